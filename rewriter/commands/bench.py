"""``python -m rewriter bench``: time one layer, rewritten and reference, on this GPU.

Routed experts are the checkpoint's MXFP4 in Humming's layout (what vLLM serves on sm_90) unless
``--experts bf16``. Two floors: the layer's as served (each weight read once per rank under the
sharding the rules chose, the experts' own format, padding left out: the ``% floor`` column) and
the reference layer's (replicated weights read whole on every rank, as vLLM holds them).
For each TP shard shape and batch: the rewritten layer (its schedule run by ``LayerRunner``
with the CuTe DSL kernels installed), the layer on vLLM 0.33's stock sm_90 kernels where they
run here (``rewriter.commands.stock_path``: Humming's MXFP4 MoE, fla's Triton KDA decode, cuBLAS, under
torch.compile and a CUDA graph; what stands in for a vLLM kernel is named there) and the
reference layer eager, under a CUDA graph and
under ``torch.compile`` with max-autotune (``--compile-mode default``: no autotuning, for
many shapes in little GPU time) and a CUDA graph (inductor's own graphs skip a
layer that updates its decode state in place, so the compiled layer is compiled without
them, ``max-autotune-no-cudagraphs``, and captured here, as vLLM captures it). Every row
gives kernels per layer (counted with the profiler over one un-captured call), the median
microseconds per layer, and the share of the layer's HBM floor that reaches.

How it is measured, and what it leaves out:
- one GPU runs rank 0 of the TP shape; collectives are excluded (``rewriter.model.ops.
  collectives_excluded``: the all-reduce is a copy, the router's gather repeats the local
  share), so the figures are one rank's compute without communication;
- ``copies`` layers with their own random weights and decode state run back to back in one
  timed call, so each layer reads weights that are not in the L2 (the copies' weights
  together exceed it several times over); the copies in turn, repeated, so that a replay runs
  at least ``--layers-per-replay`` layers (default 8), as a model's step graph runs its layers
  back to back: the graph's launch and its first kernel's ramp are shared by those layers
  (with the 3 copies of a one-token step alone they added 2 to 8 us to each, H200,
  BENCHMARKS.md); time per layer = median replay / layers run;
- medians over ``reps`` timed replays, CUDA events around each replay, after ``WARM_UP_S`` of
  untimed replays (the clocks up after the capture or compile before); each replay queued
  behind a GPU sleep, so that the host's submission of the graph is not timed (a step graph
  of a whole model pays it once, not once per 8 layers).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rewriter.commands.layer_args import add_rules_arg, rules_of
from rewriter.commands.variant import kernel_sources_swapped, kernel_variant_files
from rewriter.compiler.cost import H200_COPY_TBPS, hbm_us

L2_BYTES = 50 * 2**20  # H200: 50 MiB
PATHS = ("rewritten", "vllm-stock", "eager", "cuda graph", "torch.compile")
COMPILE_MODES = {"max-autotune": "max-autotune-no-cudagraphs", "default": "default"}  # bench captures its own graph


@dataclass
class Row:
    tp: int
    batch: int
    path: str
    kernels: int | None  # GPU kernels per layer (profiler), None when not counted
    us: float | None  # median microseconds per layer, None when not run
    floor_us: float  # the layer as served
    note: str = ""
    reference_floor_us: float = 0.0  # the reference layer: replicated weights whole
    stand_ins: int = 0  # torch kernels standing in for excluded collectives (timed, not counted)
    launched: list[tuple[str, float]] | None = None  # (kernel, us) of one profiled call
    # one layer of a graph replay: (kernel, start us, duration us, us it added to the layer's span)
    timeline: list[tuple[str, float, float, float]] | None = None
    paired_diff_us: float | None = None  # a variant's row: median of (variant - tree) over paired replays

    @property
    def floor_pct(self) -> float | None:
        return None if not self.us else 100.0 * self.floor_us / self.us


LAYERS_PER_REPLAY = 8  # default: layers a timed replay runs (the copies in turn, repeated)


def rounds_for(copies: int, layers: int) -> int:
    """How many times a replay runs the copies in turn, so that it runs at least ``layers`` layers."""
    return max(1, math.ceil(layers / copies))


def repeated(run: Callable[[], Any], rounds: int) -> Callable[[], Any]:
    """``run`` called ``rounds`` times in a row (what one timed call or graph replay runs)."""
    def run_rounds():
        for _ in range(rounds):
            run()
    return run_rounds


def copies_for(floor_bytes: int, requested: int | None) -> int:
    """Layers per timed call: enough that their weights exceed the L2 four times (at least 2)."""
    if requested is not None:
        return requested
    return max(2, math.ceil(4 * L2_BYTES / max(floor_bytes, 1)))


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help="time a layer rewritten vs reference on this GPU (needs CUDA)")
    b.add_argument("--model", default="kimi-k3", help="a preset or a config.json (default kimi-k3)")
    b.add_argument("--layer", type=int, default=1, help="layer index (default 1, a KDA+MoE layer)")
    b.add_argument("--tp", type=int, nargs="+", default=[16, 8], help="TP shard shapes to run (default 16 8)")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batches (default 1 8 64)")
    b.add_argument("--experts", default="mxfp4", choices=("mxfp4", "bf16"),
                   help="routed experts: the checkpoint's MXFP4 in Humming's layout (default), or bf16")
    b.add_argument("--q", type=int, default=1,
                   help="tokens per request: 2..8 is a speculative verify step (default 1)")
    b.add_argument("--context", type=int, default=4096,
                   help="tokens each request already holds in the MLA cache (default 4096)")
    b.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="MLA latent cache: bf16 or fp8 E4M3 with one per-tensor scale (default bf16)")
    b.add_argument("--copies", type=int, help="layer copies, each with its own weights and state (default: 4x the "
                   "L2 in weights)")
    b.add_argument("--layers-per-replay", type=int, default=LAYERS_PER_REPLAY,
                   help="layers a timed replay runs at least, the copies in turn, repeated, as a model's step graph "
                        f"runs its layers (default {LAYERS_PER_REPLAY})")
    b.add_argument("--reps", type=int, default=30, help="timed replays per row (default 30)")
    b.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="what to run (default all)")
    b.add_argument("--compile-mode", choices=COMPILE_MODES, default="max-autotune",
                   help="the torch.compile path's Inductor mode: max-autotune (default; about 45 to 90 s per "
                        "shape at full size) or default (no autotuning, much faster to compile); CUDA graph either way")
    b.add_argument("--variant", type=Path, metavar="DIR",
                   help="kernel sources (codegen/kernels/*.py at their paths below DIR) to time against the tree's "
                        "in the same process: both captured on the same weights, replays alternating, paired")
    b.add_argument("--hbm-tbps", type=float, metavar="TBPS",
                   help=f"HBM bandwidth of the floor, TB/s (default: {H200_COPY_TBPS} on an H200, the copy measured "
                        "there; on any other GPU a copy measured at start)")
    add_rules_arg(b)
    b.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    b.add_argument("--svg", type=Path, metavar="PATH",
                   help="also draw each rewritten row's replay timeline into PATH (rewriter/commands/timeline_svg.py)")
    return b


def _check_args(args: argparse.Namespace) -> None:
    from rewriter.model.shape import ShapeError

    bad = [f"--tp {t}" for t in args.tp if t < 1] + [f"--batch {b}" for b in args.batch if b < 1]
    if args.context < 0:
        bad.append(f"--context {args.context}")
    if not 1 <= args.q <= 8:
        bad.append(f"--q {args.q} (1..8)")
    bad += [f"--batch {b} x --q {args.q} = {b * args.q} tokens (at most 64)" for b in args.batch if b * args.q > 64]
    if args.copies is not None and args.copies < 1:
        bad.append(f"--copies {args.copies}")
    if args.layers_per_replay < 1:
        bad.append(f"--layers-per-replay {args.layers_per_replay}")
    if args.reps < 3:
        bad.append(f"--reps {args.reps} (at least 3)")
    if args.hbm_tbps is not None and not args.hbm_tbps > 0:
        bad.append(f"--hbm-tbps {args.hbm_tbps} (TB/s, positive)")
    if bad:
        raise ShapeError(f"bad value: {', '.join(bad)}")
    if args.variant is not None:
        if "rewritten" not in args.paths:
            raise ShapeError("--variant times the rewritten path's kernels: keep 'rewritten' in --paths")
        kernel_variant_files(args.variant)
    if args.svg is not None and not args.svg.parent.is_dir():
        raise ShapeError(f"--svg {args.svg}: no folder {args.svg.parent} to write it into")
    if not torch.cuda.is_available():
        raise ShapeError("bench needs a CUDA GPU (inspect and compile run without one)")


KNOWN_COPY_TBPS = {"H200": H200_COPY_TBPS}  # device-to-device copy bandwidth measured on GPUs named so


def floor_bandwidth(device_name: str, requested: float | None, measure: Callable[[], float]) -> tuple[float, str]:
    """The HBM bandwidth a row's floor is at, and where it comes from: ``--hbm-tbps`` if given;
    on an H200 its measured copy (every figure in BENCHMARKS.md is at it); on any other GPU a copy
    measured now, so that an H100 (HBM3, about 0.7x an H200's bandwidth) is not held to an H200's
    floor."""
    if requested is not None:
        return requested, "--hbm-tbps"
    for name, tbps in KNOWN_COPY_TBPS.items():
        if name in device_name:
            return tbps, f"the copy measured on an {name}"
    return round(measure(), 2), f"a copy measured on this {device_name} at start"


def measured_copy_tbps(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written over the median of ``reps``
    copies of ``nbytes`` (past the L2), in TB/s."""
    src = torch.randint(1, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = sorted(_timed_us(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * nbytes / (times[len(times) // 2] * 1e-6) / 1e12


def _timed_us(run: Callable[[], Any]) -> float:
    """One call, timed with CUDA events around it (host launches included: the eager path's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0


HEAD_START_CYCLES = 2_000_000  # about 1 ms at Hopper's clocks: longer than the host takes to submit a replay
HEAD_START_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel, left out of the profiled replays


def timed_replay_us(replay: Callable[[], Any]) -> float:
    """One graph replay, timed with CUDA events around it, queued behind a GPU sleep so that the
    start event fires after the host has submitted the whole replay. Timed from an idle stream,
    a replay of 8 or 9 layers also timed the host's submission: 2 to 10 us a layer above the
    layer's profiled span (layer 3, TP 16, one token: 76.5 us a layer, 69.2 with the sleep, H100,
    BENCHMARKS.md, method); a model's step graph pays it once for all its layers."""
    torch.cuda._sleep(HEAD_START_CYCLES)
    return _timed_us(replay)


WARM_UP_S = 0.3  # GPU time run before any timed call: the clocks come up from idle in about this


def warmed_up(run: Callable[[], Any], seconds: float = WARM_UP_S) -> int:
    """Call ``run`` until ``seconds`` have passed (at least twice) and return how many times: a
    GPU idle since the last row (capture, compile) times its first calls at lower clocks. On
    an H100, layer 3's 20 replays timed straight after capture gave 73.1 us a layer where the
    profiled replay after them ran a layer every 68 us (BENCHMARKS.md, method)."""
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < seconds:
        run()
        torch.cuda.synchronize()
        calls += 1
    return calls


def _median_us(run: Callable[[], Any], reps: int, timed: Callable[[Callable[[], Any]], float] = _timed_us) -> float:
    warmed_up(run)
    return statistics.median(timed(run) for _ in range(reps))


def _median_replay_us(replay: Callable[[], Any], reps: int) -> float:
    return _median_us(replay, reps, timed_replay_us)


def alternated_us(run_a: Callable[[], Any], run_b: Callable[[], Any], reps: int,
                  timed: Callable[[Callable[[], Any]], float] = timed_replay_us) -> tuple[list[float], list[float]]:
    """``reps`` timed calls of each, in pairs, the order turning each pair (A B, B A, A B, ...) so
    that neither always runs right after the other's warm caches or clocks."""
    a, b = [], []
    for i in range(reps):
        for run, out in ((run_a, a), (run_b, b)) if i % 2 == 0 else ((run_b, b), (run_a, a)):
            out.append(timed(run))
    return a, b


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float, float, int]:
    """(median, first and third quartile of b[i] - a[i], how many pairs b is the lower in)."""
    if not a or len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} timings: pairs are needed")
    diffs = sorted(y - x for x, y in zip(a, b))
    q1, _, q3 = statistics.quantiles(diffs, n=4, method="inclusive") if len(diffs) > 1 else diffs * 3
    return statistics.median(diffs), q1, q3, sum(y < x for x, y in zip(a, b))


def captured_graph(run: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``run`` captured in a CUDA graph, after one warm-up call on a side stream."""
    stream = torch.cuda.Stream()  # warm up on a side stream, as capture wants
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    torch.cuda.synchronize()
    return g


def profile_kernels(run: Callable[[], Any]) -> list[tuple[str, float]]:
    """(name, microseconds) of each GPU kernel one call launches, in launch order (memcpy and
    memset not counted)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        run()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in split_events(prof.events())[0]]


def split_events(events: list) -> tuple[list, list]:
    """A profile's GPU events in start order, split into kernels and memory operations (memcpy,
    memset: graph nodes that are not kernels, which break a PDL chain)."""
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and HEAD_START_KERNEL not in e.name), key=lambda e: e.time_range.start)
    memory = [e for e in gpu if e.name.startswith(("Memcpy", "Memset"))]
    return [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))], memory


