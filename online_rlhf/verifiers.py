"""Rule-based rewards: instruction-following constraints (IFEval/IFBench) and math answers.

``score(records, cfg)`` gives one reward per response of each generated record, or ``None`` for
a record that cannot be scored, with the reason counted in the returned
:class:`~online_rlhf.stats.ScoreResult` (``skipped``; never a silent 0).

- **ifeval** (records with ``instruction_id_list`` + ``kwargs``): the checkers of ``if-verifiable``
  (IFEval's 25 and IFBench's 58 instruction ids) and its scoring
  (``if_verifiable.common.evaluate_instructions``): ``ifeval_mode`` strict (the response as is)
  or loose (also the response without its first/last line or markdown ``*``), ``ifeval_score``
  partial (fraction of the record's instructions followed, 0..1) or all (1.0 only when every
  instruction is followed). The instruction ids of a record may come from both families.
- **math** (records with ``answer``): ``math-verify``; the gold answer is a GSM8K solution
  (the text after its last ``####``), or a final answer (number or LaTeX, e.g. MATH's
  ``\\frac{1}{2}``); the response's answer is the last ``\\boxed{}``/LaTeX/number it holds.
  Reward 1.0 when they are equal, else 0.0.

Offline NLTK: ``if-verifiable`` calls ``nltk.download`` when imported (refused here) and some
checkers need NLTK data (``punkt_tab``, ``stopwords``, ``averaged_perceptron_tagger_eng``).
Before importing it, :func:`nltk_offline` adds ``$NLTK_DATA`` (``<cache>/nltk_data``, filled by
``scripts/prepare_default.py``) to NLTK's search path and replaces ``nltk.download`` with a stub
that downloads nothing. A checker whose data is missing raises ``LookupError``: its record is
counted as ``checker_error:LookupError``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import threading
from collections import Counter
from typing import Any

from .stats import ScoreResult

log = logging.getLogger(__name__)

_skipped_downloads: list[str] = []


def _refuse_download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
    """Stand-in for ``nltk.download``: never fetches at run time; logs what was asked for."""
    _skipped_downloads.append(str(info_or_id))
    log.info("nltk.download(%r) skipped (offline). Run scripts/prepare_default.py to install NLTK data.", info_or_id)
    return False


_nltk_dirs_added: list[str] = []  # what nltk_offline put on NLTK's search path last time


def nltk_offline() -> None:
    """Make NLTK look in ``$NLTK_DATA``, then in ``<cache>/nltk_data``, and never download.

    Called before every scoring, not once per process: the folders follow the settings in force
    now (``NLTK_DATA``, ``ONLINE_RLHF_CACHE``), and the ones an earlier call added for other
    settings are taken off the path again. The cache's own folder is searched even when
    ``NLTK_DATA`` names another: :func:`online_rlhf.paths.setup_cache_env` sets ``NLTK_DATA`` from
    the cache of its time, which a later change of ``ONLINE_RLHF_CACHE`` in the same process
    leaves behind."""
    import nltk

    from .paths import cache_dir

    dirs = [d for d in os.environ.get("NLTK_DATA", "").split(os.pathsep) if d]
    dirs += [d for d in [str(cache_dir() / "nltk_data")] if d not in dirs]
    for d in _nltk_dirs_added:
        if d in nltk.data.path:
            nltk.data.path.remove(d)
    _nltk_dirs_added.clear()
    for d in reversed(dirs):
        if d not in nltk.data.path:  # one the user's NLTK setup already has stays where it is
            nltk.data.path.insert(0, d)
            _nltk_dirs_added.append(d)
    nltk.download = _refuse_download
    nltk.downloader.download = _refuse_download


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    """Instruction id -> checker class, IFEval's and IFBench's ids together (they do not overlap)."""
    nltk_offline()
    import langdetect

    from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT as IFBENCH
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT as IFEVAL

    langdetect.DetectorFactory.seed = 0  # langdetect is random unless seeded
    return {**IFBENCH, **IFEVAL}


def _last_user_text(prompt: list[dict]) -> str:
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


class Unscorable(Exception):
    """The record cannot be scored; ``reason`` is the key counted in the stats, ``detail`` what the
    example list shows beside the record's id (e.g. the argument a checker would draw)."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(reason if detail is None else f"{reason} ({detail})")
        self.reason, self.detail = reason, detail


