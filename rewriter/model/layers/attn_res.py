"""AttnRes ("attention residuals"): the learned mix over earlier block outputs that
replaces Kimi K3's plain residual add, followed by the RMSNorm of the next sub-block.

Math as in vLLM 0.33.0 ``models/kimi_k3/nvidia/ops/attn_res.py`` (one fused kernel
there), written functionally: the updated prefix sum and block buffer are returned
instead of written in place.
"""
from __future__ import annotations

import torch
from torch import Tensor


def attn_res(
    prefix: Tensor,
    delta: Tensor | None,
    blocks: Tensor,
    norm_weight: Tensor,
    qk_weight: Tensor,
    output_norm_weight: Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mix ``blocks[:, :num_blocks]`` and the running prefix sum, then RMSNorm.

    prefix: [T, D] running sum of the current block; delta: [T, D] or None, added to
    it first (rounded to the prefix dtype, as the kernel stores it); blocks: [T, NB, D]
    finished block outputs. When ``block_write_idx >= 0`` the updated prefix is stored
    as block ``block_write_idx``. Each source s gets the logit
    ``<s, norm_weight * qk_weight> / rms(s)``; the sources are averaged with the
    softmax of those logits, and the mix is normalized with ``output_norm_weight`` (None: not
    normalized, as vLLM's op does for the model's final AttnRes).
    Returns (normalized mix [T, D], updated prefix, updated blocks).
    """
    if delta is not None:
        prefix = prefix + delta
    if block_write_idx >= 0:
        blocks = torch.select_scatter(blocks, prefix, 1, block_write_idx)
    sources = torch.cat([blocks[:, :num_blocks], prefix.unsqueeze(1)], dim=1).float()  # [T, n+1, D]
    inv_rms = torch.rsqrt(sources.pow(2).mean(-1) + eps)  # [T, n+1]
    query = norm_weight.float() * qk_weight.float()  # [D]
    logits = (sources * query).sum(-1) * inv_rms
    mix = (torch.softmax(logits, dim=-1).unsqueeze(-1) * sources).sum(1)  # [T, D]
    if output_norm_weight is None:
        return mix.type_as(prefix), prefix, blocks
    mix = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + output_norm_eps)
    return (mix * output_norm_weight.float()).type_as(prefix), prefix, blocks
