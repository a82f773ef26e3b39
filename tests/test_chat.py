"""Chat data where data enters: TRL's conversational formats through a chat template, into `packkit waste`,
`plan`, `pack` and `pack_dataset`, with loss tokens checked against a hand count and TRL's own tokenization.

Every tokenizer here is built locally (a word-level vocabulary, so one word = one token and the counts can
be done by hand); nothing is downloaded, and a model id is made to fail offline.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from testlib import tiny_causal_lm  # noqa: E402

from packkit import chat, tokenizer  # noqa: E402
from packkit.chat import ChatWarning, chat_format, tokenize_chat, tokenize_dataset  # noqa: E402
from packkit.cli import main  # noqa: E402
from packkit.errors import ArgumentError, DataError  # noqa: E402
from packkit.segments import common_prefix_lengths, mask_from  # noqa: E402
from packkit.offline import pack_dataset  # noqa: E402

datasets.disable_progress_bars()

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
WORDS = "hello there hi friend how are you fine thanks what is two plus three five be brief ok".split()
VOCAB = {w: i for i, w in enumerate(SPECIAL + WORDS)}

#: <|role|> content <|end|> per message; an assistant reply and its <|end|> inside {% generation %}.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> "
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
            "{% else %}{{ m['content'] }} <|end|> {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
TEMPLATE_NO_MARKERS = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def make_tokenizer(template=TEMPLATE, *, bos=False):
    """A fast tokenizer (one token per whitespace-separated word) with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:  # plain text gets <s> first, as Llama's tokenizers do (the chat template never asks for it)
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>",
                                               additional_special_tokens=SPECIAL[4:])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny-chat"
    make_tokenizer(bos=True).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tok_nomark_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny-chat-nomarkers"
    make_tokenizer(TEMPLATE_NO_MARKERS).save_pretrained(str(path))
    return path


def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [msg("user", "hello there"), msg("assistant", "hi friend")],
    [msg("system", "be brief"), msg("user", "how are you"), msg("assistant", "fine thanks")],
    [msg("user", "hello"), msg("assistant", "hi"), msg("user", "what is two plus three"), msg("assistant", "five")],
]
# Counted by hand from TEMPLATE, one token a word: a message is its role tag, its words and <|end|>; the
# loss is on an assistant reply's words and its <|end|> (never on the first token of an example).
#   0: <|user|> hello there <|end|> (4) + <|assistant|> hi friend <|end|> (4)               -> 8, loss 3
#   1: <|system|> be brief <|end|> (4) + <|user|> how are you <|end|> (5) + <|assistant|> fine thanks <|end|> (4)
#                                                                                          -> 13, loss 3
#   2: <|user|> hello <|end|> (3) + <|assistant|> hi <|end|> (3) + <|user|> what is two plus three <|end|> (7)
#      + <|assistant|> five <|end|> (3)                                                    -> 16, loss 2 + 2
HAND_TOKENS = [8, 13, 16]
HAND_LOSS = [3, 3, 2 + 2]


def reference_tokens(conversation):
    """The slow, obvious reference: TEMPLATE written out message by message, word by word."""
    ids, mask = [], []
    for m in conversation:
        words = [f"<|{m['role']}|>"] + m["content"].split() + ["<|end|>"]
        ids += [VOCAB[w] for w in words]
        a = int(m["role"] == "assistant")
        mask += [0] + [a] * (len(words) - 1)  # the role tag is outside {% generation %}
    return ids, mask


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def chat_jsonl(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------
# the pure pieces and the formats
# ----------------------------------------------------------------------------------------------


def test_reference_matches_the_hand_count():
    refs = [reference_tokens(c) for c in CONVERSATIONS]
    assert [len(ids) for ids, _ in refs] == HAND_TOKENS
    assert [sum(m[1:]) for _, m in refs] == HAND_LOSS


def test_common_prefix_lengths_against_a_loop():
    rng = np.random.default_rng(0)
    a = [rng.integers(0, 3, rng.integers(0, 6)).tolist() for _ in range(200)]
    b = [x[: rng.integers(0, len(x) + 1)] + rng.integers(0, 3, rng.integers(0, 4)).tolist() for x in a]

    def loop(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    off = lambda xs: np.concatenate(([0], np.cumsum([len(x) for x in xs])))  # noqa: E731
    flat = lambda xs: np.array([t for x in xs for t in x], np.int64)  # noqa: E731
    got = common_prefix_lengths(off(a), flat(a), off(b), flat(b))
    assert got.tolist() == [loop(x, y) for x, y in zip(a, b)]
    assert mask_from(off(b), got).tolist() == [int(j >= p) for x, p in zip(b, got) for j in range(len(x))]


def test_chat_format_from_the_columns():
    messages = pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}])
    assert chat_format(messages) == "messages"
    assert chat_format(pa.table({"prompt": ["a"], "completion": ["b"]})) == "prompt_completion"
    cpc = pa.Table.from_pylist([{"prompt": CONVERSATIONS[0][:1], "completion": CONVERSATIONS[0][1:]}])
    assert chat_format(cpc) == "conversational_prompt_completion"
    sharegpt = pa.Table.from_pylist([{"conversations": [{"from": "user", "value": "hi"}]}])
    assert chat_format(sharegpt) == "conversations"
    assert chat_format(pa.table({"text": ["a"]})) is None
    assert chat_format(pa.Table.from_pylist([{"messages": CONVERSATIONS[0], "input_ids": [1]}])) is None
    with pytest.raises(DataError, match="'messages' holds"):
        chat_format(pa.table({"messages": ["just text"]}))
    with pytest.raises(DataError, match="both be text or both be lists"):
        chat_format(pa.Table.from_pylist([{"prompt": "a", "completion": CONVERSATIONS[0]}]))


