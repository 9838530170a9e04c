"""``python -m rewriter compile``: compile every kernel of a layer's schedule (no GPU needed);
``--all-layers``: of every layer and served batch (``rewriter/commands/compile_all.py``).

Traces and rewrites the layer as ``inspect`` does, builds its schedule, and for each kernel
prints one line: ``compiled`` (time, cache hit or miss; ``generated`` where the kernel is made
from the fused op's reference rather than a hand-written template) when a CuTe DSL template
takes it, ``no hand-written CuTe DSL template; not generated: ...`` for a fused op with
neither, ``refused`` with the templates' reasons, or ``vLLM stock kernel`` for what no rule
fused. The compiled kernels land in the
disk cache (``$K3_REWRITER_CACHE``, default ``~/.cache/k3-rewriter``) that a server
process reads at start. ``--sass`` adds each kernel's registers, spills and SASS instruction
counts (``codegen/sass.py``). Exit status 0 when every template kernel compiled, 1 when one
failed, 2 for bad input or when CuTe DSL is not installed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rewriter.commands.layer_args import add_layer_arguments, layer_of
from rewriter.compiler.plan import plan
from rewriter.model.shape import ShapeError


def add_compile_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("compile", help="compile the CuTe DSL kernels of one layer's schedule (no GPU needed)")
    add_layer_arguments(c)
    c.add_argument("--cache-dir", type=Path, metavar="DIR",
                   help="kernel cache folder (default $K3_REWRITER_CACHE or ~/.cache/k3-rewriter)")
    c.add_argument("--force", action="store_true", help="recompile even what the cache holds")
    c.add_argument("--dry-run", action="store_true", help="list the kernels and their specs, compile nothing")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    c.add_argument("--sass", action="store_true",
                   help="under each kernel: its registers, spills and SASS instruction counts (ptxas and nvdisasm: "
                        "pip install nvidia-cuda-nvdisasm)")
    c.add_argument("--sass-dir", type=Path, metavar="DIR", help="with --sass: write each kernel's SASS into DIR")
    c.add_argument("--all-layers", action="store_true",
                   help="every kernel of every layer at every batch a server builds (rewriter/commands/compile_all.py)")
    c.add_argument("--batches", type=int, nargs="+", metavar="N",
                   help="with --all-layers: the batch sizes (default the server's: 1..8, 16, 32, 64)")
    c.add_argument("--jobs", type=int, help="with --all-layers: worker processes (default: the CPUs, at most 16)")
    c.add_argument("--sms", type=int, metavar="N",
                   help="the kernels for a GPU of N SMs: a grid that must be resident at once is capped by them "
                        "(default: 128 or more, as on an H100 SXM, H200 or B200; an H100 PCIe has 114, an H20 78). "
                        "A server plans for its own GPU's")
    return c


def _sass(k, sass_dir: Path | None) -> dict:
    """A compiled kernel's SASS summary for its stage entry (and its SASS written to ``sass_dir``)."""
    from codegen.sass import SassError, assemble, describe, disassemble

    try:
        res = assemble(k.ptx, k.spec.arch)
        sass = disassemble(res.cubin)
        figures, line = describe(res, sass)
        if sass_dir:
            sass_dir.mkdir(parents=True, exist_ok=True)
            path = sass_dir / f"{k.spec.kernel}_{k.key[:12]}.sass"
            path.write_text(sass)
            line += f" ({path})"
    except SassError as e:
        return {"detail_sass": f"no SASS: {e}"}
    return {"sass": figures, "detail_sass": line}


