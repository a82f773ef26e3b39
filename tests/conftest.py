"""Shared test configuration: hypothesis profiles and the ``property`` marker.

Profiles (``HYPOTHESIS_PROFILE=...``, or ``--hypothesis-profile``):

- ``ci`` (what ``make test`` sets): derandomized, so CI is deterministic and well inside its budget.
  A fixed seed covers only the examples it happens to draw: every edge case a property test must
  hold on is pinned with ``@example`` next to its ``@given``.
- ``dev``: the default for a local run; random seeds, 100 examples a test.
- ``thorough`` (``make test-thorough``): random seeds, ten times ``dev``'s examples, for a soak
  before a release or after touching a property. A test that caps its own ``max_examples`` (it is
  expensive) gets the same factor over its cap: without that a soak would leave the capped tests,
  often the ones over the trickiest code, at their CI budget.

Every ``@given`` test carries the ``property`` marker (added here, so none can be forgotten):
``pytest -m property`` selects exactly the property tests.

Two lanes: ``make test`` (CI) runs everything; ``make test-fast`` (the inner loop) runs ``-m "not slow"``.
``slow`` marks real Trainer runs, spawned processes and subprocesses, Ray, the Triton interpreter sweeps
past their first case and fault injection; every ``distributed`` test is ``slow`` too (added here).

Longest files first. ``make test`` hands whole files to two xdist workers (``--dist loadfile``), each
taking the next file of a queue when it is free; a long file near the end of the queue leaves the other
worker idle until it ends. So a whole-suite xdist run records each file's seconds in pytest's cache
(``.pytest_cache``, key ``packkit/seconds_per_file``), and the next run queues the files by them, longest
first (a file not recorded yet goes first: it may be long); with nothing recorded (a fresh checkout) the
files with the most tests go first, as xdist's own default did. The Makefile passes
``--no-loadscope-reorder`` so that xdist keeps this order.
"""

import gc
import math
import os
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, is_hypothesis_test, settings

#: Subprocesses (the command line, spawned ranks, fork servers) import packkit from this tree, as the tests in this
#: process do (``python -m pytest`` puts the working folder first): a venv shared by several checkouts (git
#: worktrees) has its editable install pointing at one of them, whose code a subprocess would test instead.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

# too_slow measures generation time, which depends on what else the shared machine runs: a failure
# there is not a finding. data_too_large: some strategies draw long lists of long lists by design.
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=SUPPRESSED)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=SUPPRESSED)
settings.register_profile("thorough", max_examples=1000, deadline=None, suppress_health_check=SUPPRESSED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def examples_factor() -> int:
    """How many times ``dev``'s examples the active profile runs: 10 under ``thorough``; 1 for ``dev``
    and below (``ci`` keeps every test's own cap as written)."""
    return max(1, settings.default.max_examples // settings.get_profile("dev").max_examples)


def scale_own_cap(test, factor: int) -> None:
    """Multiply the ``max_examples`` that a test set with its own ``@settings`` by ``factor``.

    hypothesis has no public way to re-decorate a collected test (a second ``@settings`` is refused),
    so this rewrites the attribute ``@given`` reads at call time; if a hypothesis release renames it,
    the soak stops here with that message instead of silently running the capped tests at their cap.
    """
    if not hasattr(test, "_hypothesis_internal_settings_applied"):
        return  # no @settings of its own: it already runs the profile's max_examples
    own = getattr(test, "_hypothesis_internal_use_settings", None)
    if not isinstance(own, settings):
        raise pytest.UsageError(
            f"tests/conftest.py cannot scale {test.__qualname__}'s own max_examples by {factor}: this "
            "hypothesis release no longer sets _hypothesis_internal_use_settings; update scale_own_cap")
    test._hypothesis_internal_use_settings = settings(own, max_examples=own.max_examples * factor)


def pytest_collection_finish(session):
    """Everything collection imported (torch, transformers, trl, ray: about a million objects) lives for the
    whole session: frozen, no garbage collection walks it again. A full collection costs about 0.01 s
    instead of 0.5 s, and packkit's batch-size search collects after every failed attempt. Garbage the tests
    make is collected as before."""
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's shutdown frees as without the freeze


SECONDS_KEY = "packkit/seconds_per_file"


def file_of(nodeid: str) -> str:
    """The file part of a test id: ``file_of("tests/test_x.py::test_y[1]") -> "tests/test_x.py"``."""
    return nodeid.split("::", 1)[0]


def longest_first(files: list[str], seconds: dict[str, float], counts: Counter) -> list[str]:
    """Files in the order to queue them: by recorded seconds, longest first, unrecorded ones before all;
    with nothing recorded, by number of tests. ``longest_first(["a", "b", "c"], {"a": 1.0, "b": 9.0}, Counter())
    -> ["c", "b", "a"]``."""
    if not seconds:
        return sorted(files, key=lambda f: -counts[f])
    return sorted(files, key=lambda f: -seconds.get(f, math.inf))


def whole_suite_under_xdist(config) -> bool:
    """This process is an xdist controller running every test (no file, -k or -m chosen): its seconds per
    file are the ones to queue the next run by."""
    return (bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
            and config.args == config.getini("testpaths") and not config.option.keyword
            and not config.option.markexpr)


class FileSeconds:
    """A plugin for the xdist controller: sums each file's setup, call and teardown seconds over every
    worker's reports and stores them in the cache at the end."""

    def __init__(self, cache):
        self.cache, self.seconds = cache, defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, exitstatus):
        if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            self.cache.set(SECONDS_KEY, {f: round(s, 2) for f, s in sorted(self.seconds.items())})


def pytest_configure(config):
    cache = getattr(config, "cache", None)
    if cache is not None and whole_suite_under_xdist(config):
        config.pluginmanager.register(FileSeconds(cache), "packkit-file-seconds")


def queue_longest_files_first(config, items) -> None:
    """Reorder ``items`` in place, whole files together, by :func:`longest_first`."""
    cache = getattr(config, "cache", None)
    seconds = cache.get(SECONDS_KEY, {}) if cache is not None else {}
    counts = Counter(file_of(item.nodeid) for item in items)
    rank = {f: i for i, f in enumerate(longest_first(list(counts), seconds, counts))}
    items.sort(key=lambda item: rank[file_of(item.nodeid)])  # stable: a file's own order is kept


def pytest_collection_modifyitems(config, items):
    queue_longest_files_first(config, items)
    factor = examples_factor()
    scaled = set()  # parametrized cases share one function: scale it once
    for item in items:
        if item.get_closest_marker("distributed") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if not (isinstance(item, pytest.Function) and is_hypothesis_test(item.obj)):
            continue
        item.add_marker(pytest.mark.property)
        test = getattr(item.obj, "__func__", item.obj)
        if factor > 1 and id(test) not in scaled:
            scaled.add(id(test))
            scale_own_cap(test, factor)


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for the test (put back after): media read back as Python lists (a
    ``datasets`` row without a format) become that dtype, as ``torch.tensor`` makes them
    (:func:`packkit.media.media_tensor`), so a float64 model's exact comparison keeps them float64."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
