"""Another version of some files swapped into the tree for a while, and put back however the
block ends: how two versions of a kernel are timed against each other.

A layer's figure moves between bench runs by more than a kernel change makes (15 us
between two runs of one command on one H200: BENCHMARKS.md, method), so one run per
version decides nothing. ``examples/ab_bench.py`` alternates whole ``bench`` processes (any
file may differ). ``bench --variant DIR`` does better where only kernel sources differ: one
process captures the layer's graph on each version's kernels, on the same weights and inputs,
and alternates their replays (``kernel_sources_swapped``).

A variant directory holds files at their paths below the repository (``codegen/kernels/gemm.py``),
e.g. another revision's, written by ``ab_bench.py snapshot``.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: variants hold files at their paths below it
KERNEL_SOURCES = Path("codegen") / "kernels"
KERNEL_MODULES = "codegen.kernels."


class VariantError(ValueError):
    """A variant directory that cannot be used; the message says why."""


def variant_files(variant: Path) -> list[Path]:
    """The files of a variant directory, as paths relative to it."""
    variant = Path(variant)
    if not variant.is_dir():
        raise VariantError(f"{variant}: not a directory of replacement files")
    files = sorted(p.relative_to(variant) for p in variant.rglob("*") if p.is_file())
    if not files:
        raise VariantError(f"{variant}: holds no files")
    return files


@contextlib.contextmanager
def swapped_in(variant: Path, root: Path = ROOT) -> Iterator[list[Path]]:
    """The variant's files copied over the tree's for the duration; the tree's own back (or, for
    a file the tree did not have, removed) however the block ends."""
    files = variant_files(variant)
    saved = {f: (root / f).read_bytes() if (root / f).exists() else None for f in files}
    try:
        for f in files:
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(variant) / f, root / f)
        yield files
    finally:
        for f, content in saved.items():
            if content is None:
                (root / f).unlink(missing_ok=True)
            else:
                (root / f).write_bytes(content)


def kernel_variant_files(variant: Path) -> list[Path]:
    """The variant's files, refused unless every one is a kernel source (``codegen/kernels/*.py``):
    only those are read again within a process. Launchers, rules and the rewriter are imported
    once; a variant of those needs ``examples/ab_bench.py``'s fresh processes."""
    files = variant_files(variant)
    others = [str(f) for f in files if f.parent != KERNEL_SOURCES or f.suffix != ".py"]
    if others:
        raise VariantError(f"{variant}: {', '.join(others)} not kernel sources (codegen/kernels/*.py); one process "
                           "re-reads only those: time other files with examples/ab_bench.py")
    return files


def forget_kernel_modules() -> None:
    """Drop the imported kernel modules (``codegen.kernels.*``) and the fused ops' loaded kernels, so
    that the next compile imports the sources on disk and the next call loads what they build.
    Compiled kernels are keyed by their sources' bytes (``codegen.compiler.cache_key``), so each
    version's are compiled once and kept apart."""
    from codegen import bind

    for name in [m for m in sys.modules if m.startswith(KERNEL_MODULES)]:
        del sys.modules[name]
    bind.forget_loaded()


@contextlib.contextmanager
def kernel_sources_swapped(variant: Path, root: Path = ROOT) -> Iterator[list[Path]]:
    """The variant's kernel sources in the tree and in this process for the duration: calls of the
    fused ops inside the block compile (or find in the cache) and run the variant's kernels;
    after it, the tree's again. A CUDA graph captured inside keeps the variant's kernels."""
    kernel_variant_files(variant)
    with swapped_in(variant, root) as files:
        forget_kernel_modules()
        try:
            yield files
        finally:
            forget_kernel_modules()  # runs before swapped_in puts the files back; nothing imports in between
