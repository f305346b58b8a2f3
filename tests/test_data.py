"""collate() and prefetch() with the real DataLoader, real worker processes and real torch.distributed."""

from __future__ import annotations

import gc
import json
import socket
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

import todevice
from tests import data_support as ds, helpers
from todevice import _data, _pack

META = torch.device("meta")


def batches(dataset: Dataset[Any], collate_fn: Any = None, **kwargs: Any) -> list[Any]:
    return list(DataLoader(dataset, collate_fn=collate_fn, **kwargs))


def todevice_batches(dataset: Dataset[Any], collate_fn: Any = None, **kwargs: Any) -> list[Any]:
    loader = DataLoader(dataset, collate_fn=todevice.collate(collate_fn), **kwargs)
    return list(todevice.prefetch(loader, "cpu"))


def assert_same_batches(ours: list[Any], plain: list[Any]) -> None:
    assert len(ours) == len(plain)
    for a, b in zip(ours, plain):
        helpers.assert_same_tree(a, b, values=True, same=False)


# ---------------------------------------------------------------- against the plain pipeline


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_as_the_plain_pipeline(num_workers: int, pin_memory: bool, drop_last: bool) -> None:
    kwargs = {"batch_size": 4, "num_workers": num_workers, "pin_memory": pin_memory, "drop_last": drop_last}
    data = ds.DictData(n=23)  # 23 = 5 batches of 4 and a short one of 3
    assert_same_batches(todevice_batches(data, **kwargs), batches(data, **kwargs))


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers(context: str) -> None:
    kwargs = {"batch_size": 5, "num_workers": 2, "multiprocessing_context": context}
    data = ds.DictData(n=12)
    assert_same_batches(todevice_batches(data, **kwargs), batches(data, batch_size=5))


def test_persistent_workers_over_epochs() -> None:
    data = ds.DictData(n=10)
    loader = DataLoader(data, batch_size=3, num_workers=2, persistent_workers=True, collate_fn=todevice.collate())
    batches_in = todevice.prefetch(loader, "cpu")
    first, second = list(batches_in), list(batches_in)
    assert_same_batches(first, batches(data, batch_size=3))
    assert_same_batches(second, first)


def test_a_kept_label_keeps_only_the_small_tensors_memory_alive() -> None:
    """A collated batch's images are tensors of their own; its small tensors share one small buffer."""
    loader = DataLoader(ds.ImageData(), batch_size=8, num_workers=2, collate_fn=todevice.collate())
    plain = list(DataLoader(ds.ImageData(), batch_size=8))
    for packed, expected in zip(loader, plain):
        assert isinstance(packed, todevice.PackedBatch)
        batch = packed.unpack()
        label, image = batch["label"], batch["image"]
        assert torch.equal(label, expected["label"]) and torch.equal(image, expected["image"])
        assert label.untyped_storage().nbytes() == 64  # 8 int64 labels, and no image bytes
        assert image.untyped_storage().nbytes() == image.nbytes == 8 * 3 * 32 * 32 * 4


def test_namedtuple_samples() -> None:
    kwargs = {"batch_size": 4, "num_workers": 2}
    assert_same_batches(todevice_batches(ds.PairData(), **kwargs), batches(ds.PairData(), **kwargs))


def test_dataclass_samples_with_the_users_collate_fn() -> None:
    kwargs = {"batch_size": 4, "num_workers": 2}
    ours = todevice_batches(ds.ExampleData(), ds.collate_examples, **kwargs)
    assert_same_batches(ours, batches(ds.ExampleData(), ds.collate_examples, **kwargs))
    assert type(ours[0]) is ds.Example


def test_samples_of_different_sizes() -> None:
    kwargs = {"batch_size": 4, "num_workers": 2}
    ours = todevice_batches(ds.RaggedData(), ds.collate_ragged, **kwargs)
    assert_same_batches(ours, batches(ds.RaggedData(), ds.collate_ragged, **kwargs))


def test_a_batch_crosses_from_a_worker_as_one_shared_buffer() -> None:
    loader = DataLoader(ds.DictData(n=8, fields=50), batch_size=4, num_workers=2, collate_fn=todevice.collate())
    for packed in loader:
        assert type(packed) is _pack.PackedBatch
        assert packed.buffer.is_shared() and packed.loose == 0
        assert len(packed.layout.order) == 53  # 50 fields, ids, mask, index: every tensor in the one buffer


def test_a_batch_from_a_worker_used_before_unpacking_says_to_unpack_it() -> None:
    """With workers, collate() hands the loop PackedBatches (without, the batches themselves)."""
    loader = DataLoader(ds.DictData(n=4), batch_size=2, num_workers=2, collate_fn=todevice.collate())
    plain = batches(ds.DictData(n=4), batch_size=2)
    seen = 0
    for packed, expected in zip(loader, plain):
        with pytest.raises(
            TypeError, match=r"holds a dict, .*\.unpack\(device\).*todevice\.prefetch\(loader, device\)"
        ):
            packed["f0"]
        assert torch.equal(packed.unpack()["f0"], expected["f0"])
        seen += 1
    assert seen == 2


