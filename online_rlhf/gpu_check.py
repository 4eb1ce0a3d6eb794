"""The GPU check: every GPU component of the project on a tiny model, then on the default model.

    bash scripts/gpu_check.sh [--models tiny,default] [--only generation,dpo_zero2,...] [--plan-only]
    .venv-train/bin/python -m online_rlhf.gpu_check ...        (the same, envs already built)

Components, in order, for each model (docs/gpu.md says what each one checks):

- ``plan``: ``python -m online_rlhf.loop plan`` of a 1-iteration run with ``launch_profile: zero2``,
  ``num_processes`` = ``generation_shards`` = GPUs (one for DPO, one for GRPO), into the check's
  work folder;
- ``generation``: the planned generation stage (CUDA vLLM, K samples, one shard per GPU);
- ``rm_scoring``: reward-model scoring, length-sorted batches vs batch size 1, same items; the
  figure is the ratio (expected >= ``--min-rm-speedup``, 4x);
- ``reward_server``: the reward service's load test (``bench/bench_reward_server.py``: the model's
  backbone with a fresh score head, float32 so that every result must equal the 1-client run, one
  worker per GPU, requests merged as ``max_batch_requests=auto`` does on GPU); passes with no result
  lost, failed or mismatched, on CUDA, and for the default model 16-client items/s >=
  ``--min-server-speedup`` (4x) the 1-client figure (the tiny model's ratio is shown, not judged:
  its forward pass is too small for batching to matter);
- ``dpo_zero2``: the planned DPO stage for 2 optimizer steps under DeepSpeed ZeRO-2 in bf16, with
  flash-attention 2 where ``flash_attn`` imports in the training env, else sdpa (the figure says which);
- ``tied_weights``: after a ZeRO-2 save and a reload, ``lm_head.weight`` equals
  ``embed_tokens.weight``, logits on a fixed prompt match the in-memory model, and the loss of the
  step after a resume from the DeepSpeed checkpoint matches the uninterrupted run (after
  DeepSpeed issue #3824, tied embeddings broken by a ZeRO save/load);
- ``grpo``: the planned GRPO stage for 2 optimizer steps under ZeRO-2;
- ``loop``: ``bash run_loop.sh`` for 1 iteration with ``launch_profile: zero2``, and its report;
- ``lora``: ``bash run_loop.sh`` for 2 iterations with the loop's ``lora`` key under ZeRO-2: adapter-only
  saves, iteration 2 sampled with CUDA vLLM's LoRA (``enable_lora``, a ``LoRARequest``) and trained on
  from iteration 1's adapter.

Prints a table (component, model, PASS/FAIL, seconds, figure) and exits 1 when any component
failed, 0 when all passed, 2 on bad arguments (or no CUDA device without ``--plan-only``).
``--plan-only`` plans the runs and lists the commands without running any: it needs no GPU.
The shell wrapper ``scripts/gpu_check.sh`` builds or reuses the CUDA envs first.

Workers (run by the check itself, in the right env, as ``python -m online_rlhf.gpu_check <worker>``;
their code is in ``online_rlhf.gpu_check_workers``): ``rm-worker`` (the scoring ratio) and
``tied-worker --phase train|resume`` (under ``accelerate launch`` with a DeepSpeed profile).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .gpu_check_workers import rm_worker, tied_in_checkpoint, tied_worker
from .jsonl import read_json, write_json, write_jsonl
from .paths import PROJECT_ROOT, default_model_dir
from .testing import constraint_prompts

COMPONENTS = ("plan", "generation", "rm_scoring", "reward_server", "dpo_zero2", "tied_weights", "grpo", "loop", "lora")
MODELS = ("tiny", "default")
K = 4  # responses per prompt in the generation, GRPO and loop checks
PROMPTS_PER_GPU = 8  # the planned iteration's prompts (enough for the loop's random tiny policy to make pairs)
TRAIN_PY = PROJECT_ROOT / ".venv-train" / "bin" / "python"
ACCELERATE = PROJECT_ROOT / ".venv-train" / "bin" / "accelerate"


@dataclasses.dataclass
class Check:
    """One component on one model: commands run in order (each must exit 0), then ``verify``.

    ``verify()`` returns ``(ok, figure)``; ``prepare()`` (optional) writes the component's inputs
    first. ``timeout_s`` bounds all commands together.
    """

    component: str
    model: str
    commands: list[list[str]]
    verify: Callable[[], tuple[bool, str]]
    timeout_s: float
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    prepare: Optional[Callable[[], None]] = None
    elapsed: float = 0.0  # seconds already spent on it before run_check (the plan, done while building the checks)


@dataclasses.dataclass
class Result:
    """The outcome of a :class:`Check`: ``ok`` None when it was planned but not run
    (``--plan-only``), ``seconds`` of wall time, ``figure`` the one number or fact the table shows
    (or, when it failed, why)."""

    component: str
    model: str
    ok: Optional[bool]
    seconds: float
    figure: str


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The check's options; exits 2 (argparse's usage error) naming the bad value.

    Returns: a namespace with ``models`` and ``only`` as lists, ``work_dir`` a Path, ``gpus`` an
    int or None (None: every visible CUDA device).
    """
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,default",
                    help="comma-separated, in order: tiny (a random 2-layer Llama built here), default "
                         "(SmolLM2-135M-Instruct, prepared by scripts/prepare_default.py)")
    ap.add_argument("--only", default=",".join(COMPONENTS), help=f"comma-separated subset of {','.join(COMPONENTS)}")
    ap.add_argument("--work-dir", type=Path, default=PROJECT_ROOT / "runs" / "gpu_check",
                    help="a fresh run_<time> folder is made in it for models, run dirs, logs and results.json")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    ap.add_argument("--min-rm-speedup", type=float, default=4.0,
                    help="rm_scoring fails below this batched / batch-size-1 ratio")
    ap.add_argument("--min-server-speedup", type=float, default=4.0,
                    help="reward_server fails (default model) below this 16-client / 1-client items/s ratio")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="limit per component (loop: twice this)")
    ap.add_argument("--plan-only", action="store_true",
                    help="plan the runs and list each component's commands; run nothing (no GPU needed)")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.only = [c for c in args.only.split(",") if c]
    for name, got, allowed in (("--models", args.models, MODELS), ("--only", args.only, COMPONENTS)):
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            ap.error(f"{name} {','.join(bad) or '(empty)'}: expected a comma-separated subset of {','.join(allowed)}")
    if "plan" not in args.only:
        args.only.insert(0, "plan")  # every other component runs on the planned run directories
    if args.gpus is not None and args.gpus < 1:
        ap.error(f"--gpus {args.gpus}: give at least 1 (or leave it out: every visible GPU)")
    if args.timeout_s <= 0 or args.min_rm_speedup <= 0 or args.min_server_speedup <= 0:
        ap.error("--timeout-s, --min-rm-speedup and --min-server-speedup must be positive")
    return args


