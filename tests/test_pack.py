"""The transfer engine on the CPU: pack()/unpack(), layouts, the coalesced path to 'meta', streams."""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import gc
import io
import os
import pickle
import subprocess
import sys
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import optree
import pytest
import torch
import torch.utils.backend_registration
from hypothesis import given, strategies as st

import todevice
from tests import helpers, strategies
from todevice import _layout, _move, _stream, _tree, _walk

META = torch.device("meta")
ROOT = Path(__file__).resolve().parent.parent


def packed_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors pack() takes from ``tree``, in walk order."""
    return _layout.take(tree, _layout.PACKING, _move.COALESCE_MAX_BYTES, None, grad=True).tensors


def moved(tree: Any, device: torch.device, dtype: torch.dtype | None = None, coalesce: bool = True) -> Any:
    """move()'s walk, and the state it left (its outputs)."""
    p = _move.plan_for(device, True, dtype)
    state = _move.State(p, None, coalesce)
    out = _move._batch(tree, state)
    return out, state


# ---------------------------------------------------------------- pack() and unpack()


@given(strategies.trees)
def test_pack_unpack_round_trips_exactly(tree: Any) -> None:
    out = todevice.pack(tree).unpack()
    helpers.assert_same_tree(out, helpers.reference_move(tree, "cpu"), values=True)


