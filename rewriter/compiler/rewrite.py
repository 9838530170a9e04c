"""Match rules against a traced layer and replace each accepted match with its fused op.

Matching and replacement are torch.fx's own (``subgraph_rewriter.replace_pattern_with_filters``
over ``SubgraphMatcher``): structural, never by parameter name, and a match whose inner
values are used outside it is not a match. What is added here, and why:
- rules run largest pattern first, so a smaller rule cannot take nodes a larger one needs;
- each candidate goes through its rule's guard, and every acceptance and refusal is
  recorded with its reason;
- the bytes a fused kernel moves are measured on the original nodes before they go
  (only there is it known which experts a gather reads, which state a step touches);
- after each rule the graph is re-sorted (networkx) so that every value is defined before
  use and ops touching the same decode state keep their order, since the fx rewriter
  inserts a replacement before the first user of its outputs, which can precede an input.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from rewriter.compiler.cost import floor_bytes, group_bytes, is_gathered, weight_uses
from rewriter.compiler.rules import Match, Rule, RuleContext, RuleError, RuleSet
from rewriter.compiler.trace import LayerGraph, propagate_meta, trace_function
from rewriter.model.layers.state import decode_inputs

FUSED_NAMESPACE = "k3f"


@dataclass
class Accepted:
    rule: str
    family: str
    variant: int
    nodes: list[str]
    kernel: str
    bytes: int
    regions: list[str]
    weights: dict[str, int]  # parameter -> bytes the kernel reads of it
    dynamic_weights: list[str]  # of those, the ones read at rows picked at run time
    split_saving: int = 0  # weight bytes this rank leaves to the others (a replicated weight split across TP)


@dataclass
class Refused:
    rule: str
    reason: str
    nodes: list[str]


@dataclass
class RewriteResult:
    before: LayerGraph
    after: LayerGraph
    matches: list[Accepted] = field(default_factory=list)
    refusals: list[Refused] = field(default_factory=list)

    def reference_floor_bytes(self) -> int:
        """The reference layer's floor: every weight as vLLM holds it (replicated ones whole)."""
        return floor_bytes(self.before.graph, self.before.shape)

    def served_floor_bytes(self) -> int:
        """The floor of the layer as served: the reference floor less what the accepted rules'
        splits of replicated weights leave to the other ranks (each weight read once per rank
        under the best sharding the rules chose)."""
        return self.reference_floor_bytes() - sum(m.split_saving for m in self.matches)