def attention() -> str:
    """``flash_attention_2`` where the ``flash_attn`` package imports in this env (setup_envs.sh
    builds it on CUDA machines with nvcc), else ``sdpa``."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(model: str, work: Path) -> Path:
    """The checkpoint of ``model``: the tiny one is built under ``work`` (seconds); the default
    must have been prepared. Raises FileNotFoundError naming the fix."""
    if model == "tiny":
        out = work / "models" / "tiny"
        if not (out / "config.json").is_file():
            from .testing import make_tiny_policy

            make_tiny_policy(out, seed=3)
        return out
    d = default_model_dir()
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: the default model is not prepared. Run "
                                ".venv-train/bin/python scripts/prepare_default.py first (or --models tiny).")
    return d


def loop_overrides(model_dir: Path, work: Path, model: str, gpus: int, attn: str) -> list[str]:
    """The loop keys every planned run of the check shares: 1 iteration, ``launch_profile: zero2``,
    one process and one vLLM shard per GPU, ``PROMPTS_PER_GPU x gpus`` fresh prompts of K responses, short
    responses, flash-attention 2 or sdpa for DPO and GRPO, IFEval and KL off (time)."""
    prompts = work / "prompts"
    return [f"policy={model_dir}", f"output_root={work / 'runs'}", "iterations=1", "launch_profile=zero2",
            f"num_processes={gpus}", f"generation_shards={gpus}", f"train_prompts={prompts / 'train.jsonl'}",
            f"eval_prompts={prompts / 'eval.jsonl'}", f"prompts_per_iteration={PROMPTS_PER_GPU * gpus}", f"eval_limit={2 * gpus}",
            f"generation.k={K}", "generation.max_tokens=32", "generation.max_model_len=1024", "pairs.truncated=keep",
            "ifeval.when=never", "kl_samples=0", f"dpo.attn_implementation={attn}", f"grpo.attn_implementation={attn}",
            f"dpo.train_batch_size={2 * gpus}", "dpo.training.max_steps=2", "dpo.training.max_length=256", "dpo.max_prompt_length=128",
            "grpo.per_device_train_batch_size=4", "grpo.num_iterations=1", "grpo.gradient_accumulation_steps=1",
            "grpo.max_length=256"]


def run_plan(run_name: str, overrides: list[str], log: Path) -> Path:
    """``python -m online_rlhf.loop plan configs/loop.yaml run_name=... <overrides>``, in this
    process (the loop's own ``main``), its output in ``log``; returns the run directory.

    Raises: RuntimeError with the plan's error line (the whole output is in ``log``).
    """
    import contextlib
    import io

    from . import loop

    argv = ["plan", str(PROJECT_ROOT / "configs" / "loop.yaml"), f"run_name={run_name}", *overrides]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = loop.main(argv)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("+ python -m online_rlhf.loop " + shlex.join(argv) + "\n" + out.getvalue() + err.getvalue())
    if rc != 0:
        raise RuntimeError(f"loop plan exited {rc} ({log}): {_last_line(err.getvalue())}")
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("RUN_DIR="))
    return Path(shlex.split(line.split("=", 1)[1])[0])


def _child_env(extra: Optional[dict] = None) -> dict:
    # The checkout's code, whatever the venvs have installed (editable from another checkout).
    return {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "PYTHONUNBUFFERED": "1", **(extra or {})}


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _exec(run_dir: Path, stage: str) -> list[str]:
    return [str(TRAIN_PY), "-m", "online_rlhf.loop", "exec", str(run_dir), "1", stage]


def _write_pairs(path: Path, n: int) -> None:
    write_jsonl(path, [{"id": f"p{i}", "prompt": [{"role": "user", "content": f"Question {i}: is the sky blue?"}],
                        "chosen": [{"role": "assistant", "content": f"Yes, it is blue ({i})."}],
                        "rejected": [{"role": "assistant", "content": "No, the sky is green."}],
                        "chosen_reward": 1.0, "rejected_reward": 0.0} for i in range(n)])


def _write_rollouts(path: Path, n: int) -> None:
    """``n`` groups of K scored responses with distinct rewards (no group is skipped as all-equal)."""
    write_jsonl(path, [{"id": f"g{i}", "prompt": [{"role": "user", "content": f"Question {i}: say yes."}],
                        "responses": [f"yes {'yes ' * j}".strip() for j in range(K)],
                        "finish_reasons": ["stop"] * K, "response_tokens": [j + 1 for j in range(K)],
                        "rewards": [j / (K - 1) for j in range(K)], "reward_source": "verifier"} for i in range(n)])


def _stats(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the stage wrote no stats")
    return read_json(path)


def verify_generation(run_dir: Path, gpus: int) -> tuple[bool, str]:
    """Every planned prompt has K responses, from ``gpus`` shards each on a CUDA device."""
    st = _stats(run_dir / "iter_1" / "generated.jsonl.stats.json")
    devices = sorted({s["hardware"].get("device") for s in st["shards"]})
    n = PROMPTS_PER_GPU * gpus
    ok = (st["num_shards"] == gpus and st["records_out"] == n and st["responses"] == n * K
          and devices == ["cuda"])
    return ok, (f"{st['num_shards']} shards on {','.join(map(str, devices))}, {st['responses']} responses, "
                f"{st['generated_tokens_per_s']:.0f} tok/s")


def verify_rm(out: Path, min_speedup: float) -> tuple[bool, str]:
    """The scoring ratio reaches ``min_speedup`` and batched scores equal batch-size-1 scores
    within 5% of the largest |score| (bf16 padding rounding)."""
    r = read_json(out)
    close = r["max_abs_diff"] <= 0.05 * max(1.0, r["max_abs_score"])
    ok = r["device"] == "cuda" and r["ratio"] >= min_speedup and close
    return ok, (f"batched/B=1 {r['ratio']:.1f}x (expect >= {min_speedup:g}x), {r['items']} items, "
                f"max |diff| {r['max_abs_diff']:.1e}, {r['dtype']}")


def verify_server(out: Path, min_speedup: Optional[float]) -> tuple[bool, str]:
    """The load test's figures (``bench_reward_server --output``): served on CUDA, no result lost,
    failed or different from the 1-client run, and (``min_speedup`` not None) the last level's
    items/s at least ``min_speedup`` x the first's."""
    f = read_json(out)
    m = f["servers"]["mosec"]
    rows = m["rows"]
    first, last = rows[str(f["levels"][0])], rows[str(f["levels"][-1])]
    bad = sum(r["errors"] + r["lost"] + r["mismatched"] for r in rows.values())
    ratio = m.get("ratio", 0.0)
    ok = m.get("device") == "cuda" and not f["failed"] and bad == 0 and (min_speedup is None or ratio >= min_speedup)
    expect = f"expect >= {min_speedup:g}x" if min_speedup is not None else "not judged on this model"
    return ok, (f"{f['levels'][-1]}/{f['levels'][0]} clients {ratio:.1f}x items/s ({expect}), "
                f"{first['items_per_s']:.1f} -> {last['items_per_s']:.1f} items/s, p99 {last['p99']:.2f} s, "
                f"{bad} lost/failed/mismatched, {m.get('device')} {m.get('dtype')}, "
                f"up to {m.get('max_batch_requests')} requests per call")


def verify_training(run_dir: Path, gpus: int, attn: str, stage: str) -> tuple[bool, str]:
    """The DPO or GRPO stage ran 2 steps under ZeRO-2 on ``gpus`` CUDA processes in bf16, and its
    saved checkpoint keeps the embeddings tied."""
    st = _stats(run_dir / "iter_1" / "model.stats.json")
    dtype = json.dumps(st.get("dtype", {}))
    tied, how = tied_in_checkpoint(run_dir / "iter_1" / "model")
    ok = (st["steps"] == 2 and st.get("deepspeed_zero_stage") == 2 and st["num_processes"] == gpus
          and st["hardware"].get("device") == "cuda" and "bfloat16" in dtype and tied)
    first = st.get("train_loss_first", st.get("loss_first"))
    last = st.get("train_loss_last", st.get("loss_last"))
    return ok, (f"attn {attn}, {st['steps']} steps ZeRO-{st.get('deepspeed_zero_stage')} x{st['num_processes']}, "
                f"loss {first:.4f}->{last:.4f}, checkpoint {how}")


def verify_tied(out: Path) -> tuple[bool, str]:
    r = read_json(out)
    return r["ok"], r["figure"]


def verify_loop(run_dir: Path) -> tuple[bool, str]:
    """The 1-iteration loop wrote metrics for iterations 0 and 1 and its report."""
    from .jsonl import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")
    its = [r.get("iteration") for r in rows]
    ok = its == [0, 1] and (run_dir / "report.md").is_file()
    rewards = [r.get("eval_reward_mean") for r in rows]
    return ok, f"iterations {its}, report.md {'written' if (run_dir / 'report.md').is_file() else 'missing'}, " \
               f"held-out reward {rewards}"


def verify_lora(run_dir: Path, gpus: int) -> tuple[bool, str]:
    """The 2-iteration LoRA loop saved adapters (no full checkpoint), iteration 2 decoded with
    iteration 1's adapter on CUDA and its DPO under ZeRO-2 continued that adapter."""
    from .jsonl import read_jsonl

    its = [r.get("iteration") for r in read_jsonl(run_dir / "metrics.jsonl")]
    adapters = [(run_dir / f"iter_{i}" / "model" / "adapter_config.json").is_file() for i in (1, 2)]
    full = [(run_dir / f"iter_{i}" / "model" / "model.safetensors").exists() for i in (1, 2)]
    dpo = _stats(run_dir / "iter_2" / "model.stats.json")
    gen = _stats(run_dir / "iter_2" / "generated.jsonl.stats.json")
    devices = sorted({s["hardware"].get("device") for s in gen["shards"]})
    ok = (its == [0, 1, 2] and all(adapters) and not any(full) and dpo.get("adapter") == str(run_dir / "iter_1" / "model")
          and dpo.get("deepspeed_zero_stage") == 2 and dpo["num_processes"] == gpus
          and gen.get("adapter") == str(run_dir / "iter_1" / "model") and devices == ["cuda"])
    return ok, (f"iterations {its}, adapters {adapters}, saved {dpo.get('saved_mb')} MB, iteration-2 decode "
                f"{gen.get('generated_tokens_per_s')} tok/s on {devices} with the adapter")


def build_checks(args: argparse.Namespace, work: Path, gpus: int, attn: str) -> list[Check]:
    """Plan every run (the ``plan`` component is done here: its Check only reports) and return the
    checks to run, in order: per model, ``args.only`` in :data:`COMPONENTS` order.

    Raises: nothing; a model whose plan fails gets a failed ``plan`` check and no others.
    """
    checks: list[Check] = []
    constraint_prompts(work / "prompts" / "train.jsonl", PROMPTS_PER_GPU * gpus, "t")
    constraint_prompts(work / "prompts" / "eval.jsonl", 2 * gpus, "e")
    t = args.timeout_s
    for model in args.models:
        t0 = time.monotonic()
        try:
            mdir = _model_dir(model, work)
            over = loop_overrides(mdir, work, model, gpus, attn)
            dpo_run = run_plan(f"{model}_dpo", over, work / "logs" / f"{model}_plan_dpo.log")
            grpo_run = run_plan(f"{model}_grpo", [*over, "algorithm=grpo"], work / "logs" / f"{model}_plan_grpo.log")
        except (RuntimeError, FileNotFoundError) as e:
            msg = str(e)
            checks.append(Check("plan", model, [], lambda msg=msg: (False, msg), t, elapsed=time.monotonic() - t0))
            continue
        checks.append(Check("plan", model, [], lambda g=gpus, a=attn, d=dpo_run, r=grpo_run: (
            True, f"{g} GPU(s), zero2, attn {a}: {d.name}, {r.name}"), t, elapsed=time.monotonic() - t0))
        rm_out = work / f"{model}_rm.json"
        server_out = work / f"{model}_reward_server.json"
        tied_dir = work / f"{model}_tied"
        tied_launch = [str(ACCELERATE), "launch", "--config_file", str(PROJECT_ROOT / "configs" / "accelerate" / "zero2.yaml"),
                       "--num_processes", str(gpus), "--main_process_port", str(_free_port()), "-m", "online_rlhf.gpu_check",
                       "tied-worker", "--model", str(mdir), "--dir", str(tied_dir)]
        loop_run = work / "runs" / f"{model}_loop"
        lora_run = work / "runs" / f"{model}_lora"
        lora_over = [o for o in over if not o.startswith("iterations=")] + ["iterations=2", "lora={r: 8, alpha: 16}"]
        table = {
            "generation": Check("generation", model, [_exec(dpo_run, "generate")],
                                lambda r=dpo_run: verify_generation(r, gpus), t),
            "rm_scoring": Check("rm_scoring", model,
                                [[str(TRAIN_PY), "-m", "online_rlhf.gpu_check", "rm-worker", "--model", str(mdir),
                                  "--out", str(rm_out)]], lambda o=rm_out: verify_rm(o, args.min_rm_speedup), t),
            "reward_server": Check("reward_server", model,
                                   [[str(TRAIN_PY), "-m", "bench.bench_reward_server", "--backbone", str(mdir),
                                     "--requests", "64", "--clients", "1,4,16", "--dtype", "float32",
                                     "--time-limit", str(int(t / 4)), "--output", str(server_out)]],
                                   lambda o=server_out, m=model: verify_server(
                                       o, args.min_server_speedup if m == "default" else None), t),
            "dpo_zero2": Check("dpo_zero2", model, [_exec(dpo_run, "dpo")],
                               lambda r=dpo_run: verify_training(r, gpus, attn, "dpo"), t,
                               prepare=lambda r=dpo_run: _write_pairs(r / "iter_1" / "pairs.jsonl", 4 * gpus)),
            "tied_weights": Check("tied_weights", model, [[*tied_launch, "--phase", "train"], [*tied_launch, "--phase", "resume"]],
                                  lambda d=tied_dir: verify_tied(d / "result.json"), t),
            "grpo": Check("grpo", model, [_exec(grpo_run, "grpo")],
                          lambda r=grpo_run: verify_training(r, gpus, attn, "grpo"), t,
                          prepare=lambda r=grpo_run: _write_rollouts(r / "iter_1" / "rewards.jsonl", 2 * gpus)),
            "loop": Check("loop", model, [["bash", str(PROJECT_ROOT / "run_loop.sh"), "configs/loop.yaml",
                                           f"run_name={model}_loop", *over]],
                          lambda r=loop_run: verify_loop(r), 2 * t),
            "lora": Check("lora", model, [["bash", str(PROJECT_ROOT / "run_loop.sh"), "configs/loop.yaml",
                                           f"run_name={model}_lora", *lora_over]],
                          lambda r=lora_run: verify_lora(r, gpus), 3 * t),
        }
        checks += [table[c] for c in COMPONENTS if c in args.only and c != "plan"]
    return checks


def run_check(check: Check, log_dir: Path) -> Result:
    """Run ``check``'s commands (from the project root, output to ``<log_dir>/<model>_<component>.log``),
    then its verifier. Any non-zero exit, timeout or verifier exception is a failed Result naming it."""
    t0 = time.monotonic()
    log = log_dir / f"{check.model}_{check.component}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        if check.prepare:
            check.prepare()
        with open(log, "a", encoding="utf-8") as fh:
            for argv in check.commands:
                left = check.timeout_s - (time.monotonic() - t0)
                fh.write("+ " + shlex.join(argv) + "\n")
                fh.flush()
                try:
                    r = subprocess.run(argv, cwd=PROJECT_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                       env=_child_env(check.env), timeout=max(left, 1.0))
                except subprocess.TimeoutExpired:
                    return Result(check.component, check.model, False, time.monotonic() - t0,
                                  f"timed out after {check.timeout_s:.0f} s (log: {log})")
                if r.returncode != 0:
                    return Result(check.component, check.model, False, time.monotonic() - t0,
                                  f"exit {r.returncode}: {_last_line(log.read_text(errors='replace'))} (log: {log})")
        ok, figure = check.verify()
    except Exception as e:  # a verifier that cannot read what the stage should have written fails the check
        return Result(check.component, check.model, False, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    return Result(check.component, check.model, bool(ok), time.monotonic() - t0 + check.elapsed, figure)


def format_table(results: list[Result]) -> str:
    """The results as a fixed-width text table: component, model, PASS/FAIL, seconds, figure;
    then a line counting the passed and failed components."""
    rows = [("component", "model", "result", "seconds", "figure")]
    rows += [(r.component, r.model, _verdict(r.ok), f"{r.seconds:.1f}", r.figure) for r in results]
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join([*(row[i].ljust(w[i]) for i in range(4)), row[4]]).rstrip() for row in rows]
    counts = {v: sum(_verdict(r.ok) == v for r in results) for v in ("PASS", "FAIL", "-")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['-']} not run")
    return "\n".join(lines)


def _verdict(ok: Optional[bool]) -> str:
    return "-" if ok is None else "PASS" if ok else "FAIL"


def exit_code(results: list[Result]) -> int:
    """1 when any component failed or there are no results, else 0 (components planned but not
    run, ``--plan-only``, do not fail)."""
    return 0 if results and not any(r.ok is False for r in results) else 1


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str]) -> int:
    """The check (see the module docstring); returns the exit code."""
    if argv and argv[0] == "rm-worker":
        return rm_worker(argv[1:])
    if argv and argv[0] == "tied-worker":
        return tied_worker(argv[1:])
    args = parse_args(argv)
    visible = _visible_gpus()
    gpus = args.gpus or visible
    if not args.plan_only and (visible == 0 or gpus > visible):
        print(f"gpu_check: {visible} CUDA device(s) visible, {gpus} asked; this check needs a GPU "
              "(--plan-only plans and lists the commands without one).", file=sys.stderr)
        return 2
    gpus = max(gpus, 1)
    work = (args.work_dir / time.strftime("run_%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=False)
    attn = attention()
    print(f"gpu_check: {gpus} GPU(s) of {visible} visible, attention {attn}, work dir {work}" if not args.plan_only
          else f"gpu_check --plan-only: planned for {gpus} GPU(s) ({visible} visible here), attention {attn}, work dir "
               f"{work}; commands run from {PROJECT_ROOT}", flush=True)
    checks = build_checks(args, work, gpus, attn)
    results: list[Result] = []
    for c in checks:
        if args.plan_only:
            results.append(run_check(c, work / "logs") if c.component == "plan"
                           else Result(c.component, c.model, None, 0.0, "planned, not run (--plan-only)"))
            for argv_ in c.commands:
                print(f"[{c.model} {c.component}] {shlex.join(argv_)}")
            continue
        print(f"[{c.model} {c.component}] running ...", flush=True)
        r = run_check(c, work / "logs")
        results.append(r)
        print(f"[{c.model} {c.component}] {'PASS' if r.ok else 'FAIL'} {r.seconds:.1f} s: {r.figure}", flush=True)
    write_json(work / "results.json", [dataclasses.asdict(r) for r in results])
    print(format_table(results))
    return exit_code(results)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
