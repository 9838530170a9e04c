"""The kernel schedule of a (rewritten) layer: a networkx DAG of kernels with streams,
the events that join them, L2 prefetch points and a critical path at the HBM floor.

How nodes become kernels:
- a fused op (``k3f::``) is one kernel, named by its rule;
- a leaf op left standing (``k3::mla_decode``, an unfused all-reduce at TP > 1) is one
  kernel; an all-reduce at TP 1 is the identity and launches nothing;
- the other ops of a region no rule touched run as vLLM's stock decode runs them: the
  region's stock kernels (``rewriter.compiler.stock_kernels``), so an unrewritten layer's schedule
  is exactly the stock one; ops left over in a partly fused region form one kernel per
  connected group.
Views move nothing and belong to no kernel.

Kernel A precedes kernel B when B reads a value A produced, or when both touch the same
decode-state input (the order the graph has). Kernels on the aux stream wait on an
event recorded after the main-stream kernel they read from, and the main stream waits
on an event after the aux kernel it reads from. While a kernel that holds a cross-GPU
reduction waits on its peers, the weights of the next main-stream kernels could be pulled
into L2 (up to ``l2_bytes``): these prefetch points are reported, not launched. An L2
prefetch kernel on a side stream was measured on one H200 (docs/FEWER_STEPS.md:
no gain at batch 1 and 8, the small kernels after the prefetch are bound by their latency,
not by where their bytes come from); the points wait for a multi-GPU machine, where the
collectives leave HBM idle for longer.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
import torch
from torch import fx

from rewriter.compiler.cost import H200_COPY_TBPS, group_bytes, hbm_us, is_gathered, is_view, weight_uses
from rewriter.compiler.rewrite import is_fused
from rewriter.compiler.stock_kernels import stock_kernels
from rewriter.compiler.trace import LayerGraph

H200_L2_BYTES = 50 * 2**20
_IDENTITY_AT_TP1 = (torch.ops.k3.all_reduce.default,)


@dataclass
class Kernel:
    name: str
    stream: str  # "main" | "aux"
    bytes: int
    source: str  # "fused:<rule>" | "stock:<region>" | "leaf:<op>" | "unfused:<region>"
    nodes: list[str]
    weights: dict[str, int] = field(default_factory=dict)  # parameter name -> bytes read
    dynamic_weights: set[str] = field(default_factory=set)  # read at rows chosen by data (experts)
    communicates: bool = False
    launches: int = 1  # GPU kernels it takes (a fused op's implementation may take more than one)
    start_us: float = 0.0  # earliest start on the critical-path model
    end_us: float = 0.0


@dataclass
class Event:
    record_after: str  # kernel the event is recorded after
    stream_waits: str  # stream that waits on it
    before: str  # the kernel that must not start earlier


@dataclass
class Prefetch:
    during: str  # the communicating kernel whose wait hides the prefetch
    kernel: str  # whose weights are pulled into L2
    bytes: int


@dataclass
class Schedule:
    kernels: list[Kernel]
    dag: nx.DiGraph
    events: list[Event]
    prefetches: list[Prefetch]
    critical_path_us: float  # longest dependency chain, each kernel at full HBM bandwidth
    hbm_tbps: float

    @property
    def total_bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def bound_us(self) -> float:
        """The schedule's time at the HBM floor: streams overlap, but share one HBM."""
        return max(self.critical_path_us, hbm_us(self.total_bytes, self.hbm_tbps))

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)


def _passthrough(node: fx.Node, tp: int) -> bool:
    """Nodes that launch nothing: views, and the all-reduce at TP 1 (the identity)."""
    return is_view(node) or (node.target in _IDENTITY_AT_TP1 and tp == 1)


