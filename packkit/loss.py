"""Exact causal-LM loss under gradient accumulation and data parallelism.

The gradient an optimiser step should apply is the gradient of the **mean over every loss-bearing
token of the step**: all micro-batches of the accumulation window, on every data-parallel rank.
Averaging each micro-batch's own mean instead gives every micro-batch the same weight whatever its
token count, so a micro-batch of 20 loss tokens counts as much as one of 1,200::

    micro-batch      loss tokens   summed CE     mean of means            packkit
    0                   20            40.0       (40/20 + 600/1200) / 2    (40 + 600) / 1220
    1                 1200           600.0         = 1.25                    = 0.525

packkit sums the cross entropy of each micro-batch and divides by one count ``N``, the loss tokens
of the whole step, counted once before the first forward (and all-reduced across ranks)::

    loss_i = sum_CE(micro_batch_i) / N            (x world_size under DDP, see below)
    sum_i loss_i = mean CE over the step's N tokens

Counting loss tokens
--------------------
A causal LM predicts token ``t + 1`` from position ``t``: Hugging Face models shift inside the loss
(``logits[:, :-1]`` against ``labels[:, 1:]``), so the first label of a row is never a target. The
loss tokens of unshifted labels are therefore ``labels[..., 1:] != -100``; ``shifted=True`` means the
labels were already shifted (``shift_labels``) and every ``!= -100`` counts. packkit's packed batches
put ``-100`` on the first token of every document, so both counts agree on them::

    input_ids   [ a0 a1 a2 | b0 b1 | pad ]
    labels      [-100 a1 a2 |-100 b1 |-100 ]     loss tokens: a1 a2 b1 -> 3
    prediction    a0->a1  a1->a2  a2->(-100)  b0->b1  ...   (a2 never predicts b0)

Data parallelism
----------------
DDP (and FSDP) *average* gradients over ranks. With ``N`` the all-reduced count, the wanted gradient
is ``sum over ranks of grad(sum_CE_rank) / N``, which the average gives only if every rank's loss is
multiplied back by the world size: ``loss_i = world_size * sum_CE_i / N``.
:func:`accumulation_step` does this (``ddp_average=True``).

Hugging Face ``Trainer``
------------------------
``Trainer`` already follows this convention through ``num_items_in_batch``: before each optimiser
step it counts ``labels[..., 1:] != -100`` over the step's micro-batches (gathered over ranks when
``average_tokens_across_devices=True``, then multiplies the loss back by the number of processes),
and passes the count to the model's loss (HF causal LMs divide their summed cross entropy by it) or to
``compute_loss_func(outputs, labels, num_items_in_batch=...)``. packkit's batches carry labels in that
convention, so nothing more is needed; to compute the loss yourself pass
``compute_loss_func=packkit.loss.hf_compute_loss_func``, which divides the summed cross entropy by
``num_items_in_batch``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .batch import PackedBatch, _note, loss_factors, mark_repeat, real_tokens_and_documents, repeat_factors
from .cp import _CP_NOTE
from .integrations.transformers import StepCountHook  # Trainer's private step count, in one place
from .rules import DOCUMENT_KEYS, SEGMENT_KEYS
from .segments import IGNORE_INDEX

__all__ = [
    "count_loss_tokens",
    "token_normalized_loss",
    "hf_compute_loss_func",
    "AccumulationStep",
    "accumulation_step",
    "WeightedLossMixin",
]


# ----------------------------------------------------------------------------------------------
# counting
# ----------------------------------------------------------------------------------------------


def _labels_of(batch, *, shifted: bool):
    """``(labels, shifted)`` of a micro-batch: a tensor/array, a mapping or an object with ``labels``.

    A mapping that carries ``shift_labels`` (Hugging Face's padding-free collators, packkit's batches
    built with ``mask_first_label=False``) is counted on those, already shifted. A ``PackedBatch``
    says itself whether its labels are pre-shifted (its view carries ``shift_labels`` exactly then,
    as the model reads it): its own answer wins over ``shifted``; so does an object's
    ``labels_shifted`` flag.
    """
    if isinstance(batch, Mapping):
        if "shift_labels" in batch:
            return batch["shift_labels"], True
        if "labels" not in batch:
            raise KeyError(f"the batch has no 'labels' (keys: {sorted(batch)}); pass labels to count loss tokens")
        return batch["labels"], (False if isinstance(batch, PackedBatch) else shifted)
    own = getattr(batch, "labels_shifted", None)
    if isinstance(own, bool) and isinstance(getattr(batch, "labels", None), torch.Tensor):
        return batch.labels, own
    if isinstance(batch, (torch.Tensor, np.ndarray, list, tuple)):
        return batch, shifted
    labels = getattr(batch, "labels", None)
    if labels is None:
        raise TypeError(
            f"cannot read labels from a {type(batch).__name__}: pass a label tensor, a dict with 'labels' "
            "or a PackedBatch"
        )
    return labels, shifted


def _as_label_tensor(labels) -> torch.Tensor:
    """Labels as an integer tensor (no copy for a tensor): ``[[-100, 5]] -> tensor([[-100, 5]])``."""
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(np.asarray(labels))
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (int64 token ids or -100), got {labels.dtype}")
    if labels.dim() == 0:
        raise ValueError("labels must have at least one dimension: (T,) or (B, T)")
    return labels


def _count_tensor(labels: torch.Tensor, *, shifted: bool, ignore_index: int) -> torch.Tensor:
    """0-dim int64 tensor on ``labels.device``: the loss tokens (no host sync)."""
    targets = labels if shifted else labels[..., 1:]
    return (targets != ignore_index).sum(dtype=torch.int64)


def count_loss_tokens(labels, *, shifted: bool = False, ignore_index: int = IGNORE_INDEX) -> int:
    """Loss-bearing tokens of a batch: ``labels != -100`` after the causal shift.

    Args:
        labels: (B, T) or (T,) int64 tensor, array or list; or a dict with ``labels`` (or
            ``shift_labels``, counted as already shifted); or a ``PackedBatch``.
        shifted: the labels are already shifted (position ``t`` holds the target of logits ``t``), so
            every label counts; by default the first label of each row is not a target. A
            ``PackedBatch`` follows its own ``labels_shifted`` (``mask_first_label=False``) instead.

    Returns: a Python int.

    >>> count_loss_tokens([[-100, 7, 8, -100, 9]])          # targets are labels[:, 1:]
    3
    >>> count_loss_tokens([[5, 7, -100]]), count_loss_tokens([[5, 7, -100]], shifted=True)
    (1, 2)
    """
    labels, shifted = _labels_of(labels, shifted=shifted)
    return int(_count_tensor(_as_label_tensor(labels), shifted=shifted, ignore_index=ignore_index))


# ----------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------


def _check_count(num_loss_tokens):
    if num_loss_tokens is None or isinstance(num_loss_tokens, torch.Tensor):
        return num_loss_tokens
    if isinstance(num_loss_tokens, bool) or not isinstance(num_loss_tokens, numbers.Real):
        raise TypeError(f"num_loss_tokens must be a number or a tensor, got {num_loss_tokens!r}")
    if num_loss_tokens < 0:
        raise ValueError(f"num_loss_tokens must be >= 0, got {num_loss_tokens}")
    return num_loss_tokens


def token_normalized_loss(logits: torch.Tensor, labels, *, num_loss_tokens=None, shifted: bool = False,
                          ignore_index: int = IGNORE_INDEX, loss_weight=None) -> torch.Tensor:
    """Summed cross entropy over the loss-bearing tokens, divided by ``num_loss_tokens``.

    With ``loss_weight`` (float, the shape of ``labels``, aligned with them: the weight of the label at
    ``t``; :attr:`packkit.batch.PackedBatch.loss_weight`) each token's cross entropy is multiplied by its
    weight before the sum, and ``num_loss_tokens`` is the step's normaliser ``Z`` of
    :mod:`packkit.weighting`: ``sum_t w_t * CE_t / Z``.

    Packed (``[1, T]`` or ``[B, W]`` windows) and padded batches alike: only labels matter.

    Args:
        logits: (B, T, V) or (T, V) float. Half precision is upcast to float32 for the cross entropy
            (a sum over thousands of tokens loses digits in bf16); float64 stays float64.
        labels: (B, T) or (T,) int64, ``-100`` where no loss. Unshifted by default: logits ``t``
            predict ``labels[t + 1]`` (Hugging Face's convention); ``shifted=True`` pairs logits ``t``
            with ``labels[t]``.
        num_loss_tokens: the divisor: the loss tokens of the whole accumulation window (and of every
            rank), an int or a 0-dim tensor. ``None`` divides by this batch's own count (a plain mean).
            A count of 0 gives a loss of 0 (with a graph), not NaN.

    Returns: a 0-dim tensor, float32 (float64 for float64 logits).

    >>> logits = torch.zeros(1, 3, 4)                       # uniform over 4 classes: CE = log 4 per token
    >>> float(token_normalized_loss(logits, torch.tensor([[-100, 1, 2]]), num_loss_tokens=4))  # 2 * log(4) / 4
    0.6931471824645996
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a floating-point tensor (B, T, V) or (T, V), got {type(logits).__name__}")
    labels = _as_label_tensor(labels).to(logits.device)
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}: expected logits "
            "(B, T, V) with labels (B, T), or (T, V) with (T,)"
        )
    num_loss_tokens = _check_count(num_loss_tokens)
    if not shifted:
        # Shift the labels, not the logits: padding one -100 on the right and dropping the first label
        # pairs logits t with labels t + 1 without copying the (much larger) logits.
        labels = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # accumulate the sum in fp32
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long()
    if loss_weight is None:
        summed = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    else:
        weight = torch.as_tensor(loss_weight).to(logits.device)
        if not shifted:  # the weight travels with its label
            weight = F.pad(weight[..., 1:], (0, 1))
        per_token = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="none")
        # the weights in the cross entropy's dtype (float64 stays float64: the factors are kept exact)
        summed = (per_token * weight.reshape(-1).to(per_token.dtype)).sum()
    if num_loss_tokens is None:
        num_loss_tokens = _count_tensor(labels, shifted=True, ignore_index=ignore_index)
    # a count divides by at least 1; a weighting's Z is any number > 0 (weights below 1 sum below 1), and 0
    # only where every weight is 0 (the sum is 0 then: it divides by 1)
    if isinstance(num_loss_tokens, torch.Tensor):
        z = num_loss_tokens.to(summed.device, summed.dtype)
        return summed / (z.clamp_min(1) if loss_weight is None else torch.where(z > 0, z, torch.ones_like(z)))
    return summed / (max(num_loss_tokens, 1) if loss_weight is None else (num_loss_tokens if num_loss_tokens > 0 else 1))


