"""``expert_down_mxfp4``: stage 2 of the routed experts on MXFP4 weights in Humming's layout.

The math is ``rewriter/model/layers/moe.py:experts_down`` on ``k3::mxfp4_dequant``'s values:

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
  and each CTA pushes its sum of a row to the CTA of the cluster that stores it
  (``common.push_send``): CTA ``rank`` stores rows ``[rank, rank + 1) * 64 / cluster`` of the
  tile.

Programmatic dependent launch: the kernel runs right after ``expert_up_mxfp4``, whose CTAs let it
launch only once their own wait has seen the router finish; so a CTA reads its ids and routing
weight and issues its rows before its wait (which only the activation needs), and those loads
overlap the up stage's tail. It lets the next kernel launch after the wait.

After the per-expert up stage (``k3f::routed_moe_mxfp4``) below ``MXFP4_DOWN_BY_EXPERT_FROM``
tokens its first CTA also puts the router's plan back to zero once past that wait (the up stage,
the plan's last reader, has completed, and this grid reads none of it); from there the down stage
is per chosen expert too (``ExpertDownMxfp4ByExpert``, below).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.common import push_buffers, push_init, push_ready, push_received, push_send, push_total
from codegen.kernels.mxfp4 import (
    DOWN_WARPS_PER_SM,
    DOWN_WARPS_PER_SM_SMEM,
    NO_CARVEOUT_PREFERENCE,
    ORDERS,
    copy_from,
    issue_weights,
    issue_x_pairs,
    load_b,
    load_scales,
    mma_mxfp4,
    scale_pairs,
    staged_words,
    tile_mma,
    warp_registers,
    weight_staging,
)

TILE = 64
MAX_KB_PER_WARP = 14


def check_down_shape(order: str, rows: int, inter: int, inter_live: int) -> None:
    """Both down-stage grids' shape contract: whole 64-row tiles of L, whole scale groups of I."""
    if order not in ORDERS:
        raise ValueError(f"nibble order {order!r}: one of {ORDERS}")
    if rows % TILE:
        raise ValueError(f"L {rows} is not a multiple of {TILE}")
    if inter_live % 32 or not 0 < inter_live <= inter or inter % 16:
        raise ValueError(f"I {inter} / live {inter_live}: live a multiple of 32 (whole scale groups), <= I")


