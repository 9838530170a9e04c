"""Command line: ``python -m rewriter inspect`` (also the ``k3-rewriter`` console script).

Bad input (unknown model, layer out of range, a TP size that does not divide the
model, a bad batch) ends with one line naming the problem and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import warnings

# torch warns at import when NumPy is absent; nothing here uses NumPy, so keep the CLI's output clean
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from rewriter.bench_cmd import add_bench_parser, run_bench
from rewriter.decode_cmd import add_decode_parser, run_decode
from rewriter.fuzz_cmd import add_fuzz_parser, run_fuzz
from rewriter.compile_cmd import add_compile_parser, run_compile
from rewriter.config import PRESETS, ConfigError, KimiK3Config
from rewriter.cost import H200_COPY_TBPS
from rewriter.pages import vllm_block_size
from rewriter.rewrite import RewriteResult
from rewriter.rules import RuleError, RuleSet, default_rules, load_rules_file
from rewriter.shape import ARCHES, CONV_LAYOUTS, KV_CACHE_DTYPES, DecodeShape, ShapeError
from rewriter.variant import VariantError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    """The options that pick a layer and its decode shape (shared by inspect and compile)."""
    p.add_argument("--model", default="kimi-k3",
                   help=f"a preset ({', '.join(PRESETS)}) or a path to a config.json (default kimi-k3)")
    p.add_argument("--layer", type=int, default=1, help="0-based layer index (default 1, a KDA+MoE layer)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (default 0)")
    p.add_argument("--batch", type=_positive_int, default=1, help="decode requests in the step (default 1)")
    p.add_argument("--q", type=_positive_int, default=1, help="tokens per request (default 1; >1: speculative)")
    p.add_argument("--context", type=int, default=4096, help="tokens already cached per request (default 4096)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="MLA cache page size (default: the page vLLM binds for the model, TP, cache dtype and "
                        "draft tokens, rewriter/pages.py; Kimi K3 at TP 16: 384 bf16, 768 fp8)")
    p.add_argument("--arch", choices=ARCHES, default="sm_100a", help="GPU architecture (default sm_100a)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation/weight dtype (default bf16)")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="routed experts: the released checkpoint's MXFP4 in the layout vLLM serves (Humming's; "
                        "default) or bf16")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16",
                   help="MLA latent cache: bf16 or fp8 (E4M3, one per-tensor scale: vLLM's --kv-cache-dtype fp8)")
    p.add_argument("--conv-layout", choices=CONV_LAYOUTS, default="SD",
                   help="how vLLM keeps a KDA slot's conv state (VLLM_SSM_CONV_STATE_LAYOUT; default SD, vLLM's)")
    p.add_argument("--rules", type=Path, metavar="FILE", action="append", default=[],
                   help="a Python file whose RULES list is added to the built-in rules (repeatable)")


def block_size_of(args: argparse.Namespace, cfg: KimiK3Config) -> int:
    """``--block-size``, else the MLA cache page vLLM binds at the options' TP, cache dtype and
    draft tokens (``rewriter.pages``): what a server's kernels are compiled for."""
    if args.block_size is not None:
        return args.block_size
    cfg.shard(args.tp)  # raises ConfigError when tp does not divide the model (argparse checked the dtype)
    return vllm_block_size(cfg, args.tp, args.kv_cache_dtype, args.q - 1)


def rewritten_layer(args: argparse.Namespace, rules: RuleSet | None = None) -> RewriteResult:
    """The layer the options name, traced at their shape and rewritten (built-in rules plus --rules)."""
    from rewriter.layers import build_layer
    from rewriter.rewrite import rewrite
    from rewriter.trace import trace

    cfg = KimiK3Config.load(args.model)
    dtype = DTYPES[args.dtype]
    shape = DecodeShape(batch=args.batch, tp=args.tp, rank=args.rank, dtype=dtype, arch=args.arch, q=args.q,
                        context=args.context, block_size=block_size_of(args, cfg), conv_layout=args.conv_layout,
                        kv_cache_dtype=args.kv_cache_dtype)
    layer = build_layer(cfg, args.layer, tp=args.tp, rank=args.rank, dtype=dtype, experts=args.experts)
    rules = default_rules() if rules is None else rules
    for path in args.rules:
        for rule in load_rules_file(path):
            rules.add(rule)
    return rewrite(trace(layer, shape), rules)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rewriter", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
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
    add_compile_parser(sub)
    add_bench_parser(sub)
    add_decode_parser(sub)
    add_fuzz_parser(sub)
    return p


def _pair(path: Path) -> tuple[Path, Path]:
    """(before, after) file names for one user-given path."""
    return path, path.with_name(f"{path.stem}.after{path.suffix}")


def run_inspect_all(args: argparse.Namespace) -> int:
    """Every layer of the model, each distinct layer structure traced and rewritten once."""
    from rewriter.layers.decoder import layer_structures
    from rewriter.report import build_model_report, layer_row, render_model_table

    single = [f"--{n}" for n in ("dot", "png", "graph", "nodes") if getattr(args, n)]
    if single:
        raise ShapeError(f"--all-layers prints one row per layer; {', '.join(single)} take one --layer")
    if args.sms is not None and args.sms < 1:
        raise ShapeError(f"--sms must be >= 1, got {args.sms}")
    cfg = KimiK3Config.load(args.model)
    rows = []
    for layers in layer_structures(cfg, args.tp, args.rank, args.experts).values():
        row = layer_row(rewritten_layer(argparse.Namespace(**{**vars(args), "layer": layers[0]}),
                                        RuleSet() if args.no_rules else None), args.arch, args.sms)
        rows += [{**row, "layer": i} for i in layers]
    rows.sort(key=lambda r: r["layer"])
    report = build_model_report(rows, model=args.model, tp=args.tp, rank=args.rank, batch=args.batch, q=args.q,
                                arch=args.arch, sms=args.sms, experts=args.experts)
    print(json.dumps(report, indent=1) if args.json else render_model_table(report))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from rewriter.report import build_report, render_table, to_dot

    if args.all_layers:
        return run_inspect_all(args)
    if args.sms is not None:
        raise ShapeError("--sms goes with --all-layers (one layer's table plans no kernels; compile --sms does)")
    if args.hbm_tbps <= 0:
        raise ShapeError(f"--hbm-tbps must be positive, got {args.hbm_tbps}")
    if args.png and shutil.which("dot") is None:
        raise ShapeError("--png needs Graphviz's dot on PATH (apt-get install graphviz); --dot writes the source")
    result = rewritten_layer(args, RuleSet() if args.no_rules else None)
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"compile": run_compile, "bench": run_bench, "inspect": run_inspect,
                "decode": run_decode, "fuzz": run_fuzz}[args.command](args)
    except (ConfigError, ShapeError, RuleError, VariantError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
