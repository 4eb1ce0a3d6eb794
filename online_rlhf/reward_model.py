"""Bradley–Terry reward model scoring (``source=reward_model`` of annotate_data/get_rewards.py).

A reward model here is an HF ``AutoModelForSequenceClassification`` checkpoint with exactly one
label (e.g. FsfairX-LLaMA3-RM, Skywork-Reward): the scalar it outputs at the last token of
``prompt + response`` is the reward. What this module takes care of:

- **Input**: the conversation (prompt messages + one assistant message) is rendered with the
  reward model's *own* chat template and tokenizer, never by editing the policy's text. BOS
  appears exactly once whether the template writes it (Llama-3 style) or the tokenizer adds it.
  (RLHFlow strips the BOS with ``text.replace(bos, "")``, which also deletes a literal BOS string
  inside a response; rendering from messages needs no such surgery.) Message contents are
  tokenized as plain text (``online_rlhf.chat_tokens``): a response containing ``<|im_end|>`` is
  scored as the text it is, not as a turn that ends there; such items are counted
  (``special_token_text`` in the stats).
- **Truncation**: an input longer than ``max_length`` tokens loses prompt tokens from the left
  (after the BOS); the end of the response is always kept. Counted in the stats.
- **Batching**: inputs are sorted by length and padded by hand on the tokenizer's padding side,
  with an explicit attention mask and position ids. The score is read at the last *attended*
  position (the backbone's hidden state there, through the score head), so padding side and
  ``pad == eos`` do not change scores: transformers' own pooling looks for the last token that
  is not ``pad_token_id``, which is wrong when the input itself ends in (or contains) that id.
- **Data parallel**: under ``accelerate launch`` with N processes, each process scores a
  contiguous slice of the (record, response) items; results are gathered back in input order.
  On CPU: ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 ...``.
- **dtype** ``auto``: :func:`online_rlhf.hardware.compute_dtype` (bf16 on GPUs that have it,
  else fp16; on CPU bf16 only with native bf16, else fp32). Threads: the usable cores split
  between the processes (``OMP_NUM_THREADS`` wins). The score head (a one-row linear layer) runs
  in float32 on the pooled hidden state whatever the dtype: in bf16 its output would keep 8
  significant bits, so rewards near 5 would come in steps of 0.03 and tie where they differ. In
  bf16/fp16 an input's padded width is its own length rounded up to 64 (:meth:`RewardModel.score_ids`),
  so its reward does not depend on the inputs batched with it.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

from .chat_tokens import (PROMPT_RENDERED_DIFFERENTLY, ChatTokenError, chat_token_ids, count_special_texts,
                          messages_have_special_text, prompt_response_ids)
from .config import ConfigError
from .stats import ScoreResult

# Reasons an item (one prompt + response) cannot be scored; a record with any such item is skipped.
# (chat_template_error includes chat_tokens.ChatTokenError: a content holding a special-token string that
# the template rewrites beyond stripping whitespace, so it cannot be tokenized as text.)
REASON_TEMPLATE = "chat_template_error"


def resolve_dtype(dtype: str, device_type: str):
    """The torch dtype of :func:`online_rlhf.hardware.compute_dtype` (``auto`` follows the hardware)."""
    import torch

    from .hardware import compute_dtype

    return getattr(torch, compute_dtype(device_type, dtype))


def check_reward_model_config(path: str) -> None:
    """Refuse, from its config alone (no weights loaded), a checkpoint that is not a one-label
    sequence-classification model. ``path``: a local folder or a Hub id (as
    :func:`online_rlhf.paths.resolve_model` returns it).

    Raises:
        ConfigError: a local folder without ``config.json``; a checkpoint saved as another
            architecture (``*ForCausalLM``: loading it would add a random score head); a head with
            ``num_labels`` other than 1.
    """
    from transformers import AutoConfig

    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"reward_model={path} has no config.json: it is not a saved model folder. Give the folder a reward "
            "model was saved to (save_pretrained of a *ForSequenceClassification with num_labels=1, and its tokenizer)."
        )
    config = AutoConfig.from_pretrained(path)
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"reward_model={path} is a {', '.join(archs)} checkpoint, not a reward model: loading it as "
            "AutoModelForSequenceClassification would add a randomly initialised score head. Give a checkpoint "
            "saved as *ForSequenceClassification with num_labels=1 (a Bradley-Terry reward model)."
        )
    if config.num_labels != 1:
        raise ConfigError(
            f"reward_model={path} has num_labels={config.num_labels}; a Bradley-Terry reward model has exactly "
            "one label (one scalar score per input). Multi-label/classifier heads are not supported."
        )


class RewardModel:
    """A loaded one-label reward model with its tokenizer, ready to score (prompt, response) pairs.

    Args:
        path: checkpoint dir or Hub id of an ``AutoModelForSequenceClassification`` with one label,
            a tokenizer and a chat template.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16`` (auto: see :func:`resolve_dtype`).
        device: torch device (default: CUDA if available, else CPU).
        max_length: input budget in tokens (capped at the model's ``max_position_embeddings``).
        pad_multiple: ``auto`` (64 in bf16/fp16, None in float32), None, or a whole number: a batch
            holds only inputs of one length rounded up to it, padded to that width; None: a batch
            is padded to its longest input (see :meth:`score_ids`).
    Raises:
        ConfigError: not a one-label sequence-classification checkpoint (a score head would be
            freshly, randomly initialised), or the tokenizer has no chat template.
    """

    def __init__(self, path: str, dtype: str = "auto", device: Any = None, max_length: int = 4096,
                 pad_multiple: int | str | None = "auto"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from .paths import REWARD_MODEL_HINT, resolve_model

        self.path = resolve_model(str(path), hint=REWARD_MODEL_HINT)  # a missing local dir: a clear FileNotFoundError
        check_reward_model_config(self.path)
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(dtype, self.device.type)
        if pad_multiple == "auto":
            pad_multiple = 64 if self.dtype in (torch.bfloat16, torch.float16) else None
        if pad_multiple is not None and (isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int)
                                         or pad_multiple < 1):
            raise ConfigError(f"pad_multiple={pad_multiple!r}: give auto, None or a whole number >= 1.")
        self.pad_multiple = pad_multiple
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if not self.tokenizer.chat_template:
            raise ConfigError(
                f"reward_model={self.path}: its tokenizer has no chat template, so the prompt and response cannot be "
                "rendered the way the reward model was trained. Add the model's chat_template to tokenizer_config.json."
            )
        model, info = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=self.dtype, output_loading_info=True)
        missing = list(info.get("missing_keys") or [])
        if missing:
            raise ConfigError(
                f"reward_model={self.path}: weights missing from the checkpoint ({', '.join(sorted(missing)[:5])}); they "
                "would be random. Save the reward model (with its score head) before scoring it."
            )
        self.model = model.to(self.device).eval()
        n_pos = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.max_length = min(max_length, n_pos) if n_pos else max_length
        tok = self.tokenizer
        self.bos_id: Optional[int] = tok.bos_token_id
        # Does the tokenizer put BOS in front by itself (add_special_tokens=True)? Then we add it when
        # the chat template did not write it; if the template wrote it, we must not add a second one.
        with_sp = tok("x", add_special_tokens=True)["input_ids"]
        without = tok("x", add_special_tokens=False)["input_ids"]
        self.tokenizer_adds_bos = self.bos_id is not None and with_sp[:1] == [self.bos_id] and without[:1] != [self.bos_id]
        # Padding id: any id works (it is masked out), but keep the tokenizer's when it has one.
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.padding_side = tok.padding_side or "right"
        self.exact_head = self._check_head()
        if not self.exact_head:
            # Inputs are then scored one at a time without padding: make transformers read the last
            # position instead of the last token != pad_token_id (wrong when the input ends in pad == eos).
            self.model.config.get_text_config().pad_token_id = None
            self.model.config.pad_token_id = None

    # -- input -------------------------------------------------------------------------------
    def encode(self, prompt: list[dict], response: str) -> tuple[list[int], dict]:
        """Token ids of ``prompt + [assistant: response]`` rendered with the RM's chat template.

        ``online_rlhf.chat_tokens.prompt_response_ids``, the rule of every tokenizing stage: prompt
        ids with the generation prompt, then the response's ids (its text on its own where the
        tokenizer would merge it with the prompt's last token, e.g. Qwen2's ``"\\n"`` + ``"\\n"``), so
        the RM scores the ids the policy produced; the whole conversation's ids when the template
        writes the prompt differently once a response follows. Only the template's own markers are
        special ids; a special-token string inside the prompt or the response is tokenized as text.

        Returns:
            (ids, info): ``ids`` has at most ``max_length`` ids with BOS exactly once (when the
            model uses one); ``info`` = ``{"truncated": bool, "response_truncated": bool}``
            (``response_truncated``: even the whole prompt was not enough, response tokens were cut
            from its start).
        Raises:
            chat_tokens.ChatTokenError: a content holds a special-token string and the template rewrites
                contents beyond stripping whitespace.
            jinja2 / ValueError from the chat template on messages it refuses.
        """
        response_msgs = [{"role": "assistant", "content": response}]
        try:
            prompt_ids, (response_ids,) = prompt_response_ids(self.tokenizer, list(prompt), response_msgs)
            ids, n_prompt = prompt_ids + response_ids, len(prompt_ids)
        except ChatTokenError as e:
            if e.reason != PROMPT_RENDERED_DIFFERENTLY:
                raise
            # the RM needs no split: the whole conversation as its template writes it
            ids, n_prompt = chat_token_ids(self.tokenizer, list(prompt) + response_msgs), None
        info = {"truncated": False, "response_truncated": False}
        if len(ids) <= self.max_length:
            return ids, info
        head = 1 if self.bos_id is not None and ids[:1] == [self.bos_id] else 0
        drop = len(ids) - self.max_length
        info["truncated"] = True
        if n_prompt is not None:
            info["response_truncated"] = head + drop > n_prompt
        return ids[:head] + ids[head + drop:], info

    def _ids(self, text: str) -> list[int]:
        """Ids of a plain text (no chat template), BOS first when the tokenizer adds one."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.tokenizer_adds_bos and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    # -- forward -----------------------------------------------------------------------------
    def _check_head(self) -> bool:
        """True when ``score(backbone(x)[last])`` reproduces the model's own output (Llama, Qwen, Mistral,
        Gemma, GPT-2 ... ``*ForSequenceClassification``); then batches are scored exactly at the last attended
        token. Otherwise every input is scored alone (no padding), which is exact but slower."""
        import torch

        head = getattr(self.model, "score", None)
        backbone = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        if not isinstance(head, torch.nn.Linear) or backbone is None:
            print(f"warning: reward model {self.path}: unknown head layout; scoring inputs one at a time.", file=sys.stderr)
            return False
        ids = [i for i in self._ids("Hello, how are you?") if i != self.pad_id][:8]
        x = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            ref = self.model(input_ids=x).logits[0, 0].float()
            mine = self._scores_exact(x, torch.ones_like(x))[0]
        # the model's own output is rounded to its dtype (bf16: 8 significant bits), ours is not
        rtol = max(1e-3, torch.finfo(self.dtype).eps)
        if not torch.allclose(ref, mine, rtol=rtol, atol=1e-3):
            print(f"warning: reward model {self.path}: score head check failed ({ref.item()} vs {mine.item()}); "
                  "scoring inputs one at a time.", file=sys.stderr)
            return False
        return True

    def _scores_exact(self, input_ids, attention_mask):
        import torch

        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (attention_mask * positions).argmax(-1)  # last attended position, whichever side is padded
        pooled = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]
        head = self.model.score  # a one-row Linear, applied in float32 (see the module docstring)
        bias = head.bias.float() if head.bias is not None else None
        return torch.nn.functional.linear(pooled.float(), head.weight.float(), bias)[:, 0]

    def score_ids(self, seqs: Sequence[list[int]], batch_size: int = 8, progress: bool = False) -> list[float]:
        """Reward of each token-id sequence (list of floats, input order).

        Sequences are sorted longest first and scored up to ``batch_size`` at a time, padded on the
        tokenizer's padding side. With ``pad_multiple`` m (bf16/fp16 by default) a batch holds only
        sequences of one length rounded up to m and is padded to that width: a sequence's padded
        width depends on its own length alone, never on the others scored with it, so its reward is
        the same batched as alone, or in a reward service's batch merged from other requests (in
        bf16 a wider padded row changes the last bits: ~1e-3 of rewards ~0.5 on a tiny model).
        Without (float32 by default) a batch is padded to its longest sequence; batched and
        one-by-one scores then agree within float32 tolerance (~1e-7).
        """
        import torch

        n = len(seqs)
        out: list[float] = [0.0] * n
        m = self.pad_multiple if self.exact_head else None  # without the exact head nothing is padded

        def width_of(i: int) -> int | None:  # the padded width a sequence needs; None: any batch's
            return -(-len(seqs[i]) // m) * m if m else None

        order = sorted(range(n), key=lambda i: -len(seqs[i]))
        bs = batch_size if self.exact_head else 1
        batches: list[list[int]] = []
        for i in order:  # consecutive runs of one padded width, cut every bs sequences
            if batches and len(batches[-1]) < bs and width_of(batches[-1][0]) == width_of(i):
                batches[-1].append(i)
            else:
                batches.append([i])
        if progress:
            from tqdm import tqdm

            batches = tqdm(batches, desc="reward model", unit="batch")
        with torch.inference_mode():
            for idx in batches:
                width = width_of(idx[0]) or len(seqs[idx[0]])  # idx[0]: the batch's longest
                input_ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for r, i in enumerate(idx):
                    s = torch.tensor(seqs[i], dtype=torch.long)
                    sl = slice(width - len(s), width) if self.padding_side == "left" else slice(0, len(s))
                    input_ids[r, sl] = s
                    mask[r, sl] = 1
                input_ids, mask = input_ids.to(self.device), mask.to(self.device)
                if self.exact_head:
                    scores = self._scores_exact(input_ids, mask)
                else:
                    scores = self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float()
                for r, i in enumerate(idx):
                    out[i] = float(scores[r])
        return out

    def score(self, prompts: Sequence[list[dict]], responses: Sequence[str], batch_size: int = 8,
              progress: bool = False) -> tuple[list[Optional[float]], dict]:
        """Score ``responses[i]`` as the answer to ``prompts[i]`` (message lists).

        Returns:
            (rewards, stats): one float per item, ``None`` where the chat template refused the
            messages; stats = ``{"items": n, "truncated_inputs": n, "response_truncated": n,
            "skipped_items": {reason: n}, "special_token_text": {"prompts": n, "responses": n}}``
            (``special_token_text`` counts items whose prompt, resp. response, contains a
            special-token string of the RM's tokenizer; they are scored as text).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses; they must pair up one to one.")
        stats = {"items": len(prompts), "truncated_inputs": 0, "response_truncated": 0, "skipped_items": {},
                 "special_token_text": {
                     "prompts": sum(1 for p in prompts if messages_have_special_text(self.tokenizer, p)),
                     "responses": count_special_texts(self.tokenizer, responses)}}
        seqs, where = [], []
        rewards: list[Optional[float]] = [None] * len(prompts)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                ids, info = self.encode(p, r)
            except Exception as e:  # jinja2.TemplateError, ValueError (ChatTokenError): the template refuses these messages
                stats["skipped_items"][REASON_TEMPLATE] = stats["skipped_items"].get(REASON_TEMPLATE, 0) + 1
                if stats["skipped_items"][REASON_TEMPLATE] == 1:
                    print(f"warning: reward model chat template refused an input ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            stats["truncated_inputs"] += info["truncated"]
            stats["response_truncated"] += info["response_truncated"]
            seqs.append(ids)
            where.append(i)
        for i, s in zip(where, self.score_ids(seqs, batch_size, progress)):
            rewards[i] = s
        return rewards, stats


def distributed_state():
    """accelerate's ``PartialState``, in CPU mode when there is no GPU or ``ACCELERATE_USE_CPU`` is set.

    ``PartialState()`` alone ignores ``ACCELERATE_USE_CPU``: on a CPU machine every process of
    ``accelerate launch --num_processes 2`` would then be a rank 0 scoring everything (duplicated work).
    """
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU"))


def score(records: list[dict], cfg) -> ScoreResult:
    """``source=reward_model``: one reward per response of each generated record.

    Runs data-parallel when started by ``accelerate launch`` with N processes: every process must
    call this with the same ``records``; each scores a contiguous slice of the (record, response)
    items and all processes return the full, input-ordered result.

    Args:
        records: generated records (``prompt``: messages, ``responses``: K strings).
        cfg: ``RewardConfig`` (``reward_model``, ``batch_size``, ``max_length``, ``dtype``).
    Returns:
        :class:`~online_rlhf.stats.ScoreResult`: ``rewards[i]`` is a list of K floats aligned with
        ``records[i]["responses"]``, or ``None`` when one of its inputs could not be rendered
        (counted in ``skipped``); ``truncated_inputs``; ``hardware``; ``source_stats`` holds
        ``response_truncated``, ``num_processes``, ``dtype``, ``batch_size``, ``max_length``,
        ``exact_batched_pooling`` and ``special_token_text`` = ``{"prompts": records whose prompt holds
        a special-token string of the RM's tokenizer, "responses": such responses}`` (scored as text,
        not dropped).
    """
    import torch
    from accelerate.utils import gather_object

    from .hardware import describe, processes_here, stage_threads

    state = distributed_state()
    if state.device.type == "cpu":
        torch.set_num_threads(stage_threads(processes_here(state.num_processes)))
    rm = RewardModel(cfg.reward_model, dtype=cfg.dtype, device=state.device, max_length=cfg.max_length)
    items = [(ri, j) for ri, rec in enumerate(records) for j in range(len(rec["responses"]))]
    with state.split_between_processes(items) as mine:
        mine = list(mine)
    local, local_stats = rm.score([records[ri]["prompt"] for ri, _ in mine],
                                  [records[ri]["responses"][j] for ri, j in mine],
                                  batch_size=cfg.batch_size, progress=state.is_main_process)
    if state.num_processes > 1:
        flat = gather_object(local)
        all_stats = gather_object([local_stats])
    else:
        flat, all_stats = local, [local_stats]
    if len(flat) != len(items):
        raise RuntimeError(f"gathered {len(flat)} rewards for {len(items)} responses; processes disagree on the input.")
    out: list[Optional[list[float]]] = [[] for _ in records]
    for (ri, _), r in zip(items, flat):
        if out[ri] is not None:
            out[ri] = None if r is None else out[ri] + [r]
    source_stats: dict[str, Any] = {
        "response_truncated": sum(st["response_truncated"] for st in all_stats),
        "num_processes": state.num_processes, "dtype": str(rm.dtype).replace("torch.", ""),
        "batch_size": cfg.batch_size if rm.exact_head else 1, "max_length": rm.max_length,
        "exact_batched_pooling": rm.exact_head,
        "special_token_text": {
            "prompts": sum(1 for rec in records if messages_have_special_text(rm.tokenizer, rec["prompt"])),
            "responses": count_special_texts(rm.tokenizer, (x for rec in records for x in rec["responses"]))}}
    special = source_stats["special_token_text"]
    if state.is_main_process and any(special.values()):
        print(f"reward model: special-token strings scored as text in {special['prompts']} prompts and "
              f"{special['responses']} responses.", file=sys.stderr)
    n_bad = sum(1 for r in out if r is None)
    return ScoreResult(rewards=out, skipped=Counter({REASON_TEMPLATE: n_bad} if n_bad else {}),
                       truncated_inputs=sum(st["truncated_inputs"] for st in all_stats),
                       hardware=describe(rm.device.type, str(rm.dtype).replace("torch.", ""),
                                         processes=state.num_processes),
                       source_stats=source_stats)
