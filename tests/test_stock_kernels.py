"""The stock-kernel table: complete over REGIONS, consistent, and matching docs/STOCK_KERNELS.md."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rewriter.compiler.stock_kernels import (
    LAYER_REGIONS,
    STOCK_SOURCES,
    StockKernel,
    default_kernels,
    layer_kernels,
    stock_kernels,
)
from rewriter.model.regions import REGIONS

ARCHES = ("sm_90a", "sm_100a", "sm_103a")
TPS = (1, 8, 16)
TOKENS = (1, 8, 64)
DOC = Path(__file__).resolve().parents[1] / "docs" / "STOCK_KERNELS.md"

# The headline number: one KDA + latent-MoE layer, TP16, batch 1, Blackwell (GB300 = sm_103a).
KDA_TP16_B1_BLACKWELL = 23


def _is_all_reduce(k: StockKernel) -> bool:
    name = k.name.lower()
    return "all-reduce" in name or "allreduce" in name or "all_reduce" in name


def test_every_region_has_a_row():
    assert set(STOCK_SOURCES) == set(REGIONS)  # both directions
    for region in REGIONS:
        assert region in STOCK_SOURCES, region
        for arch in ARCHES:
            for tp in TPS:
                kernels = stock_kernels(region, tp=tp, tokens=1, arch=arch)
                assert isinstance(kernels, list)
                assert all(isinstance(k, StockKernel) for k in kernels)


def test_every_region_launches_something_somewhere():
    for region in REGIONS:
        assert any(stock_kernels(region, tp=tp, tokens=1, arch=arch) for tp in TPS for arch in ARCHES), region


def test_layer_regions_are_known_and_cover_regions():
    assert set(LAYER_REGIONS) == {"kda", "mla", "dense"}
    used = set()
    for kind, regions in LAYER_REGIONS.items():
        assert len(set(regions)) == len(regions), kind
        assert set(regions) <= set(REGIONS), kind
        # layer order follows REGIONS
        assert list(regions) == [r for r in REGIONS if r in regions], kind
        used |= set(regions)
    assert used == set(REGIONS)


def test_rows_name_their_vllm_source():
    for region in REGIONS:
        for arch in ARCHES:
            for tp in TPS:
                for tokens in TOKENS:
                    for k in stock_kernels(region, tp=tp, tokens=tokens, arch=arch):
                        assert k.name
                        assert k.source.endswith(".py") and not k.source.startswith(("/", "vllm/")), k
                        assert k.stream in ("main", "aux"), k


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_tp1_has_no_all_reduce(arch, tokens):
    for region in REGIONS:
        kernels = stock_kernels(region, tp=1, tokens=tokens, arch=arch)
        assert not any(_is_all_reduce(k) for k in kernels), (region, kernels)
    for region in ("attn.o_proj_all_reduce", "moe.tail_all_reduce", "mlp.all_reduce"):
        assert stock_kernels(region, tp=1, tokens=tokens, arch=arch) == []


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("tp", (8, 16))
def test_tp_gt_1_reduces(arch, tp):
    for region in ("attn.o_proj_all_reduce", "mlp.all_reduce", "moe.tail_all_reduce"):
        kernels = stock_kernels(region, tp=tp, tokens=1, arch=arch)
        assert kernels and all(_is_all_reduce(k) for k in kernels), region


def test_unknown_region_raises_naming_it():
    with pytest.raises(ValueError, match="moe.bogus"):
        stock_kernels("moe.bogus", tp=8, tokens=1, arch="sm_100a")


@pytest.mark.parametrize("arch", ["sm_80", "sm_120a", "gfx942", "", "sm_90x1", "hopper"])
def test_unknown_arch_raises_naming_it(arch):
    with pytest.raises(ValueError, match=re.escape(repr(arch))):
        stock_kernels("attn.o_proj", tp=8, tokens=1, arch=arch)


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "sm_100", "sm_100a", "sm_100f", "sm_103a"])
def test_arch_spellings_accepted(arch):
    assert stock_kernels("attn.o_proj", tp=8, tokens=1, arch=arch)


def test_bad_tp_and_tokens_raise():
    with pytest.raises(ValueError):
        stock_kernels("attn.o_proj", tp=5, tokens=1, arch="sm_100a")
    with pytest.raises(ValueError):
        stock_kernels("attn.o_proj", tp=8, tokens=0, arch="sm_100a")


def test_kda_moe_tp16_b1_blackwell_matches_doc():
    for arch in ("sm_100a", "sm_103a"):
        assert default_kernels(LAYER_REGIONS["kda"], tp=16, tokens=1, arch=arch) == KDA_TP16_B1_BLACKWELL
    text = DOC.read_text()
    m = re.search(r"KDA\+MoE layer at TP16, batch 1, on Blackwell[^\n]*?\*\*(\d+) kernels\*\*", text)
    assert m, "doc must state the KDA+MoE TP16 batch-1 Blackwell total"
    assert int(m.group(1)) == KDA_TP16_B1_BLACKWELL


def test_doc_totals_table_matches_module():
    """Every 'kind | arch | TP | tokens | total' row in the doc's totals table is current."""
    text = DOC.read_text()
    rows = re.findall(r"^\|\s*(kda|mla|dense)\s*\|\s*(sm_\w+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|",
                      text, flags=re.MULTILINE)
    assert len(rows) >= 18
    for kind, arch, tp, tokens, total in rows:
        assert layer_kernels(kind, tp=int(tp), tokens=int(tokens), arch=arch) == int(total), (kind, arch, tp)


