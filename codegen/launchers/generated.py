"""The generated template: a fused op with no hand-written template runs on a kernel generated
from its own reference, when the compiler can lower that reference (``codegen.host``'s
``lower``: the op's reference traced at the call's shapes into a ``codegen.lowered.Program``).

Today the generated kernel is ``rowwise`` (``codegen/kernels/rowwise.py``): pointwise chains,
broadcasts and reductions over each token's row, one CTA a token. A call the lowering refuses
(an op it does not know, a shape it does not take) is refused here with that reason, so the
plan, ``inspect`` and the server name it. The templates of ``codegen.templates`` try this one
after every hand-written template of the op.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.host import host
from codegen.lowered import DTYPES, Program
from codegen.spec import KernelSpec
from codegen.targets import VEC
from codegen.template import Template, aligned

MAX_INPUTS = 8
MAX_OUTPUTS = 4
MAX_THREADS = 1024


def threads_for(width: int, vectors: int) -> int:
    """Threads a CTA takes for a row of ``width`` values at ``vectors`` 128-bit vectors a thread."""
    per_thread = -(-(width // VEC) // vectors)
    return min(MAX_THREADS, (per_thread + 31) // 32 * 32)


def vectors_for(width: int) -> int:
    """The fewest vectors a thread that lets one CTA hold the row (more threads, more loads in flight)."""
    return -(-(width // VEC) // MAX_THREADS)


def program_of(spec: KernelSpec) -> Program:
    return Program.from_params(spec.param_dict["program"])


def _specs(op: str, arch: str, args: Sequence[Any]) -> tuple[KernelSpec, ...] | str:
    program = host().lower(op, args)
    if isinstance(program, str):
        return program
    if program.width % VEC:
        return f"a row of {program.width} values is not whole 128-bit vectors of {VEC} (the rowwise kernel)"
    if len(program.inputs) > MAX_INPUTS or len(program.outputs) > MAX_OUTPUTS:
        return (f"{len(program.inputs)} inputs and {len(program.outputs)} outputs: the rowwise kernel takes at most "
                f"{MAX_INPUTS} and {MAX_OUTPUTS}")
    return (KernelSpec.make("rowwise", op, arch, shapes={"width": program.width},
                            params={"program": program.to_params(), "vectors": vectors_for(program.width)}),)


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _runtime(args: Sequence[Any]) -> str | None:
    for i, t in enumerate(_tensors(args)):
        if not t.is_contiguous():
            return f"tensor argument {i} is not contiguous (strides {tuple(t.stride())})"
    return aligned({f"tensor argument {i}": t for i, t in enumerate(_tensors(args)) if t.dim() > 1 or
                    t.shape[-1] > 1})


def _launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,) = fns
    program = program_of(specs[0])
    ins = _tensors(args)
    tokens = next(t.shape[0] for t, (kind, _) in zip(ins, program.inputs, strict=True) if kind == "row")
    kinds = program.kinds
    outs = [torch.empty((tokens, program.width if kinds[v] == "row" else 1), dtype=DTYPES[dtype],
                        device=ins[0].device) for v, dtype, _ in program.outputs]
    fn(*ins, *[None] * (MAX_INPUTS - len(ins)), *outs, *[None] * (MAX_OUTPUTS - len(outs)))
    results = [o.view(-1) if dims == 1 else o for o, (_, _, dims) in zip(outs, program.outputs, strict=True)]
    returns = getattr(torch.ops.k3f, specs[0].op.split("::")[-1]).default._schema.returns
    return results[0] if len(returns) == 1 and str(returns[0].type) == "Tensor" else tuple(results)


TEMPLATE = Template("generated", (), _specs, _runtime, _launch, generated=True,
                    doc="a kernel generated from the fused op's reference: pointwise chains and row reductions, "
                        "one CTA a token")
