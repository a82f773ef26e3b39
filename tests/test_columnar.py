"""packkit.columnar: the columnar DataLoader path, through its real consumers (a DataLoader with
workers and packkit's samplers, transformers.Trainer with default arguments), and the locations of
errors (the dataset row, found from inside a worker)."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator
from packkit.examples import ExampleBatch
from packkit.rules import MASK_KEYS, LossMaskWarning
from packkit.segments import IGNORE_INDEX

datasets = pytest.importorskip("datasets")
from packkit.columnar import ColumnarDataset  # noqa: E402

FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "attention_mask")


def chat_rows(n=40, seed=0, *, mixed=True):
    """Examples with a completion mask (some without: null), some with labels, a few with both masks."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(2, 40))
        ids = rng.integers(0, 64, k).tolist()
        row = {"input_ids": ids, "labels": None, "completion_mask": None, "assistant_masks": None}
        p = int(rng.integers(1, k))
        if not mixed or i % 4 != 0:
            row["completion_mask"] = [0] * p + [1] * (k - p)
        if mixed and i % 5 == 1:
            row["labels"] = [IGNORE_INDEX] + ids[1:]
        if mixed and i % 7 == 2:
            row["assistant_masks"] = rng.integers(0, 2, k).tolist()
        out.append(row)
    return out


def assert_same_batch(a, b):
    """Every tensor field, max_seqlen and num_loss_tokens of two batches are equal."""
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x, y), f
    assert a.max_seqlen == b.max_seqlen and a.num_loss_tokens == b.num_loss_tokens


def as_dicts(rows):
    """The list-of-dicts form of rows: None values dropped (a key the example does not have)."""
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


COLLATORS = [PaddingFreeCollator(), FixedWindowCollator(window=64), PaddedCollator(pad_to_multiple_of=8),
             PaddingFreeCollator(mask_first_label=True, loss_mask="auto")]


@pytest.mark.parametrize("collator", COLLATORS, ids=lambda c: repr(c).split("(")[0])
@pytest.mark.parametrize("source", ["memory", "disk", "shuffled"])
def test_columnar_batches_equal_the_dict_batches(collator, source, tmp_path):
    rows = chat_rows()
    ds = datasets.Dataset.from_list(rows)
    if source == "disk":
        ds.save_to_disk(str(tmp_path / "ds"))
        ds = datasets.load_from_disk(str(tmp_path / "ds"))
    if source == "shuffled":
        ds = ds.shuffle(seed=1)
    rows = ds.to_list()  # the rows in the dataset's order (None: a key the example does not have)
    cds = ColumnarDataset(ds)
    for batch in ([3, 0, 17, 5], list(range(8, 20)), [39], [1, 1, 2]):
        want = collator(as_dicts([rows[i] for i in batch]))
        got = collator(cds.__getitems__(batch))
        assert_same_batch(got, want)


def test_an_example_batch_is_views_not_python_objects():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "completion_mask": [[0, 1, 1], [1, 1]]})
    cds = ColumnarDataset(ds)
    batch = cds.__getitems__([1, 0])
    assert isinstance(batch, ExampleBatch) and batch.rows.tolist() == [1, 0]
    assert all(isinstance(p, np.ndarray) for p in batch.columns["input_ids"])
    base = batch.columns["input_ids"][0].base
    assert base is not None and batch.columns["input_ids"][1].base is base  # one buffer, no copy
    assert cds[0]["input_ids"].tolist() == [1, 2, 3] and sorted(cds[0]) == ["completion_mask", "input_ids"]
    assert cds.example_lengths().tolist() == [3, 2]
    again = pickle.loads(pickle.dumps(cds))
    assert again[1]["completion_mask"].tolist() == [1, 1] and len(again) == 2


