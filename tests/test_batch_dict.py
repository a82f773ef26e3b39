"""PackedBatch is the dict trainers expect: item assignment, pop, update, del, copy, ``**batch``,
pickling, ``.to()``; its counts never go stale, and a batch rebuilt from its bare view (what ``Trainer``
does every step) keeps its padding.

The reference for every count is recomputed here from scratch, by loops over the documents the test
itself made.
"""

import collections.abc
import copy
import pickle

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from packkit.batch import PackedBatch
from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator

IGNORE = -100


def windows_with_unlabelled_last_documents():
    """Three windows of 5: two end in a document without loss tokens (labels all -100), the case a
    view cannot tell from padding: [3 | 2 unlabelled], [4 | 1 unlabelled], [2 | pad 3]."""
    examples = [
        {"input_ids": [11, 12, 13], "labels": [11, 12, 13]},
        {"input_ids": [21, 22], "labels": [IGNORE, IGNORE]},
        {"input_ids": [31, 32, 33, 34], "labels": [31, 32, 33, 34]},
        {"input_ids": [41], "labels": [IGNORE]},
        {"input_ids": [51, 52], "labels": [51, 52]},
    ]
    return FixedWindowCollator(window=5, strategy="next_fit")(examples), examples


def ref_counts(examples, labels_key="labels"):
    """(loss tokens, tokens, documents) of collated examples, by loops (first label of each document masked)."""
    loss = sum(sum(1 for i, x in enumerate(ex[labels_key]) if i > 0 and x != IGNORE) for ex in examples)
    return loss, sum(len(ex["input_ids"]) for ex in examples), len(examples)


def counts(b):
    return b.num_loss_tokens, b.num_tokens, b.num_examples


def test_a_batch_is_a_dict():
    b = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert isinstance(b, dict) and isinstance(b, collections.abc.MutableMapping)
    assert dict(b) == {k: b[k] for k in b} and list(dict(**b)) == list(b)
    assert {**b}.keys() == b.keys() and b.hf_kwargs().keys() == b.keys()
    # == is identity (tensors have no truth value), so a batch stays hashable
    assert b == b and b != b.copy() and len({b, b}) == 1


def test_trl_sets_use_cache_and_counts_stay_cached():
    """Before the fix, TRL 1.16's SFTTrainer.compute_loss (inputs["use_cache"] = False) crashed: PackedBatch
    was a read-only Mapping (TypeError: 'PackedBatch' object does not support item assignment)."""
    b, examples = windows_with_unlabelled_last_documents()
    b["use_cache"] = False
    b["output_router_logits"] = True
    assert b["output_router_logits"] is True and counts(b) == ref_counts(examples)
    assert b.labels.__dict__["_packkit"]["loss_tokens"] == ref_counts(examples)[0]  # still the collator's count


def test_pop_labels_keeps_the_count_of_the_labels_removed():
    """A custom compute_loss pops labels before the forward; the count still describes them."""
    b, examples = windows_with_unlabelled_last_documents()
    labels = b.pop("labels")
    assert "labels" not in b and b.labels is None and isinstance(labels, torch.Tensor)
    assert counts(b) == ref_counts(examples)
    with pytest.raises(KeyError):
        b.pop("labels")
    assert b.pop("labels", None) is None
    # the same after a rebuild that had to recount (tensors packkit never saw): counted from what was popped
    r = PackedBatch({k: (v.clone() if torch.is_tensor(v) else v) for k, v in PaddingFreeCollator()(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]).items()})
    del r["labels"]
    assert r.num_loss_tokens == 3
    # pre-shifted labels: popping labels, then shift_labels
    s = PaddingFreeCollator(mask_first_label=False)([{"input_ids": [5, 6, 7], "labels": [6, 7, IGNORE]}])
    s.pop("labels")
    assert s.num_loss_tokens == 2 and s.labels_shifted
    s.pop("shift_labels")
    assert s.num_loss_tokens == 2 and s.labels_shifted