def run_compile(args: argparse.Namespace) -> int:
    from codegen.cache import KernelCache
    from codegen.compiler import CodegenError, available, compile_kernel

    if args.sms is not None and args.sms < 1:
        raise ShapeError(f"--sms must be >= 1, got {args.sms}")
    if args.all_layers:
        from rewriter.commands.compile_all import run_compile_all

        return run_compile_all(args)
    if args.batches or args.jobs:
        raise ShapeError("--batches and --jobs go with --all-layers (one layer compiles at --batch)")
    if args.sass_dir and not args.sass:
        raise ShapeError("--sass-dir goes with --sass")
    if args.sass and args.dry_run:
        raise ShapeError("--sass reads the compiled kernels: leave out --dry-run")
    if args.sass:
        from codegen.sass import find_tool

        missing = {t: wheel for t, wheel in (("ptxas", "nvidia-cuda-nvcc"), ("nvdisasm", "nvidia-cuda-nvdisasm"))
                   if not find_tool(t)}
        if missing:
            raise ShapeError(f"--sass needs {' and '.join(missing)} (pip install {' '.join(missing.values())}, "
                             "or CUDA on PATH)")
    result = layer_of(args)
    shape = result.before.shape
    rows = plan(result, args.arch, sms=args.sms)
    pending = [r for r in rows if r["status"] == "pending"]
    out = sys.stdout
    head = (f"{args.model} layer {args.layer} ({result.before.kind}), TP {args.tp} "
            f"rank {args.rank}, batch {args.batch} x q {args.q} = {shape.tokens} tokens, {args.dtype}, "
            f"{args.arch}{f' ({args.sms} SMs)' if args.sms else ''}: {len(rows)} scheduled ops, {len(pending)} with a "
            f"CuTe DSL template ({sum(len(r['specs']) for r in pending)} kernels)")
    reason = None if args.dry_run or not pending else available()
    if reason:
        print(f"error: cannot compile CuTe DSL kernels: {reason}", file=sys.stderr)
        return 2
    cache = KernelCache(args.cache_dir)
    if not args.json:
        print(head, file=out, flush=True)
    t0 = time.perf_counter()
    failed = 0
    for row in rows:
        specs = row.get("specs")
        made = " (generated)" if row.get("implementation") == "generated" else ""
        if specs and args.dry_run:
            row["status"] = "planned"
            row["detail"] = f"\n{'':38}".join(f"would compile{made} {s.label()}" for s in specs)
        elif specs:
            row["stages"] = []
            for spec in specs:
                try:
                    k = compile_kernel(spec, cache=cache, force=args.force)
                except CodegenError as e:
                    row["stages"].append({"spec": spec, "status": "failed", "detail": f"compile failed: {e}"})
                    continue
                how = "miss" if k.cache == "miss" else "hit"
                row["stages"].append({"spec": spec, "status": "compiled", "cache": how, "seconds": k.seconds,
                                      "key": k.key, "path": k.path,
                                      "detail": f"compiled{made} {k.seconds:.2f}s (cache {how})  {spec.label()}"})
                if args.sass:
                    row["stages"][-1].update(_sass(k, args.sass_dir))
            bad = [st for st in row["stages"] if st["status"] == "failed"]
            failed += len(bad)
            row["status"] = "failed" if bad else "compiled"
            row["detail"] = "\n".join(f"{'':38}{st['detail']}" + (f"\n{'':40}{st['detail_sass']}" if "detail_sass" in st
                                                                   else "")
                                      for st in row["stages"]).lstrip()
        if not args.json:
            print(f"  {row['index']:>2} {row['kernel']:<32} {row['detail']}", file=out, flush=True)
    done = [st for r in rows for st in r.get("stages", ()) if st["status"] == "compiled"]
    hits = sum(st["cache"] == "hit" for st in done)
    no_kernel = sum(r["status"] == "missing" for r in rows)
    generated = sum(r.get("implementation") == "generated" for r in rows)
    planned = sum(r["status"] == "planned" for r in rows)
    dry = f", {planned} planned (dry run)" if planned else ""
    summary = (f"{len(done)} compiled ({len(done) - hits} cache miss, {hits} hit){dry} in "
               f"{time.perf_counter() - t0:.2f}s; {generated} generated; {no_kernel} fused ops without a GPU kernel; "
               f"{sum(r['status'] == 'stock' for r in rows)} stock; {failed} failed; cache {cache.root}")
    if args.json:
        for r in rows:
            if "specs" in r:
                r["specs"] = [spec.to_json() for spec in r["specs"]]
            for st in r.get("stages", ()):
                st["spec"] = st["spec"].to_json()
        print(json.dumps({"model": args.model, "layer": args.layer, "tp": args.tp, "batch": args.batch,
                          "tokens": shape.tokens, "arch": args.arch, "cache": str(cache.root), "kernels": rows,
                          "compiled": len(done), "failed": failed}, indent=1))
    else:
        print(summary, file=out)
    return 1 if failed else 0
