"""Which ``ExpertFormat`` a loaded vLLM layer's routed experts are in, and the MoE backend the
rewriter asks vLLM for.

After loading, vLLM's MoE backend re-lays the expert tensors in place (``process_weights_
after_loading``); the bytes then mean what that backend says, whatever their shape. So the
format is read from the backend vLLM picked (and, for Humming, from the layer configs its
transform recorded), never guessed from dtypes; a backend whose layout no kernel reads keeps
the layer on the stock forward, with its name.

The decode kernels read the layout Humming (humming-kernels, vLLM's default MXFP4 backend on
sm_90) leaves, so for an MXFP4 checkpoint the plugin asks vLLM for ``--moe-backend humming`` on
every GPU; vLLM's stock prefill then runs Humming on the same tensors, and no second copy of
the experts (93% of the checkpoint) exists.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from rewriter.model.layers.experts import ExpertFormat

log = logging.getLogger("rewriter.vllm")

MOE_BACKEND = "humming"
DENSE_BACKENDS = ("TRITON", "BATCHED_TRITON")  # unquantized backends that keep w13/w2 as loaded
HUMMING_INPUT_QUANT = "VLLM_HUMMING_INPUT_QUANT_CONFIG"  # quantized activations re-lay Humming's weights
# Humming LayerConfig fields and the value the kernels' layout needs (bf16 activations, weight-only MXFP4)
_HUMMING_FLAGS = {"use_fused_e8m0_scale": False, "use_packed_k_layout": False, "use_raw_weight": False,
                  "use_flat_weight": False, "pad_shape_n": 0, "pad_shape_k": 0}


class ExpertLayoutError(ValueError):
    """Routed experts in a layout the rewriter does not read; the message names it."""


def serves_mxfp4(vllm_config: Any) -> bool:
    """Whether the served checkpoint's routed experts are MXFP4 (vLLM resolves Kimi K3's
    compressed-tensors ``mxfp4-pack-quantized`` to ``mxfp4``)."""
    return getattr(vllm_config.model_config, "quantization", None) == "mxfp4"


def moe_backend_refusal(vllm_config: Any) -> str | None:
    """Why the MoE backend settings leave the experts in a layout the kernels cannot read."""
    if not serves_mxfp4(vllm_config):
        return None
    backend = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", "auto")
    if backend not in ("auto", MOE_BACKEND):
        return (f"MoE backend {backend!r} (--moe-backend): the rewriter's MXFP4 expert kernels read the layout "
                f"Humming leaves; use --moe-backend {MOE_BACKEND} or leave it unset")
    if os.environ.get(HUMMING_INPUT_QUANT):
        return (f"{HUMMING_INPUT_QUANT} is set: quantized activations make Humming re-lay the expert weights in a "
                "form the kernels do not read (bf16 activations)")
    return None


def select_moe_backend(vllm_config: Any) -> None:
    """Ask vLLM for Humming's layout on every GPU (sm_90's default; sm_100 would pick FlashInfer
    TRT-LLM's shuffled one), before the MoE layers are built."""
    kernel = getattr(vllm_config, "kernel_config", None)
    if serves_mxfp4(vllm_config) and kernel is not None and kernel.moe_backend == "auto":
        kernel.moe_backend = MOE_BACKEND
        log.info("rewriter: MoE backend set to %s: the decode kernels read the MXFP4 experts in its layout "
                 "(vLLM's stock prefill uses it too)", MOE_BACKEND)


def served_expert_format(routed_experts: Any) -> ExpertFormat:
    """The format of a loaded ``RoutedExperts`` module's tensors, from its quant method."""
    method = getattr(routed_experts, "quant_method", None)
    mxfp4 = getattr(method, "mxfp4_backend", None)
    if mxfp4 is not None:
        name = getattr(mxfp4, "name", str(mxfp4))
        if name == "NONE":  # no kernel re-laid them (a CPU build of vLLM): as loaded
            return ExpertFormat("mxfp4", "checkpoint")
        if name == "HUMMING":
            return ExpertFormat("mxfp4", _humming_layout(getattr(routed_experts, "humming_configs", None)))
        raise ExpertLayoutError(f"routed experts laid out for vLLM's {name} MXFP4 MoE backend; the kernels read "
                                f"Humming's layout (--moe-backend {MOE_BACKEND})")
    dense = getattr(method, "unquantized_backend", None)
    if dense is not None:
        name = getattr(dense, "name", str(dense))
        if name in DENSE_BACKENDS:
            return ExpertFormat("bf16", "dense")
        raise ExpertLayoutError(f"bf16 routed experts laid out for vLLM's {name} MoE backend; the kernels read "
                                "them as loaded (Triton's layout)")
    raise ExpertLayoutError(f"routed experts with quant method {type(method).__name__}: neither MXFP4 nor bf16 "
                            "experts in a layout the kernels read")


def _humming_layout(configs: Any) -> str:
    """``humming`` or ``humming_native`` from the LayerConfigs Humming's transform left on the
    layer, after checking they describe weight-only MXFP4 on bf16 activations."""
    if not isinstance(configs, dict) or set(configs) != {"w13", "w2"}:
        raise ExpertLayoutError("Humming experts without their layer configs (humming_configs w13, w2)")
    native = set()
    for part, cfg in configs.items():
        for field, want in (("a_dtype", "bfloat16"), ("b_dtype", "e2m1"), ("bs_dtype", "e8m0")):
            got = str(getattr(cfg, field, None)).lower()
            if want not in got:
                raise ExpertLayoutError(f"Humming {part} config {field}={got}: the kernels take {want}")
        if getattr(cfg, "weight_scale_group_size", 32) != 32:
            raise ExpertLayoutError(f"Humming {part} scale group {cfg.weight_scale_group_size}, not 32")
        for field, want in _HUMMING_FLAGS.items():
            got = getattr(cfg, field, want)
            if bool(got) != bool(want):
                raise ExpertLayoutError(f"Humming {part} config {field}={got!r}: the kernels read the layout with "
                                        f"{field}={want!r}")
        native.add(bool(getattr(cfg, "use_native_dequant", False)))
    if len(native) != 1:
        raise ExpertLayoutError("Humming w13 and w2 with different nibble orders (use_native_dequant)")
    return "humming_native" if native.pop() else "humming"
