"""Preference pairs and RL groups, packed: a prompt and its continuations as one atom.

DPO needs, for every pair, the log-probability of the chosen and of the rejected completion given the
prompt; GRPO-style RL needs it for each of a prompt's ``k`` completions. Both are *groups*: a prompt
with continuations. packkit packs whole groups (:func:`packkit.binpack.pack_groups`: a group never
spans two windows, ranks or steps) in one of two layouts.

``layout="pairs"`` (plain): every continuation is its own sequence ``prompt + continuation``, positions
from 0, a group's sequences adjacent. Any varlen consumer reads it (``cu_seqlens``, restarting
``position_ids``: Hugging Face models find the sequences themselves), like TRL's padding-free DPO, but
several groups share a window.

``layout="tree"`` (shared prompt): the prompt once, then each continuation, whose positions continue
from the prompt; a continuation sees the prompt and itself only (arXiv 2410.20305). A pair with prompt
``p0 p1``, chosen ``c0 c1``, rejected ``r0``::

    input_ids      p0  p1  c0  c1  r0
    position_ids    0   1   2   3   2       r0 continues from the prompt, as c0 does
    sequence_ids   -1  -1   0   0   1       the prompt belongs to both sequences
    scored              .   c0  c1  r0      c0 and r0 are both predicted from p1's logits

    dense_mask()[0]  (query row, key column; 1 = may attend)
          p0 p1 c0 c1 r0
      p0   1  .  .  .  .
      p1   1  1  .  .  .
      c0   1  1  1  .  .
      c1   1  1  1  1  .
      r0   1  1  .  .  1      r0 sees the prompt and itself, not the chosen reply

It saves the prompt's tokens once per extra continuation (a pair costs ``prompt + chosen + rejected``
tokens instead of ``2 * prompt + chosen + rejected``), but position restarts no longer describe the
mask, so the model needs it explicitly: :meth:`SequenceBatch.model_inputs` hands a Hugging Face model
the additive 4-D mask (eager, sdpa) or a FlexAttention ``BlockMask`` (flex_attention), and refuses flash
attention, which takes no mask; :meth:`SequenceBatch.varlen_kwargs` is the recipe for your own varlen
kernel (each later continuation a query segment whose keys are the prompt's plus its own, gathered,
with bottom-right causal alignment: flash-attn >= 2.1's ``causal=True`` when ``seqlen_q < seqlen_k``).

Log-probabilities: :func:`sequence_logps` reads every scored token from the logits that predict it
(``score_source``; in the tree the first token of every continuation reads the prompt's last token), and
returns per sequence, in group order, the sum and mean of its completion tokens' log-probabilities,
exactly what the unpacked sequence gives (float64: within 1e-10), in tiles (:mod:`packkit.logps`: no
``[tokens, vocab]`` log-softmax); :func:`forward_logps` runs the model with its LM head fused into them, so
that the logits are never made (what TRL's trainers do unpacked). :func:`dpo_loss` is TRL's sigmoid DPO
loss on them.

Collators: :class:`PreferenceCollator` takes TRL's preference format (``prompt`` / ``chosen`` /
``rejected``, text or conversations, tokenized here as TRL's ``DPOTrainer`` does:
:func:`tokenize_preference`) or its tokenized columns (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``);
:class:`GroupCollator` takes ``prompt_ids`` with ``completion_ids`` (a list of ``k`` lists) and optional
per-completion values (``advantages``...). :func:`shard_groups` splits a generation batch of groups into
micro-batches so that every rank gets the same number of micro-batches and none is empty (TRL PR #7328
found ranks starved when a micro-batch held fewer groups than ranks).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .arrow import pyarrow
from .batch import additive_mask, layer_types, mask_dtype, sliding_window, text_config
from .binpack import check_strategy, check_window, pack
from .collate import padding_free_batch, row_destinations, rows_batch
from .errors import ArgumentError, ArgumentTypeError, DataError, Where, arg, check_choice, check_int
from .examples import read_column
from .integrations.transformers import attn_implementation
from .integrations.trl import DPOLossHook  # TRL's private loss hook, config and metrics, in one place
from .logps import logits_logps, scored_logps, segment_sums
from .located import location
from .row_rules import check_groups, example_values, relocate_part
from .rules import as_lengths, check_values
from .segments import (IGNORE_INDEX, common_prefix_lengths, lengths_to_offsets, lengths_to_position_ids,
                       lengths_to_seq_idx, range_index)

__all__ = ["LAYOUTS", "PackedDPOMixin", "SequenceBatch", "SequenceLogps", "build_groups", "sequence_logps", "token_logps",
           "forward_logps",
           "dpo_loss",
           "PreferenceCollator", "GroupCollator", "tokenize_preference", "tokenize_pairs", "shard_groups",
           "tree_tokens"]

#: ``"pairs"``: each continuation its own sequence with its prompt; ``"tree"``: the prompt once.
LAYOUTS = ("pairs", "tree")


def check_layout(layout) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else an error naming the choices."""
    return check_choice(layout, "layout", LAYOUTS)


def tree_tokens(prompt, continuations, *, layout: str = "tree") -> np.ndarray:
    """Tokens a group costs in ``layout``: ``tree_tokens([3], [[2, 4]]) -> [9]`` (``"pairs"``: ``[12]``).

    Args:
        prompt: (G,) prompt lengths; continuations: (G, k) lengths, or a ragged list of lists.
    Returns:
        (G,) int64: ``prompt + sum(continuations)`` (tree) or ``k * prompt + sum(continuations)`` (pairs).
    """
    prompt = np.asarray(prompt, np.int64)
    k = np.array([len(c) for c in continuations], np.int64)
    total = np.array([int(np.sum(c)) for c in continuations], np.int64)
    return prompt * (1 if check_layout(layout) == "tree" else k) + total


def varlen_recipe(kv_starts, kv_lengths, q_len, k_len, device) -> dict:
    """The fields of a varlen call over gathered keys (``varlen_kwargs`` of a tree's batch): ``kv_index``, the
    runs ``[kv_starts, kv_starts + kv_lengths)`` laid end to end (int64 ``[K]``), ``cu_seqlens_q`` / ``cu_seqlens_k``
    of the query and key segments' lengths (int32), ``max_seqlen_q`` / ``max_seqlen_k`` (host ints).
    ``varlen_recipe([0, 0, 2], [2, 1, 1], [2, 1], [2, 2], "cpu")["kv_index"] -> [0, 1, 0, 2]``."""
    q_len, k_len = np.asarray(q_len, np.int64), np.asarray(k_len, np.int64)
    kv_index = range_index(np.asarray(kv_starts, np.int64), np.asarray(kv_lengths, np.int64))
    return {"kv_index": torch.from_numpy(kv_index).to(device),
            "cu_seqlens_q": torch.from_numpy(lengths_to_offsets(q_len).astype(np.int32)).to(device),
            "cu_seqlens_k": torch.from_numpy(lengths_to_offsets(k_len).astype(np.int32)).to(device),
            "max_seqlen_q": int(q_len.max(initial=0)), "max_seqlen_k": int(k_len.max(initial=0))}


