"""The k3:: leaf ops: paged vs contiguous caches, padding rows, fake shapes, q_len > 1."""
from __future__ import annotations

import pytest
import torch

from conftest import rel_err

k3 = torch.ops.k3


ONE = torch.ones(1)  # the KV cache scale, unused by a bf16 / fp32 cache


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_mla_decode_paged_equals_contiguous_and_formula():
    B, H, L, R, S, bs = 3, 4, 16, 8, 10, 4
    contiguous = _rand(B, S, L + R, seed=1)
    seq_lens = torch.tensor([10, 7, 1], dtype=torch.int32)
    pages = -(-S // bs)
    table = torch.randperm(B * pages, generator=torch.Generator().manual_seed(2)).view(B, pages) + 1
    paged = torch.zeros(B * pages + 1, bs, L + R)
    for b in range(B):
        for p in range(pages):
            rows = contiguous[b, p * bs:(p + 1) * bs]
            paged[table[b, p], :rows.shape[0]] = rows
    q = _rand(B, H, L + R, seed=3)
    a = k3.mla_decode(q, contiguous, None, seq_lens, ONE, 0.1, L)
    b = k3.mla_decode(q, paged, table.int(), seq_lens, ONE, 0.1, L)
    assert rel_err(a, b) < 1e-6
    for i in range(B):  # the formula, request by request
        n = int(seq_lens[i])
        probs = torch.softmax(q[i] @ contiguous[i, :n].T * 0.1, dim=-1)
        assert rel_err(a[i], probs @ contiguous[i, :n, :L]) < 1e-6


def test_mla_decode_is_causal_within_a_step():
    """With q_len 2, the first token must not see the second token's entry."""
    L, R = 8, 4
    cache = _rand(1, 5, L + R, seed=4)
    q = _rand(2, 2, L + R, seed=5)
    out = k3.mla_decode(q, cache, None, torch.tensor([5], dtype=torch.int32), ONE, 0.3, L)
    first_alone = k3.mla_decode(q[:1], cache, None, torch.tensor([4], dtype=torch.int32), ONE, 0.3, L)
    assert rel_err(out[:1], first_alone) < 1e-6


def test_cache_insert_writes_slots_and_skips_padding():
    cache = torch.zeros(3, 4, 6)
    kv_c, k_pe = _rand(3, 4, seed=6), _rand(3, 2, seed=7)
    k3.mla_cache_insert(cache, kv_c, k_pe, torch.tensor([5, -1, 11]), ONE)
    assert torch.equal(cache[1, 1], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(cache[2, 3], torch.cat([kv_c[2], k_pe[2]]))
    assert int((cache.abs().sum(-1) > 0).sum()) == 2  # the padding row wrote nothing


def test_fp8_cache_stores_value_over_scale_and_decode_reads_it_back():
    """vLLM's per-tensor fp8 cache (uint8 storage): the insert stores E4M3(value / scale), the
    decode reads E4M3 x scale, so it attends over the same values as a cache of the dequantized
    entries; a padding request (length 0) gets zeros."""
    L, R, scale = 16, 8, torch.tensor([0.37])
    cache = torch.zeros(2, 4, L + R, dtype=torch.uint8)
    kv_c, k_pe = _rand(5, L, seed=20).bfloat16(), _rand(5, R, seed=21).bfloat16()
    k3.mla_cache_insert(cache, kv_c, k_pe, torch.tensor([0, 1, 2, 3, 4]), scale)
    stored = cache.view(torch.float8_e4m3fn).float()
    want = (torch.cat([kv_c, k_pe], -1).float() / 0.37).to(torch.float8_e4m3fn).float()
    assert torch.equal(stored.reshape(-1, L + R)[:5], want)
    dequant = stored * 0.37
    assert rel_err(dequant.reshape(-1, L + R)[:5], torch.cat([kv_c, k_pe], -1).float()) < 0.07  # E4M3: 3 bits
    q = _rand(2, 3, L + R, seed=22).bfloat16()
    seq_lens, table = torch.tensor([5, 0], dtype=torch.int32), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    got = k3.mla_decode(q, cache, table, seq_lens, scale, 0.2, L)
    ref = k3.mla_decode(q, dequant.bfloat16(), table, seq_lens, ONE, 0.2, L)
    assert rel_err(got[:1], ref[:1]) < 1e-2 and torch.count_nonzero(got[1]) == 0


def test_fp8_cache_insert_saturates_as_vllm_does():
    """Past E4M3's range the insert stores +-448 (vLLM's ``__NV_SATFINITE`` cache writes), not the
    NaN of torch's plain cast; NaN stays NaN."""
    cache = torch.zeros(1, 2, 4, dtype=torch.uint8)
    kv_c = torch.tensor([[1e4, -1e4, float("inf")], [0.5, float("nan"), -float("inf")]]).bfloat16()
    k3.mla_cache_insert(cache, kv_c, torch.ones(2, 1).bfloat16(), torch.tensor([0, 1]), torch.tensor([1.0]))
    stored = cache.view(torch.float8_e4m3fn).float().reshape(2, 4)
    assert stored[0].tolist() == [448.0, -448.0, 448.0, 1.0]
    assert stored[1, 0] == 0.5 and stored[1, 1].isnan() and stored[1, 2] == -448.0


@pytest.mark.parametrize("fp8", [False, True])
def test_batched_mla_ops_equal_the_loops(fp8):
    """The CUDA implementations (no host sync: what a CUDA graph captures), run here on CPU
    tensors, against the loop references: paged cache, two tokens per request (causal within
    the step), a padding request (length 0, slots -1), bf16 and fp8 caches."""
    from rewriter.model.ops import _cache_insert_batched, _decode_batched

    B, q_len, H, L, R, bs = 3, 2, 4, 16, 8, 4
    g = torch.Generator().manual_seed(30)
    scale = torch.tensor([0.6]) if fp8 else ONE
    cache = torch.randn(9, bs, L + R, generator=g)
    cache = (cache / scale).to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else cache.bfloat16()
    table = (torch.randperm(8, generator=g)[:6] + 1).view(B, 2).int()
    seq_lens = torch.tensor([7, 3, 0], dtype=torch.int32)
    pos = torch.tensor([5, 6, 1, 2, 0, 0])
    slots = (table.long().repeat_interleave(q_len, 0).gather(1, (pos // bs).view(-1, 1)).view(-1) * bs + pos % bs)
    slots[4:] = -1
    kv_c, k_pe = torch.randn(6, L, generator=g).bfloat16(), torch.randn(6, R, generator=g).bfloat16()
    loop, batched = cache.clone(), cache.clone()
    k3.mla_cache_insert(loop, kv_c, k_pe, slots, scale)
    _cache_insert_batched(batched, kv_c, k_pe, slots, scale)
    assert torch.equal(loop, batched)
    q = torch.randn(6, H, L + R, generator=g).bfloat16()
    want = k3.mla_decode(q, loop, table, seq_lens, scale, 0.2, L)
    got = _decode_batched(q, loop, table, seq_lens, scale, 0.2, L)
    assert rel_err(got, want) < 1e-2 and torch.count_nonzero(got[4:]) == 0


def test_conv_update_formula_and_state_shift():
    C, K = 5, 4
    x, w = _rand(2, C, seed=8), _rand(C, K, seed=9)
    state = _rand(3, C, K - 1, seed=10)
    before = state.clone()
    out = k3.kda_conv_update(torch.cat([x, x[:1]]), state, w, torch.tensor([2, -1, 0]))
    window = torch.cat([before[2], x[0].unsqueeze(-1)], dim=-1)
    assert rel_err(out[0], torch.nn.functional.silu((window * w).sum(-1))) < 1e-6
    assert torch.equal(state[2], window[:, 1:])
    # padding rows, -1 and vLLM's 0 (its null block): no output, no state touched
    assert torch.count_nonzero(out[1:]) == 0 and torch.equal(state[:2], before[:2])


def test_recurrent_step_pads_and_updates_only_its_slots():
    T, H, K = 2, 2, 4
    q, k, v = _rand(T, H, K, seed=11), _rand(T, H, K, seed=12), _rand(T, H, K, seed=13)
    g, beta = -torch.rand(T, H, K), torch.rand(T, H)
    state = _rand(4, H, K, K, seed=14)
    before = state.clone()
    out = k3.kda_recurrent_step(q, k, v, g, beta, state, torch.tensor([3, 0]))  # 0: vLLM's padding row
    s = before[3] * torch.exp(g[0]).unsqueeze(1)
    s = s + torch.einsum("hv,hk->hvk", (v[0] - torch.einsum("hvk,hk->hv", s, k[0])) * beta[0, :, None], k[0])
    assert rel_err(state[3], s) < 1e-6
    assert rel_err(out[0], torch.einsum("hvk,hk->hv", s, q[0])) < 1e-6
    assert torch.count_nonzero(out[1]) == 0 and torch.equal(state[:3], before[:3])


def test_fake_impls_give_shapes_on_meta():
    m = torch.device("meta")
    out = k3.mla_decode(torch.empty(4, 6, 576, device=m), torch.empty(9, 64, 576, device=m),
                        torch.empty(4, 2, dtype=torch.int32, device=m), torch.empty(4, dtype=torch.int32, device=m),
                        torch.empty(1, device=m), 0.07, 512)
    assert out.shape == (4, 6, 512) and out.device == m
    x = torch.empty(4, 48, device=m)
    assert k3.kda_conv_update(x, torch.empty(5, 48, 3, device=m), torch.empty(48, 4, device=m),
                              torch.empty(4, dtype=torch.int32, device=m)).shape == (4, 48)


def test_uneven_tokens_are_refused():
    with pytest.raises(ValueError, match="5 tokens do not split evenly over 2 requests"):
        k3.kda_conv_update(torch.zeros(5, 3), torch.zeros(3, 3, 3), torch.zeros(3, 4), torch.tensor([0, 1]))


@pytest.mark.parametrize("q_len", [1, 2])
def test_batched_kda_steps_equal_the_loops(q_len):
    """The CUDA implementations (batched, no host sync) give the loop references' values and
    states, padding rows included (slot 0 unowned, as vLLM's null block)."""
    from rewriter.model.ops import _recurrent_step_batched, conv_update_batched

    g = torch.Generator().manual_seed(q_len)
    idx = torch.tensor([3, -1, 5, 1], dtype=torch.int32)
    t, c, slots, h, k = 4 * q_len, 24, 7, 2, 8
    x = torch.randn(t, c, generator=g).bfloat16()
    conv, w = torch.randn(slots, c, 3, generator=g).bfloat16(), torch.randn(c, 4, generator=g)
    a_conv, b_conv = conv.clone(), conv.clone()
    assert torch.equal(torch.ops.k3.kda_conv_update(x, a_conv, w, idx), conv_update_batched(x, b_conv, w, idx))
    assert torch.equal(a_conv, b_conv) and torch.equal(b_conv[0], conv[0])
    q, kk = torch.randn(t, h, k, generator=g), torch.randn(t, h, k, generator=g)
    v, decay = torch.randn(t, h, k, generator=g).bfloat16(), -torch.rand(t, h, k, generator=g)
    beta, state = torch.rand(t, h, generator=g), torch.randn(slots, h, k, k, generator=g)
    a_s, b_s = state.clone(), state.clone()
    a = torch.ops.k3.kda_recurrent_step(q, kk, v, decay, beta, a_s, idx)
    b = _recurrent_step_batched(q, kk, v, decay, beta, b_s, idx)
    assert rel_err(b.float(), a.float()) < 1e-6 and rel_err(b_s, a_s) < 1e-6 and torch.equal(b_s[0], state[0])


def test_collectives_excluded_keeps_shapes():
    from rewriter.model.ops import collectives_excluded, gather_last_dim

    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="no process group registered"):
        torch.ops.k3.all_reduce(x, "nowhere", 4)
    with collectives_excluded():
        assert torch.equal(torch.ops.k3.all_reduce(x, "nowhere", 4), x)
        assert torch.equal(gather_last_dim(x, "nowhere", 4), torch.cat([x] * 4, dim=-1))
    with pytest.raises(RuntimeError, match="no process group registered"):
        gather_last_dim(x, "nowhere", 4)
