"""The plugin on vLLM 0.33.0's REAL Kimi K3 model objects, on a CPU (``tests/vllm_model.py``):
the loaded ``KimiLinearForCausalLM`` with bf16 and MXFP4 routed experts, vLLM's own KV cache and
KDA state as its CPU model runner allocates and binds them, and decode metadata from vLLM's own
builders. Binding by name, per-layer programs, one decode step against the reference layers,
one speculative verify step (3 tokens drafted) against q one-token steps of them, binding and
layout refusals, the step guard, per-layer fallback and TP agreement.

vLLM's stock layer forward cannot run on a CPU (Triton kernels): where a test needs a layer on
the stock path to compute, that vLLM layer's ``forward`` is stood in for by its bound reference
layer, called with vLLM's signature."""
from __future__ import annotations

import functools
import importlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from conftest import rel_err  # noqa: E402
from rewriter.compiler.rewrite import is_fused  # noqa: E402
from rewriter.model.config import KimiK3Config  # noqa: E402
from rewriter.model.layers import KimiDecoderLayer  # noqa: E402
from rewriter.vllm.experts import ExpertLayoutError, served_expert_format  # noqa: E402
from rewriter.vllm.guard import KV_CACHE_DTYPES, decide_step  # noqa: E402
from rewriter.vllm.programs import ProgramError, ProgramSet, bind_layer, build_programs  # noqa: E402
from rewriter.vllm.runtime import run_layers, stage_inputs  # noqa: E402
from rewriter.vllm.state import cache_tensors, layer_name, state_inputs  # noqa: E402
from vllm_model import (  # noqa: E402
    VERIFY_NUM_BLOCKS,
    DecodeBatch,
    bind_caches,
    build_loaded,
    decode_context,
    decoder_layers,
    prepare_decode,
    text_config,
)

B = 4  # the decode batch: vllm_model.SEQ_LENS, one new token per request
ARCH = "sm_90a"
TOL = 2e-2  # bf16 activations
EXPERTS = {None: "bf16", "mxfp4": "mxfp4/checkpoint"}


def _no_compile(result, rows):
    """On a CPU the fused ops run their reference implementations: nothing to compile."""


def _quiet(line: str) -> None:
    pass


@dataclass
class Served:
    """One loaded real model with its caches bound and a decode step's metadata built."""

    quant: str | None
    model: torch.nn.Module
    vllm_config: Any
    cfg: KimiK3Config
    layers: list[torch.nn.Module]
    runner: Any
    batch: DecodeBatch

    @functools.cached_property
    def programs(self) -> ProgramSet:
        return build_programs(self.layers, self.cfg, tp=1, rank=0, arch=ARCH, batches=(B,), compile_fn=_no_compile,
                              progress=_quiet, kv_cache_dtype=self.kv_cache_dtype)

    @property
    def kv_cache_dtype(self) -> str:
        return KV_CACHE_DTYPES[self.vllm_config.cache_config.cache_dtype]

    def bind(self) -> list[KimiDecoderLayer]:
        return [bind_layer(layer, self.cfg, layer.layer_idx, 1, 0) for layer in self.layers]

    @property
    def num_attn_res_blocks(self) -> int:
        return self.model.model.num_attn_res_blocks


