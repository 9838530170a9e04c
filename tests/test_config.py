"""Config loading, presets, TP shard shapes and the errors that name what is wrong."""
from __future__ import annotations

import json

import pytest

from rewriter.model.config import PRESETS, ConfigError, KimiK3Config
from rewriter.model.layers import build_layer


def test_kimi_k3_preset_has_the_published_values(k3):
    assert (k3.hidden_size, k3.num_hidden_layers, k3.num_attention_heads) == (7168, 93, 96)
    assert (k3.num_experts, k3.num_experts_per_token, k3.num_shared_experts) == (896, 16, 2)
    assert k3.routed_expert_hidden_size == 3584 and k3.mla_cache_entry == 576
    kinds = [k3.attention_kind(i) for i in range(93)]
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert [i + 1 for i, k in enumerate(kinds) if k == "mla"][-3:] == [88, 92, 93]
    assert (k3.layer_kind(0), k3.layer_kind(1), k3.layer_kind(3)) == ("dense", "kda", "mla")
    assert k3.num_attn_res_blocks == 8 and k3.unsupported_for_reference() == []


@pytest.mark.parametrize("tp,in_proj,expert,shared,heads", [
    (1, 49376, 3072, 6144, 96), (8, 6288, 384, 768, 12), (16, 3216, 256, 384, 6)])
def test_tp_shard_shapes(k3, tp, in_proj, expert, shared, heads):
    s = k3.shard(tp)
    assert s.in_proj_qkvgfab == in_proj
    assert s.expert_intermediate == expert  # TP16: 192 real rows padded to 256, as vLLM does
    assert s.shared_intermediate == shared and s.kda_heads == heads and s.mla_heads == heads
    assert s.qkv_a_g == 1536 + 512 + 64 + heads * 128


def test_tp16_expert_padding_keeps_real_width(k3):
    assert k3.shard(16).expert_intermediate_unpadded == 192


def test_every_preset_loads():
    for name in PRESETS:
        cfg = KimiK3Config.preset(name)
        assert cfg.name == name and cfg.num_hidden_layers > 0


