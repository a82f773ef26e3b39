"""Conversational data through a chat template: token ids and the loss mask TRL would train with.

TRL's dataset formats (``SFTTrainer``), recognised by their columns:

====================================== ======================================================= ==================
format                                 columns                                                 loss mask
====================================== ======================================================= ==================
``messages``                           ``messages``: list of ``{role, content}``               ``assistant_masks``
``conversations`` (ShareGPT)           ``conversations``: list of ``{from, value}``            ``assistant_masks``
``prompt_completion``                  ``prompt``, ``completion``: strings                     ``completion_mask``
``conversational_prompt_completion``   ``prompt``, ``completion``: lists of ``{role, content}`` ``completion_mask``
====================================== ======================================================= ==================

:func:`tokenize_chat` turns such a table into Arrow columns ``input_ids`` (list<int32>) and one loss mask
(list<int8>, 1 = the token carries the loss), as TRL 1.16 tokenizes each format:

* a conversation is rendered by the chat template and tokenized with no added special tokens; ``assistant_masks``
  mark the tokens that overlap the template's ``{% generation %}`` spans. A template without those markers is an
  error that says what to do (TRL swaps in its training template for the models it knows,
  :func:`training_template`, and so does this module when TRL is installed);
* prompt/completion pairs are tokenized twice, the prompt alone (conversational: with the generation prompt) and
  prompt + completion; ``completion_mask`` is 0 on the two token sequences' common prefix and 1 after it
  (:func:`packkit.segments.common_prefix_lengths`). String completions get the EOS appended unless they end with it.

TRL's ``assistant_only_loss`` (default: on for conversations, off for prompt/completion pairs) and
``completion_only_loss`` (default on) become one mask column (the packers and ``packkit plan`` read one): their
product, as ``completion_mask``, when both apply; none when neither does (every token carries the loss). Rendering
and tokenizing, a batch at a time, with the masks as numpy over Arrow offsets: :mod:`packkit.chatrender`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np

from .allocators import c_getenv
from .arrow import chunked_lists, list_array
from .choices import CHAT_FORMATS  # the conversational formats chat_format recognises (module docstring)
from .chatoptions import ChatOptions  # its home is packkit.chatoptions, off the start of plan and pack
from .errors import ArgumentError, DataError, Message, Where, arg, check_int
from .integrations import transformers as hf  # transformers' private chat-template compiler, read in one place
from .integrations.trl import training_template  # TRL's training templates, read in one place
from .progress import progress_bar
from .chatrender import flat, render
from .segments import common_prefix_lengths, lengths_to_offsets, mask_from
from .tokenizer import COPY_BYTES_PER_TOKEN, bad_utf8, fast_copy, load_tokenizer
from .workers import encode_rows

__all__ = ["CHAT_FORMATS", "ChatWarning", "chat_encoder", "ChatOptions", "chat_format", "check_special_tokens",
           "ignored_columns", "has_generation_markers", "load_tokenizer", "tokenize_dataset", "tokenize_chat",
           "training_template"]

#: The keys of a message in each conversation column (ShareGPT's renamed to role and content, as TRL does).
_MESSAGE_KEYS = {"messages": ("role", "content"), "conversations": ("from", "value")}

#: Conversations rendered and tokenized per call.
BATCH_SIZE = 512

#: :func:`tokenize_dataset` shows a progress bar by default from this many examples on.
PROGRESS_EXAMPLES = 10_000

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatWarning(UserWarning):
    """Something about a chat template or its output a user should know (the data is still tokenized). Its text may
    be a :class:`~packkit.errors.Message`, rendered by the command line with its options (``--format messages``)."""


def has_generation_markers(template) -> bool:
    """Whether a chat template (of named variants, a dict: its ``"default"``) marks assistant replies with
    ``{% generation %}`` (any trim variant): ``has_generation_markers("{% generation %}{{ m }}{% endgeneration %}")
    -> True``."""
    if isinstance(template, dict):
        template = template.get("default", "")
    return bool(template) and _GENERATION_RE.search(template) is not None


def _is_message_list(typ, keys=_MESSAGE_KEYS["messages"]) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
        return False
    v = typ.value_type
    return pa.types.is_struct(v) and all(v.get_field_index(k) >= 0 for k in keys)


def _columns(fmt: str) -> list:
    """The columns ``fmt`` reads: ``_columns("prompt_completion") -> ["prompt", "completion"]``."""
    return [fmt] if fmt in _MESSAGE_KEYS else ["prompt", "completion"]


def _not_messages(schema, name: str) -> DataError:
    return DataError(f"column {name!r} holds {schema.field(name).type}, not a list of "
                     "{" + ", ".join(_MESSAGE_KEYS[name]) + "} messages (TRL's conversational format)")


def chat_format(schema, *, format: str | None = None) -> str | None:
    """Which of :data:`CHAT_FORMATS` a table holds, from its schema (a ``pyarrow.Schema``, a table, or
    ``datasets.Features``), or None (token ids, text, or something else); with ``input_ids`` it is already tokenized
    (None), as TRL treats it. Rows holding both ``prompt`` + ``completion`` and ``messages`` (or ``conversations``) are
    read as prompt/completion, as TRL 1.16's ``SFTTrainer`` does (``"prompt" in example`` decides first); ``format``
    (one of :data:`CHAT_FORMATS`, or ``"auto"``/None) chooses instead, and must fit the columns."""
    if hasattr(schema, "arrow_schema"):  # datasets.Features
        schema = schema.arrow_schema
    elif hasattr(schema, "schema"):  # a pyarrow table
        schema = schema.schema
    names = schema.names
    if "input_ids" in names:
        return None
    if format not in (None, "auto"):
        return _chosen_format(schema, format)
    if "prompt" in names and "completion" in names:
        return _pair_format(schema)
    present = [name for name in _MESSAGE_KEYS if name in names]
    for name in present:
        if _is_message_list(schema.field(name).type, _MESSAGE_KEYS[name]):
            return name
    if present:
        raise _not_messages(schema, present[0])
    return None


def _pair_format(schema) -> str:
    """``prompt_completion`` or ``conversational_prompt_completion`` from the two columns' types."""
    import pyarrow as pa

    p, c = schema.field("prompt").type, schema.field("completion").type
    if all(pa.types.is_string(t) or pa.types.is_large_string(t) for t in (p, c)):
        return "prompt_completion"
    if _is_message_list(p) and _is_message_list(c):
        return "conversational_prompt_completion"
    raise DataError(f"columns 'prompt' ({p}) and 'completion' ({c}) must both be text or both be lists of "
                    "{role, content} messages (TRL's prompt/completion formats)")


