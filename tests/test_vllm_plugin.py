"""The vLLM integration, with the real vllm==0.33.0 package (skipped where it is not installed):
plugin discovery, the registry override, the knob, the deployment guard, the step guard on
real forward contexts and metadata, stock fallback per step. Per-layer programs, fallback and
TP agreement on vLLM's real model objects: tests/test_vllm_model.py."""
from __future__ import annotations

import importlib.metadata
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLACommonDecodeMetadata,
    MLACommonMetadata,
)
from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata  # noqa: E402

from rewriter.compiler.pipeline import served_batches  # noqa: E402
from rewriter.model.config import KimiK3Config  # noqa: E402
from rewriter.vllm import ARCHITECTURE, register  # noqa: E402
from rewriter.vllm.guard import StepLog, decide_step, deployment_refusals  # noqa: E402
from rewriter.vllm.knob import decode_backend  # noqa: E402


# ---- plugin and registry -----------------------------------------------------------
def test_entry_point_is_discovered_by_vllm():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == "rewriter.vllm:register"]
    assert ours, "pip install -e . registers the vllm.general_plugins entry point"
    from vllm.plugins import load_plugins_by_group
    assert load_plugins_by_group("vllm.general_plugins")[ours[0].name] is register


def test_registry_override_resolves_to_our_class():
    from vllm import ModelRegistry
    register()
    register()  # vLLM loads plugins in several processes and more than once
    cls = ModelRegistry._try_load_model_cls(ARCHITECTURE)
    assert cls.__name__ == "RewrittenKimiLinearForCausalLM"
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM
    assert issubclass(cls, KimiLinearForCausalLM)


# ---- the knob ----------------------------------------------------------------------------
def test_knob():
    assert decode_backend(None) == "auto"
    assert decode_backend({}) == "auto"
    assert decode_backend({"decode_backend": "auto"}) == "auto"
    assert decode_backend({"decode_backend": "latency_specialized"}) == "latency_specialized"
    with pytest.raises(ValueError) as e:
        decode_backend({"decode_backend": "fast"})
    assert "decode_backend='fast' is not supported; accepted values: 'auto', 'latency_specialized'" in str(e.value)


