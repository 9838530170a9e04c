"""A new fusion rule in a few lines: top-k routing inside the routed-experts kernel.

    python -m rewriter inspect --layer 1 --tp 16 --rules examples/custom_rule.py
    python examples/custom_rule.py                 # prints the kernel count with and without it
"""
import torch
from torch import Tensor

from rewriter.compiler.rules import Rule, common_guard, fused_op
from rewriter.model.layers.moe import experts_down, experts_up, route


@fused_op("topk_routed_experts")  # the fused op: its CPU reference is the math it replaces
def topk_routed_experts(logits: Tensor, bias: Tensor, x_latent: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                        w2_scale: Tensor, top_k: int, scaling: float, beta: float, linear_beta: float,
                        layout: str) -> Tensor:
    weights, ids = route(logits, bias, top_k=top_k, renormalize=True, scaling=scaling)
    return experts_down(experts_up(x_latent, ids, w13, w13_scale, layout=layout, beta=beta, linear_beta=linear_beta),
                        weights, ids, w2, w2_scale, layout=layout)


def variants(ctx):
    moe = getattr(ctx.layer, "block_sparse_moe", None)
    if moe is None or not moe.renormalize or not moe.experts.routed_experts.format.quantized:
        return []  # the served MXFP4 experts only
    k, scale, act, layout = moe.top_k, moe.scaling, moe.act, moe.experts.routed_experts.format.layout

    def pattern(logits, bias, x_latent, w13, w13_scale, w2, w2_scale):  # plain PyTorch: what to find
        weights, ids = route(logits, bias, top_k=k, renormalize=True, scaling=scale)
        return experts_down(experts_up(x_latent, ids, w13, w13_scale, layout=layout, **act), weights, ids, w2,
                            w2_scale, layout=layout)

    def replacement(logits, bias, x_latent, w13, w13_scale, w2, w2_scale):  # same arguments: what to put instead
        return torch.ops.k3f.topk_routed_experts(logits, bias, x_latent, w13, w13_scale, w2, w2_scale, k, scale,
                                                 act["beta"], act["linear_beta"], layout)

    return [(pattern, replacement)]


# two launches, as the routed experts take: top-k + gate/up + SiTU, then down + weighted sum
RULES = [Rule("topk_routed_experts", "moe", variants, common_guard, kernel="topk_routed_experts", launches=2)]

if __name__ == "__main__":
    from patterns import default_rules
    from rewriter import KimiK3Config
    from rewriter.compiler.pipeline import decode_shape, rewritten_layer
    from rewriter.compiler.schedule import build_schedule

    cfg = KimiK3Config.preset("kimi-k3")
    for extra in ([], RULES):
        rs = default_rules()
        for r in extra:
            rs.add(r)
        kernels = build_schedule(rewritten_layer(cfg, 1, decode_shape(cfg, batch=1, tp=16), rs).after).kernels
        print(f"{len(rs)} rules:", sum(k.launches for k in kernels), "kernels")
