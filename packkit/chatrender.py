"""Conversations rendered by a chat template and tokenized a batch at a time, with the assistant mask the template's
``{% generation %}`` spans mark: the machinery behind :mod:`packkit.chat`, which chooses the format, the template and
the loss (this module knows nothing of TRL's formats, columns or options). An error names the example by its index.
"""

from __future__ import annotations

import bisect
import itertools
import unicodedata
import warnings
from operator import itemgetter

import numpy as np

from .arrow import flat_lists as flat  # lent here under its old name
from .errors import DataError, Where
from .integrations import transformers as hf  # transformers' private chat-template compiler, read in one place
from .pretokens import _state
from .segments import lengths_to_offsets, range_index
from .tokenizer import one_line

__all__ = ["flat", "render"]


def render(tok, conversations: list, base: int, *, template: str, tools=None, kwargs=None,
           add_generation_prompt: bool = False, assistant_mask: bool = False, fast: tuple | None = None):
    """``apply_chat_template`` on a batch (the first is example ``base``), tokenized: ``(offsets (n + 1,) int64,
    ids (T,) int64, assistant mask (T,) int8 or None)``. One render and one tokenizer call for the batch
    (:func:`_render_fast`); per example when a ``tools`` or ``chat_template_kwargs`` column gives each its own.
    ``fast``: :func:`packkit.tokenizer.fast_copy` of ``tok``'s Rust tokenizer, to tokenize with (the same ids)."""
    if tools is not None or kwargs is not None:
        outs = [_render_one(tok, conv, base + j, template, None if tools is None else tools[j],
                            None if kwargs is None else kwargs[j], add_generation_prompt, assistant_mask)
                for j, conv in enumerate(conversations)]
        offsets, ids = flat([o[0] for o in outs])
        return offsets, ids, (flat([o[1] for o in outs])[1].astype(np.int8) if assistant_mask else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            done = _render_fast(tok, conversations, template, add_generation_prompt, assistant_mask, fast)
            if done is not None:
                return done
            out = tok.apply_chat_template(conversations, chat_template=template, tokenize=True, return_dict=True,
                                          add_generation_prompt=add_generation_prompt,
                                          return_assistant_tokens_mask=assistant_mask)
    except Exception as exc:
        for j, conv in enumerate(conversations):  # find the example that fails, to name it
            _render_one(tok, conv, base + j, template, None, None, add_generation_prompt, assistant_mask)
        raise DataError(f"examples {base}..{base + len(conversations) - 1}: the chat template failed: "
                         f"{type(exc).__name__}: {one_line(exc)}") from None
    offsets, ids = flat(list(out["input_ids"]))
    return offsets, ids, (flat(list(out["assistant_masks"]))[1].astype(np.int8) if assistant_mask else None)


def _render_fast(tok, conversations, template, add_generation_prompt, assistant_mask, fast=None):
    """:func:`render`'s batch as ``apply_chat_template`` makes it, without its Python loop over every token for the
    assistant mask (a third of packkit's time on ShareGPT with Qwen3's tokenizer, more than the rendering): rendered
    by transformers' own steps (:func:`packkit.integrations.transformers.render_chat`), tokenized by the Rust
    tokenizer in one call, each ``{% generation %}`` span marked on the tokens that overlap it: by their byte spans
    for a byte-level BPE (:class:`ByteSpans`, no offsets asked), else by bisection on the token offsets. None
    (``apply_chat_template`` then) without a fast tokenizer, or for token offsets out of order (the bisection would
    not be transformers' loop)."""
    backend = hf.fast_backend(tok)
    rendered = hf.render_chat(tok, conversations, template=template, add_generation_prompt=add_generation_prompt,
                              assistant_mask=assistant_mask) if backend is not None else None
    if rendered is None:
        return None
    texts, spans = rendered
    if not assistant_mask:  # the ids alone: no offsets to track
        return (*_flat_ids(_encode_fast(backend, fast, texts)[0]), None)
    bytewise = ByteSpans.of(backend)
    if bytewise is None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        offsets, ids = _flat_ids(encodings)
        marked = _char_marks(offsets, encodings, spans, range(len(texts)))
    else:
        encodings, nfc = _encode_fast(backend, fast, texts)
        offsets, ids = _flat_ids(encodings)
        marked, slow = bytewise.marks(texts, spans, offsets, ids, nfc)
        if slow:  # a text that is not NFC, or whose tokens do not tile its bytes: its offsets, as before
            again = backend.encode_batch([texts[j] for j in slow], add_special_tokens=False)
            rest = _char_marks(offsets, again, spans, slow)
            marked = None if rest is None else (marked[0] + rest[0], marked[1] + rest[1])
    if marked is None:
        return None
    mask = np.zeros(ids.size, np.int8)
    mask[range_index(*marked)] = 1
    return offsets, ids, mask


def _encode_fast(backend, fast, texts) -> tuple:
    """``(encodings, nfc)``: ``texts`` tokenized without offsets (``encode_batch_fast``), by ``fast``
    (:func:`packkit.tokenizer.fast_copy`'s ``(copy, bare)``, or None: ``backend``) where a bare copy is given only the
    texts that are NFC, and whether each text is NFC (ASCII is)."""
    nfc = [t.isascii() or unicodedata.is_normalized("NFC", t) for t in texts]
    copy, bare = fast or (backend, False)
    if not bare or all(nfc):
        encode = getattr(copy, "encode_batch_fast", copy.encode_batch)  # tokenizers >= 0.21
        return encode(texts, add_special_tokens=False), nfc
    out = [None] * len(texts)
    for tokenizer, which in ((copy, [j for j, ok in enumerate(nfc) if ok]),
                             (backend, [j for j, ok in enumerate(nfc) if not ok])):
        for j, e in zip(which, tokenizer.encode_batch_fast([texts[j] for j in which], add_special_tokens=False)):
            out[j] = e
    return out, nfc


def _flat_ids(encodings):
    """``(offsets (n + 1,) int64, ids (T,) int64)`` of a batch's ``Encoding`` objects."""
    lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
    offsets = lengths_to_offsets(lengths)
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int64, int(offsets[-1]))
    return offsets, ids


def _char_marks(offsets, encodings, spans, which):
    """``(starts, lengths)`` of the flat tokens that overlap (``end > lo and start < hi``) each ``{% generation %}``
    span ``[lo, hi)`` of the texts ``which``, by bisection on each one's token character offsets (``encodings``, an
    ``Encoding`` with offsets per text of ``which``); None when a text's offsets are not in order."""
    starts, lengths = [], []
    for j, encoding in zip(which, encodings):
        marked, chars = spans[j], encoding.offsets
        if not marked:
            continue
        if chars != sorted(chars) or chars != sorted(chars, key=itemgetter(1)):
            return None
        first = int(offsets[j])
        for lo, hi in marked:
            a = bisect.bisect_right(chars, lo, key=itemgetter(1))
            b = bisect.bisect_left(chars, hi, key=itemgetter(0))
            if b > a:
                starts.append(first + a)
                lengths.append(b - a)
    return starts, lengths


#: Split behaviours that keep every character.
_BPE_SPLITS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


class ByteSpans:
    """Where each token of a byte-level BPE (GPT-2, Llama 3, Qwen 2/3) lies in its text's UTF-8 bytes, from the ids
    alone: a token's bytes are its vocabulary string read through the byte-level alphabet (a character a byte), an
    added token's its content, and a text's tokens tile its bytes in order. So a token's byte span is the running sum
    of its ids' byte lengths (``lengths``: ``(vocab,)`` int64, -2 not yet read, -1 no exact length), and it overlaps a
    ``{% generation %}`` span exactly when the character offsets would say so (a token's characters are those its
    bytes touch), without asking the tokenizer for offsets (``encode_batch_fast``: no ``Encoding.offsets`` lists).

    Taken only where it is exact: :meth:`of` requires no normalizer or NFC (a text that is not NFC goes through the
    offsets), a pre-tokenizer that keeps every character (ByteLevel without a prefix space, Splits that remove
    nothing), a BPE model without dropout, a post-processor that does not trim offsets, and added tokens that strip
    nothing; and every text is checked, cheaply: each of its ids has a length and their sum is its UTF-8 size.
    ``marks`` hands back the texts that fail, for their offsets."""

    def __init__(self, backend, nfc: bool):
        from tokenizers.pre_tokenizers import ByteLevel

        self.backend, self.nfc = backend, nfc
        self.alphabet = frozenset(ByteLevel.alphabet())
        self.lengths = np.full(backend.get_vocab_size(with_added_tokens=True), -2, np.int64)
        self.added = {i: t for i, t in backend.get_added_tokens_decoder().items()}
        unk = backend.model.unk_token
        self.unk = None if unk is None else backend.token_to_id(unk)

    @staticmethod
    def of(backend) -> "ByteSpans | None":
        """The byte spans of ``backend``'s tokens (a ``tokenizers.Tokenizer``), or None where they would not be
        exact (the class docstring's conditions), read from its components' settings (``{}``: none)."""
        model = backend.model
        if not hasattr(backend, "encode_batch_fast") or type(model).__name__ != "BPE" or model.dropout:
            return None
        norm, pre, post = _state(backend.normalizer), _state(backend.pre_tokenizer), _state(backend.post_processor)
        if norm.get("type", "NFC") != "NFC":
            return None
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if not parts or parts[-1].get("type") != "ByteLevel" or parts[-1].get("add_prefix_space"):
            return None
        if any(p.get("type") != "Split" or p.get("behavior") not in _BPE_SPLITS for p in parts[:-1]):
            return None
        posts = post.get("processors", []) if post.get("type") == "Sequence" else [post] if post else []
        if any(p.get("type") not in ("ByteLevel", "TemplateProcessing") or p.get("trim_offsets") for p in posts):
            return None
        key = (id(backend), bool(norm))
        found = _BYTE_SPANS.get(key)
        if found is None or found.backend is not backend:
            found = _BYTE_SPANS[key] = ByteSpans(backend, bool(norm))
            while len(_BYTE_SPANS) > 4:
                del _BYTE_SPANS[next(iter(_BYTE_SPANS))]
        return found

    def length(self, i: int) -> int:
        """UTF-8 bytes of token ``i`` as it stands in a text, or -1 where that is not one number."""
        from_model = self.backend.model.id_to_token(i)
        if i == self.unk:
            return -1
        if from_model is not None and not set(from_model) <= self.alphabet:
            from_model = None
        n = len(from_model) if from_model else -1
        added = self.added.get(i)
        if added is not None:
            if added.lstrip or added.rstrip or not added.content:
                return -1
            size = len(added.content.encode())
            return size if from_model is None or n == size else -1
        return n

    def marks(self, texts, spans, offsets, ids, nfc):
        """``((starts, lengths), slow)``: the flat tokens (``ids (T,)`` int64 over ``offsets (n + 1,)``) that overlap
        each text's ``{% generation %}`` character spans, and the indices of the texts this cannot tell exactly (not
        NFC: ``nfc``, a bool a text; or their tokens do not tile their bytes), left out of the marks."""
        if ids.size and int(ids.max()) >= self.lengths.size:  # ids past the vocabulary read so far: -2, not yet read
            self.lengths = np.concatenate([self.lengths, np.full(int(ids.max()) + 1 - self.lengths.size, -2, np.int64)])
        sizes = self.lengths[ids]
        unread = np.flatnonzero(sizes == -2)
        if unread.size:
            for i in np.unique(ids[unread]).tolist():
                self.lengths[i] = self.length(i)
            sizes = self.lengths[ids]
        bad = sizes < 0
        ends = np.cumsum(np.where(bad, 0, sizes))  # the byte after each token, counted from the batch's first
        at = np.concatenate([[0], ends])[offsets]  # each text's first byte
        bad_before = lengths_to_offsets(bad)[offsets]
        slow, glo, ghi = [], [], []
        for j, (text, marked) in enumerate(zip(texts, spans)):
            ascii_ = text.isascii()
            size = len(text) if ascii_ else len(text.encode())
            if bad_before[j + 1] > bad_before[j] or at[j + 1] - at[j] != size or (self.nfc and not nfc[j]):
                slow.append(j)
                continue
            for lo, hi in marked or ():
                if not ascii_:
                    lo, hi = len(text[:lo].encode()), len(text[:hi].encode())
                glo.append(at[j] + lo)
                ghi.append(at[j] + hi)
        if not glo:
            return ([], []), slow
        # the tokens that overlap [lo, hi): end > lo and start < hi (ends and starts never decrease)
        a = np.searchsorted(ends, glo, side="right")
        b = np.searchsorted(ends - np.where(bad, 0, sizes), ghi, side="left")
        keep = b > a
        return (a[keep].tolist(), (b - a)[keep].tolist()), slow


_BYTE_SPANS: dict = {}  # (id(backend), NFC) -> ByteSpans: the lengths read so far, for the tokenizer's next batch


def _render_one(tok, conv, i, template, tools, extra, add_generation_prompt, assistant_mask):
    """:func:`render` of one conversation, with its own tools and template variables."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = tok.apply_chat_template(conv, chat_template=template, tools=tools, tokenize=True, return_dict=True,
                                          add_generation_prompt=add_generation_prompt,
                                          return_assistant_tokens_mask=assistant_mask, **(extra or {}))
    except Exception as exc:
        raise DataError("{i}: the chat template failed on it: {kind}: {why}", i=Where(i), kind=type(exc).__name__,
                        why=one_line(exc)) from None
    return list(out["input_ids"]), (list(out["assistant_masks"]) if assistant_mask else None)
