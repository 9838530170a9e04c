"""One Kimi K3 decoder layer for decode: AttnRes, attention (KDA or MLA), AttnRes, MLP.

Follows vLLM 0.33.0 ``KimiDecoderLayer`` (``models/kimi_k3/nvidia/model.py``): the layer
takes the previous layer's MLP output (``hidden_states``; none at layer 0), the running
prefix sum of the current AttnRes block and the buffer of finished blocks, and returns
the three updated. Layers whose index is a multiple of ``attn_res_block_size`` start a
new block: they store the prefix as a finished block and restart the sum at their
attention output.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from rewriter.model.config import ConfigError, KimiK3Config
from rewriter.model.layers.attn_res import attn_res
from rewriter.model.layers.common import Weight
from rewriter.model.layers.experts import ExpertFormat
from rewriter.model.layers.kda import KimiDeltaAttention
from rewriter.model.layers.mla import MultiHeadLatentAttention
from rewriter.model.layers.moe import KimiMLP, KimiMoE
from rewriter.model.layers.sharding import REPLICATED
from rewriter.model.regions import region


class KimiDecoderLayer(nn.Module):
    """Shared body of the KDA- and MLA-attention layers (their ``forward`` differs in state)."""

    def __init__(self, cfg: KimiK3Config, layer_idx: int, tp: int = 1, rank: int = 0,
                 dtype: torch.dtype = torch.bfloat16, tp_group: str = "tp", experts: ExpertFormat | str = "bf16"):
        super().__init__()
        cfg.check_layer(layer_idx)
        reasons = cfg.unsupported_for_reference()
        if reasons:
            raise ConfigError(f"{cfg.name}: the reference layers do not implement: " + "; ".join(reasons))
        if not 0 <= rank < tp:
            raise ConfigError(f"rank {rank} out of range for TP {tp}")
        cfg.shard(tp)  # validates that tp divides every sharded size
        self.config, self.layer_idx, self.tp, self.rank = cfg, layer_idx, tp, rank
        self.kind = cfg.layer_kind(layer_idx)
        self.attention_kind = cfg.attention_kind(layer_idx)
        self.eps = cfg.rms_norm_eps
        attn_cls = KimiDeltaAttention if self.attention_kind == "kda" else MultiHeadLatentAttention
        self.self_attn = attn_cls(cfg, tp, dtype, tp_group)
        if cfg.is_moe_layer(layer_idx):
            self.block_sparse_moe = KimiMoE(cfg, tp, dtype, tp_group, experts)
        else:
            self.mlp = KimiMLP(cfg, tp, dtype, tp_group)
        hidden = cfg.hidden_size
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            setattr(self, name, Weight((hidden,), dtype, REPLICATED))
        self.self_attention_res_proj = Weight((1, hidden), dtype, REPLICATED)
        self.mlp_res_proj = Weight((1, hidden), dtype, REPLICATED)
        block = cfg.attn_res_block_size
        self.is_block_write_layer = layer_idx % block == 0
        self.block_write_idx = layer_idx // block
        self.prev_valid_blocks = math.ceil(layer_idx / block)
        self.mlp_blocks = self.prev_valid_blocks + int(self.is_block_write_layer)
        self.shardings = {}

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    @property
    def state_names(self) -> tuple[str, ...]:
        return self.self_attn.STATE_NAMES

    def _forward(self, hidden_states: Tensor | None, prefix_sum: Tensor, blocks: Tensor,
                 attn_state: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor]:
        delta = hidden_states if self.layer_idx > 0 else None  # vLLM feeds layer 0 no delta
        with region("attn_res.pre_attn"):
            x, prefix, blocks = attn_res(
                prefix_sum, delta, blocks, self.self_attention_res_norm.weight,
                self.self_attention_res_proj.weight.squeeze(0), self.input_layernorm.weight,
                num_blocks=self.prev_valid_blocks,
                block_write_idx=self.block_write_idx if self.is_block_write_layer else -1,
                eps=self.eps, output_norm_eps=self.eps)
        attn_out = self.self_attn(x, *attn_state)
        # a block-writing layer restarts the running sum at its attention output
        prefix, delta = (attn_out, None) if self.is_block_write_layer else (prefix, attn_out)
        with region("attn_res.pre_mlp"):
            x, prefix, _ = attn_res(
                prefix, delta, blocks, self.mlp_res_norm.weight, self.mlp_res_proj.weight.squeeze(0),
                self.post_attention_layernorm.weight, num_blocks=self.mlp_blocks, block_write_idx=-1,
                eps=self.eps, output_norm_eps=self.eps)
        return self.feed_forward(x), prefix, blocks

    @property
    def structure(self) -> tuple:
        """What a layer's graph depends on besides its weights: layers with the same structure
        trace, rewrite and compile alike (Kimi K3 has 24 among its 93 layers)."""
        return (self.attention_kind, self.kind, self.layer_idx == 0, self.prev_valid_blocks, self.is_block_write_layer,
                self.expert_format)

    @property
    def expert_format(self) -> ExpertFormat | None:
        moe = getattr(self, "block_sparse_moe", None)
        return None if moe is None else moe.experts.routed_experts.format

    def live_fractions(self) -> dict[str, float]:
        """Parameters of which only a share holds real values (the zero-padded expert shards)."""
        moe = getattr(self, "block_sparse_moe", None)
        live = 1.0 if moe is None else moe.experts.routed_experts.live_fraction()
        if live == 1.0:
            return {}
        return {f"block_sparse_moe.experts.routed_experts.{name}": live
                for name, _ in moe.experts.routed_experts.named_parameters()}

    def param_shardings(self) -> dict:
        """Sharding of every parameter, by its (vLLM) name (None: made per rank, never cut)."""
        out = {}
        for mod_name, mod in self.named_modules():
            for p_name, _ in mod.named_parameters(recurse=False):
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = mod.shardings[p_name]
        return out


class KDADecoderLayer(KimiDecoderLayer):
    def forward(self, hidden_states: Tensor | None, prefix_sum: Tensor, blocks: Tensor, conv_state: Tensor,
                recurrent_state: Tensor, state_indices: Tensor, num_accepted: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """``num_accepted`` given: a speculative verify step (``state_indices`` [requests, q])."""
        state = (conv_state, recurrent_state, state_indices)
        return self._forward(hidden_states, prefix_sum, blocks,
                             state if num_accepted is None else (*state, num_accepted))


class MLADecoderLayer(KimiDecoderLayer):
    def forward(self, hidden_states: Tensor | None, prefix_sum: Tensor, blocks: Tensor, kv_cache: Tensor,
                block_table: Tensor | None, seq_lens: Tensor, slot_mapping: Tensor, kv_scale: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        return self._forward(hidden_states, prefix_sum, blocks,
                             (kv_cache, block_table, seq_lens, slot_mapping, kv_scale))


def layer_structures(cfg: KimiK3Config, tp: int = 1, rank: int = 0, experts: ExpertFormat | str = "bf16"
                     ) -> dict[tuple, list[int]]:
    """The model's distinct layer structures (``KimiDecoderLayer.structure``), each with the
    layers that have it (built on meta: nothing allocated)."""
    out: dict[tuple, list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        out.setdefault(build_layer(cfg, i, tp=tp, rank=rank, experts=experts).structure, []).append(i)
    return out


def build_layer(cfg: KimiK3Config, layer_idx: int, tp: int = 1, rank: int = 0, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "meta", tp_group: str = "tp",
                experts: ExpertFormat | str = "bf16") -> KimiDecoderLayer:
    """Layer ``layer_idx`` of rank ``rank`` at TP ``tp``, parameters uninitialized on ``device``;
    routed experts in ``experts`` (an ``ExpertFormat`` or its name: ``bf16``, ``mxfp4``, ...).

    On "meta" (the default) nothing is allocated, so the full-size model builds anywhere.
    """
    cls = KDADecoderLayer if cfg.attention_kind(layer_idx) == "kda" else MLADecoderLayer
    with torch.device(device):
        return cls(cfg, layer_idx, tp, rank, dtype, tp_group, experts)
