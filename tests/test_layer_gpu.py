"""The whole rewritten layers (KDA+MoE, layer 0's KDA + dense MLP, MLA+MoE with a bf16 or fp8
latent cache) on the GPU against the reference layer (marked ``gpu``), the KDA state in vLLM's
pages (SD conv layout), the MLA cache paged with shuffled block tables.

The layer is Kimi K3's at one rank's shapes (``KimiK3Config.one_rank_of``: TP 16 or 8 sizes
as a TP 1 model, so one GPU runs it with no collective), full size, random weights, routed
experts bf16 or MXFP4 (the released checkpoint's, in Humming's layout). The
rewritten layer runs its schedule (``LayerRunner``: aux stream, events) with every fused op
on its CuTe DSL kernels; the reference layer runs plain PyTorch on the same GPU. Outputs
and the updated KDA states or MLA cache are compared by relative error (the fp8 cache by its
dequantized values).

Routing is a discontinuity: a token whose k-th and (k+1)-th expert scores are closer than
the rounding differences between the two paths may pick another expert. So the outputs are
compared on the tokens whose top-k margin in the reference is at least ``NEAR_TIE_MARGIN`` (the
router bias is scaled up to widen the gaps; at least half the tokens must qualify, else the
inputs are redrawn); the KDA states, which come before the router, are compared whole.
"""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conftest import GPU_MARKS, alone_if_large, rel_err
from rewriter.compiler.program import LayerRunner
from rewriter.compiler.rewrite import rewrite
from rewriter.compiler.schedule import build_schedule
from rewriter.compiler.trace import trace
from rewriter.model.config import KimiK3Config
from rewriter.model.layers import build_layer
from rewriter.model.layers.moe import NEAR_TIE_MARGIN, recorded_topk_margins
from rewriter.model.layers.state import conv_layout_of, decode_inputs, kda_state_pages
from rewriter.model.layers.weights import init_random_
from rewriter.model.shape import DecodeShape

pytestmark = GPU_MARKS

BF16_TOL, STATE_TOL = 1e-2, 2e-3


