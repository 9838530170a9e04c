"""Each sub-block of the reference layer against an independent float64 implementation
written from the math (tests/independent.py), on fresh random weights and inputs."""
from __future__ import annotations

import pytest
import torch

import independent as ind
from conftest import make_inputs, make_layer, rel_err
from rewriter.model.layers.attn_res import attn_res

FP32_TOL = 1e-5
BF16_TOL = 2e-2


@pytest.mark.parametrize("num_blocks,write_idx,with_delta",
                         [(0, 0, False), (1, -1, True), (2, 1, True), (3, -1, False)])
def test_attn_res_matches_math(num_blocks, write_idx, with_delta):
    g = torch.Generator().manual_seed(num_blocks * 10 + write_idx)
    T, NB, D = 4, 3, 32
    prefix, delta, blocks = (torch.randn(s, generator=g) for s in ((T, D), (T, D), (T, NB, D)))
    w = [1 + 0.1 * torch.randn(D, generator=g), torch.randn(D, generator=g) / D**0.5,
         1 + 0.1 * torch.randn(D, generator=g)]
    out, new_prefix, new_blocks = attn_res(prefix, delta if with_delta else None, blocks, *w, num_blocks=num_blocks,
                                           block_write_idx=write_idx, eps=1e-5, output_norm_eps=1e-5)
    e_out, e_prefix, e_blocks = ind.attn_res(prefix, delta if with_delta else None, blocks, *w, num_blocks, write_idx,
                                             1e-5)
    assert rel_err(out, e_out) < FP32_TOL
    assert rel_err(new_prefix, e_prefix) < FP32_TOL
    assert rel_err(new_blocks, e_blocks) < FP32_TOL
    if write_idx < 0:
        assert new_blocks is blocks  # untouched buffers are passed through, not copied


def _kda_reference(layer, x, inputs):
    cfg, attn = layer.config, layer.self_attn
    conv, rec = inputs["conv_state"].clone(), inputs["recurrent_state"].clone()
    out = ind.kda(ind.sub(layer.state_dict(), "self_attn"), x, conv, rec, inputs["state_indices"],
                  heads=attn.heads, head_dim=attn.head_dim, conv_size=attn.conv_size,
                  lower_bound=cfg.gate_lower_bound)
    return out, conv, rec


@pytest.mark.parametrize("batch,q", [(1, 1), (3, 1)])  # q > 1 is a verify step: test_verify_reference
def test_kda_attention_matches_math(tiny, batch, q):
    layer = make_layer(tiny, 1, seed=batch * 7 + q)
    inputs = make_inputs(layer, batch=batch, q=q, seed=q)
    x = inputs["prefix_sum"]
    e_out, e_conv, e_rec = _kda_reference(layer, x, inputs)
    out = layer.self_attn(x, inputs["conv_state"], inputs["recurrent_state"], inputs["state_indices"])
    assert rel_err(out, e_out) < FP32_TOL
    assert rel_err(inputs["conv_state"], e_conv) < FP32_TOL
    assert rel_err(inputs["recurrent_state"], e_rec) < FP32_TOL


def test_kda_softplus_gate_without_lower_bound(tiny):
    cfg = tiny.replace(gate_lower_bound=None)
    layer = make_layer(cfg, 1, seed=3)
    inputs = make_inputs(layer, batch=2)
    x = inputs["prefix_sum"]
    e_out, _, e_rec = _kda_reference(layer, x, inputs)
    out = layer.self_attn(x, inputs["conv_state"], inputs["recurrent_state"], inputs["state_indices"])
    assert rel_err(out, e_out) < FP32_TOL
    assert rel_err(inputs["recurrent_state"], e_rec) < FP32_TOL


def _cached_entries(inputs, block_size, context):
    cache, table = inputs["kv_cache"], inputs["block_table"]
    per_request = []
    for b in range(table.shape[0]):
        rows = cache[table[b].long()].reshape(-1, cache.shape[-1])
        per_request.append(rows[:context].clone())
    return per_request


@pytest.mark.parametrize("batch,q,context,kv_cache_dtype,tol", [
    (1, 1, 0, "bf16", FP32_TOL), (3, 1, 5, "bf16", FP32_TOL), (2, 2, 6, "bf16", FP32_TOL),
    (3, 1, 5, "fp8", 3e-2),  # the history read as E4M3 x scale; this step's own entry is stored as E4M3 too
])
def test_mla_attention_matches_unabsorbed_math(tiny, batch, q, context, kv_cache_dtype, tol):
    layer = make_layer(tiny, 2, seed=batch + q + context)
    attn = layer.self_attn
    inputs = make_inputs(layer, batch=batch, q=q, context=context, block_size=4, seed=context,
                         kv_cache_dtype=kv_cache_dtype)
    x = inputs["prefix_sum"]
    history = _cached_entries(inputs, 4, context)
    if kv_cache_dtype == "fp8":
        assert inputs["kv_cache"].dtype == torch.uint8 and float(inputs["kv_scale"]) != 1.0
        history = [h.view(torch.float8_e4m3fn).float() * inputs["kv_scale"] for h in history]
    expected = ind.mla(ind.sub(layer.state_dict(), "self_attn"), x, history, heads=attn.heads, q_lora=attn.q_lora,
                       kv_lora=attn.kv_lora, nope=attn.nope, rope=attn.rope, v_dim=attn.v_dim, eps=attn.eps)
    out = attn(x, inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], inputs["slot_mapping"],
               inputs["kv_scale"])
    assert rel_err(out, expected) < tol


