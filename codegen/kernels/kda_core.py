"""``kda_core``: the KDA decode core, one CTA per (request, head) or, at large batches, one an SM.

The math is ``rewriter/model/layers/kda.py:kda_core`` with ``rewriter/model/ops.py``'s
``kda_conv_update`` and ``kda_recurrent_step`` (the CPU reference of ``k3f::kda_core``),
per request ``b`` (slot ``s = state_indices[b]``), head ``h`` and each of its ``q`` tokens
in order (D = 128 channels per head, P = H * D):

    g1     = bf16(f_a[t] @ f_b_weight[h*D : (h+1)*D]^T)                    (the f_b_proj GEMV)
    q|k|v  = bf16(silu(<[conv_state[s, c], x[t, c]], conv_weight[c]>))     (width-4 causal conv)
    conv_state[s, c] = the last 3 inputs                                    (in place)
    q      = q * rsqrt(|q|^2 + 1e-6) * D^-0.5,  k = k * rsqrt(|k|^2 + 1e-6)
    g      = lb * sigmoid(e^A_log[h] * (g1 + dt_bias))   (lb = lower_bound; or -e^A softplus(.))
    S      = S * exp(g)  (per K column);  S += sigmoid(beta[t, h]) * (v - S k) k^T;  o = bf16(S q)
    out[t] = bf16(o * rsqrt(mean(o^2) + eps) * norm_weight * sigmoid(g_out[t]))

``S`` is ``recurrent_state[s, h]``, fp32 [V = D, K = D], updated in place. A request whose
slot is <= 0 (vLLM's padding rows, slot 0 its null block) reads and writes no state and its
output rows are 0.

A verify step (``verify``; ``k3f::kda_core_verify``, vLLM's multi-slot contract in
docs/SPECULATIVE.md) takes ``state_indices`` [B, q] (any row stride) and ``num_accepted`` [B]
(a, clamped to 1..q): the conv state is column 0's slot with ``conv_rows`` >= q + 2 rows, its
window rows a-1 .. a+1, rewritten as the old rows a, a+1 and then this step's q inputs; the
recurrent state is read from column a - 1's slot and token t's state stored to column t's
(where > 0) right after its update. A request whose column-0 slot or source slot is <= 0 is a
padding row.

The states are read where vLLM keeps them: one page per slot, so the slot stride of both is
a runtime value (the page, 64-bit offsets); within a slot the recurrent state is
[H, V, K] contiguous and the conv state [3, 3P] (``SD``, vLLM's default: tap-major) or
[3P, 3] (``DS``), a compile-time choice.

Work split: 512 threads a CTA, launched with programmatic dependent launch (PDL), in one of two
forms (a compile-time choice, ``persistent``, that the launcher makes from the batch):
- one CTA per (request, head) (grid B x H, flattened);
- ``persistent`` (one token per request, one slot, from ``PERSISTENT_FROM_ITEMS`` pairs in
  ``codegen/launchers/kda_core.py``): a grid of one CTA an SM (a multiple of H, so that a CTA
  keeps its head), each CTA looping over items ``cta, cta + grid, ...``. The kernel holds one
  CTA an SM, so a grid of more CTAs would run in waves, each CTA's loads exposed in turn;
  here each item first copies the next one's inputs (``cp.async`` into the other of two
  shared-memory buffers), so only the first item's round trips are exposed.
Before ``griddepcontrol.wait`` a CTA loads only weights, which no kernel writes: its quarter
of each f_b_proj row (at q > 1 only after the wait: held across the state loads it would spill
registers), the conv threads' fp32 taps and (persistent) the norm weight; into registers, or
persistent by ``cp.async`` into shared memory (held in registers across the items they would
crowd out the state); e^A_log of the head and the thread's dt_bias into registers.
The activations are read, and anything written, only after it (``launch_dependents`` follows
at once). One CTA per item at one token also reads its slot (vLLM's metadata, copied in before
the step's first kernel) and its state rows (written only by this layer's kda_core, a step ago)
before the wait, and the norm weight; after it f_a, g_out and beta go out with the conv
threads' loads, so the prologue waits for one round trip (it waited for the slot, then the
state, and the conv threads for f_a after the conv, the output threads for g_out at the end).
The persistent form reads state_indices and the states after the wait, each item's slot two
items ahead, so no item's work waits on a state index.
Thread ``i`` owns state row ``v = i // 4`` and, of its 32 128-bit vectors (4 fp32), the 8
with ``vector % 4 == i % 4``: a warp reads 8 rows x 64 contiguous bytes per load, and the
64 KB of the head's state are all in flight (8 per thread; ``ld.global.L1::no_allocate``
into registers, or persistent ``cp.async`` into the item's buffer) before the prologue. A
persistent item's inputs come in two ``cp.async`` groups (its activations, its state), so it
waits for its activations before the prologue and for its state after it. The prologue:
- the f_b_proj GEMV: the same (row, quarter) split over the head's 128 x 128 bf16 weight
  rows, f_a from the item's buffer (persistent; copied by 16 threads, so a barrier first) or
  by ``ld.global.nc.v4``, a 4-lane butterfly (the row's 4 threads all hold g1 then), and exp(g)
  goes to shared memory;
- the conv: 96 threads of 4 channels each (a warp per q, k, v; with 8 channels a thread the
  conv's dependent chain was what the other warps waited for at the barrier): the conv state
  (3 x 64 bits, bf16: one per tap in SD, the 4 channels' 12 contiguous values in DS) and x
  in 64-bit loads or from the item's buffer, the tokens in order, the new conv state written
  back as 3 x 64-bit stores; q and k (warps 0 and 1) get their L2 norms from a 32-lane
  butterfly; q, k, v go to shared memory (fp32);
- sigmoid(beta) per token (loaded when the item starts; persistent, an item ahead).
One barrier, then each thread runs the tokens' delta-rule updates on its registers (two
4-lane butterflies per token: S k and S q) and writes its row of o (bf16) and, per warp,
the sum of o^2 over its 8 rows to shared memory. The state goes back with 8 128-bit stores
per thread; after a second barrier 16 threads per token gate and normalize 8 channels each
(g_out from the item's buffer when persistent) and store them with one 128-bit store.
Between items nothing more is needed: every shared-memory vector an item writes is read by
others only after a barrier of the same item, and the next item's copies go to the other
buffer, whose last readers passed a barrier before the copying thread did.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom, r2g_atom, r2s_atom

HEAD_DIM = 128
CONV_WIDTH = 4
MAX_Q = 8  # tokens per request: the per-token smem vectors and the output threads (16 per token)
THREADS = 512  # 4 per state row
F32_VEC = 4  # fp32 per 128-bit vector
ROW_VECS = HEAD_DIM // F32_VEC // 4  # state vectors per thread (8)
CONV_CH = 4  # conv channels per conv thread (3 x 64 bits of bf16 state)
CONV_BITS = 16 * CONV_CH  # a conv thread's accesses of its channels' conv state and x
SEG_THREADS = HEAD_DIM // CONV_CH  # 32: q, k and v one warp each
CONV_THREADS = 3 * SEG_THREADS  # 96
OUT_THREADS = HEAD_DIM // VEC  # 16 per token
QK_EPS = 1e-6  # rewriter.model.layers.common.l2_normalize


@dataclass(frozen=True)
class Shared:
    """The kernel's shared-memory tensors (trace-time handles, ``KdaCore.shared``); the staged
    inputs are None unless ``KdaCore.persistent``."""
    g: Any  # exp(g) [D, q]
    qkv: Any  # conv outputs, q and k normalized [D, 3, q]
    beta: Any  # sigmoid(beta) [q]
    o: Any  # o before the norm [D, q]
    sq: Any  # per-warp sums of o^2 [warps, q]
    state: Any  # state rows [4, thread, 8, buffers]
    fb: Any  # f_b_proj row quarters [8, thread, 4]
    conv_w: Any  # conv taps [4, conv thread, 8 channels]
    conv_s: Any  # conv state [8, conv thread, 3, buffers]
    x: Any  # the conv threads' x [8, conv thread, buffers]
    fa: Any  # f_a [8, 16, buffers]
    g_out: Any  # the output gate [8, 16, buffers]
    norm_w: Any  # the norm weight [8, 16]


def g2s_atom(dtype=Float32, bits: int = 128):
    """Global -> shared memory by ``cp.async``, 128 bits past the L1 (the state, the weights);
    narrower copies (the conv threads' 64 bits) through the L1, as cp.async has them."""
    mode = cute.nvgpu.LoadCacheMode.GLOBAL if bits == 128 else cute.nvgpu.LoadCacheMode.ALWAYS
    return cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=mode), dtype, num_bits_per_copy=bits)