def test_new_labels_are_counted():
    b, examples = windows_with_unlabelled_last_documents()
    more = b.labels.clone()
    more[more != IGNORE] = IGNORE
    more[0, 1] = 7
    b["labels"] = more
    assert b.num_loss_tokens == 1
    # padding is structural: new labels do not change tokens or documents
    assert (b.num_tokens, b.num_examples) == ref_counts(examples)[1:]
    b.update(labels=b.labels.clone().fill_(IGNORE))
    assert b.num_loss_tokens == 0
    b |= {"labels": more}
    assert b.num_loss_tokens == 1
    b.update([("labels", b.labels.clone().fill_(3))])
    assert b.num_loss_tokens == b.labels[..., 1:].numel()


def test_shift_labels_switch_the_convention():
    """The loss reads shift_labels when the view has them, else labels shifted by the model: the count
    follows whichever the view carries."""
    b = PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert (b.num_loss_tokens, b.labels_shifted) == (3, False)
    shifted = torch.tensor([[6, 7, IGNORE, 9, IGNORE]])
    b["shift_labels"] = shifted
    assert (b.num_loss_tokens, b.labels_shifted) == (3, True)
    b["labels"] = torch.full_like(shifted, IGNORE)  # the loss still reads shift_labels
    assert b.num_loss_tokens == 3
    del b["shift_labels"]  # now the model shifts labels (all -100)
    assert (b.num_loss_tokens, b.labels_shifted) == (0, False)
    assert b.setdefault("shift_labels", shifted) is shifted and b.num_loss_tokens == 3


def test_new_segments_are_counted():
    b = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    b["cu_seq_lens_q"] = b["cu_seq_lens_k"] = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
    assert b.cu_seqlens.tolist() == [0, 1, 3, 5] and b.seq_idx.tolist() == [[0, 1, 1, 2, 2]]
    assert (b.num_real_segments, b.max_seqlen, b.num_examples, b.num_tokens) == (3, 2, 3, 5)
    b["input_ids"] = torch.zeros(1, 5, dtype=torch.int64)
    assert b.num_tokens == 5


def test_copy_deepcopy_pickle_and_to_keep_the_counts():
    b, examples = windows_with_unlabelled_last_documents()
    for other in (b.copy(), copy.copy(b), copy.deepcopy(b), pickle.loads(pickle.dumps(b)), b.to("cpu"), PackedBatch(b)):
        assert type(other) is PackedBatch and other is not b
        assert counts(other) == ref_counts(examples) and torch.equal(other.cu_seqlens, b.cu_seqlens)
        assert other["cu_seq_lens_q"] is other["cu_seq_lens_k"] is other.cu_seqlens  # aliases stay aliases
        other["labels"] = torch.full_like(b.labels, IGNORE)
        assert other.num_loss_tokens == 0 and b.num_loss_tokens == ref_counts(examples)[0]  # copies are independent


def test_trainer_rebuild_keeps_padding():
    """Trainer rebuilds a batch as type(batch)({k: v.to(device)}); the view holds no padding marker, so
    before the fix a row whose last document had no loss token was counted as padding.
    accelerate moves the batch with .to() first, then Trainer rebuilds it from those very tensors:
    the rebuilt batch finds its padding (and every count) again, with no device work."""
    b, examples = windows_with_unlabelled_last_documents()
    want = ref_counts(examples)
    from accelerate.utils import send_to_device

    moved = send_to_device(b, torch.device("cpu"))  # what accelerate's DataLoaderShard does
    rebuilt = type(moved)({k: (v.to("cpu") if torch.is_tensor(v) else v) for k, v in moved.items()})
    assert counts(rebuilt) == want
    assert rebuilt["cu_seq_lens_q"].__dict__["_packkit"]["pad"] == (3, 1)  # the collator's padding, carried by .to()
    # a rebuild of tensors packkit never saw reads padding from the labels: the documented fallback,
    # which counts each row's unlabelled last document as padding
    cloned = PackedBatch({k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()})
    assert cloned.num_loss_tokens == want[0]
    assert (cloned.num_tokens, cloned.num_examples) == (want[1] - 3, want[2] - 2)