def _chosen_format(schema, format: str) -> str:
    """``format`` when the columns hold it, else the one-line error naming the columns."""
    if format not in CHAT_FORMATS:
        raise ArgumentError("unknown chat format {got!r}; pass {fix}", got=format,
                            fix=arg("format", "auto", *CHAT_FORMATS))
    missing = [c for c in _columns(format) if c not in schema.names]
    if missing:
        raise ArgumentError("{fmt} needs the column(s) {missing}; the columns are {names}", fmt=arg("format", format),
                            missing=missing, names=list(schema.names))
    if format.endswith("prompt_completion"):
        got = _pair_format(schema)
        if got != format:
            raise ArgumentError("{fmt}: the prompt/completion columns hold {got}; pass {fix}",
                                fmt=arg("format", format), got=got, fix=arg("format", got))
    elif not _is_message_list(schema.field(format).type, _MESSAGE_KEYS[format]):
        raise _not_messages(schema, format)
    return format


def ignored_columns(schema, fmt: str) -> list:
    """The conversational columns a table holds besides those ``fmt`` reads (mixed rows): said in one line."""
    names = schema.names
    return [c for c in ("messages", "conversations", "prompt", "completion") if c in names and c not in _columns(fmt)
            and not (c in ("prompt", "completion") and not {"prompt", "completion"} <= set(names))]


def _is_path(template) -> bool:
    """Whether a ``chat_template`` given names a file (not Jinja text, named variants, or None)."""
    return isinstance(template, (str, os.PathLike)) and "{%" not in str(template) and "{{" not in str(template)


