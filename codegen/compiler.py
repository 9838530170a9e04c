"""The compiler front door: ``compile_kernel(spec)`` -> a cached ``CompiledKernel``.

Tensor-free: a spec holds every compile-time value, the template builds CuTe DSL fake
tensors from it, and ``cute.compile`` builds PTX and a cubin for ``spec.arch`` on a
machine without a GPU. The result is exported as a TVM-FFI object file (called later
with torch tensors directly, on torch's current stream) and kept with its PTX in two
caches: a dict in this process, and the disk cache (``codegen.cache``) shared by every
process. The disk key is the sha256 of the template's source files, the CuTe DSL and
TVM-FFI versions, this module's recipe version and the spec's canonical text: editing a
kernel (or a codegen module it imports), upgrading CuTe DSL or changing a spec misses;
nothing else does.

A hit on disk needs no CuTe DSL import (a new process gets its kernels in milliseconds);
only compiling and loading import it.
"""
from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.metadata
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from codegen.cache import Entry, KernelCache
from codegen.kernels import CODEGEN_DIR, module_path, source_files
from codegen.spec import KernelSpec

RECIPE = 1  # bump when how a kernel is compiled or exported changes (options, export format)
CUTLASS_DIST = "nvidia-cutlass-dsl"
TVM_FFI_DIST = "apache-tvm-ffi"


