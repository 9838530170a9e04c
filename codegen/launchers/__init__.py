"""The templates: one module per fused op (or family of ops), each defining ``TEMPLATE`` or
``TEMPLATES`` (``codegen.templates`` finds them), plus the spec helpers several share
(``gemm_specs``, ``gemv_specs``). No CuTe DSL import here."""
