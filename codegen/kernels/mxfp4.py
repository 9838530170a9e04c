"""MXFP4 in registers: E2M1 codes of Humming's layout dequantized into ``mma.m16n8k16`` A
fragments, and the MMA itself (inline PTX: CuTe DSL has no op that takes a hand-built fragment).

Humming's layout (``rewriter/model/layers/experts.py``) stores each 16 (K) x 64 (rows) tile as one
16-byte vector per lane: word ``i3`` of lane ``r * 4 + q`` holds the 8 codes of the A fragment
of rows ``16 i3 + r (+8)`` and K ``2q (+1) (+8)``. A code ``s e1 e0 m`` placed at bf16 bits 15
and 8..6 is the bf16 number ``E2M1(code) * 2^-126`` (``e1 e0 = 0`` lands on bf16's subnormals,
which is right for E2M1's subnormal 0.5), so one multiply by ``2^(scale - 1)`` gives
``E2M1(code) * 2^(scale - 127)`` exactly: the bf16 multiplier is ``(scale + 126) << 7``, valid
for scale bytes up to 128 (scales up to 2; ``rewriter.model.layers.experts.MAX_KERNEL_SCALE``).

Nibble orders: ``interleaved`` (Humming on sm_90: nibble ``p = i6 * 4 + i4 * 2 + i5``, so the
pair (k, k + 1) of a register sits at bits ``4p`` and ``4p + 16``) and ``natural`` (Humming's
native dequant on sm_100: ``p = i4 * 4 + i5 * 2 + i6``, the pair in one byte).
"""
from __future__ import annotations

from cutlass import Float32, Int32, Int64, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

ORDERS = ("interleaved", "natural")
# warps per SM the expert kernels ask ptxas to make room for (``min_blocks_per_mp`` = these / the
# CTA's warps, no preference of shared-memory carveout, so no device is asked at compile time):
# a CTA loads, computes and reduces in turn, so the more CTAs an SM holds the more of its time
# some of them have loads in flight (the up stage's 129 registers a thread held three CTAs of 4
# warps; 128 holds four)
UP_WARPS_PER_SM, DOWN_WARPS_PER_SM = 16, 20
UP_WARPS_PER_SM_SMEM, DOWN_WARPS_PER_SM_SMEM = 28, 32  # with the weights in shared memory (``weight_staging``)
NO_CARVEOUT_PREFERENCE = -1

# bf16 bits of a code pair's nibbles c = s e1 e0 m once spread (``_dequant_ptx``): signs at 15 and
# 31, e1 e0 m at 8..6 and 24..22
_SIGN_MAG = "0x81C081C0"


def _dequant_ptx(order: str) -> str:
    """PTX filling a0..a3 (row r k 2q | row r+8 k 2q | row r k 2q+8 | row r+8 k 2q+8) from ``w``."""
    if order == "interleaved":
        # pair of register j at nibbles p, p + 4 with p = 0, 2, 1, 3 for j = 0..3 (p = 2, 3 from
        # w >> 8 as p = 0, 1). The pair's two nibbles alone, times 2^(12 - 4p) + 2^(6 - 4p): two
        # copies that do not overlap (so the sum is their OR), one with the sign at bit 15 (31),
        # one with the magnitude at bits 8..6 (24..22); the mask keeps those. Three SASS
        # instructions a register (LOP3, IMAD, LOP3) instead of four (two shifts, two LOP3s).
        out = ["shr.u32 v, w, 8; "]
        for j, (src, p) in enumerate((("w", 0), ("v", 0), ("w", 1), ("v", 1))):
            copies = (1 << 12 - 4 * p) + (1 << 6 - 4 * p)
            out.append(f"and.b32 t, {src}, {0x000F000F << 4 * p:#010x}; mul.lo.u32 t, t, {copies}; "
                       f"and.b32 a{j}, t, {_SIGN_MAG}; ")
        return "".join(out)
    # natural: pair of register j in byte b = 0, 2, 1, 3 (low nibble k, high nibble k + 1). The
    # low nibbles of w (l) and its high nibbles moved down (h), once for the four registers; then
    # a register's byte of each into halves 0 and 2, bytes 1 and 3 zero (the selector's sign
    # replication of a byte whose top bit is clear), and the pair on as above with p = 0: three
    # instructions a register (PRMT, IMAD, LOP3) and three for the word.
    out = ["and.b32 l, w, 0x0F0F0F0F; shr.u32 h, w, 4; and.b32 h, h, 0x0F0F0F0F; "]
    for j, b in enumerate((0, 2, 1, 3)):
        select = b | (8 | b) << 4 | (4 + b) << 8 | (12 + b) << 12
        out.append(f"prmt.b32 t, l, h, {select:#06x}; mul.lo.u32 t, t, {(1 << 12) + (1 << 6)}; "
                   f"and.b32 a{j}, t, {_SIGN_MAG}; ")
    return "".join(out)


