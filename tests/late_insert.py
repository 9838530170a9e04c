"""A stand-in predecessor for PDL tests (CuTe DSL, compiled in the test): it lets its dependents
launch at once (``griddepcontrol.launch_dependents`` first), spins, and only then writes rows
(``dst[idx[r]] = src[r]``, bytes). A dependent that read those rows before its
``griddepcontrol.wait`` reads the bytes that were there before."""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Int32, Int64, Uint8, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

THREADS = 128


class LateInsert:
    def __init__(self, rows: int, width: int, spin_ns: int):
        self.rows, self.width, self.spin_ns = rows, width, spin_ns

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mDst: cute.Tensor, mIdx: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mSrc, mDst, mIdx).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mDst: cute.Tensor, mIdx: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cute.arch.griddepcontrol_launch_dependents()
        t0 = cute.arch.globaltimer()
        now = cute.arch.globaltimer()
        while now - t0 < Int64(self.spin_ns):
            now = cute.arch.globaltimer()
        for r in cutlass.range_constexpr(self.rows):
            for c in cutlass.range(tidx, self.width, THREADS):
                mDst[mIdx[r], c] = mSrc[r, c]


def late_insert_kernel(rows: int, width: int, spin_ns: int):
    """The compiled kernel, called as ``fn(src, dst, idx)`` with torch tensors on the current stream."""
    n = cute.sym_int32()
    args = (make_fake_tensor(Uint8, (rows, width), (width, 1)), make_fake_tensor(Uint8, (n, width), (width, 1)),
            make_fake_tensor(Int32, (rows,), (1,), assumed_align=4), make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(LateInsert(rows, width, spin_ns), *args, options="--enable-tvm-ffi")
