"""examples/profile_layer.py --summarize: the per-kernel table from Nsight Compute's ``--csv``
output (a real one, three kernels of one layer call on the H200; no GPU needed)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def test_summarize_reads_ncus_csv():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "profile_layer.py"), "--summarize",
                        str(ROOT / "tests" / "data" / "ncu_sample.csv")], capture_output=True, text=True, check=True)
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["us", "MB", "read"]
    rows = lines[1:-1]
    assert [row.split()[-1] for row in rows] == ["attn_res_normAttnResNorm", "expert_up_mxfp4ExpertUpMxfp4",
                                                 "expert_down_mxfp4ExpertDownMxfp4"]
    us = [float(row.split()[0]) for row in rows]
    assert us == [6.6, 56.2, 31.8]  # gpu__time_duration.sum in ns, "56,160" read as 56.2 us
    assert [row.split()[3:5] for row in rows] == [["8", "66"], ["240", "143"], ["240", "105"]]  # grid, registers
    assert lines[-1].split()[1:] == ["us", "over", "3", "kernels"] and abs(float(lines[-1].split()[0]) - sum(us)) < 0.2


def test_summarize_prints_the_bound_columns_where_measured():
    """With ``dram__bytes_write``, DRAM throughput and tensor-pipe metrics in the CSV (the input
    projection's GEMM and the KDA core of layer 1 at TP 16, 64 tokens), their columns appear."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "profile_layer.py"), "--summarize",
                        str(ROOT / "tests" / "data" / "ncu_columns_sample.csv")], capture_output=True, text=True,
                       check=True)
    lines = r.stdout.splitlines()
    assert lines[0].split()[-4:] == ["wrote", "dram%", "tensor%", "kernel"]
    gemm, kda = (row.split() for row in lines[1:3])
    assert gemm[-1] == "gemmSkinnyGemm" and kda[-1] == "kda_coreKdaCore"
    assert [float(v) for v in kda[6:9]] == [0.7, 21.4, 0.2]  # MB written, % of DRAM peak, % tensor pipe
    assert float(gemm[8]) > 20 > float(kda[8])  # the GEMM's tensor pipe is busy, the KDA core's idle
