"""``product_gemm``: a generated kernel: the stages of a fused op's ``codegen.lowered.Products``
that read one bf16 activation as it is (their prologue only reads it), on the skinny tensor-core
GEMM's main loop (``codegen/kernels/gemm.py``, 2..64 tokens, and 1 for MXFP4 weights or a K
longer than the GEMV holds; the token count a runtime size up to the tile). Several stages of
different widths (the projections of one activation: an input projection's q, k, v and gates)
are the kernel's *parts*: each CTA tile lies within one part, whose weights it reads and whose
epilogue it runs.

The main loop is ``SkinnyGemm.multiply``, unchanged (but for MXFP4, below): weight tiles through a ``cp.async`` ring
before ``griddepcontrol.wait``, x after it, ``mma.sync.m16n8k16`` with fp32 accumulators, the
partial tile in shared memory, the K split's CTAs a cluster. What is generated:
- the weight tile: a CTA's ``rows_per_cta`` rows are ``rows_per_cta / P`` output columns of each
  of the stage's P products (a product's weight is its own tensor, or a row slice of one: the
  gate and up halves of a packed projection), so every product of a column meets in one CTA; a
  copy pass of the tile reads one product's rows (``threads / 8`` rows a pass divide a
  product's share);
- the epilogue hook: for each (token, 4 columns) a thread owns in the cluster's sum, every
  product's sums and the epilogue's inputs (rows, columns, statistics: read right after the
  wait, as the hand-written residual) go through the part's epilogue program on scalars
  (``codegen/kernels/emit.py``) to each output;
- a part narrower than a tile (a gate of 6 columns) has one tile, whose rows past the part's
  end are neither loaded nor stored; a wider part's last tile reaches back to stay in bounds;
- fp8 weights land in a staging ring of their own and each thread converts what it copied
  into the bf16 ring once resident (the main loop's per-tile hook), 16 values a copy;
- MXFP4 weights (Humming's layout, from one token) have a main loop of their own
  (``multiply_mxfp4``): the same ring of codes and scales, read by each warp straight into its
  MMA's A fragments (``mxfp4.bf16_pairs``, exact), with no bf16 weight ring.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.common import BITS, VEC
from codegen.kernels.emit import CUTE_DTYPES, fake_input, input_value, part_of, run
from codegen.kernels.gemm import ACC_VEC, TILE_K, SkinnyGemm
from codegen.kernels.mxfp4 import bf16_pairs
from codegen.kernels.warp_mma import mma_bf16
from codegen.launchers.gemm_specs import GEMM_SMEM_ONE_CTA
from codegen.launchers.generated import (
    MXFP4_STAGED_PER_ROW,
    MXFP4_TILE,
    MXFP4_WARP_N8,
    PRODUCT_SLOTS,
    is_plain,
    part_slots,
)
from codegen.lowered import MXFP4, READ, Stage


class ProductGemm(SkinnyGemm):
    """Compile-time configuration: the parts (stages of one activation, each with as many
    products), the token tile, the tiling of ``gemm_tiling`` (rows per CTA, K split, pipeline
    stages, token groups) and the row strides of the activation and of each part's epilogue
    row inputs (views of wider rows). Tensor slots are given out part by part (``part_slots``)."""

    def __init__(self, parts: tuple[Stage, ...], token_tile: int, *, rows_per_cta: int, split_k: int, stages: int,
                 token_groups: int, x_stride: int, epi_strides: tuple[tuple[int, ...], ...],
                 mxfp4_strides: tuple[tuple[int, int], ...] = ()):
        if not parts or not all(is_plain(st) for st in parts) or len({(st.k, len(st.weights)) for st in parts}) != 1:
            raise ValueError("the GEMM's parts read one activation as it is, with as many products each (a prologue "
                             "that computes runs on a rowwise kernel of its own before it)")
        self.parts, self.products = tuple(parts), len(parts[0].weights)
        if rows_per_cta % self.products:
            raise ValueError(f"{self.products} products do not share {rows_per_cta} rows a CTA")
        widths = [st.n for st in parts]
        super().__init__(token_tile, parts[0].k, sum(widths), sum(widths), rows_per_cta=rows_per_cta,
                         split_k=split_k, stages=stages, token_groups=token_groups, x_stride=x_stride)
        # fp8 weights land in a staging ring of their own (64-byte rows, 16 values a copy) and are
        # converted into the bf16 tile each thread copied, once resident (exact: E4M3 is in bf16)
        self.fp8 = parts[0].weight_dtype == "fp8_e4m3"
        if any(st.weight_dtype != parts[0].weight_dtype for st in parts):
            raise ValueError("the parts of one kernel read one weight dtype")
        # MXFP4 codes and scales land in a staging ring of their own (a thread's 16-byte copies of
        # codes with the 8 scale bytes of their rows) and are dequantized into the bf16 tile by the
        # thread that copied them, once resident
        self.mxfp4 = parts[0].weight_dtype == MXFP4
        self.pass_rows = self.threads // (4 if self.fp8 else 8)  # rows one copy pass of the weight tile covers
        if self.tile_out % self.pass_rows and not self.mxfp4:
            raise ValueError(f"{self.products} products of {self.tile_out} rows a CTA: a copy pass covers "
                             f"{self.pass_rows} rows, within one product")
        if self.mxfp4:
            if self.tile_out % MXFP4_TILE or any(st.n < self.tile_out for st in parts):
                raise ValueError(f"MXFP4: {self.tile_out} rows a tile and parts {widths} wide, where a tile holds "
                                 f"whole {MXFP4_TILE}-row tiles of a part")
            if len(mxfp4_strides) != self.products * len(parts):
                raise ValueError(f"MXFP4 strides {mxfp4_strides}: (codes, scales) row strides for each product")
        self.mxfp4_strides = tuple(tuple(x) for x in mxfp4_strides)
        if self.mxfp4:
            # the codes go from their staging ring straight into the MMA's A fragments: no bf16
            # weight ring. A warp takes one product's 64-row Humming tile (a job), ``n_ways`` split
            # the token tile's n8 groups (at most MXFP4_WARP_N8 a warp: its accumulators) and
            # ``k_ways`` the K tile's four 16-wide blocks among the warps of a job
            self.w_stage_bytes = 0
            self.smem_bytes = max(stages * self.x_stage_bytes, self.partial_bytes)
            self.humming_tiles = self.tile_out // MXFP4_TILE
            jobs, warps, n8 = self.products * self.humming_tiles, self.threads // 32, self.tile_n // 8
            ways = warps // jobs  # warps a tile: first as many n8 splits as the accumulators ask, then
            self.n_ways = max(-(-n8 // MXFP4_WARP_N8), ways // (TILE_K // 16))  # K blocks, more splits
            if warps % jobs or ways % self.n_ways or n8 % self.n_ways:
                raise ValueError(f"MXFP4: {warps} warps for {jobs} 64-row tiles of {n8} n8 token groups")
            self.k_ways = warps // jobs // self.n_ways
            if (TILE_K // 16) % self.k_ways:
                raise ValueError(f"MXFP4: {self.k_ways} warps a tile do not split its {TILE_K // 16} K blocks")
            self.warp_n8 = n8 // self.n_ways
        self.chunks = 2 * self.tile_out  # 16-byte copies of a product's codes a K tile: 4 K blocks x tile_out / 2
        self.chunk_rounds = -(-self.chunks // self.threads)
        self.staged_bytes = stages * rows_per_cta * (TILE_K if self.fp8 else MXFP4_STAGED_PER_ROW if self.mxfp4 else 0)
        if self.smem_bytes + self.staged_bytes > GEMM_SMEM_ONE_CTA:
            raise ValueError(f"{stages} stages with {parts[0].weight_dtype} staging: "
                             f"{self.smem_bytes + self.staged_bytes} bytes of shared memory, more than the "
                             f"{GEMM_SMEM_ONE_CTA} one CTA may take")
        # each part's tiles, from tile_starts[s]; a part narrower than a tile has one, masked
        self.tiles = tuple(-(-n // self.tile_out) for n in widths)
        self.tile_starts = tuple(sum(self.tiles[:s]) for s in range(len(parts)))
        self.row_tiles = sum(self.tiles)
        self.grid = self.row_tiles * split_k
        self.epi_args = [[i for i, src in enumerate(st.epilogue_from) if src[0] in READ] for st in parts]
        if len(epi_strides) != len(parts) or any(len(a) != len(e) for a, e in zip(self.epi_args, epi_strides)):
            raise ValueError(f"epilogue strides {epi_strides}: one per row input of each part")
        self.epi_strides = epi_strides
        counts = {"weights": self.products * len(parts), "epilogue_inputs": sum(map(len, self.epi_args)),
                  "outputs": sum(len(st.epilogue.outputs) for st in parts)}
        for what, count in counts.items():
            if count > PRODUCT_SLOTS[what]:
                raise ValueError(f"{count} {what.replace('_', ' ')}: the kernel takes at most {PRODUCT_SLOTS[what]}")

    def weights_per_row(self) -> int:
        return self.products

    @cute.jit
    def __call__(self, mX: cute.Tensor, w0: cute.Tensor, w1: cute.Tensor | None, w2: cute.Tensor | None,
                 w3: cute.Tensor | None, e0: cute.Tensor | None, e1: cute.Tensor | None, e2: cute.Tensor | None,
                 e3: cute.Tensor | None, y0: cute.Tensor | None, y1: cute.Tensor | None, y2: cute.Tensor | None,
                 y3: cute.Tensor | None, stream: cuda.CUstream):
        self.kernel(mX, w0, w1, w2, w3, e0, e1, e2, e3, y0, y1, y2, y3, *self.machinery()).launch(
            grid=[self.grid, 1, 1], block=[self.threads, 1, 1], cluster=self.cluster(), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, w0: cute.Tensor, w1: cute.Tensor | None, w2: cute.Tensor | None,
               w3: cute.Tensor | None, e0: cute.Tensor | None, e1: cute.Tensor | None, e2: cute.Tensor | None,
               e3: cute.Tensor | None, y0: cute.Tensor | None, y1: cute.Tensor | None, y2: cute.Tensor | None,
               y3: cute.Tensor | None, sW_layout: cute.Layout, sX_layout: cute.Layout, tiled_g2s: cute.TiledCopy,
               tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        C = const_expr(self.split_k)
        NK = const_expr(self.k_tiles)
        TO = const_expr(self.tile_out)
        tokens = mX.shape[0]
        rank = bidx % C  # clusters are C consecutive CTAs along x
        tile = bidx // C
        # the part this tile lies in, and the tile's own first column in it
        part, first = part_of(tile, self.tile_starts, TO)
        row0 = first
        for s in cutlass.range_constexpr(len(self.parts)):
            if const_expr(self.parts[s].n > TO):
                if part == s:
                    row0 = cutlass.min(first, self.parts[s].n - TO)  # the last tile reaches back to stay in bounds
        k0 = rank * (NK * TILE_K)

        # each part's products' TO weight rows from row0, K slice cut into (TO, TILE_K, NK) tiles
        weights = (w0, w1, w2, w3)
        smem = SmemAllocator()
        sW, sX, sP = self.ring(smem, sW_layout, sX_layout)
        thr_g2s = tiled_g2s.get_slice(tidx)
        w_copy, thr_w, sLand, on_tile = tiled_g2s, thr_g2s, sW, None
        loads = sCodes = sScales = None
        if const_expr(self.mxfp4):
            sCodes = smem.allocate_tensor(Int32, cute.make_layout(
                (4, self.products * self.chunks, self.stages), stride=(1, 4, 4 * self.products * self.chunks)),
                byte_alignment=16)
            sScales = smem.allocate_tensor(Uint8, cute.make_layout(
                (8, self.products * self.chunks, self.stages), stride=(1, 8, 8 * self.products * self.chunks)),
                byte_alignment=16)
            loads = (weights, sCodes, sScales, part, row0, k0, tidx)
        if const_expr(self.fp8):
            w_copy, cvt, sLand = self.fp8_staging(smem)
            thr_w = w_copy.get_slice(tidx)
            tS8 = thr_w.partition_D(sLand)
            tCvt = cvt.get_slice(tidx).partition_D(sW)

            def on_tile(kt, stage):  # the thread's own copies of tile kt, converted into the bf16 ring
                for j in cutlass.range_constexpr(self.tile_m // self.pass_rows):
                    tCvt[None, j, None, stage].store(tS8[None, j, None, stage].load().to(Float32).to(BFloat16))
        if const_expr(not self.mxfp4):
            tWgWs = []
            for s in cutlass.range_constexpr(len(self.parts)):
                for w in part_slots(self.parts, "weights", s):
                    g = cute.local_tile(cute.domain_offset((row0, k0), weights[w]), (TO, TILE_K), (0, None))
                    tWgWs.append(thr_w.partition_S(cute.make_tensor(g.iterator.align(16), g.layout)))
            # which of this thread's rows of a product's tile each copy pass holds (a narrow part's mask)
            tWcW = thr_w.partition_S(cute.local_tile(cute.make_identity_tensor((TO, NK * TILE_K)), (TO, TILE_K),
                                                     (0, None)))
            loads = (w_copy, tWgWs, thr_w.partition_D(sLand), tWcW, part)
        gX = cute.local_tile(cute.domain_offset((0, k0), mX), (self.tile_n, TILE_K), (0, None))
        gX = cute.make_tensor(gX.iterator.align(16), gX.layout)
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (self.tile_n, TILE_K), (0, None))
        tXgX, tXsX, _, x_ok = self.x_rows(thr_g2s, gX, sX, cX, tokens)
        eins = (e0, e1, e2, e3)

        def after_wait():
            return self.load_epilogue_inputs(eins, part, tidx, rank, row0, tokens)
        if const_expr(self.mxfp4):
            rEpi = self.multiply_mxfp4(tidx, loads, tiled_g2s, tXgX, tXsX, x_ok, sX, sP, sCodes, sScales, after_wait)
        else:
            rEpi = self.multiply(tidx, loads, tiled_g2s, tXgX, tXsX, x_ok, sW, sX, sP, tiled_mma, after_wait,
                                 on_tile)
        if const_expr(C > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        ys = (y0, y1, y2, y3)
        for s in cutlass.range_constexpr(len(self.parts)):
            if const_expr(len(self.parts) == 1) or part == s:
                self.epilogue(s, sP, ys, rEpi, tidx, rank, row0, first, tokens)
        if const_expr(C > 1):
            # peers may still be reading this CTA's partials (gemm.py: why relaxed)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    def fp8_staging(self, smem):
        """(the fp8 weight copy: 16 values a thread and pass, 4 threads a 64-byte row; the same
        threads' bf16 view of the ring, for the conversion; the staging ring, rows contiguous)."""
        thr = cute.make_layout((self.threads // 4, 4), stride=(4, 1))
        w_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                Float8E4M3FN, num_bits_per_copy=BITS), thr, cute.make_layout((1, 2 * VEC)))
        cvt = cute.make_tiled_copy_tv(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16,
                                                          num_bits_per_copy=BITS), thr, cute.make_layout((1, 2 * VEC)))
        staged = smem.allocate_tensor(Float8E4M3FN, cute.make_layout(
            (self.tile_m, TILE_K, self.stages), stride=(TILE_K, 1, self.tile_m * TILE_K)), byte_alignment=128)
        return w_copy, cvt, staged

    def chunk(self, tidx, i):
        """(whether it is one, K block, 16-byte column) of this thread's copy ``i`` of a product's
        codes in a K tile: the tile's 4 K blocks of ``tile_out / 2`` copies, ``threads`` a round;
        column j holds the 8 codes of lane (r, q) = (j % 32 // 4, j % 4) of 64-row tile j // 32
        (Humming's layout; trace time)."""
        c = tidx + i * self.threads
        live = True if const_expr(self.chunks % self.threads == 0) else c < self.chunks
        return live, c // (self.tile_out // 2), c % (self.tile_out // 2)

    @cute.jit
    def load_mxfp4(self, loads, kt, stage):
        """Issue the cp.async copies of K tile ``kt`` of the tile's part's MXFP4 products into
        ``stage``: each of the thread's 16 bytes of codes (``chunk``) and the 8 scale bytes of its
        8 rows (Humming keeps a lane's rows' scales side by side), which this thread dequantizes
        (``mxfp4_tile``)."""
        weights, sCodes, sScales, part, row0, k0, tidx = loads
        codes_copy = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                         Int32, num_bits_per_copy=BITS)
        scales_copy = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS),
                                          Uint8, num_bits_per_copy=64)
        kb0 = (k0 + kt * TILE_K) // 16
        for s in cutlass.range_constexpr(len(self.parts)):
            if const_expr(len(self.parts) == 1) or part == s:
                slots = part_slots(self.parts, "weights", s)
                for p in cutlass.range_constexpr(self.products):
                    codes, scales = weights[slots[2 * p]], weights[slots[2 * p + 1]]
                    for i in cutlass.range_constexpr(self.chunk_rounds):
                        live, kb, j = self.chunk(tidx, i)
                        if live:
                            src = cute.local_tile(codes[kb0 + kb, None], (4,), (row0 // 2 + j,))
                            cute.copy(codes_copy, cute.make_tensor(src.iterator.align(16), src.layout),
                                      sCodes[None, p * self.chunks + tidx + i * self.threads, stage])
                            src = cute.local_tile(scales[(kb0 + kb) // 2, None], (8,),
                                                  (row0 // 8 + j // 32 * 8 + j % 32 // 4,))
                            cute.copy(scales_copy, cute.make_tensor(src.iterator.align(8), src.layout),
                                      sScales[None, p * self.chunks + tidx + i * self.threads, stage])

    @cute.jit
    def multiply_mxfp4(self, tidx, loads, tiled_g2s, tXgX, tXsX, x_ok, sX, sP, sCodes, sScales, after_wait):
        """The MXFP4 main loop: the ring of ``multiply`` (its ``prologue``: weights before
        ``griddepcontrol.wait``, x after it, ``stages - 1`` tiles in flight), but each warp reads
        its lane's 16 bytes of codes and 8 scale bytes of a K block from the staging ring,
        dequantizes them in registers into the A fragments of its 64-row tile's four m16
        subtiles (``mxfp4.bf16_pairs``, exact for every scale byte) and multiplies them by its n8
        token groups' B fragments of x; the warps of one tile (its K blocks split ``k_ways``) add
        into the fp32 partial tile in turn. Returns ``after_wait()``'s result."""
        S = const_expr(self.stages)
        NK = const_expr(self.k_tiles)
        KW = const_expr(self.k_ways)
        NG = const_expr(self.warp_n8)
        ready = self.prologue(loads, tiled_g2s, tXgX, tXsX, x_ok, after_wait)

        warp, lane = tidx // 32, tidx % 32
        jobs = const_expr(self.products * self.humming_tiles)
        job, way = warp % jobs, warp // jobs
        kway, nway = way % KW, way // KW
        first_chunk = job // self.humming_tiles * self.chunks + job % self.humming_tiles * 32 + lane
        acc = cute.make_rmem_tensor((4, 4, NG), Float32)
        acc.fill(0.0)
        rCodes = cute.make_rmem_tensor((4,), Int32)
        rScales = cute.make_rmem_tensor((8,), Uint8)
        rPair = cute.make_rmem_tensor((2,), BFloat16)
        for kt in cutlass.range(NK, unroll=1):
            stage = kt % S
            # tile kt resident for every thread, and every warp done with tile kt - 1, whose stage
            # the next copies refill
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            if kt + (S - 1) < NK:
                self.load_tile(loads, tiled_g2s, tXgX, tXsX, x_ok, kt + (S - 1), (kt + (S - 1)) % S)
            cute.arch.cp_async_commit_group()
            for i in cutlass.range_constexpr(TILE_K // 16 // KW):
                kb = kway + i * KW
                c = first_chunk + kb * (self.tile_out // 2)
                cute.autovec_copy(sCodes[None, c, stage], rCodes)
                cute.autovec_copy(sScales[None, c, stage], rScales)
                frags = [bf16_pairs(rCodes[i3], Int32(rScales[2 * i3]), Int32(rScales[2 * i3 + 1]))
                         for i3 in range(4)]
                for g in cutlass.range_constexpr(NG):
                    token = (nway * NG + g) * 8 + lane // 4
                    b = []
                    for half in cutlass.range_constexpr(2):  # x[token, K 2q (+1)], x[token, K 2q + 8 (+1)] of block kb
                        pair = kb * 8 + lane % 4 + 4 * half
                        cute.autovec_copy(cute.local_tile(sX[token, None, stage], (2,), (pair,)), rPair)
                        b.append(cute.recast_tensor(rPair, Int32)[0])
                    for i3 in cutlass.range_constexpr(4):
                        out = mma_bf16(frags[i3], b[0], b[1], [acc[j, i3, g] for j in range(4)])
                        for j in cutlass.range_constexpr(4):
                            acc[j, i3, g] = out[j]

        # this CTA's partial tile -> shared memory (over the ring's bytes), the K ways in turn
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        row0 = job // self.humming_tiles * self.tile_out + job % self.humming_tiles * MXFP4_TILE + lane // 4
        for w in cutlass.range_constexpr(KW):
            if kway == w:
                for g in cutlass.range_constexpr(NG):
                    for i3 in cutlass.range_constexpr(4):
                        for j in cutlass.range_constexpr(4):
                            row = row0 + 16 * i3 + j // 2 * 8
                            col = (nway * NG + g) * 8 + lane % 4 * 2 + j % 2
                            if const_expr(w == 0):
                                sP[row, col] = acc[j, i3, g]
                            else:
                                sP[row, col] = sP[row, col] + acc[j, i3, g]
            cute.arch.sync_threads()
        return ready

    @cute.jit
    def load_w(self, loads, kt, stage):
        """Issue the cp.async copies of K tile ``kt`` of the tile's part's products into
        ``stage``: copy pass j of the CTA tile is pass ``j % (TO / pass_rows)`` of product
        ``j // (TO / pass_rows)``; a narrow part's rows past its end are not read."""
        if const_expr(self.mxfp4):
            self.load_mxfp4(loads, kt, stage)
            return
        tiled_g2s, tWgWs, tWsW, tWcW, part = loads
        per = const_expr(self.tile_out // self.pass_rows)
        for s in cutlass.range_constexpr(len(self.parts)):
            if const_expr(len(self.parts) == 1) or part == s:
                for p, w in enumerate(part_slots(self.parts, "weights", s)):
                    for j in cutlass.range_constexpr(per):
                        if const_expr(self.parts[s].n >= self.tile_out) or tWcW[0, j, 0, 0][0] < self.parts[s].n:
                            cute.copy(tiled_g2s, tWgWs[w][None, j, None, kt], tWsW[None, p * per + j, None, stage])

    @cute.jit
    def load_epilogue_inputs(self, eins, part, tidx, rank, row0, tokens):
        """``rEpi[i, e, j]``: the tile's part's epilogue input i at the (token, column) of element e
        of this thread's round j (the mapping of ``epilogue``), in fp32."""
        rEpi = cute.make_rmem_tensor((max(1, *map(len, self.epi_args)), ACC_VEC, self.store_rounds), Float32)
        for s in cutlass.range_constexpr(len(self.parts)):
            if const_expr(len(self.epi_args[s]) > 0):
                if const_expr(len(self.parts) == 1) or part == s:
                    epi, n_part = self.parts[s].epilogue, self.parts[s].n
                    for j in cutlass.range_constexpr(self.store_rounds):
                        t, mv, live = self.store_round(tidx, rank, j)
                        if live and t < tokens:
                            for i, slot in enumerate(part_slots(self.parts, "inputs", s)):
                                kind, _ = epi.inputs[self.epi_args[s][i]]
                                source = self.parts[s].epilogue_from[self.epi_args[s][i]][0]
                                for e in cutlass.range_constexpr(ACC_VEC):
                                    n = cutlass.min(row0 + mv * ACC_VEC + e, n_part - 1)  # a narrow part's tail
                                    rEpi[i, e, j] = input_value(eins[slot], source, kind, t, n)
        return rEpi

    @cute.jit
    def epilogue(self, s, sP, ys, rEpi, tidx, rank, row0, first, tokens):
        """Part ``s``'s epilogue: sum this thread's (token, 4 columns) of every product over the
        cluster's partial tiles (product p's columns are rows ``p * TO ..`` of the tile), run the
        part's epilogue program on each column's scalars and store its outputs; columns below
        ``first`` (the last tile's overlap) are its neighbour's to store, columns past the
        part's end nobody's."""
        stage = self.parts[s]
        epi = stage.epilogue
        kinds = epi.kinds
        P = const_expr(self.products)
        groups = const_expr(self.tile_out // ACC_VEC)  # 4-row groups from one product's rows to the next's
        outs = [ys[o] for o in part_slots(self.parts, "outputs", s)]
        sums = [cute.make_rmem_tensor((ACC_VEC, 1), Float32) for _ in range(P)]
        for j in cutlass.range_constexpr(self.store_rounds):
            t, mv, live = self.store_round(tidx, rank, j)
            if live and t < tokens:
                for p in cutlass.range_constexpr(P):
                    self.cluster_sum(sP, mv + p * groups, t, sums[p])
                for e in cutlass.range_constexpr(ACC_VEC):
                    n = row0 + mv * ACC_VEC + e
                    vals = [sums[src[1]][e, 0] if const_expr(src[0] == "acc") else
                            rEpi[self.epi_args[s].index(i), e, j] for i, src in enumerate(stage.epilogue_from)]
                    run(epi, vals)
                    if n >= first and (const_expr(stage.n % self.tile_out == 0 or stage.n > self.tile_out) or
                                       n < stage.n):
                        for o in cutlass.range_constexpr(len(epi.outputs)):
                            value, dtype, _ = epi.outputs[o]
                            if const_expr(kinds[value] == "row"):
                                outs[o][t, n] = vals[value].to(CUTE_DTYPES[dtype])
                            elif n == 0:
                                outs[o][t, 0] = vals[value].to(CUTE_DTYPES[dtype])


def build(spec) -> tuple[ProductGemm, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size up to the token tile)."""
    p = spec.param_dict
    parts = tuple(Stage.from_params(st) for st in p["parts"])
    kernel = ProductGemm(parts, spec.shape_dict["token_tile"], rows_per_cta=p["rows_per_cta"], split_k=p["split_k"],
                         stages=p["stages"], token_groups=p["token_groups"], x_stride=p["x_stride"],
                         epi_strides=tuple(tuple(e) for e in p["epi_strides"]),
                         mxfp4_strides=p.get("mxfp4_strides", ()))
    tokens = cute.sym_int32()

    ws, eins, ys = [], [], []
    for st, args, strides in zip(parts, kernel.epi_args, kernel.epi_strides, strict=True):
        epi, kinds = st.epilogue, st.epilogue.kinds
        if kernel.mxfp4:  # each product's codes (int32 [K/16, 2N]) and scale bytes ([K/32, N]), row-strided
            for codes_stride, scales_stride in kernel.mxfp4_strides[len(ws) // 2:len(ws) // 2 + len(st.weights)]:
                ws += [make_fake_tensor(Int32, (st.k // 16, 2 * st.n), (codes_stride, 1), assumed_align=16),
                       make_fake_tensor(Uint8, (st.k // 32, st.n), (scales_stride, 1), assumed_align=16)]
        else:
            ws += [make_fake_tensor(CUTE_DTYPES[st.weight_dtype], (st.n, st.k), (st.k, 1), assumed_align=16)
                   for _ in st.weights]
        eins += [fake_input(*epi.inputs[i], tokens, st.n, stride, source=st.epilogue_from[i][0])
                 for i, stride in zip(args, strides, strict=True)]
        ys += [fake_input(kinds[v], dtype, tokens, st.n) for v, dtype, _ in epi.outputs]

    def pad(xs, size):
        return [*xs, *[None] * (size - len(xs))]
    x = make_fake_tensor(BFloat16, (tokens, parts[0].k), (kernel.x_stride, 1), assumed_align=16)
    return kernel, (x, *pad(ws, 4), *pad(eins, 4), *pad(ys, 4), make_fake_stream(use_tvm_ffi_env_stream=True))
