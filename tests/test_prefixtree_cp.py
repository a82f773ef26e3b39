"""Prefix trees under context parallelism, on real gloo processes: a tree row sharded over a CP group
(``shard_tree``, the hybrid layout: small trees whole on a rank, a tree larger than a rank's share cut across
ranks; and zigzag, every tree cut) through a tiny float64 Qwen3 whose attention is packkit's ring / all-gather
CP attention over the Euler tour gives every sample's per-token log-probabilities, the loss (a token term and a
nonlinear per-sample term, as DPO's and GRPO's) and the gradients of the unpacked samples, each alone through
the model, within 1e-10. Sharding the same row with the documents' mask (each tree one causal document) does
not: a branch would read its sibling.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testlib import free_port, gloo_rank, rank_results, run_processes, tiny_causal_lm

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 3  # CP groups of 2 (a sub-group) and 3
TOL = 1e-10
VOCAB = 64


def random_samples(seed: int, *, max_samples: int = 8):
    """Root-to-node paths of random trees (depth <= 4, branching <= 4, chunks of 1-5 tokens), with loss masks:
    ``[(ids, mask), ...]``."""
    rng = np.random.default_rng(seed)
    samples = []

    def grow(prefix, depth):
        k = 0 if depth == 4 or len(samples) >= max_samples else int(rng.integers(0 if depth else 1, 5))
        if k == 0 or rng.integers(0, 4) == 0:
            samples.append(prefix)
        for _ in range(k):
            grow(prefix + rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist(), depth + 1)

    for _ in range(int(rng.integers(1, 4))):
        grow(rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist(), 0)
    out = []
    for s in [s for s in samples if len(s) >= 2]:
        mask = (rng.random(len(s)) < 0.7).tolist()
        mask[int(rng.integers(1, len(s)))] = True
        out.append((s, mask))
    return out


CASES = [
    # one tree larger than a rank's share (cut across ranks) beside two small ones (whole on a rank)
    [([1, 2, 3, 4, 5, 6], [0, 1, 1, 1, 1, 1]), ([1, 2, 3, 7, 8, 9, 10], [0, 0, 0, 1, 1, 1, 1]),
     ([1, 2, 11, 12, 13], [0, 1, 1, 1, 1]), ([1, 2, 3, 4, 5, 6, 14, 15], [0, 0, 0, 0, 0, 0, 1, 1]),
     ([20, 21, 22], [0, 1, 1]), ([30, 31], [0, 1]), ([30, 32, 33], [0, 1, 1])],
    *(random_samples(seed) for seed in range(2)),
]


def flat(samples):
    ids = np.concatenate([np.asarray(s, np.int64) for s, _ in samples])
    lengths = np.array([len(s) for s, _ in samples])
    mask = np.concatenate([np.asarray(m, bool) for _, m in samples])
    return ids, lengths, mask


def loss_of(token_logps, sequence_logps, num_scored):
    """A token term and a nonlinear term of each sample's sum (DPO's and GRPO's shapes)."""
    return -token_logps.sum() / num_scored - torch.nn.functional.logsigmoid(0.05 * sequence_logps).sum()


def unpacked(model, samples):
    """Every sample alone through the model: ``(per-token log-probabilities [M], loss, gradients)``."""
    model.set_attn_implementation("sdpa")  # float64 throughout (eager's softmax runs in float32)
    model.zero_grad()
    tokens = []
    for s, m in samples:
        x = torch.tensor([s])
        logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
        tokens.append(logp[torch.tensor(m[1:], dtype=torch.bool)])
    per_token = torch.cat(tokens)
    loss = loss_of(per_token, torch.stack([t.sum() for t in tokens]), per_token.numel())
    loss.backward()
    return per_token.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


