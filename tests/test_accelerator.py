"""Tests that need a real accelerator (CUDA, XPU, MPS): skipped where there is none.

The CUDA tests queue ``torch.cuda._sleep`` ahead of the work they check, so a missing wait, a missing
``record_stream`` or a blocking copy shows as a wrong value or a long host time, not as luck.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

import todevice
from tests import strategies
from todevice import _stream

pytestmark = pytest.mark.accelerator

DTYPES = strategies.DTYPES

T = TypeVar("T")

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def accelerator() -> torch.device:
    acc = _stream.accelerator()
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
        torch.randn(10_000_003),  # 40 MB, contiguous: written and sent in pieces, the last one short
    ]
    for src in sources:
        out = todevice.move(src, dev)
        assert out.stride() == src.to(dev).stride()
        assert torch.equal(out.cpu(), src)


def test_a_tensor_sent_in_pieces_keeps_its_values_when_cast() -> None:
    dev = accelerator()
    src = torch.randn(5_000_001)  # 20 MB of float32: two pieces of float16, or three of float32 cast after
    for dtype in (torch.float16, torch.float64):
        out = todevice.move(src, dev, dtype=dtype)
        assert out.dtype == dtype and torch.equal(out.cpu(), src.to(dtype))


def test_tensor_already_on_the_accelerator_is_the_same_object() -> None:
    dev = accelerator()
    t = torch.ones(2, device=dev)
    assert todevice.move({"t": t}, dev)["t"] is t


def test_integer_device_is_an_accelerator_index() -> None:
    out = todevice.move(torch.ones(1), 0)
    assert out.device == torch.device(accelerator().type, 0)


def test_index_past_the_last_device_raises() -> None:
    kind = accelerator().type
    with pytest.raises(ValueError, match=f"there are {_stream.accel.device_count()} {kind} devices here"):
        todevice.move(torch.ones(1), f"{kind}:{_stream.accel.device_count()}")


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
    queued_ms = (time.perf_counter() - start) * 1000  # the queued work and the copies, as the host saw them
    # A move that waited for the queue would hold the host for nearly all of it: the limit is half.
    assert host_ms < queued_ms / 2, f"move() held the host {host_ms:.0f} ms of the {queued_ms:.0f} ms queued"
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


# ---------------------------------------------------------------- back to the host in one copy; into static buffers


def memcpys(kind: str, work: Callable[[], T]) -> tuple[T, list[str]]:
    """``work()``'s result, and the names of the ``kind`` copies ("Memcpy DtoH", "Memcpy HtoD") the profiler saw."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        result = work()
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
    return result, [e.name for e in prof.events() if kind in e.name]


def sample(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator | None = None) -> torch.Tensor:
    """Integers in [0, 100) as ``dtype`` (bool: nonzero): exact in every dtype, so sums compare with torch.equal."""
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def mixed_small(i: int, dev: torch.device) -> torch.Tensor:
    """The ``i``-th small device tensor of a mixed batch: every dtype meets 0-dim, empty and non-contiguous shapes."""
    dtype = DTYPES[i % len(DTYPES)]
    kind = i % 6  # 6 is coprime with len(DTYPES) == 11: every dtype meets every kind
    if kind == 0:
        return sample((), dtype).to(dev)
    if kind == 1:
        return sample((0, 3), dtype).to(dev)
    if kind == 2:
        return sample((4, 6), dtype).to(dev).t()
    if kind == 3:
        return sample((3, 8), dtype).to(dev)[:, ::2]
    return sample((7,) if kind == 4 else (2, 3, 5), dtype).to(dev)


@cuda_only
def test_a_thousand_small_tensors_come_back_to_the_host_in_one_copy() -> None:
    dev = accelerator()
    batch = {"x": [mixed_small(i, dev) for i in range(1000)]}
    want = [t.cpu() for t in batch["x"]]
    assert any(not t.is_contiguous() for t in batch["x"]) and any(t.dim() == 0 for t in batch["x"])
    todevice.move(batch, "cpu")  # warm-up: allocator, pinned blocks, layout
    torch.cuda.synchronize()
    back, copies = memcpys("Memcpy DtoH", lambda: todevice.move(batch, "cpu"))
    for i, (got, ref) in enumerate(zip(back["x"], want)):
        assert got.is_cpu and got.dtype == ref.dtype and got.shape == ref.shape, i
        assert torch.equal(got, ref), i
    assert len(copies) == 1, copies
    # The host tensors are views of the one buffer that came back, not copies cut from it afterwards.
    assert len({t.untyped_storage().data_ptr() for t in back["x"] if t.numel()}) == 1
    # Controls: the profiler sees one copy per tensor where nothing is gathered (empty tensors copy nothing).
    _, alone = memcpys("Memcpy DtoH", lambda: todevice.move(batch, "cpu", coalesce=False))
    _, reference = memcpys("Memcpy DtoH", lambda: [t.cpu() for t in batch["x"]])
    assert len(alone) == len(reference) >= sum(1 for t in want if t.numel()), (len(alone), len(reference))


