"""``@record``: a frozen dataclass (``@dataclasses.dataclass(frozen=True)``, ``eq=False`` as there) made without
compiling code at import.

``dataclasses`` writes the source of ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__`` and
``__delattr__`` for every class and ``exec``\\ s each: 1-3 ms of CPU a frozen class on Python 3.11, and the
commands' start path holds 15-18 of them (``packkit waste`` and ``plan`` took 1.04-1.12x the CPU of fd3b24d's, which
had 7; ``benchmarks/RESULTS.md``, "The CLI's cold start"). A record is processed by ``dataclasses`` itself with
nothing to generate (its fields, defaults, ``__match_args__``: ``dataclasses.fields``, ``replace``, ``asdict`` and
``is_dataclass`` work as on any dataclass), and the six methods are shared functions that read the class's fields:
25 us a class. What differs from a generated ``__init__``: a few microseconds more per instance (none is made in a
per-example loop), and a call error names the class (``Plan() missing required argument 'window'``).

>>> @record
... class Point:
...     x: int
...     y: int = 0
>>> p = Point(1); p, p == Point(1, 0), hash(p) == hash(Point(1, 0)), dataclasses.replace(p, y=2)
(Point(x=1, y=0), True, True, Point(x=1, y=2))
"""

from __future__ import annotations

import dataclasses
import inspect

__all__ = ["record"]


class _Spec:
    """What the shared methods read from a record class: its fields in order, sorted by use."""

    __slots__ = ("cls", "names", "fields", "defaults", "factories", "repr", "compare", "hash", "post_init")

    def __init__(self, cls):
        fields = dataclasses.fields(cls)
        self.cls = cls
        self.names = tuple(f.name for f in fields)
        self.fields = frozenset(self.names)
        self.defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        self.factories = {f.name: f.default_factory for f in fields
                          if f.default_factory is not dataclasses.MISSING}
        self.repr = tuple(f.name for f in fields if f.repr)
        self.compare = tuple(f.name for f in fields if f.compare)
        self.hash = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))
        self.post_init = getattr(cls, "__post_init__", None)


def _init(self, *args, **kwargs):
    spec = type(self).__record__
    names = spec.names
    if args:
        if len(args) > len(names):
            raise TypeError(f"{type(self).__qualname__}() takes {len(names)} arguments, got {len(args)}")
        for name, value in zip(names, args):  # (kwargs is this call's own dict)
            if name in kwargs:
                raise TypeError(f"{type(self).__qualname__}() got multiple values for argument {name!r}")
            kwargs[name] = value
    if not spec.fields.issuperset(kwargs):  # one set operation, not a test per keyword (records are made per call)
        name = next(name for name in kwargs if name not in spec.fields)
        raise TypeError(f"{type(self).__qualname__}() got an unexpected keyword argument {name!r}")
    put, defaults = object.__setattr__, spec.defaults
    for name in names:
        if name in kwargs:
            put(self, name, kwargs[name])
        elif name in defaults:
            put(self, name, defaults[name])
        elif name in spec.factories:
            put(self, name, spec.factories[name]())
        else:
            raise TypeError(f"{type(self).__qualname__}() missing required argument {name!r}")
    if spec.post_init is not None:
        self.__post_init__()


def _repr(self) -> str:
    return (f"{type(self).__qualname__}("
            + ", ".join(f"{name}={getattr(self, name)!r}" for name in type(self).__record__.repr) + ")")


def _values(self, names) -> tuple:
    return tuple(getattr(self, name) for name in names)


def _eq(self, other):
    if other.__class__ is not self.__class__:
        return NotImplemented
    names = type(self).__record__.compare
    return _values(self, names) == _values(other, names)


def _hash(self) -> int:
    return hash(_values(self, type(self).__record__.hash))


def _setattr(self, name, value):
    spec = type(self).__record__  # as dataclasses' frozen __setattr__: any name on the record, fields on a subclass
    if type(self) is spec.cls or name in spec.fields:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


def _delattr(self, name):
    spec = type(self).__record__
    if type(self) is spec.cls or name in spec.fields:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
    object.__delattr__(self, name)


class _Factory:
    """A default made by a ``default_factory``, as ``inspect.signature`` shows it for a dataclass."""

    def __repr__(self) -> str:
        return "<factory>"


class _Signature:
    """``inspect.signature(cls)``: the ``__init__`` a dataclass would have, made when asked."""

    def __get__(self, obj, owner):
        if obj is not None:
            return None
        missing = inspect.Parameter.empty
        spec = owner.__record__
        fields = {f.name: f for f in dataclasses.fields(owner)}
        return inspect.Signature([
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=fields[name].type,
                              default=spec.defaults.get(name, _Factory() if name in spec.factories else missing))
            for name in spec.names], return_annotation=None)


def record(cls=None, /, *, eq: bool = True):
    """``@record`` (or ``@record(eq=False)``): ``cls`` as ``@dataclasses.dataclass(frozen=True, eq=eq)`` makes it
    (the fields' ``default``, ``default_factory``, ``repr``, ``compare`` and ``hash``; ``__post_init__``), with
    the shared methods instead of compiled ones. A method the class defines itself is kept."""

    def wrap(cls):
        own = set(vars(cls))
        if own & {"__setattr__", "__delattr__"}:
            raise TypeError(f"{cls.__qualname__}: a frozen record cannot define __setattr__ or __delattr__")
        dataclasses.dataclass(cls, init=False, repr=False, eq=False)  # the fields; nothing compiled
        params = cls.__dataclass_params__  # say what the class is (a subclass's dataclass checks frozen)
        cls.__dataclass_params__ = type(params)(**{**{k: getattr(params, k) for k in type(params).__slots__},
                                                   "init": True, "repr": True, "eq": eq, "frozen": True})
        cls.__record__ = _Spec(cls)
        methods = {"__init__": _init, "__repr__": _repr, "__setattr__": _setattr, "__delattr__": _delattr,
                   "__signature__": _Signature()}
        if eq:  # as dataclass(frozen=True, eq=True): compared and hashed by the fields
            methods.update({"__eq__": _eq, "__hash__": _hash})
        for name, method in methods.items():
            if name not in own:
                setattr(cls, name, method)
        return cls

    return wrap if cls is None else wrap(cls)
