"""Instruction-following training prompts: any prompt set, each prompt given 1..N verifiable
constraints sampled from IFEval's instruction registry (the recipe of Tulu 3's RLVR-IFeval data,
Lambert et al. 2024, arXiv 2411.15124; and of IFBench's IF-RLVR data, Pyatkin et al. 2025,
arXiv 2507.02833).

    .venv-train/bin/python scripts/build_if_prompts.py input=my_prompts.jsonl output=if_prompts.jsonl
    .venv-train/bin/python scripts/build_if_prompts.py output=if_prompts.jsonl n=1200   # built-in templates

For each base prompt (its last user turn):

1. a generator seeded by ``(seed, base id)`` draws how many constraints it gets
   (``min_constraints``..``max_constraints``) and which instruction ids, in a random order, never two
   that the registry declares as conflicting (``INSTRUCTION_CONFLICTS`` of
   ``if_verifiable.ifeval.instructions_registry``, made symmetric as its ``conflict_make`` does);
2. each chosen checker's own ``build_description()`` samples fresh kwargs and writes the
   constraint's text (``combination:repeat_prompt`` repeats the base prompt); its
   ``get_instruction_args()`` are the record's ``kwargs``, kept only when the checker, built with
   them, draws nothing and gives them back unchanged, and some answer can meet them
   (:func:`argument_problem`; else drawn again, up to :data:`MAX_DRAWS` times, and counted);
3. the texts are appended to the prompt, and the record gets ``instruction_id_list`` + ``kwargs``
   in the prompt-set format the loop's verifier scores as it stands.

Decontamination (``decontaminate``, on by default against the 541 IFEval prompts): a base prompt
that shares any word n-gram (``ngram``, default 8; words are lower-cased ``\\w+`` runs) with any
IFEval prompt is dropped and counted. The constraint sentences themselves are the registry's
descriptions, which IFEval's prompts were written from; they are shared by construction, as in
Tulu 3's data, and are not what decontamination is about (the task a prompt asks for is).

The same seed, input and settings give the same output, byte for byte.

The built-in base prompts (``input=null``) are this project's own templates
(:data:`TASKS` x :data:`TOPICS`: a writing task about a topic, e.g. "Write a short blog post about
the history of tea."), so the default needs no data set: IFEval's types on other prompts.
"""

from __future__ import annotations

import random
import re
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from pydantic import Field, model_validator

from .config import ConfigError, StageConfig

# ---------------------------------------------------------------------------------------- templates
# The project's own base tasks: {t} is a topic from TOPICS. Written for this project (no data set).
TASKS = (
    "Write a short blog post about {t}.",
    "Write a poem about {t}.",
    "Write a short story that involves {t}.",
    "Write a letter to a friend about {t}.",
    "Write an email to your manager about {t}.",
    "Write a product description for a new gadget related to {t}.",
    "Write a riddle about {t}.",
    "Write a limerick about {t}.",
    "Write a short speech about {t} for a school assembly.",
    "Write an advertisement for a local business that is connected to {t}.",
    "Give me a list of tips about {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a short essay on {t}.",
    "Write a dialogue between two friends discussing {t}.",
    "Write song lyrics about {t}.",
    "Write a review of an imaginary book about {t}.",
    "Write a news headline and a short article about {t}.",
    "Write a cover letter for a job that has to do with {t}.",
    "Summarize the main arguments for and against {t}.",
    "Write a diary entry about a day spent thinking about {t}.",
    "Describe {t} in the style of a travel guide.",
    "Write a joke about {t}.",
    "Write a haiku sequence about {t}.",
    "Write a pitch for a startup that works on {t}.",
    "Write a social media post announcing an event about {t}.",
    "Write a short biography of a fictional person who loves {t}.",
    "Write a lesson plan outline for teaching {t}.",
    "Write a complaint letter about {t}.",
    "Write a motivational message about {t}.",
    "Write a recipe-style guide to {t}.",
    "Write a short play scene about {t}.",
    "Write an FAQ about {t}.",
    "Describe the history of {t}.",
    "Write a persuasive paragraph on why people should care about {t}.",
    "Compare two different views on {t}.",
    "Write a thank-you note to someone who taught you about {t}.",
    "Write a rap verse about {t}.",
    "Write a fairy tale that features {t}.",
    "Write an interview with an expert on {t}.",
    "Write a newsletter introduction about {t}.",
)

