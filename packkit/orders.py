"""The epochs of the padded samplers (:class:`~packkit.sampler.LengthGroupedSampler`,
:class:`~packkit.sampler.TokenBudgetBatchSampler`): lengths sorted longest first inside megabatches, the batches a
token budget cuts from them, and the steps arranged from those batches.

Their own room, imported where those samplers build an epoch, so that a command that deals packed windows
(``packkit plan``, ``packkit waste``) does not compile them; :mod:`packkit.sampler` lends the sorts here as before::

    >>> sort_megabatches([0, 1, 2, 3], [1, 3, 2, 4], 2).tolist()
    [1, 0, 3, 2]
"""

from __future__ import annotations

import numpy as np

from .csr import arrange_steps, batch_sums, select_batches
from .errors import check_int
from .segments import range_index

__all__ = ["stable_argsort", "longest_first", "sort_megabatches", "budget_batch_bounds", "length_grouped",
           "token_budget"]


def stable_argsort(key: np.ndarray) -> np.ndarray:
    """Stable argsort along the last axis of non-negative integer keys.

    numpy sorts 16-bit keys by radix and wider ones by merge sort, 50x slower on 64,000 ShareGPT lengths
    (the longest 221,070 tokens). Keys below ``2**32`` are sorted in two stable 16-bit radix passes, the low
    half first (a least-significant-digit radix sort): the same order. ``stable_argsort([70000, 3, 70000, 1])
    -> [3, 1, 0, 2]``.
    """
    key = np.asarray(key)
    top = int(key.max()) if key.size else 0
    if top < 1 << 16:
        return np.argsort(key.astype(np.uint16), axis=-1, kind="stable")
    if top >= 1 << 32:
        return np.argsort(key, axis=-1, kind="stable")
    by_low = np.argsort((key & 0xFFFF).astype(np.uint16), axis=-1, kind="stable")
    high = np.take_along_axis((key >> 16).astype(np.uint16), by_low, axis=-1)
    return np.take_along_axis(by_low, np.argsort(high, axis=-1, kind="stable"), axis=-1)


def longest_first(lengths: np.ndarray) -> np.ndarray:
    """Stable argsort along the last axis of lengths (>= 0), longest first: ``longest_first([3, 70000, 3, 9])
    -> [1, 3, 0, 2]``.

    Where every length and its position in the row fit 32 bits (ShareGPT's 221,070 in rows up to 8,192), one sort of
    the unique keys ``(cap - length) << bits | position`` (:func:`_longest_first32`, 2.5x faster than a radix
    argsort). Else one 16-bit radix pass over ``0xFFFF - min(length, 0xFFFF)``: the lengths past it tie at the head
    of their row in the given order, and only they are sorted again, by their whole length.
    """
    lengths = np.asarray(lengths)
    fast = _longest_first32(lengths)
    if fast is not None:
        return fast.astype(np.int64)
    n = lengths.shape[-1] if lengths.ndim else 1
    key = np.empty(lengths.shape, np.uint16)
    np.minimum(lengths, 0xFFFF, out=key, casting="unsafe")  # (cast chunk by chunk: no int64 temporary)
    np.subtract(np.uint16(0xFFFF), key, out=key)
    out = np.argsort(key, axis=-1, kind="stable")
    heads = np.count_nonzero((key == 0).reshape(-1, n), axis=1)  # the ties at 0xFFFF and past it, per row
    if heads.any() and lengths.size:
        rows = np.arange(heads.size, dtype=np.int64)
        row = np.repeat(rows, heads)
        at = range_index(rows * n, heads)  # their flat positions in out: each row's head
        flat = out.reshape(-1)
        held = flat[at]
        flat[at] = held[np.lexsort((-(lengths.reshape(-1, n)[row, held]), row))]  # lexsort is stable
    return out


def _longest_first32(lengths: np.ndarray) -> np.ndarray | None:
    """:func:`longest_first` as uint32, by one sort of unique 32-bit keys (the position breaks the ties, so any sort
    is the stable one), or None where a length and its position do not fit 32 bits: ``[3, 9] -> [1, 0]``."""
    n = lengths.shape[-1] if lengths.ndim else 0
    bits = max(1, (n - 1).bit_length())  # a position in its row
    if not n or bits >= 32 or int(lengths.max()) >= 1 << (32 - bits):
        return None
    key = np.empty(lengths.shape, np.uint32)
    return _sorted_keys(np.subtract((1 << (32 - bits)) - 1, lengths, out=key, casting="unsafe"), bits)