# ----------------------------------------------------------------------------------------------
# tokenize_chat against the reference and the hand count
# ----------------------------------------------------------------------------------------------


def test_messages_give_assistant_masks(tok_dir):
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS])
    out = tokenize_chat(table, str(tok_dir), batch_size=2)  # two batches
    assert out.column_names == ["input_ids", "assistant_masks"]
    assert out.schema.field("input_ids").type == pa.list_(pa.int32())
    refs = [reference_tokens(c) for c in CONVERSATIONS]
    assert out.column("input_ids").to_pylist() == [ids for ids, _ in refs]
    assert out.column("assistant_masks").to_pylist() == [m for _, m in refs]


def test_a_batch_past_int32_offsets_is_large_list(tok_dir, monkeypatch):
    """Bug: _Encoder.encode built its list arrays with int32 offsets by hand (no large_list fallback), so a
    batch past 2**31 - 1 tokens would wrap; it now goes through arrow.list_array. The limit is lowered to
    exercise the switch: the batches that pass it come back as large_list, the values the same."""
    import packkit.arrow as pio

    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS])
    ref = tokenize_chat(table, str(tok_dir), batch_size=2)
    monkeypatch.setattr(pio, "MAX_LIST_VALUES", 20)
    out = tokenize_chat(table, str(tok_dir), batch_size=2)
    assert out.schema.field("input_ids").type == pa.large_list(pa.int32())
    assert out.schema.field("assistant_masks").type == pa.large_list(pa.int8())
    assert out.column("input_ids").to_pylist() == ref.column("input_ids").to_pylist()
    assert out.column("assistant_masks").to_pylist() == ref.column("assistant_masks").to_pylist()


def test_sharegpt_conversations_are_renamed_as_trl_does(tok_dir):
    rows = [{"conversations": [{"from": m["role"], "value": m["content"]} for m in c]} for c in CONVERSATIONS]
    out = tokenize_chat(pa.Table.from_pylist(rows), tok_dir)
    assert out.column("assistant_masks").to_pylist() == [reference_tokens(c)[1] for c in CONVERSATIONS]


def test_standard_prompt_completion_appends_eos_and_masks_the_prompt(tok_dir):
    table = pa.table({"prompt": ["what is two plus three", "hello"], "completion": [" five", " there</s>"]})
    out = tokenize_chat(table, tok_dir)
    v = VOCAB
    assert out.column("input_ids").to_pylist() == [
        [v["<s>"], v["what"], v["is"], v["two"], v["plus"], v["three"], v["five"], v["</s>"]],
        [v["<s>"], v["hello"], v["there"], v["</s>"]],  # an EOS already there is not doubled
    ]
    assert out.column("completion_mask").to_pylist() == [[0] * 6 + [1, 1], [0, 0, 1, 1]]
    assert tokenize_chat(table, tok_dir, completion_only_loss=False).column_names == ["input_ids"]


def test_prompt_that_merges_with_the_completion_warns_and_starts_where_they_diverge(tok_dir):
    # "hello" + "there" is one unknown word: prompt [<s>, hello] vs whole [<s>, <unk>, </s>]
    table = pa.table({"prompt": ["hello", "hi"], "completion": ["there", " friend"]})
    with pytest.warns(ChatWarning, match="1 of 2 examples"):
        out = tokenize_chat(table, tok_dir)
    assert out.column("completion_mask").to_pylist() == [[0, 1, 1], [0, 0, 1, 1]]


