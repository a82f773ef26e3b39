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
    head chunk and a tail chunk); the others stay whole and are dealt longest first by causal work (the
    ranks behind catch up, then a snake over the ranks: 0 1 .. cp-1 cp-1 .. 1 0 ..), each rank keeping
    what fits its room; the rest are cut over the room left, the roomiest rank first; under cp tokens of
    padding fill the ranks up (here c is cut for its work, b for want of room)
      rank 0  a0 a1 a6 a7 a8 | b2 | c0 c3        positions 0 1 6 7 8 | 2 | 0 3
      rank 1  a2 a3 a4 a5    | b0 b1 | c1 c2     positions 2 3 4 5   | 0 1 | 1 2

The causal work of a rank is ``sum over its real tokens of (position + 1)``: the keys each query
attends to. Contiguous pieces give the last rank the most; zigzag balances every document but pads each
one; the hybrid pads under cp tokens a row and balances the rest as an exact LPT does, to 0.1% summed over
real chat rows, in a few numpy passes (figures: ``benchmarks/RESULTS.md``, "Context parallelism" and ``cphyb``).

The planner (:func:`plan_cp`) reads segment lengths only (no tokens); :func:`plan_for_cp` plans rows a CP
group will shard so that they still fit the window once padded.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
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
            :func:`plan_cp` and kept as dealt, ``dealt``, sorted when every rank's are asked for; a plan
            :func:`packkit.cp.shard` makes for one rank deals that rank's alone, every rank's when asked for).
    """

    layout: str
    cp_size: int
    lengths: np.ndarray
    padded: np.ndarray
    num_segments: int
    local_len: int
    #: the hybrid's pieces as dealt (:attr:`dealt`), None until dealt (a plan made for one rank) and for the other layouts
    _dealt: tuple | None = dataclasses.field(default=None, repr=False)

    @property
    def dealt(self) -> tuple | None:
        """The hybrid's pieces ``(rank, seg, offset, len)`` as dealt (rows of one (4, P) array), none empty; None for
        the other layouts. A plan made for one rank (:func:`packkit.cp.shard`) deals every rank's on first use."""
        if self._dealt is None and self.layout == "hybrid":
            n = self.num_segments
            object.__setattr__(self, "_dealt", _hybrid_pieces(self.lengths[:n], self.cp_size)[2])  # a cache, as _table
        return self._dealt

    # -- pieces --

    def _pieces(self) -> tuple[np.ndarray, ...]:
        """Every rank's pieces in plan order (built once, kept)."""
        table = self.__dict__.get("_table")
        if table is None:
            if self.layout != "hybrid":
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
        own = self.__dict__.get("_own")
        if own is not None and own[0] == rank:  # the one rank the plan was made for (_plan's rank)
            return own[1]
        if self.layout == "hybrid":
            return _plan_order(self.dealt, self.padded, rank)[1:]
        if self.layout == "zigzag":
            chunk = self._zigzag_columns()[2]
            return np.arange(self.padded.size).repeat(2), _zigzag_offsets(chunk, self.cp_size, rank), chunk
        return _contiguous_rank(self.padded, self.local_len, rank)

    def _zigzag_columns(self) -> tuple[np.ndarray, ...]:
        """What every rank's zigzag tokens share (made once a plan, kept): ``(chunk, out, sizes, seg)``. Per segment
        (``(S,)``): its chunk (a rank holds two, its head chunk and its tail chunk, ``2 * chunk`` tokens) and its place
        among a rank's tokens; per piece (``(2S,)``, head then tail): its size; per token of a rank (``(local_len,)``,
        the same on every rank): its segment, int32 (the shard's ``seq_idx`` as it is). A rank's own: where its two
        chunks start (:meth:`_zigzag_tokens`), a few passes over the segments, none over every rank's pieces."""
        cols = self.__dict__.get("_zigzag")
        if cols is None:
            chunk = self.padded // (2 * self.cp_size)
            twice = chunk * 2
            seg = np.arange(chunk.size, dtype=np.int32).repeat(twice)
            cols = (chunk, twice.cumsum() - twice, chunk.repeat(2), seg)
            object.__setattr__(self, "_zigzag", cols)  # a cache, as _table
        return cols

    def _zigzag_tokens(self, rank: int, total: int | None = None) -> tuple[np.ndarray, ...]:
        """``(source, seg, pos, pad)`` of ``rank``'s zigzag tokens: :meth:`local`'s three (``seg`` int32) and where the
        CP padding is. Segment ``s``'s tokens sit at ``out .. out + 2c`` among the rank's (``c`` its chunk): its head
        chunk ``rank`` (positions ``rank * c ..``), then its tail chunk ``2cp-1-rank``; a position past the segment's
        real length is padding. ``pad``: the padding's places, one run a segment (a head chunk with padding is
        followed by a tail chunk of padding alone), where the segments are few and hold little padding; else a
        ``(local_len,)`` bool mask (thousands of short documents: most of a tail chunk is padding, and a pass over
        the tokens costs less than one over the segments' runs). ``total``: the batch's tokens, if known."""
        chunk, out, sizes, seg = self._zigzag_columns()
        starts, cp = self._flat_starts(), self.cp_size
        head, tail = chunk * rank, chunk * (2 * cp - 1 - rank)  # where the rank's chunks start in their segment
        step = np.empty(sizes.size, np.int64)  # a piece's position minus its place among the rank's tokens
        step[0::2] = head - out
        step[1::2] = tail - out - chunk
        pos = step.repeat(sizes)
        ar = np.arange(pos.size)
        pos += ar
        step[0::2] += starts
        step[1::2] += starts
        source = step.repeat(sizes)
        source += ar
        pad_rank = self.local_len - (self.num_tokens if total is None else total) // cp  # about
        if 3 * chunk.size + 2 * pad_rank > self.local_len:
            pad = pos >= self.lengths.repeat(chunk * 2)
            np.putmask(source, pad, -1)
            return source, seg, pos, pad
        real = np.minimum(np.maximum(self.lengths - head, 0), chunk) + np.minimum(np.maximum(self.lengths - tail, 0),
                                                                                   chunk)
        has = (real < chunk * 2).nonzero()[0]  # (not np.flatnonzero: its wrappers)
        if not has.size:
            return source, seg, pos, has
        pad = range_index(out[has] + real[has], chunk[has] * 2 - real[has])
        source[pad] = -1
        return source, seg, pos, pad

    def _zigzag_places(self, tokens, rank: int) -> np.ndarray:
        """Where ``rank`` holds the flat ``tokens`` (a few: the rows' last tokens), among its own: ``(k,)`` int64,
        those it holds only, a Python step a token (a dozen numpy calls on one element cost more).
        ``plan_cp([9, 3], cp_size=2, cp_layout="zigzag")._zigzag_places([8, 11], 1) -> [5, 7]`` (token 8:
        position 8 of segment 0, in rank 1's tail chunk 6..8; token 11: position 2 of segment 1, its tail chunk)."""
        chunk, out = self._zigzag_columns()[:2]
        starts, cp = self._flat_starts(), self.cp_size
        places = []
        for token in tokens:
            s = int(starts.searchsorted(token, "right")) - 1
            p, c = token - int(starts[s]), int(chunk[s])
            k = p // c
            if k == rank or k == 2 * cp - 1 - rank:
                places.append(int(out[s]) + p - k * c + (c if k >= cp else 0))
        return np.array(places, np.int64)

    def _contiguous_tokens(self, rank: int) -> tuple[np.ndarray, ...]:
        """``(source, seg, pos, pad)`` of ``rank``'s contiguous (or ulysses) tokens: :meth:`local`'s three (``seg``
        int32) and the places of its CP padding. The padded stream is the row itself, then the padding segment, so
        the rank's tokens are ``G[rank * n : (rank + 1) * n]`` and their flat indices those slots: the segments that
        cross them are found by two searches, not by summing every segment's length (a pass over the row's)."""
        n, cp = self.local_len, self.cp_size
        lo, hi = rank * n, (rank + 1) * n
        starts = self._flat_starts()  # every segment's, the padding segment's (if any) at the row's end
        offsets = np.append(starts, int(starts[-1]) + int(self.padded[-1])) if starts.size else np.zeros(1, np.int64)
        first, last = int(offsets.searchsorted(lo, "right")) - 1, int(offsets.searchsorted(hi, "left"))
        bounds = offsets[first:last + 1].copy()
        bounds[0], bounds[-1] = lo, hi
        sizes = bounds[1:] - bounds[:-1]
        seg = np.arange(first, last, dtype=np.int32).repeat(sizes)
        source = np.arange(lo, hi)
        pos = source - offsets[first:last].repeat(sizes)
        end = int(offsets[self.num_segments]) - lo  # the batch's tokens end there
        pad = np.arange(max(end, 0), n) if end < n else np.zeros(0, np.int64)
        source[pad] = -1
        return source, seg, pos, pad

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

    def _keep_flat_starts(self, offsets: np.ndarray) -> None:
        """Keep the batch's own ``(S + 1,)`` int64 offsets of its segments (its ``cu_seqlens``, every segment
        non-empty) as :meth:`_flat_starts`, the padding segments the layout adds starting at the batch's end."""
        extra = self.lengths.size - self.num_segments
        flat = offsets[:-1] if not extra else offsets if extra == 1 else np.append(offsets, [offsets[-1]] * (extra - 1))
        object.__setattr__(self, "_flat", flat)  # a cache, as _table

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
        source, seg, pos = self._zigzag_tokens(rank)[:3] if self.layout == "zigzag" else self.local_tokens(rank)[:3]
        return source, seg.astype(np.int64), pos

    def local_tokens(self, rank: int) -> tuple[np.ndarray, ...]:
        """:meth:`local`'s ``(source, seg, position)`` (``seg`` int32) and ``(pad_at, first, real, out)``: where the CP
        padding sits among the rank's tokens (``(padding,)``), and for each of its pieces the flat index of its first
        token, its real tokens and its place among the rank's tokens. Every layout but zigzag pads with padding
        segments alone (a piece of a batch's segment holds real tokens only), after the batch's: only the rank's last
        piece can be padding, so the padding is the rank's last tokens, found from that piece alone."""
        seg, off, n = self.own_pieces(rank)
        out = n.cumsum()
        out -= n  # (not lengths_to_offsets: a zeros, a cumsum and a slice)
        first = self._flat_starts()[seg] + off
        ar = np.arange(self.local_len)
        pos = (off - out).repeat(n)
        pos += ar
        source = (first - out).repeat(n)
        source += ar
        real, pad_at = n, ar[:0]
        if n.size and seg[-1] >= self.num_segments:  # a padding segment's piece: the rank's last tokens
            pad_at = ar[int(out[-1]):]
            source[pad_at[0]:] = -1
            real = n.copy()
            real[-1] = 0
        return source, seg.astype(np.int32).repeat(n), pos, pad_at, first, real, out

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
        mine = (r == rank).nonzero()[0]  # the hybrid's dealt pieces are none empty (_hybrid_pieces)
        seg, off, n = seg[mine], off[mine], n[mine]
        order = ((seg << 32) + off).argsort()
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


