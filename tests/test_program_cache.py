"""The program cache (``rewriter.compiler.program_cache``): rewritten graphs stored, read back by a later
start and run to the same result; keys that change with what the graphs depend on; a bad
entry rewritten, never trusted."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from conftest import make_inputs, make_layer
from rewriter.compiler.program_cache import ProgramCache, program_key, rewrite_cached
from rewriter.compiler.rewrite import is_fused
from rewriter.model.shape import DecodeShape


def _nodes(graph):
    return [(n.op, str(n.target), tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None)
            for n in graph.nodes]


def test_a_stored_rewrite_reads_back_and_runs_alike(tiny, tmp_path):
    cache = ProgramCache(tmp_path)
    layer = make_layer(tiny, 2)  # MLA + MoE
    shape = DecodeShape(batch=3, dtype=torch.float32)
    fresh = rewrite_cached(layer, shape, cache)
    assert len(list(cache.dir.glob("*.pkl"))) == 1
    again = rewrite_cached(layer, shape, cache)
    assert again.after.gm is not fresh.after.gm  # read from disk, not rewritten in memory
    assert _nodes(again.after.graph) == _nodes(fresh.after.graph)
    assert _nodes(again.before.graph) == _nodes(fresh.before.graph)
    assert [m.rule for m in again.matches] == [m.rule for m in fresh.matches] and again.matches
    fused = [n for n in again.after.graph.nodes if is_fused(n)]
    assert fused and all(n.meta["fused"]["rule"] for n in fused)
    inputs = make_inputs(layer, batch=3)
    with torch.no_grad():
        want = fresh.after.gm(*[t.clone() for t in inputs.values()])
        got = again.after.gm(*[t.clone() for t in inputs.values()])
    for a, e in zip(got, want):
        assert torch.equal(a, e)


def test_keys_follow_what_the_graph_depends_on(tiny):
    layer, other = make_layer(tiny, 1), make_layer(tiny, 2)
    shape = DecodeShape(batch=3, dtype=torch.float32)
    key = program_key(tiny, layer.structure, shape, layer)
    assert key == program_key(tiny, layer.structure, shape, layer)
    assert key != program_key(tiny, other.structure, shape, other)
    assert key != program_key(tiny, layer.structure, DecodeShape(batch=4, dtype=torch.float32), layer)
    assert key != program_key(tiny, layer.structure, DecodeShape(batch=3, dtype=torch.float32, conv_layout="DS"),
                              layer)
    w = layer.input_layernorm.weight
    layer.input_layernorm.weight = torch.nn.Parameter(w.detach().view(1, -1))  # a parameter of another shape
    assert key != program_key(tiny, layer.structure, shape, layer)


def test_a_corrupt_entry_is_rewritten(tiny, tmp_path, caplog):
    cache = ProgramCache(tmp_path)
    layer = make_layer(tiny, 1)
    shape = DecodeShape(batch=2, dtype=torch.float32)
    rewrite_cached(layer, shape, cache)
    (entry,) = cache.dir.glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[:100])
    result = rewrite_cached(layer, shape, cache)
    assert result.matches and "unreadable" in caplog.text
    assert cache.load(entry.stem) is not None  # stored again, whole


def test_a_fresh_process_reads_every_layer_kinds_entry(tiny, tmp_path):
    """A server start reads entries before anything else imported ``patterns``: every fused op
    an entry names (the dense layer's ``k3f::dense_mlp`` among them) must resolve."""
    cache = ProgramCache(tmp_path)
    keys = []
    for index in (0, 1, 2):  # dense, KDA + MoE, MLA + MoE
        layer = make_layer(tiny, index)
        shape = DecodeShape(batch=1, dtype=torch.float32)
        rewrite_cached(layer, shape, cache)
        keys.append(program_key(tiny, layer.structure, shape, layer))
    code = ("import sys; from rewriter.compiler.program_cache import ProgramCache; c = ProgramCache(sys.argv[1]); "
            "print([c.load(k) is not None for k in sys.argv[2:]])")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path), *keys], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[True, True, True]" and "unreadable" not in run.stderr, run.stderr


def test_the_key_covers_the_sources_the_graphs_are_made_by():
    """Every module of the compiler, the model and the built-in rules is hashed into the key: a
    change to any of them must miss (a key over no files would serve stale graphs silently)."""
    from rewriter.compiler.program_cache import source_files

    names = {p.as_posix() for p in source_files()}
    assert {"rewriter/compiler/rewrite.py", "rewriter/compiler/rules.py", "rewriter/model/layers/moe.py",
            "rewriter/model/ops.py", "patterns/moe.py", "patterns/__init__.py"} <= names
    assert not any(n.startswith("codegen/") for n in names)  # kernels have their own cache
