"""The ``kda_core`` template (``k3f::kda_core``): specs and refusals (everywhere), compile and
PTX checks for sm_90a and sm_100a (with CuTe DSL), and the kernel on a GPU against the op's
CPU reference (marked ``gpu``; skipped without CUDA or CuTe DSL).

On the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_kda.py``.
"""
from __future__ import annotations

import re

import pytest
import torch

import patterns.kda  # noqa: F401  (defines the k3f ops used here)
import rewriter.model.ops  # noqa: F401  (the k3:: ops its reference calls)
from codegen import bind
from codegen.cache import KernelCache
from codegen.templates import spec_for_call, template
from conftest import GPU_MARKS, example_module, gpu_arch, needs_cutedsl, pdl_flags, ptxas_usage, rel_err
from rewriter.model.layers.state import kda_state_pages

ARCHS = ("sm_90a", "sm_100a")
D = 128
HEADS = {"tp16": 6, "tp8": 12}  # Kimi K3 KDA heads per rank (P = 768, 1536)
LB = -5.0  # Kimi K3's gate lower bound
EPS = 1e-5


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def kda_args(heads=6, requests=1, q=1, slots=8, head_dim=D, width=4, lower_bound=LB, tokens=None,
             dtypes=None, make=meta, layout="SD"):
    """The 16 arguments of ``k3f::kda_core`` (meta tensors unless ``make`` says otherwise), the
    states in vLLM's pages (``layout``: SD or DS; None: contiguous tensors)."""
    p, t = heads * head_dim, requests * q if tokens is None else tokens
    dt = {"act": torch.bfloat16, "idx": torch.int32, **(dtypes or {})}
    conv, state = make(slots, 3 * p, width - 1), make(slots, heads, head_dim, head_dim, dtype=torch.float32)
    if layout:
        conv, state = kda_state_pages(conv, state, layout)
    return (make(t, 3 * p, dtype=dt["act"]), make(t, p), make(t, head_dim), make(t, heads), make(p, head_dim),
            make(3 * p, 1, width, dtype=torch.float32), make(heads, dtype=torch.float32),
            make(p, dtype=torch.float32), make(head_dim), conv, state, make(requests, dtype=dt["idx"]),
            heads, head_dim, lower_bound, EPS)


def kda_spec(arch, args):
    tpl, specs = spec_for_call("k3f::kda_core", arch, args)
    assert tpl is not None, specs
    (spec,) = specs
    return spec


# ---------------------------------------------------------------- specs and refusals (no CuTe DSL needed)

