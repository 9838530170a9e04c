"""The package layout keeps its promises: no import circles between the modules of
``rewriter``, ``patterns`` and ``codegen`` (imports inside functions included); no library
module imports a command (``python -m rewriter`` is the command line's own entry); codegen
imports nothing of ``rewriter`` (the compiler hands it what it needs: ``codegen.host``)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rewriter", "patterns", "codegen")


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports() -> nx.DiGraph:
    mods, graph = _modules(), nx.DiGraph()
    for name, path in mods.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return graph


def test_no_import_circles():
    graph = _imports()
    assert len(graph) > 60  # the modules were found
    assert list(nx.simple_cycles(graph)) == []


def test_the_library_does_not_import_the_commands_and_codegen_not_the_rewriter():
    graph = _imports()
    library = [m for m in graph if not m.startswith("rewriter.commands") and m != "rewriter.__main__"]
    assert [(a, b) for a in library for b in graph.successors(a) if b.startswith("rewriter.commands")] == []
    codegen = [m for m in graph if m.startswith("codegen")]
    assert [(a, b) for a in codegen for b in graph.successors(a) if b.startswith("rewriter")] == []
    assert graph.has_edge("rewriter.commands.cli", "rewriter.commands.compile")  # the graph sees real edges
