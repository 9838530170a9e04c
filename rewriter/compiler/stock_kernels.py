"""Stock kernel accounting: what vLLM 0.33.0 launches for each region of a Kimi K3 layer.

Why this exists: the rewriter's claims ("N kernels become M") need an honest baseline.
This module is that baseline, written down as plain data: for every region in
``rewriter.model.regions.REGIONS`` it lists the GPU kernels that vLLM 0.33.0's *stock* decode
path launches for it (not the opt-in ``decode_backend: latency_specialized`` executor),
for a pure decode step (q = 1 token per request, no speculation) of the released Kimi K3
checkpoint (BF16 attention / shared / dense weights, MXFP4 routed experts, BF16 KV cache).

Every row names the file inside the ``vllm`` package it was read from. The facts were
read from vLLM's Python source; a few counts live inside compiled or third-party kernels
(FlashInfer's TRT-LLM-gen MoE and MLA, FA3's split-KV combine, the ``_moe_C`` align op);
those rows say so in their ``note``. Nothing here imports torch or vLLM.

Conditions that change the list are encoded: arch family (``sm_90*`` Hopper vs
``sm_100*``/``sm_103*`` Blackwell), TP size (TP 1 has no all-reduce; the fused latent-MoE
tail exists only at TP 8/16 on Blackwell; the native KDA decode kernel needs 12/24/48/96
local heads) and token count (stream and tier thresholds). The setup assumed is vLLM's
default for this model: tensor parallel only (no DP/EP/SP/PP), CUDA graphs on (the
architecture defaults to breakable CUDA graphs, so torch.compile is off and CustomOps run
their CUDA kernels), ``--kv-cache-dtype auto``, FlashInfer autotuning on, default env vars.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rewriter.model.regions import REGIONS

VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class StockKernel:
    """One kernel launch of vLLM's stock decode path.

    ``source`` is the vLLM file (path inside the ``vllm`` package) the launch was read
    from. ``stream`` is ``"aux"`` for launches vLLM puts on an auxiliary CUDA stream.
    """

    name: str
    source: str
    note: str = ""
    stream: str = "main"


# ---------------------------------------------------------------------------------------
# Source files (paths inside the vllm package of the vllm-0.33.0 wheel).
# ---------------------------------------------------------------------------------------
_MODEL = "models/kimi_k3/nvidia/model.py"
_ATTN_RES = "models/kimi_k3/nvidia/ops/attn_res.py"
_KDA = "models/kimi_k3/nvidia/kda.py"
_KDA_RECURRENT = "models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py"
_KDA_SKINNY = "models/kimi_k3/nvidia/ops/cute_dsl/kda_skinny_gemm.py"
_CONV1D = "model_executor/layers/mamba/ops/causal_conv1d.py"
_FLA_KDA = "third_party/flash_linear_attention/ops/kda.py"
_LLG = "models/kimi_k3/nvidia/low_latency_gemm.py"
_LINEAR = "model_executor/layers/linear.py"
_MLA = "models/kimi_k3/nvidia/mla.py"
_QKV_NORM = "models/common/ops/fused_qk_rmsnorm.py"
_MLA_CACHE = "models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py"
_FI_MLA = "v1/attention/backends/mla/flashinfer_mla.py"
_FA_MLA = "v1/attention/backends/mla/flashattn_mla.py"
_COMM = "distributed/device_communicators/cuda_communicator.py"
_FI_AR = "distributed/device_communicators/flashinfer_all_reduce.py"
_GEMM_AR = "model_executor/kernels/linear/cute_dsl/gemm_rs_ar.py"
_GATE = "model_executor/layers/fused_moe/router/gate_linear.py"
_LL_BF16 = "model_executor/kernels/linear/cute_dsl/ll_bf16.py"
_TRTLLM_MXFP4 = "model_executor/layers/fused_moe/experts/trtllm_mxfp4_moe.py"
_MXFP8 = "model_executor/layers/quantization/utils/mxfp8_utils.py"
_ORACLE_MXFP4 = "model_executor/layers/fused_moe/oracle/mxfp4.py"
_GROUPED_TOPK = "model_executor/layers/fused_moe/router/grouped_topk_router.py"
_HUMMING = "model_executor/layers/fused_moe/experts/fused_humming_moe.py"
_MOE_ALIGN = "model_executor/layers/fused_moe/moe_align_block_size.py"
_ACT = "model_executor/layers/activation.py"
_LAYERNORM = "model_executor/layers/layernorm.py"
_RUNNER = "models/kimi_k3/nvidia/latent_moe_runner.py"
_TAIL = "models/kimi_k3/nvidia/ops/latent_moe_tail.py"
_FUSED_AR_NORM = "model_executor/layers/fused_allreduce_gemma_rms_norm.py"
_MOE_RUNNER = "model_executor/layers/fused_moe/runner/moe_runner.py"

# Files read for each region (the decision logic, not only the launch sites).
STOCK_SOURCES: dict[str, tuple[str, ...]] = {
    "attn_res.pre_attn": (_MODEL, _ATTN_RES),
    "kda.in_proj": (_KDA, _LLG, _LINEAR),
    "kda.f_b_proj": (_KDA, _LLG, _KDA_SKINNY),
    "kda.core": (_KDA, _CONV1D, _KDA_RECURRENT, _FLA_KDA),
    "mla.qkv_a_g_proj": (_MLA, _LLG),
    "mla.q_kv_norm": (_MLA, _QKV_NORM),
    "mla.q_b_proj": (_MLA, _LLG, _LINEAR),
    "mla.uk_absorb": (_MLA,),
    "mla.cache_insert": (_MLA, _MLA_CACHE),
    "mla.decode": (_MLA, "platforms/cuda.py", _FI_MLA, _FA_MLA),
    "mla.uv_absorb": (_MLA,),
    "mla.gate": (_MLA,),
    "attn.o_proj": (_KDA, _MLA, _LINEAR, _LLG, _GEMM_AR, _MODEL),
    "attn.o_proj_all_reduce": (_LINEAR, _COMM, _FI_AR),
    "attn_res.pre_mlp": (_MODEL, _ATTN_RES),
    "moe.router": (_MODEL, _GATE, _LL_BF16),
    "moe.down_proj": (_MODEL, _LLG),
    "moe.topk": (_ORACLE_MXFP4, _TRTLLM_MXFP4, _GROUPED_TOPK, _MOE_RUNNER),
    "moe.experts": (_ORACLE_MXFP4, _TRTLLM_MXFP4, _MXFP8, _HUMMING, _MOE_ALIGN, _RUNNER),
    "moe.shared": (_MODEL, "model_executor/layers/fused_moe/runner/shared_experts.py", _ACT, _LLG),
    "moe.tail_all_reduce": (_RUNNER, _TAIL, _FUSED_AR_NORM, _COMM),
    "moe.tail": (_RUNNER, _TAIL, _MOE_RUNNER, _MODEL, _LLG),
    "mlp.gate_up": (_MODEL, _LLG, _LINEAR),
    "mlp.act": (_MODEL, _ACT),
    "mlp.down": (_MODEL, _LLG, _LINEAR, _GEMM_AR),
    "mlp.all_reduce": (_LINEAR, _COMM, _FI_AR),
}

# Regions each layer kind's decode step visits, in layer order.
_MOE_REGIONS = (
    "attn_res.pre_mlp",
    "moe.router",
    "moe.down_proj",
    "moe.topk",
    "moe.experts",
    "moe.shared",
    "moe.tail_all_reduce",
    "moe.tail",
)
_KDA_ATTN = ("attn_res.pre_attn", "kda.in_proj", "kda.f_b_proj", "kda.core",
             "attn.o_proj", "attn.o_proj_all_reduce")
_MLA_ATTN = ("attn_res.pre_attn", "mla.qkv_a_g_proj", "mla.q_kv_norm", "mla.q_b_proj",
             "mla.uk_absorb", "mla.cache_insert", "mla.decode", "mla.uv_absorb", "mla.gate",
             "attn.o_proj", "attn.o_proj_all_reduce")
LAYER_REGIONS: dict[str, tuple[str, ...]] = {
    "kda": _KDA_ATTN + _MOE_REGIONS,
    "mla": _MLA_ATTN + _MOE_REGIONS,
    "dense": _KDA_ATTN + ("attn_res.pre_mlp", "mlp.gate_up", "mlp.act", "mlp.down", "mlp.all_reduce"),
}

# ---------------------------------------------------------------------------------------
# Kimi K3 dimensions (released checkpoint) and vLLM thresholds read from the source.
# ---------------------------------------------------------------------------------------
_HIDDEN = 7168
_HEADS = 96                    # MLA heads and KDA heads
_HEAD_DIM = 128                # KDA head dim, MLA v head dim
_QK_HEAD_DIM = 128 + 64        # MLA nope + rope
_QKV_A_ROWS = 1536 + 512 + 64  # q_lora + kv_lora + rope rows of fused_qkv_a_g_proj
_Q_LORA = 1536
_LATENT = 3584                 # routed_expert_hidden_size
_SHARED_INTER = 2 * 3072       # 2 shared experts x moe_intermediate_size
_DENSE_INTER = 33792

_KDA_NATIVE_HEADS = (12, 24, 48, 96)        # kda.py is_fused_kda_decode_supported
_KDA_FLASHINFER_HEADS = (12, 24, 32, 48, 96)  # kda.py is_flashinfer_fused_kda_decode_supported
_KDA_OVERLAP_TP = 8                         # low_latency_gemm.py _KDA_TP_SIZE
_KDA_OVERLAP_MAX_TOKENS = 14                # KDA_PROJECTION_OVERLAP_MAX_TOKENS (after autotune)
_MLA_GATE_STREAM_TOKENS = 512               # mla.py _GATE_MULTI_STREAM_TOKEN_THRESHOLD (strict <)
_AUX_STREAM_TOKENS = 256                    # router/down_proj and shared-expert stream thresholds
_TAIL_FUSION_TPS = (8, 16)                  # latent_moe_tail.py _SUPPORTED_TP_SIZES
_TAIL_FUSION_MAX_TOKENS = 128               # latent_moe_tail.py _MAX_NUM_TOKENS
_TAIL_SKINNY_MAX_TOKENS = 5                 # latent_moe_tail.py _SKINNY_MAX_NUM_TOKENS
_LL_BF16_MAX_TOKENS = 16                    # gate_linear.py GateLinear.LL_BF16_MAX_TOKENS
_GEMM_AR_MIN_TOKENS = 128                   # gemm_rs_ar.py GemmRsAr.should_run
_LOW_LATENCY_MAX_TOKENS = 16                # low_latency_gemm.py plans cover M = 1..16

# FlashInfer fused all-reduce(+RMSNorm) budget in MB by capability and TP size
# (compilation/passes/fusion/allreduce_rms_fusion.py FI_ALLREDUCE_FUSION_MAX_SIZE_MB).
_FI_AR_MAX_MB: dict[str, dict[int, float]] = {
    "sm90": {2: 64, 4: 2, 8: 0.5},
    "sm100": {2: 64, 4: 32, 8: 1, 16: 64},
    "sm103": {2: 64, 4: 64, 8: 4, 16: 64},
}


def _m(*spans: tuple[int, int] | int) -> frozenset[int]:
    out: set[int] = set()
    for s in spans:
        if isinstance(s, int):
            out.add(s)
        else:
            out.update(range(s[0], s[1] + 1))
    return frozenset(out)


_NONE: frozenset[int] = frozenset()
# low_latency_gemm.py measured tables: local (N, K) -> (CuTe skinny-GEMM M set, dsv3 M set).
# CuTe wins over dsv3 when both list an M; anything else falls back to cuBLAS.
# KIMI_K3_PROJECTIONS is the sm_103 (and sm_107) table, KIMI_K3_PROJECTIONS_SM100 the
# sm_100 one, KIMI_K3_PROJECTIONS_SM90 the sm_90 one. lm_head shapes are omitted.
_LL_TABLES: dict[str, dict[tuple[int, int], tuple[frozenset[int], frozenset[int]]]] = {
    "sm103": {
        (1536, 128): (_NONE, _m((1, 16))),
        (3072, 128): (_NONE, _m((1, 16))),
        (1536, 7168): (_NONE, _m((1, 16))),
        (3072, 7168): (_m((1, 5)), _NONE),
        (2112, 7168): (_NONE, _m((1, 16))),
        (2304, 1536): (_NONE, _m((1, 16))),
        (4608, 1536): (_NONE, _m((1, 16))),
        (3584, 7168): (_m(1), _m((2, 8))),
        (6288, 7168): (_m((1, 4)), _NONE),
        (12448, 7168): (_m((1, 3)), _NONE),
        (7168, 768): (_NONE, _m((1, 16))),
        (7168, 1536): (_m(1), _NONE),
        (7168, 3072): (_m((1, 2)), _NONE),
        (7168, 3584): (_m((1, 2)), _NONE),
        (7168, 4224): (_m(1), _NONE),
        (7168, 8448): (_m((1, 3)), _NONE),
        (8448, 7168): (_m((1, 2)), _NONE),
        (16896, 7168): (_m((1, 2)), _NONE),
        (7168, 14336): (_m((1, 2)), _NONE),
        (3216, 7168): (_m((1, 5)), _m((9, 15))),
        (768, 7168): (_m((1, 4)), _m((5, 16))),
        (1152, 1536): (_m(1), _m((2, 16))),
        (768, 128): (_NONE, _m((1, 16))),
        (7168, 384): (_NONE, _m((1, 8))),
        (4224, 7168): (_m((1, 3)), _m((4, 8))),
    },
    "sm100": {
        (1536, 128): (_NONE, _m(1, 16)),
        (3072, 128): (_NONE, _m(8)),
        (1536, 7168): (_m((1, 2)), _m(4, 8)),
        (3072, 7168): (_m((1, 2)), _NONE),
        (2112, 7168): (_m((1, 2)), _m(4, 16)),
        (2304, 1536): (_NONE, _m((1, 16))),
        (4608, 1536): (_NONE, _m(1, 2, 4)),
        (6288, 7168): (_m(1), _NONE),
        (12448, 7168): (_m((1, 4)), _NONE),
        (7168, 768): (_NONE, _m(1)),
        (7168, 1536): (_m(1), _NONE),
        (7168, 3072): (_m((1, 2)), _NONE),
        (7168, 3584): (_m((1, 2)), _NONE),
        (7168, 8448): (_m((1, 3)), _NONE),
        (8448, 7168): (_m((1, 2)), _NONE),
        (16896, 7168): (_m(1), _NONE),
        (3584, 7168): (_m((1, 3)), _NONE),
        (768, 7168): (_m((1, 4)), _NONE),
        (1152, 1536): (_m(1), _NONE),
        (3216, 7168): (_m((1, 2)), _NONE),
        (4224, 7168): (_m((1, 3)), _NONE),
    },
    "sm90": {
        (1536, 128): (_NONE, _m((1, 8))),
        (3072, 128): (_NONE, _m(1, 2, 5, 6, 7, 8, 9)),
        (1536, 7168): (_m((1, 6)), _m((7, 16))),
        (3072, 7168): (_m((1, 4)), _NONE),
        (2112, 7168): (_m((1, 4)), _m((5, 16))),
        (2304, 1536): (_m((1, 2)), _m((3, 8))),
        (4608, 1536): (_m((1, 3)), _NONE),
        (3584, 7168): (_m((1, 3)), _NONE),
        (6288, 7168): (_m((1, 3)), _NONE),
        (12448, 7168): (_m((1, 3)), _NONE),
        (7168, 768): (_m((1, 2)), _NONE),
        (7168, 1536): (_m((1, 2)), _NONE),
        (7168, 3072): (_m((1, 3)), _NONE),
        (7168, 3584): (_m((1, 3)), _NONE),
        (7168, 4224): (_m((1, 2)), _NONE),
        (7168, 8448): (_m((1, 2)), _NONE),
        (7168, 14336): (_m((1, 2)), _NONE),
    },
}


@dataclass(frozen=True)
class _Ctx:
    tp: int
    tokens: int
    arch: str
    family: str  # "hopper" | "blackwell"
    table: str   # "sm90" | "sm100" | "sm103"

    @property
    def blackwell(self) -> bool:
        return self.family == "blackwell"

    @property
    def heads(self) -> int:
        return _HEADS // self.tp

    @property
    def proj(self) -> int:  # TP-local heads * 128 (KDA projection / MLA v / o_proj K)
        return self.heads * _HEAD_DIM


_ARCH_RE = re.compile(r"sm_(90|100|103)[a-z]?")


def _parse_arch(arch: str) -> tuple[str, str]:
    m = _ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if m is None:
        raise ValueError(
            f"unsupported arch {arch!r}: expected sm_90* (Hopper) or sm_100*/sm_103* (Blackwell)"
        )
    cc = m.group(1)
    return ("hopper", "sm90") if cc == "90" else ("blackwell", "sm" + cc)


def _ctx(tp: int, tokens: int, arch: str) -> _Ctx:
    family, table = _parse_arch(arch)
    if not isinstance(tp, int) or tp < 1 or _HEADS % tp:
        raise ValueError(f"tp must be a positive divisor of {_HEADS} (Kimi K3 heads), got {tp!r}")
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    return _Ctx(tp=tp, tokens=tokens, arch=arch, family=family, table=table)


# ---------------------------------------------------------------------------------------
# Shared builders
# ---------------------------------------------------------------------------------------
def _gemm(c: _Ctx, label: str, n: int, k: int, *, packed_input: bool = True,
          stream: str = "main", low_latency: bool = True) -> StockKernel:
    """One BF16 linear: low_latency_gemm.py's shape/M plan, else cuBLAS via F.linear."""
    m = c.tokens
    backend = "cuBLAS"
    if low_latency and m <= _LOW_LATENCY_MAX_TOKENS and (packed_input or m == 1):
        cute, dsv3 = _LL_TABLES[c.table].get((n, k), (_NONE, _NONE))
        if m in cute:
            backend = "CuTe shape_dynamic_skinny_gemm"
        elif m in dsv3:
            backend = "dsv3_fused_a_gemm"
    note = f"local [{n} x {k}] BF16 weight, M={m}; backend picked by {_LLG} ({c.table} table)"
    if backend == "cuBLAS":
        note += "; cuBLAS may add a split-K reduce launch (heuristic, not visible in vLLM source)"
    return StockKernel(f"{label} GEMM [{backend}]", _LLG if backend != "cuBLAS" else _LINEAR,
                       note, stream)


