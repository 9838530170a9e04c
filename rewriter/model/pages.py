"""The MLA cache page size vLLM 0.33 binds for a hybrid model on a CUDA GPU, so that the kernels
specialized to it (``mla_attend``, the q-front's cache insert) can be compiled ahead of a server.

vLLM fixes it only after the model is built (``Platform._align_hybrid_block_size``,
``vllm/platforms/interface.py``): an attention page must hold at least one slot's KDA state,
so the block size is the smallest multiple of 128 tokens (MLA's floor; the CUDA MLA backends'
kernel blocks, 16 for FlashAttention-MLA and 64 for FlashMLA, divide it) whose latent entries
take as many bytes as one layer's conv and recurrent state:

    state  = 3 * kda_heads / tp * kda_head_dim * (conv_kernel - 1 + draft_tokens) * 2   (bf16 conv)
           + kda_heads / tp * kda_head_dim ** 2 * 4                                   (fp32 recurrent)
    block  = 128 * ceil(state / (128 * entry_bytes))     entry_bytes: 576 x 2 (bf16) or x 1 (fp8)

Kimi K3: 384 tokens at TP 16 with a bf16 cache, 768 with fp8; 768 and 1536 at TP 8.
``tests/test_pages.py`` holds it to vLLM's own function.
"""
from __future__ import annotations

import math

from rewriter.model.config import KimiK3Config

MLA_BLOCK_ALIGN = 128  # vLLM aligns an MLA model's hybrid block size to 128 tokens
CONV_BYTES, RECURRENT_BYTES = 2, 4  # vLLM's KDA state dtypes: bf16 conv, fp32 recurrent (its defaults)
CACHE_BYTES = {"bf16": 2, "fp8": 1}


def kda_state_bytes(cfg: KimiK3Config, tp: int, draft_tokens: int = 0) -> int:
    """One slot's KDA conv and recurrent state of one layer on one rank, as vLLM sizes its page."""
    heads = cfg.kda_num_heads // tp
    conv = 3 * heads * cfg.kda_head_dim * (cfg.short_conv_kernel_size - 1 + draft_tokens) * CONV_BYTES
    return conv + heads * cfg.kda_head_dim ** 2 * RECURRENT_BYTES


def vllm_block_size(cfg: KimiK3Config, tp: int, kv_cache_dtype: str, draft_tokens: int = 0) -> int:
    """The MLA cache page (tokens) vLLM binds at this TP size, cache dtype and draft tokens a step."""
    if kv_cache_dtype not in CACHE_BYTES:
        raise ValueError(f"kv cache dtype {kv_cache_dtype!r}: one of {', '.join(CACHE_BYTES)}")
    if tp < 1 or cfg.kda_num_heads % tp:
        raise ValueError(f"TP {tp} does not divide the {cfg.kda_num_heads} KDA heads")
    entry = cfg.mla_cache_entry * CACHE_BYTES[kv_cache_dtype]
    return MLA_BLOCK_ALIGN * math.ceil(kda_state_bytes(cfg, tp, draft_tokens) / (MLA_BLOCK_ALIGN * entry))
