"""The two guards around the rewritten decode path.

- ``deployment_refusals``: settings the rewriter does not serve. Startup stops with ONE
  error listing every reason at once (vLLM's own check stops at the first).
- ``decide_step``: per forward, whether this step takes the rewritten path. Only steps of
  the kind the programs were built for (pure decode, or with speculative decoding a uniform
  verify step of q = k + 1 tokens per request) of a built size that are being captured as
  FULL CUDA graphs do; the decision is made from the forward context alone, so every TP rank
  of every pipeline stage makes the same one, and it is baked into the captured graph. vLLM's
  V2 model runner captures a FULL graph with the forward context's mode NONE (its PIECEWISE
  captures say PIECEWISE: ``vllm/v1/worker/gpu/cudagraph_utils.py``), so a step being captured
  whose mode is not PIECEWISE is a FULL graph, as vLLM's own specialized decode reads it.
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

from codegen.targets import ARCHES, MAX_Q, arch_of
from rewriter.model.config import ConfigError, KimiK3Config
from rewriter.vllm.experts import moe_backend_refusal

log = logging.getLogger("rewriter.vllm")

# vLLM's --kv-cache-dtype values the MLA programs read, and the DecodeShape.kv_cache_dtype each means
KV_CACHE_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}


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


def tokens_per_request(vllm_config: Any) -> int:
    """q of every decode step: 1, or k + 1 with k speculative tokens (then every decode step is a
    verify step, vLLM's KDA metadata counting each decode row as a spec row)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)


def cudagraph_mode_refusals(mode: Any) -> list[str]:
    """Why a CUDA graph mode does not serve the programs: they run only in FULL graphs of decode
    steps, and a FULL graph of mixed batches would bake a decode program into a graph vLLM also
    replays for prefills."""
    from vllm.config import CUDAGraphMode

    if mode is None or mode.decode_mode() != CUDAGraphMode.FULL:
        return [f"no FULL decode CUDA graphs (cudagraph_mode={mode})"]
    if mode.mixed_mode() == CUDAGraphMode.FULL:
        return [f"FULL CUDA graphs of mixed prefill and decode batches (cudagraph_mode={mode}): use "
                "FULL_AND_PIECEWISE or FULL_DECODE_ONLY"]
    return []


def deployment_refusals(vllm_config: Any, capability: tuple[int, int] | None = None) -> list[str]:
    """Every setting of this deployment the rewriter does not serve (empty: all served)."""
    from vllm.config import CompilationMode
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    capability = capability if capability is not None else _device_capability()
    par, model, cache = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    comp = vllm_config.compilation_config
    reasons = []
    if capability is None:
        reasons.append("no CUDA GPU")
    elif arch_of(capability) is None:
        reasons.append(f"this GPU (sm_{capability[0]}{capability[1]}; supported: "
                       f"{', '.join(a.removesuffix('a') for a in ARCHES)})")
    if par.enable_expert_parallel:
        reasons.append("expert parallelism (--enable-expert-parallel)")
    if getattr(par, "use_ubatching", False):
        reasons.append("dual-batch overlap (DBO)")
    spec = getattr(vllm_config, "speculative_config", None)
    q = tokens_per_request(vllm_config)
    if q > MAX_Q:
        reasons.append(f"speculative decoding ({spec.method}) of {q - 1} tokens a step: the verify programs take "
                       f"at most {MAX_Q} tokens per request (num_speculative_tokens 1..{MAX_Q - 1})")
    if q > 1 and getattr(spec, "enable_adaptive_verification", False):
        reasons.append("adaptive verification (enable_adaptive_verification): its FULL CUDA graphs replay any mix "
                       f"of 1..{q} tokens per request; the verify programs take exactly {q}")
    if getattr(cache, "use_replayssm", False):
        reasons.append("RecoverSSM speculative decoding (--use-replayssm): it keeps one KDA state slot per request "
                       "and commits the accepted tokens after sampling; the verify programs keep vLLM's k + 1 slots "
                       "per request")
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
        reasons += cudagraph_mode_refusals(comp.cudagraph_mode)
    offload = getattr(vllm_config, "offload_config", None)
    if offload is not None and (offload.uva.cpu_offload_gb > 0 or offload.prefetch.offload_group_size > 0):
        reasons.append("weight offloading (--cpu-offload-gb, --offload-group-size): the programs read each layer's "
                       "weights where the model holds them, not through the offloader's hooks")
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


def _is_kda(md: Any) -> bool:
    return hasattr(md, "num_spec_decodes")


def _verifies(md: Any) -> bool:
    """Whether a layer's metadata holds verify rows (KDA: spec decodes; MLA: decodes of more than one token)."""
    return bool(md.num_spec_decodes) if _is_kda(md) else md.num_decode_tokens != md.num_decodes


def uniform_verify_q(md: Any, num_tokens: int) -> int | None:
    """The q of a uniform verify step of ``num_tokens`` graph rows, every request q tokens, as vLLM's
    own specialized decode tests it (``is_uniform_verify``; FULL graphs pad whole requests: KDA
    stages null state rows, MLA zero-length decodes); None: not uniform."""
    if md.num_prefills:
        return None
    if _is_kda(md):
        rows = md.spec_state_indices_tensor
        if md.num_decodes or rows is None or not rows.shape[0] or num_tokens % rows.shape[0]:
            return None
        q = num_tokens // rows.shape[0]
        return q if md.num_spec_decode_tokens == md.num_spec_decodes * q else None
    if not md.num_decodes or num_tokens % md.num_decodes or md.num_decode_tokens != num_tokens:
        return None
    return num_tokens // md.num_decodes


def decide_step(num_tokens: int, built: frozenset[int] | set[int], capturing: bool, context: Any, q: int = 1
                ) -> StepDecision:
    """Whether a step with ``num_tokens`` rows takes the rewritten path, and why (not), for programs
    of ``q`` tokens per request (``built``: their token counts): q = 1 takes pure decode steps,
    q > 1 uniform verify steps of exactly q tokens per request."""
    from vllm.config import CUDAGraphMode

    if context is None:
        return StepDecision(False, "no forward context")
    if not capturing:
        return StepDecision(False, "not captured as a CUDA graph (eager, warmup or profiling step)")
    if context.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
        return StepDecision(False, "PIECEWISE CUDA graph")
    # NONE while capturing: the V2 runner's FULL capture; FULL: the V1 runner's
    if context.cudagraph_runtime_mode not in (CUDAGraphMode.NONE, CUDAGraphMode.FULL):
        return StepDecision(False, f"CUDA graph mode {context.cudagraph_runtime_mode}")
    if num_tokens not in built:
        return StepDecision(False, f"{num_tokens} tokens: no program built for this batch size")
    metadata = context.attn_metadata
    rows = list(metadata.values()) if isinstance(metadata, dict) else []
    if not rows:
        return StepDecision(False, "no attention metadata")
    verify = any(_verifies(md) for md in rows)
    prefills = max(md.num_prefills for md in rows)
    decodes = max(md.num_decodes for md in rows)
    if prefills and (decodes or verify):
        return StepDecision(False, "mixed batch (prefill and decode rows)")
    if prefills:
        return StepDecision(False, "prefill")
    if not verify:
        if q > 1:
            return StepDecision(False, f"one-token decode step: the programs verify {q} tokens per request")
        return StepDecision(True, "pure decode")
    if q == 1:
        return StepDecision(False, "speculative verify step: no verify programs built")
    for md in rows:
        step_q = uniform_verify_q(md, num_tokens)
        if step_q is None:
            return StepDecision(False, "non-uniform verify step (requests verify different numbers of tokens)")
        if step_q != q:
            return StepDecision(False, f"verify step of {step_q} tokens per request: the programs verify {q}")
    return StepDecision(True, f"uniform verify ({q} tokens per request)")


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
