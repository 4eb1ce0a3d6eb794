"""Run the generation stage as W shard processes, then merge them into one ``generated.jsonl``.

    .venv-infer/bin/python generation/launch.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated.jsonl num_shards=W [shards_dir=runs/x/iter_1/generated] ...

Same keys as ``generation/generate.py`` (``GenerateConfig``); here ``output`` is the merged file,
its stats ``<output>.stats.json`` (``online_rlhf.stats.GenerateStats``). Shard r runs ``generate.py shard_index=r num_shards=W
output=<shards_dir>/shard_{r:02d}.jsonl`` (stats: ``shard_{r:02d}.jsonl.stats.json``) with the resolved config (saved as
``<shards_dir>/generate_config.yaml``) and appends its output to ``<shards_dir>/shard_{r:02d}.log``.
A finished shard is not regenerated on a rerun (generate.py checks its output), so after a
failure, rerunning this command redoes only the failed shards.

Shards die with the launcher: each runs under ``online_rlhf.procs``' guard in its own process
group, which the kernel signals when the launcher dies (even by ``kill -9``) and which then kills
the shard and its vLLM engine processes. A SIGTERM to the launcher stops every shard the same way.
A shard also holds ``shard_{r:02d}.lock`` while it runs (generate.py), so a shard left running
anyway can never be joined by, or overwrite the output of, a second one.

Devices:
- GPUs (``torch.cuda.device_count() > 0``): shard r gets ``CUDA_VISIBLE_DEVICES`` =
  ``tensor_parallel_size`` GPUs of its own (from an existing ``CUDA_VISIBLE_DEVICES`` list, if
  set); W x tensor_parallel_size must not exceed the GPUs.
- CPU: W > 1 shards split the allowed cores into W contiguous blocks; shard r binds vLLM's
  OpenMP threads to its block (``VLLM_CPU_OMP_THREADS_BIND=a-b``, ``OMP_NUM_THREADS`` = block
  size). Each shard holds its own KV cache (``kv_cache_gb`` GiB) and model copy: on CPU, W = 1
  is usually best.
- CPU, W = 1: the engine runs inside the shard process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
  a 5 s engine start instead of 17 s, and the same samples on every run with the same seed, since
  vLLM's separate engine process batches by timing) with one OpenMP thread per core that is free
  when the stage starts (``online_rlhf.hardware.stage_threads``; ``OMP_NUM_THREADS`` set by you
  wins). Threads that share a core with another job wait for each other at every small op, so a
  busy core is left out; OpenMP spin-waiting is shortened (``GOMP_SPINCOUNT``) so that a job
  arriving later slows decoding down instead of stalling it.
  ``VLLM_ENABLE_V1_MULTIPROCESSING`` or ``VLLM_CPU_OMP_THREADS_BIND`` set by you turns this off:
  your values are passed to every shard unchanged.

Several configs (``launch.py --config A.yaml --config B.yaml ...``, co-decoding; ``loop exec``
passes an iteration's evaluation generations so): the configs whose engine settings equal the
first's (``online_rlhf.co_decode.refusal``) decode with one engine start per shard, each written as
its own launch would write it; the others run afterwards with their own start, the reason printed
(:func:`main_many`). Exit 0 when every output was written, 1 when the first config's was not, 3
when only a later one's was not.

Several machines (``num_machines`` M > 1, a filesystem shared by all of them): each machine runs
``launch.py ... machine_rank=k``, which starts only the shards r with r % M == k, on that
machine's own GPUs or cores as above. Machine 0 then waits (at most ``merge_wait_s``) until every
shard's output and stats file are there, written for this config (:func:`shard_state`), and merges;
on timeout it refuses, naming each missing shard file and the machine that should have written it.
The other machines exit after their own shards. With one machine nothing waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


from .merge_data import merge_shards, shard_path, shards_dir_of
from online_rlhf.config import ConfigError, run_main
from online_rlhf.dry_run import dry_run_path
from online_rlhf.hardware import stage_threads
from online_rlhf.jsonl import DataError, atomic_open
from online_rlhf.paths import setup_cache_env
from online_rlhf.procs import start_guarded
from online_rlhf.stage_configs import GenerateConfig
from online_rlhf.stats import DryRunStats, GenerateShardStats, GenerateStats, stats_path

GENERATE = "online_rlhf.stages.generate"  # run as a module: python -m
LOG_TAIL_LINES = 40


def torch_gpu_build() -> bool:
    """Whether the installed torch can drive a GPU, read off its files without importing it (an
    import costs 2-3 s per launch on a CPU): a CUDA or ROCm build ships ``libtorch_cuda``/``libc10_cuda``
    or ``libtorch_hip`` in ``torch/lib``, a CPU build none of them. True when torch is already
    imported or its folder cannot be read (then :func:`gpu_ids` asks torch itself); False when
    torch is not installed."""
    import importlib.util

    if "torch" in sys.modules:
        return True
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return False
    if not spec.submodule_search_locations:
        return True
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not lib.is_dir():
        return True
    return any(lib.glob("libtorch_cuda*")) or any(lib.glob("libc10_cuda*")) or any(lib.glob("libtorch_hip*"))


POLL_S = 0.1  # how often the launcher looks whether a shard has exited


def gpu_ids() -> list[str]:
    """Visible GPU ids as ``CUDA_VISIBLE_DEVICES`` entries; ``[]`` on a CPU-only machine (a CPU
    build of torch: :func:`torch_gpu_build`; torch is then not imported)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not torch_gpu_build():
        return []
    try:
        import torch
    except ImportError:
        return []
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()][:n]
    return [str(i) for i in range(n)]


