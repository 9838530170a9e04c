"""What a fused op's launcher needs of the model around it, handed over by the compiler:
the collectives it runs between its kernels, how the model lays out its decode state and its
quantized weights, and the lowering of a fused op's reference into a program a generated kernel
runs.

codegen imports nothing of the model: the compiler installs a ``Host`` (``install``) before it
plans kernels or registers launchers (``rewriter.compiler.plan``), and the templates read it
back with ``host()`` when they make specs or launch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Tensor = Any  # torch.Tensor, or a meta value of a traced graph


@dataclass(frozen=True)
class Host:
    # x summed over the ``world_size`` ranks of the named group (a copy at world size 1)
    all_reduce: Callable[[Tensor, str, int], Tensor]
    # every rank's x side by side along the last dim, in rank order
    gather_last_dim: Callable[[Tensor, str, int], Tensor]
    # whether a collective over this many ranks really runs (not at 1, nor while a benchmark stands
    # them down): a launcher that fuses one skips its staging when it does not
    collective_runs: Callable[[int], bool]
    # "SD" or "DS": how a [slots, channels, width] KDA conv state keeps a slot's values; None: neither
    conv_layout: Callable[[Tensor], str | None]
    # whether an MLA latent cache holds fp8 (E4M3 with a per-tensor scale) rather than bf16
    kv_cache_is_fp8: Callable[[Tensor], bool]
    # (fused op "k3f::name", a call's arguments) -> its reference as a codegen.lowered.Program, or why not
    lower: Callable[[str, Sequence[Any]], Any]
    # (format, packed weight, its scales) -> the weight's [N, K] bf16 values, exactly (a quantized
    # weight's format: codegen.lowered.MXFP4)
    dequant: Callable[[str, Tensor, Tensor], Tensor]


_installed: list[Host] = []


def install(h: Host) -> None:
    """Make ``h`` the host every template reads (the compiler's; installing it again is a no-op)."""
    _installed[:] = [h]


def host() -> Host:
    if not _installed:
        raise RuntimeError("no host installed in codegen: the compiler hands it over (rewriter.compiler.plan."
                           "install_host, called by plan() and install_kernels())")
    return _installed[0]
