"""The built-in fusion rules, one module per family, each named for what it fuses: the
attention input projection, the KDA core, MLA's query front and attention, the AttnRes before
attention, the output projection with its all-reduce and AttnRes, the router, the MoE experts
and tail, and layer 0's dense MLP. Each module defines its fused ops (``torch.ops.k3f``) when
it is imported and lists its rules in ``RULES``. See README.md, "Adding a pattern".
"""
from __future__ import annotations

import importlib
from types import ModuleType

from rewriter.compiler.rules import RuleSet

# the built-in families in registration order (a tie between patterns of one size goes to the earlier)
FAMILIES = ("input_projection", "kda", "mla", "attn_res", "output_projection", "router", "moe", "dense_mlp")


def builtin_modules() -> tuple[ModuleType, ...]:
    """The built-in families' modules, imported: importing one defines its fused ops, which a
    rewritten graph (or a stored program) names."""
    return tuple(importlib.import_module(f"patterns.{name}") for name in FAMILIES)


def default_rules() -> RuleSet:
    """Every built-in rule, family by family."""
    rs = RuleSet()
    for module in builtin_modules():
        for rule in module.RULES:
            rs.add(rule)
    return rs
