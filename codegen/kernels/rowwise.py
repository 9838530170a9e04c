"""``rowwise``: a generated kernel: the ``codegen.lowered.Program`` of a fused op, one CTA a token.

The kernel is the same for every program; what it computes is the program, which is a
compile-time constant (a spec parameter): while CuTe DSL traces the kernel, ``_run`` walks the
program's ops and emits each one's code, op by op (the translation table below), so the PTX
holds exactly the program's arithmetic, in registers.

Work split: a token's row of N values is cut into 128-bit vectors of 8 values (bf16; fp32
inputs take two loads a vector), and thread i of the token's CTA owns the vectors i, i +
threads, ... (``vectors`` a thread). A row value lives in the owning threads' registers as fp32
scalars; a column value (a norm's weight) likewise, read from the same columns; a per-token
statistic is one fp32 value every thread holds. A reduction over the row sums (or takes the
maximum of) each thread's values, then the warp's with a ``shfl.sync.bfly`` butterfly, then the
warps' through shared memory (one barrier a reduction; every thread adds the warps' partials in
the same order, so every thread holds the same statistic). A vector past the row's end (the last
thread's, where the threads do not divide the row) is read at the last vector and counts as the
reduction's identity; it is not stored.

Programmatic dependent launch: the kernel launches with PDL; every read comes after
``griddepcontrol.wait`` and ``launch_dependents`` follows it at once.
"""
from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float16, Float32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.kernels.common import VEC, g2r_atom, r2g_atom
from codegen.launchers.generated import MAX_INPUTS, MAX_OUTPUTS, threads_for
from codegen.lowered import IDENTITY, ROUND, Program, is_const

