"""Leaf ops of the reference layers, as ``torch.library`` custom ops (namespace ``k3``).

These are the ops that touch decode state or other GPUs, and the MXFP4 expert
dequantization: the all-reduce, the KDA short-conv and recurrent decode steps, the MLA
latent-cache insert and decode attention, the dequantization of selected expert rows.
Keeping them opaque makes the traced graph show exactly where state is read and written
(and keeps the dequantization one node), and lets kernels register as their CUDA
implementation later.
Each has a CPU reference implementation (plain, loop-based where that makes the math
obvious) and a fake implementation, so graphs trace on meta tensors with no memory.

Conventions shared with vLLM 0.33.0:
- decode tokens are laid out request-major: token ``t`` belongs to request
  ``t // q_len``; ``q_len`` (tokens per request, 1 for plain decode) is
  ``num_tokens // num_requests``;
- a KDA state index <= 0 is a padding row (vLLM pads with 0, its null block, and its
  KDA kernels skip index <= 0): no state is read or written and its output is zero; a
  negative MLA cache slot is a padding token (vLLM's PAD_SLOT_ID, -1): nothing is written.

On CUDA the KDA steps and the MLA cache insert and decode run batched
(``conv_update_batched``, ``_recurrent_step_batched``, ``_cache_insert_batched``,
``_decode_batched``: gathers and ``index_copy_``, no host sync), so the reference layer can
be captured in a CUDA graph and compiled; a padding row reads slot 0 (vLLM's null block) and
writes it back unchanged.

``collectives_excluded()`` lets one GPU run a TP > 1 rank's graph for timing: the
all-reduce becomes a copy and the gather repeats the local share (shapes right, values not).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_GROUPS: dict[str, dist.ProcessGroup] = {}
# one collective into one output tensor: torch 2.14 names it all_gather_single (and deprecates the
# older name, which torch 2.11 to 2.13 have alone)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_EXCLUDED = [False]  # collectives_excluded() is active


def reduces(world_size: int) -> bool:
    """Whether a collective over ``world_size`` ranks really runs (not at TP 1, nor when
    excluded): launchers that fuse one skip its staging when it does not."""
    return world_size > 1 and not _EXCLUDED[0]


@contextmanager
def collectives_excluded() -> Iterator[None]:
    """Run TP > 1 graphs on one GPU with their collectives stood down (benchmarks only): the
    all-reduce returns a copy of the local partial and the gather repeats the local share."""
    before = _EXCLUDED[0]
    _EXCLUDED[0] = True
    try:
        yield
    finally:
        _EXCLUDED[0] = before


def register_group(name: str, group: Any) -> None:
    """Make ``group`` reachable from graphs as ``k3::all_reduce(x, name, world_size)``: a torch
    process group (the collectives run by ``torch.distributed``, the sum in fp32), or vLLM's
    ``GroupCoordinator`` (the server's: its own all-reduce and all-gather, the custom all-reduce,
    symmetric-memory or NCCL path vLLM picks and captures, as its stock forward uses them)."""
    _GROUPS[name] = group


def _coordinator(group: Any) -> bool:
    """Whether a registered group is vLLM's ``GroupCoordinator`` (not a torch process group)."""
    return hasattr(group, "device_group") and hasattr(group, "all_reduce")


def _world_size(group: Any) -> int:
    return group.world_size if _coordinator(group) else dist.get_world_size(group)


def _tokens_per_request(num_tokens: int, num_requests: int, op: str) -> int:
    if num_requests <= 0 or num_tokens % num_requests:
        raise ValueError(f"{op}: {num_tokens} tokens do not split evenly over {num_requests} requests")
    return num_tokens // num_requests


