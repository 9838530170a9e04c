"""The compiler: trace a reference layer into torch.fx (``trace``), match the fusion rules
(``rules``, the engine; the built-in rules live in ``patterns/``) and rewrite (``rewrite``),
schedule the kernels (``schedule``, with the bytes of ``cost`` and vLLM's stock kernels of
``stock_kernels``), plan the CuTe DSL kernels of a schedule (``plan``), run a rewritten layer
(``program``) and keep rewritten graphs on disk (``program_cache``). ``pipeline`` drives it
for one layer at one decode shape."""
