"""Helpers shared by the attention and kernel tests (not a test module)."""

from __future__ import annotations

import torch

from packkit.segments import lengths_to_cu_seqlens


def cu_seqlens_of(lengths, device="cpu") -> torch.Tensor:
    """``[2, 0, 3] -> tensor([0, 2, 2, 5], dtype=int32)`` on ``device``."""
    return torch.from_numpy(lengths_to_cu_seqlens(list(lengths))).to(device)


def assert_close(name, actual, expected, atol, rtol):
    """Print max / mean difference, then assert max |err| <= atol + rtol * max|expected|."""
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.abs().max().item()
    print(f"{name}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}, bound {bound:.3e}")
    assert diff.max().item() <= bound, f"{name}: max diff {diff.max().item():.3e} > {bound:.3e}"
