"""Property tests of the packing engine against slow, obvious item-by-item references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from packkit.binpack import OVERFLOW_POLICIES, STRATEGIES, Plan, apply_overflow, as_lengths, lower_bound, pack
from packkit.segments import lengths_to_offsets

# ----------------------------------------------------------------------------------------------
# references: one item at a time, a Python list of window loads, nothing clever
# ----------------------------------------------------------------------------------------------


def ref_items(lengths, window, overflow):
    """(example, start, length) items per the overflow policy, in example order."""
    items = []
    for i, n in enumerate(lengths):
        if n <= window:
            items.append((i, 0, n))
        elif overflow == "truncate":
            items.append((i, 0, window))
        elif overflow == "split":
            for s in range(0, n, window):
                items.append((i, s, min(window, n - s)))
        elif overflow == "drop":
            continue
        else:
            raise ValueError("over-long")
    return items


def ref_fit(items, window, rule):
    """Assign items (in the given order) to windows; returns a list of windows of items."""
    windows, loads = [], []
    for item in items:
        n = item[2]
        fits = [w for w in range(len(windows)) if loads[w] + n <= window]
        if rule == "next":
            fits = [len(windows) - 1] if windows and loads[-1] + n <= window else []
        if not fits:
            windows.append([item])
            loads.append(n)
            continue
        w = min(fits, key=lambda w: (window - loads[w], w)) if rule == "best" else fits[0]
        windows[w].append(item)
        loads[w] += n
    return windows


def ref_pack(lengths, window, strategy, overflow, seed=0):
    items = ref_items(list(lengths), window, overflow)
    if strategy == "next_fit":
        return ref_fit(items, window, "next")
    # The planner lists its items as the examples first, then the second and later pieces of split
    # examples; ties in the decreasing sort and the random order are over that list.
    items = [it for it in items if it[1] == 0] + [it for it in items if it[1] > 0]
    if strategy in ("bfd", "ffd"):
        items = sorted(items, key=lambda it: -it[2])  # stable: ties keep list order
        return ref_fit(items, window, "best" if strategy == "bfd" else "first")
    if strategy == "shuffle_ff":
        perm = np.random.default_rng(seed).permutation(len(items))
        return ref_fit([items[i] for i in perm], window, "first")
    raise ValueError(strategy)


def plan_windows(plan: Plan):
    return [
        list(zip(*(a.tolist() for a in plan.segments(w)))) for w in range(plan.num_windows)
    ]


# ----------------------------------------------------------------------------------------------
# drawn inputs: the awkward lengths (1, W, W + 1, 2W + 1), non-power-of-two windows, skew
# ----------------------------------------------------------------------------------------------

WINDOWS = st.one_of(
    st.sampled_from([1, 2, 3, 7, 8, 16, 17, 33, 64, 65, 100, 127, 129, 257, 1025]),
    st.integers(1, 300),
)


@st.composite
def lengths_and_window(draw, max_factor=3, max_size=60):
    window = draw(WINDOWS)
    special = st.sampled_from(sorted({1, window, window + 1, 2 * window + 1, max(1, window // 2)}))
    body = st.one_of(
        st.integers(1, max(1, window * max_factor)),  # anything, including over-long
        st.integers(1, max(1, window // 8)),  # short
        special,
    )
    lengths = draw(st.lists(body, min_size=0, max_size=max_size))
    if draw(st.booleans()) and lengths:  # very skewed: one length repeated
        lengths = lengths + [lengths[0]] * draw(st.integers(0, 40))
    return np.asarray(lengths, dtype=np.int64), window


def check_invariants(plan: Plan, lengths: np.ndarray, window: int, overflow: str):
    """Nothing lost, capacity, pieces reassemble, honest counts."""
    assert plan.window_ptr[0] == 0 and plan.window_ptr[-1] == plan.num_segments
    assert np.all(np.diff(plan.window_ptr) >= 1), "an empty window"
    assert np.all(plan.seg_length >= 1)
    loads = plan.window_loads
    assert np.all(loads <= window), f"window over capacity: {loads.max()} > {window}"
    over = np.flatnonzero(lengths > window)
    assert np.array_equal(plan.overflow_examples, over)

    # every token of every kept example placed exactly once: sort pieces by (example, start)
    o = np.lexsort((plan.seg_start, plan.seg_example))
    ex, start, n = plan.seg_example[o], plan.seg_start[o], plan.seg_length[o]
    expected = {
        "split": lengths,
        "truncate": np.minimum(lengths, window),
        "drop": np.where(lengths > window, 0, lengths),
        "error": lengths,
    }[overflow]
    placed = np.bincount(ex, weights=n, minlength=lengths.size).astype(np.int64)
    assert np.array_equal(placed, expected), "tokens lost or duplicated"
    # pieces of one example are contiguous and start at 0
    first = np.r_[True, ex[1:] != ex[:-1]] if ex.size else ex.astype(bool)
    prev_end = np.r_[0, start[:-1] + n[:-1]] if ex.size else ex
    assert np.all(start[first] == 0)
    assert np.all(start[~first] == prev_end[~first]), "split pieces do not reassemble"
    cut = int(lengths.sum() - expected.sum())
    assert plan.cut_tokens == cut
    assert plan.total_tokens == int(expected.sum())
    if overflow == "drop":
        assert np.array_equal(plan.dropped_examples, over)
    else:
        assert plan.dropped_examples.size == 0
    assert plan.num_windows >= plan.lower_bound


# Edge cases pinned for CI's fixed seed: no examples; window 1; one example far over a window of 1;
# all examples equal to the window; 2W + 1 next to W and W + 1.
EDGE_CASES = [
    (np.zeros(0, np.int64), 1),
    (np.array([1, 1, 1]), 1),
    (np.array([3]), 1),
    (np.array([5] * 8), 5),
    (np.array([15, 7, 8, 1]), 7),
]


def edge_examples(**fixed):
    """``@example`` decorators for every EDGE_CASES entry, with ``fixed`` as the other arguments."""
    def decorate(test):
        for case in reversed(EDGE_CASES):
            test = example(data=case, **fixed)(test)
        return test
    return decorate


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(data=lengths_and_window(), overflow=st.sampled_from(["split", "truncate", "drop"]))
@edge_examples(overflow="split")
@edge_examples(overflow="truncate")
@edge_examples(overflow="drop")
def test_invariants_and_reference(strategy, data, overflow):
    lengths, window = data
    plan = pack(lengths, window=window, strategy=strategy, overflow=overflow, seed=3)
    check_invariants(plan, lengths, window, overflow)
    ref = ref_pack(lengths, window, strategy, overflow, seed=3)
    got = plan_windows(plan)
    assert plan.num_windows == len(ref)
    if strategy == "bfd":
        # which of several windows with equal room takes an item is a free choice; it cannot change
        # any later decision, so the multiset of loads is the same as the reference's
        assert sorted(plan.window_loads.tolist()) == sorted(sum(x[2] for x in w) for w in ref)
    else:
        assert got == [[tuple(x) for x in w] for w in ref]


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "shuffle_ff"])
@given(data=lengths_and_window())
@edge_examples()
def test_no_two_windows_could_be_merged(strategy, data):
    """Any-fit rules never leave two windows whose loads sum to W or less."""
    lengths, window = data
    plan = pack(lengths, window=window, strategy=strategy, overflow="split")
    loads = np.sort(plan.window_loads)
    if loads.size >= 2:
        assert loads[0] + loads[1] > window


@given(data=lengths_and_window())
@edge_examples()
def test_next_fit_no_two_adjacent_windows_could_be_merged(data):
    lengths, window = data
    plan = pack(lengths, window=window, strategy="next_fit", overflow="split")
    loads = plan.window_loads
    assert np.all(loads[:-1] + loads[1:] > window)
    # order-preserving: reading the windows in order gives the examples (and pieces) in order
    assert np.all(np.diff(plan.seg_example) >= 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(data=lengths_and_window(), seed=st.integers(0, 2**32 - 1))
@edge_examples(seed=0)
def test_deterministic(strategy, data, seed):
    lengths, window = data
    a = pack(lengths, window=window, strategy=strategy, overflow="split", seed=seed)
    b = pack(lengths.tolist(), window=window, strategy=strategy, overflow="split", seed=seed)
    for f in ("seg_example", "seg_start", "seg_length", "window_ptr"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    sa, sb = a.shuffled(seed), b.shuffled(seed)
    assert np.array_equal(sa.seg_example, sb.seg_example)
    assert np.array_equal(sa.window_ptr, sb.window_ptr)


@given(data=lengths_and_window(), seed=st.integers(0, 1000))
@edge_examples(seed=5)
def test_shuffled_is_a_permutation_of_windows(data, seed):
    lengths, window = data
    plan = pack(lengths, window=window, overflow="split")
    shuffled = plan.shuffled(seed)
    check_invariants(shuffled, lengths, window, "split")
    before = sorted(tuple(map(tuple, zip(*(a.tolist() for a in plan.segments(w))))) for w in range(plan.num_windows))
    after = sorted(tuple(map(tuple, zip(*(a.tolist() for a in shuffled.segments(w))))) for w in range(shuffled.num_windows))
    assert before == after


def test_fast_bfd_matches_reference_window_count_on_sft_like_lengths():
    """The grouped planner is item-by-item best fit: same number of windows on realistic data."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, 3000)), 8, 4096).astype(np.int64)
    for window in (512, 2048, 2049):
        plan = pack(lengths, window=window, overflow="split")
        ref = ref_pack(lengths, window, "bfd", "split")
        print(f"W={window}: fast {plan.num_windows}, reference {len(ref)}, lower bound {plan.lower_bound}")
        assert plan.num_windows == len(ref)
        assert sorted(plan.window_loads.tolist()) == sorted(sum(x[2] for x in w) for w in ref)


