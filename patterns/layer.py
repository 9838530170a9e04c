"""The rest of a layer, so that every op of the KDA+MoE, MLA+MoE and dense layers runs
inside some fused kernel:

- ``attn_res_norm``: AttnRes before attention (prefix add, block write, mix) with
  ``input_layernorm``; the block write goes to the block buffer in place, as in vLLM;
- ``mla_attend``: MLA decode attention over the paged latent cache, W_UV back to heads and
  the sigmoid output gate (one kernel: the split-context partials meet before W_UV);
- ``dense_mlp.small`` / ``dense_mlp.large``: layer 0's gate_up, SiTU, down and all-reduce,
  on GEMV kernels for up to ``DENSE_SMALL_MAX`` tokens, on the tensor-core GEMM above (and at
  one token where a rank's intermediate is too long for the GEMVs: TP 4 and below).
"""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.layers.attn_res import attn_res
from rewriter.layers.mla import mla_attend
from rewriter.layers.moe import mlp_down, mlp_up
from rewriter.rules import Match, Rule, RuleContext, common_guard, fused_op, token_range_guard

DENSE_SMALL_MAX = 1  # the GEMV kernels up to here, the GEMM above (measured: BENCHMARKS.md, layer 0's dense MLP)
# the GEMV kernels' down projection holds a row of the rank's intermediate in registers, at most 16 lanes x 4
# warps x 12 vectors of 8 (codegen/launchers/dense_mlp.py): Kimi K3's 33792 channels fit from TP 8 (4224); at
# TP 4 and below (8448 and more) the GEMM rule takes the one-token step too
DENSE_GEMV_MAX_INTER = 16 * 4 * 12 * 8


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
    return token_range_guard(lo, 64, f"the GEMM rule takes {lo}..64 tokens")(m)


RULES = [
    Rule("attn_res_norm", "layer", _attn_res_variants, common_guard,
         doc="AttnRes before attention (prefix add, block write, mix) + input_layernorm"),
    Rule("mla_attend", "layer", _mla_attend_variants, common_guard,
         doc="MLA decode over the paged latent cache + W_UV per head + sigmoid output gate"),
    Rule("dense_mlp.small", "layer", _dense_variants, _dense_small_guard,
         kernel="dense_mlp", communicates=True, launches=2,
         doc="dense MLP for few tokens: gate_up + SiTU, down (GEMV kernels), all-reduce"),
    Rule("dense_mlp.large", "layer", _dense_variants, _dense_large_guard,
         kernel="dense_mlp_gemm", communicates=True, launches=2,
         doc="dense MLP for many tokens: gate_up GEMM with SiTU in its epilogue, down GEMM, all-reduce"),
]
