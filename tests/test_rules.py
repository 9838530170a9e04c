"""Each rule matches where it should, refuses with the right reason where it must, and its
rewrite is equivalent; malformed rules fail naming the rule; larger rules go first."""
from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, make_layer, rel_err
from patterns import default_rules
from rewriter.compiler.rewrite import rewrite
from rewriter.compiler.rules import Rule, RuleError, RuleSet, common_guard
from rewriter.compiler.trace import trace
from rewriter.model.shape import DecodeShape

# tiny: layer 0 dense (KDA attention, writes an AttnRes block), 1 KDA+MoE, 2 MLA+MoE (writes a block), 3 KDA+MoE
# (at batch 3 the shared experts are the GEMM rule's: the GEMV rule takes one token)
RULES_BY_LAYER = {
    0: {"attn_res_norm", "attn_in_proj", "kda_core", "o_proj_all_reduce_attn_res", "dense_mlp"},
    1: {"attn_res_norm", "attn_in_proj", "kda_core", "o_proj_all_reduce_attn_res", "router_gemm",
        "router_topk", "routed_experts", "shared_experts.large", "latent_tail"},
    2: {"attn_res_norm", "attn_in_proj", "mla_q_front", "mla_attend", "o_proj_all_reduce_attn_res",
        "router_gemm", "router_topk", "routed_experts", "shared_experts.large", "latent_tail"},
}


def _only(name: str) -> RuleSet:
    rs = RuleSet()
    rs.add(next(r for r in default_rules() if r.name == name))
    return rs


def _run(lg, inputs):
    fresh = {k: v.clone() for k, v in inputs.items()}
    return lg.gm(*fresh.values()), fresh


def _assert_equivalent(lg, rewritten, inputs, tol):
    (a, a_state), (b, b_state) = _run(lg, inputs), _run(rewritten, inputs)
    for x, y in zip(b, a):
        assert rel_err(x, y) <= tol
    for name in ("conv_state", "recurrent_state", "kv_cache"):
        if name in inputs:
            assert rel_err(b_state[name], a_state[name]) <= tol
    # (attn_res_norm writes an AttnRes block into the buffer in place and returns that buffer:
    # the zip above compared it with the original's new buffer)


@pytest.mark.parametrize("layer_idx", sorted(RULES_BY_LAYER))
def test_each_rule_alone_matches_and_is_equivalent(tiny, layer_idx):
    layer = make_layer(tiny, layer_idx, seed=60 + layer_idx)
    lg = trace(layer, DecodeShape(batch=3, dtype=torch.float32, context=5, block_size=4))
    inputs = make_inputs(layer, batch=3, context=5, block_size=4, seed=7)
    for rule in default_rules():
        result = rewrite(lg, _only(rule.name))
        matched = [m.rule for m in result.matches]
        if rule.name in RULES_BY_LAYER[layer_idx]:
            # (alone, attn_res_norm also takes the AttnRes before the MLP, which o_proj's rule takes first)
            assert matched and set(matched) == {rule.name}, rule.name
            fused = [n for n in result.after.graph.nodes if n.meta.get("fused")]
            assert len(fused) == len(matched) and {n.meta["fused"]["rule"] for n in fused} == {rule.name}
            _assert_equivalent(lg, result.after, inputs, 1e-5)
        else:
            assert matched == [], rule.name


