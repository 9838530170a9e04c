"""The CuTe DSL kernels (importing a module here imports CuTe DSL).

Each module defines ``build(spec) -> (kernel object, fake compile arguments)`` for the specs
that name it (``KernelSpec.module``, set where the template makes the spec). What a kernel's
compiled form depends on is found from its source, without importing it: the module and every
``codegen`` module it imports, directly or through another, are hashed into the disk cache key.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

KERNELS_DIR = Path(__file__).parent
CODEGEN_DIR = KERNELS_DIR.parent


def module_path(module: str) -> Path:
    return KERNELS_DIR / f"{module}.py"


def _codegen_imports(path: Path) -> frozenset[Path]:
    return _imports_of(path, path.stat().st_mtime_ns)


@functools.cache
def _imports_of(path: Path, mtime_ns: int) -> frozenset[Path]:
    """The files of the ``codegen`` modules that ``path`` imports (parsed once per version of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            if name.startswith("codegen."):
                parts = name.split(".")[1:]
                for candidate in (CODEGEN_DIR.joinpath(*parts).with_suffix(".py"),
                                  CODEGEN_DIR.joinpath(*parts, "__init__.py")):
                    if candidate.is_file():
                        found.add(candidate)
                        break
    return frozenset(found)


def source_files(module: str) -> tuple[Path, ...]:
    """The kernel module's file and every ``codegen`` file it imports, transitively, in a stable order."""
    seen, todo = set(), [module_path(module)]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += _codegen_imports(path)
    return tuple(sorted(seen))
