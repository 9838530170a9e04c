"""Time the routed experts on MXFP4 weights: the rewriter's kernels and Humming's (vLLM 0.33's
MoE kernels on sm_90), on the very same tensors, in one run. Needs CUDA, the cutedsl extra and
humming-kernels (the GPU machine gets its wheel from ``.whl/``).

All 896 experts of one rank (TP 16: I = 256 held, 192 live; TP 8: 384) are drawn in the
checkpoint's layout and laid out by Humming's own transform, as vLLM does after loading. Each
timed CUDA graph replays ``ROUTINGS`` launches (Humming's: ``rewriter.commands.stock_path.HummingMoE``, its
routing alignment made before the graph) with different random routings, so the experts
one launch reads are not in the L2 from the last (20 x 16 experts x 1.1 MB > 50 MB). Effective
bandwidth = the MXFP4 bytes a step must read (the selected experts' live rows: codes and
scales, each distinct expert once) over the median time per launch; the floor is those bytes
at 4.27 TB/s (the H200's measured copy bandwidth). Both of the rewriter's forms are timed at
every token count: the per-pair grids (``k3f::routed_experts_mxfp4``, after ``k3f::router_topk``,
timed alone beside them), and the router with its plan, the up stage per chosen expert and the
down stage per pair or, from ``MXFP4_DOWN_BY_EXPERT_FROM`` tokens, per chosen expert
(``k3f::routed_moe_mxfp4``: the router files the pairs by expert, each chosen expert's weights are
read once; its logits are made so that their top-k are the drawn ids), so the table shows where
the switches (``patterns.moe.MOE_BY_EXPERT_FROM``, ``MXFP4_DOWN_BY_EXPERT_FROM``) should sit. ``--smem-weights
always|never``: both stages' weights staged in shared memory at every token count, or at none
(served: from ``codegen.launchers.experts.MXFP4_SMEM_WEIGHTS_FROM`` tokens).

    python examples/bench_mxfp4_experts.py                       # TP 16 and 8, 1 / 8 / 16 / 32 / 64 tokens
    python examples/bench_mxfp4_experts.py --tp 8 --tokens 16 24
    python examples/bench_mxfp4_experts.py --tokens 64 --repeat 2   # tokens in pairs with one expert set

``--repeat R``: each drawn expert set serves R consecutive tokens, so a selected expert's pairs
sit 16 pairs apart in the per-pair grid's order (on 2026-12-02 the per-pair time did not drop
with the bytes at R = 2: the L2 does not make a repeated expert's second read cheap there, its
dequantization and load latency are the cost; ``docs/CODEGEN.md``).
"""
from __future__ import annotations

import argparse
import sys

import torch
from bench_kernels import graph_us, kernel  # examples/: CUDA-graph replay timing, a call's loaded kernels

import patterns.moe  # noqa: F401  (defines k3f::routed_experts_mxfp4 and k3f::routed_moe_mxfp4)
import patterns.router  # noqa: F401  (defines k3f::router_topk)
from codegen.bind import device_arch
from codegen.launchers import experts as experts_launcher
from rewriter.commands.bench import profile_kernels, short_name
from rewriter.commands.stock_path import HummingMoE
from rewriter.compiler.cost import H200_COPY_TBPS
from rewriter.model.layers.experts import GROUP, humming_relayout, random_mxfp4
from rewriter.model.layers.moe import route

E, K, L = 896, 16, 3584
BETA, LINEAR_BETA = 4.0, 25.0
SCALING = 2.5  # any: the routed weights' scale
ROUTINGS = 20
SHAPES = {16: (256, 192), 8: (384, 384)}  # TP -> (I held, I live) per rank
# the launcher's tiling constants a run may set: option -> (constant, what it sets)
KNOBS = {"--stream-stages": ("MXFP4_STREAM_STAGES", "cp.async stages of the per-expert up stage"),
         "--down-stages": ("MXFP4_DOWN_STREAM_STAGES", "cp.async stages of the per-expert down stage"),
         "--down-groups-per-warp": ("MXFP4_DOWN_GROUPS_PER_WARP",
                                    "scale groups a warp of the per-expert down stage streams, in whole row tiles"),
         "--down-by-expert-from": ("MXFP4_DOWN_BY_EXPERT_FROM",
                                   "token count from which the down stage runs per chosen expert")}


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
        row = {"tp": tp, "tokens": tokens, "repeat": repeat, "humming_us": theirs}
        y = torch.empty(tokens, L, dtype=torch.bfloat16, device="cuda")
        act = torch.empty(tokens, K, live, dtype=torch.bfloat16, device="cuda")

        tpl, specs, fns = kernel("k3f::routed_experts_mxfp4", args[0])
        row["pair_us"] = graph_us(lambda: [tpl.launch(fns, specs, a, out=(y, act)) for a in args]) / ROUTINGS
        row["pair_diff"] = diff(lambda: tpl.launch(fns, specs, args[0], out=(y, act)), y, ref)

        # the router's operands: logits whose top-k are each routing's ids
        plans = [(*routing_logits(i, gen), K, True, SCALING) for _, i in routes]
        tk_tpl, tk_specs, tk_fns = kernel("k3f::router_topk", plans[0])
        row["router_us"] = graph_us(lambda: [tk_tpl.launch(tk_fns, tk_specs, p) for p in plans]) / ROUTINGS

        moe = [(x, p[0], p[1], *laid["w13"], *laid["w2"], *p[2:], BETA, LINEAR_BETA, "humming", live) for p in plans]
        weights, ids = route(plans[0][0], plans[0][1], top_k=K, renormalize=True, scaling=SCALING)
        ref_moe = peer(x, weights, ids, laid["w13"], laid["w2"], peer.align(ids))
        # the router's plan, the per-expert up stage and the down stage (per expert from 64 tokens)
        m_tpl, m_specs, m_fns = kernel("k3f::routed_moe_mxfp4", moe[0])
        row["expert_us"] = graph_us(lambda: [m_tpl.launch(m_fns, m_specs, a, out=(y, act)) for a in moe]) / ROUTINGS
        row["expert_diff"] = diff(lambda: m_tpl.launch(m_fns, m_specs, moe[0], out=(y, act)), y, ref_moe)
        forms = {"pair": (tpl, specs, fns, args[0]), "expert": (m_tpl, m_specs, m_fns, moe[0])}
        # one un-captured call of each form, kernel by kernel (the first routing: the L2 holds
        # less of it than in the graphs, whose 20 routings it cycles through)
        for form, (t_, s_, f_, a_) in forms.items():
            row[f"{form}_stages"] = profile_kernels(lambda: t_.launch(f_, s_, a_, out=(y, act)))
        nbytes = sum(must_read(i, live) for _, i in routes) / ROUTINGS
        row["mb"], row["floor_us"] = nbytes / 1e6, nbytes / (H200_COPY_TBPS * 1e6)
        out.append(row)
        print(f"TP {tp:>2} T {tokens:>2}: {row['mb']:7.1f} MB  floor {row['floor_us']:6.1f} us | router + per "
              f"pair {row['router_us']:5.1f} + {row['pair_us']:7.1f} us | router's plan, up per expert, down per "
              f"{'expert' if tokens >= experts_launcher.MXFP4_DOWN_BY_EXPERT_FROM else 'pair'} "
              f"{row['expert_us']:7.1f} us | Humming {theirs:7.1f} us | outputs differ from Humming's by "
              f"{row['pair_diff']:.1e} / {row['expert_diff']:.1e}", flush=True)
        for form in forms:
            print(f"    {form:>6}: " + ", ".join(f"{short_name(n)} {us:.1f} us" for n, us in row[f"{form}_stages"]))
    return out


