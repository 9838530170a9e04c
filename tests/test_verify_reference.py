"""The reference of a speculative verify step (issue #13): vLLM's multi-slot KDA contract
(``k3::kda_conv_verify``, ``k3::kda_recurrent_verify``; docs/SPECULATIVE.md) and the MLA
decode of q tokens, each against q single-token steps of the plain decode ops on the same
inputs, for every accepted length, with the rollback the next step does."""
from __future__ import annotations

import pytest
import torch

import rewriter.model.ops  # noqa: F401  (registers the k3 ops)
from conftest import rel_err

k3 = torch.ops.k3
C, W, H, K, V = 12, 4, 2, 8, 8  # conv channels and width; heads, key and value dims
HIST = W - 1


def _inputs(batch: int, q_len: int, gen: torch.Generator):
    t = batch * q_len
    x = torch.randn(t, C, generator=gen).bfloat16()
    weight = (torch.randn(C, W, generator=gen) / 2).bfloat16()
    qk = torch.nn.functional.normalize(torch.randn(2, t, H, K, generator=gen), dim=-1)
    v = torch.randn(t, H, V, generator=gen).bfloat16()
    g = -torch.rand(t, H, K, generator=gen) * 0.5
    beta = torch.rand(t, H, generator=gen)
    return x, weight, qk[0] * K ** -0.5, qk[1], v, g, beta


def _slots(batch: int, q_len: int, gen: torch.Generator) -> torch.Tensor:
    """Each request's q slot columns, distinct, none the null block 0 (as vLLM allocates them)."""
    return (torch.randperm(batch * q_len + 3, generator=gen)[:batch * q_len] + 1).view(batch, q_len).int()


def _single_steps(x, weight, q, k, v, g, beta, window, state0):
    """q one-token decode steps of one request on the plain ops, from its history window
    [C, W - 1] and state [H, V, K]: outputs, and the window and state after each token."""
    conv = torch.stack([torch.zeros_like(window), window])  # slot 0: the null block
    rec = torch.stack([torch.zeros_like(state0), state0])
    one = torch.tensor([1], dtype=torch.int32)
    ys, os, windows, states = [], [], [], []
    for j in range(x.shape[0]):
        ys.append(k3.kda_conv_update(x[j:j + 1], conv, weight, one))
        os.append(k3.kda_recurrent_step(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1], rec, one))
        windows.append(conv[1].clone())
        states.append(rec[1].clone())
    return torch.cat(ys), torch.cat(os), windows, states


@pytest.mark.parametrize("batch,q_len", [(1, 2), (3, 4), (2, 8)])
def test_verify_equals_single_steps_for_every_accepted_length(batch, q_len):
    gen = torch.Generator().manual_seed(100 * batch + q_len)
    x, weight, q, k, v, g, beta = _inputs(batch, q_len, gen)
    slots = _slots(batch, q_len, gen)
    n_slots = int(slots.max()) + 1
    rows = HIST + q_len - 1  # vLLM keeps W - 1 + k rows for k = q - 1 drafts
    for a in range(1, q_len + 1):  # the previous step's accepted tokens + 1
        conv = torch.randn(n_slots, C, rows, generator=gen).bfloat16()
        state = torch.randn(n_slots, H, V, K, generator=gen)
        before_conv, before_state = conv.clone(), state.clone()
        accepted = torch.full((batch,), a, dtype=torch.int32)
        y = k3.kda_conv_verify(x, conv, weight, slots, accepted)
        o = k3.kda_recurrent_verify(q, k, v, g, beta, state, slots, accepted)
        for b in range(batch):
            rows_b = slice(b * q_len, (b + 1) * q_len)
            window = before_conv[slots[b, 0], :, a - 1:a - 1 + HIST]
            ys, os, windows, states = _single_steps(x[rows_b], weight, q[rows_b], k[rows_b], v[rows_b], g[rows_b],
                                                    beta[rows_b], window, before_state[slots[b, a - 1]])
            assert torch.equal(y[rows_b], ys) and rel_err(o[rows_b], os) <= 1e-6
            for j in range(q_len):  # rollback: accepting j + 1 tokens, the next step finds token j's state
                assert torch.allclose(state[slots[b, j]], states[j], rtol=1e-6, atol=1e-6)
                assert torch.equal(conv[slots[b, 0], :, j:j + HIST], windows[j])
        untouched = torch.ones(n_slots, dtype=torch.bool)
        untouched[slots.flatten().long()] = False
        assert torch.equal(state[untouched], before_state[untouched])
        assert torch.equal(conv[untouched], before_conv[untouched])


