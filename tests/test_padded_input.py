"""Examples tokenized with padding are refused on every surface that reads examples (packkit.rules).

Regression (user walk-through, silent before): ``tokenizer(texts, padding=True)`` gives an ``attention_mask`` with
0 at the pad positions; packkit packed those pads as content, so they were attended to and carried the loss
(``PaddingFreeCollator()([{"input_ids": [0, 0, 5, 6, 7], "attention_mask": [0, 0, 1, 1, 1]}])`` gave labels
``[-100, 0, 5, 6, 7]``, and ``packkit pack`` of such a .jsonl did the same). Now one rule
(:func:`packkit.rules.padded_example`) refuses such an example naming it and the fix, through the real consumers:
the collators in a DataLoader (dict examples and :class:`~packkit.columnar.ColumnarDataset` batches), ``packkit
pack`` of a .jsonl on disk, ``pack_dataset`` of a ``datasets.Dataset`` and ``pack_stream``. An attention mask of all
ones (what a tokenizer without padding gives) still packs exactly as the same examples without it.

Regression (padmask39b, silent before): ``packkit waste`` and ``packkit plan`` (and ``measure_waste`` / ``plan_budget``
of :func:`packkit.datafiles.read_lengths`) measured such a file with its pads counted as tokens; now refused by the
same rule, naming the row and its line in a .jsonl; all ones measures the same figures as no mask.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packkit.collate import FixedWindowCollator, PaddedCollator, PaddingFreeCollator
from packkit.located import ExampleTypeError, ExampleValueError
from packkit.packer import pack_stream

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from packkit.cli import main  # noqa: E402
from packkit.columnar import ColumnarDataset  # noqa: E402
from packkit.datafiles import read_lengths  # noqa: E402
from packkit.offline import pack_dataset  # noqa: E402
from packkit.waste import measure_waste  # noqa: E402

PADDED = "has an attention_mask with {} (padding from the tokenizer): packing would train on the pad tokens as " \
         "content; tokenize without padding (padding=False; packkit pads nothing), or drop the pad positions"
COLLATORS = {
    "padding_free": lambda: PaddingFreeCollator(loss_mask="none"),
    "fixed_window": lambda: FixedWindowCollator(window=16, loss_mask="none"),
    "padded": lambda: PaddedCollator(loss_mask="none"),
}
TEXTS = ["the cat sat", "a dog", "the dog sat on a mat"]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer with a pad token: ``padding=True`` pads the short texts as a real one does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate(["<pad>", "<unk>", "the", "cat", "sat", "a", "dog", "on", "mat"])}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>")


def rows(enc) -> list:
    """A tokenizer's batch output as one example per text."""
    return [dict(zip(enc, values)) for values in zip(*enc.values())]