def replay_timeline(replay: Callable[[], Any], per_layer: int, layers: int
                    ) -> tuple[list[tuple[str, float, float, float]] | None, list[tuple[str, float]], list[float],
                               list[float]]:
    """The kernels of one layer (``middle_layer``'s) in one profiled graph replay: (name, start us
    from the layer's first kernel, duration us, us by which its end moved the layer's last end
    so far). The last column sums to the layer's span under replay, so it says which kernels
    the layer waits on (a kernel that ends inside an earlier one adds 0); None where the
    profiler does not see kernels inside a graph replay. Second: the replay's memory
    operations (name, us), which the layers' spans do not show. Third and fourth: ``layer_gaps``
    and ``layer_periods`` of the replay (empty where the layers cannot be told apart)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        torch.cuda._sleep(HEAD_START_CYCLES)  # as timed: the replay submitted before it starts
        replay()
        torch.cuda.synchronize()
    events, memory = split_events(prof.events())
    memory_ops = [(e.name, e.time_range.elapsed_us()) for e in memory]
    layer = middle_layer(events, per_layer, layers)
    if layer is None:
        return None, memory_ops, [], []
    spans = [(e.time_range.start, e.time_range.end) for e in layer]
    every = [(e.time_range.start, e.time_range.end) for e in events]
    return ([(e.name, start - spans[0][0], end - start, added)
             for e, (start, end), added in zip(layer, spans, span_additions(spans))],
            memory_ops, layer_gaps(every, per_layer), layer_periods(every, per_layer))


def layer_gaps(spans: list[tuple[float, float]], per_layer: int) -> list[float]:
    """For a replay's kernels in start order, ``per_layer`` a layer: from each layer's latest end to
    the next layer's first start (negative where the next layer starts early under PDL). What
    the profiler sees between layers, beside the figure less one layer's span, which also holds
    what profiling itself moves."""
    layers = [spans[i:i + per_layer] for i in range(0, len(spans), per_layer)]
    return [nxt[0][0] - max(end for _, end in prev) for prev, nxt in zip(layers, layers[1:])]


def layer_periods(spans: list[tuple[float, float]], per_layer: int) -> list[float]:
    """For a replay's kernels in start order, ``per_layer`` a layer: each layer's time from its first
    start to the next layer's, and the last layer's from its first start to its latest end. Their
    sum is the replay's span; beside the timed figure a layer, they say whether the middle layer
    (the span printed) is one like the others, and what the replay spends outside its kernels."""
    layers = [spans[i:i + per_layer] for i in range(0, len(spans), per_layer)]
    if len(layers) < 2:
        return []
    return ([nxt[0][0] - prev[0][0] for prev, nxt in zip(layers, layers[1:])]
            + [max(end for _, end in layers[-1]) - layers[-1][0][0]])


def middle_layer(events: list, per_layer: int, layers: int) -> list | None:
    """The events of the replay's middle layer (``layers // 2``: the chain ramped by the layers
    before it, as most layers of a model's step find it), from a replay's events in start order;
    None unless there are ``per_layer`` for each of the ``layers``."""
    if len(events) != per_layer * layers:
        return None
    k = layers // 2
    return events[k * per_layer:(k + 1) * per_layer]


def span_additions(spans: list[tuple[float, float]]) -> list[float]:
    """For intervals sorted by start: how far each one's end moved the latest end so far (the
    first: its own length). They sum to the whole span."""
    out, last = [], spans[0][0] if spans else 0.0
    for _, end in spans:
        out.append(max(0.0, end - last))
        last = max(last, end)
    return out


def short_name(kernel: str) -> str:
    """A generated kernel's module and class (``kda_core.KdaCore``), else torch's name cut short."""
    if "codegenkernels" in kernel:
        tail = kernel.split("codegenkernels", 1)[1].split("_object_at_")[0]
        return tail
    return kernel[:60]


def label_kernels(launched: list[tuple[str, float]], specs: list) -> list[tuple[str, float]]:
    """Each profiled kernel under the name of the spec it ran (``latent_tail_gemm`` rather than
    the ``gemm.SkinnyGemm`` class five templates share): generated kernels are matched, in launch
    order, to the first unmatched spec of the schedule whose kernel module they come from;
    torch's kernels keep their own names, cut short."""
    pending = list(specs)
    out = []
    for name, us in launched:
        label = short_name(name)
        if "codegenkernels" in name:
            for i, spec in enumerate(pending):
                stem = spec.module
                if label.startswith(stem) and label[len(stem):len(stem) + 1].isupper():  # module + class
                    label = spec.kernel
                    del pending[i]
                    break
        out.append((label, us))
    return out


