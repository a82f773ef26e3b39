"""Per-token values through the tree, end to end: old log-probabilities a GRPO trainer recorded on the unpacked
samples, carried by :class:`packkit.prefixtree.TreeCollator` (DataLoader workers), by :func:`subtree` and by a tree
split across windows (:func:`split_trees`), land on the very tokens the packed forward scores, so the policy ratio
``exp(new - old)`` of an unchanged model is 1 within 1e-10 in float64 on every scored token (verl's trie draft,
RFC #6401 / PR #6689, reported old log-probs that "seem to diverge" under its prefix sharing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packkit.preference import token_logps
from packkit.prefixtree import TreeCollator, build_tree, split_trees, subtree, tree_batch

pytest.importorskip("transformers")

from test_prefixtree import TOL, VOCAB, flat, tiny, trees  # noqa: E402


def old_logps(model, samples) -> list:
    """Every sample alone, as a trainer records them at rollout: ``[0, log p(t_1 | t_0), ...]`` per token (the first
    token has none), float64."""
    out = []
    with torch.no_grad():
        for ids, _, _ in samples:
            x = torch.tensor([ids])
            logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
            out.append(np.concatenate([[0.0], logp.numpy()]))
    return out


def ratio_error(model, batch) -> float:
    """``max |exp(new - old) - 1|`` over the batch's scored tokens (``old`` the values the batch carries)."""
    with torch.no_grad():
        new = token_logps(model(**batch.model_inputs(model)).logits, batch)
    old = batch.token_values["old_logps"]
    assert new.shape == old.shape and new.numel() == int(batch.score_target.numel())
    return float((torch.exp(new - old) - 1).abs().max()) if new.numel() else 0.0


@settings(max_examples=5, deadline=None)
@given(samples=trees(max_samples=10, vocab=VOCAB), window=st.integers(6, 14))
def test_old_log_probs_follow_the_scored_tokens_through_subtrees_and_splits(samples, window):
    """A random tree (depth <= 4, branching <= 16), its samples reordered (``subtree``) and cut into parts of at most
    ``window`` nodes: every scored token's old log-probability is the one recorded on its own sample."""
    model = tiny("qwen3", "sdpa")
    ids, lengths, mask, _ = flat(samples)
    window = max(window, int(lengths.max()))
    values = {"old_logps": np.concatenate(old_logps(model, samples))}
    tree = build_tree(ids, lengths, loss_mask=mask, values=values)
    order = np.random.default_rng(len(samples)).permutation(len(samples))
    part, _ = split_trees(subtree(tree, order), window=window)
    batch = tree_batch(subtree(subtree(tree, order), np.arange(len(samples)), groups=part), window=window)
    err = ratio_error(model, batch)
    assert err < TOL, err


def test_old_log_probs_through_the_collator_in_workers():
    """GRPO-style groups (a prompt, 4 completions each) with their recorded ``old_logps`` through ``TreeCollator``
    in a DataLoader with 2 worker processes: the ratio of the unchanged model is 1 on every completion token."""
    rng = np.random.default_rng(7)
    model = tiny("qwen3", "sdpa")
    samples = []
    for g in range(4):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 7))).tolist()
        for _ in range(4):
            completion = rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist()
            samples.append((prompt + completion, [0] * len(prompt) + [1] * len(completion), g))
    rows = [{"input_ids": s, "completion_mask": m, "old_logps": v.tolist(), "group": g}
            for (s, m, g), v in zip(samples, old_logps(model, samples))]
    loader = torch.utils.data.DataLoader(rows, batch_size=8, num_workers=2,
                                         collate_fn=TreeCollator(window=64, group_key="group"))
    batches = list(loader)
    assert len(batches) == 2 and sum(int(b.score_target.numel()) for b in batches) == sum(sum(m[1:]) for _, m, _ in samples)
    for batch in batches:
        assert batch.num_real_tokens < batch.num_sample_tokens  # prompts forwarded once
        assert ratio_error(model, batch) < TOL
