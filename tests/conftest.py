"""Shared test configuration: hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (what ``make test`` sets) keeps the whole suite well inside CI's budget;
``dev`` is the default for a local run; ``thorough`` is for a long soak before a release.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
