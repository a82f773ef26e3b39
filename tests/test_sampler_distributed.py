"""A real two-process torch.distributed run (gloo, CPU) of the samplers through a DataLoader.

Each process builds its sampler from the default process group (no explicit rank), iterates a
DataLoader with ``batch_sampler=...``, and the ranks exchange their step counts and indices with
``all_gather_object``: equal step counts, disjoint index sets, together the whole dataset.
"""

from __future__ import annotations

import collections
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from testlib import free_port, gloo_group, run_processes  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

WORLD_SIZE = 2
N = 203  # odd on purpose: the tail does not fill a step


class _Rows(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"idx": i, "input_ids": list(range(self.lengths[i]))}


def _collate(items):
    return [x["idx"] for x in items]


def _worker(rank: int, port: int, out_dir: str):
    import numpy as np

    from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, TokenBudgetBatchSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with gloo_group(rank, WORLD_SIZE, port=None, timeout_s=60):
        lengths = np.random.default_rng(0).integers(1, 64, size=N).tolist()
        ds = _Rows(lengths)
        results = {}
        for name, make in [
            ("grouped_full", lambda: LengthGroupedSampler(lengths, batch_size=4, seed=1, dataset=ds)),
            ("grouped_drop", lambda: LengthGroupedSampler(lengths, batch_size=4, seed=1, drop_last=True)),
            ("budget", lambda: TokenBudgetBatchSampler(lengths, max_tokens=160, seed=1, balance="tokens")),
            ("packed", lambda: PackedBatchSampler(lengths, window=64, windows_per_batch=3, seed=1, balance="sqlen")),
        ]:
            sampler = make()
            sampler.set_epoch(2)
            loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=_collate)
            steps, seen = 0, []
            for batch in loader:
                steps += 1
                seen += batch
                dist.barrier()  # a rank with an extra step would hang here: the failure DDP shows
            gathered = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, {"steps": steps, "len": len(loader), "rank": sampler.rank,
                                              "world_size": sampler.world_size, "seen": seen,
                                              "stats": sampler.epoch_stats()})
            results[name] = gathered
        results["elastic"] = _elastic(rank, lengths, ds)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))


def _elastic(rank, lengths, ds):
    """Grow 1 -> 2 ranks, then shrink 2 -> 1, through DataLoaders, with balance="compute": rank 0 runs
    alone and sends its state; both ranks resume from it (a barrier each step); then rank 0 resumes alone
    from the state both saved. Returns what was consumed in each phase."""
    import warnings

    from packkit.sampler import PackedBatchSampler, ResumeWarning

    warnings.simplefilter("ignore", ResumeWarning)
    make = lambda **kw: PackedBatchSampler(lengths, window=64, windows_per_batch=2, seed=4,  # noqa: E731
                                           balance="compute", **kw)
    out = {"alone": [], "grown": [], "states": None, "shrunk": []}
    box = [None]
    if rank == 0:  # phase 1: one rank, five batches
        s = make(rank=0, world_size=1)
        it = iter(torch.utils.data.DataLoader(ds, batch_sampler=s, collate_fn=_collate))
        out["alone"] = [i for _ in range(5) for i in next(it)]
        box = [s.state_dict(batches_consumed=5)]
    dist.broadcast_object_list(box, src=0)
    s = make(step_batches=4)  # phase 2: both ranks, from the process group, two micro-batches a step
    s.load_state_dict(box[0])
    it = iter(torch.utils.data.DataLoader(ds, batch_sampler=s, collate_fn=_collate))
    for _ in range(3):  # one and a half optimiser steps
        out["grown"] += next(it)
        dist.barrier()
    states = [None] * WORLD_SIZE
    dist.all_gather_object(states, s.state_dict())  # no workers: what was yielded was consumed
    out["states"] = states
    if rank == 0:  # phase 3: rank 0 alone again
        s = make(rank=0, world_size=1)
        s.load_state_dict(states[0])
        out["shrunk"] = [i for b in torch.utils.data.DataLoader(ds, batch_sampler=s, collate_fn=_collate) for i in b]
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, out)
    return gathered


def test_two_processes_equal_steps_disjoint_and_complete():
    with tempfile.TemporaryDirectory() as out_dir:  # past 90 s: a rank waiting on a missing step?
        run_processes(_worker, WORLD_SIZE, (free_port(), out_dir), timeout_s=90)
        results = torch.load(os.path.join(out_dir, "results.pt"), weights_only=False)

    elastic = results.pop("elastic")
    assert elastic[0]["states"][0] == elastic[0]["states"][1]  # the same state on every rank
    used = (elastic[0]["alone"] + elastic[0]["grown"] + elastic[1]["grown"] + elastic[0]["shrunk"])
    print("elastic 1 -> 2 -> 1:", len(elastic[0]["alone"]), len(elastic[0]["grown"]) + len(elastic[1]["grown"]),
          len(elastic[0]["shrunk"]))
    assert sorted(set(used)) == list(range(N)) and len(used) - N <= 1  # a last step of one example: repeated

    for name, ranks in results.items():
        print(name, [(r["steps"], len(r["seen"])) for r in ranks], ranks[0]["stats"])
        assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {WORLD_SIZE}
        assert ranks[0]["steps"] == ranks[1]["steps"] == ranks[0]["len"] == ranks[1]["len"] >= 1
        a, b = ranks[0]["seen"], ranks[1]["seen"]
        stats = ranks[0]["stats"]
        counts = collections.Counter(a + b)
        twice = sorted(i for i, c in counts.items() if c > 1)
        union = set(counts)
        assert len(a) + len(b) == N - stats.dropped + stats.repeated
        if name == "grouped_drop":  # disjoint; the tail (less than a step) left out and counted
            assert not twice and stats.repeated == 0 and stats.dropped == N % 8
            assert len(union) == N - stats.dropped
        else:  # together complete; disjoint but for the repeat the policy reports
            assert union == set(range(N)), name
            assert sum(counts[i] - 1 for i in twice) == stats.repeated <= 2, (name, twice)
            assert not set(a) & set(b) - set(twice)