def diff(launch, y, ref) -> float:
    """Relative difference of ``launch``'s output (written to ``y``, poisoned first) from ``ref``."""
    y.fill_(float("nan"))
    launch()
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def routing_logits(ids, gen):
    """Router logits [T, E] and a small bias whose top-k are ``ids`` (theirs 6..7, the rest about -6)."""
    tokens = ids.shape[0]
    logits = torch.randn(tokens, E, device="cuda", generator=gen) * 0.5 - 6
    logits.scatter_(1, ids, 6 + torch.rand(tokens, K, device="cuda", generator=gen))
    return logits, torch.randn(E, device="cuda", generator=gen) * 0.01


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[16, 8], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=1, help="consecutive tokens sharing one expert set (default 1)")
    ap.add_argument("--smem-weights", choices=("served", "always", "never"), default="served",
                    help="both stages' weights staged in shared memory: as served (from "
                         "codegen.launchers.experts.MXFP4_SMEM_WEIGHTS_FROM tokens), always or never")
    for option, (constant, what) in KNOBS.items():
        ap.add_argument(option, type=int, default=getattr(experts_launcher, constant),
                        help=f"{what} (default codegen.launchers.experts.{constant} = "
                             f"{getattr(experts_launcher, constant)})")
    a = ap.parse_args()
    bad = [f"--tokens {t} (1..64)" for t in a.tokens if not 1 <= t <= 64]
    bad += [f"--repeat {a.repeat} (at least 1)"] if a.repeat < 1 else []
    knobs = {constant: getattr(a, option[2:].replace("-", "_")) for option, (constant, _) in KNOBS.items()}
    bad += [f"{option} {knobs[constant]} (at least 1)" for option, (constant, _) in KNOBS.items()
            if knobs[constant] < 1]
    if bad:
        ap.error(", ".join(bad))
    for constant, value in knobs.items():
        setattr(experts_launcher, constant, value)
    if a.smem_weights != "served":
        experts_launcher.MXFP4_SMEM_WEIGHTS_FROM = 1 if a.smem_weights == "always" else None
    print(f"{torch.cuda.get_device_name()}, {device_arch()}: routed experts, MXFP4 in Humming's layout, "
          f"E = {E}, top-{K}, L = {L}; each expert set drawn for {a.repeat} consecutive token(s); the stages' weights "
          f"in shared memory from {experts_launcher.MXFP4_SMEM_WEIGHTS_FROM} tokens; the per-expert up stage streams "
          f"through {a.stream_stages} stages; the down stage per expert from {a.down_by_expert_from} tokens, "
          f"{a.down_stages} stages, {a.down_groups_per_warp} scale groups a warp", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.no_grad():
        for tp in a.tp:
            rows += bench(tp, gen, a.tokens, a.repeat)
            torch.cuda.empty_cache()
    print(f"\n{'TP':>3} {'tokens':>6} {'MB read':>8} {'floor us':>9} {'router us':>10} {'per pair us':>12} "
          f"{'router+pair':>12} {'plan+per expert':>15} {'% floor':>8} {'Humming us':>11}")
    for r in rows:
        best = min(r["router_us"] + r["pair_us"], r["expert_us"])
        print(f"{r['tp']:>3} {r['tokens']:>6} {r['mb']:>8.1f} {r['floor_us']:>9.1f} {r['router_us']:>10.1f} "
              f"{r['pair_us']:>12.1f} {r['router_us'] + r['pair_us']:>12.1f} {r['expert_us']:>15.1f} "
              f"{100 * r['floor_us'] / best:>7.0f}% {r['humming_us']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
