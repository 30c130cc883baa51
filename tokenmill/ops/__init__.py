"""Device kernels beside the native CPU ones (tokenmill/kernels): Triton kernels for
the CUDA path (`triton_attention`). Nothing here is imported unless the platform picks
it, so a CPU-only install without triton is unaffected."""