@given(strategies.trees)
def test_every_view_is_aligned_and_the_buffer_is_tight(tree: Any) -> None:
    packed = todevice.pack(tree)
    base = packed.buffer.data_ptr()
    views = _layout.read(packed.buffer, packed.layout)
    for v in views:
        if v.numel():
            assert (v.data_ptr() - base) % _layout.ALIGN == 0
            assert v.data_ptr() - base + v.nbytes <= packed.buffer.numel()
    data = sum(-(-t.nbytes // _layout.ALIGN) * _layout.ALIGN for t in packed_tensors(tree))
    assert packed.buffer.numel() <= data + _layout.ALIGN * len(packed.layout.groups)


def test_one_kept_small_tensor_holds_only_the_small_tensors_region() -> None:
    """Coalesced tensors are views of one buffer: a tensor over the limit never shares it."""
    batch = {
        "image": torch.randn(4, 3, 64, 64),
        "label": torch.arange(4),
        "weight": torch.ones(4),
        "big": torch.ones(20000),
    }
    for out in (todevice.move(batch, "meta", coalesce=True), todevice.pack(batch).unpack()):
        small = 4 * 8 + 4 * 4  # the int64 labels and the float32 weights, each 16-byte aligned
        assert out["label"].untyped_storage().nbytes() == small
        assert out["image"].untyped_storage().nbytes() == batch["image"].nbytes
        assert out["big"].untyped_storage().nbytes() == batch["big"].nbytes
    packed = todevice.pack(batch, max_bytes=None)  # everything in one buffer, when asked for
    assert packed.loose == 0 and packed.unpack()["label"].untyped_storage().nbytes() == packed.buffer.numel()


@given(strategies.trees)
def test_packed_batch_pickles_and_round_trips(tree: Any) -> None:
    packed = pickle.loads(pickle.dumps(todevice.pack(tree)))
    helpers.assert_same_tree(packed.unpack(), helpers.reference_move(tree, "cpu"), values=True, same=False)


@given(strategies.trees)
def test_coalesced_path_to_meta_matches_the_reference(tree: Any) -> None:
    out = todevice.move(tree, "meta", coalesce=True)
    helpers.assert_same_tree(out, helpers.reference_move(tree, "meta"))


@given(strategies.trees, st.sampled_from([torch.float16, torch.float64, torch.complex128]))
@pytest.mark.filterwarnings("ignore:Casting complex values to real discards:UserWarning")
def test_coalesced_cast_matches_the_reference(tree: Any, dtype: torch.dtype) -> None:
    out = todevice.move(tree, "meta", coalesce=True, dtype=dtype)
    helpers.assert_same_tree(out, helpers.reference_move(tree, "meta", dtype))


def test_a_kept_coalesced_tensor_holds_at_most_one_bounded_buffer() -> None:
    batch = {f"x{i}": torch.randn(16384) for i in range(100)}  # 100 x 64 KiB: 6.25 MiB of small tensors
    out = todevice.move(batch, "meta", coalesce=True)
    held = {out[k].untyped_storage().nbytes() for k in out}
    assert max(held) <= _layout.COALESCED_MAX_BYTES and sum(held) == 100 * 65536  # two buffers, nothing shared
    few = todevice.move({f"x{i}": torch.randn(4) for i in range(1000)}, "meta", coalesce=True)
    assert few["x1"].untyped_storage().nbytes() == 16000  # well under the bound: one buffer, as before


def test_one_buffer_for_all_tensor_bytes() -> None:
    tree = {
        "x": [torch.randn(4) for _ in range(10)],
        "b": torch.ones(3, dtype=torch.bool),
        "c": torch.ones(2, dtype=torch.complex64),
        "h": torch.ones(5, dtype=torch.bfloat16),
        "s": "text",
    }
    packed = todevice.pack(tree)
    storages = {v.untyped_storage().data_ptr() for v in _flat(packed.unpack())}
    assert storages == {packed.buffer.untyped_storage().data_ptr()}


def _flat(tree: Any) -> list[torch.Tensor]:
    return [node for _, node in _walk.paths(tree) if isinstance(node, torch.Tensor)]


_UNFLATTEN = torch._C._nn.unflatten_dense_tensors


def _empty_is_flat(region: torch.Tensor, templates: list[torch.Tensor]) -> list[torch.Tensor]:
    """unflatten_dense_tensors as torch 2.8 and older answer it: an empty tensor comes back as (0,), whatever its
    template."""
    pieces = list(_UNFLATTEN(region, templates))
    return [p.reshape(0) if p.numel() == 0 else p for p in pieces]


@pytest.mark.parametrize("empty_keeps_shape", [True, False], ids=["this-torch", "torch-2.8-and-older"])
def test_empty_tensors_of_any_shape_keep_it_packed_and_coalesced(
    monkeypatch: pytest.MonkeyPatch, empty_keeps_shape: bool
) -> None:
    if not empty_keeps_shape:
        monkeypatch.setattr(_layout, "_EMPTY_KEEPS_SHAPE", False)
        monkeypatch.setattr(torch._C._nn, "unflatten_dense_tensors", _empty_is_flat)
    _layout._templates.cache_clear()
    batch = {"rows": torch.ones(0, 4), "x": torch.arange(3.0), "cube": torch.zeros(2, 0, 3), "y": torch.ones(5)}
    for out in (todevice.pack(batch).unpack("cpu"), todevice.move(batch, "meta", coalesce=True)):
        assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in batch.items()}
    assert torch.equal(todevice.pack(batch).unpack("cpu")["x"], batch["x"])


def test_unpack_keeps_non_tensor_leaves_and_types() -> None:
    tree = {"n": helpers.Point(torch.ones(1), "label"), "r": helpers.FrozenRecord(torch.arange(2), 3), "k": None}
    out = todevice.pack(tree).unpack()
    assert type(out["n"]) is helpers.Point and out["n"].y == "label"
    assert type(out["r"]) is helpers.FrozenRecord and out["r"].b == 3 and out["k"] is None


def test_same_tensor_twice_comes_back_as_one_tensor() -> None:
    t = torch.ones(3)
    out = todevice.pack({"a": t, "b": [t]}).unpack()
    assert out["a"] is out["b"][0]
    assert len(todevice.pack({"a": t, "b": [t]}).layout.order) == 1


def test_tied_tensors_come_back_sharing_memory() -> None:
    base = torch.arange(4.0)
    out = todevice.pack([base, base.view(4)]).unpack()
    assert out[0] is not out[1] and out[0].data_ptr() == out[1].data_ptr()
    out[0][0] = 9.0
    assert out[1][0] == 9.0


def test_tensors_requiring_grad_come_back_as_leaves_requiring_grad() -> None:
    w = torch.ones(2, requires_grad=True)
    out = todevice.pack({"w": w}).unpack()
    assert out["w"].requires_grad and out["w"].is_leaf and torch.equal(out["w"].detach(), w.detach())


def test_tensors_that_cannot_be_packed_stay_in_the_structure() -> None:
    sparse = torch.eye(3).to_sparse()
    param = torch.nn.Parameter(torch.ones(2))
    packed = todevice.pack({"s": sparse, "p": param, "x": torch.ones(2)})
    assert packed.skeleton["s"] is sparse and packed.skeleton["p"] is param
    assert len(packed.layout.order) == 1


def test_pack_a_cyclic_structure_raises() -> None:
    cyc: list[Any] = [torch.ones(1)]
    cyc.append(cyc)
    with pytest.raises(ValueError, match="Cannot pack a cyclic structure"):
        todevice.pack(cyc)


def test_move_accepts_a_packed_batch_anywhere() -> None:
    inner = todevice.pack({"x": torch.ones(2), "y": [torch.arange(3)]})
    out = todevice.move({"batch": inner, "z": torch.zeros(1)}, "meta")
    assert out["batch"]["x"].device == META and out["batch"]["y"][0].device == META
    assert out["z"].device == META


def test_packed_batch_repr() -> None:
    assert repr(todevice.pack([torch.ones(2), torch.ones(2)])) == "PackedBatch(2 tensors, 32 bytes, 1 groups)"


# ---------------------------------------------------------------- a PackedBatch used as the batch


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


def _first_of_two(batch: Any) -> Any:
    x, _ = batch
    return x


# What the loop of a DataLoader with workers and collate() gets, used as the batch it holds.
MISUSES: dict[str, Any] = {
    "key": lambda b: b["x"],
    "index": lambda b: b[0],
    "slice": lambda b: b[1:],
    "attribute": lambda b: b.image,
    "method": lambda b: b.keys(),
    "to": lambda b: b.to("cpu"),
    "unpacking": _first_of_two,
    "for": lambda b: [item for item in b],
    "list": list,
    "in": lambda b: "x" in b,
}
_HOW_TO_UNPACK = (
    r"\.unpack\(device\), or \.unpack\(\) to keep its tensors on the host; "
    r"or iterate through todevice\.prefetch\(loader, device\), which unpacks each batch"
)


@pytest.mark.parametrize("misuse", MISUSES.values(), ids=MISUSES.keys())
def test_using_a_packed_batch_as_the_batch_says_to_unpack_it(misuse: Any) -> None:
    packed = todevice.pack({"x": torch.ones(2), "label": 3})
    with pytest.raises(
        TypeError, match=rf"^'PackedBatch' object .*: this PackedBatch holds a dict, .*{_HOW_TO_UNPACK}\.$"
    ):
        misuse(packed)


@pytest.mark.parametrize(
    ("batch", "held"),
    [
        ({"x": torch.ones(2)}, "a dict"),
        ((torch.ones(2), torch.zeros(2)), "a tuple"),
        (Sample(torch.ones(2, 2), 1), "a Sample"),
        (helpers.Point(torch.ones(2), "p"), "a Point"),
        (torch.ones(3), "a Tensor"),  # one packed tensor: the skeleton is its slot
        (torch.ones(1 << 15), "a Tensor"),  # one tensor too large to pack: the skeleton is the tensor
        ([torch.ones(1)], "a list"),
        (collections.OrderedDict(x=torch.ones(1)), "an OrderedDict"),
        (collections.UserDict(x=torch.ones(1)), "a UserDict"),
    ],
    ids=["dict", "tuple", "dataclass", "namedtuple", "tensor", "large-tensor", "list", "ordereddict", "userdict"],
)
def test_the_message_names_what_the_packed_batch_holds(batch: Any, held: str) -> None:
    packed = todevice.pack(batch)
    with pytest.raises(TypeError, match=rf"this PackedBatch holds {held}, .* Get the \w+ back with \.unpack"):
        packed[0]
    with pytest.raises(
        TypeError, match=rf"^'PackedBatch' object has no attribute 'image': this PackedBatch holds {held}"
    ):
        packed.image


@pytest.mark.parametrize("misuse", ["index", "for", "in"])
def test_indexing_iterating_and_in_are_not_attribute_errors(misuse: str) -> None:
    """`except (KeyError, AttributeError)` around `batch[k]` must not swallow the advice to unpack."""
    packed = todevice.pack({"x": torch.ones(2)})
    with pytest.raises(TypeError) as caught:
        MISUSES[misuse](packed)
    assert not isinstance(caught.value, AttributeError)


def test_the_message_names_a_registered_type_by_its_own_name() -> None:
    class Crate:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    todevice.register(Crate, lambda c: ([c.t], None), lambda aux, ch: Crate(ch[0]))
    try:
        packed = todevice.pack(Crate(torch.ones(2)))
        with pytest.raises(TypeError, match=r"holds a Crate, .* Get the Crate back with \.unpack"):
            packed.t
    finally:
        todevice.unregister(Crate)


def test_a_missing_attribute_is_still_missing_to_hasattr_and_getattr() -> None:
    packed = todevice.pack(Sample(torch.ones(2, 2), 1))
    assert not hasattr(packed, "image") and getattr(packed, "image", None) is None
    assert not hasattr(packed, "to") and getattr(packed, "to", "default") == "default"
    assert hasattr(packed, "unpack") and hasattr(packed, "pin_memory") and hasattr(packed, "buffer")
    with pytest.raises(AttributeError) as caught:
        packed.imgae
    assert caught.value.name == "imgae" and caught.value.obj is packed  # what "Did you mean" reads


@pytest.mark.parametrize("name", ["_fields", "_repr_html_", "__setstate__", "__array__"])
def test_private_and_dunder_names_raise_the_plain_attribute_error(name: str) -> None:
    """What protocols probe (pickle, IPython, namedtuple checks): Python's own error, nothing to explain."""
    packed = todevice.pack({"x": torch.ones(2)})
    with pytest.raises(AttributeError, match=rf"^'PackedBatch' object has no attribute '{name}'$") as caught:
        getattr(packed, name)
    assert not isinstance(caught.value, TypeError)
    assert not hasattr(packed, name)


def test_len_stays_undefined_so_a_packed_batch_is_true() -> None:
    packed = todevice.pack({"x": torch.ones(2)})
    assert packed
    with pytest.raises(TypeError, match="has no len"):
        len(packed)  # type: ignore[arg-type]


def test_an_unfilled_packed_batch_explains_without_recursing() -> None:
    """Unpickling makes the object before it sets its attributes: __getattr__ must not read them."""
    empty = todevice.PackedBatch.__new__(todevice.PackedBatch)
    assert not hasattr(empty, "skeleton") and not hasattr(empty, "__setstate__")
    with pytest.raises(TypeError, match=r"holds a batch, .* Get the batch back with \.unpack"):
        empty["x"]


def _copies(packed: todevice.PackedBatch) -> dict[str, Any]:
    saved = io.BytesIO()
    torch.save(packed, saved)
    saved.seek(0)
    return {
        "pickle": pickle.loads(pickle.dumps(packed)),
        "copy": copy.copy(packed),
        "deepcopy": copy.deepcopy(packed),
        "torch.save": torch.load(saved, weights_only=False),  # a PackedBatch is not among the weights-only types
    }


def test_a_packed_batch_still_copies_pickles_and_saves() -> None:
    batch = {"x": torch.randn(3), "r": helpers.Record(torch.arange(4), 7), "name": "b"}
    for how, again in _copies(todevice.pack(batch)).items():
        assert type(again) is todevice.PackedBatch, how
        helpers.assert_same_tree(again.unpack(), batch, values=True, same=False)
        with pytest.raises(TypeError, match="this PackedBatch holds a dict"):
            again["x"]


def test_structure_libraries_and_the_dataloader_see_a_packed_batch_as_a_leaf() -> None:
    from torch.utils.data._utils.pin_memory import pin_memory

    packed = todevice.pack({"x": torch.ones(2)})
    assert optree.tree_leaves({"a": packed, "b": [packed]}) == [packed, packed]
    assert torch.utils._pytree.tree_leaves({"a": packed}) == [packed]
    assert type(pin_memory({"p": packed})["p"]) is todevice.PackedBatch  # the pin thread's walk: probes, then pins
    assert todevice.move({"p": packed}, "meta")["p"]["x"].device == META


# ---------------------------------------------------------------- layouts


def test_same_shape_tensors_share_one_block() -> None:
    dtypes = (*[torch.float32] * 5, torch.int64)
    layout = _layout.layout(dtypes, (*[torch.Size([3])] * 5, torch.Size([2, 2])), None)
    blocks = [g for g in layout.groups if isinstance(g, _layout.Block)]
    assert len(blocks) == 1 and blocks[0].n == 5 and blocks[0].padded == 4  # 12 bytes padded to 16


def test_repeated_moves_reuse_the_plan() -> None:
    def batch() -> dict[str, Any]:
        return {"x": [torch.randn(4) for _ in range(8)], "y": torch.arange(5)}

    todevice.move(batch(), "meta", coalesce=True)
    built = _layout.layout.cache_info().misses
    for _ in range(3):
        todevice.move(batch(), "meta", coalesce=True)
    assert _layout.layout.cache_info().misses == built


@pytest.mark.parametrize(
    ("source", "cast", "stored", "final"),
    [
        (torch.float32, torch.float16, torch.float16, torch.float16),  # fewer bytes: cast while packing
        (torch.float16, torch.float32, torch.float16, torch.float32),  # more bytes: cast after the copy
        (torch.int64, torch.float16, torch.int64, torch.int64),  # integers are never cast
        (torch.float32, None, torch.float32, torch.float32),
    ],
)
def test_cast_happens_on_the_side_that_sends_fewer_bytes(
    source: torch.dtype, cast: torch.dtype | None, stored: torch.dtype, final: torch.dtype
) -> None:
    layout = _layout.layout((source, source), (torch.Size([4]), torch.Size([4])), cast)
    (group,) = layout.groups
    assert (group.dtype, group.final) == (stored, final)


# ---------------------------------------------------------------- the coalesced path


def coalesced(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a buffer shared with other tensors (a coalesced copy), not one of its own."""
    return t.untyped_storage().nbytes() > t.nbytes


def test_meta_is_not_coalesced_by_default_but_can_be() -> None:
    tree = [torch.randn(4) for _ in range(4)]
    assert not any(coalesced(t) for t in todevice.move(tree, "meta"))
    assert all(coalesced(t) for t in todevice.move(tree, "meta", coalesce=True))


def test_cpu_target_is_never_coalesced() -> None:
    tree = [torch.randn(4) for _ in range(4)]
    out = todevice.move(tree, "cpu", coalesce=True, dtype=torch.float64)
    assert not any(coalesced(t) for t in out)


def test_large_and_grad_leaves_are_moved_alone() -> None:
    big = torch.randn(64)
    grad = torch.ones(2, requires_grad=True)
    out = todevice.move(
        {"big": big, "grad": grad, "small": torch.ones(2)}, "meta", coalesce=True, coalesce_max_bytes=64
    )
    assert not coalesced(out["big"]) and coalesced(out["small"])
    assert out["grad"].requires_grad and out["grad"].grad_fn is not None


def test_coalesced_aliases_and_tied_weights() -> None:
    t = torch.ones(3)
    tied = t.view(3)
    out = todevice.move({"a": t, "b": [t], "c": tied}, "meta", coalesce=True)
    assert out["a"] is out["b"][0]
    assert out["c"] is not out["a"] and out["c"].shape == (3,)


def test_coalesced_errors_still_name_paths() -> None:
    class Broken:
        def to(self, device: Any) -> Any:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match=r"Cannot move \['k'\]\[1\] \(.*Broken\) to meta: boom"):
        todevice.move({"k": [torch.ones(1), Broken()]}, "meta", coalesce=True)


def test_pin_memory_pins_large_tensors_and_to_objects_with_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """What DataLoader(pin_memory=True) calls: the buffer, and everything left in the structure."""
    pinned: list[int] = []

    def pin(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        pinned.append(self.numel())
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    seq = torch.nn.utils.rnn.pack_padded_sequence(torch.ones(2, 3, 5), [3, 1], batch_first=True)
    packed = todevice.pack({"x": torch.ones(4), "seq": seq})
    out = packed.pin_memory().unpack()
    # The buffer, and the sequence by its own pin_memory(); before torch 2.11, torch's pin helper takes the sequence
    # for a namedtuple, and pins its batch_sizes too.
    assert pinned in (
        [packed.buffer.numel(), seq.data.numel()],
        [packed.buffer.numel(), seq.data.numel(), seq.batch_sizes.numel()],
    )
    assert torch.equal(out["seq"].data, seq.data)
    pinned.clear()
    image = torch.ones(1 << 15)
    packed = todevice.pack({"x": torch.ones(4), "image": image})
    assert torch.equal(packed.pin_memory().unpack()["image"], image)
    assert pinned == [packed.buffer.numel(), 1 << 15]


def test_a_failed_pinned_allocation_warns_once_and_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []

    def no_pinned_memory_left(*args: Any, **kwargs: Any) -> torch.Tensor:
        tried.append(1)
        raise torch.OutOfMemoryError("CUDA error: out of memory")

    monkeypatch.setattr(_stream.torch, "empty", no_pinned_memory_left)
    dev = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # as a user's process shows warnings: once per place
        for _ in range(3):
            assert _stream.pinned(64, torch.uint8, dev) is None
    assert len(tried) == 3  # never given up on: the next call tries again
    assert len(caught) == 1 and "page-locked" in str(caught[0].message)


def test_a_backend_without_pinned_memory_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_allocator(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("no getPinnedMemoryAllocator")

    monkeypatch.setattr(_stream.torch, "empty", no_allocator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _stream.pinned(64, torch.uint8, torch.device("cpu")) is None


def test_coalescing_to_meta_never_asks_for_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned memory is the accelerator's: asking for it initialises CUDA, on device 0 if nothing did before."""
    asked: list[Any] = []
    monkeypatch.setattr(_stream, "pinned", lambda *args: asked.append(args))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: asked.append("pin_memory"))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: asked.append("is_pinned"))
    monkeypatch.setattr(_stream, "is_accelerator", lambda device: device.type not in ("cpu", "meta"))  # as with CUDA
    tree = {
        "x": [torch.ones(3) for _ in range(5)],
        "big": torch.ones(1 << 15),
        "p": todevice.pack({"y": torch.ones(2)}),
    }
    out = todevice.move(tree, "meta", coalesce=True)
    assert out["x"][0].device == META and out["big"].device == META and out["p"]["y"].device == META
    assert asked == []


