"""The two guards around the rewritten decode path.

- ``deployment_refusals``: settings the rewriter does not serve. Startup stops with ONE
  error listing every reason at once (vLLM's own check stops at the first).
- ``decide_step``: per forward, whether this step takes the rewritten path. Only pure
  decode steps of a built batch size that are being captured as FULL CUDA graphs do; the
  decision is made from the forward context alone, so every TP rank of every pipeline stage
  makes the same one, and it is baked into the captured graph.
``StepLog`` counts the steps each path took, with their reasons, and logs a summary at
shutdown. With FULL CUDA graphs vLLM replays graphs without calling ``forward``, so the
counts are of forward calls: captures plus the steps that run outside FULL graphs.
"""
from __future__ import annotations

import atexit
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from rewriter.config import ConfigError, KimiK3Config
from rewriter.vllm.experts import moe_backend_refusal

log = logging.getLogger("rewriter.vllm")

SUPPORTED_CAPABILITIES = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
# vLLM's --kv-cache-dtype values the MLA programs read, and the DecodeShape.kv_cache_dtype each means
KV_CACHE_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}


def arch_of(capability: tuple[int, int] | None) -> str | None:
    return SUPPORTED_CAPABILITIES.get(tuple(capability)) if capability else None


def _device_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def model_refusals(hf_text_config: Any, tp: int) -> list[str]:
    """Why the served model is not one the reference layers describe (empty: it is)."""
    raw = hf_text_config.to_dict() if hasattr(hf_text_config, "to_dict") else dict(vars(hf_text_config))
    try:
        cfg = KimiK3Config.from_dict(raw, name="the served model")
        cfg.shard(tp)
    except ConfigError as e:
        return [f"a model that is not Kimi K3 shaped ({e})"]
    return [f"a model that is not Kimi K3 shaped ({r})" for r in cfg.unsupported_for_reference()]


