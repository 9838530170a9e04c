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

from rewriter.config import KimiK3Config
from rewriter.layers.common import Weight, rms_norm
from rewriter.layers.sharding import COLUMN, REPLICATED, ROW, Piece, Sharding
from rewriter.regions import region

k3 = torch.ops.k3


class MultiHeadLatentAttention(nn.Module):
    STATE_NAMES = ("kv_cache", "block_table", "seq_lens", "slot_mapping")

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

    def _kv_b(self) -> tuple[Tensor, Tensor]:
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.kv_lora)
        return w.split([self.nope, self.v_dim], dim=1)

    def w_uk_t(self) -> Tensor:
        """W_UK_T [H, P, L], a view of kv_b_proj (vLLM precomputes it after loading)."""
        return self._kv_b()[0]

    def w_uv(self) -> Tensor:
        """W_UV [H, L, V], a view of kv_b_proj."""
        return self._kv_b()[1].transpose(1, 2)

    def forward(self, x: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                slot_mapping: Tensor) -> Tensor:
        with region("mla.qkv_a_g_proj"):
            projected = torch.nn.functional.linear(x, self.fused_qkv_a_g_proj.weight)
            q_c, kv_c, k_pe, gate = projected.split(
                [self.q_lora, self.kv_lora, self.rope, self.heads * self.v_dim], dim=-1)
        with region("mla.q_kv_norm"):
            q_c = rms_norm(q_c, self.q_a_layernorm.weight, self.eps)
            kv_c = rms_norm(kv_c, self.kv_a_layernorm.weight, self.eps)
        with region("mla.q_b_proj"):
            q = torch.nn.functional.linear(q_c, self.q_b_proj.weight).view(-1, self.heads, self.nope + self.rope)
        with region("mla.uk_absorb"):
            q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
            ql_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk_t()).transpose(0, 1)  # [T, H, L]
        with region("mla.cache_insert"):
            mqa_q = torch.cat([ql_nope, q_pe], dim=-1)
            k3.mla_cache_insert(kv_cache, kv_c, k_pe, slot_mapping)
        with region("mla.decode"):
            latent = k3.mla_decode(mqa_q, kv_cache, block_table, seq_lens, self.scale, self.kv_lora)
        with region("mla.uv_absorb"):
            o = torch.bmm(latent.transpose(0, 1), self.w_uv()).transpose(0, 1).reshape(-1, self.heads * self.v_dim)
        with region("mla.gate"):
            o = o * torch.sigmoid(gate)
        with region("attn.o_proj"):
            out = torch.nn.functional.linear(o, self.o_proj.weight)
        with region("attn.o_proj_all_reduce"):
            return k3.all_reduce(out, self.tp_group, self.tp)
