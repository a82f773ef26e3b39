"""The rules of what an example carries beside its token columns, and their wording: a packed row's documents
(:func:`row_segments`), a group's completions (:func:`check_groups`, :func:`relocate_part`), per-example values
(:func:`example_values`) and an image's or a video's grid (:func:`grid_rows`).

    >>> [a.tolist() for a in row_segments("seq_lengths", [2, 1, 3], [2, 1], [3, 3])]
    [[2, 1, 3], [0, 2, 3]]

A room of their own beside :mod:`packkit.rules` (the rules of token ids, labels and loss masks, which every reader
applies), so that a reader of plain token ids (``packkit plan FILE``, ``waste FILE``) does not compile them; both
name the example by :mod:`packkit.located`. :mod:`packkit.rules` lends every name here under its old address
(``packkit.rules.row_segments``). numpy only.
"""

from __future__ import annotations

import numbers

import numpy as np

from .located import ExampleTypeError, ExampleValueError, is_located, located, location, not_integral, value_text
from .segments import lengths_to_offsets, lengths_to_seq_idx

__all__ = ["row_segments", "check_groups", "relocate_part", "example_values", "grid_rows"]


# ----------------------------------------------------------------------------------------------
# groups: a prompt and its completions (preference pairs, RL groups)
# ----------------------------------------------------------------------------------------------


def _part(j: int, keys) -> tuple[str, str]:
    """``(key, where)`` of completion ``j`` of a group: ``keys`` names one key per completion (a preference
    pair's ``("chosen_ids", "rejected_ids")``), else every completion is ``'completion_ids' (completion j)``."""
    if keys:
        return keys[j % len(keys)], ""
    return "completion_ids", f" (completion {j})"


def check_groups(prompt_lengths, completion_lengths, group_sizes, *, rows=None, keys=None,
                 prompt_key: str = "prompt_ids") -> None:
    """Groups that each have something to score: at least one completion, no empty completion, and no
    completion of one token after an empty prompt (its only token has no token before it to be predicted
    from). ``prompt_lengths`` ``(G,)``, ``completion_lengths`` ``(N,)`` group after group, ``group_sizes``
    ``(G,)``; ``keys``: the completions' keys for the errors (:func:`_part`).
    ``check_groups([0], [1, 2], [2], keys=("chosen_ids", "rejected_ids"))`` raises ``"example 0 has an empty
    'prompt_ids' and 1 token in 'chosen_ids': nothing to score (...); give it a prompt (a BOS token) or filter
    it out"``.
    """
    p_len, c_len = np.asarray(prompt_lengths, np.int64), np.asarray(completion_lengths, np.int64)
    k = np.asarray(group_sizes, np.int64)
    group = lengths_to_seq_idx(k)
    unscored = (c_len < 1) | ((c_len < 2) & (p_len[group] < 1))
    bad = (k < 1) | (np.bincount(group, weights=unscored, minlength=k.size) > 0)
    if bad.any():  # the first group (in order) with nothing to score, then what it lacks
        g = int(np.argmax(bad))
        if k[g] < 1:
            raise located(ExampleValueError, g, rows, "has no completion; a group needs at least one")
        offset = int(lengths_to_offsets(k)[g])
        n = offset + int(np.argmax(unscored[offset: offset + int(k[g])]))
        key, where = _part(n - offset, keys)
        if c_len[n] < 1:
            text = f"has an empty {key!r}{where}: nothing to score; filter such examples out first"
        else:
            text = (f"has an empty {prompt_key!r} and 1 token in {key!r}{where}: nothing to score (a sequence's first "
                    "token has no token before it to be predicted from); give it a prompt (a BOS token) or filter "
                    "it out")
        raise located(ExampleValueError, g, rows, text)


def relocate_part(exc: Exception, group_sizes, *, rows=None, keys=None) -> Exception:
    """An error about the ``n``-th completion (completions laid out group after group, each read as an
    example of ``'completion_ids'``) as the same error about its group: ``"example 1 has token id -1 in
    'completion_ids'"`` about completion 1 of groups of sizes ``[1, 2]`` reads ``"example 1 has token id -1 in
    'completion_ids' (completion 0)"``, or with ``keys`` its own key (:func:`_part`); other errors as they are."""
    if not is_located(exc):
        return exc
    offsets = lengths_to_offsets(np.asarray(group_sizes, np.int64))
    g = int(np.searchsorted(offsets, exc.index, side="right") - 1)
    key, where = _part(exc.index - int(offsets[g]), keys)
    return located(type(exc), g, rows, exc.text.replace("'completion_ids'", f"{key!r}{where}", 1))


# ----------------------------------------------------------------------------------------------
# per-example values: numbers that ride along (advantages, rewards, weights)
# ----------------------------------------------------------------------------------------------


