"""``attn_in_proj_gemm``: the packed attention input projection for 2..64 tokens (rule
``attn_in_proj.large``; one token goes to the GEMV), split into its
4 outputs (``k3f::kda_in_proj``, ``k3f::mla_in_proj``); one tensor-core (mma.sync) kernel,
split-K across a thread-block cluster (``codegen/kernels/gemm.py``, with its tiling
``gemm_tiling``, which the dense MLP's GEMMs share)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from codegen.spec import KernelSpec
from codegen.launchers.in_proj_gemv import in_proj_launch, in_proj_operands, in_proj_runtime
from codegen.template import Template

GEMM_MIN_TOKENS, GEMM_MAX_TOKENS = 2, 64  # patterns.attention_projection.SMALL_MAX + 1 .. 64; tried before the GEMV
GEMM_ROWS_PER_CTA = 128
GEMM_TILE_K = 64  # codegen/kernels/gemm.py: K per pipeline stage
GEMM_SMEM_BUDGET = 110 * 1024  # per CTA: two CTAs fit an SM's 228 KB (sm_90a, sm_100a)
SM_COUNT = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}


def gemm_tiling(tokens: int, k: int, rows_out: int, arch: str, *, glu: bool = False) -> dict[str, Any]:
    """The skinny GEMM's tiling (``codegen/kernels/gemm.py``): tokens padded to a multiple of 16;
    128 weight rows per CTA (x then costs at most half the weight bytes in L2 traffic), 64
    where that alone fills more SMs; the largest K split (cluster of 8, 4, 2 CTAs) that keeps
    the grid within 1.6 CTAs per SM, so every SM streams weights and the clusters stay
    resident in one wave (two CTAs per SM by shared memory, less where a GPC's SM count is
    not a multiple of the cluster); as many pipeline stages (at most 6) as fit two CTAs per
    SM. ``glu``: a CTA's rows are half gate, half up rows, so it writes half as many outputs."""
    token_tile = -(-tokens // 16) * 16
    k_tiles = k // GEMM_TILE_K
    sms = SM_COUNT.get(arch, 132)
    limit = int(1.6 * sms)
    best = None
    for rows_per_cta in (GEMM_ROWS_PER_CTA, GEMM_ROWS_PER_CTA // 2):
        per_tile = rows_per_cta // 2 if glu else rows_per_cta
        if rows_out < per_tile:
            continue
        tiles = -(-rows_out // per_tile)
        split = next(c for c in (8, 4, 2, 1)
                     if k_tiles % c == 0 and k_tiles // c >= 2 and per_tile % (4 * c) == 0
                     and (tiles * c <= limit or c == 1))
        if best is None or (best[0] < sms and tiles * split > best[0]):
            best = (tiles * split, rows_per_cta, split)
    _, rows_per_cta, split = best
    stage_bytes = (rows_per_cta + token_tile) * GEMM_TILE_K * 2
    stages = max(2, min(6, GEMM_SMEM_BUDGET // stage_bytes, k_tiles // split))
    return {"rows_per_cta": rows_per_cta, "split_k": split, "stages": stages, "token_tile": token_tile}


def _gemm_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    dims = in_proj_operands(args, GEMM_MIN_TOKENS, GEMM_MAX_TOKENS, "the GEMM template")
    if isinstance(dims, str):
        return dims
    t, k, n = dims
    split_sizes = args[2]
    if k % GEMM_TILE_K or k < 2 * GEMM_TILE_K:
        return f"K {k} is not a multiple of {GEMM_TILE_K} of at least two tiles (the pipeline's K tile)"
    sizes = [int(s) for s in split_sizes]
    if sum(sizes) != n or len(sizes) < 4 or min(sizes[:4]) < 1 or min(sizes) < 0:
        return f"split sizes {sizes} must be 4 positive pieces (then padding) summing to the {n} weight rows"
    rows_out = sum(sizes[:4])
    if rows_out < GEMM_ROWS_PER_CTA:
        return f"{rows_out} output rows < {GEMM_ROWS_PER_CTA} (one CTA tile)"
    tiling = gemm_tiling(t, k, rows_out, arch)
    return (KernelSpec.make("attn_in_proj_gemm", op, arch,
                            shapes={"token_tile": tiling.pop("token_tile"), "k": k, "rows": n},
                            dtypes={"act": "bf16", "weight": "bf16"},
                            params={"segments": sizes[:4], **tiling}),)


TEMPLATE = Template("attn_in_proj_gemm", ("k3f::kda_in_proj", "k3f::mla_in_proj"), _gemm_spec, in_proj_runtime,
                    in_proj_launch,
                    doc="packed input projection for 2..64 tokens, split into its 4 outputs; mma.sync GEMM, "
                        "cp.async pipeline, split-K over a cluster")
