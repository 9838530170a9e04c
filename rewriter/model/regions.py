"""Named regions of a decoder layer: the unit of stock-kernel accounting.

The reference layers tag every op they emit with the region it belongs to
(``with region("kda.core"): ...``). The tracer copies the active region into
``node.meta["region"]``, so a traced graph knows, node by node, which part of
vLLM's stock decode would run it. ``rewriter.compiler.stock_kernels`` maps each region
to the kernels vLLM 0.33.0 launches for it.

In eager execution ``region`` only pushes a name on a stack; it costs nothing
that matters next to the math it wraps.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

# Every region a reference layer may emit, in layer order. Keep in sync with
# rewriter/compiler/stock_kernels.py (a test checks both directions).
REGIONS: tuple[str, ...] = (
    # AttnRes mixing + RMSNorm before attention (vLLM: attn_res(... input_layernorm))
    "attn_res.pre_attn",
    # KDA attention
    "kda.in_proj",        # in_proj_qkvgfab GEMM (q,k,v,g,f_a,beta packed)
    "kda.f_b_proj",       # f_b_proj GEMM (f_a -> full-rank decay gate)
    "kda.core",           # conv update, gates, recurrent update, sigmoid-gated RMSNorm
    # MLA attention
    "mla.qkv_a_g_proj",   # fused_qkv_a_g_proj GEMM (q_a | kv_a | g)
    "mla.q_kv_norm",      # q_a_layernorm + kv_a_layernorm
    "mla.q_b_proj",       # q_b_proj GEMM
    "mla.uk_absorb",      # BMM of q_nope with W_UK_T
    "mla.cache_insert",   # query concat + latent cache insert
    "mla.decode",         # MLA decode attention over the latent cache
    "mla.uv_absorb",      # BMM of latent output with W_UV
    "mla.gate",           # sigmoid output gate multiply
    # attention output projection (both kinds)
    "attn.o_proj",
    "attn.o_proj_all_reduce",
    # AttnRes mixing + RMSNorm before the MLP
    "attn_res.pre_mlp",
    # latent MoE
    "moe.router",          # fp32 gate GEMM
    "moe.down_proj",       # routed_expert_down_proj GEMM (7168 -> 3584)
    "moe.topk",            # sigmoid + bias top-k selection, renormalized weights
    "moe.experts",         # routed experts (grouped GEMMs, SiTU, weighted combine)
    "moe.shared",          # shared experts gate_up, SiTU, down
    "moe.tail_all_reduce", # one all-reduce of [latent partial | shared partial]
    "moe.tail",            # routed_expert_norm, routed_expert_up_proj, shared add
    # dense MLP (first layer)
    "mlp.gate_up",
    "mlp.act",
    "mlp.down",
    "mlp.all_reduce",
)

_stack: list[str] = []


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Tag everything computed inside with ``name`` (must be in REGIONS)."""
    if name not in REGIONS:
        raise ValueError(f"unknown region {name!r}; known: {', '.join(REGIONS)}")
    _stack.append(name)
    try:
        yield
    finally:
        _stack.pop()


def current_region() -> str | None:
    """The innermost active region, or None outside any."""
    return _stack[-1] if _stack else None
