"""Batch samplers: coverage, equal steps across simulated ranks, budgets, determinism, resuming.

Ranks are simulated by building one sampler per rank with explicit ``rank``/``world_size``; the real
multi-process run lives in ``test_sampler_distributed.py``. Each helper is checked against a slow,
obvious reference written here.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.sampler import (
    LengthGroupedSampler,
    PackedBatchSampler,
    TokenBudgetBatchSampler,
    arrange_steps,
    budget_batch_bounds,
    lengths_from_dataset,
    resolve_rank,
    select_batches,
    split_pieces,
    sort_megabatches,
    stable_argsort,
)

# ----------------------------------------------------------------------------------------------
# slow references
# ----------------------------------------------------------------------------------------------


def ref_sort_megabatches(order, lengths, size):
    """Blocks of ``size``, each sorted longest first, ties in the given order (Python's sort is stable)."""
    out = []
    for i in range(0, len(order), size):
        out += sorted(order[i:i + size], key=lambda j: -lengths[j])
    return out


def ref_budget_bounds(sorted_lengths, max_tokens, block, max_batch_size=None):
    """Greedy, one example at a time: add while (count + 1) x first length fits and the block goes on."""
    bounds, count, first = [0], 0, None
    for i, length in enumerate(sorted_lengths):
        new_block = i % block == 0 and i > 0
        cap_hit = max_batch_size is not None and count == max_batch_size
        if count and (new_block or cap_hit or (count + 1) * first > max_tokens):
            bounds.append(i)
            count = 0
        if count == 0:
            first = length
        count += 1
    bounds.append(len(sorted_lengths))
    return bounds


def ref_next_fit_windows(lengths, window):
    """Windows next-fit makes over ``lengths`` in order (what FixedWindowCollator(strategy='next_fit') does)."""
    windows, room = 0, 0
    for length in lengths:
        if length > room:
            windows += 1
            room = window
        room -= length
    return windows


def run_ranks(make, world_size):
    """Batches of every simulated rank, and each rank's sampler."""
    samplers = [make(rank=r, world_size=world_size) for r in range(world_size)]
    return [list(s) for s in samplers], samplers


def flat(batches_per_rank):
    return [i for batches in batches_per_rank for b in batches for i in b]


SAMPLERS = {
    "grouped": lambda L, **kw: LengthGroupedSampler(L, batch_size=3, **kw),
    "budget": lambda L, **kw: TokenBudgetBatchSampler(L, max_tokens=64, **kw),
    "packed": lambda L, **kw: PackedBatchSampler(L, window=64, windows_per_batch=2, **kw),
    "packed_ff": lambda L, **kw: PackedBatchSampler(L, window=64, windows_per_batch=2, strategy="shuffle_ff", **kw),
}

lengths_st = st.lists(st.integers(1, 64), min_size=1, max_size=80)


# ----------------------------------------------------------------------------------------------
# helpers against their references
# ----------------------------------------------------------------------------------------------


@given(lengths=st.lists(st.integers(1, 70_000) | st.integers(65_536 - 2, 300_000) | st.integers(1, 2**33),
                        min_size=1, max_size=60), size=st.integers(1, 9), seed=st.integers(0, 99))
def test_sort_megabatches_matches_reference(lengths, size, seed):
    order = np.random.default_rng(seed).permutation(len(lengths))
    got = sort_megabatches(order, np.array(lengths), size).tolist()
    assert got == ref_sort_megabatches(order.tolist(), lengths, size)


@given(keys=st.lists(st.integers(0, 5) | st.integers(0, 2**17) | st.integers(2**16 - 2, 2**16 + 2)
                     | st.integers(0, 2**32 - 1) | st.integers(2**32, 2**40), min_size=1, max_size=64),
       rows=st.integers(1, 4))
def test_stable_argsort_is_numpys_stable_sort(keys, rows):
    """Keys of 16, 32 and more bits (two radix passes under 2**32): numpy's merge sort order, row by row."""
    key = np.array(keys * rows, np.int64).reshape(rows, -1)
    assert stable_argsort(key).tolist() == np.argsort(key, axis=-1, kind="stable").tolist()
    assert stable_argsort(key[0]).tolist() == np.argsort(key[0], kind="stable").tolist()


@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=60), max_tokens=st.integers(50, 200),
       block=st.integers(1, 20), cap=st.none() | st.integers(1, 6))