def example_values(values: list, sizes, *, key: str, rows=None, what: str = "completion") -> np.ndarray | None:
    """Every example's ``key`` (``values``: one entry per example, None where it lacks the key), checked and
    laid end to end as float64 ``(sum(sizes),)``; None when no example has it.

    The rule: present on every example or on none (a batch where some lack it is refused, never trained
    without it); each a number or a flat list (array, tensor) of ``sizes[i]`` numbers, one per ``what``;
    every number finite. Bools, text, nulls and nested lists are refused. The error names the example:
    ``example_values([[1.0, nan]], [2], key="advantages")`` raises ``"example 0 has nan (float) in
    'advantages' (completion 1); advantages are finite numbers, one per completion: fix or drop the example"``.
    """
    missing = [i for i, v in enumerate(values) if v is None]
    if len(missing) == len(values):
        return None
    rule = f"{key} are finite numbers, one per {what}"
    if missing:
        have = next(i for i, v in enumerate(values) if v is not None)
        raise located(ExampleValueError, missing[0], rows,
                      f"has no {key!r} while {location(have, rows)} has them; {rule}, on every example or on none "
                      "(a batch cannot be trained with some): fill it in or drop the column")
    sizes = np.asarray(sizes, np.int64)
    out = []
    for i, v in enumerate(values):
        if hasattr(v, "detach") and hasattr(v, "cpu"):  # a torch tensor, without importing torch
            v = v.detach().cpu().numpy()
        if isinstance(v, (str, bytes)):
            raise located(ExampleTypeError, i, rows, f"has {value_text(v)} in {key!r}; {rule}")
        try:
            arr = np.asarray(v)
        except ValueError:  # ragged nested lists
            arr = np.asarray(None, dtype=object)
            shape = "ragged"
        else:
            shape = f"shape {list(arr.shape)}"
        if arr.ndim > 1 or (arr.dtype == object and (shape == "ragged" or any(
                isinstance(x, (list, tuple, np.ndarray)) for x in arr.flat))):
            raise located(ExampleTypeError, i, rows, f"has a nested list in {key!r} ({shape}); {rule}: pass one flat "
                          "list per example")
        arr = arr.reshape(-1)
        if arr.dtype.kind not in "iuf" or (isinstance(v, (list, tuple)) and any(isinstance(x, (bool, np.bool_))
                                                                                 for x in v)):  # [1.0, True]
            items = list(v) if isinstance(v, (list, tuple)) else arr.tolist()
            j = next((j for j, x in enumerate(items) if x is None or isinstance(x, (bool, np.bool_, str, bytes))
                      or not isinstance(x, numbers.Real)), 0)
            x = items[j] if items else v
            text = f"has a null in {key!r} ({what} {j})" if x is None else f"has {value_text(x)} in {key!r} ({what} {j})"
            raise located(ExampleTypeError, i, rows, f"{text}; {rule}")
        if arr.size != sizes[i]:
            raise located(ExampleValueError, i, rows, f"has {arr.size} {key!r} for {int(sizes[i])} {what}s; give one "
                          f"per {what}")
        arr = arr.astype(np.float64)
        bad = ~np.isfinite(arr)
        if bad.any():
            j = int(np.argmax(bad))
            raise located(ExampleValueError, i, rows, f"has {value_text(arr[j])} in {key!r} ({what} {j}); {rule}: "
                          "fix or drop the example")
        out.append(arr)
    return np.concatenate(out) if out else np.zeros(0, np.float64)


# ----------------------------------------------------------------------------------------------
# per-example grids: the (t, h, w) of each image or video
# ----------------------------------------------------------------------------------------------


