"""Kernels generated from a fused op's reference (``rewriter.compiler.lowering`` ->
``codegen.lowered.Program`` -> ``codegen/kernels/rowwise.py``): what the lowering takes, what it
refuses by name, that the program computes what the reference does (its interpreter against the
reference in torch, over a corpus of random chains of every supported op at random shapes and
dtypes), that the generated kernel compiles for sm_90a and sm_100a with the PTX its class
promises, and, on a GPU, that it matches the program on fresh random inputs, alone and inside a
CUDA graph."""
from __future__ import annotations

import random
import re

import pytest
import torch

from codegen.lowered import LoweringError, Program, interpret
from codegen.templates import spec_for_call
from conftest import divergent_warp_collectives, gpu_kernels, needs_cutedsl, on_gpu, rel_err
from rewriter.compiler.lowering import lower
from rewriter.compiler.rules import fused_op
from rewriter.model.layers.common import rms_norm

F = torch.nn.functional


def _rand(shape, dtype, gen, positive=False):
    t = torch.randn(shape, generator=gen)
    return (t.abs() + 0.5 if positive else t).to(dtype)


# ---- the corpus: random chains of the supported ops ----------------------------------------------
UNARY = {
    "neg": torch.neg, "exp": lambda x: torch.exp(x.clamp(-8, 8)), "log": lambda x: torch.log(x.abs() + 1),
    "sqrt": lambda x: torch.sqrt(x.abs() + 0.1), "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1), "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "abs": torch.abs, "relu": torch.relu, "erf": torch.erf, "silu": F.silu,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "square": lambda x: x.pow(2),
    "reciprocal": lambda x: torch.reciprocal(x.abs() + 0.5),
}
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 0.5),
          "max": torch.maximum, "min": torch.minimum}
REDUCE = {"mean": lambda x: x.mean(-1, keepdim=True), "sum": lambda x: x.sum(-1, keepdim=True) * 0.01,
          "amax": lambda x: x.amax(-1, keepdim=True), "amin": lambda x: x.amin(-1, keepdim=True)}


