"""KDA (Kimi Delta Attention) for decode, Kimi K3's full-rank-gate variant.

Follows vLLM 0.33.0 ``models/kimi_k3/nvidia/kda.py`` (``KimiK3DeltaAttention``):
one packed projection ``in_proj_qkvgfab`` (q, k, v, output gate g, the gate's low-rank
input f_a, beta), ``f_b_proj`` lifting f_a to a full-rank decay gate, a width-4 short
convolution with SiLU on q, k, v (bf16 state), an L2-normalized delta-rule update of
an fp32 [V, K] state per head with a per-channel decay bounded below by
``gate_lower_bound``, a sigmoid-gated RMSNorm and ``o_proj`` with its all-reduce.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from rewriter.model.config import KimiK3Config
from rewriter.model.layers.common import Weight, l2_normalize, o_proj_all_reduce
from rewriter.model.layers.sharding import COLUMN, REPLICATED, ROW, Piece, Sharding
from rewriter.model.regions import region

k3 = torch.ops.k3


class KimiDeltaAttention(nn.Module):
    STATE_NAMES = ("conv_state", "recurrent_state", "state_indices")

    def __init__(self, cfg: KimiK3Config, tp: int, dtype: torch.dtype, tp_group: str):
        super().__init__()
        s = cfg.shard(tp)
        self.tp, self.tp_group = tp, tp_group
        self.heads, self.head_dim, self.proj = s.kda_heads, cfg.kda_head_dim, s.kda_projection
        self.conv_size = cfg.short_conv_kernel_size
        self.lower_bound = cfg.gate_lower_bound
        self.norm_eps = 1e-5  # FusedRMSNormGated's default, as vLLM constructs o_norm
        full_proj = cfg.kda_num_heads * cfg.kda_head_dim
        self.split_sizes = [3 * self.proj, self.proj, self.head_dim, self.heads, s.in_proj_padding]
        self.in_proj_qkvgfab = Weight(
            (s.in_proj_qkvgfab, cfg.hidden_size), dtype,
            Sharding(0, (Piece(full_proj),) * 4 + (Piece(cfg.kda_head_dim, split=False), Piece(cfg.kda_num_heads)),
                     align=16),
        )
        self.f_b_proj = Weight((self.proj, self.head_dim), dtype, COLUMN)
        self.dt_bias = nn.Parameter(torch.empty(self.proj, dtype=torch.float32), requires_grad=False)
        self.conv1d = Weight((3 * self.proj, 1, self.conv_size), torch.float32, Sharding(0, (Piece(full_proj),) * 3))
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.o_norm = Weight((self.head_dim,), dtype, REPLICATED)
        self.o_proj = Weight((cfg.hidden_size, self.proj), dtype, ROW)
        self.shardings = {"dt_bias": COLUMN, "A_log": COLUMN}

    def forward(self, x: Tensor, conv_state: Tensor, recurrent_state: Tensor, state_indices: Tensor,
                num_accepted: Tensor | None = None) -> Tensor:
        """``num_accepted`` given: a speculative verify step (``state_indices`` [requests, q])."""
        mixed_qkv, g_out, f_a, beta = kda_in_proj(x, self.in_proj_qkvgfab.weight, self.split_sizes)
        o = kda_core(mixed_qkv, g_out, f_a, beta, self.f_b_proj.weight, self.conv1d.weight, self.A_log, self.dt_bias,
                     self.o_norm.weight, conv_state, recurrent_state, state_indices, num_accepted, heads=self.heads,
                     head_dim=self.head_dim, lower_bound=self.lower_bound, eps=self.norm_eps)
        return o_proj_all_reduce(o, self.o_proj.weight, self.tp_group, self.tp)

    def state_shapes(self, slots: int, dtype: torch.dtype, spec_rows: int = 0
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes of the decode state vLLM keeps per slot (conv state dim-first, bf16, with
        ``spec_rows`` more rows when it verifies that many drafted tokens; fp32 recurrent)."""
        return {
            "conv_state": ((slots, 3 * self.proj, self.conv_size - 1 + spec_rows), dtype),
            "recurrent_state": ((slots, self.heads, self.head_dim, self.head_dim), torch.float32),
        }


def kda_in_proj(x: Tensor, weight: Tensor, split_sizes: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed projection, split into (q|k|v, output gate g, f_a, beta); padding dropped."""
    with region("kda.in_proj"):
        mixed_qkv, g_out, f_a, beta, _ = torch.nn.functional.linear(x, weight).split(split_sizes, dim=-1)
        return mixed_qkv, g_out, f_a, beta


def kda_decay(g1: Tensor, a_log: Tensor, dt_bias: Tensor, heads: int, head_dim: int,
              lower_bound: float | None) -> Tensor:
    """Log decay per channel: lb*sigmoid(e^A (g + dt_bias)), or -e^A softplus(g + dt_bias) unbounded."""
    g = g1.float().view(-1, heads, head_dim) + dt_bias.view(heads, head_dim)
    a = torch.exp(a_log).view(1, heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * torch.nn.functional.softplus(g)


def kda_core(mixed_qkv: Tensor, g_out: Tensor, f_a: Tensor, beta: Tensor, f_b_weight: Tensor, conv_weight: Tensor,
             a_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, conv_state: Tensor, recurrent_state: Tensor,
             state_indices: Tensor, num_accepted: Tensor | None = None, *, heads: int, head_dim: int,
             lower_bound: float | None, eps: float) -> Tensor:
    """f_b_proj, short conv, gates, delta-rule update and sigmoid-gated RMSNorm; states updated in
    place. With ``num_accepted`` a verify step in vLLM's multi-slot contract (``k3::kda_*_verify``)."""
    with region("kda.f_b_proj"):
        g1 = torch.nn.functional.linear(f_a, f_b_weight)
    with region("kda.core"):
        if num_accepted is None:
            qkv = k3.kda_conv_update(mixed_qkv, conv_state, conv_weight.flatten(1), state_indices)
        else:
            qkv = k3.kda_conv_verify(mixed_qkv, conv_state, conv_weight.flatten(1), state_indices, num_accepted)
        q, k, v = qkv.view(-1, 3, heads, head_dim).unbind(1)
        q = l2_normalize(q) * head_dim**-0.5
        k = l2_normalize(k)
        decay = kda_decay(g1, a_log, dt_bias, heads, head_dim, lower_bound)
        if num_accepted is None:
            o = k3.kda_recurrent_step(q, k, v, decay, torch.sigmoid(beta.float()), recurrent_state, state_indices)
        else:
            o = k3.kda_recurrent_verify(q, k, v, decay, torch.sigmoid(beta.float()), recurrent_state, state_indices,
                                        num_accepted)
        of = o.float()  # sigmoid-gated RMSNorm per head (FusedRMSNormGated, activation="sigmoid")
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
        gate = torch.sigmoid(g_out.float().view(-1, heads, head_dim))
        return (of * gate).type_as(mixed_qkv).view(-1, heads * head_dim)

