"""The passes behind ``packkit plan`` (the goal that no figure of benchmarks/ regresses): each test pins a cost that made
``plan_budget`` on the dealt schedule slower than the figures it replaced, found by cProfile and line timing
(benchmarks/RESULTS.md, "plan_budget reading the dealt epoch faster", engineer budget).
"""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packkit import balance, binpack, budget, csr, epoch, sampler
from packkit.balance import CostModel
from packkit.binpack import pack
from packkit.budget import AdviceOptions, plan_budget
from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, select_batches
from packkit.segments import lengths_to_offsets

QUIET = AdviceOptions(warn=False)


def chat_like(n: int, seed: int = 0) -> np.ndarray:
    """Lengths like ShareGPT's: lognormal, a few past 16 bits (the longest example 221,070 tokens there)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(600), 1.2, n), 1, 60_000).astype(np.int64)
    lengths[rng.choice(n, 3, replace=False)] = [70_000, 221_070, 65_535]
    return lengths


@given(lengths=st.lists(st.integers(0, 70_000) | st.integers(65_533, 65_537) | st.integers(1, 2**40),
                        min_size=1, max_size=60), rows=st.integers(1, 3))
def test_longest_first_is_a_stable_sort_by_minus_length(lengths, rows):
    """The reference: numpy's stable sort of -length, row by row (ties in the given order)."""
    x = np.array(lengths * rows, np.int64).reshape(rows, -1)
    x[-1] = x[-1][::-1]
    assert sampler.longest_first(x).tolist() == np.argsort(-x, axis=-1, kind="stable").tolist()
    assert sampler.longest_first(x[0]).tolist() == np.argsort(-x[0], kind="stable").tolist()


def test_megabatches_sorted_in_one_radix_pass(monkeypatch):
    """sort_megabatches sorted ``top - length`` keys, past 16 bits as soon as one length is (ShareGPT's are): two
    radix passes over every megabatch (22 ms of plan --padded's then 45). Then one radix argsort of 16-bit keys
    (1.3 ms on 64,000 shuffled ShareGPT lengths, the sampler's largest cost); now no argsort over the megabatches:
    one sort of unique 32-bit keys, length and position (0.5 ms), the same order."""
    lengths = chat_like(5000)
    calls = []
    real = np.argsort

    def spy(a, *args, **kwargs):
        calls.append((np.asarray(a).size, np.asarray(a).dtype))
        return real(a, *args, **kwargs)

    monkeypatch.setattr(sampler.np, "argsort", spy)
    s = LengthGroupedSampler(lengths, batch_size=8, step_batches=4, world_size=2, rank=0)
    s.schedule()
    assert [c for c in calls if c[0] >= 4000] == [], calls
    seq = s._sequence(0, s.seed, s._step_units)
    for b in range(seq.full):  # each batch longest first, as a stable sort leaves it
        batch = lengths[seq.flat[seq.ptr[b]:seq.ptr[b + 1]]]
        assert (np.diff(batch) <= 0).all()


@pytest.mark.parametrize("width", [1, 2, 3, 64, 1000])
def test_longest_first_at_the_32_bit_edge(width):
    """The 32-bit keys hold a length below ``2 ** (32 - bits of a position)``; at and past it, the radix pass."""
    cap = (1 << (32 - max(1, (width - 1).bit_length()))) - 1
    rng = np.random.default_rng(width)
    for top in (cap - 1, cap, cap + 1):
        x = rng.choice([1, cap - 1, cap, top, 5], size=(3, width))
        assert sampler.longest_first(x).tolist() == np.argsort(-x, axis=-1, kind="stable").tolist()
        order = rng.permutation(x.size)
        got = sampler.sort_megabatches(order, x.reshape(-1), width + 1)
        want = np.concatenate([c[np.argsort(-x.reshape(-1)[c], kind="stable")]
                               for c in np.split(order, range(width + 1, x.size, width + 1))])
        assert got.tolist() == want.tolist()


