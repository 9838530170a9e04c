"""``mla_q_front``: MLA's query front (``k3f::mla_q_front``): both LoRA norms, ``q_b_proj``, the
W_UK absorption and the latent cache insert in one kernel, 1..64 tokens; a cluster of 8 CTAs
per head (``codegen/kernels/mla_q_front.py``).

q_c, kv_c and k_pe are taken as the input projection's split leaves them (column views of one
wider row: their row strides are compiled in); the cache as vLLM lays it out (bf16, or fp8
E4M3 in uint8 / float8_e4m3fn storage; its block and entry strides are runtime values)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.spec import KernelSpec
from codegen.template import Template, aligned, check_tensors, dtype_name, shape_is

Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 1536, 512, 128, 64, 128  # codegen/kernels/mla_q_front.py
MAX_TOKENS = 64
SLOT_DTYPES = {torch.int64: "int64", torch.int32: "int32"}


def _row_stride(name: str, t: Any, width: int) -> int | str:
    """The row stride of a [T, width] activation view (unit column stride), canonical at one token."""
    if t.dtype != torch.bfloat16:
        return f"{name} is {dtype_name(t.dtype)}; the template is bf16 only"
    if t.dim() != 2 or t.shape[1] != width:
        return f"{name} must be [tokens, {width}], got {list(t.shape)}"
    if t.shape[0] == 1:
        return width  # one row: its stride is never used
    if t.stride(1) != 1 or t.stride(0) < width or t.stride(0) % 8:
        return (f"{name} strides {tuple(t.stride())}: rows of unit stride {width} values apart or more, "
                f"a multiple of 8 (128-bit loads)")
    return int(t.stride(0))


def _mla_q_front_spec(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    if len(args) != 16:
        return f"{op} takes 16 arguments, got {len(args)}"
    (q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping, kv_scale, heads, nope,
     rope, v_dim, kv_lora, eps) = args
    h = int(heads)
    if (int(nope), int(rope), int(v_dim), int(kv_lora)) != (NOPE, ROPE, V_DIM, KV_LORA):
        return (f"head dims nope {nope}, rope {rope}, v_dim {v_dim}, kv_lora {kv_lora}: the kernel is built for "
                f"{NOPE}, {ROPE}, {V_DIM}, {KV_LORA}")
    if h < 1:
        return f"heads {h} must be >= 1"
    if q_c.dim() != 2:
        return f"q_c must be [tokens, {Q_LORA}], got {list(q_c.shape)}"
    t = q_c.shape[0]
    if not 1 <= t <= MAX_TOKENS:
        return f"{t} tokens outside 1..{MAX_TOKENS}"
    strides = {}
    for name, tensor, width in (("q_c", q_c, Q_LORA), ("kv_c", kv_c, KV_LORA), ("k_pe", k_pe, ROPE)):
        s = _row_stride(name, tensor, width)
        if isinstance(s, str):
            return s
        strides[name] = s
    reason = (check_tensors({"q_a_norm": q_a_norm, "kv_a_norm": kv_a_norm, "q_b_weight": q_b_weight,
                             "kv_b_weight": kv_b_weight}, torch.bfloat16)
              or shape_is("kv_c", kv_c, (t, KV_LORA)) or shape_is("k_pe", k_pe, (t, ROPE))
              or shape_is("q_a_norm", q_a_norm, (Q_LORA,)) or shape_is("kv_a_norm", kv_a_norm, (KV_LORA,))
              or shape_is("q_b_weight", q_b_weight, (h * (NOPE + ROPE), Q_LORA))
              or shape_is("kv_b_weight", kv_b_weight, (h * (NOPE + V_DIM), KV_LORA)))
    if reason:
        return reason
    if kv_cache.dtype == torch.bfloat16:
        cache, vec = "bf16", 8
    elif host().kv_cache_is_fp8(kv_cache):
        cache, vec = "fp8", 16
    else:
        return f"kv_cache is {dtype_name(kv_cache.dtype)}; the template takes bf16 or fp8 (uint8, float8_e4m3fn)"
    if kv_cache.dim() != 3 or kv_cache.shape[2] != KV_LORA + ROPE:
        return f"kv_cache must be [blocks, block_size, {KV_LORA + ROPE}], got {list(kv_cache.shape)}"
    if kv_cache.stride(2) != 1 or kv_cache.stride(0) % vec or kv_cache.stride(1) % vec:
        return (f"kv_cache strides {tuple(kv_cache.stride())}: entries of unit stride, block and entry strides "
                f"multiples of 16 bytes (128-bit stores)")
    if slot_mapping.dtype not in SLOT_DTYPES:
        return f"slot_mapping is {dtype_name(slot_mapping.dtype)}; the template takes int64 or int32"
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t or (t > 1 and slot_mapping.stride(0) != 1):
        return f"slot_mapping must be a contiguous [{t}], got {list(slot_mapping.shape)} {tuple(slot_mapping.stride())}"
    if kv_scale.dtype != torch.float32 or kv_scale.numel() != 1:
        return f"kv_scale must be one fp32 value, got {dtype_name(kv_scale.dtype)} {list(kv_scale.shape)}"
    return (KernelSpec.make("mla_q_front", op, arch, shapes={"tokens": t, "heads": h},
                            dtypes={"act": "bf16", "weight": "bf16"},
                            params={"cache": cache, "slot": SLOT_DTYPES[slot_mapping.dtype], "eps": float(eps),
                                    "q_stride": strides["q_c"], "kv_stride": strides["kv_c"],
                                    "pe_stride": strides["k_pe"]}),)


def _mla_q_front_runtime(args: Sequence[Any]) -> str | None:
    names = ("q_c", "kv_c", "k_pe", "q_a_norm", "kv_a_norm", "q_b_weight", "kv_b_weight", "kv_cache")
    return aligned(dict(zip(names, args)))  # all read or written with 128-bit accesses


def _mla_q_front_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,) = fns
    q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping, kv_scale, heads = args[:11]
    out = out if out is not None else q_c.new_empty((q_c.shape[0], int(heads), KV_LORA + ROPE))
    if kv_cache.dtype != torch.bfloat16:
        kv_cache = kv_cache.view(torch.uint8)  # E4M3 bytes, the same strides
    if q_c.shape[0] == 1:  # one token: the spec's canonical strides (the kernel never steps a row)
        q_c, kv_c, k_pe = (a.as_strided((1, w), (w, 1)) for a, w in ((q_c, Q_LORA), (kv_c, KV_LORA), (k_pe, ROPE)))
        slot_mapping = slot_mapping.as_strided((1,), (1,))
    fn(q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping, kv_scale.reshape(1),
       out)
    return out


TEMPLATE = Template("mla_q_front", ("k3f::mla_q_front",), _mla_q_front_spec, _mla_q_front_runtime,
                    _mla_q_front_launch,
                    doc=f"q/kv RMSNorms + q_b_proj + W_UK absorption + latent cache insert (bf16 or fp8), "
                        f"1..{MAX_TOKENS} tokens: one kernel, a cluster of 8 CTAs per head")
