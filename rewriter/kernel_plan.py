"""Which CuTe DSL kernels a rewritten layer's schedule needs, and whether it can be served.

``plan`` gives one row per scheduled kernel: a template that takes the fused op's shapes
(``pending``, with the specs to compile), a fused op with no template yet (``no_template``),
a template that refuses these shapes (``refused``, with its reason), or a region no rule fused,
which would run vLLM's stock kernels (``stock``). ``program_refusal`` says why such a layer
cannot run as a program of device kernels (the server keeps it on the stock forward); the
server's compile step, ``python -m rewriter compile`` and ``inspect --all-layers`` all read
the same plan. No CuTe DSL import: templates only.
"""
from __future__ import annotations

from typing import Any


def _op_call(lg, node_names: list[str]) -> tuple[str, tuple[Any, ...]] | None:
    """(fused op name, its arguments as meta values) of the kernel's k3f node, or None."""
    nodes = {n.name: n for n in lg.graph.nodes}
    for name in node_names:
        n = nodes.get(name)
        if n is not None and n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "k3f":
            def val(a):
                if hasattr(a, "meta"):
                    return a.meta["val"]
                if isinstance(a, (list, tuple)):
                    return type(a)(val(x) for x in a)
                return a

            return n.target._schema.name, tuple(val(a) for a in n.args)
    return None


def plan(result, arch: str, schedule=None, sms: int | None = None) -> list[dict[str, Any]]:
    """One row per scheduled kernel (of ``schedule``, built here when not given): its status
    before compiling and, for a template, its spec, for a GPU of ``sms`` SMs (a grid that must
    be resident at once is capped by them; None: one with as many as any grid asks)."""
    from codegen.template import planned_for_sms

    with planned_for_sms(sms):
        return _plan_rows(result, arch, schedule)


def _plan_rows(result, arch: str, schedule) -> list[dict[str, Any]]:
    from codegen.templates import template
    from rewriter.schedule import build_schedule

    rows = []
    for i, k in enumerate((schedule or build_schedule(result.after)).kernels):
        row: dict[str, Any] = {"index": i, "kernel": k.name, "source": k.source}
        if not k.source.startswith("fused:"):
            row["status"] = "stock"
            row["detail"] = "vLLM stock kernel (not generated)"
        else:
            call = _op_call(result.after, k.nodes)
            tpl = template(k.name.split(" #")[0])
            row["op"] = call[0] if call else None
            if tpl is None or call is None:
                row["status"] = "no_template"
                row["detail"] = "no CuTe DSL template yet"
            else:
                specs = tpl.make_specs(call[0], arch, call[1])
                if isinstance(specs, str):
                    row["status"] = "refused"
                    row["detail"] = f"refused by the {tpl.kernel} template: {specs}"
                else:
                    row["status"] = "pending"
                    row["specs"] = list(specs)
        rows.append(row)
    return rows


def program_refusal(rows: list[dict[str, Any]]) -> str | None:
    """Why a layer with this plan cannot be served as a program (every reason, "; "-joined), or
    None: every scheduled kernel must be a template's (a region left unfused, or a fused op with
    no template, would run its reference ops inside the served step)."""
    reasons = []
    missing = [r["kernel"] for r in rows if r["status"] == "no_template"]
    if missing:
        reasons.append(f"no CuTe DSL template yet for {', '.join(missing)}")
    reasons += [r["detail"] for r in rows if r["status"] == "refused"]
    stock = [r["kernel"] for r in rows if r["status"] == "stock"]
    if stock:
        reasons.append(f"no rule fuses {', '.join(stock)} (their reference ops would run in the served step)")
    return "; ".join(reasons) or None
