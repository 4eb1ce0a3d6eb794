"""Typed configs of every stage, importable without torch/vLLM so that a whole loop config can be
validated dry (no model loaded). Each stage script builds its config with ``Cls.from_cli()``. The
loop config, whose sections these classes type, is ``online_rlhf.loop_config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from .config import StageConfig
from .dpo_loss import project_only_loss_types
from .pairs import Strategy
from .records import RewardSource
from .stats import stats_path

# transformers' attention implementations the policy stages take by name (a Hub kernel is named
# "owner/repo"); flash_attention_2/3 need a CUDA GPU and their package (checked at load time)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def _known_attn(value: str) -> str:
    if value in ATTN_IMPLEMENTATIONS or "/" in value:
        return value
    raise ValueError(f"unknown attention implementation {value!r}: one of {', '.join(ATTN_IMPLEMENTATIONS)} "
                     f"(or a Hub kernel named owner/repo)")


AttnImplementation = Annotated[str, AfterValidator(_known_attn)]

# The largest seed a stage or the loop takes. numpy (which vLLM and transformers' set_seed seed)
# refuses anything outside 0..2**32 - 1, and the loop adds 1000 x iteration and the shard index.
SEED_MAX = 2**31 - 1

LaunchProfile = Literal["cpu", "zero2", "zero3"]
_MACHINES_DOC = ("machines the stage's processes span (`accelerate launch --num_machines`); num_processes counts the "
                 "processes of all machines together. The loop's plan sets it")
_IP_DOC = "num_machines > 1: address of machine 0 that the others reach (`--main_process_ip`). The loop's plan sets it"
_PORT_DOC = "num_machines > 1: port on machine 0 for the processes' rendezvous (`--main_process_port`). The loop's plan sets it"
_PROCESSES_DOC = ("processes the stage runs as (`accelerate launch --num_processes`); the stage refuses to start "
                  "under another count, since it changes the batch split. null: as launched. The loop's plan sets it")
_PROFILE_DOC = ("how the loop launches the stage: configs/accelerate/<profile>.yaml (cpu: plain processes over gloo; "
                "zero2/zero3: DeepSpeed on GPUs). Ignored when you start the script yourself")

# The five launch fields of a stage started by `accelerate launch` (rewards, DPO, GRPO), each declared
# once: type, default, bounds and description. Each such class names all five (a base class would put
# them first in its stage YAML, whose key order is the class's field order), checks them with
# :func:`check_machines`, and may add to a description (rewards: "reward_model: ...");
# tests/test_stage_table.py checks that every class with one has all five, as declared here.
NumProcesses = Annotated[Optional[int], Field(None, ge=1, description=_PROCESSES_DOC)]
LaunchProfileKey = Annotated[LaunchProfile, Field("cpu", description=_PROFILE_DOC)]
NumMachines = Annotated[int, Field(1, ge=1, description=_MACHINES_DOC)]
MainProcessIp = Annotated[Optional[str], Field(None, description=_IP_DOC)]
MainProcessPort = Annotated[Optional[int], Field(None, ge=1, le=65535, description=_PORT_DOC)]
LAUNCH_FIELDS = {"num_processes": NumProcesses, "launch_profile": LaunchProfileKey, "num_machines": NumMachines,
                 "main_process_ip": MainProcessIp, "main_process_port": MainProcessPort}


def check_machines(num_machines: int, num_processes: Optional[int], main_process_ip: Optional[str]) -> None:
    """The multi-machine settings of an ``accelerate launch`` stage (or of the loop), checked together.

    Args:
        num_machines: machines the processes span.
        num_processes: processes over all machines (None: not fixed yet, e.g. ``auto``).
        main_process_ip: address of machine 0.
    Raises:
        ValueError: ``num_machines > 1`` without ``main_process_ip``, or ``num_processes`` that is not a
            multiple of ``num_machines`` (every machine runs ``num_processes / num_machines`` of them).
    """
    if num_machines > 1 and not main_process_ip:
        raise ValueError(f"num_machines={num_machines} needs main_process_ip=<address of machine 0 that every "
                         "machine can reach>")
    if main_process_ip and (any(c.isspace() for c in main_process_ip) or any(c in main_process_ip for c in ";:'\"/")):
        raise ValueError(f"main_process_ip={main_process_ip!r} must be one host name or IPv4 address, without a port "
                         "(set main_process_port) or spaces")
    if num_processes is not None and num_processes % num_machines:
        raise ValueError(f"num_processes={num_processes} is the process count over all {num_machines} machines and "
                         f"must be a multiple of num_machines={num_machines} (each machine runs the same number)")


def check_output_is_not_a_model(output_dir: str, **models: Optional[str]) -> None:
    """A trained policy is never saved over the checkpoint it was trained from (the DPO and GRPO
    stages' ``output_dir`` against their ``policy`` and ``reference``).

    Args:
        output_dir: where the stage saves.  models: ``{key: checkpoint path or None}``, in message order.
    Raises:
        ValueError: ``output_dir`` is an existing one of ``models``, naming its key.
    """
    out = Path(output_dir).expanduser().resolve()
    for name, src in models.items():
        if src and Path(src).expanduser().exists() and Path(src).expanduser().resolve() == out:
            raise ValueError(f"output_dir={output_dir} is the {name} checkpoint; saving there would replace it. "
                             "Write the trained policy to another folder")


def check_lora_keys(lora: Optional[dict], adapter: Optional[str], save_adapter: bool, launch_profile: str) -> None:
    """The LoRA keys of an update stage (DPO, GRPO), checked together before any weight is loaded.

    Raises:
        ValueError: ``adapter`` or ``save_adapter`` without ``lora``; ``lora`` under the ``zero3``
            profile (ZeRO-3 shards the base weights the adapter's save and merge need whole on one
            rank; this stage saves from rank 0), naming the fix.
    """
    if adapter and not lora:
        raise ValueError(f"adapter={adapter} needs lora (its r, alpha and target_modules) to continue training it; "
                         "set lora, or adapter=null to train every weight")
    if save_adapter and not lora:
        raise ValueError("save_adapter=true needs lora: without it every weight is trained and saved")
    if lora and launch_profile == "zero3":
        raise ValueError("lora with launch_profile=zero3 is refused: ZeRO-3 shards the base weights over the GPUs, and "
                         "the stage saves (or merges) the adapter from rank 0's unsharded model. Use launch_profile="
                         "zero2 (a LoRA run keeps the frozen base whole on each GPU; only the adapter trains), or "
                         "drop lora")


def _now(settings: dict, prefix: str, key: str) -> str:
    """``<prefix><key> (now <value>)``: one setting of a dry run's advice, as the loop names it."""
    return f"{prefix}{key} (now {settings.get(key)})"


def _checkpointing_advice(key: str) -> str:
    """The advice line for a stage whose gradient checkpointing is off (``key``: its full name)."""
    return f"{key}=true: recompute activations in the backward pass"


def _zero3_advice(settings: dict, device: str) -> list[str]:
    """ZeRO-3 for a training stage on GPUs that does not use it yet; nothing on CPU."""
    if device != "cuda" or settings.get("launch_profile") == "zero3":
        return []
    return [f"launch_profile=zero3 (now {settings.get('launch_profile')}): shard weights, gradients and optimizer "
            "state over the GPUs"]


class GenerateConfig(StageConfig):
    """generation/generate.py: K responses per prompt for one shard, with vLLM."""

    omit_when_default = ("adapter",)

    model: str = Field("default", description="policy checkpoint: local dir, HF Hub id, or 'default' (embedded SmolLM2-135M-Instruct)")
    adapter: Optional[str] = Field(None, description="LoRA adapter folder (peft: adapter_config.json + adapter_model.safetensors) decoded on top of `model` with vLLM's LoRA (enable_lora, a LoRARequest); null: the model alone. The loop sets it under its lora key. A `model` that is itself an adapter folder is taken as its base plus it")
    prompts: str = Field(..., description="prompt set: local .jsonl/.json/.parquet or HF Hub dataset id")
    prompt_split: str = Field("train", description="split when `prompts` is a Hub dataset")
    prompt_field: Optional[str] = Field(None, description="prompt column (text or message list) when the set has neither 'messages' nor 'prompt'")
    limit: Optional[int] = Field(None, ge=1, description="use only the first N prompts")
    output: str = Field(..., description="output JSONL of this shard (generated records)")
    shard_index: int = Field(0, ge=0, description="which shard this process writes (0-based)")
    num_shards: int = Field(1, ge=1, description="total number of shards W; shard r takes prompts r, r+W, ...")
    k: int = Field(4, ge=1, description="responses sampled per prompt (vLLM n)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_tokens: int = Field(256, ge=1, description="max new tokens per response")
    seed: int = Field(42, ge=0, le=SEED_MAX, description="engine seed (vLLM-CPU refuses per-request seeds); shard r uses seed + r")
    max_model_len: int = Field(2048, ge=16, description="context budget; prompts longer than max_model_len - max_tokens are skipped and counted")
    dtype: str = Field("auto", description="engine dtype: auto (the hardware's choice: bf16 on GPU, fp16 where bf16 is missing; on CPU bf16 only with native AVX512-BF16/AMX, else fp32), bfloat16, float16, float32")
    enforce_eager: bool = Field(True, description="skip torch.compile/CUDA graphs: faster start-up (on CPU ~23 s vs 120-250 s cold)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per shard for large models")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="GPU only: share of memory vLLM may use")
    kv_cache_gb: float = Field(2.0, gt=0.0, description="CPU only: KV cache size in GiB per shard (an explicit VLLM_CPU_KVCACHE_SPACE wins)")
    shards_dir: Optional[str] = Field(None, description="launch.py/merge_data.py: folder of shard_XX.jsonl files (default: <output> without .jsonl, e.g. generated.jsonl -> generated/)")
    save_token_ids: bool = Field(False, description="also write each record's prompt_token_ids (what the engine received) and response_token_ids (what it sampled, the stop token included): a stage that scores the sampled sequences (the kl stage) then needs no re-tokenization of the text")
    dry_run: bool = Field(False, description="memory check instead of the stage: start the engine as usual, generate one batch of dummy prompts of max_model_len - max_tokens tokens x k samples of exactly max_tokens tokens (ignore_eos), and write only <output>.dry_run.json (peak memory, seconds); no output, no stats. launch.py runs shard 0 only")
    num_machines: int = Field(1, ge=1, description="launch.py: machines M sharing the num_shards shards over a shared filesystem; machine k runs shards r with r % M == k on its own devices (set by the loop's plan)")
    machine_rank: int = Field(0, ge=0, description="launch.py: this machine's rank k (0-based); machine 0 waits for every shard file and merges, the others exit after their own shards. Given when the stage is started on a machine (loop exec ... machine_rank=k)")
    merge_wait_s: float = Field(3600.0, ge=0, description="launch.py, num_machines > 1: how long machine 0 waits for the other machines' shard files (output + stats) before it refuses, naming each missing file and its machine")

    @model_validator(mode="after")
    def _check(self):
        if self.shard_index >= self.num_shards:
            raise ValueError(f"shard_index={self.shard_index} must be < num_shards={self.num_shards} (shards are 0-based)")
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank={self.machine_rank} must be < num_machines={self.num_machines} (machines are 0-based)")
        if self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens={self.max_tokens} leaves no room for the prompt in max_model_len={self.max_model_len}")
        if Path(self.output).resolve() == Path(self.prompts).resolve():
            raise ValueError(f"output={self.output} is the prompt file; write the generated records to another file")
        if self.temperature == 0 and self.k > 1:
            raise ValueError(f"temperature=0 (greedy) gives {self.k} identical responses and vLLM refuses n>1: set k=1 or temperature>0")
        return self

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """The engine's context and KV cache first, then samples and new tokens (:meth:`StageConfig.dry_run_advice`)."""
        out = [f"{_now(settings, prefix, 'max_model_len')}: the longest prompt + response the engine must hold",
               f"{_now(settings, prefix, 'k')}: samples per prompt, each with its own KV cache"]
        if device == "cuda":
            out.append(f"{_now(settings, prefix, 'gpu_memory_utilization')}: vLLM's share of the GPU (lower it when "
                       "another process shares the device; raise it when the engine cannot fit its KV cache)")
        else:
            out.append(f"{_now(settings, prefix, 'kv_cache_gb')}: the KV cache vLLM reserves on CPU")
        out.append(f"{_now(settings, prefix, 'max_tokens')}: new tokens per response")
        return out


class RewardConfig(StageConfig):
    """annotate_data/get_rewards.py: one reward per response."""

    input: str = Field(..., description="generated.jsonl")
    output: str = Field(..., description="rewards.jsonl")
    source: RewardSource = Field("verifier", description="where rewards come from")
    # reward_model
    reward_model: Optional[str] = Field(None, description="source=reward_model: AutoModelForSequenceClassification dir or Hub id (one label)")
    batch_size: int = Field(8, ge=1, description="reward_model: inputs per forward pass (sorted by length); remote: (prompt, response) items per request")
    max_length: int = Field(4096, ge=8, description="reward model input budget in tokens; longer inputs lose prompt tokens from the left")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="reward model dtype (auto: the hardware's choice: bf16 on GPU, fp16 where bf16 is missing; on CPU bf16 only with native AVX512-BF16/AMX, else fp32)")
    # verifier
    verifier: Literal["auto", "ifeval", "math"] = Field("auto", description="auto: 'instruction_id_list' -> ifeval, 'answer' -> math")
    ifeval_mode: Literal["strict", "loose"] = Field("loose", description="ifeval: strict or loose response checking")
    ifeval_score: Literal["partial", "all"] = Field("partial", description="ifeval: fraction of instructions followed, or 1 only if all")
    # remote / judge
    url: Optional[str] = Field(None, description="remote: reward service URL; judge: OpenAI-compatible base URL")
    judge_model: Optional[str] = Field(None, description="judge: model name at the endpoint")
    timeout_s: float = Field(60.0, gt=0, description="remote/judge: per-request timeout")
    retries: int = Field(3, ge=0, description="remote/judge: retries with exponential backoff")
    retry_backoff_s: float = Field(1.0, ge=0, description="remote/judge: first retry waits this long, then 2x, 4x, ...")
    judge_max_tokens: int = Field(256, ge=1, description="judge: max tokens of the judge's reply (short reasoning + [[A]]/[[B]])")
    judge_concurrency: int = Field(8, ge=1, description="judge: requests in flight at once (the server batches them)")
    num_processes: NumProcesses = Field(description="reward_model: " + _PROCESSES_DOC + "; other sources run in one process")
    launch_profile: LaunchProfileKey = Field(description="reward_model: " + _PROFILE_DOC)
    dry_run: bool = Field(False, description="memory check instead of the stage (source=reward_model): load the model, score one batch of batch_size dummy inputs of max_length tokens, write only <output>.dry_run.json (peak memory, seconds); the input is not read. Other sources: nothing to check")
    num_machines: NumMachines = Field(description="reward_model: " + _MACHINES_DOC)
    main_process_ip: MainProcessIp = Field(description="reward_model: " + _IP_DOC)
    main_process_port: MainProcessPort = Field(description="reward_model: " + _PORT_DOC)

    @model_validator(mode="after")
    def _check(self):
        if self.source == "reward_model" and not self.reward_model:
            raise ValueError("source=reward_model needs reward_model=<dir or Hub id>")
        if self.source in ("remote", "judge") and not self.url:
            raise ValueError(f"source={self.source} needs url=<http://...>")
        if self.source == "judge" and not self.judge_model:
            raise ValueError("source=judge needs judge_model=<name>")
        if self.source != "reward_model" and (self.num_processes or 1) > 1:
            raise ValueError(f"num_processes={self.num_processes}: source={self.source} runs in one process; only "
                             "source=reward_model runs data-parallel")
        if self.source != "reward_model" and self.num_machines > 1:
            raise ValueError(f"num_machines={self.num_machines}: source={self.source} runs in one process on machine 0; "
                             "only source=reward_model runs over several machines")
        check_machines(self.num_machines, self.num_processes, self.main_process_ip)
        return self

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """The reward model's batch and input length (:meth:`StageConfig.dry_run_advice`)."""
        return [f"{_now(settings, prefix, 'batch_size')}: inputs per forward pass",
                f"{_now(settings, prefix, 'max_length')}: tokens per input"]


