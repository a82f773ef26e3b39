"""What some model families read beyond the Hugging Face packed view, laid out by the collators.

=============================  ==================================================================================
collator                       for
=============================  ==================================================================================
``VisionLanguageCollator``     vision-language models with mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5):
                               ``position_ids`` ``[4, B, L]``, and the images and videos of the batch's
                               documents (``pixel_values``, ``image_grid_thw``, ...) in document order;
                               with ``config=`` of Gemma 3, Gemma 4, PaliGemma, Idefics3, SmolVLM, InternVL,
                               LLaVA-NeXT, LLaVA-OneVision or Qwen2-Audio, that family's media and masks
                               (:mod:`packkit.media`)
``HybridCollator``             hybrid linear-attention and state-space models (Qwen3-Next and Qwen3.5's
                               GatedDeltaNet, Bamba, FalconH1, GraniteMoeHybrid, NemotronH, LFM2): ``seq_idx``
=============================  ==================================================================================

Both wrap a packkit collator and add to its batch; the two compose (Qwen3.5 is both).

**mRoPE.** These models rotate by three position ids per token (temporal, height, width: text tokens
advance all three by one, an image's tokens take its grid), computed per sequence by the model's
``get_rope_index``. Packed, they read ``position_ids`` of shape ``[4, B, L]``: row 0 the text positions,
reset to 0 at every document, from which the model finds the documents (the same rule as for text
models); rows 1-3 the three mRoPE rows of each document, as its own ``get_rope_index`` gives them. Checked
against transformers 5.24: Qwen2-VL and Qwen2.5-VL read a 2-D ``position_ids`` (what the collators give a
text model) as the three rows *without* a text row, and then build their attention mask without the
documents, so that with sdpa or eager attention every token attends across documents, silently
(axolotl PR #3817 met this); Qwen3-VL and Qwen3.5 take row 0 from 2-D ids but rotate the images' tokens as
text. A window of two documents (``a``: text, an image of 2x2 merged patches, text; ``b``: text) and a
padding tail::

    input_ids        a0  <vs> <im> <im> <im> <im> <ve>  a1 | b0  b1 | pad pad
    position_ids[0]   0    1    2    3    4    5    6    7 |  0   1 |  0   1    text: reset per document
    position_ids[1]   0    1    2    2    2    2    4    5 |  0   1 |  0   1    temporal
    position_ids[2]   0    1    2    2    3    3    4    5 |  0   1 |  0   1    height
    position_ids[3]   0    1    2    3    2    3    4    5 |  0   1 |  0   1    width

Padding extends every row (a padding tail is a segment of its own, positions from 0), and
``cu_seqlens`` / ``cu_seq_lens_q`` are the text collator's own, one entry per segment (transformers PR
#47342 fixed ``cu_seqlens`` built three times too long from 3-D positions).

**Hybrid models.** Their linear-attention (GatedDeltaNet) or Mamba-2 layers carry a state along the
sequence, which attention masks do not reach: the kernels reset it where ``seq_idx`` changes (causal
conv1d, Mamba-2 scans) or at ``cu_seqlens`` (flash-linear-attention, which the layers take from
``cu_seq_lens_q``). Checked against transformers 5.24 on tiny models (``tests/test_hybrid_model.py``):
without ``seq_idx`` in the batch, Bamba, FalconH1, GraniteMoeHybrid, NemotronH and LFM2 mix documents
silently through those layers (on the CPU, and with the kernels too: the convolution reads ``seq_idx``
only), and Qwen3-Next and Qwen3.5 mix them in their convolution (with the kernels; on the CPU
they refuse, their GatedDeltaNet taking ``cu_seq_lens_q``); with ``seq_idx``, the kernels (``causal-conv1d``,
``mamba-ssm``, ``flash-linear-attention``) keep documents apart, and the PyTorch fallbacks that run
without them (on the CPU, say) refuse with a ``ValueError`` naming the package. No hybrid model of
transformers 5.24 trains packed on the CPU. Jamba's Mamba-1 layers take no ``seq_idx``: pack its data with
:class:`~packkit.collate.PaddedCollator`. flash-linear-attention takes ``cu_seqlens`` for a ``[1, T]``
batch only: use :class:`~packkit.collate.PaddingFreeCollator` for GatedDeltaNet models.
"""

from __future__ import annotations

import collections.abc

import numpy as np
import torch

