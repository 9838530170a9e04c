"""Spec helpers of every template built on the skinny tensor-core ``gemm`` kernel
(``codegen/kernels/gemm.py``: o_proj_gemm, latent_tail_gemm, the shared experts' and the dense
MLP's; the generated ``product_gemm`` takes its tiling too): its tiling,
its spec and how it is called."""
from __future__ import annotations

from typing import Any

from codegen.spec import KernelSpec
from codegen.targets import MAX_TOKENS

GEMM_ROWS_PER_CTA = 128
GEMM_TILE_K = 64  # codegen/kernels/gemm.py: K per pipeline stage
GEMM_PARTIAL_PAD = 4  # codegen/kernels/gemm.py: fp32 partial tile's column stride is rows + this
GEMM_SMEM_BUDGET = 110 * 1024  # per CTA: two CTAs fit an SM's 228 KB (sm_90a, sm_100a)
GEMM_SMEM_ONE_CTA = 227 * 1024  # the most one CTA may take (sm_90a, sm_100a)
WHOLE_K_MAX_SHARE = 0.55  # grids of at most this share of the SMs hold their whole K in the ring
ONE_WAVE_MAX_SHARE = 0.9  # grids of at most this share (clusters of at most 2) run one CTA an SM: a deeper ring
ONE_WAVE_STAGES = 12  # that ring's depth (the dense down stage's sweep, docs/CODEGEN.md)
SM_COUNT = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}
GEMM_MAX_TOKENS = MAX_TOKENS  # codegen/kernels/gemm.py: the token tile's largest size covers every step


def stage_bytes(rows_per_cta: int, token_tile: int) -> int:
    """Shared memory of one pipeline stage: a K tile of the CTA's weight rows and of x."""
    return (rows_per_cta + token_tile) * GEMM_TILE_K * 2


def norm_bytes(k: int, split: int, token_tile: int) -> int:
    """Shared memory the RMSNorm prologue takes beside the ring: the CTA's K slice of the norm
    weight (bf16) and the tokens' sums of squares (fp32); both whole 16-byte multiples already
    (the slice is whole 64-value K tiles, the token tile a multiple of 16)."""
    return k // split * 2 + token_tile * 4


