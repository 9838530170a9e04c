"""``mla_attend``: MLA decode over vLLM's paged latent cache (bf16, or fp8 E4M3 with its
per-tensor scale) + W_UV + sigmoid output gate (``k3f::mla_attend``); one kernel whose context
splits (and head groups of at most 16, the MMA's rows) meet at a grid-wide barrier, so the whole
grid must be resident at once: at most 128 CTAs, or the SMs of a GPU with fewer (H100 PCIe 114,
H20 78), whose kernels take fewer splits."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.spec import KernelSpec
from codegen.targets import MAX_Q, MAX_TOKENS
from codegen.template import Template, aligned, dtype_name, require_outside_capture, shape_is, target_sms

MLA_LATENT, MLA_ROPE, MLA_V_DIM, MLA_NOPE = 512, 64, 128, 128  # codegen/kernels/mla_attend.py
MLA_MAX_CTAS = 128  # the grid: requests x context splits
MLA_GROUP_HEADS = 16  # heads a CTA takes: the MMA's 16 rows
MLA_MAX_HEADS = 128  # a rank's heads over its groups (Kimi K3 at TP 1: 96)


def mla_head_groups(heads: int) -> int:
    """Head groups of the grid (codegen/kernels/mla_attend.py:head_groups): the fewest of at
    most 16 heads that split ``heads`` evenly."""
    return next(g for g in range(-(-heads // MLA_GROUP_HEADS), heads + 1) if heads % g == 0)


def mla_splits(batch: int, heads: int, cap: int = MLA_MAX_CTAS) -> int:
    """Context splits per request and head group (codegen/kernels/mla_attend.py:splits_for)."""
    return max(1, cap // (batch * mla_head_groups(heads)))


def grid_cap(t: torch.Tensor) -> int:
    """The most CTAs the grid may take on the GPU it is for (``target_sms``: ``t``'s, or the one a
    plan is for): ``MLA_MAX_CTAS``, or its SM count where that is smaller."""
    return min(MLA_MAX_CTAS, target_sms(t) or MLA_MAX_CTAS)



def _mla_attend_spec(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    if len(args) != 12:
        return f"{op} takes 12 arguments, got {len(args)}"
    mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate, scale, heads, nope, v_dim, kv_lora = args
    h = int(heads)
    if not 1 <= h <= MLA_MAX_HEADS:
        return f"heads {h} outside 1..{MLA_MAX_HEADS}"
    if (int(nope), int(v_dim), int(kv_lora)) != (MLA_NOPE, MLA_V_DIM, MLA_LATENT):
        return (f"nope {nope}, v_dim {v_dim}, kv_lora {kv_lora}: the kernel is built for {MLA_NOPE}, {MLA_V_DIM}, "
                f"{MLA_LATENT}")
    e = MLA_LATENT + MLA_ROPE
    if mqa_q.dtype != torch.bfloat16 or not mqa_q.is_contiguous() or mqa_q.dim() != 3:
        return (f"mqa_q must be a contiguous bf16 [tokens, heads, {e}], "
                f"got {dtype_name(mqa_q.dtype)} {tuple(mqa_q.shape)}")
    t = mqa_q.shape[0]
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        return f"seq_lens must be int32 [requests], got {dtype_name(seq_lens.dtype)} {tuple(seq_lens.shape)}"
    b = seq_lens.shape[0]
    if b < 1 or t % b:
        return f"{t} tokens do not split evenly over {b} requests"
    q = t // b
    if q > MAX_Q:
        return f"{q} tokens per request outside 1..{MAX_Q}"
    if not 1 <= t <= MAX_TOKENS:
        return f"{t} tokens outside 1..{MAX_TOKENS}"
    groups, cap = mla_head_groups(h), grid_cap(mqa_q)
    if t * groups > cap:
        held = ("a grid-wide barrier holds" if cap == MLA_MAX_CTAS
                else "SMs of the GPU hold (the grid barrier needs every CTA resident)")
        return f"{t} tokens x {groups} head groups of {h // groups} heads: more CTAs than the {cap} {held}"
    reason = (shape_is("mqa_q", mqa_q, (t, h, e)) or shape_is("kv_b_weight", kv_b_weight, (h * 256, MLA_LATENT))
              or shape_is("gate", gate, (t, h * MLA_V_DIM)))
    if reason:
        return reason
    if kv_b_weight.dtype != torch.bfloat16 or not kv_b_weight.is_contiguous():
        return f"kv_b_weight must be contiguous bf16, got {dtype_name(kv_b_weight.dtype)}"
    if gate.dtype != torch.bfloat16 or gate.stride(1) != 1:
        return f"gate must be bf16 with unit column stride, got {dtype_name(gate.dtype)} strides {tuple(gate.stride())}"
    if kv_cache.dim() != 3 or kv_cache.shape[2] != e:
        return f"kv_cache must be [blocks, block_size, {e}], got {tuple(kv_cache.shape)}"
    fp8 = host().kv_cache_is_fp8(kv_cache)
    if not fp8 and kv_cache.dtype != torch.bfloat16:
        return f"kv_cache is {dtype_name(kv_cache.dtype)}; the template reads bf16 or fp8 E4M3 (uint8 storage)"
    per_vector = 16 if fp8 else 8
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != e or kv_cache.stride(0) % per_vector:
        return (f"kv_cache strides {tuple(kv_cache.stride())}: entries must be contiguous and the block stride a "
                f"multiple of {per_vector} elements (16-byte loads)")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != b \
            or not block_table.is_contiguous():
        return f"block_table must be a contiguous int32 [{b}, max_blocks], got {dtype_name(block_table.dtype)} " \
               f"{tuple(block_table.shape)}"
    if kv_scale.dtype != torch.float32 or kv_scale.numel() != 1:
        return f"kv_scale must be one fp32 value, got {dtype_name(kv_scale.dtype)} {tuple(kv_scale.shape)}"
    return (KernelSpec.make("mla_attend", op, arch, shapes={"batch": t, "heads": h, "block_size": kv_cache.shape[1],
                                                               **({"q_len": q} if q > 1 else {})},
                            dtypes={"q": "bf16", "cache": "fp8_e4m3" if fp8 else "bf16", "weight": "bf16"},
                            params={"scale": float(scale), "gate_stride": gate.stride(0),
                                    **({"max_ctas": cap} if cap < MLA_MAX_CTAS else {})}),)


def _mla_attend_runtime(args: Sequence[Any]) -> str | None:
    """The spec sized the grid by this GPU's SMs (``grid_cap``); what is left to check is alignment."""
    mqa_q, kv_cache, *_ = args
    return aligned({"mqa_q": mqa_q, "kv_cache": kv_cache, "kv_b_weight": args[5]})


