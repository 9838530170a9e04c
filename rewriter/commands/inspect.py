"""``python -m rewriter inspect``: one layer traced, rewritten and scheduled at one decode shape,
as a table, JSON, fx graphs or pictures; ``--all-layers``: one row per layer of the model."""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
from pathlib import Path

from rewriter.commands.layer_args import add_layer_arguments, layer_of, rules_of
from rewriter.compiler.cost import H200_COPY_TBPS
from rewriter.model.config import KimiK3Config
from rewriter.model.shape import ShapeError


def add_inspect_parser(sub) -> argparse.ArgumentParser:
    ins = sub.add_parser("inspect", help="trace one decoder layer at a decode shape and report it (no GPU needed)")
    add_layer_arguments(ins)
    ins.add_argument("--hbm-tbps", type=float, default=H200_COPY_TBPS,
                     help=f"HBM bandwidth for the floor, TB/s (default {H200_COPY_TBPS}, measured H200 copy)")
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ins.add_argument("--nodes", action="store_true", help="list every graph node in the table")
    ins.add_argument("--graph", action="store_true", help="print the fx graph before and after the rewrite")
    ins.add_argument("--dot", type=Path, metavar="PATH",
                     help="write the graph before and after as Graphviz source (PATH and PATH with .after.dot)")
    ins.add_argument("--png", type=Path, metavar="PATH",
                     help="render the graphs before and after to PNG (needs Graphviz's dot on PATH)")
    ins.add_argument("--no-rules", action="store_true", help="skip the built-in rules (show the stock layer)")
    ins.add_argument("--all-layers", action="store_true",
                     help="one row per layer of the model: kind, rewritten or why not, kernels (--layer ignored)")
    ins.add_argument("--sms", type=int, metavar="N",
                     help="with --all-layers: plan the kernels for a GPU of N SMs (an H20: 78), as compile --sms")
    return ins


def _pair(path: Path) -> tuple[Path, Path]:
    """(before, after) file names for one user-given path."""
    return path, path.with_name(f"{path.stem}.after{path.suffix}")


def run_inspect_all(args: argparse.Namespace) -> int:
    """Every layer of the model, each distinct layer structure traced and rewritten once."""
    from rewriter.commands.report import build_model_report, layer_row, render_model_table
    from rewriter.model.layers.decoder import layer_structures

    single = [f"--{n}" for n in ("dot", "png", "graph", "nodes") if getattr(args, n)]
    if single:
        raise ShapeError(f"--all-layers prints one row per layer; {', '.join(single)} take one --layer")
    if args.sms is not None and args.sms < 1:
        raise ShapeError(f"--sms must be >= 1, got {args.sms}")
    cfg = KimiK3Config.load(args.model)
    rules = rules_of(args)  # once: a rules file defines its fused ops when it is imported
    rows = []
    for layers in layer_structures(cfg, args.tp, args.rank, args.experts).values():
        row = layer_row(layer_of(argparse.Namespace(**{**vars(args), "layer": layers[0]}), rules), args.arch,
                        args.sms)
        rows += [{**row, "layer": i} for i in layers]
    rows.sort(key=lambda r: r["layer"])
    report = build_model_report(rows, model=args.model, tp=args.tp, rank=args.rank, batch=args.batch, q=args.q,
                                arch=args.arch, sms=args.sms, experts=args.experts)
    print(json.dumps(report, indent=1) if args.json else render_model_table(report))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from rewriter.commands.report import build_report, render_table, to_dot

    if not (math.isfinite(args.hbm_tbps) and args.hbm_tbps > 0):
        raise ShapeError(f"--hbm-tbps must be positive and finite, got {args.hbm_tbps}")
    if args.all_layers:
        return run_inspect_all(args)
    if args.sms is not None:
        raise ShapeError("--sms goes with --all-layers (one layer's table plans no kernels; compile --sms does)")
    if args.png and shutil.which("dot") is None:
        raise ShapeError("--png needs Graphviz's dot on PATH (apt-get install graphviz); --dot writes the source")
    result = layer_of(args)
    report = build_report(result, model=args.model, hbm_tbps=args.hbm_tbps)
    written = []
    for path in (args.dot, args.png):
        if path is None:
            continue
        for lg, target, title in zip((result.before, result.after), _pair(path), ("before", "after")):
            source = to_dot(lg, f"{args.model} layer {args.layer} {title} rewrite")
            if path is args.png:
                subprocess.run(["dot", "-Tpng", "-o", str(target)], input=source, text=True, check=True)
            else:
                target.write_text(source)
            written.append(str(target))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_table(report, show_nodes=args.nodes))
        if args.graph:
            print(f"\ngraph before:\n{result.before.gm.code}\ngraph after:\n{result.after.gm.code}")
        for path in written:
            print(f"wrote {path}")
    return 0
