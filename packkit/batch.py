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

In fixed windows (``[B, W]``) a row's padding tail is its own trailing segment, with positions from 0,
pad ids and labels ``-100``; ``cu_seqlens`` runs over the row-major flattened batch.

Views, so that nobody renames fields:

================  ================================================================================
consumer          view
================  ================================================================================
flash-attn        ``flash_kwargs()``: ``cu_seqlens_q/k``, ``max_seqlen_q/k`` (``flash_attn_varlen_func``)
Hugging Face      ``hf_kwargs()`` (also ``**batch``): ``input_ids``, ``labels``, ``position_ids``,
                  ``cu_seq_lens_q/k``, ``max_length_q/k``, ``use_cache=False`` and **no**
                  ``attention_mask``
FlexAttention     ``block_mask()``: a document-causal ``BlockMask`` (flex is imported lazily)
SDPA / eager      ``dense_mask()``: ``[B, L, L]`` bool, block-diagonal and causal
Mamba / linear    ``mamba_kwargs()``: ``seq_idx`` and ``cu_seqlens``
================  ================================================================================

Why the HF view carries no mask and sets ``use_cache=False`` (checked against transformers 5.24):
with ``attn_implementation="sdpa"`` or ``"eager"`` the model finds document boundaries from
``position_ids`` only when ``attention_mask`` is ``None`` and no cache object exists; any 2-D mask,
even all ones, or the cache that ``use_cache`` creates by default (in train mode too) turns that off
and every token attends across documents. Its flash-attention path reads ``cu_seq_lens_q/k``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math

import torch

from .segments import IGNORE_INDEX

__all__ = ["PackedBatch"]

_TENSOR_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx", "attention_mask")
_HF_PACKED_KEYS = ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                   "max_length_q", "max_length_k", "use_cache")
_HF_PADDED_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "use_cache")
_PLAIN_FIELDS = ("max_seqlen", "num_loss_tokens", "num_tokens", "num_examples", "num_real_segments",
                 "labels_shifted")


