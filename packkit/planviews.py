"""The views of a :class:`~packkit.binpack.Plan` that planning itself never takes: a range of its windows, the plan
with some segments dropped, its windows cut into ranges of a token budget, the figures a user logs and its ``repr``.
:class:`~packkit.binpack.Plan`'s methods of those names (with their docstrings) call these, so that a command that
plans (``packkit plan``, ``waste``) does not compile them: each takes the plan, and builds a new one with
``dataclasses.replace`` (no import of :mod:`packkit.binpack`).

    >>> from packkit.binpack import pack
    >>> chunks(pack([5, 3, 4, 2], window=8), 8)
    [(0, 1), (1, 2)]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import check_int
from .segments import lengths_to_offsets

__all__ = ["window_range", "keep_segments", "chunks", "summary", "plan_repr"]


def window_range(plan, start: int, stop: int):
    """:meth:`packkit.binpack.Plan.window_range`: windows ``start .. stop - 1`` as views of ``plan``'s arrays."""
    if not 0 <= start <= stop <= plan.num_windows:
        raise IndexError(f"windows {start}..{stop} out of range for a plan of {plan.num_windows} windows")
    lo, hi = int(plan.window_ptr[start]), int(plan.window_ptr[stop])
    return dataclasses.replace(plan, seg_example=plan.seg_example[lo:hi], seg_start=plan.seg_start[lo:hi],
                               seg_length=plan.seg_length[lo:hi],
                               window_ptr=plan.window_ptr[start: stop + 1] - lo,
                               seg_group=None if plan.seg_group is None else plan.seg_group[lo:hi])


def keep_segments(plan, keep):
    """:meth:`packkit.binpack.Plan.keep_segments`: only the segments where ``keep``, empty windows gone."""
    keep = np.asarray(keep, bool)
    if keep.shape != plan.seg_example.shape:
        raise ValueError(f"keep must be one bool per segment ({plan.num_segments:,}), got shape {keep.shape}")
    counts = np.diff(lengths_to_offsets(keep)[plan.window_ptr])  # kept segments per window
    return dataclasses.replace(
        plan, seg_example=plan.seg_example[keep], seg_start=plan.seg_start[keep], seg_length=plan.seg_length[keep],
        window_ptr=lengths_to_offsets(counts[counts > 0]),
        seg_group=None if plan.seg_group is None else plan.seg_group[keep])


def chunks(plan, max_tokens: int) -> list[tuple[int, int]]:
    """:meth:`packkit.binpack.Plan.chunks`: consecutive window ranges of at most ``max_tokens`` tokens each."""
    max_tokens = check_int(max_tokens, "max_tokens")
    ends = lengths_to_offsets(plan.window_loads)
    out, start = [], 0
    while start < plan.num_windows:
        # the last window whose end stays within max_tokens of this range's start (at least one)
        stop = int(np.searchsorted(ends, ends[start] + max_tokens, side="right")) - 1
        stop = max(stop, start + 1)
        out.append((start, stop))
        start = stop
    return out


def summary(plan) -> dict:
    """:meth:`packkit.binpack.Plan.summary`: the figures a user logs."""
    return {
        "strategy": plan.strategy,
        "window": plan.window,
        "examples": plan.num_examples,
        "windows": plan.num_windows,
        "lower_bound": plan.lower_bound,
        "windows_over_lower_bound": plan.num_windows - plan.lower_bound,
        "fill": plan.fill,
        "tokens": plan.total_tokens,
        "overflow": plan.overflow,
        "overflow_examples": int(plan.overflow_examples.size),
        "dropped_examples": int(plan.dropped_examples.size),
        "cut_tokens": plan.cut_tokens,
        **({} if plan.num_groups is None else {
            "groups": plan.num_groups,
            "overflow_groups": int(plan.overflow_groups.size),
            "ungrouped_windows": plan.ungrouped_windows,
            "group_cost_windows": plan.num_windows - plan.ungrouped_windows}),
    }


def plan_repr(plan) -> str:
    """``repr(plan)``: its strategy, window, counts, fill and overflow in one line."""
    return (
        f"Plan(strategy={plan.strategy!r}, window={plan.window}, examples={plan.num_examples}, "
        f"windows={plan.num_windows}, lower_bound={plan.lower_bound}, fill={plan.fill:.4f}, "
        f"overflow={plan.overflow!r}: {plan.overflow_examples.size} examples, "
        f"cut_tokens={plan.cut_tokens}"
        + ("" if plan.num_groups is None else
           f", groups={plan.num_groups}, ungrouped_windows={plan.ungrouped_windows}")
        + ")"
    )
