"""The seam between compiled kernels and the fused ops: CUDA implementations via torch.library.

``register_cuda_impl("attn_res_norm", launcher)`` makes ``launcher`` the CUDA implementation
of ``k3f::attn_res_norm`` (``torch.library.register_kernel(op, "cuda", ...)``). The CPU
implementation stays the op's reference, so a rewritten graph runs the kernel on a GPU
and the reference everywhere else. A launcher takes the op's arguments and returns its
outputs, or ``NotImplemented`` to decline a call (a shape no template takes, a tensor not
16-byte aligned, an unknown GPU): the op's reference then runs on the GPU tensors, and the
reason is counted in ``stats()`` (a strict launcher, the server's, raises instead). Nothing
registers at import: ``install_cuda_kernels()`` (or ``register_cuda_impl``) must be called,
and it refuses on a machine without CUDA unless told otherwise.

Calls compile on first use (or read the disk cache: ``python -m rewriter compile`` fills it
ahead). A kernel's first call loads its CUDA library (CuTe DSL's TVM-FFI functions do it
lazily, ``cuLibraryLoadData``): the server runs its programs only inside vLLM's CUDA graph
captures, where that is an unsafe call for a global-mode capture, so a launcher makes each
kernel's first call under capture in relaxed capture mode (``relaxed_capture_mode``: the CUDA
documentation's pattern for a library call that must allocate while a capture is under way).
``prepare`` compiles and loads a call's kernels ahead.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from codegen.targets import arch_of
from codegen.template import Specs, Template
from codegen.templates import spec_for_call, template

NAMESPACE = "k3f"
_lock = threading.Lock()
_launchers: dict[str, Callable[..., Any]] = {}  # qualified op name -> launcher
_registered: set[str] = set()  # ops whose torch.library CUDA kernel is our dispatcher
_stats: dict[str, Counter] = defaultdict(Counter)


def _qualify(op_name: str) -> str:
    return op_name if "::" in op_name else f"{NAMESPACE}::{op_name}"


def _opdef(qualname: str):
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(qualname)
    if opdef is None:
        raise KeyError(f"{qualname} is not a defined custom op (import patterns, which defines the k3f ops)")
    return opdef


def reference(op_name: str) -> Callable[..., Any]:
    """The op's reference implementation (the Python function it was defined from)."""
    return _opdef(_qualify(op_name))._init_fn


def _dispatcher(qualname: str) -> Callable[..., Any]:
    ref = reference(qualname)

    def cuda_impl(*args, **kwargs):
        launcher = _launchers.get(qualname)
        result = NotImplemented if launcher is None else launcher(*args, **kwargs)
        if result is NotImplemented:
            _stats[qualname]["reference"] += 1
            return ref(*args, **kwargs)
        _stats[qualname]["kernel"] += 1
        return result

    cuda_impl.__name__ = f"cuda_impl_{qualname.replace('::', '_')}"
    return cuda_impl


def register_cuda_impl(op_name: str, launcher: Callable[..., Any], *, allow_without_cuda: bool = False) -> None:
    """Make ``launcher`` the CUDA implementation of ``k3f::<op_name>``.

    Registering again replaces the launcher (the torch.library registration is made once
    per op). Refuses when CUDA is not available, unless ``allow_without_cuda`` (tests).
    """
    if not (allow_without_cuda or torch.cuda.is_available()):
        raise RuntimeError(f"not registering a CUDA kernel for {_qualify(op_name)}: CUDA is not available")
    qualname = _qualify(op_name)
    with _lock:
        if qualname not in _registered:
            torch.library.register_kernel(qualname, "cuda", _dispatcher(qualname))
            _registered.add(qualname)
        _launchers[qualname] = launcher


def unregister_cuda_impl(op_name: str) -> None:
    """Drop the launcher: CUDA calls run the reference again."""
    with _lock:
        _launchers.pop(_qualify(op_name), None)


def registered() -> dict[str, Callable[..., Any]]:
    return dict(_launchers)


def stats() -> dict[str, dict[str, int]]:
    """Per op: calls that ran a kernel, calls that ran the reference, and each refusal reason."""
    return {op: dict(c) for op, c in _stats.items()}


def device_arch(device: torch.device | int | None = None) -> str | None:
    """The CuTe DSL architecture of a CUDA device (sm_90a, sm_100a, sm_103a), or None."""
    return arch_of(torch.cuda.get_device_capability(device))


def load_kernels(op: str, arch: str, args: Sequence[Any], kernel: str | None = None
                 ) -> tuple[Template, Specs, tuple[Callable[..., Any], ...]] | str:
    """The template serving this call of ``op`` (or the one named ``kernel``), its specs and its
    compiled, loaded kernels (memory, disk cache or compiled now); else why not. Loading needs
    no GPU."""
    from codegen.compiler import compile_kernel

    if kernel is None:
        tpl, specs = spec_for_call(op, arch, args)
        if tpl is None:
            return specs
    else:
        tpl = template(kernel)
        if tpl is None:
            return f"no CuTe DSL template named {kernel!r}"
        specs = tpl.make_specs(_qualify(op), arch, args)
        if isinstance(specs, str):
            return specs
    return tpl, specs, tuple(compile_kernel(s).load() for s in specs)