def test_budget_batch_bounds_matches_reference(lengths, max_tokens, block, cap):
    order = sort_megabatches(np.arange(len(lengths)), np.array(lengths), block)
    seq = np.array(lengths)[order]
    got = budget_batch_bounds(seq, max_tokens=max_tokens, block=block, max_batch_size=cap).tolist()
    assert got == ref_budget_bounds(seq.tolist(), max_tokens, block, cap)


def test_small_helpers_examples():
    values, ptr = select_batches(np.array([7, 8, 9]), np.array([0, 2, 3]), [1, 0, 1])
    assert values.tolist() == [9, 7, 8, 9] and ptr.tolist() == [0, 1, 3, 4]
    assert arrange_steps(np.array([1, 5, 2, 6]), 2, None, shuffle=False, balance=True).tolist() == [3, 1, 2, 0]
    pieces, repeated = split_pieces([np.array([3, 4, 5])], 2)
    assert [p.tolist() for p in pieces] == [[3], [4, 5]] and repeated == 0
    pieces, repeated = split_pieces([np.array([3])], 2)
    assert [p.tolist() for p in pieces] == [[3], [3]] and repeated == 1
    assert resolve_rank(1, 4) == (1, 4) and resolve_rank(None, None) == (0, 1)


# ----------------------------------------------------------------------------------------------
# coverage and equal steps across ranks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SAMPLERS))
@settings(max_examples=40)
@given(lengths=lengths_st, world_size=st.integers(1, 4), drop_last=st.booleans(), seed=st.integers(0, 9),
       epoch=st.integers(0, 3), balance=st.sampled_from([None, "tokens", "sqlen", "compute"]))
