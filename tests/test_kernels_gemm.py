"""The skinny tensor-core GEMM (``codegen/kernels/gemm.py``; its tiling in ``gemm_specs``): the
main loop of the hand-written output projection, MLP and latent-tail GEMMs and of the generated
``product_gemm``. Its tiling at Kimi K3's shapes and every TP (no CuTe DSL), the configurations
its kernel refuses (CuTe DSL), and on a GPU (marked ``gpu``) the input projection's generated
GEMM at Kimi K3's four split shapes against the ``k3f::`` references, alone and dispatched
inside a CUDA graph. On the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_gemm.py``.
"""
from __future__ import annotations

import pytest
import torch

import patterns.attn_res
import patterns.input_projection
import patterns.kda
import patterns.mla  # noqa: F401  (defines the k3f ops used here)
from codegen import bind
from codegen.launchers.gemm_specs import gemm_tiling
from conftest import gpu_kernels, needs_cutedsl, on_gpu, rel_err

D = 7168
TOL = 1e-2
ARCHS = ("sm_90a", "sm_100a")
SPLITS = {  # Kimi K3 packed input projections: (op, split sizes incl. padding)
    "kda_tp16": ("k3f::kda_in_proj", [2304, 768, 128, 6, 10]),
    "kda_tp8": ("k3f::kda_in_proj", [4608, 1536, 128, 12, 4]),
    "mla_tp16": ("k3f::mla_in_proj", [1536, 512, 64, 768]),
    "mla_tp8": ("k3f::mla_in_proj", [1536, 512, 64, 1536]),
}
GPU_TOKENS = (9, 16, 32, 33, 64)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def args_of(shape="kda_tp16", tokens=16, k=D):
    op, split = SPLITS[shape]
    return op, (meta(tokens, k), meta(sum(split), k), list(split))


# ---------------------------------------------------------------- the tiling (no CuTe DSL needed)

def test_tiling_follows_the_sm_count():
    # 148 SMs (B200): 29 tiles x 8 = 232 CTAs fit 1.6 per SM
    assert gemm_tiling(64, D, 3648, "sm_90a")["split_k"] == 4
    assert gemm_tiling(64, D, 3648, "sm_100a")["split_k"] == 8
    assert gemm_tiling(64, D, 128, "sm_90a")["split_k"] == 8  # one tile: the largest cluster
    assert gemm_tiling(16, 1024, 40 * 128, "sm_90a") == {"rows_per_cta": 128, "split_k": 4, "stages": 4,
                                                          "token_groups": 1, "token_tile": 16}  # 4 K tiles a CTA


