"""``rewriter.commands.variant`` and ``bench --variant``: kernel sources swapped in for a while and read
again by the same process (a real kernel compiled from each version, with CuTe DSL), the tree put
back, the refusals; the alternated timing and its paired difference."""
from __future__ import annotations

import sys

import pytest

import patterns.mla  # noqa: F401  (defines the k3f ops used here)
from codegen import bind
from conftest import needs_cutedsl, on_gpu
from rewriter.commands.bench import alternated_us, paired_difference
from rewriter.commands.cli import main
from rewriter.commands.variant import ROOT, VariantError, kernel_sources_swapped, kernel_variant_files

MLA_ATTEND = "codegen/kernels/mla_attend.py"
SECOND_FENCE = "            cute.arch.fence_acq_rel_gpu()  # every CTA's writes before this CTA's reads\n"


def _variant(tmp_path, rel=MLA_ATTEND, edit=lambda s: s.replace(SECOND_FENCE, "")):
    """A variant directory holding ``rel`` edited; returns it and the tree's own bytes."""
    own = (ROOT / rel).read_bytes()
    edited = edit(own.decode())
    assert edited != own.decode()
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(edited)
    return tmp_path, own


def test_only_kernel_sources_are_taken(tmp_path):
    for rel in ("codegen/launchers/gemm_specs.py", "rewriter/commands/bench.py", "codegen/kernels/notes.txt"):
        d = tmp_path / rel.replace("/", "_")
        (d / rel).parent.mkdir(parents=True)
        (d / rel).write_text("x")
        with pytest.raises(VariantError, match="not kernel sources.*ab_bench"):
            kernel_variant_files(d)
    with pytest.raises(VariantError, match="not a directory"):
        kernel_variant_files(tmp_path / "missing")


def test_the_tree_and_the_loaded_kernels_come_back_even_on_error(tmp_path):
    from codegen.bind import TemplateLauncher

    variant, own = _variant(tmp_path)
    launcher = TemplateLauncher("mla_attend", "sm_90a")
    bind.register_cuda_impl("mla_attend", launcher, allow_without_cuda=True)
    try:
        launcher._fns[("a spec",)] = ("a loaded kernel",)
        import codegen.kernels  # noqa: F401  (the package stays; its modules are dropped)

        sys.modules["codegen.kernels.fake_loaded"] = sys  # stands for a kernel module imported earlier
        with pytest.raises(RuntimeError):
            with kernel_sources_swapped(variant) as files:
                assert [str(f) for f in files] == [MLA_ATTEND]
                assert (ROOT / MLA_ATTEND).read_text() == (variant / MLA_ATTEND).read_text()
                assert "codegen.kernels.fake_loaded" not in sys.modules and not launcher._fns
                assert "codegen.kernels" in sys.modules
                launcher._fns[("b spec",)] = ("the variant's kernel",)
                raise RuntimeError("a capture failed")
        assert (ROOT / MLA_ATTEND).read_bytes() == own
        assert not launcher._fns  # the variant's kernel is not served after the block
    finally:
        bind.unregister_cuda_impl("mla_attend")


@needs_cutedsl
def test_a_variant_compiles_from_its_own_source_in_the_same_process(tmp_path, kcache):
    """mla_attend without its grid barriers' second fences: the compile inside the block has 2
    ``fence.acq_rel.gpu`` where the tree's has 4, and the tree's again after it."""
    import torch

    from codegen.compiler import cache_key, compile_kernel
    from test_kernels_mla_attend import attend_args, attend_spec

    spec = attend_spec("sm_90a", attend_args(1, 6, cache_dtype=torch.bfloat16))
    tree_key = cache_key(spec)
    assert compile_kernel(spec, cache=kcache).ptx.count("fence.acq_rel.gpu") == 4
    variant, _ = _variant(tmp_path / "variant")
    with kernel_sources_swapped(variant):
        assert cache_key(spec) != tree_key
        assert compile_kernel(spec, cache=kcache).ptx.count("fence.acq_rel.gpu") == 2
    assert cache_key(spec) == tree_key
    assert compile_kernel(spec, cache=kcache).ptx.count("fence.acq_rel.gpu") == 4


def test_replays_alternate_in_turned_pairs():
    order = []

    def timed(run):
        order.append(run())
        return {"A": 60.0, "B": 58.0}[order[-1]] + len(order) * 0.01  # a drift the pairing cancels

    a, b = alternated_us(lambda: "A", lambda: "B", 4, timed=timed)
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert len(a) == len(b) == 4
    diff, q1, q3, lower = paired_difference(a, b)
    assert diff == pytest.approx(-2.0, abs=0.02) and q1 <= diff <= q3 and lower == 4


def test_the_paired_difference_is_the_median_of_the_pairs():
    diff, q1, q3, lower = paired_difference([10.0, 10.0, 10.0, 10.0, 10.0], [9.0, 11.0, 10.5, 30.0, 9.5])
    assert diff == 0.5 and (q1, q3) == (-0.5, 1.0) and lower == 2  # one slow replay (30) moves nothing
    with pytest.raises(ValueError, match="pairs are needed"):
        paired_difference([1.0], [])


def test_bench_refuses_a_variant_it_cannot_time(capsys, tmp_path):
    variant, _ = _variant(tmp_path / "ok")
    assert main(["bench", "--variant", str(variant), "--paths", "eager"]) == 2
    assert "keep 'rewritten' in --paths" in capsys.readouterr().err
    bad = tmp_path / "bad" / "codegen" / "launchers"
    bad.mkdir(parents=True)
    (bad / "o_proj.py").write_text("x")
    assert main(["bench", "--variant", str(tmp_path / "bad")]) == 2
    assert "codegen/launchers/o_proj.py not kernel sources" in capsys.readouterr().err


@on_gpu
def test_bench_times_a_variant_beside_the_tree_in_one_process(capsys, tmp_path):
    """Layer 1 at TP 16, one token, with the AttnRes norm's source edited (a comment: another
    cache key, the same kernel): a ``rewritten`` and a ``variant`` row, the same kernels, the
    paired difference in the variant's row, and the tree's file as it was."""
    import json
    import xml.etree.ElementTree as ET

    own = (ROOT / "codegen/kernels/attn_res_norm.py").read_bytes()
    variant, _ = _variant(tmp_path, "codegen/kernels/attn_res_norm.py", lambda s: s + "# a variant\n")
    argv = ["bench", "--layer", "1", "--tp", "16", "--batch", "1", "--paths", "rewritten", "--reps", "4",
            "--copies", "2", "--layers-per-replay", "2", "--variant", str(variant), "--json",
            "--svg", str(tmp_path / "layer1.svg")]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    # both rows' replay timelines drawn: a bar per kernel of each (bench --svg)
    bars = [r for r in ET.parse(tmp_path / "layer1.svg").getroot().iter("{http://www.w3.org/2000/svg}rect")
            if r.get("class") == "kernel"]
    assert len(bars) == sum(len(r["timeline"]) for r in rows) >= 24
    assert [r["path"] for r in rows] == ["rewritten", "variant"]
    assert rows[0]["kernels"] == rows[1]["kernels"] == 12 and "reference ran" not in rows[1]["note"]
    assert "4 paired replays" in rows[1]["note"] and isinstance(rows[1]["paired_diff_us"], float)
    assert (ROOT / "codegen/kernels/attn_res_norm.py").read_bytes() == own