def test_columns_and_types_are_checked_once():
    with pytest.raises(KeyError, match="no 'input_ids' column"):
        ColumnarDataset(datasets.Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(TypeError, match=r"dataset row 0 has 1.5 \(float\) in 'input_ids'"):
        ColumnarDataset(datasets.Dataset.from_dict({"input_ids": [[1.5, 2.0]]}))
    with pytest.raises(TypeError, match="dataset row 0 has a nested list in 'input_ids'"):
        ColumnarDataset(datasets.Dataset.from_dict({"input_ids": [[[1, 2]]]}))
    with pytest.raises(IndexError, match="row 5 is outside a dataset of 1 rows"):
        ColumnarDataset(datasets.Dataset.from_dict({"input_ids": [[1]]})).__getitems__([5])


def test_packed_rows_through_the_columnar_path():
    from packkit.offline import pack_dataset

    ds = datasets.Dataset.from_list(as_dicts(chat_rows(60, mixed=False)))
    packed = pack_dataset(ds, window=64, seed=0)
    cds = ColumnarDataset(packed)
    assert "seq_lengths" in cds.column_names
    collator = PackedRowsCollator(window=64)
    for batch in ([0, 1, 2], [4, 3]):
        assert_same_batch(collator(cds.__getitems__(batch)), collator([packed[i] for i in batch]))


# ----------------------------------------------------------------------------------------------
# a DataLoader with workers and packkit's samplers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler_kind", ["batch_size", "packed", "length_grouped"])
def test_dataloader_with_two_workers_and_samplers(sampler_kind):
    from packkit.sampler import LengthGroupedSampler, PackedBatchSampler

    rows = chat_rows(64, seed=3)
    ds = datasets.Dataset.from_list(rows)
    cds = ColumnarDataset(ds)
    if sampler_kind == "batch_size":
        kw = dict(batch_size=8, shuffle=False)
        collator = PaddingFreeCollator()
    elif sampler_kind == "packed":
        kw = dict(batch_sampler=PackedBatchSampler(dataset=cds, window=64, windows_per_batch=2, seed=0))
        collator = FixedWindowCollator(window=64, strategy="next_fit", num_windows=2)
    else:
        kw = dict(batch_sampler=LengthGroupedSampler(dataset=cds, batch_size=8, seed=0))
        collator = PaddingFreeCollator()
    loader = DataLoader(cds, num_workers=2, collate_fn=collator, timeout=120, **kw)
    batches = list(loader)
    order = list(kw["batch_sampler"]) if "batch_sampler" in kw else [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert len(batches) == len(order)
    for got, idx in zip(batches, order):
        assert_same_batch(got, collator(as_dicts([rows[i] for i in idx])))
    assert sum(b.num_examples for b in batches) == 64


def test_a_bad_row_deep_in_an_epoch_with_two_workers_names_the_dataset_row():
    """Before the fix, collator errors named the position inside the batch ("example 7"), so under a
    DataLoader with workers the bad row could not be found. Through ColumnarDataset the batch carries
    its dataset indices: the one error names the dataset row, and the rule."""
    rng = np.random.default_rng(0)
    n, bad = 4000, 3517
    ids = [rng.integers(0, 100, int(rng.integers(1, 30))).tolist() for _ in range(n)]
    labels = [list(x) for x in ids]
    labels[bad][-1] = -7
    cds = ColumnarDataset(datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}))
    loader = DataLoader(cds, batch_size=16, shuffle=True, num_workers=2, collate_fn=PaddingFreeCollator(),
                        generator=torch.Generator().manual_seed(0), timeout=120)
    seen, batches = 0, iter(loader)
    try:
        with pytest.raises(ValueError) as got:
            for batch in batches:
                seen += batch.num_examples
    finally:
        # the error's traceback holds the iterator in a cycle: left to the garbage collector, its two workers
        # were shut down during the next test and took 10 s there (DataLoader's 5 s join timeout each);
        # shut down here they take 0.03 s
        batches._shutdown_workers()
    msg = str(got.value)
    print(msg.splitlines()[-1], f"(after {seen} examples)")
    assert f"dataset row {bad} has label -7 in 'labels'; labels are token ids (>= 0) or -100" in msg
    assert "DataLoader worker" in msg and seen > 0


def test_the_same_bad_row_as_a_plain_list_names_the_batch_position():
    """Without the wrapper a collator only sees the batch: it names the example's position in it."""
    with pytest.raises(ValueError, match="example 1 has label -7"):
        PaddingFreeCollator()([{"input_ids": [1, 2]}, {"input_ids": [3, 4], "labels": [3, -7]}])


