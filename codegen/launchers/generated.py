"""The generated templates: a fused op with no hand-written template runs on kernels generated
from its own reference, when the compiler can lower that reference (``codegen.host``'s
``lower``: the op's reference traced at the call's shapes into a ``codegen.lowered.Program`` or
``Products``).

- ``rowwise`` (``codegen/kernels/rowwise.py``): a reference without matrix products: pointwise
  chains, broadcasts and reductions over each token's row, one CTA a token;
- ``products``: a reference with products by weights: one kernel a stage (prologue, products,
  epilogue), on the skinny tensor-core GEMM's main loop from ``GEMM_MIN_TOKENS`` tokens where the
  stage reads its activation as it is (``codegen/kernels/product_gemm.py``), else on the skinny
  GEMV's (``codegen/kernels/product_gemv.py``), and on the GEMM at one token too where a stage's
  K is longer than the GEMV holds in registers.

A call the lowering refuses (an op it does not know, a shape it does not take) is refused here
with that reason, so the plan, ``inspect`` and the server name it. ``codegen.templates`` tries
these after every hand-written template of the op.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from codegen.host import host
from codegen.launchers.gemm_specs import (
    GEMM_PARTIAL_PAD,
    GEMM_ROWS_PER_CTA,
    GEMM_SMEM_ONE_CTA,
    GEMM_TILE_K,
    SM_COUNT,
    gemm_tiling,
    k_split,
    stage_bytes,
)
from codegen.launchers.gemv_specs import skinny_gemv_tiling, token_chunk
from codegen.lowered import DTYPES, MXFP4, READ, Products, Program, Stage
from codegen.spec import KernelSpec
from codegen.targets import MAX_TOKENS, VEC
from codegen.template import Template, aligned

MAX_INPUTS = 8
MAX_OUTPUTS = 4
MAX_THREADS = 1024
# what one product_gemv stage takes: tensor slots of each kind, registers of weights a lane holds
PRODUCT_SLOTS = {"prologue_inputs": 4, "weights": 4, "epilogue_inputs": 4, "prologue_results": 2, "outputs": 4}
MAX_WEIGHT_VECTORS = 24  # 128-bit weight vectors a lane holds (4 registers each)
STAGED_BYTES = 160 * 1024  # shared memory for a chunk's activations where the prologue computes them
# from here the GEMM main loop: every projection's GEMM won from 2 tokens, or tied, against the
# GEMVs (the input projection's, o_proj's, the dense MLP's; BENCHMARKS.md)
GEMM_MIN_TOKENS = 2
GEMM_PRODUCTS = (1, 2, 4)  # products sharing a GEMM tile's 128 rows
MXFP4_TILE = 64  # rows of Humming's tile: a GEMM tile holds whole ones
# shared memory an MXFP4 GEMM's staging ring takes per weight row and pipeline stage: the codes of
# 64 K (32 bytes) and, for each 16-byte copy of codes, the 8 scale bytes of its 8 rows (16 bytes)
MXFP4_STAGED_PER_ROW = 48
MXFP4_WARP_N8 = 4  # n8 token groups a warp of the MXFP4 main loop multiplies (64 fp32 accumulators)
# the grid of ``mxfp4_small_tiling``, CTAs an SM by token groups: warps to hide the dequantization's
# latency (a CTA of two groups has twice the warps, and a 32- or 64-token activation ring)
MXFP4_CTAS_PER_SM = {1: 4, 2: 1}
MXFP4_TWO_GROUP_STAGES = 6  # that tiling's ring at two token groups (the 32- and 64-token sweep's)


def threads_for(width: int, vectors: int) -> int:
    """Threads a CTA takes for a row of ``width`` values at ``vectors`` 128-bit vectors a thread."""
    per_thread = -(-(width // VEC) // vectors)
    return min(MAX_THREADS, (per_thread + 31) // 32 * 32)


def vectors_for(width: int) -> int:
    """The fewest vectors a thread that lets one CTA hold the row (more threads, more loads in flight)."""
    return -(-(width // VEC) // MAX_THREADS)


@functools.cache
def program_of(spec: KernelSpec) -> Program:
    """The spec's program, parsed once (launches read it at every call)."""
    return Program.from_params(spec.param_dict["program"])


@functools.cache
def _single_tensor(op: str) -> bool:
    """Whether fused op ``op`` returns one tensor (else a tuple of them)."""
    returns = getattr(torch.ops.k3f, op.split("::")[-1]).default._schema.returns
    return len(returns) == 1 and str(returns[0].type) == "Tensor"


