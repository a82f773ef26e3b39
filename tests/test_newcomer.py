"""A newcomer's first day: each friction met on the way from raw chat rows to a trained model,
reproduced as a new user meets it (the command line, real files, TRL's own templates and trainer).

Before the fixes: a bare ``tokenizer.json`` of a large vocabulary failed under ``HF_HUB_OFFLINE=1`` with
"Repo id must be in the form ..."; ``--chat-template`` on prompt/completion strings and
``--no-completion-only-loss`` on messages were ignored in silence; TRL's stock ``qwen3.jinja`` passed with
``--chat-template`` was refused (TRL swaps in its training version), naming the tokenizer folder; with
``--format messages`` the warning said TRL reads such rows as messages (it reads them as prompt/completion).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pyarrow as pa
import pytest

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_chat import (CONVERSATIONS, TEMPLATE, VOCAB, make_tokenizer, our_labels, tok_dir,  # noqa: E402,F401
                       trl_labels)

from packkit.chat import ChatWarning, tokenize_chat  # noqa: E402
from packkit.cli import main  # noqa: E402
from packkit.errors import ArgumentError  # noqa: E402


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli(argv, capsys):
    """``(exit code, stdout, stderr)`` of ``packkit ARGV``."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def chat_jsonl(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])


@pytest.fixture
def pairs_jsonl(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "hello there", "completion": " hi friend"},
                                                  {"prompt": "how are you", "completion": " fine thanks"}])


# -- 1. a bare tokenizer.json of a large vocabulary, offline ---------------------------------------------------


def test_bare_tokenizer_json_of_a_large_vocabulary_reads_offline(tmp_path, chat_jsonl, capsys, monkeypatch):
    """Friction 1: transformers takes the name of a tokenizer of more than 100,000 tokens for a Hub id (its
    Mistral regex check); packkit named the tokenizer by its file, so under HF_HUB_OFFLINE=1 a bare
    tokenizer.json of Llama-3's or Qwen3's size failed with "Repo id must be in the form ..."."""
    from huggingface_hub import constants
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = dict(VOCAB, **{f"w{i}": len(VOCAB) + i for i in range(100_001)})  # past transformers' 100,000
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bare = tmp_path / "big" / "tokenizer.json"
    bare.parent.mkdir()
    tk.save(str(bare))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, out, err = cli(["waste", chat_jsonl, "--tokenizer", bare, "--chat-template", write_template(tmp_path),
                          "--json", "-q"], capsys)
    assert code == 0, err
    assert "Repo id" not in err
    assert json.loads(out)["input_tokens"] == 8 + 13 + 16  # the hand count of test_chat


def write_template(tmp_path: Path, text: str = TEMPLATE, name: str = "chat.jinja") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- 2. options that do not apply are refused, not ignored ------------------------------------------------------


def test_chat_template_on_prompt_completion_strings_is_refused(tok_dir, pairs_jsonl, capsys):
    """Friction 2: TRL tokenizes prompt/completion strings with no template; ``--chat-template`` (even a missing
    file) was ignored with exit 0, while ``--assistant-only-loss`` on the same rows is an error."""
    code, _, err = cli(["waste", pairs_jsonl, "--tokenizer", tok_dir, "--chat-template", "missing.jinja"], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and "--chat-template is not used on prompt/completion strings" in err
    code, _, err = cli(["waste", pairs_jsonl, "--tokenizer", tok_dir, "--assistant-only-loss"], capsys)
    assert code == 2 and "--assistant-only-loss needs conversational data" in err


@pytest.mark.parametrize("flag", ["--no-completion-only-loss", "--completion-only-loss"])
def test_completion_only_loss_on_messages_is_refused(tok_dir, chat_jsonl, capsys, flag):
    """Friction 2: ``--no-completion-only-loss`` on messages was accepted and changed nothing (the loss stayed on
    the assistant tokens); the error names the option that does what was meant."""
    code, _, err = cli(["waste", chat_jsonl, "--tokenizer", tok_dir, flag], capsys)
    assert code == 2, err
    assert f"{flag} applies to prompt/completion data; messages rows have no completion" in err
    assert "pass --no-assistant-only-loss for the loss on every token" in err
    assert cli(["waste", chat_jsonl, "--tokenizer", tok_dir, "-q"], capsys)[0] == 0  # the default still runs
    with pytest.raises(ArgumentError, match="completion_only_loss=False applies to prompt/completion data"):
        tokenize_chat(pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS]), str(tok_dir),
                      completion_only_loss=False)