TOPICS = (
    "the history of tea", "learning to swim", "a rainy afternoon", "city gardens", "saving money",
    "the night sky", "a lost umbrella", "public libraries", "electric bicycles", "the ocean tides",
    "baking bread", "a first day at a new job", "mountain hiking", "recycling at home", "old maps",
    "the life of bees", "playing chess", "winter mornings", "street food", "learning a new language",
    "a broken clock", "volcanoes", "friendship", "the invention of the printing press", "solar panels",
    "a birthday surprise", "desert plants", "train journeys", "video games", "healthy breakfasts",
    "a small bakery", "the moon landing", "time management", "lighthouses", "jazz music",
    "a family reunion", "coral reefs", "remote work", "a robot that learns to paint", "autumn leaves",
    "coffee", "the water cycle", "ancient Rome", "a marathon", "bird watching", "kindness to strangers",
    "a haunted house", "board games", "a village festival", "space telescopes",
)


def template_prompts(n: int | None = None, seed: int = 0) -> list[dict]:
    """The built-in base prompts: every (task, topic) pair of :data:`TASKS` x :data:`TOPICS`, in an
    order shuffled by ``seed``; the first ``n`` (None: all, 2,000).

    Returns:
        prompt-set rows ``{id: "tpl-<task>-<topic>", prompt: [{role: user, content}]}``.
    Raises:
        ConfigError: ``n`` above the number of pairs.
    """
    pairs = [(a, b) for a in range(len(TASKS)) for b in range(len(TOPICS))]
    if n is not None and n > len(pairs):
        raise ConfigError(f"n={n}: the built-in templates make {len(pairs)} prompts; give input=<your prompt set> "
                          f"for more, or n<={len(pairs)}.")
    random.Random(f"if-templates:{seed}").shuffle(pairs)
    return [{"id": f"tpl-{a:02d}-{b:02d}", "prompt": [{"role": "user", "content": TASKS[a].format(t=TOPICS[b])}]}
            for a, b in pairs[:n]]


# ---------------------------------------------------------------------------------------- config
class IFPromptsConfig(StageConfig):
    """scripts/build_if_prompts.py: a prompt set with 1..N IFEval constraints per prompt (Tulu 3's recipe)."""

    input: Optional[str] = Field(None, description="base prompt set (JSONL/JSON/parquet with messages or prompt); null: the built-in templates")
    prompt_field: Optional[str] = Field(None, description="the prompt column when it is neither messages nor prompt (e.g. instruction)")
    output: str = Field(..., description="the IF prompt set to write (JSONL: id, messages, instruction_id_list, kwargs, base_id)")
    n: Optional[int] = Field(None, ge=1, description="base prompts to take (the first n after decontamination); null: all")
    min_constraints: int = Field(1, ge=1, description="fewest constraints per prompt")
    max_constraints: int = Field(2, ge=1, description="most constraints per prompt (drawn uniformly in min..max)")
    exclude: list[str] = Field(default_factory=list, description="instruction ids never sampled (e.g. [language:response_language])")
    decontaminate: Optional[str] = Field("default", description="prompts whose word n-grams no base prompt may share ('default' = the prepared IFEval set .cache/data/ifeval.jsonl; null: off)")
    ngram: int = Field(8, ge=1, description="n of the decontamination word n-grams")
    seed: int = Field(0, description="seeds the template order and every constraint draw")

    @model_validator(mode="after")
    def _check(self):
        if self.max_constraints < self.min_constraints:
            raise ValueError(f"max_constraints={self.max_constraints} is below min_constraints={self.min_constraints}")
        return self


# ---------------------------------------------------------------------------------------- sampling
def registry() -> tuple[dict, dict[str, set[str]]]:
    """IFEval's checker classes and their conflicts, as if-verifiable ships them: ``(INSTRUCTION_DICT,
    conflicts)`` where ``conflicts[a]`` holds every id that may not be combined with ``a`` (made
    symmetric and reflexive, as the registry's ``conflict_make`` does; the module's dict is not changed)."""
    from .verifiers import nltk_offline

    nltk_offline()
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS, INSTRUCTION_DICT

    conflicts = {k: set(v) | {k} for k, v in INSTRUCTION_CONFLICTS.items()}
    for k, vs in list(conflicts.items()):
        for v in vs:
            conflicts.setdefault(v, {v}).add(k)
    return INSTRUCTION_DICT, conflicts


