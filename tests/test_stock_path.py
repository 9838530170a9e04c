"""The vllm-stock bench path (``rewriter.commands.stock_path``): the alignment against Humming's own
reference, the lowering's retargeted graph and refusals, and on the GPU the lowered layer
against the reference layer (Humming, fla-core and Inductor really run)."""
from __future__ import annotations

import pytest
import torch

from conftest import on_gpu
from rewriter.commands.stock_path import StockPathError, align_block_size, lower
from rewriter.model.layers import build_layer
from rewriter.model.ops import conv_update_batched
from rewriter.model.shape import DecodeShape


@pytest.mark.parametrize("tokens,top_k,experts,block", [(1, 16, 896, 16), (8, 16, 896, 16), (64, 16, 896, 64),
                                                        (5, 3, 8, 4)])
def test_alignment_matches_hummings_reference(tokens, top_k, experts, block):
    """Humming's test helper aligns with host loops and exact sizes; ours in device ops, sized for
    the worst case: the same sorted (token, slot) rows and block experts up to the padded total,
    and only the invalid row past it."""
    data = pytest.importorskip("humming.testing.data")
    g = torch.Generator().manual_seed(tokens * block)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    _, _, ref_sorted, ref_experts, ref_total = data.generate_moe_tensors(ids.int(), experts, "indexed",
                                                                         block_size_config=block)
    sorted_ids, expert_ids, total = align_block_size(ids, experts, block)
    n = int(total)
    assert n == int(ref_total) and n % block == 0
    assert torch.equal(sorted_ids[:n], ref_sorted) and torch.equal(expert_ids[:n // block], ref_experts)
    assert (sorted_ids[n:] == ids.numel()).all() and sorted_ids.numel() % block == 0


def test_lowering_puts_flas_decode_in_place_of_the_kda_step(k3):
    layer = build_layer(k3, 0, tp=16, device="meta")  # the dense layer: no experts to re-lay
    gm = lower(layer, DecodeShape(batch=4, tp=16))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.k3stock.fla_recurrent_step.default in targets
    assert torch.ops.k3.kda_recurrent_step.default not in targets
    # vLLM's Triton conv update: the reference's batched torch ops, traced for Inductor to fuse
    assert conv_update_batched in targets and torch.ops.k3.kda_conv_update.default not in targets


def test_lowering_runs_the_router_gate_as_one_bf16_gemm_with_fp32_output(k3):
    """The reference widens x and the 12.8 MB gate weight to fp32 before its GEMM; vLLM runs one
    bf16 GEMM with fp32 output, and so does the stock path (the experts kept as the reference's
    ops here: the lowering of a bf16 layer stops at its refusal, so call the pass directly)."""
    from rewriter.commands.stock_path import _fp32_out_gemms
    from rewriter.compiler.trace import trace

    lg = trace(build_layer(k3, 1, tp=16, device="meta"), DecodeShape(batch=2, tp=16))
    _fp32_out_gemms(lg.gm)
    gemms = [n for n in lg.graph.nodes if n.target is torch.ops.k3stock.gemm_fp32_out.default]
    assert len(gemms) == 1 and gemms[0].args[1].target == "block_sparse_moe.gate.weight"
    assert not any(n.op == "call_method" and n.target == "float" and n.args[0].op == "get_attr"
                   and n.args[0].target == "block_sparse_moe.gate.weight" for n in lg.graph.nodes)


@pytest.mark.parametrize("layer_idx,experts,message", [
    (3, "mxfp4", "MLA layer: vLLM's MLA decode on sm_90"),
    (1, "bf16", "the experts must be mxfp4/humming, got bf16"),
    (1, "verify", "a verify step of 4 tokens per request"),
])
def test_what_the_stock_path_cannot_run_is_refused_by_name(k3, layer_idx, experts, message):
    q = 4 if experts == "verify" else 1
    layer = build_layer(k3, layer_idx, tp=16, device="meta", experts="mxfp4" if q > 1 else experts)
    with pytest.raises(StockPathError, match=message):
        lower(layer, DecodeShape(batch=1, tp=16, q=q))


@on_gpu
@pytest.mark.parametrize("layer_idx,batch", [(1, 1), (1, 8), (0, 8)])
def test_stock_layer_matches_the_reference_on_the_gpu(k3, layer_idx, batch):
    """TP 16's shard of the real shapes: Humming's MoE on MXFP4 experts in its layout, fla's Triton
    decode on page-strided KDA state, the rest compiled by Inductor, captured in a CUDA graph."""
    from rewriter.commands.bench import agreement, compilable_inputs
    from rewriter.model.layers.state import decode_inputs
    from rewriter.model.layers.weights import init_random_
    from rewriter.model.ops import collectives_excluded

    shape = DecodeShape(batch=batch, tp=16, rank=0)
    layer = init_random_(build_layer(k3, layer_idx, tp=16, device="cuda", experts="mxfp4"), seed=7)
    inputs = compilable_inputs(decode_inputs(layer, shape, device="cuda", seed=3))
    with torch.no_grad(), collectives_excluded():
        compiled = torch.compile(lower(layer, shape))
        assert agreement(layer, compiled, inputs) <= 2e-2
        graph = torch.cuda.CUDAGraph()
        compiled(*inputs)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):  # nothing syncs with the host: the alignment included
            compiled(*inputs)
        graph.replay()
        torch.cuda.synchronize()
