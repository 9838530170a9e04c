"""``python -m rewriter decode``: the whole-model decode through reference and rewritten layers
(on a CPU the fused ops run their references: plumbing, state and the gate's arithmetic), and
the gate on error series that drift, spike or stay flat."""
from __future__ import annotations

import json
import re

import pytest
import torch

from rewriter.commands.cli import main
from rewriter.commands.decode import gate


def test_the_tiny_model_decodes_through_both_paths(capsys):
    assert main(["decode", "--model", "tiny", "--steps", "12", "--batch", "2", "--json"]) == 3  # too short to judge
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["layers"] == list(range(6)) and result["fused_ops"] > 20  # every layer rewritten
    rows = result["rows"]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["logits_err"] <= 1e-2 and r["tokens_agree"] for r in rows)
    assert all(r["state_err"] is not None for r in rows)
    # bf16 against fp32 (MXFP4 experts dequantized exactly): nonzero, so the yardstick is real
    assert all(r["fp32_logits_err"] > 1e-4 for r in rows)
    assert result["first_disagreement"] is None and result["gate"]["verdict"] == "too short"


def test_the_table_shows_checkpoints_and_the_verdict(capsys):
    """A run the gate judges (``MIN_STEPS``), through KDA, MoE and MLA layers with the fp32 reference."""
    assert main(["decode", "--model", "tiny", "--layers", "3", "--steps", "100", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "layers 0..2" in out and "first greedy disagreement: none" in out and "gate: passed" in out
    assert [line.split()[0] for line in out.splitlines() if line.split()[0].isdigit()] == ["1", "10", "100"]


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
                 "--no-fp32", "--json"]) == 3  # too short to judge
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


def _strict_json(text: str):
    """``json.loads`` that refuses the bare NaN / Infinity Python's json writes (not JSON)."""
    def refuse(name):
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_nan_in_the_rewritten_path_fails_the_gate_and_names_tensor_and_step(monkeypatch, capsys):
    """NaN compares false, so ``err > limit`` would let it pass: a rewritten path whose hidden
    state turns NaN from a random step on fails, naming the tensors and the first step, and the
    JSON stays valid (non-finite numbers written as strings)."""
    from rewriter.compiler.program import LayerRunner

    steps, layers = 6, 2
    poisoned_from = int(torch.randint(2, steps + 1, ()))
    calls = []
    run = LayerRunner.run

    def poisoned(self, *args, **kwargs):
        calls.append(None)
        hidden, *rest = run(self, *args, **kwargs)
        if len(calls) > (poisoned_from - 1) * layers:  # this runner is called once per layer per step
            hidden = torch.full_like(hidden, float("nan"))
        return (hidden, *rest)

    monkeypatch.setattr(LayerRunner, "run", poisoned)
    assert main(["decode", "--model", "tiny", "--layers", str(layers), "--steps", str(steps), "--batch", "1",
                 "--no-fp32", "--json"]) == 1
    (result,) = _strict_json(capsys.readouterr().out)["results"]
    gate = result["gate"]
    assert not gate["passed"]
    reasons = "; ".join(gate["reasons"])
    assert f"rewritten logits: NaN (first at step {poisoned_from})" in reasons, reasons
    assert "rewritten hidden" in reasons and "reference" not in reasons, reasons
    rows = result["rows"]
    assert all(isinstance(r["logits_err"], float) for r in rows[:poisoned_from - 1])
    assert all(r["logits_err"] == "NaN" for r in rows[poisoned_from - 1:])


def test_infinity_in_the_fp32_reference_fails_the_gate_and_prints_valid_json(monkeypatch, capsys):
    from rewriter.commands.decode import DecodeModel

    to_fp32 = DecodeModel.to_fp32
    row = int(torch.randint(0, 256, ()))  # tiny's vocabulary

    def poisoned(self):
        twin = to_fp32(self)
        twin.lm_head.data[row, int(torch.randint(0, twin.lm_head.shape[1], ()))] = float("inf")
        return twin

    monkeypatch.setattr(DecodeModel, "to_fp32", poisoned)
    assert main(["decode", "--model", "tiny", "--layers", "1", "--steps", "3", "--batch", "1", "--json"]) == 1
    (result,) = _strict_json(capsys.readouterr().out)["results"]
    reasons = "; ".join(result["gate"]["reasons"])
    assert "fp32 logits: infinity (first at step 1)" in reasons, reasons
    assert all(r["fp32_logits_err"] in ("NaN", "Infinity") for r in result["rows"])