@cuda_only
def test_small_results_on_the_host_wait_for_the_writes_queued_before_the_move() -> None:
    dev = accelerator()
    dtypes = [d for d in DTYPES if d is not torch.bool]  # each holds 7, 8 and 9
    tensors = [torch.zeros(8, dtype=dtypes[i % len(dtypes)], device=dev) for i in range(100)]
    cycles = sleep_cycles(50)
    for value in (7, 8, 9):
        torch.cuda._sleep(cycles)
        for t in tensors:
            t.fill_(value)  # queued behind the sleep: the copy back must see it
        back = todevice.move({"x": tensors}, "cpu")
        stale = [i for i, t in enumerate(back["x"]) if not bool((t == value).all())]
        assert not stale, f"read before the device wrote {value}: {stale[:10]}"


@cuda_only
def test_results_that_need_grad_come_back_alone_and_keep_their_graph() -> None:
    dev = accelerator()
    w = torch.randn(4, device=dev, requires_grad=True)
    batch: dict[str, Any] = {"y": w, "z": w * 2, "rest": [torch.randn(8, device=dev) for _ in range(100)]}
    todevice.move(batch, "cpu")  # warm-up
    torch.cuda.synchronize()
    back, copies = memcpys("Memcpy DtoH", lambda: todevice.move(batch, "cpu"))
    assert len(copies) == 3, copies  # y and z alone, the hundred others gathered in one
    assert back["y"].requires_grad and back["z"].requires_grad
    assert torch.equal(back["y"].detach(), w.detach().cpu()) and torch.equal(back["z"].detach(), (w * 2).detach().cpu())
    assert all(not t.requires_grad and torch.equal(t, s.cpu()) for t, s in zip(back["rest"], batch["rest"]))
    weights = torch.arange(1.0, 5.0)
    ((back["y"] * weights).sum() + back["z"].sum()).backward()
    assert w.grad is not None and w.grad.device == dev
    assert torch.equal(w.grad.cpu(), weights + 2)


@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_small_tensors_on_two_devices_come_back_in_one_copy_each() -> None:
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    xs = [torch.zeros(8, dtype=DTYPES[i % 3], device=devs[i % 2]) for i in range(100)]  # interleaved
    cycles = sleep_cycles(50)
    for current in (0, 1):
        with torch.cuda.device(current):
            for d in devs:
                with torch.cuda.device(d):
                    torch.cuda._sleep(cycles)
            for i, t in enumerate(xs):
                t.fill_(100 * current + i)  # on t's device's current stream, behind its sleep
            back = todevice.move({"x": xs}, "cpu")
            assert torch.cuda.current_device() == current
            wrong = [i for i, t in enumerate(back["x"]) if not bool((t == 100 * current + i).all())]
            assert not wrong, f"stale or misplaced values with cuda:{current} current: {wrong[:10]}"
            for d in devs:
                torch.cuda.synchronize(d)
            again, copies = memcpys("Memcpy DtoH", lambda: todevice.move({"x": xs}, "cpu"))
            assert torch.cuda.current_device() == current
            assert len(copies) == 2, copies  # one buffer, one copy per source device
            assert all(torch.equal(t, s.cpu()) for t, s in zip(again["x"], xs))


def out_batch(seed: int) -> dict[str, Any]:
    """A host batch for the ``out=`` tests: 100 small tensors of mixed dtypes and shapes, and one of 1 MiB.

    Every seed gives other values; from seed 1 on, ``t`` is a transposed view (the static copy is contiguous).
    """
    gen = torch.Generator().manual_seed(seed)
    t = sample((6, 4), torch.float32, gen) if seed == 0 else sample((4, 6), torch.float32, gen).t()
    return {
        "a": sample((8,), torch.float32, gen),
        "b": sample((16,), torch.float32, gen),
        "s": sample((), torch.int64, gen),
        "t": t,
        "x": [sample((5,) if i % 2 else (2, 3), DTYPES[i % len(DTYPES)], gen) for i in range(96)],
        "big": sample((1 << 18,), torch.float32, gen),  # 1 MiB: past COALESCE_MAX_BYTES
    }


