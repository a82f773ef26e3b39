"""Compute balance across data-parallel ranks: packkit's policies beside verl's Karmarkar-Karp partition
and round-robin, on real chat lengths, in one run.

Lengths: ``benchlib.chat_lengths(200_000)``, 17,545 ShareGPT conversations under Qwen3's tokenizer drawn
200,000 times *with replacement*; examples longer than the window are truncated (``overflow="truncate"``).
A document of ``L`` tokens costs ``24576 * L + L**2`` (verl's workload model for a 7B). Every policy is
measured here from the batches each rank gets (``sampler.schedule()``), not from the sampler's report:

* imbalance = sum over optimiser steps of the costliest rank / sum over steps of the mean rank (1.0 is
  perfect; a synchronous run takes that many times a perfectly balanced one);
* examples/step CV = std / mean of the examples a step holds over all ranks (full steps), and its ratio
  to random steps' (what balancing did to step composition);
* windows over the lower bound ``ceil(tokens / W)``;
* plan time: building the sampler and its epoch (best of 3); for the cost-target packer at 1M documents
  (k = 1, W = 32k, dp 8) against ``--baseline``'s ``pack_to_cost`` (a named revision, loaded with ``git show``;
  aaf59a2's is planner 1, one document at a time, a166061's planner 2) in alternating pairs, garbage collected
  outside the clock, in CPU time (``time.process_time``): medians, the spread of the pair ratios, the load
  average beside them, and the imbalance and windows of each one's schedule;
* the cost-target planners side by side (``balance="compute"``, k = 1 and 2, dp 8, W = 2k-32k): today's, the
  baseline's and planner 1 (``greedy_to_cost``), on the same lengths: imbalance, windows over the lower bound,
  examples/step CV.

Policies, on the same windows (best-fit decreasing) unless said:

* ``random``: packkit ``balance=None``, random steps, each rank its run of ``k`` windows;
* ``round-robin``: the same steps, window ``j`` of a step to rank ``j % dp`` (a plain distributed sampler);
* ``verl KK``: the same steps, each partitioned into ``dp`` parts of ``k`` windows by the Karmarkar-Karp
  largest differencing method with equal sizes (verl's ``get_seqlen_balanced_partitions``, rewritten here
  from its published description);
* ``packkit sqlen``: steps of similar attention cost over the whole epoch (``balance="sqlen"``);
* ``packkit compute``: random steps, the step's windows dealt by LPT under the cost model (then the best
  swaps between the heaviest and the lightest rank); for ``k <= 2``
  windows built step by step to a cost target, long documents queued (``balance="compute"``).

    python benchmarks/bench_balance.py            # ~2 minutes on 2 busy cores
    python benchmarks/bench_balance.py --n 50000 --plan-n 200000

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np
from benchlib import ab_pairs, chat_lengths, emit_json, loadavg, module_at, ratio_spread, versions

from packkit.balance import CostModel, compute_imbalance, variation
from packkit.sampler import PackedBatchSampler

COST = CostModel(linear=24576.0)
CONFIGS = [  # (window, dp, k windows per rank per step)
    (8192, 8, 1), (8192, 8, 4), (8192, 8, 8), (8192, 8, 16), (8192, 32, 8), (8192, 32, 16), (32768, 8, 1),
    (32768, 8, 2),
]


def karmarkar_karp(values, parts: int) -> list[list[int]]:
    """Indices of ``values`` in ``parts`` partitions of equal size (``len(values)`` a multiple of
    ``parts``), by largest differencing: values sorted, each run of ``parts`` consecutive values a
    partial solution with one value per part; the two partial solutions of largest spread are merged
    (the heaviest part of one with the lightest of the other) until one is left."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    heap = []
    for n, start in enumerate(range(0, len(order), parts)):
        sets = [(float(values[i]), [i]) for i in order[start:start + parts]]
        sets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), n, sets))
    n = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[parts - 1 - i][0], a[i][1] + b[parts - 1 - i][1]) for i in range(parts)]
        merged.sort(key=lambda s: -s[0])
        n += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), n, merged))
    return [s[1] for s in heap[0][2]]