def test_padding_rows_read_and_write_nothing():
    """vLLM pads a FULL-graph verify batch with rows of slot 0 (its null block), accepted count 1."""
    gen = torch.Generator().manual_seed(5)
    x, weight, q, k, v, g, beta = _inputs(2, 3, gen)
    slots = torch.tensor([[4, 2, 6], [0, 0, 0]], dtype=torch.int32)
    conv, state = torch.randn(7, C, HIST + 2, generator=gen).bfloat16(), torch.randn(7, H, V, K, generator=gen)
    null_conv, null_state = conv[0].clone(), state[0].clone()
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    y = k3.kda_conv_verify(x, conv, weight, slots, accepted)
    o = k3.kda_recurrent_verify(q, k, v, g, beta, state, slots, accepted)
    assert not y[3:].any() and not o[3:].any() and y[:3].any() and o[:3].any()
    assert torch.equal(conv[0], null_conv) and torch.equal(state[0], null_state)


@pytest.mark.parametrize("make,message", [
    (lambda i: (i["x"][:5], i["slots"], i["acc"]), "5 tokens are not 2 requests x 3"),
    (lambda i: (i["x"], i["slots"].flatten(), i["acc"]), "spec_state_indices must be [requests, q]"),
    (lambda i: (i["x"], i["slots"], i["acc"][:1]), "num_accepted must be [2]"),
    (lambda i: (i["x"], i["slots"], i["acc"] * 4), "num_accepted 8 outside 1..3"),
])
def test_bad_verify_inputs_name_the_problem(make, message):
    gen = torch.Generator().manual_seed(6)
    x, weight, *_ = _inputs(2, 3, gen)
    inputs = {"x": x, "slots": torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
              "acc": torch.tensor([2, 1], dtype=torch.int32)}
    xs, slots, acc = make(inputs)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        k3.kda_conv_verify(xs, torch.zeros(7, C, HIST + 2).bfloat16(), weight, slots, acc)


def test_a_conv_state_without_the_speculative_rows_is_refused():
    gen = torch.Generator().manual_seed(7)
    x, weight, *_ = _inputs(1, 4, gen)
    with pytest.raises(ValueError, match="holds 3 rows; a verify of 4 tokens needs 6"):
        k3.kda_conv_verify(x, torch.zeros(2, C, HIST).bfloat16(), weight, torch.tensor([[1, 1, 1, 1]]).int(),
                           torch.tensor([1]).int())


