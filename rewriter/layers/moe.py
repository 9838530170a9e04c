"""Kimi K3's MLPs: the latent MoE of layers 1..92 and the dense MLP of layer 0.

Follows vLLM 0.33.0 ``models/kimi_k3/nvidia/model.py`` (``KimiMoE``, ``KimiMLP``) and
its latent MoE runner: an fp32 sigmoid router whose ``e_score_correction_bias`` only
steers selection, top-k renormalized weights, routed experts working in the
3584-wide latent made by ``routed_expert_down_proj`` (SiTU, intermediate sharded
across TP and zero-padded per rank as vLLM pads it), shared experts on the
un-projected input, one all-reduce of [latent partial | shared partial], then
``routed_expert_norm``, ``routed_expert_up_proj`` and the shared add.
Routed experts are bf16 here (the released checkpoint stores them MXFP4).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from rewriter.config import KimiK3Config
from rewriter.layers.common import Weight, rms_norm, silu_and_mul, situ_and_mul
from rewriter.layers.sharding import REPLICATED, ROW, Piece, Sharding
from rewriter.regions import region

k3 = torch.ops.k3


def _act(cfg: KimiK3Config) -> dict[str, float | None]:
    if cfg.hidden_act == "situ":
        return {"beta": cfg.activation_situ_beta, "linear_beta": cfg.activation_situ_linear_beta}
    return {"beta": None, "linear_beta": None}


class KimiMoE(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: int, dtype: torch.dtype, tp_group: str):
        super().__init__()
        s = cfg.shard(tp)
        self.tp, self.tp_group = tp, tp_group
        self.top_k, self.renormalize = cfg.num_experts_per_token, cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.eps = cfg.rms_norm_eps
        self.act = _act(cfg)
        hidden, latent, experts = cfg.hidden_size, cfg.moe_hidden_size, cfg.num_experts
        inter, inter_full = s.expert_intermediate, cfg.moe_intermediate_size
        self.gate = Weight((experts, hidden), dtype, REPLICATED)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32),
                                                         requires_grad=False)
        self.gate.shardings["e_score_correction_bias"] = REPLICATED
        self.routed_expert_down_proj = Weight((latent, hidden), dtype, REPLICATED)
        self.experts = nn.Module()
        pad = inter if inter != s.expert_intermediate_unpadded else None
        self.experts.w13_weight = nn.Parameter(torch.empty(experts, 2 * inter, latent, dtype=dtype),
                                               requires_grad=False)
        self.experts.w2_weight = nn.Parameter(torch.empty(experts, latent, inter, dtype=dtype), requires_grad=False)
        self.experts.shardings = {
            "w13_weight": Sharding(1, (Piece(inter_full, pad_to=pad), Piece(inter_full, pad_to=pad))),
            "w2_weight": Sharding(2, (Piece(inter_full, pad_to=pad),)),
        }
        self.shared_experts = nn.Module()
        shared_full = cfg.moe_intermediate_size * cfg.num_shared_experts
        self.shared_experts.gate_up_proj = Weight((2 * s.shared_intermediate, hidden), dtype,
                                                  Sharding(0, (Piece(shared_full), Piece(shared_full))))
        self.shared_experts.down_proj = Weight((hidden, s.shared_intermediate), dtype, ROW)
        self.routed_expert_norm = Weight((latent,), dtype, REPLICATED)
        self.routed_expert_up_proj = Weight((hidden, latent), dtype, REPLICATED)
        self.latent, self.hidden = latent, hidden
        self.shardings = {}

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return route(logits, self.gate.e_score_correction_bias, top_k=self.top_k, renormalize=self.renormalize,
                     scaling=self.scaling)

    def forward(self, x: Tensor) -> Tensor:
        logits, x_latent = router_and_down_proj(x, self.gate.weight, self.routed_expert_down_proj.weight)
        weights, ids = self.route(logits)
        act = experts_up(x_latent, ids, self.experts.w13_weight, **self.act)
        routed = experts_down(act, weights, ids, self.experts.w2_weight)
        shared = shared_experts_down(shared_experts_up(x, self.shared_experts.gate_up_proj.weight, **self.act),
                                     self.shared_experts.down_proj.weight)
        return latent_tail(routed, shared, self.routed_expert_norm.weight, self.routed_expert_up_proj.weight,
                           latent=self.latent, hidden=self.hidden, group=self.tp_group, tp=self.tp, eps=self.eps)


class KimiMLP(nn.Module):
    """The dense MLP: gate_up (column parallel), activation, down (row parallel) + all-reduce."""

    def __init__(self, cfg: KimiK3Config, tp: int, dtype: torch.dtype, tp_group: str):
        super().__init__()
        s = cfg.shard(tp)
        self.tp, self.tp_group = tp, tp_group
        self.act = _act(cfg)
        self.gate_up_proj = Weight((2 * s.dense_intermediate, cfg.hidden_size), dtype,
                                   Sharding(0, (Piece(cfg.intermediate_size), Piece(cfg.intermediate_size))))
        self.down_proj = Weight((cfg.hidden_size, s.dense_intermediate), dtype, ROW)
        self.shardings = {}

    def forward(self, x: Tensor) -> Tensor:
        return mlp_down(mlp_up(x, self.gate_up_proj.weight, **self.act), self.down_proj.weight, self.tp_group, self.tp)


def router_and_down_proj(x: Tensor, gate_weight: Tensor, down_weight: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 router logits and the routed experts' latent input, both from the un-projected x."""
    with region("moe.router"):
        logits = torch.nn.functional.linear(x.float(), gate_weight.float())
    with region("moe.down_proj"):
        return logits, torch.nn.functional.linear(x, down_weight)


