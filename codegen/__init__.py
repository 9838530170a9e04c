"""CuTe DSL kernel templates for the fused ops of ``patterns/``, their tensor-free
compile entry and the on-disk cache. Knows nothing of torch.fx. See DESIGN.md."""
