"""``rowwise``: a generated kernel: the ``codegen.lowered.Program`` of a fused op, one CTA a token.

The kernel is the same for every program; what it computes is the program, which is a
compile-time constant (a spec parameter), emitted op by op while CuTe DSL traces the kernel
(``codegen/kernels/emit.py``).

Work split: a token's row of N values is cut into 128-bit vectors of 8 values (bf16; fp32
inputs take two loads a vector), and thread i of the token's CTA owns the vectors i, i +
threads, ... (``vectors`` a thread). A row value lives in the owning threads' registers as fp32
scalars; a column value (a norm's weight) likewise, read from the same columns; a per-token
statistic is one fp32 value every thread holds (reductions: ``emit``). A vector past the row's
end (the last thread's, where the threads do not divide the row) is read at the last vector;
it is not stored.

Programmatic dependent launch: the kernel launches with PDL; every read comes after
``griddepcontrol.wait`` and ``launch_dependents`` follows it at once.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream

from codegen.kernels.common import VEC, g2r_atom, r2g_atom
from codegen.kernels.emit import CUTE_DTYPES, RowSplit, fake_input, run
from codegen.launchers.generated import MAX_INPUTS, MAX_OUTPUTS, threads_for
from codegen.lowered import Program


class RowKernel:
    """Compile-time configuration: the program and the 128-bit vectors each thread owns."""

    def __init__(self, program: Program, vectors: int):
        if program.width % VEC:
            raise ValueError(f"a row of {program.width} values is not whole 128-bit vectors of {VEC}")
        if len(program.inputs) > MAX_INPUTS or len(program.outputs) > MAX_OUTPUTS:
            raise ValueError(f"{len(program.inputs)} inputs and {len(program.outputs)} outputs: at most "
                             f"{MAX_INPUTS} and {MAX_OUTPUTS}")
        self.program = program
        self.kinds = program.kinds
        self.split = RowSplit(program.width // VEC, threads_for(program.width, vectors))
        self.num_vec, self.threads, self.vectors = self.split.num_vec, self.split.threads, self.split.vectors
        if self.vectors != vectors:
            raise ValueError(f"{vectors} vectors a thread: a row of {self.num_vec} vectors takes {self.vectors} "
                             f"over {self.threads} threads")
        self.even = self.split.even

    @cute.jit
    def __call__(self, i0: cute.Tensor, i1: cute.Tensor | None, i2: cute.Tensor | None, i3: cute.Tensor | None,
                 i4: cute.Tensor | None, i5: cute.Tensor | None, i6: cute.Tensor | None, i7: cute.Tensor | None,
                 o0: cute.Tensor, o1: cute.Tensor | None, o2: cute.Tensor | None, o3: cute.Tensor | None,
                 stream: cuda.CUstream):
        self.kernel(i0, i1, i2, i3, i4, i5, i6, i7, o0, o1, o2, o3).launch(
            grid=[o0.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, i0: cute.Tensor, i1: cute.Tensor | None, i2: cute.Tensor | None, i3: cute.Tensor | None,
               i4: cute.Tensor | None, i5: cute.Tensor | None, i6: cute.Tensor | None, i7: cute.Tensor | None,
               o0: cute.Tensor, o1: cute.Tensor | None, o2: cute.Tensor | None, o3: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sRed = None
        if const_expr(self.program.reductions > 0):
            sRed = smem.allocate_tensor(Float32, cute.make_layout((self.program.reductions, self.split.warps)),
                                        byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        ins = (i0, i1, i2, i3, i4, i5, i6, i7)[:len(self.program.inputs)]
        vals = [load_row_value(self.split, t, kind, dtype, tidx, token)
                for t, (kind, dtype) in zip(ins, self.program.inputs)]
        vals = run(self.program, vals, self.split, tidx, sRed)
        outs = (o0, o1, o2, o3)[:len(self.program.outputs)]
        for out, (value, dtype, _) in zip(outs, self.program.outputs):
            if const_expr(self.kinds[value] == "row"):
                for j in cutlass.range_constexpr(self.vectors):
                    v = tidx + j * self.threads
                    rOut = cute.make_rmem_tensor((VEC,), CUTE_DTYPES[dtype])
                    if const_expr(dtype == "fp8_e4m3"):  # converted in pairs (cvt.rn.satfinite.e4m3x2)
                        rF = cute.make_rmem_tensor((VEC,), Float32)
                        for e in cutlass.range_constexpr(VEC):
                            rF[e] = vals[value][j * VEC + e]
                        rOut.store(rF.load().to(CUTE_DTYPES[dtype]))
                    else:
                        for e in cutlass.range_constexpr(VEC):
                            rOut[e] = vals[value][j * VEC + e].to(CUTE_DTYPES[dtype])
                    if const_expr(self.even) or v < self.num_vec:
                        store_vector(rOut, out[token, None], v, dtype)
            else:  # a statistic: one value a token
                if tidx == 0:
                    out[token, 0] = vals[value].to(CUTE_DTYPES[dtype])



def load_row_value(split: RowSplit, t, kind, dtype, tidx, token):
    """A thread's values of input ``t`` for ``token`` (trace time): a row's or a column's columns
    (the vectors ``split`` gives the thread) as fp32 scalars, or a statistic's one value."""
    if const_expr(kind == "stat"):
        return t[token, 0].to(Float32)
    row = t[token, None] if const_expr(kind == "row") else t
    out = []
    for j in range(split.vectors):
        r = cute.make_rmem_tensor((VEC,), CUTE_DTYPES[dtype])
        v = split.vector(j, tidx)
        if const_expr(dtype == "fp32"):  # two 128-bit loads of 4
            for h in range(2):
                cute.copy(g2r_atom(Float32, invariant=False), cute.local_tile(row, (VEC // 2,), (2 * v + h,)),
                          cute.local_tile(r, (VEC // 2,), (h,)))
        else:  # one load of 8 values: 128 bits (64 for fp8)
            cute.copy(g2r_atom(CUTE_DTYPES[dtype], invariant=False, bits=VEC * CUTE_DTYPES[dtype].width),
                      cute.local_tile(row, (VEC,), (v,)), r)
        out += [r[e].to(Float32) for e in range(VEC)]
    return out


def store_vector(r, row, v, dtype):
    """Registers ``r`` (one vector) to vector ``v`` of ``row`` (trace time)."""
    if const_expr(dtype == "fp32"):
        for h in range(2):
            cute.copy(r2g_atom(Float32), cute.local_tile(r, (VEC // 2,), (h,)),
                      cute.local_tile(row, (VEC // 2,), (2 * v + h,)))
    else:
        cute.copy(r2g_atom(CUTE_DTYPES[dtype], bits=VEC * CUTE_DTYPES[dtype].width), r,
                  cute.local_tile(row, (VEC,), (v,)))


def build(spec) -> tuple[RowKernel, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size: one compile serves every batch)."""
    p = spec.param_dict
    program = Program.from_params(p["program"])
    kernel = RowKernel(program, p["vectors"])
    tokens, n = cute.sym_int32(), program.width
    strides = p.get("strides") or (n,) * len(program.inputs)  # an input row may be a view of a wider one

    kinds = program.kinds
    ins = [fake_input(kind, dtype, tokens, n, stride, vectors=True)
           for (kind, dtype), stride in zip(program.inputs, strides, strict=True)]
    outs = [fake_input(kinds[v], dtype, tokens, n, vectors=True) for v, dtype, _ in program.outputs]
    return kernel, (*ins, *[None] * (MAX_INPUTS - len(ins)), *outs, *[None] * (MAX_OUTPUTS - len(outs)),
                    make_fake_stream(use_tvm_ffi_env_stream=True))