def test_steps_in_sequence_order_are_a_slice(monkeypatch):
    """A schedule dealt in sequence order (every policy but balance="compute") gathered every entry again through
    range_index; the batches in place are a slice of the sequence."""
    def fail(*args):
        raise AssertionError("range_index called for batches in place")

    flat, ptr = np.arange(10) * 3, np.array([0, 2, 5, 9, 10])
    monkeypatch.setattr(csr, "range_index", fail)
    got, got_ptr = select_batches(flat, ptr, [1, 2])
    assert got.tolist() == [6, 9, 12, 15, 18, 21, 24] and got_ptr.tolist() == [0, 3, 7]


def test_plan_reads_the_lengths_through_the_schedule_once(monkeypatch):
    """epoch_stats and plan_budget's report each gathered the dealt lengths (units.tokens[flat], a random gather of
    every example) and summed them per batch; the schedule remembers both for the read-only lengths it was asked."""
    made = []
    real = sampler.Schedule._remembered

    def spy(self, what, values, make):
        read_only = not values.flags.writeable  # the lengths (the squares, made anew, are summed once anyway)
        return real(self, what, values, lambda: (made.append(what) if read_only else None) or make())

    monkeypatch.setattr(sampler.Schedule, "_remembered", spy)
    plan_budget(chat_like(3000), per_device_batch=4, accumulation_steps=2, world_size=4, advice=QUIET)
    assert sorted(made) == ["longest", "sums", "take"]


@pytest.mark.parametrize("packed", [False, True])
def test_plan_gathers_the_callers_own_lengths_once(monkeypatch, packed):
    """The caller's lengths (writable: the schedule remembers only read-only arrays) were gathered through the schedule
    twice, by epoch_stats (from the sampler's copy) and by the report (from the caller's array), each gather summed
    per batch and padded its longest again (1 ms of plan --padded's 12 on 70,180 ShareGPT lengths); packed, the
    sampler made min(L, W) anew at each read. The report reads the sampler's own lengths: one gather, one sum per
    batch, one longest."""
    made = []
    real = sampler.Schedule._remembered
    monkeypatch.setattr(sampler.Schedule, "_remembered",
                        lambda self, what, values, make: real(self, what, values, lambda: made.append(what) or make()))
    kw = {"window": 4096, "overflow": "split"} if packed else {}
    lengths = chat_like(3000)
    assert lengths.flags.writeable
    plan_budget(lengths, per_device_batch=4, accumulation_steps=2, world_size=4, advice=QUIET, **kw)
    assert sorted(made) == sorted(["sums", "take"] + ([] if packed else ["longest"])), made  # (squares: square_sums)


def test_stats_sum_lengths_not_costs(monkeypatch):
    """epoch_stats made a cost per example (five arrays of every example), read it through the schedule and
    summed it; the cost of a rank's step is the model over its sums of L and L^2 (CostModel.of_sums)."""
    def fail(*args, **kwargs):
        raise AssertionError("a cost per example")

    lengths = chat_like(2000)
    expected = LengthGroupedSampler(lengths, batch_size=4, world_size=4, rank=0, step_batches=8, cp_size=2)
    expected = expected.schedule().per_step(CostModel(cp_size=2).costs(lengths[expected.schedule().flat]))
    monkeypatch.setattr(balance.CostModel, "costs", fail)
    s = LengthGroupedSampler(lengths, batch_size=4, world_size=4, rank=0, step_batches=8, cp_size=2)
    assert s.epoch_stats().compute_imbalance == pytest.approx(balance.compute_imbalance(expected), rel=1e-12)


@given(lengths=st.lists(st.integers(1, 300_000), min_size=1, max_size=40), cp=st.integers(1, 4),
       per_unit=st.sampled_from([0.0, 7.5]))
def test_of_sums_is_the_sum_of_costs(lengths, cp, per_unit):
    L = np.array(lengths)
    units = np.arange(L.size) % 3
    model = CostModel(linear=24576.0, cp_size=cp, per_unit=per_unit)
    got = model.of_sums([L.sum()], [(L.astype(float) ** 2).sum()], [units.sum()])
    assert got[0] == pytest.approx(model.costs(L, units).sum(), rel=1e-12)