def count_kernels(run: Callable[[], Any]) -> tuple[int, list[str]]:
    """GPU kernels one call launches (memcpy/memset not counted) and their names."""
    names = [name for name, _ in profile_kernels(run)]
    return len(names), names


def compilable_inputs(inputs: dict) -> list:
    """The layer's inputs with the KDA state's pages split into one buffer per dtype (same strides),
    which torch.compile takes (it refuses in-place updates of one buffer's views in two dtypes)."""
    from rewriter.model.layers.state import conv_layout_of, kda_state_pages

    if "conv_state" in inputs:
        inputs["conv_state"], inputs["recurrent_state"] = kda_state_pages(
            inputs["conv_state"], inputs["recurrent_state"], conv_layout_of(inputs["conv_state"]), shared=False)
    return list(inputs.values())


class _Case:
    """``copies`` layers of one TP shape and batch on the GPU, with their inputs."""

    def __init__(self, cfg, layer_idx: int, shape, copies: int, experts: str):
        from rewriter.model.layers import build_layer
        from rewriter.model.layers.state import decode_inputs
        from rewriter.model.layers.weights import init_random_

        self.shape = shape
        self.layers = [init_random_(build_layer(cfg, layer_idx, tp=shape.tp, device="cuda", experts=experts),
                                    seed=1000 + i)
                       for i in range(copies)]
        self.inputs = [compilable_inputs(decode_inputs(layer, self.shape, device="cuda", seed=i))
                       for i, layer in enumerate(self.layers)]

    def reference(self) -> Callable[[], Any]:
        def run():
            for layer, inputs in zip(self.layers, self.inputs):
                layer(*inputs)
        return run


