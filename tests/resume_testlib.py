"""What the resume tests share: real ShareGPT lengths, rows whose tokens name their example, and a loop
killed after a number of batches that records which examples each batch held."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LENGTHS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "sharegpt_qwen3_lengths.npy"


def sharegpt(n: int | None = None, *, seed: int = 0) -> np.ndarray:
    """(n,) int64 ShareGPT conversation lengths (Qwen3 tokens), ``n`` drawn without replacement (all: None)."""
    lengths = np.load(LENGTHS_FILE).astype(np.int64)
    if n is None:
        return lengths
    return lengths[np.sort(np.random.default_rng(seed).choice(lengths.size, n, replace=False))]


class TokenRows:
    """A map-style dataset whose example ``i`` is ``lengths[i]`` tokens, each ``i + 1``: a packed batch tells
    which examples it holds (:func:`examples_of`), through workers and collators."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i):
        return {"input_ids": np.full(int(self.lengths[i]), int(i) + 1, np.int64)}


def examples_of(batch) -> np.ndarray:
    """The example indices of a batch of :class:`TokenRows` (padding, id 0, left out)."""
    ids = np.unique(np.asarray(batch["input_ids"]).reshape(-1))
    return ids[ids > 0] - 1


class Killed(Exception):
    """The process died here (a test's stand-in for a kill between two training steps)."""


class KillAfter:
    """``loader``, killed after ``stop`` batches (None: never): records each batch's examples, and the
    ``state`` the loop's frame held when it died (``scope_state``, read from the exec scope by the caller)."""

    def __init__(self, loader, stop: int | None):
        self.loader, self.stop, self.examples, self.scope_state = loader, stop, [], None

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        import sys

        for n, batch in enumerate(self.loader):
            if n == self.stop:
                self.scope_state = sys._getframe(1).f_locals.get("state")  # what the loop saved last
                raise Killed(f"killed after {n} batches")
            self.examples.append(examples_of(batch))
            yield batch
