"""One rewritten layer call under Nsight Compute: each kernel's own time, DRAM bytes and
occupancy, with the L2 flushed before each kernel (as a served step finds the weights) and no
programmatic-dependent-launch overlap (ncu serializes kernels), so the sum over the kernels
against ``python -m rewriter bench``'s figure tells what the overlap gains.

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,\\
        dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread,\\
        sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
        sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \\
        python3 examples/profile_layer.py --layer 3 --tp 16 --batch 1 > ncu.csv
    python3 examples/profile_layer.py --summarize ncu.csv      # the call's kernels, in launch order

(Several ``--batch`` values profile one call each, listed one after the other.) The write, DRAM
throughput and tensor-pipe columns are printed where the CSV has their metrics: a kernel far
below its DRAM peak with its tensor pipe busy is compute-bound, with neither busy latency-bound.

Where a latency-bound kernel waits, from its warp-state samples per SASS instruction:

    ncu --clock-control none --profile-from-start off --section WarpStateStats --section SourceCounters \
        -k "regex:[Kk]da" -o kda -f python3 examples/profile_layer.py --layer 1 --tp 16 --batch 64
    ncu --import kda.ncu-rep --page source --csv --print-source sass > kda_sass.csv
    python3 examples/profile_layer.py --stalls kda_sass.csv [--kernel REGEX] [--top N]

prints each kernel's samples by stall reason, by region (the instructions up to each barrier,
cluster-barrier wait or exit: what a CTA's phases cost, and which warps run them) and its
costliest instructions.

Needs CUDA and the cutedsl extra. Collectives are excluded as in ``bench``.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict

import torch


def profile(args: argparse.Namespace) -> None:
    from codegen.bind import device_arch
    from patterns import default_rules
    from rewriter.commands.bench import _Case, _rewritten
    from rewriter.compiler.plan import install_kernels
    from rewriter.model.config import KimiK3Config
    from rewriter.model.ops import collectives_excluded
    from rewriter.model.shape import DecodeShape

    cfg = KimiK3Config.load(args.model)
    arch = device_arch()
    install_kernels(arch)
    with torch.no_grad(), collectives_excluded():
        for batch in args.batch:
            shape = DecodeShape(batch=batch, tp=args.tp, rank=0, arch=arch, context=args.context,
                                kv_cache_dtype=args.kv_cache_dtype)
            case = _Case(cfg, args.layer, shape, 1, args.experts)
            _, run_one, _ = _rewritten(case, default_rules())
            for _ in range(3):  # compile or load, then warm
                run_one()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()  # ncu --profile-from-start off: this call alone
            run_one()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled layer {args.layer} TP {args.tp} batch {batch}", file=sys.stderr, flush=True)
            del case, run_one
            torch.cuda.empty_cache()


OPTIONAL_COLUMNS = (  # (metric, title, divisor)
    ("dram__bytes_write.sum", "MB wrote", 1e6),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram%", 1),
    ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "tensor%", 1))


def summarize(path: str) -> None:
    """A per-kernel table from ncu's ``--csv`` output (one row per kernel and metric)."""
    rows: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    order: list[tuple[str, str]] = []
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    for rec in csv.DictReader(lines):
        key = (rec["ID"], rec["Kernel Name"])
        if key not in rows:
            order.append(key)
        rows[key][rec["Metric Name"]] = rec["Metric Value"].replace(",", "")
    total = 0.0
    optional = [column for column in OPTIONAL_COLUMNS if any(column[0] in rows[k] for k in order)]
    print(f"{'us':>7} {'MB read':>8} {'TB/s':>5} {'grid':>6} {'regs':>5} {'warps%':>6}"
          + "".join(f" {title:>8}" for _, title, _ in optional) + "  kernel")
    for key in order:
        m = rows[key]
        ns = float(m.get("gpu__time_duration.sum", 0))
        mb = float(m.get("dram__bytes_read.sum", 0)) / 1e6
        total += ns / 1e3
        name = key[1].split("codegenkernels")[-1].split("_object_at_")[0][:60]
        extra = "".join(f" {float(m.get(metric, 0)) / divisor:8.1f}" for metric, _, divisor in optional)
        print(f"{ns / 1e3:7.1f} {mb:8.1f} {mb / max(ns / 1e3, 1e-9):5.2f} {m.get('launch__grid_size', ''):>6} "
              f"{m.get('launch__registers_per_thread', ''):>5} "
              f"{float(m.get('sm__warps_active.avg.pct_of_peak_sustained_active', 0)):6.1f}{extra}  {name}")
    print(f"{total:7.1f} us over {len(order)} kernels")


