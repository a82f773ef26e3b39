"""Triton kernels, shipped inside the wheel as ``packkit.kernels``."""
