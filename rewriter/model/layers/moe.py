"""Kimi K3's MLPs: the latent MoE of layers 1..92 and the dense MLP of layer 0.

Follows vLLM 0.33.0 ``models/kimi_k3/nvidia/model.py`` (``KimiMoE``, ``KimiMLP``) and
its latent MoE runner: an fp32 sigmoid router whose ``e_score_correction_bias`` only
steers selection, top-k renormalized weights, routed experts working in the
3584-wide latent made by ``routed_expert_down_proj`` (SiTU, intermediate sharded
across TP and zero-padded per rank as vLLM pads it), shared experts on the
un-projected input, one all-reduce of [latent partial | shared partial], then
``routed_expert_norm``, ``routed_expert_up_proj`` and the shared add.
Routed experts are bf16 or MXFP4 (the released checkpoint's), in a layout named by an
``ExpertFormat`` (``rewriter/model/layers/experts.py``).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from rewriter.model.config import KimiK3Config
from rewriter.model.layers.common import Weight, rms_norm, silu_and_mul, situ_and_mul
from rewriter.model.layers.experts import E2M1_RMS, ExpertFormat, random_mxfp4
from rewriter.model.layers.sharding import REPLICATED, ROW, Piece, Sharding
from rewriter.model.regions import region

k3 = torch.ops.k3


def _act(cfg: KimiK3Config) -> dict[str, float | None]:
    if cfg.hidden_act == "situ":
        return {"beta": cfg.activation_situ_beta, "linear_beta": cfg.activation_situ_linear_beta}
    return {"beta": None, "linear_beta": None}


class KimiMoE(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: int, dtype: torch.dtype, tp_group: str,
                 expert_format: ExpertFormat | str = "bf16"):
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
        self.experts = nn.Module()  # vLLM's FusedMoE wrapper; its routed experts one level down
        fmt = ExpertFormat.parse(expert_format)
        if fmt.quantized:  # vLLM's MXFP4 backends hold each rank's I in multiples of 64 (oracle/mxfp4.py)
            inter = -(-inter // 64) * 64
        self.experts.routed_experts = RoutedExperts(experts, latent, inter, s.expert_intermediate_unpadded,
                                                    inter_full, fmt, dtype)
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
        r = self.experts.routed_experts
        act = experts_up(x_latent, ids, r.w13_weight, r.w13_scale, layout=r.format.layout, **self.act)
        routed = experts_down(act, weights, ids, r.w2_weight, r.w2_scale, layout=r.format.layout)
        shared = shared_experts_down(shared_experts_up(x, self.shared_experts.gate_up_proj.weight, **self.act),
                                     self.shared_experts.down_proj.weight)
        return latent_tail(routed, shared, self.routed_expert_norm.weight, self.routed_expert_up_proj.weight,
                           latent=self.latent, hidden=self.hidden, group=self.tp_group, tp=self.tp, eps=self.eps)


class RoutedExperts(nn.Module):
    """``w13_weight`` [E, 2I, L] (gate rows, then up rows) and ``w2_weight`` [E, L, I] in an
    ``ExpertFormat`` (MXFP4 ones with their ``_weight_scale``), vLLM's names. I is the rank's
    shard of the intermediate, zero-padded from ``inter_live`` as vLLM pads it (the gate and
    the up half each); the padding adds nothing and a kernel need not read it."""

    INIT_CHUNK = 32  # experts drawn at once by init_random_

    def __init__(self, experts: int, latent: int, inter: int, inter_live: int, inter_full: int, fmt: ExpertFormat,
                 dtype: torch.dtype):
        super().__init__()
        self.format, self.experts, self.latent = fmt, experts, latent
        self.inter, self.inter_live, self.inter_full = inter, inter_live, inter_full
        self.shardings = {}
        pad = inter if inter != inter_live else None
        for proj, (n, k) in (("w13", (2 * inter, latent)), ("w2", (latent, inter))):
            for part, (shape, dt) in fmt.tensors(experts, n, k).items():
                name = f"{proj}_{part}"
                setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype if dt == torch.bfloat16 else dt),
                                                 requires_grad=False))
                self.shardings[name] = self._sharding(proj, part, pad)

    @property
    def w13_scale(self) -> Tensor | None:
        return getattr(self, "w13_weight_scale", None)

    @property
    def w2_scale(self) -> Tensor | None:
        return getattr(self, "w2_weight_scale", None)

    def _sharding(self, proj: str, part: str, pad: int | None) -> Sharding | None:
        """How a rank's tensor is cut from the TP 1 one: along I (w13's rows, per half; w2's K,
        packed 2 codes per byte or 32 per scale). Humming's tiles interleave rows and K, so its
        tensors are made per rank (``init_random_``), never cut."""
        if self.format.layout not in ("dense", "checkpoint"):
            return None
        if proj == "w13":
            piece = Piece(self.inter_full, pad_to=pad)
            return Sharding(1, (piece, piece))
        per = 1 if not self.format.quantized else (2 if part == "weight" else 32)
        return Sharding(2, (Piece(self.inter_full // per, pad_to=None if pad is None else pad // per),))

    def live_fraction(self) -> float:
        """The share of each tensor that holds real (not padding) values."""
        return self.inter_live / self.inter

    @torch.no_grad()
    def init_random_(self, g: torch.Generator) -> None:
        """Random weights scaled as a linear layer's (1 / sqrt(K)), zero in the padding."""
        live = torch.arange(self.inter, device=g.device) < self.inter_live
        for proj, (n, k), rows, cols in (("w13", (2 * self.inter, self.latent), live.repeat(2), None),
                                         ("w2", (self.latent, self.inter), None, self.inter_live)):
            w = getattr(self, f"{proj}_weight")
            if not self.format.quantized:
                w.copy_(torch.randn(w.shape, generator=g, device=g.device) / math.sqrt(k))
                if rows is not None:
                    w[:, ~rows] = 0
                if cols is not None:
                    w[..., cols:] = 0
                continue
            exponent = round(math.log2(1.0 / (math.sqrt(k) * E2M1_RMS)))
            scale = getattr(self, f"{proj}_weight_scale")
            for e0 in range(0, self.experts, self.INIT_CHUNK):  # a few experts at a time: the codes
                e1 = min(e0 + self.INIT_CHUNK, self.experts)  # take 8 bytes each while re-laid
                packed, s = random_mxfp4(e1 - e0, n, k, live_rows=rows, live_k=cols, generator=g, device=g.device,
                                         scale_exponent=exponent)
                weight, s = self.format.from_checkpoint(packed, s)
                w[e0:e1].copy_(weight)
                scale[e0:e1].copy_(s)

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


