"""Layer 0's dense MLP (``k3f::dense_mlp``) on the kernels generated from its reference: the
GEMV main loop at one token (gate/up with SiTU in its epilogue, then down), the tensor-core
GEMM's from two; a stage whose K the GEMV cannot hold in registers (the down stage's whole
intermediate at TP 1) takes the GEMM at one token too.

1. specs at Kimi K3's shapes, every TP the rule serves (no CuTe DSL);
2. compiles for sm_90a with no register spills (ptxas; skipped without CuTe DSL);
3. on a GPU (marked ``gpu``): SiLU-and-mul as well as SiTU, outputs poisoned with NaN, against
   the op's CPU reference, two launches bit-identical; dispatched through
   ``install_cuda_kernels`` inside a CUDA graph. (Every served shape against the reference:
   ``test_products_gpu.py``.)
"""
from __future__ import annotations

import pytest
import torch

import patterns.dense_mlp  # noqa: F401  (defines the k3f ops used here)
import rewriter.model.ops  # noqa: F401
from codegen import bind
from codegen.launchers.gemv_specs import GEMV_MAX_SLICE
from codegen.templates import spec_for_call
from conftest import gpu_kernels, needs_cutedsl, on_gpu, ptxas_usage, rel_err
from rewriter.model.config import KimiK3Config

K3 = KimiK3Config.preset("kimi-k3")
H = K3.hidden_size
BETA, LINEAR_BETA = K3.activation_situ_beta, K3.activation_situ_linear_beta
OP = "k3f::dense_mlp"
TOL = 1e-2


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def dense_args(tokens=1, inter=2112, hidden=H, make=meta, tp=1):
    return make(tokens, hidden), make(2 * inter, hidden), make(hidden, inter), BETA, LINEAR_BETA, "tp", tp


@pytest.mark.parametrize("tp", [16, 8, 4, 2, 1])
@pytest.mark.parametrize("tokens", [1, 2, 9, 64])
def test_generated_specs_at_kimi_k3_shapes(tp, tokens):
    """Two kernels, the all-reduce the host's; GEMV stages at one token where a lane holds the
    stage's K, the GEMM's otherwise."""
    inter = K3.shard(tp).dense_intermediate
    tpl, specs = spec_for_call(OP, "sm_90a", dense_args(tokens, inter, tp=tp))
    assert tpl is not None and tpl.kernel == "products", specs
    up, down = specs
    assert (up.shape_dict["k"], up.shape_dict["n"], down.shape_dict["k"], down.shape_dict["n"]) == (H, inter, inter, H)
    assert up.param_dict["collectives"] == ((0, "all_reduce", "tp", tp),)  # the launcher runs it where tp > 1
    long_down = inter // 256 > 8 * GEMV_MAX_SLICE  # TP 1's 33792: more than 8 K slices of a GEMV row hold
    assert up.module == ("product_gemv" if tokens == 1 else "product_gemm")
    assert down.module == ("product_gemv" if tokens == 1 and not long_down else "product_gemm")


@pytest.mark.parametrize("tp,batch", [(16, 1), (8, 64), (4, 1)])
def test_one_rule_serves_every_batch_and_plans_what_a_step_launches(tp, batch):
    from rewriter.compiler.plan import plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    result = rewrite(trace(build_layer(K3, 0, tp=tp, rank=0), DecodeShape(batch=batch, tp=tp)))
    assert [m.rule for m in result.matches if m.rule.startswith("dense_mlp")] == ["dense_mlp"]
    row = next(r for r in plan(result, "sm_90a") if r["op"] == OP)
    assert row["status"] == "pending" and row["implementation"] == "generated", row
    inter = K3.shard(tp).dense_intermediate
    tpl, specs = spec_for_call(OP, "sm_90a", dense_args(batch, inter, tp=tp))
    assert tuple(row["specs"]) == tuple(specs)


@needs_cutedsl
@pytest.mark.parametrize("tokens,tp", [(1, 16), (8, 16), (64, 8)])
def test_compiles_without_spills(tokens, tp, kcache):
    from codegen.compiler import compile_kernel

    _, specs = spec_for_call(OP, "sm_90a", dense_args(tokens, K3.shard(tp).dense_intermediate, tp=tp))
    for spec in specs:
        registers, spilled = ptxas_usage(compile_kernel(spec, cache=kcache).ptx, "sm_90a")
        assert spilled == 0 and registers <= 255, (spec.label(), registers, spilled)


# ---------------------------------------------------------------- on the GPU (marked gpu)

def dense_inputs(tokens, inter, gen, act=(BETA, LINEAR_BETA)):
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    gate_up = (torch.randn(2 * inter, H, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(H, inter, generator=gen) * 0.02).bfloat16()
    return x, gate_up, down, *act, "tp", 1


def cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@on_gpu
@pytest.mark.parametrize("tokens", [1, 16, 40])
def test_silu_and_mul_matches_and_reruns_bit_identical(tokens):
    """The epilogue's other activation (no SiTU beta: SiLU-and-mul), outputs poisoned, and a
    second launch bit-identical to the first (the cluster sums in rank order)."""
    cpu = dense_inputs(tokens, K3.shard(16).dense_intermediate, torch.Generator().manual_seed(tokens),
                       act=(None, None))
    ref = torch.ops.k3f.dense_mlp(*cpu)
    gpu = cuda(cpu)
    tpl, specs, fns = gpu_kernels(OP, gpu)
    assert tpl.kernel == "products"
    ys = []
    for _ in range(2):
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN bytes for the outputs to reuse
        ys.append(tpl.launch(fns, specs, gpu))
    torch.cuda.synchronize()
    assert not torch.isnan(ys[0]).any() and rel_err(ys[0], ref) <= TOL and torch.equal(ys[0], ys[1])


@on_gpu
@pytest.mark.parametrize("tokens", [1, 24])
def test_op_dispatches_to_the_kernels_in_a_cuda_graph(tokens):
    bind.install_cuda_kernels()
    cpu = dense_inputs(tokens, K3.shard(16).dense_intermediate, torch.Generator().manual_seed(3))
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
