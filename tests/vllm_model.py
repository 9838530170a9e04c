"""vLLM 0.33.0's REAL Kimi K3 text model (``KimiLinearForCausalLM``) on a CPU host, for tests.

A test helper, not a test file. It builds the model vLLM's loader builds, loads a random
checkpoint under the Hugging Face names through the model's own ``load_weights``, runs vLLM's
``process_weights_after_loading``, lets vLLM's CPU model runner allocate and bind the KV cache
and KDA state, and builds real decode metadata with vLLM's own builders, the way the engine
core and model runner do. Nothing is faked past the patches below, each a context
manager active only where it is needed:

- ``no_cuda_streams``: the model creates a CUDA stream at construction;
- ``unquantized_moe_triton``: bf16 experts get the Triton backend (a GPU's pick; the CPU one
  refuses SiTU);
- ``mxfp4_moe_backend_none``: MXFP4 experts get ``Mxfp4MoeBackend.NONE`` (kept as loaded);
- ``keep_linear_weight``: the CPU linear repack needs ``torch.ops._C`` kernels the CUDA wheel
  lacks;
- ``mla_backend_on_cpu``: the MLA layers get vLLM's AMX_MLA backend on any host. vLLM picks it
  on an AMX host and CPU_MLA elsewhere, which takes block size 16 only while this hybrid model's
  blocks are aligned to 128 (without AMX vLLM cannot build it); and the CPU platform has no MLA
  kernel for an fp8 cache and refuses to pick one. The layer keeps its cache dtype, so vLLM
  still allocates the uint8 cache and ``_k_scale`` a GPU would get;
- ``attn_res_in_torch`` (only where the last pipeline stage's final AttnRes runs): vLLM's op is
  a Triton kernel; its math in torch;
- ``mla_verify_rows_as_decodes`` (only with speculative decoding, while the caches are bound):
  vLLM's CPU MLA builder takes one-token queries only and would count a verify step's rows as
  prefills; it is given the GPU builders' declaration.

vLLM's stock layer forward cannot run on a CPU (its ops are Triton kernels); the plugin's
programs and the reference layers can, on vLLM's tensors and caches.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

# The project's tiny preset as a vLLM text config. The MLA latent is widened to Kimi K3's own
# kv_lora_rank 512 + qk_rope_head_dim 64 = 576: vLLM's MLA metadata accepts head sizes 320, 512
# and 576 only (MLACommonMetadata.__post_init__), and its CPU MLA backend (AMX_MLA) 576 only.
_TINY = json.loads(resources.files("rewriter.model.configs").joinpath("tiny.json").read_text())["text_config"]
TINY_VLLM_CONFIG: dict[str, Any] = {
    **_TINY, "architectures": ["KimiLinearForCausalLM"], "torch_dtype": "bfloat16",
    "kv_lora_rank": 512, "qk_rope_head_dim": 64,
}
# The same, at the smallest sizes every KDA+MoE kernel template takes (hidden 512, two KDA heads of
# 128, latent 256, expert intermediate 128) and the MLA templates' q_lora of 1536: for checks of
# what the kernels accept on vLLM's tensors.
KERNEL_SHAPED_VLLM_CONFIG: dict[str, Any] = {
    **TINY_VLLM_CONFIG, "hidden_size": 512, "intermediate_size": 512, "num_attention_heads": 2,
    "linear_attn_config": {**_TINY["linear_attn_config"], "num_heads": 2, "head_dim": 128},
    "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536, "routed_expert_hidden_size": 256,
    "moe_intermediate_size": 128,
}
# What vLLM resolves the released compressed-tensors checkpoint to (KimiK3ForConditionalGeneration
# Config in vllm/model_executor/models/config.py): Mxfp4MoEMethod for the routed experts, every
# linear layer unquantized.
QUANT_CONFIGS: dict[str | None, dict | None] = {None: None, "mxfp4": {"quant_method": "mxfp4"}}
SEQ_LENS = (700, 33, 1000, 257)  # cached tokens + 1 per request of the decode step
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 40  # one pool shared by every cache group, block 0 the null block
VERIFY_NUM_BLOCKS = 80  # the same with 3 speculative tokens: each request holds 4 state blocks per KDA group


# ---- patches ----------------------------------------------------------------------------
@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


class _NoStream:
    """Constructing it gives None ("no aux stream"); a class, as annotations read ``torch.cuda.Stream | None``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> None:
        return None