@dataclasses.dataclass(frozen=True, eq=False, init=False, repr=False)
class PackedBatch(collections.abc.Mapping):
    """A packed (or padded) batch: the tensors of the varlen convention and a view per consumer.

    Fields:
        input_ids:       int64 ``[B, W]`` (fixed windows) or ``[1, T]`` (padding-free)
        labels:          int64, same shape; ``-100`` on padding, masked prompt tokens and the first
                         token of every document
        position_ids:    int64, same shape; ``0..len-1`` in every segment (a padding tail included)
        cu_seqlens:      int32 ``[S + 1]``, segment offsets over the row-major flattened batch;
                         with a static shape, padded by repeating the last offset (zero-length segments)
        max_seqlen:      Python int, the longest segment (``W`` with a static shape)
        seq_idx:         int32, same shape as ``input_ids``: the segment of every token (built from
                         ``cu_seqlens`` on first access, on the batch's device, when not given)
        num_loss_tokens: Python int, ``labels != -100`` (the loss terms after the model's shift,
                         since the first label of every document is ``-100``; with pre-shifted labels
                         every ``!= -100`` label is a term too)
        attention_mask:  int64 ``[B, L]`` (1 on real tokens) for the padded fallback only, else None
        num_tokens:      Python int, real (non-padding) tokens, as the collator laid them out
        num_examples:    Python int, documents (a piece of a split example counts as one)
        num_real_segments: Python int, segments of ``cu_seqlens`` that hold tokens (documents and
                         padding tails; static-shape zero-length padding excluded)
        labels_shifted:  bool, ``labels[t]`` is the target of token ``t`` (built with
                         ``mask_first_label=False``); the HF view then also carries ``shift_labels``,
                         so neither the model nor ``Trainer`` shifts them again

    With a static shape, ``cu_seqlens`` ends in zero-length segments (a fixed length for
    ``torch.compile``), which some flash-attn versions mishandle (flash-attn #1537).
    ``hf_kwargs(static=False)`` / ``flash_kwargs(static=False)`` cut them off on the host (a view of the
    first ``num_real_segments + 1`` offsets, no device sync) at the price of a shape that varies.

    It is a read-only mapping over the Hugging Face view, so ``model(**batch)`` and
    ``transformers.Trainer`` work as with a dict; the other fields are attributes.
    ``PackedBatch(mapping)`` rebuilds a batch from such a view (what ``Trainer`` does after moving its
    values; ``.to()``, ``pin_memory()``, ``accelerate`` and pickling keep every field as it is):
    ``seq_idx`` is recomputed on the tensors' device and the counts from the tensors (one read from
    the device). The view carries no padding marker, so a rebuilt fixed-window batch counts a row's
    last segment as padding when it holds no loss token (exact for padded batches, and whenever each
    row's last document has a loss token).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_idx: torch.Tensor
    num_loss_tokens: int
    attention_mask: torch.Tensor | None
    num_tokens: int
    num_examples: int
    num_real_segments: int
    labels_shifted: bool

    def __init__(self, mapping=None, /, *, input_ids=None, labels=None, position_ids=None,
                 cu_seqlens=None, max_seqlen=None, seq_idx=None, num_loss_tokens=None,
                 attention_mask=None, num_tokens=None, num_examples=None, num_real_segments=None,
                 labels_shifted=None):
        fields = dict(input_ids=input_ids, labels=labels, position_ids=position_ids,
                      cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_idx=seq_idx,
                      num_loss_tokens=num_loss_tokens, attention_mask=attention_mask,
                      num_tokens=num_tokens, num_examples=num_examples,
                      num_real_segments=num_real_segments, labels_shifted=labels_shifted)
        if mapping is not None:
            if any(v is not None for v in fields.values()):
                raise TypeError("PackedBatch takes either one mapping or keyword fields, not both")
            fields = _fields_from_view(mapping)
        if fields["labels_shifted"] is None:
            fields["labels_shifted"] = False
        if fields["seq_idx"] is None and fields["cu_seqlens"] is not None:
            del fields["seq_idx"]  # derived on first access (__getattr__): the HF path never reads it
        missing = [k for k, v in fields.items() if v is None and k != "attention_mask"]
        if missing:
            raise TypeError(f"PackedBatch is missing {', '.join(missing)}")
        d = self.__dict__  # frozen: fill the instance dict directly (the collators' hot path)
        d.update(fields)

    @classmethod
    def _trusted(cls, **fields) -> "PackedBatch":
        """A batch from every field, unchecked: the collators' hot path (``seq_idx`` left lazy)."""
        obj = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj

    def __getattr__(self, name):
        # only reached for a field missing from the instance dict: the lazy seq_idx
        if name != "seq_idx" or "cu_seqlens" not in self.__dict__:
            raise AttributeError(f"'PackedBatch' object has no attribute {name!r}")
        seq_idx = _seq_idx_of(self.cu_seqlens, self.input_ids.shape)
        self.__dict__["seq_idx"] = seq_idx
        return seq_idx

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
        """A batch with ``fn`` applied to every tensor field (ints are kept)."""
        d = self.__dict__
        new = {f: (None if d.get(f) is None else fn(d[f])) for f in _TENSOR_FIELDS}  # a lazy seq_idx stays lazy
        ints = {f: getattr(self, f) for f in _PLAIN_FIELDS}
        return PackedBatch(**ints, **new)

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

    def _cu(self, static: bool) -> torch.Tensor:
        """``cu_seqlens``, cut to the real segments unless ``static`` (a view: no copy, no sync)."""
        return self.cu_seqlens if static else self.cu_seqlens[: self.num_real_segments + 1]

    def hf_kwargs(self, *, static: bool = True) -> dict:
        """Keyword arguments for a Hugging Face causal LM: ``model(**batch.hf_kwargs())``.

        Packed: ``input_ids``, ``labels``, ``position_ids``, ``cu_seq_lens_q/k`` (int32),
        ``max_length_q/k`` (int), ``use_cache=False``, no ``attention_mask``; with pre-shifted labels
        (``labels_shifted``) also ``shift_labels`` (HF's loss and ``Trainer`` use them unshifted).
        Padded fallback (``attention_mask`` set): ``input_ids``, ``labels``, ``position_ids``,
        ``attention_mask``, ``use_cache=False``.
        ``static=False`` drops a static-shape batch's zero-length segments from ``cu_seq_lens_q/k``
        (flash-attn #1537) and gives up the fixed length; ``static=True`` (default, and what
        ``**batch`` gives) keeps ``cu_seqlens`` as built.
        """
        out = {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        else:
            cu = self._cu(static)
            out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=self.max_seqlen,
                       max_length_k=self.max_seqlen)
        if self.labels_shifted:
            out["shift_labels"] = self.labels
        out["use_cache"] = False
        return out

    def flash_kwargs(self, *, static: bool = True) -> dict:
        """``cu_seqlens_q/k`` int32 ``[S + 1]`` and ``max_seqlen_q/k`` int, for
        ``flash_attn_varlen_func(q, k, v, **batch.flash_kwargs(), causal=True)`` with
        ``q: (total_tokens, nheads, headdim)`` from the flattened batch. ``static`` as in
        :meth:`hf_kwargs`."""
        cu = self._cu(static)
        return {"cu_seqlens_q": cu, "cu_seqlens_k": cu,
                "max_seqlen_q": self.max_seqlen, "max_seqlen_k": self.max_seqlen}

    def mamba_kwargs(self) -> dict:
        """``seq_idx`` int32 ``[B, L]`` and ``cu_seqlens`` int32 ``[S + 1]`` for Mamba-style kernels."""
        return {"seq_idx": self.seq_idx, "cu_seqlens": self.cu_seqlens}

    def dense_mask(self) -> torch.Tensor:
        """``[B, L, L]`` bool, ``mask[b, q, k]``: query ``q`` may attend key ``k`` (same segment,
        ``k <= q``). Memory is quadratic in ``L``: for tests and small batches. For a Hugging Face
        model pass ``attention_mask=batch.dense_mask()[:, None]`` (a 4-D mask is used as given)."""
        seg = self.seq_idx
        length = seg.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril_()
        return (seg[:, :, None] == seg[:, None, :]) & causal

    def block_mask(self, *, BLOCK_SIZE: int = 128):
        """A document-causal FlexAttention ``BlockMask`` over ``[B, L]`` (imports flex lazily)."""
        from torch.nn.attention.flex_attention import create_block_mask

        seg = self.seq_idx

        def document_causal(b, h, q_idx, kv_idx):
            return (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)

        batch, length = seg.shape
        return create_block_mask(document_causal, batch, None, length, length, device=seg.device,
                                 BLOCK_SIZE=BLOCK_SIZE)

    # -- mapping over the HF view ---------------------------------------------------------------

    def _keys(self) -> tuple[str, ...]:
        keys = _HF_PADDED_KEYS if self.attention_mask is not None else _HF_PACKED_KEYS
        return keys[:-1] + ("shift_labels", "use_cache") if self.labels_shifted else keys

    def __getitem__(self, key):
        if key not in self._keys():
            raise KeyError(key)
        return self.hf_kwargs()[key]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key) -> bool:
        return key in self._keys()

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        kind = "padded" if self.attention_mask is not None else "packed"
        return (f"PackedBatch({kind}, shape={list(self.shape)}, segments={self.num_real_segments}"
                f"{'/' + str(self.num_segments) if self.is_static else ''}, max_seqlen={self.max_seqlen}, "
                f"num_loss_tokens={self.num_loss_tokens}, num_tokens={self.num_tokens}, "
                f"num_examples={self.num_examples}{', labels_shifted' if self.labels_shifted else ''}, "
                f"device={self.device})")


