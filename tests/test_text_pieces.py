"""A long text tokenized in pieces: a text's working set in one tokenizer call is 130-200 bytes a
character (Qwen3's tokenizer, ShareGPT: +14.4 MiB for a line of 90,215 characters, +0.7 in pieces of 4 Ki), so
``packkit.tokenizer.tokenize`` cuts a text longer than ``packkit.pretokens.PIECE_CHARS`` before a space after a
letter, a digit or ASCII punctuation, where the pieces give the ids of the whole text, and only for tokenizers where
that holds.

The reference is the tokenizer's own ``encode_batch`` of every text whole, compared exactly.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("pyarrow")
tokenizers = pytest.importorskip("tokenizers")

from packkit import pretokens, tokenizer as tkz  # noqa: E402

#: Qwen 2/3's pattern, then Llama 3's (a Split before a ByteLevel without its own regex)
QWEN = pretokens.SPLIT_SAFE_REGEXES[0]
LLAMA3 = pretokens.SPLIT_SAFE_REGEXES[1]
WORDS = ["hello", "there", "and", "so", "on", "It's", "we'll", "naïve", "café", "e\u0301te\u0301", "数据", "打包",
         "🚀", "x2", "2024", "a.b", "--", "  ", "\t", "(yes)", "A", "z", "don't", "THEY'RE", "\r\n", "\n", "...",
         "😀!", "foo_bar",
         "'s", "'LL", "12345", "3.14", "\t ", " \n ", "\u00a0", "x\u0301", "\u3000", "#", "\\"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _text(rng, n_words: int) -> str:
    """Words joined by single spaces mostly, sometimes by nothing or by several: cuts fall everywhere."""
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice([" "] * 8 + ["", "  ", ", "]))
    return "".join(out)


def _texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ([_text(rng, rng.randint(1, 30)) for _ in range(60)] + [_text(rng, 2_000), _text(rng, 700)]
            + ["word " * 500, "x" * 3_000, "数据打包" * 400, " " * 900 + "tail", ""])


def build(pre: str = "qwen", *, normalizer=True, post="byte_level"):
    """A trained byte-level BPE behind pre-tokenizer ``pre`` ("qwen", "llama3", "gpt2" (ByteLevel's own regex),
    "prefix" (GPT-2's with a prefix space), "whitespace")."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    if normalizer:
        tk.normalizer = normalizers.NFC()
    if pre in ("qwen", "llama3"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN if pre == "qwen" else LLAMA3), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "whitespace":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=pre == "prefix")
    if post == "byte_level":
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    elif post == "bos":
        tk.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                          special_tokens=[("<|im_start|>", 1)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_texts(1) * 2, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                              show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


class Spy:
    """The tokenizer, each call's texts kept; its settings read through it."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def encode_batch_fast(self, texts):
        self.calls.append(list(texts))
        return self.tok.encode_batch_fast(texts)

    encode_batch = encode_batch_fast  # what marks a loaded tokenizer

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _cut_within(text: str, limit: int) -> bool:
    """Whether a space after a letter, a digit or ASCII punctuation lies at 1..limit of ``text`` (the reference)."""
    before = lambda c: c.isalnum() or c == "_" or (c.isascii() and c.isprintable() and not c.isspace())  # noqa: E731
    return any(text[i] == " " and before(text[i - 1]) for i in range(1, min(limit, len(text) - 1) + 1))


def _ids(got) -> list:
    offsets, values = got.offsets.to_numpy(), got.values.to_numpy()
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("pre", ["qwen", "llama3", "gpt2"])
@pytest.mark.parametrize("normalizer", [True, False])
def test_a_long_text_is_tokenized_in_bounded_pieces_that_give_its_ids(pre, normalizer, monkeypatch):
    """A text over PIECE_CHARS reaches the tokenizer in pieces of at most that many characters (a piece
    longer only where no cut is in reach: "x" * 3,000, "数据打包" * 400), each call at most TOKENIZE_CALL_CHARS, and
    its ids are the whole text's, exactly. Before, a text went whole into one call: a ShareGPT line of 90,215
    characters held 14.4 MiB of Qwen3's tokenizer's working set (4.3x the tokens of the 4 MB file it was in)."""
    tok = build(pre, normalizer=normalizer)
    assert pretokens.cuts_keep_ids(tok)
    monkeypatch.setattr(pretokens, "PIECE_CHARS", 64)
    monkeypatch.setattr(tkz, "TOKENIZE_CALL_CHARS", 256)
    texts = _texts()
    spy = Spy(tok)
    got = _ids(tkz.tokenize(texts, spy))
    want = [e.ids for e in tok.encode_batch(texts)]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    print(f"{len(spy.calls)} calls, longest piece {max(len(t) for c in spy.calls for t in c):,}; differing: {bad[:5]}")
    assert len(got) == len(texts) and not bad
    pieces = [t for c in spy.calls for t in c]
    assert "".join(pieces) == "".join(texts)  # every character once, in order
    long = [t for t in pieces if len(t) > 64]
    assert all(not _cut_within(t, 64) for t in long), [t[:40] for t in long if _cut_within(t, 64)]
    assert len(long) < len(pieces) // 4, (len(long), len(pieces))
    assert all(sum(map(len, c)) <= 256 or len(c) == 1 for c in spy.calls)
    assert len(pieces) > len(texts) + 40  # the long texts were cut


@pytest.mark.parametrize("why", ["prefix", "whitespace", "bos", "added token", "truncation"])
def test_a_text_is_not_cut_where_pieces_could_change_its_ids(why, monkeypatch):
    """Pieces are tokenized as whole texts: a prefix space would be added to each, a post-processor's BOS repeated, a
    whitespace pre-tokenizer or truncation is not known to keep ids, an added token's matching (and its lstrip) is
    the tokenizer's. There a long text goes whole, as before, and its ids are the whole text's."""
    tok = build({"prefix": "prefix", "whitespace": "whitespace"}.get(why, "qwen"), post="bos" if why == "bos" else
                "byte_level")
    if why == "truncation":
        tok.enable_truncation(100_000)
    long = "hello there friend " * 40 + ("<|im_end|> tail" if why == "added token" else "")
    monkeypatch.setattr(pretokens, "PIECE_CHARS", 64)
    spy = Spy(tok)
    got = _ids(tkz.tokenize(["short one", long], spy))
    assert got == [e.ids for e in tok.encode_batch(["short one", long])]
    assert long in [t for c in spy.calls for t in c]  # whole


def test_text_pieces():
    """Each cut the last in reach, before a space after a letter, a digit or ASCII punctuation; none in reach: the
    first after."""
    assert pretokens.text_pieces("ab cd ef", 5) == ["ab cd", " ef"]
    assert pretokens.text_pieces("ab cd ef", 4) == ["ab", " cd", " ef"]
    assert pretokens.text_pieces("abcdef gh", 3) == ["abcdef", " gh"]
    assert pretokens.text_pieces("a. b cd", 3) == ["a.", " b", " cd"]
    assert pretokens.text_pieces("ab\t cd", 2) == ["ab\t cd"]  # not after whitespace
    assert pretokens.text_pieces("ab   cd", 3) == ["ab", "   cd"]  # not inside a run of spaces
    assert pretokens.text_pieces("数据 打包 x", 3) == ["数据", " 打包", " x"]
    assert pretokens.text_pieces("ab cd ef", 5, ["<|x|>"]) == ["ab cd", " ef"]
    assert pretokens.text_pieces("ab <|x|> ef", 5, ["<|x|>"]) == ["ab <|x|> ef"]
    assert pretokens.text_pieces("ab cd", 10) == ["ab cd"]
    text = "the quick brown fox " * 50
    pieces = pretokens.text_pieces(text, 37)
    assert "".join(pieces) == text and max(map(len, pieces)) <= 37
    assert all(p.startswith(" ") for p in pieces[1:]) and np.all(np.diff([len(p) for p in pieces[:-1]]) <= 37)
