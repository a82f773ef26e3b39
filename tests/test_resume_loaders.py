"""Resume through the loops users write: a plain DataLoader with 0 and 2 workers, torchdata's
StatefulDataLoader with workers. The state a loop saves must name exactly the batches the loop consumed,
and a loaded state must be the next pass whatever calls iter() on the sampler.

Before the fix: behind ``DataLoader(num_workers=2)`` ``sampler.state_dict()`` counted the
batches the workers had prefetched (a resume skipped them), and a loaded state was ignored (the DataLoader
calls ``iter()`` on its batch sampler twice; the first call spent the resume position, the second
restarted the epoch, so every batch already trained was trained again).

Random stop points, scaled by the hypothesis profile: 366 under ci, 10,000 under ``thorough`` (3,000
through a DataLoader with 0 workers, 3,000 with 2, 300 through StatefulDataLoader with 2, 3,700 onto
another world size); Trainer's are in test_resume_trainer.py, the gloo ranks' in test_resume_distributed.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from testlib import thorough
from torch.utils.data import DataLoader

from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, TokenBudgetBatchSampler

N = 150
LENGTHS = np.random.default_rng(0).integers(1, 64, size=N)


def ids(items):
    """The collate_fn of these tests: a batch is the list of its example indices."""
    return list(items)


def packed(**kw):
    return PackedBatchSampler(LENGTHS, window=64, windows_per_batch=2, seed=1, **kw)


def loader(sampler, workers: int, **kw):
    return DataLoader(range(N), batch_sampler=sampler, collate_fn=ids, num_workers=workers,
                      timeout=120 if workers else 0, **kw)


@pytest.mark.slow  # DataLoader worker processes
def test_state_dict_behind_workers_counts_what_the_loop_consumed():
    """Before the fix the state counted the 4 batches the two workers had prefetched (prefetch_factor 2):
    the resume skipped them."""
    full = list(loader(packed(), 0))
    for stop in (0, 1, 5, len(full) - 1, len(full)):
        s = packed()
        it = iter(loader(s, 2))
        head = [next(it) for _ in range(stop)]
        state = s.state_dict()  # the common loop: no argument
        del it
        assert state["batches_yielded"] == stop, stop
        t = packed()
        t.load_state_dict(state)
        assert head + list(loader(t, 0)) == full, stop


@pytest.mark.slow  # DataLoader worker processes
def test_a_loaded_state_is_the_next_pass_behind_workers():
    """Before the fix a DataLoader with workers started the resumed epoch again from its first batch."""
    full = list(loader(packed(), 0))
    s = packed()
    it = iter(loader(s, 0))
    head = [next(it) for _ in range(7)]
    state = s.state_dict()
    t = packed()
    t.load_state_dict(state)
    rest = list(loader(t, 2))
    assert head + rest == full
    assert list(loader(t, 2)) == full  # and the pass after it is the whole epoch


@pytest.mark.slow
def test_persistent_workers_resume_each_pass():
    """persistent_workers=True: one loader, the sampler resumed between passes (each pass one iter())."""
    s = LengthGroupedSampler(LENGTHS, batch_size=4, seed=2)
    dl = loader(s, 2, persistent_workers=True)
    full = list(dl)
    for stop in (3, 11):
        it = iter(dl)
        head = [next(it) for _ in range(stop)]
        state = s.state_dict()
        s.load_state_dict(state)
        assert head + list(dl) == full, stop


# ----------------------------------------------------------------------------------------------
# random stop points through each loop, scaled by the hypothesis profile
# ----------------------------------------------------------------------------------------------

CONFIGS = {
    "packed": lambda: PackedBatchSampler(LENGTHS, window=64, windows_per_batch=2, seed=5, balance="compute"),
    "grouped": lambda: LengthGroupedSampler(LENGTHS, batch_size=4, seed=6),
    "budget": lambda: TokenBudgetBatchSampler(LENGTHS, max_tokens=128, seed=7, balance="sqlen"),
}


def stops(ci: int, total: int) -> int:
    """Stop points of one loop: ``ci`` under the ci/dev profiles, ``total`` under ``thorough``."""
    return total if thorough() else ci


def draw(rng, sampler) -> tuple[int, int, list]:
    """A random epoch and stop point of ``sampler``, and that epoch's batches, uninterrupted."""
    epoch = int(rng.integers(0, 3))
    sampler.set_epoch(epoch)
    full = [b.tolist() for b in sampler.schedule().batches(sampler.rank)]
    return epoch, int(rng.integers(0, len(full) + 1)), full


def resume_mismatch(where, head: list, rest: list, full: list) -> str | None:
    """How the interrupted run differs from the uninterrupted one (skipped, repeated or reordered batches);
    None when it is the same run."""
    if len(head) + len(rest) != len(full):
        return f"{where}: {len(head)} + {len(rest)} batches against {len(full)}"
    if head + rest != full:
        return f"{where}: batch {next(k for k, (x, y) in enumerate(zip(head + rest, full)) if x != y)} differs"
    return None


