"""``attn_in_proj_gemv``: the attention input projection for 1..8 tokens, weight-streaming GEMV.

Computes ``y[T, n] = sum_k x[T, k] * W[n, k]`` (``torch.nn.functional.linear(x, W)``, fp32
accumulation, bf16 result) and writes it split: rows ``[start_i, start_i + size_i)`` of the
packed weight go to output ``i`` (``k3f::kda_in_proj``: q|k|v, g, f_a, beta;
``k3f::mla_in_proj``: q_c, kv_c, k_pe, gate). Rows after the last segment (the zero padding
of ``in_proj_qkvgfab``) are neither read nor written.

Work split (decode is bound by reading W once from HBM):
- one warp owns ``rows_per_warp`` consecutive rows; its 32 lanes stream those rows along K
  in 128-bit vectors (8 bf16), a warp reading 512 contiguous bytes per row per step;
  ``unroll`` vectors per lane and row are issued before any is used, so each warp keeps
  ``rows_per_warp * unroll * 512`` bytes in flight; with ``pipeline`` the K loop is
  unrolled and the next step's weights are in flight while the current step is summed
  (the tiling per token count: ``codegen.launchers.in_proj.gemv_tiling``, measured on the H200);
- W is read with ``ld.global.L1::no_allocate.L2::256B.v4`` (no L1 line allocated: it is
  read once), x with ``ld.global.nc.v4`` (read-only path; x, at most 8 x 14 KB, stays in
  L1 and is shared by every warp of the SM);
- each lane accumulates ``rows_per_warp x T`` fp32 partial dot products; a butterfly of
  ``shfl.sync.bfly`` sums them over the warp, and lane ``t`` stores token ``t``'s value;
- programmatic dependent launch: the kernel launches with PDL and every warp issues the
  weights of the K steps it keeps in flight (step 0; steps 0 and 1 with ``pipeline``) before
  ``griddepcontrol.wait`` (W is written by no kernel), so that DRAM latency and the launch
  gap overlap the previous kernel's tail; x is read and the outputs written only after the
  wait, and ``launch_dependents`` follows it at once.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom

MAX_TOKENS = 8
MAX_SEGMENTS = 4


class InProjGemv:
    """Compile-time configuration: tokens, K, weight rows, output segments, and the tiling
    (rows per warp, warps per CTA, vectors in flight per lane and row)."""

    def __init__(self, tokens: int, k: int, rows: int, segments: tuple[int, ...], *, rows_per_warp: int | None = None,
                 warps_per_cta: int = 4, unroll: int | None = None, stream_weights: bool = True,
                 pipeline: bool = True):
        if not 1 <= tokens <= MAX_TOKENS:
            raise ValueError(f"tokens {tokens} outside 1..{MAX_TOKENS}")
        if k % (VEC * 32):
            raise ValueError(f"K {k} must be a multiple of {VEC * 32} (one 128-bit vector per lane)")
        if not 1 <= len(segments) <= MAX_SEGMENTS or min(segments) < 1 or sum(segments) > rows:
            raise ValueError(f"segments {segments}: 1..{MAX_SEGMENTS} positive sizes summing to at most {rows}")
        self.tokens, self.k, self.rows = tokens, k, rows
        self.segments = tuple(segments)
        self.starts = tuple(sum(segments[:i]) for i in range(len(segments)))
        self.rows_out = sum(segments)
        # x is re-read from L1 once per row group: keep tokens / rows_per_warp <= 4
        self.rows_per_warp = rows_per_warp or -(-tokens // 4)
        self.warps_per_cta = warps_per_cta
        vec_per_lane = k // VEC // 32
        self.unroll = unroll or next(u for u in (4, 2, 1) if vec_per_lane % u == 0)
        if vec_per_lane % self.unroll:
            raise ValueError(f"unroll {self.unroll} does not divide {vec_per_lane} vectors per lane")
        self.chunks = vec_per_lane // self.unroll
        self.stream_weights = stream_weights
        self.pipeline = pipeline
        self.rows_per_cta = self.rows_per_warp * warps_per_cta
        self.grid = -(-self.rows_out // self.rows_per_cta)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY0: cute.Tensor, mY1: cute.Tensor | None,
                 mY2: cute.Tensor | None, mY3: cute.Tensor | None, stream: cuda.CUstream):
        self.kernel(mX, mW, mY0, mY1, mY2, mY3).launch(
            grid=[self.grid, 1, 1], block=[32 * self.warps_per_cta, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY0: cute.Tensor, mY1: cute.Tensor | None,
               mY2: cute.Tensor | None, mY3: cute.Tensor | None):
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        T = const_expr(self.tokens)
        R = const_expr(self.rows_per_warp)
        U = const_expr(self.unroll)
        ld_w = g2r_stream_atom(BFloat16) if const_expr(self.stream_weights) else g2r_atom(BFloat16)
        ld_x = g2r_atom(BFloat16)
        outs = (mY0, mY1, mY2, mY3)

        first = (bidx * self.warps_per_cta + warp) * R
        # the weights of the K steps the loop keeps in flight (0, and 1 when pipelined) are issued
        # before the wait (PDL): W is never written by a kernel, so their DRAM latency overlaps the
        # previous kernel's tail; a warp past the last row loads the last row again, never used
        ahead = const_expr(min(2, self.chunks) if self.pipeline else 1)
        bufs = [cute.make_rmem_tensor((VEC, U, R), BFloat16) for _ in range(2 if self.pipeline else 1)]
        for c in cutlass.range_constexpr(ahead):
            self.load_w(mW, bufs[c], c, first, lane, ld_w)
        # x is the previous kernel's output: read it (and write anything) only after the wait
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if first < self.rows_out:
            rX = cute.make_rmem_tensor((VEC,), BFloat16)
            rAcc = cute.make_rmem_tensor((R, T), Float32)
            rAcc.fill(0.0)
            if const_expr(self.pipeline):
                # fully unrolled K loop, two register buffers: step c + 1's weights are in flight
                # while step c is summed
                for c in cutlass.range_constexpr(self.chunks):
                    if const_expr(ahead <= c + 1 < self.chunks):
                        self.load_w(mW, bufs[(c + 1) % 2], c + 1, first, lane, ld_w)
                    self.accumulate(mX, bufs[c % 2], rX, rAcc, c, lane, ld_x)
            else:
                # one buffer: step c is summed, then step c + 1's weights are issued
                for c in cutlass.range(self.chunks, unroll=1):
                    self.accumulate(mX, bufs[0], rX, rAcc, c, lane, ld_x)
                    if c + 1 < self.chunks:
                        self.load_w(mW, bufs[0], c + 1, first, lane, ld_w)
            for r in cutlass.range_constexpr(R):
                n = first + r
                for t in cutlass.range_constexpr(T):
                    total = cute.arch.warp_reduction(rAcc[r, t], operator.add)
                    if lane == t and n < self.rows_out:
                        val = total.to(BFloat16)
                        for i in cutlass.range_constexpr(len(self.segments)):
                            lo = const_expr(self.starts[i])
                            hi = const_expr(self.starts[i] + self.segments[i])
                            if n >= lo and n < hi:
                                outs[i][t, n - lo] = val

    # trace-time helpers (plain Python, inlined into the kernel; no dynamic control flow inside)
    def load_w(self, mW: cute.Tensor, rW: cute.Tensor, c, first, lane, ld_w):
        """Issue the R x U weight vectors of K step ``c`` (R * U loads in flight per lane)."""
        for u in range(self.unroll):
            v = (c * self.unroll + u) * 32 + lane
            for r in range(self.rows_per_warp):
                # a row past the end (last warp) re-reads the last row; its sums are never stored
                n = cutlass.min(first + r, self.rows_out - 1)
                cute.copy(ld_w, cute.local_tile(mW[n, None], (VEC,), (v,)), rW[None, u, r])

    def accumulate(self, mX: cute.Tensor, rW: cute.Tensor, rX: cute.Tensor, rAcc: cute.Tensor, c, lane, ld_x):
        """rAcc[r, t] += <W[row r, step c], x[t, step c]> over this lane's vectors (fp32)."""
        for u in range(self.unroll):
            v = (c * self.unroll + u) * 32 + lane
            for t in range(self.tokens):
                cute.copy(ld_x, cute.local_tile(mX[t, None], (VEC,), (v,)), rX)
                x = rX.load().to(Float32)
                for r in range(self.rows_per_warp):
                    w = rW[None, u, r].load().to(Float32)
                    rAcc[r, t] = rAcc[r, t] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


def build(spec) -> tuple[InProjGemv, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    t, k, n = s["tokens"], s["k"], s["rows"]
    segments = tuple(p["segments"])
    kernel = InProjGemv(t, k, n, segments, rows_per_warp=p.get("rows_per_warp"),
                        warps_per_cta=p.get("warps_per_cta", 4), unroll=p.get("unroll"),
                        stream_weights=p.get("stream_weights", True), pipeline=p.get("pipeline", True))

    def rowmajor(rows, cols):
        return make_fake_tensor(BFloat16, (rows, cols), (cols, 1), assumed_align=16)

    # outputs: 2-byte scalar stores, any alignment torch gives a fresh [T, size] tensor
    ys = [make_fake_tensor(BFloat16, (t, size), (size, 1), assumed_align=2) for size in segments]
    ys += [None] * (MAX_SEGMENTS - len(ys))
    return kernel, (rowmajor(t, k), rowmajor(n, k), *ys, make_fake_stream(use_tvm_ffi_env_stream=True))
