"""Attention backends: ``torch`` (reference, CPU default) and ``triton`` (CUDA default)."""