def test_main_process_collate_moves_to_the_device() -> None:
    loader = DataLoader(ds.DictData(n=4), batch_size=2, collate_fn=todevice.collate(device="meta"))
    batch = next(iter(loader))
    assert batch["f0"].device == META and batch["name"] == ["sample-0", "sample-1"]


def test_collate_pickles_with_the_users_function() -> None:
    import pickle

    again = pickle.loads(pickle.dumps(todevice.collate(ds.collate_examples, device="cpu")))
    assert again.collate_fn is ds.collate_examples and again.device == "cpu"


# ---------------------------------------------------------------- errors


def test_a_worker_error_reaches_the_loop_with_its_type_and_message() -> None:
    loader = DataLoader(ds.DictData(n=12, fail_at=6), batch_size=4, num_workers=2, collate_fn=todevice.collate())
    with pytest.raises(ValueError, match="sample 6 is broken") as caught:
        for _ in todevice.prefetch(loader, "cpu"):
            pass
    # The error's frames hold the DataLoader's iterator, and torch's re-raise holds the error: a
    # cycle. Left to the garbage collector, the iterator's queues are closed before it shuts its
    # workers down, and it waits 5 s for each; with the frames cleared it shuts down now.
    traceback.clear_frames(caught.tb)


def test_a_source_error_surfaces_unchanged() -> None:
    class Boom(Exception):
        pass

    def source() -> Iterator[dict[str, torch.Tensor]]:
        yield {"x": torch.ones(1)}
        raise Boom("from the source")

    seen = []
    with pytest.raises(Boom, match="from the source"):
        for batch in todevice.prefetch(source(), "meta"):
            seen.append(batch)
    assert len(seen) == 1


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth=0"):
        todevice.prefetch([], "cpu", depth=0)


# ---------------------------------------------------------------- prefetch


def test_prefetch_is_sized_and_re_iterable() -> None:
    data = [{"x": torch.full((2,), float(i))} for i in range(5)]
    loader = todevice.prefetch(data, "meta")
    assert len(loader) == 5
    assert [b["x"].device for b in loader] == [META] * 5
    assert len(list(loader)) == 5


def test_prefetch_unpacks_packed_batches_anywhere() -> None:
    source = [todevice.pack({"x": torch.ones(2)}), {"y": todevice.pack([torch.zeros(1)])}]
    out = list(todevice.prefetch(source, "meta"))
    assert out[0]["x"].device == META and out[1]["y"][0].device == META


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def fake_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """prefetch() on a backend with streams, with stand-ins for the streams and events."""
    log: dict[str, Any] = {"issued": [], "received": [], "streams": []}

    def make_stream(device: Any = None) -> FakeStream:
        log["streams"].append(FakeStream())
        return log["streams"][-1]

    def issue(
        batch: Any, dev: torch.device, non_blocking: bool, side: Any, skip: frozenset[str]
    ) -> tuple[Any, list[Any], Any]:
        log["issued"].append(batch["i"])
        return todevice.move(batch, dev, skip_keys=skip), [], ("event", batch["i"])

    monkeypatch.setattr(_data._stream, "is_accelerator", lambda device: True)
    monkeypatch.setattr(_data.torch, "Stream", make_stream)
    monkeypatch.setattr(_data, "moved_on", issue)
    monkeypatch.setattr(_data._stream, "receive", lambda event, outputs, device: log["received"].append(event[1]))
    return log


