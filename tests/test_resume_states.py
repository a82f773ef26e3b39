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
