"""KernelSpec: what one compiled kernel is specialized to, without any tensor.

A spec names the kernel template, the fused op it implements, the GPU architecture, the
module of ``codegen/kernels/`` that builds it (its name, unless said otherwise) and its
compile-time configuration as plain values: shapes (ints), dtypes (names such as
``"bf16"``) and parameters (ints, floats, bools, strings, tuples of those). It is frozen
and hashable (the in-memory cache key) and has one canonical text form (part of the disk
cache key), so two processes that build the same spec share one compiled kernel.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from codegen.targets import ARCHES

DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp8_e4m3")
# left out of labels: tiling, and a generated kernel's program and its plumbing (its op names the computation)
_QUIET = {"eps", "rows_per_warp", "warps_per_cta", "unroll", "stream_weights", "pipeline", "program", "stage",
          "temps", "results", "collectives", "pro_strides", "epi_strides", "parts", "sources", "dests", "strides",
          "before", "weights_at"}


# parameters only the host-side launcher reads: left out of ``canonical``, so kernels that differ
# only there share one compile (a generated kernel's weight rows: each TP rank of an op that
# slices its rank's rows from a whole weight, as the router does, runs the same kernel)
LAUNCH_ONLY = ("weights_at",)


class SpecError(ValueError):
    """A spec that cannot describe a kernel (unknown arch, a value that is not plain data)."""


def _freeze(value: Any, where: str) -> Any:
    """Lists become tuples; anything but plain data is refused (it would not hash or key stably)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, where) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise SpecError(f"{where}: {value!r} ({type(value).__name__}) is not plain data (int, float, bool, str, tuple)")


def _items(mapping: Mapping[str, Any] | None, what: str) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((str(k), _freeze(v, f"{what}[{k!r}]")) for k, v in (mapping or {}).items()))


@dataclass(frozen=True)
class KernelSpec:
    kernel: str  # the kernel's name: "attn_res_norm", "gemv", "product_gemv"
    op: str  # the fused op it implements: "k3f::attn_res_norm", "k3f::kda_in_proj"
    arch: str  # "sm_90a" | "sm_100a" | "sm_103a"
    shapes: tuple[tuple[str, int], ...] = ()
    dtypes: tuple[tuple[str, str], ...] = ()
    params: tuple[tuple[str, Any], ...] = ()
    module: str = ""  # codegen/kernels/<module>.py builds it; "" means the kernel's own name

    def __post_init__(self) -> None:
        if not self.module:
            object.__setattr__(self, "module", self.kernel)
        if not self.module.isidentifier():
            raise SpecError(f"kernel module {self.module!r} is not a module name")
        if self.arch not in ARCHES:
            raise SpecError(f"arch {self.arch!r} not supported (supported: {', '.join(ARCHES)})")
        for name, v in self.shapes:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"shape {name!r} must be an int >= 0, got {v!r}")
        for name, v in self.dtypes:
            if v not in DTYPE_NAMES:
                raise SpecError(f"dtype {name!r} must be one of {', '.join(DTYPE_NAMES)}, got {v!r}")

    @classmethod
    def make(cls, kernel: str, op: str, arch: str, *, shapes: Mapping[str, int] | None = None,
             dtypes: Mapping[str, str] | None = None, params: Mapping[str, Any] | None = None,
             module: str = "") -> KernelSpec:
        """Build a spec from dicts (sorted and frozen; lists become tuples)."""
        return cls(kernel, op, arch, _items(shapes, "shapes"), _items(dtypes, "dtypes"), _items(params, "params"),
                   module)

    @property
    def shape_dict(self) -> dict[str, int]:
        return dict(self.shapes)

    @property
    def dtype_dict(self) -> dict[str, str]:
        return dict(self.dtypes)

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def with_arch(self, arch: str) -> KernelSpec:
        return KernelSpec(self.kernel, self.op, arch, self.shapes, self.dtypes, self.params, self.module)

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "op": self.op, "arch": self.arch, "module": self.module,
                "shapes": dict(self.shapes), "dtypes": dict(self.dtypes), "params": dict(self.params)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KernelSpec:
        """The spec ``to_json`` wrote."""
        return cls.make(d["kernel"], d["op"], d["arch"], shapes=d["shapes"], dtypes=d["dtypes"], params=d["params"],
                        module=d.get("module", ""))

    def canonical(self) -> str:
        """One text per compiled kernel (sorted keys, no whitespace; ``LAUNCH_ONLY`` parameters
        left out): what the disk cache key hashes."""
        d = self.to_json()
        d["params"] = {k: v for k, v in d["params"].items() if k not in LAUNCH_ONLY}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def label(self) -> str:
        """Readable: ``gemv[latent_tail] k=3584 rows=448 tokens=1 chunk=1 ksplit=7 norm=True sm_90a``
        (tiling parameters left out)."""
        op = self.op.split("::")[-1]
        head = self.kernel if op == self.kernel else f"{self.kernel}[{op}]"

        def text(v):
            return "/".join(map(str, v)) if isinstance(v, tuple) else str(v)

        words = [f"{k}={text(v)}" for k, v in (*self.shapes, *self.params) if k not in _QUIET]
        return " ".join([head, *words, self.arch])
