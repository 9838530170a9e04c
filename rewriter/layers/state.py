"""Decode inputs for a layer at a DecodeShape: activations, AttnRes buffers and attention state.

Laid out as vLLM lays them out: KDA state per slot (conv state dim-first), state
indices per request; MLA latent cache in pages of ``block_size`` tokens with a block
table, cached lengths and the slots of this step's tokens. On the meta device only
shapes are made; elsewhere values are random (and indices a random permutation, so a
layer that ignored the indirection would fail).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from rewriter.layers.decoder import KimiDecoderLayer
from rewriter.layers.sharding import REPLICATED, Piece, Sharding
from rewriter.shape import DecodeShape, ShapeError


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
        slots = batch + 1  # slot 0 stays unused, as vLLM reserves it
        shapes = attn.state_shapes(slots, dtype)
        (conv_shape, conv_dtype), (rec_shape, rec_dtype) = shapes["conv_state"], shapes["recurrent_state"]
        inputs["conv_state"] = randn(*conv_shape, dt=conv_dtype)
        inputs["recurrent_state"] = randn(*rec_shape, dt=rec_dtype, scale=0.1)
        inputs["state_indices"] = index(perm(batch) + 1)
    else:
        bs, seq_len = shape.block_size, shape.seq_len
        pages = math.ceil(seq_len / bs)
        num_blocks = batch * pages + 1
        table = perm(batch * pages).view(batch, pages) + 1  # page 0 unused
        inputs["kv_cache"] = randn(num_blocks, bs, cfg.mla_cache_entry)
        inputs["block_table"] = index(table)
        inputs["seq_lens"] = index(torch.full((batch,), seq_len))
        pos = torch.arange(shape.context, seq_len)  # this step's tokens
        slots = table.gather(1, (pos // bs).expand(batch, -1)) * bs + pos % bs
        inputs["slot_mapping"] = index(slots.reshape(-1))
    return inputs


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
    return OrderedDict((name, cuts.get(name, REPLICATED).local(t, layer.tp, layer.rank).clone())
                       for name, t in full.items())
