"""The "Many GPUs" page's blocks (docs/many-gpus.md) as pasted in real gloo processes, on real ShareGPT lengths: two ranks run
the loop and die inside the epoch; three ranks restart from the state the loop saved, with the change the
README names for 3 GPUs (step_batches=33, since 32 is refused there, with that advice), and train the rest.
Every example of the epoch is trained once over the two runs; the states of all ranks are one dict.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from testlib import free_port, gloo_group, run_processes  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,  # five spawned ranks, each with DataLoader workers
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

N = 800
MANY_GPUS = "# Many GPUs"


def _rank(rank: int, world: int, port: int, out: str, stop: int, leg: int, block: list):
    import warnings

    from resume_testlib import KillAfter, Killed, TokenRows, sharegpt

    from packkit.sampler import ResumeWarning

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with gloo_group(rank, world, port=None, timeout_s=120):
        lengths = sharegpt(N, seed=2)
        scope = {"lengths": lengths, "dataset": TokenRows(lengths), "print": lambda *a: None}
        report = {}
        if leg == 1:
            exec(block[0], scope)
            loader = KillAfter(scope["loader"], stop)
            try:
                exec(block[1], {**scope, "loader": loader, "epochs": 1})
            except Killed:
                pass
            state = loader.scope_state
        else:
            try:  # pasted unchanged on 3 ranks: refused, with the values to pass
                exec(block[0], dict(scope))
            except ValueError as exc:
                report["refusal"] = str(exc)
            exec(block[0].replace("step_batches=32", "step_batches=33"), scope)  # what the README says
            with open(os.path.join(out, "state.json")) as f:
                exec(block[2], {**scope, "state": json.load(f)})
            loader = KillAfter(scope["loader"], None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                exec(block[1], {**scope, "loader": loader, "epochs": 1})
            report["notes"] = [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)]
            state = scope["sampler"].state_dict()
        states = [None] * world
        dist.all_gather_object(states, state)
        report.update(examples=np.concatenate(loader.examples).tolist() if loader.examples else [],
                      same_state=all(s == states[0] for s in states),
                      repeated=scope["sampler"].epoch_stats().repeated)
        if rank == 0 and leg == 1:
            with open(os.path.join(out, "state.json"), "w") as f:
                json.dump(state, f)
        with open(os.path.join(out, f"leg{leg}_rank{rank}.json"), "w") as f:
            json.dump(report, f)


def test_documented_resume_on_another_world_size_in_real_ranks(tmp_path):
    import time

    from resume_testlib import sharegpt
    from test_readme import doc_code

    from packkit.sampler import PackedBatchSampler

    block = [doc_code("docs/many-gpus.md", MANY_GPUS, "python", i) for i in range(3)]  # read here: the ranks import no transformers

    lengths = sharegpt(N, seed=2)
    per_rank = PackedBatchSampler(lengths, window=2048, windows_per_batch=8, overflow="truncate",
                                  balance="compute", step_batches=32, seed=0, rank=0, world_size=2).batches_per_epoch
    stop = int(np.random.default_rng().integers(1, per_rank))  # any point of the epoch, inside a step or not
    t0 = time.perf_counter()
    run_processes(_rank, 2, (2, free_port(), str(tmp_path), stop, 1, block), timeout_s=300)
    t1 = time.perf_counter()
    run_processes(_rank, 3, (3, free_port(), str(tmp_path), stop, 2, block), timeout_s=300)
    print(f"legs {t1 - t0:.1f} s and {time.perf_counter() - t1:.1f} s")
    legs = {(leg, r): json.loads((tmp_path / f"leg{leg}_rank{r}.json").read_text())
            for leg, R in ((1, 2), (2, 3)) for r in range(R)}
    assert all(v["same_state"] for v in legs.values())
    refusal = legs[2, 0]["refusal"]
    assert "pass step_batches=30 or 33" in refusal and "\n" not in refusal
    assert all(len(v["notes"]) <= 1 for k, v in legs.items() if k[0] == 2)  # step boundaries moved: said once
    seen = np.bincount(np.concatenate([np.asarray(v["examples"], np.int64) for v in legs.values()]), minlength=N)
    repeated = legs[2, 0]["repeated"]  # a last step of fewer examples than ranks, as the README says
    assert (seen >= 1).all(), (stop, np.flatnonzero(seen == 0)[:10])
    assert int((seen - 1).sum()) <= repeated, (stop, np.flatnonzero(seen > 1)[:10], repeated)
    print(f"stop after {stop} of {per_rank} batches a rank; {int((seen - 1).sum())} repeats, {repeated} reported")
