"""What one kernel boundary costs on this GPU, and what vLLM's way of crossing it would save.

A decode layer is a chain of a dozen dependent kernels, and at one token most of them move
under 1 us of bytes yet add 2 to 4 us each (BENCHMARKS.md). Part of that is the boundary
itself: under programmatic dependent launch a kernel's ``griddepcontrol.wait`` returns once
the whole previous grid has completed and its writes are flushed. vLLM's hand-written path
instead launches its dependents at entry and has them poll for the data (docs/FEWER_STEPS.md).
This times a chain of ``links`` tiny kernels of ``ctas`` CTAs each (every CTA reads a value the
previous kernel wrote and writes its own), captured in one CUDA graph, four ways:

- ``plain``: no PDL; a kernel starts after the previous one completes;
- ``pdl``: PDL as every kernel here uses it (``griddepcontrol.wait`` then ``launch_dependents``);
- ``flag``: PDL, but the data is waited for on a counter the previous kernel's CTAs raise after
  their writes (fence, relaxed atomic; relaxed loads until it reaches their count, fence), and
  the dependents launch once it has; ``griddepcontrol.wait`` only at exit, so completion still
  covers the kernels before;
- ``flag-entry``: the same with the dependents launched at entry (vLLM's way).

A boundary's cost is the slope between chains of 16 and 64 links (the graph's launch and the
counters' reset cancel out).

    python examples/bench_boundary.py                # CTAs 1, 8, 66 and the SM count
"""
from __future__ import annotations

import argparse
import statistics

import cuda.bindings.driver as cuda
import torch
from cutlass import Float32, Int32, const_expr, cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from codegen.bind import device_arch
from codegen.compiler import compile_object, load_object
from codegen.kernels.common import trap_past_deadline, wait_started
from rewriter.commands.bench import timed_replay_us

MODES = ("plain", "pdl", "flag", "flag-entry")
THREADS = 128


class Link:
    """One link of the chain: ``ctas`` CTAs; CTA c reads ``mIn[(c + 1) % ctas]`` (another CTA's
    value) and writes ``mOut[c]``, waiting for the previous link as ``mode`` says."""

    def __init__(self, ctas: int, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        self.ctas, self.mode = ctas, mode
        self.flag = mode.startswith("flag")

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, mCountIn: cute.Tensor, mCountOut: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mIn, mOut, mCountIn, mCountOut).launch(grid=[self.ctas, 1, 1], block=[THREADS, 1, 1],
                                                           stream=stream, use_pdl=self.mode != "plain")

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor, mCountIn: cute.Tensor, mCountOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if const_expr(self.mode == "pdl"):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.mode == "flag-entry"):
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.flag):
            if tidx == 0:  # the previous link's CTAs have all raised the counter after their writes
                now = cute.arch.load(mCountIn.iterator, Int32, sem="relaxed", scope="gpu")
                started = wait_started()
                while now < Int32(self.ctas):
                    trap_past_deadline(started)
                    now = cute.arch.load(mCountIn.iterator, Int32, sem="relaxed", scope="gpu")
                cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
        if const_expr(self.mode == "flag"):
            cute.arch.griddepcontrol_launch_dependents()
        if tidx == 0:
            mOut[cta] = mIn[(cta + 1) % self.ctas] + Float32(1.0)
            if const_expr(self.flag):
                cute.arch.fence_acq_rel_gpu()  # the write before the count
                cute.arch.atomic_add(mCountOut.iterator, Int32(1), sem="relaxed", scope="gpu")
        if const_expr(self.flag):
            cute.arch.griddepcontrol_wait()  # at exit: this grid completes after the ones before it


def compiled_link(ctas: int, mode: str, arch: str):
    """The link's kernel, compiled for ``arch`` and loaded (it launches on torch's current stream)."""
    args = (make_fake_tensor(Float32, (ctas,), (1,), assumed_align=4),
            make_fake_tensor(Float32, (ctas,), (1,), assumed_align=4),
            make_fake_tensor(Int32, (1,), (1,), assumed_align=4),
            make_fake_tensor(Int32, (1,), (1,), assumed_align=4),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    function = f"boundary_{mode.replace('-', '_')}_{ctas}"
    ptx, obj = compile_object(Link(ctas, mode), args, arch, function, f"boundary link {mode} x {ctas}")
    return ptx, load_object(obj, function, arch)


def chain_us(fn, ctas: int, links: int, reps: int) -> tuple[float, torch.Tensor]:
    """Median us of a graph replay of ``links`` launches of ``fn`` (counters reset first), and
    the last link's values."""
    bufs = [torch.zeros(ctas, device="cuda") for _ in range(links + 1)]
    counts = torch.zeros(links + 1, dtype=torch.int32, device="cuda")
    armed = counts.clone()
    armed[0] = ctas  # the chain's first link finds its input written

    def run():
        counts.copy_(armed)
        for i in range(links):
            fn(bufs[i], bufs[i + 1], counts[i:i + 1], counts[i + 1:i + 2])

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    times = []
    for _ in range(reps):
        for b in bufs[1:]:
            b.fill_(-1.0)  # poisoned: a link that did not wait reads -1
        times.append(timed_replay_us(g.replay))
    return statistics.median(times), bufs[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctas", type=int, nargs="+", help="CTAs a link (default 1, 8, 66 and the SM count)")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    arch = device_arch()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes = args.ctas or [1, 8, 66, sms]
    print(f"{torch.cuda.get_device_name()}, {arch}, {sms} SMs: us a kernel boundary (slope between chains of 16 "
          f"and 64 links)\n| CTAs | " + " | ".join(MODES) + " |\n|---" * (len(MODES) + 1) + "|")
    for ctas in sizes:
        row = []
        for mode in MODES:
            _, fn = compiled_link(ctas, mode, arch)
            (short, _), (long, last) = (chain_us(fn, ctas, n, args.reps) for n in (16, 64))
            if not torch.equal(last, torch.full_like(last, 64.0)):  # each link adds 1 to the first's 0
                raise SystemExit(f"{mode} x {ctas}: the chain's values are wrong ({last[:4].tolist()}): "
                                 "a link read before the previous one wrote")
            row.append(f"{(long - short) / 48:.2f}")
        print(f"| {ctas} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
