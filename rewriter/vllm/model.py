"""``RewrittenKimiLinearForCausalLM``: vLLM's Kimi K3 text model with the rewriter as its
decode forward, selected by ``additional_config={"decode_backend": "latency_specialized"}``.

With ``auto`` it is vLLM's class unchanged. With ``latency_specialized`` it
- checks the deployment and stops startup with every unsupported setting listed;
- asks vLLM for the MoE backend whose expert layout the kernels read (Humming, for MXFP4);
- keeps vLLM's in-tree specialized decode (SM100/103, TP 8/16 only) off, since it
  claims the same knob and would refuse Hopper before our path is even considered;
- builds its programs once the weights are loaded (in the V2 runner's model state), and checks
  them against the KV cache and KDA state once vLLM binds them;
- routes each forward: pure decode steps (with speculative decoding of k tokens: uniform
  verify steps of k + 1 tokens per request) of a built size being captured as FULL CUDA
  graphs run the programs, every other step runs vLLM's stock forward;
- with pipeline parallelism, each stage builds programs for its own layers and runs its part
  of the step: it takes the previous stage's ``IntermediateTensors`` and hands its own on
  (``runtime.run_stage``), the first stage embeds, the last applies the final AttnRes.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from vllm.models.kimi_k3.nvidia import model as stock
from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

from codegen.targets import arch_of
from codegen.template import sm_count
from codegen.templates import make_workspaces
from rewriter.compiler.pipeline import served_batches
from rewriter.compiler.program_cache import ProgramCache
from rewriter.model.config import KimiK3Config
from rewriter.model.pages import vllm_block_size
from rewriter.vllm.experts import select_moe_backend
from rewriter.vllm.guard import (
    KV_CACHE_DTYPES,
    StepDecision,
    StepLog,
    check_deployment,
    cudagraph_mode_refusals,
    decide_step,
    tokens_per_request,
)
from rewriter.vllm.knob import REWRITER, decode_backend
from rewriter.vllm.programs import (
    ProgramSet,
    build_programs,
    check_cache_layouts,
    compile_specs_with_codegen,
    compile_with_codegen,
    use_tp_group,
)
from rewriter.vllm.runtime import run_stage

log = logging.getLogger("rewriter.vllm")


@contextlib.contextmanager
def in_tree_specialized_decode_off() -> Iterator[None]:
    """vLLM's own check of the knob is a module global looked up at call time: stand it down."""
    original = stock.specialized_decode_config
    stock.specialized_decode_config = lambda vllm_config: None
    try:
        yield
    finally:
        stock.specialized_decode_config = original