# -- 3. a stock template passed with --chat-template --------------------------------------------------------------


def trl_template(name: str) -> Path:
    """A template TRL ships (``trl/chat_templates/``)."""
    trl = pytest.importorskip("trl")
    path = Path(trl.__file__).parent / "chat_templates" / name
    if not path.is_file():
        pytest.skip(f"this TRL ships no {name}")
    return path


@pytest.fixture(scope="module")
def qwenish_dir(tmp_path_factory):
    """A word-level tokenizer that knows Qwen's special tokens, with no chat template of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = dict(VOCAB, **{"<|im_start|>": len(VOCAB), "<|im_end|>": len(VOCAB) + 1})
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                               unk_token="<unk>", additional_special_tokens=["<|im_start|>",
                                                                                             "<|im_end|>"])
    path = tmp_path_factory.mktemp("tok") / "qwenish"
    tok.save_pretrained(str(path))
    return path


def test_stock_template_given_is_swapped_for_trls_training_version(qwenish_dir, chat_jsonl, capsys):
    """Friction 3: TRL's ``SFTTrainer(chat_template_path="qwen3.jinja", assistant_only_loss=True)`` swaps in
    ``qwen3_training.jinja``; packkit refused the same file ("no {% generation %} markers"), naming the tokenizer
    folder. Now it swaps too, and the summary names the file and the swap."""
    stock = trl_template("qwen3.jinja")
    code, out, err = cli(["waste", chat_jsonl, "--tokenizer", qwenish_dir, "--chat-template", stock, "-q"], capsys)
    assert code == 0, err
    assert "messages through TRL's training version of the chat template 'qwen3.jinja' (tokenizer qwenish)" in out


@pytest.mark.slow
def test_stock_template_given_trains_on_trls_loss_tokens(qwenish_dir):
    """Friction 3, through TRL itself: the tokens and labels of SFTTrainer's own preparation with the same file."""
    stock = trl_template("qwen3.jinja")
    tok = transformers.AutoTokenizer.from_pretrained(str(qwenish_dir))
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChatWarning)
        got = our_labels(tokenize_chat(ds, tok, chat_template=str(stock)))
    want = trl_labels(ds, tok, assistant_only_loss=True, chat_template_path=str(stock))
    assert got == want
    assert all(any(x != -100 for x in labels) for labels in got[1])


def test_a_template_without_markers_is_named_by_its_file(tok_dir, chat_jsonl, tmp_path, capsys):
    """Friction 3: the error named the tokenizer folder, not the template file that was passed."""
    plain = write_template(tmp_path, TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                           "plain.jinja")
    code, _, err = cli(["waste", chat_jsonl, "--tokenizer", tok_dir, "--chat-template", plain], capsys)
    assert code == 2, err
    assert f"the chat template {str(plain)!r} has no {{% generation %}} markers" in err
    assert "tiny-chat" not in err


# -- 4. --format messages on rows TRL reads as prompt/completion ---------------------------------------------------


def test_format_messages_warning_says_what_trl_reads(tok_dir, tmp_path, capsys):
    """Friction 4: with ``--format messages`` on rows holding prompt/completion too, the warning said they were
    "read as messages, as TRL's SFTTrainer reads them"; TRL 1.16 reads them as prompt/completion
    (``if "prompt" in example`` first, trl/trainer/sft_trainer.py)."""
    rows = [{"messages": c, "prompt": "hello", "completion": " there"} for c in CONVERSATIONS]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    code, _, err = cli(["waste", src, "--tokenizer", tok_dir, "--format", "messages", "-q"], capsys)
    assert code == 0, err
    assert ("read as messages, as asked; TRL's SFTTrainer reads such rows as prompt_completion, so its loss "
            "differs") in err
    assert "as TRL's SFTTrainer reads them" not in err
    code, _, err = cli(["waste", src, "--tokenizer", tok_dir, "-q"], capsys)
    assert "read as prompt_completion, as TRL's SFTTrainer reads them" in err


# -- 11. the prefix warning on plain strings ------------------------------------------------------------------------


def test_prefix_warning_on_strings_does_not_blame_a_template(tok_dir):
    """Friction 11: prompt/completion strings are tokenized with no template, yet the warning blamed "the
    template" and gave no fix."""
    pairs = pa.Table.from_pylist([{"prompt": "hello", "completion": "there"}])  # one word: "hellothere"
    with pytest.warns(ChatWarning) as caught:
        tokenize_chat(pairs, str(tok_dir))
    text = str(caught[0].message)
    assert "template" not in text
    assert "start each completion with a space, or end each prompt with a newline" in text