def test_moe_matches_math(tiny):
    layer = make_layer(tiny, 1, seed=11)
    x = make_inputs(layer, batch=5)["prefix_sum"]
    cfg = tiny
    expected = ind.moe(ind.sub(layer.state_dict(), "block_sparse_moe"), x, top_k=cfg.num_experts_per_token,
                       scaling=cfg.routed_scaling_factor, renormalize=cfg.moe_renormalize,
                       beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta, eps=cfg.rms_norm_eps)
    assert rel_err(layer.block_sparse_moe(x), expected) < FP32_TOL


def test_router_bias_steers_selection_only(tiny):
    """e_score_correction_bias picks experts but does not weight them."""
    layer = make_layer(tiny, 1, seed=12)
    moe = layer.block_sparse_moe
    logits = torch.randn(3, tiny.num_experts, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[:4] = 100.0  # force experts 0..3 in
    weights, ids = moe.route(logits)
    assert sorted(ids[0].tolist())[:4] == [0, 1, 2, 3]
    scores = torch.sigmoid(logits).gather(1, ids)
    assert rel_err(weights, scores / scores.sum(-1, keepdim=True) * tiny.routed_scaling_factor) < 1e-6


def test_dense_mlp_matches_math(tiny):
    layer = make_layer(tiny, 0, seed=13)
    x = make_inputs(layer, batch=4)["prefix_sum"]
    expected = ind.dense_mlp(ind.sub(layer.state_dict(), "mlp"), x, beta=tiny.activation_situ_beta,
                             linear_beta=tiny.activation_situ_linear_beta)
    assert rel_err(layer.mlp(x), expected) < FP32_TOL


@pytest.mark.parametrize("layer_idx", [0, 1, 2, 3, 4, 5])
def test_whole_layer_matches_math(tiny, layer_idx):
    """Every layer of the tiny model (dense, KDA, MLA; block-writing or not) end to end."""
    layer = make_layer(tiny, layer_idx, seed=20 + layer_idx)
    inputs = make_inputs(layer, batch=2, context=3, seed=layer_idx)
    params = layer.state_dict()
    attn = layer.self_attn
    if layer.attention_kind == "kda":
        conv, rec = inputs["conv_state"].clone(), inputs["recurrent_state"].clone()

        def attention(x):
            return ind.kda(ind.sub(params, "self_attn"), x, conv, rec, inputs["state_indices"],
                           heads=attn.heads, head_dim=attn.head_dim, conv_size=attn.conv_size,
                           lower_bound=tiny.gate_lower_bound)
    else:
        history = _cached_entries(inputs, 4, 3)

        def attention(x):
            return ind.mla(ind.sub(params, "self_attn"), x, history, heads=attn.heads,
                           q_lora=attn.q_lora, kv_lora=attn.kv_lora, nope=attn.nope, rope=attn.rope,
                           v_dim=attn.v_dim, eps=attn.eps)
    e_out, e_prefix, e_blocks = ind.decoder_layer(params, tiny, layer_idx, inputs["hidden_states"],
                                                  inputs["prefix_sum"], inputs["blocks"], attention)
    out, prefix, blocks = layer(**inputs)
    assert rel_err(out, e_out) < FP32_TOL
    assert rel_err(prefix, e_prefix) < FP32_TOL
    assert rel_err(blocks, e_blocks) < FP32_TOL


@pytest.mark.parametrize("layer_idx", [1, 2])
def test_bf16_layer_close_to_fp32(tiny, layer_idx):
    """The bf16 layer (bf16 weights, activations and conv state) stays within bf16 tolerance."""
    l32 = make_layer(tiny, layer_idx, seed=5)
    l16 = make_layer(tiny, layer_idx, seed=5, dtype=torch.bfloat16)
    with torch.no_grad():  # same values: round the fp32 weights to bf16 first
        for (_, p32), (_, p16) in zip(l32.named_parameters(), l16.named_parameters()):
            p32.copy_(p16.float())
    i32, i16 = make_inputs(l32, seed=9), make_inputs(l16, seed=9)
    for k in i32:
        if i32[k].is_floating_point():
            i32[k] = i16[k].to(i32[k].dtype, copy=True)  # never share state: layers update it in place
    assert rel_err(l16(**i16)[0], l32(**i32)[0]) < BF16_TOL
