"""Batches of example indices as CSR (``flat``, and ``ptr`` the offsets of the batches): a selection of them, their
sums, an order's batches padded to their longest, and their arrangement into steps. What every sampler deals with, in
a room below them all (the padded samplers' epochs in :mod:`packkit.orders`, the short steps' deal in
:mod:`packkit.short_steps`), and what ``packkit waste`` measures of padded batches; :mod:`packkit.sampler` lends
the selection, the sums and the steps as before::

    >>> [a.tolist() for a in select_batches([7, 8, 9], [0, 2, 3], [1, 0])]
    [[9, 7, 8], [0, 1, 3]]
"""

from __future__ import annotations

import numpy as np

from .segments import lengths_to_offsets, range_index

__all__ = ["select_batches", "batch_sums", "padded_rows", "arrange_steps"]


def select_batches(flat: np.ndarray, ptr: np.ndarray, order) -> tuple[np.ndarray, np.ndarray]:
    """CSR batches ``flat[ptr[b]:ptr[b+1]]`` taken in ``order`` (repeats allowed), without a loop.

    ``select_batches([7, 8, 9], [0, 2, 3], [1, 0]) -> ([9, 7, 8], [0, 1, 3])``.
    """
    flat, ptr = np.asarray(flat), np.asarray(ptr, np.int64)
    order = np.asarray(order, np.int64)
    if order.size and 0 <= order[0] and order[0] + order.size < ptr.size and _is_run(order):  # in place: a slice
        a, b = int(order[0]), int(order[0]) + order.size
        return flat[ptr[a]:ptr[b]], ptr[a:b + 1] - ptr[a]  # (a view: read, never written)
    counts = ptr[order + 1] - ptr[order]
    return flat[range_index(ptr[order], counts)], lengths_to_offsets(counts)


def _is_run(order: np.ndarray) -> bool:
    """``order`` is ``[a, a + 1, ..., a + len - 1]`` (a schedule's steps in sequence order: no gather needed)."""
    return bool((np.diff(order) == 1).all())


def batch_sums(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Sum of ``values`` over each CSR batch (empty batches give 0): ``([1, 2, 3], [0, 2, 3]) -> [3, 3]``."""
    values = np.asarray(values)
    if values.dtype.kind == "f":  # costs: float prefix sums, summed into their array (no temporary)
        csum = np.empty(values.size + 1, np.float64)
        csum[0] = 0.0
        np.cumsum(values, dtype=np.float64, out=csum[1:])
    else:
        csum = lengths_to_offsets(values)  # prefix sums: the offsets of runs of these sizes
    return csum[ptr[1:]] - csum[ptr[:-1]]


def padded_rows(lengths: np.ndarray, order: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(padded length of every row, order)``: ``order`` cut every ``batch_size``, each batch padded to its
    longest: ``padded_rows(np.array([3, 1, 4, 1]), np.array([0, 1, 2, 3]), 2) -> ([3, 3, 4, 4], order)``."""
    starts = np.arange(0, order.size, batch_size)
    if order.size == 0:
        return np.zeros(0, np.int64), order
    longest = np.maximum.reduceat(lengths[order], starts)
    return np.repeat(longest, np.diff(np.append(starts, order.size))), order


def arrange_steps(cost: np.ndarray, world_size: int, rng, *, shuffle: bool, balance: bool,
                  first=None) -> np.ndarray:
    """Order of ``len(cost)`` batches (a multiple of ``world_size``) so that step ``s`` is batches
    ``s * world_size ... + world_size - 1`` of the result.

    Steps are runs of ``world_size`` consecutive batches: in the order given, or, with ``balance``,
    after sorting by ``cost`` (so a step's ranks get similar work). Steps are then shuffled, and the
    step holding batch ``first`` goes first. ``arrange_steps([1, 5, 2, 6], 2, None, shuffle=False,
    balance=True) -> [3, 1, 2, 0]``.
    """
    cost = np.asarray(cost)
    ids = np.arange(cost.size, dtype=np.int64)
    if balance:
        ids = np.argsort(-cost, kind="stable")
    steps = ids.reshape(-1, world_size)
    if shuffle and steps.shape[0] > 1:
        steps = steps[rng.permutation(steps.shape[0])]
    if first is not None and steps.size:
        row = int(np.flatnonzero((steps == first).any(axis=1))[0])
        steps[[0, row]] = steps[[row, 0]]
    return steps.reshape(-1)
