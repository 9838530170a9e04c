"""python -m rewriter inspect: the JSON contract, the table, --dot, and errors that name the problem."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

import patterns.attn_res
import patterns.dense_mlp
import patterns.mla
import patterns.moe  # noqa: F401  (defines the k3f ops used here)
from rewriter.commands.cli import main
from rewriter.compiler.stock_kernels import layer_kernels

CONTRACT = {"model", "layer", "layer_kind", "tp", "batch", "default_kernels", "rewritten_kernels", "matches",
            "refusals", "schedule", "hbm_floor_us"}


def _inspect(capsys, *args):
    assert main(["inspect", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("layer,kind", [(0, "dense"), (1, "kda"), (3, "mla")])
@pytest.mark.parametrize("tp", [1, 8, 16])
@pytest.mark.parametrize("batch", [1, 64])
def test_inspect_json_contract(capsys, layer, kind, tp, batch):
    report = json.loads(_inspect(capsys, "--model", "kimi-k3", "--layer", str(layer), "--tp", str(tp),
                                 "--batch", str(batch), "--json"))
    assert CONTRACT <= report.keys()
    assert (report["layer"], report["layer_kind"], report["tp"], report["batch"]) == (layer, kind, tp, batch)
    assert report["default_kernels"] == layer_kernels(kind, tp=tp, tokens=batch, arch="sm_100a")
    assert report["rewritten_kernels"] == sum(k["launches"] for k in report["schedule"])
    assert report["fused_ops"] == sum(k["source"].startswith("fused:") for k in report["schedule"])
    # every layer kind within the 13 kernels of vLLM's hand-written path
    assert report["rewritten_kernels"] <= 13
    # the only refusals: the shared experts' rule for the other batch range (its twin matched);
    # the input projection and the dense MLP are one rule at every batch
    small = batch <= 1
    others = {f"shared_experts.{'large' if small else 'small'}"}
    # and, below its 16 tokens, the router with the MXFP4 experts per chosen expert
    others |= {"routed_moe_mxfp4"} if batch < patterns.moe.MOE_BY_EXPERT_FROM else set()
    assert {r["rule"] for r in report["refusals"]} <= others
    present = {"dense_mlp"} if kind == "dense" else {f"shared_experts.{'small' if small else 'large'}"}
    assert present | {"attn_in_proj"} <= {m["rule"] for m in report["matches"]}
    families = {m["family"] for m in report["matches"]}
    if kind != "dense":
        assert {"attn_res", "input_projection", kind, "output_projection", "router", "moe"} <= families
    assert all({"kernel", "stream", "bytes"} <= row.keys() for row in report["schedule"])
    assert all({"rule", "nodes"} <= m.keys() for m in report["matches"])
    assert report["hbm_floor_us"] > 0
    assert report["hbm_floor_us"] == pytest.approx(report["floor_bytes"] / 4.27e6)


def test_table_graph_and_dot(capsys, tmp_path):
    dot = tmp_path / "layer.dot"
    out = _inspect(capsys, "--layer", "3", "--tp", "8", "--batch", "4", "--dot", str(dot), "--nodes", "--graph")
    assert "kimi-k3 layer 3 (mla), TP 8" in out and "HBM floor" in out
    assert "match   mla_q_front" in out and "event: aux stream waits" in out
    assert "graph before:" in out and "torch.ops.k3f.mla_q_front" in out  # --graph prints both graphs' code
    assert "[mla_q_front]" in out  # --nodes lists the rewritten graph's nodes with their rule
    before, after = dot.read_text(), (tmp_path / "layer.after.dot").read_text()
    assert before.startswith("digraph") and 'subgraph "cluster_mla.decode"' in before and "->" in before
    assert "k3f.mla_q_front" in after and "k3f" not in before


def test_the_readmes_inspect_sample_is_what_inspect_prints(capsys):
    """The README's table of the KDA+MoE layer at TP 16, batch 1 (its first lines, down to the
    schedule's events) is this program's output, not a stale copy."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    intro = "The KDA+MoE layer at TP 16, batch 1:\n\n```\n"
    assert intro in readme
    sample = readme.split(intro, 1)[1].split("```", 1)[0]
    out = _inspect(capsys, "--model", "kimi-k3", "--layer", "1", "--tp", "16", "--batch", "1")
    assert out.startswith(sample), "README.md's inspect sample differs from `inspect --layer 1 --tp 16 --batch 1`"


