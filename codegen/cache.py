"""The on-disk kernel cache, shared by every process of a machine (compile command, tests,
server workers).

One entry per key: ``<root>/kernels/<key>.zip`` holding ``manifest.json`` (the spec, the
versions, the exported function's name, the sha256 of each payload), ``kernel.ptx`` and
``kernel.o`` (the TVM-FFI object ``cutlass.cute.runtime.load_module`` loads). Entries are
written to a temporary file in the same folder and renamed into place (atomic on POSIX),
so a reader sees a whole entry or none. Compiling an entry holds an exclusive ``flock``
on ``<key>.lock``, so two processes that miss together compile once. A reader verifies the
zip's CRCs, the manifest's key and each payload's sha256; an entry that fails is deleted
and reported as a miss, never trusted.

Root: ``$K3_REWRITER_CACHE`` if set, else ``~/.cache/k3-rewriter``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ENV_VAR = "K3_REWRITER_CACHE"
ENTRY_FORMAT = 1  # bump when the layout of an entry changes


def default_root() -> Path:
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "k3-rewriter"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_or_discard(path: Path, decode: Callable[[bytes], T], errors: tuple[type[BaseException], ...],
                    on_bad: Callable[[BaseException], None]) -> T | None:
    """``decode`` of the file at ``path``; None if it is missing, or if ``decode`` raises one of
    ``errors``: then ``on_bad`` hears why and the file is deleted (a bad entry is a miss, never
    trusted). Both caches read their entries this way."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return decode(data)
    except errors as e:
        on_bad(e)
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def write_atomic(path: Path, data: bytes) -> Path:
    """``data`` into ``path`` through a temporary file in its folder and a rename (atomic on
    POSIX): a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@dataclass
class Entry:
    """What a cache entry holds."""

    manifest: dict[str, Any]
    ptx: str
    obj: bytes
    extra: dict[str, bytes] = field(default_factory=dict)


class KernelCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.dir = self.root / "kernels"
        self.rejected: list[tuple[str, str]] = []  # (key, reason) of entries found corrupt in this process

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.zip"

    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``, or None (missing, or corrupt: then it is deleted)."""
        return read_or_discard(self.path(key), lambda data: self._decode(key, data),
                               (zipfile.BadZipFile, zlib.error, KeyError, ValueError, json.JSONDecodeError,
                                UnicodeDecodeError, OSError),
                               lambda e: self.rejected.append((key, f"{type(e).__name__}: {e}")))

    @staticmethod
    def _decode(key: str, data: bytes) -> Entry:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
            if bad is not None:
                raise ValueError(f"CRC mismatch in {bad}")
            manifest = json.loads(z.read("manifest.json"))
            if manifest.get("key") != key or manifest.get("format") != ENTRY_FORMAT:
                raise ValueError("manifest does not match the key or the entry format")
            files = manifest["files"]
            payload = {name: z.read(name) for name in files}
        for name, digest in files.items():
            if sha256(payload[name]) != digest:
                raise ValueError(f"sha256 mismatch for {name}")
        ptx = payload.pop("kernel.ptx").decode()
        obj = payload.pop("kernel.o")
        return Entry(manifest, ptx, obj, payload)

    def put(self, key: str, entry: Entry) -> Path:
        """Write ``entry`` atomically (temporary file + rename) and return its path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        files = {"kernel.ptx": entry.ptx.encode(), "kernel.o": entry.obj, **entry.extra}
        manifest = dict(entry.manifest, key=key, format=ENTRY_FORMAT,
                        files={name: sha256(blob) for name, blob in files.items()})
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
            for name, blob in files.items():
                z.writestr(name, blob)
        write_atomic(self.path(key), buf.getvalue())
        entry.manifest = manifest
        return self.path(key)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """An exclusive lock on ``key`` across processes (``flock``; released on exit or crash)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"{key}.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.zip")) if self.dir.is_dir() else []

    def clear(self) -> int:
        """Delete every entry (and lock file); returns how many entries were removed."""
        n = 0
        for p in list(self.dir.glob("*.zip")) + list(self.dir.glob("*.lock")) if self.dir.is_dir() else []:
            with contextlib.suppress(OSError):
                p.unlink()
                n += p.suffix == ".zip"
        return n
