"""MLA (multi-head latent attention) for decode, Kimi K3's NoPE variant with output gate.

Follows vLLM 0.33.0 ``models/kimi_k3/nvidia/mla.py``: one projection
``fused_qkv_a_g_proj`` gives the q LoRA input, the kv latent with its (unrotated) k_pe
part and the output gate; q and kv latents get their RMSNorms; ``q_b_proj`` expands
queries; for decode the query's no-PE part is absorbed into the latent space with
W_UK (from ``kv_b_proj``), attention runs over the 576-value latent cache, and W_UV
maps the latent result back to heads before the sigmoid gate and ``o_proj``.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from rewriter.model.config import KimiK3Config
from rewriter.model.layers.common import Weight, o_proj_all_reduce, rms_norm
from rewriter.model.layers.sharding import COLUMN, REPLICATED, ROW, Piece, Sharding
from rewriter.model.regions import region

k3 = torch.ops.k3


class MultiHeadLatentAttention(nn.Module):
    STATE_NAMES = ("kv_cache", "block_table", "seq_lens", "slot_mapping", "kv_scale")

    def __init__(self, cfg: KimiK3Config, tp: int, dtype: torch.dtype, tp_group: str):
        super().__init__()
        s = cfg.shard(tp)
        self.tp, self.tp_group = tp, tp_group
        self.heads = s.mla_heads
        self.q_lora, self.kv_lora = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = (self.nope + self.rope) ** -0.5
        self.fused_qkv_a_g_proj = Weight(
            (s.qkv_a_g, cfg.hidden_size), dtype,
            Sharding(0, (Piece(self.q_lora, split=False), Piece(self.kv_lora + self.rope, split=False),
                         Piece(cfg.num_attention_heads * self.v_dim))),
        )
        self.q_a_layernorm = Weight((self.q_lora,), dtype, REPLICATED)
        self.kv_a_layernorm = Weight((self.kv_lora,), dtype, REPLICATED)
        self.q_b_proj = Weight((s.q_b, self.q_lora), dtype, COLUMN)
        self.kv_b_proj = Weight((s.kv_b, self.kv_lora), dtype, COLUMN)
        self.o_proj = Weight((cfg.hidden_size, s.mla_o_in), dtype, ROW)
        self.shardings = {}
        self.split_sizes = [self.q_lora, self.kv_lora, self.rope, self.heads * self.v_dim]
        self.dims = dict(heads=self.heads, nope=self.nope, rope=self.rope, v_dim=self.v_dim, kv_lora=self.kv_lora,
                         eps=self.eps)

    def forward(self, x: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                slot_mapping: Tensor, kv_scale: Tensor) -> Tensor:
        """``kv_cache`` bf16, or fp8 E4M3 (vLLM's uint8 storage) with ``kv_scale`` its per-tensor
        scale (fp32 [1], vLLM's ``_k_scale``; unused for a bf16 cache)."""
        q_c, kv_c, k_pe, gate = mla_in_proj(x, self.fused_qkv_a_g_proj.weight, self.split_sizes)
        mqa_q, _ = mla_q_front(q_c, kv_c, k_pe, self.q_a_layernorm.weight, self.kv_a_layernorm.weight,
                               self.q_b_proj.weight, self.kv_b_proj.weight, kv_cache, slot_mapping, kv_scale,
                               **self.dims)
        o = mla_attend(mqa_q, kv_cache, block_table, seq_lens, kv_scale, self.kv_b_proj.weight, gate,
                       scale=self.scale, heads=self.heads, nope=self.nope, v_dim=self.v_dim, kv_lora=self.kv_lora)
        return o_proj_all_reduce(o, self.o_proj.weight, self.tp_group, self.tp)


def _kv_b(kv_b_weight: Tensor, heads: int, nope: int, v_dim: int, kv_lora: int) -> tuple[Tensor, Tensor]:
    """W_UK_T [H, P, L] and W_UV^T [H, V, L] as views of kv_b_proj (vLLM precomputes them after loading)."""
    return kv_b_weight.view(heads, nope + v_dim, kv_lora).split([nope, v_dim], dim=1)


def mla_in_proj(x: Tensor, weight: Tensor, split_sizes: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fused_qkv_a_g_proj, split into (q LoRA input, kv latent, k_pe, output gate)."""
    with region("mla.qkv_a_g_proj"):
        q_c, kv_c, k_pe, gate = torch.nn.functional.linear(x, weight).split(split_sizes, dim=-1)
        return q_c, kv_c, k_pe, gate


def mla_q_front(q_c: Tensor, kv_c: Tensor, k_pe: Tensor, q_a_norm: Tensor, kv_a_norm: Tensor, q_b_weight: Tensor,
                kv_b_weight: Tensor, kv_cache: Tensor, slot_mapping: Tensor, kv_scale: Tensor, *, heads: int,
                nope: int, rope: int, v_dim: int, kv_lora: int, eps: float) -> tuple[Tensor, None]:
    """q/kv norms, q_b_proj, W_UK absorption, [q_nope_latent | q_pe], latent cache insert.

    Returns the absorbed query [T, H, L + R] and the (empty) result of the cache insert.
    """
    with region("mla.q_kv_norm"):
        q_c = rms_norm(q_c, q_a_norm, eps)
        kv_c = rms_norm(kv_c, kv_a_norm, eps)
    with region("mla.q_b_proj"):
        q = torch.nn.functional.linear(q_c, q_b_weight).view(-1, heads, nope + rope)
    with region("mla.uk_absorb"):
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        w_uk_t = _kv_b(kv_b_weight, heads, nope, v_dim, kv_lora)[0]
        ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk_t).transpose(0, 1)  # [T, H, L]
    with region("mla.cache_insert"):
        inserted = k3.mla_cache_insert(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
        return torch.cat([ql_nope, q_pe], dim=-1), inserted


def mla_attend(mqa_q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_scale: Tensor,
               kv_b_weight: Tensor, gate: Tensor, *, scale: float, heads: int, nope: int, v_dim: int,
               kv_lora: int) -> Tensor:
    """Decode attention of the absorbed queries over the latent cache, W_UV back to heads, then
    the sigmoid output gate: [T, H * V]."""
    with region("mla.decode"):
        latent = k3.mla_decode(mqa_q, kv_cache, block_table, seq_lens, kv_scale, scale, kv_lora)
    with region("mla.uv_absorb"):
        w_uv = _kv_b(kv_b_weight, heads, nope, v_dim, kv_lora)[1].transpose(1, 2)
        o = torch.bmm(latent.transpose(0, 1), w_uv).transpose(0, 1).reshape(-1, heads * v_dim)
    with region("mla.gate"):
        return o * torch.sigmoid(gate)
