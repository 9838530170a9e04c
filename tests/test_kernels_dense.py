"""Layer 0's dense MLP (``k3f::dense_mlp``): the ``dense_mlp`` template (1..8 tokens: the shared
experts' two GEMV kernels at the dense sizes, the down projection's I split over warps) and
the ``dense_mlp_gemm`` template (2..64 tokens: the skinny tensor-core GEMM, gate/up with the
activation in its epilogue, then down).

1. specs at Kimi K3's TP 16 and TP 8 shapes and refusals (no CuTe DSL);
2. compiles for sm_90a with no register spills (ptxas; skipped without CuTe DSL);
3. on a GPU (marked ``gpu``): fresh random inputs, outputs and the activation scratch poisoned
   with NaN, against the op's CPU reference (bf16 relative error <= 1e-2) at 1..64 tokens,
   SiTU and SiLU, and dispatched through ``install_cuda_kernels`` inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

import patterns.dense_mlp  # noqa: F401  (defines the k3f ops used here)
import rewriter.model.ops  # noqa: F401
from codegen import bind
from codegen.templates import spec_for_call, template
from conftest import gpu_kernels, hand_written_refusal, needs_cutedsl, on_gpu, ptxas_usage, rel_err
from rewriter.model.config import KimiK3Config

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
    specs = template("dense_mlp").make_specs(OP, "sm_90a", dense_args(tokens, inter))
    up, down = specs
    assert (up.kernel, down.kernel) == ("expert_up", "expert_down")
    assert up.shape_dict == {"experts": 1, "top_k": 1, "inter": inter, "tokens": tokens, "latent": H}
    p = down.param_dict
    vec = inter // 8
    assert vec == p["lanes_per_row"] * p["k_warps"] * (vec // p["lanes_per_row"] // p["k_warps"])
    assert vec // p["lanes_per_row"] // p["k_warps"] <= 12 and p["k_warps"] == 3  # 33 vectors: 3 warps of 11
    assert p["chunk"] == min(tokens, 8) and up.param_dict["beta"] == BETA


@pytest.mark.parametrize("shape", list(INTER))
@pytest.mark.parametrize("tokens", [2, 9, 16, 17, 64])
def test_gemm_specs_at_kimi_k3_shapes(shape, tokens):
    inter = INTER[shape]
    tpl, specs = spec_for_call(OP, "sm_90a", dense_args(tokens, inter))
    assert tpl is not None and tpl.kernel == "dense_mlp_gemm", specs
    up, down = specs
    assert (up.kernel, down.kernel) == ("mlp_gate_up_gemm", "mlp_down_gemm")
    tile = -(-tokens // 16) * 16
    assert up.shape_dict == {"token_tile": tile, "k": H, "rows": 2 * inter}
    assert down.shape_dict == {"token_tile": tile, "k": inter, "rows": H}
    p, q = up.param_dict, down.param_dict
    assert p["glu"] and p["rows_out"] == inter and (p["beta"], p["linear_beta"]) == (BETA, LINEAR_BETA)
    assert q["rows_out"] == H and "glu" not in q
    # every SM streams weights: 33 / 66 tiles of 64 channels x a K split; the down GEMM fills the
    # GPU with 64-row CTAs where its K (I = 2112: 33 tiles) allows no split
    assert inter // (p["rows_per_cta"] // 2) * p["split_k"] == 132
    assert -(-H // q["rows_per_cta"]) * q["split_k"] >= 112


def test_the_rules_and_templates_split_the_batches_alike():
    from codegen.launchers.dense_mlp import DENSE_GEMM_TOKENS, DENSE_MAX_TOKENS
    from patterns.dense_mlp import DENSE_SMALL_MAX

    assert DENSE_MAX_TOKENS >= DENSE_SMALL_MAX and DENSE_GEMM_TOKENS == (DENSE_SMALL_MAX + 1, 64)
    for tokens in (1, DENSE_SMALL_MAX, DENSE_SMALL_MAX + 1, 8, 64):
        tpl, _ = spec_for_call(OP, "sm_90a", dense_args(tokens))
        assert tpl.kernel == ("dense_mlp" if tokens <= DENSE_SMALL_MAX else "dense_mlp_gemm")


@pytest.mark.parametrize("tp,rule", [(16, "dense_mlp.small"), (8, "dense_mlp.small"), (4, "dense_mlp.large"),
                                     (2, "dense_mlp.large"), (1, "dense_mlp.large")])
def test_one_token_goes_to_the_gemm_where_a_rank_is_too_long_for_the_gemvs(tp, rule):
    """Kimi K3's dense intermediate (33792) over TP 4 and below leaves a rank more channels than
    the GEMVs' down projection holds (``DENSE_GEMV_MAX_INTER``): the rule and the templates both
    take the one-token step to the GEMM there, the GEMVs from TP 8, so what ``inspect`` plans is
    what a served step launches."""
    from patterns.dense_mlp import DENSE_GEMV_MAX_INTER
    from rewriter.compiler.plan import plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    cfg = KimiK3Config.preset("kimi-k3")
    inter = cfg.shard(tp).dense_intermediate
    assert (inter > DENSE_GEMV_MAX_INTER) == (tp <= 4)
    result = rewrite(trace(build_layer(cfg, 0, tp=tp, rank=0), DecodeShape(batch=1, tp=tp)))
    assert [m.rule for m in result.matches if m.rule.startswith("dense_mlp")] == [rule]
    row = next(r for r in plan(result, "sm_90a") if r["kernel"].startswith("dense_mlp"))
    assert row["status"] == "pending", row
    x = torch.empty(1, H, dtype=torch.bfloat16, device="meta")
    args = (x, torch.empty(2 * inter, H, dtype=torch.bfloat16, device="meta"),
            torch.empty(H, inter, dtype=torch.bfloat16, device="meta"), 4.0, 25.0, "tp", tp)
    tpl, specs = spec_for_call(OP, "sm_90a", args)
    assert tpl.kernel == row["kernel"] and tuple(row["specs"]) == tuple(specs)


@pytest.mark.parametrize("args,reason", [
    (dense_args(tokens=65), "65 tokens outside 2..64 (the GEMM template)"),
    (dense_args(tokens=65), "65 tokens: above 8 the GEMV kernels re-read x per channel"),
    (dense_args(tokens=16, inter=2100), "I 2100 is not a multiple of 64"),
    (dense_args(tokens=16, hidden=1000), "H 1000 is not a multiple of 64"),
    (dense_args(inter=2100), "I 2100: its 262 vectors do not split"),
    (dense_args(hidden=1000), "H 1000 is not a multiple of 256"),
    ((meta(1, H, dtype=torch.float32), meta(4224, H), meta(H, 2112), BETA, LINEAR_BETA, "tp", 1), "x is fp32"),
])
def test_refusals_say_why(args, reason):
    why = hand_written_refusal(OP, args)
    assert reason in why, why


@needs_cutedsl
@pytest.mark.parametrize("tokens,shape", [(1, "tp16"), (8, "tp16"), (16, "tp16"), (64, "tp8")])
def test_compiles_without_spills(tokens, shape, tmp_path):
    from codegen.cache import KernelCache
    from codegen.compiler import compile_kernel

    _, specs = spec_for_call(OP, "sm_90a", dense_args(tokens, INTER[shape]))
    for spec in specs:
        k = compile_kernel(spec, cache=KernelCache(tmp_path))
        registers, spilled = ptxas_usage(k.ptx, "sm_90a")
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
@pytest.mark.parametrize("shape", list(INTER))
@pytest.mark.parametrize("tokens,kernel", [(1, "dense_mlp"), (5, "dense_mlp"), (8, "dense_mlp"),
                                           (2, "dense_mlp_gemm"), (9, "dense_mlp_gemm"), (33, "dense_mlp_gemm"),
                                           (64, "dense_mlp_gemm")])
def test_dense_mlp(shape, tokens, kernel):
    """Both templates over their ranges (the GEMVs' 2..8 by name: the rules give them 1 token)."""
    inter = INTER[shape]
    cpu = dense_inputs(tokens, inter, torch.Generator().manual_seed(7 * tokens + inter))
    ref = torch.ops.k3f.dense_mlp(*cpu)
    gpu = cuda(cpu)
    tpl, specs, fns = gpu_kernels(OP, gpu, kernel)
    y = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    scratch = (tokens, 1, inter) if kernel == "dense_mlp" else (tokens, inter)
    act = torch.full(scratch, float("nan"), dtype=torch.bfloat16, device="cuda")
    out = tpl.launch(fns, specs, gpu, out=(y, act))
    torch.cuda.synchronize()
    assert out is y and torch.isfinite(y).all()
    assert rel_err(y, ref) <= TOL


@on_gpu
@pytest.mark.parametrize("tokens", [16, 40])
def test_gemm_with_silu_and_mul(tokens):
    """The GEMM epilogue's other activation (no SiTU beta: SiLU-and-mul) and a second launch
    bit-identical to the first (the cluster sums in rank order)."""
    cpu = dense_inputs(tokens, INTER["tp16"], torch.Generator().manual_seed(tokens), act=(None, None))
    ref = torch.ops.k3f.dense_mlp(*cpu)
    gpu = cuda(cpu)
    tpl, specs, fns = gpu_kernels(OP, gpu)
    assert tpl.kernel == "dense_mlp_gemm" and specs[0].param_dict["beta"] is None
    ys = []
    for _ in range(2):
        y = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        ys.append(tpl.launch(fns, specs, gpu, out=y))
    torch.cuda.synchronize()
    assert rel_err(ys[0], ref) <= TOL and torch.equal(ys[0], ys[1])


@on_gpu
@pytest.mark.parametrize("tokens", [4, 24])
def test_op_dispatches_to_the_kernels_in_a_cuda_graph(tokens):
    bind.install_cuda_kernels()
    cpu = dense_inputs(tokens, INTER["tp16"], torch.Generator().manual_seed(3))
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
