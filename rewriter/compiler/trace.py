"""Trace a reference decoder layer into a torch.fx graph at a fixed DecodeShape.

``trace`` inlines every module (parameters become ``get_attr`` nodes under their vLLM
names), keeps the leaf ops of ``rewriter.model.ops`` opaque, tags each node with the
layer region it came from, and then runs the graph once on meta tensors so every
node carries its output in ``node.meta["val"]`` (shape and dtype, no memory). The
full-size Kimi K3 layer traces this way on a CPU in about a second.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import rewriter.model.ops  # noqa: F401  (registers the k3:: ops the layers call)
from rewriter.model.config import KimiK3Config
from rewriter.model.layers.decoder import KimiDecoderLayer
from rewriter.model.layers.state import decode_inputs
from rewriter.model.regions import current_region
from rewriter.model.shape import DecodeShape, ShapeError


class _RegionTracer(fx.Tracer):
    """Inline all modules; record the active region on each node; name ops by overload."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False

    def create_node(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        if isinstance(target, torch._ops.OpOverloadPacket):
            target = target.default  # k3.foo -> k3.foo.default: one target per op for matching
        node = super().create_node(kind, target, *args, **kwargs)
        node.meta["region"] = current_region()
        return node


class _MetaPropagator(fx.Interpreter):
    """Run a graph on meta tensors (parameters replaced by meta twins) and keep each value."""

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta["val"] = result
        return result


@dataclass
class LayerGraph:
    """A traced layer: the fx graph module plus what it was traced for."""

    gm: fx.GraphModule
    config: KimiK3Config
    layer: int
    kind: str  # "kda" | "mla" | "dense"
    shape: DecodeShape
    module: KimiDecoderLayer  # the traced layer: its constants specialize the rules

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph


def propagate_meta(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> None:
    """Stamp ``node.meta["val"]`` on every node of ``gm`` by running it on meta tensors."""
    meta_inputs = [t if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                   for t in inputs]  # strides kept: a template may refuse a strided state
    _MetaPropagator(gm).run(*meta_inputs)


def trace(layer: KimiDecoderLayer, shape: DecodeShape) -> LayerGraph:
    """The fx graph of one decode step of ``layer`` at ``shape``, every node with meta."""
    if not isinstance(layer, KimiDecoderLayer):
        raise TypeError(f"trace expects a KimiDecoderLayer, got {type(layer).__name__}")
    if not isinstance(shape, DecodeShape):
        raise TypeError(f"trace expects a DecodeShape, got {type(shape).__name__}")
    layer_dtype = layer.input_layernorm.weight.dtype
    if shape.dtype != layer_dtype:
        raise ShapeError(f"shape dtype {shape.dtype} differs from the layer's {layer_dtype}")
    inputs = decode_inputs(layer, shape, device="meta")
    verify = layer.attention_kind == "kda" and shape.q > 1  # vLLM's multi-slot KDA verify contract
    graph = trace_function(layer, None if verify else {"num_accepted": None})
    gm = fx.GraphModule(layer, graph, class_name=f"KimiK3Layer{layer.layer_idx}")
    propagate_meta(gm, list(inputs.values()))
    live = layer.live_fractions()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in live:
            node.meta["live_fraction"] = live[node.target]  # the cost model counts only real values
    return LayerGraph(gm=gm, config=layer.config, layer=layer.layer_idx, kind=layer.kind, shape=shape, module=layer)


def trace_function(fn: torch.nn.Module | Any, absent: dict[str, None] | None = None) -> fx.Graph:
    """The fx graph of a module or plain function, as ``trace`` builds it, unused values dropped.

    ``absent`` names optional arguments the traced step does not take (``num_accepted`` of a
    KDA layer outside verify steps): traced as None, and their placeholders dropped, so the graph
    is the one the function has without them. Patterns are traced with this too, so they have the
    same structure as the layers.
    """
    graph = _RegionTracer().trace(fn, concrete_args=absent)
    if absent:
        for node in list(graph.nodes):  # fx guards each specialized argument with an assert: drop both
            if node.op == "call_function" and node.target is torch.fx._symbolic_trace._assert_is_none:
                graph.erase_node(node)
        for node in list(graph.nodes):
            if node.op == "placeholder" and not node.users and node.target.rstrip("_0123456789") in absent:
                graph.erase_node(node)
    graph.eliminate_dead_code()  # in-place state updates are impure and stay
    return graph
