"""Pieces the kernel templates share: 128-bit vector copy atoms, the gated activation, the
deadline of a wait on other CTAs, partial sums pushed across a cluster."""
from __future__ import annotations

from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from codegen.targets import BITS, VEC  # noqa: F401  (the kernels take them from here)


def g2r_atom(dtype, *, invariant: bool = True, bits: int = BITS):
    """Global -> registers, 128 bits (or ``bits``). ``invariant`` (read-only for the kernel's
    lifetime) makes it ``ld.global.nc.v4``: the read-only path, cached in L1."""
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits, invariant=invariant)


def g2r_stream_atom(dtype, bits: int = BITS):
    """Global -> registers, 128 bits (or ``bits``), for data read once (weights streamed by a
    GEMV): ``ld.global.L1::no_allocate.L2::256B.v4``: no L1 line is allocated, so the activations
    cached in L1 stay there, and L2 fetches 256 bytes ahead."""
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits,
                               l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE,
                               l2_prefetch_size=cute.nvgpu.L2PrefetchSize.SIZE_256B)


def r2g_atom(dtype, bits: int = BITS):
    """Registers -> global, 128 bits (``st.global.v4``; or ``bits``)."""
    return cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), dtype, num_bits_per_copy=bits)


def r2s_atom(dtype):
    """Registers -> shared memory, 128 bits (``st.shared.v4``)."""
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=BITS)


def gated_act(g_sum, u_sum, beta: float | None, linear_beta: float | None):
    """The gated MLP activation of one channel in fp32 from its bf16-rounded projections (the
    reference rounds the gate/up projection to bf16 first): SiTU
    ``beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)`` (the last factor
    plain ``u`` without ``linear_beta``), or SiLU-and-mul ``g sigmoid(g) u`` without ``beta``."""
    g = g_sum.to(BFloat16).to(Float32)
    u = u_sum.to(BFloat16).to(Float32)
    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
    if const_expr(beta is None):
        return g * sig * u
    gate = Float32(beta) * cute.math.tanh(g / Float32(beta)) * sig
    if const_expr(linear_beta is not None):
        u = Float32(linear_beta) * cute.math.tanh(u / Float32(linear_beta))
    return gate * u


# ---- a wait on other CTAs fails instead of hanging ---------------------------------------------------
# A kernel that spins until other CTAs arrive (a grid barrier's word) hangs the step for good if
# they never do: a protocol bug, or a grid that is not all resident. Past ``WAIT_DEADLINE_NS`` on
# the global nanosecond timer the waiting thread executes ``trap``: the launch fails with a CUDA
# error that the step's stream reports (vLLM raises it) instead of a server that never answers.
# vLLM's hand-written AMD decode gives up on its in-kernel waits after the same 10 s. A correct
# wait lasts microseconds (milliseconds under compute-sanitizer), so the deadline only ever
# fires on a wait that would not end.
WAIT_DEADLINE_NS = 10_000_000_000


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """PTX ``trap``: the kernel stops with an error."""
    llvm.intr_trap(loc=loc, ip=ip)


def wait_started() -> Int64:
    """The global timer where a wait starts (``%globaltimer``, ns)."""
    return cute.arch.globaltimer()


@cute.jit
def trap_past_deadline(started: Int64):
    """``trap`` once the wait begun at ``started`` has lasted ``WAIT_DEADLINE_NS``."""
    if cute.arch.globaltimer() - started > Int64(WAIT_DEADLINE_NS):
        trap()


@dsl_user_op
def float_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of an fp32 value as an int32 (what ``st.async`` stores)."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


# ---- a cluster's partial sums pushed to the CTA that finishes them ---------------------------------
# ``st.async`` into the owner's shared memory, its completion counted in bytes on the owner's
# mbarrier. Against pulling them through distributed shared memory after a cluster barrier,
# nothing waits for the slowest peer but the owner's own sums, no arrive waits for this CTA's
# stores (a released cluster arrive is a ``MEMBAR.GPU`` in the SASS), and no CTA reads a peer's
# shared memory, so none waits for its peers before it exits. Each CTA receives
# ``[cluster, *entry]`` fp32 values, an ``entry`` block from every CTA of the cluster (itself
# included), and sums them in rank order: deterministic. In a kernel: ``push_buffers``, then
# ``push_init`` and ``cluster_arrive_relaxed`` (all threads), ``push_ready`` (all threads) before
# the first ``push_send``, and ``push_received`` before ``push_total``. (Free functions of the two
# tensors: a dynamic branch of a kernel takes tensors and numbers, not objects.)
def push_buffers(allocator, cluster: int, entry: tuple):
    """(the received values [cluster, *entry] fp32, the mbarrier) in shared memory."""
    return (allocator.allocate_tensor(Float32, cute.make_layout((cluster, *entry)), byte_alignment=16),
            allocator.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8))


@cute.jit
def push_init(recv: cute.Tensor, mbar: cute.Tensor, tidx):
    """The mbarrier made and told to expect all of ``recv``'s bytes (thread 0). The kernel's
    threads then arrive on the cluster barrier (relaxed: the fence orders the init) that
    ``push_ready`` waits for, so that no peer pushes before every mbarrier exists."""
    if tidx == 0:
        cute.arch.mbarrier_init(mbar.iterator, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator, 4 * cute.size(recv))


def push_ready():
    """Every CTA of the cluster has made its mbarriers (before the first ``push_send``)."""
    cute.arch.cluster_wait()


def push_send(recv: cute.Tensor, mbar: cute.Tensor, value, coord: tuple, dst_rank):
    """``value`` into CTA ``dst_rank``'s ``recv`` at ``coord`` (a place only this thread fills)."""
    offset = cute.crd2idx(coord, recv.layout)
    cute.arch.store_async_dsmem(recv.iterator + offset, float_bits(value), mbar.iterator, dst_rank)


@cute.jit
def push_received(mbar: cute.Tensor):
    """Every CTA's block has landed here (the mbarrier's first phase). A wrong byte count would
    never complete the phase: past ``WAIT_DEADLINE_NS`` the wait traps."""
    started = wait_started()
    landed = cute.arch.mbarrier_try_wait(mbar.iterator, 0)
    while not landed:
        trap_past_deadline(started)
        landed = cute.arch.mbarrier_try_wait(mbar.iterator, 0)


def push_total(recv: cute.Tensor, index: tuple) -> Float32:
    """The sum over the cluster of the values at ``index``, in rank order."""
    t = Float32(0.0)
    for peer in range(cute.size(recv, mode=[0])):
        t = t + recv[(peer, *index)]
    return t
