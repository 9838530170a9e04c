"""From a fused op's reference to the program a generated kernel runs (``codegen.lowered``).

The reference (the Python function a ``k3f::`` op is defined from) is traced into ATen ops at
the call's shapes and dtypes (``make_fx`` with PyTorch's core decompositions, so SiLU, softmax
and ``F.linear`` arrive as the few ops they are made of). A reference without matrix products
becomes one ``Program`` over each token's row, or each of its heads where the reference reduces
them (``rewriter.compiler.aten_ops`` translates each ATen op); one with products becomes
``Products``: stages of a prologue, the products and an epilogue
(``rewriter.compiler.products``). An op the tables do not know is refused with its name and the
node that calls it, never approximated. ``lower_op`` caches by the call's signature: the server
asks once per shape, not per step.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from codegen.lowered import DTYPES, LoweringError, Products, Program, Tail
from rewriter.compiler.aten_ops import DTYPE_NAMES, POINTWISE, ROW_REDUCTIONS, Builder
from rewriter.compiler.products import MXFP4_DEQUANT, PRODUCT_OPS, lower_products
from rewriter.model import ops as _k3_ops  # noqa: F401  (defines the k3:: ops named below)

# collectives a result may end with: the host runs them after the stages (codegen.lowered.Products)
ALL_REDUCE = torch.ops.k3.all_reduce.default
COLLECTIVES = {ALL_REDUCE: "all_reduce", torch.ops.k3.gather_last_dim.default: "gather_last_dim"}


# what the trace decomposes beyond PyTorch's core decompositions, into ops the translation takes
# (LayerNorm into prims.var, prims.sum and pointwise ops; log_softmax into amax, exp, sum and log);
# logsumexp is kept whole, as its decomposition guards infinite maxima with a select of its own
aten = torch.ops.aten
DECOMPOSED = (aten.native_layer_norm, aten.var, aten.var_mean, aten.std, aten.std_mean, aten._log_softmax)
KEPT_WHOLE = (aten.logsumexp.default,)


def _addmm_as_products(bias: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """``F.linear`` with a bias, as the products take it: the fp32 sums plus the bias, rounded once
    (where PyTorch's own decomposition rounds the product before the add)."""
    return (torch.mm(x.float(), w.float()) * alpha + bias.float() * beta).to(x.dtype)


@functools.cache
def _decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = {**core_aten_decompositions(), **get_decompositions(list(DECOMPOSED)),
             aten.addmm.default: _addmm_as_products}
    for op in KEPT_WHOLE:
        table.pop(op, None)
    return table


class EinsumAsMatmul(torch.overrides.TorchFunctionMode):
    """While a reference is traced: ``torch.einsum`` of two matrices over one shared index
    ("tk,nk->tn", "tk,kn->tn") as the ``mm`` it is, which the products take; PyTorch would trace
    it as a batched ``bmm`` over views. Other equations trace as PyTorch writes them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.einsum and not kwargs and len(args) > 1:
            operands = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            if len(operands) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in operands):
                product = einsum_matmul(args[0], *operands)
                if product is not None:
                    return product
        return func(*args, **(kwargs or {}))


def einsum_matmul(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a`` [T, K] times ``b`` ([N, K] or [K, N]) as ``mm`` for an equation "ij,..->..": one
    index shared and summed, the output (a's free index, b's); None for any other equation."""
    lhs, _, out = equation.replace(" ", "").partition("->")
    ins = lhs.split(",")
    if len(ins) != 2 or not all(len(x) == 2 for x in ins) or len(out) != 2 or len(set(ins[0] + ins[1])) != 3:
        return None
    shared = set(ins[0]) & set(ins[1])
    if len(shared) != 1 or ins[0][0] in shared or out != ins[0][0] + (set(ins[1]) - shared).pop():
        return None
    return torch.mm(a, b.t() if ins[1][1] in shared else b)


def _trace(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def traced(*ts):
        full = list(args)
        for i, t in zip(where, ts, strict=True):
            full[i] = t
        return fn(*full)

    from torch.fx.experimental.proxy_tensor import make_fx

    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    try:
        with EinsumAsMatmul():
            gm = make_fx(traced, decomposition_table=_decompositions())(*meta)
    except Exception as e:  # noqa: BLE001 (what the trace met is the reason)
        raise LoweringError(f"the reference does not trace into ATen ops: {type(e).__name__}: {e}") from e
    _out_of_place(gm)
    return gm, tensors


def _out_of_place(gm: fx.GraphModule) -> None:
    """In-place ops as their out-of-place forms, where what they write into is a value the
    reference computed and nothing else reads (PyTorch's decomposition of ``F.rms_norm`` adds
    the epsilon with ``add_``); an in-place op on an argument, or on a value read again, is
    refused by name."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target.overloadpacket.__name__
        if not name.endswith("_") or name.startswith("_") or not node.target._schema.arguments[0].is_write:
            continue
        functional = getattr(getattr(aten, name[:-1], None), node.target._overloadname, None)
        written = node.args[0]
        if functional is None or written.op != "call_function" or set(written.users) != {node}:
            raise LoweringError(f"{node.target} (node {node.name}) writes into {written.name}: the programs take "
                                "in-place ops only on a value the reference computed and reads no more")
        node.target = functional
    gm.recompile()


def lower(fn: Callable[..., Any], args: Sequence[Any]) -> Program | Products:
    """The program of ``fn(*args)``: its tensor arguments (meta or real) are the program's inputs,
    every other argument a constant of the trace. Raises ``LoweringError`` naming what it
    cannot express."""
    gm, tensors = _trace(fn, args)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    # a result a collective ends (an all-reduce of partial sums, a gather of the ranks' columns):
    # the stages compute this rank's value, the host runs the collectives after them
    collectives, last = [], set()
    for i, r in enumerate(results):
        ends = []
        while isinstance(r, fx.Node) and r.target in COLLECTIVES and len(r.users) == 1:
            ends.append((i, COLLECTIVES[r.target], r.args[1], int(r.args[2])))
            last.add(r)
            r = r.args[0]
        results[i] = r
        collectives += reversed(ends)  # the innermost runs first
    inner = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES and n not in last]
    # what an MXFP4 weight reads that is not an argument (an expert chosen inside the op), by the weight's name
    chosen = {a: n for n in gm.graph.nodes if n.op == "call_function" and n.target is MXFP4_DEQUANT
              for a in n.args[:2] if a.op != "placeholder"}
    for node in gm.graph.nodes:  # what the reference computes decides first, then the shapes it takes
        if node.op != "call_function" or node.target in POINTWISE or node.target in PRODUCT_OPS or node in last:
            continue
        if node.target in COLLECTIVES and (len(inner) > 1 or node.target is not ALL_REDUCE):
            raise LoweringError(f"{node.target} (node {node.name}) is a collective inside the op: the generated "
                                "kernels run one all-reduce inside an op, and collectives on results after them")
        if node.target in COLLECTIVES:
            continue
        if node in chosen:
            raise LoweringError(f"MXFP4 weight {chosen[node].name}: its codes and scales are the op's arguments (an "
                                f"expert chosen inside the op, here by {node.name}, is not a product by one weight)")
        raise LoweringError(f"{node.target} (node {node.name}) has no lowering: the programs take pointwise "
                            "arithmetic, activations, casts, reductions over a token's row and matrix products "
                            "by weights (docs/CODEGEN.md)")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for r in results:
        if not isinstance(r, fx.Node):
            raise LoweringError(f"the reference returns {r!r}, which is not a computed value")
    args_of = {n: i for i, n in enumerate(placeholders)}
    if inner:
        return _with_tail(gm, tensors, args_of, results, inner[0], tuple(collectives))
    if any(n.op == "call_function" and n.target is torch.ops.aten.mm.default for n in gm.graph.nodes):
        cut = _reduction_cut(gm, results)
        if cut is not None:
            return _with_tail(gm, tensors, args_of, results, cut, tuple(collectives))
        products = lower_products(gm, args_of, results)
        return dataclasses.replace(products, collectives=tuple(collectives))
    if collectives:
        raise LoweringError(f"{collectives[0][1]} of a result without matrix products: the rowwise kernel runs no "
                            "collective")
    return _lower_rows(gm, tensors, args_of, results)


def _downstream(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(n.users)
    return seen


def _computed(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that depend on a matrix product."""
    return set().union(*(_downstream(n) for n in gm.graph.nodes
                         if n.op == "call_function" and n.target is torch.ops.aten.mm.default))


def _reduction_cut(gm: fx.GraphModule, results: list[fx.Node]) -> fx.Node | None:
    """Where to cut an op whose products' rows are reduced after them (a projection, its residual
    add, then a norm of the sum): a product's row is spread over the kernel's CTAs, so the stages
    write the cut's value to an intermediate and a tail program reduces it. The cut is a token's
    whole row that every such reduction follows, after which no product comes and nothing
    computed before it is read; of those the narrowest dtype, then the latest (the most work in
    the epilogue). None where no product's row is reduced, or no node can be cut
    (``lower_products`` then says why)."""
    computed = _computed(gm)
    reductions = [n for n in computed if n.op == "call_function" and n.target in ROW_REDUCTIONS]
    if not reductions:
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    tokens = next(n.args[0].meta["val"].shape[0] for n in gm.graph.nodes
                  if n.op == "call_function" and n.target is torch.ops.aten.mm.default)
    valid = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node not in computed or not isinstance(val, torch.Tensor) or val.dim() < 2 or \
                math.prod(val.shape[:-1]) != tokens:  # a token's row ([B, S, N] rows too), not its heads
            continue
        after = _downstream(node) - {node}
        if not all(r in after for r in reductions) or any(n.target in PRODUCT_OPS for n in after):
            continue
        if any(a in computed and a not in after and a is not node for n in after for a in n.all_input_nodes):
            continue
        valid.append(node)
    return min(valid, key=lambda n: (n.meta["val"].element_size(), -order[n]), default=None)


def _with_tail(gm: fx.GraphModule, tensors: list[torch.Tensor], args_of: dict[fx.Node, int], results: list[fx.Node],
               cut: fx.Node, on_results: tuple) -> Products:
    """An op cut in two: the stages compute the value at ``cut`` into an intermediate and a tail
    program (the rowwise kernel) computes what follows, which holds no product. The cut is an
    all-reduce inside the op (o_proj's partial sums, then its residual add and norm: the stages
    write its input, the host all-reduces it) or a row the tail reduces (``_reduction_cut``)."""
    after = _downstream(cut)
    computed = _computed(gm)
    reduced = cut.target is ALL_REDUCE
    partial, what = (cut.args[0], "the all-reduce") if reduced else (cut, "the cut")
    if partial not in computed:
        raise LoweringError(f"the all-reduce {cut.name} comes before any product: the generated kernels "
                            "all-reduce what their products computed")
    if any(n.target in PRODUCT_OPS for n in after - {cut} if n.op == "call_function"):
        raise LoweringError(f"a product after the all-reduce {cut.name}: the generated kernels take pointwise "
                            "work after a collective inside an op (a residual add, a norm)")
    head = [(i, r) for i, r in enumerate(results) if r not in after]
    products = lower_products(gm, args_of, [r for _, r in head] + [partial])
    dtype = DTYPE_NAMES.get(cut.meta["val"].dtype)
    temp = len(products.temps)

    def placed(dest: tuple) -> tuple:  # the head's results to the op's numbering, the partial to the intermediate
        if dest[0] != "result":
            return dest
        return ("temp", temp) if dest[1] == len(head) else ("result", head[dest[1]][0])
    stages = tuple(dataclasses.replace(st, prologue_to=tuple(map(placed, st.prologue_to)),
                                       epilogue_to=tuple(map(placed, st.epilogue_to))) for st in products.stages)
    *lead, full = cut.meta["val"].shape
    tokens = math.prod(lead)
    group, width = _row_geometry(after, tokens, full)

    def resolve(b: Builder, node: fx.Node, c0: int):
        if node is cut:
            return b.input("row", dtype, ("temp", temp))
        if node in args_of:
            t = tensors[args_of[node]]
            kind = b.kind_of(tuple(t.shape), c0)
            if kind is None or DTYPE_NAMES.get(t.dtype) is None:
                raise LoweringError(f"argument {node.name} of shape {tuple(t.shape)} after {what}: rows, "
                                    f"statistics and columns of {width}, {group} a token")
            return b.input(kind, DTYPE_NAMES[t.dtype], ("arg", args_of[node], c0 if kind != "stat" else 0))
        if node in computed and node not in after:
            raise LoweringError(f"{node.name}, computed before {what}, is read after it: only the "
                                f"{'all-reduced value' if reduced else 'value at the cut'} crosses it")
        return None

    b = Builder(tokens, width, resolve, group)
    dests = []
    for i, r in enumerate(results):
        if r in after:
            b.output(r)
            dests.append(("result", i))
    tail = Tail(b.program(), tuple(b.sources), tuple(dests))
    between = ((temp, "all_reduce", cut.args[1], int(cut.args[2])),) if reduced else ()
    return Products(stages, (*products.temps, (full, dtype)), len(results), on_results, between, (tail,))


def _lower_rows(gm: fx.GraphModule, tensors: list[torch.Tensor], args_of: dict[fx.Node, int],
                results: list[fx.Node]) -> Program:
    """A reference without products: one program over each token's row (or each of its groups,
    ``_row_geometry``), its inputs the op's tensor arguments in order."""
    rows = [t for t in tensors if t.dim() >= 2 and t.shape[-1] > 1]
    if not rows:
        raise LoweringError("no [tokens, columns] tensor among the arguments: nothing is computed per token")
    tokens = math.prod(rows[0].shape[:-1])  # [B, S, N]: B * S tokens
    group, width = _row_geometry(gm.graph.nodes, tokens, rows[0].shape[-1])

    def argument(b: Builder, node: fx.Node, c0: int):
        if node in args_of:
            raise LoweringError(f"argument {node.name} read from its column {c0}: a program without products reads "
                                "whole rows")
        return None

    b = Builder(tokens, width, argument, group)
    for n, i in args_of.items():  # every argument an input, in the op's order
        t = tensors[i]
        kind = b.kind_of(tuple(t.shape))
        if kind is None or (group == 1 and kind != "stat" and t.shape[-1] != width):
            each = f"[{tokens}, {width}]" if group == 1 else f"[{tokens}, {group}, {width}] or a view of it"
            raise LoweringError(f"argument {n.name} of shape {tuple(t.shape)}: the program takes rows {each}, "
                                f"their statistics and columns [{width}]")
        if DTYPE_NAMES.get(t.dtype) is None:
            raise LoweringError(f"argument {n.name} is {t.dtype}: the programs read {', '.join(DTYPES)}")
        b.refs[(n, 0)] = b.input(kind, DTYPE_NAMES[t.dtype], ("arg", i, 0))
    for r in results:
        b.output(r)
    return b.program()


def _row_geometry(nodes, tokens: int, width: int) -> tuple[int, int]:
    """(rows a token, their width) of a program over a token's row of ``width`` values: the whole
    row, or where the reference reduces the last dim of a [T, G, N] view (a norm per head) each of
    its G groups of N; the reductions must agree on N."""
    reduced = {(math.prod(n.args[0].meta["val"].shape[:-1]), n.args[0].meta["val"].shape[-1]) for n in nodes
               if n.op == "call_function" and n.target in ROW_REDUCTIONS}
    if all(lead == tokens for lead, _ in reduced):
        return 1, width
    if len(reduced) > 1:
        raise LoweringError(f"reductions over rows of different widths and counts ({sorted(reduced)}, [rows, "
                            "columns]): a program reduces one kind of row, a token's or each of its groups")
    (lead, n), = reduced
    if lead % tokens:
        raise LoweringError(f"a reduction over {lead} rows of {n} values, which are not groups of {tokens} tokens")
    return lead // tokens, n


def _signature(args: Sequence[Any]) -> tuple:
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return a
    return tuple(one(a) for a in args)


def lower_op(op: str, args: Sequence[Any]) -> Program | Products | str:
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


def _lower_uncached(op: str, args: Sequence[Any]) -> Program | Products | str:
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(op if "::" in op else f"k3f::{op}")
    if opdef is None:
        return f"{op} is not a defined fused op"
    try:
        return lower(opdef._init_fn, args)
    except LoweringError as e:
        return f"not lowered: {e}"


_CACHE: dict[tuple, Program | Products | str] = {}  # (op, the call's signature) -> its program or why not
