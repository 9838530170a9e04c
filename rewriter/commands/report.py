"""The ``inspect`` report: one layer traced, rewritten and scheduled at one shape, as JSON,
a table, graph text, or Graphviz pictures.

The JSON keys are the contract in DESIGN.md (``model``, ``layer``, ``layer_kind``, ``tp``,
``batch``, ``default_kernels``, ``rewritten_kernels``, ``matches``, ``refusals``,
``schedule``, ``hbm_floor_us``) plus detail for people: the stock schedule, events,
prefetches, per-region and per-node bytes. ``hbm_floor_us`` is the floor of the layer as
served (each weight read once per rank under the sharding the rules chose, the checkpoint's
expert format, no padding); ``reference_floor_us`` the reference layer's, replicated weights
read whole on every rank as vLLM does.

A rewritten schedule is only a win where a server would run it: ``served`` says whether every
scheduled kernel is a CuTe DSL template's at these shapes (``rewriter.compiler.plan``, the test
the server applies), ``not_served_reason`` why not (the server then keeps the layer on vLLM's
stock forward: ``served_kernels`` is ``default_kernels``), ``fused_ops_without_kernel`` how
many fused ops have no GPU kernel (no template, or one that refuses these shapes), and each
schedule row its ``plan_status`` (``pending``: a template takes it, ``missing``, ``refused``,
``stock``), its ``implementation`` (``hand-written``, ``generated`` from the fused op's reference,
``missing``, ``stock``) and ``plan_detail``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx

from rewriter.compiler.cost import H200_COPY_TBPS, floor_bytes, hbm_us, node_bytes, region_bytes
from rewriter.compiler.plan import plan, program_refusal
from rewriter.compiler.rewrite import RewriteResult, is_fused
from rewriter.compiler.schedule import Schedule, build_schedule
from rewriter.compiler.stock_kernels import stock_kernels
from rewriter.compiler.trace import LayerGraph
from rewriter.model.regions import REGIONS

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _describe(value: Any) -> tuple[list[int] | None, str | None]:
    if isinstance(value, torch.Tensor):
        return list(value.shape), str(value.dtype).removeprefix("torch.")
    return None, None


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)  # k3f.mla_q_front.default
    return getattr(t, "__name__", None) or str(t)


def layer_regions(graph: fx.Graph) -> list[str]:
    """The regions present in a graph, in layer order."""
    present = {n.meta.get("region") for n in graph.nodes}
    return [r for r in REGIONS if r in present]


def _schedule_rows(s: Schedule) -> list[dict[str, Any]]:
    return [{"kernel": k.name, "stream": k.stream, "bytes": k.bytes, "source": k.source,
             "communicates": k.communicates, "launches": k.launches, "start_us": round(k.start_us, 3),
             "end_us": round(k.end_us, 3), "after": sorted(s.dag.predecessors(k.name))} for k in s.kernels]


NO_KERNEL = ("missing", "refused")  # plan statuses of a fused op with no GPU kernel at its shapes


def _nodes(lg: LayerGraph) -> list[dict[str, Any]]:
    rows = []
    for n in lg.graph.nodes:
        shp, dt = _describe(n.meta.get("val"))
        fused = n.meta.get("fused")
        rows.append({"name": n.name, "op": n.op, "target": _target_name(n), "region": n.meta.get("region"),
                     "rule": fused["rule"] if fused else None, "shape": shp, "dtype": dt,
                     "bytes": fused["bytes"] if fused else node_bytes(n, lg.shape)})
    return rows


def build_report(result: RewriteResult, model: str, hbm_tbps: float = H200_COPY_TBPS) -> dict[str, Any]:
    before, after = result.before, result.after
    shape = before.shape
    stock, fused = build_schedule(before, hbm_tbps), build_schedule(after, hbm_tbps)
    planned = plan(result, shape.arch, schedule=fused)
    not_served = program_refusal(planned)
    schedule = [{**row, "plan_status": p["status"], "implementation": p["implementation"],
                 "plan_detail": p.get("detail")}
                for row, p in zip(_schedule_rows(fused), planned, strict=True)]
    rewritten = sum(k.launches for k in fused.kernels)
    per_region_bytes = region_bytes(before.graph, shape)
    per_region_nodes = Counter(n.meta.get("region") for n in before.graph.nodes)
    regions = [{"region": r, "nodes": per_region_nodes[r], "bytes": per_region_bytes.get(r, 0),
                "stock_kernels": [k.name for k in stock_kernels(r, tp=shape.tp, tokens=shape.tokens,
                                                                arch=shape.arch)]}
               for r in layer_regions(before.graph)]
    floor, reference_floor = result.served_floor_bytes(), floor_bytes(before.graph, shape)
    return {
        "model": model,
        "layer": before.layer,
        "layer_kind": before.kind,
        "tp": shape.tp,
        "rank": shape.rank,
        "batch": shape.batch,
        "q": shape.q,
        "tokens": shape.tokens,
        "context": shape.context,
        "arch": shape.arch,
        "dtype": _DTYPE_NAMES[shape.dtype],
        "experts": before.module.expert_format.name if before.module.expert_format else None,
        "default_kernels": len(stock.kernels),
        "rewritten_kernels": rewritten,
        "fused_ops": sum(k.source.startswith("fused:") for k in fused.kernels),
        "fused_ops_without_kernel": sum(p["status"] in NO_KERNEL for p in planned),
        "served": not_served is None,
        "not_served_reason": not_served,
        "served_kernels": rewritten if not_served is None else len(stock.kernels),
        "matches": [{"rule": m.rule, "family": m.family, "kernel": m.kernel, "nodes": m.nodes, "bytes": m.bytes}
                    for m in result.matches],
        "refusals": [{"rule": r.rule, "reason": r.reason, "nodes": r.nodes} for r in result.refusals],
        "schedule": schedule,
        "events": [vars(e) for e in fused.events],
        "prefetches": [vars(p) for p in fused.prefetches],
        "stock_schedule": _schedule_rows(stock),
        "floor_bytes": floor,
        "hbm_tbps": hbm_tbps,
        "hbm_floor_us": hbm_us(floor, hbm_tbps),
        "reference_floor_bytes": reference_floor,
        "reference_floor_us": hbm_us(reference_floor, hbm_tbps),
        "critical_path_us": fused.critical_path_us,
        "schedule_bound_us": fused.bound_us,
        "stock_bound_us": stock.bound_us,
        "regions": regions,
        "nodes_before": _nodes(before),
        "nodes_after": _nodes(after),
    }


def _human(b: int) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def _mb(b: int) -> str:
    return f"{b / 1e6:9.3f}"


def _served_lines(r: dict[str, Any], width: int = 200) -> list[str]:
    """The headline's word on a layer a server would not run rewritten (none for one it would); a
    long reason (every stock kernel no rule fuses) is cut, ``--json`` holds it whole."""
    if r["served"]:
        return []
    reason = r["not_served_reason"]
    reason = reason if len(reason) <= width else f"{reason[:width - 3]}..."
    return [f"not served: a server keeps this layer on vLLM's stock forward ({r['served_kernels']} kernels): {reason}"]


def render_table(r: dict[str, Any], show_nodes: bool = False) -> str:
    missing = r["fused_ops_without_kernel"]
    lines = [
        f"{r['model']} layer {r['layer']} ({r['layer_kind']}), TP {r['tp']} rank {r['rank']}, "
        f"batch {r['batch']} x q {r['q']} = {r['tokens']} tokens, context {r['context']}, {r['dtype']}, {r['arch']}"
        + (f", {r['experts']} routed experts" if r["experts"] else ""),
        f"kernels: {r['default_kernels']} stock -> {r['rewritten_kernels']} rewritten "
        f"({r['fused_ops']} fused ops, {len(r['matches'])} matches, {len(r['refusals'])} refusals)"
        + (f"; {missing} fused op{'' if missing == 1 else 's'} without a GPU kernel" if missing else ""),
        *_served_lines(r),
        f"HBM floor as served {r['floor_bytes'] / 1e6:.2f} MB = {r['hbm_floor_us']:.2f} us at {r['hbm_tbps']} TB/s "
        f"(the reference layer, replicated weights whole: {r['reference_floor_bytes'] / 1e6:.2f} MB = "
        f"{r['reference_floor_us']:.2f} us); schedule bound {r['schedule_bound_us']:.2f} us "
        f"(stock {r['stock_bound_us']:.2f} us)",
        "",
        f"{'#':>3} {'kernel':<34}{'stream':<7}{'MB':>9}{'start us':>10}  from",
    ]
    for i, k in enumerate(r["schedule"]):
        note = " +comm" if k["communicates"] else ""
        note += f" ({k['launches']} kernels)" if k.get("launches", 1) > 1 else ""
        note += " [no GPU kernel]" if k["plan_status"] in NO_KERNEL else ""
        note += " [generated]" if k["implementation"] == "generated" else ""
        lines.append(f"{i:>3} {k['kernel'][:33]:<34}{k['stream']:<7}{_mb(k['bytes'])}{k['start_us']:>10.2f}  "
                     f"{k['source']}{note}")
    for e in r["events"]:
        lines.append(f"    event: {e['stream_waits']} stream waits for {e['record_after']} before {e['before']}")
    for p in r["prefetches"]:
        lines.append(f"    prefetch point (not launched): {_human(p['bytes'])} of {p['kernel']} into L2 "
                     f"during {p['during']}")
    lines.append("")
    for m in r["matches"]:
        lines.append(f"match   {m['rule']:<28} -> {m['kernel']:<28} {len(m['nodes'])} nodes")
    for m in r["refusals"]:
        lines.append(f"refused {m['rule']:<28} {m['reason']}")
    lines += ["", f"{'stock region':<24}{'nodes':>6}{'MB moved':>11}  stock kernels"]
    for row in r["regions"]:
        lines.append(f"{row['region']:<24}{row['nodes']:>6}{_mb(row['bytes']):>11}  "
                     f"{len(row['stock_kernels'])}: {', '.join(row['stock_kernels'])}")
    if show_nodes:
        for title, key in (("graph before", "nodes_before"), ("graph after", "nodes_after")):
            lines += ["", f"{title}:", f"{'node':<28}{'op':<14}{'target':<26}{'region / rule':<26}{'shape':<20}"
                                       f"{'dtype':<10}{'bytes':>12}"]
            for n in r[key]:
                shape = "x".join(map(str, n["shape"])) if n["shape"] is not None else "-"
                where = n["rule"] and f"[{n['rule']}]" or n["region"] or "-"
                lines.append(f"{n['name'][:27]:<28}{n['op']:<14}{n['target'][:25]:<26}{where[:25]:<26}"
                             f"{shape[:19]:<20}{(n['dtype'] or '-'):<10}{n['bytes']:>12}")
    return "\n".join(lines)


_PALETTE = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1e6", "#e8e8e4", "#f0efeb", "#d8e2dc", "#ece4db",
            "#cddafd", "#fad2e1", "#bee1e6", "#eae4e9"]


def to_dot(lg: LayerGraph, title: str = "") -> str:
    """Graphviz source: one box per node, clustered by region; fused ops bold, weights as notes."""
    name = title or lg.gm.__class__.__name__
    out = [f'digraph "{name}" {{', f'  label="{name}"; rankdir=TB; node [shape=box, fontsize=10];']
    by_region: dict[str | None, list[fx.Node]] = {}
    for n in lg.graph.nodes:
        by_region.setdefault(n.meta.get("region"), []).append(n)

    def label(n: fx.Node) -> str:
        shp, dt = _describe(n.meta.get("val"))
        detail = f"\\n{'x'.join(map(str, shp))} {dt}" if shp is not None else ""
        what = n.target if n.op == "get_attr" else _target_name(n)
        return f"{n.name}\\n{what}{detail}".replace('"', "'")

    def style(n: fx.Node) -> str:
        if is_fused(n):
            return ', style="bold,filled", fillcolor="#ffd166"'
        if n.op == "get_attr":
            return ", shape=note"
        return ", shape=ellipse" if n.op in ("placeholder", "output") else ""

    for i, (region, members) in enumerate(by_region.items()):
        indent = "  "
        if region is not None:
            out.append(f'  subgraph "cluster_{region}" {{ label="{region}"; style=filled; '
                       f'color="{_PALETTE[i % len(_PALETTE)]}";')
            indent = "    "
        out.extend(f'{indent}"{n.name}" [label="{label(n)}"{style(n)}];' for n in members)
        if region is not None:
            out.append("  }")
    out.extend(f'  "{a.name}" -> "{n.name}";' for n in lg.graph.nodes for a in n.all_input_nodes)
    out.append("}")
    return "\n".join(out) + "\n"


def layer_row(result: RewriteResult, arch: str, sms: int | None = None) -> dict[str, Any]:
    """One layer's line of the whole-model report: whether the server would run it as a program
    (every scheduled kernel a CuTe DSL template's, ``rewriter.compiler.plan``, on a GPU of ``sms``
    SMs) and why not."""
    before, after = result.before, result.after
    reason = program_refusal(plan(result, arch, sms=sms))
    rewritten = sum(k.launches for k in build_schedule(after).kernels)
    default = len(build_schedule(before).kernels)
    return {"layer": before.layer, "layer_kind": before.kind, "rewritten": reason is None,
            "default_kernels": default, "rewritten_kernels": rewritten,
            "served_kernels": rewritten if reason is None else default, "reason": reason}


def build_model_report(rows: list[dict[str, Any]], **header: Any) -> dict[str, Any]:
    """The whole-model report (``inspect --all-layers``) from one ``layer_row`` per layer."""
    return {**header, "layers": rows, "rewritten_layers": sum(r["rewritten"] for r in rows),
            "total_default_kernels": sum(r["default_kernels"] for r in rows),
            "total_served_kernels": sum(r["served_kernels"] for r in rows)}


def render_model_table(r: dict[str, Any]) -> str:
    n = len(r["layers"])
    sms = f" ({r['sms']} SMs)" if r.get("sms") else ""
    lines = [f"{r['model']}, TP {r['tp']} rank {r['rank']}, batch {r['batch']} x q {r['q']}, {r['arch']}{sms}, "
             f"{r['experts']} routed experts: {r['rewritten_layers']} of {n} layers rewritten",
             f"kernels per step: {r['total_default_kernels']} stock -> {r['total_served_kernels']} served "
             "(rewritten layers' kernels, the others' stock ones)", "",
             f"{'layer':>5}  {'kind':<6}{'rewritten':<11}{'stock':>6}{'kernels':>9}  why not"]
    for row in r["layers"]:
        lines.append(f"{row['layer']:>5}  {row['layer_kind']:<6}{'yes' if row['rewritten'] else 'no':<11}"
                     f"{row['default_kernels']:>6}{row['rewritten_kernels']:>9}  {row['reason'] or ''}")
    return "\n".join(lines)