def test_conversational_prompt_completion(tok_dir):
    rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]
    out = tokenize_chat(pa.Table.from_pylist(rows), tok_dir)
    assert out.column_names == ["input_ids", "completion_mask"]
    for c, ids, mask in zip(CONVERSATIONS, out.column("input_ids").to_pylist(),
                            out.column("completion_mask").to_pylist()):
        ref_ids, ref_mask = reference_tokens(c)
        assert ids == ref_ids
        # the prompt with its generation prompt ends on <|assistant|>: the completion is the last reply
        last = len(c[-1]["content"].split()) + 1
        assert mask == [0] * (len(ids) - last) + [1] * last
        assert mask == [int(i >= len(ids) - last) * m for i, m in enumerate(ref_mask)]
    both = tokenize_chat(pa.Table.from_pylist(rows), tok_dir, assistant_only_loss=True)
    assert both.column("completion_mask").to_pylist() == out.column("completion_mask").to_pylist()
    only_a = tokenize_chat(pa.Table.from_pylist(rows), tok_dir, assistant_only_loss=True, completion_only_loss=False)
    assert only_a.column("assistant_masks").to_pylist() == [reference_tokens(c)[1] for c in CONVERSATIONS]


def test_template_without_generation_markers_is_one_line_with_the_fix(tok_nomark_dir):
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS])
    with pytest.raises(ArgumentError) as e:
        tokenize_chat(table, tok_nomark_dir)
    text = str(e.value)
    assert "\n" not in text and "{% generation %}" in text and "chat_template=FILE.jinja" in text
    assert "assistant_only_loss=False" in text
    out = tokenize_chat(table, tok_nomark_dir, assistant_only_loss=False)  # loss on every token
    assert out.column_names == ["input_ids"]
    fixed = tokenize_chat(table, tok_nomark_dir, chat_template=TEMPLATE)  # the user's own template
    assert fixed.column("assistant_masks").to_pylist() == [reference_tokens(c)[1] for c in CONVERSATIONS]


def test_end_of_turn_outside_the_markers_warns(tok_dir):
    """TRL 1.16 warns when the assistant's end-of-turn token is outside the mask (never trained to stop)."""
    table = pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}])
    outside = TEMPLATE.replace(" <|end|>{% endgeneration %}", "{% endgeneration %} <|end|>")
    with pytest.warns(ChatWarning, match="never trained to stop"):
        out = tokenize_chat(table, tok_dir, chat_template=outside)
    assert out.column("assistant_masks").to_pylist() == [[0, 0, 0, 0, 0, 1, 1, 0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChatWarning)
        tokenize_chat(table, tok_dir)  # <|end|> inside: no warning


@pytest.mark.parametrize("kind", ["table", "IterableDataset"])
def test_the_end_of_turn_warning_points_at_the_callers_line(tok_dir, kind):
    """The "never trained to stop" warning names the line that called packkit, for a table and an
    ``IterableDataset`` (regression: the lazy path pointed one frame above the caller after a helper was inlined).
    A ``Dataset`` goes through :func:`tokenize_chat` and is still named one frame inside packkit."""
    datasets = pytest.importorskip("datasets")
    from packkit.chat import tokenize_dataset

    table = pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}])
    outside = TEMPLATE.replace(" <|end|>{% endgeneration %}", "{% endgeneration %} <|end|>")
    data = {"table": lambda: table, "IterableDataset": lambda: datasets.Dataset(table).to_iterable_dataset()}[kind]()
    call = tokenize_chat if kind == "table" else tokenize_dataset
    with pytest.warns(ChatWarning, match="never trained to stop") as caught:
        out = call(data, tok_dir, chat_template=outside)
    if kind == "IterableDataset":
        out = list(out)
    files = [w.filename for w in caught if "never trained to stop" in str(w.message)]
    assert files and all(f == __file__ for f in files), files


def test_chat_template_from_a_file(tok_nomark_dir, tmp_path):
    path = tmp_path / "train.jinja"
    path.write_text(TEMPLATE)
    out = tokenize_chat(pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}]), tok_nomark_dir, chat_template=path)
    assert out.column("assistant_masks").to_pylist() == [reference_tokens(CONVERSATIONS[0])[1]]
    with pytest.raises(ArgumentError, match="chat_template '.*missing.jinja' is neither a file nor Jinja"):
        tokenize_chat(pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}]), tok_nomark_dir,
                      chat_template=tmp_path / "missing.jinja")


