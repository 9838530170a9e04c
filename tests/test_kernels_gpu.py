"""The CuTe DSL kernels on a GPU against the ``k3f::`` CPU references (marked ``gpu``).

Each test draws fresh random inputs, fills every output with NaN first (so a value the
kernel forgets to write fails), runs the compiled kernel, and compares with the fused op's
CPU reference by relative error (bf16: at most 1e-2; the router's fp32 weights: 1e-5, its
expert ids exactly). Skipped without CUDA or CuTe DSL.
Run on the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

import patterns.attn_res
import patterns.dense_mlp
import patterns.input_projection
import patterns.kda
import patterns.mla
import patterns.router  # noqa: F401  (defines the k3f ops used here)
from codegen import bind
from conftest import GPU_MARKS, gpu_kernels, rel_err

pytestmark = GPU_MARKS

D = 7168
TOL = 1e-2
SPLITS = {  # Kimi K3 packed input projections: (op, weight rows, split sizes incl. padding)
    "kda_tp16": ("k3f::kda_in_proj", [2304, 768, 128, 6, 10]),
    "kda_tp8": ("k3f::kda_in_proj", [4608, 1536, 128, 12, 4]),
    "mla_tp16": ("k3f::mla_in_proj", [1536, 512, 64, 768]),
    "mla_tp8": ("k3f::mla_in_proj", [1536, 512, 64, 1536]),
}


def attn_res_inputs(tokens, num_blocks, write_idx, has_delta, gen):
    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(torch.bfloat16)

    return (rnd(tokens, D), rnd(tokens, D) if has_delta else None, rnd(tokens, 8, D),
            rnd(D, scale=0.1, shift=1.0), rnd(D, scale=0.02), rnd(D, scale=0.1, shift=1.0),
            num_blocks, write_idx, 1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 12, 64, 100])  # 8, 8, 4, 2 and 1 CTAs a token
@pytest.mark.parametrize("num_blocks,write_idx,has_delta", [
    (0, 0, False),  # layer 0: the embedding is the prefix, written as block 0
    (1, -1, True),  # inside a block
    (4, 4, True),  # block-starting layer: the new prefix is written as block 4
    (8, -1, True),  # 9 sources
    (3, 1, True),  # a block write inside the sources (not a Kimi K3 layout; the kernel takes it)
])
def test_attn_res_norm(tokens, num_blocks, write_idx, has_delta):
    check_attn_res_norm(tokens, num_blocks, write_idx, has_delta)


@pytest.mark.parametrize("cluster,vectors", [(c, v) for c in (8, 4, 2, 1) for v in (1, 2)])
@pytest.mark.parametrize("num_blocks,write_idx", [(8, -1), (4, 4)])
def test_attn_res_norm_every_split(monkeypatch, cluster, vectors, num_blocks, write_idx):
    """Each split of a row the rules may serve (CTAs a token, vectors a thread), forced."""
    from codegen.launchers import attn_res_norm

    monkeypatch.setattr(attn_res_norm, "CLUSTER_BY_TOKENS", ((64, cluster, vectors),))
    spec = check_attn_res_norm(3, num_blocks, write_idx, True)
    assert (spec.param_dict["cluster"], spec.param_dict["vectors"]) == (cluster, vectors)


def check_attn_res_norm(tokens, num_blocks, write_idx, has_delta):
    """The kernel against the reference on fresh inputs, outputs and the written block poisoned; its spec."""
    gen = torch.Generator().manual_seed(1000 * tokens + 10 * num_blocks + write_idx)
    cpu = attn_res_inputs(tokens, num_blocks, write_idx, has_delta, gen)
    ref_blocks = cpu[2].clone()
    ref_x, ref_prefix = torch.ops.k3f.attn_res_norm(cpu[0], cpu[1], ref_blocks, *cpu[3:])
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu]
    if write_idx >= 0:
        gpu[2][:, write_idx] = float("nan")  # the block the kernel must write
    tpl, specs, fns = gpu_kernels("k3f::attn_res_norm", gpu)
    out = (torch.full((tokens, D), float("nan"), dtype=torch.bfloat16, device="cuda"),
           torch.full((tokens, D), float("nan"), dtype=torch.bfloat16, device="cuda"))
    x, new_prefix = tpl.launch(fns, specs, gpu, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(x).all() and torch.isfinite(gpu[2]).all()
    assert rel_err(x, ref_x) <= TOL
    assert torch.equal(new_prefix.cpu(), ref_prefix)  # bf16(prefix + delta): exact
    assert torch.equal(gpu[2].cpu(), ref_blocks)  # the block write, and nothing else touched
    return specs[0]


@pytest.mark.parametrize("shape", list(SPLITS))
def test_the_input_projections_generated_gemv_at_one_token(shape):
    """One kernel whose parts are the split's pieces; KDA's padding rows NaN, never read."""
    op, split = SPLITS[shape]
    rows = sum(split)
    gen = torch.Generator().manual_seed(31 + rows)
    x = torch.randn(1, D, generator=gen).to(torch.bfloat16)
    w = (torch.randn(rows, D, generator=gen) * 0.02).to(torch.bfloat16)
    used = sum(split[:4])
    refs = getattr(torch.ops.k3f, op.split("::")[1])(x, w, split)
    w_gpu = w.cuda()
    w_gpu[used:] = float("nan")  # the padding rows must not be read
    tpl, specs, fns = gpu_kernels(op, (x.cuda(), w_gpu, split))
    assert tpl.kernel == "products" and [s.module for s in specs] == ["product_gemv"]
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN bytes for the outputs to reuse
    ys = tpl.launch(fns, specs, (x.cuda(), w_gpu, split))
    torch.cuda.synchronize()
    assert len(ys) == len(refs) == 4
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape and torch.isfinite(y).all()
        assert rel_err(y, ref) <= TOL


ROUTER_TOL = 1e-5  # fp32 weights
ROUTER_SHAPES = {  # (experts, top_k, renormalize, scaling)
    "k3": (896, 16, True, 1.0),  # Kimi K3
    "tiny": (16, 4, True, 1.0),  # the tiny test config
    "scaled": (64, 6, False, 2.5),  # no renormalization, a scaling factor (not a Kimi K3 setting)
}


def router_inputs(tokens, experts, top_k, gen, min_gap=1e-5):
    """fp32 logits and bias whose top_k + 1 largest ``sigmoid(logits) + bias`` per row are at
    least ``min_gap`` apart (rows redrawn until so): no ties, and no order that a few ulp of
    sigmoid error could flip (torch documents no order among ties; the kernel takes the lower
    index first)."""
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.1
    while True:
        top = (torch.sigmoid(logits.double()) + bias.double()).topk(min(top_k + 1, experts), dim=-1).values
        close = (top[:, :-1] - top[:, 1:]).min(-1).values < min_gap
        if not close.any():
            return logits, bias
        logits[close] = torch.randn(int(close.sum()), experts, generator=gen) * 2


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("shape", list(ROUTER_SHAPES))
def test_router_topk(tokens, shape):
    experts, top_k, renormalize, scaling = ROUTER_SHAPES[shape]
    gen = torch.Generator().manual_seed(100 * tokens + experts)
    logits, bias = router_inputs(tokens, experts, top_k, gen)
    ref_w, ref_ids = torch.ops.k3f.router_topk(logits, bias, top_k, renormalize, scaling)
    assert ref_w.dtype == torch.float32 and ref_ids.dtype == torch.int64
    args = (logits.cuda(), bias.cuda(), top_k, renormalize, scaling)
    tpl, specs, fns = gpu_kernels("k3f::router_topk", args)
    out = (torch.full((tokens, top_k), float("nan"), device="cuda"),
           torch.full((tokens, top_k), -1, dtype=torch.int64, device="cuda"))
    w, ids = tpl.launch(fns, specs, args, out=out)
    torch.cuda.synchronize()
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    assert torch.equal(ids.cpu(), ref_ids)  # the same experts, ordered by descending score + bias
    assert torch.isfinite(w).all() and rel_err(w, ref_w) <= ROUTER_TOL
    assert float(((w.cpu() - ref_w).abs() / ref_w.abs()).max()) <= ROUTER_TOL  # every weight, not just the norm


def test_ops_dispatch_to_the_kernels_and_capture_in_a_cuda_graph():
    bind.install_cuda_kernels()
    gen = torch.Generator().manual_seed(7)
    cpu = attn_res_inputs(3, 4, 4, True, gen)
    ref_blocks = cpu[2].clone()
    ref_x, _ = torch.ops.k3f.attn_res_norm(cpu[0], cpu[1], ref_blocks, *cpu[3:])
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu]
    before = bind.stats().get("k3f::attn_res_norm", {}).get("kernel", 0)
    x, _ = torch.ops.k3f.attn_res_norm(*gpu)
    assert bind.stats()["k3f::attn_res_norm"]["kernel"] == before + 1
    assert rel_err(x, ref_x) <= TOL and torch.equal(gpu[2].cpu(), ref_blocks)

    xs, w, split = in_proj_case()
    torch.ops.k3f.kda_in_proj(xs, w, split)  # compiles and loads outside the capture
    captured_in_proj_matches(xs, w, split)
    assert bind.stats()["k3f::kda_in_proj"]["kernel"] >= 2

    logits, bias = router_inputs(5, 896, 16, gen)
    ref_w, ref_ids = torch.ops.k3f.router_topk(logits, bias, 16, True, 1.0)
    before = bind.stats().get("k3f::router_topk", {}).get("kernel", 0)
    w, ids = torch.ops.k3f.router_topk(logits.cuda(), bias.cuda(), 16, True, 1.0)
    assert bind.stats()["k3f::router_topk"]["kernel"] == before + 1
    assert torch.equal(ids.cpu(), ref_ids) and rel_err(w, ref_w) <= ROUTER_TOL


def test_a_kernels_first_call_may_be_inside_a_cuda_graph_capture():
    """The server runs its programs only inside vLLM's CUDA graph captures, so a kernel's first
    call, where CuTe DSL's TVM-FFI function loads its CUDA library, is captured: in a
    global-mode capture (torch's default, and vLLM's) that load is an unsafe call, which the
    launcher makes in relaxed capture mode. A freshly loaded kernel, compiled but never called,
    first called inside a capture; the replay against the reference, and a second capture of
    the same kernel."""
    from codegen import compiler
    from codegen.bind import device_arch
    from codegen.templates import spec_for_call

    bind.install_cuda_kernels()
    xs, w, split = in_proj_case()
    _, specs = spec_for_call("k3f::kda_in_proj", device_arch(), (xs, w, split))
    for spec in specs:
        compiler.compile_kernel(spec)  # compiled (no CUDA call) but not loaded
    bind.forget_loaded()
    compiler._LOADED.clear()  # a fresh load: its library not yet on the device
    for _ in range(2):
        captured_in_proj_matches(xs, w, split)


def in_proj_case() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Fresh random inputs of the TP 16 KDA input projection at 2 tokens, on the GPU."""
    xs, w = torch.randn(2, D, device="cuda").bfloat16(), (torch.randn(3216, D, device="cuda") * 0.02).bfloat16()
    return xs, w, [2304, 768, 128, 6, 10]


def captured_in_proj_matches(xs: torch.Tensor, w: torch.Tensor, split: list[int]) -> None:
    """``k3f::kda_in_proj`` captured in a CUDA graph, its outputs poisoned, replayed: the reference."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = torch.ops.k3f.kda_in_proj(xs, w, split)
    for y in ys:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.nn.functional.linear(xs.float(), w.float())[:, :sum(split[:-1])]
    assert rel_err(torch.cat(ys, dim=1), ref) <= TOL
