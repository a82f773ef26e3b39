"""What a loss weighting adds to a collate (``benchmarks/bench_weighting.py``: at most 2% of it), and the checks
it keeps: packed rows' ``example_loss`` read in the join of their ``seq_lengths``, every wrong or missing count still
refused in one line naming the row; a split example's shared count noted without torch's per-element copy."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packkit import collate
from packkit.batch import _note
from packkit.collate import FixedWindowCollator, PackedRowsCollator, rows_batch_spans
from packkit.examples import ExampleBatch, int_arrays

WINDOW = 8


def rows(kind=np.int32):
    """Two packed rows as a numpy-formatted dataset gives them (pack_dataset's schema: int32 documents): the first
    holds two documents (the second a piece of an example of 9 loss tokens), the second one."""
    return [{"input_ids": np.arange(1, 8), "labels": np.arange(1, 8), "seq_lengths": np.array([3, 4], kind),
             "example_loss": np.array([2, 9], kind)},
            {"input_ids": np.arange(1, 6), "labels": np.arange(1, 6), "seq_lengths": np.array([5], kind),
             "example_loss": np.array([4], kind)}]


def whole_of(batch) -> list:
    return _note(batch["labels"])["loss_whole"].tolist()


def test_example_loss_is_read_in_the_join_of_seq_lengths():
    """Regression (the weights' collate overhead, 4.6% hot and 8.87% in bench_weighting's replay for packed rows with
    example_loss): the column was read by a second pass of its own (its keys, a list, three type checks, a join,
    a per-row count check in numpy). Now both columns are one ``np.concatenate``: the documents' lengths and
    their whole examples' loss tokens are views of one buffer. Fails before (no such read)."""
    r = rows()
    seg_lengths, seg_ptr, whole = collate._row_segments(r, np.array([7, 5]), whole=True)
    assert seg_lengths.tolist() == [3, 4, 5] and seg_ptr.tolist() == [0, 2, 3] and whole.tolist() == [2, 9, 4]
    assert seg_lengths.dtype == whole.dtype == np.int64
    assert seg_lengths.base is not None and seg_lengths.base is whole.base  # one buffer
    assert collate._row_segments(r, np.array([7, 5]))[2] is None  # not read unless asked


@pytest.mark.parametrize("form", ["int32", "int64", "lists", "columns", "position_ids"])
def test_every_form_of_rows_weighs_the_same(form):
    """The join (numpy arrays) and the checked readers (lists, an ExampleBatch's columns, rows marked by
    position_ids) note the same whole-example counts."""
    want = whole_of(PackedRowsCollator(window=WINDOW, loss_weighting="sample")(rows()))
    assert want == [2, 9, 4]
    r = rows(np.int64 if form == "int64" else np.int32)
    if form == "lists":
        r = [{k: v.tolist() for k, v in row.items()} for row in r]
    elif form == "position_ids":
        for row in r:
            row["position_ids"] = np.concatenate([np.arange(n) for n in row.pop("seq_lengths")])
    elif form == "columns":
        r = ExampleBatch({k: [row[k] for row in r] for k in r[0]}, rows=[4, 9])
    assert whole_of(PackedRowsCollator(window=WINDOW, loss_weighting="sample")(r)) == want


def test_counts_moved_between_rows_are_refused_naming_the_row():
    """One row a count short and the next a count over: the column's length is right, every document after the
    first would weigh as its neighbour's example. Refused, naming the first row and what must match."""
    r = rows()
    r[0]["example_loss"], r[1]["example_loss"] = np.array([2], np.int32), np.array([9, 4], np.int32)
    with pytest.raises(ValueError, match=r"^example 0 has 1 example_loss for 2 documents \(seq_lengths\); they must "
                                         r"match$"):
        PackedRowsCollator(window=WINDOW, loss_weighting="sample")(r)
    with pytest.raises(ValueError, match=r"^example 1 has 2 example_loss for 1 documents"):
        PackedRowsCollator(window=WINDOW, loss_weighting="sample")(ExampleBatch(
            {k: [row[k] for row in rows()] for k in ("input_ids", "labels", "seq_lengths")}
            | {"example_loss": [np.array([2, 9]), np.array([4, 4])]}))


@pytest.mark.parametrize("bad, says", [
    (None, r"^example 1 has no 'example_loss'; packed rows record it on every row or none"),
    (np.array([4.0]), r"^example 1 "),
    (np.array([[4]]), r"^example 1 "),
    (np.array(4), r"^example 1 "),
    (np.array([2**63], np.uint64), r"^example 1 "),
])
def test_a_missing_or_unreadable_count_is_refused_naming_the_row(bad, says):
    """A row without the column among rows with it, a float, 2-D, 0-d or uint64 count: each falls out of the join
    to the checked reader, which names the row (one line)."""
    r = rows()
    if bad is None:
        del r[1]["example_loss"]
    else:
        r[1]["example_loss"] = bad
    with pytest.raises(ValueError, match=says) as e:
        PackedRowsCollator(window=WINDOW, loss_weighting="sample")(r)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("form", ["int32", "lists"])
def test_a_negative_count_is_refused_naming_the_row(form):
    """A negative whole-example count (rows edited, or written outside packkit) would weigh that document's loss
    tokens negatively: training would push its loss up, silently. Refused, naming the row and the document, in
    the join and in the checked readers alike. Fails before (the batch was made)."""
    r = rows()
    r[1]["example_loss"] = np.array([-4], np.int32)
    if form == "lists":
        r = [{k: v.tolist() for k, v in row.items()} for row in r]
    with pytest.raises(ValueError, match=r"^example 1 records example_loss -4 for its document 0: a count of loss "
                                         r"tokens is never negative; write the rows again") as e:
        PackedRowsCollator(window=WINDOW, loss_weighting="sample")(r)
    assert "\n" not in str(e.value)


def test_the_token_mean_reads_no_example_loss():
    """Under the token mean nothing weighs by example: the column is not read (a wrong one is not refused)."""
    r = rows()
    r[0]["example_loss"] = np.array([1.5])
    batch = PackedRowsCollator(window=WINDOW)(r)
    assert "loss_whole" not in _note(batch["labels"])


def test_int_arrays_takes_only_1d_integer_arrays():
    """``int_arrays``: the join of 1-D integer arrays as int64, None for anything the checked readers must name."""
    assert int_arrays([np.array([2, 1], np.int32), np.array([3], np.uint8)]).tolist() == [2, 1, 3]
    for xs in ([[2, 1]], [np.array([2.0])], [np.array([[2]]), np.array([[3]])], [np.array([2]), np.array([[3]])],
               [np.array(2)], [np.array([1], np.uint64)], [np.array([True])], [np.array([1]), None], []):
        assert int_arrays(xs) is None, xs


def test_a_split_examples_count_is_noted_without_torchs_copy(monkeypatch):
    """Regression: the split examples' documents (``seg_doc``, the plan's read-only array) were noted through
    ``torch.tensor``, a copy four times the cost of numpy's (about 10 against 2.5 us a batch, the split fixed
    windows' largest part of the weights' step). Noted now as a numpy copy: no torch.tensor, and the note does not
    share the plan's memory. Fails before (torch.tensor called)."""
    ex = [{"input_ids": np.arange(n), "labels": np.arange(n)} for n in (13, 3, 6)]
    coll = FixedWindowCollator(window=WINDOW, overflow="split", loss_weighting="sample")
    want = coll(ex).loss_weight

    def no_copy(*a, **k):
        raise AssertionError("torch.tensor called by the collate")

    monkeypatch.setattr(torch, "tensor", no_copy)
    batch, plan = coll._pack(ex)
    seg_doc = _note(batch["labels"])["loss_seg_doc"]
    monkeypatch.undo()
    assert seg_doc.tolist() == plan.seg_example.tolist()
    assert not np.shares_memory(np.asarray(seg_doc), plan.seg_example)
    assert torch.equal(batch.loss_weight, want)


@given(st.lists(st.lists(st.integers(1, 5), max_size=3), min_size=1, max_size=4), st.integers(0, 2))
def test_document_spans_against_a_loop(rows_docs, extra_rows):
    """``rows_batch_spans(spans=True)``'s ``doc_cu`` (every document's start in the flattened rows, then their end),
    against a loop; rows with no document and batches with no token included."""
    width = max([sum(d) for d in rows_docs] + [1])
    seg_lengths = np.array([n for d in rows_docs for n in d], np.int64)
    seg_ptr = np.cumsum([0] + [len(d) for d in rows_docs])
    ids = np.arange(1, int(seg_lengths.sum()) + 1)
    num_rows = len(rows_docs) + extra_rows
    _, doc_cu = rows_batch_spans(ids, ids.copy(), seg_lengths, seg_ptr, width=width, num_rows=num_rows, spans=True)
    want = [r * width + sum(d[:k]) for r, d in enumerate(rows_docs) for k in range(len(d))] + [num_rows * width]
    assert doc_cu.tolist() == want



def split_examples():
    return [{"input_ids": np.arange(1, n + 1), "labels": np.arange(1, n + 1)} for n in (13, 3, 6)]


@pytest.mark.parametrize("make, examples", [
    (lambda w: PackedRowsCollator(window=WINDOW, loss_weighting=w), rows),
    (lambda w: FixedWindowCollator(window=WINDOW, overflow="split", loss_weighting=w), split_examples)],
    ids=["packed_rows", "split_windows"])
def test_weights_add_no_tensor_to_the_collate(monkeypatch, make, examples):
    """Regression (packed rows' weights at 3.1% of the collate against the 2% target, bench_weighting at load 1): the
    collate made a tensor of every array it noted (the documents' spans, their whole examples' loss tokens), each
    ``torch.from_numpy`` costing about as much as the weights' own arithmetic. The note keeps numpy arrays, made
    tensors once, where the loss first reads them (``loss_factors``). Fails before (tensors more a batch)."""
    made = []
    monkeypatch.setattr(collate, "_tensor", lambda a: made.append(a.shape) or torch.from_numpy(a))
    counts = {}
    for w in ("token", "sample"):
        made.clear()
        batch = make(w)(examples())
        counts[w] = len(made)
    assert counts["sample"] == counts["token"], counts
    assert batch.loss_weight.dtype == torch.float32 and float(batch.loss_norm) > 0


def test_the_usual_rows_check_both_columns_in_one_pass(monkeypatch):
    """Regression (packed rows' weights at 2.46% of the collate in bench_weighting's isolated share): after the join of
    ``seq_lengths`` and ``example_loss``, the lengths were checked (a comparison and ``.any()``, in
    ``rules.row_segments``) and the counts again (``_whole_counts``: an argmin, an item, a comparison). Now the join's
    least value checks both where it is >= 1: neither check runs on the usual rows. Fails before (both ran)."""
    ran = []
    whole_counts, row_segments = collate._whole_counts, collate.row_segments
    monkeypatch.setattr(collate, "_whole_counts", lambda *a, **k: ran.append("counts") or whole_counts(*a, **k))
    monkeypatch.setattr(collate, "row_segments",
                        lambda *a, **k: ran.append("lengths" if not k.get("positive") else "") or row_segments(*a, **k))
    batch = PackedRowsCollator(window=WINDOW, loss_weighting="sample")(rows())
    assert whole_of(batch) == [2, 9, 4] and ran == [""]


@pytest.mark.parametrize("field, value, says", [
    ("example_loss", 0, None),  # an example without loss tokens: allowed, checked one by one
    ("example_loss", -1, r"^example 1 records example_loss -1 for its document 0: a count of loss tokens is never "),
    ("seq_lengths", 0, r"^example 0 has a segment of length 0; seq_lengths must be >= 1$"),
    ("seq_lengths", -5, r"^example 0 has a segment of length -5; seq_lengths must be >= 1$"),
])
def test_the_checks_one_by_one_where_the_least_value_is_below_one(field, value, says):
    """Where the join's least value is below 1 the checks run as before: a count of 0 weighs (no loss tokens), a
    negative count or a length below 1 is refused in one line naming the row, as under the token mean."""
    r = rows()
    if field == "seq_lengths":  # the first row's 7 tokens, still summed
        r[0][field] = np.array([value, 7 - value], np.int32)
    else:
        r[1][field] = np.array([value], np.int32)
    coll = PackedRowsCollator(window=WINDOW, loss_weighting="sample")
    if says is None:
        assert whole_of(coll(r)) == [2, 9, 0]
        return
    with pytest.raises(ValueError, match=says) as e:
        coll(r)
    assert "\n" not in str(e.value)
    if field == "seq_lengths":  # the same words as the token mean's
        with pytest.raises(ValueError, match=says):
            PackedRowsCollator(window=WINDOW)(r)


def test_weighing_notes_the_same_keys_in_the_same_order():
    """``PackedBatch._weigh`` notes its parts with keys made once (no comprehension): the note is what it was, key for
    key and in order (a guard)."""
    batch = PackedRowsCollator(window=WINDOW, loss_weighting="sample")(rows())
    note = _note(batch["labels"])
    assert [k for k in note if k.startswith("loss_") and k != "loss_tokens"] == [
        "loss_cu", "loss_whole", "loss_weighting", "loss_step_constant", "loss_rule"]
    assert note["loss_weighting"] == "sample" and note["loss_step_constant"] == 0.0