_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _scratch(device: torch.device, pairs: int, heads: int, batch: int) -> tuple[torch.Tensor, ...]:
    """The split partials (a row per (request, split)), the combined latent and the barrier word
    of one shape on one device, made once and shared by every MLA layer (they run one after
    another; the barrier word's low bits are back at 0 after each barrier). Made outside any
    CUDA graph capture (``_mla_attend_workspace``): in one, the barrier's zeroing would only be
    recorded into that graph, and every later graph would find a word never zeroed."""
    key = (device, pairs, heads, batch)
    if key not in _SCRATCH:
        require_outside_capture(device, f"k3f::mla_attend: the scratch of {batch} tokens x {heads} heads")
        _SCRATCH[key] = (torch.empty(pairs, heads, MLA_LATENT, dtype=torch.float32, device=device),
                         torch.empty(pairs, heads, 2, dtype=torch.float32, device=device),
                         torch.empty(batch, heads, MLA_LATENT, dtype=torch.bfloat16, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def _scratch_of(spec: KernelSpec, device: torch.device) -> tuple[torch.Tensor, ...]:
    b, h = spec.shape_dict["batch"], spec.shape_dict["heads"]
    return _scratch(device, b * mla_splits(b, h, spec.param_dict.get("max_ctas", MLA_MAX_CTAS)), h, b)


def _mla_attend_workspace(spec: KernelSpec, device: Any) -> bool:
    """The scratch of ``spec``'s shape, made before the first captured step, its barrier word
    zeroed at every call (each time vLLM binds its caches)."""
    device = torch.device(device)
    require_outside_capture(device, "k3f::mla_attend: the grid barrier")
    _scratch_of(spec, device)[3].zero_()
    return True


def _mla_attend_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,), (spec,) = fns, specs
    mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate = args[:7]
    b, h = spec.shape_dict["batch"], spec.shape_dict["heads"]
    out = out if out is not None else gate.new_empty(b, h * MLA_V_DIM)
    cache = kv_cache.view(torch.float8_e4m3fn) if kv_cache.dtype == torch.uint8 else kv_cache
    p_acc, p_ml, latent, barrier = _scratch_of(spec, mqa_q.device)
    fn(mqa_q, cache, block_table, seq_lens, kv_scale.reshape(1), kv_b_weight, gate, out, p_acc, p_ml, latent, barrier)
    return out


TEMPLATE = Template("mla_attend", ("k3f::mla_attend",), _mla_attend_spec, _mla_attend_runtime, _mla_attend_launch,
                    doc="MLA decode split over the context and head groups of 16 + grid barrier + combine + W_UV "
                        "+ sigmoid gate; requests x head groups x splits <= 128 CTAs",
                    workspace=_mla_attend_workspace)
