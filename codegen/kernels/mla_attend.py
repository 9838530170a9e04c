"""``mla_attend``: MLA decode attention over vLLM's paged latent cache, W_UV and the sigmoid
output gate in one kernel (``k3f::mla_attend``; one token per request).

The math is ``rewriter/layers/mla.py:mla_attend`` (``k3::mla_decode`` then W_UV and the gate),
per request ``b`` with ``n = seq_lens[b]`` cached entries (the current token's included), head
``h`` (L = 512 latent values, R = 64 rope values, E = L + R per cache entry):
    s_j    = (q[b, h] . e_j) * scale              (e_j: entry j, fp32; fp8: E4M3 x kv_scale)
    lat    = bf16(softmax(s) @ e[:, :L])           (0 for a padding request, n = 0)
    o      = bf16(lat @ W_UV[h]^T)                 (W_UV[h]: rows h*256+128 .. h*256+256 of kv_b)
    out    = bf16(o * bf16(sigmoid(gate[b, h*128 : (h+1)*128])))

Work split: a grid of ``B x S`` CTAs (S context splits per request, ``B x S <= 128`` so that the
whole grid is resident at once on any Hopper or Blackwell part: the launcher checks the SM
count), 256 threads, three phases separated by two grid-wide barriers:
1. split ``s`` of request ``b`` walks its share of the context in tiles of 32 (bf16) or 64
   (fp8) entries: the tile's entries (block table lookups, 128-bit loads; the next tile's
   loads are issued before the current one is computed) go to shared memory; scores: warp
   ``w`` takes entry values [72w, 72w + 72) of every entry (one entry per lane) against the
   queries (fp32 in shared memory, pre-scaled by scale x log2(e), broadcast reads), the 8
   partial sums meet in shared memory; online softmax in base 2, one warp per head; P x V:
   thread ``i`` owns 8 latent values (``i % 64``) of the heads ``h = i // 64 (mod 4)`` in
   fp32 registers. The split's (max, sum, unnormalized latent) go to a global scratch.
2. after the first barrier, a group of lanes (as many as splits, at most 32) combines the
   splits of one (request, head, 8 values) unit, each lane a share of the splits, a butterfly
   over the group, and writes the bf16 latent to a second scratch;
3. after the second barrier, warps take rows of W_UV (loaded before ``griddepcontrol.wait``:
   weights only) for every request, a 32-lane butterfly per (row, request), one lane gates
   and stores.

The barrier is a sense-reversing one on two int32 words (count, generation) that ends with the
count back at 0, so the scratch serves every launch (and every MLA layer, which run in turn).
PDL: ``griddepcontrol.launch_dependents`` only after the first barrier, when every CTA is
resident; a dependent launched earlier could take the SMs some CTAs still wait for.
"""
from __future__ import annotations

import math
import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom, r2g_atom

L, R, V_DIM, HEAD_ROWS = 512, 64, 128, 256  # latent, rope, value dim, kv_b rows per head
E = L + R
THREADS = 256
WARPS = THREADS // 32
MAX_CTAS = 128
MAX_BATCH = 64
TILE = {"bf16": 32, "fp8_e4m3": 64}  # entries per tile: 36 KB of shared memory either way
ELEMS = 8  # values per vector: 128 bits of bf16, 64 bits of fp8
DIM_VECS = E // ELEMS // WARPS  # score: vectors of entry values per warp (9)
LAT_VECS = L // ELEMS  # 64 vectors of latent values
HEAD_GROUPS = THREADS // LAT_VECS  # 4
LOG2E = 1.0 / math.log(2.0)
NEG_INF = float("-inf")


