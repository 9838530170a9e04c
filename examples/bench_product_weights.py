"""Time one projection of a user's rule, ``x @ W.T``, on generated kernels with MXFP4 weights
(``k3.mxfp4_dequant(codes, scales, "humming")``, Humming's layout) and with bf16 weights of
the same shape, against each one's floor (its weight bytes at the copy bandwidth measured at
start). Needs CUDA and the cutedsl extra.

Each side is captured in one CUDA graph over ``COPIES`` weight copies (out of the L2 when they
come round again); a row gives the median call of 20 replays and the relative error of the
kernels' result against the op's reference on the CPU (a bench that times a wrong kernel says so).

    python examples/bench_product_weights.py                    # N 4096, K 7168, 1 / 8 / 64 tokens
    python examples/bench_product_weights.py --n 2048 --k 3584 --tokens 1 16
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from codegen.bind import device_arch, load_kernels
from rewriter.commands import bench as bench_cmd
from rewriter.compiler.plan import install_kernels
from rewriter.compiler.rules import fused_op
from rewriter.model.layers.experts import ExpertFormat, random_mxfp4

COPIES = 8
REPLAYS = 20


@fused_op("bench_mxfp4_projection")
def _mxfp4_projection(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, torch.ops.k3.mxfp4_dequant(codes, scales, "humming"))


@fused_op("bench_bf16_projection")
def _bf16_projection(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def weights(kind: str, n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    if kind == "mxfp4":
        codes, scales = ExpertFormat.parse("mxfp4/humming").from_checkpoint(*random_mxfp4(1, n, k, generator=gen))
        return [codes[0].cuda(), scales[0].cuda()]
    return [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()]


def time_side(kind: str, n: int, k: int, tokens: int, arch: str, tbps: float, gen: torch.Generator) -> str:
    sets = [[torch.randn(tokens, k, generator=gen).to(torch.bfloat16).cuda(), *weights(kind, n, k, gen)]
            for _ in range(COPIES)]
    op = f"k3f::bench_{kind}_projection"
    loaded = load_kernels(op, arch, sets[0])
    if isinstance(loaded, str):
        return f"| {tokens} | {kind} | not generated: {loaded} | | | |"
    tpl, specs, fns = loaded
    ref = getattr(torch.ops.k3f, op.split("::")[1])(*[a.cpu() for a in sets[0]]).float()
    got = tpl.launch(fns, specs, sets[0]).float().cpu()
    err = ((got - ref).norm() / ref.norm()).item()
    run = bench_cmd.captured_graph(lambda: [tpl.launch(fns, specs, s) for s in sets]).replay
    bench_cmd.warmed_up(run)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / COPIES)
    us = statistics.median(times)
    floor = sum(t.numel() * t.element_size() for t in sets[0][1:]) / (tbps * 1e6)
    return (f"| {tokens} | {kind} | {us:.1f} | {floor:.1f} | {floor / us:.0%} | {err:.1e} | "
            f"{' + '.join(s.label() for s in specs)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="weight rows (default 4096)")
    parser.add_argument("--k", type=int, default=7168, help="weight columns, the activation's width (default 7168)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64], help="token counts (default 1 8 64)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    arch = device_arch()
    install_kernels(arch)
    tbps, _ = bench_cmd.floor_bandwidth(torch.cuda.get_device_name(), None, bench_cmd.measured_copy_tbps)
    print(f"{torch.cuda.get_device_name()} ({arch}), N {args.n}, K {args.k}, floors at {tbps:.2f} TB/s")
    print("| tokens | weights | us | floor us | % of floor | rel. error | kernels |\n|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        for kind in ("mxfp4", "bf16"):
            print(time_side(kind, args.n, args.k, tokens, arch, tbps, gen), flush=True)


if __name__ == "__main__":
    main()