def cpu_blocks(cores: list[int], num_shards: int) -> list[list[int]]:
    """Split ``cores`` into ``num_shards`` contiguous blocks of near-equal size (sizes differ by at
    most one). With more shards than cores, shards share cores round-robin (one core each)."""
    if num_shards > len(cores):
        return [[cores[r % len(cores)]] for r in range(num_shards)]
    base, extra = divmod(len(cores), num_shards)
    blocks, start = [], 0
    for r in range(num_shards):
        size = base + (1 if r < extra else 0)
        blocks.append(cores[start:start + size])
        start += size
    return blocks


def shard_envs(num_shards: int, tensor_parallel_size: int, gpus: list[str] | None = None,
               cores: list[int] | None = None) -> list[dict[str, str]]:
    """Extra environment of each shard process (see the module docstring).

    Raises:
        ConfigError: more GPUs requested (W x tensor_parallel_size) than visible.
    """
    gpus = gpu_ids() if gpus is None else gpus
    if gpus:
        need = num_shards * tensor_parallel_size
        if need > len(gpus):
            raise ConfigError(f"num_shards={num_shards} x tensor_parallel_size={tensor_parallel_size} needs {need} "
                              f"GPUs; {len(gpus)} visible ({','.join(gpus)}). Lower num_shards.")
        tp = tensor_parallel_size
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp:(r + 1) * tp])} for r in range(num_shards)]
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return [{} for _ in range(num_shards)]
    if num_shards == 1:
        return [{"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(stage_threads())}]
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if num_shards > len(cores):
        print(f"[launch] warning: {num_shards} shards on {len(cores)} cores; shards share cores.", file=sys.stderr)
    envs = []
    for block in cpu_blocks(cores, num_shards):
        if len(block) > 1 and block == list(range(block[0], block[-1] + 1)):
            spec = f"{block[0]}-{block[-1]}"
        else:
            spec = ",".join(map(str, block))
        envs.append({"VLLM_CPU_OMP_THREADS_BIND": spec, "OMP_NUM_THREADS": str(len(block))})
    return envs


PROGRESS_EVERY_S = 10  # how often the last line of each running shard's log is echoed


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r", "\n")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def shard_command(config_path: Path, shards_dir: Path, r: int, w: int) -> list[str]:
    """The command of shard ``r`` of ``w``: the generate stage with the saved config and its own output."""
    return [sys.executable, "-m", GENERATE, "--config", str(config_path), f"shard_index={r}",
            f"num_shards={w}", f"output={shard_path(shards_dir, r)}"]


def start_shard(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start one shard process under ``online_rlhf.procs.start_guarded``: in its own process group,
    and killed with every process it started when this launcher dies (even by ``kill -9``).

    Its output is appended to ``log_path`` (earlier attempts stay readable) after a header with
    the time, the extra environment and the command. Returns the guard's ``Popen`` (pid = group).
    """
    with open(log_path, "a", encoding="utf-8") as log:
        env_s = " ".join(f"{k}={v}" for k, v in env.items())
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n$ {env_s} {' '.join(cmd)}\n")
        log.flush()
        return start_guarded(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def machine_shards(num_shards: int, num_machines: int, machine_rank: int) -> list[int]:
    """The shards machine ``machine_rank`` of ``num_machines`` runs: r with r % num_machines ==
    machine_rank (every shard on exactly one machine; all of them when there is one machine)."""
    return [r for r in range(num_shards) if r % num_machines == machine_rank]


def shard_config(cfg: GenerateConfig, shards_dir: Path) -> GenerateConfig:
    """The config every shard process starts from (``<shards_dir>/generate_config.yaml``; each shard
    overrides ``shard_index``, ``num_shards`` and ``output``). The same on every machine."""
    return cfg.model_copy(update={"shard_index": 0, "output": str(shard_path(shards_dir, 0)), "shards_dir": None,
                                  "machine_rank": 0})


def run_shards(cfg: GenerateConfig, companions: Sequence[GenerateConfig] = ()) -> None:
    """Start this machine's shard processes (all W of them on one machine; see
    :func:`machine_shards`), wait for all, and exit 1 naming each failed shard's log.

    With ``companions`` (co-decoding, :func:`main_many`; their engine settings equal ``cfg``'s),
    each shard process decodes its shard of ``cfg`` and then of each companion on one engine
    (``online_rlhf.stages.generate.main_many``), logging to ``cfg``'s shard log; each config's
    shard files go to its own ``shards_dir``. A failed shard then does not exit: the caller finds
    out which configs finished (:func:`shard_state`)."""
    failed = _run_shard_processes(cfg, list(companions))
    if failed and not companions:
        raise SystemExit(1)


def _run_shard_processes(cfg: GenerateConfig, companions: list[GenerateConfig]) -> list[tuple[int, int, Path]]:
    """:func:`run_shards`' work; returns ``(shard, exit status, log)`` of each failed shard (printed)."""
    shards_dir, w = shards_dir_of(cfg), cfg.num_shards
    config_paths = []
    for c in [cfg, *companions]:
        c_dir = shards_dir_of(c)
        c_dir.mkdir(parents=True, exist_ok=True)
        config_paths.append(c_dir / "generate_config.yaml")
        with atomic_open(config_paths[-1]) as f:
            f.write(shard_config(c, c_dir).to_yaml())
    config_path = config_paths[0]
    mine = machine_shards(w, cfg.num_machines, cfg.machine_rank)
    where = f" on machine {cfg.machine_rank} of {cfg.num_machines}" if cfg.num_machines > 1 else ""
    if not mine:
        print(f"[launch] no shard for machine {cfg.machine_rank}: num_shards={w} < num_machines={cfg.num_machines}.",
              flush=True)
        return []
    envs = shard_envs(len(mine), cfg.tensor_parallel_size)

    procs: list[tuple[int, subprocess.Popen, Path]] = []

    def stop_all(signum=None, frame=None):
        for _, p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)  # the shard's guard kills the shard and its vLLM engine processes
        if signum is not None:
            raise SystemExit(128 + signum)

    old_term = signal.signal(signal.SIGTERM, stop_all)
    try:
        for r, env in zip(mine, envs):
            log_path = shards_dir / f"shard_{r:02d}.log"
            cmd = shard_command(config_path, shards_dir, r, w)
            for c, c_path in zip(companions, config_paths[1:]):  # co-decoding: the same shard of each, in turn
                cmd += shard_command(c_path, shards_dir_of(c), r, w)[3:]  # its --config FILE key=value ...
                with open(shards_dir_of(c) / f"shard_{r:02d}.log", "a", encoding="utf-8") as note:
                    note.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} ===\nco-decoded in the engine of "
                               f"{cfg.output}: this shard's log is {log_path}\n")
            p = start_shard(cmd, log_path, env)
            procs.append((r, p, log_path))
            print(f"[launch] shard {r}/{w} started{where} (pid {p.pid}) {env or ''} log: {log_path}", flush=True)
        t0 = time.perf_counter()
        failed, running = [], list(procs)
        next_progress = PROGRESS_EVERY_S
        while running:
            time.sleep(POLL_S)
            for item in list(running):
                r, p, log_path = item
                if p.poll() is not None:
                    running.remove(item)
                    print(f"[launch] shard {r}/{w} exited {p.returncode} after {time.perf_counter() - t0:.0f} s", flush=True)
                    if p.returncode != 0:
                        failed.append((r, p.returncode, log_path))
            if running and time.perf_counter() - t0 >= next_progress:
                next_progress += PROGRESS_EVERY_S
                for r, _, log_path in running:  # the shard's progress bar (prompts done, tokens/s)
                    print(f"[launch] shard {r}/{w}: {tail(log_path, 1)[-160:]}", flush=True)
    except BaseException:
        stop_all()
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
    if failed:
        for r, rc, log_path in failed:
            print(f"\n[launch] shard {r}/{w} FAILED (exit {rc}); log: {log_path}\n--- last lines ---\n"
                  f"{tail(log_path)}\n---", file=sys.stderr)
        print(f"[launch] {len(failed)} of {len(mine)} shard(s){where} failed; rerun to redo only those.", file=sys.stderr)
    return failed


