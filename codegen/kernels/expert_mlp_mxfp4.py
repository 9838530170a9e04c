"""``expert_mlp_mxfp4``: both stages of the routed experts on MXFP4 weights in one launch, a
cluster of CTAs per (token, slot) pair: the decode form at one token.

The math is ``rewriter/layers/moe.py:experts_up`` then ``experts_down`` on
``k3::mxfp4_dequant``'s values (``W13``, ``W2`` and their scales as vLLM's Humming backend
leaves them, ``codegen/kernels/expert_up_mxfp4.py``):

    a_j[c]  = bf16(act(bf16(<x, W13[e_j, c]>), bf16(<x, W13[e_j, I + c]>))),  c < I_live
    out[l]  = bf16(sum_j weights[j] * <a_j, W2[e_j, l, :I_live]>)            (fp32, slots in order)

Why one launch: at one token the two-kernel form spends about 4 us after the up stage ends on
the down stage's chain (its wait, the activation's round trip through global memory, its own
cluster reduction) for under 2 us of bytes (``docs/FEWER_STEPS.md``). Here the activation never
leaves the cluster, and each CTA's down rows are in shared memory before the activation exists.

Work split, a cluster of ``cluster`` CTAs per pair (``cluster * 32 * warps`` threads):
1. the up stage as ``expert_up_mxfp4`` splits it along L, but each CTA takes every live channel
   tile of both halves (``warps_per_tile`` warps a tile, ``kb_per_warp`` K blocks each, the
   words held in registers; at TP 16, L = 3584, I_live = 192: 8 CTAs of 12 warps, 14 blocks a
   warp); the warps' sums meet in shared memory;
2. every CTA pushes its partial of every (channel, half) to every CTA of the cluster
   (``common.push_send``: an all-reduce, one round, 2 I_live values a CTA to each peer) and each
   CTA sums the cluster's partials in rank order, so all compute the same activation, which
   stays in shared memory as the down stage's B fragments;
3. CTA ``rank`` owns rows ``[rank, rank + 1) * L / cluster`` of the down projection, a 64-row
   tile a warp over the whole live K; those rows (and their scales) were copied into shared
   memory by ``cp.async`` right after the ids were read, so they arrive while the up stage
   runs;
4. each warp stores its tile's rows times the pair's routing weight into the fp32 scratch
   ``mP`` [T, k, L]; the CTA then counts itself in at its (token, row share) counter (``mCnt``,
   zero between steps), and the CTA that brings a share's k-th sums the token's k slots of it in
   slot order (deterministic whatever the arrival order) into the bf16 output and puts the
   counter back to zero.

Programmatic dependent launch: every weight read depends on the router's ids, so a CTA waits
first, reads its id, issues both stages' loads and then lets the next kernel launch.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.common import gated_act, push_buffers, push_init, push_ready, push_received, push_send, push_total
from codegen.kernels.mxfp4 import (NO_CARVEOUT_PREFERENCE, ORDERS, issue_weights, load_scales, staged_words, tile_mma,
                                   warp_registers, weight_staging)

TILE = 64  # rows per Humming tile
MAX_KB_PER_WARP = 14  # the up stage's 16-byte weight loads a lane holds in registers at once
MAX_WARPS = 16  # the up stage's words in registers: 16 warps of ~128 registers a thread fill an SM's file


class ExpertMlpMxfp4:
    """Compile-time configuration: experts E, slots k, L, I (padded) and I_live, the activation
    (``beta`` None: SiLU-and-mul), the nibble order, the cluster (CTAs of a pair) and the up
    stage's warps per channel tile."""

    def __init__(self, *, experts: int, top_k: int, latent: int, inter: int, inter_live: int, beta: float | None,
                 linear_beta: float | None, order: str, cluster: int, warps_per_tile: int):
        if order not in ORDERS:
            raise ValueError(f"nibble order {order!r}: one of {ORDERS}")
        if inter % TILE or inter_live % TILE or not 0 < inter_live <= inter:
            raise ValueError(f"I {inter} / live {inter_live}: multiples of {TILE}, live <= I")
        if cluster not in (2, 4, 8):
            raise ValueError(f"cluster {cluster}: 2, 4 or 8 (the activation crosses the cluster)")
        kb = latent // 16
        if latent % 32 or kb % (cluster * warps_per_tile):
            raise ValueError(f"L {latent}: {kb} K blocks do not split over {cluster} CTAs x {warps_per_tile} warps")
        self.kb_per_warp = kb // (cluster * warps_per_tile)
        if self.kb_per_warp % 2 or self.kb_per_warp > MAX_KB_PER_WARP:
            raise ValueError(f"{self.kb_per_warp} K blocks per warp: even (whole scale groups), at most "
                             f"{MAX_KB_PER_WARP}")
        self.ctiles = inter_live // TILE
        self.warps = 2 * self.ctiles * warps_per_tile
        if self.warps > MAX_WARPS:
            raise ValueError(f"{self.ctiles} channel tiles x 2 halves x {warps_per_tile} warps = {self.warps} warps "
                             f"a CTA, more than {MAX_WARPS} hold their words in registers")
        if latent % (cluster * TILE):
            raise ValueError(f"L {latent}: the down rows do not split into 64-row tiles over {cluster} CTAs")
        self.down_tiles = latent // cluster // TILE  # the down stage's tiles a CTA, one a warp
        if self.down_tiles > self.warps:
            raise ValueError(f"{self.down_tiles} down tiles a CTA, more than its {self.warps} warps")
        self.experts, self.top_k, self.latent = experts, top_k, latent
        self.inter, self.inter_live = inter, inter_live
        self.beta = None if beta is None else float(beta)
        self.linear_beta = None if linear_beta is None or beta is None else float(linear_beta)
        self.order, self.cluster, self.warps_per_tile = order, cluster, warps_per_tile
        self.threads = 32 * self.warps
        self.up_tile0 = inter // TILE  # the up half's first tile
        self.x_words = warps_per_tile * self.kb_per_warp * 8  # x's bf16 pairs in the CTA's share of L
        self.down_kb = inter_live // 16  # the down stage's K blocks (whole scale groups: I_live % 64 == 0)
        self.share = latent // cluster  # the down rows a CTA owns

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor, mW13: cute.Tensor,
                 mS13: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mP: cute.Tensor, mCnt: cute.Tensor,
                 mOut: cute.Tensor, stream: cuda.CUstream):
        pairs = mIds.shape[0] * self.top_k
        self.kernel(mX, mIds, mWeights, mW13, mS13, mW2, mS2, mP, mCnt, mOut).launch(
            grid=[pairs * self.cluster, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
            stream=stream, use_pdl=True, min_blocks_per_mp=1, preferred_smem_carveout=NO_CARVEOUT_PREFERENCE)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor, mW13: cute.Tensor,
               mS13: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mP: cute.Tensor, mCnt: cute.Tensor,
               mOut: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        C = const_expr(self.cluster)
        NKB, KB2, WPT = const_expr(self.kb_per_warp), const_expr(self.down_kb), const_expr(self.warps_per_tile)
        LIVE, THREADS = const_expr(self.inter_live), const_expr(self.threads)
        rank = bidx % C
        pair = bidx // C
        token = pair // self.top_k
        slot = pair - token * self.top_k
        # the up stage: warp = (half, channel tile, slice of the tile's K share)
        half = warp // (self.ctiles * WPT)
        ct = (warp - half * (self.ctiles * WPT)) // WPT
        wslice = warp - half * (self.ctiles * WPT) - ct * WPT
        kb0 = (rank * WPT + wslice) * NKB
        r = lane // 4
        q = lane - r * 4

        rS, acc = warp_registers(NKB)
        rS2, acc2 = warp_registers(KB2)
        smem = SmemAllocator()
        rW, _ = weight_staging(False, smem, NKB, self.warps)
        _, sW2 = weight_staging(True, smem, KB2, self.down_tiles)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((TILE, WPT, 2, self.ctiles)), byte_alignment=16)
        sX = smem.allocate_tensor(Int32, cute.make_layout((self.x_words,)), byte_alignment=16)
        sA = smem.allocate_tensor(BFloat16, cute.make_layout((LIVE,)), byte_alignment=16)
        sA2 = cute.make_tensor(cute.recast_ptr(sA.iterator, dtype=Int32), cute.make_layout((LIVE // 2,)))
        sLast = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=4)
        recv, mbar = push_buffers(smem, C, (LIVE, 2))
        push_init(recv, mbar, tidx)
        cute.arch.cluster_arrive_relaxed()

        cute.arch.griddepcontrol_wait()  # the router's ids and weights
        # an id out of range would read past the weights: clamp it
        e = Int64(cutlass.max(cutlass.min(Int32(mIds[token, slot]), Int32(self.experts - 1)), Int32(0)))
        issue_weights(mW13, rW, None, e, kb0, NKB, ct + half * self.up_tile0, lane, warp)
        load_scales(mS13, rS, e, kb0 // 2, NKB // 2, ct + half * self.up_tile0, r)
        nt2 = rank * self.down_tiles + warp  # the down tile of warp < down_tiles
        if warp < self.down_tiles:
            issue_weights(mW2, None, sW2, e, 0, KB2, nt2, lane, warp)
            load_scales(mS2, rS2, e, 0, KB2 // 2, nt2, r)
        # after the loads: ptxas moves no load across it, so they are all in flight at once
        cute.arch.griddepcontrol_launch_dependents()
        weight = Float32(mWeights[token, slot])
        x0 = rank * self.x_words  # the CTA's share of x, staged once (every warp reads the same pairs)
        for j in cutlass.range_constexpr(-(-self.x_words // THREADS)):
            i = tidx + j * THREADS
            if const_expr(self.x_words % THREADS == 0) or i < self.x_words:
                sX[i] = mX[token, x0 + i]
        cute.arch.barrier()
        base = (kb0 - rank * WPT * NKB) * 8 + q
        tile_mma(staged_words(rW, None, lane, warp), rS, lambda i: (sX[base + i * 8], sX[base + i * 8 + 4]), acc,
                 NKB, self.order)
        # every C column is this token: lanes q = 0 hold rows 16 i3 + r (c0) and 16 i3 + 8 + r (c2)
        if q == 0:
            for i3 in cutlass.range_constexpr(4):
                sPart[i3 * 16 + r, wslice, half, ct] = acc[0, i3]
                sPart[i3 * 16 + 8 + r, wslice, half, ct] = acc[2, i3]
        cute.arch.barrier()
        push_ready()
        # this CTA's partial of every (channel, half), to every CTA of the cluster
        for j in cutlass.range_constexpr(-(-2 * LIVE // THREADS)):
            i = tidx + j * THREADS
            if const_expr((2 * LIVE) % THREADS == 0) or i < 2 * LIVE:
                h = i // LIVE
                c = i - h * LIVE
                row = c % TILE
                total = sPart[row, 0, h, c // TILE]
                for w in cutlass.range_constexpr(1, WPT):
                    total = total + sPart[row, w, h, c // TILE]
                for dst in cutlass.range_constexpr(C):
                    push_send(recv, mbar, total, (rank, c, h), dst)
        push_received(mbar)
        for j in cutlass.range_constexpr(-(-LIVE // THREADS)):
            c = tidx + j * THREADS
            if const_expr(LIVE % THREADS == 0) or c < LIVE:
                a = gated_act(push_total(recv, (c, 0)), push_total(recv, (c, 1)), self.beta, self.linear_beta)
                sA[c] = a.to(BFloat16)
        cute.arch.barrier()

        if warp < self.down_tiles:  # the down stage: this warp's 64 rows over the whole live K
            tile_mma(staged_words(None, sW2, lane, warp), rS2, lambda i: (sA2[i * 8 + q], sA2[i * 8 + q + 4]), acc2,
                     KB2, self.order)
            if q == 0:
                for i3 in cutlass.range_constexpr(4):
                    mP[token, slot, nt2 * TILE + i3 * 16 + r] = weight * acc2[0, i3]
                    mP[token, slot, nt2 * TILE + i3 * 16 + 8 + r] = weight * acc2[2, i3]
                cute.arch.fence_acq_rel_gpu()  # this lane's rows visible before the CTA counts in
        cute.arch.barrier()
        if tidx == 0:
            sLast[0] = cute.arch.atomic_add(mCnt.iterator + (token * C + rank), Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier()
        if sLast[0] == self.top_k - 1:  # the share's last slot: the token's k slots of it, in slot order
            cute.arch.fence_acq_rel_gpu()
            for j in cutlass.range_constexpr(-(-self.share // THREADS)):
                i = tidx + j * THREADS
                if const_expr(self.share % THREADS == 0) or i < self.share:
                    row = rank * self.share + i
                    total = Float32(0.0)
                    for s in cutlass.range_constexpr(self.top_k):
                        total = total + mP[token, s, row]
                    mOut[token, row] = total.to(BFloat16)
            if tidx == 0:
                mCnt[token, rank] = Int32(0)


def build(spec) -> tuple[ExpertMlpMxfp4, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size, up to ``max_tokens``: the arrival counters' rows)."""
    s, p = spec.shape_dict, spec.param_dict
    e, k, lat, inter, live = s["experts"], s["top_k"], s["latent"], s["inter"], s["inter_live"]
    kernel = ExpertMlpMxfp4(experts=e, top_k=k, latent=lat, inter=inter, inter_live=live, beta=p["beta"],
                            linear_beta=p["linear_beta"], order=p["order"], cluster=p["cluster"],
                            warps_per_tile=p["warps_per_tile"])
    t = cute.sym_int32()
    n = 2 * inter
    return kernel, (
        make_fake_tensor(Int32, (t, lat // 2), (lat // 2, 1), assumed_align=16),  # x as bf16 pairs
        make_fake_tensor(Int64, (t, k), (k, 1), assumed_align=8),  # ids
        make_fake_tensor(Float32, (t, k), (k, 1), assumed_align=4),  # routing weights
        make_fake_tensor(Int32, (e, lat // 16, 2 * n), (lat // 16 * 2 * n, 2 * n, 1), assumed_align=16),
        make_fake_tensor(Int32, (e, lat // 32, n // 4), (lat // 32 * n // 4, n // 4, 1), assumed_align=16),
        make_fake_tensor(Int32, (e, inter // 16, 2 * lat), (inter // 16 * 2 * lat, 2 * lat, 1), assumed_align=16),
        make_fake_tensor(Int32, (e, inter // 32, lat // 4), (inter // 32 * lat // 4, lat // 4, 1), assumed_align=16),
        make_fake_tensor(Float32, (t, k, lat), (k * lat, lat, 1), assumed_align=16),  # the weighted rows' scratch
        make_fake_tensor(Int32, (p["max_tokens"], kernel.cluster), (kernel.cluster, 1), assumed_align=4),  # counters
        make_fake_tensor(BFloat16, (t, lat), (lat, 1), assumed_align=2),
        make_fake_stream(use_tvm_ffi_env_stream=True))
