"""Reference Kimi K3 decoder layers in plain PyTorch, with vLLM 0.33.0's parameter names.

They are the oracle every rewrite is checked against and the module the tracer reads,
so they favour plain, traceable math over speed: no data-dependent Python control
flow, decode state touched only through the leaf ops in ``rewriter.model.ops``.
"""
import rewriter.model.ops  # noqa: F401  (registers the k3:: leaf ops the layers call)
from rewriter.model.layers.decoder import KimiDecoderLayer, build_layer

__all__ = ["KimiDecoderLayer", "build_layer"]
