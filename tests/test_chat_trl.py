"""Chat data as TRL trains it, where the data or the tokenizer is not the tidy case.

Before the fix: rows holding both ``messages`` and ``prompt``/``completion`` were read as ``messages`` by
packkit and as prompt/completion by TRL's ``SFTTrainer`` (68,944 against 30,577 tokens on 50 rows), with
nothing to choose; a bare ``tokenizer.json`` (no EOS, no BOS) tokenized prompt/completion strings without
the EOS TRL appends (the model is never trained to stop) and rendered ``{{ bos_token }}`` empty, silently;
the command line printed Python's warning format (a source path and line).
"""

from __future__ import annotations

import json
import warnings

import pyarrow as pa
import pytest

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_chat import CONVERSATIONS, TEMPLATE, make_tokenizer, our_labels, trl_labels  # noqa: E402

from packkit.chat import ChatWarning, chat_format, tokenize_chat  # noqa: E402
from packkit.cli import main  # noqa: E402
from packkit.errors import ArgumentError  # noqa: E402

PAIRS = [("what is two plus three", " five"), ("hello", "there"), ("how are", " you fine")]


def mixed_rows():
    """Rows holding both a conversation and a prompt/completion pair (a dataset that kept both views)."""
    return [{"messages": conv, "prompt": p, "completion": c} for conv, (p, c) in zip(CONVERSATIONS, PAIRS)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny-chat"
    make_tokenizer(bos=True).save_pretrained(str(path))
    return path


@pytest.mark.slow  # builds a real SFTTrainer (TRL's dataset preparation)
def test_mixed_rows_follow_trls_precedence_and_format_chooses(tok_dir):
    """TRL's SFTTrainer tokenizes a row with ``prompt`` as prompt/completion (``"prompt" in example``
    decides first): the same tokens and labels as its preparation of those pairs, a warning naming the
    column left unread, and ``format="messages"`` reading the conversations instead."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    mixed = pa.Table.from_pylist(mixed_rows())
    assert chat_format(mixed.schema) == "prompt_completion"
    with pytest.warns(ChatWarning, match=r"the rows hold 'messages' too: read as prompt_completion.*format='messages'"):
        got = our_labels(tokenize_chat(mixed, tok))
    pairs = datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS])
    assert got == trl_labels(pairs, tok)
    with pytest.warns(ChatWarning, match="'prompt', 'completion' too: read as messages"):
        as_messages = tokenize_chat(mixed, tok, format="messages")
    only = tokenize_chat(pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS]), tok)
    assert as_messages.equals(only)
    with pytest.raises(ArgumentError, match="format='conversations' needs the column"):
        tokenize_chat(mixed, tok, format="conversations")


def test_an_iterable_dataset_of_mixed_rows_names_the_column_left_unread(tok_dir):
    """Regression: ``tokenize_dataset`` on an ``IterableDataset`` built its encoder past :func:`chat_encoder`, so
    mixed rows were read as prompt/completion with no warning (a ``Dataset`` said it); both go through it now."""
    from packkit.chat import tokenize_dataset

    lazy = datasets.Dataset.from_list(mixed_rows()).to_iterable_dataset()
    with pytest.warns(ChatWarning, match=r"the rows hold 'messages' too: read as prompt_completion"):
        out = list(tokenize_dataset(lazy, str(tok_dir)))
    with pytest.warns(ChatWarning, match=r"the rows hold 'messages' too"):
        whole = tokenize_chat(pa.Table.from_pylist(mixed_rows()), str(tok_dir))
    assert [row["input_ids"] for row in out] == whole.column("input_ids").to_pylist()


def test_a_tokenizer_without_eos_or_bos_is_refused_in_one_line(tok_dir, tmp_path):
    """A bare tokenizer.json defines no special tokens: prompt/completion strings would get no EOS (TRL
    appends it), a template writing ``{{ bos_token }}`` would render it empty. The folder works."""
    pairs = pa.Table.from_pylist([{"prompt": p, "completion": c} for p, c in PAIRS])
    bare = tok_dir / "tokenizer.json"
    with pytest.raises(ArgumentError, match=r"defines no EOS token \(a bare tokenizer.json\?\).*tokenizer's folder"):
        tokenize_chat(pairs, str(bare))
    eos = transformers.AutoTokenizer.from_pretrained(str(tok_dir)).eos_token_id
    ids = tokenize_chat(pairs, str(tok_dir)).column("input_ids").to_pylist()
    assert all(row[-1] == eos for row in ids)
    convs = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS])
    with pytest.raises(ArgumentError, match="defines no BOS, and its chat template writes it"):
        tokenize_chat(convs, str(bare), chat_template="{{ bos_token }}" + TEMPLATE)
    assert tokenize_chat(convs, str(bare), chat_template=TEMPLATE).num_rows == len(CONVERSATIONS)


def test_cli_warns_in_one_line_and_names_what_it_did(tok_dir, tmp_path, capsys):
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in mixed_rows()))
    assert main(["waste", str(src), "--tokenizer", str(tok_dir), "-q"]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0] == ("packkit waste: warning: the rows hold 'messages' too: read as prompt_completion, as TRL's "
                        "SFTTrainer reads them; --format messages reads the other"), err
    assert all(line.startswith("packkit waste: warning: ") for line in lines) and ".py:" not in err, err
    assert "prompt/completion strings with tiny-chat (no chat template; EOS appended to each completion)" in out
    assert main(["waste", str(src), "--tokenizer", str(tok_dir), "-q", "--format", "messages"]) == 0
    out, err = capsys.readouterr()
    assert "messages through the chat template of tiny-chat" in out
    shown = warnings.showwarning
    assert main(["waste", str(src), "--tokenizer", str(tok_dir / "tokenizer.json"), "-q"]) == 2
    assert "defines no EOS token" in capsys.readouterr().err
    assert warnings.showwarning is shown  # the command leaves Python's warning machinery as it found it


@pytest.mark.parametrize("out_name", ["tok.parquet", "tok.jsonl"])
def test_tokenize_once_then_waste_plan_pack_read_it(tok_dir, tmp_path, capsys, out_name):
    """``packkit tokenize IN OUT`` writes input_ids and TRL's loss mask; waste, plan and pack then report
    on OUT exactly what they report on IN with the tokenizer (examples, tokens, loss tokens), without it."""
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 5))
    out = tmp_path / out_name
    assert main(["tokenize", str(src), str(out), "--tokenizer", str(tok_dir), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["columns"] == ["input_ids", "assistant_masks"] and made["examples"] == 5 * len(CONVERSATIONS)

    def report(*argv):
        assert main(list(argv)) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    for cmd in (["waste", "-q"], ["plan"]):
        direct = report(cmd[0], str(src), "--tokenizer", str(tok_dir), "-w", "16", "--json", *cmd[1:])
        again = report(cmd[0], str(out), "-w", "16", "--json", *cmd[1:])
        keys = ("examples", "input_tokens", "loss_tokens") if cmd[0] == "waste" else (
            "num_examples", "num_tokens", "loss_tokens", "steps_per_epoch")
        assert {k: direct[k] for k in keys} == {k: again[k] for k in keys}
    a = report("pack", str(src), str(tmp_path / "a.parquet"), "--tokenizer", str(tok_dir), "-w", "16", "--json")
    b = report("pack", str(out), str(tmp_path / "b.parquet"), "-w", "16", "--json")
    assert (a["loss_tokens"], a["rows"], a["tokens"]) == (b["loss_tokens"], b["rows"], b["tokens"])
    assert main(["tokenize", str(out), str(tmp_path / "again.parquet"), "--tokenizer", str(tok_dir)]) == 3
    assert "holds token ids already" in capsys.readouterr().err


@pytest.mark.slow  # processes
def test_num_proc_gives_the_same_table(tok_dir, monkeypatch):
    """``tokenize_chat(num_proc=2)`` cuts the rows into two parts, one process each, and joins them in
    order: the same table as one process, the example numbers in errors and warnings those of the whole (the
    tokenizer's pool off: with it, 2 processes on 2 cores are 1, test_num_proc_takes_processes_only_where_they_pay)."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS * 40])
    one = tokenize_chat(table, tok, batch_size=16)
    assert tokenize_chat(table, tok, batch_size=16, num_proc=2).equals(one)
    bad = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS * 40] + [{"messages": []}])
    with pytest.raises(ValueError, match=f"example {bad.num_rows - 1} has an empty 'messages' conversation"):
        tokenize_chat(bad, tok, batch_size=16, num_proc=2)