@pytest.mark.parametrize("rows, match", [
    ([{"messages": CONVERSATIONS[0]}, {"messages": None}], "example 1 has no 'messages'"),
    ([{"messages": CONVERSATIONS[0]}, {"messages": []}], "example 1 has an empty 'messages'"),
    ([{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[0][:1]}], "example 1 has no assistant token"),
    ([{"messages": CONVERSATIONS[0]}, {"messages": [{"role": None, "content": "hi"}]}], "example 1: a message"),
])
def test_bad_conversations_name_the_example(tok_dir, rows, match):
    with pytest.raises(DataError, match=match):
        tokenize_chat(pa.Table.from_pylist(rows), tok_dir)


def test_a_template_that_fails_names_the_example(tok_dir):
    failing = "{% for m in messages %}{% if m['content'] == 'five' %}{{ raise_exception('no fives') }}" \
              "{% endif %}{% generation %}{{ m['content'] }} <|end|>{% endgeneration %} {% endfor %}"
    with pytest.raises(DataError, match="example 2: the chat template failed on it.*no fives"):
        tokenize_chat(pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS]), tok_dir,
                      chat_template=failing)


def test_tools_and_template_kwargs_columns_reach_the_template(tok_dir):
    template = ("{% if tools %}<|system|> {{ tools[0]['name'] }} <|end|> {% endif %}"
                "{% if greet %}<|system|> hello <|end|> {% endif %}" + TEMPLATE)
    rows = [{"messages": CONVERSATIONS[0], "tools": json.dumps([{"name": "ok"}]), "chat_template_kwargs": {"greet": 0}},
            {"messages": CONVERSATIONS[0], "tools": None, "chat_template_kwargs": {"greet": 1}}]
    out = tokenize_chat(pa.Table.from_pylist(rows), tok_dir, chat_template=template)
    base = reference_tokens(CONVERSATIONS[0])[0]
    v = VOCAB
    assert out.column("input_ids").to_pylist() == [[v["<|system|>"], v["ok"], v["<|end|>"]] + base,
                                                   [v["<|system|>"], v["hello"], v["<|end|>"]] + base]


# ----------------------------------------------------------------------------------------------
# what TRL does, on the same data (the reference users hold us to)
# ----------------------------------------------------------------------------------------------


def trl_labels(ds, tok, **config):
    """Input ids and labels of TRL's own SFTTrainer preparation of ``ds`` (a tiny random model; no training)."""
    trl = pytest.importorskip("trl")
    import tempfile

    model = tiny_causal_lm(vocab_size=len(tok))
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.SFTConfig(output_dir=d, report_to=[], bf16=False, use_cpu=True, max_length=None, **config)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    rows = trainer.train_dataset
    return rows["input_ids"], rows["labels"]


def our_labels(table):
    ids = table.column("input_ids").to_pylist()
    if table.num_columns == 1:
        return ids, ids
    masks = table.column(table.column_names[1]).to_pylist()
    return ids, [[t if m else -100 for t, m in zip(i, k)] for i, k in zip(ids, masks)]


@pytest.mark.parametrize("fmt", ["messages", "prompt_completion", "conversational_prompt_completion",
                                 "conversational_prompt_completion+assistant"])
def test_same_tokens_and_labels_as_trl_sft_trainer(tok_dir, fmt):
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    config = {}
    if fmt == "messages":
        rows = [{"messages": c} for c in CONVERSATIONS]
        config = dict(assistant_only_loss=True)
    elif fmt == "prompt_completion":
        rows = [{"prompt": "what is two plus three", "completion": " five"}, {"prompt": "hello", "completion": "there"},
                {"prompt": "how are", "completion": " you fine"}]
    else:
        rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]
        if fmt.endswith("assistant"):
            config = dict(assistant_only_loss=True)
    ds = datasets.Dataset.from_list(rows)
    want = trl_labels(ds, tok, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChatWarning)
        got = our_labels(tokenize_chat(ds, tok, **config))
    assert got == want


