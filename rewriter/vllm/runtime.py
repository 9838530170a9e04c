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
from rewriter.vllm.state import state_inputs


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