@contextlib.contextmanager
def relaxed_capture_mode() -> Iterator[None]:
    """This thread in relaxed stream-capture mode for the block (then back to its mode before):
    inside a capture it may make calls a global-mode capture forbids, here a kernel library's
    lazy load."""
    from cuda.bindings import driver

    def exchange(mode):
        status, previous = driver.cuThreadExchangeStreamCaptureMode(mode)
        if status != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed: {status}")
        return previous

    previous = exchange(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        exchange(previous)


class KernelDeclined(RuntimeError):
    """A strict launcher's template refused a call: in a served step the reference must not run."""


class TemplateLauncher:
    """The launcher of every template serving one fused op: picks the template that accepts
    the call, gets its compiled kernel (memory, disk cache or compile) and launches it.
    ``strict`` (the server's): a call no template takes raises ``KernelDeclined`` naming why,
    instead of running the op's reference on the GPU (correct, but silently far slower)."""

    def __init__(self, op_name: str, arch: str | None = None, strict: bool = False):
        self.op = _qualify(op_name)
        self.arch = arch
        self.strict = strict
        self._fns: dict[Specs, tuple[Callable[..., Any], ...]] = {}
        self._launched: set[Specs] = set()  # kernels called at least once: their libraries are loaded

    def _decline(self, reason: str):
        _stats[self.op][f"declined: {reason}"] += 1
        if self.strict:
            raise KernelDeclined(f"{self.op}: no kernel takes this call ({reason}); the served path does not run "
                                 "the reference")
        return NotImplemented

    def resolve(self, args: Sequence[Any]) -> tuple[Template, Specs, tuple[Callable[..., Any], ...]] | str:
        arch = self.arch or device_arch(args[0].device)
        if arch is None:
            return f"GPU capability {torch.cuda.get_device_capability(args[0].device)} has no CuTe DSL target here"
        tpl, specs = spec_for_call(self.op, arch, args)
        if tpl is None:
            return specs
        fns = self._fns.get(specs)
        if fns is None:
            from codegen.compiler import compile_kernel

            fns = self._fns[specs] = tuple(compile_kernel(s).load() for s in specs)
        return tpl, specs, fns

    def forget(self) -> None:
        """Drop the loaded kernels (``forget_loaded``)."""
        self._fns.clear()
        self._launched.clear()

    def prepare(self, *args) -> str | None:
        """Compile and load the kernel for this call's shapes now (before graph capture); the refusal if any."""
        r = self.resolve(args)
        return r if isinstance(r, str) else None

    def __call__(self, *args, **kwargs):
        if kwargs:
            return self._decline("keyword arguments (the templates take the op's arguments by position)")
        if not all(a.is_cuda for a in args if isinstance(a, torch.Tensor)):
            return self._decline("not every tensor is on a CUDA device")
        r = self.resolve(args)
        if isinstance(r, str):
            return self._decline(r)
        tpl, specs, fns = r
        reason = tpl.runtime_check(args)
        if reason:
            return self._decline(reason)
        if specs in self._launched or not torch.cuda.is_current_stream_capturing():
            out = tpl.launch(fns, specs, args)
        else:  # the first call loads the kernels' libraries: not a captured operation
            with relaxed_capture_mode():
                out = tpl.launch(fns, specs, args)
        self._launched.add(specs)
        return out


def forget_loaded() -> None:
    """Every launcher's loaded kernels dropped: its next call resolves them again (after this
    process's kernel sources changed: ``rewriter.commands.variant``)."""
    for launcher in list(_launchers.values()):
        if isinstance(launcher, TemplateLauncher):
            launcher.forget()


def install_cuda_kernels(arch: str | None = None, *, allow_without_cuda: bool = False,
                         strict: bool = False) -> list[str]:
    """Register a ``TemplateLauncher`` for every fused op defined in this process (the built-in
    ``patterns``, imported here, and the rules files loaded before); returns the ops. An op with
    no hand-written template is served by a generated one where its reference lowers, else its
    calls decline: they run the reference on the GPU, or, ``strict``, raise."""
    from torch._library.custom_ops import OPDEFS

    from patterns import builtin_modules

    builtin_modules()
    ops = sorted(op for op in OPDEFS if op.startswith(f"{NAMESPACE}::"))
    for op in ops:
        current = _launchers.get(op)
        if isinstance(current, TemplateLauncher) and current.arch == arch and current.strict == strict:
            continue  # already installed: keep its loaded kernels (server start installs once per program)
        register_cuda_impl(op, TemplateLauncher(op, arch, strict), allow_without_cuda=allow_without_cuda)
    return ops
