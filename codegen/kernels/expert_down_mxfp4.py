"""``expert_down_mxfp4``: stage 2 of the routed experts on MXFP4 weights in Humming's layout.

The math is ``rewriter/layers/moe.py:experts_down`` on ``k3::mxfp4_dequant``'s values:

    out[t, l] = bf16(sum_j weights[t, j] * <a[t, j, :I_live], W2[ids[t, j], l, :I_live]>)   (fp32)

``W2`` int32 [E, I/16, 2L] and its scales [E, I/32, L] as vLLM's Humming backend leaves them;
``a`` [T, k, I_live] is stage 1's activation. K blocks past ``I_live`` (vLLM's zero padding of
the intermediate) are never read. (The reference rounds each expert's dot product to bf16
before weighting; here the weighted sum is fp32 throughout.)

Work split:
- a CTA takes one token, one 64-row tile of L and a ``1 / cluster`` share of the k slots; each
  slot is ``warps_per_slot`` warps, each a contiguous run of ``kb_per_warp`` 16-wide K blocks
  of I_live: one 16-byte load per lane per block and one 8-byte scale load per two, issued at
  once (at TP 16, I_live = 192: 4 CTAs of 4 warps per token and tile, 12 blocks per warp);
- the MMA is m16n8k16 with the weight rows as M and the slot's activation as every N column;
  each warp scales its C by its slot's routing weight; the warps' sums meet in shared memory,
  the cluster's in distributed shared memory, and CTA ``rank`` stores rows ``[rank, rank + 1)
  * 64 / cluster`` of the tile.

Programmatic dependent launch: the kernel runs right after ``expert_up_mxfp4``, whose CTAs let it
launch only once their own wait has seen the router finish; so a CTA reads its ids and routing
weight and issues its rows before its wait (which only the activation needs), and those loads
overlap the up stage's tail. It lets the next kernel launch after the wait. After the per-expert
up stage (``k3f::routed_moe_mxfp4``) its first CTA also puts the router's plan back to zero once
past that wait: the up stage, the plan's last reader, has completed, and this grid reads none of it.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.mxfp4 import (DOWN_WARPS_PER_SM, DOWN_WARPS_PER_SM_SMEM, NO_CARVEOUT_PREFERENCE, ORDERS,
                                   cluster_barrier, cluster_sum, issue_weights, load_b, load_scales, staged_words,
                                   tile_mma, warp_registers, weight_staging)

TILE = 64
MAX_KB_PER_WARP = 14


class ExpertDownMxfp4:
    """Compile-time configuration: experts E, slots k, output rows L, I (padded) and I_live, the
    nibble order, the cluster (CTAs splitting a token's slots) and the warps per slot."""

    def __init__(self, *, experts: int, top_k: int, rows: int, inter: int, inter_live: int, order: str,
                 cluster: int, warps_per_slot: int, zero_plan: bool = False, smem_weights: bool = False):
        if order not in ORDERS:
            raise ValueError(f"nibble order {order!r}: one of {ORDERS}")
        if rows % TILE:
            raise ValueError(f"L {rows} is not a multiple of {TILE}")
        if inter_live % 32 or not 0 < inter_live <= inter or inter % 16:
            raise ValueError(f"I {inter} / live {inter_live}: live a multiple of 32 (whole scale groups), <= I")
        self.zero_plan_after_wait = zero_plan
        self.smem_weights = smem_weights  # the weights staged in shared memory (``mxfp4.weight_staging``)
        self.warps_per_sm = DOWN_WARPS_PER_SM_SMEM if smem_weights else DOWN_WARPS_PER_SM
        if cluster not in (1, 2, 4, 8) or top_k % cluster or TILE % cluster:
            raise ValueError(f"cluster {cluster}: 1, 2, 4 or 8 dividing top_k {top_k}")
        kb = inter_live // 16
        if kb % warps_per_slot:
            raise ValueError(f"{kb} live K blocks do not split over {warps_per_slot} warps")
        self.kb_per_warp = kb // warps_per_slot
        if self.kb_per_warp % 2 or self.kb_per_warp > MAX_KB_PER_WARP:
            raise ValueError(f"{self.kb_per_warp} K blocks per warp: even, at most {MAX_KB_PER_WARP}")
        self.experts, self.top_k, self.rows = experts, top_k, rows
        self.inter, self.inter_live = inter, inter_live
        self.order, self.cluster, self.warps_per_slot = order, cluster, warps_per_slot
        self.slots_per_cta = top_k // cluster
        self.warps = self.slots_per_cta * warps_per_slot
        if not 2 <= self.warps <= 32:
            raise ValueError(f"{self.warps} warps per CTA: 2 to 32 (a thread per row of the {TILE}-row tile sums it)")
        self.tiles = rows // TILE
        self.share = TILE // cluster

    @cute.jit
    def __call__(self, mA: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor, mW: cute.Tensor,
                 mS: cute.Tensor, mOut: cute.Tensor, mCount: cute.Tensor | None, mChosen: cute.Tensor | None,
                 stream: cuda.CUstream):
        cluster = [self.cluster, 1, 1] if const_expr(self.cluster > 1) else None
        self.kernel(mA, mIds, mWeights, mW, mS, mOut, mCount, mChosen).launch(
            grid=[mIds.shape[0] * self.cluster, self.tiles, 1], block=[32 * self.warps, 1, 1], cluster=cluster,
            stream=stream, use_pdl=True, min_blocks_per_mp=max(1, self.warps_per_sm // self.warps),
            preferred_smem_carveout=NO_CARVEOUT_PREFERENCE)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor,
               mOut: cute.Tensor, mCount: cute.Tensor | None, mChosen: cute.Tensor | None):
        bidx, nt, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        C = const_expr(self.cluster)
        NKB = const_expr(self.kb_per_warp)
        rank = bidx % C
        token = bidx // C
        local = warp // self.warps_per_slot
        wslice = warp - local * self.warps_per_slot
        slot = rank * self.slots_per_cta + local
        kb0 = wslice * NKB
        r = lane // 4
        q = lane - r * 4

        rS, acc = warp_registers(NKB)
        rB = cute.make_rmem_tensor((2, NKB), Int32)
        smem = SmemAllocator()
        rW, sW = weight_staging(self.smem_weights, smem, NKB, self.warps)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((TILE, self.warps)), byte_alignment=16)
        sTot = smem.allocate_tensor(Float32, cute.make_layout((TILE,)), byte_alignment=16)

        # the ids and routing weights come from the router, which completed before the up stage
        # (its primary) passed its own wait, so they are read, and the rows they pick issued,
        # before this kernel's wait: the rows' DRAM latency overlaps the up stage's tail
        e = Int64(cutlass.max(cutlass.min(Int32(mIds[token, slot]), Int32(self.experts - 1)), Int32(0)))
        weight = Float32(mWeights[token, slot])
        issue_weights(mW, rW, sW, e, kb0, NKB, nt, lane, warp)
        load_scales(mS, rS, e, kb0 // 2, NKB // 2, nt, r)
        cute.arch.griddepcontrol_wait()  # the activation is the up stage's output
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.zero_plan_after_wait):
            if (bidx == 0) & (nt == 0):
                self.zero_plan(mCount, mChosen, tidx)
        load_b(mA, rB, (token, slot), kb0, NKB, q)
        tile_mma(staged_words(rW, sW, lane, warp), rS, lambda i: (rB[0, i], rB[1, i]), acc, NKB, self.order)

        if q == 0:
            for i3 in cutlass.range_constexpr(4):
                sPart[i3 * 16 + r, warp] = weight * acc[0, i3]
                sPart[i3 * 16 + 8 + r, warp] = weight * acc[2, i3]
        cute.arch.barrier()
        if tidx < TILE:
            total = sPart[tidx, 0]
            for w in cutlass.range_constexpr(1, self.warps):
                total = total + sPart[tidx, w]
            sTot[tidx] = total
        cluster_barrier(C)
        if tidx < self.share:
            row = rank * self.share + tidx
            mOut[token, nt * TILE + row] = cluster_sum(sTot, (1,), (row,), C)[0].to(BFloat16)
        if const_expr(C > 1):
            cluster_barrier(C)  # peers may still be reading this CTA's sums


    @cute.jit
    def zero_plan(self, mCount: cute.Tensor, mChosen: cute.Tensor, tidx):
        """After the per-expert up stage (which read the router's plan and has completed: this
        kernel passed its wait, and reads no plan itself), the plan's counts back to zero for the
        next step's router."""
        chosen = mCount[self.experts]
        for i in cutlass.range(tidx, chosen, 32 * self.warps, unroll=1):
            mCount[mChosen[i]] = Int32(0)
        cute.arch.barrier()  # every thread has read the chosen count
        if tidx == 0:
            mCount[self.experts] = Int32(0)


