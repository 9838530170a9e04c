"""Several ``python -m rewriter bench`` pieces on one GPU in one short device call, and one table.

A device call is at most 10 minutes, and a layer's kernels and the torch.compile reference take
minutes to compile. So each piece first runs once with ``--reps 1``, all in parallel (kernels
and Inductor compiled on every CPU; those timings are thrown away), then each piece alone with
the given ``--reps`` (its JSON, progress log and timeline under ``--out``), in the order given,
skipping, by name, a piece that would start past ``--seconds``. Last, one markdown table of every
row: the layer's floor as served, each path's figure and kernels, and the rewritten row's share
of the floor.

    python examples/bench_rows.py 3:16:fp8:rewritten 3:8:bf16:rewritten+torch.compile --out rows --seconds 560
    python examples/bench_rows.py --table rows/*.json       # the table of runs already made

A piece is ``LAYER:TP:CACHE:PATHS``: the layer index, the TP shape, the MLA cache (bf16 or fp8;
ignored by KDA layers) and ``+``-joined ``bench --paths``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rewriter.commands.bench import PATHS

ROOT = Path(__file__).resolve().parents[1]


class PieceError(ValueError):
    """A piece that cannot be run, named."""


@dataclass(frozen=True)
class Piece:
    layer: int
    tp: int
    cache: str
    paths: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Piece:
        parts = text.split(":")
        if len(parts) != 4:
            raise PieceError(f"piece {text!r}: LAYER:TP:CACHE:PATHS, e.g. 3:16:fp8:rewritten+torch.compile")
        layer, tp, cache, paths = parts
        if not layer.isdigit() or not tp.isdigit() or int(tp) < 1:
            raise PieceError(f"piece {text!r}: the layer and TP are whole numbers, TP at least 1")
        if cache not in ("bf16", "fp8"):
            raise PieceError(f"piece {text!r}: cache {cache!r} is bf16 or fp8")
        chosen = tuple(paths.split("+"))
        unknown = [p for p in chosen if p not in PATHS]
        if unknown or not paths:
            raise PieceError(f"piece {text!r}: paths {unknown or [paths]} not among {', '.join(PATHS)}")
        return cls(int(layer), int(tp), cache, chosen)

    @property
    def name(self) -> str:
        """The stem of its files: letters, digits, ``._-`` only (so that every file system and copy tool
        takes it: a ``+`` is not safe everywhere)."""
        return f"l{self.layer}_tp{self.tp}_{self.cache}_{'_'.join(self.paths).replace(' ', '-')}"

    def bench_args(self, batches: list[int], context: int, reps: int, compile_mode: str) -> list[str]:
        return ["--layer", str(self.layer), "--tp", str(self.tp), "--batch", *map(str, batches),
                "--context", str(context), "--kv-cache-dtype", self.cache, "--paths", *self.paths,
                "--compile-mode", compile_mode, "--reps", str(reps)]


def bench_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rewriter", "bench", *args]


def run_pieces(pieces: list[Piece], out: Path, *, batches: list[int], context: int, reps: int,
               compile_mode: str, seconds: float, log=print) -> list[Path]:
    """Warm every piece in parallel, then time each alone; the JSON files written, in order."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    logs = [(out / f"{p.name}.warm.log").open("w") for p in pieces]
    warm = [subprocess.Popen(bench_command(p.bench_args(batches, context, 1, compile_mode)), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=f) for p, f in zip(pieces, logs)]
    warm_budget = 0.45 * seconds
    for piece, proc, f in zip(pieces, warm, logs):
        try:
            proc.wait(timeout=max(1.0, warm_budget - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log(f"{piece.name}: warm-up stopped at {warm_budget:.0f}s (its timed run compiles the rest)")
        f.close()
    log(f"warm-up: {time.monotonic() - start:.0f}s")
    written = []
    for piece in pieces:
        left = seconds - (time.monotonic() - start)
        if left < 20:
            log(f"{piece.name}: not run, {left:.0f}s left")
            continue
        path = out / f"{piece.name}.json"
        with path.open("w") as stdout, (out / f"{piece.name}.log").open("w") as stderr:
            cmd = bench_command(piece.bench_args(batches, context, reps, compile_mode)
                                + ["--json", "--svg", str(out / f"{piece.name}.svg")])
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=stdout, stderr=stderr, timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out"
        log(f"{piece.name}: {time.monotonic() - start:.0f}s, exit {rc}")
        if rc == 0:
            written.append(path)
    return written


def floor_cell(floor_us: float, tbps: float | None) -> str:
    """``149 MB = 44.5 us``; the bytes only where the run names its floor's bandwidth (older runs do not)."""
    return f"{floor_us * tbps:.0f} MB = {floor_us:.1f} us" if tbps else f"{floor_us:.1f} us"


def table(runs: list[dict]) -> str:
    """One markdown row per (run, TP, batch): the floor as served, the rewritten figure (kernels)
    and its multiple of the floor, then every other path's figure (kernels)."""
    others = [p for p in PATHS if p != "rewritten" and any(r["path"] == p for run in runs for r in run["rows"])]
    head = ["layer", "cache", "TP", "batch", "floor as served", "rewritten (kernels)", "x floor",
            *[f"{p} (kernels)" for p in others]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        shapes = dict.fromkeys((r["tp"], r["batch"]) for r in run["rows"])
        for tp, batch in shapes:
            rows = {r["path"]: r for r in run["rows"] if (r["tp"], r["batch"]) == (tp, batch)}
            first = next(iter(rows.values()))
            floor_us = first["floor_us"]

            def cell(path: str) -> str:
                r = rows.get(path)
                return "" if r is None or r["us"] is None else f"{r['us']:.1f} ({r['kernels']})"

            rewritten = rows.get("rewritten")
            ratio = f"{rewritten['us'] / floor_us:.2f}x" if rewritten and rewritten["us"] else ""
            cache = run["kv_cache_dtype"] if run.get("attention") == "mla" else ""
            lines.append("| " + " | ".join([
                str(run["layer"]), cache, str(tp), str(batch),
                floor_cell(floor_us, run.get("floor_tbps")), cell("rewritten"), ratio,
                *[cell(p) for p in others]]) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pieces", nargs="*", help="LAYER:TP:CACHE:PATHS, e.g. 3:16:fp8:rewritten+torch.compile")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these bench --json files and exit")
    p.add_argument("--out", type=Path, default=Path("bench_rows"), help="folder for each piece's JSON, log, SVG")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--compile-mode", choices=("default", "max-autotune"), default="default")
    p.add_argument("--seconds", type=float, default=560, help="no piece starts past this (default 560)")
    args = p.parse_args()
    try:
        if args.table:
            files = [Path(f) for f in args.table]
        elif args.pieces:
            files = run_pieces([Piece.parse(t) for t in args.pieces], args.out, batches=args.batch,
                               context=args.context, reps=args.reps, compile_mode=args.compile_mode,
                               seconds=args.seconds)
        else:
            p.error("give pieces to run or --table JSON files")
        runs = [json.loads(f.read_text()) for f in files]
    except (PieceError, OSError, json.JSONDecodeError) as e:
        print(f"bench_rows: {e}", file=sys.stderr)
        return 2
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
