"""``python -m rewriter bench``: argument checks, copies and the table (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from conftest import on_gpu
from rewriter.commands.bench import L2_BYTES, Row, copies_for, floor_bandwidth, render, repeated, rounds_for
from rewriter.commands.cli import main


def test_copies_rotate_weights_past_the_l2():
    assert copies_for(10 * 2**20, None) * 10 * 2**20 >= 4 * L2_BYTES
    assert copies_for(300e6, None) == 2 and copies_for(300e6, 5) == 5


@pytest.mark.parametrize("copies,layers,rounds", [(2, 8, 4), (3, 8, 3), (8, 8, 1), (12, 8, 1), (2, 1, 1), (5, 11, 3)])
def test_a_replay_runs_at_least_the_layers_asked(copies, layers, rounds):
    """The copies in turn, repeated: at least ``layers`` layers, at most one round more than needed."""
    assert rounds_for(copies, layers) == rounds
    assert copies * rounds >= layers and (rounds == 1 or copies * (rounds - 1) < layers)
    calls = []
    repeated(lambda: calls.append(1), rounds)()
    assert len(calls) == rounds


def test_table_gives_the_share_of_the_floor():
    rows = [Row(16, 1, "rewritten", 12, 100.0, 65.0), Row(16, 1, "torch.compile", None, None, 65.0, "not run")]
    assert rows[0].floor_pct == pytest.approx(65.0) and rows[1].floor_pct is None
    text = render(rows, "H200 (sm_90a)", "mxfp4")
    assert "collectives excluded" in text and " 65%" in text and "not run" in text and "mxfp4 routed experts" in text


def _no_measuring() -> float:
    raise AssertionError("measured a copy where the bandwidth was known")


def test_floors_are_at_the_bandwidth_of_the_gpu_that_runs():
    """An H200 keeps the copy measured there (every BENCHMARKS.md figure); another GPU measures its
    own at start, so an H100 is not held to an H200's floor; ``--hbm-tbps`` wins over both."""
    assert floor_bandwidth("NVIDIA H200", None, _no_measuring) == (4.27, "the copy measured on an H200")
    tbps, source = floor_bandwidth("NVIDIA H100 80GB HBM3", None, lambda: 2.9134)
    assert tbps == 2.91 and "measured on this NVIDIA H100 80GB HBM3 at start" in source
    assert floor_bandwidth("NVIDIA H100 80GB HBM3", 3.35, _no_measuring) == (3.35, "--hbm-tbps")
    assert floor_bandwidth("NVIDIA H200", 5.0, _no_measuring) == (5.0, "--hbm-tbps")
    text = render([Row(8, 1, "rewritten", 7, 100.0, 65.0)], "H100", "mxfp4", floor_at="2.91 TB/s (a copy)")
    assert "floors at 2.91 TB/s (a copy)" in text


@on_gpu
def test_a_measured_copy_is_a_plausible_hbm_bandwidth():
    """The copy moves 2 GiB (read and written) past the L2: between 1 and 10 TB/s on any HBM GPU."""
    from rewriter.commands.bench import measured_copy_tbps

    assert 1.0 < measured_copy_tbps() < 10.0


