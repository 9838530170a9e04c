"""How much faster the one-token input projection runs when part of its weight is already in the L2.

vLLM's Blackwell path prefetches the next layer's attention weights into the L2 while the MoE
runs (docs/FEWER_STEPS.md). Tried here (docs/FEWER_STEPS.md), pulling the first 24 MiB of
the input projection's rows, it saved 1.4 of 14.1 us: the GEMV ended with its CTAs whose rows
still came from HBM. The GEMV's warps each stream their rows along K in order
(``codegen/kernels/in_proj_gemv.py``), so a prefetch of the first ``f`` of every row's K warms
every warp alike. This probe bounds what such a prefetch could give: before each launch a torch
reduction reads the first ``f`` of every used row (lines allocated in the L2 as any load's),
then, optionally, ``--between`` MiB of another buffer (what the MoE streams meanwhile), then the
GEMV on that copy. Weight copies rotate (>= 200 MB) so nothing else is warm. The GEMV's time is
the graph with it less the graph without it.

    python examples/probe_l2_warm.py                        # MLA and KDA shapes at TP 16 and 8, f 0..1
    python examples/probe_l2_warm.py --shape mla_tp16 --between 0 16 32
"""
from __future__ import annotations

import argparse

import torch
from bench_kernels import graph_us, kernel  # examples/: CUDA-graph replay timing, a call's loaded kernels

import patterns.input_projection
import patterns.kda
import patterns.mla  # noqa: F401  (defines the k3f ops used here)

D = 7168
SHAPES = {  # the served input projections' output segments (rows), one token
    "mla_tp16": [1536, 512, 64, 768],  # q_c, kv_c, k_pe, gate: layer 3
    "mla_tp8": [1536, 512, 64, 1536],
    "kda_tp16": [2304, 768, 128, 6],  # q|k|v, g, f_a, beta: layer 1
    "kda_tp8": [4608, 1536, 128, 12],
}
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
VEC_ELEMS = 64  # a prefetched run ends on a 128-byte line: whole lines of bf16


def warm_columns(fraction: float, k: int = D) -> int:
    """The K columns of every row the prefetch reads: ``fraction`` of ``k``, in whole 128-byte
    lines (the GEMV's warps consume a row's K from its start)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} outside 0..1")
    return round(fraction * k / VEC_ELEMS) * VEC_ELEMS


def prefetch(w: torch.Tensor, columns: int, sink: torch.Tensor) -> None:
    """Read the first ``columns`` of every row of ``w`` (a torch reduction; its sum lands in
    ``sink`` so the read is not elided)."""
    if columns:
        torch.sum(w[:, :columns], dim=(0, 1), dtype=torch.float32, out=sink)


def probe(shape: str, fractions: tuple[float, ...], between_mb: list[int]) -> None:
    split = SHAPES[shape]
    rows = sum(split)
    copies = max(2, int(200e6 // (rows * D * 2)) + 1)
    ws = [(torch.randn(rows, D, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(1, D, device="cuda").bfloat16()
    tpl, specs, fns = kernel("k3f::mla_in_proj", (x, ws[0], split), "attn_in_proj_gemv")
    outs = [torch.empty(1, s, device="cuda", dtype=torch.bfloat16) for s in split]
    other = torch.randn(max(between_mb + [1]) * (1 << 20) // 2, device="cuda").bfloat16()
    sink = torch.empty((), device="cuda")
    mb = rows * D * 2 / 1e6
    print(f"\n{shape}: {rows} rows x {D} = {mb:.1f} MB a copy, {copies} copies")
    print("| warm fraction | warm MB | MiB read between | GEMV us | GB/s |")
    print("|---|---|---|---|---|")
    for between in between_mb:
        filler = other[: between * (1 << 20) // 2]
        for fraction in fractions:
            columns = warm_columns(fraction)

            def before(w):
                prefetch(w, columns, sink)
                if between:
                    torch.sum(filler, dim=0, dtype=torch.float32, out=sink)

            with_gemv = graph_us(lambda: [(before(w), tpl.launch(fns, specs, (x, w, split), out=outs)) for w in ws])
            without = graph_us(lambda: [before(w) for w in ws])
            us = (with_gemv - without) / copies
            print(f"| {fraction:.2f} | {rows * columns * 2 / 1e6:.1f} | {between} | {us:.2f} | {mb * 1e3 / us:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--fraction", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--between", type=int, nargs="+", default=[0, 24],
                        help="MiB of another buffer read after the prefetch (default 0 24)")
    args = parser.parse_args(argv)
    for f in args.fraction:
        warm_columns(f)  # refuses a fraction outside 0..1 before anything runs
    if min(args.between) < 0:
        parser.error(f"--between {min(args.between)}: MiB are not negative")
    print(torch.cuda.get_device_name())
    for shape in args.shape:
        probe(shape, tuple(args.fraction), args.between)


if __name__ == "__main__":
    main()