@pytest.mark.parametrize("layer_idx", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("batch", [1, 8, 9, 64])
def test_all_rules_equivalent_fp32(tiny, layer_idx, batch):
    layer = make_layer(tiny, layer_idx, seed=layer_idx)
    lg = trace(layer, DecodeShape(batch=batch, dtype=torch.float32, context=5, block_size=4))
    result = rewrite(lg)
    expected = RULES_BY_LAYER.get(layer_idx, set())
    if batch == 1:  # the GEMV twins of the GEMM rules
        expected = {r.replace(".large", ".small") for r in expected}
    assert {m.rule for m in result.matches} >= expected
    assert not any(n.op == "call_function" and str(n.target).startswith("k3.kda") for n in result.after.graph.nodes)
    _assert_equivalent(lg, result.after, make_inputs(layer, batch=batch, context=5, block_size=4, seed=batch), 1e-5)


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_all_rules_equivalent_bf16(tiny, layer_idx):
    layer = make_layer(tiny, layer_idx, seed=layer_idx, dtype=torch.bfloat16)
    lg = trace(layer, DecodeShape(batch=5, context=5, block_size=4))
    result = rewrite(lg)
    assert len(result.matches) >= 5
    _assert_equivalent(lg, result.after, make_inputs(layer, batch=5, context=5, block_size=4, seed=3), 2e-2)


@pytest.mark.parametrize("experts", ["mxfp4", "mxfp4/checkpoint"])
@pytest.mark.parametrize("layer_idx", [1, 2])
def test_mxfp4_routed_experts_rule_matches_refuses_and_is_equivalent(tiny, layer_idx, experts):
    """On MXFP4 experts (Humming's layout, or the checkpoint's) ``routed_experts_mxfp4`` takes the
    routed experts and the bf16 rule does not; alone and with every rule the rewrite equals the
    reference (bf16: the MXFP4 reference dequantizes to the activation dtype); past 64 tokens it
    refuses and the layer stays as it was."""
    layer = make_layer(tiny, layer_idx, seed=40 + layer_idx, dtype=torch.bfloat16, experts=experts)
    lg = trace(layer, DecodeShape(batch=3, context=5, block_size=4))
    inputs = make_inputs(layer, batch=3, context=5, block_size=4, seed=8)
    alone = rewrite(lg, _only("routed_experts_mxfp4"))
    assert [m.rule for m in alone.matches] == ["routed_experts_mxfp4"]
    assert rewrite(lg, _only("routed_experts")).matches == []
    _assert_equivalent(lg, alone.after, inputs, 2e-2)
    everything = rewrite(lg)
    assert "routed_experts_mxfp4" in {m.rule for m in everything.matches}
    _assert_equivalent(lg, everything.after, inputs, 2e-2)
    big = trace(layer, DecodeShape(batch=65, context=3, block_size=4))
    refused = rewrite(big, _only("routed_experts_mxfp4"))
    assert refused.matches == [] and [(r.rule, r.reason) for r in refused.refusals] == [
        ("routed_experts_mxfp4", "batch 65 > 64: rules are specialized for decode batches of 1..64 tokens")]


@pytest.mark.parametrize("layer_idx", [1, 2])
def test_mxfp4_moe_rule_takes_the_router_with_the_experts_from_16_tokens(tiny, layer_idx, monkeypatch):
    """Served from ``MOE_BY_EXPERT_FROM`` = 16 tokens: ``routed_moe_mxfp4`` takes the router's top-k
    and the MXFP4 experts as one op (three kernels: the router files the pairs by expert for the
    per-expert up stage), equivalent to the layer; below, it refuses by name and the top-k and the
    per-pair experts are matched apart; set to None, the rule has no pattern, so it neither
    matches nor refuses."""
    import patterns.moe

    layer = make_layer(tiny, layer_idx, seed=50 + layer_idx, dtype=torch.bfloat16, experts="mxfp4")
    lg = trace(layer, DecodeShape(batch=16, context=5, block_size=4))
    assert patterns.moe.MOE_BY_EXPERT_FROM == 16
    result = rewrite(lg)
    rules = {m.rule for m in result.matches}
    assert "routed_moe_mxfp4" in rules and not rules & {"router_topk", "routed_experts_mxfp4"}
    (node,) = [n for n in result.after.graph.nodes if n.meta.get("fused", {}).get("rule") == "routed_moe_mxfp4"]
    assert node.target is torch.ops.k3f.routed_moe_mxfp4.default and node.meta["fused"]["launches"] == 3
    _assert_equivalent(lg, result.after, make_inputs(layer, batch=16, context=5, block_size=4, seed=9), 2e-2)
    below = rewrite(trace(layer, DecodeShape(batch=15, context=5, block_size=4)))
    assert {"router_topk", "routed_experts_mxfp4"} <= {m.rule for m in below.matches}
    assert ("routed_moe_mxfp4", "batch 15 outside 16..64 (per chosen expert from 16 tokens)") in {
        (r.rule, r.reason) for r in below.refusals}
    monkeypatch.setattr(patterns.moe, "MOE_BY_EXPERT_FROM", None)
    unserved = rewrite(lg)
    assert {"router_topk", "routed_experts_mxfp4"} <= {m.rule for m in unserved.matches}
    assert "routed_moe_mxfp4" not in {r.rule for r in unserved.refusals}


def test_the_input_projection_is_one_rule_at_every_batch(tiny):
    """One rule from 1 to 64 tokens: its generated kernels pick the GEMV or the GEMM main loop."""
    layer = make_layer(tiny, 1)
    for batch in (1, 2, 64):
        result = rewrite(trace(layer, DecodeShape(batch=batch, dtype=torch.float32)))
        assert "attn_in_proj" in {m.rule for m in result.matches}
        assert not [r for r in result.refusals if r.rule == "attn_in_proj"]


@pytest.mark.parametrize("layer_idx", [1, 2])
def test_batch_beyond_the_rules_is_refused_and_stays_equal(tiny, layer_idx):
    layer = make_layer(tiny, layer_idx, seed=5)
    lg = trace(layer, DecodeShape(batch=65, dtype=torch.float32, context=3, block_size=4))
    result = rewrite(lg)
    assert result.matches == []
    assert {r.reason for r in result.refusals} == {
        "batch 65 > 64: rules are specialized for decode batches of 1..64 tokens"}
    assert {r.rule for r in result.refusals} >= {"kda_core" if layer_idx == 1 else "mla_q_front", "routed_experts"}
    _assert_equivalent(lg, result.after, make_inputs(layer, batch=65, context=3, block_size=4, seed=1), 1e-6)


def test_a_tp_that_does_not_split_the_experts_replicates_the_router(tiny):
    """router_gemm splits the gate's rows across TP; where TP does not divide them it refuses,
    and router_gemm.replicated reads every row on each rank: nothing of it left to the others."""
    cfg = tiny.replace(num_experts=12)
    from rewriter.model.layers import build_layer
    layer = build_layer(cfg, 1, tp=8, rank=3, dtype=torch.float32)
    result = rewrite(trace(layer, DecodeShape(batch=2, tp=8, rank=3, dtype=torch.float32)))
    refusals = {r.rule: r.reason for r in result.refusals}
    assert refusals["router_gemm"] == "TP 8 does not divide the 12 rows of block_sparse_moe.gate.weight"
    matches = {m.rule: m for m in result.matches}
    assert "routed_experts" in matches and "router_gemm" not in matches
    router = matches["router_gemm.replicated"]
    assert router.kernel == "router_down" and router.split_saving == 0
    assert set(router.weights.values()) == {12 * 64 * 4, cfg.routed_expert_hidden_size * 64 * 4}  # whole, fp32


@pytest.mark.parametrize("name, reason", [
    ("router_gemm.replicated", "TP 8 divides both weights' rows: router_gemm splits them"),
    ("latent_tail.replicated", "TP 8 divides the up projection's rows: latent_tail splits them")])
def test_replicated_rules_refuse_what_tp_splits(tiny, name, reason):
    """Alone, a replicated rule refuses where TP divides the rows (its split rule's case); where
    it does not, it matches (the two tests above), and the gloo test of tests/test_tensor_parallel.py
    runs its rewrite against TP 1."""
    from rewriter.model.layers import build_layer
    layer = build_layer(tiny, 1, tp=8, rank=3, dtype=torch.float32)
    result = rewrite(trace(layer, DecodeShape(batch=2, tp=8, rank=3, dtype=torch.float32)), _only(name))
    assert result.matches == [] and {r.rule: r.reason for r in result.refusals} == {name: reason}


def test_larger_rules_run_first(tiny):
    """A one-linear user rule registered FIRST still gets no node a larger rule needs."""
    def variants(ctx):
        def pattern(x, w):
            return torch.nn.functional.linear(x, w)

        def replacement(x, w):
            return torch.ops.k3f.shared_down_linear(x, w)
        return [(pattern, replacement)]

    from rewriter.compiler.rules import fused_op

    @fused_op("shared_down_linear")
    def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w)

    rs = RuleSet()
    rs.add(Rule("greedy_linear", "layer", variants, common_guard))
    for r in default_rules():
        rs.add(r)
    result = rewrite(trace(make_layer(tiny, 1), DecodeShape(batch=2, dtype=torch.float32)), rs)
    assert "greedy_linear" not in {m.rule for m in result.matches}
    assert RULES_BY_LAYER[1] <= {m.rule for m in result.matches}


