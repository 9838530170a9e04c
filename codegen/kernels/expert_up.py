"""``expert_up``: stage 1 of the MoE experts, the gate/up projection and its activation.

The math is ``rewriter/model/layers/moe.py:experts_up`` (``shared_experts_up`` with one expert):

    g, u        = bf16(<x[t], w13[e, i]>), bf16(<x[t], w13[e, I + i]>)   (fp32 sums)
    a[t, j, i]  = bf16(act(g, u))                                        (fp32)
    act(g, u)   = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)   (SiTU)
                  or g sigmoid(g) * u                                                 (SiLU-and-mul)

with ``e = ids[t, j]`` for the routed experts (``w13`` [E, 2I, L], ``a`` [T, k, I]) and
``e = 0, j = 0`` for the shared experts (``gate_up_weight`` seen as [1, 2I, L], ``a``
[T, 1, I]).

Work split (decode is bound by reading the selected experts' rows once from HBM):
- a channel i is the gate row i and the up row I + i of one expert; ``k_slices`` warps of
  a CTA share ``channels_per_warp`` channels, each warp taking a contiguous slice of L of
  at most 7 128-bit vectors per lane and row; a lane issues its whole slice at once
  (``ld.global.L1::no_allocate``: read once) and keeps it in registers; x is read with
  ``ld.global.nc`` (it stays in L1, shared by the warps of the SM);
- routed: one CTA per (token t, slot j) pair and block of channels (2 channels x 2 slices
  at L = 3584; the grid's x is the pair, so the pairs of all tokens that picked the same
  expert run side by side and the rows one of them pulled from HBM are re-read from L2 by
  the others); every loaded weight feeds one token's FMAs, so the kernel stays memory
  bound at any token count; the token count is a runtime size;
- shared: one CTA per channel, H split over 4 warps (H = 7168): at batch 1 every CTA has
  its whole 28 KB in flight at once; the tokens are taken in chunks of up to 8 (``chunk``
  fp32 accumulators per row) against the slice held in registers, so the rows are read
  from HBM once at any token count; the token count is a compile-time constant;
- the 2 x channels x tokens sums go through a 5-step ``shfl.sync.bfly`` butterfly; lane c
  holds token c's sums; with one slice it computes the activation in fp32 and stores it
  (``st.global.b16``), with several the slices' sums meet in shared memory (one barrier)
  and one thread per (channel, token) finishes.

Programmatic dependent launch (launched with ``use_pdl``): before ``griddepcontrol.wait``
a CTA reads only weights, which no kernel writes, and writes nothing. The shared experts
issue their whole slice before the wait, so its DRAM latency overlaps the previous
kernel's tail. The routed experts' rows depend on the ids (the router's output): they wait
first, read the id, issue their slice and only then call
``griddepcontrol.launch_dependents``. ptxas moves no load across either instruction
(otherwise it sinks each load to its first use, leaving a lane 2 or 3 loads in flight),
so a lane's 14 loads are all in flight at once.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, g2r_stream_atom, gated_act

MAX_CHUNK = 8  # tokens per chunk (fp32 accumulators per row and lane)


class ExpertUp:
    """Compile-time configuration: experts E, slots k (routed) or tokens T (shared), L, I,
    the activation (``beta`` None: SiLU-and-mul), and the tiling (channels per warp, warps
    per CTA, warps sharing a channel along L, tokens per chunk). A lane's slice of L is
    ``L / 256 / k_slices`` vectors per row, all loaded at once."""

    def __init__(self, *, routed: bool, experts: int, top_k: int, latent: int, inter: int, beta: float | None,
                 linear_beta: float | None, tokens: int | None = None, channels_per_warp: int = 1,
                 warps_per_cta: int = 4, k_slices: int = 1, chunk: int = 1):
        self.routed = bool(routed)
        if self.routed == (tokens is not None):
            raise ValueError("the token count is a runtime size for routed experts, compile-time for shared ones")
        if not self.routed and (experts != 1 or top_k != 1):
            raise ValueError("shared experts: one expert, one slot")
        if warps_per_cta % k_slices:
            raise ValueError(f"{warps_per_cta} warps per CTA do not split into slices of {k_slices}")
        vec_per_lane = latent // VEC // 32
        if latent % (VEC * 32) or vec_per_lane % k_slices:
            raise ValueError(f"L {latent}: {VEC * 32}-element steps do not split into {k_slices} slices")
        self.channel_warps = warps_per_cta // k_slices  # warps with different channels
        channels_per_cta = channels_per_warp * self.channel_warps
        if inter % channels_per_cta:
            raise ValueError(f"I {inter} is not a multiple of {channels_per_cta} channels per CTA")
        if not 1 <= chunk <= MAX_CHUNK or (self.routed and chunk != 1):
            raise ValueError(f"chunk {chunk}: 1 for routed experts, 1..{MAX_CHUNK} for shared ones")
        self.experts, self.top_k, self.inter = experts, top_k, inter
        self.beta = None if beta is None else float(beta)
        self.linear_beta = None if linear_beta is None or beta is None else float(linear_beta)
        self.channels_per_warp, self.warps_per_cta, self.k_slices = channels_per_warp, warps_per_cta, k_slices
        self.slice_vec = vec_per_lane // k_slices
        self.chunk = chunk
        self.channels_per_cta = channels_per_cta
        self.channel_blocks = inter // channels_per_cta
        self.cta_tokens = 1 if self.routed else tokens  # tokens a CTA computes
        if tokens is not None:
            self.full_chunks, self.tail = divmod(tokens, chunk)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor | None, mW: cute.Tensor, mA: cute.Tensor,
                 stream: cuda.CUstream):
        groups = mIds.shape[0] * self.top_k if const_expr(self.routed) else 1
        self.kernel(mX, mIds, mW, mA).launch(grid=[groups, self.channel_blocks, 1],
                                             block=[32 * self.warps_per_cta, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor | None, mW: cute.Tensor, mA: cute.Tensor):
        pair, cblock, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        cwarp = warp // self.k_slices
        kslice = warp % self.k_slices
        first = (cblock * self.channel_warps + cwarp) * self.channels_per_warp
        rW = cute.make_rmem_tensor((VEC, self.slice_vec, 2 * self.channels_per_warp), BFloat16)
        sPart = None
        if const_expr(self.k_slices > 1):
            smem = cutlass.memory.SmemAllocator()
            sPart = smem.allocate_tensor(
                Float32, cute.make_layout((2, self.channels_per_cta, self.cta_tokens, self.k_slices)),
                byte_alignment=16)
        if const_expr(self.routed):
            cute.arch.griddepcontrol_wait()
            token = pair // self.top_k
            slot = pair - token * self.top_k
            # the router's ids; one out of range would read past w13: clamp it
            e = cutlass.max(cutlass.min(Int32(mIds[token, slot]), Int32(self.experts - 1)), Int32(0))
            self.load_w(mW, rW, Int64(e), first, kslice, lane)  # 64-bit: E x 2I x L passes 2^31 at TP 8
            # after the loads: ptxas moves no load across it, so they are all in flight at once
            cute.arch.griddepcontrol_launch_dependents()
            self.chunk_of(mX, mA, rW, sPart, token, slot, 0, first, cwarp, kslice, lane, 1)
            if const_expr(self.k_slices > 1):
                cute.arch.barrier()
                self.combine(mA, sPart, token, slot, cblock)
        else:
            # the whole slice, before the wait: weights are written by no kernel
            self.load_w(mW, rW, Int64(0), first, kslice, lane)
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            for c in cutlass.range(self.full_chunks, unroll=1):
                t0 = c * self.chunk
                self.chunk_of(mX, mA, rW, sPart, t0, 0, t0, first, cwarp, kslice, lane, self.chunk)
            if const_expr(self.tail > 0):
                t0 = self.full_chunks * self.chunk
                self.chunk_of(mX, mA, rW, sPart, t0, 0, t0, first, cwarp, kslice, lane, self.tail)
            if const_expr(self.k_slices > 1):
                cute.arch.barrier()
                self.combine(mA, sPart, 0, 0, cblock)

    # trace-time helpers (plain Python, inlined into the kernel; no dynamic control flow inside)
    def vec(self, kslice, u, lane):
        """The 128-bit vector of L that ``lane`` reads at position ``u`` of its slice."""
        return (kslice * self.slice_vec + u) * 32 + lane

    def load_w(self, mW: cute.Tensor, rW: cute.Tensor, e, first, kslice, lane):
        """Issue the lane's whole slice: gate and up rows of this warp's channels."""
        ld_w = g2r_stream_atom(BFloat16)
        R = self.channels_per_warp
        for u in range(self.slice_vec):
            v = self.vec(kslice, u, lane)
            for r in range(R):
                for h in range(2):  # gate row i, up row I + i
                    row = h * self.inter + first + r
                    cute.copy(ld_w, cute.local_tile(mW[e, row, None], (VEC,), (v,)), rW[None, u, h * R + r])

    def accumulate(self, mX: cute.Tensor, rW: cute.Tensor, rAcc: cute.Tensor, t0, kslice, lane, n: int):
        """rAcc[q, c] += <row q's slice, x[t0 + c]'s> for this lane (fp32)."""
        ld_x = g2r_atom(BFloat16)
        rX = cute.make_rmem_tensor((VEC,), BFloat16)
        for u in range(self.slice_vec):
            v = self.vec(kslice, u, lane)
            for c in range(n):
                cute.copy(ld_x, cute.local_tile(mX[t0 + c, None], (VEC,), (v,)), rX)
                x = rX.load().to(Float32)
                for q in range(2 * self.channels_per_warp):
                    w = rW[None, u, q].load().to(Float32)
                    rAcc[q, c] = rAcc[q, c] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

    @cute.jit
    def chunk_of(self, mX: cute.Tensor, mA: cute.Tensor, rW: cute.Tensor, sPart: cute.Tensor | None, t0: Int32,
                 slot: Int32, s0: Int32, first: Int32, cwarp: Int32, kslice: Int32, lane: Int32,
                 n: cutlass.Constexpr[int]):
        """Tokens t0 .. t0 + n - 1 (slot ``slot``) against the slice held in ``rW``: the
        2 x channels x n sums over the warp (lane c keeps token c's), then token c's
        activation stored (one slice) or its slice's sums staged at smem token s0 + c."""
        R = self.channels_per_warp
        rAcc = cute.make_rmem_tensor((2 * R, n), Float32)
        rAcc.fill(0.0)
        self.accumulate(mX, rW, rAcc, t0, kslice, lane, n)
        for r in cutlass.range_constexpr(R):
            gate = Float32(0.0)
            up = Float32(0.0)
            for c in cutlass.range_constexpr(n):
                gate_c = cute.arch.warp_reduction(rAcc[r, c], operator.add)
                up_c = cute.arch.warp_reduction(rAcc[R + r, c], operator.add)
                gate = Float32(cutlass.select_(lane == c, gate_c, gate))
                up = Float32(cutlass.select_(lane == c, up_c, up))
            if lane < n:
                if const_expr(self.k_slices == 1):
                    a = gated_act(gate, up, self.beta, self.linear_beta)
                    mA[t0 + lane, slot, first + r] = a.to(BFloat16)
                else:
                    sPart[0, cwarp * R + r, s0 + lane, kslice] = gate
                    sPart[1, cwarp * R + r, s0 + lane, kslice] = up

    @cute.jit
    def combine(self, mA: cute.Tensor, sPart: cute.Tensor, t0: Int32, slot: Int32, cblock: Int32):
        """Several slices: one thread per (channel, token) adds the slices' sums and stores
        the activation of token t0 + its smem token."""
        tidx, _, _ = cute.arch.thread_idx()
        threads = 32 * self.warps_per_cta
        T = self.cta_tokens
        items = self.channels_per_cta * T
        for j in cutlass.range_constexpr(-(-items // threads)):
            i = tidx + j * threads
            if i < items:
                ch = i // T
                t = i - ch * T
                gate = sPart[0, ch, t, 0]
                up = sPart[1, ch, t, 0]
                for w in cutlass.range_constexpr(1, self.k_slices):
                    gate = gate + sPart[0, ch, t, w]
                    up = up + sPart[1, ch, t, w]
                a = gated_act(gate, up, self.beta, self.linear_beta)
                mA[t0 + t, slot, cblock * self.channels_per_cta + ch] = a.to(BFloat16)


def build(spec) -> tuple[ExpertUp, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec``."""
    s, p = spec.shape_dict, spec.param_dict
    e, k, lat, inter = s["experts"], s["top_k"], s["latent"], s["inter"]
    routed = p["routed"]
    kernel = ExpertUp(routed=routed, experts=e, top_k=k, latent=lat, inter=inter, beta=p["beta"],
                      linear_beta=p["linear_beta"], tokens=None if routed else s["tokens"],
                      channels_per_warp=p["channels_per_warp"], warps_per_cta=p["warps_per_cta"],
                      k_slices=p["k_slices"], chunk=p["chunk"])
    # routed: the token count is a runtime size (one compile serves every batch)
    t = cute.sym_int32() if routed else s["tokens"]
    ids = make_fake_tensor(Int64, (t, k), (k, 1), assumed_align=8) if routed else None
    args = (make_fake_tensor(BFloat16, (t, lat), (lat, 1), assumed_align=16), ids,
            make_fake_tensor(BFloat16, (e, 2 * inter, lat), (2 * inter * lat, lat, 1), assumed_align=16),
            make_fake_tensor(BFloat16, (t, k, inter), (k * inter, inter, 1), assumed_align=2),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return kernel, args
