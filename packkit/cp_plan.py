"""Context-parallel (CP) planning, numpy only: which tokens of a packed batch each rank of a CP group
holds, from segment lengths alone, and the padding each layout costs. The tensors each rank gets (and
the attention over them) are :mod:`packkit.cp`'s; this module needs no torch, so ``packkit waste --cp``,
``packkit plan``, the budget and the offline packer price a layout without importing it.

A packed row is cut across the ``cp`` GPUs of a context-parallel group. Documents of 9, 3 and 4 tokens
(``cu_seqlens = [0, 9, 12, 16]``), ``cp = 2``::

    row             a0 a1 a2 a3 a4 a5 a6 a7 a8 | b0 b1 b2 | c0 c1 c2 c3
    shift_labels    a1 a2 a3 a4 a5 a6 a7 a8  - | b1 b2  - | c1 c2 c3  -      ('-' = -100, shifted BEFORE slicing)

    zigzag (TE THD, zigzag ring): each document padded to a multiple of 2*cp (p = CP padding), cut in
    2*cp chunks; rank r holds chunks r and 2*cp-1-r of every document
      rank 0  a0 a1 a2  a9p a10p a11p | b0 | b3p | c0 | c3        positions 0 1 2 9 10 11 | 0 | 3 | 0 | 3
      rank 1  a3 a4 a5  a6 a7 a8      | b1 | b2  | c1 | c2        positions 3 4 5 6 7 8   | 1 | 2 | 1 | 2

    contiguous (llama3 ring / TE all-gather) and ulysses (all-to-all): the row (padded to a multiple of
    cp at its end, as one padding segment) cut in cp equal pieces
      rank 0  a0 a1 a2 a3 a4 a5 a6 a7        positions 0..7
      rank 1  a8 | b0 b1 b2 | c0 c1 c2 c3    positions 8 | 0 1 2 | 0 1 2 3

    hybrid (packkit's): a document longer than a rank's share ceil(T / cp), or whose causal work alone
    exceeds 5% of a rank's, is cut zigzag without padding (every rank gets len // cp of its tokens, a
    head chunk and a tail chunk); the others stay whole and go, longest first, to the rank with the
    least causal work that has room for them (LPT), cut over the ranks only when none has room; under
    cp tokens of padding fill the ranks up (here c is cut for its work, b for want of room)
      rank 0  a0 a1 a6 a7 a8 | b2 | c0 c3        positions 0 1 6 7 8 | 2 | 0 3
      rank 1  a2 a3 a4 a5    | b0 b1 | c1 c2     positions 2 3 4 5   | 0 1 | 1 2

The causal work of a rank is ``sum over its real tokens of (position + 1)``: the keys each query
attends to. Contiguous pieces give the last rank the most; zigzag balances every document but pads each
one; the hybrid pads under cp tokens a row and balances the rest by LPT (figures on real chat rows:
``benchmarks/RESULTS.md``, "Context parallelism").

The planner (:func:`plan_cp`) reads segment lengths only (no tokens); :func:`plan_for_cp` plans rows a CP
group will shard so that they still fit the window once padded.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .binpack import Plan, pack
from .choices import CP_LAYOUTS
from .cp_layouts import _check_layout, check_cp_size, check_cp_window, cp_multiples  # their home, re-exported
from .errors import ArgumentError
from .records import record
from .segments import lengths_to_offsets, range_index

__all__ = ["LAYOUTS", "CPPlan", "plan_cp", "causal_work", "cp_padding", "cp_multiples", "check_cp_window",
           "plan_for_cp", "check_cp_size"]

LAYOUTS = CP_LAYOUTS  # (their home: packkit.choices, which the command line reads without numpy)


def causal_work(length, offset=0):
    """Causal attention work of ``length`` tokens of one document starting at position ``offset``:
    ``sum(offset + i + 1 for i < length)`` keys. ``causal_work(4) -> 10``, ``causal_work(2, 2) -> 7``."""
    length = np.asarray(length, np.int64)
    offset = np.asarray(offset, np.int64)
    return length * offset + length * (length + 1) // 2


# ----------------------------------------------------------------------------------------------
# the plan: lengths in, pieces out (numpy only)
# ----------------------------------------------------------------------------------------------


@record(eq=False)
class CPPlan:
    """Where every token of one packed batch goes in a CP group, from segment lengths alone.

    The batch's segments (``cu_seqlens`` of the flattened batch, a window's padding tail included) are
    laid out as one padded stream ``G`` of ``cp_size * local_len`` tokens: segment ``s`` takes
    ``padded[s]`` slots (its ``lengths[s]`` tokens first, CP padding after them), then the padding
    segments the layout adds at the end (``lengths`` 0). A rank holds *pieces*: runs of one segment.

    Attributes:
        layout, cp_size: as given.
        lengths: ``(S,)`` int64, real tokens per segment (the batch's, then 0 for added padding segments).
        padded: ``(S,)`` int64, slots per segment in ``G`` (zigzag: a multiple of ``2 * cp_size``).
        num_segments: the batch's segments (the first ``num_segments`` of ``lengths``).
        local_len: Python int, tokens every rank holds (equal on all ranks).
        piece_rank, piece_seg, piece_offset, piece_len: ``(P,)`` int64, sorted by rank then by place in
            ``G``: rank ``piece_rank[i]`` holds positions ``piece_offset[i] : + piece_len[i]`` of segment
            ``piece_seg[i]``. Built on first use: one rank's tokens (:meth:`local`) need only that rank's
            pieces (zigzag and contiguous ones follow from ``padded``; the hybrid's are dealt in
            :func:`plan_cp` and kept as dealt, ``dealt``, sorted when every rank's are asked for).
    """

    layout: str
    cp_size: int
    lengths: np.ndarray
    padded: np.ndarray
    num_segments: int
    local_len: int
    #: the hybrid's pieces ``(rank, seg, offset, len)`` as dealt (rows of one (4, P) array), none empty (None for the
    #: other layouts)
    dealt: tuple | None = dataclasses.field(default=None, repr=False)

    # -- pieces --

    def _pieces(self) -> tuple[np.ndarray, ...]:
        """Every rank's pieces in plan order (built once, kept)."""
        table = self.__dict__.get("_table")
        if table is None:
            if self.dealt is None:
                table = _layout_pieces(self.layout, self.padded, self.cp_size)
            else:
                table = _plan_order(self.dealt, self.padded)
            object.__setattr__(self, "_table", table)  # a cache: the plan stays what it was made as
        return table

    piece_rank = property(lambda self: self._pieces()[0])
    piece_seg = property(lambda self: self._pieces()[1])
    piece_offset = property(lambda self: self._pieces()[2])
    piece_len = property(lambda self: self._pieces()[3])

    def own_pieces(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(seg, offset, len)`` of ``rank``'s pieces in their order in ``G``, built for that rank alone (the
        zigzag of 1,472 documents at cp 8: 2,944 pieces, not 23,552): the rank's rows of the piece arrays."""
        if "_table" in self.__dict__:
            p = self.rank_pieces(rank)
            return self.piece_seg[p], self.piece_offset[p], self.piece_len[p]
        if self.dealt is not None:
            return _plan_order(self.dealt, self.padded, rank)[1:]
        if self.layout == "zigzag":
            seg, chunk = self._zigzag_columns()[:2]
            return seg, _zigzag_offsets(chunk, self.cp_size, rank), chunk
        return _contiguous_rank(self.padded, self.local_len, rank)

    def _zigzag_columns(self) -> tuple[np.ndarray, ...]:
        """What every rank's zigzag pieces share (made once a plan, kept): ``(seg, len, out, first, real)`` of the
        pieces, two a segment (head, tail): the segment, the chunk size, the place among a rank's tokens, the flat
        index of the segment's first token and its real tokens. A rank's own: the offsets (:func:`_zigzag_offsets`)."""
        cols = self.__dict__.get("_zigzag")
        if cols is None:
            chunk = (self.padded // (2 * self.cp_size)).repeat(2)
            seg = np.arange(self.padded.size).repeat(2)
            cols = (seg, chunk, lengths_to_offsets(chunk)[:-1], self._seg_starts()[0].repeat(2), self.lengths.repeat(2))
            object.__setattr__(self, "_zigzag", cols)  # a cache, as _table
        return cols

    # -- figures --

    @property
    def num_tokens(self) -> int:
        """Real tokens of the batch (its own padding tails included: they are the batch's tokens)."""
        return int(self.lengths.sum())

    @property
    def padding_tokens(self) -> int:
        """Tokens CP adds: ``cp_size * local_len - num_tokens``."""
        return self.cp_size * self.local_len - self.num_tokens

    def work(self) -> np.ndarray:
        """``(cp_size,)`` int64: causal attention work of each rank over real tokens (CP padding is
        skipped by TE and costs nothing in the balance)."""
        real = np.clip(np.minimum(self.piece_offset + self.piece_len, self.lengths[self.piece_seg])
                       - self.piece_offset, 0, None)
        return np.bincount(self.piece_rank, weights=causal_work(real, self.piece_offset),
                           minlength=self.cp_size).astype(np.int64)

    # -- token-level views --

    def _seg_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """Start of every segment in the batch's flat order and in ``G`` (per row: made once, kept)."""
        starts = self.__dict__.get("_starts")
        if starts is None:
            starts = self._flat_starts(), lengths_to_offsets(self.padded)[:-1]
            object.__setattr__(self, "_starts", starts)  # a cache, as _table
        return starts

    def _flat_starts(self) -> np.ndarray:
        """Start of every segment in the batch's flat order (made once, kept): all a rank's tokens need of the row's
        starts (not their places in ``G``)."""
        flat = self.__dict__.get("_flat")
        if flat is None:
            flat = lengths_to_offsets(self.lengths)[:-1]
            object.__setattr__(self, "_flat", flat)  # a cache, as _table
        return flat

    def rank_pieces(self, rank: int) -> slice:
        """The pieces of ``rank`` (a slice of the piece arrays)."""
        lo, hi = np.searchsorted(self.piece_rank, [rank, rank + 1])
        return slice(int(lo), int(hi))

    def local(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(source, seg, position)`` of ``rank``'s ``local_len`` tokens, int64: the flat index into the
        batch of each (``-1`` for CP padding), its segment and its position in the segment."""
        return self.local_tokens(rank)[:3]

    def local_tokens(self, rank: int) -> tuple[np.ndarray, ...]:
        """:meth:`local`'s ``(source, seg, position)`` and ``(pad_at, first, real, out)``: where the CP padding
        sits among the rank's tokens (``(padding,)``), and for each of its pieces the flat index of its first
        token, its real tokens and its place among the rank's tokens. The padding is a piece's tail, so it is
        marked piece by piece (a few slots), not found token by token."""
        if self.layout == "zigzag" and "_table" not in self.__dict__:  # the columns every rank shares, made once
            seg, n, out, seg_first, seg_real = self._zigzag_columns()
            off = _zigzag_offsets(n, self.cp_size, rank)
        else:
            seg, off, n = self.own_pieces(rank)
            out = lengths_to_offsets(n)[:-1]
            seg_first, seg_real = self._flat_starts()[seg], self.lengths[seg]
        first = seg_first + off
        real = np.minimum(np.maximum(seg_real - off, 0), n)  # not np.clip: its wrapper costs as much
        ar = np.arange(self.local_len)
        pos = np.repeat(off - out, n) + ar
        source = np.repeat(first - out, n) + ar
        short = np.flatnonzero(real < n)  # the pieces that end in CP padding (a few, or none)
        if not short.size:
            pad_at = short
        elif short.size == 1:  # the hybrid's one padding piece, or one document's zigzag padding
            k = int(short[0])
            pad_at = np.arange(int(out[k] + real[k]), int(out[k] + n[k]))
        else:
            pad_at = range_index(out[short] + real[short], n[short] - real[short])
        source[pad_at] = -1
        return source, np.repeat(seg, n), pos, pad_at, first, real, out

    def g_index(self, rank: int) -> np.ndarray:
        """``(local_len,)`` int64: where ``rank``'s tokens sit in the padded stream ``G``."""
        seg, off, n = self.own_pieces(rank)
        return range_index(self._seg_starts()[1][seg] + off, n)

    def rearrange_index(self, *, restore: bool = False) -> np.ndarray:
        """``(1, cp_size * local_len)`` int64, what torch's ``_LoadBalancer._generate_indices(restore)``
        returns (as numpy; :meth:`packkit.cp.CPShard.torch_indices` gives the tensor): ``G[idx]`` cut in
        ``cp_size`` equal contiguous pieces gives every rank its tokens (``restore=True``: the inverse
        permutation). For zigzag on one document of ``2 * cp`` chunks it equals torch's
        ``_HeadTailLoadBalancer``: ``plan_cp([4], cp_size=2, cp_layout="zigzag").rearrange_index() ->
        [[0, 3, 1, 2]]``."""
        self._pieces()  # every rank's: built once
        idx = np.concatenate([self.g_index(r) for r in range(self.cp_size)])
        if restore:
            idx = np.argsort(idx, kind="stable")
        return idx[None]


    def inverse(self) -> np.ndarray:
        """``(num_tokens,)`` int64: for every token of the batch (flat order) its place in the ranks'
        concatenated local tokens (rank 0's first)."""
        self._pieces()  # every rank's: built once
        source = np.concatenate([self.local(r)[0] for r in range(self.cp_size)])
        inv = np.empty(self.num_tokens, np.int64)
        keep = source >= 0
        inv[source[keep]] = np.flatnonzero(keep)
        return inv



def _round_up(x, m):
    return -(-np.asarray(x, np.int64) // m) * m


def _zigzag_pieces(seg, padded, cp) -> tuple[np.ndarray, ...]:
    """Rank r holds chunks r and 2cp-1-r of every segment in ``seg`` (padded to a multiple of 2cp); the
    pieces come rank by rank, in their order in ``G`` (head chunk before tail chunk), as the plan keeps them."""
    chunk = padded[seg] // (2 * cp)
    ranks = np.arange(cp)
    # (ranks, segments, 2): for every rank, the head chunk then the tail chunk of every segment
    offsets = np.stack([ranks[:, None] * chunk[None, :], (2 * cp - 1 - ranks)[:, None] * chunk[None, :]], -1)
    rank = np.broadcast_to(ranks[:, None, None], offsets.shape)
    segs = np.broadcast_to(seg[None, :, None], offsets.shape)
    lens = np.broadcast_to(chunk[None, :, None], offsets.shape)
    return rank.ravel(), segs.ravel(), offsets.ravel(), lens.ravel()


def _contiguous_pieces(padded, cp) -> tuple[np.ndarray, ...]:
    """The stream ``G`` cut in ``cp`` equal pieces, as runs of segments."""
    total = int(padded.sum())
    local = total // cp
    cuts = np.union1d(lengths_to_offsets(padded), np.arange(0, total + 1, local))
    starts, ends = cuts[:-1], cuts[1:]
    seg = np.searchsorted(lengths_to_offsets(padded), starts, side="right") - 1
    g_start = lengths_to_offsets(padded)[:-1]
    return starts // local, seg, starts - g_start[seg], ends - starts


def _zigzag_offsets(chunk, cp, rank) -> np.ndarray:
    """Where ``rank``'s zigzag pieces start in their segments: chunks ``rank`` and ``2cp-1-rank`` of every segment,
    ``chunk`` ``(2S,)`` the chunk size of each piece (head, tail, segment by segment).
    ``_zigzag_offsets([3, 3], 2, 0) -> [0, 9]``."""
    chunk = np.asarray(chunk, np.int64)
    off = chunk * rank
    off[1::2] = chunk[1::2] * (2 * cp - 1 - rank)
    return off


def _contiguous_rank(padded, local_len, rank) -> tuple[np.ndarray, ...]:
    """``(seg, offset, len)`` of one rank's contiguous pieces: the segments that cross ``G[rank * local_len :
    (rank + 1) * local_len]``, clipped to it (:func:`_contiguous_pieces`' rows of that rank)."""
    cu = lengths_to_offsets(padded)
    lo, hi = rank * local_len, (rank + 1) * local_len
    first, last = np.searchsorted(cu, lo, side="right") - 1, np.searchsorted(cu, hi, side="left")
    seg = np.arange(first, last)
    start = np.maximum(cu[first:last], lo)
    return seg, start - cu[first:last], np.minimum(cu[first + 1:last + 1], hi) - start


def _layout_pieces(layout, padded, cp) -> tuple[np.ndarray, ...]:
    """Every rank's zigzag or contiguous pieces, in plan order."""
    if layout == "zigzag":
        return _zigzag_pieces(np.arange(padded.size), padded, cp)
    return _contiguous_pieces(padded, cp)


def _plan_order(dealt, padded, rank=None) -> tuple[np.ndarray, ...]:
    """Dealt pieces ``(rank, seg, offset, len)`` without the empty ones, sorted by rank then by place in ``G``
    (``rank`` given: that rank's only, the sort of its own pieces alone). A segment's pieces lie in ``G`` in the
    order of their offsets and the segments in their own, so a rank's pieces sort by ``seg << 32 | offset`` (a
    batch's offsets are int32: ``cu_seqlens``), without the segments' places in ``G``."""
    r, seg, off, n = dealt
    if rank is not None:
        mine = np.flatnonzero(r == rank)  # the hybrid's dealt pieces are none empty (_hybrid_pieces)
        seg, off, n = seg[mine], off[mine], n[mine]
        order = np.argsort((seg << 32) + off)
        return r[mine], seg[order], off[order], n[order]
    keep = n > 0
    r, seg, off, n = r[keep], seg[keep], off[keep], n[keep]
    order = np.lexsort((lengths_to_offsets(padded)[:-1][seg] + off, r))
    return r[order], seg[order], off[order], n[order]


#: the hybrid layout zigzags a document whose causal work alone exceeds this fraction of a rank's
#: mean work (besides every document over the per-rank share): placed whole, it would make its rank
#: the straggler, since every rank holds the same number of tokens
HYBRID_WORK_FRACTION = 0.05


def _halves_pieces(seg, lengths, cp) -> tuple[np.ndarray, ...]:
    """Zigzag without padding: each segment in ``seg`` gives every rank ``len // cp`` tokens, its
    remainder going to the ranks that hold the fewest so far (so no rank ends over its share); a rank's
    share is its head chunk (``share // 2`` tokens, chunk ``r``) and its tail chunk (chunk ``2cp-1-r``).

    "Fewest so far, the lower rank first" deals the remainders round the ranks like cards: ranks
    ``P .. cp-1`` hold one token fewer than ranks ``0 .. P-1``, ``P`` the remainders dealt so far mod
    ``cp``; so segment ``i`` adds one token to ranks ``P_i, P_i + 1, ...`` (mod cp), all segments at once.
    ``_halves_pieces([0, 1], [5, 5], 2)`` gives rank 0 three tokens of segment 0 and two of segment 1."""
    seg = np.asarray(seg, np.int64)
    if not seg.size:  # nothing long (a row of short documents): no pieces, no numpy pass
        return tuple(np.zeros(0, np.int64) for _ in range(4))
    n = lengths[seg]
    rem = n % cp
    dealt = (np.cumsum(rem) - rem) % cp  # P_i: where segment i's remainder starts
    ranks = np.arange(cp)
    share = n[:, None] // cp + ((ranks[None, :] - dealt[:, None]) % cp < rem[:, None])  # (segments, cp)
    head = share // 2
    sizes = np.concatenate([head, (share - head)[:, ::-1]], axis=1)  # chunk j's size, in the document's order
    offsets = np.cumsum(sizes, axis=1) - sizes
    rank_col = np.concatenate([ranks, ranks[::-1]])  # owner of chunk j: j, then 2cp-1-j
    return (np.tile(rank_col, seg.size) if seg.size > 1 else rank_col, np.repeat(seg, 2 * cp), offsets.ravel(),
            sizes.ravel())


def _deal_equal(work: list, room: list, n: int, count: int) -> list:
    """How many of ``count`` documents of ``n`` tokens each rank gets when they are dealt one by one to the rank of
    least ``work`` with room for them (the lower rank among equal ones); ``work`` and ``room`` (Python ints, one per
    rank) are updated. Fewer than ``count`` in all when the ranks run out of room.

    The documents are equal, so rank ``r`` offers the values ``work[r] + j * w`` (``w`` a document's causal work)
    for ``j < room[r] // n``, and the dealing takes the ``count`` smallest offers in ``(value, rank)`` order. With
    ``work[r] = q[r] * w + f[r]`` an offer's value orders by its level ``q[r] + j`` first, so the count-th offer's
    level ``t`` is found on the breakpoints of "offers below a level" (a few per rank, not an offer each):
    every offer below ``t``, then the ranks offering at ``t`` in ``(f, rank)`` order until ``count``.
    ``_deal_equal([0, 5], [9, 9], 2, 3) -> [2, 1]`` (offers 0, 3, 6 | 5, 8: work [6, 8])."""
    w = n * (n + 1) // 2
    cp = len(work)
    q = [x // w for x in work]
    below = sum(q)  # the offers below every rank's own level
    level = (count - 1 + below) // cp  # the count-th offer's level when it is at or above every rank's own
    if level >= max(q):  # (the ranks within a level or two of one another: nearly every run)
        rest = count + below - cp * level  # 1 .. cp ranks offer once more at the level, in (work % w, rank) order
        took = [level - x for x in q]
        if rest < cp:
            f = [x % w for x in work]
            for r in sorted(range(cp), key=f.__getitem__)[:rest]:
                took[r] += 1
        else:
            took = [x + 1 for x in took]
    else:
        took = _deal_levels(work, q, w, count)
    if max(took) * n > min(room) and any(t * n > r for t, r in zip(took, room)):  # a rank's room binds
        took = _deal_capped(work, room, n, w, count)
    # else every rank the dealing picks still has room when it is picked: the same dealing
    for r in range(cp):
        t = took[r]
        if t:
            work[r] += t * w
            room[r] -= t * n
    return took


def _deal_levels(work: list, q: list, w: int, count: int) -> list:
    """:func:`_deal_equal` without room: offers below level ``L`` are ``sum(max(L - q, 0))``, piecewise
    linear between the sorted ``q``; every offer below the count-th's level, then the ranks at that level in
    ``(f, rank)`` order. ``_deal_levels([0, 5], [0, 1], 3, 3) -> [2, 1]``."""
    qs = sorted(q)
    cp, below = len(q), 0
    for k in range(1, cp + 1):  # between qs[k-1] and qs[k], k ranks offer at every level
        if k == cp or below + k * (qs[k] - qs[k - 1]) >= count:
            level = qs[k - 1] + (count - below - 1) // k
            break
        below += k * (qs[k] - qs[k - 1])
    took = [level - x if x < level else 0 for x in q]
    rest = count - sum(took)
    if rest:
        for _, r in sorted((work[r] - q[r] * w, r) for r in range(cp) if q[r] <= level)[:rest]:
            took[r] += 1
    return took


def _deal_capped(work: list, room: list, n: int, w: int, count: int) -> list:
    """:func:`_deal_equal` where some rank's room binds."""
    cp = len(work)
    cap = [min(r // n, count) for r in room]
    if sum(cap) <= count:
        took = cap
    else:
        q = [x // w for x in work]
        # below(L) = sum(min(max(L - q, 0), cap)): offers under level L, piecewise linear in L; its slope
        # steps up at every q and down at every q + cap (a cap of count cannot bind: left out)
        steps = sorted([(q[r], 1) for r in range(cp) if cap[r]] + [(q[r] + cap[r], -1) for r in range(cp)
                                                                     if 0 < cap[r] < count])
        below = slope = 0
        at = steps[0][0]
        for point, step in steps + [(steps[-1][0] + count + 1, 0)]:  # past the last step: reached before
            if slope and below + slope * (point - at) >= count:
                break
            below += slope * (point - at)
            slope, at = slope + step, point
        level = at + (count - below - 1) // slope
        took = [min(max(level - q[r], 0), cap[r]) for r in range(cp)]
        at = sorted((work[r] - q[r] * w, r) for r in range(cp) if q[r] <= level < q[r] + cap[r])
        for _, r in at[:count - sum(took)]:
            took[r] += 1
    return took


def _dealt_ranks(before, took, w) -> np.ndarray:
    """The rank of every document dealt by :func:`_deal_equal`, run after run, in dealing order, in one numpy
    pass: ``before`` ``(runs, cp)`` the ranks' work as each run began, ``took`` ``(runs, cp)`` the documents each
    rank got, ``w`` ``(runs,)`` a document's work; within a run the offers are taken in ``(value, rank)`` order.

    Every offer as one int64 key, ``run * big + value * cp + rank`` (a run's values from its least work on; ``big``
    past any run's last value times cp): one sort of the keys, and the rank is the key mod cp (no argsort, no
    gather). lexsort where that key could wrap (rows of ~10^9 work)."""
    runs, cp = took.shape
    if not runs:
        return np.zeros(0, np.int64)
    cells = took.ravel()
    rel = before - before.min(1, keepdims=True)
    big = (int(rel.max()) + int(cells.max()) * int(w.max()) + 1) * cp
    start = np.cumsum(cells) - cells
    j = np.arange(int(start[-1] + cells[-1])) - np.repeat(start, cells)  # a document's place among its rank's
    if big * runs >= 1 << 62:
        rank = np.repeat(np.tile(np.arange(cp), runs), cells)
        run = np.repeat(np.arange(runs).repeat(cp), cells)
        return rank[np.lexsort((rank, np.repeat(rel.ravel(), cells) + j * w[run], run))]
    base = rel * cp + (np.arange(runs) * big)[:, None] + np.arange(cp)
    key = np.repeat(base.ravel(), cells) + j * np.repeat(np.repeat(w * cp, cp), cells)
    key.sort()
    return key % cp


def _cut_over_ranks(s: int, n: int, work: list, room: list, pieces: list) -> None:
    """A document no rank has room for whole: cut over the ranks with the most room (small documents, last)."""
    off = 0
    for r in sorted(range(len(room)), key=lambda r: -room[r]):
        take = min(room[r], n - off)
        if take:
            pieces.append((r, s, off, take))
            work[r] += int(causal_work(take, off))
            room[r] -= take
            off += take
        if off == n:
            break


def _least_long(num_tokens: int, total_work: int, cp: int, fraction: float) -> int:
    """The least length the hybrid zigzags: a document is long when it holds more than a rank's share
    ``ceil(T / cp)``, or when its causal work alone exceeds ``fraction`` of a rank's mean work and it has at least
    ``2 * cp`` tokens. Both tests grow with the length, so "long" is "at least this length": one comparison over the
    row, not six (the work is compared as float64, as numpy compares an int64 array with a float).
    ``_least_long(100, 1000, 2, 0.05) -> 7`` (a rank's mean work 500, 5% of it 25: ``6 * 7 / 2 = 21``, ``7 * 8 / 2
    = 28``)."""
    limit = fraction * total_work / cp
    least = max(int(math.sqrt(2 * limit)) - 1, 1)  # n (n + 1) / 2 > limit from about sqrt(2 limit) on
    while float(least * (least + 1) // 2) <= limit:
        least += 1
    while least > 1 and float((least - 1) * least // 2) > limit:
        least -= 1
    return min(-(-num_tokens // cp) + 1, max(least, 2 * cp))


def _hybrid_pieces(lengths, cp, fraction=None) -> tuple[np.ndarray, ...]:
    """Long segments zigzag (unpadded chunks); short ones whole, LPT by causal work into the room every
    rank has left of ``ceil(T / cp)`` tokens; that room's remainder (under cp tokens) is padding.

    The LPT takes the short segments longest first, one run of equal lengths at a time (:func:`_deal_short`: a
    few Python steps a rank for a run, not a step a document: a row of 2,443 chat turns has a few dozen runs),
    and the ranks of every dealt document come in one numpy pass at the end (:func:`_dealt_ranks`). A row of
    short documents only (no long one) makes no zigzag pieces and selects nothing: a few dozen numpy calls in all."""
    fraction = HYBRID_WORK_FRACTION if fraction is None else fraction
    num_tokens = int(lengths.sum())
    local_len = -(-num_tokens // cp)
    # sum of n (n + 1) / 2 over the segments, exact in int64 (the dot of int64 arrays is no float sum)
    least = _least_long(num_tokens, (int(lengths @ lengths) + num_tokens) // 2, cp, fraction)
    long = np.flatnonzero(lengths >= least) if lengths.size else lengths
    if long.size:
        z_rank, z_seg, z_off, z_len = z = _halves_pieces(long, lengths, cp)
        if not z_len.all():  # a rank's chunk of a document under 2 * cp tokens can be empty: none kept
            z = tuple(x[z_len > 0] for x in z)
        work = np.bincount(z_rank, weights=causal_work(z_len, z_off), minlength=cp).astype(np.int64).tolist()
        room = (local_len - np.bincount(z_rank, weights=z_len, minlength=cp).astype(np.int64)).tolist()
        short = np.flatnonzero(lengths < least)
    else:  # every segment short: the dealing reads the lengths as they are
        work, room, short = [0] * cp, [local_len] * cp, None
    whole_rank, whole_seg, cut = _deal_short(lengths, short, least, work, room)
    # what room is left becomes one padding segment per rank, after the batch's segments
    fill = [r for r in range(cp) if room[r] > 0]
    # the pieces as (4, count) blocks, (rank, seg, offset, len), joined by one concatenate
    parts = [np.array((whole_rank, whole_seg, whole_seg * 0, lengths[whole_seg]))] if whole_seg.size else []
    if cut:
        parts.append(np.array(cut, np.int64).T)
    if long.size:
        parts.append(np.array(z))
    if fill:
        parts.append(np.array((fill, range(lengths.size, lengths.size + len(fill)), [0] * len(fill),
                               [room[r] for r in fill]), np.int64))
        padded = np.concatenate([lengths, parts[-1][3]])
        lengths = np.concatenate([lengths, parts[-1][2]])  # the padding segments hold no token of the batch
    else:
        padded = lengths.copy()
    table = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0] if parts else np.zeros((4, 0), np.int64)
    return padded, lengths, tuple(table)


def _deal_short(lengths, short, least: int, work: list, room: list) -> tuple[np.ndarray, np.ndarray, list]:
    """The hybrid's LPT of the segments ``short`` (``None``: every segment; each shorter than ``least``), longest
    first, into ``room`` by ``work`` (both updated): ``(rank, seg)`` of the documents placed whole, in dealing order,
    and the pieces of those cut over the ranks, ``[(rank, seg, offset, length)]``. One step a run of equal lengths
    (:func:`_deal_equal`; a run of one document: the least work with room), the runs counted by one ``bincount``."""
    cp = len(work)
    key = lengths if short is None else lengths[short]
    if not key.size:  # nothing short (a row of one long document)
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    counts = np.bincount(key)
    values = np.flatnonzero(counts)[::-1]  # the distinct lengths, longest first
    # longest first, stable: a radix sort when every length fits 16 bits (all are under least)
    order = np.argsort(-key.astype(np.int16) if least <= 1 << 15 else -key, kind="stable")
    seg = order if short is None else short[order]
    before, took, placed, cut = [], [], [], []  # before, took: (runs * cp) flat
    ranks, many = [], False  # the rank of each document of a run of one; whether a run held more
    at = 0
    sizes = counts[values]
    for n, c in zip(values.tolist(), sizes.tolist()):
        before += work
        if c == 1:  # one document: the rank of least work with room (the lower among equal ones)
            dealt = [0] * cp
            r = work.index(min(work))
            if room[r] < n:
                r = min((s for s in range(cp) if room[s] >= n), key=work.__getitem__, default=-1)
            k = int(r >= 0)
            if k:
                dealt[r] = 1
                work[r] += n * (n + 1) // 2
                room[r] -= n
                ranks.append(r)
        else:
            dealt = _deal_equal(work, room, n, c)
            k = sum(dealt)
            many = True
        took += dealt
        placed.append(k)
        if k < c:  # no rank has room for these whole
            for s in seg[at + k:at + c].tolist():
                _cut_over_ranks(s, n, work, room, cut)
        at += c
    if at > sum(placed):  # every run's dealt documents, in dealing order
        seg = seg[range_index(lengths_to_offsets(sizes)[:-1], placed)]
    if not many:  # every run one document (a row of a few): their ranks as dealt
        return np.array(ranks, np.int64), seg, cut
    return (_dealt_ranks(np.array(before, np.int64).reshape(-1, cp), np.array(took, np.int64).reshape(-1, cp),
                         values * (values + 1) // 2), seg, cut)


def plan_cp(lengths, *, cp_size: int, cp_layout: str = "hybrid") -> CPPlan:
    """Plan one batch for a CP group from its segment lengths (the flattened batch's ``cu_seqlens``
    diffs; a window's padding tail is a segment like any other).

    ``plan_cp([9, 3, 4], cp_size=2, cp_layout="zigzag").padded -> [12, 4, 4]`` (local_len 10);
    ``plan_cp([9, 3, 4], cp_size=2, cp_layout="contiguous").local_len -> 8``.
    """
    cp = check_cp_size(cp_size)
    layout = _check_layout(cp_layout)
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if lengths.size and lengths.min() < 1:
        raise ArgumentError("segment lengths must be >= 1 (drop empty segments), got {x}", x=int(lengths.min()))
    return _plan(lengths, cp, layout)


def _plan(lengths: np.ndarray, cp: int, layout: str) -> CPPlan:
    """:func:`plan_cp` of lengths already checked (``(S,)`` int64, each >= 1), ``cp`` and ``layout`` too."""
    num_segments = int(lengths.size)
    dealt = None
    if layout == "zigzag":
        padded = _round_up(lengths, 2 * cp)
    elif layout in ("contiguous", "ulysses"):
        pad = (-int(lengths.sum())) % cp
        if pad:  # one padding segment at the end of the row (positions from 0, no loss)
            lengths = np.append(lengths, 0)
        padded = np.append(lengths[:num_segments], pad) if pad else lengths.copy()
    else:
        padded, lengths, dealt = _hybrid_pieces(lengths, cp)
    local_len = int(padded.sum()) // cp
    return CPPlan(layout, cp, lengths, padded, num_segments, local_len, dealt)


def plan_for_cp(lengths, *, window: int, cp_size: int = 1, cp_layout: str = "hybrid", **pack_kwargs) -> Plan:
    """:func:`packkit.binpack.pack` for rows a CP group will shard: with ``"zigzag"`` every example is
    planned at its length padded to a multiple of ``2 * cp_size`` (so each row still holds ``window``
    tokens once :func:`packkit.cp.shard` pads its documents), then the plan is given back over the real lengths
    (a split example's padding sits in its last piece). The other layouts plan as ``pack`` does, with
    ``window`` a multiple of ``cp_size``. ``plan_for_cp([7, 6, 1], window=8, cp_size=2,
    cp_layout="zigzag").num_windows -> 3``: ``pack`` alone makes 2 (``[7, 1]``, ``[6]``), but 7 and 1
    padded to 8 and 4 no longer share a window.
    """
    check_cp_window(window, cp_size=cp_size, cp_layout=cp_layout)
    doc_multiple, _ = cp_multiples(cp_size=cp_size, cp_layout=cp_layout)
    if doc_multiple == 1:
        return pack(lengths, window=window, **pack_kwargs)
    plan = pack(lengths, window=window, **pack_kwargs)  # checks lengths as pack does
    real = plan.lengths
    padded = pack(_round_up(real, doc_multiple), window=window, **pack_kwargs)
    seg_length = np.clip(real[padded.seg_example] - padded.seg_start, 0, padded.seg_length)
    cut = int(real.sum() - seg_length.sum()) - int(real[padded.dropped_examples].sum())
    return dataclasses.replace(padded, lengths=real, seg_length=seg_length, cut_tokens=cut)


def cp_padding(row_lengths, *, cp_size: int, cp_layout: str) -> int:
    """CP padding tokens of one row (its segment lengths): ``cp_padding([9, 3, 4], cp_size=2,
    cp_layout='zigzag') -> 4``. The row-level layouts pad the row to a multiple of ``cp_size``."""
    cp = check_cp_size(cp_size)
    layout = _check_layout(cp_layout)
    lengths = np.asarray(row_lengths, np.int64)
    if layout == "zigzag":
        return int((_round_up(lengths, 2 * cp) - lengths).sum())
    if layout in ("contiguous", "ulysses"):
        return (-int(lengths.sum())) % cp
    return plan_cp(lengths, cp_size=cp, cp_layout=layout).padding_tokens


# ----------------------------------------------------------------------------------------------
