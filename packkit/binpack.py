"""Bin packing over example lengths: which examples share a window.

The planner sees an integer array of lengths and a window size ``W``; it never touches tokens.
Its answer is a frozen :class:`Plan`, a CSR layout of *segments* (an example, or a piece of one)
per window::

    >>> plan = pack([5, 3, 4, 2], window=8)
    >>> plan.num_windows, plan.lower_bound
    (2, 2)
    >>> [plan.segments(i)[0].tolist() for i in range(plan.num_windows)]   # example indices
    [[0, 1], [2, 3]]

Strategies
----------
``"bfd"``         best-fit decreasing over the whole dataset (default). Each example, longest first,
                  goes to the open window with the least room that still fits it.
``"ffd"``         first-fit decreasing: longest first, into the oldest window that fits.
``"shuffle_ff"``  first-fit in a seeded random order: windows are not grouped by length.
``"next_fit"``    next-fit in the given order: order-preserving, one open window (for streams).

Speed
-----
Lengths are small integers (at most ``W``), so best fit does not need a search tree over windows:
open windows are bucketed by remaining capacity, and a whole group of equal-length examples is placed
at once. If the tightest bucket that fits length ``L`` has room ``r``, each window in it takes
``r // L`` examples (after each one it is still the tightest fit, until its room drops below ``L``),
so a group is consumed bucket by bucket. The result is exactly item-by-item best fit (up to which of
several windows with equal room is chosen, which cannot change any later decision), at a cost of one
radix sort plus about O(n + W x distinct lengths).

Over-long examples (``length > W``)
-----------------------------------
``overflow="error"`` (default) raises and names the example; ``"truncate"`` keeps the first ``W``
tokens; ``"split"`` cuts the example into pieces of at most ``W`` tokens, each its own segment (with
positions from 0); ``"drop"`` leaves it out. The plan counts what each policy touched. :func:`apply_overflow` is the
policy's one home: the planner, the stream packer, Ray's driver and the waste report all call it.

Streams
-------
:func:`stream_windows` (:mod:`packkit.streamplan`, lent here) plans a stream it cannot see whole: best fit inside a
bounded buffer of items (fill against buffer size is tabled in :func:`packkit.packer.pack_stream`).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import math
import os

import numpy as np

from .choices import DEFAULT_OVERFLOW, OVERFLOW_POLICIES, STRATEGIES
from .errors import ArgumentError, DataError, Message, Where, arg, check_choice, check_int
from .records import record
from .length_rules import MAX_WINDOW, as_lengths, check_window, max_window  # noqa: F401 - their home, lent
from .segments import lengths_to_offsets, lengths_to_position_ids, lengths_to_seq_idx, range_index

__all__ = ["Plan", "Pieces", "pack", "apply_overflow", "stream_windows", "as_lengths", "check_window", "check_seed",
           "max_window", "check_strategy", "pack_groups", "as_groups", "check_overflow", "check_buffer_size", "StreamBuffer", "overflow_error", "overflow_note",
           "lower_bound", "windows_plan", "STRATEGIES", "OVERFLOW_POLICIES"]


# ----------------------------------------------------------------------------------------------
# input checking
# ----------------------------------------------------------------------------------------------


def check_seed(seed, *, allow_none: bool = True) -> int | None:
    """Return ``seed`` as a Python int (or None when allowed), or raise naming ``seed``: ``check_seed(3) -> 3``.

    Seeds are numpy ``default_rng`` seeds: non-negative integers.
    """
    if seed is None and allow_none:
        return None
    return check_int(seed, "seed", low=0)


def check_strategy(strategy) -> str:
    """Return ``strategy`` if it is one of :data:`STRATEGIES`, else raise naming the choices."""
    return check_choice(strategy, "strategy", STRATEGIES)


def check_overflow(overflow) -> str:
    """Return ``overflow`` if it is one of :data:`OVERFLOW_POLICIES`, else raise naming the choices."""
    return check_choice(overflow, "overflow", OVERFLOW_POLICIES, what="overflow policy")


def overflow_error(lengths: np.ndarray, window: int, *, first: int = 0,
                   fixes: tuple = ("split", "truncate", "drop"), why: str = "") -> DataError | None:
    """The error ``overflow="error"`` raises for these lengths, or None when every example fits.

    ``overflow_error(np.array([3, 9]), 8)`` -> ``DataError("example 1 has 9 tokens > window=8; ...")``
    (a ``ValueError``; from the command line it reads ``--window 8`` and ``--overflow split``).
    ``first``: the dataset index of ``lengths[0]`` (a stream or a block names its own examples).
    ``fixes``: the policies the caller offers; ``why``: a note after them (a batch sampler offers no
    ``"split"`` and says its collator needs the same policy).
    """
    lengths = np.asarray(lengths)
    over = np.flatnonzero(lengths > window)
    if over.size == 0:
        return None
    i = int(over[0])
    more = f" (and {over.size - 1:,} more)" if over.size > 1 else ""
    return DataError("{i} has {n:,} tokens > {window}{more}; pass {fix}{why}, or raise {w}", i=Where(first + i),
                     n=int(lengths[i]), window=arg("window", window), more=more,
                     fix=arg("overflow", *fixes), why=why, w=arg("window"))


#: Bytes a planner holds per item (a piece of a split example) at its peak: measured 132 for ``packkit plan``'s
#: bfd and 304 for ``packkit waste``'s five strategies on one example split into 4M pieces, 110 per example for
#: ``packkit plan --synthetic 4000000``; the planner's own.
PLAN_BYTES_PER_ITEM = 128

#: A plan of at most this many bytes is never refused, and the system is not asked for its memory: reading
#: ``/proc/meminfo`` costs about 50-100 us, which ``pack_stream`` paid for every example it split.
SPLIT_CHECK_FLOOR = 1 << 28


def memory_available() -> int | None:
    """Bytes of memory the system can give now (``MemAvailable`` of ``/proc/meminfo``; elsewhere the physical
    memory), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_split_size(lengths: np.ndarray, window: int, *, first: int = 0) -> None:
    """Refuse, before anything is allocated, a split that would make more pieces than memory can plan.

    One absurd length (``2**40`` in a ``.npy`` of lengths: a claim no token backs) split into windows of 2,048
    is 537M pieces, tens of GiB of plan: the machine ran out of memory naming nothing. The pieces are counted
    first (``ceil(L / W)`` each, no allocation), and more than :data:`PLAN_BYTES_PER_ITEM` bytes each beyond
    the memory available now (asked only past :data:`SPLIT_CHECK_FLOOR`) is the error naming the example with the most pieces:
    ``check_split_size(np.array([10, 2**40]), 2048)`` raises ``DataError("example 1 has 1,099,511,627,776
    tokens: overflow='split' cuts it into 536,870,912 pieces of window=2048 ...")``.
    """
    big = np.flatnonzero(lengths > window)  # (the others are one piece each: no division over every example)
    count = -(-lengths[big] // window)
    pieces = float(lengths.size - big.size) + float(count.sum(dtype=np.float64))
    need = pieces * PLAN_BYTES_PER_ITEM
    if need <= SPLIT_CHECK_FLOOR:
        return
    have = memory_available()
    if have is None or need <= have:
        return
    i, count = int(big[np.argmax(count)]), -(-lengths // window)
    raise DataError("example {i} has {n:,} tokens: {split} cuts it into {k:,} pieces of {window}, and planning "
                    "the data's {pieces:,} pieces needs about {need:.1f} GiB, more than the {have:.1f} GiB of memory "
                    "available; check that length, or pass {fix}, or raise {w}", i=first + i, n=int(lengths[i]),
                    split=arg("overflow", "split"), k=int(count[i]), window=arg("window", window),
                    pieces=int(pieces), need=need / 2**30, have=have / 2**30, fix=arg("overflow", "truncate", "drop"),
                    w=arg("window"))


def overflow_note(overflow: str, *, over: int, examples: int, cut: int, tokens: int,
                  unit: str = "tokens") -> Message | None:
    """What an overflow policy did to the examples longer than the window, in one line; None if none was.

    ``str(overflow_note("truncate", over=2, examples=10, cut=30, tokens=1000))`` ->
    ``"overflow='truncate': 2 of 10 examples longer than the window truncated; 30 of 1,000 tokens cut (3.00%)"``
    (from the command line: ``--overflow truncate: ...``). Nothing is cut without this count being told.
    """
    if not over:
        return None
    what = {"truncate": "truncated", "drop": "dropped", "split": "split into pieces of at most the window",
            "error": "refused"}[check_overflow(overflow)]
    cut_text = f"{cut:,} of {tokens:,} {unit} cut ({cut / max(tokens, 1):.2%})" if cut else f"no {unit[:-1]} cut"
    return Message("{policy}: {over:,} of {examples:,} examples longer than the window {what}; {cut}",
                   policy=arg("overflow", overflow), over=over, examples=examples, what=what, cut=cut_text)


# ----------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------


def _views():
    """:mod:`packkit.planviews`, imported where a plan is viewed (a range, a chunking, its summary or repr)."""
    from . import planviews  # lazy: the plan's views, off a command that plans
    return planviews


@record(eq=False)
class Plan:
    """Which segment of which example goes into which window, as flat (CSR) index arrays.

    Window ``w`` holds segments ``window_ptr[w] : window_ptr[w + 1]``; segment ``s`` is tokens
    ``seg_start[s] : seg_start[s] + seg_length[s]`` of example ``seg_example[s]``. Segments are laid out
    in a window in the order listed. Without ``overflow="split"`` every segment is a whole example (or
    its first ``W`` tokens under ``"truncate"``).

    Fields
    ------
    window:       int, tokens per window (``W``)
    lengths:      (num_examples,) int64, the input lengths
    seg_example:  (num_segments,) int64, example index of each segment
    seg_start:    (num_segments,) int64, first token of the segment inside its example
    seg_length:   (num_segments,) int64, tokens in the segment, ``1 <= seg_length <= W``
    window_ptr:   (num_windows + 1,) int64, CSR offsets into the segment arrays, starts at 0
    strategy, overflow, seed: how the plan was made
    overflow_examples: (k,) int64, indices of the examples longer than ``W``, whatever the policy
    dropped_examples: (k,) int64, indices left out by ``overflow="drop"``
    cut_tokens:   int, tokens removed by ``"truncate"`` or ``"drop"`` (never silently)
    seg_group:    (num_segments,) int64, the group of each segment (``pack(..., groups=)``), else None
    num_groups:   int, groups in the input (``groups=``), else None
    ungrouped_windows: int, windows the same examples need packed without groups (the fill cost of
                  keeping groups whole is ``num_windows - ungrouped_windows``), else None
    overflow_groups: (k,) int64, groups longer than ``W`` (split or dropped by the policy), else empty
    """

    window: int
    lengths: np.ndarray
    seg_example: np.ndarray
    seg_start: np.ndarray
    seg_length: np.ndarray
    window_ptr: np.ndarray
    strategy: str
    overflow: str
    seed: int | None
    overflow_examples: np.ndarray
    dropped_examples: np.ndarray
    cut_tokens: int
    seg_group: np.ndarray | None = None
    num_groups: int | None = None
    ungrouped_windows: int | None = None
    overflow_groups: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self):
        for f in ("lengths", "seg_example", "seg_start", "seg_length", "window_ptr",
                  "overflow_examples", "dropped_examples", "seg_group", "overflow_groups"):
            if getattr(self, f) is not None:
                getattr(self, f).setflags(write=False)

    # -- sizes --------------------------------------------------------------------------------

    @property
    def num_examples(self) -> int:
        return int(self.lengths.size)

    @property
    def num_windows(self) -> int:
        return int(self.window_ptr.size - 1)

    @property
    def num_segments(self) -> int:
        return int(self.seg_example.size)

    def __len__(self) -> int:
        return self.num_windows

    @property
    def total_tokens(self) -> int:
        """Tokens placed in windows (input tokens minus ``cut_tokens``)."""
        return int(self.seg_length.sum())

    @property
    def lower_bound(self) -> int:
        """``ceil(total_tokens / W)``: no plan of the same tokens can use fewer windows."""
        return -(-self.total_tokens // self.window)

    @property
    def fill(self) -> float:
        """Real tokens over window tokens, in [0, 1] (1.0 for an empty plan)."""
        return self.total_tokens / (self.num_windows * self.window) if self.num_windows else 1.0

    @property
    def window_loads(self) -> np.ndarray:
        """(num_windows,) int64, tokens in each window: ``window_loads <= W``."""
        csum = lengths_to_offsets(self.seg_length)
        return csum[self.window_ptr[1:]] - csum[self.window_ptr[:-1]]

    @property
    def segments_per_window(self) -> np.ndarray:
        """(num_windows,) int64."""
        return np.diff(self.window_ptr)

    @property
    def seg_window(self) -> np.ndarray:
        """(num_segments,) int64, the window of each segment."""
        return np.repeat(np.arange(self.num_windows, dtype=np.int64), self.segments_per_window)

    @property
    def split_examples(self) -> np.ndarray:
        """Indices of the examples cut into several segments (only under ``overflow="split"``)."""
        return self.overflow_examples if self.overflow == "split" else np.zeros(0, np.int64)

    @property
    def truncated_examples(self) -> np.ndarray:
        """Indices of the examples cut to ``W`` tokens (only under ``overflow="truncate"``)."""
        return self.overflow_examples if self.overflow == "truncate" else np.zeros(0, np.int64)

    # -- access ---------------------------------------------------------------------------------

    def segments(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(example, start, length)`` arrays of the segments in window ``i``."""
        if not -self.num_windows <= i < self.num_windows:
            raise IndexError(f"window {i} out of range for a plan of {self.num_windows} windows")
        i %= self.num_windows
        lo, hi = self.window_ptr[i], self.window_ptr[i + 1]
        return self.seg_example[lo:hi], self.seg_start[lo:hi], self.seg_length[lo:hi]

    def windows(self) -> list[np.ndarray]:
        """Example indices of every window, as a list of int64 arrays."""
        return np.split(self.seg_example, self.window_ptr[1:-1])

    def select(self, order, *, allow_repeats: bool = False) -> "Plan":
        """A plan with the windows in ``order``: a permutation or a subset of the window indices.

        A window listed twice duplicates its tokens, so that is an error unless ``allow_repeats``
        (a sampler that repeats windows to give every rank the same number of steps, and counts
        them, passes it); an index out of range is an error too.
        """
        order = np.asarray(order, dtype=np.int64).reshape(-1)
        if order.size and (order.min() < 0 or order.max() >= self.num_windows):
            bad = int(order[(order < 0) | (order >= self.num_windows)][0])
            raise IndexError(f"window {bad} out of range for a plan of {self.num_windows} windows")
        if not allow_repeats and np.bincount(order, minlength=self.num_windows).max(initial=0) > 1:
            raise ValueError("select() got a window index twice: that would duplicate its tokens")
        return self._take(order)

    def _take(self, order: np.ndarray) -> "Plan":
        """:meth:`select` without the checks (``order`` known to be valid)."""
        counts = self.segments_per_window[order]
        ptr = lengths_to_offsets(counts)
        seg = range_index(self.window_ptr[order], counts)  # the chosen windows' segments, in order
        return dataclasses.replace(
            self,
            seg_example=self.seg_example[seg],
            seg_start=self.seg_start[seg],
            seg_length=self.seg_length[seg],
            window_ptr=ptr,
            seg_group=None if self.seg_group is None else self.seg_group[seg],
        )

    def window_range(self, start: int, stop: int) -> "Plan":
        """Windows ``start .. stop - 1`` as a plan that shares this one's arrays (views, no copy).

        ``lengths`` and the overflow counts still describe every example (segments name examples by
        their index in the whole input).
        """
        return _views().window_range(self, start, stop)

    def keep_segments(self, keep) -> "Plan":
        """The plan with only the segments where ``keep`` (``(num_segments,)`` bool) is True, each window
        keeping its order; windows left empty are gone (a dropped segment leaves room, not a move).

        ``pack([3, 2], window=4, strategy="next_fit").keep_segments([False, True]).seg_length -> [2]``.
        """
        return _views().keep_segments(self, keep)

    def chunks(self, max_tokens: int) -> list[tuple[int, int]]:
        """Consecutive window ranges ``(start, stop)`` of at most ``max_tokens`` tokens each (a window
        larger than that is a range of its own), covering every window in order.

        ``pack([5, 3, 4, 2], window=8).chunks(8) -> [(0, 1), (1, 2)]``; ``.chunks(100) -> [(0, 2)]``.
        """
        return _views().chunks(self, max_tokens)

    def shuffled(self, seed: int | None = None) -> "Plan":
        """The same windows in a seeded random order, so training order is not sorted by length.

        ``seed=None`` uses the plan's own seed (0 if it has none). Deterministic for a given seed.
        """
        return self._take(self.shuffle_order(seed))

    def shuffle_order(self, seed: int | None = None) -> np.ndarray:
        """The window order :meth:`shuffled` takes: a sampler arranging the shuffled windows in steps selects both
        at once (``plan.select(plan.shuffle_order(s)[order]) == plan.shuffled(s).select(order)``)."""
        seed = self.seed if seed is None else seed
        return np.random.default_rng(0 if seed is None else seed).permutation(self.num_windows)

    def summary(self) -> dict:
        """The figures a user logs: windows, lower bound, fill and what the overflow policy touched."""
        return _views().summary(self)

    def __repr__(self) -> str:
        return _views().plan_repr(self)


# ----------------------------------------------------------------------------------------------
# overflow: from examples to packable items
# ----------------------------------------------------------------------------------------------


def windows_plan(seg_length: np.ndarray, window_ptr: np.ndarray, *, window: int, strategy: str) -> Plan:
    """Windows laid out already (CSR ``window_ptr`` over ``seg_length``) as a :class:`Plan`
    whose every segment is an example of its own: ``windows_plan(np.array([3, 2, 4]), np.array([0, 2, 3]),
    window=5, strategy="stream").num_windows -> 2``."""
    n, empty = len(seg_length), np.zeros(0, np.int64)
    return Plan(window=window, lengths=seg_length, seg_example=np.arange(n, dtype=np.int64),
                seg_start=np.zeros(n, np.int64), seg_length=seg_length, window_ptr=window_ptr, strategy=strategy,
                overflow="error", seed=None, overflow_examples=empty, dropped_examples=empty, cut_tokens=0)


@record(eq=False)
class Pieces:
    """Examples after an overflow policy: the items a planner packs, each of ``1..W`` tokens.

    Item ``k`` is tokens ``start[k] : start[k] + length[k]`` of example ``example[k]``.

    Fields
    ------
    example, start, length: (k,) int64, the items
    overflow_examples: (m,) int64, the examples longer than ``W`` (whatever the policy did)
    dropped_examples:  (m,) int64, those left out (``overflow="drop"``), else empty
    cut_tokens:        int, tokens removed by ``"truncate"`` or ``"drop"``
    """

    example: np.ndarray
    start: np.ndarray
    length: np.ndarray
    overflow_examples: np.ndarray
    dropped_examples: np.ndarray
    cut_tokens: int


def apply_overflow(lengths, *, window: int, overflow: str, in_order: bool = False, first: int = 0) -> Pieces:
    """The overflow policy, the one place it is written: examples -> items of at most ``window`` tokens.

    ``"error"`` raises (:func:`overflow_error`) if an example is longer than ``window``; ``"truncate"``
    keeps its first ``window`` tokens; ``"split"`` cuts it into pieces of ``window`` tokens (the last
    one shorter); ``"drop"`` leaves it out. Every count of what the policy touched is in the result.

    ``apply_overflow([3, 9, 4], window=4, overflow="split", in_order=True).length -> [3, 4, 4, 1, 4]``

    Args:
        lengths: (n,) int, every entry >= 1.
        in_order: the pieces of a split example follow each other, in example order. By default
            (the planners' layout) item ``i`` is example ``i``'s first piece for every ``i < n``, and
            the later pieces of split examples follow all of them.
        first: the index of ``lengths[0]`` in the caller's dataset (error texts name that example).
    """
    lengths = np.asarray(lengths, np.int64)
    over = np.flatnonzero(lengths > window)
    empty = np.zeros(0, np.int64)
    idx = np.arange(lengths.size, dtype=np.int64)
    zeros = np.zeros(lengths.size, np.int64)
    if over.size == 0:
        return Pieces(idx, zeros, lengths, over, empty, 0)
    if overflow == "error":
        raise overflow_error(lengths, window, first=first)
    if overflow == "truncate":
        cut = int((lengths[over] - window).sum())
        return Pieces(idx, zeros, np.minimum(lengths, window), over, empty, cut)
    if overflow == "drop":
        keep = lengths <= window
        return Pieces(idx[keep], zeros[keep], lengths[keep], over, over, int(lengths[over].sum()))
    if overflow != "split":
        check_overflow(overflow)
    # split: example i becomes ceil(L / W) pieces, all of W tokens but the last: every first piece, then the later
    # pieces of the few examples past W (no pass over every example per piece)
    check_split_size(lengths, window, first=first)
    if in_order and lengths.size == 1:  # one example (pack_stream splits each so): its pieces, no layout of many
        start = np.arange(0, int(lengths[0]), window, dtype=np.int64)
        return Pieces(zeros[:1].repeat(start.size), start, np.minimum(lengths[0] - start, window), over, empty, 0)
    extra = -(-lengths[over] // window) - 1  # later pieces of each example past W
    k = lengths_to_position_ids(extra) + 1  # their number in their example
    of = np.repeat(over, extra)
    later = (of, k * window, np.minimum(lengths[of] - k * window, window))
    firsts = (idx, zeros, np.minimum(lengths, window))
    if not in_order:  # the planners' layout: every first piece (start 0), then the later ones, each in order
        return Pieces(*(np.concatenate(pair) for pair in zip(firsts, later)), over, empty, 0)
    before = lengths_to_offsets(extra)  # later pieces before each example past W
    at = range_index(over + before[:-1] + 1, extra)  # the later pieces follow their first
    shift = np.zeros(lengths.size, np.int64)  # where each first piece goes: its example, plus the later pieces before
    shift[over[over + 1 < lengths.size] + 1] = extra[over + 1 < lengths.size]
    np.cumsum(shift, out=shift)
    shift += idx
    out = [np.empty(lengths.size + at.size, np.int64) for _ in range(3)]
    for o, f, x in zip(out, firsts, later):
        o[shift], o[at] = f, x
    return Pieces(*out, over, empty, 0)


# ----------------------------------------------------------------------------------------------
# strategies
#
# Each strategy takes item lengths (all in [1, W]) and returns ``(order, run_window, run_count,
# run_first, num_windows, run_length)``: walking the items in ``order``, ``run_count[i]`` items from
# position ``run_first[i]`` on go to window ``run_window[i]`` (``run_first=None``: the runs are
# consecutive), each of ``run_length[i]`` tokens (``None``: lengths differ inside a run).
# Runs keep the grouped planners' output small: one run per window per group of equal lengths.
# ----------------------------------------------------------------------------------------------


def _sort_decreasing(lengths: np.ndarray, window: int) -> np.ndarray:
    """Stable order of ``lengths``, longest first. A radix sort when the keys fit in 16 bits."""
    key = window - lengths
    if window < 1 << 16:
        key = key.astype(np.uint16)
    return np.argsort(key, kind="stable")


def _best_fit_decreasing(lengths: np.ndarray, window: int):
    """Best-fit decreasing, a whole group of equal lengths at a time (see the module docstring)."""
    order = _sort_decreasing(lengths, window)
    counts = np.bincount(lengths, minlength=window + 1)
    distinct = np.flatnonzero(counts)[::-1].tolist()
    min_len = distinct[-1] if distinct else 1
    # Open windows by room: room -> stack of int64 arrays of window ids (windows with equal room are
    # interchangeable, so a bucket hands out whichever ids are on top), and how many ids it holds.
    buckets: dict[int, list[np.ndarray]] = {}
    sizes: dict[int, int] = {}
    rooms: list[int] = []  # sorted rooms of the non-empty buckets
    # One event per bucket visit: windows ``ids`` each take q items from position p of ``order``
    # on, the last one r items.
    ev_ids: list[np.ndarray] = []
    ev = array.array("q")  # q, p, r, L per event
    num_windows = 0
    placed = 0
    bisect_left, insort = bisect.bisect_left, bisect.insort

    for length in distinct:
        c = int(counts[length])
        while c:
            j = bisect_left(rooms, length)
            if j == len(rooms):
                # -- no open window fits: open new ones, each taking q items --
                room = window
                q = window // length
                take = -(-c // q)
                ids = np.arange(num_windows, num_windows + take, dtype=np.int64)
                num_windows += take
            else:
                # -- the tightest bucket that fits: every window in it takes q items --
                room = rooms[j]
                q = room // length
                have = sizes[room]
                take = min(have, -(-c // q))
                stack = buckets[room]
                if take == have:
                    ids = stack[0] if len(stack) == 1 else np.concatenate(stack)
                    del buckets[room], sizes[room], rooms[j]
                else:
                    sizes[room] = have - take
                    parts, need = [], take
                    while need:
                        top = stack[-1]
                        if top.size <= need:
                            parts.append(stack.pop())
                            need -= top.size
                        else:
                            parts.append(top[top.size - need:])
                            stack[-1] = top[: top.size - need]
                            need = 0
                    ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
            full, rest = divmod(min(c, take * q), q)
            ev_ids.append(ids)
            ev.extend((q, placed, rest or q, length))
            placed += full * q + rest
            c -= full * q + rest
            # -- the windows move to the buckets of their new room (or close) --
            for group, left in ((ids[:full], room - q * length), (ids[full:], room - rest * length)):
                if left < min_len or not group.size:  # nothing left can fit: the windows close
                    continue
                if left in sizes:
                    buckets[left].append(group)
                    sizes[left] += group.size
                else:
                    buckets[left] = [group]
                    sizes[left] = group.size
                    insort(rooms, left)

    # -- expand the events with numpy: event e gives window ids[i] the items q*i .. q*i+q-1 after
    #    position p (the last window of the event r of them) --
    q, p, r, ev_length = np.frombuffer(ev, np.int64).reshape(-1, 4).T
    m = np.array([ids.size for ids in ev_ids], np.int64)
    run_window = np.concatenate(ev_ids) if ev_ids else np.zeros(0, np.int64)
    event_of = lengths_to_seq_idx(m)
    run_first = p[event_of] + lengths_to_position_ids(m) * q[event_of]
    run_count = q[event_of]
    run_count[np.cumsum(m) - 1] = r  # each event's last window
    return order, run_window, run_count, run_first, num_windows, ev_length[event_of]


def _runs_to_csr(order, run_window, run_count, run_first, num_windows, run_length):
    """Items grouped by window, placement order kept inside each window.

    ``run_first`` is the position in ``order`` of each run's first item (``None``: runs are listed in
    placement order, so it is their running count); runs of one window must be listed in placement
    order. Returns ``(items, window_ptr, item_lengths)``: window ``w`` holds
    ``items[window_ptr[w]:window_ptr[w+1]]``; ``item_lengths`` is ``None`` unless ``run_length`` is given.
    Example: ``order=[2, 0, 1]``, runs ``(window 1, 1 item), (window 0, 2 items)`` ->
    ``items=[0, 1, 2]``, ``window_ptr=[0, 2, 3]``.
    """
    perm = np.argsort(run_window, kind="stable")
    if run_first is None:  # runs given in placement order
        run_first = lengths_to_offsets(run_count)[:-1]  # position in ``order`` of each run's first item
    counts = run_count[perm]
    items = order[range_index(run_first[perm], counts)]
    per_window = np.bincount(run_window, weights=run_count, minlength=num_windows)
    window_ptr = lengths_to_offsets(per_window.astype(np.int64))
    item_lengths = None if run_length is None else np.repeat(run_length[perm], counts)
    return items, window_ptr, item_lengths


# ----------------------------------------------------------------------------------------------
# the public entry point
# ----------------------------------------------------------------------------------------------


def _plan_items(item_length: np.ndarray, window: int, strategy: str, seed: int | None, token_order=None):
    """Run ``strategy`` over item lengths (all in ``[1, W]``): ``(items, window_ptr, item_lengths)``
    as :func:`_runs_to_csr` gives them. ``token_order``: next fit's order (default: as listed)."""
    if strategy == "bfd":
        runs = _best_fit_decreasing(item_length, window)
    else:
        from . import fits  # lazy: the other strategies, compiled where one is asked for (bfd is the default)
        if strategy == "ffd":
            runs = fits.first_fit_decreasing(item_length, window, _sort_decreasing(item_length, window))
        elif strategy == "shuffle_ff":
            rng = np.random.default_rng(0 if seed is None else seed)
            runs = fits.first_fit(item_length, window, rng.permutation(item_length.size))
        else:
            runs = fits.next_fit(item_length, window, token_order)
    seg, window_ptr, seg_length = _runs_to_csr(*runs)
    return seg, window_ptr, (item_length[seg] if seg_length is None else seg_length)


def pack(lengths, *, window: int, strategy: str = "bfd", overflow: str = "error",
         seed: int | None = 0, groups=None, group_sizes=None) -> Plan:
    """Plan windows of ``window`` tokens for examples of the given ``lengths``.

    Args:
        lengths: (num_examples,) integers >= 1: list, numpy array or torch tensor.
        window: tokens per window (``W``), >= 1.
        strategy: ``"bfd"`` (default), ``"ffd"``, ``"shuffle_ff"`` or ``"next_fit"`` (module docstring).
        overflow: what to do with an example longer than ``W``: ``"error"`` (default),
            ``"truncate"``, ``"split"`` or ``"drop"`` (with groups: a *group* longer than ``W``, see
            :func:`pack_groups`).
        seed: the random order of ``"shuffle_ff"``, and the default seed of :meth:`Plan.shuffled`.
        groups: (num_examples,) a group id per example (ints or strings): examples with one id are an
            atom (a preference pair, a prompt's completions) that stays in one window, members adjacent
            and in example order. ``group_sizes``: the same as consecutive sizes (``[2, 2]``: examples
            0-1 and 2-3). Give one of the two (:func:`pack_groups`).

    Returns:
        A frozen :class:`Plan`. Windows come in the order the strategy opened them (for BFD/FFD that
        groups long examples first): call ``plan.shuffled()`` for a training order.

    Example: ``pack([5, 3, 4, 2], window=8).windows() -> [[0, 1], [2, 3]]``.
    """
    window = check_window(window)
    check_strategy(strategy)
    check_overflow(overflow)
    seed = check_seed(seed)
    lengths = as_lengths(lengths)
    if groups is not None or group_sizes is not None:
        return pack_groups(lengths, window=window, strategy=strategy, overflow=overflow, seed=seed,
                           groups=groups, group_sizes=group_sizes)
    pieces = apply_overflow(lengths, window=window, overflow=overflow)
    item_example, item_start, item_length = pieces.example, pieces.start, pieces.length
    # next fit is order-preserving: pieces of a split example stay together, in token order
    token_order = np.lexsort((item_start, item_example)) if overflow == "split" and strategy == "next_fit" else None
    seg, window_ptr, seg_length = _plan_items(item_length, window, strategy, seed, token_order)
    seg_start = np.zeros(seg.size, np.int64)
    if overflow == "drop":
        seg_example = item_example[seg]
    elif item_example.size == lengths.size:  # item i is example i
        seg_example = seg
    else:  # split: items 0..n-1 are the examples' first pieces, the other pieces follow
        seg_example = seg.copy()
        extra = np.flatnonzero(seg >= lengths.size)
        seg_example[extra] = item_example[seg[extra]]
        seg_start[extra] = item_start[seg[extra]]
    return Plan(
        window=window,
        lengths=lengths,
        seg_example=seg_example,
        seg_start=seg_start,
        seg_length=seg_length,
        window_ptr=window_ptr,
        strategy=strategy,
        overflow=overflow,
        seed=None if seed is None else int(seed),
        overflow_examples=pieces.overflow_examples,
        dropped_examples=pieces.dropped_examples,
        cut_tokens=pieces.cut_tokens,
    )


# ----------------------------------------------------------------------------------------------
# groups: atoms that stay in one window
# ----------------------------------------------------------------------------------------------


def _groups():
    """:mod:`packkit.groups`, imported where examples are packed in groups: packing without them (``packkit plan``,
    ``packkit waste``) does not compile it."""
    from . import groups  # lazy: the groups' CSR and their split, for pack_groups only
    return groups


def _streamplan():
    """:mod:`packkit.streamplan`, imported where a stream is planned: planning a whole dataset (``packkit plan``) does
    not compile it."""
    from . import streamplan  # lazy: best fit inside a bounded buffer, for streams only
    return streamplan


def __getattr__(name: str):
    """:func:`packkit.groups.as_groups` and the stream planner of :mod:`packkit.streamplan` (:func:`stream_windows`,
    :class:`StreamBuffer`, :func:`check_buffer_size`), lent under their old address (``packkit.binpack.as_groups``)."""
    if name == "as_groups":
        return _groups().as_groups
    if name in ("stream_windows", "StreamBuffer", "check_buffer_size"):
        return getattr(_streamplan(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pack_groups(lengths, *, window: int, strategy: str = "bfd", overflow: str = "error", seed: int | None = 0,
                groups=None, group_sizes=None) -> Plan:
    """:func:`pack` with atoms: every group's examples share one window, adjacent, in example order.

    A group is packed as one item of its total length, then laid out member by member, so the plan
    has one segment per example (``seg_group`` names its group). Keeping groups whole costs fill; the
    plan says how much (``ungrouped_windows``: the windows the same examples take packed one by one).

    A group longer than ``W``, by ``overflow``: ``"error"`` (default) names it; ``"split"`` cuts it
    between its examples into consecutive parts of at most ``W`` tokens (next fit; an example longer
    than ``W`` is still an error, since a sequence of a pair cannot be cut); ``"drop"`` leaves the
    whole group out (counted in ``dropped_examples`` and ``cut_tokens``). ``"truncate"`` is refused:
    it would cut one member and not the others.

    ``pack_groups([3, 4, 2, 2], window=8, group_sizes=[2, 2]).windows() -> [[0, 1], [2, 3]]``.
    """
    window = check_window(window)
    check_strategy(strategy)
    check_overflow(overflow)
    seed = check_seed(seed)
    lengths = as_lengths(lengths)
    if overflow == "truncate":
        raise ArgumentError("{got} would cut one sequence of a group and not the others; pass {fix}",
                            got=arg("overflow", "truncate"), fix=arg("overflow", "error", "split", "drop"))
    groups_ = _groups()
    member, gptr = groups_.as_groups(lengths.size, groups=groups, group_sizes=group_sizes)
    num_groups = int(gptr.size - 1)
    csum = lengths_to_offsets(lengths[member])
    glen = csum[gptr[1:]] - csum[gptr[:-1]]
    over = np.flatnonzero(glen > window)
    is_over = np.zeros(num_groups, bool)
    is_over[over] = True
    over_members = np.sort(member[np.repeat(is_over, np.diff(gptr))])
    dropped, cut = np.zeros(0, np.int64), 0
    # items: consecutive runs of ``member`` (a whole group, or a part of a split one)
    item_ptr, item_group = gptr, np.arange(num_groups, dtype=np.int64)
    if over.size and overflow == "error":
        g = int(over[0])
        raise groups_.group_error(g, member[gptr[g]: gptr[g + 1]], int(glen[g]), window)
    if over.size and overflow == "drop":
        dropped, cut = over_members, int(glen[over].sum())
        item_group = np.flatnonzero(~is_over)
        item_ptr = lengths_to_offsets(np.diff(gptr)[~is_over])
        member = member[np.repeat(~is_over, np.diff(gptr))]
    elif over.size:  # split between examples, next fit over each over-long group's members
        item_ptr, item_group = groups_.split_groups(lengths, member, gptr, glen, window)
    csum = lengths_to_offsets(lengths[member])
    item_length = csum[item_ptr[1:]] - csum[item_ptr[:-1]]
    seg_item, item_window_ptr, _ = _plan_items(item_length, window, strategy, seed)
    # expand every item into its members, in order
    count = np.diff(item_ptr)[seg_item]
    seg_example = member[range_index(item_ptr[seg_item], count)]
    window_ptr = lengths_to_offsets(count)[item_window_ptr]
    kept_lengths = lengths[member]
    ungrouped = int(_plan_items(kept_lengths, window, strategy, seed)[1].size - 1) if kept_lengths.size else 0
    return Plan(
        window=window,
        lengths=lengths,
        seg_example=seg_example,
        seg_start=np.zeros(seg_example.size, np.int64),
        seg_length=lengths[seg_example],
        window_ptr=window_ptr,
        strategy=strategy,
        overflow=overflow,
        seed=None if seed is None else int(seed),
        overflow_examples=over_members,
        dropped_examples=dropped,
        cut_tokens=cut,
        seg_group=np.repeat(item_group[seg_item], count),
        num_groups=num_groups,
        ungrouped_windows=ungrouped,
        overflow_groups=over.astype(np.int64),
    )


def lower_bound(lengths, *, window: int) -> int:
    """``ceil(sum(lengths) / window)``: ``lower_bound([5, 3, 4], window=8) -> 2``."""
    return math.ceil(int(as_lengths(lengths).sum()) / check_window(window))
