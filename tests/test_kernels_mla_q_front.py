"""The ``mla_q_front`` template (``k3f::mla_q_front``): specs and refusals (everywhere), compile,
PTX and ptxas checks for sm_90a and sm_100a (with CuTe DSL), and the kernel on a GPU against the
op's CPU reference (marked ``gpu``; skipped without CUDA or CuTe DSL): fresh random inputs,
outputs poisoned with NaN, bf16 and fp8 caches paged in shuffled blocks of 64 with a padding
token, and a CUDA-graph capture and replay.

On the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_mla_q_front.py``.
"""
from __future__ import annotations

import re

import pytest
import torch

import patterns.mla  # noqa: F401  (defines the k3f ops used here)
import rewriter.model.ops  # noqa: F401  (the k3:: ops its reference calls)
from codegen import bind
from codegen.templates import spec_for_call, template
from conftest import GPU_MARKS, gpu_kernels, needs_cutedsl, pdl_flags, ptxas_usage, rel_err, spec_of

OP = "k3f::mla_q_front"
ARCHS = ("sm_90a", "sm_100a")
HEADS = {"tp16": 6, "tp8": 12}  # Kimi K3 MLA heads per rank
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 1536, 512, 128, 64, 128
ENTRY = KV_LORA + ROPE
EPS = 1e-5
BLOCK = 64


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def in_proj_split(proj: torch.Tensor, heads: int):
    """q_c, kv_c, k_pe as ``mla_in_proj`` leaves them: column views of [q_c | kv_c | k_pe | gate]."""
    q_c, kv_c, k_pe, _ = proj.split([Q_LORA, KV_LORA, ROPE, heads * V_DIM], dim=-1)
    return q_c, kv_c, k_pe


def mla_args(heads=6, tokens=1, cache="bf16", blocks=4, block_size=BLOCK, make=meta, slot_dtype=torch.int64,
             dims=(NOPE, ROPE, V_DIM, KV_LORA)):
    """The 16 arguments of ``k3f::mla_q_front`` (meta tensors unless ``make`` says otherwise)."""
    cache_dtype = torch.bfloat16 if cache == "bf16" else torch.uint8
    q_c, kv_c, k_pe = in_proj_split(make(tokens, Q_LORA + KV_LORA + ROPE + heads * V_DIM), heads)
    return (q_c, kv_c, k_pe, make(Q_LORA), make(KV_LORA), make(heads * (NOPE + ROPE), Q_LORA),
            make(heads * (NOPE + V_DIM), KV_LORA), make(blocks, block_size, ENTRY, dtype=cache_dtype),
            make(tokens, dtype=slot_dtype), make(1, dtype=torch.float32), heads, *dims, EPS)


def replace(args, i, value):
    args = list(args)
    args[i] = value
    return tuple(args)


def q_spec(arch, args):
    return spec_of(OP, arch, args)


# ---------------------------------------------------------------- specs and refusals (no CuTe DSL needed)