def test_no_window_costs_unless_steps_are_balanced_by_them(monkeypatch):
    """Both samplers summed a cost per batch (or window) to order the steps under balance="tokens"/"sqlen" only,
    and made it under every policy."""
    calls, real = [], sampler._BatchSampler._policy_cost
    monkeypatch.setattr(sampler._BatchSampler, "_policy_cost",
                        lambda self, *a, **k: calls.append(type(self).__name__) or real(self, *a, **k))
    lengths = chat_like(1000)
    for balance in (None, "tokens"):
        kw = {} if balance is None else {"balance": balance}
        LengthGroupedSampler(lengths, batch_size=4, world_size=2, rank=0, **kw).schedule()
        PackedBatchSampler(np.minimum(lengths, 4096), window=4096, windows_per_batch=2, world_size=2, rank=0,
                           **kw).schedule()
        if balance is None:
            assert calls == [], calls
    assert calls, "the probe never ran: balance='tokens' orders steps by _policy_cost"


def test_shuffled_windows_selected_once(monkeypatch):
    """The packed sampler took the plan's windows twice (Plan.shuffled, then the steps' order): one selection."""
    lengths = np.minimum(chat_like(2000), 4096)
    taken = []
    real = binpack.Plan._take
    monkeypatch.setattr(binpack.Plan, "_take", lambda self, order: taken.append(order.size) or real(self, order))
    s = PackedBatchSampler(lengths, window=4096, windows_per_batch=2, world_size=2, rank=0, step_batches=4, seed=3)
    assert len(taken) == 1
    monkeypatch.setattr(binpack.Plan, "_take", real)
    p = pack(lengths, window=4096)
    seed = int(np.random.default_rng((3, 0)).integers(1 << 62))
    order = np.random.default_rng(5).permutation(p.num_windows)
    assert p.select(p.shuffle_order(seed)[order]).seg_example.tolist() == \
        p.shuffled(seed).select(order).seg_example.tolist()
    assert s.plan().num_windows == p.num_windows


def test_offsets_of_many_lengths_make_no_temporary():
    """lengths_to_offsets assigned a cumsum into its result: a temporary the size of the result (1.04 ms against
    0.34 ms on 70,180 lengths). Past 16,384 lengths the sum goes into the result."""
    lengths = np.ones(1_000_000, np.int64)
    lengths_to_offsets(lengths[:10])  # (numpy's first-call allocations outside the measure)
    tracemalloc.start()
    out = lengths_to_offsets(lengths)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out[-1] == 1_000_000 and peak < 1.25 * out.nbytes


def test_plan_budget_figures_as_the_sampler_deals_them():
    """The faster passes keep part 4: the report's compute imbalance is the sampler's own, padded and packed."""
    lengths = chat_like(3000)
    for kw, make in (({}, lambda: LengthGroupedSampler(lengths, batch_size=4, world_size=4, rank=0, step_batches=8)),
                     ({"window": 4096}, None)):
        r = plan_budget(lengths, per_device_batch=4, accumulation_steps=2, world_size=4, advice=QUIET, **kw)
        if make is not None:
            assert r.compute_imbalance == make().epoch_stats().compute_imbalance
        assert r.tokens_per_step.mean > 0 and budget.Spread.of([1, 3]).mean == 2.0


def test_the_figures_sampler_reads_the_lengths_without_a_copy():
    """The sampler dealing plan's and waste's figures copied the lengths (a fresh array of every example each call,
    0.3 ms of plan --padded's); it lives for one figure, so it reads them through a read-only view, and the caller's
    array stays writable."""
    lengths = chat_like(3000)
    for kw in ({}, {"window": 300_000}):
        s = epoch.deal(lengths, per_rank=4, **kw)
        assert np.shares_memory(s.lengths, lengths) and not s.lengths.flags.writeable
    assert lengths.flags.writeable


def test_a_schedule_dealt_in_sequence_order_is_a_view_of_it():
    """The schedule concatenated its batches into a new array though, dealt in sequence order, they lie end to end in
    the sequence already (a copy of every entry a plan); under balance="compute" they are gathered, as before."""
    lengths = chat_like(3000)
    s = LengthGroupedSampler(lengths, batch_size=4, world_size=4, rank=0, step_batches=8)
    seq = s._sequence(0, s.seed, s._step_units)
    assert np.shares_memory(s.schedule().flat, seq.flat)
    assert sorted(s.schedule().flat.tolist()) == list(range(lengths.size))
    c = LengthGroupedSampler(lengths, batch_size=4, world_size=4, rank=0, step_batches=8, balance="compute")
    assert not np.shares_memory(c.schedule().flat, c._sequence(0, c.seed, c._step_units).flat)
    assert sorted(c.schedule().flat.tolist()) == list(range(lengths.size))


