"""packkit.examples: one reader of examples and one wording per rule, on every path.

The same bad data goes through the collators, offline packing (``pack_dataset``, ``pack_stream``), the
measurements of ``packkit waste`` / ``plan`` and the ``packkit pack`` command; each path must refuse it
with the same rule text after its own location ("example i" or "dataset row i").
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from packkit import listcolumns
from packkit import rules as ex
from packkit.examples import ExampleBatch, read_examples
from packkit.listcolumns import loss_lengths, table_labels, token_lengths
from packkit.rules import (MASK_KEYS, ExampleTypeError, ExampleValueError, LossMaskWarning, check_values, location,
                           relocate)
from packkit.segments import IGNORE_INDEX

pa = pytest.importorskip("pyarrow")


def labels_by_hand(examples):
    """The rule, one example at a time: its labels (or ids), -100 where any mask it carries is 0."""
    out = []
    for e in examples:
        lab = list(e.get("labels") if e.get("labels") is not None else e["input_ids"])
        for k in MASK_KEYS:
            if e.get(k) is not None:
                lab = [IGNORE_INDEX if m == 0 else v for v, m in zip(lab, e[k])]
        out += lab
    return out


# ----------------------------------------------------------------------------------------------
# each example's own keys
# ----------------------------------------------------------------------------------------------


def test_a_mask_on_example_1_is_honoured_when_example_0_has_none():
    """Before the fix, PaddingFreeCollator()([{"input_ids":[3,4,5]}, {"input_ids":[6,7,8], "completion_mask":[0,0,1]}])
    gave labels [-100,4,5,-100,7,8]: example 1's mask was ignored because example 0 had none."""
    from packkit.collate import PaddingFreeCollator

    batch = PaddingFreeCollator()([{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7, 8], "completion_mask": [0, 0, 1]}])
    assert batch.labels.tolist() == [[-100, 4, 5, -100, -100, 8]]
    assert batch.num_loss_tokens == 3


@pytest.mark.parametrize("layout", ["lists", "arrays", "mixed"])
def test_keys_on_some_examples_only_are_each_honoured(layout):
    """Labels, either mask, both masks, None values: each example's labels are what it would get alone."""
    exs = [
        {"input_ids": [3, 4, 5]},
        {"input_ids": [6, 7, 8], "completion_mask": [0, 0, 1]},
        {"input_ids": [9, 10], "labels": [-100, 10]},
        {"input_ids": [11, 12, 13], "assistant_masks": [0, 1, 1], "completion_mask": [1, 1, 0]},
        {"input_ids": [14, 15], "labels": None, "completion_mask": None},
        {"input_ids": [16, 17], "labels": [16, -100], "assistant_masks": [True, False]},
    ]
    if layout != "lists":
        exs = [{k: (None if v is None else np.asarray(v)) if (layout == "arrays" or i % 2) else v
                for k, v in e.items()} for i, e in enumerate(exs)]
    ids, labels, lengths = read_examples(exs)
    assert labels.tolist() == labels_by_hand(exs)
    assert lengths.tolist() == [3, 3, 2, 3, 2, 2]
    # the same examples alone give the same labels: batch-mates do not matter
    for k in range(len(exs)):
        assert read_examples([exs[k]])[1].tolist() == labels_by_hand([exs[k]])


def test_pre_shifted_labels_are_needed_on_every_example():
    exs = [{"input_ids": [1, 2], "labels": [2, -100]}, {"input_ids": [3, 4]}]
    with pytest.raises(ValueError, match="example 1 has no 'labels'; mask_first_label=False means labels are pre-shifted"):
        read_examples(exs, need_labels=True)


