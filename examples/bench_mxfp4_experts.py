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
at 4.27 TB/s (the H200's measured copy bandwidth).

    python examples/bench_mxfp4_experts.py            # TP 16 and 8, 1 / 8 / 64 tokens
"""
from __future__ import annotations

import sys

import torch

import patterns.moe  # noqa: F401  (defines k3f::routed_experts_mxfp4)
from bench_kernels import graph_us  # examples/: CUDA-graph replay timing
from codegen.bind import device_arch, load_kernels
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


def bench(tp, gen) -> list[dict]:
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
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, L, device="cuda").bfloat16()
        routes = []
        for _ in range(ROUTINGS):
            ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)])
            scores = torch.rand(tokens, K, device="cuda")
            routes.append((scores / scores.sum(-1, keepdim=True), ids))
        args = [(x, w, i, *laid["w13"], *laid["w2"], BETA, LINEAR_BETA, "humming", live) for w, i in routes]
        r = load_kernels("k3f::routed_experts_mxfp4", device_arch(), args[0])
        assert not isinstance(r, str), r
        tpl, specs, fns = r
        y = torch.empty(tokens, L, dtype=torch.bfloat16, device="cuda")
        act = torch.empty(tokens, K, live, dtype=torch.bfloat16, device="cuda")
        ours = graph_us(lambda: [tpl.launch(fns, specs, a, out=(y, act)) for a in args]) / ROUTINGS
        aligned = [peer.align(i) for _, i in routes]  # outside the timed graph, as before
        theirs = graph_us(lambda: [peer(x, w, i, laid["w13"], laid["w2"], al)
                                   for (w, i), al in zip(routes, aligned)]) / ROUTINGS
        ref = peer(x, *routes[0], laid["w13"], laid["w2"], aligned[0])
        tpl.launch(fns, specs, args[0], out=(y, act))
        diff = float((y.float() - ref.float()).norm() / ref.float().norm())
        nbytes = sum(must_read(i, live) for _, i in routes) / ROUTINGS
        floor = nbytes / (H200_COPY_TBPS * 1e6)
        out.append({"tp": tp, "tokens": tokens, "mb": nbytes / 1e6, "floor_us": floor, "rewriter_us": ours,
                    "humming_us": theirs, "rel_diff": diff})
        print(f"TP {tp:>2} T {tokens:>2}: {nbytes / 1e6:7.1f} MB  floor {floor:6.1f} us | rewriter {ours:7.1f} us "
              f"{nbytes / ours / 1e6:6.2f} TB/s ({100 * floor / ours:3.0f}% of copy bw) | Humming {theirs:7.1f} us "
              f"{nbytes / theirs / 1e6:6.2f} TB/s | outputs differ by {diff:.1e}", flush=True)
    return out


def main() -> int:
    print(f"{torch.cuda.get_device_name()}, {device_arch()}: routed experts, MXFP4 in Humming's layout, "
          f"E = {E}, top-{K}, L = {L}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.no_grad():
        for tp in (16, 8):
            rows += bench(tp, gen)
            torch.cuda.empty_cache()
    print(f"\n{'TP':>3} {'tokens':>6} {'MB read':>8} {'floor us':>9} {'rewriter us':>12} {'% floor':>8} "
          f"{'Humming us':>11} {'speedup':>8}")
    for r in rows:
        print(f"{r['tp']:>3} {r['tokens']:>6} {r['mb']:>8.1f} {r['floor_us']:>9.1f} {r['rewriter_us']:>12.1f} "
              f"{100 * r['floor_us'] / r['rewriter_us']:>7.0f}% {r['humming_us']:>11.1f} "
              f"{r['humming_us'] / r['rewriter_us']:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
