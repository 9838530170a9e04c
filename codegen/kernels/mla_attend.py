"""``mla_attend``: MLA decode attention over vLLM's paged latent cache, W_UV and the sigmoid
output gate in one kernel (``k3f::mla_attend``; one token per request, or q of a verify step).

The math is ``rewriter/model/layers/mla.py:mla_attend`` (``k3::mla_decode`` then W_UV and the gate),
per request ``b`` with ``n = seq_lens[b]`` cached entries (the current token's included), head
``h`` (L = 512 latent values, R = 64 rope values, E = L + R per cache entry):
    s_j    = (q[b, h] . e_j) * scale              (e_j: entry j, fp32; fp8: E4M3 x kv_scale)
    lat    = bf16(softmax(s) @ e[:, :L])           (0 for a padding request, n = 0)
    o      = bf16(lat @ W_UV[h]^T)                 (W_UV[h]: rows h*256+128 .. h*256+256 of kv_b)
    out    = bf16(o * bf16(sigmoid(gate[b, h*128 : (h+1)*128])))

A verify step (``q_len`` q > 1) takes q tokens per request, causal among them: token t of
request r = t // q sees the first ``seq_lens[r] - (q - 1 - t % q)`` entries of r's block table
row (its own insert the last), so each token is a row of its own below, "request" meaning token.

Work split: a grid of ``B x G x S`` CTAs (G head groups of at most 16 heads, the MMA's rows:
one up to 16 heads a rank, 2 for Kimi K3's 24 or 32 at TP 4 or 3, 6 for its 96 at TP 1; S
context splits per request and group, ``B x G x S <= 128`` so that the whole grid is resident
at once on any Hopper or Blackwell part, or at most the SMs of a GPU with fewer: ``max_ctas``,
which the launcher sets from the SM count), 256 threads a warpgroup, three
phases separated by two grid-wide barriers:
1. split ``s`` of request ``b`` and head group ``g`` walks its share of the context in tiles of
   64 entries (the groups of a split read the same entries, together, so the L2 serves all but
   the first). A tile's chain (its loads landing, four barriers, the products, the softmax) is
   bound by its latencies with one CTA of 8 warps an SM, so for an fp8 cache from 4 tokens
   where the shared memory holds them (``WARPGROUPS``, ``TWO_WARPGROUP_MIN_TOKENS``; Kimi K3
   at TP 8 and 16) a CTA is two warpgroups of 8 warps,
   each walking every other tile of the share on its own stage, named barrier, softmax state
   and accumulators, the second's merged into the first's at the end. The tile's entries
   (block table lookups; 128-bit loads, 9 of an entry's vectors a thread at fixed offsets
   from its row; with one warpgroup the next tile's loads are issued before the current one
   is computed) go to shared memory as bf16 (fp8 E4M3 converted exactly);
   both products run on tensor cores (``mma.sync.m16n8k16``, bf16 in, fp32 accumulators;
   ``warp_mma``), the group's heads padded to the MMA's 16 rows. Scores: warp ``w`` multiplies the
   queries' entry values [144 (w % 4), +144) (A fragments by ldmatrix) by entries
   [32 (w // 4), +32) of the tile; the 4 partial sums meet in shared memory. Online softmax
   in base 2 (scale x log2(e), fp8: x kv_scale, applied to the fp32 sums), one warp per head,
   P rounded to bf16. P x V: warp ``w`` owns latent values [64 w, 64 w + 64) of every head,
   its accumulators rescaled by each head's correction before the tile's products (V read
   from the same tile with ``ldmatrix.trans``). The split's (max, sum, unnormalized latent)
   go to a global scratch.
2. after the first barrier, a group of lanes (as many as splits, at most 32) combines the
   splits of one (request, head, 8 values) unit, each lane a share of the splits (all its
   loads at once), a butterfly over the group, and writes the bf16 latent to a second scratch;
3. after the second barrier, warps take rows of W_UV for every request, a 32-lane butterfly
   per (row, request): each lane reads the gates of its requests (b % 32 = lane) first, the
   latents of ``WUV_CHUNK`` requests are loaded at once, lane b % 32 keeps request b's sum,
   and the gated outputs are stored after the last sum. (One request at a time, each
   request's loads waited behind the previous store, and each store behind a gate load: two
   dependent round trips a request, 128 at 64 requests.)

Programmatic dependent launch: before ``griddepcontrol.wait`` go the loads no kernel of the step
writes: the W_UV rows (into registers, or with two warpgroups into shared memory), the sequence
lengths and block table, and the first tile's entries of earlier steps (the bulk of the cache:
at batch 1 every split's whole share). After it: the queries and the step's own inserts (the
last ``q_len`` entries of the request, which the q-front writes).
``griddepcontrol.launch_dependents`` only after the first barrier, when every CTA is resident; a
dependent launched earlier could take the SMs some CTAs still wait for. The barrier is one int32
word whose top bit flips as the last CTA arrives and whose low bits are back at 0 after each
barrier, so the scratch serves every launch (and every MLA layer, which run in turn).
"""
from __future__ import annotations

import math
import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom, r2g_atom, trap_past_deadline, wait_started
from codegen.kernels.warp_mma import ldmatrix_x4, mma_bf16

