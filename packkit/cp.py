"""Context parallelism (CP) for packed batches, the torch side: one rank's tensors of a packed batch
(:func:`shard`, :class:`CPShard`), the way back (:func:`restore`), and packkit's reference CP attention
(:func:`cp_attention`, :func:`register_hf_cp_attention` for Hugging Face models). Where every token goes
(the layouts ``"zigzag"``, ``"contiguous"``, ``"ulysses"``, ``"hybrid"``, drawn there) is planned from
segment lengths alone by :mod:`packkit.cp_plan` (numpy only: the CLI and the budget plan without torch).

Every rank keeps what the unsharded row meant: **global** per-document positions (RoPE), labels
**shifted before slicing** (the target of a rank's last token is the next rank's first token), the
document of every token, the **global** loss-token count (the loss is a sum over ranks divided by it)
and a way back to the row's order.

The loss under CP, every :mod:`packkit.weighting` alike: a rank's loss is ``sum_t w_t CE_t / Z`` over its own
targets, ``w_t`` the factor ``a_c`` of the target's document counted over the **whole** document (every rank's
tokens of it; :attr:`CPShard.loss_weight`, sliced like ``shift_labels``), and ``Z`` the step's normaliser, to
which the batch adds its part once, whatever its number of CP ranks (:attr:`CPShard.loss_norm`: the batch's, the
same on every rank of the group, as ``num_loss_tokens`` is the batch's count). Summed over the CP group (the
gradients of the replicated parameters add), the rank's losses are the row's. No rank counts ``|O_c|`` from its
own tokens (prime-rl #2032's bug: a document cut across ranks would weigh as several) and no collective is
needed for the weights. :func:`packkit.loss.accumulation_step` takes the shards as micro-batches
(``step.loss(logits, shard)``) and counts each batch once per CP group: reduce over the group the gradients are
averaged over, a data-parallel group (one rank of each CP group: each batch is there once) or one that holds
whole CP groups (DP x CP, the world: the ``cp`` copies of each batch's counts are divided out; the loss is
multiplied by that group's size, so an average over it is the sum over the CP ranks). A group that holds some
ranks of a CP group and not others is refused. A step a sampler plans (``facts=sampler.step_facts()``, the sampler's
ranks the data-parallel ones) reduces nothing, and ``group=`` still names the gradients' group: the loss is
multiplied by its size.

Consumers and their exact arguments (:class:`CPShard` views):

==============================  ===================================================================
consumer                        view
==============================  ===================================================================
TE / Megatron-Core THD          :meth:`CPShard.te_params` (zigzag): ``PackedSeqParams`` /
                                ``DotProductAttention`` fields ``qkv_format='thd'``, ``cu_seqlens_q``,
                                ``cu_seqlens_kv`` (real lengths), ``cu_seqlens_q_padded``,
                                ``cu_seqlens_kv_padded`` (CP-padded), ``max_seqlen_q/kv``; global
                                (TE divides them by cp itself); the padded and real offsets are
                                checked against each other, so swapping them raises
ring-flash-attn llama3          :meth:`CPShard.llama3_args` (contiguous): ``cu_seqlens_q``,
                                ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``local_k_slice``
                                (what ``llama3_flash_attn_prepare_cu_seqlens`` returns)
DeepSpeed ALST / Ulysses (HF)   :meth:`CPShard.hf_kwargs` (ulysses): ``input_ids``, ``position_ids``,
                                ``shift_labels`` of the rank (``labels`` popped, as its adapter does),
                                ``use_cache=False``; :meth:`CPShard.ulysses_flash_kwargs`: the whole
                                row's ``cu_seq_lens_q/k``, ``max_length_q/k`` after the all-to-all
flash-attn, any layout          :meth:`CPShard.allgather_args` (the hybrid's GPU path): K/V
                                all-gathered, ``k_index`` picks each query piece's keys,
                                ``cu_seqlens_q/k``, ``max_seqlen_q/k`` for ``flash_attn_varlen_func``
torch ``context_parallel``      :meth:`CPShard.torch_indices`: the ``(1, T)`` rearrange (or restore)
                                indices of torch's ``_LoadBalancer._generate_indices``
packkit's reference             :func:`cp_attention` (float64, any process group, CPU/gloo):
                                ``method='ring'`` (LSE merging), ``'allgather'``, ``'alltoall'``
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from .batch import _NOTE, _note, count_loss_tokens, loss_factors, real_tokens_and_documents
from .cp_plan import CPPlan, _check_layout, _plan, check_cp_size
from .errors import ArgumentError, check_choice, check_int, renamed_keyword
from .integrations import transformers as hf  # transformers' attention call, read in one place
from .segments import IGNORE_INDEX, lengths_to_cu_seqlens, lengths_to_offsets, range_index

__all__ = ["METHODS", "CPShard", "TEParams", "Llama3Args", "AllGatherArgs", "shard", "plan_batch", "restore",
           "shift_labels", "cp_attention", "sum_over_ranks", "hf_cp_attention", "register_hf_cp_attention"]

METHODS = ("ring", "allgather", "alltoall")


def _segments_of(cu_seqlens) -> np.ndarray:
    """``(S,)`` int64 segment lengths of ``cu_seqlens``, each >= 1 (checked here, once: the plan trusts them)."""
    return _segments_and_offsets(cu_seqlens)[0]


def _segments_and_offsets(cu_seqlens) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`_segments_of`'s lengths and ``cu_seqlens`` as int64, the offsets of those lengths (the segments' flat
    starts, then the batch's tokens), or None where they are not (zero-length segments dropped, a first offset not 0).
    ``[0, 2, 2, 5] -> ([2, 3], None)``; ``[0, 2, 5] -> ([2, 3], [0, 2, 5])``."""
    cu = np.asarray(cu_seqlens, np.int64)
    lengths = cu[1:] - cu[:-1]  # np.diff's, without its Python wrapper
    least = np.minimum.reduce(lengths) if lengths.size else 1  # (the ufunc: ndarray.min's Python wrapper costs as much)
    if least < 0:
        raise ArgumentError("cu_seqlens must be non-decreasing, got {cu}", cu=list(np.asarray(cu_seqlens)))
    if least == 0:  # static-shape zero-length segments hold no token
        return lengths[lengths > 0], None
    return lengths, (cu if cu[0] == 0 else None)


