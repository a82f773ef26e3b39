"""The work of a model per token and per media unit, read from its config: the sums behind
:meth:`packkit.costs.CostModel.from_config` (whose docstring tells them), in a room of their own so that a sampler
given no config (``packkit plan``, ``packkit waste``) does not compile them::

    >>> weights(None, hidden_size=4096, intermediate_size=11008, kv_size=None)
    (49408.0, 0.0)
"""

from __future__ import annotations

from .errors import ArgumentError, arg, check_int

__all__ = ["weights"]


def weights(config, *, hidden_size: int | None, intermediate_size: int | None, kv_size: int | None) -> tuple:
    """``(linear, per_unit)`` of :meth:`packkit.costs.CostModel.from_config`: the per-token weight of the decoder,
    and the work of one media unit of its encoder over the text's ``2 h`` a layer of its layers (0.0 without one)."""
    per_unit = 0.0
    if config is not None:
        per_unit = _encoder_work(config)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden_size = getattr(config, "hidden_size", hidden_size)
        intermediate_size = getattr(config, "intermediate_size", intermediate_size)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or (hidden_size // heads if heads else None)
        if kv_size is None and kv_heads and head_dim:
            kv_size = int(kv_heads) * int(head_dim)
    if not hidden_size:
        raise ArgumentError("{c} needs a hidden size: pass a model config with hidden_size, or {h}",
                            c=arg("CostModel.from_config"), h=arg("hidden_size", metavar="H"))
    h = check_int(hidden_size, "hidden_size")
    f = check_int(intermediate_size, "intermediate_size") if intermediate_size else 4 * h
    kv = check_int(kv_size, "kv_size") if kv_size else h
    layers = getattr(config, "num_hidden_layers", None) or 1
    return float(2 * h + 2 * kv + 3 * f), per_unit / (2 * h * layers)


def _encoder_work(config) -> float:
    """FLOPs of one media unit through a multimodal config's encoder (0.0 without one): per layer and token
    ``2 * (4 h^2 + 2 h f)`` (q, k, v, o and a two-matrix MLP of width ``f``), and ``4 p^2 h`` for the
    attention over the unit's ``p`` tokens (bidirectional: not halved). ``p`` is ``(image_size /
    patch_size)^2`` for a vision tower, ``max_source_positions`` for an audio one. A SigLIP-400M image of
    896 pixels (Gemma 3: 4,096 patches, h 1,152, f 4,304, 27 layers) is 5.5e12."""
    encoder = getattr(config, "vision_config", None) or getattr(config, "audio_config", None)
    if encoder is None or not hasattr(config, "get_text_config"):
        return 0.0
    h = getattr(encoder, "hidden_size", None) or getattr(encoder, "d_model", None)
    f = getattr(encoder, "intermediate_size", None) or getattr(encoder, "encoder_ffn_dim", None) or 4 * (h or 0)
    layers = getattr(encoder, "num_hidden_layers", None) or getattr(encoder, "encoder_layers", None)
    size, patch = getattr(encoder, "image_size", None), getattr(encoder, "patch_size", None)
    if size is not None and patch is not None:
        (height, width), (ph, pw) = (tuple(v) if isinstance(v, (list, tuple)) else (v, v) for v in (size, patch))
        p = (height // ph) * (width // pw)
    else:
        p = getattr(encoder, "max_source_positions", None)
    if not (h and layers and p):
        raise ArgumentError("{c} cannot size one media unit of {t}'s encoder (it reads hidden_size, "
                            "num_hidden_layers and image_size / patch_size or max_source_positions): pass "
                            "CostModel(linear=..., per_unit=...) with the encoder's work measured",
                            c=arg("CostModel.from_config"), t=type(config).__name__)
    return float(layers * (2 * (4 * h * h + 2 * h * f) * p + 4 * p * p * h))
