"""Log-probabilities in tiles (``packkit.logps``) and through the packed batches and TRL's DPOTrainer.

The reference is the obvious computation, in this file: ``log_softmax`` over the full ``[M, V]`` rows of the
logits, gathered at the targets. Tiled from logits and fused with the LM head, values and gradients must equal
it within 1e-10 in float64 for any tile size (hypothesis), for softcapped and scaled heads (Gemma 2, Cohere),
and through real models (Llama, Qwen2, Qwen3) on pairs, groups and trees. A guard that fails if a full-vocabulary
log-softmax (or the model's full logits) came back: every tensor made during the packed DPO loss and its backward
is recorded (a ``TorchDispatchMode``), and none with the vocabulary as its last dimension may exceed one tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from packkit import logps as L
from packkit.errors import ArgumentError
from packkit.preference import GroupCollator, PreferenceCollator, forward_logps, sequence_logps

transformers = pytest.importorskip("transformers")

from testlib import tiny_causal_lm  # noqa: E402

TOL = 1e-10


def reference(logits, source, target, temperature=1.0):
    """The full-vocabulary log-softmax: what the tiles must equal."""
    rows = logits.reshape(-1, logits.shape[-1])[source] / temperature
    return rows.log_softmax(-1).gather(1, target[:, None])[:, 0]


def grads(out, weights, inputs):
    return torch.autograd.grad((out * weights).sum(), inputs)


def maxdiff(a, b):
    return max(float((x - y).detach().abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# the tiles against the full log-softmax
# ----------------------------------------------------------------------------------------------


@given(rows=st.integers(1, 9), vocab=st.integers(1, 70), width=st.integers(1, 6), m=st.integers(0, 20),
       tile=st.sampled_from([1, 2, 7, 64, 1 << 23]), temperature=st.sampled_from([1.0, 0.7]),
       transform=st.sampled_from([(1.0, None), (0.25, 3.0), (2.0, None)]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_tiles_equal_the_full_log_softmax(rows, vocab, width, m, tile, temperature, transform, bias, seed):
    """Any tile (one logit a tile included), sources repeated (a tree's prompt predicts every continuation's
    first token), any temperature, a soft cap and a scale: values and gradients within 1e-10 in float64."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    source = torch.randint(0, rows, (m,), generator=g)
    target = torch.randint(0, vocab, (m,), generator=g)
    w = torch.randn(m, generator=g, dtype=torch.float64)
    want = reference(logits, source, target, temperature)
    got = L.logits_logps(logits, source, target, temperature=temperature, tile_elements=tile)
    d = (maxdiff([got], [want]), maxdiff(grads(got, w, logits), grads(want, w, logits)))
    # the fused head: hidden [rows, width] through weight [vocab, width], scale and soft cap
    hidden = torch.randn(rows, width, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    scale, cap = transform
    y = (hidden @ weight.t() + (0 if b is None else b)) * scale
    z = y if cap is None else cap * torch.tanh(y / cap)
    inputs = (hidden, weight) + ((b,) if bias else ())
    want_h = reference(z, source, target, temperature)
    got_h = L.head_logps(hidden, L.LMHead(weight, b, scale, cap), source, target, temperature=temperature,
                         tile_elements=tile)
    d += (maxdiff([got_h], [want_h]), maxdiff(grads(got_h, w, inputs), grads(want_h, w, inputs)))
    print(f"max |diff| logits {d[0]:.1e} (grad {d[1]:.1e}), fused head {d[2]:.1e} (grads {d[3]:.1e})")
    assert max(d) < TOL


def test_tiles_half_precision_read_in_float32():
    """bfloat16 logits are read in float32 (the log-sum-exp of a vocabulary loses digits in 16 bits), as before;
    the logits' gradient comes back in their own dtype, not a float32 copy of them."""
    logits = torch.randn(3, 50, dtype=torch.bfloat16, requires_grad=True)
    source, target = torch.tensor([0, 2, 2]), torch.tensor([4, 9, 49])
    got = L.logits_logps(logits, source, target, tile_elements=16)
    assert got.dtype == torch.float32
    assert maxdiff([got], [reference(logits.float(), source, target)]) < 1e-6
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_bad_arguments_are_refused():
    with pytest.raises(ArgumentError, match="temperature must be a finite number > 0, got 0"):
        L.logits_logps(torch.zeros(2, 3), torch.tensor([0]), torch.tensor([1]), temperature=0)
    with pytest.raises(ValueError, match=r"source \(2,\) and target \(1,\) must be two \[M\] index tensors"):
        L.logits_logps(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([1]))


# ----------------------------------------------------------------------------------------------
# through models: the fused head equals the model's own logits
# ----------------------------------------------------------------------------------------------

VOCAB = 97


def tiny(kind, seed=0, **kw):
    impl = "eager" if kind == "gemma2" else "sdpa"  # Gemma 2 has no sdpa path in transformers
    return tiny_causal_lm(kind, dtype=torch.float64, attn_implementation=impl, seed=seed, vocab_size=VOCAB,
                          max_position_embeddings=256, **kw)


def random_groups(seed, n, k):
    rng = np.random.default_rng(seed)
    return [{"prompt_ids": rng.integers(3, VOCAB, int(rng.integers(1, 9))).tolist(),
             "completion_ids": [rng.integers(3, VOCAB, int(rng.integers(1, 8))).tolist() for _ in range(k)]}
            for _ in range(n)]


def fused_and_full(model, batch):
    """(fused SequenceLogps, full-logits SequenceLogps, gradient max |diff|) on ``batch``: the old path, the full
    ``log_softmax`` of the model's logits, is the reference, gradients of a weighted sum against every weight."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused, _ = forward_logps(model, batch)
    logits = model(**batch.model_inputs(model)).logits
    full = reference(logits, batch.score_source, batch.input_ids.reshape(-1)[batch.score_target])
    w = torch.linspace(-1, 1, full.shape[0], dtype=full.dtype)
    d = maxdiff(grads(fused.tokens, w, params), grads(full, w, params))
    return fused, full, d


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma2", "cohere"])
def test_forward_logps_equal_the_full_logits(kind):
    """The fused head inside the real model (tiny Llama, Qwen2, Qwen3; Gemma 2's soft cap, Cohere's logit
    scale): per-token and per-sequence values and every weight's gradient equal the full log-softmax of the
    model's logits, for groups and pairs, packed as pairs or trees (Llama: in one row and in windows)."""
    model = tiny(kind)
    groups, pairs = random_groups(0, 3, 3), random_groups(1, 3, 2)
    pairs = [{"prompt_ids": g["prompt_ids"], "chosen_ids": g["completion_ids"][0],
              "rejected_ids": g["completion_ids"][1]} for g in pairs]
    cases = [("tree", None), ("pairs", 64)] + ([("pairs", None), ("tree", 64)] if kind == "llama" else [])
    for layout, window in cases:
        for batch in (GroupCollator(layout=layout, window=window)(groups),
                      PreferenceCollator(layout=layout, window=window)(pairs)):
            fused, full, dgrad = fused_and_full(model, batch)
            d = maxdiff([fused.tokens, fused.sum], [full, L.segment_sums(full, batch.score_sequence,
                                                                          batch.num_sequences)])
            print(f"{kind} {layout} window={window} {batch.shape}: values {d:.1e}, gradients {dgrad:.1e}")
            assert d < TOL and dgrad < TOL


def test_forward_logps_on_a_prefix_tree():
    """Prefix trees (packkit.prefixtree: several levels of shared prefixes) through the same path: per-token and
    per-sample values and every weight's gradient equal the full log-softmax of the model's logits."""
    from packkit.prefixtree import build_tree, tree_batch

    rng = np.random.default_rng(5)
    trunk = rng.integers(3, VOCAB, 6).tolist()
    samples = [trunk + rng.integers(3, VOCAB, int(n)).tolist() for n in (3, 1, 4)]
    samples += [samples[0][:8] + rng.integers(3, VOCAB, 2).tolist(), rng.integers(3, VOCAB, 5).tolist()]
    tree = build_tree(np.concatenate(samples), [len(x) for x in samples])
    assert tree.num_nodes < tree.num_sample_tokens
    model = tiny("llama")
    for window in (None, int(tree.tree_sizes.max()) + 2):
        batch = tree_batch(tree, window=window)
        fused, full, dgrad = fused_and_full(model, batch)
        d = maxdiff([fused.tokens, fused.sum], [full, L.segment_sums(full, batch.score_sequence, batch.num_sequences)])
        print(f"tree window={window} {tuple(batch.shape)}: values {d:.1e}, gradients {dgrad:.1e}")
        assert d < TOL and dgrad < TOL


def test_a_head_that_is_not_read_is_refused():
    """A forward that scales its logits in a way LMHead does not read (here a config attribute removed after the
    model was built) is refused in one line by the check on the position the model computed, never approximated."""
    model = tiny("cohere")
    batch = PreferenceCollator()([{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9]}])
    model.config.logit_scale = None  # LMHead.of reads no scale; the model's forward still applies its own
    model.logit_scale = 0.0625
    with pytest.raises(ArgumentError, match="CohereForCausalLM's logits are not its LM head's output"):
        forward_logps(model, batch)


