"""The products template's launcher on the CPU: every kernel it calls gets the tensors its spec
says, in the slots the kernel reads them from. Each kernel is stood in for by the programs of its
spec run with torch (``codegen.lowered.interpret``) on exactly the tensors in its slots, so a
weight sliced at the wrong rank's rows, a part's input in another part's slot or an intermediate
read before it is written shows as a result unlike the reference, without a GPU."""
from __future__ import annotations

import pytest
import torch

from codegen.launchers.generated import MAX_INPUTS, MAX_OUTPUTS, PRODUCTS, part_slots, program_of, stages_of
from codegen.lowered import MXFP4, interpret
from conftest import rel_err
from rewriter.model.layers.experts import ExpertFormat
from rewriter.model.ops import collectives_excluded
from test_products_gpu import OWN_OPS, PROBES, _args

PRO_IN, WEIGHTS, EPI_IN, PRO_OUT, OUTS = 4, 4, 4, 2, 4  # the kernels' slots (codegen.launchers.generated)


def _as_input(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A slot's tensor as ``interpret`` takes a program input: a one-element scale is a statistic."""
    return t.reshape(1, 1) if kind == "stat" and t.dim() == 1 else t


def _put(out: torch.Tensor, value: torch.Tensor) -> None:
    out.copy_(value.reshape(out.shape))


def _rowwise(spec):
    program = program_of(spec)

    def fn(*slots):
        assert len(slots) == MAX_INPUTS + MAX_OUTPUTS
        ins, outs = slots[:len(program.inputs)], slots[MAX_INPUTS:MAX_INPUTS + len(program.outputs)]
        assert all(s is None for s in (*slots[len(program.inputs):MAX_INPUTS],
                                       *slots[MAX_INPUTS + len(program.outputs):]))
        for out, value in zip(outs, interpret(program, [_as_input(t, k) for t, (k, _) in
                                                        zip(ins, program.inputs, strict=True)]), strict=True):
            _put(out, value)
    return fn


def _products(spec):
    parts = stages_of(spec)
    gemm = spec.module == "product_gemm"

    def fn(*slots):
        if gemm:  # x, weights, epilogue inputs, outputs: the prologue only reads x
            assert len(slots) == 1 + WEIGHTS + EPI_IN + OUTS
            pins, ws, eins, qs, ys = slots[:1], slots[1:5], slots[5:9], (), slots[9:13]
        else:
            assert len(slots) == PRO_IN + WEIGHTS + EPI_IN + PRO_OUT + OUTS
            pins, ws, eins, qs, ys = slots[0:4], slots[4:8], slots[8:12], slots[12:14], slots[14:18]
        pro = parts[0].prologue
        pvals = interpret(pro, [_as_input(t, k) for t, (k, _) in zip(pins, pro.inputs)])
        results = [j for j, d in enumerate(parts[0].prologue_to) if d[0] == "result"]
        for q, j in zip(qs, results):
            _put(q, pvals[j])
        a = pvals[0].float()
        for p, st in enumerate(parts):
            w_slots = part_slots(parts, "weights", p)
            if st.weight_dtype == MXFP4:  # codes int32 [K/16, 2N] and scale bytes [K/32, N], product by product
                pairs = [(ws[w_slots[i]], ws[w_slots[i + 1]]) for i in range(0, len(w_slots), 2)]
                assert all(c.shape == (st.k // 16, 2 * st.n) and c.dtype == torch.int32 and
                           sc.shape == (st.k // 32, st.n) and sc.dtype == torch.uint8 for c, sc in pairs)
                rows = [ExpertFormat.parse(MXFP4).dequant(c, sc) for c, sc in pairs]
            else:
                rows = [ws[s] for s in w_slots]
                assert all(w.shape == (st.n, st.k) for w in rows)
            acc = [a @ w.float().t() for w in rows]
            reads = iter(part_slots(parts, "inputs", p))
            inputs = []
            for src, (kind, _) in zip(st.epilogue_from, st.epilogue.inputs, strict=True):
                if src[0] == "acc":
                    inputs.append(acc[src[1]])
                elif src[0] == "pro":
                    inputs.append(pvals[src[1]].float().reshape(-1, 1))
                else:
                    inputs.append(_as_input(eins[next(reads)], kind))
            for s, value in zip(part_slots(parts, "outputs", p), interpret(st.epilogue, inputs), strict=True):
                _put(ys[s], value)
    return fn


def stand_ins(specs):
    return tuple(_rowwise(s) if s.module == "rowwise" else _products(s) for s in specs)


def _check(op: str, args: list) -> None:
    with collectives_excluded():
        ref = getattr(torch.ops.k3f, op.split("::")[1])(*args)
        specs = PRODUCTS.make_specs(op, "sm_90a", args)
        assert not isinstance(specs, str), specs
        got = PRODUCTS.launch(stand_ins(specs), specs, args)
    ref, got = ([t] if torch.is_tensor(t) else list(t) for t in (ref, got))
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape, (op, g.dtype, r.dtype, g.shape, r.shape)
        assert torch.isfinite(g).all(), op
        assert rel_err(g, r) < 1e-2, (op, rel_err(g, r))


@pytest.mark.parametrize("name", PROBES)
@pytest.mark.parametrize("tokens", [1, 2, 17])
def test_the_launcher_hands_each_probes_kernels_their_tensors(name, tokens):
    """Every class of stage (hoisted prologues and the tail after a collective included), at the
    GEMV's one token and the GEMM's full and partial token tiles."""
    gen = torch.Generator().manual_seed(tokens * 7 + len(name))
    _check(f"k3f::products_probe_{name}", list(_args(name, tokens, "cpu", gen)))


@pytest.mark.parametrize("tokens", [1, 8])
def test_an_activation_read_from_a_wider_row_runs_at_its_stride(tokens):
    """A row-strided view (the op handed columns of a wider tensor) is taken: its stride goes in
    the specs and the run-time check passes it; a view strided along its last dim, or a weight
    that is not contiguous rows, is refused by name."""
    gen = torch.Generator().manual_seed(tokens)
    x, gate_up, down = _args("mlp", tokens, "cpu", gen)
    wide = torch.randn(tokens, 2 * x.shape[1], generator=gen).to(x.dtype)
    view = wide[:, :x.shape[1]]
    specs = PRODUCTS.make_specs("k3f::products_probe_mlp", "sm_90a", [view, gate_up, down])
    assert not isinstance(specs, str), specs
    assert specs[0].param_dict.get("x_stride", (specs[0].param_dict.get("pro_strides") or (0,))[0]) == 2 * x.shape[1]
    assert PRODUCTS.runtime_check([view, gate_up, down]) is None
    _check("k3f::products_probe_mlp", [view, gate_up, down])
    columns = wide[:, ::2]
    assert "strides (4096, 2)" in PRODUCTS.make_specs("k3f::products_probe_mlp", "sm_90a", [columns, gate_up, down])
    padded = torch.randn(gate_up.shape[0], 2 * gate_up.shape[1], generator=gen).to(x.dtype)[:, :gate_up.shape[1]]
    assert "a weight is contiguous" in PRODUCTS.make_specs("k3f::products_probe_mlp", "sm_90a", [x, padded, down])


@pytest.fixture(scope="module")
def kimi_k3():
    from rewriter.compiler.plan import install_host
    from rewriter.model.config import KimiK3Config

    install_host()
    return KimiK3Config.load("kimi-k3")


@pytest.mark.parametrize("tp,rank", [(16, 0), (16, 5), (16, 15), (8, 7)])
@pytest.mark.parametrize("tokens", [1, 8])
def test_each_rank_of_the_router_reads_its_own_rows(kimi_k3, tp, rank, tokens):
    """The router's op is handed both whole weights: the launcher slices the rank's rows
    (``weights_at``), the kernel is the same for every rank."""
    from rewriter.commands.bench_ops import _fused_calls, _materialized

    (op, fake, _), = _fused_calls(kimi_k3, OWN_OPS["router_down"], tp, tokens, "sm_90a", ["router_down"])
    args = _materialized(fake, torch.Generator().manual_seed(rank), "cpu")
    args[5] = rank
    _check(op, args)


@pytest.mark.parametrize("op,tp,tokens", [("kda_in_proj", 16, 1), ("kda_in_proj", 8, 8), ("mla_in_proj", 8, 8),
                                          ("mla_in_proj", 16, 64), ("shared_experts", 16, 1), ("dense_mlp", 16, 1),
                                          ("dense_mlp", 8, 64), ("dense_mlp", 1, 1)])
def test_kimi_k3s_own_ops_reach_their_kernels_slot_by_slot(kimi_k3, op, tp, tokens):
    """The input projections' four parts (MLA's at TP 8: four stages of one kernel), the MLPs'
    two stages through an intermediate, at the served shapes."""
    from rewriter.commands.bench_ops import _fused_calls, _materialized

    (name, fake, _), = _fused_calls(kimi_k3, OWN_OPS[op], tp, tokens, "sm_90a", [op])
    _check(name, _materialized(fake, torch.Generator().manual_seed(tp + tokens), "cpu"))


def test_a_stood_down_all_reduce_returns_the_kernels_partial_without_a_copy():
    """One GPU timing a TP 4 rank: the dense MLP's all-reduce is the identity, so the launcher
    returns the down stage's output as written (a copy would be one more kernel in every timed
    call, which the hand-written launchers do not launch)."""
    import patterns.dense_mlp  # noqa: F401  (defines k3f::dense_mlp)

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    gate_up = (torch.randn(128, 256, generator=gen) * 0.05).to(torch.bfloat16)
    down = (torch.randn(256, 64, generator=gen) * 0.05).to(torch.bfloat16)
    args = [x, gate_up, down, None, None, "tp", 4]
    written = []

    def recording(fn):
        def call(*slots):
            fn(*slots)
            written.extend(s.data_ptr() for s in slots if torch.is_tensor(s))
        return call

    with collectives_excluded():
        ref = torch.ops.k3f.dense_mlp(*args)
        specs = PRODUCTS.make_specs("k3f::dense_mlp", "sm_90a", args)
        assert not isinstance(specs, str), specs
        got = PRODUCTS.launch(tuple(recording(f) for f in stand_ins(specs)), specs, args)
    assert got.data_ptr() in written
    assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2
