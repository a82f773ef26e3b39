"""packkit: pack variable-length examples into fixed windows for fine-tuning.

The front door: the names a user needs, importable from ``packkit`` itself::

    from packkit import PaddingFreeCollator, PackedBatchSampler, pack, varlen_attention

Each is loaded when first asked for (PEP 562: module-level ``__getattr__``), from its home module, so
``import packkit`` imports nothing (no torch, datasets, transformers or pyarrow) and the ``packkit`` command
starts as light as before. ``packkit.X`` is the same object as ``packkit.<home>.X``, and the home paths
(``from packkit.collate import PaddingFreeCollator``) keep working. The rest (checks, readers, writers,
planners' internals) stays behind the front, in its module: ``packkit.cp.shard``, ``packkit.raydata``'s
``pack_dataset`` (the Ray one; ``packkit.pack_dataset`` is the one over a ``datasets.Dataset``).
"""

import importlib

__version__ = "0.1.0"

#: ``{home module: names}``: what the front door lends, each name from its one home.
_HOMES = {
    "binpack": ("Plan", "pack"),
    "packer": ("pack_stream",),
    "batch": ("PackedBatch",),
    "segments": ("IGNORE_INDEX",),
    "collate": ("PaddingFreeCollator", "FixedWindowCollator", "PackedRowsCollator", "PaddedCollator"),
    "model_inputs": ("VisionLanguageCollator", "HybridCollator"),
    "sampler": ("LengthGroupedSampler", "TokenBudgetBatchSampler", "PackedBatchSampler", "ResumeWarning"),
    "attention": ("varlen_attention", "register_hf_attention"),
    "loss": ("count_loss_tokens", "token_normalized_loss", "hf_compute_loss_func", "accumulation_step",
             "WeightedLossMixin"),
    "budget": ("plan_budget", "effective_batch_size", "find_max_micro_batch"),
    "chat": ("tokenize_dataset",),
    "waste": ("measure_waste",),
    "offline": ("pack_dataset",),
    "streaming": ("PackedIterable",),
    "columnar": ("ColumnarDataset",),
    "planindex": ("PlanIndex", "write_plan"),
    "planned": ("PlannedDataset",),
    "preference": ("PreferenceCollator", "GroupCollator", "PackedDPOMixin", "tokenize_preference",
                   "sequence_logps", "dpo_loss", "shard_groups"),
    "errors": ("PackkitError",),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = ["__version__", *_HOME]


def __getattr__(name: str):
    """``packkit.pack`` -> ``packkit.binpack.pack``, imported on first use and kept (the next lookup is a
    plain attribute). Any other name is an AttributeError, so ``from packkit import cli`` still imports the
    submodule."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'packkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"packkit.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted({*globals(), *_HOME})
