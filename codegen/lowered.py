"""A fused op's computation as plain data: the program a generated kernel runs (no CuTe, no FX).

The compiler lowers a fused op's reference, traced into ATen ops at the call's shapes
(``rewriter.compiler.lowering``), into a ``Program`` over one row of each token: its values are
rows (``[T, N]``: one value per token and column), per-token statistics (``[T, 1]``: a row's sum,
maximum, a norm's scale) and columns (``[N]``: the same for every token, a norm's weight); where
the reference reduces each head of a row, a token's row is ``group`` rows of its own. Every
operation computes in fp32; where the reference rounds (an ATen op whose result is bf16, fp16 or
fp8, a cast to one) the program says ``round``, so it rounds at the same points. The program is a tuple of
plain values: it is part of a ``KernelSpec``'s parameters, so the disk cache keys on it.

``interpret`` runs a program with torch on any device: the oracle a generated kernel is held to,
and the check that the lowering computes what the reference does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from codegen.host import host

KINDS = ("row", "stat", "col")  # [T, N], [T, 1], [N]
# what a program's rows may hold (fp8 E4M3: a quantized activation, saturated at +-448 as
# PyTorch's conversion is; the rowwise kernel's alone)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "relu", "reciprocal", "erf", "floor", "ceil",
         "rint", "trunc", "sin", "cos")  # rint: to the nearest whole number, half to even (torch.round)
# comparisons give 1.0 where they hold and 0.0 where not: a program's predicates are such values
BINARY = ("add", "sub", "mul", "div", "max", "min", "gt", "ge", "lt", "le", "eq", "ne")
SELECT = "select"  # (predicate, a, b): a where the predicate is not 0, else b (torch.where)
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
    # (value, dtype, shape) of each output, in the op's result order; shape: the result's dims past
    # the token's, as the reference returns it: (N,) a row, (1,) or () a statistic; (G, N) or
    # (G * N,) the G rows of a token's groups
    outputs: tuple[tuple[int, str, tuple[int, ...]], ...]
    # rows a token: 1, or the G groups of a token's row (a norm per head: the reference reduces the
    # last dim of a [T, G, N] view), each a row of ``width`` values; the kernels see T * G rows
    group: int = 1

    def __post_init__(self) -> None:
        if self.width < 1 or self.group < 1:
            raise LoweringError(f"rows of {self.width} columns, {self.group} a token")
        for kind, dtype in self.inputs:
            if kind not in KINDS or dtype not in DTYPES:
                raise LoweringError(f"input ({kind}, {dtype}): kinds {KINDS}, dtypes {tuple(DTYPES)}")
        kinds = [kind for kind, _ in self.inputs]
        for i, (op, args) in enumerate(self.ops):
            kinds.append(_kind(op, args, kinds, i))
        for value, dtype, shape in self.outputs:
            if not 0 <= value < len(kinds) or dtype not in DTYPES:
                raise LoweringError(f"output ({value}, {dtype}) names no value of the program or no dtype")
            if kinds[value] == "col":
                raise LoweringError("an output the same for every token (a column) is not a per-token result")
            if not (isinstance(shape, tuple) and all(isinstance(s, int) and s > 0 for s in shape)) or \
                    (kinds[value] == "row" and (not shape or shape[-1] % self.width)):
                raise LoweringError(f"output {value}, a {kinds[value]} of rows of {self.width}, as shape {shape!r} "
                                    "past the first dim")

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
        return (self.width, self.inputs, self.ops, self.outputs, self.group)

    def depends_on(self) -> list[frozenset[int]]:
        """For each value, the inputs it is computed from."""
        deps = [frozenset({i}) for i in range(len(self.inputs))]
        for op, args in self.ops:
            deps.append(frozenset().union(*(deps[a] for a in operands(op, args))))
        return deps

    def only(self, outputs: Sequence[int]) -> tuple[Program, tuple[int, ...]]:
        """(the program computing just its outputs ``outputs`` (indices into ``self.outputs``),
        the inputs it keeps, as indices into ``self.inputs``): every value none of them needs
        dropped, the rest renumbered in order."""
        needed = set()
        stack = [self.outputs[o][0] for o in outputs]
        while stack:
            v = stack.pop()
            if v not in needed:
                needed.add(v)
                if v >= len(self.inputs):
                    stack.extend(operands(*self.ops[v - len(self.inputs)]))
        kept = tuple(i for i in range(len(self.inputs)) if i in needed)
        new = {v: j for j, v in enumerate(kept)}
        ops = []
        for i, (op, args) in enumerate(self.ops):
            if len(self.inputs) + i in needed:
                new[len(self.inputs) + i] = len(kept) + len(ops)
                ops.append((op, (new[args[0]], args[1]) if op == ROUND else
                            tuple(a if is_const(a) else new[a] for a in args)))
        return (Program(self.width, tuple(self.inputs[i] for i in kept), tuple(ops),
                        tuple((new[self.outputs[o][0]], *self.outputs[o][1:]) for o in outputs), self.group), kept)

    @classmethod
    def from_params(cls, p: Sequence) -> Program:
        width, inputs, ops, outputs, group = p
        return cls(int(width), tuple(tuple(i) for i in inputs), tuple((op, tuple(args)) for op, args in ops),
                   tuple((v, dtype, tuple(shape)) for v, dtype, shape in outputs), int(group))

    def as_rows(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        """Input or output ``t`` as the kernels read it: a row [T * group, width] (a token's groups
        are consecutive rows), a statistic [T * group, 1], a column [width]."""
        return t.reshape(-1, self.width) if kind == "row" else t.reshape(-1, 1) if kind == "stat" else t.reshape(-1)


def is_const(ref: Ref) -> bool:
    return isinstance(ref, tuple)


def operands(op: str, args: tuple) -> tuple[int, ...]:
    """The values op ``(op, args)`` reads (not its constants, nor a rounding's dtype)."""
    return (args[0],) if op == ROUND else tuple(a for a in args if not is_const(a))


def result_kind(op: str, kinds: set[str]) -> str:
    """The kind of op ``op``'s result from its operands' kinds (constants left out): a reduction's
    is a statistic; a row wherever a row, or a statistic and a column, meet; else the one kind."""
    if op in REDUCE:
        return "stat"
    return "row" if "row" in kinds or kinds == {"stat", "col"} else next(iter(kinds))


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
        if op == ROUND and (args[1] not in DTYPES or args[1] == "fp32"):
            raise LoweringError(f"op {i} rounds to {args[1]!r}: {', '.join(d for d in DTYPES if d != 'fp32')}")
        k = kind_of(args[0])
        if k is None:
            raise LoweringError(f"op {i} ({op}) of a constant: fold it")
        return k
    if op in BINARY or op == SELECT:
        if len(args) != (3 if op == SELECT else 2):
            raise LoweringError(f"op {i} ({op}) takes {3 if op == SELECT else 2} arguments, got {len(args)}")
        ks = {kind_of(a) for a in args} - {None}
        if not ks:
            raise LoweringError(f"op {i} ({op}) of constants: fold it")
        return result_kind(op, ks)
    if op in REDUCE:
        if len(args) != 1 or kind_of(args[0]) != "row":
            raise LoweringError(f"op {i} ({op}) reduces one row")
        return "stat"
    raise LoweringError(f"op {i}: {op!r} is not an op of the lowered programs ({', '.join(UNARY + BINARY + REDUCE)}, "
                        f"{SELECT}, {ROUND})")


# ---- the interpreter: what a program computes, in torch ----------------------------------------
_UNARY = {"neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
          "tanh": torch.tanh, "sigmoid": torch.sigmoid, "abs": torch.abs, "relu": torch.relu,
          "reciprocal": torch.reciprocal, "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil,
          "rint": torch.round, "trunc": torch.trunc, "sin": torch.sin, "cos": torch.cos}
_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "max": torch.maximum,
           "min": torch.minimum, **{name: lambda a, b, f=f: f(a, b).float() for name, f in (
               ("gt", torch.gt), ("ge", torch.ge), ("lt", torch.lt), ("le", torch.le), ("eq", torch.eq),
               ("ne", torch.ne))}}
