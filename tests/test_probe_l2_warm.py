"""``examples/probe_l2_warm.py``: the prefetch reads whole 128-byte lines from each row's start,
and a bad fraction or a negative read between is refused before anything runs (CPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import cute_example, needs_cutedsl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # its `from bench_kernels import`


@needs_cutedsl
def test_the_prefetch_reads_whole_lines_of_each_rows_start():
    probe, _ = cute_example("probe_l2_warm")
    assert [probe.warm_columns(f) for f in (0.0, 0.25, 0.5, 1.0)] == [0, 1792, 3584, 7168]
    assert probe.warm_columns(0.3) * 2 % 128 == 0
    w = torch.arange(4 * 7168, dtype=torch.float32).reshape(4, 7168)
    sink = torch.empty(())
    probe.prefetch(w, 64, sink)
    assert sink.item() == w[:, :64].sum().item()
    with pytest.raises(ValueError, match="fraction 1.5 outside 0..1"):
        probe.warm_columns(1.5)
    with pytest.raises(ValueError, match="fraction -0.1"):
        probe.main(["--fraction", "-0.1"])
    with pytest.raises(SystemExit):
        probe.main(["--between", "-4"])