def _all_reduce(c: _Ctx, what: str, width: int, src: str = _LINEAR) -> StockKernel:
    """One tensor_model_parallel_all_reduce; cuda_communicator.py picks one backend, one launch."""
    budget = _FI_AR_MAX_MB[c.table].get(c.tp)
    if budget and c.tokens * width * 2 <= budget * 2**20:
        backend = "FlashInfer allreduce_fusion"
    elif c.tp <= 8:
        backend = "vLLM custom all-reduce"
    else:
        backend = "NCCL"
    return StockKernel(
        f"{what} all-reduce [{backend}]", src,
        f"[{c.tokens} x {width}] BF16; dispatch order in {_COMM}: FlashInfer AR (size/TP table), "
        "custom AR (TP<=8), torch symm-mem, NCCL; every option is one launch under CUDA graphs")


def _gemm_ar_active(c: _Ctx) -> bool:
    """model.py maybe_init_gemm_rs_ar: VLLM_KIMI_K3_GEMM_AR=1 default, SM100 family, TP 2..16."""
    return c.blackwell and 1 < c.tp <= 16 and 128 % c.tp == 0 and c.tokens >= _GEMM_AR_MIN_TOKENS


def _attn_res(c: _Ctx, which: str) -> list[StockKernel]:
    norm = "input_layernorm" if which == "pre_attn" else "post_attention_layernorm"
    if c.blackwell:
        return [StockKernel(
            f"attn_res_fwd_online_v2_kernel (torch.ops._C.kimi_k3_attn_res: AttnRes + {norm})",
            _ATTN_RES, "native SM100-family kernel (CUDA >= 13 build); Triton _attn_res_kernel otherwise")]
    return [StockKernel(f"_attn_res_kernel (Triton: AttnRes + {norm})", _ATTN_RES,
                        "the native op is SM100-family only")]