def two_cta_stages(rows_per_cta: int, token_tile: int, k: int, split: int) -> int:
    """The ring that fits two CTAs an SM: at most 6 stages, and no more than the CTA's K tiles."""
    return max(2, min(6, GEMM_SMEM_BUDGET // stage_bytes(rows_per_cta, token_tile), k // GEMM_TILE_K // split))


def k_split(k_tiles: int, tiles: int, per_tile: int, limit: int) -> int:
    """The largest K split (a cluster of 8, 4 or 2 CTAs) of at least two K tiles a CTA, whose
    partial sums a tile's rows share out evenly, that keeps ``tiles`` x split CTAs within ``limit``."""
    return next(c for c in (8, 4, 2, 1) if k_tiles % c == 0 and k_tiles // c >= 2 and per_tile % (4 * c) == 0
                and (tiles * c <= limit or c == 1))


def gemm_tiling(tokens: int, k: int, rows_out: int, arch: str, *, glu: bool = False, products: int = 1,
                norm: bool = False, tile_multiple: int = 1) -> dict[str, Any]:
    """The skinny GEMM's tiling (``codegen/kernels/gemm.py``): tokens padded to a multiple of 16;
    128 weight rows per CTA (x then costs at most half the weight bytes in L2 traffic), 64
    where that alone fills more SMs, 32 where even 64 leaves half the SMs idle and the token
    tile is a multiple of 32 (the router and the latent tail at TP 16: x then costs twice the
    weight bytes, but each SM streams at a few tens of GB/s, so SMs, not bytes, bound them);
    the largest K split (cluster of 8, 4, 2 CTAs) that keeps the grid within 1.6 CTAs per SM,
    so every SM streams weights and the clusters stay resident in one wave (two CTAs per SM by
    shared memory, less where a GPC's SM count is not a multiple of the cluster); as many
    pipeline stages (at most 6) as fit two CTAs per SM, except on grids of at most
    ``WHOLE_K_MAX_SHARE`` of the SMs (the router: 40 to 72 CTAs), whose ring holds every K tile
    of a CTA as far as one CTA's shared memory goes: all its weight tiles are in flight before
    ``griddepcontrol.wait`` and all its x tiles right after it, one round trip instead of three
    (on the H200 the router ends 2.5 to 6 us sooner in a layer's graph replay;
    docs/FEWER_STEPS.md); grids of at most ``ONE_WAVE_MAX_SHARE`` of the SMs in clusters of at
    most 2 (the dense down stage's 112 CTAs) get one SM each anyway, so their ring is sized for
    one CTA an SM (up to ``ONE_WAVE_STAGES``): twice the bytes in flight of the two-CTA ring
    (layer 0 at TP 16, 8 tokens: 4.3 us faster in an A/B, docs/CODEGEN.md); two token groups
    of 4 warps (2 on 32-row tiles) where the token tile is a multiple of 32 and the grid is one
    CTA an SM at most, so each warp's MMA chain is half as long (the input projection's 208
    CTAs keep one group: with 8 warps its registers hold one CTA an SM, and it ran 1 us
    slower). ``glu``: a CTA's rows are half gate, half up rows, so it writes half as many outputs;
    ``products``: likewise, a generated stage's rows are shared by that many products. ``norm``: the RMSNorm
    prologue's shared memory (``norm_bytes``) comes out of the one-CTA ring's (the dense down stage
    at TP 3 asked for 64 bytes more than a CTA may have, and failed at its launch).
    ``tile_multiple``: a tile's output rows a multiple of it (MXFP4's 64-row tiles).
    """
    token_tile = -(-tokens // 16) * 16
    groups = 2 if token_tile % 32 == 0 else 1
    k_tiles = k // GEMM_TILE_K
    sms = SM_COUNT.get(arch, 132)
    limit = int(1.6 * sms)
    best = None
    for rows_per_cta in (GEMM_ROWS_PER_CTA, GEMM_ROWS_PER_CTA // 2, GEMM_ROWS_PER_CTA // 4):
        per_tile = rows_per_cta // (2 if glu else products)
        if rows_out < per_tile or per_tile % tile_multiple:
            continue
        if rows_per_cta == GEMM_ROWS_PER_CTA // 4 and (glu or products > 1 or groups == 1 or best is None
                                                       or best[0] >= sms // 2):
            continue
        tiles = -(-rows_out // per_tile)
        split = k_split(k_tiles, tiles, per_tile, limit)
        if best is None or (best[0] < sms and tiles * split > best[0]):
            best = (tiles * split, rows_per_cta, split)
    ctas, rows_per_cta, split = best
    if rows_per_cta > GEMM_ROWS_PER_CTA // 4 and ctas > sms:
        groups = 1  # 8 warps of ~160 registers hold one CTA an SM: a second wave (the input projection)
    ring_budget = GEMM_SMEM_ONE_CTA - (norm_bytes(k, split, token_tile) if norm else 0)
    one_cta = ring_budget // stage_bytes(rows_per_cta, token_tile)
    if ctas <= WHOLE_K_MAX_SHARE * sms:
        stages = max(2, min(k_tiles // split, one_cta))
    elif ctas <= ONE_WAVE_MAX_SHARE * sms and split <= 2:
        stages = max(2, min(ONE_WAVE_STAGES, k_tiles // split, one_cta))
    else:
        stages = two_cta_stages(rows_per_cta, token_tile, k, split)
    return {"rows_per_cta": rows_per_cta, "split_k": split, "stages": stages, "token_groups": groups,
            "token_tile": token_tile}


def gemm_spec(kernel: str, op: str, arch: str, *, tokens: int, k: int, rows: int, rows_out: int,
              k_name: str = "K", glu: bool = False, **params: Any) -> KernelSpec | str:
    """The skinny GEMM's spec for ``tokens`` x [``rows``, ``k``] writing ``rows_out`` rows (gated:
    rows / 2 channels), its tiling chosen here; or why K or the rows do not fit
    (``k_name``: what K is, for the reason). ``params``: the kernel's options (norm, residual,
    activation, strides)."""
    if k % GEMM_TILE_K or k < 2 * GEMM_TILE_K:
        return f"{k_name} {k} is not a multiple of {GEMM_TILE_K} of at least two tiles (the GEMM's K tile)"
    smallest = GEMM_ROWS_PER_CTA // 2 if glu else GEMM_ROWS_PER_CTA
    if rows_out < smallest:
        return f"{rows_out} output rows < {smallest} (one CTA tile)"
    tiling = gemm_tiling(tokens, k, rows_out, arch, glu=glu, norm=params.get("norm_eps") is not None)
    if glu:
        params["glu"] = True
    return KernelSpec.make(kernel, op, arch, shapes={"token_tile": tiling.pop("token_tile"), "k": k, "rows": rows},
                           dtypes={"act": "bf16", "weight": "bf16"},
                           params={"rows_out": rows_out, **params, **tiling}, module="gemm")


def gemm_call(fn, x, weight, y, norm_weight=None, residual=None) -> None:
    """Launch a compiled skinny GEMM: its output, then its optional norm weight and residual."""
    fn(x, weight, y, norm_weight, residual)
