"""The words packkit's options take, shared by the library and the command line, in a module that imports
nothing: ``packkit --help`` and a refused argument build their parser from these without numpy (the library
modules that use them, :mod:`packkit.binpack` and :mod:`packkit.cp_plan`, import numpy at once).

``OVERFLOW_POLICIES``: what to do with an example longer than the window; ``DEFAULT_OVERFLOW`` the choice of
every path that prepares or measures data. ``STRATEGIES``: the planner's bin packings (:func:`packkit.binpack.pack`).
``BALANCE``: the samplers' balance policies (:class:`packkit.sampler.SamplerOptions`). ``CP_LAYOUTS``: how a row
is cut across a context-parallel group (drawn in :mod:`packkit.cp_plan`). ``LOSS_WEIGHTINGS``: the names a
``loss_weighting=`` string may give (the keys of :data:`packkit.weighting.NAMES`), ``LENGTH_MODES`` those given with a
constant length as ``NAME:L`` (:func:`loss_weighting_spec`). ``CHAT_FORMATS``: the
conversational formats :mod:`packkit.chat` reads.
"""

from __future__ import annotations

__all__ = ["OVERFLOW_POLICIES", "DEFAULT_OVERFLOW", "STRATEGIES", "BALANCE", "CP_LAYOUTS", "LOSS_WEIGHTINGS",
           "LENGTH_MODES", "loss_weighting_spec", "CHAT_FORMATS"]

OVERFLOW_POLICIES = ("error", "truncate", "split", "drop")

#: The overflow policy of every path that prepares or measures data (``pack_dataset``, offline and on Ray,
#: ``pack_stream``, ``plan_budget``, ``measure_waste`` and every command): ``"split"`` keeps every token
#: (an example longer than the window continues in the next one) and says how many it split. The planner
#: (:func:`packkit.binpack.pack`), the collators and the samplers, which see whole examples at batch time,
#: refuse them unless told (``"error"``).
DEFAULT_OVERFLOW = "split"

STRATEGIES = ("bfd", "ffd", "shuffle_ff", "next_fit")

BALANCE = (None, "tokens", "sqlen", "compute")

CP_LAYOUTS = ("zigzag", "contiguous", "ulysses", "hybrid")

LOSS_WEIGHTINGS = ("dapo", "grpo", "sample", "seq-mean-token-mean", "seq-mean-token-sum", "sqrt", "token", "token-mean")

#: the weightings with a constant length, given as NAME:L (packkit.weighting.SeqSumNorm, DrGRPO)
LENGTH_MODES = ("seq-mean-token-sum-norm", "dr_grpo")


def loss_weighting_spec(text: str) -> str:
    """A loss weighting named in text (``packkit plan --loss-weighting``), checked: a name of
    :data:`LOSS_WEIGHTINGS`, or ``seq-mean-token-sum-norm:L`` / ``dr_grpo:L`` (``L`` a positive int); else a
    ValueError saying why (a column of weights or a callable: the shares are read off the lengths, and a command
    line carries no Python callable). ``loss_weighting_spec("dr_grpo:4096") -> 'dr_grpo:4096'``."""
    name, sep, length = text.partition(":")
    if not sep and name in LOSS_WEIGHTINGS:
        return text
    if name in LENGTH_MODES:
        if sep and length.isdigit() and int(length) > 0:
            return text
        raise ValueError(f"{name} divides by a constant length: pass {name}:L, e.g. {name}:4096")
    if name == "column":
        raise ValueError("a column of per-example weights is not read by plan (it reads lengths): "
                         "use packkit.weighting.weight_shares with the weights in Python")
    raise ValueError(f"{text!r} is not a loss weighting: one of {', '.join(LOSS_WEIGHTINGS)}, "
                     f"or {':L, '.join(LENGTH_MODES)}:L")


CHAT_FORMATS = ("messages", "conversations", "prompt_completion", "conversational_prompt_completion")