def random_chain(seed: int):
    """(fn, its inputs): a random chain over a row input, a second row, a column and a statistic:
    steps of unary, binary (with a row, a column, the statistic, a reduction of the chain or a
    constant), casts to bf16 and back; one or two outputs, a row and maybe a statistic."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokens, width = rng.choice([1, 2, 3, 8, 17]), 8 * rng.choice([1, 4, 32, 97, 128, 448, 896, 1024, 2048])
    dtypes = [rng.choice([torch.bfloat16, torch.float32]) for _ in range(4)]
    inputs = [_rand((tokens, width), dtypes[0], gen), _rand((tokens, width), dtypes[1], gen),
              _rand((width,), dtypes[2], gen), _rand((tokens, 1), dtypes[3], gen)]
    steps = []
    for _ in range(rng.randint(2, 7)):
        kind = rng.choice(["unary", "binary", "binary", "cast", "reduce"])
        steps.append((kind, rng.choice(sorted({"unary": UNARY, "binary": BINARY, "reduce": REDUCE,
                                                 "cast": {"bf16": 0}}[kind])), rng.choice(["row", "col", "stat",
                                                                                          "const", "self"])))
    with_stat = rng.random() < 0.5

    def fn(x, r, c, s):
        h = x.float()  # every chain computes in fp32 from its first step
        for kind, name, other in steps:
            if kind == "unary":
                h = UNARY[name](h)
            elif kind == "cast":
                h = h.to(torch.bfloat16).float()
            elif kind == "reduce":
                h = h * torch.rsqrt(REDUCE[name](h).abs() + 1.0) if name == "mean" else h - REDUCE[name](h)
            else:
                b = {"row": r.float(), "col": c.float(), "stat": s.float(), "const": torch.tensor(0.75),
                     "self": h}[other]
                if other != "const":
                    h = BINARY[name](h, b)
                elif name in ("max", "min"):  # a bound: clamp
                    h = h.clamp(min=0.75) if name == "max" else h.clamp(max=0.75)
                else:
                    h = BINARY[name](h, torch.tensor(0.75))
        out = h.to(torch.bfloat16)
        return (out, h.amax(-1, keepdim=True)) if with_stat else out

    return fn, inputs


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_lower_to_what_the_reference_computes(seed):
    fn, inputs = random_chain(seed)
    program = lower(fn, inputs)
    want = fn(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    got = interpret(program, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert not torch.isnan(g).any() and not torch.isinf(g).any()
        # bf16 results may round one ulp apart where a sum is taken in another order
        assert rel_err(g, w) <= (8e-3 if w.dtype == torch.bfloat16 else 1e-5), (seed, program.ops)


def test_the_models_rms_norm_lowers_exactly():
    gen = torch.Generator().manual_seed(0)
    x, w = _rand((5, 7168), torch.bfloat16, gen), _rand((7168,), torch.bfloat16, gen)
    program = lower(lambda x, w: rms_norm(x, w, 1e-5), [x, w])
    assert program.inputs == (("row", "bf16"), ("col", "bf16")) and program.reductions == 1
    assert torch.equal(interpret(program, [x, w])[0], rms_norm(x, w, 1e-5))


def test_softmax_and_statistics_as_outputs():
    gen = torch.Generator().manual_seed(1)
    x = _rand((3, 256), torch.float32, gen)

    def fn(x):
        return torch.softmax(x, -1), x.amax(-1)

    program = lower(fn, [x])
    soft, top = interpret(program, [x])
    assert rel_err(soft, torch.softmax(x, -1)) < 1e-6 and top.shape == (3,) and torch.equal(top, x.amax(-1))
    assert program.outputs[1][2] == ()  # a [T] statistic, as the reference returns it


# norms, statistics and activations beyond the model's own ops, as a user's rule writes them: each
# lowers through PyTorch's decompositions or a translation into the programs' ops
BEYOND = {
    "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    "layer_norm_no_affine": lambda x, w, b: F.layer_norm(x, (x.shape[-1],)),
    "std_and_var": lambda x, w, b: (x.float().std(-1, keepdim=True), x.float().var(-1, correction=0)),
    "var_mean": lambda x, w, b: torch.var_mean(x.float(), -1, keepdim=True)[0] + x.float(),
    "log_softmax": lambda x, w, b: torch.log_softmax(x.float(), -1),
    "logsumexp": lambda x, w, b: torch.logsumexp(x.float(), -1, keepdim=True),
    "leaky_relu": lambda x, w, b: F.leaky_relu(x, 0.2) * w,
    "elu": lambda x, w, b: F.elu(x.float(), alpha=0.7),
    "absmax_scale": lambda x, w, b: x.float() / x.float().abs().max(-1, keepdim=True).values,
    "min_values": lambda x, w, b: x - x.min(-1).values.unsqueeze(-1),
    "exp2_log2": lambda x, w, b: torch.exp2(x.float().clamp(-8, 8)) + torch.log2(x.float().abs() + 1),
    "where_gate": lambda x, w, b: torch.where(x > 0, x, 0.5 * x) * w,
    "masked_fill": lambda x, w, b: x.masked_fill(x.float() < -1.0, 0.0),
    "where_row_stat_col": lambda x, w, b: torch.where(x.float() > x.float().mean(-1, keepdim=True), x.float(),
                                                      w.float()),
    "softplus_mish": lambda x, w, b: (F.softplus(x.float()), F.mish(x.float())),
    "log1p_expm1_small": lambda x, w, b: torch.log1p(x.float() * 1e-6) + torch.expm1(x.float() * 1e-6),
    "log1p_expm1": lambda x, w, b: torch.log1p(x.float().abs()) * torch.expm1(x.float().clamp(-20, 5)),
    "sign": lambda x, w, b: torch.sign(x) * w,
    "predicates": lambda x, w, b: (((x > 0) & (x < 1)) | ~(b > 0)).to(torch.bfloat16) * x,
    # PyTorch's own RMSNorm: its decomposition adds the epsilon in place (``add_``)
    "functional_rms_norm": lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
    # activations of [B, S, N]: the tokens span two dims
    "batch_and_sequence": lambda x, w, b: F.rms_norm(F.silu(x.view(1, *x.shape)), (x.shape[-1],), w) + b,
    # quantized activations: a norm with its per-token fp8 scale, and SiLU at a static scale
    "fp8_dynamic_quant": lambda x, w, b: _fp8_dynamic_quant(F.rms_norm(x, (x.shape[-1],), w, 1e-6).float()),
    "fp8_static_quant": lambda x, w, b: (F.silu(x.float()) / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn),
    # rounding (torch.round: half to even), int8 quantized and back, trigonometry, powers
    "rounding": lambda x, w, b: (torch.round(x.float() * 4) + torch.floor(x.float() * 3) - torch.ceil(x.float() * 2)
                                 + torch.trunc(x.float() * 5)),
    "int8_fake_quant": lambda x, w, b: _int8_fake_quant(x.float()).to(torch.bfloat16),
    "sin_cos": lambda x, w, b: torch.sin(x.float()) * w.float() + torch.cos(x.float() * 2),
    "powers": lambda x, w, b: (x.float().abs().pow(1.7) + x.float().pow(5) * 0.1 + (x.float().abs() + 0.5).pow(-3)
                               + 2 ** x.float().clamp(-8, 8)),
    # what PyTorch's functional API writes with the ops above (an expanded statistic, tensors of one number,
    # NaN and infinity tests, tensor bounds)
    "normalize_cosine": lambda x, w, b: (F.normalize(x.float(), dim=-1) * w.float(),
                                         F.cosine_similarity(x.float(), x.float() * b.float(), dim=-1)),
    "hard_activations": lambda x, w, b: F.hardtanh(x) + F.relu6(x) * F.hardswish(x) - F.hardsigmoid(x),
    "lerp_logsigmoid": lambda x, w, b: torch.lerp(x.float(), w.float(), 0.3) + F.logsigmoid(x.float()),
    "nan_to_num": lambda x, w, b: torch.nan_to_num(torch.log(x.float()), nan=0.5, neginf=-5.0),
    "hyperbolic": lambda x, w, b: (torch.sinh(x.float()) + torch.cosh(x.float()) * torch.erfc(x.float())
                                   + torch.log10(x.float().abs() + 1) + torch.hypot(x.float(), w.float())),
    "clamp_tensor": lambda x, w, b: torch.clamp(x, min=-w.abs(), max=w.abs()),
}
FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.bfloat16: 8e-3, FP8: 2e-2}  # fp8: an fp32 sum in another order may move a value one step


def _int8_fake_quant(y: torch.Tensor) -> torch.Tensor:
    scale = y.abs().amax(-1, keepdim=True) / 127.0
    return torch.round(y / scale).clamp(-127, 127) * scale


def _fp8_dynamic_quant(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = y.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 448.0
    return (y / scale).to(FP8), scale


def _beyond_args(tokens: int, width: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [_rand((tokens, width), torch.bfloat16, gen).to(device), _rand((width,), torch.bfloat16, gen).to(device),
            _rand((width,), torch.bfloat16, gen).to(device)]


@pytest.mark.parametrize("name", sorted(BEYOND))
def test_norms_and_activations_beyond_the_models_lower_to_what_they_compute(name):
    """LayerNorm, variance, log-softmax, logsumexp, leaky ReLU, ELU, max/min values, exp2/log2,
    comparisons, ``where`` and ``masked_fill``, logical ops on predicates, log1p and expm1 (small
    values kept: their relative error is checked at 1e-6), softplus and Mish, sign."""
    args = _beyond_args(5, 1024, "cpu", len(name))
    want = BEYOND[name](*args)
    want = want if isinstance(want, tuple) else (want,)
    got = interpret(lower(BEYOND[name], args), args)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and not torch.isnan(g).any()
        assert rel_err(g, w) <= TOLERANCE.get(w.dtype, 1e-5), (name, rel_err(g, w))


def test_an_fp8_row_is_read_as_its_values():
    """A quantized activation [T, N] in E4M3 with its per-token scale, dequantized to bf16."""
    gen = torch.Generator().manual_seed(3)
    q, scale = _fp8_dynamic_quant(_rand((5, 512), torch.float32, gen))
    program = lower(lambda q, s: (q.float() * s).to(torch.bfloat16), [q, scale])
    assert program.inputs == (("row", "fp8_e4m3"), ("stat", "fp32"))
    assert torch.equal(interpret(program, [q, scale])[0], (q.float() * scale).to(torch.bfloat16))


@needs_cutedsl
@pytest.mark.parametrize("name", ["layer_norm", "std_and_var", "logsumexp", "elu", "where_row_stat_col", "predicates",
                                  "fp8_dynamic_quant", "rounding", "sin_cos", "powers", "int8_fake_quant",
                                  "normalize_cosine", "nan_to_num", "hyperbolic"])
def test_norms_and_activations_beyond_the_models_compile_without_spills(kcache, name):
    """Their kernels hold every reduction's butterfly and no local memory."""
    from codegen.compiler import compile_kernel
    from codegen.launchers.generated import ROWWISE

    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in _beyond_args(8, 7168, "cpu", 0)]
    (spec,) = ROWWISE.make_specs(_as_fused_op(f"lowering_probe_beyond_{name}", BEYOND[name]), "sm_90a", metas)
    ptx = compile_kernel(spec, cache=kcache).ptx
    assert ptx.count("shfl.sync.bfly") >= 5 * Program.from_params(spec.param_dict["program"]).reductions
    # libdevice's sin and cos reduce a huge argument (Payne-Hanek) through a local array: no spill
    assert name == "sin_cos" or ("ld.local" not in ptx and "st.local" not in ptx)
    assert not divergent_warp_collectives(ptx)
    assert not name.startswith("fp8") or "cvt.rn.satfinite.e4m3x2.f32" in ptx  # E4M3 in pairs, saturated


