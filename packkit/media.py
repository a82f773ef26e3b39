"""Multimodal model families beyond mRoPE (Gemma 3, Gemma 4, PaliGemma, Idefics3, SmolVLM, InternVL, LLaVA-NeXT,
LLaVA-OneVision, Qwen2-Audio): one small adapter a family, read by
:class:`~packkit.model_inputs.VisionLanguageCollator` (``config=model.config`` picks it by ``model_type``).

A family says four things, and nothing else differs between them:

* **media**: the per-document tensors the model encodes (images, tiles, audio features), concatenated in
  the order the batch holds the documents (the model scatters the features into the placeholder tokens of
  the flattened batch in that order);
* **placeholders**: how many placeholder tokens each document's media become, checked document by document
  (the model checks only the batch's totals, so one document's surplus would become the next one's image);
* **token columns**: per-token inputs laid out like ``input_ids`` (``token_type_ids``, Gemma 4's
  ``mm_token_type_ids``), 0 on padding;
* **spans**: which tokens attend bidirectionally, on which layer types. Gemma 3: the tokens of one image, among
  themselves, on every layer; Gemma 4 (``use_bidirectional_attention="vision"``): the same, on its sliding
  layers only (its full layers stay causal); PaliGemma: a document's prefix (image and prompt,
  ``token_type_ids == 0``).

Which mask (checked against transformers 5.24, ``tests/test_vl_families.py``): packed through ``position_ids``
and ``token_type_ids``, Gemma 3 reads its sliding-window layers' image spans at each token's *position*
instead of its index (the span overlay is remapped with the causal mask), so every document after the first
attends wrongly inside itself, silently (logits off by 0.18-0.36 on a tiny model), and Gemma 4 the same
through ``mm_token_type_ids`` (0.28-0.38): packkit hands Gemma 3 and Gemma 4 their mask, one per layer type
(:func:`span_masks`). A 4-D mask is used as given, so the mask carries the whole
policy itself: documents, causality, spans and windows. PaliGemma composes its prefix, its documents (from
``position_ids``) and its windows right, given ``token_type_ids``; and it could not take a mask per layer type
(one 4-D mask would reach its sliding layers unwindowed): packkit lays out ``token_type_ids``, and numbers every
document from 1, as the model numbers a document alone (``Family.first_position``). The
other families attend causally; they find documents from ``position_ids`` like text models. For a window of
two documents, ``a`` (text, an image of 2 tokens, text) and ``b``, under Gemma 3's full layers (1 = may
attend)::

          a0 i0 i1 a1 b0 b1
      a0   1  .  .  .  .  .
      i0   1  1  1  .  .  .      the image's two tokens see each other both ways
      i1   1  1  1  .  .  .
      a1   1  1  1  1  .  .
      b0   .  .  .  .  1  .      never across documents
      b1   .  .  .  .  1  1

Its sliding layers keep ``q - k < sliding_window`` on top (Gemma 3: the window bounds the spans too;
PaliGemma 2: a prefix is seen whole, as the model itself composes them). Flash attention takes no such mask:
it is refused for these families, never approximated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from .batch import additive_mask, layer_types, mask_dtype, sliding_window, text_config
from .integrations.transformers import attn_implementation, llava_next_grids
from .mediarows import media_columns
from .located import ExampleValueError, located, location

__all__ = ["Family", "FAMILIES", "family_of", "active_spans", "span_blocks", "span_masks", "allowed_mask",
           "media_inputs", "check_media", "token_columns", "media_tensor"]


def media_tensor(value) -> torch.Tensor:
    """A document's media value as a tensor: a tensor or numpy array keeps its dtype; Python lists (what a
    ``datasets`` row without a format holds) take torch's, as ``torch.tensor`` and transformers' collators
    make them: floats the default dtype (float32 unless the user set another), not numpy's float64, which
    doubled the pixels' memory and handed the vision tower float64 inputs."""
    if isinstance(value, torch.Tensor):
        return value
    array = np.asarray(value)
    if array.dtype == np.float64 and not isinstance(value, np.ndarray):
        return torch.as_tensor(array, dtype=torch.get_default_dtype())
    return torch.as_tensor(array)


