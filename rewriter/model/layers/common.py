"""Small building blocks shared by the reference layers."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from rewriter.model.layers.sharding import Sharding
from rewriter.model.regions import region

k3 = torch.ops.k3


class Weight(nn.Module):
    """A module holding one ``weight``, so parameter names read ``<name>.weight`` as in vLLM.

    ``shardings`` says how each of its parameters is cut from the full (TP 1) tensor; the
    layers' other modules carry the same attribute for their direct parameters.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, sharding: Sharding):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.shardings = {"weight": sharding}


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32, result in x's dtype (vLLM's RMSNorm numerics)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).type_as(x)


def situ_and_mul(gate_up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU gated activation: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (act * up).type_as(gate_up)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).type_as(gate_up)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (the KDA kernels' q/k norm)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def o_proj_all_reduce(o: Tensor, weight: Tensor, group: str, tp: int) -> Tensor:
    """The attention output projection (row parallel) and its all-reduce."""
    with region("attn.o_proj"):
        out = torch.nn.functional.linear(o, weight)
    with region("attn.o_proj_all_reduce"):
        return k3.all_reduce(out, group, tp)
