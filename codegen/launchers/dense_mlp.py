"""Layer 0's dense MLP (``k3f::dense_mlp``), gate_up + SiTU, down, all-reduce: two templates.

- ``dense_mlp`` (1..8 tokens; rule ``dense_mlp.small`` gives it one): the shared experts' two
  GEMV kernels with the dense MLP's sizes (``expert_up`` then ``expert_down``, one expert, weight 1;
  ``codegen/launchers/experts.py``). Kimi K3's dense intermediate per rank (2112 at TP 16,
  4224 at TP 8) is not a multiple of the shared experts' 16 lanes x 8 per row, so the down
  projection shares a row among as many lanes as divide it (8 at TP 16, 16 at TP 8) and
  splits the row's I over 3 warps (11 128-bit vectors per lane).
- ``dense_mlp_gemm`` (2..64 tokens, rule ``dense_mlp.large``; one token too where the GEMVs cannot
  hold a rank's intermediate, TP 4 and below): the tensor-core skinny GEMM
  twice (``codegen/kernels/gemm.py``; the shared experts' GEMM path,
  ``experts.one_expert_gemm_*``): gate/up with the activation in its epilogue (a CTA holds 64
  gate rows and their 64 up rows), writing the [T, I] activation, then down. The GEMV kernels
  re-read x once per channel (at 64 tokens gigabytes from L2); measured on the H200 the GEMM
  wins from 2 tokens at TP 8 and ties at TP 16, the GEMVs win at 1 (BENCHMARKS.md).

Both then, at TP > 1, ``k3::all_reduce`` the bf16 partial, as the reference.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.launchers.experts import (
    MAX_CHUNK,
    one_expert_gemm_launch,
    one_expert_gemm_specs,
    one_expert_launch,
    one_expert_runtime,
    one_expert_specs,
    shared_tiling,
)
from codegen.spec import KernelSpec
from codegen.targets import MAX_TOKENS
from codegen.template import Template

DENSE_MAX_TOKENS = 8  # the GEMV kernels' range; the rules give them 1 token (patterns.dense_mlp.DENSE_SMALL_MAX)
DENSE_GEMM_TOKENS = (2, MAX_TOKENS)  # patterns.dense_mlp.DENSE_SMALL_MAX + 1 ..; tried before the GEMV
MAX_VEC_PER_LANE = 12  # down-projection weight vectors a lane holds (fp32 once converted: 8 registers each)
MAX_K_WARPS = 4
ROW_WARPS = 2


def dense_tiling(tokens: int, hidden: int, inter: int) -> tuple[dict[str, Any], dict[str, Any]] | str:
    """(up, down) tiling, or why the sizes do not fit. Up: the shared experts' (H split over 4
    warps of 7 vectors per lane at H = 7168, one channel per CTA). Down: a row shared by the
    most lanes (of 16, 8, 4) that divide I / 8, and its I split over the fewest warps
    (``k_warps``) that leave a lane at most 12 vectors (TP 16: 8 lanes x 3 warps x 11), one
    row per lane, 2 row groups per CTA."""
    chunk = min(tokens, MAX_CHUNK)
    vec = inter // 8
    for lanes in (16, 8, 4):
        if vec % lanes or lanes < chunk:
            continue
        per = vec // lanes
        k_warps = next((k for k in range(1, MAX_K_WARPS + 1) if per % k == 0 and per // k <= MAX_VEC_PER_LANE), None)
        if k_warps is not None:
            break
    else:
        return (f"I {inter}: its {vec} vectors do not split over 4, 8 or 16 lanes x at most {MAX_K_WARPS} warps "
                f"into at most {MAX_VEC_PER_LANE} per lane")
    rows_per_cta = 32 // lanes * ROW_WARPS
    if hidden % rows_per_cta:
        return f"H {hidden} is not a multiple of {rows_per_cta} rows per CTA"
    up = shared_tiling(tokens, hidden, inter)[0]
    down = {"routed": False, "lanes_per_row": lanes, "rows_per_lane": 1, "slot_warps": 1, "row_warps": ROW_WARPS,
            "slots_per_step": 1, "chunk": chunk, "k_warps": k_warps}
    return up, down


def _dense_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    tokens = args[0].shape[0] if args[0].dim() == 2 else 0
    if tokens > DENSE_MAX_TOKENS:
        return f"{tokens} tokens: above {DENSE_MAX_TOKENS} the GEMV kernels re-read x per channel"
    return one_expert_specs(op, arch, args, dense_tiling)


def _all_reduced(y: torch.Tensor, args: Sequence[Any]) -> torch.Tensor:
    group, tp = args[5:7]
    return host().all_reduce(y, group, tp) if host().collective_runs(tp) else y


def _dense_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    return _all_reduced(one_expert_launch(fns, specs, args, out), args)


def _gemm_specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    """From 2 tokens, and at one where the GEMVs cannot take the rank's intermediate (TP 4 and
    below; the rule ``dense_mlp.large`` takes those steps, ``patterns.dense_mlp.DENSE_GEMV_MAX_INTER``)."""
    lo, hi = DENSE_GEMM_TOKENS
    x, gate_up = args[:2]
    if x.dim() == 2 and gate_up.dim() == 2 and x.shape[0] == 1 and isinstance(
            dense_tiling(1, x.shape[1], gate_up.shape[0] // 2), str):
        lo = 1
    return one_expert_gemm_specs(op, arch, args, (lo, hi))


def _gemm_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    return _all_reduced(one_expert_gemm_launch(fns, specs, args, out), args)


TEMPLATES = (
    Template("dense_mlp_gemm", ("k3f::dense_mlp",), _gemm_specs, one_expert_runtime, _gemm_launch,
             doc=f"dense MLP for {DENSE_GEMM_TOKENS[0]}..{DENSE_GEMM_TOKENS[1]} tokens: tensor-core GEMM with "
                 "the activation in its epilogue, then the down GEMM, then the all-reduce (TP > 1)"),
    Template("dense_mlp", ("k3f::dense_mlp",), _dense_specs, one_expert_runtime, _dense_launch,
             doc=f"dense MLP for 1..{DENSE_MAX_TOKENS} tokens: gate/up + SiTU, then down (the shared experts' "
                 "kernels), then the all-reduce (TP > 1)"),
)