def test_bfd_near_lower_bound_at_scale():
    """Best fit over the whole dataset: at most 0.01% windows over ceil(tokens / W)."""
    rng = np.random.default_rng(1)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, 200_000)), 8, 4096).astype(np.int64)
    plan = pack(lengths, window=2048, overflow="split")
    excess = (plan.num_windows - plan.lower_bound) / plan.lower_bound
    print(plan)
    assert excess <= 1e-4
    check_invariants(plan, lengths, 2048, "split")


# ----------------------------------------------------------------------------------------------
# documented examples and regressions
# ----------------------------------------------------------------------------------------------


def test_docstring_example():
    plan = pack([5, 3, 4, 2], window=8)
    assert [w.tolist() for w in plan.windows()] == [[0, 1], [2, 3]]
    assert (plan.num_windows, plan.lower_bound, plan.fill) == (2, 2, 14 / 16)


def test_window_of_two_to_the_k_plus_one():
    """Regression (TRL #3887): packing failed at window sizes of 2^k + 1."""
    for k in range(1, 12):
        window = 2**k + 1
        lengths = np.arange(1, 3 * window, 7)
        plan = pack(lengths, window=window, overflow="split")
        check_invariants(plan, lengths, window, "split")


def test_examples_longer_than_twice_the_window_split_and_reassemble():
    """Regression (torchtune #1697): samples longer than twice the window broke splitting."""
    lengths = np.array([5, 25, 2 * 8 + 1, 8, 3 * 8, 1])
    for strategy in STRATEGIES:
        plan = pack(lengths, window=8, strategy=strategy, overflow="split")
        check_invariants(plan, lengths, 8, "split")
        pieces = plan.seg_length[plan.seg_example == 1]
        assert sorted(pieces.tolist()) == [1, 8, 8, 8]


