"""A tokenizer from what a user names, and text to token ids in bounded calls: the back of the house behind the
chat template (:mod:`packkit.chat`) and the door in (:mod:`packkit.datafiles`), knowing nothing of columns, chat
formats or examples. :func:`load_tokenizer` (a ``transformers`` tokenizer), :func:`rust_tokenizer` (the Rust
``tokenizers.Tokenizer`` behind one), :func:`tokenize` (texts -> a list array of ids), :func:`tokenizer_name`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
import warnings
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from .allocators import release_freed
from .arrow import byte_tokenize, list_array, pyarrow
from .errors import ArgumentError, DataError, Where, arg
from .pretokens import _state, in_pieces, per_text
from .progress import progress_bar
from .segments import lengths_to_offsets

__all__ = ["TOKENIZE_CALL_CHARS", "bad_utf8", "fast_copy", "load_tokenizer", "one_line", "release_freed",
           "rust_tokenizer", "text_calls", "tokenize", "tokenizer_name"]

#: Seconds to wait for the Hub's host before calling a model id unreachable.
HUB_PROBE_TIMEOUT = 5.0

#: A folder holding one of these is a tokenizer folder (what ``save_pretrained`` writes).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """One connection attempt to the Hub's host (``HF_ENDPOINT``), bounded by ``timeout`` seconds
    including the name lookup: no retries, so an offline machine learns it at once."""
    import socket  # here, not at start: packkit waste and plan read chat options but never probe the Hub

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    reached = []

    def attempt():
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=timeout).close()
            reached.append(True)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(timeout)
    return bool(reached)


def one_line(exc: BaseException) -> str:
    """An error's text on one line of at most 300 characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def bad_utf8(raw: bytes) -> tuple | None:
    """``(line, bytes, reason)`` of the first bytes of ``raw`` that are not UTF-8, or None:
    ``bad_utf8(b"a\\n\\xff") -> (2, b"\\xff", "invalid start byte")``."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return raw.count(b"\n", 0, exc.start) + 1, raw[exc.start:exc.end], exc.reason
    return None


def _not_utf8(folder) -> tuple | None:
    """``(path, line, bytes)`` of the first text file of a tokenizer folder (``.json``, ``.jinja``, ``.txt``) that is
    not UTF-8, or None. The error path only."""
    files = sorted(Path(folder).iterdir()) if os.path.isdir(folder) else []
    for path in files:
        bad = bad_utf8(path.read_bytes()) if path.suffix in (".json", ".jinja", ".txt") and path.is_file() else None
        if bad is not None:
            return str(path), bad[0], bad[1]
    return None


def load_tokenizer(spec, *, trust_remote_code: bool = False):
    """A ``transformers`` tokenizer from a folder, a ``tokenizer.json``, a model id, or as given.

    Args:
        spec: a folder holding ``tokenizer.json`` / ``tokenizer_config.json`` (what ``save_pretrained`` writes), the
            path of a ``tokenizer.json`` (it has no chat template: pass one to :func:`tokenize_chat`), a
            Hub model id (``"org/name"``), or a loaded tokenizer (returned as is).
        trust_remote_code: run the tokenizer's own Python code when its config asks for it (``auto_map``). Off by
            default: such a tokenizer is then an error that names the flag.
    Returns:
        A ``transformers.PreTrainedTokenizerBase``.
    Raises:
        :class:`~packkit.errors.ArgumentError` in one line naming ``spec`` and the fix: no such folder or file, a
        model id neither in the local cache nor reachable (one connection attempt; ``HF_HUB_OFFLINE=1`` skips it), a
        repository that is missing or gated, remote code refused.
    """
    if not isinstance(spec, (str, os.PathLike)):
        if hasattr(spec, "apply_chat_template"):
            return spec
        raise TypeError(f"tokenizer must be a folder, a tokenizer.json, a model id or a transformers tokenizer, "
                        f"got {type(spec).__name__}")
    try:
        import transformers
    except ImportError:
        raise ModuleNotFoundError("a chat template needs transformers: pip install 'packkit[chat]'",
                                  name="transformers") from None
    text = str(spec)
    path = Path(text).expanduser()
    fix = "pass a tokenizer folder (save_pretrained), a tokenizer.json, or a model id"
    tok_arg = arg("tokenizer")
    if path.is_file():
        if path.suffix != ".json":
            raise ArgumentError("{arg} {text!r} is a file but not a tokenizer.json: {fix}", arg=tok_arg, text=text,
                                fix=fix)
        try:
            # no name while it is built: transformers takes a name for a Hub id when the vocabulary passes 100,000
            # (its Mistral regex check), which fails on a path under HF_HUB_OFFLINE=1 ("Repo id must be ...")
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), name_or_path=None)
        except Exception as exc:  # tokenizers raises its own exception type
            raise ArgumentError("could not read {arg} {text!r}: {why}", arg=tok_arg, text=text,
                                why=one_line(exc)) from None
        tok.name_or_path = text  # named by its file, as errors about it name it once it is loaded
        return tok
    if path.is_dir():
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ArgumentError("{arg} folder {text!r} holds no tokenizer (no tokenizer.json or "
                                "tokenizer_config.json): pass the folder that save_pretrained wrote, or a model id",
                                arg=tok_arg, text=text)
        return _from_pretrained(transformers, str(path), text, trust_remote_code, local=True)
    if (text.startswith((".", "/", "~")) or text.endswith(".json") or text.count("/") > 1
            or not _REPO_ID_RE.match(text)):  # a path, not a model id
        raise ArgumentError("{arg} {text!r} not found: no such folder or file; {fix}", arg=tok_arg, text=text, fix=fix)
    from huggingface_hub import constants

    why = None  # why a model id is read from the local cache only
    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set and it is not in the local cache"
    elif not _hub_reachable():
        why = f"{constants.ENDPOINT} cannot be reached and it is not in the local cache"
    return _from_pretrained(transformers, text, text, trust_remote_code, local=why is not None, why=why)


def _from_pretrained(transformers, where: str, spec: str, trust_remote_code: bool, *, local: bool,
                     why: str | None = None):
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    try:
        disable_progress_bars()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code,
                                                              local_files_only=local)
    except Exception as exc:  # a broken tokenizer file, a template syntax error, ...: one line naming the fix
        raise _load_error(exc, where, spec, local=local, why=why) from None
    finally:
        enable_progress_bars()


def _load_error(exc: Exception, where: str, spec: str, *, local: bool, why: str | None) -> ArgumentError:
    """What :func:`_from_pretrained` says when ``from_pretrained`` raised ``exc`` (``why``: a Hub id that is
    not in the cache and cannot be downloaded)."""
    text, fields = str(exc), {"arg": arg("tokenizer"), "spec": spec}
    bad = _not_utf8(where) if isinstance(exc, UnicodeDecodeError) else None  # a chat_template.jinja saved as Latin-1
    if bad is not None:
        return ArgumentError("could not load {arg} {spec!r}: {file!r} is not UTF-8 text: line {line:,} holds {b!r}; "
                             "save it as UTF-8", file=bad[0], line=bad[1], b=bad[2], **fields)
    if isinstance(exc, ValueError) and "trust_remote_code" in text:
        return ArgumentError("{arg} {spec!r} runs its own Python code (auto_map in tokenizer_config.json); read it, "
                             "then pass {trust} to allow it", trust=arg("trust_remote_code", True), **fields)
    if isinstance(exc, OSError) and why is not None:
        return ArgumentError("{arg} {spec!r} cannot be loaded: {why}; pass a local tokenizer folder, or download it "
                             "once online (hf download NAME)", why=why, **fields)
    if isinstance(exc, OSError) and not local and ("not a valid model identifier" in text or "404" in text
                                                   or "401" in text or "gated" in text.lower()):
        return ArgumentError("{arg} {spec!r} is not a model on the Hub you can read (missing, private or gated): "
                             "check the id, or log in (hf auth login), or pass a local folder", **fields)
    kind = "" if isinstance(exc, (ValueError, OSError)) else type(exc).__name__ + ": "
    return ArgumentError("could not load {arg} {spec!r}: {kind}{why}", kind=kind, why=one_line(exc), **fields)


def rust_tokenizer(spec, *, trust_remote_code: bool = False):
    """``"bytes"`` -> None (byte level); a ``tokenizer.json`` path (or a folder holding one) -> tokenizer; anything
    else (a model id, a folder without ``tokenizer.json``) -> the Rust tokenizer behind :func:`load_tokenizer`'s
    (which runs a tokenizer's own code only under ``trust_remote_code``)."""
    if spec is None or spec == "bytes":
        return None
    if hasattr(spec, "encode_batch") and not isinstance(spec, (str, os.PathLike)):  # loaded already
        return spec
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        tok = load_tokenizer(spec, trust_remote_code=trust_remote_code)
        if getattr(tok, "backend_tokenizer", None) is None:
            raise ValueError(f"tokenizer {str(spec)!r} has no tokenizer.json (not a fast tokenizer): pass a "
                             "tokenizer.json, or 'bytes'")
        return tok.backend_tokenizer
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModuleNotFoundError("a tokenizer.json needs the 'tokenizers' package: pip install tokenizers",
                                  name="tokenizers") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own exception type
        raise ValueError(f"could not read tokenizer {str(path)!r}: {exc}") from None


#: Words a :func:`fast_copy`'s BPE remembers: 45,624 distinct words in 1,000 ShareGPT conversations, ~150 bytes each.
CACHE_WORDS = 1 << 18

#: Words ``tokenizers``' BPE remembers (``DEFAULT_CACHE_CAPACITY``): every tokenizer read from a file has it.
TOKENIZERS_CACHE_WORDS = 10_000

#: Text bytes per vocabulary entry from which :func:`fast_copy`'s larger cache pays for the user's cache it empties
#: (Qwen3's, 151,669 entries: it saved ~1.2 s on 1,000 ShareGPT conversations, 7.0 M characters rendered).
COPY_BYTES_PER_TOKEN = 32


@contextlib.contextmanager
def fast_copy(backend):
    """Yields ``(copy, bare)``: the Rust tokenizer ``backend``, or one around its own model, that gives the same ids
    for less CPU over a long run of texts. For the block its BPE remembers :data:`CACHE_WORDS` words (the original's
    cache is full after 10,000 and every other word is merged again at each occurrence), and where ``backend``'s
    normalizer is NFC alone the copy has none (``bare``): give it only texts that are NFC
    (``unicodedata.is_normalized("NFC", text)``), which NFC leaves as they are, the others to ``backend``.

    The model is not copied (through the JSON, Qwen3's took 0.5-0.6 s CPU and +91 MiB): ``backend`` shares the block's
    cache, emptied, and has :data:`TOKENIZERS_CACHE_WORDS` after it, emptied. The ids never depend on it; its size
    cannot be read (no getter; ``repr``, ``to_str``, pickle leave it out). Threads encoding meanwhile wait on the
    model's lock while it is resized, and get the same ids."""
    model = backend.model
    bpe = type(model).__name__ == "BPE" and hasattr(model, "_resize_cache")
    if bpe:
        model._resize_cache(CACHE_WORDS)
    try:
        yield _copy(backend)
    finally:
        if bpe:
            model._resize_cache(TOKENIZERS_CACHE_WORDS)


def _copy(backend) -> tuple:
    """:func:`fast_copy`'s ``(copy, bare)``: ``backend`` where its normalizer is not NFC alone, or where a copy
    around its model would differ: its added tokens (ids and every setting), truncation or padding."""
    from tokenizers import Tokenizer

    if _state(backend.normalizer).get("type") != "NFC" or backend.truncation or backend.padding:
        return backend, False
    copy = Tokenizer(backend.model)  # the same Rust model (vocabulary, merges, cache), not a copy of it
    copy.pre_tokenizer, copy.post_processor = backend.pre_tokenizer, backend.post_processor
    added = backend.get_added_tokens_decoder()
    for i in sorted(added):  # in id order: each comes out with the next id, as it was given
        (copy.add_special_tokens if added[i].special else copy.add_tokens)([added[i]])
    copy.encode_special_tokens = backend.encode_special_tokens
    same = [{i: repr(t) for i, t in tok.get_added_tokens_decoder().items()} for tok in (copy, backend)]
    return (copy, True) if same[0] == same[1] else (backend, False)  # repr: every setting (== reads the content)


def tokenizer_name(tokenizer) -> str:
    """How a message names a tokenizer: the last part of its path or model id (``"models/qwen3/" -> "qwen3"``), or a
    loaded one's ``name_or_path``."""
    name = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else getattr(tokenizer, "name_or_path", "?")
    return os.path.basename(str(name).rstrip("/")) or str(name)


#: Characters of text a tokenizer is given in one call of :func:`tokenize`, whose working set (``Encoding``\s) peaks:
#: Qwen3's, ShareGPT text, 2.0 MiB at 64 Ki characters (38x its tokens), 8 at 256 Ki, 77 at 4 Mi; the same CPU time.
TOKENIZE_CALL_CHARS = 1 << 16


def text_calls(sizes, limit: int) -> list:
    """``(lo, hi)`` ranges of consecutive texts of ``sizes`` (characters or bytes) holding at most ``limit`` of them
    together, a longer text alone: ``text_calls([2, 1, 4, 1], 3) -> [(0, 2), (2, 3), (3, 4)]``."""
    ends = np.cumsum(np.asarray(sizes, np.int64))
    out, lo = [], 0
    while lo < ends.size:
        start = ends[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, start + limit, side="right")))
        out.append((lo, hi))
        lo = hi
    return out


