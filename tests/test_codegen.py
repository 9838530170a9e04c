"""codegen/: specs, the disk cache, the registration seam, and compile-only checks of the CuTe
DSL kernels (PTX for sm_90a and sm_100a holds the instructions each kernel is built on).

The compile tests skip when CuTe DSL (``pip install -e '.[cutedsl]'``) is not installed;
everything else runs everywhere. Nothing here needs a GPU (tests/test_kernels_gpu.py runs
the kernels).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import patterns.attn_res
import patterns.dense_mlp
import patterns.input_projection
import patterns.kda
import patterns.mla
import patterns.moe  # noqa: F401  (defines the k3f ops used here)
from codegen import bind
from codegen.cache import Entry, KernelCache
from codegen.kernels import source_files
from codegen.spec import KernelSpec, SpecError
from codegen.templates import template
from conftest import HAVE_CUTEDSL, hand_written_refusal, needs_cutedsl, pdl_flags, spec_of
from rewriter.commands.cli import main
from rewriter.compiler.rules import fused_op

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_90a", "sm_100a")
TP16_SPLIT = [2304, 768, 128, 6, 10]  # Kimi K3 in_proj_qkvgfab at TP 16: q|k|v, g, f_a, beta, padding


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def attn_res_args(tokens=1, num_blocks=1, write_idx=-1, delta=True, d=7168, nb=8):
    return (meta(tokens, d), meta(tokens, d) if delta else None, meta(tokens, nb, d), meta(d), meta(d), meta(d),
            num_blocks, write_idx, 1e-5)


def in_proj_args(tokens=1, rows=3216, split=TP16_SPLIT, k=7168):
    return (meta(tokens, k), meta(rows, k), list(split))


def router_args(tokens=1, experts=896, top_k=16, dtype=torch.float32, renormalize=True, scaling=1.0):
    return (meta(tokens, experts, dtype=dtype), meta(experts, dtype=torch.float32), top_k, renormalize, scaling)


def in_proj_spec(arch, tokens):
    """The input projection's kernel for ``tokens``, generated from its reference: the GEMV's
    main loop at one token, the GEMM's from two."""
    (spec,) = template("products").make_specs("k3f::kda_in_proj", arch, in_proj_args(tokens=tokens))
    return spec


# ---------------------------------------------------------------- specs and templates (no CuTe DSL needed)

def test_spec_is_plain_hashable_data():
    a = KernelSpec.make("gemv", "k3f::o_proj_attn_res", "sm_90a", shapes={"tokens": 1, "k": 7168},
                        params={"segments": [1, 2], "unroll": 4})
    b = KernelSpec.make("gemv", "k3f::o_proj_attn_res", "sm_90a", shapes={"k": 7168, "tokens": 1},
                        params={"unroll": 4, "segments": (1, 2)})
    assert a == b and hash(a) == hash(b) and a.canonical() == b.canonical()
    assert a.param_dict["segments"] == (1, 2)
    assert a.with_arch("sm_100a") != a and json.loads(a.canonical())["shapes"] == {"k": 7168, "tokens": 1}
    assert "segments=1/2" in a.label() and "unroll" not in a.label()
    with pytest.raises(SpecError, match="sm_89"):
        KernelSpec.make("x", "k3f::x", "sm_89")
    with pytest.raises(SpecError, match="not plain data"):
        KernelSpec.make("x", "k3f::x", "sm_90a", params={"w": torch.zeros(1)})


def test_templates_make_specs_from_the_layer_values():
    spec = spec_of("k3f::attn_res_norm", "sm_90a", attn_res_args(tokens=3, num_blocks=4, write_idx=4))
    assert spec.kernel == "attn_res_norm" and spec.shape_dict == {"hidden": 7168, "blocks": 8}
    assert spec.param_dict == {"num_blocks": 4, "write_idx": 4, "has_delta": True, "eps": 1e-5, "cluster": 8,
                               "vectors": 1}
    # the token count is a runtime size for attn_res_norm: one compile serves every batch of a
    # row of CLUSTER_BY_TOKENS (the split of a token's row over a cluster of CTAs)
    from codegen.launchers.attn_res_norm import CLUSTER_BY_TOKENS, split_for

    for most, cluster, vectors in CLUSTER_BY_TOKENS:
        for t in (most, most - 1):
            p = spec_of("k3f::attn_res_norm", "sm_90a", attn_res_args(tokens=t, num_blocks=4, write_idx=4)).param_dict
            assert (p["cluster"], p["vectors"]) == (cluster, vectors) == split_for(t, 7168)
    assert split_for(CLUSTER_BY_TOKENS[-1][0] + 1, 7168) == (1, 2)
    assert spec == spec_of("k3f::attn_res_norm", "sm_90a", attn_res_args(tokens=2, num_blocks=4, write_idx=4))
    # a row whose vectors an 8-way split does not divide takes the largest cluster that does
    assert spec_of("k3f::attn_res_norm", "sm_90a", attn_res_args(d=7160)).param_dict["cluster"] == 1
    assert spec_of("k3f::attn_res_norm", "sm_90a", attn_res_args(d=7152)).param_dict["cluster"] == 2
    # the input projection's kernels are generated: one kernel whose parts are the split's pieces
    # (the padding rows after them are not read)
    g = spec_of("k3f::kda_in_proj", "sm_100a", in_proj_args(tokens=1))
    assert g.kernel == "product_gemv" and g.shape_dict == {"tokens": 1, "k": 7168, "n": 3206}
    assert [st[4][0] for st in g.param_dict["parts"]] == [2304, 768, 128, 6]
    assert spec_of("k3f::kda_in_proj", "sm_100a", in_proj_args(tokens=8)).kernel == "product_gemm"
    assert spec_of("k3f::mla_in_proj", "sm_90a", in_proj_args(rows=2880, split=[1536, 512, 64, 768])).op == \
        "k3f::mla_in_proj"
    r = spec_of("k3f::router_topk", "sm_90a", router_args(tokens=3))
    assert r.kernel == "router_topk" and r.shape_dict == {"experts": 896}
    assert r.param_dict == {"top_k": 16, "renormalize": True, "scaling": 1.0, "threads": 128}
    assert r == spec_of("k3f::router_topk", "sm_90a", router_args(tokens=64))  # tokens: a runtime size
    assert spec_of("k3f::router_topk", "sm_90a", router_args(experts=16, top_k=4)).param_dict["threads"] == 32


