"""packkit.states: the one reader of saved states (samplers, streams). Each field is checked as it is read
and refused in one line naming it; a state of an unknown version is refused, not read as another."""

from __future__ import annotations

import pytest

from packkit.states import StateError, StateFields, StateMissingError, StateTypeError


def fields(**state):
    return StateFields({"version": 3, **state}, owner="sampler", versions=(2, 3))


@pytest.mark.parametrize("state, exc, match", [
    ({"version": 4}, StateError, r"field 'version': 4 is not a version this packkit reads \(2, 3\)"),
    ({"version": "3"}, StateError, "field 'version': '3' is not a version"),
    ({"version": True}, StateError, "field 'version': True is not a version"),
    ({}, StateMissingError, "lacks the field 'version'"),
    ([("version", 3)], StateTypeError, "must be the dict state_dict"),
])
def test_unknown_or_missing_version_is_refused(state, exc, match):
    with pytest.raises(exc, match=match) as info:
        StateFields(state, owner="sampler", versions=(2, 3))
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)


def test_a_state_without_version_is_the_legacy_one_only_when_there_is_one():
    assert StateFields({"epoch": 1}, owner="sampler", versions=(1, 2), legacy=1).version == 1


@pytest.mark.parametrize("read, state, exc, match", [
    (lambda f: f.int("epoch"), {}, StateMissingError, "lacks the field 'epoch'"),
    (lambda f: f.int("epoch"), {"epoch": "2"}, StateTypeError, r"'epoch': must be an integer, got '2' \(str\)"),
    (lambda f: f.int("epoch"), {"epoch": True}, StateTypeError, "'epoch': must be an integer, got True"),
    (lambda f: f.int("epoch"), {"epoch": 2.0}, StateTypeError, "'epoch': must be an integer, got 2.0"),
    (lambda f: f.int("epoch"), {"epoch": -1}, StateError, "'epoch': must be at least 0, got -1"),
    (lambda f: f.int("rows", high=3), {"rows": 4}, StateError, r"'rows': must be in \[0, 3\], got 4"),
    (lambda f: f.hex("mask"), {"mask": "xyz"}, StateError, "'mask': must be a hexadecimal string, got 'xyz'"),
    (lambda f: f.hex("mask"), {"mask": "-1"}, StateError, "'mask': must be a hexadecimal"),
    (lambda f: f.hex("mask"), {"mask": 5}, StateTypeError, "'mask': must be a string"),
    (lambda f: f.ints("deal", 2), {"deal": [1]}, StateTypeError, "'deal': must be a list of 2 integers or None"),
    (lambda f: f.ints("deal", 2, low=1), {"deal": [1, 0]}, StateError, "'deal': must hold integers of at least 1"),
    (lambda f: f.text("sampler"), {"sampler": None}, StateTypeError, "'sampler': must be a string, got None"),
    (lambda f: f.equal("seed", 1, "build it with seed=2"), {"seed": 2}, StateError,
     r"'seed': build it with seed=2 \(the state has 2, this one 1\)"),
])
def test_each_bad_field_is_named(read, state, exc, match):
    with pytest.raises(exc, match=match) as info:
        read(fields(**state))
    assert str(info.value).startswith("sampler state") and "\n" not in str(info.value)


def test_good_fields_read_and_unknown_ones_refused():
    f = fields(epoch=2, mask="1f", deal=[4, 2], name="x", seed=7)
    assert (f.int("epoch"), f.hex("mask"), f.ints("deal", 2), f.text("name"), f.equal("seed", 7, "")) == (
        2, 31, (4, 2), "x", 7)
    f.done()
    g = fields(epoch=2, epohc=3)
    g.int("epoch")
    with pytest.raises(StateError, match="field 'epohc': is not a field of a version-3 sampler state"):
        g.done()


# ----------------------------------------------------------------------------------------------
# sampler states: every kind of damage refused by name, the sampler unchanged
# ----------------------------------------------------------------------------------------------

import numpy as np  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from packkit.sampler import LengthGroupedSampler, PackedBatchSampler, TokenBudgetBatchSampler  # noqa: E402