def _rewritten(case: _Case, rules) -> tuple[Callable[[], Any], Callable[[], Any], Any]:
    """(all copies, one copy, the rewrite of copy 0): each copy traced, rewritten by ``rules`` and
    run by its schedule."""
    from rewriter.compiler.program import LayerRunner
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace

    runners, first = [], None
    for layer in case.layers:
        result = rewrite(trace(layer, case.shape), rules)
        first = first or result
        runners.append(LayerRunner.of(result, "cuda"))

    def run():
        for runner, inputs in zip(runners, case.inputs):
            runner(*inputs)

    return run, (lambda: runners[0](*case.inputs[0])), first


@dataclass
class _Captured:
    """The rewritten layer's copies captured in one CUDA graph on the kernels this process loads
    now (the tree's, or a variant's inside ``kernel_sources_swapped``)."""
    graph: torch.cuda.CUDAGraph
    launched: list[tuple[str, float]]  # one copy's kernels in one un-captured call (profiler)
    fallbacks: list[str]  # fused ops whose reference ran instead of a kernel

    @classmethod
    def of(cls, run_all: Callable[[], Any], run_one: Callable[[], Any], rounds: int) -> _Captured:
        from codegen import bind

        before = {op: dict(c) for op, c in bind.stats().items()}
        run_all()  # compiles or loads every kernel outside the capture
        torch.cuda.synchronize()
        fallbacks = sorted({op.split("::")[-1] for op, c in bind.stats().items()
                            if c.get("reference", 0) > before.get(op, {}).get("reference", 0)})
        run_all()  # the profiled call reads copy 0's weights after the other copies evicted them
        launched = profile_kernels(run_one)
        return cls(captured_graph(repeated(run_all, rounds)), launched, fallbacks)

    def row(self, path: str, us: float, *, tp: int, batch: int, floor_us: float, ref_floor_us: float, specs: list,
            layers: int, progress: Callable[[str], None], note: str = "") -> Row:
        """The row of ``us`` per layer, with the kernels named by their specs and one layer of a
        profiled replay; printed as progress."""
        kernels = len(self.launched)
        labels = label_kernels(self.launched, specs)
        timeline, memory_ops, gaps, periods = replay_timeline(self.graph.replay, kernels, layers)
        if timeline is not None:
            names = [label for label, _ in label_kernels([(n, d) for n, _, d, _ in timeline], specs)]
            timeline = [(label, round(t, 2), round(d, 2), round(a, 2)) for label, (_, t, d, a) in zip(names, timeline)]
        others = [short_name(n) for n, _ in self.launched if "codegenkernels" not in n]
        notes = [note] if note else []
        notes += [f"reference ran for: {', '.join(self.fallbacks)}"] if self.fallbacks else []
        if memory_ops:  # not kernels: a memcpy or memset node breaks the PDL chain around it
            notes.append(f"{len(memory_ops) / layers:g} memcpy/memset a layer in the replay "
                         f"({sum(u for _, u in memory_ops) / layers:.1f} us a layer)")
        stand_ins = len(others) if tp > 1 and not self.fallbacks else 0  # the router's all-gather, repeated
        if stand_ins:
            kernels -= stand_ins
            notes.append(f"+{stand_ins} torch kernels standing in for the router's all-gather (timed, not counted)")
        elif others:
            notes.append(f"{len(others)} torch kernels: {', '.join(others)}")
        row = Row(tp, batch, path, kernels, us, floor_us, "; ".join(notes), ref_floor_us, stand_ins,
                  [(label, round(t, 2)) for label, t in labels], timeline)
        progress(f"  {path}: {kernels} kernels, {us:.1f} us {row.note}")
        for label, k_us in labels:
            progress(f"    {k_us:7.1f} us  {label}")
        progress("  one layer of a graph replay: start us, duration us, us added to the layer's span"
                 if timeline else "  (the profiler saw no kernels inside the graph replay)")
        for label, t, d, a in timeline or ():
            progress(f"    {t:7.1f} {d:7.1f} {a:7.1f}  {label}")
        if timeline:
            progress(f"    between layers: {us - sum(a for *_, a in timeline):.1f} us (the figure less the span)")
        if gaps:
            progress(f"    between layers, profiled: median {statistics.median(gaps):.1f} us from one layer's last "
                     f"end to the next's first start (min {min(gaps):.1f}, max {max(gaps):.1f}, "
                     f"{len(gaps)} boundaries)")
        if periods:
            mean = statistics.fmean(periods)
            progress(f"    the profiled replay: {mean:.1f} us a layer from its first kernel's start "
                     f"to its last's end (the figure less it: {us - mean:.1f} us, outside the "
                     f"kernels); a layer's period: first {periods[0]:.1f}, median {statistics.median(periods):.1f}, "
                     f"min {min(periods):.1f}, max {max(periods):.1f} us")
        return row