@pytest.mark.parametrize("batch,q_len", [(1, 4), (3, 8)])
def test_mla_verify_equals_single_token_steps(batch, q_len):
    """q tokens per request inserted at their slots and attended causally (token j sees the
    cache up to itself) equal q steps of one token, each inserting its entry and attending."""
    gen = torch.Generator().manual_seed(batch * q_len)
    lora, rope, heads, block, blocks = 16, 4, 2, 4, 24
    context = torch.randint(1, 9, (batch,), generator=gen)
    table = torch.randperm(blocks, generator=gen)[:batch * 5].view(batch, 5).int()
    cache = torch.randn(blocks, block, lora + rope, generator=gen).bfloat16()
    q = torch.randn(batch * q_len, heads, lora + rope, generator=gen).bfloat16()
    kv_c = torch.randn(batch * q_len, lora, generator=gen).bfloat16()
    k_pe = torch.randn(batch * q_len, rope, generator=gen).bfloat16()
    pos = context.repeat_interleave(q_len) + torch.arange(q_len).repeat(batch)  # each token's position
    req = torch.arange(batch).repeat_interleave(q_len)
    slot_mapping = (table[req, pos // block] * block + pos % block).long()
    scale, one = torch.tensor([1.0]), 0.125

    verify_cache = cache.clone()
    k3.mla_cache_insert(verify_cache, kv_c, k_pe, slot_mapping, scale)
    verify = k3.mla_decode(q, verify_cache, table, (context + q_len).int(), scale, one, lora)

    step_cache, steps = cache.clone(), []
    for j in range(q_len):
        rows = torch.arange(batch) * q_len + j
        k3.mla_cache_insert(step_cache, kv_c[rows], k_pe[rows], slot_mapping[rows], scale)
        steps.append(k3.mla_decode(q[rows], step_cache, table, (context + j + 1).int(), scale, one, lora))
    assert torch.equal(verify_cache, step_cache)
    assert rel_err(verify, torch.stack(steps, dim=1).flatten(0, 1)) <= 1e-6


@pytest.mark.parametrize("batch,q_len", [(2, 3), (3, 8)])
def test_batched_verify_equals_the_loops(batch, q_len):
    """The no-host-sync forms the CUDA dispatch runs (device-agnostic, so checked here) against
    the loop references, padding row included."""
    from rewriter.model.ops import conv_verify_batched, recurrent_verify_batched

    gen = torch.Generator().manual_seed(batch + q_len)
    x, weight, q, k, v, g, beta = _inputs(batch, q_len, gen)
    slots = _slots(batch, q_len, gen)
    slots[-1] = 0  # a padding row
    n = int(slots.max()) + 1
    accepted = torch.randint(1, q_len + 1, (batch,), generator=gen).int()
    conv, state = torch.randn(n, C, HIST + q_len - 1, generator=gen).bfloat16(), torch.randn(n, H, V, K, generator=gen)
    conv2, state2 = conv.clone(), state.clone()
    y, o = k3.kda_conv_verify(x, conv, weight, slots, accepted), k3.kda_recurrent_verify(q, k, v, g, beta, state,
                                                                                        slots, accepted)
    y2 = conv_verify_batched(x, conv2, weight, slots, accepted)
    o2 = recurrent_verify_batched(q, k, v, g, beta, state2, slots, accepted)
    assert torch.equal(y, y2) and torch.equal(conv, conv2)
    assert rel_err(o2, o) <= 1e-6 and torch.allclose(state2, state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("q_len", [2, 4])
def test_kda_layer_verify_equals_single_token_steps_for_every_accepted_length(tiny, q_len):
    """The whole KDA+MoE decoder layer (AttnRes, KDA, MoE) at a verify shape against q steps of one
    token: outputs, every token's state column and the conv rows the next step reads."""
    from conftest import make_inputs, make_layer

    batch = 2
    layer = make_layer(tiny, 1, seed=41)
    for a in range(1, q_len + 1):
        full = make_inputs(layer, batch=batch, q=q_len, seed=a)
        full["num_accepted"].fill_(a)
        verify = {k: v.clone() for k, v in full.items()}
        out = layer(**verify)
        slots = full["state_indices"].long()
        conv = torch.stack([torch.zeros_like(full["conv_state"][0, :, :HIST])]
                           + [full["conv_state"][slots[b, 0], :, a - 1:a - 1 + HIST] for b in range(batch)])
        rec = torch.stack([torch.zeros_like(full["recurrent_state"][0])]
                          + [full["recurrent_state"][slots[b, a - 1]] for b in range(batch)])
        one = torch.arange(1, batch + 1, dtype=torch.int32)
        for j in range(q_len):
            rows = torch.arange(batch) * q_len + j
            step = layer(full["hidden_states"][rows], full["prefix_sum"][rows], full["blocks"][rows].clone(),
                         conv, rec, one)
            for got, want in zip(step, out):
                assert rel_err(got, want[rows]) <= 1e-5
            for b in range(batch):
                assert rel_err(verify["recurrent_state"][slots[b, j]], rec[b + 1]) <= 1e-5
                # the inputs come from GEMMs over 2 or 2 q tokens: equal up to fp32 summation order
                assert rel_err(verify["conv_state"][slots[b, 0], :, j:j + HIST], conv[b + 1]) <= 1e-5


@pytest.mark.parametrize("layer_idx", [1, 3])
def test_the_rewritten_verify_layer_equals_the_reference(tiny, layer_idx):
    """A verify shape traced and rewritten (the KDA core by ``kda_core.verify``, the one-token
    ``kda_core`` rule not matching it) and run by its schedule."""
    from conftest import make_inputs, make_layer
    from rewriter.compiler.program import LayerRunner
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.shape import DecodeShape

    layer = make_layer(tiny, layer_idx, seed=9, dtype=torch.bfloat16)
    shape = DecodeShape(batch=2, q=4, context=5, block_size=4)
    result = rewrite(trace(layer, shape))
    targets = {n.target for n in result.after.graph.nodes if n.op == "call_function"}
    if layer_idx == 1:
        assert torch.ops.k3f.kda_core_verify.default in targets
        assert not {k3.kda_conv_verify.default, k3.kda_recurrent_verify.default} & targets
        assert [m.rule for m in result.matches if m.rule.startswith("kda_core")] == ["kda_core.verify"]
    assert result.matches  # the token-wise rules still take the layer's 8 tokens
    runner = LayerRunner.of(result)
    inputs = make_inputs(layer, batch=2, q=4, seed=3)
    mine, theirs = ({k: v.clone() for k, v in inputs.items()} for _ in range(2))
    got, want = runner(*mine.values()), layer(**theirs)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-2
    for name in ("conv_state", "recurrent_state", "kv_cache"):
        if name in mine:
            assert rel_err(mine[name], theirs[name]) <= 1e-2