def test_trl_training_template_is_used_when_trl_knows_the_template(tmp_path):
    """A template without {% generation %} that TRL ships a training version of: TRL's SFTTrainer swaps
    that version in under assistant_only_loss, and so does packkit, so the loss counts agree."""
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    words = dict(VOCAB, **{"<|im_start|>": len(VOCAB), "<|im_end|>": len(VOCAB) + 1})
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                               unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = trl_templates.qwen2_5_chat_template
    assert not chat.has_generation_markers(tok.chat_template)
    tok.save_pretrained(str(tmp_path / "qwenish"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "qwenish"))
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    got = our_labels(tokenize_chat(ds, tok))
    assert got == trl_labels(ds, tok, assistant_only_loss=True)
    assert all(any(x != -100 for x in labels) for labels in got[1])


# ----------------------------------------------------------------------------------------------
# tokenizers: folders, ids, remote code, offline
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """The Hub at a closed local port and an empty cache: a model id must fail at once, without retries."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def test_model_id_offline_fails_fast_in_one_line(no_hub):
    start = time.perf_counter()
    with pytest.raises(ArgumentError) as e:
        chat.load_tokenizer("packkit-test/no-such-model")
    took = time.perf_counter() - start
    text = str(e.value)
    print(text, f"{took:.2f}s")
    assert "\n" not in text and "'packkit-test/no-such-model'" in text and "cannot be reached" in text
    assert "local tokenizer folder" in text
    assert took < tokenizer.HUB_PROBE_TIMEOUT + 5  # one probe, no retry loop


def test_hf_hub_offline_skips_the_network(monkeypatch, no_hub):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(tokenizer, "_hub_reachable", lambda *a, **k: pytest.fail("probed the network under HF_HUB_OFFLINE"))
    with pytest.raises(ArgumentError, match="HF_HUB_OFFLINE is set"):
        chat.load_tokenizer("packkit-test/no-such-model")


def test_tokenizer_paths(tok_dir, tmp_path):
    assert chat.load_tokenizer(str(tok_dir)).chat_template == TEMPLATE
    tok = chat.load_tokenizer(tok_dir / "tokenizer.json")  # a bare tokenizer.json: no template of its own
    out = tokenize_chat(pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}]), tok, chat_template=TEMPLATE)
    assert out.column("assistant_masks").to_pylist() == [reference_tokens(CONVERSATIONS[0])[1]]
    with pytest.raises(ArgumentError, match="has no chat template"):
        tokenize_chat(pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}]), tok_dir / "tokenizer.json")
    for bad in (tmp_path / "missing", "./missing", "a/b/c", "not an id!"):
        with pytest.raises(ArgumentError, match="not found"):
            chat.load_tokenizer(str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArgumentError, match="holds no tokenizer"):
        chat.load_tokenizer(str(tmp_path / "empty"))


@pytest.fixture
def remote_code_dir(tok_dir, tmp_path):
    """A tokenizer folder whose config asks for its own Python class; importing it writes MARKER."""
    import shutil

    path = tmp_path / "custom-tok"
    shutil.copytree(tok_dir, path)
    marker = tmp_path / "RAN"
    (path / "custom_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTok(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "custom_tok.CustomTok"]}, tokenizer_class="CustomTok")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path, marker


def test_remote_code_only_when_asked_by_name(remote_code_dir, chat_jsonl, capsys):
    path, marker = remote_code_dir
    code, out, err = run(["waste", str(chat_jsonl), "--tokenizer", str(path), "-q"], capsys)
    # the option's name in the reader's syntax (packkit.errors): --trust-remote-code once the CLI renders it
    assert code == 2 and err.count("\n") == 1 and re.search(r"--trust-remote-code|trust_remote_code=True", err)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# the CLI: waste, plan, pack on chat files
# ----------------------------------------------------------------------------------------------


def test_waste_reports_the_hand_counted_loss_tokens(tok_dir, chat_jsonl, capsys):
    code, out, err = run(["waste", str(chat_jsonl), "--tokenizer", str(tok_dir), "--json", "-w", "32"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["examples"] == 3 and report["input_tokens"] == sum(HAND_TOKENS)
    assert report["loss_tokens"] == sum(HAND_LOSS)
    assert "messages through the chat template of tiny-chat" in report["source"]
    code, out, err = run(["waste", str(chat_jsonl), "--tokenizer", str(tok_dir), "-w", "32", "-q"], capsys)
    assert code == 0 and f"loss tokens {sum(HAND_LOSS)} " in out


def test_waste_without_a_tokenizer_says_what_to_pass(chat_jsonl, capsys):
    code, out, err = run(["waste", str(chat_jsonl)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "conversational (messages)" in err and re.search(r"--tokenizer|tokenizer=FOLDER_OR_MODEL_ID", err)


def test_plan_counts_loss_tokens_from_parquet(tok_dir, tmp_path, capsys):
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS]), path)
    code, out, err = run(["plan", str(path), "--tokenizer", str(tok_dir), "--json", "--padded", "-b", "3"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["num_tokens"] == sum(HAND_TOKENS) and report["steps_per_epoch"] == 1
    assert report["loss_tokens_per_step"]["mean"] == sum(HAND_LOSS) and not report["loss_tokens_assumed"]


def test_plan_prompt_completion_and_the_loss_flags(tok_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "what is two plus three", "completion": " five"},
                                               {"prompt": "how are", "completion": " you fine thanks"}])
    argv = ["plan", str(path), "--tokenizer", str(tok_dir), "--json", "--padded", "-b", "2"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert json.loads(out)["loss_tokens_per_step"]["mean"] == 2 + 4  # "five </s>", "you fine thanks </s>"
    code, out, err = run(argv + ["--no-completion-only-loss"], capsys)
    assert json.loads(out)["loss_tokens_per_step"]["mean"] == (8 - 1) + (7 - 1)  # every token but the first
    code, out, err = run(argv + ["--assistant-only-loss"], capsys)
    assert code == 2 and "needs conversational data" in err


def packed_rows(path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return datasets.load_from_disk(str(path)).to_list()


@pytest.mark.parametrize("out_name", ["packed.parquet", "packed_folder"])
def test_pack_writes_labels_on_the_assistant_spans_only(tok_dir, chat_jsonl, tmp_path, capsys, out_name):
    out = tmp_path / out_name
    code, stdout, err = run(["pack", str(chat_jsonl), str(out), "-w", "24", "--tokenizer", str(tok_dir),
                             "--example-ids", "-q"], capsys)
    assert code == 0, err
    assert "tokenized messages through the chat template of tiny-chat" in stdout
    refs = [reference_tokens(c) for c in CONVERSATIONS]
    seen = []
    loss = 0
    for row in packed_rows(out):
        start = 0
        for ex, n in zip(row["example_ids"], row["seq_lengths"]):
            ids, mask = refs[ex]
            assert row["input_ids"][start: start + n] == ids
            want = [-100] + [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
            assert row["labels"][start: start + n] == want
            loss += sum(x != -100 for x in want)
            seen.append(ex)
            start += n
    assert sorted(seen) == [0, 1, 2] and loss == sum(HAND_LOSS)


def test_pack_a_saved_dataset_dict_split(tok_dir, tmp_path, capsys):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS]),
                               "test": datasets.Dataset.from_list([{"messages": CONVERSATIONS[1]}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    out = tmp_path / "test.parquet"
    code, stdout, err = run(["pack", str(tmp_path / "dd"), str(out), "-w", "24", "--tokenizer", str(tok_dir),
                             "--split", "test", "-q"], capsys)
    assert code == 0, err
    rows = pq.read_table(out).to_pylist()
    assert [r["input_ids"] for r in rows] == [reference_tokens(CONVERSATIONS[1])[0]]
    code, out_, err = run(["waste", str(tmp_path / "dd"), "--tokenizer", str(tok_dir), "--split", "train", "--json"],
                          capsys)
    assert code == 0 and json.loads(out_)["loss_tokens"] == sum(HAND_LOSS)


#: One fresh interpreter runs every CLI case that needs one (HF_ENDPOINT and HF_HOME are read when
#: huggingface_hub is imported; trust_remote_code imports the folder's class into that process): each
#: case goes through ``python -m packkit.cli``'s own ``__main__`` (runpy), with file descriptors 1 and 2
#: sent to its own files, so a stray line from a library's logger or a C extension counts too. Starting
#: one interpreter (torch, transformers) instead of three saves ~2 interpreter starts of this file's time.
CLI_DRIVER = r"""
import json, os, runpy, sys
out, folder, cases = {}, sys.argv[1], json.loads(sys.argv[2])
for name, argv in cases.items():
    files = [os.path.join(folder, f"{name}.{fd}") for fd in (1, 2)]
    saved = [os.dup(1), os.dup(2)]
    for fd, path in zip((1, 2), files):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["packkit"] + argv
    try:
        runpy.run_module("packkit.cli", run_name="__main__", alter_sys=True)
        code = "no exit"
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
    out[name] = [code] + [open(path).read() for path in files]