def _as_fused_op(op: str, fn) -> str:
    """``fn`` of three tensors (a result or a tuple of them) as fused op ``k3f::op``."""
    @fused_op(op)
    def wrapped(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        out = fn(a, b, c)
        return list(out) if isinstance(out, tuple) else [out]
    return f"k3f::{op}"


# norms per head as a user's rule writes them: the reference reduces the last dim of a [T, H, D]
# view of a token's row (Qwen3's q/k norm, KDA's gated output norm), so the program's rows are the
# token's heads; its arguments are the row [T, H * D], a gate of the same shape, a weight [D]
HEADS, HEAD_DIM = 8, 128


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape[0], -1, HEAD_DIM)


PER_HEAD = {
    "qk_rms_norm": lambda x, g, w: rms_norm(_heads(x), w, 1e-6).view(x.shape),
    "gated_head_norm": lambda x, g, w: (rms_norm(_heads(x), w, 1e-5).float()
                                        * torch.sigmoid(_heads(g).float())).to(torch.bfloat16),
    "head_layer_norm": lambda x, g, w: F.layer_norm(_heads(x), (HEAD_DIM,), w, None, 1e-5).flatten(1),
    "head_l2_norm_and_norms": lambda x, g, w: (_heads(x).float() * torch.rsqrt(
        _heads(x).float().pow(2).sum(-1, keepdim=True) + 1e-6), _heads(x).float().pow(2).sum(-1)),
    "head_softmax": lambda x, g, w: torch.softmax(_heads(x).float(), -1),
    "head_max_stat": lambda x, g, w: _heads(x).amax(-1, keepdim=True),
    "flattened_heads": lambda x, g, w: rms_norm(x.view(-1, HEAD_DIM), w, 1e-6),
}