def test_overflow_counts_are_reported():
    lengths = [3, 10, 4, 20]
    t = pack(lengths, window=8, overflow="truncate")
    assert t.truncated_examples.tolist() == [1, 3] and t.cut_tokens == 2 + 12
    d = pack(lengths, window=8, overflow="drop")
    assert d.dropped_examples.tolist() == [1, 3] and d.cut_tokens == 30 and d.total_tokens == 7
    s = pack(lengths, window=8, overflow="split")
    assert s.split_examples.tolist() == [1, 3] and s.cut_tokens == 0 and s.total_tokens == 37
    assert s.summary()["overflow_examples"] == 2


def test_window_of_one():
    plan = pack([1, 1, 1], window=1)
    assert plan.num_windows == 3 == plan.lower_bound


def test_empty_input_gives_an_empty_plan():
    plan = pack([], window=16)
    assert plan.num_windows == 0 and plan.lower_bound == 0 and plan.fill == 1.0


def test_accepts_numpy_list_and_torch():
    a = pack(np.array([3, 5, 2], dtype=np.int32), window=8)
    b = pack(torch.tensor([3, 5, 2]), window=8)
    c = pack([3.0, 5.0, 2.0], window=8)
    assert [w.tolist() for w in a.windows()] == [w.tolist() for w in b.windows()] == [w.tolist() for w in c.windows()]


