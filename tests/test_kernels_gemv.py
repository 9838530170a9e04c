"""The skinny ``gemv`` kernel and its two templates: ``latent_tail`` (``k3f::latent_tail``) and
``o_proj_all_reduce_attn_res`` (``k3f::o_proj_attn_res``); the router's op (``k3f::router_down``),
on its generated kernels, where a call goes through ``bind``.

Three layers, like the other kernels: specs, refusals and the launchers' plumbing (with
stand-in kernels that check what the compiled ones check) from CPU tensors (everywhere); the
kernel compiled for sm_90a and sm_100a with its PTX checked (needs CuTe DSL); the kernels run
on a GPU against the ``k3f::`` CPU references (marked ``gpu``, skipped without CUDA).
On the GPU machine: ``python -m pytest -q tests/test_kernels_gemv.py`` (or ``-m gpu``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import patterns.moe
import patterns.output_projection
import patterns.router  # with the two above: defines the k3f ops used here
import rewriter.model.ops
from codegen import bind
from codegen.cache import KernelCache
from codegen.kernels import source_files
from codegen.launchers.gemv_specs import gemv_spec, skinny_gemv_tiling, token_chunk
from codegen.launchers.latent_tail import LATENT_GEMM_MIN_TOKENS
from codegen.launchers.o_proj import O_PROJ_GEMM_MIN_TOKENS, project
from codegen.templates import spec_for_call, template
from conftest import gpu_arch, hand_written_refusal, needs_cutedsl, on_gpu, rel_err
from rewriter.model.layers.attn_res import attn_res
from rewriter.model.layers.common import rms_norm

D, E, L = 7168, 896, 3584  # Kimi K3: hidden, routed experts, MoE latent
EPS = 1e-5
O_IN = {32: 384, 16: 768, 8: 1536}  # o_proj input width per rank
TOKENS = (1, 2, 5, 8, 13, 64)
TOL, LOGIT_TOL = 1e-2, 1e-4  # bf16 results; the router's fp32 logits
ARCHS = ("sm_90a", "sm_100a")
GROUP = "tp"


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def tail_args(tokens=1, tp=16, make=meta, rank=0, pieces=None):
    """``pieces``: how many the up projection's rows are split in (the TP size unless given)."""
    return (make(tokens, L), make(tokens, D), make(L), make(D, L), L, D, GROUP, tp, EPS, rank,
            tp if pieces is None else pieces)


def o_proj_args(tokens=1, tp=16, prefix=True, num_blocks=2, make=meta):
    return (make(tokens, O_IN[tp]), make(D, O_IN[tp]), make(tokens, D) if prefix else None, make(tokens, 8, D),
            make(D), make(D), make(D), GROUP, tp, num_blocks, EPS)


def specs_of(op, args, arch="sm_90a"):
    tpl, specs = spec_for_call(op, arch, args)
    assert tpl is not None, specs
    return tpl, specs


# ---------------------------------------------------------------- specs and refusals (no CuTe DSL needed)

def test_registered():
    assert template("router_down") is None  # the generated kernels serve it (tests/test_products_gpu.py)
    assert template("latent_tail").ops == ("k3f::latent_tail",)
    assert template("o_proj_all_reduce_attn_res").ops == ("k3f::o_proj_attn_res",)
    assert all(p.is_file() for p in source_files("gemv"))


