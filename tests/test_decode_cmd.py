"""``python -m rewriter decode``: the whole-model decode through reference and rewritten layers
(on a CPU the fused ops run their references: plumbing, state and the gate's arithmetic), and
the gate on error series that drift, spike or stay flat."""
from __future__ import annotations

import json

import pytest

from rewriter.commands.cli import main
from rewriter.commands.decode import gate


def test_the_tiny_model_decodes_through_both_paths_and_passes_the_gate(capsys):
    assert main(["decode", "--model", "tiny", "--steps", "12", "--batch", "2", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["layers"] == list(range(6)) and result["fused_ops"] > 20  # every layer rewritten
    rows = result["rows"]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["logits_err"] <= 1e-2 and r["tokens_agree"] for r in rows)
    assert all(r["state_err"] is not None for r in rows)
    # bf16 against fp32 (MXFP4 experts dequantized exactly): nonzero, so the yardstick is real
    assert all(r["fp32_logits_err"] > 1e-4 for r in rows)
    assert result["first_disagreement"] is None and result["gate"]["passed"]


def test_the_table_shows_checkpoints_and_the_verdict(capsys):
    assert main(["decode", "--model", "tiny", "--layers", "2", "--steps", "10", "--batch", "1", "--no-fp32"]) == 0
    out = capsys.readouterr().out
    assert "layers 0..1" in out and "first greedy disagreement: none" in out and "gate: passed" in out
    assert [line.split()[0] for line in out.splitlines() if line.strip()[:2] in ("1 ", "10")] == ["1", "10"]


def test_a_drifting_error_fails_the_gate_and_a_flat_one_with_a_spike_passes():
    flat = [1e-3] * 1000
    spiky = list(flat)
    spiky[500] = 0.4  # one routing near-tie broken the other way
    drift = [1e-3 * (1 + n / 20) for n in range(1000)]
    assert gate(flat)["passed"] and gate(spiky)["passed"]
    verdict = gate(drift)
    assert not verdict["passed"] and "the error grows" in verdict["reasons"][0]
    assert not gate([0.2] * 100)["passed"]  # above the ceiling throughout
    assert not gate([3e-2] * 100, bf16_errors=[1e-2] * 100)["passed"]  # 3x what bf16 itself costs
    assert gate([1.5e-2] * 100, bf16_errors=[1e-2] * 100)["passed"]
    # exact early (the same math), then a routing tie broken once and carried by the cache: a
    # rise that stays far below what bf16 itself costs against fp32 is not a failure
    assert gate([0.0] * 10 + [5e-2] * 90, bf16_errors=[0.3] * 100)["passed"]
    assert not gate([0.0] * 10 + [5e-2] * 90)["passed"]  # with no fp32 yardstick the floor decides
    # a random model where bf16 itself is 0.2 from fp32: a late 0.16 is at that level (the
    # ceiling follows it), unless the rewritten path is itself much further from fp32
    level = [0.2] * 100
    assert gate([0.16] * 100, bf16_errors=level, rewritten_fp32_errors=[0.22] * 100)["passed"]
    verdict = gate([0.16] * 100, bf16_errors=level, rewritten_fp32_errors=[0.5] * 100)
    assert not verdict["passed"] and "from fp32" in verdict["reasons"][0]
    assert not gate([0.5] * 100, bf16_errors=level)["passed"]  # 2.5x bf16's own cost: above the ceiling too


def test_a_tp_shard_runs_as_one_ranks_sizes_with_no_collective(capsys):
    assert main(["decode", "--model", "tiny", "--tp", "2", "--layers", "2", "--steps", "3", "--batch", "1",
                 "--no-fp32", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["model"].endswith("rank-of-tp2")
    assert all(r["logits_err"] == 0.0 for r in result["rows"])  # on a CPU the fused ops run the same math


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps 0"),
    (["--batch", "65"], "--batch 65"),
    (["--layers", "7"], "--layers 7 (1..6)"),
])
def test_bad_arguments_name_the_problem(capsys, argv, message):
    assert main(["decode", "--model", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err