def _plan_of(cu: torch.Tensor, ids: torch.Tensor, cp: int, layout: str, rank: int | None = None) -> CPPlan:
    """The plan of a batch from its ``cu_seqlens`` (read on the host once, checked against ``input_ids``), keeping
    the segments' flat starts as ``cu_seqlens`` has them (no cumsum of the lengths back: a pass over the segments);
    made for ``rank``'s tokens where given (the hybrid deals that rank's pieces alone: ``cp_plan._plan``)."""
    lengths, offsets = _segments_and_offsets(cu.numpy() if cu.device.type == "cpu" else cu.cpu().numpy())
    _check_tokens(int(offsets[-1]) if offsets is not None else int(lengths.sum()), ids)
    plan = _plan(lengths, cp, layout, None if offsets is None else int(offsets[-1]), rank)  # the lengths checked once
    if offsets is not None:
        plan._keep_flat_starts(offsets)
    return plan


# ----------------------------------------------------------------------------------------------
# the shard: one rank's tensors and its consumers' arguments
# ----------------------------------------------------------------------------------------------


class TEParams(NamedTuple):
    """TransformerEngine / Megatron-Core ``PackedSeqParams`` for THD with CP (global, unsharded offsets:
    TE divides them by ``cp_size`` itself). ``PackedSeqParams(**p._asdict())``, or
    ``DotProductAttention(...)(q, k, v, **p._asdict(), attn_mask_type="padding_causal")``.

    ``cu_seqlens_q/kv``: ``(S + 1,)`` int32, the **real** document lengths; ``cu_seqlens_q/kv_padded``:
    ``(S + 1,)`` int32, the CP-padded ones (each a multiple of ``2 * cp``), which say where each document
    sits in the rank's tokens. Swapping them is refused (see :meth:`check`)."""

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int

    def check(self, cp_size: int) -> "TEParams":
        """Raise unless the padded offsets are padded (every length a multiple of ``2 * cp_size`` and at
        least the real one): the TE #1409 NaNs came from passing one for the other."""
        real = np.diff(self.cu_seqlens_q.cpu().numpy().astype(np.int64))
        padded = np.diff(self.cu_seqlens_q_padded.cpu().numpy().astype(np.int64))
        if real.shape != padded.shape or (padded % (2 * cp_size)).any() or (padded < real).any():
            raise ValueError(f"cu_seqlens_q_padded must hold every document padded to a multiple of 2*cp="
                             f"{2 * cp_size} and cu_seqlens_q the real lengths; got padded lengths "
                             f"{padded.tolist()[:8]} for real {real.tolist()[:8]} (are they swapped?)")
        return self