def mma_ptx(order: str, half: int) -> str:
    """The inline PTX of ``mma_mxfp4``: $0..$3 the accumulators (in and out), $4 the word, $5 /
    $6 the packed multipliers of its rows (``scale_pairs``), of which it takes half ``half`` of
    each (ptxas reads it as the multiply's operand swizzle, no instruction), $7 / $8 the B
    fragment."""
    if order not in ORDERS:
        raise ValueError(f"nibble order {order!r}: one of {ORDERS}")
    if half not in (0, 1):
        raise ValueError(f"multiplier half {half}: 0 or 1")
    m = ("l5", "l6") if half == 0 else ("h5", "h6")
    return ("{ .reg .b32 a0, a1, a2, a3, t, v, l, h, w, m5, m6; .reg .b16 l5, h5, l6, h6; "
            f"mov.b32 {{l5, h5}}, $5; mov.b32 {{l6, h6}}, $6; mov.b32 m5, {{{m[0]}, {m[0]}}}; "
            f"mov.b32 m6, {{{m[1]}, {m[1]}}}; mov.b32 w, $4; " + _dequant_ptx(order)
            + " mul.rn.bf16x2 a0, a0, m5; mul.rn.bf16x2 a2, a2, m5;"
            + " mul.rn.bf16x2 a1, a1, m6; mul.rn.bf16x2 a3, a3, m6;"
            + " mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$7, $8},"
            + " {$0, $1, $2, $3}; }")


def scale_pairs_ptx(odd: int) -> str:
    """The inline PTX of ``scale_pairs``: $0 the bf16 ``2^(s - 1)`` of E8M0 bytes 0 and 2 of $1
    (``odd`` 0) or 1 and 3 (``odd`` 1), one in each half."""
    if odd:
        return "{ .reg .b32 s; shr.u32 s, $1, 1; and.b32 s, s, 0x7F807F80; add.u32 $0, s, 0x3F003F00; }"
    return "{ .reg .b32 s; and.b32 s, $1, 0x00FF00FF; mad.lo.u32 $0, s, 128, 0x3F003F00; }"


