"""PackedBatch: views, mapping behaviour, moving, pickling, masks against nested-loop references."""

import pickle

import pytest
import torch

from packkit.batch import PackedBatch
from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator


def three_docs():
    return PaddingFreeCollator()([{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22]}, {"input_ids": [31, 32]}])


def ref_dense_mask(seq_idx):
    """mask[b][q][k] = same segment and k <= q, by nested loops."""
    B, L = seq_idx.shape
    s = seq_idx.tolist()
    return torch.tensor([[[s[b][q] == s[b][k] and k <= q for k in range(L)] for q in range(L)] for b in range(B)])


def test_docstring_drawing():
    """The class docstring's three-document pack, field by field."""
    b = three_docs()
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert b.labels.tolist() == [[-100, 12, 13, -100, 22, -100, 32]]
    assert b.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 7] and b.max_seqlen == 3 and b.num_loss_tokens == 4
    drawn = ["1......", "11.....", "111....", "...1...", "...11..", ".....1.", ".....11"]
    assert ["".join("1" if x else "." for x in row) for row in b.dense_mask()[0].tolist()] == drawn


def test_views_carry_the_right_names():
    b = three_docs()
    hf = b.hf_kwargs()
    assert set(hf) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                       "max_length_q", "max_length_k", "use_cache"}
    assert "attention_mask" not in hf and hf["use_cache"] is False
    assert hf["cu_seq_lens_q"] is b.cu_seqlens and hf["max_length_k"] == 3
    assert b.flash_kwargs() == {"cu_seqlens_q": b.cu_seqlens, "cu_seqlens_k": b.cu_seqlens,
                                "max_seqlen_q": 3, "max_seqlen_k": 3}
    assert set(b.mamba_kwargs()) == {"seq_idx", "cu_seqlens"}
    assert isinstance(b.max_seqlen, int) and not isinstance(b.max_seqlen, bool)


def test_mapping_over_the_hf_view():
    b = three_docs()
    assert list(b.keys()) == list(b.hf_kwargs())
    assert len(b) == 8 and "input_ids" in b and "seq_idx" not in b
    assert b["input_ids"] is b.input_ids
    with pytest.raises(KeyError):
        b["seq_idx"]
    assert dict(**b).keys() == b.hf_kwargs().keys()


def test_rebuild_from_a_moved_mapping_like_trainer():
    """transformers.Trainer and accelerate rebuild a mapping as type(batch)({k: moved v}): the
    batch must survive it with every field intact."""
    for collate, examples in [
        (FixedWindowCollator(window=8, num_windows=3, static_shape=True, max_segments=9),
         [{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 6}, {"input_ids": [5, 6]}]),
        (PaddedCollator(), [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]),
        (PaddingFreeCollator(), [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]),
    ]:
        b = collate(examples)
        r = type(b)({k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()})
        for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx"):
            assert torch.equal(getattr(r, f), getattr(b, f)), f
        assert r.max_seqlen == b.max_seqlen and r.num_loss_tokens == b.num_loss_tokens
        assert (r.attention_mask is None) == (b.attention_mask is None)


def test_to_and_pickle_keep_everything():
    b = FixedWindowCollator(window=6)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6] * 4}])
    for other in (b.to("cpu", non_blocking=True), b.to(torch.device("cpu")), pickle.loads(pickle.dumps(b))):
        assert isinstance(other, PackedBatch)
        for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx"):
            assert torch.equal(getattr(other, f), getattr(b, f)) and getattr(other, f).dtype == getattr(b, f).dtype
        assert other.max_seqlen == b.max_seqlen and other.num_loss_tokens == b.num_loss_tokens
    with pytest.raises(AttributeError):  # the fields are read-only: change the batch through its items
        b.max_seqlen = 3


def test_pin_memory():
    b = three_docs()
    if torch.accelerator.is_available():
        p = b.pin_memory()
        assert all(t.is_pinned() for t in (p.input_ids, p.labels, p.position_ids, p.cu_seqlens, p.seq_idx))
    else:  # torch's own behaviour for a tensor on a machine without an accelerator
        with pytest.raises(RuntimeError):
            b.pin_memory()


def test_dense_mask_matches_reference_for_windows():
    b = FixedWindowCollator(window=7)([{"input_ids": [1] * n} for n in (3, 2, 5, 1, 6)])
    assert torch.equal(b.dense_mask(), ref_dense_mask(b.seq_idx))
    assert b.dense_mask().shape == (b.shape[0], 7, 7)


