"""The bundled sample: what ``packkit waste`` and ``plan`` measure when given no file (``packkit/data/README.md``
says how it was made). Its own room, off the door in (:mod:`packkit.datafiles`, which re-exports it), so that
``packkit waste`` on it imports none of the readers (``tests/test_cli_startup.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .epoch import Lengths

SAMPLE_PATH = Path(__file__).with_name("data") / "sample_lengths.npy"


def bundled_sample() -> Lengths:
    """The bundled sample of real lengths: ``bundled_sample().lengths.size -> 4127``, int64."""
    lengths = np.load(SAMPLE_PATH).astype(np.int64)
    return Lengths(lengths, "bundled sample: CPython's own docs as instruction examples", "bytes")
