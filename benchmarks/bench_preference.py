"""Preference pairs: tokens computed per pair, packing fill, and collation time; packkit against TRL, same run.

For each length distribution and window it measures, on the same pairs:

* TRL 1.16's ``DataCollatorForPreference`` (what ``DPOTrainer`` uses: chosen and rejected rows padded to
  the batch's longest), batches of ``--batch-size`` pairs in a seeded random order;
* TRL's padding-free layout (each pair as two sequences with their prompt, no padding: what
  ``DPOConfig(padding_free=True)`` flattened before TRL 1.16 disabled it), tokens per pair;
* packkit ``PreferenceCollator(layout="pairs", window=W)``: the same sequences, pairs kept whole in windows;
* packkit ``PreferenceCollator(layout="tree", window=W)``: the prompt once per pair.

Figures: tokens computed per pair (padding included) and the layout's own tokens per pair, fill, windows
against the lower bound ``ceil(tokens / W)`` (target: >= 0.99), and the collators' time per pair on random
token ids of those lengths (``--collate-batches`` batches).

Lengths (``--dists``): "sharegpt-turns" (the default) is real: every assistant turn of the ShareGPT conversations
under Qwen3's tokenizer and TRL's training template (``benchlib.chat_turns``), its history the prompt, its reply
``chosen`` and another turn's reply ``rejected``. The other two are options, labelled: "ultrafeedback-like" is synthetic (lognormal prompts, median 100 tokens, sigma 0.9; completions
median 200, sigma 0.8; clipped to [8, 1500] and [4, 1500]): no UltraFeedback data is on this machine, so its
shape is modelled, not read. "sharegpt-completions" takes chosen and rejected from real ShareGPT conversation
lengths under Qwen3's tokenizer (``benchlib.chat_lengths``; drawn with replacement past 17,545) with the same
synthetic prompts. The collators' time: ``--rounds`` rounds rotated (each collator first in turn), garbage collected
outside the clock, CPU medians, and the median and spread of the pair ratios TRL padded / packkit.

Usage: ``python benchmarks/bench_preference.py [--n 20000] [--windows 2048,4096] [--json-out FILE]``.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchlib import (chat_lengths, chat_turns, emit_json, loadavg, ratio_spread, rotating_rounds, spread_text,
                      verdict, versions)

from packkit.preference import PreferenceCollator
from packkit.waste import preference_waste

TARGET_FILL = 0.99


def ultrafeedback_like(n: int, seed: int):
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.round(rng.lognormal(np.log(100), 0.9, n)), 8, 1500).astype(np.int64)
    chosen, rejected = (np.clip(np.round(rng.lognormal(np.log(200), 0.8, n)), 4, 1500).astype(np.int64)
                        for _ in range(2))
    return prompt, chosen, rejected


def sharegpt_completions(n: int, seed: int):
    prompt, _, _ = ultrafeedback_like(n, seed)
    return prompt, chat_lengths(n, seed=seed + 1), chat_lengths(n, seed=seed + 2)


def sharegpt_turns(n: int, seed: int):
    """Real prompts and replies: a ShareGPT turn's history (its tokens before the reply, under Qwen3's tokenizer and
    TRL's training template) as the prompt, its reply as ``chosen``, another turn's reply as ``rejected``."""
    lengths, loss = chat_turns(n, seed=seed)
    return lengths - loss, loss, chat_turns(n, seed=seed + 1)[1]


DISTRIBUTIONS = {"sharegpt-turns": sharegpt_turns, "sharegpt-completions": sharegpt_completions,
                 "ultrafeedback-like": ultrafeedback_like}


def collate_times(prompt, chosen, rejected, *, window: int, batch_size: int, batches: int, seed: int,
                  rounds: int) -> dict:
    """Seconds per pair of each collator over ``batches`` batches of random token ids (pairs that fit), round by
    round (``{name: [seconds, ...]}``: ``rounds`` rotated rounds, garbage collected outside the clock, CPU time)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rng = np.random.default_rng(seed)
    fits = np.flatnonzero(prompt + chosen + rejected <= window)
    fits = fits[2 * prompt[fits] + chosen[fits] + rejected[fits] <= window]
    pick = rng.choice(fits, batches * batch_size, replace=fits.size < batches * batch_size)
    pairs = [{"prompt_ids": rng.integers(3, 30000, int(prompt[i])).tolist(),
              "chosen_ids": rng.integers(3, 30000, int(chosen[i])).tolist(),
              "rejected_ids": rng.integers(3, 30000, int(rejected[i])).tolist()} for i in pick]
    groups = [pairs[b * batch_size:(b + 1) * batch_size] for b in range(batches)]
    collators = {
        "trl_padded": DataCollatorForPreference(pad_token_id=0),
        "packkit_pairs": PreferenceCollator(layout="pairs", window=window),
        "packkit_tree": PreferenceCollator(layout="tree", window=window),
    }
    for collate in collators.values():
        collate(groups[0])  # warm up
    times = rotating_rounds({name: (lambda c=c: [c(g) for g in groups]) for name, c in collators.items()}, rounds)
    return {name: [t / (batches * batch_size) for t in ts] for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="pairs per distribution (default 20,000)")
    ap.add_argument("--windows", default="2048,4096")
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per TRL padded batch (default 8)")
    ap.add_argument("--collate-batches", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5, help="rotated rounds of the collate timing")
    ap.add_argument("--dists", default="sharegpt-turns",
                    help="length distributions, comma-separated: sharegpt-turns (real, the default), "
                         "sharegpt-completions (real replies, SYNTHETIC prompts), ultrafeedback-like (SYNTHETIC)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    env = versions("trl", "transformers")
    records, lines = [], []
    load = loadavg()
    for dist in args.dists.split(","):
        p, c, r = DISTRIBUTIONS[dist](args.n, args.seed)
        for w in windows:
            rep = preference_waste(p, c, r, window=w, batch_size=args.batch_size, seed=args.seed)
            rounds = collate_times(p, c, r, window=w, batch_size=args.batch_size, batches=args.collate_batches,
                                   seed=args.seed, rounds=args.rounds)
            times = {k: statistics.median(v) for k, v in rounds.items()}
            pairs = {k: ratio_spread(rounds["trl_padded"], rounds[k]) for k in ("packkit_pairs", "packkit_tree")}
            rows = rep["rows"]
            ratio = {k: rows[k]["lower_bound"] / rows[k]["windows"] for k in ("packkit_pairs", "packkit_tree")}
            rec = {"distribution": dist, "window": w, "pairs": rep["pairs"], "dropped": rep["dropped"],
                   "tokens_per_pair": {k: v["per_pair"] for k, v in rows.items()},
                   "real_tokens_per_pair": {k: v["real_per_pair"] for k, v in rows.items()},
                   "fill": {k: v["fill"] for k, v in rows.items()},
                   "lower_bound_over_windows": ratio,
                   "collate_us_per_pair": {k: v * 1e6 for k, v in times.items()},
                   "collate_trl_padded_over": pairs,
                   "tree_vs_trl_padding_free": rows["trl_padding_free"]["per_pair"] / rows["packkit_tree"]["per_pair"],
                   "tree_vs_trl_padded": rows["trl_padded"]["per_pair"] / rows["packkit_tree"]["per_pair"]}
            records.append(rec)
            for k in ("trl_padded", "trl_padding_free", "packkit_pairs", "packkit_tree"):
                lb = f"{ratio[k]:.4f}" if k in ratio else "-"
                us = f"{rec['collate_us_per_pair'][k]:.1f}" if k in times else "-"
                lines.append(f"{dist:<21} {w:>6} {k:<17} {rows[k]['real_per_pair']:>9.1f} {rows[k]['per_pair']:>11.1f} "
                             f"{rows[k]['fill']:>7.2%} {lb:>8} {us:>9}")
            lines.append(f"{'':<21} {'':>6} dropped (pair > window): {rep['dropped']:,} of {args.n:,}; fill vs lower bound "
                         f"pairs {verdict(ratio['packkit_pairs'], TARGET_FILL)}, tree "
                         f"{verdict(ratio['packkit_tree'], TARGET_FILL)}; tokens computed, TRL padding-free / packkit tree "
                         f"{rec['tree_vs_trl_padding_free']:.2f}x, TRL padded / packkit tree "
                         f"{rec['tree_vs_trl_padded']:.2f}x")
            lines.append(f"{'':<21} {'':>6} collate time, TRL padded / packkit, pair ratios: pairs "
                         f"{spread_text(pairs['packkit_pairs'])}, tree {spread_text(pairs['packkit_tree'])}")
    print(f"bench_preference: {args.n:,} pairs a distribution, {args.batch_size} pairs a TRL batch; collate: CPU "
          f"medians of {args.rounds} rotated rounds; load {load:.1f}-{loadavg():.1f}; {env}")
    print(f"{'distribution':<21} {'window':>6} {'layout':<17} {'real/pair':>9} {'tokens/pair':>11} {'fill':>7} "
          f"{'LB/win':>8} {'us/pair':>9}")
    print("\n".join(lines))
    emit_json({"benchmark": "preference", "versions": env, "n": args.n, "batch_size": args.batch_size,
               "target_lower_bound_over_windows": TARGET_FILL, "results": records}, args.json_out)


if __name__ == "__main__":
    main()