# a gap between a token's k-th and (k+1)-th selection score below which two correct bf16 paths may
# pick different experts (their rounding flips the choice): outputs of such tokens are not compared
NEAR_TIE_MARGIN = 2e-3


@contextlib.contextmanager
def recorded_topk_margins() -> Iterator[list[Tensor]]:
    """While the block runs eagerly, each ``route`` call's per-token gap between its k-th and
    (k+1)-th selection scores, appended to the list yielded. Where a gap is below rounding, two
    correct bf16 paths may pick different experts (routing is discrete), so comparisons of MoE
    outputs keep to the tokens with clear gaps (tests, ``fuzz``)."""
    global route
    margins: list[Tensor] = []
    real = route

    def recording(logits, bias, *, top_k, renormalize, scaling):
        ranked = (torch.sigmoid(logits) + bias).topk(top_k + 1, dim=-1).values
        margins.append(ranked[:, top_k - 1] - ranked[:, top_k])
        return real(logits, bias, top_k=top_k, renormalize=renormalize, scaling=scaling)

    route = recording
    try:
        yield margins
    finally:
        route = real


def expert_rows(weight: Tensor, scale: Tensor | None, ids: Tensor, layout: str) -> Tensor:
    """The selected experts' weights [T, k, N, K] in the activation dtype: only those are read."""
    if scale is None:
        return weight[ids]
    return k3.mxfp4_dequant(weight[ids], scale[ids], layout)


def experts_up(x_latent: Tensor, ids: Tensor, w13: Tensor, w13_scale: Tensor | None = None, *, layout: str = "dense",
               beta: float | None, linear_beta: float | None) -> Tensor:
    """Each token's selected experts' gate/up projection and activation: [T, k, I]."""
    with region("moe.experts"):
        gate_up = torch.einsum("tl,tkol->tko", x_latent, expert_rows(w13, w13_scale, ids, layout))
        return activation(gate_up, beta, linear_beta)


def experts_down(act: Tensor, weights: Tensor, ids: Tensor, w2: Tensor, w2_scale: Tensor | None = None, *,
                 layout: str = "dense") -> Tensor:
    """Each expert's down projection, combined with the routing weights (fp32 sum): [T, L]."""
    with region("moe.experts"):
        out = torch.einsum("tki,tkli->tkl", act, expert_rows(w2, w2_scale, ids, layout))
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
