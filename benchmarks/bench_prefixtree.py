"""Prefix trees: tokens forwarded with and without shared prefixes, and the tree's construction speed.

On real structure (``benchmarks/data/sharegpt_qwen3_turns.npz``, ``make_turn_lengths.py``): every assistant turn
of the ShareGPT conversations as its own sample, rendered through Qwen3's real chat template (earlier reasoning
dropped) and tokenized with Qwen3's tokenizer; token ids are rebuilt with exactly that sharing (each sample's
shared tokens copied from the earlier sample it shares them with, the rest fresh ids) and the tree is built
from the ids alone, one conversation a tree (``groups=``). Figures:

* multi-turn: tokens per turn (every sample whole, the baseline) against trie nodes (forwarded once each);
  checked against the file's own count; target >= 2.7x;
* RL groups: ``n`` completions of one prompt (n = 4, 8, 16), prompts and completions drawn (seeded) from the
  same file's assistant replies and its first-turn prompts (a first user message), then again with every turn's
  prompt (the conversation before the turn); target >= 1.5x at n = 8; beside each draw, the ratio its pools
  imply without sampling (``(n p + n c) / (p + n c)`` of their mean prompt ``p`` and reply ``c``), which a draw of
  ``--prompts`` groups estimates;
* speed: ``build_tree`` on the multi-turn ids in batches of ``--batch-tokens`` (CPU seconds,
  ``time.process_time``, GC outside the clock), A/B alternated in the same run with ``build_tree`` of a named
  revision (``--against``, read from git; its trees must equal ours, array by array) and with the baseline a
  user would write: a dict trie, sample by sample, token by token (on a ``--baseline-tokens`` share of the
  batch, scaled to tokens per second); target >= 5M tokens/s on one core. Median and range of every figure
  and of the pair ratios; the load average is printed beside them (2 cores shared by 8 engineers).

Usage: ``python benchmarks/bench_prefixtree.py [--turns FILE] [--batch-tokens 4000000] [--rounds 5]
[--against aaf59a2]``.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchlib import emit_json, loadavg, ratio_spread, verdict, versions

from packkit.prefixtree import build_tree

HERE = os.path.dirname(os.path.abspath(__file__))
TURNS = os.path.join(HERE, "data", "sharegpt_qwen3_turns.npz")  # Qwen3's template: earlier reasoning dropped
#: the same conversations through TRL's qwen3_training.jinja (every turn's think block kept: histories are prefixes)
TRAINING_TURNS = os.path.join(HERE, "data", "sharegpt_qwen3_training_turns.npz")
VOCAB = 151_643  # Qwen3's ordinary tokens


def rebuild(data) -> tuple[np.ndarray, np.ndarray]:
    """Token ids with the file's sharing: sample ``s`` is ``ids(source[s])[:shared[s]]`` then fresh ids."""
    lengths = data["length"].astype(np.int64)
    shared, source = data["shared"].astype(np.int64), data["source"].astype(np.int64)
    off = np.zeros(lengths.size + 1, np.int64)
    off[1:] = np.cumsum(lengths)
    ids = np.empty(int(off[-1]), np.int64)
    fresh = lengths - shared
    ids_fresh = np.arange(int(fresh.sum()), dtype=np.int64) % VOCAB + VOCAB  # never equal to a shared id by chance
    f_off = np.zeros(lengths.size + 1, np.int64)
    f_off[1:] = np.cumsum(fresh)
    for s in range(lengths.size):  # sources come first: one copy a sample
        a, m = off[s], shared[s]
        if m:
            ids[a:a + m] = ids[off[source[s]]:off[source[s]] + m]
        ids[a + m:off[s + 1]] = ids_fresh[f_off[s]:f_off[s + 1]]
    return ids, lengths


def multi_turn(data) -> dict:
    ids, lengths = rebuild(data)
    loss = data["loss"].astype(np.int64)
    mask = np.zeros(ids.size, np.int8)
    ends = np.cumsum(lengths)
    mask[np.concatenate([np.arange(e - n, e) for e, n in zip(ends, loss)])] = 1
    tree = build_tree(ids, lengths, loss_mask=mask, groups=data["conversation"])
    expected = int(lengths.sum() - data["shared"].astype(np.int64).sum())
    assert tree.num_nodes == expected, (tree.num_nodes, expected)
    return {"conversations": int(np.unique(data["conversation"]).size), "samples": int(lengths.size),
            "turn_tokens": tree.num_sample_tokens, "tree_tokens": tree.num_nodes,
            "ratio": tree.num_sample_tokens / tree.num_nodes, "ids": ids, "lengths": lengths,
            "groups": data["conversation"].astype(np.int64)}


