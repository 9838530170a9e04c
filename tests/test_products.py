"""Fused ops with matrix products (``rewriter.compiler.products`` -> ``codegen.lowered.Products``):
that the stages compute what the reference does (``interpret_products`` against the reference in
torch, over a corpus of random prologue -> products -> epilogue functions, sometimes with a
second stage), that named shapes (an RMSNorm'd linear with a residual, a SiLU-gated MLP) cut
into the stages the kernels expect, that what the stages cannot express is refused by name, and
that the stages survive the kernel spec's parameters (plain, hashable data), and that slices of
weights and of products read the right rows. CPU only."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from codegen.lowered import LoweringError, Products, Program, Stage, interpret_products
from codegen.spec import KernelSpec
from conftest import needs_cutedsl, rel_err
from rewriter.compiler.lowering import lower
from rewriter.model.layers.common import rms_norm, silu_and_mul, situ_and_mul
from rewriter.model.layers.experts import ExpertFormat, random_mxfp4

F = torch.nn.functional
BF16 = torch.bfloat16
EPS = 1e-5


def _rand(shape, dtype, gen, scale=1.0, positive=False):
    t = torch.randn(shape, generator=gen)
    return ((t.abs() + 0.5 if positive else t) * scale).to(dtype)


def _weight(rows, k, gen):
    """A bf16 [rows, k] weight scaled so that a product of an O(1) activation is O(1)."""
    return _rand((rows, k), BF16, gen, scale=k ** -0.5)


MXFP4 = ExpertFormat.parse("mxfp4/humming")


def _mxfp4_weight(rows: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An [N, K] MXFP4 weight in Humming's layout: (codes int32 [K/16, 2N], E8M0 scales [K/32, N])."""
    codes, scales = MXFP4.from_checkpoint(*random_mxfp4(1, rows, k, generator=gen))
    return codes[0], scales[0]