def build(spec) -> tuple[ExpertDownMxfp4, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size)."""
    s, p = spec.shape_dict, spec.param_dict
    e, k, rows, inter, live = s["experts"], s["top_k"], s["rows"], s["inter"], s["inter_live"]
    t = cute.sym_int32()
    kernel = ExpertDownMxfp4(experts=e, top_k=k, rows=rows, inter=inter, inter_live=live, order=p["order"],
                             cluster=p["cluster"], warps_per_slot=p["warps_per_slot"],
                             zero_plan=bool(p.get("zero_plan")), smem_weights=bool(p.get("smem_weights")))
    args = (make_fake_tensor(Int32, (t, k, live // 2), (k * live // 2, live // 2, 1), assumed_align=16),
            make_fake_tensor(Int64, (t, k), (k, 1), assumed_align=8),
            make_fake_tensor(Float32, (t, k), (k, 1), assumed_align=4),
            make_fake_tensor(Int32, (e, inter // 16, 2 * rows), (inter // 16 * 2 * rows, 2 * rows, 1),
                             assumed_align=16),
            make_fake_tensor(Int32, (e, inter // 32, rows // 4), (inter // 32 * rows // 4, rows // 4, 1),
                             assumed_align=16),
            make_fake_tensor(BFloat16, (t, rows), (rows, 1), assumed_align=2),
            # after the per-expert up stage: the plan's counts and chosen experts, zeroed here
            *((make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4),
               make_fake_tensor(Int32, (e,), (1,), assumed_align=4)) if p.get("zero_plan") else (None, None)),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