@pytest.mark.parametrize("shape", list(HEADS))
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_specs_at_kimi_k3_shapes(shape, tokens):
    h = HEADS[shape]
    spec = q_spec("sm_90a", mla_args(heads=h, tokens=tokens))
    assert spec.kernel == "mla_q_front" and spec.op == OP
    assert spec.shape_dict == {"tokens": tokens, "heads": h}
    width = Q_LORA + KV_LORA + ROPE + h * V_DIM  # the in-proj row the views share (one token: canonical)
    strides = (width,) * 3 if tokens > 1 else (Q_LORA, KV_LORA, ROPE)
    assert spec.param_dict == {"cache": "bf16", "slot": "int64", "eps": EPS, "q_stride": strides[0],
                               "kv_stride": strides[1], "pe_stride": strides[2]}
    # the cache's blocks, block size and strides are runtime values
    assert q_spec("sm_90a", mla_args(heads=h, tokens=tokens, blocks=300, block_size=16)) == spec
    paged = meta(5, BLOCK * ENTRY + 64)[:, :BLOCK * ENTRY].unflatten(1, (BLOCK, ENTRY))
    assert q_spec("sm_90a", replace(mla_args(heads=h, tokens=tokens), 7, paged)) == spec
    assert q_spec("sm_100a", mla_args(heads=h, tokens=tokens)) == spec.with_arch("sm_100a")
    fp8 = q_spec("sm_90a", mla_args(heads=h, tokens=tokens, cache="fp8"))
    assert fp8.param_dict["cache"] == "fp8" and fp8 != spec
    e4m3 = replace(mla_args(heads=h, tokens=tokens), 7, meta(4, BLOCK, ENTRY, dtype=torch.float8_e4m3fn))
    assert q_spec("sm_90a", e4m3) == fp8
    assert q_spec("sm_90a", mla_args(heads=h, tokens=tokens, slot_dtype=torch.int32)).param_dict["slot"] == "int32"
    assert template("mla_q_front").ops == (OP,)


def _contig(tokens=2, heads=6):
    """mla_args with contiguous q_c / kv_c / k_pe (their own rows)."""
    args = mla_args(heads=heads, tokens=tokens)
    return replace(replace(replace(args, 0, meta(tokens, Q_LORA)), 1, meta(tokens, KV_LORA)), 2, meta(tokens, ROPE))


@pytest.mark.parametrize("args,reason", [
    ((), "k3f::mla_q_front takes 16 arguments, got 0"),
    (mla_args(dims=(16, 8, 16, 32)), "head dims nope 16, rope 8, v_dim 16, kv_lora 32: the kernel is built for"),
    (mla_args(tokens=65), "65 tokens outside 1..64"),
    (replace(mla_args(tokens=2), 0, meta(2, Q_LORA, dtype=torch.float32)), "q_c is fp32; the template is bf16 only"),
    (replace(mla_args(tokens=2), 0, meta(2, Q_LORA + 4)[:, :Q_LORA]), "a multiple of 8 (128-bit loads)"),
    (replace(mla_args(tokens=2), 1, meta(2, 256)), "kv_c must be [tokens, 512], got [2, 256]"),
    (replace(mla_args(), 5, meta(6 * 192, 1024)), "q_b_weight must be [1152, 1536]"),
    (replace(mla_args(), 6, meta(6 * 256, KV_LORA, dtype=torch.float16)), "kv_b_weight is fp16"),
    (replace(mla_args(), 7, meta(4, BLOCK, ENTRY, dtype=torch.float32)), "kv_cache is fp32; the template takes"),
    (replace(mla_args(), 7, meta(4, BLOCK, 656, dtype=torch.uint8)), "kv_cache must be [blocks, block_size, 576]"),
    (replace(mla_args(), 7, meta(4, BLOCK * ENTRY + 4)[:, :BLOCK * ENTRY].unflatten(1, (BLOCK, ENTRY))),
     "multiples of 16 bytes (128-bit stores)"),
    (replace(mla_args(), 8, meta(1, dtype=torch.int16)), "slot_mapping is int16"),
    (replace(mla_args(tokens=2), 8, meta(3, dtype=torch.int64)), "slot_mapping must be a contiguous [2]"),
    (replace(mla_args(), 9, meta(2, dtype=torch.float32)), "kv_scale must be one fp32 value"),
])
def test_refusals_say_why(args, reason):
    tpl, why = spec_for_call(OP, "sm_90a", args)
    assert tpl is None and reason in why, why


def test_contiguous_activations_are_taken_too():
    assert q_spec("sm_90a", _contig()).param_dict["q_stride"] == Q_LORA


def test_launcher_declines_cpu_tensors():
    launcher = bind.TemplateLauncher("mla_q_front", arch="sm_90a")
    args = mla_args(make=lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype))
    assert launcher(*args) is NotImplemented
    assert any("CUDA" in r for r in bind.stats()[OP])


