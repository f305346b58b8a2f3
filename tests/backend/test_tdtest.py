"""Values across a real device boundary, through the coalesced path, on the ``tdtest`` backend.

Runs only in a process of its own, started by tests/test_pack.py (``TODEVICE_TDTEST=1``).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import todevice
from tests import helpers, strategies
from tests.backend import tdtest
from todevice import _bench, _into, _layout, _move

DEV = torch.device("tdtest", 0)


def there_and_back(tree: Any, **kwargs: Any) -> tuple[Any, Any]:
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest", **kwargs)
        back = todevice.move(there, "cpu", non_blocking=False)
    return there, back


def test_small_leaves_cross_in_one_copy() -> None:
    tree = {
        "x": [torch.randn(4) for _ in range(100)],
        "mask": torch.ones(3, 5, dtype=torch.bool),
        "ids": torch.arange(7),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "z": torch.randn(3, dtype=torch.complex64),
        "name": "batch-0",
    }
    before = dict(tdtest.COPIES)
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest")
    assert tdtest.COPIES["h2d"] - before["h2d"] == 1  # 104 tensors, one copy
    assert there["x"][0].device == DEV and there["name"] == "batch-0"
    with torch.inference_mode():
        back = todevice.move(there, "cpu", non_blocking=False)
    helpers.assert_same_tree(back, tree, values=True)


def test_without_coalescing_each_leaf_is_a_copy() -> None:
    tree = [torch.randn(4) for _ in range(10)]
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        todevice.move(tree, "tdtest", coalesce=False)
    assert tdtest.COPIES["h2d"] - before == 10


def test_a_tensor_met_twice_crosses_once() -> None:
    t = torch.randn(4)
    tree = {"a": t, "b": [t], "tied": t.view(4), "other": torch.randn(4)}
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest", coalesce=False)
        back = todevice.move(there, "cpu", non_blocking=False)
    assert tdtest.COPIES["h2d"] - before == 2  # t once (its tied view shares the copy), "other" once
    assert there["a"] is there["b"][0] and there["tied"] is not there["a"]
    helpers.assert_same_tree(back, tree, values=True)


def test_large_leaves_travel_alone() -> None:
    big = torch.randn(1024)  # 4 KiB, over the threshold given below
    tree = {"big": big, "small": [torch.randn(2) for _ in range(_layout.COALESCE_MIN_TENSORS)]}
    before = tdtest.COPIES["h2d"]
    _, back = there_and_back(tree, coalesce_max_bytes=1024)
    assert tdtest.COPIES["h2d"] - before == 2  # the small ones together, the big one alone
    helpers.assert_same_tree(back, tree, values=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_dtype_cast_on_either_side(dtype: torch.dtype) -> None:
    tree = {"f": [torch.randn(3) for _ in range(4)], "i": torch.arange(3)}
    _, back = there_and_back(tree, dtype=dtype)
    expected = helpers.reference_move(tree, "cpu", dtype)
    helpers.assert_same_tree(back, expected, values=True)


def test_packed_batch_unpacks_on_the_device() -> None:
    tree = {"x": [torch.randn(3) for _ in range(6)], "y": torch.arange(4), "s": "label"}
    packed = todevice.pack(tree)
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        there = packed.unpack("tdtest")
        back = todevice.move(there, "cpu", non_blocking=False)
    assert tdtest.COPIES["h2d"] - before == 1
    helpers.assert_same_tree(back, tree, values=True)


@given(strategies.trees)
def test_random_trees_round_trip(tree: Any) -> None:
    _, back = there_and_back(tree)
    expected = helpers.reference_move(tree, "cpu")
    # requires_grad does not survive inference mode; values, types and structure do.
    helpers.assert_same_tree(back, expected, values=True, grad=False)


# ---------------------------------------------------------------- what crosses, by the batch's plan


class Ops(TorchDispatchMode):
    """Every aten op dispatched, by name, and the dtypes of the tensors made."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.made: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.__name__)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.made.append(out.dtype)
        return out


STAGING_OPS = ("_foreach_copy_", "cat", "stack", "unbind", "split_with_sizes")


def dispatched(fn: Any) -> tuple[Any, Ops, dict[str, int]]:
    ops = Ops()
    before = dict(tdtest.COPIES)
    with torch.inference_mode(), ops:
        out = fn()
    return out, ops, {k: tdtest.COPIES[k] - before[k] for k in before}


def staging_ops(ops: Ops) -> list[str]:
    return [op for op in ops.ops if op.split(".")[0] in STAGING_OPS]


def test_a_bare_tensor_crosses_in_one_copy_with_no_staging(pinned_counted: list[int]) -> None:
    x = torch.randn(32, 10)
    out, ops, copies = dispatched(lambda: todevice.move(x, "tdtest"))
    assert copies["h2d"] == 1 and not staging_ops(ops) and torch.uint8 not in ops.made
    assert pinned_counted == [] and torch.equal(todevice.move(out, "cpu", non_blocking=False), x)


def test_a_tokenizer_dict_crosses_one_copy_per_tensor_with_no_staging(pinned_counted: list[int]) -> None:
    batch = {k: torch.randint(0, 9, (32, 512)) for k in ("input_ids", "attention_mask", "token_type_ids")}
    out, ops, copies = dispatched(lambda: todevice.move(batch, "tdtest"))
    assert copies["h2d"] == 3 and not staging_ops(ops) and torch.uint8 not in ops.made
    assert pinned_counted == []  # 384 KiB in all: under the driver's limit
    helpers.assert_same_tree(todevice.move(out, "cpu", non_blocking=False), batch, values=True)


def test_a_few_small_tensors_go_alone_and_many_together() -> None:
    few = [torch.randn(4) for _ in range(_layout.COALESCE_MIN_TENSORS - 1)]
    _, ops, copies = dispatched(lambda: todevice.move(few, "tdtest"))
    assert copies["h2d"] == len(few) and not staging_ops(ops)
    many = [torch.randn(4) for _ in range(100)]
    out, _, copies = dispatched(lambda: todevice.move(many, "tdtest"))
    assert copies["h2d"] == 1  # 100 small tensors, one copy
    helpers.assert_same_tree(todevice.move(out, "cpu", non_blocking=False), many, values=True)


