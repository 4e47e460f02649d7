"""Triton kernels for CUDA; each one is checked against its torch reference (CPU runs the reference)."""
