"""Markers: accelerator tests skip cleanly where there is no accelerator."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

from todevice import _stream

# Hypothesis: 100 examples a property by default; CI runs them
# derandomized, so a red run can be replayed; HYPOTHESIS_PROFILE=thorough runs 2,000, to hunt before a release.
_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", max_examples=100, **_common)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

# tests/backend registers a test accelerator, which changes torch for the whole process: it runs
# in a process of its own, started by tests/test_pack.py with TODEVICE_TDTEST=1.
collect_ignore_glob = [] if os.environ.get("TODEVICE_TDTEST") == "1" else ["backend/*"]


class _DoctestGlobals(dict):  # type: ignore[type-arg]
    """A doctest's globals. A function compiled in a doctest leaves entries in them (``__builtins_dict___0``) that
    dynamo deletes when the compiled code dies, at the interpreter's exit at the latest; doctest has cleared them by
    then, and dynamo's KeyError was printed as "Exception ignored" tracebacks after a green run. An entry gone is
    deleted as a no-op."""

    def __delitem__(self, name: str) -> None:
        self.pop(name, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # every doctest's, README.md's and docs/api.md's too: this hook sees the whole session
        test = getattr(item, "dtest", None)
        if test is not None and type(test.globs) is dict:
            test.globs = _DoctestGlobals(test.globs)
    if _stream.accelerator() is not None:
        return
    skip = pytest.mark.skip(reason="no accelerator on this machine")
    for item in items:
        if "accelerator" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_flush_to_zero() -> None:
    """Each test starts with subnormal floats kept: inductor's CPU kernels turn flush-to-zero on for the whole process
    on torch 2.4, and Hypothesis then refuses its float strategies."""
    torch.set_flush_denormal(False)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Let dynamo drop the code it compiled while the test modules' globals, where it keeps entries of its own, are
    still there: at the interpreter's exit they are cleared first, and each entry's deletion failed there."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