def test_loss_mask_required_names_the_example_and_the_trainer_setting():
    ok = {"input_ids": [1, 2], "completion_mask": [0, 1]}
    assert read_examples([ok, dict(ok)], loss_mask="required")[1].tolist() == [-100, 2, -100, 2]
    for exs, i in [([ok, {"input_ids": [3]}], 1), ([{"input_ids": [3]}], 0),
                   ([ok, {"input_ids": [3], "completion_mask": None}], 1)]:
        with pytest.raises(ValueError, match=rf"example {i} has no loss mask .*remove_unused_columns=False"):
            read_examples(exs, loss_mask="required")
    with pytest.raises(ValueError, match="loss_mask must be one of 'auto', 'required'"):
        ex.check_loss_mask_mode("always")


# ----------------------------------------------------------------------------------------------
# one wording per rule, on every path
# ----------------------------------------------------------------------------------------------

#: (rows, error type, the rule text after the location; the location is example/dataset row 1 unless noted)
BAD = {
    "float id": ([{"input_ids": [1, 2]}, {"input_ids": [3.5, 4.0]}], TypeError,
                 "has 3.5 (float) in 'input_ids'; token ids are integers >= 0", 1),
    "negative id": ([{"input_ids": [1, 2]}, {"input_ids": [3, -4]}], ValueError,
                    "has token id -4 in 'input_ids'; token ids are integers >= 0", 1),
    "empty": ([{"input_ids": [1, 2]}, {"input_ids": []}], ValueError,
              "is empty (0 tokens in 'input_ids'); filter empty examples out first", 1),
    "nested": ([{"input_ids": [[1, 2]]}, {"input_ids": [[3]]}], TypeError,
               "has a nested list in 'input_ids'", 0),
    "bool id": ([{"input_ids": [True, False]}, {"input_ids": [True]}], TypeError,
                "has True (bool) in 'input_ids'; token ids are integers >= 0", 0),
    "label -7": ([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3, 4], "labels": [-100, -7]}], ValueError,
                 "has label -7 in 'labels'; labels are token ids (>= 0) or -100 (no loss)", 1),
    "labels too short on example 1": ([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3, 4], "labels": [3]}],
                                      ValueError, "has 1 'labels' for 2 'input_ids'; they must match token for token", 1),
    "mask 2": ([{"input_ids": [1, 2], "completion_mask": [0, 1]}, {"input_ids": [3, 4], "completion_mask": [1, 2]}],
               ValueError, "has 2 in the loss mask 'completion_mask'; a loss mask holds 1 (loss) or 0 (no loss)", 1),
    "mask too long on example 1": ([{"input_ids": [1, 2], "assistant_masks": [0, 1]},
                                    {"input_ids": [3, 4], "assistant_masks": [1, 1, 1]}],
                                   ValueError, "has 3 'assistant_masks' for 2 'input_ids'", 1),
}
TOKEN_RULES = ("float id", "negative id", "empty", "nested", "bool id")


def _text(exc) -> str:
    return str(exc)


def assert_raises_naming(call, error, text, where):
    """``call()`` raises ``error`` with one line that starts with ``where`` and holds ``text``."""
    with pytest.raises(error) as got:
        call()
    msg = _text(got.value)
    print(msg)
    assert msg.startswith(where + " has") or msg.startswith(where + " is"), msg
    assert text in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("case", list(BAD))
def test_collators_name_the_example(case):
    from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator

    rows, error, text, i = BAD[case]
    for collator in (PaddingFreeCollator(), FixedWindowCollator(window=8), PaddedCollator()):
        assert_raises_naming(lambda: collator(rows), error, text, f"example {i}")


@pytest.mark.parametrize("case", list(BAD))
def test_columnar_batch_names_the_dataset_row(case):
    from packkit.collate import PaddingFreeCollator

    rows, error, text, i = BAD[case]
    cols = {k: [None if r.get(k) is None else np.asarray(r[k]) for r in rows] for k in set().union(*rows)}
    try:
        batch = ExampleBatch(cols, rows=[500, 700])
    except (TypeError, ValueError) as exc:  # a nested column is refused when it is read
        pytest.fail(f"ExampleBatch refused {case}: {exc}")
    assert_raises_naming(lambda: PaddingFreeCollator()(batch), error, text, f"dataset row {[500, 700][i]}")


