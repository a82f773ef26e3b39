"""Shared prefixes computed once: the prefix tree (trie) of a batch of samples, and its packed views.

Multi-turn reasoning SFT (each assistant turn its own sample, its history rendered before it) and RL rollouts
(a group's completions after one prompt, agentic rollouts forking at tool calls) give samples that share long
prefixes. :func:`build_tree` finds them from the token ids alone (no rollout metadata) and lays every distinct
prefix out once, a tree after another, each tree in depth-first order, so that a node's subtree is the
contiguous range ``[tin, tout)`` (an Euler tour) and "``k`` is an ancestor of ``q``" is
``tin[k] <= tin[q] < tout[k]``. Three samples ``a b c``, ``a b d e`` and ``a f``::

    sample tokens   a b c | a b d e | a f
    path            0 1 2 | 0 1 3 4 | 0 5       the layout index of every sample token
    input_ids       a  b  c  d  e  f            one node a distinct prefix: 6 tokens forwarded, not 9
    position_ids    0  1  2  2  3  1            depth along the path (a sample's own positions)
    parent         -1  0  1  1  3  0
    tin             0  1  2  3  4  5
    tout            6  5  3  5  5  6            a's subtree is everything, c's is c alone

    mask (query row, key column; 1 = may attend: the key is an ancestor of the query, or the query)
          a b c d e f
      a   1 . . . . .
      b   1 1 . . . .
      c   1 1 1 . . .
      d   1 1 . 1 . .       d continues b, it does not see the sibling c
      e   1 1 . 1 1 .
      f   1 . . . . 1

A sample's loss stays defined on the original sample: its loss tokens are read from the logits of the node
that precedes them on its own path (``score_source``), one entry per (sample, loss token), so a token that two
samples train on is scored twice, as unpacked, and per-token values (advantages, old log-probabilities) come
back aligned with those entries. :class:`TreeBatch` is a :class:`packkit.preference.SequenceBatch` whose mask is
the ancestor test, so :func:`packkit.preference.sequence_logps` / :func:`~packkit.preference.token_logps` read
it as they read a pair or a group.

Construction works on samples, not tokens (samples share only prefixes): one sort of the samples (lexicographic:
numpy rounds of packed token words, or Python's sort of one bytes key a sample when samples are long), the prefix
each shares with its neighbour in that order (token comparisons, exact, no hash), then the most each sample shares
with an earlier one and the earliest sample through that node (the runs of samples through each branching node,
level by level, a deep nest finished by binary lifting on sparse tables: O(N + sum of shared tokens) and
O(N log N) whatever the nesting) gives its chain of new nodes and where it hangs (:class:`_Chains`); the layout
and every per-token array follow from the chains in numpy passes, level by level of the chains (at most
``sqrt(2 T)`` levels). No Python loop runs once a sample, but the sort of long samples and the compares and
copies of long shared prefixes (one numpy call each, ``_SHORT``).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch

from .batch import layer_types, text_config
from .binpack import check_strategy, check_window, pack
from .chat import ChatWarning, _template_for, tokenize_chat
from .collate import padding_free_batch, row_destinations, rows_batch
from .cp import shard, sum_over_ranks
from .logps import logits_logps, scored_logps
from .errors import ArgumentError, DataError, arg
from .integrations.transformers import StepCountHook, StepNormalizer  # Trainer's private step count
from .preference import SequenceBatch, varlen_recipe
from .examples import example_arrays, read_column
from .located import location
from .row_rules import example_values
from .rules import (ATTENTION_MASK_KEY, MASK_KEYS, UNSUPERVISED_WARNING, LossMaskWarning, as_lengths,
                    check_loss_mask_mode, check_values, mask_not_expected, no_mask)
from .tokenizer import load_tokenizer
from .segments import IGNORE_INDEX, lengths_to_offsets, lengths_to_seq_idx, range_index

__all__ = ["PrefixTree", "TreeBatch", "build_tree", "tree_batch", "prefix_nodes", "turn_rows", "opening_turns", "chat_tree",
           "turn_tokens", "split_trees", "subtree", "deal_trees", "TreeDeal", "TreeCollator", "TreeShard", "shard_tree",
           "TreeSFTMixin"]

# ----------------------------------------------------------------------------------------------
# the trie at the level of samples: what each sample shares with the earlier ones
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chains:
    """The trie of ``N`` samples as chains, one a sample: sample ``s``'s first ``shared[s]`` tokens are nodes of
    earlier samples (the most it shares with any earlier sample of its group), its other ``new[s]`` tokens are
    new nodes, its chain. The chain hangs below the node at depth ``shared[s] - 1``, which is the ``attach[s]``-th
    node of ``parent[s]``'s chain (the earliest sample through it; ``-1`` when ``shared[s] == 0``). All ``(N,)``
    int64. Samples ``a b c``, ``a b d e``, ``a f``: shared ``[0, 2, 1]``, new ``[3, 2, 1]``, parent
    ``[-1, 0, 0]``, attach ``[-1, 1, 0]``."""

    shared: np.ndarray
    new: np.ndarray
    parent: np.ndarray
    attach: np.ndarray
    levels: list  #: the samples level by level, roots first (:func:`_levels` of ``parent``)


_SHORT = 64  #: pairs of samples compared at most this many tokens long are compared all at once, the rest one by one
#: tokens gathered at most a round of the sort (a round reads each undecided sample's next ``_ROUND // active`` tokens)
_ROUND = 1 << 20
_ROUND_MIN = 16  #: and at least this many tokens a sample


def _packed_words(tokens: np.ndarray, bits: int, per: int) -> np.ndarray:
    """``(A, k)`` uint64 values below ``2 ** bits`` (``k`` a multiple of ``per``, ``per * bits <= 64``) ->
    ``(A, k / per)`` uint64 words, ``per`` values a word, the first value in the highest bits, so that the words'
    order (column after column) is the rows' order: ``_packed_words([[1, 2]], 32, 2) -> [[2 ** 32 + 2]]``."""
    tokens = np.asarray(tokens, np.uint64)
    shifts = np.uint64(bits) * np.arange(per - 1, -1, -1, dtype=np.uint64)
    return np.bitwise_or.reduce(tokens.reshape(tokens.shape[0], -1, per) << shifts, axis=2)


def _stable_order(keys: list, widths: list) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key first, ties in place) of ``(A,)`` uint64 keys below ``2 ** widths[i]``.
    A key with room for the positions' bits beside it is sorted by value with the position in its low bits
    (numpy sorts uint64 values several times faster than it argsorts them, and the position keeps the sort
    stable), any other by a stable argsort; one pass a key, the last-but-first first.
    ``_stable_order([np.array([1, 0], np.uint64)], [1]) -> [1, 0]``."""
    a = keys[0].size
    bits = max(1, (a - 1).bit_length())
    low, index, perm = np.uint64((1 << bits) - 1), np.arange(a, dtype=np.uint64), np.arange(a, dtype=np.int64)
    for key, width in zip(keys, widths):
        if width + bits > 64:
            perm = perm[np.argsort(key[perm], kind="stable")]
            continue
        v = key[perm] << np.uint64(bits)
        v |= index
        v.sort()
        perm = perm[(v & low).view(np.int64)]
    return perm


def _sorted_by_python(ids: np.ndarray, off: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """:func:`_sorted_samples` for long samples: one ``bytes`` key a sample, sorted by Python (``memcmp``), which
    reads each pair only up to its first difference (the rounds re-read ``_ROUND // active`` tokens a sample)."""
    wide = ids.size and int(ids.max()) >= 2 ** 32
    width = 8 if wide else 4
    data = ids.astype(">u8" if wide else ">u4").tobytes()  # big-endian: the bytes' order is the ids' order
    at = (off * width).tolist()
    keys = [data[a:b] for a, b in zip(at[:-1], at[1:])]
    if groups is not None:
        keys = list(zip(groups.tolist(), keys))
    return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), np.int64)


