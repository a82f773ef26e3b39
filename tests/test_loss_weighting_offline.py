"""Examples split offline into separate packed rows weigh as the whole example under every loss weighting:
packed to a file on disk (pack_dataset, overflow="split"), read back, collated by PackedRowsCollator in a
DataLoader and summed by accumulation_step, the float64 loss and gradients equal the unpacked definition
within 1e-12 (the reference of test_loss_weighting, the pieces' masked first labels left out)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from testlib import tiny_token_lm

sys.path.insert(0, str(Path(__file__).parent))
from test_loss_weighting import IGNORE, MODES, VOCAB, grads, reference_loss  # noqa: E402

from packkit.collate import PackedRowsCollator
from packkit.loss import accumulation_step
from packkit.offline import pack_dataset
from packkit.weighting import ColumnWeighting

datasets = pytest.importorskip("datasets")

WINDOW = 8
#: two examples split in 3 pieces, one in 2, four whole; prompts masked on some
LENGTHS = [20, 3, 12, 5, 17, 7, 2]


def examples(seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = []
    for i, n in enumerate(LENGTHS):
        ids = rng.integers(0, VOCAB, n).tolist()
        prompt = int(rng.integers(0, n // 2 + 1)) if i % 2 else 0
        docs.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return docs


def read(path: Path, fmt: str):
    if fmt == "parquet":
        return datasets.Dataset.from_parquet(str(path))
    if fmt == "arrow":
        return datasets.Dataset.from_file(str(path))
    return datasets.load_dataset("json", data_files=str(path), split="train")


def packed_step(model, rows, mode, *, batch_size: int, workers: int = 0):
    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size, num_workers=workers,
                                         collate_fn=PackedRowsCollator(window=WINDOW, loss_weighting=mode))
    mbs = list(loader)
    step = accumulation_step(mbs, all_reduce=False)
    return sum(step.loss(model(mb["input_ids"]), mb) for mb in mbs)


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "jsonl"])
def test_pieces_in_separate_rows_weigh_as_the_unpacked_example(tmp_path, fmt):
    """Every mode but Column (a weight per example, refused for packed rows) through parquet; through the other
    formats, a mode whose weights the batch makes lazily ("sample") and one made in the collator (a callable)."""
    docs = examples(len(fmt))
    out, plan = pack_dataset(datasets.Dataset.from_list(docs), window=WINDOW, overflow="split", seed=len(fmt),
                             output=tmp_path / f"rows.{fmt}", return_report=True)
    assert plan.split_examples.size == 3 and plan.num_windows > 3
    dropped = {}  # the first label of every later piece: never trained (it would be predicted across rows)
    for ex, start in zip(plan.seg_example.tolist(), plan.seg_start.tolist()):
        if start > 0:
            dropped.setdefault(ex, set()).add(start)
    rows = read(out, fmt)
    assert {"example_ids", "piece_offsets", "example_loss"} <= set(rows.column_names)
    for m, mode in enumerate(MODES):
        if isinstance(mode, ColumnWeighting) or (fmt != "parquet" and mode != "sample" and m != len(MODES) - 1):
            continue
        model, ref_model = tiny_token_lm(VOCAB, 4), tiny_token_lm(VOCAB, 4)
        got = packed_step(model, rows, mode, batch_size=2, workers=2 if fmt == "parquet" and m == 1 else 0)
        want = reference_loss(ref_model, docs, mode, dropped)
        got.backward()
        want.backward()
        err, gerr = abs(float(got.detach() - want.detach())), float((grads(model) - grads(ref_model)).abs().max())
        assert err <= 1e-12 and gerr <= 1e-12, (getattr(mode, "name", mode), err, gerr)


def test_an_index_only_plan_weighs_pieces_as_the_written_rows(tmp_path):
    """A PlannedDataset's rows record the pieces' examples as the written rows do, and weigh the same."""
    from packkit.planned import PlannedDataset

    docs = examples(3)
    ds = datasets.Dataset.from_list(docs)
    out, plan = pack_dataset(ds, window=WINDOW, seed=3, output=tmp_path / "rows.packplan", return_report=True)
    planned = PlannedDataset(out, ds)
    written = pack_dataset(ds, window=WINDOW, seed=3)
    for r in range(len(written)):
        assert {k: np.asarray(v).tolist() for k, v in planned[r].items()} == written[r]
    dropped = {}
    for ex, start in zip(plan.seg_example.tolist(), plan.seg_start.tolist()):
        if start > 0:
            dropped.setdefault(ex, set()).add(start)
    model, ref_model = tiny_token_lm(VOCAB, 4), tiny_token_lm(VOCAB, 4)
    got, want = packed_step(model, planned, "sample", batch_size=3), reference_loss(ref_model, docs, "sample", dropped)
    assert abs(float(got.detach() - want.detach())) <= 1e-12


def test_the_rows_record_each_pieces_example_offset_and_loss(tmp_path):
    """Every document's example id, its offset in the example and the example's trained loss tokens (its
    pieces' own, summed), read back from the file."""
    docs = examples()
    out, plan = pack_dataset(datasets.Dataset.from_list(docs), window=WINDOW, overflow="split", shuffle=False,
                             output=tmp_path / "rows.parquet", return_report=True)
    rows = datasets.Dataset.from_parquet(str(out))
    ids = np.concatenate(rows["example_ids"])
    starts = np.concatenate(rows["piece_offsets"])
    loss = np.concatenate(rows["example_loss"])
    assert np.array_equal(ids, plan.seg_example) and np.array_equal(starts, plan.seg_start)
    for c, doc in enumerate(docs):
        cut = {s for e, s in zip(ids.tolist(), starts.tolist()) if e == c}
        trained = sum(1 for t in range(1, len(doc["labels"])) if doc["labels"][t] != IGNORE and t not in cut)
        assert set(loss[ids == c].tolist()) == {trained}


def test_a_format_without_room_says_so_in_one_line(tmp_path, caplog, capsys):
    """Megatron-Bridge parquet and Megatron's indexed folders hold no document columns: pack_dataset logs it and
    packkit pack prints it, one line each; parquet says nothing."""
    from packkit.cli import main

    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in examples()]
    with caplog.at_level("WARNING", logger="packkit"):
        pack_dataset(datasets.Dataset.from_list(docs), window=WINDOW, output=tmp_path / "rows.idx.parquet")
        pack_dataset(datasets.Dataset.from_list(docs), window=WINDOW, output=tmp_path / "rows.parquet")
    said = [r.getMessage() for r in caplog.records if "example_loss" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "bridge" in said[0]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"input_ids": {d["input_ids"]}}}\n' for d in docs))
    for out, lines in (("o.megatron", 1), ("o.parquet", 0)):
        assert main(["pack", str(src), str(tmp_path / out), "-w", str(WINDOW)]) == 0
        printed = capsys.readouterr().out
        assert sum("has no room for example_ids" in line for line in printed.splitlines()) == lines, printed


