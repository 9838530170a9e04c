"""Warp-level tensor-core pieces written as inline PTX, with the fragment layouts spelled out
(the MLA kernels address their shared-memory tiles by hand): ``mma.sync.m16n8k16`` bf16 ->
fp32 and ``ldmatrix.x4`` (plain or transposed).

Fragments of m16n8k16 for lane ``l`` (``g = l // 4``, ``q = l % 4``):
- A (16 x 16, row major), 4 words: (g, 2q..2q+1), (g + 8, 2q..), (g, 2q + 8..), (g + 8, 2q + 8..);
  ``ldmatrix.x4`` with lane l addressing row ``l % 8 + 8 ((l // 8) % 2)``, column ``8 (l // 16)``;
- B (16 x 8, k x n), 2 words: (k 2q..2q+1, n g), (k 2q + 8.., n g); from an [n][k] tile a plain
  ``ldmatrix`` of 8 n-rows gives one word, from a [k][n] tile ``ldmatrix.trans`` of 8 k-rows;
- C (16 x 8 fp32), 4 values: (g, 2q), (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1).
"""
from __future__ import annotations

from cutlass import Float32, Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as IrT
from cutlass.cutlass_dsl import dsl_user_op

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, " \
      "{$0, $1, $2, $3};"


@dsl_user_op
def mma_bf16(a: list, b0: Int32, b1: Int32, c: list, *, loc=None, ip=None) -> list:
    """``c += A B`` for one m16n8k16 (bf16 in, fp32 accumulators): ``a`` the lane's 4 A words,
    ``b0``, ``b1`` its B words, ``c`` its 4 accumulators; returns the new 4."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([IrT.f32()] * 4),
        [*(Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, b0, b1)), *(Float32(v).ir_value(loc=loc, ip=ip) for v in c)],
        MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(IrT.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ldmatrix_x4(addr: Int32, trans: bool, *, loc=None, ip=None) -> list:
    """``ldmatrix.x4`` (``.trans``): four 8 x 8 bf16 matrices, lane ``8 i + j`` giving the
    shared-memory address of row ``j`` of matrix ``i``; returns the lane's 4 words. Volatile:
    it must stay after the barrier that publishes the matrices."""
    op = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];"
    res = llvm.inline_asm(
        llvm.StructType.get_literal([IrT.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)], op,
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(IrT.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def words(t: cute.Tensor) -> cute.Tensor:
    """A register tensor of bf16 (or bytes) seen as 32-bit words (trace-time helper)."""
    return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=Int32),
                            cute.make_layout(cute.size(t) * t.element_type.width // 32))
