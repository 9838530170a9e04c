"""A ``codegen.lowered.Program``'s ops emitted as CuTe DSL code, while a kernel is traced.

The program is a compile-time constant: ``run`` walks its ops in plain Python and emits each
one's code (the tables below), so the PTX holds exactly the program's arithmetic, in registers.
A row value is the list of fp32 scalars of the columns a thread owns (or one scalar, where a
thread owns one column: a product's epilogue); a statistic or a constant is one fp32 scalar.

A reduction over the row (``RowSplit``: thread i owns the 128-bit vectors i, i + threads, ...)
combines each thread's values, then the warp's with a ``shfl.sync.bfly`` butterfly, then the
warps' through shared memory (one barrier a reduction; every thread combines the warps' partials
in the same order, so every thread holds the same statistic). A vector past the row's end (the
last thread's, where the threads do not divide the row) counts as the reduction's identity.

The generated kernels (rowwise, product GEMV and GEMM) also share here how a program's inputs
are declared to ``cute.compile`` (``fake_input``) and read (``input_value``), and which of a
kernel's parts a block serves (``part_of``).

To teach the kernels one more program op, add it to ``codegen.lowered`` and to a table here.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_tensor

from codegen.lowered import IDENTITY, ROUND, SELECT, Program, is_const
from codegen.targets import VEC

CUTE_DTYPES = {"bf16": BFloat16, "fp16": Float16, "fp32": Float32, "fp8_e4m3": Float8E4M3FN}


@dataclass(frozen=True)
class RowSplit:
    """How a row of ``num_vec`` 128-bit vectors is spread over a CTA's threads."""
    num_vec: int
    threads: int

    @property
    def vectors(self) -> int:  # vectors a thread owns
        return -(-self.num_vec // self.threads)

    @property
    def even(self) -> bool:  # every thread owns as many (no vector past the row's end)
        return self.num_vec % self.threads == 0

    @property
    def warps(self) -> int:
        return self.threads // 32

    def vector(self, j, tidx):
        """Thread ``tidx``'s j-th vector of the row, clamped to the last one (a read past the end)."""
        v = tidx + j * self.threads
        return v if const_expr(self.even) else cutlass.min(v, self.num_vec - 1)


def run(program: Program, vals: list, split: RowSplit | None = None, tidx=None, sRed=None, slot: int = 0) -> list:
    """Every op of ``program`` in order, appended to ``vals`` (its inputs' values). Reductions
    use rows ``slot, slot + 1, ...`` of ``sRed`` ([slots, warps] fp32 in shared memory)."""
    reduction = slot
    for op, args in program.ops:
        if op == ROUND:
            vals.append(_map(lambda x, d=args[1]: x.to(CUTE_DTYPES[d]).to(Float32), vals[args[0]]))
        elif op in _REDUCE_OPS:
            vals.append(_reduce(op, vals[args[0]], split, tidx, sRed, reduction))
            reduction += 1
        elif len(args) == 1:
            vals.append(_map(_UNARY_OPS[op], vals[args[0]]))
        else:
            operands = [Float32(x[1]) if is_const(x) else vals[x] for x in args]
            vals.append(_zip(_select if op == SELECT else _BINARY_OPS[op], *operands))
    return vals


def _reduce(op, xs, split: RowSplit, tidx, sRed, index):
    combine, identity = _REDUCE_OPS[op], Float32(IDENTITY[op])
    part = identity
    for j in range(split.vectors):
        vec = xs[j * VEC]
        for e in range(1, VEC):
            vec = combine(vec, xs[j * VEC + e])
        if const_expr(split.even):
            part = combine(part, vec)
        else:  # a vector read past the row's end counts as the identity
            part = combine(part, cutlass.select_(tidx + j * split.threads < split.num_vec, vec, identity))
    _stash(sRed, index, cute.arch.warp_reduction(part, combine))
    cute.arch.barrier()
    total = sRed[index, 0]
    for w in range(1, split.warps):
        total = combine(total, sRed[index, w])
    return total


@cute.jit
def _stash(sRed: cute.Tensor, index: cutlass.Constexpr, part: Float32):
    """Lane 0 of each warp keeps its warp's partial of reduction ``index`` in shared memory. The
    warp's index is read by the whole warp first: ``warp_idx`` is a shuffle of every lane, which
    lane 0 alone waits on forever (the rowwise kernel hung on the GPU with it in the branch)."""
    warp = cute.arch.warp_idx()
    if cute.arch.lane_idx() == 0:
        sRed[index, warp] = part


def _fmax(a, b):
    return cute.math.max(a, b)


def _fmin(a, b):
    return cute.math.min(a, b)


_REDUCE_OPS = {"sum": operator.add, "rmax": _fmax, "rmin": _fmin}
_UNARY_OPS = {
    "neg": lambda x: -x,
    "exp": cute.math.exp,
    "log": cute.math.log,
    "sqrt": cute.math.sqrt,
    "rsqrt": cute.math.rsqrt,
    "tanh": cute.math.tanh,
    "sigmoid": lambda x: Float32(1.0) / (Float32(1.0) + cute.math.exp(-x)),
    "abs": cute.math.abs,
    "relu": lambda x: _fmax(x, Float32(0.0)),
    "reciprocal": lambda x: Float32(1.0) / x,
    "erf": cute.math.erf,
    "floor": cute.math.floor,
    "ceil": cute.math.ceil,
    "rint": cute.math.roundeven,  # half to even, as torch.round
    "trunc": cute.math.trunc,
    "sin": cute.math.sin,
    "cos": cute.math.cos,
}


def _predicate(compare):
    """A comparison as a program's predicate value: 1.0 where it holds, else 0.0."""
    return lambda a, b: Float32(cutlass.select_(compare(a, b), Float32(1.0), Float32(0.0)))


def _select(predicate, a, b):
    return Float32(cutlass.select_(predicate != Float32(0.0), Float32(a), Float32(b)))


_BINARY_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
               "max": _fmax, "min": _fmin, "gt": _predicate(operator.gt), "ge": _predicate(operator.ge),
               "lt": _predicate(operator.lt), "le": _predicate(operator.le), "eq": _predicate(operator.eq),
               "ne": _predicate(operator.ne)}


