"""MXFP4 routed experts: the formats (``rewriter/model/layers/experts.py``), the templates
``routed_experts_mxfp4`` (per (token, slot) pair) and ``routed_moe_mxfp4`` (the router's top-k
filing the pairs by expert, then the up stage per chosen expert) and their kernels ``expert_up_mxfp4`` /
``expert_down_mxfp4``.

1. formats: every layout holds the checkpoint's values (exact dequantization), Humming's
   element addresses as documented, padding zero (no CuTe DSL);
2. the in-register dequantization and MMA, as PTX text, run by a small interpreter of the
   instructions it uses over a simulated warp: every lane's fragments, the scale bytes it picks
   and the C it ends with, against the dequantized tile (CuTe DSL imported, no GPU);
3. specs at Kimi K3's TP 16 / TP 8 shapes and refusals; compiles for sm_90a and sm_100a with
   PTX checks;
4. on a GPU (marked ``gpu``): Humming (humming-kernels, the package vLLM uses on sm_90) lays
   out random MXFP4 experts exactly as vLLM does, the layout equals ours bit for bit, and the
   kernels read those very tensors: fresh inputs, outputs poisoned with NaN, bf16 relative error
   <= 1e-2 against the dequantized fp32 reference; Humming's native nibble order too; the op
   dispatched through ``install_cuda_kernels`` inside a CUDA graph.
   Run on the GPU machine: ``python -m pytest -q -m gpu tests/test_kernels_mxfp4.py``.
"""
from __future__ import annotations

import re

import pytest
import torch

import patterns.moe  # noqa: F401  (defines k3f::routed_experts_mxfp4)
from codegen.launchers import experts as experts_launcher
from codegen.templates import spec_for_call
from conftest import (
    alone_if_large,
    gpu_kernels,
    needs_cutedsl,
    needs_sass_tools,
    on_gpu,
    pdl_flags,
    rel_err,
    sass_or_skip,
)
from rewriter.model.config import KimiK3Config
from rewriter.model.layers.experts import (
    GROUP,
    ExpertFormat,
    ExpertFormatError,
    humming_relayout,
    pack_nibbles,
    random_mxfp4,
)
from rewriter.model.layers.moe import route

OP = "k3f::routed_experts_mxfp4"
MOE = "k3f::routed_moe_mxfp4"  # the router's top-k with the experts, per chosen expert
K3 = KimiK3Config.preset("kimi-k3")
E, K, L = K3.num_experts, K3.num_experts_per_token, K3.moe_hidden_size  # 896, 16, 3584
BETA, LINEAR_BETA = K3.activation_situ_beta, K3.activation_situ_linear_beta
SHAPES = {"tp16": (256, 192), "tp8": (384, 384)}  # (I held per rank, I live)
SMALL_TP_SHAPES = {"tp4": (768, 768), "tp2": (1536, 1536), "tp1": (3072, 3072)}  # a slot's down stage: 4, 8, 16 warps
OTHER_TP_SHAPES = {**SMALL_TP_SHAPES, "tp32": (256, 96),  # TP 32: 96 live channels, two tiles computed
                   "tp3": (1024, 1024), "tp12": (256, 256), "tp48": (256, 64)}  # sizes that do not divide 896
HUMMING, NATIVE, CHECKPOINT = (ExpertFormat("mxfp4", x) for x in ("humming", "humming_native", "checkpoint"))
TOL = 1e-2


# ---------------------------------------------------------------- 1. formats

@pytest.mark.parametrize("fmt", [HUMMING, NATIVE, CHECKPOINT])
def test_every_layout_holds_the_checkpoints_values(fmt):
    g = torch.Generator().manual_seed(1)
    w, s = random_mxfp4(3, 128, 96, generator=g)
    codes = torch.stack((w & 15, w >> 4), -1).flatten(-2).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    expected = values * torch.exp2(s.float() - 127).repeat_interleave(GROUP, -1)
    weight, scale = fmt.from_checkpoint(w, s)
    want = fmt.tensors(3, 128, 96)
    assert (tuple(weight.shape), weight.dtype) == want["weight"]
    if "weight_scale" in want:
        assert (tuple(scale.shape), scale.dtype) == want["weight_scale"]
    assert torch.equal(fmt.dequant(weight, scale).float(), expected)
    assert torch.equal(fmt.dequant(weight[[2, 0]], scale[[2, 0]]).float(), expected[[2, 0]])  # gathered experts


@pytest.mark.parametrize("fmt", [HUMMING, CHECKPOINT])
def test_dequant_runs_a_few_matrices_at_a_time(fmt, monkeypatch):
    """The reference's [tokens, k] gathers are dequantized a few matrices at a time (all at once,
    the temporaries of a TP 3 layer at 32 tokens ran an H100 out of memory): chunks of 4 over
    2 x 5 gathered matrices, the last chunk short, give each matrix's values."""
    import rewriter.model.layers.experts as formats

    weight, scale = fmt.from_checkpoint(*random_mxfp4(3, 128, 96, generator=torch.Generator().manual_seed(5)))
    ids = torch.tensor([[2, 0, 1, 1, 0], [0, 2, 2, 1, 0]])
    monkeypatch.setattr(formats, "DEQUANT_CHUNK", 4)
    chunked = fmt.dequant(weight[ids], scale[ids])
    assert chunked.shape == (2, 5, 128, 96)
    one_each = torch.stack([fmt.dequant(weight[e], scale[e]) for e in ids.flatten().tolist()]).view(2, 5, 128, 96)
    assert torch.equal(chunked, one_each)
    assert torch.equal(fmt.dequant(weight[2], scale[2]), fmt.dequant(weight, scale)[2])  # one matrix, no leading dims


def test_relayout_runs_a_few_experts_at_a_time(monkeypatch):
    """``from_checkpoint`` re-lays experts in chunks (the int64 codes of 896 experts at once were
    18 GiB, more than the GPU tests had under compute-sanitizer): chunks of 2 give the same words."""
    import rewriter.model.layers.experts as formats

    w, s = random_mxfp4(5, 128, 96, generator=torch.Generator().manual_seed(4))
    whole = HUMMING.from_checkpoint(w, s)
    monkeypatch.setattr(formats, "RELAYOUT_CHUNK", 2)
    chunked = HUMMING.from_checkpoint(w, s)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1].view(torch.uint8), chunked[1].view(torch.uint8))
    assert torch.equal(HUMMING.dequant(*chunked), CHECKPOINT.dequant(w, s))