from .batch import PackedBatch, text_config
from .integrations.transformers import attn_implementation
from .collate import FixedWindowCollator, PackedRowsCollator, PaddedCollator, PaddingFreeCollator, row_destinations
from .mediarows import row_documents, row_lengths
from .media import (FAMILIES, active_spans, check_media, family_of, media_inputs, media_tensor, span_blocks, span_masks,
                    token_columns)
from .packer import gather_index
from .located import ExampleTypeError, ExampleValueError, located, location
from .row_rules import example_values, grid_rows
from .segments import lengths_to_offsets

__all__ = ["VisionLanguageCollator", "HybridCollator", "mrope_position_ids", "example_positions", "check_vision",
           "vision_spec", "VISION_KEYS"]

#: Per-document vision inputs, concatenated along dim 0 in the order the documents take in the batch
#: (the model scatters image features into the image tokens in that order, and the vision tower isolates
#: images by their grid): patches ``(num_patches, C * T * P * P)``, grids ``(num_images, 3)`` (t, h, w),
#: and Qwen2.5-VL's seconds per video grid ``(num_videos,)``.
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
#: Per kind of vision input: its patches, its grids, the config's placeholder token, its mm_token_type_ids value.
_KINDS = (("image", "pixel_values", "image_grid_thw", "image_token_id", 1),
          ("video", "pixel_values_videos", "video_grid_thw", "video_token_id", 2))
_ROPE_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def mrope_position_ids(text_positions, positions, index, dest) -> np.ndarray:
    """The ``[4, B, W]`` int64 position ids of a packed batch for an mRoPE model.

    Args:
        text_positions: ``(B, W)`` int, the collator's positions (reset per segment, padding tails too):
            row 0, and every row on padding.
        positions: ``(3, N)`` int, every example's temporal/height/width positions, example after example.
        index: ``(T,)`` int, the column of ``positions`` of every real token of the batch, in batch order.
        dest: ``(T,)`` int, where each of those tokens is in the flattened ``(B * W,)`` batch.

    ``mrope_position_ids([[0, 1, 0, 0]], [[0, 7, 7], [0, 7, 8], [0, 8, 7]], [0, 1, 2], [0, 1, 2])`` ->
    ``[[[0, 1, 0, 0]], [[0, 7, 7, 0]], [[0, 7, 8, 0]], [[0, 8, 7, 0]]]`` (the last token a padding tail).
    """
    text = np.asarray(text_positions, dtype=np.int64)
    out = np.broadcast_to(text.reshape(1, -1), (4, text.size)).copy()
    out[1:, np.asarray(dest, dtype=np.int64)] = np.asarray(positions, dtype=np.int64)[:, np.asarray(index, np.int64)]
    return out.reshape(4, *text.shape)


def _as_array(value, dtype=None) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value) if dtype is None else np.asarray(value, dtype=dtype)


def _has_vision(ex) -> bool:
    return any(ex.get(key) is not None for key in VISION_KEYS)


def example_positions(ex, *, rope_index=None, where: int = 0) -> np.ndarray:
    """One example's mRoPE positions, ``(3, n)`` int64 for its ``n`` tokens (``where``: its index in the
    batch, for errors). To store them in a dataset: ``ds.map(lambda ex: {"position_ids":
    example_positions(ex, rope_index=model.model.get_rope_index)})``.

    From its ``position_ids`` (``(3, n)``, or ``(3, 1, n)`` as ``get_rope_index`` returns for one
    sequence); else from ``rope_index`` (the model's ``get_rope_index``) when it carries images or
    videos; else, text only, ``0..n-1`` on all three rows. ``example_positions({"input_ids": [5, 6]})``
    -> ``[[0, 1], [0, 1], [0, 1]]``.
    """
    i = where
    n = len(ex["input_ids"])
    given = ex.get("position_ids")
    if given is not None:
        pos = _as_array(given)
        if pos.ndim == 1 and pos.shape[0] == n and np.array_equal(pos, np.arange(n)):
            return np.broadcast_to(pos.astype(np.int64), (3, n))  # text-only positions
        if pos.ndim == 3 and pos.shape[1] == 1:
            pos = pos[:, 0]
        if pos.shape != (3, n) or pos.dtype.kind not in "iu":
            raise located(ExampleValueError, i, None, f"has position_ids of shape {list(pos.shape)} ({pos.dtype}) "
                          f"for {n} input_ids; mRoPE needs integer (3, {n}) positions (temporal, height, width), as "
                          "the model's get_rope_index gives them for this one example")
        return pos.astype(np.int64, copy=False)
    if not _has_vision(ex):
        return np.broadcast_to(np.arange(n, dtype=np.int64), (3, n))
    if rope_index is None:
        raise located(ExampleValueError, i, None, "has images or videos but no 3-D position_ids; pass "
                      "rope_index=model.model.get_rope_index, or store each example's positions from it")
    types = ex.get("mm_token_type_ids")
    if types is None:
        raise located(ExampleValueError, i, None, "has images or videos but no 'mm_token_type_ids', which "
                      "get_rope_index needs (the model's processor returns it); keep that column")
    try:  # the model's own errors about a bad grid name no example: the rules first, this example named
        check_vision([ex], vision_spec(None, rope_index))
    except (ExampleValueError, ExampleTypeError) as exc:
        raise located(type(exc), i, None, exc.text) from None
    kwargs = {key: torch.as_tensor(ex[key]) for key in _ROPE_KEYS if ex.get(key) is not None}
    pos, _ = rope_index(input_ids=torch.as_tensor(ex["input_ids"]).reshape(1, -1),
                        mm_token_type_ids=torch.as_tensor(types).reshape(1, -1), **kwargs)
    return _as_array(pos, np.int64).reshape(3, n)


