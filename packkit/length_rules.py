"""The rule every list of lengths is read by (one token count per example, a loss-token count per example), and its
wording, and the window they are packed in (:func:`check_window`): numpy only, and small, so that planning
(:mod:`packkit.binpack`, the sampler, the epoch) reads lengths without compiling the rules of whole examples
(:mod:`packkit.rules`, which re-exports these names); :mod:`packkit.binpack` lends the window's names as before.

    >>> as_lengths([3, 1]).tolist()
    [3, 1]
"""

from __future__ import annotations

import numbers
import os

import numpy as np

from .errors import ArgumentError, arg, check_int

__all__ = ["as_lengths", "check_loss_lengths", "INT64_MAX", "check_window", "max_window", "MAX_WINDOW"]

#: The largest value packkit keeps: tokens and labels are int64 (uint64 past it would wrap to negatives).
INT64_MAX = np.iinfo(np.int64).max
_INT64_FIX = "-2**63 .. 2**63 - 1, what packkit writes: no value is cast silently"


def check_loss_lengths(loss_lengths, lengths: np.ndarray) -> np.ndarray:
    """(n,) int64 ``loss_lengths``, one per example of ``lengths``, each between 0 and its length - 1 (the first
    token is never a target), else the error naming the first example out of range:
    ``check_loss_lengths([1, 0], np.array([2, 3])) -> [1, 0]``."""
    loss = np.asarray(loss_lengths)
    if loss.ndim != 1 or loss.size != lengths.size:
        raise ValueError(f"loss_lengths must have one entry per example ({lengths.size:,}), got shape {loss.shape}")
    if loss.dtype.kind not in "iu":
        raise TypeError(f"loss_lengths must be integers, got dtype {loss.dtype}")
    loss = loss.astype(np.int64)
    bad = (loss < 0) | (loss > lengths - 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"example {i} has loss_lengths={int(loss[i])} with length {int(lengths[i])}: "
            "loss tokens must be between 0 and length - 1 (the first token is never a target)"
        )
    return loss


def as_lengths(lengths, *, name: str = "lengths", item: str = "example", low: int = 1) -> np.ndarray:
    """Check lengths (one token count per ``item``) and return them as a 1-D int64 array:
    ``as_lengths([3, 1]) -> [3, 1]``.

    Accepts a list, tuple, numpy array or torch tensor of positive integers. Integral floats
    (``3.0``) are accepted; NaN, infinities, fractions, zero, negatives, booleans, nested and ragged input,
    and values past int64 (a ``uint64`` 2**64 - 1 would read back as -1, a float 1e20 as a negative) are
    not, and the error names the first offending ``item`` (``name[i]``):
    ``as_lengths([3, 2.5], name="group_tokens", item="group")`` raises
    ``"group_tokens[1] = 2.5 is not a whole number of tokens; pass integer token counts"``.
    ``low=0`` reads counts that may be zero (media units per example).
    """
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"{name} must be a 1-D sequence of integers, got {type(lengths).__name__}")
    if not isinstance(lengths, np.ndarray):
        for i, x in enumerate(lengths):
            if isinstance(x, (list, tuple, np.ndarray, dict)):
                raise TypeError(
                    f"{name}[{i}] is a {type(x).__name__}, not an integer: pass one length per {item} "
                    "(nested or ragged input is not a list of lengths)"
                )
            if isinstance(x, (bool, np.bool_, str, bytes)):
                raise TypeError(f"{name}[{i}] is {x!r} ({type(x).__name__}): lengths must be integers")
            if isinstance(x, numbers.Integral) and not -2**63 <= x <= INT64_MAX:
                raise _length_past_int64(i, x, type(x).__name__, name, item)
        try:
            arr = np.asarray(lengths)
        except (ValueError, TypeError) as exc:  # pragma: no cover - numpy's own message is kept
            raise TypeError(f"{name} could not be read as a 1-D array of integers: {exc}") from None
    else:
        arr = lengths
    if arr.ndim != 1:
        raise TypeError(f"{name} must be 1-D (one length per {item}), got shape {arr.shape}")
    given = arr  # for the error past int64: the value as given (a uint64, a float)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or arr.dtype == object or arr.dtype.kind in "USV":
        bad = 0
        if arr.dtype == object:
            bad = next(
                (i for i, x in enumerate(arr) if isinstance(x, bool) or not isinstance(x, numbers.Real)),
                None,
            )
            if bad is None:  # Python ints past uint64 (2**70): checked below as floats, past int64
                arr = arr.astype(np.float64)
        if arr.dtype != np.float64:
            raise TypeError(
                f"{name}[{bad}] is {arr[bad]!r} ({type(arr[bad]).__name__}): lengths must be integers"
            )
    if arr.dtype.kind == "f":
        finite = np.isfinite(arr)
        integral = finite & (arr == np.floor(np.where(finite, arr, 0)))
        if not integral.all():
            i = int(np.argmin(integral))
            raise ValueError(f"{name}[{i}] = {float(arr[i])!r} is not a whole number of tokens; pass integer "
                             "token counts")
        past = np.abs(arr) >= 2.0 ** 63
    elif arr.dtype.kind in "iu":
        past = arr > INT64_MAX if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 else None
    else:
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if past is not None and past.any():
        i = int(np.argmax(past))
        v = given[i]
        raise _length_past_int64(i, v.item() if isinstance(v, np.generic) else v, given.dtype, name, item)
    arr = arr.astype(np.int64, copy=False)
    nonpositive = arr < low
    if nonpositive.any():
        i = int(np.argmax(nonpositive))
        if low == 0:
            raise ValueError(f"{name}[{i}] = {int(arr[i])} is negative: pass counts of 0 or more, one per {item}")
        raise ValueError(
            f"{item} {i} has length {int(arr[i])}: every {item} needs at least 1 token "
            f"(filter empty {item}s out before packing)"
        )
    return arr


