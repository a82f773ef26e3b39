"""The largest micro-batch that fits: :func:`find_max_micro_batch` bisects the sizes a training step can take
without running out of memory. Lent by :mod:`packkit.budget` (``packkit.budget.find_max_micro_batch``) and the
package; a room of its own so that the figures of a plan (``packkit plan``) do not compile it.
"""

from __future__ import annotations

import gc

from .errors import check_int
from .records import record

__all__ = ["find_max_micro_batch", "MicroBatchSearch", "is_out_of_memory"]


_OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a RuntimeError whose message says the device ran out of memory.

    ``is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) -> True``.
    """
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover - torch without OutOfMemoryError
        pass
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def _free_memory() -> None:
    """Collect garbage (tensors held by reference cycles) and return cached CUDA blocks to the driver."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


@record
class MicroBatchSearch:
    """``batch_size``: the largest that fit; ``attempts``: calls made; ``trials``: ``(size, fitted)`` in order."""

    batch_size: int
    attempts: int
    trials: tuple


def find_max_micro_batch(step, *, high: int, low: int = 1, multiple_of: int = 1) -> MicroBatchSearch:
    """The largest micro-batch in ``[low, high]`` for which ``step(batch_size)`` does not run out of memory.

    ``step(batch_size)`` runs one training step (forward, backward, optimiser step: the peak is at the
    backward) and returns nothing; it raises ``torch.OutOfMemoryError`` (or a CUDA out-of-memory
    RuntimeError) above the limit. Bisection assumes that a size fits whenever a larger one does, and
    makes ``ceil(log2(high - low + 2))`` attempts (sizes step by ``multiple_of``). Between attempts the
    exception (and the frames holding its tensors) is dropped, garbage is collected and the CUDA
    cache is emptied. Any other exception propagates. Leave headroom: memory use drifts with
    fragmentation and with the longest batch of the epoch.

    Raises ValueError when even ``low`` does not fit.

    >>> find_max_micro_batch(lambda b: None if b <= 37 else (_ for _ in ()).throw(MemoryError()), high=64)
    MicroBatchSearch(batch_size=37, attempts=6, trials=((32, True), (48, False), (40, False), (36, True), (38, False), (37, True)))
    """
    multiple_of = check_int(multiple_of, "multiple_of", fix=": pass 1 or more")
    low, high = check_int(low, "low", fix=": pass 1 or more"), check_int(high, "high", fix=": pass 1 or more")
    lo_k, hi_k = -(-low // multiple_of), high // multiple_of  # candidate sizes k * multiple_of
    if lo_k > hi_k:
        raise ValueError(f"no multiple of {multiple_of} lies in [low={low}, high={high}]")
    fit, fail = lo_k - 1, hi_k + 1  # invariant: k <= fit fits (sentinel), k >= fail does not
    trials = []
    while fail - fit > 1:
        k = (fit + fail) // 2
        size = k * multiple_of
        try:
            step(size)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - only out-of-memory is swallowed, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            ok = False
            del exc  # the traceback holds the frames, and their tensors, of the failed step
        _free_memory()
        trials.append((size, ok))
        if ok:
            fit = k
        else:
            fail = k
    if fit < lo_k:
        raise ValueError(
            f"even micro-batch size {lo_k * multiple_of} runs out of memory: shorten the window or the "
            "longest example, enable gradient checkpointing, or use a smaller model/precision"
        )
    return MicroBatchSearch(batch_size=fit * multiple_of, attempts=len(trials), trials=tuple(trials))
