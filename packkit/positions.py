"""Where a sampler's pass stands: the position a saved state records, the bits of the units of a step used before
it, the state's version, and the warning a resume gives when step boundaries move.

The sampler (:mod:`packkit.sampler`) deals from a :class:`Point`; the reading and writing of states
(:mod:`packkit.resume`) makes them. Both import this room, so neither imports the other back::

    >>> Point(start=8).clean, Point(start=8, span=4, mask=0b0101).clean
    (True, False)
    >>> bits_mask(mask_bits(0b101, 10, 13))
    5
"""

from __future__ import annotations

import numpy as np

from .records import record

__all__ = ["Point", "ResumeWarning", "STATE_VERSION", "mask_bits", "bits_mask"]

STATE_VERSION = 2  # of the dict state_dict() writes (1: an older packkit's per-rank state, no "version")


def mask_bits(mask: int, start: int, stop: int) -> np.ndarray:
    """(stop - start,) bool, bit ``u - start`` of ``mask`` for each unit: ``mask_bits(0b101, 10, 13) -> [T, F, T]``."""
    n = stop - start
    if n <= 0 or not mask:
        return np.zeros(max(n, 0), bool)
    raw = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def bits_mask(bits: np.ndarray) -> int:
    """The integer whose bit ``i`` is ``bits[i]``: ``bits_mask([True, False, True]) -> 5``."""
    bits = np.asarray(bits, bool)
    if not bits.any():
        return 0
    return int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")


class ResumeWarning(UserWarning):
    """A resume on another world size (or step size) moved step boundaries: said once, in one line.

    No example is repeated or skipped; only which examples share an optimiser step changes from the
    resume point on. Silence it with ``warnings.filterwarnings("ignore", category=ResumeWarning)``.
    """


class RepeatWarning(UserWarning):
    """A step with fewer examples than ranks deals the ranks left without one a repeat (DDP needs every rank to run a
    micro-batch): said once a sampler, in one line. The repeats weigh 0 where the loop counts the step with
    ``accumulation_step(..., facts=sampler.step_facts())`` or ``repeats=sampler.step_repeats()`` (a ``Trainer``
    with :class:`packkit.loss.WeightedLossMixin` does, the token mean included); otherwise they count twice. Silence it with ``warnings.filterwarnings("ignore", category=RepeatWarning)``.
    """


@record
class Point:
    """Where a pass starts in a sequence of ``seq_step`` units a step (``None``: this run's step size).

    A clean step boundary is ``Point(start=u)``. Inside a step: the step is units ``start ..
    start + span - 1``, of which the bits of ``mask`` were used before it was dealt as ``deal`` =
    ``(world_size, accumulation_steps)`` (None: not dealt yet), and ``rows`` rows of that deal are done.
    """

    start: int = 0
    span: int = 0
    mask: int = 0
    deal: tuple | None = None
    rows: int = 0
    seq_step: int | None = None

    @property
    def clean(self) -> bool:
        return self.rows == 0 and self.mask == 0
