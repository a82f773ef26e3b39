"""A real Hugging Face model (tiny random LlamaForCausalLM, CPU, fp32, sdpa): a packed batch gives
the logits and summed loss of running every document alone, and the pitfalls that break it.

Found with transformers 5.24: with ``attn_implementation="sdpa"`` the model isolates documents
from reset ``position_ids`` (``masking_utils.find_packed_sequence_indices``) only when there is no
``attention_mask`` and no cache object. ``PackedBatch.hf_kwargs()`` therefore carries no mask and
``use_cache=False``; a 2-D mask of ones, or leaving ``use_cache`` at its default (a cache is then
created, in train mode too), makes tokens attend across documents.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from testlib import tiny_causal_lm  # noqa: E402

from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator  # noqa: E402

TOL = 1e-4  # fp32
LENGTHS = (5, 9, 3, 7, 1, 6)


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm(dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 101, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100  # a prompt
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def alone(model, ex):
    """Logits ``(n, vocab)`` and summed loss of one document run by itself."""
    ids = torch.tensor([ex["input_ids"]])
    labels = torch.tensor([ex["labels"]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    logits = out.logits[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], labels[0, 1:], ignore_index=-100, reduction="sum")
    return logits, loss


def summed_loss(logits, labels):
    """Sum of the shifted token losses of a batch (the model's shift: logits[t] predicts labels[t+1])."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


def report(name, diff):
    print(f"{name}: max abs diff {diff:.3e}")


def test_padding_free_row_equals_each_document_alone(model, examples):
    batch = PaddingFreeCollator()(examples)
    with torch.no_grad():
        out = model(**batch)
    refs = [alone(model, ex) for ex in examples]
    ref_logits = torch.cat([r[0] for r in refs])
    ref_loss = sum(r[1] for r in refs)
    diff = (out.logits[0] - ref_logits).abs().max().item()
    loss = summed_loss(out.logits, batch.labels)
    report("logits", diff)
    report("summed loss", abs(loss - ref_loss).item())
    assert diff < TOL
    assert abs(loss - ref_loss).item() < TOL * max(1.0, ref_loss.item())
    # the model's own (mean) loss is the summed loss over num_loss_tokens
    assert abs(out.loss.item() - ref_loss.item() / batch.num_loss_tokens) < TOL


def test_fixed_windows_equal_each_document_alone(model, examples):
    """[B, W] windows with padding tails, through the same HF view: every real token as alone."""
    batch = FixedWindowCollator(window=12, num_windows=4)(examples)
    with torch.no_grad():
        out = model(**batch)
    lengths = [len(ex["input_ids"]) for ex in examples]
    refs = {}
    for ex in examples:
        refs[tuple(ex["input_ids"])] = alone(model, ex)
    cu = batch.cu_seqlens.tolist()
    flat_logits = out.logits.reshape(-1, out.logits.shape[-1])
    flat_ids = batch.input_ids.reshape(-1).tolist()
    seen, diff = 0, 0.0
    for a, b in zip(cu, cu[1:]):
        key = tuple(flat_ids[a:b])
        if key in refs and b - a in lengths:
            diff = max(diff, (flat_logits[a:b] - refs[key][0]).abs().max().item())
            seen += 1
    report("windows logits", diff)
    assert seen == len(examples) and diff < TOL
    ref_loss = sum(r[1] for r in refs.values())
    assert abs(summed_loss(out.logits, batch.labels) - ref_loss).item() < TOL * max(1.0, ref_loss.item())


def test_explicit_4d_mask_also_isolates(model, examples):
    """The explicit-mask view: ``hf_mask`` (additive float, 4-D; HF uses a 4-D mask as is). Every model
    family, eager too, in test_hf_masks.py."""
    batch = PaddingFreeCollator()(examples)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                    attention_mask=batch.hf_mask(model), use_cache=False)
    ref = torch.cat([alone(model, ex)[0] for ex in examples])
    diff = (out.logits[0] - ref).abs().max().item()
    report("4-D mask logits", diff)
    assert diff < TOL


def test_padded_fallback_equals_each_document_alone(model, examples):
    batch = PaddedCollator()(examples)
    with torch.no_grad():
        out = model(**batch)
    diff = 0.0
    for r, ex in enumerate(examples):
        n = len(ex["input_ids"])
        diff = max(diff, (out.logits[r, :n] - alone(model, ex)[0]).abs().max().item())
    report("padded logits", diff)
    assert diff < TOL


@pytest.mark.parametrize("pitfall", ["attention_mask_of_ones", "use_cache_default"])
def test_pitfalls_make_documents_attend_across(model, examples, pitfall):
    """Regression tests for the HF pitfalls of DESIGN.md: each one silently mixes documents."""
    batch = PaddingFreeCollator()(examples)
    kwargs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    if pitfall == "attention_mask_of_ones":
        kwargs.update(attention_mask=torch.ones_like(batch.input_ids), use_cache=False)
    with torch.no_grad():
        out = model(**kwargs)
    ref = torch.cat([alone(model, ex)[0] for ex in examples])
    diff = (out.logits[0] - ref).abs().max().item()
    report(pitfall, diff)
    assert diff > 1e-2