# world size larger than the data: one example for four ranks, kept (repeated) or refused by name
@example(lengths=[5], world_size=4, drop_last=False, seed=0, epoch=0, balance=None)
@example(lengths=[5], world_size=4, drop_last=True, seed=0, epoch=0, balance="tokens")
@example(lengths=[64] * 3, world_size=4, drop_last=False, seed=1, epoch=1, balance="sqlen")  # all full windows
@example(lengths=[1] * 80, world_size=3, drop_last=True, seed=2, epoch=3, balance=None)  # all equal, one-token
def test_coverage_and_equal_steps(kind, lengths, world_size, drop_last, seed, epoch, balance):
    make = SAMPLERS[kind]

    def build(**kw):
        s = make(lengths, seed=seed, drop_last=drop_last, balance=balance, **kw)
        s.set_epoch(epoch)
        return s

    try:
        per_rank, samplers = run_ranks(build, world_size)
    except ValueError as exc:  # drop_last with less than one full step is refused, by name
        assert drop_last and "drop_last=False" in str(exc)
        return
    stats = samplers[0].epoch_stats()
    counts = [len(b) for b in per_rank]
    print("steps per rank", counts, stats)
    assert len(set(counts)) == 1 and counts[0] == stats.steps >= 1
    assert all(len(s) == stats.steps for s in samplers)
    assert all(len(b) >= 1 for batches in per_rank for b in batches)
    seen = collections.Counter(flat(per_rank))
    n = len(lengths)
    extra = sum(c - 1 for c in seen.values())
    assert extra == stats.repeated
    assert n - len(seen) == stats.dropped
    assert set(seen) <= set(range(n))
    if drop_last:
        assert stats.repeated == 0
    else:
        assert stats.dropped == 0 and len(seen) == n  # every example, at least once
    assert stats.tokens == sum(lengths[i] * c for i, c in seen.items())
    # the remainder policy touches less than one step's worth
    if kind == "grouped":
        assert stats.dropped < world_size * 3 and stats.repeated < world_size
    elif kind == "budget":
        assert stats.repeated < world_size
    if kind.startswith("packed"):
        plan = samplers[0].plan()  # the windows of the epoch's sequence, the same for every world size
        assert (plan.window_loads <= 64).all()
        assert sorted(plan.seg_example.tolist()) == sorted(seen)


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_every_example_once_without_a_tail(kind):
    """When the data fill whole steps, every index appears exactly once over the ranks."""
    lengths = [8] * 96  # 8 tokens: packed windows of 64 hold 8 each -> 12 windows = 3 steps of 2 x 2
    per_rank, samplers = run_ranks(lambda **kw: SAMPLERS[kind](lengths, **kw), 2)
    assert sorted(flat(per_rank)) == list(range(96))
    assert samplers[0].epoch_stats().repeated == samplers[0].epoch_stats().dropped == 0


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_the_callers_lengths_array_stays_writable(kind):
    """A sampler (and so ``plan_budget``, which builds one) set the caller's own int64 lengths array read-only, so
    the user's next ``lengths[i] = n`` failed far from packkit; it now keeps a copy of its own, read-only, and a
    later change to the caller's array changes nothing of the sampler's epoch."""
    from packkit.budget import AdviceOptions, plan_budget

    lengths = np.full(96, 8, dtype=np.int64)
    sampler = SAMPLERS[kind](lengths, world_size=1, rank=0, seed=0)
    plan_budget(lengths, per_device_batch=2, advice=AdviceOptions(warn=False))
    assert lengths.flags.writeable
    before = [list(b) for b in sampler]
    lengths[:] = 40
    assert [list(b) for b in sampler] == before and not sampler.lengths.flags.writeable


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80), max_tokens=st.integers(300, 900),
       cap=st.none() | st.integers(1, 5), world_size=st.integers(1, 3), drop_last=st.booleans())
@settings(max_examples=40)
@example(lengths=[300], max_tokens=300, cap=1, world_size=3, drop_last=False)  # fewer examples than ranks
@example(lengths=[300] * 3, max_tokens=300, cap=None, world_size=3, drop_last=True)
def test_token_budget_respected(lengths, max_tokens, cap, world_size, drop_last):
    try:
        per_rank, _ = run_ranks(lambda **kw: TokenBudgetBatchSampler(
            lengths, max_tokens=max_tokens, max_batch_size=cap, drop_last=drop_last, **kw), world_size)
    except ValueError:
        assert drop_last
        return
    for batches in per_rank:
        for b in batches:
            padded = len(b) * max(lengths[i] for i in b)
            assert padded <= max_tokens, (b, padded)
            assert cap is None or len(b) <= cap


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=60), batch_size=st.integers(1, 7),
       world_size=st.integers(1, 3))
@settings(max_examples=40)
@example(lengths=[1], batch_size=7, world_size=3)  # fewer examples than ranks
@example(lengths=[4] * 7, batch_size=7, world_size=1)  # one full batch of equal lengths
def test_length_grouped_batch_sizes(lengths, batch_size, world_size):
    """Full batches everywhere but the last step, whose batches hold what is left (at most batch_size
    each, as even as the examples allow, one batch per rank)."""
    per_rank, _ = run_ranks(lambda **kw: LengthGroupedSampler(lengths, batch_size=batch_size, **kw),
                            world_size)
    for s in range(len(per_rank[0])):
        sizes = {len(batches[s]) for batches in per_rank}
        if s < len(per_rank[0]) - 1:
            assert sizes == {batch_size}
        else:
            assert max(sizes) <= batch_size and min(sizes) >= 1