def run_case(model, samples, ref, group, layout, method, windowed, results, case):
    import torch.distributed as dist

    from packkit.cp import register_hf_cp_attention
    from packkit.prefixtree import build_tree, shard_tree, tree_batch

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ref_tokens, ref_loss, ref_grads = ref
    ids, lengths, mask = flat(samples)
    tree = build_tree(ids, lengths, loss_mask=mask)
    window = int(tree.tree_sizes.max()) + 3 if windowed else None
    batch = tree_batch(tree, window=window)
    model.set_attn_implementation(register_hf_cp_attention(group=group, method=method))
    model.zero_grad()
    s = shard_tree(batch, cp_size=size, rank=rank, layout=layout)
    logits = model(**s.hf_cp_kwargs(model)).logits
    mine = s.token_logps(logits)
    per_seq = s.sequence_logps(mine, group=group)
    loss = loss_of(mine, per_seq, s.num_scored)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g, group=group)  # replicated parameters: every rank's part of the gradient adds
    # the per-token log-probabilities back in the batch's order, and the loss (token terms add over ranks)
    got = torch.zeros(s.num_scored, dtype=mine.dtype)
    got[s.score_entry] = mine.detach()
    dist.all_reduce(got, group=group)
    token_term = (-mine.detach().sum() / s.num_scored).clone()
    dist.all_reduce(token_term, group=group)
    got_loss = token_term - torch.nn.functional.logsigmoid(0.05 * per_seq.detach()).sum()
    # every node forwarded once on the group: the ranks' real tokens are the batch's, each once
    held = torch.zeros(batch.input_ids.numel(), dtype=torch.float64)
    held[s.index[s.index >= 0]] = 1.0
    dist.all_reduce(held, group=group)
    seg = batch.seq_idx.reshape(-1)[s.index.clamp_min(0)][s.index >= 0]
    trees_here = torch.zeros(int(batch.seq_idx.max()) + 1, dtype=torch.float64)
    trees_here[seg.long()] = 1.0
    dist.all_reduce(trees_here, group=group)  # ranks holding a part of each segment
    errs = (float((got - ref_tokens).abs().max()), float(abs(got_loss - ref_loss)),
            max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)))
    err = max(errs)
    results.append({"kind": "tree", "cp": size, "layout": layout, "method": method, "case": case, "window": window,
                    "err": err, "errs": errs, "once": bool((held == 1).all()), "max_ranks_a_tree": int(trees_here.max()),
                    "min_ranks_a_tree": int(trees_here.min())})
    if layout == "hybrid" and method == "ring":
        # the same row sharded with the documents' mask (each tree one causal document): branches read their
        # siblings, so the loss moves; what a CP run that shards a tree row as packed documents would train on
        kwargs = s.cp.hf_cp_kwargs()
        kwargs["position_ids"] = s.position_ids
        with torch.no_grad():
            naive = s.token_logps(model(**kwargs).logits)
        wrong = torch.zeros(s.num_scored, dtype=mine.dtype)
        wrong[s.score_entry] = naive
        dist.all_reduce(wrong, group=group)
        results.append({"kind": "as_documents", "cp": size, "case": case, "err": float((wrong - ref_tokens).abs().max())})


def float64_norms():
    """Qwen3's RMSNorm computes in float32 whatever the model's dtype: in the backward, float64 differences of
    1e-16 (another summation order) flip a float32 rounding now and then, 1e-7 on the gradients. The oracle
    needs float64 throughout: the same norm, in the input's dtype."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    modeling_qwen3.Qwen3RMSNorm.forward = forward


def worker(rank, port, out_dir, cases):
    import torch.distributed as dist

    float64_norms()
    with gloo_rank(rank, port, WORLD, out_dir, timeout_s=200) as results:
        pair = dist.new_group([0, 1])  # collective over the world: every rank makes it
        model = tiny_causal_lm("qwen3", vocab_size=VOCAB)
        refs = {}
        for group, size in ((pair, 2), (None, WORLD)):
            if rank >= size:
                continue
            for i, samples in enumerate(cases[:1] if size == 3 else cases):  # cp=3: the case with every kind
                ref = refs.setdefault(i, unpacked(model, samples))
                run_case(model, samples, ref, group, "hybrid", "ring", False, results, i)
                if i == 0:  # every tree cut (zigzag), all-gathered keys, windows
                    run_case(model, samples, ref, group, "zigzag", "allgather", True, results, i)


def test_tree_sharded_over_cp_ranks_equals_unpacked_samples(tmp_path):
    run_processes(worker, WORLD, (free_port(), str(tmp_path), CASES), timeout_s=240)
    results = rank_results(tmp_path, WORLD)
    trees = [r for r in results if r["kind"] == "tree"]
    for r in trees:
        print(f"cp={r['cp']} {r['layout']}/{r['method']} case {r['case']} window={r['window']}: max |diff| "
              f"{r['err']:.1e} (tokens, loss, grads {r['errs']}), ranks holding a tree {r['min_ranks_a_tree']}-{r['max_ranks_a_tree']}")
    assert {(r["cp"], r["layout"]) for r in trees} == {(2, "hybrid"), (3, "hybrid"), (2, "zigzag"), (3, "zigzag")}
    assert all(r["once"] for r in trees)
    bad = [r for r in trees if not r["err"] <= TOL]
    assert not bad, [(r["cp"], r["layout"], r["case"], r["errs"]) for r in bad]
    # the hybrid layout kept a small tree whole on one rank and cut the large one across ranks (case 0, cp=3)
    hybrid = [r for r in trees if r["layout"] == "hybrid" and r["case"] == 0 and r["cp"] == 3]
    assert all(r["min_ranks_a_tree"] == 1 and r["max_ranks_a_tree"] >= 2 for r in hybrid), hybrid
    gaps = [r["err"] for r in results if r["kind"] == "as_documents"]
    print(f"as documents: max |diff| {min(gaps):.1e}..{max(gaps):.1e}")
    assert min(gaps) > 1e-4, "the documents' mask on a tree row should change the log-probabilities"
