"""Prefix trees (``packkit.prefixtree``): shared prefixes found from token ids, computed once, losses unchanged.

The structure is checked against a nested-loop trie (dict insertion, sample after sample) in this file; the
model-level goal against the unpacked computation (every sample alone through the model, ``log_softmax`` of its
logits gathered at the next tokens, at its loss tokens): per-token and per-sample log-probabilities within 1e-10
in float64 on tiny Llama, Qwen2 and Qwen3 with eager, sdpa and flex attention, on random trees of depth <= 4 and
branching <= 16.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit import prefixtree
from packkit.errors import ArgumentError, DataError
from packkit.prefixtree import (TreeCollator, build_tree, deal_trees, prefix_nodes, split_trees, subtree,
                                tree_batch)
from packkit.preference import sequence_logps, token_logps

transformers = pytest.importorskip("transformers")

from test_preference import eager_float64, varlen_reference  # noqa: E402
from testlib import tiny_causal_lm, tiny_config  # noqa: E402

VOCAB = 64
TOL = 1e-10


# ----------------------------------------------------------------------------------------------
# random trees and the nested-loop reference
# ----------------------------------------------------------------------------------------------


@st.composite
def trees(draw, *, max_samples: int = 40, vocab: int = 6):
    """Samples that are root-to-node paths of a random tree: depth <= 4, branching <= 16, chunks of 1-4 tokens
    from a small vocabulary (so that siblings also share tokens by chance), some internal nodes also samples,
    several roots (or one group of them). Returns ``[(ids, loss_mask, group), ...]``."""
    samples = []

    def grow(prefix, depth):
        if len(samples) >= max_samples:
            return
        k = draw(st.integers(0 if depth else 1, 16 if depth < 4 else 0))
        if k == 0 or draw(st.integers(0, 5)) == 0:  # a leaf, or an internal node that is a sample too
            samples.append(prefix)
        for _ in range(k):
            chunk = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
            grow(prefix + chunk, depth + 1)

    for _ in range(draw(st.integers(1, 3))):
        grow([], 0)
    samples = [s for s in samples if len(s) >= 2] or [[1, 2]]
    out = []
    for s in samples:
        mask = draw(st.lists(st.booleans(), min_size=len(s), max_size=len(s)))
        mask[draw(st.integers(1, len(s) - 1))] = True
        out.append((s, mask, draw(st.integers(0, 1))))
    return out


def flat(samples):
    ids = np.concatenate([np.asarray(s, np.int64) for s, _, _ in samples])
    lengths = np.array([len(s) for s, _, _ in samples])
    mask = np.concatenate([np.asarray(m, bool) for _, m, _ in samples])
    groups = np.array([g for _, _, g in samples])
    return ids, lengths, mask, groups


def reference_trie(samples, groups=None):
    """Nested loops: insert every sample into a dict trie; ``(number of nodes, node of every sample token)``."""
    root, count, out = {}, 0, []
    for s, (ids, _, g) in enumerate(samples):
        level = root.setdefault(g if groups is not None else None, {})
        for t in ids:
            if t not in level:
                level[t] = (count, {})
                count += 1
            node, level = level[t]
            out.append(node)
    return count, np.asarray(out)


def check_structure(tree, samples, groups=None):
    ids, lengths, mask, _ = flat(samples)
    count, ref_node = reference_trie(samples, groups)
    assert tree.num_nodes == count  # tokens forwarded == trie nodes, exactly
    assert tree.num_sample_tokens == ids.size
    # the same partition of sample tokens into nodes
    pairs = np.unique(np.stack([ref_node, tree.path], 1), axis=0)
    assert len(pairs) == count == len(np.unique(tree.path))
    off = tree.sample_ptr
    for s in range(len(samples)):
        p = tree.path[off[s]:off[s + 1]]
        assert np.array_equal(tree.input_ids[p], ids[off[s]:off[s + 1]])
        assert np.array_equal(tree.position_ids[p], np.arange(p.size))
        assert tree.parent[p[0]] == -1 and np.array_equal(tree.parent[p[1:]], p[:-1])
    # the Euler tour against the parent chains: k <= q < tout[k] iff k is q or an ancestor of q
    anc = np.zeros((count, count), bool)
    k = np.arange(count)
    while (k >= 0).any():  # every node walks up its parent chain at once
        live = np.flatnonzero(k >= 0)
        anc[live, k[live]] = True
        k[live] = tree.parent[k[live]]
    tin = np.arange(count)
    assert np.array_equal(anc, (tin[None, :] <= tin[:, None]) & (tin[:, None] < tree.tout[None, :]))
    # scored tokens: sample after sample, loss tokens after the first, read from the node before on the path
    want = [(s, tree.path[off[s] + j - 1], tree.path[off[s] + j]) for s in range(len(samples))
            for j in range(1, lengths[s]) if mask[off[s] + j]]
    got = list(zip(tree.score_sample.tolist(), tree.score_source.tolist(), tree.score_target.tolist()))
    assert got == [tuple(map(int, w)) for w in want]
    # samples through each node, segments (a new one wherever a node's parent is not the node before), and the
    # batch's sequence_ids (the sample of a node on one sample's path only, else -1), node by node
    through = [[s for s in range(len(samples)) if node in set(tree.path[off[s]:off[s + 1]].tolist())]
               for node in range(count)]
    assert tree.num_samples.tolist() == [len(t) for t in through]
    seg, segments = -1, []
    for node in range(count):
        seg += int(node == 0 or tree.parent[node] != node - 1)
        segments.append(seg)
    assert tree.segment.tolist() == segments
    batch = tree_batch(tree)  # one row, the nodes in layout order
    assert batch.sequence_ids[0].tolist() == [t[0] if len(t) == 1 else -1 for t in through]


@given(trees(max_samples=80))
@settings(max_examples=30)
@example([([1, 2, 3], [0, 1, 1], 0), ([1, 2, 4, 5], [0, 0, 1, 1], 0), ([1, 6], [0, 1], 0)])  # the docstring's
@example([([1, 2], [0, 1], 0), ([1, 2], [0, 1], 0), ([1, 2, 3], [1, 1, 1], 1)])  # a duplicate, a prefix of another
def test_tree_is_the_trie(samples):
    ids, lengths, mask, groups = flat(samples)
    check_structure(build_tree(ids, lengths, loss_mask=mask), samples)
    check_structure(build_tree(ids, lengths, loss_mask=mask, groups=groups), samples, groups=groups)


def test_docstring_example():
    t = build_tree([1, 2, 3, 1, 2, 4, 5, 1, 6], [3, 4, 2])
    assert t.path.tolist() == [0, 1, 2, 0, 1, 3, 4, 0, 5]
    assert t.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert t.position_ids.tolist() == [0, 1, 2, 2, 3, 1]
    assert t.parent.tolist() == [-1, 0, 1, 1, 3, 0]
    assert t.tout.tolist() == [6, 5, 3, 5, 5, 6]
    assert prefix_nodes([1, 2, 1, 3, 1, 2, 4], [2, 2, 3]).tolist() == [0, 1, 0, 3, 0, 1, 6]
    assert tree_batch(build_tree([1, 2, 3, 1, 2, 4], [3, 3])).input_ids.tolist() == [[1, 2, 3, 4]]


@given(trees(max_samples=60), st.sampled_from([0, 2 ** 40, 2 ** 62]), st.sampled_from([1, -(2 ** 40), 2 ** 60]))
@settings(max_examples=20)
def test_every_compare_path_gives_the_trie(samples, shift, scale):
    """The construction's other paths, which short random samples do not take: every pair of neighbours compared
    and every shared prefix copied one by one, and the samples sorted by Python (as long samples are); the sort
    in rounds of one token (as many short samples sharing long prefixes are sorted); ids past 32 bits (8-byte
    keys, one token a sort word), group ids negative and large; ids and group ids too wide for the positions'
    bits beside them (sorted by a stable argsort, not by value)."""
    ids, lengths, mask, groups = flat(samples)
    saved = prefixtree._SHORT, prefixtree._ROUND, prefixtree._ROUND_MIN
    try:
        prefixtree._SHORT = 0  # neighbours compared, prefixes copied one by one; sorted by Python
        one_by_one = build_tree(ids + shift, lengths, loss_mask=mask, groups=groups * scale)
        prefixtree._SHORT, prefixtree._ROUND, prefixtree._ROUND_MIN = saved[0], 1, 1  # sorted a token a round
        by_rounds = build_tree(ids + shift, lengths, loss_mask=mask, groups=groups * scale)
    finally:
        prefixtree._SHORT, prefixtree._ROUND, prefixtree._ROUND_MIN = saved
    shifted = [(np.asarray(s) + shift, m, g) for s, m, g in samples]
    check_structure(one_by_one, shifted, groups=groups)
    check_structure(by_rounds, shifted, groups=groups)
    wide = build_tree(ids + shift, lengths, loss_mask=mask, groups=groups * scale)
    for tree in (one_by_one, by_rounds):
        assert np.array_equal(wide.path, tree.path) and np.array_equal(wide.input_ids, tree.input_ids)


def test_a_deep_nest_and_its_shallow_siblings():
    """The shape that made a166061's parent search quadratic (each shallow sample walked up the whole nest from
    its sorted neighbour, the deepest): 300 samples each one token longer than the last, then 2,000 that share
    only the first token, later ones sorting first (so that the nest's deepest is the nearest earlier sample of
    each); and the nest in reverse order. The trie, node for node."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50, 301)
    nest = [(base[:k + 2].tolist(), [1] * (k + 2), 0) for k in range(300)]
    shallow = [([int(base[0]), 2100 - i], [1, 1], 0) for i in range(2000)]
    for samples in (nest + shallow, nest[::-1] + shallow):
        ids, lengths, mask, groups = flat(samples)
        check_structure(build_tree(ids, lengths, loss_mask=mask), samples)


