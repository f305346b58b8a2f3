"""Markers: accelerator tests skip cleanly where there is no accelerator."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.accelerator.is_available():
        return
    skip = pytest.mark.skip(reason="no accelerator on this machine (torch.accelerator.is_available() is False)")
    for item in items:
        if "accelerator" in item.keywords:
            item.add_marker(skip)