def deployment_refusals(vllm_config: Any, capability: tuple[int, int] | None = None) -> list[str]:
    """Every setting of this deployment the rewriter does not serve (empty: all served)."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    capability = capability if capability is not None else _device_capability()
    par, model, cache = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    comp = vllm_config.compilation_config
    reasons = []
    if capability is None:
        reasons.append("no CUDA GPU")
    elif arch_of(capability) is None:
        reasons.append(f"this GPU (sm_{capability[0]}{capability[1]}; supported: sm_90, sm_100, sm_103)")
    if par.enable_expert_parallel:
        reasons.append("expert parallelism (--enable-expert-parallel)")
    if getattr(par, "use_ubatching", False):
        reasons.append("dual-batch overlap (DBO)")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "num_speculative_tokens", 0):
        reasons.append(f"speculative decoding ({getattr(spec, 'method', None)}, {spec.num_speculative_tokens} "
                       "tokens): every decode step is then a verify step, which has no programs yet")
    if getattr(par, "decode_context_parallel_size", 1) != 1:
        reasons.append(f"decode context parallelism ({par.decode_context_parallel_size})")
    if vllm_config.lora_config is not None:
        reasons.append("LoRA")
    if getattr(model, "enable_sleep_mode", False):
        reasons.append("sleep mode")
    reasons += model_refusals(model.hf_text_config, par.tensor_parallel_size)
    if model.dtype != torch.bfloat16:
        reasons.append(f"model dtype {model.dtype} (the kernels are bf16)")
    if cache.cache_dtype not in KV_CACHE_DTYPES:
        reasons.append(f"KV cache dtype {cache.cache_dtype!r} (the kernels read a bf16 latent cache or fp8 E4M3 "
                       "with one per-tensor scale: --kv-cache-dtype auto, bfloat16, fp8 or fp8_e4m3)")
    try:
        conv, recurrent = MambaStateDtypeCalculator.kda_state_dtype(model.dtype, cache.mamba_cache_dtype,
                                                                    cache.mamba_ssm_cache_dtype)[:2]
    except Exception as e:  # noqa: BLE001  (report it with the others rather than stop here)
        reasons.append(f"KDA state dtypes that cannot be resolved ({e})")
    else:
        if (conv, recurrent) != (torch.bfloat16, torch.float32):
            reasons.append(f"KDA state dtypes conv {conv} / recurrent {recurrent} (the kernels keep a bf16 conv "
                           "state and an fp32 recurrent state)")
    if getattr(model, "enforce_eager", False):
        reasons.append("eager mode (--enforce-eager): the rewritten path runs only in FULL decode CUDA graphs")
    else:
        mode = comp.cudagraph_mode
        if mode is None or mode.decode_mode() != CUDAGraphMode.FULL:
            reasons.append(f"no FULL decode CUDA graphs (cudagraph_mode={mode})")
    backend = moe_backend_refusal(vllm_config)
    if backend:
        reasons.append(backend)
    if comp.mode == CompilationMode.STOCK_TORCH_COMPILE:
        reasons.append("torch.compile (a compiled forward would trace the decode loop)")
    if not getattr(vllm_config, "use_v2_model_runner", False):
        reasons.append("the V1 model runner (programs are built in the V2 runner's model state)")
    return reasons


def check_deployment(vllm_config: Any, capability: tuple[int, int] | None = None) -> None:
    """Raise one error listing every unsupported setting, or return."""
    reasons = deployment_refusals(vllm_config, capability)
    if reasons:
        listed = "".join(f"\n  - {r}" for r in reasons)
        raise ValueError(f"decode_backend=latency_specialized does not support this deployment:{listed}\n"
                         "Use decode_backend=auto (the default) for vLLM's stock decode.")


@dataclass(frozen=True)
class StepDecision:
    rewritten: bool
    reason: str


def decide_step(num_tokens: int, built: frozenset[int] | set[int], capturing: bool, context: Any) -> StepDecision:
    """Whether a step with ``num_tokens`` rows takes the rewritten path, and why (not)."""
    from vllm.config import CUDAGraphMode

    if context is None:
        return StepDecision(False, "no forward context")
    if not capturing:
        return StepDecision(False, "not captured as a CUDA graph (eager, warmup or profiling step)")
    if context.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
        return StepDecision(False, "PIECEWISE CUDA graph")
    if context.cudagraph_runtime_mode != CUDAGraphMode.FULL:
        return StepDecision(False, f"CUDA graph mode {context.cudagraph_runtime_mode}")
    if num_tokens not in built:
        return StepDecision(False, f"{num_tokens} tokens: no program built for this batch size")
    metadata = context.attn_metadata
    rows = list(metadata.values()) if isinstance(metadata, dict) else []
    if not rows:
        return StepDecision(False, "no attention metadata")
    if any(getattr(md, "num_spec_decodes", 0) for md in rows):
        return StepDecision(False, "speculative verify step (not supported yet)")
    prefills = max(getattr(md, "num_prefills", 0) for md in rows)
    decodes = max(getattr(md, "num_decodes", 0) for md in rows)
    if prefills and decodes:
        return StepDecision(False, "mixed batch (prefill and decode rows)")
    if prefills:
        return StepDecision(False, "prefill")
    return StepDecision(True, "pure decode")


class StepLog:
    """How many forward calls took each path, by reason; summarized at shutdown."""

    def __init__(self, summarize_at_exit: bool = True):
        self.counts: Counter[tuple[bool, str]] = Counter()
        if summarize_at_exit:
            atexit.register(self.log_summary)

    def record(self, decision: StepDecision) -> None:
        self.counts[(decision.rewritten, decision.reason)] += 1

    def summary(self) -> str:
        rewritten = sum(n for (r, _), n in self.counts.items() if r)
        stock = sum(n for (r, _), n in self.counts.items() if not r)
        lines = [f"rewriter: {rewritten} forward calls on the rewritten path, {stock} on the stock path"]
        for (r, reason), n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {'rewritten' if r else 'stock':<9} {n:>8}  {reason}")
        return "\n".join(lines)

    def log_summary(self) -> None:
        if self.counts:
            log.info("%s", self.summary())
