"""What packkit relies on in transformers, in one place: the attention-function registry, the call a model's
attention layer makes, the attention implementation a config names (:func:`attn_implementation`), LLaVA-NeXT's
image grids (:func:`llava_next_grids`), and the compiler of chat templates (:func:`jinja_compiler`).

A transformers attention function is called by every attention layer as::

    out, weights = fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)

with ``query: (batch, nheads, seq, headdim)``, ``key, value: (batch, nheads_kv, seq, headdim)``, and returns
``out: (batch, seq, nheads, headdim)``. The ``kwargs`` are the model's own: what the user passed to
``model(...)`` (a packed batch's ``cu_seq_lens_q`` / ``max_length_q``, a CP shard's ``cp_seq_idx``) and the
layer's (``is_causal``, ``sliding_window``, ``softcap``, ``s_aux``). packkit's attention functions
(:func:`packkit.attention.hf_varlen_attention`, :func:`packkit.cp.hf_cp_attention`) read that call through
:func:`read_call` and are registered by :func:`register`; nothing else in packkit names these keywords.

Checked against transformers 5.17 and 5.25 (``.ci/bounds.py`` runs the integration tests at the range's lowest release;
``tests/test_integrations.py`` runs a tiny model through a registered
function and fails when the installed version leaves :data:`SUPPORTED`: widen it there after checking).
"""

from __future__ import annotations

from .. import integrations

import warnings

__all__ = ["SUPPORTED", "UNSUPPORTED_FEATURES", "installed_version", "is_supported", "read_call", "register",
           "jinja_compiler", "StepCountHook", "StepNormalizer", "render_chat", "fast_backend", "prepare_input_caller",
           "trains_model_loss", "attn_implementation", "llava_next_grids"]

#: ``[first, past)``: the transformers releases this module is checked against (major.minor). Not below 5.17: a
#: ``Trainer`` resumed in a later epoch replayed epoch 0's order from packkit's batch sampler there (``set_epoch``
#: reached accelerate's loader only), examples trained twice or never without a word; CI tests the lowest release.
SUPPORTED = ((5, 17), (6, 0))

#: Keywords of a layer's call that packkit's attention functions do not implement (refused, not ignored).
UNSUPPORTED_FEATURES = ("sliding_window", "softcap", "s_aux")


def installed_version() -> str | None:
    """transformers's version string, or None when it is not installed."""
    return integrations.installed_version("transformers")


def is_supported(version: str) -> bool:
    """``is_supported("5.24.0") -> True``; ``"5.16.1"`` and ``"6.1.0"`` -> False (outside :data:`SUPPORTED`)."""
    return integrations.is_supported(version, SUPPORTED)


def register(name: str, attention) -> str:
    """Register ``attention`` with transformers' ``AttentionInterface`` under ``name`` and return the name, for
    ``attn_implementation=name``; warns, in one line, when the installed transformers is outside
    :data:`SUPPORTED` (the call may have changed)."""
    from transformers import AttentionInterface  # optional dependency, imported when used

    version = installed_version()
    if version is not None and not is_supported(version):
        first, past = (".".join(map(str, v)) for v in SUPPORTED)
        warnings.warn(f"packkit's {name!r} attention is checked against transformers >={first},<{past}; "
                      f"transformers {version} is installed: compare its outputs with attn_implementation='sdpa' "
                      "before training", stacklevel=3)
    AttentionInterface.register(name, attention)
    return name


def read_call(name: str, module, query, key, value, attention_mask, dropout: float, kwargs: dict, *,
              needs: tuple, hint: str, instead: str = ""):
    """``(q, k, v, needed, is_causal)`` of one call to a packkit attention function registered as ``name``.

    Refuses (ValueError, naming ``name``) a call without every keyword of ``needs`` (``hint`` says how a batch
    carries them), with an ``attention_mask``, with attention dropout, or with a feature of
    :data:`UNSUPPORTED_FEATURES` (``instead``, e.g. ``"; use attn_implementation='sdpa'"``, ends that error).
    ``q, k, v``: the packed layout ``(batch * seq, heads, headdim)`` (a view for one row, else one copy each);
    ``needed``: the values of ``needs``, in order; ``is_causal``: the call's, else the layer's.
    """
    needed = tuple(kwargs.get(k) for k in needs)
    if any(v is None for v in needed):
        raise ValueError(f"the {name} attention needs {hint}")
    if attention_mask is not None:
        raise ValueError(f"the {name} attention takes no attention_mask: documents come from {needs[0]}")
    if dropout:
        raise ValueError(f"the {name} attention has no attention dropout; got dropout={dropout} "
                         "(set the model config's attention_dropout to 0)")
    for feature in UNSUPPORTED_FEATURES:
        if kwargs.get(feature) is not None or getattr(module, feature, None) is not None:
            raise ValueError(f"the {name} attention does not implement {feature}{instead}")
    batch, _, seq, head_dim = query.shape
    # (batch, heads, seq, d) -> (batch * seq, heads, d): the packed layout.
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim) for t in (query, key, value))
    return q, k, v, needed, kwargs.get("is_causal", getattr(module, "is_causal", True))


