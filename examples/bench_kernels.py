"""Time the CuTe DSL kernels on the GPU (needs CUDA and the cutedsl extra).

Each kernel is captured in a CUDA graph and replayed; the GEMV runs once per weight copy,
with enough copies (>= 200 MB) that no copy is still in the 50-60 MB L2 when it is read
again, so every launch streams its weight from HBM. Prints the median per launch next to
torch's own ``linear`` (cuBLAS) on the same data.

    python examples/bench_kernels.py        # or --only o_proj latent_tail (also: in_proj,
                                            # attn_res, kda_core, mla_attend)
    python examples/bench_kernels.py --only mla_attend --tp 16   # one TP shape of the per-TP parts

The output projection and latent tail sections time the GEMV and the GEMM at the same batches
(each forced outside its range for the sweep only), to place the batch where the templates
hand over from the GEMVs to the GEMM.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import patterns.attn_res
import patterns.input_projection
import patterns.kda
import patterns.mla
import patterns.moe
import patterns.output_projection  # noqa: F401  (defines the k3f ops used here)
from codegen.bind import device_arch, load_kernels
from rewriter.commands.bench import timed_replay_us

D = 7168
SPLITS = {"kda_tp16": [2304, 768, 128, 6, 10], "kda_tp8": [4608, 1536, 128, 12, 4]}


def graph_us(fn, reps: int = 20) -> float:
    """Median microseconds of one replay of a CUDA graph holding ``fn``'s launches."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = sorted(timed_replay_us(g.replay) for _ in range(reps))
    return times[len(times) // 2]


def kernel(op, args, name=None):
    """The template serving the call (or the one named ``name``), its specs and loaded kernels."""
    r = load_kernels(op, device_arch(), args, name)
    assert not isinstance(r, str), r
    return r


def bench_in_proj(name: str, split: list[int], t: int, ws: list[torch.Tensor]) -> None:
    """The input projection on the kernels the call picks (generated from its reference: the
    GEMV's main loop at one token, the GEMM's from two), beside torch's ``linear``."""
    x = torch.randn(t, D, device="cuda").bfloat16()
    tpl, specs, fns = kernel("k3f::kda_in_proj", (x, ws[0], split))
    us = graph_us(lambda: [tpl.launch(fns, specs, (x, w, split)) for w in ws]) / len(ws)
    ref = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / len(ws)
    used = sum(split[:4])
    print(f"in_proj {specs[0].kernel} {name} T={t}: {us:6.2f} us  {used * D * 2 / us / 1e3:5.0f} GB/s"
          f"   (torch linear {ref:6.2f} us)")


def bench_attn_res() -> None:
    """The AttnRes norm at each split of a token's row (CTAs a token x 128-bit vectors a
    thread, forced for the sweep only), 10 chained launches a graph; the served split starred."""
    from codegen.launchers import attn_res_norm

    served = attn_res_norm.CLUSTER_BY_TOKENS
    tokens = (1, 8, 16, 32, 64)
    stars = {t: attn_res_norm.split_for(t, D) for t in tokens}
    splits = [(c, v) for c in (8, 4, 2, 1) for v in (1, 2)]
    print("attn_res_norm, us a launch by split (CTAs a token x vectors a thread; * served)")
    print("| tokens | sources | " + " | ".join(f"{c}x{v}" for c, v in splits) + " |\n|---|---|" + "---|" * len(splits))
    try:
        for t in tokens:
            for n in (1, 8):
                args = [torch.randn(*shape, device="cuda").bfloat16() for shape in ((t, D), (t, D), (t, 8, D), (D,))]
                args += [args[3] * 0.02, args[3].clone(), n, -1, 1e-5]
                out = (torch.empty_like(args[0]), torch.empty_like(args[0]))
                cells = []
                for c, v in splits:
                    attn_res_norm.CLUSTER_BY_TOKENS = ((t, c, v),)
                    tpl, specs, fns = kernel("k3f::attn_res_norm", args)
                    us = graph_us(lambda: [tpl.launch(fns, specs, args, out=out) for _ in range(10)]) / 10
                    cells.append(f"{us:.2f}{'*' if (c, v) == stars[t] else ''}")
                print(f"| {t} | {n + 1} | " + " | ".join(cells) + " |")
    finally:
        attn_res_norm.CLUSTER_BY_TOKENS = served


def sweep(title: str, module, knob: str, op: str, make_args, call, nbytes: int, copies_of) -> None:
    """Time a template's projection stage with its GEMV at every batch, then its GEMM at every
    batch (``module.knob``, the first GEMM batch, forced for the sweep only)."""
    saved = getattr(module, knob)
    print(f"{title} ({nbytes / 1e6:.1f} MB, floor {nbytes / 4.27e6:.1f} us)")
    print("| tokens | GEMV | GEMM |\n|---|---|---|")
    ws = copies_of()
    for t in (1, 2, 3, 4, 6, 8, 16, 64):
        row = []
        for first_gemm in (65, 1):
            setattr(module, knob, first_gemm)
            args = make_args(t, ws[0])
            tpl, specs, fns = kernel(op, args)
            us = graph_us(lambda: [call(fns[0], specs[0], args, w) for w in ws]) / len(ws)
            row.append(f"{us:.1f} us ({specs[0].kernel})")
        print(f"| {t} | {row[0]} | {row[1]} |")
    setattr(module, knob, saved)


def rotated(rows: int, k: int) -> list[torch.Tensor]:
    """Copies of a random [rows, k] weight, enough (>= 200 MB) that none is in the L2 when read."""
    copies = max(2, int(200e6 // (rows * k * 2)) + 1)
    return [(torch.randn(rows, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]


def bench_o_proj(tp: int) -> None:
    """The output projection's first stage (``k3f::o_proj_attn_res``) at one rank's K: GEMV and GEMM."""
    from codegen.launchers import o_proj

    k = {16: 768, 8: 1536}[tp]  # 6 / 12 heads x 128 per rank (KDA and MLA alike)
    norm_ws = [torch.randn(D, device="cuda").bfloat16()] * 3

    def make_args(t, w):
        return (torch.randn(t, k, device="cuda").bfloat16(), w, None,
                torch.randn(t, 8, D, device="cuda").bfloat16(), *norm_ws, "tp", 1, 1, 1e-6)

    def call(fn, spec, args, w):
        o_proj.project(fn, spec, args[0], w, torch.empty(args[0].shape[0], D, device="cuda", dtype=torch.bfloat16))

    sweep(f"o_proj TP {tp} (K = {k})", o_proj, "O_PROJ_GEMM_MIN_TOKENS", "k3f::o_proj_attn_res", make_args, call,
          D * k * 2, lambda: rotated(D, k))


def bench_latent_tail() -> None:
    """The latent tail (``k3f::latent_tail``: norm, up projection, shared add) at TP 1, all rows: GEMV and GEMM."""
    from codegen.launchers import latent_tail

    lat = 3584

    def make_args(t, w):
        return (torch.randn(t, lat, device="cuda").bfloat16(), torch.randn(t, D, device="cuda").bfloat16(),
                torch.randn(lat, device="cuda").bfloat16(), w, lat, D, "tp", 1, 1e-5, 0, 1)

    def call(fn, spec, args, w):
        latent_tail.TEMPLATE.launch((fn,), (spec,), (*args[:3], w, *args[4:]))

    sweep(f"latent_tail (K = {lat})", latent_tail, "LATENT_GEMM_MIN_TOKENS", "k3f::latent_tail", make_args, call,
          D * lat * 2, lambda: rotated(D, lat))


def kda_core_args(tp: int, requests: int, gen: torch.Generator, device: str = "cuda") -> list:
    """``k3f::kda_core``'s arguments for one rank of Kimi K3 at ``requests`` one-token requests:
    random activations and weights at realistic magnitudes, distinct slots, the states in
    vLLM's pages (SD)."""
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers.state import kda_state_pages

    cfg = KimiK3Config.preset("kimi-k3")
    h, d = cfg.shard(tp).kda_heads, cfg.kda_head_dim
    p, slots = h * d, requests + 4

    def rnd(*shape, scale=1.0, shift=0.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(device)

    conv, state = kda_state_pages(rnd(slots, 3 * p, 3), rnd(slots, h, d, d, scale=0.1, dtype=torch.float32), "SD")
    idx = (torch.randperm(slots - 1, generator=gen)[:requests] + 1).to(torch.int32).to(device)
    return [rnd(requests, 3 * p), rnd(requests, p), rnd(requests, d), rnd(requests, h), rnd(p, d, scale=0.05),
            rnd(3 * p, 1, 4, scale=0.3, dtype=torch.float32), rnd(h, scale=0.2, dtype=torch.float32),
            rnd(p, scale=0.5, shift=-3.0, dtype=torch.float32), rnd(d, scale=0.1, shift=1.0), conv, state, idx,
            h, d, cfg.gate_lower_bound, cfg.rms_norm_eps]


def bench_kda_core(tp: int) -> None:
    """The KDA core alone, per launch: a one-element torch kernel between launches so that no
    launch overlaps the next (PDL) (that kernel alone is timed too), and back to back; the
    states rotated past the L2 over up to 64 copies."""
    gen = torch.Generator().manual_seed(tp)
    print(f"kda_core TP {tp}\n| requests | form | launch + torch kernel | torch kernel alone | back to back |\n"
          "|---|---|---|---|---|")
    for requests in (1, 8, 64):
        first = kda_core_args(tp, requests, gen)
        copies = min(64, max(3, int(200e6 // (first[10].numel() * 4)) + 1))
        cases = [first] + [kda_core_args(tp, requests, gen) for _ in range(copies - 1)]
        tpl, specs, fns = kernel("k3f::kda_core", first)
        outs = [torch.empty_like(a[1]) for a in cases]
        bump = torch.zeros(1, device="cuda")

        def run(serial: bool) -> None:
            for a, o in zip(cases, outs):
                tpl.launch(fns, specs, a, out=o)
                if serial:
                    bump.add_(1)

        serial, alone = graph_us(lambda: run(True)) / copies, graph_us(lambda: [bump.add_(1) for _ in cases]) / copies
        back = graph_us(lambda: run(False)) / copies
        form = "persistent" if specs[0].param_dict.get("persistent") else "a CTA per (request, head)"
        print(f"| {requests} | {form} | {serial:.2f} us | {alone:.2f} | {back:.2f} |")


@contextmanager
def forced_grid_cap(cap: int) -> Iterator[None]:
    """``mla_attend``'s grid capped at ``cap`` CTAs (as on a GPU of ``cap`` SMs), for the sweep only."""
    from codegen.launchers import mla_attend

    chosen = mla_attend.grid_cap
    mla_attend.grid_cap = lambda t: cap
    try:
        yield
    finally:
        mla_attend.grid_cap = chosen


def mla_attend_args(heads: int, requests: int, context: int, gen: torch.Generator, block_size: int = 64,
                    device: str = "cuda") -> tuple:
    """One rank's ``k3f::mla_attend`` call: ``requests`` requests of ``context`` cached entries (the
    step's own included) in a bf16 paged cache whose blocks are handed out shuffled."""
    per = -(-context // block_size)
    order = torch.randperm(requests * per, generator=gen).int() + 1  # block 0: vLLM's null block
    tensors = ((torch.randn(requests, heads, 576, generator=gen) * 0.5).bfloat16(),
               torch.randn(requests * per + 1, block_size, 576, generator=gen).bfloat16(),
               order.view(requests, per).contiguous(), torch.full((requests,), context, dtype=torch.int32),
               torch.ones(1), (torch.randn(heads * 256, 512, generator=gen) * 512 ** -0.5).bfloat16(),
               torch.randn(requests, heads * 128, generator=gen).bfloat16())
    return (*(t.to(device) for t in tensors), 192 ** -0.5, heads, 128, 128, 512)


def bench_mla_attend(tp: int) -> None:
    """The MLA decode core (``mla_attend``: cache, W_UV, gate) alone at Kimi K3's heads a rank, at
    grids capped below the chosen 128 CTAs (fewer context splits): where its time goes between
    the cache's bytes, the splits' combine and the two grid barriers. Per launch: with a one-element
    torch kernel between launches (no overlap), and back to back (PDL: the next launch's cache loads
    overlap this one's tail); the caches rotated past the L2."""
    from rewriter.commands.bench import measured_copy_tbps

    heads, tbps = 96 // tp, measured_copy_tbps()
    gen = torch.Generator().manual_seed(tp)
    print(f"mla_attend TP {tp} ({heads} heads, bf16 cache of 64-entry pages; floor at {tbps:.2f} TB/s)\n"
          "| requests | context | CTAs | cache MB (floor us) | launch + torch kernel | torch kernel alone | "
          "back to back |\n|---|---|---|---|---|---|---|")
    for requests in (1, 8, 64):
        for context in (512, 4096):
            first = mla_attend_args(heads, requests, context, gen)
            nbytes = first[1].numel() * 2
            copies = min(512, max(2, int(200e6 // nbytes) + 1))
            cases = [first] + [mla_attend_args(heads, requests, context, gen) for _ in range(copies - 1)]
            outs = [torch.empty_like(a[6]) for a in cases]
            bump = torch.zeros(1, device="cuda")
            for cap in (128, 64, 32, 16):
                if requests > cap:
                    continue
                with forced_grid_cap(cap):
                    tpl, specs, fns = kernel("k3f::mla_attend", first)

                def run(serial: bool) -> None:
                    for a, o in zip(cases, outs):
                        tpl.launch(fns, specs, a, out=o)
                        if serial:
                            bump.add_(1)

                serial = graph_us(lambda: run(True)) / copies
                alone = graph_us(lambda: [bump.add_(1) for _ in cases]) / copies
                back = graph_us(lambda: run(False)) / copies
                print(f"| {requests} | {context} | {cap} | {nbytes / 1e6:.1f} ({nbytes / tbps / 1e6:.1f}) | "
                      f"{serial:.2f} us | {alone:.2f} | {back:.2f} |")
            cases.clear()  # free this context's copies before the next one's are made
            outs.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ("in_proj", "attn_res", "o_proj", "latent_tail", "kda_core", "mla_attend")
    parser.add_argument("--only", nargs="+", choices=parts, default=list(parts))
    parser.add_argument("--tp", type=int, nargs="+", choices=(16, 8), default=[16, 8],
                        help="TP shapes of the per-TP parts (default 16 8)")
    args = parser.parse_args()
    only, tps = args.only, args.tp
    print(f"{torch.cuda.get_device_name()}, {device_arch()}")
    if "in_proj" in only:
        for name, split in SPLITS.items():
            copies = max(2, int(200e6 // (sum(split) * D * 2)) + 1)
            ws = [(torch.randn(sum(split), D, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
            for t in (1, 2, 4, 8, 16, 64):
                bench_in_proj(name, split, t, ws)
    if "attn_res" in only:
        bench_attn_res()
    if "o_proj" in only:
        for tp in tps:
            bench_o_proj(tp)
    if "latent_tail" in only:
        bench_latent_tail()
    if "kda_core" in only:
        for tp in tps:
            bench_kda_core(tp)
    if "mla_attend" in only:
        for tp in tps:
            bench_mla_attend(tp)


if __name__ == "__main__":
    main()