CUTE_DTYPES = {"bf16": BFloat16, "fp16": Float16, "fp32": Float32}


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
        self.num_vec = program.width // VEC
        self.threads = threads_for(program.width, vectors)
        self.vectors = -(-self.num_vec // self.threads)
        if self.vectors != vectors:
            raise ValueError(f"{vectors} vectors a thread: a row of {self.num_vec} vectors takes {self.vectors} "
                             f"over {self.threads} threads")
        self.even = self.num_vec % self.threads == 0
        self.warps = self.threads // 32

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
            sRed = smem.allocate_tensor(Float32, cute.make_layout((self.program.reductions, self.warps)),
                                        byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        ins = (i0, i1, i2, i3, i4, i5, i6, i7)[:len(self.program.inputs)]
        vals = [self._load(t, kind, dtype, tidx, token) for t, (kind, dtype) in zip(ins, self.program.inputs)]
        vals = self._run(vals, tidx, sRed)
        outs = (o0, o1, o2, o3)[:len(self.program.outputs)]
        for out, (value, dtype, _) in zip(outs, self.program.outputs):
            if const_expr(self.kinds[value] == "row"):
                for j in cutlass.range_constexpr(self.vectors):
                    v = tidx + j * self.threads
                    rOut = cute.make_rmem_tensor((VEC,), CUTE_DTYPES[dtype])
                    for e in cutlass.range_constexpr(VEC):
                        rOut[e] = vals[value][j * VEC + e].to(CUTE_DTYPES[dtype])
                    if const_expr(self.even) or v < self.num_vec:
                        self._store(rOut, out[token, None], v, dtype)
            else:  # a statistic: one value a token
                if tidx == 0:
                    out[token, 0] = vals[value].to(CUTE_DTYPES[dtype])

    # ---- trace-time helpers (plain Python: they run while the kernel is traced) ----
    def _vector(self, j, tidx):
        """Thread ``tidx``'s j-th vector of the row, clamped to the last one (a read past the end)."""
        v = tidx + j * self.threads
        return v if const_expr(self.even) else cutlass.min(v, self.num_vec - 1)

    def _load(self, t, kind, dtype, tidx, token):
        if const_expr(kind == "stat"):
            return t[token, 0].to(Float32)
        row = t[token, None] if const_expr(kind == "row") else t
        out = []
        for j in range(self.vectors):
            r = cute.make_rmem_tensor((VEC,), CUTE_DTYPES[dtype])
            v = self._vector(j, tidx)
            if const_expr(dtype == "fp32"):  # two 128-bit loads of 4
                for h in range(2):
                    cute.copy(g2r_atom(Float32, invariant=False), cute.local_tile(row, (VEC // 2,), (2 * v + h,)),
                              cute.local_tile(r, (VEC // 2,), (h,)))
            else:
                cute.copy(g2r_atom(CUTE_DTYPES[dtype], invariant=False), cute.local_tile(row, (VEC,), (v,)), r)
            out += [r[e].to(Float32) for e in range(VEC)]
        return out

    def _store(self, r, row, v, dtype):
        if const_expr(dtype == "fp32"):
            for h in range(2):
                cute.copy(r2g_atom(Float32), cute.local_tile(r, (VEC // 2,), (h,)),
                          cute.local_tile(row, (VEC // 2,), (2 * v + h,)))
        else:
            cute.copy(r2g_atom(CUTE_DTYPES[dtype]), r, cute.local_tile(row, (VEC,), (v,)))

    def _run(self, vals, tidx, sRed):
        """Every op of the program, in order: the values of the row as lists of fp32 scalars (this
        thread's columns), statistics and constants as one fp32 scalar."""
        reduction = 0
        for op, args in self.program.ops:
            if op == ROUND:
                vals.append(_map(lambda x, d=args[1]: x.to(CUTE_DTYPES[d]).to(Float32), vals[args[0]]))
            elif op in _REDUCE_OPS:
                vals.append(self._reduce(op, vals[args[0]], tidx, sRed, reduction))
                reduction += 1
            elif len(args) == 1:
                vals.append(_map(_UNARY_OPS[op], vals[args[0]]))
            else:
                a, b = (Float32(x[1]) if is_const(x) else vals[x] for x in args)
                vals.append(_zip(_BINARY_OPS[op], a, b))
        return vals

    def _reduce(self, op, xs, tidx, sRed, index):
        combine, identity = _REDUCE_OPS[op], Float32(IDENTITY[op])
        part = identity
        for j in range(self.vectors):
            vec = xs[j * VEC]
            for e in range(1, VEC):
                vec = combine(vec, xs[j * VEC + e])
            if const_expr(self.even):
                part = combine(part, vec)
            else:  # a vector read past the row's end counts as the identity
                part = combine(part, cutlass.select_(tidx + j * self.threads < self.num_vec, vec, identity))
        _stash(sRed, index, cute.arch.warp_reduction(part, combine))
        cute.arch.barrier()
        total = sRed[index, 0]
        for w in range(1, self.warps):
            total = combine(total, sRed[index, w])
        return total


@cute.jit
def _stash(sRed: cute.Tensor, index: cutlass.Constexpr, part: Float32):
    """Lane 0 of each warp keeps its warp's partial of reduction ``index`` in shared memory."""
    if cute.arch.lane_idx() == 0:
        sRed[index, cute.arch.warp_idx()] = part


def _fmax(a, b):
    return cute.math.max(a, b)


def _fmin(a, b):
    return cute.math.min(a, b)


_REDUCE_OPS = {"sum": operator.add, "rmax": _fmax, "rmin": _fmin}
_UNARY_OPS = {
    "neg": lambda x: -x,
    "exp": cute.math.exp,
    "log": cute.math.log,
    "sqrt": cute.math.sqrt,
    "rsqrt": cute.math.rsqrt,
    "tanh": cute.math.tanh,
    "sigmoid": lambda x: Float32(1.0) / (Float32(1.0) + cute.math.exp(-x)),
    "abs": cute.math.abs,
    "relu": lambda x: _fmax(x, Float32(0.0)),
    "reciprocal": lambda x: Float32(1.0) / x,
    "erf": cute.math.erf,
}
_BINARY_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
               "max": _fmax, "min": _fmin}


def _map(f, x):
    return [f(e) for e in x] if isinstance(x, list) else f(x)


def _zip(f, a, b):
    """``f`` elementwise, a scalar (statistic, constant) broadcast over a row's or column's values."""
    if isinstance(a, list) and isinstance(b, list):
        return [f(x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, list):
        return [f(x, b) for x in a]
    if isinstance(b, list):
        return [f(a, y) for y in b]
    return f(a, b)


def build(spec) -> tuple[RowKernel, tuple]:
    """The kernel object and the fake arguments ``cute.compile`` takes for ``spec`` (the token
    count is a runtime size: one compile serves every batch)."""
    p = spec.param_dict
    program = Program.from_params(p["program"])
    kernel = RowKernel(program, p["vectors"])
    tokens, n = cute.sym_int32(), program.width

    def tensor(kind, dtype):
        ct = CUTE_DTYPES[dtype]
        if kind == "row":
            return make_fake_tensor(ct, (tokens, n), (n, 1), assumed_align=16)
        if kind == "stat":
            return make_fake_tensor(ct, (tokens, 1), (1, 1), assumed_align=ct.width // 8)
        return make_fake_tensor(ct, (n,), (1,), assumed_align=16)

    kinds = program.kinds
    ins = [tensor(kind, dtype) for kind, dtype in program.inputs]
    outs = [tensor(kinds[v], dtype) for v, dtype, _ in program.outputs]
    return kernel, (*ins, *[None] * (MAX_INPUTS - len(ins)), *outs, *[None] * (MAX_OUTPUTS - len(outs)),
                    make_fake_stream(use_tvm_ffi_env_stream=True))

