"""``product_gemm``: a generated kernel: one stage of a fused op's ``codegen.lowered.Products``
whose prologue only reads a bf16 activation, on the skinny tensor-core GEMM's main loop
(``codegen/kernels/gemm.py``, 2..64 tokens, the token count a runtime size up to the tile).

The main loop is ``SkinnyGemm.multiply``, unchanged: weight tiles through a ``cp.async`` ring
before ``griddepcontrol.wait``, x after it, ``mma.sync.m16n8k16`` with fp32 accumulators, the
partial tile in shared memory, the K split's CTAs a cluster. What is generated:
- the weight tile: a CTA's ``rows_per_cta`` rows are ``rows_per_cta / P`` output columns of each
  of the stage's P products (a product's weight is its own tensor, or a row slice of one: the
  gate and up halves of a packed projection), so every product of a column meets in one CTA; a
  copy pass of the tile reads one product's rows (``threads / 8`` rows a pass divide a
  product's share);
- the epilogue hook: for each (token, 4 columns) a thread owns in the cluster's sum, every
  product's sums and the epilogue's inputs (rows, columns, statistics: read right after the
  wait, as the hand-written residual) go through the epilogue program on scalars
  (``codegen/kernels/emit.py``) to each output.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.kernels.emit import CUTE_DTYPES, run
from codegen.kernels.gemm import ACC_VEC, TILE_K, SkinnyGemm
from codegen.launchers.generated import PRODUCT_SLOTS, is_plain
from codegen.lowered import Stage


class ProductGemm(SkinnyGemm):
    """Compile-time configuration: the stage, the token tile, the tiling of ``gemm_tiling``
    (rows per CTA, K split, pipeline stages, token groups) and the row strides of the
    activation and of the epilogue's row inputs (views of wider rows)."""

    def __init__(self, stage: Stage, token_tile: int, *, rows_per_cta: int, split_k: int, stages: int,
                 token_groups: int, x_stride: int, epi_strides: tuple[int, ...]):
        if not is_plain(stage):
            raise ValueError("the GEMM's stage reads its activation as it is (a prologue that computes runs on the "
                             "GEMV's staged prologue)")
        self.stage, self.products = stage, len(stage.weights)
        if rows_per_cta % self.products:
            raise ValueError(f"{self.products} products do not share {rows_per_cta} rows a CTA")
        super().__init__(token_tile, stage.k, stage.n, (stage.n,), rows_per_cta=rows_per_cta, split_k=split_k,
                         stages=stages, token_groups=token_groups, x_stride=x_stride)
        self.pass_rows = self.threads // 8  # rows one copy pass of the weight tile covers
        if self.tile_out % self.pass_rows:
            raise ValueError(f"{self.products} products of {self.tile_out} rows a CTA: a copy pass covers "
                             f"{self.pass_rows} rows, within one product")
        epi = stage.epilogue
        self.epi_args = [i for i, s in enumerate(stage.epilogue_from) if s[0] in ("arg", "temp")]
        self.epi_strides = epi_strides
        counts = {"weights": self.products, "epilogue_inputs": len(self.epi_args), "outputs": len(epi.outputs)}
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
        P = const_expr(self.products)
        tokens = mX.shape[0]
        rank = bidx % C  # clusters are C consecutive CTAs along x
        first = bidx // C * TO  # the tile's own output columns start here
        row0 = cutlass.min(first, self.rows_out - TO)  # the last tile reaches back to stay in bounds
        k0 = rank * (NK * TILE_K)

        # each product's TO weight rows of this tile, K slice cut into (TO, TILE_K, NK) tiles
        weights = (w0, w1, w2, w3)[:P]
        gWs = []
        for p in cutlass.range_constexpr(P):
            g = cute.local_tile(cute.domain_offset((row0, k0), weights[p]), (TO, TILE_K), (0, None))
            gWs.append(cute.make_tensor(g.iterator.align(16), g.layout))
        gX = cute.local_tile(cute.domain_offset((0, k0), mX), (self.tile_n, TILE_K), (0, None))
        gX = cute.make_tensor(gX.iterator.align(16), gX.layout)
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (self.tile_n, TILE_K), (0, None))

        smem = SmemAllocator()
        sW, sX, sP = self.ring(smem, sW_layout, sX_layout)
        thr_g2s = tiled_g2s.get_slice(tidx)
        loads = (tiled_g2s, [thr_g2s.partition_S(g) for g in gWs], thr_g2s.partition_D(sW))
        tXgX, tXsX, _, x_ok = self.x_rows(thr_g2s, gX, sX, cX, tokens)
        eins = (e0, e1, e2, e3)[:len(self.epi_args)]

        def after_wait():
            return self.load_epilogue_inputs(eins, tidx, rank, row0, tokens)
        rEpi = self.multiply(tidx, loads, tiled_g2s, tXgX, tXsX, x_ok, sW, sX, sP, tiled_mma, after_wait, None)
        if const_expr(C > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        self.epilogue(sP, (y0, y1, y2, y3), rEpi, tidx, rank, row0, first, tokens)
        if const_expr(C > 1):
            # peers may still be reading this CTA's partials (gemm.py: why relaxed)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    @cute.jit
    def load_w(self, loads, kt, stage):
        """Issue the cp.async copies of K tile ``kt`` of every product's rows into ``stage``:
        copy pass j of the CTA tile is pass ``j % (TO / pass_rows)`` of product
        ``j // (TO / pass_rows)``."""
        tiled_g2s, tWgWs, tWsW = loads
        per = const_expr(self.tile_out // self.pass_rows)
        for p in cutlass.range_constexpr(self.products):
            for j in cutlass.range_constexpr(per):
                cute.copy(tiled_g2s, tWgWs[p][None, j, None, kt], tWsW[None, p * per + j, None, stage])

    @cute.jit
    def load_epilogue_inputs(self, eins, tidx, rank, row0, tokens):
        """``rEpi[i, e, j]``: epilogue input i at the (token, column) of element e of this thread's
        round j (the mapping of ``epilogue``), in fp32."""
        epi = self.stage.epilogue
        rEpi = cute.make_rmem_tensor((max(1, len(self.epi_args)), ACC_VEC, self.store_rounds), Float32)
        per_token = self.slice_m // ACC_VEC
        nvec = per_token * self.tile_n
        for j in cutlass.range_constexpr(self.store_rounds):  # as SkinnyGemm.reduce_store
            v = tidx + j * self.threads
            t = v // per_token
            mv = rank * per_token + v % per_token  # 4-column group inside the CTA's columns
            if (const_expr(nvec % self.threads == 0) or v < nvec) and t < tokens:
                for i in cutlass.range_constexpr(len(self.epi_args)):
                    kind, _ = epi.inputs[self.epi_args[i]]
                    for e in cutlass.range_constexpr(ACC_VEC):
                        n = row0 + mv * ACC_VEC + e
                        if const_expr(kind == "row"):
                            rEpi[i, e, j] = eins[i][t, n].to(Float32)
                        elif const_expr(kind == "col"):
                            rEpi[i, e, j] = eins[i][n].to(Float32)
                        else:
                            rEpi[i, e, j] = eins[i][t, 0].to(Float32)
        return rEpi

    @cute.jit
    def epilogue(self, sP, ys, rEpi, tidx, rank, row0, first, tokens):
        """Sum this thread's (token, 4 columns) of every product over the cluster's partial tiles
        (product p's columns are rows ``p * TO ..`` of the tile), run the epilogue program on
        each column's scalars and store its outputs; columns below ``first`` (the last tile's
        overlap) are its neighbour's to store."""
        epi = self.stage.epilogue
        kinds = epi.kinds
        P = const_expr(self.products)
        groups = const_expr(self.tile_out // ACC_VEC)  # 4-row groups from one product's rows to the next's
        sums = [cute.make_rmem_tensor((ACC_VEC, 1), Float32) for _ in range(P)]
        per_token = self.slice_m // ACC_VEC
        nvec = per_token * self.tile_n
        for j in cutlass.range_constexpr(self.store_rounds):  # as SkinnyGemm.reduce_store
            v = tidx + j * self.threads
            t = v // per_token
            mv = rank * per_token + v % per_token  # 4-column group inside the CTA's columns
            if (const_expr(nvec % self.threads == 0) or v < nvec) and t < tokens:
                for p in cutlass.range_constexpr(P):
                    self.cluster_sum(sP, mv + p * groups, t, sums[p])
                for e in cutlass.range_constexpr(ACC_VEC):
                    n = row0 + mv * ACC_VEC + e
                    vals = [sums[src[1]][e, 0] if const_expr(src[0] == "acc") else
                            rEpi[self.epi_args.index(i), e, j] for i, src in enumerate(self.stage.epilogue_from)]
                    run(epi, vals)
                    if n >= first:
                        for o in cutlass.range_constexpr(len(epi.outputs)):
                            value, dtype, _ = epi.outputs[o]
                            if const_expr(kinds[value] == "row"):
                                ys[o][t, n] = vals[value].to(CUTE_DTYPES[dtype])
                            elif n == 0:
                                ys[o][t, 0] = vals[value].to(CUTE_DTYPES[dtype])


def build(spec) -> tuple[ProductGemm, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size up to the token tile)."""
    p = spec.param_dict
    stage = Stage.from_params(p["stage"])
    kernel = ProductGemm(stage, spec.shape_dict["token_tile"], rows_per_cta=p["rows_per_cta"], split_k=p["split_k"],
                         stages=p["stages"], token_groups=p["token_groups"], x_stride=p["x_stride"],
                         epi_strides=tuple(p["epi_strides"]))
    k, n = stage.k, stage.n
    tokens = cute.sym_int32()

    def tensor(kind, dtype, stride):
        ct = CUTE_DTYPES[dtype]
        if kind == "row":
            return make_fake_tensor(ct, (tokens, n), (stride, 1), assumed_align=ct.width // 8)
        if kind == "stat":
            return make_fake_tensor(ct, (tokens, 1), (1, 1), assumed_align=ct.width // 8)
        return make_fake_tensor(ct, (n,), (1,), assumed_align=ct.width // 8)

    epi = stage.epilogue
    ws = [make_fake_tensor(BFloat16, (n, k), (k, 1), assumed_align=16) for _ in stage.weights]
    eins = [tensor(*epi.inputs[i], stride) for i, stride in zip(kernel.epi_args, kernel.epi_strides, strict=True)]
    kinds = epi.kinds
    ys = [tensor(kinds[v], dtype, n) for v, dtype, _ in epi.outputs]

    def pad(xs, size):
        return [*xs, *[None] * (size - len(xs))]
    x = make_fake_tensor(BFloat16, (tokens, k), (kernel.x_stride, 1), assumed_align=16)
    return kernel, (x, *pad(ws, 4), *pad(eins, 4), *pad(ys, 4), make_fake_stream(use_tvm_ffi_env_stream=True))