def figures(sched, lengths, window, dp) -> dict:
    """Imbalance, examples/step CV and windows from a schedule's batches (row-major, ``dp`` ranks)."""
    used = np.minimum(lengths, window)
    doc_cost = COST.costs(used)
    csum = np.concatenate(([0.0], np.cumsum(doc_cost[sched.flat])))
    batch_cost = (csum[sched.ptr[1:]] - csum[sched.ptr[:-1]]).reshape(sched.rows, dp)
    starts = sched.step_row[:-1]
    rank_cost = np.add.reduceat(batch_cost, starts, axis=0)
    examples = np.add.reduceat(np.diff(sched.ptr).reshape(sched.rows, dp).sum(axis=1), starts)
    full = sched.step_span == sched.step_span.max()  # the last, partial step left out
    return {"imbalance": compute_imbalance(rank_cost), "cv": variation(examples[full]),
            "windows": int(sched.pieces.sum())}


def step_windows(sampler):
    """Window costs and examples of each full step (same steps as the sampler's), from its plan."""
    plan = sampler.plan()
    S = sampler.step_batches * sampler.windows_per_batch
    seg_cost = COST.costs(plan.seg_length)
    win_cost = np.add.reduceat(seg_cost, plan.window_ptr[:-1])
    win_examples = np.diff(plan.window_ptr)
    full = plan.num_windows // S * S
    return win_cost[:full].reshape(-1, S), win_examples[:full].reshape(-1, S)


def baselines(sampler, dp, k) -> dict:
    """Round-robin and verl's KK over the sampler's own steps."""
    cost, examples = step_windows(sampler)
    rr = cost.reshape(cost.shape[0], k, dp).sum(axis=1)  # window j of a step to rank j % dp
    t = time.perf_counter()
    kk = np.array([[step[p].sum() for p in karmarkar_karp(step.tolist(), dp)] for step in cost])
    kk_time = time.perf_counter() - t
    cv = variation(examples.sum(axis=1))
    return {"round-robin": {"imbalance": compute_imbalance(rr), "cv": cv},
            "verl KK": {"imbalance": compute_imbalance(kk), "cv": cv, "time": kk_time}}


