"""``PackedBatch``: the tensors of a packed batch, and a view of them for every consumer.

A pack of three documents ``a`` (3 tokens), ``b`` (2) and ``c`` (2) in one padding-free row
(``[1, T]``, ``T = 7``), with labels shifted inside the model (the Hugging Face convention)::

    input_ids     a0   a1   a2 | b0   b1 | c0   c1
    position_ids   0    1    2 |  0    1 |  0    1
    labels      -100   a1   a2 |-100  b1 |-100  c1      first label of every document is -100
    seq_idx        0    0    0 |  1    1 |  2    2
    cu_seqlens    [0, 3, 5, 7]        max_seqlen = 3        num_loss_tokens = 4

    dense_mask()[0]  (query row, key column; 1 = may attend: block-diagonal and causal)
          a0 a1 a2 b0 b1 c0 c1
      a0   1  .  .  .  .  .  .
      a1   1  1  .  .  .  .  .
      a2   1  1  1  .  .  .  .
      b0   .  .  .  1  .  .  .
      b1   .  .  .  1  1  .  .
      c0   .  .  .  .  .  1  .
      c1   .  .  .  .  .  1  1

    hf_mask(model)[0, 0]  (what eager and sdpa attention add to the scores; m = dtype minimum)
          a0 a1 a2 b0 b1 c0 c1
      a0   0  m  m  m  m  m  m
      a1   0  0  m  m  m  m  m
      ...
      c1   m  m  m  m  m  0  0

In fixed windows (``[B, W]``) a row's padding tail is its own trailing segment, with positions from 0,
pad ids and labels ``-100``; ``cu_seqlens`` runs over the row-major flattened batch.

Views, so that nobody renames fields:

================  ================================================================================
consumer          view
================  ================================================================================
Hugging Face      the batch itself (a ``dict``: ``model(**batch)``), also ``hf_kwargs()``:
                  ``input_ids``, ``labels``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``,
                  ``use_cache=False`` and **no** ``attention_mask``
HF, explicit mask ``hf_mask(model)``: additive float ``[B, 1, L, L]`` (0 / dtype minimum) for eager and
                  sdpa, with the model's sliding window applied (a dict per layer type for models
                  that mix full and sliding layers)
flash-attn        ``flash_kwargs()``: ``cu_seqlens_q/k``, ``max_seqlen_q/k`` (``flash_attn_varlen_func``)
FlexAttention     ``block_mask()``: a document-causal ``BlockMask`` (flex is imported lazily)
SDPA (your own)   ``dense_mask()``: ``[B, L, L]`` bool, block-diagonal and causal (True = attend)
Mamba / linear    ``mamba_kwargs()``: ``seq_idx`` and ``cu_seqlens``
================  ================================================================================

Why the HF view carries no mask and sets ``use_cache=False`` (checked against transformers 5.24):
with ``attn_implementation="sdpa"`` or ``"eager"`` the model finds document boundaries from
``position_ids`` only when ``attention_mask`` is ``None`` and no cache object exists; any 2-D mask,
even all ones, or the cache that ``use_cache`` creates by default (in train mode too) turns that off
and every token attends across documents. Its flash-attention path reads ``cu_seq_lens_q/k``.
A 4-D mask is used as given, by every layer: eager *adds* it to the scores (a bool mask adds 1 and 0,
so documents attend across each other) and it replaces a sliding-window model's own window, which is
why the explicit-mask view is :meth:`PackedBatch.hf_mask` (float, windowed) and not ``dense_mask()``.

Where the counts live (no global state). The counts (``num_loss_tokens``, ``num_tokens``,
``num_examples``, the segment counts) must outlive what trainers do to the dict: set and pop keys, and
rebuild it from its items (``Trainer`` runs ``type(batch)({k: v.to(device) ...})`` every step). Each
count is kept on the tensor it describes, in that tensor's own ``__dict__`` (its *note*): the
loss-token count on the label tensor, the segment facts (``max_seqlen``, the real segments, how much
is padding) on ``cu_seqlens``, the token and document counts of the padded view (and its
``cu_seqlens``) on its ``attention_mask``. A read asks the tensor the view holds now: a new tensor
under a key is counted afresh (one read from its device), an unchanged one costs nothing, and a
rebuild from the same tensors (``accelerate`` moves the batch with ``.to()``, which carries the notes
over, then ``Trainer`` rebuilds it from those very tensors) has every count with no device work.
Chosen because it needs no hook on assignment, no table of what makes what stale and no registry of
batches (the design it replaced overrode 11 dict methods and filed every batch in a process-wide
table of weak references). Limits:

* padding cannot be read from a view (a row's padding tail and a last document without loss tokens
  look the same), so a batch rebuilt from *other* tensors (cloned, moved by hand, a plain dict from
  elsewhere) reads it from the labels: a row's last segment without a loss token counts as padding
  (:func:`real_tokens_and_documents`; exact whenever each row's last document has a loss token);
* a batch keeps the labels it loses (``pop``, ``del``, ``popitem``, ``clear``) to count them; a batch
  rebuilt from a mapping without labels has none and says so;
* a write into a tensor in place is not seen: put a new tensor under the key.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import numpy as np
import torch

from .errors import ArgumentError
from .integrations.transformers import attn_implementation, prepare_input_caller, trains_model_loss
from .segments import IGNORE_INDEX, lengths_to_offsets, range_index
from .weighting import piece_factors

__all__ = ["PackedBatch", "FIELDS", "real_tokens_and_documents", "loss_factors", "mark_repeat", "repeat_factors"]

#: the attributes of every batch (the varlen convention), whatever its view holds
FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "seq_idx", "num_loss_tokens",
          "attention_mask", "num_tokens", "num_examples", "num_real_segments", "labels_shifted")

_LABEL_KEYS = ("labels", "shift_labels")
#: the name of packkit's note in a tensor's ``__dict__``
_NOTE = "_packkit"


class PackedBatch(dict):
    """A packed (or padded) batch: a ``dict`` of the Hugging Face view, and the fields of the varlen
    convention as read-only attributes.

    The dict (what ``model(**batch)``, ``Trainer`` and TRL read, and may change)::

        packed   input_ids, labels, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                 max_length_k, [shift_labels], use_cache=False
        padded   input_ids, labels, position_ids, attention_mask, [shift_labels], use_cache=False

    Attributes:
        input_ids:       int64 ``[B, W]`` (fixed windows) or ``[1, T]`` (padding-free)
        labels:          int64, same shape; ``-100`` on padding, masked prompt tokens and the first
                         token of every document
        position_ids:    int64, same shape; ``0..len-1`` in every segment (a padding tail included);
                         ``[4, B, L]`` for mRoPE models, row 0 these (:mod:`packkit.model_inputs`)
        cu_seqlens:      int32 ``[S + 1]``, segment offsets over the row-major flattened batch;
                         with a static shape, padded by repeating the last offset (zero-length segments)
        max_seqlen:      Python int, the longest segment (``W`` with a static shape)
        seq_idx:         int32, same shape as ``input_ids``: the segment of every token (built from
                         ``cu_seqlens`` on first access, on the batch's device)
        num_loss_tokens: Python int, the loss terms of the labels: ``labels[..., 1:] != -100``, or every
                         ``shift_labels != -100`` for pre-shifted labels (the first label of every
                         document is ``-100``, so both agree on packkit's batches)
        attention_mask:  the view's mask (int64 ``[B, L]``, 1 on real tokens, for the padded fallback),
                         else None
        num_tokens:      Python int, real (non-padding) tokens
        num_examples:    Python int, documents (a piece of a split example counts as one)
        num_real_segments: Python int, segments of ``cu_seqlens`` that hold tokens (documents and
                         padding tails; static-shape zero-length padding excluded)
        labels_shifted:  bool, the loss reads pre-shifted ``shift_labels`` (built with
                         ``mask_first_label=False``: ``labels[t]`` is the target of token ``t``), so
                         neither the model nor ``Trainer`` shifts them again

    With a static shape, ``cu_seqlens`` ends in zero-length segments (a fixed length for
    ``torch.compile``), which some flash-attn versions mishandle (flash-attn #1537).
    ``hf_kwargs(static=False)`` / ``flash_kwargs(static=False)`` cut them off on the host (a view of the
    first ``num_real_segments + 1`` offsets, no device sync) at the price of a shape that varies.

    **A dict, like transformers' ``BatchEncoding``.** Trainers treat a batch as the dict it feeds the
    model: TRL's ``SFTTrainer`` sets ``inputs["use_cache"] = False``, losses ``pop("labels")``,
    ``Trainer`` and ``accelerate`` rebuild it as ``type(batch)({k: v.to(device) ...})``, some code checks
    ``isinstance(batch, dict)``. ``PackedBatch`` is a ``dict`` subclass: item assignment, ``pop``,
    ``update``, ``del``, ``setdefault``, ``copy()``, ``**batch``, pickling, ``.to()`` and
    ``pin_memory()`` all work, and ``**batch`` passes exactly the dict's items. ``==`` is identity
    (tensors have no truth value), so a batch is also hashable.

    **Counts are never stale**: each is read from the tensor the view holds now (the module docstring says
    where the counts live, and the limits). The loss count follows the labels the loss reads
    (``shift_labels`` when present, else ``labels``), and ``labels = batch.pop("labels")`` leaves
    ``batch.num_loss_tokens`` describing the labels removed.
    """

    # -- construction ---------------------------------------------------------------------------

    def __init__(self, mapping=None, /, *, input_ids=None, labels=None, position_ids=None,
                 cu_seqlens=None, max_seqlen=None, seq_idx=None, num_loss_tokens=None,
                 attention_mask=None, num_tokens=None, num_examples=None, num_real_segments=None,
                 labels_shifted=None):
        if mapping is not None:
            if not (input_ids is labels is position_ids is cu_seqlens is max_seqlen is seq_idx is num_loss_tokens
                    is attention_mask is num_tokens is num_examples is num_real_segments is labels_shifted is None):
                raise TypeError("PackedBatch takes either one mapping or keyword fields, not both")
            self._rebuild(mapping)
            return
        missing = [k for k, v in (("input_ids", input_ids), ("labels", labels), ("position_ids", position_ids),
                                  ("cu_seqlens", cu_seqlens)) if v is None]
        if missing:
            raise TypeError(f"PackedBatch is missing {', '.join(missing)}")
        _fill(self, input_ids, labels, position_ids, cu_seqlens, max_seqlen, seq_idx, num_loss_tokens,
              attention_mask, num_tokens, num_examples, num_real_segments, labels_shifted)

    @classmethod
    def _trusted(cls, *, input_ids, labels, position_ids, cu_seqlens, max_seqlen, num_loss_tokens, attention_mask,
                 num_tokens, num_examples, num_real_segments, labels_shifted, seq_idx=None) -> "PackedBatch":
        """A batch from every field, unchecked: the collators' hot path (``seq_idx`` left lazy)."""
        obj = dict.__new__(cls)
        _fill(obj, input_ids, labels, position_ids, cu_seqlens, max_seqlen, seq_idx, num_loss_tokens,
              attention_mask, num_tokens, num_examples, num_real_segments, labels_shifted)
        return obj

    def _rebuild(self, mapping) -> None:
        """Fill from a view (``Trainer``'s ``type(batch)({k: moved v})``); a ``PackedBatch`` is copied."""
        if isinstance(mapping, PackedBatch):
            dict.update(self, mapping)
            self.__dict__.update(mapping.__dict__)
            return
        if not isinstance(mapping, Mapping):
            mapping = dict(mapping)  # an iterable of pairs, as dict() takes
        if "input_ids" not in mapping:
            raise TypeError("cannot rebuild a PackedBatch from a mapping without 'input_ids' "
                            f"(keys: {sorted(mapping)})")
        if "cu_seq_lens_q" not in mapping and "position_ids" not in mapping:
            raise TypeError("cannot rebuild a PackedBatch from a mapping without 'cu_seq_lens_q' or 'position_ids' "
                            "(the segments)")
        dict.update(self, mapping)
        _carry_rebuilt_notes(mapping, sys._getframe(2))
        cu, mask = mapping.get("cu_seq_lens_q"), mapping.get("attention_mask")
        if cu is None:  # a padded view: its segments ride on its mask
            cu = _note(mask).get("cu_seqlens")
        self.__dict__.update(_cu=cu, _gone=None)
        if isinstance(cu, torch.Tensor) and "max_length_q" in mapping:  # a static shape's max_seqlen is W
            _note(cu).setdefault("max_seqlen", int(mapping["max_length_q"]))

    # -- a dict that remembers the labels it loses ----------------------------------------------

    def __delitem__(self, key):
        self._losing(key)
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        if key in self:
            self._losing(key)
        return dict.pop(self, key, *default)

    def popitem(self):
        if self:
            self._losing(next(reversed(self)))
        return dict.popitem(self)

    def clear(self):
        self._losing("labels")
        dict.clear(self)

    def _losing(self, key) -> None:
        """Before ``key`` leaves the view: if it holds labels, keep the labels the loss reads now, so
        that the count still describes them once none are left."""
        if key in _LABEL_KEYS:
            source = _loss_source(self)
            if source is not None:
                self.__dict__["_gone"] = source

    def copy(self) -> "PackedBatch":
        """A shallow copy (the same tensors), with the counts: ``type(batch)`` kept, unlike ``dict.copy``."""
        return type(self)(self)

    __copy__ = copy

    def __reduce__(self):
        """Pickled with the notes of its tensors (a DataLoader worker's queue does not carry them)."""
        gone = self.__dict__["_gone"]
        tensors = {id(t): t for t in (*self.values(), self.__dict__["_cu"], gone and gone[0])
                   if isinstance(t, torch.Tensor) and t.__dict__.get(_NOTE)}
        notes = [(t, dict(t.__dict__[_NOTE])) for t in tensors.values()]
        return _unpickle, (type(self), dict(self), dict(self.__dict__), notes)

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    # -- fields ---------------------------------------------------------------------------------

    input_ids = property(lambda self: dict.get(self, "input_ids"), doc="int64 ``[B, L]`` token ids")
    labels = property(lambda self: dict.get(self, "labels"), doc="int64 ``[B, L]`` labels (None once removed)")
    position_ids = property(lambda self: dict.get(self, "position_ids"), doc="int64 ``[B, L]``")
    attention_mask = property(lambda self: dict.get(self, "attention_mask"),
                              doc="the view's ``attention_mask`` (padded fallback), else None")

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 ``[S + 1]`` segment offsets: the view's ``cu_seq_lens_q``, else the batch's own (the
        padded view, or after ``cu_seq_lens_q`` was removed), else where ``position_ids`` restart: a position
        that does not follow the previous one by one starts a segment, as transformers finds documents (a family
        numbering from 1, PaliGemma, included)."""
        cu = dict.get(self, "cu_seq_lens_q")
        if cu is None:
            cu = self.__dict__["_cu"]
        if cu is None:  # a padded view rebuilt from tensors packkit did not make
            flat = self["position_ids"]
            if flat.dim() == 3 and flat.shape[0] == 3:  # mRoPE rows without the text row: an image's tokens share
                flat = flat[0].reshape(-1)            # their temporal position, so only a 0 starts a segment
                starts = torch.nonzero(flat == 0).reshape(-1)
            else:
                flat = (flat[0] if flat.dim() == 3 else flat).reshape(-1)  # mRoPE [4, B, L]: row 0 is the text
                starts = torch.nonzero(torch.diff(flat, prepend=flat[:1]) != 1).reshape(-1)
            end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
            cu = self.__dict__["_cu"] = torch.cat([starts, end]).to(torch.int32)
        return cu

    @property
    def seq_idx(self) -> torch.Tensor:
        """int32, the shape of ``input_ids``: the segment of every token, from ``cu_seqlens``."""
        cu, shape = self.cu_seqlens, self.input_ids.shape
        note = _note(cu)
        seq_idx = note.get("seq_idx")
        if seq_idx is None or seq_idx.shape != shape:
            seq_idx = note["seq_idx"] = _seq_idx_of(cu, shape)
        return seq_idx

    @property
    def num_loss_tokens(self) -> int:
        """Python int, the loss terms of the labels the loss reads."""
        labels, shifted = self._loss_source()
        return count_loss_tokens(labels, shifted=shifted)

    @property
    def labels_shifted(self) -> bool:
        """bool, the loss reads pre-shifted ``shift_labels``."""
        return self._loss_source()[1]

    num_tokens = property(lambda self: self._tokens_and_examples()[0], doc="Python int, real tokens")
    num_examples = property(lambda self: self._tokens_and_examples()[1], doc="Python int, documents")
    num_real_segments = property(lambda self: self._segments()["num_real_segments"],
                                 doc="Python int, non-empty segments (padding tails included)")
    max_seqlen = property(lambda self: self._segments()["max_seqlen"], doc="Python int, the longest segment")

    @property
    def loss_weight(self) -> torch.Tensor:
        """float32, the shape of the labels the loss reads: each label's factor ``a_c`` under the batch's
        ``loss_weighting`` (:mod:`packkit.weighting`; 0 where the label is -100), before the step's
        normaliser ``Z``. Without a weighting (the token mean) ``a_c = 1``; 0 on every label of a micro-batch that
        only repeats examples of another of its step (:func:`mark_repeat`). Built on first use, on the
        labels' device (:func:`loss_factors`: the collator notes the segments, nothing per token)."""
        labels, _ = self._loss_source()
        note = _note(labels)
        if "loss_weight" not in note:
            found = loss_factors(labels)
            weight = labels.ne(IGNORE_INDEX) if found is None else found[0]
            note["loss_weight"] = (weight if not note.get(REPEAT) else torch.zeros_like(weight)).to(torch.float32)
        return note["loss_weight"]

    @property
    def loss_norm(self) -> float:
        """Python float, this batch's part of the step's normaliser ``Z`` (the sum of its documents'
        ``z_c``; the token mean's is ``num_loss_tokens``; 0 for a repeat, :func:`mark_repeat`)."""
        labels, _ = self._loss_source()
        found = loss_factors(labels)
        if found is None:
            return 0.0 if _note(labels).get(REPEAT) else float(self.num_loss_tokens)
        return float(found[1])

    @property
    def loss_weighting(self) -> str | None:
        """The name of the :mod:`packkit.weighting` the batch's weights were made under (None: the token
        mean)."""
        return _note(self._loss_source()[0]).get("loss_weighting")

    @property
    def loss_step_constant(self) -> float:
        """The part of ``Z`` its weighting counts once a step, not per document (verl's
        ``seq-mean-token-sum-norm``: its length), else 0."""
        return _note(self._loss_source()[0]).get("loss_step_constant", 0.0)

    def _weigh(self, weighting, **parts) -> "PackedBatch":
        """Note a weighting on the labels (the collators): its name, the segments (``cu``) and what
        :func:`loss_factors` needs (``seg_doc``, ``values``, ``num_docs``), or the factors already made
        (``seg_factor`` float64 per segment, ``z``: a callable's, computed where it runs). Tensors, names,
        numbers and plain weightings only: a batch crosses processes, a callable may not."""
        note = _note(self._loss_source()[0])
        if not _WEIGHT_NOTES.isdisjoint(note):  # weighed before: the old weights go (the counts of labels stay)
            for key in _WEIGHT_NOTES.intersection(note):
                del note[key]
        # a loop over the parts with their keys made once, not a comprehension (a function called, a string made
        # per part: a fifth of the weights' step in a collate, benchmarks/bench_weighting.py)
        for k, v in parts.items():
            if v is not None:
                note[_PART_NOTES.get(k) or f"loss_{k}"] = v
        note["loss_weighting"] = weighting.name
        note["loss_step_constant"] = weighting.step_constant()
        if "seg_factor" not in parts:
            note["loss_rule"] = weighting
        return self

    def _loss_source(self) -> tuple[torch.Tensor, bool]:
        """``(labels, shifted)`` the loss reads, or the last ones removed."""
        source = _loss_source(self) or self.__dict__["_gone"]
        if source is None:
            raise ValueError("this batch carries no labels (removed before this batch saw them, or rebuilt from "
                             "a mapping without them); read num_loss_tokens before removing labels, or set "
                             "batch['labels']")
        return source

    def _segments(self) -> dict:
        """The note of ``cu_seqlens``, with ``num_real_segments`` and ``max_seqlen`` (one device read)."""
        cu = self.cu_seqlens
        note = _note(cu)
        if "num_real_segments" not in note or "max_seqlen" not in note:
            seg_len = (cu[1:] - cu[:-1]).to(torch.int64)
            longest = seg_len.max() if seg_len.numel() else seg_len.new_zeros(())
            real, longest = torch.stack([(seg_len > 0).sum(), longest]).tolist()
            note.setdefault("num_real_segments", real)
            note.setdefault("max_seqlen", longest)
        return note

    def _tokens_and_examples(self) -> tuple[int, int]:
        """``(num_tokens, num_examples)``: from the padded view's mask, else from the padding noted on
        ``cu_seqlens``, else (segments packkit did not make) read from the labels."""
        ids, mask = self.input_ids, dict.get(self, "attention_mask")
        if _is_padding_mask(mask, ids):
            note = _note(mask)
            if "num_tokens" not in note:
                per_row = mask.reshape(mask.shape[0], -1).ne(0).sum(-1, dtype=torch.int64)
                note["num_tokens"], note["num_examples"] = torch.stack([per_row.sum(), per_row.gt(0).sum()]).tolist()
            return note["num_tokens"], note["num_examples"]
        pad = _note(self.cu_seqlens).get("pad")
        if pad is not None:
            return ids.numel() - pad[0], self.num_real_segments - pad[1]
        source = _loss_source(self) or self.__dict__["_gone"]
        labels = dict.get(self, "labels", source and source[0])
        if labels is None:
            labels = torch.zeros(ids.shape, dtype=torch.int64, device=ids.device)  # no tails known
        cu = self.cu_seqlens
        if cu.device.type == "cpu" and labels.device.type == "cpu":  # ints on the host, no tensor made
            return _host_tokens_and_documents(cu.numpy(), labels)
        return tuple(torch.stack(real_tokens_and_documents(cu, labels)).tolist())

    # -- shape ----------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, L)``: ``(1, T)`` padding-free, ``(num_windows, W)`` fixed windows."""
        return tuple(self.input_ids.shape)

    @property
    def num_segments(self) -> int:
        """``S``: entries of ``cu_seqlens`` minus one (zero-length static-shape padding included)."""
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    # -- moving ---------------------------------------------------------------------------------

    def _map(self, fn) -> "PackedBatch":
        """A batch with ``fn`` applied to every tensor, notes carried over (each tensor once: aliases
        stay aliases)."""
        moved = {}

        def move(v):
            if isinstance(v, dict):  # a mask per layer type (packkit.media.span_masks)
                return {k: move(x) for k, x in v.items()}
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) not in moved:
                new = moved[id(v)] = fn(v)
                note = v.__dict__.get(_NOTE)
                if note and new is not v:
                    _note(new).update({k: move(x) for k, x in note.items()})  # seq_idx moves too
            return moved[id(v)]

        new = dict.__new__(type(self))
        dict.update(new, {k: move(v) for k, v in self.items()})
        gone = self.__dict__["_gone"]
        new.__dict__.update(_cu=move(self.__dict__["_cu"]), _gone=gone and (move(gone[0]), gone[1]))
        return new

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        """The batch on ``device``; ``max_seqlen`` and the counts stay Python ints."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self, device=None) -> "PackedBatch":
        """The batch in page-locked memory (``DataLoader(pin_memory=True)`` calls this).

        Needs an accelerator: torch raises ``RuntimeError`` without one, as for a plain tensor.
        """
        return self._map(lambda t: t.pin_memory() if device is None else t.pin_memory(device))

    # -- views ----------------------------------------------------------------------------------

    @property
    def is_static(self) -> bool:
        """``cu_seqlens`` carries zero-length static-shape padding after the real segments."""
        return self.num_real_segments < self.num_segments

    def _cu_view(self, static: bool) -> torch.Tensor:
        """``cu_seqlens``, cut to the real segments unless ``static`` (a view: no copy, no sync)."""
        return self.cu_seqlens if static else self.cu_seqlens[: self.num_real_segments + 1]

    def hf_kwargs(self, *, static: bool = True) -> dict:
        """Keyword arguments for a Hugging Face causal LM: ``model(**batch.hf_kwargs())``, a plain dict
        of the batch's items (``model(**batch)`` is the same with ``static=True``).

        Packed: ``input_ids``, ``labels``, ``position_ids``, ``cu_seq_lens_q/k`` (int32),
        ``max_length_q/k`` (int), ``use_cache=False``, no ``attention_mask``; with pre-shifted labels
        (``labels_shifted``) also ``shift_labels`` (HF's loss and ``Trainer`` use them unshifted).
        Padded fallback: ``input_ids``, ``labels``, ``position_ids``, ``attention_mask``, ``use_cache=False``.
        ``static=False`` drops a static-shape batch's zero-length segments from ``cu_seq_lens_q/k``
        (flash-attn #1537) and gives up the fixed length.
        """
        out = dict(self)
        if not static and "cu_seq_lens_q" in out:
            cu = self._cu_view(False)
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        return out

    def flash_kwargs(self, *, static: bool = True) -> dict:
        """``cu_seqlens_q/k`` int32 ``[S + 1]`` and ``max_seqlen_q/k`` int, for
        ``flash_attn_varlen_func(q, k, v, **batch.flash_kwargs(), causal=True)`` with
        ``q: (total_tokens, nheads, headdim)`` from the flattened batch. ``static`` as in
        :meth:`hf_kwargs`."""
        cu = self._cu_view(static)
        return {"cu_seqlens_q": cu, "cu_seqlens_k": cu,
                "max_seqlen_q": self.max_seqlen, "max_seqlen_k": self.max_seqlen}

    def mamba_kwargs(self) -> dict:
        """``seq_idx`` int32 ``[B, L]`` and ``cu_seqlens`` int32 ``[S + 1]`` for Mamba-style kernels."""
        return {"seq_idx": self.seq_idx, "cu_seqlens": self.cu_seqlens}

    def dense_mask(self, *, sliding_window: int | None = None) -> torch.Tensor:
        """``[B, L, L]`` bool, ``mask[b, q, k]``: query ``q`` may attend key ``k`` (same segment,
        ``k <= q``, and ``q - k < sliding_window`` when given). True means *attend*: what
        ``torch.nn.functional.scaled_dot_product_attention(attn_mask=mask[:, None])`` and FlexAttention
        expect. **Not** for a Hugging Face model's ``attention_mask``: eager attention adds the mask to the
        scores (True/False become +1/0 and documents attend across each other), and a sliding-window
        model loses its window; use :meth:`hf_mask` there. Memory is quadratic in ``L``: for tests and
        small batches."""
        seg = self.seq_idx
        length = seg.shape[-1]
        pos = torch.arange(length, device=seg.device)
        dist = pos[:, None] - pos[None, :]  # q - k
        allowed = dist >= 0
        if sliding_window is not None:
            allowed &= dist < _positive(sliding_window, "sliding_window")
        return (seg[:, :, None] == seg[:, None, :]) & allowed

    def hf_mask(self, model, *, dtype: torch.dtype | None = None):
        """The explicit attention mask of this batch for a Hugging Face model with eager or sdpa
        attention: ``model(**batch, attention_mask=batch.hf_mask(model))``.

        Returns an additive float mask ``[B, 1, L, L]`` of ``dtype`` (0 where a query may attend a key,
        ``torch.finfo(dtype).min`` elsewhere): eager attention adds it to the scores and sdpa takes it
        as ``attn_mask``, both as given (transformers uses a 4-D mask without changing it, for every
        layer). It is block-diagonal and causal, and applies the model's sliding window
        (``config.sliding_window``, positions ``q - k < window``) to the layers that have one: a model
        whose layers are all full or all sliding gets one tensor; a model that mixes them
        (``config.layer_types``: Gemma2, Gemma3, Qwen2 with ``max_window_layers``) gets a dict
        ``{"full_attention": mask, "sliding_attention": mask}``, which those models take per layer.

        You rarely need it: ``model(**batch)`` carries no mask, and transformers then finds the
        documents from the restarting ``position_ids`` and applies each layer's window itself. It is
        for code that must hand the model a mask (a custom attention function registered for eager
        or sdpa, a model without packed-sequence detection) and for checking. The padded fallback's
        own 2-D ``attention_mask`` needs none of this. Memory is ``B * L * L`` elements per layer type.

        Args:
            model: a ``PreTrainedModel`` or its config (``attn_implementation`` is read from it).
            dtype: the mask's float dtype, the dtype of the attention scores (sdpa refuses a float mask
                of another dtype); default: the model's parameters' dtype, else the config's ``dtype``,
                else ``torch.get_default_dtype()``.

        Raises ``ValueError`` (naming the reason) for an attention implementation that takes no such
        mask (flash attention reads ``cu_seq_lens_q/k``: pass the batch as is; flex attention:
        ``block_mask()``), for layer types other than full and sliding attention (chunked, linear...),
        and for bidirectional sliding windows.
        """
        config = text_config(model)
        impl = attn_implementation(config)
        if impl not in (None, "eager", "sdpa"):
            how = ("pass the batch without a mask (model(**batch)): flash attention reads cu_seq_lens_q/k"
                   if "flash" in str(impl) else "pass the batch without a mask (model(**batch)), or load the "
                   "model with attn_implementation='sdpa' or 'eager'")
            raise ValueError(f"hf_mask builds the 4-D mask of eager and sdpa attention; this model uses "
                             f"attn_implementation={impl!r}: {how}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("hf_mask builds causal masks; this model uses bidirectional attention "
                             "(config.use_bidirectional_attention), whose window is not causal")
        types = layer_types(config)
        other = sorted(types - {"full_attention", "sliding_attention"})
        if other:
            raise ValueError(f"hf_mask knows full and sliding-window attention layers; this model also has "
                             f"{other} layers, whose masks it cannot build: pass the batch without a mask "
                             "(model(**batch)) and let the model build them from position_ids")
        window = sliding_window(config, types)
        dtype = mask_dtype(model, config, dtype)
        masks = {kind: additive_mask(self.dense_mask(sliding_window=window if kind == "sliding_attention" else None),
                                     dtype) for kind in sorted(types)}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def block_mask(self, *, BLOCK_SIZE: int = 128):
        """A document-causal FlexAttention ``BlockMask`` over ``[B, L]`` (imports flex lazily)."""
        from torch.nn.attention.flex_attention import create_block_mask

        seg = self.seq_idx

        def document_causal(b, h, q_idx, kv_idx):
            return (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)

        batch, length = seg.shape
        return create_block_mask(document_causal, batch, None, length, length, device=seg.device,
                                 BLOCK_SIZE=BLOCK_SIZE)

    def __repr__(self) -> str:
        kind = "padded" if _is_padding_mask(self.get("attention_mask"), self.input_ids) else "packed"
        return f"PackedBatch({kind}, shape={list(self.shape)}, keys={list(self)}, device={self.device})"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _fill(obj, input_ids, labels, position_ids, cu, max_seqlen, seq_idx, num_loss_tokens, attention_mask,
          num_tokens, num_examples, num_real_segments, labels_shifted) -> None:
    """Lay a new batch's fields out as its view, and note the counts it was given on their tensors
    (positional: the hot path)."""
    shifted = bool(labels_shifted)
    segments = _note(cu)
    if max_seqlen is not None:
        segments["max_seqlen"] = max_seqlen
    if num_real_segments is not None:
        segments["num_real_segments"] = num_real_segments
    if seq_idx is not None:
        segments["seq_idx"] = seq_idx
    if num_loss_tokens is not None:
        _note(labels)["shifted_loss_tokens" if shifted else "loss_tokens"] = num_loss_tokens
    if attention_mask is None:
        if max_seqlen is None:
            max_seqlen = _max_segment(cu)
        dict.__init__(obj, input_ids=input_ids, labels=labels, position_ids=position_ids, cu_seq_lens_q=cu,
                      cu_seq_lens_k=cu, max_length_q=max_seqlen, max_length_k=max_seqlen)
        if num_tokens is not None and num_examples is not None and num_real_segments is not None:
            segments["pad"] = (input_ids.numel() - num_tokens, num_real_segments - num_examples)
    else:
        dict.__init__(obj, input_ids=input_ids, labels=labels, position_ids=position_ids,
                      attention_mask=attention_mask)
        note = _note(attention_mask)
        note["cu_seqlens"] = cu
        if num_tokens is not None and num_examples is not None:
            note.update(num_tokens=num_tokens, num_examples=num_examples)
    if shifted:
        dict.__setitem__(obj, "shift_labels", labels)
    dict.__setitem__(obj, "use_cache", False)
    obj.__dict__.update(_cu=cu, _gone=None)


def count_loss_tokens(labels: torch.Tensor, *, shifted: bool = False) -> int:
    """Python int, the loss terms of ``labels`` (``[..., W]``): ``labels[..., 1:] != -100``, or every entry of
    pre-shifted ``shift_labels`` that is not -100; counted once a tensor and kept in its note (a collator that
    built the batch wrote it there already; every CP rank of a process reads it). ``[[-100, 5, 6]] -> 2``."""
    note = _note(labels)
    key = "shifted_loss_tokens" if shifted else "loss_tokens"
    if key not in note:
        note[key] = int((labels if shifted else labels[..., 1:]).ne(IGNORE_INDEX).sum())
    return note[key]


#: what a weighting notes on the labels (:meth:`PackedBatch._weigh`, :func:`loss_factors`): not their
#: loss-token counts (``loss_tokens``, ``shifted_loss_tokens``), which are the labels' whatever the weighting
_WEIGHT_NOTES = frozenset({"loss_weighting", "loss_step_constant", "loss_rule", "loss_cu", "loss_seg_doc",
                           "loss_values", "loss_whole", "loss_num_docs", "loss_seg_factor", "loss_z", "loss_factor",
                           "loss_weight"})
#: the note of each part :meth:`PackedBatch._weigh` takes (``cu`` -> ``loss_cu``)
_PART_NOTES = {k: f"loss_{k}" for k in ("cu", "seg_doc", "values", "whole", "num_docs", "seg_factor", "z")}


def _note(tensor) -> dict:
    """What packkit knows about ``tensor`` (its counts), kept in the tensor's own ``__dict__`` so that
    it goes wherever the tensor goes; a throwaway dict for anything else."""
    if not isinstance(tensor, torch.Tensor):
        return {}
    return tensor.__dict__.setdefault(_NOTE, {})


def _carry_notes(old, new) -> None:
    """Give ``new`` (a copy of tensor ``old``, the same shape: e.g. ``old.to(device)`` where the device names
    another) what packkit noted on ``old``, its tensors moved to ``new``'s device; nothing where ``old`` has no note
    or ``new`` is ``old``. ``_carry_notes(labels, labels.clone())`` keeps the labels' loss weights on the clone."""
    note = old.__dict__.get(_NOTE) if isinstance(old, torch.Tensor) else None
    if note and isinstance(new, torch.Tensor) and new is not old and new.shape == old.shape:
        _note(new).update({k: v.to(new.device) if isinstance(v, torch.Tensor) else v for k, v in note.items()})


def _carry_rebuilt_notes(mapping: Mapping, frame) -> None:
    """A batch rebuilt by ``Trainer._prepare_input`` (:func:`packkit.integrations.transformers.prepare_input_caller`)
    gets the notes of the batch it copies where ``.to(args.device)`` made new tensors: without them the labels lose
    their loss weights. Labels weighed under a ``loss_weighting`` are refused, in one line, where the Trainer trains
    its model's own loss (the token mean, whatever the weights): before, it trained the token mean unsaid. Any other
    rebuild is of tensors packkit never saw."""
    found = prepare_input_caller(frame, mapping.keys())
    if found is None or not isinstance(found[1], PackedBatch):
        return
    trainer, old = found
    for key, new in mapping.items():
        _carry_notes(dict.__getitem__(old, key), new)
    source = _loss_source(old)
    weighting = None if source is None else _note(source[0]).get("loss_weighting")
    if weighting is not None and trains_model_loss(trainer):
        raise ValueError(f"the batches were collated under loss_weighting={weighting!r} and this "
                         f"{type(trainer).__name__} trains its model's own loss, the token mean: pass "
                         "compute_loss_func=packkit.loss.hf_compute_loss_func (with class T(WeightedLossMixin, "
                         f"{type(trainer).__name__}) where a step has several micro-batches or processes)")


def _unpickle(cls, items: dict, state: dict, notes: list) -> PackedBatch:
    obj = dict.__new__(cls)
    dict.update(obj, items)
    obj.__dict__.update(state)
    for tensor, note in notes:
        _note(tensor).update(note)
    return obj


def _loss_source(batch: dict):
    """``(labels, shifted)`` the loss reads: ``shift_labels`` when present, else ``labels``; or None."""
    shift = dict.get(batch, "shift_labels")
    if shift is not None:
        return shift, True
    labels = dict.get(batch, "labels")
    return None if labels is None else (labels, False)


def _is_padding_mask(mask, ids) -> bool:
    """A 2-D ``[B, L]`` 0/1 mask of real tokens (not a 4-D attention mask someone put in its place)."""
    return (isinstance(mask, torch.Tensor) and mask.dim() == 2 and ids is not None
            and tuple(mask.shape) == tuple(ids.shape) and not mask.dtype.is_floating_point)


def _max_segment(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def text_config(model):
    """The config whose layers a mask is for: ``model.config`` (or ``model`` itself, a config), its text
    config for a multimodal model."""
    config = getattr(model, "config", model)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> set[str]:
    """The attention kinds of a transformers config's layers: ``config.layer_types`` when it has them,
    else all sliding when ``config.sliding_window`` is set (Mistral, Phi3), else all full (Llama)."""
    types = getattr(config, "layer_types", None)
    if types:
        n = getattr(config, "num_hidden_layers", None)
        return set(types[:n] if isinstance(n, int) else types)
    return {"sliding_attention"} if getattr(config, "sliding_window", None) is not None else {"full_attention"}


def sliding_window(config, types: set[str]) -> int | None:
    """``config.sliding_window`` when ``types`` has sliding layers (None otherwise), or an error if it is
    not a positive int."""
    if "sliding_attention" not in types:
        return None
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ArgumentError(f"the model has sliding-window layers but config.sliding_window is {window!r}; "
                            "set it to the window (a positive int)")
    return window


def mask_dtype(model, config, dtype) -> torch.dtype:
    """``dtype``, by default the model's parameters' dtype, else the config's, else torch's default."""
    if dtype is None:
        param = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
        dtype = param.dtype if param is not None else getattr(config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (the attention scores' dtype), got {dtype!r}")
    return dtype


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L, L]`` bool -> the additive float ``[B, 1, L, L]`` of ``dtype`` that eager and sdpa attention
    add to the scores: 0 where allowed, the dtype's minimum elsewhere."""
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _seq_idx_of(cu: torch.Tensor, shape) -> torch.Tensor:
    """int32 ``shape``: the segment of every token, from ``cu_seqlens`` (zero-length segments own no
    token). ``[0, 2, 3] -> [[0, 0, 1]]``; on ``cu``'s device, without a host sync."""
    token = torch.arange(math.prod(shape), device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:], token, right=True).to(torch.int32).reshape(shape)


def real_tokens_and_documents(cu_seqlens: torch.Tensor, labels: torch.Tensor,
                              ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real tokens, documents)`` of packed rows as 0-dim int64 tensors (no host sync), when padding
    is not known: a row's padding tail is taken to be its last segment if it carries no loss token.

    A document whose every label is -100 that happens to end a row is counted as padding (the view
    cannot tell them apart; collated batches carry exact counts). Zero-length segments (static-shape
    ``cu_seqlens`` padding) are not documents. Rows of ``labels.shape[-1]`` tokens:
    ``cu=[0, 3, 5, 7]``, ``labels=[[-100, 1, 2, -100, 3, -100, -100]]`` -> ``(5, 2)``.

    On the host (both tensors on the CPU) the counts read only the segments that end a row
    (:func:`_host_tokens_and_documents`); on a device, whole-batch tensor passes that need no host sync.
    """
    if cu_seqlens.device.type == "cpu" and labels.device.type == "cpu":
        tokens, docs = _host_tokens_and_documents(cu_seqlens.numpy(), labels, ignore_index)
        return torch.tensor(tokens), torch.tensor(docs)
    return _device_tokens_and_documents(cu_seqlens, labels, ignore_index)


def _host_tokens_and_documents(cu, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[int, int]:
    """:func:`real_tokens_and_documents` of CPU tensors as Python ints, ``cu`` ``(S + 1,)`` a numpy array: only a
    segment that ends a row can be a padding tail, so only those are read, and of them first their last label (a
    loss token there settles it); the whole-batch passes of the device path (a cumsum over every label, a dozen
    tensor calls: 0.37 ms of CPU a 32k row, half of a CP shard) are not made. ``cu=[0, 3, 5, 7]``,
    ``labels=[[-100, 1, 2, -100, 3, -100, -100]]`` -> ``(5, 2)``."""
    flat = labels.reshape(-1).numpy()
    cu = np.asarray(cu, np.int64)
    seg_len = cu[1:] - cu[:-1]
    if not flat.size:
        return 0, 0
    width = labels.shape[-1]
    if width == flat.size and flat[-1] != ignore_index:  # one row whose last label is a loss token: no padding tail
        return flat.size, int(np.count_nonzero(seg_len))
    # the segments that end a row: at each row's end, the first segment that reaches it, if it ends there with tokens
    # (a search per row, not a % over every segment: 27 us of CPU for 1,472 segments on the shared cores)
    rows_end = np.arange(width, int(cu[-1]) + 1, width)
    tail = cu[1:].searchsorted(rows_end)
    tail = tail[tail < seg_len.size]
    tail = tail[(cu[1:][tail] == rows_end[:tail.size]) & (seg_len[tail] > 0)]
    tail = tail[flat[cu[1:][tail] - 1] == ignore_index]  # whose last label is no loss token
    if tail.size:  # and whose every label is none (a padding tail's few: read them all)
        n = seg_len[tail]
        loss = np.logical_or.reduceat(flat[range_index(cu[tail], n)] != ignore_index, lengths_to_offsets(n)[:-1])
        tail = tail[~loss]
    return int(flat.size - seg_len[tail].sum()), int(np.count_nonzero(seg_len)) - int(tail.size)


def _device_tokens_and_documents(cu_seqlens: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """:func:`real_tokens_and_documents` in tensor passes on the tensors' device (no host sync)."""
    cu = cu_seqlens.to(torch.int64)
    flat = labels.reshape(-1).to(cu.device)
    seg_len = cu[1:] - cu[:-1]
    has_loss = torch.nn.functional.pad(flat.ne(ignore_index).cumsum(0), (1, 0))
    loss_per_seg = has_loss[cu[1:]] - has_loss[cu[:-1]]
    tail = (cu[1:] % labels.shape[-1] == 0) & (loss_per_seg == 0) & (seg_len > 0)
    tokens = flat.numel() - (seg_len * tail).sum()
    return tokens, ((seg_len > 0) & ~tail).sum()



#: the note of labels whose micro-batch only repeats examples of another micro-batch of its step (:func:`mark_repeat`)
REPEAT = "loss_repeat"


def mark_repeat(labels: torch.Tensor, repeat: bool = True) -> None:
    """Note that ``labels``' micro-batch only repeats examples of another of its optimiser step (a sampler deals one
    to a rank left without an example, so that every rank runs a forward and backward): every weight it carries is
    then 0 (:func:`loss_factors`, ``PackedBatch.loss_weight``, ``loss_norm``), whatever the weighting, the token mean
    included. :func:`packkit.loss.accumulation_step` marks them (``repeats=`` or a sampler's step facts). Kept on the
    labels, so it goes where they go (``.to()``, a DataLoader's pickling); ``repeat=False`` takes it back."""
    note = _note(labels)
    if bool(note.get(REPEAT)) != repeat:
        note.pop("loss_weight", None)  # made under the other answer
        note[REPEAT] = repeat


def repeat_factors(labels) -> torch.Tensor | None:
    """The token mean's factors of labels marked a repeat (:func:`mark_repeat`): float64 zeros of their shape, on
    their device; None for labels that are no repeat (or no tensor). Under a weighting :func:`loss_factors` gives
    a repeat's zeros itself."""
    if isinstance(labels, torch.Tensor) and _note(labels).get(REPEAT):
        return torch.zeros(labels.shape, dtype=torch.float64, device=labels.device)
    return None


def loss_factors(labels: torch.Tensor):
    """``(factors, z)`` of labels collated under a loss weighting (:mod:`packkit.weighting`), None without
    one: ``factors`` float64 the shape of ``labels``, every label's ``a_c`` (its document's; 0 where the label
    is -100); ``z`` a 0-dim float64 tensor, the batch's part of ``Z``. Made on first use from what the
    collator noted (the segments, and for split examples or per-example weights which example each segment
    is), on the labels' device with no host sync, and kept on the labels: a collator pays nothing per token.

    ``segments [0, 3, 5]``, labels ``[[-100, 5, 6, -100, 7]]`` under ``"sample"`` -> factors
    ``[[0, 0.5, 0.5, 0, 1]]``, ``z = 2``. Labels marked a repeat (:func:`mark_repeat`) give zeros and ``z = 0``.
    """
    note = _note(labels)
    if "loss_factor" not in note:
        if "loss_weighting" not in note:
            return None
        dev = labels.device
        cu = torch.as_tensor(note["loss_cu"], device=dev)  # a collator notes numpy arrays (its worker's cost)
        seg_factor, z = note.get("loss_seg_factor"), note.get("loss_z")
        if seg_factor is None:
            seg_factor, z = _segment_factors(labels, cu, note)
        seg = _seq_idx_of(cu, labels.shape).long()
        note["loss_factor"] = seg_factor.to(dev)[seg] * labels.ne(IGNORE_INDEX)
        note["loss_z"] = torch.as_tensor(z, dtype=torch.float64, device=dev)
    if note.get(REPEAT):
        return torch.zeros_like(note["loss_factor"]), torch.zeros_like(note["loss_z"])
    return note["loss_factor"], note["loss_z"]


def _segment_factors(labels: torch.Tensor, cu: torch.Tensor, note: dict):
    """``(factor of each segment of cu, z)``: loss tokens counted per segment (one cumulative sum), gathered
    per example where segments share one (``loss_seg_doc``: the example of each segment, -1 for padding),
    weighed by the noted rule."""
    cu = cu.long()
    csum = torch.nn.functional.pad(labels.reshape(-1).ne(IGNORE_INDEX).cumsum(0), (1, 0))
    counts = (csum[cu[1:]] - csum[cu[:-1]]).to(torch.float64)
    rule, seg_doc = note["loss_rule"], note.get("loss_seg_doc")
    values = note.get("loss_values")
    values = None if values is None else torch.as_tensor(values, device=labels.device)
    if "loss_whole" in note:  # pieces of examples split offline: each weighs as its whole example
        a, z = piece_factors(rule, counts, torch.as_tensor(note["loss_whole"], device=labels.device), values)
        return a, z.sum()
    if seg_doc is None:
        a, z = rule.factors(counts, values)
        return a, z.sum()
    seg_doc = torch.as_tensor(seg_doc, device=labels.device)
    docs = seg_doc >= 0
    per_doc = torch.zeros(int(note["loss_num_docs"]), dtype=torch.float64, device=labels.device)
    per_doc.index_add_(0, seg_doc[docs], counts[docs])
    if rule.count_empty:  # an example the batch dropped is no document: -1, no z_c (LossWeighting.factors)
        seen = torch.zeros_like(per_doc, dtype=torch.bool).index_fill_(0, seg_doc[docs], True)
        per_doc = torch.where(seen, per_doc, -1.0)
    a, z = rule.factors(per_doc, values)
    seg_factor = torch.zeros_like(counts)
    seg_factor[docs] = a[seg_doc[docs]]
    return seg_factor, z.sum()
