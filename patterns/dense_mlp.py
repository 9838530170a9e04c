"""Layer 0's dense MLP: gate_up, SiTU, down and the all-reduce, as ``dense_mlp`` for 1..64 tokens,
on the kernels generated from the op's reference (the GEMV main loop at one token, the
tensor-core GEMM's from two; a stage whose K a GEMV lane cannot hold takes the GEMM at one token).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codegen.targets import MAX_TOKENS
from rewriter.compiler.rules import Rule, RuleContext, fused_op, token_range_guard
from rewriter.model.layers.moe import mlp_down, mlp_up


@fused_op("dense_mlp")
def dense_mlp_op(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, beta: float | None,
                 linear_beta: float | None, group: str, tp: int) -> Tensor:
    return mlp_down(mlp_up(x, gate_up_weight, beta=beta, linear_beta=linear_beta), down_weight, group, tp)


def _dense_variants(ctx: RuleContext):
    mlp = getattr(ctx.layer, "mlp", None)
    if mlp is None:
        return []
    act, group, tp = mlp.act, mlp.tp_group, mlp.tp

    def pattern(x, gate_up_weight, down_weight):
        return mlp_down(mlp_up(x, gate_up_weight, **act), down_weight, group, tp)

    def replacement(x, gate_up_weight, down_weight):
        return torch.ops.k3f.dense_mlp(x, gate_up_weight, down_weight, act["beta"], act["linear_beta"], group, tp)

    return [(pattern, replacement)]


RULES = [
    Rule("dense_mlp", "dense_mlp", _dense_variants,
         token_range_guard(1, MAX_TOKENS, f"the rule takes 1..{MAX_TOKENS} tokens"),
         communicates=True, launches=2,
         doc=f"dense MLP for 1..{MAX_TOKENS} tokens: gate_up with SiTU in its epilogue, down (two generated "
             "kernels), all-reduce"),
]
