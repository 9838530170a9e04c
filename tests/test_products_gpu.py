"""Kernels generated for fused ops made of matrix products (``codegen.lowered.Products`` ->
``codegen/kernels/product_gemv.py`` and ``product_gemm.py``): that each class of stage compiles
for sm_90a and sm_100a with the PTX its main loop promises, and, on a GPU, that the kernels match the program and the
reference on fresh random inputs, alone and inside a CUDA graph."""
from __future__ import annotations

import re

import pytest
import torch

from codegen.host import host
from codegen.launchers.generated import stages_of
from codegen.lowered import Products, interpret_products
from codegen.templates import spec_for_call
from conftest import divergent_warp_collectives, gpu_kernels, needs_cutedsl, on_gpu, rel_err
from rewriter.compiler.rules import fused_op
from rewriter.model.layers.common import rms_norm, silu_and_mul, situ_and_mul
from rewriter.model.layers.experts import ExpertFormat, random_mxfp4

F = torch.nn.functional
k3 = torch.ops.k3


# ---- the probes: one fused op per class of stage ------------------------------------------------
@fused_op("products_probe_norm_proj_res")
def _norm_proj_res(x: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A norm prologue (a reduction over K), one product, a residual epilogue: the latent tail."""
    return F.linear(rms_norm(x, norm_weight, 1e-6), w) + r


@fused_op("products_probe_mlp")
def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Two stages: a packed gate-and-up weight as two products meeting in a SiLU epilogue, then down."""
    return F.linear(silu_and_mul(F.linear(x, gate_up)), down)


@fused_op("products_probe_short_k_mlp")
def _short_k_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The shared experts' shape at TP 16: a down projection of K 384 (48 vectors), which 16-lane
    groups of the GEMV fill where a warp's 32 lanes would not."""
    return F.linear(silu_and_mul(F.linear(x, gate_up)), down)


@fused_op("products_probe_situ_mlp")
def _situ_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(situ_and_mul(F.linear(x, gate_up), 6.0, 12.0), down)


@fused_op("products_probe_scaled_two_outputs")
def _scaled(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor) -> list[torch.Tensor]:
    """A plain activation, an epilogue reading a column and a statistic, two outputs (fp32 and bf16)."""
    y = F.linear(x, w).float() * scale.float()
    return [y, (y * torch.sigmoid(gate.float())).to(torch.bfloat16)]


@fused_op("products_probe_add_norm_proj")
def _add_norm_proj(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                   w: torch.Tensor) -> list[torch.Tensor]:
    """A prologue that adds the residual, returns the sum (written by the prologue) and norms it."""
    h = (x.float() + residual.float()).to(torch.bfloat16)
    return [F.linear(rms_norm(h, norm_weight, 1e-5), w), h]


@fused_op("products_probe_mlp_all_reduced")
def _mlp_all_reduced(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The dense MLP's shape: the all-reduce last (one rank here: the partial is the result)."""
    return torch.ops.k3.all_reduce(F.linear(silu_and_mul(F.linear(x, gate_up)), down), "tp", 1)


@fused_op("products_probe_projections")
def _projections(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """Several widths from one packed weight (an input projection's q, k, gates): one kernel of
    three parts on the GEMM, a part narrower than a tile (6 columns) among them."""
    q, k, g = F.linear(x, w).split([1024, 320, 6], dim=-1)
    return [q.clone(), k.clone(), torch.sigmoid(g.float())]  # clone: at one token a split is contiguous


@fused_op("products_probe_two_weights")
def _two_weights(x: torch.Tensor, w1: torch.Tensor, r: torch.Tensor, w2: torch.Tensor,
                 scale: torch.Tensor) -> list[torch.Tensor]:
    """Two weights of different widths, each part with epilogue inputs of its own."""
    return [F.linear(x, w1) + r, (F.linear(x, w2).float() * scale.float()).to(torch.bfloat16)]


@fused_op("products_probe_router")
def _router(x: torch.Tensor, gate: torch.Tensor, down: torch.Tensor) -> list[torch.Tensor]:
    """The router's shape at TP 16: fp32 logits of 56 rows (narrower than a GEMM tile) beside a
    bf16 projection of 224, one activation."""
    return [F.linear(x.float(), gate.float()), F.linear(x, down)]


@fused_op("products_probe_fp8_per_channel")
def _fp8_per_channel(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 E4M3 weight rows with a per-channel scale, a SiLU epilogue."""
    return F.silu(F.linear(x.float(), w.float() * scale)).to(torch.bfloat16)


@fused_op("products_probe_fp8_per_tensor")
def _fp8_per_tensor(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp8 E4M3 weight rows with one scale, a residual epilogue."""
    return F.linear(x, w.to(torch.bfloat16)) * scale + r


@fused_op("products_probe_o_proj_residual_norm")
def _o_proj_residual_norm(o: torch.Tensor, w: torch.Tensor, r: torch.Tensor, nw: torch.Tensor) -> list[torch.Tensor]:
    """o_proj's partial sums all-reduced (one rank here), then the residual add and the norm: a
    tail program after the collective."""
    h = torch.ops.k3.all_reduce(F.linear(o, w), "tp", 1) + r
    return [rms_norm(h, nw, 1e-5), h]


@fused_op("products_probe_layer_norm_proj_gelu")
def _layer_norm_proj_gelu(x: torch.Tensor, nw: torch.Tensor, nb: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A LayerNorm (mean and variance: PyTorch's decomposition) as the prologue, GELU as the epilogue."""
    return F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],), nw, nb, 1e-5), w))


@fused_op("products_probe_proj_residual_norm")
def _proj_residual_norm(o: torch.Tensor, w: torch.Tensor, r: torch.Tensor, nw: torch.Tensor) -> list[torch.Tensor]:
    """A projection, its residual add and the norm of the sum on one rank: the norm reduces the
    product's row, so a tail program computes it from the sum the stage writes."""
    h = F.linear(o, w) + r
    return [rms_norm(h, nw, 1e-5), h]


@fused_op("products_probe_proj_head_norm")
def _proj_head_norm(x: torch.Tensor, w: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """A projection, then an RMSNorm of each of its heads (a [T, H, D] view: Qwen3's q norm): the
    norm reduces the product's row, so a tail program over the heads computes it."""
    q = F.linear(x, w)
    return rms_norm(q.view(q.shape[0], -1, nw.shape[0]), nw, 1e-6).view(q.shape)


@fused_op("products_probe_batched_proj_norm")
def _batched_proj_norm(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """Activations as [batch, sequence, features] (a model written for prefill): the tokens span
    two dims; a projection, its residual and PyTorch's RMSNorm of the sum (a tail program)."""
    return F.rms_norm(F.linear(x, w) + r, (w.shape[0],), nw, 1e-6)


@fused_op("products_probe_proj_bias_gelu")
def _proj_bias_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with a bias (aten.addmm: the bias added to the fp32 sums), then GELU."""
    return F.gelu(F.linear(x, w, b))


@fused_op("products_probe_mxfp4_mlp")
def _mxfp4_mlp(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
               down_scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights in Humming's layout (what vLLM leaves on Hopper), dequantized as the GEMM reads
    them: a packed gate-and-up projection meeting in a SiLU epilogue, then down."""
    gate_up_rows = k3.mxfp4_dequant(gate_up, gate_up_scale, "humming")
    return F.linear(silu_and_mul(F.linear(x, gate_up_rows)), k3.mxfp4_dequant(down, down_scale, "humming"))


def mxfp4_weight(n: int, k: int, device: str, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An [N, K] MXFP4 weight in Humming's layout: random codes, scales around 2^-6 (real weights'),
    as (codes int32 [K/16, 2N], scales E8M0 [K/32, N])."""
    fmt = ExpertFormat.parse("mxfp4/humming")
    if device == "meta":
        return tuple(torch.empty(shape[1:], dtype=dtype, device="meta") for shape, dtype in
                     (fmt.tensors(1, n, k)["weight"], fmt.tensors(1, n, k)["weight_scale"]))
    codes, scales = fmt.from_checkpoint(*random_mxfp4(1, n, k, generator=gen))
    return codes[0].to(device), scales[0].to(device)


def _args(name: str, tokens: int, device: str, gen: torch.Generator | None):
    def t(*shape, dtype=torch.bfloat16, positive=False):
        if device == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        x = torch.randn(shape, generator=gen)
        return (x.abs() + 0.5 if positive else x).to(dtype).to(device)

    if name == "norm_proj_res":
        return (t(tokens, 3584), t(3584, positive=True), t(2048, 3584) * 0.05 if device != "meta" else
                t(2048, 3584), t(tokens, 2048))
    if name in ("mlp", "situ_mlp", "mlp_all_reduced"):
        return (t(tokens, 2048), t(2 * 768, 2048), t(2048, 768))
    if name == "short_k_mlp":
        return (t(tokens, 1024), t(2 * 384, 1024), t(2048, 384))
    if name.startswith("fp8"):
        w = t(1536, 2048, dtype=torch.float32).to(torch.float8_e4m3fn) if device != "meta" else \
            t(1536, 2048, dtype=torch.float8_e4m3fn)
        if name == "fp8_per_channel":
            return (t(tokens, 2048), w, t(1536, 1, dtype=torch.float32, positive=True) * 0.02)
        return (t(tokens, 2048), w, t(1, dtype=torch.float32, positive=True) * 0.02, t(tokens, 1536))
    if name in ("o_proj_residual_norm", "proj_residual_norm"):
        return (t(tokens, 2048), t(1024, 2048), t(tokens, 1024), t(1024, positive=True))
    if name == "router":
        return (t(tokens, 1024), t(56, 1024), t(224, 1024))
    if name == "batched_proj_norm":
        return (t(1, tokens, 2048), t(1024, 2048), t(1, tokens, 1024), t(1024, positive=True))
    if name == "proj_head_norm":
        return (t(tokens, 1024), t(2048, 1024), t(128, positive=True))
    if name == "proj_bias_gelu":
        return (t(tokens, 2048), t(1536, 2048), t(1536))
    if name == "layer_norm_proj_gelu":
        return (t(tokens, 2048), t(2048, positive=True), t(2048), t(1536, 2048))
    if name == "mxfp4_mlp":
        return (t(tokens, 1024), *mxfp4_weight(2 * 1024, 1024, device, gen), *mxfp4_weight(1024, 1024, device, gen))
    if name == "projections":
        return (t(tokens, 1024), t(1350, 1024))
    if name == "two_weights":
        return (t(tokens, 1024), t(768, 1024), t(tokens, 768), t(200, 1024), t(200, positive=True))
    if name == "scaled_two_outputs":
        return (t(tokens, 1024), t(1536, 1024), t(1536, positive=True), t(tokens, 1, dtype=torch.float32))
    return (t(tokens, 1024), t(tokens, 1024), t(1024, positive=True), t(1536, 1024))


PROBES = ["norm_proj_res", "mlp", "short_k_mlp", "situ_mlp", "scaled_two_outputs", "add_norm_proj", "mlp_all_reduced",
          "projections", "two_weights", "router", "fp8_per_channel", "fp8_per_tensor", "o_proj_residual_norm",
          "mxfp4_mlp", "layer_norm_proj_gelu", "proj_residual_norm", "proj_bias_gelu", "proj_head_norm",
          "batched_proj_norm"]
# a row reduced after its product: a tail program
TAILED = {"o_proj_residual_norm", "proj_residual_norm", "proj_head_norm", "batched_proj_norm"}
STAGES = {"mlp": 2, "short_k_mlp": 2, "situ_mlp": 2, "mlp_all_reduced": 2, "mxfp4_mlp": 2}
PARTS = {"projections": 3, "two_weights": 2, "router": 2}  # stages of one activation: the parts of one kernel
# a prologue that computes: staged in the GEMV at one token; from two, a rowwise kernel of its own
# before the GEMM
COMPUTED_PROLOGUE = {"norm_proj_res", "add_norm_proj", "layer_norm_proj_gelu"}
GEMM_ONLY = {"mxfp4_mlp"}  # MXFP4 weights: the GEMM main loop at every token count


@pytest.mark.parametrize("name", PROBES)
@pytest.mark.parametrize("tokens", [1, 8])
def test_every_probe_takes_the_generated_product_template(name, tokens):
    """One token: the GEMV main loop; more: the tensor-core GEMM's, where the prologue only reads
    (MXFP4 weights: the GEMM's at every token count)."""
    tpl, specs = spec_for_call(f"k3f::products_probe_{name}", "sm_90a", _args(name, tokens, "meta", None))
    assert tpl is not None and tpl.kernel == "products", specs
    module = "product_gemv" if tokens == 1 and name not in GEMM_ONLY else "product_gemm"
    hoisted = ["rowwise"] if tokens > 1 and name in COMPUTED_PROLOGUE else []
    # the residual add and norm after the all-reduce; the norm of a product's row
    tail = ["rowwise"] if name in TAILED else []
    assert [s.module for s in specs] == (hoisted + [module]) * STAGES.get(name, 1) + tail
    assert len(stages_of(specs[-1 - len(tail)])) == PARTS.get(name, 1)


@pytest.mark.parametrize("name", PROBES)
def test_every_probe_lowers_to_what_its_reference_computes(name):
    """On the CPU: the stages the kernels run, interpreted, against the reference."""

    gen = torch.Generator().manual_seed(len(name))
    args = _args(name, 8, "cpu", gen)
    products = host().lower(f"k3f::products_probe_{name}", args)
    assert isinstance(products, Products), products
    got = interpret_products(products, [a for a in args if torch.is_tensor(a)])
    ref = getattr(torch.ops.k3f, f"products_probe_{name}")(*args)
    for g, r in zip(got, ref if isinstance(ref, (list, tuple)) else [ref], strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape and rel_err(g, r) < 1e-2, (name, rel_err(g, r))


# what each main loop's PTX holds: streamed 128-bit weight loads and butterflies (GEMV); cp.async
# into shared memory, ldmatrix and the bf16 MMA (GEMM)
PROMISES = {"product_gemv": ("ld.global.L1::no_allocate.L2::256B.v", "shfl.sync.bfly"),
            "product_gemm": ("cp.async.cg.shared.global", "ldmatrix.sync.aligned.m8n8.x4",
                             "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
            "rowwise": ("ld.global.v4",)}


@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name,tokens", [("norm_proj_res", 1), ("mlp", 1), ("mlp", 8), ("scaled_two_outputs", 64),
                                         ("add_norm_proj", 5), ("situ_mlp", 17), ("projections", 1),
                                         ("projections", 8), ("two_weights", 1), ("two_weights", 64),
                                         ("fp8_per_channel", 8), ("fp8_per_tensor", 1),
                                         ("o_proj_residual_norm", 8), ("short_k_mlp", 1), ("mxfp4_mlp", 1),
                                         ("mxfp4_mlp", 64), ("layer_norm_proj_gelu", 1), ("layer_norm_proj_gelu", 8),
                                         ("proj_bias_gelu", 1), ("proj_bias_gelu", 8), ("proj_residual_norm", 8),
                                         ("proj_head_norm", 1), ("proj_head_norm", 8), ("batched_proj_norm", 8)])
def test_generated_product_kernels_compile_with_the_ptx_their_class_promises(kcache, arch, name, tokens):
    """The main loop's instructions, PDL, no local memory (a spill), no warp-wide instruction in a
    branch some of a warp's lanes skip."""
    from codegen.compiler import compile_kernel

    _, specs = spec_for_call(f"k3f::products_probe_{name}", arch, _args(name, tokens, "meta", None))
    for spec in specs:
        ptx = compile_kernel(spec, cache=kcache).ptx
        mxfp4 = name.startswith("mxfp4")  # its A fragments come from registers, not ldmatrix
        for promised in PROMISES[spec.module]:
            assert promised in ptx or (mxfp4 and promised.startswith("ldmatrix")), (spec.module, promised)
        if name.startswith("fp8"):  # the GEMV: 8 weights a 64-bit load; both: converted in pairs
            assert "e4m3x2" in ptx
            assert spec.module == "product_gemm" or "ld.global.L1::no_allocate.L2::256B.v2.b32" in ptx
        if mxfp4:  # codes by 16-byte copies, their rows' scales by 8-byte ones, bf16 pairs straight into the MMA
            assert re.search(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 8, 8;", ptx)
            assert ptx.count("mul.rn.bf16x2") >= 4 and "0x7E807E80" in ptx
            assert "ldmatrix" not in ptx  # no bf16 weight ring
        assert "griddepcontrol.wait" in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx
        assert not divergent_warp_collectives(ptx), spec.label()


@needs_cutedsl
def test_every_mxfp4_tiling_the_launcher_offers_is_one_the_kernel_takes():
    """The MXFP4 main loop splits a tile's warps over token groups and K blocks: at every token
    count (one and two token groups, 64- and 128-row tiles) the kernel accepts the launcher's
    tiling; 17 tokens on 64-row tiles (8 warps for one tile) once asked for 8 K splits of 4."""
    from codegen.kernels.product_gemm import build

    seen = set()
    for tokens in range(1, 65):
        _, specs = spec_for_call("k3f::products_probe_mxfp4_mlp", "sm_90a", _args("mxfp4_mlp", tokens, "meta", None))
        for spec in specs:
            kernel, _ = build(spec)
            assert kernel.k_ways * kernel.n_ways * kernel.products * kernel.humming_tiles == kernel.threads // 32
            seen.add((spec.param_dict["rows_per_cta"], spec.param_dict["token_groups"]))
    assert {(64, 1), (64, 2), (128, 2), (128, 1)} <= seen


@needs_cutedsl
def test_a_short_k_is_spread_over_16_lane_groups(kcache):
    """K 384 is 48 vectors: 16 lanes of 3 each, two columns a lane group and four a warp, one
    4-step butterfly a sum; K 768 (96 vectors) keeps the whole warp."""
    from codegen.compiler import compile_kernel

    _, (up, down) = spec_for_call("k3f::products_probe_short_k_mlp", "sm_90a", _args("short_k_mlp", 1, "meta", None))
    assert (down.param_dict["lanes"], down.param_dict["cols"], down.param_dict["ksplit"]) == (16, 2, 1)
    assert "lanes" not in up.param_dict
    _, (_, wide) = spec_for_call("k3f::products_probe_mlp", "sm_90a", _args("mlp", 1, "meta", None))
    assert "lanes" not in wide.param_dict
    ptx = compile_kernel(down, cache=kcache).ptx
    assert ptx.count("ld.global.L1::no_allocate.L2::256B.v4") == 2 * 3  # two rows of 3 vectors a lane, once
    bfly = [int(m) for m in re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+),", ptx)]
    assert sorted(set(bfly)) == [1, 2, 4, 8] and len(bfly) == 2 * 4  # a 16-lane butterfly for each column


@pytest.fixture(scope="module")
def kimi_k3():
    from rewriter.compiler.plan import install_host
    from rewriter.model.config import KimiK3Config

    install_host()
    return KimiK3Config.load("kimi-k3")


# Kimi K3's fused ops the lowering takes, and the layer each is in
OWN_OPS = {"kda_in_proj": 0, "dense_mlp": 0, "shared_experts": 1, "router_down": 1, "mla_in_proj": 3}


@needs_cutedsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("tp,batch", [(16, 1), (8, 1), (16, 8), (8, 64)])
@pytest.mark.parametrize("op", sorted(OWN_OPS))
def test_kimi_k3s_own_fused_ops_generate_kernels_at_their_served_shapes(kcache, kimi_k3, op, tp, batch, arch):
    """The fused ops of the built-in rules, lowered from their references at the rewritten
    layer's shapes: one kernel for all of an input projection's widths (its parts), the
    router's two projections in one, the MLPs' two stages; every kernel compiles with its main
    loop's instructions and no local memory."""
    from codegen.compiler import compile_kernel
    from codegen.launchers.generated import PRODUCTS
    from rewriter.commands.bench_ops import _fused_calls

    (name, fake, _), = _fused_calls(kimi_k3, OWN_OPS[op], tp, batch, arch, [op])
    specs = PRODUCTS.make_specs(name, arch, fake)
    assert not isinstance(specs, str), specs
    kernels = {"kda_in_proj": 1, "mla_in_proj": 1, "router_down": 1, "shared_experts": 2,
               "dense_mlp": 2}[op]
    assert len(specs) == kernels, [s.label() for s in specs]
    for spec in specs:
        assert spec.module == ("product_gemv" if batch == 1 else "product_gemm")
        ptx = compile_kernel(spec, cache=kcache).ptx
        for promised in PROMISES[spec.module]:
            assert promised in ptx, (spec.label(), promised)
        assert "ld.local" not in ptx and "st.local" not in ptx, spec.label()


@on_gpu
@pytest.mark.parametrize("name", PROBES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 64])
def test_generated_products_match_program_and_reference(name, tokens):
    """Fresh random inputs, outputs poisoned by the allocator's reuse, alone and in a CUDA graph;
    GEMV (1 token), GEMM at a full and at a partial token tile (17 of 32)."""
    gen = torch.Generator().manual_seed(tokens * 131 + len(name))
    args = _args(name, tokens, "cuda", gen)
    op = f"k3f::products_probe_{name}"
    tpl, specs, fns = gpu_kernels(op, args)
    want = interpret_products(host().lower(op, args), [a for a in args if torch.is_tensor(a)])
    ref = getattr(torch.ops.k3f, op.split("::")[1])(*[a.cpu() for a in args])
    ref = ref if isinstance(ref, (list, tuple)) else [ref]
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN bytes for the outputs to reuse
    got = tpl.launch(fns, specs, args)
    torch.cuda.synchronize()
    got = got if isinstance(got, (list, tuple)) else [got]
    for g, w, r in zip(got, want, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert not torch.isnan(g).any() and not torch.isinf(g).any()
        assert rel_err(g, w) < 1e-2 and rel_err(g, r) < 1e-2, (name, tokens, rel_err(g, w), rel_err(g, r))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tpl.launch(fns, specs, args)
    captured = captured if isinstance(captured, (list, tuple)) else [captured]
    for c in captured:
        c.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for c, w in zip(captured, want, strict=True):
        assert not torch.isnan(c).any() and rel_err(c, w) < 1e-2


@pytest.mark.parametrize("batch", [1, 8])
def test_every_rank_of_the_router_runs_one_compiled_kernel(kimi_k3, batch):
    """The router's op slices its rank's rows from both whole weights: the rows each rank reads
    are the launcher's (``weights_at``), the kernel and its cache key the same for all 16."""
    from codegen.compiler import cache_key
    from codegen.launchers.generated import PRODUCTS
    from rewriter.commands.bench_ops import _fused_calls

    (name, fake, _), = _fused_calls(kimi_k3, OWN_OPS["router_down"], 16, batch, "sm_90a", ["router_down"])
    keys, rows = set(), set()
    for rank in range(16):
        (spec,) = PRODUCTS.make_specs(name, "sm_90a", [*fake[:5], rank])
        keys.add(cache_key(spec))
        rows.add(spec.param_dict["weights_at"])
        gate, down = spec.param_dict["weights_at"]
        assert gate == (1, rank * 56) and down == (2, rank * 224)
    assert len(keys) == 1 and len(rows) == 16


@needs_cutedsl
def test_a_stage_whose_k_the_gemv_cannot_hold_takes_the_gemm_at_one_token(kcache, kimi_k3):
    """The dense MLP at TP 1: its down stage's K (the whole intermediate, 33792) is more than a
    GEMV lane holds in registers, so that stage runs on the tensor-core GEMM at one token; the
    gate-and-up stage keeps the GEMV."""
    from codegen.compiler import compile_kernel
    from codegen.launchers.generated import PRODUCTS
    from rewriter.commands.bench_ops import _fused_calls

    (name, fake, _), = _fused_calls(kimi_k3, OWN_OPS["dense_mlp"], 1, 1, "sm_90a", ["dense_mlp"])
    specs = PRODUCTS.make_specs(name, "sm_90a", fake)
    assert [(s.module, s.shape_dict["k"]) for s in specs] == [("product_gemv", 7168), ("product_gemm", 33792)]
    ptx = compile_kernel(specs[1], cache=kcache).ptx
    assert all(p in ptx for p in PROMISES["product_gemm"]) and "ld.local" not in ptx


@on_gpu
@pytest.mark.parametrize("tp,batch", [(16, 1), (8, 1), (16, 8), (8, 64), (1, 1)])
@pytest.mark.parametrize("op", sorted(OWN_OPS))
def test_kimi_k3s_own_fused_ops_on_generated_kernels_match_their_references(kimi_k3, op, tp, batch):
    """At the served shapes, fresh inputs scaled as a trained layer's, outputs poisoned: every
    result of the generated kernels against the op's reference (collectives stood down: one GPU)."""
    from rewriter.commands.bench_ops import _fused_calls, _materialized
    from rewriter.model.ops import collectives_excluded

    (name, fake, _), = _fused_calls(kimi_k3, OWN_OPS[op], tp, batch, "sm_90a", [op])
    args = _materialized(fake, torch.Generator().manual_seed(7 * tp + batch))
    with torch.no_grad(), collectives_excluded():
        ref = getattr(torch.ops.k3f, op)(*args)
        tpl, specs, fns = gpu_kernels(name, args, "products")
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN bytes for the outputs to reuse
        got = tpl.launch(fns, specs, args)
        torch.cuda.synchronize()
    ref, got = ([t] if torch.is_tensor(t) else list(t) for t in (ref, got))
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape, (g.dtype, r.dtype, g.shape, r.shape)
        assert not torch.isnan(g).any() and not torch.isinf(g).any()
        assert rel_err(g, r) < 2e-2, (op, tp, batch, rel_err(g, r))


@on_gpu
@pytest.mark.parametrize("tokens", [1, 5, 13, 64])
@pytest.mark.parametrize("tp,ranks", [(16, (0, 3, 15)), (8, (0, 7)), (1, (0,))])
def test_the_router_on_generated_kernels_reads_each_ranks_rows(kimi_k3, tokens, tp, ranks):
    """The router's op is handed both whole weights: each rank's kernels read that rank's rows
    (the launcher's ``weights_at``), fp32 logits within 1e-4, the bf16 projection within 1e-2;
    GEMV at one token, GEMM from 2 (13: a partial token tile)."""
    from rewriter.commands.bench_ops import _fused_calls, _materialized
    from rewriter.model.ops import collectives_excluded

    (name, fake, _), = _fused_calls(kimi_k3, OWN_OPS["router_down"], tp, tokens, "sm_90a", ["router_down"])
    args = _materialized(fake, torch.Generator().manual_seed(tp + tokens))
    for rank in ranks:
        call = [*args[:5], rank]
        with torch.no_grad(), collectives_excluded():
            ref_logits, ref_latent = torch.ops.k3f.router_down(*call)
            tpl, specs, fns = gpu_kernels(name, call)
            assert tpl.kernel == "products"
            torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)
            logits, latent = tpl.launch(fns, specs, call)
            torch.cuda.synchronize()
        assert logits.dtype == torch.float32 and latent.dtype == torch.bfloat16
        assert logits.shape == ref_logits.shape and latent.shape == ref_latent.shape
        assert torch.isfinite(logits).all() and torch.isfinite(latent).all()
        assert rel_err(logits, ref_logits) <= 1e-4 and rel_err(latent, ref_latent) <= 1e-2, (rank, tokens)
