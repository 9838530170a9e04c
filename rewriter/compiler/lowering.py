"""From a fused op's reference to the program a generated kernel runs (``codegen.lowered``).

The reference (the Python function a ``k3f::`` op is defined from) is traced into ATen ops at
the call's shapes and dtypes (``make_fx`` with PyTorch's core decompositions, so SiLU, softmax
and the like arrive as the few ops they are made of), and each ATen op is translated into the
program's ops, one by one: pointwise arithmetic and the usual activations, casts (a result in
bf16 rounds where the reference rounds), broadcasts of per-token statistics and of columns, and
reductions over the row. An op the table does not know is refused with its name and the node
that calls it, never approximated. ``lower_op`` caches by the call's signature: the server asks
once per shape, not per step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from codegen.lowered import DTYPES, ROUND, LoweringError, Program, fold

aten = torch.ops.aten
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# ATen op -> program op, for the ops whose arguments map one to one
_UNARY = {aten.neg.default: "neg", aten.exp.default: "exp", aten.log.default: "log", aten.sqrt.default: "sqrt",
          aten.rsqrt.default: "rsqrt", aten.tanh.default: "tanh", aten.sigmoid.default: "sigmoid",
          aten.abs.default: "abs", aten.relu.default: "relu", aten.reciprocal.default: "reciprocal",
          aten.erf.default: "erf"}
_BINARY = {aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub",
           aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div",
           aten.maximum.default: "max", aten.minimum.default: "min"}
_REDUCE = {aten.sum.dim_IntList: "sum", aten.amax.default: "rmax", aten.amin.default: "rmin",
           aten.mean.dim: "sum"}
# ATen ops _translate writes as several program ops
_OTHER = (aten.rsub.Scalar, aten.rsub.Tensor, aten.pow.Tensor_Scalar, aten.clamp.default, aten.clamp_min.default,
          aten.clamp_max.default, aten.gelu.default, aten._softmax.default)
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_SHAPE_ONLY = (aten.lift_fresh_copy.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
               aten.clone.default, aten.alias.default, aten.detach.default)


def _kind_of_shape(shape: Sequence[int], tokens: int, width: int) -> str | None:
    """Which kind of value an argument of ``shape`` is in a program over [tokens, width] rows: a
    row [T, N], a statistic [T, 1], a column [N] or [1, N] (a 1-D argument is a column, also
    where T = N; a statistic the reference computes may be [T]: the program's own kinds follow
    from its ops, not from shapes)."""
    shape = tuple(shape)
    if shape == (tokens, width):
        return "row"
    if shape in ((width,), (1, width)):
        return "col"
    if shape in ((tokens, 1), (tokens,)):
        return "stat"
    return None


class _Builder:
    """The program as it is written, node by node."""

    def __init__(self, tokens: int, width: int):
        self.tokens, self.width = tokens, width
        self.inputs: list[tuple[str, str]] = []
        self.ops: list[tuple[str, tuple]] = []
        self.refs: dict[fx.Node, int] = {}

    def value(self, op: str, *args):
        """A new value of the program: op's result, or a constant where its operands all are."""
        if all(isinstance(a, tuple) or isinstance(a, str) for a in args):
            return ("c", fold(op, tuple(args)))
        self.ops.append((op, tuple(args)))
        return len(self.inputs) + len(self.ops) - 1

    def arg(self, a: Any, node: fx.Node):
        if isinstance(a, fx.Node):
            if a not in self.refs:
                raise LoweringError(f"{a.name}, read by {node.name} ({node.target}), is no value of the program")
            return self.refs[a]
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise LoweringError(f"{node.name} ({node.target}) takes {a!r}, which is not a number")
        return ("c", float(a))

    def rounded(self, ref, node: fx.Node):
        """``ref``, rounded where the reference's result is bf16 or fp16."""
        name = _DTYPE_NAMES.get(node.meta["val"].dtype)
        if name is None:
            raise LoweringError(f"{node.name} ({node.target}) makes {node.meta['val'].dtype}: the programs compute "
                                "bf16, fp16 and fp32")
        return self.value(ROUND, ref, name) if name != "fp32" else ref


def _reduced_dims(node: fx.Node) -> None:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    rank = node.args[0].meta["val"].dim()
    if [d % rank for d in dims] != [rank - 1]:
        raise LoweringError(f"{node.name} ({node.target}) reduces dims {dims}: the programs reduce a token's row "
                            "(the last dim) only")


