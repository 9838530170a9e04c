"""Fusion rules: what a rule is, and the registry the rewriter runs.

A rule (in the manner of vLLM's fusion passes and tinygrad's PatternMatcher) is data plus
small functions:
- ``variants(ctx)``: (pattern, replacement) pairs specialized to the layer being
  rewritten. The pattern is a plain PyTorch function, traced by the project's own tracer,
  that computes the subgraph to find (usually the very helper the reference layer calls,
  so the structure matches by construction); the replacement takes the same arguments and
  calls the fused op. Constants (split sizes, heads, eps) are baked into both, so a rule
  only matches the shapes it was specialized for.
- ``guard(match)``: a pure predicate on the matched shapes, dtypes, TP size, batch and GPU
  architecture. It returns None to accept or a reason to refuse ("batch 128 > 64").
  ``common_guard``, ``token_range_guard`` and ``split_guards`` (a rule that splits replicated
  rows across TP and its replicated twin) build the usual ones.
- ``kernel``/``stream``/``communicates``: how the fused op appears in the schedule.

The fused ops themselves are ``torch.library`` custom ops (namespace ``k3f``) defined
next to their rules in ``patterns/``, with a CPU reference implementation and a fake.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from codegen.targets import ARCHES, MAX_TOKENS
from rewriter.model.config import KimiK3Config
from rewriter.model.shape import DecodeShape


class RuleError(Exception):
    """A malformed rule: its pattern traces to nothing, its guard raised, ..."""


@dataclass(frozen=True)
class RuleContext:
    """What a rule is specialized to: the config, the traced layer and its decode shape."""

    config: KimiK3Config
    layer: Any  # rewriter.model.layers.KimiDecoderLayer (meta or real)
    shape: DecodeShape


@dataclass
class Match:
    """One occurrence of a rule's pattern in a layer graph, before its guard decides."""

    rule: Rule
    variant: int
    nodes: list[fx.Node]  # the matched computing nodes, in graph order
    inputs: dict[str, fx.Node]  # pattern parameter name -> graph node bound to it
    ctx: RuleContext

    @property
    def shape(self) -> DecodeShape:
        return self.ctx.shape

    def val(self, name: str) -> Any:
        """The meta value (shape, dtype) of the input bound to pattern parameter ``name``."""
        return self.inputs[name].meta.get("val")


Variant = tuple[Callable[..., Any], Callable[..., Any]]


@dataclass(frozen=True)
class Rule:
    name: str
    family: str
    variants: Callable[[RuleContext], Sequence[Variant]]
    guard: Callable[[Match], str | None]
    kernel: str = ""  # name of the kernel the fused op becomes; defaults to the rule name
    stream: str = "main"  # "aux": may run beside the main stream (shared experts)
    communicates: bool = False  # holds a cross-GPU reduction (a prefetch point at TP > 1)
    doc: str = ""
    # kernel launches of the fused op's GPU implementation (> 1 where a dependency across the
    # whole output sits inside it, e.g. an expert's down projection needs its whole activation);
    # cross-GPU collectives at TP > 1 not counted
    launches: int = 1
    # share of the matched weights one rank reads (rules that split a replicated weight: 1/TP)
    weight_fraction: Callable[[RuleContext], float] = lambda ctx: 1.0
    # the pattern inputs (weights) that share applies to; empty: every matched weight
    split_inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise RuleError(f"rule {self.name!r}: family must be a non-empty name (the report groups by it), "
                            f"got {self.family!r}")
        if not isinstance(self.launches, int) or self.launches < 1:
            raise RuleError(f"rule {self.name!r}: launches must be an int >= 1, got {self.launches!r}")
        if self.stream not in ("main", "aux"):
            raise RuleError(f"rule {self.name!r}: stream must be 'main' or 'aux', got {self.stream!r}")

    @property
    def kernel_name(self) -> str:
        return self.kernel or self.name