class PairsConfig(StageConfig):
    """annotate_data/make_pairs.py: chosen/rejected pairs from scored responses."""

    input: str = Field(..., description="rewards.jsonl")
    output: str = Field(..., description="pairs.jsonl")
    strategy: Strategy = Field("max_min", description="max_min: best vs worst (RLHFlow); max_random: best vs a random lower one; random: a random pair that differs; best_vs_rest: the best vs each lower one (up to K-1 pairs per prompt); all_pairs: every two that differ (up to K(K-1)/2)")
    min_margin: float = Field(0.0, ge=0.0, description="skip a prompt when chosen - rejected reward <= this (ties always skipped); the multi-pair strategies leave out each pair at or under it")
    max_pairs_per_prompt: Optional[int] = Field(None, ge=1, description="best_vs_rest / all_pairs: keep at most this many pairs of a prompt, largest margin first (best_vs_rest: worst rejected first); null: all")
    truncated: Literal["keep", "exclude", "penalize"] = Field("exclude", description="responses with finish_reason 'length'")
    truncated_penalty: float = Field(1.0, ge=0.0, description="penalize: subtract this from a truncated response's reward")
    seed: int = Field(42, ge=0, le=SEED_MAX, description="seed of max_random / random")

    @model_validator(mode="after")
    def _output_is_not_input(self):
        out = Path(self.output).resolve()
        if Path(self.input).resolve() in (out, stats_path(out)):
            raise ValueError(f"output={self.output} would overwrite the input rewards file; write the pairs to another file")
        if self.max_pairs_per_prompt is not None and self.strategy not in ("best_vs_rest", "all_pairs"):
            raise ValueError(f"max_pairs_per_prompt={self.max_pairs_per_prompt} caps best_vs_rest and all_pairs; "
                             f"strategy={self.strategy} makes at most one pair per prompt. Set strategy=best_vs_rest "
                             "or all_pairs, or max_pairs_per_prompt=null")
        return self


