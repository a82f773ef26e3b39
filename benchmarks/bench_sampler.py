"""Padding waste and epoch-building time of packkit's batch samplers against transformers'.

On real chat lengths by default (``--lengths chat``: ShareGPT conversations under Qwen3's tokenizer, drawn with
replacement to ``--n``, default 1M, from those of at most ``--max-tokens`` tokens, which the token budget needs;
``--lengths sft-like``: the synthetic lognormal, labelled), batch 16; the packed sampler truncates examples over
``--window`` (``overflow="truncate"``: a batch sampler yields whole examples): padding waste of random batches, of packkit's
``LengthGroupedSampler``, of transformers' ``LengthGroupedSampler`` (same batch size, same megabatch
of 50 batches), of packkit's ``TokenBudgetBatchSampler``, and the fill of ``PackedBatchSampler``;
then the time to build one epoch of indices, packkit and transformers in the same run: ``--repeat`` pairs
alternating (``benchlib.ab_pairs``: who goes first flips, garbage collected outside the clock, CPU time), the
medians and the median and spread of the pair ratios transformers / packkit.

Padding waste = 1 - real tokens / sum over batches of (batch size x longest in the batch), computed
here from the index lists each sampler yields (not from the sampler's own report).

    python benchmarks/bench_sampler.py                  # ~1-2 minutes on 2 cores
    python benchmarks/bench_sampler.py --n 100000 --seeds 1

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from benchlib import (LENGTH_SOURCES, ab_pairs, add_lengths_option, bench_lengths, loadavg, ratio_spread,
                      spread_text, versions)



def padding_waste(lengths: np.ndarray, flat: np.ndarray, ptr: np.ndarray) -> float:
    """1 - real / padded over CSR batches ``flat[ptr[b]:ptr[b+1]]``."""
    seq = lengths[flat]
    longest = np.maximum.reduceat(seq, ptr[:-1])
    return 1.0 - seq.sum() / float((np.diff(ptr) * longest).sum())


def chunks(order: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive batches of ``batch_size`` (the last one partial), as CSR."""
    ptr = np.append(np.arange(0, order.size, batch_size), order.size)
    return np.asarray(order, np.int64), ptr


