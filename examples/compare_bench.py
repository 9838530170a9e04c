"""Two ``python -m rewriter bench --json`` runs side by side, kernel by kernel: what a change
(a new fusion pattern, a kernel's tiling) did to each shape's layer time and to each of its
kernels, from the profile every row carries (one un-captured call).

    python -m rewriter bench --layer 1 --batch 8 64 --paths rewritten --json > before.json
    ... change something ...
    python -m rewriter bench --layer 1 --batch 8 64 --paths rewritten --json > after.json
    python examples/compare_bench.py before.json after.json          # --min-delta 0.5: hide smaller moves

Rows are matched by (TP, batch, path), kernels by name and occurrence (a layer's second
``attn_res_norm`` against the other run's second). A layer's total varies by a few us between
runs on different machines (the routed experts alone by 5 to 10 us), so a kernel's own delta is the
sharper evidence. Runs of different layers, models or expert formats are refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

SAME = ("model", "layer", "q", "experts", "context", "kv_cache_dtype")


class CompareError(ValueError):
    """Input that cannot be compared: named, not guessed around."""


def load(path: str) -> dict:
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: not readable as JSON ({e})") from e
    if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
        raise CompareError(f"{path}: not the output of `python -m rewriter bench --json` (no 'rows' list)")
    return run


def keyed_kernels(launched: list) -> dict[tuple[str, int], float]:
    """(name, occurrence) -> us, in launch order."""
    seen: Counter = Counter()
    out = {}
    for name, us in launched or ():
        out[name, seen[name]] = float(us)
        seen[name] += 1
    return out


def compare(before: dict, after: dict, min_delta: float = 0.0) -> str:
    """The side-by-side report of two bench runs (the text ``main`` prints)."""
    for key in SAME:
        if before.get(key) != after.get(key):
            raise CompareError(f"the runs differ in {key}: {before.get(key)!r} against {after.get(key)!r}")
    rows_a = {(r["tp"], r["batch"], r["path"]): r for r in before["rows"]}
    rows_b = {(r["tp"], r["batch"], r["path"]): r for r in after["rows"]}
    common = [k for k in rows_a if k in rows_b]
    if not common:
        raise CompareError(f"no (TP, batch, path) in both runs: {sorted(rows_a)} against {sorted(rows_b)}")
    lines = [f"layer {before.get('layer')} of {before.get('model')}, {before.get('experts')} experts; "
             f"before: {before.get('device', '?')}, after: {after.get('device', '?')}"]
    for key in common:
        a, b = rows_a[key], rows_b[key]
        lines.append("")
        lines.append(f"TP {key[0]} batch {key[1]} {key[2]}: {_us(a['us'])} -> {_us(b['us'])} us"
                     f"{_delta(a['us'], b['us'])}, kernels {a.get('kernels')} -> {b.get('kernels')}")
        ka, kb = keyed_kernels(a.get("launched")), keyed_kernels(b.get("launched"))
        if not ka and not kb:
            continue
        lines.append("| kernel | before us | after us | delta |")
        lines.append("|---|---|---|---|")
        order = list(ka) + [k for k in kb if k not in ka]
        hidden = 0
        for name, i in order:
            x, y = ka.get((name, i)), kb.get((name, i))
            if x is not None and y is not None and abs(y - x) < min_delta:
                hidden += 1
                continue
            label = name if i == 0 else f"{name} #{i + 1}"
            lines.append(f"| {label} | {_us(x)} | {_us(y)} | {_delta(x, y).strip(' ()') or '-'} |")
        if hidden:
            lines.append(f"({hidden} kernels moved by less than {min_delta} us)")
    only = sorted(set(rows_a) ^ set(rows_b))
    if only:
        lines.append("")
        lines.append(f"in one run only: {only}")
    return "\n".join(lines)


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _delta(x, y) -> str:
    if x is None or y is None:
        return ""
    return f" ({y - x:+.1f}, {100.0 * (y - x) / x:+.1f}%)" if x else f" ({y - x:+.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="a `bench --json` output")
    p.add_argument("after", help="a `bench --json` output of the same layer")
    p.add_argument("--min-delta", type=float, default=0.0, help="hide kernels that moved by less (us)")
    args = p.parse_args(argv)
    if args.min_delta < 0:
        p.error(f"--min-delta {args.min_delta}: at least 0")
    try:
        print(compare(load(args.before), load(args.after), args.min_delta))
    except CompareError as e:
        print(f"compare_bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