def test_nan_in_a_kda_state_fails_the_gate_in_the_table(monkeypatch, capsys):
    """A state that turns NaN before it reaches the logits is named too (the tiny model's layers 0
    and 1 are KDA; the next step would carry it into the logits)."""
    from rewriter.compiler.program import LayerRunner

    run = LayerRunner.run

    def poisoned(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        for a in args:
            if a.dim() == 4 and a.dtype == torch.float32:  # the recurrent state [slots, H, V, K], slot 0 unused
                a[(int(torch.randint(1, a.shape[0], ())), *(int(torch.randint(0, n, ())) for n in a.shape[1:]))] \
                    = float("nan")
        return out

    monkeypatch.setattr(LayerRunner, "run", poisoned)
    assert main(["decode", "--model", "tiny", "--layers", "2", "--steps", "1", "--batch", "1", "--no-fp32"]) == 1
    out = capsys.readouterr().out
    assert ("gate: FAILED: rewritten layer 0 recurrent_state: NaN (first at step 1); "
            "rewritten layer 1 recurrent_state: NaN (first at step 1)") in out, out


def test_on_a_cpu_the_table_and_json_say_the_reference_is_compared_with_itself(capsys):
    """No GPU: the rewritten program's fused ops run their CPU references, so errors of 0 prove
    the graph, not the kernels; the table's header and the JSON say so."""
    argv = ["decode", "--model", "tiny", "--layers", "1", "--steps", "2", "--batch", "1", "--no-fp32"]
    main(argv)
    header = capsys.readouterr().out.splitlines()[:2]
    assert header[1] == ("no GPU: the rewritten path runs the fused ops' CPU references; errors of 0 show the "
                         "rewrite's graph equals the reference, not the kernels"), header
    main([*argv, "--json"])
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["fused_ops_run"] == "cpu references"
    assert all(r["logits_err"] == 0.0 for r in result["rows"])


def test_a_run_that_does_not_fit_in_memory_is_refused_in_one_line_before_anything_is_built(monkeypatch, capsys):
    """``--model kimi-k3 --layers 2 --tp 16`` holds about 24 GB of weights alone (bf16 and fp32
    models): on a 24 GB machine it was killed without a word. Refused with the estimate, what is
    available and what would fit; exit status 2, as for other bad input."""
    from rewriter.commands import decode

    available = float(torch.empty(()).uniform_(18, 24)) * 1e9  # 1 layer or --no-fp32 fits
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # system memory, on any machine
    monkeypatch.setattr(decode, "available_memory", lambda device: available, raising=False)

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(decode.DecodeModel, "__init__", built)
    assert main(["decode", "--model", "kimi-k3", "--layers", "2", "--tp", "16"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    match = re.fullmatch(r"error: decode needs about ([\d.]+) GB \(.*, \+20% margin\) but ([\d.]+) GB of system memory "
                         r"is available; would fit: --layers 1 \(([\d.]+) GB\) or --no-fp32 \(([\d.]+) GB\)", line)
    assert match, line
    need, have, one_layer, no_fp32 = map(float, match.groups())
    assert have == round(available / 1e9, 1) and 24 < need < 60  # the two models' weights alone are 23.5 GB
    assert max(one_layer, no_fp32) <= have


def test_the_memory_estimate_covers_what_a_small_run_holds():
    """The estimate against the tensors a tiny run really holds (the bf16 model, its fp32 twin,
    three paths' decode state): the weights exactly, the state to its pages' rounding, and the
    whole, with the modelled working memory of a step and the margin, within 3x."""
    from rewriter.commands.decode import DecodeModel, DecodeState, memory_estimate, needed
    from rewriter.model.config import KimiK3Config
    from rewriter.model.shape import DecodeShape

    cfg, batch, steps = KimiK3Config.preset("tiny"), int(torch.randint(1, 9, ())), int(torch.randint(1, 300, ()))
    ids = list(range(cfg.num_hidden_layers))
    ref = DecodeModel(cfg, ids, "mxfp4", torch.bfloat16, "cpu", seed=0)
    twin = ref.to_fp32()
    shape = DecodeShape(batch=batch)
    states = [DecodeState(m, batch, steps + 1, shape, seed=0) for m in (ref, ref, twin)]

    def held(tensors) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    weights = held([*ref.state_dict().values(), *twin.state_dict().values()])
    state = held([t for s in states for inputs in s.step_inputs for name, t in inputs.items()
                  if name in ("conv_state", "recurrent_state", "kv_cache")])
    parts = memory_estimate(cfg, ids, batch=batch, steps=steps, experts="mxfp4", kv_cache_dtype="bf16", fp32=True,
                            cuda=False)
    assert parts["bf16 weights"] + parts["fp32 weights"] == weights
    assert 0.9 * state <= parts["decode state"] <= state  # the KDA pages' 16-byte rounding aside
    assert weights + state <= needed(parts) <= 3 * (weights + state), (parts, weights, state)
