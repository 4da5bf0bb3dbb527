"""parity/'s own module graph: no import cycle, and first-party imports at the top of the module except where a
comment-justified laziness is listed here."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIRST_PARTY = ("cases", "reference", "fused", "adapters", "parity", "reports", "bench", "cli")
#: (module, imported module) pairs that stay function-local, and why.
LAZY = {
    ("worker", "parity.engine"): "the child imports torch only after redirecting fd 1 (torch may print)",
    ("worker", "parity.run.execution"): "the same",
    ("kernel_checks", "fused.kernels.flashmla_provider"): "GPU providers load only when asked for",
    ("kernel_checks", "fused.kernels.cudnn_provider"): "the same",
}


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of parity and its floors, by dotted name under ``parity`` (``engine``, ``run.runner``, ...)."""
    return {".".join(p.relative_to(root / "parity").with_suffix("").parts): p
            for p in sorted((root / "parity").rglob("*.py")) if p.stem != "__init__"}


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[str, bool]]:
    """``(absolute module, at module level)`` of every first-party import of a parity module; ``from parity.run
    import runner`` names the module ``parity.run.runner``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    known = {"parity." + m for m in _modules(root)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = ".".join(path.relative_to(root).with_suffix("").parts[:-node.level])
                module = package + (f".{module}" if module else "")
            names = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(n, id(node) in top) for n in dict.fromkeys(names) if n.split(".")[0] in FIRST_PARTY]
    return out


def parity_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {m: {n.removeprefix("parity.") for n, _ in _imports(p, root)
                if n.startswith("parity.") and n.removeprefix("parity.") in modules}
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle (as a path back to its start), found by depth-first search."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_parity_has_no_import_cycle():
    assert cycles(parity_graph()) == []


def test_cycle_detection_negative_control():
    assert cycles({"runner": {"worker"}, "worker": {"runner"}}) == [["runner", "worker", "runner"]]
    assert cycles({"runner": {"worker", "engine"}, "worker": {"engine"}, "engine": set()}) == []


def test_first_party_imports_are_at_module_level():
    local = sorted({(p.stem, n) for p in _modules().values() for n, at_top in _imports(p) if not at_top})
    assert local == sorted(LAZY), local  # each (module, import) pair imported inside a function, with its reason