def _specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    program = host().lower(op, args)
    if isinstance(program, str):
        return program
    if isinstance(program, Products):
        return "the reference has matrix products (the products template)"
    if program.width % VEC:
        return f"a row of {program.width} values is not whole 128-bit vectors of {VEC} (the rowwise kernel)"
    if len(program.inputs) > MAX_INPUTS or len(program.outputs) > MAX_OUTPUTS:
        return (f"{len(program.inputs)} inputs and {len(program.outputs)} outputs: the rowwise kernel takes at most "
                f"{MAX_INPUTS} and {MAX_OUTPUTS}")
    return (KernelSpec.make("rowwise", op, arch, shapes={"width": program.width},
                            params={"program": program.to_params(), "vectors": vectors_for(program.width)}),)


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _runtime(args: Sequence[Any]) -> str | None:
    for i, t in enumerate(_tensors(args)):
        if not t.is_contiguous():
            return f"tensor argument {i} is not contiguous (strides {tuple(t.stride())})"
    return aligned({f"tensor argument {i}": t for i, t in enumerate(_tensors(args)) if t.dim() > 1 or
                    t.shape[-1] > 1})


def _launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,) = fns
    program = program_of(specs[0])
    ins = [program.as_rows(kind, t) for t, (kind, _) in zip(_tensors(args), program.inputs, strict=True)]
    rows = next(t.shape[0] for t, (kind, _) in zip(ins, program.inputs, strict=True) if kind == "row")
    kinds = program.kinds
    outs = [torch.empty((rows, program.width if kinds[v] == "row" else 1), dtype=DTYPES[dtype],
                        device=ins[0].device) for v, dtype, _ in program.outputs]
    fn(*ins, *[None] * (MAX_INPUTS - len(ins)), *outs, *[None] * (MAX_OUTPUTS - len(outs)))
    results = [o.view(-1, *shape) for o, (_, _, shape) in zip(outs, program.outputs, strict=True)]
    return results[0] if _single_tensor(specs[0].op) else tuple(results)


ROWWISE = Template("generated", (), _specs, _runtime, _launch, generated=True,
                   doc="a kernel generated from the fused op's reference: pointwise chains and row reductions, "
                       "one CTA a token")


# ---- products: one product_gemm or product_gemv kernel a stage ----------------------------------
def is_plain(stage: Stage) -> bool:
    """The prologue only reads a bf16 activation (read from memory in the K loop, not staged)."""
    p = stage.prologue
    return not p.ops and p.inputs == (("row", "bf16"),) and p.outputs == ((0, "bf16", (p.width,)),)


