"""Weights for the reference layers: random initialization and TP sharding of full weights.

Random weights are scaled so activations stay O(1) through a layer (tests compare
outputs by relative error, which means nothing on vanishing or exploding values).
``shard_state_dict`` cuts a TP 1 layer's weights into rank ``rank``'s, as vLLM's
weight loaders do, so a TP 2/4 run can be checked against TP 1 on the same weights.
"""
from __future__ import annotations

import math

import torch

from rewriter.model.layers.decoder import KimiDecoderLayer
from rewriter.model.layers.sharding import zero_padding_


def _random_like(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    shape, leaf = p.shape, name.rsplit(".", 2)
    def randn(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=g.device) * scale

    if name.endswith("A_log"):
        return torch.empty(shape, device=g.device).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("dt_bias"):
        return randn(0.5)
    if name.endswith("conv1d.weight"):
        return randn(0.5)
    if name.endswith("e_score_correction_bias"):
        return randn(0.05)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + randn(0.1)
    if name.endswith("res_proj.weight"):
        return randn(1.0 / math.sqrt(shape[-1]))
    if len(shape) == 2:  # linear weights [out, in]
        return randn(1.0 / math.sqrt(shape[-1]))
    raise ValueError(f"no random initialization rule for parameter {'.'.join(leaf)} {tuple(shape)}")


@torch.no_grad()
def init_random_(layer: KimiDecoderLayer, seed: int) -> KimiDecoderLayer:
    """Fill every parameter with seeded random values (padding rows stay zero), drawn on the
    layer's device (a full-size layer's experts initialize in seconds on a GPU)."""
    device = next(layer.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    shardings = layer.param_shardings()
    own = {}  # modules that draw their own parameters (the routed experts, in any format)
    for mod_name, mod in layer.named_modules():
        if hasattr(mod, "init_random_"):
            own.update({f"{mod_name}.{n}": mod for n, _ in mod.named_parameters()})
    for name, p in layer.named_parameters():
        if name in own:
            continue
        p.copy_(_random_like(name, p, g).to(p.dtype))
        zero_padding_(p, shardings[name], layer.tp)
    for mod in dict.fromkeys(own.values()):
        mod.init_random_(g)
    return layer


def shard_state_dict(full: dict[str, torch.Tensor], layer: KimiDecoderLayer) -> dict[str, torch.Tensor]:
    """Rank ``layer.rank``'s tensors cut from a TP 1 layer's ``state_dict`` (``full``)."""
    out = {}
    for name, sharding in layer.param_shardings().items():
        if name not in full:
            raise KeyError(f"full state dict has no parameter {name!r}")
        if sharding is None:
            raise ValueError(f"{name} ({layer.expert_format.name}) cannot be cut from a TP 1 tensor; "
                             "build the rank's layer and draw its weights (init_random_)")
        out[name] = sharding.local(full[name], layer.tp, layer.rank).contiguous()
    return out