def _map(f, x):
    return [f(e) for e in x] if isinstance(x, list) else f(x)


def _zip(f, *args):
    """``f`` elementwise, a scalar (statistic, constant) broadcast over a row's or column's values."""
    width = next((len(a) for a in args if isinstance(a, list)), None)
    if width is None:
        return f(*args)
    if any(isinstance(a, list) and len(a) != width for a in args):
        raise ValueError(f"operands of {[len(a) for a in args if isinstance(a, list)]} values: one width")
    return [f(*(a[e] if isinstance(a, list) else a for a in args)) for e in range(width)]


# ---- a program's inputs: their fake tensors at compile time, their values in a kernel -------------
def fake_input(kind: str, dtype: str, tokens, width: int, stride: int | None = None, *, vectors: bool = False,
               source: str = "arg"):
    """The fake tensor ``cute.compile`` takes for a program input: a row [T, width] (a view of a
    row ``stride`` wide), a statistic [T, 1], a column [width], a one-element argument [1];
    ``vectors``: read in vectors of 8 values, so aligned to one (16 bytes; 8 for fp8)."""
    ct = CUTE_DTYPES[dtype]
    align = min(16, VEC * ct.width // 8) if vectors else ct.width // 8
    if source == "scalar":
        return make_fake_tensor(ct, (1,), (1,), assumed_align=ct.width // 8)
    if kind == "row":
        return make_fake_tensor(ct, (tokens, width), (stride or width, 1), assumed_align=align)
    if kind == "stat":
        return make_fake_tensor(ct, (tokens, 1), (1, 1), assumed_align=ct.width // 8)
    return make_fake_tensor(ct, (width,), (1,), assumed_align=align)


def input_value(t, source: str, kind: str, token, column):
    """Input ``t``'s value at (token, column) in fp32, one scalar (trace time): a one-element
    argument's, a row's, a column's or a statistic's."""
    if source == "scalar":
        return t[0].to(Float32)
    if kind == "row":
        return t[token, column].to(Float32)
    if kind == "col":
        return t[column].to(Float32)
    return t[token, 0].to(Float32)


@cute.jit
def part_of(block, tile_starts: tuple[int, ...], scale: cutlass.Constexpr = 1):
    """(part, block inside it times ``scale``) of ``block``, where part q's blocks start at
    ``tile_starts[q]``."""
    part = cutlass.Int32(0)
    inside = block * scale if const_expr(scale != 1) else block
    for q in cutlass.range_constexpr(1, len(tile_starts)):
        if block >= tile_starts[q]:
            part = cutlass.Int32(q)
            inside = (block - tile_starts[q]) * scale if const_expr(scale != 1) else block - tile_starts[q]
    return part, inside
