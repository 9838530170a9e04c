"""``expert_up_mxfp4``: stage 1 of the routed experts on MXFP4 weights in Humming's layout.

The math is ``rewriter/model/layers/moe.py:experts_up`` on ``k3::mxfp4_dequant``'s values:

    g, u       = bf16(<x[t], W13[e, c]>), bf16(<x[t], W13[e, I + c]>)     (fp32 sums)
    a[t, j, c] = bf16(act(g, u)),  e = ids[t, j],  c < I_live

``W13`` int32 [E, L/16, 4I] and its scales [E, L/32, 2I] as vLLM's Humming backend leaves them
(``rewriter/model/layers/experts.py``); only the first ``I_live`` channels of each half are computed
(the rest is vLLM's zero padding: its 64-row tiles are never read), and ``a`` is [T, k, I_live].

Work split (decode reads each selected expert's live rows once; the codes are dequantized in
registers and multiplied on the tensor cores, ``codegen/kernels/mxfp4.py``):
- a CTA takes one (token, slot) pair, one 64-channel tile of it and a ``1 / cluster`` share of
  L; its warps are ``warps_per_tile`` for the gate tile and as many for the up tile, each a
  contiguous run of ``kb_per_warp`` 16-wide K blocks: one 16-byte load per lane per block (the
  tile's 512 bytes), one 8-byte scale load per lane per two blocks, all issued at once and held
  in registers (at L = 3584: 8 CTAs of 4 warps per pair and tile, 14 blocks per warp: small
  CTAs, so that four fit an SM and a whole batch's grid is resident in few waves);
- the MMA is m16n8k16 with the weight rows as M and the token's x as every one of the 8 N
  columns (all lanes read the same x pairs, staged once per CTA in shared memory), so each
  lane's C holds its rows' sums directly;
- the warps' sums meet in shared memory; each CTA then pushes its sums of a channel to the
  CTA of the cluster that finishes it (``common.push_send``: ``st.async`` counted on that
  CTA's mbarrier, no cluster barrier after the work): CTA ``rank`` finishes channels
  ``[rank, rank + 1) * 64 / cluster``.

Programmatic dependent launch: the rows depend on the router's ids, so a CTA waits first,
reads its id, issues its loads and then lets the next kernel launch.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.common import gated_act, push_buffers, push_init, push_ready, push_received, push_send, push_total
from codegen.kernels.mxfp4 import (
    NO_CARVEOUT_PREFERENCE,
    ORDERS,
    UP_WARPS_PER_SM,
    UP_WARPS_PER_SM_SMEM,
    copy_from,
    issue_weights,
    issue_x_pairs,
    load_scales,
    mma_mxfp4,
    scale_pairs,
    staged_words,
    tile_mma,
    warp_registers,
    weight_staging,
)

TILE = 64  # rows per Humming tile
MAX_KB_PER_WARP = 14  # 16-byte weight loads per lane held in registers at once


class ExpertUpMxfp4:
    """Compile-time configuration: experts E, slots k, L, I (padded) and I_live, the activation
    (``beta`` None: SiLU-and-mul), the nibble order, the cluster (CTAs sharing a pair's K) and
    the warps per tile."""

    def __init__(self, *, experts: int, top_k: int, latent: int, inter: int, inter_live: int, beta: float | None,
                 linear_beta: float | None, order: str, cluster: int, warps_per_tile: int, smem_weights: bool = False):
        self.smem_weights = smem_weights  # the weights staged in shared memory (``mxfp4.weight_staging``)
        if order not in ORDERS:
            raise ValueError(f"nibble order {order!r}: one of {ORDERS}")
        if inter % TILE or inter_live % TILE or not 0 < inter_live <= inter:
            raise ValueError(f"I {inter} / live {inter_live}: multiples of {TILE}, live <= I")
        kb = latent // 16
        if latent % 32 or kb % (cluster * warps_per_tile):
            raise ValueError(f"L {latent}: {kb} K blocks do not split over {cluster} CTAs x {warps_per_tile} warps")
        self.kb_per_warp = kb // (cluster * warps_per_tile)
        if self.kb_per_warp % 2 or self.kb_per_warp > MAX_KB_PER_WARP:
            raise ValueError(f"{self.kb_per_warp} K blocks per warp: even (whole scale groups), at most "
                             f"{MAX_KB_PER_WARP}")
        if cluster not in (1, 2, 4, 8) or TILE % cluster:
            raise ValueError(f"cluster {cluster}: 1, 2, 4 or 8")
        self.experts, self.top_k, self.latent = experts, top_k, latent
        self.inter, self.inter_live = inter, inter_live
        self.beta = None if beta is None else float(beta)
        self.linear_beta = None if linear_beta is None or beta is None else float(linear_beta)
        self.order, self.cluster, self.warps_per_tile = order, cluster, warps_per_tile
        self.warps = 2 * warps_per_tile
        self.ctiles = inter_live // TILE
        self.up_tile0 = inter // TILE  # the up half's first tile
        self.share = TILE // cluster  # channels each CTA of a cluster finishes
        self.x_words = warps_per_tile * self.kb_per_warp * 8  # x's bf16 pairs in the CTA's share of L
        self.warps_per_sm = UP_WARPS_PER_SM_SMEM if smem_weights else UP_WARPS_PER_SM

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mA: cute.Tensor,
                 stream: cuda.CUstream):
        pairs = mIds.shape[0] * self.top_k
        cluster = [self.cluster, 1, 1] if const_expr(self.cluster > 1) else None
        self.kernel(mX, mIds, mW, mS, mA).launch(grid=[pairs * self.cluster, self.ctiles, 1],
                                                 block=[32 * self.warps, 1, 1], cluster=cluster, stream=stream,
                                                 use_pdl=True,
                                                 min_blocks_per_mp=max(1, self.warps_per_sm // self.warps),
                                                 preferred_smem_carveout=NO_CARVEOUT_PREFERENCE)

    def roles(self, ctile, rank, lane):
        """A thread's place (trace-time helper): its warp, the warp's half (0 the gate tile, 1 the
        up tile), its slice of the half's warps, the Humming tile it reads, its first K block,
        and the lane's MMA row group r and pair q."""
        warp = cute.arch.warp_idx()
        half = warp // self.warps_per_tile
        wslice = warp - half * self.warps_per_tile
        r = lane // 4
        return (warp, half, wslice, ctile + half * self.up_tile0,
                (rank * self.warps_per_tile + wslice) * self.kb_per_warp, r, lane - r * 4)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mA: cute.Tensor):
        bidx, ctile, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        C = const_expr(self.cluster)
        NKB = const_expr(self.kb_per_warp)
        rank = bidx % C
        pair = bidx // C
        token = pair // self.top_k
        slot = pair - token * self.top_k
        warp, half, wslice, nt, kb0, r, q = self.roles(ctile, rank, lane)

        rS, acc = warp_registers(NKB)
        smem = SmemAllocator()
        rW, sW = weight_staging(self.smem_weights, smem, NKB, self.warps)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((TILE, self.warps_per_tile, 2)), byte_alignment=16)
        sX = smem.allocate_tensor(Int32, cute.make_layout((self.x_words,)), byte_alignment=16)
        if const_expr(C > 1):  # each CTA's sums of the tile pushed to the CTA that finishes them
            recv, mbar = push_buffers(smem, C, (self.share, 2))
            push_init(recv, mbar, tidx)
            cute.arch.cluster_arrive_relaxed()
        else:
            sTot = smem.allocate_tensor(Float32, cute.make_layout((TILE, 2)), byte_alignment=16)

        cute.arch.griddepcontrol_wait()
        # the router's id; one out of range would read past the weights: clamp it
        e = Int64(cutlass.max(cutlass.min(Int32(mIds[token, slot]), Int32(self.experts - 1)), Int32(0)))
        issue_weights(mW, rW, sW, e, kb0, NKB, nt, lane, warp)
        load_scales(mS, rS, e, kb0 // 2, NKB // 2, nt, r)
        # after the loads: ptxas moves no load across it, so they are all in flight at once
        cute.arch.griddepcontrol_launch_dependents()
        # the CTA's share of x, staged once (the gate and the up warps read the same pairs)
        x0 = rank * self.x_words
        for j in cutlass.range_constexpr(-(-self.x_words // (32 * self.warps))):
            i = tidx + j * 32 * self.warps
            if const_expr(self.x_words % (32 * self.warps) == 0) or i < self.x_words:
                sX[i] = mX[token, x0 + i]
        cute.arch.barrier()
        base = (kb0 - rank * self.warps_per_tile * NKB) * 8 + q
        tile_mma(staged_words(rW, sW, lane, warp, NKB), rS, lambda i: (sX[base + i * 8], sX[base + i * 8 + 4]),
                 acc, NKB, self.order)

        # every C column is this token: lanes q = 0 hold rows 16 i3 + r (c0) and 16 i3 + 8 + r (c2)
        if q == 0:
            for i3 in cutlass.range_constexpr(4):
                sPart[i3 * 16 + r, wslice, half] = acc[0, i3]
                sPart[i3 * 16 + 8 + r, wslice, half] = acc[2, i3]
        cute.arch.barrier()
        if const_expr(C > 1):
            push_ready()
        # the (row, half) sums: 2 x 64 of them, more than the threads when warps_per_tile is 1;
        # in a cluster, each to the CTA that finishes its channel
        for j in cutlass.range_constexpr(-(-2 * TILE // (32 * self.warps))):
            i = tidx + j * 32 * self.warps
            if i < 2 * TILE:
                row = i % TILE
                h = i // TILE
                total = sPart[row, 0, h]
                for w in cutlass.range_constexpr(1, self.warps_per_tile):
                    total = total + sPart[row, w, h]
                if const_expr(C > 1):
                    push_send(recv, mbar, total, (rank, row % self.share, h), row // self.share)
                else:
                    sTot[row, h] = total
        if const_expr(C == 1):
            cute.arch.barrier()
        if tidx < self.share:
            ch = rank * self.share + tidx
            if const_expr(C > 1):
                push_received(mbar)
                gate, up = push_total(recv, (tidx, 0)), push_total(recv, (tidx, 1))
            else:
                gate, up = sTot[ch, 0], sTot[ch, 1]
            a = gated_act(gate, up, self.beta, self.linear_beta)
            mA[token, slot, ctile * TILE + ch] = a.to(BFloat16)


class ExpertUpMxfp4ByExpert:
    """The up stage with a CTA per (chosen expert, 64-channel tile) that streams the tile's whole K
    through a ring of ``cp.async`` stages: each selected expert's tile is read and dequantized once
    per step, however many of the step's tokens chose it (at 64 tokens x 16 slots of 896 experts,
    about 610 experts for 1024 pairs), its pairs eight at a time as the MMA's 8 N columns.

    Why this shape (the per-pair kernel's CTAs load, then compute, then reduce across a cluster;
    grouped that way per expert they did not pay, ``docs/CODEGEN.md``): here a CTA keeps
    ``stages - 1`` scale groups of loads in flight while it multiplies one, and its only reduction
    is the warps' sums once at the end, in shared memory; no cluster.

    - the experts and their pairs come from the routing plan that ``router_topk`` filed
      (``RouterTopkPlan``: the chosen experts' count and list, each expert's count and pairs): a
      CTA reads its entry's expert and issues that expert's first stages of weights at once, then
      its pairs' x; the grid has min(E, T k) entries, and those past the chosen count exit;
    - warp w takes the w-th quarter of L (gate and up tiles both), one scale group (two 16-wide K
      blocks) per stage: per lane 4 weight vectors, the two tiles' 8 scale bytes and the lane's B
      pairs of x (column r = lane / 4 is pair c0 + r); each lane copies and reads back only its
      own words, so the ring needs no barrier;
    - every lane's C is useful: rows r (+8) x columns 2q (+1); the warps' sums meet in shared
      memory (the ring's bytes), then a thread per (channel, column) applies the activation.
    - its (entry, tile 0) CTA records the entry's expert and pair count (``mRec``: the chosen
      count, then ``expert + (pairs << 16)`` per entry) for the per-expert down stage, which reads
      those instead of the plan's counts and so can zero the counts once this grid has completed.
    """

    COLUMNS = 8  # the MMA's N: one pair of the expert per column
    FIELDS = 6  # 16-byte fields per lane and stage: gate kb0, gate kb1, up kb0, up kb1, scales, x
    PART_STRIDE = TILE + 4  # the warps' sums: a column's 64 rows, 4 words apart mod 32 (no bank conflicts)

    def __init__(self, *, experts: int, top_k: int, latent: int, inter: int, inter_live: int, beta: float | None,
                 linear_beta: float | None, order: str, warps: int, stages: int, max_tokens: int):
        if order not in ORDERS:
            raise ValueError(f"nibble order {order!r}: one of {ORDERS}")
        if inter % TILE or inter_live % TILE or not 0 < inter_live <= inter:
            raise ValueError(f"I {inter} / live {inter_live}: multiples of {TILE}, live <= I")
        kb = latent // 16
        if latent % 32 or warps not in (1, 2, 4) or kb % (2 * warps):
            raise ValueError(f"L {latent}: {kb} K blocks do not split into scale groups over {warps} warps")
        if stages < 1:
            raise ValueError(f"{stages} stages: at least 1")
        self.experts, self.top_k, self.latent = experts, top_k, latent
        self.inter, self.inter_live = inter, inter_live
        self.beta = None if beta is None else float(beta)
        self.linear_beta = None if linear_beta is None or beta is None else float(linear_beta)
        self.order, self.warps = order, warps
        self.groups = kb // (2 * warps)  # scale groups per warp
        self.stages = min(stages, self.groups)
        self.ctiles = inter_live // TILE
        self.up_tile0 = inter // TILE  # the up half's first tile
        # an expert's pairs in one step: one per token at most (a token's top-k ids are distinct)
        self.pair_cap = max_tokens
        # byte strides of Humming's W13 [E, L/16, 4I] and its scales [E, L/32, I/2] (int32 words)
        self.w_block_bytes = 4 * inter * 4
        self.w_expert_bytes = latent // 16 * self.w_block_bytes
        self.s_group_bytes = inter // 2 * 4
        self.s_expert_bytes = latent // 32 * self.s_group_bytes
        ring = 4 * self.FIELDS * 32 * warps * self.stages
        part = self.PART_STRIDE * self.COLUMNS * warps * 2
        self.smem_words = max(ring, part)
        # as many CTAs per SM as the shared memory holds (228 KB, 1 KB reserved per CTA), for ptxas
        self.ctas_per_sm = max(1, min(8, 228 * 1024 // (4 * self.smem_words + 1024)))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mCount: cute.Tensor, mChosen: cute.Tensor, mLists: cute.Tensor,
                 mRec: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mA: cute.Tensor, stream: cuda.CUstream):
        entries = cutlass.min(mA.shape[0] * self.top_k, self.experts)
        self.kernel(mX, mCount, mChosen, mLists, mRec, mW, mS, mA).launch(
            grid=[entries, self.ctiles, 1], block=[32 * self.warps, 1, 1], stream=stream, use_pdl=True,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=NO_CARVEOUT_PREFERENCE)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mCount: cute.Tensor, mChosen: cute.Tensor, mLists: cute.Tensor,
               mRec: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mA: cute.Tensor):
        entry, ctile, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        r = lane // 4
        q = lane - r * 4
        G, S, N, W, F = (const_expr(v) for v in (self.groups, self.stages, self.COLUMNS, self.warps, self.FIELDS))

        smem = SmemAllocator()
        buf = smem.allocate_tensor(Int32, cute.make_layout((self.smem_words,)), byte_alignment=16)
        # [word, field, lane, warp, stage]: a warp's 16-byte vectors of one field contiguous
        sRing = cute.make_tensor(buf.iterator, cute.make_layout(
            (4, F, 32, W, S), stride=(1, 128, 4, 128 * F, 128 * F * W)))
        # after the K loop the same bytes hold the warps' sums [row, column, warp, half]
        PS = const_expr(self.PART_STRIDE)
        sPart = cute.make_tensor(cute.recast_ptr(buf.iterator, dtype=Float32), cute.make_layout(
            (TILE, N, W, 2), stride=(1, PS, PS * N, PS * N * W)))
        acc = cute.make_rmem_tensor((4, 4, 2), Float32)  # [C register, subtile, half]

        cute.arch.griddepcontrol_wait()  # the plan is the router's
        chosen = mCount[self.experts]
        if entry < chosen:
            # the expert (one out of range would read past the weights: clamped), its first stages at once
            e = cutlass.max(cutlass.min(mChosen[entry], Int32(self.experts - 1)), Int32(0))
            count = cutlass.min(mCount[e], Int32(self.pair_cap))
            if (ctile == 0) & (tidx == 0):  # the records the down stage reads instead of the counts
                mRec[1 + entry] = e | (count << 16)
                if entry == 0:
                    mRec[0] = chosen
            g0 = warp * G  # the warp's first scale group
            # the lane's byte addresses at the warp's first group of the gate tile: every stage adds
            # its group's offset (and the up tile's) to these, so no stage recomputes a 64-bit
            # address from indices
            wAddr = (mW.iterator.toint() + Int64(e) * self.w_expert_bytes
                     + Int64(g0 * 2 * self.w_block_bytes + (ctile * 32 + lane) * 16))
            sAddr = (mS.iterator.toint() + Int64(e) * self.s_expert_bytes
                     + Int64(g0 * self.s_group_bytes + ctile * 64 + r * 8))
            for s in cutlass.range_constexpr(S - 1):
                self.issue_weights(wAddr, sAddr, sRing, s, s, lane, warp)
            cute.arch.griddepcontrol_launch_dependents()
            for c0 in cutlass.range(0, count, N, unroll=1):
                if c0 > 0:  # more than 8 pairs: the weights again for the next 8
                    for s in cutlass.range_constexpr(S - 1):
                        self.issue_weights(wAddr, sAddr, sRing, s, s, lane, warp)
                # the lane's column: pair c0 + r (past the expert's pairs, its last: sums never stored)
                pair = mLists[e, cutlass.min(c0 + r, count - 1)]
                token = pair // self.top_k
                xAddr = mX.iterator.toint() + Int64(token) * (self.latent * 2) + Int64(g0 * 64 + q * 4)
                for s in cutlass.range_constexpr(S - 1):  # group s = stage s (groups complete in order)
                    issue_x_pairs(xAddr, sRing, F - 1, s, s, lane, warp)
                    cute.arch.cp_async_commit_group()
                acc.fill(0.0)
                read = Int32(0)  # stage holding group g
                write = Int32(S - 1)  # stage receiving group g + S - 1 (the one read at g - 1)
                for g in cutlass.range(G, unroll=1):
                    if g + (S - 1) < G:
                        self.issue_weights(wAddr, sAddr, sRing, g + (S - 1), write, lane, warp)
                        issue_x_pairs(xAddr, sRing, F - 1, g + (S - 1), write, lane, warp)
                    cute.arch.cp_async_commit_group()  # empty at the end: keeps group g = stage g
                    cute.arch.cp_async_wait_group(S - 1)
                    self.group_mma(sRing, read, lane, warp, acc)
                    write = read
                    read = (read + 1) % S
                self.finish(mLists, mA, sPart, acc, e, c0, count, ctile, tidx, warp, r, q)

    def issue_weights(self, wAddr, sAddr, sRing, g, stage, lane, warp):
        """The warp's ``g``-th scale group's weight vectors (gate and up, two K blocks) and the
        two tiles' 8 scale bytes of the lane into ``stage``: from the lane's addresses at the
        warp's first group (``wAddr``, ``sAddr``) plus the group's and the up tile's offsets
        (trace-time helper; one commit group with its x)."""
        w = wAddr + Int64(g * (2 * self.w_block_bytes))
        sc = sAddr + Int64(g * self.s_group_bytes)
        for h in range(2):
            for blk in range(2):
                copy_from(w + (h * self.up_tile0 * 512 + blk * self.w_block_bytes), 4,
                          sRing[None, h * 2 + blk, lane, warp, stage])
            copy_from(sc + h * self.up_tile0 * 64, 2, cute.local_tile(sRing[None, 4, lane, warp, stage], (2,), (h,)))

    @cute.jit
    def group_mma(self, sRing: cute.Tensor, stage, lane, warp, acc: cute.Tensor):
        """acc += one scale group of both tiles (16 MMAs) from the lane's words in ``stage``."""
        v = cute.make_rmem_tensor((4, self.FIELDS), Int32)
        for f in cutlass.range_constexpr(self.FIELDS):
            cute.autovec_copy(sRing[None, f, lane, warp, stage], v[None, f])
        for h in cutlass.range_constexpr(2):
            mult = [scale_pairs(v[h * 2 + word, 4]) for word in range(2)]
            for i3 in cutlass.range_constexpr(4):
                # subtile i3's multipliers, rows r and r + 8 (half i3 % 2 of the tile's scale word i3 / 2's pairs)
                lo, hi = mult[i3 // 2]
                for blk in cutlass.range_constexpr(2):
                    c = mma_mxfp4(v[i3, h * 2 + blk], lo, hi, v[blk * 2, 5], v[blk * 2 + 1, 5],
                                  [acc[j, i3, h] for j in range(4)], self.order, i3 % 2)
                    for j in cutlass.range_constexpr(4):
                        acc[j, i3, h] = c[j]

    @cute.jit
    def finish(self, mLists, mA, sPart, acc, e, c0, count, ctile, tidx, warp, r, q):
        """The warps' sums of columns ``c0 ..`` through shared memory (the ring's bytes, once every
        warp is done with them), then the activations of the expert's pairs among them."""
        cute.arch.barrier()
        # C: rows 16 i3 + r (+8 for c2, c3), columns 2q (+1 for c1, c3)
        for h in cutlass.range_constexpr(2):
            for i3 in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(4):
                    sPart[i3 * 16 + (j // 2) * 8 + r, 2 * q + j % 2, warp, h] = acc[j, i3, h]
        cute.arch.barrier()
        threads = 32 * self.warps
        outs = TILE * self.COLUMNS
        for j in cutlass.range_constexpr(-(-outs // threads)):
            i = tidx + j * threads
            row = i % TILE
            col = i // TILE
            if (const_expr(outs % threads == 0) or i < outs) and c0 + col < count:
                gate = sPart[row, col, 0, 0]
                up = sPart[row, col, 0, 1]
                for w in cutlass.range_constexpr(1, self.warps):
                    gate = gate + sPart[row, col, w, 0]
                    up = up + sPart[row, col, w, 1]
                pair = mLists[e, c0 + col]
                token = pair // self.top_k
                a = gated_act(gate, up, self.beta, self.linear_beta)
                mA[token, pair - token * self.top_k, ctile * TILE + row] = a.to(BFloat16)
        cute.arch.barrier()  # the next columns' copies overwrite these sums


def build(spec) -> tuple[ExpertUpMxfp4, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size: one compile serves every batch; with ``by_expert_max_tokens`` the
    per-expert grid, for up to that many tokens)."""
    s, p = spec.shape_dict, spec.param_dict
    e, k, lat, inter, live = s["experts"], s["top_k"], s["latent"], s["inter"], s["inter_live"]
    common = dict(experts=e, top_k=k, latent=lat, inter=inter, inter_live=live, beta=p["beta"],
                  linear_beta=p["linear_beta"], order=p["order"])
    by_expert = p.get("by_expert_max_tokens")
    if by_expert:
        kernel = ExpertUpMxfp4ByExpert(max_tokens=by_expert, warps=p["warps"], stages=p["stages"], **common)
    else:
        kernel = ExpertUpMxfp4(cluster=p["cluster"], warps_per_tile=p["warps_per_tile"],
                               smem_weights=bool(p.get("smem_weights")), **common)
    t = cute.sym_int32()
    n = 2 * inter
    x = make_fake_tensor(Int32, (t, lat // 2), (lat // 2, 1), assumed_align=16)
    weights = (make_fake_tensor(Int32, (e, lat // 16, 2 * n), (lat // 16 * 2 * n, 2 * n, 1), assumed_align=16),
               make_fake_tensor(Int32, (e, lat // 32, n // 4), (lat // 32 * n // 4, n // 4, 1), assumed_align=16))
    act = make_fake_tensor(BFloat16, (t, k, live), (k * live, live, 1), assumed_align=2)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if not by_expert:
        return kernel, (x, make_fake_tensor(Int64, (t, k), (k, 1), assumed_align=8), *weights, act, stream)
    # the plan: counts [E + 1], chosen [E], lists [E, cap]; the records for the down stage [E + 1]
    plan = (make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4),
            make_fake_tensor(Int32, (e,), (1,), assumed_align=4),
            make_fake_tensor(Int32, (e, by_expert), (by_expert, 1), assumed_align=4),
            make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4))
    return kernel, (x, *plan, *weights, act, stream)