def _read_template(template) -> str | None:
    """A chat template given as Jinja text or as the path of a file holding it."""
    if template is None or isinstance(template, dict):
        return template
    if not isinstance(template, (str, os.PathLike)):
        raise TypeError(f"chat_template must be Jinja text or a file path, got {type(template).__name__}")
    text = str(template)
    if not _is_path(text):
        return text
    path = Path(text)
    if path.is_dir():
        path = path / "chat_template.jinja"
    if not path.is_file():
        raise ArgumentError("{arg} {text!r} is neither a file nor Jinja text: pass a .jinja file (or a folder "
                            "holding chat_template.jinja)", arg=arg("chat_template"), text=text)
    raw = path.read_bytes()
    bad = bad_utf8(raw)
    if bad is not None:
        raise ArgumentError("{arg} {path!r} is not UTF-8 text: line {line:,} holds {bad!r} ({why}); save it as UTF-8",
                            arg=arg("chat_template"), path=str(path), line=bad[0], bad=bad[1], why=bad[2])
    return raw.decode("utf-8")


def check_template_syntax(template: str, what: str) -> None:
    """Compile ``template`` as ``apply_chat_template`` will (transformers' Jinja, ``{% generation %}`` tag included):
    a syntax error is the one-line error naming ``what`` and the template's line, before any example is rendered."""
    try:
        from jinja2 import TemplateSyntaxError
    except ImportError:  # no jinja2: the first render says it
        return
    compile_ = hf.jinja_compiler()
    if compile_ is None:  # an older transformers: the first render says it
        return
    try:
        compile_(template)
    except TemplateSyntaxError as exc:
        raise ArgumentError("{what}, line {line}: Jinja syntax error: {msg}; fix the template or pass {tpl}", what=what,
                            line=exc.lineno, msg=str(exc.message).rstrip("."),
                            tpl=arg("chat_template", metavar="FILE.jinja")) from None


def stop_token_trained(tok, template: str) -> bool:
    """Whether an assistant reply's end-of-turn token carries the loss under ``template``'s assistant mask.

    Renders user, assistant, user (templates put the end-of-turn token before a turn) and looks at the last masked
    token that is not blank: it must be an added token (``<|im_end|>``, ...), not text. TRL 1.16 makes the same check
    and warns. True when the probe cannot be rendered (a template with other requirements): nothing to report."""
    probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"},
             {"role": "user", "content": "ping"}]
    try:  # rendered and masked as the rows will be
        _, ids, mask = render(tok, [probe], 0, template=template, assistant_mask=True)
    except Exception:  # noqa: BLE001 - any template error means the probe says nothing
        return True
    added = set(tok.get_added_vocab().values()) - {tok.unk_token_id}  # the probe's words may be unknown
    shown = [t for t, m in zip(ids.tolist(), mask.tolist()) if m and tok.decode([t]).strip()]
    return bool(shown) and shown[-1] in added


def _template_for(tok, spec_name: str, chat_template, need_markers: bool) -> tuple[str, str]:
    """``(template, what)``: the template to render with (``chat_template`` or the tokenizer's, swapped for TRL's
    training version when assistant masks need markers and TRL knows it), checked for what is asked, and where
    it came from in words (the file passed, else the tokenizer), for errors and summaries."""
    given = _read_template(chat_template)
    if given is None:
        what = f"the chat template of {spec_name!r}"
    else:
        what = f"the chat template {str(chat_template)!r}" if _is_path(chat_template) else "the chat template given"
    template = given if given is not None else tok.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ArgumentError("{tok} {name!r} has no chat template: pass {tpl}, or a tokenizer folder or model id that "
                            "has one", tok=arg("tokenizer"), name=spec_name,
                            tpl=arg("chat_template", metavar="FILE.jinja"))
    check_template_syntax(template, what)
    if need_markers and not has_generation_markers(template):
        swapped = training_template(tok, given)
        if swapped and has_generation_markers(swapped):
            return swapped, f"TRL's training version of {what}"
        raise ArgumentError(
            "{what} has no {{% generation %}} markers, so assistant tokens cannot be told from the rest: pass {tpl} "
            "that wraps each assistant reply in {{% generation %}}...{{% endgeneration %}} (TRL ships such templates "
            "for common models), or {all} to put the loss on every token", what=what,
            tpl=arg("chat_template", metavar="FILE.jinja"), all=arg("assistant_only_loss", False))
    return template, what