def _root(node: fx.Node, tp: int) -> fx.Node:
    while _passthrough(node, tp) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _groups(lg: LayerGraph) -> dict[fx.Node, str]:
    """Every node that launches work -> the key of the group (kernel or stock region) it runs in."""
    tp = lg.shape.tp
    index = {n: i for i, n in enumerate(lg.graph.nodes)}
    compute = [n for n in lg.graph.nodes
               if n.op in ("call_function", "call_method") and not _passthrough(n, tp)]
    fused_regions = {r for n in compute if is_fused(n) for r in n.meta["fused"]["regions"]}
    groups: dict[fx.Node, str] = {}
    leftovers: dict[str, list[fx.Node]] = defaultdict(list)
    for n in compute:
        region = n.meta.get("region")
        if is_fused(n):
            groups[n] = f"fused:{n.name}"
        elif region is None or region in fused_regions:
            leftovers[region or "layer"].append(n)
        else:
            groups[n] = f"stock:{region}"
    for region, nodes in leftovers.items():  # connected groups of what the rules left in their regions
        sub = nx.Graph()
        sub.add_nodes_from(nodes)
        for n in nodes:
            sub.add_edges_from((r, n) for r in (_root(a, tp) for a in n.all_input_nodes) if r in sub)
        comps = sorted(nx.connected_components(sub), key=lambda c: min(index[x] for x in c))
        for i, comp in enumerate(comps):
            groups.update((n, f"unfused:{region}:{i}") for n in comp)
    return groups


def _kernels_for_group(key: str, nodes: list[fx.Node], lg: LayerGraph, moved: int) -> list[Kernel]:
    kind, _, rest = key.partition(":")
    names = [n.name for n in nodes]
    tp = lg.shape.tp
    if kind == "fused":
        info = nodes[0].meta["fused"]
        return [Kernel(info["kernel"], info["stream"], moved, f"fused:{info['rule']}", names,
                       communicates=info["communicates"] and tp > 1, launches=info.get("launches", 1))]
    if kind == "stock":
        stock = stock_kernels(rest, tp=tp, tokens=lg.shape.tokens, arch=lg.shape.arch)
        share = moved // max(len(stock), 1)
        return [Kernel(f"{rest}: {k.name}", k.stream, share, f"stock:{rest}", names,
                       communicates="all_reduce" in rest and tp > 1) for k in stock]
    comm = any(n.target in _IDENTITY_AT_TP1 for n in nodes) and tp > 1
    return [Kernel(f"{rest} (unfused)", "main", moved, key, names, communicates=comm)]


def build_schedule(lg: LayerGraph, hbm_tbps: float = H200_COPY_TBPS, l2_bytes: int = H200_L2_BYTES) -> Schedule:
    """The kernels of ``lg`` in launch order, their DAG, streams, events and prefetches."""
    tp = lg.shape.tp
    groups = _groups(lg)
    moved = group_bytes(lg.graph, lg.shape, lambda n: groups.get(_root(n, tp)) if n.op != "get_attr" else None)
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for n in lg.graph.nodes:
        if n in groups:
            members[groups[n]].append(n)
    # group-level DAG: data edges, and the graph's order among groups touching one state input
    gdag = nx.DiGraph()
    gdag.add_nodes_from(members)
    for n, key in groups.items():
        for a in n.all_input_nodes:
            src = groups.get(_root(a, tp))
            if src is not None and src != key:
                gdag.add_edge(src, key)
    for p in (n for n in lg.graph.nodes if n.op == "placeholder"):
        keys = list(dict.fromkeys(groups[u] for u in lg.graph.nodes if u in p.users and u in groups))
        gdag.add_edges_from(zip(keys, keys[1:]))
    kernels_of = {key: _kernels_for_group(key, nodes, lg, moved.get(key, 0)) for key, nodes in members.items()}
    for key, nodes in members.items():
        if key.startswith("fused:"):  # measured on the original nodes when the rule fused them
            kernels_of[key][0].bytes = nodes[0].meta["fused"]["bytes"]
    for key in [k for k, ks in kernels_of.items() if not ks]:  # e.g. a stock all-reduce region at TP 1
        gdag.add_edges_from((a, b) for a in gdag.predecessors(key) for b in gdag.successors(key))
        gdag.remove_node(key)
    index = {n: i for i, n in enumerate(lg.graph.nodes)}
    first = {key: min(index[n] for n in nodes) for key, nodes in members.items()}
    order = list(nx.lexicographical_topological_sort(gdag, key=first.__getitem__))
    kernels = [k for key in order for k in kernels_of[key]]
    _unique_names(kernels)
    for key in order:
        _attach_weights(lg, groups, key, kernels_of[key])
    dag = nx.DiGraph()
    dag.add_nodes_from((k.name, {"kernel": k}) for k in kernels)
    for key in order:
        ks = kernels_of[key]
        dag.add_edges_from((a.name, b.name) for a, b in zip(ks, ks[1:]))  # a stock region runs in sequence
    dag.add_edges_from((kernels_of[a][-1].name, kernels_of[b][0].name) for a, b in gdag.edges)
    events = [Event(a, dag.nodes[b]["kernel"].stream, b) for a, b in dag.edges
              if dag.nodes[a]["kernel"].stream != dag.nodes[b]["kernel"].stream]
    critical = _critical_path(kernels, dag, hbm_tbps)
    return Schedule(kernels, dag, events, _prefetches(kernels, l2_bytes), critical, hbm_tbps)