def test_plan_is_frozen():
    plan = pack([3, 5, 2], window=8)
    with pytest.raises(Exception):
        plan.window = 3
    with pytest.raises(ValueError):
        plan.seg_length[0] = 99


def test_select_and_segments():
    plan = pack([5, 3, 4, 2], window=8)
    sub = plan.select([1])
    assert sub.num_windows == 1 and sub.seg_example.tolist() == [2, 3]
    assert plan.segments(-1)[0].tolist() == [2, 3]
    with pytest.raises(IndexError):
        plan.segments(2)


def test_select_rejects_repeated_and_out_of_range_windows():
    """Before the fix, select([0, 0]) silently duplicated a window's tokens."""
    plan = pack([5, 3, 4, 2], window=8)
    with pytest.raises(ValueError, match="twice"):
        plan.select([0, 0])
    with pytest.raises(IndexError, match="window 7 out of range"):
        plan.select([1, 7])
    assert plan.select([]).num_windows == 0
    assert plan.select([0, 0], allow_repeats=True).total_tokens == 16


def test_lower_bound_function():
    assert lower_bound([5, 3, 4], window=8) == 2


# ----------------------------------------------------------------------------------------------
# bad input: a clear error that names what and where
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, exc, words",
    [
        ([3, 0, 2], ValueError, "example 1 has length 0"),
        ([3, -4], ValueError, "example 1 has length -4"),
        ([3, 2.5], ValueError, "lengths[1] = 2.5"),
        ([3, float("nan")], ValueError, "lengths[1] = nan"),
        ([1, [2, 3]], TypeError, "lengths[1] is a list"),
        ([[1, 2], [3]], TypeError, "lengths[0] is a list"),
        (np.ones((2, 2), int), TypeError, "must be 1-D"),
        ([1, True], TypeError, "lengths[1] is True"),
        (["3"], TypeError, "must be integers"),
        (5, TypeError, "1-D sequence"),
    ],
)
def test_bad_lengths(lengths, exc, words):
    with pytest.raises(exc, match=None) as info:
        pack(lengths, window=8)
    assert words in str(info.value), str(info.value)


def test_over_long_error_names_example_and_fix():
    with pytest.raises(ValueError) as info:
        pack([3, 9310, 2, 9000], window=8192)
    msg = str(info.value)
    assert "example 1 has 9,310 tokens > window=8192" in msg and "overflow='split'" in msg
    assert "and 1 more" in msg
    cli = info.value.render({"window": ("--window", True), "overflow": ("--overflow", True)})
    assert "> --window 8192" in cli and "pass --overflow split, truncate or drop, or raise --window" in cli


