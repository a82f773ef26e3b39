"""The planner's strategies other than best fit (:func:`packkit.binpack.pack`'s ``"ffd"``, ``"shuffle_ff"`` and
``"next_fit"``), imported where one is asked for: ``packkit plan`` and every sampler plan best fit (the default), and
do not compile these at start. Each takes item lengths (all in ``[1, W]``) and returns the runs of
:mod:`packkit.binpack`'s strategies (see the comment above its ``_sort_decreasing``)."""

from __future__ import annotations

import heapq

import numpy as np

from .segments import lengths_to_offsets

__all__ = ["first_fit_decreasing", "first_fit", "next_fit"]


def first_fit_decreasing(lengths: np.ndarray, window: int, order: np.ndarray):
    """First-fit decreasing: for each group of equal lengths, the oldest windows that fit take
    ``room // L`` items each (after each item the oldest fitting window is still the same one). ``order``: the
    items longest first, stable (:func:`packkit.binpack._sort_decreasing`)."""
    counts = np.bincount(lengths, minlength=window + 1)
    distinct = np.flatnonzero(counts)[::-1]
    min_len = int(distinct[-1]) if distinct.size else 1
    open_ids = np.zeros(0, np.int64)  # windows that can still take the shortest item, oldest first
    open_room = np.zeros(0, np.int64)
    run_window, run_count, run_length = [], [], []
    num_windows = 0
    for length in distinct.tolist():
        c = int(counts[length])
        fits = np.flatnonzero(open_room >= length)
        if fits.size:
            q = open_room[fits] // length
            cum = np.cumsum(q)
            used = min(int(np.searchsorted(cum, c)) + 1, fits.size)  # windows that take items
            take = q[:used].copy()
            take[-1] -= max(int(cum[used - 1]) - c, 0)
            run_window.append(open_ids[fits[:used]])
            run_count.append(take)
            run_length.append(np.full(used, length, np.int64))
            open_room[fits[:used]] -= take * length
            c -= int(take.sum())
        if c:
            q = window // length
            full, rest = divmod(c, q)
            ids = np.arange(num_windows, num_windows + full + (rest > 0), dtype=np.int64)
            take = np.full(ids.size, q, np.int64)
            if rest:
                take[-1] = rest
            run_window.append(ids)
            run_count.append(take)
            run_length.append(np.full(ids.size, length, np.int64))
            open_ids = np.concatenate((open_ids, ids))
            open_room = np.concatenate((open_room, window - take * length))
            num_windows += ids.size
        keep = open_room >= min_len
        if not keep.all():
            open_ids, open_room = open_ids[keep], open_room[keep]
    if not run_window:
        return order, np.zeros(0, np.int64), np.zeros(0, np.int64), None, 0, np.zeros(0, np.int64)
    cat = np.concatenate
    return order, cat(run_window), cat(run_count), None, num_windows, cat(run_length)


def first_fit(lengths: np.ndarray, window: int, order: np.ndarray):
    """First fit, item by item, in the given order.

    Open windows are bucketed by room; each bucket keeps its window ids in a min-heap, and the
    smallest id over the buckets that fit is the first-fit window. Windows whose room is below the
    shortest length are closed.
    """
    seq = lengths[order]
    min_len = int(seq.min()) if seq.size else 1
    inf = np.iinfo(np.int64).max
    head = np.full(window + 1, inf, np.int64)  # smallest window id with exactly this room
    heaps: list[list[int] | None] = [None] * (window + 1)
    item_window = np.empty(seq.size, np.int64)
    num_windows = 0
    for i, length in enumerate(seq.tolist()):
        r = length + int(np.argmin(head[length:]))
        w = int(head[r])
        if w == inf:  # open a new window
            w = num_windows
            num_windows += 1
            room = window - length
        else:
            h = heaps[r]
            heapq.heappop(h)
            head[r] = h[0] if h else inf
            room = r - length
        item_window[i] = w
        if room >= min_len:
            h = heaps[room]
            if h is None:
                h = heaps[room] = []
            heapq.heappush(h, w)
            if w < head[room]:
                head[room] = w
    return order, item_window, np.ones(seq.size, np.int64), None, num_windows, seq


def next_fit(lengths: np.ndarray, window: int, order: np.ndarray | None = None):
    """Next fit in the given order (default: as listed): close the window when the next item does
    not fit."""
    order = np.arange(lengths.size, dtype=np.int64) if order is None else order
    csum = lengths_to_offsets(lengths[order])
    n = lengths.size
    # nxt[i]: where a window that starts at item i ends (the furthest j with csum[j] - csum[i] <= W;
    # at least i + 1, since every item fits). Then follow the chain from 0: one step per window.
    nxt = (np.searchsorted(csum, csum[:-1] + window, side="right") - 1).tolist()
    starts = []
    i = 0
    while i < n:
        starts.append(i)
        i = nxt[i]
    bounds = np.asarray(starts + [n], np.int64)
    runs = np.arange(len(starts), dtype=np.int64)
    return order, runs, np.diff(bounds), None, len(starts), None