@dataclasses.dataclass(frozen=True)
class Family:
    """What one model family reads beyond the text batch (module docstring).

    Attributes:
        name: the family, for messages (``"Gemma 3"``).
        media: ``(key, dims)`` per media tensor: ``dims`` the dimensions of one unit (an image, a tile, an
            audio clip) after the unit axis; the document's tensor is ``(units, *unit)`` (or ``(1, units,
            *unit)`` as a processor returns it for one example).
        per_unit: ``(config, ex, units) -> (token_id, expected placeholder count)``.
        token_keys: per-token columns laid out like ``input_ids`` (0 on padding).
        spans: ``None``, ``"image"`` (each run of ``token_type_ids == 1``) or ``"prefix"`` (``token_type_ids
            == 0`` in a document): the tokens that attend bidirectionally among themselves; the column read is
            ``token_keys[0]``.
        window_bounds_spans: on sliding layers, the window applies to span pairs too (Gemma 3), or a span is
            seen whole (PaliGemma 2).
        spans_on: the layer types whose attention has the spans (None: every type); the others are causal.
        spans_switch: a text config attribute that turns the spans on (:func:`active_spans`).
        batch_axis: the media tensors are sent as ``(1, units, ...)`` (Idefics3) instead of ``(units, ...)``.
        own_mask: packkit hands the model its mask (:func:`span_masks`): the model's own packed mask
            is wrong for this family (Gemma 3); else the model composes spans and documents itself from
            ``token_type_ids`` and ``position_ids`` (PaliGemma, checked equal to each document alone).
        ragged: the media key whose units differ in their first dimension (LLaVA-NeXT's tiles per image):
            padded with zeros to the batch's longest, as the model's processor pads a batch (the model
            reads each image's own tiles from ``image_sizes``).
        refused: keys the family reads per batch row, which a packed row would give to all its documents
            (LLaVA-OneVision's ``batch_num_images``): an example carrying one is refused by name.
        first_position: the position of a document's first token when the model numbers a document alone
            (PaliGemma: 1, ``position_ids = arange(L) + 1  # Paligemma positions are 1-indexed`` in transformers'
            ``PaliGemmaModel.forward``); packkit's ``position_ids`` start every segment there. The relative
            geometry is the same either way, but RoPE's angles are rounded in float32: numbered from 0, a packed
            document differs from itself alone by ~5e-8 in float64 logits.
    """

    name: str
    media: tuple[tuple[str, int], ...]
    per_unit: Callable
    token_keys: tuple[str, ...] = ()
    spans: str | None = None
    window_bounds_spans: bool = True
    spans_on: tuple[str, ...] | None = None
    spans_switch: str | None = None
    batch_axis: bool = False
    own_mask: bool = False
    ragged: str | None = None
    refused: tuple[str, ...] = ()
    first_position: int = 0


def _fixed(config, count: int):
    return int(config.image_token_id), count


def _gemma3(config, ex, units):
    return _fixed(config, units * int(config.mm_tokens_per_image))


