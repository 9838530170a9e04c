"""The model: Kimi K3's config and TP shard shapes, the decode shape a layer is specialized to,
the reference layers in plain PyTorch (vLLM's parameter names) and their leaf ops (``k3::``),
which every rewrite and kernel is checked against. Knows nothing of rules or kernels."""