class DPOStageConfig(StageConfig):
    """dpo_iteration/run_dpo.py: TRL DPOTrainer on pairs.jsonl; saves an HF checkpoint (or a LoRA adapter)."""

    omit_when_default = ("adapter", "save_adapter")

    policy: str = Field(..., description="policy to train (dir, Hub id or 'default')")
    reference: Optional[str] = Field(None, description="reference model (dir/Hub id); None = the policy itself")
    pairs: str = Field(..., description="pairs.jsonl")
    output_dir: str = Field(..., description="where the trained checkpoint is saved")
    train_batch_size: Optional[int] = Field(None, ge=1, description="pairs per optimizer step over all processes (OpenRLHF's name); per_device_train_batch_size = this / (processes x training.gradient_accumulation_steps), so the recipe is the same on 1 or N processes. null: set training.per_device_train_batch_size instead")
    training: dict[str, Any] = Field(default_factory=dict, description="any trl.DPOConfig field (beta, loss_type, learning_rate, max_length, precompute_ref_log_probs, report_to, ...); stage defaults: bf16 from the hardware (on CPU true only with native bf16, AVX512-BF16/AMX; fp16 on a GPU without bf16), precompute_ref_log_probs=true, report_to=none")
    max_prompt_length: Optional[int] = Field(None, ge=1, description="drop (and count) pairs whose prompt has more tokens than this; TRL 1.9 has no prompt truncation. Pairs whose prompt fills training.max_length are always dropped")
    lora: Optional[dict[str, Any]] = Field(None, description="peft.LoraConfig fields: train a LoRA adapter instead of every weight; saved merged into a full checkpoint unless save_adapter is true")
    adapter: Optional[str] = Field(None, description="LoRA adapter folder to continue training (on top of `policy`, its base); null: a fresh adapter when `lora` is set. The loop sets it under its lora key. Needs `lora` (the same r and lora_alpha)")
    save_adapter: bool = Field(False, description="with `lora`: save the adapter only (adapter_config.json naming `policy` as its base + adapter_model.safetensors + tokenizer) instead of merging it into a full checkpoint. The loop sets it under its lora key; scripts/merge_lora.py merges one for export")
    attn_implementation: AttnImplementation = Field("sdpa", description="sdpa (CPU/GPU), eager, flex_attention, or flash_attention_2 (GPU with flash-attn; without a GPU or the package it is refused before any weight is loaded)")
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="policy/reference load dtype (auto: fp32 on CPU, each checkpoint's stored dtype on GPU; float16 vs bfloat16 checkpoints are refused)")
    log_probs: Literal["auto", "sequence", "side", "packed", "trl"] = Field("auto", description="how the DPO log-probs are computed: LM head and log-softmax only at completion positions (online_rlhf/completion_logps.py), each sequence unpadded (sequence), chosen and rejected padded separately (side) or all sequences of a micro-batch in one unpadded row, each attending to itself (packed; attention computed with sdpa per sequence, so only for sdpa or eager models); auto = packed on CPU with sdpa or eager attention, else side; trl = TRL's own computation (full logits, chosen and rejected padded to each other). The loss of every layout but trl is online_rlhf/dpo_loss.py's; settings it does not cover (e.g. a TRL loss type not registered there, ld_alpha) use TRL's, named in the stats")
    num_processes: NumProcesses
    launch_profile: LaunchProfileKey
    dry_run: bool = Field(False, description="memory check instead of training: load policy and reference as usual, run one optimizer step (forward + backward + optimizer step, reference log-probs included) on dummy pairs of training.max_length tokens (chosen and rejected) at the real per-device batch and accumulation, and write only <output_dir>.dry_run.json (peak memory, seconds per step); the pairs file is not read, output_dir is not touched")
    num_machines: NumMachines
    main_process_ip: MainProcessIp
    main_process_port: MainProcessPort

    @model_validator(mode="after")
    def _output_is_not_a_model(self):
        check_machines(self.num_machines, self.num_processes, self.main_process_ip)
        only_here = project_only_loss_types(self.training.get("loss_type", []))
        if self.log_probs == "trl" and only_here:
            raise ValueError(f"training.loss_type {', '.join(only_here)} is computed only by online_rlhf/dpo_loss.py, "
                             "which log_probs=trl (TRL's own _compute_loss) does not run; set log_probs=auto")
        t = self.training
        needs_trl = [name for name, on in (
            ("ld_alpha", t.get("ld_alpha") is not None), ("use_weighting", bool(t.get("use_weighting"))),
            (f"f_divergence_type={t.get('f_divergence_type')}", t.get("f_divergence_type") not in (None, "reverse_kl")),
            ("use_liger_kernel", bool(t.get("use_liger_kernel")))) if on]
        if only_here and needs_trl:  # the same refusal as the stage's at its first batch, before any stage runs
            raise ValueError(f"training.loss_type {', '.join(only_here)} is computed only by online_rlhf/dpo_loss.py in "
                             f"the stage's own log-prob layouts, and training.{needs_trl[0]} needs TRL's own "
                             "computation; drop one of them")
        check_lora_keys(self.lora, self.adapter, self.save_adapter, self.launch_profile)
        if self.lora and t.get("sync_ref_model"):
            raise ValueError("training.sync_ref_model=true with lora: under LoRA the reference is the policy's adapter "
                             "switched off (or a frozen copy of it), not a model TRL could sync (TRL refuses it for "
                             "PEFT models); drop one of them")
        check_output_is_not_a_model(self.output_dir, policy=self.policy, reference=self.reference, adapter=self.adapter)
        return self

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """The per-device batch and length first, then activations, LoRA and ZeRO-3
        (:meth:`StageConfig.dry_run_advice`)."""
        p, s = prefix, settings
        out = [f"{_now(s, p, 'training.per_device_train_batch_size')}: the pairs on a device per forward pass; raise "
               f"{p}training.gradient_accumulation_steps (now {s.get('training.gradient_accumulation_steps')}) to keep "
               f"{p}train_batch_size (now {s.get('train_batch_size')}), or lower {p}train_batch_size",
               f"{_now(s, p, 'training.max_length')}: tokens of prompt + response"]
        if not s.get("training.gradient_checkpointing"):
            out.append(_checkpointing_advice(f"{p}training.gradient_checkpointing"))
        if not s.get("lora"):
            out.append(("lora={r: 16} (the loop key; " if p == "dpo." else "") + f"{p}lora" + (")" if p == "dpo." else "")
                       + ": train a LoRA adapter instead of every weight (no full-size gradients or optimizer state)")
        return out + _zero3_advice(s, device)


