"""One rewritten decode step over vLLM's backbone: the layer loop, with per-layer fallback.

The loop mirrors vLLM's ``KimiLinearModel.forward`` for AttnRes models (embedding as the
first prefix sum, a fresh block buffer, then every layer, then the final AttnRes). Each
layer runs its program for this batch size if it has one, else vLLM's own layer forward;
both take and return (hidden, prefix sum, blocks), so they mix freely.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rewriter.vllm.programs import ProgramSet


def layer_name(attention: nn.Module) -> str | None:
    return getattr(attention, "prefix", None) or getattr(attention, "layer_name", None)


def kda_state(attention: nn.Module, metadata: Any, num_tokens: int) -> tuple[torch.Tensor, ...]:
    """(conv_state [slots, C, K-1], recurrent_state [slots, H, V, K], state_indices [B]) from vLLM."""
    conv, recurrent = attention.kv_cache[:2]
    if conv.shape[-1] != attention.conv_size - 1:  # vLLM may keep the conv state width-major
        conv = conv.transpose(-1, -2)
    indices = metadata.non_spec_state_indices_tensor
    if indices is None:
        raise ValueError(f"{layer_name(attention)}: KDA metadata has no decode state indices")
    return conv, recurrent, indices[:num_tokens]


def mla_state(attention: nn.Module, metadata: Any, slot_mapping: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, ...]:
    """(kv_cache [blocks, block_size, 576], block_table, seq_lens, slot_mapping) from vLLM."""
    decode = metadata.decode
    if decode is None:
        raise ValueError(f"{layer_name(attention)}: MLA metadata has no decode part")
    return attention.kv_cache, decode.block_table, decode.seq_lens, slot_mapping[:num_tokens]


def state_inputs(vllm_layer: nn.Module, context: Any, num_tokens: int) -> tuple[torch.Tensor, ...]:
    attention = vllm_layer.self_attn
    name = layer_name(attention)
    metadata = context.attn_metadata[name]
    if hasattr(metadata, "non_spec_state_indices_tensor"):
        return kda_state(attention, metadata, num_tokens)
    return mla_state(attention, metadata, context.slot_mapping[name], num_tokens)


def run_layers(layers: list[nn.Module], programs: ProgramSet, positions: torch.Tensor, embeddings: torch.Tensor,
               num_blocks: int, context: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(last MLP output, prefix sum, blocks) after every layer, each by program or stock."""
    tokens = embeddings.shape[0]
    prefix = embeddings
    blocks = embeddings.new_empty(tokens, num_blocks, embeddings.shape[1])
    hidden = None
    for i, layer in enumerate(layers):
        program = programs.get(getattr(layer, "layer_idx", i), tokens)
        if program is None:
            hidden, prefix, blocks = layer(positions=positions, hidden_states=hidden, residual=blocks,
                                           prefix_sum=prefix)
        else:
            inputs = (prefix if hidden is None else hidden, prefix, blocks,
                      *state_inputs(layer, context, tokens))
            hidden, prefix, blocks = program(*inputs)
    return hidden, prefix, blocks
