"""``python -m rewriter fuzz``: random decode steps, each rewritten and checked against the
reference layer, or refused with its reason (issue #15).

Every step draws a layer of the model, a batch (1..64 tokens in all), tokens per request (a
verify step of 2, 4 or 8 where the tokens allow, KDA and MLA layers alike), a cached context
and page size (the block table shuffled, as ``decode_inputs`` lays it out) and padding rows the
way vLLM pads a FULL-graph batch
(KDA state index 0, MLA slot -1 and sequence length 0). The step is traced, rewritten and run by
its schedule (on a GPU with the kernels installed), then run again from the same inputs: each
outcome is one of ``ok`` (within ``TOL`` of the reference, outputs and states, and bit-identical
when repeated; an MoE layer's outputs on the tokens whose router top-k gap is at least ``NEAR_TIE_MARGIN``,
since a near-tie may pick another expert on either correct path), ``refused`` (a named reason at
trace or rewrite), ``mismatch``, ``nondeterministic``, ``nonfinite`` (NaN or an infinity in an
output or state of the reference, the rewritten run or its repeat, named; checked first, since
NaN passes a tolerance and never equals itself) or ``error`` (anything raised while running);
the table counts them.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from typing import Any

import torch

TOL = 2e-2  # bf16 layers
OUTCOMES = ("ok", "refused", "mismatch", "nondeterministic", "nonfinite", "error")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.norm() > 0 else float(a.norm())


def _pad(inputs: dict[str, torch.Tensor], rows: int, q: int) -> None:
    """Make the last ``rows`` requests padding rows, as vLLM pads a FULL-graph batch."""
    if "state_indices" in inputs:
        inputs["state_indices"][-rows:] = 0
        if "num_accepted" in inputs:
            inputs["num_accepted"][-rows:] = 1
    if "seq_lens" in inputs:
        inputs["seq_lens"][-rows:] = 0
        inputs["slot_mapping"][-rows * q:] = -1


def draw(rng: random.Random, cfg: Any, layer_ids: list[int]) -> dict[str, Any]:
    """One random step: layer (of ``layer_ids``), batch, q, context, block size, padding rows."""
    layer = rng.choice(layer_ids)
    q = rng.choice((1, 1, 1, 2, 4, 8))
    batch = rng.choice((1, 1, 2, 3, 5, 8, 13, 16, 31, 64)) // q or 1
    return {"layer": layer, "batch": batch, "q": q, "context": rng.randrange(0, 40), "block_size": rng.choice((4, 16)),
            "padding": rng.randrange(0, batch) if batch > 1 and rng.random() < 0.3 else 0,
            "seed": rng.randrange(1 << 30)}


def run_step(layers: dict[int, torch.nn.Module], step: dict[str, Any], device: str, arch: str) -> tuple[str, str]:
    """(outcome, detail) of one drawn step."""
    from rewriter.commands.decode import STATE, nonfinite
    from rewriter.compiler.program import LayerRunner
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.layers.moe import NEAR_TIE_MARGIN, recorded_topk_margins
    from rewriter.model.layers.state import decode_inputs
    from rewriter.model.shape import DecodeShape, ShapeError

    layer = layers[step["layer"]]
    try:
        shape = DecodeShape(batch=step["batch"], q=step["q"], context=step["context"], block_size=step["block_size"],
                            arch=arch)
        result = rewrite(trace(layer, shape))
    except (ShapeError, ValueError) as e:
        return "refused", f"{type(e).__name__}: {e}"
    runner = LayerRunner.of(result, device)
    inputs = decode_inputs(layer, shape, device=device, seed=step["seed"])
    if step["padding"]:
        _pad(inputs, step["padding"], step["q"])
    copies = [{k: v.clone() for k, v in inputs.items()} for _ in range(3)]
    try:
        with recorded_topk_margins() as margins:
            want = layer(**copies[0])
        got = runner(*copies[1].values())
        again = runner(*copies[2].values())
    except Exception as e:  # noqa: BLE001  (every failure is an outcome to count)
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    checked = {}  # every output and state of the three runs
    for run, outs, state in (("reference", want, copies[0]), ("rewritten", got, copies[1]),
                             ("repeated", again, copies[2])):
        checked.update({f"{run} {name}": t for name, t in zip(("hidden", "prefix", "blocks"), outs)})
        checked.update({f"{run} {name}": t for name, t in state.items() if name in STATE})
    found = nonfinite(checked)
    if found:  # NaN compares false and never equals itself: it would pass the tolerance, then read as unrepeatable
        return "nonfinite", "; ".join(f"{name}: {kind}" for name, kind in found.items())
    # outputs on the tokens whose expert choice rounding cannot flip; the states (before the router) whole
    every = torch.ones(got[0].shape[0], dtype=torch.bool, device=got[0].device)
    clear = margins[0] >= NEAR_TIE_MARGIN if margins else every
    pairs = {name: (a[clear], b[clear]) for name, a, b in zip(("hidden", "prefix", "blocks"), got, want)}
    pairs.update({k: (copies[1][k], copies[0][k]) for k in inputs if k in STATE})
    errors = {name: _rel(a, b) for name, (a, b) in pairs.items() if a.numel()}
    name, worst = max(errors.items(), key=lambda kv: kv[1])
    if worst > TOL:
        return "mismatch", f"{name} relative error {worst:.2e} ({int(clear.sum())} of {clear.numel()} tokens compared)"
    if not all(torch.equal(a, b) for a, b in zip(got, again)):
        return "nondeterministic", "a repeated run differs"
    return "ok", f"{len(result.matches)} fused ops"


def describe(step: dict[str, Any]) -> str:
    return (f"layer {step['layer']} batch {step['batch']} q {step['q']} context {step['context']} "
            f"block {step['block_size']} padding {step['padding']}")


def fuzz(cfg: Any, steps: int, seed: int, experts: str, device: str, arch: str, progress=lambda m: None,
         layer_ids: list[int] | None = None) -> tuple[Counter, list[tuple[dict[str, Any], str, str]]]:
    """``steps`` random steps over ``layer_ids`` (default all); the outcome counts and every
    step that was not ok."""
    from rewriter.model.layers import build_layer
    from rewriter.model.layers.weights import init_random_

    rng = random.Random(seed)
    layer_ids = list(range(cfg.num_hidden_layers)) if layer_ids is None else layer_ids
    layers = {i: init_random_(build_layer(cfg, i, device=device, experts=experts), seed=seed + i) for i in layer_ids}
    counts, odd, t0 = Counter(), [], time.perf_counter()
    for n in range(1, steps + 1):
        step = draw(rng, cfg, layer_ids)
        outcome, detail = run_step(layers, step, device, arch)
        counts[outcome] += 1
        if outcome != "ok":
            odd.append((step, outcome, detail))
            progress(f"step {n}: {outcome}: {describe(step)}: {detail}")
        if n % 25 == 0 or n == steps:
            progress(f"step {n}/{steps}: {dict(counts)} ({time.perf_counter() - t0:.0f} s)")
    return counts, odd


def add_fuzz_parser(subparsers) -> argparse.ArgumentParser:
    f = subparsers.add_parser("fuzz", help="random decode steps, rewritten against the reference, or refused")
    f.add_argument("--model", default="tiny", help="a preset or a config.json (default tiny)")
    f.add_argument("--layers", type=int, help="draw from the first N layers only (default all)")
    f.add_argument("--tp", type=int, default=1, help="one TP rank's shard sizes, as a TP 1 model (default 1)")
    f.add_argument("--steps", type=int, default=500, help="steps to draw (default 500)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--experts", default="mxfp4", choices=("mxfp4", "bf16"), help="routed experts (default mxfp4)")
    return f


def run_fuzz(args: argparse.Namespace) -> int:
    from rewriter.model.config import KimiK3Config
    from rewriter.model.shape import ShapeError

    cfg = KimiK3Config.load(args.model)
    bad = [f"--{n} {v}" for n, v in (("steps", args.steps), ("tp", args.tp)) if v < 1]
    if args.layers is not None and not 1 <= args.layers <= cfg.num_hidden_layers:
        bad.append(f"--layers {args.layers} (1..{cfg.num_hidden_layers})")
    if bad:
        raise ShapeError(f"bad value: {', '.join(bad)}")
    if args.tp > 1:
        cfg = cfg.one_rank_of(args.tp)
    device, arch = "cpu", "sm_90a"
    if torch.cuda.is_available():
        from codegen.bind import device_arch
        from rewriter.compiler.plan import install_kernels

        device, arch = "cuda", device_arch() or "sm_90a"
        install_kernels(arch)
    with torch.no_grad():
        counts, odd = fuzz(cfg, args.steps, args.seed, args.experts, device, arch,
                           progress=lambda m: print(m, file=sys.stderr, flush=True),
                           layer_ids=list(range(args.layers or cfg.num_hidden_layers)))
    print(f"fuzz: {cfg.name}, {args.steps} steps, seed {args.seed}, {args.experts} experts, {device}")
    for outcome in OUTCOMES:
        print(f"  {outcome:<17}{counts[outcome]:>6}")
    if device == "cuda":
        from codegen import bind

        ran = sorted(op for op, c in bind.stats().items() if c.get("reference", 0))
        print(f"  fused ops that ran their reference at some shape (no kernel took it): {', '.join(ran) or 'none'}")
    for step, outcome, detail in odd[:20]:
        print(f"  {outcome}: {describe(step)}: {detail}")
    return 0 if set(counts) <= {"ok", "refused"} else 1