class Llama3Args(NamedTuple):
    """ring-flash-attn's llama3 arguments, in the order ``llama3_flash_attn_prepare_cu_seqlens``
    returns them: ``llama3_flash_attn_varlen_func(q, k, v, **args._asdict(), heads_k_stride=...,
    causal=True, group=cp_group)`` (its ``causal`` defaults to False: pass it)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: slice


class AllGatherArgs(NamedTuple):
    """Any layout on flash-attn after an all-gather of K/V (``dist.all_gather_into_tensor``: rank 0's
    tokens first): ``k_index`` picks, for each of this rank's query pieces, its document's keys from the
    start to the piece's last token, so ``flash_attn_varlen_func(q, kg[k_index], vg[k_index],
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)`` (causal aligned bottom-right,
    flash-attn >= 2.1) is the unsharded attention of this rank's queries.

    ``cu_seqlens_q``: ``(P + 1,)`` int32 over the rank's tokens (one segment a piece); ``cu_seqlens_k``:
    ``(P + 1,)`` int32 over ``k_index``; ``k_index``: ``(M,)`` int64 into the gathered ``cp * n`` tokens."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    k_index: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class CPShard:
    """One rank's part of a packed batch (``[1, local_len]`` tensors), and its consumers' arguments.

    Attributes:
        input_ids:     int64 ``[1, n]`` (``n = plan.local_len``); CP padding holds ``pad_id``.
        shift_labels:  int64 ``[1, n]``: the target of each token, shifted on the whole batch before
                       slicing (``-100`` on the last token of a document, on prompts, on padding).
        position_ids:  int64 ``[1, n]``: global positions inside each document (``0..len-1``; CP padding
                       inside a document continues its positions, a padding segment starts at 0).
        seq_idx:       int32 ``[1, n]``: the global segment of each token.
        index:         int64 ``(n,)``: the flat index into the batch of each token, ``-1`` for CP padding.
        num_loss_tokens: Python int, loss tokens of the **whole** batch (every rank divides by it).
        num_local_loss_tokens: Python int, this rank's share of them.
        num_tokens, num_examples: Python ints, the whole batch's real tokens and documents (counted once per
                       CP group by :func:`packkit.loss.accumulation_step`, as ``num_loss_tokens``).
        max_seqlen:    Python int, the batch's longest document (global).
        plan, rank:    the :class:`~packkit.cp_plan.CPPlan` and this rank.
        batch_shape:   the unsharded batch's ``(B, W)``.

    Under a ``loss_weighting`` (:mod:`packkit.weighting`) the ``shift_labels`` carry the rank's weights as a
    batch's labels do (:func:`packkit.batch.loss_factors`): :attr:`loss_weight`, :attr:`loss_norm`,
    :attr:`loss_weighting`; ``accumulation_step([shard, ...])`` and ``step.loss(logits, shard)`` read them.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    position_ids: torch.Tensor
    seq_idx: torch.Tensor
    index: torch.Tensor
    num_loss_tokens: int
    num_local_loss_tokens: int
    max_seqlen: int
    plan: CPPlan
    rank: int
    batch_shape: tuple
    num_tokens: int | None = None
    num_examples: int | None = None

    #: the loss reads ``shift_labels`` (:func:`packkit.loss.accumulation_step`, ``step.loss(logits, shard)``)
    labels_shifted = True

    @property
    def labels(self) -> torch.Tensor:
        """The rank's targets, ``shift_labels`` (``labels_shifted`` is True): what the loss reads."""
        return self.shift_labels

    @property
    def loss_weight(self) -> torch.Tensor:
        """float64 ``[1, n]``: the weight of each target (``shift_labels``' place), the factor ``a_c`` of its
        document counted over the whole document (every rank's part), 0 on ``-100`` and CP padding; 1 on every
        target for the token mean. Before ``Z``: the rank's loss is ``sum_t w_t CE_t / Z``."""
        found = loss_factors(self.shift_labels)
        return self.shift_labels.ne(IGNORE_INDEX).to(torch.float64) if found is None else found[0]

    @property
    def loss_norm(self) -> float:
        """Python float, the **batch's** part of the step's ``Z`` (every document's ``z_c``, whichever ranks
        hold its tokens), the same on every rank of the CP group: counted once per group, not per rank (the
        token mean's is ``num_loss_tokens``)."""
        found = loss_factors(self.shift_labels)
        return float(self.num_loss_tokens) if found is None else float(found[1])

    @property
    def loss_weighting(self) -> str | None:
        """The name of the batch's :mod:`packkit.weighting` (None: the token mean)."""
        return _note(self.shift_labels).get("loss_weighting")

    @property
    def layout(self) -> str:
        return self.plan.layout

    @property
    def cp_size(self) -> int:
        return self.plan.cp_size

    def _device(self):
        return self.input_ids.device

    def _need(self, *layouts) -> None:
        if self.layout not in layouts:
            raise ValueError(f"this view needs cp_layout={' or '.join(map(repr, layouts))}; the shard was made with "
                             f"cp_layout={self.layout!r} (shard(batch, ..., cp_layout={layouts[0]!r}))")

    # -- TransformerEngine / Megatron-Core (zigzag) --

    def te_params(self) -> TEParams:
        """TE's THD ``PackedSeqParams`` fields (global offsets; see :class:`TEParams`)."""
        self._need("zigzag")
        n = self.plan.num_segments
        real = lengths_to_cu_seqlens(self.plan.lengths[:n])
        padded = lengths_to_cu_seqlens(self.plan.padded[:n])
        dev = self._device()
        cu, cu_pad = (torch.from_numpy(x).to(dev) for x in (real, padded))
        longest = int(self.plan.padded[:n].max(initial=0))
        return TEParams("thd", cu, cu, cu_pad, cu_pad, longest, longest).check(self.cp_size)

    # -- ring-flash-attn llama3 (contiguous) --

    def llama3_args(self) -> Llama3Args:
        """ring-flash-attn's ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``
        for this rank (causal), from the plan on the host: no ``.item()`` on a device tensor."""
        self._need("contiguous")
        cu = lengths_to_offsets(self.plan.padded)  # the whole padded row, padding segment included
        L, r = self.plan.local_len, self.rank
        lo, hi = r * L, (r + 1) * L
        first = int(np.searchsorted(cu, lo, side="right")) - 1
        last = int(np.searchsorted(cu, hi, side="left"))
        seg_start, seg_end = cu[first:last], np.minimum(cu[first + 1:last + 1], hi)
        q_len = seg_end - np.maximum(seg_start, lo)
        k_len = seg_end - seg_start  # keys from the document's start to the rank's last query
        cu_q, cu_k = lengths_to_cu_seqlens(q_len), lengths_to_cu_seqlens(k_len)
        dev = self._device()
        return Llama3Args(torch.from_numpy(cu_q).to(dev), torch.from_numpy(cu_k).to(dev), int(q_len.max()),
                          int(k_len.max()), slice(int(seg_start[0]), int(seg_end[-1])))

    # -- flash-attn after an all-gather (any layout, the hybrid's GPU path) --

    def allgather_args(self) -> AllGatherArgs:
        """This rank's pieces as flash-attn varlen arguments over all-gathered K/V (:class:`AllGatherArgs`)."""
        plan, p = self.plan, self.plan.rank_pieces(self.rank)
        # where every slot of the padded stream G sits in the gathered buffer (rank-major)
        where = np.empty(plan.cp_size * plan.local_len, np.int64)
        where[np.concatenate([plan.g_index(r) for r in range(plan.cp_size)])] = np.arange(where.size)
        _, g_start = plan._seg_starts()
        seg, off, n = plan.piece_seg[p], plan.piece_offset[p], plan.piece_len[p]
        keys = off + n  # a piece sees its document from position 0 to its own last token
        k_index = where[range_index(g_start[seg], keys)]
        dev = self._device()
        return AllGatherArgs(torch.from_numpy(lengths_to_cu_seqlens(n)).to(dev),
                             torch.from_numpy(lengths_to_cu_seqlens(keys)).to(dev), int(n.max(initial=0)),
                             int(keys.max(initial=0)), torch.from_numpy(k_index).to(dev))

    # -- Hugging Face / DeepSpeed ALST (ulysses; any layout with packkit's cp_attention) --

    def hf_kwargs(self) -> dict:
        """What DeepSpeed's ``UlyssesSPDataLoaderAdapter`` hands the model on each rank: ``input_ids``,
        ``position_ids``, ``shift_labels`` (pre-shifted; no ``labels``), ``use_cache=False``."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "shift_labels": self.shift_labels,
                "use_cache": False}

    def ulysses_flash_kwargs(self) -> dict:
        """The whole row's flash kwargs after Ulysses' all-to-all (every rank holds every token of
        ``heads / cp`` heads): ``cu_seq_lens_q/k`` int32 over the padded row, ``max_length_q/k`` ints."""
        self._need("ulysses", "contiguous")
        cu = torch.from_numpy(lengths_to_cu_seqlens(self.plan.padded)).to(self._device())
        longest = int(self.plan.padded.max(initial=0))
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    def hf_cp_kwargs(self) -> dict:
        """:meth:`hf_kwargs` plus what packkit's CP attention (:func:`register_hf_cp_attention`) reads in
        every layer: ``cp_seq_idx`` and ``cp_position_ids`` (``[1, n]``)."""
        return {**self.hf_kwargs(), "cp_seq_idx": self.seq_idx, "cp_position_ids": self.position_ids}

    def attention_kwargs(self) -> dict:
        """What :func:`cp_attention` needs besides q, k, v: ``seq_idx`` and ``position_ids``, ``(n,)``."""
        return {"seq_idx": self.seq_idx[0], "position_ids": self.position_ids[0]}

    def torch_indices(self, *, restore: bool = False) -> torch.Tensor:
        """``(1, cp_size * local_len)`` int64 on the shard's device: the plan's
        :meth:`~packkit.cp_plan.CPPlan.rearrange_index`, the indices torch's ``context_parallel`` load
        balancers generate (``_LoadBalancer._generate_indices(restore)``)."""
        return torch.from_numpy(self.plan.rearrange_index(restore=restore)).to(self._device())

    def take(self, x: torch.Tensor, *, fill=0) -> torch.Tensor:
        """This rank's part of a per-token tensor of the batch (``[B, W, ...]`` or ``[T, ...]``, flat
        order), ``fill`` on CP padding: ``(n, ...)``."""
        return _take(x, self.index, self.batch_shape, fill)


def _take(x: torch.Tensor, index: torch.Tensor, shape: tuple, fill) -> torch.Tensor:
    """Rows ``index`` of a per-token tensor laid out as the batch (``shape + features``, or flat
    ``(T,) + features``), ``fill`` where ``index`` is -1 (CP padding)."""
    num_tokens = math.prod(shape)
    if tuple(x.shape[:len(shape)]) == tuple(shape):
        flat = x.reshape(num_tokens, *x.shape[len(shape):])
    elif x.dim() and x.shape[0] == num_tokens:
        flat = x
    else:
        raise ValueError(f"a per-token tensor of the batch must be shaped {tuple(shape)} + features or "
                         f"({num_tokens},) + features; got {tuple(x.shape)}")
    index = index.to(flat.device)
    # index_select, not flat[index]: advanced indexing fans out to the thread pool (17 ms against 9 us
    # for 4k tokens of a 32k row on a loaded 2-core machine)
    out = flat.index_select(0, index.clamp_min(0))
    pad = index < 0
    if bool(pad.any()):
        out.masked_fill_(pad.view(-1, *[1] * (out.dim() - 1)), fill)
    return out


def _batch_fields(batch) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor]:
    """``(input_ids [B, W], labels (any shape), labels_shifted, cu_seqlens)`` of a PackedBatch or its dict view."""
    mapping = isinstance(batch, dict) or isinstance(batch, Mapping)  # (a PackedBatch is a dict: no ABC check)
    if not mapping and not hasattr(batch, "input_ids"):
        raise TypeError(f"shard takes a PackedBatch (or its dict view), got {type(batch).__name__}")
    get = batch.get if mapping else lambda k, d=None: getattr(batch, k, d)
    ids = get("input_ids")
    shifted = "shift_labels" in batch if mapping else bool(getattr(batch, "labels_shifted", False))
    labels = get("shift_labels") if shifted else get("labels")
    if ids is None or labels is None:
        raise KeyError("shard needs 'input_ids' and 'labels' (or 'shift_labels') in the batch")
    cu = getattr(batch, "cu_seqlens", None)
    if cu is None:
        cu = get("cu_seq_lens_q")
    if cu is None:
        raise KeyError("shard needs the batch's segments: a PackedBatch (cu_seqlens) or 'cu_seq_lens_q'")
    return (ids if ids.dim() == 2 else ids.reshape(1, -1)), labels, shifted, cu


def _check_tokens(num_tokens: int, ids: torch.Tensor) -> None:
    if num_tokens != ids.numel():
        raise ValueError(f"cu_seqlens covers {num_tokens} tokens but input_ids holds {ids.numel()}")


#: what a shard's ``shift_labels`` note of its place: ``(cp rank, cp size, the batch's loss tokens, real tokens,
#: documents)`` (:func:`packkit.loss.accumulation_step` counts each batch once per CP group from it)
_CP_NOTE = "cp_shard"

#: where a batch keeps its CP plan: in its ``cu_seqlens``' note (:mod:`packkit.batch`), with its other segment facts
_PLAN_NOTE = "cp_plan"


def plan_batch(batch, *, cp_size: int, cp_layout: str = "hybrid") -> CPPlan:
    """The CP plan of ``batch`` (a ``PackedBatch`` or its dict view), made now and kept with the batch, so that
    every later :func:`shard` of it for this ``cp_size`` and ``cp_layout`` reads it instead of planning. Made in
    the ``collate_fn`` (a DataLoader worker), it takes the planning off the rank's step: the plan travels with the
    batch (in its ``cu_seqlens``' note, through the worker's queue and ``batch.to(device)``), and so does what
    every rank reads of it (the segment starts; the hybrid's pieces sorted by rank, each rank's a slice).
    ``PackedRowsCollator(cp_size=...)`` calls it. A batch whose ``cu_seqlens`` is replaced is planned afresh.

    >>> from packkit.batch import PackedBatch
    >>> b = PackedBatch(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None],
    ...                 position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    ...                 cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))
    >>> plan_batch(b, cp_size=2, cp_layout="hybrid") is shard(b, cp_size=2, rank=1, cp_layout="hybrid").plan
    True
    """
    layout = _check_layout(cp_layout)
    cp = check_cp_size(cp_size)
    ids, _, _, cu = _batch_fields(batch)
    plan = _plan_of(cu, ids, cp, layout)
    plan._seg_starts()
    if plan.dealt is not None:  # the hybrid's pieces dealt in no rank's order: sorted once here, not by every rank
        plan._pieces()
    elif layout == "zigzag":  # the columns every rank's zigzag pieces share
        plan._zigzag_columns()
    _note(cu)[_PLAN_NOTE] = plan
    return plan


def _noted_plan(cu: torch.Tensor, cp: int, layout: str) -> CPPlan | None:
    """The plan :func:`plan_batch` kept on ``cu``, if it was made for ``cp`` and ``layout``."""
    plan = cu.__dict__.get(_NOTE, {}).get(_PLAN_NOTE)
    return plan if plan is not None and plan.cp_size == cp and plan.layout == layout else None


def shift_labels(labels: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
    """Targets per token of ``[B, W]`` labels, shifted per row (``labels[:, 1:]`` then ``-100``):
    ``[[-100, 5, 6, -100, 7]] -> [[5, 6, -100, 7, -100]]``. Already-shifted labels are returned as is."""
    if shifted:
        return labels
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def shard(batch, *, cp_size: int, rank: int, cp_layout: str = "hybrid", pad_id: int = 0,
          plan: CPPlan | None = None, **renamed) -> CPShard:
    """One rank's part of a packed batch for a context-parallel group of ``cp_size`` ranks.

    Args:
        batch: a ``PackedBatch`` (or its dict view with ``cu_seq_lens_q``): ``[B, W]`` windows or a
            ``[1, T]`` row; its segments are read from ``cu_seqlens``.
        cp_size, rank: the CP group's size and this rank in it.
        cp_layout: ``"zigzag"``, ``"contiguous"``, ``"ulysses"`` or ``"hybrid"`` (drawn in :mod:`packkit.cp_plan`);
            its old name ``layout=`` still works, with a ``DeprecationWarning``.
        pad_id: token of the CP padding.
        plan: a :class:`~packkit.cp_plan.CPPlan` of this batch already made (every rank makes the same one).

    Returns: a :class:`CPShard`; ``restore([...every rank's output...], plan=shard.plan)`` puts
    per-token outputs back in the batch's order.

    >>> from packkit.batch import PackedBatch
    >>> ids = torch.arange(8)[None]
    >>> b = PackedBatch(input_ids=ids, labels=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    ...                 cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))
    >>> s = shard(b, cp_size=2, rank=0, cp_layout="zigzag")
    >>> s.index.tolist(), s.position_ids.tolist()   # rows of the packed row; per-document positions
    ([0, 3, 4, 7], [[0, 3, 0, 3]])
    """
    layout = _check_layout(renamed_keyword("shard", renamed, "layout", "cp_layout", cp_layout, "hybrid") if renamed
                           else cp_layout)
    cp = check_cp_size(cp_size)
    if not (type(rank) is int and 0 <= rank < cp):  # (a Python int in range passes without a call)
        rank = check_int(rank, "rank", low=0, high=cp - 1)
    ids, labels, shifted, cu = _batch_fields(batch)
    noted = _noted_plan(cu, cp, layout)  # the collator's (plan_batch): nothing to read or plan
    if plan is None and noted is None:
        plan = _plan_of(cu, ids, cp, layout, rank)
    elif plan is None or plan is noted:
        plan = noted
        _check_tokens(plan.num_tokens, ids)
    elif plan.cp_size != cp or plan.layout != layout or not np.array_equal(plan.lengths[:plan.num_segments],
                                                                        _segments_of(cu.cpu().numpy())):
        raise ValueError("the plan passed to shard was made for another batch, cp_size or cp_layout")
    labels = labels if labels.shape == ids.shape else labels.reshape(ids.shape)
    total = ids.numel()
    index, take, seg, pos, pad, ends = _rank_tokens(plan, rank, ids.shape[-1], total)
    dev = ids.device
    on = torch.from_numpy if dev.type == "cpu" else (lambda a: torch.from_numpy(a).to(dev))
    pad, take_t = on(pad), on(take)
    if shifted:
        where, ends = take_t, None
    else:  # the targets read where they sit in the row (the next token), not from a shifted copy of the batch
        after = take + 1
        if total == 1:  # CP padding reads token 0: no token 1 to read
            after[:] = 0
        after[ends] = 0  # a row's last token: read, then filled
        where, ends = on(after), on(ends)
    local_targets = _gather(labels, where, pad, ends, IGNORE_INDEX)[None]
    _carry_weights(labels, local_targets, where, pad, ends)
    tokens, examples = _batch_counts(batch, labels, cu)
    n_loss = count_loss_tokens(labels, shifted=shifted)  # the batch's: counted once
    # what accumulation_step reads of a shard (or of its hf_kwargs' shift_labels): the batch's counts, once per group
    _note(local_targets)[_CP_NOTE] = (rank, cp, n_loss, tokens, examples)
    return CPShard(
        input_ids=_gather(ids, take_t, pad, None, pad_id)[None],
        shift_labels=local_targets,
        position_ids=on(pos[None]),  # (numpy's view: torch's [None] costs a few us)
        seq_idx=on(seg[None]),
        index=on(index), num_loss_tokens=n_loss,
        num_local_loss_tokens=_count_targets(local_targets),
        max_seqlen=int(np.maximum.reduce(plan.lengths)) if plan.lengths.size else 0, plan=plan, rank=rank,
        batch_shape=tuple(ids.shape),
        num_tokens=tokens, num_examples=examples)


def _rank_tokens(plan: CPPlan, rank: int, width: int, total: int) -> tuple[np.ndarray, ...]:
    """What :func:`shard` reads of ``rank``'s tokens, rows of ``width`` of the batch's ``total``: ``(index, take, seg,
    pos, pad, ends)``: the flat index of each token (-1 on CP padding) and one to read (0 there), its segment (int32)
    and position, where the padding is (zigzag: a ``(local_len,)`` bool mask, the padding being most of a short
    document's tail chunk; the others: the places of their few padding slots) and the places of the tokens that end
    their row (no next token to predict: labels shift per row)."""
    if plan.layout == "zigzag":
        index, seg, pos, pad = plan._zigzag_tokens(rank, total)
        return index, np.maximum(index, 0), seg, pos, pad, plan._zigzag_places(range(width - 1, total, width), rank)
    if plan.layout != "hybrid":  # contiguous, ulysses: the rank's tokens are slots lo .. hi of the row
        source, seg, pos, pad_at = plan._contiguous_tokens(rank)
        lo = rank * plan.local_len
        ends = np.arange(lo + (width - 1 - lo) % width - lo, min(lo + plan.local_len, total) - lo, width)
    else:
        source, seg, pos, pad_at, first, real, out = plan.local_tokens(rank)
        ends = _row_ends(first, real, out, width, total)
    take = source
    if pad_at.size:  # CP padding reads token 0, then is filled
        take = source.copy()
        take[pad_at] = 0
    return source, take, seg, pos, pad_at, ends


def _carry_weights(labels: torch.Tensor, targets: torch.Tensor, where: torch.Tensor, pad: torch.Tensor,
                   ends: torch.Tensor | None) -> None:
    """Note on the rank's ``targets`` (``[1, n]``) what a weighted batch's ``labels`` note
    (:func:`packkit.batch.loss_factors`): each target's factor, gathered from the **whole** batch's factors
    exactly as the target was gathered from its labels (``where``; 0 at ``pad`` and ``ends``), so a document cut
    across ranks keeps the ``a_c`` of its whole ``|O_c|``; and the batch's part of ``Z``, whole (counted once
    per CP group). Nothing for a batch without a weighting."""
    found = loss_factors(labels)
    if found is None:
        return
    factors, z = found
    note, mine = _note(labels), _note(targets)
    mine.update(loss_weighting=note["loss_weighting"], loss_step_constant=note.get("loss_step_constant", 0.0),
                loss_factor=_gather(factors, where, pad, ends, 0.0)[None], loss_z=z)


def _batch_counts(batch, labels: torch.Tensor, cu: torch.Tensor) -> tuple:
    """``(real tokens, documents)`` of the whole batch: a ``PackedBatch``'s own (read once: each of its
    ``num_tokens`` and ``num_examples`` counts them both when the batch did not note them), else from its segments."""
    own = getattr(batch, "_tokens_and_examples", None)
    if own is not None:
        return own()
    tokens, examples = real_tokens_and_documents(cu, labels)
    return int(tokens), int(examples)


def _gather(x: torch.Tensor, index: torch.Tensor, pad: torch.Tensor, ends: torch.Tensor | None, fill) -> torch.Tensor:
    """``x.reshape(-1)[index]`` (every index valid) with ``fill`` on the padding ``pad`` (a bool mask, or places) and
    at the places ``ends``, ``(n,)``."""
    out = x.reshape(-1).index_select(0, index)
    if pad.dtype == torch.bool:
        out.masked_fill_(pad, fill)
    elif pad.numel():
        out.index_fill_(0, pad, fill)
    return out.index_fill_(0, ends, fill) if ends is not None and ends.numel() else out


def _row_ends(first, real, out, width: int, total: int) -> np.ndarray:
    """The places among a rank's tokens of those that end their row of ``width`` (labels shift per row: no next
    token), found from its pieces (``first`` token, ``real`` tokens, place ``out``; in the batch's flat order, the
    real ones before the padding ones): a per-token ``% width`` costs as much as the shard; one row (``width ==
    total``) ends once, at token ``total - 1``: the end of the rank's last real piece, or none of its tokens.
    One row ``[0..3]``, a rank holding ``[2, 3, pad]`` (one piece: first 2, real 2, out 0) -> ``[1]``."""
    if width == total:  # (a few numbers read, not a pass over the pieces)
        k = real.size - 1 if real.size and real[-1] else real.size - 2  # its last real piece
        return out[k:k + 1] + (total - 1 - first[k]) if k >= 0 and first[k] + real[k] == total else out[:0]
    first_end = (first // width + 1) * width - 1  # the last token of the row a piece starts in
    count = np.where(real > 0, np.maximum((first + real - 1 - first_end) // width + 1, 0), 0)
    return np.repeat(out + first_end - first, count) + range_index(np.zeros(count.size, np.int64), count) * width


def _count_targets(targets: torch.Tensor) -> int:
    """Targets that are not ``IGNORE_INDEX`` (on the host: one pass, no tensor op per call)."""
    if targets.device.type == "cpu":  # (the ufunc: np.count_nonzero's Python wrapper costs as much)
        return int(np.add.reduce(targets.numpy() != IGNORE_INDEX, axis=None))
    return int(torch.count_nonzero(targets != IGNORE_INDEX))


def _restore_parts(parts, plan: CPPlan) -> list:
    """``restore``'s parts checked, as tensors ``(local_len, ...)``: one per rank, each a tensor, a numpy
    array or a (nested) list of numbers, of equal trailing shape and dtype; errors name the part (its rank)."""
    if isinstance(parts, (torch.Tensor, np.ndarray)) and parts.ndim >= 2:
        parts = list(parts)  # the parts stacked, rank after rank
    if isinstance(parts, (torch.Tensor, np.ndarray, str, bytes, Mapping)) or not hasattr(parts, "__len__"):
        raise TypeError(f"restore takes a list of {plan.cp_size} parts (one per rank, in rank order), got "
                        f"{type(parts).__name__}")
    if len(parts) != plan.cp_size:
        raise ValueError(f"restore needs one part per rank ({plan.cp_size}), got {len(parts)}")
    out = []
    for r, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            try:
                a = np.asarray(p)
            except ValueError:  # ragged nested lists
                a = np.asarray(None, dtype=object)
            if a.dtype.kind not in "biuf":
                raise TypeError(f"restore: part {r} (rank {r}) is a {type(p).__name__} of {a.dtype} values, not "
                                "numbers; pass each rank's output as a tensor (or a numpy array)")
            p = torch.from_numpy(np.ascontiguousarray(a))
        if p.dim() > 1 and p.shape[0] == 1 and p.shape[1] == plan.local_len:
            p = p[0]
        if p.dim() == 0 or p.shape[0] != plan.local_len:
            raise ValueError(f"restore: part {r} (rank {r}) has shape {tuple(p.shape)}; every part holds the "
                             f"rank's local_len={plan.local_len} tokens, (local_len, ...) or (1, local_len, ...)")
        if out and (p.shape[1:] != out[0].shape[1:] or p.dtype != out[0].dtype):
            raise ValueError(f"restore: part {r} (rank {r}) is {tuple(p.shape)} {p.dtype} and part 0 "
                             f"{tuple(out[0].shape)} {out[0].dtype}; every rank's output has one shape and dtype")
        out.append(p)
    return out


def restore(parts, *, plan: CPPlan, shape=None) -> torch.Tensor:
    """Every rank's per-token outputs (``(local_len, ...)`` or ``(1, local_len, ...)``, rank order) back in
    the batch's flat order: ``(num_tokens, ...)``, or ``shape`` (e.g. the batch's ``[B, W]``) when given.
    ``restore([shard(b, rank=r, ...).input_ids for r in ranks], plan=...)`` is ``b.input_ids`` flattened."""
    parts = _restore_parts(parts, plan)
    cat = torch.cat(parts)
    out = cat[torch.from_numpy(plan.inverse()).to(cat.device)]
    if shape is None:
        return out
    shape = tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and d >= 1 for d in shape) or math.prod(shape) != out.shape[0]:
        raise ValueError(f"restore: shape={shape} for the batch's {out.shape[0]} tokens; pass the batch's own "
                         "input_ids.shape (or no shape, for the flat order)")
    return out.reshape(*shape, *out.shape[1:])


# ----------------------------------------------------------------------------------------------
# the reference attention: float64-exact, any process group, CPU under gloo
# ----------------------------------------------------------------------------------------------


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _block_scores(q, k, q_key, k_key, k_end, scale):
    """Masked scores ``(H, n, m)`` of queries against one block of keys: a query sees the keys whose range
    ``[k_key, k_end)`` holds its own key (:func:`_mask_keys`: its document up to it, or its ancestors in a prefix
    tree), wherever the layout put them."""
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    allowed = (k_key[None, :] <= q_key[:, None]) & (q_key[:, None] < k_end[None, :])
    return s.masked_fill(~allowed, float("-inf"))


def _mask_keys(seq_idx, position_ids, tin, tout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, end)`` int64 ``(n,)`` of every token, the one mask of :func:`cp_attention`: query ``q`` sees key
    ``k`` iff ``key[k] <= key[q] < end[k]``. A prefix tree's Euler tour is that test as it is (``tin``, ``tout``:
    :class:`packkit.prefixtree.TreeBatch`); a document-causal row is its special case ``key = seq << 32 | pos``,
    ``end = (seq + 1) << 32`` (same segment, key position <= query position)."""
    if tin is not None:
        return tin.long(), tout.long()
    seq = seq_idx.long()
    return (seq << 32) + position_ids.long(), (seq + 1) << 32