# ---- all-reduce --------------------------------------------------------------------
@torch.library.custom_op("k3::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str, world_size: int) -> Tensor:
    """Sum over the ranks of ``group``; the identity at world size 1.

    The sum is taken in fp32 and rounded once, the numerics of a one-shot
    all-reduce that accumulates in registers.
    """
    if world_size == 1 or _EXCLUDED[0]:
        return x.clone()
    if group not in _GROUPS:
        raise RuntimeError(
            f"k3::all_reduce: no process group registered as {group!r} "
            f"(call rewriter.model.ops.register_group before running a TP {world_size} layer)"
        )
    pg = _GROUPS[group]
    if _world_size(pg) != world_size:
        raise RuntimeError(
            f"k3::all_reduce: group {group!r} has {_world_size(pg)} ranks, the graph expects {world_size}"
        )
    if _coordinator(pg):  # out of place on a GPU; vLLM's CPU communicators reduce in place, so they get a copy
        out = pg.all_reduce(x if x.is_cuda else x.clone())
        return out if out is not x else out.clone()
    acc = x.to(torch.float32, copy=True)
    dist.all_reduce(acc, group=pg)
    return acc.to(x.dtype)


@all_reduce.register_fake
def _(x: Tensor, group: str, world_size: int) -> Tensor:
    return torch.empty_like(x)


# ---- MXFP4 experts: dequantize the rows a step selected ---------------------------------
@torch.library.custom_op("k3::mxfp4_dequant", mutates_args=())
def mxfp4_dequant(weight: Tensor, scale: Tensor, layout: str) -> Tensor:
    """The bf16 values [..., N, K] of MXFP4 expert rows in ``layout``
    (``rewriter.model.layers.experts``): exact, E2M1 code times 2^(scale - 127)."""
    from rewriter.model.layers.experts import ExpertFormat

    return ExpertFormat("mxfp4", layout).dequant(weight, scale)


@mxfp4_dequant.register_fake
def _(weight: Tensor, scale: Tensor, layout: str) -> Tensor:
    *lead, a, b = weight.shape
    n, k = (a, 2 * b) if layout == "checkpoint" else (b // 2, 16 * a)
    return weight.new_empty((*lead, n, k), dtype=torch.bfloat16)


# ---- KDA: one token of each recurrence, shared by the loop references and the batched forms ----
def _conv_step(window: Tensor, x_t: Tensor, weight: Tensor, state_dtype: torch.dtype,
               out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The causal depthwise conv + SiLU of one token over its history ``window`` [..., C, W - 1]
    (fp32): the output, and the next window as the state stores it (rounded to its dtype)."""
    full = torch.cat([window, x_t.float().unsqueeze(-1)], dim=-1)  # [..., C, W]
    return torch.nn.functional.silu((full * weight).sum(-1)).to(out_dtype), full[..., 1:].to(state_dtype).float()


def _delta_step(s: Tensor, q_t: Tensor, k_t: Tensor, v_t: Tensor, g_t: Tensor, beta_t: Tensor
                ) -> tuple[Tensor, Tensor]:
    """One token of the gated delta rule on fp32 states [..., H, V, K]: S = S * exp(g);
    S += beta (v - S k) k^T; o = S q. Returns the new state and o (fp32)."""
    s = s * torch.exp(g_t.float()).unsqueeze(-2)
    k_t = k_t.float()
    delta = (v_t.float() - torch.einsum("...vk,...k->...v", s, k_t)) * beta_t.float().unsqueeze(-1)
    s = s + torch.einsum("...v,...k->...vk", delta, k_t)
    return s, torch.einsum("...vk,...k->...v", s, q_t.float())


# ---- KDA: short convolution decode step ----------------------------------------------
@torch.library.custom_op("k3::kda_conv_update", mutates_args=("conv_state",))
def kda_conv_update(x: Tensor, conv_state: Tensor, weight: Tensor, state_indices: Tensor) -> Tensor:
    """Causal depthwise conv + SiLU over one new token per step, updating the state in place.

    x: [T, C]; conv_state: [slots, C, K-1] (oldest first); weight: [C, K];
    state_indices: [B]. Returns [T, C] in x's dtype.
    """
    num_tokens = x.shape[0]
    q_len = _tokens_per_request(num_tokens, state_indices.shape[0], "k3::kda_conv_update")
    out = torch.zeros_like(x)
    w = weight.float()
    for b, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue
        window = conv_state[slot].float()  # [C, K-1]
        for j in range(q_len):
            t = b * q_len + j
            # the state holds the stored (rounded) inputs, as a bf16 conv state does
            out[t], window = _conv_step(window, x[t], w, conv_state.dtype, x.dtype)
        conv_state[slot] = window.to(conv_state.dtype)
    return out


@kda_conv_update.register_fake
def _(x: Tensor, conv_state: Tensor, weight: Tensor, state_indices: Tensor) -> Tensor:
    return torch.empty_like(x)


def _slots(state_indices: Tensor) -> tuple[Tensor, Tensor]:
    """(slot per request with padding rows sent to slot 0, mask of real rows: index > 0)."""
    valid = state_indices > 0
    return torch.where(valid, state_indices, 0).long(), valid


@kda_conv_update.register_kernel("cuda")
def conv_update_batched(x: Tensor, conv_state: Tensor, weight: Tensor, state_indices: Tensor) -> Tensor:
    """``kda_conv_update`` for all requests at once (no host sync); padding rows write slot 0's
    own values back (vLLM's null block, which belongs to no request)."""
    batch = state_indices.shape[0]
    q_len = _tokens_per_request(x.shape[0], batch, "k3::kda_conv_update")
    slots, valid = _slots(state_indices)
    old = conv_state.index_select(0, slots)  # [B, C, K-1]
    window, w = old.float(), weight.float()
    xs = x.view(batch, q_len, -1)
    outs = []
    for j in range(q_len):
        y, window = _conv_step(window, xs[:, j], w, conv_state.dtype, x.dtype)
        outs.append(y)
    keep = valid.view(-1, 1, 1)
    conv_state.index_copy_(0, slots, torch.where(keep, window.to(conv_state.dtype), old))
    return (torch.stack(outs, dim=1) * keep).view_as(x)


# ---- KDA: gated delta-rule recurrent decode step -----------------------------------
@torch.library.custom_op("k3::kda_recurrent_step", mutates_args=("state",))
def kda_recurrent_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, state_indices: Tensor
) -> Tensor:
    """One delta-rule update per token with a per-channel decay, state updated in place.

    q, k: [T, H, K] fp32 (q already normalized and scaled, k normalized);
    v: [T, H, V]; g: [T, H, K] log decay (<= 0); beta: [T, H] write strength;
    state: [slots, H, V, K] fp32; state_indices: [B]. For each token:
    S = S * exp(g); S += beta * (v - S k) k^T; o = S q. Returns [T, H, V] in v's dtype.
    """
    num_tokens = q.shape[0]
    q_len = _tokens_per_request(num_tokens, state_indices.shape[0], "k3::kda_recurrent_step")
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for b, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue
        s = state[slot].float()  # [H, V, K]
        for j in range(q_len):
            t = b * q_len + j
            s, o = _delta_step(s, q[t], k[t], v[t], g[t], beta[t])
            out[t] = o.to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out


@kda_recurrent_step.register_kernel("cuda")
def _recurrent_step_batched(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                            state_indices: Tensor) -> Tensor:
    """``kda_recurrent_step`` for all requests at once (no host sync); padding rows as in
    ``conv_update_batched``."""
    batch = state_indices.shape[0]
    q_len = _tokens_per_request(q.shape[0], batch, "k3::kda_recurrent_step")
    slots, valid = _slots(state_indices)
    old = state.index_select(0, slots)  # [B, H, V, K]
    s = old.float()
    shape = (batch, q_len) + tuple(q.shape[1:])
    qs, ks, gs = q.float().view(shape), k.float().view(shape), g.float().view(shape)
    vs, bs = v.float().view((batch, q_len) + tuple(v.shape[1:])), beta.float().view(batch, q_len, -1)
    outs = []
    for j in range(q_len):
        s, o = _delta_step(s, qs[:, j], ks[:, j], vs[:, j], gs[:, j], bs[:, j])
        outs.append(o.to(v.dtype))
    keep = valid.view(-1, 1, 1, 1)
    state.index_copy_(0, slots, torch.where(keep, s.to(state.dtype), old))
    return (torch.stack(outs, dim=1) * keep.view(-1, 1, 1, 1)).view_as(v)


@kda_recurrent_step.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, state_indices: Tensor) -> Tensor:
    return torch.empty_like(v)


# ---- KDA: speculative verify steps (vLLM 0.33's multi-slot contract, docs/SPECULATIVE.md) ----
def _verify_requests(num_tokens: int, spec_state_indices: Tensor, num_accepted: Tensor, op: str) -> tuple[int, int]:
    """(requests, tokens per request) of a verify step, or an error naming what does not fit."""
    if spec_state_indices.dim() != 2:
        raise ValueError(f"{op}: spec_state_indices must be [requests, q], got {list(spec_state_indices.shape)}")
    batch, q_len = spec_state_indices.shape
    if num_tokens != batch * q_len:
        raise ValueError(f"{op}: {num_tokens} tokens are not {batch} requests x {q_len}")
    if tuple(num_accepted.shape) != (batch,):
        raise ValueError(f"{op}: num_accepted must be [{batch}], got {list(num_accepted.shape)}")
    return batch, q_len


def _accepted(a: int, q_len: int, op: str) -> int:
    if not 1 <= a <= q_len:
        raise ValueError(f"{op}: num_accepted {a} outside 1..{q_len} (the previous step's accepted tokens + 1)")
    return a


@torch.library.custom_op("k3::kda_conv_verify", mutates_args=("conv_state",))
def kda_conv_verify(x: Tensor, conv_state: Tensor, weight: Tensor, spec_state_indices: Tensor,
                    num_accepted: Tensor) -> Tensor:
    """The causal depthwise conv + SiLU over a verify step's q tokens per request, vLLM's way.

    x: [B * q, C]; conv_state: [slots, C, W - 1 + k] (oldest first, k >= q - 1 speculative
    rows); weight: [C, W]; spec_state_indices: [B, q], the conv state in column 0's slot;
    num_accepted: [B], a = the previous step's accepted tokens + 1. The history is rows
    a - 1 .. a + W - 3. Afterwards rows 0 .. W - 3 hold the old rows a .. a + W - 3 and rows
    W - 2 .. W - 3 + q this step's inputs (as stored), so the next step, accepting a', finds the
    history ending at its token a' - 1 in rows a' - 1 .. a' + W - 3. A slot <= 0 (padding) is
    neither read nor written; its outputs are zero. Returns [B * q, C] in x's dtype.
    """
    op = "k3::kda_conv_verify"
    batch, q_len = _verify_requests(x.shape[0], spec_state_indices, num_accepted, op)
    hist = weight.shape[1] - 1
    if conv_state.shape[-1] < hist - 1 + q_len:
        raise ValueError(f"{op}: the conv state holds {conv_state.shape[-1]} rows; a verify of {q_len} tokens "
                         f"needs {hist - 1 + q_len} (W - 2 + q)")
    out = torch.zeros_like(x)
    w = weight.float()
    for b, (slot, a) in enumerate(zip(spec_state_indices[:, 0].tolist(), num_accepted.tolist())):
        if slot <= 0:
            continue
        a = _accepted(a, q_len, op)
        old = conv_state[slot].clone()  # [C, rows]
        window = old[:, a - 1:a - 1 + hist].float()
        for j in range(q_len):
            t = b * q_len + j
            out[t], window = _conv_step(window, x[t], w, conv_state.dtype, x.dtype)
        conv_state[slot, :, :hist - 1] = old[:, a:a + hist - 1]
        conv_state[slot, :, hist - 1:hist - 1 + q_len] = x[b * q_len:(b + 1) * q_len].t().to(conv_state.dtype)
    return out


@kda_conv_verify.register_kernel("cuda")
def conv_verify_batched(x: Tensor, conv_state: Tensor, weight: Tensor, spec_state_indices: Tensor,
                        num_accepted: Tensor) -> Tensor:
    """``kda_conv_verify`` for all requests at once (no host sync; accepted counts are not
    checked here, they index on the device): padding rows write slot 0's own rows back."""
    batch, q_len = _verify_requests(x.shape[0], spec_state_indices, num_accepted, "k3::kda_conv_verify")
    hist = weight.shape[1] - 1
    slots, valid = _slots(spec_state_indices[:, 0])
    old = conv_state.index_select(0, slots)  # [B, C, rows]
    first = (num_accepted.long().clamp(1, q_len) - 1).view(-1, 1, 1)

    def rows(start: Tensor, n: int) -> Tensor:  # each request's rows start .. start + n - 1
        return (start + torch.arange(n, device=x.device)).expand(batch, old.shape[1], n)

    window, w = old.gather(2, rows(first, hist)).float(), weight.float()
    xs = x.view(batch, q_len, -1)
    outs = []
    for j in range(q_len):
        y, window = _conv_step(window, xs[:, j], w, conv_state.dtype, x.dtype)
        outs.append(y)
    new = old.clone()
    new[..., :hist - 1] = old.gather(2, rows(first + 1, hist - 1))
    new[..., hist - 1:hist - 1 + q_len] = xs.transpose(1, 2).to(conv_state.dtype)
    keep = valid.view(-1, 1, 1)
    conv_state.index_copy_(0, slots, torch.where(keep, new, old))
    return (torch.stack(outs, dim=1) * keep).view_as(x)


@kda_conv_verify.register_fake
def _(x: Tensor, conv_state: Tensor, weight: Tensor, spec_state_indices: Tensor, num_accepted: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("k3::kda_recurrent_verify", mutates_args=("state",))
def kda_recurrent_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                         spec_state_indices: Tensor, num_accepted: Tensor) -> Tensor:
    """The delta-rule recurrence over a verify step's q tokens per request, vLLM's way.

    Shapes as ``kda_recurrent_step`` with T = B * q; spec_state_indices: [B, q] (each request's
    q state slots); num_accepted: [B] (a). The state is read from slot column a - 1 (the state
    after the last accepted token; <= 0: a padding row, outputs zero, nothing written) and token
    t's state is written to column t (where that slot is > 0), so the next step continues from
    any accepted length. Returns [B * q, H, V] in v's dtype.
    """
    op = "k3::kda_recurrent_verify"
    batch, q_len = _verify_requests(q.shape[0], spec_state_indices, num_accepted, op)
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for b, (slots, a) in enumerate(zip(spec_state_indices.tolist(), num_accepted.tolist())):
        source = slots[_accepted(a, q_len, op) - 1]
        if source <= 0:
            continue
        s = state[source].float()  # [H, V, K], read before column a - 1 is written
        for j in range(q_len):
            t = b * q_len + j
            s, o = _delta_step(s, q[t], k[t], v[t], g[t], beta[t])
            out[t] = o.to(v.dtype)
            if slots[j] > 0:
                state[slots[j]] = s.to(state.dtype)
                s = state[slots[j]].float()  # the next token continues from the stored state
    return out


@kda_recurrent_verify.register_kernel("cuda")
def recurrent_verify_batched(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                             spec_state_indices: Tensor, num_accepted: Tensor) -> Tensor:
    """``kda_recurrent_verify`` for all requests at once (no host sync): every request's initial
    state is gathered before any is written; a slot <= 0 writes slot 0's own state back."""
    batch, q_len = _verify_requests(q.shape[0], spec_state_indices, num_accepted, "k3::kda_recurrent_verify")
    first = (num_accepted.long().clamp(1, q_len) - 1).view(-1, 1)
    source, valid = _slots(spec_state_indices.gather(1, first).view(-1))
    targets, writes = _slots(spec_state_indices.flatten())
    s = state.index_select(0, source).float()  # [B, H, V, K]
    before = state.index_select(0, targets)  # what a padding column writes back
    shape = (batch, q_len) + tuple(q.shape[1:])
    qs, ks, gs = q.float().view(shape), k.float().view(shape), g.float().view(shape)
    vs, bs = v.float().view((batch, q_len) + tuple(v.shape[1:])), beta.float().view(batch, q_len, -1)
    outs, states = [], []
    for j in range(q_len):
        s, o = _delta_step(s, qs[:, j], ks[:, j], vs[:, j], gs[:, j], bs[:, j])
        s = s.to(state.dtype).float()  # the next token continues from the stored state
        outs.append(o.to(v.dtype))
        states.append(s.to(state.dtype))
    keep = (writes.view(batch, q_len) & valid.view(-1, 1)).flatten().view(-1, 1, 1, 1)
    state.index_copy_(0, targets, torch.where(keep, torch.stack(states, dim=1).flatten(0, 1), before))
    return (torch.stack(outs, dim=1) * valid.view(-1, 1, 1, 1)).view_as(v)


@kda_recurrent_verify.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, spec_state_indices: Tensor,
      num_accepted: Tensor) -> Tensor:
    return torch.empty_like(v)


# ---- MLA: latent cache insert and decode attention -------------------------------
FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)  # vLLM keeps a per-tensor fp8 cache as uint8


