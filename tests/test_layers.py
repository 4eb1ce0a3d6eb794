"""The import graph of ``online_rlhf`` runs one way: no circle, however an import is written (at the
top of a module, inside a function, or under ``TYPE_CHECKING``), and the layers keep their order:
the stage modules never import the stage table or the loop, and the table never imports a stage
module or the loop. Read from the source (``ast``), so an import that only runs in one branch
counts too; ``importlib.import_module`` strings (the reward sources of ``stages/get_rewards.py``)
are not imports here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "online_rlhf"
# the loop's layer: the table's consumers, which the stages must not reach
LOOP_LAYER = ("online_rlhf.stage_table", "online_rlhf.stage_checks", "online_rlhf.loop_config", "online_rlhf.loop_keys",
              "online_rlhf.loop", "online_rlhf.doc_tables", "online_rlhf.seeds")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: the online_rlhf modules it imports anywhere in its file}``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import module` names a module; `from module import name` the module itself
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name and m != "online_rlhf"}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def _in_layer(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in layer)


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    # a function-level import is an arrow too (the plan's verifier-field check imports verifiers when it runs)
    assert len(graph) > 40 and "online_rlhf.verifiers" in graph["online_rlhf.loop.resolve"]
    circles = _circles(graph)
    assert not circles, "import circles (each: its modules and who imports whom inside it):\n" + "\n".join(
        ", ".join(c) + "\n    " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a] & set(c)))
        for c in circles)


def test_a_circle_is_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_stages_never_reach_the_stage_table_or_the_loop():
    graph = import_graph()
    stages = [m for m in graph if m.startswith("online_rlhf.stages.")]
    bad = {m: sorted(w for w in _reach(graph, m) if _in_layer(w, LOOP_LAYER)) for m in stages}
    assert len(stages) > 15 and not {m: w for m, w in bad.items() if w}
    for helper in ("online_rlhf.dry_run", "online_rlhf.hardware", "online_rlhf.stage_configs", "online_rlhf.stats"):
        assert not [w for w in _reach(graph, helper) if _in_layer(w, LOOP_LAYER)], helper


def test_the_stage_table_never_imports_a_stage_module_or_the_loop():
    graph = import_graph()
    reach = _reach(graph, "online_rlhf.stage_table")
    assert not [m for m in reach if m.startswith("online_rlhf.stages.")]
    assert not [m for m in reach if _in_layer(m, ("online_rlhf.loop", "online_rlhf.loop_config",
                                                  "online_rlhf.loop_keys"))]
