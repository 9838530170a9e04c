"""The templates that exist, and how a fused op's call finds one (no CuTe import here).

Each template lives in ``codegen/launchers/<name>.py`` (see ``codegen.template``); this
module only collects them. A fused op that no template serves, or a call every template
refuses, runs the op's CPU reference (plain torch, which runs on the GPU too): see
``codegen.bind``.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any

from codegen.template import Specs, Template

LAUNCHERS = ("attn_res_norm", "in_proj_gemm", "in_proj_gemv", "router_topk", "kda_core",
             "router_down", "latent_tail", "o_proj", "experts", "dense_mlp", "mla_attend", "mla_q_front")


def _templates_of(name: str) -> tuple[Template, ...]:
    """A launcher module's ``TEMPLATE``, or its ``TEMPLATES`` when it holds several."""
    module = importlib.import_module(f"codegen.launchers.{name}")
    return getattr(module, "TEMPLATES", None) or (module.TEMPLATE,)


TEMPLATES: dict[str, Template] = {t.kernel: t for name in LAUNCHERS for t in _templates_of(name)}


def template(kernel: str) -> Template | None:
    """The template implementing the schedule kernel ``kernel``, or None (no template yet)."""
    return TEMPLATES.get(kernel)


def templates_for_op(op: str) -> list[Template]:
    op = op if "::" in op else f"k3f::{op}"
    return [t for t in TEMPLATES.values() if op in t.ops]


def spec_for_call(op: str, arch: str, args: Sequence[Any]) -> tuple[Template | None, Specs | str]:
    """The first template that accepts this call of ``op``, with its specs (one per stage);
    else (None, the reasons)."""
    reasons = []
    for t in templates_for_op(op):
        specs = t.make_specs(op if "::" in op else f"k3f::{op}", arch, args)
        if not isinstance(specs, str):
            return t, specs
        reasons.append(f"{t.kernel}: {specs}")
    return None, "; ".join(reasons) or f"no CuTe DSL template for {op} yet"


def make_workspaces(specs: Iterable[Any], device: Any) -> int:
    """Every workspace the templates of ``specs`` keep across steps, made on ``device`` now: a
    served step runs only inside a CUDA graph capture, where a workspace could be allocated but
    not zeroed. Returns how many stages have one (a hook ignores the stages that keep none)."""
    made = 0
    for spec in set(specs):
        for t in templates_for_op(spec.op):
            if t.workspace is not None and t.workspace(spec, device):
                made += 1
    return made