def _gemma4(config, ex, units):
    """Each image's real patches (``image_position_ids`` not ``(-1, -1)``) pooled ``k * k`` into one soft token
    (``k = vision_config.pooling_kernel_size``), as ``Gemma4Model.get_image_features`` splits its features."""
    if not units:
        return _fixed(config, 0)
    real = (media_tensor(ex["image_position_ids"]).reshape(units, -1, 2) != -1).all(-1).sum(-1)
    return _fixed(config, int((real // config.vision_config.pooling_kernel_size ** 2).sum()))


def _paligemma(config, ex, units):
    return _fixed(config, units * int(config.text_config.num_image_tokens))


def _idefics3(config, ex, units):
    vision = config.vision_config
    return _fixed(config, units * int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor ** 2))


def _internvl(config, ex, units):
    vision = config.vision_config
    side = [i // p for i, p in zip(vision.image_size, vision.patch_size)]
    return _fixed(config, units * int(round(side[0] * side[1] * config.downsample_ratio ** 2)))


def _qwen2_audio(config, ex, units):
    """Each clip's encoder output length from its real frames (``feature_attention_mask``), as
    ``Qwen2AudioEncoder._get_feat_extract_output_lengths`` computes it."""
    if not units:
        return int(config.audio_token_id), 0
    frames = media_tensor(ex["feature_attention_mask"]).reshape(units, -1).sum(-1)
    return int(config.audio_token_id), int((((frames - 1) // 2 + 1 - 2) // 2 + 1).sum())


def _llava_next(config, ex, units):
    """Each image's features as ``LlavaNextModel.pack_image_features`` lays them out: the base tile's patches,
    then the tiles' grid unpadded to the image's aspect ratio, a newline after every row. LLaVA-OneVision
    (``config.vision_aspect_ratio = "anyres_max_N"``) first shrinks a grid above ``1.1 * sqrt(N)`` tiles' worth of
    patches, as its ``pack_image_features`` does."""
    if not units:
        return int(config.image_token_id), 0
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    most = getattr(config, "vision_aspect_ratio", None)  # OneVision: its tower has no CLS token to keep
    base = side ** 2 + (most is None and config.vision_feature_select_strategy == "full")
    total = 0
    for height, width in llava_next_grids(media_tensor(ex["image_sizes"]).reshape(units, 2).tolist(), config):
        if most is not None:
            ratio = math.sqrt(height * width / (int(most.strip("anyres_max_")) * side ** 2))
            if ratio > 1.1:
                height, width = int(height // ratio), int(width // ratio)
        total += base + height * (width + 1)
    return int(config.image_token_id), total


#: ``model_type -> Family``: the families VisionLanguageCollator packs besides the mRoPE ones.
FAMILIES = {
    "gemma3": Family("Gemma 3", (("pixel_values", 3),), _gemma3, ("token_type_ids",), "image", True, own_mask=True),
    "gemma4": Family("Gemma 4", (("pixel_values", 2), ("image_position_ids", 2)), _gemma4, ("mm_token_type_ids",),
                     "image", spans_on=("sliding_attention",), spans_switch="use_bidirectional_attention",
                     own_mask=True),
    "paligemma": Family("PaliGemma", (("pixel_values", 3),), _paligemma, ("token_type_ids",), "prefix", False,
                        first_position=1),
    "idefics3": Family("Idefics3", (("pixel_values", 3), ("pixel_attention_mask", 2)), _idefics3, batch_axis=True),
    "smolvlm": Family("SmolVLM", (("pixel_values", 3), ("pixel_attention_mask", 2)), _idefics3, batch_axis=True),
    "internvl": Family("InternVL", (("pixel_values", 3),), _internvl),
    "llava_next": Family("LLaVA-NeXT", (("pixel_values", 4), ("image_sizes", 1)), _llava_next, ragged="pixel_values"),
    "llava_onevision": Family("LLaVA-OneVision", (("pixel_values", 4), ("image_sizes", 1)), _llava_next,
                              ragged="pixel_values", refused=("batch_num_images",)),
    "qwen2_audio": Family("Qwen2-Audio", (("input_features", 2), ("feature_attention_mask", 1)), _qwen2_audio),
}


def family_of(config) -> Family | None:
    """The :class:`Family` of a model's config (by ``config.model_type``), None for another model."""
    return FAMILIES.get(getattr(config, "model_type", None))


def _units(family: Family, ex, i: int) -> dict:
    """``{key: (units, *unit) tensor}`` of one document's media (empty when it has none); one unit count
    across its keys, the shape of a unit as the family reads it."""
    out, units = {}, None
    for key, dims in family.media:
        value = ex.get(key)
        if value is None:
            continue
        t = media_tensor(value)
        if family.batch_axis and t.dim() == dims + 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != dims + 1:
            raise located(ExampleValueError, i, None, f"has {key!r} of shape {list(t.shape)}; {family.name} reads "
                          f"(units, {dims} dims per unit){' or (1, units, ...)' if family.batch_axis else ''}, as "
                          "its processor returns it for one example")
        if units is not None and t.shape[0] != units[1]:
            raise located(ExampleValueError, i, None, f"has {t.shape[0]} units in {key!r} and {units[1]} in "
                          f"{units[0]!r}; keep the media the processor returned together")
        units = units or (key, t.shape[0])
        out[key] = t
    present = [key for key, _ in family.media if key in out]
    if out and len(present) != len(family.media):
        lack = [key for key, _ in family.media if key not in out]
        raise located(ExampleValueError, i, None, f"has {present[0]!r} but no {lack[0]!r}; keep every column the "
                      f"{family.name} processor returned")
    return out




def check_media(family: Family, config, examples) -> list[dict]:
    """Every document's media against its placeholder tokens (and ``token_type_ids``), before any is
    concatenated; returns each document's media (:func:`_units`). One unit shape across the batch."""
    shapes, media = {}, []
    known = {key for key, _ in family.media}
    for i, ex in enumerate(examples):
        for key in ex:
            if media_columns([key]) and key not in known and ex[key] is not None:  # else dropped, silently
                raise located(ExampleValueError, i, None, f"has {key!r}, which packkit does not pack for "
                              f"{family.name} (it packs {', '.join(sorted(known))}): drop it, or the example, knowing "
                              "its placeholders would stay unfilled")
        for key in family.refused:
            if ex.get(key) is not None:
                raise located(ExampleValueError, i, None, f"has {key!r}, which {family.name} reads per batch row "
                              "(not per document), so packkit does not pack it: drop the column for examples of one "
                              "image (it changes nothing there)")
        mine = _units(family, ex, i)
        ids = np.asarray(ex["input_ids"]).reshape(-1)
        units = next(iter(mine.values())).shape[0] if mine else 0
        token, want = family.per_unit(config, ex, units) if mine else (family.per_unit(config, ex, 0)[0], 0)
        have = int(np.count_nonzero(ids == token))
        if have != want:
            raise located(ExampleValueError, i, None, f"has {have} placeholder tokens (id {token}) in 'input_ids' "
                          f"for {units} media units, which {family.name} turns into {want} features; keep the text "
                          "and the media the processor returned together")
        for key, t in mine.items():
            unit = tuple(t.shape[2 if key == family.ragged else 1:])
            first = shapes.setdefault(key, (unit, i))
            if unit != first[0]:
                raise located(ExampleValueError, i, None, f"has {key!r} units of shape {list(t.shape[1:])} and "
                              f"{location(first[1])} {list(first[0])}; {family.name} encodes a batch's units "
                              "together: give every example the same processor's size")
        if family.spans == "image":
            _check_types(family, ex, i, ids, token)
        media.append(mine)
    return media


def _check_types(family: Family, ex, i: int, ids: np.ndarray, token: int) -> None:
    key = family.token_keys[0]
    types = ex.get(key)
    if types is None:
        raise located(ExampleValueError, i, None, f"has no {key!r}, which mark the image tokens that attend "
                      "each other both ways; keep the column the processor returned")
    types = np.asarray(types).reshape(-1)
    if types.shape != ids.shape or not np.array_equal(types == 1, ids == token):
        raise located(ExampleValueError, i, None, f"has {key!r} that do not mark exactly its image "
                      f"placeholder tokens (id {token}) with 1; keep the column the processor returned")


def active_spans(family: Family, config) -> str | None:
    """The family's spans for this model's config: a family with ``spans_switch`` has them only when its text
    config's switch reads ``"vision"`` (Gemma 4's ``use_bidirectional_attention``; None: causal, as text), and
    ``"all"`` (every token both ways, an encoder) is refused."""
    if family.spans_switch is None:
        return family.spans
    value = getattr(text_config(config), family.spans_switch, None)
    if value not in (None, "vision"):
        raise ValueError(f"{family.name} with {family.spans_switch}={value!r} attends both ways over whole documents; "
                         f"packkit packs it with {family.spans_switch}='vision' or None (causal text, image spans)")
    return family.spans if value == "vision" else None


def media_inputs(family: Family, media: list[dict], order) -> dict:
    """The documents' media in ``order`` (the batch's), concatenated unit after unit:
    ``{key: (units, ...)}``, or ``(1, units, ...)`` for a family with ``batch_axis``."""
    out = {}
    for key, _ in family.media:
        parts = [media[i][key] for i in order if key in media[i]]
        if parts and key == family.ragged:
            longest = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, longest - p.shape[1])) for p in parts]
        if parts:
            cat = torch.cat(parts)
            out[key] = cat[None] if family.batch_axis else cat
    return out


def token_columns(family: Family, examples, index, dest, shape) -> dict:
    """Per-token columns (``token_type_ids``) laid out like the batch's ``input_ids``: ``shape`` int64, the
    real tokens' values at ``dest`` (flat, in ``shape``) from ``index`` (flat, examples back to back), 0
    elsewhere. A document without the column (text only) counts as all 0."""
    out = {}
    for key in family.token_keys:
        flat = np.concatenate([np.zeros(len(ex["input_ids"]), np.int64) if ex.get(key) is None
                               else np.asarray(ex[key], dtype=np.int64).reshape(-1) for ex in examples])
        col = np.zeros(int(np.prod(shape)), np.int64)
        col[np.asarray(dest, np.int64)] = flat[np.asarray(index, np.int64)]
        out[key] = torch.from_numpy(col.reshape(shape))
    return out


def span_blocks(spans: str, token_type_ids: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, L]``: the bidirectional span of every token, -1 outside any.

    ``"image"``: each run of ``token_type_ids == 1`` its own span (a run cannot cross documents: every
    document starts with text); ``"prefix"``: the tokens with ``token_type_ids == 0`` of one segment.
    ``span_blocks("image", [[0, 1, 1, 0, 1]], [[0, 0, 0, 0, 1]]) -> [[-1, 0, 0, -1, 1]]``.
    """
    tt, seg = torch.as_tensor(token_type_ids), torch.as_tensor(seq_idx).to(torch.int64)
    if spans == "prefix":
        return torch.where(tt == 0, seg, -1)
    inside = tt == 1
    start = inside & ~torch.nn.functional.pad(inside, (1, 0))[:, :-1]
    run = torch.cumsum(start.reshape(-1).to(torch.int64), 0).reshape(tt.shape) - 1  # unique over the batch
    return torch.where(inside, run, -1)


def allowed_mask(seq_idx, blocks, *, window: int | None = None, window_bounds_spans: bool = True) -> torch.Tensor:
    """``[B, L, L]`` bool, True where query ``q`` may attend key ``k``: same segment, and causal (``k <= q``)
    or inside one span; with ``window``, ``q - k < window`` on the causal part, and on the spans when
    ``window_bounds_spans``. The slow, obvious composition, for eager and sdpa and for checking."""
    seg, blk = torch.as_tensor(seq_idx), torch.as_tensor(blocks)
    pos = torch.arange(seg.shape[-1], device=seg.device)
    dist = pos[:, None] - pos[None, :]  # q - k
    causal, span = dist >= 0, (blk[:, :, None] == blk[:, None, :]) & (blk[:, :, None] >= 0)
    if window is not None:
        near = dist < window
        causal = causal & near
        span = span & near if window_bounds_spans else span
    return (seg[:, :, None] == seg[:, None, :]) & (causal | span)


def _mask_mod(seg, blk, window, window_bounds_spans, b, h, q_idx, kv_idx):
    """FlexAttention's form of :func:`allowed_mask` (module level, so that a BlockMask pickles)."""
    causal, span = kv_idx <= q_idx, (blk[b, q_idx] == blk[b, kv_idx]) & (blk[b, q_idx] >= 0)
    if window is not None:
        near = q_idx - kv_idx < window
        causal = causal & near
        span = span & near if window_bounds_spans else span
    return (seg[b, q_idx] == seg[b, kv_idx]) & (causal | span)


def span_masks(config, seq_idx, blocks, *, window_bounds_spans: bool = True, spans_on=None, dtype=None):
    """The attention mask of a packed batch with bidirectional spans, for each layer type of the model:
    ``{"full_attention": mask, "sliding_attention": mask}`` (the types its layers have), what Gemma 3, Gemma 4
    and PaliGemma take as ``attention_mask`` as given, every layer its own; the spans only on the layer types
    of ``spans_on`` (None: all; Gemma 4: its sliding layers), the others causal.

    ``mask``: for ``attn_implementation="eager"`` additive float ``[B, 1, L, L]`` (0 / dtype minimum,
    ``dtype`` default the config's); ``"sdpa"`` bool ``[B, 1, L, L]`` (True = attend); ``"flex_attention"``
    a ``BlockMask``. Flash attention is refused: it takes no mask, and a causal kernel cannot give the
    spans; never approximated. Memory: ``B * L * L`` elements a layer type for eager and sdpa (quadratic in
    the window: prefer flex for long windows); the ``BlockMask`` keeps only the blocks that attend.
    """
    config = text_config(config)
    impl = attn_implementation(config, "sdpa")
    if impl not in ("eager", "sdpa", "flex_attention"):
        raise ValueError(f"this model's image or prefix tokens attend both ways, which attn_implementation={impl!r} "
                         "cannot express; load the model with attn_implementation='sdpa', 'eager' or 'flex_attention'")
    types = layer_types(config)
    other = sorted(types - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"span_masks knows full and sliding-window attention layers; this model also has {other}")
    window = sliding_window(config, types)
    out, none = {}, torch.full_like(torch.as_tensor(blocks), -1)
    for kind in sorted(types):
        w = window if kind == "sliding_attention" else None
        blk = blocks if spans_on is None or kind in spans_on else none
        if impl == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask  # lazy: flex only when asked for

            seg = torch.as_tensor(seq_idx)
            mod = functools.partial(_mask_mod, seg, torch.as_tensor(blk), w, window_bounds_spans)
            out[kind] = create_block_mask(mod, seg.shape[0], None, seg.shape[1], seg.shape[1], device=seg.device)
            continue
        allowed = allowed_mask(seq_idx, blk, window=w, window_bounds_spans=window_bounds_spans)
        out[kind] = allowed[:, None] if impl == "sdpa" else additive_mask(allowed, mask_dtype(None, config, dtype))
    return out