def _sorted_keys(key: np.ndarray, bits: int) -> np.ndarray:
    """Positions along the last axis of ``key`` (uint32 ``cap - length``, below ``2 ** (32 - bits)``), longest first,
    stable: each key shifted past ``bits`` bits of its position and sorted (in place). ``([7, 0], 1) -> [1, 0]``."""
    np.left_shift(key, np.uint32(bits), out=key)
    np.bitwise_or(key, np.arange(key.shape[-1], dtype=np.uint32), out=key)
    key.sort(axis=-1)
    return np.bitwise_and(key, np.uint32((1 << bits) - 1), out=key)


def sort_megabatches(order: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """``order`` cut into consecutive blocks of ``size``, each sorted longest first (stable).

    One row-wise :func:`longest_first` over the full blocks (20x faster than one sort over ``(block, -length)``
    keys), then the last block: ``sort_megabatches([0, 1, 2, 3], [1, 3, 2, 4], 2) -> [1, 0, 3, 2]``.
    """
    order = np.asarray(order, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if order.size == 0:
        return order
    nfull = order.size // size * size
    bits = max(1, (min(size, order.size) - 1).bit_length())  # a position in its block
    keys = None  # (cap - length) of every example as uint32, gathered: the keys of _longest_first32, no int64 copy
    if bits < 32 and order.size < 1 << 31 and int(lengths.max()) < 1 << (32 - bits):
        keys = np.subtract((1 << (32 - bits)) - 1, lengths, out=np.empty(lengths.size, np.uint32), casting="unsafe")
        keys = np.take(keys, order)
    else:
        seq = lengths[order]
    out = np.empty_like(order)  # gathered in place (mode "clip": the indices are in range, numpy buffers none)
    for lo, hi, width in ((0, nfull, size), (nfull, order.size, order.size - nfull)):
        if hi > lo:  # positions in order, longest first in each block
            at = longest_first(seq[lo:hi].reshape(-1, width)) if keys is None else _sorted_keys(
                keys[lo:hi].reshape(-1, width), bits)
            at += np.arange(lo, hi, width, dtype=at.dtype)[:, None]
            np.take(order, at.reshape(-1), out=out[lo:hi], mode="clip")
    return out


def budget_batch_bounds(sorted_lengths: np.ndarray, *, max_tokens: int, block: int,
                        max_batch_size: int | None = None) -> np.ndarray:
    """Batch boundaries over lengths sorted longest first inside blocks of ``block``.

    A batch starts at its longest item ``i`` and takes ``max_tokens // length[i]`` items (at most
    ``max_batch_size``), never crossing a block. One Python step per batch, not per example.
    ``budget_batch_bounds([4, 2, 2, 1], max_tokens=4, block=4) -> [0, 1, 3, 4]``.
    """
    sorted_lengths = np.asarray(sorted_lengths, np.int64)
    n = sorted_lengths.size
    cap = max_tokens // sorted_lengths
    if max_batch_size is not None:
        cap = np.minimum(cap, max_batch_size)
    pos = np.arange(n, dtype=np.int64)
    block_end = np.minimum((pos // block + 1) * block, n)
    nxt = np.minimum(pos + np.maximum(cap, 1), block_end).tolist()
    bounds = [0]
    i = 0
    while i < n:
        i = nxt[i]
        bounds.append(i)
    return np.asarray(bounds, np.int64)


# ----------------------------------------------------------------------------------------------
# the padded samplers' epochs
# ----------------------------------------------------------------------------------------------


def _default_mult(mult, full_steps: int) -> int:
    """Steps per megabatch: the given number, or min(50, a quarter of the steps) (Hugging Face's rule)."""
    if mult is None:
        return max(1, min(50, full_steps // 4))
    return check_int(mult, "megabatch_mult")


def _tail_units(flat: np.ndarray, ptr: np.ndarray, tail: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Units ``flat, ptr`` with the ``tail`` units appended: ``([1, 2], [0, 2], [[3]]) -> ([1, 2, 3], [0, 2, 3])``."""
    if not tail:
        return flat, ptr
    sizes = np.array([t.size for t in tail], np.int64)
    return np.concatenate((flat, *tail)), np.concatenate((ptr, ptr[-1] + np.cumsum(sizes)))


def length_grouped(sampler, rng, step: int) -> dict:
    """The epoch of a :class:`~packkit.sampler.LengthGroupedSampler` (its lengths, batch size and options), ``step``
    batches a step, as the fields of its sequence: ``flat`` (n,) int64 example indices, ``ptr`` the batches' offsets,
    ``full`` the batches of full steps, ``dropped``. Each megabatch sorted longest first, cut in batches, the steps
    arranged (shuffled, balanced, the longest first) by ``rng``; the tail, longest first, makes the last step."""
    L, B = sampler.lengths, sampler.batch_size
    n, span = L.size, step * B
    full = n // span * span
    if full == 0 and sampler.drop_last:
        raise ValueError(
            f"{n} examples do not fill one step of step_batches x batch_size = {span}; "
            "pass drop_last=False or a smaller batch_size"
        )
    perm = rng.permutation(n) if sampler.shuffle else np.arange(n, dtype=np.int64)
    body, tail = perm[:full], perm[full:]  # the tail is a random subset
    mult = _default_mult(sampler.megabatch_mult, full // span)
    order = sort_megabatches(body, L, mult * span)
    ptr = np.arange(0, full + 1, B, dtype=np.int64)
    balance = sampler.balance in ("tokens", "sqlen")  # the batches' costs order the steps only then
    cost = batch_sums(sampler._policy_cost(L[order], order), ptr) if balance else np.zeros(full // B)
    first = None
    if sampler.longest_first and full:
        first = int(np.argmax(L[order])) // B
    arrangement = arrange_steps(cost, step, rng, shuffle=sampler.shuffle, balance=balance, first=first)
    dropped = tail.size if sampler.drop_last else 0
    tail = tail[np.argsort(-L[tail], kind="stable")] if tail.size and not dropped else None
    flat = perm[:n - dropped]  # (the permutation's buffer, read already) the steps' batches of B, then the tail
    np.take(order.reshape(-1, B), arrangement, axis=0, out=flat[:full].reshape(-1, B), mode="clip")
    if tail is not None:
        flat[full:] = tail
        ptr = np.concatenate((ptr, np.arange(full + B, n, B, dtype=np.int64), [n]))
    return {"flat": flat, "ptr": ptr, "full": full // B, "dropped": dropped}


def _block(sampler, step: int) -> int:
    """Examples of a token budget's megabatch: ``megabatch_size``, else about 50 steps' worth."""
    if sampler.megabatch_size is not None:
        return sampler.megabatch_size
    per_batch = max(1, sampler.max_tokens // max(1, int(sampler.lengths.mean())))
    if sampler.max_batch_size is not None:
        per_batch = min(per_batch, sampler.max_batch_size)
    return 50 * per_batch * step


def token_budget(sampler, rng, step: int) -> dict:
    """The epoch of a :class:`~packkit.sampler.TokenBudgetBatchSampler`, ``step`` batches a step, as the fields of its
    sequence (as :func:`length_grouped`): megabatches sorted longest first and cut greedily to ``max_tokens``
    (:func:`budget_batch_bounds`); the batches that do not fill a step (a random few) make the last step."""
    L = sampler.lengths
    n = L.size
    perm = rng.permutation(n) if sampler.shuffle else np.arange(n, dtype=np.int64)
    block = _block(sampler, step)
    order = sort_megabatches(perm, L, block)
    bounds = budget_batch_bounds(L[order], max_tokens=sampler.max_tokens, block=block,
                                 max_batch_size=sampler.max_batch_size)
    G = bounds.size - 1
    t = G % step
    # -- a random few batches make the tail; the rest keep their megabatch order --
    pick = rng.permutation(G) if sampler.shuffle else np.arange(G, dtype=np.int64)
    tail_ids, body_ids = pick[G - t:], np.sort(pick[: G - t])
    if body_ids.size == 0 and sampler.drop_last:
        raise ValueError(
            f"{n} examples make {G} batches of max_tokens={sampler.max_tokens:,}, fewer than "
            f"step_batches={step}: pass drop_last=False or lower max_tokens"
        )
    flat, ptr = select_batches(order, bounds, body_ids)
    cost = batch_sums(sampler._policy_cost(L[flat], flat), ptr)
    first = None
    if sampler.longest_first and flat.size:
        first = int(np.searchsorted(ptr, int(np.argmax(L[flat])), side="right") - 1)
    arrangement = arrange_steps(cost, step, rng, shuffle=sampler.shuffle,
                                balance=sampler.balance in ("tokens", "sqlen"), first=first)
    flat, ptr = select_batches(flat, ptr, arrangement)
    parts = [order[bounds[b]:bounds[b + 1]] for b in tail_ids.tolist()]  # fewer than a step
    dropped = 0
    if parts and sampler.drop_last:
        dropped = sum(p.size for p in parts)
    else:
        flat, ptr = _tail_units(flat, ptr, parts)
    return {"flat": flat, "ptr": ptr, "full": G - t, "dropped": dropped}