# ----------------------------------------------------------------------------------------------
# transformers.Trainer with its default arguments
# ----------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

from testlib import tiny_causal_lm  # noqa: E402


def tiny_llama():
    return tiny_causal_lm(dtype=torch.float32, vocab_size=64, max_position_embeddings=128)


class Recording:
    """Wraps a collator and records each batch it makes, and the dataset rows it came from when the
    features are a columnar batch's rows (num_workers=0: it runs in this process)."""

    def __init__(self, collator):
        self.collator, self.batches, self.rows = collator, [], []

    def __call__(self, features):
        batch = self.collator(features)
        self.batches.append(batch)
        from packkit.examples import ExampleRow

        if features and isinstance(features[0], ExampleRow):
            self.rows.append([int(r.batch.rows[r.index]) for r in features])
        return batch


def run_trainer(train_dataset, collator, tmp_path, **overrides):
    """Three steps with TrainingArguments' defaults (remove_unused_columns=True among them); only what
    a CPU test needs is set."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3,
                                          per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True,
                                          **overrides)
    assert args.remove_unused_columns is True or "remove_unused_columns" in overrides
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=train_dataset, data_collator=collator)
    trainer.train()
    return trainer


def masked_counts(rows):
    """Loss tokens each example must contribute under the rule (first token never a target)."""
    out = []
    for r in as_dicts(rows):
        lab = list(r.get("labels", r["input_ids"]))
        for k in MASK_KEYS:
            if k in r:
                lab = [IGNORE_INDEX if m == 0 else v for v, m in zip(lab, r[k])]
        out.append(sum(1 for v in lab[1:] if v != IGNORE_INDEX))
    return out


@pytest.mark.slow
def test_trainer_defaults_with_columnar_dataset_honour_the_mask(tmp_path):
    """Before the fix, Trainer's default remove_unused_columns=True dropped completion_mask before the collator
    saw it (8 of 68 labels masked instead of half). Through ColumnarDataset the mask arrives: every
    batch's loss tokens are the masked count, on every example."""
    rows = chat_rows(12, seed=5, mixed=False)
    recording = Recording(PaddingFreeCollator(loss_mask="required"))
    run_trainer(ColumnarDataset(datasets.Dataset.from_list(rows)), recording, tmp_path)
    assert len(recording.batches) == 3 and len(recording.rows) == 3
    want = masked_counts(rows)
    for b, idx in zip(recording.batches, recording.rows):
        print("rows", idx, "loss tokens", b.num_loss_tokens, "of", b.num_tokens)
        assert b.num_loss_tokens == sum(want[i] for i in idx)
        assert b.num_loss_tokens < b.num_tokens - b.num_examples  # prompts are masked


@pytest.mark.slow
@pytest.mark.parametrize("as_list", [False, True], ids=["datasets.Dataset", "list of dicts"])
def test_trainer_defaults_with_masked_data_name_the_setting(tmp_path, as_list):
    """The bad-data matrix row "Trainer's default columns with masked data": the mask is dropped by
    Trainer (from the Dataset, or from each dict by RemoveColumnsCollator). With loss_mask='required' the
    collator says so, naming remove_unused_columns=False; with the default it warns once, naming it."""
    rows = as_dicts(chat_rows(12, seed=5, mixed=False))
    data = rows if as_list else datasets.Dataset.from_list(rows)
    with pytest.raises(ValueError, match=r"example 0 has no loss mask .*remove_unused_columns=False"):
        run_trainer(data, PaddingFreeCollator(loss_mask="required"), tmp_path)
    with pytest.warns(LossMaskWarning, match=r"remove_unused_columns=False"):
        run_trainer(data, PaddingFreeCollator(), tmp_path)
    # with the setting the mask arrives and is honoured
    recording = Recording(PaddingFreeCollator(loss_mask="required"))
    run_trainer(data, recording, tmp_path, remove_unused_columns=False)
    assert all(int((b.labels == IGNORE_INDEX).sum()) > b.num_examples for b in recording.batches)


