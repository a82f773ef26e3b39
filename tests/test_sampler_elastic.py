"""Elastic resume: a state saved on one world size loads on any other, and the run goes on with every
example exactly once.

The check is against the uninterrupted run's coverage (every example once), counted with numpy over
the schedules (``sampler.schedule()`` lists every rank's batches as one CSR array), so ten thousand
random resumes take seconds (two thousand under ``ci``, ten thousand under ``thorough``). Where the new world size divides the global step, the global steps after
the interrupted one are compared with the uninterrupted run's, example set by example set.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from testlib import thorough

from packkit.sampler import (
    LengthGroupedSampler,
    PackedBatchSampler,
    ResumeWarning,
    TokenBudgetBatchSampler,
)

KINDS = {
    "packed2": lambda L, **kw: PackedBatchSampler(L, window=64, windows_per_batch=2, **kw),
    "packed3": lambda L, **kw: PackedBatchSampler(L, window=64, windows_per_batch=3, **kw),
    "packed1": lambda L, **kw: PackedBatchSampler(L, window=64, windows_per_batch=1, **kw),
    "grouped": lambda L, **kw: LengthGroupedSampler(L, batch_size=3, **kw),
    "budget": lambda L, **kw: TokenBudgetBatchSampler(L, max_tokens=96, **kw),
}
POLICIES = [None, "tokens", "sqlen", "compute"]


def consumed(sched, rows: int) -> np.ndarray:
    """Examples of the first ``rows`` rows of a schedule, over every rank."""
    return sched.flat[:sched.ptr[rows * sched.world_size]]


def step_sets(sched) -> dict[int, frozenset]:
    """Example set of each whole step of a schedule, keyed by the step's first unit."""
    out = {}
    R = sched.world_size
    for s in range(sched.step_start.size):
        lo, hi = int(sched.step_row[s]), int(sched.step_row[s + 1])
        if lo < 0:
            continue
        out[int(sched.step_start[s])] = frozenset(sched.flat[sched.ptr[lo * R]:sched.ptr[hi * R]].tolist())
    return out


def resume(a, b, rows: int, *, iterate: bool = False):
    """Save ``a`` after ``rows`` rows, load into ``b``; a's and b's schedules, the state, the notices
    (``iterate``: start b's pass: its first batch is where the notice is given)."""
    sa = a.schedule()
    state = a.state_dict(batches_consumed=rows)
    b.load_state_dict(state)
    sb = b.schedule()
    notes = []
    if iterate:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            next(iter(b), None)  # a pass starts at its first batch
        notes = [w for w in caught if issubclass(w.category, ResumeWarning)]
    return sa, sb, state, notes


