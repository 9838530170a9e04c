"""A fusion rule that reaches the GPU with no kernel written for it: the shared experts (gate and
up projection, SiTU, down projection) as one fused op of your own. The compiler lowers the op's
reference into two generated kernels (the packed gate-and-up weight as two products meeting in
the SiTU epilogue; then the down projection) on its skinny GEMV main loop.

    python -m rewriter inspect --layer 1 --tp 16 --rules examples/generated_rule.py
    python -m rewriter compile --layer 1 --tp 16 --batch 1 8 --rules examples/generated_rule.py
    python -m rewriter bench --layer 1 --tp 16 --batch 1 8 --paths rewritten --rules examples/generated_rule.py

A rules file's rules are tried before the built-in ones, so this rule takes the shared experts
from the built-in ``shared_experts`` rule (same pattern, same size).
"""
import torch
from torch import Tensor

from rewriter.compiler.rules import Rule, common_guard, fused_op
from rewriter.model.layers.moe import shared_experts_down, shared_experts_up


@fused_op("my_shared_experts")  # the fused op: its reference is the math it replaces, and what is lowered
def my_shared_experts(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, beta: float | None,
                      linear_beta: float | None) -> Tensor:
    return shared_experts_down(shared_experts_up(x, gate_up_weight, beta=beta, linear_beta=linear_beta), down_weight)


def variants(ctx):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None:
        return []
    act = moe.act

    def pattern(x, gate_up_weight, down_weight):  # plain PyTorch: what to find
        return shared_experts_down(shared_experts_up(x, gate_up_weight, **act), down_weight)

    def replacement(x, gate_up_weight, down_weight):  # same arguments: what to put instead
        return torch.ops.k3f.my_shared_experts(x, gate_up_weight, down_weight, act["beta"], act["linear_beta"])

    return [(pattern, replacement)]


# two launches (the down projection needs the whole activation); beside the main stream, as the
# built-in shared experts run
RULES = [Rule("my_shared_experts", "moe", variants, common_guard, kernel="my_shared_experts", stream="aux",
              launches=2)]
