"""examples/profile_layer.py --summarize: the per-kernel table from Nsight Compute's ``--csv``
output (a real one, three kernels of one layer call on the H200; no GPU needed); --stalls: where
kernels wait, from ncu's source page (a real one, trimmed to the instructions with samples and
the barriers: the KDA core at 64 requests and the MXFP4 up stage at one token, H200)."""
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


def _stalls(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "profile_layer.py"), "--stalls",
                           str(ROOT / "tests" / "data" / "ncu_source_sample.csv"), *args],
                          capture_output=True, text=True)


def test_stalls_split_each_kernel_at_its_barriers():
    r = _stalls("--top", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if " samples over " in line]
    assert [lines[i].split(":")[0] for i in heads] == ["kda_coreKdaCore", "expert_up_mxfp4ExpertUpMxfp4"]
    kda = lines[heads[0]:heads[1]]
    assert kda[0].startswith("kda_coreKdaCore: 2469 samples") and kda[1].startswith("  by reason: barrier 28%")
    regions = [line.split() for line in kda if line.strip()[:1].isdigit() and "-" in line.split()[0]]
    assert sum(int(region[1]) for region in regions) == 2469  # the regions cover every sample
    # the prologue's barrier: 36% of the samples, 366 of them warps waiting there
    assert ["894", "36%", "6144", "barrier=366"] == regions[3][1:5]
    top = [line.split() for line in kda[kda.index(next(x for x in kda if x.strip().startswith("top 2"))) + 1:]]
    assert [t[1] for t in top] == ["368", "197"] and top[0][-3:] == ["LDS.128", "R12,", "[R68]"]
    up = lines[heads[1]:]
    # the cluster's last wait
    assert any(line.rstrip().endswith("UCGABAR_WAIT") and "barrier=97" in line for line in up)


def test_stalls_name_what_is_missing():
    r = _stalls("--kernel", "no_such_kernel")
    assert r.returncode != 0 and "no kernel matching 'no_such_kernel'" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "profile_layer.py"), "--stalls", "missing.csv"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "missing.csv: No such file or directory" in r.stderr