def test_pinned_memory_is_allocated_under_the_target_device(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[int] = []

    class Guard:
        def __init__(self, index: int) -> None:
            entered.append(index)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(_stream, "is_accelerator", lambda device: True)
    monkeypatch.setattr(_stream, "current_index", lambda: 0)
    monkeypatch.setattr(_stream.accel, "device_index", Guard)
    monkeypatch.setattr(_stream.torch, "empty", lambda *a, **k: torch.zeros(a[0], dtype=k["dtype"]))
    _stream.pinned(8, torch.uint8, torch.device("cuda", 1))  # no CUDA here: only the guard is checked
    assert entered == [1]
    _stream.pinned(8, torch.uint8, torch.device("cuda", 0))  # the current device already
    assert entered == [1]


# ---------------------------------------------------------------- streams, with stand-ins


class FakeStream:
    """Records what the engine asks of a stream."""

    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log
        self.device = torch.device("meta")  # meta stands in for an accelerator: see _meta_streams_issue()

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


def _meta_streams_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A move to meta issues its copies on a stream of meta, as a move to an accelerator does on one of its own: a
    move to the host otherwise ignores a host stream (``_stream.issuing``), and these tests need no accelerator."""
    monkeypatch.setattr(_stream, "issuing", lambda stream, device: stream)


def test_copies_run_on_the_side_stream_and_are_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    _meta_streams_issue(monkeypatch)
    log: list[tuple[str, ...]] = []
    user, side = FakeStream("user", log), FakeStream("side", log)
    current = [user]
    asked: list[Any] = []
    monkeypatch.setattr(_stream.accel, "current_stream", lambda device=None: (asked.append(device), current[0])[1])
    monkeypatch.setattr(_stream.accel, "set_stream", lambda s: (current.__setitem__(0, s), log.append(("set", s.name))))
    recorded: list[str] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s.name))
    seen_streams: list[str] = []
    real_to = torch.Tensor.to

    def spy_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen_streams.append(current[0].name)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    tree = {"small": [torch.ones(2) for _ in range(3)], "big": torch.ones(100)}
    out = todevice.move(tree, "meta", coalesce=True, coalesce_max_bytes=64, stream=side)  # type: ignore[arg-type]
    assert out["small"][0].device == META and out["big"].device == META
    assert log[0] == ("set", "side")
    # Host sources need nothing queued on the user's stream: the side stream never waits for it,
    # so its copies overlap the user's work.
    assert ("wait", "side", "user") not in log
    assert set(seen_streams) == {"side"}  # every copy was issued on the side stream
    assert ("set", "user") in log and log.index(("set", "user")) < log.index(("wait", "user", "side"))
    assert current[0] is user  # the user's stream is current again
    assert asked[0] is side.device  # the user's stream is the one on the side stream's device
    assert recorded == ["user"] * len(recorded) and len(recorded) == 2  # the coalesced buffer and "big"


def test_a_side_stream_waits_for_the_users_before_copying_accelerator_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source on an accelerator may still be written by the user's stream: the first such copy waits once."""
    log: list[tuple[str, ...]] = []
    user, side = FakeStream("user", log), FakeStream("side", log)
    s = _move.State(_move.plan_for(META, True, None))
    s.streams = (user, side)  # type: ignore[assignment]

    class OnAGpu:
        is_cpu = is_meta = False

    for host in (torch.ones(2), torch.ones(2, device="meta")):
        _move._order(host, s)
    assert log == []
    for _ in range(3):
        _move._order(OnAGpu(), s)  # type: ignore[arg-type]
    assert log == [("wait", "side", "user")]


class DeviceStream(FakeStream):
    def __init__(self, name: str, log: list[tuple[str, ...]], device: torch.device) -> None:
        super().__init__(name, log)
        self.device = device


def test_the_current_device_and_stream_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a stream current makes its device current too: both come back as they were."""
    log: list[tuple[str, ...]] = []
    state = {"device": 0, "stream": {0: DeviceStream("user0", log, torch.device("cuda", 0))}}
    state["stream"][1] = DeviceStream("user1", log, torch.device("cuda", 1))  # type: ignore[index]
    side = DeviceStream("side", log, torch.device("cuda", 1))

    def set_stream(s: Any) -> None:
        state["device"] = s.device.index
        state["stream"][s.device.index] = s  # type: ignore[index]

    monkeypatch.setattr(_stream, "is_accelerator", lambda device: device.type == "cuda")
    monkeypatch.setattr(_stream, "current_index", lambda: state["device"])
    monkeypatch.setattr(_stream.accel, "current_stream", lambda device: state["stream"][device.index])  # type: ignore[index]
    monkeypatch.setattr(_stream.accel, "set_stream", set_stream)
    monkeypatch.setattr(_stream.accel, "set_device_index", lambda i: state.__setitem__("device", i))
    entered = _stream.enter_stream(side, torch.device("cuda", 1))  # type: ignore[arg-type]
    assert state["device"] == 1 and state["stream"][1] is side  # type: ignore[index]
    _stream.leave_stream(entered)
    assert state["device"] == 0  # the caller's device
    assert state["stream"][1].name == "user1" and state["stream"][0].name == "user0"  # type: ignore[index]


def test_a_stream_of_another_device_is_refused() -> None:
    log: list[tuple[str, ...]] = []
    side = DeviceStream("side", log, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"Cannot copy to cuda:1 on a stream of cuda:0"):
        _stream.enter_stream(side, torch.device("cuda", 1))  # type: ignore[arg-type]
    assert log == []


# ---------------------------------------------------------------- across a real device boundary


# tests/backend's test accelerator is built on a private torch helper that torch 2.8 and older lack.
TEST_BACKEND = hasattr(torch.utils.backend_registration, "_setup_privateuseone_for_python_backend")


def _start_backend_tests() -> subprocess.Popen[str]:
    """tests/backend, in a process of its own: its PrivateUse1 test accelerator changes torch for the whole process."""
    # Plugins named, not found through entry points: pytest rewrites the asserts of every module in
    # an entry point's distribution (all of hypothesis), seconds of work where no bytecode is cached.
    env = {**os.environ, "TODEVICE_TDTEST": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_hypothesis_pytestplugin", "tests/backend"]
    return subprocess.Popen(
        [sys.executable, *command], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module", autouse=True)
def backend_tests(request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str] | None]:
    """The tests/backend run, started with this module's first test when the test that reads it is to run.

    Most of its seconds go to a new interpreter importing torch and hypothesis: started early, they
    pass on another core while the tests before it run.
    """
    reader = f"{request.node.nodeid}::test_values_across_a_real_device_boundary"
    wanted = TEST_BACKEND and any(item.nodeid == reader for item in request.session.items)
    run = _start_backend_tests() if wanted else None
    yield run
    if run is not None and run.poll() is None:  # the reading test did not run to its end
        run.kill()
        run.communicate()


@pytest.mark.skipif(
    not TEST_BACKEND,
    reason=f"tests/backend needs torch.utils.backend_registration._setup_privateuseone_for_python_backend, which "
    f"torch {torch.__version__} lacks",
)
def test_values_across_a_real_device_boundary(backend_tests: subprocess.Popen[str] | None) -> None:
    """tests/backend: a PrivateUse1 test accelerator, in a process of its own (it changes torch)."""
    assert backend_tests is not None
    stdout, stderr = backend_tests.communicate(timeout=600)
    assert backend_tests.returncode == 0, stdout + stderr
    assert " passed" in stdout and "skipped" not in stdout


# ---------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    "make",
    [
        lambda buf: [buf, buf[:4], buf[:4]],  # a longer tensor first at the address
        lambda buf: [buf, buf.view(torch.int32), buf.view(torch.int32)],  # another dtype first
    ],
    ids=["longer-first", "other-dtype-first"],
)
def test_tied_tensors_share_memory_whatever_came_first_at_the_address(make: Any) -> None:
    tree = make(torch.arange(8.0))
    out = todevice.pack(tree).unpack()
    assert out[1] is not out[2] and out[1].data_ptr() == out[2].data_ptr()
    helpers.assert_same_tree(out, helpers.reference_move(tree, "cpu"), values=True)


def test_tied_tensors_differing_only_in_the_stride_of_a_size_one_dimension() -> None:
    base = torch.arange(4.0).reshape(1, 4)
    other = base.as_strided((1, 4), (7, 1))  # same memory, same layout where it matters
    out = todevice.pack([base, other]).unpack()
    assert out[0].data_ptr() == out[1].data_ptr()


def test_error_in_a_registered_flatten_names_its_path_when_coalescing() -> None:
    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    def flatten(b: Box) -> Any:
        raise KeyError("boom")

    todevice.register(Box, flatten, lambda aux, ch: Box(ch[0]))
    try:
        with pytest.raises(KeyError, match=r"Cannot move \['a'\]\[0\] \(.*Box\) to meta: 'boom'"):
            todevice.move({"a": [Box(torch.ones(1))]}, "meta", coalesce=True)
        with pytest.raises(KeyError, match=r"Cannot pack \['a'\]\[0\] \(.*Box\): 'boom'"):
            todevice.pack({"a": [Box(torch.ones(1))]})
    finally:
        todevice.unregister(Box)


class Sized:
    """A registered container whose constructor reads its child's shape."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.n = t, t.shape[0]


def test_registered_unflatten_gets_tensors_when_unpacked() -> None:
    """A registered unflatten may look at its children: packing defers it until they are tensors."""
    todevice.register(Sized, lambda s: ([s.t], None), lambda aux, ch: Sized(ch[0]))
    try:
        tree = {"s": Sized(torch.arange(3.0)), "x": torch.ones(2)}
        out = pickle.loads(pickle.dumps(todevice.pack(tree))).unpack()
        assert type(out["s"]) is Sized and out["s"].n == 3 and torch.equal(out["s"].t, torch.arange(3.0))
        assert todevice.move(tree, "meta", coalesce=True)["s"].t.device == META
    finally:
        todevice.unregister(Sized)


def test_sparse_tensors_on_the_coalesced_path() -> None:
    out = todevice.move({"s": torch.eye(3).to_sparse(), "x": torch.ones(2)}, "meta", coalesce=True)
    assert out["s"].is_sparse and out["s"].device == META and coalesced(out["x"])


def test_move_casts_a_packed_batch_too() -> None:
    tree = {"p": todevice.pack({"x": torch.randn(3), "i": torch.arange(2)}), "y": torch.randn(2)}
    out = todevice.move(tree, "meta", dtype=torch.float16)
    assert out["p"]["x"].dtype == torch.float16 and out["y"].dtype == torch.float16
    assert out["p"]["i"].dtype == torch.int64


def test_tensors_cast_after_the_copy_are_among_the_outputs() -> None:
    """A cast on the receiving side makes new tensors: they must be recorded on the user's stream."""
    tree = [torch.ones(3, dtype=torch.float16) for _ in range(4)]
    out, mover = moved(tree, META, torch.float64)
    storages = {t.untyped_storage().nbytes() for t in mover.outputs()}
    assert all(t.dtype == torch.float64 for t in out)
    assert out[0].untyped_storage().nbytes() in storages  # the float64 copy the views share


def test_coalesced_tensors_can_be_modified_in_place_with_autograd() -> None:
    w = torch.ones(3, requires_grad=True)
    out = todevice.move({"x": [torch.randn(3), torch.randn(3)], "r": torch.randn(2, 3)}, "meta", coalesce=True)
    out["x"][0].mul_(w)  # as a tensor from .to() allows
    out["r"].mul_(w)
    assert out["x"][0].requires_grad


def test_unpacked_tensors_are_independent_for_autograd() -> None:
    """Changing one tensor of a batch in place must not fail the backward pass of another.

    Views of one buffer share its version counter, so an in-place change to ``y`` would count as a
    change to ``x`` ("modified by an inplace operation"), which a tensor from .to() never does.
    """
    for out in (
        todevice.pack({"x": torch.randn(4), "y": torch.randn(4)}).unpack(),
        todevice.move({"x": torch.randn(4), "y": torch.randn(4)}, "meta", coalesce=True),
    ):
        w = torch.ones(4, device=out["x"].device, requires_grad=True)
        loss = (out["x"] * w).sum()
        out["y"].add_(1)
        assert out["x"]._version == 0
        loss.backward()


def test_unpacked_tensors_share_the_buffer_and_are_plain_tensors() -> None:
    packed = todevice.pack([torch.randn(4), torch.randn(4), torch.arange(3)])
    out = packed.unpack()
    base = packed.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out)
    assert all(t._base is None and t.grad_fn is None and not t.requires_grad for t in out)


