"""``python -m rewriter bench-ops``: which fused ops it times, its table and its errors (the
timing itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from conftest import on_gpu
from rewriter.commands.bench_ops import OpRow, _fused_calls, _sides, render
from rewriter.commands.cli import main
from rewriter.model.config import KimiK3Config


@pytest.fixture(scope="module")
def cfg():
    from rewriter.compiler.plan import install_host

    install_host()
    return KimiK3Config.load("kimi-k3")


@pytest.mark.parametrize("tp,batch", [(16, 1), (8, 8), (16, 64)])
def test_the_ops_timed_are_those_with_hand_written_and_generated_kernels(cfg, tp, batch):
    """Kimi K3's shared experts; not the ops whose hand-written kernels went (the input
    projections, the router's two projections, the dense MLP) nor those
    whose references the lowering refuses (topk, the collective in the middle of o_proj)."""
    timed = {op for layer in (0, 1, 3) for op, fake, _ in _fused_calls(cfg, layer, tp, batch, "sm_90a", None)
             if _sides(op, "sm_90a", fake) is not None}
    assert timed == {"k3f::shared_experts"}


def test_the_generated_side_is_the_products_template_and_the_hand_written_side_is_not(cfg):
    (op, fake, _), = _fused_calls(cfg, 1, 16, 8, "sm_90a", ["shared_experts"])
    hand, generated = _sides(op, "sm_90a", fake)
    assert generated.kernel == "products" and generated.generated
    assert hand.kernel == "shared_experts_gemm" and not hand.generated


@pytest.mark.parametrize("tp", [16, 8])
def test_the_floor_counts_the_rows_of_a_weight_this_rank_reads(cfg, tp):
    """The router's op is handed both whole weights and reads its rank's rows: its floor is those
    rows (and the activation), not the arguments' bytes; an op handed its shard floors at it."""
    (_, fake, floor), = _fused_calls(cfg, 1, tp, 1, "sm_90a", ["router_down"])
    x, gate, down = fake[:3]
    rows = (gate.shape[0] + down.shape[0]) // tp
    assert rows * gate.shape[1] * 2 <= floor < rows * gate.shape[1] * 2 + 2 * x.numel() * 2 + (1 << 16)
    (_, fake, floor), = _fused_calls(cfg, 1, tp, 1, "sm_90a", ["shared_experts"])
    assert floor >= sum(a.numel() * a.element_size() for a in fake if isinstance(a, torch.Tensor) and a.dim() == 2
                        and min(a.shape) >= 64)


def test_the_table_gives_the_ratio_the_agreement_and_the_kernels():
    row = OpRow("shared_experts", 1, 16, 8, "a + b", "c + d", 10.0, 10.5, 4.0, 1.2e-3)
    text = render([row], "H100")
    assert row.ratio == pytest.approx(1.05)
    assert " 1.05 " in text and " 1e-03 " in text and "a + b; c + d" in text and "hand-written us" in text
    assert "hand-written us" not in render([row], "H100", head=False)
    # two sides that disagree, or a NaN, are marked where the time is read
    far, nan = (OpRow("dense_mlp", 0, 8, 1, "a", "b", 1.0, 1.0, 1.0, err) for err in (0.5, float("nan")))
    assert " 5e-01! " in render([far], "H100", head=False) and " NaN! " in render([nan], "H100", head=False)


@pytest.mark.parametrize("nan_first", [True, False])
def test_agreement_is_nan_where_either_side_has_a_nan(nan_first):
    """Whatever the order of the results, a NaN is never hidden behind a finite error."""
    from rewriter.commands.bench import agreement

    good, bad = torch.ones(4, 8), torch.ones(4, 8)
    bad[1, 2] = float("nan")
    outs = [bad, good] if nan_first else [good, bad]
    err = agreement(lambda x: [good, good], lambda x: outs, [torch.zeros(1)])
    assert err != err  # NaN
    assert agreement(lambda x: [good], lambda x: [good * 1.01], [torch.zeros(1)]) == pytest.approx(0.01)


@pytest.mark.parametrize("argv,named", [(["--layers", "93"], "--layers 93: the model has layers 0..92"),
                                        (["--tp", "0"], "--tp 0"), (["--batch", "65"], "--batch 65: decode batches"),
                                        (["--reps", "0"], "--reps 0"),
                                        (["--ops", "shared_expert"], "--ops shared_expert: not a fused op")])
def test_bad_arguments_get_one_line_before_any_gpu_work(capsys, argv, named):
    assert main(["bench-ops", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err


def test_without_a_gpu_it_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["bench-ops"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@on_gpu
def test_it_times_the_shared_experts_both_ways(capsys):
    """Both sides run and are timed (positive, finite); no claim on which is faster."""
    assert main(["bench-ops", "--layers", "1", "--tp", "16", "--batch", "8", "--ops", "shared_experts",
                 "--reps", "3", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 1 and rows[0]["op"] == "shared_experts"
    assert 0 < rows[0]["hand_us"] < 1e4 and 0 < rows[0]["generated_us"] < 1e4
    assert rows[0]["agree"] is not None and rows[0]["agree"] <= 2e-2  # the two sides compute the same
