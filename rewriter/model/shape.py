"""DecodeShape: the fixed shape a layer is traced, rewritten and compiled for."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codegen.targets import ARCHES

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONV_LAYOUTS = ("SD", "DS")  # vLLM's VLLM_SSM_CONV_STATE_LAYOUT: per slot [3, dim] (its default) or [dim, 3]
KV_CACHE_DTYPES = ("bf16", "fp8")  # the MLA latent cache: bf16, or fp8 E4M3 with a per-tensor scale


class ShapeError(ValueError):
    """A decode shape that cannot be traced (bad batch, rank, dtype, ...)."""


@dataclass(frozen=True)
class DecodeShape:
    """One decode step: ``batch`` requests of ``q`` tokens each (q > 1: speculative verify).

    ``context`` is the number of tokens each request already holds in the MLA latent
    cache before this step and ``block_size`` the cache's page size; both only set
    cache sizes and the bytes an attention step reads. ``conv_layout`` is how vLLM keeps
    each KDA slot's conv state (``SD``: [3, dim], its default; ``DS``: [dim, 3]): the
    kernels read it in place, so it is part of what they are compiled for. ``kv_cache_dtype`` is
    the MLA latent cache's: ``bf16`` or ``fp8`` (E4M3 with one per-tensor scale, vLLM's
    ``--kv-cache-dtype fp8``).
    """

    batch: int
    tp: int = 1
    rank: int = 0
    dtype: torch.dtype = torch.bfloat16
    arch: str = "sm_100a"
    q: int = 1
    context: int = 4096
    block_size: int = 64
    conv_layout: str = "SD"
    kv_cache_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("batch", "tp", "q", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ShapeError(f"DecodeShape.{name} must be a positive int, got {v!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.tp:
            raise ShapeError(f"DecodeShape.rank must be in 0..{self.tp - 1} for TP {self.tp}, got {self.rank!r}")
        if not isinstance(self.context, int) or self.context < 0:
            raise ShapeError(f"DecodeShape.context must be an int >= 0, got {self.context!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ShapeError(f"DecodeShape.dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.conv_layout not in CONV_LAYOUTS:
            raise ShapeError(f"DecodeShape.conv_layout must be one of {', '.join(CONV_LAYOUTS)}, "
                             f"got {self.conv_layout!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ShapeError(f"DecodeShape.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.arch not in ARCHES:
            raise ShapeError(f"DecodeShape.arch must be one of {', '.join(ARCHES)}, got {self.arch!r}")

    @property
    def tokens(self) -> int:
        return self.batch * self.q

    @property
    def seq_len(self) -> int:
        """Cached tokens per request once this step's tokens are inserted."""
        return self.context + self.q