@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=80), k=st.integers(1, 4),
       strategy=st.sampled_from(["bfd", "shuffle_ff"]), overflow=st.sampled_from(["truncate", "drop"]))
@settings(max_examples=40)
@example(lengths=[90], k=1, strategy="bfd", overflow="drop")  # the only example dropped
@example(lengths=[64] * 4, k=4, strategy="shuffle_ff", overflow="truncate")
def test_packed_batches_refit_into_k_windows(lengths, k, strategy, overflow):
    """The collator's next-fit over a batch's examples needs at most k windows (its contract)."""
    window = 64
    s = PackedBatchSampler(lengths, window=window, windows_per_batch=k, strategy=strategy, overflow=overflow)
    plan = s.plan()
    assert (plan.window_loads <= window).all()
    for b in s:
        assert ref_next_fit_windows([min(lengths[i], window) for i in b], window) <= k
    assert s.epoch_stats().dropped == sum(1 for x in lengths if x > window) * (overflow == "drop")


# ----------------------------------------------------------------------------------------------
# determinism and resuming
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_deterministic_and_reshuffled_by_epoch(kind):
    lengths = np.random.default_rng(1).integers(1, 64, size=300).tolist()
    make = SAMPLERS[kind]
    a, b = make(lengths, seed=3), make(lengths, seed=3)
    first = list(a)
    assert first == list(b) == list(a)  # same seed: same batches; a second pass repeats the epoch
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a)
    assert second == list(b)
    assert second != first
    assert list(make(lengths, seed=4)) != first
    if kind in ("grouped", "budget"):  # the same examples each epoch, in another order
        assert sorted(flat([first])) == sorted(flat([second]))


@pytest.mark.parametrize("kind", list(SAMPLERS))
@settings(max_examples=25)
@given(lengths=st.lists(st.integers(1, 64), min_size=2, max_size=120), world_size=st.integers(1, 3),
       stop=st.integers(0, 200), epoch=st.integers(0, 2), data=st.data())
@example(lengths=[1, 1], world_size=3, stop=0, epoch=0, data=None)  # fewer examples than ranks
@example(lengths=[64, 64], world_size=3, stop=1, epoch=2, data=None)
def test_resume_yields_exactly_the_rest(kind, lengths, world_size, stop, epoch, data):
    rank = world_size - 1 if data is None else data.draw(st.integers(0, world_size - 1))
    make = SAMPLERS[kind]
    s = make(lengths, seed=7, rank=rank, world_size=world_size)
    s.set_epoch(epoch)
    full = list(s)
    stop = stop % (len(full) + 1)
    s.set_epoch(epoch)
    it = iter(s)
    head = [next(it) for _ in range(stop)]
    state = s.state_dict()
    assert state["batches_yielded"] == stop and head == full[:stop]

    fresh = make(lengths, seed=7, rank=rank, world_size=world_size)
    fresh.load_state_dict(state)
    fresh.set_epoch(epoch)  # the loop's set_epoch for the resumed epoch keeps the position
    assert len(fresh) == len(full) - stop
    rest = list(fresh)
    assert rest == full[stop:]
    assert len(fresh) == len(full) and list(fresh) == full  # the pass after that is the whole epoch again


def test_state_dict_batches_consumed_and_next_epoch():
    lengths = list(range(1, 41))
    s = LengthGroupedSampler(lengths, batch_size=4, seed=1)
    full = list(s)
    it = iter(s)
    for _ in range(6):  # a prefetching loader ran ahead of the training loop
        next(it)
    state = s.state_dict(batches_consumed=2)
    t = LengthGroupedSampler(lengths, batch_size=4, seed=1)
    t.load_state_dict(state)
    assert list(t) == full[2:]
    t.load_state_dict(state)
    t.set_epoch(1)  # moving on to another epoch drops the resume position
    assert len(t) == len(full)
    with pytest.raises(ValueError, match="batches_consumed"):
        s.state_dict(batches_consumed=len(full) + 1)