_REDUCE = {"sum": lambda x: x.sum(-1, keepdim=True), "rmax": lambda x: x.amax(-1, keepdim=True),
           "rmin": lambda x: x.amin(-1, keepdim=True)}
IDENTITY = {"sum": 0.0, "rmax": -math.inf, "rmin": math.inf}  # what a column past the row's end adds


def fold(op: str, args: tuple) -> float:
    """The value of ``op`` on constants (``("c", v)``; a rounding's dtype name), as the programs
    compute it: what the lowering writes in place of an op whose operands are all constants."""
    vals = [torch.tensor(a[1], dtype=torch.float32) for a in args if is_const(a)]
    if op == ROUND:
        return float(vals[0].to(DTYPES[args[1]]).float())
    table = _UNARY if op in _UNARY else _BINARY if op in _BINARY else {SELECT: _select} if op == SELECT else None
    if table is None:
        raise LoweringError(f"{op} of constants does not fold")
    return float(table[op](*vals))


def _select(predicate: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(predicate != 0, a, b)


def interpret(program: Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The program's outputs for ``inputs`` (rows [T, N], statistics [T, 1], columns [N]; with
    groups, [T, G * N] or any contiguous view of [T, G, N], and [T, G, 1]), computed in fp32 on
    their device and rounded where the program rounds; each output in its dtype and shape."""
    if len(inputs) != len(program.inputs):
        raise LoweringError(f"the program takes {len(program.inputs)} inputs, got {len(inputs)}")
    vals: list[torch.Tensor] = []
    for t, (kind, _) in zip(inputs, program.inputs, strict=True):
        width, group = program.width, program.group
        fits = {"row": t.dim() >= 2 and t.shape[-1] % width == 0 and (t.shape[-1] == width or group > 1),
                "stat": t.dim() >= 2 and t.shape[-1] in (1, group), "col": tuple(t.shape) == (width,)}[kind]
        if not fits:
            raise LoweringError(f"a {kind} input of rows of {program.width} values, {program.group} a token: got "
                                f"{tuple(t.shape)}")
        vals.append(program.as_rows(kind, t).float())

    def get(ref: Ref) -> torch.Tensor:
        return torch.tensor(ref[1], dtype=torch.float32, device=vals[0].device) if is_const(ref) else vals[ref]

    for op, args in program.ops:
        if op in _UNARY:
            vals.append(_UNARY[op](get(args[0])))
        elif op in _BINARY:
            vals.append(_BINARY[op](get(args[0]), get(args[1])))
        elif op == SELECT:
            vals.append(_select(*(get(a) for a in args)))
        elif op in _REDUCE:
            vals.append(_REDUCE[op](get(args[0])))
        else:  # ROUND
            vals.append(get(args[0]).to(DTYPES[args[1]]).float())
    return [vals[v].to(DTYPES[dtype]).reshape(-1, *shape) for v, dtype, shape in program.outputs]


# ---- programs around matrix products ------------------------------------------------------------
# Where a program's input comes from, in a stage of a product program:
#   ("arg", i, c0)  the op's tensor argument i (a row from its column c0 on: a view of a wider row)
#   ("acc", p)      the fp32 accumulator of the stage's product p (epilogue only)
#   ("pro", j)      output j of the stage's prologue (epilogue only: a statistic the prologue computed)
#   ("temp", k)     intermediate k, written by an earlier stage
#   ("scalar", i)   the op's one-element tensor argument i (a per-tensor scale), read as a statistic
#                   the same for every token
# Where a program's output goes:
#   ("product",)    the prologue's first output: the products' activation (bf16)
#   ("keep",)       a prologue statistic only the epilogue reads
#   ("result", r)   the op's result r
#   ("temp", k)     intermediate k, read by a later stage
SOURCES = ("arg", "acc", "pro", "temp", "scalar")
READ = ("arg", "temp", "scalar")  # the sources a kernel reads from memory (tensors it is handed)
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}  # what a product's weight rows hold
# MXFP4 weights: E2M1 codes in Humming's layout (what vLLM leaves on Hopper: int32 [K/16, 2N]) with
# one E8M0 scale per 32 values of a row ([K/32, N]); the host's ``dequant`` reads them by this name
MXFP4 = "mxfp4/humming"
DESTS = ("product", "keep", "result", "temp")


@dataclass(frozen=True)
class Stage:
    """One kernel of a product program: ``a = prologue(...)`` over rows of K values;
    ``acc_p = a @ W_p[rows]^T`` for each product p (bf16 a, W in ``weight_dtype``, converted
    exactly, fp32 sums), all N wide; then ``epilogue(acc_0, ..., ...)`` over rows of N values,
    which is pointwise (no reduction: a row of N is spread over the kernel's CTAs; an fp8
    weight's scales are epilogue inputs)."""
    prologue: Program
    prologue_from: tuple[tuple, ...]
    prologue_to: tuple[tuple, ...]
    weights: tuple[tuple[int, int], ...]  # (op tensor argument, first row) of each product's [N, K] rows
    epilogue: Program
    epilogue_from: tuple[tuple, ...]
    epilogue_to: tuple[tuple, ...]
    weight_dtype: str = "bf16"  # every product's (WEIGHT_DTYPES, or MXFP4)
    scales: tuple[int, ...] = ()  # MXFP4: the op tensor argument of each product's E8M0 scales

    def __post_init__(self) -> None:
        pro, epi = self.prologue, self.epilogue
        if len(self.prologue_from) != len(pro.inputs) or len(self.epilogue_from) != len(epi.inputs):
            raise LoweringError("a program input without its source")
        if len(self.prologue_to) != len(pro.outputs) or len(self.epilogue_to) != len(epi.outputs):
            raise LoweringError("a program output without its destination")
        if not pro.outputs or self.prologue_to[0] != ("product",) or pro.outputs[0][1] != "bf16" \
                or pro.kinds[pro.outputs[0][0]] != "row":
            raise LoweringError("the prologue's first output is the products' activation, a bf16 row")
        if epi.reductions:
            raise LoweringError("the epilogue reduces a product's row: a row of N is spread over the kernel's "
                                "CTAs, so the epilogue is pointwise")
        if not self.weights:
            raise LoweringError("a stage without a product")
        if self.weight_dtype not in (*WEIGHT_DTYPES, MXFP4):
            raise LoweringError(f"weights of {self.weight_dtype}: the products read {', '.join(WEIGHT_DTYPES)} and "
                                f"{MXFP4}")
        if len(self.scales) != (len(self.weights) if self.weight_dtype == MXFP4 else 0):
            raise LoweringError(f"{len(self.scales)} scale arguments for {len(self.weights)} {self.weight_dtype} "
                                "products: one each for MXFP4, none otherwise")
        for src in (*self.prologue_from, *self.epilogue_from):
            if src[0] not in SOURCES or (src[0] in ("acc", "pro") and src in self.prologue_from):
                raise LoweringError(f"source {src!r}: the prologue reads arguments and intermediates, the epilogue "
                                    "also accumulators and the prologue's statistics")
            if src[0] == "acc" and not 0 <= src[1] < len(self.weights):
                raise LoweringError(f"source {src!r}: the stage has {len(self.weights)} products")
            if src[0] == "pro" and not (0 < src[1] < len(pro.outputs) and self.prologue_to[src[1]] != ("product",)):
                raise LoweringError(f"source {src!r} names no statistic of the prologue")
        for dest in (*self.prologue_to[1:], *self.epilogue_to):
            if dest[0] not in DESTS[1:] or (dest[0] == "keep" and dest in self.epilogue_to):
                raise LoweringError(f"destination {dest!r}")

    @property
    def k(self) -> int:
        return self.prologue.width

    @property
    def n(self) -> int:
        return self.epilogue.width

    @property
    def weight_tensors(self) -> int:
        """Tensors the kernel is handed for the products' weights: an MXFP4 product's codes and its scales."""
        return len(self.weights) * (2 if self.weight_dtype == MXFP4 else 1)

    def to_params(self) -> tuple:
        return (self.prologue.to_params(), self.prologue_from, self.prologue_to, self.weights,
                self.epilogue.to_params(), self.epilogue_from, self.epilogue_to, self.weight_dtype, self.scales)

    @classmethod
    def from_params(cls, p: Sequence) -> Stage:
        pro, pro_from, pro_to, weights, epi, epi_from, epi_to, weight_dtype, scales = p

        def tuples(xs):
            return tuple(tuple(x) for x in xs)
        return cls(Program.from_params(pro), tuples(pro_from), tuples(pro_to), tuples(weights),
                   Program.from_params(epi), tuples(epi_from), tuples(epi_to), weight_dtype, tuple(scales))


@dataclass(frozen=True)
class Tail:
    """A program over rows of an intermediate once a collective has run on it (o_proj's partial
    sums all-reduced, then its residual add and norm): its inputs read from ``sources`` and its
    outputs written to ``dests``, as a stage's programs are."""
    program: Program
    sources: tuple[tuple, ...]
    dests: tuple[tuple, ...]

    def to_params(self) -> tuple:
        return (self.program.to_params(), self.sources, self.dests)

    @classmethod
    def from_params(cls, p: Sequence) -> Tail:
        program, sources, dests = p
        return cls(Program.from_params(program), tuple(tuple(x) for x in sources), tuple(tuple(x) for x in dests))


@dataclass(frozen=True)
class Products:
    """A fused op made of matrix products with pointwise work around them: its stages, run in
    order (one kernel each), the intermediates between them ([T, width] in a dtype) and how many
    results the op returns."""
    stages: tuple[Stage, ...]
    temps: tuple[tuple[int, str], ...]  # (width, dtype) of each intermediate
    results: int
    # (result, collective, group, ranks): a collective the reference applies to a result last
    # (``k3.all_reduce``: summed over the group's ranks; ``k3.gather_last_dim``: the ranks' results
    # side by side), run by the host once the stages have run, in this order
    collectives: tuple[tuple[int, str, str, int], ...] = ()
    # (intermediate, collective, group, ranks): a collective inside the op, on an intermediate the
    # stages wrote, run by the host after them; the tails then read it
    between: tuple[tuple[int, str, str, int], ...] = ()
    tails: tuple[Tail, ...] = ()

    def to_params(self) -> tuple:
        return (tuple(s.to_params() for s in self.stages), self.temps, self.results, self.collectives, self.between,
                tuple(t.to_params() for t in self.tails))

    @classmethod
    def from_params(cls, p: Sequence) -> Products:
        stages, temps, results, collectives, between, tails = p
        return cls(tuple(Stage.from_params(s) for s in stages), tuple(tuple(t) for t in temps), int(results),
                   tuple(tuple(c) for c in collectives), tuple(tuple(c) for c in between),
                   tuple(Tail.from_params(t) for t in tails))


def weight_rows(stage: Stage, p: int, args: Sequence[torch.Tensor]) -> torch.Tensor:
    """Product ``p``'s [N, K] weight rows of ``stage`` from the op's tensor arguments ``args``, as
    the kernels multiply them (MXFP4: dequantized by the host, exactly)."""
    w, r0 = stage.weights[p]
    if stage.weight_dtype != MXFP4:
        return args[w][r0:r0 + stage.n]
    codes, scales = args[w][:, 2 * r0:2 * (r0 + stage.n)], args[stage.scales[p]][:, r0:r0 + stage.n]
    return host().dequant(MXFP4, codes, scales)


def interpret_products(products: Products, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The results of ``products`` for the op's tensor arguments ``args``, computed as the kernels
    do: each stage's prologue, its products in fp32 from bf16 or fp8 operands, its epilogue; the
    collectives on results are left out (one rank's view: at one rank each is the identity)."""
    temps: dict[int, torch.Tensor] = {}
    results: dict[int, torch.Tensor] = {}

    def source(src, program: Program, kind: str, acc=(), pro=()):
        if src[0] == "arg":
            t = args[src[1]]
            if program.group > 1:  # read whole, a token's groups as rows
                return program.as_rows(kind, t)
            return t.flatten(0, -2)[:, src[2]:src[2] + program.width] if kind == "row" else \
                t.reshape(-1)[src[2]:src[2] + program.width] if kind == "col" else t.reshape(-1, 1)
        if src[0] == "temp":
            return temps[src[1]]
        if src[0] == "scalar":
            return args[src[1]].reshape(1, 1)
        return acc[src[1]] if src[0] == "acc" else pro[src[1]]

    def place(dest, value):
        if dest[0] == "result":
            results[dest[1]] = value
        elif dest[0] == "temp":
            temps[dest[1]] = value

    for stage in products.stages:
        pro_in = [source(s, stage.prologue, kind) for s, (kind, _) in zip(stage.prologue_from, stage.prologue.inputs,
                                                                           strict=True)]
        pro = interpret(stage.prologue, pro_in)
        for dest, value in zip(stage.prologue_to, pro, strict=True):
            place(dest, value)
        a = pro[0].float()
        acc = [a @ weight_rows(stage, p, args).float().t() for p in range(len(stage.weights))]
        pro_stats = [p.reshape(-1, 1) for p in pro]
        epi_in = [source(s, stage.epilogue, kind, acc, pro_stats)
                  for s, (kind, _) in zip(stage.epilogue_from, stage.epilogue.inputs, strict=True)]
        for dest, value in zip(stage.epilogue_to, interpret(stage.epilogue, epi_in), strict=True):
            place(dest, value)
    for tail in products.tails:  # after the collectives between (on one rank, each the identity)
        ins = [source(s, tail.program, kind) for s, (kind, _) in zip(tail.sources, tail.program.inputs, strict=True)]
        for dest, value in zip(tail.dests, interpret(tail.program, ins), strict=True):
            place(dest, value)
    return [results[r] for r in range(products.results)]
