"""Time the routed experts on MXFP4 weights: the rewriter's kernels and Humming's (vLLM 0.33's
MoE kernels on sm_90), on the very same tensors, in one run. Needs CUDA, the cutedsl extra and
humming-kernels (the GPU machine gets its wheel from ``.whl/``).

All 896 experts of one rank (TP 16: I = 256 held, 192 live; TP 8: 384) are drawn in the
checkpoint's layout and laid out by Humming's own transform, as vLLM does after loading. Each
timed CUDA graph replays ``ROUTINGS`` launches (Humming's: ``rewriter.stock_path.HummingMoE``, its
routing alignment made before the graph) with different random routings, so the experts
one launch reads are not in the L2 from the last (20 x 16 experts x 1.1 MB > 50 MB). Effective
bandwidth = the MXFP4 bytes a step must read (the selected experts' live rows: codes and
scales, each distinct expert once) over the median time per launch; the floor is those bytes
at 4.27 TB/s (the H200's measured copy bandwidth). Both of the rewriter's grids are timed at
every token count (per (token, slot) pair, and per expert, which the template runs from
``MXFP4_BY_EXPERT_FROM`` tokens where that is set), so the table shows where a switch would pay.

    python examples/bench_mxfp4_experts.py                       # TP 16 and 8, 1 / 8 / 16 / 32 / 64 tokens
    python examples/bench_mxfp4_experts.py --tp 8 --tokens 16 24
    python examples/bench_mxfp4_experts.py --tokens 64 --repeat 2   # tokens in pairs with one expert set

``--repeat R``: each drawn expert set serves R consecutive tokens, so a selected expert's pairs
sit 16 pairs apart in the per-pair grid's order; if the per-pair time drops with the bytes
(each distinct expert once), the L2 serves a repeated expert's second read, and ordering the
grid's pairs by expert would pay (``docs/CODEGEN.md``, the per-expert grids).
"""
from __future__ import annotations

import argparse
import sys

import torch

import patterns.moe  # noqa: F401  (defines k3f::routed_experts_mxfp4)
from bench_kernels import graph_us  # examples/: CUDA-graph replay timing
from codegen.bind import device_arch, load_kernels
from codegen.launchers import experts as launcher
from rewriter.cost import H200_COPY_TBPS
from rewriter.layers.experts import GROUP, humming_relayout, random_mxfp4
from rewriter.stock_path import HummingMoE

E, K, L = 896, 16, 3584
BETA, LINEAR_BETA = 4.0, 25.0
ROUTINGS = 20
SHAPES = {16: (256, 192), 8: (384, 384)}  # TP -> (I held, I live) per rank