MERGE_POLL_S = 5.0  # how often machine 0 looks for the other machines' shard files


def shard_state(cfg: GenerateConfig, r: int, expected_fingerprint: str) -> str | None:
    """Why shard ``r``'s files are not (yet) a finished shard of this config, or None when they are.

    A shard is finished when its output and its stats file (written atomically, the stats last)
    are both there and the stats say shard r of W with this config's fingerprint, so that a shard
    file left from an earlier run with another config is not taken for a new one.
    """
    out = shard_path(shards_dir_of(cfg), r)
    st_path = stats_path(out)
    if not out.is_file():
        return "missing"
    if not st_path.is_file():
        return f"its stats file {st_path.name} is missing"
    try:
        st = GenerateShardStats.read(st_path)
    except (DataError, FileNotFoundError) as e:
        return f"its stats file is unreadable ({e})"
    if st.shard_index != r or st.num_shards != cfg.num_shards:
        return f"written as shard {st.shard_index} of {st.num_shards}"
    if st.config_fingerprint != expected_fingerprint:
        return "written for another config, model or prompt file (an earlier run's)"
    return None


def expected_fingerprints(cfg: GenerateConfig) -> dict[int, str]:
    """``{r: the config fingerprint shard r records}``, as the shard processes compute it
    (``online_rlhf.stages.generate.shard_fingerprint`` of the shared shard config)."""
    from online_rlhf.paths import resolve_model

    from .generate import shard_fingerprint

    shards_dir = shards_dir_of(cfg)
    base, model_path = shard_config(cfg, shards_dir), resolve_model(cfg.model)
    return {r: shard_fingerprint(base.model_copy(update={"shard_index": r, "output": str(shard_path(shards_dir, r))}),
                                 model_path) for r in range(cfg.num_shards)}


