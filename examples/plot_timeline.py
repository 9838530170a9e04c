"""A saved ``python -m rewriter bench --json`` run drawn as pictures: for each rewritten row, one
layer of a graph replay as a Gantt chart (each kernel at its start and duration), the layer's
span laid out kernel by kernel, and its HBM floor as served (``rewriter/commands/timeline_svg.py``).
No GPU needed, so a run saved on the GPU machine can be looked at anywhere.

    python -m rewriter bench --layer 1 --tp 16 --batch 1 64 --paths rewritten --json > run.json    # on the GPU
    python examples/plot_timeline.py run.json -o layer1.svg                                     # anywhere

``bench --svg PATH`` writes the same picture at the end of a run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewriter.commands.timeline_svg import TimelineError, panels_of, render, title_of  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a `python -m rewriter bench --json` output")
    p.add_argument("-o", "--output", required=True, type=Path, help="the SVG file to write")
    args = p.parse_args(argv)
    try:
        run = json.loads(Path(args.run).read_text())
        svg = render(panels_of(run), title_of(run))
    except (OSError, json.JSONDecodeError) as e:
        print(f"plot_timeline: {args.run}: not readable as JSON ({e})", file=sys.stderr)
        return 2
    except TimelineError as e:
        print(f"plot_timeline: {args.run}: {e}", file=sys.stderr)
        return 2
    args.output.write_text(svg)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
