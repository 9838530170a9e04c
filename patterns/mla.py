"""MLA after the input projection, in two kernels:

- ``mla_q_front``: the q/kv LoRA front: both norms, ``q_b_proj`` and the W_UK absorption are per
  head once q_c is known, and the latent cache insert rides along;
- ``mla_attend``: decode attention over the paged latent cache, W_UV back to heads and the
  sigmoid output gate (one kernel: the split-context partials meet before W_UV).
"""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.compiler.rules import Rule, RuleContext, common_guard, fused_op
from rewriter.model.layers.mla import mla_attend, mla_q_front


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


@fused_op("mla_attend")
def mla_attend_op(mqa_q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_scale: Tensor,
                  kv_b_weight: Tensor, gate: Tensor, scale: float, heads: int, nope: int, v_dim: int,
                  kv_lora: int) -> Tensor:
    return mla_attend(mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate, scale=scale, heads=heads,
                      nope=nope, v_dim=v_dim, kv_lora=kv_lora)


def _mla_attend_variants(ctx: RuleContext):
    if ctx.layer.attention_kind != "mla":
        return []
    attn = ctx.layer.self_attn
    d = attn.dims
    c = dict(scale=attn.scale, heads=d["heads"], nope=d["nope"], v_dim=d["v_dim"], kv_lora=d["kv_lora"])

    def pattern(mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate):
        return mla_attend(mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate, **c)

    def replacement(mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate):
        return torch.ops.k3f.mla_attend(mqa_q, kv_cache, block_table, seq_lens, kv_scale, kv_b_weight, gate,
                                        c["scale"], c["heads"], c["nope"], c["v_dim"], c["kv_lora"])

    return [(pattern, replacement)]


RULES = [
    Rule("mla_q_front", "mla", _mla_q_front_variants, common_guard,
         doc="q/kv norms + q_b_proj + W_UK absorption + latent cache insert, per head"),
    Rule("mla_attend", "mla", _mla_attend_variants, common_guard,
         doc="MLA decode over the paged latent cache + W_UV per head + sigmoid output gate"),
]
