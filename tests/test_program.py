"""LayerRunner: a rewritten layer run kernel by kernel, aux stream and events included."""
from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, make_layer, rel_err
from rewriter.compiler.program import LayerRunner
from rewriter.compiler.rewrite import rewrite
from rewriter.compiler.schedule import build_schedule
from rewriter.compiler.trace import trace
from rewriter.model.shape import DecodeShape


def _prepared(tiny, layer_idx, device="cpu", dtype=torch.float32):
    layer = make_layer(tiny, layer_idx, seed=70 + layer_idx, dtype=dtype).to(device)
    result = rewrite(trace(layer, DecodeShape(batch=3, dtype=dtype, context=5, block_size=4)))
    return layer, result, build_schedule(result.after)


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_runner_equals_the_rewritten_graph_on_cpu(tiny, layer_idx):
    layer, result, schedule = _prepared(tiny, layer_idx)
    inputs = make_inputs(layer, batch=3, context=5, block_size=4, seed=1)
    a = result.after.gm(*{k: v.clone() for k, v in inputs.items()}.values())
    b = LayerRunner(result, schedule)(*{k: v.clone() for k, v in inputs.items()}.values())
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_runner_knows_the_aux_kernels(tiny):
    _, result, schedule = _prepared(tiny, 1)
    runner = LayerRunner(result, schedule)
    aux = {k for k, s in runner.stream_name.items() if s == "aux"}
    assert aux == {"shared_experts_gemm"}  # batch 3: the shared experts' GEMM rule
    assert runner.waits["shared_experts_gemm"] and runner.waits["latent_tail"] == ["shared_experts_gemm"]
    # the shared experts wait on a main kernel and the latent tail on them: the events order the streams
    # already, so no fork from the caller's stream at the start, no join at the end
    assert not runner.fork and not runner.join


def test_a_layer_on_one_stream_gets_no_side_stream(tiny):
    """Layer 0 (dense MLP: no aux kernel) runs on the caller's stream alone: no side stream is
    made (so none is forked and joined around each layer of a captured step); layer 1's
    shared experts get one."""
    _, result, schedule = _prepared(tiny, 0)
    assert all(k.stream == "main" for k in schedule.kernels)
    runner = LayerRunner(result, schedule, device="cuda")  # makes no CUDA object
    assert set(runner.streams) == {"main"} and not runner.fork and not runner.join
    if torch.cuda.is_available():
        _, result, schedule = _prepared(tiny, 1)
        assert set(LayerRunner(result, schedule, device="cuda").streams) == {"main", "aux"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_runner_on_gpu_matches_cpu(tiny, layer_idx):
    """Streams and events change nothing: the GPU run (aux stream in use from layer 1; layer 0 on
    the caller's stream alone) equals the CPU one."""
    layer, result, schedule = _prepared(tiny, layer_idx, dtype=torch.bfloat16)
    inputs = make_inputs(layer, batch=3, context=5, block_size=4, seed=2)
    cpu = result.after.gm(*{k: v.clone() for k, v in inputs.items()}.values())
    gpu_layer = layer.to("cuda")
    gpu_result = rewrite(trace(gpu_layer, DecodeShape(batch=3, context=5, block_size=4)))
    runner = LayerRunner(gpu_result, build_schedule(gpu_result.after), device="cuda")
    gpu = runner(*{k: v.clone().cuda() for k, v in inputs.items()}.values())
    torch.cuda.synchronize()
    for x, y in zip(gpu, cpu):
        assert rel_err(x.cpu(), y) < 2e-2
