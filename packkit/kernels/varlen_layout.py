"""The packed (varlen) layout every attention kernel takes, and its shape checks (torch only, no triton).

::

    q:          (total_tokens, nheads, headdim)
    k, v:       (total_tokens, nheads_kv, headdim), nheads % nheads_kv == 0
    cu_seqlens: (num_segments + 1,) int32, on q's device

It lives at the bottom, beside the kernels, so that ``packkit.attention`` (every backend) and the
Triton launcher (:mod:`packkit.kernels.flash_varlen`) call the same checks, and nothing here imports
back up.
"""

from __future__ import annotations

import torch


def check_varlen_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int) -> None:
    """Shapes, dtypes and devices of a varlen call; reads no tensor values (no sync).

    Raises ValueError (TypeError for mixed dtypes) naming what is wrong, e.g. "nheads=3 must be a
    multiple of nheads_kv=2 (GQA/MQA)".
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (total_tokens, heads, headdim); got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must be (total_tokens={q.shape[0]}, nheads_kv, headdim={q.shape[2]}); "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"nheads={q.shape[1]} must be a multiple of nheads_kv={k.shape[1]} (GQA/MQA)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor (num_segments + 1,); got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if not (q.device == k.device == v.device == cu_seqlens.device):
        raise ValueError(f"q, k, v and cu_seqlens must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}, {cu_seqlens.device} (move cu_seqlens with .to(q.device))")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0; got {max_seqlen}")


def check_num_segments(num_segments, cu_seqlens: torch.Tensor) -> None:
    """num_segments: None, or a Python int in [0, len(cu_seqlens) - 1] (shape only; no values read).

    Raises TypeError for a tensor or a bool (a count on the device would force a sync), ValueError
    out of range, e.g. "num_segments=4 must be in [0, 3] (cu_seqlens has 4 entries)".
    """
    if num_segments is None:
        return
    if isinstance(num_segments, torch.Tensor) or not isinstance(num_segments, int) or isinstance(num_segments, bool):
        raise TypeError(f"num_segments must be a Python int known on the host (the collator's count of real "
                        f"segments; a tensor would force a sync); got {type(num_segments).__name__}")
    if not 0 <= num_segments <= cu_seqlens.numel() - 1:
        raise ValueError(f"num_segments={num_segments} must be in [0, {cu_seqlens.numel() - 1}] "
                         f"(cu_seqlens has {cu_seqlens.numel()} entries)")