def _serve(quant: str | None, kv_cache_dtype: str = "auto") -> Served:
    model, vc = build_loaded(quant, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype != "auto":  # a checkpoint's scale, as loaded: not 1, so a kernel ignoring it would show
        for layer in decoder_layers(model):
            if hasattr(layer.self_attn, "_k_scale"):
                layer.self_attn._k_scale.fill_(0.37)
    runner = bind_caches(model, vc)
    return Served(quant, model, vc, text_config(vc), decoder_layers(model), runner, prepare_decode(runner))


@pytest.fixture(scope="module")
def bf16() -> Served:
    return _serve(None)


@pytest.fixture(scope="module")
def mxfp4() -> Served:
    return _serve("mxfp4")


@pytest.fixture(scope="module")
def fp8_cache() -> Served:
    """bf16 experts, the MLA latent cache fp8 E4M3 (--kv-cache-dtype fp8)."""
    return _serve(None, "fp8")


@pytest.fixture(scope="module", params=["bf16", "mxfp4", "fp8_cache"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


# ---- caches: vLLM's own views, filled, snapshot, compared --------------------------------------------
def _views(layer) -> tuple[torch.Tensor, ...]:
    """The layer's cache tensors exactly as vLLM bound them (KDA: conv, recurrent; MLA: latent)."""
    kv = layer.self_attn.kv_cache
    return tuple(kv[:2]) if isinstance(kv, (tuple, list)) else (kv,)


def _kda_slots(layer, batch: DecodeBatch) -> torch.Tensor:
    return batch.attn_metadata[layer_name(layer.self_attn)].non_spec_state_indices_tensor[:B].long()


def _mla_blocks(layer, batch: DecodeBatch) -> torch.Tensor:
    """The blocks the decode step's requests hold (as vLLM's block table lists them)."""
    decode = batch.attn_metadata[layer_name(layer.self_attn)].decode
    size = layer.self_attn.kv_cache.shape[1]
    held = [decode.block_table[r, :(int(n) + size - 1) // size] for r, n in enumerate(decode.seq_lens)]
    return torch.cat(held).long()


def _inserted(layer, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of the entries this step inserts into an MLA layer's latent cache."""
    slots = batch.slot_mapping[layer_name(layer.self_attn)][:B].long()
    size = layer.self_attn.kv_cache.shape[1]
    return slots // size, slots % size


def _is_kda(layer) -> bool:
    return isinstance(layer.self_attn.kv_cache, (tuple, list))


def _fill_caches(served: Served, seed: int) -> None:
    """Seeded random values in every cache entry the step reads (never test on zeros)."""
    g = torch.Generator().manual_seed(seed)
    for layer in served.layers:
        if _is_kda(layer):
            conv, recurrent = _views(layer)
            slots = _kda_slots(layer, served.batch)
            conv[slots] = torch.randn(conv[slots].shape, generator=g).to(conv.dtype)
            recurrent[slots] = 0.1 * torch.randn(recurrent[slots].shape, generator=g)
        else:
            (kv,) = _views(layer)
            blocks = _mla_blocks(layer, served.batch)
            values = torch.randn(kv[blocks].shape, generator=g)
            if kv.dtype == torch.uint8:  # vLLM's fp8 cache: E4M3 of value / _k_scale
                values = (values / layer.self_attn._k_scale).to(torch.float8_e4m3fn).view(torch.uint8)
            kv[blocks] = values.to(kv.dtype)


def _snapshot(served: Served) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(v.clone() for v in _views(layer)) for layer in served.layers]


def _restore(served: Served, saved: list[tuple[torch.Tensor, ...]]) -> None:
    for layer, values in zip(served.layers, saved):
        for view, value in zip(_views(layer), values):
            view.copy_(value)


def _touched(served: Served, caches: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    """What a decode step writes, read from cache copies: KDA states of the used slots, MLA entries
    inserted."""
    out = {}
    for layer, values in zip(served.layers, caches):
        i = layer.layer_idx
        if _is_kda(layer):
            slots = _kda_slots(layer, served.batch)
            out[f"layer {i} conv state"], out[f"layer {i} recurrent state"] = (v[slots] for v in values)
        else:
            block, offset = _inserted(layer, served.batch)
            out[f"layer {i} latent entries"] = values[0][block, offset]
    return out


def _reference_step(served: Served, refs: list[KimiDecoderLayer], x: torch.Tensor, context: Any):
    """vLLM's backbone loop (KimiLinearModel.forward with AttnRes) over the bound reference layers."""
    return _reference_layers(served, refs, x, x.new_empty(x.shape[0], served.num_attn_res_blocks, x.shape[1]),
                             context)


def _reference_layers(served: Served, refs: list[KimiDecoderLayer], prefix: torch.Tensor, blocks: torch.Tensor,
                      context: Any, aux: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layers in turn; ``aux`` gets the AttnRes stream (prefix sum + pending MLP output)
    entering each of the backbone's ``aux_hidden_state_layers`` after the first."""
    hidden = None
    for layer, ref in zip(served.layers, refs):
        hidden, prefix, blocks = ref(hidden if hidden is not None else prefix, prefix, blocks,
                                     *state_inputs(layer, context, prefix.shape[0]))
        if aux is not None and layer.layer_idx + 1 in served.model.model.aux_hidden_state_layers:
            aux.append(prefix + hidden)
    return hidden, prefix, blocks


def _written_blocks(cfg: KimiK3Config, num_layers: int) -> list[int]:
    """AttnRes blocks a step writes (the rest of the buffer is never read)."""
    return sorted({i // cfg.attn_res_block_size for i in range(num_layers) if i % cfg.attn_res_block_size == 0})


def _embeddings(seed: int) -> torch.Tensor:
    return torch.randn(B, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ---- 1. binding ------------------------------------------------------------------------------------
def test_every_layer_binds_to_vllms_tensors(served):
    theirs_by_layer = [dict(layer.named_parameters()) for layer in served.layers]
    kinds = []
    for layer, theirs in zip(served.layers, theirs_by_layer):
        ref = bind_layer(layer, served.cfg, layer.layer_idx, 1, 0)
        kinds.append((ref.attention_kind, ref.kind))
        assert ref.expert_format is None if ref.kind == "dense" else ref.expert_format.name == EXPERTS[served.quant]
        mine = dict(ref.named_parameters())
        assert mine, layer.layer_idx
        for name, p in mine.items():
            src = theirs[name]
            assert p is src, name  # the reference layer holds vLLM's parameter, not a copy
            assert (p.data_ptr(), tuple(p.shape), p.dtype) == (src.data_ptr(), tuple(src.shape), src.dtype), name
            assert not p.is_meta, name
    assert kinds[:3] == [("kda", "dense"), ("kda", "kda"), ("mla", "mla")]  # dense layer 0, KDA+MoE, MLA+MoE
    if served.quant == "mxfp4":
        routed = served.layers[1].block_sparse_moe.experts.routed_experts
        assert routed.w13_weight.dtype == torch.uint8 and routed.w13_weight_scale.dtype == torch.uint8


# ---- 2. programs ----------------------------------------------------------------------------------
def test_programs_for_every_layer(served):
    programs = served.programs
    assert programs.fallbacks == {}
    assert sorted(programs.programs) == [(layer.layer_idx, B) for layer in served.layers]
    for layer in served.layers:
        gm = programs.get(layer.layer_idx, B).runner.module
        fused = {n.target.name() for n in gm.graph.nodes if is_fused(n)}
        assert fused and all(op.startswith("k3f::") for op in fused), (layer.layer_idx, fused)
        theirs = dict(layer.named_parameters())
        weights = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
        assert weights, layer.layer_idx
        for name in weights:  # every weight the program reads is vLLM's tensor, by name, not a copy
            assert gm.get_parameter(name).data_ptr() == theirs[name].data_ptr(), (layer.layer_idx, name)


# ---- 3. one decode step on vLLM's caches and metadata ---------------------------------------------
def test_decode_step_matches_the_reference_layers(served):
    programs = served.programs
    _fill_caches(served, seed=11)
    before = _snapshot(served)
    x = _embeddings(seed=3)
    with decode_context(served.vllm_config, served.batch) as context:
        got = run_layers(served.layers, programs, served.batch.positions,
                         *stage_inputs(served.model.model, x.clone(), None), context)
    after_programs = _snapshot(served)
    _restore(served, before)
    with decode_context(served.vllm_config, served.batch) as context:
        want = _reference_step(served, served.bind(), x.clone(), context)
    after_reference = _snapshot(served)

    written = _written_blocks(served.cfg, len(served.layers))
    assert written == list(range(served.num_attn_res_blocks))
    for name, a, b in (("hidden", got[0], want[0]), ("prefix sum", got[1], want[1]),
                       ("AttnRes blocks", got[2][:, written], want[2][:, written])):
        assert torch.isfinite(a).all() and b.abs().max() > 0, name
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    old, new, ref = (_touched(served, c) for c in (before, after_programs, after_reference))
    for name in ref:
        assert not torch.equal(new[name], old[name]), f"{name}: the step did not write it"
        assert rel_err(new[name], ref[name]) < TOL, (name, rel_err(new[name], ref[name]))
    # vLLM's "SD" conv state holds the last inputs oldest first along dim 1: the step shifts it by one
    for layer in served.layers:
        if _is_kda(layer):
            i = layer.layer_idx
            assert torch.equal(new[f"layer {i} conv state"][:, :-1], old[f"layer {i} conv state"][:, 1:]), i
    # nothing else changed: blocks no request holds, and the MLA blocks' other entries
    held = torch.tensor(sorted({b for group in served.batch.block_ids for ids in group for b in ids}))
    free = torch.ones(served.runner.kv_cache_config.num_blocks, dtype=torch.bool)
    free[held] = False
    for layer, was, now in zip(served.layers, before, after_programs):
        assert all(torch.equal(a[free], b[free]) for a, b in zip(now, was)), layer.layer_idx
        if not _is_kda(layer):
            keep = torch.ones(was[0].shape[:2], dtype=torch.bool)
            keep[_inserted(layer, served.batch)] = False
            blocks = _mla_blocks(layer, served.batch)
            assert torch.equal(now[0][blocks][keep[blocks]], was[0][blocks][keep[blocks]]), layer.layer_idx


@pytest.mark.parametrize("stream_mode", [False, True], ids=["prefix", "attn_res_stream"])
def test_a_step_hands_dspark_the_aux_hidden_states_it_asks_for(bf16, monkeypatch, stream_mode):
    """DSpark and EAGLE-3 draft from the target's hidden states: vLLM sets the backbone's
    ``aux_hidden_state_layers``, its forward returns the AttnRes stream entering each of those
    layers beside the hidden state, and the V2 runner unpacks both from every captured step. The
    rewritten stage returns the same streams, taken by the backbone's own
    ``_capture_aux_hidden_stream``: the embeddings for layer 0, then the prefix sum plus the
    pending MLP output (vLLM's default), or with ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1`` the next
    layer's AttnRes mix over the blocks written so far; without aux layers, the hidden state
    alone."""
    from rewriter.vllm.runtime import run_stage
    from vllm_model import attn_res_in_torch

    monkeypatch.setenv("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM", str(int(stream_mode)))
    backbone, aux = bf16.model.model, (0, 2, 4)
    _fill_caches(bf16, seed=5)
    before = _snapshot(bf16)
    x = _embeddings(seed=8)
    with attn_res_in_torch(), decode_context(bf16.vllm_config, bf16.batch) as context:
        plain = run_stage(backbone, bf16.programs, bf16.batch.positions, x.clone(), None, context, last=True)
        _restore(bf16, before)
        monkeypatch.setattr(backbone, "aux_hidden_state_layers", aux)
        out, streams = run_stage(backbone, bf16.programs, bf16.batch.positions, x.clone(), None, context, last=True)
    assert isinstance(plain, torch.Tensor) and torch.equal(out, plain)
    _restore(bf16, before)
    want, hidden, prefix = [x], None, x.clone()
    blocks = x.new_empty(B, bf16.num_attn_res_blocks, x.shape[1])
    with attn_res_in_torch(), decode_context(bf16.vllm_config, bf16.batch) as context:
        for layer, ref in zip(bf16.layers, bf16.bind()):
            hidden, prefix, blocks = ref(hidden if hidden is not None else prefix, prefix, blocks,
                                         *state_inputs(layer, context, B))
            if layer.layer_idx + 1 in aux:  # the stream mode mixes the blocks as the next layer will
                want.append(backbone._capture_aux_hidden_stream(layer.layer_idx, prefix, hidden, blocks)
                            if stream_mode else prefix + hidden)
    assert len(streams) == len(want) == 3 and torch.equal(streams[0], x)
    for i, (a, b) in enumerate(zip(streams, want)):
        assert a.shape == (B, x.shape[1]) and rel_err(a, b) < TOL, (i, rel_err(a, b))


def test_a_step_padded_as_for_a_full_cuda_graph_leaves_the_real_rows_and_the_null_block_alone(bf16):
    """vLLM pads a FULL-graph step with requests whose KDA state index is 0 (its null block), MLA
    length 0 and slot -1 (its builders, read back here): the programs for the padded batch give the
    real requests what the unpadded step gives them, and write no cache entry of the null block
    or of any block no real request holds."""
    from vllm_model import prepare_decode

    padded = prepare_decode(bf16.runner, padded_to=B + 2)
    for layer in bf16.layers:
        m = padded.attn_metadata[layer_name(layer.self_attn)]
        if _is_kda(layer):
            assert m.non_spec_state_indices_tensor[B:B + 2].tolist() == [0, 0]
        else:
            assert m.decode.seq_lens[B:].tolist() == [0, 0]
            assert padded.slot_mapping[layer_name(layer.self_attn)][B:].tolist() == [-1, -1]
    programs = build_programs(bf16.layers, bf16.cfg, tp=1, rank=0, arch=ARCH, batches=(B + 2,),
                              compile_fn=_no_compile, progress=_quiet)
    _fill_caches(bf16, seed=12)
    before = _snapshot(bf16)
    x = _embeddings(seed=5)
    pad = torch.randn(2, x.shape[1], generator=torch.Generator().manual_seed(6)).to(x.dtype)
    with decode_context(bf16.vllm_config, padded) as context:
        got = run_layers(bf16.layers, programs, padded.positions_padded,
                         *stage_inputs(bf16.model.model, torch.cat([x, pad]), None), context)
    after_padded = _snapshot(bf16)
    _restore(bf16, before)
    with decode_context(bf16.vllm_config, bf16.batch) as context:
        want = run_layers(bf16.layers, bf16.programs, bf16.batch.positions,
                          *stage_inputs(bf16.model.model, x.clone(), None), context)
    after = _snapshot(bf16)
    for name, a, b in (("hidden", got[0][:B], want[0]), ("prefix sum", got[1][:B], want[1])):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    for layer, was, now, unpadded in zip(bf16.layers, before, after_padded, after):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(now, was)), layer.layer_idx  # the null block
        # entries no step wrote may hold anything, NaN included: compare where both are numbers
        assert all(rel_err(a.nan_to_num(), b.nan_to_num()) < TOL for a, b in zip(now, unpadded)), layer.layer_idx


def test_caches_are_vllms_layout_as_allocated(bf16):
    """vLLM's default conv state layout "SD": [slots, 3, dim] per slot, slots a page apart; the
    state readers hand the reference views of it, never copies."""
    layer = bf16.layers[1]
    conv, recurrent = _views(layer)
    assert conv.shape[1:] == (layer.self_attn.conv_size - 1, 3 * bf16.cfg.kda_num_heads * bf16.cfg.kda_head_dim)
    assert not conv.is_contiguous() and conv.stride(0) * 2 == recurrent.stride(0) * 4  # one page per slot
    with decode_context(bf16.vllm_config, bf16.batch) as context:
        kda_conv, kda_recurrent, indices = state_inputs(layer, context, B)
        kv, table, seq_lens, slots, kv_scale = state_inputs(bf16.layers[2], context, B)
    assert kda_conv.data_ptr() == conv.data_ptr() and kda_conv.shape == conv.transpose(-1, -2).shape
    assert kda_recurrent is recurrent
    assert torch.equal(indices.long(), _kda_slots(layer, bf16.batch))
    assert kv is bf16.layers[2].self_attn.kv_cache and kv.shape[-1] == 576  # kv_c 512 | k_pe 64
    assert seq_lens.tolist() == list(bf16.batch.seq_lens) and slots.shape == (B,)
    scale = bf16.layers[2].self_attn._k_scale
    assert kv_scale.shape == (1,) and kv_scale.data_ptr() == scale.data_ptr()  # its _k_scale, as a view


# ---- 4. binding and layout refusals -----------------------------------------------------------------
def test_a_binding_mismatch_keeps_the_layer_stock(served):
    routed = served.layers[1].block_sparse_moe.experts.routed_experts
    original = routed.w13_weight
    E, rows, k = original.shape
    if served.quant is None:  # bf16 experts where vLLM holds packed MXFP4 bytes
        wrong, want = torch.zeros(E, rows, k // 2, dtype=torch.uint8), f"({E}, {rows}, {k}) torch.bfloat16"
    else:  # MXFP4 codes where vLLM holds dense bf16 weights
        wrong, want = torch.zeros(E, rows, 2 * k, dtype=torch.bfloat16), f"({E}, {rows}, {k}) torch.uint8"
    routed.w13_weight = torch.nn.Parameter(wrong, requires_grad=False)
    try:
        programs = build_programs(served.layers[1:2], served.cfg, tp=1, rank=0, arch=ARCH, batches=(B,),
                                  compile_fn=_no_compile, progress=_quiet)
    finally:
        routed.w13_weight = original
    reason = programs.fallbacks[1]
    assert programs.programs == {}
    assert (f"block_sparse_moe.experts.routed_experts.w13_weight is {tuple(wrong.shape)} {wrong.dtype} in vLLM, "
            f"the reference layer ({EXPERTS[served.quant]} experts) takes {want}") in reason, reason


def test_served_expert_format_reads_vllms_backend(mxfp4, bf16):
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    routed = mxfp4.layers[1].block_sparse_moe.experts.routed_experts
    assert served_expert_format(routed).name == "mxfp4/checkpoint"
    assert routed.quant_method.mxfp4_backend is Mxfp4MoeBackend.NONE
    with mock.patch.object(routed.quant_method, "mxfp4_backend", Mxfp4MoeBackend.MARLIN):
        with pytest.raises(ExpertLayoutError, match="MARLIN MXFP4 MoE backend"):
            served_expert_format(routed)
        programs = build_programs(mxfp4.layers[1:2], mxfp4.cfg, tp=1, rank=0, arch=ARCH, batches=(B,),
                                  compile_fn=_no_compile, progress=_quiet)
        assert "MARLIN" in programs.fallbacks[1]
    assert routed.quant_method.mxfp4_backend is Mxfp4MoeBackend.NONE

    routed = bf16.layers[1].block_sparse_moe.experts.routed_experts
    assert served_expert_format(routed).name == "bf16"
    with mock.patch.object(routed.quant_method, "unquantized_backend", UnquantizedMoeBackend.FLASHINFER_CUTLASS):
        with pytest.raises(ExpertLayoutError, match="FLASHINFER_CUTLASS MoE backend"):
            served_expert_format(routed)
    assert routed.quant_method.unquantized_backend is UnquantizedMoeBackend.TRITON


def test_mxfp4_checkpoints_ask_vllm_for_humming(mxfp4, bf16, monkeypatch):
    """The plugin asks vLLM for the MoE backend whose layout the kernels read, decided from vLLM's
    own resolution of the checkpoint's quantization, and refuses backends it cannot read."""
    from rewriter.vllm.experts import HUMMING_INPUT_QUANT, moe_backend_refusal, select_moe_backend, serves_mxfp4

    assert serves_mxfp4(mxfp4.vllm_config) and not serves_mxfp4(bf16.vllm_config)
    kernel = mxfp4.vllm_config.kernel_config
    assert kernel.moe_backend == "auto"
    try:
        select_moe_backend(mxfp4.vllm_config)
        assert kernel.moe_backend == "humming" and moe_backend_refusal(mxfp4.vllm_config) is None
        select_moe_backend(bf16.vllm_config)
        assert bf16.vllm_config.kernel_config.moe_backend == "auto"  # bf16 experts: vLLM's choice stands
        kernel.moe_backend = "marlin"
        assert "MoE backend 'marlin' (--moe-backend)" in moe_backend_refusal(mxfp4.vllm_config)
        kernel.moe_backend = "humming"
        monkeypatch.setenv(HUMMING_INPUT_QUANT, '{"a_dtype": "float8e4m3"}')
        assert f"{HUMMING_INPUT_QUANT} is set" in moe_backend_refusal(mxfp4.vllm_config)
    finally:
        kernel.moe_backend = "auto"


def test_humming_layer_configs_pick_the_nibble_order():
    """``served_expert_format`` on a module Humming transformed: the nibble order from its layer
    configs' ``use_native_dequant``, anything but weight-only MXFP4 on bf16 refused by name. (The
    configs here carry the fields of humming's LayerConfig, which cannot be built without a GPU;
    tests/test_kernels_mxfp4.py checks real ones on the H200.)"""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    def configs(**changes):
        base = dict(a_dtype="bfloat16", b_dtype="float4e2m1", bs_dtype="float8e8m0", weight_scale_group_size=32,
                    use_fused_e8m0_scale=False, use_packed_k_layout=False, use_native_dequant=False, pad_shape_n=0,
                    pad_shape_k=0)
        return {"w13": SimpleNamespace(**base), "w2": SimpleNamespace(**{**base, **changes})}

    def module(cfgs):
        return SimpleNamespace(quant_method=SimpleNamespace(mxfp4_backend=Mxfp4MoeBackend.HUMMING),
                               humming_configs=cfgs)

    assert served_expert_format(module(configs())).name == "mxfp4/humming"
    native = configs(use_native_dequant=True)
    native["w13"].use_native_dequant = True
    assert served_expert_format(module(native)).name == "mxfp4/humming_native"
    for changes, reason in (({"a_dtype": "float8e4m3"}, "w2 config a_dtype=float8e4m3"),
                            ({"use_fused_e8m0_scale": True}, "use_fused_e8m0_scale=True"),
                            ({"pad_shape_k": 128}, "pad_shape_k=128"),
                            ({"use_native_dequant": True}, "different nibble orders")):
        with pytest.raises(ExpertLayoutError, match=re.escape(reason)):
            served_expert_format(module(configs(**changes)))
    with pytest.raises(ExpertLayoutError, match="without their layer configs"):
        served_expert_format(module(None))


# ---- 5. the step guard on the real forward context ----------------------------------------------------
def test_step_guard_on_the_real_decode_context(bf16):
    from vllm.config import CUDAGraphMode

    with decode_context(bf16.vllm_config, bf16.batch) as context:  # as vLLM's V2 runner captures a FULL graph
        assert context.cudagraph_runtime_mode == CUDAGraphMode.NONE
        assert context.attn_metadata is bf16.batch.attn_metadata
        assert decide_step(B, {1, 2, 4, 8}, True, context).reason == "pure decode"
        assert decide_step(B, {1, 2, 8}, True, context).reason == "4 tokens: no program built for this batch size"
        assert not decide_step(B, {4}, False, context).rewritten
    with decode_context(bf16.vllm_config, bf16.batch, mode=CUDAGraphMode.PIECEWISE) as context:
        assert decide_step(B, {4}, True, context).reason == "PIECEWISE CUDA graph"


# ---- bad weights, named at build ------------------------------------------------------------------------
@pytest.mark.parametrize("corrupt,reason", [
    (lambda w: torch.nn.Parameter(w[:-1].clone(), requires_grad=False), "self_attn.o_proj.weight is (63, "),
    (lambda w: torch.nn.Parameter(w.half(), requires_grad=False), "torch.float16 in vLLM"),
    (lambda w: torch.nn.Parameter(w.index_fill(0, torch.tensor([3]), float("nan")), requires_grad=False),
     "self_attn.o_proj.weight holds NaN or infinite values"),
])
def test_a_bad_weight_in_vllms_model_is_named_at_build(bf16, corrupt, reason):
    """A mis-shaped, mistyped or corrupted tensor in vLLM's loaded layer 1 keeps that layer on the
    stock forward with a reason that names the tensor; the other layers build."""
    attn = bf16.layers[1].self_attn
    good = attn.o_proj.weight
    attn.o_proj.weight = corrupt(good.data)
    try:
        programs = build_programs(bf16.layers, bf16.cfg, tp=1, rank=0, arch=ARCH, batches=(B,),
                                  compile_fn=lambda result, rows: None, progress=_quiet)
    finally:
        attn.o_proj.weight = good
    assert set(programs.fallbacks) == {1} and reason in programs.fallbacks[1]
    assert programs.fallbacks[1].startswith("parameters do not match the reference layer")
    assert {i for i, _ in programs.programs} == {0, 2, 3, 4, 5}


# ---- per-layer fallback ---------------------------------------------------------------------------------
def test_a_layer_whose_compile_fails_falls_back_alone(bf16):
    def compile_fn(result, rows):
        if result.before.layer == 2:
            raise ProgramError("kernel compile failed: forced for the test")

    programs = build_programs(bf16.layers, bf16.cfg, tp=1, rank=0, arch=ARCH, batches=(B,), compile_fn=compile_fn,
                              progress=_quiet)
    assert programs.fallbacks == {2: "kernel compile failed: forced for the test"}
    # layer 5 has layer 2's attention but not its AttnRes position (no block write): its own graph
    assert {i for i, _ in programs.programs} == {0, 1, 3, 4, 5}
    assert programs.programs[(1, B)].kernels == 9

    refs = bf16.bind()
    _fill_caches(bf16, seed=5)
    before = _snapshot(bf16)
    x = _embeddings(seed=8)
    stock_layer = bf16.layers[2]
    with decode_context(bf16.vllm_config, bf16.batch) as context:
        def stock_forward(positions, hidden_states, residual, prefix_sum):  # vLLM's signature; its body is Triton
            return refs[2](hidden_states, prefix_sum, residual, *state_inputs(stock_layer, context, B))

        with mock.patch.object(stock_layer, "forward", side_effect=stock_forward) as stock:
            mixed = run_layers(bf16.layers, programs, bf16.batch.positions,
                               *stage_inputs(bf16.model.model, x.clone(), None), context)
    assert stock.call_count == 1 and set(stock.call_args.kwargs) == {"positions", "hidden_states", "residual",
                                                                      "prefix_sum"}
    assert torch.equal(stock.call_args.kwargs["positions"], bf16.batch.positions)
    _restore(bf16, before)
    with decode_context(bf16.vllm_config, bf16.batch) as context:
        want = _reference_step(bf16, refs, x.clone(), context)
    written = _written_blocks(bf16.cfg, len(bf16.layers))
    for a, b in zip((*mixed[:2], mixed[2][:, written]), (*want[:2], want[2][:, written])):
        assert rel_err(a, b) < TOL


def test_default_compile_refuses_without_cuda_kernels(bf16):
    programs = build_programs(bf16.layers[:2], bf16.cfg, tp=1, rank=0, arch=ARCH, batches=(1, B), progress=_quiet)
    assert set(programs.fallbacks) == {0, 1} and programs.programs == {}
    assert all(r.startswith("no CUDA kernel registered for k3f::") for r in programs.fallbacks.values())


def test_server_compile_step_names_what_stops_the_layer(bf16):
    from rewriter.vllm.programs import compile_with_codegen

    programs = build_programs(bf16.layers[1:2], bf16.cfg, tp=1, rank=0, arch=ARCH, batches=(1,),
                              compile_fn=compile_with_codegen(ARCH), progress=_quiet)
    reason = programs.fallbacks[1]
    # either CuTe DSL is missing, or a template refuses the tiny model's shapes (its hidden size
    # 64 and head_dim 16 are below what the kernels take): both say why
    assert reason.startswith("CuTe DSL kernels unavailable") or \
        re.match(r"refused by the \w+ template: (K 64 |head_dim 16)", reason), reason


# ---- TP ranks reach the same decisions ----------------------------------------------------------------
def _tp_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    from vllm.distributed import get_tp_group

    model, vc = build_loaded(None, tp=world, rank=rank, init_method=init_method)
    group = get_tp_group()
    assert (group.world_size, group.rank_in_group) == (world, rank)

    def compile_fn(result, rows):  # only rank 1 fails, and only on layer 1
        if rank == 1 and result.before.layer == 1:
            raise ProgramError("compile failed on rank 1")

    layers = decoder_layers(model)
    programs = build_programs(layers, text_config(vc), tp=group.world_size, rank=group.rank_in_group, arch=ARCH,
                              batches=(B,), compile_fn=compile_fn, group=group.cpu_group, progress=_quiet)
    batch = prepare_decode(bind_caches(model, vc))
    with decode_context(vc, batch) as context:  # the V2 runner's FULL capture: mode NONE
        decision = decide_step(B, set(programs.batches), True, context).reason
    shard = layers[1].self_attn.in_proj_qkvgfab.weight.shape
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"fallbacks": {str(k): v for k, v in sorted(programs.fallbacks.items())},
                   "programs": sorted(map(list, programs.programs)), "decision": decision,
                   "shard": list(shard)}, f)


@pytest.mark.slow
def test_tp_ranks_reach_the_same_decisions(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, f"file://{tmp_path}/dist-init", str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2))
    assert r0["shard"] == r1["shard"] == [4 * 64 + 16 + 4 + 12, 64]  # each rank's q,k,v,g, f_a, beta, padding
    assert r0["fallbacks"] == {"1": "its program failed to build on another TP rank"}
    assert r1["fallbacks"] == {"1": "compile failed on rank 1"}
    assert r0["programs"] == r1["programs"] == [[i, B] for i in (0, 2, 3, 4, 5)]
    assert r0["decision"] == r1["decision"] == "pure decode"


# ---- pipeline parallelism: two stages of two TP ranks -----------------------------------------------
def _reference_stage(served: Served, refs: list[KimiDecoderLayer], prefix: torch.Tensor, carried: Any,
                     context: Any, last: bool) -> Any:
    """vLLM's KimiLinearModel.forward on one stage, over the bound reference layers: the stage's
    block buffer (the previous stage's blocks at its front), every layer, then the boundary sum
    and blocks for the next stage, or the final AttnRes."""
    attn_res_ops = importlib.import_module("vllm.models.kimi_k3.nvidia.ops.attn_res")  # the module, not the function

    backbone = served.model.model
    blocks = prefix.new_empty(prefix.shape[0], backbone.num_attn_res_blocks, prefix.shape[1])
    if carried is not None:
        blocks[:, :carried.shape[1]] = carried
    aux = [prefix] if carried is None and backbone.start_layer in backbone.aux_hidden_state_layers else []
    hidden, prefix, blocks = _reference_layers(served, refs, prefix, blocks, context, aux)
    if not last:
        return {"hidden_states": hidden + prefix, "residual": blocks, **backbone.pack_local_aux_hidden_states(aux)}
    return attn_res_ops.attn_res(prefix, hidden, blocks, backbone.output_attn_res_norm.weight,
                                 backbone.output_attn_res_proj.weight.squeeze(0), None,
                                 num_blocks=backbone.num_attn_res_blocks, block_write_idx=-1,
                                 eps=backbone.output_attn_res_norm.variance_epsilon, output_norm_eps=0.0), aux


def _pp_worker(rank: int, tp: int, pp: int, init_method: str, out_dir: str) -> None:
    """One rank of PP x TP: the rewriter's path for its stage (``RewriterDecode.run``, programs on
    vLLM's caches, the TP all-reduces over vLLM's own group) and the bound reference layers, each
    chain fed by its own chain's previous stage through vLLM's PP group."""
    from vllm.distributed import get_pp_group, get_tp_group
    from vllm.sequence import IntermediateTensors

    from rewriter.vllm.model import RewriterDecode
    from rewriter.vllm.programs import use_tp_group
    from vllm_model import attn_res_in_torch

    model, vc = build_loaded(None, tp=tp, pp=pp, rank=rank, init_method=init_method)
    stage, group = get_pp_group(), get_tp_group()
    use_tp_group(group)
    model.model._set_aux_hidden_state_layers(AUX_LAYERS)  # as vLLM sets them for DSpark (eagle3_utils)
    runner = bind_caches(model, vc)
    served = Served(None, model, vc, text_config(vc), decoder_layers(model), runner, prepare_decode(runner))
    rewriter = RewriterDecode(vc)
    rewriter.programs = build_programs(served.layers, served.cfg, tp=tp, rank=group.rank_in_group, arch=ARCH,
                                       batches=(B,), compile_fn=_no_compile, group=group.cpu_group, progress=_quiet)
    _fill_caches(served, seed=11 + stage.rank_in_group)
    before = _snapshot(served)
    tokens = torch.tensor([5, 17, 3, 60])
    positions = served.batch.positions
    got_in = ref_in = None
    if not stage.is_first_rank:
        got_in = IntermediateTensors(stage.recv_tensor_dict())
        ref_in = stage.recv_tensor_dict()
    with attn_res_in_torch():
        with decode_context(vc, served.batch) as context:  # the V2 runner's FULL capture: mode NONE
            decision = decide_step(B, set(rewriter.programs.batches), True, context).reason
        with decode_context(vc, served.batch) as context:
            got = rewriter.run(model, tokens if stage.is_first_rank else None, positions, None, got_in)
        _restore(served, before)
        with decode_context(vc, served.batch) as context:
            first = model.model.embed_input_ids(tokens) if stage.is_first_rank else ref_in["hidden_states"]
            refs = [bind_layer(layer, served.cfg, layer.layer_idx, tp, group.rank_in_group) for layer in served.layers]
            want = _reference_stage(served, refs, first, None if stage.is_first_rank else ref_in["residual"],
                                    context, last=stage.is_last_rank)
    result = {"stage": stage.rank_in_group, "tp_rank": group.rank_in_group, "decision": decision,
              "layers": [layer.layer_idx for layer in served.layers], "fallbacks": dict(rewriter.programs.fallbacks)}
    if stage.is_last_rank:
        empty = model.model.make_empty_intermediate_tensors(B, torch.bfloat16, torch.device("cpu"))
        result["received"] = {k: list(v.shape) for k, v in got_in.tensors.items()}
        result["vllm_expects"] = {k: list(v.shape) for k, v in empty.tensors.items()}
        (out, streams), (want_out, want_local) = got, want
        want_streams = model.model.collect_remote_aux_hidden_states(IntermediateTensors(ref_in)) + want_local
        result["rel_err"] = {"output": rel_err(out, want_out),
                             **{f"aux {i}": rel_err(a, b) for i, (a, b) in enumerate(zip(streams, want_streams))}}
        result["aux_streams"] = [len(streams), len(want_streams)]
        result["finite"] = bool(torch.isfinite(out).all())
    else:
        assert isinstance(got, IntermediateTensors)
        result["sent"] = {k: list(v.shape) for k, v in got.tensors.items()}
        result["rel_err"] = {k: rel_err(got[k], want[k]) for k in want}  # stage 0 writes both blocks
        stage.send_tensor_dict(got.tensors)
        stage.send_tensor_dict(want)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


AUX_LAYERS = (0, 2, 4)  # the layers whose entering AttnRes stream a DSpark drafter reads (stage 0: 0, 2; stage 1: 4)


@pytest.mark.slow
def test_two_pipeline_stages_of_two_tp_ranks_equal_the_reference_over_all_layers(tmp_path):
    """PP 2 x TP 2 on four gloo processes of vLLM's real tiny model (6 layers: stage 0 holds
    layers 0..2, stage 1 layers 3..5), with the aux hidden states DSpark drafts from (layers 0,
    2 and 4, set by vLLM's own setter): each stage's rewritten step takes the previous stage's
    intermediate tensors as vLLM sends them (its PP group) and hands on the names and shapes vLLM's
    next stage expects, stage 0's aux streams under vLLM's keys; the last stage's output and its
    three aux streams (two received, one its own) equal the reference layers' over all six."""
    import torch.multiprocessing as mp

    mp.spawn(_pp_worker, args=(2, 2, f"file://{tmp_path}/dist-init", str(tmp_path)), nprocs=4, join=True)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(4)]
    assert [(r["stage"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # vLLM's numbering
    assert [r["layers"] for r in ranks] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert all(r["decision"] == "pure decode" for r in ranks)  # every rank of every stage decides alike
    assert all(r["fallbacks"] == {} for r in ranks)
    aux = {"aux_hidden_states_0": [B, 64], "aux_hidden_states_1": [B, 64]}  # layers 0 and 2 enter on stage 0
    for r in ranks[:2]:  # stage 0 hands on the AttnRes stream and its 2 blocks (layers 0 and 2 wrote them)
        assert r["sent"] == {"hidden_states": [B, 64], "residual": [B, 2, 64], **aux}
        assert len(r["rel_err"]) == 4 and all(e < TOL for e in r["rel_err"].values()), r["rel_err"]
    for r in ranks[2:]:  # stage 1 receives what vLLM's make_empty_intermediate_tensors allocates for it, and the aux
        assert r["vllm_expects"] == {"hidden_states": [B, 64], "residual": [B, 2, 64]}
        assert r["received"] == {**r["vllm_expects"], **aux}
        assert r["aux_streams"] == [3, 3] and len(r["rel_err"]) == 4
        assert r["finite"] and all(e < TOL for e in r["rel_err"].values()), r["rel_err"]


# ---- speculative decoding: verify steps of q = k + 1 tokens per request ------------------------------
VERIFY_Q = 4  # 3 speculative tokens a step
ACCEPTED = (1, 4, 2, 3)  # each request's previous accepted drafts + 1: every accepted length of a 4-token verify


@pytest.fixture(scope="module")
def verify() -> Served:
    """vLLM's real tiny model with 3 speculative tokens a step: its caches bound by vLLM (3 + 3 conv
    rows and 4 state slots per KDA request) and a verify step's metadata from vLLM's builders."""
    model, vc = build_loaded(None, speculative_tokens=VERIFY_Q - 1)
    runner = bind_caches(model, vc, num_blocks=VERIFY_NUM_BLOCKS)
    return Served(None, model, vc, text_config(vc), decoder_layers(model), runner,
                  prepare_decode(runner, q=VERIFY_Q, num_accepted=ACCEPTED))


def _group_blocks(served: Served, layer) -> list[list[int]]:
    """Each request's blocks in the layer's cache group, as the step's requests were given them."""
    groups = served.runner.kv_cache_config.kv_cache_groups
    (gid,) = [g for g, group in enumerate(groups) if layer_name(layer.self_attn) in group.layer_names]
    return served.batch.block_ids[gid]


def _fill_verify_caches(served: Served, seed: int) -> None:
    """Seeded random values in every state slot and conv row the verify step's requests hold (all
    1 + k slots, all 3 + k rows: the step reads the ones its accepted counts pick) and in their MLA
    blocks."""
    g = torch.Generator().manual_seed(seed)
    for layer in served.layers:
        held = torch.tensor([b for ids in _group_blocks(served, layer) for b in ids])
        for view in _views(layer):
            scale = 0.1 if view.dtype == torch.float32 else 1.0
            view[held] = (scale * torch.randn(view[held].shape, generator=g)).to(view.dtype)


def _one_token_steps(served: Served, refs: list[KimiDecoderLayer], x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The verify step as q one-token steps of the bound reference layers, its state read from the
    step's block ids and accepted counts (not from vLLM's metadata): token j of request r runs from
    the state after its token j - 1 (token 0: from slot a - 1, the last accepted token's) and
    leaves its state in slot j; the conv window starts at rows a - 1 .. a + 1 and moves token by
    token in a 3-row copy; token j attends to positions 0 .. L - q + j and is inserted at its own
    slot. Returns (hidden, prefix sum, blocks) with request r's token j in row r * q + j, and each
    KDA layer's conv state as the verify leaves it (rows a, a + 1, then the q tokens' inputs)."""
    q, requests = served.batch.q, len(served.batch.seq_lens)
    steps, convs, windows = [], {}, {}
    for j in range(q):
        prefix = x[j::q]
        blocks = prefix.new_empty(requests, served.num_attn_res_blocks, prefix.shape[1])
        hidden = None
        for layer, ref in zip(served.layers, refs):
            if _is_kda(layer):
                conv, recurrent = cache_tensors(layer)["conv_state"], layer.self_attn.kv_cache[1]
                slots = torch.tensor(_group_blocks(served, layer))  # [requests, q]
                window = windows.setdefault(layer.layer_idx, torch.zeros(conv.shape[:2] + (3,), dtype=conv.dtype))
                for r, a in enumerate(served.batch.num_accepted):
                    if j == 0:
                        window[slots[r, 0]] = conv[slots[r, 0], :, a - 1:a + 2]
                        recurrent[slots[r, 0]] = recurrent[slots[r, a - 1]]
                    else:
                        window[slots[r, j]] = window[slots[r, j - 1]]
                        recurrent[slots[r, j]] = recurrent[slots[r, j - 1]]
                state = (window, recurrent, slots[:, j].int())
            else:
                kv = layer.self_attn.kv_cache
                size = kv.shape[1]
                ids = _group_blocks(served, layer)
                table = torch.zeros(requests, max(map(len, ids)), dtype=torch.int32)
                for r, row in enumerate(ids):
                    table[r, :len(row)] = torch.tensor(row)
                pos = torch.tensor(served.batch.seq_lens) - q + j
                slot = table[torch.arange(requests), pos // size].long() * size + pos % size
                state = (kv, table, (pos + 1).int(), slot, layer.self_attn._k_scale.reshape(1))
            hidden, prefix, blocks = ref(hidden if hidden is not None else prefix, prefix, blocks, *state)
            if _is_kda(layer):  # this token's conv input, as the window stored it
                convs.setdefault(layer.layer_idx, []).append(window[slots[:, j]][..., -1])
        steps.append((hidden, prefix, blocks))
    out = tuple(torch.stack([s[i] for s in steps], dim=1).flatten(0, 1) for i in range(3))
    final = {}
    for layer in served.layers:
        if _is_kda(layer):
            conv = cache_tensors(layer)["conv_state"]  # as before the step: only the copies moved
            final[layer.layer_idx] = after = conv.clone()
            slots = torch.tensor(_group_blocks(served, layer))[:, 0]
            for r, a in enumerate(served.batch.num_accepted):
                after[slots[r], :, :2] = conv[slots[r], :, a:a + 2]
            after[slots, :, 2:] = torch.stack(convs[layer.layer_idx], dim=-1)
    return (*out, final)


def test_a_verify_step_on_vllms_metadata_equals_q_one_token_steps_of_the_reference_layers(verify):
    """Programs built at q = 4 on vLLM's real model run one verify step on the state vLLM laid out
    and the metadata its builders made (``spec_state_indices_tensor``, ``num_accepted_tokens``,
    MLA decodes of 4 tokens each), read by ``state_inputs``; the step guard takes it. Outputs and
    every state written equal the reference layers run as 4 one-token steps from the state the
    accepted counts pick (all four accepted lengths, one per request), and nothing else changes."""
    from rewriter.vllm.guard import StepDecision

    q, T = VERIFY_Q, B * VERIFY_Q
    for layer in verify.layers:  # vLLM's verify metadata, as its builders made it
        md = verify.batch.attn_metadata[layer_name(layer.self_attn)]
        if _is_kda(layer):
            assert (md.num_prefills, md.num_decodes, md.num_spec_decodes, md.num_spec_decode_tokens) == (0, 0, B, T)
            assert md.non_spec_state_indices_tensor is None
            assert md.spec_state_indices_tensor.tolist() == _group_blocks(verify, layer)
            assert md.num_accepted_tokens.tolist() == list(ACCEPTED)
        else:
            assert (md.num_prefills, md.num_decodes, md.num_decode_tokens) == (0, B, T)
    programs = build_programs(verify.layers, verify.cfg, tp=1, rank=0, arch=ARCH, batches=(B,), q=q,
                              compile_fn=_no_compile, progress=_quiet)
    assert programs.fallbacks == {} and programs.q == q
    assert sorted(programs.programs) == [(layer.layer_idx, T) for layer in verify.layers]
    with decode_context(verify.vllm_config, verify.batch) as context:  # the V2 runner's FULL capture: mode NONE
        assert decide_step(T, set(programs.token_counts), True, context, q) == \
            StepDecision(True, "uniform verify (4 tokens per request)")
        kda = next(layer for layer in verify.layers if _is_kda(layer))
        conv, recurrent, slots, accepted = state_inputs(kda, context, T, q)
        assert conv.data_ptr() == cache_tensors(kda)["conv_state"].data_ptr() and conv.shape[-1] == 3 + q - 1
        assert slots.shape == (B, q) and accepted.tolist() == list(ACCEPTED)

    _fill_verify_caches(verify, seed=21)
    before = _snapshot(verify)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with decode_context(verify.vllm_config, verify.batch) as context:
        got = run_layers(verify.layers, programs, verify.batch.positions,
                         *stage_inputs(verify.model.model, x.clone(), None), context)
    after_programs = _snapshot(verify)
    _restore(verify, before)
    with torch.inference_mode():
        *want, want_conv = _one_token_steps(verify, verify.bind(), x.clone())
    after_reference = _snapshot(verify)

    written = _written_blocks(verify.cfg, len(verify.layers))
    for name, a, b in (("hidden", got[0], want[0]), ("prefix sum", got[1], want[1]),
                       ("AttnRes blocks", got[2][:, written], want[2][:, written])):
        assert torch.isfinite(a).all() and b.abs().max() > 0, name
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    free = torch.ones(verify.runner.kv_cache_config.num_blocks, dtype=torch.bool)  # blocks no request holds
    free[[b for group in verify.batch.block_ids for ids in group for b in ids]] = False
    for layer, was, now, ref in zip(verify.layers, before, after_programs, after_reference):
        i = layer.layer_idx
        if _is_kda(layer):
            slots = torch.tensor(_group_blocks(verify, layer))  # [requests, q]
            conv_now = now[0].transpose(-1, -2)  # vLLM's SD [slots, rows, C] as the programs' [slots, C, rows]
            assert rel_err(conv_now[slots[:, 0]], want_conv[i][slots[:, 0]]) < TOL, i
            assert not torch.equal(now[0][slots[:, 0]], was[0][slots[:, 0]]), i
            assert torch.equal(now[0][slots[:, 1:]], was[0][slots[:, 1:]]), i  # conv rows live in column 0's slot
            for j in range(q):  # token j's state in column j, for every accepted length
                assert not torch.equal(now[1][slots[:, j]], was[1][slots[:, j]]), (i, j)
                assert rel_err(now[1][slots[:, j]], ref[1][slots[:, j]]) < TOL, (i, j, rel_err(now[1], ref[1]))
        else:
            size = now[0].shape[1]
            entries = verify.batch.slot_mapping[layer_name(layer.self_attn)][:T].long()
            block, offset = entries // size, entries % size
            assert not torch.equal(now[0][block, offset], was[0][block, offset]), i
            assert rel_err(now[0][block, offset], ref[0][block, offset]) < TOL, i
            keep = torch.ones(now[0].shape[:2], dtype=torch.bool)
            keep[block, offset] = False
            mine = torch.tensor([b for ids in _group_blocks(verify, layer) for b in ids])
            assert torch.equal(now[0][mine][keep[mine]], was[0][mine][keep[mine]]), i  # its blocks' other entries
        assert all(torch.equal(a[free], b[free]) for a, b in zip(now, was)), i


def test_speculative_decoding_is_served_at_q_4_and_a_conv_rows_count_the_programs_do_not_read_is_refused():
    """At the smallest sizes the KDA+MoE templates take, vLLM's real model with 3 speculative tokens
    a step: startup refuses nothing about it; programs built for verify steps of 4 tokens (their KDA
    graphs take vLLM's 4 state slots per request and its accepted counts) keep their KDA layers
    once vLLM binds its 3 + 3 conv rows per slot (its SD layout, read from vLLM's own flag, not
    guessed from the shape), the kernels asked about that state; programs built for
    one-token steps or for 2 tokens per request are dropped, naming the rows."""
    from rewriter.vllm.guard import deployment_refusals
    from rewriter.vllm.programs import check_cache_layouts
    from vllm_model import KERNEL_SHAPED_VLLM_CONFIG

    model, vc = build_loaded(None, config=KERNEL_SHAPED_VLLM_CONFIG, speculative_tokens=VERIFY_Q - 1)
    layers, cfg = decoder_layers(model), text_config(vc)
    kda = [layer for layer in layers if cfg.layer_kind(layer.layer_idx) == "kda"]
    assert not [r for r in deployment_refusals(vc, (9, 0)) if "speculative" in r or "verify" in r]

    def programs(q):
        return build_programs(layers, cfg, tp=1, rank=0, arch=ARCH, batches=(B,), q=q, compile_fn=_no_compile,
                              progress=_quiet)

    verify, one_token, two_tokens = programs(VERIFY_Q), programs(1), programs(2)
    for layer in kda:  # verify programs: vLLM's q state slots per request and its accepted counts
        inputs = {n.name: tuple(n.meta["val"].shape) for n in
                  verify.get(layer.layer_idx, B * VERIFY_Q).runner.module.graph.nodes if n.op == "placeholder"}
        assert inputs["state_indices"] == (B, VERIFY_Q) and inputs["num_accepted"] == (B,), inputs
        assert inputs["conv_state"][-1] == 6, inputs
    bind_caches(model, vc, num_blocks=VERIFY_NUM_BLOCKS)
    raw = kda[0].self_attn.kv_cache[0]
    conv = cache_tensors(kda[0])["conv_state"]
    assert raw.shape[1:] == (6, conv.shape[1]) and conv.shape[2] == 6  # vLLM's [slots, rows, C] -> [slots, C, rows]
    check_cache_layouts(verify, layers, ARCH)
    for layer in kda:
        assert layer.layer_idx not in verify.fallbacks, verify.fallbacks[layer.layer_idx]
        assert verify.get(layer.layer_idx, B * VERIFY_Q) is not None
    for built, q, what in ((one_token, 1, "one-token decode steps, which read 3"),
                           (two_tokens, 2, "verify steps of 2 tokens per request, which read 4")):
        check_cache_layouts(built, layers, ARCH)
        for layer in kda:
            assert built.fallbacks[layer.layer_idx] == ("vLLM keeps 6 conv state rows per slot (3 + 3 speculative "
                                                        f"tokens): the programs are built for {what}")
            assert built.get(layer.layer_idx, B * q) is None


# ---- the kernels asked about vLLM's state layout, before any step ------------------------------
def test_the_server_plans_for_its_own_gpus_sms_and_vllms_cache_page_size():
    """``mla_attend``'s grid must be resident at once, so it is capped at the GPU's SMs, and it is
    specialized to the cache's page size, which vLLM fixes only after the model (and the
    programs) are built: a hybrid MLA model's pages are a multiple of 128 tokens, here 128, not
    the 64 traced. So the server plans for its own GPU (78 SMs, an H20) and, once vLLM binds its
    caches, compiles the kernels that page size needs before any step, on the same cap. Without
    a compile step such layers keep the stock forward, named; on fewer SMs than a step's CTAs
    the MLA layers keep it from the build: never a kernel compiled or declined inside a step."""
    from rewriter.compiler.plan import program_refusal
    from rewriter.vllm.programs import check_cache_layouts
    from vllm_model import KERNEL_SHAPED_VLLM_CONFIG

    model, vc = build_loaded(None, config=KERNEL_SHAPED_VLLM_CONFIG)
    layers, cfg = decoder_layers(model), text_config(vc)
    mla = [layer.layer_idx for layer in layers if cfg.layer_kind(layer.layer_idx) == "mla"]
    assert mla

    def refuse_as_the_server_does(result, rows):  # compile_with_codegen's check, without compiling
        reason = program_refusal(rows)
        if reason:
            raise ProgramError(reason)

    def programs(sms):
        return build_programs(layers, cfg, tp=1, rank=0, arch=ARCH, batches=(B,),
                              compile_fn=refuse_as_the_server_does, progress=_quiet, sms=sms)

    def attend(built):
        return {(spec.shape_dict["block_size"], spec.param_dict.get("max_ctas")) for i in mla
                for spec in built.get(i, B).kernel_specs if spec.kernel == "mla_attend"}

    h20, any_gpu, too_few = programs(78), programs(None), programs(B - 1)
    assert not h20.fallbacks and not any_gpu.fallbacks
    assert attend(h20) == {(64, 78)} and attend(any_gpu) == {(64, None)}  # None: the 128-CTA kernel, as always
    assert set(too_few.fallbacks) == set(mla)
    for i in mla:
        assert f"more CTAs than the {B - 1} SMs of the GPU hold" in too_few.fallbacks[i], too_few.fallbacks[i]

    bind_caches(model, vc)
    page = cache_tensors(layers[mla[0]])["kv_cache"].shape[1]
    assert page == 128
    compiled = []
    check_cache_layouts(h20, layers, ARCH, sms=78, compile_specs=compiled.extend)
    assert not h20.fallbacks and attend(h20) == {(64, 78), (page, 78)}
    assert {s.kernel for s in compiled} == {"mla_attend"} and len(compiled) == 1, [s.label() for s in compiled]
    check_cache_layouts(any_gpu, layers, ARCH, sms=78)  # no compile step
    assert set(any_gpu.fallbacks) == set(mla)
    for i in mla:
        assert "needs kernels not built for the traced layout: mla_attend" in any_gpu.fallbacks[i]
        assert f"block_size={page}" in any_gpu.fallbacks[i] and "max_ctas=78" in any_gpu.fallbacks[i]


@pytest.mark.parametrize("predicted", ["vLLM's", "another"])
def test_the_plugins_model_state_builds_at_load_and_checks_each_bound_cache(monkeypatch, tmp_path, predicted):
    """The plugin's hooks in vLLM's V2 runner, on vLLM's real model, config and model-state class
    (``KimiK3ModelState``, whose own hooks build vLLM's in-tree path): the state vLLM makes after
    ``load_model`` (``init_model_state``) builds every layer's programs for the GPU it runs on and
    the MLA cache page vLLM will bind (``rewriter.model.pages``, which this config's bound page matches),
    and its ``initialize_kv_cache``, which vLLM calls for each cache it binds (the profiling one,
    then the real one), checks them on the caches as bound: nothing to compile where the page was
    predicted, else the kernels the bound page needs, once. The GPU is an H20 (sm_90, 78 SMs) as
    far as the plugin can tell; the compile steps check the templates without compiling."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.model_state import KimiK3ModelState
    from vllm.v1.worker.gpu.model_states import init_model_state

    import rewriter.vllm.model as plugin
    from rewriter.compiler.plan import program_refusal
    from rewriter.model.pages import vllm_block_size
    from vllm_model import KERNEL_SHAPED_VLLM_CONFIG

    def refuse_as_the_server_does(result, rows):  # compile_with_codegen's check, without compiling
        reason = program_refusal(rows)
        if reason:
            raise ProgramError(reason)

    compiled, workspaces = [], []
    monkeypatch.setenv("K3_REWRITER_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(plugin, "sm_count", lambda index: 78)
    monkeypatch.setattr(plugin, "compile_with_codegen", lambda arch: refuse_as_the_server_does)
    monkeypatch.setattr(plugin, "compile_specs_with_codegen", lambda: compiled.extend)
    monkeypatch.setattr(plugin, "make_workspaces", lambda specs, device: workspaces.append(set(specs)) or 0)
    if predicted == "another":  # a page vLLM does not bind (say, the server's own --block-size)
        monkeypatch.setattr(plugin, "vllm_block_size", lambda *args: 64)

    model, vc = build_loaded(None, config=KERNEL_SHAPED_VLLM_CONFIG)
    model.__class__ = plugin.RewrittenKimiLinearForCausalLM  # what vLLM's registry resolves to with the plugin
    model.rewriter = plugin.RewriterDecode(vc)
    layers, cfg = decoder_layers(model), text_config(vc)
    mla = [layer.layer_idx for layer in layers if cfg.layer_kind(layer.layer_idx) == "mla"]
    with set_current_vllm_config(vc):
        state = init_model_state(vc, model, None, torch.device("cpu"))
    assert isinstance(state, KimiK3ModelState)
    programs = model.rewriter.programs
    assert not programs.fallbacks and len(programs.programs) == len(layers) * len(programs.batches)
    attend = {s for p in programs.programs.values() for s in p.kernel_specs if s.kernel == "mla_attend"}
    built = 64 if predicted == "another" else vllm_block_size(cfg, 1, "bf16")
    assert {(s.shape_dict["block_size"], s.param_dict["max_ctas"]) for s in attend} == {(built, 78)}

    runner = bind_caches(model, vc)
    page = cache_tensors(layers[mla[0]])["kv_cache"].shape[1]
    assert (page == built) == (predicted == "vLLM's")
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # as resolved on a GPU (a CPU: NONE)
    for _ in range(2):  # vLLM's profiling cache, then the real one
        state.initialize_kv_cache(runner.kv_cache_config, None)
    assert not programs.fallbacks
    if predicted == "vLLM's":
        assert compiled == [] and len(workspaces) == 2
        return
    assert {(s.kernel, s.shape_dict["block_size"], s.param_dict["max_ctas"]) for s in compiled} == \
        {("mla_attend", page, 78)}
    assert len(compiled) == len({s.shape_dict["batch"] for s in attend})  # once per batch, not per bound cache
    assert len(workspaces) == 2 and set(compiled) <= workspaces[-1]
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE  # what vLLM may resolve it to with the caches
    with pytest.raises(ValueError, match="vLLM resolved its CUDA graphs to no FULL decode CUDA graphs"):
        state.initialize_kv_cache(runner.kv_cache_config, None)


def test_vllms_state_layout_is_taken_and_one_the_kernels_cannot_read_is_refused_when_bound():
    """At the smallest sizes the KDA+MoE templates take, vLLM's real model with bf16 experts: once
    vLLM's CPU runner binds its caches (page-strided slots, the conv state "SD", its default) the
    KDA programs built for that layout keep their kernels; programs built for "DS" get theirs for
    "SD" compiled then, before any step (or, with no compile step or a failed compile, are refused:
    their kernels would compile inside a step), and a state no kernel reads (a strided channel) is
    refused, each naming why: never the reference in a served step."""
    from rewriter.vllm.programs import check_cache_layouts
    from rewriter.vllm.state import cache_tensors
    from vllm_model import KERNEL_SHAPED_VLLM_CONFIG

    model, vc = build_loaded(None, config=KERNEL_SHAPED_VLLM_CONFIG)
    layers, cfg = decoder_layers(model), text_config(vc)
    kda = [layer for layer in layers if cfg.layer_kind(layer.layer_idx) == "kda"]

    def programs(layout="SD"):
        return build_programs(layers, cfg, tp=1, rank=0, arch=ARCH, batches=(B,), compile_fn=_no_compile,
                              progress=_quiet, conv_layout=layout)

    sd, ds = programs("SD"), programs("DS")
    assert not sd.fallbacks and not ds.fallbacks
    bind_caches(model, vc)
    conv = cache_tensors(kda[0])["conv_state"]
    assert conv.stride(0) > conv[0].numel() and conv.stride(1) == 1  # vLLM's own pages, SD
    check_cache_layouts(sd, layers, ARCH)
    assert all(sd.get(layer.layer_idx, B) is not None for layer in kda), sd.fallbacks
    check_cache_layouts(ds, layers, ARCH)
    for layer in kda:
        reason = ds.fallbacks[layer.layer_idx]
        assert reason.startswith("the state as vLLM lays it out: it needs kernels not built for the traced layout: "
                                 "kda_core"), reason
        assert "conv_layout=SD" in reason and ds.get(layer.layer_idx, B) is None
    compiled = []
    ds = programs("DS")
    check_cache_layouts(ds, layers, ARCH, compile_specs=compiled.extend)
    assert all(ds.get(layer.layer_idx, B) is not None for layer in kda), ds.fallbacks
    kda_kernels = [s for s in compiled if s.kernel == "kda_core"]
    assert kda_kernels and all(s.param_dict["conv_layout"] == "SD" for s in kda_kernels), [s.label() for s in compiled]
    assert all(set(kda_kernels) <= ds.get(layer.layer_idx, B).kernel_specs for layer in kda)

    def failing(specs):
        raise ProgramError("kernel compile failed: forced for the test")

    ds = programs("DS")
    check_cache_layouts(ds, layers, ARCH, compile_specs=failing)
    for layer in kda:
        assert ds.fallbacks[layer.layer_idx] == ("the state as vLLM lays it out: its kernels for this layout: kernel "
                                                 "compile failed: forced for the test")

    raw, recurrent = kda[0].self_attn.kv_cache[:2]
    wide = torch.empty(raw.shape[0], raw.shape[1], 2 * raw.shape[2], dtype=raw.dtype)
    kda[0].self_attn.kv_cache = [wide[..., ::2], recurrent]  # every other channel: no kernel reads that
    fresh = programs()
    check_cache_layouts(fresh, layers, ARCH)
    reason = fresh.fallbacks[kda[0].layer_idx]
    assert reason.startswith("the state as vLLM lays it out: refused by the kda_core template: conv_state strides"), \
        reason
    assert all(fresh.get(layer.layer_idx, B) is not None for layer in kda[1:])
    assert 0 not in fresh.fallbacks  # the dense layer too
