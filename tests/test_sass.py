"""``codegen/sass.py`` and ``compile --sass``: instructions counted from nvdisasm's text (a trimmed
real listing: the one-token o_proj GEMV on sm_90a), and a real kernel's SASS against its PTX where
ptxas and nvdisasm are installed (NVIDIA's ``nvidia-cuda-nvcc`` and ``nvidia-cuda-nvdisasm``
wheels, the ``sass`` extra)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from codegen.sass import instruction_mix, read_only_loads_before_wait
from conftest import needs_cutedsl, needs_sass_tools, sass_or_skip
from rewriter.commands.cli import main

SAMPLE = Path(__file__).parent / "data" / "sass_sample.sass"

def test_instructions_are_counted_by_opcode_predicated_ones_too():
    mix = instruction_mix(SAMPLE.read_text())
    assert sum(mix.values()) == 54  # /*0000*/ .. /*0350*/; directives, labels and header lines are not instructions
    assert (mix["LDG"], mix["FFMA"], mix["PRMT"], mix["EXIT"], mix["ACQBULK"]) == (7, 6, 7, 1, 1)
    full = instruction_mix(SAMPLE.read_text(), modifiers=True)
    assert (full["LDG.E.NA.LTC256B.128"], full["LDG.E.128.CONSTANT"], full["IMAD.WIDE.U32"]) == (4, 3, 2)


@needs_cutedsl
@needs_sass_tools
def test_a_kernels_sass_has_its_ptxs_mmas_and_registers():
    """The one-token MXFP4 up stage: one HMMA per ``mma.sync`` of its PTX, and the registers its
    launch asks ptxas to keep to (four CTAs of 4 warps an SM: at most 128)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from codegen.compiler import compile_kernel
    from codegen.sass import summary
    from codegen.templates import spec_for_call
    from test_kernels_mxfp4 import OP, mxfp4_args

    spec = spec_for_call(OP, "sm_90a", mxfp4_args(tokens=1))[1][0]
    k = compile_kernel(spec)
    figures, line = sass_or_skip(lambda: summary(k.ptx, "sm_90a", top=3))
    assert figures["opcodes"]["HMMA"] == k.ptx.count("mma.sync.aligned.m16n8k16") > 0
    assert 0 < figures["registers"] <= 128 and figures["spill_bytes"] == 0
    assert figures["instructions"] == sum(figures["opcodes"].values())
    assert line.startswith(f"{figures['registers']} registers, no spills; "
                           f"{figures['instructions']} SASS instructions: ")
    assert line.count(",") == 1 + 2  # the top 3 opcodes


@needs_cutedsl
@needs_sass_tools
def test_compile_prints_each_kernels_sass_summary_and_writes_its_sass(capsys, tmp_path):
    argv = ["compile", "--model", "tiny", "--layer", "1", "--arch", "sm_90a", "--cache-dir", str(tmp_path / "cache"),
            "--sass", "--sass-dir", str(tmp_path / "sass")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    if "no SASS: no ptxas reads this PTX" in out:
        pytest.skip("the installed ptxas is older than the PTX")
    written = sorted((tmp_path / "sass").glob("*.sass"))
    assert written and out.count(" SASS instructions: ") == len(written)
    assert all(instruction_mix(p.read_text()) for p in written)


def test_sass_options_are_refused_where_they_cannot_work(capsys):
    assert main(["compile", "--sass-dir", "x"]) == 2
    assert "--sass-dir goes with --sass" in capsys.readouterr().err
    assert main(["compile", "--sass", "--dry-run"]) == 2
    assert "leave out --dry-run" in capsys.readouterr().err


def test_a_read_only_load_above_the_wait_is_found():
    sass = SAMPLE.read_text()
    assert read_only_loads_before_wait(sass) == []  # the sample's read-only loads follow ACQBULK
    moved = sass.replace("ACQBULK ;", "NOP ;").replace("LDC.64 R28, c[0x0][0x210] ;", "ACQBULK ;")
    assert read_only_loads_before_wait(moved) == []  # the wait still before them
    early = sass.replace("ACQBULK ;", "NOP ;").replace("LDG.E.128.CONSTANT R4, desc[UR4][R28.64+0x400] ;",
                                                      "ACQBULK ;")
    assert read_only_loads_before_wait(early) == ["LDG.E.128.CONSTANT"] * 2


@needs_cutedsl
@needs_sass_tools
@pytest.mark.parametrize("layer, batches", [(1, (1, 8, 64)), (3, (1, 8, 64)), (0, (1, 8))])
def test_no_served_kernel_reads_an_activation_before_its_wait(layer, batches, kcache):
    """In SASS, not PTX (where the tests of each kernel look): no ``ld.global.nc`` ahead of
    ``griddepcontrol.wait`` in any kernel of the layer's schedules at TP 16 (ptxas moves them;
    the gemv's x loads between wait and trigger went above it as ld.global.nc)."""
    from codegen.compiler import compile_kernel
    from codegen.sass import assemble, disassemble
    from rewriter.compiler.pipeline import decode_shape, rewritten_layer
    from rewriter.compiler.plan import plan
    from rewriter.model.config import KimiK3Config

    seen = {}
    for batch in batches:
        cfg = KimiK3Config.preset("kimi-k3")
        shape = decode_shape(cfg, batch=batch, tp=16, arch="sm_90a", block_size=64)
        for row in plan(rewritten_layer(cfg, layer, shape), "sm_90a"):
            for spec in row.get("specs", ()):
                k = compile_kernel(spec, cache=kcache)
                if k.key not in seen:
                    sass = sass_or_skip(lambda: disassemble(assemble(k.ptx, "sm_90a").cubin))
                    seen[k.key] = (spec.label(), read_only_loads_before_wait(sass))
    assert len(seen) >= 2 * len(batches)
    assert [(label, loads) for label, loads in seen.values() if loads] == []
