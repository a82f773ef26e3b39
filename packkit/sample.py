"""The data packkit measures when given no file: the bundled sample of ``packkit waste`` and ``plan``
(``packkit/data/README.md`` says how it was made), and ``plan --synthetic``'s SFT-like lengths. Its own room, off the
door in (:mod:`packkit.datafiles` and :mod:`packkit.budget` re-export them), so that either command on it imports none
of the readers (``tests/test_cli_startup.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .epoch import Lengths
from .errors import check_int

SAMPLE_PATH = Path(__file__).with_name("data") / "sample_lengths.npy"


def bundled_sample() -> Lengths:
    """The bundled sample of real lengths: ``bundled_sample().lengths.size -> 4127``, int64."""
    lengths = np.load(SAMPLE_PATH).astype(np.int64)
    return Lengths(lengths, "bundled sample: CPython's own docs as instruction examples", "bytes")


def synthetic_sft_lengths(n: int, *, seed: int = 0, max_length: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, loss_lengths)`` of ``n`` SFT-like examples: a prompt, then a completion that carries the loss.
    Both log-normal (medians about 100 and 180 tokens, long right tails) as in chat instruction data, the total
    clipped to ``max_length``; deterministic for a seed."""
    n = check_int(n, "n", fix=": pass 1 or more")
    rng = np.random.default_rng(seed)
    prompt = np.maximum(rng.lognormal(np.log(100), 0.9, n).astype(np.int64), 4)
    completion = np.maximum(rng.lognormal(np.log(180), 1.0, n).astype(np.int64), 1)
    completion = np.minimum(completion, max_length - 2)
    lengths = np.minimum(prompt + completion, max_length)
    return lengths, np.minimum(completion, lengths - 1)