def run_plain(workers: int, points: int, seed: int) -> list[str]:
    """Stop points through ``DataLoader(batch_sampler=...)`` with ``workers`` (persistent, so a stop point
    costs a pass, not two new workers); the state is ``sampler.state_dict()`` as the loop saves it, loaded
    into another sampler behind another loader. Returns how each stop point that went wrong differed."""
    rng = np.random.default_rng(seed)
    pairs, wrong = {}, []
    for kind, make in CONFIGS.items():
        a, b = make(), make()
        kw = dict(persistent_workers=True) if workers else {}
        pairs[kind] = (a, b, loader(a, workers, **kw), loader(b, workers, **kw))
    for point in range(points):
        kind = list(CONFIGS)[point % len(CONFIGS)]
        a, b, la, lb = pairs[kind]
        epoch, stop, full = draw(rng, a)
        it = iter(la)
        head = [next(it) for _ in range(stop)]
        state = a.state_dict()
        del it
        b.set_epoch(int(rng.integers(0, 3)))  # whatever b did before, the state decides
        b.load_state_dict(state)
        b.set_epoch(epoch)  # the loop's set_epoch for the resumed epoch keeps the position
        wrong.append(resume_mismatch((kind, workers, epoch, stop), head, list(lb), full))
    return [w for w in wrong if w is not None]


@pytest.mark.slow  # DataLoader worker processes
@pytest.mark.parametrize("workers", [0, 2])
def test_random_stop_points_plain_dataloader(workers):
    points = stops(30 if workers else 300, 3000)
    assert run_plain(workers, points, seed=workers) == []
    print(f"{points} stop points through DataLoader(num_workers={workers})")


@pytest.mark.slow  # DataLoader worker processes
def test_random_stop_points_stateful_dataloader():
    """torchdata's StatefulDataLoader with 2 workers: loader.state_dict() holds the sampler's, taken as each
    batch is drawn; a new loader (new workers: it cannot load into persistent ones) resumes from it."""
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    rng = np.random.default_rng(11)
    points = stops(6, 300)
    for point in range(points):
        kind = list(CONFIGS)[point % len(CONFIGS)]
        a = CONFIGS[kind]()
        epoch, stop, full = draw(rng, a)
        first = tdl.StatefulDataLoader(range(N), batch_sampler=a, collate_fn=ids, num_workers=2, timeout=120)
        it = iter(first)
        head = [next(it) for _ in range(stop)]
        state = first.state_dict()
        if point == 0:  # the sampler's own state_dict() behind these workers counts what the loop received (the
            # loader's count, as a plain DataLoader's), with no warning: it resumes the same run
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                own = a.state_dict()
            c = CONFIGS[kind]()
            c.set_epoch(epoch)
            c.load_state_dict(own)
            assert resume_mismatch((kind, epoch, stop, "own"), head, list(loader(c, 0)), full) is None
        del it
        b = CONFIGS[kind]()
        b.set_epoch(epoch)
        again = tdl.StatefulDataLoader(range(N), batch_sampler=b, collate_fn=ids, num_workers=2, timeout=120)
        again.load_state_dict(state)
        assert resume_mismatch((kind, epoch, stop), head, list(again), full) is None
    print(f"{points} stop points through StatefulDataLoader(num_workers=2)")


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_accelerate_prepared_loader(workers):
    """accelerate's DataLoaderShard fetches one batch ahead of the loop (to know the last): the state
    counts the batches the loop received, up to the last one."""
    accelerate = pytest.importorskip("accelerate")
    full = list(loader(packed(), 0))
    acc = accelerate.Accelerator(cpu=True)
    for stop in (0, 1, 5, len(full) - 1, len(full)):
        s = packed()
        it = iter(acc.prepare(loader(s, workers)))
        head = [list(map(int, next(it))) for _ in range(stop)]
        state = s.state_dict()
        del it
        t = packed()
        t.load_state_dict(state)
        assert head + list(loader(t, 0)) == full, stop


