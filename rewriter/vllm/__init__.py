"""vLLM integration: the plugin, the ``decode_backend`` knob, the guards and the programs.

``register()`` is the ``vllm.general_plugins`` entry point. It points vLLM's
``KimiLinearForCausalLM`` architecture (which Kimi K3 builds its text model through) at
``rewriter.vllm.model:RewrittenKimiLinearForCausalLM``; nothing else happens at import,
so the plugin is safe in every process vLLM loads it in, as often as it is loaded.
"""
from __future__ import annotations

ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_CLASS = "rewriter.vllm.model:RewrittenKimiLinearForCausalLM"

_registered = False


def register() -> None:
    """Register our subclass for Kimi K3's text architecture (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    _registered = True