def ifeval_rewards(record: dict, responses: list[str], mode: str = "loose", score: str = "partial") -> list[float]:
    """Instruction-following rewards of ``responses`` (K strings) for one prompt record, every
    response checked against the same arguments.

    Args:
        record: needs ``instruction_id_list`` (list of ids) and ``kwargs`` (one dict per id;
            ``None`` values are ignored) and ``prompt`` (messages; the last user turn is passed
            to checkers that compare with the prompt).
        mode: ``strict`` or ``loose``; score: ``partial`` (fraction followed) or ``all`` (0/1).
    Returns:
        K floats in [0, 1].
    Raises:
        Unscorable: a missing/bad field, an unknown instruction id, a checker error
            (``checker_error:<ExceptionType>``, e.g. ``LookupError`` when NLTK data is missing), or
            an argument the checker would draw at random instead of reading it from the record
            (``argument_drawn_by_checker``: unset, or a value the checker treats as unset or out of
            range; :func:`drawn_arguments`). Such a record asks for something its checker does not
            check, so its rewards would not measure the prompt.
    """
    ids, kwargs, prompt_text, registry = _ifeval_fields(record)
    drawn = _drawn(ids, kwargs, registry)
    if drawn:
        raise Unscorable("argument_drawn_by_checker", detail=drawn_text(drawn))
    key = f"{'partial' if score == 'partial' else 'binary'}_{mode}"
    return [float(getattr(_evaluate(record, resp, ids, kwargs, prompt_text, registry)[1], key)) for resp in responses]


def ifeval_instruction_results(record: dict, response: str) -> tuple[list[bool], list[bool]]:
    """Per-instruction outcomes of one response, for IFEval's four scores
    (:func:`online_rlhf.evaluation.ifeval_scores`): ``(strict, loose)``, one bool per id of the
    record's ``instruction_id_list``, in order. An empty response follows no instruction.

    The benchmark as shipped: an argument its checker draws at random (IFEval's ``letter_frequency``
    records with ``letter`` ``#`` or ``!``, which the checker reads as no letter) is drawn from the
    record's own seed, the same draw on every call (:func:`_evaluate`), never refused.

    Raises:
        Unscorable: as :func:`ifeval_rewards`, except ``argument_drawn_by_checker``.
    """
    ids, kwargs, prompt_text, registry = _ifeval_fields(record)
    results, _ = _evaluate(record, response, ids, kwargs, prompt_text, registry)
    if not results:  # if-verifiable returns no result for an empty response
        return [False] * len(ids), [False] * len(ids)
    if len(results) != len(ids):
        raise Unscorable("checker_error:missing_result")
    return [r.strict_pass for r in results], [r.loose_pass for r in results]


def _evaluate(record: dict, response: str, ids: list[str], kwargs: list[dict], prompt_text: str, registry: dict):
    """``if_verifiable.common.evaluate_instructions`` on one response, with ``random`` seeded from
    the record's id for the call: it builds every checker afresh, and a checker given no usable
    value for an argument draws one, so each response of a record meets the same draw, and every
    rerun the same (the caller's ``random`` state is given back).

    Raises:
        Unscorable: ``checker_error:<ExceptionType>``.
    """
    from if_verifiable.common import evaluate_instructions

    state = random.getstate()
    random.seed(_record_seed(record))
    try:
        return evaluate_instructions(response, ids, kwargs, prompt_text, registry)
    except Exception as e:  # noqa: BLE001 - any checker failure makes the record unscorable, counted
        raise Unscorable(f"checker_error:{type(e).__name__}") from e
    finally:
        random.setstate(state)


def _record_seed(record: dict) -> int:
    return int(hashlib.sha256(str(record.get("id")).encode()).hexdigest()[:16], 16)


