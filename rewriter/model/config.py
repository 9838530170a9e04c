"""Kimi K3 text-model configuration: loading, validation, presets and TP shard shapes.

Loads the published ``config.json`` format (a ``KimiK3ForConditionalGeneration`` file
whose ``text_config`` is a ``kimi_linear`` config, or a bare ``kimi_linear`` config)
into a frozen dataclass. Every missing or invalid field is an error naming the field
and the value, so a bad file fails at load time rather than deep inside a trace.
Field names and defaults follow vLLM 0.33.0's ``KimiLinearConfig``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

PRESETS = ("kimi-k3", "kimi-linear-48b", "tiny")


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or holds an unusable value."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class KimiK3Config:
    """The text backbone fields the rewriter uses (names as in the published file)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    hidden_act: str
    activation_situ_beta: float | None
    activation_situ_linear_beta: float | None
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    # KDA (linear_attn_config)
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float | None
    use_full_rank_gate: bool
    kda_layers: tuple[int, ...]  # 1-based, as published
    full_attn_layers: tuple[int, ...]  # 1-based, as published
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    moe_renormalize: bool
    moe_router_activation_func: str
    routed_scaling_factor: float
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    topk_method: str
    first_k_dense_replace: int
    moe_layer_freq: int
    min_moe_intermediate_per_partition: int
    # AttnRes
    attn_res_block_size: int | None

    # ---- layer taxonomy -------------------------------------------------
    def check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ConfigError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.num_hidden_layers:
            raise ConfigError(
                f"layer {layer} out of range: {self.name} has layers 0..{self.num_hidden_layers - 1}"
            )

    def attention_kind(self, layer: int) -> str:
        """'kda' or 'mla' for 0-based ``layer`` (the published lists are 1-based)."""
        self.check_layer(layer)
        return "kda" if (layer + 1) in self.kda_layers else "mla"

    def is_moe_layer(self, layer: int) -> bool:
        self.check_layer(layer)
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def layer_kind(self, layer: int) -> str:
        """'dense' (dense MLP), else the attention kind of an MoE layer: 'kda' | 'mla'."""
        return self.attention_kind(layer) if self.is_moe_layer(layer) else "dense"

    @property
    def use_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def moe_hidden_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        """Blocks kept by AttnRes for the whole model (vLLM: cdiv(end_layer, block_size))."""
        if self.attn_res_block_size is None:
            return 0
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def mla_cache_entry(self) -> int:
        """Values per token per MLA layer in the latent cache (576 for Kimi K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def shard(self, tp: int) -> TPShapes:
        return TPShapes.of(self, tp)

    def one_rank_of(self, tp: int) -> KimiK3Config:
        """A TP 1 model whose layers have one rank's shapes at TP ``tp`` (heads and intermediate
        sizes divided by ``tp``): lets one GPU check a whole rank-sized layer against its
        reference with no collective. Same shapes as ``shard(tp)`` but for the replicated router
        (whole) and the expert intermediate (unpadded)."""
        self.shard(tp)  # raises ConfigError when tp does not divide the model
        return dataclasses.replace(
            self, name=f"{self.name}/rank-of-tp{tp}", kda_num_heads=self.kda_num_heads // tp,
            num_attention_heads=self.num_attention_heads // tp, intermediate_size=self.intermediate_size // tp,
            moe_intermediate_size=self.moe_intermediate_size // tp)

    def unsupported_for_reference(self) -> list[str]:
        """Features the reference layers do not implement (empty for Kimi K3)."""
        reasons = []
        if not self.use_full_rank_gate:
            reasons.append("linear_attn_config.use_full_rank_gate is false (low-rank KDA gate)")
        if self.q_lora_rank is None:
            reasons.append("q_lora_rank is null (full-rank MLA query)")
        if not self.mla_use_output_gate:
            reasons.append("mla_use_output_gate is false")
        if not self.mla_use_nope:
            reasons.append("mla_use_nope is false (RoPE MLA)")
        if not self.use_latent_moe:
            reasons.append("routed_expert_hidden_size is null (no latent MoE)")
        elif not self.latent_moe_use_norm:
            reasons.append("latent_moe_use_norm is false (no routed_expert_norm)")
        if self.topk_method != "noaux_tc":
            reasons.append(f"topk_method is {_show(self.topk_method)}, not 'noaux_tc'")
        if self.attn_res_block_size is None:
            reasons.append("attn_res_block_size is null (no AttnRes)")
        if self.hidden_act != "situ":
            reasons.append(f"hidden_act is {self.hidden_act!r}, not 'situ'")
        if self.moe_router_activation_func != "sigmoid":
            reasons.append(f"moe_router_activation_func is {self.moe_router_activation_func!r}")
        if self.num_expert_group != 1 or self.topk_group != 1:
            reasons.append("grouped top-k with more than one group")
        if self.num_shared_experts < 1:
            reasons.append("num_shared_experts is 0")
        return reasons

    # ---- loading --------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "<dict>") -> KimiK3Config:
        _require(isinstance(raw, dict), f"{name}: a config must be a JSON object, got {type(raw).__name__}")
        if "text_config" in raw:
            archs = raw.get("architectures") or []
            _require(
                raw.get("model_type") == "kimi_k3" or "KimiK3ForConditionalGeneration" in archs,
                f"{name}: a config with text_config must be Kimi K3 (model_type 'kimi_k3'), "
                f"got model_type={_show(raw.get('model_type'))}",
            )
            text = raw["text_config"]
            _require(isinstance(text, dict), f"{name}: text_config must be an object, got {_show(text)}")
        else:
            text = raw
        _require(
            text.get("model_type") == "kimi_linear",
            f"{name}: text config model_type must be 'kimi_linear', got {_show(text.get('model_type'))}",
        )
        return cls(**_parse_text_config(text, name))

    @classmethod
    def from_json(cls, path: str | Path) -> KimiK3Config:
        path = Path(path)
        try:
            raw = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        return cls.from_dict(raw, name=str(path))

    @classmethod
    def preset(cls, name: str) -> KimiK3Config:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        text = resources.files("rewriter.model.configs").joinpath(f"{name}.json").read_text()
        return cls.from_dict(json.loads(text), name=name)

    @classmethod
    def load(cls, model: str) -> KimiK3Config:
        """A preset name, or a path to a config.json (or a folder holding one)."""
        if model in PRESETS:
            return cls.preset(model)
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(
                f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config file"
            )
        return cls.from_json(path)

    def replace(self, **changes: Any) -> KimiK3Config:
        return dataclasses.replace(self, **changes)


_MISSING = object()


def _show(value: Any, first: int = 8, width: int = 120) -> str:
    """``value`` for an error message, kept to one short line: a long list as its first entries
    and its length, any other long repr cut."""
    if isinstance(value, (list, tuple)) and len(value) > first:
        text = f"[{', '.join(map(repr, value[:first]))}, ... ({len(value)} in all)]"
    else:
        text = repr(value)
    return text if len(text) <= width else f"{text[:width - 3]}..."


def _field(d: dict, key: str, kind: type | tuple, name: str, default: Any = _MISSING, where: str = "") -> Any:
    """d[key] checked against ``kind``; a missing or null field takes ``default`` or is an error.
    A float must be finite (JSON files may hold NaN and Infinity)."""
    label = f"{where}{key}"
    value = d.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"{name}: missing field {label}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past the float range
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{name}: field {label} must be a finite number, got {_show(value)}")
        return number
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{name}: field {label} must be {want}, got {_show(value)}")
    return value


def _positive(v: int | None, label: str, name: str) -> None:
    if v is not None and v <= 0:
        raise ConfigError(f"{name}: field {label} must be positive, got {_show(v)}")


def _parse_text_config(t: dict, name: str) -> dict[str, Any]:
    def f(key, kind, default=_MISSING):
        return _field(t, key, kind, name, default)
    lac = _field(t, "linear_attn_config", dict, name)
    def g(key, kind, default=_MISSING):
        return _field(lac, key, kind, name, default, "linear_attn_config.")
    out: dict[str, Any] = dict(
        name=name,
        hidden_size=f("hidden_size", int),
        intermediate_size=f("intermediate_size", int),
        num_hidden_layers=f("num_hidden_layers", int),
        num_attention_heads=f("num_attention_heads", int),
        rms_norm_eps=f("rms_norm_eps", float, 1e-6),
        vocab_size=f("vocab_size", int, 163840),
        hidden_act=f("hidden_act", str, "silu"),
        activation_situ_beta=f("activation_situ_beta", float, None),
        activation_situ_linear_beta=f("activation_situ_linear_beta", float, None),
        q_lora_rank=f("q_lora_rank", int, None),
        kv_lora_rank=f("kv_lora_rank", int),
        qk_nope_head_dim=f("qk_nope_head_dim", int),
        qk_rope_head_dim=f("qk_rope_head_dim", int),
        v_head_dim=f("v_head_dim", int),
        mla_use_nope=f("mla_use_nope", bool, False),
        mla_use_output_gate=f("mla_use_output_gate", bool, False),
        kda_num_heads=g("num_heads", int),
        kda_head_dim=g("head_dim", int),
        short_conv_kernel_size=g("short_conv_kernel_size", int),
        gate_lower_bound=g("gate_lower_bound", float, None),
        use_full_rank_gate=g("use_full_rank_gate", bool, False),
        kda_layers=tuple(g("kda_layers", list)),
        full_attn_layers=tuple(g("full_attn_layers", list)),
        num_experts=f("num_experts", int),
        num_experts_per_token=f("num_experts_per_token", int),
        num_shared_experts=f("num_shared_experts", int, 0),
        moe_intermediate_size=f("moe_intermediate_size", int),
        routed_expert_hidden_size=f("routed_expert_hidden_size", int, None),
        latent_moe_use_norm=f("latent_moe_use_norm", bool, False),
        moe_renormalize=f("moe_renormalize", bool, True),
        moe_router_activation_func=f("moe_router_activation_func", str, "sigmoid"),
        routed_scaling_factor=f("routed_scaling_factor", float, 1.0),
        use_grouped_topk=f("use_grouped_topk", bool, True),
        num_expert_group=f("num_expert_group", int, 1),
        topk_group=f("topk_group", int, 1),
        topk_method=f("topk_method", str, "noaux_tc"),
        first_k_dense_replace=f("first_k_dense_replace", int, 0),
        moe_layer_freq=f("moe_layer_freq", int, 1),
        min_moe_intermediate_per_partition=f("min_moe_intermediate_per_partition", int, 256),
        attn_res_block_size=f("attn_res_block_size", int, None),
    )
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
        "moe_intermediate_size", "moe_layer_freq", "num_expert_group", "topk_group",
        "min_moe_intermediate_per_partition", "q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size",
    ):
        _positive(out[key], key, name)
    for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
        _positive(out[{"num_heads": "kda_num_heads", "head_dim": "kda_head_dim"}.get(key, key)],
                  f"linear_attn_config.{key}", name)
    _require(out["rms_norm_eps"] > 0, f"{name}: field rms_norm_eps must be positive, got {_show(out['rms_norm_eps'])}")
    _require(out["num_shared_experts"] >= 0,
             f"{name}: field num_shared_experts must be >= 0, got {_show(out['num_shared_experts'])}")
    _require(out["first_k_dense_replace"] >= 0,
             f"{name}: field first_k_dense_replace must be >= 0, got {_show(out['first_k_dense_replace'])}")
    _require(out["hidden_act"] in ("situ", "silu"),
             f"{name}: field hidden_act must be 'situ' or 'silu', got {_show(out['hidden_act'])}")
    if out["hidden_act"] == "situ":
        _require(out["activation_situ_beta"] is not None and out["activation_situ_beta"] > 0,
                 f"{name}: field activation_situ_beta must be positive for SiTU, "
                 f"got {_show(out['activation_situ_beta'])}")
    _require(out["moe_router_activation_func"] in ("sigmoid", "softmax"),
             f"{name}: field moe_router_activation_func must be 'sigmoid' or 'softmax', "
             f"got {_show(out['moe_router_activation_func'])}")
    _require(out["num_experts_per_token"] <= out["num_experts"],
             f"{name}: field num_experts_per_token ({_show(out['num_experts_per_token'])}) exceeds "
             f"num_experts ({_show(out['num_experts'])})")
    lb = out["gate_lower_bound"]
    _require(lb is None or -5.0 <= lb < 0,
             f"{name}: field linear_attn_config.gate_lower_bound must be in [-5, 0), got {_show(lb)}")
    n = out["num_hidden_layers"]
    for key in ("kda_layers", "full_attn_layers"):
        bad = [x for x in out[key] if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= n]
        _require(not bad, f"{name}: field linear_attn_config.{key} holds entries outside 1..{n}: {_show(bad)}")
    both = sorted(set(out["kda_layers"]) & set(out["full_attn_layers"]))
    _require(not both, f"{name}: layers {_show(both)} are in both linear_attn_config.kda_layers and full_attn_layers")
    missing = sorted(set(range(1, n + 1)) - set(out["kda_layers"]) - set(out["full_attn_layers"]))
    _require(not missing, f"{name}: layers {_show(missing)} are in neither linear_attn_config.kda_layers "
                          f"nor full_attn_layers")
    return out


def _divide(value: int, tp: int, label: str) -> int:
    if value % tp:
        raise ConfigError(f"TP size {tp} does not divide {label} ({value})")
    return value // tp


@dataclass(frozen=True)
class TPShapes:
    """Per-rank shapes at tensor-parallel size ``tp``, sharded as vLLM 0.33.0 shards them."""

    tp: int
    # KDA
    kda_heads: int
    kda_projection: int  # heads * head_dim on this rank
    in_proj_padding: int
    in_proj_qkvgfab: int  # local output width of the packed projection, padding included
    conv_dim: int  # q, k, v channels through the short conv
    # MLA
    mla_heads: int
    qkv_a_g: int  # local output width of fused_qkv_a_g_proj: q_a | kv_a | gate
    q_b: int
    kv_b: int
    mla_o_in: int
    # MoE / MLP
    experts: int  # no expert parallel: every rank holds every expert
    expert_intermediate: int  # per rank, padding included (w13 is 2x this)
    expert_intermediate_unpadded: int
    shared_intermediate: int
    dense_intermediate: int

    @classmethod
    def of(cls, cfg: KimiK3Config, tp: int) -> TPShapes:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"TP size must be a positive int, got {tp!r}")
        kda_heads = _divide(cfg.kda_num_heads, tp, "linear_attn_config.num_heads")
        proj = kda_heads * cfg.kda_head_dim
        unpadded = 4 * proj + cfg.kda_head_dim + kda_heads
        padding = -unpadded % 16
        mla_heads = _divide(cfg.num_attention_heads, tp, "num_attention_heads")
        q_lora = cfg.q_lora_rank or 0
        gate = mla_heads * cfg.v_head_dim if cfg.mla_use_output_gate else 0
        expert_real = _divide(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
        expert = expert_real
        if tp > 1 and expert_real < cfg.min_moe_intermediate_per_partition:
            expert = cfg.min_moe_intermediate_per_partition  # vLLM pads each rank's shard with zeros
        return cls(
            tp=tp,
            kda_heads=kda_heads,
            kda_projection=proj,
            in_proj_padding=padding,
            in_proj_qkvgfab=unpadded + padding,
            conv_dim=3 * proj,
            mla_heads=mla_heads,
            qkv_a_g=q_lora + cfg.kv_lora_rank + cfg.qk_rope_head_dim + gate,
            q_b=mla_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
            kv_b=mla_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            mla_o_in=mla_heads * cfg.v_head_dim,
            experts=cfg.num_experts,
            expert_intermediate=expert,
            expert_intermediate_unpadded=expert_real,
            shared_intermediate=_divide(cfg.moe_intermediate_size * cfg.num_shared_experts, tp,
                                        "moe_intermediate_size * num_shared_experts"),
            dense_intermediate=_divide(cfg.intermediate_size, tp, "intermediate_size"),
        )
