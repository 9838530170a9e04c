"""The options that pick a layer and its decode shape, shared by ``inspect``, ``compile`` and
``--all-layers``, and the layer they name, rewritten by the compiler's pipeline."""
from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import torch

from codegen.targets import ARCHES
from patterns import default_rules
from rewriter.compiler.pipeline import decode_shape, rewritten_layer
from rewriter.compiler.rewrite import RewriteResult
from rewriter.compiler.rules import RuleSet, load_rules_file
from rewriter.model.config import PRESETS, KimiK3Config
from rewriter.model.shape import CONV_LAYOUTS, KV_CACHE_DTYPES, DecodeShape

# bf16 only: the released model and every kernel are bf16, and the vLLM plugin refuses other dtypes
DTYPES = {"bf16": torch.bfloat16}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    """The options that pick a layer and its decode shape (shared by inspect and compile)."""
    p.add_argument("--model", default="kimi-k3",
                   help=f"a preset ({', '.join(PRESETS)}) or a path to a config.json (default kimi-k3)")
    p.add_argument("--layer", type=int, default=1, help="0-based layer index (default 1, a KDA+MoE layer)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (default 0)")
    p.add_argument("--batch", type=_positive_int, default=1, help="decode requests in the step (default 1)")
    p.add_argument("--q", type=_positive_int, default=1, help="tokens per request (default 1; >1: speculative)")
    p.add_argument("--context", type=int, default=4096, help="tokens already cached per request (default 4096)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="MLA cache page size (default: the page vLLM binds for the model, TP, cache dtype and "
                        "draft tokens, rewriter/model/pages.py; Kimi K3 at TP 16: 384 bf16, 768 fp8)")
    p.add_argument("--arch", choices=ARCHES, default="sm_100a", help="GPU architecture (default sm_100a)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="activation/weight dtype: bf16, the released model's and every kernel's (the only one)")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="routed experts: the released checkpoint's MXFP4 in the layout vLLM serves (Humming's; "
                        "default) or bf16")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16",
                   help="MLA latent cache: bf16 or fp8 (E4M3, one per-tensor scale: vLLM's --kv-cache-dtype fp8)")
    p.add_argument("--conv-layout", choices=CONV_LAYOUTS, default="SD",
                   help="how vLLM keeps a KDA slot's conv state (VLLM_SSM_CONV_STATE_LAYOUT; default SD, vLLM's)")
    add_rules_arg(p)


def add_rules_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", type=Path, metavar="FILE", action="append", default=[],
                   help="a Python file whose RULES list is added to the built-in rules, tried before them "
                        "(repeatable)")


def rule_set(files: Iterable[str | Path]) -> RuleSet:
    """Every rules file's rules (a file loaded once per process: ``load_rules_file``), then the
    built-in rules, for this process and for ``compile --all-layers``' workers alike. Patterns
    match largest first; of two of one size, a file's rule comes first: a user's rule can take
    the place of a built-in one."""
    rules = RuleSet()
    for path in files:
        for rule in load_rules_file(path):
            rules.add(rule)
    for rule in default_rules():
        rules.add(rule)
    return rules


def rules_of(args: argparse.Namespace) -> RuleSet:
    """The rule set the options name: none with ``--no-rules``, else the built-in rules plus every
    ``--rules`` file's."""
    return RuleSet() if getattr(args, "no_rules", False) else rule_set(args.rules)


def shape_of(args: argparse.Namespace, cfg: KimiK3Config) -> DecodeShape:
    """The decode shape the options name (``--block-size`` default: the page vLLM binds)."""
    return decode_shape(cfg, batch=args.batch, tp=args.tp, rank=args.rank, dtype=DTYPES[args.dtype], arch=args.arch,
                        q=args.q, context=args.context, block_size=args.block_size, conv_layout=args.conv_layout,
                        kv_cache_dtype=args.kv_cache_dtype)


def layer_of(args: argparse.Namespace, rules: RuleSet | None = None) -> RewriteResult:
    """The layer the options name, traced at their shape and rewritten (``rules``: default the
    options' own, ``rules_of``)."""
    cfg = KimiK3Config.load(args.model)
    return rewritten_layer(cfg, args.layer, shape_of(args, cfg), rules_of(args) if rules is None else rules,
                           args.experts)
