"""The tracer: full-size layers on meta tensors, vLLM names, regions, fidelity, bad shapes."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import make_inputs, make_layer, rel_err
from rewriter.compiler.trace import trace
from rewriter.model.layers import build_layer
from rewriter.model.regions import REGIONS
from rewriter.model.shape import DecodeShape, ShapeError

K3_LAYERS = {0: "dense", 1: "kda", 3: "mla"}


@pytest.mark.parametrize("layer_idx", sorted(K3_LAYERS))
@pytest.mark.parametrize("tp", [1, 8, 16])
def test_full_size_layer_traces_on_meta(k3, layer_idx, tp):
    start = time.perf_counter()
    layer = build_layer(k3, layer_idx, tp=tp)
    lg = trace(layer, DecodeShape(batch=8, tp=tp))
    assert time.perf_counter() - start < 20
    assert lg.kind == K3_LAYERS[layer_idx]
    names = dict(layer.named_parameters())
    for node in lg.graph.nodes:
        if node.op == "output":
            continue
        val = node.meta["val"]
        tensors = [val] if isinstance(val, torch.Tensor) else [v for v in (val or ()) if isinstance(v, torch.Tensor)]
        assert all(t.device.type == "meta" for t in tensors), node.name
        if node.op == "get_attr":
            assert node.target in names  # vLLM's parameter names survive the trace
            assert tuple(val.shape) == tuple(names[node.target].shape)
        if node.op in ("call_function", "call_method"):
            assert node.meta["region"] in REGIONS, node.name
    out = [n for n in lg.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out[0].meta["val"].shape) == (8, 7168)


def test_graph_keeps_vllm_parameter_names(k3):
    lg = trace(build_layer(k3, 1, tp=8), DecodeShape(batch=1, tp=8))
    targets = {n.target for n in lg.graph.nodes if n.op == "get_attr"}
    for name in ("self_attn.in_proj_qkvgfab.weight", "self_attn.f_b_proj.weight", "self_attn.A_log",
                 "self_attn.dt_bias", "self_attn.conv1d.weight", "block_sparse_moe.gate.e_score_correction_bias",
                 "block_sparse_moe.experts.routed_experts.w13_weight", "block_sparse_moe.routed_expert_up_proj.weight",
                 "self_attention_res_proj.weight", "mlp_res_norm.weight"):
        assert name in targets
    shapes = {n.target: tuple(n.meta["val"].shape) for n in lg.graph.nodes if n.op == "get_attr"}
    assert shapes["self_attn.in_proj_qkvgfab.weight"] == (6288, 7168)
    assert shapes["block_sparse_moe.experts.routed_experts.w13_weight"] == (896, 768, 3584)


def test_leaf_ops_stay_opaque(k3):
    kda = trace(build_layer(k3, 1, tp=16), DecodeShape(batch=2, tp=16))
    mla = trace(build_layer(k3, 3, tp=16), DecodeShape(batch=2, tp=16))

    def targets(lg):
        return [str(n.target) for n in lg.graph.nodes if n.op == "call_function"]

    assert {"k3.kda_conv_update.default", "k3.kda_recurrent_step.default", "k3.all_reduce.default"} <= set(targets(kda))
    assert {"k3.mla_cache_insert.default", "k3.mla_decode.default"} <= set(targets(mla))
    assert targets(kda).count("k3.all_reduce.default") == 2  # o_proj, and the latent MoE tail


@pytest.mark.parametrize("layer_idx", [0, 1, 2, 3])
def test_traced_graph_computes_what_the_layer_computes(tiny, layer_idx):
    layer = make_layer(tiny, layer_idx, seed=40 + layer_idx)
    lg = trace(layer, DecodeShape(batch=3, dtype=torch.float32))
    eager_inputs = make_inputs(layer, batch=3, seed=2)
    graph_inputs = {k: v.clone() for k, v in eager_inputs.items()}
    for a, b in zip(lg.gm(*graph_inputs.values()), layer(**eager_inputs)):
        assert rel_err(a, b) == 0.0
    for name in eager_inputs:  # and the same state updates
        assert torch.equal(graph_inputs[name], eager_inputs[name])


@pytest.mark.parametrize("kwargs,message", [
    (dict(batch=0), "DecodeShape.batch must be a positive int, got 0"),
    (dict(batch=1, q=0), "DecodeShape.q must be a positive int, got 0"),
    (dict(batch=1, tp=2, rank=2), "DecodeShape.rank must be in 0..1 for TP 2, got 2"),
    (dict(batch=1, dtype=torch.int8), "DecodeShape.dtype must be one of"),
    (dict(batch=1, arch="sm_89"), "DecodeShape.arch must be one of sm_90a, sm_100a, sm_103a, got 'sm_89'"),
    (dict(batch=1, context=-1), "DecodeShape.context must be an int >= 0, got -1"),
])
def test_bad_shapes_are_named(kwargs, message):
    with pytest.raises(ShapeError) as e:
        DecodeShape(**kwargs)
    assert message in str(e.value)


def test_trace_refuses_mismatched_shape(tiny):
    layer = build_layer(tiny, 1, tp=2)
    with pytest.raises(ShapeError, match="shape is TP 1 rank 0 but the layer was built for TP 2 rank 0"):
        trace(layer, DecodeShape(batch=1))
    with pytest.raises(ShapeError, match="shape dtype torch.float32 differs from the layer's torch.bfloat16"):
        trace(layer, DecodeShape(batch=1, tp=2, dtype=torch.float32))
    with pytest.raises(TypeError, match="trace expects a KimiDecoderLayer"):
        trace(torch.nn.Linear(2, 2), DecodeShape(batch=1))