class VisionLanguageCollator:
    """Wrap a packkit collator for an mRoPE vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5):
    its batch, with ``position_ids`` ``[4, B, L]`` and the documents' images (module docstring). Given the
    ``config`` of another multimodal family (:data:`packkit.media.FAMILIES`: Gemma 3, Gemma 4, PaliGemma,
    Idefics3, SmolVLM, InternVL, LLaVA-NeXT, LLaVA-OneVision, Qwen2-Audio), that family's media in batch order, its
    ``token_type_ids`` and, for Gemma 3 and Gemma 4, its mask per layer type instead (:mod:`packkit.media`).

    ``VisionLanguageCollator(PaddingFreeCollator(), rope_index=model.model.get_rope_index)`` then
    ``model(**batch)``: each document's logits are those of the document run alone.

    An example is what the model's processor gives for one conversation: ``input_ids`` (with the image
    placeholder tokens), optionally ``labels`` / a loss mask (read by the wrapped collator),
    ``pixel_values`` and ``image_grid_thw`` (and ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts``), and its mRoPE positions: ``position_ids`` ``(3, n)`` from
    ``get_rope_index``, or ``mm_token_type_ids`` with ``rope_index=`` to compute them here (once per
    example with images; text-only examples need neither). Vision inputs are concatenated along dim 0 in
    the order the documents take in the batch (:data:`VISION_KEYS`); keys no document carries are left out.

    Args:
        collator: a :class:`~packkit.collate.PaddingFreeCollator`, :class:`~packkit.collate.FixedWindowCollator`
            (``overflow="error"`` or ``"drop"``: a split or cut document would lose image tokens, or
            order them apart from their features), :class:`~packkit.collate.PaddedCollator`, or
            :class:`~packkit.collate.PackedRowsCollator` over rows ``pack_dataset`` packed with their media
            (:mod:`packkit.mediarows`; an mRoPE document's positions are then computed from its
            ``mm_token_type_ids`` and grids, packed with it, by ``rope_index``).
        rope_index: the model's ``get_rope_index`` (``model.model.get_rope_index``), called as
            ``rope_index(input_ids=(1, n), mm_token_type_ids=(1, n), image_grid_thw=..., ...)`` for
            examples with images and without ``position_ids``. In DataLoader workers started by
            ``spawn`` it pickles the model: store the positions in the dataset instead.
        config: the model's config (``model.config``), whose placeholder tokens (``image_token_id``,
            ``video_token_id``) and ``vision_config.spatial_merge_size`` every document's images are checked
            against (:func:`check_vision`); read from ``rope_index``'s model when not given. Examples with
            images need one of the two. A config of a family of :data:`packkit.media.FAMILIES` (by its
            ``model_type``) picks that family's adapter, and takes no ``rope_index``.
    """

    def __init__(self, collator, *, rope_index=None, config=None):
        if not isinstance(collator, (PaddingFreeCollator, FixedWindowCollator, PaddedCollator, PackedRowsCollator)):
            raise TypeError(f"VisionLanguageCollator wraps PaddingFreeCollator, FixedWindowCollator, PaddedCollator "
                            f"or PackedRowsCollator, got {type(collator).__name__}")
        if isinstance(collator, FixedWindowCollator) and collator.overflow in ("split", "truncate"):
            raise ValueError(f"FixedWindowCollator(overflow={collator.overflow!r}) would cut documents and their image "
                             "tokens apart from their features; use overflow='error' or 'drop', or raise window")
        if rope_index is not None and not callable(rope_index):
            raise TypeError(f"rope_index must be the model's get_rope_index (a callable), got {rope_index!r}")
        self.collator, self.rope_index, self.config = collator, rope_index, config
        self.family = family_of(config)
        if self.family is not None and rope_index is not None:
            raise TypeError(f"rope_index is for mRoPE models; {self.family.name} takes position_ids as text models do: "
                            "pass config=model.config alone")
        self.vision = None if self.family is not None else vision_spec(config, rope_index)
        cp = getattr(collator, "cp_size", 1)
        spans = active_spans(self.family, config) if self.family is not None else None
        if cp > 1 and (spans or getattr(self.family, "first_position", 0)):
            what = (f"its {spans} tokens attend both ways" if spans
                    else f"it numbers a document from {self.family.first_position}")
            raise ValueError(f"{self.family.name} under context parallelism (cp_size={cp}): {what}, which "
                             "packkit.cp.shard does not carry to the ranks; train it with cp_size=1")

    def __call__(self, examples) -> PackedBatch:
        if not isinstance(examples, collections.abc.Sequence) or isinstance(examples, collections.abc.Mapping):
            raise TypeError(f"VisionLanguageCollator takes a list of examples (dicts), got {type(examples).__name__}")
        examples = list(examples)
        if self.family is not None:
            return self._family_batch(examples)
        batch, index, dest, order = self._layout(examples)
        if isinstance(self.collator, PackedRowsCollator):  # rows packed offline: their documents, in row order
            examples = row_documents(examples)
        check_vision(examples, self.vision)
        positions = [example_positions(ex, rope_index=self.rope_index, where=i) for i, ex in enumerate(examples)]
        batch["position_ids"] = torch.from_numpy(
            mrope_position_ids(batch["position_ids"].numpy(), np.concatenate(positions, axis=1), index, dest))
        for key, value in _vision_inputs(examples, order).items():
            batch[key] = value
        return batch

    def _family_batch(self, examples) -> PackedBatch:
        """A family of :data:`packkit.media.FAMILIES`: its token columns, its media in batch order, and for a
        family whose own packed mask is wrong (Gemma 3's image spans), the mask of every layer type."""
        family = self.family
        spans = active_spans(family, self.config)
        if spans is not None:
            impl = attn_implementation(text_config(self.config), "sdpa")
            if impl not in ("eager", "sdpa", "flex_attention"):
                raise ValueError(f"{family.name}'s {spans} tokens attend both ways, which "
                                 f"attn_implementation={impl!r} cannot express in a packed batch; load the model with "
                                 "attn_implementation='sdpa', 'eager' or 'flex_attention' (never approximated)")
        batch, index, dest, order = self._layout(examples)
        if family.first_position:  # every segment numbered as the model numbers a document alone (PaliGemma: 1)
            batch["position_ids"] = batch["position_ids"] + family.first_position
        if isinstance(self.collator, PackedRowsCollator):  # rows packed offline: their documents, in row order
            examples = row_documents(examples)
        media = check_media(family, self.config, examples)
        for key, value in token_columns(family, examples, index, dest, tuple(batch.input_ids.shape)).items():
            batch[key] = value
        for key, value in media_inputs(family, media, order).items():
            batch[key] = value
        if family.own_mask and spans is not None and not isinstance(self.collator, PaddedCollator):
            blocks = span_blocks(spans, batch[family.token_keys[0]], batch.seq_idx)
            batch["attention_mask"] = span_masks(self.config, batch.seq_idx, blocks, spans_on=family.spans_on,
                                                 window_bounds_spans=family.window_bounds_spans)
        return batch

    def _layout(self, examples):
        """``(batch, index, dest, order)``: the wrapped collator's batch, the flat source token
        (examples back to back) and flat destination of each of its real tokens, and the examples in
        the order the batch holds them."""
        c = self.collator
        if isinstance(c, PackedRowsCollator):
            batch = c(examples)
            lengths = [len(row["input_ids"]) for row in examples]
            index = np.arange(sum(lengths), dtype=np.int64)
            documents = sum(len(row_lengths(row, r)) for r, row in enumerate(examples))
            return batch, index, row_destinations(lengths, batch.shape[1]), range(documents)
        if isinstance(c, FixedWindowCollator):
            batch, plan = c._pack(examples)
            index, _ = gather_index(plan, lengths_to_offsets(plan.lengths))
            return batch, index, row_destinations(plan.window_loads, c.window), plan.seg_example
        batch = c(examples)
        lengths = [len(ex["input_ids"]) for ex in examples]
        index = np.arange(sum(lengths), dtype=np.int64)
        dest = index if isinstance(c, PaddingFreeCollator) else row_destinations(lengths, batch.shape[1])
        return batch, index, dest, range(len(examples))

    def __repr__(self) -> str:
        return f"VisionLanguageCollator({self.collator!r}, rope_index={self.rope_index!r})"