class GRPOStageConfig(StageConfig):
    """grpo_iteration/run_grpo.py: group-relative policy optimization on rewards.jsonl; saves an HF checkpoint.

    The training keys carry the names, meanings and (unless said) defaults of ``trl.GRPOConfig``
    (TRL 1.9); the stage trains on the rollouts the loop already generated and scored, so TRL's
    generation keys have no place here.
    """

    omit_when_default = ("lora", "adapter", "save_adapter")

    policy: str = Field(..., description="policy to train (dir, Hub id or 'default'); it also computes the 'old' log-probs of the clipped ratio")
    reference: Optional[str] = Field(None, description="reference model of the KL penalty (dir/Hub id); None = the policy as it is before this stage. Loaded only when beta > 0")
    rewards: str = Field(..., description="rewards.jsonl: K scored responses per prompt (one group each)")
    output_dir: str = Field(..., description="where the trained checkpoint is saved")
    learning_rate: float = Field(1e-6, gt=0, description="AdamW learning rate, constant (TRL's GRPOConfig decays it linearly; a pass over one iteration's rollouts is a few steps)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    per_device_train_batch_size: int = Field(8, ge=1, description="completions per forward/backward on each process")
    gradient_accumulation_steps: int = Field(1, ge=1, description="forward/backward passes per optimizer step; an optimizer step sees per_device_train_batch_size x this x processes completions")
    num_iterations: int = Field(1, ge=1, description="passes over the iteration's rollouts (TRL's mu); the clipped ratio is taken against the log-probs of the policy before the first pass")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference model (k3 estimator); 0 = no KL term and no reference pass")
    epsilon: float = Field(0.2, gt=0, lt=1, description="clipping range of the ratio: [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = Field(None, gt=0, description="upper clipping bound (DAPO's clip-higher); None = epsilon")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field("dapo", description="how token losses are summed: grpo = mean over each completion's tokens, then over completions; bnpo = mean over the micro-batch's tokens; dr_grpo = sum / (completions x max_completion_length) (Dr. GRPO); dapo = sum / tokens of the whole optimizer step")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="advantage = reward - group mean, divided by the group's std (group, GRPO), by the std of all rewards (batch), or by nothing (none, Dr. GRPO)")
    max_completion_length: int = Field(256, ge=1, description="the generation's max new tokens: the constant divisor of loss_type=dr_grpo (the loop sets it from generation.max_tokens)")
    temperature: float = Field(1.0, gt=0, description="the sampling temperature of the rollouts: logits are divided by it before the log-probs (the loop sets it from generation.temperature)")
    mask_truncated_completions: bool = Field(False, description="leave responses cut at max_tokens (finish_reason 'length') out of the loss (DAPO); they still count in their group's mean and std")
    seed: int = Field(42, ge=0, le=SEED_MAX, description="seed of the shuffle of completions into batches")
    shuffle_dataset: bool = Field(True, description="shuffle the completions before each pass")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory, ~30% more time); TRL's default is true")
    truncated_penalty: float = Field(0.0, ge=0, description="subtracted from the reward of a response cut at max_tokens before the advantages (0 = none); the pairs stage's truncated=penalize for GRPO")
    max_length: Optional[int] = Field(None, ge=2, description="prompt + completion token budget: longer completions lose their last tokens (counted), prompts that fill it drop their group (counted); null = no cap")
    attn_implementation: AttnImplementation = Field("sdpa", description="sdpa (CPU/GPU), eager, flex_attention, or flash_attention_2 (GPU with flash-attn; without a GPU or the package it is refused before any weight is loaded)")
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="load dtype of policy and reference (auto: fp32 on CPU, the checkpoint's stored dtype on GPU)")
    lora: Optional[dict[str, Any]] = Field(None, description="peft.LoraConfig fields: train a LoRA adapter instead of every weight (AdamW over the adapter only); saved merged into a full checkpoint unless save_adapter is true")
    adapter: Optional[str] = Field(None, description="LoRA adapter folder to continue training (on top of `policy`, its base); null: a fresh adapter when `lora` is set. The loop sets it under its lora key. Needs `lora` (the same r and lora_alpha)")
    save_adapter: bool = Field(False, description="with `lora`: save the adapter only (adapter_config.json naming `policy` as its base + adapter_model.safetensors + tokenizer) instead of merging it into a full checkpoint. The loop sets it under its lora key")
    num_processes: NumProcesses
    launch_profile: LaunchProfileKey
    num_machines: NumMachines
    main_process_ip: MainProcessIp
    main_process_port: MainProcessPort
    dry_run: bool = Field(False, description="memory check instead of training: load policy (and reference when beta > 0) as usual, compute the old log-probs and run one optimizer step (forward + backward of every micro-batch + AdamW step) on per_device_train_batch_size x gradient_accumulation_steps x processes dummy completions whose prompt + completion is exactly max_length tokens (completion: max_completion_length), and write only <output_dir>.dry_run.json (peak memory, seconds per step); the rewards file is not read, output_dir is not touched")

    @model_validator(mode="after")
    def _check_grpo(self):
        check_machines(self.num_machines, self.num_processes, self.main_process_ip)
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high={self.epsilon_high} is below epsilon={self.epsilon}; the upper clipping "
                             "bound is 1 + epsilon_high, set it >= epsilon (or null)")
        check_lora_keys(self.lora, self.adapter, self.save_adapter, self.launch_profile)
        check_output_is_not_a_model(self.output_dir, policy=self.policy, reference=self.reference, adapter=self.adapter)
        return self

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """The per-device batch and length first, then activations, the reference and ZeRO-3
        (:meth:`StageConfig.dry_run_advice`)."""
        p, s = prefix, settings
        out = [f"{_now(s, p, 'per_device_train_batch_size')}: the completions on a device per forward pass; raise "
               f"{p}gradient_accumulation_steps (now {s.get('gradient_accumulation_steps')}) to keep the optimizer step",
               f"{_now(s, p, 'max_length')}: tokens of prompt + completion (the completion is generation.max_tokens)"]
        if not s.get("gradient_checkpointing"):
            out.append(_checkpointing_advice(f"{p}gradient_checkpointing"))
        if s.get("beta"):
            out.append(f"{_now(s, p, 'beta')}: 0 drops the KL term, and the reference model with it")
        return out + _zero3_advice(s, device)