def splits_for(batch: int) -> int:
    """Context splits per request: the grid fills up to ``MAX_CTAS``."""
    return max(1, MAX_CTAS // batch)


class MlaAttend:
    """Compile-time configuration: requests B (= tokens), heads H, the cache dtype (bf16 or
    fp8), the softmax scale, the gate's row stride."""

    def __init__(self, batch: int, heads: int, cache: str, scale: float, gate_stride: int):
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch {batch} outside 1..{MAX_BATCH}")
        if cache not in TILE:
            raise ValueError(f"cache {cache!r}: bf16 or fp8_e4m3")
        self.batch, self.heads, self.cache = batch, heads, cache
        self.splits = splits_for(batch)
        self.ctas = batch * self.splits
        self.scale = float(scale)
        self.gate_stride = gate_stride
        self.tile = TILE[cache]
        self.slots = self.tile // 32  # entries per lane in the score phase
        self.vec_bytes = 16
        self.entry_vecs = E * (2 if cache == "bf16" else 1) // self.vec_bytes  # 16-byte vectors per entry
        self.loads = self.tile * self.entry_vecs // THREADS  # 16-byte tile loads per thread (9)
        self.row = E + (8 if cache == "bf16" else 16)  # padded shared-memory row (elements)
        self.heads_per_thread = -(-heads // HEAD_GROUPS)
        self.rows = heads * V_DIM  # W_UV rows
        self.rows_per_cta = -(-self.rows // self.ctas)
        self.rows_per_warp = -(-self.rows_per_cta // WARPS)
        self.units = batch * heads * LAT_VECS  # combine units
        self.combine_lanes = min(32, 1 << (self.splits - 1).bit_length())  # lanes sharing a unit's splits
        self.dtype = BFloat16 if cache == "bf16" else Float8E4M3FN

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
                 mKvScale: cute.Tensor, mW: cute.Tensor, mGate: cute.Tensor, mOut: cute.Tensor,
                 mPAcc: cute.Tensor, mPML: cute.Tensor, mLat: cute.Tensor, mBar: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mQ, mCache, mBT, mSeq, mKvScale, mW, mGate, mOut, mPAcc, mPML, mLat, mBar).launch(
            grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
               mKvScale: cute.Tensor, mW: cute.Tensor, mGate: cute.Tensor, mOut: cute.Tensor,
               mPAcc: cute.Tensor, mPML: cute.Tensor, mLat: cute.Tensor, mBar: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        RPW = const_expr(self.rows_per_warp)

        # 0. before the wait (PDL): this warp's W_UV rows, 2 vectors per lane and row
        rW = cute.make_rmem_tensor((VEC, 2, RPW), BFloat16)
        for r in cutlass.range_constexpr(RPW):
            n = cutlass.min(self.warp_row(cta, warp, r), self.rows - 1)
            wrow = mW[n // V_DIM * HEAD_ROWS + V_DIM + n % V_DIM, None]
            for u in cutlass.range_constexpr(2):
                cute.copy(g2r_stream_atom(BFloat16), cute.local_tile(wrow, (VEC,), (u * 32 + lane,)), rW[None, u, r])
        cute.arch.griddepcontrol_wait()

        # 1. this split's share of the context
        self.attend(mQ, mCache, mBT, mSeq, mKvScale, mPAcc, mPML, cta, tidx, lane, warp)
        self.grid_sync(mBar, tidx)
        cute.arch.griddepcontrol_launch_dependents()

        # 2. the splits combined: unit (request, head, 8 latent values) per thread
        kv_scale = Float32(1.0)
        if const_expr(self.cache == "fp8_e4m3"):
            kv_scale = mKvScale[0]
        G = const_expr(self.combine_lanes)
        for first in cutlass.range((cta * WARPS + warp) * (32 // G), self.units, self.ctas * WARPS * (32 // G),
                                   unroll=1):
            self.combine(mPAcc, mPML, mLat, first + lane // G, lane % G, kv_scale)
        self.grid_sync(mBar, tidx)

        # 3. W_UV rows and the gate, every request
        rL = cute.make_rmem_tensor((VEC,), BFloat16)
        for r in cutlass.range_constexpr(RPW):
            n = self.warp_row(cta, warp, r)
            if self.owns(warp, r, n):
                h = n // V_DIM
                for b in cutlass.range(self.batch, unroll=4):
                    acc = Float32(0.0)
                    for u in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(mLat[b, h, None], (VEC,), (u * 32 + lane,)), rL)
                        acc = acc + (rL.load().to(Float32) * rW[None, u, r].load().to(Float32)).reduce(
                            cute.ReductionOp.ADD, Float32(0.0), 0)
                    acc = cute.arch.warp_reduction(acc, operator.add)
                    if lane == 0:
                        g = mGate[b, n].to(Float32)
                        sig = (Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))).to(BFloat16).to(Float32)
                        mOut[b, n] = (acc.to(BFloat16).to(Float32) * sig).to(BFloat16)

    def warp_row(self, cta, warp, r):
        """W_UV row (head x 128 + v) that warp ``warp`` of CTA ``cta`` takes ``r``-th (past the
        CTA's share when ``r * 8 + warp >= rows_per_cta``: see ``owns``)."""
        return cta * self.rows_per_cta + r * WARPS + warp

    def owns(self, warp, r, n):
        return (r * WARPS + warp < self.rows_per_cta) & (n < self.rows)

    @cute.jit
    def grid_sync(self, mBar: cute.Tensor, tidx):
        """Every CTA of the grid has reached this point, its global writes visible to all."""
        cute.arch.barrier()
        if tidx == 0:
            count = mBar.iterator
            gen = mBar.iterator + 1
            cute.arch.fence_acq_rel_gpu()
            seen = cute.arch.load(gen, Int32, sem="relaxed", scope="gpu")
            arrived = cute.arch.atomic_add(count, Int32(1), sem="acq_rel", scope="gpu")
            if arrived == self.ctas - 1:
                cute.arch.store(count, Int32(0), sem="relaxed", scope="gpu")
                cute.arch.atomic_add(gen, Int32(1), sem="release", scope="gpu")
            else:
                now = cute.arch.load(gen, Int32, sem="acquire", scope="gpu")
                while now == seen:
                    now = cute.arch.load(gen, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()

    @cute.jit
    def attend(self, mQ, mCache, mBT, mSeq, mKvScale, mPAcc, mPML, cta, tidx, lane, warp):
        H = const_expr(self.heads)
        T = const_expr(self.tile)
        TS = const_expr(self.slots)
        HPT = const_expr(self.heads_per_thread)
        b = cta // self.splits
        split = cta % self.splits

        smem = cutlass.memory.SmemAllocator()
        sK = smem.allocate_tensor(self.dtype, cute.make_layout((T, E), stride=(self.row, 1)), byte_alignment=16)
        sQ = smem.allocate_tensor(Float32, cute.make_layout((H, E), stride=(E, 1)), byte_alignment=16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((WARPS, H, T)), byte_alignment=16)
        sP = smem.allocate_tensor(Float32, cute.make_layout((H, T)), byte_alignment=16)
        sStat = smem.allocate_tensor(Float32, cute.make_layout((3, H)), byte_alignment=16)  # max, sum, correction

        # the queries, fp32, pre-scaled into base-2 logits (fp8: times kv_scale)
        q_scale = Float32(self.scale * LOG2E)
        if const_expr(self.cache == "fp8_e4m3"):
            q_scale = q_scale * mKvScale[0]
        rQ = cute.make_rmem_tensor((VEC, -(-H * E // VEC // THREADS)), BFloat16)
        for j in cutlass.range_constexpr(-(-H * E // VEC // THREADS)):  # every load in flight at once
            i = cutlass.min(tidx + j * THREADS, H * E // VEC - 1)
            cute.copy(g2r_atom(BFloat16, invariant=False),
                      cute.local_tile(mQ[b, i // (E // VEC), None], (VEC,), (i % (E // VEC),)), rQ[None, j])
        for j in cutlass.range_constexpr(-(-H * E // VEC // THREADS)):
            i = cutlass.min(tidx + j * THREADS, H * E // VEC - 1)
            cute.local_tile(sQ[i // (E // VEC), None], (VEC,), (i % (E // VEC),)).store(
                rQ[None, j].load().to(Float32) * q_scale)
        if tidx < H:
            sStat[0, tidx] = Float32(NEG_INF)
            sStat[1, tidx] = Float32(0.0)

        n = mSeq[b]
        per = (n + self.splits - 1) // self.splits
        per = (per + T - 1) // T * T
        start = cutlass.min(split * per, n)
        end = cutlass.min(start + per, n)
        tiles = (end - start + T - 1) // T

        rAcc = cute.make_rmem_tensor((ELEMS, HPT), Float32)
        rAcc.fill(0.0)
        rNext = cute.make_rmem_tensor((16 // (self.dtype.width // 8), self.loads), self.dtype)
        if tiles > 0:
            self.load_tile(mCache, mBT, rNext, b, start, end, tidx)
        dv = tidx % LAT_VECS
        group = tidx // LAT_VECS
        rV = cute.make_rmem_tensor((ELEMS,), self.dtype)
        rK = cute.make_rmem_tensor((ELEMS,), self.dtype)
        rS = cute.make_rmem_tensor((H, TS), Float32)
        for tile in cutlass.range(tiles, unroll=1):
            base = start + tile * T
            cute.arch.barrier()  # the previous tile is no longer read (and sQ, sStat are written)
            self.store_tile(sK, rNext, tidx)
            cute.arch.barrier()
            if tile + 1 < tiles:
                self.load_tile(mCache, mBT, rNext, b, base + T, end, tidx)

            # scores: warp w, entry values [72w, 72w + 72), entry lane + 32 x slot
            rS.fill(0.0)
            for c in cutlass.range_constexpr(DIM_VECS):
                col = (warp * DIM_VECS + c) * ELEMS
                ks = []
                for s in cutlass.range_constexpr(TS):
                    cute.autovec_copy(cute.local_tile(sK[lane + 32 * s, None], (ELEMS,), (col // ELEMS,)), rK)
                    ks.append(rK.load().to(Float32))
                for h in cutlass.range_constexpr(H):
                    qv = cute.local_tile(sQ[h, None], (ELEMS,), (col // ELEMS,)).load()
                    for s in cutlass.range_constexpr(TS):
                        rS[h, s] = rS[h, s] + (qv * ks[s]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for h in cutlass.range_constexpr(H):
                for s in cutlass.range_constexpr(TS):
                    sPart[warp, h, lane + 32 * s] = rS[h, s]
            cute.arch.barrier()

            # online softmax (base 2), warp w takes heads w, w + 8
            for hh in cutlass.range_constexpr(-(-H // WARPS)):
                h = warp + hh * WARPS
                if h < H:
                    rT = cute.make_rmem_tensor((TS,), Float32)
                    tmax = Float32(NEG_INF)
                    for s in cutlass.range_constexpr(TS):
                        j = lane + 32 * s
                        tot = Float32(0.0)
                        for w in cutlass.range_constexpr(WARPS):
                            tot = tot + sPart[w, h, j]
                        rT[s] = Float32(cutlass.select_(base + j < end, tot, Float32(NEG_INF)))
                        tmax = cutlass.max(tmax, rT[s])
                    tmax = cute.arch.warp_reduction(tmax, cutlass.max)
                    old = sStat[0, h]
                    new = cutlass.max(old, tmax)
                    psum = Float32(0.0)
                    for s in cutlass.range_constexpr(TS):
                        p = cute.math.exp2(rT[s] - new)
                        sP[h, lane + 32 * s] = p
                        psum = psum + p
                    psum = cute.arch.warp_reduction(psum, operator.add)
                    cute.arch.sync_warp()
                    if lane == 0:
                        corr = cute.math.exp2(old - new)
                        sStat[0, h] = new
                        sStat[1, h] = sStat[1, h] * corr + psum
                        sStat[2, h] = corr
            cute.arch.barrier()

            # P x V: 8 latent values (dv) of heads group, group + 4, group + 8
            for k in cutlass.range_constexpr(HPT):
                h = group + k * HEAD_GROUPS
                if h < H:
                    corr = sStat[2, h]
                    for e in cutlass.range_constexpr(ELEMS):
                        rAcc[e, k] = rAcc[e, k] * corr
            for j in cutlass.range(T, unroll=4):
                cute.autovec_copy(cute.local_tile(sK[j, None], (ELEMS,), (dv,)), rV)
                v = rV.load().to(Float32)
                for k in cutlass.range_constexpr(HPT):
                    h = group + k * HEAD_GROUPS
                    if h < H:
                        p = sP[h, j]
                        acc = rAcc[None, k].load()
                        rAcc[None, k].store(acc + v * p)

        # the split's partials: unnormalized latent, max and sum per head
        cute.arch.barrier()
        for k in cutlass.range_constexpr(HPT):
            h = group + k * HEAD_GROUPS
            if h < H:
                for half in cutlass.range_constexpr(2):
                    cute.copy(r2g_atom(Float32), cute.local_tile(rAcc[None, k], (4,), (half,)),
                              cute.local_tile(mPAcc[cta, h, None], (4,), (dv * 2 + half,)))
        if tidx < H:
            mPML[cta, tidx, 0] = sStat[0, tidx]
            mPML[cta, tidx, 1] = sStat[1, tidx]

    @cute.jit
    def load_tile(self, mCache, mBT, rNext, b, first, end, tidx):
        """The tile of entries ``first ..`` into registers, 16 bytes per load; entries at or past
        ``end`` re-read entry ``end - 1`` (masked out of the softmax)."""
        NV = const_expr(self.entry_vecs)
        per = const_expr(16 // (self.dtype.width // 8))
        block_size = mCache.shape[1]
        for i in cutlass.range_constexpr(self.loads):
            flat = tidx + i * THREADS
            pos = cutlass.min(first + flat // NV, end - 1)
            blk = mBT[b, pos // block_size]
            entry = mCache[blk, pos % block_size, None]
            cute.copy(g2r_stream_atom(self.dtype), cute.local_tile(entry, (per,), (flat % NV,)), rNext[None, i])

    @cute.jit
    def store_tile(self, sK, rNext, tidx):
        NV = const_expr(self.entry_vecs)
        per = const_expr(16 // (self.dtype.width // 8))
        for i in cutlass.range_constexpr(self.loads):
            flat = tidx + i * THREADS
            cute.autovec_copy(rNext[None, i], cute.local_tile(sK[flat // NV, None], (per,), (flat % NV,)))

    @cute.jit
    def combine(self, mPAcc, mPML, mLat, unit, sub, kv_scale):
        """Unit ``unit`` = (request, head, 8 latent values), its splits shared by ``combine_lanes``
        lanes (``sub`` = this lane's place among them, every lane of the group calls this): the
        splits' partials weighted by 2^(max_s - max), over the total sum; bf16. Past the last
        unit a group computes unit ``units - 1`` again and stores nothing."""
        S = const_expr(self.splits)
        G = const_expr(self.combine_lanes)
        u = cutlass.min(unit, self.units - 1)
        b = u // (self.heads * LAT_VECS)
        h = u // LAT_VECS % self.heads
        dv = u % LAT_VECS
        top = Float32(NEG_INF)
        for s in cutlass.range(sub, S, G, unroll=4):
            top = cutlass.max(top, mPML[b * S + s, h, 0])
        if const_expr(G > 1):
            top = cute.arch.warp_reduction(top, cutlass.max, threads_in_group=G)
        safe = Float32(cutlass.select_(top > Float32(NEG_INF), top, Float32(0.0)))  # no split saw a token
        rA = cute.make_rmem_tensor((ELEMS,), Float32)
        rA.fill(0.0)
        rP = cute.make_rmem_tensor((ELEMS,), Float32)
        total = Float32(0.0)
        for s in cutlass.range(sub, S, G, unroll=4):
            w = cute.math.exp2(mPML[b * S + s, h, 0] - safe)
            total = total + w * mPML[b * S + s, h, 1]
            for half in cutlass.range_constexpr(2):
                cute.copy(g2r_atom(Float32, invariant=False),
                          cute.local_tile(mPAcc[b * S + s, h, None], (4,), (dv * 2 + half,)),
                          cute.local_tile(rP, (4,), (half,)))
            rA.store(rA.load() + rP.load() * w)
        if const_expr(G > 1):
            total = cute.arch.warp_reduction(total, operator.add, threads_in_group=G)
            for e in cutlass.range_constexpr(ELEMS):
                rA[e] = cute.arch.warp_reduction(rA[e], operator.add, threads_in_group=G)
        inv = Float32(cutlass.select_(total > Float32(0.0), kv_scale / total, Float32(0.0)))
        rO = cute.make_rmem_tensor((ELEMS,), BFloat16)
        rO.store((rA.load() * inv).to(BFloat16))
        if sub == 0 and unit < self.units:
            cute.copy(r2g_atom(BFloat16), rO, cute.local_tile(mLat[b, h, None], (ELEMS,), (dv,)))


def build(spec) -> tuple[MlaAttend, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, d, p = spec.shape_dict, spec.dtype_dict, spec.param_dict
    b, h = s["batch"], s["heads"]
    kernel = MlaAttend(b, h, d["cache"], p["scale"], p["gate_stride"])
    blocks, block_size, max_blocks = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    block_stride = cute.sym_int64(divisibility=16)

    def t(dtype, shape, stride, align=16):
        return make_fake_tensor(dtype, shape, stride, assumed_align=align)

    args = (t(BFloat16, (b, h, E), (h * E, E, 1)),  # mqa_q
            t(kernel.dtype, (blocks, block_size, E), (block_stride, E, 1)),  # kv_cache
            t(Int32, (b, max_blocks), (max_blocks, 1), 4),  # block_table
            t(Int32, (b,), (1,), 4),  # seq_lens
            t(Float32, (1,), (1,), 4),  # kv_scale
            t(BFloat16, (h * HEAD_ROWS, L), (L, 1)),  # kv_b_proj weight
            t(BFloat16, (b, h * V_DIM), (kernel.gate_stride, 1), 2),  # gate
            t(BFloat16, (b, h * V_DIM), (h * V_DIM, 1), 2),  # out
            t(Float32, (kernel.ctas, h, L), (h * L, L, 1)),  # split partials: latent
            t(Float32, (kernel.ctas, h, 2), (h * 2, 2, 1), 4),  # split partials: max, sum
            t(BFloat16, (b, h, L), (h * L, L, 1)),  # combined latent
            t(Int32, (2,), (1,), 4),  # barrier (count, generation)
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