def test_loads_published_and_bare_files(tmp_path, k3):
    from importlib import resources
    published = json.loads(resources.files("rewriter.model.configs").joinpath("kimi-k3.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert KimiK3Config.load(str(tmp_path)).hidden_size == 7168  # a folder holding config.json
    (tmp_path / "text.json").write_text(json.dumps(published["text_config"]))
    bare = KimiK3Config.load(str(tmp_path / "text.json"))
    assert bare.replace(name="kimi-k3") == k3


def _text():
    from importlib import resources
    return json.loads(resources.files("rewriter.model.configs").joinpath("kimi-k3.json").read_text())["text_config"]


@pytest.mark.parametrize("mutate,message", [
    (lambda t: t.pop("hidden_size"), "missing field hidden_size"),
    (lambda t: t.update(hidden_size="7168"), "field hidden_size must be int, got '7168'"),
    (lambda t: t.update(num_experts=0), "field num_experts must be positive, got 0"),
    (lambda t: t.update(hidden_act="gelu"), "field hidden_act must be 'situ' or 'silu', got 'gelu'"),
    (lambda t: t["linear_attn_config"].pop("head_dim"), "missing field linear_attn_config.head_dim"),
    (lambda t: t["linear_attn_config"].update(gate_lower_bound=-7.0), "gate_lower_bound must be in [-5, 0), got -7.0"),
    (lambda t: t["linear_attn_config"]["kda_layers"].remove(1), "layers [1] are in neither"),
    (lambda t: t.update(num_experts_per_token=1000), "num_experts_per_token (1000) exceeds num_experts (896)"),
    (lambda t: t.update(model_type="llama"), "model_type must be 'kimi_linear', got 'llama'"),
    # a zero vocabulary, or a float that is NaN or infinite (a JSON file may hold NaN and Infinity)
    (lambda t: t.update(vocab_size=0), "field vocab_size must be positive, got 0"),
    (lambda t: t.update(rms_norm_eps=float("nan")), "field rms_norm_eps must be a finite number, got nan"),
    (lambda t: t.update(rms_norm_eps=float("inf")), "field rms_norm_eps must be a finite number, got inf"),
    (lambda t: t.update(routed_scaling_factor=float("inf")),
     "field routed_scaling_factor must be a finite number, got inf"),
    (lambda t: t.update(routed_scaling_factor=float("nan")),
     "field routed_scaling_factor must be a finite number, got nan"),
    (lambda t: t.update(activation_situ_linear_beta=float("-inf")),
     "field activation_situ_linear_beta must be a finite number, got -inf"),
    (lambda t: t.update(activation_situ_beta=10 ** 400), "field activation_situ_beta must be a finite number"),
    (lambda t: t["linear_attn_config"].update(gate_lower_bound=float("nan")),
     "field linear_attn_config.gate_lower_bound must be a finite number, got nan"),
])
def test_bad_fields_are_named(mutate, message):
    t = _text()
    mutate(t)
    with pytest.raises(ConfigError) as e:
        KimiK3Config.from_dict(t, name="bad.json")
    assert message in str(e.value) and "bad.json" in str(e.value)


def test_bad_files_and_names(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'kimi-k4'"):
        KimiK3Config.preset("kimi-k4")
    with pytest.raises(ConfigError, match="neither a preset"):
        KimiK3Config.load(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KimiK3Config.load(str(tmp_path / "broken.json"))
    with pytest.raises(ConfigError, match="must be Kimi K3"):
        KimiK3Config.from_dict({"model_type": "other", "text_config": _text()})


@pytest.mark.parametrize("tp,message", [
    (5, "TP size 5 does not divide linear_attn_config.num_heads (96)"),
    (64, "TP size 64 does not divide linear_attn_config.num_heads (96)"),
    (0, "TP size must be a positive int, got 0"),
])
def test_bad_tp_is_named(k3, tp, message):
    with pytest.raises(ConfigError) as e:
        k3.shard(tp)
    assert message in str(e.value)


def test_layer_index_errors_name_the_range(k3):
    with pytest.raises(ConfigError, match=r"layer 93 out of range: kimi-k3 has layers 0\.\.92"):
        k3.layer_kind(93)
    with pytest.raises(ConfigError, match="layer -1 out of range"):
        build_layer(k3, -1)


def test_kimi_linear_layers_are_refused_with_every_reason():
    cfg = KimiK3Config.preset("kimi-linear-48b")
    assert cfg.shard(8).kda_heads == 4  # the config itself is fine
    with pytest.raises(ConfigError) as e:
        build_layer(cfg, 1)
    for reason in ("use_full_rank_gate is false", "q_lora_rank is null", "no latent MoE", "no AttnRes"):
        assert reason in str(e.value)


def test_one_rank_of_is_a_tp1_model_with_one_ranks_shapes(k3):
    for tp in (8, 16):
        one, rank = k3.one_rank_of(tp).shard(1), k3.shard(tp)
        for field in ("kda_heads", "kda_projection", "in_proj_qkvgfab", "mla_heads", "qkv_a_g",
                      "shared_intermediate", "dense_intermediate", "expert_intermediate_unpadded"):
            assert getattr(one, field) == getattr(rank, field), (tp, field)
    with pytest.raises(ConfigError):
        k3.one_rank_of(7)


def test_nan_and_infinity_in_the_file_are_refused(tmp_path):
    text = json.dumps(_text()).replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN')
    assert "NaN" in text
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="field rms_norm_eps must be a finite number, got nan"):
        KimiK3Config.load(str(tmp_path))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(json.dumps(_text()).encode("utf-16"))
    with pytest.raises(ConfigError) as e:
        KimiK3Config.load(str(path))
    assert str(e.value).startswith(f"{path}: not UTF-8 text") and "\n" not in str(e.value)


@pytest.mark.parametrize("mutate,first", [
    # 1000 layers, 93 of them listed: 907 in neither list
    (lambda t: t.update(num_hidden_layers=1000),
     "layers [94, 95, 96, 97, 98, 99, 100, 101, ... (907 in all)] are in neither"),
    # every KDA layer listed past the 93
    (lambda t: t["linear_attn_config"].update(kda_layers=[x + 1000 for x in t["linear_attn_config"]["kda_layers"]]),
     "linear_attn_config.kda_layers holds entries outside 1..93: [1001, 1002, 1003, 1005, 1006, 1007, 1009, 1010, "
     "... (69 in all)]"),
    (lambda t: t["linear_attn_config"].update(full_attn_layers=list(range(1, 94))),
     "layers [1, 2, 3, 5, 6, 7, 9, 10, ... (69 in all)] are in both"),
    (lambda t: t["linear_attn_config"].update(kda_layers="1," * 2000),
     "field linear_attn_config.kda_layers must be list, got '1,1,1,"),
])
def test_long_layer_lists_are_cut_short(mutate, first):
    """An error about a layer list names its first few entries and how many there are, on one
    short line (not thousands of numbers)."""
    t = _text()
    mutate(t)
    with pytest.raises(ConfigError) as e:
        KimiK3Config.from_dict(t, name="bad.json")
    assert first in str(e.value) and len(str(e.value)) < 300, str(e.value)[:400]
