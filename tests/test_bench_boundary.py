"""``examples/bench_boundary.py``: each way of crossing a kernel boundary compiles to the waits it
names (CPU), and on the GPU every way carries each link's value to the next (a link that read
before the previous one wrote would break the chain)."""
from __future__ import annotations

import pytest
import torch

from conftest import cute_example, needs_cutedsl, on_gpu


def _bench():
    return cute_example("bench_boundary")


@needs_cutedsl
@pytest.mark.parametrize("mode", ["plain", "pdl", "flag", "flag-entry"])
def test_each_mode_waits_as_it_says(mode):
    bench, _ = _bench()
    ptx, _ = bench.compiled_link(8, mode, "sm_90a")
    wait, trigger = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
    if mode == "plain":
        assert wait == trigger == 0 and "atom.global" not in ptx
    elif mode == "pdl":
        assert wait == trigger == 1 and ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        assert "atom.global" not in ptx
    else:  # a relaxed spin on the counter, fenced; the count raised after the write; the grid wait at exit
        assert wait == trigger == 1 and ptx.count("atom.global.add") == 1 and ptx.count("fence.acq_rel.gpu") == 2
        assert "ld.relaxed.gpu" in ptx and ptx.rindex("griddepcontrol.wait") > ptx.index("atom.global.add")
        spin = ptx.index("ld.relaxed.gpu")
        assert (ptx.index("griddepcontrol.launch_dependents") < spin) == (mode == "flag-entry")
    with pytest.raises(ValueError, match="mode 'fast'"):
        bench.Link(8, "fast")


@on_gpu
@pytest.mark.parametrize("mode", ["plain", "pdl", "flag", "flag-entry"])
@pytest.mark.parametrize("ctas", [1, 132])
def test_every_mode_carries_the_chain(mode, ctas):
    bench, arch = _bench()
    _, fn = bench.compiled_link(ctas, mode, arch)
    _, last = bench.chain_us(fn, ctas, 16, reps=3)
    assert torch.equal(last, torch.full_like(last, 16.0))