def bench_shape(cfg, args: argparse.Namespace, tp: int, batch: int, arch: str,
                progress: Callable[[str], None]) -> list[Row]:
    from rewriter.compiler.plan import install_kernels, plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    meta_shape = DecodeShape(batch=batch, tp=tp, rank=0, arch=arch, q=args.q, context=args.context,
                             kv_cache_dtype=args.kv_cache_dtype)
    rules = rules_of(args)
    planned = rewrite(trace(build_layer(cfg, args.layer, tp=tp, experts=args.experts), meta_shape), rules)
    floor, ref_floor = planned.served_floor_bytes(), planned.reference_floor_bytes()
    floor_us, ref_floor_us = hbm_us(floor, args.floor_tbps), hbm_us(ref_floor, args.floor_tbps)
    copies = copies_for(floor, args.copies)
    rounds = rounds_for(copies, args.layers_per_replay)
    layers = copies * rounds  # per timed replay
    progress(f"TP {tp} batch {batch}: {copies} layer copies x {rounds} per replay, HBM floor as served "
             f"{floor / 1e6:.1f} MB = {floor_us:.1f} us (reference layer {ref_floor / 1e6:.1f} MB = "
             f"{ref_floor_us:.1f} us)")
    case = _Case(cfg, args.layer, meta_shape, copies, args.experts)
    rows = []
    if "rewritten" in args.paths:
        install_kernels(arch)
        run_all, run_one, result = _rewritten(case, rules)
        specs = [s for row in plan(result, arch) for s in row.get("specs", ())]
        tree = _Captured.of(run_all, run_one, rounds)
        shown = dict(tp=tp, batch=batch, floor_us=floor_us, ref_floor_us=ref_floor_us, specs=specs, layers=layers,
                     progress=progress)
        if args.variant is None:
            rows.append(tree.row("rewritten", _median_replay_us(tree.graph.replay, args.reps) / layers, **shown))
        else:
            progress(f"  the variant's kernels ({args.variant}), captured on the same weights")
            with kernel_sources_swapped(args.variant):
                variant = _Captured.of(run_all, run_one, rounds)
            warmed_up(tree.graph.replay)
            a_us, b_us = alternated_us(tree.graph.replay, variant.graph.replay, args.reps)
            a_us, b_us = [t / layers for t in a_us], [t / layers for t in b_us]
            diff, q1, q3, lower = paired_difference(a_us, b_us)
            rows.append(tree.row("rewritten", statistics.median(a_us), **shown))
            rows.append(variant.row("variant", statistics.median(b_us), **shown,
                                    note=f"{args.variant}; variant - tree over {len(a_us)} paired replays: median "
                                         f"{diff:+.2f} us (quartiles {q1:+.2f} to {q3:+.2f}), lower in {lower}"))
            rows[-1].paired_diff_us = round(diff, 3)
            del variant
        del tree
    if "vllm-stock" in args.paths:
        rows.append(_stock_row(case, tp, batch, floor_us, ref_floor_us, args.reps, rounds, progress))
    ref = case.reference()
    if "eager" in args.paths:
        ref()
        kernels, _ = count_kernels(lambda: case.layers[0](*case.inputs[0]))
        rows.append(Row(tp, batch, "eager", kernels, _median_us(repeated(ref, rounds), args.reps) / layers, floor_us,
                        reference_floor_us=ref_floor_us))
        progress(f"  eager: {rows[-1].kernels} kernels, {rows[-1].us:.1f} us")
    if "cuda graph" in args.paths:
        g = captured_graph(repeated(ref, rounds))
        kernels, _ = count_kernels(lambda: case.layers[0](*case.inputs[0]))
        rows.append(Row(tp, batch, "cuda graph", kernels, _median_replay_us(g.replay, args.reps) / layers, floor_us,
                        reference_floor_us=ref_floor_us))
        progress(f"  cuda graph: {rows[-1].us:.1f} us")
        del g
    if "torch.compile" in args.paths:
        t0 = time.perf_counter()
        compiled = [torch.compile(layer, mode=COMPILE_MODES[args.compile_mode]) for layer in case.layers]

        def run_compiled():
            for fn, inputs in zip(compiled, case.inputs):
                fn(*inputs)

        run_compiled()  # compile and autotune
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        kernels, _ = count_kernels(lambda: compiled[0](*case.inputs[0]))
        g = captured_graph(repeated(run_compiled, rounds))
        us = _median_replay_us(g.replay, args.reps) / layers
        rows.append(Row(tp, batch, "torch.compile", kernels, us, floor_us,
                        f"{args.compile_mode}, CUDA graph; compiled in {seconds:.0f}s", ref_floor_us))
        del g
        progress(f"  torch.compile: {us:.1f} us ({rows[-1].note})")
    return rows


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def agreement(run_a: Callable[..., Any], run_b: Callable[..., Any], inputs: list) -> float:
    """The largest relative error between two paths' outputs and updated states over one step
    from the same inputs (each on its own copy); NaN where either holds a NaN or an infinity."""
    copies = [[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs] for _ in range(2)]
    outs = [_tensors(run(*c)) + [t for t in c if isinstance(t, torch.Tensor)]
            for run, c in zip((run_a, run_b), copies)]
    errors = [float((b.float() - a.float()).norm() / a.float().norm().clamp_min(1e-30))
              for a, b in zip(*outs) if a.is_floating_point()]
    return math.nan if any(not math.isfinite(e) for e in errors) else max(errors)


