"""Context parallelism (CP) for packed batches: which tokens each rank of a CP group holds, with
which positions, labels, segments and loss count, and the arguments each CP attention takes.

A packed row is cut across the ``cp`` GPUs of a context-parallel group. Every rank must keep what the
unsharded row meant: **global** per-document positions (RoPE), labels **shifted before slicing** (the
target of a rank's last token is the next rank's first token), the document of every token, the
**global** loss-token count (the loss is a sum over ranks divided by it) and a way back to the row's
order. Documents of 9, 3 and 4 tokens (``cu_seqlens = [0, 9, 12, 16]``), ``cp = 2``::

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
attends to. Contiguous pieces give the last rank the most; zigzag balances every document but pads each one; the hybrid pads under cp
tokens a row and balances the rest by LPT (figures on real chat rows: ``benchmarks/RESULTS.md``,
"Context parallelism").

Consumers and their exact arguments (:class:`CPShard` views):

==============================  ===================================================================
consumer                        view
==============================  ===================================================================
TE / Megatron-Core THD          :meth:`CPShard.te_params` (zigzag): ``PackedSeqParams`` /
                                ``DotProductAttention`` fields ``qkv_format='thd'``, ``cu_seqlens_q``,
                                ``cu_seqlens_kv`` (real lengths), ``cu_seqlens_q_padded``,
                                ``cu_seqlens_kv_padded`` (CP-padded), ``max_seqlen_q/kv``; global
                                (TE divides them by cp itself); the padded and real offsets are
                                checked against each other, so swapping them raises
ring-flash-attn llama3          :meth:`CPShard.llama3_args` (contiguous): ``cu_seqlens_q``,
                                ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``local_k_slice``
                                (what ``llama3_flash_attn_prepare_cu_seqlens`` returns)
DeepSpeed ALST / Ulysses (HF)   :meth:`CPShard.hf_kwargs` (ulysses): ``input_ids``, ``position_ids``,
                                ``shift_labels`` of the rank (``labels`` popped, as its adapter does),
                                ``use_cache=False``; :meth:`CPShard.ulysses_flash_kwargs`: the whole
                                row's ``cu_seq_lens_q/k``, ``max_length_q/k`` after the all-to-all
flash-attn, any layout          :meth:`CPShard.allgather_args` (the hybrid's GPU path): K/V
                                all-gathered, ``k_index`` picks each query piece's keys,
                                ``cu_seqlens_q/k``, ``max_seqlen_q/k`` for ``flash_attn_varlen_func``
torch ``context_parallel``      :meth:`CPPlan.torch_indices`: the ``(1, T)`` rearrange (or restore)
                                indices of torch's ``_LoadBalancer._generate_indices``
packkit's reference             :func:`cp_attention` (float64, any process group, CPU/gloo):
                                ``method='ring'`` (LSE merging), ``'allgather'``, ``'alltoall'``
==============================  ===================================================================

The planner (:func:`plan_cp`) reads segment lengths only (numpy, no tokens), so ``packkit waste
--cp`` and the benchmark price a layout without building a batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from .binpack import Plan, pack
from .errors import ArgumentError, arg, check_int
from .segments import IGNORE_INDEX, cu_seqlens_to_lengths, lengths_to_cu_seqlens, lengths_to_offsets

__all__ = ["LAYOUTS", "METHODS", "CPPlan", "CPShard", "TEParams", "Llama3Args", "AllGatherArgs", "plan_cp", "shard",
           "restore", "shift_labels", "causal_work", "cp_padding", "cp_multiples", "check_cp_window", "plan_for_cp", "cp_attention", "check_cp_size",
           "hf_cp_attention", "register_hf_cp_attention"]

LAYOUTS = ("zigzag", "contiguous", "ulysses", "hybrid")
METHODS = ("ring", "allgather", "alltoall")


def check_cp_size(cp_size) -> int:
    """``cp_size``: a Python int >= 1 (1 means no context parallelism)."""
    return check_int(cp_size, "cp_size")


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ArgumentError("unknown CP layout {got!r}; pass {fix}", got=layout, fix=arg("layout", *LAYOUTS))
    return layout


def _ranges(starts, lengths) -> np.ndarray:
    """Concatenated ``arange(s, s + n)``: ``([5, 0], [2, 3]) -> [5, 6, 0, 1, 2]`` (int64, vectorised)."""
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    off = lengths_to_offsets(lengths)
    return np.arange(int(off[-1]), dtype=np.int64) - np.repeat(off[:-1] - starts, lengths)


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
        pos = _ranges(self.piece_offset[p], self.piece_len[p])
        flat_start, _ = self._seg_starts()
        source = np.where(pos < self.lengths[seg], flat_start[seg] + pos, -1)
        return source, seg, pos

    def g_index(self, rank: int) -> np.ndarray:
        """``(local_len,)`` int64: where ``rank``'s tokens sit in the padded stream ``G``."""
        p = self.rank_pieces(rank)
        _, g_start = self._seg_starts()
        return _ranges(g_start[self.piece_seg[p]] + self.piece_offset[p], self.piece_len[p])

    def torch_indices(self, *, restore: bool = False) -> torch.Tensor:
        """``(1, cp_size * local_len)`` int64, what torch's ``_LoadBalancer._generate_indices(restore)``
        returns: ``G[idx]`` cut in ``cp_size`` equal contiguous pieces gives every rank its tokens
        (``restore=True``: the inverse permutation). For zigzag on one document of ``2 * cp`` chunks it
        equals torch's ``_HeadTailLoadBalancer``."""
        idx = np.concatenate([self.g_index(r) for r in range(self.cp_size)])
        if restore:
            idx = np.argsort(idx, kind="stable")
        return torch.from_numpy(idx)[None]

    def inverse(self) -> np.ndarray:
        """``(num_tokens,)`` int64: for every token of the batch (flat order) its place in the ranks'
        concatenated local tokens (rank 0's first)."""
        source = np.concatenate([self.local(r)[0] for r in range(self.cp_size)])
        inv = np.empty(self.num_tokens, np.int64)
        keep = source >= 0
        inv[source[keep]] = np.flatnonzero(keep)
        return inv


