"""Tests that need a real accelerator (CUDA, XPU, MPS): skipped where there is none.

The CUDA tests queue ``torch.cuda._sleep`` ahead of the work they check, so a missing wait, a missing
``record_stream`` or a blocking copy shows as a wrong value or a long host time, not as luck.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import todevice
from tests import strategies
from todevice import _stream

pytestmark = pytest.mark.accelerator

DTYPES = strategies.DTYPES

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="queues torch.cuda._sleep")


def accelerator() -> torch.device:
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, _stream.current_index())


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds, measured here."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    per_ms = 10_000_000 / ((time.perf_counter() - start) * 1000)
    return int(per_ms * ms)


@pytest.fixture
def busy() -> Iterator[Any]:
    """Queue about ``ms`` milliseconds of work on the current stream: ``busy(ms)``."""
    cycles_per_ms = sleep_cycles(1.0) if torch.cuda.is_available() else 0

    def queue(ms: float) -> None:
        torch.cuda._sleep(int(cycles_per_ms * ms))

    yield queue
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_both_ways(dtype: torch.dtype) -> None:
    src = (torch.randn(5, 3) * 10).to(dtype) if dtype is not torch.bool else torch.randn(5, 3) > 0
    tree = {"x": [src, src.t()], "y": (src[::2],), "big": torch.randn(300, 300).to(dtype)}
    dev = accelerator()
    for coalesce in (None, False):
        there = todevice.move(tree, dev, coalesce=coalesce)
        assert there["x"][0].device == dev
        back = todevice.move(there, "cpu")
        assert torch.equal(back["x"][0], src) and torch.equal(back["x"][1], src.t())
        assert torch.equal(back["y"][0], src[::2]) and torch.equal(back["big"], tree["big"])


def test_staged_tensors_keep_strides_and_values() -> None:
    dev = accelerator()
    sources = [
        torch.randn(3000, 700).t(),
        torch.randn(1, 64, 128, 128).contiguous(memory_format=torch.channels_last),
        torch.randn(4000, 300)[:, ::3],
        torch.randn(1).expand(1 << 20),
    ]
    for src in sources:
        out = todevice.move(src, dev)
        assert out.stride() == src.to(dev).stride()
        assert torch.equal(out.cpu(), src)


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


# ---------------------------------------------------------------- nothing read early


@cuda_only
def test_device_to_host_waits_for_work_queued_before_the_write(busy: Any) -> None:
    dev = accelerator()
    x = torch.zeros(1 << 16, device=dev)
    small = torch.zeros(8, device=dev)
    for i in range(5):
        busy(20)
        x.add_(1)  # queued behind the sleep: the copy back must see it
        small.add_(1)
        out = todevice.move({"x": x, "s": [small]}, "cpu")
        assert bool((out["x"] == i + 1).all()) and bool((out["s"][0] == i + 1).all())


@cuda_only
def test_a_packed_batch_on_the_device_is_waited_for_when_unpacked_to_the_host(busy: Any) -> None:
    dev = accelerator()
    packed = todevice.pack({"x": [torch.zeros(4) for _ in range(8)]})
    on_device = todevice.PackedBatch(
        packed.buffer.to(dev), packed.layout, packed.skeleton, packed.requires_grad, packed.loose
    )
    busy(20)
    on_device.buffer.fill_(0)
    on_device.buffer.view(torch.float32).fill_(3.0)  # queued behind the sleep
    back = on_device.unpack()
    assert all(bool((t == 3.0).all()) for t in back["x"])


@cuda_only
def test_a_pinned_source_still_being_filled_is_sent_in_stream_order(busy: Any) -> None:
    dev = accelerator()
    x = torch.zeros(1 << 18, device=dev)  # 1 MiB: sent as it is, never read on the host
    pinned = torch.empty(1 << 18, pin_memory=True)
    busy(20)
    x.add_(7)
    pinned.copy_(x, non_blocking=True)  # pending: the host must not read it yet
    there = todevice.move({"p": pinned}, dev)
    assert bool((there["p"] == 7).all())


@cuda_only
def test_a_to_object_comes_back_to_the_host_complete(busy: Any) -> None:
    dev = accelerator()
    seq = torch.nn.utils.rnn.pack_padded_sequence(torch.zeros(4, 100, 8), [100, 90, 50, 10], batch_first=True)
    there = todevice.move(seq, dev)
    busy(20)
    there.data.add_(5)
    back = todevice.move({"seq": there}, "cpu")
    assert bool((back["seq"].data == 5).all())


# ---------------------------------------------------------------- the host never waits


@cuda_only
def test_large_pageable_tensors_do_not_block_the_host(busy: Any) -> None:
    dev = accelerator()
    batch = {f"x{i}": torch.randn(4 << 20) for i in range(8)}  # 8 x 16 MiB, pageable
    todevice.move(batch, dev)  # warm-up: the pinned blocks, the allocator
    torch.cuda.synchronize()
    busy(200)
    start = time.perf_counter()
    out = todevice.move(batch, dev)
    host_ms = (time.perf_counter() - start) * 1000
    torch.cuda.synchronize()
    assert host_ms < 100, f"move() held the host {host_ms:.0f} ms while 200 ms of work was queued"
    assert torch.equal(out["x3"].cpu(), batch["x3"])


@cuda_only
def test_a_side_stream_copy_does_not_wait_for_the_current_stream(busy: Any) -> None:
    dev = accelerator()
    side = torch.cuda.Stream(device=dev)
    batch = {"x": [torch.randn(256) for _ in range(50)]}
    todevice.move(batch, dev, stream=side)
    torch.cuda.synchronize()
    busy(200)
    out = todevice.move(batch, dev, stream=side)
    copied = torch.cuda.Event()
    copied.record(side)
    time.sleep(0.05)
    assert copied.query(), "the side stream's copy waited for the work on the current stream"
    torch.cuda.synchronize()
    assert torch.equal(out["x"][7].cpu(), batch["x"][7])


# ---------------------------------------------------------------- streams and memory


@cuda_only
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "control-without-record_stream"])
def test_side_stream_outputs_are_recorded_on_the_current_stream(
    busy: Any, monkeypatch: pytest.MonkeyPatch, record: bool
) -> None:
    """Freed while the current stream still reads them, they must not be handed to the next side-stream copy.

    The control run turns the recording off and must see the next batch's values: it shows that the
    test can catch the race it names.
    """
    if not record:
        monkeypatch.setattr(_stream, "_record", lambda outputs, stream: None)
    dev = accelerator()
    side = torch.cuda.Stream(device=dev)
    n = 1 << 20  # 4 MiB: copied into an allocation of its own, made on the side stream
    corrupted = 0
    for _ in range(5):
        out = todevice.move({"x": torch.full((n,), 1.0)}, dev, stream=side)
        busy(30)
        doubled = out["x"] * 2  # queued behind the sleep on the current stream
        del out  # freed now, read later
        junk = todevice.move({"x": torch.full((n,), -1.0)}, dev, stream=side)
        corrupted += int(not bool((doubled == 2.0).all()))
        del junk
    if record:
        assert corrupted == 0
    else:
        assert corrupted > 0, "the control run did not race: the test cannot see the bug"


@cuda_only
def test_the_current_stream_and_device_are_restored() -> None:
    dev = accelerator()
    before_device = torch.cuda.current_device()
    before_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=dev)
    todevice.move({"x": torch.ones(3)}, dev, stream=side)
    assert torch.cuda.current_stream() == before_stream and torch.cuda.current_device() == before_device
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", 1 - before_device if before_device < 2 else 0)
        todevice.move({"x": torch.ones(3)}, other, stream=torch.cuda.Stream(device=other))
        assert torch.cuda.current_device() == before_device
        for _ in todevice.prefetch([{"x": torch.ones(2)}], other):
            assert torch.cuda.current_device() == before_device
        with pytest.raises(ValueError, match="on a stream of"):
            todevice.move(torch.ones(1), other, stream=side)


@cuda_only
def test_prefetch_values_with_real_streams(busy: Any) -> None:
    dev = accelerator()
    batches = [{"x": torch.randn(64, 256), "y": [torch.randn(8) for _ in range(20)], "i": i} for i in range(12)]
    for pin in (False, True):
        source = [todevice.pack(b).pin_memory() if pin else b for b in batches]
        for k, batch in enumerate(todevice.prefetch(source, dev, depth=2)):
            busy(2)  # the consumer is slower than the copies
            assert batch["i"] == k
            assert torch.equal(batch["x"].cpu(), batches[k]["x"])
            assert torch.equal(batch["y"][19].cpu(), batches[k]["y"][19])


@cuda_only
def test_a_thousand_small_tensors_cross_in_one_pinned_copy() -> None:
    batch = {"x": [torch.randn(16) for _ in range(1000)]}
    todevice.move(batch, "cuda")  # warm-up: allocator, pinned staging, plan
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        todevice.move(batch, "cuda")
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert copies == ["Memcpy HtoD (Pinned -> Device)"], copies


@cuda_only
def test_large_results_on_the_host_are_pageable_and_small_ones_pinned() -> None:
    dev = accelerator()
    there = {"big": torch.randn(1 << 20, device=dev), "small": torch.randn(16, device=dev)}
    back = todevice.move(there, "cpu")
    assert not back["big"].is_pinned() and back["small"].is_pinned()
    assert torch.equal(back["big"], there["big"].cpu())
