"""Trace one Kimi K3 layer at a decode shape and print where its bytes go.

    python examples/inspect_layer.py            # KDA+MoE layer 1 at TP 8, batch 4
"""
from rewriter.compiler.cost import floor_bytes, hbm_us, region_bytes
from rewriter.compiler.trace import trace
from rewriter.model.config import KimiK3Config
from rewriter.model.layers import build_layer
from rewriter.model.shape import DecodeShape

cfg = KimiK3Config.preset("kimi-k3")
lg = trace(build_layer(cfg, 1, tp=8), DecodeShape(batch=4, tp=8))
print(f"layer 1 ({lg.kind}): {len(lg.graph.nodes)} fx nodes")
by_region = sorted(region_bytes(lg.graph, lg.shape).items(), key=lambda kv: -kv[1])
for region, b in by_region[:6]:
    print(f"  {region:<22} {b / 1e6:8.2f} MB")
floor = floor_bytes(lg.graph, lg.shape)
print(f"floor: {floor / 1e6:.1f} MB = {hbm_us(floor):.1f} us at 4.27 TB/s")