def no_cuda_streams() -> contextlib.AbstractContextManager:
    """Why: KimiLinearModel.__init__ calls torch.cuda.Stream() unconditionally; it raises without CUDA."""
    return _patched(torch.cuda, "Stream", _NoStream)


def unquantized_moe_triton() -> contextlib.AbstractContextManager:
    """Why: on CPU vLLM offers only its CPU MoE backend, which refuses SiTU; Triton (a GPU's pick) keeps w13/w2."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as uq

    def select(moe_config: Any) -> tuple:
        return uq.UnquantizedMoeBackend.TRITON, uq.backend_to_kernel_cls(uq.UnquantizedMoeBackend.TRITON)[0]

    return _patched(um, "select_unquantized_moe_backend", select)


def mxfp4_moe_backend_none() -> contextlib.AbstractContextManager:
    """Why: on CPU the only MXFP4 MoE backend refuses SiTU; with NONE the experts stay in checkpoint layout."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization import mxfp4 as mx

    return _patched(mx, "select_deepseek_v4_mxfp4_moe_backend", lambda moe: (Mxfp4MoeBackend.NONE, None))


def keep_linear_weight() -> contextlib.AbstractContextManager:
    """Why: on CPU post-load repacks linear weights for torch.ops._C kernels this wheel lacks (and empties them)."""
    from vllm.model_executor.layers import utils as lu

    def dispatch(layer: Any, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias=None: F.linear(x, weight, bias)

    return _patched(lu, "dispatch_cpu_unquantized_gemm", dispatch)


def mla_backend_on_cpu() -> contextlib.AbstractContextManager:
    """Why: on a CPU vLLM picks AMX_MLA for MLA layers on an AMX host and CPU_MLA elsewhere, which
    takes block size 16 only, while a hybrid MLA + KDA model's block size is aligned to 128
    (``_align_hybrid_block_size``): without AMX vLLM cannot build this model at all. And its CPU
    MLA kernels refuse an fp8 cache. AMX_MLA on any host, whatever the cache dtype (the cache stays
    the layer's kv_cache_dtype; no vLLM MLA kernel runs in these tests, the programs do)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    pick = current_platform.get_attn_backend_cls

    def get_attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla:
            return AttentionBackendEnum.AMX_MLA.get_path()
        return pick(selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads)

    return _patched(current_platform, "get_attn_backend_cls", get_attn_backend_cls)


@contextlib.contextmanager
def attn_res_in_torch() -> Iterator[None]:
    """Why: vLLM's ``attn_res`` op (the last stage's final AttnRes, and the backbone's aux stream
    in ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM`` mode) is a Triton kernel. Its math in torch: the
    reference layers' ``attn_res`` (``rewriter/model/layers/attn_res.py``), with the block write done in
    place as vLLM's op does it; in its module and where the model imported it by name."""
    from rewriter.model.layers.attn_res import attn_res as reference

    module = importlib.import_module("vllm.models.kimi_k3.nvidia.ops.attn_res")  # the module, not the function
    model = importlib.import_module("vllm.models.kimi_k3.nvidia.model")

    def attn_res(prefix, delta, blocks, *args, **kwargs):
        out, _, written = reference(prefix, delta, blocks, *args, **kwargs)
        blocks.copy_(written)
        return out

    with _patched(module, "attn_res", attn_res), _patched(model, "attn_res", attn_res):
        yield


def mla_verify_rows_as_decodes() -> contextlib.AbstractContextManager:
    """Why: vLLM's CPU MLA builder (AMX_MLA) declares single-token queries only, so its decode
    threshold stays 1 and a verify step's q-token rows would be prefills; the GPU builders
    (FlashMLA, Triton MLA: UNIFORM) raise the threshold to k + 1 at construction and build them as
    decodes, the metadata a GPU's verify step gets."""
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAMetadataBuilder

    return _patched(AMXMLAMetadataBuilder, "query_len_support", QueryLenSupport.UNIFORM)


