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
layer's recurrent state, whether the two paths' greedy tokens agree, and the reference
routers' smallest top-k gap. A reference in fp32, fed the same tokens, says what bf16 itself
costs. On a GPU the rewritten step runs its kernels in one CUDA graph; on a CPU the fused ops
run their reference implementations, so the two paths compute the same thing and errors of 0
prove the rewritten graph, not the kernels (the table and the JSON say so). Before building
anything the memory the run needs is estimated (``memory_estimate``) and a run that would not
fit is refused, with what would; the JSON gives each batch's estimate beside, on a GPU, the
peak it allocated.

The gate. Any NaN or infinity in a path's logits, final hidden state or decode state fails it,
at any length, naming the path, the tensor and the first step. Otherwise it judges runs of
``MIN_STEPS`` (100) steps or more, by the same rule at any length; a shorter run is "too
short to judge". It looks at the rewritten path's logits error against the bf16 reference
through medians over fixed spans of steps: the first and the last ``WINDOW`` (25) steps, and
the second half of the run. Medians, and not over the first steps: random weights give the
routers many near-ties (a top-k gap under bf16's rounding), which a correct bf16 path may
break the other way, moving that step's logits a long way, and while the context is short
the caches carry that into the next steps; the second half's median does not see a few such
spikes early, at 100 steps as at 1000. The level is what bf16 costs: ``FLOOR`` (2e-2), or
``BF16_FACTOR`` (2) times the bf16 reference's own median error against fp32 over the second half
where that is larger. The gate fails when the error grows (the last window's median above
``GROWTH`` (4) times the first's and above the level), when the last window's median passes
``CEILING`` (0.1; or the level, where larger), when the second half's median is above the level,
or, with the fp32 reference, when the rewritten path's median error against fp32 over the
second half is above the level: it must be as accurate as the layers it replaces, compared
with the bf16 reference over the same steps by the same statistic.

Exit status: 0 when every batch passed, 1 when one failed, 3 when none failed but one was too
short to judge, 2 on bad input (a run that would not fit in memory included).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rewriter.model.layers.moe import NEAR_TIE_MARGIN

GROWTH, FLOOR, CEILING, BF16_FACTOR = 4.0, 2e-2, 0.1, 2.0
WINDOW, MIN_STEPS = 25, 100
CHECKPOINTS = (1, 10, 100, 1000)
STATE = ("conv_state", "recurrent_state", "kv_cache")
DEQUANT_CHUNK = 16  # experts ``to_fp32`` dequantizes at a time
DEQUANT_BYTES = {2: 17, 4: 28}  # peak bytes per value MXFP4 dequantization makes in bf16 or fp32 (measured: its
                                # codes, exponents, masks and output, 7 to 8 times the output)
MEMORY_MARGIN = 0.2  # on top of the estimate: the allocator's rounding and caching, graphs, the runtime
CPU_NOTE = ("no GPU: the rewritten path runs the fused ops' CPU references; errors of 0 show the rewrite's graph "
            "equals the reference, not the kernels")


@dataclass
class Step:
    step: int
    logits_err: float
    hidden_err: float
    state_err: float | None  # the first KDA layer's recurrent state; None without a KDA layer
    fp32_logits_err: float | None  # the bf16 reference against the fp32 one
    rw_fp32_logits_err: float | None  # the rewritten path against the fp32 reference
    tokens_agree: bool
    router_margin: float | None  # the bf16 reference's least top-k selection gap; None without an MoE layer


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
            t = torch.randn(shape, generator=g, device=device).mul_(scale).add_(shift)  # one fp32 temporary
            return nn.Parameter(t.to(dtype), requires_grad=False)

        self.embed = param(vocab, hidden, scale=1.0)
        self.out_norm, self.out_proj = param(hidden, scale=0.1, shift=1.0), param(hidden, scale=hidden ** -0.5)
        self.final_norm, self.lm_head = param(hidden, scale=0.1, shift=1.0), param(vocab, hidden, scale=hidden ** -0.5)

    def to_fp32(self) -> DecodeModel:
        """A copy in fp32, MXFP4 experts dequantized into dense fp32 ones (exact: every E2M1 value
        times its power of two is an fp32 number; a full-size layer's experts then take about
        7 GB at TP 16). Built in place of a deep copy of the bf16 model, and the experts
        dequantized ``DEQUANT_CHUNK`` at a time, so the peak is the two models and one chunk's
        temporaries (``memory_estimate``)."""
        import copy

        from rewriter.model.layers import build_layer

        memo: dict[int, Any] = {}  # what the deep copy takes as it is: the dense layers, the weights made fp32
        for layer in self.layers:
            routed = getattr(getattr(layer, "block_sparse_moe", None), "experts", None)
            routed = getattr(routed, "routed_experts", None)
            if routed is not None and routed.format.quantized:
                dense = build_layer(self.cfg, layer.layer_idx, dtype=torch.float32,
                                    device=self.embed.device, experts="bf16")
                params = dict(layer.named_parameters())
                for name, p in dense.named_parameters():
                    if ".routed_experts." in name:
                        proj = name.rsplit(".", 1)[1].removesuffix("_weight")
                        weight, scale = getattr(routed, f"{proj}_weight"), getattr(routed, f"{proj}_scale")
                        for lo in range(0, p.shape[0], DEQUANT_CHUNK):
                            hi = lo + DEQUANT_CHUNK
                            p.data[lo:hi] = routed.format.dequant(weight[lo:hi], scale[lo:hi], torch.float32)
                    else:
                        p.data.copy_(params[name].data)
                memo[id(layer)] = dense
        replaced = {id(p) for layer in self.layers if id(layer) in memo for p in layer.parameters()}
        for p in self.parameters():
            if p.dtype == torch.bfloat16 and id(p) not in replaced:
                memo[id(p)] = nn.Parameter(p.data.float(), requires_grad=False)
        return copy.deepcopy(self, memo)

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
            for name in STATE:
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

    def named(self, layer_ids: list[int]) -> dict[str, Tensor]:
        """The state tensors by name (``layer 3 kv_cache``)."""
        return {f"layer {i} {name}": t for i, inputs in zip(layer_ids, self.step_inputs) for name, t in inputs.items()
                if name in STATE}

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
    come from ``cfg.one_rank_of``) through the paths; per-step errors, and the first step at
    which each path's hidden state, logits or decode state held NaN or an infinity."""
    from rewriter.compiler.rewrite import is_fused
    from rewriter.model.layers.moe import recorded_topk_margins
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
    bad: dict[str, tuple[str, int]] = {}  # "<path> <tensor>" -> (NaN or infinity, the first step it held one)
    fp32_ok = "fp32" in paths
    for n in range(1, steps + 1):
        for s in states.values():
            s.advance()
        out, margin = {}, None
        for name, fn in fns.items():
            if name == "fp32" and not fp32_ok:
                continue
            try:
                with recorded_topk_margins() if name == "reference" else contextlib.nullcontext() as margins:
                    out[name] = fn(tokens[name])
            except RuntimeError as e:  # a layer the fp32 twin cannot run: reported, the run goes on
                if name != "fp32":
                    raise
                fp32_ok = False
                notes.append(f"fp32 reference not run: {str(e).splitlines()[0][:120]}")
                continue
            if name == "reference" and margins:
                margin = float(torch.stack([m.min() for m in margins]).min())
            found = nonfinite({"hidden": out[name][0], "logits": out[name][1], **states[name].named(layer_ids)})
            for tensor, kind in found.items():
                bad.setdefault(f"{name} {tensor}", (kind, n))
        (h_ref, l_ref), (h_rw, l_rw) = out["reference"], out["rewritten"]
        ref_state, rw_state = states["reference"].kda_state(), states["rewritten"].kda_state()
        agree = bool(torch.equal(l_ref.argmax(-1), l_rw.argmax(-1)))
        if not agree and disagree is None:
            disagree = n
        rows.append(Step(n, rel(l_rw, l_ref), rel(h_rw, h_ref), None if ref_state is None else rel(rw_state, ref_state),
                         rel(l_ref, out["fp32"][1]) if "fp32" in out else None,
                         rel(l_rw, out["fp32"][1]) if "fp32" in out else None, agree, margin))
        nxt = l_ref.argmax(-1)
        for name in paths:
            tokens[name].copy_(nxt)
        for s in states.values():
            s.position += 1
        if n % 100 == 0 or n == steps:
            progress(f"step {n}/{steps}: logits error {rows[-1].logits_err:.2e} ({time.perf_counter() - t0:.0f} s)")
    fused = sum(1 for r in paths["rewritten"][1] for n in r.module.graph.nodes if is_fused(n))
    nonfinite_reasons = [f"{name}: {kind} (first at step {n})" for name, (kind, n) in bad.items()]
    return {"model": cfg.name, "batch": batch, "steps": steps, "experts": experts, "kv_cache_dtype": kv_cache_dtype,
            "layers": layer_ids, "device": device, "fused_ops": fused,
            "fused_ops_run": "kernels" if cuda else "cpu references", "first_disagreement": disagree, "notes": notes,
            "gate": gate([r.logits_err for r in rows], [r.fp32_logits_err for r in rows],
                         [r.rw_fp32_logits_err for r in rows], nonfinite_tensors=nonfinite_reasons),
            "rows": [asdict(r) for r in rows]}


def nonfinite(tensors: dict[str, Tensor]) -> dict[str, str]:
    """The tensors that hold NaN or an infinity: name -> ``NaN`` (where it holds both) or
    ``infinity``; one host sync for all of them. NaN compares false, so ``err > limit`` alone
    would pass it."""
    def values(t: Tensor) -> Tensor:  # vLLM keeps an fp8 cache as uint8 bytes
        return t.view(torch.float8_e4m3fn).float() if t.dtype == torch.uint8 else t

    flags = torch.stack([torch.stack((t.isnan().any(), t.isinf().any())) for t in map(values, tensors.values())])
    return {name: "NaN" if nan else "infinity" for name, (nan, inf) in zip(tensors, flags.tolist()) if nan or inf}


def gate(errors: list[float], bf16_errors: list[float | None] | None = None,
         rewritten_fp32_errors: list[float | None] | None = None, *, nonfinite_tensors: list[str] = ()
         ) -> dict[str, Any]:
    """Whether the logits error stays at bf16 level over the run, by the rule in the module doc:
    ``errors`` rewritten against the bf16 reference, step by step; ``bf16_errors`` that
    reference against fp32 and ``rewritten_fp32_errors`` the rewritten path against fp32, at
    the same steps (None where not measured); ``nonfinite_tensors`` the tensors that held NaN or
    an infinity, each a failure. ``verdict``: passed, failed, or too short (under ``MIN_STEPS``)."""
    reasons = list(nonfinite_tensors)
    series = {"logits error": errors, "bf16 reference's error against fp32": bf16_errors or [],
              "rewritten path's error against fp32": rewritten_fp32_errors or []}
    for name, values in series.items():
        odd = [n for n, v in enumerate(values, 1) if v is not None and not math.isfinite(v)]
        if odd and not nonfinite_tensors:  # where a tensor was named, its error's NaN says nothing more
            reasons.append(f"the {name} is not finite at {len(odd)} of {len(values)} steps (first at step {odd[0]})")
    result = {"verdict": "failed" if reasons else "too short", "passed": False, "reasons": reasons,
              "min_steps": MIN_STEPS}
    if reasons or len(errors) < MIN_STEPS:
        return result

    def settled(values: list[float | None]) -> float | None:  # the median over the second half, where measured
        kept = [v for v in values[len(errors) // 2:] if v is not None]
        return statistics.median(kept) if kept else None

    early, late = statistics.median(errors[:WINDOW]), statistics.median(errors[-WINDOW:])
    rewritten, bf16, rw_fp32 = (settled(values) for values in series.values())
    level = max(FLOOR, BF16_FACTOR * bf16) if bf16 is not None else FLOOR  # what bf16 rounding alone allows
    own = f" ({BF16_FACTOR}x bf16's own {bf16:.2e} against fp32)" if bf16 is not None else ""
    if late > GROWTH * early and late > level:
        reasons.append(f"the error grows: median {late:.2e} over the last {WINDOW} steps against {early:.2e} over the "
                       f"first {WINDOW} (bf16 level {level:.2e})")
    ceiling = max(CEILING, level)
    if late > ceiling:
        reasons.append(f"the median error over the last {WINDOW} steps is {late:.2e} (ceiling {ceiling:.2e})")
    if rewritten > level:
        reasons.append(f"the median error over the second half is {rewritten:.2e}, above bf16 level {level:.2e}{own}")
    if rw_fp32 is not None and bf16 is not None and rw_fp32 > level:
        reasons.append(f"the rewritten path is {rw_fp32:.2e} from fp32 over the second half (median), more than "
                       f"{BF16_FACTOR}x the bf16 reference's {bf16:.2e} over the same steps")
    return {**result, "verdict": "failed" if reasons else "passed", "passed": not reasons, "early": early,
            "late": late, "settled": rewritten, "worst": max(errors), "bf16_settled": bf16,
            "rewritten_fp32_settled": rw_fp32, "level": level}


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float written as a string (``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``): bare NaN is not JSON, and null already means "not measured"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"decode: {result['model']}, batch {result['batch']}, {result['steps']} steps, layers "
             f"{result['layers'][0]}..{result['layers'][-1]} ({result['fused_ops']} fused ops), {result['experts']} "
             f"experts, {result['kv_cache_dtype']} MLA cache, {result['device']}"]
    if result["fused_ops_run"] != "kernels":
        lines.append(CPU_NOTE)
    lines.append(f"{'step':>6} {'logits err':>11} {'hidden err':>11} {'KDA state err':>14} {'bf16 vs fp32 ref':>17} "
                 f"{'rewritten vs fp32':>18}  tokens")
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
    margins = [r["router_margin"] for r in rows if r["router_margin"] is not None]
    if margins:
        ties = sum(m < NEAR_TIE_MARGIN for m in margins)
        lines.append(f"router near-ties (the reference's top-k gap under {NEAR_TIE_MARGIN:.0e}) at {ties} of "
                     f"{len(rows)} steps")
    g = result["gate"]
    if g["verdict"] == "too short":
        lines.append(f"gate: too short to judge ({len(rows)} steps; it needs {g['min_steps']})")
    elif "settled" not in g:
        lines.append("gate: FAILED: " + "; ".join(g["reasons"]))
    else:
        lines.append("gate: " + ("passed" if g["passed"] else "FAILED: " + "; ".join(g["reasons"]))
                     + f" (median error {g['early']:.2e} over the first {WINDOW} steps, {g['late']:.2e} over the last "
                       f"{WINDOW}, {g['settled']:.2e} over the second half; worst {g['worst']:.2e}"
                     + (f"; against fp32 over the second half: bf16 reference {g['bf16_settled']:.2e}, rewritten "
                        f"{g['rewritten_fp32_settled']:.2e}" if g["bf16_settled"] is not None else "") + ")")
    return "\n".join(lines)


def memory_estimate(cfg, layer_ids: list[int], *, batch: int, steps: int, experts: str, kv_cache_dtype: str,
                    fp32: bool, cuda: bool) -> dict[str, int]:
    """Bytes a run holds at its peak, by part: the bf16 model's weights (the rewritten path
    shares them), the fp32 reference's, every path's decode state (the MLA cache for ``steps``
    tokens; on a GPU also the CUDA graph's warm-up state), all from the layers and state built
    on the meta device, so exact; and the working memory, modelled: the most that the routed
    experts' rows a reference step gathers for every token (MXFP4 ones dequantized), or one chunk
    of ``to_fp32``'s dequantization, or the LM head drawn in fp32 while only the bf16 model
    exists, adds to what the run holds then. ``needed`` adds the margin."""
    from rewriter.model.shape import DecodeShape

    head = (2 * cfg.vocab_size + 3) * cfg.hidden_size  # embedding, LM head, the final AttnRes and norm vectors
    parts = {"bf16 weights": 2 * head, "fp32 weights": 4 * head if fp32 else 0, "decode state": 0, "working": 0}
    shape = DecodeShape(batch=batch, context=steps, kv_cache_dtype=kv_cache_dtype)
    paths = [(torch.bfloat16, experts, "bf16 weights", 3 if cuda else 2)]  # reference, rewritten (+ warm-up)
    if fp32:
        paths.append((torch.float32, "bf16", "fp32 weights", 1))  # dense experts
    for i in layer_ids:
        for dtype, kind, part, states in paths:
            weights, state = layer_bytes(cfg, i, kind, dataclasses.replace(shape, dtype=dtype))
            parts[part] += weights
            parts["decode state"] += states * state
    step = 0  # what a step, or to_fp32, makes on top of the weights and state
    if any(cfg.is_moe_layer(i) for i in layer_ids):
        w13 = 2 * cfg.moe_intermediate_size * cfg.moe_hidden_size  # values of one expert's largest weight
        rows = batch * cfg.num_experts_per_token * w13
        step = max(rows * (DEQUANT_BYTES[2] if experts == "mxfp4" else 4),
                   rows * 8 if fp32 else 0,  # fp32 rows gathered, then multiplied
                   DEQUANT_CHUNK * w13 * DEQUANT_BYTES[4] if fp32 and experts == "mxfp4" else 0)
    build = 4 * cfg.vocab_size * cfg.hidden_size  # the LM head drawn in fp32, beside the bf16 model alone
    parts["working"] = max(step, build - parts["fp32 weights"] - parts["decode state"])
    return parts


@functools.lru_cache(maxsize=None)
def layer_bytes(cfg, index: int, experts: str, shape: Any) -> tuple[int, int]:
    """(weights, decode state) of layer ``index`` with ``experts`` at ``shape`` (its dtype), in
    bytes, from the layer and its inputs built on the meta device."""
    from rewriter.model.layers import build_layer
    from rewriter.model.layers.state import decode_inputs

    layer = build_layer(cfg, index, dtype=shape.dtype, device="meta", experts=experts)
    inputs = decode_inputs(layer, shape)
    return (sum(t.numel() * t.element_size() for t in layer.state_dict().values()),
            sum(t.numel() * t.element_size() for name, t in inputs.items() if name in STATE))


def needed(parts: dict[str, int]) -> int:
    """The bytes to have available for a run of ``parts``: their sum and ``MEMORY_MARGIN``."""
    return int(sum(parts.values()) * (1 + MEMORY_MARGIN))


def available_memory(device: str) -> int:
    """Bytes the run may take: the GPU's free memory, or the system's available memory."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_refusal(need: Callable[[int, bool], dict[str, int]], layers: int, fp32: bool, have: int,
                   where: str) -> str | None:
    """None when ``need(layers, fp32)``, the estimate of a run of the first ``layers`` layers with
    or without the fp32 reference, fits in the ``have`` bytes of ``where``; else one line: the
    estimate by part, what is available, and what would fit (fewer --layers, --no-fp32)."""
    parts = need(layers, fp32)
    if needed(parts) <= have:
        return None
    fits = []
    for with_fp32 in dict.fromkeys((fp32, False)):  # as asked, then without the fp32 reference
        most = max((n for n in range(1, layers + 1) if needed(need(n, with_fp32)) <= have), default=None)
        if most:
            flags = [f"--layers {most}"] * (most < layers) + ["--no-fp32"] * (with_fp32 != fp32)
            fits.append(f"{' '.join(flags)} ({gb(needed(need(most, with_fp32)))})")
    return (f"decode needs about {gb(needed(parts))} ({', '.join(f'{k} {gb(v)}' for k, v in parts.items() if v)}, "
            f"+{MEMORY_MARGIN:.0%} margin) but {gb(have)} of {where}; "
            + (f"would fit: {' or '.join(fits)}" if fits else
               f"not even --layers 1 --no-fp32 fits ({gb(needed(need(1, False)))})"))


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def add_decode_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("decode", help="decode a whole model through reference and rewritten layers; the "
                                             "numerics gate", description=__doc__[__doc__.index("The gate."):])
    d.add_argument("--model", default="tiny", help="a preset or a config.json (default tiny)")
    d.add_argument("--layers", type=int, help="decode with the first N layers only (default all)")
    d.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests (default 1 8)")
    d.add_argument("--steps", type=int, default=1000,
                   help=f"tokens decoded per request (default 1000; the gate judges {MIN_STEPS} or more)")
    d.add_argument("--tp", type=int, default=1, help="one TP rank's shard sizes, as a TP 1 model (default 1)")
    d.add_argument("--experts", default="mxfp4", choices=("mxfp4", "bf16"), help="routed experts (default mxfp4)")
    d.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16", help="MLA latent cache")
    d.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables (non-finite "
                                                       "numbers as the strings NaN, Infinity, -Infinity)")
    return d


def run_decode(args: argparse.Namespace) -> int:
    """The exit status of the module doc."""
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
    device, arch = ("cuda", None) if torch.cuda.is_available() else ("cpu", "sm_90a")
    layer_ids = list(range(args.layers or cfg.num_hidden_layers))

    def estimate(batch: int, layers: int = len(layer_ids), fp32: bool = not args.no_fp32) -> dict[str, int]:
        return memory_estimate(cfg, layer_ids[:layers], batch=batch, steps=args.steps, experts=args.experts,
                               kv_cache_dtype=args.kv_cache_dtype, fp32=fp32, cuda=device == "cuda")

    refusal = memory_refusal(functools.partial(estimate, max(args.batch)), len(layer_ids), not args.no_fp32,
                             available_memory(device),
                             "GPU memory is free" if device == "cuda" else "system memory is available")
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if device == "cuda":
        from codegen.bind import device_arch
        from rewriter.compiler.plan import install_kernels

        arch = device_arch() or "sm_90a"
        install_kernels(arch)
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = []
    with torch.no_grad():
        for batch in args.batch:
            log(f"batch {batch}: building {len(layer_ids)} layers on {device}")
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            results.append(decode(cfg, layer_ids=layer_ids, batch=batch, steps=args.steps,
                                  experts=args.experts, kv_cache_dtype=args.kv_cache_dtype, device=device, arch=arch,
                                  seed=args.seed, fp32=not args.no_fp32, progress=log))
            results[-1]["memory"] = {"estimate": needed(estimate(batch)),
                                     "peak": torch.cuda.max_memory_allocated() if device == "cuda" else None}
            if not args.json:
                print(render(results[-1]), flush=True)
    if device == "cuda":
        from codegen import bind

        ran = sorted(op for op, c in bind.stats().items() if c.get("reference", 0))
        if ran:
            log(f"fused ops that ran their reference (no kernel took them): {', '.join(ran)}")
    if args.json:
        print(json.dumps(json_safe({"model": args.model, "results": results}), indent=1, allow_nan=False))
    verdicts = {r["gate"]["verdict"] for r in results}
    return 1 if "failed" in verdicts else 3 if "too short" in verdicts else 0
