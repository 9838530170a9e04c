"""A fused op's graph cut at its matrix products into stages (``codegen.lowered.Products``).

A product is ``aten.mm(a, W^T)`` where ``W`` is one of the op's [N, K] weights (or a row slice
of one: a chunk of a packed gate-and-up weight), read in bf16 or fp8 E4M3 (times its scale, per
channel or per tensor: the kernels scale the product's fp32 sums in the epilogue), or the values
of MXFP4 codes and scales in Humming's layout (``k3.mxfp4_dequant``: the kernels dequantize them
as they read them). A node's *depth* is the number
of products on its longest path from the op's arguments. The products of one depth read one
activation ``a`` and form one stage per output width N: one kernel that computes ``a``
(the prologue, over rows of K: a norm, a residual add, a cast), multiplies it by every product's
weight rows, and applies the pointwise work after them (the epilogue, over rows of N: an
activation times a gate, a residual add, a scale, casts, several outputs). A split or slice of
a product's output along its last dim is a product of that slice of the weight's rows, so a
packed gate-and-up projection is two products whose halves meet in one epilogue.

What crosses stages goes through memory: a value of depth d that a later stage reads is an
output of d's epilogue (an intermediate); a statistic of depth 0 that an epilogue reads (a
norm's scale) is computed by the stage's own prologue, in the same kernel, unless it is a
function of statistics alone (a gate's sigmoid), which the epilogue recomputes. The epilogue is
pointwise: a reduction over a product's row is refused, by name.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from codegen.lowered import MXFP4, WEIGHT_DTYPES, LoweringError, Products, Ref, Stage
from rewriter.compiler.aten_ops import CASTS, DTYPE_NAMES, SHAPE_ONLY, Builder, columns, kind_of
from rewriter.model import ops as _k3_ops  # noqa: F401  (defines k3::mxfp4_dequant)

aten = torch.ops.aten
TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
MXFP4_DEQUANT = torch.ops.k3.mxfp4_dequant.default
PRODUCT_OPS = (aten.mm.default, *TRANSPOSES, MXFP4_DEQUANT)
MXFP4_TILE_ROWS = 64  # Humming's layout keeps each 64 rows' codes and scales apart: a row slice cuts between them


@dataclass(frozen=True)
class Weight:
    """What a product's second operand reads: rows ``row0 ..`` of the op's [N, K] argument
    ``arg`` in ``dtype``, and the scale its rows are multiplied by, where it has one:
    ``("col", argument, first row)`` (per channel, [N] or [N, 1]) or ``("scalar", argument)``
    (per tensor, one element); MXFP4 (``dtype`` MXFP4): ``arg`` holds the codes and ``block_scales``
    the argument of their E8M0 scales."""
    arg: int
    row0: int
    rows: int
    dtype: str
    scale: tuple | None = None
    block_scales: int | None = None


def _scale_argument(node: fx.Node, args: dict[fx.Node, int], rows: int) -> tuple | None:
    """``node`` as a weight's scale: an fp32, bf16 or fp16 argument (through casts) of one element
    or of one value per row."""
    while node.op == "call_function" and node.target in CASTS:
        node = node.args[0]
    if node not in args:
        return None
    val = node.meta["val"]
    if val.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if val.numel() == 1:
        return ("scalar", args[node])
    if tuple(val.shape) in ((rows,), (rows, 1)):
        return ("col", args[node])
    return None


def _weight(node: fx.Node, args: dict[fx.Node, int]) -> Weight:
    """The weight a product's second operand reads: ``W^T`` of an [N, K] argument, through row
    slices (before or after the transpose), casts of a bf16 or fp8 weight and, for fp8, the
    multiplication by its scale (per channel or per tensor) where no rounding follows it."""
    # walking up from the product: above the transpose the operand is W^T [K, N] (rows are dim
    # 1), below it the weight [N, K] itself (rows are dim 0)
    row0, rows, below, seen, scale, rounds = 0, None, False, node, None, None
    while True:
        if seen.op == "call_function" and seen.target is MXFP4_DEQUANT:
            return _mxfp4_weight(node, seen, args, below, row0, rows, scale)
        if seen in args:
            val = seen.meta["val"]
            if val.dim() != 2:
                raise LoweringError(f"product operand {node.name} is a {val.dim()}-D argument: a product's weight is "
                                    "one [N, K] matrix (a batched matmul by a weight per head is not a product)")
            if not below:
                raise LoweringError(f"product operand {node.name} reads the argument {seen.name} as a [K, N] weight "
                                    "(x @ W): the product kernels read weights as [N, K] rows, F.linear's layout "
                                    "(store W transposed and write F.linear(x, W))")
            dtype = next((name for name, dt in WEIGHT_DTYPES.items() if dt == val.dtype), None)
            if dtype is None:
                raise LoweringError(f"weight {seen.name} is {val.dtype}: the generated products read "
                                    f"{', '.join(WEIGHT_DTYPES)} weights")
            if scale is not None and dtype == "bf16":
                raise LoweringError(f"bf16 weight {seen.name} is scaled before its product: scales go with fp8 weights")
            return Weight(args[seen], row0, rows if rows is not None else val.shape[0] - row0, dtype, scale)
        if seen.op != "call_function":
            raise LoweringError(f"product operand {node.name} is not read from an argument")
        t = seen.target
        row_dim = 0 if below else 1
        if t in TRANSPOSES:
            dims = seen.args[1] if t is aten.permute.default else [1, 0]
            if list(dims) not in ([1, 0], [-1, -2], [1, -2], [-1, 0]) or below:
                raise LoweringError(f"product operand {node.name} transposes twice or permutes {dims}")
            below = True
        elif t is aten.slice.Tensor or t is operator.getitem:
            if t is aten.slice.Tensor:
                src, dim = seen.args[0], seen.args[1] if len(seen.args) > 1 else 0
                total = src.meta["val"].shape[dim]
                start = seen.args[2] if len(seen.args) > 2 and seen.args[2] is not None else 0
                start = max(0, start + total if start < 0 else start)
                n = seen.meta["val"].shape[row_dim]
                if src.meta["val"].dim() != 2 or dim % 2 != row_dim or (len(seen.args) > 4 and seen.args[4] != 1):
                    raise LoweringError(f"{seen.name} slices a weight across its K dim: products take row slices")
            else:
                split = seen.args[0]
                src, size = split.args[0], split.args[1]
                dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
                if dim % 2 != row_dim:
                    raise LoweringError(f"{split.name} splits a weight across its K dim: products take row slices")
                total = src.meta["val"].shape[dim]
                sizes = size if isinstance(size, (list, tuple)) else [size] * -(-total // size)
                start, n = sum(sizes[:seen.args[1]]), sizes[seen.args[1]]
            row0, rows = row0 + start, n if rows is None else rows
            seen = src
            continue
        elif t is aten.mul.Tensor and below and scale is None:
            rows_here = seen.meta["val"].shape[0]
            # (the scale, the weight side) of the product's two operands, whichever order
            found = next(((sc, a) for a, b in (seen.args, seen.args[::-1])
                          if isinstance(a, fx.Node) and isinstance(b, fx.Node)
                          and (sc := _scale_argument(b, args, rows_here)) is not None), None)
            if found is None:
                raise LoweringError(f"product operand {node.name} is computed ({seen.name}: {t}): the generated "
                                    "products read weights as the op's arguments, times a scale")
            if rounds is not None:
                raise LoweringError(f"the scaled weight {seen.name} is rounded to {rounds} before its product: the "
                                    "kernels scale the product's fp32 sums (multiply the product by the scale, "
                                    "or multiply in fp32)")
            scale, seen = found
            scale = (*scale, row0) if scale[0] == "col" else scale  # this product's rows of the scale
            continue
        elif t in CASTS or t in SHAPE_ONLY:
            if t not in CASTS and seen.meta["val"].shape != seen.args[0].meta["val"].shape:
                raise LoweringError(f"{seen.name} ({t}) reshapes a weight")
            if t in CASTS and scale is None and seen.meta["val"].dtype != torch.float32 and \
                    seen.args[0].meta["val"].dtype == torch.float32:
                rounds = DTYPE_NAMES.get(seen.meta["val"].dtype, str(seen.meta["val"].dtype))
        else:
            raise LoweringError(f"product operand {node.name} is computed ({seen.name}: {t}): the generated products "
                                "read weights as the op's arguments")
        seen = seen.args[0]


def _mxfp4_weight(node: fx.Node, dequant: fx.Node, args: dict[fx.Node, int], below: bool, row0: int,
                  rows: int | None, scale: tuple | None) -> Weight:
    """The MXFP4 weight ``k3.mxfp4_dequant(codes, scales, layout)`` of product operand ``node``:
    codes and scales are the op's arguments, in Humming's layout, 2-D (one weight, no experts),
    read in whole 64-row tiles."""
    codes, scales, layout = dequant.args
    if not below:
        raise LoweringError(f"product operand {node.name} is not the transpose of MXFP4 weight {dequant.name}")
    if layout != "humming":
        raise LoweringError(f"MXFP4 weight {dequant.name} in the {layout!r} layout: the generated products read "
                            "Humming's (what vLLM leaves on Hopper)")
    if codes not in args or scales not in args:
        raise LoweringError(f"MXFP4 weight {dequant.name}: its codes and scales are the op's arguments")
    if codes.meta["val"].dim() != 2:
        raise LoweringError(f"MXFP4 weight {dequant.name} has codes of {codes.meta['val'].dim()} dims: a product's "
                            "weight is one [N, K] matrix (an expert chosen at run time is not a product by a weight)")
    if scale is not None:
        raise LoweringError(f"MXFP4 weight {dequant.name} is scaled again before its product")
    n = dequant.meta["val"].shape[0]
    rows = n - row0 if rows is None else rows
    if row0 % MXFP4_TILE_ROWS or rows % MXFP4_TILE_ROWS:
        raise LoweringError(f"rows {row0}..{row0 + rows} of MXFP4 weight {dequant.name}: Humming's layout is read "
                            f"in whole {MXFP4_TILE_ROWS}-row tiles")
    return Weight(args[codes], row0, rows, MXFP4, None, args[scales])


def _activation(mm: fx.Node) -> fx.Node:
    """The bf16 value a product multiplies: its first operand, through casts to fp32 of a bf16
    value (exact)."""
    a = mm.args[0]
    while a.op == "call_function" and a.target in CASTS and a.meta["val"].dtype == torch.float32 and \
            a.args[0].meta["val"].dtype == torch.bfloat16:
        a = a.args[0]
    if a.meta["val"].dtype != torch.bfloat16:
        raise LoweringError(f"product {mm.name} multiplies {a.name}, {a.meta['val'].dtype}: the generated products "
                            "multiply bf16 activations")
    return a


class _Stage:
    """A stage while it is written: its prologue and epilogue builders and its products."""

    def __init__(self, staging: _Staging, depth: int, width: int):
        self.staging, self.depth = staging, depth
        self.a = staging.activation[depth]
        self.weights: list[tuple[int, int]] = []
        self.scales: list[int] = []  # MXFP4: each product's scales argument
        self.products: dict[tuple[fx.Node, int], int] = {}
        self.weight_dtype: dict[str, str] = {}  # "dtype": the products' weight dtype, once one is read
        self.pro_to: list[tuple] = [("product",)]
        self.stats: dict[fx.Node, int] = {}  # a depth-0 statistic the epilogue reads -> its prologue output
        self.epi_to: list[tuple] = []
        self.pro = Builder(staging.tokens, columns(self.a), self._resolve_prologue)
        self.epi = Builder(staging.tokens, width, self._resolve_epilogue)
        self.pro.output(self.a)

    def _resolve_prologue(self, b: Builder, node: fx.Node, c0: int) -> Ref | None:
        s = self.staging
        if node in s.args:
            return s.argument(b, node, c0)
        if s.depth[node] == 0:
            return None
        if s.depth[node] >= self.depth:
            raise LoweringError(f"{node.name} is computed after the products it feeds")
        return b.input("row", DTYPE_NAMES[node.meta["val"].dtype], s.temp(node, c0, b.width))

    def _resolve_epilogue(self, b: Builder, node: fx.Node, c0: int) -> Ref | None:
        s = self.staging
        if node in s.args:
            return s.argument(b, node, c0)
        depth = s.depth[node]
        if node.target is aten.mm.default and depth == self.depth:
            return self._product(b, node, c0)
        if depth == self.depth:
            return None
        if depth == 0:
            kind = kind_of(tuple(node.meta["val"].shape), b.tokens, b.width, c0)
            if kind != "stat" or self.staging.from_statistics(node):
                return None  # a row or column of the arguments, or a function of statistics: recomputed here
            # a statistic of a row (a norm's scale): the prologue computes it, in this kernel
            if node not in self.stats:
                self.stats[node] = self.pro.output(node)
                self.pro_to.append(("keep",))
            j = self.stats[node]
            return b.input("stat", self.pro.outputs[j][1], ("pro", j))
        return b.input("row", DTYPE_NAMES[node.meta["val"].dtype], s.temp(node, c0, b.width))

    def _product(self, b: Builder, mm: fx.Node, c0: int) -> Ref:
        if _activation(mm) is not self.a:
            raise LoweringError(f"products {mm.name} and another of depth {self.depth} read different activations: "
                                "the products of one stage read one")
        w = self.staging.weights[mm]
        if c0 + b.width > w.rows:
            raise LoweringError(f"{mm.name}: columns {c0}..{c0 + b.width} of a product of {w.rows}")
        if self.weight_dtype.setdefault("dtype", w.dtype) != w.dtype:
            raise LoweringError(f"{mm.name} reads {w.dtype} weights beside {self.weight_dtype['dtype']} ones: the "
                                "products of one stage read one weight dtype")
        key = (mm, c0)
        if key not in self.products:
            if w.block_scales is not None and c0 % MXFP4_TILE_ROWS:
                raise LoweringError(f"{mm.name}: columns from {c0} of an MXFP4 product: Humming's layout is read in "
                                    f"whole {MXFP4_TILE_ROWS}-row tiles")
            self.products[key] = len(self.weights)
            self.weights.append((w.arg, w.row0 + c0))
            if w.block_scales is not None:
                self.scales.append(w.block_scales)
        acc = b.input("row", "fp32", ("acc", self.products[key]))
        if w.scale is not None:  # the fp8 weight's scale, on the fp32 sums (exact where the reference is fp32)
            dtype = DTYPE_NAMES[self.staging.arg_dtype(w.scale[1])]
            scale = b.input("col", dtype, ("arg", w.scale[1], w.scale[2] + c0)) if w.scale[0] == "col" else \
                b.input("stat", dtype, ("scalar", w.scale[1]))
            acc = b.value("mul", acc, scale)
        return b.rounded(acc, mm)

    def stage(self) -> Stage:
        return Stage(self.pro.program(), tuple(self.pro.sources), tuple(self.pro_to), tuple(self.weights),
                     self.epi.program(), tuple(self.epi.sources), tuple(self.epi_to),
                     self.weight_dtype.get("dtype", "bf16"), tuple(self.scales))


class _Staging:
    """The whole op: depths, weights, the stages by (depth, width) and the intermediates."""

    def __init__(self, gm: fx.GraphModule, args: dict[fx.Node, int]):
        self.args = args
        mms = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.mm.default]
        self.weights = {mm: _weight(mm.args[1], args) for mm in mms}
        self.depth: dict[fx.Node, int] = {}
        for n in gm.graph.nodes:
            deps = [self.depth.get(a, 0) for a in n.all_input_nodes]
            self.depth[n] = (self.depth[_activation(n)] + 1) if n in self.weights else max(deps, default=0)
        self.activation = {}
        for mm in mms:
            a = _activation(mm)
            if self.activation.setdefault(self.depth[mm], a) is not a:
                raise LoweringError(f"products of depth {self.depth[mm]} read {self.activation[self.depth[mm]].name} "
                                    f"and {a.name}: the products of one stage read one activation")
        self.tokens = self.activation[1].meta["val"].shape[0]
        self.stages: dict[tuple[int, int], _Stage] = {}
        self.temps: list[tuple[int, str]] = []
        self.temp_of: dict[tuple[fx.Node, int, int], int] = {}
        self.stat_only: dict[fx.Node, bool] = {}

    def from_statistics(self, node: fx.Node) -> bool:
        """Whether ``node`` is computed from statistics and numbers alone (no row or column of K
        on its way): an epilogue recomputes it rather than the prologue keeping it."""
        if node not in self.stat_only:
            val = node.meta.get("val")
            small = not isinstance(val, torch.Tensor) or val.numel() <= self.tokens
            self.stat_only[node] = small and all(self.from_statistics(a) for a in node.all_input_nodes)
        return self.stat_only[node]

    def stage(self, depth: int, width: int) -> _Stage:
        if depth not in self.activation:
            raise LoweringError(f"a value of depth {depth} with no product of that depth")
        key = (depth, width)
        if key not in self.stages:
            self.stages[key] = _Stage(self, depth, width)
        return self.stages[key]

    def arg_dtype(self, i: int) -> torch.dtype:
        return next(n for n, j in self.args.items() if j == i).meta["val"].dtype

    def argument(self, b: Builder, node: fx.Node, c0: int) -> int:
        val = node.meta["val"]
        if val.numel() == 1 and DTYPE_NAMES.get(val.dtype) is not None:  # one value for the whole step
            return b.input("stat", DTYPE_NAMES[val.dtype], ("scalar", self.args[node]))
        kind = kind_of(tuple(val.shape), b.tokens, b.width, c0)
        if kind is None or DTYPE_NAMES.get(val.dtype) is None:
            raise LoweringError(f"argument {node.name} of shape {tuple(val.shape)} and {val.dtype}: a program over "
                                f"rows of {b.width} reads rows, statistics and columns in bf16, fp16 or fp32")
        return b.input(kind, DTYPE_NAMES[val.dtype], ("arg", self.args[node], c0 if kind != "stat" else 0))

    def temp(self, node: fx.Node, c0: int, width: int) -> tuple:
        """The intermediate holding columns c0.. of ``node`` (a row of an earlier stage's epilogue)."""
        key = (node, c0, width)
        if key not in self.temp_of:
            stage = self.stage(self.depth[node], width)
            if kind_of(tuple(node.meta["val"].shape), self.tokens, width, c0) != "row":
                raise LoweringError(f"{node.name} crosses stages as a statistic: only rows go through memory")
            stage.epi.output(node, c0)
            self.temp_of[key] = len(self.temps)
            stage.epi_to.append(("temp", len(self.temps)))
            self.temps.append((width, DTYPE_NAMES[node.meta["val"].dtype]))
        return ("temp", self.temp_of[key])

    def result(self, node: fx.Node, r: int) -> None:
        if node in self.args:
            raise LoweringError(f"the reference returns its argument {node.name}")
        depth = self.depth[node]
        if depth == 0:  # computed before any product: the prologue of the first stage writes it
            stage = next((s for (d, _), s in self.stages.items() if d == 1), None)
            if stage is None:
                raise LoweringError(f"{node.name} is computed before the products, and no result after them")
            if kind_of(tuple(node.meta["val"].shape), self.tokens, 2) != "stat" and columns(node) != stage.pro.width:
                raise LoweringError(f"the reference returns {node.name}, {columns(node)} columns wide, computed before "
                                    f"the products: a prologue's rows are K = {stage.pro.width} wide")
            stage.pro.output(node)
            stage.pro_to.append(("result", r))
            return
        if kind_of(tuple(node.meta["val"].shape), self.tokens, 2) == "stat":
            raise LoweringError(f"the reference returns {node.name}, a statistic of a product's row: an epilogue is "
                                "pointwise (a row of N is spread over the kernel's CTAs)")
        width = columns(node)
        stage = self.stage(depth, width)
        stage.epi.output(node)
        stage.epi_to.append(("result", r))


def lower_products(gm: fx.GraphModule, args: dict[fx.Node, int], results: list[fx.Node]) -> Products:
    """The stages of ``gm`` (a trace with at least one ``aten.mm``); ``args`` maps its
    placeholders to the op's tensor arguments."""
    s = _Staging(gm, args)
    late = [(r, i) for i, r in enumerate(results) if s.depth.get(r, 0) > 0]
    early = [(r, i) for i, r in enumerate(results) if s.depth.get(r, 0) == 0]
    for node, i in (*late, *early):
        s.result(node, i)
    order = sorted(s.stages.items(), key=lambda kv: kv[0][0])  # by depth: an intermediate before its reader
    return Products(tuple(part for _, st in order for part in apart(st.stage())), tuple(s.temps), len(results))


def apart(stage: Stage) -> list[Stage]:
    """``stage`` cut into one stage for each group of its products whose results meet in its
    epilogue: two projections of one width from one activation (two slices of a packed weight)
    become two stages, each a part of one kernel beside the other widths, while a gate and its up
    projection stay one. Only where the prologue computes the activation alone (nothing else a
    second copy of it would write again)."""
    if len(stage.weights) == 1 or stage.prologue_to != (("product",),):
        return [stage]
    epi = stage.epilogue
    deps = epi.depends_on()
    products_of = [{stage.epilogue_from[i][1] for i in deps[v] if stage.epilogue_from[i][0] == "acc"}
                   for v, _, _ in epi.outputs]
    group = list(range(len(stage.weights)))  # union-find over the products

    def root(p):
        while group[p] != p:
            p = group[p]
        return p
    for ps in products_of:
        for p in ps:
            group[root(p)] = root(min(ps))
    roots = sorted({root(p) for p in range(len(stage.weights))})
    if len(roots) == 1:
        return [stage]
    parts = []
    for r in roots:
        products = [p for p in range(len(stage.weights)) if root(p) == r]
        outputs = [o for o, ps in enumerate(products_of) if ps and root(min(ps)) == r]
        if not outputs:  # a product no output reads: the stage stays whole, as the reference wrote it
            return [stage]
        program, kept = epi.only(outputs)
        renumber = {p: j for j, p in enumerate(products)}
        sources = tuple(("acc", renumber[stage.epilogue_from[i][1]]) if stage.epilogue_from[i][0] == "acc"
                        else stage.epilogue_from[i] for i in kept)
        parts.append(Stage(stage.prologue, stage.prologue_from, stage.prologue_to,
                           tuple(stage.weights[p] for p in products), program, sources,
                           tuple(stage.epilogue_to[o] for o in outputs), stage.weight_dtype,
                           tuple(stage.scales[p] for p in products) if stage.scales else ()))
    if sum(len(p.epilogue_to) for p in parts) != len(stage.epilogue_to):
        return [stage]  # an output of no product's value (an argument passed through): kept whole
    return parts