STALL_COLUMN = "stall_"  # ncu's per-reason sample columns (and their "(Not Issued)" twins, not read)
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
REGION_ENDS = ("BAR.SYNC", "BAR.RED", "UCGABAR_WAIT", "EXIT")  # opcodes that close a region of the table


def read_source_page(path: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, its SASS rows) from ncu's source page (``--page source --csv --print-source
    sass``), one entry per profiled kernel, rows in address order."""
    kernels: list[tuple[str, list[dict[str, str]]]] = []
    header: list[str] | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                kernels.append((row[1], []))
                header = None
            elif row[:2] == ["Address", "Source"]:
                header = row
            elif header is not None and kernels and len(row) == len(header):
                kernels[-1][1].append(dict(zip(header, row)))
    return kernels


def _count(value: str) -> int:
    return int(value.replace(",", "")) if value.strip().replace(",", "").isdigit() else 0


def opcode(source: str) -> str:
    """The instruction's opcode with its modifiers, its predicate (``@!P0``) left out."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def by_reason(rows: list[dict[str, str]]) -> list[tuple[str, int]]:
    """(stall reason, samples) over ``rows``, the most first."""
    sums = [(k[len(STALL_COLUMN):], sum(_count(r[k]) for r in rows)) for k in rows[0]
            if k.startswith(STALL_COLUMN) and not k.endswith("(Not Issued)")]
    return sorted(sums, key=lambda kv: -kv[1])


def stall_table(name: str, rows: list[dict[str, str]], top: int) -> list[str]:
    """One kernel's stall samples: by reason, by region, and its ``top`` instructions."""
    samples = [_count(r[SAMPLES]) for r in rows]
    total = sum(samples) or 1
    reasons = by_reason(rows)

    def stalls_of(rs: list[dict[str, str]], n: int = 3) -> str:
        return " ".join(f"{k}={v}" for k, v in by_reason(rs)[:n] if v)

    short = name.split("codegenkernels")[-1].split("_object_at_")[0][:60]
    out = [f"{short}: {sum(samples)} samples over {len(rows)} instructions",
           "  by reason: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in reasons if v)]
    out.append(f"  {'region':>11} {'samples':>8} {'share':>6}  {'runs (warps x passes)':>21}  top stalls; ends at")
    start = 0
    for i, r in enumerate(rows):
        if opcode(r["Source"]).startswith(REGION_ENDS) or i == len(rows) - 1:
            part = rows[start:i + 1]
            s = sum(samples[start:i + 1])
            if s:
                runs = max(_count(x[EXECUTED]) for x in part)
                out.append(f"  {start:>5}-{i:<5} {s:>8} {100 * s / total:5.0f}%  {runs:>21}  {stalls_of(part)}; "
                           f"{opcode(r['Source'])}")
            start = i + 1
    out.append(f"  top {top}: {'index':>5} {'samples':>8} {'runs':>8}  stalls  instruction")
    for i in sorted(range(len(rows)), key=lambda j: -samples[j])[:top]:
        if samples[i]:
            out.append(f"  {'':>6}{i:>5} {samples[i]:>8} {_count(rows[i][EXECUTED]):>8}  {stalls_of([rows[i]])}  "
                       f"{rows[i]['Source'].strip()}")
    return out


def stalls(path: str, kernel: str | None, top: int) -> None:
    """Print ``stall_table`` for each kernel of the source-page CSV whose name matches ``kernel``."""
    try:
        pages = read_source_page(path)
    except OSError as e:
        raise SystemExit(f"{path}: {e.strerror}") from None
    kernels = [(n, rows) for n, rows in pages if rows and (not kernel or re.search(kernel, n))]
    if not kernels:
        raise SystemExit(f"{path}: no kernel{' matching ' + repr(kernel) if kernel else ''} with SASS rows "
                         "(ncu --page source --csv --print-source sass)")
    for name, rows in kernels:
        print("\n".join(stall_table(name, rows, top)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarize", metavar="CSV", help="print the table of an ncu --csv file and exit")
    p.add_argument("--stalls", metavar="CSV", help="print where each kernel of an ncu source-page CSV (--page source "
                   "--csv --print-source sass) stalls, and exit")
    p.add_argument("--kernel", metavar="REGEX", help="with --stalls: only kernels whose name matches")
    p.add_argument("--top", type=int, default=12, help="with --stalls: the costliest instructions shown (default 12)")
    p.add_argument("--model", default="kimi-k3")
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--tp", type=int, default=16)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.stalls:
        stalls(args.stalls, args.kernel, args.top)
    else:
        profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