@contextmanager
def _global_random(seed: int) -> Iterator[None]:
    """The registry's ``build_description`` draws from the ``random`` module: seed it, then give
    the caller's state back."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def unsatisfiable(iid: str, kwargs: dict) -> bool:
    """Whether a drawn constraint cannot be met by any answer: the registry's sampler can ask for
    "less than 1" sentence or word (``length_constraints:number_sentences``/``number_words`` with
    ``relation: less than`` and a count of 1), which only an empty answer would pass."""
    count = kwargs.get("num_sentences", kwargs.get("num_words"))
    return (iid in ("length_constraints:number_sentences", "length_constraints:number_words")
            and kwargs.get("relation") == "less than" and count is not None and count <= 1)


MAX_DRAWS = 32  # draws of one constraint's kwargs before it is left out (counted)
BUILT_FIELDS = ("messages", "base_id")  # written by build(); an input column of that name is replaced, counted


def argument_problem(checker_class, iid: str, kwargs: dict) -> str | None:
    """Why a constraint's drawn ``kwargs`` cannot go into a record, or None when they can.

    - ``unsatisfiable``: no answer can meet them (:func:`unsatisfiable`);
    - ``argument_drawn_by_checker``: the checker, built with them, would draw an argument again
      at every scoring (:func:`online_rlhf.verifiers.checker_draws`): ``ParagraphFirstWordCheck``'s
      sampler asks for paragraph N+1 of N once in N+1 draws, and its builder reads that as unset;
    - ``arguments_not_round_trip``: built with them, the checker's ``get_instruction_args()`` gives
      other values back, so the record would not say what the checker checks.
    """
    from .verifiers import checker_draws

    if unsatisfiable(iid, kwargs):
        return "unsatisfiable"
    if checker_draws(checker_class, iid, kwargs):
        return "argument_drawn_by_checker"
    checker = checker_class(iid)
    checker.build_description(**kwargs)
    back = {a: v for a, v in (checker.get_instruction_args() or {}).items() if v is not None}
    return None if back == kwargs else "arguments_not_round_trip"


def sample_constraints(base_text: str, rng: random.Random, k: int, ids: list[str], checkers: dict,
                       conflicts: dict[str, set[str]], redrawn: Counter | None = None,
                       dropped: Counter | None = None) -> tuple[list[str], list[dict], list[str]]:
    """Up to ``k`` mutually compatible constraints for one prompt, each with kwargs its checker
    reads back as drawn (:func:`argument_problem`).

    Args:
        base_text: the prompt's text (``combination:repeat_prompt`` asks to repeat it).
        rng: the prompt's own generator (its draws decide the ids and, through the ``random``
            module seeded from it, each checker's kwargs).
        k: how many constraints to draw; fewer come back only when no compatible id is left, or
            when a constraint found no valid kwargs in :data:`MAX_DRAWS` draws.
        ids: the ids that may be drawn (in registry order).
        checkers, conflicts: from :func:`registry`.
        redrawn: counts, per ``(reason, instruction id)``, the kwargs drawn again because
            :func:`argument_problem` refused them.
        dropped: counts, per ``(reason, instruction id)``, the constraints left out after
            :data:`MAX_DRAWS` refused draws (the last draw's reason).
    Returns:
        ``(instruction ids, kwargs per id, description per id)``; ``repeat_prompt`` is put last, so
        that the text it asks to repeat is the request before it.
    """
    order = list(ids)
    rng.shuffle(order)
    chosen: list[str] = []
    for iid in order:
        if len(chosen) == k:
            break
        if all(iid not in conflicts.get(c, {c}) and c not in conflicts.get(iid, {iid}) for c in chosen):
            chosen.append(iid)
    chosen.sort(key=lambda i: i == "combination:repeat_prompt")
    kept, kwargs, texts = [], [], []
    for iid in chosen:
        for _ in range(MAX_DRAWS):
            checker = checkers[iid](iid)
            with _global_random(rng.getrandbits(64)):
                if iid == "combination:repeat_prompt":
                    text = checker.build_description(prompt_to_repeat=base_text)
                else:
                    text = checker.build_description()
                args = {a: v for a, v in (checker.get_instruction_args() or {}).items() if v is not None}
            problem = argument_problem(checkers[iid], iid, args)
            if problem is None:
                kept.append(iid)
                kwargs.append(args)
                texts.append(text)
                break
            if redrawn is not None:
                redrawn[(problem, iid)] += 1
        else:
            if dropped is not None:
                dropped[(problem, iid)] += 1
    return kept, kwargs, texts


def _by_reason(counts: Counter) -> dict[str, dict[str, int]]:
    """``{(reason, id): n}`` as ``{reason: {id: n}}``, sorted."""
    out: dict[str, dict[str, int]] = {}
    for (reason, iid), n in sorted(counts.items()):
        out.setdefault(reason, {})[iid] = n
    return out


# ---------------------------------------------------------------------------------------- decontamination
_WORD = re.compile(r"\w+")


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The word ``n``-grams of ``text`` (lower-cased ``\\w+`` runs); empty when it has fewer words."""
    w = _WORD.findall(text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def contamination_index(rows: list[dict], n: int) -> set[tuple[str, ...]]:
    """Every word n-gram of every user turn of ``rows`` (prompt-set records)."""
    grams: set[tuple[str, ...]] = set()
    for r in rows:
        for m in r["prompt"]:
            if m["role"] == "user":
                grams |= word_ngrams(m["content"], n)
    return grams


# ---------------------------------------------------------------------------------------- build
def build(base: list[dict], cfg: IFPromptsConfig, against: list[dict] | None) -> tuple[list[dict], dict]:
    """IF prompts from base prompt-set rows (see the module docstring).

    Args:
        base: normalized prompt-set rows ``{id, prompt: [messages], ...}``.
        cfg: the settings.
        against: the prompt-set rows to decontaminate against (None: no decontamination).
    Returns:
        ``(records, stats)``: records ``{id, messages, instruction_id_list, kwargs, base_id}`` (the
        input's other fields kept); stats count what came in, what went out, every skip by reason
        (``contaminated``: shares an n-gram; ``already_constrained``: the row carries its own
        ``instruction_id_list`` or ``kwargs``; ``no_valid_constraint``: its only constraint found no valid kwargs),
        the base prompts left unread once ``n`` prompts were built (``base_prompts_not_read``), the
        input columns the builder writes itself and replaced (``input_fields_replaced``, e.g.
        ``base_id`` or ``messages``: the builder's value wins), the
        constraints per prompt, the prompts per instruction id, and the kwargs drawn again
        (``arguments_redrawn``) or constraints left out (``constraints_dropped``) by
        :func:`argument_problem`'s reason and instruction id.
    Raises:
        ConfigError: an ``exclude`` id that the registry does not have, or nothing left to sample.
    """
    checkers, conflicts = registry()
    unknown = [i for i in cfg.exclude if i not in checkers]
    if unknown:
        raise ConfigError(f"exclude: unknown IFEval instruction id(s) {unknown}; known: {', '.join(checkers)}.")
    ids = [i for i in checkers if i not in cfg.exclude]
    if not ids:
        raise ConfigError("exclude: every IFEval instruction id is excluded; nothing to sample.")
    grams = contamination_index(against, cfg.ngram) if against is not None else set()
    skipped: Counter = Counter()
    examples: dict[str, list[str]] = {}
    out: list[dict] = []
    per_prompt: Counter = Counter()
    per_id: Counter = Counter()
    short = 0
    redrawn: Counter = Counter()
    dropped: Counter = Counter()
    replaced: Counter = Counter()
    read = 0

    def skip(reason: str, row: dict) -> None:
        skipped[reason] += 1
        if len(examples.setdefault(reason, [])) < 5:
            examples[reason].append(str(row["id"]))

    for row in base:
        if cfg.n is not None and len(out) >= cfg.n:
            break
        read += 1
        reason = None
        if row.get("instruction_id_list") is not None or row.get("kwargs") is not None:
            reason = "already_constrained"
        elif grams and any(word_ngrams(m["content"], cfg.ngram) & grams for m in row["prompt"] if m["role"] == "user"):
            reason = "contaminated"
        if reason:
            skip(reason, row)
            continue
        rng = random.Random(f"if-prompts:{cfg.seed}:{row['id']}")
        text = row["prompt"][-1]["content"].strip()
        k = rng.randint(cfg.min_constraints, cfg.max_constraints)
        chosen, kwargs, texts = sample_constraints(text, rng, k, ids, checkers, conflicts, redrawn, dropped)
        if not chosen:  # its only constraint found no valid kwargs (constraints_dropped says which)
            skip("no_valid_constraint", row)
            continue
        messages = [dict(m) for m in row["prompt"]]
        if text and text[-1].isalnum():  # "... the throne" + "Your entire response ...": end the task's sentence first
            text += "."
        messages[-1]["content"] = " ".join([text, *texts])
        extra = {k2: v for k2, v in row.items() if k2 not in ("id", "prompt")}
        replaced.update(k2 for k2 in extra if k2 in BUILT_FIELDS)  # the builder's own value wins, counted
        out.append({**extra, "id": f"if-{row['id']}", "messages": messages, "instruction_id_list": chosen,
                    "kwargs": kwargs, "base_id": str(row["id"])})
        per_prompt[len(chosen)] += 1
        per_id.update(chosen)
        if len(chosen) < cfg.min_constraints:  # no compatible id left, or one dropped: counted, never silent
            short += 1
    stats = {"base_prompts_in": len(base), "n": cfg.n, "base_prompts_not_read": len(base) - read,
             "prompts_out": len(out), "skipped": dict(skipped),
             "skipped_examples": examples, "constraints_per_prompt": {str(k): v for k, v in sorted(per_prompt.items())},
             "prompts_per_instruction": dict(sorted(per_id.items())),
             "prompts_below_min_constraints": short, "input_fields_replaced": dict(replaced),
             "arguments_redrawn": _by_reason(redrawn), "constraints_dropped": _by_reason(dropped),
             "decontamination": None if against is None else {"against_prompts": len(against), "ngram": cfg.ngram,
                                                              "ngrams": len(grams)},
             "seed": cfg.seed, "min_constraints": cfg.min_constraints, "max_constraints": cfg.max_constraints,
             "exclude": list(cfg.exclude)}
    return out, stats


def main(cfg: IFPromptsConfig) -> dict:
    """Read the base prompts (or the templates), build, write ``cfg.output`` and its stats
    (``<output>.stats.json``); returns the stats.

    Raises:
        DataError / FileNotFoundError: a bad or missing input or decontamination file (names it);
        ConfigError: as :func:`build`, or ``decontaminate=default`` before the IFEval prompts are
            prepared.
    """
    from .jsonl import write_json, write_jsonl
    from .paths import default_data_dir, setup_cache_env
    from .records import load_prompts
    from .stats import stats_path

    setup_cache_env()
    base = template_prompts(seed=cfg.seed) if cfg.input is None else load_prompts(cfg.input, prompt_field=cfg.prompt_field)
    against = None
    if cfg.decontaminate:
        path = default_data_dir() / "ifeval.jsonl" if cfg.decontaminate == "default" else cfg.decontaminate
        if cfg.decontaminate == "default" and not path.is_file():
            raise ConfigError(f"decontaminate=default: {path} is missing; run .venv-train/bin/python "
                              "scripts/prepare_default.py first, or give decontaminate=<file> (or null: off).")
        against = load_prompts(path)
    if cfg.input is not None and Path(cfg.output).resolve() == Path(cfg.input).resolve():
        raise ConfigError(f"output={cfg.output} is the input file; write the IF prompts to another file.")
    if Path(cfg.output).is_dir():
        raise ConfigError(f"output={cfg.output} is a folder; give a file name, e.g. {Path(cfg.output) / 'if_prompts.jsonl'}.")
    if Path(cfg.output).suffix != ".jsonl":
        raise ConfigError(f"output={cfg.output}: the IF prompts are written as JSONL; name the file *.jsonl.")
    records, stats = build(base, cfg, against)
    for name, count in stats["input_fields_replaced"].items():
        print(f"warning: {cfg.input}: {count} row(s) have a '{name}' column, which the builder writes itself; "
              f"its own value replaced yours (rename the column to keep it).", file=sys.stderr)
    if stats["prompts_below_min_constraints"]:
        print(f"warning: {stats['prompts_below_min_constraints']} prompt(s) got fewer than min_constraints="
              f"{cfg.min_constraints} constraints: the registry's conflicts left no compatible instruction id for them, "
              f"or a constraint found no valid kwargs in {MAX_DRAWS} draws (prompts_below_min_constraints and "
              "constraints_dropped in the stats).", file=sys.stderr)
    if not records:
        from .jsonl import DataError

        raise DataError(f"{cfg.input or 'the built-in templates'}: no prompt left (skipped: {stats['skipped']}).")
    stats = {"input": cfg.input or "built-in templates (online_rlhf.if_prompts)", "output": cfg.output, **stats}
    write_jsonl(cfg.output, records)
    write_json(stats_path(cfg.output), stats)
    unread = f"; {stats['base_prompts_not_read']} not read after n={cfg.n}" if stats["base_prompts_not_read"] else ""
    print(f"build_if_prompts: {len(records)} prompts from {stats['base_prompts_in']} base prompts "
          f"(skipped {stats['skipped'] or 0}{unread}; constraints per prompt {stats['constraints_per_prompt']}) -> {cfg.output}",
          file=sys.stderr)
    return stats


def cli() -> None:
    """Command-line entry point (scripts/build_if_prompts.py calls this)."""
    from .config import run_main

    run_main(main, IFPromptsConfig)