class IFEvalScoreConfig(StageConfig):
    """annotate_data/ifeval_score.py: IFEval's four scores of generated records (one greedy response each)."""

    input: str = Field(..., description="generated records with instruction_id_list + kwargs (ifeval_generated.jsonl)")
    output: str = Field(..., description="per-prompt outcomes (ifeval.jsonl): {id, instruction_id_list, strict: [bool], loose: [bool], prompt_strict, prompt_loose, response_tokens, finish_reason}")

    @model_validator(mode="after")
    def _output_is_not_input(self):
        if Path(self.input).resolve() == Path(self.output).resolve():
            raise ValueError(f"output={self.output} is the input file; write the outcomes to another file")
        return self


class KLConfig(StageConfig):
    """annotate_data/kl_estimate.py: KL(policy || reference) from responses sampled from the policy."""

    omit_when_default = ("adapter",)

    input: str = Field(..., description="generated records whose responses were SAMPLED from `policy` (temperature 1), e.g. kl_generated.jsonl")
    policy: str = Field(..., description="the policy that sampled the responses (dir, Hub id or 'default')")
    reference: str = Field(..., description="the reference model (dir, Hub id or 'default'), e.g. the starting policy")
    adapter: Optional[str] = Field(None, description="LoRA adapter folder of the policy, on top of `policy` (its base); null: none. When `reference` is that base, its log-probs are the same model's with the adapter switched off (no second model). The loop sets it under its lora key")
    output: str = Field(..., description="per-prompt log-probs (kl.jsonl): {id, logp_policy: [K], logp_reference: [K], kl: [K], response_tokens: [K]}")
    batch_size: int = Field(8, ge=1, description="sequences per forward pass")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="precision of both models' log-prob passes: auto = float32 weights under bf16 autocast (fp16 on a GPU without bf16) where the hardware computes it natively, with the log-softmax in float32 (as the DPO stage's reference pass runs), else float32; float32 = no autocast; bfloat16 = weights in bf16")

    @model_validator(mode="after")
    def _output_is_not_input(self):
        if Path(self.input).resolve() == Path(self.output).resolve():
            raise ValueError(f"output={self.output} is the input file; write the log-probs to another file")
        return self


