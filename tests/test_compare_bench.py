"""``examples/compare_bench.py`` on two real ``bench --json`` runs of layer 1 from the H200
(2026-12-03): the router GEMM on 64-row CTA tiles, then on 32-row ones."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
BEFORE, AFTER = DATA / "bench_layer1_64row_router.json", DATA / "bench_layer1_32row_router.json"
sys.path.insert(0, str(ROOT / "examples"))

import compare_bench  # noqa: E402


def _section(report: str, header: str) -> list[str]:
    block = report.split(header, 1)[1].split("\n\n", 1)[0]
    return block.splitlines()


def test_each_shape_and_kernel_side_by_side():
    report = compare_bench.compare(compare_bench.load(BEFORE), compare_bench.load(AFTER))
    # the layer's totals, straight from the two runs' rows
    assert "TP 16 batch 64 rewritten: 301.9 -> 312.1 us (+10.2, +3.4%), kernels 12 -> 12" in report
    assert "TP 8 batch 8 rewritten: 179.1 -> 190.3 us" in report
    rows = _section(report, "TP 16 batch 64 rewritten")
    assert "| router_down_gemm | 10.4 | 8.7 | -1.7, -16.3% |" in rows
    # the second of the layer's two AttnRes norms is matched with the other run's second
    assert "| attn_res_norm | 4.8 | 4.8 | +0.0, +0.0% |" in rows
    assert "| attn_res_norm #2 | 5.0 | 4.9 | -0.1, -1.8% |" in rows
    table = [line for line in rows if line.startswith("| ") and line != "| kernel | before us | after us | delta |"]
    assert len(table) == 15  # 12 kernels of ours + 3 torch stand-ins for the collectives, none hidden


def test_min_delta_hides_the_small_moves():
    report = compare_bench.compare(compare_bench.load(BEFORE), compare_bench.load(AFTER), min_delta=1.0)
    rows = _section(report, "TP 16 batch 64 rewritten")
    assert any("router_down_gemm" in line for line in rows)
    assert not any("attn_res_norm" in line for line in rows)
    assert "(12 kernels moved by less than 1.0 us)" in rows


def test_runs_of_different_layers_are_refused(tmp_path):
    other = json.loads(AFTER.read_text())
    other["layer"] = 3
    path = tmp_path / "layer3.json"
    path.write_text(json.dumps(other))
    with pytest.raises(compare_bench.CompareError, match="differ in layer: 1 against 3"):
        compare_bench.compare(compare_bench.load(BEFORE), compare_bench.load(path))


def test_the_command_names_bad_input(tmp_path):
    not_bench = tmp_path / "x.json"
    not_bench.write_text(json.dumps({"layers": []}))
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_bench.py"), str(BEFORE), str(not_bench)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "not the output of `python -m rewriter bench --json`" in run.stderr
    ok = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_bench.py"), str(BEFORE), str(AFTER),
                         "--min-delta", "0.5"], capture_output=True, text=True)
    assert ok.returncode == 0 and "router_down_gemm" in ok.stdout