def _fields_from_view(mapping) -> dict:
    """Fields of a :class:`PackedBatch` from its HF view (a mapping), as moved by Trainer/accelerate."""
    if isinstance(mapping, PackedBatch):
        return {f.name: getattr(mapping, f.name) for f in dataclasses.fields(PackedBatch)}
    try:
        input_ids = mapping["input_ids"]
        position_ids = mapping["position_ids"]
    except KeyError as exc:
        raise TypeError(f"cannot rebuild a PackedBatch from a mapping without {exc}") from None
    labels = mapping.get("labels")
    if labels is None:
        labels = torch.full_like(input_ids, IGNORE_INDEX)
    shifted = mapping.get("shift_labels") is not None
    attention_mask = mapping.get("attention_mask")
    if "cu_seq_lens_q" in mapping:
        cu = mapping["cu_seq_lens_q"]
        max_seqlen = int(mapping["max_length_q"])
    else:  # padded view: segments start where positions restart
        flat = position_ids.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1)
        end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
        cu = torch.cat([starts, end]).to(torch.int32)
        max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    seq_idx = _seq_idx_of(cu, input_ids.shape)
    counts = _view_counts(cu, seq_idx, labels, attention_mask, shifted)
    loss, tokens, examples, real = counts.tolist()  # one read from the device
    return dict(input_ids=input_ids, labels=labels, position_ids=position_ids, cu_seqlens=cu,
                max_seqlen=max_seqlen, seq_idx=seq_idx, num_loss_tokens=loss, attention_mask=attention_mask,
                num_tokens=tokens, num_examples=examples, num_real_segments=real, labels_shifted=shifted)


