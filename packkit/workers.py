"""A table's rows encoded a batch at a time, in this process or in ``num_proc`` processes, each a contiguous part
(forked where the platform allows), joined in order: the one process's result. Behind :mod:`packkit.chat`'s
``num_proc`` (chat decides how many processes pay). An encoder: ``encode(table, base) -> (ids, mask)``, list arrays of
the rows (the first is example ``base``, for errors), adding to its count ``diverged``.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["encode_range", "encode_rows"]

#: what forked workers read from their parent's memory, not a pickle: key -> (encoder, table). With Qwen3's tokenizer
#: the pickle took 0.43 s and 1.33 s a worker to rebuild, most of what num_proc=2 cost over one process.
_FORKED: dict = {}


def encode_range(enc, table, base: int, batch_size: int, bar=None):
    """``(ids chunks, mask chunks, enc.diverged)`` of ``table``'s rows (the first is example ``base``), ``batch_size``
    rows a call of ``enc.encode``; ``bar`` (a progress bar) counts the rows."""
    ids_chunks, mask_chunks = [], []
    for lo in range(0, table.num_rows, batch_size):
        ids, mask = enc.encode(table.slice(lo, batch_size), base + lo)
        ids_chunks.append(ids)
        mask_chunks.append(mask)
        if bar is not None:
            bar.update(len(ids))
    return ids_chunks, mask_chunks, enc.diverged


def _encode_part(job):
    """A worker's part: ``(enc, table, base, batch_size)`` -> :func:`encode_range`; forked, ``enc`` is the key of
    the parent's ``(encoder, table)`` in :data:`_FORKED` and ``table`` the part's ``(first row, rows)``."""
    enc, table, base, batch_size = job
    if isinstance(enc, int):
        enc, whole = _FORKED[enc]
        table = whole.slice(*table)
    enc.diverged = 0
    return encode_range(enc, table, base, batch_size)


def encode_rows(enc, table, base: int, batch_size: int, num_proc: int, bar):
    """``(ids chunks, mask chunks)`` of ``table``'s rows, in ``num_proc`` processes where they are more than one batch
    (module docstring); ``bar`` counts the rows, ``enc.diverged`` every process's. A forked worker reads the parent's
    encoder and table (:data:`_FORKED`, no re-import) and tokenizes on one thread (``TOKENIZERS_PARALLELISM=false``, as
    ``tokenizers`` asks of forked processes)."""
    if num_proc <= 1 or table.num_rows <= batch_size:
        return encode_range(enc, table, base, batch_size, bar)[:2]
    import concurrent.futures
    import multiprocessing

    cuts = np.linspace(0, table.num_rows, num_proc + 1).astype(np.int64)
    parts = [(int(a), int(b - a)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    method, key = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn", id(enc)
    if method == "fork":
        _FORKED[key] = (enc, table)
    jobs = [(key, p, base + p[0], batch_size) if method == "fork" else (enc, table.slice(*p), base + p[0], batch_size)
            for p in parts]
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context(method)) as pool:
            done = []
            for part in pool.map(_encode_part, jobs):
                done.append(part)
                bar.update(sum(len(c) for c in part[0]))
    finally:
        _FORKED.pop(key, None)
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
    enc.diverged += sum(p[2] for p in done)
    return [c for p in done for c in p[0]], [c for p in done for c in p[1]]