@pytest.mark.parametrize("arch", ("sm_90a", "sm_100a"))
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("kind", ("kda", "mla", "dense"))
def test_totals_positive_ints(kind, tp, tokens, arch):
    total = default_kernels(LAYER_REGIONS[kind], tp=tp, tokens=tokens, arch=arch)
    assert isinstance(total, int) and total > 0
    assert total == layer_kernels(kind, tp=tp, tokens=tokens, arch=arch)


def test_default_kernels_counts_distinct_regions():
    regs = ["attn_res.pre_attn", "kda.core", "kda.core", "attn_res.pre_attn"]
    assert default_kernels(regs, tp=16, tokens=1, arch="sm_100a") == default_kernels(
        regs[:2], tp=16, tokens=1, arch="sm_100a")
    assert default_kernels(iter(regs), tp=16, tokens=1, arch="sm_100a") == 5  # 1 AttnRes + 4 Triton KDA


def test_source_backed_conditions():
    # KDA: the native fused decode needs 12/24/48/96 local heads; TP16 leaves 6 -> Triton path.
    assert len(stock_kernels("kda.core", tp=8, tokens=1, arch="sm_100a")) == 1
    assert len(stock_kernels("kda.core", tp=16, tokens=1, arch="sm_100a")) == 4
    assert len(stock_kernels("kda.core", tp=16, tokens=1, arch="sm_90a")) == 4
    # TP8 KDA projection overlap splits in_proj in two for M <= 14.
    assert len(stock_kernels("kda.in_proj", tp=8, tokens=14, arch="sm_103a")) == 2
    assert len(stock_kernels("kda.in_proj", tp=8, tokens=15, arch="sm_103a")) == 1
    assert len(stock_kernels("kda.in_proj", tp=16, tokens=1, arch="sm_103a")) == 1
    # Fused latent-MoE tail only on Blackwell at TP 8/16 for <= 128 tokens, finalize deferred into it.
    for tp in (8, 16):
        assert len(stock_kernels("moe.tail_all_reduce", tp=tp, tokens=1, arch="sm_100a")) == 1
        assert len(stock_kernels("moe.experts", tp=tp, tokens=1, arch="sm_100a")) == 3
        assert len(stock_kernels("moe.experts", tp=tp, tokens=129, arch="sm_100a")) == 4
    assert len(stock_kernels("moe.experts", tp=1, tokens=1, arch="sm_100a")) == 4
    assert len(stock_kernels("moe.tail_all_reduce", tp=8, tokens=1, arch="sm_90a")) == 2
    # MLA: g_proj on the aux stream below 512 tokens; Hopper FA3 adds a combine kernel.
    assert [k.stream for k in stock_kernels("mla.qkv_a_g_proj", tp=16, tokens=1, arch="sm_100a")] == ["main", "aux"]
    assert len(stock_kernels("mla.decode", tp=16, tokens=1, arch="sm_90a")) == 2
    assert len(stock_kernels("mla.decode", tp=16, tokens=1, arch="sm_100a")) == 1


def test_blackwell_counts_do_not_depend_on_sm100_vs_sm103():
    for kind in LAYER_REGIONS:
        for tp in TPS:
            for tokens in (1, 2, 5, 8, 14, 16, 17, 64):
                assert layer_kernels(kind, tp=tp, tokens=tokens, arch="sm_100a") == layer_kernels(
                    kind, tp=tp, tokens=tokens, arch="sm_103a")