def test_token_chunks_and_tiling():
    # chunks of at most 8 tokens, as equal as possible
    assert [token_chunk(t) for t in (1, 5, 8, 9, 13, 16, 17, 64)] == [1, 5, 8, 5, 7, 8, 6, 8]
    # K slices so that a lane holds <= 8 vectors per row and ~1024 warps stream
    assert skinny_gemv_tiling(1, D, 280) == {"rows_per_warp": 1, "warps_per_cta": 4, "ksplit": 4}
    assert skinny_gemv_tiling(8, D, 560) == {"rows_per_warp": 1, "warps_per_cta": 4, "ksplit": 4}
    assert skinny_gemv_tiling(8, D, 4480) == {"rows_per_warp": 2, "warps_per_cta": 4, "ksplit": 4}
    assert skinny_gemv_tiling(8, L, D, norm=True) == {"rows_per_warp": 2, "warps_per_cta": 8, "ksplit": 2}
    assert skinny_gemv_tiling(1, 768, D) == {"rows_per_warp": 1, "warps_per_cta": 4, "ksplit": 1}
    assert skinny_gemv_tiling(5, 1536, D) == {"rows_per_warp": 2, "warps_per_cta": 4, "ksplit": 1}
    assert skinny_gemv_tiling(1, D, 100)["ksplit"] == 7  # few rows: more K slices
    assert "vectors per lane" in skinny_gemv_tiling(1, 256 * 17 * 2, 4096)  # no slice of <= 16 vectors


@pytest.mark.parametrize("tokens", TOKENS)
def test_latent_tail_spec(tokens):
    _, (spec,) = specs_of("k3f::latent_tail", tail_args(tokens, tp=16))
    p = spec.param_dict
    rows = D // 16  # this rank's share of the up projection's rows
    if tokens < LATENT_GEMM_MIN_TOKENS:
        assert spec.kernel == "gemv" and spec.shape_dict == {"tokens": tokens, "k": L, "rows": rows}
        assert p["norm"] and p["eps"] == EPS
    else:  # the tensor-core GEMM with the norm prologue and the residual epilogue
        assert spec.kernel == "latent_tail_gemm"
        assert spec.shape_dict == {"token_tile": -(-tokens // 16) * 16, "k": L, "rows": rows}
        assert p["norm_eps"] == EPS and p["rows_out"] == rows
    # at TP > 1 the kernel reads views of the all-reduced [routed | shared]: row stride L + D
    assert p["residual"] and p["x_stride"] == p["r_stride"] == L + D
    assert spec == specs_of("k3f::latent_tail", tail_args(tokens, tp=16, rank=15))[1][0]  # one kernel for every rank
    (tp8,) = specs_of("k3f::latent_tail", tail_args(tokens, tp=8))[1]
    assert tp8.shape_dict["rows"] == D // 8
    (tp1,) = specs_of("k3f::latent_tail", tail_args(tokens, tp=1))[1]
    assert tp1.param_dict["x_stride"] == L and tp1.param_dict["r_stride"] == D
    # TP 12 does not divide the rows: all of them on every rank, read from the all-reduced views
    (whole,) = specs_of("k3f::latent_tail", tail_args(tokens, tp=12, rank=0, pieces=1))[1]
    assert whole.shape_dict["rows"] == D
    assert whole.param_dict["x_stride"] == whole.param_dict["r_stride"] == L + D


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("prefix", [True, False])
def test_o_proj_specs(tp, prefix):
    few = O_PROJ_GEMM_MIN_TOKENS - 1
    _, (gemv, res) = specs_of("k3f::o_proj_attn_res", o_proj_args(few, tp, prefix, num_blocks=3))
    assert gemv.kernel == "gemv" and gemv.shape_dict == {"tokens": few, "k": O_IN[tp], "rows": D}
    assert gemv.dtype_dict["out"] == "bf16" and gemv.param_dict["ksplit"] == 1
    # from O_PROJ_GEMM_MIN_TOKENS on the tensor-core GEMM, writing all D rows
    _, (gemm, res_many) = specs_of("k3f::o_proj_attn_res", o_proj_args(few + 1, tp, prefix, num_blocks=3))
    assert gemm.kernel == "o_proj_gemm" and gemm.shape_dict == {"token_tile": 16, "k": O_IN[tp], "rows": D}
    assert gemm.param_dict["rows_out"] == D and res_many.param_dict == res.param_dict
    assert res.kernel == "attn_res_norm" and res.op == "k3f::o_proj_attn_res"
    # a given prefix gets attn as its delta; without one attn is the new block's prefix (no delta)
    assert res.param_dict == {"num_blocks": 3, "write_idx": -1, "has_delta": prefix, "eps": EPS,
                              "cluster": 8, "vectors": 1}


def test_o_proj_at_tp_32_takes_the_gemm_at_one_token():
    """TP 32's 384-wide rows are not whole 256-wide steps of the GEMV's warps: the GEMM takes the
    one-token step there; TP 16 and 8 keep the GEMV."""
    _, (proj, _) = specs_of("k3f::o_proj_attn_res", o_proj_args(1, 32))
    assert proj.kernel == "o_proj_gemm" and proj.shape_dict == {"token_tile": 16, "k": 384, "rows": D}
    assert [specs_of("k3f::o_proj_attn_res", o_proj_args(1, tp))[1][0].kernel for tp in (16, 8)] == ["gemv", "gemv"]


@pytest.mark.parametrize("op,args,reason", [
    ("k3f::latent_tail", tail_args(tokens=65), "65 tokens outside 1..64"),
    ("k3f::latent_tail", (*tail_args()[:2], meta(D), *tail_args()[3:]), f"norm_weight must be [{L}]"),
    ("k3f::latent_tail", (*tail_args()[:3], meta(D, L, dtype=torch.float16), *tail_args()[4:]),
     "up_weight is fp16"),
    ("k3f::latent_tail", (meta(2, 2 * L)[:, :L], *tail_args(2, tp=1)[1:]), "routed is not contiguous"),
    ("k3f::latent_tail", (meta(1, L, dtype=torch.float32), *tail_args()[1:]), "routed is fp32"),
    ("k3f::latent_tail", tail_args(rank=16), "piece 16 of 16 (TP 16)"),
    ("k3f::latent_tail", tail_args(tp=6), f"piece 0 of 6 (TP 6) over {D} up-projection rows"),
    ("k3f::latent_tail", tail_args(tp=6, pieces=2), "piece 0 of 2 (TP 6)"),
    ("k3f::latent_tail", tail_args(tp=6, rank=1, pieces=1), "piece 1 of 1 (TP 6)"),
    ("k3f::o_proj_attn_res", o_proj_args(tokens=65), "65 tokens outside 1..64"),
    ("k3f::o_proj_attn_res", (meta(1, 700), meta(D, 700), *o_proj_args()[2:]), "not a multiple of 256"),
    ("k3f::o_proj_attn_res", o_proj_args(num_blocks=9), "attn_res_norm stage: num_blocks 9"),
    ("k3f::o_proj_attn_res", (meta(1, 768), meta(D, 768, dtype=torch.float32), *o_proj_args()[2:]),
     "weight is fp32"),
])
def test_refusals(op, args, reason):
    """Every hand-written template refuses, naming the reason (a kernel generated from the op's
    reference may still take the call)."""
    why = hand_written_refusal(op, args)
    assert reason in why, why


# ---------------------------------------------------------------- the launchers' plumbing, on the CPU

def stand_in_gemv(spec):
    """The ``gemv`` kernel in torch, checking the shapes and strides the compiled one checks."""
    s, p = spec.shape_dict, spec.param_dict
    t, k, n = s["tokens"], s["k"], s["rows"]

    def fn(x, w, norm_w, r, y):
        assert x.shape == (t, k) and x.stride() == (p["x_stride"], 1)
        assert w.shape == (n, k) and w.is_contiguous() and y.shape == (t, n) and y.is_contiguous()
        assert y.dtype == torch.bfloat16 and (norm_w is None) != p["norm"] and (r is None) != p["residual"]
        if p["residual"]:
            assert r.shape == (t, n) and r.stride() == (p["r_stride"], 1)
        xn = rms_norm(x, norm_w, p["eps"]) if p["norm"] else x
        acc = xn.float() @ w.float().t()
        if p["residual"]:
            acc = acc.to(torch.bfloat16) + r
        y.copy_(acc)
    return fn


def stand_in_attn_res(spec):
    def fn(prefix, delta, blocks, norm_w, qk_w, out_w, x, new_prefix):
        assert (delta is not None) == spec.param_dict["has_delta"] and blocks.shape[1:] == (8, D)
        mix, p, _ = attn_res(prefix, delta, blocks, norm_w, qk_w, out_w, spec.param_dict["num_blocks"], -1, EPS, EPS)
        x.copy_(mix)
        new_prefix.copy_(p)
    return fn


def stand_in_gemm(spec):
    """The skinny ``gemm`` kernel in torch, with its shape, stride and dtype
    checks."""
    s, p = spec.shape_dict, spec.param_dict

    def fn(x, w, y, norm_w, r):
        assert x.shape[1] == s["k"] and x.shape[0] <= s["token_tile"] and x.stride() == (p.get("x_stride", s["k"]), 1)
        assert w.shape == (s["rows"], s["k"]) and y.shape == (x.shape[0], p["rows_out"])
        assert (norm_w is not None) == ("norm_eps" in p) and (r is not None) == p.get("residual", False)
        xn = rms_norm(x, norm_w, p["norm_eps"]) if norm_w is not None else x
        acc = torch.nn.functional.linear(xn.float(), w.float())
        if r is not None:
            assert r.stride() == (p["r_stride"], 1)
            acc = acc.to(torch.bfloat16) + r
        y.copy_(acc)
    return fn


def stand_ins(specs):
    makers = {"gemv": stand_in_gemv, "o_proj_gemm": stand_in_gemm, "latent_tail_gemm": stand_in_gemm,
              "attn_res_norm": stand_in_attn_res}
    return tuple(makers[s.kernel](s) for s in specs)


def rnd(*shape, gen, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(torch.bfloat16)


def router_inputs(tokens, gen):
    return rnd(tokens, D, gen=gen), rnd(E, D, gen=gen, scale=0.02), rnd(L, D, gen=gen, scale=0.02)


def tail_inputs(tokens, gen):
    return (rnd(tokens, L, gen=gen), rnd(tokens, D, gen=gen), rnd(L, gen=gen, scale=0.1, shift=1.0),
            rnd(D, L, gen=gen, scale=0.02))


def o_proj_inputs(tokens, tp, prefix, gen):
    """o, weight, prefix, blocks and the three AttnRes weights (the delta keeps the scale of the prefix)."""
    return (rnd(tokens, O_IN[tp], gen=gen), rnd(D, O_IN[tp], gen=gen, scale=0.05),
            rnd(tokens, D, gen=gen) if prefix else None, rnd(tokens, 8, D, gen=gen),
            rnd(D, gen=gen, scale=0.1, shift=1.0), rnd(D, gen=gen, scale=0.02), rnd(D, gen=gen, scale=0.1, shift=1.0))


@pytest.fixture
def fake_collectives(monkeypatch):
    """TP > 1 on one process: the all-reduce doubles (as if a second rank held the same partial),
    the gather repeats this rank's part (``patterns.router`` holds its own reference to it)."""
    def gather(x, group, world_size):
        return x if world_size == 1 else torch.cat([x] * world_size, dim=-1)

    monkeypatch.setattr(torch.ops.k3, "all_reduce", lambda x, group, world_size: x * world_size)
    monkeypatch.setattr(rewriter.model.ops, "gather_last_dim", gather)
    monkeypatch.setattr(patterns.router, "gather_last_dim", gather)


@pytest.mark.parametrize("tp,rank,pieces", [(1, 0, 1), (16, 5, 16), (12, 0, 1)])
@pytest.mark.parametrize("tokens", [1, 13])
def test_latent_tail_launch_plumbing(fake_collectives, tp, rank, pieces, tokens):
    gen = torch.Generator().manual_seed(tp)
    args = (*tail_inputs(tokens, gen), L, D, GROUP, tp, EPS, rank, pieces)
    tpl, specs = specs_of("k3f::latent_tail", args)
    assert tpl.runtime_check(args) is None
    y = tpl.launch(stand_ins(specs), specs, args)
    assert rel_err(y, torch.ops.k3f.latent_tail(*args)) <= TOL


@pytest.mark.parametrize("tp", [2, 8])
def test_latent_tail_rank_shares_gather_to_the_unsharded_tail(monkeypatch, tp):
    """Each rank's share (the gather mocked as the identity) is its slice of the replicated
    reference tail; in rank order they are the whole of it."""
    from rewriter.model.layers.moe import latent_tail

    monkeypatch.setattr(rewriter.model.ops, "gather_last_dim", lambda x, group, world_size: x)
    monkeypatch.setattr(torch.ops.k3, "all_reduce", lambda x, group, world_size: x.clone())
    gen = torch.Generator().manual_seed(tp)
    inputs = tail_inputs(3, gen)
    whole = latent_tail(*inputs, latent=L, hidden=D, group=GROUP, tp=tp, eps=EPS)
    shares = [torch.ops.k3f.latent_tail(*inputs, L, D, GROUP, tp, EPS, r, tp) for r in range(tp)]
    assert all(s.shape == (3, D // tp) for s in shares)
    assert rel_err(torch.cat(shares, dim=-1), whole) <= 1e-6
    # one piece (a TP size that does not divide the rows): every rank the whole tail
    assert rel_err(torch.ops.k3f.latent_tail(*inputs, L, D, GROUP, tp, EPS, 0, 1), whole) <= 1e-6


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("tokens", [2, 5])
def test_o_proj_launch_plumbing(fake_collectives, tp, prefix, tokens):
    gen = torch.Generator().manual_seed(tp + prefix)
    o, w, p, blocks, nw, qw, ow = o_proj_inputs(tokens, tp, prefix, gen)
    args = (o, w, p, blocks, nw, qw, ow, GROUP, tp, 2, EPS)
    tpl, specs = specs_of("k3f::o_proj_attn_res", args)
    assert tpl.runtime_check(args) is None
    x, new_prefix = tpl.launch(stand_ins(specs), specs, args)
    ref_x, ref_prefix = torch.ops.k3f.o_proj_attn_res(*args)
    assert rel_err(x, ref_x) <= TOL and rel_err(new_prefix, ref_prefix) <= TOL


# ---------------------------------------------------------------- compile-only (CuTe DSL)

@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The latent tail's GEMV (TP 16, 13 tokens: 2 chunks of 7, one padded slot; the template
    gives it one token, the kernel takes up to 64) and GEMM (13 tokens), and o_proj (TP 16, 1
    token, both stages; 64 tokens at TP 8: its GEMM), for sm_90a and sm_100a."""
    from codegen.compiler import clear_memory_cache, compile_kernel

    cache = KernelCache(tmp_path_factory.mktemp("gemv-kernel-cache"))
    clear_memory_cache()
    out = {}
    for arch in ARCHS:
        for name, op, args in (("tail_gemm", "k3f::latent_tail", tail_args(13, 16)),
                               ("o_proj", "k3f::o_proj_attn_res", o_proj_args(1, 16, prefix=False)),
                               ("o_proj_gemm", "k3f::o_proj_attn_res", o_proj_args(64, 8, prefix=True))):
            _, specs = specs_of(op, args, arch)
            out[name, arch] = [compile_kernel(s, cache=cache) for s in specs]
        tail_gemv = gemv_spec("k3f::latent_tail", arch, tokens=13, k=L, rows=D, x_stride=L + D,
                              norm=True, eps=EPS, residual=True, r_stride=L + D)
        out["tail", arch] = [compile_kernel(tail_gemv, cache=cache)]
    return out


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


STREAM = "ld.global.L1::no_allocate.L2::256B.v4.b32"


def _common_ptx(k, arch):
    ptx = k.ptx
    assert f".target {arch}" in ptx and k.obj and k.cache == "miss"
    assert "ld.local" not in ptx and "st.local" not in ptx  # accumulators and weights stay in registers
    assert "ld.global.b32" not in ptx and "ld.global.nc.b16" not in ptx  # no scalar x / W loads
    _check_pdl(ptx)
    return ptx


def _check_pdl(ptx: str):
    """Programmatic dependent launch: one wait, then one trigger; before the wait the weight
    loads (all of them: they are issued up front) and no other global access, no store. Between
    the two only a one-chunk GEMV's x loads, plain (``ld.global.v4``: ptxas would hoist
    ``ld.global.nc`` above the wait), which ptxas then issues together. (The launch attribute
    itself is host code, not in the PTX.)"""
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait", 1)
    gap = after.split("griddepcontrol.launch_dependents", 1)[0]
    assert "st." not in gap and "ld.global.nc" not in gap and "bar." not in gap
    assert _count(gap, "ld.global") == _count(gap, "ld.global.v4.b32")
    assert _count(before, STREAM) >= 1 and _count(after, STREAM) == 0
    assert _count(before, "ld.global") == _count(before, STREAM)  # x, norm weight, residual: after the wait
    assert _count(before, "st.") == 0 and _count(before, "bar.sync") == 0


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
def test_latent_tail_ptx(compiled, arch):
    (k,) = compiled["tail", arch]
    ptx, p = _common_ptx(k, arch), k.spec.param_dict
    tc, r = p["chunk"], p["rows_per_warp"]
    s = L // 256 // p["ksplit"]
    per_thread = -(-(L // 8) // (32 * p["warps_per_cta"]))  # x vectors per thread in the norm prologue
    assert (tc, r, p["ksplit"]) == (7, 2, 2)
    # W and the norm weight (its own vectors of each thread) streamed once, before the wait
    assert _count(ptx, STREAM) == r * s + per_thread
    assert _count(ptx.split("griddepcontrol.wait", 1)[0], STREAM) == r * s + per_thread
    assert _count(ptx, "ld.global.nc.v4.b32") == tc * per_thread  # x once
    # the residuals a lane adds are read with x, before the norm's first barrier, not after the sums
    first_bar = ptx.index("bar.sync")
    assert _count(ptx[:first_bar], "ld.global.b16") == r * tc
    assert _count(ptx[:first_bar], "ld.global.nc.v4.b32") == tc * per_thread
    assert _count(ptx, "st.shared.v4.b32") == 2 * tc * per_thread  # x staged, then normalized in place
    assert _count(ptx, "ld.shared.v4.b32") >= tc * per_thread + tc * s  # normalize + the GEMV's x
    assert _count(ptx, "rsqrt.approx") == tc
    assert _count(ptx, "shfl.sync.bfly.b32") == 5 * (tc + r * tc)  # norm sums + (row, token) sums
    assert _count(ptx, "bar.sync") == 4  # norm sums, x_n staged, K slices, chunk end
    assert _count(ptx, "ld.global.b16") == r * tc and _count(ptx, "st.global.b16") == r * tc  # residual, y
    assert _count(ptx, "fma.rn.f32") >= 8 * s * tc * r


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
def test_o_proj_ptx(compiled, arch):
    gemv, res = compiled["o_proj", arch]
    ptx = _common_ptx(gemv, arch)
    s = O_IN[16] // 256
    assert _count(ptx, STREAM) == s and _count(ptx, "ld.global.v4.b32") == s  # x before the trigger
    assert _count(ptx, "shfl.sync.bfly.b32") == 5 and _count(ptx, "st.global.b16") == 1
    assert "bar.sync" not in ptx and "ld.shared" not in ptx and "st.shared" not in ptx  # one warp per row
    assert res.spec.kernel == "attn_res_norm" and f".target {arch}" in res.ptx


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
def test_latent_tail_gemm_ptx(compiled, arch):
    """The latent tail on tensor cores: mma.sync over cp.async tiles, the norm prologue's rsqrt
    and bf16 multiplies in shared memory, the cluster's sums of squares read through DSMEM."""
    (k,) = compiled["tail_gemm", arch]
    assert k.spec.kernel == "latent_tail_gemm" and f".target {arch}" in k.ptx
    assert "mma.sync.aligned.m16n8k16" in k.ptx and "cp.async.cg.shared.global" in k.ptx
    assert "rsqrt.approx" in k.ptx and "mapa.shared::cluster" in k.ptx
    assert "ld.local" not in k.ptx and "st.local" not in k.ptx
    # the residuals a thread adds (4 rows of each of its 4-row groups) are read right after the
    # wait, before the K loop's first MMA, not after the cluster's sums
    after = k.ptx.split("griddepcontrol.wait;")[1]
    first_mma = after.index("mma.sync")
    assert _count(after, "ld.global.b16") == _count(after[:first_mma], "ld.global.b16") > 0
    assert _count(after, "ld.global.b16") % 4 == 0


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
def test_o_proj_gemm_ptx(compiled, arch):
    """The projection on tensor cores at 64 tokens: mma.sync, cp.async, no spills to local memory."""
    gemm, res = compiled["o_proj_gemm", arch]
    assert gemm.spec.kernel == "o_proj_gemm" and f".target {arch}" in gemm.ptx
    assert "mma.sync.aligned.m16n8k16" in gemm.ptx and "cp.async.cg.shared.global" in gemm.ptx
    assert "ld.local" not in gemm.ptx and "st.local" not in gemm.ptx
    assert res.spec.kernel == "attn_res_norm"


@needs_cutedsl
def test_launch_asks_for_pdl(tmp_path):
    """The host side of programmatic dependent launch, which the PTX cannot show: CuTe DSL's IR
    of the launch (dumped by a fresh process, as ``CUTE_DSL_KEEP`` is read at import) sets the
    launch's programmatic stream serialization flag."""
    _, (spec, _) = specs_of("k3f::o_proj_attn_res", o_proj_args(1, 16, prefix=False))
    code = ("import json, sys\nfrom codegen.cache import KernelCache\nfrom codegen.compiler import compile_kernel\n"
            "from codegen.spec import KernelSpec\ns = json.loads(sys.argv[1])\n"
            "compile_kernel(KernelSpec.from_json(s), cache=KernelCache(sys.argv[2]))")
    env = dict(os.environ, CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=str(tmp_path / "ir"))
    subprocess.run([sys.executable, "-c", code, json.dumps(spec.to_json()), str(tmp_path / "cache")],
                   cwd=Path(__file__).resolve().parents[1], env=env, check=True, capture_output=True)
    ir = "".join(p.read_text() for p in (tmp_path / "ir").glob("*.mlir"))
    assert re.search(r"programmatic_stream_serialization_allowed\[%\w+\] %c1_i32", ir)


# ---------------------------------------------------------------- on the GPU


def compiled_fns(op, args):
    from codegen.compiler import compile_kernel

    tpl, specs = specs_of(op, args, gpu_arch())
    return tpl, specs, tuple(compile_kernel(s).load() for s in specs)


def cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def nan(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@on_gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("tp,rank,pieces", [(1, 0, 1), (16, 11, 16), (12, 0, 1)])
def test_latent_tail_gpu(monkeypatch, tokens, tp, rank, pieces):
    """tp 1: routed and shared read in place; tp 16 and 12 (the all-reduce and the gather mocked
    as the identity, on both sides): the kernel reads row-strided views of the reduced [routed |
    shared] and writes rank 11's share of the hidden rows (TP 16) or all of them (TP 12, whose
    size does not divide them)."""
    if tp > 1:
        monkeypatch.setattr(torch.ops.k3, "all_reduce", lambda x, group, world_size: x.clone())
        monkeypatch.setattr(rewriter.model.ops, "gather_last_dim", lambda x, group, world_size: x)
    gen = torch.Generator().manual_seed(10 * tokens + tp)
    args = (*tail_inputs(tokens, gen), L, D, GROUP, tp, EPS, rank, pieces)
    ref = torch.ops.k3f.latent_tail(*args)
    gpu = cuda(args)
    tpl, specs, fns = compiled_fns("k3f::latent_tail", gpu)
    assert tpl.runtime_check(gpu) is None
    y = tpl.launch(fns, specs, gpu, out=nan(tokens, D // pieces))
    torch.cuda.synchronize()
    assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL


@on_gpu
@pytest.mark.parametrize("tokens,tp", [(t, tp) for tp in (16, 8) for t in TOKENS] + [(1, 32)])
def test_o_proj_attn_res_gpu(tokens, tp):
    """TP 16 / 8 shapes on one GPU (tp = 1: no all-reduce), and TP 32's at one token (the GEMM);
    prefix given or not by token count."""
    prefix = tokens % 2 == 1
    gen = torch.Generator().manual_seed(100 * tokens + tp)
    o, w, p, blocks, nw, qw, ow = o_proj_inputs(tokens, tp, prefix, gen)
    args = (o, w, p, blocks, nw, qw, ow, GROUP, 1, 3, EPS)
    ref_x, ref_prefix = torch.ops.k3f.o_proj_attn_res(*args)
    gpu = cuda(args)
    tpl, specs, fns = compiled_fns("k3f::o_proj_attn_res", gpu)
    assert tpl.runtime_check(gpu) is None
    assert specs[0].kernel == ("o_proj_gemm" if tokens >= O_PROJ_GEMM_MIN_TOKENS or tp == 32 else "gemv")
    # the projection stage alone (its output is the launcher's intermediate)
    attn = nan(tokens, D)
    project(fns[0], specs[0], gpu[0], gpu[1], attn)
    torch.cuda.synchronize()
    assert torch.isfinite(attn).all() and rel_err(attn, torch.nn.functional.linear(o, w)) <= TOL
    x, new_prefix = tpl.launch(fns, specs, gpu, out=(nan(tokens, D), nan(tokens, D)))
    torch.cuda.synchronize()
    assert torch.isfinite(x).all() and torch.isfinite(new_prefix).all()
    assert rel_err(x, ref_x) <= TOL and rel_err(new_prefix, ref_prefix) <= TOL
    assert torch.equal(gpu[3].cpu(), blocks)  # no block write


@on_gpu
def test_ops_dispatch_to_the_kernels_and_capture_in_a_cuda_graph():
    bind.install_cuda_kernels()
    gen = torch.Generator().manual_seed(5)
    calls = {
        "router_down": (*router_inputs(5, gen), GROUP, 1, 0),
        "latent_tail": (*tail_inputs(5, gen), L, D, GROUP, 1, EPS, 0, 1),
        "o_proj_attn_res": (*o_proj_inputs(5, 16, True, gen), GROUP, 1, 2, EPS),
    }
    for name, args in calls.items():
        op = getattr(torch.ops.k3f, name)
        refs = op(*args)
        refs = refs if isinstance(refs, tuple) else (refs,)
        gpu = cuda(args)
        before = bind.stats().get(f"k3f::{name}", {}).get("kernel", 0)
        op(*gpu)  # compiles and loads outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = op(*gpu)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for y in outs:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert bind.stats()[f"k3f::{name}"]["kernel"] == before + 2, bind.stats()[f"k3f::{name}"]
        tol = [LOGIT_TOL, TOL] if name == "router_down" else [TOL] * len(refs)
        for y, ref, t in zip(outs, refs, tol):
            assert y.shape == ref.shape and torch.isfinite(y).all() and rel_err(y, ref) <= t, name