# ----------------------------------------------------------------------------------------------
# the batch
# ----------------------------------------------------------------------------------------------


class SequenceBatch(dict):
    """Packed groups (prompt + continuations) and what a sequence-level loss reads: a ``dict`` (so that
    ``transformers.Trainer`` moves and rebuilds it as it does any batch) whose items are also attributes.
    Not a model's keyword arguments: ``model(**batch.model_inputs(model))``.

    Tensors (``B`` rows of ``L`` tokens: ``[1, T]`` padding-free, or ``[B, W]`` windows):

    input_ids:      int64 ``[B, L]``
    position_ids:   int64 ``[B, L]``, from 0 per sequence (pairs) or per tree, continuations after the prompt
    labels:         int64 ``[B, L]``, the continuation tokens whose predictor is the token before them in the
                    row (every scored token in ``"pairs"``; in ``"tree"`` not the first token of a later
                    continuation), ``-100`` elsewhere: for an NLL term with a shifting loss
    seq_idx:        int32 ``[B, L]``, the segment (a sequence, a tree, or a row's padding tail) of each token
    sequence_ids:   int64 ``[B, L]``, the sequence of each token: ``-1`` on padding and on a tree's prompt
    branch_ids:     int64 ``[B, L]``, ``n + 1`` on the tokens of continuation ``n``, 0 on prompts and padding
    cu_seqlens:     int32 ``[S + 1]``, the segments over the row-major flattened batch; ``max_seqlen``: int
    score_source:   int64 ``[M]``, flat index (into ``B * L``) of the logits that predict each scored token
    score_target:   int64 ``[M]``, flat index of each scored token
    score_sequence: int64 ``[M]``, its sequence
    num_tokens:     int64 ``[N]``, scored tokens of each sequence
    group_ptr:      int64 ``[G + 1]``, group ``g`` is sequences ``group_ptr[g]:group_ptr[g + 1]`` (a pair:
                    chosen then rejected)
    sequence_values: dict of float64 ``[N]``, per-sequence values given with the examples (``advantages``...)
    layout:         ``"pairs"`` or ``"tree"``; ``num_real_tokens``: int, tokens that are not padding

    Sequences are numbered in group order (the order of the examples), whatever the packing order.
    """

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def num_sequences(self) -> int:
        return int(self["num_tokens"].shape[0])

    @property
    def num_groups(self) -> int:
        return int(self["group_ptr"].shape[0] - 1)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self["input_ids"].shape)

    def to(self, device, non_blocking: bool = False) -> "SequenceBatch":
        """The batch on ``device`` (a new batch; ``max_seqlen`` and ``layout`` stay host values)."""
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device, non_blocking=non_blocking)
            return {k: move(x) for k, x in v.items()} if isinstance(v, dict) else v

        return type(self)({k: move(v) for k, v in self.items()})

    # -- masks --------------------------------------------------------------------------------

    def dense_mask(self) -> torch.Tensor:
        """``[B, L, L]`` bool, True where query ``q`` may attend key ``k``: same segment, ``k <= q``, and ``k``
        on the prompt or on ``q``'s own continuation. For SDPA's ``attn_mask`` (``mask[:, None]``) and
        FlexAttention; a Hugging Face model takes :meth:`hf_mask`. Quadratic in ``L``."""
        seg, br = self.seq_idx, self.branch_ids
        length = seg.shape[-1]
        pos = torch.arange(length, device=seg.device)
        causal = pos[None, :] <= pos[:, None]
        same = seg[:, :, None] == seg[:, None, :]
        branch = (br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])
        return same & causal & branch

    def hf_mask(self, model, *, dtype: torch.dtype | None = None):
        """The additive float mask ``[B, 1, L, L]`` (0 where :meth:`dense_mask` allows, the dtype's minimum
        elsewhere) that eager and sdpa attention of a Hugging Face model add to the scores as given.

        An explicit mask replaces the model's own sliding window, so sliding-window layers get it here:
        ``q - k < config.sliding_window`` in the batch's positions (a continuation's distance to its prompt
        is what it would be unpacked). A model mixing full and sliding layers (``config.layer_types``) gets a
        dict ``{"full_attention": mask, "sliding_attention": mask}``, which such models take per layer.

        ``model``: a ``PreTrainedModel`` or its config. ``dtype``: the scores' dtype (default as in
        :meth:`packkit.batch.PackedBatch.hf_mask`). Refused for attention implementations that take no
        such mask and for other layer kinds (chunked, linear), whose masks it cannot build.
        """
        config = text_config(model)
        impl = attn_implementation(config)
        if impl not in (None, "eager", "sdpa"):
            raise ArgumentError(f"hf_mask is the mask of eager and sdpa attention; this model uses "
                                f"attn_implementation={impl!r}: call model_inputs(model), which picks the view")
        types = layer_types(config)
        other = sorted(types - {"full_attention", "sliding_attention"})
        if other:
            raise ArgumentError(f"the model has {other} layers, whose masks a tree cannot give: use layout='pairs' "
                                "(the model builds its own masks from the positions)")
        window = sliding_window(config, types)
        dtype = mask_dtype(model, config, dtype)
        allowed, pos = self.dense_mask(), self.position_ids
        masks = {}
        for kind in sorted(types):
            ok = allowed if kind == "full_attention" else allowed & ((pos[:, :, None] - pos[:, None, :]) < window)
            masks[kind] = additive_mask(ok, dtype)
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def mask_mod(self):
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of :meth:`dense_mask` (index tensors
        broadcast: ``mask_mod(b, 0, q[:, None], k[None, :])`` is row ``b`` of the dense mask)."""
        seg, br = self.seq_idx, self.branch_ids

        def tree_causal(b, h, q_idx, kv_idx):
            k_branch = br[b, kv_idx]
            return ((seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)
                    & ((k_branch == 0) | (k_branch == br[b, q_idx])))

        return tree_causal

    def block_mask(self, *, BLOCK_SIZE: int = 128):
        """A FlexAttention ``BlockMask`` of :meth:`dense_mask` (flex is imported lazily: optional)."""
        from torch.nn.attention.flex_attention import create_block_mask

        batch, length = self.seq_idx.shape
        return create_block_mask(self.mask_mod(), batch, None, length, length, device=self.seq_idx.device,
                                 BLOCK_SIZE=BLOCK_SIZE)

    def varlen_kwargs(self) -> dict:
        """The varlen recipe: query segments, and the key/value tokens each reads, for a varlen kernel.

        Every segment is a query segment, except that in a tree each continuation after the first starts its
        own; its keys are the prompt's tokens followed by its own (gathered: ``k_var = k_flat[kv_index]``), and
        causality is aligned bottom-right (flash-attn >= 2.1 ``causal=True`` with ``seqlen_q <= seqlen_k``)::

            k_var, v_var = k.flatten(0, 1)[kw["kv_index"]], v.flatten(0, 1)[kw["kv_index"]]
            out = flash_attn_varlen_func(q.flatten(0, 1), k_var, v_var, kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                         kw["max_seqlen_q"], kw["max_seqlen_k"], causal=True)

        Returns ``kv_index`` int64 ``[K]``, ``cu_seqlens_q`` / ``cu_seqlens_k`` int32, ``max_seqlen_q`` /
        ``max_seqlen_k`` int (host values). In ``"pairs"`` it is the plain varlen call (``kv_index`` the identity).
        """
        seg = self.seq_idx.reshape(-1).cpu().numpy()
        br = self.branch_ids.reshape(-1).cpu().numpy()
        n = seg.size
        new = np.ones(n, bool)
        new[1:] = (seg[1:] != seg[:-1]) | ((br[1:] != br[:-1]) & (br[:-1] != 0))
        q_start = np.flatnonzero(new)
        q_len = np.diff(np.append(q_start, n))
        unit_start = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        prompt = np.bincount(seg, weights=(br == 0), minlength=seg.max() + 1 if n else 0).astype(np.int64)
        later = q_start != unit_start[seg[q_start]]  # a continuation after the first: reads the prompt first
        pre_start = unit_start[seg[q_start]]
        pre_len = np.where(later, prompt[seg[q_start]], 0)
        starts = np.stack([pre_start, q_start], 1).reshape(-1)
        lens = np.stack([pre_len, q_len], 1).reshape(-1)
        return varlen_recipe(starts, lens, q_len, pre_len + q_len, self.input_ids.device)

    def model_inputs(self, model=None) -> dict:
        """Keyword arguments for a Hugging Face causal LM: ``logits = model(**batch.model_inputs(model)).logits``.

        ``"pairs"``: ``input_ids``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``,
        ``use_cache=False`` and no mask (the packed view, :class:`packkit.batch.PackedBatch`: every
        attention implementation finds the sequences). ``"tree"``: ``input_ids``, ``position_ids``,
        ``use_cache=False`` and ``attention_mask``: :meth:`hf_mask` for eager and sdpa, :meth:`block_mask`
        for flex_attention; flash attention takes no mask and is refused (use ``"pairs"``, or
        :meth:`varlen_kwargs` in your own attention). No labels: the loss reads :func:`sequence_logps`.
        """
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.layout == "pairs":
            cu = self.cu_seqlens
            out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=self.max_seqlen, max_length_k=self.max_seqlen)
            return out
        if model is None:
            raise ArgumentError("layout='tree' needs the model to build its mask: pass model_inputs(model)")
        impl = attn_implementation(text_config(model))
        if impl == "flex_attention":
            out["attention_mask"] = self.block_mask()
        elif impl in (None, "eager", "sdpa"):
            out["attention_mask"] = self.hf_mask(model)
        else:
            raise ArgumentError(f"layout='tree' needs a mask, and attn_implementation={impl!r} takes none: load the "
                                "model with 'sdpa', 'eager' or 'flex_attention', or use layout='pairs'")
        return out

    def __repr__(self) -> str:
        return (f"SequenceBatch(layout={self.layout!r}, shape={list(self.shape)}, groups={self.num_groups}, "
                f"sequences={self.num_sequences}, scored_tokens={int(self.score_target.shape[0])})")


# ----------------------------------------------------------------------------------------------
# building a batch from token arrays
# ----------------------------------------------------------------------------------------------


def _pieces(layout, order, p_len, p_start, c_len, c_start, c_ptr):
    """The layout as pieces in row order: ``(start, length, is_continuation, sequence, unit)`` arrays.

    ``order``: the units in packing order (``"pairs"``: sequences; ``"tree"``: groups). Example, one group with
    prompt 2 and continuations 2, 1: pairs -> pieces ``P C0 P C1``; tree -> ``P C0 C1``.
    """
    if layout == "pairs":
        group = lengths_to_seq_idx(np.diff(c_ptr))[order]
        start = np.stack([p_start[group], c_start[order]], 1).reshape(-1)
        length = np.stack([p_len[group], c_len[order]], 1).reshape(-1)
        is_cont = np.tile([False, True], order.size)
        seq = np.repeat(order, 2)
        unit = np.repeat(np.arange(order.size), 2)
        return start, length, is_cont, seq, unit
    k = np.diff(c_ptr)[order]
    count = k + 1
    unit = lengths_to_seq_idx(count)
    j = lengths_to_position_ids(count)
    group = order[unit]
    is_cont = j > 0
    seq = np.where(is_cont, c_ptr[group] + j - 1, -1)
    start = np.where(is_cont, c_start[np.maximum(seq, 0)], p_start[group])
    length = np.where(is_cont, c_len[np.maximum(seq, 0)], p_len[group])
    return start, length, is_cont, seq, unit


def _sequence_values(v, name: str, k: np.ndarray, where) -> np.ndarray:
    """``values[name]`` of :func:`build_groups`, ``(N,)`` float64 one per completion (group after group),
    checked by the per-example rule (:func:`packkit.row_rules.example_values`: finite, errors naming the group)."""
    v = np.asarray(v)
    if v.ndim != 1 or v.size != int(k.sum()):
        raise ValueError(f"values[{name!r}] has shape {list(v.shape)} for {int(k.sum())} completions; pass one number "
                         "per completion, group after group")
    return example_values(np.split(v, np.cumsum(k)[:-1]), k, key=name, rows=where)


def _check_groups_input(prompt_ids, prompt_lengths, completion_ids, completion_lengths, completions_per_group,
                        values, where, keys):
    """:func:`build_groups`' arguments checked: ``(tokens, p_len, p_start, c_len, c_start, k, c_ptr, values)``,
    the prompts then the completions back to back in ``tokens`` (int64), ``*_start`` their offsets there."""
    p_len = np.asarray(prompt_lengths, np.int64)
    c_len = np.asarray(completion_lengths, np.int64)
    k = np.asarray(completions_per_group, np.int64)
    c_ptr = lengths_to_offsets(k)
    if k.size != p_len.size or int(c_ptr[-1]) != c_len.size:
        raise ValueError(f"{p_len.size} prompts, {k.size} group sizes and {c_len.size} completions (the sizes sum to "
                         f"{int(c_ptr[-1])}) do not describe the same groups")
    check_groups(p_len, c_len, k, rows=where, keys=keys)
    p_vals, c_vals = np.asarray(prompt_ids), np.asarray(completion_ids)
    check_values(p_vals, lengths=p_len, kind="ids", key="prompt_ids", rows=where, empty_ok=True)
    try:  # errors about the n-th completion told about its group
        check_values(c_vals, lengths=c_len, kind="ids", key="completion_ids")
    except DataError as exc:
        raise relocate_part(exc, k, rows=where, keys=keys) from None
    values_np = {name: _sequence_values(v, name, k, where) for name, v in (values or {}).items()}
    p_vals = p_vals.astype(np.int64, copy=False)
    tokens = np.concatenate([p_vals, c_vals.astype(np.int64, copy=False)])
    p_start = lengths_to_offsets(p_len)[:-1]
    c_start = lengths_to_offsets(c_len)[:-1] + p_vals.size
    return tokens, p_len, p_start, c_len, c_start, k, c_ptr, values_np


def _plan_units(layout, p_len, c_len, k, c_ptr, *, window, strategy, where):
    """``(unit_len, order, window_ptr)``: the units' lengths (``"pairs"``: sequences; ``"tree"``: groups), their
    packing order, and ``window_ptr`` (``None`` for one ``[1, T]`` row: the units in order)."""
    group_of_seq = lengths_to_seq_idx(k)
    if layout == "pairs":
        unit_len = p_len[group_of_seq] + c_len
    else:
        unit_len = p_len + np.add.reduceat(c_len, c_ptr[:-1]) if k.size else np.zeros(0, np.int64)
    if window is None:
        return unit_len, np.arange(unit_len.size, dtype=np.int64), None
    window = check_window(window)
    group_len = unit_len if layout == "tree" else np.bincount(group_of_seq, weights=unit_len,
                                                              minlength=k.size).astype(np.int64)
    over = np.flatnonzero(group_len > window)
    if over.size:
        g = int(over[0])
        fix = ", use layout='tree' (the prompt once)" if layout == "pairs" else ""
        raise DataError("{at} has {n:,} tokens in layout={layout!r} > {w}; raise {wn}{fix} or shorten it "
                        "(TRL's max_length)", at=location(g, where), n=int(group_len[g]), layout=layout,
                        w=arg("window", window), wn=arg("window"), fix=fix)
    plan = pack(unit_len, window=window, strategy=strategy, **({"group_sizes": k} if layout == "pairs" else {}))
    return unit_len, plan.seg_example, plan.window_ptr


def _lay_tokens(layout, tokens, order, unit_len, p_len, p_start, c_len, c_start, k, c_ptr) -> dict:
    """Per token in row order (numpy, ``(T,)``): ``ids``, ``position``, ``sequence`` (``-1`` on a tree's prompt),
    ``branch``, ``seq`` (the continuation's sequence, ``-1`` on prompts), ``scored``, ``source`` (flat index of
    the token whose logits predict it) and ``labels`` (the scored tokens predicted by the token before them)."""
    start, length, is_cont, seq, unit = _pieces(layout, order, p_len, p_start, c_len, c_start, c_ptr)
    piece = lengths_to_seq_idx(length)
    within = lengths_to_position_ids(length)
    ids = tokens[start[piece] + within]
    unit_off = lengths_to_offsets(unit_len[order])
    tok_unit = unit[piece]
    group_of_unit = lengths_to_seq_idx(k)[order] if layout == "pairs" else order
    plen_tok = p_len[group_of_unit[tok_unit]]
    cont = is_cont[piece]
    tok_seq = seq[piece]
    flat = np.arange(ids.size, dtype=np.int64)
    scored = cont & ((within > 0) | (plen_tok > 0))
    source = np.where(within > 0, flat - 1, unit_off[:-1][tok_unit] + plen_tok - 1)
    return {"ids": ids, "position": np.where(cont, plen_tok + within, within), "seq": tok_seq,
            "sequence": tok_seq if layout == "pairs" else np.where(cont, tok_seq, -1),
            "branch": np.where(cont, tok_seq + 1, 0), "scored": scored, "source": source,
            "labels": np.where(scored & (source == flat - 1), ids, IGNORE_INDEX)}


def build_groups(prompt_ids, prompt_lengths, completion_ids, completion_lengths, completions_per_group, *,
                 layout: str = "pairs", window: int | None = None, num_windows: int | None = None,
                 strategy: str = "bfd", pad_token_id: int = 0, values: dict | None = None,
                 where=None, keys=None) -> SequenceBatch:
    """Pack groups (a prompt and its completions) into one :class:`SequenceBatch`.

    Args:
        prompt_ids: (sum of prompt lengths,) int, the prompts back to back; prompt_lengths: (G,) int >= 0.
        completion_ids: (sum of completion lengths,) int; completion_lengths: (N,) int >= 1, group after group.
        completions_per_group: (G,) int >= 1 (2 for a preference pair: chosen, then rejected).
        layout: ``"pairs"`` or ``"tree"`` (module docstring).
        window: ``None``: one ``[1, T]`` row, groups in order; else ``[B, W]`` windows planned by ``strategy``
            over whole groups (a group longer than ``W`` is an error naming it). num_windows: fixed ``B``.
        values: ``{name: (N,) float}``, per-sequence values carried along (``advantages``...).
        where: the dataset rows of the groups (errors name them), or None.
        keys: the completions' keys in errors (``("chosen_ids", "rejected_ids")`` for pairs), or None
            (``'completion_ids' (completion j)``). A group must have something to score
            (:func:`packkit.row_rules.check_groups`).

    Example: ``build_groups([1, 2], [2], [3, 4, 5], [2, 1], [2], layout="tree")`` gives ``input_ids
    [[1, 2, 3, 4, 5]]``, ``position_ids [[0, 1, 2, 3, 2]]`` and scores token 3 from position 1, 4 from 2,
    5 from 1.
    """
    layout = check_layout(layout)
    tokens, p_len, p_start, c_len, c_start, k, c_ptr, values_np = _check_groups_input(
        prompt_ids, prompt_lengths, completion_ids, completion_lengths, completions_per_group, values, where, keys)
    unit_len, order, window_ptr = _plan_units(layout, p_len, c_len, k, c_ptr, window=window, strategy=strategy,
                                              where=where)
    t = _lay_tokens(layout, tokens, order, unit_len, p_len, p_start, c_len, c_start, k, c_ptr)
    # -- rows: one [1, T] row, or [B, W] windows (each window's padding tail its own segment) --
    total = int(t["ids"].size)
    if window_ptr is None:
        packed = padding_free_batch(t["ids"], t["labels"].copy(), unit_len[order])
        dest, width = np.arange(total, dtype=np.int64), total
    else:
        packed = rows_batch(t["ids"], t["labels"], unit_len[order], window_ptr, width=window, num_rows=num_windows,
                            pad_token_id=pad_token_id)
        unit_off = lengths_to_offsets(unit_len[order])
        dest, width = row_destinations(unit_off[window_ptr[1:]] - unit_off[window_ptr[:-1]], window), window
    rows = packed.input_ids.shape[0]

    def laid(values_, fill):
        buf = np.full(rows * width, fill, np.int64) if np.isscalar(fill) else fill.reshape(-1).numpy().copy()
        buf[dest] = values_
        return torch.from_numpy(buf.reshape(rows, width))

    sel = np.flatnonzero(t["scored"])
    seq_idx = lengths_to_seq_idx(np.diff(packed.cu_seqlens.numpy()))  # numpy: torch.searchsorted is 30x slower
    return SequenceBatch(
        input_ids=packed.input_ids,
        position_ids=laid(t["position"], packed.position_ids) if layout == "tree" else packed.position_ids,
        labels=packed.labels, seq_idx=torch.from_numpy(seq_idx.reshape(rows, width)),
        sequence_ids=laid(t["sequence"], -1), branch_ids=laid(t["branch"], 0), cu_seqlens=packed.cu_seqlens,
        max_seqlen=packed.max_seqlen, score_source=torch.from_numpy(dest[t["source"][sel]]),
        score_target=torch.from_numpy(dest[sel]), score_sequence=torch.from_numpy(t["seq"][sel]),
        num_tokens=torch.from_numpy(np.bincount(t["seq"][sel], minlength=c_len.size).astype(np.int64)),
        group_ptr=torch.from_numpy(c_ptr), layout=layout, num_real_tokens=total,
        sequence_values={name: torch.from_numpy(v) for name, v in values_np.items()})


# ----------------------------------------------------------------------------------------------
# log-probabilities and the DPO loss
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SequenceLogps:
    """Per sequence, in group order: ``sum`` and ``mean`` ``[N]`` of the completion tokens' log-probabilities
    (float32, or the logits' dtype when wider), ``num_tokens`` int64 ``[N]``; ``tokens`` ``[M]``, every scored
    token's, in the batch's scoring order (``batch.score_sequence`` names each one's sequence). For pairs (two
    sequences a group), ``chosen`` / ``rejected`` are the sums and ``chosen_mean`` / ``rejected_mean`` the means
    ``[P]``."""

    sum: torch.Tensor
    mean: torch.Tensor
    num_tokens: torch.Tensor
    tokens: torch.Tensor | None = None

    @classmethod
    def of_tokens(cls, per_token: torch.Tensor, batch: "SequenceBatch") -> "SequenceLogps":
        """Summed per sequence (:func:`packkit.logps.segment_sums`)."""
        total = segment_sums(per_token, batch.score_sequence, batch.num_sequences)
        count = batch.num_tokens.to(total.device)
        return cls(sum=total, mean=total / count.clamp(min=1).to(total.dtype), num_tokens=count, tokens=per_token)

    def _pair(self, x: torch.Tensor, j: int) -> torch.Tensor:
        if x.shape[0] % 2:
            raise ValueError(f"{x.shape[0]} sequences are not pairs: chosen/rejected need two sequences a group")
        return x.view(-1, 2)[:, j]

    @property
    def chosen(self) -> torch.Tensor:
        return self._pair(self.sum, 0)

    @property
    def rejected(self) -> torch.Tensor:
        return self._pair(self.sum, 1)

    @property
    def chosen_mean(self) -> torch.Tensor:
        return self._pair(self.mean, 0)

    @property
    def rejected_mean(self) -> torch.Tensor:
        return self._pair(self.mean, 1)


def _scored(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, target)`` of the batch's scored tokens: flat indices of the predicting positions, token ids."""
    if not isinstance(batch, SequenceBatch):
        raise TypeError(f"batch must be the SequenceBatch the logits were computed from (a PreferenceCollator or "
                        f"GroupCollator batch), got {type(batch).__name__}")
    return batch.score_source, batch.input_ids.reshape(-1)[batch.score_target]


def token_logps(logits: torch.Tensor, batch: SequenceBatch, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of every scored token, ``[M]`` in the batch's scoring order (``batch.score_sequence``
    names each one's sequence; tokens of a sequence in order): what a token-level loss (GRPO's clipped
    ratios) reads. Float32 for half-precision logits, else the logits' dtype.

    ``logits``: ``[B, L, V]`` of ``model(**batch.model_inputs(model))``. Only the ``M`` scored positions are
    read (``batch.score_source``: in a tree the first token of every continuation reads the prompt's last
    token), in tiles (:func:`packkit.logps.logits_logps`): no ``[M, V]`` log-softmax is made, in the forward or
    the backward. :func:`forward_logps` also keeps the model from making the logits.
    """
    source, target = _scored(batch)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(batch.input_ids.shape):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for a batch of {tuple(batch.input_ids.shape)}: "
                         "pass the [B, L, V] logits of model(**batch.model_inputs(model))")
    return logits_logps(logits, source, target, temperature=temperature)


def sequence_logps(logits: torch.Tensor, batch: SequenceBatch, *, temperature: float = 1.0) -> SequenceLogps:
    """Sum and mean of every sequence's completion log-probabilities from packed logits (:func:`token_logps`
    summed per sequence), in group order.

    Equal to the unpacked computation (TRL's: ``log_softmax(logits[:, :-1])`` gathered at the next tokens
    under the completion mask, summed per row).
    """
    return SequenceLogps.of_tokens(token_logps(logits, batch, temperature=temperature), batch)


def forward_logps(model, batch: SequenceBatch, *, temperature: float = 1.0):
    """``(SequenceLogps, outputs)``: ``model`` run on the batch with its LM head fused into the log-probabilities
    (:func:`packkit.logps.scored_logps`): the ``[B, L, V]`` logits are never made, only tiles of the scored
    tokens' (``outputs.logits`` holds the last position's). The same values as
    ``sequence_logps(model(**batch.model_inputs(model)).logits, batch)``, at the memory of a tile.
    """
    source, target = _scored(batch)
    per_token, outputs = scored_logps(model, batch.model_inputs(model), source, target, temperature=temperature)
    return SequenceLogps.of_tokens(per_token, batch), outputs


def dpo_loss(policy: SequenceLogps, reference: SequenceLogps, *, beta: float = 0.1) -> torch.Tensor:
    """TRL's sigmoid DPO loss (``DPOConfig(loss_type="sigmoid")``, the default), averaged over pairs:
    ``-logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))``."""
    if policy.sum.shape != reference.sum.shape:
        raise ValueError(f"policy has {policy.sum.shape[0]} sequences and reference {reference.sum.shape[0]}: compute "
                         "both from the same batch")
    delta = (policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)
    return -torch.nn.functional.logsigmoid(beta * delta).mean()


class PackedDPOMixin(DPOLossHook):
    """TRL's ``DPOTrainer`` on packed pairs: mix it in first and pass a :class:`PreferenceCollator`::

        class PackedDPOTrainer(PackedDPOMixin, trl.DPOTrainer):
            pass

        trainer = PackedDPOTrainer(model=model, ref_model=ref, args=DPOConfig(..., max_length=None),
                                   train_dataset=ds, processing_class=tok,
                                   data_collator=PreferenceCollator(layout="tree", window=4096))

    The trainer tokenizes the dataset as usual (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``); the loss is
    computed from :func:`forward_logps` of the policy and the reference model on the packed batch (the LM head
    fused, as TRL's own: no ``[tokens, vocab]`` logits, so packing costs no memory), with :func:`dpo_loss`: TRL's default sigmoid loss, the same value as ``DPOTrainer`` on the padded batch. What this
    path does not compute (other ``loss_type``\\ s, ``f_divergence_type``, ``ld_alpha``, ``use_weighting``, MoE
    auxiliary losses, precomputed or PEFT-adapter reference log-probabilities) is refused in one line, not
    approximated. The packed collator never truncates: set ``max_length=None`` (TRL's collator would cut long
    pairs; a pair longer than the collator's window is an error naming it).
    """

    def _packed_dpo_loss(self, model, ref_model, inputs, *, beta: float):
        """``(loss, outputs, policy, reference)`` of a packed batch: :func:`dpo_loss` of the policy's and the
        reference's :func:`forward_logps` (TRL's side, its config and metrics: :class:`DPOLossHook`)."""
        if not isinstance(inputs, SequenceBatch):
            raise TypeError(f"PackedDPOMixin takes packed batches, got {type(inputs).__name__}: pass "
                            "data_collator=packkit.preference.PreferenceCollator(...)")
        policy, outputs = forward_logps(model, inputs)
        with torch.no_grad():
            reference, _ = forward_logps(ref_model, inputs)
        return dpo_loss(policy, reference, beta=beta), outputs, policy, reference


# ----------------------------------------------------------------------------------------------
# TRL's tokenization of preference data
# ----------------------------------------------------------------------------------------------


def _encode(tok, x, **template_kwargs) -> list:
    """One text (``tokenizer(text)``) or conversation (``apply_chat_template``), as TRL's ``_tokenize``."""
    if isinstance(x, str):
        return list(tok(text=x)["input_ids"])
    out = tok.apply_chat_template(list(x), tokenize=True, return_dict=True, **template_kwargs)
    return list(out["input_ids"])


def tokenize_preference(examples, tokenizer) -> list[dict]:
    """``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` of TRL preference examples, as TRL 1.16's
    ``DPOTrainer`` makes them.

    Text: EOS appended to ``chosen`` / ``rejected`` when they do not end with it, then ``tokenizer(prompt)``,
    ``tokenizer(prompt + chosen)``, ``tokenizer(prompt + rejected)``. Conversations: the chat template over the
    prompt (with the generation prompt) and over prompt + chosen, prompt + rejected (``tools`` and
    ``chat_template_kwargs`` per example passed on). The completions start where both tokenized sequences stop
    sharing the tokenized prompt (:func:`packkit.segments.common_prefix_lengths`).

    ``examples``: a list of dicts (or a ``datasets.Dataset``). Returns a list of dicts with the three columns.
    ``tokenizer``: a loaded ``transformers`` tokenizer.
    """
    out = []
    for i, ex in enumerate(examples):
        for key in ("prompt", "chosen", "rejected"):
            if ex.get(key) is None:
                fix = (" (TRL's implicit-prompt format: extract it with trl.data_utils.extract_prompt)"
                       if key == "prompt" else "; a preference pair is 'prompt', 'chosen' and 'rejected', text or "
                       "conversations (or their tokenized prompt_ids, chosen_ids and rejected_ids)")
                raise DataError("{i} has no {key!r}{fix}", i=Where(i), key=key, fix=fix)
        prompt, chosen, rejected = ex["prompt"], ex["chosen"], ex["rejected"]
        if isinstance(prompt, str) != isinstance(chosen, str) or isinstance(chosen, str) != isinstance(rejected, str):
            raise DataError("{i}: 'prompt', 'chosen' and 'rejected' must all be text or all be conversations", i=Where(i))
        kwargs = {}
        if not isinstance(prompt, str):
            tools = ex.get("tools")
            if isinstance(tools, str):
                import json  # stdlib, only for this rare column

                tools = json.loads(tools)
            kwargs = {"tools": tools, **(ex.get("chat_template_kwargs") or {})}
            p = _encode(tokenizer, prompt, add_generation_prompt=True, **kwargs)
            pc = _encode(tokenizer, list(prompt) + list(chosen), **kwargs)
            pr = _encode(tokenizer, list(prompt) + list(rejected), **kwargs)
        else:
            eos = tokenizer.eos_token
            if not eos:
                raise ArgumentError(f"example {i} is text and the tokenizer has no EOS token (eos_token is "
                                    f"{eos!r}): TRL's DPOTrainer ends every text reply with it, so the replies would "
                                    "end without one; set tokenizer.eos_token to the model's end-of-turn token, or "
                                    "pass conversations (the chat template ends them)")
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
            p, pc, pr = (_encode(tokenizer, prompt), _encode(tokenizer, prompt + chosen),
                         _encode(tokenizer, prompt + rejected))
        shared = common_prefix_lengths([0, len(p), 2 * len(p)], p + p, [0, len(pc), len(pc) + len(pr)], pc + pr)
        n = int(shared.min())
        out.append({"prompt_ids": p[:n], "chosen_ids": pc[n:], "rejected_ids": pr[n:]})
    return out


def tokenize_pairs(table, tokenizer, *, trust_remote_code: bool = False):
    """:func:`tokenize_preference` over a ``pyarrow.Table`` of text or conversational ``prompt`` / ``chosen`` /
    ``rejected`` pairs (``tools`` and ``chat_template_kwargs`` passed on), in one pass: a table of TRL's
    ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (list<int32>), what ``packkit tokenize`` writes and ``packkit
    waste --preference`` measures. ``tokenizer``: as :func:`packkit.tokenizer.load_tokenizer` takes it (a folder or
    a model id)."""
    from .tokenizer import load_tokenizer  # lazy: the tokenizers, for pairs to tokenize only
    pa = pyarrow("tokenizing preference pairs")
    tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
    keep = [c for c in ("prompt", "chosen", "rejected", "tools", "chat_template_kwargs") if c in table.column_names]
    rows = tokenize_preference(table.select(keep).to_pylist(), tok)
    return pa.table({c: pa.array([r[c] for r in rows], pa.list_(pa.int32())) for c in PreferenceCollator.KEYS})


# ----------------------------------------------------------------------------------------------
# collators
# ----------------------------------------------------------------------------------------------


class _GroupsCollator:
    """What both collators share: the layout and windows of the batch, built by :func:`build_groups`."""

    def __init__(self, *, layout: str, window: int | None, num_windows: int | None, strategy: str, pad_token_id: int):
        self.layout = check_layout(layout)
        self.window = None if window is None else check_window(window)
        self.num_windows = None if num_windows is None else check_int(num_windows, "num_windows")
        self.strategy = check_strategy(strategy)
        self.pad_token_id = int(pad_token_id)

    def _build(self, prompt_ids, prompt_lengths, completion_ids, completion_lengths, k, **options) -> SequenceBatch:
        return build_groups(prompt_ids, prompt_lengths, completion_ids, completion_lengths, k, layout=self.layout,
                            window=self.window, num_windows=self.num_windows, strategy=self.strategy,
                            pad_token_id=self.pad_token_id, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layout={self.layout!r}, window={self.window}, num_windows={self.num_windows})"


class PreferenceCollator(_GroupsCollator):
    """TRL preference examples -> a packed :class:`SequenceBatch` (two sequences a pair: chosen, rejected).

    ``PreferenceCollator(layout="tree")([{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}])``
    gives ``input_ids [[1, 2, 3, 4, 5]]``, ``position_ids [[0, 1, 2, 3, 2]]``.

    Args:
        layout: ``"pairs"`` (default: every sequence with its own prompt copy, no mask needed) or ``"tree"``
            (the prompt once, an explicit mask).
        window: ``None`` (default): one ``[1, T]`` row. An int ``W``: ``[B, W]`` windows, pairs packed whole
            by ``strategy`` (a pair longer than ``W`` is an error naming it). num_windows: a fixed ``B``.
        tokenizer: a loaded ``transformers`` tokenizer: examples may then be raw TRL rows (``prompt`` /
            ``chosen`` / ``rejected``, text or conversations), tokenized as ``DPOTrainer`` does
            (:func:`tokenize_preference`). Without it they carry ``prompt_ids`` / ``chosen_ids`` /
            ``rejected_ids`` (what ``DPOTrainer`` tokenizes a dataset into).
        pad_token_id: the id of padding in windows.
    """

    KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")

    def __init__(self, *, layout: str = "pairs", window: int | None = None, num_windows: int | None = None,
                 strategy: str = "bfd", tokenizer=None, pad_token_id: int = 0):
        super().__init__(layout=layout, window=window, num_windows=num_windows, strategy=strategy,
                         pad_token_id=pad_token_id)
        self.tokenizer = tokenizer

    def __call__(self, examples) -> SequenceBatch:
        examples = list(examples)
        if not examples:
            raise ValueError("a collator needs at least one example")
        if self.tokenizer is not None and "prompt_ids" not in examples[0]:
            examples = tokenize_preference(examples, self.tokenizer)
        missing = ("TRL's tokenized preference columns are prompt_ids, chosen_ids and rejected_ids: pass "
                   "tokenizer= for raw prompt/chosen/rejected rows (and remove_unused_columns=False under a Trainer)")
        (p_vals, p_len), (c_vals, c_len), (r_vals, r_len) = (read_column(examples, key, missing=missing)
                                                             for key in self.KEYS)
        # completions group after group: chosen_i then rejected_i
        c_off, r_off = lengths_to_offsets(c_len), lengths_to_offsets(r_len)
        starts = np.stack([c_off[:-1], r_off[:-1] + c_vals.size], 1).reshape(-1)
        lens = np.stack([c_len, r_len], 1).reshape(-1)
        both = np.concatenate([c_vals, r_vals])
        comp = both[range_index(starts, lens)]
        return self._build(p_vals, p_len, comp, lens, np.full(len(examples), 2), keys=self.KEYS[1:])


class GroupCollator(_GroupsCollator):
    """RL groups -> a packed :class:`SequenceBatch`: one example per prompt, with ``prompt_ids`` and
    ``completion_ids`` (a list of its ``k`` completions' token lists; ``k`` may differ between prompts).

    ``GroupCollator(layout="tree")([{"prompt_ids": [1, 2], "completion_ids": [[3], [4, 5]]}])`` gives
    ``input_ids [[1, 2, 3, 4, 5]]``, ``position_ids [[0, 1, 2, 2, 3]]``; log-probabilities come back in
    group order (prompt after prompt, completion after completion).

    Args:
        layout, window, num_windows, strategy, pad_token_id: as in :class:`PreferenceCollator`.
        sequence_keys: keys of per-completion numbers (one per completion) carried into ``batch.sequence_values``
            as float64 ``[N]`` (``batch.sequence_values``) in the same order, when the examples have them (``advantages``, ``rewards``).
    """

    def __init__(self, *, layout: str = "pairs", window: int | None = None, num_windows: int | None = None,
                 strategy: str = "bfd", pad_token_id: int = 0, sequence_keys=("advantages", "rewards")):
        super().__init__(layout=layout, window=window, num_windows=num_windows, strategy=strategy,
                         pad_token_id=pad_token_id)
        if isinstance(sequence_keys, str) or not all(isinstance(key, str) for key in sequence_keys):
            raise ArgumentTypeError("{a} must be a list of keys, got {got!r}; pass {fix}", a=arg("sequence_keys"),
                                    got=sequence_keys, fix=arg("sequence_keys", ("advantages",)))
        self.sequence_keys = tuple(sequence_keys)

    def __call__(self, examples) -> SequenceBatch:
        examples = list(examples)
        if not examples:
            raise ValueError("a collator needs at least one example")
        missing = "an RL group is prompt_ids with completion_ids (a list of token lists)"
        p_vals, p_len = read_column(examples, "prompt_ids", missing=missing)
        k = []
        flat = []
        for i, ex in enumerate(examples):
            comps = ex.get("completion_ids") if hasattr(ex, "get") else None
            if comps is None or isinstance(comps, (str, bytes)) or not hasattr(comps, "__len__"):
                raise DataError(f"example {i} has no 'completion_ids' list; {missing}")
            flat_list = next((j for j, c in enumerate(comps) if isinstance(c, (int, float, np.number))), None)
            if flat_list is not None:  # one completion's tokens given as the list of completions
                raise DataError(f"example {i} has {comps[flat_list]!r} ({type(comps[flat_list]).__name__}) as "
                                f"completion {flat_list} of 'completion_ids'; {missing} (one per completion: "
                                "[[3, 4], [5]], not [3, 4, 5])")
            k.append(len(comps))
            flat.extend({"completion_ids": c} for c in comps)
        try:  # each completion read as an example, its errors told about its group
            c_vals, c_len = read_column(flat, "completion_ids", missing=missing) if flat else (np.zeros(0, np.int64),) * 2
        except DataError as exc:
            raise relocate_part(exc, k) from None
        values = {}
        for key in self.sequence_keys:
            got = example_values([ex.get(key) if hasattr(ex, "get") else None for ex in examples], k, key=key)
            if got is not None:
                values[key] = got
        return self._build(p_vals, p_len, c_vals, c_len, np.asarray(k, np.int64), values=values)


# ----------------------------------------------------------------------------------------------
# micro-batches across ranks
# ----------------------------------------------------------------------------------------------


def shard_groups(group_tokens, *, world_size: int, max_tokens: int) -> list[list[np.ndarray]]:
    """Split groups into micro-batches for ``world_size`` ranks: every rank the same number of micro-batches,
    none empty, a group never split, at most ``max_tokens`` tokens a micro-batch.

    Groups go to ranks longest first, each to the rank with the fewest tokens (every rank gets one before any
    gets two), then each rank's groups are packed best fit into micro-batches of ``max_tokens``; a rank with
    fewer micro-batches splits its fullest one (between groups) until all ranks have as many. Where that leaves a
    rank short (its micro-batches single groups), the groups are packed best fit over all ranks instead, the
    fullest micro-batch split until their number is a multiple of ``world_size``, and dealt largest first to
    the least loaded rank that still needs one (:func:`_shard_globally`). ``ranks[r][m]`` is the group indices of
    rank ``r``'s micro-batch ``m``.

    ``shard_groups([5, 3, 4, 2], world_size=2, max_tokens=8) -> [[[0, 3]], [[2, 1]]]`` (as arrays).

    Raises a one-line error naming the fix when there are fewer groups than ranks (a rank would idle: TRL PR
    #7328), a group longer than ``max_tokens``, or too few groups to make a multiple of ``world_size``
    micro-batches of ``max_tokens``.
    """
    tokens = as_lengths(group_tokens, name="group_tokens", item="group")
    world_size = check_int(world_size, "world_size")
    max_tokens = check_window(max_tokens)
    if tokens.size < world_size:
        raise DataError(f"{tokens.size} groups for {world_size} ranks: a rank would have no work (and a collective "
                        "would hang); generate at least one group per rank")
    over = np.flatnonzero(tokens > max_tokens)
    if over.size:
        raise DataError(f"group {int(over[0])} has {int(tokens[over[0]]):,} tokens > max_tokens={max_tokens:,}; "
                        "raise max_tokens")
    order = np.argsort(-tokens, kind="stable")
    load = np.zeros(world_size, np.int64)
    share: list[list[int]] = [[] for _ in range(world_size)]
    for i, g in enumerate(order.tolist()):
        r = i if i < world_size else int(np.argmin(load))
        share[r].append(g)
        load[r] += tokens[g]
    ranks = []
    for groups in share:
        idx = np.asarray(groups, np.int64)
        plan = pack(tokens[idx], window=max_tokens)
        ranks.append([idx[w] for w in plan.windows()])
    target = max(len(m) for m in ranks)
    for micro in ranks:
        while len(micro) < target:
            j = max(range(len(micro)), key=lambda m: (micro[m].size, int(tokens[micro[m]].sum())))
            if micro[j].size < 2:  # this rank's groups cannot make as many: deal them over all ranks
                return _shard_globally(tokens, world_size, max_tokens)
            part = micro.pop(j)
            half = part.size // 2
            micro += [part[:half], part[half:]]
    return ranks


def _shard_globally(tokens: np.ndarray, world_size: int, max_tokens: int) -> list[list[np.ndarray]]:
    """:func:`shard_groups` where dealing first left a rank short: the groups packed best fit over all ranks
    into ``K`` micro-batches; while ``K`` is not a multiple of ``world_size`` the fullest micro-batch of several
    groups is split in two (the largest groups first, each to the lighter half), which needs no more than one
    group a micro-batch; then the micro-batches go to ranks largest first, each to the least loaded rank that
    still needs one. Before, such a batch was refused although every rank could be given as many."""
    bins = [np.asarray(w, np.int64) for w in pack(tokens, window=max_tokens).windows()]
    target = -(-len(bins) // world_size) * world_size
    if target > tokens.size:
        raise DataError(f"{tokens.size} groups need {len(bins)} micro-batches of max_tokens={max_tokens:,}, and "
                        f"{world_size} ranks need a multiple of {world_size}, none empty: raise max_tokens or send "
                        "more groups")
    size = [int(tokens[b].sum()) for b in bins]
    while len(bins) < target:
        i = max((i for i, b in enumerate(bins) if b.size > 1), key=lambda i: (size[i], -i))
        b, halves, load = bins.pop(i), ([], []), [0, 0]
        size.pop(i)
        for g in b[np.argsort(-tokens[b], kind="stable")].tolist():
            h = int(load[1] < load[0])
            halves[h].append(g)
            load[h] += int(tokens[g])
        bins += [np.asarray(h, np.int64) for h in halves]
        size += load
    per_rank = target // world_size
    load = np.zeros(world_size, np.int64)
    ranks: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(bins)), key=lambda i: (-size[i], i)):
        r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
        ranks[r].append(np.sort(bins[i]))
        load[r] += size[i]
    return ranks
