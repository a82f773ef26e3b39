"""packkit.loss under a real 2-process DDP run (gloo, CPU): accumulation is exact across ranks.

Rank 0 and rank 1 hold micro-batches with very uneven loss-token counts. After accumulation with
packkit's step (count all-reduced, loss multiplied back by the world size because DDP averages), the
gradient on both ranks equals the single-process gradient over all the data; the naive mean of
per-micro-batch means does not.
"""

import os

import numpy as np
import pytest
import torch
from testlib import free_port, gloo_group, run_processes, tiny_token_lm

from packkit.loss import accumulation_step, count_loss_tokens

pytestmark = pytest.mark.distributed

IGNORE = -100
VOCAB = 11
# loss tokens per micro-batch: rank 0, rank 1 (very uneven, also across ranks)
RANK_COUNTS = [[30, 900], [200, 45, 12]]
TIMEOUT_S = 90


def tiny_lm():
    return tiny_token_lm(VOCAB, 5)


def rank_batches(rank):
    """Deterministic micro-batches of one rank: [1, T] rows, a masked prompt, then the loss tokens."""
    rng = np.random.default_rng(100 + rank)
    out = []
    for c in RANK_COUNTS[rank]:
        prompt = int(rng.integers(1, 30))
        ids = torch.from_numpy(rng.integers(0, VOCAB, prompt + c))[None]
        labels = ids.clone()
        labels[0, :prompt] = IGNORE
        out.append({"input_ids": ids, "labels": labels})
    return out


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def worker(rank, world_size, port, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    with gloo_group(rank, world_size, port=port, timeout_s=60):
        model = DDP(tiny_lm())
        mbs = rank_batches(rank)
        step = accumulation_step(mbs)  # all-reduces the count: torch.distributed is initialised
        logged = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(mbs):
            if i < len(mbs) - 1:
                with model.no_sync():
                    loss = step.loss(model(mb["input_ids"]), mb)
                    loss.backward()
            else:
                loss = step.loss(model(mb["input_ids"]), mb)
                loss.backward()
            logged += loss.detach()
        torch.save({"grad": grads(model.module), "step": step.as_dict(), "world_size": step.world_size,
                    "grad_multiplier": step.grad_multiplier, "local": step.local_loss_tokens,
                    "mean_loss": step.mean_loss(logged)},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def test_ddp_two_ranks_uneven_counts_match_single_process(tmp_path):
    run_processes(worker, 2, (2, free_port(), str(tmp_path)), timeout_s=TIMEOUT_S)

    # single process over all the data: mean CE over every loss token of both ranks
    all_mbs = rank_batches(0) + rank_batches(1)
    model = tiny_lm()
    logits = torch.cat([model(mb["input_ids"][0]) for mb in all_mbs])
    targets = torch.cat([torch.cat([mb["labels"][0, 1:], torch.tensor([IGNORE])]) for mb in all_mbs])
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE)
    loss.backward()
    want = grads(model)

    # naive: every micro-batch's own mean, divided by the accumulation steps, DDP-averaged over ranks
    naive_model = tiny_lm()
    for rank in (0, 1):
        mbs = rank_batches(rank)
        for mb in mbs:
            lg = naive_model(mb["input_ids"][0])
            tg = torch.cat([mb["labels"][0, 1:], torch.tensor([IGNORE])])
            (torch.nn.functional.cross_entropy(lg, tg, ignore_index=IGNORE) / len(mbs) / 2).backward()
    naive = grads(naive_model)

    total = sum(sum(c) for c in RANK_COUNTS)
    for rank in (0, 1):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        err = float((res["grad"] - want).abs().max())
        print(f"rank {rank}: max |grad - single process| = {err:.2e}; "
              f"naive max diff {float((naive - want).abs().max()):.2e}")
        assert res["world_size"] == 2 and res["grad_multiplier"] == 2.0
        assert res["local"] == sum(RANK_COUNTS[rank]) == sum(count_loss_tokens(mb["labels"]) for mb in rank_batches(rank))
        assert res["step"]["loss_tokens_per_step"] == total
        assert res["step"]["examples_per_step"] == sum(len(c) for c in RANK_COUNTS)
        torch.testing.assert_close(res["grad"], want, rtol=1e-10, atol=1e-12)
        assert res["mean_loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
    assert float((naive - want).abs().max()) > 1e-3 * float(want.abs().max())