def test_load_state_dict_refuses_a_different_setup():
    lengths = list(range(1, 41))
    state = LengthGroupedSampler(lengths, batch_size=4, rank=0, world_size=2).state_dict()
    LengthGroupedSampler(lengths, batch_size=4).load_state_dict(state)  # another world size: elastic
    with pytest.raises(ValueError, match="other lengths or options"):
        LengthGroupedSampler(lengths[::-1], batch_size=4, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="other lengths or options"):
        LengthGroupedSampler(lengths, batch_size=5, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="LengthGroupedSampler"):
        TokenBudgetBatchSampler(lengths, max_tokens=64, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(KeyError, match="lacks the field 'fingerprint'"):
        LengthGroupedSampler(lengths, batch_size=4).load_state_dict({"sampler": "LengthGroupedSampler"})


@pytest.mark.parametrize("field, value, exc, match", [
    ("epoch", -3, ValueError, "field 'epoch': must be at least 0, got -3"),
    ("epoch", 1.5, TypeError, r"field 'epoch': must be an integer, got 1.5 \(float\)"),
    ("seed", -1, ValueError, "field 'seed': must be at least 0, got -1"),
    ("seed", "7", TypeError, "field 'seed'"),
    ("batches_yielded", 10_000, ValueError, r"field 'batches_yielded': 10000 is more than the epoch's "),
    ("batches_yielded", -1, ValueError, "field 'batches_yielded'"),
    ("batches_yielded", None, TypeError, "field 'batches_yielded': must be an integer"),
    ("world_size", 0, ValueError, "field 'world_size'"),
    ("fingerprint", "0" * 40, ValueError, "field 'fingerprint'"),
    ("sampler", "PackedBatchSampler", ValueError, "field 'sampler'"),
])
def test_failed_load_leaves_the_sampler_as_it_was(field, value, exc, match):
    """Before the fix, load_state_dict assigned epoch -3 before checking it, so a failed load left a sampler
    that then raised on iteration, and the message named no field. Every field is checked first now."""
    lengths = list(range(1, 81))
    s = LengthGroupedSampler(lengths, batch_size=4, seed=9)
    s.set_epoch(2)
    it = iter(s)
    next(it)
    before = (s.seed, s.epoch, len(s), s.state_dict())
    good = LengthGroupedSampler(lengths, batch_size=4, seed=9).state_dict()
    with pytest.raises(exc, match=match):
        s.load_state_dict({**good, field: value})
    assert (s.seed, s.epoch, len(s), s.state_dict()) == before
    rest = list(it)  # the pass in progress goes on untouched
    assert len(rest) == s.batches_per_epoch - 1
    s.load_state_dict(good)  # and a good state still loads
    assert s.seed == 9 and s.epoch == 0
    with pytest.raises(TypeError, match="must be the dict state_dict"):
        s.load_state_dict([("epoch", 1)])


# ----------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls,kw", [(LengthGroupedSampler, {"batch_size": 4}),
                                    (TokenBudgetBatchSampler, {"max_tokens": 400})])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_longest_first(cls, kw, seed):
    lengths = np.random.default_rng(seed).integers(1, 100, size=200)
    lengths[137] = 250
    for world_size in (1, 2):
        per_rank, _ = run_ranks(lambda **k: cls(lengths, seed=seed, longest_first=True, **kw, **k), world_size)
        assert any(137 in batches[0] for batches in per_rank)
    without = list(cls(lengths, seed=seed, **kw))
    assert sum(137 in b for b in without) == 1