def hf_compute_loss_func(outputs, labels, *, num_items_in_batch=None) -> torch.Tensor:
    """Hugging Face ``Trainer(compute_loss_func=...)``: summed CE over ``labels[..., 1:]`` / ``num_items_in_batch``.

    ``Trainer`` pops ``labels`` from the inputs, calls the model, then calls this with the model's
    outputs (``.logits`` or a dict with ``"logits"``) and the step's loss-token count. Without a count it
    is the batch mean.

    Labels collated under a ``loss_weighting`` (:mod:`packkit.weighting`) carry their weights: the loss is
    ``sum_t w_t CE_t / Z``. ``Z`` is the step's: from
    :class:`WeightedLossMixin` (a ``Trainer`` that counts it over the
    step's micro-batches and ranks, as it counts ``num_items_in_batch``), or, under a plain ``Trainer``,
    this micro-batch's own part when it holds every loss token of the step (``num_items_in_batch`` equals
    its count on one process: ``gradient_accumulation_steps=1``, the default); otherwise an error says so.
    """
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
    found = loss_factors(labels) if isinstance(labels, torch.Tensor) else None
    if found is None:
        return token_normalized_loss(logits, labels, num_loss_tokens=num_items_in_batch,
                                     loss_weight=repeat_factors(labels))  # a repeat weighs 0 (WeightedLossMixin)
    z = getattr(num_items_in_batch, "loss_normalizer", None)
    if z is None:
        z = _own_normalizer(labels, _note(labels), num_items_in_batch)
    return token_normalized_loss(logits, labels, num_loss_tokens=z, loss_weight=found[0])