def tokenize(texts, tokenizer="bytes", *, progress: bool = False, trust_remote_code: bool = False, first_row: int = 0):
    """Token ids of ``texts`` (a pyarrow string array, or a list of str) as a pyarrow ``ListArray`` of int32 (a
    ``LargeListArray`` past 2**31 - 1 tokens, :func:`list_array`). ``tokenizer``: ``"bytes"`` (byte level), a local
    ``tokenizer.json`` (or its folder), a model id (:func:`load_tokenizer`: no remote code unless
    ``trust_remote_code``), or a loaded ``tokenizers.Tokenizer``, at most :data:`TOKENIZE_CALL_CHARS` characters a call
    (a longer text cut where its ids stay, :func:`packkit.pretokens.in_pieces`, else alone): memory holds the texts,
    their ids and one call's working set, whatever the texts."""
    pa = pyarrow()
    if isinstance(texts, (pa.Array, pa.ChunkedArray)) and texts.null_count:  # first_row: the row of texts[0]
        raise DataError("{i} has no text (null)", i=Where(first_row + texts.to_pylist().index(None)))
    tok = rust_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
    if tok is None:
        return byte_tokenize(texts)
    if isinstance(texts, (pa.Array, pa.ChunkedArray)):
        import pyarrow.compute as pc

        sizes = pc.binary_length(texts).to_numpy()  # UTF-8 bytes: at least the characters
        take = lambda lo, hi: texts.slice(lo, hi - lo).to_pylist()  # noqa: E731 - a call's texts as str only
    else:
        sizes = np.fromiter(map(len, texts), np.int64, len(texts))
        take = lambda lo, hi: texts[lo: hi]  # noqa: E731
    lengths, ids = [], []
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: 7M tokens in 12.9 s CPU, not 14.1
    with progress_bar(total=len(sizes), unit="ex", enabled=progress, desc="tokenize") as bar:
        for lo, hi in text_calls(sizes, TOKENIZE_CALL_CHARS):
            batch, counts = in_pieces(tok, take(lo, hi), sizes[lo:hi].max())  # long texts cut, where ids stay
            n = []
            for a, b in text_calls(list(map(len, batch)), TOKENIZE_CALL_CHARS):  # the pieces in calls as the texts
                per = [e.ids for e in encode(batch[a:b])]  # the call's Encodings go here, its working set with them
                n.append(np.fromiter(map(len, per), np.int64, len(per)))
                ids.append(np.fromiter(itertools.chain.from_iterable(per), np.int32, int(n[-1].sum())))
            lengths.append(per_text(np.concatenate(n), counts))
            bar.update(hi - lo)
    offsets = lengths_to_offsets(np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
    return list_array(offsets, np.concatenate(ids) if ids else np.zeros(0, np.int32))
