"""Attention over the paged KV cache: `torch_ops` (CPU, and any device torch runs on) and
`triton_ops` (GPU kernels), with the same signatures."""
