"""Compute balance that sees images: packkit's ``balance="compute"`` with each example's media units in the
cost (``media_units=``, ``cost=model.config``) against the same deal by text cost alone and against random
steps, on VLM-like rows, in one run.

Rows: ``benchlib.chat_lengths(n)`` (real ShareGPT conversations under Qwen3's tokenizer, drawn with
replacement) plus 0-4 images each (drawn from 0, 1, 1, 2, 3, 4), 256 placeholders and two markers an image
as Gemma 3 lays them out; rows above the window left out. The cost of a row is Gemma 3 4B's
(``CostModel.from_config``: text ``37,888 * L + L**2``, an image's SigLIP encoder ``3.13e7``, about three times
the text work of its placeholders). Every policy is measured from the batches each rank gets
(``sampler.schedule()``) under that true cost, encoder included:

* imbalance = sum over steps of the costliest rank / sum over steps of the mean rank (1.0 is perfect);
* images imbalance: the same ratio over the images each rank encodes;
* plan CPU time: building the sampler and its epoch's schedule, with and without media units, in alternating
  pairs (``time.process_time``, garbage collected outside the clock), the load average beside them.

    python benchmarks/bench_media_balance.py            # ~1 minute on 2 busy cores
    python benchmarks/bench_media_balance.py --quick

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from benchlib import (ab_pairs, chat_lengths, emit_json, gemma3_4b_config, loadavg, parse_quick, ratio_spread,
                      versions, with_images)

from packkit.balance import CostModel, compute_imbalance
from packkit.sampler import PackedBatchSampler

CONFIGS = [(4096, 8, 1), (4096, 8, 8), (8192, 8, 2), (8192, 8, 8)]  # (window, dp, k windows per rank a step)


def rows(n: int, window: int):
    return with_images(chat_lengths(n), window)


def figures(sched, cost, dp) -> dict:
    """Imbalance of ``cost`` (per example) over the ranks' batches of each step (row-major, ``dp`` ranks)."""
    csum = np.concatenate(([0.0], np.cumsum(cost[sched.flat])))
    batch = (csum[sched.ptr[1:]] - csum[sched.ptr[:-1]]).reshape(sched.rows, dp)
    return compute_imbalance(np.add.reduceat(batch, sched.step_row[:-1], axis=0))


def run(n, window, dp, k, model, config, rounds) -> list[dict]:
    lengths, images = rows(n, window)
    true = model.costs(lengths, images)
    kw = dict(window=window, windows_per_batch=k, world_size=dp, rank=0, seed=0, step_batches=dp)
    samplers = {"random": dict(), "compute, text cost": dict(balance="compute", cost=config),
                "compute, with images": dict(balance="compute", cost=config, media_units=images)}
    out = []
    for name, extra in samplers.items():
        sched = PackedBatchSampler(lengths, **kw, **extra).schedule()
        out.append({"policy": name, "imbalance": figures(sched, true, dp),
                    "images_imbalance": figures(sched, images.astype(np.float64), dp),
                    "windows": int(sched.pieces.sum())})
    text_t, media_t = ab_pairs(lambda: PackedBatchSampler(lengths, **kw, **samplers["compute, text cost"]).schedule(),
                               lambda: PackedBatchSampler(lengths, **kw, **samplers["compute, with images"]).schedule(),
                               rounds, clock=time.process_time)
    spread = ratio_spread(media_t, text_t)
    for r in out:
        r.update(window=window, dp=dp, k=k, rows=int(lengths.size), images=int(images.sum()))
    out[-1].update(plan_cpu_s=spread["num_median"], plan_ratio=spread["median"], ratio_low=spread["low"],
                   ratio_high=spread["high"], load=loadavg())
    out[1].update(plan_cpu_s=spread["den_median"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=50_000, help="rows drawn (default 50,000)")
    p.add_argument("--rounds", type=int, default=4, help="alternating pairs of the plan timing")
    p.add_argument("--json-out", default=None)
    args = parse_quick(p, argv, "5,000 rows, 2 pairs", n=5_000, rounds=2)
    config = gemma3_4b_config()
    model = CostModel.from_config(config)
    print(f"cost: linear {model.linear:,.0f}, per image {model.per_unit:.3e}; load {loadavg():.1f}", flush=True)
    table = []
    for window, dp, k in CONFIGS:
        table += run(args.n, window, dp, k, model, config, args.rounds)
    print(f"{'W':>6} {'dp':>3} {'k':>3} {'policy':<22} {'imbalance':>9} {'images':>7} {'windows':>8} {'plan CPU s':>10}"
          f" {'ratio':>6} {'load':>5}")
    for r in table:
        plan = f"{r['plan_cpu_s']:.2f}" if "plan_cpu_s" in r else ""
        ratio = f"{r['plan_ratio']:.2f}" if "plan_ratio" in r else ""
        load = f"{r['load']:.1f}" if "load" in r else ""
        print(f"{r['window']:>6} {r['dp']:>3} {r['k']:>3} {r['policy']:<22} {r['imbalance']:>9.4f} "
              f"{r['images_imbalance']:>7.3f} {r['windows']:>8} {plan:>10} {ratio:>6} {load:>5}")
    emit_json({"bench": "media_balance", "n": args.n, "per_image": model.per_unit, "linear": model.linear,
               "rows": table, **versions("numpy", "transformers")}, args.json_out)


if __name__ == "__main__":
    main(sys.argv[1:])
