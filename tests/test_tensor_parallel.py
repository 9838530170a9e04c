"""TP 2 and 4 on CPU processes (gloo) give TP 1's layer outputs and state updates, for the
reference layers and for their rewritten graphs; at TP 4 also with a hidden size and an expert
count TP does not divide, where the router and the latent tail read every row on each rank
(``router_gemm.replicated``, ``latent_tail.replicated``), as at Kimi K3's TP 3, 6, 12, 24, 48.

Each rank builds its layer from the TP 1 weights cut as vLLM cuts them (column, row,
replicated, packed pieces, zero-padded expert shards at TP 4), runs the same decode
step with its share of the state, and all-reduces through ``k3::all_reduce``.
"""
from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)
LAYERS = (0, 1, 2, 3)  # dense (KDA attention), KDA+MoE, MLA+MoE, KDA+MoE writing an AttnRes block
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_without_teardown() -> None:
    """End a worker that passed, skipping the interpreter's teardown: after gloo collectives a
    worker aborted at exit one run in 6 to 15 ("terminate called without an active exception", a
    C++ thread destroyed while joinable), after its group was destroyed and its last line printed;
    40 runs of 40 passed with this exit. A worker that fails raises before reaching it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world: int, port: int, sizes: dict) -> None:
    sys.path.insert(0, HERE)
    from conftest import make_inputs, make_layer, rel_err
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.layers.state import shard_decode_inputs, state_shardings
    from rewriter.model.layers.weights import shard_state_dict
    from rewriter.model.ops import register_group
    from rewriter.model.shape import DecodeShape

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    register_group("tp", dist.group.WORLD)
    torch.manual_seed(0)
    cfg = KimiK3Config.preset("tiny").replace(**sizes)
    replicated = {"router_gemm.replicated", "latent_tail.replicated"} if sizes else set()
    try:
        for layer_idx in LAYERS:
            full = make_layer(cfg, layer_idx, seed=100 + layer_idx)
            inputs = make_inputs(full, batch=3, context=6, block_size=4, seed=layer_idx)
            local = build_layer(cfg, layer_idx, tp=world, rank=rank, dtype=torch.float32, device="cpu")
            local.load_state_dict(shard_state_dict(full.state_dict(), local))
            local_inputs = shard_decode_inputs(inputs, local)
            expected = full(**inputs)
            got = local(**local_inputs)
            for name, a, b in zip(("output", "prefix_sum", "blocks"), got, expected):
                err = rel_err(a, b)
                assert err < TOL, f"TP {world} rank {rank} layer {layer_idx}: {name} rel err {err:.2e}"
            for name, cut in state_shardings(local).items():
                err = rel_err(local_inputs[name], cut.local(inputs[name], world, rank))
                assert err < TOL, f"TP {world} rank {rank} layer {layer_idx}: {name} rel err {err:.2e}"
            if "kv_cache" in inputs:
                assert rel_err(local_inputs["kv_cache"], inputs["kv_cache"]) < TOL
            # the rewritten rank graph (fused ops, the router split across ranks and gathered) too
            for batch in (2, 9):
                shape = DecodeShape(batch=batch, tp=world, rank=rank, dtype=torch.float32, context=6, block_size=4)
                result = rewrite(trace(local, shape))
                rules = {m.rule for m in result.matches}
                assert rules >= {"o_proj_all_reduce_attn_res", "kda_core" if local.attention_kind == "kda"
                                 else "mla_q_front"}
                if layer_idx:  # the MoE layers
                    assert rules >= (replicated or {"router_gemm", "latent_tail"}), rules
                step = make_inputs(full, batch=batch, context=6, block_size=4, seed=10 + layer_idx)
                expected = full(**{k: v.clone() for k, v in step.items()})
                got = result.after.gm(*shard_decode_inputs(step, local).values())
                for name, a, b in zip(("output", "prefix_sum", "blocks"), got, expected):
                    err = rel_err(a, b)
                    assert err < TOL, (f"rewritten TP {world} rank {rank} layer {layer_idx} batch {batch}: "
                                       f"{name} {err:.2e}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


@pytest.mark.slow
@pytest.mark.parametrize("world,sizes", [(2, {}), (4, {}), (4, {"hidden_size": 66, "num_experts": 18})],
                         ids=["tp2", "tp4", "tp4-rows-not-divided"])
def test_tp_ranks_equal_tp1(world, sizes):
    mp.spawn(_worker, args=(world, _free_port(), sizes), nprocs=world, join=True)


def _gather_worker(rank: int, world: int, port: int) -> None:
    from rewriter.model.ops import gather_last_dim, register_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    register_group("g", dist.group.WORLD)
    try:
        for shape in ((5,), (1, 4), (3, 4), (2, 3, 4)):
            def piece(r, shape=shape):
                return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 100 * r

            got = gather_last_dim(piece(rank), "g", world)
            expected = torch.cat([piece(r) for r in range(world)], dim=-1)
            assert torch.equal(got, expected) and got.is_contiguous(), f"rank {rank} shape {shape}"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


def test_gather_last_dim_puts_the_ranks_side_by_side():
    """The router's and the latent tail's gather (one collective into a [world, ...] buffer and
    one copy) gives ``cat`` of the ranks' pieces in rank order, contiguous, for 1- to 3-D pieces."""
    mp.spawn(_gather_worker, args=(3, _free_port()), nprocs=3, join=True)


def test_tp4_pads_expert_shards_like_vllm(tiny):
    """At TP 4 the tiny config's 16-wide expert shards are zero-padded to 32, as vLLM pads them."""
    from conftest import make_layer
    from rewriter.model.layers import build_layer
    from rewriter.model.layers.weights import shard_state_dict

    full = make_layer(tiny, 1, seed=1)
    local = build_layer(tiny, 1, tp=4, rank=3, dtype=torch.float32, device="cpu")
    sd = shard_state_dict(full.state_dict(), local)
    w13 = sd["block_sparse_moe.experts.routed_experts.w13_weight"]
    w2 = sd["block_sparse_moe.experts.routed_experts.w2_weight"]
    assert w13.shape == (16, 64, 64) and w2.shape == (16, 64, 32)
    assert torch.count_nonzero(w13[:, 16:32]) == 0 and torch.count_nonzero(w13[:, 48:64]) == 0
    assert torch.count_nonzero(w2[:, :, 16:]) == 0
    full_w13 = full.state_dict()["block_sparse_moe.experts.routed_experts.w13_weight"]
    assert torch.equal(w13[:, :16], full_w13[:, 48:64])  # rank 3's gate rows
    assert torch.equal(w13[:, 32:48], full_w13[:, 112:128])  # rank 3's up rows


def test_all_reduce_without_group_names_the_fix():
    x = torch.ones(2, 3)
    assert torch.equal(torch.ops.k3.all_reduce(x, "tp", 1), x)
    with pytest.raises(RuntimeError, match="no process group registered as 'nope'"):
        torch.ops.k3.all_reduce(x, "nope", 2)
