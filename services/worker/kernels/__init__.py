"""Triton kernels of the GPU path (attention.py: paged attention + KV write; elementwise.py:
residual-add + RMSNorm, RoPE, SiLU·mul). Importing this package does not import triton: the CPU
path never needs it. Tests run the kernels on the CPU with TRITON_INTERPRET=1."""