# -- 9 and 11. the README's install lines, the Makefile and the extras ---------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def makefile_value(name: str) -> str:
    """A ``NAME ?= value`` or ``NAME := value`` line of the Makefile."""
    import re

    m = re.search(rf"^{name}\s*[?:]?=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, name
    return m.group(1).strip()


def test_readme_names_every_extra_and_make_waste_can_tokenize_chat():
    """Friction 9: the README's list of extras omitted ``chat``, the extra the exit-4 error asks for on chat data,
    and the venv ``make waste`` creates (and the README's line without make) could not tokenize chat data."""
    import re
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from packkit.cli import _extra_for

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"Extras: (.*?)\.\s", readme, re.S).group(1)
    assert sorted(set(re.findall(r"`(\w+)`", listed))) == sorted(extras)
    asked = _extra_for("transformers")  # what `packkit waste chat.jsonl --tokenizer T` asks for without it
    assert asked == "chat"
    setup = re.search(r"^setup:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    made = set(re.search(r"-e '\.\[([\w,]+)\]'", setup).group(1).split(","))
    assert asked in made
    by_hand = re.search(r"pip install -e '\.\[([\w,]+)\]' && \.venv/bin/packkit waste", readme).group(1)
    assert set(by_hand.split(",")) == made


def test_readme_test_command_without_make_is_make_test():
    """Friction 11: the README's test command without make ran xdist without ``--no-loadscope-reorder``, so
    the files ran in another order than ``make test`` runs them."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "-e '.[test]'" in x and "pytest" in x)
    assert line.endswith("pytest -q " + makefile_value("XDIST")), line


# -- 11. the small ones: plan -q, one JSON key a count, --tokenizer not used, help, the ColumnarDataset error -------


def ids_rows(n: int = 30, seed: int = 0) -> list:
    """Token ids with labels; every fifth example has no loss token, the others a masked prompt half."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = rng.integers(5, 90, int(rng.integers(3, 40))).tolist()
        half = len(ids) // 2
        rows.append({"input_ids": ids, "labels": [-100] * len(ids) if i % 5 == 0 else [-100] * half + ids[half:]})
    return rows


@pytest.fixture
def ids_jsonl(tmp_path):
    return write_jsonl(tmp_path / "ids.jsonl", ids_rows())


def test_loss_free_counts_have_one_key_in_every_command(ids_jsonl, tmp_path, capsys):
    """Friction 11: the loss-free counts were ``loss_free_pieces`` in waste, ``loss_free_windows`` in pack and
    ``loss_free_units`` in plan; now every command's JSON has ``loss_free_pieces``, and plan's windows go by
    pack's key. The values agree on the same file and options."""
    common = ["-w", "32", "--json", "-q"]
    waste = json.loads(cli(["waste", ids_jsonl, *common], capsys)[1])
    plan = json.loads(cli(["plan", ids_jsonl, *common], capsys)[1])
    pack = json.loads(cli(["pack", ids_jsonl, tmp_path / "out.jsonl", *common], capsys)[1])
    assert waste["loss_free_pieces"] == plan["loss_free_pieces"] == pack["loss_free_pieces"] > 0
    assert plan["loss_free_windows"] == pack["loss_free_windows"] == plan["loss_free_units"] > 0
    dropped = json.loads(cli(["pack", ids_jsonl, tmp_path / "dropped.jsonl", *common, "--drop-loss-free"],
                             capsys)[1])
    assert dropped["loss_free_pieces"] == dropped["dropped_pieces"] == pack["loss_free_pieces"]


def test_plan_has_quiet(ids_jsonl, capsys):
    """Friction 11: ``packkit plan -q`` was a usage error; waste, pack and tokenize all have it."""
    code, out, err = cli(["plan", ids_jsonl, "-q"], capsys)
    assert code == 0, err


def test_tokenizer_on_token_ids_is_said_not_ignored(ids_jsonl, tok_dir, tmp_path, capsys):
    """Friction 11: ``--tokenizer`` on data that holds token ids already was ignored in silence."""
    for argv in (["waste", ids_jsonl], ["plan", ids_jsonl], ["pack", ids_jsonl, tmp_path / "o.parquet"]):
        code, _, err = cli([*argv, "--tokenizer", tok_dir, "-q"], capsys)
        assert code == 0, err
        assert f"warning: {str(ids_jsonl)!r} holds token ids already: --tokenizer is not used" in err, argv
        code, _, err = cli([*argv, "-q", "--overwrite"] if argv[0] == "pack" else [*argv, "-q"], capsys)
        assert "warning" not in err


def test_top_level_help_is_aligned(capsys):
    """Friction 11: ``tokenize`` is 8 characters; the command column was 7 wide, so its line was off by one."""
    code, out, _ = cli(["--help"], capsys)
    lines = [x for x in out.splitlines() if x.startswith("  ") and x.split()[0] in ("waste", "pack", "plan",
                                                                                      "tokenize")]
    assert len(lines) == 4
    assert len({x.index(x.split(None, 1)[1]) for x in lines}) == 1, out  # every help text in one column


def test_columnar_dataset_without_input_ids_names_packkit_tokenize():
    """Friction 11: "tokenize first" did not say with what."""
    from packkit.columnar import ColumnarDataset

    with pytest.raises(KeyError, match="packkit tokenize IN OUT --tokenizer T"):
        len(ColumnarDataset(pa.table({"text": ["hello there"]})))


def test_drop_loss_free_prints_the_tokens_packed(ids_jsonl, tmp_path, capsys):
    """Friction 8: after ``--drop-loss-free`` the summary printed the input's token count as the tokens packed."""
    code, out, err = cli(["pack", ids_jsonl, tmp_path / "o.jsonl", "-w", "32", "-q", "--drop-loss-free"], capsys)
    assert code == 0, err
    report = json.loads(cli(["pack", ids_jsonl, tmp_path / "o2.jsonl", "-w", "32", "--json", "--drop-loss-free"],
                            capsys)[1])
    kept, given = report["tokens"], report["input_tokens"]
    assert kept < given
    assert f"({kept:,} of {given:,} tokens) into" in out, out


# -- 10. pack_dataset and loss-free windows ---------------------------------------------------------------------


def test_pack_dataset_says_loss_free_windows_and_drops_them_when_asked(caplog):
    """Friction 10: Python's ``pack_dataset`` had no ``drop_loss_free`` (``packkit pack`` has) and said nothing
    of the windows without a loss token (TRL's SFTTrainer then drops them in silence when max_length is set)."""
    import logging

    import numpy as np

    from packkit.collate import PackedRowsCollator
    from packkit.offline import pack_dataset

    ds = datasets.Dataset.from_list(ids_rows())
    with caplog.at_level(logging.WARNING, logger="packkit"):
        rows = pack_dataset(ds, window=32, overflow="split")
    free = sum(1 for labels, seq in zip(rows["labels"], rows["seq_lengths"])
               if all(x == -100 for x in labels))
    assert free > 0
    assert f"{free} of {len(rows)} windows hold no loss token" in caplog.text
    assert "drop_loss_free=True" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="packkit"):
        kept, plan = pack_dataset(ds, window=32, overflow="split", drop_loss_free=True, return_report=True)
    assert all(any(x != -100 for x in labels) for labels in kept["labels"])
    assert "windows hold no loss token" not in caplog.text and "drop_loss_free=True left out" in caplog.text
    assert sum(map(sum, kept["seq_lengths"])) == plan.total_tokens < sum(map(sum, rows["seq_lengths"]))
    batch = PackedRowsCollator(window=32)([kept[i] for i in range(len(kept))])  # what a trainer gets
    assert int((batch["labels"] != -100).sum()) == sum(sum(x != -100 for x in labels) for labels in kept["labels"])
    assert np.all([(np.asarray(lab) != -100).any() for lab in kept["labels"]])
    with pytest.raises(ArgumentError, match=r"drop_loss_free=True reads every piece.s loss first.*an IterableDataset.*pack a datasets.Dataset"):
        pack_dataset(ds.to_iterable_dataset(), window=32, drop_loss_free=True)


