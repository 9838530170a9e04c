"""``mla_q_front``: MLA's query front for decode (``k3f::mla_q_front``), 1..64 tokens, one kernel.

The math is ``rewriter/model/layers/mla.py:mla_q_front`` with ``rewriter/model/ops.py``'s
``mla_cache_insert`` (the CPU reference of ``k3f::mla_q_front``), per token ``t`` and head
``h`` (q LoRA 1536, kv LoRA L = 512, nope P = 128, rope R = 64):

    qn        = bf16(rms_norm(q_c[t]) * q_a_norm)              (fp32, as common.rms_norm)
    q         = bf16(qn @ q_b[h * 192 : (h + 1) * 192]^T)      (per head: 128 nope, then 64 rope rows)
    ql_nope   = bf16(q[:128] @ W_UK[h]),  W_UK[h][p, l] = kv_b[h * 256 + p, l]
    out[t, h] = [ql_nope (512) | q[128:] (64)]
    cache[slot // bs, slot % bs] = [bf16(rms_norm(kv_c[t]) * kv_a_norm) | k_pe[t]]   (slot >= 0)

both products with fp32 accumulation (``mma.sync.m16n8k16`` bf16 -> fp32). The cache is bf16,
or fp8 E4M3 of value / kv_scale (vLLM's uint8 storage): an IEEE division, then
``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even, +-448 for anything larger, Inf
included: what torch's ``.to(float8_e4m3fn)`` gives), addressed through the cache's real
block and entry strides (runtime values, as vLLM may page it); negative slots store nothing.

Work split: grid ``8 H`` CTAs of 256 threads (8 warps), a thread-block cluster of the 8 CTAs
of one head; CTA rank ``r``:
- phase A (``q_b_proj``): the 24 rows nope ``[16 r, 16 r + 16)`` and rope ``[8 r, 8 r + 8)`` of
  its head as 3 MMA n-tiles of 8 rows, warp ``w`` taking K ``[192 w, 192 w + 192)``: a lane
  holds 18 128-bit vectors of the rows in registers (``ld.global.L1::no_allocate.L2::256B``,
  all issued before ``griddepcontrol.wait``), so q_b is read from HBM once whatever the
  tokens. The vectors are the MMA's B fragments as they are: the K order inside an MMA is
  free, so lane ``(g, q)``'s 8 consecutive values at ``k0 + 8q`` serve two k16 steps, and
  its A fragments are the same 128-bit slice of two token rows of the normed q_c. Tokens in
  chunks of 16 (one m-tile): the RMSNorm prologue (warp ``w`` normalizes chunk rows ``w`` and
  ``w + 8``, six 128-bit vectors per lane, a butterfly for the sum of squares) stages the
  chunk in shared memory (the next chunk's q_c loads go out before this chunk's MMAs); the
  8 warps' K partial sums meet in shared memory; rope rows go straight to the output, nope
  rows to this CTA's shared memory ``[T, 16]`` (bf16, as the reference rounds q);
- the cluster barrier (arrive, the latent cache insert, wait);
- phase B (the W_UK absorption): every CTA gathers the head's 128 q_nope values of every
  token from its peers' shared memory (distributed shared memory, 128-bit reads) into its
  own, then computes ql_nope columns ``[64 r, 64 r + 64)`` with MMAs: warp ``w`` the 8
  columns ``64 r + 8 w ..``, all 128 p (``ldmatrix.trans`` of its W_UK slice, 128 x 64 bf16
  copied to shared memory by ``cp.async`` before ``griddepcontrol.wait``; ``ldmatrix`` of
  the gathered q_nope);
- a last cluster arrive / wait so no CTA exits while a peer may still read its shared memory.

The latent cache insert: token ``t`` belongs to warp ``t // (8 H)`` of CTA ``t % (8 H)``: its
lanes hold 16 consecutive kv_c values each (two 128-bit loads), a butterfly gives the sum of
squares, lanes 0..3 carry k_pe; each lane stores its 16 values with 128-bit stores. Up to 16
tokens (one chunk) the slot and the kv norm weight are read before the wait and kv_c and k_pe
right after it, so the insert between the cluster's arrive and wait is compute and stores.

Programmatic dependent launch: before ``griddepcontrol.wait`` only weights (the q_b rows, the
W_UK slice, q_a_norm), which no kernel writes; ``launch_dependents`` follows the wait at once.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import BITS, VEC, g2r_atom, g2r_stream_atom, r2s_atom
from codegen.kernels.warp_mma import ldmatrix_x4, mma_bf16, words

Q_LORA, KV_LORA, NOPE, ROPE = 1536, 512, 128, 64
ENTRY = KV_LORA + ROPE  # 576: a cache entry and an output row per head
HEAD_ROWS = NOPE + ROPE  # q_b rows per head
KV_B_ROWS = 2 * NOPE  # kv_b rows per head: W_UK then W_UV (v_dim = nope = 128)
CLUSTER = 8  # CTAs per head
WARPS = 8
THREADS = 32 * WARPS
NOPE_ROWS, ROPE_ROWS = NOPE // CLUSTER, ROPE // CLUSTER  # 16 + 8 q_b rows per CTA
ROWS = NOPE_ROWS + ROPE_ROWS  # 24: three n-tiles of 8
NTILES = ROWS // 8
K_WARP = Q_LORA // WARPS  # 192 K per warp in phase A
BLOCKS = K_WARP // 32  # 6 blocks of 32 K (two k16 MMA steps each) per warp
LANE_VECS = Q_LORA // VEC // 32  # 6 vectors of a q_c row per lane (the norm prologue)
M_TILE = 16  # tokens per MMA m-tile, and per phase A chunk
X_STRIDE = Q_LORA + 32  # sX row (elements): 64 bytes of padding, so 2 rows x 64 B hit distinct banks
COLS = KV_LORA // CLUSTER  # 64 ql_nope columns per CTA
W_STRIDE = COLS + VEC  # sW row: 16 bytes of padding (ldmatrix's 8 rows in distinct banks)
Q_STRIDE = NOPE + VEC  # sQ row, likewise
MAX_TOKENS = 64
CACHE_DTYPES = ("bf16", "fp8")
SLOT_DTYPES = {"int64": Int64, "int32": Int32}
class MlaQFront:
    """Compile-time configuration: tokens T, heads H, the cache dtype (bf16 | fp8), the slot
    dtype, eps and the row strides of q_c, kv_c and k_pe (views of the input projection's
    output). The cache's block size, block count and strides are runtime values."""

    def __init__(self, tokens: int, heads: int, cache: str, eps: float, q_stride: int = Q_LORA,
                 kv_stride: int = KV_LORA, pe_stride: int = ROPE, slot: str = "int64"):
        if not 1 <= tokens <= MAX_TOKENS:
            raise ValueError(f"tokens {tokens} outside 1..{MAX_TOKENS}")
        if heads < 1:
            raise ValueError(f"heads {heads} must be >= 1")
        if cache not in CACHE_DTYPES:
            raise ValueError(f"cache dtype {cache!r}: one of {CACHE_DTYPES}")
        if slot not in SLOT_DTYPES:
            raise ValueError(f"slot dtype {slot!r}: one of {tuple(SLOT_DTYPES)}")
        for name, stride, width in (("q_c", q_stride, Q_LORA), ("kv_c", kv_stride, KV_LORA),
                                    ("k_pe", pe_stride, ROPE)):
            if stride < width or stride % VEC:
                raise ValueError(f"{name} row stride {stride}: at least {width}, a multiple of {VEC}")
        self.tokens, self.heads, self.cache, self.eps, self.slot = tokens, heads, cache, float(eps), slot
        self.q_stride, self.kv_stride, self.pe_stride = q_stride, kv_stride, pe_stride
        self.fp8 = cache == "fp8"
        self.mtiles = -(-tokens // M_TILE)  # phase A chunks, phase B m-tiles
        self.rows_per_warp = 1 if tokens <= WARPS else 2  # norm prologue: chunk rows w (and w + 8)
        self.ctas = heads * CLUSTER
        self.insert_warps = -(-tokens // self.ctas)  # warps per CTA with a token to insert
        self.gather = NOPE // VEC * tokens  # 128-bit q_nope vectors a CTA gathers (16 per token)

    @cute.jit
    def __call__(self, mQc: cute.Tensor, mKv: cute.Tensor, mPe: cute.Tensor, mQNorm: cute.Tensor,
                 mKvNorm: cute.Tensor, mQb: cute.Tensor, mKvb: cute.Tensor, mCache: cute.Tensor, mSlot: cute.Tensor,
                 mScale: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mQc, mKv, mPe, mQNorm, mKvNorm, mQb, mKvb, mCache, mSlot, mScale, mOut).launch(
            grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], cluster=[CLUSTER, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mQc: cute.Tensor, mKv: cute.Tensor, mPe: cute.Tensor, mQNorm: cute.Tensor,
               mKvNorm: cute.Tensor, mQb: cute.Tensor, mKvb: cute.Tensor, mCache: cute.Tensor, mSlot: cute.Tensor,
               mScale: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        T = const_expr(self.tokens)
        RW = const_expr(self.rows_per_warp)
        head = bidx // CLUSTER
        rank = bidx % CLUSTER
        g = lane // 4  # MMA fragment row group
        q = lane % 4
        ld_w = g2r_stream_atom(BFloat16)
        ld_x = g2r_atom(BFloat16)
        st_s = r2s_atom(BFloat16)
        g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=BITS)

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(BFloat16, cute.make_layout((M_TILE, Q_LORA), stride=(X_STRIDE, 1)),
                                  byte_alignment=16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((ROWS, M_TILE, WARPS), stride=(1, ROWS, ROWS * M_TILE)),
                                     byte_alignment=16)
        sQn = smem.allocate_tensor(BFloat16, cute.make_layout((T, NOPE_ROWS), stride=(NOPE_ROWS, 1)),
                                   byte_alignment=16)  # this CTA's q_nope rows: what the peers read
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout((self.mtiles * M_TILE, NOPE), stride=(Q_STRIDE, 1)),
                                  byte_alignment=16)
        sW = smem.allocate_tensor(BFloat16, cute.make_layout((NOPE, COLS), stride=(W_STRIDE, 1)), byte_alignment=16)
        sNw = smem.allocate_tensor(BFloat16, cute.make_layout((Q_LORA,)), byte_alignment=16)

        # ---- weights only, before griddepcontrol.wait ------------------------------------------
        # q_a_norm -> shared memory (cp.async group 0)
        if tidx < Q_LORA // VEC:
            cute.copy(g2s, cute.local_tile(mQNorm, (VEC,), (tidx,)), cute.local_tile(sNw, (VEC,), (tidx,)))
        cute.arch.cp_async_commit_group()
        # this CTA's W_UK slice -> shared memory (group 1): kv_b rows h * 256 + p, columns [64 r, 64 r + 64)
        for j in cutlass.range_constexpr(NOPE * COLS // VEC // THREADS):
            wi = tidx + j * THREADS
            wp = wi // (COLS // VEC)
            wc = wi % (COLS // VEC)
            cute.copy(g2s, cute.local_tile(mKvb[head * KV_B_ROWS + wp, None], (VEC,), (rank * (COLS // VEC) + wc,)),
                      cute.local_tile(sW[wp, None], (VEC,), (wc,)))
        cute.arch.cp_async_commit_group()
        # q_b rows as B fragments: n-tile j row g is local row 8 j + g (nope 16 r + n for n < 16, else
        # rope 8 r + n - 16); block b's vector at K 192 w + 32 b + 8 q
        rW = cute.make_rmem_tensor((VEC, BLOCKS, NTILES), BFloat16)
        for j in cutlass.range_constexpr(NTILES):
            if const_expr(j * 8 < NOPE_ROWS):
                row = head * HEAD_ROWS + rank * NOPE_ROWS + j * 8 + g
            else:
                row = head * HEAD_ROWS + NOPE + rank * ROPE_ROWS + j * 8 - NOPE_ROWS + g
            for b in cutlass.range_constexpr(BLOCKS):
                cute.copy(ld_w, cute.local_tile(mQb[row, None], (VEC,), (warp * (K_WARP // VEC) + b * 4 + q,)),
                          rW[None, b, j])
        rWw = words(rW)  # word 4 (b + 6 j) + i

        # the cache insert's token (one a warp). With one chunk of tokens (up to 16) its slot
        # (vLLM's metadata: no kernel of the step writes it) and the kv norm weight are read
        # before the wait, its kv_c and k_pe right after it, all held across phase A: read where
        # the insert runs, between the cluster's arrive and wait, they were a round trip (two:
        # the slot first) on the way to phase B. (Held across several chunks they spill.)
        early = const_expr(self.mtiles == 1)
        t_ins = bidx + self.ctas * warp
        ins = t_ins < self.tokens
        if const_expr(self.insert_warps < WARPS):
            ins = ins & (warp < self.insert_warps)
        slot = Int64(-1)
        rKvNw = cute.make_rmem_tensor((2 * VEC,), BFloat16)
        rKv = cute.make_rmem_tensor((2 * VEC,), BFloat16)
        rPe = cute.make_rmem_tensor((2 * VEC,), BFloat16)
        if const_expr(early):
            if ins:
                slot = self.insert_weights(t_ins, lane, mSlot, mKvNorm, rKvNw)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(early):
            if ins:
                self.insert_inputs(t_ins, lane, mKv, mPe, rKv, rPe)

        # ---- phase A: RMSNorm(q_c) + this CTA's 24 q_b rows, in chunks of 16 tokens ---------------------
        rX = cute.make_rmem_tensor((VEC, LANE_VECS, RW), BFloat16)
        self.load_x(mQc, rX, 0, warp, lane, ld_x)
        cute.arch.cp_async_wait_group(1)  # q_a_norm landed (W_UK may still be in flight)
        cute.arch.barrier()
        rNw = cute.make_rmem_tensor((VEC,), BFloat16)
        rXs = cute.make_rmem_tensor((VEC,), BFloat16)
        rA = cute.make_rmem_tensor((VEC, 2), BFloat16)  # the A slices of rows g and g + 8
        rAw = words(rA)
        rC = cute.make_rmem_tensor((4, NTILES), Float32)
        for ch in cutlass.range(self.mtiles, unroll=1):
            base = ch * M_TILE
            # the norm prologue: rows w (and w + 8) of the chunk, whole rows per warp
            for rr in cutlass.range_constexpr(RW):
                sq = Float32(0.0)
                for s in cutlass.range_constexpr(LANE_VECS):
                    xf = rX[None, s, rr].load().to(Float32)
                    sq = sq + (xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                inv = cute.math.rsqrt(cute.arch.warp_reduction(sq, operator.add) / Float32(Q_LORA)
                                      + Float32(self.eps))
                for s in cutlass.range_constexpr(LANE_VECS):
                    cute.autovec_copy(cute.local_tile(sNw, (VEC,), (s * 32 + lane,)), rNw)
                    rXs.store(((rX[None, s, rr].load().to(Float32) * inv) * rNw.load().to(Float32)).to(BFloat16))
                    cute.copy(st_s, rXs, cute.local_tile(sX[warp + 8 * rr, None], (VEC,), (s * 32 + lane,)))
            cute.arch.barrier()
            if const_expr(self.mtiles > 1):
                if ch + 1 < self.mtiles:
                    self.load_x(mQc, rX, base + M_TILE, warp, lane, ld_x)  # in flight during the MMAs

            rC.fill(0.0)
            for b in cutlass.range_constexpr(BLOCKS):
                k = warp * K_WARP + b * 32 + q * VEC
                cute.autovec_copy(cute.local_tile(sX[g, None], (VEC,), (k // VEC,)), rA[None, 0])
                cute.autovec_copy(cute.local_tile(sX[g + 8, None], (VEC,), (k // VEC,)), rA[None, 1])
                for h2 in cutlass.range_constexpr(2):  # two k16 steps: words (0, 1) and (2, 3)
                    a = [rAw[2 * h2], rAw[4 + 2 * h2], rAw[2 * h2 + 1], rAw[4 + 2 * h2 + 1]]
                    for j in cutlass.range_constexpr(NTILES):
                        w0 = 4 * (b + BLOCKS * j) + 2 * h2
                        cc = mma_bf16(a, rWw[w0], rWw[w0 + 1], [rC[i, j] for i in range(4)])
                        for i in cutlass.range_constexpr(4):
                            rC[i, j] = cc[i]
            # the warps' K partial sums: c0, c1 at (token g, rows 8 j + 2 q, + 1), c2, c3 at token g + 8
            for j in cutlass.range_constexpr(NTILES):
                for i in cutlass.range_constexpr(4):
                    sPart[8 * j + 2 * q + i % 2, g + 8 * (i // 2), warp] = rC[i, j]
            cute.arch.barrier()
            for e in cutlass.range_constexpr(-(-ROWS * M_TILE // THREADS)):
                idx = tidx + e * THREADS
                n = idx % ROWS
                m = idx // ROWS
                tg = base + m
                if idx < ROWS * M_TILE and tg < T:
                    total = sPart[n, m, 0]
                    for w in cutlass.range_constexpr(1, WARPS):
                        total = total + sPart[n, m, w]
                    val = total.to(BFloat16)
                    if n < NOPE_ROWS:
                        sQn[tg, n] = val
                    else:
                        mOut[tg, head, KV_LORA + rank * ROPE_ROWS + n - NOPE_ROWS] = val
            # (the next chunk's barrier orders its sX / sPart writes after these reads)

        # ---- the cluster barrier; the latent cache insert while the peers arrive ------------------------
        cute.arch.cluster_arrive()
        if ins:
            if const_expr(not early):
                slot = self.insert_weights(t_ins, lane, mSlot, mKvNorm, rKvNw)
                self.insert_inputs(t_ins, lane, mKv, mPe, rKv, rPe)
            self.cache_insert(slot, lane, rKv, rPe, rKvNw, mCache, mScale)
        cute.arch.cluster_wait()

        # ---- phase B: gather the head's q_nope, then ql_nope columns [64 r, 64 r + 64) ---------------
        # vector i: token i // 16, peer (i // 2) % 8, half i % 2 of the peer's 16 rows
        for j in cutlass.range_constexpr(-(-self.gather // THREADS)):
            i = tidx + j * THREADS
            if const_expr((j + 1) * THREADS <= self.gather) or i < self.gather:
                t = i // (2 * CLUSTER)
                peer = (i // 2) % CLUSTER
                half = i % 2
                src = cute.make_tensor(cute.arch.map_dsmem_ptr(sQn.iterator, peer), sQn.layout)
                cute.autovec_copy(cute.local_tile(src[t, None], (VEC,), (half,)), rXs)
                cute.autovec_copy(rXs, cute.local_tile(sQ[t, None], (VEC,), (peer * 2 + half,)))
        cute.arch.cluster_arrive()  # done reading the peers' shared memory (waited for at the end)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        # B fragments of warp w's 8 columns, all 128 p: ldmatrix.trans x4 call x gives k-tiles 2x, 2x + 1
        sW_addr = sW.iterator.toint()
        sQ_addr = sQ.iterator.toint()
        rB = cute.make_rmem_tensor((4, NOPE // 32), Int32)
        for x in cutlass.range_constexpr(NOPE // 32):
            bw = ldmatrix_x4(sW_addr + ((x * 32 + lane) * W_STRIDE + warp * 8) * 2, True)
            for i in cutlass.range_constexpr(4):
                rB[i, x] = bw[i]
        # A: lane l addresses row (l % 8) + 8 ((l // 8) % 2), k 8 (l // 16) of the k-tile
        a_row = lane % 8 + 8 * ((lane // 8) % 2)
        a_col = 8 * (lane // 16)
        rO = cute.make_rmem_tensor((2,), BFloat16)
        for mt in cutlass.range_constexpr(self.mtiles):
            acc = [Float32(0.0)] * 4
            for kt in cutlass.range_constexpr(NOPE // 16):
                qa = ldmatrix_x4(sQ_addr + ((mt * M_TILE + a_row) * Q_STRIDE + kt * 16 + a_col) * 2, False)
                acc = mma_bf16(qa, rB[2 * (kt % 2), kt // 2], rB[2 * (kt % 2) + 1, kt // 2], acc)
            for hh in cutlass.range_constexpr(2):
                t = mt * M_TILE + g + 8 * hh
                if const_expr((mt * M_TILE + 8 * hh + 8) <= T) or t < T:
                    rO[0] = acc[2 * hh].to(BFloat16)
                    rO[1] = acc[2 * hh + 1].to(BFloat16)
                    cute.autovec_copy(rO, cute.local_tile(mOut[t, head, None], (2,),
                                                          (rank * (COLS // 2) + warp * 4 + q,)))
        cute.arch.cluster_wait()  # no CTA exits while a peer may still read its q_nope rows

    @cute.jit
    def load_x(self, mQc: cute.Tensor, rX: cute.Tensor, base: Int32, warp: Int32, lane: Int32, ld_x: cute.CopyAtom):
        """The q_c vectors ``32 s + lane`` of chunk rows ``warp`` (and ``warp + 8``) into ``rX``; rows past
        the last token re-read token T-1 (their results are never stored)."""
        for rr in cutlass.range_constexpr(self.rows_per_warp):
            t = cutlass.min(base + warp + 8 * rr, self.tokens - 1)
            for s in cutlass.range_constexpr(LANE_VECS):
                cute.copy(ld_x, cute.local_tile(mQc[t, None], (VEC,), (s * 32 + lane,)), rX[None, s, rr])

    @cute.jit
    def insert_weights(self, t: Int32, lane: Int32, mSlot: cute.Tensor, mKvNorm: cute.Tensor, rNw: cute.Tensor):
        """Token ``t``'s slot (returned) and lane ``l``'s 16 values of the kv norm weight into ``rNw``:
        what the insert reads that no kernel of the step writes."""
        cute.autovec_copy(cute.local_tile(mKvNorm, (2 * VEC,), (lane,)), rNw)
        return Int64(mSlot[t])

    @cute.jit
    def insert_inputs(self, t: Int32, lane: Int32, mKv: cute.Tensor, mPe: cute.Tensor, rKv: cute.Tensor,
                      rPe: cute.Tensor):
        """Lane ``l``'s 16 kv_c values of token ``t`` into ``rKv``, and k_pe's (lanes 0..3) into ``rPe``."""
        cute.autovec_copy(cute.local_tile(mKv[t, None], (2 * VEC,), (lane,)), rKv)
        cute.autovec_copy(cute.local_tile(mPe[t, None], (2 * VEC,), (cutlass.min(lane, ROPE // (2 * VEC) - 1),)), rPe)

    @cute.jit
    def cache_insert(self, slot: Int64, lane: Int32, rKv: cute.Tensor, rPe: cute.Tensor, rNw: cute.Tensor,
                     mCache: cute.Tensor, mScale: cute.Tensor):
        """One warp writes its token's cache entry (read ahead: its ``slot``, lane ``l``'s 16 kv_c
        values ``[16 l, 16 l + 16)`` in ``rKv`` with the norm weight's in ``rNw``, lanes 0..3 k_pe's
        in ``rPe``) unless the slot is negative: the normed kv_c, then k_pe."""
        xf = rKv.load().to(Float32)
        sq = cute.arch.warp_reduction((xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), operator.add)
        inv = cute.math.rsqrt(sq / Float32(KV_LORA) + Float32(self.eps))
        normed = ((xf * inv) * rNw.load().to(Float32)).to(BFloat16)
        if slot >= 0:
            s32 = Int32(slot)
            bs = Int32(mCache.shape[1])
            blk = s32 // bs
            entry = mCache[blk, s32 - blk * bs, None]
            if const_expr(self.fp8):
                scale = Float32(mScale[0])
                self.store_fp8(normed.to(Float32) / scale, entry, lane)
                if lane < ROPE // (2 * VEC):
                    self.store_fp8(rPe.load().to(Float32) / scale, entry, KV_LORA // (2 * VEC) + lane)
            else:
                rN = cute.make_rmem_tensor((2 * VEC,), BFloat16)
                rN.store(normed)
                cute.autovec_copy(rN, cute.local_tile(entry, (2 * VEC,), (lane,)))
                if lane < ROPE // (2 * VEC):
                    cute.autovec_copy(rPe, cute.local_tile(entry, (2 * VEC,), (KV_LORA // (2 * VEC) + lane,)))

    @cute.jit
    def store_fp8(self, values, entry: cute.Tensor, idx: Int32):
        """16 fp32 values as E4M3 bytes into vector ``idx`` (16 bytes) of a cache entry."""
        r8 = cute.make_rmem_tensor((2 * VEC,), cutlass.Float8E4M3FN)
        r8.store(values.to(cutlass.Float8E4M3FN))
        cute.autovec_copy(cute.make_tensor(cute.recast_ptr(r8.iterator, dtype=Uint8), r8.layout),
                          cute.local_tile(entry, (2 * VEC,), (idx,)))


def build(spec) -> tuple[MlaQFront, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the cache's
    block count, block size and strides are runtime values)."""
    s, p = spec.shape_dict, spec.param_dict
    t, h = s["tokens"], s["heads"]
    kernel = MlaQFront(t, h, p["cache"], p["eps"], q_stride=p["q_stride"], kv_stride=p["kv_stride"],
                       pe_stride=p["pe_stride"], slot=p["slot"])
    cache_dtype, cache_vec = (Uint8, 16) if kernel.fp8 else (BFloat16, VEC)  # elements per 16 bytes
    blocks, block_size = cute.sym_int32(), cute.sym_int32()
    block_stride, entry_stride = cute.sym_int64(divisibility=cache_vec), cute.sym_int64(divisibility=cache_vec)
    slot_dtype = SLOT_DTYPES[kernel.slot]

    def bf16(shape, stride, align=16):
        return make_fake_tensor(BFloat16, shape, stride, assumed_align=align)

    return kernel, (bf16((t, Q_LORA), (kernel.q_stride, 1)), bf16((t, KV_LORA), (kernel.kv_stride, 1)),
                    bf16((t, ROPE), (kernel.pe_stride, 1)), bf16((Q_LORA,), (1,)), bf16((KV_LORA,), (1,)),
                    bf16((h * HEAD_ROWS, Q_LORA), (Q_LORA, 1)), bf16((h * KV_B_ROWS, KV_LORA), (KV_LORA, 1)),
                    make_fake_tensor(cache_dtype, (blocks, block_size, ENTRY), (block_stride, entry_stride, 1),
                                     assumed_align=16),
                    make_fake_tensor(slot_dtype, (t,), (1,), assumed_align=slot_dtype.width // 8),
                    make_fake_tensor(Float32, (1,), (1,), assumed_align=4),
                    bf16((t, h, ENTRY), (h * ENTRY, ENTRY, 1), align=4),
                    make_fake_stream(use_tvm_ffi_env_stream=True))