def test_block_mask_is_document_causal():
    pytest.importorskip("torch.nn.attention.flex_attention")
    b = FixedWindowCollator(window=16)([{"input_ids": [1] * n} for n in (5, 7, 3, 9)])
    bm = b.block_mask(BLOCK_SIZE=16)
    dense = ref_dense_mask(b.seq_idx)
    # the BlockMask's own mask_mod, evaluated everywhere, is the block-diagonal causal mask
    B, L = b.shape
    bi, qi, ki = torch.meshgrid(torch.arange(B), torch.arange(L), torch.arange(L), indexing="ij")
    assert torch.equal(bm.mask_mod(bi, torch.zeros_like(bi), qi, ki), dense)
    assert bm.shape[0] == B and bm.shape[-1] == L


def test_construction_errors():
    with pytest.raises(TypeError, match="missing"):
        PackedBatch(input_ids=torch.zeros(1, 1))
    with pytest.raises(TypeError, match="either one mapping or keyword fields"):
        PackedBatch({"input_ids": 1}, labels=torch.zeros(1))


def test_counts_survive_to_pickle_and_rebuild():
    """Before the fix, counts were recomputed from the tensors (a row whose last document has no loss
    label lost that document to padding). The batch carries num_tokens/num_examples/num_real_segments/
    labels_shifted as Python ints through .to(), pickling and the Trainer-style rebuild from the HF view."""
    b = FixedWindowCollator(window=8)([{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 6}, {"input_ids": [5, 6]}])
    assert (b.num_tokens, b.num_examples, b.num_real_segments, b.labels_shifted) == (11, 3, 4, False)
    rebuilt = type(b)({k: v for k, v in b.items()})
    for other in (b.to("cpu"), pickle.loads(pickle.dumps(b)), rebuilt, PackedBatch(b)):
        assert (other.num_tokens, other.num_examples, other.num_real_segments, other.labels_shifted) == \
            (11, 3, 4, False)


def test_static_batch_hf_kwargs_can_drop_zero_length_segments():
    """Before the fix, a static-shape batch sent its zero-length cu_seqlens padding straight to HF's flash
    path (flash-attn #1537). hf_kwargs()/flash_kwargs() keep the static length by default (what
    torch.compile wants); static=False cuts to the real segments on the host, without a copy."""
    b = FixedWindowCollator(window=8, num_windows=3, static_shape=True, max_segments=9)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 6}])
    assert b.is_static and b.num_real_segments == 5 and b.num_segments == 9
    assert b.hf_kwargs()["cu_seq_lens_q"].tolist() == [0, 6, 8, 11, 16, 24, 24, 24, 24, 24]
    cut = b.hf_kwargs(static=False)["cu_seq_lens_q"]
    assert cut.tolist() == b.cu_seqlens[:6].tolist()
    assert cut.untyped_storage().data_ptr() == b.cu_seqlens.untyped_storage().data_ptr()
    assert torch.all(cut[1:] > cut[:-1])  # no zero-length segment left
    assert b.flash_kwargs(static=False)["cu_seqlens_k"].tolist() == cut.tolist()
    # a dynamic batch is unchanged by static=False
    d = three_docs()
    assert d.hf_kwargs(static=False)["cu_seq_lens_q"] is not None
    assert d.hf_kwargs(static=False)["cu_seq_lens_q"].tolist() == d.cu_seqlens.tolist()


def test_pre_shifted_labels_carry_shift_labels_in_the_hf_view():
    """A batch built with mask_first_label=False holds pre-shifted labels; its HF view must also carry
    them as shift_labels, or HF's loss (and Trainer's num_items_in_batch) shift them a second time, as
    they did before the fix."""
    b = PaddingFreeCollator(mask_first_label=False)([{"input_ids": [5, 6, 7], "labels": [6, 7, -100]}])
    assert b.labels_shifted and b["shift_labels"] is b.labels and "shift_labels" in list(b)
    assert list(b)[-1] == "use_cache"
    r = type(b)({k: v for k, v in b.items()})
    assert r.labels_shifted and r.num_loss_tokens == 2
    assert "shift_labels" not in three_docs()


def test_collated_batches_have_every_field():
    """The collators build batches on an unchecked fast path: every field must be there
    (seq_idx derived on first access, equal to the reference from cu_seqlens)."""
    from packkit.batch import FIELDS

    for b in (three_docs(), FixedWindowCollator(window=8)([{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 6}]),
              PaddedCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])):
        for f in FIELDS:
            getattr(b, f)
        cu = b.cu_seqlens.tolist()
        want = [s for s in range(len(cu) - 1) for _ in range(cu[s + 1] - cu[s])]
        assert b.seq_idx.dtype == torch.int32 and b.seq_idx.reshape(-1).tolist() == want