LENGTHS = np.random.default_rng(3).integers(1, 64, size=200)
MAKE = {
    "packed": lambda L=LENGTHS, **kw: PackedBatchSampler(L, **{
        "window": 64, "windows_per_batch": 2, "rank": 1, "world_size": 4, "step_batches": 8, "seed": 4, **kw}),
    "grouped": lambda L=LENGTHS, **kw: LengthGroupedSampler(L, **{
        "batch_size": 3, "rank": 1, "world_size": 4, "step_batches": 8, "seed": 4, **kw}),
    "budget": lambda L=LENGTHS, **kw: TokenBudgetBatchSampler(L, **{
        "max_tokens": 96, "rank": 1, "world_size": 4, "step_batches": 8, "seed": 4, "balance": "compute", **kw}),
}


def saved(kind: str) -> dict:
    """A state inside an optimiser step (3 micro-batches of 2 a step done): every field carries something."""
    s = MAKE[kind]()
    s.set_epoch(1)
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    assert state["rows"] == 1 and state["deal"] == [4, 2]
    return state


def loaded_elsewhere(kind: str):
    """A sampler in the middle of its own run, and what it would save and yield from there."""
    s = MAKE[kind]()
    s.set_epoch(2)
    it = iter(s)
    next(it)
    return s, it, s.state_dict()


DAMAGES = [  # (field, value, what the message must say)
    ("version", 3, "is not a version this packkit reads"),
    ("version", "2", "is not a version"),
    ("version", None, "is not a version"),
    ("epoch", -1, "must be at least 0"),
    ("epoch", "1", "must be an integer"),
    ("epoch", 1.0, "must be an integer"),
    ("seed", 5, "saved with seed=5, this sampler has seed=4: build it with seed=5"),
    ("seed", True, "must be an integer"),
    ("world_size", 0, "must be at least 1"),
    ("batches_yielded", 10**6, "is more than the epoch's batches_per_epoch"),
    ("batches_yielded", [3], "must be an integer"),
    ("batches_per_epoch", -2, "must be at least 0"),
    ("accumulation_steps", 0, "must be at least 1"),
    ("step_units", 0, "must be at least 1"),
    ("start", 10**6, "is past the end of the epoch's"),
    ("span", 10**6, "end past the end of the epoch's"),
    ("span", 0, "is 0, but the state says a step is in progress"),
    ("mask", "zz", "must be a hexadecimal string"),
    ("mask", "f" * 40, "of the step in progress (span)"),
    ("mask", 3, "must be a string"),
    ("deal", [4], "must be a list of 2 integers or None"),
    ("deal", [0, 2], "must hold integers of at least 1"),
    ("deal", None, "is None, but rows=1 rows of a step are done"),
    ("rows", 3, "is more than the 2 rows a step of the deal"),
    ("rows", -1, "must be at least 0"),
    ("fingerprint", "0" * 40, "other lengths or options"),
    ("sampler", "Sampler", "from another sampler"),
    ("sampler", 7, "from another sampler"),
    ("extra", 1, "is not a field of a version-2 sampler state"),
]


def refused(s, it, before, state, field, match):
    with pytest.raises((ValueError, TypeError)) as info:
        s.load_state_dict(state)
    msg = str(info.value)
    assert "\n" not in msg and f"'{field}'" in msg and match in msg, (field, msg)
    assert s.state_dict() == before  # nothing about the sampler changed
    return msg


