"""Planner 1 of the cost-target packer (:func:`packkit.balance.greedy_to_cost`: the windows of states saved
without a "planner" field, and planner 2's last steps; planner 2 is tested in test_balance_planner.py) against the
one-document-at-a-time loop it replaced (``ref_pack_to_cost``, below, as it stood at 5803dad): the same windows,
queued and deferred counts, bit for bit, on drawn lengths (ties, windows of one token, lookaheads of one,
outliers) and on real chat lengths (long runs of documents that fit no window, missed in bulk).

The cause of the 3.55 s for 1M documents at k = 1: a Python scan over the step's windows for every document
met (deferred ones again in the next step). Today the cheapest window is a heap's top and runs of misses are
scanned by C-level iterators; ``test_no_scan_per_document`` keeps the per-window scan from coming back.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from packkit import balance
from packkit.balance import CostModel, greedy_to_cost


def ref_pack_to_cost(lengths, order, *, window, step_windows, cost, outlier=0.25, slack=0.0, lookahead=None):
    """The loop of 5803dad, verbatim but for the return: ``(seg_example, window_ptr, queued, deferred)``."""
    L = np.asarray(lengths, np.int64)
    order = np.asarray(order, np.int64)
    S = int(step_windows)
    look = 4 * S if lookahead is None else int(lookahead)
    a, cp = cost.linear, cost.cp_size
    Lo = L[order]
    is_out = (Lo.astype(np.float64) ** 2 / cp) > outlier * a * window
    lower = max(1, -(-int(Lo.sum()) // window))
    target = float(cost.costs(Lo).sum()) / lower * (1.0 + slack)
    per_step = S * window / max(1.0, float(Lo.mean())) if Lo.size else float(S * window)
    Ll = L.tolist()
    stream = order[~is_out].tolist()
    outliers = order[is_out].tolist()
    out_at = np.cumsum(~is_out)[is_out].tolist()
    queue, seg, ptr, pending = [], [], [0], []
    deferred = pos = oi = 0
    while pos < len(stream) or pending or oi < len(outliers) or queue:
        while oi < len(outliers) and (out_at[oi] <= pos + per_step or (pos >= len(stream) and not pending)):
            queue.append(outliers[oi])
            oi += 1
        cost_w = [0.0] * S
        room = [window] * S
        members = [[] for _ in range(S)]
        if len(queue) >= S or (queue and pos >= len(stream) and not pending and oi == len(outliers)):
            take = sorted(queue[:S], key=lambda d: -Ll[d])
            del queue[:len(take)]
            for w, d in enumerate(take):
                members[w].append(d)
                room[w] -= Ll[d]
                cost_w[w] = a * Ll[d] + Ll[d] * Ll[d] / cp
        misses = ci = 0
        cands, pending = pending, []
        while misses < look:
            if ci < len(cands):
                d = cands[ci]
                ci += 1
            elif pos < len(stream):
                d = stream[pos]
                pos += 1
            else:
                break
            n = Ll[d]
            c = a * n + n * n / cp
            best, best_cost = -1, 0.0
            for w in range(S):
                if room[w] >= n and (best < 0 or cost_w[w] < best_cost):
                    best, best_cost = w, cost_w[w]
            if best < 0 or (members[best] and best_cost + c > target):
                pending.append(d)
                misses += 1
                continue
            misses = 0
            members[best].append(d)
            room[best] -= n
            cost_w[best] += c
        pending += cands[ci:]
        deferred += len(pending)
        for m in members:
            if m:
                seg += m
                ptr.append(len(seg))
    return seg, ptr, len(outliers), deferred


def assert_same(lengths, order, **kw):
    want = ref_pack_to_cost(lengths, order, **kw)
    got = greedy_to_cost(lengths, order, **kw)
    assert got.seg_example.tolist() == want[0]
    assert got.window_ptr.tolist() == want[1]
    assert (got.queued, got.deferred) == want[2:]


@st.composite
def packer_inputs(draw):
    window = draw(st.sampled_from([1, 2, 7, 64, 97, 256]))
    # few distinct lengths: equal window costs, so ties between windows, are common
    pool = draw(st.lists(st.integers(1, window), min_size=1, max_size=6))
    lengths = np.array(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=300)), np.int64)
    order = np.array(draw(st.permutations(range(lengths.size))), np.int64)
    order = order[:draw(st.integers(0, order.size))]
    kw = dict(window=window, step_windows=draw(st.integers(1, 9)),
              cost=CostModel(linear=draw(st.sampled_from([0.5, 3.0, 100.0, 24576.0])), cp_size=draw(st.integers(1, 3))),
              outlier=draw(st.sampled_from([0.01, 0.25, 4.0])), slack=draw(st.sampled_from([-0.2, 0.0, 0.1])),
              lookahead=draw(st.sampled_from([None, 1, 2, 5, 40])))
    return lengths, order, kw


@given(packer_inputs())
@example((np.array([3, 3, 2, 2]), np.array([0, 1, 2, 3]), dict(window=5, step_windows=2, cost=CostModel(100))))
def test_same_plan_as_the_document_loop(case):
    lengths, order, kw = case
    assert_same(lengths, order, **kw)


@pytest.mark.parametrize("window,step_windows,cp", [(32768, 8, 1), (8192, 8, 1), (32768, 16, 2), (4096, 2, 1)])
def test_same_plan_on_chat_lengths(window, step_windows, cp):
    """Real chat lengths (the bundled sample, drawn to 20,000 with replacement): steps end in long runs of
    misses, the case the bulk scan takes."""
    lengths = chat_sample(20_000, window, window + step_windows)
    assert_same(lengths, np.random.default_rng(cp).permutation(lengths.size), window=window, step_windows=step_windows,
                cost=CostModel(24576.0, cp_size=cp))


def chat_sample(n: int, window: int, seed: int) -> np.ndarray:
    """The bundled chat sample's lengths times 4 (a 32k-window regime), drawn ``n`` times with replacement."""
    sample = np.load(os.path.join(os.path.dirname(balance.__file__), "data", "sample_lengths.npy")).astype(np.int64)
    return np.minimum(sample[np.random.default_rng(seed).integers(0, sample.size, n)] * 4, window)


def test_no_scan_per_document(monkeypatch):
    """Regression: the packer scanned every window of the step for every document it met
    (1M documents at k = 1: 3.55 s). Now a document that goes to the cheapest window costs no scan and a run
    of documents that fit no window one C-level pass; the scan (``_cheapest_with_room``) runs for the
    documents the cheapest window has no room for: about 13% of those met here, at most a quarter."""
    calls = []
    real = balance._cheapest_with_room
    monkeypatch.setattr(balance, "_cheapest_with_room", lambda *a: calls.append(1) or real(*a))
    lengths = chat_sample(20_000, 32768, 0)
    out = greedy_to_cost(lengths, np.random.default_rng(1).permutation(lengths.size), window=32768, step_windows=8,
                       cost=CostModel(24576.0))
    met = lengths.size + out.deferred
    print(f"{len(calls)} scans for {met} documents met")
    assert 0 < len(calls) < 0.25 * met