# -- 6 and 7. packed rows through TRL's SFTTrainer: max_length, the rows it drops, num_tokens -------------------


def trl_run(tmp_path, rows, **config):
    """A tiny SFTTrainer over packed ``rows`` with PackedRowsCollator(window=32): the trainer, after 2 steps."""
    trl = pytest.importorskip("trl")
    from testlib import tiny_causal_lm

    from packkit.collate import PackedRowsCollator

    collator, made = PackedRowsCollator(window=32), []

    def recorded(features):  # what the trainer trains on, a micro-batch at a time
        batch = collator(features)
        made.append(batch.num_tokens)
        return batch

    tok = make_tokenizer()
    model = tiny_causal_lm(vocab_size=96, max_position_embeddings=64, pad_token_id=0)
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=2,
                         per_device_train_batch_size=2, logging_steps=1, disable_tqdm=True, bf16=False,
                         dataloader_num_workers=0, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                                 data_collator=recorded)
        trainer.train()
    trainer.trained_tokens = made
    return trainer


@pytest.fixture(scope="module")
def packed_rows():
    """Rows packed at window 32 from ids_rows(): some hold no loss token; the count packkit logs with them."""
    import logging

    from packkit.offline import pack_dataset

    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logger = logging.getLogger("packkit")
    level = logger.level  # whatever the process set, put back after
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        rows = pack_dataset(datasets.Dataset.from_list(ids_rows(60)), window=32)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    free = [int(m.split()[1]) for m in logs if "windows hold no loss token" in m]
    assert len(free) == 1 and free[0] > 0
    return rows, free[0]


