"""``python -m rewriter bench-ops``: each fused op's generated kernels timed against its
hand-written ones, on the same inputs, in one process.

An op is timed where both exist for its call: a hand-written template takes it and the compiler
lowers its reference to matrix-product stages (``codegen/launchers/generated.py``). The calls'
inputs are fresh random tensors of the rewritten layer's shapes, in enough copies that the
weights of one call are out of L2 when it comes round again (as in a model's step, each layer's
own weights); each side is captured in one CUDA graph over every copy, and the two graphs'
replays alternate (A B, B A, ...). A row gives each side's time a call (the median replay over
the copies), the ratio, and the op's HBM floor: the bytes the rewriter counts for its match (the
rows of each weight this rank reads, the activations in and out) at the copy bandwidth ``bench``
uses. An op handed a whole weight that it slices to its rank's rows (the router's) floors at the
rows. ``agree`` is the largest relative error between the two sides' results on the first copy's
inputs: a bench that times a wrong kernel says so (``!`` above 2e-2, ``NaN!`` for a NaN or an
infinity).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rewriter.commands import bench as bench_cmd
from rewriter.compiler.cost import hbm_us
from rewriter.model.shape import ShapeError

LAYERS = (0, 1, 3)  # one of each structure of Kimi K3: KDA + dense MLP, KDA + MoE, MLA + MoE
WEIGHT_SCALE = 0.02  # random weights of about a trained layer's size (no overflow through the epilogues)


@dataclass
class OpRow:
    op: str
    layer: int
    tp: int
    batch: int
    hand_written: str  # the hand-written kernels, by spec label
    generated: str
    hand_us: float
    generated_us: float
    floor_us: float
    agree: float  # the largest relative error between the two sides' results on the same inputs (NaN: a NaN)

    @property
    def ratio(self) -> float:
        return self.generated_us / self.hand_us


def add_bench_ops_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench-ops", help="time each fused op's generated kernels against its hand-written ones",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-k3", help="a preset or a config.json (default kimi-k3)")
    p.add_argument("--layers", type=int, nargs="+", default=list(LAYERS),
                   help=f"layers whose fused ops are timed (default {' '.join(map(str, LAYERS))})")
    p.add_argument("--tp", type=int, nargs="+", default=[16, 8], help="TP shard shapes (default 16 8)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batches (default 1 8 64)")
    p.add_argument("--ops", nargs="+", metavar="OP", help="only these fused ops (e.g. shared_experts dense_mlp)")
    p.add_argument("--reps", type=int, default=30, help="timed replays of each side (default 30)")
    p.add_argument("--hbm-tbps", type=float, metavar="TBPS", help="HBM bandwidth of the floor (as bench)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _fused_calls(cfg, layer: int, tp: int, batch: int, arch: str, only: Sequence[str] | None):
    """(op, call arguments as fake tensors and values, the bytes its match moves) of every fused op
    of the rewritten layer."""
    from patterns import default_rules
    from rewriter.compiler.pipeline import decode_shape, rewritten_layer

    result = rewritten_layer(cfg, layer, decode_shape(cfg, batch=batch, tp=tp, arch=arch), default_rules())
    for n in result.after.graph.nodes:
        name = str(n.target)
        if n.op != "call_function" or not name.startswith("k3f."):
            continue
        op = name.split(".")[1]
        if only and op not in only:
            continue
        yield (f"k3f::{op}", [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in n.args],
               n.meta["fused"]["bytes"])


def _materialized(args: Sequence[Any], gen: torch.Generator, device: str = "cuda") -> list[Any]:
    """Random tensors of the fake arguments' shapes and dtypes, on ``device``; weights ([N, K],
    both at least 64) scaled as a trained layer's."""
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        t = torch.randn(tuple(a.shape), generator=gen, dtype=torch.float32)
        if a.dim() == 2 and min(a.shape) >= 64:
            t = t * WEIGHT_SCALE
        out.append(t.to(a.dtype).to(device))
    return out


def _bytes(args: Sequence[Any]) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _sides(op: str, arch: str, fake: Sequence[Any]):
    """(hand-written template, generated template) both taking the call, or None."""
    from codegen.launchers.generated import PRODUCTS
    from codegen.templates import templates_for_op

    hand = next((t for t in templates_for_op(op) if not isinstance(t.make_specs(op, arch, fake), str)), None)
    if hand is None or isinstance(PRODUCTS.make_specs(op, arch, fake), str):
        return None
    return hand, PRODUCTS


def _loaded(template, op: str, arch: str, args: Sequence[Any]) -> tuple[Callable[[Sequence[Any]], Any], str]:
    from codegen.bind import load_kernels

    loaded = load_kernels(op, arch, args, template.kernel)
    if isinstance(loaded, str):
        raise ShapeError(f"{op}: the {template.kernel} template refused the real tensors: {loaded}")
    tpl, specs, fns = loaded
    return (lambda a: tpl.launch(fns, specs, a)), " + ".join(s.label() for s in specs)