@dsl_user_op
def mma_mxfp4(word: Int32, scale_lo: Int32, scale_hi: Int32, b0: Int32, b1: Int32, c: list, order: str,
              half: int, *, loc=None, ip=None) -> list:
    """``c += dequant(word) x b`` for one m16n8k16: ``word`` holds the lane's 8 codes of a 16 x 16
    A tile, ``scale_lo`` / ``scale_hi`` the packed multipliers (``scale_pairs``) of its rows r and
    r + 8, of which half ``half`` is this subtile's, ``b0``, ``b1`` its B fragment (bf16 pairs),
    ``c`` its 4 fp32 accumulators. Returns the new 4."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(word).ir_value(loc=loc, ip=ip), Int32(scale_lo).ir_value(loc=loc, ip=ip),
         Int32(scale_hi).ir_value(loc=loc, ip=ip), Int32(b0).ir_value(loc=loc, ip=ip),
         Int32(b1).ir_value(loc=loc, ip=ip), *(Float32(v).ir_value(loc=loc, ip=ip) for v in c)],
        mma_ptx(order, half), "=f,=f,=f,=f,r,r,r,r,r,0,1,2,3", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def scale_pairs(scales: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """The multipliers of a word of 4 E8M0 scale bytes, packed two a word: (bytes 0 and 2, bytes
    1 and 3) as bf16 ``2^(s - 1)`` (subtile i3 of a scale word takes half i3 % 2: row r from the
    first, row r + 8 from the second), 5 instructions for the 4 instead of 2 each."""
    return tuple(Int32(llvm.inline_asm(
        T.i32(), [Int32(scales).ir_value(loc=loc, ip=ip)], scale_pairs_ptx(odd), "=r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)) for odd in (0, 1))


def bf16_pairs_ptx() -> str:
    """The inline PTX of ``bf16_pairs``: $0..$3 the pairs of ``_dequant_ptx`` (interleaved order)
    times their row's ``2^(s - 127)``, any scale byte: first by ``2^126`` (exact: the E2M1 value
    itself), then by the scale's power of two as bf16 (``s << 7``; byte 0 is bf16's subnormal
    ``2^-127``, 0x40), so the one rounding is the reference's bf16 ``values * 2^(s - 127)``; $4
    the word, $5 / $6 the scale bytes of rows r and r + 8."""
    mult = "".join(f"setp.eq.u32 z, ${i}, 0; shl.b32 s, ${i}, 7; selp.b32 s, 0x40, s, z; prmt.b32 {m}, s, s, 0x1010; "
                   for i, m in ((5, "m5"), (6, "m6")))
    return ("{ .reg .b32 a0, a1, a2, a3, t, v, w, s, m5, m6, c; .reg .pred z; mov.b32 w, $4; " + mult
            + _dequant_ptx("interleaved") + "mov.b32 c, 0x7E807E80; "
            + "".join(f"mul.rn.bf16x2 a{j}, a{j}, c; " for j in range(4))
            + "mul.rn.bf16x2 $0, a0, m5; mul.rn.bf16x2 $1, a1, m6; mul.rn.bf16x2 $2, a2, m5; "
            + "mul.rn.bf16x2 $3, a3, m6; }")


@dsl_user_op
def bf16_pairs(word: Int32, scale_r: Int32, scale_r8: Int32, *, loc=None, ip=None) -> list:
    """The bf16 values of a word of Humming's codes (interleaved order) as 4 pairs (k, k + 1),
    each an int32: rows (r, k 2q), (r + 8, k 2q), (r, k 2q + 8), (r + 8, k 2q + 8), where
    ``scale_r`` / ``scale_r8`` are the E8M0 bytes of rows r and r + 8 (any byte, exact: the
    generated GEMM's dequantization into its bf16 ring)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(v).ir_value(loc=loc, ip=ip) for v in (word, scale_r, scale_r8)],
        bf16_pairs_ptx(), "=r,=r,=r,=r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


# ---- loads and the per-warp tile loop (trace-time helpers, inlined into the kernels) -----------
def _atom(bits: int):
    """Global -> registers, ``bits`` wide, streamed (no L1 allocation: weights are read once)."""
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=bits,
                               l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)


def load_weights(mW: cute.Tensor, rW: cute.Tensor, e, kb0, nkb: int, nt, lane):
    """Issue the lane's 16 bytes of tile ``nt`` for K blocks ``kb0 .. kb0 + nkb - 1`` of expert
    ``e`` (``mW`` int32 [E, K/16, 2N]): ``rW[i3, i]`` is word i3 of K block i."""
    atom = _atom(128)
    for i in range(nkb):
        cute.copy(atom, cute.local_tile(mW[e, kb0 + i, None], (4,), (nt * 32 + lane,)), rW[None, i])


def weight_staging(smem: bool, allocator, nkb: int, warps: int):
    """Where a warp's weight words wait for the MMA: in registers ([4, nkb], ``load_weights``: a
    run held at once), or, with ``smem``, in the warp's share of shared memory ([4 words, K block,
    lane, warp]: a lane's 16 bytes contiguous, a warp's 512 per block), copied by ``cp.async``
    and read back one K block at a time, so that a thread holds about 56 registers fewer and an
    SM more CTAs with loads in flight. Returns (registers, None) or (None, shared memory)."""
    if not smem:
        return cute.make_rmem_tensor((4, nkb), Int32), None
    return None, allocator.allocate_tensor(Int32, cute.make_layout((4, nkb, 32, warps), stride=(1, 128, 4, 128 * nkb)),
                                           byte_alignment=16)


def issue_weights(mW: cute.Tensor, rW, sW, e, kb0, nkb: int, nt, lane, warp):
    """The lane's 16 bytes of tile ``nt`` for K blocks ``kb0 ..`` of expert ``e``, into the
    registers or (``sW`` not None) by ``cp.async`` into shared memory, a commit group per scale
    group (two K blocks), so that ``staged_words`` can multiply a group while later ones land."""
    if sW is None:
        load_weights(mW, rW, e, kb0, nkb, nt, lane)
        return
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Int32,
                               num_bits_per_copy=128)
    for i in range(nkb):
        cute.copy(atom, cute.local_tile(mW[e, kb0 + i, None], (4,), (nt * 32 + lane,)), sW[None, i, lane, warp])
        if i % 2 == 1:
            cute.arch.cp_async_commit_group()


