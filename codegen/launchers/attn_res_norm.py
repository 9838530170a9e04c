"""``attn_res_norm``: AttnRes mix over <= 9 sources + RMSNorm, block write and new prefix
(``k3f::attn_res_norm``); one kernel, a cluster of CTAs per token (``CLUSTER_BY_TOKENS``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codegen.spec import KernelSpec
from codegen.template import Template, aligned, check_tensors

# The split of a token's row by token count: (up to this many tokens, CTAs a token, 128-bit
# vectors a thread); past the last row one CTA of two vectors a thread. One SM per token waits
# on its loads; with many tokens the CTAs' reductions cost more than the split saves (H200,
# docs/CODEGEN.md). The cluster halves until it divides the row's vectors.
CLUSTER_BY_TOKENS = ((8, 8, 1), (16, 4, 1), (64, 2, 2))


def split_for(tokens: int, hidden: int) -> tuple[int, int]:
    """(cluster, vectors a thread) that ``CLUSTER_BY_TOKENS`` gives ``tokens``."""
    c, v = next(((c, v) for most, c, v in CLUSTER_BY_TOKENS if tokens <= most), (1, 2))
    while (hidden // 8) % c:
        c //= 2
    return c, v


def _attn_res_spec(op: str, arch: str, args: Sequence[Any]) -> KernelSpec | str:
    prefix, delta, blocks, norm_w, qk_w, out_w, num_blocks, write_idx, eps = args
    if prefix.dim() != 2:
        return f"prefix must be [tokens, hidden], got {tuple(prefix.shape)}"
    t, d = prefix.shape
    named = {"prefix": prefix, "blocks": blocks, "norm_weight": norm_w, "qk_weight": qk_w, "out_norm_weight": out_w}
    if delta is not None:
        named["delta"] = delta
    reason = check_tensors(named, torch.bfloat16)
    if reason:
        return reason
    if delta is not None and tuple(delta.shape) != (t, d):
        return f"delta {tuple(delta.shape)} does not match prefix {(t, d)}"
    if blocks.dim() != 3 or blocks.shape[0] != t or blocks.shape[2] != d:
        return f"blocks must be [tokens, blocks, {d}], got {tuple(blocks.shape)}"
    for name in ("norm_weight", "qk_weight", "out_norm_weight"):
        if tuple(named[name].shape) != (d,):
            return f"{name} must be [{d}], got {tuple(named[name].shape)}"
    if d % 8:
        return f"hidden {d} is not a multiple of 8 (128-bit vectors)"
    nb = blocks.shape[1]
    if not 0 <= num_blocks <= min(8, nb):
        return f"num_blocks {num_blocks} outside 0..{min(8, nb)} (at most 9 sources)"
    if write_idx >= nb:
        return f"write_idx {write_idx} outside the block buffer ({nb} blocks)"
    cluster, vectors = split_for(t, d)
    return (KernelSpec.make("attn_res_norm", op, arch, shapes={"hidden": d, "blocks": nb},
                           dtypes={"act": "bf16", "weight": "bf16"},
                           params={"num_blocks": int(num_blocks), "write_idx": max(int(write_idx), -1),
                                   "has_delta": delta is not None, "eps": float(eps),
                                   "cluster": cluster, "vectors": vectors}),)


def _attn_res_runtime(args: Sequence[Any]) -> str | None:
    prefix, delta, blocks, norm_w, qk_w, out_w = args[:6]
    return aligned({"prefix": prefix, "delta": delta, "blocks": blocks, "norm_weight": norm_w,
                     "qk_weight": qk_w, "out_norm_weight": out_w})


def _attn_res_launch(fns, specs: tuple[KernelSpec, ...], args: Sequence[Any], out=None):
    (fn,) = fns
    prefix, delta, blocks, norm_w, qk_w, out_w = args[:6]
    x, new_prefix = out if out is not None else (torch.empty_like(prefix), torch.empty_like(prefix))
    if prefix.shape[0]:
        fn(prefix, delta, blocks, norm_w, qk_w, out_w, x, new_prefix)
    return x, new_prefix


TEMPLATE = Template("attn_res_norm", ("k3f::attn_res_norm",), _attn_res_spec, _attn_res_runtime, _attn_res_launch,
                    doc="AttnRes mix over <= 9 sources + RMSNorm, block write and new prefix; "
                        "a cluster of CTAs per token")
