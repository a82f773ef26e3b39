"""packkit.loss: loss-token counting, the token-normalised loss, exact gradient accumulation.

References live here: a per-token Python loop for the count and the cross entropy, and the gradient
of the whole step's data at once for accumulation.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from testlib import tiny_causal_lm, tiny_token_lm

from packkit.loss import (
    AccumulationStep,
    accumulation_step,
    count_loss_tokens,
    hf_compute_loss_func,
    token_normalized_loss,
)

IGNORE = -100


# ----------------------------------------------------------------------------------------------
# slow, obvious references
# ----------------------------------------------------------------------------------------------


def count_ref(labels, shifted):
    rows = labels if labels.ndim == 2 else labels[None]
    n = 0
    for row in rows.tolist():
        for t, y in enumerate(row):
            if (shifted or t > 0) and y != IGNORE:
                n += 1
    return n


def summed_ce_ref(logits, labels, shifted):
    """Sum over (row, t) of -log softmax(logits[row, t])[target], target = labels[row, t + 1] (or t)."""
    logits = logits if logits.dim() == 3 else logits[None]
    labels = labels if labels.dim() == 2 else labels[None]
    total = torch.zeros((), dtype=torch.float64)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            j = t if shifted else t + 1
            if j >= labels.shape[1] or labels[b, j] == IGNORE:
                continue
            total = total - torch.log_softmax(logits[b, t].double(), -1)[labels[b, j]]
    return total


labels_2d = st.integers(1, 4).flatmap(
    lambda b: st.integers(1, 9).flatmap(
        lambda t: st.lists(st.lists(st.sampled_from([IGNORE, IGNORE, 0, 1, 2, 3, 4]), min_size=t, max_size=t),
                           min_size=b, max_size=b)
    )
)


# ----------------------------------------------------------------------------------------------
# counting
# ----------------------------------------------------------------------------------------------


@given(labels_2d, st.booleans(), st.booleans())
@example([[IGNORE]], False, True)  # one token: no loss token
@example([[3]], False, False)  # one token, unshifted: its label is never a target
@example([[IGNORE] * 9] * 4, True, False)  # zero loss tokens
def test_count_matches_reference(rows, shifted, as_numpy):
    labels = np.array(rows, dtype=np.int64)
    got = count_loss_tokens(labels if as_numpy else torch.from_numpy(labels), shifted=shifted)
    assert isinstance(got, int)
    assert got == count_ref(labels, shifted)
    assert count_loss_tokens(labels[0], shifted=shifted) == count_ref(labels[0], shifted)


def test_count_reads_dicts_shift_labels_and_objects():
    labels = torch.tensor([[7, 1, IGNORE, 2]])
    assert count_loss_tokens({"labels": labels}) == 2
    assert count_loss_tokens({"labels": labels, "shift_labels": labels}) == 3  # shift_labels: already shifted

    class Batch:
        pass

    b = Batch()
    b.labels = labels
    assert count_loss_tokens(b) == 2


def test_count_bad_input():
    with pytest.raises(TypeError, match="integer"):
        count_loss_tokens(torch.zeros(2, 3))
    with pytest.raises(KeyError, match="labels"):
        count_loss_tokens({"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="PackedBatch"):
        count_loss_tokens(object())


# ----------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(labels_2d, st.booleans(), st.integers(0, 2**31 - 1), st.sampled_from([None, 1, 7, 1000]), st.booleans())
@example([[IGNORE] * 3] * 2, False, 0, None, False)  # zero loss tokens: 0, not NaN
@example([[4]], False, 1, None, True)  # one token, unshifted: nothing to predict
@example([[4]], True, 2, 1, True)
def test_loss_matches_reference(rows, shifted, seed, count, flat):
    labels = torch.tensor(rows, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*labels.shape, 5, generator=gen, dtype=torch.float64)
    if flat:  # (T, V) with (T,)
        labels, logits = labels[0], logits[0]
    got = token_normalized_loss(logits, labels, num_loss_tokens=count, shifted=shifted)
    n = count_ref(labels.numpy(), shifted) if count is None else count
    want = summed_ce_ref(logits, labels, shifted) / max(n, 1)
    print("diff", float((got - want).abs()))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_loss_count_as_tensor_and_zero_count_is_zero_not_nan():
    logits = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.full((2, 4), IGNORE)
    loss = token_normalized_loss(logits, labels)
    assert float(loss.detach()) == 0.0
    loss.backward()  # still differentiable: a rank whose micro-batch has no loss token joins backward
    assert torch.all(logits.grad == 0)
    labels[0, 2] = 1
    a = token_normalized_loss(logits, labels, num_loss_tokens=torch.tensor(4))
    b = token_normalized_loss(logits, labels, num_loss_tokens=4)
    torch.testing.assert_close(a, b)


def test_loss_upcasts_bf16_to_fp32():
    logits = torch.randn(1, 600, 50).to(torch.bfloat16)
    labels = torch.randint(0, 50, (1, 600))
    got = token_normalized_loss(logits, labels, num_loss_tokens=599)
    assert got.dtype == torch.float32
    want = summed_ce_ref(logits.double(), labels, False) / 599
    print("bf16-input diff", float((got.double() - want).abs()))
    assert abs(float(got) - float(want)) < 1e-5


def test_loss_bad_input():
    with pytest.raises(ValueError, match="do not match"):
        token_normalized_loss(torch.zeros(1, 4, 3), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="floating-point"):
        token_normalized_loss(torch.zeros(1, 4, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 0"):
        token_normalized_loss(torch.zeros(1, 4, 3), torch.zeros(1, 4, dtype=torch.long), num_loss_tokens=-1)


def test_hf_compute_loss_func_matches_transformers_for_causal_lm_loss():
    """``compute_loss_func`` for HF Trainer agrees with transformers' own ForCausalLMLoss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :3] = IGNORE
    labels[2, 5:] = IGNORE
    n = count_loss_tokens(labels) + 13  # the count of a whole accumulation window, larger than this batch's
    want = ForCausalLMLoss(logits, labels, vocab_size=11, num_items_in_batch=torch.tensor(n))
    got = hf_compute_loss_func({"logits": logits}, labels, num_items_in_batch=torch.tensor(n))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
    got_mean = hf_compute_loss_func({"logits": logits}, labels)
    torch.testing.assert_close(got_mean.double(), ForCausalLMLoss(logits, labels, vocab_size=11).double(),
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# accumulation is exact (invariant 7)
# ----------------------------------------------------------------------------------------------

VOCAB = 13


def tiny_lm(seed=0):
    return tiny_token_lm(VOCAB, 6, seed=seed)


def make_micro_batch(rng, loss_tokens, masked):
    """[1, T] row: the first token and ``masked`` prompt tokens with label -100, then ``loss_tokens``."""
    t = masked + 1 + loss_tokens
    ids = torch.from_numpy(rng.integers(0, VOCAB, t))[None]
    labels = ids.clone()
    labels[0, : masked + 1] = IGNORE  # first label is never a target after the shift
    return {"input_ids": ids, "labels": labels}


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@settings(max_examples=12)
@given(
    st.lists(st.integers(20, 1200), min_size=2, max_size=4),
    st.lists(st.integers(0, 40), min_size=4, max_size=4),
    st.integers(0, 2**31 - 1),
)
def test_accumulated_gradient_equals_whole_batch_and_mean_of_means_does_not(loss_counts, masked, seed):
    assume(max(loss_counts) >= 3 * min(loss_counts))
    rng = np.random.default_rng(seed)
    mbs = [make_micro_batch(rng, c, m) for c, m in zip(loss_counts, masked)]
    counts = [count_loss_tokens(mb["labels"]) for mb in mbs]
    assert counts == loss_counts

    # whole batch at once: every token of the step in one forward, mean over all loss tokens
    model = tiny_lm()
    ids = torch.cat([mb["input_ids"][0] for mb in mbs])
    # shift inside each micro-batch: build the targets row by row, then one mean
    logits = torch.cat([model(mb["input_ids"][0]) for mb in mbs])
    targets = torch.cat([torch.cat([mb["labels"][0, 1:], torch.tensor([IGNORE])]) for mb in mbs])
    assert logits.shape[0] == ids.shape[0]
    torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE).backward()
    want = grads(model)

    model = tiny_lm()
    step = accumulation_step(mbs)
    assert step.num_loss_tokens == sum(counts) and step.micro_loss_tokens == tuple(counts)
    assert step.world_size == 1 and step.grad_multiplier == 1.0
    logged = 0.0
    for mb in mbs:
        loss = step.loss(model(mb["input_ids"]), mb)
        loss.backward()
        logged += loss.detach()
    got = grads(model)

    naive_model = tiny_lm()
    for mb in mbs:  # what trainers shipped: each micro-batch's own mean, divided by accumulation steps
        (token_normalized_loss(naive_model(mb["input_ids"]), mb["labels"]) / len(mbs)).backward()
    naive = grads(naive_model)

    err, naive_err = float((got - want).abs().max()), float((naive - want).abs().max())
    print(f"counts {counts}: packkit max diff {err:.2e}, mean-of-means max diff {naive_err:.2e}")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert naive_err > 1e-3 * float(want.abs().max())
    assert math.isclose(step.mean_loss(logged), float(
        torch.nn.functional.cross_entropy(logits.detach(), targets, ignore_index=IGNORE)), rel_tol=1e-12)