def checker_draws(checker_class: Any, iid: str, kwargs: dict) -> list[str] | None:
    """Which arguments checker ``iid`` would draw at random when built with ``kwargs``.

    if-verifiable's ``build_description`` draws, from the ``random`` module, every argument it is not
    given or reads as unset or out of range (``if not n_start`` takes 0 for unset;
    ``ParagraphFirstWordCheck`` draws an ``nth_paragraph`` above ``num_paragraphs`` again). A draw
    is seen exactly, as a change of ``random``'s state during the build; the arguments named are
    those left unset, and those whose built value differs between 16 seeds (``["?"]`` when no seed
    shows which). The caller's ``random`` state is given back.

    Returns:
        None when the build draws nothing, else the drawn argument names.
    Raises:
        whatever the checker's ``build_description`` raises for these ``kwargs``.
    """
    state = random.getstate()
    try:
        builds = []
        for seed in range(16):
            random.seed(seed)
            before = random.getstate()
            checker = checker_class(iid)
            checker.build_description(**kwargs)
            if seed == 0 and random.getstate() == before:
                return None
            builds.append(checker.get_instruction_args() or {})
        keys = {k for b in builds for k in b}
        names = {k for k in keys if len({repr(b.get(k)) for b in builds}) > 1 or (k not in kwargs and builds[0].get(k) is not None)}
        return sorted(names) or ["?"]
    finally:
        random.setstate(state)


def drawn_arguments(record: dict) -> list[tuple[str, list[str]]]:
    """The arguments of an IFEval/IFBench record that its checkers would draw at random instead of
    reading them (:func:`checker_draws`), as ``[(instruction id, [argument names])]`` in the
    record's order; empty when none. A checker that fails to build is left out (scoring counts it).

    Raises:
        Unscorable: a missing/bad field or an unknown instruction id.
    """
    ids, kwargs, _, registry = _ifeval_fields(record)
    return _drawn(ids, kwargs, registry)


def _drawn(ids: list[str], kwargs: list[dict], registry: dict) -> list[tuple[str, list[str]]]:
    out = []
    for iid, kw in zip(ids, kwargs):
        try:
            names = checker_draws(registry[iid], iid, kw)
        except Exception:  # noqa: BLE001 - the scoring reports a checker that cannot be built
            continue
        if names:
            out.append((iid, names))
    return out


def drawn_text(drawn: list[tuple[str, list[str]]]) -> str:
    """:func:`drawn_arguments`' list in words: ``"<instruction id>: <arg>, <arg>; ..."``."""
    return "; ".join(f"{iid}: {', '.join(names)}" for iid, names in drawn)


def _ifeval_fields(record: dict) -> tuple[list[str], list[dict], str, dict]:
    """``(instruction ids, kwargs without None values, last user text, checker registry)`` of a record.

    Raises:
        Unscorable: a missing/bad field or an unknown instruction id.
    """
    registry = _registry()
    nltk_offline()
    ids, kwargs = record.get("instruction_id_list"), record.get("kwargs")
    if not isinstance(ids, list) or not ids:
        raise Unscorable("missing_field:instruction_id_list")
    if kwargs is None:
        kwargs = [{} for _ in ids]
    if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) or k is None for k in kwargs):
        raise Unscorable("bad_field:kwargs")
    unknown = [i for i in ids if i not in registry]
    if unknown:
        raise Unscorable(f"unknown_instruction:{unknown[0]}")
    kwargs = [{k: v for k, v in (kw or {}).items() if v is not None} for kw in kwargs]
    return ids, kwargs, _last_user_text(record.get("prompt") or []), registry


def gold_answer_text(answer: Any) -> str:
    """The final answer of a gold ``answer`` field: GSM8K's text after ``####`` (commas removed), else as is."""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].replace(",", "").strip()
    return text