@pytest.mark.slow
def test_packed_rows_under_trainer_defaults(tmp_path):
    """PackedRowsCollator failed under Trainer's defaults with an error that did not name the setting;
    now it names it, and the columnar path keeps seq_lengths."""
    from packkit.offline import pack_dataset

    packed = pack_dataset(datasets.Dataset.from_list(as_dicts(chat_rows(40, mixed=False))), window=64, seed=0)
    with pytest.raises(ValueError, match=r"has no 'seq_lengths' or 'position_ids'.*remove_unused_columns=False"):
        run_trainer(packed, PackedRowsCollator(window=64), tmp_path)
    recording = Recording(PackedRowsCollator(window=64))
    run_trainer(ColumnarDataset(packed), recording, tmp_path)
    assert len(recording.batches) >= 3 and len(recording.rows) == len(recording.batches)
    for b, idx in zip(recording.batches, recording.rows):
        assert_same_batch(b, PackedRowsCollator(window=64)([packed[i] for i in idx]))


def test_bad_data_matrix_has_no_silent_prompt_token_loss(tmp_path):
    """Each row of the matrix is an error naming the example (or the setting), or the mask honoured."""
    collator = PaddingFreeCollator()
    mask_on_some = [{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7, 8], "completion_mask": [0, 0, 1]}]
    assert collator(mask_on_some).labels.tolist() == [[-100, 4, 5, -100, -100, 8]]
    labels_on_some = [{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7, 8], "labels": [-100, -100, 8]}]
    assert collator(labels_on_some).labels.tolist() == [[-100, 4, 5, -100, -100, 8]]
    for bad, match in [
        ([{"input_ids": [3, 4]}, {"input_ids": [6, 7, 8], "labels": [6, 7]}], "example 1 has 2 'labels' for 3"),
        ([{"input_ids": [3, 4]}, {"input_ids": [6, 7, 8], "completion_mask": [0, 1]}],
         "example 1 has 2 'completion_mask' for 3"),
        ([{"input_ids": [3, 4], "completion_mask": [0, 1]}, {"input_ids": [6, 7]}], None),
    ]:
        if match is None:  # mask on example 0 only: example 1 trains on its tokens, as it would alone
            assert collator(bad).labels.tolist() == [[-100, 4, -100, 7]]
            with pytest.raises(ValueError, match="example 1 has no loss mask"):
                PaddingFreeCollator(loss_mask="required")(bad)
            continue
        for c in (collator, FixedWindowCollator(window=8), PaddedCollator()):
            with pytest.raises(ValueError, match=match):
                c(bad)
    with pytest.raises(ValueError, match=r"example 1 has a loss mask 'completion_mask' and loss_mask='none'"):
        PaddingFreeCollator(loss_mask="none")(mask_on_some)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PaddingFreeCollator(loss_mask="none")([{"input_ids": [1, 2]}])  # pretraining: no warning


def test_batches_cross_processes_by_value():
    """A worker's batch goes through multiprocessing's pickler with its CPU tensors by value (numpy),
    not one shared-memory segment per tensor (a fixed cost that capped loaders with workers): the batch
    arrives equal, with its counts, shared tensors still shared. Large or non-numpy batches keep torch's way."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from packkit import collate

    for batch in (PaddingFreeCollator()(as_dicts(chat_rows(8))), FixedWindowCollator(window=64)(as_dicts(chat_rows(8))),
                  PaddedCollator()(as_dicts(chat_rows(8)))):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(batch)
        data = buf.getvalue()
        assert b"torch.multiprocessing" not in data and b"rebuild_storage" not in data
        got = pickle.loads(data)
        assert_same_batch(got, batch)
        assert got.num_tokens == batch.num_tokens and got.num_examples == batch.num_examples
        if "cu_seq_lens_q" in got:
            assert got["cu_seq_lens_q"] is got["cu_seq_lens_k"]
    big = PaddingFreeCollator()([{"input_ids": np.zeros(collate.SHIP_BY_VALUE_BYTES // 16, np.int64)}])
    tensors = {}
    collate._swap(collate._reduce_by_value(big)[1:], tensors)
    assert tensors  # still tensors: torch's reducer (shared memory) ships them
