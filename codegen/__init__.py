"""CuTe DSL kernel templates for the fused ops of ``patterns/``, their tensor-free compile
entry, the on-disk cache and the binding of compiled kernels to the ``k3f`` ops. Knows
nothing of torch.fx. See docs/CODEGEN.md.

- ``spec``: ``KernelSpec``, what a compiled kernel is specialized to (no tensors);
- ``targets``: the architectures and token limits the kernels are built for;
- ``host``: what the compiler hands the templates (collectives, decode state layouts);
- ``templates``: the templates of ``launchers/`` (found there), specs from op arguments, refusals
  (no CuTe import);
- ``kernels/``: the CuTe DSL kernel classes (import CuTe DSL);
- ``compiler``: ``compile_kernel`` / ``compile_schedule``, cached in memory and on disk;
- ``cache``: the disk cache (atomic entries, file locks, verification);
- ``bind``: ``register_cuda_impl`` / ``install_cuda_kernels`` (nothing registers at import).
"""
