"""The ``vllm-stock`` bench path: a layer on the kernels vLLM 0.33 runs for it on sm_90.

The peer a Hopper user has is not our reference layer but vLLM's stock decode. Its kernels
cannot all run without vllm (the GPU machine has none), so the layer is lowered onto the
closest ones that can, the reference graph retargeted node by node:

routed experts
    vLLM 0.33 on sm_90: Humming MXFP4 MoE: align, w13 GEMM, SiTU, w2 GEMM, weighted sum
    here: Humming's own w13 / SiTU / w2 kernels; the alignment (vLLM's CUDA
    ``moe_align_block_size``) in torch ops Inductor compiles, the weighted sum (vLLM's Triton
    ``moe_fused_mul_sum``) in torch ops
KDA recurrent step
    vLLM 0.33 on sm_90: vLLM's Triton packed decode kernel (TP 16) or its CUDA fused decode
    (12/24/48/96 local heads: TP 8)
    here: flash-linear-attention's Triton ``fused_recurrent_kda`` (fla-core), state read and
    written in vLLM's pages
projections
    vLLM 0.33 on sm_90: cuBLAS (or vLLM's CuTe skinny GEMM where its table has the shape)
    here: cuBLAS, through torch.compile
router gate
    vLLM 0.33 on sm_90: vLLM's CuTe bf16 GEMM with fp32 output
    here: cuBLAS bf16 GEMM with fp32 output (``aten::mm.dtype``; the reference widens the weight
    to fp32 first)
AttnRes, norms, KDA conv update, router top-k, SiTU of the shared experts
    vLLM 0.33 on sm_90: vLLM's CUDA / Triton custom ops
    here: the reference's torch ops, fused by Inductor (the conv update's batched form, traced,
    not its opaque op)
MLA decode
    vLLM 0.33 on sm_90: FA3-MLA (bf16) or FlashMLA (fp8)
    here: not run: refused by name

The lowered graph is compiled with ``torch.compile`` (Inductor's default mode, as vLLM
compiles; the Humming and fla calls are opaque custom ops) and captured in a CUDA graph by the
bench. Collectives are excluded as for every bench path.
"""
from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor, fx

from rewriter.compiler.rules import RuleSet
from rewriter.model.ops import conv_update_batched

HUMMING_LOCK_SLOTS_PER_SM = 8  # Humming's stream-K locks (as vLLM allocates them)

_configs: dict[tuple[int, int, int], Any] = {}  # (experts, n, k) -> Humming LayerConfig
_runners: dict[tuple[int, int, int, int], "HummingMoE"] = {}


class StockPathError(ValueError):
    """A layer the vllm-stock path cannot run, with the reason."""


def align_block_size(ids: Tensor, experts: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """vLLM's ``moe_align_block_size`` in torch ops (no host sync, so it captures): the flat
    (token, slot) indices sorted by expert, each expert's run padded to ``block`` with the
    invalid index ``ids.numel()``; the expert of each block; the padded total as a device
    scalar. Buffers are sized for the worst case, as vLLM sizes them; blocks past the total
    are never read (Humming's scheduler stops at the device-side total)."""
    flat = ids.flatten().long()
    m = flat.numel()
    size = m + experts * (block - 1)
    if m < experts:
        size = min(m * block, size)
    size = math.ceil(size / block) * block
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first position in ``order``
    dest = (ends - padded)[by_expert] + torch.arange(m, device=ids.device) - first[by_expert]
    sorted_ids = torch.full((size,), m, dtype=torch.int32, device=ids.device).scatter_(0, dest, order.int())
    starts = torch.arange(0, size, block, device=ids.device)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=experts - 1).int()
    return sorted_ids, expert_ids, ends[-1].int()


def humming_configs(routed: torch.nn.Module) -> dict[str, Any]:
    """Humming's LayerConfig of each projection of ``routed`` (experts in Humming's layout), from
    Humming's own transform of the checkpoint-layout tensors, once per shape; the transform must
    give back the layer's own tensors, or the two paths would not read the same weights."""
    from rewriter.model.layers.experts import humming_relayout, pack_nibbles

    fmt, out = routed.format, {}
    for proj, (n, k) in (("w13", (2 * routed.inter, routed.latent)), ("w2", (routed.latent, routed.inter))):
        key = (routed.experts, n, k)
        if key not in _configs:
            w, s = getattr(routed, f"{proj}_weight"), getattr(routed, f"{proj}_weight_scale")
            laid_w, laid_s, _configs[key] = humming_relayout(pack_nibbles(fmt.codes(w)), fmt.scale_bytes(s), n, k)
            if not (torch.equal(laid_w, w) and torch.equal(laid_s.view(torch.uint8), s.view(torch.uint8))):
                del _configs[key]
                raise StockPathError(f"Humming's transform of {proj} differs from the layer's own tensors")
        out[proj] = _configs[key]
    return out


class HummingMoE:
    """Humming's decode MoE as vLLM 0.33 calls it (``fused_humming_moe.py``: the w13 GEMM over
    (token, expert) rows sorted by expert, the SiTU pass, the w2 GEMM, the weighted sum)."""

    def __init__(self, configs: dict[str, Any], experts: int, inter: int, latent: int, beta: float,
                 linear_beta: float | None):
        from humming.config import GemmType
        from humming.tune import get_heuristics_config

        self.configs, self.experts, self.inter, self.latent = configs, experts, inter, latent
        self.tuning = {n: get_heuristics_config(layer_config=c, use_f16_accum=False, use_batch_invariant=False,
                                                gemm_type=GemmType.INDEXED) for n, c in configs.items()}
        self.compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.locks = torch.zeros(sms * HUMMING_LOCK_SLOTS_PER_SM, dtype=torch.int32, device="cuda")
        up = f"({linear_beta!r}f) * tanhf(b / ({linear_beta!r}f))" if linear_beta is not None else "b"
        self.situ = (f"[](float a, float b) {{ const float gate = ({beta!r}f) * tanhf(a / ({beta!r}f)); "
                     f"const float act = gate / (1.f + expf(-a)); const float up = {up}; "
                     "return act * up; }(a, b)")

    def block(self, name: str, m: int) -> int:
        """The M block Humming's heuristics pick for ``m`` rows (64 past the table, as vLLM)."""
        return next((c["block_shape"][0] for lo, hi, c in self.tuning[name] if lo < m <= hi), 64)

    def align(self, ids: Tensor) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """The alignment each GEMM wants (once when both pick the same block, as vLLM does)."""
        m = ids.numel()
        blocks = {n: self.block(n, m) for n in ("w13", "w2")}
        first = align_block_size(ids, self.experts, blocks["w13"])
        second = first if blocks["w2"] == blocks["w13"] else align_block_size(ids, self.experts, blocks["w2"])
        return {"w13": first, "w2": second}

    def rows(self, x: Tensor, weights: Tensor, ids: Tensor, w13: tuple[Tensor, Tensor], w2: tuple[Tensor, Tensor],
             aligned: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None) -> Tensor:
        """Humming's three kernels: each (token, expert) row's down projection [T, k, latent]."""
        from humming.forward import humming_forward, may_process_input

        t, k = ids.shape
        m = t * k
        aligned = aligned or self.align(ids)
        gate_up = torch.empty(m, 2 * self.inter, dtype=torch.bfloat16, device=x.device)
        sorted_ids, expert_ids, total = aligned["w13"]
        humming_forward(self.configs["w13"], inputs=x, weight=w13[0], weight_scale=w13[1], outputs=gate_up,
                        locks=self.locks, top_k=k, sorted_ids=sorted_ids, expert_ids=expert_ids,
                        num_tokens_padded=total, valid_shape_m=m, compute_config=self.compute,
                        tuning_config=json.dumps(self.tuning["w13"]))
        h = torch.empty(m, self.inter, dtype=torch.bfloat16, device=x.device)
        may_process_input(self.configs["w2"], inputs=gate_up, outputs=h, token_scales=None, hadamard_block_size=0,
                          layout="normal", activation_type="binary_split", activation_impl=self.situ)
        down = torch.empty(m, self.latent, dtype=torch.bfloat16, device=x.device)
        sorted_ids, expert_ids, total = aligned["w2"]
        humming_forward(self.configs["w2"], inputs=h, weight=w2[0], weight_scale=w2[1], outputs=down,
                        locks=self.locks, top_k=1, sorted_ids=sorted_ids, expert_ids=expert_ids,
                        num_tokens_padded=total, valid_shape_m=m, compute_config=self.compute,
                        tuning_config=json.dumps(self.tuning["w2"]))
        return down.view(t, k, self.latent)

    def __call__(self, x: Tensor, weights: Tensor, ids: Tensor, w13: tuple[Tensor, Tensor], w2: tuple[Tensor, Tensor],
                 aligned: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None) -> Tensor:
        """The routed output [tokens, latent]: each (token, expert) row weighted and summed."""
        down = self.rows(x, weights, ids, w13, w2, aligned)
        return weighted_sum(down, weights)


def weighted_sum(down: Tensor, weights: Tensor) -> Tensor:
    """Each token's expert rows [T, k, L] weighted and summed in fp32 (vLLM's ``moe_fused_mul_sum``)."""
    return (down.float() * weights[..., None]).sum(1).bfloat16()


# ---- the stock kernels as opaque ops the compiled graph calls --------------------------------
@torch.library.custom_op("k3stock::humming_moe", mutates_args=())
def humming_moe(x_latent: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                w2_scale: Tensor, sorted13: Tensor, experts13: Tensor, total13: Tensor, sorted2: Tensor,
                experts2: Tensor, total2: Tensor) -> Tensor:
    """Humming's three kernels over aligned rows (the runner ``lower`` made): [T, k, latent]."""
    runner = _runners[_runner_key(w13, w2)]
    return runner.rows(x_latent, weights, ids, (w13, w13_scale), (w2, w2_scale),
                       {"w13": (sorted13, experts13, total13), "w2": (sorted2, experts2, total2)})


@humming_moe.register_fake
def _(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, *aligned):
    return x_latent.new_empty((*ids.shape, x_latent.shape[-1]))


def _runner_key(w13: Tensor, w2: Tensor) -> tuple[int, int, int, int]:
    return (w13.shape[0], w13.shape[-1], w13.shape[-2], w2.shape[-1])


def humming_routed_experts(x_latent: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w13_scale: Tensor,
                           w2: Tensor, w2_scale: Tensor, experts: int, block13: int, block2: int) -> Tensor:
    """``k3f::routed_experts_mxfp4`` as vLLM's sm_90 MoE runs it: the alignment and the weighted sum
    in torch ops (traced, so Inductor compiles them), Humming between (opaque). Blocks: Humming's
    picks for this shape."""
    a13 = align_block_size(ids, experts, block13)
    a2 = a13 if block2 == block13 else align_block_size(ids, experts, block2)
    return weighted_sum(torch.ops.k3stock.humming_moe(x_latent, weights, ids, w13, w13_scale, w2, w2_scale, *a13,
                                                      *a2), weights)


@torch.library.custom_op("k3stock::gemm_fp32_out", mutates_args=())
def gemm_fp32_out(x: Tensor, weight: Tensor) -> Tensor:
    """``linear(x.float(), weight.float())`` as one bf16 GEMM with fp32 output (cuBLAS)."""
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


@gemm_fp32_out.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _widened(node: Any) -> Any:
    """The bf16 source of ``node`` if it is ``src.float()``, else None."""
    if isinstance(node, fx.Node) and node.op == "call_method" and node.target == "float":
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16:
            return src
    return None


def _fp32_out_gemms(gm: fx.GraphModule) -> None:
    """Each ``linear(x.float(), w.float())`` of bf16 ``x`` and ``w`` becomes ``gemm_fp32_out(x, w)``."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.nn.functional.linear and len(node.args) == 2:
            x, w = (_widened(a) for a in node.args)
            if x is not None and w is not None:
                node.target, node.args = torch.ops.k3stock.gemm_fp32_out.default, (x, w)
    gm.graph.eliminate_dead_code()


@torch.library.custom_op("k3stock::fla_recurrent_step", mutates_args=("state",))
def fla_recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       state_indices: Tensor) -> Tensor:
    """``k3::kda_recurrent_step`` (one token per request) on fla-core's Triton decode kernel, the
    state read and written in place through the slot indices (V-first, as vLLM keeps it)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    b, (t, h, kd) = state_indices.shape[0], q.shape
    if t != b:
        raise StockPathError(f"fla_recurrent_step: one token per request, got {t} tokens for {b} requests")
    out, _ = fused_recurrent_kda_fwd(
        q=q.contiguous().view(b, 1, h, kd), k=k.contiguous().view(b, 1, h, kd), v=v.contiguous().view(b, 1, h, -1),
        g=g.contiguous().view(b, 1, h, kd), beta=beta.contiguous().view(b, 1, h), initial_state=state, scale=1.0,
        inplace_final_state=True, state_v_first=True, ssm_state_indices=state_indices)
    return out.view(t, h, -1)


@fla_recurrent_step.register_fake
def _(q, k, v, g, beta, state, state_indices):
    return torch.empty_like(v)


def lower(layer: torch.nn.Module, shape: Any) -> fx.GraphModule:
    """``layer``'s decode step at ``shape`` with vLLM's stock sm_90 kernels in place of the
    reference's leaf ops (the table above); raises ``StockPathError`` for what it cannot run."""
    import patterns.moe  # noqa: F401  (defines k3f::routed_experts_mxfp4)
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace

    if shape.q > 1:
        raise StockPathError(f"a verify step of {shape.q} tokens per request: vLLM's sm_90 verify kernels (the "
                             "packed Triton KDA decode with accepted counts) have no runnable stand-in here yet")
    if layer.attention_kind == "mla":
        raise StockPathError(f"layer {layer.layer_idx} is an MLA layer: vLLM's MLA decode on sm_90 (FA3-MLA, "
                             "FlashMLA) cannot run without vllm on this machine, and a torch stand-in would flatter "
                             "the comparison")
    moe = getattr(layer, "block_sparse_moe", None)
    rules = RuleSet()
    if moe is not None:
        routed = moe.experts.routed_experts
        if routed.format.layout != "humming":
            raise StockPathError(f"vLLM's sm_90 MoE is Humming's MXFP4: the experts must be mxfp4/humming, "
                                 f"got {routed.format.name}")
        rules.add(next(r for r in patterns.moe.RULES if r.name == "routed_experts_mxfp4"))
        if moe.act["beta"] is None:
            raise StockPathError("the vllm-stock MoE runs SiTU experts; this layer's are SiLU")
        runner = _runners[_runner_key(routed.w13_weight, routed.w2_weight)] = HummingMoE(
            humming_configs(routed), routed.experts, routed.inter, routed.latent, moe.act["beta"],
            moe.act["linear_beta"])
        rows = shape.tokens * moe.top_k
        blocks = (routed.experts, runner.block("w13", rows), runner.block("w2", rows))
    result = rewrite(trace(layer, shape), rules)
    if moe is not None and not any(m.rule == "routed_experts_mxfp4" for m in result.matches):
        raise StockPathError(f"the routed experts of layer {layer.layer_idx} did not match: "
                             + "; ".join(r.reason for r in result.refusals))
    gm = result.after.gm
    retarget = {torch.ops.k3.kda_recurrent_step.default: torch.ops.k3stock.fla_recurrent_step.default,
                torch.ops.k3.kda_conv_update.default: conv_update_batched}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in retarget:
            node.target = retarget[node.target]
        elif node.target is torch.ops.k3f.routed_experts_mxfp4.default:
            node.target, node.args = humming_routed_experts, (*node.args[:7], *blocks)
    _fp32_out_gemms(gm)
    gm.recompile()
    return gm