def test_balance_by_squared_length_evens_out_attention_cost():
    """Heavy-tailed lengths: grouping windows of similar attention cost per step cuts the imbalance."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.5, 1.2, size=4000).astype(int), 1, 1024)
    kw = dict(window=1024, windows_per_batch=2, world_size=4, rank=0)
    plain = PackedBatchSampler(lengths, **kw).epoch_stats()
    balanced = PackedBatchSampler(lengths, balance="sqlen", **kw).epoch_stats()
    print("imbalance: plain (tokens)", plain.step_imbalance, "balanced (sqlen)", balanced.step_imbalance)
    assert balanced.step_imbalance < 0.05
    assert balanced.steps == plain.steps
    grouped = LengthGroupedSampler(lengths, batch_size=8, world_size=4, rank=0, balance="sqlen").epoch_stats()
    assert grouped.step_imbalance < 0.05


def test_unbalanced_packed_steps_are_measurably_uneven():
    """The imbalance figure can fail: random windows by attention cost are uneven across 4 ranks."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.5, 1.2, size=4000).astype(int), 1, 1024)
    s = PackedBatchSampler(lengths, window=1024, windows_per_batch=2, world_size=4, rank=0, balance="sqlen")
    balanced = s.epoch_stats().step_imbalance
    # same windows, steps formed in random order: recompute the sqlen imbalance by hand
    plan = PackedBatchSampler(lengths, window=1024, windows_per_batch=2, world_size=1).plan()
    sq = np.array([int((plan.segments(i)[2] ** 2).sum()) for i in range(plan.num_windows)])
    full = sq.size // 8 * 8
    per_step = sq[:full].reshape(-1, 4, 2).sum(axis=2)
    random_imbalance = per_step.max(axis=1).sum() / per_step.mean(axis=1).sum() - 1
    print("random", random_imbalance, "balanced", balanced)
    assert random_imbalance > 4 * balanced


def test_shuffle_false_is_sorted_and_stable():
    lengths = [3, 9, 1, 7, 5, 2]
    s = LengthGroupedSampler(lengths, batch_size=2, megabatch_mult=3, shuffle=False)
    assert list(s) == [[1, 3], [4, 0], [5, 2]]
    assert list(PackedBatchSampler([5, 3, 4, 2], window=8, shuffle=False)) == [[0, 1], [2, 3]]


def test_waste_matches_transformers_grouping_on_the_same_permutation():
    """Same permutation, same megabatch: packkit's batches hold the lengths of transformers' batches.

    transformers also swaps the longest example into the first batch; the two batches it touches are
    left out of the comparison.
    """
    torch = pytest.importorskip("torch")
    tpu = pytest.importorskip("transformers.trainer_pt_utils")
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, size=4000).tolist()
    B, mult = 8, 10
    g = torch.Generator().manual_seed(5)
    theirs = tpu.get_length_grouped_indices(lengths, B, mega_batch_mult=mult, generator=g)
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(5)).numpy()
    ours = sort_megabatches(perm, np.array(lengths), B * mult).tolist()
    L = np.array(lengths)
    a = [sorted(L[theirs[i:i + B]]) for i in range(0, len(L), B)]
    b = [sorted(L[ours[i:i + B]]) for i in range(0, len(L), B)]
    megabatch_max = [max(L[perm[i:i + B * mult]]) for i in range(0, len(L), B * mult)]
    touched = {0, int(np.argmax(megabatch_max)) * mult}
    diffs = [i for i in range(len(a)) if a[i] != b[i] and i not in touched]
    assert not diffs, diffs[:5]


# ----------------------------------------------------------------------------------------------
# DataLoader, datasets, bad input
# ----------------------------------------------------------------------------------------------


def test_dataloader_batch_sampler():
    torch = pytest.importorskip("torch")
    lengths = np.random.default_rng(0).integers(1, 64, size=50)
    ds = [{"idx": i, "input_ids": list(range(int(n)))} for i, n in enumerate(lengths)]
    for sampler in (LengthGroupedSampler(lengths, batch_size=4, dataset=ds),
                    TokenBudgetBatchSampler(lengths, max_tokens=128, dataset=ds),
                    PackedBatchSampler(lengths, window=64, windows_per_batch=2, dataset=ds)):
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=lambda xs: [x["idx"] for x in xs])
        assert len(loader) == len(sampler)
        assert list(loader) == list(sampler)