# ----------------------------------------------------------------------------------------------
# the guard: no [tokens, vocab] tensor beyond one tile
# ----------------------------------------------------------------------------------------------


class VocabTensors(TorchDispatchMode):
    """Records the shape of every floating tensor an op makes whose last dimension is the vocabulary."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in given):  # a view (weight.t()) makes no numbers
                self.shapes.append(tuple(t.shape))
        return out


def test_no_full_vocabulary_tensor_in_packed_logps(monkeypatch):
    """Fails if the full-vocabulary log_softmax comes back: with a tile of 64 logits, no tensor made in the
    forward and backward of packed log-probs has more than a tile's numbers over the vocabulary, except the last
    position's logits (``logits_to_keep=1``) and, from given logits, their own gradient. Before, the forward made
    the [M, V] rows twice over (the gathered rows, their log_softmax) and the model its [1, T, V] logits."""
    monkeypatch.setattr(L, "TILE_ELEMENTS", 64)
    model = tiny("llama")
    batch = GroupCollator(layout="tree")(random_groups(2, 4, 3))
    with VocabTensors(VOCAB) as seen:
        got, _ = forward_logps(model, batch)
        got.sum.sum().backward()
    rows = batch.shape[0]
    big = [s for s in seen.shapes if int(np.prod(s)) > max(64, rows * VOCAB)]
    print(f"{len(seen.shapes)} vocabulary tensors, largest {max(seen.shapes, key=np.prod)}; over a tile: {big}")
    assert seen.shapes and not big
    logits = model(**batch.model_inputs(model)).logits.detach().requires_grad_()
    with VocabTensors(VOCAB) as seen:
        sequence_logps(logits, batch).sum.sum().backward()
    big = [s for s in seen.shapes if int(np.prod(s)) > 64 and s != (logits.shape[0] * logits.shape[1], VOCAB)]
    assert not big, big


# ----------------------------------------------------------------------------------------------
# the real consumer: TRL's DPOTrainer with PackedDPOMixin
# ----------------------------------------------------------------------------------------------


def full_logits_dpo_loss(trainer, batch):
    """The packed DPO loss as it was computed before the fused head: the full log_softmax of both models'
    logits (``sequence_logps``' old body, written out), TRL's sigmoid loss on the sums."""
    def sums(model):
        per_token = reference(model(**batch.model_inputs(model)).logits, batch.score_source,
                              batch.input_ids.reshape(-1)[batch.score_target])
        return L.segment_sums(per_token, batch.score_sequence, batch.num_sequences).view(-1, 2)

    policy = sums(trainer.model)
    with torch.no_grad():
        ref = sums(trainer.ref_model)
    delta = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
    return -torch.nn.functional.logsigmoid(trainer.beta * delta).mean()


@pytest.mark.slow  # a real DPOTrainer: make test runs it, make test-fast does not
@pytest.mark.parametrize("layout", ["pairs", "tree"])
def test_packed_dpo_trainer_loss_and_gradients_unchanged_and_no_vocabulary_tensor(tmp_path, monkeypatch, layout):
    """PackedDPOTrainer's compute_loss (policy and reference through the fused head) against the full-logits
    loss it computed before, on the same packed batch: loss and every weight's gradient within 1e-10 (float64).
    Inside compute_loss and its backward no tensor over the vocabulary exceeds a tile (64 logits) but the last
    positions' logits; then two optimiser steps train (the loss is finite and the weights move)."""
    pytest.importorskip("trl")
    import datasets
    from test_preference import PackedDPOTrainer, dpo_args, preference_rows, tokenizer

    monkeypatch.setattr(L, "TILE_ELEMENTS", 64)
    rows = preference_rows(8, 4, conversational=True)
    collator = PreferenceCollator(layout=layout, window=64, tokenizer=tokenizer())
    # models of this file (a vocabulary of 97: no other dimension of the run is 97)
    trainer = PackedDPOTrainer(model=tiny("llama"), ref_model=tiny("llama", seed=1),
                               args=dpo_args(tmp_path, max_steps=2), train_dataset=datasets.Dataset.from_list(rows),
                               processing_class=tokenizer(), data_collator=collator)
    batch = collator(rows[:4])
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    vocab = trainer.model.config.vocab_size
    with VocabTensors(vocab) as seen:
        loss = trainer.compute_loss(trainer.model, batch)
        got = torch.autograd.grad(loss, params)
    want_loss = full_logits_dpo_loss(trainer, batch)
    want = torch.autograd.grad(want_loss, params)
    big = [s for s in seen.shapes if int(np.prod(s)) > max(64, batch.shape[0] * vocab)]
    d = (abs(float(loss - want_loss)), maxdiff(got, want))
    print(f"{layout}: loss {float(loss):.12f} vs full logits {float(want_loss):.12f} (|diff| {d[0]:.1e}), "
          f"gradients {d[1]:.1e}; vocabulary tensors over a tile: {big}")
    assert max(d) < TOL and not big
    before = [p.detach().clone() for p in params]
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(np.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
