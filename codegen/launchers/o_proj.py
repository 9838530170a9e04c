"""``o_proj_all_reduce_attn_res``: the attention output projection, its all-reduce and the
AttnRes + ``post_attention_layernorm`` after it (``k3f::o_proj_attn_res``), two stages: the
projection ``attn = o @ W^T`` (bf16; the skinny GEMV below ``O_PROJ_GEMM_MIN_TOKENS``, the
tensor-core skinny GEMM from there, where the GEMV's CUDA-core dot products stop hiding
behind its loads), then (after ``k3::all_reduce`` at TP > 1, as the reference) the
``attn_res_norm`` kernel, with ``attn`` as the new block's prefix when no prefix is given,
else as the delta added to the prefix."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.launchers import attn_res_norm
from codegen.launchers.gemm_specs import GEMM_MAX_TOKENS, gemm_call, gemm_spec
from codegen.launchers.gemv_specs import GEMV_MAX_TOKENS, gemv_spec
from codegen.spec import KernelSpec
from codegen.template import Template, aligned, check_tensors

O_PROJ_GEMM_MIN_TOKENS = 2  # measured on the H200: the GEMM wins from 2 tokens at TP 8 (BENCHMARKS.md, o_proj)


def _attn_res_args(args: Sequence[Any], attn) -> tuple:
    """``k3f::attn_res_norm``'s arguments for the second stage (no block write), as the reference maps them."""
    _, _, prefix, blocks, norm_weight, qk_weight, out_norm_weight, _, _, num_blocks, eps = args
    head = (attn, None) if prefix is None else (prefix, attn)
    return (*head, blocks, norm_weight, qk_weight, out_norm_weight, num_blocks, -1, eps)


def _o_proj_spec(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    o, weight = args[:2]
    if o.dim() != 2 or weight.dim() != 2:
        return f"o and weight must be 2-D, got {tuple(o.shape)} and {tuple(weight.shape)}"
    reason = check_tensors({"o": o, "weight": weight}, torch.bfloat16)
    if reason:
        return reason
    t, k = o.shape
    hidden = weight.shape[0]
    if weight.shape[1] != k:
        return f"weight {tuple(weight.shape)} does not match o {tuple(o.shape)}"
    proj = _projection_spec(op, arch, t, k, hidden)
    if isinstance(proj, str):
        return proj
    attn = torch.empty((t, hidden), dtype=torch.bfloat16, device="meta")
    res = attn_res_norm.TEMPLATE.make_specs(op, arch, _attn_res_args(args, attn))
    if isinstance(res, str):
        return f"attn_res_norm stage: {res}"
    return (proj, *res)


def _projection_spec(op: str, arch: str, t: int, k: int, hidden: int) -> KernelSpec | str:
    """The GEMM from ``O_PROJ_GEMM_MIN_TOKENS`` tokens (where K allows its pipeline), else the GEMV;
    below that too where the GEMV cannot take K (TP 32: 384, not whole 256-wide warp steps)."""
    def gemm():
        return gemm_spec("o_proj_gemm", op, arch, tokens=t, k=k, rows=hidden, rows_out=hidden)

    if O_PROJ_GEMM_MIN_TOKENS <= t <= GEMM_MAX_TOKENS:
        spec = gemm()
        if not isinstance(spec, str):
            return spec
    spec = gemv_spec(op, arch, tokens=t, k=k, rows=hidden, x_stride=k)
    if isinstance(spec, str) and t < O_PROJ_GEMM_MIN_TOKENS:
        fallback = gemm()
        return spec if isinstance(fallback, str) else fallback
    return spec


def project(fn, spec: KernelSpec, o: torch.Tensor, weight: torch.Tensor, attn: torch.Tensor) -> None:
    """Launch the projection stage (GEMM or GEMV, as ``spec`` says) into ``attn`` [T, hidden]."""
    if spec.kernel == "o_proj_gemm":
        gemm_call(fn, o, weight, attn)
    else:
        fn(o, weight, None, None, attn)


def _o_proj_runtime(args: Sequence[Any]) -> str | None:
    o, weight = args[:2]
    return aligned({"o": o, "weight": weight}) or attn_res_norm.TEMPLATE.runtime_check(_attn_res_args(args, None))


def _o_proj_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """``out``: the (MLP input, new prefix) outputs of the second stage."""
    proj_fn, res_fn = fns
    o, weight = args[:2]
    group, tp = args[7:9]
    attn = o.new_empty((o.shape[0], weight.shape[0]))
    project(proj_fn, specs[0], o, weight, attn)
    if host().collective_runs(tp):
        attn = host().all_reduce(attn, group, tp)
    return attn_res_norm.TEMPLATE.launch((res_fn,), specs[1:], _attn_res_args(args, attn), out=out)


TEMPLATE = Template("o_proj_all_reduce_attn_res", ("k3f::o_proj_attn_res",), _o_proj_spec, _o_proj_runtime,
                    _o_proj_launch,
                    doc=f"o_proj skinny GEMV (1..{O_PROJ_GEMM_MIN_TOKENS - 1} tokens) or tensor-core GEMM "
                        f"({O_PROJ_GEMM_MIN_TOKENS}..{GEMV_MAX_TOKENS}), all-reduce (TP > 1), then the "
                        "attn_res_norm kernel; two stages")
