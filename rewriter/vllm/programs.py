"""Build, at server start, one program per decoder layer and batch size, and run them.

For each layer of the loaded vLLM backbone: bind vLLM's parameter tensors to a reference
layer by name (no copies; routed experts in the format vLLM's MoE backend left them), trace
it, rewrite it and compile its kernels for every batch size served: one-token decode steps,
or with speculative decoding (k tokens drafted a step) verify steps of q = k + 1 tokens per
request, the only decode steps vLLM then runs. A layer whose program cannot be built (a
parameter that is not what the kernels take, a missing kernel, a compile failure) keeps
vLLM's stock forward, with the reason logged. Then every TP rank adopts the union of all
ranks' fallbacks, so all ranks take the same path before any program's collective runs.

Graphs depend only on a layer's structure (attention kind, dense or MoE, its AttnRes
position), not on its weights, so each distinct structure is traced and rewritten once
per batch size and re-rooted on each layer's parameters.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from codegen.spec import KernelSpec
from codegen.targets import MAX_Q, MAX_TOKENS
from rewriter.compiler.plan import install_kernels, plan, program_refusal
from rewriter.compiler.program import LayerRunner
from rewriter.compiler.program_cache import ProgramCache, rewrite_cached
from rewriter.compiler.rewrite import RewriteResult, is_fused
from rewriter.compiler.schedule import Schedule, build_schedule
from rewriter.compiler.trace import propagate_meta
from rewriter.model.config import KimiK3Config
from rewriter.model.layers import KimiDecoderLayer, build_layer
from rewriter.model.layers.experts import ExpertFormat, mxfp4_scale_refusal
from rewriter.model.layers.state import conv_layout_of
from rewriter.model.shape import DecodeShape
from rewriter.vllm.experts import ExpertLayoutError, served_expert_format
from rewriter.vllm.state import cache_tensors

log = logging.getLogger("rewriter.vllm")

class ProgramError(Exception):
    """Why one layer's program cannot be built; that layer keeps the stock forward."""


def use_tp_group(group: Any) -> None:
    """vLLM's TP group (its ``GroupCoordinator``) as the programs' ``"tp"`` group, so the
    all-reduces and gathers inside a layer's program are vLLM's own (one group per pipeline
    stage: its TP ranks): the custom all-reduce, symmetric-memory or NCCL path it picks for the
    message and captures in its CUDA graphs, as its stock forward's are."""
    from rewriter.model.ops import register_group

    register_group("tp", group)


def bind_layer(vllm_layer: nn.Module, cfg: KimiK3Config, layer_idx: int, tp: int, rank: int,
               dtype: torch.dtype = torch.bfloat16) -> KimiDecoderLayer:
    """A reference layer whose parameters ARE vLLM's loaded tensors, matched by name; its routed
    experts in the format vLLM's MoE backend left them (``served_expert_format``). A tensor
    missing, of another shape or dtype, or holding NaN or infinities is named in a
    ``ProgramError`` (read once, at build), never met as a wrong answer in a step."""
    fmt = "bf16"
    moe = getattr(vllm_layer, "block_sparse_moe", None)
    if moe is not None and cfg.is_moe_layer(layer_idx):
        try:
            fmt = served_expert_format(moe.experts.routed_experts)
        except (AttributeError, ExpertLayoutError) as e:
            raise ProgramError(str(e)) from e
    ref = build_layer(cfg, layer_idx, tp=tp, rank=rank, dtype=dtype, device="meta", experts=fmt)
    theirs = dict(vllm_layer.named_parameters())
    problems = []
    for name, mine in list(ref.named_parameters()):
        src = theirs.get(name)
        if src is None:
            problems.append(f"{name} missing")
        elif tuple(src.shape) != tuple(mine.shape) or src.dtype != mine.dtype:
            problems.append(f"{name} is {tuple(src.shape)} {src.dtype} in vLLM, the reference layer "
                            f"({ExpertFormat.parse(fmt).name} experts) takes {tuple(mine.shape)} {mine.dtype}")
        elif src.is_floating_point() and src.device.type != "meta" and not bool(torch.isfinite(src).all()):
            problems.append(f"{name} holds NaN or infinite values (a corrupted checkpoint tensor?)")
        else:
            owner, _, leaf = name.rpartition(".")
            setattr(ref.get_submodule(owner) if owner else ref, leaf, src)
    if problems:
        raise ProgramError("parameters do not match the reference layer: " + "; ".join(problems[:4])
                           + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""))
    if ref.expert_format is not None and ref.expert_format.quantized:
        reason = mxfp4_scale_refusal(ref.block_sparse_moe.experts.routed_experts)
        if reason:
            raise ProgramError(reason)
    return ref