print(json.dumps(out))
"""


def run_cli_cases(cases, tmp_path, env):
    """``{name: argv}`` -> ``{name: (exit code, stdout, stderr)}``, all in one fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", CLI_DRIVER, str(tmp_path), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return {name: tuple(v) for name, v in json.loads(done.stdout).items()}


@pytest.mark.slow
def test_cli_subprocess_waste_unreachable_model_id_and_trust_remote_code(tok_dir, chat_jsonl, remote_code_dir,
                                                                        tmp_path):
    """In a fresh ``python -m packkit.cli``: waste --json on a local tokenizer folder; a model id behind
    an unreachable HF_ENDPOINT is one error line naming the endpoint, exit 2, nothing written; and
    --trust-remote-code runs the folder's own class (its import writes MARKER)."""
    path, marker = remote_code_dir
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0",
               TRANSFORMERS_OFFLINE="0", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    got = run_cli_cases({
        "waste": ["waste", str(chat_jsonl), "--tokenizer", str(tok_dir), "--json"],
        "unreachable": ["pack", str(chat_jsonl), str(tmp_path / "o.parquet"), "-w", "32",
                        "--tokenizer", "packkit-test/no-such-model"],
        "remote_code": ["waste", str(chat_jsonl), "--tokenizer", str(path), "--trust-remote-code", "--json"],
    }, tmp_path, env)
    print({name: (code, err) for name, (code, _, err) in got.items()}, f"{time.perf_counter() - start:.1f}s")
    code, out, err = got["waste"]
    assert code == 0, err
    assert json.loads(out)["loss_tokens"] == sum(HAND_LOSS)
    code, out, err = got["unreachable"]
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(r"packkit pack: error: (--)?tokenizer 'packkit-test/no-such-model' cannot be loaded: "
                     r"http://127.0.0.1:9 cannot be reached", err)
    assert not (tmp_path / "o.parquet").exists()
    code, out, err = got["remote_code"]
    assert code == 0, err
    assert marker.exists() and json.loads(out)["loss_tokens"] == sum(HAND_LOSS)