def _messages(value, i: int, name: str, keys=_MESSAGE_KEYS["messages"]) -> list:
    if value is None:
        raise DataError("{i} has no {name!r} (null); drop or fill it", i=Where(i), name=name)
    if not value:
        raise DataError("{i} has an empty {name!r} conversation; every example needs a message", i=Where(i), name=name)
    out = []
    for m in value:
        if m is None or m.get(keys[0]) is None:
            raise DataError("{i}: a message in {name!r} has no {key!r}", i=Where(i), name=name, key=keys[0])
        if keys[0] == "from":  # ShareGPT keys, renamed as TRL does (roles are kept as written)
            m = {("role" if k == "from" else "content" if k == "value" else k): v for k, v in m.items()}
        out.append(m)
    return out


def _resolve_loss(fmt: str, assistant_only_loss, completion_only_loss) -> tuple[bool, bool]:
    """``(assistant, completion)``: the loss options for ``fmt`` (None: the default), or the one-line error for
    an option the format cannot honour (it would be ignored)."""
    paired = fmt.endswith("prompt_completion")
    assistant = (not paired) if assistant_only_loss is None else bool(assistant_only_loss)
    if assistant and fmt == "prompt_completion":  # strings: no assistant turns
        raise ArgumentError("{arg} needs conversational data (messages); prompt/completion strings have no "
                            "assistant turns: drop it and keep {keep} (the default)", arg=arg("assistant_only_loss"),
                            keep=arg("completion_only_loss"))
    if completion_only_loss is not None and not paired:
        raise ArgumentError("{arg} applies to prompt/completion data; {fmt} rows have no completion (it would be "
                            "ignored): drop it, and pass {all} for the loss on every token", fmt=fmt,
                            arg=arg("completion_only_loss", bool(completion_only_loss)),
                            all=arg("assistant_only_loss", False))
    return assistant, (completion_only_loss is None or bool(completion_only_loss)) and paired


def check_special_tokens(tok, fmt: str, template: str | None, name: str) -> None:
    """Refuse, in one line, a tokenizer that lacks a token this data needs (a bare ``tokenizer.json`` defines
    neither EOS nor BOS): prompt/completion strings get the EOS appended, as TRL does, or the model never
    learns to stop; a template that writes ``bos_token`` (or ``eos_token``) would render it empty."""
    fix = ("pass the tokenizer's folder (its tokenizer_config.json names the special tokens), or a model id")
    if fmt == "prompt_completion" and not tok.eos_token:
        raise ArgumentError("{arg} {name!r} defines no EOS token (a bare tokenizer.json?): TRL appends it to every "
                            "completion, without it the model never learns to stop; " + fix, arg=arg("tokenizer"),
                            name=name)
    for special in ("bos_token", "eos_token"):
        if template and re.search(r"\b" + special + r"\b", template) and not getattr(tok, special, None):
            raise ArgumentError("{arg} {name!r} defines no {special}, and its chat template writes it (it would render "
                                "empty); " + fix, arg=arg("tokenizer"), name=name,
                                special=special.replace("_token", "").upper())


