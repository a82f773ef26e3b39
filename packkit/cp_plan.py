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

import numpy as np

from .binpack import Plan, pack
from .errors import ArgumentError, arg, check_choice, check_int
from .segments import lengths_to_offsets, range_index

__all__ = ["LAYOUTS", "CPPlan", "plan_cp", "causal_work", "cp_padding", "cp_multiples", "check_cp_window",
           "plan_for_cp", "check_cp_size"]

LAYOUTS = ("zigzag", "contiguous", "ulysses", "hybrid")

def check_cp_size(cp_size) -> int:
    """``cp_size``: a Python int >= 1 (1 means no context parallelism)."""
    return check_int(cp_size, "cp_size")


def _check_layout(layout: str, name: str = "layout") -> str:
    return check_choice(layout, name, LAYOUTS, what="CP layout")


def causal_work(length, offset=0):
    """Causal attention work of ``length`` tokens of one document starting at position ``offset``:
    ``sum(offset + i + 1 for i < length)`` keys. ``causal_work(4) -> 10``, ``causal_work(2, 2) -> 7``."""
    length = np.asarray(length, np.int64)
    offset = np.asarray(offset, np.int64)
    return length * offset + length * (length + 1) // 2


# ----------------------------------------------------------------------------------------------
# the plan: lengths in, pieces out (numpy only)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
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
            ``piece_seg[i]``.
    """

    layout: str
    cp_size: int
    lengths: np.ndarray
    padded: np.ndarray
    num_segments: int
    local_len: int
    piece_rank: np.ndarray
    piece_seg: np.ndarray
    piece_offset: np.ndarray
    piece_len: np.ndarray

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
        """Start of every segment in the batch's flat order and in ``G``."""
        return lengths_to_offsets(self.lengths)[:-1], lengths_to_offsets(self.padded)[:-1]

    def rank_pieces(self, rank: int) -> slice:
        """The pieces of ``rank`` (a slice of the piece arrays)."""
        lo, hi = np.searchsorted(self.piece_rank, [rank, rank + 1])
        return slice(int(lo), int(hi))

    def local(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(source, seg, position)`` of ``rank``'s ``local_len`` tokens, int64: the flat index into the
        batch of each (``-1`` for CP padding), its segment and its position in the segment."""
        p = self.rank_pieces(rank)
        seg = np.repeat(self.piece_seg[p], self.piece_len[p])
        pos = range_index(self.piece_offset[p], self.piece_len[p])
        flat_start, _ = self._seg_starts()
        source = np.where(pos < self.lengths[seg], flat_start[seg] + pos, -1)
        return source, seg, pos

    def g_index(self, rank: int) -> np.ndarray:
        """``(local_len,)`` int64: where ``rank``'s tokens sit in the padded stream ``G``."""
        p = self.rank_pieces(rank)
        _, g_start = self._seg_starts()
        return range_index(g_start[self.piece_seg[p]] + self.piece_offset[p], self.piece_len[p])

    def rearrange_index(self, *, restore: bool = False) -> np.ndarray:
        """``(1, cp_size * local_len)`` int64, what torch's ``_LoadBalancer._generate_indices(restore)``
        returns (as numpy; :meth:`packkit.cp.CPShard.torch_indices` gives the tensor): ``G[idx]`` cut in
        ``cp_size`` equal contiguous pieces gives every rank its tokens (``restore=True``: the inverse
        permutation). For zigzag on one document of ``2 * cp`` chunks it equals torch's
        ``_HeadTailLoadBalancer``: ``plan_cp([4], cp_size=2, layout="zigzag").rearrange_index() ->
        [[0, 3, 1, 2]]``."""
        idx = np.concatenate([self.g_index(r) for r in range(self.cp_size)])
        if restore:
            idx = np.argsort(idx, kind="stable")
        return idx[None]


    def inverse(self) -> np.ndarray:
        """``(num_tokens,)`` int64: for every token of the batch (flat order) its place in the ranks'
        concatenated local tokens (rank 0's first)."""
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
    n = lengths[seg]
    rem = n % cp
    dealt = (np.cumsum(rem) - rem) % cp  # P_i: where segment i's remainder starts
    ranks = np.arange(cp)
    share = n[:, None] // cp + ((ranks[None, :] - dealt[:, None]) % cp < rem[:, None])  # (segments, cp)
    head = share // 2
    sizes = np.concatenate([head, (share - head)[:, ::-1]], axis=1)  # chunk j's size, in the document's order
    offsets = np.cumsum(sizes, axis=1) - sizes
    rank_col = np.concatenate([ranks, ranks[::-1]])  # owner of chunk j: j, then 2cp-1-j
    return (np.broadcast_to(rank_col, sizes.shape).ravel(), np.repeat(seg, 2 * cp), offsets.ravel(),
            sizes.ravel())


def _lpt_equal(work, room, n: int, count: int) -> np.ndarray:
    """Ranks of ``count`` documents of ``n`` tokens dealt one by one to the rank of least ``work`` with room
    for them (the lower rank among equal ones), all at once; ``work`` and ``room`` are updated. Fewer than
    ``count`` when the ranks run out of room.

    The documents are equal, so rank ``r`` offers the values ``work[r] + j * w`` (``w`` a document's causal
    work) for ``j < room[r] // n``, and one-by-one least-work dealing takes the ``count`` smallest offers
    in ``(value, rank)`` order: ``_lpt_equal([0., 5.], [9, 9], 2, 3) -> [0, 0, 1]`` (offers 0, 3, 6 | 5, 8).
    Works are exact integers in float64, so the order is the loop's."""
    w = n * (n + 1) // 2
    cap = np.minimum(room // n, count)
    total = int(cap.sum())
    rank = np.repeat(np.arange(cap.size), cap)
    j = np.arange(total) - np.repeat(np.cumsum(cap) - cap, cap)
    pick = rank[np.lexsort((rank, work[rank] + j * w))[:count]]
    took = np.bincount(pick, minlength=cap.size)
    work += took * w
    room -= took * n
    return pick


def _cut_over_ranks(s: int, n: int, work, room, pieces: list) -> None:
    """A document no rank has room for whole: cut over the ranks with the most room (small documents, last)."""
    off = 0
    for r in np.argsort(-room, kind="stable").tolist():
        take = int(min(room[r], n - off))
        if take:
            pieces.append((r, s, off, take))
            work[r] += int(causal_work(take, off))
            room[r] -= take
            off += take
        if off == n:
            break


def _hybrid_pieces(lengths, cp, fraction=None) -> tuple[np.ndarray, ...]:
    """Long segments zigzag (unpadded chunks); short ones whole, LPT by causal work into the room every
    rank has left of ``ceil(T / cp)`` tokens; that room's remainder (under cp tokens) is padding.

    The LPT takes the short segments longest first, one run of equal lengths at a time (:func:`_lpt_equal`:
    one numpy pass a run, not a Python step a document: a row of 2,443 chat turns has a few dozen runs)."""
    fraction = HYBRID_WORK_FRACTION if fraction is None else fraction
    total = int(lengths.sum())
    local_len = -(-total // cp)
    doc_work = causal_work(lengths)
    long = (lengths > local_len) | ((doc_work > fraction * doc_work.sum() / cp) & (lengths >= 2 * cp))
    z_rank, z_seg, z_off, z_len = _halves_pieces(np.flatnonzero(long), lengths, cp)
    work = np.bincount(z_rank, weights=causal_work(z_len, z_off), minlength=cp).astype(np.float64)
    room = local_len - np.bincount(z_rank, weights=z_len, minlength=cp).astype(np.int64)
    short = np.flatnonzero(~long)
    short = short[np.argsort(-lengths[short], kind="stable")]
    runs = lengths_to_offsets(np.unique(lengths[short], return_counts=True)[1][::-1])
    whole_rank, whole_seg, cut = [], [], []  # cut: (rank, seg, offset, length)
    for a, b in zip(runs[:-1].tolist(), runs[1:].tolist()):
        n = int(lengths[short[a]])
        rank = _lpt_equal(work, room, n, b - a)
        whole_rank.append(rank)
        whole_seg.append(short[a:a + rank.size])
        for s in short[a + rank.size:b].tolist():  # no rank has room for it whole
            _cut_over_ranks(s, n, work, room, cut)
    whole_rank = np.concatenate(whole_rank) if whole_rank else np.zeros(0, np.int64)
    whole_seg = np.concatenate(whole_seg) if whole_seg else np.zeros(0, np.int64)
    # what room is left becomes one padding segment per rank, after the batch's segments
    fill = np.flatnonzero(room > 0)
    seg_ids = len(lengths) + np.arange(fill.size)
    parts = [np.stack([whole_rank, whole_seg, np.zeros_like(whole_seg), lengths[whole_seg]], 1),
             np.array(cut, np.int64).reshape(-1, 4),
             np.stack([z_rank, z_seg, z_off, z_len], 1).astype(np.int64),
             np.stack([fill, seg_ids, np.zeros_like(fill), room[fill]], 1).astype(np.int64)]
    table = np.concatenate(parts)
    lengths = np.concatenate([lengths, np.zeros(fill.size, np.int64)])
    padded = np.concatenate([lengths[:len(lengths) - fill.size], room[fill]])
    return padded, lengths, tuple(table.T)


def plan_cp(lengths, *, cp_size: int, layout: str = "hybrid") -> CPPlan:
    """Plan one batch for a CP group from its segment lengths (the flattened batch's ``cu_seqlens``
    diffs; a window's padding tail is a segment like any other).

    ``plan_cp([9, 3, 4], cp_size=2, layout="zigzag").padded -> [12, 4, 4]`` (local_len 10);
    ``plan_cp([9, 3, 4], cp_size=2, layout="contiguous").local_len -> 8``.
    """
    cp = check_cp_size(cp_size)
    _check_layout(layout)
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if lengths.size and lengths.min() < 1:
        raise ArgumentError("segment lengths must be >= 1 (drop empty segments), got {x}", x=int(lengths.min()))
    num_segments = int(lengths.size)
    if layout == "zigzag":
        padded = _round_up(lengths, 2 * cp)
        pieces = _zigzag_pieces(np.arange(num_segments), padded, cp)
    elif layout in ("contiguous", "ulysses"):
        pad = (-int(lengths.sum())) % cp
        if pad:  # one padding segment at the end of the row (positions from 0, no loss)
            lengths = np.append(lengths, 0)
        padded = np.append(lengths[:num_segments], pad) if pad else lengths.copy()
        pieces = _contiguous_pieces(padded, cp)
    else:
        padded, lengths, pieces = _hybrid_pieces(lengths, cp)
    rank, seg, off, length = (np.asarray(x, np.int64) for x in pieces)
    if layout == "hybrid":  # pieces in dealing order, some empty; zigzag's and contiguous' come in plan order
        keep = length > 0
        rank, seg, off, length = rank[keep], seg[keep], off[keep], length[keep]
        g_start = lengths_to_offsets(padded)[:-1]
        order = np.lexsort((g_start[seg] + off, rank))
        rank, seg, off, length = rank[order], seg[order], off[order], length[order]
    local_len = int(padded.sum()) // cp
    return CPPlan(layout, cp, lengths, padded, num_segments, local_len, rank, seg, off, length)


def cp_multiples(*, cp_size: int, layout: str) -> tuple[int, int]:
    """``(document multiple, row multiple)`` a layout pads to: zigzag pads every document to a multiple
    of ``2 * cp``, the others cut the row in ``cp`` equal pieces. ``cp_multiples(cp_size=4,
    layout="zigzag") -> (8, 1)``; ``layout="hybrid" -> (1, 4)``."""
    cp = check_cp_size(cp_size)
    return (2 * cp, 1) if _check_layout(layout) == "zigzag" else (1, cp)


def check_cp_window(window: int, *, cp_size: int, layout: str) -> int:
    """``window`` if a row of it can be cut for the layout (a multiple of ``2 * cp`` for zigzag, of ``cp``
    for the others), else a one-line error naming the window to pass: ``check_cp_window(4096, cp_size=8,
    layout="zigzag") -> 4096``."""
    _check_layout(layout, "cp_layout")
    doc_multiple, row_multiple = cp_multiples(cp_size=cp_size, layout=layout)
    m = doc_multiple * row_multiple
    if window % m:
        raise ArgumentError("{window} is not a multiple of {m}, which {layout} with {cp} needs; raise {w} to {up:,}",
                            window=arg("window", window), m=m, layout=arg("cp_layout", layout),
                            cp=arg("cp_size", cp_size), w=arg("window"), up=-(-window // m) * m)
    return window


def plan_for_cp(lengths, *, window: int, cp_size: int = 1, cp_layout: str = "hybrid", **pack_kwargs) -> Plan:
    """:func:`packkit.binpack.pack` for rows a CP group will shard: with ``"zigzag"`` every example is
    planned at its length padded to a multiple of ``2 * cp_size`` (so each row still holds ``window``
    tokens once :func:`packkit.cp.shard` pads its documents), then the plan is given back over the real lengths
    (a split example's padding sits in its last piece). The other layouts plan as ``pack`` does, with
    ``window`` a multiple of ``cp_size``. ``plan_for_cp([7, 6, 1], window=8, cp_size=2,
    cp_layout="zigzag").num_windows -> 3``: ``pack`` alone makes 2 (``[7, 1]``, ``[6]``), but 7 and 1
    padded to 8 and 4 no longer share a window.
    """
    check_cp_window(window, cp_size=cp_size, layout=cp_layout)
    doc_multiple, _ = cp_multiples(cp_size=cp_size, layout=cp_layout)
    if doc_multiple == 1:
        return pack(lengths, window=window, **pack_kwargs)
    plan = pack(lengths, window=window, **pack_kwargs)  # checks lengths as pack does
    real = plan.lengths
    padded = pack(_round_up(real, doc_multiple), window=window, **pack_kwargs)
    seg_length = np.clip(real[padded.seg_example] - padded.seg_start, 0, padded.seg_length)
    cut = int(real.sum() - seg_length.sum()) - int(real[padded.dropped_examples].sum())
    return dataclasses.replace(padded, lengths=real, seg_length=seg_length, cut_tokens=cut)


def cp_padding(row_lengths, *, cp_size: int, layout: str) -> int:
    """CP padding tokens of one row (its segment lengths): ``cp_padding([9, 3, 4], cp_size=2,
    layout='zigzag') -> 4``. The row-level layouts pad the row to a multiple of ``cp_size``."""
    cp = check_cp_size(cp_size)
    _check_layout(layout)
    lengths = np.asarray(row_lengths, np.int64)
    if layout == "zigzag":
        return int((_round_up(lengths, 2 * cp) - lengths).sum())
    if layout in ("contiguous", "ulysses"):
        return (-int(lengths.sum())) % cp
    return plan_cp(lengths, cp_size=cp, layout=layout).padding_tokens


# ----------------------------------------------------------------------------------------------