def test_humming_addresses_as_documented():
    """Element (n, k) in nibble i6*4 + i4*2 + i5 of word (k // 16, (n // 64) * 128 + ((n % 8) * 4 + (k % 8) // 2)
    * 4 + (n % 64) // 16); its scale at byte (k // 32, (n // 64) * 64 + (n % 8) * 8 + (n % 64) // 8)."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (1, 128, 64), generator=g)
    scales = torch.randint(100, 130, (1, 128, 2), generator=g, dtype=torch.uint8)
    weight, scale = HUMMING.from_checkpoint(pack_nibbles(codes), scales)
    native, _ = NATIVE.from_checkpoint(pack_nibbles(codes), scales)
    words, nat, sb = weight[0].long() & 0xFFFFFFFF, native[0].long() & 0xFFFFFFFF, scale[0].view(torch.uint8)
    for n, k in torch.randint(0, 64, (400, 2), generator=g).tolist():
        n = n * 2 + k % 2  # rows 0..127
        i3, i4, r, i5, q, i6 = (n % 64) // 16, (n // 8) % 2, n % 8, (k % 16) // 8, (k % 8) // 2, k % 2
        col = (n // 64) * 128 + (r * 4 + q) * 4 + i3
        assert (int(words[k // 16, col]) >> 4 * (i6 * 4 + i4 * 2 + i5)) & 15 == int(codes[0, n, k])
        assert (int(nat[k // 16, col]) >> 4 * (i4 * 4 + i5 * 2 + i6)) & 15 == int(codes[0, n, k])
        assert int(sb[k // 32, (n // 64) * 64 + r * 8 + (n % 64) // 8]) == int(scales[0, n, k // 32])


def test_random_experts_are_zero_in_the_padding():
    live = torch.arange(128) % 64 < 48
    w, s = random_mxfp4(2, 128, 64, live_rows=live, live_k=32)
    assert not w[:, ~live].any() and not s[:, ~live].any()
    assert not w[..., 16:].any() and not s[..., 1:].any() and w[:, live, :16].any()


def test_formats_name_what_is_wrong():
    with pytest.raises(ExpertFormatError, match="unknown expert format mxfp4/marlin"):
        ExpertFormat("mxfp4", "marlin")
    with pytest.raises(ExpertFormatError, match="unknown expert dtype 'fp8'"):
        ExpertFormat.parse("fp8")
    assert ExpertFormat.parse("mxfp4") == HUMMING and ExpertFormat.parse("bf16").layout == "dense"
    with pytest.raises(ExpertFormatError, match="N a multiple of 64"):
        HUMMING.tensors(4, 48, 64)
    w, s = HUMMING.from_checkpoint(*random_mxfp4(2, 64, 64))
    assert (tuple(w.shape), w.dtype) == HUMMING.tensors(2, 64, 64)["weight"] == ((2, 4, 128), torch.int32)
    assert HUMMING.tensors(2, 64, 32)["weight"][0] == (2, 2, 128)  # another K: another shape


# ---------------------------------------------------------------- 2. the PTX, interpreted over one warp

def _u32(v: int) -> int:
    return v & 0xFFFFFFFF


def _bf16x2(v: int) -> tuple[float, float]:
    """The two bf16 halves of a 32-bit register (low half first)."""
    halves = [torch.tensor([(v >> s) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()
              for s in (0, 16)]
    return halves[0], halves[1]


def _pack_bf16x2(a: float, b: float) -> int:
    bits = torch.tensor([a, b], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).tolist()
    return (bits[0] & 0xFFFF) | ((bits[1] & 0xFFFF) << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> 4 * i) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def run_ptx(body: str, args: dict[str, int | float]) -> tuple[dict[str, int], list[int] | None]:
    """Run one lane's inline PTX (the instructions the MXFP4 helpers use) up to its mma; returns
    the registers and the mma's A and B fragments (None without an mma)."""
    regs: dict[str, int | float] = dict(args)

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    fragments = None
    for stmt in body.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        if op.startswith("mma.sync"):
            groups = re.findall(r"\{([^}]*)\}", rest)
            a = [val(x) for x in groups[1].split(",")]
            b = [val(x) for x in groups[2].split(",")]
            fragments = a + b
            continue
        if op == "mov.b32" and "{" in rest:  # a b32 unpacked into two b16 halves, or packed from two
            if rest.startswith("{"):
                lo, hi, src = re.fullmatch(r"\{(\w+), (\w+)\}, (\S+)", rest).groups()
                regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            else:
                d, lo, hi = re.fullmatch(r"(\w+), \{(\w+), (\w+)\}", rest).groups()
                regs[d] = regs[lo] | regs[hi] << 16
            continue
        d, *srcs = [x.strip() for x in rest.split(",")]
        x = [val(s) for s in srcs]
        if op == "mov.b32":
            regs[d] = x[0]
        elif op == "shl.b32":
            regs[d] = _u32(x[0] << x[1])
        elif op == "shr.u32":
            regs[d] = x[0] >> x[1]
        elif op == "and.b32":
            regs[d] = x[0] & x[1]
        elif op == "or.b32":
            regs[d] = x[0] | x[1]
        elif op == "prmt.b32":
            regs[d] = _prmt(x[0], x[1], x[2])
        elif op == "add.u32":
            regs[d] = _u32(x[0] + x[1])
        elif op == "mul.lo.u32":
            regs[d] = _u32(x[0] * x[1])
        elif op == "mad.lo.u32":
            regs[d] = _u32(x[0] * x[1] + x[2])
        elif op == "mul.rn.bf16x2":
            (a0, a1), (b0, b1) = _bf16x2(x[0]), _bf16x2(x[1])
            regs[d] = _pack_bf16x2(a0 * b0, a1 * b1)
        elif op == "setp.eq.u32":
            regs[d] = x[0] == x[1]
        elif op == "selp.b32":
            regs[d] = x[0] if x[2] else x[1]
        else:
            raise AssertionError(f"instruction the interpreter does not know: {op}")
    return regs, fragments