class _Encoder:
    """One tokenizer, template and loss choice, applied to Arrow batches of one conversational format."""

    def __init__(self, fmt: str, tokenizer, options: ChatOptions):
        self.fmt, self.num_proc = fmt, options.num_proc
        chat_template = options.chat_template
        self.assistant, self.completion = _resolve_loss(fmt, options.assistant_only_loss, options.completion_only_loss)
        name = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else getattr(tokenizer, "name_or_path", "?")
        if fmt == "prompt_completion" and chat_template is not None:
            raise ArgumentError("{arg} is not used on prompt/completion strings: TRL tokenizes them as text, with no "
                                "chat template (it would be ignored); drop it, or give the prompt and completion as "
                                "lists of {{role, content}} messages", arg=arg("chat_template"))
        self.tok = load_tokenizer(tokenizer, trust_remote_code=options.trust_remote_code)
        self.template, self.template_words, self.swapped = None, None, False
        if fmt != "prompt_completion":
            self.template, self.template_words = _template_for(self.tok, str(name), chat_template, self.assistant)
            self.swapped = self.template_words.startswith("TRL's")
        self.template_file = str(chat_template) if _is_path(chat_template) else None
        if self.assistant and not getattr(self.tok, "is_fast", False):
            raise ArgumentError("{arg} {name!r} is not a fast (Rust) tokenizer: assistant masks need its token "
                                "offsets; pass a folder with tokenizer.json", arg=arg("tokenizer"), name=str(name))
        if self.assistant and not stop_token_trained(self.tok, self.template):
            warnings.warn(f"{self.template_words} leaves an assistant reply's end-of-turn token outside "
                          "{% generation %}...{% endgeneration %}: the model is never trained to stop (the loss "
                          "looks fine; it shows at inference); move the token inside the markers",
                          ChatWarning, stacklevel=4)  # past chat_encoder and its caller in packkit
        check_special_tokens(self.tok, fmt, self.template, str(name))
        self.mask_name = "completion_mask" if self.completion else "assistant_masks" if self.assistant else None
        self.columns = _columns(fmt)
        self.diverged = 0
        self.fast = None  # fast_copy of the Rust tokenizer, from the first long table encode_table runs

    def encode(self, table, base: int):
        """``(input_ids, mask or None)``: pyarrow list arrays (int32, int8) of ``table``'s rows, the first
        of which is example ``base`` (for errors)."""
        wanted = self.columns + [c for c in ("tools", "chat_template_kwargs") if c in table.column_names]
        rows = table.select(wanted).to_pydict()
        offsets, values, mask = self._tokens(rows, base)
        if self.assistant:  # every example must hold an assistant token (TRL raises too)
            csum = lengths_to_offsets(mask)  # mask tokens before each flat index
            none = np.flatnonzero(csum[offsets[1:]] == csum[offsets[:-1]])
            if none.size:
                raise DataError("{i} has no assistant token in its rendered conversation (no assistant message, or "
                                "the template's {{% generation %}} markers do not cover it): drop the example, or "
                                "pass {all}", i=Where(base + int(none[0])), all=arg("assistant_only_loss", False))
        ids = list_array(offsets, values.astype(np.int32))
        return ids, (None if mask is None else list_array(offsets, mask))  # mask: int8

    def _tokens(self, rows: dict, base: int) -> tuple:
        """``(offsets (n + 1,) int64, ids (T,) int64, mask (T,) int8 or None)`` of one batch (``rows``: column -> list,
        as ``datasets`` batches), adding to :attr:`diverged` the pairs whose tokenized prompt is not a prefix of the
        whole."""
        tok, fmt, template, fast = self.tok, self.fmt, self.template, self.fast
        tools = rows.get("tools")
        if tools is not None:
            tools = [json.loads(t) if isinstance(t, str) else t for t in tools]
        kwargs = rows.get("chat_template_kwargs")
        if fmt in _MESSAGE_KEYS:
            convs = [_messages(v, base + j, fmt, _MESSAGE_KEYS[fmt]) for j, v in enumerate(rows[fmt])]
            return render(tok, convs, base, template=template, tools=tools, kwargs=kwargs,
                          assistant_mask=self.assistant, fast=fast)
        prompts, completions = rows["prompt"], rows["completion"]
        for j, (p, c) in enumerate(zip(prompts, completions)):
            if p is None or c is None:
                raise DataError("{i} has no {key!r} (null)", i=Where(base + j),
                                key="prompt" if p is None else "completion")
        amask = None
        if fmt == "prompt_completion":
            if tok.eos_token:
                completions = [c if c.endswith(tok.eos_token) else c + tok.eos_token for c in completions]
            p_off, p_val = flat(tok(list(prompts), add_special_tokens=True)["input_ids"])
            whole = [p + c for p, c in zip(prompts, completions)]
            offsets, values = flat(tok(whole, add_special_tokens=True)["input_ids"])
        else:
            convs_p = [_messages(v, base + j, "prompt") for j, v in enumerate(prompts)]
            convs_c = [_messages(v, base + j, "completion") for j, v in enumerate(completions)]
            p_off, p_val, _ = render(tok, convs_p, base, template=template, tools=tools, kwargs=kwargs,
                                     add_generation_prompt=True, fast=fast)
            offsets, values, amask = render(tok, [p + c for p, c in zip(convs_p, convs_c)], base, template=template,
                                            tools=tools, kwargs=kwargs, assistant_mask=self.assistant, fast=fast)
        prefix = common_prefix_lengths(p_off, p_val, offsets, values)
        self.diverged += int(np.count_nonzero(prefix < np.diff(p_off)))
        mask = mask_from(offsets, prefix) if self.completion else None
        if amask is not None:
            mask = amask if mask is None else mask & amask
        return offsets, values, mask

    def encode_table(self, table, base: int, *, batch_size: int = BATCH_SIZE, progress: bool = False):
        """``table``'s rows (the first is example ``base``) as :func:`tokenize_chat`'s table, ``batch_size``
        conversations per tokenizer call, in the options' ``num_proc`` processes."""
        import pyarrow as pa

        check_int(batch_size, "batch_size")
        num_proc = worker_processes(self.num_proc or 1)
        with self._fast(table) as self.fast, progress_bar(total=table.num_rows, unit="ex", enabled=progress,
                                                          desc="chat template") as bar:
            ids_chunks, mask_chunks = encode_rows(self, table, base, batch_size, num_proc, bar)
        columns = {"input_ids": chunked_lists(ids_chunks, pa.int32())}
        if self.mask_name is not None:
            columns[self.mask_name] = chunked_lists(mask_chunks, pa.int8())
        return pa.table(columns)

    def _fast(self, table):
        """A context giving ``self.fast``: :func:`packkit.tokenizer.fast_copy`, its cache enlarged while ``table`` is
        tokenized (before any fork), where its columns hold :data:`~packkit.tokenizer.COPY_BYTES_PER_TOKEN` bytes a
        vocabulary entry; else the copy made before, if any (the same ids, the cache the user's tokenizer has)."""
        backend = hf.fast_backend(self.tok)
        if backend is None or table.select(self.columns).nbytes < COPY_BYTES_PER_TOKEN * backend.get_vocab_size():
            return contextlib.nullcontext(self.fast)
        return fast_copy(backend)

    def warn_diverged(self, n: int) -> None:
        if not self.diverged:
            return
        if self.fmt == "prompt_completion":  # no template: the tokenizer merges tokens across the boundary
            why = ("the prompt's last characters and the completion's first tokenize as one token (no space or "
                   "newline between them?); start each completion with a space, or end each prompt with a newline")
        else:
            why = (f"{self.template_words} renders the prompt alone (with the generation prompt) otherwise than at the "
                   "start of prompt + completion; check the template's generation prompt")
        warnings.warn(f"{self.diverged:,} of {n:,} examples: the tokenized prompt is not a prefix of the tokenized "
                      f"prompt + completion, so their completion starts where the two diverge, as in TRL: {why}",
                      ChatWarning, stacklevel=3)