def missing_cuda_kernels(result: RewriteResult) -> list[str]:
    """Fused ops of a rewritten graph with no CUDA implementation registered."""
    ops = {n.target for n in result.after.graph.nodes if is_fused(n)}
    return sorted(op.name() for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"))


def require_cuda_kernels(result: RewriteResult, rows: list[dict]) -> None:
    """The default compile step: every fused op must have a CUDA kernel registered (the plan's
    ``rows`` are not needed for that)."""
    missing = missing_cuda_kernels(result)
    if missing:
        raise ProgramError(f"no CUDA kernel registered for {', '.join(missing)}")


SpecCompileFn = Callable[[list[KernelSpec]], None]  # compile these kernels (or read the disk cache), or raise


def _codegen() -> tuple[Any, Any]:
    """CuTe DSL's compile entry points, or ``ProgramError`` naming why they are unavailable."""
    try:
        from codegen.compiler import CodegenError, available, compile_kernel
    except ImportError as e:
        raise ProgramError(f"CuTe DSL kernels unavailable ({e}); pip install 'k3-decode-rewriter[cutedsl]'") from e
    reason = available()
    if reason:
        raise ProgramError(f"CuTe DSL kernels unavailable: {reason}")
    return compile_kernel, CodegenError


def compile_specs_with_codegen(progress: Callable[[str], None] | None = None) -> SpecCompileFn:
    """Compile kernels (or read them from the disk cache), ``ProgramError`` on the first failure.
    ``progress`` gets a line per kernel compiled now (a cache miss: seconds each)."""
    progress = progress or (lambda line: log.info("%s", line))

    def compile_specs(specs: list[KernelSpec]) -> None:
        compile_kernel, codegen_error = _codegen()
        for spec in specs:
            try:
                compile_kernel(spec, progress=lambda line: progress(f"rewriter: {line}"))
            except codegen_error as e:
                raise ProgramError(f"kernel compile failed: {e}") from e

    return compile_specs


def compile_with_codegen(arch: str, progress: Callable[[str], None] | None = None) -> CompileFn:
    """The server's compile step: every fused op of the schedule needs a CuTe DSL template that
    takes its shapes; compile those (or read the disk cache) and register them as the ops'
    CUDA kernels. Anything short of that keeps the layer on the stock forward, with why.
    ``progress`` gets a line per kernel compiled now (a cache miss: seconds each)."""
    compile_specs = compile_specs_with_codegen(progress)

    def compile_fn(result: RewriteResult, rows: list[dict]) -> None:
        _codegen()
        reason = program_refusal(rows)
        if reason:
            raise ProgramError(reason)
        compile_specs([s for row in rows for s in row.get("specs", ())])
        install_kernels(arch, strict=True)  # in a served step a declined call raises, never runs slow
        require_cuda_kernels(result, rows)

    return compile_fn


@dataclass
class LayerProgram:
    layer_idx: int
    batch: int
    runner: LayerRunner  # the rewritten graph, kernel by kernel on its streams
    kernels: int
    result: RewriteResult  # the rewrite it runs (its graph is shared by the layers of one structure)
    structure: tuple  # KimiDecoderLayer.structure
    kernel_specs: frozenset  # the specs its kernels were compiled for (on the traced state layout)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.runner(*inputs)

    def kernels_for_state(self, states: dict[str, torch.Tensor], arch: str, sms: int | None = None
                          ) -> tuple[str | None, list[KernelSpec]]:
        """Whether the kernels can take these state tensors (shapes, dtypes, strides as vLLM laid
        them out): the graph's values re-derived from them (meta tensors, nothing run) and every
        fused op's template asked again, for a GPU of ``sms`` SMs as at build. Returns why not (or
        None) and the kernels they need that were not built: the graph does not depend on the
        cache's page size or the conv state's layout, but the kernels are specialized to them, and
        vLLM fixes its page size only after the programs are built."""
        gm = self.result.after.gm
        propagate_meta(gm, [states.get(n.name, n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"])
        rows = plan(self.result, arch, sms=sms)
        reason = program_refusal(rows)
        if reason:
            return reason, []
        return None, list(dict.fromkeys(spec for row in rows for spec in row.get("specs", ())
                                        if spec not in self.kernel_specs))


@dataclass
class ProgramSet:
    programs: dict[tuple[int, int], LayerProgram] = field(default_factory=dict)  # by (layer, tokens a step)
    fallbacks: dict[int, str] = field(default_factory=dict)  # layer -> why it keeps the stock forward
    batches: tuple[int, ...] = ()  # requests a step
    q: int = 1  # tokens per request: 1, or k + 1 for verify steps of k speculative tokens

    @property
    def token_counts(self) -> tuple[int, ...]:
        """Tokens of the steps served (what a forward sees as its ``num_tokens``)."""
        return tuple(b * self.q for b in self.batches)

    def get(self, layer_idx: int, num_tokens: int) -> LayerProgram | None:
        return self.programs.get((layer_idx, num_tokens))

    def drop(self, layer_idx: int, reason: str) -> None:
        """Layer ``layer_idx`` loses its programs for every batch and keeps vLLM's stock forward."""
        self.fallbacks[layer_idx] = reason
        for tokens in self.token_counts:
            self.programs.pop((layer_idx, tokens), None)


CompileFn = Callable[[RewriteResult, list[dict]], None]  # (rewrite, its kernel plan): compile or raise


def build_programs(vllm_layers: list[nn.Module], cfg: KimiK3Config, *, tp: int, rank: int, arch: str,
                   batches: Iterable[int], compile_fn: CompileFn = require_cuda_kernels,
                   group: Any = None, progress: Callable[[str], None] | None = None,
                   conv_layout: str = "SD", kv_cache_dtype: str = "bf16",
                   program_cache: ProgramCache | None = None, q: int = 1, sms: int | None = None,
                   block_size: int = DecodeShape.block_size) -> ProgramSet:
    """Programs for every (layer, batch), traced on KDA state in ``conv_layout`` (vLLM's
    ``get_conv_state_layout()``) and an MLA cache of ``kv_cache_dtype`` (bf16 or fp8), for steps
    of ``q`` tokens per request (q > 1: speculative verify, ``DecodeShape.q``); layers that fail
    on any rank fall back on all. ``program_cache``: rewritten graphs read from (and stored to)
    disk, as a warm server start does; None rewrites every one. ``sms``: the serving GPU's SMs,
    which cap the grids that must be resident at once (None: as many as any grid asks), so the
    kernels compiled here are the ones its steps launch. ``block_size``: the MLA cache page the
    programs are traced for (vLLM fixes its own only once the caches are bound, and
    ``check_cache_layouts`` compiles for that where it differs)."""
    batches = tuple(sorted(set(batches)))
    if not 1 <= q <= MAX_Q or any(b * q > MAX_TOKENS for b in batches):
        raise ValueError(f"programs take 1..{MAX_Q} tokens per request and at most {MAX_TOKENS} tokens a step; "
                         f"asked for batches {list(batches)} of {q}")
    progress = progress or (lambda line: log.info("%s", line))
    out = ProgramSet(batches=batches, q=q)
    built: dict[tuple, tuple[RewriteResult, Schedule, frozenset] | ProgramError] = {}  # per (structure, batch, q)
    start = time.perf_counter()
    for i, vllm_layer in enumerate(vllm_layers):
        idx = getattr(vllm_layer, "layer_idx", i)
        try:
            ref = bind_layer(vllm_layer, cfg, idx, tp, rank)
            for b in batches:
                shape = DecodeShape(batch=b, q=q, tp=tp, rank=rank, arch=arch, conv_layout=conv_layout,
                                    kv_cache_dtype=kv_cache_dtype, block_size=block_size)
                result, schedule, specs = _built(built, ref.structure, ref, shape, compile_fn, program_cache, sms)
                gm = fx.GraphModule(ref, result.after.graph, class_name=f"K3Layer{idx}Batch{b}Q{q}")
                rooted = RewriteResult(before=result.before, after=replace(result.after, gm=gm, module=ref))
                device = next(ref.parameters()).device
                out.programs[(idx, shape.tokens)] = LayerProgram(idx, b, LayerRunner(rooted, schedule, device),
                                                                 len(schedule.kernels), rooted, ref.structure, specs)
        except Exception as e:  # noqa: BLE001  (any failure keeps this one layer on the stock forward)
            reason = str(e) if isinstance(e, ProgramError) else f"{type(e).__name__}: {e}"
            out.drop(idx, reason)
            log.warning("rewriter: layer %d keeps the stock forward: %s", idx, reason)
        progress(f"rewriter: layer {i + 1}/{len(vllm_layers)} built ({time.perf_counter() - start:.1f} s)")
    agree_across_ranks(out, [getattr(m, "layer_idx", i) for i, m in enumerate(vllm_layers)], group)
    return out


def _built(cache: dict, structure: tuple, ref: KimiDecoderLayer, shape: DecodeShape, compile_fn: CompileFn,
           program_cache: ProgramCache | None, sms: int | None) -> tuple[RewriteResult, Schedule, frozenset]:
    """Trace, rewrite, schedule and compile once per layer structure and batch; later layers
    of the same structure reuse the graph (re-rooted on their own weights) and its kernels."""
    key = (structure, shape.batch, shape.q)
    if key not in cache:
        result = rewrite_cached(ref, shape, program_cache)
        schedule = build_schedule(result.after)
        rows = plan(result, shape.arch, schedule, sms)
        try:
            compile_fn(result, rows)
            cache[key] = (result, schedule, frozenset(spec for row in rows for spec in row.get("specs", ())))
        except ProgramError as e:
            cache[key] = e
    entry = cache[key]
    if isinstance(entry, ProgramError):
        raise entry
    return entry


def check_cache_layouts(programs: ProgramSet, vllm_layers: list[nn.Module], arch: str, group: Any = None,
                        sms: int | None = None, compile_specs: SpecCompileFn | None = None) -> None:
    """Once vLLM has bound its KV cache and KDA state: every program's kernels asked about the
    state tensors as vLLM laid them out (page-strided slots, its conv layout, its cache page
    size); a layer whose kernels refuse them keeps the stock forward, with the reason, on every
    rank. So a state the kernels cannot read is refused here, before any step, never run by the
    ops' references inside a served step. Kernels the layout needs beyond those built (vLLM's
    page size is not known when the programs are built) are compiled here by ``compile_specs``,
    still before any step; without it such a layer keeps the stock forward too. Each layer
    structure and layout is checked once. ``sms``: the serving GPU's SMs, as at build."""
    checked: dict[tuple, tuple[str | None, list[KernelSpec]]] = {}
    compiled: dict[KernelSpec, None] = {}  # in order, each once however many structures need it

    def compile_new(specs: list[KernelSpec]) -> None:
        new = [spec for spec in specs if spec not in compiled]
        if new:
            compile_specs(new)
            compiled.update(dict.fromkeys(new))

    for i, layer in enumerate(vllm_layers):
        idx = getattr(layer, "layer_idx", i)
        states = cache_tensors(layer)
        rows = speculative_conv_rows(layer, states, programs.q)
        if rows:
            _keep_stock(programs, idx, rows)
            continue
        layout = tuple((n, tuple(t.shape), t.stride(), t.dtype) for n, t in sorted(states.items()))
        for tokens in programs.token_counts:
            program = programs.get(idx, tokens)
            if program is None:
                continue
            key = (program.structure, tokens, layout)
            if key not in checked:
                try:
                    checked[key] = _state_kernels(program, states, arch, sms, compile_specs and compile_new)
                except Exception as e:  # noqa: BLE001  (one layer keeps the stock forward; the ranks still agree)
                    checked[key] = f"its check failed: {type(e).__name__}: {e}", []
            reason, added = checked[key]
            if reason:
                _keep_stock(programs, idx, f"the state as vLLM lays it out: {reason}")
                break
            program.kernel_specs = program.kernel_specs | frozenset(added)
    if compiled:
        log.info("rewriter: %d kernels compiled for the caches as vLLM laid them out, not as traced; "
                 "`python -m rewriter compile --all-layers %s` fills the kernel cache ahead",
                 len(compiled), _compile_flags(vllm_layers, sms))
    agree_across_ranks(programs, [getattr(m, "layer_idx", i) for i, m in enumerate(vllm_layers)], group)


def _state_kernels(program: LayerProgram, states: dict[str, torch.Tensor], arch: str, sms: int | None,
                   compile_specs: SpecCompileFn | None) -> tuple[str | None, list[KernelSpec]]:
    """(why ``program`` cannot serve ``states``, or None; the kernels compiled for them now)."""
    reason, missing = program.kernels_for_state(states, arch, sms)
    if reason or not missing:
        return reason, []
    if compile_specs is None:
        return (f"it needs kernels not built for the traced layout: {', '.join(s.label() for s in missing)} "
                "(build the programs for vLLM's layout: DecodeShape.conv_layout and block_size)"), []
    try:
        compile_specs(missing)
    except ProgramError as e:
        return f"its kernels for this layout: {e}", []
    return None, missing


def _compile_flags(vllm_layers: list[nn.Module], sms: int | None) -> str:
    """``compile --all-layers``'s options for the caches as vLLM bound them and this GPU."""
    def first(name: str) -> torch.Tensor | None:
        return next((t for t in (cache_tensors(layer).get(name) for layer in vllm_layers) if t is not None), None)

    cache, conv = first("kv_cache"), first("conv_state")
    flags = [f"--sms {sms}"] if sms else []
    flags += [f"--block-size {cache.shape[1]}"] if cache is not None else []
    flags += [f"--conv-layout {conv_layout_of(conv)}"] if conv is not None and conv_layout_of(conv) else []
    return " ".join(flags)


def _keep_stock(programs: ProgramSet, idx: int, reason: str) -> None:
    """Layer ``idx`` drops its programs for every batch and keeps vLLM's stock forward, the reason logged."""
    programs.drop(idx, reason)
    log.warning("rewriter: layer %d keeps the stock forward: %s", idx, reason)


def speculative_conv_rows(vllm_layer: nn.Module, states: dict[str, torch.Tensor], q: int = 1) -> str | None:
    """Why a KDA layer's programs cannot serve this conv state: vLLM keeps ``K - 1 + k`` rows per
    slot with ``k`` speculative tokens a step, and programs built for ``q`` tokens per request read
    ``K - 2 + q`` (None: the two agree)."""
    conv = states.get("conv_state")
    width = getattr(vllm_layer.self_attn, "conv_size", None)
    if conv is None or width is None or conv.shape[-1] == width - 2 + q:
        return None
    built = "one-token decode steps" if q == 1 else f"verify steps of {q} tokens per request"
    return (f"vLLM keeps {conv.shape[-1]} conv state rows per slot ({width - 1} + {conv.shape[-1] - width + 1} "
            f"speculative tokens): the programs are built for {built}, which read {width - 2 + q}")


def agree_across_ranks(programs: ProgramSet, layer_ids: list[int], group: Any) -> None:
    """Make every rank drop the layers any rank could not build (one all-reduce at startup)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    failed = torch.tensor([1 if i in programs.fallbacks else 0 for i in layer_ids], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    for i, flag in zip(layer_ids, failed.tolist()):
        if flag and i not in programs.fallbacks:
            programs.drop(i, "its program failed to build on another TP rank")
