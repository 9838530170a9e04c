"""``attn_in_proj_gemm``: the packed attention input projection for 2..64 tokens (rule
``attn_in_proj.large``; one token goes to the GEMV), split into its
4 outputs (``k3f::kda_in_proj``, ``k3f::mla_in_proj``); one tensor-core (mma.sync) kernel,
split-K across a thread-block cluster (``codegen/kernels/gemm.py``; its tiling and call in
``gemm_specs``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from codegen.spec import KernelSpec
from codegen.launchers.gemm_specs import GEMM_ROWS_PER_CTA, GEMM_TILE_K, gemm_tiling
from codegen.launchers.in_proj_gemv import in_proj_launch, in_proj_operands, in_proj_runtime
from codegen.template import Template

GEMM_MIN_TOKENS, GEMM_MAX_TOKENS = 2, 64  # patterns.attention_projection.SMALL_MAX + 1 .. 64; tried before the GEMV


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