def tokenize_chat(data, tokenizer, *, chat_template=None, assistant_only_loss: bool | None = None,
                  completion_only_loss: bool | None = None, trust_remote_code: bool = False,
                  batch_size: int = BATCH_SIZE, progress: bool = False, format: str | None = None,
                  num_proc: int | None = None):
    """Token ids and TRL's loss mask of conversational data (module docstring), as an Arrow table.

    Args:
        data: a ``pyarrow.Table`` or ``datasets.Dataset`` in one of :data:`CHAT_FORMATS` (optional ``tools`` and
            ``chat_template_kwargs`` columns are passed to the template per example).
        tokenizer: a folder, ``tokenizer.json``, model id or loaded tokenizer; ``trust_remote_code`` lets it run
            its own code (:func:`packkit.tokenizer.load_tokenizer`).
        chat_template: Jinja text or a ``.jinja`` file, instead of the tokenizer's own template.
        assistant_only_loss: loss on assistant tokens only (needs ``{% generation %}`` markers). Default: on for
            ``messages`` / ``conversations``, off for prompt/completion pairs.
        completion_only_loss: loss on the completion only (prompt/completion pairs; default None: on); refused on
            other formats, as are ``assistant_only_loss`` and ``chat_template`` on prompt/completion strings.
        batch_size: conversations per tokenizer call; ``progress``: a progress bar (examples) on stderr.
        num_proc: processes that render and tokenize (default 1), as ``datasets.map``'s (:mod:`packkit.workers`: the
            same table as one process gives); one where that is faster (:func:`worker_processes`; 2 on 2 cores: 1).
        format: which of :data:`CHAT_FORMATS` to read (default ``"auto"``: :func:`chat_format`, TRL's precedence;
            a :class:`ChatWarning` names a conversational column left unread).
    Returns:
        ``pyarrow.Table``, rows in ``data``'s order: ``input_ids`` (list<int32>; large_list when one batch passes
        2**31 - 1 tokens) and, unless no mask applies, the loss mask (list<int8>, the same; module docstring).
    Raises:
        ValueError / TypeError naming the example and the fix: not a conversational format, a null or empty
        conversation, a template that fails on an example, a template without generation markers under
        assistant-only loss, an example with no assistant token (as TRL does).
    """
    import pyarrow as pa

    if not isinstance(data, pa.Table):
        if not (hasattr(data, "with_format") and hasattr(data, "column_names") and hasattr(data, "__len__")):
            raise TypeError(f"tokenize_chat takes a pyarrow.Table or a datasets.Dataset, got {type(data).__name__}")
        data = data.with_format("arrow")[:]  # a datasets.Dataset, by its public API: a selection comes back applied
    check_int(batch_size, "batch_size")  # before the tokenizer is loaded (num_proc: by ChatOptions)
    options = ChatOptions(chat_template, assistant_only_loss, completion_only_loss, trust_remote_code, format, num_proc)
    enc = chat_encoder(data.schema, tokenizer, options, stacklevel=3)
    out = enc.encode_table(data, 0, batch_size=batch_size, progress=progress)
    enc.warn_diverged(data.num_rows)
    return out


