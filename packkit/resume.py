"""A sampler's resume: the state it saves (:meth:`~packkit.sampler.PackedBatchSampler.state_dict`) and loads,
the per-rank states of an older packkit merged, the facts of the step in progress, and the count of the batches the
training loop consumed (asked of the DataLoader that drives the sampler).

The sampler's methods of those names call these; this room is imported at the first of them (or the first pass
over a sampler), so a command that deals an epoch and saves nothing (``packkit plan``, ``packkit waste``) never
compiles it. The story of the state, its fields and the loaders is the sampler's module docstring
(:mod:`packkit.sampler`, *Resuming, on any number of ranks*).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref

import numpy as np

from .errors import ArgumentError, arg, check_int
from .csr import select_batches
from .integrations import accelerate  # accelerate's loader and batch sampler wrappers, in one place
from .positions import STATE_VERSION, Point, RepeatWarning, ResumeWarning, bits_mask, mask_bits
from .short_steps import partial_rows
from .states import StateFields

__all__ = ["state_dict", "load_state_dict", "merge_state_dicts", "step_facts", "asking_loader", "consumed", "Pass",
           "resumed_step"]


def _planner() -> int:
    """:data:`packkit.balance.PLANNER`, the newest cost-target planner: read where a state of a sampler that plans
    to cost (``balance="compute"``) is loaded, whose sampler imported :mod:`packkit.balance` already."""
    from .balance import PLANNER  # lazy: the cost-target planners, for balance="compute" only
    return PLANNER


class Pass:
    """One pass of a sampler over its schedule: an iterator of batches (lists of example indices), made by the sampler's
    ``iter()`` (:mod:`packkit.sampler`).

    It starts at its first ``next()`` (:func:`start`), so an iterator made and dropped spends nothing.
    ``loader``, ``shard``: weak references to the DataLoader iterator (and accelerate's ``DataLoaderShard`` around it)
    that called ``iter()``, or None; ``yielded``: batches handed out.
    """

    __slots__ = ("sampler", "loader", "shard", "sched", "yielded", "__weakref__")

    def __init__(self, sampler, asked: tuple):
        self.sampler, (self.loader, self.shard) = sampler, asked
        self.sched = None
        self.yielded = 0

    def __iter__(self):
        return self

    def __reduce__(self):  # a sampler pickled mid-pass keeps its count; the loader asking is this process's
        return _unpickle_pass, (self.sampler, self.sched, self.yielded)

    def __next__(self) -> list:
        if self.sched is None:
            self.sched = start(self.sampler, self)
        sched, i = self.sched, self.yielded
        if i >= sched.rows:
            raise StopIteration
        g = i * sched.world_size + self.sampler.rank
        self.yielded = i + 1  # counted before the consumer sees the batch
        return sched.flat[sched.ptr[g]:sched.ptr[g + 1]].tolist()


def start(sampler, p):
    """``p``'s first batch is asked for (:meth:`Pass.__next__`): it becomes ``sampler``'s pass in progress, from the
    position it starts at (a resume's moved steps and a short step's repeats said once); its schedule."""
    sched = sampler.schedule()
    if sched.moved:
        warnings.warn(ResumeWarning(f"{type(sampler).__name__} resumed on world_size={sampler.world_size}: "
                                    f"{sched.moved}; no example is repeated or skipped"), stacklevel=3)
    sampler._active = (sched, sampler._point, sampler._offset, p)
    if sched.repeats.any() and not getattr(sampler, "_said_repeats", False):
        sampler._said_repeats = True
        warnings.warn(RepeatWarning(
            f"{type(sampler).__name__} (epoch {sampler._epoch_num}): {int(sched.repeats.sum())} micro-batch(es) of a "
            f"step with fewer examples than the {sampler.world_size} ranks repeat examples so that every rank runs "
            "one; they weigh 0 where accumulation_step counts the step with facts=sampler.step_facts() or "
            "repeats=sampler.step_repeats() (a Trainer with packkit.loss.WeightedLossMixin does), else they count "
            f"twice (epoch_stats().repeated = {sched.repeated})"),
            stacklevel=3)
    sampler._point, sampler._offset, sampler._loaded = Point(), 0, False  # the pass after this one: the whole epoch
    return sched


def _unpickle_pass(sampler, sched, yielded) -> Pass:
    p = Pass(sampler, (None, None))
    p.sched, p.yielded = sched, yielded
    return p


def asking_loader() -> tuple:
    """Weak references to the torch DataLoader iterator whose construction or reset calls ``iter()`` on a
    batch sampler, and to accelerate's ``DataLoaderShard`` around it; ``(None, None)`` for another caller.

    A DataLoader hands its iterator nothing else: this is how a sampler learns which loop consumes it.
    accelerate's ``BatchSamplerShard`` dealing a sampler that is already one rank's over its processes
    again (``accelerator.prepare`` on many processes) would train a fraction of the data: refused.
    """
    dl = sys.modules.get("torch.utils.data.dataloader")  # no torch loaded: no DataLoader asking
    loader = shard = None
    f = sys._getframe(2) if dl is not None else None
    for _ in range(8):
        if f is None:
            break
        obj = f.f_locals.get("self")
        accelerate.check_not_dealt_twice(obj)
        if loader is None and isinstance(obj, dl._BaseDataLoaderIter):
            loader = obj
        elif loader is not None and accelerate.is_loader_shard(obj):
            shard = obj
            break
        f = f.f_back
    return (None if loader is None else weakref.ref(loader), None if shard is None else weakref.ref(shard))


def consumed(sampler, p, caller: str, offset: int) -> int:
    """Batches of pass ``p`` (which starts ``offset`` batches into the epoch) of ``sampler`` the training loop has
    received; ``caller``: the module that asked (``__name__``).

    A DataLoader's workers fetch ahead of the loop, so the sampler's own count runs ahead of it: where
    the DataLoader iterator that asked for ``p`` still draws from ``p``, its count of the batches it
    handed to the loop is the answer (less the one batch accelerate's loader holds back). torchdata's
    ``StatefulDataLoader`` saves the sampler's state as each batch is drawn, so its own calls get the
    sampler's own count; asked by anyone else (``step_facts()`` in the loop), its count is the epoch's,
    the batches before a resume included (restored with its state), so ``offset`` comes off it. Where
    neither can be told, a :class:`ResumeWarning` says so.
    """
    loader = p.loader() if p.loader is not None else None
    if loader is None or caller.startswith("torchdata."):
        return p.yielded
    workers = getattr(loader, "_num_workers", 0)
    stateful = type(loader).__module__.startswith("torchdata.")
    # the loader draws from p, or through a wrapper that passes every batch (accelerate's BatchSamplerShard made a
    # passthrough on many processes, where Trainer's DataLoaderShard iterates the wrapper): it counts p's batches
    skip = getattr(loader, "_index_sampler", None)
    passes = not accelerate.is_skipping(skip) and accelerate.draws_from(skip, sampler)
    held = accelerate.held_back(p.shard() if p.shard is not None else None)
    if (getattr(loader, "_sampler_iter", None) is p or passes) and isinstance(getattr(loader, "_num_yielded", None),
                                                                              int):
        if workers and not getattr(loader, "_in_order", True):
            warnings.warn(ResumeWarning(
                f"{type(sampler).__name__}.state_dict() behind DataLoader(in_order=False) cannot tell which "
                "batches the loop trained: pass in_order=True, or state_dict(batches_consumed=...)"), stacklevel=4)
        return max(0, min(p.yielded, loader._num_yielded - held - (offset if stateful else 0)))
    # accelerate's skip_first_batches (Trainer's resume)
    skipped = accelerate.skipped_batches(skip)
    if skipped is not None and isinstance(getattr(loader, "_num_yielded", None), int) and \
            accelerate.draws_from(skip, sampler):
        return max(0, min(p.yielded, skipped + loader._num_yielded - held))
    if workers or p.shard is not None:
        fix = ("save loader.state_dict() instead (it holds the sampler's)" if stateful else
               "pass state_dict(batches_consumed=...) with the batches this epoch's loop consumed")
        warnings.warn(ResumeWarning(
            f"{type(sampler).__name__}.state_dict() counts {p.yielded} batches handed out this pass, but a "
            f"loader fetched some of them ahead of the loop and cannot be asked: {fix}"), stacklevel=4)
    return p.yielded


def point_after(sampler, sched, base: Point, rows: int) -> Point:
    """The position after ``rows`` rows of ``sched`` (a :class:`~packkit.sampler.Schedule` of ``sampler``, started
    at ``base``)."""
    seq_step = base.seq_step or sampler._step_units
    s = int(np.searchsorted(sched.step_row, rows, side="right")) - 1
    if s >= sched.step_start.size:  # the epoch is done
        end = int(sched.step_start[-1] + sched.step_span[-1]) if sched.step_start.size else base.start
        return Point(start=end, seq_step=seq_step)
    r_in = rows - int(sched.step_row[s])
    mask = sched.mask0 if s == 0 else 0
    start, span = int(sched.step_start[s]), int(sched.step_span[s])
    if r_in == 0 and mask == 0:
        return Point(start=start, seq_step=seq_step)
    return Point(start=start, span=span, mask=mask, deal=(sampler.world_size, sampler.accumulation_steps),
                 rows=r_in, seq_step=seq_step)


def state_dict(sampler, batches_consumed: int | None, caller: str) -> dict:
    """What ``sampler.state_dict(batches_consumed=...)`` returns (its docstring says what the state holds);
    ``caller``: the module that asked (``__name__``)."""
    if sampler._active is not None:
        sched, base, offset, p = sampler._active
        done_rows = consumed(sampler, p, caller, offset) if batches_consumed is None else p.yielded
    else:
        sched, base, offset = sampler.schedule(), sampler._point, sampler._offset
        done_rows = 0
    total = offset + sched.rows
    done = offset + done_rows if batches_consumed is None else batches_consumed
    done = check_int(done, "batches_consumed", low=offset, high=total)
    point = point_after(sampler, sched, base, int(done) - offset) if done > offset or base.clean else base
    return {
        "sampler": type(sampler).__name__,
        "version": STATE_VERSION,
        "epoch": sampler._epoch_num,
        "seed": sampler.seed,
        "batches_yielded": int(done),
        "batches_per_epoch": total,
        "world_size": sampler.world_size,
        "accumulation_steps": sampler.accumulation_steps,
        "step_units": point.seq_step or sampler._step_units,
        "start": point.start,
        "span": point.span,
        "mask": format(point.mask, "x"),
        "deal": list(point.deal) if point.deal else None,
        "rows": point.rows,
        "fingerprint": sampler._fingerprint(),
        **({} if sampler._planner is None else {"planner": sampler._planner}),
    }


def step_facts(sampler, batches_consumed: int | None, caller: str):
    """What ``sampler.step_facts(batches_consumed=...)`` returns (its docstring says what); ``caller``: the
    module that asked (``__name__``). The counts and ``Z`` are the step's unique examples': its batches that only
    repeat another's (``Schedule.repeats``) are left out, and named in ``repeats``."""
    if sampler._weights is None:
        raise ArgumentError("{f} needs the sampler's {w} and {n}: pass them to the sampler, or leave the step's "
                            "normaliser to accumulation_step's collective", f=arg("step_facts"),
                            w=arg("loss_weighting"), n=arg("loss_lengths"))
    whole, lo, hi, mine = received_step(sampler, batches_consumed, caller, "step_facts")
    R = whole.world_size
    step = whole.flat[whole.ptr[lo * R]:whole.ptr[hi * R]]
    if whole.repeats[lo * R:hi * R].any():  # the step's examples once: its repeated batches left out
        step = step[~np.repeat(whole.repeats[lo * R:hi * R], whole.sizes[lo * R:hi * R])]
    rule, counts, z = sampler._weights
    token_mean = rule.is_token_mean
    from .weighting import StepFacts  # lazy: the weighting is resolved where the sampler was given one
    return StepFacts(weighting=None if token_mean else rule.name, loss_tokens=int(counts[step].sum()),
                     loss_normalizer=float(z[step].sum()) + rule.step_constant(),
                     tokens=int(sampler._lengths_used()[step].sum()), examples=int(step.size), world_size=R,
                     micro=tuple((int(counts[b].sum()), float(z[b].sum())) for b, _ in mine),
                     repeats=tuple(r for _, r in mine))


def received_step(sampler, batches_consumed, caller: str, what: str) -> tuple:
    """``(schedule, first row, end row, mine)``: the optimiser step of the last batch the loop received, in the
    schedule that holds it whole, and this rank's micro-batches of it, ``(examples, is a repeat)`` each."""
    if sampler._active is None:
        raise ValueError(f"{type(sampler).__name__}.{what}(): no batch of this pass was drawn yet: ask after "
                         "the step's micro-batches are drawn from the loader")
    sched, base, offset, p = sampler._active
    done = offset + consumed(sampler, p, caller, offset) if batches_consumed is None else batches_consumed
    row = check_int(done, "batches_consumed", low=offset + 1, high=offset + sched.rows) - offset - 1
    s = int(np.searchsorted(sched.step_row, row, side="right")) - 1
    lo, hi = int(sched.step_row[s]), int(sched.step_row[s + 1])
    R = sched.world_size
    mine = [(sched.flat[sched.ptr[b]:sched.ptr[b + 1]], bool(sched.repeats[b]))
            for b in range(max(lo, 0) * R + sampler.rank, hi * R, R)]
    if lo < 0:  # resumed inside this step under the same deal: the step from its first row
        whole = sampler._schedule(dataclasses.replace(base, rows=0))
        return whole, 0, int(whole.step_row[1]), mine
    return sched, lo, hi, mine


def merge_state_dicts(sampler, states) -> dict:
    """What ``sampler.merge_state_dicts(states)`` returns: one state from the per-rank states of a run."""
    states = list(states)
    if not states:
        raise ValueError("merge_state_dicts needs the states of every rank, got none")
    for state in states:  # each a state of this sampler, every field checked
        read_state(sampler, state)
    if all(s.get("version") == STATE_VERSION for s in states):
        for s in states[1:]:
            bad = [k for k in s if s[k] != states[0].get(k)]
            if bad:
                raise ValueError(f"the rank states differ in {', '.join(bad)}: save them at the same step")
        return dict(states[0])
    for name in ("version", "sampler", "epoch", "seed", "world_size", "fingerprint"):
        vals = {repr(s.get(name)) for s in states}
        if len(vals) > 1:
            raise ValueError(f"the rank states differ in {name!r} ({', '.join(sorted(vals))}): they are "
                             "not from one run")
    lacking = [i for i, s in enumerate(states) if "rank" not in s]
    if lacking:
        raise ValueError(f"sampler state field 'rank': states {lacking} lack it; an older packkit's per-rank "
                         "states each name their rank: pass them as saved")
    R = int(states[0]["world_size"])
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(R)):
        missing = sorted(set(range(R)) - set(ranks))
        raise ValueError(f"merge_state_dicts needs one state per rank of world_size={R}; missing ranks "
                         f"{missing}, repeated {sorted(r for r in set(ranks) if ranks.count(r) > 1)}: "
                         "a rank's progress left out would be trained again")
    yields = {int(s["rank"]): int(s["batches_yielded"]) for s in states}
    lo, hi = min(yields.values()), max(yields.values())
    if hi - lo > 1:
        raise ValueError(f"the ranks yielded {lo} to {hi} batches: states saved at one training step "
                         "differ by at most one")
    k = sampler._k
    S = R * k  # an older packkit dealt one micro-batch per rank a step
    state = {**states[0], "version": STATE_VERSION, "batches_yielded": lo, "accumulation_steps": 1, "step_units": S,
             "start": lo * S, "span": 0, "mask": "0", "deal": None, "rows": 0}
    state.pop("rank", None)
    if hi > lo:
        bits = np.zeros(S, bool)
        for r, y in yields.items():
            if y > lo:
                bits[r * k:(r + 1) * k] = True
        state.update(span=S, mask=format(bits_mask(bits), "x"))
    return state


def load_state_dict(sampler, state: dict) -> None:
    """``sampler.load_state_dict(state)``: every field checked (:func:`read_state`), then assigned."""
    epoch, point, done, planner = read_state(sampler, state)
    # -- every field checked: assign --
    if planner != sampler._planner:  # the run's windows are the planner's it began with
        sampler._planner, sampler._sched_cache, sampler._stats_cache = planner, {}, None
    sampler._epoch_num, sampler._point = epoch, point
    sampler._offset, sampler._active, sampler._loaded = done, None, True


def read_state(sampler, state) -> tuple[int, Point, int, int | None]:
    """``(epoch, position, batches done, planner)`` of a saved state, every field checked against this sampler
    (see the sampler's ``load_state_dict``); nothing is assigned. ``planner``: the cost-target planner whose windows the
    state counts, its function in :data:`packkit.balance.PLANNERS` (a state without the field was saved by
    planner 1, :func:`packkit.balance.greedy_to_cost`)."""
    f = StateFields(state, owner="sampler", versions=(STATE_VERSION,), legacy=1)
    name = type(sampler).__name__
    f.equal("sampler", name, f"the state is from another sampler: build a {f.state.get('sampler')} "
            "with the arguments of the run that saved it")
    f.equal("fingerprint", sampler._fingerprint(), "the state was saved for other lengths or options (batch "
            "size, window, policy): build the sampler with the same dataset and arguments before loading")
    seed = f.int("seed")
    if seed != sampler.seed:
        f.fail("seed", f"the state was saved with seed={seed}, this sampler has seed={sampler.seed}: build it "
               f"with seed={seed} to resume that run")
    epoch, old_R, done = f.int("epoch"), f.int("world_size", low=1), f.int("batches_yielded")
    planner = sampler._planner
    if planner is not None:
        planner = f.int("planner", low=1, high=_planner()) if "planner" in f.state else 1
    k = sampler._k
    if f.version == STATE_VERSION:
        total = f.int("batches_per_epoch")
        f.int("accumulation_steps", low=1)
        seq_step = f.int("step_units", low=1)
        start, span, rows, mask = f.int("start"), f.int("span"), f.int("rows"), f.hex("mask")
        deal = f.ints("deal", 2, low=1)
    else:  # an older packkit: one micro-batch per rank a step, this rank's count for every rank
        total = f.int("batches_per_epoch") if "batches_per_epoch" in f.state else None
        if "rank" in f.state:
            f.int("rank", high=old_R - 1)
        seq_step, start, span, mask, deal, rows = old_R * k, done * old_R * k, 0, 0, None, 0
    f.done()
    if total is not None and done > total:  # the two fields disagree: either may be the damaged one
        f.fail("batches_yielded", f"{done} is more than the epoch's batches_per_epoch={total} "
               "(field 'batches_per_epoch' of the same state: one of the two is damaged)")
    if seq_step % k:
        f.fail("step_units", f"{seq_step} is not a multiple of {k} {sampler._unit_name} a batch")
    if rows and deal is None:
        f.fail("deal", f"is None, but rows={rows} rows of a step are done: the deal says which")
    if deal is not None and rows > deal[1]:
        f.fail("rows", f"{rows} is more than the {deal[1]} rows a step of the deal {list(deal)} has")
    if (mask or rows) and not span:
        f.fail("span", "is 0, but the state says a step is in progress (mask or rows)")
    if start == 0 and mask == 0 and rows == 0:  # nothing used yet: this run cuts its own steps
        seq_step = sampler._step_units
    own, sampler._planner = sampler._planner, planner
    try:  # the epoch the state describes, under its planner; nothing assigned yet
        seq = sampler._sequence(epoch, seed, seq_step)
    except ValueError as exc:
        f.fail("step_units", f"{seq_step} cannot cut epoch {epoch}: {exc}")
    finally:
        sampler._planner = own
    units = f"the epoch's {seq.units} {sampler._unit_name}"
    if start > seq.units:
        f.fail("start", f"{start} is past the end of {units}")
    if start + span > seq.units:
        f.fail("span", f"{span} {sampler._unit_name} from start={start} end past the end of {units}")
    if mask >> span:
        f.fail("mask", f"{mask:x} marks {sampler._unit_name} past the {span} of the step in progress (span)")
    if span and mask == (1 << span) - 1:  # a step wholly used is over: a state of this packkit says start+span
        f.fail("mask", f"{mask:x} marks every one of the {span} {sampler._unit_name} of the step in progress "
               "as used, but the step is not over (start)")
    return epoch, Point(start=start, span=span, mask=mask, deal=deal, rows=rows, seq_step=seq_step), done, planner


# ----------------------------------------------------------------------------------------------
# the step in progress at a loaded position, dealt again
# ----------------------------------------------------------------------------------------------


def _chunks(units: np.ndarray, size: int) -> list[np.ndarray]:
    """``units`` in consecutive runs of ``size`` (the last shorter): ``_chunks([1, 2, 3], 2) -> [[1, 2], [3]]``."""
    return [units[i:i + size] for i in range(0, units.size, size)]


def deal_step(sampler, seq, units: np.ndarray, S: int):
    """One step's batches of ``units`` (of the sequence ``seq``), as the schedule deals it: the full deal for ``S``
    units, else the partial (:mod:`packkit.short_steps`)."""
    R, m, k = sampler.world_size, sampler.accumulation_steps, sampler._k
    if units.size == S:
        order = sampler._deal_full(seq, units.reshape(1, S), R, m)
        return ([select_batches(seq.flat, seq.ptr, order[i:i + k])[0] for i in range(0, order.size, k)],
                [k] * (order.size // k), [False] * (order.size // k))
    return sampler._deal_short(seq, units, R, m)


def dealt_units(sampler, seq, units: np.ndarray, deal: tuple, rows: int) -> np.ndarray:
    """Units handed out by the first ``rows`` rows of ``units`` dealt as ``deal = (R, m)`` (another run's world size:
    the same deal functions with its ``R`` and ``m``)."""
    R, m, k = int(deal[0]), int(deal[1]), sampler._k
    S = R * m * k
    if units.size == S:
        return sampler._deal_full(seq, units.reshape(1, S), R, m)[:rows * R * k]
    return np.concatenate([units[:0], *partial_rows(units, R, m, k)[:rows]])


def resumed_step(sampler, seq, point: Point, S: int, add_step, notes: list) -> tuple[int, int]:
    """The step in progress at ``point`` (a loaded position inside a step of ``seq``), dealt in steps of ``S`` units:
    on the same deal, its units not yet used go on inside it; on another world size, what the old deal had not handed
    out yet becomes steps of their own (said in ``notes``). ``add_step(batches, pieces, repeats, start, span)`` takes
    each step. Returns ``(skip, mask0)``: the rows of the first step done, and the units of it used before it was
    dealt (a bit mask)."""
    R, m = sampler.world_size, sampler.accumulation_steps
    lo, hi = point.start, point.start + point.span
    left = np.arange(lo, hi)[~mask_bits(point.mask, lo, hi)]
    if point.deal == (R, m):  # the same deal: go on inside it
        add_step(*deal_step(sampler, seq, left, S), lo, hi - lo)
        return point.rows, point.mask
    used = np.zeros(hi - lo, bool)  # what the old deal had not handed out yet, dealt to this world size
    used[mask_bits(point.mask, lo, hi)] = True
    if point.deal is not None and point.rows:
        done = dealt_units(sampler, seq, left, point.deal, point.rows)
        used[done - lo] = True
    rest = np.arange(lo, hi)[~used]
    mask0 = 0
    for i, chunk in enumerate(_chunks(rest, S)):
        c_lo, c_hi = int(chunk[0]), int(chunk[-1]) + 1
        add_step(*deal_step(sampler, seq, chunk, S), c_lo, c_hi - c_lo)
        if i == 0:
            mask0 = bits_mask(used[c_lo - lo:c_hi - lo])
    notes.append(f"the step in progress ({rest.size} of {hi - lo} {sampler._unit_name} left) is dealt "
                 f"to world_size={R} as {len(_chunks(rest, S))} step(s) of its own")
    return 0, mask0
