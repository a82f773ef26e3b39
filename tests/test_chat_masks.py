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
