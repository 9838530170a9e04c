"""``python -m rewriter bench``: argument checks, copies and the table (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from rewriter.bench_cmd import L2_BYTES, Row, copies_for, render
from rewriter.cli import main


def test_copies_rotate_weights_past_the_l2():
    assert copies_for(10 * 2**20, None) * 10 * 2**20 >= 4 * L2_BYTES
    assert copies_for(300e6, None) == 2 and copies_for(300e6, 5) == 5


def test_table_gives_the_share_of_the_floor():
    rows = [Row(16, 1, "rewritten", 12, 100.0, 65.0), Row(16, 1, "torch.compile", None, None, 65.0, "not run")]
    assert rows[0].floor_pct == pytest.approx(65.0) and rows[1].floor_pct is None
    text = render(rows, "H200 (sm_90a)", "mxfp4")
    assert "collectives excluded" in text and " 65%" in text and "not run" in text and "mxfp4 routed experts" in text


@pytest.mark.parametrize("argv,message", [
    (["--tp", "0"], "--tp 0"),
    (["--batch", "0", "--reps", "2"], "--batch 0, --reps 2"),
    (["--q", "9"], "--q 9 (1..8)"),
    (["--q", "4", "--batch", "1", "32"], "--batch 32 x --q 4 = 128 tokens (at most 64)"),
])
def test_bad_arguments_name_the_problem(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_expert_format_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--experts", "fp8"])
    assert e.value.code == 2 and "--experts: invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
