"""The router, split in two.

- ``router_gemm``: the fp32 gate GEMM packed with ``routed_expert_down_proj``: both read
  the same un-projected rows, so one kernel streams both weights. vLLM replicates both
  (51 MB of down projection per rank); here each rank computes its 1/TP share of the
  experts' logits and of the latent columns and the shares are gathered, so per-rank
  weight traffic falls by the TP size.
  Where TP does not divide the rows (896 gate rows and 3584 latent rows: TP 3, 6, 12, 24,
  48), ``router_gemm.replicated`` reads all of them on every rank, as vLLM does, and gathers
  nothing.
- ``router_topk``: sigmoid scores, the correction bias added for selection only, top-k,
  renormalized and scaled weights.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from rewriter.compiler.rules import Match, Rule, RuleContext, common_guard, fused_op, split_guards
from rewriter.model.layers.moe import route, router_and_down_proj
from rewriter.model.ops import gather_last_dim


def _router_down_fake(x: Tensor, gate_weight: Tensor, down_weight: Tensor, group: str, tp: int,
                      rank: int) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape[0], gate_weight.shape[0], dtype=torch.float32),
            x.new_empty(x.shape[0], down_weight.shape[0]))


@fused_op("router_down", fake=_router_down_fake)
def router_down_op(x: Tensor, gate_weight: Tensor, down_weight: Tensor, group: str, tp: int,
                   rank: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank`` computes rows [rank/tp, (rank+1)/tp) of both replicated weights; all gather."""
    gate_rows = gate_weight.chunk(tp)[rank]
    down_rows = down_weight.chunk(tp)[rank]
    logits, latent = router_and_down_proj(x, gate_rows, down_rows)
    return gather_last_dim(logits, group, tp), gather_last_dim(latent, group, tp)


def _router_gemm_variants(ctx: RuleContext, *, split: bool):
    """``split``: this rank's 1/TP of both weights' rows, gathered; else all of them (a TP of one)."""
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None:
        return []
    group, tp, rank = (moe.tp_group, moe.tp, ctx.layer.rank) if split else (moe.tp_group, 1, 0)

    def pattern(x, gate_weight, down_weight):
        return router_and_down_proj(x, gate_weight, down_weight)

    def replacement(x, gate_weight, down_weight):
        r = torch.ops.k3f.router_down(x, gate_weight, down_weight, group, tp, rank)
        return r[0], r[1]

    return [(pattern, replacement)]


def _undivided_rows(m: Match) -> str | None:
    """Which weight's rows the TP size does not divide, if any."""
    tp = m.shape.tp
    for name in ("gate_weight", "down_weight"):
        rows = m.val(name).shape[0]
        if rows % tp:
            return f"TP {tp} does not divide the {rows} rows of {m.inputs[name].target or name}"
    return None


_router_gemm_guard, _router_replicated_guard = split_guards(_undivided_rows, "both weights' rows", "router_gemm")


@fused_op("router_topk")
def router_topk_op(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool,
                   scaling: float) -> tuple[Tensor, Tensor]:
    return route(logits, bias, top_k=top_k, renormalize=renormalize, scaling=scaling)


def _topk_variants(ctx: RuleContext):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None:
        return []
    k, renorm, scale = moe.top_k, moe.renormalize, moe.scaling

    def pattern(logits, bias):
        return route(logits, bias, top_k=k, renormalize=renorm, scaling=scale)

    def replacement(logits, bias):
        r = torch.ops.k3f.router_topk(logits, bias, k, renorm, scale)
        return r[0], r[1]

    return [(pattern, replacement)]


RULES = [
    Rule("router_gemm", "router", partial(_router_gemm_variants, split=True), _router_gemm_guard,
         kernel="router_down", communicates=True, weight_fraction=lambda ctx: 1 / ctx.shape.tp,
         doc="fp32 gate GEMM + routed_expert_down_proj, split across TP ranks and gathered"),
    Rule("router_gemm.replicated", "router", partial(_router_gemm_variants, split=False),
         _router_replicated_guard, kernel="router_down",
         doc="the same where TP does not divide the rows: every rank all of them (as vLLM reads them)"),
    Rule("router_topk", "router", _topk_variants, common_guard,
         doc="sigmoid + bias top-k selection with renormalized weights"),
]
