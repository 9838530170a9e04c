"""examples/compare_decode.py: parsing vLLM's saved benchmark results and the report.

The JSON fixtures in tests/data have the layout of vLLM 0.33's ``vllm bench serve
--save-result`` output (benchmarks/serve.py), with synthetic timings."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from conftest import example_module

ROOT = pathlib.Path(__file__).parent.parent
compare = example_module("compare_decode")


def test_summary_excludes_prefill_and_failed_requests():
    result = {"ttfts": [0.1, 0.2, 5.0], "latencies": [1.1, 2.2, 9.0], "output_lens": [101, 51, 10],
              "errors": ["", "", "timeout"], "output_throughput": 123.0}
    s = compare.summarize(result)
    assert s.requests == 2
    assert s.decode_tok_s_per_request == pytest.approx((100 / 1.0 + 50 / 2.0) / 2)  # median of two
    assert s.ttft_ms == pytest.approx(150.0)
    assert s.latency_ms == pytest.approx(1650.0)
    assert s.output_tok_s == 123.0


def test_summary_refuses_what_is_not_a_result():
    with pytest.raises(ValueError, match="missing 'ttfts'"):
        compare.summarize({"latencies": []})
    with pytest.raises(ValueError, match="more than one token"):
        compare.summarize({"ttfts": [0.1], "latencies": [0.2], "output_lens": [1], "output_throughput": 1.0})
    with pytest.raises(ValueError, match="no successful request"):
        compare.summarize({"ttfts": [0.1], "latencies": [0.2], "output_lens": [5], "output_throughput": 1.0,
                           "errors": ["boom"]})


def test_report_keeps_metrics_apart():
    a = compare.Summary(8, 400.0, 120.0, 300.0, 600.0)
    b = compare.Summary(8, 600.0, 100.0, 450.0, 400.0)
    table = compare.render({"auto": a, "latency_specialized": b})
    head, _, _, ratio = table.splitlines()
    for name in ("decode tok/s/req", "TTFT ms", "output tok/s", "latency ms"):
        assert name in head
    assert ratio.split()[-4:] == ["1.50x", "1.20x", "1.50x", "1.50x"]


def test_recorded_results_end_to_end():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_decode.py"), "--results",
                          str(ROOT / "tests/data/bench_serve_auto.json"),
                          str(ROOT / "tests/data/bench_serve_rewriter.json")],
                         check=True, capture_output=True, text=True).stdout
    rows = out.splitlines()
    assert rows[1].startswith("auto (stock)") and rows[1].split()[2] == "7"  # one failed request dropped
    assert rows[2].startswith("latency_specialized")
    assert float(rows[3].split()[3].rstrip("x")) > 1.5  # decode speedup on the recorded runs


def test_cli_needs_inputs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_decode.py")], capture_output=True, text=True)
    assert r.returncode == 2 and "give --results AUTO REWRITER" in r.stderr
