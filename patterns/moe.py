"""MoE: routed experts grouped over the selected experts, shared experts beside them on
an auxiliary stream, and the latent tail.

- ``routed_experts`` (bf16) and ``routed_experts_mxfp4`` (the checkpoint's MXFP4, in the
  layout vLLM's MoE backend leaves): for each token, its selected experts' gate/up rows,
  SiTU, and down projections, weighted and summed;
- ``routed_moe_mxfp4``: the router's top-k and the MXFP4 experts as one op, so that the router
  can file the step's pairs by expert for an up stage that reads and dequantizes each chosen
  expert once (the down stage too from 64 tokens, per pair below); from ``MOE_BY_EXPERT_FROM`` =
  16 tokens, where it is faster than the per-pair grids;
- ``shared_experts.small`` / ``.large``: gate_up, SiTU, down on the un-projected rows (GEMVs
  at one token, the tensor-core GEMM from 2); it reads nothing of the routed branch, so it
  runs on the aux stream beside it;
- ``latent_tail``: one cross-GPU reduction of [latent | shared] partials, then
  ``routed_expert_norm``, ``routed_expert_up_proj`` and the shared add. vLLM replicates the up
  projection (51 MB read on every rank); here each rank computes its 1/TP of the hidden rows
  (and adds its columns of the shared sum) and the shares are gathered, as the router does;
  ``latent_tail.replicated`` reads every row where TP does not divide them (TP 3, 6, 12, 24, 48).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from rewriter.compiler.rules import Match, Rule, RuleContext, common_guard, fused_op, split_guards, token_range_guard
from rewriter.model import ops  # gather_last_dim looked up at call time (tests mock it)
from rewriter.model.layers.common import rms_norm
from rewriter.model.layers.moe import (
    experts_down,
    experts_up,
    latent_tail,
    route,
    shared_experts_down,
    shared_experts_up,
)

SHARED_SMALL_MAX = 1  # the GEMVs up to here, the GEMM above (codegen.launchers.experts.SHARED_GEMM_TOKENS)
# routed_moe_mxfp4 from this many tokens per step (router_topk + routed_experts_mxfp4 below); None: never.
# On the H200 (examples/bench_mxfp4_experts.py, 2026-12-02) the router's plan with the up stage per
# chosen expert streaming its tiles' K (ExpertUpMxfp4ByExpert) against the router with the per-pair
# grids: TP 16 60.2 / 54.3 us at 8 tokens, 93.6 / 96.6 at 16, 153.7 / 181.6 at 32, 263.3 / 350.8 at
# 64; TP 8 100.4 / 102.0, 171.8 / 189.4, 313.8 / 371.3, 528.1 / 727.5.
MOE_BY_EXPERT_FROM: int | None = 16


@fused_op("routed_experts")
def routed_experts_op(x_latent: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor, beta: float | None,
                      linear_beta: float | None) -> Tensor:
    return experts_down(experts_up(x_latent, ids, w13, beta=beta, linear_beta=linear_beta), weights, ids, w2)


def mxfp4_experts(x_latent: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                  w2_scale: Tensor, layout: str, beta: float | None, linear_beta: float | None) -> Tensor:
    """The reference layer's routed experts on MXFP4 weights (what both MXFP4 rules match and
    their ops compute)."""
    return experts_down(experts_up(x_latent, ids, w13, w13_scale, layout=layout, beta=beta, linear_beta=linear_beta),
                        weights, ids, w2, w2_scale, layout=layout)


@fused_op("routed_experts_mxfp4")
def routed_experts_mxfp4_op(x_latent: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w13_scale: Tensor,
                            w2: Tensor, w2_scale: Tensor, beta: float | None, linear_beta: float | None, layout: str,
                            inter_live: int) -> Tensor:
    """The routed experts on MXFP4 weights in ``layout``; only the first ``inter_live`` channels
    of each half of w13 (and of w2's K) are real, the rest is zero padding a kernel skips."""
    return mxfp4_experts(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, layout, beta, linear_beta)


@fused_op("routed_moe_mxfp4")
def routed_moe_mxfp4_op(x_latent: Tensor, logits: Tensor, bias: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                        w2_scale: Tensor, top_k: int, renormalize: bool, scaling: float, beta: float | None,
                        linear_beta: float | None, layout: str, inter_live: int) -> Tensor:
    """The router's top-k, then the routed experts on MXFP4 weights (``routed_experts_mxfp4``)."""
    weights, ids = route(logits, bias, top_k=top_k, renormalize=renormalize, scaling=scaling)
    return mxfp4_experts(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, layout, beta, linear_beta)


@fused_op("shared_experts")
def shared_experts_op(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, beta: float | None,
                      linear_beta: float | None) -> Tensor:
    return shared_experts_down(shared_experts_up(x, gate_up_weight, beta=beta, linear_beta=linear_beta), down_weight)


def _latent_tail_fake(routed: Tensor, shared: Tensor, norm_weight: Tensor, up_weight: Tensor, latent: int,
                      hidden: int, group: str, tp: int, eps: float, piece: int, pieces: int) -> Tensor:
    return shared.new_empty(shared.shape[0], hidden)


@fused_op("latent_tail", fake=_latent_tail_fake)
def latent_tail_op(routed: Tensor, shared: Tensor, norm_weight: Tensor, up_weight: Tensor, latent: int, hidden: int,
                   group: str, tp: int, eps: float, piece: int, pieces: int) -> Tensor:
    """The all-reduce of [routed | shared] partials over the ``tp`` ranks, then piece ``piece`` of
    ``pieces`` of the up projection's rows plus its columns of the shared sum, the pieces gathered:
    ``pieces`` is the TP size where it divides the rows (each rank its own piece) and 1 where it
    does not (every rank all rows, nothing to gather)."""
    reduced = torch.ops.k3.all_reduce(torch.cat([routed, shared], dim=-1), group, tp)
    routed, shared = reduced.split([latent, hidden], dim=-1)
    rows = up_weight.chunk(pieces)[piece]
    part = shared[:, piece * rows.shape[0]:(piece + 1) * rows.shape[0]]
    return ops.gather_last_dim(torch.nn.functional.linear(rms_norm(routed, norm_weight, eps), rows) + part, group,
                               pieces)


def _routed_variants(ctx: RuleContext):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None or moe.experts.routed_experts.format.quantized:
        return []
    act = moe.act

    def pattern(x_latent, weights, ids, w13, w2):
        return experts_down(experts_up(x_latent, ids, w13, **act), weights, ids, w2)

    def replacement(x_latent, weights, ids, w13, w2):
        return torch.ops.k3f.routed_experts(x_latent, weights, ids, w13, w2, act["beta"], act["linear_beta"])

    return [(pattern, replacement)]


def _routed_mxfp4_variants(ctx: RuleContext):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None or not moe.experts.routed_experts.format.quantized:
        return []
    act, routed = moe.act, moe.experts.routed_experts
    layout, live = routed.format.layout, routed.inter_live

    def pattern(x_latent, weights, ids, w13, w13_scale, w2, w2_scale):
        return mxfp4_experts(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, layout, **act)

    def replacement(x_latent, weights, ids, w13, w13_scale, w2, w2_scale):
        return torch.ops.k3f.routed_experts_mxfp4(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, act["beta"],
                                                  act["linear_beta"], layout, live)

    return [(pattern, replacement)]


def _moe_mxfp4_variants(ctx: RuleContext):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None or not moe.experts.routed_experts.format.quantized or MOE_BY_EXPERT_FROM is None:
        return []
    act, routed = moe.act, moe.experts.routed_experts
    layout, live = routed.format.layout, routed.inter_live
    k, renorm, scale = moe.top_k, moe.renormalize, moe.scaling

    def pattern(x_latent, logits, bias, w13, w13_scale, w2, w2_scale):
        weights, ids = route(logits, bias, top_k=k, renormalize=renorm, scaling=scale)
        return mxfp4_experts(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, layout, **act)

    def replacement(x_latent, logits, bias, w13, w13_scale, w2, w2_scale):
        return torch.ops.k3f.routed_moe_mxfp4(x_latent, logits, bias, w13, w13_scale, w2, w2_scale, k, renorm, scale,
                                              act["beta"], act["linear_beta"], layout, live)

    return [(pattern, replacement)]


def _moe_guard(m: Match) -> str | None:
    """From ``MOE_BY_EXPERT_FROM`` tokens (read at match time, so a test or a user can set it)."""
    return token_range_guard(MOE_BY_EXPERT_FROM, 64, f"per chosen expert from {MOE_BY_EXPERT_FROM} tokens")(m)


def _shared_variants(ctx: RuleContext):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None:
        return []
    act = moe.act

    def pattern(x, gate_up_weight, down_weight):
        return shared_experts_down(shared_experts_up(x, gate_up_weight, **act), down_weight)

    def replacement(x, gate_up_weight, down_weight):
        return torch.ops.k3f.shared_experts(x, gate_up_weight, down_weight, act["beta"], act["linear_beta"])

    return [(pattern, replacement)]


def _tail_variants(ctx: RuleContext, *, split: bool):
    """``split``: this rank's 1/TP of the up projection's rows, gathered; else all of them."""
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None:
        return []
    c = dict(latent=moe.latent, hidden=moe.hidden, group=moe.tp_group, tp=moe.tp, eps=moe.eps)
    piece, pieces = (ctx.layer.rank, moe.tp) if split else (0, 1)

    def pattern(routed, shared, norm_weight, up_weight):
        return latent_tail(routed, shared, norm_weight, up_weight, **c)

    def replacement(routed, shared, norm_weight, up_weight):
        return torch.ops.k3f.latent_tail(routed, shared, norm_weight, up_weight, c["latent"], c["hidden"],
                                         c["group"], c["tp"], c["eps"], piece, pieces)

    return [(pattern, replacement)]


def _undivided_up_rows(m: Match) -> str | None:
    """Why the TP size does not split the up projection's rows, if it does not."""
    rows, tp = m.val("up_weight").shape[0], m.shape.tp
    return f"TP {tp} does not divide the {rows} rows of {m.inputs['up_weight'].target or 'up_weight'}" if rows % tp \
        else None


_tail_guard, _tail_replicated_guard = split_guards(_undivided_up_rows, "the up projection's rows", "latent_tail")


RULES = [
    Rule("routed_experts", "moe", _routed_variants, common_guard, kernel="routed_experts_grouped", launches=2,
         doc="grouped GEMV/GEMM over the selected experts: gate/up + SiTU, then down + weighted sum"),
    Rule("routed_experts_mxfp4", "moe", _routed_mxfp4_variants, common_guard, launches=2,
         doc="the same on MXFP4 experts in the layout vLLM's MoE backend leaves, dequantized in registers"),
    Rule("routed_moe_mxfp4", "moe", _moe_mxfp4_variants, _moe_guard, launches=3,
         doc="router top-k filing the pairs by expert, then the MXFP4 up stage per chosen expert (each read "
             "once) and the down stage per pair or, from 64 tokens, per chosen expert"),
    Rule("shared_experts.small", "moe", _shared_variants,
         token_range_guard(1, SHARED_SMALL_MAX, "the GEMV rule takes 1 token"), kernel="shared_experts",
         stream="aux", launches=2,
         doc="shared experts' gate_up + SiTU, then down (a partial sum), beside the routed experts: GEMVs"),
    Rule("shared_experts.large", "moe", _shared_variants,
         token_range_guard(SHARED_SMALL_MAX + 1, 64, f"the GEMM rule takes {SHARED_SMALL_MAX + 1}..64 tokens"),
         kernel="shared_experts_gemm", stream="aux", launches=2,
         doc="the same from 2 tokens: gate_up GEMM with SiTU in its epilogue, then the down GEMM"),
    Rule("latent_tail", "moe", partial(_tail_variants, split=True), _tail_guard, communicates=True,
         weight_fraction=lambda ctx: 1 / ctx.shape.tp, split_inputs=("up_weight",),
         doc="[latent | shared] cross-GPU reduction, routed_expert_norm, this rank's rows of the up projection, "
             "shared add, gathered"),
    Rule("latent_tail.replicated", "moe", partial(_tail_variants, split=False), _tail_replicated_guard,
         kernel="latent_tail", communicates=True,
         doc="the same where TP does not divide the up projection's rows: every rank all of them (as vLLM "
             "reads it), nothing gathered"),
]
