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

import torch

from .segments import IGNORE_INDEX

__all__ = ["PackedBatch"]

_TENSOR_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx", "attention_mask")
_HF_PACKED_KEYS = ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                   "max_length_q", "max_length_k", "use_cache")
_HF_PADDED_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "use_cache")


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
        seq_idx:         int32, same shape as ``input_ids``: the segment of every token
        num_loss_tokens: Python int, ``labels != -100`` (the loss terms after the model's shift,
                         since the first label of every document is ``-100``)
        attention_mask:  int64 ``[B, L]`` (1 on real tokens) for the padded fallback only, else None

    It is a read-only mapping over the Hugging Face view, so ``model(**batch)`` and
    ``transformers.Trainer`` work as with a dict; the other fields are attributes.
    ``PackedBatch(mapping)`` rebuilds a batch from such a view (what ``Trainer`` and ``accelerate`` do
    after moving its values): ``seq_idx`` is recomputed on the tensors' device, and
    ``num_loss_tokens`` from the labels (one read from the device).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_idx: torch.Tensor
    num_loss_tokens: int
    attention_mask: torch.Tensor | None

    def __init__(self, mapping=None, /, *, input_ids=None, labels=None, position_ids=None,
                 cu_seqlens=None, max_seqlen=None, seq_idx=None, num_loss_tokens=None,
                 attention_mask=None):
        fields = dict(input_ids=input_ids, labels=labels, position_ids=position_ids,
                      cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_idx=seq_idx,
                      num_loss_tokens=num_loss_tokens, attention_mask=attention_mask)
        if mapping is not None:
            if any(v is not None for v in fields.values()):
                raise TypeError("PackedBatch takes either one mapping or keyword fields, not both")
            fields = _fields_from_view(mapping)
        missing = [k for k, v in fields.items() if v is None and k != "attention_mask"]
        if missing:
            raise TypeError(f"PackedBatch is missing {', '.join(missing)}")
        for k, v in fields.items():
            object.__setattr__(self, k, v)

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
        new = {f: (None if getattr(self, f) is None else fn(getattr(self, f))) for f in _TENSOR_FIELDS}
        return PackedBatch(max_seqlen=self.max_seqlen, num_loss_tokens=self.num_loss_tokens, **new)

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        """The batch on ``device``; ``max_seqlen`` and ``num_loss_tokens`` stay Python ints."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self, device=None) -> "PackedBatch":
        """The batch in page-locked memory (``DataLoader(pin_memory=True)`` calls this).

        Needs an accelerator: torch raises ``RuntimeError`` without one, as for a plain tensor.
        """
        return self._map(lambda t: t.pin_memory() if device is None else t.pin_memory(device))

    # -- views ----------------------------------------------------------------------------------

    def hf_kwargs(self) -> dict:
        """Keyword arguments for a Hugging Face causal LM: ``model(**batch.hf_kwargs())``.

        Packed: ``input_ids``, ``labels``, ``position_ids``, ``cu_seq_lens_q/k`` (int32),
        ``max_length_q/k`` (int), ``use_cache=False``, no ``attention_mask``.
        Padded fallback (``attention_mask`` set): ``input_ids``, ``labels``, ``position_ids``,
        ``attention_mask``, ``use_cache=False``.
        """
        if self.attention_mask is not None:
            return {"input_ids": self.input_ids, "labels": self.labels,
                    "position_ids": self.position_ids, "attention_mask": self.attention_mask,
                    "use_cache": False}
        return {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids,
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen, "use_cache": False}

    def flash_kwargs(self) -> dict:
        """``cu_seqlens_q/k`` int32 ``[S + 1]`` and ``max_seqlen_q/k`` int, for
        ``flash_attn_varlen_func(q, k, v, **batch.flash_kwargs(), causal=True)`` with
        ``q: (total_tokens, nheads, headdim)`` from the flattened batch."""
        return {"cu_seqlens_q": self.cu_seqlens, "cu_seqlens_k": self.cu_seqlens,
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
        return _HF_PADDED_KEYS if self.attention_mask is not None else _HF_PACKED_KEYS

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
        return (f"PackedBatch({kind}, shape={list(self.shape)}, segments={self.num_segments}, "
                f"max_seqlen={self.max_seqlen}, num_loss_tokens={self.num_loss_tokens}, "
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
    token = torch.arange(input_ids.numel(), device=cu.device, dtype=cu.dtype)
    seq_idx = torch.searchsorted(cu[1:], token, right=True).to(torch.int32).reshape(input_ids.shape)
    return dict(input_ids=input_ids, labels=labels, position_ids=position_ids, cu_seqlens=cu,
                max_seqlen=max_seqlen, seq_idx=seq_idx,
                num_loss_tokens=int((labels != IGNORE_INDEX).sum()), attention_mask=attention_mask)
