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
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import torch

from .segments import IGNORE_INDEX

__all__ = ["PackedBatch", "FIELDS", "real_tokens_and_documents"]

#: the attributes of every batch (the varlen convention), whatever its view holds
FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "seq_idx", "num_loss_tokens",
          "attention_mask", "num_tokens", "num_examples", "num_real_segments", "labels_shifted")

#: the counts a batch caches; ``pad`` is ``(padding tokens, padding segments)``, ``None`` when unknown
_COUNTS = ("num_loss_tokens", "labels_shifted", "num_tokens", "num_examples")
_LABEL_KEYS = ("labels", "shift_labels")
#: what a new value under a key (other than the labels) makes stale
_STALE = {
    "input_ids": ("num_tokens", "num_examples"),
    "attention_mask": ("num_tokens", "num_examples"),
    "cu_seq_lens_q": ("num_tokens", "num_examples", "num_real_segments", "max_seqlen", "pad"),
}


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
    (tensors have no truth value), so a batch is also hashable, as before.

    **Counts are never stale.** They are computed once (by the collator, on the host) and cached;
    assigning a key they depend on drops what it makes stale, to be recomputed on the next read (one
    read from the tensors' device): ``labels``/``shift_labels`` the loss-token count (only when the
    label tensor the loss reads changes), ``input_ids``/``attention_mask`` the token and document
    counts, ``cu_seq_lens_q`` every segment count. Other keys (``use_cache``...) change nothing.
    Removing labels (what a loss does before the forward) keeps the count of the labels removed, so
    ``labels = batch.pop("labels")`` leaves ``batch.num_loss_tokens`` describing them.

    **Rebuilt from a bare dict.** ``PackedBatch(mapping)`` takes such a view back. Padding cannot be
    read from the view (a row's padding tail and a last document without loss tokens look the same:
    positions from 0, labels all ``-100``), so a batch files itself under its ``cu_seq_lens_q`` tensor
    (``attention_mask`` for a padded view) in a weak registry when it is moved (``.to()``,
    ``pin_memory()``), copied, unpickled or rebuilt, and the first time its ``items()`` are iterated
    (what every rebuild does; the collators' hot path files nothing). When a rebuilt mapping holds that
    very tensor and the filed batch is alive, as in ``Trainer`` (``accelerate`` moves the batch with
    ``.to()``, then ``Trainer._prepare_input`` rebuilds it from its ``items()``: the same tensors), the
    new batch takes the padding and every still-valid count from the filed one, with no device work.
    Otherwise (tensors moved by hand, a plain dict from another process, ``dict(batch)`` of a batch
    never filed) it falls back to reading the labels: a row's last segment without loss tokens counts
    as padding (exact for padded views, and whenever each row's last document has a loss token). The
    registry holds weak references: an entry dies with its batch.
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
        obj = _new(cls)
        _fill(obj, input_ids, labels, position_ids, cu_seqlens, max_seqlen, seq_idx, num_loss_tokens,
              attention_mask, num_tokens, num_examples, num_real_segments, labels_shifted)
        return obj

    def _rebuild(self, mapping) -> None:
        """Fill from a view (``Trainer``'s ``type(batch)({k: moved v})``), inheriting from the batch
        registered under the same segment tensor when there is one (see the class docstring)."""
        if isinstance(mapping, PackedBatch):
            dict.update(self, mapping)
            self._copy_state(mapping)
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
        d = self.__dict__
        d["_cu"], d["_seq_idx"], d["_facts"], d["_filed"] = mapping.get("cu_seq_lens_q"), None, {}, None
        src = _registered(self)
        if src is not None:
            sd = src.__dict__
            d["_cu"] = sd["_cu"]
            facts = d["_facts"]
            for name in ("pad", "num_real_segments", "max_seqlen"):
                if name in sd["_facts"]:
                    facts[name] = sd["_facts"][name]
            same = all(mapping.get(k) is dict.get(src, k) for k in ("input_ids", "labels", "shift_labels",
                                                                     "attention_mask"))
            if same:
                facts.update({k: sd["_facts"][k] for k in _COUNTS if k in sd["_facts"]})
                if "_labels_gone" in sd:
                    d["_labels_gone"] = sd["_labels_gone"]
            if sd["_seq_idx"] is not None and sd["_seq_idx"].shape == mapping["input_ids"].shape:
                d["_seq_idx"] = sd["_seq_idx"]
        elif "max_length_q" in mapping:
            d["_facts"]["max_seqlen"] = int(mapping["max_length_q"])
        _register(self)

    def _copy_state(self, other: "PackedBatch") -> None:
        d, od = self.__dict__, other.__dict__
        d["_cu"], d["_seq_idx"], d["_facts"] = od["_cu"], od["_seq_idx"], dict(od["_facts"])
        if "_labels_gone" in od:
            d["_labels_gone"] = od["_labels_gone"]
        _register(self)

    # -- a dict whose counts follow it ----------------------------------------------------------

    def __setitem__(self, key, value):
        before = _loss_source(self) if key in _LABEL_KEYS else None
        dict.__setitem__(self, key, value)
        if key in _LABEL_KEYS:
            self._labels_changed(before)
        elif key in _STALE:
            self._stale(key, value)

    def __delitem__(self, key):
        before = _loss_source(self) if key in _LABEL_KEYS else None
        dict.__delitem__(self, key)
        if key in _LABEL_KEYS:
            self._labels_changed(before)

    _MISSING = object()

    def pop(self, key, default=_MISSING):
        if key not in self:
            if default is PackedBatch._MISSING:
                raise KeyError(key)
            return default
        value = self[key]
        del self[key]
        return value

    def popitem(self):
        if not self:
            raise KeyError("popitem(): PackedBatch is empty")
        key = next(reversed(self))
        return key, self.pop(key)

    def clear(self):
        for key in list(self):
            del self[key]

    def update(self, other=(), /, **kwargs):
        if isinstance(other, Mapping):
            pairs = other.items()
        elif hasattr(other, "keys"):  # what dict.update accepts: anything with keys() and [key]
            pairs = [(k, other[k]) for k in other.keys()]
        else:
            pairs = other
        for key, value in pairs:
            self[key] = value
        for key, value in kwargs.items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self

    def items(self):
        """The view's items (what ``Trainer`` and ``accelerate`` iterate to rebuild a batch): the batch
        files itself in the registry here, once per segment tensor, so that the rebuilt batch finds it."""
        if self.__dict__["_filed"] is not _anchor(self):
            _register(self)
        return dict.items(self)

    def copy(self) -> "PackedBatch":
        """A shallow copy (the same tensors), with the counts: ``type(batch)`` kept, unlike ``dict.copy``."""
        new = dict.__new__(type(self))
        dict.update(new, self)
        new._copy_state(self)
        return new

    __copy__ = copy

    def __reduce__(self):
        state = {"_cu": self.__dict__["_cu"], "_facts": self.__dict__["_facts"]}
        if "_labels_gone" in self.__dict__:
            state["_labels_gone"] = self.__dict__["_labels_gone"]
        return _unpickle, (type(self), dict(self), state)

    def _labels_changed(self, before) -> None:
        """The loss reads ``shift_labels`` when present, else ``labels``: its count is stale only when
        that tensor changed. With no labels left, the count of the last ones is kept."""
        after = _loss_source(self)
        d, facts = self.__dict__, self.__dict__["_facts"]
        if after is None:
            if "num_loss_tokens" not in facts and before is not None:
                d["_labels_gone"] = before  # counted on the next read, no device work now
            return
        d.pop("_labels_gone", None)
        if before is None or after[0] is not before[0] or after[1] != before[1]:
            facts.pop("num_loss_tokens", None)
            facts.pop("labels_shifted", None)
            if facts.get("pad") is None:  # padding read from the labels: that reading changes too
                facts.pop("num_tokens", None)
                facts.pop("num_examples", None)

    def _stale(self, key: str, value) -> None:
        d, facts = self.__dict__, self.__dict__["_facts"]
        if key == "cu_seq_lens_q" and value is d["_cu"]:
            return  # the very segments it has (put back after a pop): nothing changed
        for name in _STALE[key]:
            facts.pop(name, None)
        if key in ("input_ids", "cu_seq_lens_q"):
            d["_seq_idx"] = None
        if key == "cu_seq_lens_q":
            d["_cu"] = value
            _register(self)

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
        """int32 ``[S + 1]`` segment offsets (kept when ``cu_seq_lens_q`` is removed from the view)."""
        cu = self.__dict__["_cu"]
        if cu is None:  # a padded view rebuilt by hand: segments start where positions restart
            flat = self["position_ids"]
            flat = (flat[0] if flat.dim() == 3 else flat).reshape(-1)  # mRoPE [4, B, L]: row 0 is the text
            starts = torch.nonzero(flat == 0).reshape(-1)
            end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
            cu = self.__dict__["_cu"] = torch.cat([starts, end]).to(torch.int32)
        return cu

    @property
    def seq_idx(self) -> torch.Tensor:
        """int32, the shape of ``input_ids``: the segment of every token, from ``cu_seqlens``."""
        seq_idx = self.__dict__["_seq_idx"]
        if seq_idx is None:
            seq_idx = self.__dict__["_seq_idx"] = _seq_idx_of(self.cu_seqlens, self.input_ids.shape)
        return seq_idx

    def _fact(self, name: str):
        facts = self.__dict__["_facts"]
        if name not in facts:
            self._count()
        return facts[name]

    num_loss_tokens = property(lambda self: self._fact("num_loss_tokens"), doc="Python int, loss terms")
    labels_shifted = property(lambda self: self._fact("labels_shifted"), doc="bool, pre-shifted labels")
    num_tokens = property(lambda self: self._fact("num_tokens"), doc="Python int, real tokens")
    num_examples = property(lambda self: self._fact("num_examples"), doc="Python int, documents")
    num_real_segments = property(lambda self: self._fact("num_real_segments"),
                                 doc="Python int, non-empty segments (padding tails included)")
    max_seqlen = property(lambda self: self._fact("max_seqlen"), doc="Python int, the longest segment")

    def _count(self) -> None:
        """Compute every missing count with one read from the tensors' device."""
        facts = self.__dict__["_facts"]
        names, parts = [], []
        if "num_real_segments" not in facts or "max_seqlen" not in facts:
            cu = self.cu_seqlens
            seg_len = (cu[1:] - cu[:-1]).to(torch.int64)
            names += ["num_real_segments", "max_seqlen"]
            parts += [(seg_len > 0).sum(), seg_len.max() if seg_len.numel() else seg_len.new_zeros(())]
        if "num_loss_tokens" not in facts:
            source = _loss_source(self) or self.__dict__.get("_labels_gone")
            if source is None:
                raise ValueError("this batch carries no labels (they were removed before their loss tokens were "
                                 "counted); read num_loss_tokens before removing labels, or set batch['labels']")
            labels, shifted = source
            facts["labels_shifted"] = shifted
            names.append("num_loss_tokens")
            parts.append((labels if shifted else labels[..., 1:]).ne(IGNORE_INDEX).sum(dtype=torch.int64))
        if "num_tokens" not in facts or "num_examples" not in facts:
            mask, ids = self.get("attention_mask"), self.input_ids
            pad = facts.get("pad")
            if _is_padding_mask(mask, ids):
                names += ["num_tokens", "num_examples"]
                per_row = mask.reshape(mask.shape[0], -1).ne(0).sum(-1, dtype=torch.int64)
                parts += [per_row.sum(), per_row.gt(0).sum()]
            elif pad is not None:
                facts["num_tokens"] = ids.numel() - pad[0]
                if "num_real_segments" in facts:
                    facts["num_examples"] = facts["num_real_segments"] - pad[1]
                else:
                    names.append("num_examples")
                    parts.append(parts[names.index("num_real_segments")] - pad[1])
            else:
                labels = self.get("labels")
                if labels is None:
                    labels = (self.get("shift_labels") if "shift_labels" in self
                              else (self.__dict__.get("_labels_gone") or (None,))[0])
                if labels is None:
                    labels = torch.zeros(ids.shape, dtype=torch.int64, device=ids.device)  # no tails known
                tokens, docs = real_tokens_and_documents(self.cu_seqlens, labels)
                names += ["num_tokens", "num_examples"]
                parts += [tokens, docs]
        if parts:
            device = parts[0].device
            values = torch.stack([p.to(device) for p in parts]).tolist()  # one read from the device
            facts.update(zip(names, values))

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
        """A batch with ``fn`` applied to every tensor (each tensor once: aliases stay aliases)."""
        moved = {}

        def move(v):
            if not isinstance(v, torch.Tensor):
                return v
            key = id(v)
            if key not in moved:
                moved[key] = fn(v)
            return moved[key]

        new = dict.__new__(type(self))
        dict.update(new, {k: move(v) for k, v in self.items()})
        d, nd = self.__dict__, new.__dict__
        nd["_cu"] = None if d["_cu"] is None else move(d["_cu"])
        nd["_seq_idx"] = None if d["_seq_idx"] is None else move(d["_seq_idx"])  # a lazy seq_idx stays lazy
        nd["_facts"] = dict(d["_facts"])
        if "_labels_gone" in d:
            nd["_labels_gone"] = (move(d["_labels_gone"][0]), d["_labels_gone"][1])
        _register(new)
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
        config = getattr(model, "config", model)
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        impl = getattr(config, "_attn_implementation", None)
        if impl not in (None, "eager", "sdpa"):
            how = ("pass the batch without a mask (model(**batch)): flash attention reads cu_seq_lens_q/k"
                   if "flash" in str(impl) else "pass the batch without a mask (model(**batch)), or load the "
                   "model with attn_implementation='sdpa' or 'eager'")
            raise ValueError(f"hf_mask builds the 4-D mask of eager and sdpa attention; this model uses "
                             f"attn_implementation={impl!r}: {how}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("hf_mask builds causal masks; this model uses bidirectional attention "
                             "(config.use_bidirectional_attention), whose window is not causal")
        types = _layer_types(config)
        other = sorted(types - {"full_attention", "sliding_attention"})
        if other:
            raise ValueError(f"hf_mask knows full and sliding-window attention layers; this model also has "
                             f"{other} layers, whose masks it cannot build: pass the batch without a mask "
                             "(model(**batch)) and let the model build them from position_ids")
        window = None
        if "sliding_attention" in types:
            window = getattr(config, "sliding_window", None)
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"the model has sliding-window layers but config.sliding_window is {window!r}; "
                                 "set it to the window (a positive int)")
        dtype = _mask_dtype(model, config, dtype)
        masks = {}
        for kind in sorted(types):
            allowed = self.dense_mask(sliding_window=window if kind == "sliding_attention" else None)
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            masks[kind] = additive.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
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
        facts = self.__dict__["_facts"]
        kind = "padded" if _is_padding_mask(self.get("attention_mask"), self.input_ids) else "packed"
        counts = ", ".join(f"{k}={facts[k]}" for k in ("num_loss_tokens", "num_tokens", "num_examples")
                           if k in facts)
        return (f"PackedBatch({kind}, shape={list(self.shape)}, keys={list(self)}"
                f"{', ' + counts if counts else ''}{', labels_shifted' if facts.get('labels_shifted') else ''}, "
                f"device={self.device})")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


_new = dict.__new__
_dict_init = dict.__init__
_put = dict.__setitem__


def _fill(obj, input_ids, labels, position_ids, cu, max_seqlen, seq_idx, num_loss_tokens, attention_mask,
          num_tokens, num_examples, num_real_segments, labels_shifted) -> None:
    """Lay a new batch's fields out as its view and its cached counts (positional: the hot path)."""
    shifted = bool(labels_shifted)
    if attention_mask is None:
        if max_seqlen is None:
            max_seqlen = _max_segment(cu)
        _dict_init(obj, input_ids=input_ids, labels=labels, position_ids=position_ids, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=max_seqlen, max_length_k=max_seqlen)
    else:
        _dict_init(obj, input_ids=input_ids, labels=labels, position_ids=position_ids, attention_mask=attention_mask)
    if shifted:
        _put(obj, "shift_labels", labels)
    _put(obj, "use_cache", False)
    if not (num_loss_tokens is None or num_tokens is None or num_examples is None or num_real_segments is None
            or max_seqlen is None):  # the collators' case: every count known, padding with them
        facts = {"labels_shifted": shifted, "num_loss_tokens": num_loss_tokens, "max_seqlen": max_seqlen,
                 "num_real_segments": num_real_segments, "num_tokens": num_tokens, "num_examples": num_examples,
                 "pad": (input_ids.numel() - num_tokens, num_real_segments - num_examples)}
    else:
        facts = {"labels_shifted": shifted}
        for name, value in (("num_loss_tokens", num_loss_tokens), ("max_seqlen", max_seqlen),
                            ("num_real_segments", num_real_segments), ("num_tokens", num_tokens),
                            ("num_examples", num_examples)):
            if value is not None:
                facts[name] = value
        if num_tokens is not None and num_examples is not None and num_real_segments is not None:
            facts["pad"] = (input_ids.numel() - num_tokens, num_real_segments - num_examples)
    d = obj.__dict__
    d["_cu"], d["_seq_idx"], d["_facts"], d["_filed"] = cu, seq_idx, facts, None


def _unpickle(cls, items: dict, state: dict) -> PackedBatch:
    obj = dict.__new__(cls)
    dict.update(obj, items)
    obj.__dict__.update(state, _seq_idx=None, _facts=dict(state["_facts"]))
    _register(obj)
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


def _layer_types(config) -> set[str]:
    """The attention kinds of a transformers config's layers: ``config.layer_types`` when it has them,
    else all sliding when ``config.sliding_window`` is set (Mistral, Phi3), else all full (Llama)."""
    types = getattr(config, "layer_types", None)
    if types:
        n = getattr(config, "num_hidden_layers", None)
        return set(types[:n] if isinstance(n, int) else types)
    return {"sliding_attention"} if getattr(config, "sliding_window", None) is not None else {"full_attention"}


def _mask_dtype(model, config, dtype) -> torch.dtype:
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


# -- the registry that lets a batch rebuilt from its bare view find its padding again -----------

_ORIGIN: dict[int, list] = {}  # id of an anchor tensor -> weak references to the batches that hold it


class _Origin(weakref.ref):
    """A weak reference to a batch, filed under the id of its anchor tensor (``key``)."""

    __slots__ = ("key",)


def _forget(ref: _Origin) -> None:
    refs = _ORIGIN.get(ref.key)
    if refs is not None:
        try:
            refs.remove(ref)
        except ValueError:
            pass
        if not refs:
            _ORIGIN.pop(ref.key, None)


def _anchor(batch: dict):
    """The tensor a view's structure hangs on: ``cu_seq_lens_q``, else ``attention_mask``."""
    anchor = dict.get(batch, "cu_seq_lens_q")
    return dict.get(batch, "attention_mask") if anchor is None else anchor


def _register(batch: PackedBatch) -> None:
    """File ``batch`` under its anchor tensor (once per anchor)."""
    anchor = _anchor(batch)
    batch.__dict__["_filed"] = anchor
    if isinstance(anchor, torch.Tensor):
        ref = _Origin(batch, _forget)
        ref.key = id(anchor)
        _ORIGIN.setdefault(ref.key, []).append(ref)


def _registered(batch: PackedBatch):
    """A live batch filed under ``batch``'s anchor tensor that still holds that very tensor, or None."""
    anchor = _anchor(batch)
    if not isinstance(anchor, torch.Tensor):
        return None
    for ref in reversed(tuple(_ORIGIN.get(id(anchor), ()))):  # the latest first
        src = ref()
        if src is not None and src is not batch and _anchor(src) is anchor:
            return src
    return None


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
    """
    cu = cu_seqlens.to(torch.int64)
    flat = labels.reshape(-1).to(cu.device)
    seg_len = cu[1:] - cu[:-1]
    has_loss = torch.nn.functional.pad(flat.ne(ignore_index).cumsum(0), (1, 0))
    loss_per_seg = has_loss[cu[1:]] - has_loss[cu[:-1]]
    tail = (cu[1:] % labels.shape[-1] == 0) & (loss_per_seg == 0) & (seg_len > 0)
    tokens = flat.numel() - (seg_len * tail).sum()
    return tokens, ((seg_len > 0) & ~tail).sum()
