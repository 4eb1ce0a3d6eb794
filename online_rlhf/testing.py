"""Tiny random models for tests and quick local runs (seconds to build, no network).

``make_tiny_tokenizer`` trains a byte-level BPE on a small built-in corpus, so any text
(non-ASCII included) encodes; it has a ChatML chat template and ``<|im_end|>`` as eos/pad.
``make_qwen2_style_tokenizer`` builds one like Qwen2's (newlines merge across the prompt/response
boundary; eos ``<|endoftext|>`` is not the ChatML turn terminator ``<|im_end|>``).
``make_tiny_policy`` saves a 2-layer Llama causal LM with that tokenizer (vLLM and TRL load it);
``make_tiny_reward_model`` saves a 1-label ``LlamaForSequenceClassification``.
``chatml_reference_ids`` builds the token ids of a ChatML conversation piece by piece (marker ids
+ each text tokenized alone, special-token strings as text), the reference the token-id tests
compare the stages with.
"""

from __future__ import annotations

import os
from pathlib import Path

CHATML_TEMPLATE = (
    "{% if bos_token_in_template %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea. Answer in exactly three sentences.",
    "What is 12 plus 30? The answer is 42.",
    "Please respond in lowercase letters only, and end with a question?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: , . ; : ! ? - ( ) [ ] { } # * \" '",
    "Über café naïve — 日本語 テキスト — emoji 🙂 — Ελληνικά — русский текст.",
    "system user assistant: You are a helpful assistant.",
]


