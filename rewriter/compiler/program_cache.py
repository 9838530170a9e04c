"""Rewritten layer graphs on disk, so that a server start with a warm cache skips tracing and
rewriting (about 0.15 s per layer structure and batch, 264 of them for Kimi K3: most of a
cold start after the kernels are compiled).

An entry is the traced and the rewritten fx graph (nodes with their meta: shapes, regions,
fused-op records) plus the matches and refusals, pickled; the fused ops (``torch.ops.k3f``,
``torch.ops.k3``), which do not pickle, are stored by their qualified names. The key hashes
what the graphs depend on: the sources of ``rewriter`` and ``patterns``, torch's
version, the config, the layer's structure, the decode shape, and every parameter's name,
shape, dtype and strides (a graph is only re-rooted on a layer with the same parameters).
``python -m rewriter compile --all-layers`` fills it; ``build_programs`` reads it first.

Entries live in ``<root>/programs/`` beside the kernel cache (``codegen.cache``: same root,
written to a temporary file and renamed into place; an entry that fails to load is deleted
and treated as a miss).
"""
from __future__ import annotations

import functools
import hashlib
import io
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx, nn

from codegen.cache import default_root, read_or_discard, write_atomic

log = logging.getLogger("k3_rewriter")
ENTRY_FORMAT = 1
_SOURCES = ("rewriter", "patterns")  # the packages the graphs are made by (kernels have their own cache)


@dataclass
class StoredRewrite:
    before: fx.Graph
    after: fx.Graph
    matches: list
    refusals: list


@functools.cache
def source_hash() -> str:
    """The sha256 of every Python source the graphs depend on."""
    h = hashlib.sha256(f"{ENTRY_FORMAT} {torch.__version__}".encode())
    for path in source_files():
        h.update(path.as_posix().encode())
        h.update((ROOT / path).read_bytes())
    return h.hexdigest()


ROOT = Path(__file__).resolve().parents[2]


def source_files() -> list[Path]:
    """The sources of ``_SOURCES``, relative to the repository."""
    return [p.relative_to(ROOT) for package in _SOURCES for p in sorted((ROOT / package).rglob("*.py"))]


def program_key(config: object, structure: tuple, shape: object, layer: nn.Module) -> str:
    params = [(name, tuple(t.shape), str(t.dtype), tuple(t.stride()))
              for name, t in (*layer.named_parameters(), *layer.named_buffers())]
    text = repr((source_hash(), config, structure, shape, params))
    return hashlib.sha256(text.encode()).hexdigest()


def _detached(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (node meta included) owned by no module, so the layer is not pickled."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


class _Pickler(pickle.Pickler):
    """Ops by qualified name; meta tensors (the nodes' ``val``) by shape, strides and dtype."""

    def persistent_id(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch.Tensor) and obj.device.type == "meta":
            return ("meta", tuple(obj.shape), tuple(obj.stride()), str(obj.dtype).removeprefix("torch."))
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid[0] == "meta":
            _, shape, stride, dtype = pid
            return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")
        if pid[0] == "op":
            _, name, overload = pid
            namespace, op = name.split("::")
            return getattr(getattr(getattr(torch.ops, namespace), op), overload)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


class ProgramCache:
    def __init__(self, root: str | Path | None = None):
        self.dir = (Path(root).expanduser() if root is not None else default_root()) / "programs"

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.pkl"

    def load(self, key: str) -> StoredRewrite | None:
        from patterns import builtin_modules

        builtin_modules()  # defines the fused ops an entry names

        path = self.path(key)

        def decode(data: bytes) -> StoredRewrite:
            stored = _Unpickler(io.BytesIO(data)).load()
            if not isinstance(stored, StoredRewrite):
                raise pickle.UnpicklingError(f"holds a {type(stored).__name__}")
            return stored

        def bad(e: BaseException) -> None:
            log.warning("rewriter: program cache entry %s unreadable (%s); rewriting again", path.name, e)

        return read_or_discard(path, decode, (Exception,), bad)  # any failure: a miss, never trusted

    def store(self, key: str, stored: StoredRewrite) -> Path:
        buf = io.BytesIO()
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(stored)
        return write_atomic(self.path(key), buf.getvalue())


def rewrite_cached(layer: nn.Module, shape: object, cache: ProgramCache | None = None):
    """``rewrite(trace(layer, shape))``, the graphs read from ``cache`` when it holds them (and
    stored there when it does not); None: no cache, always rewrite."""
    from rewriter.compiler.rewrite import RewriteResult, rewrite
    from rewriter.compiler.trace import LayerGraph, trace

    if cache is None:
        return rewrite(trace(layer, shape))
    key = program_key(layer.config, layer.structure, shape, layer)
    stored = cache.load(key)
    if stored is None:
        result = rewrite(trace(layer, shape))
        cache.store(key, StoredRewrite(_detached(result.before.graph), _detached(result.after.graph), result.matches,
                                       result.refusals))
        return result

    def rooted(graph: fx.Graph) -> LayerGraph:
        gm = fx.GraphModule(layer, graph, class_name=f"KimiK3Layer{layer.layer_idx}")
        return LayerGraph(gm=gm, config=layer.config, layer=layer.layer_idx, kind=layer.kind, shape=shape,
                          module=layer)

    return RewriteResult(before=rooted(stored.before), after=rooted(stored.after), matches=stored.matches,
                         refusals=stored.refusals)