# ---------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------
def _kda_overlap(c: _Ctx) -> bool:
    return c.tp == _KDA_OVERLAP_TP and c.tokens <= _KDA_OVERLAP_MAX_TOKENS


def _kda_in_proj(c: _Ctx) -> list[StockKernel]:
    if _kda_overlap(c):
        if c.tokens <= 2:
            qkvg = "CuTe shape_dynamic_skinny_gemm"
        elif c.table in ("sm100", "sm103"):
            qkvg = "FlashInfer mm_bf16 cute-dsl"
        else:
            qkvg = "cuBLAS torch.mm"
        fab = "CuTe shape_dynamic_skinny_gemm" if c.tokens == 1 else "kda_skinny_gemm.run_n"
        note = (f"TP8 projection overlap under CUDA-graph capture, M <= {_KDA_OVERLAP_MAX_TOKENS} "
                "(2 if FlashInfer autotune is off): Q/K/V/G rows on the main stream, "
                "F_A/beta rows on the aux stream")
        return [StockKernel(f"in_proj Q/K/V/G GEMM [{qkvg}]", _LLG, note),
                StockKernel(f"in_proj F_A/beta GEMM [{fab}]", _LLG, note, "aux")]
    rows = 4 * c.proj + _HEAD_DIM + c.heads
    rows += -rows % 16
    return [_gemm(c, "in_proj_qkvgfab", rows, _HIDDEN)]


