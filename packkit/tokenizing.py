"""Behind the door in, :class:`Tokenizing`: how rows get their token column. :mod:`packkit.datafiles` lends it under its
old address and imports this module only where rows lack their token column (a file of token ids does not compile it).
"""

from __future__ import annotations

import os

from . import tokenizer as tokenizers  # the module, not its names: its functions are looked up at each call
from .arrow import pyarrow
from .chatoptions import ChatOptions
from .errors import ArgumentError, DataError, MissingError, arg

__all__ = ["Tokenizing"]


class Tokenizing:
    """How rows of one schema get their token column (:meth:`Input.tokenizing`), decided and checked once, applied a
    chunk at a time. ``encode(table, first_row)``: the chunk with its tokens, errors naming the row in the whole input.
    Conversational rows (TRL's ``messages``, ``conversations`` or ``prompt`` + ``completion``) get ``input_ids`` and
    TRL's loss mask (:func:`packkit.chat.chat_encoder`), text gets ``column`` (list<int32>,
    :func:`packkit.tokenizer.tokenize`). ``finish(rows)``: the warnings that need every row; ``how``: what was done."""

    def __init__(self, schema, *, column: str, text_column: str, tokenizer, chat: ChatOptions, where: str):
        from .chat import chat_encoder, chat_format  # lazy: off waste and plan's start
        self.column, self.text_column, self.chat = column, text_column, None
        fmt = chat_format(schema, format=chat.format)
        if fmt is not None:
            if tokenizer in (None, "bytes"):
                raise ArgumentError("{where} is conversational ({fmt}): pass {arg}, a tokenizer with a chat "
                                    "template (a local folder, or a model id)", where=where, fmt=fmt,
                                    arg=arg("tokenizer", metavar="FOLDER_OR_MODEL_ID"))
            self.chat = enc = chat_encoder(schema, tokenizer, chat, stacklevel=4)
            name = tokenizers.tokenizer_name(tokenizer)
            # the template named as given (the file passed, else the tokenizer's own); prompt/completion: none
            words = (f"the chat template {os.path.basename(enc.template_file)!r} (tokenizer {name})"
                     if enc.template_file else f"the chat template of {name}")
            if enc.swapped:
                words = f"TRL's training version of {words}"
            self.how = (f"prompt/completion strings with {name} (no chat template; EOS appended to each completion)"
                        if fmt == "prompt_completion" else f"{fmt} through {words}")
            return
        if text_column not in schema.names:
            raise MissingError("no column {column!r} (token ids) or {text!r} (text); the columns are {names}: pass "
                               "{col} or {text_col}", column=column, text=text_column, names=schema.names,
                               col=arg("column", metavar="NAME"), text_col=arg("text_column", metavar="NAME"))
        if tokenizer is None:
            raise DataError("no token ids (no column {column!r}), only text in {text!r}: pass {tok} (or {bytes})",
                            column=column, text=text_column, tok=arg("tokenizer", "tokenizer.json"),
                            bytes=arg("tokenizer", "bytes"))
        pa = pyarrow()
        typ = schema.field(text_column).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise TypeError(f"column {text_column!r} holds {typ}, not text")
        self.tokenizer = tokenizers.rust_tokenizer(tokenizer, trust_remote_code=chat.trust_remote_code) or "bytes"
        self.how = f"column {text_column!r} tokenized with {tokenizers.tokenizer_name(tokenizer or 'bytes')}" + (
            "" if self.tokenizer == "bytes" else ", no EOS appended (TRL's SFTTrainer appends one to each text)")

    def encode(self, table, first_row: int = 0, *, progress: bool = False):
        """``table`` (a chunk of the input whose first row is ``first_row``) with its tokens (class docstring)."""
        if self.chat is not None:
            return self.chat.encode_table(table, first_row, progress=progress)
        return table.append_column(self.column, tokenizers.tokenize(
            table.column(self.text_column), self.tokenizer, progress=progress, first_row=first_row))

    def finish(self, rows: int) -> None:
        """The warnings that need every row (``rows`` of them): prompts that did not prefix their completion."""
        if self.chat is not None:
            self.chat.warn_diverged(rows)
