"""Where packkit touches a framework's private surface: one module per framework, so an upgrade of it has one
place to break. Each declares the versions it is checked against (``SUPPORTED``) and
``tests/test_integrations.py`` checks the installed version against it and the hooks it uses against the
installed framework.

* :mod:`packkit.integrations.transformers`: attention functions (``AttentionInterface``), the keyword
  arguments a model's attention layer passes them, and the layouts of their tensors; the attention implementation
  a config names (``_attn_implementation``); LLaVA-NeXT's image grid (``modeling_llava_next``); the chat-template
  compiler; ``Trainer``'s private hooks.
* :mod:`packkit.integrations.trl`: ``DPOTrainer``'s private ``_compute_loss``, the config it holds, its metrics.
* :mod:`packkit.integrations.accelerate`: the loader and batch-sampler wrappers of ``accelerator.prepare`` and
  ``skip_first_batches``, seen through to count the batches a loop received.
"""

from __future__ import annotations


def installed_version(distribution: str) -> str | None:
    """``distribution``'s version string, or None when it is not installed (read from its metadata, not imported)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def is_supported(version: str, supported: tuple) -> bool:
    """``is_supported("5.24.0", ((5, 0), (6, 0))) -> True``: ``version``'s major.minor lies in ``[first, past)``."""
    return supported[0] <= tuple(int(p) for p in version.split(".")[:2]) < supported[1]