def test_counts_follow_the_tensors_to_another_device_without_reading_it():
    """.to() carries every count to the moved tensors (what accelerate does before Trainer's rebuild):
    on the meta device, which holds no data, any read from the device would raise, yet the moved batch
    and a rebuild from its tensors answer every count, padded view included."""
    windows, examples = windows_with_unlabelled_last_documents()
    padded = PaddedCollator()([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [IGNORE]}])
    for b, want in ((windows, ref_counts(examples)), (padded, (2, 4, 2))):
        b.seq_idx  # computed on the CPU: moved with the batch
        moved = b.to("meta")
        for x in (moved, type(moved)({k: v for k, v in moved.items()})):
            assert x.device.type == "meta" and counts(x) == want
            assert (x.num_real_segments, x.max_seqlen, x.labels_shifted) == (b.num_real_segments, b.max_seqlen, False)
            assert x.seq_idx.device.type == "meta" and x.seq_idx.shape == b.seq_idx.shape


def test_rebuilds_from_the_batchs_tensors_are_exact_and_others_fall_back():
    """The counts ride on the tensors they describe: any rebuild that holds the batch's tensors (dict(b),
    {**b}, its items, after .to() or unpickling) is exact; tensors the batch never held (clones) read the
    padding from the labels, which takes each row's unlabelled last document for padding."""
    b, examples = windows_with_unlabelled_last_documents()
    want = ref_counts(examples)
    fallback = (want[0], want[1] - 3, want[2] - 2)
    assert counts(PackedBatch(dict(b))) == want
    assert counts(PackedBatch(dict(b.to("cpu")))) == want
    assert counts(PackedBatch({k: v for k, v in b.items()})) == want
    assert counts(PackedBatch({**pickle.loads(pickle.dumps(b))})) == want
    assert counts(PackedBatch({k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()})) == fallback


def test_trainer_prepare_input_rebuild():
    """The same through transformers.Trainer's own _prepare_input, for every collator's batch."""
    transformers = pytest.importorskip("transformers")

    class Prepare:  # the two attributes Trainer._prepare_input reads, without building a Trainer
        _prepare_input = transformers.Trainer._prepare_input
        is_deepspeed_enabled = False
        args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])

    prepare = Prepare()._prepare_input
    b, examples = windows_with_unlabelled_last_documents()
    rows = [{"input_ids": [1, 2, 3, 4], "seq_lengths": [3, 1], "labels": [1, 2, 3, IGNORE]}]
    for batch in (b, PaddingFreeCollator()([{"input_ids": [1, 2]}, {"input_ids": [3], "labels": [IGNORE]}]),
                  PaddedCollator()([{"input_ids": [1, 2]}, {"input_ids": [3]}]),
                  PackedRowsCollator(window=6)(rows)):
        want = counts(batch)
        got = prepare(batch.to("cpu"))
        assert type(got) is PackedBatch and counts(got) == want
        assert got.num_real_segments == batch.num_real_segments and got.max_seqlen == batch.max_seqlen


def test_rebuild_needs_the_segments():
    with pytest.raises(TypeError, match="without 'input_ids'"):
        PackedBatch({"labels": torch.zeros(1, 2)})
    with pytest.raises(TypeError, match="cu_seq_lens_q' or 'position_ids'"):
        PackedBatch({"input_ids": torch.zeros(1, 2, dtype=torch.int64)})
    # an iterable of pairs, as dict() takes (DataParallel's scatter rebuilds mappings this way)
    b = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}])
    assert PackedBatch(list(b.items())).num_loss_tokens == 2


def test_removing_every_label_before_a_recount_is_an_error_naming_the_fix():
    b = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}])
    b["labels"] = torch.tensor([[IGNORE, 2, 3]])  # a new value: the count is dropped, to be recomputed...
    b.pop("labels")                              # ...from what was popped
    assert b.num_loss_tokens == 2
    r = PackedBatch({"input_ids": b.input_ids, "position_ids": b.position_ids})
    with pytest.raises(ValueError, match="read num_loss_tokens before removing labels"):
        r.num_loss_tokens


# -- a property: any sequence of dict operations, counts equal to a recount from scratch ----------

OPS = ["set_use_cache", "set_labels", "set_shift_labels", "del_labels", "del_shift_labels", "pop_labels",
       "update_labels", "set_4d_mask", "copy", "rebuild_moved", "clear_and_refill"]