def _kda_f_b_proj(c: _Ctx) -> list[StockKernel]:
    if _kda_overlap(c):
        name = "dsv3_fused_a_gemm" if c.tokens == 1 else "kda_skinny_gemm.run_k"
        return [StockKernel(f"f_b_proj GEMM [{name}]", _LLG, "aux stream, after F_A/beta", "aux")]
    return [_gemm(c, "f_b_proj", c.proj, _HEAD_DIM, packed_input=False)]


def _kda_core(c: _Ctx) -> list[StockKernel]:
    h = c.heads
    if h in _KDA_NATIVE_HEADS:
        return [StockKernel(
            "kda_decode_fusion_many_heads_kernel (ops.fused_kda_decode: conv update + gates + "
            "recurrent update + sigmoid-gated RMSNorm)", _KDA,
            f"native backend: {h} local heads in {_KDA_NATIVE_HEADS}, SM90 or SM100 family")]
    if c.blackwell and h in _KDA_FLASHINFER_HEADS:
        return [StockKernel("flashinfer_fused_kda_decode", _KDA,
                            f"{h} local heads: native unsupported, FlashInfer SM100 decode")]
    why = f"{h} local heads not in {_KDA_NATIVE_HEADS}: kda_decode_backend resolves to 'triton'"
    return [
        StockKernel("_causal_conv1d_update_kernel (Triton, packed Q/K/V)", _CONV1D, why),
        StockKernel("fused_recurrent_kda_packed_decode_kernel (Triton)", _KDA_RECURRENT, why),
        StockKernel("copy: core_attn_out[0, :n] = decode output", _KDA,
                    "elementwise copy (the packed decode allocates its own output)"),
        StockKernel("layer_norm_gated_fwd_kernel (Triton, o_norm sigmoid gate, in place)", _FLA_KDA,
                    "the following core_attn_out.copy_ is a self-copy with no device work"),
    ]


