"""The assistant mask without transformers' Python loop over every token: ``tokenize_chat`` renders a batch with
transformers' own steps, tokenizes it in one Rust call and marks each ``{% generation %}`` span's tokens by
bisection on the token offsets. These tests hold it to ``apply_chat_template(..., return_assistant_tokens_mask=True)``
token for token: a byte-level BPE (characters of several bytes cut across tokens), spans that start or end inside a
word or a character, empty spans, and texts drawn by hypothesis; and they check the loop is no longer run.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from packkit.chat import tokenize_chat  # noqa: E402

#: The tests of the fast path itself need transformers' steps that render a batch without its loop (chat_template_utils'
#: message normaliser, from 5.24): below, tokenize_chat takes apply_chat_template's path, slower, the same ids and
#: masks (every test of the masks above still runs there).
fast_render = pytest.mark.skipif(
    not hasattr(__import__("transformers.utils.chat_template_utils", fromlist=["_"]), "_normalize_chat_messages"),
    reason="transformers < 5.24 renders chat through apply_chat_template's per-token loop (the same output)")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: ChatML with the assistant reply and its <|im_end|> inside {% generation %} (TRL's training templates' shape)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
          "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
#: spans that cut words and characters: the reply's first character outside, an empty span, the rest inside
ODD = ("{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' %}{{ m['content'][:1] }}"
       "{% generation %}{% endgeneration %}{% generation %}{{ m['content'][1:] }}{% endgeneration %}"
       "{% else %}{{ m['content'] }}{% endif %}|{% endfor %}")
TEXTS = ["hello there, how are you?", "naïve café — déjà vu", "数据打包 与 注意力", "emoji 🚀🔥 and 👩‍💻 too",
         "  spaces\tand\nnewlines  ", "x", "def f(x):\n    return x ** 2  # 平方"]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                               additional_special_tokens=SPECIAL[1:])


def conversation(texts):
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


def transformers_masks(tok, convs, template):
    out = tok.apply_chat_template(convs, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return [list(x) for x in out["input_ids"]], [list(x) for x in out["assistant_masks"]]


def ours(tok, convs, template):
    import pyarrow as pa

    table = tokenize_chat(pa.table({"messages": convs}), tok, chat_template=template)
    return table.column("input_ids").to_pylist(), table.column("assistant_masks").to_pylist()


@pytest.mark.parametrize("template", [CHATML, ODD], ids=["chatml", "spans-cut-words-and-characters"])
def test_masks_equal_apply_chat_template(tok, template):
    convs = [conversation(TEXTS[i:] + TEXTS[:i]) for i in range(len(TEXTS))]
    ids, masks = ours(tok, convs, template)
    want_ids, want_masks = transformers_masks(tok, convs, template)
    print("tokens", sum(map(len, ids)), "masked", sum(map(sum, masks)))
    assert ids == want_ids
    assert masks == want_masks


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.lists(st.text(min_size=2, max_size=30), min_size=2, max_size=5), min_size=1, max_size=4),
       template=st.sampled_from([CHATML, ODD]))
def test_drawn_conversations_equal_apply_chat_template(tok, texts, template):
    convs = [conversation(t) for t in texts]
    assert ours(tok, convs, template) == transformers_masks(tok, convs, template)


@fast_render
def test_the_per_token_loop_is_not_run(tok, monkeypatch):
    """Regression: every batch went through ``apply_chat_template(return_assistant_tokens_mask=True)``, whose
    assistant mask is a Python loop over every token (a third of packkit's CPU time on ShareGPT with Qwen3's
    tokenizer). A fast tokenizer without truncation or padding set no longer calls it."""
    masked = []  # the conversations apply_chat_template masked (the encoder's one-message probe of its template aside)
    real = type(tok).apply_chat_template

    def spy(self, conversation, *a, **k):
        if k.get("return_assistant_tokens_mask"):
            masked.append(str(conversation))
        return real(self, conversation, *a, **k)

    monkeypatch.setattr(type(tok), "apply_chat_template", spy)
    ours(tok, [conversation(TEXTS[:4])], CHATML)
    assert not [c for c in masked if TEXTS[0] in c]


def test_a_tokenizer_with_truncation_set_goes_through_apply_chat_template(tok):
    """``tok(...)`` turns a backend's own truncation off for the call; ``encode_batch`` would apply it, so such a
    tokenizer keeps transformers' path, and the masks still agree."""
    import copy

    cut = copy.deepcopy(tok)
    cut.backend_tokenizer.enable_truncation(8)
    convs = [conversation(TEXTS[:4])]
    assert ours(cut, convs, CHATML) == transformers_masks(cut, convs, CHATML)