def _per_head_args(tokens: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [_rand((tokens, HEADS * HEAD_DIM), torch.bfloat16, gen).to(device),
            _rand((tokens, HEADS * HEAD_DIM), torch.bfloat16, gen).to(device),
            _rand((HEAD_DIM,), torch.bfloat16, gen, positive=True).to(device)]


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", sorted(PER_HEAD))
def test_norms_per_head_lower_to_programs_over_the_heads(name, tokens):
    """A program whose rows are a token's heads (``group`` of them): the reference's results in
    their shapes ([T, H * D], [T, H, D], a per-head statistic [T, H] or [T, H, 1])."""
    args = _per_head_args(tokens, "cpu", len(name) + tokens)
    want = PER_HEAD[name](*args)
    want = want if isinstance(want, tuple) else (want,)
    program = lower(PER_HEAD[name], args)
    assert (program.group, program.width) == (HEADS, HEAD_DIM)
    got = interpret(program, args)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and not torch.isnan(g).any()
        assert rel_err(g, w) <= (8e-3 if w.dtype == torch.bfloat16 else 1e-5), (name, rel_err(g, w))


@pytest.mark.parametrize("fn,width,named", [
    # PyTorch broadcasts a [T] statistic along a row of T values: the programs' statistic would not
    (lambda x, g, w: (x.float() * x.float().sum(-1)).to(torch.bfloat16), 8,
     "broadcasts sum_1, a statistic of shape (8,), along the last dim of (8, 8)"),
    (lambda x, g, w: rms_norm(_heads(x), w, 1e-6) * x.float().mean(-1, keepdim=True).unsqueeze(-1), 1024,
     "reductions over rows of different widths and counts ([(8, 1024), (64, 128)]"),
    (lambda x, g, w: rms_norm(_heads(x), w, 1e-6) * g[:, :1].unsqueeze(-1), 1024,
     "makes a tensor of shape (8, 1, 1): a program over rows of 128 values, 8 a token"),
    (lambda x, g, w: rms_norm(_heads(x)[..., :64], w[:64], 1e-6), 1024,
     "argument arg0_1 of shape (8, 1024): the program takes rows [8, 8, 64] or a view of it"),
])
def test_what_a_program_over_heads_cannot_read_is_refused_by_name(fn, width, named):
    """A token's statistic read by each of its heads, two row geometries in one op, a window of a
    head; and a statistic PyTorch broadcasts along a row (the same in any program)."""
    x = torch.randn(8, width).bfloat16()
    with pytest.raises(LoweringError, match=re.escape(named)):
        lower(fn, [x, x, torch.rand(min(width, HEAD_DIM)).bfloat16()])


@needs_cutedsl
@pytest.mark.parametrize("name", ["qk_rms_norm", "gated_head_norm", "head_l2_norm_and_norms"])
def test_norms_per_head_compile_without_spills(kcache, name):
    """One CTA a head: its butterflies, no local memory; the spec holds the heads a token."""
    from codegen.compiler import compile_kernel
    from codegen.launchers.generated import ROWWISE

    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in _per_head_args(8, "cpu", 0)]
    (spec,) = ROWWISE.make_specs(_as_fused_op(f"lowering_probe_heads_{name}", PER_HEAD[name]), "sm_90a", metas)
    program = Program.from_params(spec.param_dict["program"])
    assert (program.group, program.width) == (HEADS, HEAD_DIM)
    ptx = compile_kernel(spec, cache=kcache).ptx
    assert ptx.count("shfl.sync.bfly") >= 4 * program.reductions
    assert "ld.local" not in ptx and "st.local" not in ptx and not divergent_warp_collectives(ptx)