@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**16)), max_size=12), st.booleans())
@example([], False)
@example([("pop_labels", 0), ("copy", 0)], True)  # counts outlive the labels
@example([("pop_labels", 0), ("rebuild_moved", 0)], True)  # a rebuild without labels has none to count
@example([("del_labels", 0), ("set_shift_labels", 1), ("clear_and_refill", 0), ("set_4d_mask", 0)], False)
def test_counts_equal_a_recount_after_any_operations(ops, windows):
    examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [IGNORE, IGNORE]},
                {"input_ids": [6, 7, 8, 9], "labels": [6, IGNORE, 8, 9]}]
    b = (FixedWindowCollator(window=6, strategy="next_fit") if windows else PaddingFreeCollator())(examples)
    tokens, docs = 9, 3
    last = None  # (labels, shifted) the count must describe once the view holds none

    def source(batch):
        if "shift_labels" in batch:
            return batch["shift_labels"], True
        return (batch["labels"], False) if "labels" in batch else None

    for op, seed in ops:
        g = torch.Generator().manual_seed(seed)
        rand = torch.randint(0, 3, b.input_ids.shape, generator=g) - 1  # -1, 0, 1
        new = torch.where(rand < 0, torch.full_like(rand, IGNORE), rand + 5)
        if source(b) is not None:
            last = source(b)
        if op == "set_use_cache":
            b["use_cache"] = bool(seed % 2)
        elif op == "set_labels":
            b["labels"] = new
        elif op == "set_shift_labels":
            b["shift_labels"] = new
        elif op in ("del_labels", "pop_labels", "del_shift_labels"):
            key = "shift_labels" if op == "del_shift_labels" else "labels"
            if key in b:
                b.pop(key) if op == "pop_labels" else b.__delitem__(key)
        elif op == "update_labels":
            b.update({"labels": new, "use_cache": False})
        elif op == "set_4d_mask":
            b["attention_mask"] = torch.zeros(b.shape[0], 1, b.shape[1], b.shape[1])
        elif op == "copy":
            b = b.copy()
        elif op == "rebuild_moved":
            moved = b.to("cpu")
            b = type(b)({k: (v.to("cpu") if torch.is_tensor(v) else v) for k, v in moved.items()})
            del moved
            if source(b) is None:  # the documented limit: a mapping without labels has none to count
                last = None
                with pytest.raises(ValueError, match="read num_loss_tokens before removing labels"):
                    b.num_loss_tokens
        elif op == "clear_and_refill":
            items = dict(b)
            b.clear()
            b.update(items)
        src = source(b) or last
        if src is not None:
            labels, shifted = src
            want = int(((labels if shifted else labels[..., 1:]) != IGNORE).sum())
            assert (b.num_loss_tokens, b.labels_shifted) == (want, shifted), op
        assert (b.num_tokens, b.num_examples) == (tokens, docs), op


def test_segments_rebuilt_from_positions_of_every_shape():
    """A batch rebuilt from a plain dict finds its segments from ``position_ids``: for text and for mRoPE's text row
    (``[4, B, L]``), where a position does not follow the previous one (as transformers finds documents); for
    mRoPE's three rows alone (``[3, B, L]``, no text row), only where the temporal row is 0, since an image's
    tokens share their temporal position (the diff rule cut a Qwen2-VL document at its image: [0, 3, 4, 5, 6, 8])."""
    t = torch.tensor([0, 1, 2, 2, 2, 2, 4, 5, 0, 1])
    h = torch.tensor([0, 1, 2, 2, 3, 3, 4, 5, 0, 1])
    w = torch.tensor([0, 1, 2, 3, 2, 3, 4, 5, 0, 1])
    rows = torch.stack([t, h, w])[:, None]
    text = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1])[None]
    make = lambda pos: PackedBatch({"input_ids": torch.arange(1, 11)[None], "labels": torch.arange(1, 11)[None],  # noqa: E731
                                    "position_ids": pos})
    assert make(rows).cu_seqlens.tolist() == [0, 8, 10]
    assert make(torch.cat([text[None], rows])).cu_seqlens.tolist() == [0, 8, 10]
    assert make(text).cu_seqlens.tolist() == [0, 8, 10]
    assert make(torch.tensor([[1, 2, 3, 1, 2, 3, 4, 5, 1, 2]])).cu_seqlens.tolist() == [0, 3, 8, 10]  # from 1