def _bad(name, variants=None, guard=common_guard):
    def default_variants(ctx):
        def pattern(x, w):
            return torch.nn.functional.linear(x, w)

        def replacement(x, w):
            return torch.ops.k3f.routed_experts(x, w, w, w, w, None, None)
        return [(pattern, replacement)]
    rs = RuleSet()
    rs.add(Rule(name, "layer", variants or default_variants, guard))
    return rs


def test_malformed_rules_name_themselves(tiny):
    lg = trace(make_layer(tiny, 1), DecodeShape(batch=2, dtype=torch.float32))

    def empty(ctx):
        return [(lambda x: x, lambda x: x)]
    with pytest.raises(RuleError, match="rule 'empty_pattern': pattern of variant 0 traces to no operations"):
        rewrite(lg, _bad("empty_pattern", empty))

    def raising_guard(m):
        raise KeyError("oops")
    with pytest.raises(RuleError, match="rule 'bad_guard': guard raised KeyError"):
        rewrite(lg, _bad("bad_guard", guard=raising_guard))

    def unfused(ctx):
        def pattern(x, w):
            return torch.nn.functional.linear(x, w)

        def replacement(x, w):
            return torch.nn.functional.linear(x, w) * 1.0
        return [(pattern, replacement)]
    with pytest.raises(RuleError, match="rule 'no_fused_op': replacement of variant 0 calls no k3f:: op"):
        rewrite(lg, _bad("no_fused_op", unfused))

    def broken(ctx):
        raise ValueError("no such layer attribute")
    with pytest.raises(RuleError, match="rule 'broken': building its patterns raised ValueError"):
        rewrite(lg, _bad("broken", broken))

    with pytest.raises(RuleError, match="rule 'x': family must be a non-empty name"):
        Rule("x", "", empty, common_guard)
    rs = RuleSet()
    rs.add(Rule("dup", "layer", empty, common_guard))
    with pytest.raises(RuleError, match="rule 'dup' is already registered"):
        rs.add(Rule("dup", "layer", empty, common_guard))


