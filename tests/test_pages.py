"""``rewriter.model.pages``: the MLA cache page vLLM binds for Kimi K3, held to vLLM 0.33's own
``Platform._align_hybrid_block_size`` (the model's real ``get_mamba_state_shape_from_config``),
and what ``compile --all-layers`` compiles for by default."""
from __future__ import annotations

import types

import pytest
import torch

from rewriter.model.config import KimiK3Config
from rewriter.model.pages import vllm_block_size


def test_kimi_k3_pages_at_tp_16_and_8():
    cfg = KimiK3Config.load("kimi-k3")
    assert [vllm_block_size(cfg, tp, c) for tp in (16, 8) for c in ("bf16", "fp8")] == [384, 768, 768, 1536]
    assert vllm_block_size(cfg, 16, "bf16", draft_tokens=7) == 384  # DSpark's 7 drafts still fit
    assert vllm_block_size(cfg, 16, "bf16", draft_tokens=8) == 512
    with pytest.raises(ValueError, match="TP 5 does not divide"):
        vllm_block_size(cfg, 5, "bf16")
    with pytest.raises(ValueError, match="'fp16'"):
        vllm_block_size(cfg, 16, "fp16")


def _vllm_block_size(cfg: KimiK3Config, tp: int, cache: str, drafts: int) -> int:
    """vLLM's own computation for the CUDA MLA backend Hopper picks: FlashAttention-MLA (kernel
    blocks of a multiple of 16, ``v1/attention/backends/mla/flashattn_mla.py``) for a bf16 cache,
    FlashMLA (64, ``flashmla.py``) for fp8; neither imports without CUDA, so each stands here as
    its declared block sizes."""
    pytest.importorskip("vllm")
    from vllm.config.cache import CacheConfig
    from vllm.model_executor import models
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf

    sizes = [MultipleOf(16)] if cache == "bf16" else [64]
    backend = types.SimpleNamespace(get_supported_kernel_block_sizes=lambda kv_cache_spec=None: sizes)
    text = types.SimpleNamespace(linear_attn_config={"num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
                                                      "short_conv_kernel_size": cfg.short_conv_kernel_size})

    def model_config(hf_config):
        return types.SimpleNamespace(dtype=torch.bfloat16, use_mla=True, architecture="KimiK3ForConditionalGeneration",
                                     hf_config=hf_config, get_num_kv_heads=lambda parallel_config: 1,
                                     get_head_size=lambda: cfg.mla_cache_entry)

    cache_config = CacheConfig(block_size=16 if cache == "bf16" else 64,
                               cache_dtype="auto" if cache == "bf16" else cache)
    cache_config.mamba_cache_mode = "none"
    vllm_config = types.SimpleNamespace(
        model_config=model_config(types.SimpleNamespace(text_config=text)), cache_config=cache_config,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=drafts) if drafts else None,
        compilation_config=types.SimpleNamespace(static_forward_context={}))
    vllm_config.with_hf_config = lambda h: types.SimpleNamespace(**{**vllm_config.__dict__,
                                                                    "model_config": model_config(h)})
    resolve = models.ModelRegistry.resolve_model_cls
    models.ModelRegistry.resolve_model_cls = lambda *a, **k: (KimiK3ForConditionalGeneration,
                                                              "KimiK3ForConditionalGeneration")
    try:
        Platform._align_hybrid_block_size(vllm_config, backend)
    finally:
        models.ModelRegistry.resolve_model_cls = resolve
    return cache_config.block_size


@pytest.mark.parametrize("tp", [16, 8, 4])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("drafts", [0, 7, 8])
def test_the_page_is_vllms(tp, cache, drafts):
    cfg = KimiK3Config.load("kimi-k3")
    assert vllm_block_size(cfg, tp, cache, drafts) == _vllm_block_size(cfg, tp, cache, drafts)
