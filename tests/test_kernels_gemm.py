"""``attn_in_proj_gemm``: the tensor-core input projection for 2..64 tokens.

Three layers, like the other kernels: specs and refusals from meta tensors (everywhere); the
kernel compiled for sm_90a and sm_100a with its PTX checked (needs CuTe DSL); the kernel run
on a GPU against the ``k3f::`` CPU references (marked ``gpu``, skipped without CUDA).
On the GPU machine: ``python -m pytest -q tests/test_kernels_gemm.py`` (or ``-m gpu``).
"""
from __future__ import annotations

import re

import pytest
import torch

import patterns.attn_res
import patterns.dense_mlp
import patterns.input_projection
import patterns.kda
import patterns.mla  # noqa: F401  (defines the k3f ops used here)
from codegen import bind
from codegen.kernels import source_files
from codegen.launchers.gemm_specs import gemm_tiling
from codegen.templates import spec_for_call, template
from conftest import example_module, gpu_kernels, needs_cutedsl, on_gpu, pdl_flags, rel_err

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


def gemm_spec(shape="kda_tp16", tokens=16, arch="sm_90a"):
    op, args = args_of(shape, tokens)
    tpl, specs = spec_for_call(op, arch, args)
    assert tpl is not None and tpl.kernel == "attn_in_proj_gemm", specs
    (spec,) = specs
    return spec


# ---------------------------------------------------------------- specs and refusals (no CuTe DSL needed)

def test_registered_for_both_projections():
    tpl = template("attn_in_proj_gemm")
    assert tpl is not None and tpl.ops == ("k3f::kda_in_proj", "k3f::mla_in_proj")
    (spec,) = tpl.make_specs(*args_of(tokens=8)[:1], "sm_90a", args_of(tokens=8)[1])
    assert spec.kernel == "attn_in_proj_gemm" and spec.module == "gemm"
    assert all(p.is_file() for p in source_files(spec.module))