# ---------------------------------------------------------------- compile-only (CuTe DSL)

COMPILES = [  # (tokens, heads, cache, arch)
    *((t, h, "bf16", "sm_90a") for h in HEADS.values() for t in (1, 8, 64)),
    (5, 6, "fp8", "sm_90a"), (64, 12, "fp8", "sm_90a"), (1, 6, "bf16", "sm_100a"), (64, 12, "fp8", "sm_100a"),
]


@pytest.fixture(scope="module")
def compiled(kcache):
    from codegen.compiler import clear_memory_cache, compile_kernel

    clear_memory_cache()
    return {key: compile_kernel(q_spec(key[3], mla_args(heads=key[1], tokens=key[0], cache=key[2])), cache=kcache)
            for key in COMPILES}


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


@needs_cutedsl
@pytest.mark.parametrize("key", COMPILES, ids=lambda k: f"t{k[0]}_h{k[1]}_{k[2]}_{k[3]}")
def test_mla_q_front_ptx(compiled, key):
    tokens, heads, cache, arch = key
    k = compiled[key]
    ptx = k.ptx
    assert f".target {arch}" in ptx and k.cache == "miss" and k.obj
    assert ".reqntid 256, 1, 1" in ptx  # 8 warps; the cluster of 8 CTAs is a launch attribute
    mtiles = -(-tokens // 16)
    # phase A: 6 K blocks x 2 k16 steps x 3 n-tiles per warp (one chunk's code, looped); phase B: 8 per m-tile
    assert _count(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 36 + 8 * mtiles
    assert _count(ptx, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 4  # the W_UK B fragments
    assert _count(ptx, "ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 8 * mtiles  # the q_nope A fragments
    assert _count(ptx, "ld.shared::cluster.v4.b32") == -(-16 * tokens // 256)  # the gather, 128-bit
    # PDL: q_b (18 streamed 128-bit loads per lane), q_a_norm and W_UK (cp.async) before the wait;
    # up to 16 tokens also the insert's slot and kv_a_norm (2 x 128-bit), which no kernel of the step writes
    early = mtiles == 1
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait;")
    assert _count(before, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 18
    assert _count(ptx, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 18
    assert _count(before, "cp.async.cg.shared.global") == 5 and _count(after, "cp.async.cg.shared.global") == 0
    assert _count(before, "ld.global.nc") == 0 and _count(before, "ld.global.v4") == (2 if early else 0)
    assert _count(before, "ld.global.b") == early and _count(before, "st.") == 0  # the slot
    assert "griddepcontrol.launch_dependents" in after
    assert _count(ptx, "barrier.cluster.arrive") == 2 and _count(ptx, "barrier.cluster.wait") == 2
    # the cache insert: kv_c, kv_a_norm, k_pe (2 x 128-bit each); 128-bit stores of 16 values; up to
    # 16 tokens kv_c and k_pe are read before phase A's first barrier, not between the cluster's arrive and wait
    assert _count(ptx, "ld.global.v4.b32") == 6
    window = ptx[ptx.index("barrier.cluster.arrive"):ptx.index("barrier.cluster.wait")]
    assert _count(window, "ld.global.v4.b32") == (0 if early else 6)
    if cache == "fp8":
        # 32 values per lane: value / scale (IEEE, as torch), then two per cvt (the means divide too)
        assert _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") == 16 and _count(ptx, "div.rn.f32") >= 32
        assert _count(ptx, "st.global.v4.b32") == 2
    else:
        assert "e4m3" not in ptx and _count(ptx, "st.global.v4.b32") == 4
    assert "ld.local" not in ptx and "st.local" not in ptx
    registers, spilled = ptxas_usage(ptx, arch)
    assert spilled == 0 and registers <= 255, (registers, spilled)


@needs_cutedsl
def test_mla_q_front_launches_with_pdl_in_a_cluster(compiled):
    assert pdl_flags(compiled[1, 6, "bf16", "sm_90a"].spec) == [1]


# ---------------------------------------------------------------- on the GPU (marked gpu)

TOL = 1e-2  # bf16 outputs


def mla_inputs(heads, tokens, cache, gen, pad=(), cache_layout="contiguous"):
    """CPU inputs with realistic magnitudes; the cache paged in blocks of 64 (blocks + 3 of them,
    block 0 never used), the tokens' slots distinct, random and in shuffled blocks, ``pad``: tokens
    given slot -1; the cache prefilled with random entries (``cache_layout`` ``paged``: a view whose
    block stride is wider than a block, as vLLM's hybrid allocator may pad pages)."""
    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).bfloat16()

    blocks = -(-tokens // BLOCK) + 3
    proj = rnd(tokens, Q_LORA + KV_LORA + ROPE + heads * V_DIM, scale=2.0)
    q_c, kv_c, k_pe = in_proj_split(proj, heads)
    order = torch.randperm(blocks - 1, generator=gen) + 1  # block 0: vLLM's null block
    slots = torch.stack([order[s // BLOCK] * BLOCK + s % BLOCK
                         for s in torch.randperm((blocks - 1) * BLOCK, generator=gen)[:tokens].tolist()])
    slots[list(pad)] = -1
    scale = torch.tensor([0.05 + 0.1 * float(torch.rand(1, generator=gen))], dtype=torch.float32)
    values = torch.randn(blocks, BLOCK, ENTRY, generator=gen)
    kv_cache = (values / scale).to(torch.float8_e4m3fn).view(torch.uint8) if cache == "fp8" else values.bfloat16()
    if cache_layout == "paged":
        kv_cache = paged(kv_cache)
    return (q_c, kv_c, k_pe, rnd(Q_LORA, scale=0.1, shift=1.0), rnd(KV_LORA, scale=0.1, shift=1.0),
            rnd(heads * (NOPE + ROPE), Q_LORA, scale=0.03), rnd(heads * (NOPE + V_DIM), KV_LORA, scale=0.05),
            kv_cache, slots.to(torch.int64), scale, heads, NOPE, ROPE, V_DIM, KV_LORA, EPS)


def paged(cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` whose blocks sit 64 entries' worth of bytes apart beyond their own size."""
    blocks, bs, entry = cache.shape
    raw = torch.zeros(blocks, bs * entry + 64 * 16, dtype=cache.dtype, device=cache.device)
    view = raw.as_strided(cache.shape, (raw.stride(0), entry, 1))
    view.copy_(cache)
    return view


def to_gpu(cpu, cache_layout):
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu]
    proj = cpu[0]._base if cpu[0]._base is not None else None
    if proj is not None:  # keep the activations as views of one in-proj row on the GPU too
        gpu[0], gpu[1], gpu[2] = in_proj_split(proj.cuda(), cpu[10])
    if cache_layout == "paged":
        gpu[7] = paged(cpu[7].cuda())
    return gpu


def reference(cpu):
    """The op's CPU reference on a copy of the cache: (out, cache)."""
    args = list(cpu)
    args[7] = cpu[7].clone()
    return torch.ops.k3f.mla_q_front(*args), args[7]


def check(out, cache, ref, cpu):
    ref_out, ref_cache = ref
    assert out.shape == ref_out.shape and torch.isfinite(out).all()
    assert rel_err(out, ref_out) <= TOL
    assert rel_err(out[..., :KV_LORA], ref_out[..., :KV_LORA]) <= TOL  # ql_nope
    assert rel_err(out[..., KV_LORA:], ref_out[..., KV_LORA:]) <= TOL  # q_pe
    cache, before = cache.cpu(), cpu[7]
    slots = cpu[8]
    flat, ref_flat, old = (c.flatten(0, 1) for c in (cache, ref_cache, before))  # [slots, 576]
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(flat[~written], old[~written])  # no other entry touched (padding tokens included)
    got, want = flat[written], ref_flat[written]
    if cache.dtype == torch.uint8:  # E4M3 codes: equal, or one code apart (one ulp) with the same sign
        g, w = got.to(torch.int16), want.to(torch.int16)
        assert torch.equal(g & 0x80, w & 0x80) and ((g - w).abs() <= 1).all()
        assert (g == w).float().mean() >= 0.99
        assert torch.equal(got[:, KV_LORA:], want[:, KV_LORA:])  # k_pe: no norm in between, exact
    else:
        assert rel_err(got, want) <= TOL
        assert torch.equal(got[:, KV_LORA:], want[:, KV_LORA:])  # k_pe copied as is


class TestMlaQFrontOnGpu:
    pytestmark = GPU_MARKS

    @pytest.mark.parametrize("tokens,pad", [(1, ()), (5, (2,)), (8, (0,)), (64, (17, 63))])
    @pytest.mark.parametrize("cache,layout", [("bf16", "contiguous"), ("fp8", "contiguous"), ("bf16", "paged"),
                                              ("fp8", "paged")])
    @pytest.mark.parametrize("shape", list(HEADS))
    def test_mla_q_front(self, shape, tokens, pad, cache, layout):
        heads = HEADS[shape]
        gen = torch.Generator().manual_seed(1000 * heads + tokens + (7 if cache == "fp8" else 0))
        cpu = mla_inputs(heads, tokens, cache, gen, pad, layout)
        ref = reference(cpu)
        gpu = to_gpu(cpu, layout)
        assert gpu[0].stride(0) == cpu[0].stride(0)  # views of one wider row on the GPU too
        assert layout == "contiguous" or gpu[7].stride(0) > BLOCK * ENTRY  # paged on the GPU too
        tpl, specs, fns = gpu_kernels(OP, gpu)
        assert tpl.kernel == "mla_q_front" and tpl.runtime_check(gpu) is None
        out = torch.full((tokens, heads, ENTRY), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert tpl.launch(fns, specs, gpu, out=out) is out
        torch.cuda.synchronize()
        check(out, gpu[7], ref, cpu)

    def test_fp8_saturates_as_vllm_does(self):
        """Entries past E4M3's range (value / scale beyond 448) are stored as +-448, as vLLM's
        saturating cache writes and the reference do (torch's plain cast would store NaN)."""
        gen = torch.Generator().manual_seed(5)
        cpu = list(mla_inputs(6, 3, "fp8", gen))
        cpu[9] = torch.tensor([1e-3], dtype=torch.float32)  # |k_pe| / 1e-3 mostly > 448
        ref = reference(cpu)
        gpu = to_gpu(cpu, "contiguous")
        tpl, specs, fns = gpu_kernels(OP, gpu)
        out = tpl.launch(fns, specs, gpu)
        torch.cuda.synchronize()
        check(out, gpu[7], ref, cpu)

    def test_op_dispatches_to_the_kernel_and_replays_in_a_cuda_graph(self):
        bind.install_cuda_kernels()
        gen = torch.Generator().manual_seed(11)
        cpu = mla_inputs(HEADS["tp16"], 4, "fp8", gen, pad=(1,))
        ref = reference(cpu)
        gpu = to_gpu(cpu, "contiguous")
        cache0 = gpu[7].clone()
        before = bind.stats().get(OP, {}).get("kernel", 0)
        out = torch.ops.k3f.mla_q_front(*gpu)  # compiles and loads outside the capture
        torch.cuda.synchronize()
        assert bind.stats()[OP]["kernel"] == before + 1
        check(out, gpu[7], ref, cpu)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.k3f.mla_q_front(*gpu)
        gpu[7].copy_(cache0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, gpu[7], ref, cpu)
        assert bind.stats()[OP]["kernel"] == before + 2