def time_op(op: str, layer: int, tp: int, batch: int, arch: str, fake: Sequence[Any], floor_bytes: int,
            reps: int, tbps: float) -> OpRow | None:
    sides = _sides(op, arch, fake)
    if sides is None:
        return None
    gen = torch.Generator().manual_seed(1000 * layer + 10 * tp + batch)
    copies = bench_cmd.copies_for(_bytes(fake), None)
    sets = [_materialized(fake, gen) for _ in range(copies)]
    runs, labels, launches = [], [], []
    for template in sides:
        launch, label = _loaded(template, op, arch, sets[0])
        runs.append(bench_cmd.captured_graph(lambda launch=launch: [launch(s) for s in sets]).replay)
        labels.append(label)
        launches.append(lambda *a, launch=launch: launch(list(a)))
    agree = bench_cmd.agreement(*launches, sets[0])
    for run in runs:
        bench_cmd.warmed_up(run)
    hand, generated = bench_cmd.alternated_us(runs[0], runs[1], reps)
    floor_us = hbm_us(floor_bytes, tbps)
    return OpRow(op.split("::")[1], layer, tp, batch, labels[0], labels[1], statistics.median(hand) / copies,
                 statistics.median(generated) / copies, floor_us, agree)


HEAD = (f"{'op':<16} {'layer':>5} {'TP':>3} {'batch':>5} {'hand-written us':>16} {'generated us':>13} "
        f"{'ratio':>6} {'floor us':>9} {'agree':>8}  kernels (hand-written; generated)")


DISAGREE = 2e-2  # two sides' bf16 results further apart than this: one of them is wrong at these shapes


def _agree(err: float) -> str:
    return "NaN!" if math.isnan(err) else f"{err:.0e}" + ("!" if err > DISAGREE else "")


def render(rows: list[OpRow], device: str, head: bool = True) -> str:
    """The rows as a table (printed as each is measured: the header with the first)."""
    lines = [f"fused ops, generated kernels against hand-written ones on {device}: a call's time in CUDA graph "
             "replays, weights out of L2", HEAD, "-" * 100] if head else []
    for r in rows:
        lines.append(f"{r.op:<16} {r.layer:>5} {r.tp:>3} {r.batch:>5} {r.hand_us:>16.1f} {r.generated_us:>13.1f} "
                     f"{r.ratio:>6.2f} {r.floor_us:>9.1f} {_agree(r.agree):>8}  {r.hand_written}; {r.generated}")
    return "\n".join(lines)


def _check_args(args: argparse.Namespace, cfg) -> None:
    """One line naming what is wrong, before any GPU work."""
    from codegen.targets import MAX_TOKENS
    from codegen.templates import TEMPLATES

    for layer in args.layers:
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ShapeError(f"--layers {layer}: the model has layers 0..{cfg.num_hidden_layers - 1}")
    for tp in args.tp:
        if tp < 1:
            raise ShapeError(f"--tp {tp}: a TP size is a positive number of ranks")
    for batch in args.batch:
        if not 1 <= batch <= MAX_TOKENS:
            raise ShapeError(f"--batch {batch}: decode batches are 1..{MAX_TOKENS}")
    if args.reps < 1:
        raise ShapeError(f"--reps {args.reps}: at least one timed replay")
    known = sorted({op.split("::")[1] for t in TEMPLATES.values() for op in t.ops})
    for op in args.ops or ():
        if op not in known:
            raise ShapeError(f"--ops {op}: not a fused op with a hand-written template; those are {', '.join(known)}")


def run_bench_ops(args: argparse.Namespace) -> int:
    from rewriter.model.config import KimiK3Config

    cfg = KimiK3Config.load(args.model)
    _check_args(args, cfg)
    if not torch.cuda.is_available():
        raise ShapeError("bench-ops needs a CUDA GPU (inspect and compile run without one)")
    from codegen.bind import device_arch
    from rewriter.compiler.plan import install_kernels
    from rewriter.model.ops import collectives_excluded

    arch = device_arch()
    if arch is None:
        raise ShapeError(f"no CuTe DSL target for this GPU (capability {torch.cuda.get_device_capability()})")
    install_kernels(arch)
    device = torch.cuda.get_device_name()
    tbps, _ = bench_cmd.floor_bandwidth(device, args.hbm_tbps, bench_cmd.measured_copy_tbps)
    rows, seen = [], set()
    with torch.no_grad(), collectives_excluded():
        for tp in args.tp:
            for batch in args.batch:
                for layer in args.layers:
                    for op, fake, floor_bytes in _fused_calls(cfg, layer, tp, batch, arch, args.ops):
                        key = (op, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                                         for a in fake))
                        if key in seen:  # the same call in another layer (the shared experts of every MoE layer)
                            continue
                        seen.add(key)
                        row = time_op(op, layer, tp, batch, arch, fake, floor_bytes, args.reps, tbps)
                        if row is not None:
                            rows.append(row)
                            if not args.json:
                                print(render([row], device, head=len(rows) == 1), flush=True)
    if args.json:
        print(json.dumps({"device": device, "arch": arch, "hbm_tbps": tbps,
                          "rows": [{**asdict(r), "ratio": r.ratio, "agree": None if math.isnan(r.agree) else r.agree}
                                   for r in rows]}, indent=1, allow_nan=False))
    elif not rows:
        print("no fused op of these layers has both a hand-written template and generated kernels")
    return 0
