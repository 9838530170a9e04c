"""Token-by-token decode with states and caches equals one pass over the whole sequence."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import independent as ind
from conftest import make_inputs, make_layer, rel_err

TOL = 1e-5
B, N = 2, 5  # requests, tokens per request


def _clone(inputs):
    return OrderedDict((k, v.clone()) for k, v in inputs.items())


def _tokens(t: torch.Tensor, n: int) -> torch.Tensor:
    """Token n of every request from a request-major [B*N, ...] tensor."""
    return t.view(B, N, *t.shape[1:])[:, n]


def _steps(layer, full, per_step):
    """Run the layer N times, one token per request each time; stack outputs request-major."""
    state = _clone(full)
    outs = []
    for n in range(N):
        step = OrderedDict(state)
        for name in ("hidden_states", "prefix_sum", "blocks"):
            step[name] = _tokens(full[name], n)
        step.update(per_step(n))
        outs.append(layer(**step))
    stacked = [torch.stack([o[i] for o in outs], dim=1).flatten(0, 1) for i in range(3)]
    return stacked, state


def test_kda_attention_steps_equal_the_float64_recurrence(tiny):
    """N one-token steps of the KDA attention against the float64 recurrence written from the
    math over the whole sequence (a verify step of N tokens against N steps: test_verify_reference)."""
    layer = make_layer(tiny, 1, seed=31)
    full = make_inputs(layer, batch=B, seed=4)
    attn = layer.self_attn
    x = torch.randn(B * N, tiny.hidden_size, generator=torch.Generator().manual_seed(2))
    conv, rec = full["conv_state"].clone(), full["recurrent_state"].clone()
    expected = ind.kda(ind.sub(layer.state_dict(), "self_attn"), x, conv, rec, full["state_indices"],
                       heads=attn.heads, head_dim=attn.head_dim, conv_size=attn.conv_size,
                       lower_bound=tiny.gate_lower_bound)
    s = _clone(full)
    got = torch.stack([attn(_tokens(x, n), s["conv_state"], s["recurrent_state"], s["state_indices"])
                       for n in range(N)], dim=1).flatten(0, 1)
    assert rel_err(got, expected) < TOL
    assert rel_err(s["recurrent_state"], rec) < TOL
    assert rel_err(s["conv_state"], conv) < TOL


@pytest.mark.parametrize("context", [0, 7])
def test_mla_layer_steps_equal_full_sequence(tiny, context):
    layer = make_layer(tiny, 2, seed=32)
    full = make_inputs(layer, batch=B, q=N, context=context, block_size=4, seed=5)

    def per_step(n):
        return {"seq_lens": full["seq_lens"] - (N - 1 - n), "slot_mapping": _tokens(full["slot_mapping"], n)}

    stepped, stepped_state = _steps(layer, full, per_step)
    whole_state = _clone(full)
    whole = layer(**whole_state)
    for a, b in zip(stepped, whole):
        assert rel_err(a, b) < TOL
    assert rel_err(stepped_state["kv_cache"], whole_state["kv_cache"]) < TOL
    # the absorbed decode against attention with keys and values materialized, causal over the sequence
    attn = layer.self_attn
    cache, table = full["kv_cache"], full["block_table"]
    history = [cache[table[b].long()].reshape(-1, cache.shape[-1])[:context] for b in range(B)]
    x = torch.randn(B * N, tiny.hidden_size, generator=torch.Generator().manual_seed(3))
    expected = ind.mla(ind.sub(layer.state_dict(), "self_attn"), x, history, heads=attn.heads, q_lora=attn.q_lora,
                       kv_lora=attn.kv_lora, nope=attn.nope, rope=attn.rope, v_dim=attn.v_dim, eps=attn.eps)
    s = _clone(full)
    got = torch.stack([attn(_tokens(x, n), s["kv_cache"], s["block_table"], per_step(n)["seq_lens"],
                            per_step(n)["slot_mapping"], s["kv_scale"]) for n in range(N)], dim=1).flatten(0, 1)
    assert rel_err(got, expected) < TOL
