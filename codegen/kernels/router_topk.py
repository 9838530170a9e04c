"""``router_topk``: sigmoid scores, bias-corrected top-k, renormalized weights; one CTA per token.

The math is ``rewriter/layers/moe.py:route`` (the CPU reference of ``k3f::router_topk``):

    s       = sigmoid(logits[t])                    (fp32, E experts)
    ids     = topk(s + bias, k)                     (the bias selects, it is not a weight)
    w       = s[ids]                                (in the order of ids)
    weights = w / sum(w) * scaling                  (or w * scaling without renormalize)

``torch.topk`` returns its values sorted, so ``ids`` are ordered by descending ``s + bias``;
the kernel emits them in the same order. Ties: torch documents no order among equal
values (the CPU and CUDA implementations need not agree; on the CPU, torch 2.13 returns
indices 1 and 3 for the top 2 of [1, 2, 2, 2, 0]); the kernel takes the lower expert
index first. NaN logits are not handled as torch does (torch.topk ranks NaN highest; here a
NaN never wins a comparison).

Work split: thread i of the CTA owns experts i, i + threads, ... (coalesced fp32 loads of
the logits and the bias), keeps their scores and selection values in registers, and the k
experts are found by k rounds of a block-wide argmax: each thread's best (value, index), a
5-step butterfly of (value, index) pairs over the warp (``shfl.sync.bfly``), one
(value, index) per warp through shared memory (double buffered, so one barrier per round),
and every thread reduces the per-warp winners itself. The owner of the winner records its
score and id in shared memory and takes the value out of the race (-inf). After the k
rounds the first k lanes of warp 0 sum the k scores with a butterfly, scale them and store
the weights (fp32) and the ids (int64).

Ties everywhere are broken towards the lower index: a thread's own experts are scanned in
increasing index order with a strict ``>``, and pairs compare (value, then lower index).
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

MAX_EXPERTS = 8192
MAX_TOP_K = 32  # the weights are summed by one warp
MAX_PER_THREAD = 8


class RouterTopk:
    """Compile-time configuration: experts E, top_k, renormalize, scaling, threads per CTA
    (whole warps, at most 8 experts each; the template's choice is ``templates.router_threads``:
    128 for E = 896, 7 experts each; one warp for E = 16)."""

    def __init__(self, experts: int, top_k: int, renormalize: bool, scaling: float, threads: int):
        if not 1 <= experts <= MAX_EXPERTS:
            raise ValueError(f"{experts} experts outside 1..{MAX_EXPERTS}")
        if not 1 <= top_k <= min(MAX_TOP_K, experts):
            raise ValueError(f"top_k {top_k} outside 1..{min(MAX_TOP_K, experts)}")
        self.experts = experts
        self.top_k = top_k
        self.renormalize = bool(renormalize)
        self.scaling = float(scaling)
        self.threads = threads
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads {self.threads} must be whole warps, 32..1024")
        self.per_thread = -(-experts // self.threads)
        if self.per_thread > MAX_PER_THREAD:
            raise ValueError(f"{self.per_thread} experts per thread (at most {MAX_PER_THREAD}): more threads")
        self.even = experts % self.threads == 0
        self.num_warps = self.threads // 32

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mLogits, mBias, mWeights, mIds).launch(
            grid=[mLogits.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        V = const_expr(self.per_thread)
        K = const_expr(self.top_k)
        W = const_expr(self.num_warps)
        neg_inf = Float32(-float("inf"))

        smem = cutlass.memory.SmemAllocator()
        sVal = smem.allocate_tensor(Float32, cute.make_layout((W, 2)), byte_alignment=16)  # per-warp winners,
        sIdx = smem.allocate_tensor(Int32, cute.make_layout((W, 2)), byte_alignment=16)  # two buffers
        sScore = smem.allocate_tensor(Float32, cute.make_layout((K,)), byte_alignment=16)
        sId = smem.allocate_tensor(Int32, cute.make_layout((K,)), byte_alignment=16)

        # 1. scores and selection values of this thread's experts (absent ones: -inf, never picked)
        rScore = cute.make_rmem_tensor((V,), Float32)
        rSel = cute.make_rmem_tensor((V,), Float32)
        gLogits = mLogits[token, None]
        for j in cutlass.range_constexpr(V):
            e = tidx + j * self.threads
            rScore[j] = Float32(0.0)
            rSel[j] = neg_inf
            if const_expr(self.even) or e < self.experts:
                x = gLogits[e]
                s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))
                rScore[j] = s
                rSel[j] = s + mBias[e]

        # 2. k rounds of a block-wide argmax; ties go to the lower expert index
        for r in cutlass.range_constexpr(K):
            buf = const_expr(r % 2)
            best = rSel[0]
            best_i = tidx
            for j in cutlass.range_constexpr(1, V):
                take = rSel[j] > best
                best = Float32(cutlass.select_(take, rSel[j], best))
                best_i = Int32(cutlass.select_(take, tidx + j * self.threads, best_i))
            for o in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_bfly(best, offset=16 >> o)
                other_i = cute.arch.shuffle_sync_bfly(best_i, offset=16 >> o)
                take = (other > best) | ((other == best) & (other_i < best_i))
                best = Float32(cutlass.select_(take, other, best))
                best_i = Int32(cutlass.select_(take, other_i, best_i))
            if const_expr(W > 1):
                if lane == 0:
                    sVal[warp, buf] = best
                    sIdx[warp, buf] = best_i
                cute.arch.barrier()
                best = sVal[0, buf]
                best_i = sIdx[0, buf]
                for w in cutlass.range_constexpr(1, W):
                    other = sVal[w, buf]
                    other_i = sIdx[w, buf]
                    take = (other > best) | ((other == best) & (other_i < best_i))
                    best = Float32(cutlass.select_(take, other, best))
                    best_i = Int32(cutlass.select_(take, other_i, best_i))
            # the owner records the winner and takes it out of the race
            for j in cutlass.range_constexpr(V):
                if best_i == tidx + j * self.threads:
                    sScore[r] = rScore[j]
                    sId[r] = best_i
                    rSel[j] = neg_inf
        cute.arch.barrier()

        # 3. the first k lanes of warp 0: sum, scale, store (weights fp32, ids int64)
        if warp == 0:
            w = Float32(0.0)
            if lane < K:
                w = sScore[lane]
            if const_expr(self.renormalize):
                w = w / cute.arch.warp_reduction(w, operator.add)
            if const_expr(self.scaling != 1.0):
                w = w * Float32(self.scaling)
            if lane < K:
                mWeights[token, lane] = w
                mIds[token, lane] = Int64(sId[lane])


def build(spec) -> tuple[RouterTopk, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    e, k = s["experts"], p["top_k"]
    kernel = RouterTopk(e, k, p["renormalize"], p["scaling"], p["threads"])
    tokens = cute.sym_int32()  # the token count is a runtime size: one compile serves every batch
    args = (make_fake_tensor(Float32, (tokens, e), (e, 1), assumed_align=4),
            make_fake_tensor(Float32, (e,), (1,), assumed_align=4),
            make_fake_tensor(Float32, (tokens, k), (k, 1), assumed_align=4),
            make_fake_tensor(Int64, (tokens, k), (k, 1), assumed_align=8),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
