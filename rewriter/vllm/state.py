"""Read vLLM's KV cache, KDA state and decode metadata as the reference layers' inputs.

Views only, never copies: the programs update vLLM's own state in place, as its kernels do.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def layer_name(attention: nn.Module) -> str | None:
    return getattr(attention, "prefix", None) or getattr(attention, "layer_name", None)


def cache_tensors(vllm_layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's KV cache / KDA state as vLLM bound it, as views under the names of the
    reference layer's inputs: KDA ``conv_state`` [slots, C, rows] (a transposed view in vLLM's
    default "SD" layout, read from vLLM's own flag: rows are K - 1, or K - 1 + k with k
    speculative tokens, so the shape cannot tell) and ``recurrent_state`` [slots, H, V, K]; MLA
    ``kv_cache`` [blocks, block_size, 576] (bf16, or fp8 as uint8) and ``kv_scale`` (its
    ``_k_scale``, a [1] view). Slots are vLLM's pages: not contiguous across slots."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    attention = vllm_layer.self_attn
    if hasattr(attention, "conv_size"):
        conv, recurrent = attention.kv_cache[:2]
        if not is_conv_state_dim_first():  # "SD", vLLM's default: [rows, C] per slot
            conv = conv.transpose(-1, -2)
        return {"conv_state": conv, "recurrent_state": recurrent}
    scale = getattr(attention, "_k_scale", None)
    if scale is None:
        raise ValueError(f"{layer_name(attention)}: the MLA layer has no _k_scale (its KV cache scale)")
    return {"kv_cache": attention.kv_cache, "kv_scale": scale.reshape(1)}


def kda_state(vllm_layer: nn.Module, metadata: Any, num_tokens: int, q: int = 1) -> tuple[torch.Tensor, ...]:
    """(conv_state, recurrent_state, state_indices [B]) from vLLM's state and metadata; for a verify
    step of ``q`` tokens per request (B = num_tokens // q requests) also ``num_accepted`` [B], with
    ``state_indices`` [B, q] each request's q state slots (``spec_state_indices_tensor``)."""
    caches = cache_tensors(vllm_layer)
    if q == 1:
        indices = metadata.non_spec_state_indices_tensor
        if indices is None:
            raise ValueError(f"{layer_name(vllm_layer.self_attn)}: KDA metadata has no decode state indices")
        return caches["conv_state"], caches["recurrent_state"], indices[:num_tokens]
    slots, accepted = metadata.spec_state_indices_tensor, metadata.num_accepted_tokens
    if slots is None or accepted is None:
        raise ValueError(f"{layer_name(vllm_layer.self_attn)}: KDA metadata of a verify step has no "
                         "spec_state_indices_tensor or num_accepted_tokens")
    requests = num_tokens // q
    return caches["conv_state"], caches["recurrent_state"], slots[:requests], accepted[:requests]


def mla_state(vllm_layer: nn.Module, metadata: Any, slot_mapping: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, ...]:
    """(kv_cache, block_table, seq_lens, slot_mapping, kv_scale) from vLLM's cache and metadata: the
    decode part's rows (one per request; a verify step's requests are decodes too, their seq_lens
    counting the step's tokens) and a slot per token."""
    decode = metadata.decode
    if decode is None:
        raise ValueError(f"{layer_name(vllm_layer.self_attn)}: MLA metadata has no decode part")
    caches = cache_tensors(vllm_layer)
    return caches["kv_cache"], decode.block_table, decode.seq_lens, slot_mapping[:num_tokens], caches["kv_scale"]


def state_inputs(vllm_layer: nn.Module, context: Any, num_tokens: int, q: int = 1) -> tuple[torch.Tensor, ...]:
    """The state inputs of a layer's program for a step of ``num_tokens`` tokens, ``q`` per request."""
    attention = vllm_layer.self_attn
    name = layer_name(attention)
    metadata = context.attn_metadata[name]
    if hasattr(metadata, "non_spec_state_indices_tensor"):
        return kda_state(vllm_layer, metadata, num_tokens, q)
    return mla_state(vllm_layer, metadata, context.slot_mapping[name], num_tokens)
