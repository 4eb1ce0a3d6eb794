"""The loop's bookkeeping, called by run_loop.sh (training env):

    python -m online_rlhf.loop plan CONFIG [key=value ...]   # resolve + validate, write stage configs
    python -m online_rlhf.loop plan-check CONFIG [key=value ...] [--quiet]  # the plan's checks and warnings, nothing written
    python -m online_rlhf.loop run-dir CONFIG [key=value ...]  # the run directory the config names, nothing written
    python -m online_rlhf.loop check RUN_DIR ITER STAGE       # exit 0 if STAGE is done and fresh, 1 to run (prints env, why),
                                                              # 3 not planned in ITER (says so), 2 no such stage
    python -m online_rlhf.loop fresh-check RUN_DIR            # exit 0 if run_loop.sh --fresh may empty RUN_DIR, else 2 (says why)
    python -m online_rlhf.loop stages RUN_DIR ITER            # ITER's planned stages, one per line, in the stage table's order
                                                              # ("<name> after": its row has an `after` check)
    python -m online_rlhf.loop after RUN_DIR ITER STAGE       # exit 1 (with why) when STAGE's row says the loop stops after it
    python -m online_rlhf.loop pairs-check RUN_DIR ITER       # exit 1 (with why and what to change) if ITER's pairs stage made 0 pairs
    python -m online_rlhf.loop exec RUN_DIR ITER STAGE [machine_rank=R] [key=value ...]  # run STAGE as its config file says
                                                              # (R > 0: this machine's part of a multi-machine stage;
                                                              # key=value: appended to the stage's command, e.g. dry_run=true)
    python -m online_rlhf.loop dry-run RUN_DIR                # each model stage once in dry mode; fit table; exit 1 if one does not fit
    python -m online_rlhf.loop mark RUN_DIR ITER STAGE SECONDS
    python -m online_rlhf.loop output-hint RUN_DIR MESSAGE    # which stage wrote a run file MESSAGE names, how to regenerate it
    python -m online_rlhf.loop metrics RUN_DIR ITER           # one row of metrics.jsonl
    python -m online_rlhf.loop report RUN_DIR                 # report.md + report.png (+ wandb)
    python -m online_rlhf.loop verdict RUN_DIR                # one line: IFEval at the last iteration vs 0, significant or not

    python -m online_rlhf.loop -h                             # every loop config key, sections included

``plan`` writes ``runs/<name>/config.yaml`` (the resolved loop config) and, per iteration,
``iter_<i>/configs/<stage>.yaml`` plus ``iter_<i>/plan.json`` naming each stage's config, command,
inputs and outputs (the stages are the rows of ``online_rlhf.stage_table.STAGES``). A stage's YAML
holds everything it needs, launch settings included (``num_shards``, ``num_processes``,
``launch_profile``), with comments saying how to run it by hand and where each value that is not
the stage's default came from. A stage's freshness hash covers its config values and its inputs,
so any changed setting or a re-made input reruns that stage and, through its outputs, every stage
after it; its ``.done`` also records the size and hash of its outputs, so an output changed after
the stage finished (cut, edited) reruns the stage that wrote it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..config import ConfigError
from ..jsonl import DataError, read_json
from ..paths import setup_cache_env
from ..loop_config import LoopConfig
from ..stage_table import STAGES, no_pairs_stop
from .metrics import metrics
from .plan import fresh_refusal, plan, stdout_to_stderr
from .report import metrics_line, report, verdict
from .resolve import resolve
from .memory_check import dry_run
from .co_decoding import co_decoded_note
from .freshness import stale_reason
from .run import after_line, exec_stage, mark, output_hint, stage_lines


def _iteration(text: str) -> int:
    """The ITER argument as an int, or a ConfigError naming it."""
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"ITER must be an iteration number (0, 1, ...), got {text!r}.") from None


def _stage_name(name: str) -> str:
    """The STAGE argument when it names a row of the stage table, else a ConfigError listing them."""
    if name not in STAGES:
        raise ConfigError(f"no stage named {name!r}; the stages are {', '.join(STAGES)}.")
    return name


def _needs(cmd: str, args: list[str], names: str) -> None:
    """Refuse a command given fewer arguments than its usage line names."""
    want = names.split()
    if len(args) < len(want):
        raise ConfigError(f"{cmd} needs {names} (got {len(args)} argument(s)); `python -m online_rlhf.loop` "
                          "prints the usage.")


def main(argv: list[str]) -> int:
    setup_cache_env()
    if not argv:
        print(__doc__)
        return 2
    if any(a in ("-h", "--help") for a in argv):  # `-h`, and `plan --help` too
        print(__doc__)
        print("Loop config keys (configs/loop.yaml, or key=value after `bash run_loop.sh [CONFIG]`):")
        print("\n".join(LoopConfig._field_lines("  ")))
        return 0
    cmd, args = argv[0], argv[1:]
    try:
        if cmd in ("plan", "plan-check", "run-dir"):
            quiet = "--quiet" in args  # plan-check --quiet: no warnings (run_loop.sh --fresh: the plan prints them next)
            args = [a for a in args if a != "--quiet"]
            if not args:  # nothing given: the class defaults are not configs/loop.yaml's (64 prompts per iteration ...)
                raise ConfigError(f"{cmd} needs CONFIG, e.g. `python -m online_rlhf.loop {cmd} configs/loop.yaml` (what "
                                  "`bash run_loop.sh` plans); key=value overrides alone start from the keys' defaults.")
            cfg_path = args[0] if "=" not in args[0] else None
            overrides = args[1:] if cfg_path else args
            if cmd in ("plan", "plan-check"):  # plan-check: every check of the plan (and its warnings), nothing written
                with stdout_to_stderr() as real_stdout:
                    plan(cfg_path, overrides, write=cmd == "plan", shell_out=real_stdout, warn=not quiet)
            else:  # where the run lives, nothing written (run_loop.sh locks it before any change)
                cfg = resolve(cfg_path, overrides)
                print((Path(cfg.output_root) / cfg.run_name).resolve())
        elif cmd == "fresh-check":  # 0: run_loop.sh --fresh may empty RUN_DIR; 2: it must not (says why)
            reason = fresh_refusal(Path(args[0]))
            if reason:
                print(f"run_loop.sh: {reason}", file=sys.stderr)
                return 2
        elif cmd == "pairs-check":  # 0: go on; 1: the iteration made 0 pairs (prints why and what to change)
            _needs(cmd, args, "RUN_DIR ITER")
            line = no_pairs_stop(Path(args[0]), _iteration(args[1]))
            if line:
                print(line)
                return 1
        elif cmd == "stages":  # the iteration's stages in the stage table's order, "<name> after" for a row with a hook
            _needs(cmd, args, "RUN_DIR ITER")
            for line in stage_lines(Path(args[0]), _iteration(args[1])):
                print(line)
        elif cmd == "after":  # 0: go on; 1: the stage's row says stop (prints why), e.g. pairs made 0 pairs
            _needs(cmd, args, "RUN_DIR ITER STAGE")
            line = after_line(Path(args[0]), _iteration(args[1]), _stage_name(args[2]))
            if line:
                print(line)
                return 1
        elif cmd == "check":  # 0 done and fresh, 1 to run (prints the stage's env, then why), 3 not in the plan
            _needs(cmd, args, "RUN_DIR ITER STAGE")
            i = _iteration(args[1])
            entries = read_json(Path(args[0]) / f"iter_{i}" / "plan.json")
            if args[2] not in entries:
                if args[2] not in STAGES:  # a typo, not a stage this iteration leaves out
                    raise ConfigError(f"no stage named {args[2]!r}; the stages are {', '.join(STAGES)} "
                                      f"(iteration {i} plans {', '.join(entries)}).")
                print(f"loop check: stage {args[2]} is not planned in iteration {i} (it plans {', '.join(entries)})",
                      file=sys.stderr)
                return 3
            why = stale_reason(Path(args[0]), i, args[2])
            if why is None:
                return 0
            print(entries[args[2]]["env"])
            note = co_decoded_note(Path(args[0]), i, args[2])
            print(why + (f"; {note}" if note else ""))
            return 1
        elif cmd == "exec":  # exec RUN_DIR ITER STAGE [machine_rank=R] [key=value ...]
            ranks = [a.split("=", 1)[1] for a in args[3:] if a.startswith("machine_rank=")]
            try:
                rank = int(ranks[-1]) if ranks else 0
            except ValueError:
                raise ConfigError(f"exec: machine_rank={ranks[-1]!r} is not an integer.") from None
            _needs(cmd, args, "RUN_DIR ITER STAGE")
            exec_stage(Path(args[0]), _iteration(args[1]), _stage_name(args[2]), [a for a in args[3:] if not a.startswith("machine_rank=")],
                       machine_rank=rank)
        elif cmd == "dry-run":
            return dry_run(Path(args[0]))
        elif cmd == "output-hint":  # output-hint RUN_DIR MESSAGE: which stage wrote a file the message names
            line = output_hint(Path(args[0]), " ".join(args[1:]))
            if line:
                print(line)
        elif cmd == "mark":
            _needs(cmd, args, "RUN_DIR ITER STAGE SECONDS")
            try:
                seconds = float(args[3])
            except ValueError:
                raise ConfigError(f"mark: SECONDS must be a number (the stage's wall seconds), got {args[3]!r}.") from None
            if not 0 <= seconds < float("inf"):
                raise ConfigError(f"mark: SECONDS is the stage's wall time, so >= 0 and finite; got {args[3]!r}.")
            mark(Path(args[0]), _iteration(args[1]), _stage_name(args[2]), seconds)
        elif cmd == "metrics":
            _needs(cmd, args, "RUN_DIR ITER")
            row = metrics(Path(args[0]), _iteration(args[1]))
            print(metrics_line(row))
            for w in row["warnings"]:
                print(f"WARNING: {w}")
        elif cmd == "report":
            print(report(Path(args[0])))
        elif cmd == "verdict":
            _needs(cmd, args, "RUN_DIR")
            print(verdict(Path(args[0])))
        else:
            print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
            return 2
    except (ConfigError, DataError, FileNotFoundError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

