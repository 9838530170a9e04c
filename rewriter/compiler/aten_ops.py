"""The op-by-op translation of ATen ops into the ops of a ``codegen.lowered.Program``.

A ``Builder`` writes one program over rows of ``width`` values. It is demand-driven: asked for
a node's value at a column offset (``get(node, c0)``: columns ``c0 .. c0 + width`` of that
node's rows, so that a split or slice of a wider row is a window into it), it translates the
node's ATen op from its operands' values, or asks its ``resolve`` hook, which decides what a
node the program does not compute itself is (an input: an argument, a product's accumulator,
a statistic of the prologue, an intermediate). An op the table does not know is refused with
its name and the node, never approximated. To teach the lowering one more op, add it to a
table below (or to ``translate``), and where it is a new program op to ``codegen.lowered`` (its
kind rule and interpreter) and ``codegen.kernels.emit`` (its CuTe DSL).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from codegen.lowered import DTYPES, ROUND, SELECT, LoweringError, Program, Ref, fold, result_kind

aten = torch.ops.aten
prims = torch.ops.prims
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# ATen op -> program op, for the ops whose arguments map one to one
UNARY = {aten.neg.default: "neg", aten.exp.default: "exp", aten.log.default: "log", aten.sqrt.default: "sqrt",
         aten.rsqrt.default: "rsqrt", aten.tanh.default: "tanh", aten.sigmoid.default: "sigmoid",
         aten.abs.default: "abs", aten.relu.default: "relu", aten.reciprocal.default: "reciprocal",
         aten.erf.default: "erf", aten.floor.default: "floor", aten.ceil.default: "ceil", aten.round.default: "rint",
         aten.trunc.default: "trunc", aten.sin.default: "sin", aten.cos.default: "cos"}
BINARY = {aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub",
          aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div",
          aten.maximum.default: "max", aten.minimum.default: "min", prims.div.default: "div"}
REDUCE = {aten.sum.dim_IntList: "sum", aten.amax.default: "rmax", aten.amin.default: "rmin",
          aten.mean.dim: "sum", prims.sum.default: "sum"}
# comparisons: a predicate, 1.0 where they hold, else 0.0 (``codegen.lowered.BINARY``)
COMPARE = {getattr(getattr(aten, name), overload): name
           for name in ("gt", "ge", "lt", "le", "eq", "ne") for overload in ("Scalar", "Tensor")}
# reductions that return (values, indices): their values are a row reduction, their indices refused
VALUES_AND_INDICES = {aten.max.dim: "rmax", aten.min.dim: "rmin"}
# ATen ops translate writes as several program ops
OTHER = (aten.rsub.Scalar, aten.rsub.Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.clamp.default,
         aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default, aten.gelu.default, aten._softmax.default,
         aten.leaky_relu.default, aten.elu.default,
         aten.exp2.default, aten.log2.default, aten.logsumexp.default, prims.var.default, aten.log1p.default,
         aten.expm1.default, aten.sign.default)
CASTS = (aten._to_copy.default, prims.convert_element_type.default)
SHAPE_ONLY = (aten.lift_fresh_copy.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
              aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
              aten.clone.default, aten.alias.default, aten.detach.default, prims.broadcast_in_dim.default)
# a window of a wider row: the columns of a split or a slice along the last dim
WINDOWS = (aten.split_with_sizes.default, aten.split.Tensor, aten.slice.Tensor, operator.getitem)
# what reduces a token's row: a product's row so reduced is cut off the kernel (``lowering``)
ROW_REDUCTIONS = (*REDUCE, *VALUES_AND_INDICES, aten._softmax.default, aten.logsumexp.default, prims.var.default)
# tensors of one number (PyTorch's decompositions make them: log-sigmoid, lerp): a constant
FILLED = {aten.full.default: lambda args: args[1], aten.full_like.default: lambda args: args[1],
          aten.zeros.default: lambda args: 0.0, aten.zeros_like.default: lambda args: 0.0,
          aten.ones.default: lambda args: 1.0, aten.ones_like.default: lambda args: 1.0}
# predicates and what reads them: where, the logical ops on predicates, a number as a tensor
PREDICATES = (aten.where.self, aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
              aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.scalar_tensor.default)
LOGICAL = {aten.bitwise_not.default: aten.logical_not.default, aten.bitwise_and.Tensor: aten.logical_and.default,
           aten.bitwise_or.Tensor: aten.logical_or.default}  # ~, & and | of bool tensors: logical ops

# ATen ops the programs write from their operands' values alone (each a tensor or a number)
COMPOSED = {
    aten.isnan.default: lambda b, x: b.value("ne", x, x),  # the programs' ne is unordered: NaN != NaN
    aten.isinf.default: lambda b, x: b.value("eq", b.value("abs", x), ("c", math.inf)),
    aten.isfinite.default: lambda b, x: b.value("lt", b.value("abs", x), ("c", math.inf)),
    aten.erfc.default: lambda b, x: b.value("sub", ("c", 1.0), b.value("erf", x)),
    aten.log10.default: lambda b, x: b.value("mul", b.value("log", x), ("c", 1 / math.log(10))),
    aten.tan.default: lambda b, x: b.value("div", b.value("sin", x), b.value("cos", x)),
    aten.sinh.default: lambda b, x: _half(b, b.value("sub", _expm1(b, x), _expm1(b, b.value("neg", x)))),
    aten.cosh.default: lambda b, x: _half(b, b.value("add", b.value("exp", x), b.value("exp", b.value("neg", x)))),
    aten.hardtanh.default: lambda b, x, lo=("c", -1.0), hi=("c", 1.0): b.value("min", b.value("max", x, lo), hi),
    aten.hypot.default: lambda b, x, y: b.value("sqrt", b.value("add", b.value("mul", x, x), b.value("mul", y, y))),
    aten.clamp_min.Tensor: lambda b, x, lo: b.value("max", x, lo),
    aten.clamp_max.Tensor: lambda b, x, hi: b.value("min", x, hi),
}
BROADCASTING = (*BINARY, *COMPARE, aten.where.self, aten.logical_and.default, aten.logical_or.default,
                *LOGICAL, *COMPOSED, aten.clamp.Tensor)  # the ops whose tensor operands broadcast against each other
POINTWISE = (*UNARY, *BINARY, *COMPARE, *PREDICATES, *REDUCE, *VALUES_AND_INDICES, *OTHER, *CASTS, *SHAPE_ONLY,
             *WINDOWS, *FILLED, *COMPOSED)


def kind_of(shape: tuple[int, ...], tokens: int, width: int, c0: int = 0, group: int = 1) -> str | None:
    """What a tensor of ``shape`` is in a program over [tokens, width] rows, read from column
    ``c0``: a row [T, >= c0 + width], a statistic [T, 1] or [T], a column [>= c0 + width],
    [1, ...] or [..., 1] (a 1-D tensor is a column, also where T = N), or None; the tokens may
    span several leading dims ([B, S, N] rows where T = B * S). With ``group`` rows a token,
    see ``_grouped_kind``."""
    shape = tuple(shape)
    if group > 1:
        return _grouped_kind(shape, tokens, width, c0, group)
    per_token = len(shape) >= 2 and math.prod(shape[:-1]) == tokens
    if per_token and shape[-1] == 1 and width > 1:
        return "stat"
    if per_token and shape[-1] >= c0 + width:
        return "row"
    if len(shape) == 2 and shape[0] == 1 and shape[1] >= c0 + width:
        return "col"
    if len(shape) == 2 and shape[1] == 1 and shape[0] >= c0 + width and shape[0] != tokens:
        return "col"  # [N, 1]: a per-channel scale, read through a view as [N]
    if len(shape) == 1 and shape[0] >= c0 + width and (shape[0] != tokens or shape[0] == width):
        return "col"
    if len(shape) == 1 and shape[0] == tokens:
        return "stat"
    return None


def _grouped_kind(shape: tuple[int, ...], tokens: int, width: int, c0: int, group: int) -> str | None:
    """What a tensor of ``shape`` is where a token's row is ``group`` rows of ``width`` (the
    heads of a [T, G, N] view): a row [T, G, N] or a view of it ([T, G * N], [T * G, N]), a
    statistic [T, G, 1] ([T, G], [T * G, 1]), a column [N] ([1, 1, N]), or None; no windows (a
    group's columns are read whole), and no tensor of the token (a [T, 1] read by every group)."""
    if c0 or not shape:
        return None
    rows, n = tokens * group, math.prod(shape)
    token_major = any(math.prod(shape[:k]) in (tokens, rows) for k in range(1, len(shape) + 1))
    if n == rows * width and shape[-1] % width == 0 and token_major:
        return "row"
    col = n == width and all(s == 1 for s in shape[:-1])
    if n == rows and token_major and (shape[-1] == 1 or not col):
        return "stat"
    return "col" if col else None


def columns(node: fx.Node) -> int:
    """How many columns ``node``'s value has (1 for a statistic or a number): which operands
    share a window with it."""
    shape = tuple(node.meta["val"].shape)
    return shape[-1] if shape else 1


class Builder:
    """One program as it is written, demand by demand. ``resolve(builder, node, c0)`` returns the
    value of a node the builder does not translate (or None to translate it)."""

    def __init__(self, tokens: int, width: int, resolve: Callable[[Builder, fx.Node, int], Ref | None],
                 group: int = 1):
        self.tokens, self.width, self.resolve, self.group = tokens, width, resolve, group
        self.inputs: list[tuple[str, str]] = []
        self.sources: list[tuple] = []
        self.ops: list[tuple[str, tuple]] = []
        self.op_kinds: list[str] = []
        self.outputs: list[tuple[int, str, tuple[int, ...]]] = []
        self.refs: dict[tuple[fx.Node, int], Ref] = {}

    def kind_of(self, shape: tuple[int, ...], c0: int = 0) -> str | None:
        """What a tensor of ``shape`` is in this program (``kind_of``)."""
        return kind_of(shape, self.tokens, self.width, c0, self.group)

    def kind(self, ref: Ref) -> str | None:
        """The kind of value ``ref`` (None: a constant)."""
        if isinstance(ref, tuple):
            return None
        return self.inputs[-1 - ref][0] if ref < 0 else self.op_kinds[ref]

    def input(self, kind: str, dtype: str, source: tuple) -> int:
        """The input read from ``source`` (one input per source and kind)."""
        for i, (k, s) in enumerate(zip(self.inputs, self.sources, strict=True)):
            if s == source and k[0] == kind:
                return -1 - i
        self.inputs.append((kind, dtype))
        self.sources.append(source)
        return -len(self.inputs)  # inputs are numbered -1, -2, ... while ops are written: program() renumbers

    def value(self, op: str, *args) -> Ref:
        """A new value of the program: op's result, or a constant where its operands all are."""
        if all(isinstance(a, tuple) or isinstance(a, str) for a in args):
            return ("c", fold(op, tuple(args)))
        self.op_kinds.append(result_kind(op, {self.kind(a) for a in args if not isinstance(a, str)} - {None}))
        self.ops.append((op, tuple(args)))
        return len(self.ops) - 1

    def get(self, node: fx.Node, c0: int = 0) -> Ref:
        """``node``'s value, columns ``c0 ..`` (a statistic or a number: c0 is 0)."""
        if columns(node) == 1:
            c0 = 0
        key = (node, c0)
        if key not in self.refs:
            self.refs[key] = self._make(node, c0)
        return self.refs[key]

    def _make(self, node: fx.Node, c0: int) -> Ref:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0 and val.numel() > 1 and \
                self.kind_of(tuple(val.shape), c0) is None:
            rows = f"[{self.tokens}, {self.width}]" if self.group == 1 else \
                f"[{self.tokens}, {self.group}, {self.width}] (its views and no windows)"
            raise LoweringError(f"{node.name} ({node.target}) makes a tensor of shape {tuple(val.shape)}: a program "
                                f"over rows of {self.width} values, {self.group} a token, holds rows {rows}, "
                                "statistics and columns")
        found = self.resolve(self, node, c0)
        if found is not None:
            return found
        if node.op == "get_attr":  # a constant the reference made (torch.tensor(0.5)): one number, or refused
            held = getattr(node.graph.owning_module, node.target)
            if not isinstance(held, torch.Tensor) or held.numel() != 1:
                raise LoweringError(f"{node.name} holds a tensor constant of shape {tuple(held.shape)}: the programs "
                                    "take tensors as the op's arguments")
            return ("c", float(held.item()))
        if node.op != "call_function":
            raise LoweringError(f"{node.name} ({node.op} {node.target}): the reference holds state the programs "
                                "cannot read")
        if node.target in SHAPE_ONLY:
            ref = self.arg(node.args[0], node, c0)
        elif node.target in WINDOWS:
            ref = self._window(node, c0)
        elif node.target in CASTS:
            ref = self.arg(node.args[0], node, c0)
            if val.dtype == torch.bool and node.args[0].meta["val"].dtype != torch.bool:
                ref = self.value("ne", ref, ("c", 0.0))  # a number as a predicate: not zero
            ref = self.rounded(ref, node)
        else:
            ref = translate(self, node, c0)
            if node.target in BROADCASTING:
                self._broadcast_check(node, c0, ref)
            ref = self.rounded(ref, node)
        if val.dim() == 0 and not isinstance(ref, tuple):
            raise LoweringError(f"{node.name} ({node.target}) makes one number of the whole step: the programs "
                                "compute per token")
        return ref

    def _broadcast_check(self, node: fx.Node, c0: int, ref: Ref) -> None:
        """Refuses a pointwise op whose operands broadcast otherwise than the program's kinds do:
        a statistic must be constant along the last dim it meets ([T, 1] against [T, N]; a [T]
        against [T, N] where T = N is broadcast along the row by PyTorch), a column vary along it
        alone."""
        out = tuple(node.meta["val"].shape)
        for a in node.all_input_nodes:
            shape = varying(a)
            if not shape or math.prod(shape) == 1:
                continue
            aligned = (1,) * (len(out) - len(shape)) + shape
            k = self.kind(self.refs.get((a, _operand_window(a, node, c0)), ("c", 0.0)))
            if k == "stat" and aligned[-1] != 1 and out[-1] != 1 and self.kind(ref) == "row":
                raise LoweringError(f"{node.name} ({node.target}) broadcasts {a.name}, a statistic of shape {shape}, "
                                    f"along the last dim of {out}: its values would meet the row's columns")
            if k == "col" and any(s != 1 for s in aligned[:-1]):
                raise LoweringError(f"{node.name} ({node.target}) reads {a.name} of shape {shape} as the same "
                                    "columns for every token: it varies along another dim")

    def arg(self, a: Any, node: fx.Node, c0: int = 0) -> Ref:
        """Operand ``a`` of ``node`` (read at ``node``'s window ``c0`` where it has node's columns)."""
        if isinstance(a, fx.Node):
            return self.get(a, _operand_window(a, node, c0))
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise LoweringError(f"{node.name} ({node.target}) takes {a!r}, which is not a number")
        return ("c", float(a))

    def rounded(self, ref: Ref, node: fx.Node) -> Ref:
        """``ref``, rounded where the reference's result is bf16 or fp16 (a bool is a predicate,
        1.0 or 0.0, exact in any dtype)."""
        if node.meta["val"].dtype == torch.bool:
            return ref
        name = DTYPE_NAMES.get(node.meta["val"].dtype)
        if name is None:
            raise LoweringError(f"{node.name} ({node.target}) makes {node.meta['val'].dtype}: the programs compute "
                                f"{', '.join(DTYPES)}")
        return self.value(ROUND, ref, name) if name != "fp32" else ref

    def _window(self, node: fx.Node, c0: int) -> Ref:
        """A split's piece or a slice along the last dim: a window further into the operand."""
        if node.target is operator.getitem:
            split = node.args[0]
            if isinstance(split, fx.Node) and split.target in VALUES_AND_INDICES:
                if node.args[1] != 0:
                    raise LoweringError(f"{node.name} takes the indices of {split.name} ({split.target}): the programs "
                                        "compute values, not indices")
                return self.value(VALUES_AND_INDICES[split.target], _reduced(self, split))
            if not (isinstance(split, fx.Node) and split.target in WINDOWS[:2]):
                raise LoweringError(f"{node.name} takes an item of {split}: the programs take the pieces of a split")
            src, size = split.args[0], split.args[1]
            dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            last_dim(split, dim)
            sizes = size if isinstance(size, (list, tuple)) else [size] * -(-columns(src) // size)
            return self.get(src, c0 + sum(sizes[:node.args[1]]))
        if node.target is aten.slice.Tensor:
            src, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
            start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
            step = node.args[4] if len(node.args) > 4 else 1
            last_dim(node, dim)
            if step != 1:
                raise LoweringError(f"{node.name} slices with step {step}: the programs take contiguous columns")
            return self.get(src, c0 + max(0, start + columns(src) if start < 0 else start))
        raise LoweringError(f"{node.name} ({node.target}): a split is read through its pieces")

    def program(self) -> Program:
        """The program, its values numbered as ``Program`` does: the inputs, then the ops' results."""
        n = len(self.inputs)

        def number(ref):
            return ref if isinstance(ref, tuple) or isinstance(ref, str) else (-1 - ref if ref < 0 else n + ref)
        ops = tuple((op, tuple(number(a) for a in args)) for op, args in self.ops)
        return Program(self.width, tuple(self.inputs), ops, tuple((number(v), d, k) for v, d, k in self.outputs),
                       self.group)

    def output(self, node: fx.Node, c0: int = 0) -> int:
        """``node`` (from column c0) as the program's next output; returns its index."""
        ref = self.get(node, c0)
        if not isinstance(ref, int):
            raise LoweringError(f"{node.name} is a constant, not a computed value")
        val = node.meta["val"]
        if val.dtype not in DTYPE_NAMES:
            raise LoweringError(f"{node.name} is a result of {val.dtype}: the programs write {', '.join(DTYPES)}")
        shape = tuple(val.shape[1:])  # as the reference returns it, or the window a program writes of a wider row
        if self.kind(ref) == "row" and self.group == 1 and shape[-1] != self.width:
            shape = (self.width,)
        self.outputs.append((ref, DTYPE_NAMES[val.dtype], shape))
        return len(self.outputs) - 1


def _operand_window(a: fx.Node, node: fx.Node, c0: int) -> int:
    """The column from which ``node``'s window ``c0`` reads operand ``a``: the same window where
    ``a`` is as wide as ``node``, else its whole (a statistic, a number: column 0)."""
    return c0 if columns(a) == columns(node) != 1 else 0


def varying(node: fx.Node) -> tuple[int, ...]:
    """``node``'s shape as its values vary: an expanded tensor's dims of size 1 before the
    expand (``expand``: right-aligned; ``prims.broadcast_in_dim``: along the dims it names), so a
    statistic expanded to a row ([T, 1] -> [T, N], as ``F.normalize`` writes it) is still one."""
    shape = tuple(node.meta["val"].shape)
    if node.op != "call_function" or not isinstance(node.args[0], fx.Node):
        return shape
    if node.target is aten.expand.default:
        src = varying(node.args[0])
        return (1,) * (len(shape) - len(src)) + src
    if node.target is prims.broadcast_in_dim.default:
        src, out = varying(node.args[0]), [1] * len(shape)
        for i, d in enumerate(node.args[2]):
            out[d] = src[i]
        return tuple(out)
    return shape


def last_dim(node: fx.Node, dim: int) -> None:
    rank = node.args[0].meta["val"].dim()
    if dim % rank != rank - 1:
        raise LoweringError(f"{node.name} ({node.target}) cuts dim {dim}: the programs cut a token's row "
                            "(the last dim) only")


def reduced_dims(node: fx.Node) -> None:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    rank = node.args[0].meta["val"].dim()
    if [d % rank for d in dims] != [rank - 1]:
        raise LoweringError(f"{node.name} ({node.target}) reduces dims {dims}: the programs reduce a token's row "
                            "(the last dim) only")


def _pow(b: Builder, x: Ref, exponent: float, node: fx.Node) -> Ref:
    """x ** exponent: a whole exponent (up to 1024 in size) by squarings and a reciprocal, so a
    negative x keeps its sign as in PyTorch; halves by sqrt and rsqrt; any other as
    exp(exponent * log(x)) (NaN for a negative x, as PyTorch's)."""
    named = {0.5: "sqrt", -0.5: "rsqrt"}
    if exponent in named:
        return b.value(named[exponent], x)
    if not math.isfinite(exponent) or (exponent == int(exponent) and abs(exponent) > 1024):
        raise LoweringError(f"{node.name} ({node.target}) raises to {exponent}: the programs take whole exponents up "
                            "to 1024 and any other finite one")
    if exponent != int(exponent):
        return b.value("exp", b.value("mul", b.value("log", x), ("c", float(exponent))))
    n, result, square = abs(int(exponent)), ("c", 1.0), x
    while n:
        if n & 1:
            result = square if result == ("c", 1.0) else b.value("mul", result, square)
        n >>= 1
        if n:
            square = b.value("mul", square, square)
    return b.value("reciprocal", result) if exponent < 0 else result


def _gelu(b: Builder, x: Ref, approximate: str) -> Ref:
    if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cube = b.value("mul", b.value("mul", x, x), x)
        inner = b.value("mul", b.value("add", x, b.value("mul", cube, ("c", 0.044715))), ("c", math.sqrt(2 / math.pi)))
        return b.value("mul", b.value("mul", x, ("c", 0.5)), b.value("add", b.value("tanh", inner), ("c", 1.0)))
    erf = b.value("erf", b.value("mul", x, ("c", 1 / math.sqrt(2))))  # 0.5 x (1 + erf(x / sqrt(2)))
    return b.value("mul", b.value("mul", x, ("c", 0.5)), b.value("add", erf, ("c", 1.0)))


def _softmax(b: Builder, x: Ref) -> Ref:
    shifted = b.value("sub", x, b.value("rmax", x))
    e = b.value("exp", shifted)
    return b.value("div", e, b.value("sum", e))


def _variance(b: Builder, x: Ref, correction: float) -> Ref:
    """sum((x - mean)^2) / (width - correction), the mean taken first (as PyTorch's two passes)."""
    centered = b.value("sub", x, b.value("div", b.value("sum", x), ("c", float(b.width))))
    return b.value("div", b.value("sum", b.value("mul", centered, centered)), ("c", float(b.width - correction)))


def _logsumexp(b: Builder, x: Ref) -> Ref:
    top = b.value("rmax", x)
    return b.value("add", top, b.value("log", b.value("sum", b.value("exp", b.value("sub", x, top)))))


def _log1p(b: Builder, x: Ref) -> Ref:
    """log(1 + x) without losing a small x: log(u) x / (u - 1) for u = 1 + x (the rounding of u
    cancels), x itself where u rounds to 1 (Goldberg, "What every computer scientist should know
    about floating-point arithmetic", theorem 4)."""
    u = b.value("add", x, ("c", 1.0))
    d = b.value("sub", u, ("c", 1.0))
    small = b.value(SELECT, b.value("eq", d, ("c", 0.0)), x, b.value("div", b.value("mul", b.value("log", u), x), d))
    return b.value(SELECT, b.value("eq", u, ("c", math.inf)), u, small)  # log1p(inf) = inf, not inf / inf


def _expm1(b: Builder, x: Ref) -> Ref:
    """exp(x) - 1 without losing a small x: (u - 1) x / log(u) for u = exp(x), x where u rounds
    to 1, -1 where u - 1 does (Kahan's form)."""
    u = b.value("exp", x)
    d = b.value("sub", u, ("c", 1.0))
    scaled = b.value("div", b.value("mul", d, x), b.value("log", u))
    scaled = b.value(SELECT, b.value("eq", u, ("c", math.inf)), u, scaled)  # expm1(x) = inf where exp(x) is
    return b.value(SELECT, b.value("eq", d, ("c", 0.0)), x,
                   b.value(SELECT, b.value("eq", d, ("c", -1.0)), ("c", -1.0), scaled))


def _half(b: Builder, x: Ref) -> Ref:
    return b.value("mul", x, ("c", 0.5))


def _reduced(b: Builder, node: fx.Node) -> Ref:
    """The row a reduction reduces: the whole of its operand, which must be as wide as the program."""
    reduced_dims(node)
    src = node.args[0]
    if columns(src) != b.width:
        raise LoweringError(f"{node.name} ({node.target}) reduces a row of {columns(src)} values in a program over "
                            f"rows of {b.width}")
    x = b.get(src, 0)
    if not isinstance(x, int):
        raise LoweringError(f"{node.name} ({node.target}) reduces a constant")
    if b.kind(x) != "row":
        raise LoweringError(f"{node.name} ({node.target}) reduces {src.name}, the same values for every token (a "
                            "weight's): the programs reduce a token's row")
    return x


def translate(b: Builder, node: fx.Node, c0: int) -> Ref:
    """The program value of one ATen node at window ``c0`` (before its result's rounding)."""
    t, args = node.target, node.args
    if t in UNARY:
        return b.value(UNARY[t], b.arg(args[0], node, c0))
    if t in BINARY:
        alpha = node.kwargs.get("alpha", 1)
        rhs = b.arg(args[1], node, c0)
        if alpha != 1:
            rhs = b.value("mul", rhs, ("c", float(alpha))) if isinstance(rhs, int) else ("c", rhs[1] * alpha)
        return b.value(BINARY[t], b.arg(args[0], node, c0), rhs)
    if t in COMPARE:
        return b.value(COMPARE[t], b.arg(args[0], node, c0), b.arg(args[1], node, c0))
    if t is aten.where.self:
        return b.value(SELECT, *(b.arg(a, node, c0) for a in args[:3]))
    if t in LOGICAL:
        if node.meta["val"].dtype != torch.bool:
            raise LoweringError(f"{t} (node {node.name}) of {node.meta['val'].dtype}: the programs take bit operations "
                                "on bool predicates only")
        t = LOGICAL[t]
    if t is aten.logical_not.default:
        return b.value("eq", b.arg(args[0], node, c0), ("c", 0.0))
    if t is aten.logical_and.default or t is aten.logical_or.default:  # of predicates: 1.0 or 0.0 each
        x, y = (b.value("ne", b.arg(a, node, c0), ("c", 0.0)) for a in args[:2])
        return b.value("mul" if t is aten.logical_and.default else "max", x, y)
    if t is aten.scalar_tensor.default:
        return b.arg(args[0], node)
    if t in COMPOSED:
        return COMPOSED[t](b, *(b.arg(a, node, c0) for a in args))
    if t in FILLED:
        return b.arg(FILLED[t](args), node)
    if t is aten.rsub.Scalar or t is aten.rsub.Tensor:
        return b.value("sub", b.arg(args[1], node, c0), b.arg(args[0], node, c0))
    if t in REDUCE:
        r = b.value(REDUCE[t], _reduced(b, node))
        return b.value("div", r, ("c", float(b.width))) if t is aten.mean.dim else r
    if t is aten.pow.Tensor_Scalar:
        return _pow(b, b.arg(args[0], node, c0), float(args[1]), node)
    if t is aten.pow.Scalar:  # base ** x, for a positive base
        if not isinstance(args[0], (int, float)) or args[0] <= 0:
            raise LoweringError(f"{node.name} ({t}) raises {args[0]!r} to a tensor: the programs take a positive base")
        return b.value("exp", b.value("mul", b.arg(args[1], node, c0), ("c", math.log(args[0]))))
    if t in (aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default):
        x = b.arg(args[0], node, c0)
        both = t in (aten.clamp.default, aten.clamp.Tensor)  # bounds: numbers, or tensors (clamp.Tensor)
        lo = (args[1] if len(args) > 1 else node.kwargs.get("min")) if t is not aten.clamp_max.default else None
        hi = (args[2] if len(args) > 2 else node.kwargs.get("max")) if both else \
            (args[1] if t is aten.clamp_max.default else None)
        if lo is not None:
            x = b.value("max", x, b.arg(lo, node, c0))
        if hi is not None:
            x = b.value("min", x, b.arg(hi, node, c0))
        return x
    if t is aten.gelu.default:
        return _gelu(b, b.arg(args[0], node, c0), node.kwargs.get("approximate", "none"))
    if t is aten._softmax.default:
        return _softmax(b, _reduced(b, node))
    if t is prims.var.default:
        return _variance(b, _reduced(b, node), float(args[2] if len(args) > 2 else node.kwargs.get("correction", 1)))
    if t is aten.logsumexp.default:
        return _logsumexp(b, _reduced(b, node))
    if t is aten.leaky_relu.default:  # max(x, 0) + slope min(x, 0)
        x, slope = b.arg(args[0], node, c0), b.arg(args[1] if len(args) > 1 else 0.01, node)
        return b.value("add", b.value("max", x, ("c", 0.0)), b.value("mul", b.value("min", x, ("c", 0.0)), slope))
    if t is aten.elu.default:  # scale (max(x, 0) + alpha (exp(input_scale min(x, 0)) - 1))
        x = b.arg(args[0], node, c0)
        alpha, scale, input_scale = (b.arg(args[i] if len(args) > i else 1.0, node) for i in (1, 2, 3))
        negative = b.value("sub", b.value("exp", b.value("mul", b.value("min", x, ("c", 0.0)), input_scale)),
                           ("c", 1.0))
        return b.value("mul", b.value("add", b.value("max", x, ("c", 0.0)), b.value("mul", negative, alpha)), scale)
    if t is aten.log1p.default:
        return _log1p(b, b.arg(args[0], node, c0))
    if t is aten.expm1.default:
        return _expm1(b, b.arg(args[0], node, c0))
    if t is aten.sign.default:
        x = b.arg(args[0], node, c0)
        return b.value("sub", b.value("gt", x, ("c", 0.0)), b.value("lt", x, ("c", 0.0)))
    if t is aten.exp2.default:
        return b.value("exp", b.value("mul", b.arg(args[0], node, c0), ("c", math.log(2))))
    if t is aten.log2.default:
        return b.value("mul", b.value("log", b.arg(args[0], node, c0)), ("c", 1 / math.log(2)))
    raise LoweringError(f"{t} (node {node.name}) has no lowering: the programs take pointwise arithmetic, "
                        "activations, casts and reductions over a token's row (docs/CODEGEN.md)")