def math_rewards(record: dict, responses: list[str]) -> list[float]:
    """1.0 for each response whose final answer equals the record's gold ``answer`` (math-verify), else 0.0.

    Raises:
        Unscorable: no ``answer`` (``missing_field:answer``) or a gold answer math-verify cannot
            parse into a math object (``gold_unparsable``): e.g. ``"???"`` parses to the bare string
            only, and would otherwise score every response 0 instead of being counted.
    """
    from math_verify import parse, verify

    if record.get("answer") in (None, ""):
        raise Unscorable("missing_field:answer")
    gold_text = gold_answer_text(record["answer"])
    # math-verify's timeouts use signals, which only work in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(gold_text if gold_text.startswith("$") or "\\boxed" in gold_text else f"${gold_text}$",
                 parsing_timeout=timeout)
    if not any(not isinstance(g, str) for g in gold):  # math-verify returns [sympy object, text]
        raise Unscorable("gold_unparsable")
    out = []
    for resp in responses:
        pred = parse(resp, parsing_timeout=timeout) if resp.strip() else []
        out.append(1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0)
    return out


def pick_verifier(record: dict, verifier: str = "auto") -> str:
    """``ifeval`` or ``math`` for a record; ``auto`` looks for ``instruction_id_list``, then ``answer``.

    Raises:
        Unscorable: ``auto`` and the record has neither field (``missing_field``).
    """
    if verifier != "auto":
        return verifier
    if "instruction_id_list" in record:
        return "ifeval"
    if "answer" in record:
        return "math"
    raise Unscorable("missing_field")


FIELDS_HELP = {
    "ifeval": "instruction_id_list (a non-empty list of IFEval/IFBench instruction ids) + kwargs (one object of "
              "arguments per id, or null)",
    "math": "answer (the gold answer: a GSM8K solution ending in '#### 42', a number or LaTeX)",
}


def missing_fields(record: dict, verifier: str = "auto") -> str | None:
    """What a prompt (or generated) record lacks for ``verifier`` to score it, in words; None when
    its fields are there (the checks of :func:`pick_verifier`, :func:`_ifeval_fields` and
    :func:`math_rewards` that need no checker; :func:`instruction_problem` checks the ids and kwargs).

    ``auto`` needs ``instruction_id_list`` (then as ``ifeval``) or ``answer`` (then as ``math``).
    """
    if verifier == "auto":
        if "instruction_id_list" in record:
            verifier = "ifeval"
        elif "answer" in record:
            verifier = "math"
        else:
            return "instruction_id_list + kwargs (verifier=ifeval) or answer (verifier=math)"
    if verifier == "math":
        return None if record.get("answer") not in (None, "") else "answer (it is missing or empty)"
    ids, kwargs = record.get("instruction_id_list"), record.get("kwargs")
    if not isinstance(ids, list) or not ids:
        return "instruction_id_list (it is missing, empty or not a list)"
    if kwargs is not None and (not isinstance(kwargs, list) or len(kwargs) != len(ids)
                               or not all(isinstance(k, dict) or k is None for k in kwargs)):
        return f"kwargs as one object (or null) per instruction id ({len(ids)} of them)"
    return None


def instruction_problem(record: dict) -> str | None:
    """What is wrong, in words, with an IFEval/IFBench record whose fields are there
    (:func:`missing_fields` gives None): an instruction id no checker of the registry has, or a
    kwargs key its checker's ``build_description`` does not take, or kwargs with which the checker
    fails to build or fails on any answer (:func:`_build_problem`): the checker would fail on every
    response (``checker_error:<type>``). None when none of these.
    """
    import difflib
    import inspect

    registry = _registry()
    ids, kwargs = record["instruction_id_list"], record.get("kwargs") or [None] * len(record["instruction_id_list"])
    for iid, kw in zip(ids, kwargs):
        if iid not in registry:
            near = difflib.get_close_matches(str(iid), list(registry), n=1)
            return (f"instruction id {iid!r}, which no IFEval or IFBench checker has"
                    + (f" (did you mean {near[0]!r}?)" if near else ""))
        params = inspect.signature(registry[iid](iid).build_description).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        extra = sorted(k for k, v in (kw or {}).items() if v is not None and k not in params)
        if extra:
            return (f"kwargs {', '.join(extra)} for {iid!r}, which its checker does not take (it takes "
                    f"{', '.join(params) or 'none'})")
        if problem := _build_problem(registry[iid], iid, {k: v for k, v in (kw or {}).items() if v is not None},
                                     _last_user_text(record["prompt"]) if isinstance(record.get("prompt"), list)
                                     else str(record.get("prompt", ""))):
            return problem
    return None