# -- the byte spans of a byte-level BPE (chatrender.ByteSpans): ids without offsets, the same mask -----------------
#: Qwen 2/3's pre-tokenizer pattern (a Split, then ByteLevel without its own regex), behind an NFC normalizer
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
#: special tokens inside a generation span, at its start and at its end, and one just outside it
EDGES = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<|im_start|>{{ m['content'] }}"
         "<|endoftext|>{{ m['content'][:3] }}<|im_end|>{% endgeneration %}<|endoftext|>{% else %}<|im_start|>"
         "{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}")
NOT_NFC = "cafe\u0301 and e\u0301te\u0301"  # decomposed accents: NFC changes the text


def qwen_like(normalizer=True):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    if normalizer:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                               additional_special_tokens=SPECIAL[1:])


@pytest.fixture(scope="module")
def qwen():
    return qwen_like()


def offsets_path(tok, convs, template, monkeypatch):
    """The batch through the token character offsets (``ByteSpans`` refused): the reference."""
    from packkit import chatrender

    with monkeypatch.context() as m:
        m.setattr(chatrender.ByteSpans, "of", staticmethod(lambda backend: None))
        return ours(tok, convs, template)


MIXED = TEXTS + ["<|im_end|> inside a reply", "ends with a special<|im_start|>", "<|endoftext|>", "ő" * 5 + "😀x"]


@pytest.mark.parametrize("template", [CHATML, ODD, EDGES], ids=["chatml", "spans-cut-words", "special-tokens-at-edges"])
def test_byte_spans_equal_the_offsets_path(qwen, template, monkeypatch):
    """The ids and the mask from the tokens' byte spans (``encode_batch_fast``, no offsets) equal those from the
    token character offsets and transformers' own, token for token: characters of 2-4 bytes cut across tokens,
    special tokens inside, at the start and at the end of a generation span and in the text, a text that is not
    NFC (its offsets are asked for, alone)."""
    convs = [conversation(MIXED[i:] + MIXED[:i]) for i in range(len(MIXED))] + [conversation([NOT_NFC, NOT_NFC])]
    got = ours(qwen, convs, template)
    ref = offsets_path(qwen, convs, template, monkeypatch)
    print("tokens", sum(map(len, got[0])), "masked", sum(map(sum, got[1])))
    assert got == ref
    assert got == transformers_masks(qwen, convs, template)


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.lists(st.text(min_size=2, max_size=30), min_size=2, max_size=5), min_size=1, max_size=4),
       template=st.sampled_from([CHATML, ODD, EDGES]))
def test_drawn_texts_byte_spans_equal_apply_chat_template(qwen, texts, template):
    convs = [conversation(t) for t in texts]
    assert ours(qwen, convs, template) == transformers_masks(qwen, convs, template)


@fast_render
def test_a_byte_level_bpe_takes_the_byte_spans(qwen, tok, monkeypatch):
    """The byte spans are taken for a byte-level BPE (with and without an NFC normalizer), so the path cannot fall
    back to the offsets unseen: ``encode_batch`` (offsets) is not called for NFC texts, and only on the text that is
    not NFC. A post-processor that trims the offsets (the mask would follow the trimmed ones) is refused."""
    from tokenizers import processors

    from packkit import chatrender

    of = chatrender.ByteSpans.of
    for t in (qwen, tok):
        assert of(t.backend_tokenizer) is not None
    trims = qwen_like()
    trims.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    assert of(trims.backend_tokenizer) is None
    with_offsets = []
    real = type(qwen.backend_tokenizer).encode_batch

    class Spy:
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def encode_batch(self, texts, **kw):
            with_offsets.extend(texts)
            return real(self.backend, texts, **kw)

    monkeypatch.setattr(chatrender.hf, "fast_backend", lambda t: Spy(t.backend_tokenizer))
    monkeypatch.setattr(chatrender.ByteSpans, "of", staticmethod(lambda b: of(b.backend)))
    ours(qwen, [conversation(MIXED[:6])], CHATML)
    assert with_offsets == []
    ours(qwen, [conversation(MIXED[:4]), conversation([NOT_NFC, "fine"]), conversation(MIXED[4:8])], CHATML)
    assert len(with_offsets) == 1 and "e\u0301" in with_offsets[0]


