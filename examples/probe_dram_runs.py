"""How fast the DRAM serves the routed up stage's bytes when read in runs of different lengths.

The MXFP4 up stage at 8 tokens (layer 3, TP 16) streams at about 2.2 TB/s, 66% of the DRAM's
peak, with every sector it asks for used (Nsight Compute: docs/FEWER_STEPS.md); neither more
bytes in flight nor resident CTAs walking items raised it. What it reads is fixed by vLLM's
Humming layout: W13 int32 [E, L/16, 4I], so one 16-wide K block of an expert is a 4 KB row
(TP 16: I = 256) whose live channels are two 1.5 KB runs (gate tiles 0-2, up tiles 4-6), and
each CTA of the stage reads 512-byte runs (one 64-channel tile) at the row stride. This probe
reads the same bytes (128 random experts' live runs, 88 MB) the stage's way and in longer runs,
plus the same amount contiguous, with CTAs like the stage's (4 warps, 28 KB by ``cp.async``
into shared memory, 7 an SM): if the short runs alone cost the third, the stage is at its
pattern's ceiling. (They do not: docs/FEWER_STEPS.md.)

    python examples/probe_dram_runs.py              # a table: pattern, MB, us, TB/s
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import cuda.bindings.driver as cuda
import cutlass
import numpy as np
import torch
from cutlass import Int32, Int64, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from codegen.bind import device_arch
from codegen.compiler import compile_object, load_object
from codegen.kernels.mxfp4 import copy_from
from rewriter.commands.bench import timed_replay_us, warmed_up

THREADS = 128
EXPERTS, KBLOCKS, ROW_BYTES = 896, 224, 4096  # W13 at TP 16: [896, 3584 / 16, 4 x 256] int32
LIVE_RUNS = ((0, 1536), (2048, 1536))  # (byte offset, bytes) of the gate's and the up's live tiles
PAIRS = 128  # 8 tokens x top 16
CTA_SMEM = 32 * 1024  # the stage's CTAs fit 7 an SM


class RunReader:
    """Each CTA copies ``runs`` runs of ``run_bytes`` (their first words' offsets in its row of
    ``mPlan``) into shared memory, every copy issued at once, then XORs its words into ``mOut``."""

    def __init__(self, runs: int, run_bytes: int):
        pieces = runs * run_bytes // 16
        if run_bytes % 16 or pieces % THREADS or pieces * 16 > CTA_SMEM:
            raise ValueError(f"{runs} runs of {run_bytes} B: not whole 16-byte pieces for {THREADS} threads "
                             f"within {CTA_SMEM} B")
        self.runs, self.run_pieces, self.per_thread = runs, run_bytes // 16, pieces // THREADS

    @cute.jit
    def __call__(self, mW: cute.Tensor, mPlan: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mW, mPlan, mOut).launch(grid=[mPlan.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mPlan: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        sBuf = SmemAllocator().allocate_tensor(Int32, cute.make_layout((CTA_SMEM // 4,)), byte_alignment=16)
        base = mW.iterator.toint()
        for j in cutlass.range_constexpr(self.per_thread):
            p = tidx + j * THREADS
            run = p // self.run_pieces
            word = mPlan[cta, run] + (p - run * self.run_pieces) * 4
            copy_from(base + Int64(word) * 4, 4, cute.local_tile(sBuf, (4,), (p,)))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        acc = Int32(0)
        for j in cutlass.range_constexpr(self.per_thread):
            for w in cutlass.range_constexpr(4):
                acc = acc ^ sBuf[(tidx + j * THREADS) * 4 + w]
        mOut[cta * THREADS + tidx] = acc


def word(expert: int, kb: int, byte: int) -> int:
    """The int32 word at byte ``byte`` of K block ``kb``'s row of expert ``expert``."""
    return (expert * KBLOCKS * ROW_BYTES + kb * ROW_BYTES + byte) // 4