class ExpertDownMxfp4:
    """Compile-time configuration: experts E, slots k, output rows L, I (padded) and I_live, the
    nibble order, the cluster (CTAs splitting a token's slots) and the warps per slot."""

    def __init__(self, *, experts: int, top_k: int, rows: int, inter: int, inter_live: int, order: str,
                 cluster: int, warps_per_slot: int, zero_plan: bool = False, smem_weights: bool = False):
        check_down_shape(order, rows, inter, inter_live)
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
        if const_expr(C > 1):  # each CTA's sums of the tile pushed to the CTA that stores them
            recv, mbar = push_buffers(smem, C, (self.share,))
            push_init(recv, mbar, tidx)
            cute.arch.cluster_arrive_relaxed()
        else:
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
        tile_mma(staged_words(rW, sW, lane, warp, NKB), rS, lambda i: (rB[0, i], rB[1, i]), acc, NKB, self.order)

        if q == 0:
            for i3 in cutlass.range_constexpr(4):
                sPart[i3 * 16 + r, warp] = weight * acc[0, i3]
                sPart[i3 * 16 + 8 + r, warp] = weight * acc[2, i3]
        cute.arch.barrier()
        if const_expr(C > 1):
            push_ready()
        if tidx < TILE:
            total = sPart[tidx, 0]
            for w in cutlass.range_constexpr(1, self.warps):
                total = total + sPart[tidx, w]
            if const_expr(C > 1):  # to the CTA that stores the row
                push_send(recv, mbar, total, (rank, tidx % self.share), tidx // self.share)
            else:
                sTot[tidx] = total
        if const_expr(C == 1):
            cute.arch.barrier()
        if tidx < self.share:
            row = rank * self.share + tidx
            if const_expr(C > 1):
                push_received(mbar)
                total = push_total(recv, (tidx,))
            else:
                total = sTot[row]
            mOut[token, nt * TILE + row] = total.to(BFloat16)

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


class ExpertDownMxfp4ByExpert:
    """The down stage after the per-expert up stage: a CTA per (chosen expert, run of row tiles)
    whose warps each stream their tiles' live K through a ring of ``cp.async`` stages (one scale
    group a stage: 2 weight vectors, the tile's 8 scale bytes, the lane's B pairs of its column's
    activation), so each selected expert's W2 is read once per step, its pairs eight at a time as
    the MMA's 8 N columns.

    - the experts and their pairs: the up stage's records (``mRec``: the chosen count, then
      ``expert + (pairs << 16)`` per entry, written once the up stage had read the plan) and the
      plan's lists; this grid reads no count, so its first CTA, once past its wait (the up stage
      complete), puts the plan's counts back to zero for the next step's router;
    - a warp owns whole 64-row tiles over the whole live K: no reduction across warps or CTAs for
      a pair. At a tile's end each lane stores its C (rows r (+8), columns 2q (+1)) times the
      pairs' routing weights into the fp32 scratch ``mP`` [T, k, L]; the warp then counts each
      pair in at its (token, tile) counter (``mCnt``, zero between steps), and the pair that brings
      a token's k-th sums the token's k rows of the tile in slot order (deterministic whatever the
      lists' order or the arrival order) into the bf16 output and puts the counter back to zero.
      The next tile's first stages are in flight meanwhile.
    """

    COLUMNS = 8
    FIELDS = 4  # 16-byte fields per lane and stage: weights kb0, weights kb1, scales (2 words), x (4 words)

    def __init__(self, *, experts: int, top_k: int, rows: int, inter: int, inter_live: int, order: str,
                 warps: int, tiles_per_warp: int, stages: int, max_tokens: int):
        check_down_shape(order, rows, inter, inter_live)
        self.tiles = rows // TILE
        if warps not in (1, 2, 4) or tiles_per_warp < 1 or self.tiles % (warps * tiles_per_warp):
            raise ValueError(f"{self.tiles} row tiles do not split into CTAs of {warps} warps x {tiles_per_warp}")
        if stages < 1:
            raise ValueError(f"{stages} stages: at least 1")
        self.experts, self.top_k, self.rows = experts, top_k, rows
        self.inter, self.inter_live, self.order = inter, inter_live, order
        self.warps, self.tiles_per_warp = warps, tiles_per_warp
        self.groups = inter_live // 32  # scale groups of a tile's live K
        self.steps = tiles_per_warp * self.groups  # a warp's stages, tile after tile
        self.stages = min(stages, self.steps)
        self.ctas_per_expert = self.tiles // (warps * tiles_per_warp)
        self.pair_cap = max_tokens
        # byte strides of Humming's W2 [E, I/16, 2L] and its scales [E, I/32, L/4] (int32 words)
        self.w_block_bytes = 2 * rows * 4
        self.w_expert_bytes = inter // 16 * self.w_block_bytes
        self.s_expert_bytes = inter // 32 * rows
        self.smem_words = 4 * self.FIELDS * 32 * warps * self.stages
        self.ctas_per_sm = max(1, min(8, 228 * 1024 // (4 * self.smem_words + 1024)))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mCount: cute.Tensor, mChosen: cute.Tensor, mLists: cute.Tensor,
                 mRec: cute.Tensor, mWeights: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mP: cute.Tensor,
                 mCnt: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        entries = cutlass.min(mA.shape[0] * self.top_k, self.experts)
        self.kernel(mA, mCount, mChosen, mLists, mRec, mWeights, mW, mS, mP, mCnt, mOut).launch(
            grid=[entries, self.ctas_per_expert, 1], block=[32 * self.warps, 1, 1], stream=stream, use_pdl=True,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=NO_CARVEOUT_PREFERENCE)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mCount: cute.Tensor, mChosen: cute.Tensor, mLists: cute.Tensor,
               mRec: cute.Tensor, mWeights: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mP: cute.Tensor,
               mCnt: cute.Tensor, mOut: cute.Tensor):
        entry, part, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        r = lane // 4
        q = lane - r * 4
        G, S, N, W, F = (const_expr(v) for v in (self.groups, self.stages, self.COLUMNS, self.warps, self.FIELDS))
        n = const_expr(self.steps)
        nt0 = (part * W + warp) * self.tiles_per_warp  # the warp's first row tile

        smem = SmemAllocator()
        sRing = smem.allocate_tensor(Int32,
                                     cute.make_layout((4, F, 32, W, S), stride=(1, 128, 4, 128 * F, 128 * F * W)),
                                     byte_alignment=16)
        acc = cute.make_rmem_tensor((4, 4), Float32)
        pairs = cute.make_rmem_tensor((2,), Int32)  # the lane's C columns' pairs (-1: none)
        wts = cute.make_rmem_tensor((2,), Float32)  # and their routing weights

        cute.arch.griddepcontrol_wait()  # the records and activations are the up stage's
        chosen = mRec[0]
        if (entry == 0) & (part == 0):  # nothing reads the plan's counts any more: zero for the next step
            for i in cutlass.range(tidx, chosen, 32 * W, unroll=1):
                mCount[mChosen[i]] = Int32(0)
            cute.arch.barrier()  # every thread has read the chosen count
            if tidx == 0:
                mCount[self.experts] = Int32(0)
        if entry < chosen:
            rec = mRec[1 + entry]
            e = cutlass.max(cutlass.min(rec & Int32(0xFFFF), Int32(self.experts - 1)), Int32(0))
            count = cutlass.min(rec >> 16, Int32(self.pair_cap))
            # the lane's byte addresses at the warp's first tile: every stage adds its group's and
            # tile's offsets to these, so no stage recomputes a 64-bit address from indices
            wAddr = mW.iterator.toint() + Int64(e) * self.w_expert_bytes + Int64((nt0 * 32 + lane) * 16)
            sAddr = mS.iterator.toint() + Int64(e) * self.s_expert_bytes + Int64(nt0 * 64 + r * 8)
            for s in cutlass.range_constexpr(S - 1):
                self.issue_weights(wAddr, sAddr, sRing, s // G, s % G, s, lane, warp)
            cute.arch.griddepcontrol_launch_dependents()
            for c0 in cutlass.range(0, count, N, unroll=1):
                if c0 > 0:  # more than 8 pairs: the weights again for the next 8
                    for s in cutlass.range_constexpr(S - 1):
                        self.issue_weights(wAddr, sAddr, sRing, s // G, s % G, s, lane, warp)
                # the lane's B column: pair c0 + r (past the expert's pairs, its last: never stored)
                mine = mLists[e, cutlass.min(c0 + r, count - 1)]
                for h in cutlass.range_constexpr(2):
                    col = c0 + 2 * q + h
                    pairs[h] = Int32(-1)
                    wts[h] = Float32(0.0)
                    if col < count:
                        pairs[h] = mLists[e, col]
                        wts[h] = Float32(mWeights[pairs[h] // self.top_k, pairs[h] % self.top_k])
                xAddr = mA.iterator.toint() + Int64(mine) * (self.inter_live * 2) + Int64(q * 4)
                for s in cutlass.range_constexpr(S - 1):  # group s = stage s (groups complete in order)
                    issue_x_pairs(xAddr, sRing, F - 1, s % G, s, lane, warp)
                    cute.arch.cp_async_commit_group()
                acc.fill(0.0)
                read = Int32(0)
                write = Int32(S - 1)
                for st in cutlass.range(n, unroll=1):
                    nxt = st + (S - 1)
                    if nxt < n:
                        self.issue_weights(wAddr, sAddr, sRing, nxt // G, nxt % G, write, lane, warp)
                        issue_x_pairs(xAddr, sRing, F - 1, nxt % G, write, lane, warp)
                    cute.arch.cp_async_commit_group()  # empty at the end: keeps group st = stage st
                    cute.arch.cp_async_wait_group(S - 1)
                    self.group_mma(sRing, read, lane, warp, acc)
                    write = read
                    read = (read + 1) % S
                    if st % G == G - 1:  # the tile's whole K: its rows out, counted in, and the tokens it completes
                        self.finish_tile(mP, mCnt, mOut, acc, pairs, wts, nt0 + st // G, lane, r, q)
                        acc.fill(0.0)

    def issue_weights(self, wAddr, sAddr, sRing, t, grp, stage, lane, warp):
        """The warp's ``t``-th row tile's weight vectors for the two K blocks of scale group ``grp``
        and its 8 scale bytes of the lane, into ``stage``: from the lane's addresses at the warp's
        first tile (``wAddr``, ``sAddr``) plus the group's and tile's offsets (trace-time helper;
        one commit group with its x)."""
        w = wAddr + Int64(grp * (2 * self.w_block_bytes) + t * 512)
        for blk in range(2):
            copy_from(w + blk * self.w_block_bytes, 4, sRing[None, blk, lane, warp, stage])
        copy_from(sAddr + Int64(grp * self.rows + t * 64), 2,
                  cute.local_tile(sRing[None, 2, lane, warp, stage], (2,), (0,)))

    @cute.jit
    def group_mma(self, sRing: cute.Tensor, stage, lane, warp, acc: cute.Tensor):
        """acc += one scale group of the tile (8 MMAs) from the lane's words in ``stage``."""
        v = cute.make_rmem_tensor((4, self.FIELDS), Int32)
        for f in cutlass.range_constexpr(self.FIELDS):
            cute.autovec_copy(sRing[None, f, lane, warp, stage], v[None, f])
        mult = [scale_pairs(v[h, 2]) for h in range(2)]
        for i3 in cutlass.range_constexpr(4):
            lo, hi = mult[i3 // 2]
            for blk in cutlass.range_constexpr(2):
                c = mma_mxfp4(v[i3, blk], lo, hi, v[blk * 2, 3], v[blk * 2 + 1, 3], [acc[j, i3] for j in range(4)],
                              self.order, i3 % 2)
                for j in cutlass.range_constexpr(4):
                    acc[j, i3] = c[j]

    @cute.jit
    def finish_tile(self, mP, mCnt, mOut, acc, pairs, wts, nt, lane, r, q):
        """Tile ``nt``'s weighted rows of the warp's 8 columns into the scratch; each pair counted
        in at its (token, tile); a token's k-th pair sums its k slots' rows in slot order."""
        k = self.top_k
        for h in cutlass.range_constexpr(2):
            p = pairs[h]
            if p >= 0:
                tp = p // k
                for i3 in cutlass.range_constexpr(4):
                    for half in cutlass.range_constexpr(2):
                        mP[tp, p - tp * k, nt * TILE + i3 * 16 + half * 8 + r] = acc[half * 2 + h, i3] * wts[h]
        cute.arch.fence_acq_rel_gpu()  # this lane's rows visible before its column counts in
        cute.arch.sync_warp()
        # lanes 0..7 count the 8 columns in: column c's pair is pairs[c % 2] of lane c / 2 (q = c / 2)
        p0 = cute.arch.shuffle_sync(pairs[0], (lane // 2) % 4)
        p1 = cute.arch.shuffle_sync(pairs[1], (lane // 2) % 4)
        last = Int32(-1)
        if lane < self.COLUMNS:
            p = cutlass.select_(lane % 2 == 0, p0, p1)
            if p >= 0:
                tp = p // k
                seen = cute.arch.atomic_add(mCnt.iterator + (tp * self.tiles + nt), Int32(1), sem="acq_rel",
                                            scope="gpu")
                if seen == k - 1:
                    last = tp
        cute.arch.sync_warp()  # the counting lanes' acquires before every lane's reads of the rows
        cute.arch.fence_acq_rel_gpu()
        for col in cutlass.range_constexpr(self.COLUMNS):
            tl = cute.arch.shuffle_sync(last, col)
            if tl >= 0:  # the token's k rows of this tile, summed in slot order; its counter back to zero
                for j in cutlass.range_constexpr(TILE // 32):
                    row = nt * TILE + lane + j * 32
                    total = Float32(0.0)
                    for slot in cutlass.range_constexpr(k):
                        total = total + mP[tl, slot, row]
                    mOut[tl, row] = total.to(BFloat16)
                if lane == col:
                    mCnt[tl, nt] = Int32(0)


def build(spec) -> tuple[ExpertDownMxfp4 | ExpertDownMxfp4ByExpert, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size)."""
    s, p = spec.shape_dict, spec.param_dict
    e, k, rows, inter, live = s["experts"], s["top_k"], s["rows"], s["inter"], s["inter_live"]
    t = cute.sym_int32()
    weights = (make_fake_tensor(Int32, (e, inter // 16, 2 * rows), (inter // 16 * 2 * rows, 2 * rows, 1),
                                assumed_align=16),
               make_fake_tensor(Int32, (e, inter // 32, rows // 4), (inter // 32 * rows // 4, rows // 4, 1),
                                assumed_align=16))
    act = make_fake_tensor(Int32, (t, k, live // 2), (k * live // 2, live // 2, 1), assumed_align=16)
    if p.get("by_expert_max_tokens"):
        cap = p["by_expert_max_tokens"]
        kernel = ExpertDownMxfp4ByExpert(experts=e, top_k=k, rows=rows, inter=inter, inter_live=live,
                                         order=p["order"], warps=p["warps"], tiles_per_warp=p["tiles_per_warp"],
                                         stages=p["stages"], max_tokens=cap)
        return kernel, (
            act,
            make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4),  # the plan: counts, chosen, lists
            make_fake_tensor(Int32, (e,), (1,), assumed_align=4),
            make_fake_tensor(Int32, (e, cap), (cap, 1), assumed_align=4),
            make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4),  # the up stage's records
            make_fake_tensor(Float32, (t, k), (k, 1), assumed_align=4),
            *weights,
            make_fake_tensor(Float32, (t, k, rows), (k * rows, rows, 1), assumed_align=16),  # the scratch
            make_fake_tensor(Int32, (cap, rows // TILE), (rows // TILE, 1), assumed_align=4),  # arrival counts
            make_fake_tensor(BFloat16, (t, rows), (rows, 1), assumed_align=2),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    kernel = ExpertDownMxfp4(experts=e, top_k=k, rows=rows, inter=inter, inter_live=live, order=p["order"],
                             cluster=p["cluster"], warps_per_slot=p["warps_per_slot"],
                             zero_plan=bool(p.get("zero_plan")), smem_weights=bool(p.get("smem_weights")))
    args = (act,
            make_fake_tensor(Int64, (t, k), (k, 1), assumed_align=8),
            make_fake_tensor(Float32, (t, k), (k, 1), assumed_align=4),
            *weights,
            make_fake_tensor(BFloat16, (t, rows), (rows, 1), assumed_align=2),
            # after the per-expert up stage: the plan's counts and chosen experts, zeroed here
            *((make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4),
               make_fake_tensor(Int32, (e,), (1,), assumed_align=4)) if p.get("zero_plan") else (None, None)),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
