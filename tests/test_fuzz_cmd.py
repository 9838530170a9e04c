"""``python -m rewriter fuzz``: random steps (layers, batches, verify q, contexts, pages, padding
rows) rewritten and checked against the reference; the outcomes it tells apart."""
from __future__ import annotations

import random

import pytest
import torch

from rewriter.commands.cli import main
from rewriter.commands.fuzz import draw, fuzz
from rewriter.compiler.program import LayerRunner
from rewriter.model.config import KimiK3Config


def test_random_steps_are_rewritten_and_match_the_reference(capsys):
    assert main(["fuzz", "--model", "tiny", "--steps", "10", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "ok                   10" in out and "mismatch              0" in out


def test_fuzz_draws_from_the_first_layers_at_one_ranks_sizes(capsys):
    assert main(["fuzz", "--model", "tiny", "--layers", "2", "--tp", "2", "--steps", "4", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "tiny/rank-of-tp2" in out and "ok                    4" in out
    assert main(["fuzz", "--model", "tiny", "--layers", "99"]) != 0
    assert "bad value: --layers 99 (1..6)" in capsys.readouterr().err


def test_the_draws_cover_the_step_space():
    cfg, rng = KimiK3Config.preset("tiny"), random.Random(0)
    steps = [draw(rng, cfg, list(range(cfg.num_hidden_layers))) for _ in range(300)]
    assert {s["layer"] for s in steps} == set(range(cfg.num_hidden_layers))
    assert {1, 2, 4, 8} <= {s["q"] for s in steps} and any(s["padding"] for s in steps)
    assert all(1 <= s["batch"] * s["q"] <= 64 for s in steps) and max(s["batch"] for s in steps) == 64
    assert any(s["q"] > 1 for s in steps if cfg.attention_kind(s["layer"]) == "mla")  # MLA verify too


@pytest.mark.parametrize("perturb,outcome", [
    (lambda t: t * 1.1, "mismatch"),  # a wrong answer
    (lambda t: t + 1e-4 * torch.randn_like(t) * t.abs().mean(), "nondeterministic"),  # a different one each run
])
def test_a_wrong_or_unrepeatable_program_is_counted_as_such(monkeypatch, perturb, outcome):
    run = LayerRunner.run
    monkeypatch.setattr(LayerRunner, "run", lambda self, *a, **k: tuple(perturb(t) for t in run(self, *a, **k)))
    counts, odd = fuzz(KimiK3Config.preset("tiny"), 3, 1, "bf16", "cpu", "sm_90a")
    assert counts[outcome] == 3 and all(o == outcome for _, o, _ in odd)


def test_the_routers_topk_gaps_are_recorded_for_the_comparison():
    """``recorded_topk_margins``: one gap per token of an MoE layer's router (k-th minus (k+1)-th
    selection score, >= 0), none for the dense layer; the router is itself again afterwards."""
    from rewriter.model.layers import build_layer, moe
    from rewriter.model.layers.state import decode_inputs
    from rewriter.model.layers.weights import init_random_
    from rewriter.model.shape import DecodeShape

    cfg = KimiK3Config.preset("tiny")
    real = moe.route
    for index, calls in ((1, 1), (0, 0)):
        layer = init_random_(build_layer(cfg, index, device="cpu"), seed=index)
        inputs = decode_inputs(layer, DecodeShape(batch=5), device="cpu", seed=1)
        with torch.no_grad(), moe.recorded_topk_margins() as margins:
            layer(**inputs)
        assert len(margins) == calls and moe.route is real
        if calls:
            assert margins[0].shape == (5,) and (margins[0] >= 0).all() and (margins[0] > 0).any()


@pytest.mark.parametrize("where", ["output", "state"])
def test_a_step_whose_output_or_state_holds_nan_or_inf_is_a_nonfinite_failure_naming_it(monkeypatch, capsys, where):
    """NaN compares false and is never equal to itself: without an explicit check a NaN output
    passed the tolerance and read as 'nondeterministic' (an infinity as 'mismatch', a NaN in a
    state as 'ok'). It is a failure of its own kind that names the tensor, in the counts, the
    listed steps and the exit status."""
    run = LayerRunner.run
    bad = float(["nan", "inf", "-inf"][int(torch.randint(0, 3, ()))])

    def poisoned(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        if where == "output":
            out = (out[0], out[1].clone().index_fill_(0, torch.tensor([0]), bad), out[2])  # prefix, token 0
        else:
            state = next(a for a in args[3:] if a.dim() == 3)  # the conv state (KDA) or the latent cache (MLA)
            state[-1, 0, 0] = bad
        return out

    monkeypatch.setattr(LayerRunner, "run", poisoned)
    counts, odd = fuzz(KimiK3Config.preset("tiny"), 4, int(torch.randint(0, 1000, ())), "bf16", "cpu", "sm_90a",
                       layer_ids=[1, 2])  # KDA and MLA: both hold a 3-d state
    assert counts["nonfinite"] == 4 and counts["nondeterministic"] == 0, counts
    name = "rewritten prefix" if where == "output" else ("rewritten conv_state", "rewritten kv_cache")
    assert all(o == "nonfinite" and detail.startswith(name) for _, o, detail in odd), odd
    monkeypatch.setattr("rewriter.commands.fuzz.fuzz", lambda *a, **k: (counts, odd))
    assert main(["fuzz", "--model", "tiny", "--steps", "4"]) == 1
    assert "nonfinite             4" in capsys.readouterr().out