# -- the fast copy (tokenizer.fast_copy): no NFC normalizer for NFC texts, a BPE cache past 10,000 words ------------
@fast_render
def test_the_fast_copy_takes_the_nfc_texts_and_gives_the_same_ids(qwen, monkeypatch):
    """Over a long enough table the texts are tokenized by a copy of the tokenizer without its NFC normalizer (NFC
    costs ~9% of Qwen3's tokenizing and changes no NFC text) and with a larger BPE cache: every NFC text goes to the
    copy, the text that is not NFC to the original (the copy would tokenize it otherwise: checked), and the ids
    and masks equal transformers' own."""
    from packkit import chat, chatrender, tokenizer

    backend = qwen.backend_tokenizer
    with tokenizer.fast_copy(backend) as (copy, bare):
        assert bare and copy is not backend and copy.normalizer is None and backend.normalizer is not None
        assert copy.encode(NOT_NFC).ids != backend.encode(NOT_NFC).ids  # why the text that is not NFC must not go there
    seen = {"copy": [], "original": []}
    real = chatrender._encode_fast

    def spy(b, fast, texts):
        encodings, nfc = real(b, fast, texts)
        assert fast is not None and fast[0] is not b and fast[1]
        for t, ok in zip(texts, nfc):
            seen["copy" if ok else "original"].append(t)
        return encodings, nfc

    monkeypatch.setattr(chatrender, "_encode_fast", spy)
    monkeypatch.setattr(chat, "COPY_BYTES_PER_TOKEN", 0)
    convs = [conversation(MIXED[i:] + MIXED[:i]) for i in range(len(MIXED))] + [conversation([NOT_NFC, "fine"])]
    for template in (CHATML, EDGES):
        assert ours(qwen, convs, template) == transformers_masks(qwen, convs, template)
    assert len(seen["copy"]) == 2 * (len(convs) - 1) and len(seen["original"]) == 2
    assert all("e\u0301" in t for t in seen["original"])


class Recorded:
    """A Rust tokenizer without a normalizer (so no copy is made) whose model's cache resizes are recorded (its size
    cannot be read back from ``tokenizers``)."""

    normalizer = None

    def __init__(self, backend, sizes):
        self.backend, self.sizes = backend, sizes

    def __getattr__(self, name):
        return getattr(self.backend, name)

    @property
    def model(self):
        sizes, model = self.sizes, self.backend.model

        class BPE:  # the type's name is what fast_copy reads
            def __getattr__(self, name):
                return getattr(model, name)

            def _resize_cache(self, capacity):
                sizes.append(capacity)
                model._resize_cache(capacity)
        return BPE()


def test_the_fast_copy_gives_the_cache_its_size_back(qwen):
    """``fast_copy`` shares the user's tokenizer's model: its cache is enlarged for the block and given tokenizers'
    size back after it (the only tokenizer state the block changes), also when the block fails."""
    from packkit import tokenizer

    sizes = []
    backend = Recorded(qwen.backend_tokenizer, sizes)
    with tokenizer.fast_copy(backend) as (copy, bare):
        assert (copy, bare) == (backend, False) and sizes == [tokenizer.CACHE_WORDS]
    assert sizes == [tokenizer.CACHE_WORDS, tokenizer.TOKENIZERS_CACHE_WORDS]
    with pytest.raises(ZeroDivisionError), tokenizer.fast_copy(backend):
        1 / 0
    assert sizes[2:] == [tokenizer.CACHE_WORDS, tokenizer.TOKENIZERS_CACHE_WORDS]


