"""Windows planned from a stream packkit cannot see whole: best fit inside a bounded buffer of items
(:func:`stream_windows`; fill against buffer size is tabled in :func:`packkit.packer.pack_stream`), and the buffer a
stream resumes from (:class:`StreamBuffer`).

Its own room, imported where a stream is planned, so that planning a whole dataset (``packkit plan``) does not compile
it; :mod:`packkit.binpack` lends every name here under its old address::

    >>> list(stream_windows([("a", 3), ("b", 4), ("c", 1)], window=4, buffer_size=3))
    [['a', 'c'], ['b']]
"""

from __future__ import annotations

import bisect
import collections

from .errors import check_int
from .length_rules import check_window

__all__ = ["stream_windows", "StreamBuffer", "check_buffer_size"]


def check_buffer_size(buffer_size) -> int:
    """Return ``buffer_size`` as a positive int, or raise: ``check_buffer_size(1000) -> 1000``."""
    return check_int(buffer_size, "buffer_size")


class StreamBuffer:
    """The items :func:`stream_windows` holds: read out between windows, put back to resume a stream.

    ``StreamBuffer([("a", 3), ("b", 1)]).items() -> [("a", 3), ("b", 1)]`` (arrival order). The
    generator works on these very containers, so a buffer read between two windows is exactly what the
    next window will be planned from; a new generator given a copy plans the same windows.
    """

    __slots__ = ("by_length", "present", "arrivals", "held", "seq", "taken")

    def __init__(self, items=()):
        self.by_length: dict[int, collections.deque] = {}  # length -> seqs, oldest first
        self.present: list[int] = []  # sorted distinct lengths in the buffer
        self.arrivals: collections.deque = collections.deque()  # (seq, length), oldest first; taken ones skipped
        self.held: dict[int, object] = {}  # seq -> payload
        self.seq = 0
        self.taken: list | None = None  # a list: the seqs taken are appended to it (a reader of changes)
        for payload, length in items:
            self.add(payload, int(length))

    def add(self, payload, length: int) -> None:
        seq = self.seq
        self.seq += 1
        self.held[seq] = payload
        self.arrivals.append((seq, length))
        q = self.by_length.get(length)
        if q is None:
            self.by_length[length] = collections.deque([seq])
            bisect.insort(self.present, length)
        else:
            q.append(seq)

    def items(self) -> list:
        """``[(payload, length), ...]`` of the items held, oldest first."""
        held = self.held
        return [(held[seq], length) for seq, length in self.arrivals if seq in held]

    def __len__(self) -> int:
        return len(self.held)


def stream_windows(items, *, window: int, buffer_size: int = 1000, buffer: StreamBuffer | None = None):
    """Windows from a stream of ``(payload, length)`` items, best fit inside a bounded buffer.

    Each window starts with the oldest buffered item, then repeatedly takes the longest buffered item
    that fits the room left (the oldest of that length), refilling the buffer after every take, until
    nothing fits. At most ``buffer_size`` items are held; ``buffer_size=1`` is next fit.
    ``[(a, 3), (b, 4), (c, 1)]`` with ``window=4``, ``buffer_size=3`` -> ``[a, c], [b]``.

    Args:
        items: iterable of ``(payload, length)`` with ``1 <= length <= window`` (an overflow policy,
            :func:`apply_overflow`, has cut longer examples before).
        buffer: the :class:`StreamBuffer` to plan in (default a new, empty one): between two windows it
            holds what was read and not yet placed, so a stream resumes from a copy of it and the items
            not yet read, with the same windows. It may hold more than ``buffer_size`` items (a resume
            on fewer shards): nothing more is read until it holds fewer.
    Yields:
        lists of payloads, one list per window.
    """
    window = check_window(window)
    buffer_size = check_buffer_size(buffer_size)
    it = iter(items)
    buf = StreamBuffer() if buffer is None else buffer
    by_length, present, arrivals, held = buf.by_length, buf.present, buf.arrivals, buf.held
    add = buf.add
    state = {"done": False}

    def fill():
        while not state["done"] and len(held) < buffer_size:
            try:
                payload, length = next(it)
            except StopIteration:
                state["done"] = True
                return
            length = int(length)
            if not 1 <= length <= window:
                raise ValueError(f"item {buf.seq} has length {length}, outside [1, window={window}]")
            add(payload, length)

    def take(length: int):
        q = by_length[length]
        seq = q.popleft()
        if not q:
            del by_length[length]
            del present[bisect.bisect_left(present, length)]
        if buf.taken is not None:
            buf.taken.append(seq)
        return held.pop(seq)

    fill()
    while held:
        while arrivals[0][0] not in held:
            arrivals.popleft()
        _, length = arrivals.popleft()
        win = [take(length)]
        room = window - length
        fill()
        while room and present:
            j = bisect.bisect_right(present, room) - 1
            if j < 0:
                break
            length = present[j]
            win.append(take(length))
            room -= length
            fill()
        yield win