def vision_spec(config=None, rope_index=None) -> tuple[int, int, int] | None:
    """``(image_token_id, video_token_id, spatial_merge_size)`` of a vision-language model, from its ``config``
    or from the model that ``rope_index`` (``model.model.get_rope_index``) is bound to; None when neither tells.
    A ``config`` that lacks them is an error naming what it lacks."""
    source = config if config is not None else getattr(getattr(rope_index, "__self__", None), "config", None)
    if source is None:
        return None
    merge = getattr(getattr(source, "vision_config", None), "spatial_merge_size", None)
    spec = {"image_token_id": getattr(source, "image_token_id", None),
            "video_token_id": getattr(source, "video_token_id", None), "vision_config.spatial_merge_size": merge}
    lacks = [name for name, v in spec.items() if v is None]
    if lacks:
        if config is None:
            return None
        kind = getattr(config, "model_type", None)
        if kind and spec["image_token_id"] is not None:  # a multimodal model of a family packkit does not pack
            raise TypeError(f"packkit packs the mRoPE vision-language models (Qwen-VL) and "
                            f"{', '.join(sorted(FAMILIES))}; model_type {kind!r} is not one of them yet (its "
                            f"{type(config).__name__} has no {', '.join(lacks)} for the mRoPE way): train it unpacked "
                            "(PaddedCollator alone)")
        raise TypeError(f"config must be the vision-language model's config (model.config), with image_token_id, "
                        f"video_token_id and vision_config.spatial_merge_size; this {type(config).__name__} has no "
                        f"{', '.join(lacks)}")
    return tuple(int(v) for v in spec.values())


