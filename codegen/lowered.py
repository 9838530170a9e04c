"""A fused op's computation as plain data: the program a generated kernel runs (no CuTe, no FX).

The compiler lowers a fused op's reference, traced into ATen ops at the call's shapes
(``rewriter.compiler.lowering``), into a ``Program`` over one row of each token: its values are
rows (``[T, N]``: one value per token and column), per-token statistics (``[T, 1]``: a row's sum,
maximum, a norm's scale) and columns (``[N]``: the same for every token, a norm's weight). Every
operation computes in fp32; where the reference rounds (an ATen op whose result is bf16, a cast
to bf16) the program says ``round``, so it rounds at the same points. The program is a tuple of
plain values: it is part of a ``KernelSpec``'s parameters, so the disk cache keys on it.

``interpret`` runs a program with torch on any device: the oracle a generated kernel is held to,
and the check that the lowering computes what the reference does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KINDS = ("row", "stat", "col")  # [T, N], [T, 1], [N]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "relu", "reciprocal", "erf")
BINARY = ("add", "sub", "mul", "div", "max", "min")
REDUCE = ("sum", "rmax", "rmin")  # over the row: a row becomes a statistic
ROUND = "round"  # (value, dtype): rounded to bf16 or fp16 and back to fp32, as the reference's tensor of that dtype


class LoweringError(ValueError):
    """A computation the lowering cannot express; the message names the op and where it is."""


Ref = int | tuple  # a value's index, or ("c", float): a constant


@dataclass(frozen=True)
class Program:
    width: int  # N: the columns of a row
    inputs: tuple[tuple[str, str], ...]  # (kind, dtype) of each input, in the op's argument order
    ops: tuple[tuple[str, tuple], ...]  # (op, args): value len(inputs) + i is op i's result
    # (value, dtype, dims) of each output, in the op's result order; dims: 2, or 1 for a statistic
    # the reference returns as [T] rather than [T, 1]
    outputs: tuple[tuple[int, str, int], ...]

    def __post_init__(self) -> None:
        if self.width < 1:
            raise LoweringError(f"a row of {self.width} columns")
        for kind, dtype in self.inputs:
            if kind not in KINDS or dtype not in DTYPES:
                raise LoweringError(f"input ({kind}, {dtype}): kinds {KINDS}, dtypes {tuple(DTYPES)}")
        kinds = [kind for kind, _ in self.inputs]
        for i, (op, args) in enumerate(self.ops):
            kinds.append(_kind(op, args, kinds, i))
        for value, dtype, dims in self.outputs:
            if not 0 <= value < len(kinds) or dtype not in DTYPES:
                raise LoweringError(f"output ({value}, {dtype}) names no value of the program or no dtype")
            if kinds[value] == "col":
                raise LoweringError("an output the same for every token (a column) is not a per-token result")
            if dims not in (1, 2) or (dims == 1 and kinds[value] != "stat"):
                raise LoweringError(f"output {value}: a row is [T, N], a statistic [T, 1] or [T]; got {dims} dims")

    @property
    def kinds(self) -> tuple[str, ...]:
        kinds = [kind for kind, _ in self.inputs]
        for i, (op, args) in enumerate(self.ops):
            kinds.append(_kind(op, args, kinds, i))
        return tuple(kinds)

    @property
    def reductions(self) -> int:
        return sum(op in REDUCE for op, _ in self.ops)

    def to_params(self) -> tuple:
        """The program as a spec parameter (plain tuples)."""
        return (self.width, self.inputs, self.ops, self.outputs)

    @classmethod
    def from_params(cls, p: Sequence) -> Program:
        width, inputs, ops, outputs = p
        return cls(int(width), tuple(tuple(i) for i in inputs), tuple((op, tuple(args)) for op, args in ops),
                   tuple(tuple(o) for o in outputs))


def is_const(ref: Ref) -> bool:
    return isinstance(ref, tuple)


def _kind(op: str, args: tuple, kinds: list[str], i: int) -> str:
    """The kind of op ``i``'s result; refuses an op or operand the kernels do not take."""
    def kind_of(ref: Ref) -> str | None:
        if is_const(ref):
            if len(ref) != 2 or ref[0] != "c" or not isinstance(ref[1], float):
                raise LoweringError(f"op {i} ({op}): a constant is ('c', float), got {ref!r}")
            return None
        if not isinstance(ref, int) or not 0 <= ref < len(kinds):
            raise LoweringError(f"op {i} ({op}) reads {ref!r}, which is not an earlier value")
        return kinds[ref]

    if op in UNARY or op == ROUND:
        want = 1 if op in UNARY else 2
        if len(args) != want:
            raise LoweringError(f"op {i} ({op}) takes {want} argument(s), got {len(args)}")
        if op == ROUND and args[1] not in ("bf16", "fp16"):
            raise LoweringError(f"op {i} rounds to {args[1]!r}: bf16 or fp16")
        k = kind_of(args[0])
        if k is None:
            raise LoweringError(f"op {i} ({op}) of a constant: fold it")
        return k
    if op in BINARY:
        if len(args) != 2:
            raise LoweringError(f"op {i} ({op}) takes 2 arguments, got {len(args)}")
        ks = {kind_of(a) for a in args} - {None}
        if not ks:
            raise LoweringError(f"op {i} ({op}) of two constants: fold it")
        return "row" if "row" in ks or ks == {"stat", "col"} else ks.pop()
    if op in REDUCE:
        if len(args) != 1 or kind_of(args[0]) != "row":
            raise LoweringError(f"op {i} ({op}) reduces one row")
        return "stat"
    raise LoweringError(f"op {i}: {op!r} is not an op of the lowered programs ({', '.join(UNARY + BINARY + REDUCE)}, "
                        f"{ROUND})")