@pytest.mark.parametrize("op,args,reason", [
    ("k3f::kda_in_proj", in_proj_args(tokens=65), "65 tokens outside 1..64"),
    ("k3f::kda_in_proj", (meta(1, 7168, dtype=torch.float32), meta(3216, 7168), TP16_SPLIT),
     "the generated products multiply bf16 activations"),
    ("k3f::kda_in_proj", (meta(1, 7168), meta(7168, 3216).t(), TP16_SPLIT),
     "the kernels read 128-bit vectors of a row"),
    ("k3f::attn_res_norm", attn_res_args(num_blocks=9, nb=10), "at most 9 sources"),
    ("k3f::attn_res_norm", attn_res_args(write_idx=8), "outside the block buffer"),
    ("k3f::router_topk", router_args(dtype=torch.bfloat16), "logits is bf16; the template is fp32 only"),
    ("k3f::router_topk", router_args(top_k=33), "top_k 33 outside 1..32"),
    ("k3f::router_topk", router_args(experts=8, top_k=16), "top_k 16 outside 1..8"),
    ("k3f::router_topk", router_args(experts=9000), "9000 experts outside 1..8192"),
    ("k3f::router_topk", (meta(1, 896, dtype=torch.float32), meta(895, dtype=torch.float32), 16, True, 1.0),
     "bias must be [896]"),
    ("k3f::kda_core", (), "k3f::kda_core takes 16 arguments, got 0"),
    ("k3f::mla_q_front", (), "k3f::mla_q_front takes 16 arguments, got 0"),
    ("k3f::no_such_op", (), "no hand-written CuTe DSL template for k3f::no_such_op; generated: k3f::no_such_op is "
                            "not a defined fused op"),
])
def test_templates_refuse_with_a_reason(op, args, reason):
    from codegen.templates import spec_for_call, templates_for_op

    why = hand_written_refusal(op, args) if templates_for_op(op) else spec_for_call(op, "sm_90a", args)[1]
    assert reason in why, why


def test_kernel_sources_found_from_the_module():
    """What a kernel's cache key hashes is found from its imports: the module, every codegen module
    it imports (mla_attend: warp_mma; gemm: the spec helpers it shares with its launchers, and
    what they import), nothing else; a spec naming no kernel module is a compile error by name."""
    names = {p.relative_to(ROOT).as_posix() for p in source_files("mla_attend")}
    assert {"codegen/kernels/mla_attend.py", "codegen/kernels/warp_mma.py", "codegen/kernels/common.py"} <= names
    assert not any("launchers" in n or "gemm" in n for n in names)
    assert "codegen/launchers/gemm_specs.py" in {p.relative_to(ROOT).as_posix() for p in source_files("gemm")}
    from codegen.compiler import CodegenError, cache_key

    bad = KernelSpec.make("attn_res_norm", "k3f::attn_res_norm", "sm_90a", module="no_such_kernel")
    with pytest.raises(CodegenError, match="no CuTe DSL kernel module codegen/kernels/no_such_kernel.py"):
        cache_key(bad)
    assert template("no_such_kernel") is None and template("attn_res_norm").ops == ("k3f::attn_res_norm",)


# ---------------------------------------------------------------- disk cache (no CuTe DSL needed)

