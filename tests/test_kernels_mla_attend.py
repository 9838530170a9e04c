"""The ``mla_attend`` template (``k3f::mla_attend``: MLA decode over the paged latent cache +
W_UV + sigmoid gate): specs and refusals (everywhere), compile and ptxas checks (with CuTe DSL),
and the kernel on a GPU against the op's reference in fp32 (marked ``gpu``).

On the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_mla_attend.py``.
"""
from __future__ import annotations

import re

import pytest
import torch

import patterns.mla  # noqa: F401  (defines the k3f ops used here)
import rewriter.model.ops  # noqa: F401  (the k3:: ops its reference calls)
from codegen import bind
from codegen.templates import spec_for_call, template
from conftest import example_module, gpu_kernels, needs_cutedsl, on_gpu, pdl_flags, ptxas_usage, rel_err, spec_of

OP = "k3f::mla_attend"
HEADS = {"tp16": 6, "tp8": 12, "tp4": 24, "tp1": 96}  # Kimi K3 MLA heads per rank (from 24: head groups)
E, L = 576, 512
SCALE = 192 ** -0.5
GATE_WIDTH, GATE_AT = 12800, 96  # the gate is a column slice of the input projection's output (96 heads fit)
TOL = 1e-2


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def attend_args(batch=1, heads=6, cache_dtype=torch.bfloat16, make=meta, blocks=40, block_size=64, max_blocks=8,
                tokens=None):
    t = batch if tokens is None else tokens
    gate = make(t, GATE_WIDTH)[:, GATE_AT:GATE_AT + heads * 128]
    return (make(t, heads, E), make(blocks, block_size, E, dtype=cache_dtype),
            make(batch, max_blocks, dtype=torch.int32), make(batch, dtype=torch.int32),
            make(1, dtype=torch.float32), make(heads * 256, L), gate, SCALE, heads, 128, 128, L)


def attend_spec(arch, args):
    return spec_of(OP, arch, args)


# ---------------------------------------------------------------- specs and refusals (no CuTe DSL needed)