def chat_encoder(schema, tokenizer, options: ChatOptions | None = None, *, stacklevel: int = 2) -> "_Encoder":
    """The encoder :func:`tokenize_chat` applies, made once for rows of ``schema`` (the tokenizer loaded, the
    template and the loss chosen, the columns left unread warned about), so that a file can be tokenized a
    chunk at a time: ``enc.encode_table(chunk, first_row)`` per chunk, ``enc.warn_diverged(rows)`` at the end.
    ``options``: :class:`ChatOptions` (:func:`tokenize_chat`'s keywords)."""
    options = options or ChatOptions()
    fmt = chat_format(schema, format=options.format)
    if fmt is None:
        raise DataError("the data is not conversational (no messages, conversations, or prompt + completion "
                        "columns); the columns are {names}", names=schema.names)
    unread = ignored_columns(schema, fmt)
    if unread:
        other = next((c for c in ("messages", "conversations") if c in unread), "prompt_completion")
        try:  # what TRL's SFTTrainer reads ("prompt" in example decides first)
            trl = chat_format(schema)
        except (ArgumentError, DataError):  # prompt/completion columns TRL cannot read either
            trl = fmt
        how = ("as TRL's SFTTrainer reads them" if fmt == trl else
               "as asked; TRL's SFTTrainer reads such rows as {trl}, so its loss differs")
        warnings.warn(ChatWarning(Message("the rows hold {unread} too: read as {fmt}, " + how + "; {other} reads the "
                                          "other", unread=", ".join(map(repr, unread)), fmt=fmt, trl=trl,
                                          other=arg("format", other))), stacklevel=stacklevel)
    return _Encoder(fmt, tokenizer, options)


#: One process's chat tokenizing CPU outside its Rust pool (render 6%, masks 4%, ids 1%: Qwen3, ShareGPT), and forked
#: workers' CPU (one thread each) over one process's for the same rows (1.24x quiet, 1.38-1.39x at load 5; 2 cores).
PYTHON_SHARE, WORKER_CPU = 0.15, 1.3


