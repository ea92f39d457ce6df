"""Kernel families: one module per op family, kernels beside their launch code."""
