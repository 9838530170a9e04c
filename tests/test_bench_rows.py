"""``examples/bench_rows.py``: pieces parsed or refused by name, the warm-then-timed order under a
time budget (``bench`` itself replaced by a script that writes a run), and the table of runs
made of ``bench_cmd.Row`` rows as ``run_bench`` writes them."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import bench_rows  # noqa: E402

from rewriter.commands.bench import Row  # noqa: E402


def test_a_piece_names_its_layer_tp_cache_and_paths():
    piece = bench_rows.Piece.parse("3:16:fp8:rewritten+torch.compile")
    assert piece == bench_rows.Piece(3, 16, "fp8", ("rewritten", "torch.compile"))
    args = piece.bench_args([1, 8], 4096, 20, "default")
    assert args[args.index("--paths") + 1:args.index("--compile-mode")] == ["rewritten", "torch.compile"]
    assert args[args.index("--batch") + 1:args.index("--context")] == ["1", "8"]
    assert bench_rows.Piece.parse("0:8:bf16:cuda graph").name == "l0_tp8_bf16_cuda-graph"
    assert piece.name == "l3_tp16_fp8_rewritten_torch.compile"
    assert re.fullmatch(r"[\w.-]+", bench_rows.Piece.parse("3:8:bf16:rewritten+vllm-stock+cuda graph").name)


@pytest.mark.parametrize("text, says", [
    ("3:16:fp8", "LAYER:TP:CACHE:PATHS"), ("x:16:fp8:rewritten", "whole numbers"),
    ("3:0:fp8:rewritten", "TP at least 1"), ("3:16:fp16:rewritten", "cache 'fp16'"),
    ("3:16:fp8:rewritten+compiled", "['compiled']"), ("3:16:fp8:", "not among")])
def test_a_bad_piece_is_refused_by_name(text, says):
    with pytest.raises(bench_rows.PieceError) as e:
        bench_rows.Piece.parse(text)
    assert says in str(e.value) and repr(text) in str(e.value)


def _run(layer, attention, cache, rows):
    return {"device": "NVIDIA H100 80GB HBM3 (sm_90a)", "layer": layer, "attention": attention,
            "kv_cache_dtype": cache, "floor_tbps": 2.96,
            "rows": [{**asdict(r), "floor_pct": r.floor_pct} for r in rows]}


def test_the_table_has_a_row_per_shape_and_a_column_per_path():
    mla = _run(3, "mla", "fp8", [Row(16, 1, "rewritten", 13, 70.0, 35.0),
                                 Row(16, 1, "torch.compile", 180, 2371.1, 35.0),
                                 Row(16, 8, "rewritten", 13, 140.0, 80.0)])
    kda = _run(0, "kda", "bf16", [Row(8, 1, "rewritten", 7, 110.0, 100.0)])
    lines = bench_rows.table([mla, kda]).splitlines()
    assert lines[0] == ("| layer | cache | TP | batch | floor as served | rewritten (kernels) | x floor "
                        "| torch.compile (kernels) |")
    assert lines[2] == "| 3 | fp8 | 16 | 1 | 104 MB = 35.0 us | 70.0 (13) | 2.00x | 2371.1 (180) |"
    assert lines[3] == "| 3 | fp8 | 16 | 8 | 237 MB = 80.0 us | 140.0 (13) | 1.75x |  |"
    assert lines[4] == "| 0 |  | 8 | 1 | 296 MB = 100.0 us | 110.0 (7) | 1.10x |  |"  # a KDA layer has no MLA cache
    assert len(lines) == 5


def test_an_older_run_without_its_floor_bandwidth_shows_the_floor_in_us():
    run = json.loads((ROOT / "tests" / "data" / "bench_layer1_64row_router.json").read_text())
    lines = bench_rows.table([run]).splitlines()
    assert lines[2].startswith("| 1 |  | 16 | 8 | 51.4 us | 120.1 (12) | 2.34x |")
    assert len(lines) == 6


FAKE_BENCH = """
import json, sys
args = sys.argv[1:]
if "--json" in args:
    tp = int(args[args.index("--tp") + 1])
    print(json.dumps({"layer": int(args[args.index("--layer") + 1]), "attention": "mla", "kv_cache_dtype": "bf16",
                      "floor_tbps": 4.27, "rows": [{"tp": tp, "batch": 1, "path": "rewritten", "us": 50.0,
                                                   "kernels": 13, "floor_us": 25.0}]}))
"""


def test_pieces_warm_together_then_run_alone_until_the_time_is_spent(tmp_path, monkeypatch):
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE_BENCH)
    monkeypatch.setattr(bench_rows, "bench_command", lambda args: [sys.executable, str(fake), *args])
    said = []
    pieces = [bench_rows.Piece.parse(t) for t in ("3:16:bf16:rewritten", "3:8:bf16:rewritten")]
    written = bench_rows.run_pieces(pieces, tmp_path / "out", batches=[1], context=4096, reps=3,
                                    compile_mode="default", seconds=120, log=said.append)
    assert [p.name for p in written] == ["l3_tp16_bf16_rewritten.json", "l3_tp8_bf16_rewritten.json"]
    assert "| 3 | bf16 | 8 | 1 | 107 MB = 25.0 us | 50.0 (13) | 2.00x |" in bench_rows.table(
        [json.loads(p.read_text()) for p in written])
    assert {p.name for p in (tmp_path / "out").glob("*.warm.log")} == {"l3_tp16_bf16_rewritten.warm.log",
                                                                        "l3_tp8_bf16_rewritten.warm.log"}
    # too little time left: each piece is named and skipped, none started
    said.clear()
    assert bench_rows.run_pieces(pieces, tmp_path / "late", batches=[1], context=4096, reps=3,
                                 compile_mode="default", seconds=10, log=said.append) == []
    assert [s.split(":")[0] for s in said if "not run" in s] == ["l3_tp16_bf16_rewritten", "l3_tp8_bf16_rewritten"]
