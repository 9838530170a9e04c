"""Shared helpers: the tiny config, seeded layers and inputs, relative error."""
from __future__ import annotations

import pytest
import torch

import rewriter.ops  # noqa: F401
from rewriter.config import KimiK3Config
from rewriter.layers import build_layer
from rewriter.layers.state import decode_inputs
from rewriter.layers.weights import init_random_
from rewriter.shape import DecodeShape


@pytest.fixture(scope="session")
def tiny() -> KimiK3Config:
    return KimiK3Config.preset("tiny")


@pytest.fixture(scope="session")
def k3() -> KimiK3Config:
    return KimiK3Config.preset("kimi-k3")


def make_layer(cfg, layer_idx, *, tp=1, rank=0, dtype=torch.float32, seed=0):
    return init_random_(build_layer(cfg, layer_idx, tp=tp, rank=rank, dtype=dtype, device="cpu"), seed=seed)


def make_inputs(layer, *, batch=3, q=1, context=5, block_size=4, seed=1, dtype=None):
    shape = DecodeShape(batch=batch, tp=layer.tp, rank=layer.rank, q=q, context=context, block_size=block_size,
                        dtype=dtype or layer.input_layernorm.weight.dtype)
    return decode_inputs(layer, shape, device="cpu", seed=seed)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))