def test_the_fast_copy_is_made_only_for_long_text(qwen, monkeypatch):
    """The larger cache pays over ~32 bytes a vocabulary entry (~1.2 s saved on 1,000 ShareGPT conversations with
    Qwen3's) and empties the user's: a short table is tokenized by the original, its cache untouched; a long one by
    the copy, for that table's run (also when it fails). A tokenizer whose copy would gain nothing (no BPE, no NFC)
    is used as it is."""
    import contextlib

    import pyarrow as pa
    from tokenizers import Tokenizer, models, pre_tokenizers

    from packkit import chat, tokenizer

    runs = []

    @contextlib.contextmanager
    def recorded(backend):
        with tokenizer.fast_copy(backend) as got:
            runs.append("in")
            yield got
        runs.append("out")

    monkeypatch.setattr(chat, "fast_copy", recorded)
    options = chat.ChatOptions(CHATML)
    enc = chat.chat_encoder(pa.table({"messages": [conversation(TEXTS[:2])]}).schema, qwen, options)
    short = pa.table({"messages": [conversation(TEXTS[:2])]})
    enc.encode_table(short, 0)
    assert enc.fast is None and runs == []
    vocab = qwen.backend_tokenizer.get_vocab_size()
    long_ = pa.table({"messages": [conversation(TEXTS)] * (chat.COPY_BYTES_PER_TOKEN * vocab // 100)})
    assert enc.encode_table(long_, 1) == tokenize_chat(long_, qwen, chat_template=CHATML)
    assert enc.fast[0] is not qwen.backend_tokenizer and runs == ["in", "out", "in", "out"]
    monkeypatch.setattr(chat, "encode_rows", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        enc.encode_table(long_, 1)
    assert runs[4:] == ["in"]  # left by the exception: fast_copy's own finally gives the size back (test above)
    word = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    with tokenizer.fast_copy(word) as got:
        assert got == (word, False)


def test_the_fast_copy_is_made_around_the_model_not_through_its_json(qwen, monkeypatch):
    """The copy is a new ``Tokenizer`` around the user's tokenizer's own model: Qwen3's JSON round trip
    (``to_str``, ``from_str``) took 0.5-0.6 s CPU a call (as much as its larger cache saved on 1,000 ShareGPT
    conversations) and +91 MiB while made. Regression: ``fast_copy`` went through the JSON. Its ids equal the
    original's, and another thread encoding with the user's tokenizer meanwhile gets its own ids."""
    import threading

    from packkit import tokenizer

    def refused(*args):
        raise AssertionError("fast_copy went through the tokenizer's JSON")

    backend = qwen.backend_tokenizer
    texts = MIXED + [t.upper() for t in MIXED]
    want = [e.ids for e in backend.encode_batch(texts)]
    monkeypatch.setattr(type(backend), "from_str", refused, raising=False)
    got, stop = [], threading.Event()

    def user():
        while not stop.is_set():
            got.append([e.ids for e in backend.encode_batch(texts)])

    thread = threading.Thread(target=user)
    thread.start()
    try:
        for _ in range(20):
            with tokenizer.fast_copy(backend) as (copy, bare):
                assert bare and copy is not backend
                assert [e.ids for e in copy.encode_batch(texts)] == want
    finally:
        stop.set()
        thread.join()
    assert got and all(g == want for g in got)


def test_a_tokenizer_whose_added_tokens_would_change_is_used_as_it_is(qwen, monkeypatch):
    """Where the added tokens would not come out around the shared model with the ids and settings they have (an
    ``AddedToken`` compares its content alone, so every setting is compared), or truncation or padding is set, no
    copy is made: the original tokenizes, its cache enlarged."""
    from tokenizers import AddedToken, Tokenizer

    from packkit import tokenizer

    backend = Tokenizer.from_str(qwen.backend_tokenizer.to_str())
    backend.add_tokens([AddedToken("zz-far", single_word=True)])
    with tokenizer.fast_copy(backend) as (copy, bare):
        assert (copy, bare) != (backend, False)  # the settings came out the same: a copy
    real = Tokenizer.add_tokens

    def lose_settings(self, tokens):  # as if the copy could not keep single_word
        return real(self, [AddedToken(t.content, special=t.special) for t in tokens])

    monkeypatch.setattr(Tokenizer, "add_tokens", lose_settings)
    with tokenizer.fast_copy(backend) as got:
        assert got == (backend, False)
    monkeypatch.undo()
    backend.enable_truncation(8)
    with tokenizer.fast_copy(backend) as got:
        assert got == (backend, False)