# ---------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------
def _mla_qkv_a_g(c: _Ctx) -> list[StockKernel]:
    if c.tokens < _MLA_GATE_STREAM_TOKENS:
        return [_gemm(c, "fused_qkv_a_g_proj[q_a+kv_a rows]", _QKV_A_ROWS, _HIDDEN),
                _gemm(c, "fused_qkv_a_g_proj[g rows]", c.proj, _HIDDEN, stream="aux")]
    return [_gemm(c, "fused_qkv_a_g_proj", _QKV_A_ROWS + c.proj, _HIDDEN)]


def _trtllm_gen_mla_heads_ok(h: int) -> bool:
    tile = 8 if h <= 8 else 16 if h <= 32 else 64
    return h % min(h, tile) == 0


def _mla_decode(c: _Ctx) -> list[StockKernel]:
    if c.blackwell:
        if _trtllm_gen_mla_heads_ok(c.heads):
            return [StockKernel(
                "trtllm_batch_decode_with_kv_cache_mla [trtllm-gen FMHA]", _FI_MLA,
                "FLASHINFER_MLA backend; multi-CTA-KV reduction inside the kernel with a "
                "persistent counter buffer (block size 32/64), so no per-step memset")]
        return [StockKernel(
            "trtllm_batch_decode_with_kv_cache_mla [cute-dsl]", _FI_MLA,
            f"{c.heads} local heads: trtllm-gen cannot tile them; FlashInfer cute-dsl MLA "
            "decode (counted as one launch; its split/combine is inside FlashInfer)")]
    return [
        StockKernel("flash_fwd split-KV kernel (FA3 MLA, q_v = absorbed nope)", _FA_MLA,
                    "FLASH_ATTN_MLA backend; num_splits = flash_attn_max_num_splits_for_cuda_graph (32)"),
        StockKernel("flash_fwd_combine kernel (FA3 split-KV combine)", _FA_MLA,
                    "launched by FA3 because num_splits > 1 under full CUDA graphs"),
    ]


