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


def _act(cfg: KimiK3Config):
    if cfg.hidden_act == "situ":
        return lambda x: situ_and_mul(x, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return silu_and_mul


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
        self.latent, self.shared_width = latent, hidden
        self.shardings = {}

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """noaux_tc top-k: sigmoid scores, bias added for selection only, renormalized, scaled."""
        scores = torch.sigmoid(logits)
        choice = scores + self.gate.e_score_correction_bias
        ids = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.scaling, ids

    def routed_experts(self, x_latent: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Each token through its selected experts, combined with the routing weights (fp32 sum)."""
        w13 = self.experts.w13_weight[ids]  # [T, k, 2I, L]: only the selected experts are read
        w2 = self.experts.w2_weight[ids]  # [T, k, L, I]
        gate_up = torch.einsum("tl,tkol->tko", x_latent, w13)
        act = self.act(gate_up)
        out = torch.einsum("tki,tkli->tkl", act, w2)
        return (out.float() * weights.unsqueeze(-1)).sum(1).type_as(x_latent)

    def forward(self, x: Tensor) -> Tensor:
        with region("moe.router"):
            logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        with region("moe.down_proj"):
            x_latent = torch.nn.functional.linear(x, self.routed_expert_down_proj.weight)
        with region("moe.topk"):
            weights, ids = self.route(logits)
        with region("moe.experts"):
            routed = self.routed_experts(x_latent, weights, ids)
        with region("moe.shared"):
            shared_gate_up = torch.nn.functional.linear(x, self.shared_experts.gate_up_proj.weight)
            shared = torch.nn.functional.linear(self.act(shared_gate_up), self.shared_experts.down_proj.weight)
        with region("moe.tail_all_reduce"):
            reduced = k3.all_reduce(torch.cat([routed, shared], dim=-1), self.tp_group, self.tp)
            routed, shared = reduced.split([self.latent, self.shared_width], dim=-1)
        with region("moe.tail"):
            routed = rms_norm(routed, self.routed_expert_norm.weight, self.eps)
            return torch.nn.functional.linear(routed, self.routed_expert_up_proj.weight) + shared


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
        with region("mlp.gate_up"):
            gate_up = torch.nn.functional.linear(x, self.gate_up_proj.weight)
        with region("mlp.act"):
            act = self.act(gate_up)
        with region("mlp.down"):
            out = torch.nn.functional.linear(act, self.down_proj.weight)
        with region("mlp.all_reduce"):
            return k3.all_reduce(out, self.tp_group, self.tp)

