"""Every loss token accounted for, one number: ``packkit waste``, ``plan`` and ``pack`` report the same
loss-token count for the same file and options, equal to a count made here token by token and to the
labels ``pack`` writes; the pieces, windows and steps with no loss token are reported, and
``--drop-loss-free`` leaves the pieces out, counted the same way in all three.

Before the fix the three disagreed on one file (``waste`` 3,502,557 before the overflow policy, ``pack``
3,501,680 and printed nothing, ``plan`` about 3,501,670 from a model of where the loss sits), and 77 of
2,213 windows after ``pack -w 2048`` trained on no token without a word.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from packkit.cli import main
from packkit.segments import IGNORE_INDEX

W = 16


def make_examples(seed: int = 0, *, labels: bool = True):
    """Examples of 1..3W tokens with random prompt masks, one fully masked, one whose second piece
    holds no loss token (its loss sits in the first W tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(80):
        n = int(rng.integers(1, 3 * W))
        ids = rng.integers(0, 300, n).tolist()
        lab = [t if rng.random() < 0.6 else IGNORE_INDEX for t in ids]
        out.append({"input_ids": ids, "labels": lab} if labels else {"input_ids": ids})
    if labels:
        out.append({"input_ids": [5] * 10, "labels": [IGNORE_INDEX] * 10})
        out.append({"input_ids": list(range(2 * W)), "labels": list(range(W)) + [IGNORE_INDEX] * W})
    return out


def reference(examples, window: int, overflow: str):
    """``(loss tokens, loss-free pieces)`` once packed, token by token: each example cut by the policy,
    each piece's labels (its token ids without labels) counted past the piece's first token."""
    loss = free = 0
    for ex in examples:
        lab = ex.get("labels", ex["input_ids"])
        if overflow == "truncate":
            pieces = [lab[:window]]
        else:
            pieces = [lab[lo: lo + window] for lo in range(0, len(lab), window)]
        for p in pieces:
            n = sum(1 for x in p[1:] if x != IGNORE_INDEX)
            loss += n
            free += n == 0
    return loss, free


def written(path):
    """``(loss tokens, windows without one, segments without one)`` of a packed file's own labels."""
    rows = pq.read_table(path).to_pylist()
    loss = free_windows = free_segments = 0
    for r in rows:
        lab = r.get("labels") or r["input_ids"]
        n_row, pos = 0, 0
        for n in r["seq_lengths"]:
            seg = lab[pos: pos + n]
            c = sum(1 for x in seg[1:] if x != IGNORE_INDEX) + (0 if "labels" not in r or seg[0] == IGNORE_INDEX else 1)
            free_segments += c == 0
            n_row += c
            pos += n
        loss += n_row
        free_windows += n_row == 0
    return loss, free_windows, free_segments


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("loss")
    out = {}
    for name, labels in (("labels", True), ("nolabels", False)):
        ex = make_examples(labels=labels)
        p = d / f"{name}.jsonl"
        p.write_text("".join(json.dumps(e) + "\n" for e in ex))
        out[name] = (p, ex)
    return d, out


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["labels", "nolabels"])
@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_one_loss_count_across_commands(files, kind, overflow, capsys):
    d, data = files
    src, examples = data[kind]
    want, want_free = reference(examples, W, overflow)
    common = ["-w", str(W), "--overflow", overflow, "--json"]
    waste = run_json(capsys, "waste", str(src), *common, "-q")
    plan = run_json(capsys, "plan", str(src), *common)
    out = d / f"{kind}-{overflow}.parquet"
    pack = run_json(capsys, "pack", str(src), str(out), *common, "--overwrite")
    print(kind, overflow, want, waste["loss_tokens"], plan["loss_tokens"], pack["loss_tokens"])
    assert waste["loss_tokens"] == plan["loss_tokens"] == pack["loss_tokens"] == want
    got, free_windows, _ = written(out)
    assert got == want
    assert pack["loss_free_windows"] == free_windows
    assert waste["loss_tokens_assumed"] == plan["loss_tokens_assumed"] == pack["loss_tokens_assumed"] == (
        kind == "nolabels")
    if kind == "labels":
        assert waste["loss_free_pieces"] == want_free > 0
    # the lengths before the policy and of the pieces, both there
    assert waste["longest_example"] == plan["longest_example"] == max(len(e["input_ids"]) for e in examples)
    assert waste["longest_piece"] == W


def test_drop_loss_free_pieces_counted_alike(files, capsys):
    d, data = files
    src, examples = data["labels"]
    want, want_free = reference(examples, W, "split")
    common = ["-w", str(W), "--json", "--drop-loss-free"]
    waste = run_json(capsys, "waste", str(src), *common, "-q")
    plan = run_json(capsys, "plan", str(src), *common)
    out = d / "dropped.parquet"
    pack = run_json(capsys, "pack", str(src), str(out), *common, "--overwrite")
    assert waste["dropped_pieces"] == plan["dropped_pieces"] == pack["dropped_pieces"] == want_free
    assert waste["dropped_tokens"] == plan["dropped_tokens"] == pack["dropped_tokens"] > 0
    assert waste["loss_tokens"] == plan["loss_tokens"] == pack["loss_tokens"] == want  # nothing that trains lost
    got, free_windows, free_segments = written(out)
    assert (got, free_windows, free_segments) == (want, 0, 0)
    assert plan["steps_per_epoch"] == pack["rows"]  # the same plan, the same segments left out


