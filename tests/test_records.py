"""``packkit.records.record`` behaves as ``dataclasses.dataclass(frozen=True)``: each check runs on a record and on
its dataclass twin (the same class body) and compares what they do. Then: the commands' start path builds no
dataclass through ``dataclasses``' generated code (1-3 ms of CPU each on Python 3.11: 15 of them made ``packkit
waste`` and 18 ``plan --synthetic`` start slower than fd3b24d, which had 7; ``benchmarks/RESULTS.md``, "The CLI's
cold start")."""

import copy
import dataclasses
import inspect
import pickle
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packkit.records import record


def _body(eq: bool = True):
    """A class body with what the records on the start path use: defaults, a default_factory, a field out of the
    repr and the comparison, one out of the hash, a ``__post_init__`` and a method."""

    class Body:
        """A doc."""

        a: int
        b: str = "x"
        c: list = dataclasses.field(default_factory=list)
        d: float = dataclasses.field(default=0.5, repr=False, compare=False)
        e: tuple = dataclasses.field(default=(), hash=False)

        def __post_init__(self):
            self.c.append(len(self.c))

        @property
        def twice(self):
            return 2 * self.a

    return Body


def _pair(eq: bool = True):
    """``(record, dataclass)`` made from the same body, under the same name."""
    return record(_body(), eq=eq), dataclasses.dataclass(frozen=True, eq=eq)(_body())


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the exception's type is what is compared
        return ("raises", type(exc).__name__)


CALLS = [((1,), {}), ((1, "y"), {}), ((), {"a": 2, "e": (1,)}), ((1, "y", [5], 1.5, (2,)), {}),
         ((), {}), ((1,), {"a": 1}), ((1,), {"z": 1}), ((1, "y", [], 0.0, (), 9), {})]


@pytest.mark.parametrize("args, kwargs", CALLS)
@pytest.mark.parametrize("eq", [True, False])
def test_a_record_is_made_and_shown_as_its_dataclass_twin(args, kwargs, eq):
    rec, dc = _pair(eq)
    # each gets its own copy: __post_init__ appends to the list c
    got = _outcome(lambda: rec(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
    want = _outcome(lambda: dc(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
    assert got[0] == want[0], (got, want)
    if got[0] == "raises":
        assert got[1] == want[1] == "TypeError"
        return
    r, d = got[1], want[1]
    assert repr(r) == repr(d)
    assert dataclasses.asdict(r) == dataclasses.asdict(d) and dataclasses.astuple(r) == dataclasses.astuple(d)
    assert r.twice == d.twice and r.c == d.c
    assert repr(dataclasses.replace(r, b="q")) == repr(dataclasses.replace(d, b="q"))
    assert repr(copy.copy(r)) == repr(copy.copy(d)) and repr(copy.deepcopy(r)) == repr(copy.deepcopy(d))
    for obj in (r, d):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.a = 3
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.other = 3
        with pytest.raises(dataclasses.FrozenInstanceError):
            del obj.a


@given(a=st.integers(-3, 3), b=st.sampled_from(["x", "y"]), d=st.sampled_from([0.5, 1.0]),
       e=st.sampled_from([(), (1,), [1]]), a2=st.integers(-3, 3), d2=st.sampled_from([0.5, 1.0]))
def test_records_compare_and_hash_as_their_dataclass_twins(a, b, d, e, a2, d2):
    for eq in (True, False):
        rec, dc = _pair(eq)
        r1, r2, d1, dd2 = rec(a, b, [], d, e), rec(a2, b, [], d2, e), dc(a, b, [], d, e), dc(a2, b, [], d2, e)
        assert (r1 == r2) == (d1 == dd2) and (r1 == r1) == (d1 == d1) and (r1 != r2) == (d1 != dd2)
        assert (r1 == 5) == (d1 == 5)
        assert _outcome(lambda: hash(r1) == hash(r2))[0] == _outcome(lambda: hash(d1) == hash(dd2))[0]
        if eq and r1 == r2 and _outcome(lambda: hash(r1))[0] == "ok":
            assert hash(r1) == hash(r2)


Pickled = record(_body())
Pickled.__name__ = Pickled.__qualname__ = "Pickled"


def test_a_record_pickles():
    obj = Pickled(1, "y", [4], 2.0, (1,))
    back = pickle.loads(pickle.dumps(obj))
    assert back == obj and repr(back) == repr(obj) == "Pickled(a=1, b='y', c=[4, 1], e=(1,))"


def test_a_record_is_a_dataclass_to_the_introspection():
    rec, dc = _pair()
    assert dataclasses.is_dataclass(rec)
    assert [(f.name, f.default, f.repr, f.compare, f.hash) for f in dataclasses.fields(rec)] == \
        [(f.name, f.default, f.repr, f.compare, f.hash) for f in dataclasses.fields(dc)]
    assert rec.__match_args__ == dc.__match_args__
    assert str(inspect.signature(rec)) == str(inspect.signature(dc))
    for name in ("init", "repr", "eq", "frozen", "order", "unsafe_hash"):
        assert getattr(rec.__dataclass_params__, name) == getattr(dc.__dataclass_params__, name), name
    assert rec.__doc__ == dc.__doc__ == "A doc."


def test_a_subclass_of_a_record_keeps_its_own_attributes_and_the_frozen_fields():
    rec, dc = _pair()
    for base in (rec, dc):
        sub = type("Sub", (base,), {})(1)
        sub.extra = 1  # not a field: allowed on a plain subclass, as for a dataclass
        with pytest.raises(dataclasses.FrozenInstanceError):
            sub.a = 2
        child = dataclasses.dataclass(frozen=True)(type("Child", (base,), {"__annotations__": {"f": int}, "f": 0}))
        assert repr(child(1, f=3)).endswith("a=1, b='x', c=[0], e=(), f=3)")


def test_the_start_path_builds_no_dataclass_through_generated_code():
    """Regression: ``packkit waste`` and ``plan --synthetic`` compiled the methods of 15 and 18 frozen dataclasses
    at start (``dataclasses`` ``exec``\\ s six for each); records compile none. Every packkit class the commands
    define is a record (or no dataclass)."""
    code = ("import contextlib, dataclasses, io, sys\nmade = []\n"
            "real = dataclasses._create_fn\n"
            "def spy(name, *a, **k):\n    made.append(name)\n    return real(name, *a, **k)\n"
            "dataclasses._create_fn = spy\nfrom packkit import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    cli.main(sys.argv[1:])\n"
            "plain = sorted(f'{m.__name__}.{k}' for m in list(sys.modules.values()) if m.__name__.startswith('packkit')"
            " for k, v in vars(m).items() if isinstance(v, type) and v.__module__ == m.__name__"
            " and dataclasses.is_dataclass(v) and '__record__' not in vars(v))\n"
            "print(len(made), plain)")
    for argv in (["waste"], ["plan", "--synthetic", "500"]):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "0 []", f"packkit {' '.join(argv)}: {out.stdout}{out.stderr}"
