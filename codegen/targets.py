"""What the kernels are built for, and so what the compiler serves: the GPU architectures
(with the compute capability of each), the most tokens a decode step holds, and the most
tokens one request holds (a speculative verify step: k drafted tokens plus one). The rules,
the templates, the server's programs, its guard and the commands all read these."""
from __future__ import annotations

# arch name (CuTe DSL's --gpu-arch) -> CUDA compute capability
CAPABILITIES: dict[str, tuple[int, int]] = {"sm_90a": (9, 0), "sm_100a": (10, 0), "sm_103a": (10, 3)}
ARCHES: tuple[str, ...] = tuple(CAPABILITIES)
MAX_TOKENS = 64  # tokens in a decode step (requests x tokens per request)
MAX_Q = 8  # tokens per request of a verify step (k + 1 <= 8)
BITS = 128  # the widest load or store a thread issues
VEC = BITS // 16  # 16-bit values (bf16) in one


def arch_of(capability: tuple[int, int]) -> str | None:
    """The arch of a GPU of compute ``capability``, or None when no kernel is built for it."""
    return next((a for a, c in CAPABILITIES.items() if c == tuple(capability)), None)