def test_loss_free_windows_are_named_with_the_fix(files, capsys):
    _, data = files
    src, _ = data["labels"]
    assert main(["waste", str(src), "-w", str(W), "-q"]) == 0
    text = capsys.readouterr().out
    assert "pieces hold no loss token (they train on nothing); pass --drop-loss-free" in text
    assert "(examples as given)" in text and "pieces after --overflow split:" in text


def test_one_overflow_default_in_python_and_on_the_command_line(caplog):
    """Before the fix pack_dataset defaulted to overflow='error' and every command to 'split', so the
    README's snippets raised on real data (after every row was tokenized). One default now, and a line
    says what it did."""
    import inspect
    import logging

    import datasets

    from packkit import binpack, budget, offline, packer, raydata, waste
    from packkit.cli import pack as cli_pack, plan as cli_plan, waste as cli_waste

    assert binpack.DEFAULT_OVERFLOW == "split"
    for fn in (offline.pack_dataset, offline.plan_source, raydata.pack_dataset, packer.pack_stream,
               budget.plan_budget, waste.measure_waste):
        assert inspect.signature(fn).parameters["overflow"].default == binpack.DEFAULT_OVERFLOW, fn.__qualname__
    for mod in (cli_pack, cli_plan, cli_waste):
        assert mod.parser().get_default("overflow") == binpack.DEFAULT_OVERFLOW
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6], [7]]})
    with caplog.at_level(logging.WARNING, logger="packkit"):
        out = offline.pack_dataset(ds, window=4, shuffle=False)
    assert sorted(sum(out["input_ids"], [])) == list(range(1, 8))  # every token kept
    assert "split 1 of 2 examples longer than window=4" in caplog.text


def test_plan_warns_about_an_example_far_beyond_the_window(tmp_path, capsys):
    """Before the fix ``plan --padded`` gave no advice for a 235,001-token example, and no command showed
    the real longest example. Now: a row with it, and advice packed and padded."""
    lengths = np.random.default_rng(0).integers(50, 800, 500)
    lengths[5] = 235_001
    np.save(tmp_path / "l.npy", lengths)
    assert main(["plan", str(tmp_path / "l.npy")]) == 0
    out = capsys.readouterr().out
    assert "longest example       235,001 tokens (as given" in out
    assert "[far_beyond_window] the longest example has 235,001 tokens, 115 times the window of 2,048" in out
    assert main(["plan", str(tmp_path / "l.npy"), "--padded"]) == 0
    assert "[far_beyond_batch] the longest example has 235,001 tokens" in capsys.readouterr().out


def test_what_trains_on_nothing_is_said_in_one_wording_everywhere(files, tmp_path, capsys, caplog):
    """One wording a fact (``packkit.epoch.trains_on_nothing``), with the numbers of the JSON: the windows with no
    loss token in ``pack``'s and ``waste``'s lines, ``plan``'s advice and ``pack_dataset``'s log; the pieces
    ``--drop-loss-free`` left out in ``waste``'s and ``pack``'s lines, ``plan``'s row and the log. Before, five places
    said them in four wordings, and ``pack_dataset(output=...)`` (the way ``packkit pack`` packs media) said nothing
    of the windows with no loss token."""
    import logging

    import datasets

    from packkit.offline import pack_dataset

    src, examples = files[1]["labels"]
    windows = ("windows hold no loss token (they train on nothing; a step of them has loss 0); pass --drop-loss-free, "
               "or raise --window")
    common = ["-w", str(W), "-q"]
    pack = run_json(capsys, "pack", str(src), str(tmp_path / "a.parquet"), *common, "--json")
    n, rows = pack["loss_free_windows"], pack["rows"]
    assert n > 0
    assert main(["pack", str(src), str(tmp_path / "b.parquet"), *common]) == 0
    assert f"\n{n} of {rows} {windows}\n" in capsys.readouterr().out
    assert main(["waste", str(src), *common]) == 0
    assert f"\npacked: best fit decreasing: {n} of {rows} windows and " in capsys.readouterr().out
    assert main(["plan", str(src), *common]) == 0
    out = capsys.readouterr().out
    assert f"[loss_free] {n} of {rows} windows and " in out and f" steps hold no loss token (they train on " in out
    ds = datasets.Dataset.from_list(examples)
    with caplog.at_level(logging.WARNING, logger="packkit"):
        pack_dataset(ds, window=W, output=tmp_path / "c.parquet", progress=False)
    assert f"pack_dataset: {n} of {rows} {windows}".replace("--drop-loss-free", "drop_loss_free=True").replace(
        "--window", "window") in caplog.text
    caplog.clear()
    dropped = run_json(capsys, "pack", str(src), str(tmp_path / "d.parquet"), *common, "--json", "--drop-loss-free")
    left_out = f"--drop-loss-free left out {dropped['dropped_pieces']} pieces with no loss token " \
               f"({dropped['dropped_tokens']} tokens)"
    for argv in (["pack", str(src), str(tmp_path / "e.parquet")], ["waste", str(src)], ["plan", str(src)]):
        assert main([*argv, *common, "--drop-loss-free"]) == 0
        assert left_out in capsys.readouterr().out, argv
    with caplog.at_level(logging.WARNING, logger="packkit"):
        pack_dataset(ds, window=W, output=tmp_path / "f.parquet", progress=False, drop_loss_free=True)
    assert "pack_dataset: " + left_out.replace("--drop-loss-free", "drop_loss_free=True") in caplog.text