def test_prefetch_keeps_depth_batches_in_flight(fake_streams: dict[str, Any]) -> None:
    source = [{"i": i, "x": torch.ones(1)} for i in range(6)]
    loader = todevice.prefetch(source, "meta", depth=2)
    for k, batch in enumerate(loader):
        assert batch["i"] == k
        assert fake_streams["received"][-1] == k  # handed over just before it is used
        assert fake_streams["issued"][-1] == min(k + 1, 5)  # the next one on its way; one more once this is let go
    list(loader)
    assert len(fake_streams["streams"]) == 1  # one side stream for every epoch


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_holds_at_most_depth_batches_beyond_the_one_in_use(
    fake_streams: dict[str, Any], monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """Counted with weakrefs as each batch is started: a batch is handed over first, the next started after.

    With the garbage collector off, a batch counts as alive until reference counting frees it: one
    kept by a reference cycle would hold its device memory until some later collection.
    """
    alive: list[weakref.ref[torch.Tensor]] = []
    counts: list[int] = []
    real_move = todevice.move

    def tracked(batch: Any, dev: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_move(batch, dev)
        alive.append(weakref.ref(out["x"]))
        counts.append(sum(r() is not None for r in alive))
        return out

    monkeypatch.setattr(todevice, "move", tracked)
    source = [{"i": i, "x": torch.ones(1)} for i in range(8)]
    collecting = gc.isenabled()
    gc.disable()
    try:
        for k, batch in enumerate(todevice.prefetch(source, "meta", depth=depth)):
            assert batch["i"] == k
    finally:
        if collecting:
            gc.enable()
    assert len(counts) == 8 and max(counts) == depth + 1  # the one in use, and depth on their way


def test_the_end_of_the_source_keeps_nothing_of_its_last_call_alive() -> None:
    class Payload: ...

    held: list[weakref.ref[Payload]] = []

    class Source:
        def __init__(self) -> None:
            self.left = 2

        def __iter__(self) -> Source:
            return self

        def __next__(self) -> int:
            payload = Payload()  # a local of the call that ends the source
            held.append(weakref.ref(payload))
            if not self.left:
                raise StopIteration
            self.left -= 1
            return self.left

    window = _data._window(Source(), 3, lambda b: b, lambda b: b, lambda: None)
    assert next(window) == 1  # the source has ended behind it, a batch still to come
    assert len(held) == 3 and held[-1]() is None
    assert list(window) == [0]


def test_the_source_is_closed_even_when_abandoning_the_copies_fails() -> None:
    closed: list[bool] = []

    def source() -> Iterator[int]:
        try:
            yield from range(5)
        finally:
            closed.append(True)

    def abandon() -> None:
        raise RuntimeError("the device is gone")

    window = _data._window(source(), 2, lambda b: b, lambda b: b, abandon)
    assert next(window) == 0
    with pytest.raises(RuntimeError, match="the device is gone"):
        window.close()
    assert closed == [True]


def test_a_break_leaves_no_copy_running(fake_streams: dict[str, Any]) -> None:
    loader = todevice.prefetch([{"i": i} for i in range(6)], "meta", depth=2)
    for batch in loader:
        if batch["i"] == 1:
            break
    assert fake_streams["streams"][0].synchronized == 1


# ---------------------------------------------------------------- torch.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.slow
def test_ddp_training_gives_the_same_losses(tmp_path: Path) -> None:
    """Two gloo processes, DistributedSampler, workers: collate() + prefetch() as the plain pipeline."""
    mp.spawn(ds.ddp_job, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(result["plain"]) == 8  # 64 samples, 2 ranks, batches of 8, 2 epochs
        assert result["todevice"] == result["plain"]


# ---------------------------------------------------------------- regressions


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_source_error_comes_after_the_batches_before_it(fake_streams: dict[str, Any], depth: int) -> None:
    def source() -> Iterator[dict[str, Any]]:
        for i in range(5):
            yield {"i": i}
        raise KeyError("sixth")

    seen = []
    with pytest.raises(KeyError, match="sixth"):
        for batch in todevice.prefetch(source(), "meta", depth=depth):
            seen.append(batch["i"])
    assert seen == [0, 1, 2, 3, 4]


def test_a_break_closes_a_generator_source(fake_streams: dict[str, Any]) -> None:
    closed = []

    def source() -> Iterator[dict[str, Any]]:
        try:
            for i in range(10):
                yield {"i": i}
        finally:
            closed.append(True)

    for batch in todevice.prefetch(source(), "meta"):
        if batch["i"] == 1:
            break
    assert closed == [True]


def test_worker_collate_refuses_sparse_tensors_as_default_collate_does() -> None:
    sparse = [torch.eye(2).to_sparse(), torch.eye(2).to_sparse()]
    with pytest.raises(RuntimeError, match="Batches of sparse tensors are not currently supported"):
        _data._default_collate_for_packing(sparse)


def test_a_break_closes_a_generator_source_without_streams_too() -> None:
    closed = []

    def source() -> Iterator[dict[str, Any]]:
        try:
            for i in range(10):
                yield {"i": torch.ones(1) * i}
        finally:
            closed.append(True)

    for batch in todevice.prefetch(source(), "meta"):
        if batch["i"].shape == (1,):
            break
    assert closed == [True]


def test_collate_without_parentheses_or_with_bad_arguments_fails_at_once_with_a_hint() -> None:
    loader = torch.utils.data.DataLoader([{"x": torch.ones(2)}] * 4, batch_size=2, collate_fn=todevice.collate)
    with pytest.raises(TypeError, match=r"collate_fn=todevice.collate\(\), with the parentheses"):
        next(iter(loader))
    with pytest.raises(TypeError, match="collate_fn is not callable"):
        todevice.collate("not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Cannot move to device 'gpu'"):
        todevice.collate(device="gpu")
    assert todevice.collate(device="cpu").device == "cpu"