def _pow(b: _Builder, x: int, exponent: float, node: fx.Node) -> int:
    if exponent == 2:
        return b.value("mul", x, x)
    if exponent == 3:
        return b.value("mul", b.value("mul", x, x), x)
    if exponent == 1:
        return x
    named = {0.5: "sqrt", -0.5: "rsqrt", -1: "reciprocal"}
    if exponent in named:
        return b.value(named[exponent], x)
    raise LoweringError(f"{node.name} ({node.target}) raises to {exponent}: the programs take 1, 2, 3, 0.5, -0.5 "
                        "and -1")


def _gelu(b: _Builder, x: int, approximate: str) -> int:
    if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cube = b.value("mul", b.value("mul", x, x), x)
        inner = b.value("mul", b.value("add", x, b.value("mul", cube, ("c", 0.044715))), ("c", math.sqrt(2 / math.pi)))
        return b.value("mul", b.value("mul", x, ("c", 0.5)), b.value("add", b.value("tanh", inner), ("c", 1.0)))
    erf = b.value("erf", b.value("mul", x, ("c", 1 / math.sqrt(2))))  # 0.5 x (1 + erf(x / sqrt(2)))
    return b.value("mul", b.value("mul", x, ("c", 0.5)), b.value("add", erf, ("c", 1.0)))


def _softmax(b: _Builder, x: int) -> int:
    shifted = b.value("sub", x, b.value("rmax", x))
    e = b.value("exp", shifted)
    return b.value("div", e, b.value("sum", e))


def _translate(b: _Builder, node: fx.Node) -> int:
    """The program value of one ATen node (before its result's rounding)."""
    t, args = node.target, node.args
    if t in _UNARY:
        return b.value(_UNARY[t], b.arg(args[0], node))
    if t in _BINARY:
        alpha = node.kwargs.get("alpha", 1)
        rhs = b.arg(args[1], node)
        if alpha != 1:
            rhs = b.value("mul", rhs, ("c", float(alpha))) if isinstance(rhs, int) else ("c", rhs[1] * alpha)
        return b.value(_BINARY[t], b.arg(args[0], node), rhs)
    if t is aten.rsub.Scalar or t is aten.rsub.Tensor:
        return b.value("sub", b.arg(args[1], node), b.arg(args[0], node))
    if t in _REDUCE:
        _reduced_dims(node)
        x = b.arg(args[0], node)
        if not isinstance(x, int):
            raise LoweringError(f"{node.name} ({t}) reduces a constant")
        r = b.value(_REDUCE[t], x)
        return b.value("div", r, ("c", float(b.width))) if t is aten.mean.dim else r
    if t is aten.pow.Tensor_Scalar:
        return _pow(b, b.arg(args[0], node), float(args[1]), node)
    if t is aten.clamp.default or t is aten.clamp_min.default or t is aten.clamp_max.default:
        x = b.arg(args[0], node)
        lo = args[1] if t is not aten.clamp_max.default else None
        hi = (args[2] if len(args) > 2 else node.kwargs.get("max")) if t is aten.clamp.default else \
            (args[1] if t is aten.clamp_max.default else None)
        if lo is not None:
            x = b.value("max", x, b.arg(lo, node))
        if hi is not None:
            x = b.value("min", x, b.arg(hi, node))
        return x
    if t is aten.gelu.default:
        return _gelu(b, b.arg(args[0], node), node.kwargs.get("approximate", "none"))
    if t is aten._softmax.default:
        _reduced_dims(node)
        return _softmax(b, b.arg(args[0], node))
    raise LoweringError(f"{t} (node {node.name}) has no lowering: the programs take pointwise arithmetic, "
                        "activations, casts and reductions over a token's row (docs/CODEGEN.md)")