def _stock_row(case: _Case, tp: int, batch: int, floor_us: float, ref_floor_us: float, reps: int, rounds: int,
               progress: Callable[[str], None]) -> Row:
    """The layer on vLLM's stock sm_90 kernels, or why it cannot run here."""
    from rewriter.commands.stock_path import StockPathError, lower

    try:
        lowered = [lower(layer, case.shape) for layer in case.layers]
    except ModuleNotFoundError as e:
        return Row(tp, batch, "vllm-stock", None, None, floor_us, f"not run: needs {e.name} (humming-kernels, "
                   "fla-core)", ref_floor_us)
    except StockPathError as e:
        return Row(tp, batch, "vllm-stock", None, None, floor_us, f"not run: {e}", ref_floor_us)
    t0 = time.perf_counter()
    compiled = [torch.compile(gm) for gm in lowered]  # Inductor's default mode, as vLLM compiles

    def run():
        for fn, inputs in zip(compiled, case.inputs):
            fn(*inputs)

    run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    diff = agreement(case.layers[0], compiled[0], case.inputs[0])
    run()  # the profiled call reads copy 0's weights after the other copies evicted them
    launched = profile_kernels(lambda: compiled[0](*case.inputs[0]))
    kernels = len(launched)
    g = captured_graph(repeated(run, rounds))
    us = _median_replay_us(g.replay, reps) / (len(compiled) * rounds)
    del g
    row = Row(tp, batch, "vllm-stock", kernels, us, floor_us,
              f"Humming MoE, fla Triton KDA, cuBLAS; torch.compile, CUDA graph; compiled in {seconds:.0f}s; "
              f"vs reference {diff:.1e}", ref_floor_us, launched=[(short_name(n), round(t, 2)) for n, t in launched])
    progress(f"  vllm-stock: {kernels} kernels, {us:.1f} us ({row.note})")
    for name, k_us in launched:
        progress(f"    {k_us:7.1f} us  {short_name(name)}")
    return row


