"""``python -m rewriter decode``: a whole model decoded greedily, step by step, through the
reference layers and through the rewritten programs, each with its own states and caches: the
numerics gate (issue #15).

The model is built from the reference layers (random weights: embedding, the config's layers
or its first ``--layers``, the final AttnRes and norm, the LM head) at one TP rank's shard shapes
(``KimiK3Config.one_rank_of``: a TP 1 model of one rank's sizes, so no collective is stood in
for and the two paths compute the same function; the router and latent tail then read whole
what a TP group splits). Every step feeds both paths the reference's
greedy token (teacher forcing, so their errors stay comparable over the whole run) and records
the relative error of the final hidden state and of the logits, the error of the first KDA
layer's recurrent state, and whether the two paths' greedy tokens agree. A reference in fp32,
fed the same tokens, says what bf16 itself costs. On a GPU the rewritten step runs its kernels
in one CUDA graph; on a CPU the fused ops run their reference implementations (plumbing only).

The gate fails when the rewritten path's logits error grows with the step count beyond bf16
level (its median over the last tenth of the run above ``GROWTH`` times that over the first ten
steps and above the level: ``FLOOR``, or ``BF16_FACTOR`` times the bf16 reference's own median
error against fp32 where that is larger), when that late median passes ``CEILING`` (or the level,
where bf16 itself costs more: a random model's router has many near-ties, and every path in
bf16 breaks some of them its own way), when its median over the run is above the level, or,
with the fp32 reference, when the rewritten path is further from fp32 than ``BF16_FACTOR``
times the bf16 reference is (medians): it must be as accurate as the layers it replaces.
Medians, not single steps: MoE routing is discrete, so a near-tie that one path breaks the
other way moves one step's logits a long way without any drift.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

GROWTH, FLOOR, CEILING, BF16_FACTOR = 4.0, 2e-2, 0.1, 2.0
CHECKPOINTS = (1, 10, 100, 1000)


@dataclass
class Step:
    step: int
    logits_err: float
    hidden_err: float
    state_err: float | None  # the first KDA layer's recurrent state; None without a KDA layer
    fp32_logits_err: float | None  # the bf16 reference against the fp32 one
    rw_fp32_logits_err: float | None  # the rewritten path against the fp32 reference
    tokens_agree: bool


def rel(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class DecodeModel(nn.Module):
    """The reference layers of ``layer_ids`` with an embedding, the final AttnRes and norm and an LM head."""

    def __init__(self, cfg, layer_ids: list[int], experts: str, dtype: torch.dtype, device: str, seed: int):
        from rewriter.model.layers import build_layer
        from rewriter.model.layers.weights import init_random_

        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(init_random_(build_layer(cfg, i, dtype=dtype, device=device,
                                                             experts=experts), seed=seed + i) for i in layer_ids)
        g = torch.Generator(device=device).manual_seed(seed)
        hidden, vocab = cfg.hidden_size, cfg.vocab_size

        def param(*shape: int, scale: float, shift: float = 0.0) -> nn.Parameter:
            t = torch.randn(shape, generator=g, device=device) * scale + shift
            return nn.Parameter(t.to(dtype), requires_grad=False)

        self.embed = param(vocab, hidden, scale=1.0)
        self.out_norm, self.out_proj = param(hidden, scale=0.1, shift=1.0), param(hidden, scale=hidden ** -0.5)
        self.final_norm, self.lm_head = param(hidden, scale=0.1, shift=1.0), param(vocab, hidden, scale=hidden ** -0.5)

    def to_fp32(self) -> DecodeModel:
        """A copy in fp32, MXFP4 experts dequantized into dense fp32 ones (exact: every E2M1 value
        times its power of two is an fp32 number; a full-size layer's experts then take about
        10 GB at TP 16)."""
        import copy

        from rewriter.model.layers import build_layer

        twin = copy.deepcopy(self)
        for i, layer in enumerate(self.layers):
            routed = getattr(getattr(layer, "block_sparse_moe", None), "experts", None)
            routed = getattr(routed, "routed_experts", None)
            if routed is not None and routed.format.quantized:
                dense = build_layer(self.cfg, layer.layer_idx, dtype=torch.float32,
                                    device=self.embed.device, experts="bf16")
                params = dict(layer.named_parameters())
                for name, p in dense.named_parameters():
                    if ".routed_experts." in name:
                        proj = name.rsplit(".", 1)[1].removesuffix("_weight")
                        p.data = routed.format.dequant(getattr(routed, f"{proj}_weight"), getattr(routed, f"{proj}_scale"),
                                                       torch.float32)
                    else:
                        p.data = params[name].data.clone()
                twin.layers[i] = dense
        for p in twin.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
        return twin

    def head(self, hidden: Tensor, prefix: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """(final hidden state, fp32 logits): the final AttnRes, the norm and the LM head."""
        from rewriter.model.layers.attn_res import attn_res
        from rewriter.model.layers.common import rms_norm

        eps = self.cfg.rms_norm_eps
        x, _, _ = attn_res(prefix, hidden, blocks, self.out_norm, self.out_proj, None,
                           num_blocks=self.cfg.num_attn_res_blocks, block_write_idx=-1, eps=eps, output_norm_eps=0.0)
        x = rms_norm(x, self.final_norm, eps)
        return x, torch.nn.functional.linear(x, self.lm_head).float()


class DecodeState:
    """One path's decode state for ``batch`` requests of up to ``max_len`` tokens, laid out as
    vLLM lays it out (KDA pages per slot, a paged MLA cache with a shuffled block table), and
    the per-step inputs of every layer (positions advance in place, so a captured step replays)."""

    def __init__(self, model: DecodeModel, batch: int, max_len: int, shape: Any, seed: int):
        from rewriter.model.layers.state import decode_inputs

        self.batch, self.step_inputs = batch, []
        self.position = torch.zeros(batch, dtype=torch.long, device=model.embed.device)
        for i, layer in enumerate(model.layers):
            room = dataclasses.replace(shape, context=max_len - 1, dtype=model.embed.dtype)  # cache pages for max_len
            inputs = decode_inputs(layer, room, device=model.embed.device, seed=seed + i)
            for name in ("conv_state", "recurrent_state", "kv_cache"):
                if name in inputs:
                    inputs[name].zero_()  # a fresh request's state
            self.step_inputs.append(inputs)

    def advance(self) -> None:
        """Point every MLA layer's step inputs at the current position."""
        for inputs in self.step_inputs:
            if "seq_lens" in inputs:
                table, block = inputs["block_table"], inputs["kv_cache"].shape[1]
                pos = self.position
                inputs["seq_lens"].copy_(pos + 1)
                inputs["slot_mapping"].copy_(table.gather(1, (pos // block).view(-1, 1)).view(-1).long() * block
                                             + pos % block)

    def attention_inputs(self, i: int) -> list[Tensor]:
        return list(self.step_inputs[i].values())[3:]

    def kda_state(self) -> Tensor | None:
        return next((s["recurrent_state"] for s in self.step_inputs if "recurrent_state" in s), None)


def step_fn(model: DecodeModel, state: DecodeState, runners: list | None) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """token ids [B] -> (final hidden, logits) for one decode step of ``model`` (its reference
    layers, or ``runners`` for the rewritten ones), with ``state`` updated in place."""
    def step(tokens: Tensor) -> tuple[Tensor, Tensor]:
        prefix = model.embed[tokens]
        blocks = prefix.new_zeros(prefix.shape[0], model.cfg.num_attn_res_blocks, prefix.shape[1])
        hidden = None
        for i, layer in enumerate(model.layers):
            run = layer if runners is None else runners[i]
            hidden, prefix, blocks = run(prefix if hidden is None else hidden, prefix, blocks,
                                         *state.attention_inputs(i))
        return model.head(hidden, prefix, blocks)

    return step


def rewritten_runners(model: DecodeModel, shape: Any) -> list:
    from rewriter.compiler.program import LayerRunner
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace

    return [LayerRunner.of(rewrite(trace(layer, shape)), model.embed.device) for layer in model.layers]


def decode(cfg, *, layer_ids: list[int], batch: int, steps: int, experts: str, kv_cache_dtype: str,
           device: str, arch: str, seed: int = 0, fp32: bool = True,
           progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Decode ``steps`` tokens for ``batch`` requests of ``cfg`` (a TP 1 model: one rank's sizes
    come from ``cfg.one_rank_of``) through the paths; per-step errors."""
    from rewriter.compiler.rewrite import is_fused
    from rewriter.model.shape import DecodeShape

    shape = DecodeShape(batch=batch, arch=arch, kv_cache_dtype=kv_cache_dtype)
    ref_model = DecodeModel(cfg, layer_ids, experts, torch.bfloat16, device, seed)
    paths = {"reference": (ref_model, None)}
    paths["rewritten"] = (ref_model, rewritten_runners(ref_model, shape))
    notes = []
    if fp32:
        paths["fp32"] = (ref_model.to_fp32(), None)
    states = {name: DecodeState(m, batch, steps + 1, shape, seed) for name, (m, _) in paths.items()}
    fns = {name: step_fn(m, states[name], r) for name, (m, r) in paths.items()}
    cuda = torch.device(device).type == "cuda"
    tokens = {name: torch.zeros(batch, dtype=torch.long, device=device) for name in paths}
    if cuda:  # the rewritten step as one CUDA graph over static buffers
        static = fns["rewritten"]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        warm = DecodeState(ref_model, batch, steps + 1, shape, seed + 99)  # warm-up on a scratch state
        with torch.cuda.stream(stream):
            step_fn(ref_model, warm, paths["rewritten"][1])(tokens["rewritten"])
        torch.cuda.current_stream().wait_stream(stream)
        del warm
        with torch.cuda.graph(graph):
            captured = static(tokens["rewritten"])
        fns["rewritten"] = lambda t: (graph.replay(), captured)[1]
    first = torch.randint(0, ref_model.embed.shape[0], (batch,), generator=torch.Generator().manual_seed(seed))
    for t in tokens.values():
        t.copy_(first)
    rows, disagree, t0 = [], None, time.perf_counter()
    fp32_ok = "fp32" in paths
    for n in range(1, steps + 1):
        for s in states.values():
            s.advance()
        out = {}
        for name, fn in fns.items():
            if name == "fp32" and not fp32_ok:
                continue
            try:
                out[name] = fn(tokens[name])
            except RuntimeError as e:  # a layer the fp32 twin cannot run: reported, the run goes on
                if name != "fp32":
                    raise
                fp32_ok = False
                notes.append(f"fp32 reference not run: {str(e).splitlines()[0][:120]}")
        (h_ref, l_ref), (h_rw, l_rw) = out["reference"], out["rewritten"]
        ref_state, rw_state = states["reference"].kda_state(), states["rewritten"].kda_state()
        agree = bool(torch.equal(l_ref.argmax(-1), l_rw.argmax(-1)))
        if not agree and disagree is None:
            disagree = n
        rows.append(Step(n, rel(l_rw, l_ref), rel(h_rw, h_ref), None if ref_state is None else rel(rw_state, ref_state),
                         rel(l_ref, out["fp32"][1]) if "fp32" in out else None,
                         rel(l_rw, out["fp32"][1]) if "fp32" in out else None, agree))
        nxt = l_ref.argmax(-1)
        for name in paths:
            tokens[name].copy_(nxt)
        for s in states.values():
            s.position += 1
        if n % 100 == 0 or n == steps:
            progress(f"step {n}/{steps}: logits error {rows[-1].logits_err:.2e} ({time.perf_counter() - t0:.0f} s)")
    fused = sum(1 for r in paths["rewritten"][1] for n in r.module.graph.nodes if is_fused(n))
    return {"model": cfg.name, "batch": batch, "steps": steps, "experts": experts, "kv_cache_dtype": kv_cache_dtype,
            "layers": layer_ids, "device": device, "fused_ops": fused, "first_disagreement": disagree, "notes": notes,
            "gate": gate([r.logits_err for r in rows], [r.fp32_logits_err for r in rows if r.fp32_logits_err is not None],
                         [r.rw_fp32_logits_err for r in rows if r.rw_fp32_logits_err is not None]),
            "rows": [asdict(r) for r in rows]}


def gate(errors: list[float], bf16_errors: list[float] | None = None,
         rewritten_fp32_errors: list[float] | None = None) -> dict[str, Any]:
    """Whether the logits error stays at bf16 level over the run (see the module doc):
    ``errors`` rewritten against the bf16 reference, ``bf16_errors`` that reference against
    fp32, ``rewritten_fp32_errors`` the rewritten path against fp32."""
    early = statistics.median(errors[:10])
    late = statistics.median(errors[-max(1, len(errors) // 10):])
    overall = statistics.median(errors)
    bf16 = statistics.median(bf16_errors) if bf16_errors else None
    level = max(FLOOR, BF16_FACTOR * bf16) if bf16 is not None else FLOOR  # what bf16 rounding alone allows
    reasons = []
    if late > GROWTH * early and late > level:
        reasons.append(f"the error grows: median {late:.2e} over the last tenth against {early:.2e} over the "
                       f"first ten steps (bf16 level {level:.2e})")
    ceiling = max(CEILING, level)
    if late > ceiling:
        reasons.append(f"the median error over the last tenth is {late:.2e} (ceiling {ceiling:.2e})")
    if overall > level:
        reasons.append(f"the median error {overall:.2e} is above bf16 level {level:.2e}"
                       + (f" ({BF16_FACTOR}x bf16's own {bf16:.2e} against fp32)" if bf16 is not None else ""))
    rw_fp32 = statistics.median(rewritten_fp32_errors) if rewritten_fp32_errors and bf16 is not None else None
    if rw_fp32 is not None and rw_fp32 > max(FLOOR, BF16_FACTOR * bf16):
        reasons.append(f"the rewritten path is {rw_fp32:.2e} from fp32 (median), more than {BF16_FACTOR}x the bf16 "
                       f"reference's {bf16:.2e}")
    return {"passed": not reasons, "early": early, "late": late, "median": overall, "worst": max(errors),
            "bf16_median": bf16, "rewritten_fp32_median": rw_fp32, "level": level, "reasons": reasons}


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"decode: {result['model']}, batch {result['batch']}, {result['steps']} steps, layers "
             f"{result['layers'][0]}..{result['layers'][-1]} ({result['fused_ops']} fused ops), {result['experts']} "
             f"experts, {result['kv_cache_dtype']} MLA cache, {result['device']}",
             f"{'step':>6} {'logits err':>11} {'hidden err':>11} {'KDA state err':>14} {'bf16 vs fp32 ref':>17} "
             f"{'rewritten vs fp32':>18}  tokens"]
    for n in sorted({c for c in CHECKPOINTS if c <= len(rows)} | {len(rows)}):
        r = rows[n - 1]
        state = f"{r['state_err']:14.2e}" if r["state_err"] is not None else f"{'-':>14}"
        fp32 = f"{r['fp32_logits_err']:17.2e}" if r["fp32_logits_err"] is not None else f"{'-':>17}"
        rw32 = f"{r['rw_fp32_logits_err']:18.2e}" if r["rw_fp32_logits_err"] is not None else f"{'-':>18}"
        lines.append(f"{n:>6} {r['logits_err']:11.2e} {r['hidden_err']:11.2e}{state}{fp32} {rw32}  "
                     f"{'agree' if r['tokens_agree'] else 'differ'}")
    d = result["first_disagreement"]
    lines.append(f"first greedy disagreement: {'none' if d is None else f'step {d}'}")
    lines.extend(result["notes"])
    g = result["gate"]
    lines.append("gate: " + ("passed" if g["passed"] else "FAILED: " + "; ".join(g["reasons"]))
                 + f" (median error {g['early']:.2e} early, {g['late']:.2e} late, {g['median']:.2e} overall; worst "
                   f"{g['worst']:.2e}" + (f"; against fp32: bf16 reference {g['bf16_median']:.2e}, rewritten "
                                          f"{g['rewritten_fp32_median']:.2e}" if g["bf16_median"] else "")
                   + ")")
    return "\n".join(lines)


def add_decode_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("decode", help="decode a whole model through reference and rewritten layers; the "
                                             "numerics gate")
    d.add_argument("--model", default="tiny", help="a preset or a config.json (default tiny)")
    d.add_argument("--layers", type=int, help="decode with the first N layers only (default all)")
    d.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests (default 1 8)")
    d.add_argument("--steps", type=int, default=1000, help="tokens decoded per request (default 1000)")
    d.add_argument("--tp", type=int, default=1, help="one TP rank's shard sizes, as a TP 1 model (default 1)")
    d.add_argument("--experts", default="mxfp4", choices=("mxfp4", "bf16"), help="routed experts (default mxfp4)")
    d.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16", help="MLA latent cache")
    d.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return d


def run_decode(args: argparse.Namespace) -> int:
    from rewriter.model.config import KimiK3Config
    from rewriter.model.shape import ShapeError

    bad = [f"--{n} {v}" for n, v in (("steps", args.steps), ("tp", args.tp)) if v < 1]
    bad += [f"--batch {b}" for b in args.batch if not 1 <= b <= 64]
    cfg = KimiK3Config.load(args.model)
    if args.tp > 1:
        cfg = cfg.one_rank_of(args.tp)
    if args.layers is not None and not 1 <= args.layers <= cfg.num_hidden_layers:
        bad.append(f"--layers {args.layers} (1..{cfg.num_hidden_layers})")
    if bad:
        raise ShapeError(f"bad value: {', '.join(bad)}")
    device, arch = "cpu", "sm_90a"
    if torch.cuda.is_available():
        from codegen.bind import device_arch
        from rewriter.compiler.plan import install_kernels

        device, arch = "cuda", device_arch() or "sm_90a"
        install_kernels(arch)
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    layer_ids = list(range(args.layers or cfg.num_hidden_layers))
    results = []
    with torch.no_grad():
        for batch in args.batch:
            log(f"batch {batch}: building {len(layer_ids)} layers on {device}")
            results.append(decode(cfg, layer_ids=layer_ids, batch=batch, steps=args.steps,
                                  experts=args.experts, kv_cache_dtype=args.kv_cache_dtype, device=device, arch=arch,
                                  seed=args.seed, fp32=not args.no_fp32, progress=log))
            if not args.json:
                print(render(results[-1]), flush=True)
    if device == "cuda":
        from codegen import bind

        ran = sorted(op for op, c in bind.stats().items() if c.get("reference", 0))
        if ran:
            log(f"fused ops that ran their reference (no kernel took them): {', '.join(ran)}")
    if args.json:
        print(json.dumps({"model": args.model, "results": results}, indent=1))
    return 0 if all(r["gate"]["passed"] for r in results) else 1