def lower(fn: Callable[..., Any], args: Sequence[Any]) -> Program:
    """The program of ``fn(*args)``: its tensor arguments (meta or real) are the program's inputs,
    every other argument a constant of the trace. Raises ``LoweringError`` naming what it
    cannot express."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    rows = [a for a in tensors if a.dim() == 2 and a.shape[-1] > 1]
    if not rows:
        raise LoweringError("no [tokens, columns] tensor among the arguments: nothing is computed per token")
    tokens, width = rows[0].shape
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def traced(*ts):
        full = list(args)
        for i, t in zip(where, ts, strict=True):
            full[i] = t
        return fn(*full)

    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    try:
        gm = make_fx(traced, decomposition_table=core_aten_decompositions())(*meta)
    except Exception as e:  # noqa: BLE001 (what the trace met is the reason)
        raise LoweringError(f"the reference does not trace into ATen ops: {type(e).__name__}: {e}") from e
    known = (*_UNARY, *_BINARY, *_REDUCE, *_CASTS, *_SHAPE_ONLY, *_OTHER)
    for node in gm.graph.nodes:  # what the reference computes decides first, then the shapes it takes
        if node.op == "call_function" and node.target not in known:
            raise LoweringError(f"{node.target} (node {node.name}) has no lowering: the programs take pointwise "
                                "arithmetic, activations, casts and reductions over a token's row (docs/CODEGEN.md)")
    b = _Builder(tokens, width)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, t in zip(placeholders, tensors, strict=True):
        kind = _kind_of_shape(t.shape, tokens, width)
        if kind is None:
            raise LoweringError(f"argument {n.name} of shape {tuple(t.shape)}: the programs take rows "
                                f"[{tokens}, {width}], per-token statistics [{tokens}, 1] and columns [{width}]")
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise LoweringError(f"argument {n.name} is {t.dtype}: the programs read bf16, fp16 and fp32")
        b.refs[n] = len(b.inputs)
        b.inputs.append((kind, name))
    outputs: list[tuple[int, str, int]] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            for r in results:
                if not isinstance(r, fx.Node) or r not in b.refs:
                    raise LoweringError(f"the reference returns {r!r}, which is not a computed value")
                val = r.meta["val"]  # a result the same for every token is refused by the Program
                outputs.append((b.refs[r], _DTYPE_NAMES[val.dtype], val.dim()))
            continue
        if node.op == "get_attr":  # a constant the reference made (torch.tensor(0.5)): one number, or refused
            held = getattr(gm, node.target)
            if not isinstance(held, torch.Tensor) or held.numel() != 1:
                raise LoweringError(f"{node.name} holds a tensor constant of shape {tuple(held.shape)}: the programs "
                                    "take tensors as the op's arguments")
            b.refs[node] = ("c", float(held.item()))
            continue
        if node.op != "call_function":
            raise LoweringError(f"{node.name} ({node.op} {node.target}): the reference holds state the programs "
                                "cannot read")
        scalar = node.meta["val"].dim() == 0  # arithmetic on constants only: folded, or refused below
        if not scalar and _kind_of_shape(node.meta["val"].shape, tokens, width) is None:
            raise LoweringError(f"{node.name} ({node.target}) makes a tensor of shape {tuple(node.meta['val'].shape)}: "
                                f"the programs hold rows [{tokens}, {width}], statistics and columns")
        if node.target in _SHAPE_ONLY:
            b.refs[node] = b.arg(node.args[0], node)
        elif node.target in _CASTS:
            b.refs[node] = b.rounded(b.arg(node.args[0], node), node)
        else:
            b.refs[node] = b.rounded(_translate(b, node), node)
        if scalar and not isinstance(b.refs[node], tuple):
            raise LoweringError(f"{node.name} ({node.target}) makes one number of the whole step: the programs "
                                "compute per token")
    return Program(width, tuple(b.inputs), tuple(b.ops), tuple(outputs))


def _signature(args: Sequence[Any]) -> tuple:
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return a
    return tuple(one(a) for a in args)


def lower_op(op: str, args: Sequence[Any]) -> Program | str:
    """The program of fused op ``op`` (``k3f::name``) at this call's shapes, or why there is none;
    the same signature (shapes, dtypes, constants) is lowered once."""
    key = (op, _signature(args))
    try:
        hash(key)
    except TypeError:  # an argument that does not hash: lower without the cache
        return _lower_uncached(op, args)
    if key not in _CACHE:
        _CACHE[key] = _lower_uncached(op, args)
    return _CACHE[key]


def _lower_uncached(op: str, args: Sequence[Any]) -> Program | str:
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(op if "::" in op else f"k3f::{op}")
    if opdef is None:
        return f"{op} is not a defined fused op"
    try:
        return lower(opdef._init_fn, args)
    except LoweringError as e:
        return f"not lowered: {e}"


_CACHE: dict[tuple, Program | str] = {}  # (op, the call's signature) -> its program or why not
