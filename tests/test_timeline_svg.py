"""The replay timeline drawn as SVG (``rewriter/commands/timeline_svg.py``, ``bench --svg``,
``examples/plot_timeline.py``): geometry checked against the numbers drawn, bad input refused
by name. The bench's own timelines need a GPU (``tests/test_variant.py`` draws one there)."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rewriter.commands.cli import main
from rewriter.commands.timeline_svg import (
    LABEL_W,
    PLOT_W,
    TORCH,
    TimelineError,
    colours,
    is_torch,
    panels_of,
    render,
    title_of,
)

ROOT = Path(__file__).resolve().parents[1]
NS = {"s": "http://www.w3.org/2000/svg"}


def _run(seed: int = 0) -> dict:
    """A bench --json run of two rows: the rewritten one with a timeline of fresh random
    kernels (one of them a torch kernel named with C++ punctuation), a vllm-stock one without."""
    import random

    rng = random.Random(seed)
    names = ["attn_res_norm", "product_gemv", "kda_core", "gemv<o_proj&norm>",
             "void at::native::vectorized_elementwise_kernel<4>", "expert_up_mxfp4"]
    timeline, start, last = [], 0.0, 0.0
    for name in names:
        duration = rng.uniform(1.0, 12.0)
        end = start + duration
        timeline.append([name, round(start, 2), round(duration, 2), round(max(0.0, end - last), 2)])
        last = max(last, end)
        start += rng.uniform(0.2, duration)  # the next one starts inside this one (PDL) or after it
    rows = [{"tp": 16, "batch": 1, "path": "rewritten", "us": last + 3.0, "floor_us": rng.uniform(5.0, 20.0),
             "timeline": timeline, "paired_diff_us": None},
            {"tp": 16, "batch": 1, "path": "vllm-stock", "us": 200.0, "floor_us": 23.4, "timeline": None}]
    return {"device": "NVIDIA H200 (sm_90a)", "model": "kimi-k3", "layer": 1, "q": 1, "rows": rows}


def _rects(root, cls):
    return [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == cls]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_kernel_is_a_bar_at_its_start_and_duration(seed):
    run = _run(seed)
    panels = panels_of(run)
    assert len(panels) == 1  # the row without a timeline draws nothing
    timeline = run["rows"][0]["timeline"]
    root = ET.fromstring(render(panels, title_of(run)))
    bars = _rects(root, "kernel")
    assert len(bars) == len(timeline)
    limit = max(panels[0].span_us, panels[0].floor_us, max(t + d for _, t, d, _ in timeline)) * 1.04
    scale = PLOT_W / limit
    for bar, (name, t, d, _) in zip(bars, timeline):
        assert float(bar.get("x")) == pytest.approx(LABEL_W + t * scale, abs=0.06)
        assert float(bar.get("width")) == pytest.approx(d * scale, abs=0.06)
        assert bar.find("s:title", NS).text.startswith(name)  # the whole name in the tooltip, unescaped by XML
    # the strip lays the span out: the additions end to end reach the layer's last end
    strip = _rects(root, "added")
    assert sum(float(r.get("width")) for r in strip) == pytest.approx(panels[0].span_us * scale, abs=0.1)
    last_end = max(t + d for _, t, d, _ in timeline)
    assert panels[0].span_us == pytest.approx(last_end, abs=0.05)
    floor = next(e for e in root.iter("{http://www.w3.org/2000/svg}line") if e.get("class") == "floor")
    assert float(floor.get("x1")) == pytest.approx(LABEL_W + run["rows"][0]["floor_us"] * scale, abs=0.06)


def test_torch_kernels_are_grey_and_ours_each_keep_their_own_colour():
    run = _run()
    run["rows"].append({**run["rows"][0], "path": "variant", "timeline": run["rows"][0]["timeline"][::-1]})
    panels = panels_of(run)
    colour = colours(panels)
    assert colour["void at::native::vectorized_elementwise_kernel<4>"] == TORCH
    ours = [c for name, c in colour.items() if not is_torch(name)]
    assert len(ours) == 5 and len(set(ours)) == 5 and TORCH not in ours
    root = ET.fromstring(render(panels, "t"))
    fills = {}
    for bar in _rects(root, "kernel"):  # both panels: a name, one colour
        fills.setdefault(bar.find("s:title", NS).text.split(":")[0], set()).add(bar.get("fill"))
    assert all(len(f) == 1 for f in fills.values()) and len(fills) == 6
    assert "gemv&lt;o_proj&amp;norm&gt;" in render(panels, "t")


def test_a_variant_row_says_its_paired_difference():
    run = _run()
    run["rows"].append({**run["rows"][0], "path": "variant", "paired_diff_us": -1.25})
    panels = panels_of(run)
    assert [p.heading for p in panels] == ["TP 16, batch 1, rewritten",
                                           "TP 16, batch 1, variant (-1.2 us against the tree, paired median)"]
    assert len(_rects(ET.fromstring(render(panels, "t")), "kernel")) == 2 * len(run["rows"][0]["timeline"])


@pytest.mark.parametrize("run,message", [
    ({"rows": "x"}, "no 'rows' list"),
    ([1, 2], "no 'rows' list"),
    ({"rows": [{"tp": 16, "timeline": None}]}, "no row carries a replay timeline"),
    ({"rows": [{"tp": 16, "batch": 8, "timeline": [["k", "soon", 1, 1]]}]}, "TP 16 batch 8: a timeline entry"),
])
def test_bad_runs_are_refused_by_name(run, message):
    with pytest.raises(TimelineError, match=message):
        panels_of(run)


def test_plot_timeline_draws_a_saved_run_and_refuses_a_bad_one(tmp_path):
    good, bad, out = tmp_path / "run.json", tmp_path / "bad.json", tmp_path / "layer.svg"
    good.write_text(json.dumps(_run()))
    bad.write_text(json.dumps({"rows": []}))
    script = [sys.executable, str(ROOT / "examples" / "plot_timeline.py")]
    ok = subprocess.run([*script, str(good), "-o", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert len(_rects(ET.parse(out).getroot(), "kernel")) == 6
    failed = subprocess.run([*script, str(bad), "-o", str(tmp_path / "no.svg")], capture_output=True, text=True)
    assert failed.returncode == 2 and "no row carries a replay timeline" in failed.stderr
    assert not (tmp_path / "no.svg").exists()


def test_bench_refuses_an_svg_path_it_cannot_write(capsys, tmp_path):
    assert main(["bench", "--svg", str(tmp_path / "missing" / "layer.svg")]) == 2
    assert "no folder" in capsys.readouterr().err