# ----------------------------------------------------------------------------------------------
# pack_dataset: conversational data, DatasetDict, IterableDataset
# ----------------------------------------------------------------------------------------------


def expected_labels(example_ids, seq_lengths):
    out = []
    for ex in example_ids:
        ids, mask = reference_tokens(CONVERSATIONS[ex])
        out += [-100] + [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
    return out


def test_pack_dataset_on_messages(tok_dir):
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    packed = pack_dataset(tokenize_dataset(ds, str(tok_dir)), window=24, example_ids=True)
    for row in packed:
        assert row["labels"] == expected_labels(row["example_ids"], row["seq_lengths"])
    with pytest.raises(DataError, match=r"conversational \(messages\): tokenize it first with "
                                        r"packkit.chat.tokenize_dataset"):
        pack_dataset(ds, window=24)
    with pytest.raises(DataError, match="not conversational"):
        tokenize_dataset(datasets.Dataset.from_dict({"text": ["hi"]}), str(tok_dir))


def test_pack_dataset_dict_each_split_or_one(tok_dir):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS]),
                               "test": datasets.Dataset.from_list([{"messages": CONVERSATIONS[2]}])})
    tokenized = tokenize_dataset(dd, str(tok_dir))
    packed, plans = pack_dataset(tokenized, window=24, return_report=True, example_ids=True)
    assert isinstance(packed, datasets.DatasetDict) and set(packed) == {"train", "test"}
    assert plans["train"].num_examples == 3 and plans["test"].num_examples == 1
    assert packed["test"]["input_ids"] == [reference_tokens(CONVERSATIONS[2])[0]]
    for row in packed["train"]:
        assert row["labels"] == expected_labels(row["example_ids"], row["seq_lengths"])
    one = pack_dataset(tokenized, window=24, split="test")
    assert isinstance(one, datasets.Dataset) and one["input_ids"] == packed["test"]["input_ids"]
    with pytest.raises(ArgumentError, match="no split 'dev'.*pass split=NAME"):
        pack_dataset(tokenized, window=24, split="dev")
    with pytest.raises(ArgumentError, match="split='train' picks a split of a DatasetDict"):
        pack_dataset(tokenized["train"], window=24, split="train")
    plain = datasets.DatasetDict({"a": datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})})
    assert pack_dataset(plain, window=4)["a"]["seq_lengths"] == [[2, 1]]