def must_read(ids, inter_live) -> int:
    """MXFP4 bytes a step reads at least: each distinct expert's live rows once, codes and scales."""
    per_expert = 2 * inter_live * (L // 2 + L // GROUP) + L * (inter_live // 2 + inter_live // GROUP)
    return int(ids.unique().numel()) * per_expert


def bench(tp, gen, token_counts, repeat=1) -> list[dict]:
    inter, live = SHAPES[tp]
    rows = (torch.arange(inter, device="cuda") < live).repeat(2)
    laid, configs = {}, {}
    for name, (n, k, kw) in {"w13": (2 * inter, L, {"live_rows": rows, "scale_exponent": -7}),
                             "w2": (L, inter, {"live_k": live, "scale_exponent": -5})}.items():
        packed, scale = random_mxfp4(E, n, k, generator=gen, device="cuda", **kw)
        w, s, configs[name] = humming_relayout(packed, scale, n, k)
        laid[name] = (w, s)
        del packed, scale
    peer = HummingMoE(configs, E, inter, L, BETA, LINEAR_BETA)
    out = []
    for tokens in token_counts:
        x = torch.randn(tokens, L, device="cuda").bfloat16()
        routes = []
        for _ in range(ROUTINGS):
            sets = -(-tokens // repeat)  # distinct expert sets, each for `repeat` consecutive tokens
            ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(sets)])
            ids = ids.repeat_interleave(repeat, dim=0)[:tokens]
            scores = torch.rand(tokens, K, device="cuda")
            routes.append((scores / scores.sum(-1, keepdim=True), ids))
        args = [(x, w, i, *laid["w13"], *laid["w2"], BETA, LINEAR_BETA, "humming", live) for w, i in routes]
        aligned = [peer.align(i) for _, i in routes]  # outside the timed graph, as before
        theirs = graph_us(lambda: [peer(x, w, i, laid["w13"], laid["w2"], al)
                                   for (w, i), al in zip(routes, aligned)]) / ROUTINGS
        ref = peer(x, *routes[0], laid["w13"], laid["w2"], aligned[0])
        served_from = launcher.MXFP4_BY_EXPERT_FROM
        row = {"tp": tp, "tokens": tokens, "repeat": repeat, "humming_us": theirs,
               "grid": "expert" if served_from is not None and tokens >= served_from else "pair"}
        for grid, switch in (("pair", None), ("expert", 1)):
            launcher.MXFP4_BY_EXPERT_FROM = switch  # this grid at every token count
            try:
                r = load_kernels("k3f::routed_experts_mxfp4", device_arch(), args[0])
            finally:
                launcher.MXFP4_BY_EXPERT_FROM = served_from
            assert not isinstance(r, str), r
            tpl, specs, fns = r
            y = torch.empty(tokens, L, dtype=torch.bfloat16, device="cuda")
            act = torch.empty(tokens, K, live, dtype=torch.bfloat16, device="cuda")
            row[f"{grid}_us"] = graph_us(lambda: [tpl.launch(fns, specs, a, out=(y, act)) for a in args]) / ROUTINGS
            y.fill_(float("nan"))
            tpl.launch(fns, specs, args[0], out=(y, act))
            row[f"{grid}_diff"] = float((y.float() - ref.float()).norm() / ref.float().norm())
        nbytes = sum(must_read(i, live) for _, i in routes) / ROUTINGS
        row["mb"], row["floor_us"] = nbytes / 1e6, nbytes / (H200_COPY_TBPS * 1e6)
        out.append(row)
        print(f"TP {tp:>2} T {tokens:>2}: {row['mb']:7.1f} MB  floor {row['floor_us']:6.1f} us | per pair "
              f"{row['pair_us']:7.1f} us | per expert {row['expert_us']:7.1f} us | Humming {theirs:7.1f} us | "
              f"outputs differ from Humming's by {row['pair_diff']:.1e} / {row['expert_diff']:.1e}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[16, 8], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=1, help="consecutive tokens sharing one expert set (default 1)")
    a = ap.parse_args()
    bad = [f"--tokens {t} (1..64)" for t in a.tokens if not 1 <= t <= 64]
    bad += [f"--repeat {a.repeat} (at least 1)"] if a.repeat < 1 else []
    if bad:
        ap.error(", ".join(bad))
    print(f"{torch.cuda.get_device_name()}, {device_arch()}: routed experts, MXFP4 in Humming's layout, "
          f"E = {E}, top-{K}, L = {L}; each expert set drawn for {a.repeat} consecutive token(s)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.no_grad():
        for tp in a.tp:
            rows += bench(tp, gen, a.tokens, a.repeat)
            torch.cuda.empty_cache()
    print(f"\n{'TP':>3} {'tokens':>6} {'MB read':>8} {'floor us':>9} {'per pair us':>12} {'per expert us':>14} "
          f"{'served':>7} {'% floor':>8} {'Humming us':>11} {'speedup':>8}")
    for r in rows:
        served = r[f"{r['grid']}_us"]
        print(f"{r['tp']:>3} {r['tokens']:>6} {r['mb']:>8.1f} {r['floor_us']:>9.1f} {r['pair_us']:>12.1f} "
              f"{r['expert_us']:>14.1f} {r['grid']:>7} {100 * r['floor_us'] / served:>7.0f}% {r['humming_us']:>11.1f} "
              f"{r['humming_us'] / served:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
