"""One layer through the compiler at one decode shape: the driver the commands share.

``decode_shape`` fixes the shape a layer is specialized to (the MLA cache page defaults to the
one vLLM binds, ``rewriter.model.pages``); ``rewritten_layer`` builds the reference layer on
meta tensors, traces it and rewrites it with a rule set; ``served_batches`` says which batch
sizes a server builds programs for, so that ``compile --all-layers`` fills the kernel cache
for exactly what a server start will ask of it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from codegen.targets import MAX_TOKENS
from rewriter.compiler.rewrite import RewriteResult, rewrite
from rewriter.compiler.rules import RuleSet
from rewriter.compiler.trace import trace
from rewriter.model.config import KimiK3Config
from rewriter.model.layers import build_layer
from rewriter.model.pages import vllm_block_size
from rewriter.model.shape import DecodeShape

SERVED_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)  # one-token steps a server always builds


def decode_shape(cfg: KimiK3Config, *, batch: int, tp: int, rank: int = 0, dtype: torch.dtype = torch.bfloat16,
                 arch: str = "sm_100a", q: int = 1, context: int = 4096, block_size: int | None = None,
                 conv_layout: str = "SD", kv_cache_dtype: str = "bf16") -> DecodeShape:
    """The decode shape of one step; ``block_size`` None: the MLA cache page vLLM binds for this
    model, TP size, cache dtype and draft tokens (what a server's kernels are compiled for)."""
    if block_size is None:
        cfg.shard(tp)  # a TP size that does not divide the model is named before the page is worked out
        block_size = vllm_block_size(cfg, tp, kv_cache_dtype, q - 1)
    return DecodeShape(batch=batch, tp=tp, rank=rank, dtype=dtype, arch=arch, q=q, context=context,
                       block_size=block_size, conv_layout=conv_layout, kv_cache_dtype=kv_cache_dtype)


def rewritten_layer(cfg: KimiK3Config, layer: int, shape: DecodeShape, rules: RuleSet | None = None,
                    experts: str = "mxfp4") -> RewriteResult:
    """Layer ``layer`` of ``cfg`` (meta tensors: nothing allocated) traced at ``shape`` and
    rewritten by ``rules`` (default: the built-in rules)."""
    built = build_layer(cfg, layer, tp=shape.tp, rank=shape.rank, dtype=shape.dtype, experts=experts)
    return rewrite(trace(built, shape), rules)


def served_batches(capture_sizes: Iterable[int] = (), q: int = 1, max_requests: int | None = None
                   ) -> tuple[int, ...]:
    """Requests a step for which to build programs. One-token steps (q = 1): 1..8, 16, 32, 64 and
    vLLM's CUDA graph capture sizes up to 64. Verify steps of q tokens per request: the request
    counts of the uniform FULL graphs vLLM's V2 runner captures (``CudaGraphManager._init_candidates``:
    each capture size rounded up to whole requests of q tokens, none past the largest capture size),
    up to 64 tokens; no other verify step is ever captured. Without capture sizes (a build ahead
    of the server, ``compile --all-layers``) the token counts of one-token steps stand for them.
    ``max_requests`` (vLLM's ``max_num_seqs``): no step has more requests, so no graph of more is
    captured and none is built."""
    capture_sizes = [s for s in capture_sizes if s >= 1]
    if q > 1 and not capture_sizes:
        capture_sizes = list(SERVED_BATCHES)
    if q == 1:
        batches = {*SERVED_BATCHES, *(s for s in capture_sizes if s <= MAX_TOKENS)}
    else:
        ceiling = min(MAX_TOKENS, max(capture_sizes, default=0))
        batches = {-(-s // q) for s in capture_sizes if -(-s // q) * q <= ceiling}
    return tuple(sorted(b for b in batches if max_requests is None or b <= max_requests))
