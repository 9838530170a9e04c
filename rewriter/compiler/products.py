"""A fused op's graph cut at its matrix products into stages (``codegen.lowered.Products``).

A product is ``aten.mm(a, W^T)`` where ``W`` is one of the op's [N, K] weights (or a row slice
of one: a chunk of a packed gate-and-up weight), read in bf16. A node's *depth* is the number
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

import torch
from torch import fx

from codegen.lowered import LoweringError, Products, Ref, Stage
from rewriter.compiler.aten_ops import CASTS, DTYPE_NAMES, SHAPE_ONLY, Builder, columns, kind_of

aten = torch.ops.aten
TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
PRODUCT_OPS = (aten.mm.default, *TRANSPOSES)


def _weight(node: fx.Node, args: dict[fx.Node, int]) -> tuple[int, int, int]:
    """(op tensor argument, first row, rows) of the weight a product's second operand reads:
    ``W^T`` of an [N, K] argument, through row slices (before or after the transpose) and
    casts of a bf16 weight."""
    # walking up from the product: above the transpose the operand is W^T [K, N] (rows are dim
    # 1), below it the weight [N, K] itself (rows are dim 0)
    row0, rows, below, seen = 0, None, False, node
    while True:
        if seen in args:
            val = seen.meta["val"]
            if val.dim() != 2 or not below:
                raise LoweringError(f"product operand {node.name} is not the transpose of an [N, K] argument")
            if val.dtype != torch.bfloat16:
                raise LoweringError(f"weight {seen.name} is {val.dtype}: the generated products read bf16 weights")
            return args[seen], row0, rows if rows is not None else val.shape[0] - row0
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
        elif t in CASTS or t in SHAPE_ONLY:
            if t not in CASTS and seen.meta["val"].shape != seen.args[0].meta["val"].shape:
                raise LoweringError(f"{seen.name} ({t}) reshapes a weight")
        else:
            raise LoweringError(f"product operand {node.name} is computed ({seen.name}: {t}): the generated products "
                                "read weights as the op's arguments")
        seen = seen.args[0]


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
        self.products: dict[tuple[fx.Node, int], int] = {}
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
        arg, row0, rows = self.staging.weights[mm]
        if c0 + b.width > rows:
            raise LoweringError(f"{mm.name}: columns {c0}..{c0 + b.width} of a product of {rows}")
        key = (mm, c0)
        if key not in self.products:
            self.products[key] = len(self.weights)
            self.weights.append((arg, row0 + c0))
        return b.rounded(b.input("row", "fp32", ("acc", self.products[key])), mm)

    def stage(self) -> Stage:
        return Stage(self.pro.program(), tuple(self.pro.sources), tuple(self.pro_to), tuple(self.weights),
                     self.epi.program(), tuple(self.epi.sources), tuple(self.epi_to))


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

    def argument(self, b: Builder, node: fx.Node, c0: int) -> int:
        val = node.meta["val"]
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
    return Products(tuple(st.stage() for _, st in order), tuple(s.temps), len(results))

