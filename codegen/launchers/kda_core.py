"""``kda_core``: f_b_proj + short conv + gates + delta-rule update + sigmoid-gated RMSNorm
(``k3f::kda_core``, and ``k3f::kda_core_verify`` for a speculative verify step in vLLM's
multi-slot contract); one kernel, one CTA per (request, head), or from ``PERSISTENT_FROM_ITEMS``
pairs at one token per request one CTA an SM, each taking a head's requests in turn
(``persistent_ctas``); the tokens of a request in order.

The conv and recurrent states are taken as vLLM lays them out (one page per slot: any slot
stride, the conv state SD or DS within a slot), read and written in place."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.spec import KernelSpec
from codegen.targets import MAX_Q
from codegen.template import Template, aligned, check_tensors, dtype_name, shape_is, sm_count

KDA_HEAD_DIM = 128  # codegen/kernels/kda_core.py: 4 threads x 32 fp32 per state row, 512 threads
KDA_CONV_WIDTH = 4
# (request, head) pairs from which a one-token step takes the persistent form: more than one CTA
# an SM on an H100 SXM / H200 (132 SMs). Below it one CTA per pair, its loads in the order of its work
PERSISTENT_FROM_ITEMS = 133


VERIFY_OP = "k3f::kda_core_verify"


def _kda_core_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    verify = op == VERIFY_OP
    if len(args) != 16 + verify:
        return f"{op} takes {16 + verify} arguments, got {len(args)}"
    if verify:
        (mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
         recurrent_state, state_indices, num_accepted, heads, head_dim, lower_bound, eps) = args
    else:
        (mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
         recurrent_state, state_indices, heads, head_dim, lower_bound, eps) = args
    h, d = int(heads), int(head_dim)
    if d != KDA_HEAD_DIM:
        return f"head_dim {d}: the kernel is built for {KDA_HEAD_DIM} (4 threads x 32 state values per row)"
    if h < 1:
        return f"heads {h} must be >= 1"
    reason = (check_tensors({"mixed_qkv": mixed_qkv, "g_out": g_out, "f_a": f_a, "beta": beta,
                             "f_b_weight": f_b_weight, "norm_weight": norm_weight}, torch.bfloat16)
              or check_tensors({"conv_weight": conv_weight, "a_log": a_log, "dt_bias": dt_bias}, torch.float32)
              or (_verify_indices(state_indices, num_accepted) if verify
                  else check_tensors({"state_indices": state_indices}, torch.int32))
              or _dtype_is("conv_state", conv_state, torch.bfloat16)
              or _dtype_is("recurrent_state", recurrent_state, torch.float32))
    if reason:
        return reason
    if mixed_qkv.dim() != 2:
        return f"mixed_qkv must be [tokens, 3 x heads x head_dim], got {tuple(mixed_qkv.shape)}"
    t, p = mixed_qkv.shape[0], h * d
    if conv_weight.dim() == 3 and conv_weight.shape[2] != KDA_CONV_WIDTH:
        return f"conv width {conv_weight.shape[2]}: the kernel takes {KDA_CONV_WIDTH}"
    if state_indices.dim() != 1 + verify:
        return f"state_indices must be {'[requests, q]' if verify else '[requests]'}, got {tuple(state_indices.shape)}"
    b = state_indices.shape[0]
    if conv_state.dim() != 3 or recurrent_state.dim() != 4:
        return (f"conv_state must be [slots, 3P, rows] and recurrent_state [slots, H, V, K], got "
                f"{tuple(conv_state.shape)} and {tuple(recurrent_state.shape)}")
    slots, rows = conv_state.shape[0], conv_state.shape[2]
    reason = (shape_is("mixed_qkv", mixed_qkv, (t, 3 * p)) or shape_is("g_out", g_out, (t, p))
              or shape_is("f_a", f_a, (t, d)) or shape_is("beta", beta, (t, h))
              or shape_is("f_b_weight", f_b_weight, (p, d))
              or shape_is("conv_weight", conv_weight, (3 * p, 1, KDA_CONV_WIDTH))
              or shape_is("a_log", a_log, (h,)) or shape_is("dt_bias", dt_bias, (p,))
              or shape_is("norm_weight", norm_weight, (d,))
              or shape_is("conv_state", conv_state, (slots, 3 * p, rows if verify else KDA_CONV_WIDTH - 1))
              or shape_is("recurrent_state", recurrent_state, (slots, h, d, d)))
    if reason:
        return reason
    layout = host().conv_layout(conv_state)
    if layout is None:
        return (f"conv_state strides {tuple(conv_state.stride())}: a slot must hold its [3, 3P] (SD) or "
                f"[3P, 3] (DS) values contiguously")
    if recurrent_state.stride()[1:] != (d * d, d, 1):
        return f"recurrent_state strides {tuple(recurrent_state.stride())}: a slot must hold [H, V, K] contiguously"
    if conv_state.stride(0) % 8 or recurrent_state.stride(0) % 4:
        return (f"slot strides {conv_state.stride(0)} (conv_state) and {recurrent_state.stride(0)} "
                f"(recurrent_state) must be multiples of 8 and 4 elements (128-bit accesses)")
    if b < 1 or t % b:
        return f"{t} tokens do not split evenly over {b} requests"
    q = t // b
    if not 1 <= q <= MAX_Q:
        return f"{q} tokens per request outside 1..{MAX_Q}"
    shapes, params = {"heads": h, "head_dim": d, "q_len": q}, {}
    if q == 1 and not verify and b * h >= PERSISTENT_FROM_ITEMS:
        params["persistent"] = True
    if verify:
        if state_indices.shape[1] != q:
            return f"state_indices holds {state_indices.shape[1]} slots per request for {q} tokens"
        if rows < q + KDA_CONV_WIDTH - 2:
            return f"the conv state holds {rows} rows; a verify of {q} tokens needs {q + KDA_CONV_WIDTH - 2}"
        shapes["conv_rows"], params["verify"] = rows, True
    return (KernelSpec.make("kda_core", op, arch, shapes=shapes,
                            dtypes={"act": "bf16", "weight": "bf16", "conv_state": "bf16", "state": "fp32"},
                            params={"lower_bound": None if lower_bound is None else float(lower_bound),
                                    "eps": float(eps), "conv_layout": layout, **params}),)


def _verify_indices(state_indices: Any, num_accepted: Any) -> str | None:
    """A verify step's slots may be a slice of vLLM's block table (any row stride), each row contiguous."""
    for name, t in (("state_indices", state_indices), ("num_accepted", num_accepted)):
        if t.dtype != torch.int32:
            return f"{name} is {dtype_name(t.dtype)}; the template is int32 only"
    if state_indices.dim() == 2 and state_indices.stride(1) != 1:
        return f"state_indices strides {tuple(state_indices.stride())}: a request's slots must be contiguous"
    if num_accepted.dim() != 1 or num_accepted.shape[0] != state_indices.shape[0] or not num_accepted.is_contiguous():
        return f"num_accepted must be a contiguous [{state_indices.shape[0]}], got {tuple(num_accepted.shape)}"
    return None


def _dtype_is(name: str, t: Any, dtype: torch.dtype) -> str | None:
    return None if t.dtype == dtype else f"{name} is {dtype_name(t.dtype)}; the template takes {dtype_name(dtype)}"


def _kda_core_runtime(args: Sequence[Any]) -> str | None:
    names = ("mixed_qkv", "g_out", "f_a", None, "f_b_weight", "conv_weight", None, None, "norm_weight", "conv_state",
             "recurrent_state")  # the tensors read or written with 128-bit accesses
    return aligned({n: a for n, a in zip(names, args) if n})


def persistent_ctas(items: int, heads: int, sms: int) -> int:
    """The persistent form's grid for ``items`` (request, head) pairs on ``sms`` SMs. The kernel
    holds one CTA an SM (512 threads, up to 128 registers), so beyond ``sms`` items a grid of one
    CTA per item runs in waves, each CTA's loads exposed in turn. Instead one CTA an SM (a
    multiple of ``heads``, so a CTA keeps one head and its weights) loops over items, copying
    the next item's inputs while it works on this one. (With more tokens per request the loop
    would spill registers: one CTA per item.)"""
    if items <= sms:
        return items
    return max(heads, sms // heads * heads)


def _kda_core_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,) = fns
    (mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state, recurrent_state,
     state_indices) = args[:12]
    num_accepted = args[12] if specs[0].param_dict.get("verify") else state_indices  # unread by a one-slot step
    out = out if out is not None else g_out.new_empty(g_out.shape)
    # flat 2-D views: a channel's taps; a slot's conv state as one row (its page stride kept)
    conv_w = conv_weight.view(conv_weight.shape[0], conv_weight.shape[2])
    conv_s = conv_state.as_strided((conv_state.shape[0], conv_state.shape[1] * conv_state.shape[2]),
                                   (conv_state.stride(0), 1))
    heads = specs[0].shape_dict["heads"]
    items = state_indices.shape[0] * heads
    ctas = (persistent_ctas(items, heads, sm_count(mixed_qkv.device.index)) if specs[0].param_dict.get("persistent")
            else items)
    fn(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_w, a_log, dt_bias, norm_weight, conv_s, recurrent_state,
       state_indices, num_accepted, out, ctas)
    return out


TEMPLATE = Template("kda_core", ("k3f::kda_core", VERIFY_OP), _kda_core_spec, _kda_core_runtime, _kda_core_launch,
                    doc="f_b_proj + conv + gates + delta-rule update + gated RMSNorm; one CTA per (request, head)")
