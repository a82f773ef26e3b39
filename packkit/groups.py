"""Groups of examples that stay in one window (a preference pair, a prompt's completions): their examples as CSR, a
group too long for the window cut between its examples, and the error naming one. :func:`packkit.binpack.pack_groups`
packs them; a room of its own so that packing without groups (``packkit plan``, ``packkit waste``) does not compile
it. :mod:`packkit.binpack` lends :func:`as_groups` under its old address::

    >>> [a.tolist() for a in as_groups(4, groups=[7, 3, 7, 3])]
    [[0, 2, 1, 3], [0, 2, 4]]
"""

from __future__ import annotations

import numpy as np

from .errors import ArgumentError, DataError, Where, arg
from .length_rules import as_lengths
from .segments import lengths_to_offsets

__all__ = ["as_groups", "group_error", "split_groups"]


def as_groups(num_examples: int, *, groups=None, group_sizes=None) -> tuple[np.ndarray, np.ndarray]:
    """The groups of ``num_examples`` examples as CSR: ``(member (n,) int64, group_ptr (G + 1,) int64)``.

    Group ``g`` is examples ``member[group_ptr[g] : group_ptr[g + 1]]``, in example order; groups are
    numbered by their first example. ``as_groups(4, groups=[7, 3, 7, 3]) -> ([0, 2, 1, 3], [0, 2, 4])``;
    ``as_groups(4, group_sizes=[1, 3]) -> ([0, 1, 2, 3], [0, 1, 4])``.
    """
    if (groups is None) == (group_sizes is None):
        raise ArgumentError("pass one of {a} (a group id per example) or {b} (consecutive group sizes)",
                            a=arg("groups"), b=arg("group_sizes"))
    if group_sizes is not None:
        sizes = as_lengths(group_sizes, name="group_sizes")
        if int(sizes.sum()) != num_examples:
            raise ArgumentError("{arg} sum to {got:,} examples, but there are {n:,}", arg=arg("group_sizes"),
                                got=int(sizes.sum()), n=num_examples)
        return np.arange(num_examples, dtype=np.int64), lengths_to_offsets(sizes)
    if hasattr(groups, "detach") and hasattr(groups, "cpu"):  # a torch tensor, without importing torch
        groups = groups.detach().cpu().numpy()
    ids = np.asarray(groups)
    if ids.size == 0 and ids.ndim == 1:
        ids = ids.astype(np.int64)
    if ids.ndim != 1 or ids.dtype == object or ids.dtype.kind == "f" or ids.dtype == np.bool_:
        raise TypeError(f"groups must be a 1-D sequence of integer (or string) group ids, one per example, "
                        f"got {'shape ' + str(ids.shape) if ids.ndim != 1 else 'dtype ' + str(ids.dtype)}")
    if ids.size != num_examples:
        raise ArgumentError("{arg} has {got:,} ids for {n:,} examples: give one group id per example",
                            arg=arg("groups"), got=int(ids.size), n=num_examples)
    if num_examples == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)  # groups in order of their first example
    group_of = rank[inverse.reshape(-1)]
    return np.argsort(group_of, kind="stable").astype(np.int64), lengths_to_offsets(np.bincount(group_of))


def group_error(g: int, member: np.ndarray, tokens: int, window: int) -> DataError:
    """``group 3 (examples 6, 7) has 9 tokens > window=8; ...``: one line naming the group and the fix."""
    shown = ", ".join(str(int(i)) for i in member[:4]) + (", ..." if member.size > 4 else "")
    return DataError("group {g} (examples {shown}) has {n:,} tokens > {window}; pass {fix} (split it between "
                     "its examples) or raise {w}", g=g, shown=shown, n=tokens, window=arg("window", window),
                     fix=arg("overflow", "split", "drop"), w=arg("window"))


def split_groups(lengths: np.ndarray, member: np.ndarray, gptr: np.ndarray, glen: np.ndarray,
                  window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(item_ptr, item_group)``: the groups as items, each group longer than ``window`` cut between its
    examples into consecutive parts (next fit over its members); an example longer than ``window`` is the
    error naming it and its group. ``split_groups([3, 4, 2], [0, 1, 2], [0, 3], [9], 7) -> ([0, 2, 3], [0, 0])``."""
    num_groups = int(gptr.size - 1)
    lengths_m = lengths[member]
    big = np.flatnonzero(lengths_m > window)
    if big.size:
        i = int(member[big[0]])
        g = int(np.searchsorted(gptr, big[0], side="right") - 1)
        raise DataError("{i} (group {g}) has {n:,} tokens > {window}: one sequence of a group cannot be "
                        "cut; pass {fix}, or raise {w}", i=Where(i), g=g, n=int(lengths[i]),
                        window=arg("window", window), fix=arg("overflow", "drop"), w=arg("window"))
    starts, owners = [], []
    for g in range(num_groups):
        lo, hi = int(gptr[g]), int(gptr[g + 1])
        if glen[g] <= window:
            starts.append(lo)
            owners.append(g)
            continue
        room = 0
        for j in range(lo, hi):
            if lengths_m[j] > room:
                starts.append(j)
                owners.append(g)
                room = window
            room -= int(lengths_m[j])
    return np.asarray(starts + [member.size], np.int64), np.asarray(owners, np.int64)