@pytest.mark.parametrize("shape", list(HEADS))
def test_specs_at_kimi_k3_shapes(shape):
    h = HEADS[shape]
    spec = kda_spec("sm_90a", kda_args(heads=h))
    assert spec.kernel == "kda_core" and spec.op == "k3f::kda_core"
    assert spec.shape_dict == {"heads": h, "head_dim": D, "q_len": 1}
    assert spec.param_dict == {"lower_bound": LB, "eps": EPS, "conv_layout": "SD"}
    assert spec.label() == f"kda_core head_dim=128 heads={h} q_len=1 conv_layout=SD lower_bound=-5.0 sm_90a"
    # requests and slots are runtime sizes: one compile serves every batch of q = 1 up to the
    # persistent form's (request, head) count, and one every batch from it
    assert kda_spec("sm_90a", kda_args(heads=h, requests=132 // h, slots=300)) == spec
    big = kda_spec("sm_90a", kda_args(heads=h, requests=64, slots=300))
    assert big.param_dict == {**spec.param_dict, "persistent": True}
    assert kda_spec("sm_90a", kda_args(heads=h, requests=-(-133 // h), slots=300)) == big
    assert kda_spec("sm_100a", kda_args(heads=h)) == spec.with_arch("sm_100a")
    two = kda_spec("sm_90a", kda_args(heads=h, requests=3, q=2))
    assert two.shape_dict["q_len"] == 2 and two != spec
    assert kda_spec("sm_90a", kda_args(heads=h, lower_bound=None)).param_dict["lower_bound"] is None
    # the conv layout is compiled in; the page stride is not (contiguous states are pages too)
    ds = kda_spec("sm_90a", kda_args(heads=h, layout="DS"))
    assert ds.param_dict["conv_layout"] == "DS" and ds != spec
    assert kda_spec("sm_90a", kda_args(heads=h, layout=None)) == ds
    assert template("kda_core").ops == ("k3f::kda_core", "k3f::kda_core_verify")


def verify_args(heads=6, requests=2, q=4, rows=None, slots=16, table_width=12, make=meta, layout="SD"):
    """The 17 arguments of ``k3f::kda_core_verify`` as vLLM gives them: ``rows`` (default q + 2,
    vLLM's 3 + k) conv rows per slot, the slots a [requests, q] slice of a wider block table."""
    plain = list(kda_args(heads=heads, requests=requests, q=q, slots=slots, make=make, layout=None))
    p = heads * D
    conv, state = make(slots, 3 * p, q + 2 if rows is None else rows), plain[10]
    if layout:
        conv, state = kda_state_pages(conv, state, layout)
    table = make(requests, table_width, dtype=torch.int32)[:, :q]
    return (*plain[:9], conv, state, table, make(requests, dtype=torch.int32), *plain[12:])


def test_verify_specs_at_kimi_k3_shapes():
    """One spec per (q, conv rows, layout): the slot table's row stride, the batch and the pages
    are runtime values."""
    tpl, (spec,) = spec_for_call("k3f::kda_core_verify", "sm_90a", verify_args(q=8))
    assert tpl is template("kda_core") and spec.op == "k3f::kda_core_verify"
    assert spec.shape_dict == {"heads": 6, "head_dim": D, "q_len": 8, "conv_rows": 10}
    assert spec.param_dict == {"lower_bound": LB, "eps": EPS, "conv_layout": "SD", "verify": True}
    same = spec_for_call("k3f::kda_core_verify", "sm_90a", verify_args(q=8, requests=8, slots=80, table_width=40))
    assert same[1] == (spec,)
    ds = spec_for_call("k3f::kda_core_verify", "sm_90a", verify_args(q=8, layout="DS"))[1][0]
    assert ds.param_dict["conv_layout"] == "DS" and ds != spec


def _verify_replace(i, value, **kw):
    args = list(verify_args(**kw))
    args[i] = value
    return tuple(args)


@pytest.mark.parametrize("args,reason", [
    (_verify_replace(11, meta(2, dtype=torch.int32)), "state_indices must be [requests, q]"),
    (_verify_replace(11, meta(2, 8, dtype=torch.int32)[:, ::2]), "a request's slots must be contiguous"),
    (_verify_replace(11, meta(2, 3, dtype=torch.int32)), "3 slots per request for 4 tokens"),
    (_verify_replace(12, meta(3, dtype=torch.int32)), "num_accepted must be a contiguous [2]"),
    (_verify_replace(12, meta(2, dtype=torch.int64)), "num_accepted is int64"),
    (verify_args(q=4, rows=5), "the conv state holds 5 rows; a verify of 4 tokens needs 6"),
])
def test_verify_refusals_say_why(args, reason):
    tpl, why = spec_for_call("k3f::kda_core_verify", "sm_90a", args)
    assert tpl is None and reason in why, why


def _strided_state(i, view):
    """kda_args with state ``i`` (9: conv, 10: recurrent) replaced by ``view`` of a bigger buffer."""
    args = list(kda_args())
    args[i] = view
    return tuple(args)


def _replace(i, value, **kw):
    args = list(kda_args(**kw))
    args[i] = value
    return tuple(args)


@pytest.mark.parametrize("args,reason", [
    (kda_args(heads=8, head_dim=16), "head_dim 16: the kernel is built for 128"),  # the tiny preset
    (kda_args(dtypes={"act": torch.float32}), "mixed_qkv is fp32; the template is bf16 only"),
    (kda_args(dtypes={"idx": torch.int64}), "state_indices is int64; the template is int32 only"),
    (_strided_state(9, meta(8, 3 * 768, 6)[:, :, ::2]), "a slot must hold its [3, 3P] (SD) or [3P, 3] (DS)"),
    (_strided_state(9, meta(8, 3 * 768 * 3 + 4)[:, 4:].unflatten(1, (3 * 768, 3))), "multiples of 8 and 4"),
    (_strided_state(10, meta(8, 6, 128, 256, dtype=torch.float32)[..., :128]), "a slot must hold [H, V, K]"),
    (kda_args(width=3), "conv width 3: the kernel takes 4"),
    (kda_args(requests=3, tokens=4), "4 tokens do not split evenly over 3 requests"),
    (kda_args(requests=2, q=9), "9 tokens per request outside 1..8"),
    (_replace(4, meta(768, 64)), "f_b_weight must be [768, 128]"),
    (_replace(10, meta(8, 6, 128, 64, dtype=torch.float32)), "recurrent_state must be [8, 6, 128, 128]"),
    (_replace(6, meta(6)), "a_log is bf16; the template is fp32 only"),
])
def test_refusals_say_why(args, reason):
    tpl, why = spec_for_call("k3f::kda_core", "sm_90a", args)
    assert tpl is None and reason in why, why


def test_launcher_declines_cpu_tensors():
    launcher = bind.TemplateLauncher("kda_core", arch="sm_90a")
    args = kda_args(make=lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype))
    assert launcher(*args) is NotImplemented
    assert any("CUDA" in r for r in bind.stats()["k3f::kda_core"])


@pytest.mark.parametrize("items,heads,sms,ctas", [
    (6, 6, 132, 6),  # one request: a CTA per (request, head)
    (132, 6, 132, 132),  # exactly one wave
    (384, 6, 132, 132),  # TP 16, 64 requests: one CTA an SM, each on one head
    (768, 12, 132, 132),
    (240, 12, 114, 108),  # an H100 PCIe: the largest multiple of the heads that fits
    (40, 12, 8, 12),  # fewer SMs than heads: a CTA per head still (the CTAs then wait their turn)
])
def test_persistent_grid(items, heads, sms, ctas):
    from codegen.launchers.kda_core import persistent_ctas

    got = persistent_ctas(items, heads, sms)
    assert got == ctas and (got == items or got % heads == 0)


# ---------------------------------------------------------------- compile-only (CuTe DSL)

COMPILES = {  # name -> (arch, heads, q, lower_bound, requests)
    **{("tp16_q1", a): (a, 6, 1, LB, 2) for a in ARCHS},
    ("tp16_q1_persistent", "sm_90a"): ("sm_90a", 6, 1, LB, 23),  # 138 (request, head) pairs
    ("tp8_q4_unbounded", "sm_90a"): ("sm_90a", 12, 4, None, 2),
}
VERIFY_COMPILES = {("tp16_q8_SD", "sm_90a"): (6, 8, "SD"), ("tp8_q4_DS", "sm_100a"): (12, 4, "DS")}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from codegen.compiler import clear_memory_cache, compile_kernel

    clear_memory_cache()
    cache = KernelCache(tmp_path_factory.mktemp("kda-kernel-cache"))
    out = {key: compile_kernel(kda_spec(arch, kda_args(heads=h, requests=r, q=q, lower_bound=lb)), cache=cache)
           for key, (arch, h, q, lb, r) in COMPILES.items()}
    for key, (h, q, layout) in VERIFY_COMPILES.items():
        (spec,) = spec_for_call("k3f::kda_core_verify", key[1], verify_args(heads=h, q=q, layout=layout))[1]
        out[key] = compile_kernel(spec, cache=cache)
    return out


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


def _count64(ptx: str, op: str) -> int:
    """64-bit accesses ``op`` (``ld.global``, ``st.global.nc``...): 2 x b32, 4 x b16 or one b64."""
    return _count(ptx, f"{op}.v2.b32") + _count(ptx, f"{op}.v4.b16") + _count(ptx, f"{op}.b64")


def _count128(ptx: str, op: str) -> int:
    """128-bit accesses ``op`` (``st.global``, ``ld.shared``...): 4 x b32, or 2 x b64 as sm_100a writes fp32 ones."""
    return _count(ptx, f"{op}.v4.b32") + _count(ptx, f"{op}.v2.b64")


@needs_cutedsl
@pytest.mark.parametrize("key", list(COMPILES))
def test_kda_core_ptx(compiled, key):
    k = compiled[key]
    arch, _, q, lb, _ = COMPILES[key]
    ptx = k.ptx
    assert f".target {arch}" in ptx and k.cache == "miss" and k.obj
    assert ".reqntid 512, 1, 1" in ptx  # 4 threads per state row: at most 128 registers each
    registers, spilled = ptxas_usage(ptx, arch)
    assert registers <= 128 and spilled == 0, (registers, spilled)
    staged = k.spec.param_dict.get("persistent", False)  # items looped over, every input copied ahead
    assert staged == ("persistent" in key[0])
    if staged:
        # by cp.async into shared memory, 128 bits past the L1, before the wait: the f_b_proj row
        # quarters (4 per thread), the conv taps (4 fp32 rows per conv thread) and the norm weight;
        # after it, per item at two sites (the first item's and the next one's): g_out and f_a (1
        # each, 16 threads) and the fp32 state (8 per thread); 64 bits through the L1: the conv
        # state (3) and x (1) of each conv thread
        assert _count(ptx, "cp.async.cg.shared.global") == 4 + 4 + 1 + 2 * (1 + 1 + 8)
        assert _count(ptx, "cp.async.ca.shared.global") == 2 * (3 + 1)
        assert _count(ptx, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 0
        # one group the weights, then two per item (activations, state), each item with its next
        # one's two behind it: it waits for all but 3 (its activations) and all but 2 (its state)
        assert _count(ptx, "cp.async.commit_group") == 1 + 2 * 2 + 2
        assert [len(re.findall(rf"cp.async.wait_group\s+{n};", ptx)) for n in (3, 2)] == [1, 1]
    else:
        # streamed into registers (8 x 128-bit per thread): the head's fp32 state, the f_b_proj
        # rows (4 per thread) and the conv taps (4 fp32 rows per conv thread), at one token also
        # the norm weight (output threads); no cp.async
        assert _count(ptx, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 8 + 4 + 4 + (q == 1)
        assert "cp.async" not in ptx
    early = not staged and q == 1  # slot, state and norm weight before the wait, f_a and g_out with beta
    # PDL: weights are all that comes before griddepcontrol.wait (the f_b_proj rows there at
    # q = 1 only); launch_dependents right after it, both once
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait;")
    if staged:
        assert _count(before, "cp.async.cg.shared.global") == 4 + 4 + 1
    else:  # conv taps, f_b_proj rows at one token; one CTA an item at one token: the state, the norm weight
        assert _count(before, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 4 + (4 + 8 + 1 if early else 0)
    # and the decay's two constants, A_log of the head and dt_bias of the thread's row (weights
    # too); one CTA an item at one token also the slot (vLLM's metadata, no kernel's output)
    assert _count(before, "ld.global.b32") == 2 + early and _count(before, "ld.global.nc") == 0
    assert _count(before, "ld.global.v4") == 0 and _count(before, "st.") == 0
    assert "griddepcontrol.launch_dependents" in after
    # unstaged, read-only 128-bit loads: f_a per token (4 vectors), g_out and norm_weight (output
    # threads); one CTA an item at one token f_a and g_out plain (ptxas sinks ld.global.nc to its
    # first use: f_a past the conv), all before the conv; 64-bit: x per token (conv threads) and
    # the conv state (coherent: written back)
    assert _count(ptx, "ld.global.nc.v4.b32") == (0 if staged or early else 4 * q + 2)
    assert _count(ptx, "ld.global.v4.b32") == (4 + 1 if early else 0)
    if early:
        conv_store = re.search(r"^\s*(?:@%p\d+\s+)?st\.global\.(?:v2\.b32|v4\.b16|b64)", after, re.MULTILINE).start()
        assert _count(after[:conv_store], "ld.global.v4.b32") == 4 + 1
    assert _count64(ptx, "ld.global.nc") == (0 if staged else q)
    assert _count64(ptx, "ld.global") == (0 if staged else 3)
    # state, the output (and the zero rows of a skipped request), all 128-bit; the conv state 64
    assert _count128(ptx, "st.global") == 8 + 1 + 1
    assert _count64(ptx, "st.global") == 3
    # per token: GEMV row sums (2), q/k norms (5), S k and S q (2 + 2), sum of o^2 over 8 rows (3)
    assert _count(ptx, "shfl.sync.bfly.b32") == 14 * q
    assert _count(ptx, "bar.sync") == 2 + staged  # staged: f_a, copied by 16 threads, read by all
    assert _count128(ptx, "st.shared") == q  # a conv thread's 4 outputs (fp32) staged per token
    assert _count128(ptx, "ld.shared") >= 3 * 8 * q  # exp(g), k, q vectors per token
    assert _count(ptx, "fma.rn.f32") >= 2 * 32 * q  # the rank-1 update and S q (fp32)
    if lb is not None:  # exps: A_log, beta, 2 per decay and 4 SiLU per token, 8 output gates
        assert _count(ptx, "ex2.approx") == 10 + 6 * q
    else:
        assert len(re.findall(r"setp.gt.f32\s+%p\d+, %r\d+, 0f41A00000;", ptx)) == q  # softplus: x > 20
    # beta: where the item starts, or, staged, the first item's and each next one's (an item ahead)
    assert _count(ptx, "ld.global.b16") == 1 + staged
    # the slot (of the item; staged also of the first item's prefetch and the next one's),
    # A_log, dt_bias
    assert _count(ptx, "ld.global.s32") + _count(ptx, "ld.global.b32") == (3 if staged else 1) + 2
    assert "st.global.b16" not in ptx and "ld.local" not in ptx and "st.local" not in ptx


@needs_cutedsl
@pytest.mark.parametrize("key", list(VERIFY_COMPILES))
def test_kda_core_verify_ptx(compiled, key):
    """A verify step in one kernel: the source state streamed in once, token t's state stored
    after its update (8 x 128-bit per token), the conv rows rewritten (SD: 2 + q 64-bit rows of
    a thread's 4 channels; DS: scalars), no local memory, PDL as for one-slot steps."""
    k = compiled[key]
    _, q, layout = VERIFY_COMPILES[key]
    ptx = k.ptx
    assert f".target {key[1]}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert _count(ptx, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 8 + 4 + 4  # state, f_b rows, conv taps
    assert "cp.async" not in ptx
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    conv_rows = 2 + q if layout == "SD" else 0
    assert _count128(ptx, "st.global") == 8 * q + 1 + 1  # states, output, zero rows
    assert _count64(ptx, "st.global") == conv_rows
    if layout == "DS":
        assert _count(ptx, "st.global.b16") == 4 * (2 + q)  # 4 channels x (2 + q) rows
        assert _count(ptx, "ld.global.b16") == 1 + 12  # beta, 4 channels x 3 window taps
    assert _count(ptx, "bar.sync") == 2


@needs_cutedsl
def test_kda_core_launches_with_pdl(compiled):
    assert pdl_flags(compiled["tp16_q1", "sm_90a"].spec) == [1]


# ---------------------------------------------------------------- on the GPU (marked gpu)

TOL = 1e-2  # bf16 outputs
STATE_TOL = 1e-3  # the fp32 recurrent state


def kda_inputs(heads, requests, q, gen, lower_bound=LB, skip=(), layout="SD"):
    """CPU inputs with realistic magnitudes (gates away from saturation), ``requests`` random
    distinct slots out of 1 .. ``requests + 3`` (``skip``: padding requests, given slot 0 as
    vLLM does, or -1), the states in vLLM's pages (``layout``), every slot no request uses
    (the null block 0 included) filled with NaN (the kernel must neither read nor write it)."""
    p, t, slots = heads * D, requests * q, requests + 4
    rnd = _randn(gen)
    idx = (torch.randperm(slots - 1, generator=gen)[:requests] + 1).to(torch.int32)
    for n, r in enumerate(skip):
        idx[r] = -(n % 2)  # 0, vLLM's padding, then -1
    conv_state, state = kda_state_pages(rnd(slots, 3 * p, 3), rnd(slots, heads, D, D, scale=0.1, dtype=torch.float32),
                                        layout)
    unused = torch.ones(slots, dtype=torch.bool)
    unused[idx[idx > 0].long()] = False
    conv_state[unused] = float("nan")
    state[unused] = float("nan")
    return (*_activations_and_weights(rnd, heads, t), conv_state, state, idx, heads, D, lower_bound, EPS), unused


def _randn(gen):
    def rnd(*shape, scale=1.0, shift=0.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype)

    return rnd


def _activations_and_weights(rnd, heads, tokens):
    """The op's first 9 arguments for ``tokens`` tokens, at realistic magnitudes (gates away from
    saturation): mixed_qkv, g_out, f_a, beta, f_b_weight, conv_weight, A_log, dt_bias, norm_weight."""
    p = heads * D
    return (rnd(tokens, 3 * p), rnd(tokens, p), rnd(tokens, D), rnd(tokens, heads), rnd(p, D, scale=0.05),
            rnd(3 * p, 1, 4, scale=0.3, dtype=torch.float32), rnd(heads, scale=0.2, dtype=torch.float32),
            rnd(p, scale=0.5, shift=-3.0, dtype=torch.float32), rnd(D, scale=0.1, shift=1.0))


def to_gpu(cpu, layout):
    """The inputs on the GPU, the states in vLLM's pages there too (``.cuda()`` would compact them)."""
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu]
    gpu[9], gpu[10] = kda_state_pages(gpu[9], gpu[10], layout)
    return gpu


def reference(cpu, op=torch.ops.k3f.kda_core):
    """The op's CPU reference on copies of the states: (out, conv_state, recurrent_state)."""
    args = list(cpu)
    args[9], args[10] = cpu[9].clone(), cpu[10].clone()
    out = op(*args)
    return out, args[9], args[10]


def verify_inputs(heads, requests, q, gen, extra_rows=0, pad=(), layout="SD"):
    """A verify step's CPU inputs as vLLM lays them out: each request's q distinct slots a
    row of a wider block table (padding rows: 0s, accepted 1), accepted counts 1..q, conv
    rows q + 2 (+ ``extra_rows``), every state no request may read NaN: slots outside the
    table and, of the table's, the recurrent states of columns other than a - 1 (written,
    never read) and the conv states of columns past 0."""
    p, t = heads * D, requests * q
    slots = requests * q + 4
    rnd = _randn(gen)
    table = torch.zeros(requests, q + 3, dtype=torch.int32)
    table[:, :q] = (torch.randperm(slots - 1, generator=gen)[:t] + 1).view(requests, q).to(torch.int32)
    accepted = torch.randint(1, q + 1, (requests,), generator=gen, dtype=torch.int32)
    for r in pad:
        table[r] = 0
        accepted[r] = 1
    idx = table[:, :q]
    rows = q + 2 + extra_rows
    conv = rnd(slots, 3 * p, rows)
    state = rnd(slots, heads, D, D, scale=0.1, dtype=torch.float32)
    conv_used = torch.zeros(slots, dtype=torch.bool)
    conv_used[idx[:, 0].long()] = True
    state_used = torch.zeros(slots, dtype=torch.bool)
    state_used[idx.gather(1, (accepted.long() - 1).view(-1, 1)).view(-1).long()] = True
    conv_used[0] = state_used[0] = False
    conv[~conv_used] = float("nan")
    state[~state_used] = float("nan")
    written = torch.zeros(slots, dtype=torch.bool)
    written[idx.flatten().long()] = True
    written[0] = False
    conv, state = kda_state_pages(conv, state, layout)
    return [*_activations_and_weights(rnd, heads, t), conv, state, idx, accepted, heads, D, LB, EPS], \
        (~conv_used, ~written)


def verify_to_gpu(cpu, layout):
    gpu = to_gpu(cpu, layout)
    table = torch.zeros(cpu[11].shape[0], cpu[11].shape[1] + 3, dtype=torch.int32, device="cuda")
    table[:, :cpu[11].shape[1]] = gpu[11]
    gpu[11] = table[:, :cpu[11].shape[1]]  # a slice of a wider block table, as vLLM's is
    return gpu


def run_kernel(op, gpu):
    from codegen.compiler import compile_kernel

    tpl, specs = spec_for_call(op, gpu_arch(), gpu)
    assert tpl is not None, specs
    assert tpl.runtime_check(gpu) is None
    fns = tuple(compile_kernel(s).load() for s in specs)
    out = torch.full_like(gpu[1], float("nan"))
    assert tpl.launch(fns, specs, gpu, out=out) is out
    torch.cuda.synchronize()
    return out


def check_verify(out, gpu, ref, cpu, unused, q):
    ref_out, ref_conv, ref_state = ref
    conv_untouched, state_untouched = unused
    assert torch.isfinite(out).all() and rel_err(out, ref_out) <= TOL
    padding = (cpu[11][:, 0] <= 0).repeat_interleave(q)
    assert (out.cpu()[padding] == 0).all()
    conv, state = gpu[9].cpu(), gpu[10].cpu()
    assert torch.equal(conv[~conv_untouched], ref_conv[~conv_untouched])  # rows moved and inputs stored: exact
    assert conv[conv_untouched].isnan().all()  # columns past 0 and the null block keep their conv pages
    assert torch.isfinite(state[~state_untouched]).all()  # every column's state written
    assert rel_err(state[~state_untouched], ref_state[~state_untouched]) <= STATE_TOL
    assert state[state_untouched].isnan().all()


def check(out, conv_state, state, ref, unused, idx, q):
    ref_out, ref_conv, ref_state = ref
    used = ~unused
    assert out.shape == ref_out.shape and torch.isfinite(out).all()
    assert rel_err(out, ref_out) <= TOL
    skipped = (idx <= 0).repeat_interleave(q)
    assert (out.cpu()[skipped] == 0).all()  # a request without a slot: rows of 0
    conv_state, state = conv_state.cpu(), state.cpu()
    assert torch.equal(conv_state[used], ref_conv[used])  # the last 3 inputs, bf16: exact
    assert rel_err(state[used], ref_state[used]) <= STATE_TOL
    assert conv_state[unused].isnan().all() and state[unused].isnan().all()  # no other slot touched


class TestKdaCoreOnGpu:
    pytestmark = GPU_MARKS

    @pytest.mark.parametrize("requests,q,skip,lower_bound,layout", [
        (1, 1, (), LB, "SD"),
        (5, 1, (3, 1), LB, "SD"),  # padding requests (slot 0, vLLM's, and -1) in the middle
        (64, 1, (), LB, "SD"),
        (150, 1, (3, 77, 149), LB, "SD"),  # more items than SMs: one CTA an SM loops over them
        (100, 1, (0, 50), LB, "DS"),
        (3, 2, (0,), LB, "SD"),
        (4, 4, (), LB, "SD"),
        (2, 8, (), LB, "SD"),
        (4, 1, (), None, "SD"),  # the unbounded (softplus) decay
        (5, 1, (2,), LB, "DS"),  # vLLM told VLLM_SSM_CONV_STATE_LAYOUT=DS
        (3, 4, (), LB, "DS"),
    ])
    @pytest.mark.parametrize("shape", list(HEADS))
    def test_kda_core(self, shape, requests, q, skip, lower_bound, layout):
        heads = HEADS[shape]
        gen = torch.Generator().manual_seed(1000 * heads + 10 * requests + q)
        cpu, unused = kda_inputs(heads, requests, q, gen, lower_bound, skip, layout)
        ref = reference(cpu)
        gpu = to_gpu(cpu, layout)
        assert gpu[9].stride(0) > gpu[9][0].numel()  # page-strided on the GPU too
        out = run_kernel("k3f::kda_core", gpu)
        check(out, gpu[9], gpu[10], ref, unused, cpu[11], q)

    @pytest.mark.parametrize("requests,q,extra_rows,pad,layout", [
        (1, 2, 0, (), "SD"),
        (3, 4, 0, (1,), "SD"),  # a padding row (slots 0, accepted 1) in the middle
        (8, 8, 0, (), "SD"),
        (2, 8, 1, (), "SD"),  # more conv rows than this q needs
        (4, 4, 0, (3,), "DS"),
        (2, 8, 0, (), "DS"),
    ])
    @pytest.mark.parametrize("shape", list(HEADS))
    def test_kda_core_verify(self, shape, requests, q, extra_rows, pad, layout):
        """Two verify steps in a row (the second continues from the first's accepted length)
        against the op's CPU reference, every accepted length 1..q drawn, vLLM's page-strided
        states and its block-table slice of slots, every slot no request reads poisoned NaN."""
        heads = HEADS[shape]
        gen = torch.Generator().manual_seed(100 * heads + 10 * q + requests)
        cpu, unused = verify_inputs(heads, requests, q, gen, extra_rows, pad, layout)
        gpu = verify_to_gpu(cpu, layout)
        for step in range(2):
            if step:  # fresh activations and accepted counts; the states carry over
                fresh, _ = verify_inputs(heads, requests, q, gen, extra_rows, pad, layout)
                for i in (0, 1, 2, 3, 12):
                    cpu[i] = fresh[i]
                    gpu[i] = fresh[i].cuda()
            ref = reference(cpu, torch.ops.k3f.kda_core_verify)
            out = run_kernel("k3f::kda_core_verify", gpu)
            check_verify(out, gpu, ref, cpu, unused, q)
            cpu[9], cpu[10] = ref[1], ref[2]  # the reference's states go on to the next step

    @pytest.mark.parametrize("sms,requests,skip", [(12, 5, (2,)), (6, 7, (0, 6)), (25, 9, ())])
    def test_kda_core_loops_over_items(self, monkeypatch, sms, requests, skip):
        """The persistent grid on a GPU made to look small (its SM count patched), so that every
        CTA takes several items, padding rows among them, and buffers alternate."""
        import codegen.launchers.kda_core as launcher

        monkeypatch.setattr(launcher, "sm_count", lambda index: sms)
        monkeypatch.setattr(launcher, "PERSISTENT_FROM_ITEMS", 2)
        heads = HEADS["tp16"]
        assert launcher.persistent_ctas(requests * heads, heads, sms) < requests * heads
        gen = torch.Generator().manual_seed(7 * sms + requests)
        cpu, unused = kda_inputs(heads, requests, 1, gen, LB, skip, "SD")
        ref = reference(cpu)
        gpu = to_gpu(cpu, "SD")
        out = run_kernel("k3f::kda_core", gpu)
        check(out, gpu[9], gpu[10], ref, unused, cpu[11], 1)

    def test_op_dispatches_to_the_kernel_and_replays_in_a_cuda_graph(self):
        bind.install_cuda_kernels()
        gen = torch.Generator().manual_seed(11)
        cpu, unused = kda_inputs(HEADS["tp16"], 4, 1, gen, skip=(2,))
        ref = reference(cpu)
        gpu = to_gpu(cpu, "SD")
        conv0, state0 = gpu[9].clone(), gpu[10].clone()
        before = bind.stats().get("k3f::kda_core", {}).get("kernel", 0)
        out = torch.ops.k3f.kda_core(*gpu)  # compiles and loads outside the capture
        torch.cuda.synchronize()
        assert bind.stats()["k3f::kda_core"]["kernel"] == before + 1
        check(out, gpu[9], gpu[10], ref, unused, cpu[11], 1)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.k3f.kda_core(*gpu)
        gpu[9].copy_(conv0)
        gpu[10].copy_(state0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, gpu[9], gpu[10], ref, unused, cpu[11], 1)
        assert bind.stats()["k3f::kda_core"]["kernel"] == before + 2


@pytest.mark.parametrize("tp,requests,persistent", [(16, 8, False), (16, 64, True), (8, 64, True)])
def test_benchmark_inputs_are_a_served_call(tp, requests, persistent):
    """``examples/bench_kernels.py --only kda_core`` times the form the template serves at its
    batch, on inputs the op's reference takes (finite outputs, every request's state moved)."""
    bench = example_module("bench_kernels")
    args = bench.kda_core_args(tp, requests, torch.Generator().manual_seed(tp), device="cpu")
    assert kda_spec("sm_90a", args).param_dict.get("persistent", False) == persistent
    before = args[10].clone()
    out = torch.ops.k3f.kda_core(*args)
    assert out.shape == (requests, HEADS[f"tp{tp}"] * D) and torch.isfinite(out).all()
    moved = (args[10] != before).flatten(1).any(1)
    assert moved[args[11].long()].all() and not moved[0]  # the requests' slots, not the null block
