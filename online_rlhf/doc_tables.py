"""The key and stats tables of the docs pages, generated from the classes that define them.

Each stage page under ``docs/`` holds, between two marker comments, a Markdown table of its config
class (``online_rlhf.stage_configs``: key, type, default, description, and the loop key that sets
it) and one of its stats class (``online_rlhf.stats``: key, type)::

    <!-- keys:dpo start -->
    ...generated table...
    <!-- keys:dpo end -->

The classes are the one source of these facts; a page's prose around the tables is written by hand.
:data:`PAGES` says which page documents which rows of the stage table and which tables it holds: a
stage's page (its row's ``page``, by default ``docs/<name>.md``) gets a key table of its config class
and a stats table of its stats class without a line here.

The lists that name every stage on pages that are not a stage's (:data:`INDEXES`) are generated
from the stage table too, between ``<!-- index:<name> start -->`` / ``end`` markers: the stage
pages' links in ``docs/README.md``, the stage list and the list of stats classes in
``docs/architecture.md``.

    python -m online_rlhf.doc_tables --write    # rewrite every table and list in place
    python -m online_rlhf.doc_tables --check    # exit 1, naming each one that disagrees with its source

``tests/test_docs.py`` runs the check and also fails when a stage of
:data:`online_rlhf.stage_table.STAGES` has no page. Importable without torch or vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from pydantic import BaseModel

from .config import StageConfig
from .paths import PROJECT_ROOT
from .loop_config import LOOP_OWNED, LoopConfig
from .stage_configs import IFEvalSection, SFTDataConfig
from .stage_table import STAGES, Stage
from .stages.reward_server import ServeConfig
from .stats import GenerateShardStats, SFTDataStats


@dataclass(frozen=True)
class Table:
    """One generated table of a page.

    Attributes:
        name: the marker's name (``<!-- keys:<name> start -->``), unique over all pages.
        kind: ``keys`` (a config class) or ``stats`` (a stats class).
        cls: the pydantic class the table is rendered from.
        sections: the loop sections whose keys feed this config (``("dpo",)``), for the column
            "set in the loop as"; empty when no loop section does.
        stage: the stage-table row whose ``build`` sets the keys of a config with no loop section
            (the column then says which keys the plan sets and which keep their default).
    """

    name: str
    kind: Literal["keys", "stats"]
    cls: type[BaseModel]
    sections: tuple[str, ...] = ()
    stage: Optional[str] = None


@dataclass(frozen=True)
class Page:
    """A docs page and what it documents: ``path`` (from the project root), the rows of the stage
    table it is the page of (``stages``; none for a page that is not a stage's) and its tables."""

    path: str
    stages: tuple[str, ...]
    tables: tuple[Table, ...]


def _dict_section(name: str) -> bool:
    """Whether the loop section ``name`` is a plain mapping (``sft``: Axolotl's keys), not a typed section."""
    return typing.get_origin(LoopConfig.model_fields[name].annotation) is dict


def stage_page(path: str, extra: tuple[Table, ...] = ()) -> Page:
    """The page ``path`` of the stage table's rows whose :attr:`Stage.docs_page` it is: a key table
    of each of their config classes (named after the page: ``docs/ifeval-score.md`` ->
    ``ifeval_score``), "in the loop" by the rows' own typed or mapping sections (else by the first
    row's ``build``), and a stats table of each of their stats classes; then ``extra``.

    Raises:
        ValueError: no row of the stage table has that page.
    """
    rows = [s for s in STAGES.values() if s.docs_page == path]
    if not rows:
        raise ValueError(f"{path}: no stage of the stage table has this page")
    stem = Path(path).stem.replace("-", "_")
    tables: list[Table] = []
    for kind, classes in (("keys", [s.config for s in rows]), ("stats", [s.stats for s in rows])):
        for n, cls in enumerate(dict.fromkeys(classes)):
            mine = [s for s in rows if (s.config if kind == "keys" else s.stats) is cls]
            name = stem if n == 0 else f"{stem}_{mine[0].name}"
            if kind == "stats":
                tables.append(Table(name, "stats", cls))
                continue
            sections = tuple(dict.fromkeys(s.section for s in mine if s.section and (
                s.section in LOOP_OWNED or _dict_section(s.section))))
            tables.append(Table(name, "keys", cls, sections, None if sections else mine[0].name))
    return Page(path, tuple(s.name for s in rows), (*tables, *extra))


# Tables of a stage page beyond its rows' classes, and the pages that are not a stage's.
_EXTRA_TABLES: dict[str, tuple[Table, ...]] = {
    "docs/generation.md": (Table("generation_shard", "stats", GenerateShardStats),),
    "docs/sft.md": (Table("sft_data", "keys", SFTDataConfig), Table("sft_data", "stats", SFTDataStats)),
}
_OTHER_PAGES: tuple[Page, ...] = (
    Page("docs/custom.md", (), (Table("loop", "keys", LoopConfig),)),
    Page("docs/evaluation.md", (), (Table("ifeval_section", "keys", IFEvalSection, ("ifeval",)),)),
    Page("docs/reward-server.md", (), (Table("reward_server", "keys", ServeConfig),)),
)
# Every page with generated tables: one per stage page of the stage table (in its order), then the others.
PAGES: tuple[Page, ...] = (*(stage_page(path, _EXTRA_TABLES.get(path, ()))
                             for path in dict.fromkeys(s.docs_page for s in STAGES.values())), *_OTHER_PAGES)

# Keys of the loop's `sft` section that the loop sets itself (online_rlhf.loop_keys refuses them
# there); the section has no class of its own, so LOOP_OWNED has no entry for it.
_SFT_OWNED = ("base_model", "output_dir", "dry_run")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: on one line, ``|`` escaped, and outside code spans
    ``\\``, ``<`` and ``*`` escaped so that ``<output>`` or ``*.safetensors`` render as written."""
    parts = " ".join(str(text).split()).split("`")
    for i, part in enumerate(parts):
        if i % 2 == 0:  # outside a code span
            part = part.replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*")
        parts[i] = part.replace("|", "\\|")
    return "`".join(parts)


def summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring on one line, RST double backticks as Markdown's single."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "`")


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def type_name(annotation: Any) -> str:
    """A field's type in words: ``int``, ``float or null``, ``cpu / zero2 / zero3`` (a Literal),
    ``mapping``, ``list of str``, ``section`` (a loop section typed by a stage class), ``object: a, b``
    (a nested model with fixed keys)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " / ".join(str(a) for a in args)
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        rest = [a for a in args if a is not type(None)]
        text = " / ".join(type_name(a) for a in rest)
        return f"{text} or null" if len(rest) < len(args) else text
    if origin in (dict, typing.Dict):
        return "mapping"
    if origin in (list, typing.List, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if _is_model(annotation):
        if not issubclass(annotation, StageConfig):
            return "object: " + ", ".join(annotation.model_fields)
        return "section"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _value(v: Any) -> str:
    """A default as YAML would write it in one line: ``null``, ``true``, ``2e-05``, ``{k: 1}``."""
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json", exclude_unset=True)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, str):
        return v if v else '""'
    return json.dumps(v)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return "`" + _value(value).replace("|", "\\|") + "`"


def _planned_keys(stage: str) -> set[str]:
    """The keys the loop's plan writes for ``stage`` (its row's ``build`` on the default loop config)."""
    return set(STAGES[stage].build(LoopConfig(), Path("/run"), 1))


def _loop_column(table: Table, key: str, planned: set[str]) -> str:
    """Where the loop sets ``key`` of ``table``'s config: its section keys (``dpo.beta``), ``the
    plan`` (the loop writes it itself, from the run layout or a top-level key), or ``-`` (the loop
    leaves the stage's default; set it by hand)."""
    if table.sections == ("ifeval",):
        return f"`ifeval.{key}`"
    if table.sections:
        owned = _SFT_OWNED if table.sections == ("sft",) else LOOP_OWNED[table.sections[0]]
        return "the plan" if key in owned else ", ".join(f"`{s}.{key}`" for s in table.sections)
    return "the plan" if key in planned else "-"


def render(table: Table) -> str:
    """The Markdown of ``table``: the text between its two markers, newline-terminated."""
    cls = table.cls
    doc = summary(cls)
    where = cls.__module__.replace(".", "/") + ".py"
    lines = [f"<!-- generated by `python -m online_rlhf.doc_tables --write` from {cls.__name__}; edit the class, "
             "not this table -->"]
    if table.kind == "stats":
        lines += [f"`{cls.__name__}` ({where}), written by {_cell(getattr(cls, 'WRITTEN_BY', ''))}: {_cell(doc)}", "",
                  "| key | type |", "|---|---|"]
        for name, f in cls.model_fields.items():
            kind = type_name(f.annotation)
            if not f.is_required():
                kind += f" (absent in older files: `{_value(f.default)}`)"
            lines.append(f"| `{name}` | {_cell(kind)} |")
        return "\n".join(lines) + "\n"
    with_loop = bool(table.sections or table.stage)
    planned = _planned_keys(table.stage) if table.stage else set()
    lines += [f"`{cls.__name__}` ({where}): {_cell(doc)}", "",
              "| key | type | default | in the loop | description |" if with_loop else
              "| key | type | default | description |",
              "|---|---|---|---|---|" if with_loop else "|---|---|---|---|"]
    for name, f in cls.model_fields.items():
        desc = f.description or ""
        if _is_model(f.annotation) and not desc:
            desc = summary(f.annotation)
        row = [f"`{name}`", _cell(type_name(f.annotation)), _default(f)]
        if with_loop:
            row.append(_loop_column(table, name, planned))
        lines.append("| " + " | ".join([*row, _cell(desc)]) + " |")
    if cls.model_config.get("extra") == "allow":  # the docstring's next paragraph says where other keys go
        rest = inspect.cleandoc(cls.__doc__ or "").split("\n\n", 1)[1:]
        lines += ["", " ".join(rest[0].split()).replace("``", "`") if rest else "Any other key is passed on as is."]
    return "\n".join(lines) + "\n"


def _link(page: str, target: str) -> str:
    """A Markdown link from the page ``page`` to the page ``target`` (both from the project root)."""
    rel = os.path.relpath(target, os.path.dirname(page))
    return f"[{Path(target).name}]({rel})"


def _rows_by_page() -> dict[str, list[Stage]]:
    """``{page: its rows}`` for every stage page, in the stage table's order."""
    pages: dict[str, list[Stage]] = {}
    for s in STAGES.values():
        pages.setdefault(s.docs_page, []).append(s)
    return pages


def _generated_note(source: str) -> str:
    return (f"<!-- generated by `python -m online_rlhf.doc_tables --write` from {source}; edit that, "
            "not these lines -->")


def render_stage_links(page: str) -> str:
    """One bullet per stage page, linked from ``page``, with the stages it documents."""
    lines = [_generated_note("the stage table (online_rlhf/stage_table.py)")]
    for path, rows in _rows_by_page().items():
        lines.append(f"- {_link(page, path)}: " + ", ".join(f"`{s.name}`" for s in rows))
    return "\n".join(lines) + "\n"


_ITERATIONS = {"0": "0 (before iteration 1)", "1..N": "1..N", "0..N": "0..N"}
_DEFAULT_ENABLED = next(f.default for f in dataclasses.fields(Stage) if f.name == "enabled")


def iterations(stage: Stage) -> str:
    """The iterations ``stage`` runs in, in words: its row's ``schedule`` (``"0"``: ``0 (before
    iteration 1)``), or the first line of the docstring of its ``schedule`` function."""
    if not callable(stage.schedule):
        return _ITERATIONS[stage.schedule]
    return summary(stage.schedule) or "as its row's `schedule` says"


def condition(stage: Stage) -> str:
    """The loop keys ``stage`` runs only under: the first line of its ``enabled`` function's
    docstring (``algorithm: dpo``); ``-`` when the row keeps the default (always)."""
    if stage.enabled is _DEFAULT_ENABLED:
        return "-"
    return summary(stage.enabled) or "as its row's `enabled` says"


def render_stage_list(page: str) -> str:
    """The stage table as a Markdown table: stage, env, iterations, condition and page."""
    lines = [_generated_note("the stage table (online_rlhf/stage_table.py)"), "",
             "| stage | env | iterations | only if | page |", "|---|---|---|---|---|"]
    for s in STAGES.values():
        lines.append(f"| `{s.name}` | {s.env} | {_cell(iterations(s))} | {_cell(condition(s))} | "
                     f"{_link(page, s.docs_page)} |")
    return "\n".join(lines) + "\n"


def render_stats_classes(page: str) -> str:
    """Every stats class the stage pages document (a stage's, or one more of its page's, such as a
    generation shard's), with its writer, its stages and its page."""
    lines = [_generated_note("the stage table and the stats classes (online_rlhf/stats.py)"), "",
             "| stats class | written by | stages | page |", "|---|---|---|---|"]
    seen: set[type] = set()
    for p in PAGES:
        for table in p.tables:
            if table.kind != "stats" or table.cls in seen:
                continue
            seen.add(table.cls)
            stages = ", ".join(f"`{s.name}`" for s in STAGES.values() if s.stats is table.cls) or "-"
            lines.append(f"| `{table.cls.__name__}` | {_cell(getattr(table.cls, 'WRITTEN_BY', ''))} | {stages} | "
                         f"{_link(page, p.path)} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Index:
    """A generated list of stages on a page that is not a stage's: ``path`` (from the project root),
    the marker's ``name`` (``<!-- index:<name> start -->``) and ``render`` (the page's path -> its Markdown)."""

    path: str
    name: str
    render: Callable[[str], str]
    kind: str = "index"


# The lists that name every stage outside the stage pages.
INDEXES: tuple[Index, ...] = (
    Index("docs/README.md", "stage_pages", render_stage_links),
    Index("docs/architecture.md", "stages", render_stage_list),
    Index("docs/architecture.md", "stats_classes", render_stats_classes),
)


def _markers(table: Table | Index) -> tuple[str, str]:
    return f"<!-- {table.kind}:{table.name} start -->\n", f"<!-- {table.kind}:{table.name} end -->"


def _span(text: str, table: Table | Index, page: str) -> tuple[int, int]:
    """``(start, end)`` of the text between ``table``'s markers in ``text``.

    Raises:
        ValueError: a marker is missing or given twice (naming the page and the marker).
    """
    start, end = _markers(table)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{page}: needs the markers {start.strip()} and {end} once each (found "
                         f"{text.count(start)} and {text.count(end)}).")
    a = text.index(start) + len(start)
    b = text.index(end)
    if b < a:
        raise ValueError(f"{page}: {end} comes before {start.strip()}.")
    return a, b


def _generated() -> dict[str, list[tuple[Table | Index, str, str]]]:
    """``{page: [(table or index, its text, what it is generated from)]}``: every generated section."""
    out: dict[str, list[tuple[Table | Index, str, str]]] = {}
    for page in PAGES:
        for table in page.tables:
            out.setdefault(page.path, []).append((table, render(table), table.cls.__name__))
    for index in INDEXES:
        out.setdefault(index.path, []).append((index, index.render(index.path), "the stage table"))
    return out


def check(root: Path = PROJECT_ROOT) -> list[str]:
    """Every disagreement between a page's generated sections and their sources, one line each
    (empty: none): the tables of :data:`PAGES` against their classes, the lists of :data:`INDEXES`
    against the stage table.

    A missing page, a missing or repeated marker, and a section whose text is not what
    :func:`render` (or the index's ``render``) gives all count."""
    problems = []
    for page, sections in _generated().items():
        path = root / page
        if not path.is_file():
            problems.append(f"{page}: no such page")
            continue
        text = path.read_text(encoding="utf-8")
        for table, want, source in sections:
            try:
                a, b = _span(text, table, page)
            except ValueError as e:
                problems.append(str(e))
                continue
            if text[a:b] != want:
                what = "table" if isinstance(table, Table) else "list"
                problems.append(f"{page}: the {table.kind}:{table.name} {what} differs from {source} "
                                "(python -m online_rlhf.doc_tables --write rewrites it)")
    return problems


def write(root: Path = PROJECT_ROOT) -> list[str]:
    """Rewrite every generated section in place; return the pages changed.

    Raises:
        ValueError: a page lacks a section's markers (add them where the section belongs).
        FileNotFoundError: a page of :data:`PAGES` or :data:`INDEXES` does not exist.
    """
    changed = []
    for page, sections in _generated().items():
        path = root / page
        text = old = path.read_text(encoding="utf-8")
        for table, want, _ in sections:
            a, b = _span(text, table, page)
            text = text[:a] + want + text[b:]
        if text != old:
            path.write_text(text, encoding="utf-8")
            changed.append(page)
    return changed


def stage_pages() -> dict[str, str]:
    """``{stage name: its page}`` for every stage :data:`PAGES` documents."""
    return {stage: page.path for page in PAGES for stage in page.stages}


def main(argv: list[str] | None = None) -> int:
    """``python -m online_rlhf.doc_tables --write | --check``; returns the exit code (1: ``--check``
    found a table or list that disagrees with its source, each printed to stderr)."""
    ap = argparse.ArgumentParser(prog="python -m online_rlhf.doc_tables",
                                 description="The docs pages' key and stats tables, from the config and stats "
                                 "classes, and the lists of stages, from the stage table.")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite every table and list in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when one disagrees with its source")
    args = ap.parse_args(argv)
    if args.write:
        try:
            for p in write():
                print(f"rewrote {p}")
        except (ValueError, FileNotFoundError) as e:  # a page without its markers, a missing page
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{sum(len(p.tables) for p in PAGES)} tables on {len(PAGES)} pages agree with their classes, "
              f"{len(INDEXES)} lists of stages with the stage table")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