# ---- the interpreter: what a program computes, in torch ----------------------------------------
_UNARY = {"neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
          "tanh": torch.tanh, "sigmoid": torch.sigmoid, "abs": torch.abs, "relu": torch.relu,
          "reciprocal": torch.reciprocal, "erf": torch.erf}
_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "max": torch.maximum,
           "min": torch.minimum}
_REDUCE = {"sum": lambda x: x.sum(-1, keepdim=True), "rmax": lambda x: x.amax(-1, keepdim=True),
           "rmin": lambda x: x.amin(-1, keepdim=True)}
IDENTITY = {"sum": 0.0, "rmax": -math.inf, "rmin": math.inf}  # what a column past the row's end adds


def fold(op: str, args: tuple) -> float:
    """The value of ``op`` on constants (``("c", v)``; a rounding's dtype name), as the programs
    compute it: what the lowering writes in place of an op whose operands are all constants."""
    vals = [torch.tensor(a[1], dtype=torch.float32) for a in args if is_const(a)]
    if op == ROUND:
        return float(vals[0].to(DTYPES[args[1]]).float())
    table = _UNARY if op in _UNARY else _BINARY if op in _BINARY else None
    if table is None:
        raise LoweringError(f"{op} of constants does not fold")
    return float(table[op](*vals))


def interpret(program: Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The program's outputs for ``inputs`` (rows [T, N], statistics [T, 1], columns [N]), computed
    in fp32 on their device and rounded where the program rounds; each output in its dtype."""
    if len(inputs) != len(program.inputs):
        raise LoweringError(f"the program takes {len(program.inputs)} inputs, got {len(inputs)}")
    vals: list[torch.Tensor] = []
    for t, (kind, _) in zip(inputs, program.inputs, strict=True):
        want = {"row": (-1, program.width), "stat": (-1, 1), "col": (program.width,)}[kind]
        if t.dim() != len(want) or any(w != -1 and s != w for s, w in zip(t.shape, want, strict=True)):
            raise LoweringError(f"a {kind} input must be {want} (-1: any), got {tuple(t.shape)}")
        vals.append(t.float())

    def get(ref: Ref) -> torch.Tensor:
        return torch.tensor(ref[1], dtype=torch.float32, device=vals[0].device) if is_const(ref) else vals[ref]

    for op, args in program.ops:
        if op in _UNARY:
            vals.append(_UNARY[op](get(args[0])))
        elif op in _BINARY:
            vals.append(_BINARY[op](get(args[0]), get(args[1])))
        elif op in _REDUCE:
            vals.append(_REDUCE[op](get(args[0])))
        else:  # ROUND
            vals.append(get(args[0]).to(DTYPES[args[1]]).float())
    return [vals[v].to(DTYPES[dtype]).reshape(-1) if dims == 1 else vals[v].to(DTYPES[dtype])
            for v, dtype, dims in program.outputs]
