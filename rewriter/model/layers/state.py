"""Decode inputs for a layer at a DecodeShape: activations, AttnRes buffers and attention state.

Laid out as vLLM lays them out: KDA state in one page per slot (the conv state in the
shape's layout, then the recurrent state: neither contiguous across slots), state
indices per request (slot 0 is vLLM's null block, never a request's); MLA latent cache in
pages of ``block_size`` tokens with a block table, cached lengths and the slots of this
step's tokens. On the meta device only shapes are made; elsewhere values are random (and
indices a random permutation, so a layer that ignored the indirection would fail).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from rewriter.model.layers.decoder import KimiDecoderLayer
from rewriter.model.layers.sharding import REPLICATED, Piece, Sharding
from rewriter.model.shape import DecodeShape, ShapeError


def decode_inputs(layer: KimiDecoderLayer, shape: DecodeShape, device: str | torch.device = "meta",
                  seed: int | None = None) -> OrderedDict[str, torch.Tensor]:
    """The layer's forward arguments, in order, for one decode step of ``shape``."""
    if shape.tp != layer.tp or shape.rank != layer.rank:
        raise ShapeError(f"shape is TP {shape.tp} rank {shape.rank} but the layer was built for "
                         f"TP {layer.tp} rank {layer.rank}")
    cfg, dev = layer.config, torch.device(device)
    meta = dev.type == "meta"
    g = None if meta else torch.Generator().manual_seed(0 if seed is None else seed)
    dtype, tokens, batch = shape.dtype, shape.tokens, shape.batch

    def randn(*size: int, dt: torch.dtype = dtype, scale: float = 1.0) -> torch.Tensor:
        if meta:
            return torch.empty(size, dtype=dt, device=dev)
        return (torch.randn(size, generator=g) * scale).to(dt).to(dev)

    def index(values: torch.Tensor) -> torch.Tensor:
        return torch.empty(values.shape, dtype=torch.int32, device=dev) if meta else values.to(torch.int32).to(dev)

    def perm(n: int) -> torch.Tensor:
        return torch.arange(n) if meta else torch.randperm(n, generator=g)

    inputs: OrderedDict[str, torch.Tensor] = OrderedDict(
        hidden_states=randn(tokens, cfg.hidden_size),
        prefix_sum=randn(tokens, cfg.hidden_size),
        blocks=randn(tokens, cfg.num_attn_res_blocks, cfg.hidden_size),
    )
    attn = layer.self_attn
    if layer.attention_kind == "kda":
        q = shape.q  # q > 1: a verify step, q state slots per request and q - 1 more conv rows
        slots = batch * q + 1  # slot 0 stays unused, as vLLM reserves it
        shapes = attn.state_shapes(slots, dtype, spec_rows=q - 1)
        (conv_shape, conv_dtype), (rec_shape, rec_dtype) = shapes["conv_state"], shapes["recurrent_state"]
        inputs["conv_state"], inputs["recurrent_state"] = kda_state_pages(
            randn(*conv_shape, dt=conv_dtype), randn(*rec_shape, dt=rec_dtype, scale=0.1), shape.conv_layout)
        if q == 1:
            inputs["state_indices"] = index(perm(batch) + 1)
        else:  # vLLM's spec_state_indices_tensor and num_accepted_tokens (previous step's accepted + 1)
            inputs["state_indices"] = index((perm(batch * q) + 1).view(batch, q))
            accepted = torch.ones(batch) if meta else torch.randint(1, q + 1, (batch,), generator=g)
            inputs["num_accepted"] = index(accepted)
    else:
        bs, seq_len = shape.block_size, shape.seq_len
        pages = math.ceil(seq_len / bs)
        num_blocks = batch * pages + 1
        table = perm(batch * pages).view(batch, pages) + 1  # page 0 unused
        if shape.kv_cache_dtype == "fp8":  # E4M3 in vLLM's uint8 storage, values / scale
            scale = torch.full((1,), 0.5 if meta else 0.25 + float(torch.rand(1, generator=g)), device=dev)
            values = randn(num_blocks, bs, cfg.mla_cache_entry, dt=torch.float32)
            inputs["kv_cache"] = (values / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            scale = torch.ones(1, device=dev)
            inputs["kv_cache"] = randn(num_blocks, bs, cfg.mla_cache_entry)
        inputs["block_table"] = index(table)
        inputs["seq_lens"] = index(torch.full((batch,), seq_len))
        pos = torch.arange(shape.context, seq_len)  # this step's tokens
        slots = table.gather(1, (pos // bs).expand(batch, -1)) * bs + pos % bs
        inputs["slot_mapping"] = index(slots.reshape(-1))
        inputs["kv_scale"] = scale  # vLLM's _k_scale (fp32 [1]; 1 and unused for a bf16 cache)
    return inputs


def kda_state_pages(conv_state: torch.Tensor, recurrent_state: torch.Tensor, layout: str, shared: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a KDA conv state [slots, C, K-1] and recurrent state [slots, H, V, K] laid out
    as vLLM's cache allocator lays them: one page per slot, the conv state first (``SD``:
    [K-1, C], ``DS``: [C, K-1]), then the recurrent state; returned as views in the reference
    layers' shapes, whose slot stride is the page. ``shared=False``: the same strides over two
    buffers (torch.compile cannot take in-place updates of views of one buffer in two dtypes)."""
    slots, channels, width = conv_state.shape
    conv_bytes = channels * width * conv_state.element_size()
    rec_bytes = recurrent_state[0].numel() * recurrent_state.element_size()
    page = -(-(conv_bytes + rec_bytes) // 16) * 16
    raw = torch.empty(slots * page, dtype=torch.uint8, device=conv_state.device)
    rec_raw = raw if shared else torch.empty_like(raw)
    conv_raw = raw.view(conv_state.dtype)
    conv_page = page // conv_state.element_size()
    if layout == "SD":
        conv = conv_raw.as_strided((slots, width, channels), (conv_page, channels, 1)).transpose(1, 2)
    elif layout == "DS":
        conv = conv_raw.as_strided((slots, channels, width), (conv_page, width, 1))
    else:
        raise ShapeError(f"conv state layout must be SD or DS, got {layout!r}")
    inner = torch.empty(recurrent_state.shape[1:], device="meta").stride()  # contiguous within a slot
    size = recurrent_state.element_size()
    rec = rec_raw.view(recurrent_state.dtype).as_strided(recurrent_state.shape, (page // size, *inner),
                                                     storage_offset=-(-conv_bytes // size))
    conv.copy_(conv_state)
    rec.copy_(recurrent_state)
    return conv, rec


def conv_layout_of(conv_state: torch.Tensor) -> str | None:
    """``SD`` or ``DS``: which way a [slots, C, K-1] conv state view keeps each slot's values
    contiguously ([K-1, C] or [C, K-1]); None when it does neither."""
    _, channels, width = conv_state.shape
    inner = tuple(conv_state.stride()[1:])
    return "SD" if inner == (1, channels) else "DS" if inner == (width, 1) else None


def state_shardings(layer: KimiDecoderLayer) -> dict[str, Sharding]:
    """How each decode-state tensor of a rank is cut from the TP 1 one.

    KDA state is per head (the conv state packs q, k, v channels, each split across
    ranks); the MLA latent cache is replicated, as are activations and indices.
    """
    if layer.attention_kind == "kda":
        full_proj = layer.config.kda_num_heads * layer.config.kda_head_dim
        return {"conv_state": Sharding(1, (Piece(full_proj),) * 3), "recurrent_state": Sharding(1)}
    return {}


def shard_decode_inputs(full: OrderedDict[str, torch.Tensor], layer: KimiDecoderLayer
                        ) -> OrderedDict[str, torch.Tensor]:
    """Rank ``layer.rank``'s decode inputs cut from TP 1 inputs (copies: ranks update state in place)."""
    cuts = state_shardings(layer)
    out = OrderedDict((name, cuts.get(name, REPLICATED).local(t, layer.tp, layer.rank).clone())
                      for name, t in full.items())
    if "conv_state" in out:  # a rank's own pages, in the layout of the full state
        out["conv_state"], out["recurrent_state"] = kda_state_pages(out["conv_state"], out["recurrent_state"],
                                                                    conv_layout_of(full["conv_state"]))
    return out