def test_an_in_place_op_on_an_argument_is_refused_by_name():
    """``add_`` on a value the reference computed is an add; on its argument, the op's input would
    change under it."""
    x = torch.randn(4, 64)
    assert lower(lambda x: F.rms_norm(x, (64,)), [x]).reductions == 1
    with pytest.raises(LoweringError, match=re.escape("aten.mul_.Tensor (node mul_) writes into arg0_1")):
        lower(lambda x: x.mul_(2), [x])


def test_a_reduction_of_a_weight_is_refused_by_name():
    """The cosine similarity of each token's row with one vector reduces the vector too: a number
    of the whole step, which the programs do not compute."""
    with pytest.raises(LoweringError, match=re.escape("the same values for every token (a weight's)")):
        lower(lambda x, w: F.cosine_similarity(x, w, dim=-1), [torch.randn(4, 64), torch.randn(64)])


def test_a_bool_argument_is_refused_by_name():
    """A mask handed to the op: the kernels read bf16, fp16, fp32 and fp8 tensors."""
    with pytest.raises(LoweringError, match="arg1_1 is torch.bool: the programs read bf16, fp16, fp32, fp8_e4m3"):
        lower(lambda x, m: x.masked_fill(m, 0.0), [torch.randn(4, 64), torch.rand(4, 64) > 0.5])


