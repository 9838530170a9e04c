"""Shared helpers: the tiny config, seeded layers and inputs, relative error, the CuTe DSL and
GPU markers, a kernel cache per test module, this GPU's kernels, a kernel's PDL launch flag,
the GPU's large tests each with the GPU to itself, the examples loaded as modules."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import rewriter.model.ops  # noqa: F401
from rewriter.compiler.plan import install_host
from rewriter.model.config import KimiK3Config
from rewriter.model.layers import build_layer
from rewriter.model.layers.state import decode_inputs
from rewriter.model.layers.weights import init_random_
from rewriter.model.shape import DecodeShape

install_host()  # the templates read the model's collectives and state layouts from it, as the compiler's plan does


HAVE_CUTEDSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))
needs_cutedsl = pytest.mark.skipif(not HAVE_CUTEDSL, reason="CuTe DSL not installed (pip install -e '.[cutedsl]')")


def _have_sass_tools() -> bool:
    from codegen.sass import find_tool

    return bool(find_tool("ptxas") and find_tool("nvdisasm"))


needs_sass_tools = pytest.mark.skipif(not _have_sass_tools(),
                                      reason="ptxas and nvdisasm not installed (pip install -e '.[sass]')")

GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    needs_cutedsl,
]


# bytes a test holds on the GPU (its layer or weights, its reference) above which it runs alone
LARGE_REFERENCE = 4 << 30
GPU_TURNS = Path(tempfile.gettempdir()) / "k3-gpu-tests.lock"  # shared by every GPU test, alone by a large one
_turn: list = []  # this worker's open lock file while one of its GPU tests runs


@pytest.fixture(autouse=True)
def gpu_turn(request) -> Iterator[None]:
    """Every GPU test holds ``GPU_TURNS`` shared while it runs, so that a large one can have the
    GPU to itself (``alone_if_large``)."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    with open(GPU_TURNS, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_SH)
        _turn.append(lock)
        try:
            yield
        finally:
            _turn.pop()
            torch.cuda.empty_cache()  # an idle worker's cached blocks would crowd the next large test
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def alone_if_large(nbytes: int) -> Iterator[None]:
    """A test that holds more than ``LARGE_REFERENCE`` runs with the GPU to itself: its shared
    hold on ``GPU_TURNS`` turns exclusive, so it waits until no other pytest-xdist worker of the
    machine is in a GPU test, and none starts one until it ends; it gives its cached blocks back
    before the others go on. Taking turns among the large tests alone was not enough: a TP 8
    layer at 64 tokens held 37 GB while the five other workers held 5 to 9 GB each, and ran out
    of memory (on an H100). Alone, a TP 3 layer (44 GB) still did beside workers
    holding 28 GB between their tests: every GPU test gives its cached blocks back as it ends."""
    if nbytes < LARGE_REFERENCE:
        yield
        return
    with contextlib.ExitStack() as own:
        lock = _turn[-1] if _turn else own.enter_context(open(GPU_TURNS, "a+b"))
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # a shared hold is given up first, then waited for
        try:
            yield
        finally:
            torch.cuda.empty_cache()
            fcntl.flock(lock.fileno(), fcntl.LOCK_SH if _turn else fcntl.LOCK_UN)


def on_gpu(test):
    """Marked ``gpu``, skipped without CUDA or CuTe DSL (only this test: the rest of a file runs anywhere)."""
    for mark in GPU_MARKS:
        test = mark(test)
    return test


@pytest.fixture(scope="session")
def tiny() -> KimiK3Config:
    return KimiK3Config.preset("tiny")


@pytest.fixture(scope="session")
def k3() -> KimiK3Config:
    return KimiK3Config.preset("kimi-k3")


def make_layer(cfg, layer_idx, *, tp=1, rank=0, dtype=torch.float32, seed=0, experts="bf16"):
    return init_random_(build_layer(cfg, layer_idx, tp=tp, rank=rank, dtype=dtype, device="cpu", experts=experts),
                        seed=seed)