# ---------------------------------------------------------------- containers, and batches after other batches


@pytest.mark.parametrize("name", sorted(helpers.corpus()))
def test_corpus_round_trips_through_pack_and_the_coalesced_path(name: str) -> None:
    tree = helpers.corpus()[name]
    helpers.assert_same_tree(todevice.pack(tree).unpack(), helpers.reference_move(tree, "cpu"), values=True)
    if name != "module-inside":  # a module comes back from pickle as another, unequal, module
        again = pickle.loads(pickle.dumps(todevice.pack(tree))).unpack()
        helpers.assert_same_tree(again, helpers.reference_move(tree, "cpu"), values=True, same=False)
    with helpers.left_behind(name):
        helpers.assert_same_tree(todevice.move(tree, "meta", coalesce=True), helpers.reference_move(tree, "meta"))


def test_dataclasses_and_dict_subclasses_are_packed_by_todevice_rules() -> None:
    t = torch.randn(3)
    tree = {"r": helpers.Record(t, [t + 1]), "d": helpers.TaggedDict("tag", {"k": t + 2}), "x": t + 3}
    out = todevice.pack(tree).unpack()
    helpers.assert_same_tree(out, helpers.reference_move(tree, "cpu"), values=True)
    assert out["r"].a is not t and out["d"].tag == "tag"