@pytest.mark.slow
def test_trl_max_length_below_the_window_is_named(packed_rows, tmp_path):
    """Friction 6: TRL's max_length (1024 by default) below the packing window truncated the packed rows, and
    the collator's error said only that seq_lengths and input_ids differ; it now names max_length."""
    rows, _ = packed_rows
    with pytest.raises(ValueError, match=r"TRL's SFTConfig\(max_length=\.\.\.\) below the packing window truncates "
                                         r"packed rows: pass max_length=None"):
        trl_run(tmp_path, rows, max_length=16)


@pytest.mark.slow
def test_trl_drops_the_loss_free_windows_packkit_counted(packed_rows, tmp_path):
    """Friction 6: with a max_length, TRL drops the rows without a loss token in silence; they are exactly the
    windows pack_dataset now logs, and max_length=None (the README's) keeps every row."""
    rows, free = packed_rows
    assert len(trl_run(tmp_path / "a", rows, max_length=32).train_dataset) == len(rows) - free
    assert len(trl_run(tmp_path / "b", rows, max_length=None).train_dataset) == len(rows)


@pytest.mark.slow
def test_trl_num_tokens_with_packed_rows_counts_the_window(packed_rows, tmp_path):
    """Friction 7: TRL's logged num_tokens with PackedRowsCollator is W a micro-batch (position_ids.size(1)),
    not the B windows' tokens; the TRL page's note said so of FixedWindowCollator only."""
    rows, _ = packed_rows
    trainer = trl_run(tmp_path, rows, max_length=None)
    logged = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h][-1]
    trained = sum(trainer.trained_tokens[:2])  # the two micro-batches trained (accelerate collates one ahead)
    print(f"TRL logged {logged} tokens for {trained} trained")
    assert logged == 2 * 32 < trained
    note = next(p for p in (ROOT / "docs" / "trl.md").read_text().split("\n- ") if "logged `num_tokens`" in p)
    assert "PackedRowsCollator" in note and "FixedWindowCollator" in note


# -- 5. from text preference pairs to waste --preference on the command line -------------------------------------

PREF = [{"prompt": "hello there", "chosen": " hi friend", "rejected": " what"},
        {"prompt": "how are you", "chosen": " fine thanks", "rejected": " ok"}]


def test_text_preference_pairs_tokenize_then_waste(tok_dir, tmp_path, capsys):
    """Friction 5: ``packkit tokenize`` on prompt/chosen/rejected failed with "pass column=NAME" (Python syntax:
    tokenize has no --column); ``waste --preference`` refused text and ignored ``--tokenizer``. Now tokenize
    writes TRL's prompt_ids/chosen_ids/rejected_ids (tokenize_preference's, as DPOTrainer), waste reads them,
    and waste --preference --tokenizer on the text gives the same report."""
    from packkit.chat import load_tokenizer
    from packkit.preference import tokenize_preference

    src = write_jsonl(tmp_path / "pairs.jsonl", PREF)
    out = tmp_path / "pairs.parquet"
    code, text, err = cli(["tokenize", src, out, "--tokenizer", tok_dir], capsys)
    assert code == 0, err
    import pyarrow.parquet as pq

    got = pq.read_table(out).to_pylist()
    assert got == tokenize_preference(PREF, load_tokenizer(str(tok_dir)))
    assert all(r["prompt_ids"] and r["chosen_ids"] and r["rejected_ids"] for r in got)
    code, tokenized, err = cli(["waste", out, "--preference", "-w", "64", "--json"], capsys)
    assert code == 0, err
    code, direct, err = cli(["waste", src, "--preference", "-w", "64", "--json", "--tokenizer", tok_dir], capsys)
    assert code == 0, err
    assert json.loads(tokenized)["rows"] == json.loads(direct)["rows"]
    code, _, err = cli(["waste", out, "--preference", "-w", "64", "--tokenizer", tok_dir], capsys)
    assert code == 0 and "holds token ids already: --tokenizer is not used" in err


