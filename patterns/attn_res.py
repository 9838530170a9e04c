"""AttnRes before attention with ``input_layernorm``, as one kernel: ``attn_res_norm`` (prefix
add, block write, mix, norm); the block write goes to the block buffer in place, as in vLLM.
The AttnRes after attention rides in the output projection's kernel (``output_projection``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.compiler.rules import Rule, RuleContext, common_guard, fused_op
from rewriter.model.layers.attn_res import attn_res


@fused_op("attn_res_norm", mutates_args=("blocks",))
def attn_res_norm_op(prefix: Tensor, delta: Tensor | None, blocks: Tensor, norm_weight: Tensor, qk_weight: Tensor,
                     out_norm_weight: Tensor, num_blocks: int, write_idx: int, eps: float) -> tuple[Tensor, Tensor]:
    """(normalized mix, new prefix sum); block ``write_idx`` (if >= 0) is written into ``blocks``."""
    x, new_prefix, new_blocks = attn_res(prefix, delta, blocks, norm_weight, qk_weight, out_norm_weight, num_blocks,
                                         write_idx, eps, eps)
    if write_idx >= 0:
        blocks.copy_(new_blocks)
    return x, new_prefix if delta is not None else new_prefix.clone()


def _attn_res_variants(ctx: RuleContext):
    layer = ctx.layer
    n, eps = layer.prev_valid_blocks, layer.eps
    w = layer.block_write_idx if layer.is_block_write_layer else -1
    if layer.layer_idx == 0:  # no delta: the prefix is the embedding, unchanged
        def pattern(prefix, blocks, norm_weight, qk_weight, out_norm_weight):
            x, _, new_blocks = attn_res(prefix, None, blocks, norm_weight, qk_weight.squeeze(0), out_norm_weight,
                                        n, w, eps, eps)
            return x, new_blocks

        def replacement(prefix, blocks, norm_weight, qk_weight, out_norm_weight):
            r = torch.ops.k3f.attn_res_norm(prefix, None, blocks, norm_weight, qk_weight.squeeze(0),
                                            out_norm_weight, n, w, eps)
            return r[0], blocks
    elif w >= 0:
        def pattern(prefix, delta, blocks, norm_weight, qk_weight, out_norm_weight):
            return attn_res(prefix, delta, blocks, norm_weight, qk_weight.squeeze(0), out_norm_weight, n, w, eps, eps)

        def replacement(prefix, delta, blocks, norm_weight, qk_weight, out_norm_weight):
            r = torch.ops.k3f.attn_res_norm(prefix, delta, blocks, norm_weight, qk_weight.squeeze(0),
                                            out_norm_weight, n, w, eps)
            return r[0], r[1], blocks
    else:
        def pattern(prefix, delta, blocks, norm_weight, qk_weight, out_norm_weight):
            x, new_prefix, _ = attn_res(prefix, delta, blocks, norm_weight, qk_weight.squeeze(0), out_norm_weight,
                                        n, w, eps, eps)
            return x, new_prefix

        def replacement(prefix, delta, blocks, norm_weight, qk_weight, out_norm_weight):
            r = torch.ops.k3f.attn_res_norm(prefix, delta, blocks, norm_weight, qk_weight.squeeze(0),
                                            out_norm_weight, n, w, eps)
            return r[0], r[1]
    return [(pattern, replacement)]


RULES = [
    Rule("attn_res_norm", "attn_res", _attn_res_variants, common_guard,
         doc="AttnRes before attention (prefix add, block write, mix) + input_layernorm"),
]