def _moe_patch(quant: str | None) -> contextlib.AbstractContextManager:
    return {None: unquantized_moe_triton, "mxfp4": mxfp4_moe_backend_none}[quant]()


# ---- build and load ---------------------------------------------------------------------
def init_distributed(tp: int = 1, rank: int = 0, init_method: str | None = None, pp: int = 1) -> None:
    """vLLM's own gloo world of ``tp x pp`` processes (once per process) and its TP and PP groups
    (rank = stage x tp + TP rank, as vLLM numbers them)."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        assert ps.get_tensor_model_parallel_world_size() == tp and ps.get_pp_group().world_size == pp
        return
    if init_method is None:
        assert tp * pp == 1, "TP or PP > 1 needs one process per rank and a shared init_method"
        init_method = f"file://{tempfile.mkdtemp(prefix='k3-vllm-dist-')}/init"
    ps.init_distributed_environment(world_size=tp * pp, rank=rank, local_rank=rank,
                                    distributed_init_method=init_method, backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def make_vllm_config(quant: str | None = None, tp: int = 1, config: dict | None = None,
                     kv_cache_dtype: str = "auto", pp: int = 1, speculative_tokens: int = 0) -> VllmConfig:
    """A fresh VllmConfig per model (vLLM registers every attention layer's name in it) for a folder
    holding only a ``config.json``; ``kv_cache_dtype`` as ``--kv-cache-dtype``; ``speculative_tokens``
    > 0: vLLM's speculative config with that many tokens drafted per step, by n-gram lookup (no draft
    model to load on a CPU; the target's caches and metadata are the same whichever method drafts,
    DSpark on a GPU)."""
    from vllm.config import CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig

    raw = copy.deepcopy(config or TINY_VLLM_CONFIG)
    if QUANT_CONFIGS[quant] is not None:
        raw["quantization_config"] = QUANT_CONFIGS[quant]
    folder = tempfile.mkdtemp(prefix="k3-tiny-vllm-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    model = ModelConfig(model=folder, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                        enforce_eager=True, max_model_len=MAX_MODEL_LEN)
    spec = None
    parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if speculative_tokens:
        from vllm.config import SpeculativeConfig

        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=speculative_tokens, prompt_lookup_max=3,
                                 prompt_lookup_min=1, target_model_config=model, target_parallel_config=parallel)
    return VllmConfig(
        model_config=model,
        speculative_config=spec,
        # prefix caching would switch mamba_cache_mode to "align", whose state-index gather is Triton
        cache_config=CacheConfig(mamba_cache_mode="none", enable_prefix_caching=False, cache_dtype=kv_cache_dtype),
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def make_checkpoint(cfg: dict, quant: str | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under a Kimi K3 HF checkpoint's names and full (TP 1) shapes. Routed experts
    ``experts.E.{w1,w2,w3}.weight`` (bf16), or ``.weight_packed`` (FP4 E2M1 codes, two per byte,
    element 2i in the low nibble) and ``.weight_scale`` (E8M0 bytes per 32 along K) for MXFP4."""
    g = torch.Generator().manual_seed(seed)
    bf, f32 = torch.bfloat16, torch.float32

    def r(*shape: int, dtype: torch.dtype = bf, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    H = cfg["hidden_size"]
    la = cfg["linear_attn_config"]
    nh, hd, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = nh * hd
    na, nope, rope, vd = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    E, inter, latent = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    shared = inter * cfg["num_shared_experts"]
    ck = {"model.embed_tokens.weight": r(cfg["vocab_size"], H)}
    for L in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{L}.", f"model.layers.{L}.self_attn."
        if L + 1 in la["kda_layers"]:  # 1-based
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                ck[a + n + ".weight"] = r(P, H)
            ck[a + "f_a_proj.weight"] = r(hd, H)
            ck[a + "b_proj.weight"] = r(nh, H)
            ck[a + "f_b_proj.weight"] = r(P, hd)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                ck[a + n + ".weight"] = r(P, 1, width, std=0.5)
            ck[a + "A_log"] = r(nh, dtype=f32)
            ck[a + "dt_bias"] = r(P, dtype=f32)
            ck[a + "o_norm.weight"] = 1 + r(hd)
            ck[a + "o_proj.weight"] = r(H, P)
        else:
            ck[a + "q_a_proj.weight"] = r(ql, H)
            ck[a + "q_a_layernorm.weight"] = 1 + r(ql)
            ck[a + "q_b_proj.weight"] = r(na * (nope + rope), ql)
            ck[a + "kv_a_proj_with_mqa.weight"] = r(kvl + rope, H)
            ck[a + "kv_a_layernorm.weight"] = 1 + r(kvl)
            ck[a + "kv_b_proj.weight"] = r(na * (nope + vd), kvl)
            ck[a + "g_proj.weight"] = r(na * vd, H)
            ck[a + "o_proj.weight"] = r(H, na * vd)
        if L >= cfg["first_k_dense_replace"] and L % cfg["moe_layer_freq"] == 0:
            m = p + "block_sparse_moe."
            ck[m + "gate.weight"] = r(E, H)
            ck[m + "gate.e_score_correction_bias"] = r(E, dtype=f32)
            ck[m + "shared_experts.gate_proj.weight"] = r(shared, H)
            ck[m + "shared_experts.up_proj.weight"] = r(shared, H)
            ck[m + "shared_experts.down_proj.weight"] = r(H, shared)
            ck[m + "routed_expert_down_proj.weight"] = r(latent, H)
            ck[m + "routed_expert_norm.weight"] = 1 + r(latent)
            ck[m + "routed_expert_up_proj.weight"] = r(H, latent)
            for e in range(E):
                for w, (n, k) in (("w1", (inter, latent)), ("w3", (inter, latent)), ("w2", (latent, inter))):
                    x = f"{m}experts.{e}.{w}."
                    if quant is None:
                        ck[x + "weight"] = r(n, k)
                    else:  # scales 2^-8 .. 2^-4, as trained weights' are
                        ck[x + "weight_packed"] = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
                        ck[x + "weight_scale"] = torch.randint(119, 124, (n, k // 32), generator=g, dtype=torch.uint8)
        else:
            for n, shape in (("gate_proj", (cfg["intermediate_size"], H)), ("up_proj", (cfg["intermediate_size"], H)),
                             ("down_proj", (H, cfg["intermediate_size"]))):
                ck[p + f"mlp.{n}.weight"] = r(*shape)
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            ck[p + n + ".weight"] = 1 + r(H)
        ck[p + "self_attention_res_proj.weight"] = r(1, H)
        ck[p + "mlp_res_proj.weight"] = r(1, H)
    ck["model.norm.weight"] = 1 + r(H)
    ck["model.output_attn_res_norm.weight"] = 1 + r(H)
    ck["model.output_attn_res_proj.weight"] = r(1, H)
    ck["lm_head.weight"] = r(cfg["vocab_size"], H)
    return ck


def build_loaded(quant: str | None = None, *, tp: int = 1, rank: int = 0, init_method: str | None = None,
                 seed: int = 0, config: dict | None = None, kv_cache_dtype: str = "auto", pp: int = 1,
                 speculative_tokens: int = 0) -> tuple[torch.nn.Module, VllmConfig]:
    """vLLM's KimiLinearForCausalLM for the tiny config (or ``config``), built as its loader builds
    it, a random checkpoint loaded through its own ``load_weights``, then vLLM's post-load step.
    ``quant``: None (bf16 experts) or ``"mxfp4"``; ``kv_cache_dtype``: ``--kv-cache-dtype``; with
    ``pp`` > 1 the stage of ``rank`` holds its own layers only (vLLM's ``PPMissingLayer`` for the
    others, which its ``load_weights`` skips)."""
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = config or TINY_VLLM_CONFIG
    vc = make_vllm_config(quant, tp, config, kv_cache_dtype, pp, speculative_tokens)
    with set_current_vllm_config(vc):
        init_distributed(tp, rank, init_method, pp)
        with no_cuda_streams(), _moe_patch(quant), mla_backend_on_cpu(), \
                set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=vc.model_config)
        loaded = model.load_weights(iter(make_checkpoint(config, quant, seed).items()))
        missing = {n for n, _ in model.named_parameters()} - set(loaded)
        assert not missing, f"parameters the checkpoint did not load: {sorted(missing)}"
        post = mxfp4_moe_backend_none() if quant == "mxfp4" else contextlib.nullcontext()
        with keep_linear_weight(), post:
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return model.eval(), vc


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    backbone = model.model
    return list(backbone.layers[backbone.start_layer:backbone.end_layer])


def text_config(vc: VllmConfig):
    """The project's config of the served model, read as the plugin reads it (rewriter/vllm/model.py)."""
    from rewriter.model.config import KimiK3Config

    return KimiK3Config.from_dict(vc.model_config.hf_text_config.to_dict(), name="served model")


# ---- caches and decode metadata ---------------------------------------------------------
def bind_caches(model: torch.nn.Module, vc: VllmConfig, num_blocks: int = NUM_BLOCKS):
    """vLLM's CPU model runner holding ``model``, its KV cache config (EngineCore's planning) and
    caches allocated and bound (``layer.self_attn.kv_cache``): GPUModelRunner.initialize_kv_cache."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    verify = mla_verify_rows_as_decodes() if vc.speculative_config is not None else contextlib.nullcontext()
    with set_current_vllm_config(vc), verify:
        current_platform.update_block_size_for_backend(vc)  # what the executor does after load_model
        runner = CPUModelRunner(vc, torch.device("cpu"))
        runner.model = model
        specs = runner.get_kv_cache_spec()
        supported = [[lay.name for lay in get_supported_kv_cache_layouts(get_current_attn_backends(vc))]]
        layout = resolve_kv_cache_layout(vc, supported, list(specs.values()))
        if vc.cache_config.kv_cache_layout is None:
            record_kv_cache_layout(vc.cache_config, layout.name)
        groups = get_global_kv_cache_groups(vc, [specs])
        vc.cache_config.num_gpu_blocks_override = num_blocks
        kv_config = get_kv_cache_configs(vc, [specs], [1 << 40], groups)[0]
        kv_config.kv_cache_layout = vc.cache_config.kv_cache_layout
        runner.initialize_kv_cache(kv_config)
    return runner


@dataclass
class DecodeBatch:
    """A decode step as vLLM's runner prepares it: q new tokens per request (q > 1: a verify step),
    ``seq_lens`` counting them."""

    seq_lens: tuple[int, ...]
    block_ids: list[list[list[int]]]  # [cache group][request] -> block ids
    attn_metadata: dict[str, Any]  # layer name -> metadata (vLLM's builders)
    slot_mapping: dict[str, torch.Tensor]  # layer name -> slots (what set_forward_context gets)
    padded_tokens: int  # the step's tokens with the padding rows of a FULL CUDA graph
    q: int = 1
    num_accepted: tuple[int, ...] = ()  # verify: each request's previous accepted tokens + 1

    @property
    def num_tokens(self) -> int:
        return len(self.seq_lens) * self.q

    @property
    def positions(self) -> torch.Tensor:
        """Each token's position, request by request."""
        last = torch.tensor(self.seq_lens, dtype=torch.int64).repeat_interleave(self.q)
        return last - self.q + torch.arange(self.q).repeat(len(self.seq_lens))

    @property
    def positions_padded(self) -> torch.Tensor:
        """Positions of the padded step (0 for the padding rows, as vLLM leaves them)."""
        return torch.cat([self.positions, self.positions.new_zeros(self.padded_tokens - self.num_tokens)])


def prepare_decode(runner: Any, seq_lens: tuple[int, ...] = SEQ_LENS, seed: int = 0,
                   padded_to: int | None = None, q: int = 1, num_accepted: tuple[int, ...] = ()) -> DecodeBatch:
    """Fill the runner's persistent input buffers for a decode step (as ``_prepare_inputs`` does),
    with shuffled block ids drawn without replacement from the one pool every cache group shares,
    then vLLM's ``_get_slot_mappings`` and ``_build_attention_metadata`` (its real builders).
    ``padded_to``: the step padded to that many requests of one token, as for a FULL CUDA graph
    (vLLM's builders give the padding rows the null block and its slot mapping PAD_SLOT_ID).
    ``q`` > 1: a verify step of q tokens per request (k = q - 1 drafts each, every request a spec
    row) after the previous step accepted ``num_accepted`` - 1 drafts per request, as the runner
    hands the KDA builder its ``num_accepted_tokens`` and ``num_decode_draft_tokens``. (vLLM pads a
    FULL-graph verify step by staging on the GPU, a Triton kernel: verify steps here are unpadded.)"""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import MambaSpec

    B = len(seq_lens)
    P = padded_to or B
    assert q == 1 or (P == B and len(num_accepted) == B), "a verify step: unpadded, num_accepted per request"
    T = B * q
    pool = (torch.randperm(runner.kv_cache_config.num_blocks - 1, generator=torch.Generator().manual_seed(seed))
            + 1).tolist()
    block_ids = []
    for group in runner.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_request = [1 + spec.num_speculative_blocks if isinstance(spec, MambaSpec) else cdiv(n, spec.block_size)
                       for n in seq_lens]
        block_ids.append([[pool.pop() for _ in range(k)] for k in per_request])
    batch = runner.input_batch
    for r in range(B):
        batch.block_table.add_row(tuple(ids[r] for ids in block_ids), r)
    batch.block_table.commit_block_table(B)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    batch.num_computed_tokens_cpu_tensor[:B] = lens - q
    batch.num_prompt_tokens_cpu_tensor[:B] = 1
    runner.query_start_loc.np[0] = 0
    runner.query_start_loc.np[1:P + 1] = range(q, P * q + 1, q)
    runner.query_start_loc.np[P + 1:] = P * q
    runner.query_start_loc.copy_to_gpu()
    runner.optimistic_seq_lens_cpu[:B], runner.optimistic_seq_lens_cpu[B:] = lens, 0
    runner.seq_lens[:B], runner.seq_lens[B:] = lens, 0
    step = DecodeBatch(tuple(seq_lens), block_ids, {}, {}, P * q, q, tuple(num_accepted))
    runner.positions[:T], runner.positions[T:P * q] = step.positions, 0
    if q > 1:
        runner.num_accepted_tokens.gpu[:B] = torch.tensor(num_accepted, dtype=torch.int32)
        runner.num_decode_draft_tokens.cpu[:B], runner.num_decode_draft_tokens.cpu[B:] = q - 1, -1
    for gid in range(len(block_ids)):
        table = batch.block_table[gid]
        if table.slot_mapping_mode.name == "TOKEN_TO_KV_SLOT":
            # BlockTable.compute_slot_mapping is a Triton kernel; its arithmetic (DCP 1) in torch
            pos = runner.positions[:T]
            blocks = table.block_table.gpu[torch.arange(B).repeat_interleave(q), pos // table.block_size]
            table.slot_mapping.gpu[:T] = blocks.to(torch.int64) * table.block_size + pos % table.block_size
    with set_current_vllm_config(runner.vllm_config):
        by_group, by_layer = runner._get_slot_mappings(num_tokens_padded=P * q, num_reqs_padded=P,
                                                       num_tokens_unpadded=T)
        metadata, _ = runner._build_attention_metadata(num_tokens=T, num_reqs=B, max_query_len=q,
                                                       num_tokens_padded=P * q, num_reqs_padded=P,
                                                       slot_mappings=by_group, use_spec_decode=q > 1)
    step.attn_metadata, step.slot_mapping = metadata, by_layer
    return step


@contextlib.contextmanager
def decode_context(vc: VllmConfig, batch: DecodeBatch, mode: Any = None) -> Iterator[Any]:
    """What the model runner wraps the forward in (``inference_mode``, ``set_forward_context``);
    yields the context. ``mode``: the CUDA graph runtime mode (NONE, as on a CPU, unless given)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, set_forward_context

    with torch.inference_mode(), set_current_vllm_config(vc), set_forward_context(
            batch.attn_metadata, vc, num_tokens=batch.padded_tokens, slot_mapping=batch.slot_mapping,
            cudagraph_runtime_mode=CUDAGraphMode.NONE if mode is None else mode):
        yield get_forward_context()