def _seq_idx_of(cu: torch.Tensor, shape) -> torch.Tensor:
    """int32 ``shape``: the segment of every token, from ``cu_seqlens`` (zero-length segments own no
    token). ``[0, 2, 3] -> [[0, 0, 1]]``; on ``cu``'s device, without a host sync."""
    token = torch.arange(math.prod(shape), device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:], token, right=True).to(torch.int32).reshape(shape)


def _view_counts(cu, seq_idx, labels, attention_mask, shifted: bool) -> torch.Tensor:
    """``[loss tokens, real tokens, documents, non-empty segments]`` int64 on the tensors' device.

    Padded view: the mask's ones are the tokens, one document per row. Packed view: a row's last
    segment is padding when it carries no loss token (the view has no padding marker).
    """
    cu = cu.to(torch.int64)
    has_loss = labels.reshape(-1) != IGNORE_INDEX
    # the loss terms: every label when pre-shifted, else labels[..., 1:] (what count_loss_tokens reads)
    loss = (labels[..., 1:] != IGNORE_INDEX).sum(dtype=torch.int64) if not shifted else has_loss.sum(dtype=torch.int64)
    seg_len = cu[1:] - cu[:-1]
    real = (seg_len > 0).sum(dtype=torch.int64)
    if attention_mask is not None:
        rows = torch.tensor(labels.shape[0] if labels.dim() > 1 else 1, device=cu.device)
        return torch.stack([loss, attention_mask.sum(dtype=torch.int64).to(cu.device), rows, real])
    loss_per_seg = torch.zeros(seg_len.numel(), dtype=torch.int64, device=cu.device).index_add_(
        0, seq_idx.reshape(-1).to(cu.device, torch.int64), has_loss.to(cu.device, torch.int64))
    tail = (cu[1:] % labels.shape[-1] == 0) & (loss_per_seg == 0) & (seg_len > 0)
    tokens = labels.numel() - (seg_len * tail).sum()
    return torch.stack([loss, tokens, ((seg_len > 0) & ~tail).sum(), real])
