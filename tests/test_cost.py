"""Bytes moved: exact on pieces we can count by hand, and the floor's composition."""
from __future__ import annotations

import pytest

from rewriter.compiler.cost import _expected_distinct, floor_bytes, hbm_us, region_bytes
from rewriter.compiler.trace import trace
from rewriter.model.layers import build_layer
from rewriter.model.shape import DecodeShape


@pytest.fixture(scope="module")
def kda16(k3):
    return trace(build_layer(k3, 1, tp=16), DecodeShape(batch=1, tp=16))


def test_projection_region_moves_weight_input_and_output(kda16):
    rb = region_bytes(kda16.graph, kda16.shape)
    # the weight, the input, and the 3206 output columns other regions read (not the 10 padding ones)
    assert rb["kda.in_proj"] == 3216 * 7168 * 2 + 7168 * 2 + (4 * 768 + 128 + 6) * 2
    assert rb["attn.o_proj"] == 7168 * 768 * 2 + 768 * 2 + 7168 * 2


def test_state_traffic_is_per_request(k3):
    def kda_regions(batch):
        lg = trace(build_layer(k3, 1, tp=16), DecodeShape(batch=batch, tp=16))
        return region_bytes(lg.graph, lg.shape)

    one, four = kda_regions(1), kda_regions(4)
    state = 6 * 128 * 128 * 4 * 2 + 3 * 768 * 3 * 2 * 2  # fp32 recurrent + bf16 conv, read and written
    assert four["kda.core"] - one["kda.core"] == pytest.approx(3 * state, rel=0.05)


def test_floor_counts_each_weight_once_and_only_selected_live_experts(kda16, k3):
    params = dict(build_layer(k3, 1, tp=16).named_parameters())
    dense = sum(p.numel() * p.element_size() for n, p in params.items() if "experts.w" not in n)
    experts = sum(p.numel() * p.element_size() for n, p in params.items() if "experts.w" in n)
    floor = floor_bytes(kda16.graph, kda16.shape)
    picked = experts * _expected_distinct(896, 16) // 896 * 192 // 256  # 192 of 256 rows per rank are real
    assert dense + picked < floor < dense + picked + 2_000_000  # + state and activations


def test_mxfp4_floor_counts_codes_and_scales_of_live_rows(kda16, k3):
    """MXFP4 experts: 4 bits a value plus a byte per 32, only the 192 live rows of 256 (by hand)."""
    sh = DecodeShape(batch=1, tp=16)
    mx = floor_bytes(trace(build_layer(k3, 1, tp=16, experts="mxfp4"), sh).graph, sh)
    bf16 = floor_bytes(kda16.graph, sh)
    live, latent = 192, 3584
    per_expert_bf16 = (2 * live * latent + latent * live) * 2
    per_expert_mx = 2 * live * (latent // 2 + latent // 32) + latent * (live // 2 + live // 32)
    assert bf16 - mx == 16 * (per_expert_bf16 - per_expert_mx)


def test_expected_distinct_experts():
    assert _expected_distinct(896, 16) == 16
    assert 600 < _expected_distinct(896, 64 * 16) < 620  # batch 64 touches about two thirds
    assert _expected_distinct(8, 10_000) == 8


def test_mla_kv_b_halves_are_not_double_counted(k3):
    lg = trace(build_layer(k3, 3, tp=16), DecodeShape(batch=1, tp=16))
    rb = region_bytes(lg.graph, lg.shape)
    half = 6 * 128 * 512 * 2
    assert half < rb["mla.uk_absorb"] < half + 100_000
    assert half < rb["mla.uv_absorb"] < half + 100_000
    # the decode reads the whole cached context once
    assert rb["mla.decode"] >= 4097 * 576 * 2


def test_hbm_us():
    assert hbm_us(4_270_000, 4.27) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="HBM bandwidth must be positive"):
        hbm_us(1, 0)


@pytest.mark.parametrize("layer,tp", [(1, 16), (3, 8), (1, 1), (0, 16)])
def test_served_floor_leaves_split_weights_to_the_other_ranks(k3, layer, tp):
    """The floor as served reads 1/TP of the weights the rules split (router gate, latent down and
    up projections), the reference floor all of them; the dense layer splits none."""
    from rewriter.compiler.rewrite import rewrite

    result = rewrite(trace(build_layer(k3, layer, tp=tp, experts="mxfp4"), DecodeShape(batch=1, tp=tp)))
    split = 0 if layer == 0 else (896 * 7168 + 2 * 3584 * 7168) * 2  # gate, down, up: bf16, replicated
    saved = result.reference_floor_bytes() - result.served_floor_bytes()
    assert result.reference_floor_bytes() == floor_bytes(result.before.graph, result.before.shape)
    assert saved == pytest.approx(split * (tp - 1) / tp, abs=8)