@pytest.mark.parametrize("fn,named", [
    (lambda x: torch.cumsum(x, -1), "aten.cumsum.default (node cumsum) has no lowering"),
    (lambda x: torch.topk(x, 4, -1).values, "aten.topk.default (node topk) has no lowering"),
    (lambda x: x @ x.t(), "weight arg0_1 is torch.float32: the generated products read bf16, fp8_e4m3 weights"),
    (lambda x: x.sum(0, keepdim=True) + x, "reduces dims [0]: the programs reduce a token's row"),
    (lambda x: x.pow(x), "aten.pow.Tensor_Tensor (node pow_1) has no lowering"),
    (lambda x: x.pow(4096), "raises to 4096.0: the programs take whole exponents up to 1024"),
    (lambda x: (-2.0) ** x, "raises -2.0 to a tensor: the programs take a positive base"),
    (lambda x: torch.ops.k3.all_reduce(x, "tp", 2), "all_reduce of a result without matrix products"),
    (lambda x: x.double(), "makes torch.float64"),
    (lambda x: x.max(-1).indices.float(), "(aten.max.dim): the programs compute values, not indices"),
    (lambda x: torch.atan(x), "aten.atan.default (node atan) has no lowering"),
    # x - trunc(x / y) y is one y off where the quotient rounds to a whole number: not taken
    (lambda x: torch.fmod(x, 0.3), "aten.fmod.Scalar (node fmod) has no lowering"),
    (lambda x: x > 0, "is a result of torch.bool: the programs write bf16, fp16, fp32, fp8_e4m3"),
])
def test_what_the_lowering_does_not_know_is_refused_by_name(fn, named):
    x = torch.randn(4, 64)
    with pytest.raises(LoweringError, match=re.escape(named)):
        lower(fn, [x])


def test_programs_refuse_malformed_data():
    with pytest.raises(LoweringError, match="'cumsum' is not an op of the lowered programs"):
        Program(8, (("row", "bf16"),), (("cumsum", (0,)),), ((1, "bf16", (8,)),))
    with pytest.raises(LoweringError, match="reads 5, which is not an earlier value"):
        Program(8, (("row", "bf16"),), (("exp", (5,)),), ((1, "bf16", (8,)),))
    with pytest.raises(LoweringError, match="reduces one row"):
        Program(8, (("col", "bf16"),), (("sum", (0,)),), ((1, "fp32", (8,)),))