def test_cache_writes_atomically_and_rejects_corrupt_entries(tmp_path):
    cache = KernelCache(tmp_path)
    key = "ab" * 32
    assert cache.get(key) is None
    path = cache.put(key, Entry({"function": "f"}, ".target sm_90a", b"\x7fELF" + bytes(100)))
    assert path.is_file() and not list(cache.dir.glob("*.tmp"))  # written via a renamed temporary file
    got = cache.get(key)
    assert got.ptx == ".target sm_90a" and got.obj.startswith(b"\x7fELF") and got.manifest["function"] == "f"
    assert cache.get("cd" * 32) is None and cache.keys() == [key]
    # a flipped byte, a truncated file, an entry filed under another key: reported, deleted, never trusted
    data = path.read_bytes()
    for bad in (data[:-40] + bytes(b ^ 0xFF for b in data[-40:]), data[: len(data) // 2]):
        path.write_bytes(bad)
        assert cache.get(key) is None and not path.exists()
        cache.put(key, Entry({"function": "f"}, "x", b"y"))
    # a deflated payload whose stream is broken (zlib's error, not a CRC mismatch)
    cache.put(key, Entry({"function": "f"}, ".target sm_90a\n" * 400, b"y"))
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("kernel.ptx")
    assert info.compress_type == zipfile.ZIP_DEFLATED
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start] |= 0b110  # block type 3: reserved, an invalid stream
    path.write_bytes(bytes(data))
    assert cache.get(key) is None and not path.exists() and "error" in cache.rejected[-1][1]
    cache.put(key, Entry({"function": "f"}, "x", b"y"))
    path.rename(cache.path("cd" * 32))
    assert cache.get("cd" * 32) is None and len(cache.rejected) == 4
    with cache.lock(key):
        pass
    assert cache.clear() == 0 and cache.keys() == []


def test_cache_root_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_REWRITER_CACHE", str(tmp_path / "c"))
    assert KernelCache().root == tmp_path / "c"
    monkeypatch.delenv("K3_REWRITER_CACHE")
    assert KernelCache().root == Path.home() / ".cache" / "k3-rewriter"


# ---------------------------------------------------------------- registration seam (no GPU needed)

@fused_op("_codegen_bind_probe")
def _probe(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale


def test_nothing_registers_at_import():
    code = ("import torch, codegen, codegen.bind, codegen.compiler, codegen.templates, rewriter.commands.compile, "
            "patterns.attn_res, patterns.input_projection\n"
            "print(any(torch._C._dispatch_has_kernel_for_dispatch_key(f'k3f::{op}', 'CUDA')"
            " for op in ('attn_res_norm', 'kda_in_proj', 'mla_in_proj')), codegen.bind.registered())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "{}"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_register_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        bind.register_cuda_impl("attn_res_norm", lambda *a: NotImplemented)
    assert "k3f::attn_res_norm" not in bind.registered()


def test_install_keeps_launchers_already_installed_for_the_arch():
    """Server start installs once per program: the launchers (and kernels they loaded) stay.
    In a new process: a torch.library registration cannot be undone, and later tests check that
    none was made."""
    code = """
from codegen import bind
ops = bind.install_cuda_kernels("sm_90a", allow_without_cuda=True)
first = {op: bind.registered()[op] for op in ops}
assert "k3f::kda_core" in ops and all(isinstance(f, bind.TemplateLauncher) for f in first.values())
bind.install_cuda_kernels("sm_90a", allow_without_cuda=True)
assert all(bind.registered()[op] is first[op] for op in ops)
bind.install_cuda_kernels("sm_100a", allow_without_cuda=True)
assert all(bind.registered()[op].arch == "sm_100a" for op in ops)
print(len(ops))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 9


def test_cuda_impl_runs_the_launcher_or_the_reference():
    op = "k3f::_codegen_bind_probe"
    calls = []

    def launcher(x, scale):
        calls.append(x.shape)
        return NotImplemented if scale < 0 else x * 0 + 42

    bind.register_cuda_impl("_codegen_bind_probe", launcher, allow_without_cuda=True)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    x = torch.ones(3)
    assert torch.equal(torch.ops.k3f._codegen_bind_probe(x, 2.0), x * 2)  # CPU tensors: the reference
    assert not calls
    impl = bind._dispatcher(op)  # what torch.library calls for CUDA tensors
    assert torch.equal(impl(x, 2.0), torch.full((3,), 42.0))
    assert torch.equal(impl(x, -1.0), -x)  # the launcher declined: the reference ran
    bind.unregister_cuda_impl("_codegen_bind_probe")
    assert torch.equal(impl(x, 2.0), x * 2) and len(calls) == 2
    assert bind.stats()[op] == {"kernel": 1, "reference": 2}


def test_template_launcher_declines_what_it_cannot_run():
    launcher = bind.TemplateLauncher("kda_in_proj", arch="sm_90a")
    x, w = torch.zeros(1, 7168, dtype=torch.bfloat16), torch.zeros(3216, 7168, dtype=torch.bfloat16)
    assert launcher(x, w, TP16_SPLIT) is NotImplemented  # CPU tensors never launch
    assert any("CUDA" in r for r in bind.stats()["k3f::kda_in_proj"])


def test_a_strict_launcher_raises_instead_of_running_the_reference():
    """The server's launchers: a call no template takes is an error naming why, never the
    reference on the GPU (correct but far slower, and silent)."""
    launcher = bind.TemplateLauncher("kda_in_proj", arch="sm_90a", strict=True)
    x, w = torch.zeros(1, 7168, dtype=torch.bfloat16), torch.zeros(3216, 7168, dtype=torch.bfloat16)
    with pytest.raises(bind.KernelDeclined, match="k3f::kda_in_proj: no kernel takes this call .*CUDA"):
        launcher(x, w, TP16_SPLIT)


def test_compile_dry_run_lists_the_layer(capsys):
    assert main(["compile", "--layer", "1", "--tp", "16", "--batch", "1", "--arch", "sm_90a", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "9 scheduled ops, 9 with a CuTe DSL template (12 kernels)" in out
    assert re.search(r"0 attn_res_norm\s+would compile attn_res_norm", out)
    assert re.search(r"1 attn_in_proj\s+would compile \(generated\) product_gemv\[kda_in_proj\] k=7168 n=3206", out)
    assert re.search(r"5 router_topk\s+would compile router_topk experts=896 .*top_k=16", out)
    assert re.search(r"6 routed_experts_mxfp4\s+would compile expert_up_mxfp4[^\n]*\n\s+would compile "
                     r"expert_down_mxfp4", out)
    # the router's and the input projection's ops have no hand-written template: their kernels are
    # generated from their references
    assert re.search(r"4 router_down\s+would compile \(generated\) product_gemv\[router_down\] k=7168 n=280", out)
    assert "no GPU kernel" not in out and "generated" not in out.replace("2 generated", "").replace("(generated)", "")
    assert "compiled" not in out.replace("0 compiled", "")


# ---------------------------------------------------------------- compile-only (CuTe DSL)

@pytest.fixture(scope="module")
def compiled(kcache):
    """Every template compiled for sm_90a and sm_100a at the TP 16 batch 1 shapes (and the
    generated input projection at 8 tokens)."""
    from codegen.compiler import clear_memory_cache, compile_kernel

    clear_memory_cache()
    out = {}
    for arch in ARCHS:
        out["attn_res_norm", arch] = compile_kernel(spec_of("k3f::attn_res_norm", arch, attn_res_args()),
                                                    cache=kcache)
        out["attn_res_norm_9", arch] = compile_kernel(
            spec_of("k3f::attn_res_norm", arch, attn_res_args(num_blocks=8)), cache=kcache)
        for t in (1, 8):
            out[f"in_proj_{t}", arch] = compile_kernel(in_proj_spec(arch, t), cache=kcache)
        for e, k in ((896, 16), (16, 4)):
            out[f"router_{e}", arch] = compile_kernel(
                spec_of("k3f::router_topk", arch, router_args(experts=e, top_k=k)), cache=kcache)
    return out


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@%p\d+\s+)?{re.escape(instr)}", ptx, re.MULTILINE))


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
def test_attn_res_norm_ptx(compiled, arch):
    k = compiled["attn_res_norm", arch]
    ptx = k.ptx
    assert f".target {arch}" in ptx and k.cache == "miss" and k.obj
    # a token's row over a cluster of 8 CTAs of 128 threads (112 vectors each): one vector a thread.
    # prefix and delta: 128-bit read-only loads; the block: cp.async straight into shared
    # memory, committed once and waited for once
    assert (k.spec.param_dict["cluster"], k.spec.param_dict["vectors"]) == (8, 1) and ".reqntid 128" in ptx
    assert _count(ptx, "ld.global.nc.v4.b32") == 2
    assert _count(ptx, "cp.async.cg.shared.global") == 1
    assert _count(ptx, "cp.async.commit_group") == 1 and _count(ptx, "cp.async.wait_group") == 1
    # PDL: the three weights (plain loads: ptxas keeps them above the wait) are all that comes
    # before griddepcontrol.wait; launch_dependents right after it, both once
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait;")
    assert _count(before, "ld.global.L1::no_allocate.L2::256B.v4.b32") == 3
    assert "ld.global.L1::no_allocate" not in after and "ld.global.nc" not in before and _count(before, "st.") == 0
    assert "griddepcontrol.launch_dependents" in after
    assert _count(ptx, "st.global.v4.b32") == 2  # new prefix and output, 128-bit stores
    assert _count(ptx, "st.shared.v4.b32") == 1  # the new prefix staged (the block came by cp.async)
    # the cluster: one relaxed arrive at the top (after both exchanges' mbarriers are made) and
    # its wait before the first push; each warp's sums sent by st.async into every CTA (2 per
    # source, then the mix's), counted in bytes on that CTA's mbarrier; no other cluster barrier,
    # nothing read from a peer, no CTA-wide barrier
    assert _count(before, "barrier.cluster.arrive.relaxed") == 1
    assert _count(ptx, "barrier.cluster.arrive") == 1 and _count(ptx, "barrier.cluster.wait") == 1
    assert _count(ptx, "st.async.shared::cluster.mbarrier::complete_tx::bytes") == 2 * 2 + 1
    assert _count(ptx, "mbarrier.init") == 2
    # each exchange's wait: a first look, then looks that trap past the deadline (a wrong byte
    # count fails the launch instead of hanging it)
    assert _count(ptx, "mbarrier.try_wait") == 2 * 2 and ptx.count("%globaltimer") == 2 * 2
    assert _count(ptx, "trap;") == 2
    assert "ld.shared::cluster" not in ptx and "st.shared::cluster" not in ptx and _count(ptx, "bar.sync") == 0
    # warp sums: 2 per source + the mix, each pushed and then gathered
    assert _count(ptx, "shfl.sync.bfly.b32") == 2 * 5 * (2 * 2 + 1)
    assert _count(ptx, "ex2.approx") == 2  # softmax over 2 sources
    # nothing scalar, no spills
    assert "st.global.b16" not in ptx and "ld.global.b16" not in ptx and ".local" not in ptx
    nine = compiled["attn_res_norm_9", arch].ptx  # 8 blocks + the prefix: 9 sources
    assert _count(nine, "ld.global.nc.v4.b32") == 2 and _count(nine, "ex2.approx") == 9
    assert _count(nine, "st.async.shared::cluster.mbarrier::complete_tx::bytes") == 2 * 9 + 1
    assert _count(nine, "cp.async.cg.shared.global") == 8  # every block's copy issued before any wait
    before_wait = nine.split("cp.async.wait_group")[0]
    assert _count(before_wait, "cp.async.cg.shared.global") == 8 and _count(before_wait, "ld.shared") == 0
    assert _count(nine, "griddepcontrol.wait") == 1 and _count(nine, "griddepcontrol.launch_dependents") == 1
    assert _count(nine, "shfl.sync.bfly.b32") == 2 * 5 * (2 * 9 + 1)


@needs_cutedsl
@pytest.mark.parametrize("name", ["attn_res_norm", "in_proj_1", "in_proj_8"])
def test_hand_written_and_generated_kernels_launch_with_pdl(compiled, name):
    assert pdl_flags(compiled[name, "sm_90a"].spec) == [1]


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("experts,top_k,warps,share", [(896, 16, 4, 2), (16, 4, 1, 4)])
def test_router_topk_ptx(compiled, arch, experts, top_k, warps, share):
    from codegen.kernels.router_topk import RouterTopk

    k = compiled[f"router_{experts}", arch]
    ptx = k.ptx
    cfg = RouterTopk(experts, top_k, True, 1.0, k.spec.param_dict["threads"])
    v, cands = cfg.per_thread, cfg.candidates
    assert f".target {arch}" in ptx and k.obj and cfg.num_warps == warps and cfg.share == share
    # PDL: one wait, then at once one trigger; before the wait only the biases are read, nothing written
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait", 1)
    gap = after.split("griddepcontrol.launch_dependents", 1)[0].splitlines()
    assert all(line.strip() in ("", ";") or line.strip().startswith("//") for line in gap)
    assert _count(before, "ld.global.b32") == v and _count(after, "ld.global.b32") == v  # biases; logits
    assert _count(before, "st.") == 0 and _count(before, "bar.sync") == 0
    # the sigmoid: one exp (ex2 after range reduction) and one approximate reciprocal per owned expert
    assert _count(ptx, "ex2.approx") == v and _count(ptx, "rcp.approx.ftz.f32") == v
    # each thread's keys sorted in registers (Batcher's network: one max and one min per pair) ...
    assert _count(ptx, "max.u64") == _count(ptx, "min.u64") == len(cfg.network)
    for bits in range(1 << v):  # ... which sorts (the 0-1 principle)
        x = [(bits >> i) & 1 for i in range(v)]
        for a, b in cfg.network:
            x[a], x[b] = max(x[a], x[b]), min(x[a], x[b])
        assert x == sorted(x, reverse=True)
    # each warp's k rounds: one redux and one ballot each, no shared memory read, no barrier
    assert _count(ptx, "redux.sync.max.u32") == top_k and _count(ptx, "vote.sync.ballot.b32") == top_k
    rounds = ptx[ptx.index("redux.sync.max.u32"):ptx.index("bar.sync")]
    assert _count(rounds, "ld.shared") == 0 and _count(rounds, "st.shared.b64") == top_k
    # the candidates ranked by counting (share threads each, one butterfly step per halving), two barriers
    assert sorted(cfg.counted(q, p) for p in range(share) for q in range(cands // share)) == list(range(cands))
    assert _count(ptx, "setp.gt.u64") == cands // share and _count(ptx, "shfl.sync.bfly.b32") == share.bit_length() - 1
    assert _count(ptx, "ld.shared.v2.b64") == (cands // share // 2 if cands // share % 2 == 0 else 0)
    assert _count(ptx, "bar.sync") == 2
    assert _count(ptx, "div.rn.f32") == 1  # renormalize: w / sum(w)
    assert _count(ptx, "st.global.b32") == 1 and _count(ptx, "st.global.b64") == 1  # weights fp32, ids int64
    assert "ld.local" not in ptx and "st.local" not in ptx  # the experts stay in registers


@needs_cutedsl
def test_cache_hits_in_a_new_process_and_other_specs_miss(compiled, kcache):
    from codegen.compiler import clear_memory_cache, compile_kernel

    spec = compiled["in_proj_1", "sm_90a"].spec
    code = ("import json, sys\nfrom codegen.compiler import compile_kernel\nfrom codegen.spec import KernelSpec\n"
            "s = json.loads(sys.argv[1])\n"
            "k = compile_kernel(KernelSpec.from_json(s))\n"
            "print(k.cache, k.key, 'cutlass' in sys.modules)")
    env = dict(os.environ, K3_REWRITER_CACHE=str(kcache.root))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec.to_json())], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["disk", compiled["in_proj_1", "sm_90a"].key, "False"]  # a hit needs no CuTe DSL import
    assert compile_kernel(spec, cache=kcache).cache == "memory"
    clear_memory_cache()
    again = compile_kernel(spec, cache=kcache)
    assert again.cache == "disk" and again.ptx == compiled["in_proj_1", "sm_90a"].ptx
    other = in_proj_spec("sm_90a", 17)  # a token tile of 32: not the fixture's
    assert compile_kernel(other, cache=kcache).cache == "miss"
    assert compile_kernel(spec.with_arch("sm_103a"), cache=kcache).cache == "miss"


@needs_cutedsl
def test_corrupt_entry_is_recompiled(compiled, kcache):
    from codegen.compiler import clear_memory_cache, compile_kernel

    k = compiled["attn_res_norm", "sm_100a"]
    path = Path(k.path)
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    assert {"manifest.json", "kernel.ptx", "kernel.o"} <= set(names)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    clear_memory_cache()
    again = compile_kernel(k.spec, cache=kcache)
    assert again.cache == "miss" and again.ptx == k.ptx and kcache.rejected
    assert compile_kernel(k.spec, cache=kcache).cache == "memory" and kcache.get(k.key) is not None


@needs_cutedsl
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the argument check on a machine without a GPU")
def test_loaded_kernel_checks_its_arguments(compiled):
    k = compiled["in_proj_1", "sm_90a"]
    fn = k.load()  # loads without a GPU
    x, w = torch.zeros(1, 7168, dtype=torch.bfloat16), torch.zeros(3216, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cuda"):
        template("products").launch((fn,), (k.spec,), (x, w, TP16_SPLIT))


@needs_cutedsl
def test_compile_command(capsys, kcache):
    args = ["compile", "--model", "kimi-k3", "--layer", "1", "--tp", "16", "--batch", "1", "--arch", "sm_90a",
            "--cache-dir", str(kcache.root)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0  # a second run: every kernel from the cache
    out = capsys.readouterr().out
    assert "9 scheduled ops, 9 with a CuTe DSL template (12 kernels)" in out
    assert re.search(r"0 attn_res_norm\s+compiled \d+\.\d+s \(cache hit\)", out)
    assert re.search(r"3 o_proj_all_reduce_attn_res\s+compiled [^\n]*gemv\[o_proj_attn_res\][^\n]*\n"
                     r"\s+compiled [^\n]*attn_res_norm", out)
    assert "12 compiled (0 cache miss, 12 hit)" in out and "2 generated; 0 fused ops without a GPU kernel" in out
    assert main([*args, "--json", "--batch", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    status = {r["kernel"]: r for r in report["kernels"]}
    assert status["attn_res_norm"]["stages"][0]["cache"] == "hit"  # tokens are a runtime size there
    gemm = status["attn_in_proj"]["stages"][0]  # batch 3: the generated GEMM
    assert gemm["spec"]["kernel"] == "product_gemm" and gemm["spec"]["shapes"] == {"k": 7168, "n": 3206,
                                                                                   "token_tile": 16}
    assert status["router_topk"]["stages"][0]["cache"] == "hit"  # tokens are a runtime size there too
    assert report["compiled"] == 12 and report["failed"] == 0


def test_compile_all_layers_plans_every_structure_and_compiles_each_kernel_once(capsys, tmp_path):
    """``compile --all-layers`` on the tiny model: every layer structure at each batch planned in
    worker processes, each distinct kernel compiled once (cache misses), then all read back from
    the cache by a second run; the JSON names the layers that cannot be served and why."""
    args = ["compile", "--all-layers", "--model", "tiny", "--batches", "1", "3", "--arch", "sm_90a", "--jobs", "2",
            "--cache-dir", str(tmp_path), "--json"]
    if not HAVE_CUTEDSL:
        args.append("--dry-run")
    assert main(args) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["structures"] == 6 and cold["plans"] == 12 and cold["batches"] == [1, 3]
    assert cold["kernels"] >= 5 and cold["layers_served"] == 0  # the tiny sizes are below several kernels'
    assert "layer 4 batch 1" in cold["refusals"] and "K 64" in cold["refusals"]["layer 4 batch 1"]
    if not HAVE_CUTEDSL:
        return
    assert cold["compiled"] == cold["cache_misses"] == cold["kernels"] and cold["failed"] == 0
    assert main(args) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["compiled"] == cold["kernels"] and warm["cache_misses"] == 0


def test_compile_all_layers_for_verify_steps_plans_the_served_request_counts(capsys, tmp_path):
    """``--q 4`` without ``--batches``: the request counts whose 4-token verify steps the server
    serves (the one-token token counts rounded up to whole requests, at most 64 tokens)."""
    assert main(["compile", "--all-layers", "--model", "tiny", "--q", "4", "--arch", "sm_90a", "--jobs", "2",
                 "--cache-dir", str(tmp_path), "--json", "--dry-run", "--block-size", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["batches"] == [1, 2, 4, 8, 16] and report["plans"] == 6 * 5
    assert report["block_size"] == 16  # as given, not vLLM's


def test_compile_for_a_gpu_of_fewer_sms_plans_its_mla_grid(capsys, tmp_path):
    """``--sms 78`` (an H20): an MLA layer's ``mla_attend`` is planned on a grid of at most 78 CTAs,
    the kernel that GPU's server launches, for one layer and for ``--all-layers`` (which names the
    layers that GPU cannot serve: at TP 4, 64 tokens x 2 head groups); a bad count is refused."""
    args = ["compile", "--layer", "3", "--tp", "16", "--batch", "8", "--arch", "sm_90a", "--dry-run"]
    assert main([*args, "--sms", "78"]) == 0
    out = capsys.readouterr().out
    assert "sm_90a (78 SMs)" in out and re.search(r"would compile mla_attend [^\n]*max_ctas=78", out)
    assert main(args) == 0
    assert "max_ctas" not in capsys.readouterr().out
    assert main(["compile", "--all-layers", "--tp", "4", "--batches", "8", "64", "--arch", "sm_90a", "--sms", "78",
                 "--jobs", "2", "--cache-dir", str(tmp_path), "--json", "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sms"] == 78 and report["layers_served"] == 69  # the 24 MLA layers cannot take 64 tokens
    assert report["block_size"] == 1536  # the page vLLM binds at TP 4 with a bf16 cache (rewriter.model.pages)
    assert "more CTAs than the 78 SMs of the GPU hold" in report["refusals"]["layer 3 batch 64"]
    assert "layer 3 batch 8" not in report["refusals"]
    assert main([*args, "--sms", "0"]) == 2
    assert "--sms must be >= 1, got 0" in capsys.readouterr().err


def test_compile_batches_and_jobs_need_all_layers(capsys):
    assert main(["compile", "--model", "tiny", "--layer", "1", "--jobs", "2", "--dry-run"]) == 2
    assert "--batches and --jobs go with --all-layers" in capsys.readouterr().err


# What each CuTe DSL kernel is built on, as its PTX must show (on every arch)
BUILT_ON = {
    "attn_res_norm": ("ld.global.nc.v4", "shfl.sync.bfly"),
    "kda_core": ("shfl.sync.bfly", "ex2.approx"),
    "o_proj_gemm": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global",
                    "ldmatrix.sync.aligned"),
    "mlp_gate_up_gemm": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global",
                         "ex2.approx"),
    "mlp_down_gemm": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global"),
    "latent_tail_gemm": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global",
                         "ldmatrix.sync.aligned", "rsqrt.approx"),
    "gemv": ("ld.global.L1::no_allocate.L2::256B.v4", "shfl.sync.bfly"),
    # generated: the GEMV's and the GEMM's main loops (the router's and the input projection's ops)
    "product_gemv": ("ld.global.L1::no_allocate.L2::256B.v4", "shfl.sync.bfly"),
    "product_gemm": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global",
                     "ldmatrix.sync.aligned"),
    "router_topk": ("redux.sync.max.u32", "vote.sync.ballot.b32", "ex2.approx"),
    "expert_up": ("ld.global.L1::no_allocate.L2::256B.v4",),
    "expert_down": ("ld.global.L1::no_allocate.L2::256B.v4",),
    "expert_up_mxfp4": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mul.rn.bf16x2"),
    "expert_down_mxfp4": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mul.rn.bf16x2"),
}
# the per-pair stages' clusters; the up stage per chosen expert streams its K through cp.async stages
BUILT_ON_PAIRS = ("barrier.cluster.arrive",)
STREAMED = ("cp.async.cg.shared.global", "cp.async.ca.shared.global", "ld.shared.v4")
# the MXFP4 stages' weights: into registers, or (from MXFP4_SMEM_WEIGHTS_FROM tokens) into shared memory
KDA_STATE_LOADS = {False: ("ld.global.L1::no_allocate.L2::256B.v4",),
                   True: ("cp.async.cg.shared.global", "cp.async.wait_group", "ld.shared.v4")}
MXFP4_WEIGHT_LOADS = {False: ("ld.global.L1::no_allocate.v4.b32",), True: ("cp.async.cg.shared.global", "ld.shared.v4")}


@needs_cutedsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch,experts", [(1, "mxfp4"), (64, "mxfp4"), (1, "bf16")])
def test_every_kernel_of_the_kda_moe_layer_compiles(capsys, kcache, arch, batch, experts):
    """The CI check of issue #4: every kernel of the KDA+MoE layer's schedule compiles for sm_90a
    and sm_100a without a GPU, and its PTX holds the instructions the kernel is built on; with the
    checkpoint's MXFP4 experts (what is served) and with bf16 ones."""
    assert main(["compile", "--layer", "1", "--tp", "16", "--batch", str(batch), "--arch", arch, "--experts",
                 experts, "--cache-dir", str(kcache.root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == 0
    # from 16 MXFP4 tokens the router and the experts are one op (routed_moe_mxfp4), of three stages
    by_expert = experts == "mxfp4" and batch >= patterns.moe.MOE_BY_EXPERT_FROM
    assert [r["status"] for r in report["kernels"]] == ["compiled"] * (8 if by_expert else 9)
    stages = [st for r in report["kernels"] for st in r["stages"]]
    assert len(stages) == 12
    for st in stages:
        name = st["spec"]["kernel"]
        ptx = kcache.get(st["key"]).ptx
        assert f".target {arch}" in ptx, name
        extra = ()
        if "by_expert_max_tokens" in st["spec"]["params"]:
            extra = STREAMED
        elif name == "kda_core":  # state and weights: into registers, or (persistent, 64 tokens) shared memory
            extra = KDA_STATE_LOADS[bool(st["spec"]["params"].get("persistent"))]
        elif name.endswith("_mxfp4"):
            extra = BUILT_ON_PAIRS + MXFP4_WEIGHT_LOADS[bool(st["spec"]["params"].get("smem_weights"))]
        missing = [instr for instr in (*BUILT_ON[name], *extra) if instr not in ptx]
        assert not missing, f"{name} ({arch}): PTX lacks {missing}"
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{name} ({arch}) uses local memory"


@pytest.mark.parametrize("tp,batch", [(16, 1), (8, 8), (16, 64)])
def test_templates_launch_as_many_kernels_as_their_rules_declare(tp, batch):
    """The schedule's kernel count (rules' ``launches``) is what the templates really launch."""
    from rewriter.compiler.plan import plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.schedule import build_schedule
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    shape = DecodeShape(batch=batch, tp=tp, arch="sm_90a")
    result = rewrite(trace(build_layer(KimiK3Config.preset("kimi-k3"), 1, tp=tp), shape))
    launches = {k.name: k.launches for k in build_schedule(result.after).kernels}
    rows = [r for r in plan(result, "sm_90a") if r.get("specs")]
    assert rows  # some template takes a kernel of this layer
    for row in rows:
        assert len(row["specs"]) == launches[row["kernel"]], row["kernel"]


@needs_cutedsl
def test_server_compile_step_shows_each_kernel_it_compiles(tmp_path, monkeypatch):
    """At server start every cache miss is a progress line (a compile takes seconds)."""
    from codegen.compiler import clear_memory_cache
    from rewriter.compiler.plan import plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape
    from rewriter.vllm.programs import compile_with_codegen

    clear_memory_cache()  # kernels compiled by earlier tests would be memory hits
    monkeypatch.setenv("K3_REWRITER_CACHE", str(tmp_path))
    import rewriter.vllm.programs as programs

    installed = []  # no CUDA here: record the registration instead of making it
    monkeypatch.setattr(programs, "install_kernels", lambda arch, strict: installed.append((arch, strict)))
    monkeypatch.setattr(programs, "require_cuda_kernels", lambda result, rows: None)
    result = rewrite(trace(build_layer(KimiK3Config.preset("kimi-k3"), 1, tp=16), DecodeShape(batch=1, tp=16)))
    lines = []
    compile_with_codegen("sm_90a", progress=lines.append)(result, plan(result, "sm_90a"))
    assert installed == [("sm_90a", True)]  # strict: a served step never runs a reference
    assert len(lines) == 12 and all(line.startswith("rewriter: compiling ") for line in lines)
    assert sum("kda_core" in line for line in lines) == 1


def test_load_kernels_says_why_not():
    assert "99 tokens outside" in bind.load_kernels("k3f::kda_in_proj", "sm_90a", in_proj_args(tokens=99))
    assert bind.load_kernels("k3f::kda_in_proj", "sm_90a", in_proj_args(), "nope") == \
        "no CuTe DSL template named 'nope'"
    assert "outside 1..64" in bind.load_kernels("kda_in_proj", "sm_90a", in_proj_args(tokens=65), "products")


@needs_cutedsl
def test_load_kernels_loads_the_named_template_or_the_one_the_call_picks(kcache, monkeypatch):
    monkeypatch.setenv("K3_REWRITER_CACHE", str(kcache.root))
    tpl, specs, fns = bind.load_kernels("k3f::attn_res_norm", "sm_90a", attn_res_args(tokens=3), "attn_res_norm")
    assert tpl.kernel == specs[0].kernel == "attn_res_norm" and len(fns) == 1  # loads without a GPU
    tpl, specs, fns = bind.load_kernels("kda_in_proj", "sm_90a", in_proj_args(tokens=1))
    assert tpl.kernel == "products" and specs[0].kernel == "product_gemv" and len(fns) == 1


@needs_cutedsl
def test_a_spec_the_kernel_refuses_is_a_named_compile_failure(tmp_path):
    """A bound the kernel holds and its template lets through (a spec made by hand here: more MLA
    heads than the kernel takes) fails the compile with the reason, as a CodegenError that
    ``compile --all-layers`` counts and a server start turns into a stock layer, not a crash."""
    from codegen.compiler import CodegenError, compile_kernel

    spec = KernelSpec.make("mla_attend", "k3f::mla_attend", "sm_90a",
                           shapes={"batch": 1, "heads": 130, "block_size": 64},
                           dtypes={"q": "bf16", "cache": "bf16", "weight": "bf16"},
                           params={"scale": 0.07, "gate_stride": 130 * 128})
    with pytest.raises(CodegenError, match="the kernel refuses its spec: heads 130 outside 1..128"):
        compile_kernel(spec, cache=KernelCache(str(tmp_path)))


@needs_cutedsl
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48])
def test_every_kernel_a_plan_lists_builds(tp):
    """What ``inspect`` counts as rewritten is what a server compiles: every spec the templates
    accept for layers 0, 1 and 3 of Kimi K3 at 1, 8 and 64 tokens builds its kernel object (the
    kernels' own bounds agree with their templates'; no compile, so every TP size stays cheap)."""
    import importlib

    from rewriter.compiler.plan import plan
    from rewriter.compiler.rewrite import rewrite
    from rewriter.compiler.trace import trace
    from rewriter.model.config import KimiK3Config
    from rewriter.model.layers import build_layer
    from rewriter.model.shape import DecodeShape

    cfg = KimiK3Config.preset("kimi-k3")
    built = set()
    for layer_idx in (0, 1, 3):
        layer = build_layer(cfg, layer_idx, tp=tp, rank=0, dtype=torch.bfloat16, experts="mxfp4")
        for batch in (1, 8, 64):
            rows = plan(rewrite(trace(layer, DecodeShape(batch=batch, tp=tp, arch="sm_90a"))), "sm_90a")
            for spec in (s for row in rows for s in row.get("specs", ())):
                importlib.import_module(f"codegen.kernels.{spec.module}").build(spec)
                built.add(spec)
    assert len(built) > 20  # the plans listed kernels: the layers were rewritten