@pytest.mark.parametrize("shape,batch", [(s, b) for s in HEADS for b in (1, 8, 64)
                                         if b * -(-HEADS[s] // 16) <= 128])  # a grid of B x head groups x splits
def test_specs_at_kimi_k3_shapes(shape, batch):
    h = HEADS[shape]
    spec = attend_spec("sm_90a", attend_args(batch, h))
    assert spec.kernel == "mla_attend" and spec.op == OP
    assert spec.shape_dict == {"batch": batch, "heads": h, "block_size": 64}
    assert spec.dtype_dict["cache"] == "bf16"
    assert spec.param_dict == {"scale": SCALE, "gate_stride": GATE_WIDTH}
    # the cache's blocks and the block table's width are runtime sizes; the block size is the
    # kernel's (one block table lookup a tile where it is a multiple of 64)
    assert attend_spec("sm_90a", attend_args(batch, h, blocks=900, max_blocks=300)) == spec
    assert attend_spec("sm_90a", attend_args(batch, h, block_size=16)).shape_dict["block_size"] == 16
    fp8 = attend_spec("sm_90a", attend_args(batch, h, cache_dtype=torch.uint8))
    assert fp8.dtype_dict["cache"] == "fp8_e4m3" and fp8 != spec
    assert attend_spec("sm_90a", attend_args(batch, h, cache_dtype=torch.float8_e4m3fn)) == fp8
    assert template("mla_attend").ops == (OP,)


@pytest.mark.parametrize("requests,q", [(1, 8), (2, 4), (8, 8)])
def test_verify_specs(requests, q):
    """A verify step of q tokens per request: the kernel's rows are the tokens (each its own
    causal length), compiled per (tokens, q)."""
    spec = attend_spec("sm_90a", attend_args(requests, 6, tokens=requests * q))
    assert spec.shape_dict == {"batch": requests * q, "heads": 6, "block_size": 64, "q_len": q}
    assert spec != attend_spec("sm_90a", attend_args(requests * q, 6))


def _with(i, value, **kw):
    args = list(attend_args(**kw))
    args[i] = value
    return tuple(args)


@pytest.mark.parametrize("args, reason", [
    (attend_args(batch=2, tokens=5), "5 tokens do not split evenly over 2 requests"),
    (attend_args(batch=1, tokens=9), "9 tokens per request outside 1..8"),
    (attend_args(batch=65), "65 tokens outside 1..64"),
    (attend_args(batch=9, tokens=72), "72 tokens outside 1..64"),
    (attend_args(cache_dtype=torch.float16), "kv_cache is fp16"),
    (_with(1, meta(40, 64, 2 * E)[:, :, :E]), "kv_cache strides"),
    (_with(1, meta(40 * 64 * E + 4)[4:].view(40, 64, E).as_strided((40, 64, E), (64 * E + 4, E, 1))),
     "block stride a multiple of 8"),
    (_with(2, meta(1, 8, dtype=torch.int64)), "block_table must be a contiguous int32"),
    (_with(3, meta(1, dtype=torch.int64)), "seq_lens must be int32"),
    (_with(4, meta(2, dtype=torch.float32)), "kv_scale must be one fp32 value"),
    (_with(6, meta(128 * 6, 2).t()[:1]), "gate must be bf16 with unit column stride"),
    (_with(11, 256), "kv_lora 256: the kernel is built for 128, 128, 512"),
    (attend_args(heads=130), "heads 130 outside 1..128"),
    (attend_args(batch=22, heads=96), "22 tokens x 6 head groups of 16 heads: more CTAs than the 128"),  # TP 1
    (attend_args(batch=64, heads=48), "64 tokens x 3 head groups"),  # TP 2
])
def test_refusals_say_why(args, reason):
    tpl, why = spec_for_call(OP, "sm_90a", args)
    assert tpl is None and reason in why, why


def test_the_launchers_grid_is_the_kernels():
    """The launcher sizes the scratch and checks the SM count from its own copy of the kernel's
    head groups and splits (it imports no CuTe DSL): they agree at every head count and batch."""
    from codegen.launchers.mla_attend import MLA_GROUP_HEADS, MLA_MAX_HEADS, mla_head_groups, mla_splits
    kernel = pytest.importorskip("codegen.kernels.mla_attend")
    assert (MLA_GROUP_HEADS, MLA_MAX_HEADS) == (kernel.MAX_HEADS, kernel.MAX_TOTAL_HEADS)
    for h in range(1, MLA_MAX_HEADS + 1):
        g = mla_head_groups(h)
        assert g == kernel.head_groups(h) and h % g == 0 and h // g <= MLA_GROUP_HEADS
        for batch in (1, 3, 8, 64):
            for cap in (128, 114, 78):  # the grid's cap: 128, or the SMs of an H100 PCIe, an H20
                if batch * g <= cap:  # else the template refuses (below)
                    splits = mla_splits(batch, h, cap)
                    assert splits == kernel.splits_for(batch, g, cap) and batch * g * splits <= cap
    assert [mla_head_groups(h) for h in (6, 12, 16, 24, 32, 96)] == [1, 1, 1, 2, 2, 6]


def test_a_gpu_with_fewer_sms_than_the_grid_gets_fewer_splits(monkeypatch):
    """On a GPU of fewer than 128 SMs (an H20's 78) the spec caps the grid at its SMs (a
    ``max_ctas`` parameter, so another kernel), and refuses what that cap cannot hold, naming it;
    at 128 the spec is the one it was (no parameter: the same cache entries)."""
    import codegen.launchers.mla_attend as launcher

    served = attend_spec("sm_90a", attend_args(8, 6))
    assert "max_ctas" not in served.param_dict
    monkeypatch.setattr(launcher, "grid_cap", lambda t: 78)
    spec = attend_spec("sm_90a", attend_args(8, 6))
    assert spec.param_dict["max_ctas"] == 78 and spec != served
    assert launcher.mla_splits(8, 6, 78) == 9  # 72 CTAs of the 78
    tpl, why = spec_for_call(OP, "sm_90a", attend_args(64, 24))  # 64 tokens x 2 head groups
    assert tpl is None and "more CTAs than the 78 SMs of the GPU hold" in why, why
    assert attend_spec("sm_90a", attend_args(39, 24)).param_dict["max_ctas"] == 78  # 78 CTAs: one split each


def test_the_kernel_benchmark_times_a_served_call_at_each_grid_cap():
    """``examples/bench_kernels.py --only mla_attend``: its inputs are a call the template serves and
    the op's reference takes (finite outputs), and inside ``forced_grid_cap`` the spec takes the
    cap (fewer context splits), the launcher's rule back after it."""
    import codegen.launchers.mla_attend as launcher

    bench = example_module("bench_kernels")
    args = bench.mla_attend_args(6, 2, 200, torch.Generator().manual_seed(0), device="cpu")
    rule = launcher.grid_cap
    assert "max_ctas" not in attend_spec("sm_90a", args).param_dict
    with bench.forced_grid_cap(32):
        assert attend_spec("sm_90a", args).param_dict["max_ctas"] == 32
    assert launcher.grid_cap is rule and "max_ctas" not in attend_spec("sm_90a", args).param_dict
    out = torch.ops.k3f.mla_attend(*args)
    assert out.shape == (2, 6 * 128) and torch.isfinite(out).all() and out.abs().max() > 0


def test_the_scratch_is_made_and_its_barrier_zeroed_outside_any_capture(monkeypatch):
    """The server's steps run only inside CUDA graph captures, and vLLM captures its largest FULL
    graphs once to size its memory, then throws them away: a scratch first made in such a capture
    would have its barrier word's zeroing recorded into a graph that never runs. So
    ``make_workspaces`` (the plugin calls it each time vLLM binds its caches) makes the scratch of
    each spec's shape and zeroes its barrier, every time; inside a capture the launcher refuses to
    make one."""
    import codegen.launchers.mla_attend as launcher
    from codegen.templates import make_workspaces

    monkeypatch.setattr(launcher, "_SCRATCH", {})
    spec = attend_spec("sm_90a", attend_args(8, 6))
    assert make_workspaces([spec], "cpu") == 1
    ((key, (p_acc, p_ml, latent, barrier)),) = launcher._SCRATCH.items()
    splits = launcher.mla_splits(8, 6)
    assert p_acc.shape == (8 * splits, 6, 512) and p_ml.shape == (8 * splits, 6, 2) and latent.shape == (8, 6, 512)
    barrier.fill_(5)  # a word some earlier launch left dirty
    assert make_workspaces([spec], "cpu") == 1 and barrier.item() == 0 and len(launcher._SCRATCH) == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="the scratch of 8 tokens x 6 heads on cuda:0 is made outside a CUDA graph"):
        launcher._scratch_of(spec, torch.device("cuda", 0))


# ---------------------------------------------------------------- compile checks (CuTe DSL, no GPU)

@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("batch, heads, cache, q, block", [(1, 6, torch.bfloat16, 1, 64),
                                                           (64, 12, torch.bfloat16, 1, 64),
                                                           (1, 12, torch.uint8, 1, 64), (64, 12, torch.uint8, 1, 16),
                                                           (1, 6, torch.bfloat16, 8, 16), (2, 12, torch.uint8, 4, 128),
                                                           (1, 96, torch.bfloat16, 1, 64), (8, 24, torch.uint8, 1, 64),
                                                           (8, 12, torch.uint8, 1, 1536)])  # vLLM's page: TP 8, fp8
def test_compiles_without_spills(arch, batch, heads, cache, q, block, kcache):
    from codegen.compiler import compile_kernel

    spec = attend_spec(arch, attend_args(batch, heads, cache_dtype=cache, tokens=batch * q, block_size=block))
    k = compile_kernel(spec, cache=kcache)
    registers, spilled = ptxas_usage(k.ptx, arch)
    assert spilled == 0 and registers <= 255, (spec.label(), registers, spilled)
    # two grid-wide barriers (fence, one relaxed arrival on the one word, relaxed loads while
    # waiting, fence), dependents launched only after the first, and PDL on the launch
    ptx = k.ptx
    assert ptx.count("atom.global.add") == 2 and ptx.count("fence.acq_rel.gpu") == 4
    assert "ld.relaxed.gpu" in ptx and "ld.acquire" not in ptx
    # each barrier's wait reads the global timer and traps past its deadline, inside the spin
    for arrival in (ptx.index("atom.global.add"), ptx.rindex("atom.global.add")):
        spin = ptx[arrival:ptx.index("fence.acq_rel.gpu", arrival)]
        assert spin.count("%globaltimer") == 2 and spin.count("trap;") == 1, spin
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("atom.global.add")
    # the first tile's entries of earlier steps are in flight before the wait; the queries after it
    # (each thread's 16-byte loads of a tile: cp.async for bf16, streaming loads for fp8 beside
    # the W_UV rows' two a row)
    from codegen.kernels.mla_attend import build

    kernel, _ = build(spec)
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1
    from codegen.kernels.mla_attend import WUV_HELD_ROWS
    # the W_UV rows: two vectors a row held in registers, or with two warpgroups the CTA's rows
    # copied into shared memory (a vector a thread at a time)
    held = 2 * min(kernel.rows_per_warp, WUV_HELD_ROWS) if kernel.wgs == 1 else 0
    staged = -(-kernel.rows_per_cta * 64 // kernel.threads) if kernel.wgs == 2 else 0
    if cache == torch.bfloat16:
        assert ptx[:wait].count("cp.async.cg.shared.global") == kernel.loads + staged
    else:
        assert ptx[:wait].count("ld.global.L1") == kernel.loads + held
        assert ptx[:wait].count("cp.async.cg.shared.global") == staged
    assert "ld.global.v4" not in ptx[:wait] and "ld.global.v4" in ptx[wait:]
    # before the wait, the 32-bit loads: the request's length and the block table lookups of
    # the first two tiles (one a tile, or one a pass of a thread's rows where blocks are not
    # multiples of 64)
    lookups = 1 if block % 64 == 0 else kernel.passes
    assert ptx[:wait].count("ld.global.b32") == 1 + 2 * lookups
    if arch == "sm_90a" and batch == 1:
        assert pdl_flags(spec) == [1]


@needs_cutedsl
def test_a_capped_grid_compiles_without_spills(monkeypatch, kcache):
    """The kernel for a 78-SM GPU (9 splits a request at 8 tokens) builds, its scratch sized by the cap."""
    import codegen.launchers.mla_attend as launcher
    from codegen.compiler import compile_kernel
    from codegen.kernels.mla_attend import build

    monkeypatch.setattr(launcher, "grid_cap", lambda t: 78)
    spec = attend_spec("sm_90a", attend_args(8, 6))
    kernel, _ = build(spec)
    assert (kernel.splits, kernel.pairs, kernel.ctas) == (9, 72, 72)
    registers, spilled = ptxas_usage(compile_kernel(spec, cache=kcache).ptx, "sm_90a")
    assert spilled == 0 and registers <= 255


@needs_cutedsl
@pytest.mark.parametrize("batch, heads, cache, wgs", [(8, 6, torch.uint8, 2), (4, 12, torch.uint8, 2),
                                                       (8, 6, torch.bfloat16, 1), (1, 6, torch.uint8, 1),
                                                       (8, 96, torch.uint8, 1)])
def test_two_warpgroups_for_fp8_where_the_shared_memory_holds_them(batch, heads, cache, wgs, kcache):
    """Kimi K3's fp8 cache at TP 16 and 8 (6, 12 heads a rank) from 4 tokens: 512 threads in two
    warpgroups, each on every other tile with its own named barrier (ids 1 and 2), the second's
    sums merged into the first's before the partials; a bf16 cache (its cp.async chain measured
    faster so), one token (a split's one tile would leave the second idle) and TP 1 (96 heads:
    96 W_UV rows a CTA would not fit beside both tiles) one warpgroup and the CTA's barrier only."""
    from codegen.compiler import compile_kernel
    from codegen.kernels.mla_attend import SMEM_BYTES, build

    spec = attend_spec("sm_90a", attend_args(batch, heads, cache_dtype=cache))
    kernel, _ = build(spec)
    assert (kernel.wgs, kernel.threads) == (wgs, 256 * wgs)
    assert (wgs == 2) == (cache == torch.uint8 and batch >= 4 and kernel.smem_bytes(2) <= SMEM_BYTES)
    ptx = compile_kernel(spec, cache=kcache).ptx
    named = re.findall(r"bar(?:rier)?\.sync(?:\.aligned)?\s+%r\d+,\s*256;", ptx)
    assert bool(named) == (wgs == 2), named
    registers, spilled = ptxas_usage(ptx, "sm_90a")
    assert spilled == 0 and registers <= 65536 // kernel.threads


@needs_cutedsl
@pytest.mark.parametrize("batch, heads, cache", [(8, 6, torch.bfloat16), (64, 12, torch.bfloat16),
                                                  (64, 12, torch.uint8), (3, 6, torch.bfloat16)])
def test_the_w_uv_stage_loads_its_latents_in_chunks_and_stores_last(batch, heads, cache, kcache):
    """After the second grid barrier, per W_UV row of a warp: its requests' gates (one a lane, 32
    requests a load), then the latents of ``WUV_CHUNK`` requests at a time (2 vectors each, one
    loop body per 32 requests), then one store a lane per 32 requests: no load behind a store,
    no gate read behind a sum."""
    from codegen.compiler import compile_kernel
    from codegen.kernels.mla_attend import WUV_CHUNK, MlaAttend

    spec = attend_spec("sm_90a", attend_args(batch, heads, cache_dtype=cache))
    ptx = compile_kernel(spec, cache=kcache).ptx
    k = MlaAttend(batch, heads, "bf16" if cache == torch.bfloat16 else "fp8_e4m3", SCALE, GATE_WIDTH)
    halves, chunk = -(-batch // 32), min(WUV_CHUNK, batch)
    row = ["ld.global.b16"] * halves + ["ld.global.v4.b32"] * (2 * chunk * halves) + ["st.global.b16"] * halves
    tail = ptx[ptx.rindex("fence.acq_rel.gpu"):]
    assert re.findall(r"\b(ld\.global[\w.]*|st\.global[\w.]*)", tail) == row * k.rows_per_warp


# ---------------------------------------------------------------- on the GPU (marked gpu)

def attend_inputs(batch, heads, seq_lens, *, fp8=False, block_size=64, seed=0, kv_scale=0.37, q_len=1):
    """Fresh random inputs on the CPU: a paged cache whose blocks are handed out shuffled (as
    vLLM's allocator does after a while), spare blocks full of values nobody may read, the
    rows past each request's end in its last block NaN (a kernel that reads them must not let
    them through); ``q_len`` tokens per request (a verify step: ``seq_lens`` count the step's own tokens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(max(blocks_per), 1) + 1
    n_blocks = sum(blocks_per) + 3
    order = torch.randperm(n_blocks - 1, generator=gen) + 1  # block 0 is the null block
    table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = order[used:used + n].int()
        used += n
    cache = torch.randn(n_blocks, block_size, E, generator=gen)
    scale = torch.tensor([kv_scale if fp8 else 1.0], dtype=torch.float32)
    if fp8:
        cache = (cache / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        cache = cache.bfloat16()
    for b, n in enumerate(seq_lens):  # a last block's rows past the request's end: stale, here NaN
        if n % block_size:
            cache[table[b, blocks_per[b] - 1], n % block_size:] = 0x7F if fp8 else float("nan")  # E4M3 NaN
    q = (torch.randn(batch * q_len, heads, E, generator=gen) * 0.5).bfloat16()
    kv_b = (torch.randn(heads * 256, L, generator=gen) * L ** -0.5).bfloat16()
    gate = torch.randn(batch * q_len, GATE_WIDTH, generator=gen).bfloat16()[:, GATE_AT:GATE_AT + heads * 128]
    return (q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), scale, kv_b, gate, SCALE, heads, 128, 128, L)


def reference(args):
    """The op's reference in fp32 (the bf16 cache exactly; the fp8 cache dequantized by the op)."""
    q, cache, table, seq, scale, kv_b, gate = args[:7]
    cache = cache if cache.dtype == torch.uint8 else cache.float()
    return torch.ops.k3f.mla_attend(q.float(), cache, table, seq, scale, kv_b.float(), gate.float(), *args[7:])


def cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def run(args):
    tpl, specs, fns = gpu_kernels(OP, args)
    out = torch.full((args[0].shape[0], args[8] * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert tpl.runtime_check(args) is None
    assert tpl.launch(fns, specs, args, out=out) is out
    torch.cuda.synchronize()
    return out


CASES = {  # (batch, context lengths): long and short requests, a padding request (0), a tail tile
    "b1-4096": (1, [4096]),
    "b1-1": (1, [1]),
    "b3-mixed": (3, [700, 0, 65]),
    "b8": (8, [4096, 1, 300, 64, 63, 2000, 129, 5]),
    "b64": (64, [(37 * i) % 1500 + 1 for i in range(63)] + [4096]),
}


@on_gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case,shape", [(c, s) for c in CASES for s in HEADS
                                        if CASES[c][0] * -(-HEADS[s] // 16) <= 128])  # the grid's bound
def test_mla_attend(case, shape, fp8):
    batch, seq = CASES[case]
    cpu = attend_inputs(batch, HEADS[shape], seq, fp8=fp8, seed=len(case) + batch)
    gpu = cuda(cpu)
    out = check_attend(cpu, gpu, seq, 1)
    # the barrier and scratch serve the next launch: the same result, bit for bit
    assert torch.equal(run(gpu), out)


@on_gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [16, 48, 128, 384, 768, 1536])
def test_mla_attend_block_sizes(block_size, fp8):
    """Blocks smaller than a tile or not a multiple of it (a lookup per row) and larger ones (a
    tile at an offset inside its block, one lookup a tile); the 64 of every other test is the
    one-lookup case at offset 0. 384, 768 and 1536 are the pages vLLM gives Kimi K3's MLA cache
    (``rewriter.model.pages``: 384 and 768 at TP 16 with bf16 and fp8, 768 and 1536 at TP 8): a hybrid
    model's attention page holds at least a KDA state slot."""
    batch, seq = CASES["b8"]
    cpu = attend_inputs(batch, 6, seq, fp8=fp8, block_size=block_size, seed=block_size)
    check_attend(cpu, cuda(cpu), seq, 1)


@on_gpu
@pytest.mark.parametrize("case", ["b1-4096", "b8", "b64"])
def test_mla_attend_on_a_grid_capped_below_the_sms(case, monkeypatch):
    """The kernel a 78-SM GPU (an H20) gets: fewer splits per request (78 at one token, 9 at 8, 1
    at 64), run here on more SMs than it takes, against the reference."""
    import codegen.launchers.mla_attend as launcher

    monkeypatch.setattr(launcher, "grid_cap", lambda t: 78)
    batch, seq = CASES[case]
    cpu = attend_inputs(batch, 6, seq, seed=78 + batch)
    tpl, specs, _ = gpu_kernels(OP, cuda(cpu))
    assert specs[0].param_dict["max_ctas"] == 78
    check_attend(cpu, cuda(cpu), seq, 1)


def check_attend(cpu, gpu, seq, q):
    """The kernel's rows against the op's reference; a padding request's (length 0) q rows zero;
    the cache only read. Returns the output."""
    ref = reference(cpu)
    cache_before = gpu[1].clone()
    out = run(gpu)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL, rel_err(out, ref)
    if 0 in seq:
        r = seq.index(0)
        assert (out[r * q:(r + 1) * q] == 0).all()
    assert torch.equal(gpu[1].view(torch.uint8), cache_before.view(torch.uint8))  # bytes: NaN rows equal too
    return out


VERIFY_CASES = {  # (requests, q, sequence lengths with the step's q tokens): a padding request (0)
    "b1-q8-4096": (1, 8, [4096]),
    "b1-q8-first": (1, 8, [8]),  # token t sees t + 1 entries
    "b3-q4-mixed": (3, 4, [700, 0, 66]),
    "b8-q8": (8, 8, [4096, 9, 300, 64, 71, 2000, 129, 12]),
}


@on_gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_mla_attend_verify(case, fp8):
    """q tokens per request, causal among them, against the op's reference (``k3::mla_decode``
    at q > 1, itself checked against q single-token steps); the cache only read."""
    requests, q, seq = VERIFY_CASES[case]
    cpu = attend_inputs(requests, 6, seq, fp8=fp8, seed=len(case) + q, q_len=q)
    out = check_attend(cpu, cuda(cpu), seq, q)
    # token t's row is the one-token result over the first seq - (q - 1 - t) entries
    t = q - 2
    single = (cpu[0][t:t + 1], cpu[1], cpu[2][:1], torch.tensor([seq[0] - 1], dtype=torch.int32), *cpu[4:6],
              cpu[6][t:t + 1], *cpu[7:])
    assert rel_err(out[t:t + 1].cpu(), reference(single)) <= TOL


TRAP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import codegen.kernels.common as common
common.WAIT_DEADLINE_NS = -1  # every wait is past its deadline at its first look
from test_kernels_mla_attend import attend_inputs, cuda, run
run(cuda(attend_inputs(1, 6, [4096])))
print("no trap")
"""


@on_gpu
def test_a_grid_barrier_past_its_deadline_fails_the_launch(tmp_path):
    """A grid barrier that would not end stops the kernel with a CUDA error instead of hanging
    the step: here every wait is past its deadline (a fresh process, since the error spoils the
    CUDA context, and a fresh kernel cache, since the deadline is compiled in)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    r = subprocess.run([sys.executable, "-c", TRAP_SCRIPT.format(tests=str(tests))], cwd=tests.parent,
                       env={**os.environ, "K3_REWRITER_CACHE": str(tmp_path)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "no trap" not in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "launch failure" in r.stderr or "illegal instruction" in r.stderr, r.stderr[-2000:]


@on_gpu
def test_op_dispatches_to_the_kernel_in_a_cuda_graph():
    bind.install_cuda_kernels()
    cpu = attend_inputs(4, 6, [900, 17, 0, 2048], seed=11)
    ref = reference(cpu)
    gpu = cuda(cpu)
    before = bind.stats().get(OP, {}).get("kernel", 0)
    torch.ops.k3f.mla_attend(*gpu)  # compiles and loads outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.k3f.mla_attend(*gpu)
    for step in range(3):  # replays meet at the barrier each time; new lengths each step
        out.fill_(float("nan"))
        gpu[3].copy_(torch.tensor([900 - step, 17, 0, 2048 + step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        cpu_step = (*cpu[:3], gpu[3].cpu(), *cpu[4:])
        assert rel_err(out, reference(cpu_step)) <= TOL
    assert rel_err(torch.ops.k3f.mla_attend(*cuda(cpu)), ref) <= TOL
    assert bind.stats()[OP]["kernel"] >= before + 2


@on_gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("requests, q, seq", [(1, 1, [4096]), (8, 1, [4096, 1, 300, 64, 63, 2000, 129, 5]),
                                              (2, 4, [700, 66])])
def test_step_inserts_are_read_after_the_wait(requests, q, seq, fp8):
    """The kernel loads the cache's older entries before ``griddepcontrol.wait`` (no kernel of
    the step writes them) and the step's own inserts only after it: behind a predecessor that
    writes the inserts 200 us after letting it launch, the result is the one over the new rows."""
    cpu = attend_inputs(requests, 6, seq, fp8=fp8, seed=5 + q, q_len=q)
    gpu = cuda(cpu)
    run(gpu)  # compiled and loaded before the launch under test
    cache, table = gpu[1], cpu[2]
    block = cache.shape[1]
    rows = [int(table[r, p // block]) * block + p % block for r, n in enumerate(seq) for p in range(max(n - q, 0), n)]
    fresh = torch.randn(len(rows), E, generator=torch.Generator().manual_seed(99))
    fresh = (fresh / cpu[4]).to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else fresh.bfloat16()
    flat = cache.view(torch.uint8).flatten(0, 1)
    src = fresh.view(torch.uint8).reshape(len(rows), -1).cuda()
    idx = torch.tensor(rows, dtype=torch.int32, device="cuda")
    from late_insert import late_insert_kernel

    late = late_insert_kernel(len(rows), flat.shape[1], 200_000)
    late(src, flat, idx)  # loaded; the cache now holds the fresh rows
    expect = reference((cpu[0], cache.cpu(), *cpu[2:]))
    flat[idx.long()] = src.flip(0).roll(1, 1)  # stale bytes where the inserts go
    late(src, flat, idx)
    out = run(gpu)
    assert torch.equal(flat[idx.long()], src)
    assert rel_err(out, expect) <= TOL, rel_err(out, expect)
