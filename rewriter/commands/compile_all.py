"""``python -m rewriter compile --all-layers``: fill the kernel cache for every layer and batch
a server builds, before the server starts.

Two phases, both spread over ``--jobs`` worker processes:
1. plan: each distinct layer structure (``KimiDecoderLayer.structure``: 24 in Kimi K3) at each
   served batch is traced and rewritten once and its kernels' specs collected (the plan the
   server's own compile step reads, ``rewriter.compiler.plan``); with ``--rules`` files, each
   worker loads them too and plans with them (those graphs are not stored in the program cache:
   a server rewrites with the built-in rules only);
2. compile: each distinct spec once (most are shared by several structures and batches), with
   a line per kernel and an ETA.
The disk cache (``codegen.cache``) is safe for several processes: entries are renamed into
place and a compile holds a lock, so the TP ranks of a host that start together compile each
kernel once and the others wait for it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any


def _plan_one(model: str, layer_idx: int, shape_kwargs: dict, experts: str, arch: str,
              cache_dir: str | None, sms: int | None, rules_files: tuple[str, ...]) -> dict[str, Any]:
    """(worker) The specs of one layer structure at one batch, or why it cannot be served. Built-in
    rules only: its rewritten graphs go to the program cache (``rewriter.compiler.program_cache``)
    a server start reads; with ``rules_files`` added, they are not stored (not the server's graphs)."""
    from rewriter.commands.layer_args import rule_set
    from rewriter.compiler.plan import plan, program_refusal
    from rewriter.compiler.program_cache import ProgramCache, rewrite_cached
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    cfg = KimiK3Config.load(model)
    shape = DecodeShape(**shape_kwargs)
    layer = build_layer(cfg, layer_idx, tp=shape.tp, rank=shape.rank, dtype=shape.dtype, experts=experts)
    if rules_files:
        result = rewrite(trace(layer, shape), rule_set(rules_files))
    else:
        result = rewrite_cached(layer, shape, ProgramCache(cache_dir))
    rows = plan(result, arch, sms=sms)
    return {"layer": layer_idx, "batch": shape.batch, "refusal": program_refusal(rows),
            "specs": [spec for row in rows for spec in row.get("specs", ())]}


def _compile_one(spec, cache_dir: str | None, force: bool) -> dict[str, Any]:
    """(worker) Compile ``spec`` into the disk cache, or read it there."""
    from codegen.cache import KernelCache
    from codegen.compiler import CodegenError, compile_kernel

    t0 = time.perf_counter()
    try:
        k = compile_kernel(spec, cache=KernelCache(cache_dir), force=force)
    except CodegenError as e:
        return {"label": spec.label(), "status": "failed", "detail": str(e), "seconds": time.perf_counter() - t0}
    return {"label": spec.label(), "status": "compiled", "cache": "miss" if k.cache == "miss" else "hit",
            "seconds": time.perf_counter() - t0}


def _eta(done: int, total: int, elapsed: float) -> str:
    if not done or done == total:
        return ""
    left = elapsed / done * (total - done)
    return f", ETA {int(left // 60)}m{int(left % 60):02d}s"


def run_compile_all(args: argparse.Namespace) -> int:
    from codegen.cache import KernelCache
    from codegen.compiler import available
    from rewriter.commands.layer_args import DTYPES, rules_of, shape_of
    from rewriter.compiler.pipeline import served_batches
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers.decoder import layer_structures
    from rewriter.model.shape import ShapeError

    cfg = KimiK3Config.load(args.model)
    batches = tuple(sorted(set(args.batches))) if args.batches else served_batches(q=args.q)
    if any(b < 1 for b in batches):
        raise ShapeError(f"--batches must be positive, got {list(batches)}")
    if args.jobs is not None and args.jobs < 1:
        raise ShapeError(f"--jobs must be >= 1, got {args.jobs}")
    jobs = args.jobs or max(1, min(os.cpu_count() or 1, 16))
    rules_of(args)  # a bad rules file is named here, once, not in every worker
    rules_files = tuple(str(Path(p).resolve()) for p in args.rules)
    if not args.dry_run:
        reason = available()
        if reason:
            print(f"error: cannot compile CuTe DSL kernels: {reason}", file=sys.stderr)
            return 2
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    structures = layer_structures(cfg, args.tp, args.rank, args.experts)
    block_size, block_from = shape_of(args, cfg).block_size, "--block-size" if args.block_size else "vLLM's"
    base = {"tp": args.tp, "rank": args.rank, "dtype": DTYPES[args.dtype], "arch": args.arch, "q": args.q,
            "context": args.context, "block_size": block_size, "conv_layout": args.conv_layout,
            "kv_cache_dtype": args.kv_cache_dtype}
    work = [(layers[0], b) for layers in structures.values() for b in batches]
    say(f"{args.model}: {cfg.num_hidden_layers} layers, {len(structures)} structures x {len(batches)} batches "
        f"{list(batches)} = {len(work)} plans, TP {args.tp} rank {args.rank}, {args.arch}"
        f"{f' ({args.sms} SMs)' if args.sms else ''}, {args.kv_cache_dtype} MLA cache in pages of {block_size} "
        f"({block_from}), {jobs} processes" + (f"; rules added from {', '.join(rules_files)}" if rules_files else ""))
    t0 = time.perf_counter()
    plans: dict[tuple[int, int], dict] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        cache_dir = str(args.cache_dir) if args.cache_dir else None
        futures = [pool.submit(_plan_one, args.model, i, {**base, "batch": b}, args.experts, args.arch, cache_dir,
                               args.sms, rules_files) for i, b in work]
        for n, f in enumerate(as_completed(futures), 1):
            p = f.result()
            plans[(p["layer"], p["batch"])] = p
            if n % max(1, len(work) // 10) == 0 or n == len(work):
                elapsed = time.perf_counter() - t0
                say(f"  planned {n}/{len(work)} ({elapsed:.0f}s{_eta(n, len(work), elapsed)})")
        plan_s = time.perf_counter() - t0
        specs = list(dict.fromkeys(s for p in plans.values() for s in p["specs"]))
        served = {i: all(plans[(layers[0], b)]["refusal"] is None for b in batches)
                  for layers in structures.values() for i in layers}
        say(f"planned in {plan_s:.1f}s: {len(specs)} distinct kernels; {sum(served.values())} of "
            f"{cfg.num_hidden_layers} layers have every kernel at every batch")
        for reason, n in Counter(p["refusal"] for p in plans.values() if p["refusal"]).most_common():
            say(f"  not served: {n} plan{'' if n == 1 else 's'}: {reason}")
        results = []
        t1 = time.perf_counter()
        if args.dry_run:
            for s in specs:
                say(f"  would compile {s.label()}")
        else:
            futures = [pool.submit(_compile_one, s, cache_dir, args.force) for s in specs]
            for n, f in enumerate(as_completed(futures), 1):
                r = f.result()
                results.append(r)
                how = f"{r['seconds']:.1f}s (cache {r['cache']})" if r["status"] == "compiled" else \
                    f"FAILED: {r['detail']}"
                say(f"  [{n}/{len(specs)}] {how}  {r['label']}{_eta(n, len(specs), time.perf_counter() - t1)}")
    compile_s = time.perf_counter() - t1
    failed = [r for r in results if r["status"] == "failed"]
    misses = sum(r.get("cache") == "miss" for r in results)
    summary = {"model": args.model, "tp": args.tp, "rank": args.rank, "arch": args.arch, "sms": args.sms,
               "block_size": block_size, "rules_files": list(rules_files),
               "batches": list(batches),
               "structures": len(structures), "plans": len(work), "kernels": len(specs),
               "compiled": len(results) - len(failed), "cache_misses": misses, "failed": len(failed),
               "plan_seconds": round(plan_s, 1), "compile_seconds": round(compile_s, 1),
               "layers_served": sum(served.values()), "cache": str(KernelCache(args.cache_dir).root),
               "refusals": {f"layer {p['layer']} batch {p['batch']}": p["refusal"] for p in plans.values()
                            if p["refusal"]}}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{len(specs)} kernels: {summary['compiled']} compiled ({misses} cache miss), {len(failed)} failed; "
              f"plan {plan_s:.1f}s + compile {compile_s:.1f}s; cache {summary['cache']}")
    return 1 if failed else 0
