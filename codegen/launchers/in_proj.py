"""The packed attention input projection (``k3f::kda_in_proj``, ``k3f::mla_in_proj``), split into
its 4 outputs, as two templates tried in this order:

- ``attn_in_proj_gemm``: 2..64 tokens (rule ``attn_in_proj.large``); one tensor-core (mma.sync)
  kernel, split-K across a thread-block cluster (``codegen/kernels/gemm.py``; its tiling and call
  in ``gemm_specs``);
- ``attn_in_proj_gemv``: 1..8 tokens (the kernel's range; rule ``attn_in_proj.small`` gives it one
  token); one weight-streaming GEMV kernel (``codegen/kernels/in_proj_gemv.py``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.launchers.gemm_specs import GEMM_MAX_TOKENS, gemm_call, gemm_spec
from codegen.spec import KernelSpec
from codegen.template import Template, aligned, check_tensors

GEMV_MAX_TOKENS = 8
GEMM_MIN_TOKENS = 2  # patterns.input_projection.SMALL_MAX + 1; the GEMM is tried before the GEMV


def gemv_tiling(tokens: int, k: int) -> dict[str, Any]:
    """The GEMV's tiling for ``tokens`` rows of x, from a sweep on the H200 (2026-11-29, TP 16
    and TP 8 KDA shapes, CUDA graph replay, weights rotated past L2; docs/CODEGEN.md):
    1..3 tokens: one row per warp, a plain K loop (4 or 2 vectors per lane in flight);
    4 tokens: 4 rows per warp; 5..8: 2 rows per warp; both with the K loop unrolled and the
    next step's weights loaded while the current one is summed (``pipeline``)."""
    vec_per_lane = k // 8 // 32
    if tokens == 1:
        rows, unroll, pipeline = 1, 4, False
    elif tokens <= 3:
        rows, unroll, pipeline = 1, 2, False
    elif tokens == 4:
        rows, unroll, pipeline = 4, 2, True
    else:
        rows, unroll, pipeline = 2, 2, True
    unroll = next(u for u in (unroll, 2, 1) if vec_per_lane % u == 0)
    return {"rows_per_warp": rows, "warps_per_cta": 4, "unroll": unroll, "stream_weights": True,
            "pipeline": pipeline}


def in_proj_operands(args: Sequence[Any], min_tokens: int, max_tokens: int, template_name: str
                     ) -> tuple[int, int, int] | str:
    """(tokens, K, weight rows) of an input-projection call both templates can read; else why not."""
    x, weight, _ = args
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    t, k = x.shape
    if not min_tokens <= t <= max_tokens:
        return f"{t} tokens outside {min_tokens}..{max_tokens} ({template_name})"
    reason = check_tensors({"x": x, "weight": weight}, torch.bfloat16)
    if reason:
        return reason
    if weight.shape[1] != k:
        return f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    return t, k, weight.shape[0]


def _gemv_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    dims = in_proj_operands(args, 1, GEMV_MAX_TOKENS, "the GEMV template; larger batches need the GEMM")
    if isinstance(dims, str):
        return dims
    t, k, n = dims
    split_sizes = args[2]
    if k % 256:
        return f"K {k} is not a multiple of 256 (one 128-bit vector per lane)"
    sizes = [int(s) for s in split_sizes]
    if sum(sizes) != n or len(sizes) < 4:
        return f"split sizes {sizes} must be at least 4 pieces summing to the {n} weight rows"
    return (KernelSpec.make("attn_in_proj_gemv", op, arch, shapes={"tokens": t, "k": k, "rows": n},
                           dtypes={"act": "bf16", "weight": "bf16"},
                           params={"segments": sizes[:4], **gemv_tiling(t, k)}, module="in_proj_gemv"),)


def in_proj_runtime(args: Sequence[Any]) -> str | None:
    """x and the packed weight 16-byte aligned (both input-projection templates)."""
    x, weight, _ = args
    return aligned({"x": x, "weight": weight})


def in_proj_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """One kernel writing the projection's 4 outputs (both input-projection templates)."""
    (fn,), (spec,) = fns, specs
    x, weight, _ = args
    segments = spec.param_dict["segments"]
    ys = list(out) if out is not None else [x.new_empty((x.shape[0], s)) for s in segments]
    if spec.kernel == "attn_in_proj_gemm":
        gemm_call(fn, x, weight, ys)
    else:
        fn(x, weight, *ys, *[None] * (4 - len(ys)))
    return tuple(ys)


def _gemm_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    dims = in_proj_operands(args, GEMM_MIN_TOKENS, GEMM_MAX_TOKENS, "the GEMM template")
    if isinstance(dims, str):
        return dims
    t, k, n = dims
    sizes = [int(s) for s in args[2]]
    if sum(sizes) != n or len(sizes) < 4 or min(sizes[:4]) < 1 or min(sizes) < 0:
        return f"split sizes {sizes} must be 4 positive pieces (then padding) summing to the {n} weight rows"
    spec = gemm_spec("attn_in_proj_gemm", op, arch, tokens=t, k=k, rows=n, segments=sizes[:4])
    return spec if isinstance(spec, str) else (spec,)


TEMPLATES = (
    Template("attn_in_proj_gemm", ("k3f::kda_in_proj", "k3f::mla_in_proj"), _gemm_spec, in_proj_runtime,
             in_proj_launch,
             doc="packed input projection for 2..64 tokens, split into its 4 outputs; mma.sync GEMM, "
                 "cp.async pipeline, split-K over a cluster"),
    Template("attn_in_proj_gemv", ("k3f::kda_in_proj", "k3f::mla_in_proj"), _gemv_spec, in_proj_runtime,
             in_proj_launch,
             doc="packed input projection for 1..8 tokens, split into its 4 outputs; weight-streaming GEMV"),
)