def layer_test_bytes(tp: int, tokens: int, layer_idx: int, experts: str | None) -> int:
    """What a layer test holds on the GPU at once: the layer's routed experts (all of them, MXFP4
    at 17 bytes a 32-value group, or bf16) and the reference MoE's expert rows of each (token,
    slot) pair (gate, up and down, bf16, gathered per pair: ``rewriter/model/layers/moe.py:expert_rows``,
    counted twice for the einsums' copies).
    Counting the pairs alone left the TP 1 layer (16 GB of MXFP4 experts) beside the large tests,
    and three of them ran out of memory (on an H100)."""
    if layer_idx == 0:
        return 0
    cfg = KimiK3Config.preset("kimi-k3")
    values = 3 * (cfg.moe_intermediate_size // tp) * cfg.routed_expert_hidden_size
    weights = cfg.num_experts * values * (17 / 32 if experts == "mxfp4" else 2)
    return int(weights) + tokens * cfg.num_experts_per_token * values * 4


def _layer(tp: int, experts: str, index: int = 1):
    from codegen import bind

    cfg = KimiK3Config.preset("kimi-k3").one_rank_of(tp)
    layer = init_random_(build_layer(cfg, index, tp=1, device="cuda", experts=experts), seed=tp)
    if index:
        layer.block_sparse_moe.gate.e_score_correction_bias.mul_(10.0)  # wider gaps between experts
    bind.install_cuda_kernels()
    return layer


def _copy(inputs: dict) -> list:
    """Copies of the inputs, the KDA state in pages again (``clone`` would compact the views)."""
    out = {n: t.clone() for n, t in inputs.items()}
    if "conv_state" in inputs:
        out["conv_state"], out["recurrent_state"] = kda_state_pages(inputs["conv_state"], inputs["recurrent_state"],
                                                                    conv_layout_of(inputs["conv_state"]))
    return list(out.values())


def _reference(layer, inputs):
    """The reference layer's outputs and each token's top-k selection margin in its router."""
    with recorded_topk_margins() as margins:
        out = layer(*inputs)
    (margin,) = margins or [torch.ones(inputs[0].shape[0], device=inputs[0].device)]  # the dense layer: no router
    return out, margin


@pytest.mark.parametrize("layer_idx,tp,batch,experts,cache", [
    (1, 16, 1, "bf16", "bf16"), (1, 16, 8, "bf16", "bf16"), (1, 16, 64, "bf16", "bf16"), (1, 8, 1, "bf16", "bf16"),
    (1, 8, 8, "bf16", "bf16"), (1, 16, 1, "mxfp4", "bf16"), (1, 16, 8, "mxfp4", "bf16"), (1, 8, 1, "mxfp4", "bf16"),
    (1, 8, 8, "mxfp4", "bf16"), (1, 16, 16, "mxfp4", "bf16"), (1, 8, 64, "mxfp4", "bf16"),  # the router GEMM, MoE at 64
    (1, 16, 64, "mxfp4", "bf16"),  # both MXFP4 stages per chosen expert, the down stage two tiles a warp
    (0, 16, 1, None, "bf16"), (0, 16, 8, None, "bf16"), (0, 8, 5, None, "bf16"),  # layer 0: KDA + dense MLP
    (0, 16, 64, None, "bf16"), (0, 8, 24, None, "bf16"),  # ... on its GEMMs
    (3, 16, 1, "mxfp4", "bf16"), (3, 16, 8, "mxfp4", "fp8"), (3, 8, 1, "mxfp4", "fp8"), (3, 8, 8, "bf16", "bf16"),
    (3, 16, 64, "mxfp4", "bf16"),  # layer 3: MLA + MoE
    (1, 4, 1, "mxfp4", "bf16"), (1, 2, 8, "mxfp4", "bf16"), (0, 4, 1, None, "bf16"),  # TP 4 and 2: wider CTAs, GEMM
    (1, 32, 1, "mxfp4", "bf16"), (3, 32, 8, "mxfp4", "bf16"),  # TP 32: o_proj's GEMM, 96 live expert channels
    (1, 12, 1, "mxfp4", "bf16"), (3, 6, 8, "mxfp4", "fp8"), (1, 48, 8, "mxfp4", "bf16"), (3, 24, 1, "mxfp4", "bf16"),
    (1, 3, 8, "mxfp4", "bf16"), (0, 3, 1, None, "bf16"),  # TP 3, 6, 12, 24, 48: 32 to 2 KDA heads, 1024 to 64 channels
    # MLA heads in groups of 16 (TP 3: 2 groups)
    (3, 4, 8, "mxfp4", "fp8"), (3, 1, 1, "mxfp4", "bf16"), (3, 3, 32, "mxfp4", "bf16")])
def test_rewritten_layer_matches_the_reference(layer_idx, tp, batch, experts, cache):
    """``experts``: bf16, or the checkpoint's MXFP4 in Humming's layout (what vLLM serves on sm_90);
    ``cache``: the MLA latent cache, bf16 or fp8 E4M3 with its per-tensor scale."""
    check_layer(layer_idx, tp, batch, experts, cache)


@pytest.mark.parametrize("layer_idx,tp,batch,q,cache", [
    (1, 16, 1, 4, "bf16"), (1, 16, 1, 8, "bf16"), (1, 8, 8, 4, "bf16"), (0, 16, 2, 8, "bf16"),
    (3, 16, 1, 4, "bf16"), (3, 16, 1, 8, "fp8"), (3, 8, 8, 4, "bf16")])
def test_rewritten_verify_layer_matches_the_reference(layer_idx, tp, batch, q, cache):
    """A speculative verify step of q tokens per request (vLLM's multi-slot KDA state, random
    accepted counts; MLA causal among the q tokens), MXFP4 experts, on its verify kernels."""
    check_layer(layer_idx, tp, batch, "mxfp4" if layer_idx else None, cache, q)


@pytest.mark.parametrize("tp,batch", [(16, 1), (16, 8), (8, 64)])
def test_the_generated_rule_example_serves_its_layer(tp, batch):
    """``examples/generated_rule.py``: the shared experts as a fused op of the user's, on kernels
    generated from its reference (no hand-written template), inside the whole layer."""
    from rewriter.commands.layer_args import rule_set

    rules = rule_set([Path(__file__).resolve().parents[1] / "examples" / "generated_rule.py"])
    check_layer(1, tp, batch, "mxfp4", "bf16", rules=rules, fused="k3f::my_shared_experts")


def check_layer(layer_idx, tp, batch, experts, cache, q=1, rules=None, fused=None):
    with alone_if_large(layer_test_bytes(tp, batch * q, layer_idx, experts)):
        _check_layer(layer_idx, tp, batch, experts, cache, q, rules, fused)
        gc.collect()  # the layer and its tensors, before the lock lets the next large test in


def _check_layer(layer_idx, tp, batch, experts, cache, q, rules=None, fused=None):
    from codegen import bind

    layer = _layer(tp, experts or "bf16", layer_idx)
    shape = DecodeShape(batch=batch, q=q, arch=bind.device_arch(), kv_cache_dtype=cache)
    tokens = shape.tokens
    for seed in range(10):
        given = decode_inputs(layer, shape, device="cuda", seed=seed)
        if "conv_state" in given:
            assert given["conv_state"].stride(0) > given["conv_state"][0].numel()  # vLLM's pages
        inputs = list(given.values())
        ref_inputs = _copy(given)
        with torch.no_grad():
            ref_out, margin = _reference(layer, ref_inputs)
        clear = margin >= NEAR_TIE_MARGIN  # tokens whose expert choice rounding cannot flip
        if 2 * int(clear.sum()) >= tokens:
            break
    else:
        pytest.fail(f"no inputs with half the tokens' top-k margins >= {NEAR_TIE_MARGIN} in 10 draws")
    result = rewrite(trace(layer, shape), rules)
    if fused:
        assert any(n.target == getattr(torch.ops.k3f, fused.split("::")[1]).default for n in result.after.graph.nodes)
    runner = LayerRunner(result, build_schedule(result.after), device="cuda")
    before = {op: c.get("reference", 0) for op, c in bind.stats().items()}
    rw_inputs = _copy(given)
    with torch.no_grad():
        out = runner(*rw_inputs)
    torch.cuda.synchronize()
    fallbacks = {op for op, c in bind.stats().items() if c.get("reference", 0) > before.get(op, 0)}
    assert not fallbacks, f"fused ops that ran their reference instead of a kernel: {sorted(fallbacks)}"
    for name, a, e in zip(("hidden", "prefix", "blocks"), out, ref_out):
        assert torch.isfinite(a).all(), name
        assert rel_err(a[clear], e[clear]) <= BF16_TOL, name
    names = list(decode_inputs(layer, shape).keys())
    if "kv_cache" in names:
        _check_mla_cache(rw_inputs, ref_inputs, inputs, names)
        return
    assert rw_inputs[names.index("conv_state")].stride(1) == 1  # the kernels ran on SD pages
    states = {n: (a, e) for n, a, e in zip(names, rw_inputs, ref_inputs) if n in ("conv_state", "recurrent_state")}
    assert rel_err(*states["conv_state"]) <= BF16_TOL
    assert rel_err(*states["recurrent_state"]) <= STATE_TOL
    # the states of slots no request owns (slot 0) are untouched
    for n, (a, _) in states.items():
        assert torch.equal(a[0], inputs[names.index(n)][0]), n


def _check_mla_cache(rw_inputs, ref_inputs, given, names):
    """This step's latent entries written where the slot mapping says, as the reference wrote
    them (fp8: within one E4M3 step of the value / scale); every other entry untouched."""
    at = names.index
    slots = given[at("slot_mapping")].long()
    a, e, before = (x[at("kv_cache")].flatten(0, 1) for x in (rw_inputs, ref_inputs, given))
    if a.dtype == torch.uint8:
        scale = given[at("kv_scale")].float()
        a, e, before = (x.view(torch.float8_e4m3fn).float() * scale for x in (a, e, before))
    written = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    written[slots[slots >= 0]] = True
    assert torch.equal(a[~written], before[~written])
    assert rel_err(a[written], e[written]) <= (6e-2 if rw_inputs[at("kv_cache")].dtype == torch.uint8 else BF16_TOL)
    assert not torch.equal(a[written], before[written])  # the entries did change
