"""The templates that exist, and how a fused op's call finds one (no CuTe import here).

Each module of ``codegen/launchers/`` that defines ``TEMPLATE`` (or ``TEMPLATES``, tried in
their order) contributes its templates; nothing else lists them. Every template of one fused
op lives in one module, so the order in which a call tries them is written in one place. After
an op's hand-written templates a call tries the generated ones (``Template.generated``: a kernel
made from the op's own reference, for any op the compiler can lower). A fused op that no
template serves, or a call every template refuses, runs the op's CPU reference (plain torch,
which runs on the GPU too): see ``codegen.bind``.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Sequence
from typing import Any

import codegen.launchers
from codegen.template import Specs, Template


def _discover() -> dict[str, Template]:
    templates: dict[str, Template] = {}
    home: dict[str, str] = {}  # fused op -> the module of its templates
    for info in sorted(pkgutil.iter_modules(codegen.launchers.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"codegen.launchers.{info.name}")
        found = getattr(module, "TEMPLATES", None) or ((module.TEMPLATE,) if hasattr(module, "TEMPLATE") else ())
        for t in found:
            if t.kernel in templates:
                raise ValueError(f"two templates named {t.kernel!r} (codegen/launchers/{info.name}.py)")
            for op in t.ops:
                if home.setdefault(op, info.name) != info.name:
                    raise ValueError(f"{op} has templates in codegen/launchers/{home[op]}.py and {info.name}.py: "
                                     "keep them in one module, in the order a call tries them")
            templates[t.kernel] = t
    return templates


TEMPLATES: dict[str, Template] = _discover()
GENERATED: tuple[Template, ...] = tuple(t for t in TEMPLATES.values() if t.generated)


def template(kernel: str) -> Template | None:
    """The template implementing the schedule kernel ``kernel``, or None (no template yet)."""
    return TEMPLATES.get(kernel)


def templates_for_op(op: str) -> list[Template]:
    """The hand-written templates of ``op``, in the order a call tries them (the generated ones
    come after them: ``spec_for_call``)."""
    op = op if "::" in op else f"k3f::{op}"
    return [t for t in TEMPLATES.values() if op in t.ops]


def spec_for_call(op: str, arch: str, args: Sequence[Any]) -> tuple[Template | None, Specs | str]:
    """The first template that accepts this call of ``op`` (its hand-written ones, then a
    generated one), with its specs (one per stage); else (None, the reasons)."""
    op = op if "::" in op else f"k3f::{op}"
    hand_written = templates_for_op(op)
    reasons = []
    for t in (*hand_written, *GENERATED):
        specs = t.make_specs(op, arch, args)
        if not isinstance(specs, str):
            return t, specs
        reasons.append(f"{t.kernel}: {specs}")
    if not hand_written:
        reasons.insert(0, f"no hand-written CuTe DSL template for {op}")
    return None, "; ".join(reasons)


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
