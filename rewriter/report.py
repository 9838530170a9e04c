"""The ``inspect`` report: one layer traced at one shape, as JSON, a table, or a dot picture.

The JSON keys are the contract in DESIGN.md (``model``, ``layer``, ``layer_kind``, ``tp``,
``batch``, ``default_kernels``, ``rewritten_kernels``, ``matches``, ``refusals``,
``schedule``, ``hbm_floor_us``) plus detail for people: per-region and per-node bytes.
Until fusion rules exist the rewritten layer is the stock one: ``rewritten_kernels``
equals ``default_kernels``, ``matches`` is empty, and the schedule lists the stock
kernels, each region's boundary bytes shared evenly among its kernels.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx

from rewriter.cost import H200_COPY_TBPS, floor_bytes, hbm_us, node_bytes, region_bytes
from rewriter.regions import REGIONS
from rewriter.stock_kernels import stock_kernels
from rewriter.trace import LayerGraph

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _describe(value: Any) -> tuple[list[int] | None, str | None]:
    if isinstance(value, torch.Tensor):
        return list(value.shape), str(value.dtype).removeprefix("torch.")
    return None, None


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


def layer_regions(graph: fx.Graph) -> list[str]:
    """The regions present in a graph, in layer order."""
    present = {n.meta.get("region") for n in graph.nodes}
    return [r for r in REGIONS if r in present]


def build_report(lg: LayerGraph, model: str, hbm_tbps: float = H200_COPY_TBPS) -> dict[str, Any]:
    shape = lg.shape
    regions = layer_regions(lg.graph)
    per_region_bytes = region_bytes(lg.graph, shape)
    per_region_nodes = Counter(n.meta.get("region") for n in lg.graph.nodes)
    region_rows, schedule = [], []
    for r in regions:
        kernels = stock_kernels(r, tp=shape.tp, tokens=shape.tokens, arch=shape.arch)
        region_rows.append({
            "region": r, "nodes": per_region_nodes[r], "bytes": per_region_bytes.get(r, 0),
            "stock_kernels": [k.name for k in kernels],
        })
        for k in kernels:
            schedule.append({
                "kernel": k.name, "region": r, "stream": getattr(k, "stream", "main"),
                "bytes": per_region_bytes.get(r, 0) // len(kernels), "source": k.source,
            })
    nodes = []
    for n in lg.graph.nodes:
        shp, dt = _describe(n.meta.get("val"))
        nodes.append({"name": n.name, "op": n.op, "target": _target_name(n), "region": n.meta.get("region"),
                      "shape": shp, "dtype": dt, "bytes": node_bytes(n, shape)})
    floor = floor_bytes(lg.graph, shape)
    default = len(schedule)
    return {
        "model": model,
        "layer": lg.layer,
        "layer_kind": lg.kind,
        "tp": shape.tp,
        "rank": shape.rank,
        "batch": shape.batch,
        "q": shape.q,
        "tokens": shape.tokens,
        "context": shape.context,
        "arch": shape.arch,
        "dtype": _DTYPE_NAMES[shape.dtype],
        "default_kernels": default,
        "rewritten_kernels": default,
        "matches": [],
        "refusals": [],
        "schedule": schedule,
        "floor_bytes": floor,
        "hbm_tbps": hbm_tbps,
        "hbm_floor_us": hbm_us(floor, hbm_tbps),
        "regions": region_rows,
        "nodes": nodes,
    }


def _mb(b: int) -> str:
    return f"{b / 1e6:9.3f}"


def render_table(report: dict[str, Any], show_nodes: bool = False) -> str:
    r = report
    lines = [
        f"{r['model']} layer {r['layer']} ({r['layer_kind']}), TP {r['tp']} rank {r['rank']}, "
        f"batch {r['batch']} x q {r['q']} = {r['tokens']} tokens, context {r['context']}, {r['dtype']}, {r['arch']}",
        f"kernels: {r['default_kernels']} stock, {r['rewritten_kernels']} rewritten; "
        f"matches {len(r['matches'])}, refusals {len(r['refusals'])}",
        f"HBM floor: {r['floor_bytes'] / 1e6:.2f} MB = {r['hbm_floor_us']:.2f} us at {r['hbm_tbps']} TB/s",
        "",
        f"{'region':<24}{'nodes':>6}{'MB moved':>11}  stock kernels",
    ]
    for row in r["regions"]:
        lines.append(f"{row['region']:<24}{row['nodes']:>6}{_mb(row['bytes']):>11}  "
                     f"{len(row['stock_kernels'])}: {', '.join(row['stock_kernels'])}")
    total = sum(row["bytes"] for row in r["regions"])
    lines.append(f"{'total':<24}{sum(row['nodes'] for row in r['regions']):>6}{_mb(total):>11}  "
                 f"{r['default_kernels']}")
    for m in r["matches"]:
        lines.append(f"match   {m['rule']}: {', '.join(m['nodes'])}")
    for m in r["refusals"]:
        lines.append(f"refused {m['rule']}: {m['reason']}")
    if show_nodes:
        lines += ["", f"{'node':<28}{'op':<14}{'target':<22}{'region':<24}{'shape':<22}{'dtype':<10}{'bytes':>12}"]
        for n in r["nodes"]:
            shape = "x".join(map(str, n["shape"])) if n["shape"] is not None else "-"
            lines.append(f"{n['name']:<28}{n['op']:<14}{n['target'][:21]:<22}{(n['region'] or '-'):<24}"
                         f"{shape:<22}{(n['dtype'] or '-'):<10}{n['bytes']:>12}")
    return "\n".join(lines)


_PALETTE = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1e6", "#e8e8e4", "#f0efeb", "#d8e2dc", "#ece4db",
            "#cddafd", "#fad2e1", "#bee1e6", "#eae4e9"]


def to_dot(lg: LayerGraph) -> str:
    """Graphviz source: one box per node, clustered by region, weights as notes."""
    out = [f'digraph "{lg.gm.__class__.__name__}" {{', "  rankdir=TB; node [shape=box, fontsize=10];"]
    by_region: dict[str | None, list[fx.Node]] = {}
    for n in lg.graph.nodes:
        by_region.setdefault(n.meta.get("region"), []).append(n)

    def label(n: fx.Node) -> str:
        shp, dt = _describe(n.meta.get("val"))
        detail = f"\\n{'x'.join(map(str, shp))} {dt}" if shp is not None else ""
        what = n.target if n.op == "get_attr" else _target_name(n)
        return f"{n.name}\\n{what}{detail}".replace('"', "'")

    for i, (region, members) in enumerate(by_region.items()):
        indent = "  "
        if region is not None:
            out.append(f'  subgraph "cluster_{region}" {{ label="{region}"; style=filled; '
                       f'color="{_PALETTE[i % len(_PALETTE)]}";')
            indent = "    "
        for n in members:
            style = ", shape=note" if n.op == "get_attr" else ", shape=ellipse" if n.op in ("placeholder", "output") else ""
            out.append(f'{indent}"{n.name}" [label="{label(n)}"{style}];')
        if region is not None:
            out.append("  }")
    for n in lg.graph.nodes:
        for a in n.all_input_nodes:
            out.append(f'  "{a.name}" -> "{n.name}";')
    out.append("}")
    return "\n".join(out) + "\n"
