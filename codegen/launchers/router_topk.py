"""``router_topk``: sigmoid + bias top-k, renormalized and scaled weights
(``k3f::router_topk``); one kernel, one CTA per token."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.spec import KernelSpec
from codegen.template import Template, check_tensors

ROUTER_MAX_EXPERTS = 8192  # codegen/kernels/router_topk.py: at most 8 experts per thread of 1024
ROUTER_MAX_TOP_K = 32  # the weights are summed by one warp


def router_threads(experts: int) -> int:
    """Threads per CTA: up to 8 experts each, whole warps, 32..1024 (E = 896: 128)."""
    return min(1024, max(32, -(-experts // 8 // 32) * 32))


def router_topk_spec(op: str, arch: str, logits, bias, top_k, renormalize, scaling,
                     plan_cap: int | None = None) -> KernelSpec | str:
    """The ``router_topk`` kernel's spec for these operands, or why not; ``plan_cap``: the variant
    that also files the pairs by expert (``RouterTopkPlan``), for lists of up to that many pairs."""
    if logits.dim() != 2:
        return f"logits must be [tokens, experts], got {tuple(logits.shape)}"
    reason = check_tensors({"logits": logits, "bias": bias}, torch.float32)
    if reason:
        return reason
    e = logits.shape[1]
    if tuple(bias.shape) != (e,):
        return f"bias must be [{e}], got {tuple(bias.shape)}"
    if not 1 <= e <= ROUTER_MAX_EXPERTS:
        return f"{e} experts outside 1..{ROUTER_MAX_EXPERTS}"
    if not 1 <= int(top_k) <= min(ROUTER_MAX_TOP_K, e):
        return f"top_k {top_k} outside 1..{min(ROUTER_MAX_TOP_K, e)}"
    params = {"top_k": int(top_k), "renormalize": bool(renormalize), "scaling": float(scaling),
              "threads": router_threads(e)}
    return KernelSpec.make("router_topk", op, arch, shapes={"experts": e}, dtypes={"logits": "fp32", "bias": "fp32"},
                           params=params if plan_cap is None else {**params, "plan_cap": int(plan_cap)})


def _router_topk_spec(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec] | str:
    spec = router_topk_spec(op, arch, *args)
    return spec if isinstance(spec, str) else (spec,)


def _router_topk_runtime(args: Sequence[Any]) -> str | None:
    return None  # scalar fp32 loads: no alignment beyond the dtype's


def _router_topk_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,), (spec,) = fns, specs
    logits, bias = args[:2]
    k = spec.param_dict["top_k"]
    t = logits.shape[0]
    weights, ids = out if out is not None else (logits.new_empty((t, k)),
                                                torch.empty((t, k), dtype=torch.int64, device=logits.device))
    if t:
        fn(logits, bias, weights, ids)
    return weights, ids


TEMPLATE = Template("router_topk", ("k3f::router_topk",), _router_topk_spec, _router_topk_runtime,
                    _router_topk_launch,
                    doc="sigmoid + bias top-k (per-warp rounds of redux.sync + ballot, then a rank merge), "
                        "renormalized weights; one CTA per token")