def test_text_preference_pairs_without_a_tokenizer_name_the_ways(tmp_path, capsys):
    """Friction 5: the error named a Python function the documentation did not mention, and no command-line way."""
    src = write_jsonl(tmp_path / "pairs.jsonl", PREF)
    code, _, err = cli(["waste", src, "--preference"], capsys)
    assert code == 3 and "pass --tokenizer FOLDER_OR_MODEL_ID to tokenize the pairs" in err
    assert "packkit tokenize IN OUT --tokenizer T" in err and "packkit.preference.tokenize_preference" in err
    assert "packkit.preference.tokenize_preference" in (ROOT / "docs" / "dpo.md").read_text()
    code, _, err = cli(["tokenize", src, tmp_path / "o.jsonl"], capsys)
    assert code == 2 and "holds preference pairs (prompt, chosen, rejected): pass --tokenizer" in err


def test_tokenize_names_its_own_options(tok_dir, tmp_path, capsys):
    """Friction 5: tokenize's error said "pass column=NAME" (the library's spelling; tokenize has no --column)."""
    src = write_jsonl(tmp_path / "other.jsonl", [{"body": "hello there"}])
    code, _, err = cli(["tokenize", src, tmp_path / "o.jsonl", "--tokenizer", tok_dir], capsys)
    assert code == 3, err
    assert "column=" not in err and "pass --text-column NAME" in err


# -- 8. re-packing packed rows at a larger window ----------------------------------------------------------------


def test_repacking_keeps_the_example_ids_and_says_what_stays_split(ids_jsonl, tmp_path, capsys):
    """Friction 8: re-packing packkit's rows at a larger window dropped their ``example_ids`` (or, with
    --example-ids, wrote ids of the input's documents, not of the examples) and said nothing of the pieces an
    example was split into at the smaller window."""
    import pyarrow.parquet as pq

    small, large = tmp_path / "w16.parquet", tmp_path / "w64.parquet"
    code, _, err = cli(["pack", ids_jsonl, small, "-w", "16", "--example-ids", "-q"], capsys)
    assert code == 0, err
    code, out, err = cli(["pack", small, large, "-w", "64", "-q"], capsys)
    assert code == 0, err
    examples = [r["input_ids"] for r in ids_rows()]
    split = [i for i, ids in enumerate(examples) if len(ids) > 16]
    pieces = sum(-(-len(examples[i]) // 16) for i in split)
    assert f"{pieces:,} of the documents are pieces of {len(split):,} examples split when the rows were packed" in out
    docs = {}
    for row in pq.read_table(large).to_pylist():
        start = 0
        for n, i in zip(row["seq_lengths"], row["example_ids"]):
            docs.setdefault(i, []).append(row["input_ids"][start:start + n])
            start += n
    assert sorted(docs) == list(range(len(examples)))  # the examples' ids, not the 16-token documents'
    for i, parts in docs.items():
        if i not in split:
            assert parts == [examples[i]]
        else:
            assert sorted(map(len, parts)) == sorted([16] * (len(examples[i]) // 16) + [len(examples[i]) % 16] * (
                len(examples[i]) % 16 > 0))
    code, out, err = cli(["pack", tmp_path / "w64.parquet", tmp_path / "again.parquet", "-w", "64", "-q"], capsys)
    assert code == 0 and "pieces of" in out  # ids carried twice: still the examples'


def test_every_option_the_documentation_uses_is_in_its_commands_help():
    """``packkit COMMAND --help`` mentions every option the documentation uses with it."""
    import importlib
    import re

    from packkit.cli import SUBCOMMANDS

    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    used = {}
    for cmd, rest in re.findall(r"packkit (waste|pack|plan|tokenize)\b([^`\n#|]*)", docs):
        used.setdefault(cmd, set()).update(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest))
    assert used.get("pack") and used.get("tokenize")
    for cmd, options in used.items():
        helptext = importlib.import_module(SUBCOMMANDS[cmd][0]).parser().format_help()
        missing = sorted(o for o in options if not re.search(rf"(?<![\w-]){o}(?![\w-])", helptext))
        assert not missing, f"packkit {cmd} --help does not mention {missing}"