@pytest.mark.parametrize("kind", list(MAKE))
def test_every_damaged_state_is_refused_by_name(kind):
    good = saved(kind)
    s, it, before = loaded_elsewhere(kind)
    for field, value, match in DAMAGES:
        if field == "step_units" and kind != "packed":
            continue
        refused(s, it, before, {**good, field: value}, field, match)
    if kind == "packed":  # 3 units a step is not a whole number of 2-window batches
        refused(s, it, before, {**good, "step_units": 3}, "step_units", "not a multiple of 2 windows")
    for field in good:  # every field is needed
        state = {k: v for k, v in good.items() if k != field}
        if field == "version":  # without a version: an older packkit's state, whose fields these are not
            refused(s, it, before, state, "version", "is missing, which makes this a version-1 state")
        else:
            refused(s, it, before, state, field, "lacks the field")
    # another dataset, another option, another class: the fingerprint and the class name
    other = {"packed": dict(window=96), "grouped": dict(batch_size=4), "budget": dict(max_tokens=128)}[kind]
    for t in (MAKE[kind](LENGTHS[::-1].copy()), MAKE[kind](**other), MAKE[kind](drop_last=True)):
        with pytest.raises(ValueError, match="field 'fingerprint'"):
            t.load_state_dict(good)
    rest = list(it)  # the pass in progress goes on
    assert len(rest) == s.batches_per_epoch - 1
    s.load_state_dict(good)  # and the good state loads
    assert s.state_dict() == good


VALUES = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70), st.none(), st.booleans(), st.text(max_size=4),
                   st.floats(allow_nan=True), st.lists(st.integers(-2, 9), max_size=3),
                   st.sampled_from(["0", "1", "ff", "-1", " 1", "1f" * 20]))


@pytest.mark.filterwarnings("ignore::packkit.sampler.ResumeWarning")
@settings(deadline=None)
@given(kind=st.sampled_from(list(MAKE)), field=st.sampled_from(["epoch", "batches_yielded", "batches_per_epoch",
                                                                  "world_size", "accumulation_steps", "step_units",
                                                                  "start", "span", "mask", "deal", "rows", "seed",
                                                                  "version"]),
       value=VALUES)
@example(kind="grouped", field="mask", value="FF")  # every unit of the step used: loaded, then crashed dealing it
@example(kind="packed", field="batches_per_epoch", value=0)  # refused naming 'batches_yielded' only
def test_a_garbled_field_is_refused_or_yields_each_example_at_most_once(kind, field, value):
    """Before the fix some garbled states loaded and then crashed when iterated, or repeated examples. A
    garbled field is refused by name, with the sampler unchanged; a value that happens to be valid loads a
    position from which every rank's batches hold each example at most once (repeats as reported)."""
    good = saved(kind)
    s = MAKE[kind]()
    before = s.state_dict()
    try:
        s.load_state_dict({**good, field: value})
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        assert "\n" not in msg and msg.startswith("sampler state") and f"'{field}'" in msg, msg
        assert s.state_dict() == before
        return
    sched = s.schedule()
    counts = np.bincount(sched.flat, minlength=LENGTHS.size)
    assert int(np.maximum(counts - 1, 0).sum()) == sched.repeated
    assert sum(len(b) for b in s) == int(np.diff(sched.ptr)[s.rank::s.world_size].sum())


def test_merge_checks_every_rank_state():
    """merge_state_dicts read per-rank states unchecked (a garbled one crashed with a bare KeyError or merged):
    each is read as load_state_dict reads it, and a mix of versions is refused."""
    s = MAKE["packed"](world_size=2, rank=0, step_batches=2)
    old = [{"sampler": "PackedBatchSampler", "epoch": 0, "seed": 4, "batches_yielded": 3, "world_size": 2,
            "rank": r, "fingerprint": s._fingerprint()} for r in range(2)]
    assert s.merge_state_dicts(old)["start"] == 3 * 2 * 2
    for damage, match in [({"batches_yielded": "3"}, "field 'batches_yielded': must be an integer"),
                          ({"rank": 5}, r"field 'rank': must be in \[0, 1\]"),
                          ({"seed": 5}, "field 'seed': the state was saved with seed=5"),
                          ({"extra": 1}, "field 'extra'")]:
        with pytest.raises((ValueError, TypeError), match=match):
            s.merge_state_dicts([old[0], {**old[1], **damage}])
    with pytest.raises(ValueError, match="field 'rank': states \\[1\\] lack it"):
        s.merge_state_dicts([old[0], {k: v for k, v in old[1].items() if k != "rank"}])
    with pytest.raises(ValueError, match="differ in 'version'"):
        s.merge_state_dicts([old[0], s.state_dict()])