def _most_shared_by_definition(samples, groups):
    """Per sample: the longest prefix it shares with an earlier sample of its group, and the earliest sample of
    its group through that prefix (-1: none), pair by pair."""
    def common(a, b):
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)
    shared, earliest = [], []
    for s, x in enumerate(samples):
        same = [t for t in range(len(samples)) if groups[t] == groups[s]]
        m = max([common(x, samples[t]) for t in same if t < s], default=0)
        shared.append(m)
        earliest.append(min(t for t in same if common(x, samples[t]) >= m) if m else -1)
    return shared, earliest


@given(trees(max_samples=60), st.sampled_from([0, 1, 2, 16]), st.booleans())
@settings(max_examples=40)
@example([([1, 2, 3, 4], [1] * 4, 0), ([1, 2, 3], [1] * 3, 0), ([1, 2], [1] * 2, 0), ([1, 2, 3, 4], [1] * 4, 0),
          ([1, 5], [1] * 2, 0)], 1, False)  # a nest, deeper than one level of runs, with a repeat
def test_runs_and_lifting_give_the_same_tree(samples, levels, grouped):
    """What each sample shares with an earlier one, run by run down the levels of branching nodes and finished by
    binary lifting after ``levels`` of them (0: lifted from the start, as before), against the definition; and
    the trees of both ways identical, array for array."""
    ids, lengths, mask, groups = flat(samples)
    g = groups if grouped else np.zeros_like(groups)
    off = np.concatenate([[0], np.cumsum(lengths)])
    order = prefixtree._sorted_samples(ids, off, g if grouped else None)
    lcp = prefixtree._neighbour_lcps(ids, off, g if grouped else None, order)
    saved = prefixtree._LIFT_AFTER
    try:
        got = {}
        for n in (levels, 0):
            prefixtree._LIFT_AFTER = n
            got[n] = (prefixtree._most_shared_earlier(order, lcp),
                      build_tree(ids, lengths, loss_mask=mask, groups=g if grouped else None))
    finally:
        prefixtree._LIFT_AFTER = saved
    want = _most_shared_by_definition([list(s) for s, _, _ in samples], g.tolist())
    for (shared, earliest), _ in got.values():
        assert shared.tolist() == want[0] and earliest.tolist() == want[1]
    a, b = got[levels][1], got[0][1]
    for field in a.__dataclass_fields__:
        x, y = getattr(a, field), getattr(b, field)
        assert (x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)) if isinstance(x, dict) \
            else np.array_equal(x, y), field


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2 ** 64 - 1), st.integers(0, 1)), min_size=1,
                max_size=40), st.sampled_from([2, 40, 64]))