def test_a_batch_already_on_the_device_dispatches_no_op() -> None:
    with torch.inference_mode():
        there = todevice.move({"x": torch.randn(3), "y": [torch.randn(2), torch.arange(3)]}, "tdtest")
        alone = torch.randn(4).to("tdtest")
    out, ops, copies = dispatched(lambda: todevice.move(there, "tdtest"))
    assert ops.ops == [] and copies == {"h2d": 0, "d2h": 0, "d2d": 0}
    assert out["x"] is there["x"] and out["y"][1] is there["y"][1]
    same, ops, _ = dispatched(lambda: todevice.move(alone, "tdtest"))
    assert same is alone and ops.ops == []
    with torch.inference_mode():
        many = {f"t{i}": torch.randn(2).to("tdtest") for i in range(1000)}
    out, ops, _ = dispatched(lambda: todevice.move(many, "tdtest"))
    assert ops.ops == [] and out is not many and all(out[k] is many[k] for k in many)


def test_a_flat_batch_that_repeats_a_tensor_or_ties_memory_still_copies_it_once() -> None:
    t = torch.randn(4)
    batch = {"a": t, "b": t, "tied": t.view(4), "other": torch.randn(2)}
    there, _, copies = dispatched(lambda: todevice.move(batch, "tdtest"))
    assert copies["h2d"] == 2 and there["a"] is there["b"]
    assert there["tied"].raw.data_ptr() == there["a"].raw.data_ptr()  # tied memory stays tied
    pair, _, copies = dispatched(lambda: todevice.move((t, t), "tdtest"))
    assert copies["h2d"] == 1 and pair[0] is pair[1]


def test_a_flat_batch_names_the_tensor_that_cannot_be_copied() -> None:
    batch = {"x": torch.ones(2), "m": torch.ones(2, device="meta")}
    with pytest.raises(NotImplementedError, match=r"Cannot move \['m'\] \(Tensor of shape \(2,\)"):
        dispatched(lambda: todevice.move(batch, "tdtest"))


def test_no_stream_or_event_is_looked_up_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed costs once per move, not once per tensor: no current_stream() and no Event on the way there."""
    asked: list[str] = []
    current_stream = torch.accelerator.current_stream

    def counted_stream(*args: Any) -> Any:
        asked.append("current_stream")
        return current_stream(*args)

    class CountedEvent(torch.Event):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            asked.append("Event")

    monkeypatch.setattr(torch.accelerator, "current_stream", counted_stream)
    monkeypatch.setattr(torch, "Event", CountedEvent)
    batches = [
        [torch.randn(4) for _ in range(100)],
        {"x": [torch.randn(4) for _ in range(5)], "big": torch.randn(1 << 16)},
        {"a": torch.randn(3), "b": torch.arange(2)},
        torch.randn(5),
    ]
    for batch in batches:
        dispatched(lambda batch=batch: todevice.move(batch, "tdtest"))
    assert asked == []


def test_a_prefetched_batch_costs_what_a_timm_style_prefetcher_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per flat batch: one event, two current_stream() (the copies' start, the hand-over), one record_stream per
    copy, and no walk: as a side stream, .to() per tensor, wait_stream() and record_stream() cost."""
    asked: list[str] = []
    current_stream, take = torch.accelerator.current_stream, _layout.take

    def counted_stream(*args: Any) -> Any:
        asked.append("current_stream")
        return current_stream(*args)

    def counted_take(*args: Any, **kwargs: Any) -> Any:
        asked.append("walk")
        return take(*args, **kwargs)

    class CountedEvent(torch.Event):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            asked.append("Event")

    monkeypatch.setattr(torch.accelerator, "current_stream", counted_stream)
    monkeypatch.setattr(torch, "Event", CountedEvent)
    monkeypatch.setattr(_layout, "take", counted_take)
    batches = [{"image": torch.randn(3, 8, 8), "label": torch.arange(4) + i} for i in range(5)]
    del tdtest.RECORDED[:]
    with torch.inference_mode():
        got = [(b, [id(b["image"]), id(b["label"])]) for b in todevice.prefetch(batches, "tdtest")]
    assert collections.Counter(asked) == {"current_stream": 2 * 5, "Event": 5}
    assert [i for _, ids in got for i in ids] == tdtest.RECORDED  # each copy recorded, when its batch is handed over
    for (b, _), sent in zip(got, batches):
        assert b["image"].device == DEV and torch.equal(b["label"].raw, sent["label"])


def test_a_flat_batch_on_a_side_stream_records_its_copies_and_a_nested_one_walks() -> None:
    side = torch.Stream(device="tdtest")
    flat = {"x": torch.randn(3), "y": torch.arange(2)}
    del tdtest.RECORDED[:]
    with torch.inference_mode():
        out = todevice.move(flat, "tdtest", stream=side)
    assert sorted(tdtest.RECORDED) == sorted([id(out["x"]), id(out["y"])])
    with torch.inference_mode():
        there = todevice.move({"x": torch.randn(3)}, "tdtest")
        mixed = {"host": torch.randn(2), "there": there["x"]}  # already there: kept, and not recorded
        del tdtest.RECORDED[:]
        out = todevice.move(mixed, "tdtest", stream=side)
    assert out["there"] is there["x"] and [id(out["host"])] == tdtest.RECORDED
    helpers.assert_same_tree(
        todevice.move(out, "cpu", non_blocking=False), {**mixed, "there": there["x"].raw}, values=True
    )


def test_the_size_matrix_table_runs_on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)  # tdtest copies as it is asked
    full = _bench.carried_batches()
    small = {name: full[name] for name in list(full)[:4]}  # up to 10 tensors: a smoke test, not a timing
    small[list(full)[1]] = [torch.randn(2, 3, 8, 8), torch.arange(2)]
    monkeypatch.setattr(_bench.device, "carried_batches", lambda: small)
    ours = {"todevice.move": todevice.move, _bench.HELPER: _bench.recursive_to_device, "optree.tree_map": None}
    monkeypatch.setattr(_bench.device, "contenders", lambda: (dict(ours), []))  # no peers: importing them takes seconds
    with torch.inference_mode():
        rows = _bench.size_rows(rounds=1)
    assert {r["memory"] for r in rows} == {"pageable", "on the device"}  # tdtest has no pinned memory
    assert {r["contender"] for r in rows} == {"todevice.move", _bench.HELPER}
    assert all(r["host_ms"] > 0 and r["e2e_ms"] > 0 for r in rows)
    assert len(rows) == len({(r["workload"], r["contender"]) for r in rows}) == 16
    assert _bench.size_verdict(rows).count("Target: ") == 4


def test_coalesced_buffers_are_bounded_so_a_kept_tensor_holds_little() -> None:
    """1,600 x 64 KiB coalesced: buffers of at most COALESCED_MAX_BYTES, one copy each, not one of 100 MiB."""
    batch = [torch.randn(16384) for _ in range(100)]  # 100 x 64 KiB, 6.25 MiB
    tied = batch[0].view(16384)  # distinct, over the same memory, read the same way
    out, _, copies = dispatched(lambda: todevice.move({"x": batch, "tied": tied}, "tdtest", coalesce=True))
    assert copies["h2d"] == 2  # 4 MiB, then the rest
    assert out["tied"].raw.data_ptr() == out["x"][0].raw.data_ptr()  # tied across the buffers' walk order
    helpers.assert_same_tree(todevice.move(out, "cpu", non_blocking=False), {"x": batch, "tied": tied}, values=True)