def test_tokenize_dataset_dict_loads_the_tokenizer_once(tok_dir, monkeypatch):
    """Bug: packing a DatasetDict loaded the tokenizer once a split (for a model id, a Hub probe of up to
    5 s each); tokenize_dataset loads it once (chat.load_tokenizer) and passes the object to every split."""
    loads = []
    real = chat.load_tokenizer

    def counting(spec, **kwargs):
        if isinstance(spec, (str, os.PathLike)):
            loads.append(spec)
        return real(spec, **kwargs)

    monkeypatch.setattr(chat, "load_tokenizer", counting)
    splits = {name: datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS]) for name in ("a", "b", "c")}
    packed = pack_dataset(tokenize_dataset(datasets.DatasetDict(splits), str(tok_dir)), window=24, example_ids=True)
    assert loads == [str(tok_dir)]
    for name in splits:
        for row in packed[name]:
            assert row["labels"] == expected_labels(row["example_ids"], row["seq_lengths"])
    # an error about the tokenizer still names it as given (a tokenizer.json has no chat template)
    spec = str(tok_dir / "tokenizer.json")
    with pytest.raises(ArgumentError) as one:
        tokenize_dataset(splits["a"], spec)
    with pytest.raises(ArgumentError) as every:
        tokenize_dataset(datasets.DatasetDict(splits), spec)
    assert str(every.value) == str(one.value) and repr(spec) in str(one.value)


def test_pack_dataset_on_an_iterable_dataset(tok_dir):
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS]).to_iterable_dataset()
    rows = list(pack_dataset(tokenize_dataset(ds, str(tok_dir)), window=24, shuffle=False, example_ids=True))
    assert sorted(e for r in rows for e in r["example_ids"]) == [0, 1, 2]
    for row in rows:
        assert list(row["labels"]) == expected_labels(row["example_ids"], row["seq_lengths"])
    bad = datasets.Dataset.from_list([{"messages": CONVERSATIONS[0]}] * 3 + [{"messages": CONVERSATIONS[0][:1]}])
    with pytest.raises(DataError, match="example 3 has no assistant token"):
        list(pack_dataset(tokenize_dataset(bad.to_iterable_dataset(), str(tok_dir)), window=24, shuffle=False))


def test_pack_dataset_with_a_loaded_tokenizer_and_prompt_completion(tok_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ds = datasets.Dataset.from_list([{"prompt": "what is two plus three", "completion": " five"}])
    packed = pack_dataset(tokenize_dataset(ds, tok), window=16)
    v = VOCAB
    assert packed["labels"] == [[-100] * 6 + [v["five"], v["</s>"]]]


def test_text_through_a_tokenizer_that_needs_its_own_code(remote_code_dir, tmp_path, capsys):
    """Plain text with --tokenizer naming a folder without tokenizer.json goes through the same loader:
    remote code only with --trust-remote-code (here refused; the marker file proves nothing ran)."""
    path, marker = remote_code_dir
    (path / "tokenizer.json").rename(path / "tokenizer.json.bak")  # now only AutoTokenizer can read it
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello there"}, {"text": "how are you"}])
    code, out, err = run(["waste", str(text), "--tokenizer", str(path), "-q"], capsys)
    assert code == 2 and re.search(r"--trust-remote-code|trust_remote_code=True", err)
    assert not marker.exists()


def test_tokenize_chat_reads_a_selection_in_its_order(tok_dir):
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS]).select([2, 0])
    out = tokenize_chat(ds, tok_dir)
    assert out.column("input_ids").to_pylist() == [reference_tokens(CONVERSATIONS[i])[0] for i in (2, 0)]


def test_num_proc_is_checked_once_by_the_chat_options(tok_dir, tmp_path, capsys):
    """``num_proc`` is checked where the options are made (:class:`packkit.chatoptions.ChatOptions`), for every caller.
    Regression: tokenize_chat and the encoder each checked it, and an ``IterableDataset`` (mapped in one process) or
    ``packkit tokenize --num-proc 0`` on text let 0 through unsaid."""
    ds = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    for call in (lambda: chat.ChatOptions(num_proc=0), lambda: tokenize_chat(ds, tok_dir, num_proc=0),
                 lambda: tokenize_dataset(ds.to_iterable_dataset(), tok_dir, num_proc=0)):
        with pytest.raises(ArgumentError, match="^num_proc must be at least 1, got 0$"):
            call()
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello there"}])
    code, _, err = run(["tokenize", str(text), str(tmp_path / "out.parquet"), "--tokenizer", "bytes", "--num-proc",
                        "0"], capsys)
    assert code == 2 and "--num-proc must be at least 1, got 0" in err and not (tmp_path / "out.parquet").exists()