def wait_for_shards(cfg: GenerateConfig, poll_s: float = MERGE_POLL_S) -> None:
    """Machine 0 of several: wait until every shard of every machine is finished (:func:`shard_state`)
    on the shared filesystem, at most ``cfg.merge_wait_s`` seconds.

    Raises:
        DataError: the wait ran out; names each shard file still missing or unfinished, why, the
            machine that should have written it (r % num_machines) and that shard's log.
    """
    shards_dir, m = shards_dir_of(cfg), cfg.num_machines
    expected = expected_fingerprints(cfg)
    deadline = time.monotonic() + cfg.merge_wait_s
    next_note = time.monotonic() + 60
    while True:
        pending = {r: why for r in range(cfg.num_shards) if (why := shard_state(cfg, r, expected[r])) is not None}
        if not pending:
            return
        now = time.monotonic()
        if now >= deadline:
            lines = [f"{shard_path(shards_dir, r)} ({why}; machine {r % m} of {m} runs shard {r}; its log: "
                     f"{shards_dir / f'shard_{r:02d}.log'})" for r, why in sorted(pending.items())]
            raise DataError(f"machine 0 waited {cfg.merge_wait_s:g} s (merge_wait_s) for the shards of the other "
                            f"machines; {len(pending)} of {cfg.num_shards} not finished:\n  - " + "\n  - ".join(lines)
                            + "\nStart `launch.py ... machine_rank=k` on each of those machines (loop exec ... "
                            "machine_rank=k), then rerun; finished shards are kept.")
        if now >= next_note:
            next_note = now + 60
            print(f"[launch] machine 0 waits for shard(s) {', '.join(map(str, sorted(pending)))} of the other "
                  f"machine(s) ({deadline - now:.0f} s left)", flush=True)
        time.sleep(max(0.0, min(poll_s, deadline - now)))


