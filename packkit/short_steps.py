"""A step with fewer units (windows, or batches) than a full one, dealt to the ranks row by row: the tail of an epoch
that does not fill a step (``drop_last=False``), and a step resumed on another world size.

Its own room, imported where a sampler deals such a step: an epoch of whole steps (``packkit plan`` and ``packkit
waste`` at one micro-batch a step, whatever the data) does not compile it. :mod:`packkit.sampler` lends
:func:`halve_pieces` and :func:`split_pieces` under their old address::

    >>> [p.tolist() for p in split_pieces([[3, 4, 5]], 2)[0]]
    [[3], [4, 5]]
"""

from __future__ import annotations

import numpy as np

from .csr import select_batches

__all__ = ["halve_pieces", "split_pieces", "partial_rows", "deal_partial"]


def halve_pieces(parts: list[np.ndarray], count: int, *, split: bool = True) -> list[np.ndarray]:
    """Split the piece with the most examples in halves until there are ``count``, or every piece is one example
    (none at all with ``split=False``: pieces whose examples must stay together, as groups do). Halves of a batch
    within its budget are within it too: ``halve_pieces([[3, 4, 5]], 4) -> [[3], [4], [5]]``."""
    parts = [np.asarray(p, np.int64) for p in parts]
    while split and len(parts) < count:
        j = max(range(len(parts)), key=lambda i: parts[i].size)
        if parts[j].size < 2:
            break
        p = parts.pop(j)
        h = p.size // 2
        parts[j:j] = [p[:h], p[h:]]
    return parts


def split_pieces(parts: list[np.ndarray], count: int, *, split: bool = True) -> tuple[list[np.ndarray], int]:
    """:func:`halve_pieces`, then the pieces repeated in order until there are ``count``: the repeats are the last
    ``count - len(halve_pieces(...))`` pieces. Returns the pieces and the examples repeated:
    ``split_pieces([[3, 4, 5]], 2) -> ([[3], [4, 5]], 0)``; ``split_pieces([[3]], 2) -> ([[3], [3]], 1)``.
    """
    parts = halve_pieces(parts, count, split=split)
    copies = [parts[i % len(parts)] for i in range(count - len(parts))]
    return parts + copies, sum(p.size for p in copies)


def partial_rows(units: np.ndarray, R: int, m: int, k: int) -> list[np.ndarray]:
    """The units of a short step in rows: the fewest rows (at most ``m``) whose ``R`` batches of at most ``k`` units
    hold them, as even as possible: ``partial_rows(units 0..4, R=2, m=2, k=2) -> [[0, 1, 2], [3, 4]]``."""
    rows = min(m, max(1, -(-units.size // (R * k))))
    return np.array_split(units, rows)


def deal_partial(flat: np.ndarray, ptr: np.ndarray, units: np.ndarray, R: int, m: int, k: int, *,
                 splittable: bool) -> tuple[list[np.ndarray], list[int], list[bool]]:
    """A step of fewer units than a full one (units ``flat[ptr[u]:ptr[u + 1]]``), row by row (:func:`partial_rows`):
    a row's units in runs as even as possible over the ranks; a row with fewer units than ranks is split by examples
    (:func:`split_pieces`; not where ``splittable`` is False: groups stay whole), and where there are fewer examples
    than ranks the last ranks get repeats of them. Each row uses whole units, so a resume inside the step is exact.
    Returns batches (row-major), units per batch, and whether each batch is a repeat (its examples are another
    batch's of the step: it is dealt only so that every rank runs a micro-batch, and weighs 0,
    :attr:`packkit.sampler.Schedule.repeats`)."""
    batches, pieces, repeats = [], [], []
    for row in partial_rows(units, R, m, k):
        if row.size >= R and int(row[-1] - row[0]) == row.size - 1:  # consecutive units: each run a slice
            q, r = divmod(row.size, R)
            edges = [int(row[0]) + i * q + min(i, r) for i in range(R + 1)]  # np.array_split's runs
            at = ptr[edges].tolist()
            batches += [flat[at[i]:at[i + 1]] for i in range(R)]
            pieces += [edges[i + 1] - edges[i] for i in range(R)]
            repeats += [False] * R
        elif row.size >= R:
            parts = np.array_split(row, R)
            batches += [select_batches(flat, ptr, p)[0] for p in parts]
            pieces += [p.size for p in parts]
            repeats += [False] * R
        else:
            own = halve_pieces([flat[ptr[x]:ptr[x + 1]] for x in row], R, split=splittable)
            batches += split_pieces(own, R, split=False)[0]
            pieces += [1] * R
            repeats += [False] * len(own) + [True] * (R - len(own))
    return batches, pieces, repeats
