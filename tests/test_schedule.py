"""The kernel schedule: counts, streams and events, prefetches, bytes, critical path."""
from __future__ import annotations

import networkx as nx
import pytest

from patterns import default_rules
from rewriter.compiler.cost import floor_bytes, hbm_us
from rewriter.compiler.rewrite import rewrite
from rewriter.compiler.rules import RuleSet
from rewriter.compiler.schedule import build_schedule
from rewriter.compiler.stock_kernels import layer_kernels
from rewriter.compiler.trace import trace
from rewriter.model.layers import build_layer
from rewriter.model.shape import DecodeShape


def _both(cfg, layer, tp, batch, arch="sm_100a"):
    lg = trace(build_layer(cfg, layer, tp=tp), DecodeShape(batch=batch, tp=tp, arch=arch))
    return lg, build_schedule(lg), build_schedule(rewrite(lg).after)


@pytest.mark.parametrize("layer,kind", [(1, "kda"), (3, "mla")])
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", [1, 64])
def test_at_most_13_kernels_and_the_stock_count(k3, layer, kind, tp, batch):
    lg, stock, fused = _both(k3, layer, tp, batch)
    assert len(stock.kernels) == layer_kernels(kind, tp=tp, tokens=batch, arch="sm_100a")
    assert len(fused.kernels) <= 13
    assert nx.is_directed_acyclic_graph(fused.dag)


def test_hopper_schedule(k3):
    _, stock, fused = _both(k3, 1, 16, 1, arch="sm_90a")
    assert len(stock.kernels) == layer_kernels("kda", tp=16, tokens=1, arch="sm_90a")
    assert len(fused.kernels) == 9


def test_shared_experts_run_beside_the_routed_ones(k3):
    _, _, s = _both(k3, 1, 16, 1)
    shared = s.kernel("shared_experts")
    assert shared.stream == "aux"
    routed = s.kernel("routed_experts_grouped")
    assert not nx.has_path(s.dag, shared.name, routed.name) and not nx.has_path(s.dag, routed.name, shared.name)
    forks = [e for e in s.events if e.before == "shared_experts"]
    joins = [e for e in s.events if e.record_after == "shared_experts"]
    assert forks and forks[0].stream_waits == "aux"
    assert joins and joins[0].before == "latent_tail" and joins[0].stream_waits == "main"
    assert shared.start_us < routed.end_us  # it overlaps in time


def test_prefetch_during_communication_only(k3):
    _, _, s16 = _both(k3, 1, 16, 1)
    comm = {k.name for k in s16.kernels if k.communicates}
    assert comm == {"o_proj_all_reduce_attn_res", "router_down", "latent_tail"}
    assert s16.prefetches and all(p.during in comm for p in s16.prefetches)
    assert all(p.kernel != "routed_experts_grouped" for p in s16.prefetches)  # experts chosen at run time
    first = [p for p in s16.prefetches if p.during == "o_proj_all_reduce_attn_res"]
    assert first[0].kernel == "router_down" and first[0].bytes == s16.kernel("router_down").weights[
        "block_sparse_moe.gate.weight"] + s16.kernel("router_down").weights[
        "block_sparse_moe.routed_expert_down_proj.weight"]
    _, _, s1 = _both(k3, 1, 1, 1)
    assert s1.prefetches == [] and not any(k.communicates for k in s1.kernels)


def test_bytes_and_time_bounds(k3):
    lg, stock, fused = _both(k3, 1, 16, 1)
    floor = floor_bytes(lg.graph, lg.shape)
    # the router split reads 1/16 of its replicated weights: below the reference's floor
    assert fused.total_bytes < floor < stock.total_bytes * 1.02
    assert fused.critical_path_us <= hbm_us(fused.total_bytes) + 1e-9
    assert fused.bound_us == pytest.approx(max(fused.critical_path_us, hbm_us(fused.total_bytes)))
    order = [k.name for k in fused.kernels]
    for a, b in fused.dag.edges:  # launch order respects every dependency
        assert order.index(a) < order.index(b)


def test_unrewritten_regions_keep_their_stock_kernels(k3):
    lg = trace(build_layer(k3, 3, tp=8), DecodeShape(batch=4, tp=8))
    without = RuleSet()
    for rule in default_rules():
        if rule.name != "mla_attend":
            without.add(rule)
    s = build_schedule(rewrite(lg, without).after)
    decode = [k for k in s.kernels if k.source == "stock:mla.decode"]
    assert len(decode) == 1  # without its rule, the MLA decode core stays vLLM's kernel
    assert [k.source for k in s.kernels].count("stock:mla.uv_absorb") == 1
    fused = build_schedule(rewrite(lg).after)
    assert "mla_attend" in [k.name for k in fused.kernels] and len(fused.kernels) < len(s.kernels)


def test_tp1_all_reduce_launches_nothing(tiny):
    lg = trace(build_layer(tiny, 1), DecodeShape(batch=2))
    s = build_schedule(lg)
    assert not any("all_reduce" in k.source and "tail" not in k.source for k in s.kernels)