def make_tiny_tokenizer(bos_in_template: bool = False, vocab_size: int = 512, padding_side: str = "left"):
    """A ``PreTrainedTokenizerFast`` with ChatML; bos ``<|bos|>`` (id 0), eos = pad = ``<|im_end|>``.

    ``bos_in_template=True`` makes the chat template write the BOS token itself (like Llama-3),
    the case where adding special tokens again would double it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # Prepend BOS when encoding with special tokens, as Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                       special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    template = CHATML_TEMPLATE.replace("bos_token_in_template", "true" if bos_in_template else "false")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>",
                                 pad_token="<|im_end|>", unk_token="<|unk|>", padding_side=padding_side,
                                 model_max_length=4096)
    hf.chat_template = template
    return hf


# Qwen2's pre-tokenizer split (tokenizer.json of the Qwen2/2.5/3 checkpoints): a run of newlines
# (with the spaces before it) is one piece, so "\n" + "\n" across the prompt/response boundary
# becomes one piece, and one token once BPE has merged "\u010a\u010a".
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def make_qwen2_style_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` built like Qwen2's, trained here (no hub).

    Qwen2's split regex (:data:`QWEN2_SPLIT`) then byte-level without its own regex; specials
    ``<|endoftext|>`` (eos = pad, as in the Qwen base checkpoints), ``<|im_start|>``, ``<|im_end|>``
    (the ChatML turn terminator, not the eos); no BOS; the ChatML template. Its vocabulary has the
    ``"\n\n"`` token, so a generation prompt ending ``"\n"`` followed by a response starting
    ``"\n"`` tokenizes to one merged token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([t + "\n\n" for t in _CORPUS] * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                 padding_side="left", model_max_length=4096)
    hf.chat_template = CHATML_TEMPLATE.replace("bos_token_in_template", "false")
    assert len(hf("x\n\ny", add_special_tokens=False)["input_ids"]) == 3, "no merged newline token"
    return hf


def chatml_reference_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                         bos: bool = False, system_default: str | None = None) -> list[int]:
    """Token ids of a ChatML conversation built piece by piece, independently of the stages' code.

    Each turn is ``<|im_start|>`` id + ``tokenizer(role + "\n")`` + ``tokenizer(content,
    split_special_tokens=True)`` + ``<|im_end|>`` id + ``tokenizer("\n")``; the generation prompt is
    ``<|im_start|>`` id + ``tokenizer("assistant\n")``. Texts are encoded without special tokens.
    Matches the real template's tokenization when each content starts with a non-space character
    (then the byte-level pre-tokenizer splits at the newline anyway).

    Args:
        tokenizer: a tokenizer with ``<|im_start|>`` and ``<|im_end|>`` special tokens.
        messages: ``[{role, content}]``.
        add_generation_prompt: append the assistant header.
        bos: put ``tokenizer.bos_token_id`` first.
        system_default: a system message inserted first when the first message is not a system one
            (SmolLM2's template does this).
    Returns:
        list of int token ids.
    """
    start, end = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")

    def text(t: str) -> list[int]:
        return list(tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if t else []

    if system_default is not None and messages and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_default}] + list(messages)
    ids = [tokenizer.bos_token_id] if bos else []
    for m in messages:
        ids += [start] + text(m["role"] + "\n") + text(m["content"]) + [end] + text("\n")
    if add_generation_prompt:
        ids += [start] + text("assistant\n")
    return ids


def _llama_config(tokenizer, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=kw.pop("hidden_size", 128), intermediate_size=kw.pop("intermediate_size", 256),
        num_hidden_layers=kw.pop("num_hidden_layers", 2), num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=kw.pop("max_position_embeddings", 2048), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **kw,
    )


def make_tiny_policy(out_dir: str | os.PathLike, seed: int = 0, bos_in_template: bool = False, tokenizer=None,
                     **config_kw) -> Path:
    """Save a random 2-layer Llama causal LM (+ tokenizer, chat template, generation_config) to ``out_dir``.

    Hidden size 128 with 4 heads: head_dim 32, the smallest vLLM's CPU attention supports (16 fails).
    ``tokenizer`` replaces the tiny tokenizer (e.g. :func:`make_qwen2_style_tokenizer`).
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    out = Path(out_dir)
    tok = tokenizer if tokenizer is not None else make_tiny_tokenizer(bos_in_template=bos_in_template)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tok, **config_kw))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id],
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_tiny_reward_model(out_dir: str | os.PathLike, seed: int = 0, padding_side: str = "right",
                           pad_equals_eos: bool = True, bos_in_template: bool = False, tokenizer=None) -> Path:
    """Save a random 1-label ``LlamaForSequenceClassification`` reward model to ``out_dir``.

    ``pad_equals_eos=False`` gives the tokenizer a distinct ``<|unk|>`` pad token; ``tokenizer``
    replaces the tiny tokenizer (e.g. :func:`make_qwen2_style_tokenizer`; the other options then
    do not apply to it).
    """
    import torch
    from transformers import LlamaForSequenceClassification

    out = Path(out_dir)
    tok = tokenizer if tokenizer is not None else make_tiny_tokenizer(bos_in_template=bos_in_template,
                                                                      padding_side=padding_side)
    if not pad_equals_eos and tokenizer is None:
        tok.pad_token = "<|unk|>"
    torch.manual_seed(seed)
    cfg = _llama_config(tok, num_labels=1)
    cfg.pad_token_id = tok.pad_token_id
    model = LlamaForSequenceClassification(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for test servers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class serve_in_thread:
    """Run an ASGI app (e.g. FastAPI) with uvicorn on 127.0.0.1 in a background thread.

    ``with serve_in_thread(app) as url: ...`` gives ``http://127.0.0.1:PORT``; the server is
    stopped (and the thread joined) on exit. Start-up waits at most ``start_timeout_s``.
    """

    def __init__(self, app, start_timeout_s: float = 30.0):
        self.app, self.start_timeout_s = app, start_timeout_s

    def __enter__(self) -> str:
        import threading
        import time

        import uvicorn

        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.server.should_exit = True
                raise RuntimeError(f"test server on port {port} did not start within {self.start_timeout_s} s")
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def example_stats(cls, **overrides):
    """A valid instance of a stage stats class of ``online_rlhf.stats`` with small made-up values
    (every required key set), ``overrides`` replacing top-level keys: for tests that need a run
    directory's stats files without running the stages. A class without a hand-written example here
    (a new stage's) gets its defaults and a made-up value of each required field's type.

    Raises:
        KeyError: ``cls`` is not a stage stats class (``online_rlhf.stats.StageStats``).
        pydantic.ValidationError: an override of the wrong type or an unknown key.
    """
    from . import stats as S

    hw = {"device": "cpu", "dtype": "float32", "threads": 1, "processes": 1, "cpu_model": "test CPU",
          "cpu_capability": "AVX2", "cpu_native_bf16": False}
    summary = {"mean": 0.5, "std": 0.1, "min": 0.0, "max": 1.0}
    gen = {"stage": "generate", "num_shards": 1, "prompts": "prompts.jsonl", "prompts_in": 2, "skipped": {},
           "skipped_ids": {}, "records_out": 2, "responses": 4, "finish_reasons": {"stop": 4}, "empty_responses": 0,
           "generated_tokens": 40, "mean_response_tokens": 10.0, "prompts_all_distinct": 2,
           "mean_distinct_responses": 2.0, "prompts_fewer_than_2_distinct": 0, "warnings": [],
           "input_fields_replaced": {}, "special_token_text": {"prompts": 0, "responses": 0},
           "response_ids_differ_from_text": 0, "k": 2, "engine_startup_s": 5.0, "generation_s": 10.0,
           "generated_tokens_per_s": 4.0, "model": "model"}
    shard = {"shard_index": 0, "shard_prompts": 2, "records_out": 2, "skipped": {}, "engine_startup_s": 5.0,
             "generation_s": 10.0, "generated_tokens_per_s": 4.0, "hardware": hw}
    examples = {
        S.GenerateShardStats: {**gen, "shard_index": 0, "config_fingerprint": "0" * 16, "shard_prompts": 2,
                               "max_prompt_tokens": 100, "hardware": hw},
        S.GenerateStats: {**gen, "hardware": hw, "shards": [shard]},
        S.RewardStats: {"stage": "get_rewards", "input": "generated.jsonl", "output": "rewards.jsonl",
                        "source": "verifier", "records_in": 2, "records_scored": 2, "records_skipped": 0,
                        "skipped": {}, "responses_scored": 4, "responses_unscored": {}, "examples": {},
                        "truncated_inputs": 0, "reward": summary, "records_all_tied": 0, "source_stats": {},
                        "warnings": [], "num_processes": 1, "hardware": None, "seconds": 1.0},
        S.PairsStats: {"stage": "make_pairs", "input": "rewards.jsonl", "output": "pairs.jsonl", "records_in": 2,
                       "pairs_out": 2, "skipped": {}, "skipped_examples": {}, "responses": {"total": 4},
                       "prompts_fewer_than_2_distinct": 0, "warnings": [], "reward": summary,
                       "chosen_reward_mean": 1.0, "rejected_reward_mean": 0.0, "margin_mean": 1.0,
                       "strategy": "max_min", "min_margin": 0.0, "truncation": {"policy": "exclude", "penalty": None},
                       "seed": 42, "seconds": 0.5},
        S.DPOStats: {"stage": "dpo", "policy": "policy", "reference": {"source": "policy", "path": "policy",
                     "precomputed_log_probs": True, "lora_adapter_disabled": False},
                     "pairs_file": "pairs.jsonl", "pairs_in": 2, "pairs_used": 2, "pairs_dropped": {},
                     "dropped_examples": {}, "truncation": {}, "special_token_text": {"prompts": 0, "chosen": 0, "rejected": 0},
                     "loss_type": ["sigmoid"], "beta": 0.1, "learning_rate": 5e-5, "dtype": {}, "lora": None,
                     "hardware": hw, "num_processes": 1, "deepspeed_zero_stage": None, "steps": 1,
                     "train_loss_mean": 0.69, "history": [], "train_loss_first": 0.69, "train_loss_last": 0.69,
                     "rewards_accuracies_first": 0.0, "rewards_accuracies_last": 0.0, "rewards_margins_first": 0.0,
                     "rewards_margins_last": 0.0, "output_dir": "model",
                     "seconds": {"total": 10.0, "model_loading": 1.0, "trainer_init": 2.0, "reference_precompute": 1.0,
                                 "train_steps": 5.0, "save": 1.0}},
        S.GRPOStats: {"stage": "grpo", "policy": "policy", "reference": {"source": "policy", "path": "policy"},
                      "rewards_file": "rewards.jsonl", "groups_in": 2, "groups_used": 1, "groups_skipped": {"all_equal": 1},
                      "skipped_examples": {"all_equal": ["p1"]}, "completions_used": 2, "completions_masked": {},
                      "completions_cut": 0, "reward_mean": 0.5, "reward_mean_all": 0.5, "advantage_abs_mean": 0.7,
                      "loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2,
                      "learning_rate": 1e-6, "num_iterations": 1, "steps": 1, "loss_first": 0.1, "loss_last": 0.1,
                      "kl_last": None, "clip_fraction_mean": 0.0, "ratio_first_step_max_dev": 0.0, "history": [],
                      "dtype": {}, "hardware": hw, "num_processes": 1, "deepspeed_zero_stage": None, "output_dir": "model",
                      "seconds": {"total": 10.0, "model_loading": 1.0, "old_log_probs": 1.0, "train_steps": 5.0,
                                  "save": 1.0}},
        S.SFTStats: {"stage": "sft", "base_model": "base", "dataset": "sft.jsonl", "output_dir": "model",
                     "axolotl_config": "model.axolotl.yaml", "rows_in": 2, "rows_used": 2, "dropped": {}, "steps": 1,
                     "train_loss_first": 1.0, "train_loss_last": 1.0, "train_losses": [1.0], "train_runtime_s": 1.0,
                     "seconds_per_step": 1.0, "wall_seconds": 5.0, "launcher": "python", "sequence_len": 512,
                     "special_token_text": {"rows": 0, "messages": {}}, "hardware": hw, "removed_from_checkpoint": [],
                     "chat_template_from": "trained checkpoint", "generation_config_from": "base model",
                     "eos_token": "<|im_end|>", "eos_token_id": 2, "pad_token_id": 2},
        S.SFTDataStats: {"stage": "build_sft_data", "rewards": "rewards.jsonl", "output": "sft.jsonl", "min_reward": 1.0,
                         "truncated": "exclude", "prompts_in": 2, "kept": 1, "dropped": {"below_min_reward": 1},
                         "dropped_examples": {}, "responses_excluded": {}, "kept_reward_mean": 1.0},
        S.IFEvalStats: {"stage": "ifeval_score", "input": "ifeval_generated.jsonl", "output": "ifeval.jsonl",
                        "records_in": 2, "records_scored": 2, "skipped": {}, "skipped_ids": {}, "instructions": 3,
                        "prompt_strict": 0.5, "prompt_loose": 0.5, "instruction_strict": 0.6667,
                        "instruction_loose": 0.6667, "mean_response_tokens": 10.0, "truncation_rate": 0.0, "seconds": 1.0},
        S.KLStats: {"stage": "kl", "input": "kl_generated.jsonl", "output": "kl.jsonl", "policy": "model",
                    "reference": "start", "records_in": 2, "samples": 2, "skipped": {}, "kl_mean": 0.5, "kl_se": 0.1, "retokenized_length_differs": 0,
                    "mean_response_tokens": 10.0, "dtype": "float32", "hardware": hw, "seconds": 1.0},
    }
    if cls in examples:
        return cls.model_validate({**examples[cls], **overrides})
    if not (isinstance(cls, type) and issubclass(cls, S.StageStats)):
        raise KeyError(f"{cls!r} is not a stage stats class of online_rlhf.stats")
    # any other stats class (a new stage's): its defaults, a made-up value of each required field's type
    made_up = {name: _made_up(f.annotation) for name, f in cls.model_fields.items() if f.is_required()}
    return cls.model_validate({**made_up, **overrides})


def _made_up(annotation):
    """A small valid value of a stats field's type: a Literal's first value, 1 / 1.0 / "x" / False, an
    empty mapping or list, None for an optional field, a nested model's own made-up values."""
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return args[0]
    if args and type(None) in args:
        return None
    if args and (origin is typing.Union or getattr(origin, "__name__", "") == "UnionType"):
        return _made_up(args[0])
    if origin is dict or annotation is dict:
        return {}
    if origin in (list, tuple) or annotation in (list, tuple):
        return []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {n: _made_up(f.annotation) for n, f in annotation.model_fields.items() if f.is_required()}
    return {bool: False, int: 1, float: 1.0, str: "x"}.get(annotation)


def constraint_prompts(path: Path, n: int, prefix: str) -> Path:
    """``n`` prompts with instruction-following constraints that short random text meets sometimes
    (so the verifier's partial credit differs between K responses and the loop's pairs exist)."""
    from .jsonl import write_jsonl

    ids = ["keywords:letter_frequency", "length_constraints:number_words", "punctuation:no_comma"]
    kwargs = [{"letter": "e", "let_frequency": 2, "let_relation": "at least"},
              {"relation": "less than", "num_words": 8}, {}]
    write_jsonl(path, [{"id": f"{prefix}{j}", "prompt": f"Say something short about topic {j}.",
                        "instruction_id_list": ids, "kwargs": kwargs} for j in range(n)])
    return path


def kill_loop_during(root: Path, args: list[str], stage_log: Path, timeout_s: float = 600) -> None:
    """Start ``bash run_loop.sh *args`` in ``root`` (the project), wait until ``stage_log`` has output
    (the stage is under way), then kill the run as a crash does: every process of it (stages run in
    process groups of their own) at once, with SIGKILL, so that no clean-up code runs. The resume
    tests of the loop (DPO, GRPO, LoRA) start from this.

    Raises:
        AssertionError: the loop ended before the stage wrote to its log (its output is in the message).
    """
    import subprocess
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["bash", "run_loop.sh", *args], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if stage_log.exists() and stage_log.stat().st_size > 0:
                time.sleep(2)
                break
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
    finally:
        proc.wait(timeout=60)
