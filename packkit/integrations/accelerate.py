"""What packkit relies on in accelerate, in one place: the wrappers ``accelerator.prepare`` (and ``Trainer``, which
calls it) and ``skip_first_batches`` (``Trainer``'s resume in mid-epoch) put around a DataLoader and its batch
sampler, which :mod:`packkit.resume` must see through to count the batches a training loop received:

* ``BatchSamplerShard`` (its ``batch_sampler``, ``num_processes``): deals the batches of the batch sampler it wraps
  over ``num_processes`` processes, one in ``num_processes`` to each; on one process it passes every batch.
* ``DataLoaderShard`` (its ``end_of_dataloader``): iterates a torch DataLoader one batch ahead of the loop, to know
  the last batch, so the loop has received one batch fewer than that DataLoader handed out until the end.
* ``SkipBatchSampler`` (its ``batch_sampler``, ``skip_batches``): drops the first ``skip_batches`` batches of the
  batch sampler it wraps and passes the rest.

Recognised by class name and read by attribute: accelerate is optional and never imported here. Checked against
accelerate 1.16 (``tests/test_integrations.py`` fails when the installed version leaves :data:`SUPPORTED` and checks
that these classes still hold what is read; ``tests/test_resume_trainer.py`` and ``tests/test_resume_loaders.py``
resume through them): widen the range there after checking.
"""

from __future__ import annotations

from .. import integrations

__all__ = ["SUPPORTED", "CLASSES", "installed_version", "is_supported", "check_not_dealt_twice", "is_loader_shard",
           "held_back", "is_skipping", "skipped_batches", "draws_from"]

#: ``[first, past)``: the accelerate releases this module is checked against (major.minor).
SUPPORTED = ((1, 16), (2, 0))

#: ``{class name in accelerate.data_loader: the attributes read of it}``.
CLASSES = {"BatchSamplerShard": ("batch_sampler", "num_processes"), "DataLoaderShard": ("end_of_dataloader",),
           "SkipBatchSampler": ("batch_sampler", "skip_batches")}


def installed_version() -> str | None:
    """accelerate's version string, or None when it is not installed."""
    return integrations.installed_version("accelerate")


def is_supported(version: str) -> bool:
    """``is_supported("1.16.0") -> True``; ``"1.15.0"`` and ``"2.0.0"`` -> False (outside :data:`SUPPORTED`)."""
    return integrations.is_supported(version, SUPPORTED)


def check_not_dealt_twice(obj) -> None:
    """Refuses (ValueError) ``obj`` when it is a ``BatchSamplerShard`` dealing, over its processes, the batches of a
    batch sampler that is already one rank's (``world_size > 1``): ``accelerator.prepare`` on many processes does
    that, and each rank would train a fraction of its batches. Anything else passes."""
    if type(obj).__name__ == "BatchSamplerShard" and getattr(obj, "num_processes", 1) > 1 and \
            getattr(getattr(obj, "batch_sampler", None), "world_size", 1) > 1:
        raise ValueError(
            f"accelerate's BatchSamplerShard deals the batches of {type(obj.batch_sampler).__name__} over "
            f"{obj.num_processes} processes again, but they are already one rank's of "
            f"{obj.batch_sampler.world_size} (each rank would train 1/{obj.num_processes} of them): after "
            "accelerator.prepare(loader), set loader.batch_sampler.num_processes = 1 and process_index = 0")


def is_loader_shard(obj) -> bool:
    """Whether ``obj`` is a ``DataLoaderShard``, the loader ``accelerator.prepare`` wraps a DataLoader in."""
    return type(obj).__name__ == "DataLoaderShard"


def held_back(shard) -> int:
    """Batches a ``DataLoaderShard`` (or None: no shard) has drawn from its DataLoader and not yet handed to the
    loop: 1 until its last batch (it fetches one ahead), else 0."""
    return 0 if shard is None or getattr(shard, "end_of_dataloader", True) else 1


def is_skipping(batch_sampler) -> bool:
    """Whether ``batch_sampler`` is a ``SkipBatchSampler`` (``skip_first_batches``, Trainer's resume in mid-epoch)."""
    return type(batch_sampler).__name__ == "SkipBatchSampler"


def skipped_batches(batch_sampler) -> int | None:
    """The batches a ``SkipBatchSampler`` drops before it passes the rest (its ``skip_batches``); None for any other
    batch sampler, or one whose count is not an int."""
    count = getattr(batch_sampler, "skip_batches", None) if is_skipping(batch_sampler) else None
    return count if isinstance(count, int) else None


def draws_from(batch_sampler, sampler) -> bool:
    """Whether ``batch_sampler`` (a DataLoader's) wraps ``sampler``: ``sampler`` is its ``batch_sampler``, or that of a
    wrapper inside it, at most three deep, each wrapper inside it passing every batch (no ``num_processes``, or 1: a
    ``SkipBatchSampler``, a ``BatchSamplerShard`` made a passthrough). ``draws_from(sampler, sampler) -> False``."""
    for _ in range(3):
        batch_sampler = getattr(batch_sampler, "batch_sampler", None)
        if batch_sampler is sampler:
            return True
        if getattr(batch_sampler, "num_processes", 1) != 1:
            return False
    return False
