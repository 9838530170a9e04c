"""Spec helpers of every template built on the skinny ``gemv`` kernel (``codegen/kernels/gemv.py``:
latent_tail, o_proj; the generated ``product_gemv`` takes its tiling too): the token chunking,
the tiling and the spec itself."""
from __future__ import annotations

from typing import Any

from codegen.spec import KernelSpec

GEMV_MAX_TOKENS = 64
GEMV_MAX_CHUNK = 8  # tokens whose fp32 accumulators a lane holds at once
GEMV_MAX_SLICE = 16  # codegen/kernels/gemv.py: weight vectors per lane and row held in registers
GEMV_TARGET_WARPS = 1024  # about 8 streaming warps per SM of an H200


def token_chunk(tokens: int) -> int:
    """Tokens per chunk: ceil(T / 8) chunks of equal size (13 tokens: 2 x 7, one padded slot)."""
    chunks = -(-tokens // GEMV_MAX_CHUNK)
    return -(-tokens // chunks)


def skinny_gemv_tiling(chunk: int, k: int, rows: int, norm: bool = False) -> dict[str, int] | str:
    """Rows per warp, warps per CTA and K slices per row group, or why K does not fit.

    A warp holds its whole K slice of each of its rows in registers (one 128-bit load per
    vector, all issued at once), so a slice is at most 8 vectors per lane where K allows
    (K = 7168: 4 slices; 3584: 2; 768 / 1536: 1). 2 rows per warp from 4 tokens on (each x
    load and conversion serves both) while at least ``2 x GEMV_TARGET_WARPS`` warps remain;
    more K slices while fewer than ``GEMV_TARGET_WARPS`` warps would stream (few rows; the
    router's 280 rows at TP 16 make 1120 warps with 4 slices). 4 warps per CTA, 8 with the
    norm prologue (its CTA-wide pass over the whole x row then serves twice the rows)."""
    vec = k // 256
    divisors = [d for d in range(1, 9) if vec % d == 0]
    ks = next((d for d in divisors if vec // d <= 8), divisors[-1])
    rows_per_warp = 2 if chunk >= 4 and rows * ks // 2 >= 2 * GEMV_TARGET_WARPS else 1
    for d in divisors:
        if d > ks and rows * ks // rows_per_warp < GEMV_TARGET_WARPS:
            ks = d
    if vec // ks > GEMV_MAX_SLICE:
        return f"K {k} leaves {vec // ks} vectors per lane and row (at most {GEMV_MAX_SLICE} in registers)"
    warps = 8 if norm else 4
    return {"rows_per_warp": rows_per_warp, "warps_per_cta": ks * max(1, warps // ks), "ksplit": ks}


def gemv_spec(op: str, arch: str, *, tokens: int, k: int, rows: int, x_stride: int, norm: bool = False,
              eps: float = 0.0, residual: bool = False, r_stride: int = 0) -> KernelSpec | str:
    """The ``gemv`` kernel's spec, or the reason it cannot take this call."""
    if not 1 <= tokens <= GEMV_MAX_TOKENS:
        return f"{tokens} tokens outside 1..{GEMV_MAX_TOKENS} (the skinny GEMV template)"
    if k % 256:
        return f"K {k} is not a multiple of 256 (one 128-bit vector per lane)"
    if x_stride % 8:
        return f"x row stride {x_stride} is not a multiple of 8 (128-bit vectors)"
    chunk = token_chunk(tokens)
    tiling = skinny_gemv_tiling(chunk, k, rows, norm)
    if isinstance(tiling, str):
        return tiling
    params: dict[str, Any] = {"norm": norm, "residual": residual, "x_stride": x_stride, "chunk": chunk, **tiling}
    if norm:
        params["eps"] = float(eps)
    if residual:
        params["r_stride"] = r_stride
    return KernelSpec.make("gemv", op, arch, shapes={"tokens": tokens, "k": k, "rows": rows},
                           dtypes={"act": "bf16", "weight": "bf16", "out": "bf16"}, params=params)
