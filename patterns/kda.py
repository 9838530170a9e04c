"""KDA after the input projection, per head, as one kernel: ``kda_core``. ``f_b_proj`` cannot
join the projection kernel (it needs all of f_a first), but per head it is a 128x128 GEMV, so it
runs in the head's core kernel with the conv update, gates, recurrent update and gated norm.
``kda_core.verify``: the same for a speculative verify step (vLLM's multi-slot state:
``state_indices`` [requests, q], ``num_accepted``), the q tokens walked in one kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.compiler.rules import Rule, RuleContext, common_guard, fused_op
from rewriter.model.layers.kda import kda_core


@fused_op("kda_core", mutates_args=("conv_state", "recurrent_state"))
def kda_core_op(mixed_qkv: Tensor, g_out: Tensor, f_a: Tensor, beta: Tensor, f_b_weight: Tensor, conv_weight: Tensor,
                a_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, conv_state: Tensor, recurrent_state: Tensor,
                state_indices: Tensor, heads: int, head_dim: int, lower_bound: float | None, eps: float) -> Tensor:
    return kda_core(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                    recurrent_state, state_indices, heads=heads, head_dim=head_dim, lower_bound=lower_bound, eps=eps)


@fused_op("kda_core_verify", mutates_args=("conv_state", "recurrent_state"))
def kda_core_verify_op(mixed_qkv: Tensor, g_out: Tensor, f_a: Tensor, beta: Tensor, f_b_weight: Tensor,
                       conv_weight: Tensor, a_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, conv_state: Tensor,
                       recurrent_state: Tensor, state_indices: Tensor, num_accepted: Tensor, heads: int, head_dim: int,
                       lower_bound: float | None, eps: float) -> Tensor:
    return kda_core(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                    recurrent_state, state_indices, num_accepted, heads=heads, head_dim=head_dim,
                    lower_bound=lower_bound, eps=eps)


def _kda_consts(ctx: RuleContext) -> dict | None:
    """The KDA core's constants of a KDA layer (heads, head_dim, lower_bound, eps, in the ops'
    order), or None for another attention kind."""
    if ctx.layer.attention_kind != "kda":
        return None
    a = ctx.layer.self_attn
    return dict(heads=a.heads, head_dim=a.head_dim, lower_bound=a.lower_bound, eps=a.norm_eps)


def _kda_core_verify_variants(ctx: RuleContext):
    consts = _kda_consts(ctx)
    if consts is None:
        return []

    def pattern(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                recurrent_state, state_indices, num_accepted):
        return kda_core(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight,
                        conv_state, recurrent_state, state_indices, num_accepted, **consts)

    def replacement(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                    recurrent_state, state_indices, num_accepted):
        return torch.ops.k3f.kda_core_verify(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias,
                                             norm_weight, conv_state, recurrent_state, state_indices, num_accepted,
                                             *consts.values())

    return [(pattern, replacement)]


def _kda_core_variants(ctx: RuleContext):
    consts = _kda_consts(ctx)
    if consts is None:
        return []

    def pattern(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                recurrent_state, state_indices):
        return kda_core(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight,
                        conv_state, recurrent_state, state_indices, **consts)

    def replacement(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                    recurrent_state, state_indices):
        return torch.ops.k3f.kda_core(mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, a_log, dt_bias,
                                      norm_weight, conv_state, recurrent_state, state_indices, *consts.values())

    return [(pattern, replacement)]


RULES = [
    Rule("kda_core", "kda", _kda_core_variants, common_guard,
         doc="f_b_proj + short conv + gates + delta-rule update + gated RMSNorm, per head"),
    Rule("kda_core.verify", "kda", _kda_core_verify_variants, common_guard, kernel="kda_core",
         doc="kda_core for a speculative verify step: q tokens per request over vLLM's multi-slot state"),
]