def is_fused(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == FUSED_NAMESPACE


def copy_layer_graph(lg: LayerGraph) -> LayerGraph:
    """A new graph over the same parameters (no weight is copied)."""
    graph = fx.Graph()
    out = graph.graph_copy(lg.graph, {})
    graph.output(out)
    gm = fx.GraphModule(lg.gm, graph, class_name=lg.gm.__class__.__name__)
    return LayerGraph(gm=gm, config=lg.config, layer=lg.layer, kind=lg.kind, shape=lg.shape, module=lg.module)


_TRACED: dict[tuple, fx.GraphModule] = {}  # (code, closure values) -> traced pattern / replacement


def _trace_key(fn: Any) -> tuple | None:
    """What a rule's pattern or replacement traces from: its code and the values it closes over
    (layer sizes, group names), so layers and batches with the same ones share one trace; None
    where a value has no stable repr."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(c.cell_contents for c in getattr(fn, "__closure__", None) or ())
    text = repr((cells, getattr(fn, "__defaults__", None)))
    return None if " at 0x" in text else (code, text)


def _traced(rule: Rule, variant: int, fn: Any, what: str) -> fx.GraphModule:
    """The traced pattern or replacement (shared: the subgraph rewriter only reads them)."""
    key = _trace_key(fn)
    if key is not None and key in _TRACED:
        return _TRACED[key]
    gm = _trace_new(rule, variant, fn, what)
    if key is not None:
        _TRACED[key] = gm
    return gm


def _trace_new(rule: Rule, variant: int, fn: Any, what: str) -> fx.GraphModule:
    try:
        graph = trace_function(fn)
    except Exception as e:
        raise RuleError(f"rule {rule.name!r}: {what} of variant {variant} does not trace: {e}") from e
    if not any(n.op in ("call_function", "call_method") for n in graph.nodes):
        raise RuleError(f"rule {rule.name!r}: {what} of variant {variant} traces to no operations")
    return fx.GraphModule(torch.nn.Module(), graph)


def _size(gm: fx.GraphModule) -> int:
    return sum(n.op in ("call_function", "call_method") for n in gm.graph.nodes)


def _prepare(rules: RuleSet, ctx: RuleContext) -> list[tuple[Rule, int, fx.GraphModule, fx.GraphModule]]:
    """Every (rule, variant) traced, largest pattern first (ties keep registration order)."""
    prepared = []
    for rule in rules:
        try:
            variants = list(rule.variants(ctx))
        except Exception as e:
            raise RuleError(f"rule {rule.name!r}: building its patterns raised {type(e).__name__}: {e}") from e
        for i, (pattern, replacement) in enumerate(variants):
            pg = _traced(rule, i, pattern, "pattern")
            rg = _traced(rule, i, replacement, "replacement")
            if not any(is_fused(n) for n in rg.graph.nodes):
                raise RuleError(f"rule {rule.name!r}: replacement of variant {i} calls no {FUSED_NAMESPACE}:: op")
            prepared.append((rule, i, pg, rg))
    order = {id(r): k for k, r in enumerate(rules)}
    return sorted(prepared, key=lambda p: (-_size(p[2]), order[id(p[0])], p[1]))


def _inputs(im: Any, pg: fx.GraphModule) -> dict[str, fx.Node]:
    names = [n.target for n in pg.graph.nodes if n.op == "placeholder"]
    return dict(zip(names, im.placeholder_nodes))


def _traffic(graph: fx.Graph, lg: LayerGraph, nodes: list[fx.Node], weight_fraction: float,
             split: set[str] | None = None) -> tuple[int, dict[str, int], int]:
    """Bytes the matched nodes move as one kernel, what it reads of each weight, and the
    weight bytes a split leaves to the other ranks.

    Measured on the original nodes: only there is it visible that a gather reads just the
    selected experts. ``weight_fraction`` scales the weights in ``split`` (all when None) for
    rules that split a replicated weight across ranks.
    """
    members = set(nodes)
    moved = group_bytes(graph, lg.shape, lambda n: 0 if n in members else None).get(0, 0)
    full: dict[str, int] = {}
    for p in (n for n in graph.nodes if n.op == "get_attr"):
        b = sum(b for c, b in weight_uses(p) if c in members)
        if b:
            full[p.target] = b
    weights = {name: int(b * weight_fraction) if split is None or name in split else b for name, b in full.items()}
    saving = sum(full.values()) - sum(weights.values())
    return moved - saving, weights, saving


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder nodes so inputs come first, keeping the current order where it is valid and
    the relative order of every op that reads or writes the same decode-state input."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    for n in nodes:
        for a in n.all_input_nodes:
            dag.add_edge(a, n)
    for p in (n for n in nodes if n.op == "placeholder"):
        users = sorted(p.users, key=lambda u: index.get(u, len(nodes)))
        users = [u for u in users if u.op != "output"]
        for a, b in zip(users, users[1:]):
            if _writes(a, p) or _writes(b, p):
                dag.add_edge(a, b)
    order = list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))
    for prev, node in zip(order, order[1:]):
        if prev.next is not node:
            prev.append(node)


def _writes(node: fx.Node, value: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for arg, value_arg in zip(schema.arguments, node.args):
        if value_arg is value and arg.alias_info is not None and arg.alias_info.is_write:
            return True
    return False


@contextlib.contextmanager
def _no_recompile(gm: fx.GraphModule):
    gm.recompile = lambda: None
    try:
        yield
    finally:
        del gm.recompile


def rewrite(lg: LayerGraph, rules: RuleSet | None = None) -> RewriteResult:
    """The layer with every accepted match replaced by its fused op, plus what happened."""
    if rules is None:
        from patterns import default_rules  # the built-in rules import this package's engine

        rules = default_rules()
    ctx = RuleContext(config=lg.config, layer=lg.module, shape=lg.shape)
    after = copy_layer_graph(lg)
    result = RewriteResult(before=lg, after=after)
    for rule, variant, pg, rg in _prepare(rules, ctx):
        accepted: list[Accepted] = []

        def decide(im: Any, graph: fx.Graph, pattern: fx.Graph, rule: Rule = rule, variant: int = variant,
                   pg: fx.GraphModule = pg, accepted: list[Accepted] = accepted) -> bool:
            nodes = [n for pn, n in im.nodes_map.items() if pn.op not in ("placeholder", "output")]
            position = {n: i for i, n in enumerate(graph.nodes)}
            nodes.sort(key=position.__getitem__)
            m = Match(rule=rule, variant=variant, nodes=nodes, inputs=_inputs(im, pg), ctx=ctx)
            try:
                reason = rule.guard(m)
            except Exception as e:
                raise RuleError(f"rule {rule.name!r}: guard raised {type(e).__name__}: {e}") from e
            names = [n.name for n in nodes]
            if reason is not None:
                result.refusals.append(Refused(rule=rule.name, reason=str(reason), nodes=names))
                return False
            split = {m.inputs[name].target for name in rule.split_inputs} if rule.split_inputs else None
            moved, weights, saving = _traffic(graph, lg, nodes, rule.weight_fraction(ctx), split)
            dynamic = [n.target for n in graph.nodes if n.op == "get_attr" and n.target in weights and is_gathered(n)]
            regions = sorted({n.meta["region"] for n in nodes if n.meta.get("region")})
            accepted.append(Accepted(rule=rule.name, family=rule.family, variant=variant, nodes=names,
                                     kernel=rule.kernel_name, bytes=moved, regions=regions, weights=weights,
                                     dynamic_weights=dynamic, split_saving=saving))
            return True

        with _no_recompile(after.gm):  # torch regenerates the module's code after every call: once, below
            replaced = replace_pattern_with_filters(after.gm, pg, rg, match_filters=[decide])
        for acc, rp in zip(accepted, replaced):
            fused = [n for n in rp.replacements if is_fused(n)]
            for n in fused:
                n.meta["region"] = None
                n.meta["fused"] = {"rule": acc.rule, "family": acc.family, "kernel": acc.kernel,
                                   "stream": rule.stream, "communicates": rule.communicates, "bytes": acc.bytes,
                                   "launches": rule.launches,
                                   "replaces": acc.nodes, "regions": acc.regions, "weights": acc.weights,
                                   "dynamic_weights": acc.dynamic_weights}
        result.matches.extend(accepted)
        if accepted:
            stable_toposort(after.graph)
    after.graph.lint()
    after.gm.recompile()
    propagate_meta(after.gm, list(decode_inputs(lg.module, lg.shape, device="meta").values()))
    return result