class Wrapped:
    """A batch sampler around packkit's (as accelerate's SkipBatchSampler is): the DataLoader draws from it."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        yield from self.inner

    def __len__(self):
        return len(self.inner)


@pytest.mark.slow  # DataLoader worker processes
def test_where_the_loop_cannot_be_told_a_warning_names_the_fix():
    from packkit.sampler import ResumeWarning

    s = packed()
    it = iter(DataLoader(range(N), batch_sampler=Wrapped(s), collate_fn=ids, num_workers=2, timeout=120))
    head = [next(it) for _ in range(3)]
    with pytest.warns(ResumeWarning, match=r"batches_consumed=\.\.\.") as record:
        s.state_dict()
    assert len(record) == 1 and "\n" not in str(record[0].message)
    state = s.state_dict(batches_consumed=len(head))  # the fix it names
    t = packed()
    t.load_state_dict(state)
    assert head + list(loader(t, 0)) == list(loader(packed(), 0))
    del it
    s = packed()
    it = iter(loader(s, 2, in_order=False))
    next(it)
    with pytest.warns(ResumeWarning, match="in_order=True"):
        s.state_dict()
    del it


def test_random_stop_points_onto_another_world_size():
    """Every rank of world A runs the loop through its own DataLoader (no workers: the ranks share this
    process) and stops after the same number of batches; the states of all ranks are one dict; world B,
    with a step_batches that is a multiple of it, restarts from it. Over the two runs every example of the
    epoch is trained, and none twice beyond the repeats the schedules report (a last step holding fewer
    examples than ranks). 30 stop points under ci, 3,700 under thorough."""
    import warnings

    from packkit.sampler import ResumeWarning

    rng = np.random.default_rng(12)
    made: dict = {}
    kinds = {"packed": dict(window=64, windows_per_batch=2, balance="compute"), "grouped": dict(batch_size=4),
             "budget": dict(max_tokens=128, balance="sqlen")}
    classes = {"packed": PackedBatchSampler, "grouped": LengthGroupedSampler, "budget": TokenBudgetBatchSampler}

    def make(kind, rank, world, step):
        key = (kind, rank, world, step)
        if key not in made:
            made[key] = classes[kind](LENGTHS, seed=9, rank=rank, world_size=world, step_batches=step,
                                      **kinds[kind])
        return made[key]

    points = stops(30, 3700)
    for point in range(points):
        kind = list(kinds)[point % len(kinds)]
        A, B = (int(x) for x in rng.integers(1, 6, 2))
        step_a, step_b = A * int(rng.integers(1, 3)), B * int(rng.integers(1, 3))
        epoch = int(rng.integers(0, 2))
        first = [make(kind, r, A, step_a) for r in range(A)]
        for s in first:
            s.set_epoch(epoch + 1)  # a fresh pass of the epoch
            s.set_epoch(epoch)
        stop = int(rng.integers(0, first[0].batches_per_epoch + 1))
        whole = first[0].schedule()
        taken, states = [], []
        for s in first:
            it = iter(loader(s, 0))
            taken += [i for _ in range(stop) for i in next(it)]
            states.append(s.state_dict())
            del it
        assert all(st == states[0] for st in states), (kind, A, stop)
        rest, repeated = [], whole.repeated
        for r in range(B):
            t = make(kind, r, B, step_b)
            t.load_state_dict(states[0])
            t.set_epoch(epoch)
            repeated = max(repeated, whole.repeated + t.schedule().repeated)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResumeWarning)
                rest += [i for b in loader(t, 0) for i in b]
        counts = np.bincount(np.asarray(taken + rest, np.int64), minlength=N)
        where = (point, kind, A, step_a, B, step_b, epoch, stop)
        assert (counts >= 1).all(), (where, np.flatnonzero(counts == 0))
        assert int((counts - 1).sum()) <= repeated, (where, np.flatnonzero(counts > 1))
    print(f"{points} stop points onto another world size")


def test_a_sampler_pickled_mid_pass_keeps_its_place():
    import copy
    import pickle

    s = packed()
    it = iter(loader(s, 0))
    head = [next(it) for _ in range(3)]
    for t in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert t.state_dict() == s.state_dict()
        u = packed()
        u.load_state_dict(t.state_dict())
        assert head + list(loader(u, 0)) == list(loader(packed(), 0))


def test_set_epoch_dropping_a_loaded_position_says_so():
    """The common loop ``for epoch in range(epochs): sampler.set_epoch(epoch)`` after loading a state of epoch
    2 trained epochs 0 and 1 again with no word (set_epoch(0) dropped the position): a ResumeWarning names
    the loop to write. Setting the loaded epoch, or moving on after the resumed pass, says nothing."""
    import warnings

    from packkit.sampler import ResumeWarning

    s = packed()
    s.set_epoch(2)
    it = iter(s)
    for _ in range(4):
        next(it)
    state = s.state_dict()
    t = packed()
    t.load_state_dict(state)
    with pytest.warns(ResumeWarning, match=r"set_epoch\(0\) drops the position loaded for epoch 2 \(4 batches "
                                           r"done\): .*range\(sampler.epoch, epochs\)") as record:
        t.set_epoch(0)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    t.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        for epoch in range(t.epoch, 4):
            t.set_epoch(epoch)
            list(t)


def test_accelerate_dealing_a_rank_aware_sampler_again_is_refused():
    """accelerate.prepare on many processes wraps a batch sampler in BatchSamplerShard, which deals its batches
    over the processes: packkit's are already one rank's, so each rank would silently train half of them."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    s = packed(rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"each rank would train 1/2 of them\): after accelerator.prepare\(loader\), "
                                         r"set loader.batch_sampler.num_processes = 1") as info:
        list(data_loader.BatchSamplerShard(s, num_processes=2, process_index=0))
    assert "\n" not in str(info.value)
    assert list(data_loader.BatchSamplerShard(s, num_processes=1, process_index=0)) == list(s)  # the fix
    assert list(data_loader.BatchSamplerShard(packed(), num_processes=2, process_index=0))  # a one-rank sampler