def grid_rows(value, i: int, *, key: str, rows=None, merge: int | None = None) -> np.ndarray:
    """One example's grids (``image_grid_thw``, ``video_grid_thw``: one ``(t, h, w)`` row of patches per image
    or video) as ``(n, 3)`` int64, checked: integers >= 1, three a row, and ``h`` and ``w`` multiples of
    ``merge`` (the vision tower merges ``merge x merge`` patches into one token) when given.
    ``grid_rows([[1, 4, 4]], 0, key="image_grid_thw") -> [[1, 4, 4]]``; ``[[4, 4]]`` raises ``"example 0 has
    image_grid_thw of shape [1, 2]; a grid is one (t, h, w) row per image, as the processor returns it"``.
    """
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        grid = np.asarray(value)
    except ValueError:  # ragged rows
        grid = np.asarray(None, dtype=object)
    what = "image" if "image" in key else "video"
    if grid.ndim != 2 or grid.shape[1] != 3:
        shape = f"shape {list(grid.shape)}" if grid.dtype != object or grid.ndim else "ragged rows"
        raise located(ExampleValueError, i, rows, f"has {key} of {shape}; a grid is one (t, h, w) row per {what}, as "
                      "the processor returns it")
    if grid.dtype.kind not in "iu":
        bad = not_integral(grid.astype(np.float64)) if grid.dtype.kind == "f" else np.ones(grid.shape, bool)
        if grid.dtype.kind != "f" or bad.any():
            r, c = np.unravel_index(int(np.argmax(bad)), grid.shape)
            raise located(ExampleTypeError, i, rows, f"has {value_text(grid[r, c])} in {key} ({what} {r}); a grid "
                          "holds integers >= 1 (patches along t, h, w)")
    small = grid < 1
    if small.any():
        r, c = np.unravel_index(int(np.argmax(small)), grid.shape)
        raise located(ExampleValueError, i, rows, f"has {key} {grid[r].tolist()} ({what} {r}); a grid holds integers "
                      ">= 1 (patches along t, h, w)")
    grid = grid.astype(np.int64)
    if merge is not None:
        odd = (grid[:, 1:] % merge != 0).any(axis=1)
        if odd.any():
            r = int(np.argmax(odd))
            raise located(ExampleValueError, i, rows, f"has {key} {grid[r].tolist()} ({what} {r}), whose h and w are "
                          f"not multiples of the model's spatial_merge_size={merge}; keep the grid the model's "
                          "processor returned")
    return grid



# ----------------------------------------------------------------------------------------------
# packed rows: their documents
# ----------------------------------------------------------------------------------------------


def _first_bad_row(values: np.ndarray, bad: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
    """``(row, value)`` of the first ``bad`` value of a flat column with ``(n + 1,)`` ``offsets``."""
    t = int(np.argmax(bad))
    return int(np.searchsorted(offsets, t, side="right") - 1), int(values[t])


def row_segments(key: str, flat, counts, lengths, *, rows=None,
                 positive: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The documents of packed rows: ``(seg_lengths (S,) int64, seg_ptr (R + 1,) int64)``, row ``r``
    holding ``seg_lengths[seg_ptr[r]:seg_ptr[r + 1]]``, from their ``key`` column (``seq_lengths``, or
    ``position_ids`` that restart at 0 at each document) as flat values with ``counts`` per row, checked
    against the rows' token ``lengths`` (errors name the row, :func:`location`).

    ``row_segments("seq_lengths", [2, 1, 3], [2, 1], [3, 3]) -> ([2, 1, 3], [0, 2, 3])``;
    ``row_segments("position_ids", [0, 1, 0, 0, 1, 2], [3, 3], [3, 3]) -> ([2, 1, 3], [0, 2, 3])``.
    ``positive``: the caller has found every ``seq_lengths`` value >= 1 (packed rows' join checks them with their
    ``example_loss`` in one comparison, :func:`packkit.collate._row_segments`); nothing else is skipped.
    """
    flat = np.asarray(flat, np.int64)
    counts, lengths = np.asarray(counts, np.int64), np.asarray(lengths, np.int64)
    if key == "seq_lengths":
        seg_ptr = lengths_to_offsets(counts)
        if not positive and (flat < 1).any():
            i, v = _first_bad_row(flat, flat < 1, seg_ptr)
            raise located(ExampleValueError, i, rows, f"has a segment of length {v}; seq_lengths must be >= 1")
        csum = lengths_to_offsets(flat)
        sums = csum[seg_ptr[1:]] - csum[seg_ptr[:-1]]
        bad = sums != lengths
        if bad.any():
            i = int(np.argmax(bad))
            cut = ("; they must match (input_ids cut after packing? TRL's SFTConfig(max_length=...) below the packing "
                   "window truncates packed rows: pass max_length=None, the rows already fit the window)"
                   if sums[i] > lengths[i] else "; they must match")
            raise located(ExampleValueError, i, rows, f"has seq_lengths summing to {int(sums[i])} for "
                          f"{int(lengths[i])} input_ids{cut}")
        return flat, seg_ptr
    bad = counts != lengths
    if bad.any():
        i = int(np.argmax(bad))
        raise located(ExampleValueError, i, rows, f"has {int(counts[i])} position_ids for {int(lengths[i])} "
                      "input_ids")
    row_offsets = lengths_to_offsets(lengths)
    prev = np.concatenate(([-1], flat[:-1]))
    prev[row_offsets[:-1]] = -1
    is_start = flat == 0
    bad = ~is_start & (flat != prev + 1)
    if bad.any():
        i, v = _first_bad_row(flat, bad, row_offsets)
        raise located(ExampleValueError, i, rows, "has position_ids that neither restart at 0 nor go up by one "
                      f"(value {v}); pass seq_lengths instead")
    starts = np.flatnonzero(is_start)
    seg_ptr = np.searchsorted(starts, row_offsets, side="left").astype(np.int64)
    return np.diff(np.append(starts, flat.size)).astype(np.int64), seg_ptr