def rl_groups(data, n: int, *, prompts: int, seed: int, history: bool = False) -> dict:
    """``prompts`` groups of ``n`` completions, lengths drawn from the file's replies and its first-turn prompts
    (``history``: every turn's prompt, the conversation before it). A turn that opens its conversation (``opening``:
    the message alone) has no prompt: its conversation's first prompt is the next turn's."""
    rng = np.random.default_rng(seed)
    asked = data["opening"] == 0 if "opening" in data else np.ones(data["length"].size, bool)
    conv = data["conversation"][asked]
    first = asked.copy()
    if not history:  # each conversation's first turn that has a prompt
        first[asked] = np.r_[True, conv[1:] != conv[:-1]]
    prompt_pool = (data["length"] - data["loss"])[first].astype(np.int64)
    reply_pool = data["loss"].astype(np.int64)
    p = rng.choice(prompt_pool, prompts)
    c = rng.choice(reply_pool, (prompts, n))
    lengths = (p[:, None] + c).reshape(-1)
    ids = rng.integers(0, VOCAB, int(lengths.sum()))
    off = np.concatenate([[0], np.cumsum(lengths)])
    for g in range(prompts):  # the group's samples start with its first sample's prompt
        a = off[g * n]
        for j in range(1, n):
            ids[off[g * n + j]:off[g * n + j] + p[g]] = ids[a:a + p[g]]
    tree = build_tree(ids, lengths, groups=np.repeat(np.arange(prompts), n))
    # what the draws estimate: the pools' own sharing (their means), no sampling
    pm, cm = float(prompt_pool.mean()), float(reply_pool.mean())
    return {"n": n, "groups": prompts, "prompts": "every turn's history" if history else "first turn",
            "sample_tokens": tree.num_sample_tokens, "tree_tokens": tree.num_nodes,
            "ratio": tree.num_sample_tokens / tree.num_nodes,
            "formula": float((n * p + c.sum(1)).sum() / (p + c.sum(1)).sum()),
            "population": (n * pm + n * cm) / (pm + n * cm), "pool_prompts": int(prompt_pool.size),
            "pool_replies": int(reply_pool.size)}


def dict_trie(ids, lengths, groups) -> int:
    """The baseline: insert every sample into a dict trie (one dict a node), token by token; nodes."""
    roots, count, at = {}, 0, 0
    ids = ids.tolist()
    for s, n in enumerate(lengths.tolist()):
        level = roots.setdefault(int(groups[s]), {})
        for t in ids[at:at + n]:
            nxt = level.get(t)
            if nxt is None:
                nxt = level[t] = {}
                count += 1
            level = nxt
        at += n
    return count


def cpu(fn) -> float:
    gc.collect()
    gc.disable()
    try:
        t = time.process_time()
        fn()
        return time.process_time() - t
    finally:
        gc.enable()


def revision_build_tree(rev: str):
    """``build_tree`` of ``packkit/prefixtree.py`` at git revision ``rev`` (a module of its own, the rest of
    packkit as checked out)."""
    src = subprocess.run(["git", "-C", HERE, "show", f"{rev}:packkit/prefixtree.py"], capture_output=True, text=True,
                         check=True).stdout
    name = f"packkit._prefixtree_{rev}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "packkit"
    sys.modules[name] = module
    exec(compile(src, f"{rev}:packkit/prefixtree.py", "exec"), module.__dict__)
    return module.build_tree


def same_tree(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "position_ids", "parent", "tout",
               "segment", "tree_ptr", "num_samples", "path", "score_source", "score_target", "num_tokens"))