def _sorted_samples(ids: np.ndarray, off: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """Sample indices in lexicographic order of ``(group, token ids)``, ties by index, ``(N,)`` int64.

    Rounds of one stable sort on several keys (:func:`_stable_order`): a round sorts the samples still tied (same
    bucket) by their bucket, then their next tokens, ``id + 1`` with ``0`` past a sample's end (so that a prefix
    sorts first), packed into 64-bit words beside room for the positions' bits (:func:`_packed_words`); ties that
    run past all their samples' ends are equal samples, done. Samples longer than ``_SHORT`` tokens on average
    are sorted by Python instead (:func:`_sorted_by_python`)."""
    n = off.size - 1
    if ids.size > _SHORT * n:
        return _sorted_by_python(ids, off, groups)
    lengths = np.diff(off)
    bits = max(1, (int(ids.max()) + 1).bit_length()) if ids.size else 1  # ids + 1 (ids are >= 0: checked)
    plus = np.append(ids.astype(np.uint64) + np.uint64(1), np.uint64(0))  # ids + 1, then 0: past every end
    order = np.arange(n, dtype=np.int64)
    bucket = np.zeros(n, np.int64)  # per position in ``order``: the first position of its bucket
    active = order.copy() if n > 1 else order[:0]  # positions whose bucket holds other samples
    depth = 0
    group = groups  # the first round's keys start with it
    while active.size:
        s = order[active]
        # tokens a word: room left for the positions' bits beside them (:func:`_stable_order`), else as many as fit
        per = (64 - max(1, (s.size - 1).bit_length())) // bits or 64 // bits
        k = int(min(int(lengths[s].max()) - depth, max(_ROUND_MIN, _ROUND // active.size)))
        k = -(-k // per) * per  # whole words
        at = off[s, None] + depth + np.arange(k)
        words = _packed_words(plus[np.where(at < off[s + 1, None], at, ids.size)], bits, per)
        keys = [words[:, j] for j in range(words.shape[1] - 1, -1, -1)]  # np.lexsort's order: the last key first
        widths = [per * bits] * len(keys)
        if group is not None:
            g = group[s]
            low = int(g.min())
            keys.append(g.astype(np.uint64) - np.uint64(low % 2 ** 64))  # wraps to g - low, which is >= 0
            widths.append((int(g.max()) - low).bit_length())
        if depth:  # round one: bucket 0
            keys.append(bucket[active].astype(np.uint64))
            widths.append(n.bit_length())
        perm = _stable_order(keys, widths)
        words, s = words[perm], s[perm]
        order[active] = s
        first = np.ones(s.size, bool)
        first[1:] = (words[1:] != words[:-1]).any(axis=1)
        if group is not None:
            g = group[s]
            first[1:] |= g[1:] != g[:-1]
        if depth:
            b = bucket[active]  # the positions hold their bucket's samples in order: buckets ascending
            first[1:] |= b[1:] != b[:-1]
        run = np.flatnonzero(first)
        size = np.diff(np.append(run, s.size))
        bucket[active] = active[np.repeat(run, size)]
        # tied runs go on while one of them goes on (one that ends here sorts first next round: zeros)
        keep = np.repeat((size > 1) & np.logical_or.reduceat(lengths[s] > depth + k, run), size)
        active, depth, group = active[keep], depth + k, None
    return order


def _neighbour_lcps(ids: np.ndarray, off: np.ndarray, groups: np.ndarray | None, order: np.ndarray) -> np.ndarray:
    """Tokens shared by each sample in ``order`` with the one before it (``0`` for the first, and across groups).

    At most ``sum(lcp) + N`` tokens compared in all: short pairs in one vectorised compare (a Python loop would
    cost more than their tokens), long ones one numpy compare each."""
    a, b = order[:-1], order[1:]
    n = np.minimum(off[a + 1] - off[a], off[b + 1] - off[b])
    if groups is not None:
        n[groups[a] != groups[b]] = 0
    lcp = np.zeros(order.size, np.int64)
    short = np.flatnonzero(n <= _SHORT)
    if short.size:
        m = n[short]
        diff = ids[range_index(off[a[short]], m)] != ids[range_index(off[b[short]], m)]
        ptr = lengths_to_offsets(m)
        first = np.flatnonzero(diff)  # the first difference of each pair, or its end
        k = np.searchsorted(first, ptr[:-1])
        hit = np.append(first, ptr[-1])[k]
        lcp[1 + short] = np.minimum(hit, ptr[1:]) - ptr[:-1]
    starts = off.tolist()
    for i, x, y, k in zip(np.flatnonzero(n > _SHORT).tolist(), a[n > _SHORT].tolist(), b[n > _SHORT].tolist(),
                          n[n > _SHORT].tolist()):
        diff = ids[starts[x]:starts[x] + k] != ids[starts[y]:starts[y] + k]
        j = int(diff.argmax())
        lcp[i + 1] = j if diff[j] else k
    return lcp


class _RangeMin:
    """Range minima of ``a`` ``(n,)`` in O(1) a query, and the longest runs of a bound, by binary lifting: a
    sparse table, ``table[j, i] = min(a[i:i + 2 ** j])`` (``(log2 n + 1, n)``, past the end: the dtype's max).
    ``_RangeMin([3, 1, 2]).min([0, 1], [2, 2]) -> [1, 2]``."""

    def __init__(self, a: np.ndarray):
        big = np.iinfo(a.dtype).max
        rows = [a]
        while (1 << len(rows)) <= a.size:
            h, prev = 1 << (len(rows) - 1), rows[-1]
            rows.append(np.minimum(prev, np.append(prev[h:], np.full(h, big, a.dtype))))
        self.table = np.stack(rows)

    def min(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``min(a[lo:hi + 1])`` for each ``lo <= hi``."""
        j = np.log2(hi - lo + 1).astype(np.int64)  # exact for the powers of two: lengths < 2 ** 52
        return np.minimum(self.table[j, lo], self.table[j, hi - (1 << j) + 1])

    def _run(self, start: np.ndarray, bound: np.ndarray, above: bool, left: bool) -> np.ndarray:
        """How far the run of ``a`` beyond ``bound`` goes from ``start`` (exclusive) leftwards or rightwards:
        galloping up the powers of two, then back down, each element only as many levels as its run needs (work
        O(sum of log runs), not O(N log N))."""
        n, levels = self.table.shape[1], self.table.shape[0]
        end = start.copy()

        def step(j: int, live: np.ndarray) -> np.ndarray:  # extend ``live`` by 2 ** j where that block holds
            e = end[live]
            first = e - (1 << j) if left else e + 1  # the block [first, first + 2 ** j)
            ok = (first >= 0) if left else (first + (1 << j) <= n)
            m = self.table[j, np.clip(first, 0, n - 1)]
            ok &= (m > bound[live]) if above else (m >= bound[live])
            end[live[ok]] = (first if left else first + (1 << j) - 1)[ok]
            return ok

        top = np.full(end.size, levels, np.int64)  # the first level whose block failed (the run is shorter)
        live = np.arange(end.size)
        for j in range(levels):  # up: blocks of 1, 2, 4, ... while they hold
            if not live.size:
                break
            ok = step(j, live)
            top[live[~ok]] = j
            live = live[ok]
        by_top = np.argsort((levels - top).astype(np.uint8), kind="stable")  # radix: top descending
        count = np.bincount(top, minlength=levels + 1)[::-1].cumsum()[::-1]  # count[j]: elements with top >= j
        for j in range(levels - 1, -1, -1):  # down: the rest of each run, shorter than its failed block
            if count[j + 1]:
                step(j, by_top[:count[j + 1]])
        return end

    def run_left(self, at: np.ndarray, bound: np.ndarray, *, above: bool) -> np.ndarray:
        """The least ``lo <= at + 1`` with every ``a[lo:at + 1] > bound`` (``above``) or ``>= bound``."""
        return self._run(at + 1, bound, above, True)

    def run_right(self, at: np.ndarray, bound: np.ndarray, *, above: bool) -> np.ndarray:
        """The greatest ``hi >= at - 1`` with every ``a[at:hi + 1] > bound`` (``above``) or ``>= bound``."""
        return self._run(at - 1, bound, above, False)


def _lifted(order: np.ndarray, lcp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_most_shared_earlier` per sorted position, by binary lifting on sparse tables: what two samples share
    is the least ``lcp`` between them, so the best earlier sample is the nearest earlier one on the left or on the
    right (nearest smaller value of ``order``); the samples sharing ``m`` tokens with one are a run around it, and
    the earliest of them is the run's least index. O(N log N) whatever the nesting."""
    n = order.size
    dt = np.int32 if n < 2 ** 31 and (lcp.size == 0 or int(lcp.max()) < 2 ** 31) else np.int64
    samples, gaps = _RangeMin(order.astype(dt)), _RangeMin(lcp.astype(dt))
    pos = np.arange(n, dtype=np.int64)
    left = samples.run_left(pos - 1, order, above=True) - 1  # nearest earlier sample to the left (-1: none)
    right = samples.run_right(pos + 1, order, above=True) + 1  # and to the right (n: none)
    shared = np.zeros(n, np.int64)
    has = left >= 0
    shared[has] = gaps.min(left[has] + 1, pos[has])
    has = right < n
    shared[has] = np.maximum(shared[has], gaps.min(pos[has] + 1, right[has]))
    earliest = np.full(n, -1, np.int64)
    q = np.flatnonzero(shared)
    m = shared[q].astype(dt)
    lo = gaps.run_left(q, m, above=False) - 1  # the run of positions sharing >= m tokens with q's sample
    hi = gaps.run_right(q + 1, m, above=False)
    earliest[q] = samples.min(lo, hi)
    return shared, earliest


_LIFT_AFTER = 16  #: levels of branching nodes taken run by run; samples nested deeper are finished by lifting


def _most_shared_earlier(order: np.ndarray, lcp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every sample, the most tokens it shares with an earlier sample (by index), ``(N,)`` int64, and the
    earliest sample through its node at that depth (``-1`` when it shares nothing).

    In lexicographic order, the samples through a node are a run of positions, and the node is as deep as the
    least ``lcp`` inside the run. Runs are taken node by node from the roots down: each run's earliest sample
    (its least index) is the earliest through its node, so every later sample of the run shares at least that
    node's depth with an earlier one; below the node the run splits where its ``lcp`` is least, and runs of one
    sample drop out. The deepest run whose earliest sample is earlier gives a sample's figures. One pass a level
    of branching nodes over the samples still in runs (O(N + sum(lcp)) in all); after ``_LIFT_AFTER`` levels
    the runs left (a deep nest) are finished as a problem of their own by :func:`_lifted`, O(N log N)."""
    n = order.size
    shared, earliest = np.zeros(n, np.int64), np.full(n, -1, np.int64)
    inner = lcp > 0  # position i shares with i - 1
    at = np.flatnonzero(inner | np.append(inner[1:], False))  # the positions in runs of two or more
    head = ~inner[at]  # a run's first position
    far = np.iinfo(np.int64).max
    for _ in range(_LIFT_AFTER):
        if not at.size:
            break
        starts = np.flatnonzero(head)
        size = np.diff(np.append(starts, at.size))
        gap, s = lcp[at], order[at]
        depth = np.repeat(np.minimum.reduceat(np.where(head, far, gap), starts), size)
        first = np.repeat(np.minimum.reduceat(s, starts), size)
        later = first < s
        shared[at[later]], earliest[at[later]] = depth[later], first[later]
        head |= gap == depth
        starts = np.flatnonzero(head)
        size = np.diff(np.append(starts, at.size))
        keep = np.repeat(size > 1, size)
        at, head = at[keep], head[keep]
    if at.size:  # within its run (lcp 0 at the runs' heads), a sample that shares any prefix shares more than before
        more, first = _lifted(order[at], np.where(head, 0, lcp[at]))
        shared[at[more > 0]], earliest[at[more > 0]] = more[more > 0], first[more > 0]
    out_shared, out_earliest = np.empty(n, np.int64), np.empty(n, np.int64)
    out_shared[order], out_earliest[order] = shared, earliest
    return out_shared, out_earliest


def _levels(parent: np.ndarray) -> list:
    """Samples by depth in the forest ``parent`` (``-1`` at roots): a list of ``(K,)`` int64 index arrays, roots
    first, each ascending. ``_levels([-1, 0, 0, 1]) -> [[0], [1, 2], [3]]``. Depths by pointer jumping
    (O(N log depth)); a sample ``d`` levels deep has ``d`` ancestors of at least ``1, 2, ..., d`` tokens, so
    samples of ``T`` tokens in all have at most ``sqrt(2 T)`` levels."""
    depth = (parent >= 0).astype(np.int64)  # per sample: the steps from it to ``up`` (or to its root)
    up = parent.copy()
    live = np.flatnonzero(up >= 0)
    while live.size:
        u = up[live]
        depth[live] += depth[u]
        up[live] = up[u]
        live = live[up[live] >= 0]
    order = np.argsort(depth.astype(np.min_scalar_type(int(depth.max(initial=0)))), kind="stable")  # radix
    return np.split(order, np.cumsum(np.bincount(depth))[:-1])


def _chains(ids: np.ndarray, lengths: np.ndarray, off: np.ndarray, groups: np.ndarray | None) -> _Chains:
    """:class:`_Chains` of the samples: sorted once, shared prefixes compared token by token (exact, no hash)."""
    order = _sorted_samples(ids, off, groups)
    shared, parent = _most_shared_earlier(order, _neighbour_lcps(ids, off, groups, order))
    has = parent >= 0
    attach = np.full(shared.size, -1, np.int64)
    attach[has] = shared[has] - 1 - shared[parent[has]]
    return _Chains(shared=shared, new=lengths - shared, parent=parent, attach=attach, levels=_levels(parent))


def _copy_shared(values: np.ndarray, off: np.ndarray, chains: _Chains) -> np.ndarray:
    """``values`` ``(T,)`` with every sample's shared tokens overwritten by its parent chain's sample's, level by
    level (a parent's are final first): a token's value becomes its node's first token's. Short copies in one
    gather a level, long ones one slice each."""
    for level in chains.levels[1:]:
        m = chains.shared[level]
        short = m <= _SHORT
        s, p, k = level[short], chains.parent[level[short]], m[short]
        values[range_index(off[s], k)] = values[range_index(off[p], k)]
        for s, p, k in zip(off[level[~short]].tolist(), off[chains.parent[level[~short]]].tolist(), m[~short].tolist()):
            values[s:s + k] = values[p:p + k]
    return values


def prefix_nodes(ids, lengths, *, groups=None) -> np.ndarray:
    """For every sample token, the first token (flat index) with the same prefix: its trie node.

    ``prefix_nodes([1, 2, 1, 3, 1, 2, 4], [2, 2, 3]) -> [0, 1, 0, 3, 0, 1, 6]``: the prefix ``1`` is token 0's
    everywhere, ``1 2`` is token 1's, the rest are new. ``groups``: ``(N,)`` ints, samples share prefixes only
    within a group. Exact: prefixes are compared token by token.
    """
    ids = np.asarray(ids, np.int64)
    lengths = np.asarray(lengths, np.int64)
    off = lengths_to_offsets(lengths)
    groups = None if groups is None else np.asarray(groups, np.int64)
    return _copy_shared(np.arange(ids.size, dtype=np.int64), off, _chains(ids, lengths, off, groups))


# ----------------------------------------------------------------------------------------------
# the layout: every tree depth first, a node's subtree contiguous
# ----------------------------------------------------------------------------------------------


def _chain_starts(parent_chain: np.ndarray, attach: np.ndarray, size: np.ndarray, length: np.ndarray,
                  levels: list) -> np.ndarray:
    """Where each sample's chain of new nodes starts in the layout, ``(N,)`` int64 (``-1``: no chain).

    A chain's children (the chains attached to its nodes) follow it, deepest attachment first (so that the
    subtree of the chain's node at offset ``j`` is its chain from ``j`` and the children attached at ``>= j``),
    then by sample; roots (``parent_chain == -1``) tree after tree in sample order. ``size``: each chain's
    subtree in tokens. ``levels``: the samples level by level (:func:`_levels`), parents' starts first."""
    n = parent_chain.size
    has = length > 0
    key_parent = np.where(parent_chain < 0, -1, parent_chain)
    order = np.lexsort((np.arange(n), -attach, key_parent))
    order = order[has[order]]
    sizes = size[order]
    group_start = np.ones(order.size, bool)
    group_start[1:] = key_parent[order][1:] != key_parent[order][:-1]
    csum = np.cumsum(sizes) - sizes
    sib = csum - np.maximum.accumulate(np.where(group_start, csum, 0))
    sib_off = np.zeros(n, np.int64)
    sib_off[order] = sib
    start = np.full(n, -1, np.int64)
    for level in levels:
        c = level[has[level]]
        p = parent_chain[c]
        joined = p >= 0
        start[c] = np.where(joined, start[np.maximum(p, 0)] + length[np.maximum(p, 0)], 0) + sib_off[c]
    return start


def _subtree_sizes(parent_chain: np.ndarray, length: np.ndarray, levels: list) -> np.ndarray:
    """Tokens in each chain's subtree (its own and its descendants' chains), deepest level first."""
    size = length.copy()
    for level in levels[:0:-1]:
        np.add.at(size, parent_chain[level], size[level])
    return size


def _layout(chains: _Chains, off: np.ndarray):
    """``(path, parent, depth, tout, start, chain)`` of the trie (:class:`_Chains`): the layout index of every
    sample token ``(T,)``; per layout node its parent (``-1`` at roots), depth and the end of its subtree
    ``(P,)``; where each sample's chain starts ``(N,)`` (``-1``: no chain), and the samples with a chain in
    layout order. A chain's nodes are contiguous; its children follow it (:func:`_chain_starts`)."""
    shared, new, up, attach = chains.shared, chains.new, chains.parent, chains.attach
    size = _subtree_sizes(up, new, chains.levels)
    start = _chain_starts(up, attach, size, new, chains.levels)
    # per sample token: its own chain's place, then the shared tokens copied from the parent's sample
    path = np.repeat(start - off[:-1] - shared, np.diff(off))
    path += np.arange(path.size, dtype=np.int64)
    _copy_shared(path, off, chains)
    # per node, chain after chain in layout order
    chain = np.flatnonzero(new > 0)
    chain = chain[np.argsort(start[chain], kind="stable")]
    count, first = new[chain], start[chain]
    total = int(count.sum())
    depth = np.repeat(shared[chain] - first, count)
    depth += np.arange(total, dtype=np.int64)
    parent = np.arange(-1, total - 1, dtype=np.int64)
    joined = up[chain] >= 0
    parent[first] = np.where(joined, start[np.maximum(up[chain], 0)] + attach[chain], -1)
    # a node's subtree: the rest of its chain, then the chains attached at or below it (they follow the chain)
    below = np.zeros(total + 1, np.int64)
    child = chain[joined]
    np.add.at(below, start[up[child]] + attach[child], size[child])
    below = np.cumsum(below[::-1])[::-1]  # below[p]: the chains attached at p or after, in the layout
    end = first + count
    tout = np.repeat(end - below[end], count)
    tout += below[:total]
    return path, parent, depth, tout, start, chain


# ----------------------------------------------------------------------------------------------
# the tree of a batch of samples
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefixTree:
    """The trie of ``N`` samples (``T`` tokens) laid out as ``P`` nodes, trees one after another (numpy, host).

    Per node (layout order; ``tin`` is the index itself):

    input_ids:     int64 ``(P,)``
    position_ids:  int64 ``(P,)``, depth along the path (what the token's position is in each of its samples)
    parent:        int64 ``(P,)``, the parent node, ``-1`` at a tree's root
    tout:          int64 ``(P,)``, the end of the node's subtree: ``k`` is an ancestor of ``q`` (or ``q``) iff
                   ``k <= q < tout[k]``
    segment:       int64 ``(P,)``, the branch segment (a run whose parent is the token before it) of each node
    tree_ptr:      int64 ``(R + 1,)``, tree ``r`` is nodes ``tree_ptr[r]:tree_ptr[r + 1]``
    num_samples:   int64 ``(P,)``, samples whose path passes through the node

    Per sample token: ``path`` int64 ``(T,)``, its node; sample ``s`` is ``path[sample_ptr[s]:sample_ptr[s + 1]]``.
    Per scored token (``M``, sample after sample, each sample's loss tokens in order; a sample's first token is
    never scored: nothing precedes it): ``score_source`` (the node whose logits predict it), ``score_target``
    (its node), ``score_sample``, ``score_token`` (its flat index among the sample tokens) int64 ``(M,)``; ``values``: ``{name: (M,) float64}``, the per-token values
    given with the samples at those tokens; ``num_tokens`` int64 ``(N,)``, scored tokens per sample.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    parent: np.ndarray
    tout: np.ndarray
    segment: np.ndarray
    tree_ptr: np.ndarray
    num_samples: np.ndarray
    path: np.ndarray
    sample_ptr: np.ndarray
    score_source: np.ndarray
    score_target: np.ndarray
    score_sample: np.ndarray
    score_token: np.ndarray
    num_tokens: np.ndarray
    values: dict

    @property
    def num_nodes(self) -> int:
        """Tokens forwarded with sharing: one per distinct prefix."""
        return int(self.input_ids.size)

    @property
    def num_sample_tokens(self) -> int:
        """Tokens forwarded without sharing: every sample whole."""
        return int(self.path.size)

    @property
    def tree_sizes(self) -> np.ndarray:
        """``(R,)`` int64, nodes of each tree."""
        return np.diff(self.tree_ptr)

    def __repr__(self) -> str:
        return (f"PrefixTree(samples={self.sample_ptr.size - 1}, trees={self.tree_ptr.size - 1}, nodes={self.num_nodes:,}, "
                f"sample_tokens={self.num_sample_tokens:,}, scored={self.score_target.size:,})")


def _check_samples(ids, lengths, loss_mask, values, groups, rows):
    """The inputs of :func:`build_tree`, checked by packkit's rules (errors name the sample)."""
    lengths = as_lengths(lengths, name="lengths", item="sample")
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size != int(lengths.sum()):
        raise ValueError(f"input_ids has shape {list(ids.shape)} for lengths summing to {int(lengths.sum()):,}: pass "
                         "the samples' token ids back to back, flat")
    check_values(ids, lengths=lengths, kind="ids", key="input_ids", rows=rows)
    if loss_mask is None:
        mask = np.ones(ids.size, bool)
    else:
        mask = np.asarray(loss_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"loss_mask has shape {list(mask.shape)} for {ids.size:,} tokens: one 0/1 a token")
        check_values(mask, lengths=lengths, kind="mask", key="loss_mask", rows=rows)
        mask = mask.astype(bool)
    vals = {}
    off = lengths_to_offsets(lengths)
    for name, v in (values or {}).items():
        v = np.asarray(v)
        if v.shape != ids.shape:
            raise ValueError(f"values[{name!r}] has shape {list(v.shape)} for {ids.size:,} tokens: one number a token, "
                             "flat like input_ids")
        if v.dtype.kind not in "iuf" or not np.isfinite(v).all():  # the per-example rule names the sample
            example_values(np.split(v, off[1:-1]), lengths, key=name, rows=rows, what="token")
        vals[name] = v.astype(np.float64)
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != lengths.shape or groups.dtype.kind not in "iu":
            raise ArgumentError("{g} must be one integer a sample ({n} samples), got shape {got}",
                                g=arg("groups"), n=lengths.size, got=list(groups.shape))
        groups = groups.astype(np.int64)
    return ids.astype(np.int64, copy=False), lengths, mask, vals, groups


def build_tree(input_ids, lengths, *, loss_mask=None, values=None, groups=None, rows=None) -> PrefixTree:
    """The prefix tree of a batch of samples (module docstring), found from the token ids alone.

    Args:
        input_ids: ``(T,)`` int, the samples' tokens back to back; lengths: ``(N,)`` int >= 1.
        loss_mask: ``(T,)`` 0/1, the tokens each sample trains on (default: all); scored from the token before
            them on the sample's own path, so a sample's first token is never scored.
        values: ``{name: (T,) float}``, per-token numbers (advantages, old log-probabilities), carried to the
            scored tokens (``tree.values[name]``, aligned with ``score_target``).
        groups: ``(N,)`` int, a hint: samples share prefixes only within their group (a conversation, a
            prompt's rollouts), so that each group's tree can be packed apart. Default: the whole batch.
        rows: the dataset rows of the samples (errors name them), or None.

    ``build_tree([1, 2, 3, 1, 2, 4], [3, 3]).input_ids -> [1, 2, 3, 4]`` (the prefix ``1 2`` once).
    Raises a one-line error naming the sample for bad ids or masks, and for a sample with nothing to score.
    """
    ids, lengths, mask, vals, groups = _check_samples(input_ids, lengths, loss_mask, values, groups, rows)
    off = lengths_to_offsets(lengths)
    chains = _chains(ids, lengths, off, groups)
    path, parent, depth, tout, start, chain = _layout(chains, off)
    total = parent.size
    nodes_ids = ids[range_index(off[chain] + chains.shared[chain], chains.new[chain])]
    scored = mask.copy()
    scored[off[:-1]] = False
    at = np.flatnonzero(scored)
    num_tokens = np.diff(np.searchsorted(at, off))
    if (num_tokens == 0).any():
        s = int(np.argmin(num_tokens))
        raise DataError(f"{location(s, rows)} has no loss token after its first token: nothing of it would be trained; "
                        "drop it or fix its loss mask")
    # samples through a node: those whose last node is in its subtree (prefix sums over the Euler tour)
    last = np.where(chains.new > 0, start + chains.new - 1, start[np.maximum(chains.parent, 0)] + chains.attach)
    through = np.zeros(total + 1, np.int64)
    np.cumsum(np.bincount(last, minlength=total), out=through[1:])
    fresh = np.ones(chain.size, bool)  # a chain continues the node before it in the layout, or opens a segment
    fresh[1:] = parent[start[chain[1:]]] != start[chain[1:]] - 1
    return PrefixTree(input_ids=nodes_ids, position_ids=depth, parent=parent, tout=tout,
                      segment=np.repeat(np.cumsum(fresh) - 1, chains.new[chain]),
                      tree_ptr=np.append(start[chain[chains.parent[chain] < 0]], total).astype(np.int64),
                      num_samples=through[tout] - through[:-1], path=path, sample_ptr=off,
                      score_source=path[at - 1], score_target=path[at],
                      score_sample=np.repeat(np.arange(lengths.size, dtype=np.int64), num_tokens), score_token=at,
                      num_tokens=num_tokens, values={k: v[at] for k, v in vals.items()})


# ----------------------------------------------------------------------------------------------
# the batch a model reads
# ----------------------------------------------------------------------------------------------

#: the layer kinds whose attention an ancestor mask describes; any other (linear attention, Mamba) carries a
#: state along the row, which would flow from one branch into its sibling
MASKED_KINDS = {"full_attention", "sliding_attention", "attention"}


def check_attention_only(model) -> None:
    """Refuse, in one line, a model with layers other than attention (hybrid linear-attention, Mamba): their
    recurrent state runs along the packed row, so a branch would read its sibling's tokens."""
    config = text_config(model)
    kinds = set(layer_types(config)) | set(getattr(config, "layers_block_type", None) or ())
    other = sorted(kinds - MASKED_KINDS)
    if other:
        raise ArgumentError(f"the model has {other} layers, whose state would run from one branch of a prefix tree into "
                            "the next (it needs a state per branch): train it on unshared samples (packkit's collators), "
                            "not on a TreeBatch")


class TreeBatch(SequenceBatch):
    """Packed prefix trees (:func:`tree_batch`): a :class:`packkit.preference.SequenceBatch` whose sequences are
    the samples, so that :func:`~packkit.preference.sequence_logps` and :func:`~packkit.preference.token_logps`
    read it unchanged. Its fields (``B`` rows of ``L``):

    input_ids, position_ids (depth along the path), labels, seq_idx (one segment a tree, and a row's padding
    tail), cu_seqlens, max_seqlen: as in :class:`~packkit.preference.SequenceBatch`
    tin / tout:     int64 ``[B, L]``, the Euler tour in row columns: key ``k`` may be read by query ``q`` iff
                    ``tin[k] <= tin[q] < tout[k]`` (a padding tail: causal within itself)
    parent:         int64 ``[B, L]``, flat index (into ``B * L``) of each node's parent, ``-1`` at roots and at a
                    padding tail's first token
    sequence_ids:   int64 ``[B, L]``, the sample of each node on one sample's path only, ``-1`` on nodes shared by
                    several (and on padding)
    score_source / score_target / score_sequence / num_tokens: as in ``SequenceBatch`` (sequences = samples)
    token_values:   ``{name: float64 [M]}``, the per-token values at the scored tokens
    num_real_tokens: nodes forwarded; num_sample_tokens: tokens the samples have unshared
    """

    def dense_mask(self) -> torch.Tensor:
        """``[B, L, L]`` bool, True where query ``q`` may attend key ``k``: ``k`` an ancestor of ``q`` or ``q``."""
        tin, tout = self.tin, self.tout
        return (tin[:, None, :] <= tin[:, :, None]) & (tin[:, :, None] < tout[:, None, :])

    def mask_mod(self):
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` of :meth:`dense_mask`: the Euler-tour test."""
        tin, tout = self.tin, self.tout

        def ancestor(b, h, q_idx, kv_idx):
            q = tin[b, q_idx]
            return (tin[b, kv_idx] <= q) & (q < tout[b, kv_idx])

        return ancestor

    def varlen_kwargs(self) -> dict:
        """The varlen recipe: every branch segment (a run whose parent is the token before it) is a query segment,
        whose keys are its ancestors' tokens root first, then its own (gathered: ``k_var = k_flat[kv_index]``),
        causal aligned bottom-right (flash-attn >= 2.1 ``causal=True``); called as in
        :meth:`packkit.preference.SequenceBatch.varlen_kwargs`. Same fields."""
        parent = self.parent.reshape(-1).cpu().numpy()
        n = parent.size
        new = (parent != np.arange(n) - 1) | (parent < 0)
        q_start = np.flatnonzero(new)
        q_len = np.diff(np.append(q_start, n))
        seg_of = np.cumsum(new) - 1
        pieces: list[list[tuple[int, int]]] = []  # per segment: its ancestors as (start, length) runs
        for s, a in enumerate(q_start.tolist()):
            p = int(parent[a])
            if p < 0:
                pieces.append([])
            else:
                ps = int(seg_of[p])
                pieces.append(pieces[ps] + [(int(q_start[ps]), p - int(q_start[ps]) + 1)])
        starts, lens = [], []
        for s, runs in enumerate(pieces):
            starts += [r[0] for r in runs] + [int(q_start[s])]
            lens += [r[1] for r in runs] + [int(q_len[s])]
        k_len = q_len + np.asarray([sum(r[1] for r in runs) for runs in pieces], np.int64)
        return varlen_recipe(starts, lens, q_len, k_len, self.input_ids.device)

    def model_inputs(self, model=None) -> dict:
        """``input_ids``, ``position_ids``, ``use_cache=False`` and the mask the model's attention takes: the
        additive 4-D mask (eager, sdpa) or a FlexAttention ``BlockMask`` (flex_attention); flash attention takes
        no mask and is refused (:meth:`varlen_kwargs` is the recipe for your own kernel), and so are models with
        layers other than attention (:func:`check_attention_only`)."""
        if model is None:
            raise ArgumentError("a TreeBatch needs the model to build its mask: pass model_inputs(model)")
        check_attention_only(model)
        return super().model_inputs(model)

    def __repr__(self) -> str:
        return (f"TreeBatch(shape={list(self.shape)}, samples={self.num_sequences}, nodes={self.num_real_tokens:,}, "
                f"sample_tokens={self.num_sample_tokens:,}, scored_tokens={int(self.score_target.shape[0])})")


def tree_batch(tree: PrefixTree, *, window: int | None = None, num_windows: int | None = None, strategy: str = "bfd",
               pad_token_id: int = 0) -> TreeBatch:
    """A :class:`TreeBatch` of ``tree``: one ``[1, P]`` row (``window=None``), or ``[B, W]`` windows holding whole
    trees planned by ``strategy`` (a tree longer than ``W`` is an error naming it and the fix).

    ``tree_batch(build_tree([1, 2, 3, 1, 2, 4], [3, 3])).input_ids -> [[1, 2, 3, 4]]``.
    """
    sizes = tree.tree_sizes
    if window is None:
        order, window_ptr = np.arange(sizes.size, dtype=np.int64), None
    else:
        window = check_window(window)
        over = np.flatnonzero(sizes > window)
        if over.size:
            r = int(over[0])
            raise DataError("tree {r} (from sample {s}) has {n:,} nodes > {w}; raise {wn}, or split it at node "
                            "boundaries with split_trees (its shared prefix recomputed in each part)", r=r,
                            s=_first_sample(tree, r), n=int(sizes[r]),
                            w=arg("window", window), wn=arg("window"))
        plan = pack(sizes, window=window, strategy=check_strategy(strategy))
        order, window_ptr = plan.seg_example, plan.window_ptr
    # the nodes, tree after tree in packing order, and where each lands in the flattened rows
    moved = range_index(tree.tree_ptr[:-1][order], sizes[order])
    new_of_old = np.empty(moved.size, np.int64)
    new_of_old[moved] = np.arange(moved.size)
    ids = tree.input_ids[moved]
    total = moved.size
    if window_ptr is None:
        packed = padding_free_batch(ids, np.full(total, IGNORE_INDEX, np.int64), sizes[order])
        width, dest = total, np.arange(total, dtype=np.int64)
    else:
        packed = rows_batch(ids, np.full(total, IGNORE_INDEX, np.int64), sizes[order], window_ptr, width=window,
                            num_rows=num_windows, pad_token_id=pad_token_id)
        width = window
        off = lengths_to_offsets(sizes[order])
        dest = row_destinations(off[window_ptr[1:]] - off[window_ptr[:-1]], window)
    return _assemble(tree, packed, moved, new_of_old, dest, width)


def _first_sample(tree: PrefixTree, r: int) -> int:
    """The first sample whose path starts at tree ``r``'s root."""
    starts = tree.path[tree.sample_ptr[:-1]]
    return int(np.flatnonzero(starts == tree.tree_ptr[r])[0])


def _assemble(tree: PrefixTree, packed, moved, new_of_old, dest, width) -> TreeBatch:
    """The :class:`TreeBatch` fields of ``tree`` laid out by ``moved`` (old node of each new place) into ``dest``."""
    rows = packed.input_ids.shape[0]
    col = dest % width
    row_start = dest - col
    flat_of_old = dest[new_of_old]

    def laid(values, fill):
        buf = fill.reshape(-1).numpy().copy() if isinstance(fill, torch.Tensor) else np.full(rows * width, fill, np.int64)
        buf[dest] = values
        return torch.from_numpy(buf.reshape(rows, width))

    cu = packed.cu_seqlens.numpy()
    seq_idx = lengths_to_seq_idx(np.diff(cu))
    # padding tails: causal within themselves (tin = column, tout = the row's end; parent = the token before)
    grid = np.arange(rows * width, dtype=np.int64)
    tail_parent = np.where(np.r_[True, seq_idx[1:] != seq_idx[:-1]], -1, grid - 1)
    old_parent = tree.parent[moved]
    parent = np.where(old_parent < 0, -1, flat_of_old[np.maximum(old_parent, 0)])
    tout = row_start + (tree.tout[moved] - moved) + col  # the subtree keeps its extent
    sample_ids = np.full(tree.num_nodes, -1, np.int64)
    only = tree.num_samples == 1
    sample_of_node = np.zeros(tree.num_nodes, np.int64)
    sample_of_node[tree.path] = lengths_to_seq_idx(np.diff(tree.sample_ptr))
    sample_ids[only] = sample_of_node[only]
    labels = np.full(rows * width, IGNORE_INDEX, np.int64)
    src, tgt = flat_of_old[tree.score_source], flat_of_old[tree.score_target]
    next_ok = src == tgt - 1
    labels[tgt[next_ok]] = packed.input_ids.reshape(-1).numpy()[tgt[next_ok]]
    return TreeBatch(
        input_ids=packed.input_ids, position_ids=laid(tree.position_ids[moved], packed.position_ids),
        labels=torch.from_numpy(labels.reshape(rows, width)), seq_idx=torch.from_numpy(seq_idx.reshape(rows, width)),
        tin=torch.from_numpy(grid.reshape(rows, width) % width),
        tout=laid(tout - row_start, torch.full((rows, width), width, dtype=torch.int64)),
        parent=laid(parent, torch.from_numpy(tail_parent.reshape(rows, width))),
        sequence_ids=laid(sample_ids[moved], -1), cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
        score_source=torch.from_numpy(src), score_target=torch.from_numpy(tgt),
        score_sequence=torch.from_numpy(tree.score_sample), num_tokens=torch.from_numpy(tree.num_tokens),
        token_values={k: torch.from_numpy(v) for k, v in tree.values.items()}, sequence_values={},
        layout="tree", num_real_tokens=tree.num_nodes, num_sample_tokens=tree.num_sample_tokens)


# ----------------------------------------------------------------------------------------------
# context parallelism: a tree row sharded over a CP group
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeShard:
    """One CP rank's part of a :class:`TreeBatch` (:func:`shard_tree`): its tokens, the ancestor test over the
    whole batch, and the scored tokens whose logits it holds (``n`` tokens, ``m`` scored here).

    input_ids, position_ids: int64 ``[1, n]``, the nodes and their depth (RoPE), ``pad_id`` / 0 on CP padding
    tin, tout:        int64 ``(n,)``, the Euler tour over the batch's flattened rows (``tin`` is the flat index):
                      key ``k`` may be read by query ``q`` iff ``tin[k] <= tin[q] < tout[k]``, wherever they
                      sit; CP padding has a range of its own (it reads itself only)
    index:            int64 ``(n,)``, each token's flat index into the batch (``-1``: CP padding)
    score_local:      int64 ``(m,)``, the place among this rank's tokens of the logits predicting each scored
                      token this rank holds; score_target_ids int64 ``(m,)``, the tokens predicted
    score_entry:      int64 ``(m,)``, which of the batch's ``M`` scored tokens they are (``batch.score_sequence``,
                      ``batch.token_values[name]`` at them); num_scored: ``M``; num_sequences: ``N``
    cp:               the :class:`packkit.cp.CPShard` of the row (plan, rank, :func:`packkit.cp.restore`)

    Every scored token is held by exactly one rank (the one holding its predicting node), so per-token terms
    add over the group as they are, and per-sample sums come from :meth:`sequence_logps` (an all-reduce).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tin: torch.Tensor
    tout: torch.Tensor
    index: torch.Tensor
    score_local: torch.Tensor
    score_target_ids: torch.Tensor
    score_entry: torch.Tensor
    score_sequence: torch.Tensor
    num_scored: int
    num_sequences: int
    cp: object

    def attention_kwargs(self) -> dict:
        """What :func:`packkit.cp.cp_attention` needs besides q, k, v: ``tin`` and ``tout``, ``(n,)``."""
        return {"tin": self.tin, "tout": self.tout}

    def hf_cp_kwargs(self, model=None) -> dict:
        """``model(**shard.hf_cp_kwargs(model))`` under :func:`packkit.cp.register_hf_cp_attention`: ``input_ids``,
        ``position_ids`` (depth), ``use_cache=False`` and ``cp_tin`` / ``cp_tout`` (``[1, n]``), read by every
        layer. A model with layers other than attention (hybrid linear attention, Mamba) is refused in one line
        (:func:`check_attention_only`: its state would run from one branch into the next), as
        :meth:`TreeBatch.model_inputs` refuses it; so the model is required."""
        if model is None:
            raise ArgumentError("a TreeShard needs the model to check that its layers are all attention: pass "
                                "hf_cp_kwargs(model)")
        check_attention_only(model)
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "cp_tin": self.tin[None], "cp_tout": self.tout[None]}

    def token_logps(self, logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """``(m,)`` log-probabilities of this rank's scored tokens from its ``[1, n, V]`` logits (tiled:
        :func:`packkit.logps.logits_logps`); ``score_entry`` places them among the batch's ``M``."""
        return logits_logps(logits, self.score_local, self.score_target_ids, temperature=temperature)

    def sequence_logps(self, token_logps: torch.Tensor, *, group=None) -> torch.Tensor:
        """``(N,)`` every sample's summed log-probability over the whole CP group (each rank adds the tokens it
        scored, then :func:`packkit.cp.sum_over_ranks`): the same on every rank, differentiable for a loss of
        them (DPO's, GRPO's sequence terms) computed alike on every rank."""
        sums = token_logps.new_zeros(self.num_sequences).index_add(0, self.score_sequence, token_logps)
        return sum_over_ranks(sums, group=group)


def shard_tree(batch: TreeBatch, *, cp_size: int, rank: int, layout: str = "hybrid", pad_id: int = 0) -> TreeShard:
    """One rank's part of a :class:`TreeBatch` for a CP group of ``cp_size``: a tree is a segment of the row
    (:func:`packkit.cp.shard`'s plan: ``"hybrid"`` keeps small trees whole on one rank, balanced, and cuts a tree
    larger than a rank's share), and the ancestor test goes with every token as global ``tin`` / ``tout``, so
    the attention (:func:`packkit.cp.cp_attention`) is exact whatever the cut. Shared prefixes are forwarded
    once on the group, as on one device.

    ``shard_tree(tree_batch(build_tree([1, 2, 3, 1, 2, 4], [3, 3])), cp_size=2, rank=0).tin -> [0, 3]`` (the
    one tree of 4 nodes cut in zigzag halves).
    """
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"shard_tree takes a TreeBatch (tree_batch, TreeCollator), got {type(batch).__name__}")
    cp = shard(batch, cp_size=cp_size, rank=rank, layout=layout, pad_id=pad_id)
    rows, width = batch.input_ids.shape
    total = rows * width
    index = cp.index.cpu().numpy()
    real = index >= 0
    flat_tout = (np.arange(total) // width * width + batch.tout.reshape(-1).cpu().numpy())
    here = np.arange(index.size, dtype=np.int64)
    tin = np.where(real, index, total + cp.rank * index.size + here)  # CP padding: a range of its own
    tout = np.where(real, flat_tout[np.maximum(index, 0)], tin + 1)
    local_of = np.full(total, -1, np.int64)
    local_of[index[real]] = here[real]
    at = local_of[batch.score_source.cpu().numpy()]
    entry = np.flatnonzero(at >= 0)
    dev = batch.input_ids.device
    target = batch.input_ids.reshape(-1)[batch.score_target.to(dev)[torch.from_numpy(entry).to(dev)]]
    return TreeShard(
        input_ids=cp.input_ids, position_ids=cp.take(batch.position_ids, fill=0)[None],
        tin=torch.from_numpy(tin).to(dev), tout=torch.from_numpy(tout).to(dev), index=cp.index,
        score_local=torch.from_numpy(at[entry]).to(dev), score_target_ids=target,
        score_entry=torch.from_numpy(entry).to(dev), score_sequence=batch.score_sequence.to(dev)[entry],
        num_scored=int(batch.score_source.numel()), num_sequences=int(batch.num_tokens.numel()), cp=cp)


# ----------------------------------------------------------------------------------------------
# multi-turn chat: one sample per assistant turn, then their tree
# ----------------------------------------------------------------------------------------------


def turn_rows(conversations) -> tuple[list, np.ndarray]:
    """Every assistant turn of every conversation as TRL's conversational prompt/completion row: the messages
    before it (``prompt``) and the turn (``completion``), so that the chat template renders the history as it
    renders it before that turn (Qwen3's drops the reasoning of earlier assistant turns, and keeps the last's).

    ``turn_rows([[u1, a1, u2, a2]])`` -> rows ``{prompt: [u1], completion: [a1]}``, ``{prompt: [u1, a1, u2],
    completion: [a2]}`` and their conversation ``[0, 0]``.

    An assistant message that opens its conversation (ShareGPT's split conversations: a third of them start with
    ``gpt``) is a turn whose history is empty: ``[[a0, u1, a1]]`` -> ``{prompt: [], completion: [a0]}``, then
    ``{prompt: [a0, u1], completion: [a1]}``. TRL's ``SFTTrainer`` trains that message in the conversation's
    ``messages`` row (its assistant mask is on), but cannot read such a prompt/completion row (an empty prompt);
    :func:`chat_tree` trains it as the ``messages`` row of that message alone (:func:`opening_turns`). A
    conversation with no assistant message is refused (nothing of it would be trained).
    """
    rows, conv = [], []
    for i, messages in enumerate(conversations):
        messages = list(messages)
        turns = [t for t, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
        if not turns:
            raise DataError(f"conversation {i} has no assistant message: nothing of it would be trained; drop it")
        rows += [{"prompt": messages[:t], "completion": [messages[t]]} for t in turns]
        conv += [i] * len(turns)
    return rows, np.asarray(conv, np.int64)


def opening_turns(rows, conv, tokenizer, *, chat_template=None) -> tuple[np.ndarray, object]:
    """Which of :func:`turn_rows`' ``rows`` open their conversation (an empty ``prompt``), and how they are trained,
    said in one :class:`~packkit.chat.ChatWarning`. Returns ``(opening, table)``: ``opening`` ``(N,)`` bool, and
    the tokenization of those rows as TRL's ``SFTTrainer(assistant_only_loss=True)`` tokenizes the ``messages`` row
    of the message alone (:func:`~packkit.chat.tokenize_chat`: ``input_ids`` and ``assistant_masks``, the template's
    ``{% generation %}`` tokens, in TRL's training version of a template that has none), which is what TRL trains
    of that message in the whole conversation's ``messages`` row.

    A template that has no markers, and no training version in TRL, cannot say which of the message's tokens TRL
    trains: then ``table`` is None, the rows are left untrained (history of the later turns), the warning says so
    and names the fix, and a conversation left with no turn is refused.
    """
    import pyarrow as pa  # lazy: only chat data needs Arrow

    opening = np.array([not r["prompt"] for r in rows], bool)
    if not opening.any():
        return opening, None
    n, first = int(opening.sum()), int(conv[np.argmax(opening)])
    tok = load_tokenizer(tokenizer)
    try:
        _, words = _template_for(tok, str(getattr(tok, "name_or_path", "?")), chat_template, True)
    except ArgumentError as e:
        alone = np.bincount(conv[~opening], minlength=int(conv.max()) + 1) == 0
        if alone.any():
            i = int(np.argmax(alone))
            raise DataError(f"conversation {i} has no assistant message after another message, and its opening one "
                            f"cannot be trained ({e}): drop the conversation or put a user message first") from None
        warnings.warn(ChatWarning(f"{n:,} conversations open with an assistant message (the first: conversation "
                                  f"{first}): not trained, history for the later turns only, since {e}"), stacklevel=3)
        return opening, None
    warnings.warn(ChatWarning(f"{n:,} conversations open with an assistant message (the first: conversation {first}): "
                              "each is trained as a turn of its own, the message alone, on its assistant tokens "
                              f"under {words}, as TRL's SFTTrainer trains it in a messages row (a prompt/completion "
                              "row cannot hold an empty prompt)"), stacklevel=3)
    table = tokenize_chat(pa.Table.from_pylist([{"messages": rows[k]["completion"]} for k in np.flatnonzero(opening)]),
                          tok, chat_template=chat_template, assistant_only_loss=True)
    return opening, table


def chat_tree(conversations, tokenizer, *, chat_template=None, values=None) -> PrefixTree:
    """The prefix tree of multi-turn conversations trained turn by turn: :func:`turn_rows`, each rendered and
    tokenized as TRL's SFTTrainer tokenizes a conversational prompt/completion row
    (:func:`packkit.chat.tokenize_chat`: the loss on the completion, the turn), then :func:`build_tree` with one
    group a conversation (each conversation a tree). Samples are in turn order, conversation after conversation.
    A turn that opens its conversation is the message alone, trained on its assistant tokens (:func:`opening_turns`).

    ``conversations``: lists of ``{"role", "content"[, "reasoning_content"]}`` messages; ``tokenizer`` and
    ``chat_template`` as in :func:`~packkit.chat.tokenize_chat` (the tokenizer's own template by default: pass
    the model's real one, so that what it removes from earlier turns is removed here).
    """
    import pyarrow as pa  # lazy: only chat data needs Arrow

    rows, conv = turn_rows(conversations)
    opening, alone = opening_turns(rows, conv, tokenizer, chat_template=chat_template)
    parts = []  # (rows, ids, lengths, mask) of the prompt/completion rows, then of the opening turns trained
    later = np.flatnonzero(~opening)
    if later.size:
        parts.append((later, tokenize_chat(pa.Table.from_pylist([rows[k] for k in later]), tokenizer,
                                           chat_template=chat_template), "completion_mask"))
    if alone is not None:
        parts.append((np.flatnonzero(opening), alone, "assistant_masks"))
    where = np.concatenate([w for w, _, _ in parts])
    ids = [t.column("input_ids").combine_chunks() for _, t, _ in parts]
    lengths = np.concatenate([np.diff(i.offsets.to_numpy()) for i in ids]).astype(np.int64)
    flat = np.concatenate([i.values.to_numpy() for i in ids]).astype(np.int64)
    mask = np.concatenate([t.column(n).combine_chunks().values.to_numpy() for _, t, n in parts]).astype(np.int8)
    order = np.argsort(where, kind="stable")  # back to turn order
    take = range_index(lengths_to_offsets(lengths)[:-1][order], lengths[order])
    return build_tree(flat[take], lengths[order], loss_mask=mask[take], groups=conv[where[order]], values=values)


def turn_tokens(conversations, tokenizer, *, chat_template=None) -> dict:
    """What training ``conversations`` turn by turn forwards (:func:`chat_tree`): ``turn_tokens`` (every turn's
    sample whole), ``tree_tokens`` (shared histories once: the trees' nodes) and their ``ratio``, with the counts
    of ``conversations`` and ``turns``. What ``packkit waste FILE --turns`` prints."""
    conversations = list(conversations)
    tree = chat_tree(conversations, tokenizer, chat_template=chat_template)
    return {"conversations": len(conversations), "turns": int(tree.sample_ptr.size - 1),
            "turn_tokens": tree.num_sample_tokens, "tree_tokens": tree.num_nodes,
            "ratio": tree.num_sample_tokens / tree.num_nodes}



# ----------------------------------------------------------------------------------------------
# trees larger than a window, and trees dealt to ranks
# ----------------------------------------------------------------------------------------------


def _dfs_samples(tree: PrefixTree):
    """Samples in depth-first order of their last node, with each one's shared length with the one before
    (in that order the previous sample shares the most with it among all earlier ones)."""
    off = tree.sample_ptr
    order = np.lexsort((np.arange(off.size - 1), tree.path[off[1:] - 1]))
    lcp = np.zeros(order.size, np.int64)
    tree_of = np.searchsorted(tree.tree_ptr, tree.path[off[:-1]], side="right") - 1
    for i in range(1, order.size):  # one numpy compare a sample
        a, b = order[i - 1], order[i]
        if tree_of[a] != tree_of[b]:
            continue
        pa, pb = tree.path[off[a]:off[a + 1]], tree.path[off[b]:off[b + 1]]
        n = min(pa.size, pb.size)
        diff = np.flatnonzero(pa[:n] != pb[:n])
        lcp[i] = diff[0] if diff.size else n
    return order, lcp, tree_of


def split_trees(tree: PrefixTree, *, window: int) -> tuple[np.ndarray, int]:
    """Cut every tree of more than ``window`` nodes at node boundaries: its samples, depth first, go to parts of at
    most ``window`` nodes each, a part recomputing the prefix it shares with the part before. Returns each
    sample's part ``(N,)`` int64 (parts numbered tree by tree) and the tokens recomputed (forwarded again).

    ``split_trees(build_tree([1, 2, 3, 1, 2, 4], [3, 3]), window=3) -> ([0, 1], 2)``: ``1 2`` forwarded twice.
    Raises a one-line error naming a sample longer than ``window`` (no cut inside a sample keeps its loss whole).
    """
    window = check_window(window)
    lengths = np.diff(tree.sample_ptr)
    over = np.flatnonzero(lengths > window)
    if over.size:
        raise DataError(f"sample {int(over[0])} has {int(lengths[over[0]]):,} tokens > window={window:,}: a tree is cut "
                        "between samples, never inside one; raise window")
    order, lcp, tree_of = _dfs_samples(tree)
    part = np.empty(lengths.size, np.int64)
    count, load, last_tree = -1, 0, -1
    for s, shared in zip(order.tolist(), lcp.tolist()):
        new = int(lengths[s]) - (shared if tree_of[s] == last_tree else 0)
        if tree_of[s] != last_tree or load + new > window:
            count, load, last_tree = count + 1, int(lengths[s]), int(tree_of[s])
        else:
            load += new
        part[s] = count
    ids = tree.input_ids[tree.path]
    nodes = prefix_nodes(ids, lengths, groups=part)
    return part, int(np.count_nonzero(nodes == np.arange(nodes.size))) - tree.num_nodes


def subtree(tree: PrefixTree, samples, *, groups=None) -> PrefixTree:
    """The tree of some of ``tree``'s samples (``samples``: their indices, in the order wanted), built again from
    their tokens, loss tokens and values (``groups``: one per chosen sample, e.g. :func:`split_trees`' parts)."""
    samples = np.asarray(samples, np.int64)
    off = tree.sample_ptr
    lengths = np.diff(off)[samples]
    flat = range_index(off[:-1][samples], lengths)
    mask = np.zeros(off[-1], bool)
    mask[tree.score_token] = True
    values = {}
    for name, v in tree.values.items():
        full = np.zeros(off[-1], np.float64)
        full[tree.score_token] = v
        values[name] = full[flat]
    return build_tree(tree.input_ids[tree.path[flat]], lengths, loss_mask=mask[flat], values=values, groups=groups)


@dataclasses.dataclass(frozen=True)
class TreeDeal:
    """Trees dealt to ranks (:func:`deal_trees`). ``ranks[r][m]``: the sample indices of rank ``r``'s micro-batch
    ``m`` (every rank the same number of micro-batches, none empty); ``part``: each sample's part (``(N,)``);
    ``recomputed``: tokens forwarded again because a tree was cut (counted, never silent)."""

    ranks: list
    part: np.ndarray
    recomputed: int

    def batch(self, tree: PrefixTree, rank: int, micro: int, **batch_options) -> TreeBatch:
        """The :class:`TreeBatch` of rank ``rank``'s micro-batch ``micro`` (sequences in its sample order)."""
        samples = self.ranks[rank][micro]
        return tree_batch(subtree(tree, samples, groups=self.part[samples]), **batch_options)


def _run_nodes(first_len: np.ndarray, cum_new: np.ndarray, a, b):
    """Nodes of the samples at depth-first positions ``[a, b)`` of one tree (:func:`_dfs_samples` order): the first
    sample whole, then what each adds to the one before (``cum_new``: prefix sums of those, ``(N + 1,)``)."""
    return first_len[a] + cum_new[b] - cum_new[a + 1]


def _positions(run) -> np.ndarray:
    """The depth-first positions of a part: a run ``(a, b)``, or an array of them (two samples paired)."""
    return np.arange(*run) if isinstance(run, tuple) else run


def _merge_singles(bins, runs, size_of, part, order, first_len, lcp, merges: int, max_tokens: int) -> None:
    """Make ``merges`` fewer micro-batches of the single-sample ones (``bins`` and the parts' fields, in place):
    each step adds a single sample to a micro-batch (single or grown) that it fits, as one part, the pair with the
    fewest other choices first: a sample adds its tokens less the most it shares with a member (the least ``lcp``
    between them in depth-first order; ``0`` across trees). Raises the one-line error when no more fit
    ``max_tokens``."""
    single = [i for i, b in enumerate(bins) if len(b) == 1 and isinstance(runs[b[0]], tuple)
              and runs[b[0]][1] - runs[b[0]][0] == 1]
    at = np.asarray(sorted(runs[bins[i][0]][0] for i in single), np.int64)  # depth-first positions
    single = sorted(single, key=lambda i: runs[bins[i][0]][0])
    k = at.size
    shared = np.zeros((k, k), np.int64)  # shared[i, j]: tokens samples i and j share
    for i in range(k - 1):
        shared[i, i + 1:] = np.minimum.accumulate(lcp[at[i] + 1:at[-1] + 1])[at[i + 1:] - at[i] - 1]
    shared = np.maximum(shared, shared.T)
    best = shared.copy()  # per micro-batch (row), the most each sample shares with one of its members
    size = first_len[at].copy()
    alone, members = np.ones(k, bool), [[i] for i in range(k)]
    done = 0
    for done in range(merges):
        union = size[:, None] + first_len[at][None, :] - best
        union[:, ~alone] = max_tokens + 1  # add only samples still alone, to a micro-batch still in play
        union[[not m for m in members], :] = max_tokens + 1
        np.fill_diagonal(union, max_tokens + 1)
        fit = union <= max_tokens
        if not fit.any():
            raise DataError(f"{len(bins)} micro-batches of max_tokens={max_tokens:,} nodes, {k} of them single "
                            f"samples, of which only {done} can be merged into others and the ranks need {merges} "
                            "merged (a multiple of the world size, none empty): raise max_tokens or send more samples")
        # the micro-batch with the fewest samples that fit it, with the sample that fits the fewest (a matching
        # that pairs the smallest first strands the large ones), then the fewest nodes
        rows = fit.sum(1)
        g = int(np.argmin(np.where(rows > 0, rows, k + 1)))
        x = int(np.lexsort((union[g], np.where(fit[g], fit.sum(0), k + 1)))[0])
        size[g], alone[x], alone[g] = union[g, x], False, False
        best[g] = np.maximum(best[g], shared[x])
        members[g] += members[x]
        members[x] = []
    gone = set()
    for g, m in enumerate(members):
        if len(m) < 2:
            continue
        p = bins[single[g]][0]
        runs[p] = np.sort(at[m])
        size_of[p] = int(size[g])
        for x in m[1:]:
            q = bins[single[x]][0]
            part[order[at[x]]] = p  # one part: the members share their prefixes
            runs[q], size_of[q] = np.zeros(0, np.int64), 0
            gone.add(single[x])
    bins[:] = [b for i, b in enumerate(bins) if i not in gone]


def deal_trees(tree: PrefixTree, *, world_size: int, max_tokens: int) -> TreeDeal:
    """Deal the samples of ``tree`` to ``world_size`` ranks in micro-batches of at most ``max_tokens`` nodes, every
    rank the same number of micro-batches, none empty, every sample in exactly one.

    A subtree is the atom: trees over ``max_tokens`` are cut by :func:`split_trees` into parts (runs of samples in
    depth-first order), the parts packed best fit into ``K`` micro-batches, and while ``K`` is not a multiple of
    ``world_size`` (or below it) the micro-batch of most nodes is split: between its parts, or, a single part, between
    its samples where the halves are most even (the prefix they share recomputed in both, counted in
    ``recomputed``). Then micro-batches go to ranks largest first, each to the least loaded rank that still needs
    one. ``deal_trees(build_tree([1, 2, 3, 1, 2, 4], [3, 3]), world_size=2, max_tokens=4).ranks -> [[[0]], [[1]]]``.

    Raises a one-line error for fewer samples than ranks (a rank would idle), for a sample over ``max_tokens``, and
    when no micro-batch can be split although ranks need more (every one a single sample: raise ``max_tokens``
    or send more samples).
    """
    world_size = max(1, int(world_size))
    n = tree.sample_ptr.size - 1
    if n < world_size:
        raise DataError(f"{n} samples for {world_size} ranks: a rank would have no work (and a collective would hang); "
                        "give every step at least one sample per rank")
    part, _ = split_trees(tree, window=max_tokens)
    lengths = np.diff(tree.sample_ptr)
    order, lcp, _ = _dfs_samples(tree)  # a part is a run of this order, and so is every cut of it
    first_len = lengths[order]
    cum_new = np.append(0, np.cumsum(first_len - lcp))
    pos = part[order]
    starts = np.flatnonzero(np.r_[True, pos[1:] != pos[:-1]])
    ends = np.append(starts[1:], n)
    runs = list(zip(starts.tolist(), ends.tolist()))  # part p: positions runs[p]
    sizes = _run_nodes(first_len, cum_new, starts, ends)
    bins = [list(w.tolist()) for w in pack(sizes, window=max_tokens).windows()]
    size_of = sizes.tolist()
    target = -(-max(len(bins), world_size) // world_size) * world_size
    if target > n:  # even every sample alone is too few micro-batches: merge single samples instead, fewer
        target = n // world_size * world_size
        _merge_singles(bins, runs, size_of, part, order, first_len, lcp, len(bins) - target, max_tokens)
    while len(bins) < target:  # always possible: n >= target, and every bin of several samples can be split
        i = max((i for i, b in enumerate(bins) if len(b) > 1 or runs[b[0]][1] - runs[b[0]][0] > 1),
                key=lambda i: (sum(size_of[p] for p in bins[i]), -i))
        b = bins.pop(i)
        if len(b) > 1:  # between parts: the largest first, each to the lighter half
            halves, load = ([], []), [0, 0]
            for p in sorted(b, key=lambda p: -size_of[p]):
                h = int(load[1] < load[0])
                halves[h].append(p)
                load[h] += size_of[p]
            bins += [halves[0], halves[1]]
            continue
        (a, e), p = runs[b[0]], b[0]  # one part of several samples: cut where the halves are most even
        cut = np.arange(a + 1, e)
        c = int(cut[np.argmin(np.maximum(_run_nodes(first_len, cum_new, a, cut),
                                          _run_nodes(first_len, cum_new, cut, e)))])
        runs[p] = (a, c)
        runs.append((c, e))
        size_of[p] = int(_run_nodes(first_len, cum_new, a, c))
        size_of.append(int(_run_nodes(first_len, cum_new, c, e)))
        part[order[c:e]] = len(runs) - 1
        bins += [[p], [len(runs) - 1]]
    per_rank = target // world_size
    load = np.zeros(world_size, np.int64)
    ranks: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for b in sorted(bins, key=lambda b: -sum(size_of[p] for p in b)):
        r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
        ranks[r].append(np.sort(np.concatenate([order[_positions(runs[p])] for p in b])))
        load[r] += sum(size_of[p] for p in b)
    return TreeDeal(ranks=ranks, part=part, recomputed=int(sum(size_of)) - tree.num_nodes)


# ----------------------------------------------------------------------------------------------
# a DataLoader's collate_fn
# ----------------------------------------------------------------------------------------------


class TreeCollator:
    """Samples -> a :class:`TreeBatch`, their shared prefixes found and computed once: a DataLoader's
    ``collate_fn`` for turn-by-turn SFT samples or RL rollouts.

    Each example has ``input_ids``, optionally a loss mask (the first of :data:`packkit.rules.MASK_KEYS` it has:
    ``completion_mask``, ``assistant_masks``; none: every token after the first), per-token ``value_keys``
    (``advantages``, ``old_logps``: one number a token, on every example or none) and a ``group_key`` (an int:
    samples share prefixes only within a group). An ``attention_mask`` holding a 0 (padding, as a padded rollout
    carries) is refused naming the example (:func:`packkit.rules.padded_example`).
    ``TreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 4]}]).input_ids -> [[1, 2, 3, 4]]``. ``window``, ``num_windows``, ``strategy``, ``pad_token_id``: as
    :func:`tree_batch` (a tree over ``window`` is an error naming :func:`split_trees`). ``loss_mask``: ``"auto"``,
    ``"required"`` or ``"none"``, as packkit's other collators (:meth:`_mask_key`).
    """

    def __init__(self, *, window: int | None = None, num_windows: int | None = None, strategy: str = "bfd",
                 pad_token_id: int = 0, value_keys=("advantages", "old_logps"), group_key: str | None = None,
                 loss_mask: str = "auto"):
        self.loss_mask = check_loss_mask_mode(loss_mask)
        self._warned = False
        self.window = None if window is None else check_window(window)
        self.options = {"window": self.window, "num_windows": num_windows, "strategy": check_strategy(strategy),
                        "pad_token_id": int(pad_token_id)}
        self.value_keys, self.group_key = tuple(value_keys), group_key

    def __call__(self, examples) -> TreeBatch:
        examples = list(examples)
        if not examples:
            raise ValueError("a collator needs at least one example")
        ids, lengths = read_column(examples, "input_ids", missing="a sample is input_ids (and optionally a loss mask)")
        if any(ATTENTION_MASK_KEY in ex for ex in examples):  # a 0 is a pad token: refused by the rules' own check
            for i, ex in enumerate(examples):
                example_arrays(ex, ["input_ids"], index=i)
        key = self._mask_key(examples[0])
        mask = None if key is None else read_column(examples, key, missing=f"every example needs {key!r} when the "
                                                   "first has it")[0]
        values = {}
        for name in self.value_keys:
            got = example_values([ex.get(name) for ex in examples], lengths, key=name, what="token")
            if got is not None:
                values[name] = got
        groups = None if self.group_key is None else [ex.get(self.group_key) for ex in examples]
        tree = build_tree(ids, lengths, loss_mask=mask, values=values, groups=groups)
        return tree_batch(tree, **self.options)

    def _mask_key(self, first: dict):
        """The loss mask the batch carries (the first of :data:`packkit.rules.MASK_KEYS` its first example has),
        by the ``loss_mask`` policy of packkit's collators: ``"auto"`` scores every token after the first when
        there is none and says so once (a Trainer's ``remove_unused_columns=True`` drops mask columns),
        ``"required"`` refuses, ``"none"`` (every token a target) refuses a mask it would ignore."""
        key = next((k for k in MASK_KEYS if k in first), None)
        if key is None and self.loss_mask == "required":
            raise no_mask(0, None)
        if key is not None and self.loss_mask == "none":
            raise mask_not_expected(0, None, key)
        if key is None and self.loss_mask == "auto" and not self._warned:
            self._warned = True
            warnings.warn(UNSUPERVISED_WARNING.format(keys=", ".join(MASK_KEYS)), LossMaskWarning, stacklevel=3)
        return key

    def __repr__(self) -> str:
        return f"TreeCollator(window={self.window}, group_key={self.group_key!r})"


class TreeSFTMixin(StepCountHook):
    """``transformers.Trainer`` (or TRL's ``SFTTrainer``) on prefix trees: mix it in first and pass a
    :class:`TreeCollator`::

        class TreeTrainer(TreeSFTMixin, transformers.Trainer):
            pass

        trainer = TreeTrainer(model=model, args=TrainingArguments(out), train_dataset=turns,
                              data_collator=TreeCollator(window=8192))

    The loss of an optimiser step is the unpacked token mean: the negative log-probabilities of its scored tokens
    (every sample's loss tokens, a token two samples train on counted twice, as unpacked) summed over every
    micro-batch of the step and every rank, over their number, counted before the first forward (``Trainer``'s own
    count reads ``labels``, which in a tree misses every branch's first scored token; averaging micro-batch means
    would over-weigh the tokens of small micro-batches). The log-probabilities come from the LM head fused with
    them (:func:`packkit.logps.scored_logps`: no ``[tokens, vocab]`` logits). The columns the collator reads
    (``input_ids``, the loss masks, its value and group keys) are kept under the Trainer's default
    ``remove_unused_columns=True``, which would otherwise drop the loss mask before the collator sees it.
    """

    loss_is_scaled_for_ga = True  # transformers' switch: the loss is over the step's count, not one micro-batch's

    @property
    def kept_columns(self) -> tuple:
        collator = getattr(self, "data_collator", None)
        keys = ["input_ids", *MASK_KEYS]
        if isinstance(collator, TreeCollator):
            keys += [*collator.value_keys, *([collator.group_key] if collator.group_key else [])]
        return tuple(keys)

    def _step_normalizer(self, batch_samples: list, all_reduce: bool):
        """The scored tokens of the step's micro-batches (this rank's), summed over the ranks when asked."""
        if not batch_samples or not all(isinstance(b, TreeBatch) for b in batch_samples):
            return None
        local = torch.tensor([sum(int(b.score_target.numel()) for b in batch_samples)], dtype=torch.float64)
        if all_reduce:
            import torch.distributed as dist

            dist.all_reduce(local)
        return StepNormalizer(float(local[0]))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(inputs, TreeBatch):
            raise TypeError(f"TreeSFTMixin takes TreeBatch inputs, got {type(inputs).__name__}: pass "
                            "data_collator=packkit.prefixtree.TreeCollator(...)")
        target = inputs.input_ids.reshape(-1)[inputs.score_target]
        per_token, outputs = scored_logps(model, inputs.model_inputs(model), inputs.score_source, target)
        step = getattr(num_items_in_batch, "loss_normalizer", None)
        if step is None:  # outside a training step (evaluation): this batch's own mean
            loss = -per_token.sum() / max(int(per_token.numel()), 1)
        else:  # ranks average their gradients: the world size takes that mean back to the step's sum over step
            loss = -per_token.sum() * self.args.world_size / max(step, 1.0)
        return (loss, outputs) if return_outputs else loss
