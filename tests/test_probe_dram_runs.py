"""``examples/probe_dram_runs.py``: its patterns read the same bytes in different runs (CPU), its
kernel issues every copy before its one wait, and on the GPU it reads exactly its plan's words."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cute_example, needs_cutedsl, on_gpu


def _probe():
    return cute_example("probe_dram_runs")


def _words_read(run_bytes, rows):
    return np.sort((np.array(rows)[..., None] + np.arange(run_bytes // 4)).ravel())


@needs_cutedsl
def test_patterns_read_the_live_bytes_in_runs_of_their_length():
    probe, _ = _probe()
    experts = [5, 895, 5, 17]  # a repeat, as the router's picks may have
    live = {}
    for pattern in probe.PATTERNS:
        run_bytes, rows = probe.plan(pattern, experts, 1)
        assert len(rows[0]) * run_bytes <= probe.CTA_SMEM
        probe.RunReader(len(rows[0]), run_bytes)  # a shape its kernel takes
        live[pattern] = _words_read(run_bytes, rows)
    stage = live["stage"]
    assert len(stage) == len(experts) * probe.KBLOCKS * 3072 // 4
    assert np.array_equal(stage, live["stage, tiles in turn"]) and np.array_equal(stage, live["live runs"])
    assert np.isin(stage, live["whole rows"]).all() and len(live["whole rows"]) == len(stage) * 4 // 3
    contiguous = live["contiguous"]
    assert len(contiguous) == len(stage) and np.array_equal(contiguous, np.arange(contiguous[0], contiguous[-1] + 1))
    assert contiguous[-1] < probe.EXPERTS * probe.KBLOCKS * probe.ROW_BYTES // 4  # inside the buffer
    with pytest.raises(ValueError, match="pattern 'random'"):
        probe.plan("random", experts, 0)
    with pytest.raises(ValueError, match="3 runs of 512 B"):
        probe.RunReader(3, 512)


@needs_cutedsl
def test_every_copy_is_issued_before_the_one_wait():
    probe, _ = _probe()
    ptx, _ = probe.compiled_reader(56, 512, 8, 1 << 20, "sm_90a")
    copies = [i for i in range(len(ptx)) if ptx.startswith("cp.async.cg.shared.global", i)]
    assert len(copies) == 56 * 512 // 16 // probe.THREADS
    assert ptx.count("cp.async.wait_group") == 1 and copies[-1] < ptx.index("cp.async.wait_group")


@needs_cutedsl
def test_expected_out_is_each_threads_xor_of_its_pieces():
    probe, _ = _probe()
    rng = np.random.default_rng()
    words = rng.integers(-2**31, 2**31 - 1, 4096, dtype=np.int64).astype(np.int32)
    rows = rng.integers(0, (4096 - 1536 // 4) // 4, (3, 4)) * 4  # 3 CTAs of 4 runs of 512 B
    want = np.zeros(3 * probe.THREADS, dtype=np.int32)
    for cta in range(3):
        for p in range(4 * 512 // 16):
            run, within = divmod(p, 512 // 16)
            for w in range(4):
                want[cta * probe.THREADS + p % probe.THREADS] ^= words[rows[cta, run] + within * 4 + w]
    assert np.array_equal(probe.expected_out(words, rows, 512), want)


@on_gpu
@pytest.mark.parametrize("runs,run_bytes", [(56, 512), (16, 1536), (1, 28672)])
def test_the_kernel_reads_its_plans_words(runs, run_bytes):
    probe, arch = _probe()
    ctas, words = 24, 1 << 20
    w = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
    rows = torch.randint(0, (words - run_bytes // 4) // 4, (ctas, runs), dtype=torch.int32) * 4
    out = torch.full((ctas * probe.THREADS,), -1, dtype=torch.int32, device="cuda")  # poisoned
    _, fn = probe.compiled_reader(runs, run_bytes, ctas, words, arch)
    fn(w.cuda(), rows.cuda(), out)
    assert np.array_equal(out.cpu().numpy(), probe.expected_out(w.numpy(), rows.numpy(), run_bytes))