def _gemm_tiling(parts: Sequence[Stage], tokens: int, arch: str, min_tokens: int = GEMM_MIN_TOKENS
                 ) -> dict[str, Any] | str:
    """The GEMM's tiling for stages of one activation (its parts; ``gemm_tiling`` over their
    columns, a tile's rows shared by the products), or why the GEMM does not take them."""
    k, products, n = parts[0].k, len(parts[0].weights), sum(st.n for st in parts)
    mxfp4 = parts[0].weight_dtype == MXFP4
    if tokens < min_tokens and not mxfp4:
        return f"{tokens} token: the GEMV main loop"
    if not all(is_plain(st) for st in parts):
        return "the prologue computes (the GEMM multiplies its activation as it is read)"
    if products not in GEMM_PRODUCTS or any(len(st.weights) != products for st in parts):
        return f"{products} products: a GEMM tile's rows are shared by {', '.join(map(str, GEMM_PRODUCTS))}"
    if k % GEMM_TILE_K or k < 2 * GEMM_TILE_K:
        return f"K {k} is not a multiple of {GEMM_TILE_K} of at least two tiles"
    if n < GEMM_ROWS_PER_CTA // 2 // products:
        return f"{n} columns: fewer than a tile's {GEMM_ROWS_PER_CTA // 2 // products}"
    if mxfp4 and (GEMM_ROWS_PER_CTA // products < MXFP4_TILE or any(st.n < MXFP4_TILE for st in parts)):
        return (f"MXFP4: {products} products of parts {[st.n for st in parts]} wide, where a GEMM tile holds whole "
                f"{MXFP4_TILE}-row tiles of each product")
    tiling = gemm_tiling(tokens, k, n, arch, products=products, tile_multiple=MXFP4_TILE if mxfp4 else 1)
    if mxfp4:
        tiling.update(mxfp4_small_tiling(tiling, k, [st.n for st in parts], products, arch))
    per_tile = tiling["rows_per_cta"] // products
    if mxfp4 and any(st.n < per_tile for st in parts):
        return f"MXFP4: a part narrower than a tile's {per_tile} rows (parts {[st.n for st in parts]} wide)"
    threads = 32 * min(4, tiling["rows_per_cta"] // 16) * tiling["token_groups"]
    fp8 = parts[0].weight_dtype == "fp8_e4m3"  # 16 values a copy: 4 threads a row
    pass_rows = threads // (4 if fp8 else 8)
    if not mxfp4 and (per_tile % pass_rows or n < per_tile):
        return f"{products} products of {per_tile} columns a tile, copied {pass_rows} rows a pass"
    staged = GEMM_TILE_K if fp8 else MXFP4_STAGED_PER_ROW if mxfp4 else 0  # bytes a row and stage
    if staged:  # the staging ring beside the bf16 one: fewer stages where one CTA's memory asks it
        rows, tile = tiling["rows_per_cta"], tiling["token_tile"]

        def smem(stages: int) -> int:  # as ProductGemm counts it (MXFP4 codes skip the bf16 weight ring)
            ring = max(stages * stage_bytes(0 if mxfp4 else rows, tile), tile * (rows + GEMM_PARTIAL_PAD) * 4)
            return ring + stages * rows * staged
        while tiling["stages"] > 2 and smem(tiling["stages"]) > GEMM_SMEM_ONE_CTA:
            tiling["stages"] -= 1
        if smem(tiling["stages"]) > GEMM_SMEM_ONE_CTA:
            return (f"{parts[0].weight_dtype} staging: {smem(2)} bytes of shared memory at two stages, more than a "
                    "CTA may take")
    return tiling


def mxfp4_small_tiling(tiling: dict[str, Any], k: int, widths: Sequence[int], products: int, arch: str
                       ) -> dict[str, Any]:
    """The MXFP4 loop on 64-row tiles with the largest K split that keeps the grid within
    ``MXFP4_CTAS_PER_SM`` CTAs an SM: 4 at one token group (up to 16 tokens), 1 at two (17 to 32
    and 49 to 64 tokens); none where a tile of each product needs 128 rows, or where the tiles
    alone pass that grid. Its warps wait on their dequantization's chain, not on bytes, so more
    of them an SM is what pays. A 4096 x 7168 projection: at 8 tokens 14.7 us on 512 CTAs of 64
    rows and 8 splits against 18.0 on the bf16 GEMM's 128 CTAs of 128 rows and 4 (b8ca961); at 64
    tokens 27.8 us on 128 CTAs of 64 rows and 2 splits against 42.7 on 128 rows and 4, 37.2 on 8
    splits, 38.7 on 64 rows and 4 (9ed0ecf; H100 both). More pipeline stages did not help (12 at
    8 tokens: 17.9)."""
    groups = tiling["token_groups"]
    if (groups == 1 and tiling["token_tile"] > 16) or groups not in MXFP4_CTAS_PER_SM or \
            products * MXFP4_TILE > GEMM_ROWS_PER_CTA // 2:
        return {}
    tiles, k_tiles = sum(-(-w // MXFP4_TILE) for w in widths), k // GEMM_TILE_K
    limit = MXFP4_CTAS_PER_SM[groups] * SM_COUNT.get(arch, 132)
    if tiles > limit:
        return {}
    split = k_split(k_tiles, tiles, MXFP4_TILE, limit)
    stages = tiling["stages"] if groups == 1 else MXFP4_TWO_GROUP_STAGES
    return {"rows_per_cta": MXFP4_TILE, "split_k": split, "stages": max(2, min(stages, k_tiles // split))}


def _parts(stages: Sequence[Stage]) -> list[list[int]]:
    """The stages cut into runs that one kernel can hold as its parts: consecutive stages of one
    activation (the same prologue reading the same rows and keeping the same statistics), as
    many products each, their tensors within the kernel's slots."""
    runs: list[list[int]] = []
    for i, st in enumerate(stages):
        if runs:
            head, run = stages[runs[-1][0]], [stages[j] for j in runs[-1]] + [st]
            used = {"weights": sum(x.weight_tensors for x in run),
                    "epilogue_inputs": sum(s[0] in READ for x in run for s in x.epilogue_from),
                    "outputs": sum(len(x.epilogue.outputs) for x in run)}
            if (st.prologue, st.prologue_from, st.prologue_to) == (head.prologue, head.prologue_from,
                                                                   head.prologue_to) and \
                    (len(st.weights), st.weight_dtype) == (len(head.weights), head.weight_dtype) and \
                    all(used[w] <= PRODUCT_SLOTS[w] for w in used):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


@functools.cache
def stages_of(spec: KernelSpec) -> tuple[Stage, ...]:
    """The stages (parts) one kernel of the products template runs (none: a hoisted prologue or a
    tail), parsed once."""
    return tuple(Stage.from_params(st) for st in spec.param_dict.get("parts", ()))


@functools.cache
def _programs_of(spec: KernelSpec) -> tuple[tuple[Program, tuple, tuple], ...]:
    """(program, its sources, its destinations) of each program a kernel of the products template runs."""
    p = spec.param_dict
    if "parts" not in p:
        return ((program_of(spec), p["sources"], p["dests"]),)
    return tuple(program for st in stages_of(spec) for program in
                 ((st.prologue, st.prologue_from, st.prologue_to), (st.epilogue, st.epilogue_from, st.epilogue_to)))


def part_slots(parts: Sequence[Stage], what: str, q: int) -> range:
    """The kernel's tensor slots of part ``q``'s ``weights``, epilogue ``inputs`` or ``outputs``
    (given out part by part)."""
    def size(st: Stage) -> int:
        return {"weights": st.weight_tensors, "inputs": sum(src[0] in READ for src in st.epilogue_from),
                "outputs": len(st.epilogue.outputs)}[what]
    start = sum(size(st) for st in parts[:q])
    return range(start, start + size(parts[q]))


def _tiling(parts: Sequence[Stage], tokens: int) -> dict[str, Any] | str:
    """The GEMV's tiling for its parts (``skinny_gemv_tiling`` over their columns), or why not."""
    stage = parts[0]
    k, products, n = stage.k, len(stage.weights), sum(st.n for st in parts)
    if stage.weight_dtype == MXFP4:
        return "MXFP4 weights: the GEMM main loop"
    if k % VEC:
        return f"K {k} is not whole 128-bit vectors of {VEC}"
    chunk = token_chunk(tokens)
    if not is_plain(stage):
        while chunk > 1 and chunk * k * 2 > STAGED_BYTES:
            chunk -= 1
        if k * 2 > STAGED_BYTES:
            return f"K {k}: a token's staged activation exceeds {STAGED_BYTES // 1024} KB of shared memory"
    vec = -(-k // 256)  # vectors a lane of one warp (the last lanes' past the end where 256 does not divide K)
    # the tiling of the next K (in whole 256-wide steps) whose slices divide it: the kernel reads
    # ragged slices (a prime 17 steps, TP 8's dense down projection, as 18 in 3 slices of 6)
    tiling = next((t for t in (skinny_gemv_tiling(chunk, (vec + pad) * 256, n * products, norm=not is_plain(stage))
                               for pad in range(4)) if not isinstance(t, str)),
                  skinny_gemv_tiling(chunk, vec * 256, n * products, norm=not is_plain(stage)))
    if isinstance(tiling, str):
        return tiling
    cols = tiling["rows_per_warp"] if products == 1 else 1
    ks = tiling["ksplit"]
    while cols * products * -(-vec // ks) > MAX_WEIGHT_VECTORS and ks < 8 and vec % (2 * ks) == 0:
        ks *= 2
    if cols * products * -(-vec // ks) > MAX_WEIGHT_VECTORS:
        return (f"{products} products of K {k}: {cols * products * -(-vec // ks)} weight vectors a lane, at most "
                f"{MAX_WEIGHT_VECTORS} in registers")
    out = {"chunk": chunk, "cols": cols, "ksplit": ks, "warps_per_cta": ks * max(1, tiling["warps_per_cta"] // ks)}
    return {**out, **_lane_groups(k // VEC, products, chunk)} if ks == 1 else out


def _lane_groups(k_vectors: int, products: int, chunk: int) -> dict[str, int]:
    """For a short K that a warp's 32 lanes do not divide (the shared experts' down projection at
    TP 16: 48 vectors, a quarter of the lanes idle on their second): 16 or 8 lanes a row that it
    fills, each lane holding rows of as many columns as the warp has lane groups (the hand-written
    shared-experts kernel's 16 lanes and two rows a lane); else nothing (the whole warp)."""
    if k_vectors % 32 == 0:
        return {}
    for lanes in (16, 8):
        cols = 32 // lanes
        if k_vectors % lanes == 0 and cols * products * (k_vectors // lanes) <= MAX_WEIGHT_VECTORS \
                and cols * chunk <= lanes:
            return {"lanes": lanes, "cols": cols}
    return {}


def _source(src: tuple, tensors: list[torch.Tensor], temps: list[torch.Tensor], kind: str, program: Program):
    """The tensor an input of ``program`` reads: a view from its column, or with groups the whole
    tensor as ``Program.as_rows`` views it."""
    t = temps[src[1]] if src[0] == "temp" else tensors[src[1]]
    if src[0] == "scalar":
        return t.reshape(1)
    if program.group > 1:
        return program.as_rows(kind, t)
    if src[0] == "temp":
        return t
    if kind == "row":
        return t.flatten(0, -2)[:, src[2]:src[2] + program.width]  # [B, S, N]: B * S rows
    if kind == "col":
        return t.reshape(-1)[src[2]:src[2] + program.width]
    return t.reshape(-1, 1)


def _row_stride(src: tuple, tensors: list[torch.Tensor], products: Products, kind: str, program: Program) -> int:
    if kind != "row" or src[0] == "scalar":
        return 0
    if program.group > 1:  # a token's groups are consecutive rows of a whole tensor
        return program.width
    return products.temps[src[1]][0] if src[0] == "temp" else tensors[src[1]].stride(-2)


def _tokens(sources: Sequence[tuple], program: Program, tensors: list[torch.Tensor]) -> int:
    """The call's tokens: the rows of a program's first row argument (all its leading dims)."""
    return next(math.prod(tensors[s[1]].shape[:-1]) for s, (kind, _) in zip(sources, program.inputs, strict=True)
                if s[0] == "arg" and kind == "row")


def _hoisted(parts: Sequence[Stage], temps: list[tuple[int, str]]) -> tuple[Program, tuple, list[Stage]] | str:
    """The parts' shared prologue as a rowwise program of its own, and the parts reading what it
    wrote as they are: its activation and the statistics the epilogues keep go to new
    intermediates (appended to ``temps``), so the GEMM main loop can take a prologue that
    computes (a norm) at the cost of one more kernel; or why the rowwise kernel cannot run it."""
    head = parts[0]
    pro = head.prologue
    if len(pro.inputs) > MAX_INPUTS or len(pro.outputs) > MAX_OUTPUTS:
        return f"a prologue of {len(pro.inputs)} inputs and {len(pro.outputs)} outputs (the rowwise kernel's limits)"
    dests, kept = [], {}
    for j, dest in enumerate(head.prologue_to):
        if dest[0] in ("product", "keep"):
            kept[j] = len(temps)
            temps.append((head.k, "bf16") if dest[0] == "product" else (1, pro.outputs[j][1]))
            dests.append(("temp", kept[j]))
        else:
            dests.append(dest)
    plain = Program(head.k, (("row", "bf16"),), (), ((0, "bf16", (head.k,)),))  # reads the activation as it is
    return pro, tuple(dests), [
        Stage(plain, (("temp", kept[0]),), (("product",),), st.weights, st.epilogue,
              tuple(("temp", kept[src[1]]) if src[0] == "pro" else src for src in st.epilogue_from), st.epilogue_to,
              st.weight_dtype, st.scales) for st in parts]


def _product_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    products = host().lower(op, args)
    if isinstance(products, str):
        return products
    if not isinstance(products, Products):
        return "no matrix products (the rowwise kernel)"
    return product_specs(op, arch, products, _tensors(args))


def product_specs(op: str, arch: str, products: Products, tensors: list[torch.Tensor]
                  ) -> tuple[KernelSpec, ...] | str:
    """The kernels of ``products`` for a call of ``op`` with these tensor arguments (their shapes
    and strides: meta tensors do), or why the kernels do not take it."""
    first = products.stages[0]
    tokens = _tokens(first.prologue_from, first.prologue, tensors)
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} tokens outside 1..{MAX_TOKENS}"
    for i, t in enumerate(tensors):  # rows may be views of wider ones (their strides go in the specs)
        if t.dim() and t.stride(-1) != 1:
            return f"tensor argument {i} of strides {tuple(t.stride())}: the kernels read 128-bit vectors of a row"
        if t.dim() == 2 and t.shape[1] == 1 < t.shape[0] and t.stride(0) != 1:
            return f"tensor argument {i}, a [T, 1] statistic, of strides {tuple(t.stride())}: it is read packed"
        if t.dim() > 2 and any(t.stride(d) != t.stride(d + 1) * t.shape[d + 1] for d in range(t.dim() - 2)):
            return f"tensor argument {i} of strides {tuple(t.stride())}: its leading dims are not one run of rows"
    for w in {w for st in products.stages for w in (*(w for w, _ in st.weights), *st.scales)}:
        if tensors[w].dim() != 2 or tensors[w].stride(0) != tensors[w].shape[1]:
            return f"weight argument {w} of strides {tuple(tensors[w].stride())}: a weight is contiguous [N, K] rows"
    checked = []  # each stage's (prologue row strides, epilogue row strides)
    for i, stage in enumerate(products.stages):
        pro, epi = stage.prologue, stage.epilogue
        if any(d == "fp8_e4m3" for p in (pro, epi) for d in (*(d for _, d in p.inputs), *(d for _, d, _ in p.outputs))):
            return (f"stage {i} reads or writes an fp8 row: the product kernels' prologues and epilogues take bf16, "
                    "fp16 and fp32 (fp8 rows: the rowwise kernel's)")
        epi_args = [(s, kind) for s, (kind, _) in zip(stage.epilogue_from, epi.inputs, strict=True)
                    if s[0] in READ]
        counts = {"prologue_inputs": len(pro.inputs), "weights": stage.weight_tensors, "epilogue_inputs": len(epi_args),
                  "prologue_results": sum(d[0] == "result" for d in stage.prologue_to), "outputs": len(epi.outputs)}
        for what, count in counts.items():
            if count > PRODUCT_SLOTS[what]:
                return f"stage {i}: {count} {what.replace('_', ' ')}, at most {PRODUCT_SLOTS[what]}"
        if any(kind != "stat" and (s[0] == "arg" and s[2] % VEC) for s, (kind, _) in
               zip(stage.prologue_from, pro.inputs, strict=True)):
            return f"stage {i}: a prologue input starts inside a 128-bit vector"
        if any(s[0] == "scalar" for s in stage.prologue_from):
            return f"stage {i}: a one-element argument in the prologue (the kernels read it in an epilogue)"
        pro_strides = [_row_stride(s, tensors, products, kind, pro) for s, (kind, _) in
                       zip(stage.prologue_from, pro.inputs, strict=True)]
        if any(s % VEC for s in pro_strides):
            return f"stage {i}: a prologue row's stride is not whole 128-bit vectors"
        epi_strides = [_row_stride(s, tensors, products, kind, epi) for s, kind in epi_args]
        checked.append((tuple(pro_strides), tuple(epi_strides)))
    temps = list(products.temps)
    made = []  # (module, parts, run, shapes, params) of each kernel, made once the intermediates are known
    for run in _parts(products.stages):
        parts = [products.stages[i] for i in run]
        epi_strides = tuple(checked[i][1] for i in run)
        mxfp4 = parts[0].weight_dtype == MXFP4
        if not is_plain(parts[0]) and (tokens >= GEMM_MIN_TOKENS or mxfp4):  # the prologue on a kernel of its own
            trial = list(temps)
            hoisted = _hoisted(parts, trial)
            tiling = hoisted if isinstance(hoisted, str) else _gemm_tiling(hoisted[2], tokens, arch)
            if not isinstance(tiling, str) and \
                    sum(src[0] in READ for st in hoisted[2] for src in st.epilogue_from) <= \
                    PRODUCT_SLOTS["epilogue_inputs"]:
                program, dests, plain = hoisted
                temps = trial
                made.append(("rowwise", None, run, {"width": program.width},
                             {"program": program.to_params(), "vectors": vectors_for(program.width),
                              "strides": checked[run[0]][0], "sources": parts[0].prologue_from, "dests": dests}))
                # the kept statistics are epilogue inputs now, [T, 1] intermediates (no row stride)
                strides = tuple(tuple(0 if old[0] == "pro" else next(it) for new, old in
                                      zip(st.epilogue_from, was.epilogue_from, strict=True) if new[0] in READ)
                                for st, was, it in zip(plain, parts, map(iter, epi_strides), strict=True))
                made.append(("product_gemm", plain, run, {"token_tile": tiling.pop("token_tile")},
                             {**tiling, "x_stride": plain[0].k, "epi_strides": strides}))
                continue
        gemm = _gemm_tiling(parts, tokens, arch)
        if isinstance(gemm, str) and mxfp4:
            return f"stage{'s' if len(run) > 1 else ''} {', '.join(map(str, run))}: {gemm}"
        if isinstance(gemm, str):
            tiling = _tiling(parts, tokens)
            if not isinstance(tiling, str):
                made.append(("product_gemv", parts, run, {"tokens": tokens},
                             {**tiling, "pro_strides": checked[run[0]][0], "epi_strides": epi_strides}))
                continue
            gemm = _gemm_tiling(parts, tokens, arch, min_tokens=1)  # a K too long for the GEMV's registers
            if isinstance(gemm, str):
                return f"stage{'s' if len(run) > 1 else ''} {', '.join(map(str, run))}: {tiling}"
        made.append(("product_gemm", parts, run, {"token_tile": gemm.pop("token_tile")},
                     {**gemm, "x_stride": checked[run[0]][0][0], "epi_strides": epi_strides}))
    specs = []
    for module, parts, run, shapes, params in made:
        plumbing = {"stage_index": tuple(run), "temps": tuple(temps), "results": products.results,
                    "collectives": products.collectives}
        if module == "rowwise":
            specs.append(KernelSpec.make("product_prologue", op, arch, shapes=shapes, params={**plumbing, **params},
                                         module="rowwise"))
            continue
        shapes = {**shapes, "k": parts[0].k, "n": sum(st.n for st in parts)}
        # the kernel reads each product's rows as the launcher slices them: where they start is the
        # launcher's alone (weights_at), so the kernel is the same whichever rows a rank reads
        kernel_parts = tuple(replace(st, weights=tuple((w, 0) for w, _ in st.weights)) for st in parts)
        params = {**plumbing, "parts": tuple(st.to_params() for st in kernel_parts),
                  "weights_at": tuple(w for st in parts for w in st.weights), **params}
        if parts[0].weight_dtype == MXFP4:  # the codes' and scales' row strides: the whole weight's
            params["mxfp4_strides"] = tuple((tensors[w].stride(0), tensors[sc].stride(0)) for st in parts
                                            for (w, _), sc in zip(st.weights, st.scales, strict=True))
        specs.append(KernelSpec.make(module, op, arch, shapes=shapes, params=params))
    for i, tail in enumerate(products.tails):  # after the collective inside the op, on the rowwise kernel
        program = tail.program
        if program.width % VEC or len(program.inputs) > MAX_INPUTS or len(program.outputs) > MAX_OUTPUTS:
            return (f"the program after the all-reduce: {program.width} columns, {len(program.inputs)} inputs, "
                    f"{len(program.outputs)} outputs (the rowwise kernel: whole 128-bit vectors, at most "
                    f"{MAX_INPUTS} and {MAX_OUTPUTS})")
        strides = tuple(_row_stride(s, tensors, products, kind, program)
                        for s, (kind, _) in zip(tail.sources, program.inputs, strict=True))
        if any(s % VEC for s in strides):
            return "a row after the all-reduce is read at a stride that is not whole 128-bit vectors"
        specs.append(KernelSpec.make("product_tail", op, arch, shapes={"width": program.width}, module="rowwise",
                                     params={"stage_index": (len(products.stages) + i,), "temps": tuple(temps),
                                             "results": products.results, "collectives": products.collectives,
                                             "program": program.to_params(), "vectors": vectors_for(program.width),
                                             "strides": strides, "sources": tail.sources, "dests": tail.dests,
                                             "before": products.between if i == 0 else ()}))
    return tuple(specs)


def weight_tensors(stage: Stage, tensors: list[torch.Tensor], weights_at) -> list[torch.Tensor]:
    """The tensors a kernel reads for ``stage``'s products, whose rows start where ``weights_at``
    says: each product's [N, K] rows, or an MXFP4 product's codes (two int32 columns a row) and
    its E8M0 scales (as bytes), in Humming's layout."""
    if stage.weight_dtype != MXFP4:
        return [tensors[w][r0:r0 + stage.n] for w, r0 in weights_at]
    out = []
    for (w, r0), sc in zip(weights_at, stage.scales, strict=True):
        out += [tensors[w][:, 2 * r0:2 * (r0 + stage.n)], tensors[sc][:, r0:r0 + stage.n].view(torch.uint8)]
    return out


def _product_runtime(args: Sequence[Any]) -> str | None:
    """What the specs cannot know: where the tensors lie (their layouts are the specs')."""
    return aligned({f"tensor argument {i}": t for i, t in enumerate(_tensors(args))})


def _product_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    tensors = _tensors(args)
    p0 = specs[0].param_dict
    program, sources, _ = _programs_of(specs[0])[0]
    tokens, device = _tokens(sources, program, tensors), tensors[0].device
    temps = [torch.empty((tokens, width), dtype=DTYPES[dtype], device=device) for width, dtype in p0["temps"]]
    results: dict[int, torch.Tensor] = {}

    def made(dest, kind, width, dtype, group=1):
        t = torch.empty((tokens * group, width if kind == "row" else 1), dtype=DTYPES[dtype], device=device)
        if dest[0] == "result":
            results[dest[1]] = t
        return temps[dest[1]] if dest[0] == "temp" else t

    def pad(xs, size):
        return [*xs, *[None] * (size - len(xs))]

    for fn, spec in zip(fns, specs, strict=True):
        if spec.module == "rowwise":  # a prologue hoisted out of its GEMM, or a tail after a collective
            for k, collective, group, ranks in spec.param_dict.get("before", ()):
                if host().collective_runs(ranks):
                    temps[k] = getattr(host(), collective)(temps[k], group, ranks)
            (program, sources, dests), = _programs_of(spec)
            kinds = program.kinds
            ins = [_source(s, tensors, temps, kind, program) for s, (kind, _) in
                   zip(sources, program.inputs, strict=True)]
            outs = [made(d, kinds[v], program.width, dtype, program.group) for d, (v, dtype, _) in
                    zip(dests, program.outputs, strict=True)]
            fn(*pad(ins, MAX_INPUTS), *pad(outs, MAX_OUTPUTS))
            continue
        pins, ws, eins, qs, ys = [], [], [], [], []
        weights_at = iter(spec.param_dict["weights_at"])
        for stage in stages_of(spec):
            pro, epi = stage.prologue, stage.epilogue
            pins = [_source(s, tensors, temps, kind, pro) for s, (kind, _) in
                    zip(stage.prologue_from, pro.inputs, strict=True)]  # the same for every part
            ws += weight_tensors(stage, tensors, itertools.islice(weights_at, len(stage.weights)))
            eins += [_source(s, tensors, temps, kind, epi) for s, (kind, _) in
                     zip(stage.epilogue_from, epi.inputs, strict=True) if s[0] in READ]
            pkinds, ekinds = pro.kinds, epi.kinds
            qs += [made(d, pkinds[pro.outputs[j][0]], stage.k, pro.outputs[j][1])
                   for j, d in enumerate(stage.prologue_to) if d[0] == "result"]
            ys += [made(d, ekinds[v], stage.n, dtype) for d, (v, dtype, _) in zip(stage.epilogue_to, epi.outputs,
                                                                                   strict=True)]
        if spec.module == "product_gemm":  # its activation is the prologue's one input, read as it is
            fn(pins[0], *pad(ws, 4), *pad(eins, 4), *pad(ys, 4))
        else:
            fn(*pad(pins, 4), *pad(ws, 4), *pad(eins, 4), *pad(qs, 2), *pad(ys, 4))
    shapes = _result_shapes(specs)
    results = {r: t.view(-1, *shapes[r]) for r, t in results.items()}
    for r, collective, group, ranks in p0["collectives"]:  # what the reference does with a result last
        # stood down (one GPU timing a rank), an all-reduce is the partial as the kernel wrote it, as the
        # hand-written launchers leave it; a gather still runs: its result is every rank's width
        if ranks > 1 and (host().collective_runs(ranks) or collective != "all_reduce"):
            results[r] = getattr(host(), collective)(results[r], group, ranks)
    outs = [results[r] for r in range(p0["results"])]
    return outs[0] if _single_tensor(specs[0].op) else tuple(outs)


@functools.cache
def _result_shapes(specs: tuple[KernelSpec, ...]) -> dict[int, tuple[int, ...]]:
    """Each result's shape past its first dim, as the reference returns it (a statistic as [T] or
    [T, 1]; a row of a token's groups as [T, G, N] or [T, G * N]; [B, S, N] rows)."""
    shapes = {}
    for program, _, dests in (program for spec in specs for program in _programs_of(spec)):
        for (_, _, shape), dest in zip(program.outputs, dests, strict=True):
            if dest[0] == "result":
                shapes[dest[1]] = shape
    return shapes


PRODUCTS = Template("products", (), _product_specs, _product_runtime, _product_launch, generated=True,
                    doc="kernels generated from the fused op's reference: a prologue, matrix products by weights and "
                        "a pointwise epilogue, on the skinny tensor-core GEMM's main loop from "
                        f"{GEMM_MIN_TOKENS} tokens, else the skinny GEMV's")
TEMPLATES = (ROWWISE, PRODUCTS)