def attn_implementation(config, default: str | None = None) -> str | None:
    """The attention implementation ``config`` names: its ``_attn_implementation`` (private: what
    ``from_pretrained(attn_implementation=...)`` and ``model.set_attn_implementation`` set, ``"eager"``, ``"sdpa"``,
    ``"flash_attention_2"``, ``"flex_attention"``, a registered name...), None where it names none.

    ``default`` given: that in place of a name that is None or empty (the transformers default is sdpa, so a caller
    asking what the model will run passes ``default="sdpa"``; one that tells "unset" from sdpa passes none).
    ``config``: a transformers config, the text config of a multimodal model (:func:`packkit.batch.text_config`).
    ``attn_implementation(LlamaConfig(attn_implementation="eager")) -> "eager"``;
    ``attn_implementation(LlamaConfig()) -> None``; ``attn_implementation(LlamaConfig(), "sdpa") -> "sdpa"``.
    """
    impl = getattr(config, "_attn_implementation", None)
    if default is None:
        return impl
    return impl or default


def llava_next_grids(image_sizes: list, config) -> list[tuple[int, int]]:
    """``[(height, width), ...]``, in patches, of each image's tiles as LLaVA-NeXT lays out their features: the grid of
    tiles ``get_anyres_image_grid_shape`` picks for the image's size (``image_sizes``: ``[[height, width], ...]`` in
    pixels) from ``config.image_grid_pinpoints``, unpadded to the image's aspect ratio by ``unpad_image`` (both private
    to ``transformers.models.llava_next.modeling_llava_next``, imported when called, once for all the images:
    transformers only for this family). ``config``: a LLaVA-NeXT or LLaVA-OneVision config (its ``vision_config``
    gives a tile's side in patches)."""
    import torch

    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    grids = []
    for size in image_sizes:
        rows, cols = get_anyres_image_grid_shape(size, config.image_grid_pinpoints, vision.image_size)
        height, width = unpad_image(torch.empty(1, rows * side, cols * side), size).shape[1:]
        grids.append((height, width))
    return grids


def jinja_compiler():
    """transformers' own compiler of chat templates, ``chat_template_utils._compile_jinja_template`` (private: the
    Jinja environment ``apply_chat_template`` renders with, its ``{% generation %}`` tag included), or None where
    transformers or that function is missing. ``jinja_compiler()(template)`` raises jinja2's
    ``TemplateSyntaxError`` on a template that does not compile."""
    try:
        from transformers.utils import chat_template_utils
    except ImportError:
        return None
    return getattr(chat_template_utils, "_compile_jinja_template", None)


def prepare_input_caller(frame, keys) -> tuple | None:
    """``(trainer, data)`` where a mapping with ``keys`` is being built by ``Trainer._prepare_input`` (private) as
    ``type(data)({k: self._prepare_input(v) for k, v in data.items()})``: the frame of that call found within
    three frames of ``frame`` (the mapping's constructor and its comprehension lie between), ``data`` the mapping it
    copies (the same keys); None for any other construction. ``.to(args.device)`` made the new tensors, and a CPU
    tensor moved to ``cpu:0`` (``args.device`` of a distributed CPU run) is a copy without what packkit noted on the
    old one: :class:`packkit.batch.PackedBatch` carries it over from ``data``."""
    for _ in range(3):
        if frame is None:
            return None
        if frame.f_code.co_name == "_prepare_input":
            data, trainer = frame.f_locals.get("data"), frame.f_locals.get("self")
            if isinstance(data, dict) and dict.keys(data) == keys:
                return trainer, data
        frame = frame.f_back
    return None


