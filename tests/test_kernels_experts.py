"""The MoE experts' templates and kernels: ``routed_experts_grouped`` (``k3f::routed_experts``)
and ``shared_experts`` (``k3f::shared_experts``), each two kernels (``expert_up``,
``expert_down``).

1. specs from meta tensors at Kimi K3's TP 16 and TP 8 shapes, and refusals (no CuTe DSL);
2. compiles for sm_90a and sm_100a and PTX checks (skipped without CuTe DSL);
3. on a GPU (marked ``gpu``): fresh random inputs, outputs and the activation scratch filled
   with NaN first, against the ops' CPU references (bf16 relative error <= 1e-2), and the ops
   dispatched through ``install_cuda_kernels`` inside a CUDA graph.
   Run on the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_experts.py``.
"""
from __future__ import annotations

import re

import pytest
import torch

import patterns.attn_res
import patterns.dense_mlp
import patterns.input_projection
import patterns.kda
import patterns.mla
import patterns.moe
import patterns.output_projection
import patterns.router  # noqa: F401  (defines the k3f ops used here)
from codegen import bind
from codegen.kernels import source_files
from codegen.templates import TEMPLATES, spec_for_call, template
from conftest import gpu_kernels, hand_written_refusal, needs_cutedsl, on_gpu, rel_err
from rewriter.model.config import KimiK3Config
from rewriter.model.layers.moe import experts_up, shared_experts_up

ARCHS = ("sm_90a", "sm_100a")
TOL = 1e-2

K3 = KimiK3Config.preset("kimi-k3")
E, K, L, H = K3.num_experts, K3.num_experts_per_token, K3.moe_hidden_size, K3.hidden_size  # 896, 16, 3584, 7168
BETA, LINEAR_BETA = K3.activation_situ_beta, K3.activation_situ_linear_beta  # 4.0, 25.0
SHAPES = {f"tp{tp}": (K3.shard(tp).expert_intermediate, K3.shard(tp).shared_intermediate) for tp in (16, 8)}
ROUTED, SHARED = "k3f::routed_experts", "k3f::shared_experts"


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def routed_args(tokens=1, inter=256, experts=E, top_k=K, latent=L, beta=BETA, linear_beta=LINEAR_BETA, **dtypes):
    return (meta(tokens, latent, dtype=dtypes.get("x", torch.bfloat16)),
            meta(tokens, top_k, dtype=dtypes.get("weights", torch.float32)),
            meta(tokens, top_k, dtype=dtypes.get("ids", torch.int64)),
            meta(experts, 2 * inter, latent), meta(experts, latent, inter), beta, linear_beta)


def shared_args(tokens=1, inter=384, hidden=H, beta=BETA, linear_beta=LINEAR_BETA):
    return meta(tokens, hidden), meta(2 * inter, hidden), meta(hidden, inter), beta, linear_beta


def specs_of(op, arch, args):
    tpl, specs = spec_for_call(op, arch, args)
    assert tpl is not None, specs
    return specs


def gemv_specs_of(arch, args):
    """The shared experts' GEMV template by name (the rules give it one token; it takes 1..64)."""
    specs = template("shared_experts").make_specs(SHARED, arch, args)
    assert not isinstance(specs, str), specs
    return specs


# ---------------------------------------------------------------- specs and refusals (no CuTe DSL needed)

def test_one_module_serves_both_templates():
    routed, shared = template("routed_experts_grouped"), template("shared_experts")
    shared_gemm = template("shared_experts_gemm")
    assert routed.ops == (ROUTED,) and shared.ops == shared_gemm.ops == (SHARED,)
    assert TEMPLATES["routed_experts_grouped"] is routed
    for name in ("expert_up", "expert_down"):
        assert all(p.is_file() for p in source_files(name))
    # the schedule names the fused ops' kernels the way the templates do
    kernels = {r.name: r.kernel_name for r in patterns.moe.RULES}
    assert kernels["routed_experts"] == routed.kernel and kernels["shared_experts.small"] == shared.kernel
    assert kernels["shared_experts.large"] == shared_gemm.kernel


@pytest.mark.parametrize("shape", list(SHAPES))
def test_routed_specs_at_kimi_k3_shapes(shape):
    inter, _ = SHAPES[shape]
    up, down = specs_of(ROUTED, "sm_90a", routed_args(tokens=1, inter=inter))
    assert (up.kernel, down.kernel) == ("expert_up", "expert_down") and up.op == down.op == ROUTED
    assert up.shape_dict == {"experts": E, "top_k": K, "latent": L, "inter": inter}
    assert down.shape_dict == {"experts": E, "top_k": K, "rows": L, "inter": inter}
    p = up.param_dict
    assert p["routed"] and p["beta"] == 4.0 and p["linear_beta"] == 25.0 and p["chunk"] == 1
    # 2 channels x 2 slices of L per CTA: a lane holds 7 of L's 14 vectors per row, all 14 loads in flight
    assert p["warps_per_cta"] == 4 and p["k_slices"] == 2
    d = down.param_dict
    assert d["lanes_per_row"] == 8
    # the fewest slot warps that leave a lane <= 16 weight loads, all of a warp's experts in one step
    assert (d["slot_warps"], d["slots_per_step"]) == {256: (4, 4), 384: (8, 2)}[inter]
    # the token count is a runtime size: one compile serves 1..64 tokens
    for t in (3, 8, 64):
        assert specs_of(ROUTED, "sm_90a", routed_args(tokens=t, inter=inter)) == (up, down)
    assert specs_of(ROUTED, "sm_100a", routed_args(inter=inter))[0] == up.with_arch("sm_100a")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shared_specs_at_kimi_k3_shapes(shape):
    _, inter = SHAPES[shape]
    for t, chunk in ((1, 1), (3, 3), (8, 8), (64, 8)):
        up, down = gemv_specs_of("sm_90a", shared_args(tokens=t, inter=inter))
        assert (up.kernel, down.kernel) == ("expert_up", "expert_down") and up.op == SHARED
        assert up.shape_dict == {"experts": 1, "top_k": 1, "latent": H, "inter": inter, "tokens": t}
        assert down.shape_dict == {"experts": 1, "top_k": 1, "rows": H, "inter": inter, "tokens": t}
        assert not up.param_dict["routed"] and up.param_dict["chunk"] == down.param_dict["chunk"] == chunk
        # one channel per CTA, H over 4 warps: 7 of H's 28 vectors per lane and row, held in registers
        assert up.param_dict["k_slices"] == up.param_dict["warps_per_cta"] == 4
    silu = specs_of(SHARED, "sm_90a", shared_args(beta=None, linear_beta=25.0))[0]
    assert silu.param_dict["beta"] is None and silu.param_dict["linear_beta"] is None
    # from 2 tokens the skinny GEMM (the dense MLP's path): gate/up + SiTU, then down
    for t in (2, 8, 64):
        up, down = specs_of(SHARED, "sm_90a", shared_args(tokens=t, inter=inter))
        assert (up.kernel, down.kernel) == ("mlp_gate_up_gemm", "mlp_down_gemm") and up.op == SHARED
        assert up.shape_dict == {"token_tile": -(-t // 16) * 16, "k": H, "rows": 2 * inter}
        assert up.param_dict["glu"] and (up.param_dict["beta"], up.param_dict["linear_beta"]) == (BETA, LINEAR_BETA)
        assert down.shape_dict == {"token_tile": -(-t // 16) * 16, "k": inter, "rows": H}


def test_tiling_at_a_small_shape():
    """E = 16, k = 4, L = H = 512, I = 128 (the GPU test's SiLU case): one slice of L (2
    vectors per lane), one slot warp of 4 experts x 2 vectors, one channel warp per CTA."""
    up, down = specs_of(ROUTED, "sm_90a", routed_args(tokens=5, inter=128, experts=16, top_k=4, latent=512))
    assert (up.param_dict["k_slices"], up.param_dict["warps_per_cta"]) == (1, 4)
    assert (down.param_dict["slot_warps"], down.param_dict["slots_per_step"]) == (1, 4)
    up, _ = gemv_specs_of("sm_90a", shared_args(tokens=5, inter=128, hidden=512))
    assert (up.param_dict["k_slices"], up.param_dict["warps_per_cta"], up.param_dict["chunk"]) == (1, 1, 5)


@pytest.mark.parametrize("op,args,reason", [
    (ROUTED, routed_args(tokens=65), "65 tokens outside 1..64"),
    (ROUTED, routed_args(tokens=0), "0 tokens outside 1..64"),
    (ROUTED, routed_args(x=torch.float32), "x is fp32; the template is bf16 only"),
    (ROUTED, routed_args(weights=torch.bfloat16), "weights is bf16; the template is fp32 only"),
    (ROUTED, routed_args(ids=torch.int32), "ids is int32; the template is int64 only"),
    (ROUTED, routed_args(inter=200), "I 200 is not a multiple of 64"),
    (ROUTED, routed_args(latent=3500), "L 3500 is not a multiple of 256"),
    (ROUTED, routed_args(latent=17 * 256), "L 4352: its 17 vectors per lane do not split into at most 16 warps"),
    (ROUTED, routed_args(experts=8, top_k=16), "top_k 16 outside 1..8 experts"),
    (ROUTED, routed_args(beta="4"), "beta must be a float or None"),
    (ROUTED, routed_args()[:3] + (meta(E, 2 * 256, L), meta(E, 256, L)) + routed_args()[5:], "w2 must be"),
    (ROUTED, routed_args()[:3] + (meta(E, L, 512).transpose(1, 2),) + routed_args()[4:], "w13 is not contiguous"),
    (ROUTED, (meta(1, L), meta(2, K, dtype=torch.float32)) + routed_args()[2:], "weights must be [1, 16]"),
    (SHARED, shared_args(tokens=65), "65 tokens outside 1..64"),
    (SHARED, shared_args(inter=288), "I 288 is not a multiple of 64 (8 lanes x 8 per row, at least)"),
    (SHARED, shared_args(hidden=7000), "H 7000 is not a multiple of 256"),
    (SHARED, (meta(1, H), meta(768, H), meta(384, H)) + shared_args()[3:], "down_weight must be [7168, 384]"),
    (SHARED, (meta(1, H, dtype=torch.float16),) + shared_args()[1:], "x is fp16"),
])
def test_templates_refuse_with_a_reason(op, args, reason):
    why = hand_written_refusal(op, args)
    assert reason in why, why


def test_launcher_declines_cpu_tensors():
    launcher = bind.TemplateLauncher("shared_experts", arch="sm_90a")
    args = (torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(768, H, dtype=torch.bfloat16),
            torch.zeros(H, 384, dtype=torch.bfloat16), BETA, LINEAR_BETA)
    assert launcher(*args) is NotImplemented
    assert any("CUDA" in r for r in bind.stats()[SHARED])


# ---------------------------------------------------------------- compile-only (CuTe DSL)

COMPILED = {  # name: (op, args); the routed specs serve every token count
    "routed_tp16": (ROUTED, routed_args(inter=256)),
    "routed_tp8": (ROUTED, routed_args(inter=384)),
    "shared_tp16_1": (SHARED, shared_args(tokens=1, inter=384)),
    "shared_tp16_11": (SHARED, shared_args(tokens=11, inter=384)),  # a chunk of 8 and a tail of 3
    "shared_tp8_64": (SHARED, shared_args(tokens=64, inter=768)),
    # the GPU test's small SiLU shape: one slice of L, the activation stored by each warp
    "routed_small": (ROUTED, routed_args(inter=128, experts=16, top_k=4, latent=512, beta=None, linear_beta=None)),
    "shared_small_5": (SHARED, shared_args(tokens=5, inter=128, hidden=512, beta=None, linear_beta=None)),
}


@pytest.fixture(scope="module")
def compiled(kcache):
    """(name, arch) -> (up, down) compiled kernels, with the compile seconds. Each kernel's
    host launch is recorded as it compiles (``pdl``: the ``use_pdl`` flag of each launch)."""
    from cutlass.cutlass_dsl.cutlass import CutlassBaseDSL

    from codegen.compiler import clear_memory_cache, compile_kernel

    clear_memory_cache()
    launches = []
    launch = CutlassBaseDSL.cuda_launch_func

    def record(*args, use_pdl=False, **kwargs):
        launches.append(use_pdl)
        return launch(*args, use_pdl=use_pdl, **kwargs)

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CutlassBaseDSL, "cuda_launch_func", staticmethod(record))
        for arch in ARCHS:
            for name, (op, args) in COMPILED.items():  # the shared experts' GEMVs by name
                kernels = []
                for spec in (gemv_specs_of(arch, args) if op == SHARED else specs_of(op, arch, args)):
                    launches.clear()
                    k = compile_kernel(spec, cache=kcache)
                    assert k.cache == "miss"  # compiled here, so its launch was recorded
                    k.pdl = tuple(launches)
                    kernels.append(k)
                out[name, arch] = tuple(kernels)
    return out


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


STREAM = "ld.global.L1::no_allocate.L2::256B.v4.b32"  # weights: read once, no L1 line allocated
NC = "ld.global.nc.v4.b32"  # activations: read-only path, 128 bits
WAIT, LAUNCH = "griddepcontrol.wait;", "griddepcontrol.launch_dependents;"


def _common_ptx(k, arch):
    ptx = k.ptx
    assert f".target {arch}" in ptx and k.obj and k.compile_seconds < 30
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "ld.global.b16" not in ptx and "ld.global.nc.b16" not in ptx  # no scalar bf16 loads
    return ptx


def _pdl_phases(k) -> tuple[str, str, str]:
    """The kernel's PTX before griddepcontrol.wait, between it and launch_dependents, and
    after, checked against the PDL rules: launched with PDL, one wait and one
    launch_dependents per CTA (straight-line code up to both: every path passes them), no
    global store and no activation read before the wait."""
    assert k.pdl == (True,)  # one launch, with programmatic stream serialization
    ptx = k.ptx
    assert ptx.count(WAIT) == 1 and ptx.count(LAUNCH) == 1
    before, rest = ptx[ptx.index(".entry"):].split(WAIT)
    between, after = rest.split(LAUNCH)
    for code in (before, between):
        assert not re.search(r"\b(bra|ret|exit)\b", code)
    assert "st.global" not in before and NC not in before and "ld.global.b" not in before
    return before, between, after


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["routed_tp16", "routed_tp8"])
def test_routed_ptx(compiled, arch, name):
    up, down = compiled[name, arch]
    ptx, p = _common_ptx(up, arch), up.spec.param_dict
    vec = 3584 // 8 // 32 // p["k_slices"]  # vectors per lane of its slice of L (7): the K loop unrolled
    assert _count(ptx, STREAM) == 2 * vec  # the gate row and the up row of one channel
    assert _count(ptx, NC) == vec  # x, once per vector, shared by both rows
    assert _count(ptx, "fma.rn.f32") >= 2 * 8 * vec  # fp32 accumulation
    assert _count(ptx, "shfl.sync.bfly.b32") == 2 * 5  # the gate and the up sums over the warp
    assert _count(ptx, "st.global.b16") == 1 and _count(ptx, "ex2.approx") == 3  # sigmoid, two tanh
    assert _count(ptx, "bar.sync") == 1  # the 2 slices' sums meet in shared memory
    inter = up.spec.shape_dict["inter"]
    # the expert's offset in 64 bits: E x 2I x L is 2.47e9 elements at TP 8 (past int32)
    assert re.search(rf"mul\.wide\.[su]32\s+%rd\d+, %r\d+, {2 * inter * 3584};", ptx)
    # PDL: nothing before the wait (the rows depend on the ids); the id, then the whole
    # slice before launch_dependents; x only after it
    before, between, after = _pdl_phases(up)
    assert "ld.global" not in before
    assert _count(between, "ld.global.b32") == 1  # the id's low word (ids < 2^31)
    assert _count(between, STREAM) == 2 * vec and NC not in between and _count(after, NC) == vec

    ptx, d = _common_ptx(down, arch), down.spec.param_dict
    assert re.search(rf"mul\.wide\.[su]32\s+%rd\d+, %r\d+, {3584 * inter};", ptx)
    per_warp = 16 // d["slot_warps"]  # slots (experts) of one token per warp
    vec = inter // 8 // d["lanes_per_row"]  # vectors per lane of one w2 row
    assert _count(ptx, STREAM) == per_warp * vec and _count(ptx, NC) == per_warp * vec  # w2 rows, a rows
    assert _count(ptx, "fma.rn.f32") >= per_warp * 8 * vec
    assert _count(ptx, "shfl.sync.bfly.b32") == 3  # 8 lanes per row
    assert _count(ptx, "bar.sync") == 1 and _count(ptx, "st.shared.b32") == 1  # the slot warps' partial sums
    assert _count(ptx, "st.global.b16") == 1
    # PDL: the ids and routing weights after the wait, then the first step's experts (all of
    # them at these shapes) before launch_dependents, ``a`` only after it
    before, between, after = _pdl_phases(down)
    assert "ld.global" not in before
    assert _count(between, "ld.global.b32") == 2 * per_warp  # the ids' low words and the routing weights
    assert _count(between, STREAM) == d["slots_per_step"] * vec and NC not in between
    assert _count(after, NC) == per_warp * vec


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name,bodies", [("shared_tp16_1", (1,)), ("shared_tp16_11", (8, 3)),
                                         ("shared_tp8_64", (8,))])
def test_shared_ptx(compiled, arch, name, bodies):
    """``bodies``: the token counts of the chunk loop's bodies (full chunks, then the tail).
    Each lane loads its weights once, before the PDL wait, and keeps them for every chunk."""
    up, down = compiled[name, arch]
    ptx, p = _common_ptx(up, arch), up.spec.param_dict
    vec = 7168 // 8 // 32 // p["k_slices"]  # vectors per lane of its slice of H (7)
    assert _count(ptx, STREAM) == 2 * vec  # the gate and up rows of the slice, loaded once
    assert _count(ptx, NC) == vec * sum(bodies)  # x: every token's vectors
    assert _count(ptx, "shfl.sync.bfly.b32") == 2 * 5 * sum(bodies)
    # the 4 slices' sums meet in shared memory (one barrier); one thread per token finishes
    assert _count(ptx, "bar.sync") == 1
    assert _count(ptx, "st.global.b16") == 1 and _count(ptx, "ex2.approx") == 3
    before, between, after = _pdl_phases(up)
    assert _count(before, STREAM) == 2 * vec and "ld.global" not in between + after.replace(NC, "")

    ptx, d = _common_ptx(down, arch), down.spec.param_dict
    inter = down.spec.shape_dict["inter"]
    vec, rows = inter // 8 // d["lanes_per_row"], d["rows_per_lane"]
    assert _count(ptx, STREAM) == rows * vec  # each row vector loaded once, for every chunk
    assert _count(ptx, NC) == vec * sum(bodies)  # h: every token's vectors, shared by the rows
    assert _count(ptx, "shfl.sync.bfly.b32") == 4 * rows * sum(bodies)  # 16 lanes per row
    assert _count(ptx, "st.global.b16") == rows * sum(bodies) and _count(ptx, "bar.sync") == 0
    before, between, after = _pdl_phases(down)
    assert _count(before, STREAM) == rows * vec and "ld.global" not in between + after.replace(NC, "")


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name,tokens", [("routed_small", 1), ("shared_small_5", 5)])
def test_one_slice_ptx(compiled, arch, name, tokens):
    """L = 512 (2 vectors per lane): no slices to combine, each warp stores its channel's
    activation (SiLU: one ex2); the down projection keeps 4 experts x 2 vectors in flight."""
    up, down = compiled[name, arch]
    ptx = _common_ptx(up, arch)
    assert up.spec.param_dict["k_slices"] == 1 and _count(ptx, "bar.sync") == 0
    assert _count(ptx, STREAM) == 2 * 2 and _count(ptx, "ex2.approx") == 1
    assert _count(ptx, "st.global.b16") == 1 and _count(ptx, "shfl.sync.bfly.b32") == 2 * 5 * tokens
    before, between, _ = _pdl_phases(up)
    assert _count(before + between, STREAM) == 4
    ptx = _common_ptx(down, arch)
    assert _count(ptx, STREAM) == (4 * 2 if name == "routed_small" else 2 * 1)
    before, between, _ = _pdl_phases(down)
    assert _count(before + between, STREAM) == _count(ptx, STREAM)


# ---------------------------------------------------------------- on the GPU


def nan(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def draw_routing(tokens, top_k, pool, gen):
    """ids [T, k] (int64): distinct experts per token out of ``pool`` (tokens share experts);
    fp32 weights normalized like the router's."""
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(tokens)])
    scores = torch.sigmoid(torch.randn(tokens, top_k, generator=gen))
    return scores / scores.sum(-1, keepdim=True), ids


class RoutedCase:
    """The pool's experts (k x min(T, 4) of E, the last one among them) with random weights:
    on the CPU compact ([pool, ...], ids renumbered into the pool), on the GPU at their ids
    in the full [E, ...] tensors, NaN everywhere else (the kernels must read only the
    selected experts)."""

    def __init__(self, tokens, inter, gen, experts=E, top_k=K, latent=L, beta=BETA, linear_beta=LINEAR_BETA):
        self.experts, self.top_k, self.act = experts, top_k, (beta, linear_beta)
        self.pool = torch.randperm(experts, generator=gen)[:min(experts, top_k * min(tokens, 4))]
        if experts - 1 not in self.pool:
            self.pool[0] = experts - 1  # the last expert: its rows lie past 2^31 elements of w13 at TP 8
        self.w13 = (torch.randn(len(self.pool), 2 * inter, latent, generator=gen) * 0.02).bfloat16()
        self.w2 = (torch.randn(len(self.pool), latent, inter, generator=gen) * 0.02).bfloat16()
        self.w13_gpu = torch.full((experts, 2 * inter, latent), float("nan"), dtype=torch.bfloat16, device="cuda")
        self.w2_gpu = torch.full((experts, latent, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        self.w13_gpu[self.pool.cuda()] = self.w13.cuda()
        self.w2_gpu[self.pool.cuda()] = self.w2.cuda()
        self.slot_of = torch.full((experts,), -1, dtype=torch.int64)
        self.slot_of[self.pool] = torch.arange(len(self.pool))

    def inputs(self, tokens, gen):
        """(x, weights, ids) on the CPU: fresh random tokens and routing."""
        x = torch.randn(tokens, self.w13.shape[2], generator=gen).bfloat16()
        return (x, *draw_routing(tokens, self.top_k, self.pool, gen))

    def cpu_args(self, x, weights, ids):
        return (x, weights, self.slot_of[ids], self.w13, self.w2, *self.act)

    def gpu_args(self, x, weights, ids):
        return (x.cuda(), weights.cuda(), ids.cuda(), self.w13_gpu, self.w2_gpu, *self.act)


def check_routed(case, x, weights, ids):
    cpu = case.cpu_args(x, weights, ids)
    ref = torch.ops.k3f.routed_experts(*cpu)
    ref_act = experts_up(x, cpu[2], case.w13, beta=case.act[0], linear_beta=case.act[1])  # the stages' scratch
    gpu = case.gpu_args(x, weights, ids)
    tpl, specs, fns = gpu_kernels(ROUTED, gpu)
    y, act = nan(*ref.shape), nan(*ref_act.shape)
    out = tpl.launch(fns, specs, gpu, out=(y, act))
    torch.cuda.synchronize()
    assert out is y and torch.isfinite(act).all() and torch.isfinite(y).all()
    assert rel_err(act, ref_act) <= TOL
    assert rel_err(y, ref) <= TOL


def shared_inputs(tokens, inter, gen, hidden=H, beta=BETA, linear_beta=LINEAR_BETA):
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate_up = (torch.randn(2 * inter, hidden, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(hidden, inter, generator=gen) * 0.02).bfloat16()
    return x, gate_up, down, beta, linear_beta


def cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def check_shared(cpu, kernel=None):
    """The template the call picks (or ``kernel``): y and the activation scratch poisoned first."""
    x, gate_up, down, beta, linear_beta = cpu
    ref = torch.ops.k3f.shared_experts(*cpu)
    ref_h = shared_experts_up(x, gate_up, beta=beta, linear_beta=linear_beta)
    gpu = cuda(cpu)
    tpl, specs, fns = gpu_kernels(SHARED, gpu, kernel)
    assert tpl.kernel == kernel or (kernel is None and tpl.kernel == ("shared_experts" if x.shape[0] == 1 else
                                                                        "shared_experts_gemm"))
    gemv = tpl.kernel == "shared_experts"
    y, h = nan(*ref.shape), nan(x.shape[0], 1, down.shape[1]) if gemv else nan(x.shape[0], down.shape[1])
    out = tpl.launch(fns, specs, gpu, out=(y, h))
    torch.cuda.synchronize()
    assert out is y and torch.isfinite(h).all() and torch.isfinite(y).all()
    assert rel_err(h[:, 0] if gemv else h, ref_h) <= TOL
    assert rel_err(y, ref) <= TOL


@on_gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_routed_experts(tokens, shape):
    inter, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(10 * tokens + inter)
    case = RoutedCase(tokens, inter, gen)
    check_routed(case, *case.inputs(tokens, gen))


@on_gpu
@pytest.mark.parametrize("tokens,kernel", [(1, None), (2, None), (8, None), (64, None), (8, "shared_experts"),
                                           (64, "shared_experts")])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shared_experts(tokens, kernel, shape):
    """As served (GEMVs at 1 token, the GEMM from 2), and the GEMVs over their whole range."""
    _, inter = SHAPES[shape]
    check_shared(shared_inputs(tokens, inter, torch.Generator().manual_seed(20 * tokens + inter)), kernel)


def test_shared_gemv_at_tp_32_shares_a_row_among_8_lanes():
    """TP 32 leaves the shared experts 192 channels a rank, not a multiple of 16 lanes x 8: the
    down GEMV shares a row among 8 lanes (3 vectors each); 16 where they divide (TP 16 and 8)."""
    inter = K3.shard(32).shared_intermediate
    assert inter == 192
    up, down = gemv_specs_of("sm_90a", shared_args(tokens=1, inter=inter))
    assert down.param_dict["lanes_per_row"] == 8 and down.shape_dict["inter"] == 192
    for _, wide in SHAPES.values():
        assert gemv_specs_of("sm_90a", shared_args(tokens=1, inter=wide))[1].param_dict["lanes_per_row"] == 16


@on_gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_shared_experts_at_tp_32(tokens):
    """The GEMVs on 8 lanes a row (TP 32's 192 channels), against the reference."""
    inter = K3.shard(32).shared_intermediate
    check_shared(shared_inputs(tokens, inter, torch.Generator().manual_seed(32 + tokens)), "shared_experts")


@on_gpu
def test_silu_and_mul_at_a_small_shape():
    """beta None: SiLU-and-mul (the tiny config's activation); E = 16, k = 4, L = 512, I = 128."""
    gen = torch.Generator().manual_seed(5)
    case = RoutedCase(5, 128, gen, experts=16, top_k=4, latent=512, beta=None, linear_beta=None)
    check_routed(case, *case.inputs(5, gen))
    for kernel in ("shared_experts", "shared_experts_gemm"):
        check_shared(shared_inputs(5, 128, gen, hidden=512, beta=None, linear_beta=None), kernel)


@on_gpu
def test_ops_dispatch_to_the_kernels_in_a_cuda_graph():
    """Both ops through ``install_cuda_kernels``, captured in one CUDA graph; then new x,
    weights and ids copied into the captured inputs and the graph replayed: the kernels read
    the ids on the GPU at replay time (no host sync, nothing fixed at capture)."""
    bind.install_cuda_kernels()
    gen = torch.Generator().manual_seed(11)
    inter, shared_inter = SHAPES["tp16"]
    case = RoutedCase(8, inter, gen)
    gpu = case.gpu_args(*case.inputs(8, gen))
    shared_cpu = shared_inputs(8, shared_inter, gen)
    shared_gpu = cuda(shared_cpu)
    before = {op: bind.stats().get(op, {}).get("kernel", 0) for op in (ROUTED, SHARED)}
    torch.ops.k3f.routed_experts(*gpu)  # compiles and loads outside the capture
    torch.ops.k3f.shared_experts(*shared_gpu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.k3f.routed_experts(*gpu)
        ys = torch.ops.k3f.shared_experts(*shared_gpu)
    assert all(bind.stats()[op]["kernel"] == before[op] + 2 for op in (ROUTED, SHARED))

    x, weights, ids = case.inputs(8, gen)
    for dst, src in zip(gpu[:3], (x, weights, ids)):
        dst.copy_(src.cuda())
    y.fill_(float("nan"))
    ys.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all() and torch.isfinite(ys).all()
    assert rel_err(y, torch.ops.k3f.routed_experts(*case.cpu_args(x, weights, ids))) <= TOL
    assert rel_err(ys, torch.ops.k3f.shared_experts(*shared_cpu)) <= TOL
