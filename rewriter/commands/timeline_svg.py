"""One layer of a graph replay as a picture: an SVG Gantt chart per bench row, from the
timeline every rewritten row carries (``bench_cmd.replay_timeline``: each kernel's start,
duration and how far it moved the layer's end).

Why a picture: the table says what each kernel adds, but not what runs beside what. Here each
kernel is a bar at its start and duration, and a strip under the bars lays the layer's span out
as the kernels that made it (each kernel's addition, end to end), against the layer's HBM floor
as served. A chain of short kernels each waiting for the one before shows up as a staircase that
is long next to the floor; a kernel that hides inside another adds nothing to the strip.

Written by ``python -m rewriter bench --svg PATH`` and, from a saved ``bench --json`` run, by
``examples/plot_timeline.py``. Plain SVG, no dependency.
"""
from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

LANE = 18  # pixels per kernel row
LABEL_W = 210  # left margin for the kernel names
PLOT_W = 720  # pixels for the time axis
STRIP = 22  # the span strip under the bars
TORCH = "#9a9a9a"  # kernels that are not ours (torch's stand-ins for excluded collectives)
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#86bcb6", "#d37295", "#8cd17d", "#b6992d", "#499894")  # a layer's kernels, each its own


class TimelineError(ValueError):
    """Input that cannot be drawn, named."""


@dataclass(frozen=True)
class Panel:
    """One bench row's replay timeline: ``kernels`` as (label, start us, duration us, us added
    to the layer's span), ``floor_us`` the layer's floor as served, ``us`` the bench's figure."""
    heading: str
    kernels: list[tuple[str, float, float, float]]
    floor_us: float
    us: float | None

    @property
    def span_us(self) -> float:
        return sum(added for *_, added in self.kernels)


def panels_of(run: dict) -> list[Panel]:
    """The panels of a ``bench --json`` run: one per row with a timeline."""
    rows = run.get("rows") if isinstance(run, dict) else None
    if not isinstance(rows, list):
        raise TimelineError("not the output of `python -m rewriter bench --json` (no 'rows' list)")
    panels = []
    for r in rows:
        timeline = r.get("timeline")
        if not timeline:
            continue
        try:
            kernels = [(str(label), float(t), float(d), float(a)) for label, t, d, a in timeline]
        except (TypeError, ValueError) as e:
            raise TimelineError(f"row TP {r.get('tp')} batch {r.get('batch')}: a timeline entry is not "
                                f"(kernel, start, duration, added): {e}") from e
        heading = f"TP {r.get('tp')}, batch {r.get('batch')}, {r.get('path')}"
        if r.get("paired_diff_us") is not None:
            heading += f" ({r['paired_diff_us']:+.1f} us against the tree, paired median)"
        panels.append(Panel(heading, kernels, float(r.get("floor_us") or 0.0), r.get("us")))
    if not panels:
        raise TimelineError("no row carries a replay timeline (only the rewritten path has one, and only where "
                            "the profiler saw the kernels inside the graph replay)")
    return panels


def is_torch(label: str) -> bool:
    """A kernel that is not ours: the bench names our kernels by their spec (one word), torch's
    by their C++ names."""
    return "::" in label or " " in label


def colours(panels: list[Panel]) -> dict[str, str]:
    """A colour per kernel name, in order of first appearance, so that a kernel keeps its colour
    in every panel of the picture and the first ``len(PALETTE)`` names all differ; grey for
    torch's kernels."""
    out: dict[str, str] = {}
    for p in panels:
        for label, *_ in p.kernels:
            if label not in out:
                out[label] = TORCH if is_torch(label) else PALETTE[sum(c != TORCH for c in out.values()) % len(PALETTE)]
    return out


def _ticks(limit: float) -> list[float]:
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if limit / s <= 12)
    return [i * step for i in range(int(limit // step) + 1)]


def render(panels: list[Panel], title: str) -> str:
    """The SVG text: one panel per row, all on one time scale so that rows compare by eye."""
    if not panels:
        raise TimelineError("nothing to draw")
    limit = max(max(p.span_us, p.floor_us, max(t + d for _, t, d, _ in p.kernels)) for p in panels) * 1.04
    scale = PLOT_W / limit
    colour = colours(panels)
    out, y = [], 30
    for p in panels:
        top = y + 22
        lanes = len(p.kernels)
        floor_x = LABEL_W + p.floor_us * scale
        us = f"{p.us:.1f} us a layer, " if p.us else ""
        out.append(f'<text x="4" y="{y + 14}" font-weight="bold">{escape(p.heading)}: {us}span {p.span_us:.1f} us, '
                   f'floor {p.floor_us:.1f} us</text>')
        for i, (label, t, d, added) in enumerate(p.kernels):
            ly = top + i * LANE
            out.append(f'<text x="{LABEL_W - 6}" y="{ly + 13}" text-anchor="end">{escape(label[:32])}</text>')
            out.append(f'<rect class="kernel" x="{LABEL_W + t * scale:.1f}" y="{ly + 2}" '
                       f'width="{max(d * scale, 0.5):.1f}" height="{LANE - 4}" fill="{colour[label]}">'
                       f'<title>{escape(label)}: start {t:.2f} us, {d:.2f} us, adds {added:.2f} us</title></rect>')
        strip_y = top + lanes * LANE + 4
        out.append(f'<text x="{LABEL_W - 6}" y="{strip_y + 15}" text-anchor="end">the span, kernel by kernel</text>')
        x = LABEL_W
        for label, _, _, added in p.kernels:
            if added > 0:
                out.append(f'<rect class="added" x="{x:.1f}" y="{strip_y}" width="{added * scale:.1f}" '
                           f'height="{STRIP}" fill="{colour[label]}" stroke="white" stroke-width="0.5">'
                           f'<title>{escape(label)} adds {added:.2f} us</title></rect>')
                x += added * scale
        bottom = strip_y + STRIP + 4
        out.append(f'<line class="floor" x1="{floor_x:.1f}" y1="{top}" x2="{floor_x:.1f}" y2="{bottom}" '
                   f'stroke="black" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{floor_x + 3:.1f}" y="{bottom + 11}" font-size="10">HBM floor</text>')
        y = bottom + 24
    axis_y = y
    out.append(f'<line x1="{LABEL_W}" y1="{axis_y}" x2="{LABEL_W + PLOT_W}" y2="{axis_y}" stroke="black"/>')
    for tick in _ticks(limit):
        tx = LABEL_W + tick * scale
        out.append(f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{axis_y + 4}" stroke="black"/>')
        out.append(f'<text x="{tx:.1f}" y="{axis_y + 16}" text-anchor="middle">{tick:g}</text>')
    out.append(f'<text x="{LABEL_W + PLOT_W / 2:.0f}" y="{axis_y + 32}" text-anchor="middle">us from the layer\'s '
               'first kernel</text>')
    height = axis_y + 44
    width = LABEL_W + PLOT_W + 20
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
            f'font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
            f'<text x="4" y="16" font-size="13" font-weight="bold">{escape(title)}</text>\n'
            + "\n".join(out) + "\n</svg>\n")


def title_of(run: dict) -> str:
    """The picture's title from a ``bench --json`` run's header."""
    parts = [str(run.get("model", "?")), f"layer {run.get('layer', '?')}"]
    if run.get("q", 1) != 1:
        parts.append(f"verify {run['q']} tokens")
    if run.get("device"):
        parts.append(str(run["device"]))
    return ", ".join(parts) + ": one layer of a graph replay"