def common_guard(m: Match) -> str | None:
    """Refusals every rule shares: batch beyond the specialized range, an unknown GPU, a dtype."""
    s = m.shape
    if s.tokens > MAX_TOKENS:
        return f"batch {s.tokens} > {MAX_TOKENS}: rules are specialized for decode batches of 1..{MAX_TOKENS} tokens"
    if s.arch not in ARCHES:
        return f"{s.arch} not supported (supported: {', '.join(ARCHES)})"
    return None


def token_range_guard(lo: int, hi: int, what: str) -> Callable[[Match], str | None]:
    """A guard accepting ``lo..hi`` tokens per step (after the common checks)."""

    def guard(m: Match) -> str | None:
        reason = common_guard(m)
        if reason:
            return reason
        if not lo <= m.shape.tokens <= hi:
            return f"batch {m.shape.tokens} outside {lo}..{hi} ({what})"
        return None

    return guard


def split_guards(undivided: Callable[[Match], str | None], rows: str,
                 split_rule: str) -> tuple[Callable[[Match], str | None], Callable[[Match], str | None]]:
    """The guards of a rule that splits replicated weights' rows across TP and of its replicated
    twin: ``undivided`` says why TP does not divide the ``rows`` (the split rule's refusal), and
    the twin refuses where it does (the split rule's case)."""
    def split(m: Match) -> str | None:
        return common_guard(m) or undivided(m)

    def replicated(m: Match) -> str | None:
        reason = common_guard(m)
        if reason is None and undivided(m) is None:
            reason = f"TP {m.shape.tp} divides {rows}: {split_rule} splits them"
        return reason

    return split, replicated


@dataclass
class RuleSet:
    """An ordered collection of rules; ``patterns.default_rules()`` is the built-in one."""

    rules: list[Rule] = field(default_factory=list)

    def add(self, rule: Rule) -> Rule:
        if any(r.name == rule.name for r in self.rules):
            raise RuleError(f"rule {rule.name!r} is already registered")
        self.rules.append(rule)
        return rule

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)


def fused_op(name: str, mutates_args: tuple[str, ...] = (), fake: Callable[..., Any] | None = None):
    """Define ``k3f::<name>`` from a typed Python function: its CPU reference implementation.

    The fake (meta) implementation is the same function unless ``fake`` is given: the
    reference is plain torch plus ``k3::`` ops, which all have fakes themselves.
    """

    def wrap(fn: Callable[..., Any]) -> Any:
        if hasattr(torch.ops.k3f, name):  # torch would drop the op from under the graphs made with it
            raise RuleError(f"k3f::{name} is already defined in this process (a fused op is defined once: "
                            "give it another name)")
        op = torch.library.custom_op(f"k3f::{name}", fn, mutates_args=mutates_args)
        op.register_fake(fake or fn)
        return op

    return wrap


_LOADED: dict[tuple[Path, int, int], list[Rule]] = {}  # (resolved path, mtime_ns, size) -> its RULES


def load_rules_file(path: str | Path) -> list[Rule]:
    """The ``RULES`` list of a Python file: how users add their own rules to ``inspect``.

    A file runs once per process: running it again would define its ``k3f::`` ops again (which
    ``fused_op`` refuses). So the same file, unchanged, gives back the rules of its first run, and a
    file defining an op this process already has (another file's, a built-in's, or this file's
    before it changed) fails to import, naming the op."""
    path = Path(path)
    if not path.is_file():
        raise RuleError(f"rules file not found: {path}")
    stat = path.stat()
    key = (path.resolve(), stat.st_mtime_ns, stat.st_size)
    if key in _LOADED:
        return list(_LOADED[key])
    spec = importlib.util.spec_from_file_location(f"k3_user_rules_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise RuleError(f"rules file {path} failed to import: {type(e).__name__}: {e}") from e
    rules = getattr(module, "RULES", None)
    if not isinstance(rules, (list, tuple)) or not all(isinstance(r, Rule) for r in rules):
        raise RuleError(f"rules file {path} must define RULES, a list of rewriter.compiler.rules.Rule")
    _LOADED[key] = list(rules)
    return list(rules)