def make_inputs(layer, *, batch=3, q=1, context=5, block_size=4, seed=1, dtype=None, kv_cache_dtype="bf16"):
    shape = DecodeShape(batch=batch, tp=layer.tp, rank=layer.rank, q=q, context=context, block_size=block_size,
                        dtype=dtype or layer.input_layernorm.weight.dtype, kv_cache_dtype=kv_cache_dtype)
    return decode_inputs(layer, shape, device="cpu", seed=seed)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (on the CPU: either may be a GPU tensor)."""
    a, e = actual.double().cpu(), expected.double().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def pdl_flags(spec) -> list[int]:
    """Per kernel launch of ``spec``'s host code, its programmatic stream serialization launch
    attribute (CUDA launch attribute 6): 1 where the kernel launches with PDL. Compiled again,
    as ``compile_kernel`` keeps no host IR; read from the lowered host IR, where each attribute
    is stored as (id, value)."""
    import importlib

    from cutlass import cute

    kernel, args = importlib.import_module(f"codegen.kernels.{spec.module}").build(spec)
    ir = str(cute.compile(kernel, *args, options=f"--gpu-arch {spec.arch} --enable-tvm-ffi").ir_module)
    flags = []
    for func in ir.split("llvm.func ")[1:]:
        consts = dict(re.findall(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i32\) : i32", func))
        for attr, value in re.findall(r"llvm\.store (%\d+), %\d+ : i32, !llvm\.ptr\n\s*%\d+ = llvm\.getelementptr "
                                      r"%\d+\[0, 2\][^\n]*\n\s*llvm\.store (%\d+), %\d+ : i32, !llvm\.ptr", func):
            if consts.get(attr) == "6":
                flags.append(int(consts[value]))
    return flags


@pytest.fixture(scope="module")
def kcache(tmp_path_factory):
    """A kernel disk cache of the module's own, so compile tests compile and never read a stale entry;
    the in-memory cache emptied too, or a kernel an earlier module compiled would never reach it."""
    from codegen.cache import KernelCache
    from codegen.compiler import clear_memory_cache

    clear_memory_cache()
    return KernelCache(tmp_path_factory.mktemp("kernel-cache"))


def example_module(name: str):
    """``examples/<name>.py`` loaded as a module (the examples are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cute_example(name: str):
    """(an example that imports CuTe DSL, the arch it targets): CUTE_DSL_ARCH, read once at CuTe
    DSL's first import, set first to this GPU's target (sm_90a without a GPU)."""
    arch = "sm_90a"
    if torch.cuda.is_available():
        from codegen.bind import device_arch

        arch = device_arch()
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    return example_module(name), arch


def gpu_arch() -> str:
    """This GPU's CuTe DSL target; the test is skipped on a GPU without one."""
    from codegen.bind import device_arch

    arch = device_arch()
    if arch is None:
        pytest.skip(f"no CuTe DSL target for capability {torch.cuda.get_device_capability()}")
    return arch


def spec_of(op, arch, args):
    """The spec of a one-stage template's call (the template the call picks)."""
    from codegen.templates import spec_for_call

    tpl, specs = spec_for_call(op, arch, args)
    assert tpl is not None, specs
    (spec,) = specs
    return spec


def gpu_kernels(op, args, kernel=None):
    """(template, specs, loaded kernels) serving this call on this GPU (``bind.load_kernels``);
    ``kernel`` names the template instead of the one the op's call would pick."""
    from codegen.bind import load_kernels

    r = load_kernels(op, gpu_arch(), args, kernel)
    assert not isinstance(r, str), r
    return r


def sass_or_skip(make):
    """``make()`` (something of ``codegen.sass`` that runs ptxas), or the test skipped where the
    installed ptxas is older than the PTX."""
    from codegen.sass import SassError

    try:
        return make()
    except SassError as e:
        pytest.skip(str(e))


def divergent_warp_collectives(ptx: str) -> list[str]:
    """Warp-wide ``.sync`` instructions of every lane (``shfl.sync``, ``vote.sync``, ...) that
    ``ptx`` places between a predicated forward branch and its label, where only some lanes
    may reach them: each waits for lanes that never come (a lane-0 branch that read the warp's
    index hung the rowwise kernel). A branch on a warp-uniform condition is flagged too."""
    found, open_labels = [], set()
    for line in ptx.splitlines():
        line = line.strip()
        m = re.match(r"@!?%p\d+ bra(?:\.uni)?\s+(\$\w+);", line)
        if m:
            open_labels.add(m.group(1))
        elif line.endswith(":"):
            open_labels.discard(line[:-1])
        elif open_labels and re.match(r"(shfl|vote|match|redux)\.sync|bar\.warp\.sync", line):
            found.append(line)
    return found


def ptxas_usage(ptx: str, arch: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) ptxas reports for ``ptx`` (the kernel's,
    ``codegen.sass.assemble``); the test is skipped where no ptxas reads this PTX (none
    installed, or an older one that refuses a newer PTX version)."""
    from codegen.sass import assemble

    res = sass_or_skip(lambda: assemble(ptx, arch))
    return res.registers, res.spill_bytes


def hand_written_refusal(op: str, args, arch: str = "sm_90a") -> str:
    """Why every hand-written template of ``op`` refuses this call (asserting that they all do): a
    kernel generated from the op's reference may still serve it."""
    from codegen.templates import templates_for_op

    op = op if "::" in op else f"k3f::{op}"
    reasons = []
    for t in templates_for_op(op):
        specs = t.make_specs(op, arch, args)
        assert isinstance(specs, str), f"{t.kernel} takes the call"
        reasons.append(f"{t.kernel}: {specs}")
    return "; ".join(reasons)