@pytest.mark.slow  # about 1 s of CPU under ci (5 s under thorough): the inner loop keeps the regression tests below
def test_random_resumes_exactly_once():
    """World A -> B in 1..16, any position, seed, policy and sampler kind: 0 repeats and 0 skips against
    the uninterrupted run (repeats only where a last step holds fewer examples than ranks, and then
    exactly as reported), identical global steps where B divides the global step, and a one-line
    notice exactly when step boundaries move. Resumes come in groups of ten from one first run (two
    new world sizes, five positions each), so each sampler builds an epoch once per group: 200 groups
    under ``ci`` (every sampler kind x policy ten times), 1000 (ten thousand resumes) under ``thorough``."""
    rng = np.random.default_rng(0)
    n = 90
    lengths = rng.integers(1, 64, size=n)
    made: dict = {}

    def sampler(kind, policy, world, step_batches):
        key = (kind, policy, world, step_batches)
        if key not in made:
            made[key] = KINDS[kind](lengths, balance=policy, rank=0, world_size=world, step_batches=step_batches)
        return made[key]

    checked = divides = moved = 0
    groups = 1000 if thorough() else 200
    for group in range(groups):
        kind = list(KINDS)[group % len(KINDS)]
        policy = POLICIES[(group // len(KINDS)) % len(POLICIES)]
        A = int(rng.integers(1, 17))
        step = A * int(rng.integers(1, 3))
        a = sampler(kind, policy, A, step)
        a.seed = int(rng.integers(0, 1000))  # any seed: the state carries it
        epoch = int(rng.integers(0, 3))
        for _ in range(2):
            B = int(rng.integers(1, 17))
            same_step = step % B == 0 and rng.random() < 0.7
            b = sampler(kind, policy, B, step if same_step else B * int(rng.integers(1, 3)))
            b.seed = a.seed  # a state loads into a sampler of its seed
            for trial in range(5):
                with warnings.catch_warnings():  # dropping b's loaded position on purpose
                    warnings.simplefilter("ignore", ResumeWarning)
                    a.set_epoch(epoch + 1)  # another epoch and back: a fresh pass (a may be b, resumed)
                a.set_epoch(epoch)
                rows = int(rng.integers(0, a.schedule().rows + 1))
                iterate = trial == 0
                sa, sb, state, notes = resume(a, b, rows, iterate=iterate)
                before = np.bincount(consumed(sa, rows), minlength=n)
                after = np.bincount(sb.flat, minlength=n)
                where = (group, kind, policy, A, B, rows)
                assert ((before + after) >= 1).all(), (where, np.flatnonzero(before + after == 0))  # no skip
                assert not ((before > 0) & (after > 0)).any(), where  # nothing used before comes again
                # inside each run, only the repeats it reports (a last step with fewer examples than ranks)
                assert int(np.maximum(after - 1, 0).sum()) == sb.repeated, where
                assert int(np.maximum(before - 1, 0).sum()) <= sa.repeated, where
                assert len(notes) <= 1 and all("\n" not in str(w.message) for w in notes)
                assert not iterate or bool(notes) == bool(sb.moved)
                if same_step and sb.rows:
                    divides += 1
                    whole = step_sets(sa)
                    # every step B yields whole is the uninterrupted run's step, but the interrupted one
                    for start, examples in step_sets(sb).items():
                        if start != int(sb.step_start[0]) or not sb.moved:
                            assert examples == whole[start], (where, start)
                    assert not sb.moved or int(state["rows"]) > 0
                moved += bool(sb.moved)
                checked += 1
    print(f"{checked} resumes, {divides} onto a world size dividing the global step, {moved} with moved steps")
    assert checked == 10 * groups and divides > groups and moved > groups


def test_state_is_the_same_on_every_rank_and_small():
    lengths = np.random.default_rng(1).integers(1, 64, size=500)
    samplers = [PackedBatchSampler(lengths, window=64, windows_per_batch=4, balance="compute", rank=r,
                                   world_size=4, step_batches=8) for r in range(4)]
    iters = [iter(s) for s in samplers]
    for it in iters:
        for _ in range(3):  # one and a half optimiser steps (2 micro-batches a rank a step)
            next(it)
    states = [s.state_dict() for s in samplers]
    assert all(s == states[0] for s in states)
    assert len(json.dumps(states[0])) < 800  # no per-sample lists
    assert states[0]["rows"] == 1 and states[0]["deal"] == [4, 2]


def test_shrink_keeps_every_rank_progress():
    """torchtitan PR #816: before it refused, dp 4 -> 2 restored each new rank from the old rank of its
    number, so the progress of old ranks 2 and 3 was lost (their data trained again). Here the state is
    global: what old ranks 2 and 3 consumed is not yielded again, and nothing is skipped."""
    lengths = np.random.default_rng(2).integers(1, 64, size=400)
    old = [PackedBatchSampler(lengths, window=64, windows_per_batch=2, rank=r, world_size=4) for r in range(4)]
    taken = []
    for s in old:
        it = iter(s)
        taken += [i for _ in range(5) for i in next(it)]
    state = old[0].state_dict()
    new = [PackedBatchSampler(lengths, window=64, windows_per_batch=2, rank=r, world_size=2) for r in range(2)]
    rest = []
    for s in new:
        s.load_state_dict(state)
        rest += [i for b in s for i in b]
    ranks_2_3 = {i for s in old[2:] for b in list(s)[:5] for i in b}
    assert not ranks_2_3 & set(rest)
    assert sorted(taken + rest) == list(range(400))


def test_resume_mid_accumulation_neither_skips_nor_repeats_and_says_so():
    """Megatron-Bridge PR #5637: a resume on another data-parallel size skipped or repeated samples
    while reporting success. A resume inside an accumulation step on another world size finishes that
    step's remaining micro-batches as a step of its own, says so in one line, and loses nothing."""
    lengths = np.random.default_rng(3).integers(1, 64, size=300)
    a = [LengthGroupedSampler(lengths, batch_size=2, rank=r, world_size=4, step_batches=8, balance="compute")
         for r in range(4)]
    taken = []
    for s in a:
        it = iter(s)
        taken += [i for _ in range(3) for i in next(it)]  # 1.5 optimiser steps
    state = a[0].state_dict()
    assert state["rows"] == 1
    rest = []
    b = [LengthGroupedSampler(lengths, batch_size=2, rank=r, world_size=3, step_batches=6, balance="compute")
         for r in range(3)]
    for s in b:
        s.load_state_dict(state)
        with pytest.warns(ResumeWarning, match="world_size=3") as record:
            rest += [i for batch in s for i in batch]
        assert len(record) == 1 and "\n" not in str(record[0].message)
    assert sorted(taken + rest) == list(range(300))
    # the same world size at the same point: the deal goes on inside the step, no notice
    c = LengthGroupedSampler(lengths, batch_size=2, rank=0, world_size=4, step_batches=8, balance="compute")
    c.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        assert list(c) == list(a[0])[3:]


def test_growing_onto_a_divisor_reproduces_the_global_steps():
    """8 ranks -> 16 ranks (and 2) with the same global step: the steps hold the same examples."""
    lengths = np.random.default_rng(4).integers(1, 64, size=1200)
    make = lambda R: PackedBatchSampler(lengths, window=64, windows_per_batch=2, rank=0, world_size=R,  # noqa: E731
                                        step_batches=16, balance="compute")
    full = step_sets(make(8).schedule())
    for R in (2, 16):
        b = make(R)
        b.load_state_dict(make(8).state_dict(batches_consumed=4))  # after two optimiser steps
        sb = b.schedule()
        assert not sb.moved
        assert step_sets(sb) == {k: v for k, v in full.items() if k >= int(sb.step_start[0])}
        b.load_state_dict(make(8).state_dict(batches_consumed=3))  # inside the second: it ends on its own
        sb = b.schedule()
        assert sb.moved and sb.step_row[0] == 0
        assert step_sets(sb) == {**{k: v for k, v in full.items() if k > int(sb.step_start[0])},
                                 int(sb.step_start[0]): step_sets(sb)[int(sb.step_start[0])]}


def test_merge_per_rank_states_of_an_older_run():
    """Per-rank states of an older packkit (each rank its own batches_yielded, one micro-batch a rank a
    step) merge into one global state; ranks one batch ahead count as done; a missing rank is refused."""
    lengths = np.random.default_rng(5).integers(1, 64, size=240)
    old = [PackedBatchSampler(lengths, window=64, windows_per_batch=2, rank=r, world_size=3) for r in range(3)]
    ahead = {0: 4, 1: 5, 2: 4}
    taken, states = [], []
    for r, s in enumerate(old):
        batches = list(s)[:ahead[r]]
        taken += [i for b in batches for i in b]
        states.append({"sampler": "PackedBatchSampler", "epoch": 0, "seed": 0, "batches_yielded": ahead[r],
                       "batches_per_epoch": s.batches_per_epoch, "world_size": 3, "rank": r,
                       "fingerprint": s._fingerprint()})  # the format an older packkit saved
    new = [PackedBatchSampler(lengths, window=64, windows_per_batch=2, rank=r, world_size=2) for r in range(2)]
    merged = new[0].merge_state_dicts(states)
    rest = []
    for s in new:
        s.load_state_dict(merged)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResumeWarning)
            rest += [i for b in s for i in b]
    assert sorted(taken + rest) == list(range(240))
    with pytest.raises(ValueError, match=r"missing ranks \[2\]"):
        new[0].merge_state_dicts(states[:2])


@pytest.mark.slow  # a DataLoader worker process
def test_stateful_dataloader_protocol():
    """torchdata's StatefulDataLoader saves the batch sampler's state_dict and restores it with
    load_state_dict before iterating: with workers prefetching, the resumed loader yields exactly the
    batches the first one had not delivered, on the same world size and on another."""
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    lengths = np.random.default_rng(6).integers(1, 64, size=150)
    ds = [{"idx": i} for i in range(150)]

    def collate(xs):
        return [x["idx"] for x in xs]

    def loader(world_size, rank=0, workers=1):
        s = PackedBatchSampler(lengths, window=64, windows_per_batch=2, rank=rank, world_size=world_size,
                               seed=3, balance="compute")
        return tdl.StatefulDataLoader(ds, batch_sampler=s, collate_fn=collate, num_workers=workers), s

    full = list(loader(1, workers=0)[0])
    first, _ = loader(1)
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    again, _ = loader(1)
    again.load_state_dict(state)
    assert head + list(again) == full
    single, _ = loader(1, workers=0)  # onto two ranks (a loader's state fits its own number of workers)
    it = iter(single)
    head = [next(it) for _ in range(4)]
    state = single.state_dict()
    taken = [i for b in head for i in b]
    rest = []
    for r in range(2):
        other, sampler = loader(2, r, workers=0)
        other.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResumeWarning)
            it = iter(other)  # the loader hands the state to the sampler here, not in load_state_dict: the schedule
            repeated = sampler.schedule().repeated  # read before was a fresh epoch's (1 repeat under planner 3, none
            rest += [i for b in it for i in b]  # in the resumed one): a last step of fewer examples than ranks
    assert sorted(set(taken + rest)) == list(range(150)) and len(taken + rest) == 150 + repeated