@pytest.mark.parametrize("shape,split_k,ctas", [
    ("kda_tp16", 8, 26 * 8),  # 3206 rows: 26 tiles of 128, K split over a cluster of 8
    ("kda_tp8", 4, 50 * 4),  # 6284 rows
    ("mla_tp16", 8, 23 * 8),  # 2880 rows
    ("mla_tp8", 4, 29 * 4),  # 3648 rows: 29 x 8 would pass 1.6 CTAs per SM on 132 SMs
])
def test_specs_at_the_kimi_k3_shapes(shape, split_k, ctas):
    op, split = SPLITS[shape]
    for tokens, tile, stages in ((9, 16, 6), (16, 16, 6), (17, 32, 5), (33, 48, 5), (48, 48, 5), (64, 64, 4)):
        spec = gemm_spec(shape, tokens)
        assert spec.op == op and spec.arch == "sm_90a"
        assert spec.shape_dict == {"token_tile": tile, "k": D, "rows": sum(split)}
        assert spec.dtype_dict == {"act": "bf16", "weight": "bf16"}
        p = spec.param_dict
        assert p["segments"] == tuple(split[:4]) and p["rows_per_cta"] == 128
        assert p["split_k"] == split_k and p["stages"] == stages
        assert -(-sum(split[:4]) // 128) * p["split_k"] == ctas
        # two CTAs per SM: the ring of (weight + x) tiles fits 110 KB
        assert p["stages"] * (128 + tile) * 64 * 2 <= 110 * 1024
    # the token count is a runtime size inside a tile of 16: one compile serves 9..16, 49..64
    assert gemm_spec(shape, 9) == gemm_spec(shape, 16) and gemm_spec(shape, 49) == gemm_spec(shape, 64)
    assert gemm_spec(shape, 16) != gemm_spec(shape, 17)
    assert gemm_spec(shape, 64, "sm_100a").arch == "sm_100a"


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

    SkinnyGemm(16, 11264, D, (D,), rows_per_cta=128, split_k=2, stages=12)  # 216 KB: fits
    with pytest.raises(ValueError, match="12 stages of 18432 bytes and the norm prologue: 232512 bytes"):
        SkinnyGemm(16, 11264, D, (D,), rows_per_cta=128, split_k=2, stages=12, norm_eps=1e-5)


@pytest.mark.parametrize("tokens,groups", [(2, 1), (16, 1), (17, 2), (32, 2), (33, 1), (48, 1), (49, 2), (64, 2)])
def test_two_token_groups_from_a_32_token_tile(tokens, groups):
    # the output projection at TP 16 (K 768, 112 CTAs): two groups where the tile splits in 16s
    assert gemm_tiling(tokens, 768, D, "sm_90a")["token_groups"] == groups
    # the input projection (208 CTAs): 8 warps would hold one CTA an SM, so one group
    assert gemm_tiling(tokens, D, 3216, "sm_90a")["token_groups"] == 1


@pytest.mark.parametrize("tokens,kernel", [(1, "attn_in_proj_gemv"), (2, "attn_in_proj_gemm"),
                                           (8, "attn_in_proj_gemm"), (64, "attn_in_proj_gemm")])
def test_the_gemv_takes_1_token_and_the_gemm_2_to_64(tokens, kernel):
    """As the rules split the batches (patterns.input_projection.SMALL_MAX)."""
    from patterns.input_projection import SMALL_MAX

    assert SMALL_MAX == 1
    for shape in SPLITS:
        op, args = args_of(shape, tokens)
        tpl, specs = spec_for_call(op, "sm_90a", args)
        assert tpl is not None and tpl.kernel == kernel and specs[0].kernel == kernel


@pytest.mark.parametrize("args,reason", [
    (args_of(tokens=65)[1], "65 tokens outside 2..64"),
    (args_of(tokens=1)[1], "1 tokens outside 2..64"),
    ((meta(16, D, dtype=torch.float32), meta(3216, D), SPLITS["kda_tp16"][1]), "x is fp32; the template is bf16"),
    ((meta(16, D), meta(3216, D, dtype=torch.float16), SPLITS["kda_tp16"][1]), "weight is fp16"),
    ((meta(16, D), meta(D, 3216).t(), SPLITS["kda_tp16"][1]), "weight is not contiguous"),
    ((meta(D, 16).t(), meta(3216, D), SPLITS["kda_tp16"][1]), "x is not contiguous"),
    ((meta(16, D), meta(3216, 4096), SPLITS["kda_tp16"][1]), "does not match x"),
    (args_of(tokens=16, k=7000)[1], "K 7000 is not a multiple of 64"),
    ((meta(16, D), meta(3216, D), [2304, 768, 128, 6, 9]), "summing to the 3216 weight rows"),
    ((meta(16, D), meta(3216, D), [2304, 912]), "must be 4 positive pieces"),
    ((meta(16, D), meta(3216, D), [2304, 0, 896, 6, 10]), "must be 4 positive pieces"),
    ((meta(16, D), meta(100, D), [40, 30, 20, 10]), "100 output rows < 128"),
    ((meta(16, D, 1), meta(3216, D), SPLITS["kda_tp16"][1]), "must be 2-D"),
])
def test_refusals_say_why(args, reason):
    tpl = template("attn_in_proj_gemm")
    for op in tpl.ops:
        why = tpl.make_specs(op, "sm_90a", args)
        assert isinstance(why, str) and reason in why, why


def test_runtime_check_wants_16_byte_aligned_x_and_weight():
    tpl = template("attn_in_proj_gemm")
    x, w = torch.zeros(16 * D + 1, dtype=torch.bfloat16), torch.zeros(3216, D, dtype=torch.bfloat16)
    assert tpl.runtime_check((x[:16 * D].view(16, D), w, SPLITS["kda_tp16"][1])) is None
    assert "x is not 16-byte aligned" in tpl.runtime_check((x[1:].view(16, D), w, SPLITS["kda_tp16"][1]))


# ---------------------------------------------------------------- compile-only (CuTe DSL)

COMPILED = [  # (shape, tokens, arch): the largest and smallest token tiles, both K splits
    *[(s, t, a) for a in ARCHS for s, t in (("kda_tp16", 64), ("kda_tp16", 9))],
    ("mla_tp8", 33, "sm_90a"),  # cluster of 4, token tile 48
]


@pytest.fixture(scope="module")
def compiled(kcache):
    from codegen.compiler import clear_memory_cache, compile_kernel

    clear_memory_cache()
    return {case: compile_kernel(gemm_spec(*case), cache=kcache) for case in COMPILED}


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


@needs_cutedsl
@pytest.mark.parametrize("case", COMPILED, ids=["-".join(map(str, c)) for c in COMPILED])
def test_gemm_ptx(compiled, case):
    k = compiled[case]
    ptx, p, s = k.ptx, k.spec.param_dict, k.spec.shape_dict
    tile, split, stages, groups = s["token_tile"], p["split_k"], p["stages"], p["token_groups"]
    threads, group_n = 128 * groups, tile // groups  # two token groups from a 32-token tile, 4 warps each
    assert groups == 1  # the input projection's 208 CTAs: 8 warps would hold one CTA an SM
    k_steps = 64 // 16  # 16-K MMA steps per pipeline stage (one copy of the K loop's body)
    assert f".target {case[2]}" in ptx and k.cache == "miss" and k.obj
    assert f".reqntid {threads}" in ptx or f".maxntid {threads}" in ptx
    # tensor cores: per warp and 16-K step, 2 m16 tiles x (its group's tokens / 8) n8 tiles
    assert _count(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == k_steps * 2 * group_n // 8
    # cp.async ring, 16 bytes per copy bypassing L1: per stage 128 rows x 128 B of weights and
    # tile rows of x over the CTA's threads; the prologue's stages - 1 stages and the loop's one
    w_chunks, x_chunks = 128 * 8 // threads, tile * 8 // threads
    assert _count(ptx, "cp.async.cg.shared.global") == stages * (w_chunks + x_chunks)
    assert _count(ptx, "cp.async.commit_group") == stages and _count(ptx, "cp.async.wait_group") == 3
    # PDL: the prologue's stages - 1 weight tiles are all that comes before griddepcontrol.wait
    # (x is the previous kernel's output); launch_dependents right after it, both once
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait;")
    assert _count(before, "cp.async.cg.shared.global") == (stages - 1) * w_chunks
    assert _count(before, "cp.async.commit_group") == 0 and _count(before, "st.global") == 0
    assert "griddepcontrol.launch_dependents" in after
    # swizzled shared memory -> fragments: 2 ldmatrix.x4 (weights) + group_n / 16 (x) per 16-K step
    assert _count(ptx, "ldmatrix.sync.aligned.m8n8.x4.shared.b16") == (k_steps + 1) * (2 + group_n // 16)
    # split-K over the cluster: partials summed from every CTA's shared memory, 128-bit at a time
    vecs = -(-(128 // split // 4) * tile // threads)  # 4-row vectors each thread sums
    assert _count(ptx, "barrier.cluster.arrive") == 2 and _count(ptx, "barrier.cluster.wait") == 2
    assert _count(ptx, "barrier.cluster.arrive.relaxed") == 1  # the exit's: execution only
    assert len(re.findall(r"ld\.shared::cluster\.v(?:4\.b32|2\.b64)", ptx)) == vecs * split
    assert _count(ptx, "mapa.shared::cluster") == vecs * split
    assert _count(ptx, "st.global.b16") == vecs * 4 * 4  # 4 rows, each tested against 4 segments
    assert "ld.global" not in ptx  # every global read is a cp.async
    assert "ld.local" not in ptx and "st.local" not in ptx


@needs_cutedsl
def test_gemm_launches_with_pdl(compiled):
    assert pdl_flags(compiled["kda_tp16", 9, "sm_90a"].spec) == [1]  # with its cluster of 8


@needs_cutedsl
def test_kernel_refuses_configurations_it_cannot_run():
    from codegen.kernels.gemm import SkinnyGemm

    segs = (2304, 768, 128, 6)
    SkinnyGemm(64, D, 3216, segs, split_k=8, stages=4)
    with pytest.raises(ValueError, match="token tile 24"):
        SkinnyGemm(24, D, 3216, segs)
    with pytest.raises(ValueError, match="split_k 3"):
        SkinnyGemm(16, D, 3216, segs, split_k=3)
    with pytest.raises(ValueError, match="stages 15"):
        SkinnyGemm(16, D, 3216, segs, split_k=8, stages=15)  # 14 K tiles per CTA
    with pytest.raises(ValueError, match="rows per CTA 96"):
        SkinnyGemm(16, D, 3216, segs, rows_per_cta=96)
    with pytest.raises(ValueError, match="summing to at most 3200"):
        SkinnyGemm(16, D, 3200, segs)


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
def test_gemm_matches_the_reference(tokens, shape):
    op, split, x, w = random_problem(shape, tokens, seed=tokens * 131 + sum(SPLITS[shape][1]))
    refs = getattr(torch.ops.k3f, op.split("::")[1])(x, w, split)
    x_gpu, w_gpu = x.cuda(), w.cuda()
    w_gpu[sum(split[:4]):] = float("nan")  # the padding rows must not be read
    args = (x_gpu, w_gpu, split)
    tpl, specs, fns = gpu_kernels(op, args)
    assert tpl.kernel == "attn_in_proj_gemm"
    assert tpl.runtime_check(args) is None
    out = [torch.full((tokens, s), float("nan"), dtype=torch.bfloat16, device="cuda") for s in split[:4]]
    ys = tpl.launch(fns, specs, args, out=out)
    torch.cuda.synchronize()
    assert len(ys) == len(refs) == 4
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape and torch.isfinite(y).all()
        assert rel_err(y, ref) <= TOL
    # one CTA sums each output's partials, in cluster rank order: a second run gives the same bits
    again = [torch.full_like(y, float("nan")) for y in ys]
    tpl.launch(fns, specs, args, out=again)
    torch.cuda.synchronize()
    assert all(torch.equal(a, y) for a, y in zip(again, ys))


@on_gpu
@pytest.mark.parametrize("shape,tokens", [("kda_tp16", 24), ("mla_tp16", 40)])
def test_ops_dispatch_to_the_gemm_and_capture_in_a_cuda_graph(shape, tokens):
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


def test_the_dense_tiling_sweep_forces_one_stage_and_restores_the_rule():
    """``examples/bench_kernels.py --only dense_tiling``: inside ``forced_tiling`` the dense MLP's
    specs take the forced choices (gate/up and down apart; a changed split without stages gets
    the two-CTA ring), and the rule is back after it."""
    from codegen.launchers import gemm_specs
    from codegen.launchers.experts import one_expert_gemm_specs

    bench = example_module("bench_kernels")
    x, up, down = (torch.empty(*shape, dtype=torch.bfloat16) for shape in ((8, D), (2 * 2112, D), (D, 2112)))
    args = (x, up, down, 4.0, 25.0, "tp", 1)

    def params():
        return [s.param_dict for s in one_expert_gemm_specs("k3f::dense_mlp", "sm_90a", args, (2, 64))]

    chosen = params()
    rule = gemm_specs.gemm_tiling
    with bench.forced_tiling({"split_k": 8}, {"stages": 5}):
        forced = params()
    assert gemm_specs.gemm_tiling is rule and params() == chosen
    assert forced[0]["split_k"] == 8 and forced[0]["stages"] == 6 and forced[1]["stages"] == 5
    same = [k for k in chosen[1] if k != "stages"]
    assert [forced[1][k] for k in same] == [chosen[1][k] for k in same]