# ---------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------
def _tail_fusion(c: _Ctx) -> bool:
    """latent_moe_runner.py tier 0: SM100 family, TP 8/16, 1..128 tokens."""
    return c.blackwell and c.tp in _TAIL_FUSION_TPS and c.tokens <= _TAIL_FUSION_MAX_TOKENS


def _moe_router(c: _Ctx) -> list[StockKernel]:
    if c.tokens <= _LL_BF16_MAX_TOKENS:
        mode = "dotprod" if c.tokens <= 4 else "cluster split-K"
        k = StockKernel(f"router gate GEMM fp32-out [CuTe ll_bf16_gemm {mode}]", _LL_BF16,
                        "GateLinear(7168 -> 896, bf16 weight, fp32 logits), main stream")
    else:
        k = StockKernel("router gate GEMM fp32-out [cuBLAS torch.mm out_dtype=fp32]", _GATE,
                        "GateLinear above LL_BF16_MAX_TOKENS")
    return [k]


def _moe_down_proj(c: _Ctx) -> list[StockKernel]:
    stream = "aux" if c.tokens <= _AUX_STREAM_TOKENS else "main"
    return [_gemm(c, "routed_expert_down_proj", _LATENT, _HIDDEN, stream=stream)]


def _moe_topk(c: _Ctx) -> list[StockKernel]:
    if c.blackwell:
        note = ("inside flashinfer trtllm_fp4_block_scale_moe (monolithic "
                "TrtLlmMxfp4ExpertsMonolithic, DeepSeekV3 routing: sigmoid + bias, top-16, renorm); "
                "launch count from TRT-LLM-gen routing source, not vLLM")
        second = ("routingIndicesClusterKernel" if c.tokens <= 1024 else "routingIndicesCoopKernel")
        return [StockKernel("routingMainKernel (FlashInfer TRT-LLM-gen routing)", _TRTLLM_MXFP4, note),
                StockKernel(f"{second} (FlashInfer TRT-LLM-gen routing)", _TRTLLM_MXFP4, note)]
    return [StockKernel("grouped_topk_fused_kernel (ops.grouped_topk: sigmoid + bias + top-16 + renorm)",
                        _GROUPED_TOPK, "GroupedTopKRouter (num_expert_group=1 keeps DeepSeekV3 routing)")]


def _moe_experts(c: _Ctx) -> list[StockKernel]:
    if c.blackwell:
        note = ("FLASHINFER_TRTLLM_MXFP4_MXFP8 (first priority on SM100): MXFP4 weights x MXFP8 "
                "activations, TRT-LLM-gen batched GEMMs inside flashinfer")
        out = [
            StockKernel("mxfp8_quantize (FlashInfer cute-dsl, routed latent activations)", _MXFP8,
                        "MoEPrepareAndFinalizeNoDPEPMonolithic.prepare"),
            StockKernel("FC1 batched GEMM (MXFP4 x MXFP8, gate/up + fused SiTU)", _TRTLLM_MXFP4, note),
            StockKernel("FC2 batched GEMM (MXFP4 x MXFP8, down)", _TRTLLM_MXFP4, note),
        ]
        if not _tail_fusion(c):
            out.append(StockKernel("finalizeKernel (top-16 weighted combine)", _TRTLLM_MXFP4,
                                   "do_finalize=True: the tail does not take over the combine here"))
        return out
    note = ("HUMMING backend (ranked above Marlin on SM90), HummingIndexedExperts for TP-only; "
            "W4A16 so the w13 input needs no quantization launch")
    return [
        StockKernel("moe_align_block_size_kernel", _MOE_ALIGN,
                    "_moe_C op; 896 experts > 64 uses the two-kernel align + sort path"),
        StockKernel("count_and_sort_expert_tokens_kernel", _MOE_ALIGN,
                    "assumes the w13 and w2 tuned block sizes agree (else a second align pair)"),
        StockKernel("Humming w13 grouped GEMM (MXFP4 x BF16)", _HUMMING, note),
        StockKernel("Humming w2 input processing (SiTU activation)", _HUMMING, note),
        StockKernel("Humming w2 grouped GEMM (MXFP4 x BF16)", _HUMMING, note),
        StockKernel("moe_fused_mul_sum (top-16 weighted combine)", _HUMMING, note),
    ]