@fused_op("lowering_probe_add_norm")
def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A fused op no hand-written template serves: a residual add, then RMSNorm."""
    return rms_norm((x.float() + residual.float()).to(torch.bfloat16), weight, eps)


def _add_norm_args(tokens=4, width=7168, device="meta", gen=None):
    if device == "meta":
        return (torch.empty(tokens, width, dtype=torch.bfloat16, device="meta"),
                torch.empty(tokens, width, dtype=torch.bfloat16, device="meta"),
                torch.empty(width, dtype=torch.bfloat16, device="meta"), 1e-5)
    x, r = (_rand((tokens, width), torch.bfloat16, gen).to(device) for _ in range(2))
    return x, r, _rand((width,), torch.bfloat16, gen).to(device), 1e-5


def test_a_fused_op_without_a_template_gets_a_generated_one():
    tpl, specs = spec_for_call("k3f::lowering_probe_add_norm", "sm_90a", _add_norm_args())
    assert tpl is not None and tpl.generated and [s.module for s in specs] == ["rowwise"]
    program = Program.from_params(specs[0].param_dict["program"])
    assert program.width == 7168 and program.reductions == 1
    tpl, why = spec_for_call("k3f::lowering_probe_add_norm", "sm_90a", _add_norm_args(width=4100))
    assert tpl is None and "4100 values is not whole 128-bit vectors" in why


def test_the_plan_says_which_kernels_are_generated():
    """What inspect, compile and the server read: hand-written, generated, or missing and why."""
    from codegen.templates import GENERATED, template
    from rewriter.compiler.plan import _kernel_for

    row = _kernel_for(None, GENERATED, ("k3f::lowering_probe_add_norm", _add_norm_args()), "sm_90a")
    assert (row["status"], row["implementation"], [s.module for s in row["specs"]]) == ("pending", "generated",
                                                                                        ["rowwise"])
    logits = torch.empty(1, 896, dtype=torch.float32, device="meta")
    hand = _kernel_for(template("router_topk"), GENERATED,
                       ("k3f::router_topk", (logits, torch.empty(896, dtype=torch.float32, device="meta"), 16, True,
                                             1.0)), "sm_90a")
    assert (hand["status"], hand["implementation"]) == ("pending", "hand-written")
    missing = _kernel_for(None, GENERATED, ("k3f::lowering_probe_add_norm", _add_norm_args(width=4100)), "sm_90a")
    assert (missing["status"], missing["implementation"]) == ("missing", "missing")
    assert missing["detail"].startswith("no hand-written CuTe DSL template; not generated: a row of 4100 values")


@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("seed", [0, 3, 7, 11])
def test_generated_kernels_compile_with_the_ptx_their_class_promises(kcache, arch, seed):
    """Vector loads and stores, one butterfly per reduction, no local memory (a spill), no
    warp-wide instruction that only some of a warp's lanes reach (it would wait forever)."""
    from codegen.compiler import compile_kernel
    from codegen.launchers.generated import ROWWISE

    fn, inputs = random_chain(seed)

    @fused_op(f"lowering_probe_chain_{seed}_{arch}")
    def chain(x: torch.Tensor, r: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = fn(x, r, c, s)
        return out[0] if isinstance(out, tuple) else out

    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs]
    (spec,) = ROWWISE.make_specs(f"k3f::lowering_probe_chain_{seed}_{arch}", arch, metas)
    ptx = compile_kernel(spec, cache=kcache).ptx
    program = Program.from_params(spec.param_dict["program"])
    assert "ld.global.v4" in ptx or "ld.global.v2" in ptx
    assert "st.global.v4" in ptx
    assert ptx.count("shfl.sync.bfly") >= 5 * program.reductions
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "griddepcontrol.wait" in ptx
    assert not divergent_warp_collectives(ptx)


