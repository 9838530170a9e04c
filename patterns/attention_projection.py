"""Attention input projection: the packed GEMM, and what can run with it per head.

- ``attn_in_proj.small`` / ``attn_in_proj.large``: the layer's input projection
  (KDA ``in_proj_qkvgfab``, MLA ``fused_qkv_a_g_proj``) with its split, as one kernel;
  a weight-streaming GEMV for one token, a tensor-core GEMM for 2..64 (separate guards, same
  semantics; on the H200 the GEMM streams the weights faster from 2 tokens on: BENCHMARKS.md).
- ``kda_core``: KDA after the projection. ``f_b_proj`` cannot join the projection
  kernel (it needs all of f_a first), but per head it is a 128x128 GEMV, so it runs in
  the head's core kernel with the conv update, gates, recurrent update and gated norm.
  ``kda_core.verify``: the same for a speculative verify step (vLLM's multi-slot state:
  ``state_indices`` [requests, q], ``num_accepted``), the q tokens walked in one kernel.
- ``mla_q_front``: MLA's q/kv LoRA front: both norms, ``q_b_proj`` and the W_UK
  absorption are per head once q_c is known, and the latent cache insert rides along.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.layers.kda import kda_core, kda_in_proj
from rewriter.layers.mla import mla_in_proj, mla_q_front
from rewriter.rules import Rule, RuleContext, common_guard, fused_op, token_range_guard

SMALL_MAX = 1


@fused_op("kda_in_proj")
def kda_in_proj_op(x: Tensor, weight: Tensor, split_sizes: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.clone() for t in kda_in_proj(x, weight, split_sizes))


@fused_op("mla_in_proj")
def mla_in_proj_op(x: Tensor, weight: Tensor, split_sizes: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.clone() for t in mla_in_proj(x, weight, split_sizes))


def _in_proj_variants(ctx: RuleContext):
    attn = ctx.layer.self_attn
    sizes = attn.split_sizes
    if ctx.layer.attention_kind == "kda":
        def pattern(x, weight):
            return kda_in_proj(x, weight, sizes)

        def replacement(x, weight):
            r = torch.ops.k3f.kda_in_proj(x, weight, sizes)
            return r[0], r[1], r[2], r[3]
    else:
        def pattern(x, weight):
            return mla_in_proj(x, weight, sizes)

        def replacement(x, weight):
            r = torch.ops.k3f.mla_in_proj(x, weight, sizes)
            return r[0], r[1], r[2], r[3]
    return [(pattern, replacement)]


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


@fused_op("mla_q_front", mutates_args=("kv_cache",))
def mla_q_front_op(q_c: Tensor, kv_c: Tensor, k_pe: Tensor, q_a_norm: Tensor, kv_a_norm: Tensor, q_b_weight: Tensor,
                   kv_b_weight: Tensor, kv_cache: Tensor, slot_mapping: Tensor, kv_scale: Tensor, heads: int, nope: int,
                   rope: int, v_dim: int, kv_lora: int, eps: float) -> Tensor:
    return mla_q_front(q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping, kv_scale,
                       heads=heads, nope=nope, rope=rope, v_dim=v_dim, kv_lora=kv_lora, eps=eps)[0]


def _mla_q_front_variants(ctx: RuleContext):
    if ctx.layer.attention_kind != "mla":
        return []
    d = ctx.layer.self_attn.dims

    def pattern(q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping, kv_scale):
        return mla_q_front(q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping,
                           kv_scale, **d)

    def replacement(q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache, slot_mapping, kv_scale):
        q = torch.ops.k3f.mla_q_front(q_c, kv_c, k_pe, q_a_norm, kv_a_norm, q_b_weight, kv_b_weight, kv_cache,
                                      slot_mapping, kv_scale, d["heads"], d["nope"], d["rope"], d["v_dim"],
                                      d["kv_lora"], d["eps"])
        return q, q  # the pattern's second result is the cache insert, which nothing reads

    return [(pattern, replacement)]


RULES = [
    Rule("attn_in_proj.small", "attention_projection", _in_proj_variants,
         token_range_guard(1, SMALL_MAX, "the GEMV rule takes 1 token"), kernel="attn_in_proj_gemv",
         doc="attention input projection for one token: weight-streaming GEMV"),
    Rule("attn_in_proj.large", "attention_projection", _in_proj_variants,
         token_range_guard(SMALL_MAX + 1, 64, "the GEMM rule takes 2..64 tokens"), kernel="attn_in_proj_gemm",
         doc="attention input projection for 2..64 tokens: tensor-core GEMM"),
    Rule("kda_core", "attention_projection", _kda_core_variants, common_guard,
         doc="f_b_proj + short conv + gates + delta-rule update + gated RMSNorm, per head"),
    Rule("kda_core.verify", "attention_projection", _kda_core_verify_variants, common_guard, kernel="kda_core",
         doc="kda_core for a speculative verify step: q tokens per request over vLLM's multi-slot state"),
    Rule("mla_q_front", "attention_projection", _mla_q_front_variants, common_guard,
         doc="q/kv norms + q_b_proj + W_UK absorption + latent cache insert, per head"),
]