def test_batch_outside_the_rules_is_refused_and_stays_stock(capsys):
    report = json.loads(_inspect(capsys, "--layer", "1", "--tp", "8", "--batch", "128", "--json"))
    assert report["matches"] == []
    assert report["rewritten_kernels"] == report["default_kernels"]
    reasons = {r["reason"] for r in report["refusals"]}
    assert "batch 128 > 64: rules are specialized for decode batches of 1..64 tokens" in reasons


def test_no_rules_shows_the_stock_layer(capsys):
    report = json.loads(_inspect(capsys, "--layer", "1", "--no-rules", "--json"))
    assert report["matches"] == [] and report["rewritten_kernels"] == report["default_kernels"]


def test_hopper_and_bandwidth_options(capsys):
    a = json.loads(_inspect(capsys, "--tp", "16", "--arch", "sm_90a", "--hbm-tbps", "2.0", "--json"))
    b = json.loads(_inspect(capsys, "--tp", "16", "--json"))
    assert a["default_kernels"] == layer_kernels("kda", tp=16, tokens=1, arch="sm_90a")
    assert a["hbm_floor_us"] == pytest.approx(b["hbm_floor_us"] * 4.27 / 2.0)


@pytest.mark.parametrize("args,message", [
    (["--layer", "93"], "layer 93 out of range: kimi-k3 has layers 0..92"),
    (["--tp", "7"], "TP size 7 does not divide linear_attn_config.num_heads (96)"),
    (["--model", "kimi-k9"], "'kimi-k9' is neither a preset"),
    (["--tp", "2", "--rank", "2"], "DecodeShape.rank must be in 0..1 for TP 2, got 2"),
    (["--hbm-tbps", "0"], "--hbm-tbps must be positive"),
    (["--model", "kimi-linear-48b"], "the reference layers do not implement"),
])
def test_errors_name_the_problem(capsys, args, message):
    assert main(["inspect", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_argparse_rejects_bad_numbers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--batch", "0"])
    assert e.value.code == 2 and "expected a positive integer, got 0" in capsys.readouterr().err


def test_python_dash_m_and_console_script():
    cmd = [sys.executable, "-m", "rewriter", "inspect", "--layer", "1", "--tp", "16", "--json"]
    report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert report["layer_kind"] == "kda"
    script = shutil.which("k3-rewriter")
    if script:  # installed by pip install -e .
        out = subprocess.run([script, "inspect", "--layer", "0"], check=True, capture_output=True, text=True).stdout
        assert "(dense)" in out


def test_example_runs():
    import pathlib
    example = pathlib.Path(__file__).parent.parent / "examples" / "inspect_layer.py"
    out = subprocess.run([sys.executable, str(example)], check=True, capture_output=True, text=True).stdout
    assert "layer 1 (kda)" in out and "floor:" in out


def test_custom_rule_example(capsys, tmp_path):
    import pathlib
    example = pathlib.Path(__file__).parent.parent / "examples" / "custom_rule.py"
    out = subprocess.run([sys.executable, str(example)], check=True, capture_output=True, text=True).stdout
    from patterns import default_rules
    n = len(default_rules())
    assert f"{n} rules: 12 kernels" in out and f"{n + 1} rules: 11 kernels" in out
    report = json.loads(_inspect(capsys, "--layer", "1", "--tp", "16", "--rules", str(example), "--json"))
    assert "topk_routed_experts" in {m["rule"] for m in report["matches"]}
    assert report["rewritten_kernels"] == 11
    bad = tmp_path / "bad_rules.py"
    bad.write_text("RULES = 3\n")
    assert main(["inspect", "--rules", str(bad)]) == 2
    assert "must define RULES, a list of rewriter.compiler.rules.Rule" in capsys.readouterr().err
    assert main(["inspect", "--rules", str(tmp_path / "missing.py")]) == 2
    assert "rules file not found" in capsys.readouterr().err


def test_inspect_all_layers_reports_every_layer(capsys, k3):
    """One row per layer of Kimi K3: its kind, whether the server would run it as a program
    (every kernel a CuTe DSL template's), its kernels, and why not."""
    report = json.loads(_inspect(capsys, "--model", "kimi-k3", "--all-layers", "--tp", "16", "--json"))
    rows = report["layers"]
    assert [r["layer"] for r in rows] == list(range(93))
    for r in rows:
        assert set(r) >= {"layer", "layer_kind", "rewritten", "default_kernels", "rewritten_kernels", "reason"}
        assert r["layer_kind"] == k3.layer_kind(r["layer"])
        assert r["rewritten"] == (r["reason"] is None) and (r["rewritten_kernels"] <= 13 or not r["rewritten"])
    kda = [r for r in rows if r["layer_kind"] == "kda"]
    assert all(r["rewritten"] and r["rewritten_kernels"] == 12 and r["default_kernels"] == 23 for r in kda)
    assert len(kda) == 68 and report["rewritten_layers"] == 93  # every layer, on its own kernels
    assert rows[0]["rewritten"] and rows[0]["rewritten_kernels"] == 7  # the dense layer 0
    mla = [r for r in rows if r["layer_kind"] == "mla"]
    assert len(mla) == 24 and all(r["rewritten"] and r["rewritten_kernels"] == 13 for r in mla)
    assert report["total_served_kernels"] == sum(r["rewritten_kernels"] if r["rewritten"] else r["default_kernels"]
                                                 for r in rows)
    table = _inspect(capsys, "--model", "tiny", "--all-layers")  # below the kernels' sizes: every layer says why
    assert "0 of 6 layers rewritten" in table
    # its input projection's hand-written template refuses K 64, and a generated kernel serves it:
    # the first op left without a kernel is the KDA core, its head_dim 16
    assert "    4  kda   no             20       12  refused by the kda_core template: head_dim 16" in table
    assert main(["inspect", "--all-layers", "--dot", "x.dot"]) == 2
    assert "--all-layers prints one row per layer; --dot take one --layer" in capsys.readouterr().err


def test_inspect_all_layers_for_a_gpu_of_fewer_sms(capsys):
    """``--sms 78``: which layers a server on an H20 runs as programs. At TP 4 and 64 tokens the
    MLA layers' 2 head groups need 128 CTAs resident at once, more than its SMs."""
    table = _inspect(capsys, "--model", "kimi-k3", "--all-layers", "--tp", "4", "--batch", "64", "--arch", "sm_90a",
                     "--sms", "78")
    assert "sm_90a (78 SMs)" in table and "69 of 93 layers rewritten" in table
    assert re.search(r"\n\s+3  mla   no .*more CTAs than the 78 SMs of the GPU hold", table)
    assert main(["inspect", "--tp", "4", "--sms", "78"]) == 2
    assert "--sms goes with --all-layers" in capsys.readouterr().err


@pytest.mark.parametrize("tp,batch,rewritten", [(4, 64, 93), (1, 1, 93), (1, 64, 69), (2, 64, 69), (3, 8, 93),
                                                 (12, 64, 93), (48, 1, 93), (32, 1, 93), (32, 8, 93)])
def test_every_layer_is_rewritten_at_other_tp_sizes(capsys, tp, batch, rewritten):
    """What the README says of TP sizes other than 8 and 16: every layer of Kimi K3 on its own
    kernels, 13 at most (at TP 4 and below the down stage's wider CTAs; at 32 o_proj's GEMM at one
    token, 96 live expert channels in two tiles, the shared experts' rows on 8 lanes; at 3, 6, 12,
    24 and 48 the router and the latent tail read every row; from 17 heads a rank `mla_attend`
    takes them in groups of 16), but for what keeps the stock forward, named: the 24 MLA layers
    where tokens x head groups exceed the 128 CTAs of its grid barrier (TP 2 and 1 at 64 tokens)."""
    report = json.loads(_inspect(capsys, "--model", "kimi-k3", "--all-layers", "--tp", str(tp), "--batch", str(batch),
                                 "--json"))
    stock = [r for r in report["layers"] if not r["rewritten"]]
    assert report["rewritten_layers"] == rewritten, [r["reason"] for r in stock][:3]
    assert max(r["rewritten_kernels"] for r in report["layers"]) <= 13
    if tp <= 2 and batch == 64:
        assert {r["layer_kind"] for r in stock} == {"mla"} and len(stock) == 24
        assert all(f"64 tokens x {6 // tp} head groups of 16 heads" in r["reason"] for r in stock)
    else:
        assert not stock


MISSING = ("no GPU kernel for topk_routed_experts: no hand-written CuTe DSL template; not generated: not lowered: "
           "aten.topk.default (node topk) has no lowering")


def test_a_fused_op_without_a_gpu_kernel_is_not_a_win(capsys):
    """The custom rule's op has no hand-written template, and its reference (top-k routing) does not
    lower into a generated one: 12 -> 11 kernels on paper, but a server keeps the layer on vLLM's
    stock forward, and the headline (table and JSON) says so and why."""
    args = ["--layer", "1", "--tp", "16", "--rules", "examples/custom_rule.py"]
    report = json.loads(_inspect(capsys, *args, "--json"))
    assert CONTRACT <= report.keys() and report["rewritten_kernels"] == 11
    assert (report["served"], report["fused_ops_without_kernel"]) == (False, 1)
    assert report["not_served_reason"].startswith(MISSING)
    assert report["served_kernels"] == report["default_kernels"] == 23
    status = {row["kernel"]: (row["plan_status"], row["implementation"]) for row in report["schedule"]}
    assert status["topk_routed_experts"] == ("missing", "missing")
    generated = ("router_down", "attn_in_proj")  # the router's and the input projection's only kernels
    assert {s for k, s in status.items() if k not in ("topk_routed_experts", *generated)} == \
        {("pending", "hand-written")}
    assert all(status[k] == ("pending", "generated") for k in generated)
    table = _inspect(capsys, *args).splitlines()
    # the rule is tried before the built-in routed MoE rule of the same size: it takes those nodes
    assert table[1] == ("kernels: 23 stock -> 11 rewritten (8 fused ops, 8 matches, 0 refusals); "
                        "1 fused op without a GPU kernel")
    assert table[2].startswith("not served: a server keeps this layer on vLLM's stock forward (23 kernels): "
                               + MISSING[:60])
    assert any(line.endswith("fused:topk_routed_experts (2 kernels) [no GPU kernel]") for line in table)


def test_a_layer_no_rule_touched_says_why_in_one_short_line(capsys):
    """With no rules every region stays stock: the reason names the first regions and counts the
    rest, instead of listing every stock kernel vLLM would launch."""
    report = json.loads(_inspect(capsys, "--layer", "1", "--tp", "16", "--no-rules", "--json"))
    assert report["not_served_reason"] == ("no rule fuses attn_res.pre_attn, kda.in_proj, kda.f_b_proj, kda.core and "
                                           "10 more (their reference ops would run in the served step)")


def test_shapes_a_kernel_refuses_leave_the_layer_stock(capsys):
    """9 tokens per request is beyond the kernels' 8: every rule still matches, but the KDA core's
    template refuses, so the layer would run stock; the headline says so and names the reason."""
    report = json.loads(_inspect(capsys, "--layer", "1", "--tp", "16", "--q", "9", "--json"))
    assert not report["served"] and report["fused_ops_without_kernel"] == 1
    assert report["not_served_reason"].startswith("refused by the kda_core template: 9 tokens per request outside "
                                                  "1..8; not generated: not lowered: k3.kda_conv_verify.default")
    assert [row["plan_status"] for row in report["schedule"] if row["kernel"] == "kda_core"] == ["refused"]
    table = _inspect(capsys, "--layer", "1", "--tp", "16", "--q", "9")
    assert ("\nnot served: a server keeps this layer on vLLM's stock forward (23 kernels): refused by the kda_core "
            "template: 9 tokens per request outside 1..8; not generated") in table
    served = json.loads(_inspect(capsys, "--layer", "1", "--tp", "16", "--q", "8", "--json"))
    assert served["served"] and served["not_served_reason"] is None and served["fused_ops_without_kernel"] == 0
    assert served["served_kernels"] == served["rewritten_kernels"]
    assert {row["plan_status"] for row in served["schedule"]} == {"pending"}


def test_the_readmes_python_snippet_runs(capsys):
    """The README's Python example, run as written (it once called ``print_tabular``, which needs a
    package this project does not install)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    intro = "From Python, the same pipeline (meta tensors: nothing allocated):\n\n```python\n"
    assert intro in readme
    exec(compile(readme.split(intro, 1)[1].split("```", 1)[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "torch.ops.k3f.kda_core" in out and "'attn_in_proj'" in out