def _attach_weights(lg: LayerGraph, groups: dict[fx.Node, str], key: str, kernels: list[Kernel]) -> None:
    """Record the weights a group reads on its kernels (a stock region's shared evenly, like its bytes)."""
    tp = lg.shape.tp
    if key.startswith("fused:"):
        node = next(n for n, k in groups.items() if k == key)
        kernels[0].weights.update(node.meta["fused"]["weights"])
        kernels[0].dynamic_weights.update(node.meta["fused"]["dynamic_weights"])
        return
    for p in (n for n in lg.graph.nodes if n.op == "get_attr"):
        b = sum(b for c, b in weight_uses(p) if groups.get(_root(c, tp)) == key)
        for k in kernels:
            if b:
                k.weights[p.target] = b // len(kernels)
                if is_gathered(p):
                    k.dynamic_weights.add(p.target)


def _unique_names(kernels: list[Kernel]) -> None:
    seen: dict[str, int] = defaultdict(int)
    for k in kernels:
        seen[k.name] += 1
        if seen[k.name] > 1:
            k.name = f"{k.name} #{seen[k.name]}"


def _critical_path(kernels: list[Kernel], dag: nx.DiGraph, tbps: float) -> float:
    """Longest path when each kernel takes its bytes at HBM speed and a stream runs one
    kernel at a time (in launch order)."""
    timed = dag.copy()
    last_on: dict[str, str] = {}
    for k in kernels:
        if k.stream in last_on:
            timed.add_edge(last_on[k.stream], k.name)
        last_on[k.stream] = k.name
    for name in nx.topological_sort(timed):
        k = timed.nodes[name]["kernel"]
        k.start_us = max((timed.nodes[p]["kernel"].end_us for p in timed.predecessors(name)), default=0.0)
        k.end_us = k.start_us + hbm_us(k.bytes, tbps)
    return max((k.end_us for k in kernels), default=0.0)


def _prefetches(kernels: list[Kernel], l2_bytes: int) -> list[Prefetch]:
    """While a communicating kernel waits on its peers, pull the static weights of the
    kernels after it (through the next communicating one) into L2, within ``l2_bytes``.
    Weights picked by data (routed experts) cannot be known ahead and are not prefetched."""
    out = []
    for i, k in enumerate(kernels):
        if not k.communicates:
            continue
        budget = l2_bytes
        for nxt in kernels[i + 1:]:
            if budget <= 0:
                break
            want = sum(b for name, b in nxt.weights.items() if name not in nxt.dynamic_weights)
            if want:
                out.append(Prefetch(k.name, nxt.name, min(want, budget)))
                budget -= want
            if nxt.communicates:
                break
    return out