def test_every_match_and_refusal_is_recorded(k3):
    from rewriter.model.layers import build_layer
    lg = trace(build_layer(k3, 1, tp=16), DecodeShape(batch=64, tp=16))
    result = rewrite(lg)
    assert len(result.matches) == 9
    assert sorted((r.rule, r.reason) for r in result.refusals) == [
        ("shared_experts.small", "batch 64 outside 1..1 (the GEMV rule takes 1 token)")]
    by_rule = {m.rule: m for m in result.matches}
    assert by_rule["routed_experts"].bytes < by_rule["routed_experts"].weights[
        "block_sparse_moe.experts.routed_experts.w13_weight"] * 2  # only the experts batch 64 is expected to touch
    assert "block_sparse_moe.experts.routed_experts.w13_weight" in by_rule["routed_experts"].dynamic_weights


def test_rule_launches_must_be_a_positive_int():
    with pytest.raises(RuleError, match="launches must be an int >= 1"):
        Rule("zero", "moe", lambda ctx: [], common_guard, launches=0)


def test_a_tp_that_does_not_split_the_up_projection_replicates_the_tail(tiny):
    """The tail reads 1/TP of the up projection's rows; where TP does not divide the hidden size
    latent_tail refuses and latent_tail.replicated reads them all; the router still splits."""
    from rewriter.model.layers import build_layer
    layer = build_layer(tiny.replace(hidden_size=68), 1, tp=8, rank=3, dtype=torch.float32)
    result = rewrite(trace(layer, DecodeShape(batch=2, tp=8, rank=3, dtype=torch.float32)))
    refusals = {r.rule: r.reason for r in result.refusals}
    assert refusals["latent_tail"] == ("TP 8 does not divide the 68 rows of "
                                       "block_sparse_moe.routed_expert_up_proj.weight")
    matches = {m.rule: m for m in result.matches}
    assert {"routed_experts", "router_gemm", "latent_tail.replicated"} <= set(matches)
    assert matches["latent_tail.replicated"].split_saving == 0
    assert result.served_floor_bytes() == result.reference_floor_bytes() - matches["router_gemm"].split_saving