def _shape(value) -> list | None:
    """The shape of patches given as a tensor, an array or nested lists; None when ragged."""
    if hasattr(value, "shape"):
        return list(value.shape)
    try:
        return list(np.shape(value))
    except ValueError:
        return None


def check_vision(examples, spec) -> None:
    """Every document's images and videos against what the model will compute from them, before any is
    concatenated (the model checks only the batch's totals, so a document's surplus patches would become the
    next document's image, silently).

    Per document and kind (images, videos): patches and grids come together; the grids are ``(n, 3)``
    integers >= 1 whose h and w the vision tower can merge (:func:`packkit.row_rules.grid_rows`); the patch rows
    are ``sum(t * h * w)`` (the tower reads ``t * h * w`` rows per grid) of one width across the batch; the text
    holds ``sum(t * h * w) / spatial_merge_size**2`` placeholder tokens (one per merged patch: the features the
    model scatters into them), as many as ``mm_token_type_ids`` marks; ``second_per_grid_ts``, one finite number
    per video. ``spec``: :func:`vision_spec`'s ``(image_token_id, video_token_id, merge)``, or None (then a
    document with images is an error: there is nothing to check them against).
    """
    width = {}
    for i, ex in enumerate(examples):
        ids = types = None
        for what, pixels, grid_key, token_attr, type_id in _KINDS:
            has_pixels, has_grid = ex.get(pixels) is not None, ex.get(grid_key) is not None
            if has_pixels != has_grid:
                have, lack = (pixels, grid_key) if has_pixels else (grid_key, pixels)
                raise located(ExampleValueError, i, None, f"has {have!r} but no {lack!r}; keep both columns the "
                              "processor returned")
            if spec is None:
                if has_pixels:
                    raise located(ExampleValueError, i, None, "has images or videos, which VisionLanguageCollator "
                                  "checks against the model's placeholder tokens and merge size; pass "
                                  "config=model.config (or rope_index=model.model.get_rope_index)")
                continue
            token, merge = spec[0 if what == "image" else 1], spec[2]
            if ids is None:
                ids = _as_array(ex["input_ids"]).reshape(-1)
                types = None if ex.get("mm_token_type_ids") is None else _as_array(ex["mm_token_type_ids"]).reshape(-1)
                if types is not None and types.size != ids.size:
                    raise located(ExampleValueError, i, None, f"has {types.size} 'mm_token_type_ids' for {ids.size} "
                                  "'input_ids'; they must match token for token")
            tokens = int(np.count_nonzero(ids == token))
            if not has_pixels:
                if tokens:
                    raise located(ExampleValueError, i, None, f"has {tokens} {what} placeholder tokens ({token_attr}="
                                  f"{token}) in 'input_ids' but no {pixels!r}; they would take another document's "
                                  f"{what} features: keep the {what}s the processor returned with this example")
                continue
            grid = grid_rows(ex[grid_key], i, key=grid_key, merge=merge)
            patches = int(grid.prod(axis=1).sum())
            shape = _shape(ex[pixels])
            if shape is None or len(shape) != 2 or shape[0] != patches:
                raise located(ExampleValueError, i, None, f"has {pixels!r} of shape {shape or 'ragged'} for {grid_key} "
                              f"{grid.tolist()}, which needs {patches} patch rows (t*h*w summed); keep the {pixels} and "
                              f"{grid_key} the processor returned for this example together")
            first = width.setdefault(pixels, (shape[1], i))
            if shape[1] != first[0]:
                raise located(ExampleValueError, i, None, f"has {pixels!r} rows of {shape[1]} values and "
                              f"{location(first[1])} of {first[0]}; every {what} of a batch comes from the same "
                              "processor (channels * temporal_patch_size * patch_size**2)")
            want = patches // merge ** 2
            if tokens != want:
                raise located(ExampleValueError, i, None, f"has {tokens} {what} placeholder tokens ({token_attr}="
                              f"{token}) in 'input_ids' for {grid_key} {grid.tolist()}, which the model turns into "
                              f"{want} (t*h*w / spatial_merge_size**2 = {patches} / {merge ** 2}); keep the text and "
                              f"the {what}s the processor returned together")
            marked = None if types is None else int(np.count_nonzero(types == type_id))
            if marked is not None and marked != tokens:
                raise located(ExampleValueError, i, None, f"has {marked} {what} tokens marked {type_id} in "
                              f"'mm_token_type_ids' for {tokens} {what} placeholder tokens in 'input_ids'; keep the "
                              "mm_token_type_ids the processor returned")
        seconds = ex.get("second_per_grid_ts")
        if seconds is not None and spec is not None:
            videos = 0 if ex.get("video_grid_thw") is None else len(grid_rows(ex["video_grid_thw"], i,
                                                                               key="video_grid_thw"))
            try:
                example_values([seconds], [videos], key="second_per_grid_ts", what="video")
            except (ExampleValueError, ExampleTypeError) as exc:  # about example 0 of one: this example
                raise located(type(exc), i, None, exc.text) from None