def dry_run(cfg: GenerateConfig) -> DryRunStats:
    """``generation/launch.py dry_run=true``: shard 0 alone (its own ``dry_run``,
    ``online_rlhf.stages.generate.dry_run``), with the environment the launcher gives it (its GPUs,
    or its CPU cores and in-process engine), writing its result beside ``cfg.output``. On CPU,
    W > 1 shards share the machine's memory: the peak is multiplied by W.

    Raises:
        SystemExit: the shard failed (its exit code; its log is printed).
    """
    shards_dir, w = shards_dir_of(cfg), cfg.num_shards
    shards_dir.mkdir(parents=True, exist_ok=True)
    config_path = shards_dir / "generate_config.dry_run.yaml"
    with atomic_open(config_path) as f:
        f.write(cfg.model_copy(update={"shard_index": 0, "shards_dir": None}).to_yaml())
    out = dry_run_path(cfg.output)
    out.unlink(missing_ok=True)
    env = shard_envs(w, cfg.tensor_parallel_size)[0]
    log = shards_dir / "shard_00.dry_run.log"
    cmd = [sys.executable, "-m", GENERATE, "--config", str(config_path), "shard_index=0", f"num_shards={w}",
           f"output={cfg.output}"]
    rc = start_shard(cmd, log, env).wait()
    print(tail(log), flush=True)
    if rc != 0 and not out.is_file():
        print(f"[launch] dry run: shard 0 failed (exit {rc}); log: {log}", file=sys.stderr)
        raise SystemExit(rc if rc > 0 else 1)
    result = DryRunStats.read(out)
    if result.device == "cpu" and w > 1 and result.peak_memory_gib:
        result = result.model_copy(update={"peak_memory_gib": round(result.peak_memory_gib * w, 3), "processes": w,
                                           "step": result.step + f"; shard 0 of {w}, peak x{w} (CPU shards share RAM)"})
        result.write(out)
    if rc != 0:
        raise SystemExit(rc if rc > 0 else 1)
    return result


def main(cfg: GenerateConfig) -> GenerateStats | None:
    """Run this machine's shards, then merge them; returns the merged stats (written to
    ``<output>.stats.json``). With ``num_machines`` > 1, machine 0 first waits for the other
    machines' shards (:func:`wait_for_shards`) and merges; any other machine returns None after its
    own shards, without merging.

    Raises:
        DataError: a shard is still missing after ``merge_wait_s`` (machine 0), or the merge fails.
    """
    setup_cache_env()
    if cfg.dry_run:  # shard 0 alone, one max-length batch; no shard output, no merge
        return dry_run(cfg)
    run_shards(cfg)
    if cfg.num_machines > 1:
        if cfg.machine_rank != 0:
            mine = machine_shards(cfg.num_shards, cfg.num_machines, cfg.machine_rank)
            print(f"[launch] machine {cfg.machine_rank} of {cfg.num_machines}: shard(s) {mine} finished; "
                  "machine 0 merges.", flush=True)
            return None
        wait_for_shards(cfg)
    return merge_shards(cfg)