L, R, V_DIM, HEAD_ROWS = 512, 64, 128, 256  # latent, rope, value dim, kv_b rows per head
E = L + R
THREADS = 256
WARPS = THREADS // 32
MAX_CTAS = 128
MAX_BATCH = 64
MAX_HEADS = 16  # the MMA's M: a head group's heads padded to 16 rows
MAX_TOTAL_HEADS = 128  # a rank's heads over its groups (Kimi K3 at TP 1: 96)
CACHE_DTYPES = ("bf16", "fp8_e4m3")
TILE = 64  # entries per tile
ROW = E + 8  # shared-memory row of an entry / a query (bf16): 16 bytes of padding, ldmatrix rows in distinct banks
P_ROW = TILE + 8  # row of P (bf16), likewise
PART_ROW = TILE + 8  # row of the fp32 partial scores: the accumulator stores 2-way conflicted at most
K_WARPS, N_WARPS = 4, 2  # scores: warps along the entry values (144 each) x along the tile's entries (32 each)
K_TILES = E // K_WARPS // 16  # 9 k16 steps per score warp
N_TILES = TILE // N_WARPS // 8  # 4 n8 tiles per score warp
O_TILES = L // WARPS // 8  # P x V: 8 n8 tiles of latent values per warp
ROW_VECS = 9  # 16-byte vectors of an entry a thread loads (72 of a bf16 entry over 8 threads, 36 of fp8 over 4)
ELEMS = 8  # latent values per combine unit
LAT_VECS = L // ELEMS  # 64 combine units per (request, head)
WUV_CHUNK = 8  # requests whose latents a warp loads at once in the W_UV stage (16 x 16 bytes a lane)
# W_UV rows a warp loads before the wait and holds (TP 8 and 16 hold all theirs; the rest after the barrier)
WUV_HELD_ROWS = 2
# warpgroups of 8 warps a CTA: with 2, each walks every other tile of the split's share, so an SM
# runs two tiles' dependent chains side by side (its W_UV rows wait in shared memory instead of
# registers: 512 threads leave 128 registers a thread); 1 where the shared memory does not hold both
WARPGROUPS = 2
# where the second warpgroup pays (measured on the H100 and H200: docs/CODEGEN.md), and so the only form
# built: the fp8 cache (its tiles pass through registers and convert; bf16's cp.async chain
# measured faster with one) from 4 tokens (a split's share at a 4096-entry context is half a
# tile a token: one token leaves the second idle)
TWO_WARPGROUP_MIN_TOKENS = 4
SMEM_BYTES = 227 * 1024
LOG2E = 1.0 / math.log(2.0)
NEG_INF = float("-inf")


