"""``latent_tail``: the MoE tail (``k3f::latent_tail``): at TP > 1 the all-reduce of [routed |
shared] partials as the reference does it, then one kernel over this rank's piece of the rows of
``routed_expert_up_proj`` (1/TP of them, or all where TP does not divide them):
``routed_expert_norm`` as its prologue and the add of the piece's columns of the shared sum as its
epilogue; then the gather of the pieces. The skinny
GEMV at one token, the tensor-core skinny GEMM (``latent_tail_gemm``) from
``LATENT_GEMM_MIN_TOKENS``, where the GEMV's CUDA-core dot products over K = 3584 stop hiding
behind its loads."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.launchers.gemm_specs import GEMM_MAX_TOKENS, gemm_call, gemm_spec
from codegen.launchers.gemv_specs import GEMV_MAX_TOKENS, gemv_spec
from codegen.spec import KernelSpec
from codegen.template import Template, aligned, check_tensors, dtype_name, shape_is

LATENT_GEMM_MIN_TOKENS = 2  # measured on the H200 (BENCHMARKS.md, the latent tail)


def _latent_tail_spec(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    routed, shared, norm_weight, up_weight, latent, hidden, _, tp, eps, piece, pieces = args
    if routed.dim() != 2:
        return f"routed must be [tokens, {latent}], got {tuple(routed.shape)}"
    t = routed.shape[0]
    named = {"norm_weight": norm_weight, "up_weight": up_weight}
    # read in place; at TP > 1 the kernel reads views of the all-reduced [routed | shared]
    if not host().collective_runs(tp):
        named.update(routed=routed, shared=shared)
    reason = check_tensors(named, torch.bfloat16)
    if reason:
        return reason
    for name, tensor in (("routed", routed), ("shared", shared)):
        if tensor.dtype != torch.bfloat16:
            return f"{name} is {dtype_name(tensor.dtype)}; the template is bf16 only"
    reason = (shape_is("routed", routed, (t, latent)) or shape_is("shared", shared, (t, hidden))
              or shape_is("norm_weight", norm_weight, (latent,)) or shape_is("up_weight", up_weight, (hidden, latent)))
    if reason:
        return reason
    if pieces not in (1, tp) or not 0 <= piece < pieces or hidden % pieces:
        return f"piece {piece} of {pieces} (TP {tp}) over {hidden} up-projection rows"
    rows = hidden // pieces
    stride = latent + hidden if host().collective_runs(tp) else None
    if LATENT_GEMM_MIN_TOKENS <= t <= GEMM_MAX_TOKENS:
        spec = gemm_spec("latent_tail_gemm", op, arch, tokens=t, k=latent, rows=rows, rows_out=rows,
                         norm_eps=float(eps), residual=True, x_stride=stride or latent, r_stride=stride or hidden)
        if not isinstance(spec, str):
            return (spec,)
    spec = gemv_spec(op, arch, tokens=t, k=latent, rows=rows, x_stride=stride or latent, norm=True,
                     eps=eps, residual=True, r_stride=stride or hidden)
    return spec if isinstance(spec, str) else (spec,)


def _piece(args: Sequence[Any], shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece of the up projection's rows and its columns of ``shared`` (views)."""
    up_weight, piece, pieces = args[3], args[9], args[10]
    rows = up_weight.chunk(pieces)[piece]
    return rows, shared[:, piece * rows.shape[0]:(piece + 1) * rows.shape[0]]


def _latent_tail_runtime(args: Sequence[Any]) -> str | None:
    routed, shared, norm_weight = args[:3]
    tp = args[7]
    rows, part = _piece(args, shared)
    return aligned({"routed": None if host().collective_runs(tp) else routed, "norm_weight": norm_weight,
                    "up_weight rows": rows, "shared columns": None if host().collective_runs(tp) else part})


def _latent_tail_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """``out``: this rank's [tokens, hidden / pieces] piece, written by the kernel before the gather."""
    (fn,) = fns
    routed, shared, norm_weight, _, latent, hidden, group, tp, _, _, pieces = args
    if host().collective_runs(tp):
        reduced = host().all_reduce(torch.cat([routed, shared], dim=-1), group, tp)
        routed, shared = reduced.split([latent, hidden], dim=-1)
    rows, part = _piece(args, shared)
    y = out if out is not None else shared.new_empty((shared.shape[0], rows.shape[0]))
    if specs[0].kernel == "latent_tail_gemm":
        gemm_call(fn, routed, rows, y, norm_weight, part)
    else:
        fn(routed, rows, norm_weight, part, y)
    return host().gather_last_dim(y, group, pieces)


TEMPLATE = Template("latent_tail", ("k3f::latent_tail",), _latent_tail_spec, _latent_tail_runtime,
                    _latent_tail_launch,
                    doc=f"[routed | shared] all-reduce (TP > 1), then RMSNorm + this rank's piece of the "
                        f"up-projection rows + shared add, 1..{GEMV_MAX_TOKENS} tokens: one skinny GEMV (1 token) or "
                        "tensor-core GEMM; then the gather of the pieces")
