"""``router_down``: the fp32 router logits and the routed experts' latent input of one
TP rank (``k3f::router_down``), one launch over the two weights, then the gathers: the skinny
GEMV below ``ROUTER_GEMM_MIN_TOKENS`` tokens, the tensor-core skinny GEMM (its second-weight
form, fp32 logits) from there, where the GEMV's CUDA-core dot products become the bound."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.launchers.gemm_specs import GEMM_MAX_TOKENS, gemm_call, gemm_spec
from codegen.launchers.gemv_specs import GEMV_MAX_TOKENS, gemv_spec
from codegen.spec import KernelSpec
from codegen.template import Template, aligned, check_tensors

# tensor cores from here: on the H200 (examples/bench_kernels.py --only router, 2026-12-02) the GEMM
# took 5.4 / 5.6 us at 8 tokens against the GEMV's 5.9 / 7.1 (TP 16 / TP 8), 5.6 / 6.0 against
# 12.4 / 24.2 at 16, 8.8 / 9.4 against 45.3 / 87.8 at 64; the GEMV wins below (TP 16, 6 tokens:
# 4.9 against 5.4). Both forms pass their GPU tests at 1, 8, 13, 16, 37 and 64 tokens
ROUTER_GEMM_MIN_TOKENS = 8


def _router_down_spec(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    x, gate_weight, down_weight, _, tp, rank = args
    if x.dim() != 2 or gate_weight.dim() != 2 or down_weight.dim() != 2:
        return f"x, gate_weight and down_weight must be 2-D, got {tuple(x.shape)}, {tuple(gate_weight.shape)}, " \
               f"{tuple(down_weight.shape)}"
    reason = check_tensors({"x": x, "gate_weight": gate_weight, "down_weight": down_weight}, torch.bfloat16)
    if reason:
        return reason
    t, k = x.shape
    if gate_weight.shape[1] != k or down_weight.shape[1] != k:
        return f"weights {tuple(gate_weight.shape)} / {tuple(down_weight.shape)} do not match x {tuple(x.shape)}"
    if not 0 <= rank < tp:
        return f"rank {rank} outside 0..{tp - 1}"
    experts, latent = gate_weight.shape[0], down_weight.shape[0]
    if experts % tp or latent % tp:
        return f"TP {tp} does not divide the {experts} gate rows and {latent} down rows"
    if ROUTER_GEMM_MIN_TOKENS <= t <= GEMM_MAX_TOKENS:
        spec = gemm_spec("router_down_gemm", op, arch, tokens=t, k=k, rows=experts // tp,
                         segments=[experts // tp, latent // tp], second_weight=True, out_fp32=[True, False])
        if not isinstance(spec, str):
            return (spec,)
    spec = gemv_spec(op, arch, tokens=t, k=k, rows0=experts // tp, rows1=latent // tp, out0="fp32", out1="bf16",
                     x_stride=k)
    return spec if isinstance(spec, str) else (spec,)


def _rank_rows(args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of both weights (contiguous row slices, as ``Tensor.chunk`` gives them)."""
    _, gate_weight, down_weight, _, tp, rank = args
    return gate_weight.chunk(tp)[rank], down_weight.chunk(tp)[rank]


def _router_down_runtime(args: Sequence[Any]) -> str | None:
    gate_rows, down_rows = _rank_rows(args)
    return aligned({"x": args[0], "gate_weight rows": gate_rows, "down_weight rows": down_rows})


def _router_down_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """``out``: this rank's (logits, latent) parts, written by the kernel before the gathers."""
    (fn,) = fns
    x, _, _, group, tp, _ = args
    gate_rows, down_rows = _rank_rows(args)
    t = x.shape[0]
    logits, latent = out if out is not None else (x.new_empty((t, gate_rows.shape[0]), dtype=torch.float32),
                                                  x.new_empty((t, down_rows.shape[0])))
    if specs[0].kernel == "router_down_gemm":
        gemm_call(fn, x, gate_rows, [logits, latent], weight1=down_rows)
    else:
        fn(x, gate_rows, down_rows, None, None, logits, latent)
    if tp > 1:
        return host().gather_last_dim(logits, group, tp), host().gather_last_dim(latent, group, tp)
    return logits, latent


TEMPLATE = Template("router_down", ("k3f::router_down",), _router_down_spec, _router_down_runtime,
                    _router_down_launch,
                    doc=f"this rank's fp32 router logits + bf16 latent rows: one skinny GEMV (1.."
                        f"{ROUTER_GEMM_MIN_TOKENS - 1} tokens) or tensor-core GEMM ({ROUTER_GEMM_MIN_TOKENS}.."
                        f"{GEMV_MAX_TOKENS}) over the two weights, then the TP gathers")
