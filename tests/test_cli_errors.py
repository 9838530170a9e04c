"""What a new user hits first: options the CLI offers but cannot honour, bad numbers and bad
config files (one line naming the value, exit status 2), a rules file loaded more than once,
``--rules`` with ``compile --all-layers``, and output piped into a reader that stops early."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rewriter.commands.cli import main
from rewriter.compiler.rules import RuleError, load_rules_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_rule.py"


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err[:500]
    return err.strip()


@pytest.mark.parametrize("command", ["inspect", "compile"])
def test_dtype_offers_bf16_only(capsys, command):
    """The released model and every kernel are bf16 (the vLLM plugin refuses other dtypes):
    ``--help`` offers bf16 alone, and ``--dtype fp16`` is argparse's one-line error, exit 2."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--dtype {bf16}" in out and "fp16" not in out and "fp32" not in out
    for dtype in ("fp16", "fp32"):
        with pytest.raises(SystemExit) as e:
            main([command, "--dtype", dtype])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument --dtype: invalid choice: '{dtype}'" in err and "Traceback" not in err
    assert main(["inspect", "--dtype", "bf16", "--layer", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bf16"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
@pytest.mark.parametrize("all_layers", [False, True])
def test_hbm_tbps_must_be_a_positive_finite_number(capsys, value, all_layers):
    assert main(["inspect", f"--hbm-tbps={value}", *(["--all-layers"] if all_layers else [])]) == 2
    assert f"--hbm-tbps must be positive and finite, got {float(value)}" in _one_error_line(capsys)


def _config(tmp_path, edit) -> str:
    """The Kimi K3 preset's file, edited, as a config.json of its own."""
    from importlib import resources

    text = resources.files("rewriter.model.configs").joinpath("kimi-k3.json").read_text()
    data = edit(text)
    assert data != text.encode()
    path = tmp_path / "config.json"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.encode("utf-16"), "not UTF-8 text"),
    (lambda t: t.replace('"vocab_size": 163840', '"vocab_size": 0').encode(),
     "field vocab_size must be positive, got 0"),
    (lambda t: t.replace('"routed_scaling_factor": 1.0', '"routed_scaling_factor": Infinity').encode(),
     "field routed_scaling_factor must be a finite number, got inf"),
    (lambda t: t.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN').encode(),
     "field rms_norm_eps must be a finite number, got nan"),
    (lambda t: t.replace('"num_hidden_layers": 93', '"num_hidden_layers": 1000').encode(),
     "layers [94, 95, 96, 97, 98, 99, 100, 101, ... (907 in all)] are in neither"),
])
def test_a_bad_config_file_is_one_line(capsys, tmp_path, edit, message):
    path = _config(tmp_path, edit)
    assert main(["inspect", "--model", path]) == 2
    line = _one_error_line(capsys)
    assert path in line and message in line and len(line) < 300, line[:400]


def test_a_rules_file_loaded_twice_is_loaded_once():
    """A rules file defines its ``k3f::`` ops when it runs: a second run would replace them under
    the graphs already made with them (a traceback or a segfault later). The same file, unchanged,
    gives back the same rules."""
    first, again = load_rules_file(EXAMPLE), load_rules_file(ROOT / "examples" / ".." / "examples" / "custom_rule.py")
    assert [r.name for r in first] == ["topk_routed_experts"] and all(a is b for a, b in zip(first, again))


def test_a_second_definition_of_a_fused_op_is_refused(tmp_path):
    """Another file (or this one, changed) defining a ``k3f::`` op this process already has is
    refused, naming the op (torch would drop the first from under the graphs made with it)."""
    load_rules_file(EXAMPLE)
    copy = tmp_path / "my_rules.py"
    copy.write_text(EXAMPLE.read_text())
    with pytest.raises(RuleError) as e:
        load_rules_file(copy)
    assert str(e.value) == (f"rules file {copy} failed to import: RuleError: k3f::topk_routed_experts is already "
                            "defined in this process (a fused op is defined once: give it another name)")


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewriter", *args], capture_output=True, text=True, cwd=ROOT, **kw)


def test_inspect_all_layers_with_a_rules_file():
    """End to end, as a user runs it: the rules file is loaded once for the 24 layer structures,
    and every layer says why the server would keep it stock."""
    p = _run("inspect", "--model", "kimi-k3", "--tp", "16", "--all-layers", "--rules", "examples/custom_rule.py")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]
    assert "1 of 93 layers rewritten" in p.stdout  # the dense layer 0: no routed experts for the rule to take
    assert p.stdout.count("no GPU kernel for topk_routed_experts: no hand-written CuTe DSL template; not generated: "
                          "not lowered: aten.topk.default (node topk) has no lowering") == 92


def test_compile_all_layers_plans_the_rules_files(tmp_path):
    """``compile --all-layers`` plans with the ``--rules`` files too (its worker processes load
    them) and says so; the custom rule's op has no template, so no layer with routed experts is
    served. ``--dry-run``: nothing is compiled."""
    p = _run("compile", "--all-layers", "--dry-run", "--rules", "examples/custom_rule.py", "--tp", "16",
             "--batches", "1", "--jobs", "4", "--cache-dir", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    assert summary["rules_files"] == [str(EXAMPLE)]
    assert summary["layers_served"] == 1 and summary["compiled"] == 0  # the dense layer 0 only
    assert {r.split(" (docs")[0] for r in summary["refusals"].values()} == {
        "no GPU kernel for topk_routed_experts: no hand-written CuTe DSL template; not generated: not lowered: "
        "aten.topk.default (node topk) has no lowering: the programs take pointwise arithmetic, activations, casts, "
        "reductions over a token's row and matrix products by weights"}
    assert len(summary["refusals"]) == 23  # every structure but the dense layer's, at batch 1
    assert f"rules added from {EXAMPLE}" in p.stderr
    assert "not served: 23 plans: no GPU kernel for topk_routed_experts" in p.stderr
    assert not (tmp_path / "programs").exists()  # graphs of user rules are not the server's: not cached


def test_output_into_a_closed_pipe_ends_quietly():
    """``inspect ... | head -3``: once the reader is gone the command stops, with no error message,
    and exits 141 (128 + SIGPIPE, what a shell reports for ``yes | head -3``)."""
    proc = subprocess.Popen([sys.executable, "-m", "rewriter", "inspect", "--layer", "1", "--tp", "16", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # the reader stops early; the rest of the JSON (75 kB) meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err[-2000:]