@pytest.mark.parametrize(
    "tree",
    [
        {"twin": helpers.Twin(torch.ones(2))},  # optree would call Twin(x, y)
        {"n": helpers.Point(torch.ones(2), 1), "d": collections.OrderedDict(a=torch.ones(1))},
    ],
    ids=["namedtuple-with-own-new", "allowed-nodes"],
)
def test_namedtuples_with_their_own_constructor_round_trip(tree: Any) -> None:
    packed = todevice.pack(tree)
    helpers.assert_same_tree(packed.unpack(), helpers.reference_move(tree, "cpu"), values=True)


class OptreePair:
    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


def test_a_type_registered_with_optree_itself_is_moved_and_packed_through_its_flatten() -> None:
    Pair = OptreePair
    everywhere = getattr(optree.registry, "__GLOBAL_NAMESPACE")  # optree keeps the global namespace private
    optree.register_pytree_node(Pair, lambda p: ((p.b,), p.a), lambda a, ch: Pair(a, ch[0]), namespace=everywhere)
    try:
        pair = Pair(torch.ones(1), torch.zeros(1))
        packed = todevice.pack({"p": pair, "x": torch.ones(2)})
        out = packed.unpack("meta")
        assert type(out["p"]) is Pair and out["p"].b.is_meta  # its children, as optree's flatten gives them
        assert out["p"].a is pair.a  # what its flatten keeps aside is not a child: it stays as it is
        again = pickle.loads(pickle.dumps(packed)).unpack()  # rebuilt through this process's registration
        assert type(again["p"]) is Pair and again["p"].b.equal(pair.b)
    finally:
        optree.unregister_pytree_node(Pair, namespace=everywhere)