@pytest.mark.parametrize("argv,message", [
    (["--tp", "0"], "--tp 0"),
    (["--batch", "0", "--reps", "2"], "--batch 0, --reps 2"),
    (["--q", "9"], "--q 9 (1..8)"),
    (["--layers-per-replay", "0"], "--layers-per-replay 0"),
    (["--q", "4", "--batch", "1", "32"], "--batch 32 x --q 4 = 128 tokens (at most 64)"),
    (["--hbm-tbps", "0"], "--hbm-tbps 0.0 (TB/s, positive)"),
])
def test_bad_arguments_name_the_problem(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_compile_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--compile-mode", "reduce-overhead"])
    assert e.value.code == 2 and "--compile-mode: invalid choice: 'reduce-overhead'" in capsys.readouterr().err


def test_unknown_expert_format_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--experts", "fp8"])
    assert e.value.code == 2 and "--experts: invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_profiled_kernels_are_named_by_their_specs():
    """The KDA+MoE layer at TP 16, 64 tokens: five of its kernels are the one ``SkinnyGemm`` class
    (and ``gemv`` would be three); each profiled kernel gets its spec's name, in launch order, the
    torch kernels between them keep theirs, and ``expert_up`` does not take ``expert_up_mxfp4``'s."""
    from rewriter.commands.bench import label_kernels
    from rewriter.compiler.plan import plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    layer = build_layer(KimiK3Config.preset("kimi-k3"), 1, tp=16, experts="mxfp4")
    result = rewrite(trace(layer, DecodeShape(batch=64, tp=16, arch="sm_90a")))
    specs = [s for row in plan(result, "sm_90a") for s in row.get("specs", ())]
    kernels = [s.kernel for s in specs]
    # the input projection's and the router's: generated
    assert kernels.count("product_gemm") == 2 and "expert_up_mxfp4" in kernels
    launched = []
    for i, s in enumerate(specs):  # as the profiler names a CuTe DSL kernel: module, then class
        launched.append((f"kernel_cutlass_kernel_codegenkernels{s.module}Cls{i}_object_at__0", 1.0 + i))
        if i == 2:
            launched.append(("void at::native::elementwise_kernel<128, 2>", 0.5))
    labels = label_kernels(launched, specs)
    assert [name for name, _ in labels] == kernels[:3] + ["void at::native::elementwise_kernel<128, 2>"] + kernels[3:]
    assert [us for _, us in labels][:3] == [1.0, 2.0, 3.0]
    one_token = rewrite(trace(layer, DecodeShape(batch=1, tp=16, arch="sm_90a")))
    shared_up = [s for row in plan(one_token, "sm_90a") for s in row.get("specs", ()) if s.kernel == "expert_up"]
    assert shared_up  # the shared experts' GEMV at one token
    stray = label_kernels([("kernel_cutlass_kernel_codegenkernelsexpert_up_mxfp4ExpertUpMxfp4_object_at__0", 1.0)],
                          shared_up)
    assert stray == [("expert_up_mxfp4ExpertUpMxfp4", 1.0)]  # no spec of its module: the class name


def test_span_additions_say_what_each_kernel_adds_to_the_layer():
    from rewriter.commands.bench import span_additions

    # a kernel inside the previous one adds nothing; an early start (PDL) adds only its tail; a gap counts
    spans = [(0.0, 3.0), (1.0, 2.5), (2.0, 5.0), (7.0, 8.0)]
    assert span_additions(spans) == [3.0, 0.0, 2.0, 3.0]
    assert sum(span_additions(spans)) == spans[-1][1] - spans[0][0]
    assert span_additions([]) == []


def test_the_timeline_is_the_middle_layers():
    """Of a replay's layers the middle one is profiled (the chain ramped by those before it);
    a replay whose kernel count is not the layers' is not sliced at all."""
    from rewriter.commands.bench import middle_layer

    events = [f"layer{i}.k{j}" for i in range(8) for j in range(3)]
    assert middle_layer(events, 3, 8) == ["layer4.k0", "layer4.k1", "layer4.k2"]
    assert middle_layer(events[:3], 3, 1) == events[:3]
    assert middle_layer(events[:-1], 3, 8) is None


def test_layer_gaps_run_from_a_layers_latest_end_to_the_next_layers_first_start():
    """A layer's latest end need not be its last kernel's (a side stream's kernel may end later);
    a next layer that starts early under PDL gives a negative gap."""
    from rewriter.commands.bench import layer_gaps

    spans = [(0.0, 4.0), (1.0, 9.0), (5.0, 7.0),  # layer 0 ends at 9 (its middle kernel)
             (12.0, 13.0), (13.0, 14.0), (14.0, 16.0),  # layer 1 starts 3 us later
             (15.5, 17.0), (17.0, 18.0), (18.0, 19.0)]  # layer 2 starts 0.5 us before layer 1 ends
    assert layer_gaps(spans, 3) == [3.0, -0.5]
    assert layer_gaps(spans[:3], 3) == []


def test_layer_periods_run_first_start_to_first_start_and_sum_to_the_replays_span():
    """Each layer's period, the last one's to its latest end: together the replay's span, so
    their mean beside the timed figure says what the timed replays spend outside the kernels."""
    from rewriter.commands.bench import layer_periods

    spans = [(0.0, 4.0), (1.0, 9.0), (5.0, 7.0),
             (12.0, 13.0), (13.0, 14.0), (14.0, 16.0),
             (15.5, 17.0), (17.0, 20.0), (18.0, 19.0)]  # the last layer's latest end: its middle kernel
    assert layer_periods(spans, 3) == [12.0, 3.5, 4.5]
    assert sum(layer_periods(spans, 3)) == max(end for _, end in spans) - spans[0][0]
    assert layer_periods(spans[:3], 3) == []


def test_timed_calls_follow_a_warm_up_of_the_same_call(monkeypatch):
    """At least two untimed calls, and as many as fill the warm-up time (on a clock each call
    moves by 1/64 s, so that a loaded CI machine cannot change the count)."""
    from rewriter.commands import bench as bench_cmd

    clock = [0.0]

    def call():
        clock[0] += 1 / 64

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_cmd.time, "perf_counter", lambda: clock[0])
    assert bench_cmd.warmed_up(call, seconds=0.0) == 2
    assert bench_cmd.warmed_up(call, seconds=5 / 64) == 5