@settings(max_examples=40)
def test_stable_order_is_lexsort(rows, width):
    """The sort of the rounds equals ``np.lexsort`` (ties in place), keys sorted by value beside the positions'
    bits where they have room for them, by a stable argsort where they do not."""
    keys = [np.array([r[j] for r in rows], np.uint64) for j in range(3)]
    keys[1] &= np.uint64((1 << width) - 1)
    got = prefixtree._stable_order(keys, [2, width, 1])
    assert got.tolist() == np.lexsort(keys).tolist()


def test_values_follow_the_scored_tokens():
    ids = [1, 2, 3, 1, 2, 4]
    adv = np.arange(6, dtype=float) * 10
    t = build_tree(ids, [3, 3], loss_mask=[0, 1, 1, 0, 0, 1], values={"advantages": adv})
    assert t.values["advantages"].tolist() == [10.0, 20.0, 50.0]
    assert t.num_tokens.tolist() == [2, 1]


# ----------------------------------------------------------------------------------------------
# the model-level goal
# ----------------------------------------------------------------------------------------------


def flex_uncompiled(query, key, value, training=False, **kwargs):
    """transformers' flex path without ``torch.compile``: Inductor's CPU FlexAttention has no float64; the
    uncompiled kernel (the same ``mask_mod`` and ``BlockMask``) does."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(query, key, value, **kwargs)


@pytest.fixture(scope="module")
def exact_kernels():
    """Eager attention with its softmax in float64 (test_preference's ``eager_float64``), flex uncompiled
    (module-scoped: hypothesis runs every example inside one fixture)."""
    from transformers.integrations import flex_attention
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    with pytest.MonkeyPatch.context() as mp:
        for mod in (modeling_llama, modeling_qwen2, modeling_qwen3):
            mp.setattr(mod, "eager_attention_forward", eager_float64)
        mp.setattr(flex_attention, "compile_friendly_flex_attention", flex_uncompiled)
        yield


MODELS = {}


def tiny(family: str, impl: str):
    if (family, impl) not in MODELS:
        MODELS[family, impl] = tiny_causal_lm(family, dtype=torch.float64, attn_implementation=impl,
                                              vocab_size=VOCAB, max_position_embeddings=256).eval()
    return MODELS[family, impl]


def unpacked(model, samples):
    """Every sample alone: the log-probability of each of its loss tokens after the first, ``[M]``."""
    out = []
    with torch.no_grad():
        for s, m, _ in samples:
            x = torch.tensor([s])
            logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
            out.append(logp[torch.tensor(m[1:], dtype=torch.bool)])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@given(samples=trees(max_samples=12, vocab=VOCAB))
@settings(max_examples=2)
@example(samples=[([5, 6, 7, 8], [0, 1, 1, 1], 0), ([5, 6, 9], [0, 0, 1], 0), ([5, 10, 11, 12], [0, 1, 0, 1], 1),
                  ([5, 6, 7, 8, 13], [0, 0, 0, 0, 1], 0)])
def test_log_probs_equal_unpacked(family, samples, exact_kernels):
    ids, lengths, mask, groups = flat(samples)
    tree = build_tree(ids, lengths, loss_mask=mask)
    ref_tokens = unpacked(tiny(family, "sdpa"), samples)
    ref = torch.cat(ref_tokens)
    ref_sum = torch.stack([t.sum() for t in ref_tokens])
    for impl in ("eager", "sdpa", "flex_attention"):
        model = tiny(family, impl)
        for window in (None, int(tree.tree_sizes.max()) + 1):
            batch = tree_batch(tree, window=window)
            with torch.no_grad():
                logits = model(**batch.model_inputs(model)).logits
            got, per_seq = token_logps(logits, batch), sequence_logps(logits, batch)
            d = max((got - ref).abs().max().item(), (per_seq.sum - ref_sum).abs().max().item())
            print(f"{family} {impl} window={window} {tuple(batch.shape)} nodes {tree.num_nodes}/{tree.num_sample_tokens}:"
                  f" max |diff| {d:.1e}")
            assert d < TOL, (family, impl, window)
            assert per_seq.num_tokens.tolist() == [t.numel() for t in ref_tokens]


# ----------------------------------------------------------------------------------------------
# the views
# ----------------------------------------------------------------------------------------------


def some_batch(window):
    samples = [([5, 6, 7, 8], [0, 1, 1, 1], 0), ([5, 6, 9, 3, 3], [0, 0, 1, 1, 1], 0), ([5, 10, 11], [0, 1, 1], 0),
               ([4, 6, 7], [0, 1, 1], 0), ([5, 6, 7, 8, 1, 2], [0, 1, 1, 1, 1, 1], 0)]
    ids, lengths, mask, _ = flat(samples)
    return tree_batch(build_tree(ids, lengths, loss_mask=mask), window=window)


@pytest.mark.parametrize("window", [None, 12])
def test_varlen_recipe_equals_the_dense_mask(window):
    """Each branch segment attending to its gathered ancestors then itself (bottom-right causal), against SDPA
    with the dense ancestor mask, float64; the reference varlen attention lives here."""
    b = some_batch(window)
    B, L = b.shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 2, L, 8, dtype=torch.float64) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b.dense_mask()[:, None])
    kw = b.varlen_kwargs()
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    assert cq[-1] == B * L and max(np.diff(cq)) == kw["max_seqlen_q"] and max(np.diff(ck)) == kw["max_seqlen_k"]
    d = (varlen_reference(kw, q, k, v) - want).abs().max().item()
    print(f"varlen recipe: max |diff| {d:.1e}")
    assert d < 1e-12


@pytest.mark.slow  # FlexAttention on the CPU runs unfused (about 10 s on a loaded 2-core machine)
@pytest.mark.parametrize("window", [None, 12])
def test_flex_block_mask_and_mask_mod_equal_the_dense_mask(window):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    b = some_batch(window)
    B, L = b.shape
    q_idx, k_idx = torch.arange(L)[:, None], torch.arange(L)[None, :]
    for r in range(B):
        assert torch.equal(b.mask_mod()(r, 0, q_idx, k_idx), b.dense_mask()[r])
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 2, L, 8, dtype=torch.float64) for _ in range(3))
    got = flex.flex_attention(q, k, v, block_mask=b.block_mask(BLOCK_SIZE=16))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b.dense_mask()[:, None])
    assert (got - want).abs().max().item() < 1e-12


def test_hybrid_linear_attention_and_flash_are_refused_in_one_line():
    b = some_batch(None)
    hybrid = transformers.Qwen3NextConfig(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2) \
        if hasattr(transformers, "Qwen3NextConfig") else None
    for config in filter(None, [hybrid, transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1])]):
        with pytest.raises(ArgumentError, match="state per branch") as e:
            b.model_inputs(config)
        assert "\n" not in str(e.value)
    config = tiny_config("llama")
    config._attn_implementation = "flash_attention_2"
    for config_ in filter(None, [hybrid, transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1])]):
        # under CP too (a review found shard_tree ran a hybrid model silently wrong)
        shard = prefixtree.shard_tree(b, cp_size=2, rank=0)
        with pytest.raises(ArgumentError, match="state per branch") as e:
            shard.hf_cp_kwargs(config_)
        assert "\n" not in str(e.value)
    with pytest.raises(ArgumentError, match=r"pass hf_cp_kwargs\(model\)"):
        prefixtree.shard_tree(b, cp_size=2, rank=0).hf_cp_kwargs()
    assert set(prefixtree.shard_tree(b, cp_size=2, rank=0).hf_cp_kwargs(config)) >= {"cp_tin", "cp_tout"}
    with pytest.raises(ArgumentError, match="takes none") as e:
        b.model_inputs(config)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def test_errors_name_the_sample_and_the_fix():
    with pytest.raises(DataError, match="example 1 has no loss token after its first token"):
        build_tree([1, 2, 1, 3], [2, 2], loss_mask=[0, 1, 1, 0])
    with pytest.raises(DataError, match="example 1 has token id -3"):
        build_tree([1, 2, 1, -3], [2, 2])
    with pytest.raises(DataError, match=r"example 1 has nan \(float\) in 'adv' \(token 0\)"):
        build_tree([1, 2, 1, 3], [2, 2], values={"adv": [0.0, 1.0, float("nan"), 1.0]})
    with pytest.raises(ValueError, match="one number a token"):
        build_tree([1, 2, 1, 3], [2, 2], values={"adv": [0.0, 1.0]})
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        build_tree([1, 2], [2, 0])
    with pytest.raises(DataError, match=r"tree 1 \(from sample 1\) has 4 nodes > window=3; raise window"):
        tree_batch(build_tree([1, 2, 5, 6, 7, 8], [2, 4]), window=3)


# ----------------------------------------------------------------------------------------------
# trees larger than a window, and trees dealt to ranks
# ----------------------------------------------------------------------------------------------


@given(trees(max_samples=40), st.integers(4, 30))
@settings(max_examples=30)
def test_split_trees_cuts_at_node_boundaries_within_the_window(samples, window):
    ids, lengths, mask, _ = flat(samples)
    window = max(window, int(lengths.max()))
    tree = build_tree(ids, lengths, loss_mask=mask)
    part, recomputed = split_trees(tree, window=window)
    cut = subtree(tree, np.arange(lengths.size), groups=part)
    assert cut.tree_sizes.max() <= window
    assert cut.num_nodes == tree.num_nodes + recomputed and recomputed >= 0
    assert np.array_equal(cut.input_ids[cut.path], ids)  # every sample whole, in its order
    assert np.array_equal(cut.score_token, tree.score_token)  # the same loss tokens
    fits = tree.tree_sizes.max() <= window
    assert (recomputed == 0) if fits else True
    # a part never mixes two trees: the tree of a sample is the tree of its part
    tree_of = np.searchsorted(tree.tree_ptr, tree.path[tree.sample_ptr[:-1]], side="right") - 1
    assert all(np.unique(tree_of[part == p]).size == 1 for p in np.unique(part))


def test_split_tree_log_probs_equal_unpacked(exact_kernels):
    """A tree cut across windows (its shared prefix recomputed in each part) still gives every sample's
    log-probabilities as the sample alone does."""
    samples = [([5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1, 1], 0), ([5, 6, 7, 8, 11, 12], [0, 0, 0, 0, 1, 1], 0),
               ([5, 6, 7, 13, 14], [0, 1, 0, 1, 1], 0), ([5, 6, 15, 16, 17, 18], [0, 0, 1, 1, 1, 1], 0),
               ([5, 6, 15, 19], [0, 1, 1, 1], 0)]
    ids, lengths, mask, _ = flat(samples)
    tree = build_tree(ids, lengths, loss_mask=mask)
    assert tree.num_nodes > 10
    part, recomputed = split_trees(tree, window=10)
    with pytest.raises(DataError, match="split_trees"):
        tree_batch(tree, window=10)
    batch = tree_batch(subtree(tree, np.arange(len(samples)), groups=part), window=10)
    ref = torch.cat(unpacked(tiny("llama", "sdpa"), samples))
    for impl in ("eager", "sdpa"):
        model = tiny("llama", impl)
        with torch.no_grad():
            got = token_logps(model(**batch.model_inputs(model)).logits, batch)
        d = (got - ref).abs().max().item()
        print(f"tree of {tree.num_nodes} nodes in windows of 10: {batch.shape[0]} rows, {recomputed} tokens recomputed, "
              f"{impl}: max |diff| {d:.1e}")
        assert d < TOL and recomputed > 0


def reference_nodes(samples) -> int:
    """Nodes of a set of samples sharing their prefixes: its distinct prefixes, counted one by one."""
    return len({tuple(s[:k]) for s in samples for k in range(1, len(s) + 1)})


def reference_dealing_exists(samples, world_size: int, max_tokens: int) -> bool:
    """Whether some dealing exists (every sample fits ``max_tokens``): micro-batches can be split down to single
    samples (a subset never has more nodes), so ``K`` micro-batches exist for every ``K`` from the fewest to
    ``N``, and ``N // world * world`` of them needs ``N % world`` samples merged into others. Exhaustive search for
    that many merges: a sample grows a set (every subset of a set that fits fits), or stays alone."""
    n = len(samples)
    if n < world_size:
        return False

    def merges(free: tuple, need: int) -> bool:
        if need <= 0:
            return True
        if len(free) < 2:
            return False
        first, rest = free[0], free[1:]

        def grow(chosen: list, start: int) -> bool:
            for k in range(start, len(rest)):
                bigger = chosen + [rest[k]]
                if reference_nodes([samples[i] for i in bigger]) > max_tokens:
                    continue
                left = tuple(i for i in rest if i not in bigger)
                if merges(left, need - (len(bigger) - 1)) or grow(bigger, k + 1):
                    return True
            return False

        return grow([first], 0) or merges(rest, need)

    return merges(tuple(range(n)), n % world_size)


def check_deal(tree, deal, world_size: int, max_tokens: int):
    """Every rank the same number of micro-batches, none empty, every sample once, every micro-batch within
    ``max_tokens`` nodes, and ``recomputed`` the nodes forwarded beyond the tree's."""
    n = tree.sample_ptr.size - 1
    assert len(deal.ranks) == world_size
    assert len({len(r) for r in deal.ranks}) == 1 and all(m.size for r in deal.ranks for m in r)
    dealt = np.sort(np.concatenate([m for r in deal.ranks for m in r]))
    assert np.array_equal(dealt, np.arange(n))
    forwarded = 0
    for r in deal.ranks:
        for m in r:
            cut = subtree(tree, m, groups=deal.part[m])
            assert cut.num_nodes <= max_tokens
            forwarded += cut.num_nodes
    assert deal.recomputed == forwarded - tree.num_nodes >= 0


@given(trees(max_samples=30), st.integers(1, 9), st.integers(8, 60))
@settings(max_examples=40)
@example([([1, 2, 3], [0, 1, 1], 0)] * 8, 8, 10)  # one tree of 8 identical samples, 8 ranks
def test_deal_trees_never_starves_or_drops(samples, world_size, max_tokens):
    """No rank is ever empty and every rank gets the same number of micro-batches (TRL PR #7328 found ranks starved
    when a micro-batch held fewer groups than ranks: here one tree is cut between its samples until every rank has
    a part), and every sample is dealt exactly once (open-instruct PR #1271 silently dropped up to world - 1 packed
    sequences a step); fewer samples than ranks is one line. A refusal only where no dealing exists (the
    exhaustive reference): the dealing once refused 15% of RL batches that every rank could take (a review
    found), and this test passed them (it returned on any refusal)."""
    ids, lengths, mask, _ = flat(samples)
    tree = build_tree(ids, lengths, loss_mask=mask)
    max_tokens = max(max_tokens, int(lengths.max()))
    if lengths.size < world_size:
        with pytest.raises(DataError, match=f"{lengths.size} samples for {world_size} ranks") as e:
            deal_trees(tree, world_size=world_size, max_tokens=max_tokens)
        assert "\n" not in str(e.value)
        return
    try:
        deal = deal_trees(tree, world_size=world_size, max_tokens=max_tokens)
    except DataError as e:
        assert "raise max_tokens" in str(e) and "\n" not in str(e)
        assert not reference_dealing_exists([s for s, _, _ in samples], world_size, max_tokens), str(e)
        return
    check_deal(tree, deal, world_size, max_tokens)


def test_deal_trees_cuts_a_tree_to_even_the_micro_batches():
    """A review's case: 4 prompts x 5 completions (20 + 20 tokens: trees of 120 nodes), 3 ranks, max_tokens 200,
    was refused ("rank 1 has 1 micro-batches of single groups") although every tree fits. 4 trees fill 4
    micro-batches; 6 are needed, so two are cut between completions, each recomputing its 20-token prompt."""
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(4):
        prompt = rng.integers(0, 1000, 20).tolist()
        samples += [prompt + rng.integers(0, 1000, 20).tolist() for _ in range(5)]
    ids = np.concatenate(samples)
    lengths = np.full(len(samples), 40)
    tree = build_tree(ids, lengths)
    assert tree.tree_sizes.tolist() == [120] * 4
    deal = deal_trees(tree, world_size=3, max_tokens=200)
    check_deal(tree, deal, 3, 200)
    assert [len(r) for r in deal.ranks] == [2, 2, 2] and deal.recomputed == 40
    for world, max_tokens in [(2, 60), (5, 60), (7, 60), (8, 80), (5, 100), (3, 127)]:  # the review's other refusals
        check_deal(tree, deal_trees(tree, world_size=world, max_tokens=max_tokens), world, max_tokens)


def test_deal_trees_merges_single_samples_when_every_one_alone_is_too_many():
    """Samples that each fill most of ``max_tokens`` but share a prefix: every one alone would be 5 micro-batches
    for 4 ranks, so two that share are merged (4 micro-batches, one a rank); with nothing shared, one line."""
    samples = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19],
               [20, 21, 22, 23, 24, 25]]
    ids, lengths = np.concatenate(samples), np.full(5, 6)
    tree = build_tree(ids, lengths)
    deal = deal_trees(tree, world_size=4, max_tokens=8)
    check_deal(tree, deal, 4, 8)
    assert [len(r) for r in deal.ranks] == [1] * 4 and deal.recomputed == 0
    # one prompt of 12 and 8 completions, pairs fit when two completions have <= 38 tokens: merging the two
    # smallest (17 + 18) first leaves no other pair; 21 + 17 and 19 + 18 make the 6 micro-batches of 6 ranks
    prompt, ends = list(range(100, 112)), [21, 23, 26, 19, 23, 17, 22, 18]
    rollouts = [prompt + list(range(1000 * i, 1000 * i + c)) for i, c in enumerate(ends)]
    tree = build_tree(np.concatenate(rollouts), [len(s) for s in rollouts])
    check_deal(tree, deal_trees(tree, world_size=6, max_tokens=50), 6, 50)
    alone = build_tree(np.arange(30), lengths)
    with pytest.raises(DataError, match="raise max_tokens or send more samples") as e:
        deal_trees(alone, world_size=4, max_tokens=8)
    assert "\n" not in str(e.value) and not reference_dealing_exists(np.arange(30).reshape(5, 6).tolist(), 4, 8)