@pytest.mark.parametrize("case", list(BAD))
def test_offline_packing_names_the_dataset_row(case):
    datasets = pytest.importorskip("datasets")
    from packkit.offline import pack_dataset
    from packkit.packer import pack_stream

    rows, error, text, i = BAD[case]
    ds = datasets.Dataset.from_list(rows)
    assert_raises_naming(lambda: pack_dataset(ds, window=8), error, text, f"dataset row {i}")
    assert_raises_naming(lambda: list(pack_stream(rows, window=8)), error, text, f"example {i}")


@pytest.mark.parametrize("case", list(BAD))
def test_waste_plan_and_pack_commands_refuse_what_pack_refuses(case, tmp_path, capsys):
    """Before the fix, `packkit waste` measured float, NaN and negative ids and nested lists' outer lengths that
    `pack` rejects; `plan` counted label -7 as a loss token. Now the three refuse the same rows, in the
    same words."""
    from packkit.datafiles import read_lengths
    from packkit.cli import main
    from packkit.datafiles import read_lengths

    rows, error, text, i = BAD[case]
    path = tmp_path / "data.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    if case in TOKEN_RULES:
        assert_raises_naming(lambda: read_lengths(str(path)), error, text, f"dataset row {i}")
    assert_raises_naming(lambda: read_lengths(str(path)), error, text, f"dataset row {i}")
    for argv in (["waste", str(path), "-w", "8"], ["plan", str(path), "-w", "8", "-b", "1"],
                 ["pack", str(path), str(tmp_path / "out.parquet"), "-w", "8"]):
        if argv[0] == "waste" and case not in TOKEN_RULES:
            continue  # waste reads token ids only
        code = main(argv)
        err = capsys.readouterr().err
        assert code != 0 and err.count("\n") == 1 and f"dataset row {i} " in err and text in err, (argv, err)


def test_packed_rows_columnar_seq_lengths_are_checked_like_dicts():
    """Bug (drift between the two batch readers): read_column's ExampleBatch branch went through
    ExampleBatch.column, which skipped the dtype/shape check, so PackedRowsCollator silently truncated
    float seq_lengths [1.5, 2.5] of a columnar batch where the dict form raised. Both raise the same now."""
    from packkit.collate import PackedRowsCollator

    row = {"input_ids": np.arange(3), "seq_lengths": np.array([1.5, 2.5])}
    text = "example 0 has 1.5 (float) in 'seq_lengths'; token ids are integers >= 0"
    for batch in ([row], ExampleBatch({k: [v] for k, v in row.items()})):
        with pytest.raises(ExampleTypeError) as got:
            PackedRowsCollator(window=8, loss_mask="none")(batch)
        assert str(got.value) == text
    nested = ExampleBatch({"input_ids": [np.arange(3)], "seq_lengths": [np.ones((1, 2), int)]}, rows=[9])
    with pytest.raises(ExampleTypeError, match=r"dataset row 9 has a nested list in 'seq_lengths' \(shape \(1, 2\)\)"):
        PackedRowsCollator(window=8, loss_mask="none")(nested)


def test_both_batch_forms_read_a_null_the_same_way():
    """Drift between the two batch readers: a null token-id list read 'has a NoneType in ...' from dicts
    and 'has no 'input_ids' (null)' from columns (as offline packing says it); a key every example holds
    as None counted as labels or a mask given for the loss-mask warning from dicts only. Both forms
    follow the module's rule now: None is a key the example does not have."""
    import warnings

    from packkit.collate import PaddingFreeCollator

    def columns(exs):  # the batch a DataLoader fetches through ColumnarDataset: dataset rows 0, 1, ...
        from packkit.columnar import ColumnarDataset

        return ColumnarDataset(pa.Table.from_pylist(exs))[list(range(len(exs)))]

    exs = [{"input_ids": [1, 2]}, {"input_ids": None}]
    for batch, where in ((exs, "example 1"), (columns(exs), "dataset row 1")):
        with pytest.raises(ExampleValueError) as got:
            read_examples(batch)
        assert str(got.value) == f"{where} has no 'input_ids' (null); drop the example or fill it"
    for key in ("labels", *MASK_KEYS):
        exs = [{"input_ids": [1, 2], key: None}, {"input_ids": [3], key: None}]
        for batch in (exs, columns(exs)):
            with pytest.warns(LossMaskWarning, match="no example of this batch carries labels or a loss mask"):
                got = PaddingFreeCollator()(batch)
            assert got.labels.tolist() == [[-100, 2, -100]]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one example with the key: no warning on either form
            exs[1][key] = [1] if key != "labels" else [3]
            for batch in (exs, columns(exs)):
                PaddingFreeCollator()(batch)