def out_leaves(batch: dict[str, Any]) -> list[torch.Tensor]:
    """``out_batch``'s tensors, the small ones first and the large one last."""
    return [batch["a"], batch["b"], batch["s"], batch["t"], *batch["x"], batch["big"]]


def static_batch() -> dict[str, Any]:
    """Static buffers on the device, made as the docs say: its small tensors are views of one buffer."""
    static = todevice.move(out_batch(0), "cuda")
    small = out_leaves(static)[:-1]
    assert out_leaves(static)[-1].nbytes > todevice.COALESCE_MAX_BYTES
    assert len({t.untyped_storage().data_ptr() for t in small}) == 1, "precondition: one buffer for the small ones"
    return static


def holds(static: dict[str, Any], batch: dict[str, Any]) -> list[int]:
    """The indices (in ``out_leaves`` order) of the static tensors whose values differ from ``batch``'s."""
    pairs = zip(out_leaves(static), out_leaves(batch))
    return [i for i, (got, want) in enumerate(pairs) if not torch.equal(got.cpu(), want)]


@cuda_only
def test_a_move_into_static_buffers_keeps_them_and_writes_every_value() -> None:
    static = static_batch()
    tensors, ptrs = out_leaves(static), [t.data_ptr() for t in out_leaves(static)]
    batches = [out_batch(seed) for seed in (1, 2, 3)]
    torch.cuda._sleep(sleep_cycles(50))  # the copies queue behind it: staging reused too early shows
    snapshots = []
    for batch in batches:
        assert todevice.move(batch, out=static) is static
        # Cloned on the current stream, behind this move's copies and ahead of the next move's.
        snapshots.append({k: [t.clone() for t in v] if k == "x" else v.clone() for k, v in static.items()})
    for seed, (batch, snap) in enumerate(zip(batches, snapshots), start=1):
        assert not holds(snap, batch), f"batch {seed}: wrong values at {holds(snap, batch)[:10]}"
    assert all(a is b for a, b in zip(out_leaves(static), tensors)), "static's tensors were replaced"
    assert [t.data_ptr() for t in out_leaves(static)] == ptrs, "static's memory moved"


@cuda_only
def test_small_tensors_cross_into_static_buffers_in_one_pinned_copy() -> None:
    static = static_batch()
    todevice.move(out_batch(1), out=static)  # warm-up: pinned staging, layout
    batch = out_batch(2)
    torch.cuda.synchronize()
    _, copies = memcpys("Memcpy HtoD", lambda: todevice.move(batch, out=static))
    # Control: the large tensor on its own, into the same static tensor, makes the copies it makes in any move.
    _, large = memcpys("Memcpy HtoD", lambda: todevice.move({"big": batch["big"]}, out={"big": static["big"]}))
    assert large, "the profiler saw no copy of the large tensor"
    assert sorted(copies) == sorted([*large, "Memcpy HtoD (Pinned -> Device)"]), (copies, large)
    assert not holds(static, batch)


@cuda_only
def test_a_cuda_graph_reads_what_each_move_writes_into_static_buffers() -> None:
    static = static_batch()

    def step() -> torch.Tensor:
        y: torch.Tensor = static["a"] * 2 + static["b"].sum() + static["big"][:8]
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch.cuda.graphs' docs show
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for seed in (1, 2, 3):
        batch = out_batch(seed)
        todevice.move(batch, out=static)
        graph.replay()  # reads static's memory at the addresses captured
        torch.cuda.synchronize()
        want = batch["a"] * 2 + batch["b"].sum() + batch["big"][:8]  # integers: exact on both sides
        assert torch.equal(y.cpu(), want), f"batch {seed}: {y.cpu()} != {want}"


@cuda_only
def test_a_move_into_static_buffers_waits_for_earlier_reads_of_them() -> None:
    static = static_batch()
    cycles = sleep_cycles(50)
    for seed in (1, 2, 3):
        batch = out_batch(seed)
        old_a, old_big = static["a"].to("cpu", copy=True), static["big"].to("cpu", copy=True)
        torch.cuda._sleep(cycles)
        read_a, read_big = static["a"].clone(), static["big"].clone()  # queued behind the sleep
        todevice.move(batch, out=static)  # must be ordered after those reads on the current stream
        assert torch.equal(read_a.cpu(), old_a), f"batch {seed}: a small tensor was written before it was read"
        assert torch.equal(read_big.cpu(), old_big), f"batch {seed}: the large tensor was written before it was read"
        assert not holds(static, batch)