def warp_mma(frags: list[list[int]], c: list[list[float]]) -> list[list[float]]:
    """mma.m16n8k16 row.col bf16 -> fp32 over 32 lanes' fragments (PTX ISA's layout):
    A reg j of lane (g, t) is rows g (+8 for j odd), K 2t (+8 for j >= 2) and +1; B reg j is
    K 2t (+8 for j = 1) and +1, column g; D reg j is row g (+8 for j >= 2), column 2t + j % 2."""
    A, B = torch.zeros(16, 16), torch.zeros(16, 8)
    for lane, f in enumerate(frags):
        g, t = divmod(lane, 4)
        for j in range(4):
            lo, hi = _bf16x2(f[j])
            row, col = g + 8 * (j % 2), 2 * t + 8 * (j // 2)
            A[row, col], A[row, col + 1] = lo, hi
        for j in range(2):
            lo, hi = _bf16x2(f[4 + j])
            B[2 * t + 8 * j, g], B[2 * t + 8 * j + 1, g] = lo, hi
    D = A.double() @ B.double()
    out = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        out.append([c[lane][j] + float(D[g + 8 * (j // 2), 2 * t + j % 2]) for j in range(4)])
    return out


@needs_cutedsl
@pytest.mark.parametrize("fmt", [HUMMING, NATIVE])
def test_dequant_and_mma_ptx_on_one_warp(fmt):
    """Two K blocks (one scale group) of one 64-row tile: every lane's C holds its rows' dot
    products with x (rows 16 i3 + r in c0 and c1, 16 i3 + 8 + r in c2 and c3), scales near 2^1
    and 2^-30 included (the bias trick's range), signed zeros and E2M1's subnormal 0.5 too."""
    from codegen.kernels.mxfp4 import mma_ptx, scale_pairs_ptx

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (1, 64, 32), generator=g)
    codes[0, 0, :4] = torch.tensor([0, 8, 1, 9])  # +-0, +-0.5
    scales = torch.randint(96, 129, (1, 64, 1), generator=g, dtype=torch.uint8)
    scales[0, :2, 0] = torch.tensor([128, 97], dtype=torch.uint8)
    weight, scale = fmt.from_checkpoint(pack_nibbles(codes), scales)
    words = (weight[0].long() & 0xFFFFFFFF).tolist()  # [2 kb][128]
    sbytes = scale[0].view(torch.uint8)[0].tolist()  # [64]
    x = torch.randn(32, generator=g).bfloat16()
    xbits = [int(v) & 0xFFFF for v in x.view(torch.int16).tolist()]
    xpair = [xbits[2 * i] | (xbits[2 * i + 1] << 16) for i in range(16)]  # bf16 pairs (k, k + 1)
    order = "interleaved" if fmt is HUMMING else "natural"
    c = [[[0.0] * 4 for _ in range(32)] for _ in range(4)]  # [i3][lane]
    for kb in range(2):
        for i3 in range(4):
            frags = []
            for lane in range(32):
                r, q = divmod(lane, 4)
                sw = [sum(sbytes[r * 8 + 4 * h + i] << 8 * i for i in range(4)) for h in range(2)]
                # the scale word's multipliers packed two a word, subtile i3 taking half i3 % 2
                mult = [run_ptx(scale_pairs_ptx(odd), {"$1": sw[i3 // 2]})[0]["$0"] for odd in range(2)]
                _, f = run_ptx(mma_ptx(order, i3 % 2), {"$4": words[kb][lane * 4 + i3], "$5": mult[0], "$6": mult[1],
                                                        "$7": xpair[kb * 8 + q], "$8": xpair[kb * 8 + 4 + q]})
                frags.append(f)
            c[i3] = warp_mma(frags, c[i3])
    expected = fmt.dequant(weight, scale)[0].double() @ x.double()  # [64]
    for i3 in range(4):
        for lane in range(32):
            r = lane // 4
            got = c[i3][lane]
            assert got[0] == got[1] and got[2] == got[3]  # every column is the one token
            assert got[0] == pytest.approx(float(expected[16 * i3 + r]), rel=1e-6, abs=1e-12)
            assert got[2] == pytest.approx(float(expected[16 * i3 + 8 + r]), rel=1e-6, abs=1e-12)


@needs_cutedsl
def test_bf16_pairs_dequantize_every_code_at_every_scale_byte():
    """The generated GEMM's dequantization (``mxfp4.bf16_pairs``, PTX interpreted): each lane's
    4 pairs of a word are its rows' values at K 2q (+1) (+8), equal to the reference's bf16
    values bit for bit for every code and every scale byte but 255 (NaN), subnormal results
    (bytes below 7) and overflows to infinity (above 252) included: the hand-written kernels'
    single multiply takes bytes up to 128."""
    from codegen.kernels.mxfp4 import bf16_pairs_ptx

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (1, 64, 32), generator=g)
    codes[0, :16, :16] = torch.arange(16)  # every code in every row of subtile 0
    scales = torch.randint(0, 255, (1, 64, 1), generator=g, dtype=torch.uint8)
    scales[0, :8, 0] = torch.tensor([0, 1, 6, 127, 128, 129, 253, 254], dtype=torch.uint8)
    weight, scale = HUMMING.from_checkpoint(pack_nibbles(codes), scales)
    want = HUMMING.dequant(weight, scale)[0]  # [64, 32] bf16
    words = (weight[0].long() & 0xFFFFFFFF).tolist()  # [2 kb][128]
    sbytes = scales[0, :, 0].tolist()
    ptx = bf16_pairs_ptx()
    for kb in range(2):
        for lane in range(32):
            r, q = divmod(lane, 4)
            for i3 in range(4):
                rows = (16 * i3 + r, 16 * i3 + 8 + r)
                regs, _ = run_ptx(ptx, {"$4": words[kb][lane * 4 + i3], "$5": sbytes[rows[0]], "$6": sbytes[rows[1]]})
                for j in range(4):
                    row, k = rows[j % 2], 16 * kb + 2 * q + 8 * (j // 2)
                    got = torch.tensor(_bf16x2(regs[f"${j}"]), dtype=torch.bfloat16)
                    assert torch.equal(got, want[row, k:k + 2]), (kb, lane, i3, j, got, want[row, k:k + 2])


# ---------------------------------------------------------------- 3. specs, refusals, compiles

def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def mxfp4_args(tokens=1, inter=256, live=192, layout="humming", experts=E, top_k=K, latent=L, **dtypes):
    n = 2 * inter
    return (meta(tokens, latent, dtype=dtypes.get("x", torch.bfloat16)), meta(tokens, top_k, dtype=torch.float32),
            meta(tokens, top_k, dtype=torch.int64), meta(experts, latent // 16, 2 * n, dtype=torch.int32),
            meta(experts, latent // 32, n, dtype=dtypes.get("scale", torch.float8_e8m0fnu)),
            meta(experts, inter // 16, 2 * latent, dtype=torch.int32),
            meta(experts, inter // 32, latent, dtype=torch.float8_e8m0fnu), BETA, LINEAR_BETA, layout, live)


def moe_args(tokens=1, inter=256, live=192, experts=E, top_k=K, latent=L, logits=None):
    """``k3f::routed_moe_mxfp4``'s arguments on meta tensors: the pair op's, logits and bias for
    its weights and ids, and the router's top-k, renormalization and scaling."""
    x, _, _, *weights = mxfp4_args(tokens, inter, live, experts=experts, top_k=top_k, latent=latent)[:7]
    return (x, meta(*(logits or (tokens, experts)), dtype=torch.float32), meta(experts, dtype=torch.float32),
            *weights, top_k, True, 2.5, BETA, LINEAR_BETA, "humming", live)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_specs_at_kimi_k3_shapes(shape):
    inter, live = SHAPES[shape]
    tpl, specs = spec_for_call(OP, "sm_90a", mxfp4_args(inter=inter, live=live))
    assert tpl.kernel == "routed_experts_mxfp4", specs
    up, down = specs
    assert up.kernel == "expert_up_mxfp4" and down.kernel == "expert_down_mxfp4"
    assert up.shape_dict == {"experts": E, "top_k": K, "latent": L, "inter": inter, "inter_live": live}
    # 224 K blocks of L = 8 CTAs x 2 warps per tile x 14; the slots over CTAs of 4 warps of 12 live
    # blocks: TP 16 4 CTAs of 4 slots, TP 8 8 CTAs of 2 slots x 2 warps
    assert (up.param_dict["cluster"], up.param_dict["warps_per_tile"]) == (8, 2)
    wps = live // 16 // 12
    assert down.param_dict == {"cluster": 4 * wps, "warps_per_slot": wps, "order": "interleaved"}
    # one compile per stage serves every batch below the shared-memory form's token count, one more
    # every batch from it (the token count is a runtime size)
    smem_from = experts_launcher.MXFP4_SMEM_WEIGHTS_FROM
    for tokens in range(2, smem_from):
        assert spec_for_call(OP, "sm_90a", mxfp4_args(tokens=tokens, inter=inter, live=live))[1] == specs
    big = spec_for_call(OP, "sm_90a", mxfp4_args(tokens=smem_from, inter=inter, live=live))[1]
    assert [(s.kernel, s.shape_dict, s.param_dict) for s in big] == \
        [(s.kernel, s.shape_dict, {**s.param_dict, "smem_weights": True}) for s in specs]
    for tokens in (15, 16, 64):
        assert spec_for_call(OP, "sm_90a", mxfp4_args(tokens=tokens, inter=inter, live=live))[1] == big
    # the router with the experts: its top-k filing the pairs by expert (lists of up to 64), then
    # the up stage per chosen expert, one compile for every batch too
    for tokens in (16, 64):
        tpl, (router, up_e, down_e) = spec_for_call(MOE, "sm_90a", moe_args(tokens=tokens, inter=inter, live=live))
        assert tpl.kernel == "routed_moe_mxfp4"
        assert router.kernel == "router_topk" and router.shape_dict == {"experts": E}
        assert router.param_dict == {"top_k": K, "renormalize": True, "scaling": 2.5, "threads": 128, "plan_cap": 64}
        # the up stage per chosen expert streams L over 4 warps; the down stage is the per-pair one,
        # which zeroes the plan, or from MXFP4_DOWN_BY_EXPERT_FROM tokens per chosen expert too,
        # streaming whole row tiles (TP 16: 6 scale groups a tile, 2 tiles a warp; TP 8: 12, one)
        assert up_e.param_dict == {"warps": 4, "stages": experts_launcher.MXFP4_STREAM_STAGES,
                                   "by_expert_max_tokens": 64, "beta": BETA, "linear_beta": LINEAR_BETA,
                                   "order": "interleaved"}
        if tokens < experts_launcher.MXFP4_DOWN_BY_EXPERT_FROM:
            assert down_e.param_dict == {**(big if tokens >= smem_from else specs)[1].param_dict, "zero_plan": True}
        else:
            assert down_e.param_dict == {"warps": 4, "tiles_per_warp": 2 if live == 192 else 1,
                                         "stages": experts_launcher.MXFP4_DOWN_STREAM_STAGES,
                                         "by_expert_max_tokens": 64, "order": "interleaved"}


def test_routing_plan_is_made_before_any_capture(monkeypatch):
    """A served step runs only inside a CUDA graph capture, where the plan (zeroed once, then left
    zero by every step) could not be zeroed: ``make_workspaces`` (the vLLM plugin calls it each time
    vLLM binds its caches) makes it from the router stage's spec, once per device and shape, and
    zeroes it at every call; the per-pair op keeps none."""
    from codegen.templates import make_workspaces

    monkeypatch.setattr(experts_launcher, "_plans", {})
    monkeypatch.setattr(experts_launcher, "_arrivals", {})
    assert make_workspaces(spec_for_call(OP, "sm_90a", mxfp4_args(tokens=16))[1], "cpu") == 0
    assert experts_launcher._plans == {} and experts_launcher._arrivals == {}
    specs = spec_for_call(MOE, "sm_90a", moe_args(tokens=16))[1] + spec_for_call(MOE, "sm_90a", moe_args(tokens=64))[1]
    assert make_workspaces(specs, "cpu") == 2  # the router's and the down stage's: one spec each for every batch
    (key,) = experts_launcher._plans
    assert key == ("cpu", E, 64)
    counts, chosen, lists, records = experts_launcher._plans[key]
    assert counts.shape == (E + 1,) and chosen.shape == (E,) and lists.shape == (E, 64) and records.shape == (E + 1,)
    assert not counts.any() and counts.dtype == torch.int32
    (arrivals,) = experts_launcher._arrivals.values()
    assert arrivals.shape == (64, L // 64) and not arrivals.any()
    counts.fill_(3)  # left dirty by some earlier run: zeroed again at every call (each time vLLM binds its caches)
    arrivals.fill_(1)
    assert make_workspaces(specs, "cpu") == 2 and not counts.any() and not arrivals.any()


@pytest.mark.parametrize("args,reason", [
    (mxfp4_args(layout="checkpoint"), "MXFP4 experts in the 'checkpoint' layout; the kernels read Humming's"),
    (mxfp4_args(tokens=65), "65 tokens outside 1..64"),
    (mxfp4_args(x=torch.float16), "x is fp16; the template is bf16 only"),
    (mxfp4_args(scale=torch.uint8), "w13_scale is uint8; the template is float8_e8m0fnu only"),
    (mxfp4_args(live=320), "I_live 320: multiples of 64 (Humming's row tiles), I_live <= I"),  # I = 256
])
def test_template_refuses_with_a_reason(args, reason):
    tpl, why = spec_for_call(OP, "sm_90a", args)
    assert tpl is None and reason in why, why


@pytest.mark.parametrize("args,reason", [
    (moe_args(tokens=8, logits=(7, E)), "x [T, L] and logits [T, E] expected, got (8, 3584) and (7, 896)"),
    (moe_args(logits=(1, 64)), "logits score 64 experts, the weights hold 896"),
    (moe_args(tokens=65), "65 tokens outside 1..64"),
])
def test_moe_template_refuses_with_a_reason(args, reason):
    tpl, why = spec_for_call(MOE, "sm_90a", args)
    assert tpl is None and reason in why, why


COMPILED = {"tp16": mxfp4_args(inter=256, live=192), "tp8": mxfp4_args(inter=384, live=384),
            "native_tp16": mxfp4_args(inter=256, live=192, layout="humming_native"),
            "tp8_by_expert": moe_args(tokens=64, inter=384, live=384),
            "tp16_by_expert_16": moe_args(tokens=16, inter=256, live=192)}


@pytest.fixture(scope="module")
def compiled(kcache):
    from codegen.compiler import compile_kernel

    return {(name, arch): tuple(compile_kernel(s, cache=kcache)
                                for s in spec_for_call(MOE if "by_expert" in name else OP, arch, args)[1])
            for name, args in COMPILED.items() for arch in ("sm_90a", "sm_100a")}


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
WAIT, LAUNCH = "griddepcontrol.wait;", "griddepcontrol.launch_dependents;"


@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", list(COMPILED))
def test_ptx(compiled, arch, name):
    """Each warp's loads all issued before its first MMA (128-bit weights, 64-bit scales, no L1
    allocation), 4 MMAs per K block, the cluster's sums pushed to their owners, PDL; on
    the per-expert up stage, the pairs read from the router's plan (two atomic adds per pair filed
    there, no scan of the ids) and the tokens' sums by arrival counts."""
    *router, up, down = compiled[name, arch]
    by_expert = "by_expert_max_tokens" in up.spec.param_dict  # the up stage per chosen expert
    down_by_expert = "by_expert_max_tokens" in down.spec.param_dict  # and the down stage
    assert bool(router) == by_expert and by_expert == (down_by_expert or bool(down.spec.param_dict.get("zero_plan")))
    if router:  # each of the k lanes: its place in its expert's list, and the chosen list's for a first pair
        body = router[0].ptx[router[0].ptx.index(".entry"):]
        assert re.findall(r"atom\.global\.[\w.]+", body) == ["atom.global.add.u32"] * 2
        assert "ld.local" not in body and pdl_flags(router[0].spec) == [1]
    live_blocks = up.spec.shape_dict["inter_live"] // 16
    # the streamed stages per expert: their own test
    stages = () if down_by_expert else ((down, live_blocks // down.spec.param_dict["warps_per_slot"]),)
    for k, per_warp in stages if by_expert else ((up, 14), *stages):
        ptx = k.ptx
        assert f".target {arch}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
        body = ptx[ptx.index(".entry"):]
        # the tile's 16 bytes per K block, into registers, or into shared memory from the token
        # count where that form is served (64 tokens here)
        smem = bool(k.spec.param_dict.get("smem_weights"))
        wload = "cp.async.cg.shared.global" if smem else "ld.global.L1::no_allocate.v4.b32"
        # the owner reads its received sums, the cluster's values of one (channel, half) 4 a load
        cluster, halves = k.spec.param_dict["cluster"], 2 if k is up else 1
        received = cluster * halves // 4
        assert _count(body, wload) == per_warp and _count(body, "ld.shared.v4") == (per_warp if smem else 0) + received
        # 8 scale bytes per group (as two words or, where the compiler likes, one 64-bit load)
        assert (_count(body, "ld.global.L1::no_allocate.v2.b32") + _count(body, "ld.global.L1::no_allocate.b64")
                == per_warp // 2)
        assert body.count(MMA) == 4 * per_warp and body.count("mul.rn.bf16x2") == 16 * per_warp
        # a group's 8 row multipliers from its 2 scale words, packed two a word (scale_pairs)
        assert body.count("0x00FF00FF") == body.count("0x7F807F80") == 2 * (per_warp // 2)
        assert body.count(WAIT) == 1 and body.count(LAUNCH) == 1
        before, rest = body.split(WAIT)
        between, after = rest.split(LAUNCH)
        # up: the ids (or the plan) are its primary's output, so nothing is read before the wait and
        # the rows between it and launch_dependents; down: the router finished before the up stage
        # let it launch, so ids and rows come before its wait (which the activation needs)
        waits_first = k is up
        early = between if waits_first else before
        assert ("ld.global" not in before) == waits_first
        assert _count(early, wload) == per_warp  # all in flight at once
        # the B pairs after the weights: the down kernel's from global, the up kernel's x staged in
        # shared memory once per CTA (224 words over 128 threads); after the per-expert up stage the
        # per-pair down stage also reads the plan's chosen count and experts, to zero it
        expected = 2 if k is up else 2 * per_warp + 2 * by_expert
        assert _count(after, "ld.global.b32") == expected
        # no scan of the ids, no atomics: each pair's sums meet in its cluster (of 8 and 4 / 8 CTAs):
        # pushed by st.async to the CTA that finishes them, counted on its mbarrier; one cluster
        # barrier, relaxed, only so that every mbarrier exists before the first push; no CTA reads
        # a peer's shared memory, so none waits for its peers before it leaves
        assert body.count("vote.sync.ballot.b32") == 0 and "atom.global" not in body
        assert _count(body, "st.async.shared::cluster.mbarrier::complete_tx::bytes") == 1
        assert _count(body, "mbarrier.init.shared") == 1 and _count(body, "mbarrier.arrive.expect_tx") == 1
        # its wait traps past the deadline instead of hanging on a wrong byte count
        assert _count(body, "mbarrier.try_wait") == 2 and _count(body, "trap;") == 1
        assert [_count(body, f"barrier.cluster.{op}") for op in ("arrive.relaxed;", "arrive;", "wait")] == [1, 0, 1]
        assert "ld.shared::cluster" not in body
        assert re.search(r"\.minnctapersm\s+[2-8]\b", body)  # ptxas keeps room for several CTAs per SM
        assert pdl_flags(k.spec) == [1]


@needs_cutedsl
@needs_sass_tools
def test_natural_order_dequantizes_in_about_as_many_instructions_as_interleaved(compiled):
    """On sm_100a (where Humming leaves the natural order), both one-token stages in each nibble
    order: the natural order spends at most 3 SASS instructions an MMA more than the interleaved
    (its word's low and high nibbles split once, then PRMT, IMAD, LOP3 a register, as the
    interleaved's LOP3, IMAD, LOP3), where its old per-register extract spent 15 more and spilled."""
    from codegen.sass import summary

    for interleaved, natural in zip(compiled["tp16", "sm_100a"], compiled["native_tp16", "sm_100a"]):
        assert natural.spec.param_dict["order"] == "natural" != interleaved.spec.param_dict["order"]
        ours, theirs = (sass_or_skip(lambda k=k: summary(k.ptx, "sm_100a")[0]) for k in (natural, interleaved))
        mmas = theirs["opcodes"]["HMMA"]
        assert mmas == ours["opcodes"]["HMMA"] > 0 and ours["spill_bytes"] == 0
        assert ours["instructions"] - theirs["instructions"] <= 3 * mmas, (ours["instructions"], theirs["instructions"])


@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_ptx_of_the_stages_per_expert(compiled, arch):
    """Both stages per chosen expert stream their weights: each warp's first ``stages - 1`` scale
    groups issued by cp.async between the wait and launch_dependents (after only the words that
    say which expert: the up stage the plan's chosen count, expert and pair count, the down stage
    the up stage's two records and, in its first CTA, the chosen experts whose counts it zeroes),
    then one group a step through the ring (the up stage 16 MMAs and six
    16-byte shared loads a step, the down stage 8 and four), no barrier inside the loops, no
    cluster; the up stage with no atomics, the down stage with one: a pair's arrival at its
    (token, tile) counter, between acq_rel fences. ptxas asked for as many CTAs an SM as their
    shared memory holds (the up stage's 48 KB: four; the down stage's 3 stages of 8 KB: eight), no
    spill."""
    from conftest import ptxas_usage

    _, up, down = compiled["tp8_by_expert", arch]
    assert (up.spec.param_dict["stages"], down.spec.param_dict["stages"]) == (4, 3)
    for k, fields, mmas, shared_loads, plan_words, ctas in ((up, (4, 2, 4), 16, 6, 3, 4),
                                                            (down, (2, 1, 4), 8, 4, 3, 8)):
        p = k.spec.param_dict
        S = p["stages"]
        w, sc, x = fields  # per scale group: weight vectors (.cg), scale pairs and x words (.ca)
        body = k.ptx[k.ptx.index(".entry"):]
        assert "ld.local" not in body and "st.local" not in body
        assert body.count(WAIT) == 1 and body.count(LAUNCH) == 1
        before, rest = body.split(WAIT)
        between, after = rest.split(LAUNCH)
        assert "ld.global" not in before and "cp.async" not in before
        assert _count(between, "ld.global.b32") == plan_words, k.spec.kernel
        # the prologue's S - 1 groups of weights before launch_dependents; after it the refill of
        # weights for more than 8 pairs, the x of the prologue and one group in the loop
        assert _count(between, "cp.async.cg.shared.global") == w * (S - 1)
        assert _count(between, "cp.async.ca.shared.global") == sc * (S - 1)
        assert _count(after, "cp.async.cg.shared.global") == w * (S - 1) + w
        assert _count(after, "cp.async.ca.shared.global") == sc * (S - 1) + x * (S - 1) + sc + x
        assert body.count(MMA) == mmas and _count(body, "ld.shared.v4") == shared_loads
        assert _count(body, "cp.async.wait_group") == 1 and body.count("mul.rn.bf16x2") == 4 * mmas
        assert "barrier.cluster" not in body and "mapa" not in body
        atomics = re.findall(r"atom\.[\w.]+", body)
        assert atomics == ([] if k is up else ["atom.global.acq_rel.add.u32"]), atomics
        assert re.search(rf"\.minnctapersm\s+{ctas}\b", body) and pdl_flags(k.spec) == [1]
        if arch == "sm_90a":
            registers, spilled = ptxas_usage(k.ptx, arch)
            assert registers <= 65536 // (ctas * 128) and spilled == 0, (registers, spilled)  # CTAs of 4 warps


@needs_cutedsl
def test_stages_keep_their_weights_in_shared_memory_from_a_token_count(kcache):
    """From ``MXFP4_SMEM_WEIGHTS_FROM`` tokens each lane's weight vectors (14 in the up stage, 12
    in the down stage at TP 16) go to shared memory by cp.async (no 128-bit register loads of them
    left), in a commit group a scale group, are read back one K block at a time once their group
    landed, and ptxas is asked for room for more CTAs (7 of the up stage, 8 of the down stage)
    with no spill."""
    from codegen.compiler import compile_kernel
    from conftest import ptxas_usage

    served_from = experts_launcher.MXFP4_SMEM_WEIGHTS_FROM
    assert served_from is not None
    below = spec_for_call(OP, "sm_90a", mxfp4_args(tokens=served_from - 1, inter=256, live=192))[1]
    assert not any("smem_weights" in s.param_dict for s in below)
    specs = spec_for_call(OP, "sm_90a", mxfp4_args(tokens=served_from, inter=256, live=192))[1]
    assert specs == spec_for_call(OP, "sm_90a", mxfp4_args(tokens=64, inter=256, live=192))[1]
    for spec, blocks, ctas in zip(specs, (14, 12), (7, 8)):
        assert spec.param_dict["smem_weights"] is True
        k = compile_kernel(spec, cache=kcache)
        body = k.ptx[k.ptx.index(".entry"):]
        received = spec.param_dict["cluster"] * (2 if spec.kernel == "expert_up_mxfp4" else 1) // 4  # owners' sums
        assert _count(body, "cp.async.cg.shared.global") == blocks
        assert _count(body, "ld.shared.v4") == blocks + received
        assert _count(body, "ld.global.L1::no_allocate.v4.b32") == 0
        # a commit group per scale group, each waited for just before its MMAs: the first
        # group's multiplies run while the later ones land
        assert _count(body, "cp.async.commit_group") == blocks // 2
        assert [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", body)] == list(range(blocks // 2))[::-1]
        assert re.search(rf"\.minnctapersm\s+{ctas}\b", body), spec.kernel
        registers, spilled = ptxas_usage(k.ptx, "sm_90a")
        assert registers <= 65536 // (ctas * 4 * 32) and spilled == 0, (registers, spilled)  # CTAs of 4 warps


@needs_cutedsl
@pytest.mark.parametrize("shape", list(SMALL_TP_SHAPES))
def test_down_stage_at_tp_4_and_below_takes_a_cluster_of_wider_ctas(kcache, shape):
    """At TP 4, 2 and 1 a slot's live K (768 to 3072 channels, 12 blocks a warp) takes 4 to 16
    warps, so the k slots' 64 to 256 warps exceed a cluster of 8 CTAs of 4: the cluster stays at
    8 and its CTAs grow to 8, 16 and 32 warps (at 32, the weights in shared memory at every
    batch: 1024 threads leave 64 registers). The up stage does not change. Both compile without
    a spill, holding room for at least one CTA an SM."""
    from codegen.compiler import compile_kernel
    from conftest import ptxas_usage

    inter, live = SMALL_TP_SHAPES[shape]
    wps = live // 16 // 12
    for tokens in (1, 8, 16):
        up, down = spec_for_call(OP, "sm_90a", mxfp4_args(tokens=tokens, inter=inter, live=live))[1]
        assert (up.param_dict["cluster"], up.param_dict["warps_per_tile"]) == (8, 2)
        assert (down.param_dict["cluster"], down.param_dict["warps_per_slot"]) == (8, wps)
        assert bool(down.param_dict.get("smem_weights")) == (tokens >= experts_launcher.MXFP4_SMEM_WEIGHTS_FROM
                                                               or K * wps // 8 > 16)
    tpl, (_, up_e, down_e) = spec_for_call(MOE, "sm_90a", moe_args(tokens=16, inter=inter, live=live))
    assert tpl.kernel == "routed_moe_mxfp4" and down_e.param_dict["warps_per_slot"] == wps  # the per-pair down stage
    for spec in spec_for_call(OP, "sm_90a", mxfp4_args(tokens=1, inter=inter, live=live))[1]:
        k = compile_kernel(spec, cache=kcache)
        registers, spilled = ptxas_usage(k.ptx, "sm_90a")
        threads = 32 * (4 if spec.kernel == "expert_up_mxfp4" else K * wps // 8)
        assert spilled == 0 and registers * threads <= 65536, (spec.kernel, registers, spilled)


def test_tp_32_computes_the_live_channels_in_whole_tiles():
    """TP 32 leaves each expert 96 live channels a rank (of the 256 vLLM pads to): the kernels
    compute two 64-row tiles (128 channels, the last 32 vLLM's zeros), one 32-wide scale group
    a slot's warp in the down stage, so a cluster of 4 CTAs of 4 slots."""
    assert experts_launcher.kernel_live(96) == 128 and experts_launcher.kernel_live(192) == 192
    for tokens in (1, 8, 16, 64):
        op, args = (OP, mxfp4_args(tokens=tokens, inter=256, live=96)) if tokens < 16 else \
            (MOE, moe_args(tokens=tokens, inter=256, live=96))
        *_, up, down = spec_for_call(op, "sm_90a", args)[1]
        assert up.shape_dict["inter_live"] == down.shape_dict["inter_live"] == 128
    up, down = spec_for_call(OP, "sm_90a", mxfp4_args(inter=256, live=96))[1]
    assert (down.param_dict["cluster"], down.param_dict["warps_per_slot"]) == (4, 1)


# ---------------------------------------------------------------- 4. on the GPU

class Experts:
    """All E experts of one rank in checkpoint layout (random, zero in the padding as vLLM pads)
    and in the layout under test; ``humming`` lays them out with the humming package."""

    def __init__(self, inter, live, fmt, gen, experts=E, latent=L, humming=True):
        self.inter, self.live, self.fmt, self.count = inter, live, fmt, experts
        self.kernel_live = experts_launcher.kernel_live(live)  # the channels the kernels compute: whole tiles
        rows = (torch.arange(inter) < live).repeat(2)
        self.ckpt = {"w13": random_mxfp4(experts, 2 * inter, latent, live_rows=rows.cuda(), generator=gen,
                                         device="cuda", scale_exponent=-7),
                     "w2": random_mxfp4(experts, latent, inter, live_k=live, generator=gen, device="cuda",
                                        scale_exponent=-5)}
        self.laid = {}
        for name, (n, k) in (("w13", (2 * inter, latent)), ("w2", (latent, inter))):
            w, s = self.ckpt[name]
            if humming:
                hw, hs, config = humming_relayout(w, s, n, k)
                assert (config.pad_shape_n, config.pad_shape_k) == (0, 0)
                mine = fmt.from_checkpoint(w, s)
                assert torch.equal(hw, mine[0]) and torch.equal(hs.view(torch.uint8), mine[1].view(torch.uint8)), \
                    f"{name}: Humming's layout differs from rewriter.model.layers.experts'"
                self.laid[name] = (hw, hs)
            else:
                self.laid[name] = fmt.from_checkpoint(w, s)

    def live_part(self, act):
        """The live channels of the kernels' activation, after checking that the rest of its
        tiles (vLLM's zero padding: TP 32's 96 of 128) came out 0."""
        assert not act[..., self.live:].any()
        return act[..., :self.live]

    def args(self, x, weights, ids):
        (w13, s13), (w2, s2) = self.laid["w13"], self.laid["w2"]
        return (x, weights, ids, w13, s13, w2, s2, BETA, LINEAR_BETA, self.fmt.layout, self.live)

    def moe_args(self, x, logits, bias, top_k=K):
        """``k3f::routed_moe_mxfp4``'s: the router's logits and bias for the routing (renormalized
        top-k, scaled by 2.5)."""
        (w13, s13), (w2, s2) = self.laid["w13"], self.laid["w2"]
        return (x, logits, bias, w13, s13, w2, s2, top_k, True, 2.5, BETA, LINEAR_BETA, self.fmt.layout, self.live)

    def reference(self, x, weights, ids):
        """(activation [T, k, I_live], output [T, L]) in fp32 from the checkpoint's values, one
        selected expert at a time (each dequantized once for all its (token, slot) pairs: a
        per-token loop allocated k experts' fp32 weights per token, about 30 GB at 64 tokens,
        which outran the H200's memory under compute-sanitizer, where frees lag)."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        act = torch.empty(tokens * k, self.live, dtype=torch.bfloat16, device=x.device)
        down = torch.empty(tokens * k, x.shape[1], device=x.device)
        for e in torch.unique(flat).tolist():
            pairs = (flat == e).nonzero().squeeze(1)
            w13 = CHECKPOINT.dequant(*(c[e] for c in self.ckpt["w13"]), torch.float32)
            gate_up = (x[pairs // k].float() @ w13.T).bfloat16().float()
            g, u = gate_up[:, :self.inter], gate_up[:, self.inter:]
            a = BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * LINEAR_BETA * torch.tanh(u / LINEAR_BETA)
            act[pairs] = a.bfloat16()[:, :self.live]
            w2 = CHECKPOINT.dequant(*(c[e] for c in self.ckpt["w2"]), torch.float32)
            down[pairs] = act[pairs].float() @ w2[:, :self.live].T
        out = (down.view(tokens, k, -1) * weights.float().unsqueeze(-1)).sum(1)
        return act.view(tokens, k, self.live), out


def routing(tokens, gen, experts=E, top_k=K, crowded=None):
    """Random top-k ids (distinct per token) with routing weights summing to 1; ``crowded``: an
    expert every token picks in slot 1 (its pairs fill several 8-column passes)."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if crowded is not None:
        ids = torch.stack([torch.cat([torch.tensor([crowded]), row[row != crowded][:top_k - 1]]).roll(1)
                           for row in ids])
    ids[0, 0] = experts - 1  # the last expert: its rows lie past 2^31 bytes of w13 at TP 8
    scores = torch.sigmoid(torch.randn(tokens, top_k, generator=gen))
    return (scores / scores.sum(-1, keepdim=True)).cuda(), ids.cuda()


def check(experts, tokens, gen, crowded=None):
    """The per-pair grids on a random routing, against the reference."""
    x = torch.randn(tokens, L, generator=gen).bfloat16().cuda()
    weights, ids = routing(tokens, gen, experts=experts.count, crowded=crowded)
    args = experts.args(x, weights, ids)
    tpl, specs, fns = gpu_kernels(OP, args)
    y = torch.full((tokens, L), float("nan"), dtype=torch.bfloat16, device="cuda")
    act = torch.full((tokens, K, experts.kernel_live), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = tpl.launch(fns, specs, args, out=(y, act))
    torch.cuda.synchronize()
    ref_act, ref = experts.reference(x, weights, ids)
    assert out is y and torch.isfinite(act).all() and torch.isfinite(y).all()
    assert rel_err(experts.live_part(act), ref_act) <= TOL
    assert rel_err(y, ref) <= TOL
    assert "by_expert_max_tokens" not in specs[0].param_dict


@pytest.fixture(scope="module", params=list(SHAPES))
def humming_experts(request):
    inter, live = SHAPES[request.param]
    return Experts(inter, live, HUMMING, torch.Generator(device="cuda").manual_seed(inter))


@on_gpu
@pytest.mark.parametrize("tokens", [1, 8, 15, 16, 64])
def test_kernels_read_the_layout_humming_leaves(humming_experts, tokens):
    """The served grids: one CTA cluster per (token, slot) pair."""
    check(humming_experts, tokens, torch.Generator().manual_seed(tokens))


@on_gpu
@pytest.mark.parametrize("shape", list(OTHER_TP_SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_kernels_at_other_tp_sizes(shape, tokens):
    """TP 4, 2 and 1 (a down-stage CTA of 8, 16 or 32 warps), 32 (96 live channels in two tiles,
    the rest of them zero), 3, 12 and 48 on 64 experts, in Humming's layout: the per-pair grids,
    and at 16 tokens the router's plan with the per-pair down stage."""
    inter, live = OTHER_TP_SHAPES[shape]
    # the relayout's int64 codes of w13 and w2 at once, and the reference's fp32 rows
    with alone_if_large(64 * 3 * inter * L * (8 + 4)):
        experts = Experts(inter, live, HUMMING, torch.Generator(device="cuda").manual_seed(inter), experts=64)
        gen = torch.Generator().manual_seed(tokens)
        if tokens < 16:
            check(experts, tokens, gen)
        else:
            check_moe(experts, tokens, gen, steps=1)
        del experts


def routing_logits(ids, gen, experts=E):
    """Router logits [T, E] and a small correction bias whose top-k are ``ids`` (each id's logit
    6..7, the rest about -6: the margin dwarfs the bias and the kernel's sigmoid error)."""
    tokens, k = ids.shape
    logits = torch.randn(tokens, experts, generator=gen) * 0.5 - 6
    logits.scatter_(1, ids.cpu(), 6 + torch.rand(tokens, k, generator=gen))
    return logits.cuda(), (torch.randn(experts, generator=gen) * 0.01).cuda()


def moe_step(experts, x, logits, bias, top_k=K):
    """``k3f::routed_moe_mxfp4`` on the kernels, outputs poisoned first: (y, activation), and the
    reference routing (weights, ids) the checks hold them to."""
    args = experts.moe_args(x, logits, bias, top_k)
    tpl, specs, fns = gpu_kernels(MOE, args)
    assert tpl.kernel == "routed_moe_mxfp4" and "plan_cap" in specs[0].param_dict
    y = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    act = torch.full((x.shape[0], top_k, experts.kernel_live), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert tpl.launch(fns, specs, args, out=(y, act)) is y
    torch.cuda.synchronize()
    # the down stage left the plan's counts at zero for the next step's router
    counts = experts_launcher.routing_plan(x.device, logits.shape[1], specs[0].param_dict["plan_cap"])[0]
    assert not counts.any(), counts.nonzero()
    # and, after the per-expert down stage, every (token, tile) arrival counter (each last arrival
    # put its own back)
    cap = specs[2].param_dict.get("by_expert_max_tokens")
    if cap is not None:
        arrivals = experts_launcher.arrival_counts(x.device, cap, x.shape[1] // 64)
        assert not arrivals.any(), arrivals.nonzero()
    weights, ids = route(logits.cpu(), bias.cpu(), top_k=top_k, renormalize=True, scaling=2.5)
    return y, act, weights.cuda(), ids.cuda()


def check_moe(experts, tokens, gen, crowded=None, steps=2):
    """``steps`` steps in a row on fresh routings (the plan the router fills must be empty again
    after each), every one against the reference."""
    for _ in range(steps):
        x = torch.randn(tokens, L, generator=gen).bfloat16().cuda()
        ids = routing(tokens, gen, experts=experts.count, crowded=crowded)[1]
        y, act, weights, ids = moe_step(experts, x, *routing_logits(ids, gen, experts=experts.count))
        ref_act, ref = experts.reference(x, weights, ids)
        assert torch.isfinite(act).all() and torch.isfinite(y).all()
        assert rel_err(experts.live_part(act), ref_act) <= TOL and rel_err(y, ref) <= TOL


@on_gpu
@pytest.mark.parametrize("tokens", [16, 64])
def test_moe_grids_read_the_layout_humming_leaves(humming_experts, tokens):
    """The router's plan, both stages per chosen expert, two steps in a row."""
    check_moe(humming_experts, tokens, torch.Generator().manual_seed(tokens))


@on_gpu
@pytest.mark.parametrize("tokens", [17, 64])
def test_moe_grids_run_an_experts_pairs_eight_at_a_time(humming_experts, tokens):
    """Every token picks expert 5: 17 and 64 pairs of one expert, three and eight passes of the
    MMA's 8 columns, the last one partly empty at 17."""
    check_moe(humming_experts, tokens, torch.Generator().manual_seed(100 + tokens), crowded=5)


@on_gpu
def test_per_expert_grid_agrees_with_the_per_pair_kernel(humming_experts):
    """The per-pair and per-expert grids run the same MMAs on the same words, summed in another
    order (the up stage: four warps' quarters of L against sixteen runs of 14 blocks; the down
    stage: the k slots in slot order against a cluster's), so activations and outputs differ only
    by that rounding, whatever place the plan's atomics gave each pair."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(24, L, generator=gen).bfloat16().cuda()
    y_moe, act_moe, weights, ids = moe_step(humming_experts, x, *routing_logits(routing(24, gen, crowded=3)[1], gen))
    args = humming_experts.args(x, weights, ids)
    tpl, specs, fns = gpu_kernels(OP, args)
    y = torch.full((24, L), float("nan"), dtype=torch.bfloat16, device="cuda")
    act = torch.full((24, K, humming_experts.live), float("nan"), dtype=torch.bfloat16, device="cuda")
    tpl.launch(fns, specs, args, out=(y, act))
    torch.cuda.synchronize()
    assert torch.isfinite(act).all() and torch.isfinite(act_moe).all() and rel_err(act_moe, act) <= 2e-3
    assert torch.isfinite(y_moe).all() and rel_err(y_moe, y) <= 2e-3


@on_gpu
@pytest.mark.parametrize("tokens", [16, 64])  # the down stage per pair, per chosen expert
def test_moe_op_in_a_cuda_graph(humming_experts, tokens, monkeypatch):
    """Through ``install_cuda_kernels``, captured with no eager step before, as vLLM serves it
    (the plan made by ``make_workspaces``, the kernels loaded by ``prepare``), then replayed on
    new x and logits three times: the plan is filled and emptied on the GPU."""
    from codegen import bind
    from codegen.templates import make_workspaces

    bind.install_cuda_kernels()
    monkeypatch.setattr(experts_launcher, "_plans", {})
    monkeypatch.setattr(experts_launcher, "_arrivals", {})
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, L, generator=gen).bfloat16().cuda()
    logits, bias = routing_logits(routing(tokens, gen)[1], gen)
    args = humming_experts.moe_args(x, logits, bias)
    per_expert_down = tokens >= experts_launcher.MXFP4_DOWN_BY_EXPERT_FROM  # with its arrival counts
    assert make_workspaces(spec_for_call(MOE, "sm_90a", args)[1], x.device) == 1 + per_expert_down
    assert bind.registered()[MOE].prepare(*args) is None
    before = bind.stats().get(MOE, {}).get("kernel", 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.k3f.routed_moe_mxfp4(*args)
    assert bind.stats()[MOE]["kernel"] == before + 1
    for _ in range(3):
        x.copy_(torch.randn(tokens, L, generator=gen).bfloat16())
        new_logits, new_bias = routing_logits(routing(tokens, gen)[1], gen)
        logits.copy_(new_logits)
        bias.copy_(new_bias)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = route(logits.cpu(), bias.cpu(), top_k=K, renormalize=True, scaling=2.5)
        assert torch.isfinite(y).all()
        assert rel_err(y, humming_experts.reference(x, weights.cuda(), ids.cuda())[1]) <= TOL


@on_gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_stages_with_weights_in_shared_memory(humming_experts, tokens, monkeypatch):
    """Both stages with their weights staged in shared memory: the same MMAs on the same words, so
    activations and outputs bit-identical to the register form's."""
    gen = torch.Generator().manual_seed(40 + tokens)
    x = torch.randn(tokens, L, generator=gen).bfloat16().cuda()
    weights, ids = routing(tokens, gen)
    args = humming_experts.args(x, weights, ids)
    outs = []
    for smem in (False, True):
        monkeypatch.setattr(experts_launcher, "MXFP4_SMEM_WEIGHTS_FROM", 1 if smem else None)
        tpl, specs, fns = gpu_kernels(OP, args)
        assert [bool(s.param_dict.get("smem_weights")) for s in specs] == [smem, smem]
        y = torch.full((tokens, L), float("nan"), dtype=torch.bfloat16, device="cuda")
        act = torch.full((tokens, K, humming_experts.live), float("nan"), dtype=torch.bfloat16, device="cuda")
        tpl.launch(fns, specs, args, out=(y, act))
        torch.cuda.synchronize()
        outs.append((act, y))
    (act0, y0), (act1, y1) = outs
    assert torch.isfinite(act1).all() and torch.equal(act0, act1)
    assert torch.isfinite(y1).all() and torch.equal(y0, y1)
    assert rel_err(y1, humming_experts.reference(x, weights, ids)[1]) <= TOL


@on_gpu
def test_served_format_reads_hummings_own_layer_configs():
    """The LayerConfigs Humming's transform returns (what vLLM keeps as ``humming_configs``) say
    Humming's sm_90 layout to ``served_expert_format``."""
    from types import SimpleNamespace

    from rewriter.vllm.experts import served_expert_format

    configs = {}
    for name, (n, k) in (("w13", (512, L)), ("w2", (L, 256))):
        configs[name] = humming_relayout(*random_mxfp4(4, n, k, device="cuda"), n, k)[2]
    module = SimpleNamespace(quant_method=SimpleNamespace(mxfp4_backend=SimpleNamespace(name="HUMMING")),
                             humming_configs=configs)
    assert served_expert_format(module) == HUMMING


@on_gpu
def test_natural_nibble_order():
    """Humming's native-dequant order (sm_100 with a recent NVRTC), laid out by our transform
    (no sm_100 here to let Humming do it) and read by the kernels' natural-order path on sm_90."""
    inter, live = SHAPES["tp16"]
    experts = Experts(inter, live, NATIVE, torch.Generator(device="cuda").manual_seed(5), humming=False)
    check(experts, 8, torch.Generator().manual_seed(6))


@on_gpu
def test_op_dispatches_to_the_kernels_in_a_cuda_graph(humming_experts):
    """Through ``install_cuda_kernels``, captured; new x / routing copied in and replayed: the
    ids are read on the GPU at replay time."""
    from codegen import bind

    bind.install_cuda_kernels()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, L, generator=gen).bfloat16().cuda()
    args = list(humming_experts.args(x, *routing(8, gen)))
    torch.ops.k3f.routed_experts_mxfp4(*args)  # compiles and loads outside the capture
    before = bind.stats()[OP]["kernel"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.k3f.routed_experts_mxfp4(*args)
    assert bind.stats()[OP]["kernel"] == before + 1
    x2 = torch.randn(8, L, generator=gen).bfloat16().cuda()
    weights, ids = routing(8, gen)
    for dst, src in zip(args[:3], (x2, weights, ids)):
        dst.copy_(src)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    assert rel_err(y, humming_experts.reference(x2, weights, ids)[1]) <= TOL


@on_gpu
@pytest.mark.parametrize("tokens,grid", [(1, "pair"), (8, "pair"), (16, "pair"), (64, "pair"), (16, "expert"),
                                         (64, "expert")])  # per expert at 64: about 16 pairs per expert
def test_kernels_at_the_tiny_configs_shapes(tokens, grid):
    """The tiny preset's experts (E 16, top-4, L 64, I 64: one CTA, no cluster, 4 K blocks a warp),
    which the templates accept, against the op's own reference on the same tensors (per expert:
    ``routed_moe_mxfp4``, two steps). The decode gate (``python -m rewriter decode --model tiny``)
    saw the MXFP4 layer's logits differ by about 1x from step 1 on 2026-12-01; this pins it to the
    kernels or clears them. Humming itself pads shapes this small (pad_shape_n 128, pad_shape_k 64,
    which ``served_expert_format`` refuses in vLLM), so the tensors are laid out unpadded by
    ``ExpertFormat`` as the decode gate does."""
    tiny = KimiK3Config.preset("tiny")
    e, k, lat, inter = tiny.num_experts, tiny.num_experts_per_token, tiny.moe_hidden_size, tiny.moe_intermediate_size
    experts = Experts(inter, inter, HUMMING, torch.Generator(device="cuda").manual_seed(3), experts=e, latent=lat,
                      humming=False)
    gen = torch.Generator().manual_seed(tokens)
    for _ in range(2 if grid == "expert" else 1):
        x = torch.randn(tokens, lat, generator=gen).bfloat16().cuda()
        weights, ids = routing(tokens, gen, experts=e, top_k=k)
        if grid == "expert":
            y, _, weights, ids = moe_step(experts, x, *routing_logits(ids, gen, experts=e), top_k=k)
        else:
            args = experts.args(x, weights, ids)
            tpl, specs, fns = gpu_kernels(OP, args)
            y = torch.full((tokens, lat), float("nan"), dtype=torch.bfloat16, device="cuda")
            act = torch.full((tokens, k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            tpl.launch(fns, specs, args, out=(y, act))
            torch.cuda.synchronize()
        ref = torch.ops.k3f.routed_experts_mxfp4(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                                   for a in experts.args(x, weights, ids)])
        assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL
