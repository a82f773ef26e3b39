"""Where a long text may be cut so that a tokenizer gives the same ids in pieces as whole: one text's working set in a
tokenizer call grows with it (130-200 bytes a character), so :func:`packkit.tokenizer.tokenize` gives a text longer
than :data:`PIECE_CHARS` in pieces (:func:`in_pieces`). :func:`cuts_keep_ids` says for which tokenizers cuts keep the
ids, :func:`text_pieces` where a text is cut. Nothing here knows columns, files or commands.
"""

from __future__ import annotations

import json
import re
import unicodedata

import numpy as np

__all__ = ["PIECE_CHARS", "SPLIT_SAFE_REGEXES", "cuts_keep_ids", "in_pieces", "per_text", "text_pieces"]

#: Pre-tokenizer regexes (a ``Split``, ``Isolated``, before a ``ByteLevel`` without its own regex) under which a text
#: cut before a space that follows a letter, a digit or ASCII punctuation gives the same ids in pieces as whole. No
#: alternative takes such a character and then a space (only a match that starts with whitespace goes on with it),
#: so a piece of the whole text ends before that space; the regex has no look-behind, so the scan from the space is
#: the same in the piece after it, and its one look-ahead (``\s+(?!\S)``) ends a run of whitespace, which no cut
#: ends. GPT-2's (``ByteLevel``'s own) holds the same way. Qwen2/2.5/3's, then Llama 3's (tiktoken's cl100k).
SPLIT_SAFE_REGEXES = tuple(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
                           + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                           for digits in (r"\p{N}", r"\p{N}{1,3}"))

#: Characters of a piece of a longer text (:func:`text_pieces`): one text's working set in a call is 130-200 bytes a
#: character (its normalized string, pre-tokenized pieces and ``Encoding``), about four times a batch of short texts'.
#: Qwen3's tokenizer, a ShareGPT line of 90,215 characters: +14.4 MiB whole, +8.1 in pieces of 64 Ki characters,
#: +3.2 at 16 Ki, +0.7 at 4 Ki; the same CPU time.
PIECE_CHARS = 1 << 12

_CUT = re.compile(r"(?<=[\w!-/:-@\[-`{-~]) ")  # a space after a letter, digit or ASCII punctuation: a cut


def _state(part) -> dict:
    """A tokenizer part's settings as its JSON says them (``{}``: none)."""
    return {} if part is None else json.loads(part.__getstate__())


def cuts_keep_ids(tok) -> bool:
    """Whether a text tokenized by ``tok`` (a ``tokenizers.Tokenizer``) in pieces cut by :func:`text_pieces` gives the
    ids of the whole text: no truncation or padding, no normalizer or NFC alone (a space never composes with what
    is before it, nor is reordered), a ``ByteLevel`` pre-tokenizer with GPT-2's regex or one of
    :data:`SPLIT_SAFE_REGEXES` and no prefix space, a post-processor that adds no token. Added tokens are checked
    text by text (:func:`text_pieces`)."""
    try:
        if tok.truncation is not None or tok.padding is not None:
            return False
        norm, pre, post = _state(tok.normalizer), _state(tok.pre_tokenizer), _state(tok.post_processor)
    except (AttributeError, TypeError, ValueError):  # not a tokenizers.Tokenizer: its settings are not known
        return False
    if norm.get("type", "NFC") != "NFC" or post.get("type", "ByteLevel") != "ByteLevel":
        return False
    byte_level = lambda d, regex: (d.get("type") == "ByteLevel" and not d.get("add_prefix_space")  # noqa: E731
                                   and d.get("use_regex", True) == regex)
    if byte_level(pre, True):
        return True
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    return (len(steps) == 2 and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert") and steps[0].get("pattern", {}).get("Regex") in SPLIT_SAFE_REGEXES
            and byte_level(steps[1], False))


def _last_cut(text: str, lo: int, hi: int) -> int | None:
    """The last ``i`` in ``(lo, hi]`` where ``text[i]`` is a space after a letter, a digit or ASCII punctuation
    (:data:`SPLIT_SAFE_REGEXES`), or None."""
    i = text.rfind(" ", lo + 1, hi + 1)
    while i > lo:
        if _CUT.match(text, i) is not None:  # its look-behind sees text[i - 1]
            return i
        i = text.rfind(" ", lo + 1, i)
    return None


def text_pieces(text: str, limit: int, added=()) -> list:
    """``text`` as consecutive pieces of at most ``limit`` characters where it can be cut (before a space after a
    letter, a digit or ASCII punctuation: :func:`cuts_keep_ids`), each cut the last one that fits; a piece with no
    cut in reach is longer. Whole where an added token (``added``: their texts) occurs in it or in its NFC form (its
    lstrip, rstrip and matching are then the tokenizer's, whole): ``text_pieces("ab cd ef", 5) -> ["ab cd", " ef"]``."""
    if len(text) <= limit or any(a in text for a in added):
        return [text]
    if added and not unicodedata.is_normalized("NFC", text):
        nfc = unicodedata.normalize("NFC", text)
        if any(a in nfc for a in added):
            return [text]
    pieces, lo = [], 0
    while len(text) - lo > limit:
        cut = _last_cut(text, lo, lo + limit)
        if cut is None:  # none in reach: the first one after
            found = _CUT.search(text, lo + limit + 1)
            if found is None:
                break
            cut = found.start()
        pieces.append(text[lo:cut])
        lo = cut
    pieces.append(text[lo:])
    return pieces


def in_pieces(tok, texts: list, longest: int) -> tuple:
    """``(pieces, counts)``: ``texts`` (``longest``: the length of the longest, in characters or more) with each text
    longer than :data:`PIECE_CHARS` cut (:func:`text_pieces`) where ``tok`` keeps the ids (:func:`cuts_keep_ids`), and
    how many pieces each text gave; ``(texts, None)`` where none is cut."""
    if longest <= PIECE_CHARS or not cuts_keep_ids(tok):
        return texts, None
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    split = [text_pieces(t, PIECE_CHARS, added) for t in texts]
    return [p for ps in split for p in ps], np.fromiter(map(len, split), np.int64, len(split))


def per_text(lengths, counts):
    """The token counts of pieces summed back into their texts' (``counts``: pieces a text; None: one each):
    ``per_text([2, 3, 4], [2, 1]) -> [5, 4]``."""
    if counts is None:
        return lengths
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.add.reduceat(np.asarray(lengths, np.int64), starts)
