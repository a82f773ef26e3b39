"""What a context-parallel layout asks of a row, numpy-free: the multiples it pads a document and a row to, and the
window check that names the window to pass. :mod:`packkit.cp_plan` plans the layouts (and re-exports these names);
the budget, the waste figures and the collators check a window with them without importing the planner (37 KB
that ``packkit plan`` and ``packkit waste`` would compile at every start from source for a ``--cp`` not asked for).

    >>> cp_multiples(cp_size=4, cp_layout="zigzag"), cp_multiples(cp_size=4, cp_layout="hybrid")
    ((8, 1), (1, 4))
"""

from __future__ import annotations

from .choices import CP_LAYOUTS
from .errors import ArgumentError, arg, check_choice, check_int

__all__ = ["check_cp_size", "cp_multiples", "check_cp_window"]


def check_cp_size(cp_size) -> int:
    """``cp_size``: a Python int >= 1 (1 means no context parallelism)."""
    return cp_size if type(cp_size) is int and cp_size >= 1 else check_int(cp_size, "cp_size")  # (ints pass at once)


def _check_layout(cp_layout: str) -> str:
    if type(cp_layout) is str and cp_layout in CP_LAYOUTS:  # (the names pass without a call)
        return cp_layout
    return check_choice(cp_layout, "cp_layout", CP_LAYOUTS, what="CP layout")


def cp_multiples(*, cp_size: int, cp_layout: str) -> tuple[int, int]:
    """``(document multiple, row multiple)`` a layout pads to: zigzag pads every document to a multiple
    of ``2 * cp``, the others cut the row in ``cp`` equal pieces. ``cp_multiples(cp_size=4,
    cp_layout="zigzag") -> (8, 1)``; ``cp_layout="hybrid" -> (1, 4)``."""
    cp = check_cp_size(cp_size)
    return (2 * cp, 1) if _check_layout(cp_layout) == "zigzag" else (1, cp)


def check_cp_window(window: int, *, cp_size: int, cp_layout: str) -> int:
    """``window`` if a row of it can be cut for the layout (a multiple of ``2 * cp`` for zigzag, of ``cp``
    for the others), else a one-line error naming the window to pass: ``check_cp_window(4096, cp_size=8,
    cp_layout="zigzag") -> 4096``."""
    doc_multiple, row_multiple = cp_multiples(cp_size=cp_size, cp_layout=cp_layout)
    m = doc_multiple * row_multiple
    if window % m:
        raise ArgumentError("{window} is not a multiple of {m}, which {layout} with {cp} needs; raise {w} to {up:,}",
                            window=arg("window", window), m=m, layout=arg("cp_layout", cp_layout),
                            cp=arg("cp_size", cp_size), w=arg("window"), up=-(-window // m) * m)
    return window