def plan(pattern: str, experts: list[int], region: int) -> tuple[int, list[list[int]]]:
    """(run bytes, each CTA's runs' first words) of ``pattern`` over ``experts`` (one a pair);
    ``contiguous`` reads the same bytes from region ``region`` of the buffer instead."""
    cluster, kb_share = 8, KBLOCKS // 8
    if pattern.startswith("stage"):  # a CTA a (pair, 1/8 of K, tile): each half's 512 B at the row stride
        order = (((t, e, r) for t in range(3) for e in experts for r in range(cluster)) if pattern == "stage"
                 else ((t, e, r) for e in experts for t in range(3) for r in range(cluster)))
        return 512, [[word(e, kb, off + 512 * t) for off, _ in LIVE_RUNS
                      for kb in range(r * kb_share, (r + 1) * kb_share)]
                     for t, e, r in order]
    if pattern == "live runs":  # a CTA a (pair, 8 K blocks): both halves' whole 1.5 KB
        return 1536, [[word(e, kb, off) for kb in range(c, c + 8) for off, _ in LIVE_RUNS]
                      for e in experts for c in range(0, KBLOCKS, 8)]
    if pattern == "whole rows":  # a CTA a (pair, 7 K blocks): the 4 KB rows, padding included
        return ROW_BYTES, [[word(e, kb, 0) for kb in range(c, c + 7)] for e in experts for c in range(0, KBLOCKS, 7)]
    if pattern == "contiguous":  # the stage's bytes in 28 KB pieces
        nbytes = len(experts) * KBLOCKS * sum(n for _, n in LIVE_RUNS)
        start = region % (EXPERTS * KBLOCKS * ROW_BYTES // nbytes) * nbytes
        return 28672, [[(start + c * 28672) // 4] for c in range(nbytes // 28672)]
    raise ValueError(f"pattern {pattern!r}: one of {PATTERNS}")


PATTERNS = ("stage", "stage, tiles in turn", "live runs", "whole rows", "contiguous")


def compiled_reader(runs: int, run_bytes: int, ctas: int, words: int, arch: str):
    """``RunReader``'s kernel for ``ctas`` CTAs over a buffer of ``words`` int32 words, compiled
    for ``arch`` and loaded: (its PTX, ``fn(buffer, plan, out)``)."""
    fake = (make_fake_tensor(Int32, (words,), (1,), assumed_align=16),
            make_fake_tensor(Int32, (ctas, runs), (runs, 1), assumed_align=4),
            make_fake_tensor(Int32, (ctas * THREADS,), (1,), assumed_align=4),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    name = f"probe_runs_{runs}x{run_bytes}_{ctas}"
    ptx, obj = compile_object(RunReader(runs, run_bytes), fake, arch, name, f"probe {runs} runs of {run_bytes} B")
    return ptx, load_object(obj, name, arch)


def expected_out(words: np.ndarray, plan_rows: np.ndarray, run_bytes: int) -> np.ndarray:
    """What ``RunReader`` writes: thread t of a CTA XORs the words of its pieces t + 128 j."""
    ctas, runs = plan_rows.shape
    piece = np.arange(runs * run_bytes // 16)
    first = plan_rows[:, piece // (run_bytes // 16)] + piece % (run_bytes // 16) * 4  # [ctas, pieces]
    got = np.bitwise_xor.reduce(words[first[..., None] + np.arange(4)], axis=-1)  # a piece's 4 words
    return np.bitwise_xor.reduce(got.reshape(ctas, -1, THREADS), axis=1).ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sets", type=int, default=6, help="expert draws replayed in turn (the L2 keeps none)")
    args = parser.parse_args()
    arch, dev = device_arch(), "cuda"
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (EXPERTS * KBLOCKS * ROW_BYTES // 4,), dtype=torch.int32, generator=gen)
    words = w.numpy()
    w = w.to(dev)
    draws = [torch.randint(0, EXPERTS, (PAIRS,), generator=gen).tolist() for _ in range(args.sets)]
    print(f"{torch.cuda.get_device_name()}, {arch}: {PAIRS} random experts' live W13 runs (TP 16), "
          f"{args.reps} reps over {args.sets} draws\n| pattern | CTAs | run B | MB | us | TB/s |\n"
          "|---|---|---|---|---|---|")
    for pattern in PATTERNS:
        plans = [plan(pattern, d, i) for i, d in enumerate(draws)]
        run_bytes, first = plans[0]
        ctas, runs = len(first), len(first[0])
        _, fn = compiled_reader(runs, run_bytes, ctas, w.numel(), arch)
        tensors = [torch.tensor(p, dtype=torch.int32, device=dev) for _, p in plans]
        out = torch.full((ctas * THREADS,), -1, dtype=torch.int32, device=dev)
        fn(w, tensors[0], out)
        if not np.array_equal(out.cpu().numpy(), expected_out(words, np.array(first), run_bytes)):
            raise SystemExit(f"{pattern}: the words read are not the plan's")
        turn = itertools.count()
        warmed_up(lambda: fn(w, tensors[next(turn) % len(tensors)], out))
        us = statistics.median(timed_replay_us(lambda i=i: fn(w, tensors[i % len(tensors)], out))
                               for i in range(args.reps))
        nbytes = ctas * runs * run_bytes
        print(f"| {pattern} | {ctas} | {run_bytes} | {nbytes / 1e6:.1f} | {us:.2f} | {nbytes / us / 1e6:.2f} |")


if __name__ == "__main__":
    main()
