"""The command line (``python -m rewriter``, ``k3-rewriter``) and its measuring tools:
``inspect`` and its report, ``compile`` (one layer or every layer), ``bench`` with vLLM's stock
path, ``decode`` (the numerics gate), ``fuzz``, the replay timelines and kernel-source variants.
Library code never imports this package."""