def _check(products, fn, args, seed=None):
    """Every result of ``products`` against the reference: dtype, shape, finite, close."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    want = fn(*args)
    want = want if isinstance(want, tuple) else (want,)
    got = interpret_products(products, tensors)
    assert len(got) == len(want) == products.results
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (seed, i, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.isfinite(g.float()).all(), (seed, i)
        # a product's bf16 rounding may land one ulp apart where its sums are taken in another order
        assert rel_err(g, w) <= {BF16: 1e-2, torch.float8_e4m3fn: 2e-2}.get(w.dtype, 1e-4), (seed, i, rel_err(g, w))


def _weights_are_bf16_rows(products, tensors):
    """Every product reads whole rows [row0, row0 + N) of a [rows, K] argument: bf16 rows, or
    MXFP4 codes (two int32 columns a row) beside their scales argument."""
    for stage in products.stages:
        for p, (w, row0) in enumerate(stage.weights):
            t = tensors[w]
            if stage.weight_dtype == "mxfp4/humming":
                scales = tensors[stage.scales[p]]
                assert t.dtype == torch.int32 and t.shape[0] * 16 == stage.k and scales.shape[0] * 32 == stage.k
                assert 0 <= row0 and 2 * (row0 + stage.n) <= t.shape[1] and row0 % 64 == 0, (w, row0, stage.n)
                continue
            assert t.dtype == BF16 and t.dim() == 2 and t.shape[1] == stage.k, (w, tuple(t.shape), stage.k)
            assert 0 <= row0 and row0 + stage.n <= t.shape[0], (w, row0, stage.n, tuple(t.shape))


# ---- the corpus: prologue -> products -> epilogue (-> a second stage) ------------------------------
TOKENS = (1, 2, 5, 8, 64)
PRO_UNARY = {"tanh": torch.tanh, "silu": F.silu, "gelu": F.gelu, "relu": torch.relu}
PRO_STEPS = ("norm", "residual", "cast", "unary")
EPI_STEPS = ("tanh", "sigmoid_gate", "residual", "col", "stat", "argstat", "cast")
EPI2_STEPS = ("tanh", "residual", "col", "cast")


def random_products(seed: int):
    """(fn, args, info: the stage count, the first stage's product count, the choices made): a
    bf16 activation x [T, K] through a prologue (RMSNorm with a column weight, a residual add,
    casts, activations), multiplied by 1-3 bf16 weights (separate [N, K] ones, or a packed
    [2N, K] gate-and-up weight whose output is chunked), an epilogue (SiLU(g) * u, SiTU, gates,
    residual rows, columns, a statistic of the prologue, casts) to a bf16 row; sometimes a
    second stage (that row times [N2, N]); one or two results. About a third of the seeds read
    every weight in MXFP4 (Humming's layout, whole 64-row tiles)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokens, k, n = rng.choice(TOKENS), 8 * rng.randint(8, 64), 8 * rng.randint(8, 64)
    mxfp4 = random.Random(seed + 1000).random() < 0.35
    if mxfp4:
        k, n = max(128, -(-k // 64) * 64), -(-n // 64) * 64
    names: list[str] = []
    args: list[torch.Tensor] = []

    def arg(name, t):
        names.append(name)
        args.append(t)

    def weight(name, rows, cols):
        if mxfp4:
            codes, scales = _mxfp4_weight(rows, cols, gen)
            arg(name, codes)
            arg(f"{name}_scales", scales)
        else:
            arg(name, _weight(rows, cols, gen))

    def read(v, name):
        """The weight ``name``'s [rows, K] values, as the reference reads them."""
        return torch.ops.k3.mxfp4_dequant(v[name], v[f"{name}_scales"], "humming") if mxfp4 else v[name]

    arg("x", _rand((tokens, k), BF16, gen))
    pro = [rng.choice(PRO_STEPS) for _ in range(rng.randint(0, 3))]
    unary = [rng.choice(sorted(PRO_UNARY)) for _ in pro]
    if "norm" in pro:
        arg("norm_w", _rand((k,), BF16, gen, positive=True))
    if "residual" in pro:
        arg("res", _rand((tokens, k), BF16, gen))

    packed = rng.random() < 0.5
    if packed:
        count = rng.choice([2, 3])
        start = rng.choice(["silu_and_mul", "situ_and_mul", "chunk"])
        weight("w_gu", 2 * n, k)
        if count == 3:
            weight("w_2", n, k)
    else:
        count = rng.choice([1, 2, 3])
        start = rng.choice(["silu_mul", "sigmoid_gate", "add"])
        for i in range(count):
            weight(f"w_{i}", n, k)
    third = rng.choice(["add", "tanh_mul"])
    situ_linear_beta = rng.choice([None, 3.0])

    epi = [rng.choice(EPI_STEPS) for _ in range(rng.randint(0, 3))]
    if "residual" in epi:
        arg("r", _rand((tokens, n), BF16, gen))
    if "col" in epi:
        arg("c", _rand((n,), BF16, gen, positive=True))
    if "argstat" in epi:
        arg("sc", _rand((tokens, 1), torch.float32, gen, positive=True))

    second = rng.random() < 0.4
    n2 = 8 * rng.randint(8, 64)
    n2 = -(-n2 // 64) * 64 if mxfp4 else n2
    epi2 = [rng.choice(EPI2_STEPS) for _ in range(rng.randint(0, 2))] if second else []
    if second:
        weight("w2", n2, n)
        if "residual" in epi2:
            arg("r2", _rand((tokens, n2), BF16, gen))
        if "col" in epi2:
            arg("c2", _rand((n2,), BF16, gen, positive=True))
    extra = rng.choice([None, None, "product", "depth0", "fp32"] + (["packed_whole"] if packed else []))

    def fn(*ts):
        v = dict(zip(names, ts, strict=True))
        x = v["x"]
        hp = x.float()
        for step, name in zip(pro, unary):
            if step == "norm":
                hp = rms_norm(hp.to(BF16), v["norm_w"], EPS).float()
            elif step == "residual":
                hp = hp + v["res"].float()
            elif step == "cast":
                hp = hp.to(BF16).float()
            else:
                hp = PRO_UNARY[name](hp)
        a = hp.to(BF16) if pro else x
        stat = torch.rsqrt(hp.pow(2).mean(-1, keepdim=True) + 1.0)  # a statistic of the prologue

        if packed:
            gu = F.linear(a, read(v, "w_gu"))
            g, u = gu.chunk(2, -1)
            if start == "silu_and_mul":
                h = silu_and_mul(gu).float()
            elif start == "situ_and_mul":
                h = situ_and_mul(gu, 2.0, situ_linear_beta).float()
            else:
                h = F.silu(g.float()) * u.float()
            products = [g, u] + ([F.linear(a, read(v, "w_2"))] if count == 3 else [])
        else:
            products = [F.linear(a, read(v, f"w_{i}")) for i in range(count)]
            g = products[0]
            h = products[0].float()
            if count >= 2:
                p = products[1].float()
                h = F.silu(h) * p if start == "silu_mul" else h * torch.sigmoid(p) if start == "sigmoid_gate" else h + p
        if count == 3:
            p = products[2].float()
            h = h + p if third == "add" else h * torch.tanh(p)
        for step in epi:
            if step == "tanh":
                h = torch.tanh(h)
            elif step == "sigmoid_gate":
                h = h * torch.sigmoid(h)
            elif step == "residual":
                h = h + v["r"].float()
            elif step == "col":
                h = h * v["c"].float()
            elif step == "stat":
                h = h * stat
            elif step == "argstat":
                h = h * v["sc"]
            else:
                h = h.to(BF16).float()
        out = h.to(BF16)
        if second:
            h2 = F.linear(out, read(v, "w2")).float()
            for step in epi2:
                if step == "tanh":
                    h2 = torch.tanh(h2)
                elif step == "residual":
                    h2 = h2 + v["r2"].float()
                elif step == "col":
                    h2 = h2 * v["c2"].float()
                else:
                    h2 = h2.to(BF16).float()
            out = h2.to(BF16)
        if extra is None:
            return out
        return out, {"product": g, "depth0": a if pro else torch.tanh(x.float()), "fp32": h,
                     "packed_whole": gu if packed else None}[extra]

    # a kernel per (products' depth, output width): the packed weight's whole output is one more
    stages = 1 + second + (extra == "packed_whole")
    info = {"stages": stages, "count": count, "tokens": tokens, "start": start, "pro": set(pro), "epi": set(epi),
            "second": second, "extra": extra, "mxfp4": mxfp4}
    return fn, args, info


@pytest.mark.parametrize("seed", range(40))
def test_random_products_lower_to_what_the_reference_computes(seed):
    fn, args, info = random_products(seed)
    products = lower(fn, args)
    assert isinstance(products, Products), type(products)
    assert len(products.stages) == info["stages"], (seed, [(s.k, s.n, s.weights) for s in products.stages])
    assert len(products.stages[0].weights) == info["count"], (seed, products.stages[0].weights)
    assert all(s.epilogue.reductions == 0 for s in products.stages)
    _weights_are_bf16_rows(products, args)
    _check(products, fn, args, seed)


@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("seed", range(0, 40, 5))
def test_random_products_compile_with_their_main_loops_ptx(kcache, arch, seed):
    """A sample of the corpus, compiled: the GEMV's streamed loads at one token, the GEMM's
    cp.async ring and MMA from two (where a stage reads its activation as it is), PDL, no local
    memory (a spill)."""
    from codegen.compiler import compile_kernel
    from codegen.launchers.generated import product_specs

    fn, args, info = random_products(seed)
    products = lower(fn, args)
    specs = product_specs("k3f::corpus", arch, products, [a for a in args if isinstance(a, torch.Tensor)])
    if info["mxfp4"] and info["count"] == 3:  # codes and scales of three products: more than a kernel's 4 slots
        assert specs == "stage 0: 6 weights, at most 4", specs
        return
    assert not isinstance(specs, str), specs
    promised = {"product_gemv": "ld.global.L1::no_allocate.L2::256B.v4",
                "product_gemm": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "rowwise": "ld.global.v4"}
    for spec in specs:
        ptx = compile_kernel(spec, cache=kcache).ptx
        assert promised[spec.module] in ptx and "griddepcontrol.wait" in ptx, (seed, spec.module)
        assert "ld.local" not in ptx and "st.local" not in ptx, (seed, spec.label())


def test_the_corpus_covers_its_shapes():
    """The seeds above take every token count, stage count, way of combining the products, step
    of the prologue and of the epilogue and extra result."""
    seen: dict[str, set] = {}
    for seed in range(40):
        info = random_products(seed)[2]
        for key, value in info.items():
            seen.setdefault(key, set()).update(value if isinstance(value, set) else {value})
    assert seen["tokens"] == set(TOKENS) and seen["count"] == {1, 2, 3} and seen["second"] == {False, True}
    assert seen["stages"] >= {1, 2} and seen["pro"] == set(PRO_STEPS) and seen["epi"] == set(EPI_STEPS)
    assert seen["start"] == {"silu_and_mul", "situ_and_mul", "chunk", "silu_mul", "sigmoid_gate", "add"}
    assert seen["extra"] == {None, "product", "depth0", "fp32", "packed_whole"}, seen
    assert seen["mxfp4"] == {False, True}


# ---- named shapes ------------------------------------------------------------------------------------
def _latent_tail(x, w, weight, r):
    return F.linear(rms_norm(x, w, EPS), weight) + r


def _latent_tail_args(tokens=5, k=1024, n=384, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_rand((tokens, k), BF16, gen), _rand((k,), BF16, gen, positive=True), _weight(n, k, gen),
            _rand((tokens, n), BF16, gen)]


def test_a_normed_linear_with_a_residual_is_one_stage():
    """``F.linear(rms_norm(x, w), W) + r``: the norm in the prologue (one reduction), the product,
    the residual add in the epilogue (one accumulator and one row argument)."""
    args = _latent_tail_args()
    products = lower(_latent_tail, args)
    assert isinstance(products, Products)
    assert len(products.stages) == 1 and products.temps == () and products.results == 1
    (stage,) = products.stages
    assert (stage.k, stage.n, stage.weights) == (1024, 384, ((2, 0),))
    assert stage.prologue.reductions == 1 and stage.epilogue.reductions == 0
    assert sorted(stage.prologue_from) == [("arg", 0, 0), ("arg", 1, 0)]
    assert stage.prologue_to == (("product",),)
    assert sorted(stage.epilogue_from) == [("acc", 0), ("arg", 3, 0)]
    assert [kind for kind, _ in stage.epilogue.inputs] == ["row", "row"]
    assert stage.epilogue_to == (("result", 0),)
    _check(products, _latent_tail, args)


def _reads(program: Program, value: int) -> int:
    """The input ``value`` is, through roundings."""
    while value >= len(program.inputs):
        op, args = program.ops[value - len(program.inputs)]
        assert op == "round", (op, args)
        value = args[0]
    return value


def _mlp_args(tokens=8, hidden=256, inter=192, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [_rand((tokens, hidden), BF16, gen), _rand((hidden,), BF16, gen, positive=True),
            _weight(2 * inter, hidden, gen), _weight(hidden, inter, gen)]


@pytest.mark.parametrize("act", ["silu", "situ", "situ_linear"])
def test_a_gated_mlp_is_two_stages(act):
    """``F.linear(silu_and_mul(F.linear(rms_norm(x), W_gu)), W_d)``: the first stage multiplies
    the packed weight's gate rows [0, I) and up rows [I, 2I) and writes the gated [T, I] row in
    bf16; the second multiplies it by the down weight."""
    hidden, inter = 256, 192
    gated = {"silu": silu_and_mul, "situ": lambda gu: situ_and_mul(gu, 2.0, None),
             "situ_linear": lambda gu: situ_and_mul(gu, 2.0, 3.0)}[act]

    def mlp(x, w, w_gu, w_d):
        return F.linear(gated(F.linear(rms_norm(x, w, EPS), w_gu)), w_d)

    args = _mlp_args(hidden=hidden, inter=inter)
    products = lower(mlp, args)
    assert isinstance(products, Products)
    assert len(products.stages) == 2 and products.results == 1
    assert products.temps == ((inter, "bf16"),)
    up, down = products.stages
    assert (up.k, up.n, down.k, down.n) == (hidden, inter, inter, hidden)
    assert sorted(up.weights) == [(2, 0), (2, inter)]  # in the order the epilogue asks for them
    assert up.prologue.reductions == 1 and up.epilogue_to == (("temp", 0),)
    assert sorted(up.epilogue_from) == [("acc", 0), ("acc", 1)]
    # the gate (rows [0, I)) is the accumulator the sigmoid reads
    (sigmoid,) = [operands for op, operands in up.epilogue.ops if op == "sigmoid"]
    gate = up.epilogue_from[_reads(up.epilogue, sigmoid[0])]
    assert up.weights[gate[1]] == (2, 0)
    assert down.prologue_from == (("temp", 0),) and down.prologue.ops == ()
    assert down.weights == ((3, 0),) and down.epilogue_to == (("result", 0),)
    _check(products, mlp, args)


def test_products_of_one_activation_at_two_widths_are_two_kernels():
    """q and kv projections of one normed row: one stage per output width, each its own prologue."""
    gen = torch.Generator().manual_seed(2)
    args = [_rand((3, 512), BF16, gen), _rand((512,), BF16, gen, positive=True), _weight(128, 512, gen),
            _weight(320, 512, gen)]

    def fn(x, w, wq, wkv):
        a = rms_norm(x, w, EPS)
        return F.linear(a, wq), F.linear(a, wkv), a

    products = lower(fn, args)
    assert [(s.k, s.n, s.weights) for s in products.stages] == [(512, 128, ((2, 0),)), (512, 320, ((3, 0),))]
    assert all(s.prologue.reductions == 1 for s in products.stages)
    assert ("result", 2) in products.stages[0].prologue_to  # the normed row, written by the first stage
    _check(products, fn, args)


def test_projections_of_one_width_whose_results_never_meet_are_stages_of_their_own():
    """Two slices of one packed weight of the same width (MLA's q and the fourth segment at TP 8),
    each returned on its own: one stage each, so both become parts of one kernel beside the other
    widths; a scaled and a plain product that an epilogue adds stay one stage."""
    gen = torch.Generator().manual_seed(4)
    args = [_rand((3, 256), BF16, gen), _weight(3 * 128 + 64, 256, gen), _rand((128,), BF16, gen, positive=True)]

    def fn(x, w, s):
        a, b, c, d = F.linear(x, w).split([128, 64, 128, 128], dim=-1)
        return a.clone(), (b.float() * 2).to(BF16), c.clone(), (d.float() * s.float() + c.float()).to(BF16)

    products = lower(fn, args)
    stages = sorted((s.n, tuple(sorted(s.weights)), tuple(sorted(s.epilogue_to))) for s in products.stages)
    assert stages == [(64, ((1, 128),), (("result", 1),)),
                      (128, ((1, 0),), (("result", 0),)),  # q alone: a part of its own
                      (128, ((1, 192), (1, 320)), (("result", 2), ("result", 3)))]  # added in one epilogue
    _check(products, fn, args)


def test_a_program_keeps_only_what_its_chosen_outputs_need():
    """``Program.only``: the values an output needs, renumbered; its inputs named by index."""
    p = Program(8, (("row", "bf16"), ("row", "fp32"), ("col", "bf16")),
                (("mul", (0, ("c", 2.0))), ("add", (1, 2)), ("round", (3, "bf16")), ("sigmoid", (4,))),
                ((3, "bf16", (8,)), (5, "fp32", (8,)), (6, "bf16", (8,))))
    sub, kept = p.only([2])
    assert kept == (1, 2)
    assert sub.inputs == (("row", "fp32"), ("col", "bf16"))
    assert sub.ops == (("add", (0, 1)), ("sigmoid", (2,)))
    assert sub.outputs == ((3, "bf16", (8,)),)
    x = [torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)]
    from codegen.lowered import interpret
    assert torch.equal(interpret(sub, [x[i] for i in kept])[0], interpret(p, x)[2])
    assert p.only([0, 1])[1] == (0,)


def test_a_statistic_of_the_prologue_reaches_the_epilogue():
    """A per-token scale of the activation's row, computed in the prologue and kept for the epilogue."""
    gen = torch.Generator().manual_seed(3)
    args = [_rand((5, 256), BF16, gen), _weight(128, 256, gen)]

    def fn(x, weight):
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
        return (F.linear(x, weight).float() * scale).to(BF16), scale

    products = lower(fn, args)
    (stage,) = products.stages
    assert stage.prologue.reductions == 1 and ("keep",) in stage.prologue_to
    keep = stage.prologue_to.index(("keep",))
    assert ("pro", keep) in stage.epilogue_from
    _check(products, fn, args)


# ---- refusals ----------------------------------------------------------------------------------------
def _refusal_args(gen):
    return {"x": _rand((4, 128), BF16, gen), "y": _rand((4, 128), BF16, gen), "w": _weight(64, 128, gen),
            "w2": _weight(64, 128, gen), "b": _rand((64,), BF16, gen), "kn": _weight(128, 64, gen)}


@pytest.mark.parametrize("fn,named", [
    (lambda v: F.linear(v["x"].float(), v["w"].float()).to(BF16), None),  # exact casts to fp32: accepted
    # a product's row reduced after it: cut, the reduction on a tail program (accepted)
    (lambda v: torch.softmax(F.linear(v["x"], v["w"]).float(), -1), None),
    (lambda v: (lambda y: y - y.amax(-1, keepdim=True))(F.linear(v["x"], v["w"]).float()), None),
    (lambda v: F.linear(v["x"], v["w"]).float().sum(-1), None),
    (lambda v: F.linear(v["x"], v["w"]) + F.linear(v["y"], v["w2"]),
     "read arg0_1 and arg1_1: the products of one stage read one activation"),
    (lambda v: v["x"] @ (v["w"] * 2).t(), "product operand permute is computed (mul: aten.mul.Tensor): the generated "
                                          "products read weights as the op's arguments"),
    (lambda v: torch.cumsum(F.linear(v["x"], v["w"]), -1), "aten.cumsum.default (node cumsum) has no lowering"),
    (lambda v: torch.einsum("tk,nk->tn", v["x"], v["w"]), None),  # einsum of two matrices: the product it is
    (lambda v: torch.einsum("tk,kn->tn", v["x"], v["w"].t()), None),
    (lambda v: torch.einsum("tk,nk->nt", v["x"], v["w"]), "aten.bmm.default (node bmm) has no lowering"),
    (lambda v: F.linear(v["x"], v["w"], v["b"]), None),  # a bias: added to the fp32 sums, rounded once
    (lambda v: F.linear(v["x"], v["w"], v["b"]).float() - F.linear(v["x"].float(), v["w"].float(), v["b"].float()),
     None),  # rounded where the reference rounds: its bf16 projection against its fp32 one
    (lambda v: F.linear(v["x"].float() * 2, v["w"].float()), "multiplies mul, torch.float32: the generated products "
                                                             "multiply bf16 activations"),
    (lambda v: (F.linear(v["x"], v["w"]), v["w"]), "the reference returns its argument"),
    (lambda v: v["x"] @ v["kn"], "product operand arg5_1 reads the argument arg5_1 as a [K, N] weight (x @ W): "
                                 "the product kernels read weights as [N, K] rows"),
])
def test_what_the_products_cannot_express_is_refused_by_name(fn, named):
    gen = torch.Generator().manual_seed(4)
    v = _refusal_args(gen)
    names = list(v)

    def call(*ts):
        return fn(dict(zip(names, ts, strict=True)))

    args = list(v.values())
    if named is None:
        _check(lower(call, args), call, args)
        return
    with pytest.raises(LoweringError, match=re.escape(named)):
        lower(call, args)


def test_an_fp32_weight_is_refused():
    gen = torch.Generator().manual_seed(5)
    x, w = _rand((4, 128), BF16, gen), _rand((64, 128), torch.float32, gen)
    with pytest.raises(LoweringError, match=re.escape("weight arg1_1 is torch.float32: the generated products read "
                                                      "bf16, fp8_e4m3 weights")):
        lower(lambda x, w: F.linear(x.float(), w), [x, w])


FP8 = torch.float8_e4m3fn


def _fp8_weight(rows, k, gen):
    """fp8 E4M3 rows of O(1) values, and a per-channel fp32 scale making a product of an O(1)
    activation O(1)."""
    return _rand((rows, k), torch.float32, gen).to(FP8), _rand((rows, 1), torch.float32, gen, k ** -0.5,
                                                                 positive=True)


@pytest.mark.parametrize("form", ["per_channel_fp32", "per_tensor_fp32", "per_channel_after", "per_tensor_after"])
def test_fp8_weights_are_products_scaled_in_the_epilogue(form):
    """The forms an fp8 projection is written in: the weight times its scale in fp32 (per channel
    [N, 1], per tensor one element), or the product of the converted weight times the scale;
    both become a product of the fp8 rows with the scale on its fp32 sums."""
    gen = torch.Generator().manual_seed(13)
    x, (w, s) = _rand((5, 256), BF16, gen), _fp8_weight(96, 256, gen)
    t = s.mean().reshape(1) if form.startswith("per_tensor") else s
    fn = {"per_channel_fp32": lambda x, w, s: F.silu(F.linear(x.float(), w.float() * s)).to(BF16),
          "per_tensor_fp32": lambda x, w, s: F.linear(x.float(), w.float() * s).to(BF16),
          "per_channel_after": lambda x, w, s: (F.linear(x, w.to(BF16)) * s.reshape(-1)).to(BF16),
          "per_tensor_after": lambda x, w, s: F.linear(x, w.to(BF16)) * s}[form]
    products = lower(fn, [x, w, t])
    (stage,) = products.stages
    assert stage.weight_dtype == "fp8_e4m3" and stage.weights == ((1, 0),)
    reads = {src[0] for src in stage.epilogue_from}
    assert ("scalar" in reads) == form.startswith("per_tensor") and "acc" in reads
    assert Stage.from_params(stage.to_params()) == stage
    _check(products, fn, [x, w, t])


def test_an_fp8_weights_row_slices_take_their_rows_of_the_scale():
    """A packed fp8 gate-and-up weight: each half's product reads its own rows of the per-channel scale."""
    gen = torch.Generator().manual_seed(14)
    x, (w, s) = _rand((3, 256), BF16, gen), _fp8_weight(2 * 64, 256, gen)

    def fn(x, w, s):
        gate, up = F.linear(x.float(), w.float() * s).chunk(2, dim=-1)
        return (F.silu(gate) * up).to(BF16)
    products = lower(fn, [x, w, s])
    (stage,) = products.stages
    assert sorted(stage.weights) == [(1, 0), (1, 64)]
    assert sorted(src for src in stage.epilogue_from if src[0] == "arg") == [("arg", 2, 0), ("arg", 2, 64)]
    _check(products, fn, [x, w, s])


def test_a_scaled_weight_rounded_before_its_product_is_refused_by_name():
    """bf16(W * s) rounds each weight: the kernels scale the product's fp32 sums instead, so the
    reference is refused rather than approximated."""
    gen = torch.Generator().manual_seed(15)
    x, (w, s) = _rand((3, 256), BF16, gen), _fp8_weight(64, 256, gen)
    with pytest.raises(LoweringError, match="is rounded to bf16 before its product"):
        lower(lambda x, w, s: F.linear(x, (w.float() * s).to(BF16)), [x, w, s])
    with pytest.raises(LoweringError, match="scales go with fp8 weights"):
        lower(lambda x, w, s: F.linear(x.float(), w.float() * s), [x, _weight(64, 256, gen), s])


def test_mxfp4_weights_are_products_of_their_rows_in_humming_s_layout():
    """``k3.mxfp4_dequant`` of two arguments is the product's weight: a packed gate-and-up's halves
    are products of their 64-row tiles, each with the scales argument beside it."""
    gen = torch.Generator().manual_seed(16)
    x, (codes, scales) = _rand((3, 256), BF16, gen), _mxfp4_weight(2 * 128, 256, gen)

    def fn(x, codes, scales):
        gate, up = F.linear(x, torch.ops.k3.mxfp4_dequant(codes, scales, "humming")).chunk(2, dim=-1)
        return F.silu(gate) * up
    products = lower(fn, [x, codes, scales])
    (stage,) = products.stages
    assert stage.weight_dtype == "mxfp4/humming" and sorted(stage.weights) == [(1, 0), (1, 128)]
    assert stage.scales == (2, 2) and stage.weight_tensors == 4
    assert Stage.from_params(stage.to_params()) == stage
    _check(products, fn, [x, codes, scales])


@pytest.mark.parametrize("form,named", [
    ("checkpoint", "in the 'checkpoint' layout: the generated products read Humming's"),
    ("half_tile", "rows 32..96 of MXFP4 weight mxfp4_dequant: Humming's layout is read in whole 64-row tiles"),
    ("expert", "its codes and scales are the op's arguments"),
])
def test_what_an_mxfp4_product_cannot_be_is_refused_by_name(form, named):
    gen = torch.Generator().manual_seed(17)
    x = _rand((3, 256), BF16, gen)
    if form == "checkpoint":
        codes, scales = random_mxfp4(1, 128, 256, generator=gen)
        codes, scales = codes[0], scales[0]

        def fn(x, codes, scales):
            return F.linear(x, torch.ops.k3.mxfp4_dequant(codes, scales, "checkpoint"))
    elif form == "half_tile":
        codes, scales = _mxfp4_weight(128, 256, gen)

        def fn(x, codes, scales):
            return F.linear(x, torch.ops.k3.mxfp4_dequant(codes, scales, "humming")[32:96])
    else:  # one expert of several, chosen inside the op
        codes, scales = MXFP4.from_checkpoint(*random_mxfp4(2, 128, 256, generator=gen))

        def fn(x, codes, scales):
            return F.linear(x, torch.ops.k3.mxfp4_dequant(codes[1], scales[1], "humming"))
    with pytest.raises(LoweringError, match=re.escape(named)):
        lower(fn, [x, codes, scales])


def test_a_norm_between_two_products_is_refused():
    """A norm of a product's row before the next product is a reduction in the first epilogue."""
    gen = torch.Generator().manual_seed(6)
    args = [_rand((4, 128), BF16, gen), _weight(64, 128, gen), _rand((64,), BF16, gen), _weight(96, 64, gen)]
    with pytest.raises(LoweringError, match="the epilogue reduces a product's row"):
        lower(lambda x, w, nw, w2: F.linear(rms_norm(F.linear(x, w), nw, EPS), w2), args)


def test_stages_refuse_malformed_data():
    pro = Program(8, (("row", "bf16"),), (), ((0, "bf16", (8,)),))
    epi = Program(4, (("row", "fp32"),), (("round", (0, "bf16")),), ((1, "bf16", (4,)),))
    good = Stage(pro, (("arg", 0, 0),), (("product",),), ((1, 0),), epi, (("acc", 0),), (("result", 0),))
    assert good.k == 8 and good.n == 4
    with pytest.raises(LoweringError, match="the stage has 1 products"):
        Stage(pro, (("arg", 0, 0),), (("product",),), ((1, 0),), epi, (("acc", 1),), (("result", 0),))
    with pytest.raises(LoweringError, match="a stage without a product"):
        Stage(pro, (("arg", 0, 0),), (("product",),), (), epi, (("acc", 0),), (("result", 0),))
    summed = Program(4, (("row", "fp32"),), (("sum", (0,)), ("mul", (0, 1))), ((2, "fp32", (4,)),))
    with pytest.raises(LoweringError, match="the epilogue reduces"):
        Stage(pro, (("arg", 0, 0),), (("product",),), ((1, 0),), summed, (("acc", 0),), (("result", 0),))
    fp32_out = Program(8, (("row", "fp32"),), (), ((0, "fp32", (8,)),))
    with pytest.raises(LoweringError, match="the products' activation, a bf16 row"):
        Stage(fp32_out, (("arg", 0, 0),), (("product",),), ((1, 0),), epi, (("acc", 0),), (("result", 0),))


# ---- as a kernel spec's parameter --------------------------------------------------------------------
def _examples():
    fn0, args0, _ = random_products(3)
    mlp_args = _mlp_args()

    def mlp(x, w, w_gu, w_d):
        return F.linear(silu_and_mul(F.linear(rms_norm(x, w, EPS), w_gu)), w_d)

    return [(_latent_tail, _latent_tail_args()), (mlp, mlp_args), (fn0, args0)]


@pytest.mark.parametrize("i", range(3))
def test_products_round_trip_through_their_params(i):
    fn, args = _examples()[i]
    products = lower(fn, args)
    params = products.to_params()
    assert Products.from_params(params) == products
    assert hash(params) == hash(lower(fn, args).to_params())  # the kernel cache keys on it: the same each time
    # through a spec's canonical JSON (lists come back as tuples) and back
    spec = KernelSpec.make("products", "k3f::probe", "sm_90a", params={"products": params})
    again = KernelSpec.from_json(json.loads(spec.canonical()))
    assert again == spec and hash(again) == hash(spec)
    assert Products.from_params(again.param_dict["products"]) == products


# ---- slices of weights and of products, and results that must be whole -----------------------------
def _lowers_right_or_refuses(fn, args):
    try:
        products = lower(fn, args)
    except LoweringError:
        return False
    _weights_are_bf16_rows(products, args)
    _check(products, fn, args)
    return True


@pytest.mark.parametrize("which", ["slice", "chunk", "slice_after_t"])
def test_a_row_slice_of_a_weight_is_a_product_of_those_rows(which):
    gen = torch.Generator().manual_seed(7)
    x, w = _rand((4, 128), BF16, gen), _weight(192, 128, gen)
    fn = {"slice": lambda x, w: F.linear(x, w[64:]), "chunk": lambda x, w: F.linear(x, w[:128].chunk(2)[1]),
          "slice_after_t": lambda x, w: x @ w.t()[:, 64:128]}[which]
    products = lower(fn, [x, w])
    assert products.stages[0].weights == ((1, 64),)
    _check(products, fn, [x, w])


def test_a_k_slice_of_a_weight_is_refused_or_lowered_right():
    gen = torch.Generator().manual_seed(8)
    x, w = _rand((4, 64), BF16, gen), _weight(64, 128, gen)
    _lowers_right_or_refuses(lambda x, w: F.linear(x, w[:, :64]), [x, w])


def test_a_negative_slice_of_a_product_is_its_last_columns():
    gen = torch.Generator().manual_seed(9)
    x, w = _rand((4, 128), BF16, gen), _weight(128, 128, gen)
    _lowers_right_or_refuses(lambda x, w: F.linear(x, w)[:, -64:], [x, w])


def test_a_wide_result_of_the_arguments_is_refused_or_whole():
    gen = torch.Generator().manual_seed(10)
    x, w, r = _rand((4, 128), BF16, gen), _weight(64, 128, gen), _rand((4, 256), BF16, gen)
    _lowers_right_or_refuses(lambda x, w, r: (F.linear(x, w), (r.float() * 2).to(BF16)), [x, w, r])


def test_the_generated_rule_example_is_served_by_generated_kernels():
    """``examples/generated_rule.py`` takes the shared experts from the built-in rule, and the plan
    (what inspect, compile and the server read) serves its op on two generated kernels: on the
    GEMV's main loop at one token, the tensor-core GEMM's from two."""
    from pathlib import Path

    from rewriter.commands.layer_args import rule_set
    from rewriter.compiler.pipeline import decode_shape, rewritten_layer
    from rewriter.compiler.plan import plan
    from rewriter.model.config import KimiK3Config

    rules = rule_set([Path(__file__).resolve().parents[1] / "examples" / "generated_rule.py"])
    cfg = KimiK3Config.preset("kimi-k3")
    for batch in (1, 8, 64):
        result = rewritten_layer(cfg, 1, decode_shape(cfg, batch=batch, tp=16, arch="sm_90a"), rules)
        rows = {r["op"]: r for r in plan(result, "sm_90a") if r.get("op")}
        row = rows["k3f::my_shared_experts"]
        assert (row["status"], row["implementation"]) == ("pending", "generated"), row
        main_loop = "product_gemv" if batch == 1 else "product_gemm"
        assert [s.module for s in row["specs"]] == [main_loop, main_loop]
        assert "k3f::shared_experts" not in rows
        # the rest as without the rule: the router's and the input projection's ops on their
        # generated kernels, the others hand-written
        generated = ("k3f::router_down", "k3f::kda_in_proj")
        assert all(r["implementation"] == ("generated" if op in generated else "hand-written")
                   for op, r in rows.items() if op != "k3f::my_shared_experts")


def test_a_result_all_reduced_last_is_the_hosts_collective():
    """The dense MLP's reference ends in ``k3.all_reduce``: the stages compute the partial, and
    the result is marked for the host's all-reduce; one before a product is refused by name."""
    gen = torch.Generator().manual_seed(11)
    x, gu, down = _rand((3, 256), BF16, gen), _weight(2 * 64, 256, gen), _weight(256, 64, gen)

    def mlp(x, gu, down):
        return torch.ops.k3.all_reduce(F.linear(silu_and_mul(F.linear(x, gu)), down), "tp", 4)

    products = lower(mlp, [x, gu, down])
    assert len(products.stages) == 2 and products.collectives == ((0, "all_reduce", "tp", 4),)
    assert Products.from_params(products.to_params()) == products
    (got,) = interpret_products(products, [x, gu, down])
    assert rel_err(got, F.linear(silu_and_mul(F.linear(x, gu)), down)) < 1e-2
    with pytest.raises(LoweringError, match="a product after the all-reduce all_reduce"):
        lower(lambda x, gu, down: F.linear(torch.ops.k3.all_reduce(F.linear(x, gu), "tp", 4)[:, :64], down),
              [x, gu, down])


def _o_proj_residual_norm(o, w, r, nw):
    """o_proj's partial sums all-reduced, then the residual add and the norm (TP 4)."""
    h = torch.ops.k3.all_reduce(F.linear(o, w), "tp", 4) + r
    return rms_norm(h, nw, EPS), h


def _proj_residual_norm(o, w, r, nw):
    """A projection, its residual add and the norm of the sum, on one rank (no all-reduce)."""
    h = F.linear(o, w) + r
    return rms_norm(h, nw, EPS), h


def test_an_einsum_of_two_matrices_lowers_as_the_linear_it_is():
    """PyTorch traces ``einsum`` as a batched ``bmm`` over views; the lowering traces the
    two-matrix forms as ``mm``, so the rule's op gets the very stages of ``F.linear``."""
    gen = torch.Generator().manual_seed(19)
    x, w = _rand((4, 256), BF16, gen), _weight(128, 256, gen)
    as_einsum = lower(lambda x, w: F.silu(torch.einsum("tk,nk->tn", [x, w])), [x, w])
    assert as_einsum == lower(lambda x, w: F.silu(F.linear(x, w)), [x, w])


def _residual_norm_args(seed: int) -> list[torch.Tensor]:
    """(o [5, 512], w [256, 512], r [5, 256], nw [256]) for the two residual-norm references."""
    gen = torch.Generator().manual_seed(seed)
    return [_rand((5, 512), BF16, gen), _weight(256, 512, gen), _rand((5, 256), BF16, gen),
            _rand((256,), BF16, gen, positive=True)]


def test_a_products_row_reduced_after_it_is_cut_and_a_tail_program_reduces_it():
    """A product's row is spread over the kernel's CTAs: the stage writes the residual sum (bf16,
    the narrowest row every reduction follows) to an intermediate, and a tail program computes
    the norm and writes both results from it; no collective between them."""
    from codegen.launchers.generated import product_specs

    args = _residual_norm_args(18)
    products = lower(_proj_residual_norm, args)
    (stage,) = products.stages
    assert stage.epilogue_to == (("temp", 0),) and products.temps == ((256, "bf16"),)
    assert products.between == () and len(products.tails) == 1
    assert products.tails[0].dests == (("result", 0), ("result", 1))
    _check(products, _proj_residual_norm, args)
    specs = product_specs("k3f::probe", "sm_90a", products, args)
    assert [s.module for s in specs] == ["product_gemm", "rowwise"] and specs[1].param_dict["before"] == ()


def test_an_fp8_result_is_the_tail_programs_and_refused_in_an_epilogue():
    """A projection's row quantized to fp8 E4M3 with its per-token scale: the scale reduces the
    row, so a tail program (the rowwise kernel, which writes fp8) computes both; a pointwise fp8
    epilogue is refused by the product kernels by name."""
    from codegen.launchers.generated import product_specs

    gen = torch.Generator().manual_seed(8)
    args = [_rand((5, 256), BF16, gen), _weight(512, 256, gen)]

    def quantized(x, w):
        y = F.linear(x, w).float()
        scale = y.abs().amax(-1, keepdim=True) / 448.0
        return (y / scale).to(torch.float8_e4m3fn), scale

    products = lower(quantized, args)
    assert products.tails[0].program.outputs[0][1] == "fp8_e4m3"
    _check(products, quantized, args)
    assert [s.module for s in product_specs("k3f::probe", "sm_90a", products, args)] == ["product_gemm", "rowwise"]
    static = lower(lambda x, w: (F.linear(x, w).float() * 8.0).to(torch.float8_e4m3fn), args)
    assert "stage 0 reads or writes an fp8 row" in product_specs("k3f::probe", "sm_90a", static, args)


def test_an_all_reduce_inside_the_op_is_the_hosts_and_a_tail_program_follows_it():
    """The stages write the all-reduce's input to an intermediate, the host all-reduces it, and a
    tail program (the rowwise kernel) computes the residual add and the norm from it."""
    from codegen.launchers.generated import product_specs
    from rewriter.model.ops import collectives_excluded

    args = _residual_norm_args(16)
    products = lower(_o_proj_residual_norm, args)
    (stage,) = products.stages
    assert stage.epilogue_to == (("temp", 0),) and products.temps == ((256, "bf16"),)
    assert products.between == ((0, "all_reduce", "tp", 4),) and len(products.tails) == 1
    assert products.tails[0].dests == (("result", 0), ("result", 1))
    assert ("temp", 0) in products.tails[0].sources
    assert Products.from_params(products.to_params()) == products
    with collectives_excluded():  # one rank's view: the all-reduce is the identity
        _check(products, _o_proj_residual_norm, args)
    specs = product_specs("k3f::probe", "sm_90a", products, args)
    assert [s.module for s in specs] == ["product_gemm", "rowwise"]
    assert specs[1].param_dict["before"] == ((0, "all_reduce", "tp", 4),)


@pytest.mark.parametrize("fn,named", [
    (lambda x, w, w2: F.linear(torch.ops.k3.all_reduce(F.linear(x, w), "tp", 4), w2),
     "a product after the all-reduce"),
    (lambda x, w, w2: (torch.ops.k3.all_reduce(F.linear(x, w), "tp", 4).float() + F.linear(x, w).float()).to(BF16),
     "computed before the all-reduce, is read after it"),
    (lambda x, w, w2: torch.ops.k3.all_reduce(torch.ops.k3.all_reduce(F.linear(x, w), "tp", 4) * 2, "tp", 2) * 3,
     "is a collective inside the op"),
    (lambda x, w, w2: F.linear(torch.ops.k3.all_reduce(x, "tp", 4), w), "comes before any product"),
])
def test_what_a_collective_inside_cannot_be_is_refused_by_name(fn, named):
    gen = torch.Generator().manual_seed(17)
    args = [_rand((3, 256), BF16, gen), _weight(256, 256, gen), _weight(128, 256, gen)]
    with pytest.raises(LoweringError, match=named):
        lower(fn, args)


def test_results_gathered_last_are_the_hosts_collectives():
    """The router's reference: this rank's rows of two replicated weights, each result gathered
    over the ranks; the gathers run after the kernels, in the results' order, and the two
    products of different widths read one activation (one kernel's parts)."""
    from rewriter.model.ops import gather_last_dim

    gen = torch.Generator().manual_seed(12)
    x, gate, down = _rand((5, 256), BF16, gen), _weight(4 * 24, 256, gen), _weight(4 * 64, 256, gen)

    def router(x, gate, down):
        logits = F.linear(x.float(), gate.chunk(4)[1].float())
        return gather_last_dim(logits, "tp", 4), gather_last_dim(F.linear(x, down.chunk(4)[1]), "tp", 4)

    products = lower(router, [x, gate, down])
    assert products.collectives == ((0, "gather_last_dim", "tp", 4), (1, "gather_last_dim", "tp", 4))
    assert [(st.n, st.weights) for st in products.stages] == [(24, ((1, 24),)), (64, ((2, 64),))]
    logits, latent = interpret_products(products, [x, gate, down])
    assert logits.dtype == torch.float32 and rel_err(logits, F.linear(x.float(), gate[24:48].float())) < 1e-5
    assert rel_err(latent, F.linear(x, down[64:128])) < 1e-2


def test_the_weights_benchmark_times_generated_kernels_at_its_shapes():
    """``examples/bench_product_weights.py``: both of its ops lower to the products template at
    its default shapes (MXFP4 on the GEMM at every count, bf16 on the GEMV at one token), so the
    table it prints is of generated kernels."""
    from codegen.launchers.generated import PRODUCTS
    from conftest import example_module
    from rewriter.compiler.plan import install_host

    install_host()
    example_module("bench_product_weights")
    shapes = MXFP4.tensors(1, 4096, 7168)
    for tokens in (1, 8, 32, 48, 64):
        x = torch.empty(tokens, 7168, dtype=BF16, device="meta")
        codes, scales = (torch.empty(shapes[k][0][1:], dtype=shapes[k][1], device="meta")
                         for k in ("weight", "weight_scale"))
        (mx,) = PRODUCTS.make_specs("k3f::bench_mxfp4_projection", "sm_90a", [x, codes, scales])
        (bf,) = PRODUCTS.make_specs("k3f::bench_bf16_projection", "sm_90a",
                                    [x, torch.empty(4096, 7168, dtype=BF16, device="meta")])
        assert mx.module == "product_gemm" and bf.module == ("product_gemv" if tokens == 1 else "product_gemm")
        tiling = {key: mx.param_dict[key] for key in ("rows_per_cta", "split_k", "token_groups")}
        # the MXFP4 loop on 64-row tiles: to 16 tokens 8 K splits (512 CTAs, about 4 an SM); at two
        # token groups 2 (128 CTAs, one an SM); 48 tokens (one group of a 48-token tile) as the GEMM
        assert tiling == ({"rows_per_cta": 64, "split_k": 8, "token_groups": 1} if tokens <= 16 else
                          {"rows_per_cta": 128, "split_k": 4, "token_groups": 1} if tokens == 48 else
                          {"rows_per_cta": 64, "split_k": 2, "token_groups": 2}), (tokens, tiling)
