"""One rewritten decode step over vLLM's backbone: the layer loop, with per-layer fallback, on
one pipeline stage.

The loop mirrors vLLM's ``KimiLinearModel.forward`` for AttnRes models: the first stage takes
the embeddings as the first prefix sum and a fresh block buffer; a later stage takes the
previous stage's ``IntermediateTensors`` (``hidden_states``: the AttnRes stream at the
boundary, the prefix sum with the last layer's pending output added; ``residual``: the blocks
written so far, ``cdiv(start_layer, block_size)`` of them) into a buffer of its own
``cdiv(end_layer, block_size)`` blocks. Then every layer of the stage, each by its program for
this batch size if it has one, else vLLM's own layer forward (both take and return (hidden,
prefix sum, blocks), so they mix freely); then a stage that is not the last hands the same
two tensors on, and the last applies the final AttnRes.

Speculative methods that draft from the target's hidden states (DSpark, EAGLE-3: vLLM sets the
backbone's ``aux_hidden_state_layers``) also get the AttnRes stream entering each of those
layers, taken by the backbone's own ``_capture_aux_hidden_stream`` as its forward takes it: on
the last stage returned beside the hidden state (with the earlier stages' streams first), on
the others packed into the intermediate tensors under vLLM's keys.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rewriter.vllm.programs import ProgramSet
from rewriter.vllm.state import state_inputs

AuxHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (layer_idx, prefix, hidden, blocks)


def run_layers(layers: list[nn.Module], programs: ProgramSet, positions: torch.Tensor, prefix: torch.Tensor,
               blocks: torch.Tensor, context: Any, aux: AuxHook | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(last MLP output, prefix sum, blocks) after every layer, each by program or stock, from
    the stage's first prefix sum and its block buffer; ``aux(layer_idx, prefix, hidden, blocks)``
    is called after each layer (the aux hidden streams)."""
    tokens = prefix.shape[0]
    hidden = None
    for i, layer in enumerate(layers):
        idx = getattr(layer, "layer_idx", i)
        program = programs.get(idx, tokens)
        if program is None:
            hidden, prefix, blocks = layer(positions=positions, hidden_states=hidden, residual=blocks,
                                           prefix_sum=prefix)
        else:
            inputs = (prefix if hidden is None else hidden, prefix, blocks,
                      *state_inputs(layer, context, tokens, programs.q))
            hidden, prefix, blocks = program(*inputs)
        if aux is not None:
            aux(idx, prefix, hidden, blocks)
    return hidden, prefix, blocks


def stage_inputs(backbone: nn.Module, embeddings: torch.Tensor | None, intermediate: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first prefix sum, block buffer) of this stage: from the embeddings on the first stage,
    else from the previous stage's intermediate tensors (their blocks copied to the front)."""
    prefix = embeddings if intermediate is None else intermediate["hidden_states"]
    blocks = prefix.new_empty(prefix.shape[0], backbone.num_attn_res_blocks, prefix.shape[1])
    if intermediate is not None:
        carried = intermediate["residual"]
        blocks[:, :carried.shape[1]].copy_(carried)
    return prefix, blocks


def run_stage(backbone: nn.Module, programs: ProgramSet, positions: torch.Tensor, embeddings: torch.Tensor | None,
              intermediate: Any, context: Any, last: bool) -> Any:
    """This stage's part of a decode step (``embeddings`` on the first stage, ``intermediate``
    on the others): the final hidden state on the last stage, else vLLM's ``IntermediateTensors``
    for the next one."""
    layers = list(backbone.layers[backbone.start_layer:backbone.end_layer])
    prefix, blocks = stage_inputs(backbone, embeddings, intermediate)
    wanted = set(backbone.aux_hidden_state_layers)
    streams: list[torch.Tensor] = []
    if wanted and intermediate is None and backbone.start_layer in wanted:
        streams.append(prefix)  # the embeddings enter the stage's first layer

    def aux(idx: int, prefix: torch.Tensor, hidden: torch.Tensor, blocks: torch.Tensor) -> None:
        if idx + 1 in wanted:
            streams.append(backbone._capture_aux_hidden_stream(idx, prefix, hidden, blocks))

    hidden, prefix, blocks = run_layers(layers, programs, positions, prefix, blocks, context, aux if wanted else None)
    if not last:
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({"hidden_states": hidden + prefix, "residual": blocks,
                                    **backbone.pack_local_aux_hidden_states(streams)})
    # the module, looked up at call time (its package exports the function under the same name)
    attn_res_ops = importlib.import_module("vllm.models.kimi_k3.nvidia.ops.attn_res")
    out = attn_res_ops.attn_res(prefix, hidden, blocks, backbone.output_attn_res_norm.weight,
                                backbone.output_attn_res_proj.weight.squeeze(0), None,
                                num_blocks=backbone.num_attn_res_blocks, block_write_idx=-1,
                                eps=backbone.output_attn_res_norm.variance_epsilon, output_norm_eps=0.0)
    streams = backbone.collect_remote_aux_hidden_states(intermediate) + streams  # the earlier stages' first
    return (out, streams) if streams else out
