"""The tensor-core skinny GEMM of decode (2..64 tokens): the output projection
(``o_proj_gemm``), the dense MLP's two projections and the shared experts' (``mlp_gate_up_gemm``,
``mlp_down_gemm``) and the latent tail (``latent_tail_gemm``); the generated ``product_gemm`` is
built on its main loop.

Computes ``y[T, n] = sum_k x[T, k] * W[n, k]`` (``torch.nn.functional.linear(x, W)``, fp32
accumulation, bf16 result) for the first ``rows_out`` rows of the weight; the padding rows
after them are neither read nor written. With ``glu`` (the gate/up projection of a
gated MLP, ``W = [gate; up]``, 2I rows) the output is ``act(gate_c, up_c)`` per channel c < I
(SiTU or SiLU-and-mul, ``common.gated_act``): a CTA's 128 weight rows are 64 gate rows and
the 64 up rows of the same channels, so the activation is applied where the cluster's
partial sums meet, and the [T, 2I] projection never leaves the chip. With ``norm_eps`` (the
latent tail: RMSNorm before the projection) each x tile is multiplied by the norm weight in
shared memory as it lands (by the thread that copied it; the norm weight, staged by all the
threads, is behind one barrier before the first tile) while its
squares are summed per token, the cluster's partial sums of squares meet with the partial
tiles and the epilogue scales each token's row by ``rsqrt(mean(x^2) + eps)`` (the reference
scales before rounding, this kernel after the projection: the same math, bf16 rounding apart);
with ``residual`` the epilogue adds ``r`` in bf16, ``y = bf16(bf16(acc) + r)`` (each thread's
``r`` read right after the wait, so no load stands between the cluster's sums and the stores). x and r may be
row-strided views.

Work split (decode is bound by reading W once from HBM; x is small and stays in L2):
- the MMA's M is the weight rows, its N the tokens (padded to ``token_tile``, a multiple of 16;
  the real count T is a runtime size), K is streamed. One CTA owns ``rows_per_cta`` rows
  (128, 64 or 32) and a ``1 / split_k`` slice of K; its warps are one or two token groups
  (each all the rows, 4 warps of 32 or 16 rows, 2 of 16 on 32-row tiles, over its half of
  the token tile), all sharing the shared-memory tiles; the ``split_k`` CTAs of one row tile
  form a cluster. A whole CTA tile reads x's K slice once, so x costs
  ``token_tile / rows_per_cta`` of the weight bytes in L2 traffic whatever the split; the
  split only fills the SMs (3206 rows / 128 = 26 tiles at TP 16);
- W and x tiles of 64 K (128-byte rows) go global -> shared with ``cp.async.cg`` (16 bytes, L2
  only: W is read once) through a ``stages``-deep ring (``stages - 1`` tiles in flight), into
  a 128-byte XOR swizzle so that ``ldmatrix.x4`` reads them without bank conflicts; each warp
  owns 32 rows x all tokens and issues ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate),
  the next 16-K fragments loaded while the current ones multiply;
- the last row tile starts at ``rows - rows_per_cta`` (it overlaps its neighbour and stores
  only its own rows) so no weight load needs a bound; x rows past T are not loaded (their
  MMA columns hold whatever shared memory held, and are never stored);
- epilogue: each CTA writes its fp32 partial tile to its own shared memory; after a cluster
  barrier, CTA r of the cluster sums rows ``[r, r + 1) * rows_per_cta / split_k`` of all the
  cluster's partials (128-bit ``ld.shared::cluster``, rank order: deterministic), rounds to
  bf16 and stores them into the outputs; a second cluster barrier keeps every CTA's shared
  memory alive until its peers have read it. No atomics, no global workspace;
- programmatic dependent launch: the kernel launches with PDL; the prologue's ``stages - 1``
  weight tiles are issued before ``griddepcontrol.wait`` (no kernel writes W), x and every
  global write only after it, and ``launch_dependents`` follows the wait at once.

The main loop (``multiply``) and the ring are also the generated kernels' (``product_gemm.py``,
a subclass with its own weight tiles and epilogue).
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.common import BITS, VEC, gated_act
from codegen.launchers.gemm_specs import GEMM_PARTIAL_PAD, GEMM_SMEM_ONE_CTA, norm_bytes

MAX_TOKENS = 64
ROW_WARPS = 4  # along M: each warp of a token group owns rows_per_cta / 4 rows (2 warps of 16 on 32-row tiles)
TOKEN_GROUPS = (1, 2)  # warp groups along the tokens: 4 or 8 warps a CTA
MMA_SHAPE = (16, 8, 16)  # mma.sync m16n8k16: bf16 A (weights, row) x bf16 B (tokens, col) -> fp32
TILE_K = 64  # K per pipeline stage: 128-byte rows, one XOR-swizzle atom wide
PAD = GEMM_PARTIAL_PAD  # fp32 partial tile: column stride rows + 4 words keeps the accumulator stores conflict-free
ACC_VEC = 4  # fp32 partials summed per 128-bit shared::cluster load


class SkinnyGemm:
    """Compile-time configuration: token tile (tokens padded to a multiple of 16), K, weight
    rows, output rows, rows per CTA, the K split (= cluster size), pipeline stages, the
    token groups (each the CTA's rows over its own half of the token tile where there are two:
    more warps to hide the MMA chain's latency, fewer accumulators each), and ``glu``:
    ``(beta, linear_beta)`` of a gated activation over ``[gate; up]`` rows (I = rows / 2 output
    channels), or None for a plain projection."""

    def __init__(self, token_tile: int, k: int, rows: int, rows_out: int, *, rows_per_cta: int = 128,
                 split_k: int = 1, stages: int = 4, token_groups: int = 1,
                 glu: tuple[float | None, float | None] | None = None,
                 norm_eps: float | None = None, residual: bool = False, x_stride: int | None = None,
                 r_stride: int | None = None):
        if token_tile % 16 or not 16 <= token_tile <= MAX_TOKENS:
            raise ValueError(f"token tile {token_tile}: a multiple of 16 in 16..{MAX_TOKENS}")
        if not 1 <= rows_out <= rows:
            raise ValueError(f"{rows_out} output rows: 1..{rows}, the weight's rows")
        if glu is not None and 2 * rows_out != rows:
            raise ValueError(f"a gated projection writes rows / 2 channels, got {rows_out} of {rows}")
        if token_groups not in TOKEN_GROUPS or token_tile % (16 * token_groups):
            raise ValueError(f"token groups {token_groups}: 1, or 2 where each takes a multiple of 16 of the "
                             f"{token_tile}-token tile")
        if rows_per_cta != 32 and rows_per_cta % (ROW_WARPS * MMA_SHAPE[0]):
            raise ValueError(f"rows per CTA {rows_per_cta}: 32, or a multiple of {ROW_WARPS * MMA_SHAPE[0]}")
        if (norm_eps is not None or residual) and glu is not None:
            raise ValueError("the norm prologue and the residual epilogue go with a plain projection")
        self.norm = norm_eps is not None
        self.eps = float(norm_eps) if self.norm else 0.0
        self.residual = residual
        self.x_stride = x_stride or k
        self.r_stride = r_stride or rows_out
        if self.x_stride % VEC or self.x_stride < k or self.r_stride < rows_out:
            raise ValueError(f"x row stride {self.x_stride} (K {k}, 16-byte rows) or r row stride {self.r_stride}")
        self.glu = glu is not None
        self.beta, self.linear_beta = glu if glu is not None else (None, None)
        self.tile_out = rows_per_cta // self.weights_per_row()  # output rows (channels) per CTA tile
        if split_k not in (1, 2, 4, 8) or self.tile_out % (split_k * ACC_VEC):
            raise ValueError(f"split_k {split_k}: 1, 2, 4 or 8 (a portable cluster), dividing the CTA's "
                             f"{self.tile_out} output rows by 4s")
        if k % (split_k * TILE_K):
            raise ValueError(f"K {k} is not a multiple of split_k x {TILE_K}")
        self.tile_n, self.k, self.rows = token_tile, k, rows
        self.rows_out = rows_out
        if self.rows_out < self.tile_out:
            raise ValueError(f"{self.rows_out} output rows < {self.tile_out} per CTA tile")
        self.tile_m = rows_per_cta
        self.groups = token_groups
        self.warps_m = min(ROW_WARPS, rows_per_cta // MMA_SHAPE[0])
        self.threads = 32 * self.warps_m * token_groups
        self.group_n = token_tile // token_groups  # tokens each group's warps multiply
        self.split_k = split_k
        self.k_tiles = k // split_k // TILE_K
        if not 2 <= stages <= self.k_tiles:
            raise ValueError(f"stages {stages} outside 2..{self.k_tiles} (K tiles per CTA)")
        self.stages = stages
        self.grid = -(-self.rows_out // self.tile_out) * split_k
        self.slice_m = self.tile_out // split_k  # output rows each CTA of a cluster sums and stores
        # a thread's rounds of 4-row groups in the epilogue (per token, slice_m / 4 groups)
        self.store_rounds = -(-(self.slice_m // ACC_VEC * self.tile_n) // self.threads)
        self.w_stage_bytes = rows_per_cta * TILE_K * 2
        self.x_stage_bytes = token_tile * TILE_K * 2
        self.partial_bytes = token_tile * (rows_per_cta + PAD) * 4
        self.smem_bytes = max(stages * (self.w_stage_bytes + self.x_stage_bytes), self.partial_bytes)
        total = self.smem_bytes + (norm_bytes(k, split_k, token_tile) if self.norm else 0)
        if total > GEMM_SMEM_ONE_CTA:
            raise ValueError(f"{stages} stages of {self.w_stage_bytes + self.x_stage_bytes} bytes"
                             f"{' and the norm prologue' if self.norm else ''}: {total} bytes of shared memory, "
                             f"more than the {GEMM_SMEM_ONE_CTA} one CTA may take")

    def weights_per_row(self) -> int:
        """Weight rows a CTA tile multiplies for each output row (2 gated: the gate's and the up's)."""
        return 2 if self.glu else 1

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mNw: cute.Tensor | None,
                 mR: cute.Tensor | None, stream: cuda.CUstream):
        self.kernel(mX, mW, mY, mNw, mR, *self.machinery()).launch(
            grid=[self.grid, 1, 1], block=[self.threads, 1, 1], cluster=self.cluster(), stream=stream, use_pdl=True)

    def machinery(self) -> tuple:
        """The kernel's shared-memory layouts, its global -> shared copy and its MMA (traced in
        the launching function)."""
        # K-major tiles in shared memory: 8 rows x 128 bytes per atom, the 16-byte chunks XOR-ed with
        # the row (Swizzle<3,4,3> on byte addresses), so ldmatrix's 8 row reads hit 8 distinct banks
        atom = cute.make_layout((8, TILE_K), stride=(TILE_K, 1))
        sW_layout = cute.tile_to_shape(atom, (self.tile_m, TILE_K, self.stages), (0, 1, 2))
        sX_layout = cute.tile_to_shape(atom, (self.tile_n, TILE_K, self.stages), (0, 1, 2))
        g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=BITS)
        # 8 threads per 128-byte row, threads / 8 rows a pass
        tiled_g2s = cute.make_tiled_copy_tv(g2s, cute.make_layout((self.threads // 8, 8), stride=(8, 1)),
                                            cute.make_layout((1, VEC)))
        # one token group's warps along M; N permuted to 16 so one ldmatrix.x4 feeds two n8 MMAs
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, MMA_SHAPE),
                                        cute.make_layout((self.warps_m, 1, 1)),
                                        permutation_mnk=(self.warps_m * MMA_SHAPE[0], 16, MMA_SHAPE[2]))
        return sW_layout, sX_layout, tiled_g2s, tiled_mma

    def cluster(self) -> list[int] | None:
        return [self.split_k, 1, 1] if self.split_k > 1 else None

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mNw: cute.Tensor | None,
               mR: cute.Tensor | None, sW_layout: cute.Layout, sX_layout: cute.Layout, tiled_g2s: cute.TiledCopy,
               tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        C = const_expr(self.split_k)
        NK = const_expr(self.k_tiles)
        BM = const_expr(self.tile_m)
        TO = const_expr(self.tile_out)
        tokens = mX.shape[0]
        rank = bidx % C  # clusters are C consecutive CTAs along x: rank = %cluster_ctarank
        tile = bidx // C
        first = tile * TO  # the tile's own output rows start here
        row0 = cutlass.min(first, self.rows_out - TO)  # the last tile reaches back to stay in bounds
        k0 = rank * (NK * TILE_K)

        # this CTA's W rows and x, K slice cut into (rows, TILE_K, NK) tiles; gated: the rows are
        # (64 gate rows, the same channels' 64 up rows I rows further)
        if const_expr(self.glu):
            corner = cute.domain_offset((row0, k0), mW)
            gW = cute.make_tensor(corner.iterator, cute.make_layout(
                ((TO, 2), TILE_K, NK), stride=((self.k, self.rows_out * self.k), 1, TILE_K)))
        else:
            gW = cute.local_tile(cute.domain_offset((row0, k0), mW), (BM, TILE_K), (0, None))
        gX = cute.local_tile(cute.domain_offset((0, k0), mX), (self.tile_n, TILE_K), (0, None))
        gW = cute.make_tensor(gW.iterator.align(16), gW.layout)
        gX = cute.make_tensor(gX.iterator.align(16), gX.layout)
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (self.tile_n, TILE_K), (0, None))

        smem = SmemAllocator()
        sW, sX, sP = self.ring(smem, sW_layout, sX_layout)
        # norm prologue: this CTA's K slice of the norm weight, and the tokens' sums of squares
        sNw = sSq = None
        if const_expr(self.norm):
            sNw = smem.allocate_tensor(BFloat16, cute.make_layout((NK * TILE_K,)), byte_alignment=16)
            sSq = smem.allocate_tensor(Float32, cute.make_layout((self.tile_n,)), byte_alignment=16)
            g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                      BFloat16, num_bits_per_copy=BITS)
            gNw = cute.domain_offset((k0,), mNw)
            gNw = cute.make_tensor(gNw.iterator.align(16), gNw.layout)  # k0: whole 64-element tiles
            for v in cutlass.range(tidx, NK * TILE_K // VEC, self.threads, unroll=1):
                cute.copy(g2s, cute.local_tile(gNw, (VEC,), (v,)), cute.local_tile(sNw, (VEC,), (v,)))

        thr_g2s = tiled_g2s.get_slice(tidx)
        tWgW = thr_g2s.partition_S(gW)
        tWsW = thr_g2s.partition_D(sW)
        tXgX, tXsX, tXcX, x_ok = self.x_rows(thr_g2s, gX, sX, cX, tokens)
        XR = const_expr(cute.size(tXgX, mode=[1]))  # x rows per thread and stage
        rSq = cute.make_rmem_tensor((XR,), Float32)  # the norm prologue's sums of squares, per x row
        rSq.fill(0.0)

        loads = (tiled_g2s, tWgW, tWsW)

        def after_wait():
            # the residuals this thread adds in the epilogue, read now: after the sums their load
            # would be one more round trip before the stores
            rRes = cute.make_rmem_tensor((ACC_VEC, self.store_rounds), BFloat16)
            if const_expr(self.residual):
                self.load_residual(mR, rRes, tidx, rank, row0, tokens)
            return rRes

        def on_tile(kt, stage):
            self.norm_tile(tXsX, sNw, rSq, x_ok, kt, stage, tidx)
        rRes = self.multiply(tidx, loads, tiled_g2s, tXgX, tXsX, x_ok, sW, sX, sP, tiled_mma, after_wait,
                             on_tile if const_expr(self.norm) else None)
        if const_expr(self.norm):  # this CTA's sums of squares per token (8 threads share an x row)
            for j in cutlass.range_constexpr(XR):
                total = cute.arch.warp_reduction(rSq[j], operator.add, threads_in_group=8)
                if tidx % 8 == 0 and x_ok[j]:
                    sSq[tXcX[0, j, 0, 0][0]] = total
        if const_expr(C > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        self.reduce_store(sP, sSq, mY, rRes, tidx, rank, row0, first, tokens)
        if const_expr(C > 1):
            # peers may still be reading this CTA's partials: an execution barrier only (relaxed:
            # a released arrive would first wait for this CTA's output stores to be acknowledged)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    # helpers inlined into the kernel
    @cute.jit
    def ring(self, smem, sW_layout, sX_layout):
        """(sW, sX, sP): the pipeline's swizzled W and x stages, and over the same bytes the fp32
        partial tile the main loop leaves."""
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        swizzle = cute.make_swizzle(3, 4, 3)
        sW = cute.make_tensor(cute.recast_ptr(base, swizzle, dtype=BFloat16), sW_layout)
        sX = cute.make_tensor(cute.recast_ptr(base + self.stages * self.w_stage_bytes, swizzle, dtype=BFloat16),
                              sX_layout)
        # after the main loop the same bytes hold the fp32 partial tile, (rows, tokens), rows contiguous
        sP = cute.make_tensor(cute.recast_ptr(base, dtype=Float32),
                              cute.make_layout((self.tile_m, self.tile_n), stride=(1, self.tile_m + PAD)))
        return sW, sX, sP

    @cute.jit
    def x_rows(self, thr_g2s, gX, sX, cX, tokens):
        """This thread's x copies (global, shared, coordinates) and which of its rows are tokens < T."""
        tXgX = thr_g2s.partition_S(gX)
        tXsX = thr_g2s.partition_D(sX)
        tXcX = thr_g2s.partition_S(cX)
        x_ok = cute.make_rmem_tensor((cute.size(tXgX, mode=[1]),), cutlass.Boolean)
        for j in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            x_ok[j] = tXcX[0, j, 0, 0][0] < tokens
        return tXgX, tXsX, tXcX, x_ok

    @cute.jit
    def prologue(self, loads, tiled_g2s, tXgX, tXsX, x_ok, after_wait):
        """Tiles 0 .. S-2 in flight, their weights first, before the wait (PDL): no kernel writes
        W, so their DRAM latency overlaps the previous kernel's tail; x is that kernel's output,
        read only after the wait. All of it is commit group 0 (groups complete in order, so the
        first fragments wait for every prologue weight tile anyway); groups 1 .. S-2 are empty
        and keep group kt = tile kt for the main loop's waits. Returns ``after_wait()``'s result."""
        S = const_expr(self.stages)
        for s in cutlass.range_constexpr(S - 1):
            self.load_w(loads, s, s)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        for j in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            if x_ok[j]:
                for s in cutlass.range_constexpr(S - 1):
                    cute.copy(tiled_g2s, tXgX[None, j, None, s], tXsX[None, j, None, s])
        for _ in cutlass.range_constexpr(S - 1):
            cute.arch.cp_async_commit_group()
        return after_wait()

    @cute.jit
    def multiply(self, tidx, loads, tiled_g2s, tXgX, tXsX, x_ok, sW, sX, sP, tiled_mma, after_wait, on_tile):
        """The main loop: the prologue's tiles (weights before ``griddepcontrol.wait``, x after
        it), then every K tile through the ring into the MMAs, and this CTA's fp32 partial tile
        into ``sP``. ``loads``: what ``load_w`` reads the weight tiles with; ``after_wait()``
        runs once x is in flight (it reads what the epilogue adds; its result is returned);
        ``on_tile(kt, stage)``, where given, runs on each x tile once it is resident, before its
        first fragments are read (the norm prologue)."""
        S = const_expr(self.stages)
        NK = const_expr(self.k_tiles)
        KB = const_expr(TILE_K // MMA_SHAPE[2])  # 16-K MMA steps per tile
        BM = const_expr(self.tile_m)
        ready = self.prologue(loads, tiled_g2s, tXgX, tXsX, x_ok, after_wait)

        # the MMA's threads: one token group's warps, over the group's tokens of x and of the partials
        mtid = tidx
        sXg, sPg = sX, sP
        if const_expr(self.groups > 1):
            group = tidx // (32 * self.warps_m)
            mtid = tidx % (32 * self.warps_m)
            sXg = cute.local_tile(sX, (self.group_n, TILE_K, S), (group, 0, 0))
            sPg = cute.local_tile(sP, (BM, self.group_n), (0, group))
        thr_mma = tiled_mma.get_slice(mtid)
        tCsW = thr_mma.partition_A(sW)
        tCsX = thr_mma.partition_B(sXg)
        tCrW = tiled_mma.make_fragment_A(tCsW[None, None, None, 0])
        tCrX = tiled_mma.make_fragment_B(tCsX[None, None, None, 0])
        tCsP = thr_mma.partition_C(sPg)
        acc = tiled_mma.make_fragment_C(tCsP)
        acc.fill(0.0)

        ldm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), BFloat16)
        s2r_W = cute.make_tiled_copy_A(ldm, tiled_mma)
        s2r_X = cute.make_tiled_copy_B(ldm, tiled_mma)
        thr_s2r_W = s2r_W.get_slice(mtid)
        thr_s2r_X = s2r_X.get_slice(mtid)
        tLsW = thr_s2r_W.partition_S(sW)
        tLrW = thr_s2r_W.retile(tCrW)
        tLsX = thr_s2r_X.partition_S(sXg)
        tLrX = thr_s2r_X.retile(tCrX)

        # the first K step's fragments
        cute.arch.cp_async_wait_group(S - 2)
        if const_expr(on_tile is not None):
            # the norm weight's vectors were copied by other threads: their waits must pass before
            # tile 0 reads them (without this barrier it was a read-after-write race on sNw)
            cute.arch.sync_threads()
            on_tile(0, 0)
        cute.arch.sync_threads()
        cute.copy(s2r_W, tLsW[None, None, 0, 0], tLrW[None, None, 0])
        cute.copy(s2r_X, tLsX[None, None, 0, 0], tLrX[None, None, 0])

        read = cutlass.Int32(0)  # stage holding tile kt
        write = cutlass.Int32(S - 1)  # stage receiving tile kt + S - 1
        for kt in cutlass.range(NK, unroll=1):
            for kb in cutlass.range_constexpr(KB):
                if const_expr(kb == KB - 1):
                    # tile kt + 1 must be resident (and every warp done with tile kt's last
                    # fragments, issued one step ago) before its first fragments are read
                    cute.arch.cp_async_wait_group(S - 2)
                    if const_expr(on_tile is not None):
                        if kt + 1 < NK:
                            on_tile(kt + 1, (read + 1) % S)
                    cute.arch.sync_threads()
                nxt = const_expr((kb + 1) % KB)
                stage = read if const_expr(kb < KB - 1) else (read + 1) % S
                cute.copy(s2r_W, tLsW[None, None, nxt, stage], tLrW[None, None, nxt])
                cute.copy(s2r_X, tLsX[None, None, nxt, stage], tLrX[None, None, nxt])
                if const_expr(kb == 0):
                    # refill the stage freed by tile kt - 1 (empty groups at the end keep the count)
                    if kt + (S - 1) < NK:
                        self.load_tile(loads, tiled_g2s, tXgX, tXsX, x_ok, kt + (S - 1), write)
                    cute.arch.cp_async_commit_group()
                cute.gemm(tiled_mma, acc, tCrW[None, None, kb], tCrX[None, None, kb], acc)
            write = read
            read = (read + 1) % S

        # this CTA's partial tile -> shared memory (the epilogue sums the cluster's)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        cute.autovec_copy(acc, tCsP)
        return ready

    @cute.jit
    def load_w(self, loads, kt, stage):
        """Issue the cp.async copies of W's K tile ``kt`` into ``stage``."""
        tiled_g2s, tWgW, tWsW = loads
        cute.copy(tiled_g2s, tWgW[None, None, None, kt], tWsW[None, None, None, stage])

    @cute.jit
    def load_tile(self, loads, tiled_g2s, tXgX, tXsX, x_ok, kt, stage):
        """Issue the cp.async copies of K tile ``kt`` (W tile by ``load_w``, x rows < T) into ``stage``."""
        self.load_w(loads, kt, stage)
        for j in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            if x_ok[j]:
                cute.copy(tiled_g2s, tXgX[None, j, None, kt], tXsX[None, j, None, stage])

    @cute.jit
    def norm_tile(self, tXsX, sNw, rSq, x_ok, kt, stage, tidx):
        """The norm prologue on K tile ``kt`` (in ``stage``): this thread's x vectors (its own
        cp.async copies, complete after its wait) summed squared and multiplied by the norm
        weight, rounded to bf16, in place."""
        for j in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            if x_ok[j]:
                xs = tXsX[None, j, 0, stage]
                xf = xs.load().to(Float32)
                rSq[j] = rSq[j] + (xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                w = cute.local_tile(sNw, (VEC,), (kt * (TILE_K // VEC) + tidx % (TILE_K // VEC),))
                w = cute.make_tensor(w.iterator, cute.make_layout(xs.shape)).load()  # the x vector's (8, 1) shape
                xs.store((xf * w.to(Float32)).to(BFloat16))

    def store_round(self, tidx, rank, j):
        """(token, 4-row group inside the CTA's output rows, whether there is one) of this thread's
        round ``j`` of the epilogue: the rounds walk the (token, group) pairs of the CTA's rank's
        slice, ``threads`` pairs a round (trace time)."""
        per_token = self.slice_m // ACC_VEC
        nvec = per_token * self.tile_n
        v = tidx + j * self.threads
        return v // per_token, rank * per_token + v % per_token, True if nvec % self.threads == 0 else v < nvec

    @cute.jit
    def load_residual(self, mR, rRes, tidx, rank, row0, tokens):
        """``rRes[e, j]`` = r at the (token, row) of element e of this thread's ``j``-th 4-row group
        in ``reduce_store`` (the same mapping)."""
        for j in cutlass.range_constexpr(self.store_rounds):
            t, mv, live = self.store_round(tidx, rank, j)
            if live and t < tokens:
                for e in cutlass.range_constexpr(ACC_VEC):
                    rRes[e, j] = mR[t, row0 + mv * ACC_VEC + e]

    @cute.jit
    def reduce_store(self, sP, sSq, mY, rRes, tidx, rank, row0, first, tokens):
        """Sum output rows ``rank * slice_m + [0, slice_m)`` of the cluster's partial tiles (4
        rows per 128-bit load; gated: each with its up row ``tile_out`` further, then the
        activation) and store those below ``rows_out``, rounded to bf16, into ``mY``; rows below
        ``first`` (the last tile's overlap) are its neighbour's to store. ``rRes``: the
        residuals (``load_residual``)."""
        up_groups = self.tile_out // ACC_VEC  # 4-row groups from a gate row to its up row
        gate = cute.make_rmem_tensor((ACC_VEC, 1), Float32)
        up = cute.make_rmem_tensor((ACC_VEC, 1), Float32)
        for j in cutlass.range_constexpr(self.store_rounds):
            t, mv, live = self.store_round(tidx, rank, j)
            if live and t < tokens:
                rstd = Float32(1.0)
                if const_expr(self.norm):
                    sq = Float32(0.0)
                    part = cute.make_rmem_tensor((1,), Float32)
                    for r in cutlass.range_constexpr(self.split_k):
                        src = sSq
                        if const_expr(self.split_k > 1):
                            src = cute.make_tensor(cute.arch.map_dsmem_ptr(sSq.iterator, r), sSq.layout)
                        cute.autovec_copy(cute.local_tile(src, (1,), (t,)), part)
                        sq = sq + part[0]
                    rstd = cute.math.rsqrt(sq * Float32(1.0 / self.k) + Float32(self.eps))
                self.cluster_sum(sP, mv, t, gate)
                if const_expr(self.glu):
                    self.cluster_sum(sP, mv + up_groups, t, up)
                for e in cutlass.range_constexpr(ACC_VEC):
                    n = row0 + mv * ACC_VEC + e
                    val = gate[e, 0]
                    if const_expr(self.glu):
                        val = gated_act(val, up[e, 0], self.beta, self.linear_beta)
                    val = val * rstd
                    rounded = val.to(BFloat16)
                    if const_expr(self.residual):
                        rounded = (rounded.to(Float32) + rRes[e, j].to(Float32)).to(BFloat16)
                    if n < self.rows_out and n >= first:
                        mY[t, n] = rounded

    @cute.jit
    def cluster_sum(self, sP, group, t, total):
        """``total`` = rows ``[4 group, 4 group + 4)`` of token ``t`` summed over the cluster's
        partial tiles, in rank order (deterministic)."""
        part = cute.make_rmem_tensor((ACC_VEC, 1), Float32)
        total.fill(0.0)
        for r in cutlass.range_constexpr(self.split_k):
            src = sP
            if const_expr(self.split_k > 1):
                src = cute.make_tensor(cute.arch.map_dsmem_ptr(sP.iterator, r), sP.layout)
            cute.autovec_copy(cute.local_tile(src, (ACC_VEC, 1), (group, t)), part)
            total.store(total.load() + part.load())

def build(spec) -> tuple[SkinnyGemm, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size up to the token tile)."""
    s, p = spec.shape_dict, spec.param_dict
    tile_n, k, n = s["token_tile"], s["k"], s["rows"]
    glu = (p["beta"], p["linear_beta"]) if p.get("glu") else None
    kernel = SkinnyGemm(tile_n, k, n, p["rows_out"], rows_per_cta=p["rows_per_cta"], split_k=p["split_k"],
                        stages=p["stages"], token_groups=p.get("token_groups", 1), glu=glu,
                        norm_eps=p.get("norm_eps"), residual=p.get("residual", False),
                        x_stride=p.get("x_stride"), r_stride=p.get("r_stride"))
    tokens = cute.sym_int32()
    # the output: scalar stores, any alignment torch gives a fresh [T, rows_out] tensor
    y = make_fake_tensor(BFloat16, (tokens, kernel.rows_out), (kernel.rows_out, 1), assumed_align=2)
    norm_w = make_fake_tensor(BFloat16, (k,), (1,), assumed_align=16) if kernel.norm else None
    r = (make_fake_tensor(BFloat16, (tokens, kernel.rows_out), (kernel.r_stride, 1), assumed_align=2)
         if kernel.residual else None)
    return kernel, (make_fake_tensor(BFloat16, (tokens, k), (kernel.x_stride, 1), assumed_align=16),
                    make_fake_tensor(BFloat16, (n, k), (k, 1), assumed_align=16), y, norm_w, r,
                    make_fake_stream(use_tvm_ffi_env_stream=True))
