"""``attn_in_proj_gemm``: the packed attention input projection for 2..64 tokens (rule
``attn_in_proj.large``; one token goes to the GEMV), split into its
4 outputs (``k3f::kda_in_proj``, ``k3f::mla_in_proj``); one tensor-core (mma.sync) kernel,
split-K across a thread-block cluster (``codegen/kernels/gemm.py``; its tiling and call in
``gemm_specs``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from codegen.spec import KernelSpec
from codegen.launchers.gemm_specs import GEMM_MAX_TOKENS, gemm_spec
from codegen.launchers.in_proj_gemv import in_proj_launch, in_proj_operands, in_proj_runtime
from codegen.template import Template

GEMM_MIN_TOKENS = 2  # patterns.attention_projection.SMALL_MAX + 1; tried before the GEMV


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


TEMPLATE = Template("attn_in_proj_gemm", ("k3f::kda_in_proj", "k3f::mla_in_proj"), _gemm_spec, in_proj_runtime,
                    in_proj_launch,
                    doc="packed input projection for 2..64 tokens, split into its 4 outputs; mma.sync GEMM, "
                        "cp.async pipeline, split-K over a cluster")
