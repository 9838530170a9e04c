"""Which CuTe DSL kernels a rewritten layer's schedule needs, and whether it can be served.

``plan`` gives one row per scheduled kernel: a template that takes the fused op's shapes
(``pending``, with the specs to compile; ``implementation`` says whether the template is
hand-written or generated from the op's reference), a fused op with neither (``missing``, with
why the lowering refused it), a hand-written template that refuses these shapes and no
generated one either (``refused``, with both reasons), or a region no rule fused, which would
run vLLM's stock kernels (``stock``). ``program_refusal`` says why such a layer
cannot run as a program of device kernels (the server keeps it on the stock forward); the
server's compile step, ``python -m rewriter compile`` and ``inspect --all-layers`` all read
the same plan. No CuTe DSL import: templates only.

The templates get the model's collectives and state layouts from the compiler, not by
importing the model: ``install_host`` hands them over (``codegen.host``); ``plan`` and
``install_kernels`` (the fused ops' CUDA implementations) call it first.
"""
from __future__ import annotations

from typing import Any

import torch


def install_host() -> None:
    """Hand codegen the model's collectives (``k3::all_reduce``, ``gather_last_dim``, looked up at
    call time), its decode state layouts, its quantized weights' values and the lowering of a
    fused op's reference (``codegen.host``)."""
    from codegen.host import Host, install
    from rewriter.compiler.lowering import lower_op
    from rewriter.model import ops
    from rewriter.model.layers.experts import ExpertFormat
    from rewriter.model.layers.state import conv_layout_of

    install(Host(all_reduce=lambda x, group, n: torch.ops.k3.all_reduce(x, group, n),
                 gather_last_dim=lambda x, group, n: ops.gather_last_dim(x, group, n),
                 collective_runs=lambda n: ops.reduces(n), conv_layout=conv_layout_of,
                 kv_cache_is_fp8=ops.cache_is_fp8, lower=lower_op,
                 dequant=lambda fmt, w, s: ExpertFormat.parse(fmt).dequant(w, s)))


def install_kernels(arch: str | None = None, *, allow_without_cuda: bool = False, strict: bool = False) -> list[str]:
    """The CuTe DSL kernels as the CUDA implementations of every fused op a template serves
    (``codegen.bind.install_cuda_kernels``), with the host handed over first."""
    from codegen.bind import install_cuda_kernels

    install_host()
    return install_cuda_kernels(arch, allow_without_cuda=allow_without_cuda, strict=strict)


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

    install_host()
    with planned_for_sms(sms):
        return _plan_rows(result, arch, schedule)


def _plan_rows(result, arch: str, schedule) -> list[dict[str, Any]]:
    from codegen.templates import GENERATED, template
    from rewriter.compiler.schedule import build_schedule

    rows = []
    for i, k in enumerate((schedule or build_schedule(result.after)).kernels):
        row: dict[str, Any] = {"index": i, "kernel": k.name, "source": k.source}
        if not k.source.startswith("fused:"):
            row.update(status="stock", implementation="stock", detail="vLLM stock kernel (not generated)")
        else:
            call = _op_call(result.after, k.nodes)
            row["op"] = call[0] if call else None
            row.update(_kernel_for(template(k.name.split(" #")[0]), GENERATED, call, arch))
        rows.append(row)
    return rows


def _kernel_for(tpl, generated, call, arch: str) -> dict[str, Any]:
    """How a fused op's call gets its kernel: the schedule's hand-written template, else a
    generated one (``codegen/launchers/generated.py``), else why neither."""
    if call is None:
        return {"status": "missing", "implementation": "missing", "detail": "the fused op's call is not in the graph"}
    refused = None
    if tpl is not None:
        specs = tpl.make_specs(call[0], arch, call[1])
        if not isinstance(specs, str):
            return {"status": "pending", "implementation": "hand-written", "specs": list(specs)}
        refused = f"refused by the {tpl.kernel} template: {specs}"
    reasons = []
    for g in generated:
        specs = g.make_specs(call[0], arch, call[1])
        if not isinstance(specs, str):
            return {"status": "pending", "implementation": "generated", "specs": list(specs)}
        reasons.append(specs)
    why = "; ".join(reasons) or "no generated template"
    if refused:
        return {"status": "refused", "implementation": "missing", "detail": f"{refused}; not generated: {why}"}
    return {"status": "missing", "implementation": "missing",
            "detail": f"no hand-written CuTe DSL template; not generated: {why}"}


SHOWN = 4  # regions left stock a refusal names (a layer no rule touched has 14 or more)


def program_refusal(rows: list[dict[str, Any]]) -> str | None:
    """Why a layer with this plan cannot be served as a program (every reason, "; "-joined), or
    None: every scheduled kernel must be a template's (a region left unfused, or a fused op with
    no template, would run its reference ops inside the served step)."""
    reasons = [f"no GPU kernel for {r['kernel']}: {r['detail']}" for r in rows if r["status"] == "missing"]
    reasons += [r["detail"] for r in rows if r["status"] == "refused"]
    stock = list(dict.fromkeys(r["kernel"].split(":")[0] for r in rows if r["status"] == "stock"))  # their regions
    if stock:
        named = ", ".join(stock[:SHOWN]) + (f" and {len(stock) - SHOWN} more" if len(stock) > SHOWN else "")
        reasons.append(f"no rule fuses {named} (their reference ops would run in the served step)")
    return "; ".join(reasons) or None