def cli(argv) -> tuple[int, str]:
    """``packkit ARGV`` in this process (what the script calls) -> (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def write_jsonl(path, examples) -> None:
    path.write_text("".join(json.dumps(ex) + "\n" for ex in examples))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", sorted(COLLATORS))
def test_a_collator_in_a_dataloader_refuses_a_padded_example(tokenizer, name, side):
    """The bug: a collator fed ``tokenizer(texts, padding=True)`` rows trained on the pads; now the DataLoader's
    batch is refused naming the first padded example (the second text, 2 pad tokens) and the fix."""
    tokenizer.padding_side = side
    examples = rows(tokenizer(TEXTS, padding=True))
    assert examples[1]["attention_mask"].count(0) == 4 and examples[0]["attention_mask"].count(0) == 3
    loader = DataLoader(examples, batch_size=3, collate_fn=COLLATORS[name]())
    with pytest.raises(ExampleValueError, match="^example 0 " + PADDED.format("3 zeros").replace("(", r"\(")
                       .replace(")", r"\)")):
        next(iter(loader))


@pytest.mark.parametrize("name", sorted(COLLATORS))
def test_a_columnar_batch_names_the_padded_dataset_row(name):
    """The columnar path (:class:`ColumnarDataset`) reads the attention mask too, so the error names the row."""
    ds = datasets.Dataset.from_list([{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}] * 3
                                    + [{"input_ids": [0, 5, 6], "attention_mask": [0, 1, 1]}])
    loader = DataLoader(ColumnarDataset(ds), batch_size=4, collate_fn=COLLATORS[name]())
    with pytest.raises(ExampleValueError, match=r"^dataset row 3 has an attention_mask with 1 zero \(padding"):
        next(iter(loader))


@pytest.mark.parametrize("mask, error, words", [
    ([1, 2, 1], ExampleValueError, "example 1 has 2 in 'attention_mask'; an attention_mask holds 1 (a token) or 0"),
    ([1, 1], ExampleValueError, "example 1 has 2 'attention_mask' for 3 'input_ids'; they must match token for"),
    ([1.0, 1.0, 1.0], ExampleTypeError, "example 1 has 1.0 (float) in 'attention_mask'"),
    ([True, False, True], ExampleValueError, "example 1 has an attention_mask with 1 zero (padding"),
])
def test_an_attention_mask_that_is_not_ones_token_for_token_is_refused_everywhere(tmp_path, mask, error, words):
    """Values other than 0/1, another length than ``input_ids``, floats: refused by the rules' own checks, with
    the same words from a collator, ``pack_stream``, ``pack_dataset`` and ``packkit pack``."""
    ones = [True] * 3 if isinstance(mask[0], bool) else [1] * 3  # one Arrow type for the two rows
    examples = [{"input_ids": [5, 6, 7], "attention_mask": ones}, {"input_ids": [8, 9, 10], "attention_mask": mask}]
    with pytest.raises(error) as got:
        PaddingFreeCollator(loss_mask="none")(examples)
    assert words in str(got.value)
    with pytest.raises(error) as got:
        list(pack_stream(iter(examples), window=8))
    assert words in str(got.value)
    if isinstance(mask[0], float):
        return  # Arrow makes one float column of the two rows: its first value is named (tested in test_offline)
    with pytest.raises((ExampleValueError, ExampleTypeError)) as got:
        pack_dataset(datasets.Dataset.from_list(examples), window=8)
    assert words.replace("example 1", "dataset row 1") in str(got.value)
    write_jsonl(tmp_path / "in.jsonl", examples)
    code, err = cli(["pack", tmp_path / "in.jsonl", tmp_path / "out.parquet", "--window", "8"])
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "dataset row 1 (line 2 of" in err and words.split(" ", 2)[2] in err
    assert not (tmp_path / "out.parquet").exists()
    code, err = cli(["waste", tmp_path / "in.jsonl", "--window", "8"])
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "dataset row 1 (line 2 of" in err and words.split(" ", 2)[2] in err


def test_packkit_pack_refuses_a_padded_jsonl_and_writes_nothing(tmp_path, tokenizer):
    """``packkit pack`` of a .jsonl of ``tokenizer(texts, padding=True)`` rows: one line naming the row, its line
    in the file and the fix; exit code of bad data; no OUT, and the input untouched."""
    tokenizer.padding_side = "right"
    path = tmp_path / "padded.jsonl"
    write_jsonl(path, rows(tokenizer(TEXTS, padding=True)))
    before = path.read_bytes()
    code, err = cli(["pack", path, tmp_path / "out.parquet", "--window", "16"])
    print(err)
    assert code == 3 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "dataset row 0 (line 1 of" in err and PADDED.format("3 zeros") in err
    assert not (tmp_path / "out.parquet").exists() and path.read_bytes() == before


def test_pack_dataset_refuses_a_padded_dataset(tokenizer):
    """``pack_dataset`` of a ``datasets.Dataset`` mapped with ``padding=True`` names the first padded row, also
    when the attention mask is not among the packed columns and when some rows lack it (null)."""
    tokenizer.padding_side = "left"
    ds = datasets.Dataset.from_dict({"text": TEXTS}).map(lambda b: tokenizer(b["text"], padding=True), batched=True)
    with pytest.raises(ExampleValueError, match=r"^dataset row 0 has an attention_mask with 3 zeros \(padding"):
        pack_dataset(ds.remove_columns("text"), window=16)
    with pytest.raises(ExampleValueError, match=r"^dataset row 1 has an attention_mask with 4 zeros"):
        pack_dataset(ds.select([2, 1, 0]).remove_columns("text"), window=16, columns=["input_ids"])
    some = datasets.Dataset.from_list([{"input_ids": [5, 6], "attention_mask": None},
                                       {"input_ids": [0, 5], "attention_mask": [0, 1]}])
    with pytest.raises(ExampleValueError, match=r"^dataset row 1 has an attention_mask with 1 zero "):
        pack_dataset(some, window=16)


def test_pack_stream_refuses_a_padded_example(tokenizer):
    """``pack_stream`` (and so ``PackedIterable``) names the padded example, whichever columns it reads."""
    tokenizer.padding_side = "right"
    examples = [{"input_ids": [5, 6, 7]}] + rows(tokenizer(TEXTS, padding=True))
    with pytest.raises(ExampleValueError, match=r"^example 1 has an attention_mask with 3 zeros \(padding"):
        list(pack_stream(iter(examples), window=16))
    with pytest.raises(ExampleValueError, match=r"^example 1 has an attention_mask with 3 zeros"):
        list(pack_stream(iter(examples), window=16, columns=["input_ids"]))


def test_an_all_ones_attention_mask_packs_unchanged(tmp_path, tokenizer):
    """What a tokenizer without padding gives (``attention_mask`` all ones, also as bools or on some rows only) is
    ignored as before: every surface packs the same as the same examples without it."""
    plain = rows(tokenizer(TEXTS))
    assert all(set(ex["attention_mask"]) == {1} for ex in plain)
    bare = [{"input_ids": ex["input_ids"]} for ex in plain]
    mixed = [plain[0], bare[1], {"input_ids": plain[2]["input_ids"], "attention_mask": [True] * 6}]
    for make in COLLATORS.values():
        want = make()(bare)
        for examples in (plain, mixed):
            got = make()(examples)
            for field in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
    ds = datasets.Dataset.from_list(plain)
    for name, make in COLLATORS.items():
        got = make()(ColumnarDataset(ds)[[0, 1, 2]])
        assert torch.equal(got.labels, make()(bare).labels), name
    def stream(examples):
        return [{k: np.asarray(v).tolist() for k, v in r.items()} for r in pack_stream(iter(examples), window=16)]

    assert stream(plain) == stream(bare) and stream(mixed) == stream(bare)
    want = pack_dataset(datasets.Dataset.from_list(bare), window=16)
    got = pack_dataset(ds, window=16)
    assert got.column_names == want.column_names and got[:] == want[:]
    write_jsonl(tmp_path / "plain.jsonl", plain)
    write_jsonl(tmp_path / "bare.jsonl", bare)
    for name in ("plain", "bare"):
        code, err = cli(["pack", tmp_path / f"{name}.jsonl", tmp_path / f"{name}.parquet", "--window", "16"])
        assert code == 0, err
    got, want = pq.read_table(tmp_path / "plain.parquet"), pq.read_table(tmp_path / "bare.parquet")
    assert "attention_mask" not in got.column_names and got.equals(want)
    print("rows", got.num_rows, "tokens", int(np.sum([len(r) for r in got.column("input_ids").to_pylist()])))


@pytest.mark.parametrize("command", ["waste", "plan"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_waste_and_plan_refuse_a_padded_file(tmp_path, tokenizer, command, suffix):
    """``packkit waste`` / ``plan`` of a file of ``tokenizer(texts, padding=True)`` rows (a .jsonl read a chunk at a
    time, a .parquet read whole): one line naming the row (its line in a .jsonl) and the fix, the exit code of bad
    data, no figures. Before, the pads were measured as tokens."""
    tokenizer.padding_side = "right"
    examples = rows(tokenizer(TEXTS, padding=True))
    path = tmp_path / f"padded{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, examples)
    else:
        pq.write_table(pa.Table.from_pylist(examples), path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(err):
        code = main([command, str(path), "--window", "16"])
    err = err.getvalue()
    print(err)
    assert code == 3 and len(err.strip().splitlines()) == 1 and "Traceback" not in err and not out.getvalue()
    assert ("dataset row 0 (line 1 of" if suffix == ".jsonl" else "dataset row 0 has") in err
    assert PADDED.format("3 zeros") in err


def test_measure_waste_of_a_padded_dataset_is_refused(tmp_path, tokenizer):
    """``measure_waste(read_lengths(folder))`` of a ``datasets.Dataset`` mapped with ``padding=True`` and saved names
    the first padded row; the same rows without padding measure as the rows without a mask."""
    tokenizer.padding_side = "left"
    ds = datasets.Dataset.from_dict({"text": TEXTS}).map(lambda b: tokenizer(b["text"], padding=True), batched=True)
    ds.remove_columns("text").select([2, 1, 0]).save_to_disk(str(tmp_path / "padded"))
    with pytest.raises(ExampleValueError, match=r"^dataset row 1 has an attention_mask with 4 zeros \(padding"):
        measure_waste(read_lengths(tmp_path / "padded"), window=16)
    plain = datasets.Dataset.from_dict({"text": TEXTS}).map(lambda b: tokenizer(b["text"]), batched=True)
    plain.remove_columns("text").save_to_disk(str(tmp_path / "plain"))
    plain.remove_columns(["text", "attention_mask"]).save_to_disk(str(tmp_path / "bare"))
    got, want = (measure_waste(read_lengths(tmp_path / name), window=16) for name in ("plain", "bare"))
    assert got.input_lengths.tolist() == want.input_lengths.tolist() == [3, 2, 6]
    assert got.input_tokens == want.input_tokens and got.loss_tokens == want.loss_tokens


def test_waste_and_plan_of_an_all_ones_mask_say_the_same_figures(tmp_path, tokenizer):
    """A .jsonl whose ``attention_mask`` is all ones (no padding) gives ``packkit waste`` and ``plan`` the same output
    as the same rows without the column."""
    plain = rows(tokenizer(TEXTS))
    for name, examples in (("plain", plain), ("bare", [{"input_ids": ex["input_ids"]} for ex in plain])):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "d.jsonl", examples)
    for command in ("waste", "plan"):
        said = []
        for name in ("plain", "bare"):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([command, str(tmp_path / name / "d.jsonl"), "--window", "16", "--json"])
            assert code == 0, err.getvalue()
            said.append(out.getvalue().replace(str(tmp_path / name), "DIR"))
        assert said[0] == said[1] and said[0], command


def test_the_tree_collator_refuses_a_padded_sample(tokenizer):
    """``TreeCollator`` (packkit.prefixtree) of ``tokenizer(texts, padding=True)`` samples, as padded rollouts come:
    refused naming the example, by the same rule; all ones builds the same tree as no mask. Before, the pads were
    tokens of the tree, attended to and scored."""
    from packkit.prefixtree import TreeCollator

    tokenizer.padding_side = "left"
    padded = rows(tokenizer(TEXTS, padding=True))
    with pytest.raises(ExampleValueError, match=r"^example 0 has an attention_mask with 3 zeros \(padding"):
        TreeCollator(loss_mask="none")(padded)
    plain = rows(tokenizer(TEXTS))
    got = TreeCollator(loss_mask="none")(plain)
    want = TreeCollator(loss_mask="none")([{"input_ids": ex["input_ids"]} for ex in plain])
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.position_ids, want.position_ids)


def test_packed_rows_keep_their_mask_as_another_packer_wrote_it(tmp_path, capsys):
    """Packed rows hold their documents in ``seq_lengths`` / ``position_ids``; another packer's ``attention_mask``
    (axolotl's and LLaMA-Factory's segment ids, or padding at a window's tail) is not a tokenizer's padding: the rule
    leaves it, in the collator and in ``packkit waste`` (the review found both refused)."""
    from packkit.cli import main
    from packkit.collate import PackedRowsCollator

    row = {"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1], "attention_mask": [1, 1, 1, 2, 2],
           "labels": [5, 6, 7, 8, 9]}
    batch = PackedRowsCollator(window=8)([row])
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    src = tmp_path / "packed.jsonl"
    src.write_text(json.dumps({"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2], "attention_mask": [1, 1, 1, 2, 2]})
                   + "\n")
    code = main(["waste", str(src), "-w", "8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["examples"] == 2