def _build_problem(checker_class: Any, iid: str, kwargs: dict, prompt_text: str) -> str | None:
    """Why checker ``iid`` fails with ``kwargs`` whatever the response, or None: its build raises (a
    relation other than "less than"/"at least", a missing ``prompt_to_repeat``), or checking a plain
    answer raises TypeError (an argument of the wrong type, e.g. ``num_words: "50"``). Built as
    if-verifiable's ``evaluate_instructions`` builds it (the prompt given where the checker takes
    one). Other errors of a check depend on the response or the machine (NLTK data) and are left to
    the scoring. The caller's ``random`` state is given back."""
    state = random.getstate()
    random.seed(0)
    try:
        try:
            checker = checker_class(iid)
            checker.build_description(**kwargs)
            args = checker.get_instruction_args()
            if args and "prompt" in args:
                checker.build_description(prompt=prompt_text)
        except Exception as e:  # noqa: BLE001 - every response would be checker_error: say so before scoring
            return f"kwargs {kwargs} for {iid!r}, with which its checker fails to build ({type(e).__name__}: {e})"
        try:
            checker.check_following("A plain answer of a few words.")
        except TypeError as e:
            return f"kwargs {kwargs} for {iid!r}, with which its checker fails on every answer (TypeError: {e})"
        except Exception:  # noqa: BLE001 - response- or machine-dependent: the scoring counts it per record
            pass
    finally:
        random.setstate(state)
    return None


def score(records: list[dict], cfg) -> ScoreResult:
    """Rule-based rewards of generated records.

    Args:
        records: generated records ``{id, prompt: [messages], responses: [K str], finish_reasons,
            ...task fields}`` (``instruction_id_list`` + ``kwargs`` or ``answer``).
        cfg: a :class:`~online_rlhf.stage_configs.RewardConfig` (``verifier``, ``ifeval_mode``,
            ``ifeval_score``).
    Returns:
        :class:`~online_rlhf.stats.ScoreResult`: ``rewards[i]`` is a list of K floats in [0, 1] for
        record i, or ``None`` when it cannot be scored (counted in ``skipped`` by reason, e.g.
        ``checker_error:LookupError``; the rewards stage lists their ids);
        ``source_stats`` = ``{"records", "scored", "by_verifier": {name: n}}`` (+ ``nltk_downloads_refused``).
    """
    out: list[list[float] | None] = []
    by_verifier: Counter = Counter()
    unscorable: Counter = Counter()
    examples: dict[str, list[str]] = {}
    for rec in records:
        try:
            kind = pick_verifier(rec, cfg.verifier)
            if kind == "ifeval":
                r = ifeval_rewards(rec, rec["responses"], cfg.ifeval_mode, cfg.ifeval_score)
            else:
                r = math_rewards(rec, rec["responses"])
            by_verifier[kind] += 1
        except Unscorable as e:
            unscorable[e.reason] += 1
            if len(examples.setdefault(e.reason, [])) < 5:  # up to 5 ids per reason, with the detail where known
                examples[e.reason].append(str(rec.get("id")) if e.detail is None else f"{rec.get('id')} ({e.detail})")
            if e.__cause__ is not None:
                log.debug("record %r unscorable: %s", rec.get("id"), e.__cause__)
            r = None
        out.append(r)
    source_stats = {"records": len(records), "scored": sum(r is not None for r in out), "by_verifier": dict(by_verifier)}
    if _skipped_downloads:
        source_stats["nltk_downloads_refused"] = sorted(set(_skipped_downloads))
    return ScoreResult(rewards=out, skipped=unscorable, examples=examples, source_stats=source_stats)
