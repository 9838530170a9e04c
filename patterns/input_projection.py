"""The attention input projection (KDA ``in_proj_qkvgfab``, MLA ``fused_qkv_a_g_proj``) with
its split, as one fused op for 1..64 tokens. Its kernels are generated from its reference (one
kernel whose parts are the split's pieces: the GEMV's main loop at one token, the tensor-core
GEMM's from two; ``codegen/launchers/generated.py``), within 0.91 to 1.02 of the hand-written
GEMV and GEMM they replaced (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codegen.targets import MAX_TOKENS
from rewriter.compiler.rules import Rule, RuleContext, fused_op, token_range_guard
from rewriter.model.layers.kda import kda_in_proj
from rewriter.model.layers.mla import mla_in_proj


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


RULES = [
    Rule("attn_in_proj", "input_projection", _in_proj_variants,
         token_range_guard(1, MAX_TOKENS, f"the rule takes 1..{MAX_TOKENS} tokens"), kernel="attn_in_proj",
         doc=f"attention input projection for 1..{MAX_TOKENS} tokens, split into its pieces: one generated kernel"),
]