class TokenModel(torch.nn.Module):
    """:func:`tiny_token_lm` as ``Trainer`` calls a model (``model(**batch)`` -> outputs with ``logits``): a piece of
    a split example sees only its own window, so the step equals the unpacked definition only where attention is
    beside the point."""

    def __init__(self):
        super().__init__()
        self.net = tiny_token_lm(VOCAB, 4)

    def forward(self, input_ids, labels=None, **packed):
        return {"logits": self.net(input_ids)}


@pytest.mark.slow  # a real Trainer run
@pytest.mark.parametrize("mixin", [True, False])
def test_trainer_with_default_arguments_keeps_the_piece_columns(tmp_path, mixin):
    """transformers.Trainer drops every column its model's forward does not name (remove_unused_columns=True, its
    default; TRL's keeps seq_lengths alone): example_loss with them, and the pieces would weigh as separate
    examples. WeightedLossMixin keeps the segment and document columns, so one step over the packed file has the
    unpacked definition's gradient; under a plain Trainer the collator misses the rows' segments and says so."""
    transformers = pytest.importorskip("transformers")
    from test_loss_weighting_trainer import Grads, WeightedTrainer

    from packkit.loss import hf_compute_loss_func

    docs = examples(5)
    out, plan = pack_dataset(datasets.Dataset.from_list(docs), window=WINDOW, overflow="split", seed=5,
                             output=tmp_path / "rows.parquet", return_report=True)
    dropped = {}
    for ex, start in zip(plan.seg_example.tolist(), plan.seg_start.tolist()):
        if start > 0:
            dropped.setdefault(ex, set()).add(start)
    rows = datasets.Dataset.from_parquet(str(out))
    model, ref_model, grad = TokenModel(), tiny_token_lm(VOCAB, 4), Grads()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], max_steps=1,
                                          max_grad_norm=0.0, save_strategy="no", disable_tqdm=True,
                                          per_device_train_batch_size=len(rows))
    assert args.remove_unused_columns  # the default this test is about
    trainer = (WeightedTrainer if mixin else transformers.Trainer)(
        model=model, args=args, train_dataset=rows, callbacks=[grad], compute_loss_func=hf_compute_loss_func,
        data_collator=PackedRowsCollator(window=WINDOW, loss_weighting="sample"))
    if not mixin:
        with pytest.raises(ValueError, match=r"no 'seq_lengths'.*remove_unused_columns=False"):
            trainer.train()
        return
    trainer.train()
    reference_loss(ref_model, docs, "sample", dropped).backward()
    err = float((grad.grad - grads(ref_model)).abs().max())
    print(f"max |grad - unpacked definition| {err:.1e}")
    assert err <= 1e-12


