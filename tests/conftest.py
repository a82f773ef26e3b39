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
"""

import gc
import os

import pytest
from hypothesis import HealthCheck, is_hypothesis_test, settings

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


def pytest_collection_modifyitems(config, items):
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
