"""Lowering: how one module's forward computes in a precision.

Below the stages that run modules in a precision — probe (one layer at a time) and apply (a
whole plan) — and above the number formats (``autoprec.formats``):

- ``forward``: ``lowered_forward`` wraps a module's forward in its precision's region
  (fp32 / tf32 / bf16 / fp16: autocast, tf32 flags or their emulation) or hands a
  Linear-like leaf to its GEMM backend (fp8 / mxfp8 / nvfp4);
- ``backends``: the GEMM formats behind one call, run by ``fp8`` (per-tensor current
  scaling) and ``blockscale`` (MXFP8 / NVFP4 block scales), and ``nvfp4_train`` (NVIDIA's
  NVFP4 training recipe: the three GEMMs of a training step, what the train form runs);
- ``autocast``: what ``torch.autocast`` does to each op per device type (the plan prices
  it), and the mode that runs CUDA's fp32 ops in fp32 on a CPU.
"""