def test_nan_in_a_float_column_is_named():
    table = pa.table({"input_ids": pa.array([[1.0, 2.0], [3.0, float("nan")]])})
    with pytest.raises(TypeError, match=r"dataset row 1 has nan \(float\) in 'input_ids'"):
        token_lengths(table.column("input_ids"))


def test_plan_does_not_count_bad_labels_as_loss():
    """Before the fix, `plan` counted label -7 as a loss token; now it is refused, and -100 is not counted."""
    table = pa.table({"input_ids": [[1, 2, 3]], "labels": [[-100, -7, 3]]})
    with pytest.raises(ValueError, match="dataset row 0 has label -7"):
        loss_lengths(table)
    assert loss_lengths(pa.table({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, -100]]})).tolist() == [1]


def test_loss_lengths_and_table_labels_honour_nulls_and_both_masks():
    rows = [{"input_ids": [5, 6, 7], "labels": [5, -100, 7], "completion_mask": None},
            {"input_ids": [8, 9], "labels": None, "completion_mask": [0, 1]},
            {"input_ids": [1, 2, 3], "labels": None, "completion_mask": [1, 1, 0], "assistant_masks": [0, 1, 1]}]
    rows[0]["assistant_masks"] = None
    rows[1]["assistant_masks"] = None
    table = pa.Table.from_pylist(rows)
    want = labels_by_hand(rows)
    assert table_labels(table).tolist() == want
    assert loss_lengths(table).tolist() == [1, 1, 1]  # first tokens never count
    ids, labels, _ = read_examples(rows)
    assert labels.tolist() == want


def test_null_rows_that_hold_values_in_arrow_are_examples_without_the_key():
    """Arrow lets a null list row keep values in its slot; they belong to no example. table_labels and
    loss_lengths (whose null rows are now filled by one gather, not a row-by-row loop) must skip them."""
    labels = pa.ListArray.from_arrays(pa.array([0, 2, 5, 6]), pa.array([5, -100, -100, -100, -100, -100]),
                                      mask=pa.array([False, True, False]))
    mask = pa.ListArray.from_arrays(pa.array([0, 2, 4, 5]), pa.array([1, 1, 0, 0, 0]),
                                    mask=pa.array([False, True, False]))
    table = pa.table({"input_ids": [[5, 6], [7, 8, 9], [1]], "labels": labels, "completion_mask": mask})
    assert table_labels(table).tolist() == [5, -100, 7, 8, 9, -100]
    assert loss_lengths(table).tolist() == [0, 2, 0]


# ----------------------------------------------------------------------------------------------
# the pieces
# ----------------------------------------------------------------------------------------------


def test_location_and_relocate():
    assert location(3) == "example 3" and location(3, rows=800) == "dataset row 803"
    assert location(1, rows=[9, 4]) == "dataset row 4"
    with pytest.raises(ExampleValueError) as got:
        check_values(np.array([3, -1]), [0, 1, 2], kind="ids", key="input_ids")
    assert str(got.value) == "example 1 has token id -1 in 'input_ids'; token ids are integers >= 0"
    moved = relocate(got.value, 800)
    assert isinstance(moved, ValueError) and str(moved) == "dataset row 801 has token id -1 in 'input_ids'; " \
                                                           "token ids are integers >= 0"


def test_errors_survive_pickling_and_dataloader_reraise():
    """A DataLoader worker's error is rebuilt in the main process as ``type(exc)(message)``; Ray pickles it."""
    with pytest.raises(ExampleTypeError) as got:
        read_examples([{"input_ids": [1.5]}])
    again = pickle.loads(pickle.dumps(got.value))
    assert str(again) == str(got.value) and isinstance(again, TypeError)
    assert str(type(got.value)("Caught in worker: " + str(got.value))).startswith("Caught in worker")


def test_selected_rows_outside_the_selection_are_not_blamed():
    values = np.array([1, -5, 2, 3])
    # -5 lies in no example
    check_values(values, starts=np.array([0, 2]), lengths=np.array([1, 2]), kind="ids", key="input_ids")
    with pytest.raises(ValueError, match="example 1 has label -5"):
        check_values(values, starts=np.array([0, 1]), lengths=np.array([1, 1]), kind="labels", key="labels")
    with pytest.raises(ValueError, match="example 0 has 2 in the loss mask"):
        check_values(np.array([2, 1]), [0, 2], kind="mask", key="completion_mask")


#: every integer dtype a column may hold (both byte orders for one), floats and bools
DTYPES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", ">i8", "f8", "b1"]
EDGE_VALUES = [-128, -101, -100, -99, -1, 0, 1, 2, 127]


def bad_by_hand(values, kind):
    """Where ``values`` break ``kind``'s rule, one value at a time (the slow, obvious reference)."""
    out = []
    for v in values.tolist():
        if values.dtype.kind == "b":
            out.append(False)
        elif kind == "ids":
            out.append(v < 0)
        elif kind == "labels":
            out.append(v < 0 and v != IGNORE_INDEX)
        else:
            out.append(v not in (0, 1))
    return out


@given(values=st.lists(st.sampled_from(EDGE_VALUES), max_size=12), dtype=st.sampled_from(DTYPES))
@example(values=[], dtype="i8")
@example(values=[-99], dtype="i1")
@example(values=[-101], dtype="i2")
@example(values=[-100, 2], dtype=">i8")
def test_any_bad_and_first_bad_agree_with_the_rule_value_by_value(values, dtype):
    """The fast any-bad test of each rule (unsigned views, two reductions) against a per-value loop,
    on every width and byte order (a value that does not fit the dtype wraps as numpy casts it)."""
    arr = np.array(values, np.int64).astype(dtype)
    for kind, any_bad in (("ids", ex.any_bad_id), ("labels", ex.any_bad_label), ("mask", ex.any_bad_mask)):
        want = bad_by_hand(arr, kind)
        if kind == "ids" and arr.dtype.kind not in "iu":
            continue  # token ids are checked for negatives once their dtype passed
        assert bool(any_bad(arr)) == any(want), (kind, arr)
        first = {"labels": ex.first_bad_label, "mask": ex.first_bad_mask}.get(kind)
        if first is not None:
            assert first(arr) == (want.index(True) if any(want) else None), (kind, arr)


def test_check_values_is_the_rule_of_each_kind_and_the_wrappers_call_it():
    offsets = [0, 1, 3]
    for kind, values, text in [("ids", [3, 4, -2], "example 1 has token id -2 in 'k'"),
                               ("labels", [3, -100, -2], "example 1 has label -2 in 'k'"),
                               ("mask", [1, 0, 3], "example 1 has 3 in the loss mask 'k'")]:
        with pytest.raises(ExampleValueError, match=text):
            ex.check_values(np.array(values), offsets, kind=kind, key="k")
    with pytest.raises(ValueError, match="dataset row 4 has no 'input_ids' \\(null\\)"):
        check_values(np.array([1, 2]), [0, 1, 2], valid=np.array([True, False]), rows=3, kind="ids", key="input_ids")
    with pytest.raises(ValueError, match="example 0 has label -3 in 'labels'"):
        check_values(np.array([-3]), [0, 1], kind="labels", key="labels")
    with pytest.raises(TypeError, match="example 0 has 1.5 \\(float\\) in 'completion_mask'"):
        check_values(np.array([1.5]), [0, 1], kind="mask", key="completion_mask")
    ex.check_values(np.array([True, False]), [0, 2], kind="mask", key="m")  # bools are a mask's values