def _own_normalizer(labels: torch.Tensor, note: dict, num_items_in_batch) -> float:
    """A micro-batch's own ``Z`` when it holds every loss token of the step, else a one-line error."""
    import torch.distributed as dist

    own = int(labels.ne(IGNORE_INDEX).sum())  # packkit's labels mask every document's first: either shift agrees
    alone = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    if num_items_in_batch is None or not alone or int(num_items_in_batch) != own:
        raise ValueError(
            f"loss_weighting={note.get('loss_weighting')!r} divides by the optimiser step's normaliser, and this "
            f"micro-batch holds {own} of the step's {num_items_in_batch} loss tokens (or other ranks hold some): "
            "use a Trainer with packkit.loss.WeightedLossMixin (class T(WeightedLossMixin, Trainer)), which counts it over the step")
    return float(loss_factors(labels)[1]) + note.get("loss_step_constant", 0.0)


# ----------------------------------------------------------------------------------------------
# one optimiser step of a hand-written loop
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AccumulationStep:
    """The counts of one optimiser step, and the loss scale that makes accumulation exact.

    Fields (counts are over every micro-batch of the step and, when reduced, every rank)
    -------------------------------------------------------------------------------------
    num_loss_tokens:    int, loss-bearing tokens of the step: the divisor of the token mean
    num_tokens:         int, real (non-padding) tokens of the step
    num_examples:       int, examples (documents) of the step
    local_loss_tokens:  int, this rank's loss tokens
    micro_loss_tokens:  tuple[int, ...], this rank's loss tokens per micro-batch
    world_size:         int, ranks whose counts were summed (1 without ``torch.distributed``)
    grad_multiplier:    float, ``world_size`` when the gradient reduction averages over ranks
                        (DDP, FSDP), else 1
    shifted, ignore_index: how labels are read
    group:              the process group the counts were reduced over (None: the default group)
    loss_normalizer:    float, ``Z`` of the batches' ``loss_weighting`` (:mod:`packkit.weighting`) over
                        the step; ``num_loss_tokens`` for the token mean
    loss_weighting:     str, the name of that weighting (None: the token mean)
    """

    num_loss_tokens: int
    num_tokens: int
    num_examples: int
    local_loss_tokens: int
    micro_loss_tokens: tuple
    world_size: int
    grad_multiplier: float
    shifted: bool = False
    ignore_index: int = IGNORE_INDEX
    group: object = dataclasses.field(default=None, repr=False, compare=False)
    loss_normalizer: float | None = None
    loss_weighting: str | None = None

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_loss_tokens)

    @property
    def _z(self) -> float:
        """The divisor: ``Z`` (at least 1 for the token mean's count; a weighting's ``Z`` of 0 means every
        weight is 0, and divides by 1)."""
        if self.loss_weighting is None:
            return max(self.num_loss_tokens, 1)
        return self.loss_normalizer if self.loss_normalizer > 0 else 1.0

    @property
    def scale(self) -> float:
        """Multiplier of a micro-batch's *summed* (weighted) cross entropy: ``grad_multiplier / Z``."""
        return self.grad_multiplier / self._z

    def loss(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """The loss to ``backward()`` for one micro-batch: ``grad_multiplier * sum_t w_t CE_t / Z``
        (``w_t = 1``, ``Z = num_loss_tokens`` for the token mean).

        ``batch`` is the micro-batch (``PackedBatch``, dict with ``labels``) or its label tensor.
        """
        labels, shifted, factor = self._factors(batch)
        loss = token_normalized_loss(logits, labels, num_loss_tokens=self._z, shifted=shifted,
                                     ignore_index=self.ignore_index, loss_weight=factor)
        return loss * self.grad_multiplier if self.grad_multiplier != 1 else loss

    def loss_weight(self, batch, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Each label's weight in the step's loss, ``grad_multiplier * a_c / Z``, the shape of the labels the loss
        reads (``dtype``, on their device; 0 where a label is ``ignore_index`` and on a repeat): the plain sum
        ``sum_t loss_weight[t] * CE_t`` of a micro-batch is its :meth:`loss`, and summed over the step's
        micro-batches and ranks, DDP's average included, the weighting's ``L`` (:mod:`packkit.weighting`). For a loss
        of one's own that reduces with ``sum``: ``CE_t`` is the cross entropy of the label at ``t`` (predicted at
        ``t - 1`` for unshifted labels). ``batch.loss_weight`` is the same before the step's scale (``a_c``)."""
        labels, shifted, factor = self._factors(batch)
        labels = _as_label_tensor(labels)
        weight = (labels.ne(self.ignore_index) if factor is None else factor).to(dtype) * (self.grad_multiplier / self._z)
        if not shifted:  # an unshifted label at 0 has no prediction: the loss reads labels[..., 1:]
            weight[..., 0] = 0
        return weight

    def _factors(self, batch) -> tuple:
        """``(labels, shifted, a_c of every label or None for the token mean)``, or a one-line error where the
        batch's weighting is not the step's."""
        labels, shifted = _labels_of(batch, shifted=self.shifted)
        found = loss_factors(labels) if isinstance(labels, torch.Tensor) else None
        factor = None if found is None else found[0]
        if factor is None and self.loss_weighting is not None:
            raise ValueError(f"this micro-batch's labels carry no loss weights and the step is under loss_weighting="
                             f"{self.loss_weighting!r}: pass the micro-batch the step counted (its PackedBatch or "
                             "CPShard, or their labels as they are: a copy or slice leaves the weights behind)")
        if factor is not None and self.loss_weighting is None:
            raise ValueError(f"this micro-batch was collated under loss_weighting="
                             f"{_note(labels).get('loss_weighting')!r}, the step under the token mean: count the "
                             "step on the micro-batches it trains")
        if factor is None:  # a repeat under the token mean weighs 0 too
            factor = repeat_factors(labels)
        return labels, shifted, factor

    def mean_loss(self, step_loss) -> float:
        """The step's loss over every loss token of every rank (the weighting's ``L``), for logging.

        ``step_loss`` is this rank's sum of :meth:`loss` values (detached) over the step's micro-batches;
        under ``torch.distributed`` it is summed over ranks (a collective: call it on every rank).
        """
        total = torch.as_tensor(step_loss, dtype=torch.float64).detach().reshape(())
        if self.world_size > 1:
            import torch.distributed as dist

            total = total.to(_reduce_device(self.group))
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return float(total) / self.grad_multiplier

    def as_dict(self) -> dict:
        """The figures a loop logs: loss tokens, tokens and examples per step, micro-batches, ranks."""
        return {
            "loss_tokens_per_step": self.num_loss_tokens,
            "tokens_per_step": self.num_tokens,
            "examples_per_step": self.num_examples,
            "micro_batches": self.num_micro_batches,
            "world_size": self.world_size,
        }


def _field(batch, name):
    if isinstance(batch, Mapping) and not hasattr(batch, name):
        return batch.get(name)
    return getattr(batch, name, None)


def _real_tokens_and_examples(batch, labels: torch.Tensor, ignore_index: int):
    """``(tokens, examples)`` of one micro-batch as int64 tensors or ints (no host sync for tensors).

    ``num_tokens``/``num_examples`` when the batch carries them; else an ``attention_mask`` gives the
    real tokens and one example per row; else ``cu_seqlens`` gives the documents and the padding tails
    (:func:`packkit.batch.real_tokens_and_documents`: a row's last segment without loss tokens counts as
    padding); else every label position is a token and every row an example. A ``PackedBatch`` always
    carries its counts (exact, also after ``Trainer`` rebuilt it), so a document without loss tokens
    at the end of a row still counts.
    """
    tokens, examples = _field(batch, "num_tokens"), _field(batch, "num_examples")
    if tokens is not None and examples is not None:
        return tokens, examples
    mask = _field(batch, "attention_mask")
    cu = _field(batch, "cu_seqlens")
    if isinstance(mask, torch.Tensor):
        t, e = mask.sum(dtype=torch.int64), (labels.shape[0] if labels.dim() > 1 else 1)
    elif isinstance(cu, torch.Tensor) and int(cu.shape[0]) > 0:
        t, e = real_tokens_and_documents(cu, labels, ignore_index)
    else:
        t, e = labels.numel(), (labels.shape[0] if labels.dim() > 1 else 1)
    return (t if tokens is None else tokens), (e if examples is None else examples)


def _reduce_device(group) -> torch.device:
    """NCCL reduces CUDA tensors only; gloo and the others take CPU tensors."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def accumulation_step(micro_batches: Sequence, *, shifted: bool = False, all_reduce: bool | None = None,
                      group=None, ddp_average: bool = True,
                      ignore_index: int = IGNORE_INDEX, facts=None, repeats=None) -> AccumulationStep:
    """Count one optimiser step's loss tokens (and its ``loss_weighting``'s ``Z``) once, across ranks,
    before the first forward.

    Args:
        micro_batches: the micro-batches of the step, each a ``PackedBatch``, a dict with ``labels``
            (``shift_labels`` counts as shifted) or a label tensor (B, T) / (T,); or this rank's CP shards of
            them (:func:`packkit.cp.shard`), which count their whole batch's counts and part of ``Z``.
        shifted: the labels are already shifted (see :func:`count_loss_tokens`); a ``PackedBatch``
            follows its own ``labels_shifted`` instead.
        all_reduce: sum the counts over the ranks of ``group`` (one collective of eight float64s, every
            rank must call it). ``None``: when ``torch.distributed`` is initialised.
        group: that sum's process group (None: the default), the gradients' averaging one; CP shards count
            each batch once per CP group, over a DP group or whole CP groups (:mod:`packkit.cp`).
        ddp_average: the gradient reduction averages over ranks (DDP, FSDP: the default), so each
            loss is multiplied back by the world size. ``False`` for a reduction that sums.
        facts: the step as a sampler's plan knows it (``sampler.step_facts()``, a
            :class:`packkit.weighting.StepFacts`): counts and ``Z`` read there, no collective, this rank's
            micro-batches checked against it (loss tokens, parts of ``Z``); CP shards: x ``group``'s size.
        repeats: one bool a micro-batch, True where it only repeats another's examples, dealt so that every rank
            runs one (``sampler.step_repeats()``; ``facts`` carries the same): it weighs 0 under every weighting
            (:func:`packkit.batch.mark_repeat`) and is left out of the counts and ``Z`` (the unique examples').

    The weighting travels with the batches (the collators' ``loss_weighting``, :mod:`packkit.weighting`):
    each carries its documents' factors ``a_c`` and its part of ``Z``; the step sums the parts in the same
    collective as the counts, so a weighting costs no communication of its own. Every micro-batch of the
    step must be collated under one weighting.

    Returns: an :class:`AccumulationStep`; ``step.loss(logits, micro_batch)`` is the loss to
    ``backward()``. A loop reads::

        step = accumulation_step(micro_batches)
        for mb in micro_batches:
            with (model.no_sync() if ddp and mb is not micro_batches[-1] else nullcontext()):
                logits = model(**{k: v for k, v in mb.hf_kwargs().items() if k != "labels"}).logits
                loss = step.loss(logits, mb)
                loss.backward()
        optimizer.step(); optimizer.zero_grad()

    >>> step = accumulation_step([torch.tensor([[-100, 1, 2]]), torch.tensor([[-100, 3, -100, 4, 5]])])
    >>> step.num_loss_tokens, step.micro_loss_tokens, step.scale
    (5, (2, 3), 0.2)
    """
    if isinstance(micro_batches, (torch.Tensor, np.ndarray, Mapping)) or not isinstance(micro_batches, Sequence):
        raise TypeError(
            "micro_batches must be a list of the step's micro-batches (PackedBatch, dicts with 'labels' or "
            f"label tensors), got {type(micro_batches).__name__}"
        )
    if len(micro_batches) == 0:
        raise ValueError("an optimiser step needs at least one micro-batch, got an empty list")
    rows = [_micro_counts(mb, i, shifted, ignore_index) for i, mb in enumerate(micro_batches)]
    weighting, constant = _one_weighting([row[4:6] for row in rows])
    repeat = _repeats(micro_batches, repeats, facts, shifted)
    # A (micro_batches, 8) float64 table on the labels' device (exact below 2**53): one host sync, one collective
    device = next((x.device for row in rows for x in row[:4] if isinstance(x, torch.Tensor)), torch.device("cpu"))
    table = torch.stack([
        torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device).reshape(())
                     for x in (*row[:4], *_cp_columns(rows, i))])
        for i, row in enumerate(rows)
    ])
    if facts is not None:
        return _planned_step(facts, table.cpu().tolist(), repeat, weighting, shifted=shifted, ddp_average=ddp_average,
                             ignore_index=ignore_index, ranks=_planned_ranks(facts, rows[0][6], group))
    if any(repeat):  # a repeat's counts and part of Z are another micro-batch's: counted there (its CP columns stay)
        table[torch.tensor(repeat, device=device), :4] = 0
    local = table.sum(0)
    world_size, reduced, group = _reduce(local, all_reduce, group)
    table, local, reduced = table.cpu().tolist(), local.cpu().tolist(), reduced.cpu().tolist()
    copies = _cp_copies(*reduced[4:])
    n_loss, n_tokens, n_examples, z = (x / copies for x in reduced[:4])
    return AccumulationStep(
        num_loss_tokens=int(n_loss), num_tokens=int(n_tokens), num_examples=int(n_examples),
        local_loss_tokens=int(local[0]), micro_loss_tokens=tuple(int(row[0]) for row in table),
        world_size=world_size, grad_multiplier=float(world_size) if (ddp_average and world_size > 1) else 1.0,
        shifted=shifted, ignore_index=ignore_index, group=group,
        loss_normalizer=(z + constant) if weighting is not None else float(n_loss), loss_weighting=weighting)


def _micro_counts(mb, i: int, shifted: bool, ignore_index: int) -> tuple:
    """``(loss tokens, tokens, examples, z, weighting name, step constant)`` of micro-batch ``i``: ints,
    floats or 0-dim tensors (no host sync)."""
    try:
        labels, mb_shifted = _labels_of(mb, shifted=shifted)
        labels = _as_label_tensor(labels)
    except (TypeError, KeyError, ValueError) as exc:
        raise type(exc)(f"micro-batch {i}: {exc.args[0] if exc.args else exc}") from None
    known = getattr(mb, "num_loss_tokens", None)
    # A PackedBatch counted its loss tokens on the CPU (no device work); trust that count only when
    # it was made under the convention the loss will use (pre-shifted labels or not).
    if (isinstance(known, numbers.Integral) and not isinstance(known, bool)
            and bool(getattr(mb, "labels_shifted", False)) == mb_shifted):
        count = int(known)
    else:
        count = _count_tensor(labels, shifted=mb_shifted, ignore_index=ignore_index)
    note = _note(labels)
    cp = note.get(_CP_NOTE)
    if cp is not None:  # a CP shard's targets: the whole batch's counts, the same on every rank of the group
        count, tokens, examples = cp[2:]
    else:
        tokens, examples = _real_tokens_and_examples(mb, labels, ignore_index)
    name = note.get("loss_weighting")
    z = loss_factors(labels)[1] if name is not None else count  # a tensor on the labels' device: no sync
    return count, tokens, examples, z, name, note.get("loss_step_constant", 0.0), cp


def _cp_columns(rows: list, i: int) -> tuple:
    """``(1, cp rank, cp rank ** 2, cp size)`` of micro-batch ``i`` when it is a CP shard, zeros otherwise (the
    columns :func:`_cp_copies` reads once summed over the ranks); every micro-batch of a step is a shard or none
    is (one line naming the first that differs)."""
    cp, first = rows[i][6], rows[0][6]
    if (cp is None) != (first is None) or (cp is not None and cp[1] != first[1]):
        what = ["not a CP shard" if c is None else f"a shard of a CP group of {c[1]}" for c in (cp, first)]
        raise ValueError(f"micro-batch {i} is {what[0]}, micro-batch 0 {what[1]}: shard every micro-batch of a "
                         "step over one CP group, or none")
    return (0, 0, 0, 0) if cp is None else (1, cp[0], cp[0] ** 2, cp[1])


def _cp_copies(shards: float, ranks: float, squares: float, sizes: float) -> int:
    """How many copies of each batch the reduced counts hold, from the CP shards counted over the reduced group
    (``shards`` of them, ``ranks`` and ``squares`` their CP ranks summed and squared, ``sizes`` their CP sizes): a
    group with one rank of each CP group (a data-parallel group: every shard of one CP rank) holds each batch once;
    one of whole CP groups (DP x CP: every CP rank as often) holds it ``cp`` times; any other is refused.
    ``_cp_copies(4, 2, 2, 8) -> 2`` (CP ranks 0, 1, 0, 1 of groups of 2)."""
    if shards == 0:
        return 1
    cp = sizes / shards
    if cp != int(cp):
        raise ValueError("the ranks reduced hold shards of CP groups of different sizes: reduce each step's counts "
                         "over ranks of one CP size")
    if squares * shards == ranks * ranks:  # every shard of one CP rank
        return 1
    if 2 * ranks == shards * (cp - 1) and 6 * squares == shards * (cp - 1) * (2 * cp - 1) and shards % cp == 0:
        return int(cp)  # CP ranks 0 .. cp - 1 as often each (their first two moments)
    raise ValueError(f"the step's counts were reduced over a group that holds {int(shards)} CP shards of some ranks of "
                     "a CP group and not others; pass group= a data-parallel group (one rank of each CP group) or "
                     "one of whole CP groups (DP x CP)")


def _repeats(micro_batches: Sequence, repeats, facts, shifted: bool) -> list:
    """Which micro-batches only repeat another's examples (``repeats``, or ``facts.repeats``), each marked on its
    labels (:func:`packkit.batch.mark_repeat`), or a one-line error; all False when neither says."""
    n, planned = len(micro_batches), None if facts is None else (tuple(facts.repeats) or (False,) * len(facts.micro))
    if repeats is None:
        if planned is None or len(planned) != n:  # (a count that differs from the facts' is refused after)
            return [False] * n
        repeats = planned
    if isinstance(repeats, (str, bytes, Mapping)) or not isinstance(repeats, Sequence) or len(repeats) != n or \
            not all(isinstance(r, (bool, np.bool_)) for r in repeats):
        raise ValueError(f"repeats must hold one bool for each of the {n} micro-batches, got {repeats!r}: pass "
                         "sampler.step_repeats() once the step's micro-batches are drawn")
    repeats = [bool(r) for r in repeats]
    if planned is not None and tuple(repeats) != planned:
        raise ValueError(f"repeats={tuple(repeats)} differ from the sampler's step facts ({planned}): pass one of them")
    for i, (mb, r) in enumerate(zip(micro_batches, repeats)):
        labels = _labels_of(mb, shifted=shifted)[0]
        if isinstance(labels, torch.Tensor):
            mark_repeat(labels, r)
        elif r:
            raise TypeError(f"micro-batch {i} repeats another's examples, and its labels are a "
                            f"{type(labels).__name__}, which cannot carry its weight 0: pass it as a tensor")
    return repeats


def _planned_step(facts, table: list, repeat: list, weighting, **how) -> AccumulationStep:
    """The step of ``facts`` (a sampler's plan: every rank's counts and ``Z``), once this rank's micro-batches
    (``table``: loss tokens, tokens, examples and part of ``Z`` of each, as collated) are found to be the ones it
    planned; those that only ``repeat`` another's examples count 0 here, as in the facts."""
    if weighting != facts.weighting:
        raise ValueError(f"the micro-batches were collated under loss_weighting={weighting or 'token'!r}, the "
                         f"sampler plans {facts.weighting or 'token'!r}: give the collator and the sampler one weighting")
    if len(table) != len(facts.micro):
        raise ValueError(f"{len(table)} micro-batches were given, the sampler's step has {len(facts.micro)} on this "
                         "rank: ask step_facts() once the step's micro-batches are drawn, and pass them all")
    for i, (row, (n, z)) in enumerate(zip(table, facts.micro)):
        if int(row[0]) != n or abs(row[3] - z) > 1e-9 * max(1.0, abs(z)):
            raise ValueError(f"micro-batch {i} holds {int(row[0])} loss tokens (Z part {row[3]:g}), the sampler's "
                             f"loss_lengths say {n} ({z:g}): pass loss_lengths counted as the collator counts "
                             "(labels other than -100, the first label not counted), or leave them out")
    world_size = how["ranks"]
    micro = tuple(0 if r else int(row[0]) for row, r in zip(table, repeat))
    return AccumulationStep(
        num_loss_tokens=facts.loss_tokens, num_tokens=facts.tokens, num_examples=facts.examples,
        local_loss_tokens=sum(micro), micro_loss_tokens=micro,
        world_size=world_size, grad_multiplier=float(world_size) if (how["ddp_average"] and world_size > 1) else 1.0,
        shifted=how["shifted"], ignore_index=how["ignore_index"], loss_normalizer=facts.loss_normalizer,
        loss_weighting=weighting)


def _planned_ranks(facts, cp, group) -> int:
    """The ranks a planned step's gradients are averaged over: the sampler's (``facts.world_size``); for CP shards
    (``cp``: their note, else None) the size of ``group`` (None: the default group), the sampler's data-parallel
    ranks or whole CP groups of them (``cp`` times as many), as :func:`_cp_copies` allows; any other is refused."""
    import torch.distributed as dist

    if cp is None or not (dist.is_available() and dist.is_initialized()):
        return facts.world_size
    size = dist.get_world_size(group)
    if size not in (facts.world_size, facts.world_size * cp[1]):
        raise ValueError(f"the gradients' group holds {size} ranks, the sampler plans {facts.world_size} data-parallel "
                         f"ranks of CP groups of {cp[1]}: pass group= a data-parallel group ({facts.world_size} ranks) "
                         f"or one of whole CP groups ({facts.world_size * cp[1]})")
    return size


def _one_weighting(rows: list) -> tuple:
    """``(name, step constant)`` shared by every micro-batch of the step, or an error naming the first
    that differs."""
    first = rows[0]
    for i, row in enumerate(rows):
        if row != first:
            raise ValueError(f"micro-batch {i} was collated under loss_weighting={row[0] or 'token'!r}, micro-batch 0 "
                             f"under {first[0] or 'token'!r}: collate every micro-batch of a step under one weighting")
    return first


def _reduce(local: torch.Tensor, all_reduce, group) -> tuple:
    """``(world_size, summed, group)``: ``local`` summed over the ranks of ``group`` (one collective) when
    asked, or when ``torch.distributed`` is initialised and ``all_reduce`` is None."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if all_reduce is None:
        all_reduce = initialised
    if all_reduce and not initialised:
        raise ValueError("all_reduce=True needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group), or pass all_reduce=False")
    if not all_reduce:
        return 1, local.clone(), None
    reduced = local.to(_reduce_device(group), copy=True)  # a copy: all_reduce works in place, local stays this rank's
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return dist.get_world_size(group), reduced, group


class WeightedLossMixin(StepCountHook):
    """A ``transformers.Trainer`` mixin for batches collated under a ``loss_weighting``:
    ``class MyTrainer(WeightedLossMixin, Trainer)`` with ``compute_loss_func=packkit.loss.hf_compute_loss_func``.

    Where ``Trainer`` counts the loss tokens of an optimiser step's micro-batches (before the first forward;
    :class:`packkit.integrations.transformers.StepCountHook`), this counts the weighting's ``Z`` with
    :func:`accumulation_step` and hands it to :func:`hf_compute_loss_func`, so ``sum_t w_t CE_t / Z`` summed over
    the micro-batches and averaged over ranks is the recipe's loss. Where the training loader's batch sampler is
    a packkit sampler that plans the steps (given ``loss_weighting`` and ``loss_lengths``: its ``plans_steps``),
    ``Z`` is read from its plan (``sampler.step_facts()``) with no collective, this rank's micro-batches checked
    against it; otherwise one collective of four numbers across processes, as ``Trainer``'s own gather. Steps
    without a weighting keep ``Trainer``'s count, but for a step in which a packkit sampler deals a rank a
    micro-batch that repeats another rank's examples (``sampler.step_repeats()``): the repeat weighs 0 and leaves
    the count, so the step's token mean is its unique examples' (``Trainer`` alone counts it twice).

    It also keeps the packed rows' segment and document columns (``seq_lengths``, ``example_ids``,
    ``piece_offsets``, ``example_loss``: :data:`packkit.rules.SEGMENT_KEYS`, :data:`~packkit.rules.DOCUMENT_KEYS`)
    that ``Trainer``'s default ``remove_unused_columns=True`` drops (TRL's keeps ``seq_lengths`` alone), so an
    example split across rows weighs as one example, as it does in a plain loop; and, under a
    ``Column(key)`` weighting, the examples' ``key``.
    """

    @property
    def kept_columns(self) -> tuple:
        """The segment and document columns, and the examples' weight column of the collator's ``Column``."""
        key = getattr(getattr(getattr(self, "data_collator", None), "loss_weighting", None), "key", None)
        return (*SEGMENT_KEYS, *DOCUMENT_KEYS, *([key] if isinstance(key, str) else []))

    def _step_normalizer(self, batch_samples: list, all_reduce: bool):
        labels = [b.get("labels") if isinstance(b, Mapping) else None for b in batch_samples]
        repeats = None
        if not any(_note(t).get("loss_weighting") for t in labels):  # the token mean: Trainer's count, but repeats
            sampler = self._train_batch_sampler("step_repeats")  # a packkit sampler names the micro-batches that
            repeats = None if sampler is None else sampler.step_repeats()  # repeat another rank's examples
            if not any(repeats or ()):
                return None
        if getattr(self, "compute_loss_func", None) is None:  # the model's own loss would drop the weights unsaid
            raise ValueError("WeightedLossMixin hands the step's normaliser where Trainer hands its token count, and "
                             "without a compute_loss_func the model's own loss divides the unweighted sum by it: pass "
                             "compute_loss_func=packkit.loss.hf_compute_loss_func")
        if repeats is not None:  # they weigh 0 and leave Trainer's count: the step's loss is its unique examples'
            return accumulation_step(batch_samples, all_reduce=all_reduce, ddp_average=False,
                                     repeats=list(repeats)).loss_normalizer
        sampler = self._train_batch_sampler("plans_steps")  # a packkit sampler that knows every step's Z
        facts = None if sampler is None else sampler.step_facts()
        return accumulation_step(batch_samples, all_reduce=all_reduce and facts is None, ddp_average=False,
                                 facts=facts).loss_normalizer
