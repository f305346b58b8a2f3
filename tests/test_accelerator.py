"""Tests that need a real accelerator (CUDA, XPU, MPS): skipped where there is none."""

from __future__ import annotations

import pytest
import torch

import todevice
from tests import strategies
from todevice import _stream

pytestmark = pytest.mark.accelerator

DTYPES = strategies.DTYPES


def accelerator() -> torch.device:
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, _stream.current_index())


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


def test_side_stream_moves_stay_correct_under_allocator_pressure() -> None:
    """Outputs made on a side stream are recorded on the current one: freeing them early never lets
    the allocator hand their memory to the next side-stream copy while a kernel still reads it."""
    dev = accelerator()
    side = torch.Stream(device=dev)
    src = {"a": [torch.full((256,), float(i)) for i in range(20)], "big": torch.arange(1 << 18, dtype=torch.float32)}
    for step in range(200):
        out = todevice.move(src, dev, stream=side)
        doubled = [t * 2 for t in out["a"]] + [out["big"] * 2]  # queued on the current stream
        del out  # freed while the kernels above may still be running
        junk = todevice.move({"j": [torch.full((256,), -1.0) for _ in range(20)]}, dev, stream=side)
        back = todevice.move(doubled, "cpu", non_blocking=False)
        for i in range(20):
            assert torch.equal(back[i], torch.full((256,), 2.0 * i)), step
        assert torch.equal(back[20], torch.arange(1 << 18, dtype=torch.float32) * 2), step
        del junk


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA memcpy events with the profiler")
def test_a_thousand_small_tensors_cross_in_one_copy() -> None:
    batch = {"x": [torch.randn(16) for _ in range(1000)]}
    todevice.move(batch, "cuda")  # warm-up: allocator, pinned staging, plan
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        todevice.move(batch, "cuda")
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(copies) == 1, [e.name for e in copies]