@pytest.mark.parametrize("tokens", [8, 64])
@pytest.mark.parametrize("weights", [(56, 224), (112, 448)])  # the router at TP 16 and 8
def test_small_grids_hold_their_whole_k_in_the_ring(tokens, weights):
    """The router's 40 to 72 CTAs (its generated GEMM: a part for each weight, at most
    WHOLE_K_MAX_SHARE of the SMs, one CTA an SM) take every K tile of their share in flight at
    once, within one CTA's shared memory; larger grids keep a ring that fits two CTAs an SM."""
    from codegen.launchers.gemm_specs import GEMM_SMEM_ONE_CTA, WHOLE_K_MAX_SHARE

    t = gemm_tiling(tokens, D, sum(weights), "sm_90a")
    tiles = sum(-(-n // t["rows_per_cta"]) for n in weights)
    assert tiles * t["split_k"] <= WHOLE_K_MAX_SHARE * 132
    assert t["stages"] == D // 64 // t["split_k"] == 14
    assert t["stages"] * (t["rows_per_cta"] + t["token_tile"]) * 64 * 2 <= GEMM_SMEM_ONE_CTA
    big = gemm_tiling(tokens, D, 3206, "sm_90a")  # the input projection: 208 CTAs
    assert big["stages"] <= 6


@pytest.mark.parametrize("tokens", [2, 8, 16])
@pytest.mark.parametrize("k,rows_per_cta,split", [(2112, 64, 1), (4224, 128, 2)])  # the dense down stage, TP 16 / 8
def test_one_wave_grids_take_a_ring_for_one_cta_an_sm(tokens, k, rows_per_cta, split):
    """The dense down stage's 112 CTAs (at most ONE_WAVE_MAX_SHARE of the SMs, clusters of at most
    2) get an SM each, so their ring is ONE_WAVE_STAGES deep within one CTA's shared memory; a
    grid of the same size in clusters of 4 keeps the two-CTA ring."""
    from codegen.launchers.gemm_specs import GEMM_SMEM_ONE_CTA, ONE_WAVE_MAX_SHARE, ONE_WAVE_STAGES

    t = gemm_tiling(tokens, k, D, "sm_90a")
    assert (t["rows_per_cta"], t["split_k"]) == (rows_per_cta, split)
    assert 0.55 * 132 < D // rows_per_cta * split <= ONE_WAVE_MAX_SHARE * 132
    assert t["stages"] == ONE_WAVE_STAGES
    assert t["stages"] * (rows_per_cta + t["token_tile"]) * 64 * 2 <= GEMM_SMEM_ONE_CTA
    clustered = gemm_tiling(tokens, D, 28 * 128, "sm_90a")  # 28 tiles x 4 = 112 CTAs
    assert clustered["split_k"] == 4 and clustered["stages"] <= 6


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_every_ring_fits_one_cta_beside_its_norm_prologue(tp, tokens):
    """The dense MLP's two stages and a normed projection over the hidden size, at every TP: the
    ring, with the norm prologue its weight slice and sums, within the 227 KB one CTA may take.
    The dense down stage at TP 3 (K 11264, a ring of 12) asked for 64 bytes more and failed at
    its launch on an H100."""
    from codegen.launchers.gemm_specs import GEMM_SMEM_ONE_CTA, norm_bytes, stage_bytes

    inter = 33792 // tp  # Kimi K3's dense intermediate size a rank
    for k, rows, norm in ((inter, D, False), (inter, D, True), (D, 2 * inter, True), (D, 3206, True)):
        t = gemm_tiling(tokens, k, rows, "sm_90a", norm=norm)
        ring = t["stages"] * stage_bytes(t["rows_per_cta"], t["token_tile"])
        assert ring + (norm_bytes(k, t["split_k"], t["token_tile"]) if norm else 0) <= GEMM_SMEM_ONE_CTA, (k, rows, t)


@needs_cutedsl
def test_a_ring_past_one_ctas_shared_memory_is_refused_at_build():
    from codegen.kernels.gemm import SkinnyGemm

    SkinnyGemm(16, 11264, D, D, rows_per_cta=128, split_k=2, stages=12)  # 216 KB: fits
    with pytest.raises(ValueError, match="12 stages of 18432 bytes and the norm prologue: 232512 bytes"):
        SkinnyGemm(16, 11264, D, D, rows_per_cta=128, split_k=2, stages=12, norm_eps=1e-5)


@pytest.mark.parametrize("tokens,groups", [(2, 1), (16, 1), (17, 2), (32, 2), (33, 1), (48, 1), (49, 2), (64, 2)])
def test_two_token_groups_from_a_32_token_tile(tokens, groups):
    # the output projection at TP 16 (K 768, 112 CTAs): two groups where the tile splits in 16s
    assert gemm_tiling(tokens, 768, D, "sm_90a")["token_groups"] == groups
    # the input projection (208 CTAs): 8 warps would hold one CTA an SM, so one group
    assert gemm_tiling(tokens, D, 3216, "sm_90a")["token_groups"] == 1


# ---------------------------------------------------------------- compile-only (CuTe DSL)

@needs_cutedsl
def test_kernel_refuses_configurations_it_cannot_run():
    from codegen.kernels.gemm import SkinnyGemm

    rows = 3206  # the input projection's packed rows at TP 16
    SkinnyGemm(64, D, 3216, rows, split_k=8, stages=4)
    with pytest.raises(ValueError, match="token tile 24"):
        SkinnyGemm(24, D, 3216, rows)
    with pytest.raises(ValueError, match="split_k 3"):
        SkinnyGemm(16, D, 3216, rows, split_k=3)
    with pytest.raises(ValueError, match="stages 15"):
        SkinnyGemm(16, D, 3216, rows, split_k=8, stages=15)  # 14 K tiles per CTA
    with pytest.raises(ValueError, match="rows per CTA 96"):
        SkinnyGemm(16, D, 3216, rows, rows_per_cta=96)
    with pytest.raises(ValueError, match="3206 output rows: 1..3200"):
        SkinnyGemm(16, D, 3200, rows)
    with pytest.raises(ValueError, match="rows / 2 channels, got 3206 of 3216"):
        SkinnyGemm(16, D, 3216, rows, glu=(None, None))


# ---------------------------------------------------------------- on the GPU


def random_problem(shape, tokens, seed):
    op, split = SPLITS[shape]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen).to(torch.bfloat16)
    w = (torch.randn(sum(split), D, generator=gen) * 0.02).to(torch.bfloat16)
    return op, split, x, w


@on_gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("shape", list(SPLITS))
def test_in_proj_gemm_matches_the_reference(tokens, shape):
    """Its padding rows (KDA's) are NaN and never read; outputs poisoned through the allocator;
    one CTA sums each output's partials in cluster rank order, so a second run gives the same bits."""
    op, split, x, w = random_problem(shape, tokens, seed=tokens * 131 + sum(SPLITS[shape][1]))
    refs = getattr(torch.ops.k3f, op.split("::")[1])(x, w, split)
    x_gpu, w_gpu = x.cuda(), w.cuda()
    w_gpu[sum(split[:4]):] = float("nan")  # the padding rows must not be read
    args = (x_gpu, w_gpu, split)
    tpl, specs, fns = gpu_kernels(op, args)
    assert tpl.kernel == "products" and [s.module for s in specs] == ["product_gemm"]
    assert tpl.runtime_check(args) is None
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN bytes for the outputs to reuse
    ys = tpl.launch(fns, specs, args)
    torch.cuda.synchronize()
    assert len(ys) == len(refs) == 4
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape and torch.isfinite(y).all()
        assert rel_err(y, ref) <= TOL
    again = tpl.launch(fns, specs, args)
    torch.cuda.synchronize()
    assert all(torch.equal(a, y) for a, y in zip(again, ys))


@on_gpu
@pytest.mark.parametrize("shape,tokens", [("kda_tp16", 24), ("mla_tp16", 40)])
def test_the_input_projection_dispatches_to_its_generated_gemm_inside_a_cuda_graph(shape, tokens):
    bind.install_cuda_kernels()
    op, split, x, w = random_problem(shape, tokens, seed=tokens)
    fn = getattr(torch.ops.k3f, op.split("::")[1])
    ref = torch.cat(fn(x, w, split), dim=1)
    x_gpu, w_gpu = x.cuda(), w.cuda()
    w_gpu[sum(split[:4]):] = float("nan")  # padding rows (KDA): never read
    before = bind.stats().get(op, {}).get("kernel", 0)
    eager = fn(x_gpu, w_gpu, split)  # compiles and loads outside the capture
    assert bind.stats()[op]["kernel"] == before + 1
    assert rel_err(torch.cat(eager, dim=1), ref) <= TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = fn(x_gpu, w_gpu, split)
    for y in ys:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.isfinite(y).all() for y in ys)
    assert rel_err(torch.cat(ys, dim=1), ref) <= TOL
    assert bind.stats()[op]["kernel"] == before + 2


