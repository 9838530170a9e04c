"""The kernel templates that exist, and how each one meets its fused op (no CuTe import here).

A template is the cutlass-free half of a kernel: which schedule kernel and fused ops it
implements, how a call's arguments (real tensors, or the meta values of a traced graph)
become a ``KernelSpec`` or a refusal that says why, and how its compiled function is
called from torch. The CuTe DSL half (the kernel class and its fake compile arguments)
lives in ``codegen/kernels/<name>.py``, imported only to compile.

A fused op that no template serves, or a call a template refuses, runs the op's CPU
reference (which is plain torch and runs on the GPU too): see ``codegen.bind``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from codegen.spec import KernelSpec

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
KERNELS_DIR = Path(__file__).parent / "kernels"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Template:
    kernel: str  # the schedule's kernel name (the rule's kernel)
    ops: tuple[str, ...]  # fused ops served, "k3f::name"
    module: str  # the CuTe DSL half: defines build(spec) -> (kernel object, fake compile args)
    make_spec: Callable[[str, str, Sequence[Any]], KernelSpec | str]  # (op, arch, op args) -> spec | refusal
    runtime_check: Callable[[Sequence[Any]], str | None]  # what only real tensors can tell (alignment)
    launch: Callable[..., Any]  # (fn, spec, op args, out=None) -> the op's outputs
    doc: str = ""

    def source_files(self) -> list[Path]:
        """The files whose text is part of the cache key: the kernel module and what it shares."""
        name = self.module.rsplit(".", 1)[-1]
        return [KERNELS_DIR / f"{name}.py", KERNELS_DIR / "common.py"]


def _check_tensors(named: dict[str, Any], dtype: torch.dtype) -> str | None:
    for name, t in named.items():
        if t.dtype != dtype:
            return f"{name} is {dtype_name(t.dtype)}; the template is {dtype_name(dtype)} only"
        if not t.is_contiguous():
            return f"{name} is not contiguous (strides {tuple(t.stride())})"
    return None


def _aligned(named: dict[str, Any], nbytes: int = 16) -> str | None:
    for name, t in named.items():
        if t is not None and t.data_ptr() % nbytes:
            return f"{name} is not {nbytes}-byte aligned (128-bit loads)"
    return None


# ---------------------------------------------------------------- attn_res_norm

def _attn_res_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    prefix, delta, blocks, norm_w, qk_w, out_w, num_blocks, write_idx, eps = args
    if prefix.dim() != 2:
        return f"prefix must be [tokens, hidden], got {tuple(prefix.shape)}"
    t, d = prefix.shape
    named = {"prefix": prefix, "blocks": blocks, "norm_weight": norm_w, "qk_weight": qk_w, "out_norm_weight": out_w}
    if delta is not None:
        named["delta"] = delta
    reason = _check_tensors(named, torch.bfloat16)
    if reason:
        return reason
    if delta is not None and tuple(delta.shape) != (t, d):
        return f"delta {tuple(delta.shape)} does not match prefix {(t, d)}"
    if blocks.dim() != 3 or blocks.shape[0] != t or blocks.shape[2] != d:
        return f"blocks must be [tokens, blocks, {d}], got {tuple(blocks.shape)}"
    for name in ("norm_weight", "qk_weight", "out_norm_weight"):
        if tuple(named[name].shape) != (d,):
            return f"{name} must be [{d}], got {tuple(named[name].shape)}"
    if d % 8:
        return f"hidden {d} is not a multiple of 8 (128-bit vectors)"
    nb = blocks.shape[1]
    if not 0 <= num_blocks <= min(8, nb):
        return f"num_blocks {num_blocks} outside 0..{min(8, nb)} (at most 9 sources)"
    if write_idx >= nb:
        return f"write_idx {write_idx} outside the block buffer ({nb} blocks)"
    return KernelSpec.make("attn_res_norm", op, arch, shapes={"hidden": d, "blocks": nb},
                           dtypes={"act": "bf16", "weight": "bf16"},
                           params={"num_blocks": int(num_blocks), "write_idx": max(int(write_idx), -1),
                                   "has_delta": delta is not None, "eps": float(eps)})


def _attn_res_runtime(args: Sequence[Any]) -> str | None:
    prefix, delta, blocks, norm_w, qk_w, out_w = args[:6]
    return _aligned({"prefix": prefix, "delta": delta, "blocks": blocks, "norm_weight": norm_w,
                     "qk_weight": qk_w, "out_norm_weight": out_w})


def _attn_res_launch(fn, spec: KernelSpec, args: Sequence[Any], out=None):
    prefix, delta, blocks, norm_w, qk_w, out_w = args[:6]
    x, new_prefix = out if out is not None else (torch.empty_like(prefix), torch.empty_like(prefix))
    if prefix.shape[0]:
        fn(prefix, delta, blocks, norm_w, qk_w, out_w, x, new_prefix)
    return x, new_prefix


# ---------------------------------------------------------------- attn_in_proj_gemv

GEMV_MAX_TOKENS = 8


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


def _gemv_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    x, weight, split_sizes = args
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    t, k = x.shape
    n = weight.shape[0]
    if not 1 <= t <= GEMV_MAX_TOKENS:
        return f"{t} tokens outside 1..{GEMV_MAX_TOKENS} (the GEMV template; larger batches need the GEMM)"
    reason = _check_tensors({"x": x, "weight": weight}, torch.bfloat16)
    if reason:
        return reason
    if weight.shape[1] != k:
        return f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    if k % 256:
        return f"K {k} is not a multiple of 256 (one 128-bit vector per lane)"
    sizes = [int(s) for s in split_sizes]
    if sum(sizes) != n or len(sizes) < 4:
        return f"split sizes {sizes} must be at least 4 pieces summing to the {n} weight rows"
    return KernelSpec.make("attn_in_proj_gemv", op, arch, shapes={"tokens": t, "k": k, "rows": n},
                           dtypes={"act": "bf16", "weight": "bf16"},
                           params={"segments": sizes[:4], **gemv_tiling(t, k)})


def _gemv_runtime(args: Sequence[Any]) -> str | None:
    x, weight, _ = args
    return _aligned({"x": x, "weight": weight})


def _gemv_launch(fn, spec: KernelSpec, args: Sequence[Any], out=None):
    x, weight, _ = args
    segments = spec.param_dict["segments"]
    ys = list(out) if out is not None else [x.new_empty((x.shape[0], s)) for s in segments]
    fn(x, weight, *ys, *[None] * (4 - len(ys)))
    return tuple(ys)


# ---------------------------------------------------------------- router_topk

ROUTER_MAX_EXPERTS = 8192  # codegen/kernels/router_topk.py: at most 8 experts per thread of 1024
ROUTER_MAX_TOP_K = 32  # the weights are summed by one warp


def router_threads(experts: int) -> int:
    """Threads per CTA: up to 8 experts each, whole warps, 32..1024 (E = 896: 128)."""
    return min(1024, max(32, -(-experts // 8 // 32) * 32))


def _router_topk_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    logits, bias, top_k, renormalize, scaling = args
    if logits.dim() != 2:
        return f"logits must be [tokens, experts], got {tuple(logits.shape)}"
    reason = _check_tensors({"logits": logits, "bias": bias}, torch.float32)
    if reason:
        return reason
    e = logits.shape[1]
    if tuple(bias.shape) != (e,):
        return f"bias must be [{e}], got {tuple(bias.shape)}"
    if not 1 <= e <= ROUTER_MAX_EXPERTS:
        return f"{e} experts outside 1..{ROUTER_MAX_EXPERTS}"
    if not 1 <= int(top_k) <= min(ROUTER_MAX_TOP_K, e):
        return f"top_k {top_k} outside 1..{min(ROUTER_MAX_TOP_K, e)}"
    return KernelSpec.make("router_topk", op, arch, shapes={"experts": e},
                           dtypes={"logits": "fp32", "bias": "fp32"},
                           params={"top_k": int(top_k), "renormalize": bool(renormalize), "scaling": float(scaling),
                                   "threads": router_threads(e)})


def _router_topk_runtime(args: Sequence[Any]) -> str | None:
    return None  # scalar fp32 loads: no alignment beyond the dtype's


def _router_topk_launch(fn, spec: KernelSpec, args: Sequence[Any], out=None):
    logits, bias = args[:2]
    k = spec.param_dict["top_k"]
    t = logits.shape[0]
    weights, ids = out if out is not None else (logits.new_empty((t, k)),
                                                torch.empty((t, k), dtype=torch.int64, device=logits.device))
    if t:
        fn(logits, bias, weights, ids)
    return weights, ids


TEMPLATES: dict[str, Template] = {
    t.kernel: t for t in (
        Template("attn_res_norm", ("k3f::attn_res_norm",), "codegen.kernels.attn_res_norm", _attn_res_spec,
                 _attn_res_runtime, _attn_res_launch,
                 doc="AttnRes mix over <= 9 sources + RMSNorm, block write and new prefix; one CTA per token"),
        Template("attn_in_proj_gemv", ("k3f::kda_in_proj", "k3f::mla_in_proj"), "codegen.kernels.in_proj_gemv",
                 _gemv_spec, _gemv_runtime, _gemv_launch,
                 doc="packed input projection for 1..8 tokens, split into its 4 outputs; weight-streaming GEMV"),
        Template("router_topk", ("k3f::router_topk",), "codegen.kernels.router_topk", _router_topk_spec,
                 _router_topk_runtime, _router_topk_launch,
                 doc="sigmoid + bias top-k (k rounds of a block argmax), renormalized weights; one CTA per token"),
    )
}


def template(kernel: str) -> Template | None:
    """The template implementing the schedule kernel ``kernel``, or None (no template yet)."""
    return TEMPLATES.get(kernel)


def templates_for_op(op: str) -> list[Template]:
    op = op if "::" in op else f"k3f::{op}"
    return [t for t in TEMPLATES.values() if op in t.ops]


def spec_for_call(op: str, arch: str, args: Sequence[Any]) -> tuple[Template | None, KernelSpec | str]:
    """The first template that accepts this call of ``op``, with its spec; else (None, the reasons)."""
    reasons = []
    for t in templates_for_op(op):
        spec = t.make_spec(op if "::" in op else f"k3f::{op}", arch, args)
        if isinstance(spec, KernelSpec):
            return t, spec
        reasons.append(f"{t.kernel}: {spec}")
    return None, "; ".join(reasons) or f"no CuTe DSL template for {op} yet"