@given(strategies.trees)
def test_random_trees_round_trip_in_small_coalesced_buffers(tree: Any) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(_layout, "COALESCED_MAX_BYTES", 64)
        _, back = there_and_back(tree, coalesce=True)
    helpers.assert_same_tree(back, helpers.reference_move(tree, "cpu"), values=True, grad=False)


# ---------------------------------------------------------------- staging through pinned memory


@pytest.fixture
def pinned_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pinned memory for a backend that has none: plain host blocks, their sizes counted."""
    sizes: list[int] = []

    def pinned(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        sizes.append(numel * dtype.itemsize)
        return torch.empty(numel, dtype=dtype)

    monkeypatch.setattr(_move._stream, "pinned", pinned)
    return sizes


@pytest.fixture
def pinned_stand_in(pinned_counted: list[int], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``pinned_counted``, with the driver's limits shrunk to 1 KiB: tensors of a few KiB are staged as
    those of a few MiB are on a GPU."""
    sizes = pinned_counted
    monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES", 1024)
    monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES_ONE", 1024)
    return sizes


def test_pageable_tensors_over_the_limit_cross_through_one_pinned_buffer(pinned_stand_in: list[int]) -> None:
    big = torch.randn(2560)  # 10 KiB
    tree = {"big": big, "small": [torch.randn(2) for _ in range(5)], "more": torch.randn(300)}
    before = tdtest.COPIES["h2d"]
    del tdtest.NON_BLOCKING[:]
    there, back = there_and_back(tree, coalesce_max_bytes=1024)
    # Five small tensors are too few to coalesce: each of the seven crosses alone, all through one buffer.
    assert tdtest.COPIES["h2d"] - before == 7
    assert all(nb for kind, nb in tdtest.NON_BLOCKING if kind == "h2d")
    assert pinned_stand_in == [10240 + 5 * 16 + 1200]  # one allocation, each tensor 16-byte aligned
    assert there["big"].raw.untyped_storage().nbytes() == big.nbytes  # its own allocation on the device
    helpers.assert_same_tree(back, tree, values=True)


def test_images_and_labels_cross_through_one_pinned_buffer_over_the_limit(pinned_stand_in: list[int]) -> None:
    images, labels = torch.randn(4, 3, 8, 8), torch.arange(4)  # 3 KiB of images, pageable
    there, _, copies = dispatched(lambda: todevice.move([images, labels], "tdtest"))
    assert copies["h2d"] == 2 and pinned_stand_in == [images.nbytes + 32]  # one buffer, each 16-byte aligned
    helpers.assert_same_tree(todevice.move(there, "cpu", non_blocking=False), [images, labels], values=True)


