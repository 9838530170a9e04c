"""``expert_down``: stage 2 of the MoE experts, the down projection and the weighted sum.

The math is ``rewriter/model/layers/moe.py:experts_down`` (``shared_experts_down`` with one
expert and weight 1):

    out[t, l] = bf16(sum_j weights[t, j] * <a[t, j], w2[ids[t, j], l]>)      (fp32)

``a`` [T, k, I] is stage 1's activation, ``w2`` [E, L, I]; the shared experts pass ``h``
as [T, 1, I] and ``down_weight`` as [1, L, I]. (The reference rounds each expert's dot
product to bf16 before weighting; here the weighted sum is fp32 throughout.)

Work split: a row of w2 is only I = 256..768 values (32..96 128-bit vectors), so a group
of ``lanes_per_row`` lanes shares a row (lane ``g`` of the group reads vectors g, g + G,
..., so each load instruction reads whole 128-byte lines), a warp covers ``32 /
lanes_per_row`` rows at a time and ``rows_per_lane`` of those groups; w2 is streamed with
``ld.global.L1::no_allocate``, ``a`` read with ``ld.global.nc`` (each (token, slot) row of
``a`` is shared by every row group of the warp). A ``warp_reduction`` over the group's
lanes (``shfl.sync.bfly``) finishes each dot product.
- routed: one CTA per (token, block of rows); its warps split the k slots (each warp keeps
  ``slots_per_step`` experts' rows in flight at once: all of its slots at Kimi K3's
  shapes), and the warps' fp32 partial sums meet in shared memory. The grid's x is the
  token, so the CTAs of all tokens for one block of rows run side by side and an expert
  picked by several tokens is re-read from L2, not HBM; every loaded weight feeds one
  token's FMAs. The token count is a runtime size.
- shared: one CTA per block of rows, its warps split the rows; a lane loads its share of the
  rows once and keeps it in registers while all T tokens are taken in chunks of up to 8
  (``chunk`` accumulators per row). The token count is a compile-time constant.

Programmatic dependent launch (launched with ``use_pdl``): before ``griddepcontrol.wait``
a CTA reads only weights, which no kernel writes, and writes nothing. The shared expert
loads its rows before the wait, so their DRAM latency overlaps the previous kernel's tail.
The routed experts' rows depend on the ids (the router's output): they wait first, read
ids and routing weights, issue the first step of expert rows and only then call
``griddepcontrol.launch_dependents``; ptxas moves no load across either instruction
(otherwise it sinks each load to its first use, leaving a lane about 2 loads in flight),
so those loads are all in flight at once.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom

MAX_CHUNK = 8


class ExpertDown:
    """Compile-time configuration: experts E, slots k (routed) or tokens T (shared), output
    rows L, inner size I, and the tiling (lanes per row, rows per lane, warps splitting the
    slots and the rows, experts in flight per warp, tokens per chunk)."""

    def __init__(self, *, routed: bool, experts: int, top_k: int, rows: int, inter: int, tokens: int | None = None,
                 lanes_per_row: int = 8, rows_per_lane: int = 1, slot_warps: int = 4, row_warps: int = 1,
                 slots_per_step: int = 4, chunk: int = 1):
        self.routed = bool(routed)
        if self.routed == (tokens is not None):
            raise ValueError("the token count is a runtime size for routed experts, compile-time for shared ones")
        if not self.routed and (experts != 1 or top_k != 1 or slot_warps != 1):
            raise ValueError("shared experts: one expert, one slot, one warp per row")
        if lanes_per_row not in (1, 2, 4, 8, 16, 32) or inter % (VEC * lanes_per_row):
            raise ValueError(f"I {inter} is not a multiple of {VEC} x {lanes_per_row} lanes per row")
        if top_k % slot_warps or (top_k // slot_warps) % slots_per_step:
            raise ValueError(f"{top_k} slots do not split into {slot_warps} warps x steps of {slots_per_step}")
        if not 1 <= chunk <= min(MAX_CHUNK, lanes_per_row) or (self.routed and chunk != 1):
            raise ValueError(f"chunk {chunk}: 1 for routed experts, 1..{min(MAX_CHUNK, lanes_per_row)} for shared")
        self.experts = experts
        self.lanes_per_row, self.rows_per_lane = lanes_per_row, rows_per_lane
        self.slot_warps, self.row_warps = slot_warps, row_warps
        self.slots_per_step, self.chunk = slots_per_step, chunk
        self.groups = 32 // lanes_per_row  # rows a warp covers at once
        self.vec_per_lane = inter // VEC // lanes_per_row
        self.rows_per_warp = self.groups * rows_per_lane
        self.rows_per_cta = self.rows_per_warp * row_warps
        if rows % self.rows_per_cta:
            raise ValueError(f"L {rows} is not a multiple of {self.rows_per_cta} rows per CTA")
        self.row_blocks = rows // self.rows_per_cta
        self.slots_per_warp = top_k // slot_warps
        self.warps = slot_warps * row_warps
        if self.warps > 32:
            raise ValueError(f"{slot_warps} x {row_warps} warps: at most 32 per CTA")
        if tokens is not None:
            self.full_chunks, self.tail = divmod(tokens, chunk)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mIds: cute.Tensor | None, mWeights: cute.Tensor | None, mW: cute.Tensor,
                 mOut: cute.Tensor, stream: cuda.CUstream):
        token_ctas = mIds.shape[0] if const_expr(self.routed) else 1  # shared: every token in each CTA
        self.kernel(mA, mIds, mWeights, mW, mOut).launch(grid=[token_ctas, self.row_blocks, 1],
                                                         block=[32 * self.warps, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mIds: cute.Tensor | None, mWeights: cute.Tensor | None, mW: cute.Tensor,
               mOut: cute.Tensor):
        token, rblock, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        swarp = warp % self.slot_warps
        rwarp = warp // self.slot_warps
        group = lane // self.lanes_per_row
        first = rblock * self.rows_per_cta + rwarp * self.rows_per_warp + group  # + q * groups for q < rows_per_lane
        rW = cute.make_rmem_tensor((VEC, self.vec_per_lane, self.rows_per_lane, self.slots_per_step), BFloat16)
        if const_expr(self.routed):
            cute.arch.griddepcontrol_wait()
            slot0 = swarp * self.slots_per_warp
            # every expert id and weight first (one round trip), ids clamped: one out of range would read past w2
            rE = cute.make_rmem_tensor((self.slots_per_warp,), Int32)
            rWt = cute.make_rmem_tensor((self.slots_per_warp,), Float32)
            for j in cutlass.range_constexpr(self.slots_per_warp):
                rE[j] = cutlass.max(cutlass.min(Int32(mIds[token, slot0 + j]), Int32(self.experts - 1)), Int32(0))
                rWt[j] = mWeights[token, slot0 + j]
            rAcc = cute.make_rmem_tensor((self.rows_per_lane, 1), Float32)
            rAcc.fill(0.0)
            for s0 in cutlass.range_constexpr(0, self.slots_per_warp, self.slots_per_step):
                for su in cutlass.range_constexpr(self.slots_per_step):
                    self.load_w(mW, rW, Int64(rE[s0 + su]), su, first, lane)  # 64-bit: E x L x I may pass 2^31
                if const_expr(s0 == 0):
                    # after the first experts' loads: ptxas moves no load across it, so they are all in flight
                    cute.arch.griddepcontrol_launch_dependents()
                for su in cutlass.range_constexpr(self.slots_per_step):
                    self.accumulate(mA, rW, rAcc, su, token, slot0 + s0 + su, rWt[s0 + su], lane, 1)
            self.reduce(rAcc, 1)
            smem = cutlass.memory.SmemAllocator()
            sPart = smem.allocate_tensor(Float32, cute.make_layout((self.rows_per_cta, self.slot_warps)),
                                         byte_alignment=16)
            if lane % self.lanes_per_row == 0:
                for q in cutlass.range_constexpr(self.rows_per_lane):
                    sPart[rwarp * self.rows_per_warp + q * self.groups + group, swarp] = rAcc[q, 0]
            cute.arch.barrier()
            if tidx < self.rows_per_cta:
                total = sPart[tidx, 0]
                for w in cutlass.range_constexpr(1, self.slot_warps):
                    total = total + sPart[tidx, w]
                mOut[token, rblock * self.rows_per_cta + tidx] = total.to(BFloat16)
        else:
            # the lane's whole share of the rows, before the wait: weights are written by no kernel
            self.load_w(mW, rW, Int64(0), 0, first, lane)
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            for c in cutlass.range(self.full_chunks, unroll=1):
                self.chunk_of(mA, mOut, rW, c * self.chunk, first, lane, self.chunk)
            if const_expr(self.tail > 0):
                self.chunk_of(mA, mOut, rW, self.full_chunks * self.chunk, first, lane, self.tail)

    # trace-time helpers (plain Python, inlined into the kernel; no dynamic control flow inside)
    def load_w(self, mW: cute.Tensor, rW: cute.Tensor, e, su: int, first, lane):
        """Issue expert e's vectors of this lane's rows into buffer ``su`` (lane g of a group
        reads vectors g, g + G, ... of I: each load instruction reads whole
        128-byte lines)."""
        ld_w = g2r_stream_atom(BFloat16)
        G = self.lanes_per_row
        sub = lane % G
        for q in range(self.rows_per_lane):
            for v in range(self.vec_per_lane):
                cute.copy(ld_w, cute.local_tile(mW[e, first + q * self.groups, None], (VEC,), (v * G + sub,)),
                          rW[None, v, q, su])

    def accumulate(self, mA: cute.Tensor, rW: cute.Tensor, rAcc: cute.Tensor, su: int, t0, slot, weight, lane,
                   n: int):
        """rAcc[q, c] += weight * <buffer su's row q, a[t0 + c, slot]> over this lane's vectors (fp32)."""
        ld_a = g2r_atom(BFloat16)
        G = self.lanes_per_row
        sub = lane % G
        rA = cute.make_rmem_tensor((VEC,), BFloat16)
        for c in range(n):
            rPart = cute.make_rmem_tensor((self.rows_per_lane,), Float32)
            rPart.fill(0.0)
            for v in range(self.vec_per_lane):
                cute.copy(ld_a, cute.local_tile(mA[t0 + c, slot, None], (VEC,), (v * G + sub,)), rA)
                a = rA.load().to(Float32)
                for q in range(self.rows_per_lane):
                    w = rW[None, v, q, su].load().to(Float32)
                    rPart[q] = rPart[q] + (w * a).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for q in range(self.rows_per_lane):
                rAcc[q, c] = rAcc[q, c] + (rPart[q] if weight is None else weight * rPart[q])

    def reduce(self, rAcc: cute.Tensor, n: int):
        """Each dot product summed over its lane group (``shfl.sync.bfly``)."""
        for q in range(self.rows_per_lane):
            for c in range(n):
                rAcc[q, c] = cute.arch.warp_reduction(rAcc[q, c], operator.add, threads_in_group=self.lanes_per_row)

    @cute.jit
    def chunk_of(self, mA: cute.Tensor, mOut: cute.Tensor, rW: cute.Tensor, t0: Int32, first: Int32,
                 lane: Int32, n: cutlass.Constexpr[int]):
        """Shared expert, tokens t0 .. t0 + n - 1 against the rows held in ``rW``; lane c of
        each group stores token c's rows (bf16)."""
        rAcc = cute.make_rmem_tensor((self.rows_per_lane, n), Float32)
        rAcc.fill(0.0)
        self.accumulate(mA, rW, rAcc, 0, t0, 0, None, lane, n)
        self.reduce(rAcc, n)
        sub = lane % self.lanes_per_row
        for c in cutlass.range_constexpr(n):
            if sub == c:
                for q in cutlass.range_constexpr(self.rows_per_lane):
                    mOut[t0 + c, first + q * self.groups] = rAcc[q, c].to(BFloat16)


def build(spec) -> tuple[ExpertDown, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    e, k, rows, inter = s["experts"], s["top_k"], s["rows"], s["inter"]
    routed = p["routed"]
    kernel = ExpertDown(routed=routed, experts=e, top_k=k, rows=rows, inter=inter,
                        tokens=None if routed else s["tokens"], lanes_per_row=p["lanes_per_row"],
                        rows_per_lane=p["rows_per_lane"], slot_warps=p["slot_warps"], row_warps=p["row_warps"],
                        slots_per_step=p["slots_per_step"], chunk=p["chunk"])
    # routed: the token count is a runtime size (one compile serves every batch)
    t = cute.sym_int32() if routed else s["tokens"]
    ids = make_fake_tensor(Int64, (t, k), (k, 1), assumed_align=8) if routed else None
    weights = make_fake_tensor(Float32, (t, k), (k, 1), assumed_align=4) if routed else None
    args = (make_fake_tensor(BFloat16, (t, k, inter), (k * inter, inter, 1), assumed_align=16), ids, weights,
            make_fake_tensor(BFloat16, (e, rows, inter), (rows * inter, inter, 1), assumed_align=16),
            make_fake_tensor(BFloat16, (t, rows), (rows, 1), assumed_align=2),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