@on_gpu
@pytest.mark.parametrize("tokens,width", [(1, 7168), (8, 7168), (64, 3584), (5, 1000)])
def test_the_generated_kernel_matches_its_program(tokens, width):
    """Fresh random inputs, poisoned outputs, alone and inside a CUDA graph."""
    gen = torch.Generator().manual_seed(tokens * width)
    args = _add_norm_args(tokens, width, "cuda", gen)
    tpl, specs, fns = gpu_kernels("k3f::lowering_probe_add_norm", args)
    want = interpret(Program.from_params(specs[0].param_dict["program"]), [a for a in args if torch.is_tensor(a)])[0]
    got = tpl.launch(fns, specs, args)  # the launcher allocates its outputs: poisoned by the allocator's reuse
    torch.cuda.synchronize()
    assert not torch.isnan(got).any() and rel_err(got, want) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tpl.launch(fns, specs, args)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(captured).any() and rel_err(captured, want) < 1e-2


@on_gpu
@pytest.mark.parametrize("seed", range(16))
def test_random_chains_run_as_their_programs_on_the_gpu(seed):
    """Every corpus chain's generated kernel against its program (every output), fresh inputs."""
    fn, inputs = random_chain(seed)
    name = f"lowering_gpu_chain_{seed}"

    @fused_op(name)
    def chain(x: torch.Tensor, r: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> list[torch.Tensor]:
        out = fn(x, r, c, s)
        return list(out) if isinstance(out, tuple) else [out]

    args = [t.cuda() for t in inputs]
    tpl, specs, fns = gpu_kernels(f"k3f::{name}", args)
    want = interpret(Program.from_params(specs[0].param_dict["program"]), args)
    got = tpl.launch(fns, specs, args)
    torch.cuda.synchronize()
    for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want, strict=True):
        assert not torch.isnan(g).any() and rel_err(g, w) < 1e-2, (seed, rel_err(g, w))


@on_gpu
@pytest.mark.parametrize("name", sorted(BEYOND))
def test_norms_and_activations_beyond_the_models_run_on_the_gpu(name):
    """Their generated kernels against the reference, fresh inputs, 3 tokens of 1000 values."""
    args = _beyond_args(3, 1000, "cuda", len(name))
    tpl, specs, fns = gpu_kernels(_as_fused_op(f"lowering_gpu_beyond_{name}", BEYOND[name]), args)
    want = BEYOND[name](*[a.cpu() for a in args])
    want = want if isinstance(want, tuple) else (want,)
    got = tpl.launch(fns, specs, args)
    torch.cuda.synchronize()
    for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want, strict=True):
        assert not torch.isnan(g).any() and rel_err(g.cpu(), w) < 1e-2, (name, rel_err(g.cpu(), w))


@on_gpu
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", sorted(PER_HEAD))
def test_norms_per_head_run_on_the_gpu(name, tokens):
    """Their generated kernels (one CTA a head) against the reference, fresh inputs, poisoned
    outputs, alone and inside a CUDA graph."""
    args = _per_head_args(tokens, "cuda", len(name) + tokens)
    tpl, specs, fns = gpu_kernels(_as_fused_op(f"lowering_gpu_heads_{name}_{tokens}", PER_HEAD[name]), args)
    want = PER_HEAD[name](*[a.cpu() for a in args])
    want = want if isinstance(want, tuple) else (want,)
    got = tpl.launch(fns, specs, args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tpl.launch(fns, specs, args)
    for c in captured:
        c.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for g, c, w in zip(got, captured, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
        for out in (g, c):
            assert not torch.isnan(out).any() and rel_err(out.cpu(), w) < 1e-2, (name, rel_err(out.cpu(), w))


@on_gpu
def test_an_fp8_row_is_read_on_the_gpu():
    """The dequantization of an E4M3 row (8-byte vectors) against the reference."""
    gen = torch.Generator().manual_seed(4)
    q, scale = (t.cuda() for t in _fp8_dynamic_quant(_rand((5, 1000), torch.float32, gen)))
    tpl, specs, fns = gpu_kernels(_as_fused_op("lowering_gpu_fp8_dequant", lambda q, s, _: (q.float() * s).to(
        torch.bfloat16)), [q, scale, scale])
    (got,) = tpl.launch(fns, specs, [q, scale, scale])
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), (q.float() * scale).to(torch.bfloat16).cpu())
