"""The CuTe DSL kernels (importing a module here imports CuTe DSL).

``KERNELS`` maps a spec's kernel name to its source files, first the module that defines
``build(spec) -> (kernel object, fake compile arguments)``, then what else it imports from
this folder; with ``common.py`` they are hashed into the disk cache key.
"""
from __future__ import annotations

from pathlib import Path

KERNELS_DIR = Path(__file__).parent

KERNELS: dict[str, tuple[str, ...]] = {
    "attn_res_norm": ("attn_res_norm",),
    "attn_in_proj_gemv": ("in_proj_gemv",),
    "router_topk": ("router_topk",),
    "expert_up": ("expert_up",),
    "expert_down": ("expert_down",),
    "gemv": ("gemv",),
    "attn_in_proj_gemm": ("gemm",),
    "mlp_gate_up_gemm": ("gemm",),
    "mlp_down_gemm": ("gemm",),
    "o_proj_gemm": ("gemm",),
    "latent_tail_gemm": ("gemm",),
    "router_down_gemm": ("gemm",),
    "kda_core": ("kda_core",),
    "mla_attend": ("mla_attend", "warp_mma"),
    "expert_up_mxfp4": ("expert_up_mxfp4", "mxfp4"),
    "expert_down_mxfp4": ("expert_down_mxfp4", "mxfp4"),
    "mla_q_front": ("mla_q_front", "warp_mma"),
}


def module_of(kernel: str) -> str | None:
    files = KERNELS.get(kernel)
    return f"codegen.kernels.{files[0]}" if files else None


def source_files(kernel: str) -> list[Path]:
    return [KERNELS_DIR / f"{stem}.py" for stem in (*KERNELS[kernel], "common")]