# ---- deployment guard ------------------------------------------------------------------
def _text_config(**changes):
    text = KimiK3Config.preset("kimi-k3")
    raw = {"model_type": "kimi_linear", **{k: getattr(text, k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps", "vocab_size",
        "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate", "num_experts",
        "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
        "latent_moe_use_norm", "moe_renormalize", "moe_router_activation_func", "routed_scaling_factor",
        "first_k_dense_replace", "attn_res_block_size")}}
    raw["linear_attn_config"] = {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                 "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                 "kda_layers": list(text.kda_layers), "full_attn_layers": list(text.full_attn_layers)}
    raw.update(changes)
    return SimpleNamespace(to_dict=lambda: raw)


def _vllm_config():
    from vllm.config import DeviceConfig
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def _config(tp=8, **model_changes):
    """vLLM's real parallel, cache and compilation configs around a stand-in model config (vLLM's
    own CPU tests do the same: its ModelConfig needs a model on disk). On a CPU host VllmConfig
    forces no CUDA graphs and the V1 runner, so those are set here as a GPU deployment has them."""
    real = _vllm_config()
    real.parallel_config.tensor_parallel_size = tp
    real.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    real.cache_config.mamba_ssm_cache_dtype = "float32"
    model = SimpleNamespace(hf_text_config=_text_config(**model_changes), dtype=torch.bfloat16, enforce_eager=False,
                            enable_sleep_mode=False)
    return SimpleNamespace(parallel_config=real.parallel_config, cache_config=real.cache_config,
                           compilation_config=real.compilation_config, lora_config=None, model_config=model,
                           use_v2_model_runner=True, additional_config={}, speculative_config=None)


def test_a_supported_deployment_has_no_refusals():
    assert deployment_refusals(_config(), capability=(9, 0)) == []
    assert deployment_refusals(_config(tp=16), capability=(10, 3)) == []
    hopper_two_hosts = _config(tp=8)
    hopper_two_hosts.parallel_config.pipeline_parallel_size = 2  # the released checkpoint on 2 x 8 H200
    assert deployment_refusals(hopper_two_hosts, capability=(9, 0)) == []
    assert deployment_refusals(_config(tp=5), capability=(9, 0))[0].startswith(
        "a model that is not Kimi K3 shaped (TP size 5 does not divide")


def test_startup_refusal_lists_every_reason():
    from rewriter.vllm.guard import check_deployment
    cfg = _config(num_experts_per_token=8, hidden_act="silu")
    cfg.parallel_config.pipeline_parallel_size = 2
    cfg.parallel_config.enable_expert_parallel = True
    cfg.lora_config = object()
    cfg.cache_config.cache_dtype = "fp8_ds_mla"
    cfg.model_config.enforce_eager = True
    cfg.use_v2_model_runner = False
    with pytest.raises(ValueError) as e:
        check_deployment(cfg, capability=(8, 9))
    text = str(e.value)
    for reason in ("this GPU (sm_89", "expert parallelism", "LoRA", "hidden_act is 'silu'",
                   "KV cache dtype 'fp8_ds_mla'", "eager mode (--enforce-eager)", "the V1 model runner"):
        assert reason in text, reason
    assert "pipeline" not in text  # served: each stage runs its own layers' programs
    assert text.count("\n  - ") >= 7  # one error, every reason on its own line


@pytest.mark.parametrize("dtype,refused", [("auto", False), ("bfloat16", False), ("fp8", False),
                                           ("fp8_e4m3", False), ("fp8_ds_mla", True), ("fp8_e5m2", True)])
def test_kv_cache_dtypes(dtype, refused):
    """A per-tensor fp8 E4M3 MLA cache is served (the kernels read E4M3 x _k_scale); vLLM's
    fp8_ds_mla (656-byte self-scaled tiles) and E5M2 are refused by name."""
    cfg = _config()
    cfg.cache_config.cache_dtype = dtype
    reasons = [r for r in deployment_refusals(cfg, capability=(9, 0)) if "KV cache dtype" in r]
    assert bool(reasons) == refused, reasons
    if refused:
        assert reasons[0].startswith(f"KV cache dtype {dtype!r}") and "fp8_e4m3" in reasons[0]


def test_model_dtype_and_graph_mode_refusals():
    cfg = _config()
    cfg.model_config.dtype = torch.float16
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    reasons = deployment_refusals(cfg, capability=(10, 0))
    assert any("model dtype torch.float16" in r for r in reasons)
    assert any("no FULL decode CUDA graphs" in r for r in reasons)
    for mode, refused in ((CUDAGraphMode.FULL, True), (CUDAGraphMode.FULL_DECODE_ONLY, False),
                          (CUDAGraphMode.FULL_AND_PIECEWISE, False)):
        cfg = _config()
        cfg.compilation_config.cudagraph_mode = mode
        reasons = deployment_refusals(cfg, capability=(9, 0))
        assert any("FULL CUDA graphs of mixed prefill and decode batches" in r for r in reasons) == refused, reasons
        assert all("CUDA graphs" not in r for r in reasons) or refused, reasons


def test_weight_offloading_is_refused():
    """vLLM's weight offloaders swap a layer's weights in from its forward hooks, which the programs
    (bound to the parameters once) never run."""
    for field, value in (("uva.cpu_offload_gb", 4.0), ("prefetch.offload_group_size", 2)):
        cfg = _config()
        cfg.offload_config = _vllm_config().offload_config
        sub, name = field.split(".")
        setattr(getattr(cfg.offload_config, sub), name, value)
        reasons = deployment_refusals(cfg, capability=(9, 0))
        assert reasons == ["weight offloading (--cpu-offload-gb, --offload-group-size): the programs read each "
                           "layer's weights where the model holds them, not through the offloader's hooks"], reasons
    cfg = _config()
    cfg.offload_config = _vllm_config().offload_config
    assert deployment_refusals(cfg, capability=(9, 0)) == []


def _speculative(k):
    """vLLM's real speculative config, k tokens drafted a step (n-gram: no draft model to load)."""
    from vllm.config import SpeculativeConfig
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize("k", range(1, 8))
def test_speculative_decoding_of_up_to_seven_tokens_is_served(k):
    from rewriter.vllm.guard import tokens_per_request
    cfg = _config()
    cfg.speculative_config = _speculative(k)
    assert deployment_refusals(cfg, capability=(9, 0)) == []
    assert tokens_per_request(cfg) == k + 1
    assert tokens_per_request(_config()) == 1


def test_speculative_settings_the_verify_programs_do_not_serve_are_refused_by_name():
    cfg = _config()
    cfg.speculative_config = _speculative(8)
    assert deployment_refusals(cfg, capability=(9, 0)) == [
        "speculative decoding (ngram) of 8 tokens a step: the verify programs take at most 8 tokens per request "
        "(num_speculative_tokens 1..7)"]
    cfg = _config()
    cfg.speculative_config = _speculative(3)
    cfg.cache_config.use_replayssm = True  # --use-replayssm: vLLM then sets use_kda_recoverssm for Kimi K3
    (reason,) = deployment_refusals(cfg, capability=(9, 0))
    assert reason.startswith("RecoverSSM speculative decoding (--use-replayssm): it keeps one KDA state slot"), reason
    cfg = _config()
    cfg.speculative_config = _speculative(3)
    cfg.speculative_config.enable_adaptive_verification = True  # DSpark's: ragged FULL graphs
    (reason,) = deployment_refusals(cfg, capability=(9, 0))
    assert reason.startswith("adaptive verification (enable_adaptive_verification): its FULL CUDA graphs replay any "
                             "mix of 1..4 tokens per request"), reason


# ---- step guard on real forward contexts and metadata ---------------------------------------
def _kda_md(prefills=0, decodes=4, spec=0):
    return KimiK3KDAMetadata(num_prefills=prefills, num_prefill_tokens=prefills * 7, num_decodes=decodes,
                             num_decode_tokens=decodes, num_spec_decodes=spec, num_spec_decode_tokens=spec * 2,
                             num_actual_tokens=prefills * 7 + decodes + spec * 2,
                             non_spec_state_indices_tensor=torch.arange(1, decodes + 1, dtype=torch.int32))


def _mla_md(prefills=0, decodes=4, table=None, seq_lens=None, slots=None):
    decode = MLACommonDecodeMetadata(block_table=(table if table is not None
                                                  else torch.zeros(decodes, 2, dtype=torch.int32)),
                                     seq_lens=seq_lens if seq_lens is not None else torch.full((decodes,), 9),
                                     dcp_tot_seq_lens=None)
    return MLACommonMetadata(num_reqs=prefills + decodes, max_query_len=7 if prefills else 1, max_seq_len=9,
                             num_actual_tokens=prefills * 7 + decodes, query_start_loc=torch.arange(decodes + 1),
                             slot_mapping=slots if slots is not None else torch.arange(decodes),
                             num_decodes=decodes, num_decode_tokens=decodes, num_prefills=prefills, decode=decode)


def _kda_verify_md(requests=4, q=4, padded=None, tokens=None, decodes=0, prefills=0):
    """KDA metadata of a verify step as vLLM's builder makes it (pure verify: every row a spec row,
    the FULL-graph padding rows staged as null state rows); ``tokens``: the spec rows' tokens
    (requests x q when uniform)."""
    padded = padded or requests
    slots = torch.arange(1, padded * q + 1, dtype=torch.int32).view(padded, q)
    slots[requests:] = 0
    tokens = requests * q if tokens is None else tokens
    return KimiK3KDAMetadata(num_prefills=prefills, num_prefill_tokens=prefills * 7, num_decodes=decodes,
                             num_decode_tokens=decodes, num_spec_decodes=requests, num_spec_decode_tokens=tokens,
                             num_actual_tokens=padded * q, spec_state_indices_tensor=slots,
                             num_accepted_tokens=torch.ones(padded, dtype=torch.int32),
                             non_spec_state_indices_tensor=torch.arange(decodes, dtype=torch.int32) if decodes
                             else None)


def _mla_verify_md(requests=4, q=4, tokens=None, prefills=0):
    """MLA metadata of a verify step: every request a decode of its q tokens (padding included, as
    vLLM's split counts zero-length padding rows as decodes of a uniform batch)."""
    decode = MLACommonDecodeMetadata(block_table=torch.zeros(requests, 2, dtype=torch.int32),
                                     seq_lens=torch.full((requests,), 9), dcp_tot_seq_lens=None)
    tokens = requests * q if tokens is None else tokens
    return MLACommonMetadata(num_reqs=requests + prefills, max_query_len=7 if prefills else q, max_seq_len=9,
                             num_actual_tokens=tokens + prefills * 7, query_start_loc=torch.arange(requests + 1) * q,
                             slot_mapping=torch.arange(tokens), num_decodes=requests, num_decode_tokens=tokens,
                             num_prefills=prefills, decode=decode)


def _decide(metadata, tokens=4, mode=CUDAGraphMode.NONE, capturing=True, built=(1, 2, 4, 8), q=1):
    """The decision inside a capture whose forward context has ``mode``: NONE by default, what
    vLLM's V2 runner sets while it captures a FULL graph."""
    cfg = _vllm_config()
    with set_forward_context(metadata, cfg, num_tokens=tokens, cudagraph_runtime_mode=mode):
        return decide_step(tokens, set(built), capturing, get_forward_context(), q)


def test_step_guard_decisions():
    decode = {"model.layers.1.self_attn": _kda_md(), "model.layers.3.self_attn": _mla_md()}
    assert _decide(decode).rewritten
    assert _decide(decode).reason == "pure decode"
    cases = {
        "prefill": {"model.layers.1.self_attn": _kda_md(prefills=2, decodes=0),
                    "model.layers.3.self_attn": _mla_md(prefills=2, decodes=0)},
        "mixed batch (prefill and decode rows)": {"model.layers.1.self_attn": _kda_md(prefills=1, decodes=3),
                                                  "model.layers.3.self_attn": _mla_md(prefills=1, decodes=3)},
        "speculative verify step: no verify programs built": {"model.layers.1.self_attn": _kda_md(decodes=0, spec=2),
                                                              "model.layers.3.self_attn": _mla_md()},
    }
    for reason, md in cases.items():
        d = _decide(md)
        assert not d.rewritten and d.reason == reason
    assert _decide(decode, mode=CUDAGraphMode.FULL).rewritten  # the V1 runner's FULL capture
    assert _decide(decode, mode=CUDAGraphMode.PIECEWISE).reason == "PIECEWISE CUDA graph"
    assert _decide(decode, capturing=False).reason.startswith("not captured as a CUDA graph")
    assert _decide(decode, tokens=5).reason == "5 tokens: no program built for this batch size"
    assert decide_step(4, {4}, True, None).reason == "no forward context"


def test_vllms_v2_runner_captures_its_full_graphs_with_the_mode_the_guard_takes():
    """The guard reads a step being captured with the forward context's mode NONE as a FULL graph:
    vLLM's V2 runner (the one the plugin builds its programs in) captures a FULL graph by calling
    its forward inside ``torch.cuda.graph`` with ``CUDAGraphMode.NONE``, and a PIECEWISE one with
    ``PIECEWISE``. CUDA graphs cannot be captured on a CPU, so this reads the capture loop of the
    installed vLLM: when it changes, the guard must be checked again."""
    import inspect

    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    source = inspect.getsource(CudaGraphManager.capture)
    graph = source.index("torch.cuda.graph(")
    assert "forward_fn(CUDAGraphMode.NONE)" in source[graph:graph + 400], source[graph:graph + 400]
    assert "forward_fn(CUDAGraphMode.PIECEWISE)" in source[:graph]


def test_step_guard_on_verify_steps():
    """Programs built for q = 4 (k = 3) take a uniform verify step of 4 tokens per request, padded
    or not, and nothing else: a ragged step (DSpark's adaptive verification), a uniform step of
    another q whose token count was built, a verify step with prefill or plain decode rows, a
    one-token decode step; programs for one-token steps take no verify step."""
    def step(kda, mla):
        return {"model.layers.1.self_attn": kda, "model.layers.3.self_attn": mla}

    built = {4, 8, 16}  # 1, 2, 4 requests of 4 tokens
    uniform = step(_kda_verify_md(), _mla_verify_md())
    d = _decide(uniform, tokens=16, built=built, q=4)
    assert d.rewritten and d.reason == "uniform verify (4 tokens per request)"
    padded = step(_kda_verify_md(requests=3, padded=4), _mla_verify_md(requests=4))  # 3 requests in a 4-request graph
    assert _decide(padded, tokens=16, built=built, q=4).rewritten
    ragged = "non-uniform verify step (requests verify different numbers of tokens)"
    cases = {
        ragged: step(_kda_verify_md(tokens=11), _mla_verify_md(tokens=16)),
        "verify step of 2 tokens per request: the programs verify 4": step(_kda_verify_md(requests=8, q=2),
                                                                          _mla_verify_md(requests=8, q=2)),
        "mixed batch (prefill and decode rows)": step(_kda_verify_md(requests=3, prefills=1),
                                                      _mla_verify_md(requests=3, prefills=1)),
        "one-token decode step: the programs verify 4 tokens per request": step(
            _kda_md(decodes=16), _mla_md(decodes=16)),
    }
    for reason, md in cases.items():
        d = _decide(md, tokens=16, built=built, q=4)
        assert not d.rewritten and d.reason == reason, (reason, d.reason)
    spec_and_plain = step(_kda_verify_md(requests=3, decodes=4), _mla_verify_md(requests=4, tokens=16))
    assert _decide(spec_and_plain, tokens=16, built=built, q=4).reason == ragged
    assert _decide(uniform, tokens=16, built={1, 2, 4, 8, 16}, q=1).reason == \
        "speculative verify step: no verify programs built"
    assert _decide(uniform, tokens=12, built=built, q=4).reason == "12 tokens: no program built for this batch size"


def test_step_log_summary():
    steps = StepLog(summarize_at_exit=False)
    steps.record(_decide({"a": _kda_md()}))
    steps.record(_decide({"a": _kda_md(prefills=1, decodes=0)}))
    steps.record(_decide({"a": _kda_md(prefills=1, decodes=0)}))
    text = steps.summary()
    assert "1 forward calls on the rewritten path, 2 on the stock path" in text
    assert "stock            2  prefill" in text


# ---- the model's forward routing -------------------------------------------------------------
def _bare_model(decision_taken: bool):
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

    from rewriter.vllm.guard import StepDecision
    from rewriter.vllm.model import RewrittenKimiLinearForCausalLM
    model = RewrittenKimiLinearForCausalLM.__new__(RewrittenKimiLinearForCausalLM)
    torch.nn.Module.__init__(model)
    rewriter = mock.Mock()
    rewriter.decide.return_value = StepDecision(decision_taken, "pure decode" if decision_taken else "prefill")
    rewriter.run.return_value = "rewritten output"
    rewriter.steps = StepLog(summarize_at_exit=False)
    model.rewriter = rewriter
    return model, KimiLinearForCausalLM


def test_refused_step_runs_the_stock_forward_and_returns_its_result():
    model, stock_cls = _bare_model(decision_taken=False)
    positions = torch.arange(3)
    with mock.patch.object(stock_cls, "forward", return_value="stock output") as stock_forward:
        assert model.forward(torch.arange(3), positions) == "stock output"
    stock_forward.assert_called_once()
    model.rewriter.run.assert_not_called()
    assert model.rewriter.steps.counts == {(False, "prefill"): 1}


def test_taken_step_runs_the_programs():
    model, stock_cls = _bare_model(decision_taken=True)
    with mock.patch.object(stock_cls, "forward", return_value="stock output") as stock_forward:
        assert model.forward(torch.arange(4), torch.arange(4)) == "rewritten output"
    stock_forward.assert_not_called()
    model.rewriter.decide.assert_called_once_with(4)


def test_auto_keeps_the_stock_class_behaviour():
    from rewriter.vllm.model import RewrittenKimiLinearForCausalLM
    model = RewrittenKimiLinearForCausalLM.__new__(RewrittenKimiLinearForCausalLM)
    torch.nn.Module.__init__(model)
    model.rewriter = None
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM
    with mock.patch.object(KimiLinearForCausalLM, "forward", return_value="stock") as f:
        assert model.forward(None, torch.arange(2)) == "stock"
    f.assert_called_once()


def test_in_tree_check_is_stood_down_only_while_building():
    from vllm.models.kimi_k3.nvidia import model as stock

    from rewriter.vllm.model import in_tree_specialized_decode_off
    original = stock.specialized_decode_config
    with in_tree_specialized_decode_off():
        assert stock.specialized_decode_config(SimpleNamespace(additional_config={
            "decode_backend": "latency_specialized"})) is None
    assert stock.specialized_decode_config is original


# ---- programs ------------------------------------------------------------------------------------
def test_served_batches():
    assert served_batches([1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]) == (
        1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
    # vLLM's default sizes up to 72 with 3 speculative tokens (VllmConfig._set_cudagraph_sizes: 1, 2, 4,
    # multiples of 8, and n x 4 for request counts n): the V2 runner rounds each up to whole requests
    assert served_batches([1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 128], q=4) == (1, 2, 4, 6, 8, 10, 12, 14, 16)
    assert served_batches([1, 2, 4, 12, 128], q=4) == (1, 3)
    assert served_batches([1, 2, 4, 8], q=3) == (1, 2)  # 9 tokens would pass the largest capture size
    assert served_batches([], q=4) == (1, 2, 4, 8, 16)  # ahead of a server: the one-token token counts
    # no graph of more requests than max_num_seqs is captured, so none is built
    assert served_batches([1, 2, 4, 8, 16, 32, 64], max_requests=8) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert served_batches([1, 2, 4, 8, 16, 24, 32], q=2, max_requests=8) == (1, 2, 4, 8)
