"""Layer 0's dense MLP: gate_up, SiTU, down and the all-reduce, as ``dense_mlp.small`` on GEMV
kernels for up to ``DENSE_SMALL_MAX`` tokens and ``dense_mlp.large`` on the tensor-core GEMM above
(and at one token where a rank's intermediate is too long for the GEMVs: TP 4 and below).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codegen.targets import MAX_TOKENS
from rewriter.compiler.rules import Match, Rule, RuleContext, fused_op, token_range_guard
from rewriter.model.layers.moe import mlp_down, mlp_up

DENSE_SMALL_MAX = 1  # the GEMV kernels up to here, the GEMM above (measured: BENCHMARKS.md, layer 0's dense MLP)
# the GEMV kernels' down projection holds a row of the rank's intermediate in registers, at most 16 lanes x 4
# warps x 12 vectors of 8 (codegen/launchers/dense_mlp.py): Kimi K3's 33792 channels fit from TP 8 (4224); at
# TP 4 and below (8448 and more) the GEMM rule takes the one-token step too
DENSE_GEMV_MAX_INTER = 16 * 4 * 12 * 8


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


def _dense_inter(m: Match) -> int:
    return m.val("gate_up_weight").shape[0] // 2


def _dense_small_guard(m: Match) -> str | None:
    reason = token_range_guard(1, DENSE_SMALL_MAX, "the GEMV rule takes 1 token")(m)
    inter = _dense_inter(m)
    if reason is None and inter > DENSE_GEMV_MAX_INTER:
        return (f"intermediate {inter} per rank: the GEMV kernels hold at most {DENSE_GEMV_MAX_INTER} "
                "(the GEMM rule takes it)")
    return reason


def _dense_large_guard(m: Match) -> str | None:
    lo = 1 if _dense_inter(m) > DENSE_GEMV_MAX_INTER else DENSE_SMALL_MAX + 1
    return token_range_guard(lo, MAX_TOKENS, f"the GEMM rule takes {lo}..{MAX_TOKENS} tokens")(m)


RULES = [
    Rule("dense_mlp.small", "dense_mlp", _dense_variants, _dense_small_guard,
         kernel="dense_mlp", communicates=True, launches=2,
         doc="dense MLP for few tokens: gate_up + SiTU, down (GEMV kernels), all-reduce"),
    Rule("dense_mlp.large", "dense_mlp", _dense_variants, _dense_large_guard,
         kernel="dense_mlp_gemm", communicates=True, launches=2,
         doc="dense MLP for many tokens: gate_up GEMM with SiTU in its epilogue, down GEMM, all-reduce"),
]
