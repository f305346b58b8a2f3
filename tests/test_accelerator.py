"""Tests that need a real accelerator (CUDA, XPU, MPS): skipped where there is none."""

from __future__ import annotations

import pytest
import torch

import todevice
from tests import strategies

pytestmark = pytest.mark.accelerator

DTYPES = strategies.DTYPES


def accelerator() -> torch.device:
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, torch.accelerator.current_device_index())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_both_ways(dtype: torch.dtype) -> None:
    src = (torch.randn(5, 3) * 10).to(dtype) if dtype is not torch.bool else torch.randn(5, 3) > 0
    tree = {"x": [src, src.t()], "y": (src[::2],)}
    dev = accelerator()
    there = todevice.move(tree, dev)
    assert there["x"][0].device == dev
    back = todevice.move(there, "cpu")
    assert torch.equal(back["x"][0], src) and torch.equal(back["x"][1], src.t()) and torch.equal(back["y"][0], src[::2])


def test_non_blocking_device_to_host_never_returns_stale_data() -> None:
    dev = accelerator()
    x = torch.zeros(1 << 16, device=dev)
    for i in range(1000):
        x.add_(1)  # queued on the device; the copy back must see it
        out = todevice.move({"x": x}, "cpu", non_blocking=True)
        assert out["x"][0].item() == i + 1 and out["x"][-1].item() == i + 1


def test_tensor_already_on_the_accelerator_is_the_same_object() -> None:
    dev = accelerator()
    t = torch.ones(2, device=dev)
    assert todevice.move({"t": t}, dev)["t"] is t


def test_integer_device_is_an_accelerator_index() -> None:
    out = todevice.move(torch.ones(1), 0)
    assert out.device == torch.device(accelerator().type, 0)


def test_index_past_the_last_device_raises() -> None:
    kind = accelerator().type
    with pytest.raises(ValueError, match=f"there are {torch.accelerator.device_count()} {kind} devices here"):
        todevice.move(torch.ones(1), f"{kind}:{torch.accelerator.device_count()}")
