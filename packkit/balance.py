"""Compute balance across data-parallel ranks: who gets which window, and the windows built to a cost target.

A data-parallel step waits for its slowest rank, and a rank's time is not its token count: attention is
quadratic per document. What a document costs (:class:`CostModel`) and the two figures every schedule reports
(:func:`compute_imbalance`, :func:`variation`) live in :mod:`packkit.costs`, re-exported here: the commands
measure with them without compiling the planners below.

    >>> CostModel(linear=10).costs([1, 4]).tolist()
    [11.0, 56.0]
    >>> compute_imbalance([[3.0, 1.0], [2.0, 2.0]])      # (3 + 2) / (2 + 2)
    1.25

Balancing stays *inside* a step: the steps are drawn at random as without balancing (so what a step
holds is unchanged, see :func:`variation` of examples per step), and only which rank gets which of the
step's windows is chosen (:func:`lpt_assign`). For one or two windows per rank there is too little to
choose from, and :func:`pack_to_cost` builds the step's windows from documents to a cost target instead.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np

from .costs import DEFAULT_LINEAR, CostModel, compute_imbalance, cost_model, step_figures, variation  # re-exported
from .records import record

__all__ = ["CostModel", "DEFAULT_LINEAR", "compute_imbalance", "variation", "step_figures", "lpt_assign", "swap_refine",
           "pack_to_cost", "steps_to_cost", "greedy_to_cost", "PLANNER", "PLANNERS", "ToCost", "cost_model"]


# ----------------------------------------------------------------------------------------------
# which rank gets which of a step's windows
# ----------------------------------------------------------------------------------------------


def lpt_assign(cost, ranks: int, *, swaps: int = 4) -> np.ndarray:
    """(steps, n) int64 rank of each item, each rank getting ``n // ranks`` items of every step.

    Longest-processing-time first with equal counts, all steps at once: the items of a step, costliest
    first, are dealt in rounds of ``ranks``; in each round the costliest item goes to the rank carrying
    the least so far, the next to the next lightest, and so on (``n // ranks`` rounds of one sort of
    ``ranks`` loads each, vectorised over steps). Then ``swaps`` rounds of :func:`swap_refine`. ``n``
    must be a multiple of ``ranks``. ``lpt_assign([[5, 1, 4, 2]], 2) -> [[0, 0, 1, 1]]`` (5 + 1 and 4 + 2).
    """
    c = np.asarray(cost, np.float64)
    steps, n = c.shape
    if n % ranks:
        raise ValueError(f"{n} items per step do not share out evenly over {ranks} ranks")
    order = np.argsort(-c, axis=1, kind="stable")
    sorted_cost = np.take_along_axis(c, order, axis=1)
    loads = np.zeros((steps, ranks))
    out = np.empty((steps, n), np.int64)
    rows = np.arange(steps)[:, None]
    for j in range(n // ranks):
        lightest = np.argsort(loads, axis=1, kind="stable")  # (steps, ranks), lightest first
        cols = order[:, j * ranks:(j + 1) * ranks]
        out[rows, cols] = lightest
        loads[rows, lightest] += sorted_cost[:, j * ranks:(j + 1) * ranks]
    for _ in range(swaps if ranks > 1 else 0):
        out, changed = swap_refine(c, out, ranks)
        if not changed:
            break
    return out


def swap_refine(cost, rank_of, ranks: int) -> tuple[np.ndarray, bool]:
    """One round of the best swap per step between its heaviest and its lightest rank.

    ``cost``, ``rank_of``: (steps, n); each rank holds ``n // ranks`` items. For each step, the pair (an
    item of the heaviest rank, one of the lightest) whose exchange brings the two loads closest is
    swapped when that lowers the heavier of the two (so the step's maximum never rises). Returns the new
    ranks and whether any step changed: ``swap_refine([[4, 3, 2, 1]], [[0, 0, 1, 1]], 2) -> [[1, 0, 0, 1]]``
    (loads 7, 3 -> 5, 5).
    """
    c = np.asarray(cost, np.float64)
    rank_of = np.array(rank_of, np.int64)
    steps, n = c.shape
    q = n // ranks
    at = np.arange(steps)
    loads = np.bincount((rank_of + at[:, None] * ranks).ravel(), weights=c.ravel(),
                        minlength=steps * ranks).reshape(steps, ranks)
    heavy, light = loads.argmax(axis=1), loads.argmin(axis=1)
    by_rank = np.argsort(rank_of, axis=1, kind="stable").reshape(steps, ranks, q)
    h_items, l_items = by_rank[at, heavy], by_rank[at, light]  # (steps, q)
    delta = np.take_along_axis(c, h_items, 1)[:, :, None] - np.take_along_axis(c, l_items, 1)[:, None, :]
    gap = (loads[at, heavy] - loads[at, light])[:, None, None]
    after = np.maximum(gap - delta, delta)  # the heavier of the two, relative to the light load
    after = np.where((delta > 0) & (delta < gap), after, np.inf).reshape(steps, -1)
    best = after.argmin(axis=1)
    ok = np.isfinite(after[at, best]) & (after[at, best] < gap[:, 0, 0])
    if not ok.any():
        return rank_of, False
    s = at[ok]
    i, j = h_items[s, best[ok] // q], l_items[s, best[ok] % q]
    rank_of[s, i], rank_of[s, j] = light[ok], heavy[ok]
    return rank_of, True


# ----------------------------------------------------------------------------------------------
# one or two windows per rank: pack documents to a cost target
# ----------------------------------------------------------------------------------------------


@record
class ToCost:
    """Windows built step by step by :func:`pack_to_cost` (or :func:`greedy_to_cost`), in training order.

    ``seg_example``: (segments,) int64 document of each segment; ``window_ptr``: (windows + 1,) int64 CSR
    offsets, ``step_windows`` windows a step but in the last steps. ``queued``: long documents held back for a
    later step (outliers wait until a step takes one per window); ``deferred``: moves of a document that fitted no
    window of its step into a later one (a document moved twice counts twice).
    """

    seg_example: np.ndarray
    window_ptr: np.ndarray
    queued: int
    deferred: int


#: The cost-target planner a sampler state records (``"planner"``): 3 is :func:`pack_to_cost` (steps dealt a chunk
#: of steps at a time, by numpy), 2 :func:`steps_to_cost` (each step dealt alone), 1 :func:`greedy_to_cost` (one
#: document at a time; states saved without the field). :data:`PLANNERS` maps each to its function.
PLANNER = 3


def pack_to_cost(lengths, order, *, window: int, step_windows: int, cost: CostModel, outlier: float = 0.25,
                 fill: float = 0.998, cap: float = 0.005, rounds: int = 8, units=None, chunk: int = 512) -> ToCost:
    """Fill each step's ``step_windows`` windows with documents taken in ``order``, to equal cost (planner 3).

    ``lengths``: (n,) int64, each at most ``window``; ``order``: (m,) the documents to place, at random.

    * **Steps**: ``order`` is cut into runs, one a step (at least one document a window), step ``s`` ending where
      the stream's tokens reach ``s + 1`` budgets of ``fill * step_windows * window`` (what one run's last document
      left short, the next run takes). A document whose attention part alone exceeds ``outlier`` times a full
      window's linear part is *queued* (WLB-LLM's outlier queue): ``step_windows`` of them open a step together,
      the longest first, one per window (their tokens taken from the step's budget), once the last of them is
      within about a step of the run's start, so no rank carries one alone.
    * **Chunks**: ``G`` consecutive steps are dealt together, ``G = chunk // (documents a step meets)``, at least
      2 and at most ``64 // step_windows`` (at least 1): their ``G * step_windows`` windows take the runs of all ``G``, so a gap
      one step leaves is filled by a document of another (planner 2, :func:`steps_to_cost`, dealt each step alone).
    * **Windows**: each chunk's documents, costliest first, go one at a time to the chunk's cheapest window with
      room (an empty one first), unless that would take the window over ``1 + cap`` times its target: the
      chunk's mean window cost, or for a window an outlier opened, its step's. A document of a quarter window or
      more goes instead to the fullest window it fits under the target (best fit: long documents pair tightly),
      where there is one. A document that fits no window moves to the next chunk (``deferred``, one move a
      chunk, at most ``rounds`` moves).
    * **Steps of a chunk**: its windows, costliest first, are cut into its steps (windows of equal cost meet in a
      step), the steps in the order of their first document in ``order``. Every step but the last has exactly
      ``step_windows`` windows.
    * **All chunks at once**: the i-th document of every chunk is placed in one numpy pass (:func:`_deal`).
    * **The end**: what no whole chunk took (the run too short for a chunk, outliers not yet opened, documents
      still moving after ``rounds``: 1-4% of ShareGPT's documents, planner 2 0.2-2%) is planned by
      :func:`greedy_to_cost` into the last steps.

    ``units``: (n,) each document's media units, whose encoder work (``cost.per_unit``) joins its cost.
    ``queued`` counts the outliers, ``deferred`` each move of a document to a later chunk (the last steps'
    included). On 200,000 ShareGPT lengths (dp 8, k = 1 and 2, W = 2k-32k) fewer windows and a lower imbalance
    than planner 1 and planner 2 (at 2k, k = 1: +2.0% windows over the lower bound, imbalance 1.006; planner 1
    +3.6%, 1.048; planner 2 +7.1%, 1.082); benchmarks/RESULTS.md has the figures and the time.
    ``pack_to_cost([6, 3, 2, 1] * 4, range(16), window=10, step_windows=2, cost=CostModel(10), chunk=16)`` deals
    its two full steps as one chunk (the 6s are outliers, opening its windows): ``[0, 2, 3], [4, 6, 7], [8, 1],
    [12, 5]``, 9 tokens each (planner 2's steps hold 8, 7, 8 and 7), then the last steps ``[9, 14, 15],
    [10, 11, 13]``.
    """
    L = np.asarray(lengths, np.int64)
    n_order = np.asarray(order).size
    per_step = int(step_windows) * window / max(1.0, float(L[np.asarray(order, np.int64)].mean()) if n_order else 1.0)
    G = max(1, min(max(2, int(chunk) // max(1, int(per_step))), 64 // int(step_windows)))
    return _to_cost(L, order, window=window, S=int(step_windows), cost=cost, outlier=outlier, fill=fill, cap=cap,
                    rounds=rounds, units=units, G=G, regroup=True)


def steps_to_cost(lengths, order, *, window: int, step_windows: int, cost: CostModel, outlier: float = 0.25,
                  fill: float = 0.998, cap: float = 0.005, rounds: int = 8, units=None) -> ToCost:
    """Planner 2 (packkit a166061's ``pack_to_cost``, see :data:`PLANNER`): :func:`pack_to_cost` with every step
    dealt alone (a chunk of one step, its windows in the order they were opened). Kept for the states it saved
    (a run resumes on the windows it began with). At W = 8k, k = 1 it made +2.8% windows over the lower bound
    (planner 1: +1.6%), at 2k +7.1% (+3.6%): a step's run alone has too few documents to fill its gaps.
    ``steps_to_cost([4, 3, 2, 1] * 3, range(12), window=10, step_windows=2, cost=CostModel(10))`` gives one full
    step, ``[0, 1, 2], [4, 5, 6]``, and the last steps ``[3, 8], [7, 9, 10], [11]``.
    """
    return _to_cost(np.asarray(lengths, np.int64), order, window=window, S=int(step_windows), cost=cost,
                    outlier=outlier, fill=fill, cap=cap, rounds=rounds, units=units, G=1, regroup=False)


_NEVER = np.iinfo(np.int64).max  # no document is this long: :func:`_deal` never places by best fit


def _to_cost(L, order, *, window: int, S: int, cost: CostModel, outlier: float, fill: float, cap: float, rounds: int,
             units, G: int, regroup: bool) -> ToCost:
    """Planners 2 and 3 (:func:`steps_to_cost`, :func:`pack_to_cost`): steps cut, dealt ``G`` steps at a time,
    each chunk's windows cut into steps by cost when ``regroup``, the rest to :func:`greedy_to_cost`."""
    order = np.asarray(order, np.int64)
    C = cost.costs(L, units)
    Lo = L[order]
    is_out = (Lo.astype(np.float64) ** 2 / cost.cp_size) > outlier * cost.linear * window
    body, outliers = order[~is_out], order[is_out]
    per_step = S * window / max(1.0, float(Lo.mean()) if Lo.size else 1.0)  # documents a step meets, about
    ends, seeds = _cut_steps(L[body], L[outliers], np.cumsum(~is_out)[is_out], S, fill * S * window, per_step,
                             carry=regroup)
    ends, seeds = ends[:ends.size // G * G], seeds[:ends.size // G * G]  # whole chunks; the rest to the last steps
    (seg, ptr, deferred, wc), left = _fill_steps(L, C, body, outliers, ends, seeds, window=window, S=S, G=G,
                                                cap=cap, rounds=rounds, tight=max(1, window // 4) if regroup else _NEVER)
    if regroup:
        seg, ptr = _steps_by_cost(seg, ptr, wc, order, S=S, G=G)
    # -- the last steps: what no full step took, in ``order`` --
    rest = np.zeros(L.size, bool)
    rest[left] = True
    tail = order[rest[order]]
    if tail.size:
        last = greedy_to_cost(L[tail], np.arange(tail.size), window=window, step_windows=S, cost=cost,
                              outlier=outlier, units=None if units is None else np.asarray(units)[tail])
        seg = np.concatenate((seg, tail[last.seg_example]))
        ptr = np.concatenate((ptr, ptr[-1] + last.window_ptr[1:]))
        deferred += last.deferred
    return ToCost(seg_example=seg, window_ptr=ptr, queued=int(outliers.size), deferred=int(deferred))


def _fill_steps(L, C, body, outliers, ends, seeds, *, window: int, S: int, G: int, cap: float, rounds: int,
                tight: int = _NEVER):
    """``((seg_example, window_ptr, deferred, window_cost), left)``: the full steps of :func:`_to_cost` (cut by
    :func:`_cut_steps`, a whole number of chunks of ``G`` steps) filled a chunk at a time, ``left`` the documents
    they did not take (their runs past the last step, the outliers not opened, the documents still moving after
    ``rounds``). ``L``, ``C``: (n,) every document's length and cost; ``body``, ``outliers``: the stream and the
    queued documents, in order; ``tight``: see :func:`_deal`. Windows come out step by step, each step's in the
    order they were opened."""
    steps = ends.size
    chunks, B = steps // G, G * S
    # -- each step's windows, opened by its outliers (one a window, the longest first) --
    cw = np.zeros((steps, S))
    room = np.full((steps, S), window, np.int64)
    count = np.zeros((steps, S), np.int64)
    seeded = np.flatnonzero(seeds >= 0)
    first = outliers[seeds[seeded][:, None] + np.arange(S)] if seeded.size else np.zeros((0, S), np.int64)
    first = np.take_along_axis(first, np.argsort(-L[first], axis=1, kind="stable"), axis=1)
    cw[seeded], count[seeded] = C[first], 1
    room[seeded] -= L[first]
    # -- the targets: a window's chunk's mean cost; an outlier's window, its step's --
    step_of = np.repeat(np.arange(steps), np.diff(ends, prepend=0))
    docs = body[:step_of.size]
    step_cost = np.bincount(step_of, weights=C[docs], minlength=steps) + cw.sum(axis=1)
    cap_w = np.repeat((step_cost.reshape(chunks, G).sum(axis=1) / B)[:, None], B, axis=1).reshape(steps, S)
    cap_w[seeded] = (step_cost[seeded] / S)[:, None]
    cap_w *= 1.0 + cap
    placed = [(seeded[:, None] * S + np.arange(S)).ravel()]  # window (step * S + w) of each document placed, in order
    members = [first.ravel()]
    left = [body[step_of.size:], outliers[S * seeded.size:]]
    chunk_of, docs = _costliest_first(step_of // G, docs, C)
    cw, room, count, cap_w = (a.reshape(chunks, B) for a in (cw, room, count, cap_w))
    deferred = 0
    for r in range(rounds + 1):
        win = _deal(chunk_of, L[docs], C[docs], cw, room, count, cap_w, tight)
        ok = win >= 0
        placed.append(chunk_of[ok] * B + win[ok])
        members.append(docs[ok])
        chunk_of, docs = chunk_of[~ok] + 1, docs[~ok]
        on = chunk_of < chunks if r < rounds else np.zeros(docs.size, bool)  # moved past the last chunk: left
        left.append(docs[~on])
        chunk_of, docs = _costliest_first(chunk_of[on], docs[on], C)
        deferred += docs.size + left[-1].size  # a move each, into the next chunk or the last steps
        if not docs.size:
            break
    placed = np.concatenate(placed)  # window by window, each in the order it was filled: one sort of unique keys
    at = np.sort((placed << 32) | np.arange(placed.size, dtype=np.int64)) & 0xFFFFFFFF  # (window, place): a stable
    seg = np.concatenate(members)[at]  # argsort, several times faster (both fit: windows and documents < 2**31)
    return (seg, np.concatenate(([0], np.cumsum(count.ravel()))), deferred, cw.ravel()), np.concatenate(left)


def _steps_by_cost(seg, ptr, wc, order, *, S: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    """``(seg_example, window_ptr)`` of :func:`pack_to_cost`'s full steps: each chunk's ``G * S`` windows sorted by
    cost, highest first (equal ones in their order), cut into ``G`` steps, the steps in the order of their first
    document in ``order``; each window keeps its documents in their order. ``seg``, ``ptr``, ``wc``: (segments,),
    (windows + 1,), (windows,) the windows, chunk by chunk, and their costs. With ``S = 2, G = 2``, windows
    costing ``[1, 4, 3, 2]`` make the steps ``[1, 2], [3, 0]`` (as old windows) where window 3's first document
    comes before window 1's in ``order``, ``[3, 0]`` first."""
    B, nw = G * S, ptr.size - 1
    if nw == 0:
        return seg, ptr
    chunks = nw // B
    wc = wc.reshape(chunks, B)
    by_cost = np.argsort(-wc, axis=1, kind="stable")  # (chunks, B) windows, costliest first
    rank = np.empty(int(order.max()) + 1, np.int64)  # each document's place in ``order``
    rank[order] = np.arange(order.size)
    first = np.minimum.reduceat(rank[seg], ptr[:-1]).reshape(chunks, B)  # each window's first document
    step_first = np.take_along_axis(first, by_cost, axis=1).reshape(chunks, G, S).min(axis=2)
    steps = np.argsort(step_first, axis=1, kind="stable")  # (chunks, G) the chunk's steps in order
    wins = np.take_along_axis(by_cost.reshape(chunks, G, S), steps[:, :, None], axis=1)
    wins = (wins + (np.arange(chunks) * B)[:, None, None]).ravel()  # the new window order, as old windows
    counts = np.diff(ptr)[wins]
    new_ptr = np.concatenate(([0], np.cumsum(counts)))
    src = np.repeat(ptr[wins] - new_ptr[:-1], counts) + np.arange(int(new_ptr[-1]))
    return seg[src], new_ptr


def _cut_steps(body_len, out_len, out_at, S: int, budget: float, per_step: float,
               carry: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(ends, seeds)``: the full steps of :func:`pack_to_cost`, step ``s`` taking the stream documents
    ``ends[s-1]:ends[s]`` and, when ``seeds[s] >= 0``, the outliers ``seeds[s]:seeds[s] + S``.

    ``body_len``: (b,) the stream's lengths; ``out_len``, ``out_at``: (o,) each outlier's length and the stream
    documents before it. A step takes ``budget`` tokens less its outliers' (at least one document a window they
    leave empty); the next ``S`` outliers open it once the last of them is at most ``per_step`` documents past
    its start. The run that would reach the stream's end is no full step (the last steps take it). ``carry``
    (planner 3): step ``s`` ends where the stream's tokens reach the budgets of steps ``0..s``, so what a step's
    last document left short of its budget is taken by the next (else each step's run falls short of its budget
    by half a document on average: 5.5% of a step at W = 2k, k = 1). A Python loop per step, each a binary
    search: ``_cut_steps([2, 2, 2, 2, 2], [], [], 1, 4.0, 9.0) -> ([2, 4], [-1, -1])``.
    """
    ctok = np.concatenate(([0.0], np.cumsum(body_len, dtype=np.float64)))  # float: searchsorted takes a float key
    # without converting the array
    n, no = ctok.size - 1, len(out_len)
    group_len = np.asarray(out_len)[:no - no % S].reshape(-1, S).sum(axis=1).tolist()  # each group of S outliers
    last_at = np.asarray(out_at)[S - 1::S].tolist()
    ends, seeds = [], []
    pos = g = 0
    goal = 0.0  # under ``carry``, the tokens the steps so far were to take
    while True:
        seed = g < len(group_len) and last_at[g] <= pos + per_step
        room = budget - (group_len[g] if seed else 0)
        base = goal if carry else ctok[pos]
        end = max(int(ctok.searchsorted(base + room, "right")) - 1, pos + (0 if seed else S))
        if end >= n:
            break
        goal = max(base + room, ctok[end])
        ends.append(end)
        seeds.append(g * S if seed else -1)
        g += seed
        pos = end
    return np.asarray(ends, np.int64), np.asarray(seeds, np.int64)


def _costliest_first(step_of, docs, C) -> tuple[np.ndarray, np.ndarray]:
    """``(step_of, docs)`` sorted by step, then by cost, highest first (equal costs in the order given): the key is
    ``step - cost / (2 * max cost)``, so costs within 1e-9 of the largest one of each other count as equal.
    ``_costliest_first([1, 0, 0], [5, 6, 7], costs) -> ([0, 0, 1], [7, 6, 5])`` where 7 costs more than 6."""
    step_of, docs = np.asarray(step_of, np.int64), np.asarray(docs, np.int64)
    scale = 2.0 * float(C.max()) if C.size and C.max() > 0 else 1.0
    at = np.argsort(step_of - C[docs] / scale, kind="stable")
    return step_of[at], docs[at]


def _deal(step_of, n, c, cw, room, count, cap_w, tight: int = _NEVER) -> np.ndarray:
    """(m,) int64 window of each document (-1: none had room under the cap), placing the i-th document of every
    step at once; ``step_of``: (m,) grouped by step, each group in the order its documents are met; ``n``, ``c``:
    (m,) their lengths and costs. ``cw``, ``room``, ``count``, ``cap_w``: (steps, S) each window's cost, room and
    documents, updated, and its cost limit (an empty window takes any document).

    A document goes to the cheapest window with room (an empty one first; the first of equal ones), unless that
    takes it over the cap; one of at least ``tight`` tokens (planner 3: a quarter window) goes to the fullest
    window with room under the cap (best fit, so long documents pair tightly), or as the others where none is.
    Steps are ranked by their number of documents, so the steps still placing at position i are a prefix:
    position i costs a dozen numpy calls on that prefix, whatever the documents.
    ``_deal([0, 0, 0], [3, 2, 2], [3., 2., 2.], zeros((1, 2)), full((1, 2), 4), zeros((1, 2)),``
    ``full((1, 2), inf)) -> [0, 1, 1]``.
    """
    m = len(step_of)
    out = np.full(m, -1, np.int64)
    if m == 0:
        return out
    S = cw.shape[1]
    counts = np.bincount(step_of, minlength=cw.shape[0])
    ranked = np.argsort(-counts, kind="stable")
    ranked = ranked[:np.count_nonzero(counts)]
    start = (np.cumsum(counts) - counts)[ranked]  # each ranked step's first document
    active = np.searchsorted(-counts[ranked], -np.arange(counts.max()), side="left")  # steps still placing at i
    c_r, room_r, count_r, cap_r = cw[ranked], room[ranked], count[ranked], np.asarray(cap_w, np.float64)[ranked]
    c_f, room_f, count_f, cap_f = c_r.reshape(-1), room_r.reshape(-1), count_r.reshape(-1), cap_r.reshape(-1)
    base = np.arange(ranked.size) * S
    kc = np.where(count_r > 0, c_r, -1.0)  # each window's key, kept as it fills: its cost (an empty one first)
    kt = np.where(count_r > 0, room_r, -1).astype(np.float64)  # and for best fit, its room (an empty one first)
    kc_f, kt_f = kc.reshape(-1), kt.reshape(-1)
    for i, a in enumerate(active.tolist()):
        at = start[:a] + i
        ni, ci = n[at], c[at]
        w = kc[:a].argmin(axis=1)  # the cheapest window; where it has no room, the cheapest with room
        full = np.flatnonzero(room_f[base[:a] + w] < ni)
        if full.size:
            w[full] = np.where(room_r[full] >= ni[full, None], kc[full], np.inf).argmin(axis=1)
        big = np.flatnonzero(ni >= tight)  # to the fullest window it fits under the cap, if any
        if big.size:
            under = (room_r[big] >= ni[big, None]) & ((c_r[big] + ci[big, None] <= cap_r[big]) | (count_r[big] == 0))
            wb = np.where(under, kt[big], np.inf).argmin(axis=1)
            big, wb = big[under[np.arange(big.size), wb]], wb[under[np.arange(big.size), wb]]
            w[big] = wb
        f = base[:a] + w
        ok = (room_f[f] >= ni) & ((c_f[f] + ci <= cap_f[f]) | (count_f[f] == 0))
        f, ci, ni = f[ok], ci[ok], ni[ok]
        c_f[f] += ci
        room_f[f] -= ni
        count_f[f] += 1
        kc_f[f], kt_f[f] = c_f[f], room_f[f]
        out[at[ok]] = w[ok]
    cw[ranked], room[ranked], count[ranked] = c_r, room_r, count_r
    return out


def greedy_to_cost(lengths, order, *, window: int, step_windows: int, cost: CostModel,
                   outlier: float = 0.25, slack: float = 0.0, lookahead: int | None = None, units=None) -> ToCost:
    """Planner 1 (packkit before planner 2, see :data:`PLANNER`): one document at a time, in ``order``.

    Kept for the states it saved (a run resumes on the windows it began with) and for the last steps of
    :func:`pack_to_cost`. Fills each step's ``step_windows`` windows with documents taken in ``order``, to equal cost.

    ``lengths``: (n,) int64, each at most ``window``; ``order``: (m,) the documents to place, at random.
    Each document, in order, goes to the cheapest window of the step that has room for it, unless that
    would take the window over the target cost (the mean cost of a window at the lower bound of windows,
    times ``1 + slack``); a document that fits no window waits for the next step (``deferred``, it goes
    first there), and a step closes after ``lookahead`` (default ``4 * step_windows``) misses in a row.
    A document whose attention part alone exceeds ``outlier`` times a full window's linear part is
    *queued* (WLB-LLM's outlier queue): it waits until ``step_windows`` outliers are queued, and those
    open a step together, the longest first, one per window, so no rank carries one alone; what is left
    at the end opens the last steps. Every step but the last has exactly ``step_windows`` windows.
    ``units``: (n,) each document's media units, whose encoder work (``cost.per_unit``) joins its cost.
    ``greedy_to_cost([3, 3, 2, 2], [0, 1, 2, 3], window=5, step_windows=2, cost=CostModel(100))`` gives the
    windows ``[0, 2], [1, 3]``. 1M ShareGPT lengths at ``step_windows=8``, W = 32k: 2.1 s CPU (a Python loop per
    document).
    """
    L = np.asarray(lengths, np.int64)
    order = np.asarray(order, np.int64)
    S = int(step_windows)
    look = 4 * S if lookahead is None else int(lookahead)
    if look < 1:
        raise ValueError(f"lookahead must be at least 1, got {lookahead!r}")
    a, cp = cost.linear, cost.cp_size
    Lo = L[order]
    is_out = (Lo.astype(np.float64) ** 2 / cp) > outlier * a * window
    lower = max(1, -(-int(Lo.sum()) // window))
    doc_cost = cost.costs(L, units)
    target = float(doc_cost[order].sum()) / lower * (1.0 + slack)
    per_step = S * window / max(1.0, float(Lo.mean()) if Lo.size else 1.0)  # documents a step meets, about
    # -- one pass in Python, step after step (a step starts where the last one stopped). A document is a
    # (document, length, cost) triple made by numpy; the cheapest window is the top of a heap of the
    # step's window costs (floats: cheap to compare) and the first window holding that cost
    # (``list.index``), which is the original scan's choice among equal costs; runs of documents longer
    # than any window's room are missed in bulk (C-level scans, no per-document Python) --
    stream = order[~is_out]
    sn = L[stream].tolist()
    docs = zip(stream.tolist(), sn, doc_cost[stream].tolist())
    ns = len(sn)
    Ll, Cl = L.tolist(), doc_cost.tolist()
    outliers = order[is_out].tolist()
    out_at = np.cumsum(~is_out)[is_out].tolist()  # stream documents before each outlier
    queue: list[int] = []
    seg: list[int] = []
    ptr = [0]
    deferred = 0
    pos = oi = 0
    pending: list[tuple] = []
    while pos < ns or pending or oi < len(outliers) or queue:
        while oi < len(outliers) and (out_at[oi] <= pos + per_step or (pos >= ns and not pending)):
            queue.append(outliers[oi])
            oi += 1
        flush = pos >= ns and not pending and oi == len(outliers)
        cost_w, room, members, seeded = _open_step(queue, S, Ll, Cl, window, flush)
        cands, pending = pending, []
        _fill_step(itertools.chain(cands, docs), (docs, sn, pos, len(cands)), cost_w, room, members, seeded,
                   target, look, pending)
        taken = _seen(members, seeded, pending)  # documents this step looked at
        pos += max(0, taken - len(cands))
        pending += cands[taken:]
        deferred += len(pending)
        for m in members:
            if m:
                seg += m
                ptr.append(len(seg))
    return ToCost(seg_example=np.asarray(seg, np.int64), window_ptr=np.asarray(ptr, np.int64),
                  queued=len(outliers), deferred=deferred)


def _open_step(queue: list, S: int, Ll: list, Cl: list, window: int, flush: bool):
    """:func:`greedy_to_cost`: a step's empty windows ``(cost_w, room, members, seeded)``, the queued outliers opening it one a window
    (the longest first) when ``S`` of them wait, or when ``flush`` (nothing else is left) and any wait;
    ``Ll``, ``Cl``: each document's length and cost."""
    cost_w = [0.0] * S
    room = [window] * S
    members: list[list[int]] = [[] for _ in range(S)]
    seeded = 0
    if len(queue) >= S or (queue and flush):
        take = sorted(queue[:S], key=lambda d: -Ll[d])
        del queue[:len(take)]
        for w, d in enumerate(take):
            members[w].append(d)
            room[w] -= Ll[d]
            cost_w[w] = Cl[d]
        seeded = len(take)
    return cost_w, room, members, seeded


def _fill_step(todo, stream: tuple, cost_w: list, room: list, members: list, seeded: int, target: float,
               look: int, pending: list) -> None:
    """One step of :func:`greedy_to_cost`: each ``(document, length, cost)`` of ``todo`` to the cheapest window with
    room under ``target`` (the top of a heap of the window costs, the first window of that cost as a scan finds
    it), else onto ``pending``; the step closes after ``look`` misses in a row. ``stream`` is ``(docs, lengths,
    position, candidates)``, what :func:`_miss_run` needs to skip a run of documents no window has room for."""
    docs, sn, pos, ncands = stream
    replace, heapify = heapq.heapreplace, heapq.heapify
    heap = sorted(cost_w)
    index, add = cost_w.index, [m.append for m in members]
    misses = 0
    for d, n, c in todo:
        k = heap[0]
        w = index(k)
        if room[w] < n or (k + c > target and members[w]):
            if room[w] < n:
                k, w = _cheapest_with_room(n, cost_w, room)
            if w < 0 or (k + c > target and members[w]):
                pending.append((d, n, c))
                misses += 1
                if misses >= look:
                    return
                if w < 0:
                    misses = _miss_run(docs, sn, pos, _seen(members, seeded, pending) - ncands,
                                       max(room), look - misses, pending, misses)
                    if misses >= look:
                        return
                continue
            heap[heap.index(k)] = k + c
            heapify(heap)
        else:
            replace(heap, k + c)
        cost_w[w] = k + c
        room[w] -= n
        add[w](d)
        misses = 0


def _cheapest_with_room(n: int, cost_w: list, room: list) -> tuple[float, int]:
    """``(cost, window)`` of the cheapest window with ``room`` for ``n`` tokens (the first of equal ones, as a scan
    in window order finds it), or ``(0.0, -1)``: ``_cheapest_with_room(3, [5.0, 1.0, 1.0], [9, 2, 3]) -> (1.0, 2)``."""
    if n > max(room):
        return 0.0, -1
    return min(itertools.compress(zip(cost_w, itertools.count()), map(n.__le__, room)))


def _seen(members, seeded: int, pending) -> int:
    """Documents a step of :func:`greedy_to_cost` has looked at: placed (less the queued ones it opened with) and missed."""
    return sum(map(len, members)) - seeded + len(pending)


def _miss_run(docs, sn, pos: int, past: int, room: int, most: int, pending, misses: int) -> int:
    """Miss, in one go, the stream documents after the first ``pos + past`` that are longer than ``room`` (so fit
    no window), up to ``most`` of them: ``docs`` moves past them, ``pending`` takes their triples; returns
    ``misses`` plus their number. ``past`` below 0 (the step is still on its deferred documents): none."""
    if past < 0:
        return misses
    at = pos + past
    run = next(itertools.compress(itertools.count(), map(room.__ge__, sn[at:at + most])), None)
    run = min(most, len(sn) - at) if run is None else run
    if run:
        pending += itertools.islice(docs, run)
    return misses + run


#: Each cost-target planner a sampler state may name (:data:`PLANNER` the newest), by number.
PLANNERS = {1: greedy_to_cost, 2: steps_to_cost, 3: pack_to_cost}


def sequence_to_cost(sampler, plan, rng, step: int) -> dict:
    """The epoch of a :class:`~packkit.sampler.PackedBatchSampler` under ``balance="compute"`` at one or two windows a
    rank: its windows built ``step`` at a time to a cost target by the sampler's planner (:func:`pack_to_cost`, or the
    older one a resumed run began with), in a seeded random order of the examples ``plan`` keeps. Returns the fields of
    its sequence: ``flat``, ``ptr`` (the windows' offsets), ``full``, ``plan`` (the windows as a
    :class:`~packkit.binpack.Plan`), ``dropped``, ``queued``, ``deferred``."""
    kept = np.ones(sampler.lengths.size, bool)
    kept[plan.dropped_examples] = False
    order = np.flatnonzero(kept)
    if sampler.shuffle:
        order = order[rng.permutation(order.size)]
    used = sampler._lengths_used()
    planner = pack_to_cost if sampler._planner == PLANNER else PLANNERS[sampler._planner]  # a run resumed keeps its
    # windows
    tc = planner(used, order, window=sampler.window, step_windows=step, cost=sampler.cost, units=sampler.media_units)
    nw = tc.window_ptr.size - 1
    full = nw // step * step
    if full == 0 and sampler.drop_last:
        raise ValueError(
            f"the documents make {nw} windows, fewer than one step of step_batches x windows_per_batch = "
            f"{step}: pass drop_last=False or fewer windows_per_batch"
        )
    seg, ptr = tc.seg_example, tc.window_ptr
    dropped = int(plan.dropped_examples.size)
    if full < nw and sampler.drop_last:
        dropped += int(ptr[nw] - ptr[full])
        seg, ptr = seg[:ptr[full]], ptr[:full + 1]
    windows = dataclasses.replace(plan, seg_example=seg, seg_start=np.zeros(seg.size, np.int64),
                                  seg_length=used[seg], window_ptr=ptr, strategy="to_cost")
    return {"flat": seg, "ptr": ptr, "full": full, "plan": windows, "dropped": dropped, "queued": tc.queued,
            "deferred": tc.deferred}