def _moe_shared(c: _Ctx) -> list[StockKernel]:
    stream = "aux" if c.tokens <= _AUX_STREAM_TOKENS else "main"
    return [
        _gemm(c, "shared_experts.gate_up_proj", 2 * _SHARED_INTER // c.tp, _HIDDEN, stream=stream),
        StockKernel("situ_and_mul_kernel (SiTU)", _ACT, "SituAndMul.forward_cuda", stream),
        _gemm(c, "shared_experts.down_proj", _HIDDEN, _SHARED_INTER // c.tp, stream=stream),
    ]


def _fi_fused_ar_norm(c: _Ctx, width: int) -> bool:
    """fused_allreduce_gemma_rms_norm.py _can_use_flashinfer: TP/size budget per capability."""
    budget = _FI_AR_MAX_MB[c.table].get(c.tp)
    return bool(budget) and c.tokens <= int(budget * 2**20) // (width * 2)


def _moe_tail_all_reduce(c: _Ctx) -> list[StockKernel]:
    if c.tp == 1:
        return []
    if _tail_fusion(c):
        return [StockKernel(
            "CollectiveKernel (CuTe DSL: latent all-reduce + top-16 finalize + routed_expert_norm "
            "+ shared reduce-scatter)", _TAIL,
            "tier 0 TAIL_FUSION; the MoE finalize is deferred into it (deferred MoE finalize)")]
    fused = _fi_fused_ar_norm(c, _LATENT)
    latent = StockKernel(
        "latent all-reduce + RMSNorm [FlashInfer allreduce_fusion kARResidualRMSNorm]" if fused
        else "latent all-reduce", _RUNNER if fused else _COMM,
        "allreduce_norm_latent_out" + ("" if fused else ": FlashInfer fused path unavailable at this TP/size"))
    if c.tokens <= _AUX_STREAM_TOKENS:
        shared = StockKernel("shared-expert output all-reduce", _RUNNER,
                             "tier 1 ALLREDUCE_OVERLAP: on the aux stream, overlapping the up-projection",
                             "aux")
    else:
        shared = StockKernel("final all-reduce of (shared + routed shard)", _MOE_RUNNER,
                             "tier 2 COLUMN_PARALLEL: _maybe_reduce_final_output")
    return [latent, shared]


def _moe_tail(c: _Ctx) -> list[StockKernel]:
    norm = StockKernel("rms_norm (routed_expert_norm)", _LAYERNORM, "vllm_c RMSNorm")
    if c.tp == 1:
        return [norm,
                _gemm(c, "routed_expert_up_proj", _HIDDEN, _LATENT),
                StockKernel("add: shared_output + routed output", _MOE_RUNNER,
                            "MoERunner.forward (no fused path at TP 1)")]
    if _tail_fusion(c):
        kind = "skinny" if c.tokens <= _TAIL_SKINNY_MAX_TOKENS else "dynamic"
        return [
            StockKernel(f"AdaptiveUpProjectionKernel [{kind}] (CuTe DSL: TP-sharded up-proj + shared add "
                        "+ NVLS multicast)", _TAIL, "tier 0 TAIL_FUSION"),
            StockKernel("LamportCopyKernel (gather the multicast mailbox)", _TAIL, "tier 0 TAIL_FUSION"),
        ]
    out = [] if _fi_fused_ar_norm(c, _LATENT) else [norm]
    if c.tokens <= _AUX_STREAM_TOKENS:
        out += [StockKernel("routed_expert_up_proj GEMM [cuBLAS torch.mm]", _RUNNER,
                            "tier 1: torch.mm on the replicated weight (bypasses the low-latency plan)"),
                StockKernel("add_: result += reduced shared output", _RUNNER, "tier 1")]
    else:
        out += [StockKernel("routed_expert_up_proj shard GEMM [cuBLAS addmm_ into shared partial]",
                            _RUNNER, "tier 2: column-parallel shard, add folded into the epilogue")]
    return out


# ---------------------------------------------------------------------------------------
# Attention output projection and dense MLP
# ---------------------------------------------------------------------------------------
def _row_parallel_gemm(c: _Ctx, label: str, k: int) -> list[StockKernel]:
    """A row-parallel projection (o_proj, the dense down_proj): GEMM-AR on Blackwell, else a GEMM."""
    if _gemm_ar_active(c):
        return [StockKernel(f"Sm100GemmRsAr (CuTe DSL fused {label} GEMM + all-reduce)", _GEMM_AR,
                            f"GEMM-AR for M >= {_GEMM_AR_MIN_TOKENS} (VLLM_KIMI_K3_GEMM_AR=1 default)")]
    return [_gemm(c, label, _HIDDEN, k)]


def _row_parallel_all_reduce(c: _Ctx, label: str) -> list[StockKernel]:
    """Its reduction: none at TP 1, a copy after GEMM-AR (which reduced already), else an all-reduce."""
    if c.tp == 1:
        return []
    if _gemm_ar_active(c):
        return [StockKernel("copy: partial[:M].clone() after GEMM-AR", _GEMM_AR,
                            "the reduction itself ran inside Sm100GemmRsAr")]
    return [_all_reduce(c, label, _HIDDEN)]


_BUILDERS = {
    "attn_res.pre_attn": lambda c: _attn_res(c, "pre_attn"),
    "kda.in_proj": _kda_in_proj,
    "kda.f_b_proj": _kda_f_b_proj,
    "kda.core": _kda_core,
    "mla.qkv_a_g_proj": _mla_qkv_a_g,
    "mla.q_kv_norm": lambda c: [StockKernel("fused_q_kv_rmsnorm (Triton: q_a_layernorm + kv_a_layernorm)",
                                            _QKV_NORM)],
    "mla.q_b_proj": lambda c: [_gemm(c, "q_b_proj", c.heads * _QK_HEAD_DIM, _Q_LORA)],
    "mla.uk_absorb": lambda c: [StockKernel("torch.bmm q_nope x W_UK_T [cuBLAS batched]", _MLA)],
    "mla.cache_insert": lambda c: [StockKernel(
        "fused_mla_decode_q_concat_kv_cache_insert (Triton: concat ql_nope, q_pe + latent cache write)",
        _MLA_CACHE, "bf16 cache (--kv-cache-dtype auto)")],
    "mla.decode": _mla_decode,
    "mla.uv_absorb": lambda c: [StockKernel("torch.bmm latent x W_UV [cuBLAS batched]", _MLA,
                                            "writes attn_out through a transposed view, no copy")],
    "mla.gate": lambda c: [StockKernel("_gate_sigmoid_mul (Inductor-fused Triton: attn_out * sigmoid(g))",
                                       _MLA, "torch.compile(simple_compile_backend) on this one function")],
    "attn.o_proj": lambda c: _row_parallel_gemm(c, "o_proj", c.proj),
    "attn.o_proj_all_reduce": lambda c: _row_parallel_all_reduce(c, "o_proj"),
    "attn_res.pre_mlp": lambda c: _attn_res(c, "pre_mlp"),
    "moe.router": _moe_router,
    "moe.down_proj": _moe_down_proj,
    "moe.topk": _moe_topk,
    "moe.experts": _moe_experts,
    "moe.shared": _moe_shared,
    "moe.tail_all_reduce": _moe_tail_all_reduce,
    "moe.tail": _moe_tail,
    "mlp.gate_up": lambda c: [_gemm(c, "mlp.gate_up_proj", 2 * _DENSE_INTER // c.tp, _HIDDEN)],
    "mlp.act": lambda c: [StockKernel("situ_and_mul_kernel (SiTU)", _ACT, "SituAndMul.forward_cuda")],
    "mlp.down": lambda c: _row_parallel_gemm(c, "mlp.down_proj", _DENSE_INTER // c.tp),
    "mlp.all_reduce": lambda c: _row_parallel_all_reduce(c, "mlp.down_proj"),
}


def stock_kernels(region: str, *, tp: int, tokens: int, arch: str) -> list[StockKernel]:
    """The kernels vLLM 0.33.0's stock decode launches for ``region`` at this shape.

    ``tokens`` is the number of decode tokens in the step (batch x 1). ``arch`` is a
    CUDA arch string: ``sm_90*`` is Hopper, ``sm_100*`` / ``sm_103*`` Blackwell.
    """
    if region not in _BUILDERS:
        raise ValueError(f"unknown region {region!r}; known: {', '.join(REGIONS)}")
    return list(_BUILDERS[region](_ctx(tp, tokens, arch)))


def default_kernels(regions: Iterable[str], *, tp: int, tokens: int, arch: str) -> int:
    """Total stock launches over the distinct ``regions`` given (duplicates count once)."""
    return sum(len(stock_kernels(r, tp=tp, tokens=tokens, arch=arch)) for r in dict.fromkeys(regions))


def layer_kernels(kind: str, *, tp: int, tokens: int, arch: str) -> int:
    """Total stock launches of one decoder layer of ``kind`` ("kda", "mla" or "dense")."""
    if kind not in LAYER_REGIONS:
        raise ValueError(f"unknown layer kind {kind!r}; known: {', '.join(LAYER_REGIONS)}")
    return default_kernels(LAYER_REGIONS[kind], tp=tp, tokens=tokens, arch=arch)