class KdaCore:
    """Compile-time configuration: heads H, tokens per request q, the decay's lower bound
    (None: the softplus form), the gated norm's eps, the conv state's layout in a slot
    (``SD`` or ``DS``), and for a speculative verify step (``verify``) the conv rows a slot keeps
    (3 + k). head_dim is 128, conv width 4."""

    def __init__(self, heads: int, q_len: int, lower_bound: float | None, eps: float, conv_layout: str = "SD",
                 verify: bool = False, conv_rows: int = CONV_WIDTH - 1, persistent: bool = False):
        if heads < 1:
            raise ValueError(f"heads {heads} must be >= 1")
        if not 1 <= q_len <= MAX_Q:
            raise ValueError(f"q_len {q_len} outside 1..{MAX_Q}")
        self.heads = heads
        self.proj = heads * HEAD_DIM
        self.q_len = q_len
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.eps = float(eps)
        if conv_layout not in ("SD", "DS"):
            raise ValueError(f"conv_layout {conv_layout!r}: SD or DS")
        self.conv_layout = conv_layout
        if verify and conv_rows < q_len + CONV_WIDTH - 2:
            raise ValueError(f"a verify of {q_len} tokens needs {q_len + CONV_WIDTH - 2} conv rows, got {conv_rows}")
        if not verify and conv_rows != CONV_WIDTH - 1:
            raise ValueError(f"a one-slot step keeps {CONV_WIDTH - 1} conv rows, got {conv_rows}")
        self.verify, self.conv_rows = verify, conv_rows
        # taps held as [channel, tap] registers: SD's 128-bit rows, or the scalars a verify reads in DS
        self.tap_major = conv_layout == "SD" or verify
        if persistent and (q_len != 1 or verify):
            raise ValueError("the persistent form takes one token per request, one slot (no verify)")
        # persistent: a grid smaller than the items loops over them (``persistent_ctas``), every
        # input of an item copied into shared memory ahead of it
        self.persistent = persistent

    @cute.jit
    def __call__(self, mQKV: cute.Tensor, mGOut: cute.Tensor, mFa: cute.Tensor, mBeta: cute.Tensor,
                 mFbW: cute.Tensor, mConvW: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
                 mNormW: cute.Tensor, mConvS: cute.Tensor, mState: cute.Tensor, mIdx: cute.Tensor,
                 mAcc: cute.Tensor, mOut: cute.Tensor, ctas: Int32, stream: cuda.CUstream):
        """``mAcc``: num_accepted [B] of a verify step (unread otherwise: the launcher passes
        state_indices). ``ctas``: the grid, one CTA per (request, head) or fewer
        (``persistent_ctas``: then a multiple of the heads)."""
        self.kernel(mQKV, mGOut, mFa, mBeta, mFbW, mConvW, mALog, mDtBias, mNormW, mConvS, mState, mIdx, mAcc,
                    mOut).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mQKV: cute.Tensor, mGOut: cute.Tensor, mFa: cute.Tensor, mBeta: cute.Tensor,
               mFbW: cute.Tensor, mConvW: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
               mNormW: cute.Tensor, mConvS: cute.Tensor, mState: cute.Tensor, mIdx: cute.Tensor,
               mAcc: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        H = const_expr(self.heads)
        items = mIdx.shape[0] * H
        head = cta % H  # every item of this CTA: the grid is the items or a multiple of H
        sh = self.shared()

        # 0. before the wait (PDL), weights only (no kernel writes them): this thread's quarter of
        # f_b_proj row n (at q > 1 in registers only after the wait: held across the state loads
        # it would spill), the conv threads' taps and, persistent, the norm weight. Persistent by
        # cp.async into shared memory (held in registers across the items they would crowd out
        # the state), else in registers by plain loads (not ld.global.nc: ptxas sinks those
        # below griddepcontrol.wait, plain ones stay above it)
        n = head * HEAD_DIM + tidx // 4
        # the decay's constants of the head and of row n, in registers for every item (read in
        # the gate they were a round trip of their own on each item's path)
        decay_a = cute.math.exp(mALog[head])
        dt = mDtBias[n]
        rFb, rConvW = None, None
        if const_expr(self.persistent):
            for u in cutlass.range_constexpr(4):
                cute.copy(g2s_atom(BFloat16), cute.local_tile(mFbW[n, None], (VEC,), (u * 4 + tidx % 4,)),
                          sh.fb[None, tidx, u])
            if tidx < CONV_THREADS:
                ch0 = self.conv_channel(head, tidx)
                for c in cutlass.range_constexpr(CONV_CH):
                    cute.copy(g2s_atom(), cute.local_tile(mConvW[ch0 + c, None], (F32_VEC,), (0,)),
                              sh.conv_w[None, tidx, c])
            if tidx < OUT_THREADS:
                cute.copy(g2s_atom(BFloat16), cute.local_tile(mNormW, (VEC,), (tidx,)), sh.norm_w[None, tidx])
            cute.arch.cp_async_commit_group()
        else:
            rFb = cute.make_rmem_tensor((VEC, 4), BFloat16)
            if const_expr(self.q_len == 1):
                self.load_fb(mFbW, rFb, n, tidx % 4)
            rConvW = cute.make_rmem_tensor((F32_VEC, CONV_CH), Float32)
            if tidx < CONV_THREADS:
                ch0 = self.conv_channel(head, tidx)
                for c in cutlass.range_constexpr(CONV_CH):
                    cute.copy(g2r_stream_atom(Float32), cute.local_tile(mConvW[ch0 + c, None], (F32_VEC,), (0,)),
                              rConvW[None, c])
        # one CTA per item, one token: its slot (vLLM's metadata, copied in before the step's
        # first kernel) and its state rows (written only by this layer's kda_core, a step ago)
        # are no earlier kernel's output either: read before the wait too, so that after it only
        # the activations' round trip is left (the slot's and then the state's were two more)
        early = const_expr(not self.persistent and not self.verify and self.q_len == 1)
        slot0, rS0, rNorm = Int32(0), None, None
        if const_expr(early):
            slot0 = mIdx[cta // H]
            rS0 = cute.make_rmem_tensor((F32_VEC, ROW_VECS), Float32)
            if slot0 > 0:
                self.load_state(rS0, mState[slot0, head, tidx // 4, None], tidx % 4)
            rNorm = cute.make_rmem_tensor((VEC,), BFloat16)  # the gated norm's weight (its 16 threads)
            if tidx < OUT_THREADS:
                cute.copy(g2r_stream_atom(BFloat16), cute.local_tile(mNormW, (VEC,), (tidx,)), rNorm)
        # the activations are the previous kernels' outputs (the outputs may reuse their memory):
        # every read of them and every global write comes after the wait
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # 1. persistent: the first item's inputs into buffer 0 (two groups: its activations, its
        # state); each item first sends the next one's into the other buffer, so that its own
        # round trips are all behind it. The slots travel with the loop: the one two items ahead
        # is read while this item works, so no item waits for a state index; beta an item ahead
        if const_expr(self.persistent):
            slot = mIdx[cta // H]
            upcoming = self.slot_of(mIdx, cta + ctas, items, H)
            beta = self.beta_of(mBeta, cta, items, H, tidx)
            self.prefetch(mQKV, mGOut, mFa, mConvS, mState, sh, cta // H, slot, head, tidx, 0)
            for item in cutlass.range(cta, items, ctas, unroll=1):
                buf = (item - cta) // ctas % 2
                after = self.slot_of(mIdx, item + 2 * ctas, items, H)
                beta_next = self.beta_of(mBeta, item + ctas, items, H, tidx)
                if item + ctas < items:
                    self.prefetch(mQKV, mGOut, mFa, mConvS, mState, sh, (item + ctas) // H, upcoming, head, tidx,
                                  1 - buf)
                else:
                    cute.arch.cp_async_commit_group()  # two empty groups: four per item either way
                    cute.arch.cp_async_commit_group()
                self.item(mQKV, mGOut, mFa, mBeta, mFbW, decay_a, dt, mNormW, mConvS, mState, mIdx, mAcc, mOut, sh,
                          item // H, head, buf, tidx, rFb, rConvW, slot, beta, None, None)
                slot = upcoming
                upcoming = after
                beta = beta_next
        else:  # one CTA per item, its inputs read where it uses them
            self.item(mQKV, mGOut, mFa, mBeta, mFbW, decay_a, dt, mNormW, mConvS, mState, mIdx, mAcc, mOut, sh,
                      cta // H, head, 0, tidx, rFb, rConvW, slot0, Float32(0.0), rS0, rNorm)

    def shared(self) -> Shared:
        """The kernel's shared memory. Per-thread copies are laid out [vector, thread, ...] so
        that a warp's 128-bit accesses of one index are contiguous (no bank conflicts). Only the
        persistent form stages an item's inputs and state, in two buffers (items alternate)."""
        Q, D = self.q_len, HEAD_DIM
        smem = cutlass.memory.SmemAllocator()

        def alloc(dtype, shape, stride=None):
            layout = cute.make_layout(shape) if stride is None else cute.make_layout(shape, stride=stride)
            return smem.allocate_tensor(dtype, layout, byte_alignment=16)

        def per_thread(dtype, elems, threads, *rest):  # [elems, threads, *rest], threads innermost after elems
            stride, size = [1, elems], elems * threads
            for r in rest:
                stride.append(size)
                size *= r
            return alloc(dtype, (elems, threads, *rest), tuple(stride))

        staged = self.persistent  # the inputs copied ahead of each item, in two buffers
        return Shared(
            g=alloc(Float32, (D, Q)),  # exp(g)
            qkv=alloc(Float32, (D, 3, Q)),  # normalized q, k; v
            beta=alloc(Float32, (Q,)),
            o=alloc(BFloat16, (D, Q)),
            sq=alloc(Float32, (THREADS // 32, Q)),
            state=per_thread(Float32, F32_VEC, THREADS, ROW_VECS, 2) if staged else None,  # a thread's 8 vectors
            fb=per_thread(BFloat16, VEC, THREADS, 4) if staged else None,  # a thread's f_b_proj row quarter
            conv_w=per_thread(Float32, F32_VEC, CONV_THREADS, CONV_CH) if staged else None,  # 4 channels x 4 taps
            conv_s=per_thread(BFloat16, CONV_CH, CONV_THREADS, 3, 2) if staged else None,
            x=per_thread(BFloat16, CONV_CH, CONV_THREADS, 2) if staged else None,
            fa=per_thread(BFloat16, VEC, OUT_THREADS, 2) if staged else None,
            g_out=per_thread(BFloat16, VEC, OUT_THREADS, 2) if staged else None,
            norm_w=per_thread(BFloat16, VEC, OUT_THREADS) if staged else None)

    @cute.jit
    def item(self, mQKV, mGOut, mFa, mBeta, mFbW, decay_a, dt, mNormW, mConvS, mState, mIdx, mAcc, mOut, sh, req, head,
             buf, tidx, rFb, rConvW, known_slot, known_beta, rS_read, rNorm):
        """One (request ``req``, ``head``) from buffer ``buf``: conv, gate, the delta-rule steps,
        the state stored back and the gated norm. Of the four most recent cp.async groups, the
        first two are this item's (activations, state), the last two the next item's; the staged
        form reads them from shared memory, the other one reads its activations and its state
        from global memory (the state straight into registers). The staged form takes its slot
        and thread 0's beta from the loop (``known_slot``, ``known_beta``: read ahead); the other
        form's one-token step takes its slot, its state rows (``rS_read``) and the norm weight
        (``rNorm``) read before the wait, and reads f_a and g_out with beta, before the conv and
        the gate need them (each had been a round trip of its own, f_a after the conv threads'
        conv); a verify step reads its slots and state here."""
        Q, D = self.q_len, HEAD_DIM
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = tidx // 4
        part = tidx % 4
        n = head * D + row
        if const_expr(self.persistent or rS_read is not None):  # one slot, read ahead
            a, slot, conv_slot = Int32(1), known_slot, known_slot
        else:
            a, slot, conv_slot = self.slots(mIdx, mAcc, req)
        if slot > 0:
            rS = rS_read
            if const_expr(rS_read is None):
                rS = cute.make_rmem_tensor((F32_VEC, ROW_VECS), Float32)
            if const_expr(not self.persistent and rS_read is None):  # staged: prefetched, read after the prologue
                self.load_state(rS, mState[slot, head, row, None], part)
            b = Float32(0.0)
            if const_expr(self.persistent):  # read an item ahead by the loop
                b = known_beta
            elif tidx < Q:
                b = mBeta[req * Q + tidx, head].to(Float32)
            rFa, rGo = None, None
            if const_expr(rS_read is not None):  # the activations the gate and the norm read, now
                # (plain loads: ptxas sinks ld.global.nc to their first use, past the conv's stores)
                ld = g2r_atom(BFloat16, invariant=False)
                rFa = cute.make_rmem_tensor((VEC, 4), BFloat16)
                for u in cutlass.range_constexpr(4):
                    cute.copy(ld, cute.local_tile(mFa[req, None], (VEC,), (u * 4 + part,)), rFa[None, u])
                rGo = cute.make_rmem_tensor((VEC,), BFloat16)
                if tidx < OUT_THREADS:
                    cute.copy(ld, cute.local_tile(mGOut[req, None], (VEC,), (head * OUT_THREADS + tidx,)), rGo)
            if const_expr(self.persistent):
                cute.arch.cp_async_wait_group(3)  # the weights and this item's activations landed
                cute.arch.barrier()  # f_a was copied by 16 threads for all

            # 2. prologue: conv (96 threads), f_b_proj GEMV + decay (all), sigmoid(beta)
            if tidx < CONV_THREADS:
                self.conv(mQKV, sh, rConvW, mConvS, conv_slot, a, req, head, tidx, warp, buf)
            if const_expr(not self.persistent and Q > 1):
                self.load_fb(mFbW, rFb, n, part)
            self.gate(mFa, sh, rFb, decay_a, dt, req, n, row, part, buf, rFa)
            if tidx < Q:
                sh.beta[tidx] = Float32(1.0) / (Float32(1.0) + cute.math.exp(-b))
            if const_expr(self.persistent):
                cute.arch.cp_async_wait_group(2)  # this item's state rows (each thread reads only its own)
                for j in cutlass.range_constexpr(ROW_VECS):
                    cute.autovec_copy(sh.state[None, tidx, j, buf], rS[None, j])
            cute.arch.barrier()

            # 3. the delta-rule steps of the q tokens on this thread's 32 state values
            rA = cute.make_rmem_tensor((F32_VEC,), Float32)
            for j in cutlass.range_constexpr(Q):
                pred = Float32(0.0)
                for u in cutlass.range_constexpr(ROW_VECS):
                    vec = u * 4 + part
                    cute.autovec_copy(cute.local_tile(sh.g[None, j], (F32_VEC,), (vec,)), rA)
                    s = rS[None, u].load() * rA.load()
                    rS[None, u].store(s)
                    cute.autovec_copy(cute.local_tile(sh.qkv[None, 1, j], (F32_VEC,), (vec,)), rA)
                    pred = pred + (s * rA.load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                pred = cute.arch.warp_reduction(pred, operator.add, threads_in_group=4)
                delta = (sh.qkv[row, 2, j] - pred) * sh.beta[j]
                o = Float32(0.0)
                for u in cutlass.range_constexpr(ROW_VECS):
                    vec = u * 4 + part
                    cute.autovec_copy(cute.local_tile(sh.qkv[None, 1, j], (F32_VEC,), (vec,)), rA)
                    s = rS[None, u].load() + delta * rA.load()
                    rS[None, u].store(s)
                    cute.autovec_copy(cute.local_tile(sh.qkv[None, 0, j], (F32_VEC,), (vec,)), rA)
                    o = o + (s * rA.load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                o = cute.arch.warp_reduction(o, operator.add, threads_in_group=4).to(BFloat16)
                if part == 0:
                    sh.o[row, j] = o
                # sum of o^2 over the warp's 8 rows (lanes of one row hold the same o)
                of = o.to(Float32)
                sq = of * of
                for step in cutlass.range_constexpr(3):
                    sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=4 << step)
                if lane == 0:
                    sh.sq[warp, j] = sq
                if const_expr(self.verify):  # token j's state into column j's slot
                    target = mIdx[req, j]
                    if target > 0:
                        self.store_state(rS, mState[target, head, row, None], part)
            if const_expr(not self.verify):
                self.store_state(rS, mState[slot, head, row, None], part)
            cute.arch.barrier()

            # 4. sigmoid-gated RMSNorm: 16 threads per token, 8 channels each
            if tidx < OUT_THREADS * Q:
                self.gated_norm(mGOut, mNormW, sh, mOut, req, head, tidx, buf, rGo, rNorm)
        else:
            if tidx < OUT_THREADS * Q:
                rZ = cute.make_rmem_tensor((VEC,), BFloat16)
                rZ.fill(0.0)
                c8 = tidx % OUT_THREADS
                cute.copy(r2g_atom(BFloat16), rZ,
                          cute.local_tile(mOut[req * Q + tidx // OUT_THREADS, None], (VEC,),
                                          (head * OUT_THREADS + c8,)))

    # helpers, inlined into the kernel (dynamic ifs allowed: @cute.jit)
    @cute.jit
    def slots(self, mIdx, mAcc, req):
        """(accepted a, the slot the state is read from, the conv state's slot) of request ``req``:
        a one-slot step's slot for both; a verify step's column a - 1 (column 0 for the conv), its
        state slot 0 (no state) where column 0 is a padding row's."""
        if const_expr(self.verify):
            a = mAcc[req]
            a = cutlass.select_(a < 1, Int32(1), a)
            a = cutlass.select_(a > self.q_len, Int32(self.q_len), a)
            conv_slot = mIdx[req, 0]
            source = mIdx[req, a - 1]
            return a, cutlass.select_(conv_slot > 0, source, Int32(0)), conv_slot
        slot = mIdx[req]
        return Int32(1), slot, slot

    @cute.jit
    def slot_of(self, mIdx, item, items, heads):
        """Persistent: the slot of ``item`` (0 past the last item: nothing to prefetch)."""
        slot = Int32(0)
        if item < items:
            slot = mIdx[item // heads]
        return slot

    @cute.jit
    def beta_of(self, mBeta, item, items, heads, tidx):
        """Persistent: thread 0's beta of ``item`` (one token a request; 0 past the last item),
        read an item ahead: read where the item starts, its round trip held warp 0, and so the
        prologue's barrier, back."""
        b = Float32(0.0)
        if (item < items) & (tidx == 0):
            b = mBeta[item // heads, item % heads].to(Float32)
        return b

    @cute.jit
    def prefetch(self, mQKV, mGOut, mFa, mConvS, mState, sh, req, slot, head, tidx, buf):
        """Persistent: ``cp.async`` into buffer ``buf`` of (request ``req``, ``head``)'s inputs, if
        its ``slot`` (read ahead by the loop) is > 0, as two groups (empty otherwise): the conv threads' conv state and
        x, f_a and g_out (16 threads each); then this thread's 32 state values."""
        if slot > 0:
            if tidx < CONV_THREADS:
                ch0 = self.conv_channel(head, tidx)
                gCS = mConvS[slot, None]
                for u in cutlass.range_constexpr(3):
                    cute.copy(g2s_atom(BFloat16, CONV_BITS),
                              cute.local_tile(gCS, (CONV_CH,), (self.conv_vector(ch0, u),)),
                              sh.conv_s[None, tidx, u, buf])
                cute.copy(g2s_atom(BFloat16, CONV_BITS),
                          cute.local_tile(mQKV[req, None], (CONV_CH,), (ch0 // CONV_CH,)),
                          sh.x[None, tidx, buf])
            if tidx < OUT_THREADS:
                cute.copy(g2s_atom(BFloat16), cute.local_tile(mGOut[req, None], (VEC,), (head * OUT_THREADS + tidx,)),
                          sh.g_out[None, tidx, buf])
            elif tidx < 2 * OUT_THREADS:
                v = tidx - OUT_THREADS
                cute.copy(g2s_atom(BFloat16), cute.local_tile(mFa[req, None], (VEC,), (v,)), sh.fa[None, v, buf])
        cute.arch.cp_async_commit_group()
        if slot > 0:
            gRow = mState[slot, head, tidx // 4, None]
            for j in cutlass.range_constexpr(ROW_VECS):
                cute.copy(g2s_atom(), cute.local_tile(gRow, (F32_VEC,), (j * 4 + tidx % 4,)),
                          sh.state[None, tidx, j, buf])
        cute.arch.cp_async_commit_group()

    def load_fb(self, mFbW, rW, n, part):
        """This thread's quarter of f_b_proj weight row ``n``: 4 streamed 128-bit loads."""
        for u in range(4):
            cute.copy(g2r_stream_atom(BFloat16), cute.local_tile(mFbW[n, None], (VEC,), (u * 4 + part,)), rW[None, u])

    def load_state(self, rS, gRow, part):
        """This thread's 32 state values of one row: 8 streamed 128-bit loads."""
        for u in range(ROW_VECS):
            cute.copy(g2r_stream_atom(Float32), cute.local_tile(gRow, (F32_VEC,), (u * 4 + part,)), rS[None, u])

    def store_state(self, rS, gRow, part):
        """This thread's 32 state values of one row back: 8 128-bit stores."""
        for u in range(ROW_VECS):
            cute.copy(r2g_atom(Float32), rS[None, u], cute.local_tile(gRow, (F32_VEC,), (u * 4 + part,)))

    def conv_channel(self, head, tidx):
        """The first of conv thread ``tidx``'s 4 global channels: segment ``tidx // 32`` (q, k, v),
        channels [4c, 4c + 4) of the head, c = ``tidx % 32``."""
        return tidx // SEG_THREADS * self.proj + head * HEAD_DIM + tidx % SEG_THREADS * CONV_CH

    @cute.jit
    def conv(self, mQKV, sh, rConvW, mConvS, slot, a, req, head, tidx, warp, buf):
        """Thread ``tidx`` < 96: channels [4c, 4c + 4) of segment ``seg`` (q, k, v: one warp each)
        of the head (conv taps loaded before the wait: in shared memory when persistent, else
        ``rConvW``): the causal conv + SiLU of the q tokens, the conv state written back, q and k
        L2-normalized (warps 0 and 1, a 32-lane butterfly each), results to
        ``sh.qkv[:, seg, token]``. The conv state and x come from buffer ``buf`` (``persistent``)
        or global memory. A verify step's window starts at row ``a - 1``."""
        Q, D = self.q_len, HEAD_DIM
        seg = tidx // SEG_THREADS
        c4 = tidx % SEG_THREADS
        ch0 = self.conv_channel(head, tidx)  # first global channel
        # the 4 channels' conv state, 3 x 64 bits: SD, tap u's 4 channels at u * 3P + ch0; DS,
        # 12 contiguous bf16 (channel-major, oldest first); a verify step in DS, 12 scalars
        rCS = cute.make_rmem_tensor((CONV_CH, 3), BFloat16)
        gCS = mConvS[slot, None]
        if const_expr(self.persistent):
            for u in cutlass.range_constexpr(3):
                cute.autovec_copy(sh.conv_s[None, tidx, u, buf], rCS[None, u])
        elif const_expr(self.verify and self.conv_layout == "DS"):
            for c in cutlass.range_constexpr(CONV_CH):
                for u in cutlass.range_constexpr(3):
                    rCS[c, u] = gCS[(ch0 + c) * self.conv_rows + a - 1 + u]
        else:
            first = a - 1 if const_expr(self.verify) else 0  # a one-slot step: a = 1
            for u in cutlass.range_constexpr(3):
                cute.copy(g2r_atom(BFloat16, invariant=False, bits=CONV_BITS),
                          cute.local_tile(gCS, (CONV_CH,), (self.conv_vector(ch0, first + u),)), rCS[None, u])
        rX = cute.make_rmem_tensor((CONV_CH, Q), BFloat16)
        if const_expr(self.persistent):
            cute.autovec_copy(sh.x[None, tidx, buf], rX[None, 0])
        else:
            for j in cutlass.range_constexpr(Q):
                cute.copy(g2r_atom(BFloat16, bits=CONV_BITS),
                          cute.local_tile(mQKV[req * Q + j, None], (CONV_CH,), (ch0 // CONV_CH,)), rX[None, j])
        window = [[self.conv_tap(rCS, c, i) for i in range(3)] for c in range(CONV_CH)]
        scale = Float32(1.0)
        rY = cute.make_rmem_tensor((CONV_CH,), Float32)
        for j in cutlass.range_constexpr(Q):
            for c in cutlass.range_constexpr(CONV_CH):
                x = rX[c, j]
                w = window[c]
                rW = cute.make_rmem_tensor((F32_VEC,), Float32)
                if const_expr(self.persistent):
                    cute.autovec_copy(sh.conv_w[None, tidx, c], rW)
                else:
                    rW.store(rConvW[None, c].load())
                acc = w[0].to(Float32) * rW[0] + w[1].to(Float32) * rW[1]
                acc = acc + w[2].to(Float32) * rW[2] + x.to(Float32) * rW[3]
                silu = acc * (Float32(1.0) / (Float32(1.0) + cute.math.exp(-acc)))
                rY[c] = silu.to(BFloat16).to(Float32)
                window[c] = [w[1], w[2], x]
            if warp < 2:  # q and k: L2 norm over the head's 128 channels (32 lanes x 4)
                y = rY.load()
                sq = cute.arch.warp_reduction((y * y).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), operator.add,
                                              threads_in_group=SEG_THREADS)
                qk_scale = Float32(cutlass.select_(seg == 0, Float32(D ** -0.5), Float32(1.0)))
                scale = cute.math.rsqrt(sq + Float32(QK_EPS)) * qk_scale
            rY.store(rY.load() * scale)
            cute.copy(r2s_atom(Float32), rY, cute.local_tile(sh.qkv[None, seg, j], (CONV_CH,), (c4,)))
        if const_expr(self.verify):
            self.write_verify_conv(gCS, rCS, rX, ch0)
        else:
            rOut = cute.make_rmem_tensor((CONV_CH, 3), BFloat16)
            for c in cutlass.range_constexpr(CONV_CH):
                for i in cutlass.range_constexpr(3):
                    self.set_conv_tap(rOut, c, i, window[c][i])
            for u in cutlass.range_constexpr(3):
                cute.copy(r2g_atom(BFloat16, CONV_BITS), rOut[None, u],
                          cute.local_tile(gCS, (CONV_CH,), (self.conv_vector(ch0, u),)))

    def write_verify_conv(self, gCS, rCS, rX, ch0):
        """A verify step's conv rows: 0, 1 the old rows a, a + 1 (the window's newer two taps),
        2 .. q + 1 this step's inputs; SD by 64-bit rows of the thread's 4 channels, DS by scalars."""
        Q = self.q_len
        if self.conv_layout == "SD":
            for u in range(2):
                cute.copy(r2g_atom(BFloat16, CONV_BITS), rCS[None, u + 1],
                          cute.local_tile(gCS, (CONV_CH,), (self.conv_vector(ch0, u),)))
            for j in range(Q):
                cute.copy(r2g_atom(BFloat16, CONV_BITS), rX[None, j],
                          cute.local_tile(gCS, (CONV_CH,), (self.conv_vector(ch0, 2 + j),)))
        else:
            for c in range(CONV_CH):
                base = (ch0 + c) * self.conv_rows
                gCS[base] = rCS[c, 1]
                gCS[base + 1] = rCS[c, 2]
                for j in range(Q):
                    gCS[base + 2 + j] = rX[c, j]

    def conv_vector(self, ch0, u):
        """Which 4-value vector of a slot's conv state is row (tap) ``u`` of channels [ch0, ch0 + 4)
        (SD; DS one-slot steps: the ``u``-th of their 12 contiguous values)."""
        if const_expr(self.conv_layout == "SD"):
            return u * (3 * self.proj // CONV_CH) + ch0 // CONV_CH
        return ch0 // CONV_CH * 3 + u

    def conv_tap(self, r, c, i):
        """Tap ``i`` (oldest first) of channel ``c`` in the 3 loaded vectors ``r``."""
        if const_expr(self.tap_major):
            return r[c, i]
        return r[(3 * c + i) % CONV_CH, (3 * c + i) // CONV_CH]

    def set_conv_tap(self, r, c, i, value):
        if const_expr(self.tap_major):
            r[c, i] = value
        else:
            r[(3 * c + i) % CONV_CH, (3 * c + i) // CONV_CH] = value

    @cute.jit
    def gate(self, mFa, sh, rFb, decay_a, dt, req, n, row, part, buf, rFa):
        """g1 = f_a @ f_b_weight^T for channel ``row`` of the head (global channel ``n``; 4
        threads per row, 4 vectors each of the row in shared memory when persistent, else in
        ``rFb``; f_a from buffer ``buf``
        (``persistent``), ``rFa`` (read ahead) or global memory), rounded to bf16 as the
        reference's linear is, then
        exp(decay) into ``sh.g`` (the row's 4 threads store the same value); ``decay_a`` is
        e^A_log of the head and ``dt`` the row's dt_bias, both read before the wait."""
        Q = self.q_len
        tidx = row * 4 + part
        rX = cute.make_rmem_tensor((VEC,), BFloat16)
        rW = cute.make_rmem_tensor((VEC,), BFloat16)
        for j in cutlass.range_constexpr(Q):
            acc = Float32(0.0)
            for u in cutlass.range_constexpr(4):
                if const_expr(self.persistent):
                    cute.autovec_copy(sh.fa[None, u * 4 + part, buf], rX)
                elif const_expr(rFa is not None):
                    rX.store(rFa[None, u].load())
                else:
                    cute.copy(g2r_atom(BFloat16), cute.local_tile(mFa[req * Q + j, None], (VEC,), (u * 4 + part,)),
                              rX)
                if const_expr(self.persistent):
                    cute.autovec_copy(sh.fb[None, tidx, u], rW)
                else:
                    rW.store(rFb[None, u].load())
                acc = acc + (rW.load().to(Float32) * rX.load().to(Float32)).reduce(
                    cute.ReductionOp.ADD, Float32(0.0), 0)
            g1 = cute.arch.warp_reduction(acc, operator.add, threads_in_group=4)
            x = g1.to(BFloat16).to(Float32) + dt
            if const_expr(self.lower_bound is not None):
                decay = Float32(self.lower_bound) / (Float32(1.0) + cute.math.exp(-(decay_a * x)))
            else:  # softplus with torch's threshold 20
                soft = Float32(cutlass.select_(x > Float32(20.0), x, cute.math.log1p(cute.math.exp(x))))
                decay = -decay_a * soft
            sh.g[row, j] = cute.math.exp(decay)

    @cute.jit
    def gated_norm(self, mGOut, mNormW, sh, mOut, req, head, tidx, buf, rGo, rNorm):
        """Thread ``tidx`` < 16 q: token ``tidx // 16``, channels [8c, 8c + 8):
        o * rsqrt(mean(o^2) + eps) * norm_weight * sigmoid(g_out), one 128-bit store (g_out and
        the norm weight from ``rGo`` and ``rNorm`` where they were read ahead)."""
        D = HEAD_DIM
        j = tidx // OUT_THREADS
        c8 = tidx % OUT_THREADS
        t = req * self.q_len + j
        rG = cute.make_rmem_tensor((VEC,), BFloat16)
        rN = cute.make_rmem_tensor((VEC,), BFloat16)
        if const_expr(self.persistent):
            cute.autovec_copy(sh.g_out[None, c8, buf], rG)
            cute.autovec_copy(sh.norm_w[None, c8], rN)
        elif const_expr(rGo is not None):
            rG.store(rGo.load())
            rN.store(rNorm.load())
        else:
            cute.copy(g2r_atom(BFloat16), cute.local_tile(mGOut[t, None], (VEC,), (head * OUT_THREADS + c8,)), rG)
            cute.copy(g2r_atom(BFloat16), cute.local_tile(mNormW, (VEC,), (c8,)), rN)
        total = Float32(0.0)
        for w in cutlass.range_constexpr(THREADS // 32):
            total = total + sh.sq[w, j]
        r = cute.math.rsqrt(total * Float32(1.0 / D) + Float32(self.eps))
        rO = cute.make_rmem_tensor((VEC,), BFloat16)
        cute.autovec_copy(cute.local_tile(sh.o[None, j], (VEC,), (c8,)), rO)
        g = rG.load().to(Float32)
        gate = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
        y = rO.load().to(Float32) * r * rN.load().to(Float32) * gate
        rY = cute.make_rmem_tensor((VEC,), BFloat16)
        rY.store(y.to(BFloat16))
        cute.copy(r2g_atom(BFloat16), rY, cute.local_tile(mOut[t, None], (VEC,), (head * OUT_THREADS + c8,)))


def build(spec) -> tuple[KdaCore, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    h, q = s["heads"], s["q_len"]
    verify = bool(p.get("verify", False))
    rows = s.get("conv_rows", CONV_WIDTH - 1)
    kernel = KdaCore(h, q, p["lower_bound"], p["eps"], p["conv_layout"], verify=verify, conv_rows=rows,
                     persistent=bool(p.get("persistent", False)))
    d, pr = HEAD_DIM, h * HEAD_DIM
    tokens, requests, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()  # runtime sizes
    conv_page, state_page = cute.sym_int64(divisibility=VEC), cute.sym_int64(divisibility=F32_VEC)  # slot strides

    def t(dtype, shape, stride, align=16):
        return make_fake_tensor(dtype, shape, stride, assumed_align=align)

    args = (t(BFloat16, (tokens, 3 * pr), (3 * pr, 1)),  # mixed_qkv
            t(BFloat16, (tokens, pr), (pr, 1)),  # g_out
            t(BFloat16, (tokens, d), (d, 1)),  # f_a
            t(BFloat16, (tokens, h), (h, 1), 2),  # beta
            t(BFloat16, (pr, d), (d, 1)),  # f_b_weight
            t(Float32, (3 * pr, CONV_WIDTH), (CONV_WIDTH, 1)),  # conv_weight [3P, 1, 4] viewed [3P, 4]
            t(Float32, (h,), (1,), 4),  # A_log
            t(Float32, (pr,), (1,), 4),  # dt_bias
            t(BFloat16, (d,), (1,)),  # norm_weight
            t(BFloat16, (slots, 3 * pr * rows), (conv_page, 1)),  # conv_state, a slot's page flat
            t(Float32, (slots, h, d, d), (state_page, d * d, d, 1)),  # recurrent_state
            # state_indices: [B] or a verify's [B, q] (a slice of vLLM's block table: any row stride)
            t(Int32, (requests, q), (cute.sym_int32(), 1), 4) if verify else t(Int32, (requests,), (1,), 4),
            t(Int32, (requests,), (1,), 4),  # num_accepted (a verify; else state_indices again)
            t(BFloat16, (tokens, pr), (pr, 1)),  # out
            Int32(1),  # ctas: a runtime value
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