def render(rows: list[Row], device: str, experts: str, layer: str = "", floor_at: str = "") -> str:
    """The run's table; ``floor_at``: the bandwidth the floors are at and its source."""
    lines = [f"{device}; {layer}{experts} routed experts; one rank of each TP shape, collectives excluded; weights "
             "rotated past the L2",
             "floor: the layer as served (each weight once per rank under the rules' sharding); ref floor: the "
             f"reference layer (replicated weights whole){'; floors at ' + floor_at if floor_at else ''}",
             f"{'TP':>3} {'batch':>5}  {'path':<14}{'kernels':>8}{'us/layer':>10}{'floor us':>10}{'% floor':>9}"
             f"{'ref floor':>10}  note"]
    for r in rows:
        us = f"{r.us:10.1f}" if r.us else f"{'-':>10}"
        pct = f"{r.floor_pct:8.0f}%" if r.floor_pct else f"{'-':>9}"
        k = f"{r.kernels:8d}" if r.kernels is not None else f"{'-':>8}"
        lines.append(f"{r.tp:>3} {r.batch:>5}  {r.path:<14}{k}{us}{r.floor_us:10.1f}{pct}{r.reference_floor_us:10.1f}"
                     f"  {r.note}")
    return "\n".join(lines)


def write_svg(run: dict, path: Path, log: Callable[[str], None]) -> None:
    """The run's replay timelines drawn into ``path``, or why there are none (the run's table and
    JSON still print: a missing picture does not cost the measurements)."""
    from rewriter.commands.timeline_svg import TimelineError, panels_of, render, title_of

    try:
        path.write_text(render(panels_of(run), title_of(run)))
    except TimelineError as e:
        log(f"--svg {path}: not written: {e}")
        return
    log(f"--svg: wrote {path}")


