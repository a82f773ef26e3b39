"""Conversations rendered by a chat template and tokenized a batch at a time, with the assistant mask the template's
``{% generation %}`` spans mark: the machinery behind :mod:`packkit.chat`, which chooses the format, the template
and the loss (this module knows nothing of TRL's formats, columns or options).

The interface: :func:`render` (a batch of conversations -> flat token ids over offsets, and the assistant mask),
:func:`flat` (lists of ids -> offsets and values, through Arrow). An error names the example by its index.
"""

from __future__ import annotations

import bisect
import warnings
from operator import itemgetter

import numpy as np

from .errors import DataError, Where
from .integrations import transformers as hf  # transformers' private chat-template compiler, read in one place
from .segments import lengths_to_offsets, range_index
from .tokenizer import one_line

__all__ = ["flat", "render"]

def flat(lists):
    """``(offsets (n + 1,) int64, values)`` of a list of int lists, through Arrow (no per-token Python)."""
    import pyarrow as pa

    arr = pa.array(lists, type=pa.list_(pa.int64()))
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy()[offsets[0]: offsets[-1]]
    return offsets - offsets[0], values


def render(tok, conversations: list, base: int, *, template: str, tools=None, kwargs=None,
            add_generation_prompt: bool = False, assistant_mask: bool = False):
    """``apply_chat_template`` on a batch, tokenized: ``(offsets (n + 1,) int64, ids (T,) int64, assistant mask
    (T,) int8 or None)``.

    One render and one tokenizer call for the batch (:func:`_render_fast`); per example when a ``tools`` or
    ``chat_template_kwargs`` column gives each its own. An error is re-raised naming the example."""
    if tools is not None or kwargs is not None:
        outs = [_render_one(tok, conv, base + j, template, None if tools is None else tools[j],
                            None if kwargs is None else kwargs[j], add_generation_prompt, assistant_mask)
                for j, conv in enumerate(conversations)]
        offsets, ids = flat([o[0] for o in outs])
        return offsets, ids, (flat([o[1] for o in outs])[1].astype(np.int8) if assistant_mask else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = _render_fast(tok, conversations, template, add_generation_prompt, assistant_mask)
            if fast is not None:
                return fast
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


def _render_fast(tok, conversations, template, add_generation_prompt, assistant_mask):
    """:func:`render`'s batch as ``apply_chat_template`` makes it, without its Python loop over every token for
    the assistant mask (a third of packkit's time on ShareGPT with Qwen3's tokenizer, more than the rendering):
    rendered by transformers' own steps (:func:`packkit.integrations.transformers.render_chat`), tokenized by the
    Rust tokenizer in one ``encode_batch``, each ``{% generation %}`` span marked on the tokens that overlap it,
    found by bisection on the token offsets. None (``apply_chat_template`` then) without a fast tokenizer, or for a
    conversation whose token offsets are not in order (where the bisection would not be transformers' loop)."""
    backend = hf.fast_backend(tok)
    rendered = hf.render_chat(tok, conversations, template=template, add_generation_prompt=add_generation_prompt,
                              assistant_mask=assistant_mask) if backend is not None else None
    if rendered is None:
        return None
    texts, spans = rendered
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    offsets = lengths_to_offsets([len(e) for e in encodings])
    ids = np.concatenate([np.array(e.ids, np.int64) for e in encodings]) if encodings else np.zeros(0, np.int64)
    if not assistant_mask:
        return offsets, ids, None
    starts, lengths = [], []
    for first, e, marked in zip(offsets.tolist(), encodings, spans):
        if not marked:
            continue
        chars = e.offsets
        if chars != sorted(chars) or chars != sorted(chars, key=itemgetter(1)):
            return None
        for lo, hi in marked:  # the tokens that overlap [lo, hi): end > lo and start < hi
            a = bisect.bisect_right(chars, lo, key=itemgetter(1))
            b = bisect.bisect_left(chars, hi, key=itemgetter(0))
            if b > a:
                starts.append(first + a)
                lengths.append(b - a)
    mask = np.zeros(ids.size, np.int8)
    mask[range_index(starts, lengths)] = 1
    return offsets, ids, mask


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
