"""The MoE experts: ``routed_experts_grouped`` (``k3f::routed_experts``, bf16),
``routed_experts_mxfp4`` (``k3f::routed_experts_mxfp4``, the checkpoint's MXFP4 in Humming's
layout) and ``shared_experts`` (``k3f::shared_experts``), 1..64 tokens; two kernels each:
``expert_up`` (gate/up projection and activation into a bf16 scratch [T, k, I]) then
``expert_down`` (down projection and the routing-weighted fp32 sum), because the down
projection needs an expert's whole activation (``*_mxfp4`` for MXFP4 weights).
The shared experts are the same kernels with one expert, one slot and weight 1 at one token,
and from 2 tokens (``shared_experts_gemm``) the skinny tensor-core GEMM twice, as the dense
MLP: the GEMVs re-read x once per channel."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.launchers.gemm_specs import gemm_call, gemm_spec
from codegen.spec import KernelSpec
from codegen.targets import MAX_TOKENS
from codegen.template import Template, aligned, check_tensors, require_outside_capture, shape_is

EXPERTS_MAX_TOKENS = MAX_TOKENS  # decode batches; larger ones want a grouped GEMM
SHARED_GEMM_TOKENS = (2, 64)  # patterns.moe.SHARED_SMALL_MAX + 1 .. 64; tried before the GEMVs
MAX_CHUNK = 8  # tokens per chunk: fp32 accumulators per row and lane (codegen/kernels/expert_up.py, expert_down.py)
ROUTED_ROWS_LANES = 8  # lanes sharing one w2 row in the routed down projection
SHARED_ROW_LANES = 16  # lanes sharing one down_weight row in the shared down projection
MAX_LOADS = 16  # 128-bit weight loads a lane of the routed down projection keeps in flight
MAX_SLICES = 16  # warps sharing a channel along L in the up projection


def _slices(latent: int, cap: int = 7) -> int:
    """Warps sharing a channel along L (``k_slices``) in the up projection: the fewest that
    leave a lane at most ``cap`` 128-bit vectors per row (2 at L = 3584, 4 at 7168: 7 each);
    a lane loads its whole slice at once and keeps it in registers."""
    vec_per_lane = latent // 256
    return min(d for d in range(1, vec_per_lane + 1) if vec_per_lane % d == 0 and vec_per_lane // d <= cap)


def act_params(beta: Any, linear_beta: Any) -> dict[str, Any] | str:
    for name, v in (("beta", beta), ("linear_beta", linear_beta)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"{name} must be a float or None, got {v!r}"
    return {"beta": None if beta is None else float(beta),
            "linear_beta": None if beta is None or linear_beta is None else float(linear_beta)}


def _common_refusal(t: int, name: str, k_dim: int) -> str | None:
    if not 1 <= t <= EXPERTS_MAX_TOKENS:
        return f"{t} tokens outside 1..{EXPERTS_MAX_TOKENS} (the experts GEMV; larger batches need a grouped GEMM)"
    if k_dim % 256 or not k_dim:
        return f"{name} {k_dim} is not a multiple of 256 (one 128-bit vector per lane)"
    if _slices(k_dim) > MAX_SLICES:
        return (f"{name} {k_dim}: its {k_dim // 256} vectors per lane do not split into at most {MAX_SLICES} "
                "warps of <= 7")
    return None


def routed_tiling(top_k: int, latent: int, inter: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(up, down) tiling of the routed experts. Up: 4 warps per CTA, L split over
    ``_slices`` of them (2 channels per CTA, 2 warps of 7 vectors per lane and row at L =
    3584: 14 loads in flight). Down: 8 lanes per w2 row (4 rows per warp), the k slots over
    the fewest warps that leave a lane at most 16 weight loads (4 warps of 4 experts x 4
    vectors at I = 256, 8 warps of 2 x 6 at I = 384), all of them in flight at once."""
    slices = _slices(latent)
    up = {"routed": True, "channels_per_warp": 1, "warps_per_cta": slices * max(1, 4 // slices), "k_slices": slices,
          "chunk": 1}
    vec = inter // 8 // ROUTED_ROWS_LANES
    warps = [w for w in range(1, min(top_k, 32) + 1) if top_k % w == 0]
    slot_warps = next((w for w in warps if top_k // w * vec <= MAX_LOADS), warps[-1])
    per_warp = top_k // slot_warps
    step = max(s for s in range(1, per_warp + 1) if per_warp % s == 0 and s * vec <= max(MAX_LOADS, vec))
    down = {"routed": True, "lanes_per_row": ROUTED_ROWS_LANES, "rows_per_lane": 1, "slot_warps": slot_warps,
            "row_warps": 1, "slots_per_step": step, "chunk": 1}
    return up, down


def shared_row_lanes(inter: int) -> int | None:
    """Lanes sharing a row of the shared experts' down projection: 16 where 16 x 8 values divide
    I, else 8 (TP 32's 192); None where neither does."""
    return next((lanes for lanes in (SHARED_ROW_LANES, SHARED_ROW_LANES // 2) if inter % (8 * lanes) == 0), None)


def shared_tiling(tokens: int, hidden: int, inter: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(up, down) tiling of the shared experts: tokens in chunks of up to 8, each lane's
    weights loaded once (before the PDL wait) and held in registers across the chunks. Up:
    one channel per CTA, H split over ``_slices`` warps (4 warps of 7 vectors per lane and
    row at H = 7168: 384 CTAs with their whole 28 KB in flight at Is = 384); with one slice,
    as many channels (warps) per CTA as keep >= 264 CTAs. Down: 16 lanes per row (8 where
    they do not divide I: TP 32's 192), 2 rows per lane, 4 warps per CTA."""
    chunk = min(tokens, MAX_CHUNK)
    lanes = shared_row_lanes(inter)
    slices = _slices(hidden)
    warps = slices if slices > 1 else next(w for w in (4, 2, 1) if inter % w == 0 and inter // w >= 264 or w == 1)
    up = {"routed": False, "channels_per_warp": 1, "warps_per_cta": warps, "k_slices": slices, "chunk": chunk}
    down = {"routed": False, "lanes_per_row": lanes, "rows_per_lane": 2, "slot_warps": 1, "row_warps": 4,
            "slots_per_step": 1, "chunk": chunk}
    return up, down


def _routed_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    x, weights, ids, w13, w2, beta, linear_beta = args
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or weights.dim() != 2 or ids.dim() != 2:
        return (f"x [T, L], weights and ids [T, k], w13 [E, 2I, L], w2 [E, L, I] expected, got "
                f"{tuple(x.shape)}, {tuple(weights.shape)}, {tuple(ids.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, latent = x.shape
    e, two_i, _ = w13.shape
    k = ids.shape[1]
    inter = two_i // 2
    reason = (check_tensors({"x": x, "w13": w13, "w2": w2}, torch.bfloat16)
              or check_tensors({"weights": weights}, torch.float32)
              or check_tensors({"ids": ids}, torch.int64)
              or shape_is("w13", w13, (e, 2 * inter, latent)) or shape_is("w2", w2, (e, latent, inter))
              or shape_is("weights", weights, (t, k)) or shape_is("ids", ids, (t, k))
              or _common_refusal(t, "L", latent))
    if reason:
        return reason
    if not 1 <= k <= e:
        return f"top_k {k} outside 1..{e} experts"
    if inter % (8 * ROUTED_ROWS_LANES):
        return f"I {inter} is not a multiple of {8 * ROUTED_ROWS_LANES} ({ROUTED_ROWS_LANES} lanes x 8 per w2 row)"
    act = act_params(beta, linear_beta)
    if isinstance(act, str):
        return act
    up, down = routed_tiling(k, latent, inter)
    shapes = {"experts": e, "top_k": k, "inter": inter}
    dtypes = {"act": "bf16", "weight": "bf16", "routing": "fp32"}
    return (KernelSpec.make("expert_up", op, arch, shapes={**shapes, "latent": latent}, dtypes=dtypes,
                            params={**up, **act}),
            KernelSpec.make("expert_down", op, arch, shapes={**shapes, "rows": latent}, dtypes=dtypes, params=down))


def _one_expert_operands(args: Sequence[Any]) -> tuple[int, int, int, dict[str, Any]] | str:
    """(T, H, I, activation params) of one expert's ``(x, gate_up_weight, down_weight, beta,
    linear_beta, ...)`` (the shared experts, the dense MLP), or why the call is malformed."""
    x, gate_up, down_w, beta, linear_beta = args[:5]
    if x.dim() != 2 or gate_up.dim() != 2 or down_w.dim() != 2:
        return (f"x [T, H], gate_up_weight [2I, H], down_weight [H, I] expected, got {tuple(x.shape)}, "
                f"{tuple(gate_up.shape)}, {tuple(down_w.shape)}")
    (t, hidden), inter = x.shape, gate_up.shape[0] // 2
    reason = (check_tensors({"x": x, "gate_up_weight": gate_up, "down_weight": down_w}, torch.bfloat16)
              or shape_is("gate_up_weight", gate_up, (2 * inter, hidden))
              or shape_is("down_weight", down_w, (hidden, inter)))
    if reason:
        return reason
    act = act_params(beta, linear_beta)
    return act if isinstance(act, str) else (t, hidden, inter, act)


def one_expert_specs(op: str, arch: str, args: Sequence[Any], tiling) -> tuple[KernelSpec, ...] | str:
    """The two GEMV kernels' specs for one expert of weight 1; ``tiling(T, H, I)`` gives the
    (up, down) tiling or why the sizes do not fit."""
    operands = _one_expert_operands(args)
    if isinstance(operands, str):
        return operands
    t, hidden, inter, act = operands
    reason = _common_refusal(t, "H", hidden)
    if reason:
        return reason
    tiles = tiling(t, hidden, inter)
    if isinstance(tiles, str):
        return tiles
    up, down = tiles
    shapes = {"experts": 1, "top_k": 1, "inter": inter, "tokens": t}
    dtypes = {"act": "bf16", "weight": "bf16"}
    return (KernelSpec.make("expert_up", op, arch, shapes={**shapes, "latent": hidden}, dtypes=dtypes,
                            params={**up, **act}),
            KernelSpec.make("expert_down", op, arch, shapes={**shapes, "rows": hidden}, dtypes=dtypes, params=down))


def _routed_runtime(args: Sequence[Any]) -> str | None:
    x, _, _, w13, w2 = args[:5]
    return aligned({"x": x, "w13": w13, "w2": w2})


def _shared_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    def tiling(t, hidden, inter):
        if shared_row_lanes(inter) is None:
            lanes = SHARED_ROW_LANES // 2
            return f"I {inter} is not a multiple of {8 * lanes} ({lanes} lanes x 8 per row, at least)"
        return shared_tiling(t, hidden, inter)

    return one_expert_specs(op, arch, args, tiling)


def _shared_gemm_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    return one_expert_gemm_specs(op, arch, args, SHARED_GEMM_TOKENS)


def one_expert_runtime(args: Sequence[Any]) -> str | None:
    x, gate_up, down_w = args[:3]
    return aligned({"x": x, "gate_up_weight": gate_up, "down_weight": down_w})


def expert_outputs(x: torch.Tensor, rows: int, scratch: tuple[int, ...], out) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, rows], the activation scratch): ``out`` is None, y, or (y, scratch)."""
    y, act = (out, None) if isinstance(out, torch.Tensor) else (out or (None, None))
    y = y if y is not None else x.new_empty((x.shape[0], rows))
    act = act if act is not None else x.new_empty(scratch)
    return y, act


def _routed_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (up, down), x = fns, args[0]
    weights, ids, w13, w2 = args[1:5]
    y, act = expert_outputs(x, x.shape[1], (x.shape[0], ids.shape[1], w2.shape[2]), out)
    up(x, ids, w13, act)
    down(act, ids, weights, w2, y)
    return y


def one_expert_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """Gate/up + activation into the scratch, then down into y [T, H]; ``out``: as ``expert_outputs``."""
    (up, down), x = fns, args[0]
    gate_up, down_w = args[1:3]
    inter = down_w.shape[1]
    y, act = expert_outputs(x, x.shape[1], (x.shape[0], 1, inter), out)
    up(x, None, gate_up.view(1, *gate_up.shape), act)
    down(act, None, None, down_w.view(1, *down_w.shape), y)
    return y


def one_expert_gemm_specs(op: str, arch: str, args: Sequence[Any], tokens: tuple[int, int]
                          ) -> tuple[KernelSpec, ...] | str:
    """One expert of weight 1 on the skinny tensor-core GEMM for ``tokens`` (lo, hi): gate/up
    with the activation in its epilogue (``mlp_gate_up_gemm``), then down (``mlp_down_gemm``);
    or why not."""
    operands = _one_expert_operands(args)
    if isinstance(operands, str):
        return operands
    t, hidden, inter, act = operands
    lo, hi = tokens
    if not lo <= t <= hi:
        return f"{t} tokens outside {lo}..{hi} (the GEMM template)"
    up = gemm_spec("mlp_gate_up_gemm", op, arch, tokens=t, k=hidden, rows=2 * inter, rows_out=inter, k_name="H",
                   glu=True, **act)
    down = gemm_spec("mlp_down_gemm", op, arch, tokens=t, k=inter, rows=hidden, rows_out=hidden, k_name="I")
    for spec in (up, down):
        if isinstance(spec, str):
            return spec
    return up, down


def one_expert_gemm_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """Gate/up + activation into the [T, I] scratch, then down into y [T, H]; ``out``: None, y,
    or (y, scratch)."""
    (up, down), (x, gate_up, down_w) = fns, args[:3]
    y, act = expert_outputs(x, x.shape[1], (x.shape[0], down_w.shape[1]), out)
    gemm_call(up, x, gate_up, act)
    gemm_call(down, act, down_w, y)
    return y


TEMPLATES = (
    Template("routed_experts_grouped", ("k3f::routed_experts",), _routed_specs, _routed_runtime, _routed_launch,
             doc="routed experts for 1..64 tokens: gate/up + SiTU per (token, slot), then down + weighted sum"),
    Template("shared_experts_gemm", ("k3f::shared_experts",), _shared_gemm_specs, one_expert_runtime,
             one_expert_gemm_launch,
             doc=f"shared experts for {SHARED_GEMM_TOKENS[0]}..{SHARED_GEMM_TOKENS[1]} tokens: tensor-core GEMM with "
                 "SiTU in its epilogue, then the down GEMM"),
    Template("shared_experts", ("k3f::shared_experts",), _shared_specs, one_expert_runtime, one_expert_launch,
             doc="shared experts for 1..64 tokens (the rules give them 1): gate/up + SiTU, then down; tokens in "
                 "chunks of 8"),
)


# ---- routed experts on MXFP4 weights (Humming's layout) ---------------------------------------
MXFP4_LAYOUTS = {"humming": "interleaved", "humming_native": "natural"}  # layout -> nibble order
MXFP4_MAX_KB_PER_WARP = 14  # 16-byte weight loads a lane holds (codegen/kernels/expert_up_mxfp4.py)
MXFP4_DOWN_CTA_WARPS = (4, 8, 16, 32)  # warps of an expert_down_mxfp4 CTA: the fewest that keep its cluster <= 8
# the down stage's weights held in registers take 96 a thread: CTAs of more warps stage them in shared memory
MXFP4_DOWN_REGISTER_FORM_MAX_WARPS = 16
# from this many tokens both stages' weights are staged in shared memory by cp.async rather than
# held in registers (``codegen.kernels.mxfp4.weight_staging``: 7 and 8 CTAs per SM instead of 4
# and 5); None: never. On the H200 (2026-12-02, ``examples/bench_mxfp4_experts.py``) it took the
# two stages at TP 16 / 8 from 375.6 / 762.5 to 362.5 / 737.3 us at 64 tokens and from 57.5 /
# 107.7 to 56.3 / 100.2 at 8; at one token it was a wash at TP 16 and 2 us slower at TP 8.
MXFP4_SMEM_WEIGHTS_FROM: int | None = 8
# the per-expert up stage (``k3f::routed_moe_mxfp4``) streams each tile's K through this many
# cp.async stages of one scale group per warp (``ExpertUpMxfp4ByExpert``)
MXFP4_STREAM_STAGES = 4
# and, from MXFP4_DOWN_BY_EXPERT_FROM tokens, its down stage too (``ExpertDownMxfp4ByExpert``: a
# warp streams whole 64-row tiles of W2, about 12 scale groups a warp, through this many stages);
# below, the per-pair down stage. On the H200 (2026-12-02, examples/bench_mxfp4_experts.py, down
# stage per expert / per pair, 6 stages): TP 16 74.8 / 35.2 us at 16 tokens, 111.6 / 65.0 at 32,
# 141.9 / 124.4 at 64; TP 8 105.6 / 69.6, 155.5 / 125.5, 228.9 / 258.9. A pair's tile of W2 is
# too short a stream for the arrival counts' round trips until most experts have several pairs.
# Fewer stages hold more CTAs an SM (3: 24 KB, eight), which paid more than depth: router and both
# stages at 64 tokens, TP 16, 269.2 / 251.1 / 245.6 us with 6 / 4 / 3 stages; TP 8 498.5 / 479.1
# with 6 / 3.
MXFP4_DOWN_BY_EXPERT_FROM = 64
MXFP4_DOWN_STREAM_STAGES = 3
MXFP4_DOWN_GROUPS_PER_WARP = 12


def mxfp4_up_tiling(latent: int) -> dict[str, int] | str:
    """(cluster, warps per tile) of ``expert_up_mxfp4``: the longest even run of K blocks per warp
    up to 14, then the rest of L over a cluster of up to 8 CTAs, each with the fewest warps per
    tile (1, 2 or 4) that keep the cluster that small (L = 3584: 224 blocks = 8 CTAs x 2 warps x
    14; CTAs of 4 warps, four of which fit an SM: ``mxfp4.UP_WARPS_PER_SM``)."""
    kb = latent // 16
    for per_warp in range(MXFP4_MAX_KB_PER_WARP, 1, -2):
        if kb % per_warp:
            continue
        units = kb // per_warp
        for warps in (1, 2, 4):
            if units % warps == 0 and units // warps in (1, 2, 4, 8):
                return {"cluster": units // warps, "warps_per_tile": warps}
    return f"L {latent}: its {kb} K blocks do not split into even runs of at most 14 over <= 8 CTAs x 4 warps"


def kernel_live(inter_live: int) -> int:
    """The channels of each half the MXFP4 kernels compute: the live ones in whole 64-row tiles of
    Humming's layout. Past the live ones lie vLLM's zero padding (code 0, scale byte 0: the
    activation there is 0, and so is its share of the down projection), so a tile that is partly
    padding costs reads, not accuracy (TP 32: 96 live of 256, two tiles)."""
    return -(-inter_live // 64) * 64


def mxfp4_down_tiling(top_k: int, inter_live: int) -> dict[str, int] | str:
    """(cluster, warps per slot) of ``expert_down_mxfp4``: a slot's live K blocks in even runs of
    up to 14 per warp, the k slots over a cluster of at most 8 CTAs of the fewest warps that allow
    it (``MXFP4_DOWN_CTA_WARPS``; four warps, five CTAs of which fit an SM, wherever they do:
    ``mxfp4.DOWN_WARPS_PER_SM``). TP 16, I_live = 192: 4 CTAs x 4 slots x 1 warp of 12 blocks; TP 8:
    8 CTAs x 2 slots x 2 warps; TP 4, 2, 1 (a slot of 4, 8, 16 warps): 8 CTAs of 8, 16, 32 warps."""
    kb = inter_live // 16
    per_warp = next((n for n in range(MXFP4_MAX_KB_PER_WARP, 1, -2) if kb % n == 0), None)
    if per_warp is None:
        return f"I_live {inter_live}: {kb} K blocks do not split into even runs of at most 14"
    warps = kb // per_warp
    for cta_warps in MXFP4_DOWN_CTA_WARPS:
        cluster, rest = divmod(top_k * warps, cta_warps)
        if not rest and cta_warps % warps == 0 and cluster in (1, 2, 4, 8):
            return {"cluster": cluster, "warps_per_slot": warps}
    return (f"top_k {top_k} x {warps} warps per slot do not split into a cluster of 1, 2, 4 or 8 CTAs of "
            f"{', '.join(map(str, MXFP4_DOWN_CTA_WARPS))} warps")


def mxfp4_down_stream_tiling(rows: int, inter_live: int) -> dict[str, int]:
    """(warps, row tiles per warp) of the per-expert down stage: up to 4 warps a CTA, each with
    as many whole 64-row tiles as keep it near ``MXFP4_DOWN_GROUPS_PER_WARP`` scale groups (TP 16,
    I_live 192: 6 groups a tile, 2 tiles a warp, 7 CTAs an expert; TP 8: 1 tile, 14 CTAs)."""
    tiles, groups = rows // 64, inter_live // 32
    warps = next(w for w in (4, 2, 1) if tiles % w == 0)
    per_warp = next(t for t in range(max(1, MXFP4_DOWN_GROUPS_PER_WARP // groups), 0, -1) if tiles % (warps * t) == 0)
    return {"warps": warps, "tiles_per_warp": per_warp}


def _mxfp4_specs(op: str, arch: str, args: Sequence[Any], by_expert: bool = False
                 ) -> tuple[KernelSpec, ...] | str:
    """The up and down stages' specs, per (token, slot) pair, or ``by_expert``
    (``k3f::routed_moe_mxfp4``, on its router's plan) the up stage per chosen expert, and the down
    stage per pair (zeroing the plan) or from ``MXFP4_DOWN_BY_EXPERT_FROM`` tokens per chosen
    expert too."""
    x, weights, ids, w13, w13_scale, w2, w2_scale, beta, linear_beta, layout, inter_live = args
    if layout not in MXFP4_LAYOUTS:
        return (f"MXFP4 experts in the {layout!r} layout; the kernels read Humming's (vLLM's MoE backend on "
                f"sm_90 leaves it): {', '.join(MXFP4_LAYOUTS)}")
    if x.dim() != 2 or ids.dim() != 2 or weights.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return (f"x [T, L], weights and ids [T, k], w13 / w2 [E, K/16, 2N] expected, got {tuple(x.shape)}, "
                f"{tuple(weights.shape)}, {tuple(ids.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, latent = x.shape
    e, k = w13.shape[0], ids.shape[1]
    inter = w13.shape[2] // 4
    reason = (check_tensors({"x": x}, torch.bfloat16) or check_tensors({"weights": weights}, torch.float32)
              or check_tensors({"ids": ids}, torch.int64)
              or check_tensors({"w13": w13, "w2": w2}, torch.int32)  # Humming's words and scales
              or check_tensors({"w13_scale": w13_scale, "w2_scale": w2_scale}, torch.float8_e8m0fnu)
              or shape_is("w13", w13, (e, latent // 16, 4 * inter))
              or shape_is("w13_scale", w13_scale, (e, latent // 32, 2 * inter))
              or shape_is("w2", w2, (e, inter // 16, 2 * latent))
              or shape_is("w2_scale", w2_scale, (e, inter // 32, latent))
              or shape_is("weights", weights, (t, k)) or shape_is("ids", ids, (t, k)))
    if reason:
        return reason
    if not 1 <= t <= EXPERTS_MAX_TOKENS:
        return f"{t} tokens outside 1..{EXPERTS_MAX_TOKENS} (the experts GEMV; larger batches need a grouped GEMM)"
    if not 1 <= k <= e:
        return f"top_k {k} outside 1..{e} experts"
    if latent % 64 or inter % 64 or not 0 < inter_live <= inter:
        return f"L {latent}, I {inter}, I_live {inter_live}: multiples of 64 (Humming's row tiles), I_live <= I"
    inter_live = kernel_live(inter_live)  # TP 32: 96 live channels, the kernels take 128 (the rest zero)
    act = act_params(beta, linear_beta)
    if isinstance(act, str):
        return act
    up, down = mxfp4_up_tiling(latent), mxfp4_down_tiling(k, inter_live)
    for tiling in (up, down):
        if isinstance(tiling, str):
            return tiling
    shapes = {"experts": e, "top_k": k, "inter": inter, "inter_live": inter_live}
    dtypes = {"act": "bf16", "routing": "fp32"}
    order = MXFP4_LAYOUTS[layout]
    if MXFP4_SMEM_WEIGHTS_FROM is not None and t >= MXFP4_SMEM_WEIGHTS_FROM:
        up, down = {**up, "smem_weights": True}, {**down, "smem_weights": True}
    if k * down["warps_per_slot"] // down["cluster"] > MXFP4_DOWN_REGISTER_FORM_MAX_WARPS:
        down = {**down, "smem_weights": True}  # TP 1: 1024 threads leave 64 registers a thread
    if by_expert:
        # 4 warps where L's quarters are whole scale groups (L = 3584: 28 each), else 2 (L % 64 == 0)
        warps = 4 if latent % 128 == 0 else 2
        up = {"warps": warps, "stages": MXFP4_STREAM_STAGES, "by_expert_max_tokens": EXPERTS_MAX_TOKENS}
        if t >= MXFP4_DOWN_BY_EXPERT_FROM:
            down = {**mxfp4_down_stream_tiling(latent, inter_live), "stages": MXFP4_DOWN_STREAM_STAGES,
                    "by_expert_max_tokens": EXPERTS_MAX_TOKENS}
        else:
            down = {**down, "zero_plan": True}
    return (KernelSpec.make("expert_up_mxfp4", op, arch, shapes={**shapes, "latent": latent}, dtypes=dtypes,
                            params={**up, **act, "order": order}),
            KernelSpec.make("expert_down_mxfp4", op, arch, shapes={**shapes, "rows": latent}, dtypes=dtypes,
                            params={**down, "order": order}))


def _mxfp4_runtime(args: Sequence[Any]) -> str | None:
    """Alignment of x and the weights, which both MXFP4 ops take in places 0 and 3..6."""
    x, _, _, w13, w13_scale, w2, w2_scale = args[:7]
    return aligned({"x": x, "w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale})


def _mxfp4_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """Per pair: up, then down."""
    (up, down), x = fns, args[0]
    weights, ids, w13, w13_scale, w2, w2_scale = args[1:7]
    live = kernel_live(args[10])
    y, act = expert_outputs(x, x.shape[1], (x.shape[0], ids.shape[1], live), out)
    up(x.view(torch.int32), ids, w13, w13_scale.view(torch.int32), act)
    down(act.view(torch.int32), ids, weights, w2, w2_scale.view(torch.int32), y, None, None)
    return y


# ---- the router and the routed experts as one op, per chosen expert (k3f::routed_moe_mxfp4) ----
_plans: dict[tuple[str, int, int], tuple[torch.Tensor, ...]] = {}
_arrivals: dict[tuple[str, int, int], torch.Tensor] = {}


def routing_plan(device: torch.device, experts: int, cap: int) -> tuple[torch.Tensor, ...]:
    """The device's routing plan (int32: counts [E + 1], chosen [E], lists [E, cap]), zero where
    the router counts: it is made once and every step leaves it so (``RouterTopkPlan`` fills it,
    the down stage zeroes it); and the up stage's records for the down stage [E + 1]. One per
    device: the MoE layers of a program run one after another on one stream."""
    key = (str(device), experts, cap)
    if key not in _plans:
        require_outside_capture(device, f"k3f::routed_moe_mxfp4: the routing plan for {experts} experts")
        _plans[key] = (torch.zeros(experts + 1, dtype=torch.int32, device=device),
                       torch.zeros(experts, dtype=torch.int32, device=device),
                       torch.zeros((experts, cap), dtype=torch.int32, device=device),
                       torch.zeros(experts + 1, dtype=torch.int32, device=device))
    return _plans[key]


def arrival_counts(device: torch.device, cap: int, tiles: int) -> torch.Tensor:
    """The per-expert down stage's (token, row tile) arrival counters, int32 [cap, tiles], zero
    between steps (each step's last arrival puts its counter back). One per device and shape."""
    key = (str(device), cap, tiles)
    if key not in _arrivals:
        require_outside_capture(device, f"k3f::routed_moe_mxfp4: the arrival counts of {tiles} row tiles")
        _arrivals[key] = torch.zeros((cap, tiles), dtype=torch.int32, device=device)
    return _arrivals[key]


def _moe_workspace(spec: KernelSpec, device: Any) -> bool:
    """The router stage's routing plan (``routing_plan``) and the down stage's arrival counts
    (``arrival_counts``), made before the first captured step and zeroed at every call (each
    time vLLM binds its caches): whatever ran before, the captured steps start from zero."""
    p = spec.param_dict
    device = torch.device(device)
    if spec.kernel == "router_topk" and "plan_cap" in p:
        require_outside_capture(device, "k3f::routed_moe_mxfp4: the routing plan")
        for t in routing_plan(device, spec.shape_dict["experts"], p["plan_cap"]):
            t.zero_()
        return True
    if spec.kernel == "expert_down_mxfp4" and "by_expert_max_tokens" in p:
        require_outside_capture(device, "k3f::routed_moe_mxfp4: the arrival counts")
        arrival_counts(device, p["by_expert_max_tokens"], spec.shape_dict["rows"] // 64).zero_()
        return True
    return False


def _routing(tokens: int, top_k: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64), what the router's kernel leaves (on ``meta`` for
    the spec checks)."""
    return (torch.empty((tokens, top_k), dtype=torch.float32, device=device),
            torch.empty((tokens, top_k), dtype=torch.int64, device=device))


def _moe_mxfp4_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    from codegen.launchers.router_topk import router_topk_spec

    x, logits, bias, w13, w13_scale, w2, w2_scale, top_k, renormalize, scaling = args[:10]
    if x.dim() != 2 or logits.dim() != 2 or logits.shape[0] != x.shape[0]:
        return f"x [T, L] and logits [T, E] expected, got {tuple(x.shape)} and {tuple(logits.shape)}"
    if logits.shape[1] != w13.shape[0]:
        return f"logits score {logits.shape[1]} experts, the weights hold {w13.shape[0]}"
    router = router_topk_spec(op, arch, logits, bias, top_k, renormalize, scaling, plan_cap=EXPERTS_MAX_TOKENS)
    if isinstance(router, str):
        return router
    weights, ids = _routing(x.shape[0], int(top_k), "meta")
    experts = _mxfp4_specs(op, arch, (x, weights, ids, w13, w13_scale, w2, w2_scale, *args[10:]), by_expert=True)
    return experts if isinstance(experts, str) else (router, *experts)


def _moe_mxfp4_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    """The router with its plan, the up stage per chosen expert, then the down stage per pair or
    (from ``MXFP4_DOWN_BY_EXPERT_FROM`` tokens) per chosen expert, which zeroes the plan's counts.
    ``out``: as ``expert_outputs``."""
    (router, up, down), (x, logits, bias, w13, w13_scale, w2, w2_scale) = fns, args[:7]
    top_k, live = int(args[7]), kernel_live(args[13])
    t, latent = x.shape
    weights, ids = _routing(t, top_k, x.device)
    counts, chosen, lists, records = routing_plan(x.device, w13.shape[0], specs[0].param_dict["plan_cap"])
    y, act = expert_outputs(x, latent, (t, top_k, live), out)
    router(logits, bias, weights, ids, counts, chosen, lists)
    up(x.view(torch.int32), counts, chosen, lists, records, w13, w13_scale.view(torch.int32), act)
    cap = specs[2].param_dict.get("by_expert_max_tokens")
    if cap is None:  # the per-pair down stage, which zeroes the plan's counts
        down(act.view(torch.int32), ids, weights, w2, w2_scale.view(torch.int32), y, counts, chosen)
        return y
    rows = torch.empty((t, top_k, latent), dtype=torch.float32, device=x.device)  # each pair's weighted rows
    down(act.view(torch.int32), counts, chosen, lists, records, weights, w2, w2_scale.view(torch.int32), rows,
         arrival_counts(x.device, cap, latent // 64), y)
    return y


TEMPLATES = (*TEMPLATES, Template(
    "routed_experts_mxfp4", ("k3f::routed_experts_mxfp4",), _mxfp4_specs, _mxfp4_runtime, _mxfp4_launch,
    doc="routed experts on MXFP4 weights in Humming's layout, 1..64 tokens: dequantized in registers, "
        "m16n8k16 MMAs; gate/up + SiTU, then down + weighted sum, per (token, slot) pair; the padding never read"),
    Template("routed_moe_mxfp4", ("k3f::routed_moe_mxfp4",), _moe_mxfp4_specs, _mxfp4_runtime, _moe_mxfp4_launch,
             doc="the router's top-k filing the pairs by expert, then the MXFP4 up stage per chosen expert (each "
                 "selected expert's w13 read and dequantized once, its K streamed through cp.async stages, its "
                 "pairs as the MMA's columns) and the down stage per pair or, from 64 tokens, per chosen expert",
             workspace=_moe_workspace))
