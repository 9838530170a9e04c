"""``product_gemv``: a generated kernel: a stage of a fused op's ``codegen.lowered.Products`` (a
prologue, matrix products of its result, a pointwise epilogue) on the skinny GEMV's main loop,
1..64 tokens, bf16 or fp8 weights. Several stages of one prologue and different widths (an input projection's q, k,
v and gates) are the kernel's *parts*: each CTA's columns lie in one part, whose weights it
reads and whose epilogue it runs (``product_gemm.py`` holds parts the same way).

The main loop is the one of ``codegen/kernels/gemv.py`` (decode reads every weight once from
HBM): a warp owns ``cols`` output columns of every product (``cols x products`` weight rows;
for a short K each 16- or 8-lane group of a warp owns ``cols`` columns of its own, ``lanes``),
``ksplit`` warps split K, each lane loads its whole K slice of its rows at once
(``ld.global.L1::no_allocate.L2::256B.v4``, before ``griddepcontrol.wait``: weights are never
written by the layer) and keeps it in registers for every token; tokens run in chunks of at most
8 (fp32 sums in registers); a butterfly sums the lanes, shared memory the K slices. The
generated code goes into two hooks, emitted op by op from the programs
(``codegen/kernels/emit.py``):
- the prologue: a plain read of a bf16 activation (the programs' identity) reads x from memory
  in the K loop, as the GEMV does; any other prologue runs per token of the chunk over the
  whole row, spread over the CTA as in the rowwise kernel (reductions across the CTA), and
  stages its bf16 result in shared memory; the statistics the epilogue reads stay in
  registers; a result the op returns from the prologue is written by CTA 0;
- the epilogue: lane ``c * chunk + t`` of a column group's first warp (of each lane group)
  owns (column c, token t):
  it reads its epilogue inputs (rows, columns, statistics) with the chunk's x, takes every
  product's sum for its (c, t), runs the epilogue on scalars and stores each output.

Programmatic dependent launch: weights before the wait; everything else after it, followed at
once by ``launch_dependents`` (after the loads of a one-chunk activation, as the GEMV).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom, r2s_atom
from codegen.kernels.emit import CUTE_DTYPES, RowSplit, fake_input, input_value, part_of, run
from codegen.kernels.gemv import X_AHEAD, lane_and_slice_sums
from codegen.kernels.rowwise import load_row_value, store_vector
from codegen.launchers.generated import PRODUCT_SLOTS, is_plain, part_slots
from codegen.lowered import READ, Stage
from codegen.targets import MAX_TOKENS


class ProductGemv:
    """Compile-time configuration: the parts (stages of one prologue; the first's prologue is
    every part's), the tokens and their chunk, the tiling (lanes a row, columns per lane group,
    warps per CTA, K slices), and the row strides of the row inputs (views of wider rows), the
    epilogue's per part.

    ``lanes``: a row's K is spread over the whole warp (32), or over each of its 16- or 8-lane
    groups, which then own columns of their own: a short K (the shared experts' down projection,
    384 at TP 16: 48 vectors) fills every lane of 16 with 3 vectors, where a warp would leave a
    quarter of its lanes idle on a second one. Groups smaller than the warp take one K slice."""

    def __init__(self, parts: tuple[Stage, ...], tokens: int, *, chunk: int, cols: int, warps_per_cta: int,
                 ksplit: int, pro_strides: tuple[int, ...], epi_strides: tuple[tuple[int, ...], ...],
                 lanes: int = 32):
        if not 1 <= tokens <= MAX_TOKENS or not 1 <= chunk <= min(8, tokens):
            raise ValueError(f"{tokens} tokens in chunks of {chunk}: 1..{MAX_TOKENS} in chunks of 1..8")
        stage = parts[0]
        if any((st.prologue, st.prologue_from, st.prologue_to, len(st.weights), st.weight_dtype) !=
               (stage.prologue, stage.prologue_from, stage.prologue_to, len(stage.weights), stage.weight_dtype)
               for st in parts):
            raise ValueError("the parts of one kernel share their prologue, their count of products and their "
                             "weights' dtype")
        self.parts, self.stage, self.tokens, self.chunk = tuple(parts), stage, tokens, chunk
        self.k, self.products = stage.k, len(stage.weights)
        if self.k % VEC or warps_per_cta % ksplit:
            raise ValueError(f"K {self.k} is not whole 128-bit vectors, or {warps_per_cta} warps do not split into "
                             f"groups of {ksplit}")
        if lanes not in (8, 16, 32) or (lanes < 32 and ksplit != 1):
            raise ValueError(f"{lanes} lanes a row with {ksplit} K slices: 32, or 16 or 8 in one K slice")
        self.cols, self.ksplit, self.warps_per_cta, self.lanes = cols, ksplit, warps_per_cta, lanes
        self.subs = 32 // lanes  # lane groups a warp, each its own columns
        self.rows = cols * self.products  # weight rows a lane holds
        self.k_vectors = self.k // VEC
        self.slice = -(-self.k_vectors // (lanes * ksplit))  # vectors a lane holds of each row
        # K not whole vectors a lane: the lanes past the row's end read its last vector and add nothing
        self.k_even = self.k_vectors == self.slice * lanes * ksplit
        if cols * chunk > lanes:
            raise ValueError(f"{cols} columns x {chunk} tokens: one storing lane each, at most {lanes}")
        self.groups = warps_per_cta // ksplit
        self.threads = 32 * warps_per_cta
        # each part's CTAs, from tile_starts[q]
        tiles = [-(-st.n // (self.groups * self.subs * cols)) for st in parts]
        self.tile_starts = tuple(sum(tiles[:q]) for q in range(len(parts)))
        self.grid = sum(tiles)
        self.num_chunks = -(-tokens // chunk)
        self.padded = self.num_chunks * chunk != tokens
        self.plain = is_plain(stage)
        self.split = RowSplit(self.k // VEC, self.threads)
        self.pro_strides, self.epi_strides = pro_strides, epi_strides
        self.pro_results = [(j, d) for j, d in enumerate(stage.prologue_to) if d[0] == "result"]
        self.keeps = [j for j, d in enumerate(stage.prologue_to) if d[0] == "keep"]
        self.epi_args = [[i for i, src in enumerate(st.epilogue_from) if src[0] in READ] for st in parts]
        if len(epi_strides) != len(parts) or any(len(a) != len(e) for a, e in zip(self.epi_args, epi_strides)):
            raise ValueError(f"epilogue strides {epi_strides}: one per row input of each part")
        counts = {"prologue_inputs": len(stage.prologue.inputs), "weights": self.products * len(parts),
                  "epilogue_inputs": sum(map(len, self.epi_args)), "prologue_results": len(self.pro_results),
                  "outputs": sum(len(st.epilogue.outputs) for st in parts)}
        for what, count in counts.items():
            if count > PRODUCT_SLOTS[what]:
                raise ValueError(f"{count} {what.replace('_', ' ')}: the kernel takes at most {PRODUCT_SLOTS[what]}")

    @cute.jit
    def __call__(self, p0: cute.Tensor, p1: cute.Tensor | None, p2: cute.Tensor | None, p3: cute.Tensor | None,
                 w0: cute.Tensor, w1: cute.Tensor | None, w2: cute.Tensor | None, w3: cute.Tensor | None,
                 e0: cute.Tensor | None, e1: cute.Tensor | None, e2: cute.Tensor | None, e3: cute.Tensor | None,
                 q0: cute.Tensor | None, q1: cute.Tensor | None,
                 y0: cute.Tensor | None, y1: cute.Tensor | None, y2: cute.Tensor | None, y3: cute.Tensor | None,
                 stream: cuda.CUstream):
        self.kernel(p0, p1, p2, p3, w0, w1, w2, w3, e0, e1, e2, e3, q0, q1, y0, y1, y2, y3).launch(
            grid=[self.grid, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, p0: cute.Tensor, p1: cute.Tensor | None, p2: cute.Tensor | None, p3: cute.Tensor | None,
               w0: cute.Tensor, w1: cute.Tensor | None, w2: cute.Tensor | None, w3: cute.Tensor | None,
               e0: cute.Tensor | None, e1: cute.Tensor | None, e2: cute.Tensor | None, e3: cute.Tensor | None,
               q0: cute.Tensor | None, q1: cute.Tensor | None,
               y0: cute.Tensor | None, y1: cute.Tensor | None, y2: cute.Tensor | None, y3: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        T, TC, C, P = const_expr(self.tokens), const_expr(self.chunk), const_expr(self.cols), const_expr(self.products)
        R, S, KS, L = const_expr(self.rows), const_expr(self.slice), const_expr(self.ksplit), const_expr(self.lanes)
        one = const_expr(len(self.parts) == 1)
        pro = self.stage.prologue
        pro_kinds = pro.kinds
        pins = (p0, p1, p2, p3)[:len(pro.inputs)]
        weights = (w0, w1, w2, w3)
        eins = (e0, e1, e2, e3)
        qouts = (q0, q1)[:len(self.pro_results)]
        youts = (y0, y1, y2, y3)

        group = warp // KS
        ks = warp % KS
        # the part this CTA's columns lie in, and the CTA's place in it
        part, cta = part_of(bidx, self.tile_starts)
        first = (cta * self.groups + group) * C  # this warp's (lane group's) first output column of its part
        if const_expr(L < 32):
            first = ((cta * self.groups + group) * self.subs + lane // L) * C
            lane = lane % L  # the lane within its group from here on

        smem = cutlass.memory.SmemAllocator()
        sRed = None
        if const_expr(KS > 1):
            sRed = smem.allocate_tensor(Float32, cute.make_layout((KS, self.groups, R, TC)), byte_alignment=16)
        sX, sPro = None, None
        if const_expr(not self.plain):
            sX = smem.allocate_tensor(BFloat16, cute.make_layout((TC, self.k), stride=(self.k, 1)), byte_alignment=16)
            if const_expr(pro.reductions > 0):
                sPro = smem.allocate_tensor(Float32, cute.make_layout((TC * pro.reductions, self.split.warps)),
                                            byte_alignment=16)

        # the weight rows of this warp: column c of product p is row c * P + p, K slice ks; a
        # column past its part's end (a part's last CTA) re-reads the last one and stores nothing
        WD = CUTE_DTYPES[self.stage.weight_dtype]  # bf16, or fp8 (8 values a 64-bit load, converted exactly)
        rW = cute.make_rmem_tensor((VEC, S, R), WD)
        for q in cutlass.range_constexpr(len(self.parts)):
            if one or part == q:
                ws = [weights[w] for w in part_slots(self.parts, "weights", q)]
                for c in cutlass.range_constexpr(C):
                    n = cutlass.min(first + c, self.parts[q].n - 1)
                    for p in cutlass.range_constexpr(P):
                        for s in cutlass.range_constexpr(S):
                            cute.copy(g2r_stream_atom(WD, bits=VEC * WD.width),
                                      cute.local_tile(ws[p][n, None], (VEC,), (self.k_vector(ks, s, lane),)),
                                      rW[None, s, c * P + p])

        cute.arch.griddepcontrol_wait()
        ahead = const_expr(self.plain and self.num_chunks == 1 and S * TC <= X_AHEAD)
        rXa = None
        if const_expr(ahead):  # plain loads, before the trigger (gemv.py says why)
            rXa = cute.make_rmem_tensor((VEC, S, TC), BFloat16)
            for s in cutlass.range_constexpr(S):
                for t in cutlass.range_constexpr(TC):
                    cute.copy(g2r_atom(BFloat16, invariant=False),
                              cute.local_tile(p0[self.x_row(0, t), None], (VEC,), (self.k_vector(ks, s, lane),)),
                              rXa[None, s, t])
        cute.arch.griddepcontrol_launch_dependents()
        pro_cols = [load_row_value(self.split, t, kind, dtype, tidx, None) if const_expr(kind == "col") else None
                    for t, (kind, dtype) in zip(pins, pro.inputs)] if const_expr(not self.plain) else []

        # the (column, token) this lane stores, where it stores one
        my_c = lane // TC
        my_t = lane % TC
        rX = cute.make_rmem_tensor((VEC,), BFloat16)
        rAcc = cute.make_rmem_tensor((R, TC), Float32)
        rOut = cute.make_rmem_tensor((R, TC), Float32)
        rStat = cute.make_rmem_tensor((max(1, len(self.keeps)), TC), Float32)
        rEpi = cute.make_rmem_tensor((max(1, *map(len, self.epi_args)),), Float32)
        for ch in cutlass.range(self.num_chunks, unroll=1):
            base = ch * TC
            t_mine = cutlass.min(base + my_t, T - 1)
            # the epilogue's inputs at this lane's (column, token), read with the chunk's x (not
            # after the sums: one more round trip before the store)
            for q in cutlass.range_constexpr(len(self.parts)):
                if const_expr(len(self.epi_args[q]) > 0):
                    if one or part == q:
                        n_mine = cutlass.min(first + my_c, self.parts[q].n - 1)
                        for i, slot in enumerate(part_slots(self.parts, "inputs", q)):
                            kind, _ = self.parts[q].epilogue.inputs[self.epi_args[q][i]]
                            source = self.parts[q].epilogue_from[self.epi_args[q][i]][0]
                            rEpi[i] = input_value(eins[slot], source, kind, t_mine, n_mine)
            if const_expr(not self.plain):
                # the prologue hook: every token of the chunk over its whole row, spread over the
                # CTA; the products' activation to shared memory, the kept statistics to
                # registers, the op's results from CTA 0
                for t in cutlass.range_constexpr(TC):
                    tok = self.x_row(base, t)
                    vals = [pro_cols[i] if const_expr(kind == "col") else
                            load_row_value(self.split, pins[i], kind, dtype, tidx, tok)
                            for i, (kind, dtype) in enumerate(pro.inputs)]
                    run(pro, vals, self.split, tidx, sPro, slot=t * pro.reductions)
                    for j in cutlass.range_constexpr(self.split.vectors):
                        v = tidx + j * self.split.threads
                        rA = cute.make_rmem_tensor((VEC,), BFloat16)
                        for e in cutlass.range_constexpr(VEC):
                            rA[e] = vals[pro.outputs[0][0]][j * VEC + e].to(BFloat16)
                        if const_expr(self.split.even) or v < self.split.num_vec:
                            cute.copy(r2s_atom(BFloat16), rA, cute.local_tile(sX[t, None], (VEC,), (v,)))
                    for slot in cutlass.range_constexpr(len(self.keeps)):
                        rStat[slot, t] = vals[pro.outputs[self.keeps[slot]][0]]
                    for q in cutlass.range_constexpr(len(self.pro_results)):
                        q_value, q_dtype, _ = pro.outputs[self.pro_results[q][0]]
                        if const_expr(pro_kinds[q_value] == "row"):
                            for j in cutlass.range_constexpr(self.split.vectors):
                                rQ = cute.make_rmem_tensor((VEC,), CUTE_DTYPES[q_dtype])
                                for e in cutlass.range_constexpr(VEC):
                                    rQ[e] = vals[q_value][j * VEC + e].to(CUTE_DTYPES[q_dtype])
                                if bidx == 0 and base + t < T and (const_expr(self.split.even) or
                                                                   tidx + j * self.split.threads < self.split.num_vec):
                                    store_vector(rQ, qouts[q][base + t, None], tidx + j * self.split.threads, q_dtype)
                        elif bidx == 0 and tidx == 0 and base + t < T:
                            qouts[q][base + t, 0] = vals[q_value].to(CUTE_DTYPES[q_dtype])
                cute.arch.barrier()

            # rAcc[r, t] = this lane's share of <W[row r], a[token t]> over the warp's K slice (fp32)
            rAcc.fill(0.0)
            for s in cutlass.range_constexpr(S):
                v = self.k_vector(ks, s, lane)
                w = [rW[None, s, r].load().to(Float32) for r in range(R)]
                for t in cutlass.range_constexpr(TC):
                    if const_expr(not self.plain):
                        cute.autovec_copy(cute.local_tile(sX[t, None], (VEC,), (v,)), rX)
                    elif const_expr(ahead):
                        rX.store(rXa[None, s, t].load())
                    else:
                        cute.copy(g2r_atom(BFloat16), cute.local_tile(p0[self.x_row(base, t), None], (VEC,), (v,)),
                                  rX)
                    xf = rX.load().to(Float32)
                    for r in cutlass.range_constexpr(R):
                        dot = (w[r] * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        if const_expr(not self.k_even):
                            dot = cutlass.select_((ks * S + s) * L + lane < self.k_vectors, dot, Float32(0.0))
                        rAcc[r, t] = rAcc[r, t] + dot

            # sums over the warp (butterfly: every lane holds every sum), then over the K slices
            lane_and_slice_sums(rAcc, rOut, sRed, lane, ks, group, R, TC, KS, L)

            # the epilogue hook: this lane's (column, token): every product's sum, the kept
            # statistics and its inputs, through the epilogue program, to the outputs
            rSel = cute.make_rmem_tensor((P + max(1, len(self.keeps)),), Float32)
            for c in cutlass.range_constexpr(C):
                for t in cutlass.range_constexpr(TC):
                    if lane == c * TC + t:
                        for p in cutlass.range_constexpr(P):
                            rSel[p] = rOut[c * P + p, t]
                        for slot in cutlass.range_constexpr(len(self.keeps)):
                            rSel[P + slot] = rStat[slot, t]
            n = first + my_c
            tg = base + my_t
            for q in cutlass.range_constexpr(len(self.parts)):
                if one or part == q:
                    stage = self.parts[q]
                    epi = stage.epilogue
                    epi_kinds = epi.kinds
                    outs = [youts[o] for o in part_slots(self.parts, "outputs", q)]
                    evals = [rSel[src[1]] if const_expr(src[0] == "acc") else
                             rSel[P + self.keeps.index(src[1])] if const_expr(src[0] == "pro") else
                             rEpi[self.epi_args[q].index(i)] for i, src in enumerate(stage.epilogue_from)]
                    run(epi, evals)
                    if lane < C * TC and ks == 0 and n < stage.n and tg < T:
                        for o in cutlass.range_constexpr(len(epi.outputs)):
                            if const_expr(epi_kinds[epi.outputs[o][0]] == "row"):
                                outs[o][tg, n] = evals[epi.outputs[o][0]].to(CUTE_DTYPES[epi.outputs[o][1]])
                            elif n == 0:
                                outs[o][tg, 0] = evals[epi.outputs[o][0]].to(CUTE_DTYPES[epi.outputs[o][1]])
            if const_expr(self.num_chunks > 1 and (KS > 1 or not self.plain)):
                cute.arch.barrier()  # shared memory is reused by the next chunk

    def k_vector(self, ks, s, lane):
        """The K vector lane ``lane`` (of its group) of K slice ``ks`` holds at step ``s`` (clamped
        to the last)."""
        v = (ks * self.slice + s) * self.lanes + lane
        return v if const_expr(self.k_even) else cutlass.min(v, self.k_vectors - 1)

    def x_row(self, base, t):
        """The row of token ``t`` of the chunk at ``base``: a padded last chunk re-reads token T-1."""
        return cutlass.min(base + t, self.tokens - 1) if self.padded else base + t


def build(spec) -> tuple[ProductGemv, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    p = spec.param_dict
    parts = tuple(Stage.from_params(st) for st in p["parts"])
    t = spec.shape_dict["tokens"]
    kernel = ProductGemv(parts, t, chunk=p["chunk"], cols=p["cols"], warps_per_cta=p["warps_per_cta"],
                         ksplit=p["ksplit"], pro_strides=tuple(p["pro_strides"]),
                         epi_strides=tuple(tuple(e) for e in p["epi_strides"]), lanes=p.get("lanes", 32))
    k = parts[0].k

    pro = parts[0].prologue
    pins = [fake_input(kind, dtype, t, k, stride, vectors=True) for (kind, dtype), stride in
            zip(pro.inputs, kernel.pro_strides)]
    pkinds = pro.kinds
    qs = [fake_input(pkinds[pro.outputs[j][0]], pro.outputs[j][1], t, k, vectors=True) for j, _ in kernel.pro_results]
    ws, eins, ys = [], [], []
    for st, args, strides in zip(parts, kernel.epi_args, kernel.epi_strides, strict=True):
        epi, ekinds = st.epilogue, st.epilogue.kinds
        wd = CUTE_DTYPES[st.weight_dtype]  # rows of K values: whole 8-value vectors
        ws += [make_fake_tensor(wd, (st.n, k), (k, 1), assumed_align=VEC * wd.width // 8) for _ in st.weights]
        eins += [fake_input(*epi.inputs[i], t, st.n, stride, source=st.epilogue_from[i][0])
                 for i, stride in zip(args, strides, strict=True)]
        ys += [fake_input(ekinds[v], dtype, t, st.n) for v, dtype, _ in epi.outputs]

    def pad(xs, size):
        return [*xs, *[None] * (size - len(xs))]
    return kernel, (*pad(pins, 4), *pad(ws, 4), *pad(eins, 4), *pad(qs, 2), *pad(ys, 4),
                    make_fake_stream(use_tvm_ffi_env_stream=True))