def test_lengths_from_dataset():
    datasets = pytest.importorskip("datasets")
    rows = [[1, 2], [3], [4, 5, 6], [7, 8, 9, 10]]
    ds = datasets.Dataset.from_dict({"input_ids": rows}).select([3, 0, 2])
    assert lengths_from_dataset(ds).tolist() == [4, 2, 3]
    assert lengths_from_dataset([{"input_ids": r} for r in rows]).tolist() == [2, 1, 3, 4]
    s = LengthGroupedSampler(dataset=ds, batch_size=2)
    assert s.lengths.tolist() == [4, 2, 3]
    with pytest.raises(KeyError, match="labels"):
        lengths_from_dataset(ds, key="labels")


@pytest.mark.parametrize("make,match", [
    (lambda: LengthGroupedSampler([], batch_size=2), "empty"),
    (lambda: LengthGroupedSampler([1, 2], batch_size=0), "batch_size must be at least 1"),
    (lambda: LengthGroupedSampler([1, 2], batch_size=True), "batch_size"),
    (lambda: LengthGroupedSampler([1, 0, 2], batch_size=2), "example 1 has length 0"),
    (lambda: LengthGroupedSampler([1, 2, 3], batch_size=2, dataset=[{}] * 4), "3 entries but the dataset has 4"),
    (lambda: LengthGroupedSampler([1, 2, 3], batch_size=4, drop_last=True), "drop_last=False"),
    (lambda: TokenBudgetBatchSampler([5, 9, 30, 2], max_tokens=16), "example 2 has 30 tokens > max_tokens=16"),
    (lambda: PackedBatchSampler([5, 9, 30], window=16), "example 2 has 30 tokens > window=16"),
    (lambda: PackedBatchSampler([5, 9], window=16, overflow="split"), "split long examples offline"),
    (lambda: PackedBatchSampler([5, 9], window=16, strategy="next_fit"), "strategy"),
    (lambda: PackedBatchSampler([5, 9], window=0), "window must be at least 1"),
    (lambda: LengthGroupedSampler([1, 2], batch_size=1, rank=2, world_size=2), "rank must be"),
    (lambda: LengthGroupedSampler([1, 2], batch_size=1, rank=1), "pass both, or neither"),
    (lambda: LengthGroupedSampler([1, 2], batch_size=1, balance="flops"), "balance"),
])
def test_bad_input_is_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_single_example_many_ranks_repeats_and_reports():
    """One example, four ranks: each rank still gets one batch, and the three repeats are reported."""
    per_rank, samplers = run_ranks(lambda **kw: LengthGroupedSampler([5], batch_size=2, **kw), 4)
    assert per_rank == [[[0]]] * 4
    assert samplers[0].epoch_stats().repeated == 3


def test_packed_sampler_feeds_fixed_window_collator():
    """End to end: every batch of the sampler becomes exactly k windows of W, with all its tokens."""
    torch = pytest.importorskip("torch")
    collate = pytest.importorskip("packkit.collate")
    window, k = 32, 3
    lengths = np.random.default_rng(0).integers(1, window + 1, size=120)
    ds = [{"input_ids": np.arange(1, n + 1)} for n in lengths]  # ids >= 1, padding is 0
    sampler = PackedBatchSampler(lengths, window=window, windows_per_batch=k, seed=2)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate.FixedWindowCollator(
        window=window, strategy="next_fit", num_windows=k))
    total = 0
    for batch, indices in zip(loader, sampler):
        assert tuple(batch["input_ids"].shape) == (k, window)
        real = int((batch["input_ids"] != 0).sum())
        assert real == int(lengths[indices].sum())
        total += real
    assert total == int(lengths.sum())