@pytest.mark.slow  # processes
@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_forked_workers_read_the_encoder_without_a_pickle(tok_dir, monkeypatch):
    """Regression (chat tokenizing speed): each ``num_proc`` worker got the encoder pickled, its tokenizer with it (0.43 s to
    pickle and 1.33 s to rebuild a worker with Qwen3's tokenizer: most of what ``num_proc=2`` cost over one
    process). Forked workers read the parent's encoder and table: the encoder cannot be pickled here, and the table
    is the one process's."""
    from packkit import chat, workers

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # processes on any machine (worker_processes)
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS * 40])
    one = tokenize_chat(table, tok, batch_size=16)

    def refuse(self):
        raise AssertionError("the encoder was pickled for a forked worker")

    monkeypatch.setattr(chat._Encoder, "__reduce__", refuse)
    assert tokenize_chat(table, tok, batch_size=16, num_proc=2).equals(one)
    assert workers._FORKED == {}


def test_num_proc_takes_processes_only_where_they_pay(tok_dir, monkeypatch):
    """Regression (num_proc=2 slower than one process on 2 cores: bench_chat, Qwen3 / 3,000 ShareGPT conversations,
    load 5: 13.93 s wall against 9.95, 1.39x the CPU; 68e14a9 the same). One process's Rust pool already tokenizes
    on every core; forked workers have one thread each and cost ~1.3x its CPU. So ``num_proc`` takes processes only
    where they beat that pool (``worker_processes``): on 2 cores, one process; with the pool off, two, also where
    the C environment alone turns it off (datasets' map(num_proc) leaves it so: os.environ would say it is on)."""
    from packkit import chat

    w = chat.worker_processes
    assert (w(2, 2, True), w(2, 2, False), w(8, 16, True), w(1, 64, True), w(3, 1, True)) == (1, 2, 8, 1, 1)
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS * 40])
    one = tokenize_chat(table, tok, batch_size=16)
    asked, real = [], chat.encode_rows  # the processes each call asks of the engine
    monkeypatch.setattr(chat, "encode_rows", lambda *a, **k: asked.append(a[4]) or real(*a, **k))
    monkeypatch.setattr(chat.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    assert tokenize_chat(table, tok, batch_size=16, num_proc=2).equals(one) and asked == [1]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert tokenize_chat(table, tok, batch_size=16, num_proc=2).equals(one) and asked == [1, 2]
    os_env = __import__("os")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    try:  # datasets' map(num_proc) sets it in the C environment alone (Python keeps a copy of os.environ without it)
        os_env.putenv("TOKENIZERS_PARALLELISM", "false")
        assert "TOKENIZERS_PARALLELISM" not in os_env.environ and w(2, 2) == 2
    finally:
        os_env.unsetenv("TOKENIZERS_PARALLELISM")
    assert w(2, 2) == 1


def test_a_pool_turned_off_behind_pythons_back_is_said(tok_dir, monkeypatch):
    """``datasets``' ``map(num_proc)`` leaves ``TOKENIZERS_PARALLELISM=false`` in the C environment alone (os.environ
    says nothing), so one process tokenizes on one thread of many cores. Regression: said nowhere (the silence rule).
    Set in os.environ (the user's own choice), or with ``num_proc`` processes taken, nothing is said."""
    import os

    from packkit import chat

    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS])
    monkeypatch.setattr(chat.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    try:
        os.putenv("TOKENIZERS_PARALLELISM", "false")
        with pytest.warns(chat.ChatWarning, match=r"TOKENIZERS_PARALLELISM='false' in the C environment, not in "
                                                  r"os.environ .* runs on 1 of 2 cores; set os.environ"):
            tokenize_chat(table, tok)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert chat.worker_processes(2) == 2
    finally:
        os.unsetenv("TOKENIZERS_PARALLELISM")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    with warnings.catch_warnings(record=True) as also:
        warnings.simplefilter("always")
        tokenize_chat(table, tok)
    assert not [w for w in caught + also if "TOKENIZERS_PARALLELISM" in str(w.message)]


def test_text_tokenized_without_the_eos_trl_appends_is_said(tok_dir, tmp_path, capsys):
    """A ``text`` column tokenized by ``packkit tokenize`` gets no EOS, where TRL's SFTTrainer appends the tokenizer's
    EOS to every text (its ``add_eos``): the documents trained without it never teach the model to stop, and the
    summary said only "column 'text' tokenized with tiny-chat". It now says that no EOS was appended; the byte-level
    measure of ``waste`` (no vocabulary, no EOS) says nothing of it."""
    src, out = tmp_path / "text.jsonl", tmp_path / "tok.parquet"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in PAIRS))
    assert main(["tokenize", str(src), str(out), "--tokenizer", str(tok_dir)]) == 0
    said = capsys.readouterr().out
    assert "column 'text' tokenized with tiny-chat, no EOS appended (TRL's SFTTrainer appends one to each text)" in said
    eos = transformers.AutoTokenizer.from_pretrained(str(tok_dir)).eos_token_id
    rows = pytest.importorskip("pyarrow.parquet").read_table(out)["input_ids"].to_pylist()
    assert len(rows) == len(PAIRS) and all(row[-1] != eos for row in rows)
    assert main(["waste", str(src), "-w", "16"]) == 0
    assert "column 'text' tokenized with bytes\n" in capsys.readouterr().out
