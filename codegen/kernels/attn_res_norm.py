"""``attn_res_norm``: AttnRes before attention + the input RMSNorm, a cluster of CTAs per token.

The math is ``rewriter/model/layers/attn_res.py`` (the CPU reference of ``k3f::attn_res_norm``):

    p      = bf16(prefix + delta)                   (or prefix when there is no delta)
    blocks[t, write_idx] = p                        (when write_idx >= 0; in place)
    S      = [blocks[t, 0..n-1], p]                 (n + 1 <= 9 sources of D values)
    q      = norm_weight * qk_weight                (fp32)
    l_s    = <S_s, q> * rsqrt(mean(S_s^2) + eps)
    mix    = sum_s softmax(l)_s * S_s
    out    = bf16(mix * rsqrt(mean(mix^2) + eps) * out_norm_weight)

Work split: the row of D = 7168 values is cut into 128-bit vectors (8 bf16), and the vectors
into ``cluster`` equal shares, one per CTA of a thread-block cluster (the launcher picks 1 to 8
from the token count). One SM cannot keep a whole row's sources in flight: a CTA per token
took 3.2 us with 2 sources and 6.9 with 9 at batch 1 on the H200, most of it waiting
for its loads; 8 CTAs a token take 2.5 and 3.5. At 64 tokens 512 CTAs reduce more than they
save (9.3 us), so the cluster shrinks with the batch (2 CTAs: 5.5 us). Thread i of a CTA
owns the share's vectors i, i + threads, ... (one or two a thread, also by token count).
Every source is read from HBM exactly once, the finished blocks by ``cp.async`` straight into
shared memory (all of a thread's copies in flight at once, beside the prefix and delta loads:
one HBM round trip), each thread reading back only its own vectors.

The two reductions cross the cluster through distributed shared memory, pushed: each warp
sums its 2 (n + 1) partials (squares, dot with q) with shuffles, and its lane r sends them by
``st.async`` into CTA r's shared memory, at this (CTA, warp)'s entry, counted in bytes on CTA
r's mbarrier (``common.push_send``); once its own mbarrier has every entry, every warp of every
CTA sums the same entries in the same order (lane e takes entry e, then shuffles), so all CTAs
compute bit-identical softmax weights without another exchange. The mix's squared norm goes
the same way, on a second mbarrier. No cluster barrier waits for the slowest CTA after the
work, and nothing reads a peer's shared memory, so a CTA may leave once it has its own; the
first push into a peer waits for the cluster's start (an arrive at the top, after the
mbarriers are made; the wait before the push).

Programmatic dependent launch: the kernel launches with PDL; the three weight vectors are
loaded before ``griddepcontrol.wait`` (no kernel writes them; plain loads, which ptxas keeps
above the wait, unlike ``ld.global.nc``), every activation read and every global write comes
after it, and ``launch_dependents`` follows the wait at once.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import (
    BITS,
    VEC,
    g2r_atom,
    g2r_stream_atom,
    push_init,
    push_received,
    push_send,
    r2g_atom,
    r2s_atom,
)

MAX_SOURCES = 9


class AttnResNorm:
    """Compile-time configuration: hidden size, block-buffer size, number of source
    blocks, block write index (-1: none), whether a delta is added, eps, CTAs per token and
    128-bit vectors per thread."""

    def __init__(self, hidden: int, num_blocks_buf: int, num_blocks: int, write_idx: int, has_delta: bool,
                 eps: float, cluster: int, vectors: int):
        if hidden % VEC:
            raise ValueError(f"hidden {hidden} must be a multiple of {VEC}")
        if not 0 <= num_blocks < MAX_SOURCES:
            raise ValueError(f"num_blocks {num_blocks} outside 0..{MAX_SOURCES - 1}")
        if write_idx >= num_blocks_buf:
            raise ValueError(f"write_idx {write_idx} outside the block buffer ({num_blocks_buf} blocks)")
        if num_blocks > num_blocks_buf:
            raise ValueError(f"num_blocks {num_blocks} > block buffer ({num_blocks_buf} blocks)")
        self.hidden = hidden
        self.num_blocks_buf = num_blocks_buf
        self.num_blocks = num_blocks
        self.write_idx = write_idx
        self.has_delta = has_delta
        self.eps = float(eps)
        num_vec = hidden // VEC
        if cluster not in (1, 2, 4, 8) or num_vec % cluster:
            raise ValueError(f"cluster {cluster}: 1, 2, 4 or 8 CTAs dividing the {num_vec} vectors of a row")
        if vectors not in (1, 2):
            raise ValueError(f"vectors {vectors}: 1 or 2 a thread")
        self.cluster = cluster
        self.share = num_vec // cluster  # vectors of the row each CTA owns
        # one vector a thread: the most loads in flight at a few tokens; two: half the warps to reduce
        self.threads = min(1024, -(-self.share // (32 * vectors)) * 32)
        self.vec_per_thread = -(-self.share // self.threads)
        self.even = self.share % self.threads == 0
        self.num_warps = self.threads // 32
        self.entries = self.cluster * self.num_warps  # a CTA receives one set of sums per (CTA, warp)

    @cute.jit
    def __call__(self, mPrefix: cute.Tensor, mDelta: cute.Tensor | None, mBlocks: cute.Tensor,
                 mNormW: cute.Tensor, mQkW: cute.Tensor, mOutW: cute.Tensor, mOut: cute.Tensor,
                 mNewPrefix: cute.Tensor, stream: cuda.CUstream):
        cluster = [self.cluster, 1, 1] if const_expr(self.cluster > 1) else None
        self.kernel(mPrefix, mDelta, mBlocks, mNormW, mQkW, mOutW, mOut, mNewPrefix).launch(
            grid=[mPrefix.shape[0] * self.cluster, 1, 1], block=[self.threads, 1, 1], cluster=cluster,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mPrefix: cute.Tensor, mDelta: cute.Tensor | None, mBlocks: cute.Tensor, mNormW: cute.Tensor,
               mQkW: cute.Tensor, mOutW: cute.Tensor, mOut: cute.Tensor, mNewPrefix: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        C = const_expr(self.cluster)
        W = const_expr(self.num_warps)
        E = const_expr(self.entries)
        token = bidx // C
        rank = bidx % C
        first = rank * self.share  # this CTA's first vector of the row
        V = const_expr(self.vec_per_thread)
        S = const_expr(self.num_blocks + 1)
        P = const_expr(S - 1)  # the new prefix is the last source
        inv_d = const_expr(1.0 / self.hidden)

        smem = cutlass.memory.SmemAllocator()
        # this CTA's share of the sources, as read (bf16): the finished blocks land here straight
        # from HBM (cp.async, no registers, so all of them are in flight at once), the mix reads them back
        sSrc = smem.allocate_tensor(BFloat16, cute.make_layout((self.share * VEC, S)), byte_alignment=16)
        # the cluster's partial sums, pushed by every (CTA, warp): entry e = rank * W + warp
        sPart = smem.allocate_tensor(Float32, cute.make_layout((2 * S, E)), byte_alignment=16)
        sMixSq = smem.allocate_tensor(Float32, cute.make_layout((1, E)), byte_alignment=16)
        mbarSum = mbarMix = None
        if const_expr(self.cluster > 1):
            mbarSum, mbarMix = (smem.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8) for _ in range(2))
            push_init(sPart, mbarSum, tidx)
            push_init(sMixSq, mbarMix, tidx)
            # this CTA's shared memory and mbarriers are in place: peers may push into it once
            # their wait sees every arrival
            cute.arch.cluster_arrive_relaxed()

        ld = g2r_atom(BFloat16)
        st = r2g_atom(BFloat16)
        st_s = r2s_atom(BFloat16)
        g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=BITS)
        rV = cute.make_rmem_tensor((VEC,), BFloat16)
        rW = cute.make_rmem_tensor((VEC,), BFloat16)
        rQ = cute.make_rmem_tensor((VEC, V), Float32)
        rQ.fill(0.0)
        rOutW = cute.make_rmem_tensor((VEC, V), BFloat16)
        rSq = cute.make_rmem_tensor((S,), Float32)
        rSq.fill(0.0)
        rDot = cute.make_rmem_tensor((S,), Float32)
        rDot.fill(0.0)

        gPrefix = mPrefix[token, None]
        gNewPrefix = mNewPrefix[token, None]
        gOut = mOut[token, None]

        # 0. before the wait (PDL): only the three weights, which no kernel writes;
        # q = norm_weight * qk_weight, out_norm_weight kept for step 5. Not ld.global.nc: ptxas
        # sinks those below griddepcontrol.wait (an acquire), plain loads stay above it
        ld_w = g2r_stream_atom(BFloat16)
        for j in cutlass.range_constexpr(V):
            lv = tidx + j * self.threads
            if const_expr(self.even) or lv < self.share:
                v = first + lv
                cute.copy(ld_w, cute.local_tile(mNormW, (VEC,), (v,)), rW)
                cute.copy(ld_w, cute.local_tile(mQkW, (VEC,), (v,)), rV)
                cute.copy(ld_w, cute.local_tile(mOutW, (VEC,), (v,)), rOutW[None, j])
                rQ[None, j].store(rW.load().to(Float32) * rV.load().to(Float32))
        # the prefix, delta and blocks are the previous kernels' outputs, and the outputs may
        # reuse their memory: read and write only after the wait
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # 1. the finished blocks, each read from HBM once, all in flight together (staged through
        # registers they went out a few at a time, each batch behind the last one's data)
        for s in cutlass.range_constexpr(P):
            if const_expr(s != self.write_idx):  # the block about to be written is p itself
                for j in cutlass.range_constexpr(V):
                    lv = tidx + j * self.threads
                    if const_expr(self.even) or lv < self.share:
                        cute.copy(g2s, cute.local_tile(mBlocks[token, s, None], (VEC,), (first + lv,)),
                                  cute.local_tile(sSrc[None, s], (VEC,), (lv,)))
        cute.arch.cp_async_commit_group()

        # 2. meanwhile the new prefix p: stored, written as a block, staged
        for j in cutlass.range_constexpr(V):
            lv = tidx + j * self.threads
            if const_expr(self.even) or lv < self.share:
                v = first + lv
                cute.copy(ld, cute.local_tile(gPrefix, (VEC,), (v,)), rV)
                if const_expr(self.has_delta):
                    cute.copy(ld, cute.local_tile(mDelta[token, None], (VEC,), (v,)), rW)
                    rV.store((rV.load().to(Float32) + rW.load().to(Float32)).to(BFloat16))
                cute.copy(st, rV, cute.local_tile(gNewPrefix, (VEC,), (v,)))
                if const_expr(self.write_idx >= 0):
                    cute.copy(st, rV, cute.local_tile(mBlocks[token, self.write_idx, None], (VEC,), (v,)))
                cute.copy(st_s, rV, cute.local_tile(sSrc[None, P], (VEC,), (lv,)))
                x = rV.load().to(Float32)
                rSq[P] = rSq[P] + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                rDot[P] = rDot[P] + (x * rQ[None, j].load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

        # the blocks' partial sums, from this thread's own copies (complete after its wait)
        cute.arch.cp_async_wait_group(0)
        for s in cutlass.range_constexpr(P):
            if const_expr(s == self.write_idx):
                rSq[s] = rSq[P]
                rDot[s] = rDot[P]
            else:
                for j in cutlass.range_constexpr(V):
                    lv = tidx + j * self.threads
                    if const_expr(self.even) or lv < self.share:
                        cute.autovec_copy(cute.local_tile(sSrc[None, s], (VEC,), (lv,)), rV)
                        x = rV.load().to(Float32)
                        rSq[s] = rSq[s] + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        rDot[s] = rDot[s] + (x * rQ[None, j].load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

        # 3. the 2S sums over the cluster: each warp's, pushed into every CTA, then summed there
        rSum = cute.make_rmem_tensor((2 * S,), Float32)
        for s in cutlass.range_constexpr(S):
            rSum[2 * s] = cute.arch.warp_reduction(rSq[s], operator.add)
            rSum[2 * s + 1] = cute.arch.warp_reduction(rDot[s], operator.add)
        if const_expr(self.cluster > 1):
            cute.arch.cluster_wait()  # every CTA of the cluster has started
        self.exchange(rSum, sPart, mbarSum, lane, rank * W + warp)

        # 4. logits and softmax weights (every thread computes all S of them)
        rLogit = cute.make_rmem_tensor((S,), Float32)
        for s in cutlass.range_constexpr(S):
            rLogit[s] = rSum[2 * s + 1] * cute.math.rsqrt(rSum[2 * s] * inv_d + self.eps)
        m = rLogit[0]
        for s in cutlass.range_constexpr(1, S):
            m = cute.arch.fmax(m, rLogit[s])
        total = Float32(0.0)
        for s in cutlass.range_constexpr(S):
            rLogit[s] = cute.math.exp(rLogit[s] - m)
            total = total + rLogit[s]
        inv_total = Float32(1.0) / total
        for s in cutlass.range_constexpr(S):
            rLogit[s] = rLogit[s] * inv_total

        # 5. the mix (each thread reads back only what it staged: no barrier needed), its norm over
        # the cluster (pushed like step 3), the output
        rMix = cute.make_rmem_tensor((VEC, V), Float32)
        rMix.fill(0.0)
        rMixSq = cute.make_rmem_tensor((1,), Float32)
        rMixSq.fill(0.0)
        for j in cutlass.range_constexpr(V):
            lv = tidx + j * self.threads
            if const_expr(self.even) or lv < self.share:
                src = P if const_expr(self.write_idx == 0) else 0
                cute.autovec_copy(cute.local_tile(sSrc[None, src], (VEC,), (lv,)), rV)
                acc = rV.load().to(Float32) * rLogit[0]
                for s in cutlass.range_constexpr(1, S):
                    src = P if const_expr(s == self.write_idx) else s
                    cute.autovec_copy(cute.local_tile(sSrc[None, src], (VEC,), (lv,)), rV)
                    acc = acc + rV.load().to(Float32) * rLogit[s]
                rMix[None, j].store(acc)
                rMixSq[0] = rMixSq[0] + (acc * acc).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        rMixSq[0] = cute.arch.warp_reduction(rMixSq[0], operator.add)
        self.exchange(rMixSq, sMixSq, mbarMix, lane, rank * W + warp)
        r = cute.math.rsqrt(rMixSq[0] * inv_d + self.eps)
        for j in cutlass.range_constexpr(V):
            lv = tidx + j * self.threads
            if const_expr(self.even) or lv < self.share:
                rV.store((rMix[None, j].load() * r * rOutW[None, j].load().to(Float32)).to(BFloat16))
                cute.copy(st, rV, cute.local_tile(gOut, (VEC,), (first + lv,)))

    @cute.jit
    def exchange(self, rSum: cute.Tensor, sBuf: cute.Tensor, mbar: cute.Tensor, lane, entry):
        """The warp's sums ``rSum`` (the same in every lane after its shuffles) become the
        cluster's: lane r sends them to ``entry`` of CTA r's ``sBuf`` (``[values, entries]``),
        counted on CTA r's ``mbar``; once this CTA's ``mbar`` has every entry, every lane sums
        every entry: lane e adds entries e, e + 32, ..., then the warp's shuffles; the same
        order in every warp and CTA. A CTA alone (one a token, no cluster launched: 100 tokens)
        stores its warps' entries itself and waits on a CTA barrier."""
        n = const_expr(cute.size(rSum))
        if const_expr(self.cluster > 1):
            if lane < self.cluster:
                for k in cutlass.range_constexpr(n):
                    push_send(sBuf, mbar, rSum[k], (k, entry), lane)
            push_received(mbar)
        else:  # a CTA alone (no cluster launched): its warps' entries through its shared memory
            if lane == 0:
                for k in cutlass.range_constexpr(n):
                    sBuf[k, entry] = rSum[k]
            cute.arch.barrier()
        E = const_expr(self.entries)
        rSum.fill(0.0)
        for e0 in cutlass.range_constexpr(-(-E // 32)):
            e = lane + e0 * 32
            if const_expr((e0 + 1) * 32 <= E) or e < E:
                for k in cutlass.range_constexpr(n):
                    rSum[k] = rSum[k] + sBuf[k, e]
        for k in cutlass.range_constexpr(n):
            rSum[k] = cute.arch.warp_reduction(rSum[k], operator.add)


def build(spec) -> tuple[AttnResNorm, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    d, nb = s["hidden"], s["blocks"]
    kernel = AttnResNorm(d, nb, p["num_blocks"], p["write_idx"], p["has_delta"], p["eps"], p["cluster"],
                         p["vectors"])
    tokens = cute.sym_int32()  # the token count is a runtime size: one compile serves every batch of a split

    def row(*shape):  # row-major bf16 tensor, first mode = tokens
        stride, acc = [], 1
        for n in reversed(shape[1:]):
            stride.insert(0, acc)
            acc *= n
        return make_fake_tensor(BFloat16, (tokens, *shape[1:]), (acc, *stride), assumed_align=16)

    def vec():
        return make_fake_tensor(BFloat16, (d,), (1,), assumed_align=16)

    args = (row(None, d), row(None, d) if p["has_delta"] else None, row(None, nb, d), vec(), vec(), vec(),
            row(None, d), row(None, d), make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args