def test_no_loss_per_unit_without_loss_counts(monkeypatch):
    """With no loss counts a unit's loss is its tokens less one: plan made that array of every unit (and counted its
    zeros twice) though it reads only its sum, its zeros and, per step, tokens less entries. The examples per step
    summed a first-piece flag over every entry; now the later pieces of split examples are found where they fall."""
    real = epoch.loss_of
    monkeypatch.setattr(epoch, "loss_of", lambda *a, **k: pytest.fail("a loss per unit made"))
    sums = []
    real_sums = epoch.Dealt.sums
    monkeypatch.setattr(epoch.Dealt, "sums", lambda self, v, taken=False: sums.append(taken) or real_sums(self, v,
                                                                                                          taken=taken))
    lengths = chat_like(3000)
    pieces = -(-lengths // 4096)  # split into pieces of at most 4096, each with one token that is not a target
    for kw, units in (({}, lengths.size), ({"window": 4096, "overflow": "split"}, int(pieces.sum()))):
        r = plan_budget(lengths, per_device_batch=4, accumulation_steps=2, world_size=4, advice=QUIET, **kw)
        assert r.loss_tokens == r.num_tokens - units
    assert sums == [True, True], sums  # the tokens, read through the schedule already
    monkeypatch.setattr(epoch, "loss_of", real)
    units = epoch.padded_units(epoch.read_lengths_object(lengths), row_round=1, drop_loss_free=False)
    assert units.loss.tolist() == (lengths - 1).tolist() and units.free == int((lengths == 1).sum())


def test_plan_padded_holds_few_arrays_of_every_example():
    """Each array of every example a plan holds at once is fresh memory the kernel clears page by page (half of
    plan --padded's system time on 70,180 ShareGPT lengths). 4528c1c peaked at 7.2x the lengths' bytes (the sampler's
    copy, the loss of every unit, the schedule concatenated, the keys of the sort as int64, a sequence beside the
    permutation); now about 4.2x."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(600), 1.2, 200_000), 1, 60_000).astype(np.int64)
    lengths[:3] = [70_000, 221_070, 65_535]
    kw = dict(per_device_batch=8, accumulation_steps=4, world_size=8, advice=QUIET)
    plan_budget(lengths, **kw)  # (numpy's first-call allocations outside the measure)
    tracemalloc.start()
    plan_budget(lengths, **kw)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5 * lengths.nbytes, peak / lengths.nbytes


@given(values=st.lists(st.floats(-1e12, 1e12, allow_nan=False) | st.integers(0, 300_000), min_size=1, max_size=60))
def test_spread_is_numpys_mean_and_std(values):
    """Spread.of computes numpy's mean and std itself (the same sums, without numpy's dispatch, a third of its
    time): equal to the last bit."""
    v = np.array(values, dtype=np.float64)
    s = budget.Spread.of(v)
    assert (s.mean, s.std, s.min, s.max) == (float(v.mean()), float(v.std()), float(v.min()), float(v.max()))


@given(lengths=st.lists(st.integers(1, 300_000) | st.integers(1, 60), min_size=1, max_size=300),
       batch=st.integers(1, 9), world=st.integers(1, 4), balance=st.sampled_from([None, "compute"]))
def test_square_sums_are_float_squares_summed(lengths, batch, world, balance):
    """epoch_stats squared every dealt length into a fresh float64 array to sum it per batch; the batches of one size
    are summed by einsum over the integers, with no such array: the same sums to the bit."""
    L = np.array(lengths, np.int64)
    sched = LengthGroupedSampler(L, batch_size=batch, world_size=world, rank=0, balance=balance).schedule()
    lens = L[sched.flat]
    want = [float((lens[a:b].astype(np.float64) ** 2).sum()) for a, b in zip(sched.ptr[:-1], sched.ptr[1:])]
    assert sched.square_sums(lens).tolist() == want
