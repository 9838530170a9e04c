"""How each parameter of a rank is cut from the full (TP 1) tensor, as vLLM shards it.

A ``Sharding`` turns a full tensor into rank ``rank``'s piece. The packed projections
(several logical outputs in one weight, some split across ranks and some replicated,
padded per rank) are described as a list of pieces, so the same code slices every one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Piece:
    """One logical block of a packed dimension: its full size and whether ranks split it."""

    size: int
    split: bool = True
    pad_to: int | None = None  # per-rank size after zero padding (vLLM pads small expert shards)


@dataclass(frozen=True)
class Sharding:
    """Cut ``dim`` of a full tensor into pieces; ``align`` zero-pads the rank's total."""

    dim: int | None = None  # None: replicated
    pieces: tuple[Piece, ...] = ()
    align: int = 1

    def local(self, full: Tensor, tp: int, rank: int) -> Tensor:
        if self.dim is None or tp == 1 and self.align == 1 and not any(p.pad_to for p in self.pieces):
            return full
        dim = self.dim % full.dim()
        pieces = self.pieces or (Piece(full.shape[dim]),)
        total = sum(p.size for p in pieces)
        if self.align > 1 and 0 < full.shape[dim] - total < self.align:
            full = full.narrow(dim, 0, total)  # the full tensor's own alignment padding
        if total != full.shape[dim]:
            raise ValueError(
                f"sharding expects dim {dim} of size {total}, got {tuple(full.shape)}"
            )
        out, start = [], 0
        for p in pieces:
            block = full.narrow(dim, start, p.size)
            start += p.size
            if p.split:
                if p.size % tp:
                    raise ValueError(f"TP size {tp} does not divide a shard of size {p.size}")
                block = block.chunk(tp, dim=dim)[rank]
            if p.pad_to is not None and p.pad_to > block.shape[dim]:
                block = _pad(block, dim, p.pad_to - block.shape[dim])
            out.append(block)
        local = torch.cat(out, dim=dim)
        extra = -local.shape[dim] % self.align
        return _pad(local, dim, extra) if extra else local


def _pad(t: Tensor, dim: int, n: int) -> Tensor:
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


REPLICATED = Sharding()
COLUMN = Sharding(dim=0)  # output features split (ColumnParallelLinear)
ROW = Sharding(dim=1)  # input features split (RowParallelLinear)


def zero_padding_(local: Tensor, sharding: Sharding, tp: int) -> None:
    """Zero the rows a rank holds only as padding (vLLM keeps them zero so they add nothing)."""
    if sharding.dim is None:
        return
    dim = sharding.dim % local.dim()
    start = 0
    for p in sharding.pieces:
        real = p.size // tp if p.split else p.size
        held = max(real, p.pad_to or 0)
        if held > real:
            local.narrow(dim, start + real, held - real).zero_()
        start += held
    if sharding.pieces and local.shape[dim] > start:
        local.narrow(dim, start, local.shape[dim] - start).zero_()