def cache_is_fp8(kv_cache: Tensor) -> bool:
    return kv_cache.dtype in FP8_CACHE_DTYPES


def _cache_values(entries: Tensor, kv_scale: Tensor) -> Tensor:
    """Cache entries as fp32: bf16 as stored; fp8 E4M3 times the per-tensor scale (vLLM's ``_k_scale``)."""
    if cache_is_fp8(entries):
        return entries.view(torch.float8_e4m3fn).float() * kv_scale.float().reshape(())
    return entries.float()


E4M3_MAX = 448.0


def _to_cache(entry: Tensor, kv_cache: Tensor, kv_scale: Tensor) -> Tensor:
    """Values as the cache stores them: bf16, or fp8 E4M3 of value / scale (in the cache's own
    dtype), saturated at +-448 as vLLM's cache writes are (``__NV_SATFINITE``; torch's own cast
    would make NaN of them)."""
    if cache_is_fp8(kv_cache):
        scaled = (entry.float() / kv_scale.float().reshape(())).clamp(-E4M3_MAX, E4M3_MAX)
        return scaled.to(torch.float8_e4m3fn).view(kv_cache.dtype)
    return entry.to(kv_cache.dtype)


@torch.library.custom_op("k3::mla_cache_insert", mutates_args=("kv_cache",))
def mla_cache_insert(kv_cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_scale: Tensor) -> None:
    """Write each token's latent [kv_c | k_pe] into ``kv_cache`` at its slot.

    kv_cache: [num_blocks, block_size, L + R], bf16 or fp8 E4M3 (uint8 storage, as vLLM's
    ``--kv-cache-dtype fp8``) holding value / ``kv_scale`` (fp32 [1], vLLM's ``_k_scale``;
    unused for bf16); a contiguous [B, S, L + R] cache is the case block_size = S;
    slot = block * block_size + offset; negative slots (padding tokens) are skipped.
    """
    block_size = kv_cache.shape[1]
    entry = _to_cache(torch.cat([kv_c, k_pe], dim=-1), kv_cache, kv_scale)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[slot // block_size, slot % block_size] = entry[t]


@mla_cache_insert.register_kernel("cuda")
def _cache_insert_batched(kv_cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor,
                          kv_scale: Tensor) -> None:
    """``mla_cache_insert`` with no host sync: padding tokens write slot 0's own entry back
    (block 0 is vLLM's null block)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, 0).long()
    entry = _to_cache(torch.cat([kv_c, k_pe], dim=-1), kv_cache, kv_scale)
    flat.index_copy_(0, slots, torch.where(valid.unsqueeze(-1), entry, flat.index_select(0, slots)))


@mla_cache_insert.register_fake
def _(kv_cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_scale: Tensor) -> None:
    return None


@torch.library.custom_op("k3::mla_decode", mutates_args=())
def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor | None, seq_lens: Tensor, kv_scale: Tensor,
               scale: float, kv_lora_rank: int) -> Tensor:
    """Multi-query attention of absorbed queries over the latent cache.

    q: [T, H, L + R]; kv_cache: paged [num_blocks, block_size, L + R] with
    block_table [B, max_blocks], or contiguous [B, S, L + R] with block_table None; bf16,
    or fp8 E4M3 read as stored value x ``kv_scale``; seq_lens: [B] cached tokens per
    request, the current step's tokens included (0: a padding request, output 0).
    Token j of a request with q_len tokens sees positions 0 .. seq_len - q_len + j.
    Scores are q . entry (all L + R values), values are the first L (kv_c) of each
    entry. Returns [T, H, L] in q's dtype.
    """
    num_tokens, heads, _ = q.shape
    q_len = _tokens_per_request(num_tokens, seq_lens.shape[0], "k3::mla_decode")
    out = torch.zeros(num_tokens, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        if block_table is None:
            entries = kv_cache[b, :seq_len]
        else:
            block_size = kv_cache.shape[1]
            n_blocks = -(-seq_len // block_size)
            entries = kv_cache[block_table[b, :n_blocks].long()].reshape(-1, kv_cache.shape[-1])[:seq_len]
        entries = _cache_values(entries, kv_scale)  # [S, L + R] fp32
        for j in range(q_len):
            t = b * q_len + j
            visible = seq_len - q_len + j + 1
            scores = (q[t].float() @ entries[:visible].T) * scale  # [H, visible]
            probs = torch.softmax(scores, dim=-1)
            out[t] = (probs @ entries[:visible, :kv_lora_rank]).to(q.dtype)
    return out


@mla_decode.register_kernel("cuda")
def _decode_batched(q: Tensor, kv_cache: Tensor, block_table: Tensor | None, seq_lens: Tensor, kv_scale: Tensor,
                    scale: float, kv_lora_rank: int) -> Tensor:
    """``mla_decode`` for all requests at once (no host sync, so it captures in a CUDA graph): each
    request's whole block table gathered, positions past what a token sees masked."""
    num_tokens, heads, _ = q.shape
    batch = seq_lens.shape[0]
    q_len = _tokens_per_request(num_tokens, batch, "k3::mla_decode")
    if block_table is None:
        entries = kv_cache
    else:
        entries = kv_cache[block_table.long().clamp_min(0)].flatten(1, 2)  # [B, blocks x block_size, L + R]
    entries = _cache_values(entries, kv_scale)
    qs = q.float().view(batch, q_len, heads, -1)
    scores = torch.einsum("bjhe,bse->bjhs", qs, entries) * scale
    pos = torch.arange(entries.shape[1], device=q.device)
    visible = seq_lens.long().view(-1, 1) - q_len + 1 + torch.arange(q_len, device=q.device)  # [B, q]
    mask = pos.view(1, 1, -1) < visible.unsqueeze(-1)  # [B, q, S]
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a padding request (length 0) sees nothing
    out = torch.einsum("bjhs,bsl->bjhl", probs, entries[..., :kv_lora_rank])
    return out.reshape(num_tokens, heads, kv_lora_rank).to(q.dtype)


@mla_decode.register_fake
def _(q: Tensor, kv_cache: Tensor, block_table: Tensor | None, seq_lens: Tensor, kv_scale: Tensor, scale: float,
      kv_lora_rank: int) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)