def _segments_of(cu_seqlens) -> np.ndarray:
    lengths = cu_seqlens_to_lengths(np.asarray(cu_seqlens))
    if lengths.size and lengths.min() < 0:
        raise ArgumentError("cu_seqlens must be non-decreasing, got {cu}", cu=list(np.asarray(cu_seqlens)))
    return lengths[lengths > 0]  # static-shape zero-length segments hold no token


def _round_up(x, m):
    return -(-np.asarray(x, np.int64) // m) * m


def _zigzag_pieces(seg, padded, cp) -> tuple[np.ndarray, ...]:
    """Rank r holds chunks r and 2cp-1-r of every segment in ``seg`` (padded to a multiple of 2cp)."""
    chunk = padded[seg] // (2 * cp)
    ranks = np.arange(cp)
    # (segments, ranks, 2): the head chunk then the tail chunk of every segment, for every rank
    offsets = np.stack([ranks[None, :] * chunk[:, None], (2 * cp - 1 - ranks)[None, :] * chunk[:, None]], -1)
    rank = np.broadcast_to(ranks[None, :, None], offsets.shape)
    segs = np.broadcast_to(seg[:, None, None], offsets.shape)
    lens = np.broadcast_to(chunk[:, None, None], offsets.shape)
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
    share is its head chunk (``share // 2`` tokens, chunk ``r``) and its tail chunk (chunk ``2cp-1-r``)."""
    held = np.zeros(cp, np.int64)
    ranks = np.arange(cp)
    rank_col = np.concatenate([ranks, ranks[::-1]])  # owner of chunk j: j, then 2cp-1-j
    out = []
    for s in seg.tolist():
        n = int(lengths[s])
        share = np.full(cp, n // cp, np.int64)
        share[np.argsort(held, kind="stable")[: n % cp]] += 1
        held += share
        head = share // 2
        sizes = np.concatenate([head, (share - head)[::-1]])  # chunk j's size, in the document's order
        offsets = lengths_to_offsets(sizes)[:-1]
        out.append(np.stack([rank_col, np.full(2 * cp, s), offsets, sizes], 1))
    table = np.concatenate(out) if out else np.zeros((0, 4), np.int64)
    return tuple(table.T)


def _hybrid_pieces(lengths, cp, fraction=None) -> tuple[np.ndarray, ...]:
    """Long segments zigzag (unpadded chunks); short ones whole, LPT by causal work into the room every
    rank has left of ``ceil(T / cp)`` tokens; that room's remainder (under cp tokens) is padding."""
    fraction = HYBRID_WORK_FRACTION if fraction is None else fraction
    total = int(lengths.sum())
    local_len = -(-total // cp)
    doc_work = causal_work(lengths)
    long = (lengths > local_len) | ((doc_work > fraction * doc_work.sum() / cp) & (lengths >= 2 * cp))
    z_rank, z_seg, z_off, z_len = _halves_pieces(np.flatnonzero(long), lengths, cp)
    work = np.bincount(z_rank, weights=causal_work(z_len, z_off), minlength=cp).astype(np.float64)
    room = local_len - np.bincount(z_rank, weights=z_len, minlength=cp).astype(np.int64)
    short = np.flatnonzero(~long)
    pieces = []  # (rank, seg, offset, length)
    for s in short[np.argsort(-lengths[short], kind="stable")].tolist():
        n = int(lengths[s])
        fits = room >= n
        if fits.any():
            r = int(np.argmin(np.where(fits, work, np.inf)))
            pieces.append((r, s, 0, n))
            room[r] -= n
            work[r] += n * (n + 1) // 2
            continue
        # no rank has room for it whole: cut it over the ranks with the most room (small documents, last)
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
    # what room is left becomes one padding segment per rank, after the batch's segments
    fill = np.flatnonzero(room > 0)
    seg_ids = len(lengths) + np.arange(fill.size)
    parts = [np.array(pieces, np.int64).reshape(-1, 4),
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
    keep = length > 0
    rank, seg, off, length = rank[keep], seg[keep], off[keep], length[keep]
    g_start = lengths_to_offsets(padded)[:-1]
    order = np.lexsort((g_start[seg] + off, rank))
    local_len = int(padded.sum()) // cp
    plan = CPPlan(layout, cp, lengths, padded, num_segments, local_len,
                  rank[order], seg[order], off[order], length[order])
    return plan


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
    if layout not in LAYOUTS:
        raise ArgumentError("unknown CP layout {got!r}; pass {fix}", got=layout, fix=arg("cp_layout", *LAYOUTS))
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
    tokens once :func:`shard` pads its documents), then the plan is given back over the real lengths
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
# the shard: one rank's tensors and its consumers' arguments
# ----------------------------------------------------------------------------------------------


class TEParams(NamedTuple):
    """TransformerEngine / Megatron-Core ``PackedSeqParams`` for THD with CP (global, unsharded offsets:
    TE divides them by ``cp_size`` itself). ``PackedSeqParams(**p._asdict())``, or
    ``DotProductAttention(...)(q, k, v, **p._asdict(), attn_mask_type="padding_causal")``.

    ``cu_seqlens_q/kv``: ``(S + 1,)`` int32, the **real** document lengths; ``cu_seqlens_q/kv_padded``:
    ``(S + 1,)`` int32, the CP-padded ones (each a multiple of ``2 * cp``), which say where each document
    sits in the rank's tokens. Swapping them is refused (see :meth:`check`)."""

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int

    def check(self, cp_size: int) -> "TEParams":
        """Raise unless the padded offsets are padded (every length a multiple of ``2 * cp_size`` and at
        least the real one): the TE #1409 NaNs came from passing one for the other."""
        real = np.diff(self.cu_seqlens_q.cpu().numpy().astype(np.int64))
        padded = np.diff(self.cu_seqlens_q_padded.cpu().numpy().astype(np.int64))
        if real.shape != padded.shape or (padded % (2 * cp_size)).any() or (padded < real).any():
            raise ValueError(f"cu_seqlens_q_padded must hold every document padded to a multiple of 2*cp="
                             f"{2 * cp_size} and cu_seqlens_q the real lengths; got padded lengths "
                             f"{padded.tolist()[:8]} for real {real.tolist()[:8]} (are they swapped?)")
        return self


class Llama3Args(NamedTuple):
    """ring-flash-attn's llama3 arguments, in the order ``llama3_flash_attn_prepare_cu_seqlens``
    returns them: ``llama3_flash_attn_varlen_func(q, k, v, **args._asdict(), heads_k_stride=...,
    causal=True, group=cp_group)`` (its ``causal`` defaults to False: pass it)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: slice


class AllGatherArgs(NamedTuple):
    """Any layout on flash-attn after an all-gather of K/V (``dist.all_gather_into_tensor``: rank 0's
    tokens first): ``k_index`` picks, for each of this rank's query pieces, its document's keys from the
    start to the piece's last token, so ``flash_attn_varlen_func(q, kg[k_index], vg[k_index],
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)`` (causal aligned bottom-right,
    flash-attn >= 2.1) is the unsharded attention of this rank's queries.

    ``cu_seqlens_q``: ``(P + 1,)`` int32 over the rank's tokens (one segment a piece); ``cu_seqlens_k``:
    ``(P + 1,)`` int32 over ``k_index``; ``k_index``: ``(M,)`` int64 into the gathered ``cp * n`` tokens."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    k_index: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class CPShard:
    """One rank's part of a packed batch (``[1, local_len]`` tensors), and its consumers' arguments.

    Attributes:
        input_ids:     int64 ``[1, n]`` (``n = plan.local_len``); CP padding holds ``pad_id``.
        shift_labels:  int64 ``[1, n]``: the target of each token, shifted on the whole batch before
                       slicing (``-100`` on the last token of a document, on prompts, on padding).
        position_ids:  int64 ``[1, n]``: global positions inside each document (``0..len-1``; CP padding
                       inside a document continues its positions, a padding segment starts at 0).
        seq_idx:       int32 ``[1, n]``: the global segment of each token.
        index:         int64 ``(n,)``: the flat index into the batch of each token, ``-1`` for CP padding.
        num_loss_tokens: Python int, loss tokens of the **whole** batch (every rank divides by it).
        num_local_loss_tokens: Python int, this rank's share of them.
        max_seqlen:    Python int, the batch's longest document (global).
        plan, rank:    the :class:`CPPlan` and this rank.
        batch_shape:   the unsharded batch's ``(B, W)``.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    position_ids: torch.Tensor
    seq_idx: torch.Tensor
    index: torch.Tensor
    num_loss_tokens: int
    num_local_loss_tokens: int
    max_seqlen: int
    plan: CPPlan
    rank: int
    batch_shape: tuple

    @property
    def layout(self) -> str:
        return self.plan.layout

    @property
    def cp_size(self) -> int:
        return self.plan.cp_size

    def _device(self):
        return self.input_ids.device

    def _need(self, *layouts) -> None:
        if self.layout not in layouts:
            raise ValueError(f"this view needs layout={' or '.join(map(repr, layouts))}; the shard was made with "
                             f"layout={self.layout!r} (shard(batch, ..., layout={layouts[0]!r}))")

    # -- TransformerEngine / Megatron-Core (zigzag) --

    def te_params(self) -> TEParams:
        """TE's THD ``PackedSeqParams`` fields (global offsets; see :class:`TEParams`)."""
        self._need("zigzag")
        n = self.plan.num_segments
        real = lengths_to_cu_seqlens(self.plan.lengths[:n])
        padded = lengths_to_cu_seqlens(self.plan.padded[:n])
        dev = self._device()
        cu, cu_pad = (torch.from_numpy(x).to(dev) for x in (real, padded))
        longest = int(self.plan.padded[:n].max(initial=0))
        return TEParams("thd", cu, cu, cu_pad, cu_pad, longest, longest).check(self.cp_size)

    # -- ring-flash-attn llama3 (contiguous) --

    def llama3_args(self) -> Llama3Args:
        """ring-flash-attn's ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``
        for this rank (causal), from the plan on the host: no ``.item()`` on a device tensor."""
        self._need("contiguous")
        cu = lengths_to_offsets(self.plan.padded)  # the whole padded row, padding segment included
        L, r = self.plan.local_len, self.rank
        lo, hi = r * L, (r + 1) * L
        first = int(np.searchsorted(cu, lo, side="right")) - 1
        last = int(np.searchsorted(cu, hi, side="left"))
        seg_start, seg_end = cu[first:last], np.minimum(cu[first + 1:last + 1], hi)
        q_len = seg_end - np.maximum(seg_start, lo)
        k_len = seg_end - seg_start  # keys from the document's start to the rank's last query
        cu_q, cu_k = lengths_to_cu_seqlens(q_len), lengths_to_cu_seqlens(k_len)
        dev = self._device()
        return Llama3Args(torch.from_numpy(cu_q).to(dev), torch.from_numpy(cu_k).to(dev), int(q_len.max()),
                          int(k_len.max()), slice(int(seg_start[0]), int(seg_end[-1])))

    # -- flash-attn after an all-gather (any layout, the hybrid's GPU path) --

    def allgather_args(self) -> AllGatherArgs:
        """This rank's pieces as flash-attn varlen arguments over all-gathered K/V (:class:`AllGatherArgs`)."""
        plan, p = self.plan, self.plan.rank_pieces(self.rank)
        # where every slot of the padded stream G sits in the gathered buffer (rank-major)
        where = np.empty(plan.cp_size * plan.local_len, np.int64)
        where[np.concatenate([plan.g_index(r) for r in range(plan.cp_size)])] = np.arange(where.size)
        _, g_start = plan._seg_starts()
        seg, off, n = plan.piece_seg[p], plan.piece_offset[p], plan.piece_len[p]
        keys = off + n  # a piece sees its document from position 0 to its own last token
        k_index = where[_ranges(g_start[seg], keys)]
        dev = self._device()
        return AllGatherArgs(torch.from_numpy(lengths_to_cu_seqlens(n)).to(dev),
                             torch.from_numpy(lengths_to_cu_seqlens(keys)).to(dev), int(n.max(initial=0)),
                             int(keys.max(initial=0)), torch.from_numpy(k_index).to(dev))

    # -- Hugging Face / DeepSpeed ALST (ulysses; any layout with packkit's cp_attention) --

    def hf_kwargs(self) -> dict:
        """What DeepSpeed's ``UlyssesSPDataLoaderAdapter`` hands the model on each rank: ``input_ids``,
        ``position_ids``, ``shift_labels`` (pre-shifted; no ``labels``), ``use_cache=False``."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "shift_labels": self.shift_labels,
                "use_cache": False}

    def ulysses_flash_kwargs(self) -> dict:
        """The whole row's flash kwargs after Ulysses' all-to-all (every rank holds every token of
        ``heads / cp`` heads): ``cu_seq_lens_q/k`` int32 over the padded row, ``max_length_q/k`` ints."""
        self._need("ulysses", "contiguous")
        cu = torch.from_numpy(lengths_to_cu_seqlens(self.plan.padded)).to(self._device())
        longest = int(self.plan.padded.max(initial=0))
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    def hf_cp_kwargs(self) -> dict:
        """:meth:`hf_kwargs` plus what packkit's CP attention (:func:`register_hf_cp_attention`) reads in
        every layer: ``cp_seq_idx`` and ``cp_position_ids`` (``[1, n]``)."""
        return {**self.hf_kwargs(), "cp_seq_idx": self.seq_idx, "cp_position_ids": self.position_ids}

    def attention_kwargs(self) -> dict:
        """What :func:`cp_attention` needs besides q, k, v: ``seq_idx`` and ``position_ids``, ``(n,)``."""
        return {"seq_idx": self.seq_idx[0], "position_ids": self.position_ids[0]}

    def take(self, x: torch.Tensor, *, fill=0) -> torch.Tensor:
        """This rank's part of a per-token tensor of the batch (``[B, W, ...]`` or ``[T, ...]``, flat
        order), ``fill`` on CP padding: ``(n, ...)``."""
        return _take(x, self.index, self.batch_shape, fill)


def _take(x: torch.Tensor, index: torch.Tensor, shape: tuple, fill) -> torch.Tensor:
    """Rows ``index`` of a per-token tensor laid out as the batch (``shape + features``, or flat
    ``(T,) + features``), ``fill`` where ``index`` is -1 (CP padding)."""
    num_tokens = math.prod(shape)
    if tuple(x.shape[:len(shape)]) == tuple(shape):
        flat = x.reshape(num_tokens, *x.shape[len(shape):])
    elif x.dim() and x.shape[0] == num_tokens:
        flat = x
    else:
        raise ValueError(f"a per-token tensor of the batch must be shaped {tuple(shape)} + features or "
                         f"({num_tokens},) + features; got {tuple(x.shape)}")
    index = index.to(flat.device)
    # index_select, not flat[index]: advanced indexing fans out to the thread pool (17 ms against 9 us
    # for 4k tokens of a 32k row on a loaded 2-core machine)
    out = flat.index_select(0, index.clamp_min(0))
    pad = index < 0
    if bool(pad.any()):
        out.masked_fill_(pad.view(-1, *[1] * (out.dim() - 1)), fill)
    return out


def _batch_fields(batch) -> tuple[torch.Tensor, torch.Tensor, bool, np.ndarray]:
    """``(input_ids [B, W], labels, labels_shifted, segment lengths)`` of a PackedBatch or its dict view."""
    if not isinstance(batch, Mapping) and not hasattr(batch, "input_ids"):
        raise TypeError(f"shard takes a PackedBatch (or its dict view), got {type(batch).__name__}")
    get = batch.get if isinstance(batch, Mapping) else lambda k, d=None: getattr(batch, k, d)
    ids = get("input_ids")
    shifted = "shift_labels" in batch if isinstance(batch, Mapping) else bool(getattr(batch, "labels_shifted", False))
    labels = get("shift_labels") if shifted else get("labels")
    if ids is None or labels is None:
        raise KeyError("shard needs 'input_ids' and 'labels' (or 'shift_labels') in the batch")
    cu = getattr(batch, "cu_seqlens", None)
    if cu is None:
        cu = get("cu_seq_lens_q")
    if cu is None:
        raise KeyError("shard needs the batch's segments: a PackedBatch (cu_seqlens) or 'cu_seq_lens_q'")
    ids = ids if ids.dim() == 2 else ids.reshape(1, -1)
    lengths = _segments_of(cu.cpu().numpy())
    if int(lengths.sum()) != ids.numel():
        raise ValueError(f"cu_seqlens covers {int(lengths.sum())} tokens but input_ids holds {ids.numel()}")
    return ids, labels.reshape(ids.shape), shifted, lengths


def shift_labels(labels: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
    """Targets per token of ``[B, W]`` labels, shifted per row (``labels[:, 1:]`` then ``-100``):
    ``[[-100, 5, 6, -100, 7]] -> [[5, 6, -100, 7, -100]]``. Already-shifted labels are returned as is."""
    if shifted:
        return labels
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def shard(batch, *, cp_size: int, rank: int, layout: str = "hybrid", pad_id: int = 0,
          plan: CPPlan | None = None) -> CPShard:
    """One rank's part of a packed batch for a context-parallel group of ``cp_size`` ranks.

    Args:
        batch: a ``PackedBatch`` (or its dict view with ``cu_seq_lens_q``): ``[B, W]`` windows or a
            ``[1, T]`` row; its segments are read from ``cu_seqlens``.
        cp_size, rank: the CP group's size and this rank in it.
        layout: ``"zigzag"``, ``"contiguous"``, ``"ulysses"`` or ``"hybrid"`` (see the module docstring).
        pad_id: token of the CP padding.
        plan: a :class:`CPPlan` of this batch already made (every rank makes the same one).

    Returns: a :class:`CPShard`; ``restore([...every rank's output...], plan=shard.plan)`` puts
    per-token outputs back in the batch's order.

    >>> from packkit.batch import PackedBatch
    >>> ids = torch.arange(8)[None]
    >>> b = PackedBatch(input_ids=ids, labels=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    ...                 cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))
    >>> s = shard(b, cp_size=2, rank=0, layout="zigzag")
    >>> s.index.tolist(), s.position_ids.tolist()   # rows of the packed row; per-document positions
    ([0, 3, 4, 7], [[0, 3, 0, 3]])
    """
    cp = check_cp_size(cp_size)
    rank = check_int(rank, "rank", low=0, high=cp - 1)
    ids, labels, shifted, lengths = _batch_fields(batch)
    if plan is None:
        plan = plan_cp(lengths, cp_size=cp, layout=layout)
    elif plan.cp_size != cp or plan.layout != layout or not np.array_equal(plan.lengths[:plan.num_segments], lengths):
        raise ValueError("the plan passed to shard was made for another batch, cp_size or layout")
    source, seg, pos = plan.local(int(rank))
    dev = ids.device
    index = torch.from_numpy(source).to(dev)
    targets = shift_labels(labels, shifted=shifted)
    local_targets = _take(targets, index, tuple(ids.shape), IGNORE_INDEX)
    total = int((targets != IGNORE_INDEX).sum())
    local = int((local_targets != IGNORE_INDEX).sum())
    return CPShard(
        input_ids=_take(ids, index, tuple(ids.shape), pad_id)[None],
        shift_labels=local_targets[None],
        position_ids=torch.from_numpy(pos).to(dev)[None],
        seq_idx=torch.from_numpy(seg.astype(np.int32)).to(dev)[None],
        index=index, num_loss_tokens=total, num_local_loss_tokens=local,
        max_seqlen=int(lengths.max(initial=0)), plan=plan, rank=int(rank), batch_shape=tuple(ids.shape))


def restore(parts, *, plan: CPPlan, shape=None) -> torch.Tensor:
    """Every rank's per-token outputs (``(local_len, ...)`` or ``(1, local_len, ...)``, rank order) back in
    the batch's flat order: ``(num_tokens, ...)``, or ``shape`` (e.g. the batch's ``[B, W]``) when given.
    ``restore([shard(b, rank=r, ...).input_ids for r in ranks], plan=...)`` is ``b.input_ids`` flattened."""
    if len(parts) != plan.cp_size:
        raise ValueError(f"restore needs one part per rank ({plan.cp_size}), got {len(parts)}")
    parts = [p[0] if p.dim() > 1 and p.shape[0] == 1 and p.shape[1] == plan.local_len else p for p in parts]
    if any(p.shape[0] != plan.local_len for p in parts):
        raise ValueError(f"every part must hold local_len={plan.local_len} tokens, got "
                         f"{[tuple(p.shape) for p in parts]}")
    cat = torch.cat(parts)
    out = cat[torch.from_numpy(plan.inverse()).to(cat.device)]
    return out if shape is None else out.reshape(*shape, *out.shape[1:])


# ----------------------------------------------------------------------------------------------
# the reference attention: float64-exact, any process group, CPU under gloo
# ----------------------------------------------------------------------------------------------


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _block_scores(q, k, qs, qp, ks, kp, scale):
    """Masked scores ``(H, n, m)`` of queries against one block of keys: same segment, key position <=
    query position (document-causal by global positions, whatever the layout's order)."""
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    allowed = (qs[:, None] == ks[None, :]) & (kp[None, :] <= qp[:, None])
    return s.masked_fill(~allowed, float("-inf"))


def _probs(s, lse):
    """``exp(s - lse)`` with rows that see no key in this block giving 0 (not NaN)."""
    finite = torch.isfinite(lse)
    return torch.where(finite[..., None], torch.exp(s - torch.where(finite, lse, 0)[..., None]), 0.0)


def _masked_attention(q, k, v, qs, qp, ks, kp, scale):
    """Differentiable document-causal attention of q ``(n, H, D)`` over k, v ``(m, H, D)``."""
    s = _block_scores(q, k, qs, qp, ks, kp, scale)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", p, v)


def _p2p_shift(tensors, group, rank, size):
    """Send ``tensors`` to the next rank of the ring, receive the previous rank's (same shapes)."""
    import torch.distributed as dist  # keeps packkit.cp importable where torch.distributed is missing

    nxt = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
    prv = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V blocks travel the ring, partial outputs merge by their log-sum-exp; the
    backward sends each block's dK/dV along with it until it is home."""

    @staticmethod
    def forward(ctx, q, k, v, seq, pos, scale, group, rank, size):
        heads = q.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=q.dtype, device=q.device)
        blk = (k, v, seq, pos)
        for step in range(size):
            bk, bv, bs, bp = blk
            s = _block_scores(q, _expand_kv(bk, heads), seq, pos, bs, bp, scale)
            blk_lse = torch.logsumexp(s, dim=-1)
            blk_out = torch.einsum("hnm,mhd->nhd", _probs(s, blk_lse), _expand_kv(bv, heads))
            new = torch.logaddexp(lse, blk_lse)
            w_old, w_blk = _probs(lse[..., None], new)[..., 0], _probs(blk_lse[..., None], new)[..., 0]
            out = out * w_old.T[..., None] + blk_out * w_blk.T[..., None]
            lse = new
            if step < size - 1:
                blk = tuple(_p2p_shift(list(blk), group, rank, size))
        ctx.save_for_backward(q, k, v, seq, pos, out, lse)
        ctx.args = (scale, group, rank, size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, seq, pos, out, lse = ctx.saved_tensors
        scale, group, rank, size = ctx.args
        heads, group_heads = q.shape[1], q.shape[1] // k.shape[1]
        delta = (dout * out).sum(-1).T  # (H, n)
        dq = torch.zeros_like(q)
        blk = [k, v, seq, pos, torch.zeros_like(k), torch.zeros_like(v)]
        for _ in range(size):
            bk, bv, bs, bp, dk, dv = blk
            ke, ve = _expand_kv(bk, heads), _expand_kv(bv, heads)
            p = _probs(_block_scores(q, ke, seq, pos, bs, bp, scale), lse)
            dp = torch.einsum("nhd,mhd->hnm", dout, ve)
            ds = p * (dp - delta[..., None])
            dq += torch.einsum("hnm,mhd->nhd", ds, ke) * scale
            dke = torch.einsum("hnm,nhd->mhd", ds, q) * scale
            dve = torch.einsum("hnm,nhd->mhd", p, dout)
            # grouped heads: every query head of a group adds into its kv head
            dk = dk + dke.reshape(dke.shape[0], -1, group_heads, dke.shape[-1]).sum(2)
            dv = dv + dve.reshape(dve.shape[0], -1, group_heads, dve.shape[-1]).sum(2)
            blk = [bk, bv, bs, bp, dk, dv]
            if size > 1:  # cp_size sends bring every block, with its gradients, back to its rank
                blk = _p2p_shift(blk, group, rank, size)
        return dq, blk[4], blk[5], None, None, None, None, None, None


class _AllGather(torch.autograd.Function):
    """All-gather along the tokens (equal parts); the backward sums every rank's gradient and keeps
    this rank's part (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        import torch.distributed as dist  # lazy, as in _p2p_shift

        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.args = (group, rank, x.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        group, rank, n = ctx.args
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad[rank * n:(rank + 1) * n], None, None, None


class _AllToAll(torch.autograd.Function):
    """``x`` cut in ``size`` parts along ``split_dim``; part ``j`` goes to rank ``j``, and what every
    rank sends this one is concatenated along ``cat_dim``. The backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group, size):
        import torch.distributed as dist  # lazy, as in _p2p_shift

        ctx.args = (split_dim, cat_dim, group, size)
        send = [t.contiguous() for t in x.chunk(size, dim=split_dim)]
        recv = [torch.empty_like(send[0]) for _ in range(size)]
        dist.all_to_all(recv, send, group=group)
        return torch.cat(recv, dim=cat_dim)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim, group, size = ctx.args
        return _AllToAll.apply(grad, cat_dim, split_dim, group, size), None, None, None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_idx: torch.Tensor,
                 position_ids: torch.Tensor, group=None, method: str = "ring",
                 scale: float | None = None) -> torch.Tensor:
    """Causal attention of a CP rank's tokens against the whole batch's, exact (the oracle).

    Args:
        q: ``(n, H, D)`` this rank's queries (``n = local_len``, equal on every rank); k, v:
            ``(n, Hkv, D)``, ``H % Hkv == 0``. Any float dtype; float64 for an oracle.
        seq_idx, position_ids: ``(n,)`` this rank's :meth:`CPShard.attention_kwargs`: a query sees the
            keys of its own segment at positions <= its own, wherever they live. Any layout.
        group: the CP process group (``None``: the default group).
        method: ``"ring"`` (K/V blocks passed round the ring, outputs merged by log-sum-exp),
            ``"allgather"`` (K/V all-gathered, llama3 / TE all-gather style) or ``"alltoall"`` (Ulysses:
            tokens for heads; needs ``H`` and ``Hkv`` divisible by the group size, else k, v are repeated
            to ``H`` heads first).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns: ``(n, H, D)``; differentiable in q, k, v (the backward communicates too).
    """
    import torch.distributed as dist  # lazy, as in _p2p_shift

    if method not in METHODS:
        raise ArgumentError("unknown cp_attention method {got!r}; pass {fix}", got=method, fix=arg("method", *METHODS))
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"cp_attention takes q (n, H, D) and k, v (n, Hkv, D) with H % Hkv == 0; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if seq_idx.shape != (q.shape[0],) or position_ids.shape != (q.shape[0],):
        raise ValueError(f"seq_idx and position_ids must be ({q.shape[0]},), got {tuple(seq_idx.shape)}, "
                         f"{tuple(position_ids.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_idx, position_ids = seq_idx.long(), position_ids.long()
    if method == "ring":
        return _RingAttention.apply(q, k, v, seq_idx, position_ids, scale, group, rank, size)
    meta = torch.stack([seq_idx, position_ids], 1)
    g_meta = _AllGather.apply(meta, group, rank, size)
    if method == "allgather":
        kg, vg = (_AllGather.apply(t, group, rank, size) for t in (k, v))
        return _masked_attention(q, _expand_kv(kg, q.shape[1]), _expand_kv(vg, q.shape[1]), seq_idx, position_ids,
                                 g_meta[:, 0], g_meta[:, 1], scale)
    heads = q.shape[1]
    if heads % size:
        raise ValueError(f"alltoall (Ulysses) needs the query heads ({heads}) divisible by the group size ({size})")
    if k.shape[1] % size:
        k, v = _expand_kv(k, heads), _expand_kv(v, heads)  # replicated kv heads, as DeepSpeed does
    # (n, H, D) -> (size * n, H / size, D): every token of the group, this rank's heads
    qh, kh, vh = (_AllToAll.apply(t, 1, 0, group, size) for t in (q, k, v))
    out = _masked_attention(qh, _expand_kv(kh, qh.shape[1]), _expand_kv(vh, qh.shape[1]), g_meta[:, 0],
                            g_meta[:, 1], g_meta[:, 0], g_meta[:, 1], scale)
    return _AllToAll.apply(out, 0, 1, group, size)


# -- Hugging Face models: the CP attention of a sharded batch --

HF_CP_ATTENTION_NAME = "packkit_cp"


def hf_cp_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, *, group=None, method: str = "ring",
                    **kwargs):
    """A Hugging Face attention function (``transformers.AttentionInterface``) over one CP rank's tokens.

    query: ``(1, H, n, D)``; key, value: ``(1, Hkv, n, D)``: the rank's tokens, as the model sees
    ``model(**shard.hf_cp_kwargs())``. The documents come from the ``cp_seq_idx`` / ``cp_position_ids``
    kwargs; the attention runs :func:`cp_attention` over ``group``. Returns ``((1, n, H, D), None)``.
    """
    seq_idx, positions = kwargs.get("cp_seq_idx"), kwargs.get("cp_position_ids")
    if seq_idx is None or positions is None:
        raise ValueError("the packkit_cp attention needs a CP shard's cp_seq_idx and cp_position_ids "
                         "(model(**shard.hf_cp_kwargs()))")
    if attention_mask is not None:
        raise ValueError("the packkit_cp attention takes no attention_mask: documents come from cp_seq_idx")
    if dropout:
        raise ValueError(f"the packkit_cp attention has no attention dropout; got dropout={dropout}")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("the packkit_cp attention is causal only (CP shards a causal LM's rows)")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None or getattr(module, name, None) is not None:
            raise ValueError(f"the packkit_cp attention does not implement {name}")
    if query.shape[0] != 1:
        raise ValueError(f"a CP shard is one row ([1, n]); got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (n, heads, D)
    out = cp_attention(q, k, v, seq_idx=seq_idx.reshape(-1), position_ids=positions.reshape(-1), group=group,
                       method=method, scale=scaling)
    return out[None], None


def register_hf_cp_attention(name: str = HF_CP_ATTENTION_NAME, *, group=None, method: str = "ring") -> str:
    """Register :func:`hf_cp_attention` (over ``group`` with ``method``) with transformers under ``name``
    and return the name, for ``model.set_attn_implementation(name)`` or ``attn_implementation=name``."""
    from transformers import AttentionInterface  # optional dependency, imported when used

    def attention(module, query, key, value, attention_mask, **kwargs):
        return hf_cp_attention(module, query, key, value, attention_mask, group=group, method=method, **kwargs)

    AttentionInterface.register(name, attention)
    return name