class CodegenError(RuntimeError):
    """Compiling a kernel failed, or CuTe DSL is not installed; the message says which."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"cutlass_dsl": _version(CUTLASS_DIST), "tvm_ffi": _version(TVM_FFI_DIST)}


def available() -> str | None:
    """None when kernels can be compiled here, else why not (what to install)."""
    v = versions()
    missing = [d for d, k in ((CUTLASS_DIST, "cutlass_dsl"), (TVM_FFI_DIST, "tvm_ffi")) if v[k] is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install -e '.[cutedsl]')"
    return None


def _module_of(spec: KernelSpec) -> str:
    if not module_path(spec.module).is_file():
        raise CodegenError(f"{spec.label()}: no CuTe DSL kernel module codegen/kernels/{spec.module}.py")
    return f"codegen.kernels.{spec.module}"


def cache_key(spec: KernelSpec) -> str:
    """sha256 of (template source, CuTe DSL + TVM-FFI versions, recipe, spec)."""
    h = hashlib.sha256()
    _module_of(spec)
    for path in source_files(spec.module):
        h.update(path.relative_to(CODEGEN_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    v = versions()
    h.update(f"cutlass_dsl={v['cutlass_dsl']}\0tvm_ffi={v['tvm_ffi']}\0recipe={RECIPE}\0".encode())
    h.update(spec.canonical().encode())
    return h.hexdigest()


@dataclass
class CompiledKernel:
    spec: KernelSpec
    key: str
    ptx: str
    obj: bytes  # TVM-FFI object file: cutlass.cute.runtime.load_module(path, enable_tvm_ffi=True)
    function: str  # its exported symbol
    cache: str  # "miss" (compiled now), "disk" (read from the disk cache) or "memory"
    seconds: float  # wall time of this compile_kernel call
    compile_seconds: float  # how long the compile took when it was compiled
    path: str = ""  # the disk entry

    @property
    def hit(self) -> bool:
        return self.cache != "miss"

    def load(self) -> Callable[..., Any]:
        """The callable kernel (a ``tvm_ffi.Function``): takes the template's tensors (torch
        tensors work directly), launches on torch's current CUDA stream. Loading works
        without a GPU; calling needs one."""
        fn = _LOADED.get(self.key)
        if fn is None:
            fn = _LOADED[self.key] = load_object(self.obj, self.function, self.spec.arch)
        return fn


def load_object(obj: bytes, function: str, arch: str) -> Callable[..., Any]:
    """The exported ``function`` of a TVM-FFI object file (``compile_object``'s) as a callable."""
    _import_cute(arch)
    from cutlass.cute.runtime import load_module

    with tempfile.TemporaryDirectory(prefix="k3-kernel-") as d:
        path = os.path.join(d, "kernel.o")
        with open(path, "wb") as f:
            f.write(obj)
        return getattr(load_module(path, enable_tvm_ffi=True), function)


_MEMORY: dict[str, CompiledKernel] = {}
_LOADED: dict[str, Callable[..., Any]] = {}


def clear_memory_cache() -> None:
    """Forget the in-process layer (the disk cache stays): the next compile reads the disk."""
    _MEMORY.clear()


def _import_cute(arch: str):
    """Import CuTe DSL; CUTE_DSL_ARCH is read once at import, so set it first (each compile
    still names its architecture with ``--gpu-arch``)."""
    if "cutlass" not in sys.modules:
        reason = available()
        if reason:
            raise CodegenError(f"cannot compile CuTe DSL kernels: {reason}")
        os.environ.setdefault("CUTE_DSL_ARCH", arch)
    from cutlass import cute

    return cute


def compile_object(kernel: Any, args: tuple, arch: str, function: str, label: str) -> tuple[str, bytes]:
    """(PTX, TVM-FFI object file exporting ``function``) of a CuTe DSL kernel object compiled on
    its fake arguments for ``arch``; ``label`` names it in errors."""
    cute = _import_cute(arch)
    with tempfile.TemporaryDirectory(prefix="k3-compile-") as d:
        options = f"--gpu-arch {arch} --enable-tvm-ffi --keep-ptx --dump-dir {d}"
        try:
            compiled = cute.compile(kernel, *args, options=options)
        except Exception as e:
            raise CodegenError(f"{label}: CuTe DSL compile failed: {type(e).__name__}: {e}") from e
        ptx_files = glob.glob(os.path.join(d, "*.ptx"))
        if len(ptx_files) != 1:
            raise CodegenError(f"{label}: expected one PTX file from the compile, found {len(ptx_files)}")
        with open(ptx_files[0]) as f:
            ptx = f.read()
        obj_path = os.path.join(d, "kernel.o")
        compiled.export_to_c(obj_path, function_name=function)
        with open(obj_path, "rb") as f:
            return ptx, f.read()


def _compile_uncached(spec: KernelSpec, key: str) -> tuple[Entry, float]:
    t0 = time.perf_counter()
    _import_cute(spec.arch)
    module = importlib.import_module(_module_of(spec))
    try:
        kernel, args = module.build(spec)
    except ValueError as e:  # a bound the template should have refused: name it, as a compile failure
        raise CodegenError(f"{spec.label()}: the kernel refuses its spec: {e}") from e
    function = f"k3_{spec.kernel}_{key[:16]}"
    ptx, obj = compile_object(kernel, args, spec.arch, function, spec.label())
    seconds = time.perf_counter() - t0
    manifest = {"spec": spec.to_json(), "function": function, "versions": versions(), "recipe": RECIPE,
                "compile_seconds": round(seconds, 4)}
    return Entry(manifest, ptx, obj), seconds


def compile_kernel(spec: KernelSpec, *, progress: Callable[[str], None] | None = None,
                   cache: KernelCache | None = None, force: bool = False) -> CompiledKernel:
    """The compiled kernel for ``spec``: from this process, the disk cache, or compiled now
    (then written to the disk cache). ``force`` recompiles and overwrites the entry."""
    t0 = time.perf_counter()
    key = cache_key(spec)
    if not force and key in _MEMORY:
        k = _MEMORY[key]
        return CompiledKernel(k.spec, k.key, k.ptx, k.obj, k.function, "memory", time.perf_counter() - t0,
                              k.compile_seconds, k.path)
    cache = cache or KernelCache()
    entry = None if force else cache.get(key)
    how = "disk"
    if entry is None:
        with cache.lock(key):  # another process may be compiling it: wait, then look again
            entry = None if force else cache.get(key)
            if entry is None:
                if progress:
                    progress(f"compiling {spec.label()} ...")
                entry, _ = _compile_uncached(spec, key)
                cache.put(key, entry)
                how = "miss"
    k = CompiledKernel(spec, key, entry.ptx, entry.obj, entry.manifest["function"], how,
                       time.perf_counter() - t0, float(entry.manifest.get("compile_seconds", 0.0)),
                       str(cache.path(key)))
    _MEMORY[key] = k
    return k


def describe(k: CompiledKernel) -> str:
    """One line: what was compiled, how long it took, hit or miss."""
    if k.cache == "miss":
        return f"compiled  {k.spec.label()}  {k.seconds:.2f}s (cache miss)"
    return f"compiled  {k.spec.label()}  {k.seconds:.2f}s (cache hit, {k.cache}; compiled in {k.compile_seconds:.2f}s)"


def compile_schedule(specs: Iterable[KernelSpec], *, progress: Callable[[str], None] | None = print,
                     cache: KernelCache | None = None, force: bool = False) -> list[CompiledKernel]:
    """Compile ``specs`` in order, one progress line per kernel (``[i/n] compiled ...``)."""
    specs = list(specs)
    out = []
    for i, spec in enumerate(specs, 1):
        k = compile_kernel(spec, cache=cache, force=force)
        out.append(k)
        if progress:
            progress(f"[{i}/{len(specs)}] {describe(k)}")
    return out