class RewriterDecode:
    """The rewriter's per-model state: built programs, the step guard, the step log."""

    def __init__(self, vllm_config: Any):
        self.vllm_config = vllm_config
        self.programs: ProgramSet | None = None
        self.sms: int | None = None  # the serving GPU's SMs, read at build: the checks plan for the same
        self.steps = StepLog()

    def build(self, model: "RewrittenKimiLinearForCausalLM") -> None:
        from vllm.distributed import get_tp_group
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        cfg = KimiK3Config.from_dict(self.vllm_config.model_config.hf_text_config.to_dict(), name="served model")
        group = get_tp_group()
        use_tp_group(group)
        backbone = model.model
        layers = list(backbone.layers[backbone.start_layer:backbone.end_layer])
        capture = self.vllm_config.compilation_config.cudagraph_capture_sizes or ()
        arch = arch_of(torch.cuda.get_device_capability())
        sms = self.sms = sm_count(torch.cuda.current_device())
        q = tokens_per_request(self.vllm_config)  # k + 1 with k speculative tokens: every decode step verifies
        batches = served_batches(capture, q, self.vllm_config.scheduler_config.max_num_seqs)
        kv_cache_dtype = KV_CACHE_DTYPES[self.vllm_config.cache_config.cache_dtype]
        # the page vLLM will bind (it fixes it after the model loads), as `compile --all-layers` compiles for
        block_size = vllm_block_size(cfg, group.world_size, kv_cache_dtype, q - 1)
        self.programs = build_programs(layers, cfg, tp=group.world_size, rank=group.rank_in_group, arch=arch,
                                       batches=batches, compile_fn=compile_with_codegen(arch),
                                       group=group.cpu_group, conv_layout=get_conv_state_layout(),
                                       kv_cache_dtype=kv_cache_dtype, program_cache=ProgramCache(), q=q, sms=sms,
                                       block_size=block_size)
        spec = self.vllm_config.speculative_config
        if spec is not None and spec.uses_dynamic_speculative_decoding():
            log.warning("rewriter: dynamic speculative decoding (num_speculative_tokens_per_batch_size): the "
                        "programs verify %d tokens per request; steps with fewer drafts run the stock forward", q)
        rewritten = len(layers) - len(self.programs.fallbacks)
        log.info("rewriter: %d of %d layers rewritten for batch sizes %s of %d tokens per request; %d keep the "
                 "stock forward", rewritten, len(layers), list(self.programs.batches), q, len(self.programs.fallbacks))

    def check_caches(self, model: "RewrittenKimiLinearForCausalLM") -> None:
        """Once vLLM has bound its caches: compile the kernels their page size and layout need
        beyond those built (vLLM fixes the page size after the model loads), and drop the programs
        whose kernels refuse the state as vLLM laid it out (``check_cache_layouts``)."""
        from vllm.distributed import get_tp_group

        if self.programs is None:
            return
        resolved = cudagraph_mode_refusals(self.vllm_config.compilation_config.cudagraph_mode)
        if resolved:  # vLLM resolves the mode when it binds its caches (it may have changed it since startup)
            raise ValueError(f"decode_backend=latency_specialized: vLLM resolved its CUDA graphs to {resolved[0]}; "
                             "no step could take the rewritten programs")
        backbone = model.model
        layers = list(backbone.layers[backbone.start_layer:backbone.end_layer])
        check_cache_layouts(self.programs, layers, arch_of(torch.cuda.get_device_capability()),
                            group=get_tp_group().cpu_group, sms=self.sms,
                            compile_specs=compile_specs_with_codegen())
        # what kernels keep across steps (the MoE router's plan), zeroed now: every served step is captured
        made = make_workspaces({s for p in self.programs.programs.values() for s in p.kernel_specs},
                               torch.cuda.current_device())
        if made:
            log.info("rewriter: %d kernel workspaces made before capture", made)
        log.info("rewriter: %d of %d layers rewritten on vLLM's caches", len(layers) - len(self.programs.fallbacks),
                 len(layers))

    def decide(self, num_tokens: int) -> StepDecision:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if self.programs is None or not self.programs.programs:
            return StepDecision(False, "no layer program built")
        context = get_forward_context() if is_forward_context_available() else None
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return decide_step(num_tokens, set(self.programs.token_counts), capturing, context, self.programs.q)

    def run(self, model: "RewrittenKimiLinearForCausalLM", input_ids: torch.Tensor | None,
            positions: torch.Tensor, inputs_embeds: torch.Tensor | None, intermediate_tensors: Any = None) -> Any:
        """This pipeline stage's part of the step: the final hidden state on the last stage, the
        ``IntermediateTensors`` vLLM sends to the next stage on the others."""
        from vllm.distributed import get_pp_group
        from vllm.forward_context import get_forward_context

        backbone = model.model
        pp = get_pp_group()
        embeddings = None
        if pp.is_first_rank:
            embeddings = inputs_embeds if inputs_embeds is not None else backbone.embed_input_ids(input_ids)
        return run_stage(backbone, self.programs, positions, embeddings, None if pp.is_first_rank else
                         intermediate_tensors, get_forward_context(), last=pp.is_last_rank)


class RewrittenKimiLinearForCausalLM(KimiLinearForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        backend = decode_backend(vllm_config.additional_config)
        if backend == REWRITER:
            check_deployment(vllm_config)
            select_moe_backend(vllm_config)
            with in_tree_specialized_decode_off():
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.rewriter: RewriterDecode | None = RewriterDecode(vllm_config)
            log.info("rewriter: decode_backend=latency_specialized: decode steps take the rewriter's programs "
                     "(vLLM's in-tree specialized decode stays off); other steps take vLLM's stock forward")
        else:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.rewriter = None
            log.info("rewriter: decode_backend=auto: vLLM's stock decode")

    def get_model_state_cls(self) -> type:
        base = super().get_model_state_cls()
        if self.rewriter is None:
            return base
        return _with_rewriter(base)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> Any:
        rewriter = self.rewriter
        if rewriter is not None:
            decision = rewriter.decide(positions.shape[0])
            rewriter.steps.record(decision)
            if decision.rewritten:
                return rewriter.run(self, input_ids, positions, inputs_embeds, intermediate_tensors)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


def _with_rewriter(base: type) -> type:
    """The runner's model state, building the rewriter's programs once weights are loaded."""

    class RewriterModelState(base):
        def __init__(self, vllm_config: Any, model: Any, *args: Any, **kwargs: Any):
            super().__init__(vllm_config, model, *args, **kwargs)
            text = model.get_language_model() if hasattr(model, "get_language_model") else model
            self.rewriter_model = text
            text.rewriter.build(text)

        def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
            out = super().initialize_kv_cache(*args, **kwargs)
            self.rewriter_model.rewriter.check_caches(self.rewriter_model)  # for every cache bound
            return out

    return RewriterModelState