def rollouts(seed: int, groups: int = 4, n: int = 3):
    """RL rollouts: a prompt, ``n`` completions forking after it, a completion mask and advantages a token."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 6))).tolist()
        for _ in range(n):
            comp = rng.integers(3, VOCAB, int(rng.integers(1, 5))).tolist()
            adv = float(rng.normal())
            out.append({"input_ids": prompt + comp, "completion_mask": [0] * len(prompt) + [1] * len(comp),
                        "advantages": [0.0] * len(prompt) + [adv] * len(comp), "prompt": g})
    return out


def test_tree_collator_in_a_dataloader_with_workers():
    """TreeCollator as a DataLoader's collate_fn with 2 worker processes: the batches the main process would
    collate, their advantages at the scored tokens, and log-probs equal to each rollout alone."""
    data = rollouts(0, groups=6)
    collate = TreeCollator(window=32, group_key="prompt")
    loader = torch.utils.data.DataLoader(data, batch_size=6, collate_fn=collate, num_workers=2)
    got = list(loader)
    assert len(got) == 3
    model = tiny("qwen3", "sdpa")
    for i, batch in enumerate(got):
        chunk = data[6 * i:6 * i + 6]
        want = collate(chunk)
        assert torch.equal(batch.input_ids, want.input_ids) and torch.equal(batch.tout, want.tout)
        assert batch.num_real_tokens < batch.num_sample_tokens  # the prompts once
        adv = torch.cat([torch.tensor(ex["advantages"], dtype=torch.float64)[torch.tensor(ex["completion_mask"], dtype=torch.bool)]
                         for ex in chunk])
        assert torch.equal(batch.token_values["advantages"], adv)
        samples = [(ex["input_ids"], ex["completion_mask"], 0) for ex in chunk]
        with torch.no_grad():
            logp = token_logps(model(**batch.model_inputs(model)).logits, batch)
        d = (logp - torch.cat(unpacked(model, samples))).abs().max().item()
        assert d < TOL, d


def test_tree_collator_says_when_no_loss_mask_reaches_it():
    """Without a loss mask every token after the first is scored: what a Trainer's remove_unused_columns=True
    makes of masked data. TreeCollator says so once (loss_mask="auto"), refuses ("required"), or takes it as meant
    ("none", which refuses a mask it would ignore), as packkit's other collators do."""
    from packkit.rules import ExampleValueError, LossMaskWarning

    bare = [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 4]}]
    collate = TreeCollator()
    with pytest.warns(LossMaskWarning, match="remove_unused_columns=False"):
        batch = collate(bare)
    assert int(batch.score_target.numel()) == 4  # every token after the first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collate(bare)  # once per collator
        TreeCollator(loss_mask="none")(bare)
    with pytest.raises(ExampleValueError, match="example 0 has no loss mask"):
        TreeCollator(loss_mask="required")(bare)
    with pytest.raises(ExampleValueError, match="loss_mask='none'"):
        TreeCollator(loss_mask="none")([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}])