def test_memory_operations_are_kept_apart_from_kernels():
    """A profile's memcpy and memset (graph nodes that are not kernels) are not counted as kernels
    nor dropped: the bench names them in its row. CPU events are left out; both lists in start order."""
    from types import SimpleNamespace

    from rewriter.commands.bench import split_events

    def event(name, start, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=start + 1))

    events = [event("kernel_b", 3.0), event("Memcpy DtoD (Device -> Device)", 2.0), event("kernel_a", 1.0),
              event("Memset (Device)", 4.0), event("aten::mm", 0.5, torch.autograd.DeviceType.CPU)]
    kernels, memory = split_events(events)
    assert [e.name for e in kernels] == ["kernel_a", "kernel_b"]
    assert [e.name for e in memory] == ["Memcpy DtoD (Device -> Device)", "Memset (Device)"]


def test_the_head_start_sleep_is_not_a_kernel_of_the_replay():
    """The GPU sleep queued before a profiled replay (the bench's head start) is left out of its
    kernels, so that layers are still told apart by counting."""
    from types import SimpleNamespace

    from rewriter.commands.bench import split_events

    def event(name, start):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=start + 1))

    sleep = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    kernels, memory = split_events([event("kernel_a", 2.0), event(sleep, 0.0), event("kernel_b", 3.0)])
    assert [e.name for e in kernels] == ["kernel_a", "kernel_b"] and memory == []


def test_a_timed_replay_starts_its_clock_after_a_head_start(monkeypatch):
    """The replay is queued behind a GPU sleep, then the start event: the host's submission of the
    graph falls inside the sleep, not inside the timed span."""
    from rewriter.commands import bench as bench_cmd

    calls = []

    class Event:
        def __init__(self, enable_timing):
            self.name = "start" if not any(c == "event start" for c in calls) else "end"
            calls.append(f"event {self.name}")

        def record(self):
            calls.append(f"record {self.name}")

        def elapsed_time(self, other):
            return 0.25

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(f"sleep {cycles}"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    assert bench_cmd.timed_replay_us(lambda: calls.append("replay")) == 250.0
    assert calls == [f"sleep {bench_cmd.HEAD_START_CYCLES}", "event start", "event end", "record start", "replay",
                     "record end", "sync"]