def test_pinned_images_go_as_they_are_and_their_labels_straight(
    pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only pageable bytes count towards the limit: pinned images leave 32 bytes of labels, far under it."""
    images, labels = torch.randn(4, 3, 8, 8), torch.arange(4)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: self is images)
    there, _, copies = dispatched(lambda: todevice.move((images, labels), "tdtest"))
    assert copies["h2d"] == 2 and pinned_stand_in == []
    assert torch.equal(todevice.move(there[0], "cpu", non_blocking=False), images)


def test_only_host_tensors_are_staged(pinned_stand_in: list[int]) -> None:
    """A tensor on the device, cast on the way, is copied there: never through host memory."""
    with torch.inference_mode():
        there = torch.ones(4).to("tdtest")
    batch = {"big": torch.randn(2560), "there": there, "small": torch.zeros(3)}
    out, _, copies = dispatched(lambda: todevice.move(batch, "tdtest", dtype=torch.float16))
    assert copies["d2h"] == 0 and copies["d2d"] == 1 and pinned_stand_in == [2560 * 2 + 16]  # cast on the host
    assert out["there"].dtype == torch.float16


def test_tensors_over_the_same_memory_are_staged_once(pinned_stand_in: list[int]) -> None:
    w = torch.randn(1000)
    state = {"emb.weight": w.detach(), "head.weight": w.detach(), "bias": torch.zeros(3)}  # as state_dict() ties
    out, _, copies = dispatched(lambda: todevice.move(state, "tdtest", coalesce_max_bytes=1024))
    assert copies["h2d"] == 2 and pinned_stand_in == [16 + 4000]
    assert out["emb.weight"].raw.data_ptr() == out["head.weight"].raw.data_ptr()  # still tied


def test_one_move_stages_at_most_stage_max_bytes(pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_layout, "STAGE_MAX_BYTES", 5000)
    batch = {f"w{i}": torch.randn(1000) for i in range(3)}  # 3 x 4,000 bytes, each over the 1 KiB limit
    out, _, copies = dispatched(lambda: todevice.move({"nested": batch}, "tdtest", coalesce_max_bytes=1024))
    assert copies["h2d"] == 3 and pinned_stand_in == [4000]  # the first staged, the rest straight
    helpers.assert_same_tree(todevice.move(out, "cpu", non_blocking=False), {"nested": batch}, values=True)


def test_a_packed_batch_s_large_pageable_tensors_are_staged(pinned_stand_in: list[int]) -> None:
    images = torch.randn(20000)  # 80 KB: left out of the packed buffer, over the (shrunk) limit
    packed = todevice.pack({"images": images, "labels": torch.arange(4)})
    for move in (lambda: todevice.move(packed, "tdtest"), lambda: packed.unpack("tdtest")):
        del pinned_stand_in[:]
        out, _, _ = dispatched(move)
        assert images.nbytes in pinned_stand_in
        assert torch.equal(todevice.move(out["images"], "cpu", non_blocking=False), images)


def test_a_flat_batch_already_there_comes_back_in_a_new_container() -> None:
    with torch.inference_mode():
        pair = (torch.ones(2).to("tdtest"), torch.zeros(2).to("tdtest"))
    out, ops, _ = dispatched(lambda: todevice.move(pair, "tdtest"))
    assert out is not pair and out[0] is pair[0] and type(out) is tuple and ops.ops == []


def test_pageable_tensors_under_the_limit_cross_as_they_are(pinned_stand_in: list[int]) -> None:
    tree = {"a": torch.randn(100), "b": torch.randn(100)}  # 800 bytes in all, under 1 KiB
    before = tdtest.COPIES["h2d"]
    _, back = there_and_back(tree)
    assert tdtest.COPIES["h2d"] - before == 2 and pinned_stand_in == []
    helpers.assert_same_tree(back, tree, values=True)


def test_the_small_tensors_coalesced_leave_the_rest_to_the_limit(pinned_stand_in: list[int]) -> None:
    n = _layout.COALESCE_MIN_TENSORS
    tree = {"small": [torch.randn(4) for _ in range(n)], "big": torch.randn(2000)}  # 8,000 bytes alone
    before = tdtest.COPIES["h2d"]
    _, back = there_and_back(tree, coalesce_max_bytes=64)
    assert tdtest.COPIES["h2d"] - before == 2  # the small ones in one copy, the big one alone
    assert sorted(pinned_stand_in) == [n * 16, 8000]  # the coalesced buffer, then the staging of the big one
    helpers.assert_same_tree(back, tree, values=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(40, 64).t(),  # dense, transposed: its strides are kept, as .to() keeps them
        lambda: torch.randn(40, 128)[:, ::2],  # with gaps: laid out contiguously first
        lambda: torch.randn(1, 3, 40, 40).contiguous(memory_format=torch.channels_last),
        lambda: torch.randn(1).expand(3000),  # overlapping
        lambda: torch.randn(0, 5),
        lambda: torch.randint(0, 9, (3001,), dtype=torch.int8),  # an odd number of bytes
    ],
)
def test_staged_values_and_strides_match_to(pinned_stand_in: list[int], make: Any) -> None:
    src = make()
    with torch.inference_mode():
        there = todevice.move(src, "tdtest", coalesce=False)
        expected = src.to("tdtest")
        back = todevice.move(there, "cpu", non_blocking=False)
    assert there.shape == src.shape and there.stride() == expected.stride()
    assert torch.equal(back, src)
    assert len(pinned_stand_in) == (src.nbytes > 1024)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_staged_cast_sends_the_smaller_dtype(pinned_stand_in: list[int], dtype: torch.dtype) -> None:
    src = torch.randn(1000)  # 4,000 bytes of float32
    with torch.inference_mode():
        there = todevice.move(src, "tdtest", dtype=dtype, coalesce=False)
        back = todevice.move(there, "cpu", non_blocking=False)
    assert there.dtype == dtype and torch.equal(back, src.to(dtype))
    assert sum(pinned_stand_in) == 1000 * min(dtype.itemsize, 4)


def test_a_large_staged_tensor_is_written_and_sent_piece_by_piece(
    pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece's copy is queued before the next piece is written; a tensor of one piece is written, then sent."""
    monkeypatch.setattr(_layout, "STAGE_CHUNK_BYTES", 4096)  # 1,024 float32
    batch = {"a": torch.randn(2500), "b": torch.randn(3, 300)}  # 10,000 bytes, then 3,600
    copies = helpers.Copies()
    with torch.inference_mode(), copies:
        there = todevice.move(batch, "tdtest", coalesce=False)
    host, across = ("cpu", "cpu"), ("cpu", "tdtest")
    assert copies.log == [
        (*host, 1024), (*across, 1024), (*host, 1024), (*across, 1024), (*host, 452), (*across, 452),
        (*host, 900), (*across, 900),
    ]  # fmt: skip
    assert pinned_stand_in == [10000 + 3600]  # one block, as before
    with torch.inference_mode():
        helpers.assert_same_tree(todevice.move(there, "cpu", non_blocking=False), batch, values=True)


@pytest.mark.parametrize(
    ("make", "dtype", "pieces"),
    [
        (lambda: torch.randn(2500), torch.float16, 2),  # cast on the host: 2,048 halves a piece
        (lambda: torch.randn(50, 50).t(), None, 1),  # tdtest's targets are contiguous, this is not: written whole
        (lambda: torch.randn(60, 60)[:, ::2], None, 1),  # with gaps: written whole, laid out as its target is
        (lambda: torch._neg_view(torch.randn(2500)), None, 3),  # a lazy negation, resolved before the pieces
    ],
)
def test_pieces_keep_values_casts_and_layouts(
    pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch, make: Any, dtype: Any, pieces: int
) -> None:
    monkeypatch.setattr(_layout, "STAGE_CHUNK_BYTES", 4096)
    src = make()
    copies = helpers.Copies()
    with torch.inference_mode(), copies:
        there = todevice.move(src, "tdtest", dtype=dtype, coalesce=False)
        back = todevice.move(there, "cpu", non_blocking=False)
    expected = src.to("tdtest", dtype=dtype)
    assert there.dtype == expected.dtype and there.stride() == expected.stride()
    assert torch.equal(back, src.to(dtype) if dtype is not None else src)
    assert sum(1 for a, b, _ in copies.log if (a, b) == ("cpu", "tdtest")) == pieces


def test_a_pinned_source_is_sent_as_it_is(pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Never read on the host: its copy is ordered on the stream, after any write queued to it."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: True)
    src = torch.randn(2560)
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        back = todevice.move(todevice.move({"big": src}, "tdtest", coalesce_max_bytes=1024), "cpu", non_blocking=False)
    assert tdtest.COPIES["h2d"] - before == 1 and pinned_stand_in == []
    assert torch.equal(back["big"], src)


def test_without_pinned_memory_the_copies_go_from_pageable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def none_left(numel: int, dtype: torch.dtype, device: torch.device) -> None:
        asked.append(numel)

    monkeypatch.setattr(_move._stream, "pinned", none_left)
    monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES_ONE", 1024)
    src = torch.randn(2560)
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        back = todevice.move(todevice.move(src, "tdtest", coalesce=False), "cpu", non_blocking=False)
    assert asked == [src.nbytes] and tdtest.COPIES["h2d"] - before == 1
    assert torch.equal(back, src)


@given(strategies.trees)
def test_random_trees_round_trip_through_pinned_staging(tree: Any) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(_move._stream, "pinned", lambda numel, dtype, device: torch.empty(numel, dtype=dtype))
        monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES", 16)
        monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES_ONE", 16)
        _, back = there_and_back(tree, coalesce_max_bytes=32)
    helpers.assert_same_tree(back, helpers.reference_move(tree, "cpu"), values=True, grad=False)


def _lazy(shape: tuple[int, ...], how: str, seed: int) -> torch.Tensor:
    """A tensor with the negative bit (a real view), the conjugate bit (a complex one), or neither."""
    g = torch.Generator().manual_seed(seed)
    z = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return z.conj().imag if how == "neg" else z.conj() if how == "conj" else z.real.clone()


@given(
    st.lists(
        st.tuples(st.sampled_from([(), (1,), (3,), (2, 3), (400,)]), st.sampled_from(["neg", "conj", "plain"])),
        min_size=1,
        max_size=20,
    ),
    st.sampled_from([None, torch.float16, torch.float64, torch.complex128]),
    st.sampled_from([None, True, False]),
)
def test_negative_and_conjugate_views_cross_staging_as_to_gives_them(
    specs: list[tuple[tuple[int, ...], str]], dtype: torch.dtype | None, coalesce: bool | None
) -> None:
    """Every staged write, cast or not (one pinned block for large pageable tensors, the coalesced buffer, out='s
    staging), gives the values .to() gives: a lazy negation or conjugation is never dropped."""
    if dtype is not None and not dtype.is_complex:
        specs = [(shape, "neg" if how == "conj" else how) for shape, how in specs]  # a real cast of a complex warns
    batch = [_lazy(shape, how, seed) for seed, (shape, how) in enumerate(specs)]
    expected = [t.to(dtype) if dtype is not None else t for t in batch]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(_move._stream, "pinned", lambda numel, dtype, device: torch.empty(numel, dtype=dtype))
        monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES", 1024)
        monkeypatch.setattr(_layout, "PAGEABLE_DIRECT_MAX_BYTES_ONE", 1024)
        _, back = there_and_back(batch, dtype=dtype, coalesce=coalesce)
        with torch.inference_mode():
            static = todevice.move([torch.zeros_like(t) for t in expected], "tdtest")
            todevice.move(batch, out=static, dtype=dtype, coalesce=coalesce)
            into = todevice.move(static, "cpu", non_blocking=False)
    for got in (back, into):
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and torch.equal(g, e.resolve_neg().resolve_conj())


# ---------------------------------------------------------------- moves to the host


def test_a_large_result_lands_in_pageable_memory() -> None:
    """Only results up to PINNED_RESULT_MAX_BYTES are copied asynchronously into pinned memory."""
    with torch.inference_mode():
        there = todevice.move({"big": torch.randn(1 << 15)}, "tdtest")
        del tdtest.NON_BLOCKING[:]
        back = todevice.move(there, "cpu")  # non_blocking=True: tdtest has no pinned memory to land in
    assert tdtest.NON_BLOCKING == [("d2h", False)]
    assert not back["big"].is_pinned()


class Holder:
    """An object that moves itself, holding a tensor where only its attributes show it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any, non_blocking: bool = False) -> Holder:
        return Holder(self.t.to(device))


def test_a_to_object_moved_to_the_host_waits_for_its_own_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(_move._stream, "synchronize", synced.append)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: synced.append("every device"))  # type: ignore[arg-type]
    with torch.inference_mode():
        holder = Holder(torch.ones(3).to("tdtest"))
        out = todevice.move({"h": holder}, "cpu")
    assert torch.equal(out["h"].t, torch.ones(3))
    assert synced == [DEV]


def test_a_packed_batch_on_the_device_is_waited_for_before_unpacking_to_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A buffer loaded with torch.load(map_location=...) onto a device: its copy back is waited for."""
    synced: list[torch.device] = []
    monkeypatch.setattr(_move._stream, "synchronize", synced.append)
    monkeypatch.setattr(_layout, "PINNED_RESULT_MAX_BYTES", 0)  # tdtest has no pinned memory to land in
    tree = {"x": [torch.randn(3) for _ in range(4)]}
    packed = todevice.pack(tree)
    with torch.inference_mode():
        on_device = todevice.PackedBatch(
            packed.buffer.to("tdtest"), packed.layout, packed.skeleton, packed.requires_grad, packed.loose
        )
        back = on_device.unpack()
    assert synced == [DEV]
    helpers.assert_same_tree(back, tree, values=True)


def test_a_packed_batch_on_the_device_cast_on_the_host_is_copied_back_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cast reads the buffer on the host at once: the copy must have landed by then."""
    tree = {"x": [torch.randn(3) for _ in range(4)]}
    packed = todevice.pack(tree)
    with torch.inference_mode():
        on_device = todevice.PackedBatch(
            packed.buffer.to("tdtest"), packed.layout, packed.skeleton, packed.requires_grad, packed.loose
        )
        del tdtest.NON_BLOCKING[:]
        back = todevice.move(on_device, "cpu", dtype=torch.float64)
    assert tdtest.NON_BLOCKING == [("d2h", False)]
    helpers.assert_same_tree(back, helpers.reference_move(tree, "cpu", torch.float64), values=True)


class Storage(dict):  # type: ignore[type-arg]
    """Where a graph library keeps its tensors: a mapping inside an attribute."""


class Graph:
    def __init__(self, x: torch.Tensor) -> None:
        self._store = Storage(x=x)

    def to(self, device: Any, non_blocking: bool = False) -> Graph:
        for k, v in self._store.items():
            self._store[k] = v.to(device)  # in place, through the mapping copy.copy shares
        return self


def test_the_devices_of_a_to_object_are_read_before_its_to_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(_move._stream, "synchronize", synced.append)
    monkeypatch.setattr(_move._stream, "devices_in_use", lambda: ["no tensors were found"])
    with torch.inference_mode():
        graph = Graph(torch.ones(3).to("tdtest"))
        todevice.move({"g": graph}, "cpu")
    assert synced == [DEV]


# ---------------------------------------------------------------- small device tensors to the host in one copy


def on_device(tree: Any) -> Any:
    with torch.inference_mode():
        return todevice.move(tree, "tdtest", coalesce=False)


def counted(fn: Any) -> tuple[Any, dict[str, int], dict[str, int]]:
    """``fn()``, and the copies and device kernels it ran."""
    copies, kernels = dict(tdtest.COPIES), dict(tdtest.KERNELS)
    with torch.inference_mode():
        out = fn()
    return (
        out,
        {k: tdtest.COPIES[k] - copies[k] for k in copies},
        {k: tdtest.KERNELS[k] - kernels[k] for k in kernels},
    )


def outputs() -> dict[str, Any]:
    """A thousand small results of mixed dtypes and shapes: 0-dim, empty, non-contiguous, a name."""
    return {
        "loss": [torch.tensor(float(i)) for i in range(300)],
        "logits": [torch.randn(4, 3) for _ in range(500)],
        "ids": [torch.arange(i % 9) for i in range(150)],  # empty and ragged, int64
        "mask": [torch.rand(5) > 0.5 for _ in range(40)],
        "half": [torch.randn(2, 2).half() for _ in range(9)],
        "t": torch.randn(6, 4).t(),  # non-contiguous on the host: a strided view on the device too
        "name": "step-3",
    }


def test_a_thousand_small_device_tensors_come_back_in_one_copy() -> None:
    tree = outputs()
    there = on_device(tree)
    back, copies, kernels = counted(lambda: todevice.move(there, "cpu"))
    assert copies["h2d"] == 0 and copies["d2h"] == 1
    # A kernel or two per group of the layout (a copy on the device for padded rows), not one per tensor.
    groups = _layout.take(there, _layout.takes(frozenset(), True), todevice.COALESCE_MAX_BYTES, None).layout.groups
    assert 1 <= sum(kernels.values()) + copies["d2d"] <= 2 * len(groups) < 40
    helpers.assert_same_tree(back, tree, values=True)


def test_without_coalescing_each_device_tensor_is_a_copy_back() -> None:
    tree = {"x": [torch.randn(3) for _ in range(20)]}
    there = on_device(tree)
    back, copies, kernels = counted(lambda: todevice.move(there, "cpu", coalesce=False, non_blocking=False))
    assert copies["d2h"] == 20 and sum(kernels.values()) == 0
    helpers.assert_same_tree(back, tree, values=True)


def test_a_single_device_tensor_comes_back_alone_without_a_gather() -> None:
    tree = {"loss": torch.tensor(1.5), "step": 3, "host": torch.ones(2)}
    there = {**tree, "loss": on_device(tree["loss"])}
    back, copies, kernels = counted(lambda: todevice.move(there, "cpu", non_blocking=False))
    assert copies["d2h"] == 1 and sum(kernels.values()) == 0
    assert back["host"] is there["host"]  # on the host already: the very same tensor
    helpers.assert_same_tree(back, tree, values=True)


def test_large_device_tensors_come_back_alone_and_small_ones_together() -> None:
    tree = {"big": torch.randn(1 << 15), "small": [torch.randn(2) for _ in range(5)]}
    back, copies, _ = counted(lambda: todevice.move(on_device(tree), "cpu"))
    assert copies["d2h"] == 2
    assert back["big"].untyped_storage().nbytes() == tree["big"].nbytes  # its own allocation
    # A kept small result holds the small results' buffer at most, never the large one's memory.
    assert back["small"][0].untyped_storage().nbytes() == 5 * 16
    helpers.assert_same_tree(back, tree, values=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_cast_on_the_way_back_in_one_copy(dtype: torch.dtype) -> None:
    tree = {"f": [torch.randn(3) for _ in range(10)], "i": [torch.arange(3) for _ in range(3)]}
    back, copies, _ = counted(lambda: todevice.move(on_device(tree), "cpu", dtype=dtype))
    assert copies["d2h"] == 1
    helpers.assert_same_tree(back, helpers.reference_move(tree, "cpu", dtype), values=True)


def test_repeated_and_tied_device_tensors_stay_so_on_the_host() -> None:
    with torch.inference_mode():
        t = torch.randn(4).to("tdtest")
        tree = {"a": t, "b": [t], "other": torch.randn(4).to("tdtest"), "more": torch.randn(2).to("tdtest")}
    back, copies, _ = counted(lambda: todevice.move(tree, "cpu"))
    assert copies["d2h"] == 1
    assert back["a"] is back["b"][0]
    assert torch.equal(back["a"], t.raw) and torch.equal(back["other"], tree["other"].raw)


def test_skipped_device_tensors_stay_on_the_device() -> None:
    there = on_device({"x": [torch.randn(2) for _ in range(4)], "cache": torch.randn(3)})
    back, copies, _ = counted(lambda: todevice.move(there, "cpu", skip_keys="cache"))
    assert copies["d2h"] == 1 and back["cache"] is there["cache"]
    assert all(x.is_cpu for x in back["x"])


def test_gathered_results_come_back_in_one_blocking_copy_with_no_pinned_block_and_no_other_wait(
    pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned buffer would first query the event of every pinned block freed since the last allocation."""
    synced: list[torch.device] = []
    monkeypatch.setattr(_move._stream, "synchronize", synced.append)
    for tree in (
        {"x": [torch.randn(4) for _ in range(100)]},
        {"x": [torch.randn(4) for _ in range(100)], "p": helpers.Point(1, 2)},
    ):
        there = on_device(tree)
        del tdtest.NON_BLOCKING[:], pinned_stand_in[:]
        back, _, _ = counted(lambda there=there: todevice.move(there, "cpu"))
        assert tdtest.NON_BLOCKING == [("d2h", False)]  # one copy, which waits for the queued work by itself
        assert pinned_stand_in == [] and synced == []
        helpers.assert_same_tree(back, tree, values=True)


def test_tensors_of_another_device_are_not_gathered_with_these() -> None:
    """One buffer per source device: a meta tensor is copied alone, and its error names its path."""
    with torch.inference_mode():
        tree = {"x": [torch.randn(2).to("tdtest") for _ in range(3)], "m": [torch.ones(2, device="meta")]}
        with pytest.raises(NotImplementedError, match=r"Cannot move \['m'\]\[0\] \(Tensor of shape \(2,\)"):
            todevice.move(tree, "cpu")


def test_gradients_flow_back_through_results_that_need_them() -> None:
    x = torch.randn(3, requires_grad=True)
    there = {"y": x.to("tdtest"), "n": [torch.randn(2).to("tdtest") for _ in range(3)]}
    back = todevice.move(there, "cpu", non_blocking=False)
    assert back["y"].requires_grad and not back["n"][0].requires_grad
    back["y"].sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(3))


def test_a_flat_dict_of_device_scalars_comes_back_in_one_look_one_gather_and_one_copy(
    pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(_move._stream, "synchronize", synced.append)
    metrics = {f"m{i}": torch.tensor(float(i)) for i in range(1000)}
    there = on_device(metrics)
    walked: list[Any] = []
    monkeypatch.setattr(_layout, "take", lambda *a, **k: walked.append(a))  # the general way's walk: not taken
    del tdtest.NON_BLOCKING[:], pinned_stand_in[:]
    back, ops, copies = dispatched(lambda: todevice.move(there, "cpu"))
    assert copies == {"h2d": 0, "d2h": 1, "d2d": 0} and walked == [] and synced == []
    assert tdtest.NON_BLOCKING == [("d2h", False)] and pinned_stand_in == []  # one blocking copy
    # No op per tensor from Python: one stack on the device, one copy, one unbind on the host, and the buffers.
    dispatched_ops = collections.Counter(op.split(".")[0] for op in ops.ops)
    assert dispatched_ops["stack"] == dispatched_ops["unbind"] == 1 and max(dispatched_ops.values()) <= 2, (
        dispatched_ops
    )
    assert type(back) is dict and list(back) == list(metrics)
    helpers.assert_same_tree(back, metrics, values=True)


def test_nested_plain_containers_come_back_without_a_walk_and_others_with_one(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = {"loss": torch.tensor(0.5), "metrics": {f"m{i}": torch.tensor(float(i)) for i in range(40)}, "step": 7}
    tree["per_class"] = [(torch.randn(1 + i % 4), "class", None) for i in range(30)]
    there = on_device(tree)
    walked: list[Any] = []
    take = _layout.take
    monkeypatch.setattr(_layout, "take", lambda *a, **k: walked.append(1) or take(*a, **k))
    back, copies, _ = counted(lambda: todevice.move(there, "cpu", non_blocking=False))
    assert copies["d2h"] == 1 and walked == []
    helpers.assert_same_tree(back, tree, values=True)
    # A namedtuple, a host tensor, a tensor twice or an object: the general way, which keeps what each needs.
    host = torch.ones(2)
    point = helpers.Point(*on_device([torch.ones(1), torch.zeros(1)]))
    for odd in (point, host, there["loss"], helpers.Color.RED):
        batch = {**there, "odd": [odd]}
        back, copies, _ = counted(lambda batch=batch: todevice.move(batch, "cpu", non_blocking=False))
        assert copies["d2h"] == 1 and len(walked) == 1, odd
        del walked[:]
        got = back["odd"][0]
        if odd is point:
            assert type(got) is helpers.Point and got.x.is_cpu and torch.equal(got.x, torch.ones(1))
        elif odd is there["loss"]:
            assert got is back["loss"]  # the same tensor twice: one result
        else:
            assert got is odd  # a host tensor, an atom: as it is
        assert back["metrics"]["m3"].item() == 3.0


@pytest.mark.parametrize("kind", [list, tuple])
def test_a_flat_list_or_tuple_of_mixed_device_tensors_comes_back_in_one_copy(kind: Any) -> None:
    tree = kind([torch.randn(3), torch.arange(4), torch.randn(2, 2).half(), torch.tensor(True), torch.randn(6, 4).t()])
    there = on_device(tree)
    back, copies, _ = counted(lambda: todevice.move(there, "cpu"))
    assert copies["d2h"] == 1 and type(back) is kind
    helpers.assert_same_tree(back, tree, values=True)


def test_a_flat_batch_back_keeps_repeats_host_tensors_grads_and_limits() -> None:
    """What the one-look way back cannot keep, the general way does: the results are the same."""
    with torch.inference_mode():
        t, u = torch.randn(4).to("tdtest"), torch.randn(2).to("tdtest")
    repeated = [t, u, t]
    back, copies, _ = counted(lambda: todevice.move(repeated, "cpu"))
    assert copies["d2h"] == 1 and back[0] is back[2] and torch.equal(back[0], t.raw)
    host = torch.ones(2)
    back, _, _ = counted(lambda: todevice.move({"a": t, "b": u, "host": host}, "cpu"))
    assert back["host"] is host and torch.equal(back["b"], u.raw)
    x = torch.randn(3, requires_grad=True)
    grads = (u, x.to("tdtest"))
    back = todevice.move(grads, "cpu", non_blocking=False)
    assert back[1].requires_grad and not back[0].requires_grad
    back[1].sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(3))
    big = on_device([torch.randn(1 << 15), torch.randn(2), torch.randn(2)])  # 128 KiB: over the coalescing limit
    back, copies, _ = counted(lambda: todevice.move(big, "cpu"))
    assert copies["d2h"] == 2 and back[0].untyped_storage().nbytes() == 1 << 17
    skipped, _, _ = counted(lambda: todevice.move({"a": t, "b": u}, "cpu", skip_keys="b", non_blocking=False))
    assert skipped["b"] is u and skipped["a"].is_cpu
    cast, _, _ = counted(lambda: todevice.move([t, u], "cpu", dtype=torch.float64, non_blocking=False))
    assert cast[0].dtype == torch.float64 and torch.equal(cast[0], t.raw.double())


@settings(max_examples=40)  # each example crosses the Python backend: the general way's own test searches further
@given(st.lists(strategies.tensors(), min_size=2, max_size=12), st.sampled_from([list, tuple, dict]))
def test_random_flat_batches_come_back_as_the_reference_moves_them(tensors: list[torch.Tensor], kind: Any) -> None:
    tree = {f"k{i}": t for i, t in enumerate(tensors)} if kind is dict else kind(tensors)
    there = on_device(tree)
    with torch.inference_mode():
        back = todevice.move(there, "cpu")
    helpers.assert_same_tree(back, helpers.reference_move(tree, "cpu"), values=True, grad=False)


@given(strategies.trees)
def test_random_trees_come_back_through_one_copy(tree: Any) -> None:
    there = on_device(tree)
    with torch.inference_mode():
        back = todevice.move(there, "cpu", coalesce_max_bytes=64, non_blocking=False)
    helpers.assert_same_tree(back, helpers.reference_move(tree, "cpu"), values=True, grad=False)


@settings(max_examples=40)
@given(strategies.trees_with_aliases())
def test_the_way_back_gives_the_oracle_s_result(tree: Any) -> None:
    """The way back (``_back.brought``, and the gathering walk) and the general walk, which copies each tensor alone,
    give the plain oracle's result: the same types, values, dtypes, devices and aliasing."""
    there = on_device(tree)
    with torch.inference_mode():  # blocking: copies into pageable memory (tdtest has no pinned memory)
        expected = helpers.reference_move(there, "cpu")
        p = _move.plan_for("cpu", False, None)
        for got in (
            todevice.move(there, "cpu", non_blocking=False),
            _move._general(there, p, False, todevice.COALESCE_MAX_BYTES, None, False),
        ):
            helpers.assert_same_tree(got, expected, values=True, grad=False)
            assert helpers.sharing(got) == helpers.sharing(expected)


# ---------------------------------------------------------------- into static buffers: move(batch, out=static)


def step(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": [torch.randn(3, generator=g) for _ in range(100)],
        "ids": torch.randint(0, 9, (7,), generator=g),
        "half": torch.randn(2, 3, generator=g).half(),
        "big": torch.randn(1 << 15, generator=g),
        "name": f"step-{seed}",
    }


@pytest.fixture
def one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """tdtest's views keep no storage of their own: the library's span check, run on the host memory behind them."""

    def span(targets: list[torch.Tensor], lay: _layout.Layout) -> torch.Tensor | None:
        host = real_span([t.raw for t in targets], lay)  # type: ignore[attr-defined]
        return None if host is None else tdtest.wrap(host)

    real_span = _into._span
    monkeypatch.setattr(_into, "_span", span)


def test_into_one_device_buffer_in_one_copy(one_buffer: None, pinned_stand_in: list[int]) -> None:
    with torch.inference_mode():
        static = todevice.move(step(0), "tdtest")  # the small tensors: views of one device buffer
    kept = [t.raw.data_ptr() for t in static["x"]]
    for seed in (1, 2, 3):
        b = step(seed)
        del tdtest.NON_BLOCKING[:]
        got, copies, _ = counted(lambda b=b: todevice.move(b, out=static))
        assert got is static and [t.raw.data_ptr() for t in static["x"]] == kept
        # The 102 small tensors in one asynchronous copy per group (float32[3] leaves padding between them, which
        # may be another tensor's bytes in a buffer out= did not make), the large one through a pinned block.
        groups = _layout.layout_for([t for t in b["x"]] + [b["ids"], b["half"]], None).groups
        assert copies["h2d"] == len(groups) + 1 == 4 and copies["d2h"] == 0
        assert b["big"].nbytes in pinned_stand_in
        assert all(nb for kind, nb in tdtest.NON_BLOCKING)
        back = todevice.move(static, "cpu", non_blocking=False)
        helpers.assert_same_tree({**back, "name": b["name"]}, b, values=True, same=False)


def test_a_static_batch_feeds_one_device_buffer_in_one_copy(
    one_buffer: None, pinned_stand_in: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_into, "copy", None)  # every step is the one-buffer step: out='s general copy is not called
    small = {k: v for k, v in step(0).items() if k != "big"}
    with torch.inference_mode():
        feed = todevice.static(small, "tdtest")  # views of one device buffer, the example's values in them
        back = todevice.move(feed.static, "cpu", non_blocking=False)
    helpers.assert_same_tree(back, small, values=True, same=False)
    assert repr(feed) == "StaticBatch(102 tensors in one buffer)"
    for seed in (1, 2):
        b = {k: v for k, v in step(seed).items() if k != "big"}
        del tdtest.NON_BLOCKING[:]
        with torch.inference_mode():  # the targets are inference tensors
            got, copies, _ = counted(lambda b=b: feed(b))
        assert got is feed.static and copies["h2d"] == 1 and copies["d2h"] == 0
        assert all(nb for kind, nb in tdtest.NON_BLOCKING)  # from page-locked staging, asynchronous
        with torch.inference_mode():
            back = todevice.move(feed.static, "cpu", non_blocking=False)
        helpers.assert_same_tree({**back, "name": b["name"]}, b, values=True, same=False)


def test_into_separate_device_tensors_a_copy_each() -> None:
    with torch.inference_mode():
        static = todevice.move(step(0), "tdtest")  # seen as separate tensors: no span on tdtest
    b = step(1)
    _, copies, _ = counted(lambda: todevice.move(b, out=static))
    assert copies["h2d"] == 102 + 1
    back = todevice.move(static, "cpu", non_blocking=False)
    helpers.assert_same_tree({**back, "name": b["name"]}, b, values=True, same=False)


def test_into_device_buffers_from_device_tensors() -> None:
    with torch.inference_mode():
        static = todevice.move({"a": torch.zeros(3), "b": torch.zeros(2)}, "tdtest")
        src = todevice.move({"a": torch.ones(3), "b": torch.full((2,), 2.0)}, "tdtest")
    _, copies, _ = counted(lambda: todevice.move(src, out=static))
    assert copies == {"h2d": 0, "d2h": 0, "d2d": 2}
    assert torch.equal(static["a"].raw, torch.ones(3)) and torch.equal(static["b"].raw, torch.full((2,), 2.0))


def test_a_mapping_that_reads_its_values_is_rebuilt_from_tensors_both_ways() -> None:
    from tests.test_pack import _AsTensors

    m = _AsTensors({f"k{i}": torch.full((3,), float(i)) for i in range(20)})
    batch = {"m": m, "other": [torch.randn(2) for _ in range(5)]}
    there, copies, _ = counted(lambda: todevice.move(batch, "tdtest"))
    assert copies["h2d"] == 1 and type(there["m"]) is _AsTensors and there["m"].shapes == m.shapes
    back, copies, _ = counted(lambda: todevice.move(there, "cpu", non_blocking=False))
    assert copies["d2h"] == 1 and type(back["m"]) is _AsTensors and back["m"].shapes == m.shapes
    assert all(torch.equal(back["m"][k], m[k]) for k in m)


def test_assert_moved_raises_no_false_alarm_where_tensors_report_no_address() -> None:
    from todevice import testing

    tree = {"a": torch.randn(3), "b": [torch.randn(2), torch.arange(4)], "c": torch.randn(2, 2)}
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest", coalesce=False)
    assert {t.data_ptr() for t in (there["a"], there["c"])} == {0}  # what this backend reports
    testing.assert_moved(there, tree, "tdtest")


def test_a_deep_plain_batch_comes_back_through_the_general_way() -> None:
    deep: Any = "leaf"
    for _ in range(700):  # deeper than the one-pass way back rebuilds on Python's stack
        deep = [deep]
    with torch.inference_mode():
        there = [torch.ones(2).to("tdtest"), torch.zeros(2).to("tdtest"), deep]
    back, copies, _ = counted(lambda: todevice.move(there, "cpu", non_blocking=False))
    assert copies["d2h"] >= 1 and back[0].is_cpu and torch.equal(back[1], torch.zeros(2)) and back[2] == deep


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("sparse", ["coo", "csr"])
def test_into_device_targets_a_sparse_source_is_refused_before_the_large_ones_are_written(sparse: str) -> None:
    """The large tensors are copied alone before the small ones together: a sparse source among them must be refused
    first, or out= would be left half written."""
    with torch.inference_mode():
        static = todevice.move(step(0), "tdtest")
    b = step(1)
    b["ids"] = torch.eye(7).to_sparse() if sparse == "coo" else torch.eye(7).to_sparse_csr()
    static["ids"] = todevice.move(torch.zeros(7, 7), "tdtest")
    before = dict(tdtest.COPIES)
    refused = pytest.raises(ValueError, match=r"at \['ids'\], the batch holds a Tensor .*Nothing was copied")
    with refused, torch.inference_mode():  # the targets are inference tensors
        todevice.move(b, out=static)
    assert before == tdtest.COPIES  # nothing crossed: the large tensor was not written


def test_bench_runs_on_an_accelerator_without_page_locked_memory() -> None:
    """Such a backend has no pinned form of the batch: bench() times the others, and checks the helper on each."""
    assert todevice._stream.no_pinned_memory() is not None  # tdtest has no pinned-memory allocator
    batch = {"x": torch.randn(3), "y": [torch.arange(4), "label"]}
    with torch.inference_mode():
        report = todevice.bench(batch, "tdtest", rounds=3)
    assert {row.form for row in report.rows} == {"pageable", "already on tdtest:0"}
    assert report.helper == "hand-written helper" and "hand-written helper" not in report.wrong
    assert batch["x"].device.type == "cpu"