def _vision_inputs(examples, order) -> dict:
    """The vision inputs of the documents (checked by :func:`check_vision`), in ``order``: ``{key: tensor}``
    for every key of :data:`VISION_KEYS` some document carries."""
    out = {}
    for key in VISION_KEYS:
        parts = [media_tensor(examples[i][key]) for i in order if examples[i].get(key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


class HybridCollator:
    """Wrap a packkit collator for a hybrid linear-attention or state-space model: its batch, with
    ``seq_idx`` (int32, the shape of ``input_ids``: the segment of every token) beside ``cu_seq_lens_q``
    in the dict, where transformers hands both to the layers' kernels (module docstring).

    ``HybridCollator(PaddingFreeCollator())(examples)["seq_idx"]`` -> ``[[0, 0, 0, 1, 1]]`` for
    examples of 3 and 2 tokens. Wraps any packkit collator, :class:`VisionLanguageCollator` included.
    """

    def __init__(self, collator):
        if not callable(collator):
            raise TypeError(f"HybridCollator wraps a collator (a callable), got {collator!r}")
        self.collator = collator

    def __call__(self, examples) -> PackedBatch:
        batch = self.collator(examples)
        batch["seq_idx"] = batch.seq_idx
        return batch

    def __repr__(self) -> str:
        return f"HybridCollator({self.collator!r})"
