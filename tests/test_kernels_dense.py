"""The ``dense_mlp`` template (``k3f::dense_mlp``, layer 0's dense MLP): the shared experts'
two kernels at the dense sizes, the down projection's I split over warps.

1. specs at Kimi K3's TP 16 and TP 8 shapes and refusals (no CuTe DSL);
2. compiles for sm_90a with no register spills (ptxas; skipped without CuTe DSL);
3. on a GPU (marked ``gpu``): fresh random inputs, outputs poisoned with NaN, against the op's
   CPU reference (bf16 relative error <= 1e-2) at 1, 5 and 8 tokens, and dispatched through
   ``install_cuda_kernels`` inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch
from conftest import gpu_kernels, needs_cutedsl, on_gpu, ptxas_usage, rel_err

import patterns.layer  # noqa: F401  (defines k3f::dense_mlp)
import rewriter.ops  # noqa: F401
from codegen import bind
from codegen.templates import spec_for_call
from rewriter.config import KimiK3Config

K3 = KimiK3Config.preset("kimi-k3")
H = K3.hidden_size
BETA, LINEAR_BETA = K3.activation_situ_beta, K3.activation_situ_linear_beta
INTER = {f"tp{tp}": K3.shard(tp).dense_intermediate for tp in (16, 8)}  # 2112, 4224
OP = "k3f::dense_mlp"
TOL = 1e-2


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def dense_args(tokens=1, inter=2112, hidden=H, make=meta, tp=1):
    return make(tokens, hidden), make(2 * inter, hidden), make(hidden, inter), BETA, LINEAR_BETA, "tp", tp


@pytest.mark.parametrize("shape", list(INTER))
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_specs_at_kimi_k3_shapes(shape, tokens):
    inter = INTER[shape]
    tpl, specs = spec_for_call(OP, "sm_90a", dense_args(tokens, inter))
    assert tpl is not None and tpl.kernel == "dense_mlp", specs
    up, down = specs
    assert (up.kernel, down.kernel) == ("expert_up", "expert_down")
    assert up.shape_dict == {"experts": 1, "top_k": 1, "inter": inter, "tokens": tokens, "latent": H}
    p = down.param_dict
    vec = inter // 8
    assert vec == p["lanes_per_row"] * p["k_warps"] * (vec // p["lanes_per_row"] // p["k_warps"])
    assert vec // p["lanes_per_row"] // p["k_warps"] <= 12 and p["k_warps"] == 3  # 33 vectors: 3 warps of 11
    assert p["chunk"] == min(tokens, 8) and up.param_dict["beta"] == BETA


@pytest.mark.parametrize("args,reason", [
    (dense_args(tokens=9), "9 tokens: above 8 the GEMV kernels re-read x per channel"),
    (dense_args(inter=2100), "I 2100: its 262 vectors do not split"),
    (dense_args(hidden=1000), "H 1000 is not a multiple of 256"),
    ((meta(1, H, dtype=torch.float32), meta(4224, H), meta(H, 2112), BETA, LINEAR_BETA, "tp", 1), "x is fp32"),
])
def test_refusals_say_why(args, reason):
    tpl, why = spec_for_call(OP, "sm_90a", args)
    assert tpl is None and reason in why, why


@needs_cutedsl
@pytest.mark.parametrize("tokens", [1, 8])
def test_compiles_without_spills(tokens, tmp_path):
    from codegen.cache import KernelCache
    from codegen.compiler import compile_kernel

    _, specs = spec_for_call(OP, "sm_90a", dense_args(tokens, INTER["tp16"]))
    for spec in specs:
        k = compile_kernel(spec, cache=KernelCache(tmp_path))
        registers, spilled = ptxas_usage(k.ptx, "sm_90a")
        assert spilled == 0 and registers <= 255, (spec.label(), registers, spilled)


# ---------------------------------------------------------------- on the GPU (marked gpu)

def dense_inputs(tokens, inter, gen):
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    gate_up = (torch.randn(2 * inter, H, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(H, inter, generator=gen) * 0.02).bfloat16()
    return x, gate_up, down, BETA, LINEAR_BETA, "tp", 1


def cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@on_gpu
@pytest.mark.parametrize("shape", list(INTER))
@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_dense_mlp(shape, tokens):
    inter = INTER[shape]
    cpu = dense_inputs(tokens, inter, torch.Generator().manual_seed(7 * tokens + inter))
    ref = torch.ops.k3f.dense_mlp(*cpu)
    gpu = cuda(cpu)
    tpl, specs, fns = gpu_kernels(OP, gpu)
    y = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    act = torch.full((tokens, 1, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = tpl.launch(fns, specs, gpu, out=(y, act))
    torch.cuda.synchronize()
    assert out is y and torch.isfinite(y).all()
    assert rel_err(y, ref) <= TOL


@on_gpu
def test_op_dispatches_to_the_kernels_in_a_cuda_graph():
    bind.install_cuda_kernels()
    cpu = dense_inputs(4, INTER["tp16"], torch.Generator().manual_seed(3))
    ref = torch.ops.k3f.dense_mlp(*cpu)
    gpu = cuda(cpu)
    before = bind.stats().get(OP, {}).get("kernel", 0)
    torch.ops.k3f.dense_mlp(*gpu)  # compiles and loads outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.k3f.dense_mlp(*gpu)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= TOL
    assert bind.stats()[OP]["kernel"] == before + 2