@pytest.mark.parametrize("source", ["pack_stream", "iterable_dataset"])
def test_streamed_pieces_weigh_as_the_unpacked_example(tmp_path, source):
    """Examples packed as they stream (``pack_stream`` with ``example_ids=True``, or ``pack_dataset`` on an
    ``IterableDataset``), split across rows, written to parquet and read back: the rows record each piece's example,
    offset and whole example's loss tokens, and every mode weighs the pieces as the whole example (float64 loss and
    gradients equal the unpacked definition within 1e-12). Fails before: the stream wrote example_ids only, so each
    piece weighed as an example of its own."""
    from packkit.packer import pack_stream

    docs = examples(7)
    if source == "pack_stream":
        rows = list(pack_stream(iter(docs), window=WINDOW, buffer_size=3, overflow="split", example_ids=True))
    else:
        rows = list(pack_dataset(datasets.Dataset.from_list(docs).to_iterable_dataset(), window=WINDOW,
                                 overflow="split", example_ids=True, shuffle=False, buffer_size=3))
    path = tmp_path / "streamed.parquet"
    datasets.Dataset.from_list([{k: np.asarray(v).tolist() for k, v in r.items()} for r in rows]).to_parquet(str(path))
    back = datasets.Dataset.from_parquet(str(path))
    assert {"example_ids", "piece_offsets", "example_loss"} <= set(back.column_names)
    ids, starts = np.concatenate(back["example_ids"]), np.concatenate(back["piece_offsets"])
    assert (starts > 0).sum() == 5  # 20 and 17 tokens in 3 pieces of at most 8, 12 in 2
    dropped = {}
    for ex, start in zip(ids.tolist(), starts.tolist()):
        if start > 0:
            dropped.setdefault(ex, set()).add(start)
    for mode in MODES:
        if isinstance(mode, ColumnWeighting):
            continue
        model, ref_model = tiny_token_lm(VOCAB, 4), tiny_token_lm(VOCAB, 4)
        got = packed_step(model, back, mode, batch_size=2)
        want = reference_loss(ref_model, docs, mode, dropped)
        got.backward()
        want.backward()
        err, gerr = abs(float(got.detach() - want.detach())), float((grads(model) - grads(ref_model)).abs().max())
        print(f"{getattr(mode, 'name', mode)}: loss {err:.1e}, gradient {gerr:.1e}")
        assert err <= 1e-12 and gerr <= 1e-12, (getattr(mode, "name", mode), err, gerr)


def test_a_streamed_state_keeps_the_pieces_example_loss(tmp_path):
    """A stream saved while pieces of a split example wait in its buffer (JSON round trip) and resumed gives the rows
    the uninterrupted stream gives, each piece's ``example_loss`` its whole example's."""
    import json

    from packkit.packer import pack_stream

    docs = examples(7)
    opts = dict(window=WINDOW, buffer_size=3, overflow="split", example_ids=True)
    want = list(pack_stream(iter(docs), **opts))
    own, recorded = {}, {}  # each example's loss tokens as its rows carry them, and what each piece records
    for r in want:
        at = np.cumsum(np.concatenate([[0], r["seq_lengths"]]))
        for k, ex in enumerate(r["example_ids"].tolist()):
            own[ex] = own.get(ex, 0) + int((r["labels"][at[k]:at[k + 1]] != IGNORE).sum())
            recorded.setdefault(ex, set()).add(int(r["example_loss"][k]))
    assert recorded == {ex: {n} for ex, n in own.items()}
    for cut in range(1, len(want)):
        first = pack_stream(list(docs), **opts)
        head = [next(first) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        again = pack_stream(list(docs), **opts)
        again.load_state_dict(state)
        got = head + list(again)
        assert [{k: v.tolist() for k, v in r.items()} for r in got] == [{k: v.tolist() for k, v in r.items()} for r in want]
