"""What a document costs a rank, and the two figures every schedule reports: numpy only, and small, so that the
commands measure a schedule without the planners of :mod:`packkit.balance` (which re-exports these names).

The cost model (WLB-LLM, verl's ``calculate_workload``) is, per document of ``L`` tokens::

    cost(L) = linear * L + L**2 / cp_size (+ per_unit * units)

``linear`` is the per-token work (the matmuls) in units of the per-token-pair attention work; a context-
parallel group of ``cp_size`` ranks shares a document's attention, so its quadratic part is divided.
A multimodal document also runs its media through an encoder: ``per_unit`` is one unit's encoder work (an
image, a tile, an audio clip, at the encoder's fixed input size), ``units`` the document's count of them
(:meth:`CostModel.from_config` derives both weights from a vision-language config).
:meth:`CostModel.from_config` derives ``linear`` from a model config; :data:`DEFAULT_LINEAR` is verl's
figure for a 7B model (``6 x hidden_size`` at 4096).

    >>> CostModel(linear=10).costs([1, 4]).tolist()
    [11.0, 56.0]
    >>> compute_imbalance([[3.0, 1.0], [2.0, 2.0]])      # (3 + 2) / (2 + 2)
    1.25
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .errors import ArgumentError, arg, check_int
from .records import record

__all__ = ["CostModel", "DEFAULT_LINEAR", "cost_model", "compute_imbalance", "variation", "step_figures"]

#: verl's per-token weight for a 7B model (``6 x 4096``): cost = 24576 * L + L**2.
DEFAULT_LINEAR = 24576.0


def _config_costs():
    """:mod:`packkit.config_costs`, imported where a cost model is read from a model config: a sampler given none
    (``packkit plan``, ``packkit waste``) does not compile it."""
    from . import config_costs  # lazy: the sums of a model config, for CostModel.from_config only
    return config_costs


@record
class CostModel:
    """``cost(L) = linear * L + L**2 / cp_size + per_unit * units`` per document; a rank's cost is the sum over
    its documents.

    Args:
        linear: per-token weight, > 0 (see :meth:`from_config`, or measure it once: the time of a
            window of many short documents over that of one long document tells ``linear`` apart).
        cp_size: context-parallel ranks that share each document's attention (>= 1).
        per_unit: the encoder work of one media unit (image, tile, audio clip), >= 0, in the same units
            (one token pair of the decoder's attention); 0 for a text model.

    ``CostModel(linear=2, cp_size=2).costs([4]) -> [16.0]`` (2 * 4 + 16 / 2);
    ``CostModel(linear=2, per_unit=100).costs([4], units=[3]) -> [324.0]`` (2 * 4 + 16 + 3 * 100).
    """

    linear: float = DEFAULT_LINEAR
    cp_size: int = 1
    per_unit: float = 0.0

    def __post_init__(self):
        if (isinstance(self.linear, bool) or not isinstance(self.linear, numbers.Real) or not self.linear > 0
                or not math.isfinite(self.linear)):  # inf would make every cost inf, and every ratio of them NaN
            raise ArgumentError("{a} must be a finite positive number (the per-token weight), got {got!r}",
                                a=arg("cost"), got=self.linear)
        object.__setattr__(self, "linear", float(self.linear))
        object.__setattr__(self, "cp_size", check_int(self.cp_size, "cp_size"))
        if (isinstance(self.per_unit, bool) or not isinstance(self.per_unit, numbers.Real) or not self.per_unit >= 0
                or not math.isfinite(self.per_unit)):
            raise ArgumentError("{a} must be a finite number >= 0 (one media unit's encoder work), got {got!r}",
                                a=arg("per_unit"), got=self.per_unit)
        object.__setattr__(self, "per_unit", float(self.per_unit))

    def costs(self, lengths, units=None) -> np.ndarray:
        """(n,) float64 cost of each document, ``units`` (n,) its media units (None: none):
        ``CostModel(linear=10).costs([1, 4]) -> [11., 56.]``."""
        L = np.asarray(lengths)
        own = L.dtype != np.float64  # the conversion copies: L is ours to scale in place
        L = L.astype(np.float64) if own else L
        text = L * L
        text /= self.cp_size
        text += np.multiply(L, self.linear, out=L if own else None)  # linear L + L^2 / cp, two arrays made, not five
        return text if units is None or not self.per_unit else text + self.per_unit * np.asarray(units, np.float64)

    def of_sums(self, tokens, squares, units=None) -> np.ndarray:
        """The summed :meth:`costs` of groups of documents from the groups' sums of ``L``, ``L**2`` and media units
        (None: none): ``CostModel(linear=10).of_sums([5], [17]) -> [67.]`` (documents of 1 and 4 tokens)."""
        out = self.linear * np.asarray(tokens, np.float64) + np.asarray(squares, np.float64) / self.cp_size
        return out if units is None or not self.per_unit else out + self.per_unit * np.asarray(units, np.float64)

    @classmethod
    def from_config(cls, config=None, *, hidden_size: int | None = None, intermediate_size: int | None = None,
                    kv_size: int | None = None, cp_size: int = 1) -> "CostModel":
        """The weight of a decoder from its sizes (a transformers config, or the sizes by name).

        Per layer and token, the projections cost ``2 * (2 h^2 + 2 h kv + 3 h f)`` FLOPs (q and o,
        k and v of width ``kv = num_key_value_heads * head_dim``, a gated MLP of width ``f``); causal
        attention over a document of ``L`` tokens costs ``2 L^2 h`` (QK^T and PV, halved by the mask).
        The layers cancel, and per unit of attention ``linear = 2 h + 2 kv + 3 f``:
        ``from_config(hidden_size=4096, intermediate_size=11008) -> linear 49408`` (Llama-2 7B; the
        embedding and the LM head are left out, as verl's 24576 = 6 h leaves out the MLP's width).
        A multimodal config (``model.config`` of Gemma 3, LLaVA, Qwen2-Audio, ...) gives ``linear`` from its text
        config and ``per_unit`` from its encoder (:func:`packkit.config_costs._encoder_work`) over the text's ``2 h`` a layer of its
        layers: Gemma 3 4B's image ``3.1e7``, about three times the text work of its 256 placeholders.
        """
        linear, per_unit = _config_costs().weights(config, hidden_size=hidden_size,
                                                   intermediate_size=intermediate_size, kv_size=kv_size)
        return cls(linear=linear, cp_size=cp_size, per_unit=per_unit)


def cost_model(cost=None, *, cp_size: int = 1) -> CostModel:
    """A :class:`CostModel` from what a sampler was given: None (the default weight), a number (the
    weight), a :class:`CostModel`, or a model config (:meth:`CostModel.from_config`).

    ``cost_model(100, cp_size=2) -> CostModel(linear=100.0, cp_size=2)``.
    """
    if isinstance(cost, CostModel):
        if cp_size != 1 and cost.cp_size not in (1, cp_size):
            raise ArgumentError("{cp} disagrees with the cost model's cp_size={m}: pass one of them",
                                cp=arg("cp_size", cp_size), m=cost.cp_size)
        return dataclasses.replace(cost, cp_size=max(cost.cp_size, cp_size))
    if cost is None:
        return CostModel(cp_size=cp_size)
    if isinstance(cost, numbers.Real) and not isinstance(cost, bool):
        return CostModel(linear=cost, cp_size=cp_size)
    if hasattr(cost, "hidden_size") or hasattr(cost, "get_text_config"):
        return CostModel.from_config(cost, cp_size=cp_size)
    raise ArgumentError("{c} must be a number (the per-token weight), a CostModel or a model config, got {t}",
                        c=arg("cost"), t=type(cost).__name__)


# ----------------------------------------------------------------------------------------------
# the two figures
# ----------------------------------------------------------------------------------------------


def compute_imbalance(rank_cost) -> float:
    """How much longer steps take than if every rank had the mean: ``sum_s max_r c[s, r] / sum_s mean_r c[s, r]``.

    ``rank_cost``: (steps, ranks) the cost each rank carries in each optimiser step (the sum over its
    micro-batches of that step). 1.0 is perfect balance; with synchronous steps, a run takes
    ``compute_imbalance`` times the time of a perfectly balanced one (at equal per-rank speed). No steps,
    or no cost: 1.0. ``compute_imbalance([[3, 1], [2, 2]]) -> 1.25``.
    """
    c = np.asarray(rank_cost, np.float64)
    if c.ndim != 2:
        raise ValueError(f"rank_cost must be (steps, ranks), got shape {c.shape}")
    if c.size == 0:
        return 1.0
    bad = ~np.isfinite(c) | (c < 0)  # a NaN step would make the ratio NaN, or 1.0 where NaN compares False
    if bad.any():
        s, r = np.unravel_index(int(np.argmax(bad)), c.shape)
        raise ValueError(f"rank_cost[{s}, {r}] = {float(c[s, r])!r}: a rank's cost is a finite number >= 0 "
                         "(check the cost model's weight)")
    mean = float(c.mean(axis=1).sum())
    return float(c.max(axis=1).sum()) / mean if mean > 0 else 1.0


def variation(values) -> float:
    """Coefficient of variation, ``std / mean`` (population std); 0.0 when empty or the mean is 0.

    Of examples per step, it says how much balancing changed what a step holds: ``variation([2, 4]) -> 1/3``.
    """
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return 0.0
    mean = float(v.mean())
    return float(v.std()) / mean if mean > 0 else 0.0


def step_figures(unit_cost, unit_examples, *, ranks: int, per_rank: int) -> tuple[float, float]:
    """``(compute_imbalance, examples_per_step_cv)`` of units (windows, or padded micro-batches) taken in
    training order, ``ranks * per_rank`` a step, rank ``r`` of a step taking its ``r``-th run of
    ``per_rank``; full steps only (all units as one step when there is no full step).

    ``step_figures([3, 1, 2, 2], [1, 1, 2, 2], ranks=2, per_rank=1) -> (1.25, 1/3)``.
    """
    c = np.asarray(unit_cost, np.float64)
    e = np.asarray(unit_examples, np.float64)
    span = ranks * per_rank
    full = c.size // span * span
    if full == 0:
        return 1.0, 0.0
    rank_cost = c[:full].reshape(-1, ranks, per_rank).sum(axis=2)
    return compute_imbalance(rank_cost), variation(e[:full].reshape(-1, span).sum(axis=1))
