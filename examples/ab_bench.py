"""Two variants of the tree timed in turn on one GPU: the tree as it is (A) and the tree with
some files replaced (B), each run a fresh ``python -m rewriter bench --json`` process, A B A B...

A layer's figure can move between runs of one command by more than the 2 to 4 us a kernel change
makes (15 us between two runs on one H200, within 1 us on another: BENCHMARKS.md, method), so one
run per variant decides nothing. Alternating, and pairing each B run with the A run just before
it, does: the report gives the median of those paired differences.

    python examples/ab_bench.py snapshot main codegen/kernels/kda_core.py --into .ab/main   # needs git
    python examples/ab_bench.py run .ab/main --rounds 3 -- --layer 1 --tp 16 --batch 1 64 --paths rewritten

B is the directory's files at the same paths below the repository (another commit's snapshot, or
edited copies; ``rewriter.commands.variant``); the tree's own files are put back however the run ends.
Where B changes only kernel sources (``codegen/kernels/*.py``), ``python -m rewriter bench
--variant DIR`` is the finer tool: one process, the same weights, replays alternating. Each variant's kernels
compile once (the kernel cache keys on their source), so later rounds start fast. The report,
per (TP, batch, path): each variant's figures in run order, their medians and the median paired
difference; per kernel, the median us it adds to the layer's replay span under each variant.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from compare_bench import SAME, CompareError, keyed_kernels

from rewriter.commands.bench import paired_difference
from rewriter.commands.variant import VariantError, swapped_in, variant_files

ROOT = Path(__file__).resolve().parents[1]


def bench_json(bench_args: list[str]) -> dict:
    """One ``python -m rewriter bench --json`` run in a fresh process (its progress on stderr)."""
    out = subprocess.run([sys.executable, "-m", "rewriter", "bench", *bench_args, "--json"], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise CompareError(f"bench exited with {out.returncode} for {' '.join(bench_args)}")
    return json.loads(out.stdout)


def alternate(variant: Path, rounds: int, bench_args: list[str], run: Callable[[list[str]], dict] = bench_json,
              root: Path = ROOT) -> tuple[list[dict], list[dict]]:
    """``rounds`` runs of each variant, A then B in every round."""
    a_runs, b_runs = [], []
    for r in range(rounds):
        print(f"round {r + 1} of {rounds}: A (the tree)", file=sys.stderr, flush=True)
        a_runs.append(run(bench_args))
        with swapped_in(variant, root):
            print(f"round {r + 1} of {rounds}: B ({variant})", file=sys.stderr, flush=True)
            b_runs.append(run(bench_args))
    return a_runs, b_runs


def _adds(row: dict) -> dict[tuple[str, int], float]:
    """(kernel, occurrence) -> us it added to the layer's replay span (the row's timeline)."""
    return keyed_kernels([(name, added) for name, _, _, added in row.get("timeline") or ()])


def report(a_runs: list[dict], b_runs: list[dict], min_delta: float = 0.0) -> str:
    """Per shape and path, both variants' figures and the median paired difference; per kernel,
    the median of what it adds to the replay span under each."""
    if not a_runs or len(a_runs) != len(b_runs):
        raise CompareError(f"{len(a_runs)} A runs against {len(b_runs)} B runs: pairs are needed")
    first = a_runs[0]
    for run in a_runs + b_runs:
        for key in SAME:
            if run.get(key) != first.get(key):
                raise CompareError(f"the runs differ in {key}: {first.get(key)!r} against {run.get(key)!r}")

    a_tables, b_tables = ([{(r["tp"], r["batch"], r["path"]): r for r in run["rows"]} for run in runs]
                          for runs in (a_runs, b_runs))
    keys = [k for k in a_tables[0] if all(k in t for t in a_tables + b_tables)]
    if not keys:
        raise CompareError("no (TP, batch, path) is in every run")
    lines = [f"layer {first.get('layer')} of {first.get('model')}, {first.get('experts')} experts; "
             f"{len(a_runs)} rounds, A then B in each; {first.get('device', '?')}"]
    for key in keys:
        a_rows, b_rows = [t[key] for t in a_tables], [t[key] for t in b_tables]
        a_us, b_us = [r["us"] for r in a_rows], [r["us"] for r in b_rows]
        lines.append("")
        if None in a_us or None in b_us:
            lines.append(f"TP {key[0]} batch {key[1]} {key[2]}: not run in every round")
            continue
        paired, _, _, lower = paired_difference(a_us, b_us)
        lines.append(f"TP {key[0]} batch {key[1]} {key[2]}: A {_list(a_us)} (median {statistics.median(a_us):.1f}), "
                     f"B {_list(b_us)} (median {statistics.median(b_us):.1f}); B - A, paired: median {paired:+.1f} us, "
                     f"{lower} of {len(a_us)} rounds lower")
        a_adds, b_adds = [_adds(r) for r in a_rows], [_adds(r) for r in b_rows]
        names = [k for k in a_adds[0] if all(k in d for d in a_adds + b_adds)]
        if not names:
            continue
        lines.append("| kernel | A adds us | B adds us | B - A |")
        lines.append("|---|---|---|---|")
        hidden = 0
        for name, i in names:
            x = statistics.median(d[name, i] for d in a_adds)
            y = statistics.median(d[name, i] for d in b_adds)
            if abs(y - x) < min_delta:
                hidden += 1
                continue
            lines.append(f"| {name if i == 0 else f'{name} #{i + 1}'} | {x:.1f} | {y:.1f} | {y - x:+.1f} |")
        if hidden:
            lines.append(f"({hidden} kernels moved by less than {min_delta} us)")
    return "\n".join(lines)


def _list(values: list[float]) -> str:
    return " ".join(f"{v:.1f}" for v in values)


def snapshot(ref: str, files: list[str], into: Path) -> None:
    """``files`` as they are at git revision ``ref``, written below ``into`` at the same paths."""
    for f in files:
        out = subprocess.run(["git", "show", f"{ref}:{f}"], cwd=ROOT, capture_output=True)
        if out.returncode:
            raise CompareError(f"git show {ref}:{f}: {out.stderr.decode().strip()}")
        (into / f).parent.mkdir(parents=True, exist_ok=True)
        (into / f).write_bytes(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("snapshot", help="write files as they are at a git revision into a variant directory")
    s.add_argument("ref")
    s.add_argument("files", nargs="+")
    s.add_argument("--into", type=Path, required=True)
    r = sub.add_parser("run", help="time the tree (A) and the tree with the variant's files (B) in turn")
    r.add_argument("variant", type=Path, help="a directory of replacement files at their paths in the tree")
    r.add_argument("--rounds", type=int, default=2, help="A then B, this many times (default 2)")
    r.add_argument("--min-delta", type=float, default=0.0, help="hide kernels that moved by less (us)")
    r.epilog = "then -- and the arguments of `python -m rewriter bench`"
    argv = sys.argv[1:] if argv is None else list(argv)
    # ab_bench's options anywhere before "--", bench's after it (a REMAINDER positional would take
    # every option after the variant as bench's)
    split = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = p.parse_args(argv[:split]), argv[split + 1:]
    try:
        if args.command == "snapshot":
            snapshot(args.ref, args.files, args.into)
            return 0
        if args.rounds < 1 or args.min_delta < 0:
            p.error(f"--rounds {args.rounds} (at least 1), --min-delta {args.min_delta} (at least 0)")
        if "--json" in bench_args:
            p.error("leave --json out of the bench arguments: ab_bench asks for it")
        variant_files(args.variant)  # refused before any run
        print(report(*alternate(args.variant, args.rounds, bench_args), args.min_delta))
    except (CompareError, VariantError) as e:
        print(f"ab_bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