class FakePacked:
    """The PackedBatch fields the helper reads; it trusts ``num_loss_tokens`` (no device work)."""

    def __init__(self, labels, cu_seqlens, seq_idx):
        self.labels = torch.tensor(labels)
        self.cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
        self.seq_idx = torch.tensor(seq_idx, dtype=torch.int32)
        self.num_loss_tokens = int((self.labels != IGNORE).sum())


def test_accumulation_step_counts_tokens_examples_and_packed_batch_fields():
    # padding-free row: documents of 3 and 2 tokens, then a padding tail of 2
    free = FakePacked([[IGNORE, 1, 2, IGNORE, 3, IGNORE, IGNORE]], [0, 3, 5, 7], [[0, 0, 0, 1, 1, 2, 2]])
    # two windows of 4: [doc 3 | pad 1], [doc 2 | pad 2], plus a zero-length static-shape segment
    windows = FakePacked([[IGNORE, 1, 2, IGNORE], [IGNORE, 3, IGNORE, IGNORE]], [0, 3, 4, 6, 8, 8],
                         [[0, 0, 0, 1], [2, 2, 3, 3]])
    padded = {
        "labels": torch.tensor([[IGNORE, 4, 5], [IGNORE, 6, IGNORE]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    step = accumulation_step([free, windows, padded, torch.tensor([IGNORE, 7, 8, 9])])
    assert step.micro_loss_tokens == (3, 3, 3, 3)
    assert step.num_loss_tokens == 12
    assert step.num_tokens == 5 + 5 + 5 + 4
    assert step.num_examples == 2 + 2 + 2 + 1
    assert step.as_dict()["tokens_per_step"] == 19
    assert step.scale == pytest.approx(1 / 12)
    assert isinstance(step, AccumulationStep)
    # ddp_average without a process group changes nothing
    assert accumulation_step([padded], ddp_average=True).grad_multiplier == 1.0


def test_accumulation_step_shifted_labels():
    step = accumulation_step([torch.tensor([[5, 6, IGNORE]])], shifted=True)
    assert step.num_loss_tokens == 2
    logits = torch.zeros(1, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(step.loss(logits, torch.tensor([[5, 6, IGNORE]])),
                               torch.tensor(math.log(8), dtype=torch.float64))


def test_accumulation_step_bad_input():
    with pytest.raises(ValueError, match="at least one micro-batch"):
        accumulation_step([])
    with pytest.raises(TypeError, match="list of the step's micro-batches"):
        accumulation_step(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(KeyError, match="micro-batch 1"):
        accumulation_step([{"labels": torch.zeros(1, 2, dtype=torch.long)}, {"input_ids": torch.zeros(1, 2)}])
    with pytest.raises(ValueError, match="init_process_group"):
        accumulation_step([torch.zeros(1, 2, dtype=torch.long)], all_reduce=True)


# ----------------------------------------------------------------------------------------------
# packed and padded batches of the same examples
# ----------------------------------------------------------------------------------------------


def tiny_llama(seed=0):
    return tiny_causal_lm(seed=seed, vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                          num_key_value_heads=1).train()


@pytest.mark.parametrize("layout", ["padding_free", "windows"])
def test_packed_and_padded_give_the_same_loss_and_gradient(layout):
    """The same 4 examples, padded [4, Lmax] with a mask, or packed without a mask (reset positions)."""
    g = torch.Generator().manual_seed(3)
    lens = [5, 11, 3, 8]
    prompt = [2, 4, 0, 3]  # prompt tokens carry no loss
    docs = [torch.randint(0, 32, (n,), generator=g) for n in lens]

    # padded: HF convention, labels = input ids with -100 on prompt and padding
    L = max(lens)
    ids = torch.zeros(len(docs), L, dtype=torch.long)
    mask = torch.zeros(len(docs), L, dtype=torch.long)
    labels = torch.full((len(docs), L), IGNORE)
    for i, (d, p) in enumerate(zip(docs, prompt)):
        ids[i, : len(d)] = d
        mask[i, : len(d)] = 1
        labels[i, p: len(d)] = d[p:]
    n_padded = count_loss_tokens(labels)

    # packed: labels -100 on the first token of every document (and on prompts), positions reset
    def packed_row(group):
        row_ids = torch.cat([docs[i] for i in group])
        row_lab = torch.cat([torch.cat([torch.full((max(prompt[i], 1),), IGNORE), docs[i][max(prompt[i], 1):]])
                             for i in group])
        pos = torch.cat([torch.arange(lens[i]) for i in group])
        return row_ids, row_lab, pos

    groups = [[0, 1, 2, 3]] if layout == "padding_free" else [[1, 0], [3, 2]]
    rows = [packed_row(grp) for grp in groups]
    W = max(r[0].numel() for r in rows)

    def pad(x, value):
        return torch.cat([x, torch.full((W - x.numel(),), value, dtype=x.dtype)])

    p_ids = torch.stack([pad(r[0], 0) for r in rows])
    p_lab = torch.stack([pad(r[1], IGNORE) for r in rows])
    # a padding tail is its own segment from position 0
    p_pos = torch.stack([torch.cat([r[2], torch.arange(W - r[0].numel())]) for r in rows])
    n_packed = count_loss_tokens(p_lab)
    assert n_packed == n_padded

    model = tiny_llama()
    out = model(input_ids=ids, attention_mask=mask)
    loss_padded = token_normalized_loss(out.logits, labels, num_loss_tokens=n_padded)
    loss_padded.backward()
    g_padded = grads(model)
    hf_loss = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_padded).loss

    model = tiny_llama()
    out = model(input_ids=p_ids, position_ids=p_pos, use_cache=False)
    loss_packed = token_normalized_loss(out.logits, p_lab, num_loss_tokens=n_packed)
    loss_packed.backward()
    g_packed = grads(model)

    print("loss diff", float((loss_packed - loss_padded).detach().abs()), "grad diff", float((g_packed - g_padded).abs().max()))
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-10, atol=1e-12)
    # HF's num_items_in_batch convention gives the same loss (HF computes it in float32: logits.float())
    torch.testing.assert_close(hf_loss.double(), loss_padded.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_packed, g_padded, rtol=1e-9, atol=1e-11)


def test_pre_shifted_batch_counts_one_way():
    """Before the fix, with mask_first_label=False (pre-shifted labels) batch.num_loss_tokens counted every
    label (2) while count_loss_tokens and step.loss read labels[..., 1:] (1 term), and
    accumulation_step trusted the batch's 2: the divisor disagreed with the summed terms. The batch
    now says labels_shifted and every count and the loss follow it."""
    from packkit.collate import PaddingFreeCollator

    b = PaddingFreeCollator(mask_first_label=False)([{"input_ids": [5, 6, 7], "labels": [6, 7, -100]},
                                                     {"input_ids": [8, 9], "labels": [9, -100]}])
    step = accumulation_step([b])
    assert b.num_loss_tokens == count_loss_tokens(b) == step.num_loss_tokens == 3
    logits = torch.randn(1, 5, 11, dtype=torch.float64)
    want = torch.nn.functional.cross_entropy(logits[0], torch.tensor([6, 7, IGNORE, 9, IGNORE]),
                                             ignore_index=IGNORE)  # logits t against labels t
    assert torch.allclose(step.loss(logits, b), want)
    # the same through the mapping rebuild Trainer does
    r = type(b)({k: v for k, v in b.items()})
    assert count_loss_tokens(r) == accumulation_step([r]).num_loss_tokens == 3
    # and HF's own loss, fed the view, agrees (it reads shift_labels as given)
    from transformers.loss.loss_utils import ForCausalLMLoss

    hf = b.hf_kwargs()
    got = ForCausalLMLoss(logits, hf["labels"], 11, shift_labels=hf["shift_labels"])  # HF upcasts to float32
    assert torch.allclose(got.double(), want, atol=1e-6)


def test_last_document_without_loss_tokens_is_not_padding():
    """Before the fix, a padding-free batch of [5, 6, 7] and [8] whose last document has no loss label was
    counted as 3 tokens and 1 example (the last segment taken for padding). Collated batches carry
    the exact counts now."""
    from packkit.collate import FixedWindowCollator, PaddingFreeCollator

    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    step = accumulation_step([PaddingFreeCollator()(examples)])
    assert (step.num_tokens, step.num_examples) == (4, 2)
    # a window exactly filled whose last document has no loss tokens
    full = FixedWindowCollator(window=4, strategy="next_fit")(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]},
         {"input_ids": [1, 2], "labels": [-100, 2]}])
    step = accumulation_step([full, full])
    assert (step.num_tokens, step.num_examples, step.num_loss_tokens) == (12, 6, 6)