def worker_processes(num_proc: int, cores: int | None = None, pool: bool | None = None) -> int:
    """Processes that tokenize for ``num_proc``: ``num_proc`` where they are faster than one process whose Rust pool
    spreads the tokenizing over ``cores`` (``1 / (PYTHON_SHARE + (1 - PYTHON_SHARE) / cores)`` against the workers'
    ``min(num_proc, cores) / WORKER_CPU``), else 1; ``pool``: that pool is on, as ``tokenizers`` reads
    ``TOKENIZERS_PARALLELISM`` in the C environment. ``worker_processes(2, 2, True) -> 1``, ``(8, 16, True) -> 8``."""
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if pool is None:
        value = c_getenv("TOKENIZERS_PARALLELISM")
        pool = value is None or value.lower() not in ("", "off", "false", "f", "no", "n", "0")
        if not pool and num_proc <= 1 and cores > 1 and os.environ.get("TOKENIZERS_PARALLELISM") != value:
            warnings.warn(f"TOKENIZERS_PARALLELISM={value!r} in the C environment, not in os.environ (datasets' "
                          f"map(num_proc) leaves it so): the tokenizer runs on 1 of {cores} cores; set "
                          "os.environ['TOKENIZERS_PARALLELISM'] = 'true' (or 'false', to keep 1 and silence this)",
                          ChatWarning, stacklevel=4)
    if num_proc <= 1 or not pool:
        return max(1, num_proc)
    return num_proc if min(num_proc, cores) / WORKER_CPU > 1 / (PYTHON_SHARE + (1 - PYTHON_SHARE) / cores) else 1


def tokenize_dataset(ds, tokenizer, *, chat_template=None, assistant_only_loss=None,
                     completion_only_loss: bool | None = None, trust_remote_code: bool = False, progress=None,
                     format: str | None = None, num_proc: int | None = None):
    """Conversational ``datasets`` data tokenized through ``tokenizer``'s chat template, the step before
    :func:`packkit.offline.pack_dataset` (``packkit pack`` composes both):
    ``pack_dataset(tokenize_dataset(ds, "Qwen/Qwen3-0.6B"), window=2048)``.

    ``ds``: a ``Dataset`` (back as an in-memory ``Dataset`` of :func:`tokenize_chat`'s columns; ``progress=None``: a
    bar from :data:`PROGRESS_EXAMPLES` examples on), an ``IterableDataset`` (mapped lazily, batch by batch), or a
    ``DatasetDict`` / ``IterableDatasetDict`` (every split; a tokenizer given by name is loaded once, not once a
    split). ``tokenizer`` and the options are :func:`tokenize_chat`'s. Data holding ``input_ids`` comes back as it is.
    """
    import datasets

    options = ChatOptions(chat_template, assistant_only_loss, completion_only_loss, trust_remote_code, format, num_proc)
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
        return type(ds)({name: tokenize_dataset(split, tokenizer, progress=progress, **dataclasses.asdict(options))
                         for name, split in ds.items()})
    if "input_ids" in (ds.column_names or []):
        return ds
    if isinstance(ds, datasets.Dataset):
        if progress is None:
            progress = len(ds) >= PROGRESS_EXAMPLES and datasets.utils.logging.is_progress_bar_enabled()
        table = tokenize_chat(ds, tokenizer, progress=progress, **dataclasses.asdict(options))
        return datasets.Dataset(table, fingerprint=datasets.fingerprint.generate_random_fingerprint())
    import pyarrow as pa

    schema = ds.features.arrow_schema if ds.features is not None else pa.schema([])  # features unknown: no columns
    enc = chat_encoder(schema, tokenizer, dataclasses.replace(options, num_proc=None), stacklevel=3)

    def encode(batch, indices):
        table = pa.Table.from_pydict(batch, schema=pa.schema([schema.field(c) for c in batch]))
        ids, mask = enc.encode(table, indices[0] if indices else 0)
        out = {"input_ids": ids.to_pylist()}
        if mask is not None:
            out[enc.mask_name] = mask.to_pylist()
        return out

    return ds.map(encode, batched=True, batch_size=BATCH_SIZE, with_indices=True, remove_columns=ds.column_names)