def _probs(s, lse):
    """``exp(s - lse)`` with rows that see no key in this block giving 0 (not NaN)."""
    finite = torch.isfinite(lse)
    return torch.where(finite[..., None], torch.exp(s - torch.where(finite, lse, 0)[..., None]), 0.0)


def _masked_attention(q, k, v, q_key, k_key, k_end, scale):
    """Differentiable masked attention (:func:`_block_scores`) of q ``(n, H, D)`` over k, v ``(m, H, D)``."""
    s = _block_scores(q, k, q_key, k_key, k_end, scale)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", p, v)


def _p2p_shift(tensors, group, rank, size):
    """Send ``tensors`` to the next rank of the ring, receive the previous rank's (same shapes)."""
    import torch.distributed as dist  # keeps packkit.cp importable where torch.distributed is missing

    nxt = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
    prv = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V blocks travel the ring, partial outputs merge by their log-sum-exp; the
    backward sends each block's dK/dV along with it until it is home."""

    @staticmethod
    def forward(ctx, q, k, v, key, end, scale, group, rank, size):
        heads = q.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=q.dtype, device=q.device)
        blk = (k, v, key, end)
        for step in range(size):
            bk, bv, b_key, b_end = blk
            s = _block_scores(q, _expand_kv(bk, heads), key, b_key, b_end, scale)
            blk_lse = torch.logsumexp(s, dim=-1)
            blk_out = torch.einsum("hnm,mhd->nhd", _probs(s, blk_lse), _expand_kv(bv, heads))
            new = torch.logaddexp(lse, blk_lse)
            w_old, w_blk = _probs(lse[..., None], new)[..., 0], _probs(blk_lse[..., None], new)[..., 0]
            out = out * w_old.T[..., None] + blk_out * w_blk.T[..., None]
            lse = new
            if step < size - 1:
                blk = tuple(_p2p_shift(list(blk), group, rank, size))
        ctx.save_for_backward(q, k, v, key, end, out, lse)
        ctx.args = (scale, group, rank, size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, key, end, out, lse = ctx.saved_tensors
        scale, group, rank, size = ctx.args
        heads, group_heads = q.shape[1], q.shape[1] // k.shape[1]
        delta = (dout * out).sum(-1).T  # (H, n)
        dq = torch.zeros_like(q)
        blk = [k, v, key, end, torch.zeros_like(k), torch.zeros_like(v)]
        for _ in range(size):
            bk, bv, b_key, b_end, dk, dv = blk
            ke, ve = _expand_kv(bk, heads), _expand_kv(bv, heads)
            p = _probs(_block_scores(q, ke, key, b_key, b_end, scale), lse)
            dp = torch.einsum("nhd,mhd->hnm", dout, ve)
            ds = p * (dp - delta[..., None])
            dq += torch.einsum("hnm,mhd->nhd", ds, ke) * scale
            dke = torch.einsum("hnm,nhd->mhd", ds, q) * scale
            dve = torch.einsum("hnm,nhd->mhd", p, dout)
            # grouped heads: every query head of a group adds into its kv head
            dk = dk + dke.reshape(dke.shape[0], -1, group_heads, dke.shape[-1]).sum(2)
            dv = dv + dve.reshape(dve.shape[0], -1, group_heads, dve.shape[-1]).sum(2)
            blk = [bk, bv, b_key, b_end, dk, dv]
            if size > 1:  # cp_size sends bring every block, with its gradients, back to its rank
                blk = _p2p_shift(blk, group, rank, size)
        return dq, blk[4], blk[5], None, None, None, None, None, None


class _AllGather(torch.autograd.Function):
    """All-gather along the tokens (equal parts); the backward sums every rank's gradient and keeps
    this rank's part (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        import torch.distributed as dist  # lazy, as in _p2p_shift

        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.args = (group, rank, x.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        group, rank, n = ctx.args
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad[rank * n:(rank + 1) * n], None, None, None


class _AllToAll(torch.autograd.Function):
    """``x`` cut in ``size`` parts along ``split_dim``; part ``j`` goes to rank ``j``, and what every
    rank sends this one is concatenated along ``cat_dim``. The backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group, size):
        import torch.distributed as dist  # lazy, as in _p2p_shift

        ctx.args = (split_dim, cat_dim, group, size)
        send = [t.contiguous() for t in x.chunk(size, dim=split_dim)]
        recv = [torch.empty_like(send[0]) for _ in range(size)]
        dist.all_to_all(recv, send, group=group)
        return torch.cat(recv, dim=cat_dim)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim, group, size = ctx.args
        return _AllToAll.apply(grad, cat_dim, split_dim, group, size), None, None, None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_idx: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, tin: torch.Tensor | None = None,
                 tout: torch.Tensor | None = None, group=None, method: str = "ring",
                 scale: float | None = None) -> torch.Tensor:
    """Causal attention of a CP rank's tokens against the whole batch's, exact (the oracle).

    Args:
        q: ``(n, H, D)`` this rank's queries (``n = local_len``, equal on every rank); k, v:
            ``(n, Hkv, D)``, ``H % Hkv == 0``. Any float dtype; float64 for an oracle.
        seq_idx, position_ids: ``(n,)`` this rank's :meth:`CPShard.attention_kwargs`: a query sees the
            keys of its own segment at positions <= its own, wherever they live. Any layout.
        tin, tout: ``(n,)`` instead of them, a prefix tree's Euler tour over the whole batch
            (:meth:`packkit.prefixtree.TreeShard.attention_kwargs`): a query sees key ``k`` iff
            ``tin[k] <= tin[q] < tout[k]`` (its ancestors and itself).
        group: the CP process group (``None``: the default group).
        method: ``"ring"`` (K/V blocks passed round the ring, outputs merged by log-sum-exp),
            ``"allgather"`` (K/V all-gathered, llama3 / TE all-gather style) or ``"alltoall"`` (Ulysses:
            tokens for heads; needs ``H`` and ``Hkv`` divisible by the group size, else k, v are repeated
            to ``H`` heads first).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns: ``(n, H, D)``; differentiable in q, k, v (the backward communicates too).
    """
    import torch.distributed as dist  # lazy, as in _p2p_shift

    check_choice(method, "method", METHODS, what="cp_attention method")
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"cp_attention takes q (n, H, D) and k, v (n, Hkv, D) with H % Hkv == 0; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    pair = ("tin", "tout") if tin is not None or tout is not None else ("seq_idx", "position_ids")
    given = (tin, tout) if pair[0] == "tin" else (seq_idx, position_ids)
    if any(t is None or t.shape != (q.shape[0],) for t in given):
        raise ValueError(f"{pair[0]} and {pair[1]} must be ({q.shape[0]},), got "
                         f"{[None if t is None else tuple(t.shape) for t in given]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    key, end = _mask_keys(seq_idx, position_ids, tin, tout)
    if method == "ring":
        return _RingAttention.apply(q, k, v, key, end, scale, group, rank, size)
    g_meta = _AllGather.apply(torch.stack([key, end], 1), group, rank, size)
    if method == "allgather":
        kg, vg = (_AllGather.apply(t, group, rank, size) for t in (k, v))
        return _masked_attention(q, _expand_kv(kg, q.shape[1]), _expand_kv(vg, q.shape[1]), key, g_meta[:, 0],
                                 g_meta[:, 1], scale)
    heads = q.shape[1]
    if heads % size:
        raise ValueError(f"alltoall (Ulysses) needs the query heads ({heads}) divisible by the group size ({size})")
    if k.shape[1] % size:
        k, v = _expand_kv(k, heads), _expand_kv(v, heads)  # replicated kv heads, as DeepSpeed does
    # (n, H, D) -> (size * n, H / size, D): every token of the group, this rank's heads
    qh, kh, vh = (_AllToAll.apply(t, 1, 0, group, size) for t in (q, k, v))
    out = _masked_attention(qh, _expand_kv(kh, qh.shape[1]), _expand_kv(vh, qh.shape[1]), g_meta[:, 0],
                            g_meta[:, 0], g_meta[:, 1], scale)
    return _AllToAll.apply(out, 0, 1, group, size)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in the forward, the identity in the backward: every rank computes the same loss of the
    summed values, and each rank's gradient reaches its own part once (summed over ranks, the whole)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist  # lazy, as in _p2p_shift

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_ranks(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """``x`` summed over the CP group's ranks (per-sequence log-probabilities whose tokens several ranks scored),
    differentiable for a loss every rank computes alike from the sum: the gradients of the replicated
    parameters, summed over the group, are the unsharded ones. ``sum_over_ranks(tensor([1.]))`` on 2 ranks
    -> ``[2.]``."""
    return _SumOverRanks.apply(x, group)


# -- Hugging Face models: the CP attention of a sharded batch --

HF_CP_ATTENTION_NAME = "packkit_cp"


def hf_cp_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, *, group=None, method: str = "ring",
                    **kwargs):
    """A Hugging Face attention function (``transformers.AttentionInterface``) over one CP rank's tokens.

    query: ``(1, H, n, D)``; key, value: ``(1, Hkv, n, D)``: the rank's tokens, as the model sees
    ``model(**shard.hf_cp_kwargs())``. The documents come from the ``cp_seq_idx`` / ``cp_position_ids``
    kwargs (a prefix tree's shard: ``cp_tin`` / ``cp_tout``, its ancestors); the attention runs
    :func:`cp_attention` over ``group``. Returns ``((1, n, H, D), None)``.
    """
    if query.shape[0] != 1:
        raise ValueError(f"a CP shard is one row ([1, n]); got a batch of {query.shape[0]}")
    tree = kwargs.get("cp_tin") is not None  # a prefix tree's shard (packkit.prefixtree.TreeShard)
    q, k, v, (first, second), is_causal = hf.read_call(
        HF_CP_ATTENTION_NAME, module, query, key, value, attention_mask, dropout, kwargs,
        needs=("cp_tin", "cp_tout") if tree else ("cp_seq_idx", "cp_position_ids"),
        hint="a CP shard's cp_seq_idx and cp_position_ids, or a tree shard's cp_tin and cp_tout "
        "(model(**shard.hf_cp_kwargs()))")  # q, k, v: (n, heads, D), views of the one row
    if not is_causal:
        raise ValueError("the packkit_cp attention is causal only (CP shards a causal LM's rows)")
    mask = {"tin": first.reshape(-1), "tout": second.reshape(-1)} if tree else \
        {"seq_idx": first.reshape(-1), "position_ids": second.reshape(-1)}
    out = cp_attention(q, k, v, **mask, group=group, method=method, scale=scaling)
    return out[None], None


def register_hf_cp_attention(name: str = HF_CP_ATTENTION_NAME, *, group=None, method: str = "ring") -> str:
    """Register :func:`hf_cp_attention` (over ``group`` with ``method``) with transformers under ``name``
    and return the name, for ``model.set_attn_implementation(name)`` or ``attn_implementation=name``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        return hf_cp_attention(module, query, key, value, attention_mask, group=group, method=method, **kwargs)

    return hf.register(name, attention)