def _halves_few(seg, lengths, cp) -> tuple[np.ndarray, ...]:
    """:func:`_halves_pieces` in Python lists, for a few segments (their count times ``cp`` at most ``_FEW_HALVES``):
    the same four arrays, where the numpy passes (two dozen calls on ``(segments, cp)`` arrays) cost more than the
    steps. ``_halves_few(np.array([0]), np.array([5]), 2)`` -> ranks ``[0, 1, 1, 0]``, offsets ``[0, 1, 2, 3]``,
    sizes ``[1, 1, 1, 2]`` (rank 0 holds 3 tokens: the remainder's, in its tail chunk)."""
    seg = seg.tolist()
    rank_col = list(range(cp)) + list(range(cp - 1, -1, -1))
    segs, offs, sizes, dealt = [], [], [], 0
    for s, n in zip(seg, lengths[seg].tolist()):
        base, rem = divmod(n, cp)
        share = [base + ((q - dealt) % cp < rem) for q in range(cp)]  # the ranks from ``dealt`` on take the remainder
        head = [x // 2 for x in share]
        size = head + [x - h for x, h in zip(share[::-1], head[::-1])]
        offs += itertools.accumulate(size[:-1], initial=0)
        sizes += size
        segs += [s] * (2 * cp)
        dealt = (dealt + rem) % cp
    return (np.array(rank_col * len(seg), np.int64), np.array(segs, np.int64), np.array(offs, np.int64),
            np.array(sizes, np.int64))


#: the most segments times ``cp`` whose zigzag halves :func:`_halves_few` makes in Python (one document up to cp 32;
#: the 15 long ones of the median chat row at cp 2 and 4)
_FEW_HALVES = 64


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


class _Parts(list):
    """The pieces a dealing appends, ``(4, k)`` blocks ``(rank, seg, offset, len)``: every rank's, or where ``rank`` is
    given that rank's alone (each block's columns of that rank; the snake's grid gives its column, no table of every
    rank's: :func:`_deal_short`), and those dealt in Python lists (:meth:`add`) as ``rows``."""

    def __init__(self, rank: int | None = None):
        super().__init__()
        self.rank = rank
        self.rows = []  #: one rank's pieces made in Python (:meth:`add`), as ``(seg, offset, len)`` tuples

    def append(self, block) -> None:
        super().append(block if self.rank is None else block[:, block[0] == self.rank])

    def add(self, rows: list) -> None:
        """Pieces dealt in Python, ``(rank, seg, offset, len)`` tuples: a block of every rank's, or the rank's rows."""
        if self.rank is None:
            super().append(np.array(rows, np.int64).reshape(-1, 4).T)
        else:
            self.rows += [row[1:] for row in rows if row[0] == self.rank]


def _hybrid_pieces(lengths, cp, fraction=None, total=None, rank=None) -> tuple[np.ndarray, ...]:
    """Long segments zigzag (unpadded chunks); short ones whole, dealt longest first by causal work
    (:func:`_deal_short`: a few numpy passes; a step a document only for a few, ``_FEW``) into the room every rank has
    left of ``ceil(T / cp)`` tokens; those that overflow their rank's room are laid over the room left, the
    roomiest rank first (cut where a rank's room ends), and that room's remainder (under cp tokens) is padding.

    A row of short documents only (no long one) makes no zigzag pieces and selects nothing; one with nothing short
    deals nothing: a few dozen numpy calls in all, whatever the number of documents or of distinct lengths. One rank's
    pieces of a few long documents (:func:`_halves_rank`: its share read in closed form, every rank's room and, for
    short ones beside them, work in Python lists; a short few dealt in Python too) take no numpy pass but the arrays.

    ``(padded, lengths, pieces)``: the pieces of every rank as dealt, or with ``rank`` that rank's alone (every rank's
    room is still dealt: it decides the lay-over and the padding segments, so ``padded`` and ``lengths`` are the
    same), sorted by segment then offset (its order in ``G``)."""
    fraction = HYBRID_WORK_FRACTION if fraction is None else fraction
    num_tokens = int(lengths.sum()) if total is None else total
    local_len = -(-num_tokens // cp)
    # sum of n (n + 1) / 2 over the segments, exact in int64 (the dot of int64 arrays is no float sum)
    least = _least_long(num_tokens, (int(lengths @ lengths) + num_tokens) // 2, cp, fraction)
    if rank is not None and 0 < lengths.size <= _FEW_LONG and least >= 2 * cp and np.minimum.reduce(lengths) >= least:
        # a few segments, every one long (a row of long chat turns): one rank's halves in closed form, no numpy pass
        flat, room = _halves_rank(range(lengths.size), lengths.tolist(), cp, rank, local_len)
        return _rank_rows(lengths, room, rank, flat)
    is_long = lengths >= least
    long = is_long.nonzero()[0] if lengths.size else lengths
    parts = _Parts(rank)
    short = long.size < lengths.size  # short ones to deal
    if long.size and rank is not None and long.size * cp <= _FEW_HALVES:
        # one rank's halves in closed form; every rank's room and work (the short ones' dealing reads them) in Python
        work = [0] * cp if short else None
        flat, room = _halves_rank(long.tolist(), lengths[long].tolist(), cp, rank, local_len, work)
        parts.rows += [t for t in zip(flat[0::3], flat[1::3], flat[2::3]) if t[2]]  # (a chunk can be empty)
    elif long.size:
        z_rank, z_seg, z_off, z_len = z = (_halves_few if long.size * cp <= _FEW_HALVES else _halves_pieces)(
            long, lengths, cp)
        if not np.logical_and.reduce(z_len):  # a rank's chunk of a document under 2 * cp tokens can be empty: none kept
            z = tuple(x[z_len > 0] for x in z)
        parts.append(np.array(z))
        room = local_len - np.bincount(z_rank, weights=z_len, minlength=cp).astype(np.int64)
        work = np.bincount(z_rank, weights=causal_work(z_len, z_off), minlength=cp).astype(np.int64) if short else None
    else:  # nothing long: the dealing reads the lengths as they are (short=None), into every rank's whole room
        room, work = [local_len] * cp, None
    if short:
        room = _deal_short(lengths, (~is_long).nonzero()[0] if long.size else None, least, work, room, parts)
    if rank is not None and not len(parts):  # one rank's pieces, every one made in Python: sorted in Python
        return _rank_rows(lengths, room, rank, list(itertools.chain.from_iterable(sorted(parts.rows))))
    # what room is left becomes one padding segment per rank, after the batch's segments
    room = np.asarray(room)
    fill = (room > 0).nonzero()[0]
    if fill.size:
        parts.append(np.array((fill, np.arange(lengths.size, lengths.size + fill.size), fill * 0, room[fill])))
    padded, lengths = _with_padding(lengths, room[fill])
    if parts.rows:
        list.append(parts, np.array([(rank, *row) for row in parts.rows], np.int64).reshape(-1, 4).T)
    table = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0] if parts else np.zeros((4, 0), np.int64)
    if rank is None:
        return padded, lengths, tuple(table)
    # the rank's pieces as dealt (none empty), in G's order: by segment, then offset (the rows read one by one: an
    # array unpacked is iterated to an IndexError, its message formatted)
    seg, off, n = table[1], table[2], table[3]
    order = ((seg << 32) + off).argsort()
    return padded, lengths, (seg[order], off[order], n[order])


def _with_padding(lengths, pad) -> tuple[np.ndarray, np.ndarray]:
    """``(padded, lengths)``, ``(S + k,)`` int64: the batch's segments, then the ``k`` padding segments of ``pad`` slots
    (an array or a list: the room left of the ranks that have some, rank order), which hold no token of the batch."""
    if not len(pad):
        return lengths.copy(), lengths
    return np.concatenate([lengths, pad]), np.concatenate([lengths, np.zeros(len(pad), np.int64)])


def _rank_rows(lengths, room: list, rank: int, flat: list) -> tuple:
    """:func:`_hybrid_pieces`' end for one rank whose pieces were all made in Python, ``flat`` (``seg, offset, len``
    of each, in their order; ``room``: every rank's room left, a list): its padding segment after them (the ``k``-th
    of the ranks with room left is segment ``S + k``), ``(padded, lengths)`` and the rank's ``(seg, offset, len)``."""
    fill = [q for q in range(len(room)) if room[q] > 0]
    if room[rank] > 0:
        flat += lengths.size + fill.index(rank), 0, room[rank]
    # (np.fromiter of a flat list: np.array of a list of tuples discovers every element's type and shape, 5x slower)
    table = np.fromiter(flat, np.int64, len(flat)).reshape(-1, 3)
    return (*_with_padding(lengths, [room[q] for q in fill]), (table[:, 0], table[:, 1], table[:, 2]))


#: the most segments, every one long, whose one rank's halves :func:`_halves_rank` makes in Python (a step a segment
#: costs ~5 k instructions here, a numpy call on a few elements ~6 k; the median chat row is 16 long at cp 4-16)
_FEW_LONG = 24


def _halves_rank(long, n: list, cp: int, rank: int, local_len: int, work: list | None = None) -> tuple[list, list]:
    """One rank's zigzag halves of the long segments ``long`` of ``n`` tokens (:func:`_halves_pieces`' pieces of that
    rank) in closed form, a few steps a segment, no ``(segments, cp)`` table: ``(flat, room)``, the rank's pieces
    ``seg, offset, len`` in a flat list (a head chunk then a tail chunk a segment; a chunk of a segment under ``2 *
    cp`` tokens can be empty), and every rank's room left of ``local_len`` (a list). ``work`` (every rank's, a list)
    gets their causal work of them, a step a rank and segment.

    Segment ``i`` gives rank ``q`` ``base = n // cp`` tokens, one more where its remainder, dealt round the ranks from
    ``P_i`` on (the remainders before it, mod cp), covers ``q``; ``c`` of the ranks before ``rank`` are covered. The
    chunks lie heads of ranks ``0 .. cp-1``, then tails of ``cp-1 .. 0``; a head is ``share // 2`` (``base // 2``, plus
    the remainder's token where ``base`` is odd) and a tail the rest, so the rank's head starts at ``rank * (base //
    2)`` (``+ c`` for an odd base) and its tail ends where the tails of ranks ``rank .. 0`` end the segment (``(rank +
    1) * ceil(base / 2)``, ``+ c`` and its own for an even base). Over every segment the remainders are dealt round
    the ranks from rank 0 on: rank ``q`` holds ``(T - R % cp) / cp`` tokens of them, one more for ``q < R % cp``
    (``T`` their tokens, ``R`` the remainders').
    ``_halves_rank([0], [5], 2, 0, 3)`` -> ``([0, 0, 1, 0, 3, 2], [0, 1])``: rank 0 holds tokens 0 and 3..4."""
    flat, dealt = [], 0
    for s, x in zip(long, n):
        base = x // cp
        rem = x - base * cp
        half = base >> 1
        lo = rank - dealt
        e = 0 <= lo < rem or lo + cp < rem  # the rank gets one of the remainder
        c = 0 if lo <= 0 else lo if lo < rem else rem  # (conditional expressions, not min and max: a call each)
        if dealt + rem > cp:  # the remainder wraps round to ranks 0 ..
            c += rank if rank < dealt + rem - cp else dealt + rem - cp
        if base & 1:  # the remainder's token in the head
            flat += s, rank * half + c, half + e, s, x - (rank + 1) * (half + 1), half + 1
        else:
            flat += s, rank * half, half, s, x - (rank + 1) * half - c - e, half + e
        if work is not None:  # every rank's work of its head and tail chunks, rank by rank
            _add_halves_work(work, x, base, rem, dealt)
        dealt = (dealt + rem) % cp
    held = (sum(n) - dealt) // cp  # every rank's tokens of them, but the last remainders': ranks 0 .. dealt-1 one more
    return flat, [local_len - held - (q < dealt) for q in range(cp)]


def _add_halves_work(work: list, x: int, base: int, rem: int, dealt: int) -> None:
    """Adds to every rank's ``work`` the causal work of its head and tail chunks of a segment of ``x`` tokens
    (:func:`_halves_rank`'s chunks for every rank: ``base``, ``rem`` and the remainder's first rank ``dealt``)."""
    cp, half, odd, c = len(work), base >> 1, base & 1, 0
    for q in range(cp):
        e = (q - dealt) % cp < rem
        h = half + (e if odd else 0)
        t = base + e - h
        h_off = q * half + (c if odd else 0)
        c += e
        t_off = x - (q + 1) * (base - half) - (0 if odd else c)
        work[q] += h * h_off + (h * (h + 1) >> 1) + t * t_off + (t * (t + 1) >> 1)


def _catch_up(n, work, cp: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The ranks behind the busiest catch up first: the largest documents (``n`` tokens each, longest first) laid
    end to end over the ranks' shortfalls, the rank behind the most first, each document where its middle falls.
    ``(caught, their ranks, the ranks' work after them)``; ``_catch_up(np.array([4, 3, 1]), np.array([0, 9]), 2)
    -> (1, [0], [10, 9])``."""
    w = n * (n + 1) // 2
    short = work.max() - work  # each rank's shortfall
    by = np.argsort(-short, kind="stable")
    ends = np.cumsum(short[by])
    middle = np.cumsum(w) - (w + 1) // 2
    caught = int(np.searchsorted(middle, ends[-1]))  # the documents whose middle falls in a shortfall
    rank = by[np.searchsorted(ends, middle[:caught], side="right")]
    return caught, rank, work + np.bincount(rank, weights=w[:caught], minlength=cp).astype(np.int64)


def _snake(count: int, cp: int) -> np.ndarray:
    """The places in a snake of ``count`` documents over ``cp`` ranks: ``0 1 .. cp-1 cp-1 .. 1 0 0 1 ..``."""
    j = np.arange(count) % (2 * cp)
    return np.minimum(j, 2 * cp - 1 - j)


def _deal_short(lengths, short, least: int, work, room, parts: list) -> np.ndarray:
    """The hybrid's dealing of the segments ``short`` (``None``: every segment; each shorter than ``least``) into
    ``room`` over ranks that already hold ``work`` of the long ones (``None``: nothing long), longest first, by
    causal work, in a few numpy passes (no step a document or a run of equal lengths, but for ``_FEW`` or fewer):

    * the ranks behind the busiest catch up (:func:`_catch_up`), then the rest go in a snake over the ranks, least
      work first (``0 1 .. cp-1 cp-1 .. 1 0 0 1 ..``): every rank gets a like mix of long and short documents, so
      like work and like tokens;
    * each rank keeps its documents, in dealing order, while they fit its room; the rest are laid end to end over
      the room left in their order in the row, the roomiest rank first (stable), cut where a rank's room ends
      (:func:`_lay_over`).

    This replaced an exact LPT (each document to the rank of least work with room: a Python step a run of equal
    lengths); on the real rows of ``benchmarks/bench_cp.py`` the busiest rank's work is the LPT's to 5 digits
    summed over the rows (RESULTS.md, ``cphyb``). Appends the pieces to ``parts`` as ``(4, k)`` blocks ``(rank,
    seg, offset, len)``; returns the room left. At most ``_FEW`` documents are dealt in Python (:func:`_deal_few`)."""
    if (lengths.size if short is None else short.size) <= _FEW:  # (lists in, a list out)
        return _deal_few(lengths, short, _listed(work), _listed(room), parts)
    room, work = np.asarray(room), None if work is None else np.asarray(work)
    cp = room.size
    key = lengths if short is None else lengths[short]
    # longest first, stable: a radix sort when every length fits 16 bits (all are under least)
    order = (-key.astype(np.int16) if least <= 1 << 15 else -key).argsort(kind="stable")
    seg = order if short is None else short[order]
    ranks = None  # the snake's ranks, least work first (None: 0 .. cp-1)
    if work is not None and work.min() < work.max():
        top = int(key[order[0]])
        if top * (top + 1) // 4 < cp * int(work.max()) - int(work.sum()):  # the largest one's middle in a shortfall
            n = key[order]
            caught, first, after = _catch_up(n, work, cp)
            rank = np.concatenate([first, np.argsort(after, kind="stable")[_snake(n.size - caught, cp)]])
            return _deal_listed(lengths, rank, seg, n, room, parts)
        ranks = work.argsort(kind="stable")  # none catches up
    # the snake as a grid: row pair k holds documents 2cp k .. 2cp (k + 1) - 1, the second row reversed, so that
    # column c holds rank ranks[c]'s documents in dealing order (-1: none)
    rows = -(-seg.size // (2 * cp))
    grid = np.empty(rows * 2 * cp, np.int64)
    grid[:seg.size] = seg
    grid[seg.size:] = -1
    pairs = grid.reshape(rows, 2, cp)
    pairs[:, 1] = pairs[:, 1, ::-1]
    grid = grid.reshape(2 * rows, cp)
    n = lengths[grid]
    if seg.size % (2 * cp):  # none (-1) read the last segment: 0 tokens (in the last two rows)
        n[-2:][grid[-2:] < 0] = 0
    room_c = room if ranks is None else room[ranks]
    fits = n.cumsum(axis=0) <= room_c
    if getattr(parts, "rank", None) is not None:  # one rank's: its column of the grid, no table of every rank's
        return _deal_column(lengths, grid, n, fits, room, room_c, ranks, parts)
    table = np.empty((4, *grid.shape), np.int64)  # (rank, seg, offset, len) of every cell (not np.stack: its wrapper)
    table[0] = np.arange(cp) if ranks is None else ranks
    table[1] = grid
    table[2] = 0
    table[3] = n
    if fits.all():
        parts.append(table[:, grid >= 0] if seg.size % (2 * cp) else table.reshape(4, -1))
    else:
        parts.append(table[:, fits & (grid >= 0)])
    return _room_left(lengths, grid, n, fits, room, room_c, ranks, parts, _lay_over)


def _deal_column(lengths, grid, n, fits, room, room_c, ranks, parts) -> np.ndarray:
    """:func:`_deal_short`'s grid for one rank (``parts.rank``): the documents of its column that fit its room, then
    its share of the lay-over of those of every column that do not; the same pieces as the rank's of the table, and
    every rank's room left. A column's documents fit as a prefix (its counts only grow down the grid)."""
    rank = parts.rank
    c = rank if ranks is None else int((ranks == rank).argmax())  # the rank's column
    col, keep = grid[:, c], fits[:, c]
    if grid[-1, c] < 0:  # no document in its last cells
        keep = keep & (col >= 0)
    block = np.zeros((4, int(np.add.reduce(keep))), np.int64)  # (the ufunc: ndarray.sum's Python wrapper costs as much)
    block[0] = rank
    block[1] = col[keep]
    block[3] = n[:, c][keep]
    list.append(parts, block)
    return _room_left(lengths, grid, n, fits, room, room_c, ranks, parts, _lay_over_rank)


def _room_left(lengths, grid, n, fits, room, room_c, ranks, parts, lay_over) -> np.ndarray:
    """Every rank's room left once the grid's cells that fit are dealt: those that do not laid over the room left
    by ``lay_over`` (:func:`_lay_over`, or :func:`_lay_over_rank` for one rank's pieces)."""
    if np.logical_and.reduce(fits, axis=None):
        used = np.add.reduce(n, 0)
        return room - (used if ranks is None else used[ranks.argsort()])
    left = room_c - np.add.reduce(n * fits, 0)
    if ranks is not None:
        left = left[ranks.argsort()]
    over = grid[~fits & (grid >= 0)]
    over.sort()
    return lay_over(over, lengths[over], left, parts)


def _lay_over_rank(seg, n, left, parts: list) -> np.ndarray:
    """:func:`_lay_over` for one rank (``parts.rank``): every rank's room left after it, and that rank's pieces alone,
    in Python lists: its share of the documents laid end to end is one run of that stream, ``[end - room, end)``, the
    ranks in the lay-over's order (the roomiest first, stable), cut where a document ends (a few pieces; no pass
    over every cut). ``_lay_over_rank([4, 7], [3, 2], [1, 4], parts)`` with ``parts.rank == 0``: rank 1 takes the
    stream's tokens 0..4 (document 4, then 1 token of document 7), rank 0 token 4: the piece ``(0, 7, 1, 1)``."""
    rank, room, n = parts.rank, left.tolist(), n.tolist()
    by = sorted(range(len(room)), key=[-x for x in room].__getitem__)  # the roomiest first, stable (as argsort's)
    ends = list(itertools.accumulate([room[r] for r in by]))
    doc_end = list(itertools.accumulate(n))
    total = doc_end[-1]
    i = by.index(rank)
    lo, hi = ends[i] - room[rank], ends[i] if ends[i] < total else total  # the rank's run of the stream
    pieces = []
    d = bisect.bisect_right(doc_end, lo)
    while lo < hi:  # (conditional expressions, not min and max: a call each)
        end = doc_end[d] if doc_end[d] < hi else hi
        pieces.append((d, lo - doc_end[d] + n[d], end - lo))
        lo, d = end, d + 1
    block = np.empty((4, len(pieces)), np.int64)
    block[0] = rank
    block[1:] = np.array(pieces, np.int64).reshape(-1, 3).T
    block[1] = seg[block[1]]
    list.append(parts, block)
    out = [0] * len(room)
    for r, e in zip(by, ends):  # every rank's room after it: what its run leaves past the stream's end
        out[r] = 0 if e <= total else e - total if e - total < room[r] else room[r]
    return np.array(out, np.int64)


#: the most short documents :func:`_deal_few` deals in Python: below it a step a document costs less than the few
#: dozen numpy calls of :func:`_deal_short` (2-8 us each on small arrays here)
_FEW = 24


def _listed(x):
    """A list of numbers as a Python list (an array's ``tolist``), None as is."""
    return x if x is None or type(x) is list else x.tolist()


def _deal_few(lengths, short, work: list | None, room: list, parts: list) -> list:
    """:func:`_deal_short` of a few documents, one step a document in Python lists (``work``, ``room``: every rank's;
    returns the room left): the same rule, the same pieces in the same order (the median chat row at cp 2 deals one
    short document: ~60 numpy calls on arrays of a few elements did it, 1.2x slower than the LPT's loop).
    ``_deal_few(np.array([3, 1]), None, None, [2, 2], _Parts()) -> [0, 0]`` (1 kept by rank 1; 3 cut over the room
    left: 2 tokens on rank 0, 1 on rank 1)."""
    cp = len(room)
    n_of = lengths.tolist()
    segs = sorted(range(len(n_of)) if short is None else short.tolist(), key=lambda s: -n_of[s])  # stable
    n = [n_of[s] for s in segs]
    cols = list(range(cp))  # the snake's ranks, least work first
    if work is not None and min(work) < max(work):
        if (n[0] * (n[0] + 1) // 2) // 2 < cp * max(work) - sum(work):  # the largest one's middle in a shortfall
            return _listed_few(lengths, _catch_up_few(n, work, cp), segs, n, room, parts)
        cols = sorted(cols, key=work.__getitem__)
    placed = []  # (row, column, rank, seg, len) of the snake's grid (_deal_short), in dealing order
    for k, (s, x) in enumerate(zip(segs, n)):
        p, j = divmod(k, 2 * cp)
        col = j if j < cp else 2 * cp - 1 - j
        placed.append((2 * p + (j >= cp), col, cols[col], s, x))
    placed.sort(key=lambda t: t[:2])  # the grid read row by row, as _deal_short's table
    return _listed_few(lengths, [t[2] for t in placed], [t[3] for t in placed], [t[4] for t in placed], room, parts,
                       by_rank=False)


def _catch_up_few(n, wk, cp: int) -> list:
    """:func:`_catch_up` then the snake, in Python: every document's rank, in dealing order."""
    short = [max(wk) - w for w in wk]
    by = sorted(range(cp), key=lambda r: -short[r])
    ends = list(itertools.accumulate(short[r] for r in by))
    rank, done, after = [], 0, list(wk)
    for x in n:
        w = x * (x + 1) // 2
        middle = done + w - (w + 1) // 2
        if middle >= ends[-1]:
            break
        r = by[bisect.bisect_right(ends, middle)]
        rank.append(r)
        after[r] += w
        done += w
    order = sorted(range(cp), key=lambda r: after[r])
    return rank + [order[min(j % (2 * cp), 2 * cp - 1 - j % (2 * cp))] for j in range(len(n) - len(rank))]


def _listed_few(lengths, rank, seg, n, room: list, parts: list, by_rank: bool = True) -> list:
    """:func:`_deal_listed` in Python lists (``by_rank``: the pieces sorted by rank, stable, as it lays them;
    else kept in the order given): each rank keeps its documents while they fit, the rest laid over the room left."""
    items = sorted(zip(rank, seg, n), key=lambda t: t[0]) if by_rank else list(zip(rank, seg, n))
    held, kept, over = [0] * len(room), [], []
    for r, s, x in items:
        held[r] += x
        (kept if held[r] <= room[r] else over).append((r, s, 0, x))
    parts.add(kept)
    if not over:
        return [a - b for a, b in zip(room, held)]
    left = list(room)
    for r, _, _, x in kept:
        left[r] -= x
    over = sorted(s for _, s, _, _ in over)
    return _lay_over_few(over, [int(lengths[s]) for s in over], left, parts)


def _lay_over_few(seg, n, left: list, parts: list) -> list:
    """:func:`_lay_over` in Python lists (``seg`` sorted, ``n`` their tokens, ``left`` every rank's room): the same
    pieces in the same order, and the room left after them."""
    by = sorted(range(len(left)), key=lambda r: -left[r])  # the roomiest rank first, stable
    ends = list(itertools.accumulate(left[r] for r in by))
    doc_end = list(itertools.accumulate(n))
    total = doc_end[-1]
    starts = sorted(set([0] + doc_end[:-1] + [e for e in ends if e < total]))
    pieces = []
    for i, a in enumerate(starts):
        d = bisect.bisect_right(doc_end, a)
        b = starts[i + 1] if i + 1 < len(starts) else total
        pieces.append((by[bisect.bisect_right(ends, a)], seg[d], a - (doc_end[d] - n[d]), b - a))
    parts.add(pieces)
    out = list(left)
    for r, e in zip(by, ends):
        out[r] = min(max(e - total, 0), left[r])
    return out


def _deal_listed(lengths, rank, seg, n, room, parts: list) -> np.ndarray:
    """:func:`_deal_short` of documents whose ranks are listed (``rank``, in dealing order): each rank keeps its
    documents while they fit its room, the rest laid over the room left (:func:`_lay_over`)."""
    cp = room.size
    # rank by rank, in dealing order (a radix sort: ranks fit 16 bits), each rank's tokens counted up
    by = np.argsort(rank.astype(np.int16) if cp <= 1 << 15 else rank, kind="stable")
    rank, seg, n = rank[by], seg[by], n[by]
    count = np.bincount(rank, minlength=cp)
    ends = np.cumsum(n)
    held = ends - np.append(ends - n, 0)[np.cumsum(count) - count].repeat(count)  # a document's end in its rank's
    fits = held <= room[rank]
    if fits.all():
        parts.append(np.array((rank, seg, rank * 0, n)))
        return room - np.bincount(rank, weights=n, minlength=cp).astype(np.int64)
    parts.append(np.array((rank[fits], seg[fits], seg[fits] * 0, n[fits])))
    left = room - np.bincount(rank[fits], weights=n[fits], minlength=cp).astype(np.int64)
    over = np.sort(seg[~fits])
    return (_lay_over if getattr(parts, "rank", None) is None else _lay_over_rank)(over, lengths[over], left, parts)


def _lay_over(seg, n, left, parts: list) -> np.ndarray:
    """Documents ``seg`` of ``n`` tokens that did not fit their rank's room, laid end to end in their order in the
    row (``seg`` sorted) over the room ``left`` (every rank's: it holds them all), the roomiest rank first (stable:
    as the exact LPT cut a document no rank had room for), cut where a rank's room ends; appends the pieces to
    ``parts``; returns the room left after them."""
    by = (-left).argsort(kind="stable")
    ends = left[by].cumsum()
    doc_end = n.cumsum()
    total = int(doc_end[-1])
    starts = np.concatenate([[0], doc_end[:-1], ends[ends < total]])  # every cut, some twice (not union1d: slow)
    starts.sort()
    keep = np.empty(starts.size, bool)
    keep[0] = True
    np.not_equal(starts[1:], starts[:-1], out=keep[1:])
    starts = starts[keep]
    doc = doc_end.searchsorted(starts, side="right")
    slot = ends.searchsorted(starts, side="right")
    size = np.empty_like(starts)  # np.diff(starts, append=total), without its wrapper
    np.subtract(starts[1:], starts[:-1], out=size[:-1])
    size[-1] = total - starts[-1]
    parts.append(np.array((by[slot], seg[doc], starts - (doc_end - n)[doc], size)))
    left = left.copy()
    left[by] = np.minimum(np.maximum(ends - total, 0), left[by])
    return left


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


def _plan(lengths: np.ndarray, cp: int, layout: str, total: int | None = None, rank: int | None = None) -> CPPlan:
    """:func:`plan_cp` of lengths already checked (``(S,)`` int64, each >= 1), ``cp`` and ``layout`` too; ``total``:
    their sum, where the caller knows it (a batch's ``cu_seqlens[-1]``). ``rank``: the plan is made for that rank's
    tokens (:func:`packkit.cp.shard`): the hybrid deals that rank's pieces alone, every rank's when asked for."""
    num_segments = int(lengths.size)
    total = int(lengths.sum()) if total is None else total
    dealt = None
    if layout == "zigzag":
        padded = _round_up(lengths, 2 * cp)
        local_len = int(np.add.reduce(padded)) // cp  # (the ufunc: ndarray.sum's Python wrapper costs as much)
    elif layout in ("contiguous", "ulysses"):
        pad = (-total) % cp
        if pad:  # one padding segment at the end of the row (positions from 0, no loss)
            lengths = np.append(lengths, 0)
        padded = np.append(lengths[:num_segments], pad) if pad else lengths.copy()
        local_len = (total + pad) // cp
    else:
        padded, lengths, dealt = _hybrid_pieces(lengths, cp, total=total, rank=rank)
        local_len = -(-total // cp)  # every rank's room filled up: real tokens, then padding
        if rank is not None:  # the rank's pieces (seg, offset, len), sorted: own_pieces(rank)
            plan = CPPlan(layout, cp, lengths, padded, num_segments, local_len)
            object.__setattr__(plan, "_own", (rank, dealt))  # a cache, as _table
            return plan
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