def gather_last_dim(x: Tensor, group: str, world_size: int) -> Tensor:
    """Concatenate every rank's ``x`` along the last dim, rank order (no-op at world size 1).

    Used inside fused ops that split a replicated GEMM across ranks; a traced reference holds it
    as ``k3::gather_last_dim`` (the lowering runs a result's gather as the host's collective).
    """
    if world_size == 1:
        return x
    return torch.ops.k3.gather_last_dim(x, group, world_size)


@torch.library.custom_op("k3::gather_last_dim", mutates_args=())
def _gather_last_dim(x: Tensor, group: str, world_size: int) -> Tensor:
    """One collective into one [world, ...] buffer, then one copy to put the ranks' pieces side
    by side (none for a single row): NCCL's list form of all_gather copies each rank's piece out
    of its own flat buffer, and a ``cat`` after it made world size + 1 copy kernels a call (51 a
    layer at TP 16)."""
    if _EXCLUDED[0]:
        return x.repeat(*([1] * (x.dim() - 1)), world_size)
    pg = _GROUPS.get(group)
    if pg is None:
        raise RuntimeError(f"gather_last_dim: no process group registered as {group!r}")
    x = x.contiguous()
    if _coordinator(pg):
        return pg.all_gather(x, dim=-1)
    gathered = x.new_empty((world_size * x.shape[0], *x.shape[1:]))  # ranks along dim 0 (gloo takes no stack)
    _ALL_GATHER_SINGLE(gathered, x, group=pg)
    stacked = gathered.view(world_size, *x.shape)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], world_size * x.shape[-1])


@_gather_last_dim.register_fake
def _(x: Tensor, group: str, world_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], world_size * x.shape[-1]))