def trains_model_loss(trainer) -> bool:
    """Whether ``trainer`` trains its model's own loss from the labels (``Trainer.compute_loss`` without a
    ``compute_loss_func``, or a subclass's of transformers or TRL that calls it, ``SFTTrainer``'s): that loss is the
    token mean whatever weights packkit noted on the labels. A ``compute_loss`` of the user's own is theirs to read."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        return False
    module = getattr(getattr(type(trainer), "compute_loss", None), "__module__", None) or ""
    return module.split(".")[0] in ("transformers", "trl")


class StepNormalizer(float):
    """The optimiser step's normaliser ``Z`` of a ``loss_weighting`` (:mod:`packkit.weighting`), handed to
    ``compute_loss_func`` where ``Trainer`` hands its ``num_items_in_batch``
    (:func:`packkit.loss.hf_compute_loss_func` reads :attr:`loss_normalizer`)."""

    @property
    def loss_normalizer(self) -> float:
        return float(self)


class StepCountHook:
    """Overrides ``Trainer._get_num_items_in_batch(batch_samples, device)`` (private: ``Trainer`` draws every
    micro-batch of an optimiser step before the first forward and counts their loss tokens there, gathered
    over processes with ``average_tokens_across_devices``, then multiplies each loss back by the number of
    processes). A subclass supplies ``_step_normalizer(batch_samples, all_reduce)``: a :class:`StepNormalizer`,
    or None to keep ``Trainer``'s count (:class:`packkit.loss.WeightedLossMixin`). Also keeps the dataset columns
    named by ``kept_columns`` (``Trainer._set_signature_columns_if_needed``, private too)."""

    #: dataset columns the collator reads that no model's ``forward`` names: kept when ``Trainer`` removes the
    #: unused ones (``remove_unused_columns=True``, its default), which would otherwise drop them unsaid
    kept_columns: tuple = ()

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()  # Trainer's (or TRL's) list of the columns it keeps
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *self.kept_columns]))

    def _train_batch_sampler(self, has: str):
        """The batch sampler under ``Trainer``'s training loader whose attribute ``has`` is true, or None: the
        loader ``Trainer`` keeps in ``callback_handler.train_dataloader`` (private), its ``batch_sampler``
        (accelerate's ``BatchSamplerShard``), and so on inward (the sampler given, where a subclass builds the
        loader with ``batch_sampler=``)."""
        obj = getattr(getattr(self, "callback_handler", None), "train_dataloader", None)
        for _ in range(4):
            obj = getattr(obj, "batch_sampler", None)
            if obj is None:
                return None
            if getattr(obj, has, False):
                return obj
        return None

    def _get_num_items_in_batch(self, batch_samples: list, device):
        world = self.args.world_size
        z = self._step_normalizer(batch_samples, world > 1)
        if z is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        if world > 1 and not self.args.average_tokens_across_devices:
            raise ValueError("a loss_weighting needs TrainingArguments(average_tokens_across_devices=True) on "
                             f"{world} processes: Trainer then multiplies each loss back by the process count")
        return StepNormalizer(z)


def render_chat(tok, conversations: list, *, template: str, add_generation_prompt: bool = False,
                assistant_mask: bool = False) -> tuple[list, list | None] | None:
    """What ``tok.apply_chat_template(conversations, chat_template=template, tokenize=True, ...)`` renders before it
    tokenizes: ``(texts, spans)``, the rendered conversations and, with ``assistant_mask``, each one's
    ``{% generation %}`` character spans ``[(start, end), ...]`` (the ones its assistant mask marks the tokens of).
    The same steps as ``apply_chat_template`` (its messages normalised, the tokenizer's special tokens as template
    variables), through ``chat_template_utils``' ``_normalize_chat_messages`` and ``render_jinja_template``; None
    where transformers lacks them (call ``apply_chat_template`` then)."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        return None
    normalize, render = (getattr(ctu, n, None) for n in ("_normalize_chat_messages", "render_jinja_template"))
    if normalize is None or render is None:
        return None
    texts, spans = render(conversations=[normalize(c) for c in conversations],
                          chat_template=tok.get_chat_template(template, None),
                          return_assistant_tokens_mask=assistant_mask, add_generation_prompt=add_generation_prompt,
                          **tok.special_tokens_map)
    return texts, (spans if assistant_mask else None)


def fast_backend(tok):
    """The Rust ``tokenizers.Tokenizer`` behind a fast tokenizer when ``tok(texts, add_special_tokens=False)`` is
    its ``encode_batch(texts, add_special_tokens=False)`` (no truncation or padding set on it), else None."""
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend
