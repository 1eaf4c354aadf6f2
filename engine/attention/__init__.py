"""Attention over the paged KV cache: `cpu_ops` (the CPU path: the C kernels, and plain
torch, on any device, where they do not run) and `triton_ops` (GPU kernels), with the same
signatures."""
