"""Fusion rules, one module per family (attention projection, output projection +
all-reduce + residual, router, MoE). Each rule is a pattern traced like the model, a
guard on shapes, dtypes, TP and arch, and the fused op it becomes. See DESIGN.md."""