def test_same_structure_with_other_leaf_types() -> None:
    first = todevice.pack({"a": torch.ones(2), "b": "s"}).unpack()
    second_tree = {"a": "s", "b": torch.arange(3)}
    second = todevice.pack(second_tree).unpack()
    assert first["b"] == "s" and torch.equal(first["a"], torch.ones(2))
    helpers.assert_same_tree(second, second_tree, values=True, same=False)


@given(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True))
def test_dict_key_order_is_kept_whatever_the_order_before(keys: list[str]) -> None:
    for order in (keys, keys[::-1], sorted(keys), keys, keys[::-1]):
        tree = {k: torch.full((2,), float(i)) for i, k in enumerate(order)}
        out = todevice.pack(tree).unpack()
        assert list(out) == order
        helpers.assert_same_tree(out, tree, values=True, same=False)


def _guided_batch() -> dict[str, Any]:
    return {"a": {"x": [torch.ones(2), torch.zeros(2)], "y": (torch.arange(2), 1)}, "b": [{"z": torch.ones(1)}]}


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["a"]["x"].append(torch.ones(2)),  # a longer list
        lambda b: b["a"].__setitem__("y", [torch.arange(2), 1]),  # a list where a tuple was
        lambda b: b.__setitem__("a", collections.OrderedDict(b["a"])),  # an OrderedDict where a dict was
        lambda b: b["b"].__setitem__(0, {"z": None}),  # None where a tensor was
        lambda b: b["b"].__setitem__(0, {"w": torch.ones(1), "z": torch.ones(1)}),  # another key
        lambda b: b.__setitem__("a", {"y": b["a"]["y"], "x": b["a"]["x"]}),  # the same keys in another order
        lambda b: b["b"][0].__setitem__("z", [torch.ones(1)]),  # a list where a tensor leaf was
    ],
    ids=[
        "longer-list",
        "list-for-tuple",
        "ordereddict-for-dict",
        "none-for-tensor",
        "another-key",
        "key-order",
        "list-for-leaf",
    ],
)
def test_a_batch_unlike_the_last_one_is_taken_apart_exactly(change: Any) -> None:
    for _ in range(3):
        todevice.pack(_guided_batch())
    tree = _guided_batch()
    change(tree)
    out = todevice.pack(tree).unpack()
    helpers.assert_same_tree(out, helpers.reference_move(tree, "cpu"), values=True)
    assert [type(v) for v in out.values()] == [type(v) for v in tree.values()] and list(out["a"]) == list(tree["a"])


