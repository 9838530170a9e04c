"""``gemv``: the skinny GEMV of the fused ops that are a projection with extras
(``k3f::latent_tail``, ``k3f::o_proj_attn_res``), 1..64 tokens; the generated ``product_gemv``
is built on its main loop.

Computes ``y[t, n] = <x[t], W[n]>`` (bf16 x and W, fp32 accumulation) with compile-time
options:
- an RMSNorm prologue: ``x_n = bf16(x * rsqrt(mean(x^2) + eps) * norm_weight)`` per token,
  in fp32 as ``rewriter/model/layers/common.py:rms_norm``; each CTA computes it from the whole x
  row and stages ``x_n`` in shared memory;
- a residual epilogue: ``y = bf16(bf16(acc) + r[t, n])`` (a bf16 linear, then a bf16 add).
x and r may have a row stride other than their width (views of a wider tensor).

Work split (decode is bound by reading W once from HBM):
- a row group of ``rows_per_warp`` rows is owned by ``ksplit`` warps of a CTA, each taking
  a contiguous K slice of ``S = K / 256 / ksplit`` 128-bit vectors per lane (a warp reads
  512 contiguous bytes of a row per vector step); ``warps_per_cta / ksplit`` groups per CTA;
- each lane issues all ``rows_per_warp x S`` weight loads of its slice at once
  (``ld.global.L1::no_allocate.L2::256B.v4``) and keeps them in registers for the whole
  kernel: W is read from HBM once, however many tokens there are;
- tokens are processed in chunks of at most 8 (the fp32 accumulators, ``rows x chunk``
  per lane, stay in registers); x is read with ``ld.global.nc.v4`` (a chunk, at most 8 x
  14 KB, stays in L1) or, with the norm prologue, from shared memory (``ld.shared.v4``); a
  single chunk of at most ``X_AHEAD`` vectors a lane (the router and o_proj at one token)
  loads them all between the wait and the trigger, plain ``ld.global.v4`` (ptxas hoists
  ``ld.global.nc`` above the wait), so that they go out together: in the K loop ptxas issued
  them a few at a time, each batch once the last had landed;
- per (row, token) a 5-step ``shfl.sync.bfly`` butterfly sums the lanes; with ``ksplit > 1``
  the warps' partial sums meet in shared memory (one barrier); one lane per (row, token)
  applies the epilogue and stores;
- the norm prologue (per chunk): every thread stages its x vectors in shared memory and sums
  their squares (butterfly, then one barrier across warps), then normalizes them in place
  (one more barrier before the GEMV reads them).

Programmatic dependent launch: the kernel is launched with PDL and issues its weight loads and
the norm weight's (weights are never written by the layer) before ``griddepcontrol.wait``, so
their DRAM latency overlaps the previous kernel's tail; x, the residual and the outputs come
after the wait, which is followed at once by ``griddepcontrol.launch_dependents``. The
residual a lane adds is read with the chunk's x, so no load stands between the sums and the
store.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom, r2s_atom

MAX_TOKENS = 64
MAX_CHUNK = 8
MAX_SLICE = 16  # weight vectors per lane and row held in registers
X_AHEAD = 16  # x vectors per lane a chunk loads before its first use, at most (4 registers each)


class Gemv:
    """Compile-time configuration: tokens, K, the weight's rows, the norm prologue (eps), the
    residual epilogue, x / r row strides, the token chunk and the tiling (rows per warp, warps
    per CTA, K slices per row group)."""

    def __init__(self, tokens: int, k: int, rows: int, *, norm: bool = False, eps: float = 1e-6,
                 residual: bool = False, x_stride: int | None = None, r_stride: int | None = None,
                 chunk: int = MAX_CHUNK, rows_per_warp: int = 1, warps_per_cta: int = 4, ksplit: int = 1):
        if not 1 <= tokens <= MAX_TOKENS:
            raise ValueError(f"tokens {tokens} outside 1..{MAX_TOKENS}")
        if not 1 <= chunk <= min(MAX_CHUNK, tokens):
            raise ValueError(f"token chunk {chunk} outside 1..{min(MAX_CHUNK, tokens)}")
        if k % (VEC * 32 * ksplit):
            raise ValueError(f"K {k} is not {ksplit} slices of whole 128-bit vectors per lane")
        if warps_per_cta % ksplit:
            raise ValueError(f"{warps_per_cta} warps per CTA do not split into groups of {ksplit}")
        if rows < 1:
            raise ValueError(f"{rows} weight rows")
        self.tokens, self.k, self.rows = tokens, k, rows
        self.norm, self.eps, self.residual = norm, float(eps), residual
        self.x_stride = x_stride or k
        self.r_stride = r_stride or self.rows
        self.chunk = chunk
        self.num_chunks = -(-tokens // chunk)
        self.padded = self.num_chunks * chunk != tokens  # the last chunk re-reads token T-1, stores nothing for it
        self.rows_per_warp, self.warps_per_cta, self.ksplit = rows_per_warp, warps_per_cta, ksplit
        self.slice = k // VEC // 32 // ksplit
        if self.slice > MAX_SLICE:
            raise ValueError(f"{self.slice} vectors per lane and row exceed {MAX_SLICE} (use more K slices)")
        self.groups = warps_per_cta // ksplit
        self.threads = 32 * warps_per_cta
        self.grid = -(-self.rows // (self.groups * rows_per_warp))
        if rows_per_warp * chunk > 32:
            raise ValueError("rows_per_warp x chunk must fit in a warp (one storing lane each)")
        self.x_vectors = k // VEC  # norm prologue: vectors per x row, spread over the CTA
        self.x_per_thread = -(-self.x_vectors // self.threads)
        self.x_even = self.x_vectors % self.threads == 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mNormW: cute.Tensor | None, mR: cute.Tensor | None,
                 mY: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mX, mW, mNormW, mR, mY).launch(
            grid=[self.grid, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mNormW: cute.Tensor | None, mR: cute.Tensor | None,
               mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        T = const_expr(self.tokens)
        TC = const_expr(self.chunk)
        R = const_expr(self.rows_per_warp)
        S = const_expr(self.slice)
        KS = const_expr(self.ksplit)
        N = const_expr(self.rows)
        ld_w = g2r_stream_atom(BFloat16)
        ld_x = g2r_atom(BFloat16)
        st_s = r2s_atom(BFloat16)

        group = warp // KS
        ks = warp % KS
        first = (bidx * self.groups + group) * R

        smem = cutlass.memory.SmemAllocator()
        sRed = None
        if const_expr(KS > 1):
            sRed = smem.allocate_tensor(Float32, cute.make_layout((KS, self.groups, R, TC)), byte_alignment=16)
        if const_expr(self.norm):
            sX = smem.allocate_tensor(BFloat16, cute.make_layout((TC, self.k), stride=(self.k, 1)),
                                      byte_alignment=16)
            sSq = smem.allocate_tensor(Float32, cute.make_layout((TC, self.warps_per_cta)), byte_alignment=16)

        # this warp's weight slice: R rows x S vectors per lane, loaded once, kept for every chunk;
        # a row past the end (last CTA) re-reads the last row and stores nothing
        rW = cute.make_rmem_tensor((VEC, S, R), BFloat16)
        for r in cutlass.range_constexpr(R):
            gRow = mW[cutlass.min(first + r, N - 1), None]
            for s in cutlass.range_constexpr(S):
                v = (ks * S + s) * 32 + lane
                cute.copy(ld_w, cute.local_tile(gRow, (VEC,), (v,)), rW[None, s, r])

        # the norm weight, a weight too: loaded here rather than where x is normalized, one
        # round trip after the first barrier (plain loads: ptxas sinks ld.global.nc below the wait)
        if const_expr(self.norm):
            rNw = cute.make_rmem_tensor((VEC, self.x_per_thread), BFloat16)
            for j in cutlass.range_constexpr(self.x_per_thread):
                v = tidx + j * self.threads
                if const_expr(self.x_even) or v < self.x_vectors:
                    cute.copy(ld_w, cute.local_tile(mNormW, (VEC,), (v,)), rNw[None, j])

        # PDL: the weight loads above are in flight while the previous kernel finishes; x, the
        # residual and every output are touched only after its writes are visible
        cute.arch.griddepcontrol_wait()
        # one chunk, no norm: every x vector this lane multiplies, loaded now and before the
        # trigger (ptxas moves no load across it, so they all go out together; in the K loop it
        # issued them a few at a time, each batch once the last had landed: a round trip each).
        # Plain loads: ptxas hoists ld.global.nc above griddepcontrol.wait, a race with the
        # kernel that writes x
        ahead = const_expr(not self.norm and self.num_chunks == 1 and S * TC <= X_AHEAD)
        rXa = None
        if const_expr(ahead):
            rXa = cute.make_rmem_tensor((VEC, S, TC), BFloat16)
            for s in cutlass.range_constexpr(S):
                for t in cutlass.range_constexpr(TC):
                    cute.copy(g2r_atom(BFloat16, invariant=False),
                              cute.local_tile(mX[self.x_row(0, t), None], (VEC,), ((ks * S + s) * 32 + lane,)),
                              rXa[None, s, t])
        cute.arch.griddepcontrol_launch_dependents()

        rX = cute.make_rmem_tensor((VEC,), BFloat16)
        rAcc = cute.make_rmem_tensor((R, TC), Float32)
        rOut = cute.make_rmem_tensor((R, TC), Float32)
        for ch in cutlass.range(self.num_chunks, unroll=1):
            base = ch * TC
            # the residual of the (row, token) this lane stores, read with the chunk's x, not
            # after the sums (the load would then be one more round trip before the store)
            res = Float32(0.0)
            if const_expr(self.residual):
                for r in cutlass.range_constexpr(R):
                    for t in cutlass.range_constexpr(TC):
                        if lane == r * TC + t and ks == 0 and first + r < N and base + t < T:
                            res = mR[base + t, first + r].to(Float32)
            if const_expr(self.norm):
                # RMSNorm prologue: x staged in shared memory (each thread its own vectors) with
                # per-token sums of squares over the whole row, reduced over the CTA ...
                rSq = cute.make_rmem_tensor((TC,), Float32)
                rSq.fill(0.0)
                rXs = cute.make_rmem_tensor((VEC, self.x_per_thread), BFloat16)
                for t in cutlass.range_constexpr(TC):
                    gX = mX[self.x_row(base, t), None]
                    for j in cutlass.range_constexpr(self.x_per_thread):  # the token's loads, all in flight
                        v = tidx + j * self.threads
                        if const_expr(self.x_even) or v < self.x_vectors:
                            cute.copy(ld_x, cute.local_tile(gX, (VEC,), (v,)), rXs[None, j])
                    for j in cutlass.range_constexpr(self.x_per_thread):
                        v = tidx + j * self.threads
                        if const_expr(self.x_even) or v < self.x_vectors:
                            cute.copy(st_s, rXs[None, j], cute.local_tile(sX[t, None], (VEC,), (v,)))
                            xf = rXs[None, j].load().to(Float32)
                            rSq[t] = rSq[t] + (xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                for t in cutlass.range_constexpr(TC):
                    sq = cute.arch.warp_reduction(rSq[t], operator.add)
                    if lane == 0:
                        sSq[t, warp] = sq
                cute.arch.barrier()
                rInv = cute.make_rmem_tensor((TC,), Float32)
                for t in cutlass.range_constexpr(TC):
                    sq = Float32(0.0)
                    for w in cutlass.range_constexpr(self.warps_per_cta):
                        sq = sq + sSq[t, w]
                    rInv[t] = cute.math.rsqrt(sq / Float32(self.k) + Float32(self.eps))
                # ... then x_n = bf16((x * inv_rms) * norm_weight), in place (no register holds x across)
                for j in cutlass.range_constexpr(self.x_per_thread):
                    v = tidx + j * self.threads
                    if const_expr(self.x_even) or v < self.x_vectors:
                        nw = rNw[None, j].load().to(Float32)
                        for t in cutlass.range_constexpr(TC):
                            sXv = cute.local_tile(sX[t, None], (VEC,), (v,))
                            cute.autovec_copy(sXv, rX)
                            rX.store(((rX.load().to(Float32) * rInv[t]) * nw).to(BFloat16))
                            cute.copy(st_s, rX, sXv)
                cute.arch.barrier()

            # rAcc[r, t] = this lane's share of <W[row r], x[token t]> over the warp's K slice (fp32)
            rAcc.fill(0.0)
            for s in cutlass.range_constexpr(S):
                v = (ks * S + s) * 32 + lane
                w = [rW[None, s, r].load().to(Float32) for r in range(R)]
                for t in cutlass.range_constexpr(TC):
                    if const_expr(self.norm):
                        cute.autovec_copy(cute.local_tile(sX[t, None], (VEC,), (v,)), rX)
                    elif const_expr(ahead):
                        rX.store(rXa[None, s, t].load())
                    else:
                        cute.copy(ld_x, cute.local_tile(mX[self.x_row(base, t), None], (VEC,), (v,)), rX)
                    xf = rX.load().to(Float32)
                    for r in cutlass.range_constexpr(R):
                        rAcc[r, t] = rAcc[r, t] + (w[r] * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

            # sums over the warp (butterfly), then over the K slices (shared memory)
            lane_and_slice_sums(rAcc, rOut, sRed, lane, ks, group, R, TC, KS)

            # epilogue: lane r * TC + t (of the first K slice's warp) stores (row r, token t)
            for r in cutlass.range_constexpr(R):
                n = first + r
                for t in cutlass.range_constexpr(TC):
                    tg = base + t
                    if lane == r * TC + t and ks == 0 and n < N and tg < T:
                        val = rOut[r, t]
                        if const_expr(self.residual):
                            val = val.to(BFloat16).to(Float32) + res
                        mY[tg, n] = val.to(BFloat16)
            if const_expr(self.num_chunks > 1 and (KS > 1 or self.norm)):
                cute.arch.barrier()  # shared memory is reused by the next chunk

    def x_row(self, base, t):
        """The x row of token ``t`` of the chunk at ``base`` (trace-time helper): a padded last
        chunk re-reads token T-1 for its empty slots."""
        return cutlass.min(base + t, self.tokens - 1) if self.padded else base + t


def build(spec) -> tuple[Gemv, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    t, k, n = s["tokens"], s["k"], s["rows"]
    kernel = Gemv(t, k, n, norm=p["norm"], eps=p.get("eps", 1e-6),
                  residual=p["residual"], x_stride=p["x_stride"], r_stride=p.get("r_stride"), chunk=p["chunk"],
                  rows_per_warp=p["rows_per_warp"], warps_per_cta=p["warps_per_cta"], ksplit=p["ksplit"])

    x = make_fake_tensor(BFloat16, (t, k), (kernel.x_stride, 1), assumed_align=16)
    norm_w = make_fake_tensor(BFloat16, (k,), (1,), assumed_align=16) if kernel.norm else None
    res = make_fake_tensor(BFloat16, (t, kernel.rows), (kernel.r_stride, 1), assumed_align=2) if kernel.residual \
        else None
    w = make_fake_tensor(BFloat16, (n, k), (k, 1), assumed_align=16)
    y = make_fake_tensor(BFloat16, (t, n), (n, 1), assumed_align=2)  # scalar stores: any fresh [T, n] tensor
    return kernel, (x, w, norm_w, res, y, make_fake_stream(use_tvm_ffi_env_stream=True))


@cute.jit
def lane_and_slice_sums(rAcc: cute.Tensor, rOut: cute.Tensor, sRed: cute.Tensor | None, lane, ks, group, rows: int,
                        tokens: int, ksplit: int, lanes: cutlass.Constexpr = 32):
    """``rOut[r, t]``: ``rAcc[r, t]`` summed over the ``lanes`` lanes of a row (the warp, or each
    of its 16- or 8-lane groups: a butterfly, every lane of the group holds every sum), then over
    the ``ksplit`` warps of the K slices of its column group (through ``sRed[ks, group, r, t]``
    in shared memory, behind one barrier; whole warps only)."""
    for r in cutlass.range_constexpr(rows):
        for t in cutlass.range_constexpr(tokens):
            rOut[r, t] = cute.arch.warp_reduction(rAcc[r, t], operator.add, threads_in_group=lanes)
    if const_expr(ksplit > 1):
        if lane == 0:
            for r in cutlass.range_constexpr(rows):
                for t in cutlass.range_constexpr(tokens):
                    sRed[ks, group, r, t] = rOut[r, t]
        cute.arch.barrier()
        for r in cutlass.range_constexpr(rows):
            for t in cutlass.range_constexpr(tokens):
                total = sRed[0, group, r, t]
                for q in cutlass.range_constexpr(1, ksplit):
                    total = total + sRed[q, group, r, t]
                rOut[r, t] = total