# launch.py with several configs: exit status when the first config finished and a later one did not.
LATER_CONFIG_FAILED = 3


def co_decode_plan(cfgs: Sequence[GenerateConfig]) -> tuple[list[GenerateConfig], list[tuple[GenerateConfig, str]]]:
    """Which of ``cfgs`` decode in the engine started for the first (``online_rlhf.co_decode``):
    ``(together, alone)``; ``together`` starts with the first config, ``alone`` holds each other
    config with the reason it cannot join (:func:`online_rlhf.co_decode.refusal`: engine settings,
    machines, a sampled config where the engine runs in processes of its own)."""
    from online_rlhf.co_decode import engine_in_process, refusal

    first = cfgs[0]
    in_process = engine_in_process(first.num_shards, first.tensor_parallel_size, gpu_ids())
    together, alone = [first], []
    for cfg in cfgs[1:]:
        why = refusal(first.model_dump(mode="json"), cfg.model_dump(mode="json"), in_process)
        if why:
            alone.append((cfg, why))
        else:
            together.append(cfg)
    return together, alone


def main_many(cfgs: Sequence[GenerateConfig]) -> int:
    """``launch.py --config A.yaml --config B.yaml ...``: decode several configs of one policy with
    one engine start per shard (co-decoding, :func:`co_decode_plan`), each written as its own
    launch would write it (shard files, ``<output>``, ``<output>.stats.json``); a config that cannot
    join runs afterwards with its own engine start (:func:`main`), the reason printed.

    Returns:
        the exit status: 0 when every config's output was written; 1 when the first config's was
        not (as a single launch that failed); :data:`LATER_CONFIG_FAILED` when the first config's
        was and a later one's was not (each named above).
    """
    setup_cache_env()
    if len(cfgs) == 1:
        main(cfgs[0])
        return 0
    together, alone = co_decode_plan(cfgs)
    for cfg, why in alone:
        print(f"[launch] co-decoding: {cfg.output} runs with its own engine start: {why}.", flush=True)
    done: dict[str, bool] = {}
    if len(together) > 1:
        print(f"[launch] co-decoding {len(together)} configs with one engine start per shard: "
              + ", ".join(c.output for c in together), flush=True)
        _run_shard_processes(together[0], together[1:])
        for cfg in together:
            expected = expected_fingerprints(cfg)
            pending = {r: why for r in range(cfg.num_shards) if (why := shard_state(cfg, r, expected[r])) is not None}
            if pending:
                print(f"[launch] {cfg.output}: not written, shard(s) {sorted(pending)} unfinished "
                      f"({'; '.join(sorted(set(pending.values())))}).", file=sys.stderr, flush=True)
                done[cfg.output] = False
                continue
            try:
                merge_shards(cfg)
                done[cfg.output] = True
            except DataError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                done[cfg.output] = False
    else:
        alone = [(together[0], ""), *alone]
    for cfg, _ in alone:
        try:
            main(cfg)
            done[cfg.output] = True
        except SystemExit as e:
            done[cfg.output] = e.code in (0, None)
        except (ConfigError, DataError, FileNotFoundError) as e:
            print(f"error: {cfg.output}: {e}", file=sys.stderr, flush=True)
            done[cfg.output] = False
    missing = [c.output for c in cfgs if not done.get(c.output)]
    if missing:
        print(f"[launch] not written: {', '.join(missing)}; rerunning the same command redoes only what is missing "
              "(finished shards are kept).", file=sys.stderr, flush=True)
    if not done.get(cfgs[0].output):
        return 1
    return LATER_CONFIG_FAILED if missing else 0


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this). Several
    ``--config FILE [key=value ...]`` groups co-decode (:func:`main_many`; its exit status)."""
    from .generate import config_groups

    groups = config_groups(sys.argv[1:])
    if len(groups) == 1:
        run_main(main, GenerateConfig)
        return
    try:
        cfgs = [GenerateConfig.from_cli(g) for g in groups]
        if any(c.dry_run for c in cfgs):
            raise ConfigError("dry_run=true measures one config: give launch.py one --config.")
        rc = main_many(cfgs)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(rc)


if __name__ == "__main__":
    cli()