def test_a_batch_unlike_the_last_one_is_never_formatted(monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(3):
        todevice.pack(_guided_batch())
    monkeypatch.setattr(torch.Tensor, "__repr__", lambda self: pytest.fail("a tensor was formatted"))
    tree = _guided_batch()
    tree["a"]["x"].append(torch.ones(2))
    assert torch.equal(todevice.pack(tree).unpack()["a"]["x"][2], torch.ones(2))


def test_a_deque_keeps_its_maxlen_batch_after_batch() -> None:
    def batch() -> dict[str, Any]:
        return {"d": collections.deque([torch.ones(1)], maxlen=3), "x": torch.ones(2)}

    for _ in range(3):
        assert todevice.pack(batch()).unpack()["d"].maxlen == 3


# ---------------------------------------------------------------- a batch after batches of other shapes


def _warm_batch(shape: tuple[int, ...] = (4,)) -> dict[str, Any]:
    return {
        "x": [torch.randn(shape) for _ in range(6)],
        "ids": [torch.arange(3) for _ in range(4)],
        "one": torch.ones(5, dtype=torch.float64),  # a shape seen once: a ragged group
        "name": "b",
    }


def test_taking_from_devices_takes_what_is_off_the_host_and_needs_no_grad() -> None:
    """What a move to the CPU gathers on each device: small plain tensors off the host, not needing grad."""
    small = [torch.ones(2, device="meta"), torch.zeros((), device="meta", dtype=torch.int64)]
    tree = {
        "small": small,
        "host": torch.ones(2),
        "grad": torch.ones(2, device="meta", requires_grad=True),
        "big": torch.ones(1000, device="meta"),
        "name": "x",
    }
    taken = _layout.take(tree, _layout.takes(frozenset(), True), 1024, None)
    assert [id(t) for t in taken.tensors] == [id(t) for t in small]
    assert taken.skeleton["host"] is tree["host"] and taken.skeleton["big"] is tree["big"]
    assert taken.skeleton["grad"] is tree["grad"] and len(taken.loose) == 2  # host tensors are not even looked at
    assert [id(t) for t in _layout.take(tree, _layout.PACKING, 1024, None).tensors] == [id(tree["host"])]


def _warmed() -> None:
    for _ in range(3):
        todevice.pack(_warm_batch())
        todevice.move(_warm_batch(), "meta", coalesce=True)


def test_a_batch_like_the_last_one_reuses_its_layout() -> None:
    _warmed()
    assert (
        _layout.take(_warm_batch(), _layout.PACKING, None, None).layout
        is _layout.take(_warm_batch(), _layout.PACKING, None, None).layout
    )
    tree = _warm_batch()
    helpers.assert_same_tree(todevice.pack(tree).unpack(), tree, values=True, same=False)
    helpers.assert_same_tree(todevice.move(tree, "meta", coalesce=True), helpers.reference_move(tree, "meta"))


@pytest.mark.parametrize(
    "change",
    [
        lambda b: [b["x"].__setitem__(i, torch.randn(8)) for i in range(6)],  # a whole block changes shape
        lambda b: b["x"].__setitem__(2, torch.randn(5)),  # one tensor of a block does
        lambda b: b["x"].__setitem__(2, torch.randn(2, 2)),  # same numel, other shape
        lambda b: b["x"].__setitem__(0, torch.randn(4, requires_grad=True)),  # one requires grad
        lambda b: b["x"].__setitem__(5, torch.randn(4, device="meta")),  # one is not on the host
        lambda b: b.__setitem__("one", torch.ones(6, dtype=torch.float64)),  # the ragged one changes shape
        lambda b: b.__setitem__("one", torch.ones(5, dtype=torch.float64, requires_grad=True)),
        lambda b: b.__setitem__("one", torch.ones(5, dtype=torch.float64, device="meta")),
        lambda b: b["ids"].__setitem__(1, torch.arange(3.0)),  # another dtype
        lambda b: b["x"].__setitem__(3, torch.randn(8)[::2]),  # a strided view, same shape
        lambda b: [b["x"].__setitem__(i, torch.randn(40000)) for i in range(6)],  # too big to coalesce
    ],
    ids=[
        "block-shape",
        "one-shape",
        "same-numel",
        "requires-grad",
        "meta",
        "ragged-shape",
        "ragged-grad",
        "ragged-meta",
        "dtype",
        "strided",
        "too-big",
    ],
)
def test_a_batch_unlike_the_ones_before_is_packed_exactly(change: Any) -> None:
    _warmed()
    tree = _warm_batch()
    change(tree)
    packed = todevice.pack(tree)
    if not _on_meta(tree):  # unpack() brings loose tensors to the host, and meta has no data to bring
        helpers.assert_same_tree(packed.unpack(), helpers.reference_move(tree, "cpu"), values=True)
    _warmed()
    moved = todevice.move(tree, "meta", coalesce=True)
    helpers.assert_same_tree(moved, helpers.reference_move(tree, "meta"))
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree["x"] + [tree["one"]]):
        assert any(t.grad_fn is not None for t in [*moved["x"], moved["one"]])  # .to() kept autograd


def _on_meta(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for _, t in _walk.paths(tree))


def test_requires_grad_is_kept_without_grad_mode() -> None:
    _warmed()
    with torch.no_grad():
        tree = _warm_batch()
        tree["x"][1] = torch.randn(4, requires_grad=True)
        out = todevice.pack(tree).unpack()
    assert out["x"][1].requires_grad and not out["x"][0].requires_grad


