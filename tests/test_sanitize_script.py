"""``.ci/sanitize`` (compute-sanitizer over the GPU kernel tests, on a CUDA machine):
its arguments, the tool line it builds and its summary, here with a stand-in ``compute-sanitizer``
on PATH that prints its arguments and exits as told (no GPU: the pytest runs it wraps skip)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST = "tests/test_kernels_gemm.py::test_in_proj_gemm_matches_the_reference"  # marked gpu: skips here


def run(tmp_path, *args, rc=0):
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    tool = fake / "compute-sanitizer"
    tool.write_text(f'#!/bin/sh\necho "ARGS: $*"\necho "========= ERROR SUMMARY: {rc} errors"\nexit {rc}\n')
    tool.chmod(0o755)
    python = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{fake}:{python}:{os.environ['PATH']}", GPU_OUT=str(tmp_path / "out"),
               VLLM_TARGET_DEVICE="cpu")
    return subprocess.run(["bash", str(ROOT / ".ci" / "sanitize"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_unknown_argument_is_named(tmp_path):
    r = run(tmp_path, "--bogus")
    assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr


@pytest.mark.parametrize("flags,filtered", [((), True), (("--all-kernels",), False)])
def test_only_the_projects_kernels_are_instrumented_unless_asked(tmp_path, flags, filtered):
    r = run(tmp_path, *flags, "--jobs", "1", "memcheck", "--", GPU_TEST)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "out" / "sanitize-memcheck.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith("ARGS:"))
    assert line.startswith("ARGS: --tool memcheck") and "--report-api-errors no" in line and GPU_TEST in line
    assert ("--kernel-name kns=codegenkernels" in line) == filtered
    summary = (tmp_path / "out" / "sanitize-summary.txt").read_text().splitlines()
    name = "test_kernels_gemm.py::test_in_proj_gemm_matches_the_reference"  # a node id names its file and test
    assert [s.split(": rc=")[0] for s in summary] == [f"plain {name}", f"memcheck {name}"]
    assert all(": rc=0 " in s for s in summary)


def test_a_reported_error_fails_the_run(tmp_path):
    r = run(tmp_path, "--jobs", "1", "racecheck", "--", GPU_TEST, rc=99)
    summary = (tmp_path / "out" / "sanitize-summary.txt").read_text()
    assert r.returncode == 1
    assert "racecheck test_kernels_gemm.py::test_in_proj_gemm_matches_the_reference: rc=99" in summary


def test_per_test_runs_each_gpu_test_of_a_file_on_its_own(tmp_path):
    """``--per-test``: a file becomes its GPU tests' node ids (as pytest collects them with
    ``-m gpu``), each its own process under the tool; a node id stays as given."""
    file = "tests/test_kernels_dense.py"
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                                "-p", "no:cacheprovider", file], cwd=ROOT, capture_output=True, text=True,
                               env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), timeout=600).stdout
    nodes = sorted(n.split("/", 1)[1] for n in collected.splitlines() if "::" in n)
    assert len(nodes) > 1
    r = run(tmp_path, "--per-test", "--jobs", "2", "synccheck", "--", file, GPU_TEST)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (tmp_path / "out" / "sanitize-summary.txt").read_text().splitlines()
    ran = sorted(s.split(": rc=")[0].split(" ", 1)[1] for s in summary if s.startswith("synccheck "))
    assert ran == sorted([*nodes, "test_kernels_gemm.py::test_in_proj_gemm_matches_the_reference"])


def test_per_test_without_gpu_tests_is_named(tmp_path):
    r = run(tmp_path, "--per-test", "memcheck", "--", "tests/test_config.py")
    assert r.returncode == 2 and "--per-test found no GPU tests in: tests/test_config.py" in r.stderr
