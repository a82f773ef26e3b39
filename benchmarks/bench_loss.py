"""How wrong is the mean of per-micro-batch means on real chat data, and what does exactness cost?

Baseline: what trainers shipped until late 2024 -- each micro-batch's own mean loss, divided by the
accumulation steps. packkit: summed CE over the step's loss-token count (``accumulation_step``).

Measured on real samples by default (``--lengths chat``: every assistant turn of the ShareGPT conversations with
its history, under Qwen3's tokenizer and TRL's training template, those of at most 2,048 tokens; the loss on the
reply: ``benchlib.chat_turns``); ``--lengths sft-like`` for the synthetic lognormal prompt and completion
(``packkit.budget.synthetic_sft_lengths``), labelled. For padded micro-batches and for packed windows:

* ``weight_tv``: total variation between the per-token loss weights of the two rules in one step,
  ``sum_m |1/A - n_m/N|`` (n_m loss tokens of micro-batch m, N of the step): the fraction of the
  step's loss mass that the baseline moves between micro-batches (0 = identical);
* ``max_weight_ratio``: the largest over the smallest per-token weight within a step under the
  baseline (1.0 under packkit);
* ``grad_rel_err``: ``|g_naive - g_exact| / |g_exact|`` of a tiny per-token LM in float64 on the same
  micro-batches (few steps);
* ``count_us``: wall time of ``accumulation_step`` per optimiser step on real ``PackedBatch``
  micro-batches (the baseline counts nothing, 0).

The two rules are compared on the same micro-batches, exactly (no clock); ``count_us`` is packkit's alone.

Usage: ``python benchmarks/bench_loss.py [--examples N] [--steps S] [--lengths chat]``
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from benchlib import LENGTH_SOURCES, add_lengths_option, bench_turns

from packkit.collate import FixedWindowCollator, PaddedCollator
from packkit.loss import accumulation_step, token_normalized_loss
from packkit.sampler import PackedBatchSampler

VOCAB = 97


def weight_stats(n_per_micro: np.ndarray) -> tuple[float, float]:
    """``(weight_tv, max_weight_ratio)`` of one step's micro-batch loss-token counts."""
    n = n_per_micro[n_per_micro > 0]
    A, N = n_per_micro.size, n.sum()
    tv = float(np.abs(1.0 / A - n / N).sum() + (n_per_micro.size - n.size) / A)
    return tv, float(n.max() / n.min())


def make_examples(lengths, loss, seed):
    rng = np.random.default_rng(seed)
    out = []
    for n_tok, n_loss in zip(lengths.tolist(), loss.tolist()):
        ids = rng.integers(1, VOCAB, n_tok)
        labels = ids.copy()
        labels[: n_tok - n_loss] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def tiny_lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, VOCAB)).double()


def grad_of(model, mbs, rule, step):
    model.zero_grad()
    for mb in mbs:
        logits = model(mb["input_ids"])
        if rule == "naive":
            loss = token_normalized_loss(logits, mb["labels"]) / len(mbs)
        else:
            loss = step.loss(logits, mb)
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def run(config, examples, lengths, steps_for_grad, seed):
    name, A = config["name"], config["accumulation"]
    if config["mode"] == "packed":
        sampler = PackedBatchSampler(lengths, window=config["window"], windows_per_batch=config["k"], seed=seed)
        collate = FixedWindowCollator(window=config["window"], strategy="next_fit", num_windows=config["k"])
        batches = list(sampler)
    else:
        order = np.random.default_rng(seed).permutation(len(examples))
        b = config["batch"]
        batches = [order[i:i + b] for i in range(0, len(order) - b + 1, b)]
        collate = PaddedCollator()
    num_steps = len(batches) // A
    tvs, ratios, times, errs = [], [], [], []
    model = tiny_lm()
    for s in range(num_steps):
        mbs = [collate([examples[i] for i in batches[s * A + m]]) for m in range(A)]
        t0 = time.perf_counter()
        step = accumulation_step(mbs)
        times.append(time.perf_counter() - t0)
        tv, ratio = weight_stats(np.array(step.micro_loss_tokens))
        tvs.append(tv)
        ratios.append(ratio)
        if s < steps_for_grad:
            exact = grad_of(model, mbs, "exact", step)
            naive = grad_of(model, mbs, "naive", step)
            errs.append(float((naive - exact).norm() / exact.norm()))
    return {
        "config": name, "steps": num_steps,
        "weight_tv_mean": float(np.mean(tvs)), "weight_tv_max": float(np.max(tvs)),
        "max_weight_ratio_mean": float(np.mean(ratios)), "max_weight_ratio_max": float(np.max(ratios)),
        "grad_rel_err_mean": float(np.mean(errs)) if errs else None,
        "count_us_median": 1e6 * float(np.median(times)),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description="mean-of-means error vs packkit's token normalisation")
    p.add_argument("--examples", type=int, default=4000)
    p.add_argument("--steps", type=int, default=5, help="steps with a gradient comparison per config")
    p.add_argument("--seed", type=int, default=0)
    add_lengths_option(p)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    lengths, loss = bench_turns(args.lengths, args.examples, seed=args.seed, high=2048)
    examples = make_examples(lengths, loss, args.seed)
    configs = [
        {"name": "padded b=4, A=8", "mode": "padded", "batch": 4, "accumulation": 8},
        {"name": "padded b=1, A=16", "mode": "padded", "batch": 1, "accumulation": 16},
        {"name": "packed W=2048 k=1, A=8", "mode": "packed", "window": 2048, "k": 1, "accumulation": 8},
        {"name": "packed W=2048 k=4, A=4", "mode": "packed", "window": 2048, "k": 4, "accumulation": 4},
    ]
    rows = [run(c, examples, lengths, args.steps, args.seed) for c in configs]
    head = f"{'config':<26}{'steps':>6}{'TV mean':>9}{'TV max':>8}{'w ratio':>9}{'w max':>9}{'grad err':>10}{'count us':>10}"
    print(f"bench_loss: {args.examples:,} examples, {LENGTH_SOURCES[args.lengths]}, torch {torch.__version__}")
    print("baseline = mean of per-micro-batch means / A; packkit = summed CE / step loss tokens "
          "(TV 0 and ratio 1 for packkit by construction; grad err = |g_baseline - g_packkit| / |g_packkit|)")
    print(head)
    for r in rows:
        ge = "n/a" if r["grad_rel_err_mean"] is None else f"{r['grad_rel_err_mean']:.3f}"
        print(f"{r['config']:<26}{r['steps']:>6}{r['weight_tv_mean']:>9.3f}{r['weight_tv_max']:>8.3f}"
              f"{r['max_weight_ratio_mean']:>9.1f}{r['max_weight_ratio_max']:>9.1f}{ge:>10}"
              f"{r['count_us_median']:>10.0f}")
    print(json.dumps({"bench": "loss", "examples": args.examples, "lengths": args.lengths, "results": rows}))


if __name__ == "__main__":
    main()
