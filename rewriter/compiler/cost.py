"""Bytes moved: per node, per region, and the layer's floor over HBM.

Decode is memory bound, so bytes are the cost that matters. Three measures:
- ``node_bytes``: what a node moves if it ran as a kernel of its own (its tensor
  inputs read, its output written; views move nothing; leaf ops by their own rule);
- ``region_bytes``: what a region moves if it ran as ONE kernel: weights, state and
  the activations that cross its boundary;
- ``floor_bytes``: what the whole layer must move at least: every weight it reads
  once (routed experts: only those selected), its decode state, its inputs and outputs.
``hbm_floor_us`` turns bytes into time at a given bandwidth (4.27 TB/s: the copy
bandwidth measured on an H200).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch import fx

import rewriter.model.ops  # noqa: F401  (registers the k3:: ops named below)
from rewriter.model.shape import DecodeShape

H200_COPY_TBPS = 4.27

k3 = torch.ops.k3

# Ops that only re-describe memory (or are no-ops on the value): they move no bytes.
_VIEW_METHODS = {"view", "reshape", "transpose", "squeeze", "unsqueeze", "split", "chunk", "unbind",
                 "permute", "expand", "narrow", "contiguous", "flatten"}
_STATE_ARGS = {  # leaf op -> positions of arguments that are decode state (read and written in place)
    k3.kda_conv_update.default: (1,),
    k3.kda_recurrent_step.default: (5,),
    k3.kda_conv_verify.default: (1,),
    k3.kda_recurrent_verify.default: (5,),
    k3.mla_cache_insert.default: (0,),
    k3.mla_decode.default: (1,),
}


def nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return 0


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _tensor_args(node: fx.Node) -> Iterable[fx.Node]:
    for a in node.all_input_nodes:
        if isinstance(_val(a), torch.Tensor):
            yield a


def is_view(node: fx.Node) -> bool:
    """True for nodes that move no bytes (views, tuple unpacking, dtype no-ops)."""
    if node.op == "call_method":
        if node.target in _VIEW_METHODS:
            return True
        if node.target in ("float", "type_as"):
            src = _val(node.args[0])
            return isinstance(src, torch.Tensor) and src.dtype == _val(node).dtype
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        return not isinstance(_val(node.args[0]), torch.Tensor) or not _indexes_with_tensor(node)
    return False


def _indexes_with_tensor(node: fx.Node) -> bool:
    index = node.args[1]
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(_val(i), torch.Tensor) for i in items)


def _state_bytes(node: fx.Node, shape: DecodeShape) -> int:
    """Decode-state traffic of a leaf op: only the rows of this step's requests."""
    target = node.target
    if target in (k3.kda_conv_update.default, k3.kda_recurrent_step.default, k3.kda_conv_verify.default):
        state = _val(node.args[_STATE_ARGS[target][0]])
        per_slot = nbytes(state) // state.shape[0]
        return 2 * shape.batch * per_slot  # read and write back
    if target == k3.kda_recurrent_verify.default:
        state = _val(node.args[5])
        return (1 + shape.q) * shape.batch * (nbytes(state) // state.shape[0])  # one slot read, q written
    if target == k3.mla_cache_insert.default:
        cache = _val(node.args[0])
        return shape.tokens * cache.shape[-1] * cache.element_size()  # write this step's entries
    if target == k3.mla_decode.default:
        cache = _val(node.args[1])
        return shape.batch * shape.seq_len * cache.shape[-1] * cache.element_size()
    return 0


def node_bytes(node: fx.Node, shape: DecodeShape) -> int:
    """Bytes the node moves when run as its own kernel."""
    if node.op in ("placeholder", "get_attr", "output") or is_view(node):
        return 0
    out = nbytes(_val(node))
    if node.op == "call_function" and node.target is operator.getitem:  # a gather: read what it writes
        return 2 * out
    state_positions = _STATE_ARGS.get(node.target, ())
    state_nodes = {node.args[i] for i in state_positions}
    ins = sum(nbytes(_val(a)) for a in _tensor_args(node) if a not in state_nodes)
    return ins + out + _state_bytes(node, shape)


def _expected_distinct(rows: int, picks: int) -> int:
    """Expected distinct rows among ``picks`` uniform random picks of ``rows`` (experts touched)."""
    return round(rows * (1.0 - (1.0 - 1.0 / rows) ** picks))


def live_bytes(param: fx.Node) -> int:
    """A weight's bytes that hold real values (a zero-padded expert shard's padding need not be read)."""
    return round(nbytes(_val(param)) * param.meta.get("live_fraction", 1.0))


def weight_uses(param: fx.Node) -> list[tuple[fx.Node, int]]:
    """(consumer, bytes it reads) for each real use of a weight, looking through views."""
    uses = []
    for u in param.users:
        if is_view(u):
            uses.extend((c, min(b, nbytes(_val(u)))) for c, b in weight_uses(u))
        elif u.op == "call_function" and u.target is operator.getitem and _indexes_with_tensor(u):
            rows = _val(param).shape[0]
            picked = _expected_distinct(rows, _val(u.args[1]).numel())
            uses.append((u, live_bytes(param) * picked // rows))
        else:
            uses.append((u, live_bytes(param)))
    return uses


def is_gathered(param: fx.Node) -> bool:
    """True when some use of the weight picks rows by a runtime index (routed experts)."""
    return any(c.op == "call_function" and c.target is operator.getitem and _indexes_with_tensor(c)
               for c, _ in weight_uses(param))


def _weight_bytes(param: fx.Node) -> int:
    """A weight's bytes as read once: gathered experts count only those expected to be
    selected (uniform routing), a weight split by views counts each part once."""
    per_consumer: dict[fx.Node, int] = {}
    for consumer, b in weight_uses(param):
        per_consumer[consumer] = max(per_consumer.get(consumer, 0), b)
    return min(sum(per_consumer.values()), live_bytes(param))


def _is_state(placeholder: fx.Node) -> bool:
    return any(u.target in _STATE_ARGS and placeholder in [u.args[i] for i in _STATE_ARGS[u.target]]
               for u in placeholder.users)


def _input_bytes(placeholder: fx.Node) -> int:
    """An input read once: slices of it count their size, anything else the whole."""
    sizes = []
    for u in placeholder.users:
        if u.target is torch.select_scatter:
            continue  # the write is counted at the output
        if u.op == "call_function" and u.target is operator.getitem and not _indexes_with_tensor(u):
            sizes.append(nbytes(_val(u)))
        else:
            sizes.append(nbytes(_val(placeholder)))
    return max(sizes, default=0)


def _output_bytes(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(_output_bytes(v) for v in value)
    if not isinstance(value, fx.Node) or value.op == "placeholder":
        return 0  # returned unchanged: nothing written
    if value.target is torch.select_scatter:
        return nbytes(_val(value.args[1]))  # only the written block
    return nbytes(_val(value))


def floor_bytes(graph: fx.Graph, shape: DecodeShape) -> int:
    """The least the layer must move: weights once, state, inputs read, outputs written."""
    total = 0
    for node in graph.nodes:
        if node.op == "get_attr":
            total += _weight_bytes(node)
        elif node.op == "placeholder" and not _is_state(node):
            total += _input_bytes(node)
        elif node.op == "call_function" and node.target in _STATE_ARGS:
            total += _state_bytes(node, shape)
        elif node.op == "output":
            total += _output_bytes(node.args[0])
    return total


def _root(node: fx.Node) -> fx.Node:
    """The node a chain of views starts from."""
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _is_activation(node: fx.Node) -> bool:
    """A tensor computed by the layer or fed to it as an activation (not a weight or state)."""
    root = _root(node)
    if root.op == "get_attr" or (root.op == "placeholder" and _is_state(root)):
        return False
    return isinstance(_val(node), torch.Tensor)


def group_bytes(graph: fx.Graph, shape: DecodeShape, key: Callable[[fx.Node], Hashable | None]
                ) -> dict[Hashable, int]:
    """Bytes each group of nodes moves as ONE kernel: weights, state, boundary activations.

    ``key`` maps a node to its group (None: belongs to none). An activation crossing from
    group A to group B costs A a write and B a read.
    """
    totals: dict[Hashable, int] = defaultdict(int)
    for node in graph.nodes:
        g = key(node)
        if node.op == "get_attr":
            for consumer, b in weight_uses(node):
                totals[key(consumer)] += b
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        if node.target in _STATE_ARGS:
            totals[g] += _state_bytes(node, shape)
        for a in node.all_input_nodes:  # activations entering the group
            if _is_activation(a) and (a.op == "placeholder" or key(a) != g):
                totals[g] += nbytes(_val(a))
        if _is_activation(node) and any(u.op == "output" or key(u) != g for u in node.users):
            totals[g] += nbytes(_val(node))  # results leaving the group (or the layer)
    totals.pop(None, None)
    return dict(totals)


def region_bytes(graph: fx.Graph, shape: DecodeShape) -> dict[str, int]:
    """Per region, the bytes it moves as one kernel."""
    return group_bytes(graph, shape, lambda n: n.meta.get("region"))


def hbm_us(num_bytes: int, tbps: float = H200_COPY_TBPS) -> float:
    """Microseconds to move ``num_bytes`` at ``tbps`` terabytes per second."""
    if tbps <= 0:
        raise ValueError(f"HBM bandwidth must be positive, got {tbps} TB/s")
    return num_bytes / (tbps * 1e12) * 1e6
