"""What ptxas makes of a kernel's PTX, without a GPU: its registers and spills (``ptxas -v``),
and its SASS (``nvdisasm``) counted by instruction.

Why: a kernel change can be judged on the CPU before any device time is spent on it, e.g. how
many integer instructions the MXFP4 dequantization costs per ``HMMA``, whether a load moved
above a wait, whether registers leave room for the CTAs per SM a launcher asks for. ptxas comes
with the ``nvidia-cuda-nvcc`` wheel (installed beside CuTe DSL) or CUDA on ``PATH``; nvdisasm
with ``pip install nvidia-cuda-nvdisasm`` or CUDA.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# an instruction line of nvdisasm's output: /*0120*/  @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)",
                          re.MULTILINE)


class SassError(RuntimeError):
    """A tool is missing or refused the kernel; the message says which and what to install."""


def find_tool(name: str) -> list[str]:
    """Paths of ``name`` (ptxas, nvdisasm): NVIDIA's CUDA wheels first, then ``PATH``."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = [str(p) for root in roots for p in sorted(Path(root).glob(f"cu*/bin/{name}"))]
    return found + ([shutil.which(name)] if shutil.which(name) else [])


@dataclass
class Resources:
    registers: int  # per thread
    spill_bytes: int  # spill stores
    cubin: bytes


def assemble(ptx: str, arch: str) -> Resources:
    """The kernel's cubin and what ``ptxas -v`` says of it; the first ptxas that reads this PTX
    (an older one refuses a newer PTX version)."""
    candidates = find_tool("ptxas")
    if not candidates:
        raise SassError("no ptxas (pip install nvidia-cuda-nvcc, or CUDA on PATH)")
    errors = []
    with tempfile.TemporaryDirectory(prefix="k3-sass-") as d:
        src, out = Path(d) / "kernel.ptx", Path(d) / "kernel.cubin"
        src.write_text(ptx)
        for ptxas in candidates:
            run = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(out)], capture_output=True,
                                 text=True)
            if run.returncode == 0:
                return Resources(max((int(r) for r in re.findall(r"Used (\d+) registers", run.stderr)), default=0),
                                 sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", run.stderr)),
                                 out.read_bytes())
            errors.append(f"{ptxas}: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode}")
    raise SassError(f"no ptxas reads this PTX: {'; '.join(errors)}")


def disassemble(cubin: bytes) -> str:
    """nvdisasm's SASS of a cubin."""
    candidates = find_tool("nvdisasm")
    if not candidates:
        raise SassError("no nvdisasm (pip install nvidia-cuda-nvdisasm, or CUDA on PATH)")
    with tempfile.TemporaryDirectory(prefix="k3-sass-") as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        run = subprocess.run([candidates[0], str(path)], capture_output=True, text=True)
    if run.returncode:
        raise SassError(f"{candidates[0]} failed: {run.stderr.strip()}")
    return run.stdout


def instruction_mix(sass: str, *, modifiers: bool = False) -> Counter:
    """How many of each instruction the SASS holds (static counts: a loop body counts once), by
    opcode (``LDG``), or with ``modifiers`` by opcode and modifiers (``LDG.E.128``)."""
    return Counter(op + (mods if modifiers else "") for op, mods in _INSTRUCTION.findall(sass))


def summary(ptx: str, arch: str, top: int = 10) -> tuple[dict, str]:
    """(the figures, one line): registers, spill bytes, SASS instructions in all and the ``top``
    opcodes by count."""
    res = assemble(ptx, arch)
    return describe(res, disassemble(res.cubin), top)


def describe(res: Resources, sass: str, top: int = 10) -> tuple[dict, str]:
    """``summary`` of an assembled kernel and its SASS (for a caller that keeps the SASS too)."""
    mix = instruction_mix(sass)
    figures = {"registers": res.registers, "spill_bytes": res.spill_bytes, "instructions": sum(mix.values()),
               "opcodes": dict(mix.most_common())}
    spills = f"{res.spill_bytes} bytes spilled" if res.spill_bytes else "no spills"
    line = (f"{res.registers} registers, {spills}; {figures['instructions']} SASS instructions: "
            + ", ".join(f"{op} {n}" for op, n in mix.most_common(top)))
    return figures, line


def read_only_loads_before_wait(sass: str) -> list[str]:
    """The ``ld.global.nc`` loads (SASS ``LDG...CONSTANT``) a kernel issues before its
    ``griddepcontrol.wait`` (SASS ``ACQBULK``). ptxas moves such loads across the wait (it takes
    them for data no one writes while the kernel runs), so one of an activation placed after
    the wait in the source can end up before it: a race with the kernel that writes it. Weights
    go before the wait as plain loads; this list is empty for every served kernel."""
    ops = [op + mods for op, mods in _INSTRUCTION.findall(sass)]
    if "ACQBULK" not in ops:
        return []
    return [op for op in ops[:ops.index("ACQBULK")] if op.startswith("LDG") and ".CONSTANT" in op]
