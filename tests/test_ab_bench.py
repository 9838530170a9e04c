"""``examples/ab_bench.py``: the variant's files swapped in and back, the runs alternated, and the
paired report (on real ``bench --json`` runs of layer 1 from the H200, and on runs made here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "examples"))

import ab_bench  # noqa: E402
from compare_bench import CompareError  # noqa: E402

from rewriter.commands.variant import VariantError  # noqa: E402


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    root, variant = tmp_path / "repo", tmp_path / "variant"
    (root / "codegen").mkdir(parents=True)
    (root / "codegen" / "k.py").write_text("A")
    (variant / "codegen").mkdir(parents=True)
    (variant / "codegen" / "k.py").write_text("B")
    (variant / "extra.py").write_text("new")
    return root, variant


def test_the_variant_is_swapped_in_and_the_tree_put_back_even_on_error(tmp_path):
    root, variant = _tree(tmp_path)
    with pytest.raises(RuntimeError):
        with ab_bench.swapped_in(variant, root) as files:
            assert files == [Path("codegen/k.py"), Path("extra.py")]
            assert (root / "codegen" / "k.py").read_text() == "B" and (root / "extra.py").read_text() == "new"
            raise RuntimeError("a bench run failed")
    assert (root / "codegen" / "k.py").read_text() == "A" and not (root / "extra.py").exists()


def _run(us: dict, adds: dict | None = None, layer: int = 1) -> dict:
    """A bench --json run with one rewritten row per (tp, batch) in ``us``."""
    rows = [{"tp": tp, "batch": b, "path": "rewritten", "us": v,
             "timeline": [[name, 0.0, 1.0, a] for name, a in (adds or {}).get((tp, b), [])]}
            for (tp, b), v in us.items()]
    return {"device": "H200", "model": "kimi-k3", "layer": layer, "q": 1, "experts": "mxfp4", "context": 4096,
            "kv_cache_dtype": "bf16", "rows": rows}


def test_runs_alternate_a_then_b_with_the_variant_in_place(tmp_path):
    root, variant = _tree(tmp_path)
    seen = []

    def run(args):  # the figure depends on the file in place during the run
        seen.append((root / "codegen" / "k.py").read_text())
        return _run({(16, 1): 60.0 if seen[-1] == "A" else 58.0})

    a_runs, b_runs = ab_bench.alternate(variant, 3, ["--layer", "1"], run=run, root=root)
    assert seen == ["A", "B", "A", "B", "A", "B"]
    assert [r["rows"][0]["us"] for r in a_runs] == [60.0] * 3 and [r["rows"][0]["us"] for r in b_runs] == [58.0] * 3
    assert (root / "codegen" / "k.py").read_text() == "A"


def test_the_report_pairs_each_b_with_the_a_before_it():
    adds_a = {(16, 1): [("kda_core", 6.0), ("attn_res_norm", 3.9), ("attn_res_norm", 3.6)]}
    adds_b = {(16, 1): [("kda_core", 5.0), ("attn_res_norm", 3.9), ("attn_res_norm", 3.7)]}
    # a drifting machine: A and B both move up round by round, B always 1 to 2 us below its A
    a_runs = [_run({(16, 1): v}, adds_a) for v in (60.0, 64.0, 70.0)]
    b_runs = [_run({(16, 1): v}, adds_b) for v in (59.0, 62.0, 68.5)]
    text = ab_bench.report(a_runs, b_runs, min_delta=0.05)
    assert "A 60.0 64.0 70.0 (median 64.0), B 59.0 62.0 68.5 (median 62.0)" in text
    assert "B - A, paired: median -1.5 us, 3 of 3 rounds lower" in text
    assert "| kda_core | 6.0 | 5.0 | -1.0 |" in text and "| attn_res_norm #2 | 3.6 | 3.7 | +0.1 |" in text
    assert "(1 kernels moved by less than 0.05 us)" in text  # the first norm did not move


def test_the_report_on_real_runs_agrees_with_compare_bench():
    before = json.loads((DATA / "bench_layer1_64row_router.json").read_text())
    after = json.loads((DATA / "bench_layer1_32row_router.json").read_text())
    text = ab_bench.report([before, before], [after, after])
    assert "TP 16 batch 64 rewritten: A 301.9 301.9" in text and "paired: median +10.2 us, 0 of 2 rounds lower" in text


def test_runs_that_cannot_be_paired_are_refused(tmp_path):
    with pytest.raises(CompareError, match="pairs are needed"):
        ab_bench.report([_run({(16, 1): 60.0})], [])
    with pytest.raises(CompareError, match="differ in layer"):
        ab_bench.report([_run({(16, 1): 60.0})], [_run({(16, 1): 60.0}, layer=3)])
    with pytest.raises(VariantError, match="no files"):
        (tmp_path / "empty").mkdir()
        ab_bench.variant_files(tmp_path / "empty")


def test_bad_runs_are_refused_before_any_bench(capsys, tmp_path):
    assert ab_bench.main(["run", str(tmp_path / "missing"), "--", "--layer", "1"]) == 2
    assert "not a directory of replacement files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_bench.main(["run", str(tmp_path), "--", "--layer", "1", "--json"])
    assert "leave --json out" in capsys.readouterr().err


def test_its_options_go_before_the_bench_arguments_wherever_the_variant_is(tmp_path, monkeypatch, capsys):
    """``run VARIANT --rounds 3 -- ...`` (as the docstring shows) and ``run --rounds 3 VARIANT -- ...``
    both take 3 rounds and hand bench only what follows ``--`` (an A/B that handed bench
    ``--rounds 2 -- ...`` failed every run)."""
    (tmp_path / "codegen").mkdir()
    (tmp_path / "codegen" / "x.py").write_text("")
    seen = []
    monkeypatch.setattr(ab_bench, "alternate", lambda variant, rounds, bench_args: seen.append((rounds, bench_args))
                        or ([_run({(16, 1): 60.0})], [_run({(16, 1): 59.0})]))
    for argv in (["run", str(tmp_path), "--rounds", "3", "--", "--layer", "1"],
                 ["run", "--rounds", "3", str(tmp_path), "--", "--layer", "1"]):
        assert ab_bench.main(argv) == 0
    assert seen == [(3, ["--layer", "1"])] * 2
    assert "B - A, paired: median -1.0 us" in capsys.readouterr().out


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's git history")
def test_snapshot_writes_a_revisions_files_at_their_paths(tmp_path, capsys):
    assert ab_bench.main(["snapshot", "HEAD", "examples/ab_bench.py", "--into", str(tmp_path / "v")]) == 0
    import subprocess
    head = subprocess.run(["git", "show", "HEAD:examples/ab_bench.py"], cwd=ROOT, capture_output=True, check=True)
    assert (tmp_path / "v" / "examples" / "ab_bench.py").read_bytes() == head.stdout
    assert ab_bench.main(["snapshot", "no-such-revision", "README.md", "--into", str(tmp_path / "w")]) == 2
    assert "git show no-such-revision:README.md" in capsys.readouterr().err