@st.composite
def _batch_and_a_changed_one(draw: st.DrawFn) -> tuple[Any, Any]:
    """A batch, then one of the same structure whose tensors may differ in every way."""
    first = draw(strategies.trees)

    def vary(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and type(x) is torch.Tensor:
            return draw(st.one_of(st.just(x.clone()), strategies.tensors(), st.just(x.to("meta"))))
        if type(x) is dict:
            return {k: vary(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(vary(v) for v in x)
        return x

    return first, vary(first)


@given(_batch_and_a_changed_one())
def test_earlier_batches_never_change_a_batch(pair: tuple[Any, Any]) -> None:
    first, second = pair
    for _ in range(3):
        todevice.pack(first)
        todevice.move(first, "meta", coalesce=True)
    packed = todevice.pack(second)
    if not _on_meta(second):
        helpers.assert_same_tree(packed.unpack(), helpers.reference_move(second, "cpu"), values=True)
    helpers.assert_same_tree(todevice.move(second, "meta", coalesce=True), helpers.reference_move(second, "meta"))


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.__setitem__(3, torch.randn(4095)),
        lambda b: b.__setitem__(3, torch.randn(4096, requires_grad=True)),
        lambda b: b.__setitem__(3, torch.randn(4096, device="meta")),
        lambda b: [b.__setitem__(i, torch.randn(2, 2048)) for i in range(8)],
    ],
    ids=["one-shape", "requires-grad", "meta", "block-shape"],
)
def test_a_large_block_unlike_the_last_one(change: Any) -> None:
    def batch() -> list[torch.Tensor]:
        return [torch.randn(4096) for _ in range(8)]  # 128 KiB: above _STACK_TO_CHECK

    for _ in range(3):
        todevice.move(batch(), "meta", coalesce=True, coalesce_max_bytes=1 << 20)
    tree = batch()
    change(tree)
    out = todevice.move(tree, "meta", coalesce=True, coalesce_max_bytes=1 << 20)
    helpers.assert_same_tree(out, helpers.reference_move(tree, "meta"))


# ---------------------------------------------------------------- regressions


class _StrKey(str, enum.Enum):
    A = "a"


@pytest.mark.parametrize(
    ("first", "then"),
    [("a", _StrKey.A), (1, True), (1, 1.0), (0, False), (True, 1)],
    ids=["str-then-str-enum", "int-then-bool", "int-then-float", "int-then-false", "bool-then-int"],
)
def test_dict_keys_come_back_as_the_batch_s_own_type(first: Any, then: Any) -> None:
    """Equal keys of another type give equal treespecs; the batch must keep its own keys."""
    for _ in range(3):
        todevice.pack({first: torch.ones(2), "b": torch.zeros(2)})
        todevice.move({first: torch.ones(2), "b": torch.zeros(2)}, "meta", coalesce=True)
    tree = {then: torch.ones(2), "b": torch.zeros(2)}
    for out in (todevice.pack(tree).unpack(), todevice.move(tree, "meta", coalesce=True)):
        assert [type(k) for k in out] == [type(then), str]


def test_errors_while_unpacking_name_the_path() -> None:
    class Boxed:
        def to(self, device: Any, non_blocking: bool = False) -> Any:
            raise ValueError(f"Boxed cannot go to {device}")

    packed = todevice.pack({"x": torch.ones(2), "meta": [1, Boxed()]})
    with pytest.raises(ValueError, match=r"Cannot move \['meta'\]\[1\] \(.*Boxed\) to meta: Boxed cannot go"):
        packed.unpack("meta")


def test_a_namedtuple_registered_with_optree_itself_keeps_the_walk() -> None:
    class Sample(NamedTuple):
        x: torch.Tensor
        mask: torch.Tensor

    everywhere = getattr(optree.registry, "__GLOBAL_NAMESPACE")  # optree keeps the global namespace private
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # optree warns that it overrides its namedtuple rule
        optree.register_pytree_node(
            Sample, lambda s: ((s.x,), s.mask), lambda mask, ch: Sample(ch[0], mask), namespace=everywhere
        )
    try:
        for _ in range(3):
            out = todevice.move({"s": Sample(torch.ones(2), torch.zeros(2))}, "meta", coalesce=True)
            assert out["s"].x.device == META and out["s"].mask.device == META
    finally:
        optree.unregister_pytree_node(Sample, namespace=everywhere)


def test_a_nested_tensor_among_same_shaped_ones_stays_loose() -> None:
    for _ in range(3):
        todevice.pack([torch.randn(20000) for _ in range(4)])
    tree = [torch.randn(20000) for _ in range(4)]
    tree[1] = torch.nested.nested_tensor([torch.randn(20000)])
    out = todevice.pack(tree).unpack()
    assert out[1].is_nested and torch.equal(out[0], tree[0])


@pytest.mark.filterwarnings("ignore::todevice.errors.TensorsLeftBehindWarning")  # Box is optree's, not todevice's
def test_nothing_of_a_batch_is_kept_alive() -> None:
    class Box:
        def __init__(self, x: torch.Tensor, meta: torch.Tensor) -> None:
            self.x, self.meta = x, meta

    everywhere = getattr(optree.registry, "__GLOBAL_NAMESPACE")  # optree keeps the global namespace private
    optree.register_pytree_node(Box, lambda b: ([b.x], b.meta), lambda meta, ch: Box(ch[0], meta), namespace=everywhere)
    try:
        refs = []
        for _ in range(3):
            meta = torch.zeros(1000)
            refs.append(weakref.ref(meta))
            batch = {"box": Box(torch.ones(2), meta), "y": torch.ones(3)}
            todevice.move(batch, "meta")
            todevice.pack(batch).unpack()
            del meta, batch
        gc.collect()
        assert all(r() is None for r in refs)
    finally:
        optree.unregister_pytree_node(Box, namespace=everywhere)


def test_a_namedtuple_batch_round_trips() -> None:
    batch = helpers.Point(torch.ones(2), [torch.zeros(3), "s"])
    helpers.assert_same_tree(todevice.pack(batch).unpack(), batch, values=True, same=False)


@pytest.mark.parametrize("slot", [_tree.Slot(0), _tree.AliasSlot(0)], ids=["Slot", "AliasSlot"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_slot_outside_a_packed_skeleton_is_refused_with_its_error_alone(slot: Any, device: str) -> None:
    with pytest.raises(TypeError, match=r"a slot only means something inside a PackedBatch's skeleton") as info:
        todevice.move({"k": [torch.ones(1), slot]}, device)
    assert info.value.__suppress_context__  # no exception of the walk's own shown above it


def test_a_tied_tensor_reached_twice_comes_back_as_one_tensor() -> None:
    """A distinct tensor over another's memory, met twice, is one AliasSlot: one view at both places."""
    x = torch.arange(4.0)
    u = x.detach()
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    sd = torch.nn.Sequential(emb, head).state_dict()
    for tree in ([x, u, u], {"a": sd, "b": sd}):
        for out in (todevice.pack(tree).unpack(), pickle.loads(pickle.dumps(todevice.pack(tree))).unpack()):
            if isinstance(out, list):
                assert out[1] is out[2] and out[1] is not out[0] and out[1].data_ptr() == out[0].data_ptr()
            else:
                assert out["a"]["1.weight"] is out["b"]["1.weight"]
        coalesced = todevice.move(tree, "meta", coalesce=True)
        if isinstance(coalesced, list):
            assert coalesced[1] is coalesced[2]
        else:
            assert coalesced["a"]["1.weight"] is coalesced["b"]["1.weight"]


def test_an_error_inside_a_packed_batch_names_the_path_from_the_top() -> None:
    packed = todevice.pack({"x": torch.ones(2), "m": [torch.ones(2, device="meta")]})
    with pytest.raises(NotImplementedError, match=r"Cannot move \['batch'\]\[0\]\['m'\]\[0\] \(Tensor of shape"):
        todevice.move({"batch": [packed]}, "cpu")
    with pytest.raises(NotImplementedError, match=r"Cannot move \['m'\]\[0\] \(Tensor of shape"):
        packed.unpack()


def test_batches_sharing_a_skeleton_keep_their_own_tied_tensors() -> None:
    """A copy of a packed batch, or a pinned one, shares its skeleton: each batch's AliasSlot gets its own view."""
    x = torch.arange(4.0)
    packed = todevice.pack({"a": x, "b": x.detach()})
    other = copy.copy(packed)
    other.buffer = packed.buffer.clone()
    out = todevice.move([packed, other], "cpu", dtype=torch.float16)
    out[1]["a"].add_(100)
    assert out[1]["b"].data_ptr() == out[1]["a"].data_ptr() and torch.equal(out[1]["b"], out[1]["a"])
    assert torch.equal(out[0]["b"], x.half()) and out[0]["b"].data_ptr() == out[0]["a"].data_ptr()


class _AsTensors(collections.abc.Mapping):  # type: ignore[type-arg]
    """A mapping whose constructor normalises its values, as a config or feature store may: it reads each one."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = {k: torch.as_tensor(v) for k, v in items.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self._items.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@pytest.mark.parametrize(
    "how",
    [
        lambda m: todevice.move(m, "meta", coalesce=True),
        lambda m: todevice.pack(m).unpack(),
        lambda m: pickle.loads(pickle.dumps(todevice.pack(m))).unpack(),
        lambda m: todevice.move(todevice.pack(m), "meta"),
    ],
    ids=["coalesced", "pack", "pickled", "packed-to-meta"],
)
def test_a_mapping_is_rebuilt_from_its_tensors_never_from_the_packing_slots(how: Any) -> None:
    m = _AsTensors({f"k{i}": torch.full((2, 3), float(i)) for i in range(20)})
    got = how({"m": m, "n": [m]})
    for inner in (got["m"], got["n"][0]):
        assert type(inner) is _AsTensors and inner.shapes == m.shapes
        assert all(inner[k].shape == (2, 3) for k in m)
        if not inner["k3"].is_meta:
            assert torch.equal(inner["k3"], m["k3"])


def test_len_of_a_packed_batch_says_how_to_get_the_batch_and_it_stays_true() -> None:
    packed = todevice.pack({"x": torch.ones(2), "y": [torch.zeros(1)]})
    with pytest.raises(
        todevice.errors.PackedBatchError, match=r"has no len\(\): this PackedBatch holds a dict.*unpack"
    ):
        len(packed)
    assert packed  # truthy, as an object without len() is
    with pytest.raises(TypeError, match="not subscriptable") as info:
        packed["x"]
    assert type(info.value).__module__ == "todevice.errors"  # no private name in the traceback
    assert not hasattr(packed, "x")


class _KeywordOnly(collections.abc.Mapping):  # type: ignore[type-arg]
    """A read-only mapping whose constructor takes no dict: move() gives it back as it is when nothing in it moves."""

    def __init__(self, *, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_a_mapping_holding_no_tensor_comes_back_as_it_is_from_a_packed_batch_too() -> None:
    m = _KeywordOnly(data={"a": [1, 2], "b": ("x", None)})
    batch = {"m": m, "t": torch.ones(2)}
    assert todevice.move(batch, "meta")["m"] is m
    assert todevice.pack(batch).unpack()["m"] is m
    assert todevice.move(batch, "meta", coalesce=True)["m"] is m