def wrong_shape(batch: dict[str, Any]) -> str:
    batch["x"][57] = torch.zeros(7, dtype=batch["x"][57].dtype)
    return "['x'][57]"


def wrong_dtype(batch: dict[str, Any]) -> str:
    batch["b"] = batch["b"].double()
    return "['b']"


@cuda_only
@pytest.mark.parametrize("spoil", [wrong_shape, wrong_dtype], ids=["shape", "dtype"])
def test_a_mismatched_batch_names_its_path_and_writes_nothing(spoil: Callable[[dict[str, Any]], str]) -> None:
    static = static_batch()
    before = [t.clone() for t in out_leaves(static)]
    batch = out_batch(1)
    path = spoil(batch)  # the later leaves in walk order would be written by a move that checks as it goes
    with pytest.raises(ValueError, match=re.escape(path)):
        todevice.move(batch, out=static)
    torch.cuda.synchronize()
    changed = [i for i, (t, b) in enumerate(zip(out_leaves(static), before)) if not torch.equal(t, b)]
    assert not changed, f"written before the mismatch was found: {changed[:10]}"


@cuda_only
def test_a_flat_dict_of_device_tensors_comes_back_in_one_copy_after_queued_writes() -> None:
    dev = accelerator()
    metrics = {f"m{i}": torch.zeros((), dtype=DTYPES[i % len(DTYPES)], device=dev) for i in range(1000)}
    mixed = [mixed_small(i, dev) for i in range(60)]
    todevice.move(metrics, "cpu")  # warm-up
    cycles = sleep_cycles(50)
    for value in (3, 4):
        torch.cuda._sleep(cycles)
        for t in metrics.values():
            t.fill_(value)  # queued behind the sleep: the copy back must see it
        back, copies = memcpys("Memcpy DtoH", lambda: todevice.move(metrics, "cpu"))
        assert len(copies) == 1 and list(back) == list(metrics), copies
        assert all(t.dtype == metrics[k].dtype for k, t in back.items())
        stale = [k for k, t in back.items() if not bool(t == torch.tensor(value).to(t.dtype))]
        assert not stale, f"read before the device wrote {value}: {stale[:10]}"
    back_list, copies = memcpys("Memcpy DtoH", lambda: todevice.move(mixed, "cpu"))
    assert len(copies) == 1 and type(back_list) is list
    assert all(torch.equal(got, t.cpu()) and got.shape == t.shape for got, t in zip(back_list, mixed))


@cuda_only
def test_static_buffers_are_written_right_every_step_and_a_changed_one_is_found() -> None:
    def step_inputs(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        out = {f"x{i}": sample((16,), torch.float32, gen) for i in range(90)}
        out.update({f"ids{i}": sample((8,), torch.int64, gen) for i in range(10)})
        return out

    static = todevice.move(step_inputs(0), "cuda")
    assert len({t.untyped_storage().data_ptr() for t in static.values()}) == 1
    batches = [step_inputs(seed) for seed in range(1, 6)]
    torch.cuda._sleep(sleep_cycles(50))  # the copies queue behind it: staging reused too early shows
    snapshots = []
    for batch in batches:
        assert todevice.move(batch, out=static) is static
        snapshots.append({k: v.clone() for k, v in static.items()})
    for seed, (batch, snap) in enumerate(zip(batches, snapshots), start=1):
        wrong = [k for k in batch if not torch.equal(snap[k].cpu(), batch[k])]
        assert not wrong, f"step {seed}: wrong values at {wrong[:10]}"
    _, copies = memcpys("Memcpy HtoD", lambda: todevice.move(step_inputs(7), out=static))
    assert copies == ["Memcpy HtoD (Pinned -> Device)"], copies
    before = {k: v.clone() for k, v in static.items()}
    static["x5"].resize_(4)  # the same tensor, another shape: checked again, found, nothing written
    with pytest.raises(ValueError, match=re.escape("at ['x5'], out's tensor has shape (4,)")):
        todevice.move(step_inputs(8), out=static)
    torch.cuda.synchronize()
    assert all(torch.equal(static[k], before[k][: static[k].numel()]) for k in static)
