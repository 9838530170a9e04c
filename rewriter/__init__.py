"""A compiler-style decode rewriter for Kimi K3: trace a decoder layer into torch.fx,
match fusion rules, schedule fused kernels, and install them into vLLM."""
from rewriter.model.config import ConfigError, KimiK3Config, TPShapes

__all__ = ["ConfigError", "KimiK3Config", "TPShapes"]