def test_column_kind_and_check_column():
    assert [ex.column_kind(k, "input_ids") for k in ("input_ids", "labels", *MASK_KEYS, "seq_lengths")] == \
        ["ids", "labels", "mask", "mask", "other"]
    assert ex.column_kind("labels", "labels") == "ids"  # the token column is the token column, whatever its name
    lengths = np.array([2, 1])
    with pytest.raises(ValueError, match="dataset row 8 has 2 'labels' for 1 'tokens'"):
        ex.check_column(np.array([5, 6, 7, 8]), [0, 2, 4], kind="labels", key="labels", rows=7,
                        ref_lengths=lengths, ref_key="tokens")
    with pytest.raises(ValueError, match="dataset row 8 has no 'x' \\(null\\)"):
        ex.check_column(np.array([5, 6]), [0, 2, 2], kind="other", key="x", rows=7, valid=np.array([True, False]),
                        ref_lengths=lengths)
    # a null mask row is an example without a mask: neither its length nor its (absent) values are refused
    ex.check_column(np.array([0, 1]), [0, 2, 2], kind="mask", key="completion_mask", valid=np.array([True, False]),
                    ref_lengths=lengths)


def test_list_chunks_of_sliced_chunked_columns():
    col = pa.chunked_array([pa.array([[1, 2], [3]]), pa.array([[4, 5, 6], [-1], [7]]).slice(1)])
    got = [(v.tolist(), o.tolist(), first) for v, o, _, first in listcolumns.list_chunks(col)]
    assert got == [([1, 2, 3], [0, 2, 3], 0), ([-1, 7], [0, 1, 2], 2)]
    with pytest.raises(ValueError, match="dataset row 2 has token id -1"):
        token_lengths(col)
    with pytest.raises(ValueError, match=r"dataset row 1 has a null inside 'input_ids'"):
        token_lengths(pa.array([[1], [2, None]]))
    with pytest.raises(ValueError, match=r"dataset row 1 has no 'input_ids' \(null\)"):
        token_lengths(pa.array([[1], None]))
    with pytest.raises(TypeError, match=r"dataset row 0 has 'a' \(str\) in 'input_ids'"):
        token_lengths(pa.array([["a"]]))
    with pytest.raises(TypeError, match="column 'input_ids' holds int64, not lists of token ids"):
        token_lengths(pa.array([1, 2]))


def test_jsonl_with_a_float_line_is_refused_by_waste(tmp_path):
    """The reader names the row and its line itself, from Python too (the command line added the line by parsing
    the message)."""
    from packkit.datafiles import read_lengths

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"input_ids": [1, 2]}, {}, {"input_ids": [3, 4.5]}]))
    with pytest.raises(TypeError, match=r"dataset row 2 \(line 3 of .*d.jsonl'\) has 4.5 \(float\) in 'input_ids'"):
        read_lengths(str(path))


def test_values_past_int64_are_refused_by_name_never_cast():
    """uint64 token ids or labels past 2**63 - 1 (a parquet list<uint64> read into a collator) used to wrap
    to negatives (2**64 - 1 read as -1): every reader names the example and the value (packkit.rules)."""
    from packkit.examples import read_examples

    for ex, key in (({"input_ids": np.array([1, 2**64 - 1], np.uint64)}, "input_ids"),
                    ({"input_ids": [1, 2], "labels": np.array([1, 2**64 - 1], np.uint64)}, "labels"),
                    ({"input_ids": [1, 2**64 - 1]}, "input_ids")):
        with pytest.raises(ValueError, match=rf"example 1 has 18446744073709551615 \(int\) in '{key}', beyond int64"):
            read_examples([{"input_ids": [3]}, ex])
    assert read_examples([{"input_ids": np.array([1, 2**63 - 1], np.uint64)}])[0].tolist() == [1, 2**63 - 1]