def run(lengths, window, dp, k) -> list[dict]:
    out = []
    lower = -(-int(np.minimum(lengths, window).sum()) // window)
    made = {}
    for policy in (None, "sqlen", "compute"):
        best = None
        for _ in range(3 if policy == "compute" else 1):
            t = time.perf_counter()
            s = PackedBatchSampler(lengths, window=window, windows_per_batch=k, world_size=dp, rank=0, seed=0,
                                   balance=policy, overflow="truncate", cost=COST)
            sched = s.schedule()
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        made[policy] = s
        f = figures(sched, lengths, window, dp)
        name = {None: "random", "sqlen": "packkit sqlen", "compute": "packkit compute"}[policy]
        out.append({"policy": name, **f, "plan_s": best, "queued": s.epoch_stats().queued})
    for name, f in baselines(made[None], dp, k).items():
        out.append({"policy": name, "imbalance": f["imbalance"], "cv": f["cv"], "windows": out[0]["windows"],
                    "plan_s": f.get("time"), "queued": 0})
    random_cv = out[0]["cv"]
    for r in out:
        r.update(window=window, dp=dp, k=k, lower_bound=lower, over_lower=r["windows"] / lower - 1,
                 cv_vs_random=r["cv"] / random_cv if random_cv else 1.0)
    return out


def plan_time(n: int, k: int, window: int = 8192, dp: int = 8) -> float:
    lengths = chat_lengths(n, seed=1)
    best = None
    for _ in range(3 if k > 2 else 1):
        t = time.perf_counter()
        PackedBatchSampler(lengths, window=window, windows_per_batch=k, world_size=dp, rank=0,
                           balance="compute", overflow="truncate", cost=COST).schedule()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best


def plan_ab(n: int, rounds: int, baseline: str, window: int = 32768, dp: int = 8) -> dict:
    """The cost-target packer (``balance="compute"``, k = 1) planning ``n`` documents: today's
    ``pack_to_cost`` (planner 3) against ``baseline``'s (``git show``; a166061: planner 2; aaf59a2: planner 1, one
    document at a time), alternating pairs, garbage collected outside the clock, CPU time; the whole sampler (plan +
    schedule) and ``pack_to_cost`` alone; and what each schedule gives (imbalance, windows over the lower bound)."""
    import packkit.sampler as sampler_module

    lengths = chat_lengths(n, seed=1)
    ours = sampler_module.pack_to_cost
    theirs = module_at(baseline, "packkit/balance.py").pack_to_cost

    def sampler_with(fn):
        def run():
            sampler_module.pack_to_cost = fn
            try:
                return PackedBatchSampler(lengths, window=window, windows_per_batch=1, world_size=dp, rank=0,
                                          balance="compute", overflow="truncate", cost=COST).schedule()
            finally:
                sampler_module.pack_to_cost = ours
        return run

    lower = -(-int(np.minimum(lengths, window).sum()) // window)
    made = {}
    for name, fn in (("new", ours), ("old", theirs)):
        f = figures(sampler_with(fn)(), lengths, window, dp)
        made[name] = {"imbalance": f["imbalance"], "windows": f["windows"], "over_lower": f["windows"] / lower - 1}
    same = made["new"] == made["old"]
    used = np.minimum(lengths, window)
    order = np.random.default_rng(2).permutation(n)
    alone = {fn: (lambda fn=fn: fn(used, order, window=window, step_windows=dp, cost=COST)) for fn in (ours, theirs)}
    load = [loadavg()]
    t_new, t_old = ab_pairs(sampler_with(ours), sampler_with(theirs), rounds, clock=time.process_time)
    load.append(loadavg())
    p_new, p_old = ab_pairs(alone[ours], alone[theirs], rounds, clock=time.process_time)
    load.append(loadavg())
    return {"n": n, "baseline": baseline, "identical": bool(same), "schedules": made, "load": load,
            "sampler": {"new": t_new, "old": t_old, "ratio_old_new": ratio_spread(t_old, t_new)},
            "pack_to_cost": {"new": p_new, "old": p_old, "ratio_old_new": ratio_spread(p_old, p_new)}}


def planners(lengths, baseline: str, dp: int = 8) -> list[dict]:
    """The cost-target planners on the same lengths and sampler (``balance="compute"``, k = 1 and 2): today's
    ``pack_to_cost``, ``baseline``'s and planner 1 (``greedy_to_cost``), from each one's schedule."""
    import packkit.sampler as sampler_module
    from packkit.balance import greedy_to_cost

    ours = sampler_module.pack_to_cost
    fns = {"today": ours, baseline: module_at(baseline, "packkit/balance.py").pack_to_cost, "planner 1": greedy_to_cost}
    out = []
    for window in (2048, 4096, 8192, 16384, 32768):
        lower = -(-int(np.minimum(lengths, window).sum()) // window)
        for k in (1, 2):
            for name, fn in fns.items():
                sampler_module.pack_to_cost = fn
                try:
                    sched = PackedBatchSampler(lengths, window=window, windows_per_batch=k, world_size=dp, rank=0,
                                               seed=0, balance="compute", overflow="truncate", cost=COST).schedule()
                finally:
                    sampler_module.pack_to_cost = ours
                f = figures(sched, lengths, window, dp)
                out.append({"window": window, "k": k, "planner": name, "imbalance": f["imbalance"], "cv": f["cv"],
                            "over_lower": f["windows"] / lower - 1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000, help="documents (drawn with replacement past 17,545)")
    ap.add_argument("--plan-n", type=int, default=1_000_000, help="documents for the planning-time target")
    ap.add_argument("--baseline", default="a166061", help="revision whose pack_to_cost the 1M k=1 case and the "
                    "planners' table run against (a166061: planner 2; aaf59a2: planner 1, one document at a time)")
    ap.add_argument("--ab-rounds", type=int, default=5, help="alternating pairs for the 1M k=1 case")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()
    lengths = chat_lengths(args.n, seed=0)
    rows = []
    for window, dp, k in CONFIGS:
        rows += run(lengths, window, dp, k)
    table = planners(lengths, args.baseline)
    t_lpt = plan_time(args.plan_n, 8)
    ab = plan_ab(args.plan_n, args.ab_rounds, args.baseline)
    t_doc = ab["sampler"]["ratio_old_new"]["den_median"]

    def pick(window, dp, k, policy):
        return next(r for r in rows if (r["window"], r["dp"], r["k"], r["policy"]) == (window, dp, k, policy))

    checks = []
    for dp in (8, 32):
        for k in (8, 16):
            r = pick(8192, dp, k, "packkit compute")
            checks.append((f"compute W=8k dp {dp} k={k}: imbalance <= 1.02", r["imbalance"] <= 1.02,
                           f"{r['imbalance']:.4f}"))
            checks.append((f"compute W=8k dp {dp} k={k}: examples/step CV within 5% of random",
                           abs(r["cv_vs_random"] - 1) <= 0.05, f"{r['cv_vs_random']:.3f}x random"))
    r = pick(32768, 8, 1, "packkit compute")
    checks.append(("compute W=32k dp 8 k=1: imbalance <= 1.05", r["imbalance"] <= 1.05, f"{r['imbalance']:.4f}"))
    checks.append(("compute W=32k dp 8 k=1: windows <= lower bound + 1%", r["over_lower"] <= 0.01,
                   f"+{100 * r['over_lower']:.2f}%"))
    checks.append((f"plan {args.plan_n:,} documents (compute, W=8k, dp 8, k=8) <= 1 s", t_lpt <= 1.0, f"{t_lpt:.2f} s"))
    sp, pc = ab["sampler"]["ratio_old_new"], ab["pack_to_cost"]["ratio_old_new"]
    sn, so = ab["schedules"]["new"], ab["schedules"]["old"]
    checks.append((f"plan {args.plan_n:,} documents (compute, W=32k, dp 8, k=1, cost-target packer) <= 1 s",
                   t_doc <= 1.0, f"median {t_doc:.2f} s over {sp['pairs']} pairs (range {min(ab['sampler']['new']):.2f}-"
                   f"{max(ab['sampler']['new']):.2f}); {args.baseline} {sp['num_median']:.2f} s; {args.baseline}/today "
                   f"{sp['median']:.2f}x (pairs {sp['low']:.2f}-{sp['high']:.2f}); pack_to_cost alone "
                   f"{pc['den_median']:.2f} s vs {pc['num_median']:.2f} s, {pc['median']:.2f}x ({pc['low']:.2f}-"
                   f"{pc['high']:.2f}); imbalance {sn['imbalance']:.4f} vs {so['imbalance']:.4f}, windows "
                   f"+{100 * sn['over_lower']:.2f}% vs +{100 * so['over_lower']:.2f}% over the lower bound; load "
                   f"{'/'.join(f'{x:.1f}' for x in ab['load'])}; CPU time"))

    v = versions()
    print(f"bench_balance: {args.n:,} chat lengths (ShareGPT under Qwen3's tokenizer, drawn with replacement), "
          f"cost 24576 L + L^2, truncated to W; {v}")
    head = f"{'W':>6} {'dp':>3} {'k':>3}  {'policy':<16} {'imbalance':>9} {'ex/step cv':>10} {'vs random':>9} " \
           f"{'windows':>8} {'+LB':>7} {'queued':>6} {'plan s':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        plan = "" if r["plan_s"] is None else f"{r['plan_s']:.3f}"
        print(f"{r['window']:>6} {r['dp']:>3} {r['k']:>3}  {r['policy']:<16} {r['imbalance']:>9.4f} {r['cv']:>10.3f} "
              f"{r['cv_vs_random']:>8.3f}x {r['windows']:>8,} {100 * r['over_lower']:>6.2f}% {r['queued']:>6} {plan:>7}")
    print()
    print(f"cost-target planners, dp 8 (today, {args.baseline}, planner 1): imbalance, windows over the lower bound, "
          f"examples/step cv")
    for r in table:
        print(f"{r['window']:>6} k={r['k']}  {r['planner']:<10} {r['imbalance']:.4f} {100 * r['over_lower']:+6.2f}% "
              f"{r['cv']:.3f}")
    for window in (2048, 4096, 8192, 16384, 32768):
        for k in (1, 2):
            t, p1 = (next(r for r in table if (r["window"], r["k"], r["planner"]) == (window, k, name))
                     for name in ("today", "planner 1"))
            checks.append((f"compute W={window // 1024}k dp 8 k={k}: imbalance and windows no worse than planner 1",
                           t["imbalance"] <= p1["imbalance"] and t["over_lower"] <= p1["over_lower"],
                           f"{t['imbalance']:.4f} vs {p1['imbalance']:.4f}, {100 * t['over_lower']:+.2f}% vs "
                           f"{100 * p1['over_lower']:+.2f}%"))
    print()
    for text, ok, value in checks:
        print(f"  {'met   ' if ok else 'MISSED'} {text}: {value}")
    emit_json({"bench": "balance", "n": args.n, "plan_n": args.plan_n, "versions": v, "rows": rows,
               "plan_time_s": {"compute_k8_w8k": t_lpt, "compute_k1_w32k": t_doc}, "plan_ab_k1": ab, "planners": table,
               "checks": [{"check": t, "met": ok, "value": val} for t, ok, val in checks]}, args.json_out)


if __name__ == "__main__":
    main()
