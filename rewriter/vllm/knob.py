"""The ``decode_backend`` knob, read from vLLM's ``additional_config``.

    vllm serve moonshotai/Kimi-K3 --additional-config '{"decode_backend": "latency_specialized"}'

"auto" (the default) keeps vLLM's stock decode; "latency_specialized" turns the
rewriter on; anything else stops startup with the accepted values listed.
"""
from __future__ import annotations

from typing import Any

KNOB = "decode_backend"
AUTO = "auto"
REWRITER = "latency_specialized"
ACCEPTED = (AUTO, REWRITER)


def decode_backend(additional_config: Any) -> str:
    """The requested backend, validated."""
    if additional_config is None:
        return AUTO
    if not isinstance(additional_config, dict):
        raise ValueError(f"additional_config must be a JSON object, got {type(additional_config).__name__}")
    value = additional_config.get(KNOB, AUTO)
    if value not in ACCEPTED:
        raise ValueError(f"additional_config {KNOB}={value!r} is not supported; accepted values: "
                         f"{', '.join(repr(v) for v in ACCEPTED)}")
    return value