def speed(mt: dict, *, batch_tokens: int, baseline_tokens: int, rounds: int, against: str) -> dict:
    """Tokens per CPU second of build_tree, of build_tree at revision ``against`` and of the dict trie, A/B
    alternated, on the first batch."""
    lengths, ids, groups = mt["lengths"], mt["ids"], mt["groups"]
    k = int(np.searchsorted(np.cumsum(lengths), batch_tokens)) + 1
    kb = int(np.searchsorted(np.cumsum(lengths), baseline_tokens)) + 1
    n_tok, b_tok = int(lengths[:k].sum()), int(lengths[:kb].sum())
    ids_k, ids_b = ids[:n_tok], ids[:b_tok]
    before = revision_build_tree(against)
    assert same_tree(build_tree(ids_k, lengths[:k], groups=groups[:k]), before(ids_k, lengths[:k], groups=groups[:k]))
    runs = {"ours": [], "rev": [], "base": []}
    loads = []
    for r in range(rounds):
        trio = [("ours", n_tok, lambda: build_tree(ids_k, lengths[:k], groups=groups[:k])),
                ("rev", n_tok, lambda: before(ids_k, lengths[:k], groups=groups[:k])),
                ("base", b_tok, lambda: dict_trie(ids_b, lengths[:kb], groups[:kb]))]
        for name, tokens, fn in trio if r % 2 == 0 else trio[::-1]:
            loads.append(loadavg())
            runs[name].append(tokens / cpu(fn))
    assert build_tree(ids_b, lengths[:kb], groups=groups[:kb]).num_nodes == dict_trie(ids_b, lengths[:kb], groups[:kb])
    vs, over_base = ratio_spread(runs["ours"], runs["rev"]), ratio_spread(runs["ours"], runs["base"])
    return {"batch_tokens": n_tok, "baseline_tokens": b_tok, "against": against,
            "ours_tok_s": statistics.median(runs["ours"]), "ours_low": min(runs["ours"]), "ours_high": max(runs["ours"]),
            "rev_tok_s": statistics.median(runs["rev"]), "rev_low": min(runs["rev"]), "rev_high": max(runs["rev"]),
            "vs_rev": vs["median"], "vs_rev_low": vs["low"], "vs_rev_high": vs["high"], "vs_rev_pairs": vs,
            "base_tok_s": statistics.median(runs["base"]),
            "speedup": over_base["median"], "speedup_low": over_base["low"], "speedup_high": over_base["high"],
            "load": statistics.median(loads), "load_low": min(loads), "load_high": max(loads)}


def shapes(seed: int = 0) -> dict:
    """Batches whose construction cost is per sample, not per token: ``(ids, lengths)`` of
    * 400,000 samples of 10 tokens, Qwen3-sized ids, each sharing its first 0-9 tokens with one of 1,000 prompts;
    * a deep nest (400 samples, each one token longer than the last) then 20,000 samples of 2 tokens that share
      only its first token, later ones sorting first: the nearest earlier sample of each in sorted order is the
      nest's deepest, and a166061's parent search walked up the whole nest from there (quadratic)."""
    rng = np.random.default_rng(seed)
    n, width = 400_000, 10
    prompts = rng.integers(0, VOCAB, (1000, width))
    ids = rng.integers(0, VOCAB, (n, width))
    keep = np.arange(width) < rng.integers(0, width, n)[:, None]
    ids = np.where(keep, prompts[rng.integers(0, 1000, n)], ids)
    base = rng.integers(0, 100, 401)
    nest = [base[:k + 2] for k in range(400)] + [np.array([base[0], 20_200 - i]) for i in range(20_000)]
    return {"400,000 samples of 10 tokens": (ids.reshape(-1), np.full(n, width)),
            "deep nest + 20,000 shallow siblings": (np.concatenate(nest), np.array([x.size for x in nest]))}


