"""Output projection + all-reduce + the following AttnRes and RMSNorm, as one fused op.

The row-parallel ``o_proj`` leaves a partial sum on each rank; the kernel reduces it
across ranks (none at TP 1) and, while the reduced rows are at hand, adds them into the
AttnRes prefix sum (or starts a new block with them), mixes the blocks and applies
``post_attention_layernorm``: the MLP's input comes out of the same kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.compiler.rules import Rule, RuleContext, common_guard, fused_op
from rewriter.model.layers.attn_res import attn_res
from rewriter.model.layers.common import o_proj_all_reduce


@fused_op("o_proj_attn_res")
def o_proj_attn_res_op(o: Tensor, weight: Tensor, prefix: Tensor | None, blocks: Tensor, norm_weight: Tensor,
                       qk_weight: Tensor, out_norm_weight: Tensor, group: str, tp: int, num_blocks: int,
                       eps: float) -> tuple[Tensor, Tensor]:
    """(MLP input, new prefix sum); a None ``prefix`` starts a new AttnRes block at the attention output."""
    attn = o_proj_all_reduce(o, weight, group, tp)
    if prefix is None:
        x, new_prefix, _ = attn_res(attn, None, blocks, norm_weight, qk_weight, out_norm_weight, num_blocks, -1,
                                    eps, eps)
        return x, new_prefix.clone()
    x, new_prefix, _ = attn_res(prefix, attn, blocks, norm_weight, qk_weight, out_norm_weight, num_blocks, -1,
                                eps, eps)
    return x, new_prefix


def _variants(ctx: RuleContext):
    layer, attn = ctx.layer, ctx.layer.self_attn
    group, tp, n, eps = attn.tp_group, attn.tp, layer.mlp_blocks, layer.eps
    if layer.is_block_write_layer:
        def pattern(o, weight, blocks, norm_weight, qk_weight, out_norm_weight):
            out = o_proj_all_reduce(o, weight, group, tp)
            x, prefix, _ = attn_res(out, None, blocks, norm_weight, qk_weight.squeeze(0), out_norm_weight, n, -1,
                                    eps, eps)
            return x, prefix

        def replacement(o, weight, blocks, norm_weight, qk_weight, out_norm_weight):
            r = torch.ops.k3f.o_proj_attn_res(o, weight, None, blocks, norm_weight, qk_weight.squeeze(0),
                                              out_norm_weight, group, tp, n, eps)
            return r[0], r[1]
    else:
        def pattern(o, weight, prefix, blocks, norm_weight, qk_weight, out_norm_weight):
            out = o_proj_all_reduce(o, weight, group, tp)
            x, new_prefix, _ = attn_res(prefix, out, blocks, norm_weight, qk_weight.squeeze(0), out_norm_weight, n,
                                        -1, eps, eps)
            return x, new_prefix

        def replacement(o, weight, prefix, blocks, norm_weight, qk_weight, out_norm_weight):
            r = torch.ops.k3f.o_proj_attn_res(o, weight, prefix, blocks, norm_weight, qk_weight.squeeze(0),
                                              out_norm_weight, group, tp, n, eps)
            return r[0], r[1]
    return [(pattern, replacement)]


RULES = [
    Rule("o_proj_all_reduce_attn_res", "output_projection", _variants, common_guard, communicates=True,
         launches=2,
         doc="o_proj GEMM + cross-GPU reduction + AttnRes + post_attention_layernorm (2 kernels: the AttnRes "
             "mix needs whole reduced rows)"),
]
