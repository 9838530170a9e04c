"""``router_topk``: sigmoid scores, bias-corrected top-k, renormalized weights; one CTA per token.

The math is ``rewriter/model/layers/moe.py:route`` (the CPU reference of ``k3f::router_topk``):

    s       = sigmoid(logits[t])                    (fp32, E experts)
    ids     = topk(s + bias, k)                     (the bias selects, it is not a weight)
    w       = s[ids]                                (in the order of ids)
    weights = w / sum(w) * scaling                  (or w * scaling without renormalize)

``torch.topk`` returns its values sorted, so ``ids`` are ordered by descending ``s + bias``;
the kernel emits them in the same order. Ties: torch documents no order among equal
values (the CPU and CUDA implementations need not agree; on the CPU, torch 2.13 returns
indices 1 and 3 for the top 2 of [1, 2, 2, 2, 0]); the kernel takes the lower expert
index first. A NaN selection value ranks by its bits: the canonical (positive) NaN the GPU
makes of a NaN logit ranks above every number, as ``torch.topk`` ranks NaN.
The sigmoid is ``rcp.approx(1 + exp(-x))`` (``ex2.approx`` after range reduction): a few fp32
ulp, and no IEEE-division slow path, whose branches would keep the experts' chains apart.

Every expert gets one 64-bit key that orders exactly as (value descending, index ascending):
the fp32 value's bits mapped to an unsigned integer of the same order in the high word,
``0xFFFF - index`` in the low word. Absent experts (past E in the last threads) get a zero high
word, below every real one.

Work split, with no barrier until the k candidates of every warp are known:
- thread t owns the contiguous experts ``t*V .. t*V+V-1`` (V <= 8) and loads their biases,
  then (programmatic dependent launch: the biases are parameters no kernel writes, the logits
  come from the previous kernel) ``griddepcontrol.wait``, ``launch_dependents`` and all V logits
  at once; it stages the scores in shared memory for the weights and sorts its V keys in
  registers (Batcher's network);
- each warp finds its own top k in k rounds, no barrier and no shared-memory read:
  ``redux.sync.max.u32`` of the lanes' head values (high words), a ballot of the lanes holding
  that value, the lowest such lane (the lowest index: the experts are contiguous) wins, writes
  its key to the warp's candidate list and shifts its sorted keys by one;
- after one barrier the ``W x k`` candidates are ranked by counting the candidates above each
  (P threads per candidate, summed with ``shfl.sync.bfly``); those of rank < k write their id
  and score to slot ``rank`` (the keys are unique, so the ranks are);
- after a second barrier the first k lanes of warp 0 each sum the k scores from shared memory
  (the same order in every lane), scale theirs and store the weight (fp32) and the id (int64).
The global top k is among the candidates: an expert beaten by k others of its own warp is
beaten by k overall.

With ``plan`` (``k3f::routed_moe_mxfp4``, whose per-expert up stage reads it) the same k lanes also
file their pairs (token * k + slot) by expert, so that no later kernel has to scan the ids: each
takes its place in its expert's list with an atomic add on the expert's count, and the pair that
finds the count at 0 appends the expert to the list of chosen experts (a second atomic add). The
counts and the chosen count must be zero when the kernel starts; the down stage after the experts'
up stage, the plan's last reader, zeroes them again once past its wait (``expert_down_mxfp4``). The order within a
list is the atomics' order, which varies from run to run; the kernels that read the lists give
each pair the same result whatever its place.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, Uint32, Uint64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

MAX_EXPERTS = 8192
MAX_TOP_K = 32  # one warp stores the results; a warp's 32 lanes hold at least k experts
MAX_PER_THREAD = 8
LOW = 0xFFFF  # the key's low word: LOW - index (indices < 8192)


def sorting_network(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort for ``n`` values as compare-exchange pairs ``(i, j)``,
    ``i < j``; pairs past ``n`` are dropped (as if padded with values that never move)."""
    m = 1 << max(0, (n - 1).bit_length())
    pairs = []
    p = 1
    while p < m:
        k = p
        while k >= 1:
            for j in range(k % p, m - k, 2 * k):
                for i in range(min(k, m - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return [(a, b) for a, b in pairs if b < n]


def pairwise_sum(values: list):
    """Sum of ``values`` as a tree of pairwise adds (trace-time helper: log2 depth, one order)."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


class RouterTopk:
    """Compile-time configuration: experts E, top_k, renormalize, scaling, threads per CTA
    (whole warps, at most 8 experts each; the template's choice is ``launchers.router_topk.router_threads``:
    128 for E = 896, 7 experts each; one warp for E = 16)."""

    def __init__(self, experts: int, top_k: int, renormalize: bool, scaling: float, threads: int,
                 plan: bool = False):
        """``plan``: file the pairs by expert as well (``RouterTopkPlan``, whose call takes the plan)."""
        if not 1 <= experts <= MAX_EXPERTS:
            raise ValueError(f"{experts} experts outside 1..{MAX_EXPERTS}")
        if not 1 <= top_k <= min(MAX_TOP_K, experts):
            raise ValueError(f"top_k {top_k} outside 1..{min(MAX_TOP_K, experts)}")
        self.experts = experts
        self.top_k = top_k
        self.renormalize = bool(renormalize)
        self.scaling = float(scaling)
        self.threads = threads
        self.plan = bool(plan)
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads {self.threads} must be whole warps, 32..1024")
        self.per_thread = -(-experts // self.threads)
        if self.per_thread > MAX_PER_THREAD:
            raise ValueError(f"{self.per_thread} experts per thread (at most {MAX_PER_THREAD}): more threads")
        self.even = experts % self.threads == 0
        self.num_warps = self.threads // 32
        self.candidates = self.num_warps * top_k  # C <= threads, as k <= 32
        # P threads (neighbouring lanes) share a candidate's count: a power of two dividing C
        self.share = 1
        while self.share * 2 <= min(32, self.threads // self.candidates) and self.candidates % (self.share * 2) == 0:
            self.share *= 2
        self.network = sorting_network(self.per_thread)

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor,
                 stream: cuda.CUstream):
        # no plan: mIds stands in for its three tensors, which the kernel then never touches
        self.kernel(mLogits, mBias, mWeights, mIds, mIds, mIds, mIds).launch(
            grid=[mLogits.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor,
               mCount: cute.Tensor, mChosen: cute.Tensor, mLists: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        V = const_expr(self.per_thread)
        K = const_expr(self.top_k)
        C = const_expr(self.candidates)
        P = const_expr(self.share)

        smem = cutlass.memory.SmemAllocator()
        sScore = smem.allocate_tensor(Float32, cute.make_layout((self.experts,)), byte_alignment=16)
        sCand = smem.allocate_tensor(Uint64, cute.make_layout((C,)), byte_alignment=16)  # per warp, sorted
        sSelId = smem.allocate_tensor(Int32, cute.make_layout((K,)), byte_alignment=16)
        sSelScore = smem.allocate_tensor(Float32, cute.make_layout((K,)), byte_alignment=16)

        # 1. biases (parameters: read before the previous kernel's end), then the logits
        rBias = cute.make_rmem_tensor((V,), Float32)
        for j in cutlass.range_constexpr(V):
            e = tidx * V + j
            if const_expr(self.even) or e < self.experts:
                rBias[j] = mBias[e]
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # keys of this thread's experts: high word the value's bits in unsigned order, low word
        # LOW - index (absent experts: high word 0); scores staged for the weights
        rLogit = cute.make_rmem_tensor((V,), Float32)
        gLogits = mLogits[token, None]
        for j in cutlass.range_constexpr(V):  # all loads in flight before the first use
            e = tidx * V + j
            if const_expr(self.even) or e < self.experts:
                rLogit[j] = gLogits[e]
        rKey = cute.make_rmem_tensor((V,), Uint64)
        for j in cutlass.range_constexpr(V):
            e = tidx * V + j
            rKey[j] = Uint64(LOW - e)
            if const_expr(self.even) or e < self.experts:
                s = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-rLogit[j]))
                sScore[e] = s
                bits = (s + rBias[j]).bitcast(Uint32)
                flip = cutlass.select_(bits >= Uint32(0x80000000), Uint32(0xFFFFFFFF), Uint32(0x80000000))
                rKey[j] = (Uint64(bits ^ flip) << 32) | Uint64(LOW - e)
        # sorted descending in registers
        for a, b in self.network:
            x, y = rKey[a], rKey[b]
            swap = y > x
            rKey[a] = cutlass.select_(swap, y, x)
            rKey[b] = cutlass.select_(swap, x, y)

        # 2. the warp's top k: max of the lanes' head values, the lowest lane holding it wins
        lower_lanes = cute.arch.lanemask_lt()
        for r in cutlass.range_constexpr(K):
            head = Uint32(rKey[0] >> 32)
            best = cute.arch.warp_redux_sync(head, "max")
            tied = head == best
            holders = Uint32(cute.arch.vote_ballot_sync(tied))
            win = tied & ((holders & lower_lanes) == Uint32(0))
            if win:
                sCand[warp * K + r] = rKey[0]
            for j in cutlass.range_constexpr(V - 1):
                rKey[j] = cutlass.select_(win, rKey[j + 1], rKey[j])
            rKey[V - 1] = cutlass.select_(win, Uint64(0), rKey[V - 1])
        cute.arch.barrier()

        # 3. rank of candidate c: the candidates above it, counted by P neighbouring threads
        c = tidx // P
        part = tidx % P
        mine = sCand[cutlass.min(c, C - 1)]  # threads past the candidates count a copy, store nothing
        # summed as floats (exact for counts < 2^24): the compiler keeps float adds a tree, where
        # it chains integer adds one after the other
        above = Int32(pairwise_sum([cutlass.select_(sCand[self.counted(q, part)] > mine, Float32(1.0), Float32(0.0))
                                    for q in range(C // P)]))
        for o in cutlass.range_constexpr(P.bit_length() - 1):
            above = above + cute.arch.shuffle_sync_bfly(above, offset=1 << o)
        if c < C and part == 0 and above < K:
            e = LOW - Int32(mine & Uint64(LOW))
            sSelId[above] = e
            sSelScore[above] = sScore[e]
        cute.arch.barrier()

        # 4. the first k threads (lanes of warp 0): sum (each in the same order), scale, store
        if tidx < K:
            w = sSelScore[tidx]
            if const_expr(self.renormalize):
                w = w / pairwise_sum([sSelScore[i] for i in range(K)])
            if const_expr(self.scaling != 1.0):
                w = w * Float32(self.scaling)
            mWeights[token, tidx] = w
            e = sSelId[tidx]
            mIds[token, tidx] = Int64(e)
            if const_expr(self.plan):  # a token chooses an expert once: its place is below the token count
                place = cute.arch.atomic_add(mCount.iterator + e, Int32(1), sem="relaxed", scope="gpu")
                if place < mLists.shape[1]:  # (a plan left unzeroed must not write past the lists)
                    mLists[e, place] = token * K + tidx
                if place == 0:
                    mChosen[cute.arch.atomic_add(mCount.iterator + self.experts, Int32(1), sem="relaxed",
                                                 scope="gpu")] = e

    def counted(self, q: int, part):
        """The candidate that the thread of ``part`` compares in its step ``q`` (trace-time helper):
        pairs of neighbours (one 128-bit load), the parts' pairs side by side (no bank conflict)."""
        n = self.candidates // self.share
        pair = 2 if n % 2 == 0 else 1
        return (q // pair) * (pair * self.share) + part * pair + q % pair


class RouterTopkPlan(RouterTopk):
    """The same kernel filing the pairs by expert: ``mCount`` int32 [E + 1] (each expert's pairs,
    then the chosen experts' count), ``mChosen`` int32 [E], ``mLists`` int32 [E, cap]."""

    def __init__(self, *args, **kw):
        super().__init__(*args, plan=True, **kw)

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor,
                 mCount: cute.Tensor, mChosen: cute.Tensor, mLists: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mLogits, mBias, mWeights, mIds, mCount, mChosen, mLists).launch(
            grid=[mLogits.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)


def build(spec) -> tuple[RouterTopk, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    e, k = s["experts"], p["top_k"]
    plan = p.get("plan_cap")
    kernel = (RouterTopkPlan if plan else RouterTopk)(e, k, p["renormalize"], p["scaling"], p["threads"])
    tokens = cute.sym_int32()  # the token count is a runtime size: one compile serves every batch
    args = (make_fake_tensor(Float32, (tokens, e), (e, 1), assumed_align=4),
            make_fake_tensor(Float32, (e,), (1,), assumed_align=4),
            make_fake_tensor(Float32, (tokens, k), (k, 1), assumed_align=4),
            make_fake_tensor(Int64, (tokens, k), (k, 1), assumed_align=8))
    if plan:  # the plan's counts [E + 1], chosen experts [E] and lists [E, cap]
        args += (make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4),
                 make_fake_tensor(Int32, (e,), (1,), assumed_align=4),
                 make_fake_tensor(Int32, (e, plan), (plan, 1), assumed_align=4))
    return kernel, (*args, make_fake_stream(use_tvm_ffi_env_stream=True))