def shape_speed(*, rounds: int, against: str) -> list:
    """Tokens per CPU second on :func:`shapes`, ours and ``against``'s alternated; the trees must be equal."""
    before = revision_build_tree(against)
    out = []
    for name, (ids, lengths) in shapes().items():
        assert same_tree(build_tree(ids, lengths), before(ids, lengths))
        runs, loads = {"ours": [], "rev": []}, []
        for r in range(rounds):
            pair = [("ours", build_tree), ("rev", before)]
            for who, fn in pair if r % 2 == 0 else pair[::-1]:
                loads.append(loadavg())
                runs[who].append(ids.size / cpu(lambda: fn(ids, lengths)))
        vs = ratio_spread(runs["ours"], runs["rev"])
        out.append({"batch": name, "tokens": int(ids.size), "samples": int(lengths.size), "against": against,
                    "ours_tok_s": statistics.median(runs["ours"]), "ours_low": min(runs["ours"]),
                    "ours_high": max(runs["ours"]), "rev_tok_s": statistics.median(runs["rev"]),
                    "rev_low": min(runs["rev"]), "rev_high": max(runs["rev"]), "vs_rev": vs["median"],
                    "vs_rev_low": vs["low"], "vs_rev_high": vs["high"], "load": statistics.median(loads)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default=TURNS)
    parser.add_argument("--training-turns", default=TRAINING_TURNS, help="the prefix-preserving template's file "
                        "(multi-turn ratio only; skipped when absent)")
    parser.add_argument("--batch-tokens", type=int, default=4_000_000)
    parser.add_argument("--baseline-tokens", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", default="aaf59a2", help="the git revision whose build_tree is timed beside ours")
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--shape-rounds", type=int, default=3, help="A/B rounds on the per-sample shapes (0: skip)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    data = dict(np.load(args.turns))
    mt = multi_turn(data)
    groups = [rl_groups(data, n, prompts=args.prompts, seed=n, history=h) for h in (False, True) for n in (4, 8, 16)]
    sp = speed(mt, batch_tokens=args.batch_tokens, baseline_tokens=args.baseline_tokens, rounds=args.rounds,
               against=args.against)
    training = multi_turn(dict(np.load(args.training_turns))) if os.path.exists(args.training_turns) else None
    shaped = shape_speed(rounds=args.shape_rounds, against=args.against) if args.shape_rounds else []
    print(f"\nprefix trees on {os.path.basename(args.turns)} ({mt['conversations']:,} conversations, {mt['samples']:,} "
          f"assistant turns); load {sp['load']:.1f}; {versions('numpy')}")
    print(f"{'case':34s} {'tokens unshared':>16s} {'tokens forwarded':>17s}  ratio")
    print(f"{'multi-turn, one sample a turn':34s} {mt['turn_tokens']:>16,} {mt['tree_tokens']:>17,}  "
          f"{verdict(mt['ratio'], 2.7)}")
    if training is not None:
        print(f"{'  the same, qwen3_training.jinja':34s} {training['turn_tokens']:>16,} {training['tree_tokens']:>17,}  "
              f"{verdict(training['ratio'], 2.7)}")
    for g in groups:
        target = f"{verdict(g['ratio'], 1.5)}" if g["n"] == 8 else f"{g['ratio']:.2f}x"
        print(f"{'RL groups of ' + str(g['n']) + ', ' + g['prompts'] + ' prompts':34s} "
              f"{g['sample_tokens']:>16,} {g['tree_tokens']:>17,}  {target} (lengths alone: {g['formula']:.2f}x; "
              f"the pools' own: {g['population']:.3f}x over {g['pool_prompts']:,} prompts, {g['pool_replies']:,} replies)")
    print(f"build_tree: {sp['ours_tok_s'] / 1e6:.2f}M tokens/CPU s (range {sp['ours_low'] / 1e6:.2f}-"
          f"{sp['ours_high'] / 1e6:.2f}M; {sp['batch_tokens']:,} tokens a batch); at {sp['against']}: "
          f"{sp['rev_tok_s'] / 1e6:.2f}M ({sp['rev_low'] / 1e6:.2f}-{sp['rev_high'] / 1e6:.2f}M), the same trees; "
          f"pair ratio {sp['vs_rev']:.1f}x ({sp['vs_rev_low']:.1f}-{sp['vs_rev_high']:.1f}x); the dict trie's "
          f"{sp['base_tok_s'] / 1e6:.2f}M ({sp['baseline_tokens']:,} tokens): {sp['speedup']:.1f}x ({sp['speedup_low']:.1f}-{sp['speedup_high']:.1f}x); "
          f"target 5M: {'met' if sp['ours_tok_s'] >= 5e6 else 'MISSED'}; load {sp['load']:.1f} "
          f"({sp['load_low']:.1f}-{sp['load_high']:.1f})")
    for x in shaped:
        print(f"build_tree on {x['batch']} ({x['tokens']:,} tokens): {x['ours_tok_s'] / 1e6:.2f}M tokens/CPU s "
              f"({x['ours_low'] / 1e6:.2f}-{x['ours_high'] / 1e6:.2f}M); at {x['against']}: {x['rev_tok_s'] / 1e6:.2f}M "
              f"({x['rev_low'] / 1e6:.2f}-{x['rev_high'] / 1e6:.2f}M), the same trees; pair ratio {x['vs_rev']:.2f}x "
              f"({x['vs_rev_low']:.2f}-{x['vs_rev_high']:.2f}x); load {x['load']:.1f}")
    mt, training = ({k: v for k, v in x.items() if k not in ("ids", "lengths", "groups")} if x else None
                    for x in (mt, training))
    emit_json({"bench": "prefixtree", "multi_turn": mt, "multi_turn_training_template": training, "groups": groups, "speed": sp, "shapes": shaped, **versions("numpy")},
              args.json_out)


if __name__ == "__main__":
    main()
