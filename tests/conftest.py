"""Markers: accelerator tests skip cleanly where there is no accelerator."""

from __future__ import annotations

import os

import pytest
import torch

# tests/backend registers a test accelerator, which changes torch for the whole process: it runs
# in a process of its own, started by tests/test_pack.py with TODEVICE_TDTEST=1.
collect_ignore_glob = [] if os.environ.get("TODEVICE_TDTEST") == "1" else ["backend/*"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.accelerator.is_available():
        return
    skip = pytest.mark.skip(reason="no accelerator on this machine (torch.accelerator.is_available() is False)")
    for item in items:
        if "accelerator" in item.keywords:
            item.add_marker(skip)