def test_window_upper_bound_is_checked_before_any_allocation(monkeypatch):
    """Before the fix, `-w 1099511627776` tried to allocate 8 TiB (a table of window + 1 entries) and
    `waste -w 2147483648` was killed by the OOM killer. check_window bounds the window with the reason;
    PACKKIT_MAX_WINDOW moves the bound."""
    from packkit.binpack import MAX_WINDOW, check_window
    from packkit.errors import ArgumentError

    assert MAX_WINDOW == 2**24 and check_window(2**24) == 2**24
    for w in (2**24 + 1, 2**31, 2**40):
        with pytest.raises(ArgumentError, match=r"window=%d is above the largest window packkit accepts, "
                                                r"16,777,216 tokens: .*PACKKIT_MAX_WINDOW" % w):
            pack([1, 2], window=w)
    monkeypatch.setenv("PACKKIT_MAX_WINDOW", "64")
    assert check_window(64) == 64
    with pytest.raises(ArgumentError, match="largest window packkit accepts, 64 tokens: PACKKIT_MAX_WINDOW"):
        check_window(65)
    monkeypatch.setenv("PACKKIT_MAX_WINDOW", "lots")
    with pytest.raises(ArgumentError, match="PACKKIT_MAX_WINDOW must be a positive integer"):
        check_window(8)


@pytest.mark.parametrize("seed, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_seed_names_seed(seed, exc):
    with pytest.raises(exc, match="seed must be (at least 0|an integer), got"):
        pack([1, 2], window=4, seed=seed)


@pytest.mark.parametrize("window, exc", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_bad_window(window, exc):
    with pytest.raises(exc, match="window"):
        pack([1, 2], window=window)


def test_unknown_strategy_and_policy():
    with pytest.raises(ValueError, match="unknown strategy 'best'.*bfd"):
        pack([1], window=4, strategy="best")
    with pytest.raises(ValueError, match="unknown overflow policy 'cut'.*truncate"):
        pack([1], window=4, overflow="cut")
    with pytest.raises(TypeError, match="seed"):
        pack([1], window=4, seed=1.5)


def test_as_lengths_returns_int64():
    assert as_lengths([1, 2]).dtype == np.int64
    assert OVERFLOW_POLICIES[0] == "error"


# ----------------------------------------------------------------------------------------------
# the overflow policy's one home, and lengths -> offsets
# ----------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=0, max_size=30), st.integers(1, 12),
       st.sampled_from(["truncate", "split", "drop"]), st.booleans())
@example([], 1, "split", True)  # no examples
@example([40, 1], 1, "split", False)  # window 1: forty one-token pieces, then the next example
@example([12, 12], 12, "drop", True)  # exactly the window: kept
@example([40], 3, "split", True)  # one example split in order (pack_stream's every split): its own short path
def test_apply_overflow_matches_reference(lengths, window, overflow, in_order):
    """Both layouts hold the reference's items; in_order lists them as the reference does; the
    planners' layout lists every example's first piece at its index, the later pieces after."""
    p = apply_overflow(lengths, window=window, overflow=overflow, in_order=in_order)
    got = list(zip(p.example.tolist(), p.start.tolist(), p.length.tolist()))
    ref = ref_items(lengths, window, overflow)
    if in_order:
        assert got == ref
    else:
        assert sorted(got) == sorted(ref)
        if overflow != "drop":
            assert [g[0] for g in got[:len(lengths)]] == list(range(len(lengths)))
    over = [i for i, n in enumerate(lengths) if n > window]
    assert p.overflow_examples.tolist() == over
    assert p.dropped_examples.tolist() == (over if overflow == "drop" else [])
    assert p.cut_tokens == sum(lengths) - sum(it[2] for it in ref)


def test_apply_overflow_error_names_the_example_with_its_offset():
    with pytest.raises(ValueError, match=r"example 41 has 9 tokens > window=4.*overflow='split'"):
        apply_overflow([3, 9], window=4, overflow="error", first=40)
    assert apply_overflow([3, 4], window=4, overflow="error").length.tolist() == [3, 4]


def test_lengths_to_offsets():
    assert lengths_to_offsets([2, 4, 3]).tolist() == [0, 2, 6, 9]
    assert lengths_to_offsets([]).tolist() == [0] and lengths_to_offsets([]).dtype == np.int64
    big = lengths_to_offsets(np.full(3, 2**31, np.int64))  # int64: no wrap past int32
    assert big[-1] == 3 * 2**31
    with pytest.raises(TypeError, match="integers"):
        lengths_to_offsets([1.5])