class IFEvalSection(StageConfig):
    """The loop's `ifeval` section: IFEval (541 prompts, greedy) on the policy of an iteration."""

    when: Literal["ends", "every", "never"] = Field("ends", description="ends: iteration 0 (starting policy) and the last iteration; every: each iteration; never: off")
    prompts: str = Field("default", description="IFEval prompt set ('default' = .cache/data/ifeval.jsonl from scripts/prepare_default.py)")
    limit: Optional[int] = Field(None, ge=1, description="first N IFEval prompts (null: all 541); cost grows with N x max_tokens")
    max_tokens: int = Field(384, ge=1, description="max new tokens per IFEval answer (cut answers fail length checks more often)")


class SFTStageConfig(StageConfig):
    """sft/run_sft.py: supervised fine-tuning with Axolotl (once, before the loop); saves an HF checkpoint.

    The file is an Axolotl config plus the keys below: every other key is passed to Axolotl as is
    (checked against Axolotl's own schema by the stage, so a misspelt key is an error, not ignored).
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True, protected_namespaces=())

    base_model: str = Field("default", description="policy to fine-tune: dir, HF Hub id or 'default' (embedded SmolLM2-135M-Instruct)")
    dataset: str = Field(..., description="SFT data: local JSONL, one {'messages': [{role, content}, ...]} per line (roles system/user/assistant); checked before Axolotl starts")
    output_dir: str = Field(..., description="where the HF checkpoint is saved (Axolotl trains into <output_dir>.tmp; renamed at the end)")
    axolotl_config_output: Optional[str] = Field(None, description="where the resolved Axolotl YAML is written (default: <output_dir>.axolotl.yaml)")
    launcher: Literal["python", "accelerate"] = Field("python", description="python: one process (CPU, one GPU); accelerate: `accelerate launch` with num_processes (multi-GPU, DeepSpeed via Axolotl's `deepspeed:` key)")
    num_processes: Optional[int] = Field(None, ge=1, description="launcher=accelerate: processes (default: all visible GPUs, else 1)")
    dry_run: bool = Field(False, description="memory check instead of training: one forward + backward + AdamW step of the base model (transformers, in Axolotl's dtype and attention, one process) on micro_batch_size dummy rows of sequence_len tokens; writes only <output_dir>.dry_run.json (peak memory, seconds); Axolotl does not run, output_dir is not touched")

    @model_validator(mode="after")
    def _check_sft(self):
        if self.launcher == "python" and (self.num_processes or 1) > 1:
            raise ValueError(f"num_processes={self.num_processes} needs launcher=accelerate")
        return self

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """Axolotl's micro-batch and sequence length, then activations (:meth:`StageConfig.dry_run_advice`)."""
        p, s = prefix, settings
        out = [f"{_now(s, p, 'micro_batch_size')}: rows per forward pass (raise {p}gradient_accumulation_steps, now "
               f"{s.get('gradient_accumulation_steps')}, to keep the batch)",
               f"{_now(s, p, 'sequence_len')}: tokens per row"]
        if not s.get("gradient_checkpointing"):
            out.append(_checkpointing_advice(f"{p}gradient_checkpointing"))
        return out


class SFTDataConfig(StageConfig):
    """sft/build_sft_data.py: rejection-sampling SFT data (RAFT): the best scored response per prompt."""

    rewards: str = Field(..., description="rewards.jsonl of a run (generated records + 'rewards')")
    output: str = Field(..., description="SFT JSONL: {id, messages: [...prompt, {role: assistant, content: best}], reward}")
    min_reward: float = Field(1.0, description="keep a prompt only when its best response's reward is >= this (1.0 with verifier rewards in [0, 1]: only fully correct responses)")
    truncated: Literal["exclude", "keep"] = Field("exclude", description="responses with finish_reason 'length': exclude (SFT on them teaches the model not to stop) or keep")