def head_groups(heads: int) -> int:
    """The fewest groups of at most ``MAX_HEADS`` heads that split ``heads`` evenly."""
    return next(g for g in range(-(-heads // MAX_HEADS), heads + 1) if heads % g == 0)


def splits_for(batch: int, groups: int = 1, max_ctas: int = MAX_CTAS) -> int:
    """Context splits per request and head group: the grid fills up to ``max_ctas`` (``MAX_CTAS``,
    or the SMs of a GPU with fewer)."""
    return max(1, max_ctas // (batch * groups))


class MlaAttend:
    """Compile-time configuration: requests B (= tokens), heads H, the cache dtype (bf16 or
    fp8), the softmax scale, the gate's row stride, and the grid's cap (``MAX_CTAS``, or the SMs
    of a GPU with fewer: every CTA must be resident for the grid barriers)."""

    def __init__(self, batch: int, heads: int, cache: str, scale: float, gate_stride: int, q_len: int = 1,
                 block_size: int = 64, max_ctas: int = MAX_CTAS):
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch {batch} outside 1..{MAX_BATCH}")
        if q_len < 1 or batch % q_len:
            raise ValueError(f"{batch} tokens are not whole requests of {q_len}")
        self.q_len = q_len
        if cache not in CACHE_DTYPES:
            raise ValueError(f"cache {cache!r}: bf16 or fp8_e4m3")
        if not 1 <= heads <= MAX_TOTAL_HEADS:
            raise ValueError(f"heads {heads} outside 1..{MAX_TOTAL_HEADS}")
        self.batch, self.heads, self.cache = batch, heads, cache
        self.groups = head_groups(heads)
        self.group_heads = heads // self.groups  # at most MAX_HEADS: the MMA's rows
        if not 1 <= max_ctas <= MAX_CTAS or batch * self.groups > max_ctas:
            raise ValueError(f"grid cap {max_ctas}: at most {MAX_CTAS}, and at least {batch} tokens x "
                             f"{self.groups} head groups")
        self.splits = splits_for(batch, self.groups, max_ctas)
        self.pairs = batch * self.splits  # (request, split): the rows of the partials' scratch
        self.ctas = self.pairs * self.groups
        self.scale = float(scale)
        self.gate_stride = gate_stride
        self.per_vec = 8 if cache == "bf16" else 16  # cache values per 16-byte load
        self.entry_vecs = E // self.per_vec  # 16-byte vectors per entry (72 | 36)
        self.loads = TILE * self.entry_vecs // THREADS  # 16-byte tile loads per thread of a warpgroup (18 | 9)
        # a thread's loads: ROW_VECS vectors a row, ``row_threads`` threads a row side by side, the
        # rows in ``passes`` of THREADS / row_threads: an entry position and a block number a pass,
        # the vectors at constant offsets from it
        self.row_threads = self.entry_vecs // ROW_VECS  # 8 | 4
        self.pass_rows = THREADS // self.row_threads  # 32 | 64
        self.passes = TILE // self.pass_rows  # 2 | 1
        self.rows = heads * V_DIM  # W_UV rows
        self.rows_per_cta = -(-self.rows // self.ctas)
        two = (cache == "fp8_e4m3" and batch >= TWO_WARPGROUP_MIN_TOKENS
               and self.smem_bytes(WARPGROUPS) <= SMEM_BYTES)
        self.wgs = WARPGROUPS if two else 1
        self.stages = self.stages_of(self.wgs)
        self.threads, self.warps = THREADS * self.wgs, WARPS * self.wgs
        self.rows_per_warp = -(-self.rows_per_cta // self.warps)
        self.units = batch * heads * LAT_VECS  # combine units
        self.combine_lanes = min(32, 1 << (self.splits - 1).bit_length())  # lanes sharing a unit's splits
        self.dtype = BFloat16 if cache == "bf16" else Float8E4M3FN
        if block_size < 1:
            raise ValueError(f"block size {block_size}")
        self.block_size = block_size
        # tiles start at multiples of 64 entries: with blocks of a multiple of 64, a tile lies in
        # one block, one block table lookup a tile (vLLM's MLA caches on Hopper: 64)
        self.one_block = block_size % TILE == 0
        self.lookups = 1 if self.one_block else self.passes

    def stages_of(self, wgs: int) -> int:
        """Tile stages in shared memory: bf16 by cp.async into two; fp8 via registers, one stage a
        warpgroup."""
        return 2 if self.cache == "bf16" or wgs == 2 else 1

    def smem_bytes(self, wgs: int) -> int:
        """Shared memory of the form with ``wgs`` warpgroups: the tile stages, the queries, each
        warpgroup's partial scores, P and statistics, and with two the CTA's W_UV rows."""
        stages = self.stages_of(wgs)
        per_wg = K_WARPS * MAX_HEADS * PART_ROW * 4 + MAX_HEADS * P_ROW * 2 + 3 * MAX_HEADS * 4
        rows = self.rows_per_cta * L * 2 if wgs == 2 else 0
        return stages * TILE * ROW * 2 + MAX_HEADS * ROW * 2 + wgs * per_wg + rows + 6 * 16

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
                 mKvScale: cute.Tensor, mW: cute.Tensor, mGate: cute.Tensor, mOut: cute.Tensor,
                 mPAcc: cute.Tensor, mPML: cute.Tensor, mLat: cute.Tensor, mBar: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mQ, mCache, mBT, mSeq, mKvScale, mW, mGate, mOut, mPAcc, mPML, mLat, mBar).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
               mKvScale: cute.Tensor, mW: cute.Tensor, mGate: cute.Tensor, mOut: cute.Tensor,
               mPAcc: cute.Tensor, mPML: cute.Tensor, mLat: cute.Tensor, mBar: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        RPW = const_expr(self.rows_per_warp)
        HELD = const_expr(min(RPW, WUV_HELD_ROWS) if self.wgs == 1 else 0)

        # 0. before the wait (PDL): this warp's first W_UV rows, 2 vectors per lane and row; with
        #    two warpgroups the CTA's rows into shared memory instead
        smem = cutlass.memory.SmemAllocator()
        rW = cute.make_rmem_tensor((VEC, 2, max(1, HELD)), BFloat16)
        for r in cutlass.range_constexpr(HELD):
            self.load_w_row(mW, rW, r, cutlass.min(self.warp_row(cta, warp, r), self.rows - 1), lane)
        sW = None
        if const_expr(self.wgs == 2):
            sW = smem.allocate_tensor(BFloat16, cute.make_layout((self.rows_per_cta, L), stride=(L, 1)),
                                      byte_alignment=16)
            self.stage_w_rows(mW, sW, cta, tidx)

        # 1. this split's share of the context (``griddepcontrol.wait`` inside, once the entries
        #    of earlier steps are in flight)
        self.attend(mQ, mCache, mBT, mSeq, mKvScale, mPAcc, mPML, cta, tidx, lane, warp, smem)
        if const_expr(self.wgs == 2):
            cute.arch.cp_async_wait_group(0)  # the W_UV rows (the barrier below shows them to every warp)
        self.grid_sync(mBar, cta, tidx)
        cute.arch.griddepcontrol_launch_dependents()

        # 2. the splits combined: unit (request, head, 8 latent values) per thread
        kv_scale = Float32(1.0)
        if const_expr(self.cache == "fp8_e4m3"):
            kv_scale = mKvScale[0]
        G = const_expr(self.combine_lanes)
        for first in cutlass.range((cta * self.warps + warp) * (32 // G), self.units,
                                   self.ctas * self.warps * (32 // G), unroll=1):
            self.combine(mPAcc, mPML, mLat, first + lane // G, lane % G, kv_scale)
        self.grid_sync(mBar, cta, tidx)

        # 3. W_UV rows and the gate, every request (rows past the held ones loaded here: at most
        #    WUV_HELD_ROWS a warp stay in registers across the two barriers)
        for r in cutlass.range_constexpr(RPW):
            n = self.warp_row(cta, warp, r)
            if self.owns(warp, r, n):
                if const_expr(r < HELD):
                    self.project_row(mLat, mGate, mOut, rW, n, r, lane)
                else:
                    rW1 = cute.make_rmem_tensor((VEC, 2, 1), BFloat16)
                    if const_expr(self.wgs == 2):
                        for u in cutlass.range_constexpr(2):
                            cute.autovec_copy(cute.local_tile(sW[n - cta * self.rows_per_cta, None], (VEC,),
                                                              (u * 32 + lane,)), rW1[None, u, 0])
                    else:
                        self.load_w_row(mW, rW1, 0, n, lane)
                    self.project_row(mLat, mGate, mOut, rW1, n, 0, lane)

    @cute.jit
    def load_w_row(self, mW, rW, r: cutlass.Constexpr, n, lane):
        """W_UV row ``n`` (head ``n // 128``'s value rows of kv_b) into ``rW[:, :, r]``, 2 vectors a lane."""
        wrow = mW[n // V_DIM * HEAD_ROWS + V_DIM + n % V_DIM, None]
        for u in cutlass.range_constexpr(2):
            cute.copy(g2r_stream_atom(BFloat16), cute.local_tile(wrow, (VEC,), (u * 32 + lane,)), rW[None, u, r])

    @cute.jit
    def stage_w_rows(self, mW, sW, cta, tidx):
        """The CTA's W_UV rows into ``sW`` by ``cp.async`` (one commit group, before the tiles'):
        a 16-byte vector a thread at a time, rows past the last one re-reading it (never used)."""
        g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        VECS = const_expr(self.rows_per_cta * (L // VEC))
        for j in cutlass.range_constexpr(-(-VECS // self.threads)):
            v = tidx + j * self.threads
            if const_expr((j + 1) * self.threads <= VECS) or v < VECS:
                n = cutlass.min(cta * self.rows_per_cta + v // (L // VEC), self.rows - 1)
                wrow = mW[n // V_DIM * HEAD_ROWS + V_DIM + n % V_DIM, None]
                cute.copy(g2s, cute.local_tile(wrow, (VEC,), (v % (L // VEC),)),
                          cute.local_tile(sW[v // (L // VEC), None], (VEC,), (v % (L // VEC),)))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def project_row(self, mLat, mGate, mOut, rW, n, r: cutlass.Constexpr, lane):
        """W_UV row ``n`` (the warp's ``r``-th, in ``rW``) against every request's latent, gated.
        Lane ``b % 32`` keeps request b's sum and reads its gate, both stored at the end: no
        load waits for a store (ptxas cannot move a load of ``mLat`` above a store to ``mOut``)
        or for a gate read after the sum, and the latents of ``WUV_CHUNK`` requests are in flight
        at once. Each sum is added in the same order as before (one request at a time)."""
        B = const_expr(self.batch)
        NB = const_expr(-(-B // 32))  # requests per lane
        CH = const_expr(min(WUV_CHUNK, B))
        h = n // V_DIM
        rSig = cute.make_rmem_tensor((NB,), Float32)
        for j in cutlass.range_constexpr(NB):
            if const_expr(B >= 32 * (j + 1)) or lane + 32 * j < B:
                g = mGate[lane + 32 * j, n].to(Float32)
                rSig[j] = (Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))).to(BFloat16).to(Float32)
        rSum = cute.make_rmem_tensor((NB,), Float32)
        rSum.fill(0.0)
        rL = cute.make_rmem_tensor((VEC, 2, CH), BFloat16)
        for j in cutlass.range_constexpr(NB):  # requests 32 j .. 32 j + 31: lane b - 32 j keeps b's
            for c in cutlass.range(32 * j, min(B, 32 * (j + 1)), CH, unroll=1):
                for i in cutlass.range_constexpr(CH):  # the chunk's loads, all in flight
                    if const_expr(B % CH == 0) or c + i < B:
                        for u in cutlass.range_constexpr(2):
                            cute.autovec_copy(cute.local_tile(mLat[c + i, h, None], (VEC,), (u * 32 + lane,)),
                                              rL[None, u, i])
                for i in cutlass.range_constexpr(CH):
                    if const_expr(B % CH == 0) or c + i < B:
                        acc = Float32(0.0)
                        for u in cutlass.range_constexpr(2):
                            acc = acc + (rL[None, u, i].load().to(Float32) * rW[None, u, r].load().to(Float32)).reduce(
                                cute.ReductionOp.ADD, Float32(0.0), 0)
                        acc = cute.arch.warp_reduction(acc, operator.add)
                        rSum[j] = cutlass.select_(lane == c + i - 32 * j, acc, rSum[j])
        for j in cutlass.range_constexpr(NB):
            if const_expr(B >= 32 * (j + 1)) or lane + 32 * j < B:
                mOut[lane + 32 * j, n] = (rSum[j].to(BFloat16).to(Float32) * rSig[j]).to(BFloat16)

    def warp_row(self, cta, warp, r):
        """W_UV row (head x 128 + v) that warp ``warp`` of CTA ``cta`` takes ``r``-th (past the
        CTA's share when ``r * 8 + warp >= rows_per_cta``: see ``owns``)."""
        return cta * self.rows_per_cta + r * self.warps + warp

    def owns(self, warp, r, n):
        return (r * self.warps + warp < self.rows_per_cta) & (n < self.rows)

    @cute.jit
    def grid_sync(self, mBar: cute.Tensor, cta, tidx):
        """Every CTA of the grid has reached this point, its global writes visible to all.

        One word, whose top bit flips when the last CTA arrives: CTA 0 adds 2^31 - (ctas - 1),
        every other CTA 1, so a barrier adds 2^31 and leaves the low bits at 0 for the next one
        (no reset, no second word). A fence, one relaxed atomic, relaxed loads until the bit
        flips, a fence: the release and acquire patterns of the PTX memory model (two
        ``MEMBAR.GPU`` a barrier). A wait past ``common.WAIT_DEADLINE_NS`` traps."""
        cute.arch.barrier()
        if tidx == 0:
            word = mBar.iterator
            add = Int32(1)
            if cta == 0:
                add = Int32(2**31 - (self.ctas - 1))
            cute.arch.fence_acq_rel_gpu()  # this CTA's writes (ordered by the barrier) before the arrival
            old = cute.arch.atomic_add(word, add, sem="relaxed", scope="gpu")
            now = cute.arch.load(word, Int32, sem="relaxed", scope="gpu")
            started = wait_started()
            while (old ^ now) >= 0:  # top bit unchanged: someone has not arrived
                trap_past_deadline(started)
                now = cute.arch.load(word, Int32, sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()  # every CTA's writes before this CTA's reads
        cute.arch.barrier()

    @cute.jit
    def attend(self, mQ, mCache, mBT, mSeq, mKvScale, mPAcc, mPML, cta, tidx, lane, warp, smem):
        H = const_expr(self.group_heads)  # this CTA's heads h0 .. h0 + H - 1
        TS = const_expr(TILE // 32)
        WG = const_expr(self.wgs)
        b = cta // (self.groups * self.splits)
        h0 = cta // self.splits % self.groups * H
        split = cta % self.splits
        pair = b * self.splits + split  # the partials' row: the combine reads (request, split)
        g, q = lane // 4, lane % 4  # the MMA fragments' row group and column pair
        # the warpgroup: its tiles are tiles wg, wg + WG, ... of the split's share; lt / lw its
        # thread and warp (the whole CTA where WG is 1)
        wg = warp // WARPS
        lt = tidx % THREADS
        lw = warp % WARPS

        ST = const_expr(self.stages)
        sK = smem.allocate_tensor(BFloat16, cute.make_layout((ST, TILE, E), stride=(TILE * ROW, ROW, 1)),
                                  byte_alignment=16)
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout((MAX_HEADS, E), stride=(ROW, 1)), byte_alignment=16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((WG, K_WARPS, MAX_HEADS, TILE), stride=(
            K_WARPS * MAX_HEADS * PART_ROW, MAX_HEADS * PART_ROW, PART_ROW, 1)), byte_alignment=16)
        sP = smem.allocate_tensor(BFloat16,
                                  cute.make_layout((WG, MAX_HEADS, TILE), stride=(MAX_HEADS * P_ROW, P_ROW, 1)),
                                  byte_alignment=16)
        sStat = smem.allocate_tensor(Float32, cute.make_layout((WG, 3, MAX_HEADS)), byte_alignment=16)  # max, sum, corr

        # before the wait (PDL): P's padding rows, the softmax state, the sequence lengths and
        # block table (no kernel of the step writes them) and the first tile's entries of earlier
        # steps; this step's inserts (the last q_len entries of the request, written by the
        # q-front) and the queries only after it
        if lt < MAX_HEADS * TILE // VEC:
            rZ = cute.make_rmem_tensor((VEC,), BFloat16)
            rZ.fill(0.0)
            cute.autovec_copy(rZ, cute.local_tile(sP[wg, lt // (TILE // VEC), None], (VEC,), (lt % (TILE // VEC),)))
        if lt < MAX_HEADS:
            sStat[wg, 0, lt] = Float32(NEG_INF)
            sStat[wg, 1, lt] = Float32(0.0)
            sStat[wg, 2, lt] = Float32(0.0)
        req = b // self.q_len  # the token's request: its sequence length and block table row
        n = mSeq[req]
        old_end = cutlass.max(n - self.q_len, Int32(0))  # entries written before this step
        if const_expr(self.q_len > 1):  # causal among the step's tokens
            n = cutlass.max(n - (self.q_len - 1 - b % self.q_len), Int32(0))
        per = (n + self.splits - 1) // self.splits
        per = (per + TILE - 1) // TILE * TILE
        start = cutlass.min(split * per, n)
        end = cutlass.min(start + per, n)
        tiles = (end - start + TILE - 1) // TILE
        first = start + wg * TILE  # the warpgroup's first tile
        first_stage = wg if const_expr(WG == 2) else 0

        # the first tile's loads: bf16 by cp.async into its stage, fp8 into registers; the block
        # table lookups of a tile are made one tile ahead of its loads (rBlk), so that no load
        # waits on one at the top of an iteration
        rNext = cute.make_rmem_tensor((self.per_vec, self.loads if const_expr(self.cache != "bf16") else 1),
                                      self.dtype)
        rBlk0 = cute.make_rmem_tensor((self.lookups,), Int32)
        rBlk = cute.make_rmem_tensor((self.lookups,), Int32)
        if tiles > wg:
            self.lookup(mBT, rBlk0, req, first, end, lt)
            self.load_tile(mCache, rBlk0, rNext, sK, first_stage, first, end, lt, old_end, "old")
        if tiles > wg + WG:
            self.lookup(mBT, rBlk, req, first + WG * TILE, end, lt)
        cute.arch.griddepcontrol_wait()
        if tiles > wg and first + TILE > old_end:  # the tile holds entries of this step
            self.load_tile(mCache, rBlk0, rNext, sK, first_stage, first, end, lt, old_end, "new")
        cute.arch.cp_async_commit_group()

        # the queries as given (bf16; the scale multiplies the fp32 sums), rows past H zero
        QV = const_expr(MAX_HEADS * E // VEC)
        QJ = const_expr(-(-QV // self.threads))
        rQv = cute.make_rmem_tensor((VEC, QJ), BFloat16)
        for j in cutlass.range_constexpr(QJ):  # every load in flight at once
            i = cutlass.min(tidx + j * self.threads, QV - 1)
            h = i // (E // VEC)
            rQv[None, j].fill(0.0)
            if h < H:
                cute.copy(g2r_atom(BFloat16, invariant=False),
                          cute.local_tile(mQ[b, h0 + h, None], (VEC,), (i % (E // VEC),)), rQv[None, j])
        if const_expr(WG == 2):  # the first (fp8) tile stored while the queries fly
            if tiles > wg:
                self.store_tile(sK, first_stage, rNext, lt)
        for j in cutlass.range_constexpr(QJ):
            i = tidx + j * self.threads
            if const_expr((j + 1) * self.threads <= QV) or i < QV:
                cute.autovec_copy(rQv[None, j], cute.local_tile(sQ[i // (E // VEC), None], (VEC,), (i % (E // VEC),)))
        s_scale = Float32(self.scale * LOG2E)
        if const_expr(self.cache == "fp8_e4m3"):
            s_scale = s_scale * mKvScale[0]
        cute.arch.barrier()  # sQ, sP, sStat written

        kq, nh = lw % K_WARPS, lw // K_WARPS  # scores: entry values [144 kq, +144), entries [32 nh, +32)
        sK_addr = sK.iterator.toint()
        sQ_addr = sQ.iterator.toint()
        sP_addr = sP.iterator.toint() + wg * (MAX_HEADS * P_ROW * 2)
        a_row = lane % 8 + 8 * ((lane // 8) % 2)
        a_col = 8 * (lane // 16)
        m_row = lane % 8  # ldmatrix: the row this lane addresses in matrix lane // 8
        m_lo = 8 * ((lane // 8) % 2)  # matrix offset along the fragment's k (plain) / k (trans)
        m_hi = 8 * (lane // 16)  # along n

        rO = cute.make_rmem_tensor((4, O_TILES), Float32)
        rO.fill(0.0)
        for tile in cutlass.range(wg, tiles, WG, unroll=1):
            base = start + tile * TILE
            if const_expr(WG == 1):
                stage = tile % ST
                cute.arch.barrier()  # the previous tile's sK stage, sP and corrections are no longer read
                if const_expr(self.cache == "bf16"):
                    if tile + 1 < tiles:  # the next tile into the other stage, in flight during this one
                        self.load_tile(mCache, rBlk, rNext, sK, 1 - stage, base + TILE, end, lt, end, "all")
                        if tile + 2 < tiles:  # its block numbers, needed next iteration
                            self.lookup(mBT, rBlk, req, base + 2 * TILE, end, lt)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)  # this tile's copies (this thread's) landed
                else:
                    self.store_tile(sK, 0, rNext, lt)
            else:  # fp8, one stage a warpgroup, loaded at the top: the other warpgroup's tile runs meanwhile
                stage = wg
                self.wg_barrier(wg)  # the previous tile's sK stage, sP and corrections are no longer read
                if tile != wg:  # (the first tile was loaded and stored before the loop)
                    self.load_tile(mCache, rBlk, rNext, sK, stage, base, end, lt, end, "all")
                    if tile + WG < tiles:  # the next tile's block numbers
                        self.lookup(mBT, rBlk, req, base + WG * TILE, end, lt)
                    self.store_tile(sK, stage, rNext, lt)  # no registers held across the tile's products
            self.wg_barrier(wg)
            if const_expr(self.cache != "bf16" and WG == 1):  # fp8: the next tile in registers meanwhile
                if tile + 1 < tiles:
                    self.load_tile(mCache, rBlk, rNext, sK, 0, base + TILE, end, lt, end, "all")
                    if tile + 2 < tiles:
                        self.lookup(mBT, rBlk, req, base + 2 * TILE, end, lt)
            k_addr = sK_addr + stage * (TILE * ROW * 2)

            # scores: (16 heads) x (entries [32 nh, +32)) over entry values [144 kq, +144)
            acc = [[Float32(0.0)] * 4 for _ in range(N_TILES)]
            for kt in cutlass.range_constexpr(K_TILES):
                # the queries' A fragments, re-read per tile (held, they would cost 36 registers)
                a = ldmatrix_x4(sQ_addr + (a_row * ROW + kq * (E // K_WARPS) + kt * 16 + a_col) * 2, False)
                col = kq * (E // K_WARPS) + kt * 16 + m_lo
                for np in cutlass.range_constexpr(N_TILES // 2):
                    entry = nh * (TILE // N_WARPS) + np * 16 + m_hi + m_row
                    bw = ldmatrix_x4(k_addr + (entry * ROW + col) * 2, False)
                    acc[2 * np] = mma_bf16(a, bw[0], bw[1], acc[2 * np])
                    acc[2 * np + 1] = mma_bf16(a, bw[2], bw[3], acc[2 * np + 1])
            for nt in cutlass.range_constexpr(N_TILES):
                col = nh * (TILE // N_WARPS) + nt * 8 + 2 * q
                for hh in cutlass.range_constexpr(2):
                    sPart[wg, kq, g + 8 * hh, col] = acc[nt][2 * hh]
                    sPart[wg, kq, g + 8 * hh, col + 1] = acc[nt][2 * hh + 1]
            self.wg_barrier(wg)

            # online softmax (base 2), warp w takes heads w, w + 8
            for hh in cutlass.range_constexpr(-(-H // WARPS)):
                h = lw + hh * WARPS
                if h < H:
                    rT = cute.make_rmem_tensor((TS,), Float32)
                    tmax = Float32(NEG_INF)
                    for s in cutlass.range_constexpr(TS):
                        j = lane + 32 * s
                        tot = Float32(0.0)
                        for w in cutlass.range_constexpr(K_WARPS):
                            tot = tot + sPart[wg, w, h, j]
                        rT[s] = Float32(cutlass.select_(base + j < end, tot * s_scale, Float32(NEG_INF)))
                        tmax = cutlass.max(tmax, rT[s])
                    tmax = cute.arch.warp_reduction(tmax, cutlass.max)
                    old = sStat[wg, 0, h]
                    new = cutlass.max(old, tmax)
                    psum = Float32(0.0)
                    for s in cutlass.range_constexpr(TS):
                        p = cute.math.exp2(rT[s] - new)
                        sP[wg, h, lane + 32 * s] = p.to(BFloat16)
                        psum = psum + p
                    psum = cute.arch.warp_reduction(psum, operator.add)
                    cute.arch.sync_warp()
                    if lane == 0:
                        corr = cute.math.exp2(old - new)
                        sStat[wg, 0, h] = new
                        sStat[wg, 1, h] = sStat[wg, 1, h] * corr + psum
                        sStat[wg, 2, h] = corr
            self.wg_barrier(wg)

            # P x V: (16 heads) x (latent values [64 w, +64)) over the tile's 64 entries
            corr = [sStat[wg, 2, g], sStat[wg, 2, g + 8]]
            for nt in cutlass.range_constexpr(O_TILES):
                for i in cutlass.range_constexpr(4):
                    rO[i, nt] = rO[i, nt] * corr[i // 2]
            for kt in cutlass.range_constexpr(TILE // 16):
                pa = ldmatrix_x4(sP_addr + (a_row * P_ROW + kt * 16 + a_col) * 2, False)
                entry = kt * 16 + m_lo + m_row
                for np in cutlass.range_constexpr(O_TILES // 2):
                    bw = ldmatrix_x4(k_addr + (entry * ROW + lw * (L // WARPS) + np * 16 + m_hi) * 2, True)
                    for half in cutlass.range_constexpr(2):
                        nt = 2 * np + half
                        c = mma_bf16(pa, bw[2 * half], bw[2 * half + 1], [rO[i, nt] for i in range(4)])
                        for i in cutlass.range_constexpr(4):
                            rO[i, nt] = c[i]

        # the split's partials: unnormalized latent, max and sum per head (with two warpgroups,
        # the second's handed to the first through its tile stage and merged there)
        if const_expr(WG == 2):
            self.merge_warpgroups(sK, sStat, rO, wg, lt, g)
        else:
            cute.arch.barrier()
        if wg == 0:
            for hh in cutlass.range_constexpr(2):
                h = g + 8 * hh
                if h < H:
                    for nt in cutlass.range_constexpr(O_TILES):
                        col = lw * (L // WARPS) + nt * 8 + 2 * q
                        mPAcc[pair, h0 + h, col] = rO[2 * hh, nt]
                        mPAcc[pair, h0 + h, col + 1] = rO[2 * hh + 1, nt]
            if lt < H:
                mPML[pair, h0 + lt, 0] = sStat[0, 0, lt]
                mPML[pair, h0 + lt, 1] = sStat[0, 1, lt]

    @cute.jit
    def wg_barrier(self, wg):
        """The CTA barrier, or with two warpgroups the named barrier of warpgroup ``wg`` (1 + wg;
        0 stays the CTA's)."""
        if const_expr(self.wgs == 1):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=THREADS)

    @cute.jit
    def merge_warpgroups(self, sK, sStat, rO, wg, lt, g):
        """The second warpgroup's accumulators (through its tile stage, a thread's 32 values at
        stride THREADS) and statistics into the first's: both rescaled to the larger max (a
        warpgroup that saw no entry has max -inf and weighs 0); the first's ``sStat[0]`` ends
        with the merged max and sum."""
        sX = cute.make_tensor(cute.recast_ptr(sK[1, None, None].iterator, dtype=Float32),
                              cute.make_layout((4, O_TILES, THREADS), stride=(O_TILES * THREADS, THREADS, 1)))
        cute.arch.barrier()  # every warpgroup's loop done: stage 1 and the statistics final
        if wg == 1:
            for i in cutlass.range_constexpr(4):
                for nt in cutlass.range_constexpr(O_TILES):
                    sX[i, nt, lt] = rO[i, nt]
        cute.arch.barrier()
        if wg == 0:
            for hh in cutlass.range_constexpr(2):
                _, c0, c1 = self.merge_weights(sStat, g + 8 * hh)
                for i in cutlass.range_constexpr(2):
                    for nt in cutlass.range_constexpr(O_TILES):
                        rO[2 * hh + i, nt] = rO[2 * hh + i, nt] * c0 + sX[2 * hh + i, nt, lt] * c1
            cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)  # every (first) thread read sStat
            if lt < MAX_HEADS:
                top, c0, c1 = self.merge_weights(sStat, lt)
                sStat[0, 1, lt] = sStat[0, 1, lt] * c0 + sStat[1, 1, lt] * c1
                sStat[0, 0, lt] = top
            cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)

    @cute.jit
    def merge_weights(self, sStat, h):
        """(the larger max, each warpgroup's weight) of head ``h``: exp2 of its max less the larger
        (0 where both maxima are -inf, no entry seen)."""
        m0, m1 = sStat[0, 0, h], sStat[1, 0, h]
        top = cutlass.max(m0, m1)
        safe = Float32(cutlass.select_(top > Float32(NEG_INF), top, Float32(0.0)))
        return top, cute.math.exp2(m0 - safe), cute.math.exp2(m1 - safe)

    @cute.jit
    def lookup(self, mBT, rBlk, b, first, end, tidx):
        """The block numbers of this thread's rows of the tile of entries ``first ..`` into
        ``rBlk`` (loads issued, not waited on: ``load_tile`` is the first to read them): one
        where a tile lies in one block, else one a pass."""
        BS = const_expr(self.block_size)
        if const_expr(self.one_block):
            rBlk[0] = mBT[b, first // BS]
        else:
            for k in cutlass.range_constexpr(self.passes):
                rBlk[k] = mBT[b, self.position(first, end, tidx, k) // BS]

    def position(self, first, end, tidx, k):
        """The entry of this thread's row in pass ``k`` of the tile at ``first`` (past ``end - 1``:
        ``end - 1``, masked out of the softmax)."""
        return cutlass.min(first + tidx // self.row_threads + k * self.pass_rows, end - 1)

    def slot(self, tidx, i):
        """(row in the tile, 16-byte vector of the entry) of this thread's ``i``-th load."""
        k, j = divmod(i, ROW_VECS)
        return tidx // self.row_threads + k * self.pass_rows, tidx % self.row_threads + j * self.row_threads

    @cute.jit
    def load_tile(self, mCache, rBlk, rNext, sK, stage, first, end, tidx, old_end, part: cutlass.Constexpr):
        """Issue the loads of the tile of entries ``first ..`` (block numbers in ``rBlk``), 16
        bytes each: bf16 by cp.async straight into ``sK[stage]``, fp8 into registers
        (``store_tile`` converts them). ``part``: "all" the tile's rows, "old" those of entries
        before ``old_end`` (earlier steps'), "new" the others; the two parts load each row once."""
        for k in cutlass.range_constexpr(self.passes):
            pos = self.position(first, end, tidx, k)
            if const_expr(part == "all"):
                self.load_pass(mCache, rBlk, rNext, sK, stage, pos, tidx, k)
            elif const_expr(part == "old"):
                if pos < old_end:
                    self.load_pass(mCache, rBlk, rNext, sK, stage, pos, tidx, k)
            else:
                if pos >= old_end:
                    self.load_pass(mCache, rBlk, rNext, sK, stage, pos, tidx, k)

    @cute.jit
    def load_pass(self, mCache, rBlk, rNext, sK, stage, pos, tidx, k: cutlass.Constexpr):
        """This thread's ROW_VECS loads of its row in pass ``k`` (entry ``pos``, in block
        ``rBlk[k]``, or ``rBlk[0]`` where the tile lies in one block)."""
        g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        blk = rBlk[0] if const_expr(self.one_block) else rBlk[k]
        src_row = mCache[blk, pos % self.block_size, None]
        for j in cutlass.range_constexpr(ROW_VECS):
            i = k * ROW_VECS + j
            row, vec = self.slot(tidx, i)
            src = cute.local_tile(src_row, (self.per_vec,), (vec,))
            if const_expr(self.cache == "bf16"):
                cute.copy(g2s, src, cute.local_tile(sK[stage, row, None], (self.per_vec,), (vec,)))
            else:
                cute.copy(g2r_stream_atom(self.dtype), src, rNext[None, i])

    @cute.jit
    def store_tile(self, sK, stage, rNext, tidx):
        """The fp8 tile loaded into registers, into shared memory stage ``stage`` as bf16 (E4M3
        converts exactly)."""
        for i in cutlass.range_constexpr(self.loads):
            row, vec = self.slot(tidx, i)
            dst = cute.local_tile(sK[stage, row, None], (self.per_vec,), (vec,))
            dst.store(rNext[None, i].load().to(Float32).to(BFloat16))

    @cute.jit
    def combine(self, mPAcc, mPML, mLat, unit, sub, kv_scale):
        """Unit ``unit`` = (request, head, 8 latent values), its splits shared by ``combine_lanes``
        lanes (``sub`` = this lane's place among them, every lane of the group calls this): the
        splits' partials weighted by 2^(max_s - max), over the total sum; bf16. Every load of a
        lane's splits (at most 4) is issued at once, before the group's max is known, so the
        combine costs one round trip. Past the last unit a group computes unit ``units - 1``
        again and stores nothing."""
        S = const_expr(self.splits)
        G = const_expr(self.combine_lanes)
        J = const_expr(-(-S // G))  # splits per lane
        u = cutlass.min(unit, self.units - 1)
        b = u // (self.heads * LAT_VECS)
        h = u // LAT_VECS % self.heads
        dv = u % LAT_VECS
        rM = cute.make_rmem_tensor((J,), Float32)
        rS = cute.make_rmem_tensor((J,), Float32)
        rP = cute.make_rmem_tensor((ELEMS, J), Float32)
        for j in cutlass.range_constexpr(J):
            s = cutlass.min(sub + j * G, S - 1)
            rM[j] = mPML[b * S + s, h, 0]
            rS[j] = mPML[b * S + s, h, 1]
            for half in cutlass.range_constexpr(2):
                cute.copy(g2r_atom(Float32, invariant=False),
                          cute.local_tile(mPAcc[b * S + s, h, None], (4,), (dv * 2 + half,)),
                          cute.local_tile(rP[None, j], (4,), (half,)))
        top = Float32(NEG_INF)
        for j in cutlass.range_constexpr(J):
            if const_expr((j + 1) * G > S):  # some lanes of the group have no j-th split
                rM[j] = Float32(cutlass.select_(sub + j * G < S, rM[j], Float32(NEG_INF)))
            top = cutlass.max(top, rM[j])
        if const_expr(G > 1):
            top = cute.arch.warp_reduction(top, cutlass.max, threads_in_group=G)
        safe = Float32(cutlass.select_(top > Float32(NEG_INF), top, Float32(0.0)))  # no split saw a token
        rA = cute.make_rmem_tensor((ELEMS,), Float32)
        rA.fill(0.0)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(J):
            w = cute.math.exp2(rM[j] - safe)
            total = total + w * rS[j]
            rA.store(rA.load() + rP[None, j].load() * w)
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
    b, h, q, block_size = s["batch"], s["heads"], s.get("q_len", 1), s["block_size"]
    kernel = MlaAttend(b, h, d["cache"], p["scale"], p["gate_stride"], q, block_size, p.get("max_ctas", MAX_CTAS))
    blocks, max_blocks = cute.sym_int32(), cute.sym_int32()
    block_stride = cute.sym_int64(divisibility=16)

    def t(dtype, shape, stride, align=16):
        return make_fake_tensor(dtype, shape, stride, assumed_align=align)

    args = (t(BFloat16, (b, h, E), (h * E, E, 1)),  # mqa_q
            t(kernel.dtype, (blocks, block_size, E), (block_stride, E, 1)),  # kv_cache
            t(Int32, (b // q, max_blocks), (max_blocks, 1), 4),  # block_table, a row per request
            t(Int32, (b // q,), (1,), 4),  # seq_lens
            t(Float32, (1,), (1,), 4),  # kv_scale
            t(BFloat16, (h * HEAD_ROWS, L), (L, 1)),  # kv_b_proj weight
            t(BFloat16, (b, h * V_DIM), (kernel.gate_stride, 1), 2),  # gate
            t(BFloat16, (b, h * V_DIM), (h * V_DIM, 1), 2),  # out
            t(Float32, (kernel.pairs, h, L), (h * L, L, 1)),  # split partials: latent
            t(Float32, (kernel.pairs, h, 2), (h * 2, 2, 1), 4),  # split partials: max, sum
            t(BFloat16, (b, h, L), (h * L, L, 1)),  # combined latent
            t(Int32, (1,), (1,), 4),  # barrier word
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