def copy_from(addr, words: int, dst: cute.Tensor):
    """``cp.async`` of the ``words`` int32 words (4, 2 or 1) at global byte address ``addr`` into
    ``dst``: the weights streamed (16 bytes, no L1 allocation), scales and x through the L1. The
    per-expert stages add constant offsets to a lane's base address instead of indexing tensors,
    so no stage recomputes a 64-bit address (trace-time helper)."""
    mode = cute.nvgpu.LoadCacheMode.GLOBAL if words == 4 else cute.nvgpu.LoadCacheMode.ALWAYS
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=mode), Int32, num_bits_per_copy=32 * words)
    src = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4 * words)
    cute.copy(atom, cute.make_tensor(src, cute.make_layout((words,))), dst)


def issue_x_pairs(x_addr, ring: cute.Tensor, field: int, group, stage, lane, warp):
    """``cp.async`` of a lane's B pairs of the activation (int32 words ``kb * 8 + q`` and ``+ 4`` of
    its row; ``x_addr`` at word q of the row's first scale group) for the two K blocks of scale
    group ``group``, into field ``field`` of the lane's ``stage`` of the per-expert stages' ring
    (trace-time helper)."""
    x = x_addr + Int64(group * 64)
    for blk in range(2):
        for hi in range(2):
            copy_from(x + (blk * 32 + hi * 16), 1,
                      cute.local_tile(ring[None, field, lane, warp, stage], (1,), (blk * 2 + hi,)))


def staged_words(rW, sW, lane, warp, nkb: int):
    """``words(i)``: K block i's 4 weight words for ``tile_mma`` (called in order of i); from
    shared memory once this thread's copies of its scale group landed (``issue_weights``' groups
    were the thread's last; each lane reads back its own words, so no barrier is needed: a
    thread's cp.async writes are visible to it after its wait)."""
    if sW is None:
        return lambda i: [rW[i3, i] for i3 in range(4)]

    def words(i):
        if i % 2 == 0:
            cute.arch.cp_async_wait_group(nkb // 2 - 1 - i // 2)
        v = cute.make_rmem_tensor((4,), Int32)
        cute.autovec_copy(sW[None, i, lane, warp], v)
        return [v[i3] for i3 in range(4)]
    return words


def load_scales(mS: cute.Tensor, rS: cute.Tensor, e, g0, ng: int, nt, r):
    """The 8 E8M0 bytes of rows ``r + 8 i4 + 16 i3`` of tile ``nt`` (Humming keeps them side by
    side) for scale groups ``g0 .. g0 + ng - 1`` (``mS`` the scales as int32 [E, K/32, N/4])."""
    atom = _atom(64)
    for i in range(ng):
        cute.copy(atom, cute.local_tile(mS[e, g0 + i, None], (2,), (nt * 8 + r,)), rS[None, i])


def load_b(mX: cute.Tensor, rB: cute.Tensor, row: tuple, kb0, nkb: int, q):
    """The B fragments (bf16 pairs) of one activation row ``mX[row]`` (int32 view) for K blocks
    kb0..: every lane's columns are the same row, so every C column holds the same result."""
    for i in range(nkb):
        base = (kb0 + i) * 8 + q
        rB[0, i] = mX[(*row, base)]
        rB[1, i] = mX[(*row, base + 4)]


def tile_mma(words, rS: cute.Tensor, b_pair, acc: cute.Tensor, nkb: int, order: str):
    """acc[:, i3] += the 16 rows of subtile i3 times B over the warp's K blocks (two per scale
    group: the 8 multipliers are made once per group, packed two a word); ``words(i)`` K block
    i's 4 weight words (``staged_words``), ``b_pair(i)`` its B fragment (each read where it is
    used)."""
    for g in range(nkb // 2):
        mult = [scale_pairs(rS[h, g]) for h in range(2)]
        for i in (2 * g, 2 * g + 1):
            b0, b1 = b_pair(i)
            w = words(i)
            for i3 in range(4):
                lo, hi = mult[i3 // 2]
                c = mma_mxfp4(w[i3], lo, hi, b0, b1, [acc[j, i3] for j in range(4)], order, i3 % 2)
                for j in range(4):
                    acc[j, i3] = c[j]


def warp_registers(nkb: int):
    """A warp's scale words [2, nkb / 2] for a run of ``nkb`` K blocks and its four subtiles' fp32
    accumulators [4, 4], zeroed (the weight words: ``weight_staging``)."""
    acc = cute.make_rmem_tensor((4, 4), Float32)
    acc.fill(0.0)
    return cute.make_rmem_tensor((2, nkb // 2), Int32), acc