def from_batches(batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.fromiter((len(b) for b in batches), np.int64, len(batches))
    ptr = np.zeros(sizes.size + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    return np.fromiter((i for b in batches for i in b), np.int64, int(ptr[-1])), ptr


def best_time(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--megabatch-mult", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3, help="epochs (seeds) the waste is averaged over")
    ap.add_argument("--repeat", type=int, default=5, help="timing: alternating pairs")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--windows-per-batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16 * 1024)
    ap.add_argument("--shuffle-ff", action="store_true", help="also time strategy='shuffle_ff' (slow at 1M)")
    add_lengths_option(ap)
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers.trainer_pt_utils import LengthGroupedSampler as HFLengthGroupedSampler

    from transformers.trainer_pt_utils import get_length_grouped_indices

    from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, TokenBudgetBatchSampler, sort_megabatches

    B, n = args.batch_size, args.n
    lengths = bench_lengths(args.lengths, n, high=args.max_tokens)  # the token budget refuses longer examples
    lengths_list = lengths.tolist()
    rows = []

    # -- padding waste, averaged over epochs -------------------------------------------------
    waste = {"random": [], "packkit": [], "transformers": [], "budget": [], "paired_packkit": [],
             "paired_transformers": []}
    ours = LengthGroupedSampler(lengths, batch_size=B, megabatch_mult=args.megabatch_mult, seed=0)
    budget = TokenBudgetBatchSampler(lengths, max_tokens=args.max_tokens, seed=0)
    for epoch in range(args.seeds):
        rng = np.random.default_rng(1000 + epoch)
        waste["random"].append(padding_waste(lengths, *chunks(rng.permutation(n), B)))
        ours.set_epoch(epoch)
        waste["packkit"].append(padding_waste(lengths, *from_batches(list(ours))))
        hf = HFLengthGroupedSampler(B, lengths=lengths_list, generator=torch.Generator().manual_seed(epoch))
        hf_order = np.fromiter(iter(hf), np.int64, n)
        waste["transformers"].append(padding_waste(lengths, *chunks(hf_order, B)))
        budget.set_epoch(epoch)
        waste["budget"].append(padding_waste(lengths, *from_batches(list(budget))))
        # paired: both groupings over one torch permutation (what each sampler does with world_size=1)
        mult = args.megabatch_mult
        theirs = get_length_grouped_indices(lengths_list, B, mega_batch_mult=mult,
                                            generator=torch.Generator().manual_seed(100 + epoch))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(100 + epoch)).numpy()
        waste["paired_transformers"].append(padding_waste(lengths, *chunks(np.asarray(theirs), B)))
        waste["paired_packkit"].append(padding_waste(lengths, *chunks(sort_megabatches(perm, lengths, mult * B), B)))

    def summary(xs):
        return float(np.mean(xs)), float(np.std(xs) / max(1, len(xs) - 1) ** 0.5)

    for name, label in [("random", f"random batches of {B}"),
                        ("transformers", f"transformers LengthGroupedSampler (B={B}, mult=50)"),
                        ("packkit", f"packkit LengthGroupedSampler (B={B}, mult={args.megabatch_mult})"),
                        ("paired_transformers", "  same permutation: transformers' grouping"),
                        ("paired_packkit", "  same permutation: packkit's grouping"),
                        ("budget", f"packkit TokenBudgetBatchSampler (max_tokens={args.max_tokens})")]:
        m, se = summary(waste[name])
        rows.append((label, f"waste {m:.4%} +- {se:.4%}", ""))

    # -- packed fill ------------------------------------------------------------------------
    packed_t, packed = best_time(lambda: PackedBatchSampler(lengths, window=args.window, overflow="truncate",
                                                            windows_per_batch=args.windows_per_batch, seed=0), 1)
    packed_stats = packed.epoch_stats()
    rows.append((f"packkit PackedBatchSampler bfd (W={args.window}, k={args.windows_per_batch})",
                 f"fill {1 - packed_stats.padding_waste:.4%}", f"plan+epoch {packed_t:.3f} s"))
    packed_epoch_t, _ = best_time(lambda: (packed.set_epoch(packed.epoch + 1), len(packed)), args.repeat)
    rows.append(("  next epoch (plan reused, windows reshuffled)", "", f"{packed_epoch_t:.3f} s"))
    ff_fill = ff_t = None
    if args.shuffle_ff:
        ff_t, ff = best_time(lambda: PackedBatchSampler(lengths, window=args.window, strategy="shuffle_ff", overflow="truncate",
                                                        windows_per_batch=args.windows_per_batch), 1)
        ff_fill = 1 - ff.epoch_stats().padding_waste
        rows.append(("packkit PackedBatchSampler shuffle_ff", f"fill {ff_fill:.4%}", f"plan+epoch {ff_t:.3f} s"))

    # -- epoch-building time, same run --------------------------------------------------------
    counter = iter(range(args.seeds, 10**6))  # epochs the waste loop built are cached: not timed again

    def ours_build():  # a new epoch: permutation, megabatch sort, steps (what len() and iter() need)
        ours.set_epoch(next(counter))
        return len(ours)

    def ours_lists():  # ... and every batch handed out as a Python list
        ours.set_epoch(next(counter))
        return sum(1 for _ in ours)

    hf = HFLengthGroupedSampler(B, lengths=lengths_list)

    def hf_build():  # transformers builds its whole index list in __iter__
        hf.generator = torch.Generator().manual_seed(next(counter))
        return iter(hf)

    def hf_lists():  # ... and the DataLoader's BatchSampler cuts it into lists of B
        hf.generator = torch.Generator().manual_seed(next(counter))
        return sum(1 for _ in torch.utils.data.BatchSampler(hf, B, drop_last=False))

    load = loadavg()
    build = ratio_spread(*reversed(ab_pairs(ours_build, hf_build, args.repeat, clock=time.process_time)))
    lists = ratio_spread(*reversed(ab_pairs(ours_lists, hf_lists, args.repeat, clock=time.process_time)))
    t_ours, t_hf, t_ours_l, t_hf_l = build["den_median"], build["num_median"], lists["den_median"], lists["num_median"]
    rows.append(("epoch build: packkit LengthGroupedSampler", "", f"{t_ours:.3f} s"))
    rows.append(("epoch build: transformers LengthGroupedSampler", "", f"{t_hf:.3f} s"))
    rows.append(("  transformers / packkit, pair ratios", "", spread_text(build)))
    rows.append(("epoch + batches as lists: packkit", "", f"{t_ours_l:.3f} s"))
    rows.append(("epoch + batches as lists: transformers + BatchSampler", "", f"{t_hf_l:.3f} s"))
    rows.append(("  transformers / packkit, pair ratios", "", spread_text(lists)))

    m_ours, se_ours = summary(waste["packkit"])
    m_hf, se_hf = summary(waste["transformers"])
    paired_ours, paired_hf = np.array(waste["paired_packkit"]), np.array(waste["paired_transformers"])
    targets = {
        "waste_no_worse_than_transformers_same_permutation": bool((paired_ours <= paired_hf).all()),
        "waste_within_noise_of_transformers": m_ours <= m_hf + 2 * (se_ours**2 + se_hf**2) ** 0.5,
        "epoch_under_0.5s": t_ours < 0.5,
        "epoch_no_slower_than_transformers": build["median"] >= 1.0,
    }

    print(f"\n{n:,} lengths, {LENGTH_SOURCES[args.lengths]} (mean {lengths.mean():.0f}, max {lengths.max()}), "
          f"batch {B}, waste over {args.seeds} epochs (mean +- standard error); timings: CPU medians of "
          f"{args.repeat} alternating pairs, load {load:.1f}-{loadavg():.1f}; "
          f"numpy {np.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{platform.processor() or platform.machine()}")
    width = max(len(r[0]) for r in rows)
    print(f"{'provider':<{width}}  {'padding':<24}  time")
    for name, a, b in rows:
        print(f"{name:<{width}}  {a:<24}  {b}")
    for k, v in targets.items():
        print(f"target {k}: {'met' if v else 'MISSED'}")
    print(json.dumps({
        "bench": "sampler", "versions": versions("transformers"), "n": n, "batch_size": B, "megabatch_mult": args.megabatch_mult, "epochs": args.seeds,
        "waste_random": summary(waste["random"])[0], "waste_packkit": m_ours, "waste_packkit_se": se_ours,
        "waste_transformers": m_hf, "waste_transformers_se": se_hf, "waste_token_budget": summary(waste["budget"])[0],
        "paired_waste_packkit": paired_ours.tolist(), "paired_waste_transformers": paired_hf.tolist(),
        "max_tokens": args.max_tokens, "packed_fill_bfd": 1 - packed_stats.padding_waste, "packed_build_s": packed_t,
        "packed_epoch_s": packed_epoch_t, "packed_fill_shuffle_ff": ff_fill, "packed_shuffle_ff_s": ff_t,
        "epoch_s_packkit": t_ours, "epoch_s_transformers": t_hf, "epoch_lists_s_packkit": t_ours_l,
        "epoch_lists_s_transformers": t_hf_l, "targets": targets, "lengths": args.lengths,
        "epoch_ratio_transformers_over_packkit": build, "lists_ratio_transformers_over_packkit": lists,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
