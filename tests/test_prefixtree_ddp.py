"""Prefix trees dealt across real ranks (gloo, CPU, 2 processes): ``deal_trees`` gives every rank the same number of
micro-batches and none empty, so a DDP backward per micro-batch (one all-reduce each) never waits on a rank that
has no work (TRL PR #7328's starvation hangs exactly there), and together the ranks train every sample exactly
once (open-instruct PR #1271 silently dropped up to world - 1 sequences a step). Three RL groups of 4 rollouts fill
3 micro-batches of ``MAX_TOKENS``, so one tree is cut between its completions (its prompt recomputed) to give each
rank 2: the dealing a review found refused. The DDP gradient equals the unpacked one (every rollout alone
through the model) within 1e-10 in float64.
"""

import json
import os

import numpy as np
import pytest
import torch

from testlib import free_port, gloo_group, run_processes, tiny_causal_lm

pytestmark = pytest.mark.distributed

WORLD = 2
MAX_TOKENS = 40
VOCAB = 64


def rollouts():
    """3 prompts of 10 tokens, 4 completions of 4-6 each (trees of 26-34 nodes), a completion mask, advantages."""
    rng = np.random.default_rng(0)
    ids, mask, adv = [], [], []
    for _ in range(3):
        prompt = rng.integers(3, VOCAB, 10).tolist()
        for _ in range(4):
            comp = rng.integers(3, VOCAB, int(rng.integers(4, 7))).tolist()
            ids.append(prompt + comp)
            mask.append([0] * len(prompt) + [1] * len(comp))
            adv.append([float(rng.normal())] * len(ids[-1]))
    return ids, mask, adv


def float64_norms(mp=None):
    """Tiny Llama in float64 throughout: its RMSNorm computes in float32 whatever the dtype, so float64 differences
    of 1e-16 (another summation order) flip a float32 rounding in the backward (2e-7 on the gradients here), as
    test_prefixtree_cp's ``float64_norms`` found for Qwen3; the oracle needs the norm in the input's dtype
    (``mp``: a MonkeyPatch in the test's process, none in a rank's own)."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    (mp or pytest.MonkeyPatch()).setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def model():
    return tiny_causal_lm(dtype=torch.float64, vocab_size=VOCAB, max_position_embeddings=128)


def the_tree():
    from packkit.prefixtree import build_tree

    ids, mask, adv = rollouts()
    return build_tree(np.concatenate(ids), [len(s) for s in ids], loss_mask=np.concatenate(mask),
                      values={"advantages": np.concatenate(adv)})


def worker(rank, world_size, port, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from packkit.preference import token_logps
    from packkit.prefixtree import deal_trees

    float64_norms()
    with gloo_group(rank, world_size, port=port, timeout_s=60):
        tree = the_tree()
        deal = deal_trees(tree, world_size=world_size, max_tokens=MAX_TOKENS)
        net = model()
        ddp = DDP(net)
        seen = []
        for m in range(len(deal.ranks[rank])):
            batch = deal.batch(tree, rank, m)
            assert batch.num_real_tokens <= MAX_TOKENS
            logp = token_logps(ddp(**batch.model_inputs(net)).logits, batch)
            (-(logp * batch.token_values["advantages"]).sum()).backward()  # DDP all-reduces: every rank as often
            seen += deal.ranks[rank][m].tolist()
        counts = torch.tensor([len(deal.ranks[rank])])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        torch.save([p.grad for p in net.parameters()], os.path.join(out_dir, f"grads{rank}.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"micro_batches": len(deal.ranks[rank]), "max_micro_batches": int(counts), "samples": seen,
                       "recomputed": deal.recomputed}, f)


def test_every_rank_steps_as_often_and_trains_every_sample_once(tmp_path):
    run_processes(worker, WORLD, (WORLD, free_port(), str(tmp_path)), timeout_s=120)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(out)
    assert {o["micro_batches"] for o in out} == {out[0]["max_micro_batches"]} == {2}  # 3 trees -> 4 micro-batches
    assert out[0]["recomputed"] > 0  # a tree was cut: its prompt forwarded twice, counted
    ids, mask, adv = rollouts()
    assert sorted(s for o in out for s in o["samples"]) == list(range(len(ids)))
    # the unpacked reference: every rollout alone, the same loss summed, DDP's mean over the ranks
    with pytest.MonkeyPatch.context() as mp:
        float64_norms(mp)
        net = model()
        loss = 0
        for s, m, a in zip(ids, mask, adv):
            x = torch.tensor([s])
            logp = net(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
            keep = torch.tensor(m[1:], dtype=torch.bool)
            loss = loss - (logp[keep] * torch.tensor(a[1:], dtype=torch.float64)[keep]).sum()
        (loss / WORLD).backward()
    for r in range(WORLD):
        got = torch.load(tmp_path / f"grads{r}.pt")
        d = max((g - p.grad).abs().max().item() for g, p in zip(got, net.parameters()))
        print(f"rank {r}: max |grad - unpacked grad| {d:.1e}")
        assert d < 1e-10
