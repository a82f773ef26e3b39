"""How conversational rows become tokens, as one object: :class:`ChatOptions`, what the readers of
:mod:`packkit.datafiles` and the commands (``packkit waste``, ``plan``, ``pack``, ``tokenize``) take and hand to
:mod:`packkit.chat`. A room of its own, lent by :mod:`packkit.chat` as before, so that a command reading a file of
token ids builds its options without compiling the chat templates (``chat``, ``chatrender`` and transformers'
compiler: 67 KB)::

    >>> ChatOptions(format="messages").assistant_only_loss is None
    True
"""

from __future__ import annotations

import dataclasses

from .errors import check_int

__all__ = ["ChatOptions"]


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """:func:`packkit.chat.tokenize_chat`'s keywords of the same names (documented there) as one object (module
    docstring). ``num_proc`` is checked here, once, for every caller."""

    chat_template: object = None
    assistant_only_loss: bool | None = None
    completion_only_loss: bool | None = None
    trust_remote_code: bool = False
    format: str | None = None
    num_proc: int | None = None

    def __post_init__(self):
        if self.num_proc is not None:
            check_int(self.num_proc, "num_proc")
