"""How much each loss token weighs: the recipe's loss, over the whole optimiser step.

Every weighting here is one formula over the **optimiser step** ``S``: every document ``c`` of every
micro-batch on every rank of the step, ``O_c`` its loss tokens, ``l_t`` a token's loss::

    L = sum_{c in S} a_c * sum_{t in O_c} l_t  /  Z,        Z = sum_{c in S} z_c

A weighting gives each document its factor ``a_c`` and its share ``z_c`` of the normaliser; the token
weight is ``a_c / Z``. A document with no loss token weighs 0 (``a_c = 0``, never NaN) and, as in verl's
``agg_loss`` ("exclude fully masked sequences"), is not counted in ``|B|``, the documents of the step with at
least one loss token (``z_c = 0``). TRL's ``grpo`` and ``dr_grpo`` are the exception: TRL divides by every
completion of the micro-batch (``size(0)``), so a completion whose mask is empty (``mask_truncated_completions``,
a tool mask) still counts in their ``|B|`` (:attr:`LossWeighting.count_empty`): ``"grpo"`` is ``"sample"``
except there, ``DrGRPO`` likewise. One limit: an example without loss tokens split *offline* into ``k`` packed
rows counts ``k`` times in those two ``|B|`` (:func:`piece_factors`; split by a collator it counts once).

``|O_c|`` is counted over the whole document where the collator sees it whole: an example split across
the windows of one batch (``FixedWindowCollator(overflow="split")``) keeps one count and one factor, and a
row sharded over a CP group afterwards keeps the factors of the whole row: :func:`packkit.cp.shard` gives each
rank its targets' factors (``shard.loss_weight``, sliced as ``shift_labels``) and the batch's part of ``Z``
(``shard.loss_norm``, the same on every rank of the group), and ``accumulation_step(shards)`` counts each batch
once per CP group, not once per CP rank (:mod:`packkit.cp`: which group to reduce over). The pieces of an example split offline into separate packed
rows carry the whole example's ``|O_c|`` (``example_loss``, :func:`packkit.outputs.packed_schema`): each
piece takes the factor ``a_c`` of the whole example and the share ``z_c * |O_piece| / |O_c|`` of its ``z_c``
(:func:`piece_factors`), so an example whose pieces all fall in one step counts once in ``|B|``, and one split
across steps counts in each step in proportion to the loss tokens it trains there.

The weightings (a name, or an object of this module), each with its loss and its factors::

    name (aliases)                              L                                    a_c          z_c
    "token"  (verl token-mean, TRL dapo)        sum_t l_t / sum_c |O_c|              1            |O_c|
    "sample" (verl seq-mean-token-mean)         (1/|B|) sum_c (1/|O_c|) sum_t l_t    1/|O_c|      1
    "grpo"   (TRL grpo)                         the same, |B| with empty completions 1/|O_c|      1, empty too
    "sqrt"                                      sum_c |O_c|^-1/2 sum_t l_t           |O_c|^-1/2   |O_c|^1/2
                                                  / sum_c |O_c|^1/2
    "seq-mean-token-sum" (verl)                 (1/|B|) sum_c sum_t l_t              1            1
    SeqSumNorm(L_max)                           sum_c sum_t l_t / L_max              1            L_max, once
      (verl seq-mean-token-sum-norm)
    DrGRPO(L_max)  (TRL dr_grpo)                sum_c sum_t l_t / (|B| L_max),       1            L_max, empty
                                                  |B| with empty completions                      too
    Column(key): a weight w_c per example       sum_c w_c sum_t l_t                  w_c          w_c |O_c|
                                                  / sum_c w_c |O_c|
    Weights(fn), or a callable: w_c = fn(|O_c|) the same                             w_c          w_c |O_c|

``"sample"`` is the per-conversation mean of Nemotron 3 Super's second SFT stage
(``L = (1/|B|) sum_c (1/|O_c|) sum_t l_t``); a callable gives LongAlign's ``1/N_i`` and the like.
``SeqSumNorm`` divides by a constant, once for the whole step: its ``z`` is counted once, not per document
(:attr:`LossWeighting.z_once`).

**How these relate to TRL's and verl's code** (TRL 1.16 ``GRPOTrainer._compute_loss``; verl's ``agg_loss`` in
``verl/trainer/ppo/core_algos.py``), which reduce over one micro-batch each and scale it into the step:

- TRL ``grpo`` / ``dr_grpo``: each micro-batch's mean over its rows (``size(0)``), divided by the accumulation
  steps, the ranks averaged by DDP: over a step of equal micro-batches (TRL's ``per_device_train_batch_size``)
  that is ``"grpo"`` / ``DrGRPO`` exactly, empty completions counted; with micro-batches of unequal rows TRL's
  mean of means differs, packkit's is the step's. TRL ``dapo``: the micro-batch's sum over ``num_items_in_batch``
  (the generation batch's loss tokens, all ranks), rescaled by ``steps_per_generation``: the token mean of the
  step, ``"token"``, where a generation batch is one optimiser step (``steps_per_generation`` = accumulation).
  ``tests/test_loss_weighting_trl.py`` runs TRL's own ``_compute_loss`` against these.
- verl ``seq-mean-token-sum-norm``: the micro-batch's token sums over the sequences with a loss token, divided
  by ``global_batch_size`` (those sequences over the mini-batch and its ranks when verl passes it, else the
  micro-batch's own count) times ``dp_size``, then by ``loss_scale_factor`` (default ``loss_mask.shape[-1]``,
  the micro-batch's padded response width, which changes from micro-batch to micro-batch). That is
  ``sum_c sum_t l_t / (|B| L)``: packkit's ``DrGRPO(L)`` with empty sequences left out of ``|B|``, and the
  same only where ``loss_scale_factor`` is set to a constant. verl releases before ``global_batch_size``
  divided the micro-batch's plain sum by ``loss_scale_factor`` and scaled it by ``1 / gradient_accumulation``
  (or rows / ``ppo_mini_batch_size``), the ranks averaged: ``sum_c sum_t l_t / (L * G * R)`` for ``G``
  micro-batches on ``R`` ranks. packkit's ``SeqSumNorm(L)`` is that sum over the whole step divided by ``L``
  once (Dr. GRPO's constant normaliser), with no division by the micro-batches or ranks: ``G * R`` times
  verl's older value, the same direction; divide the learning rate (or ``L``) by ``G * R`` to match it.
- verl ``seq-mean-token-sum`` / ``seq-mean-token-mean`` / ``token-mean`` are the step's formulas when verl
  passes the global counts (``global_batch_size``, ``batch_num_tokens``), per micro-batch when it does not;
  packkit's are always the step's.

A batch carries the *unnormalised* factors (``batch.loss_weight``: ``a_c`` on every loss token) and its
part of ``Z`` (``batch.loss_norm``); :func:`packkit.loss.accumulation_step` sums the parts of the
step's micro-batches (and of the ranks, in the one collective it already makes) and divides.

Where a sampler deals the steps, every rank knows every step's documents: given the same weighting and
each example's loss tokens (``PackedBatchSampler(..., loss_weighting="sample", loss_lengths=n)``, any
sampler), ``sampler.step_facts()`` is the step's ``Z`` and counts (:class:`StepFacts`), and
``accumulation_step(micro_batches, facts=sampler.step_facts())`` divides by it with no collective at all,
after checking this rank's micro-batches against it; a resume, on any world size, keeps the steps' ``Z``::

    for mb in loader:                                   # DataLoader(ds, batch_sampler=sampler, collate_fn=...)
        mbs.append(mb)
        facts = sampler.step_facts()                    # the step of the batch just drawn
        if len(mbs) == len(facts.micro):                # all of this rank's micro-batches of it
            step = accumulation_step(mbs, facts=facts)  # then step.loss(logits, mb) for each, as usual
            ...
            mbs = []

>>> resolve("sample").factors([4, 0, 1])
(array([0.25, 0.  , 1.  ]), array([1., 0., 1.]))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .errors import ArgumentError
from .atomic import png_figure
from .segments import IGNORE_INDEX

__all__ = ["StepFacts", "WeightShares", "weight_shares", "plot_weight_shares", "LossWeighting", "Column", "Weights", "ColumnWeighting", "CallableWeighting", "SeqSumNorm", "DrGRPO", "resolve", "NAMES", "segment_factors", "piece_factors"]


@dataclasses.dataclass(frozen=True)
class LossWeighting:
    """A named weighting whose factors depend on ``|O_c|`` only: ``a_c = |O_c| ** a_power``,
    ``z_c = |O_c| ** z_power`` (or the constant ``z_const``), both 0 for a document without loss
    tokens. ``z_once``: the constant is the whole step's normaliser, not a document's share."""

    name: str
    a_power: float = 0.0
    z_power: float = 1.0
    z_const: float | None = None
    z_once: bool = False
    #: a document without loss tokens still takes its ``z_c`` (``z_power`` with ``|O_c| = 1``, or ``z_const``):
    #: TRL's ``grpo`` and ``dr_grpo`` count every completion of the step in ``|B|``, empty ones included
    count_empty: bool = False

    #: the example key that carries per-example weights (``Column`` only)
    key = None

    @property
    def is_token_mean(self) -> bool:
        """The default: every loss token weighs ``1 / N`` (no per-token weights needed)."""
        return type(self) is LossWeighting and self.a_power == 0.0 and self.z_power == 1.0 and self.z_const is None

    def factors(self, loss_counts, values=None):
        """``(a, z)``, float64 ``(D,)`` each, for documents of ``loss_counts`` loss tokens (``values``:
        their per-example weights, for ``Column`` only). numpy in, numpy out; a torch tensor in, torch out
        (on its device: the batches' lazy path, no host sync). A count of -1 marks an example that is no
        document of the batch (dropped by the collator): it weighs 0 and takes no ``z_c`` under any rule."""
        xp = _xp(loss_counts)
        n = xp.asarray(loss_counts, dtype=xp.float64)
        has = n > 0
        counted = n >= 0 if self.count_empty else has
        safe = xp.where(has, n, 1.0)
        a = xp.where(has, safe ** self.a_power, 0.0)
        if self.z_const is not None:
            z = xp.where(counted, self.z_const, 0.0) if not self.z_once else xp.zeros_like(n)
        else:
            z = xp.where(counted, safe ** self.z_power, 0.0)
        return a, z

    def step_constant(self) -> float:
        """The part of ``Z`` counted once a step (``SeqSumNorm``'s ``L_max``), else 0."""
        return float(self.z_const) if self.z_once else 0.0


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """One optimiser step as a sampler's plan knows it (every micro-batch of every rank), so that
    :func:`packkit.loss.accumulation_step` needs no collective: what it would otherwise sum over the ranks.

    ``weighting``: the name of the step's weighting (None: the token mean); ``loss_tokens``: ``sum_c |O_c|``;
    ``loss_normalizer``: ``Z`` (with the step's constant; ``loss_tokens`` for the token mean); ``tokens``,
    ``examples``: the step's tokens and examples; ``world_size``: its ranks; ``micro``: this rank's micro-batches
    in order, ``(loss tokens, part of Z)`` each as collated, which the step checks against the batches it is given;
    ``repeats``: this rank's micro-batches, True where one only repeats examples of another (dealt so that every rank
    runs one): weighed 0 by the step and left out of the counts and ``Z`` above, which are the unique examples'.
    Made by ``sampler.step_facts()`` (:class:`packkit.sampler.SamplerOptions`' ``loss_weighting``).
    """

    weighting: str | None
    loss_tokens: int
    loss_normalizer: float
    tokens: int
    examples: int
    world_size: int
    micro: tuple
    repeats: tuple = ()


def SeqSumNorm(max_length: int) -> LossWeighting:
    """verl's ``seq-mean-token-sum-norm``: ``L = sum_c sum_t l_t / L_max`` (``L_max``: the response length
    of the rollout, a constant)."""
    return LossWeighting(f"seq-mean-token-sum-norm({_positive(max_length)})", 0.0, 0.0, float(max_length), True)


def DrGRPO(max_length: int) -> LossWeighting:
    """TRL's ``dr_grpo``: ``L = sum_c sum_t l_t / (|B| * max_completion_length)``, ``|B|`` every completion of
    the step, those without a loss token (``mask_truncated_completions``) included, as TRL's ``size(0)``."""
    return LossWeighting(f"dr_grpo({_positive(max_length)})", 0.0, 0.0, float(max_length), count_empty=True)


@dataclasses.dataclass(frozen=True)
class CallableWeighting(LossWeighting):
    """``fn(|O_c|) -> w_c``: the weighted token mean (:func:`Weights`)."""

    fn: Callable | None = None

    def factors(self, loss_counts, values=None):
        n = np.asarray(loss_counts, np.float64)
        has = n > 0  # a document without loss tokens weighs 0 whatever fn says (fn(0) may divide by 0)
        got = np.asarray(self.fn(n[has]), np.float64).reshape(-1)
        if got.size != int(has.sum()):
            raise ArgumentError(f"loss_weighting's callable returned {got.size} weights for {int(has.sum())} "
                                "documents; return one weight per document")
        w = np.zeros_like(n)
        w[has] = got
        return _weighted_mean(n, w, "loss_weighting's callable")


def Weights(fn: Callable) -> CallableWeighting:
    """``fn(|O_c|) -> w_c`` (numpy ``(D,)`` float64 in, ``(D,)`` finite ``>= 0`` out, called on the documents
    with loss tokens): the weighted token mean ``sum_c w_c sum_t l_t / sum_c w_c |O_c|``.
    ``Weights(lambda n: 1 / n)`` is ``"sample"``."""
    if not callable(fn):
        raise ArgumentError(f"Weights takes a callable of the documents' loss-token counts, got {fn!r}")
    return CallableWeighting(f"weights({getattr(fn, '__name__', 'callable')})", fn=fn)


@dataclasses.dataclass(frozen=True)
class ColumnWeighting(LossWeighting):
    """A weight per example, from the example's ``key`` (:func:`Column`)."""

    key: str = "loss_weight"

    def factors(self, loss_counts, values=None):
        if values is None:
            raise ArgumentError(f"loss_weighting=Column({self.key!r}) needs the examples' {self.key!r} values")
        xp = _xp(loss_counts)
        n = xp.asarray(loss_counts, dtype=xp.float64)
        w = xp.asarray(values, dtype=xp.float64)
        if xp is np:
            _check_weights(w, f"the examples' {self.key!r}")
        a = xp.where(n > 0, w, 0.0)  # (checked when collated on the lazy path)
        return a, a * n


def Column(key: str = "loss_weight") -> ColumnWeighting:
    """A weight per example, read from the example's ``key`` (finite, ``>= 0``, on every example): the
    weighted token mean ``sum_c w_c sum_t l_t / sum_c w_c |O_c|``. A split example's pieces share its weight."""
    if not isinstance(key, str):
        raise ArgumentError(f"Column takes the name of the examples' weight key, got {key!r}")
    return ColumnWeighting(f"column({key})", key=key)


def _weighted_mean(n: np.ndarray, w: np.ndarray, what: str):
    _check_weights(w, what)
    a = np.where(n > 0, w, 0.0)
    return a, a * n


def _check_weights(w: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        raise ArgumentError(f"{what} gave {float(w[bad][0])!r} for document {int(np.argmax(bad))}; weights are finite "
                            "numbers >= 0")


class _Torch:
    """The few numpy names :meth:`LossWeighting.factors` uses, for torch tensors."""

    float64 = None

    @staticmethod
    def asarray(x, dtype=None):
        import torch

        return x.to(torch.float64)

    @staticmethod
    def where(cond, x, y):
        import torch

        return torch.where(cond, x, torch.as_tensor(y, dtype=torch.float64, device=cond.device))

    @staticmethod
    def zeros_like(x):
        import torch

        return torch.zeros_like(x)


def _xp(x):
    """numpy, or the torch stand-in for a tensor (torch is not imported here unless a tensor came in)."""
    return np if isinstance(x, (np.ndarray, list, tuple)) or not hasattr(x, "device") else _Torch


def _positive(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ArgumentError(f"max_length must be a positive int (the constant normaliser), got {value!r}")
    return int(value)


TOKEN = LossWeighting("token")
SAMPLE = LossWeighting("sample", -1.0, 0.0)
SQRT = LossWeighting("sqrt", -0.5, 0.5)
SEQ_SUM = LossWeighting("seq-mean-token-sum", 0.0, 0.0)
GRPO = LossWeighting("grpo", -1.0, 0.0, count_empty=True)

#: the names a string may give, and the weighting each means
NAMES = {"token": TOKEN, "token-mean": TOKEN, "dapo": TOKEN, "sample": SAMPLE, "seq-mean-token-mean": SAMPLE,
         "grpo": GRPO, "sqrt": SQRT, "seq-mean-token-sum": SEQ_SUM}


def resolve(spec) -> LossWeighting:
    """A ``loss_weighting=`` value as a :class:`LossWeighting`: a name of :data:`NAMES`, a weighting, or a
    callable (:class:`Weights`). ``None`` is ``"token"``. ``resolve("seq-mean-token-mean").name -> 'sample'``."""
    if spec is None:
        return TOKEN
    if isinstance(spec, LossWeighting):
        return spec
    if isinstance(spec, str):
        if spec in NAMES:
            return NAMES[spec]
        need = {"seq-mean-token-sum-norm": "SeqSumNorm", "dr_grpo": "DrGRPO"}.get(spec)
        if need:
            raise ArgumentError(f"loss_weighting={spec!r} divides by a constant length: pass "
                                f"packkit.weighting.{need}(max_length) instead of the name")
        raise ArgumentError(f"loss_weighting must be one of {sorted(NAMES)}, a packkit.weighting object or a "
                            f"callable, got {spec!r}")
    if callable(spec):
        return Weights(spec)
    raise ArgumentError(f"loss_weighting must be a name ({', '.join(sorted(NAMES))}), a packkit.weighting object "
                        f"or a callable, got {type(spec).__name__}")


def piece_factors(weighting: LossWeighting, loss_counts, whole, values=None):
    """``(a, z)`` of documents that are pieces of examples of ``whole`` loss tokens each (``loss_counts``
    their own): ``a`` the whole example's factor, ``z`` its share in proportion to the piece's loss tokens,
    so that the pieces of one example add up to its ``z_c``. numpy or torch, as :meth:`LossWeighting.factors`.

    >>> piece_factors(resolve("sample"), np.array([3., 1.]), np.array([4., 4.]))
    (array([0.25, 0.25]), array([0.75, 0.25]))
    """
    a, z = weighting.factors(whole, values)
    xp = _xp(loss_counts)
    n, w = xp.asarray(loss_counts, dtype=xp.float64), xp.asarray(whole, dtype=xp.float64)
    # an example without loss tokens (z_c > 0 under count_empty only): the piece takes z_c whole; the collator
    # marks its later pieces -1 (no z_c) from the rows' piece_offsets, so a split one counts once
    return a, xp.where(w > 0, z * n / xp.where(w > 0, w, 1.0), z)


def segment_factors(weighting: LossWeighting, labels: np.ndarray, cu_seqlens: np.ndarray, *, real=None,
                    seg_doc=None, values=None, whole=None) -> tuple[np.ndarray, float]:
    """Each segment's factor ``a_c`` and the batch's part of ``Z``: ``(factors, z)``.

    Args:
        labels: ``(n,)`` int64, the batch's flattened labels (``-100`` where no loss: a loss token is a
            label ``!= -100``, under either shift convention, as packkit's batches mask each document's
            first label).
        cu_seqlens: ``(S + 1,)`` the segments over ``labels`` (padding tails and zero-length ones included).
        real: ``(D,)`` the segments that are documents, in order (None: every segment; the others weigh 0).
        seg_doc: ``(D,)`` the example of each document (pieces of a split example share one, so its
            ``|O_c|`` is counted over all of them); None: every document its own.
        values: per-example weights (:class:`ColumnWeighting`).
        whole: ``(D,)`` each document's whole example's loss tokens (pieces of examples split offline:
            :func:`piece_factors`); None: every document is whole (or its pieces share ``seg_doc``).

    Returns: ``factors`` float64 ``(S,)`` (a token's weight is its segment's factor where its label is not
    -100: :func:`packkit.batch.PackedBatch.loss_weight`); ``z`` a float. Two passes over the labels (a
    comparison and ``flatnonzero``); the rest is per segment.

    >>> f, z = segment_factors(resolve("sample"), np.array([-100, 5, 6, -100, 7]), np.array([0, 3, 5]))
    >>> f.tolist(), z
    ([0.5, 1.0], 2.0)
    """
    where = np.flatnonzero(labels != IGNORE_INDEX)
    counts = np.diff(np.searchsorted(where, cu_seqlens))
    docs = counts if real is None else counts[real]
    if whole is not None:
        a, z = piece_factors(weighting, docs, whole, values)
    elif seg_doc is not None:
        size = 0 if values is None else len(values)
        per_example = np.bincount(seg_doc, weights=docs, minlength=size)
        per_example[np.bincount(seg_doc, minlength=size) == 0] = -1  # examples the batch dropped: no documents
        a, z = weighting.factors(per_example, values)
        a = a[seg_doc]
    else:
        a, z = weighting.factors(docs, values)
    if real is None:
        return a, float(z.sum())
    factors = np.zeros(counts.size, np.float64)
    factors[real] = a
    return factors, float(z.sum())


# ----------------------------------------------------------------------------------------------
# what a weighting does to a dataset: the loss weight by length decile (packkit plan --loss-weighting)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightShares:
    """The share of the loss weight each tenth of the examples (by length) carries, under a weighting and
    under the token mean: ``shares[i] = sum_{c in decile i} a_c |O_c| / sum_c a_c |O_c|``, the data read as
    one step (within a step every document's ``Z`` is the same; steps differ only in what they hold).

    Fields: ``weighting`` (its name); ``edges`` ``(11,)`` the lengths bounding the deciles; ``examples``
    ``(10,)``; ``shares`` and ``token_shares`` ``(10,)`` float64, each summing to 1.
    """

    weighting: str
    edges: np.ndarray
    examples: np.ndarray
    shares: np.ndarray
    token_shares: np.ndarray

    def table(self) -> str:
        lines = [f"loss weight by length decile under loss_weighting={self.weighting!r} (token mean beside it)",
                 f"  {'decile':>6}  {'lengths':>15}  {'examples':>9}  {self.weighting:>10}  {'token':>7}"]
        for i in range(self.shares.size):
            span = f"{int(self.edges[i]):,}-{int(self.edges[i + 1]):,}"
            lines.append(f"  {i + 1:>6}  {span:>15}  {int(self.examples[i]):>9,}  {self.shares[i]:>10.1%}  "
                         f"{self.token_shares[i]:>7.1%}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"weighting": self.weighting, "edges": self.edges.tolist(), "examples": self.examples.tolist(),
                "shares": self.shares.tolist(), "token_shares": self.token_shares.tolist()}


def weight_shares(lengths, loss_lengths, weighting) -> WeightShares:
    """:class:`WeightShares` of examples of ``lengths`` tokens with ``loss_lengths`` loss tokens each.

    >>> weight_shares([10] * 5 + [100] * 5, [9] * 5 + [99] * 5, "sample").shares.round(2).tolist()
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    """
    lengths, n = np.asarray(lengths, np.int64), np.asarray(loss_lengths, np.float64)
    rule = resolve(weighting)
    if isinstance(rule, ColumnWeighting):
        raise ArgumentError("the shares of a per-example weight column need the column: pass a name or a callable")
    order = np.argsort(lengths, kind="stable")
    groups = np.array_split(order, 10)
    shares = []
    for r in (rule, TOKEN):
        a, _ = r.factors(n)
        w = a * n
        total = w.sum()
        shares.append(np.array([w[g].sum() / total if total > 0 else 0.0 for g in groups]))
    edges = np.array([int(lengths[g].min()) if g.size else 0 for g in groups] + [int(lengths.max(initial=0))])
    return WeightShares(rule.name, edges, np.array([g.size for g in groups]), shares[0], shares[1])


def plot_weight_shares(shares: WeightShares, path, *, overwrite: bool = False) -> None:
    """A PNG of the shares by decile, the weighting's bars beside the token mean's. Written beside ``path`` and
    renamed into place when complete; an existing ``path`` is replaced only with ``overwrite=True``."""
    x = np.arange(shares.shares.size)
    with png_figure(path, overwrite=overwrite, figsize=(9, 4.8)) as (fig, ax):
        from matplotlib.ticker import PercentFormatter

        ax.bar(x - 0.2, shares.token_shares, width=0.4, color="#8C8C8C", label="token mean")
        ax.bar(x + 0.2, shares.shares, width=0.4, color="#4C72B0", label=shares.weighting)
        ax.axhline(0.1, color="0.5", linestyle=":", linewidth=1)
        labels = [f"{int(shares.edges[i]):,}-\n{int(shares.edges[i + 1]):,}" for i in x]
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel("length decile (tokens)")
        ax.set_ylabel("share of the loss weight")
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_title(f"loss weight by length decile: {shares.weighting} against the token mean", fontsize=11)
        ax.legend(frameon=False)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