def route(logits: Tensor, bias: Tensor, *, top_k: int, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """noaux_tc top-k: sigmoid scores, bias added for selection only, renormalized, scaled."""
    with region("moe.topk"):
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + bias, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * scaling, ids


def experts_up(x_latent: Tensor, ids: Tensor, w13: Tensor, *, beta: float | None, linear_beta: float | None) -> Tensor:
    """Each token's selected experts' gate/up projection and activation: [T, k, I]."""
    with region("moe.experts"):
        gate_up = torch.einsum("tl,tkol->tko", x_latent, w13[ids])  # only the selected experts are read
        return activation(gate_up, beta, linear_beta)


def experts_down(act: Tensor, weights: Tensor, ids: Tensor, w2: Tensor) -> Tensor:
    """Each expert's down projection, combined with the routing weights (fp32 sum): [T, L]."""
    with region("moe.experts"):
        out = torch.einsum("tki,tkli->tkl", act, w2[ids])
        return (out.float() * weights.unsqueeze(-1)).sum(1).type_as(act)


def shared_experts_up(x: Tensor, weight: Tensor, *, beta: float | None, linear_beta: float | None) -> Tensor:
    with region("moe.shared"):
        return activation(torch.nn.functional.linear(x, weight), beta, linear_beta)


def shared_experts_down(h: Tensor, weight: Tensor) -> Tensor:
    with region("moe.shared"):
        return torch.nn.functional.linear(h, weight)


def latent_tail(routed: Tensor, shared: Tensor, norm_weight: Tensor, up_weight: Tensor, *, latent: int, hidden: int,
                group: str, tp: int, eps: float) -> Tensor:
    """One all-reduce of [latent | shared] partials, routed_expert_norm, up projection, shared add."""
    with region("moe.tail_all_reduce"):
        reduced = k3.all_reduce(torch.cat([routed, shared], dim=-1), group, tp)
        routed, shared = reduced.split([latent, hidden], dim=-1)
    with region("moe.tail"):
        return torch.nn.functional.linear(rms_norm(routed, norm_weight, eps), up_weight) + shared


def mlp_up(x: Tensor, weight: Tensor, *, beta: float | None, linear_beta: float | None) -> Tensor:
    with region("mlp.gate_up"):
        gate_up = torch.nn.functional.linear(x, weight)
    with region("mlp.act"):
        return activation(gate_up, beta, linear_beta)


def mlp_down(h: Tensor, weight: Tensor, group: str, tp: int) -> Tensor:
    with region("mlp.down"):
        out = torch.nn.functional.linear(h, weight)
    with region("mlp.all_reduce"):
        return k3.all_reduce(out, group, tp)


def activation(gate_up: Tensor, beta: float | None, linear_beta: float | None) -> Tensor:
    """SiTU when ``beta`` is set (Kimi K3), SiLU-and-mul otherwise."""
    return situ_and_mul(gate_up, beta, linear_beta) if beta is not None else silu_and_mul(gate_up)
