"""``Template``: how one fused op meets its compiled kernels (no CuTe import here).

A template is the cutlass-free half of a fused op's GPU implementation: which schedule
kernel and fused ops it implements, how a call's arguments (real tensors, or the meta
values of a traced graph) become the ``KernelSpec`` of each kernel it launches (its
*stages*: most templates launch one kernel, some two when a dependency across the whole
output sits between them), or a refusal that says why, and how the compiled functions are
called from torch. The CuTe DSL half (a kernel class and its fake compile arguments per
stage) lives in ``codegen/kernels/`` (each spec names its module), imported only to compile.
Each template lives in ``codegen/launchers/``, where ``codegen.templates`` finds it.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from codegen.spec import KernelSpec

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

Specs = tuple[KernelSpec, ...]


@functools.cache
def sm_count(device_index: int) -> int:
    """SMs of a GPU, asked once: launchers that size their grid by it run on every served call."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_planned_sms: ContextVar[int | None] = ContextVar("planned_sms", default=None)


@contextlib.contextmanager
def planned_for_sms(sms: int | None) -> Iterator[None]:
    """Specs made inside are for a GPU of ``sms`` SMs where their tensors are not on a GPU (a
    plan on meta tensors): a server plans for its own GPU before it has run anything, and
    ``compile --sms`` for a GPU it is not on. None: a GPU with as many SMs as any grid asks."""
    if sms is not None and sms < 1:
        raise ValueError(f"a GPU of {sms} SMs")
    token = _planned_sms.set(sms)
    try:
        yield
    finally:
        _planned_sms.reset(token)


def target_sms(t: torch.Tensor) -> int | None:
    """SMs of the GPU a kernel for ``t`` is specified for: ``t``'s own GPU, else the count being
    planned for (``planned_for_sms``), else None (no limit but the kernel's own)."""
    return sm_count(t.device.index) if t.is_cuda else _planned_sms.get()


def require_outside_capture(device: torch.device, what: str) -> None:
    """Memory kernels keep across steps (a workspace, zeroed where it must be) is made and zeroed
    outside a CUDA graph capture: inside one its zeroing would only be recorded into that graph
    (and vLLM never replays its profiling captures). ``codegen.templates.make_workspaces`` makes
    them; the vLLM plugin calls it each time vLLM binds its caches."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} on {device} is made outside a CUDA graph capture: by "
                           "codegen.templates.make_workspaces (the vLLM plugin calls it once vLLM has bound its "
                           "caches) or by one eager step")


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Template:
    kernel: str  # the schedule's kernel name (the rule's kernel)
    ops: tuple[str, ...]  # fused ops served, "k3f::name"
    make_specs: Callable[[str, str, Sequence[Any]], Specs | str]  # (op, arch, op args) -> one spec per stage | refusal
    runtime_check: Callable[[Sequence[Any]], str | None]  # what only real tensors can tell (alignment)
    launch: Callable[..., Any]  # (fns, specs, op args, out=None) -> the op's outputs; one fn per stage
    doc: str = ""
    # (stage spec, device) -> whether it made one: what that stage's kernels keep on the device from
    # one step to the next (zeroed once), before any CUDA graph capture (``templates.make_workspaces``)
    workspace: Callable[[KernelSpec, Any], bool] | None = None
    # generated from the fused op's reference (``codegen/launchers/generated.py``): serves any op
    # the compiler can lower, after the op's hand-written templates; ``ops`` is empty
    generated: bool = False


def check_tensors(named: dict[str, Any], dtype: torch.dtype) -> str | None:
    """The first tensor of ``named`` that is not ``dtype`` or not contiguous, said in words."""
    for name, t in named.items():
        if t.dtype != dtype:
            return f"{name} is {dtype_name(t.dtype)}; the template is {dtype_name(dtype)} only"
        if not t.is_contiguous():
            return f"{name} is not contiguous (strides {tuple(t.stride())})"
    return None


def aligned(named: dict[str, Any], nbytes: int = 16) -> str | None:
    """The first tensor of ``named`` whose address is not ``nbytes``-aligned (None entries skipped)."""
    for name, t in named.items():
        if t is not None and t.data_ptr() % nbytes:
            return f"{name} is not {nbytes}-byte aligned (128-bit loads)"
    return None


def shape_is(name: str, t: Any, shape: tuple[int, ...]) -> str | None:
    if tuple(t.shape) != tuple(shape):
        return f"{name} must be {list(shape)}, got {list(t.shape)}"
    return None