def run_bench(args: argparse.Namespace) -> int:
    from codegen.bind import device_arch
    from rewriter.model.config import KimiK3Config
    from rewriter.model.ops import collectives_excluded
    from rewriter.model.shape import ShapeError

    _check_args(args)
    arch = device_arch()
    if arch is None:
        raise ShapeError(f"no CuTe DSL target for this GPU (capability {torch.cuda.get_device_capability()})")
    cfg = KimiK3Config.load(args.model)
    device = f"{torch.cuda.get_device_name()} ({arch})"
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    args.floor_tbps, floor_source = floor_bandwidth(torch.cuda.get_device_name(), args.hbm_tbps, measured_copy_tbps)
    floor_at = f"{args.floor_tbps} TB/s ({floor_source})"
    log(f"floors at {floor_at}")
    rows: list[Row] = []
    with torch.no_grad(), collectives_excluded():
        for tp in args.tp:
            for batch in args.batch:
                rows.extend(bench_shape(cfg, args, tp, batch, arch, log))
                torch.cuda.empty_cache()  # the shape's layer copies are gone
    run = {"device": device, "model": args.model, "layer": args.layer, "attention": cfg.attention_kind(args.layer),
           "q": args.q, "experts": args.experts,
           "variant": None if args.variant is None else str(args.variant),
           "context": args.context, "kv_cache_dtype": args.kv_cache_dtype,
           "floor_tbps": args.floor_tbps, "floor_source": floor_source,
           "rows": [{**asdict(r), "floor_pct": r.floor_pct} for r in rows]}
    if args.svg is not None:
        write_svg(run, args.svg, log)
    if args.json:
        print(json.dumps(run, indent=1))
    else:
        kind = cfg.layer_kind(args.layer)
        mla = (f", context {args.context}, {args.kv_cache_dtype} latent cache"
               if cfg.attention_kind(args.layer) == "mla" else "")
        verify = f"verify steps of {args.q} tokens per request; " if args.q > 1 else ""
        print(render(rows, device, args.experts, f"layer {args.layer} ({kind}{mla}); {verify}", floor_at))
    return 0
