"""RL groups across real ranks (gloo, CPU, 2 processes): ``shard_groups`` gives every rank the same number of
micro-batches and none empty, so a DDP backward per micro-batch (one all-reduce each) never waits on a rank that
has no work (TRL PR #7328's starvation hangs exactly there). Each rank packs its groups as trees
(``GroupCollator``), reads per-sequence log-probabilities in group order and steps; together the ranks see every
group once.
"""

import json
import os

import numpy as np
import pytest
import torch

from testlib import free_port, gloo_group, run_processes, tiny_causal_lm

from packkit.preference import GroupCollator, sequence_logps, shard_groups

pytestmark = pytest.mark.distributed

WORLD = 2
GROUPS = 7  # not a multiple of the world size, uneven lengths
MAX_TOKENS = 50


def rollouts():
    rng = np.random.default_rng(0)
    return [{"prompt_ids": rng.integers(3, 64, int(rng.integers(1, 12))).tolist(),
             "completion_ids": [rng.integers(3, 64, int(rng.integers(1, 10))).tolist() for _ in range(4)],
             "advantages": rng.normal(size=4).tolist()} for _ in range(GROUPS)]


def worker(rank, world_size, port, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    with gloo_group(rank, world_size, port=port, timeout_s=60):
        data = rollouts()
        tokens = [len(g["prompt_ids"]) + sum(map(len, g["completion_ids"])) for g in data]
        mine = shard_groups(tokens, world_size=world_size, max_tokens=MAX_TOKENS)[rank]
        net = tiny_causal_lm(dtype=torch.float64, vocab_size=64, max_position_embeddings=128)
        model = DDP(net)
        collate = GroupCollator(layout="tree")
        seen = []
        for micro in mine:
            batch = collate([data[g] for g in micro.tolist()])
            logps = sequence_logps(model(**batch.model_inputs(net)).logits, batch)
            loss = -(logps.mean * batch.sequence_values["advantages"]).sum()
            loss.backward()  # DDP all-reduces here: every rank must arrive as often
            seen += micro.tolist()
        counts = torch.tensor([len(mine)])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"micro_batches": len(mine), "max_micro_batches": int(counts), "groups": seen,
                       "grad_norm": float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm())}, f)


def test_every_rank_steps_as_often_and_no_group_is_lost(tmp_path):
    run_processes(worker, WORLD, (WORLD, free_port(), str(tmp_path)), timeout_s=120)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(out)
    assert len({o["micro_batches"] for o in out}) == 1 and out[0]["micro_batches"] == out[0]["max_micro_batches"]
    assert out[0]["micro_batches"] >= 2  # several micro-batches a rank: the case that hangs when counts differ
    assert sorted(g for o in out for g in o["groups"]) == list(range(GROUPS))
    assert len({round(o["grad_norm"], 12) for o in out}) == 1  # DDP averaged the same gradient on every rank