def _length_past_int64(i: int, v, dtype, name: str, item: str) -> ValueError:
    return ValueError(f"{item} {i} has length {v!r} ({dtype}) in {name}, beyond int64 ({_INT64_FIX}); every "
                      f"{item} needs a token count from 1 to 2**63 - 1")


#: The largest window packkit accepts by default, in tokens (16,777,216). Why a bound: the first-fit
#: planner keeps tables of ``window + 1`` entries and the best-fit one counts lengths up to the window
#: (8 bytes an entry: 128 MiB at 2**24, 8 TiB at 2**40), and ``cu_seqlens`` are int32 (at most 2**31 - 1
#: tokens a batch); a window this wide is longer than any context models are trained at. The
#: environment variable ``PACKKIT_MAX_WINDOW`` raises (or lowers) it, for the library and the CLI alike.
MAX_WINDOW = 2**24


def max_window() -> int:
    """The largest window :func:`check_window` accepts: ``PACKKIT_MAX_WINDOW`` if set, else :data:`MAX_WINDOW`."""
    env = os.environ.get("PACKKIT_MAX_WINDOW", "").strip()
    if not env:
        return MAX_WINDOW
    try:
        value = int(env.replace("_", ""), 0)
    except ValueError:
        value = 0
    if value < 1:
        raise ArgumentError(f"PACKKIT_MAX_WINDOW must be a positive integer number of tokens, got {env!r}")
    return value


def check_window(window) -> int:
    """Return ``window`` as a Python int in ``[1, max_window()]``, or raise: ``check_window(2048) -> 2048``."""
    window = check_int(window, "window", unit=" token")
    limit = max_window()
    if window > limit:
        why = ("the planners keep tables of window + 1 entries (8 bytes each) and cu_seqlens are int32"
               if limit == MAX_WINDOW else "PACKKIT_MAX_WINDOW sets it")
        raise ArgumentError("{window} is above the largest window packkit accepts, {limit:,} tokens: {why}; "
                            "set the environment variable PACKKIT_MAX_WINDOW to change it",
                            window=arg("window", window), limit=limit, why=why)
    return window
