"""What users of the peers' helpers expect from move(), and the bugs adversarial testing found."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings, strategies as st

import todevice
from tests import helpers
from todevice import _tree
from todevice.errors import TensorsLeftBehindWarning
from todevice.testing import FrozenMapping

META = torch.device("meta")
CPU = torch.device("cpu")


def ones(*shape: int) -> torch.Tensor:
    return torch.ones(*shape or (2,))


# ---------------------------------------------------------------- mappings that are not dicts


ReadOnly = FrozenMapping  # a mapping built from a dict, as most custom mappings are


class Registry(collections.abc.MutableMapping):  # type: ignore[type-arg]
    """A mutable mapping whose constructor does not take a dict."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size, self._data = name, size, {}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Frozen(ReadOnly):
    """A read-only mapping whose constructor does not take a dict: nothing can rebuild it."""

    def __init__(self, name: str, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.name = name


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """Like a tokenizer's BatchEncoding: a UserDict with its own .to(), which moves it in place."""

    def to(self, device: Any, non_blocking: bool = False) -> Encoding:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        self.moved_by_to = True
        return self


def test_a_userdict_is_rebuilt_with_its_items_and_attributes_moved() -> None:
    d = collections.UserDict({"x": ones(), "n": 3})
    d.extra = ones(3)  # type: ignore[attr-defined]
    for coalesce in (False, True):
        out = todevice.move(d, "meta", coalesce=coalesce)
        assert type(out) is collections.UserDict and out is not d
        assert out["x"].device == META and out["n"] == 3 and out.extra.device == META
    assert d["x"].device == CPU and d.extra.device == CPU  # the input is untouched
    assert todevice.pack(d).unpack()["x"].equal(d["x"])
    assert todevice.devices(d) == {".data['x']": CPU, ".extra": CPU}  # its items live in its .data


def test_a_userdict_keeps_the_type_of_its_data() -> None:
    ordered = collections.UserDict()
    ordered.data = collections.OrderedDict(a=ones(), b=ones())
    ordered.data.move_to_end("a")
    out = todevice.move(ordered, "meta")
    assert type(out.data) is collections.OrderedDict and list(out) == ["b", "a"]
    counts = collections.UserDict()
    counts.data = collections.defaultdict(list, {"a": ones()})
    assert todevice.move(counts, "meta").data["missing"] == []


def test_any_mapping_is_rebuilt_through_its_constructor_from_a_dict() -> None:
    m = ReadOnly({"x": ones(), "y": [ones(3)], "s": "keep"})
    out = todevice.move(m, "meta")
    assert type(out) is ReadOnly and list(out) == ["x", "y", "s"]
    assert out["x"].device == META and out["y"][0].device == META and out["s"] is m["s"]
    assert todevice.move({"m": m}, "meta", coalesce=True)["m"]["y"][0].device == META
    assert todevice.check(m) == CPU


@pytest.mark.parametrize("mapping", [Frozen("f", {"x": ones()}), Registry("r", 4)], ids=["read-only", "mutable"])
def test_a_mapping_that_cannot_be_rebuilt_from_a_dict_names_its_path_and_the_fix(mapping: Any) -> None:
    if isinstance(mapping, Registry):
        mapping["x"] = ones()
    with pytest.raises(TypeError, match=r"Cannot move \['f'\] \(\w+\) to meta: Cannot rebuild a \w+: .*register"):
        todevice.move({"f": mapping}, "meta")
    assert mapping["x"].device == CPU  # a copy with its items set would have shared (and changed) its storage
    assert todevice.move({"f": mapping}, "meta", skip_keys="f")["f"] is mapping


def test_a_mapping_holding_nothing_to_move_comes_back_as_itself() -> None:
    assert todevice.move(os.environ, "meta") is os.environ
    for f in (Frozen("f", {"a": 1}), Frozen("f", {"a": [1, (2, "x")], "b": {"c": None}})):
        assert todevice.move({"f": f}, "meta")["f"] is f  # inner containers rebuilt around the same leaves


def test_weak_mappings_are_left_alone_and_a_chainmap_keeps_its_maps() -> None:
    t = ones()
    weak = weakref.WeakValueDictionary({"a": t})
    assert todevice.move({"w": weak}, "meta")["w"] is weak  # new tensors in it would be freed at once
    chain = collections.ChainMap({"a": ones()}, {"b": ones()})
    out = todevice.move(chain, "meta")
    assert type(out) is collections.ChainMap and len(out.maps) == 2
    assert out["a"].device == META and out["b"].device == META


def test_a_mapping_with_its_own_to_still_goes_through_it() -> None:
    enc = Encoding({"input_ids": torch.arange(3)})
    out = todevice.move(enc, "meta")
    assert out.moved_by_to and out["input_ids"].device == META
    assert not hasattr(enc, "moved_by_to") and enc["input_ids"].device == CPU


TensorsOnly = helpers.Encoding  # like transformers' BatchEncoding.to(): moves its tensor values, in place


@pytest.mark.parametrize("coalesce", [False, True, None])
def test_a_mapping_with_its_own_to_has_its_containers_moved_and_its_skipped_keys_kept(coalesce: Any) -> None:
    enc = TensorsOnly({"ids": torch.arange(3), "pixel": [ones(2), (ones(1),)], "lengths": torch.tensor([3]), "n": 3})
    out = todevice.move({"enc": enc}, "meta", skip_keys="lengths", coalesce=coalesce)["enc"]
    assert type(out) is TensorsOnly and out is not enc
    assert out["ids"].device == META and out["n"] == 3
    assert out["pixel"][0].device == META and out["pixel"][1][0].device == META  # its .to() left them
    assert out["lengths"] is enc["lengths"]  # skipped inside it too, although its .to() moved it
    assert enc["ids"].device == CPU and enc["pixel"][0].device == CPU  # the input is untouched
    todevice.testing.assert_moved(out, enc, "meta", skip_keys="lengths")


def test_a_mapping_with_its_own_to_keeps_a_tensor_it_holds_twice_one_tensor() -> None:
    t = ones(2)
    out = todevice.move(TensorsOnly({"a": [t], "b": [t], "c": t}), "meta", coalesce=False)
    assert out["a"][0] is out["b"][0] and out["a"][0].device == META


def test_a_mapping_with_its_own_to_that_holds_itself_comes_back_holding_its_copy() -> None:
    enc = TensorsOnly({"ids": torch.arange(3)})
    enc["parents"] = [enc]
    out = todevice.move(enc, "meta")
    assert out["parents"][0] is out and out["ids"].device == META
    assert enc["parents"][0] is enc and enc["ids"].device == CPU


class OnlyTensors(TensorsOnly):
    """Its __setitem__ refuses anything but a tensor, as a validating container may."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError("only tensors")
        super().__setitem__(key, value)


def test_a_mapping_with_its_own_to_that_refuses_an_item_keeps_it_as_its_to_left_it() -> None:
    enc = OnlyTensors.__new__(OnlyTensors)
    enc.data = {"ids": torch.arange(3), "words": ["a", "b"]}
    out = todevice.move({"e": enc}, "meta")["e"]
    assert out["ids"].device == META and out["words"] == ["a", "b"] and enc["ids"].device == CPU


def test_an_error_inside_a_mapping_with_its_own_to_names_its_path() -> None:
    batch = {"x": ones(), "e": TensorsOnly({"ids": ones(), "pix": [torch.empty(1, device="meta")]})}
    with pytest.raises(NotImplementedError, match=r"Cannot move \['e'\]\['pix'\]\[0\] \(Tensor"):
        todevice.move(batch, "cpu")


@pytest.mark.parametrize("coalesce", [False, None, True])
def test_a_tensor_inside_a_mapping_with_its_own_to_and_elsewhere_stays_one_tensor(coalesce: Any) -> None:
    t = ones(2)
    out = todevice.move(TensorsOnly({"c": t, "a": [t]}), "meta", coalesce=coalesce)
    assert out["c"] is out["a"][0]  # one its .to() moved, one the walk met
    out = todevice.move({"e": TensorsOnly({"a": [t]}), "x": t, "y": ones(3)}, "meta", coalesce=coalesce)
    assert out["e"]["a"][0] is out["x"]  # coalesced: a view of the batch's buffer


class InPlaceStore:
    """A hand-written batch without __copy__ whose .to() writes into the dicts and lists it holds."""

    def __init__(self, t: torch.Tensor) -> None:
        inner = {"u": t}
        self.data = {"t": t, "inner": inner, "again": inner}
        self.items = [t, [t]]

    def to(self, device: Any) -> InPlaceStore:
        self.data["t"] = self.data["t"].to(device)
        self.data["inner"]["u"] = self.data["inner"]["u"].to(device)
        self.items[0] = self.items[0].to(device)
        self.items[1][0] = self.items[1][0].to(device)
        return self


def test_a_to_that_writes_into_the_dicts_and_lists_it_holds_leaves_the_input_alone() -> None:
    store = InPlaceStore(ones(2))
    out = todevice.move([store], "meta")[0]
    assert out.data["t"].device == META and out.data["inner"]["u"].device == META
    assert out.items[0].device == META and out.items[1][0].device == META
    assert out.data["inner"] is out.data["again"]  # a dict held twice is copied once
    assert store.data["t"].device == CPU and store.data["inner"]["u"].device == CPU
    assert store.items[0].device == CPU and store.items[1][0].device == CPU


class Proxy:
    """Slots only; every other attribute read is passed to the object it wraps (its __dict__ too)."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def to(self, device: Any) -> Proxy:
        return Proxy(self._inner)


class AdoptsState:
    """Its copy adopts the input's own __dict__ (its __getstate__ hands it out)."""

    def __init__(self) -> None:
        self.data = {"t": ones(2)}

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__ = state

    def to(self, device: Any) -> AdoptsState:
        return self


def test_the_copy_for_to_never_replaces_what_the_input_holds() -> None:
    inner = InPlaceStore(ones(2))
    data = inner.data
    todevice.move(Proxy(inner), "meta")
    assert inner.data is data  # the proxy's reads reach the wrapped object: its dicts are not the copy's
    state = AdoptsState()
    data = state.data
    todevice.move(state, "meta")
    assert state.data is data


class SharesOnCopy(InPlaceStore):
    """A class whose own __copy__ shares its dict: its copy is its own word."""

    def __copy__(self) -> SharesOnCopy:
        new = SharesOnCopy.__new__(SharesOnCopy)
        new.__dict__.update(self.__dict__)
        return new


def test_a_class_with_its_own_copy_is_copied_its_way() -> None:
    store = SharesOnCopy(ones(2))
    out = todevice.move(store, "meta")
    assert out is not store and out.data is store.data  # the documented limit: its __copy__ shares
    assert store.data["t"].device == META


# ---------------------------------------------------------------- instance attributes


@dataclasses.dataclass
class WithExtras:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.doubled = self.x * 2  # not a field

    @functools.cached_property
    def plus_one(self) -> torch.Tensor:
        return self.x + 1


@dataclasses.dataclass(slots=True)
class Slotted:
    x: torch.Tensor


class SlottedMore(Slotted):
    __slots__ = ("cache",)


@pytest.mark.parametrize("how", ["move", "coalesced", "to cpu with a cast", "pack"])
def test_no_tensor_reachable_from_a_dataclass_stays_behind(how: str) -> None:
    d = WithExtras(ones())
    assert d.plus_one.device == CPU  # cached now, in the instance __dict__
    if how == "move":
        out = todevice.move(d, "meta")
    elif how == "coalesced":
        out = todevice.move(d, "meta", coalesce=True)
    elif how == "pack":
        out = todevice.pack(d).unpack("meta")
    else:
        out = todevice.move(d, "cpu", dtype=torch.float64)
    want = torch.float64 if how == "to cpu with a cast" else torch.float32
    assert {path: (t.device, t.dtype) for path, t in todevice._inspect._tensors(out)} == {
        ".x": (out.x.device, want),
        ".doubled": (out.x.device, want),
        ".plus_one": (out.x.device, want),
    }
    assert out.plus_one is out.__dict__["plus_one"]  # still the cached value, not recomputed


def test_devices_and_check_see_a_dataclass_s_other_attributes() -> None:
    d = WithExtras(ones())
    d.doubled = d.doubled.to("meta")
    assert todevice.devices(d) == {".x": CPU, ".doubled": META}
    with pytest.raises(todevice.DeviceMismatchError, match=r"meta: \.doubled"):
        todevice.check(d)


def test_slots_that_are_not_fields_are_moved_too() -> None:
    s = SlottedMore(ones())
    s.cache = ones(3)
    out = todevice.move(s, "meta")
    assert out.x.device == META and out.cache.device == META
    unset = todevice.move(SlottedMore(ones()), "meta")
    assert not hasattr(unset, "cache")


def test_dict_and_list_subclasses_move_their_instance_attributes() -> None:
    d = helpers.TaggedDict(ones(), {"x": ones()})
    lst = helpers.TaggedList(ones(), [ones()])
    out = todevice.move({"d": d, "l": lst}, "meta")
    assert out["d"].tag.device == META and out["d"]["x"].device == META
    assert out["l"].tag.device == META and out["l"][0].device == META
    assert d.tag.device == CPU and lst.tag.device == CPU


class EasyDict(dict):  # type: ignore[type-arg]
    """Keeps every item as an attribute too, as the popular attribute-access dicts do."""

    def __init__(self, d: dict[str, Any]) -> None:
        super().__init__()
        for k, v in d.items():
            v = EasyDict(v) if isinstance(v, dict) else v
            self[k] = v
            setattr(self, k, v)


class AttrDict(dict):  # type: ignore[type-arg]
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.__dict__ = self


class DotDict(dict):  # type: ignore[type-arg]
    __slots__ = ()
    __getattr__ = dict.__getitem__


class Inner:
    def __init__(self) -> None:
        self.t = ones()


@dataclasses.dataclass(slots=True)
class Delegating:
    inner: Inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclasses.dataclass(slots=True)
class Public:
    pub: torch.Tensor


class PrivateSlot(Public):
    __slots__ = ("__cache",)

    def __init__(self) -> None:
        super().__init__(ones())
        self.__cache = ones()

    def cache(self) -> torch.Tensor:
        return self.__cache


def test_an_attribute_access_dict_is_walked_once_per_item() -> None:
    nested: dict[str, Any] = {"x": ones()}
    for _ in range(40):  # walked twice per level, this would take 2**40 steps
        nested = {"c": nested, "t": ones()}
    e = EasyDict(nested)
    out = todevice.move(e, "meta")
    assert out.c is out["c"] and out.t is out["t"] and out.t.device == META
    assert len(todevice.devices(e)) == 41  # each tensor once, under its item
    a = todevice.move(AttrDict({"x": ones()}), "meta")
    assert a.__dict__ is a and a.x.device == META
    a.y = 5
    assert a["y"] == 5


def test_attributes_are_read_and_written_below_getattr() -> None:
    inner = Inner()
    with pytest.warns(TensorsLeftBehindWarning, match=r"Inner at \.inner through as it is: the tensor in its \.t "):
        out = todevice.move(Delegating(inner), "meta")
    assert inner.t.device == CPU and inner.__dict__.keys() == {"t"}  # the input is untouched
    assert out.inner is inner  # an object todevice does not know, kept as it is
    d = DotDict(x=ones())
    assert todevice.move(d, "meta")["x"].device == META
    assert todevice.devices(d) == {"['x']": CPU}


def test_private_slots_are_moved() -> None:
    p = PrivateSlot()
    out = todevice.move(p, "meta")
    assert out.cache().device == META and out.pub.device == META
    assert todevice.devices(p) == {".pub": CPU, "._PrivateSlot__cache": CPU}


# ---------------------------------------------------------------- .to() that returns None


class MovesInPlace:
    def __init__(self) -> None:
        self.t = ones()

    def to(self, device: Any, non_blocking: bool = False) -> None:
        self.t = self.t.to(device)


def test_an_object_whose_to_returns_none_comes_back_moved() -> None:
    obj = MovesInPlace()
    out = todevice.move({"o": obj}, "meta")["o"]
    assert type(out) is MovesInPlace and out is not obj
    assert out.t.device == META and obj.t.device == CPU


# ---------------------------------------------------------------- skip_keys


@pytest.mark.parametrize("target", ["meta", "cpu"])
@pytest.mark.parametrize("coalesce", [False, True])
def test_skip_keys_leaves_those_entries_exactly_as_they_are(target: str, coalesce: bool) -> None:
    lengths = torch.tensor([3, 2])
    batch = {
        "x": ones(2, 3),
        "lengths": lengths,
        "inner": [{"lengths": {"deep": lengths, "more": [ones()]}, "y": ones()}],
        "od": collections.OrderedDict(lengths=ones(), z=ones()),
        "rec": helpers.TaggedDict("t", {"lengths": ones(), "w": ones()}),
        "map": ReadOnly({"lengths": ones(), "v": ones()}),
    }
    dtype = torch.float64 if target == "cpu" else None
    out = todevice.move(batch, target, skip_keys="lengths", coalesce=coalesce, dtype=dtype)
    assert out["lengths"] is lengths and out["inner"][0]["lengths"] is batch["inner"][0]["lengths"]
    assert out["od"]["lengths"] is batch["od"]["lengths"] and out["rec"]["lengths"] is batch["rec"]["lengths"]
    assert out["map"]["lengths"] is batch["map"]["lengths"]
    moved = [out["x"], out["inner"][0]["y"], out["od"]["z"], out["rec"]["w"], out["map"]["v"]]
    if target == "meta":
        assert all(t.device == META for t in moved)
    else:
        assert all(t.dtype == torch.float64 for t in moved)


def test_skip_keys_takes_a_collection_and_is_checked() -> None:
    batch = {"a": ones(), "b": ones(), "c": ones()}
    out = todevice.move(batch, "meta", skip_keys=["a", "b"])
    assert out["a"] is batch["a"] and out["b"] is batch["b"] and out["c"].device == META
    assert todevice.move(batch, "meta", skip_keys=())["a"].device == META
    assert todevice.move({1: ones(), 2: ones()}, "meta", skip_keys=[1])[2].device == META  # any dict key
    with pytest.raises(TypeError, match=r"Cannot skip keys \[\[1\]\]: skip_keys takes a dict key or a collection"):
        todevice.move(batch, "meta", skip_keys=[[1]])
    with pytest.raises(TypeError, match=r"keys must be hashable"):
        todevice.move(batch, "meta", skip_keys=[{"a": 1}])


def test_skip_keys_hides_entries_from_strict() -> None:
    batch = {"x": ones(), "meta": {"handle": object()}}
    with pytest.raises(TypeError, match=r"\['meta'\]\['handle'\]: object"):
        todevice.move(batch, "meta", strict=True)
    assert todevice.move(batch, "meta", strict=True, skip_keys="meta")["meta"] is batch["meta"]


def test_skip_keys_in_a_structure_deeper_than_the_recursion_limit() -> None:
    deep: Any = {"lengths": ones(), "x": ones()}
    for _ in range(3000):
        deep = {"next": deep}
    out = todevice.move(deep, "meta", skip_keys="lengths")
    for _ in range(3000):
        out, deep = out["next"], deep["next"]
    assert out["lengths"] is deep["lengths"] and out["x"].device == META


def test_skip_keys_with_a_packed_batch_keeps_those_tensors_as_the_batch_holds_them() -> None:
    batch = {"x": ones(3), "w": ones(2).requires_grad_(), "lengths": torch.tensor([3, 1])}
    packed = todevice.pack(batch)
    for out in (
        todevice.move(packed, "meta", skip_keys="lengths", coalesce=True),
        todevice.move({"p": packed}, "meta", skip_keys=["lengths"])["p"],
    ):
        assert out["x"].device == META
        assert out["lengths"].device == CPU and out["lengths"].tolist() == [3, 1]
        assert out["w"].device == META and out["w"].is_leaf and out["w"].requires_grad


def test_skip_keys_names_the_right_path_and_ignores_cycles_it_skips() -> None:
    t = torch.ones(1, device="meta")
    with pytest.raises(NotImplementedError, match=r"Cannot move \['x'\] "):
        todevice.move({"lengths": t, "x": t}, "cpu", skip_keys="lengths")
    cycle: dict[str, Any] = {}
    cycle["self"] = cycle
    deep: Any = ones()
    for _ in range(3000):
        deep = [deep]
    out = todevice.move({"lengths": cycle, "deep": deep}, "meta", skip_keys="lengths")
    assert out["lengths"] is cycle


def test_prefetch_skips_keys_too() -> None:
    batches = [{"x": ones(), "lengths": torch.tensor([i])} for i in range(3)]
    got = list(todevice.prefetch(batches, "meta", skip_keys="lengths"))
    assert [b["lengths"] for b in got] == [b["lengths"] for b in batches]
    assert all(b["x"].device == META for b in got)
    with pytest.raises(TypeError, match=r"skip_keys takes a dict key or a collection"):
        todevice.prefetch(batches, "meta", skip_keys=[["lengths"]])


# ---------------------------------------------------------------- a consistent registry


class Box:
    def __init__(self, v: Any) -> None:
        self.v = v


def test_a_coalesced_move_uses_the_registration_it_started_with() -> None:
    """The type is unregistered between packing and unpacking, as another thread may do."""

    def flatten(b: Box) -> tuple[list[Any], None]:
        todevice.unregister(Box)  # right while the move is packing the batch
        return [b.v], None

    todevice.register(Box, flatten, lambda aux, ch: Box(ch[0]))
    try:
        out = todevice.move({"box": Box(ones())}, "meta", coalesce=True)
    finally:
        if Box in _tree._registry:
            todevice.unregister(Box)
    assert type(out["box"]) is Box and out["box"].v.device == META


@pytest.mark.filterwarnings("ignore::todevice.errors.TensorsLeftBehindWarning")  # Box between registrations
def test_coalesced_moves_while_another_thread_unregisters() -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        while not stop.is_set():
            todevice.register(Box, lambda b: ([b.v], None), lambda aux, ch: Box(ch[0]))
            todevice.unregister(Box)
            # A loop of pure Python holds the GIL for whole switch intervals (5 ms), and a move that waits for
            # the registry's lock then waits one interval per wait: 300 moves took 40 s. Registrations still
            # land between and within the moves.
            time.sleep(0)

    thread = threading.Thread(target=churn)
    thread.start()
    deadline = time.monotonic() + 5
    try:
        for i in range(2000):
            if i >= 300 and time.monotonic() > deadline:
                break
            try:
                out = todevice.move({"box": Box(ones()), "x": ones()}, "meta", coalesce=True)
                assert out["x"].device == META
            except BaseException as err:  # surfaced below
                errors.append(err)
    finally:
        stop.set()
        thread.join()
        if Box in _tree._registry:
            todevice.unregister(Box)
    assert errors == []


# ---------------------------------------------------------------- structseqs


def test_a_structseq_holding_no_tensor_comes_back_as_itself() -> None:
    st = time.localtime()
    stat = os.stat(".")
    out = todevice.move({"time": st, "stat": stat}, "meta")
    assert out["time"] is st and out["stat"] is stat


def test_a_structseq_holding_tensors_keeps_every_field() -> None:
    st = time.struct_time((ones(), *range(8)), {"tm_zone": ones(3), "tm_gmtoff": 7})
    for out in (todevice.move(st, "meta"), todevice.move([st], "meta", coalesce=True)[0]):
        assert type(out) is time.struct_time
        assert out.tm_year.device == META and out.tm_zone.device == META and out.tm_gmtoff == 7
        assert tuple(out)[1:] == tuple(range(8))
    assert todevice.devices(st) == {".tm_year": CPU, ".tm_zone": CPU}
    values, indices = todevice.move(torch.max(torch.ones(2, 2), 0), "meta")
    assert values.device == META and indices.device == META
    assert list(todevice.devices(torch.max(torch.ones(2, 2), 0))) == [".values", ".indices"]


# ---------------------------------------------------------------- diagnostics and cycles


class Loop:
    """An object with .to() that refers back to itself, or to its parent."""

    def __init__(self, parent: Any = None) -> None:
        self.t = ones()
        self.back = self if parent is None else parent

    def to(self, *args: Any, **kwargs: Any) -> Loop:
        return self


def test_devices_and_check_refuse_a_to_object_that_refers_back_with_its_path() -> None:
    with pytest.raises(ValueError, match=r"the Loop at \['a'\] contains itself at \['a'\]\.back"):
        todevice.devices({"a": Loop()})
    parent: dict[str, Any] = {}
    parent["child"] = Loop(parent)
    with pytest.raises(ValueError, match=r"Cannot inspect a cyclic structure: the Loop at \['child'\]"):
        todevice.check(parent)
    shared = Loop([])
    assert todevice.devices([shared, shared]) == {"[0].t": CPU, "[1].t": CPU}  # shared, not a cycle


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("value", "error"), [(None, TypeError), (1.5, TypeError), (True, TypeError), ("64k", TypeError), (-1, ValueError)]
)
def test_coalesce_max_bytes_is_checked(value: Any, error: type[Exception]) -> None:
    t = ones().requires_grad_()
    with pytest.raises(error, match=r"Cannot coalesce with coalesce_max_bytes=.*expected a number of bytes"):
        todevice.move({"t": t}, "meta", coalesce=True, coalesce_max_bytes=value)
    with pytest.raises(error, match=r"coalesce_max_bytes"):
        todevice.move({"t": t}, "cpu", coalesce_max_bytes=value)  # checked where it has no effect too
    assert todevice.move({"t": t}, "meta", coalesce=True, coalesce_max_bytes=65536)["t"].requires_grad
    numpy = pytest.importorskip("numpy")
    assert todevice.move({"t": t}, "meta", coalesce=True, coalesce_max_bytes=numpy.int64(8))["t"].requires_grad


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), ("x", TypeError), (False, TypeError)])
def test_pack_max_bytes_is_checked(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Cannot pack with max_bytes="):
        todevice.pack({"t": ones()}, max_bytes=value)


# ---------------------------------------------------------------- constructors never called


class NeedsArgs(dict):  # type: ignore[type-arg]
    def __new__(cls, required: int) -> NeedsArgs:
        return super().__new__(cls)

    def __init__(self, required: int) -> None:
        super().__init__()
        self.required = required


class OrderedNeedsArgs(collections.OrderedDict):  # type: ignore[type-arg]
    def __new__(cls, required: int) -> OrderedNeedsArgs:
        return super().__new__(cls)

    def __init__(self, required: int) -> None:
        super().__init__()


class ListNeedsArgs(list):  # type: ignore[type-arg]
    def __new__(cls, required: int) -> ListNeedsArgs:
        return super().__new__(cls)

    def __init__(self, required: int) -> None:
        super().__init__()


@pytest.mark.parametrize("how", ["move", "coalesced", "pack"])
def test_subclasses_whose_new_wants_arguments_are_moved(how: str) -> None:
    d, od, lst = NeedsArgs(1), OrderedNeedsArgs(2), ListNeedsArgs(3)
    d["x"], od["x"] = ones(), ones()
    lst.append(ones())
    batch = {"d": d, "od": od, "l": lst}
    if how == "pack":
        out = todevice.pack(batch).unpack("meta")
    else:
        out = todevice.move(batch, "meta", coalesce=how == "coalesced")
    assert type(out["d"]) is NeedsArgs and out["d"].required == 1 and out["d"]["x"].device == META
    assert type(out["od"]) is OrderedNeedsArgs and out["od"]["x"].device == META
    assert type(out["l"]) is ListNeedsArgs and out["l"][0].device == META


# ---------------------------------------------------------------- guard


def test_guard_reads_a_generator_of_ignored_inputs_once() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(2, device="meta"))  # so the guard hooks this module

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    net = Net()
    with pytest.raises(todevice.DeviceMismatchError, match=r"kwargs\['lengths'\] is on cpu"), todevice.guard(net):
        net(torch.ones(2, 2, device="meta"), lengths=torch.tensor([1, 2]))
    with todevice.guard(net, ignore=(name for name in ["lengths"])):
        net(torch.ones(2, 2, device="meta"), lengths=torch.tensor([1, 2]))  # the keyword form is ignored
    with todevice.guard(net, ignore="lengths"):
        net(torch.ones(2, 2, device="meta"), lengths=torch.tensor([1, 2]))


# ---------------------------------------------------------------- at the edges: wrong results and crashes


class Items(list):  # type: ignore[type-arg]
    """A list subclass, as a DataLoader collate may return one."""


@pytest.mark.parametrize("how", ["walk", "coalesced", "strict", "packed", "deep", "prefetch"])
def test_a_list_subclass_keeps_its_items_when_keys_are_skipped(how: str) -> None:
    batch = Items([ones(), {"k": ones(3), "x": ones(1)}])
    batch.tag = ones(4)  # type: ignore[attr-defined]
    if how == "prefetch":
        (out,) = list(todevice.prefetch([batch], "meta", skip_keys="k"))
    elif how == "deep":
        deep: Any = batch
        for _ in range(3000):
            deep = [deep]
        out = todevice.move(deep, "meta", skip_keys="k")
        for _ in range(3000):
            out = out[0]
    else:
        obj: Any = todevice.pack(batch) if how == "packed" else batch
        out = todevice.move(obj, "meta", skip_keys="k", coalesce=how == "coalesced", strict=how == "strict")
    assert type(out) is Items and len(out) == 2 and out[0].device == META and out.tag.device == META
    assert out[1]["k"].device == CPU and out[1]["x"].device == META


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_packed_batch_s_mapping_with_to_shares_a_tensor_with_the_outer_batch(coalesce: bool) -> None:
    shared = torch.tensor([5.0, 6.0, 7.0, 8.0])
    enc = helpers.Encoding({"ids": torch.arange(2), "lst": [shared]})
    batch = {"outer": shared, "packed": todevice.pack({"p0": torch.full((2,), 9.0), "enc": enc})}
    for device in ("meta", "cpu"):
        out = todevice.move(batch, device, coalesce=coalesce)
        assert out["packed"]["enc"]["lst"][0] is out["outer"] and out["outer"].shape == (4,)
    assert todevice.move(batch, "cpu", coalesce=coalesce)["packed"]["enc"]["lst"][0] is shared


def test_skip_keys_reach_inside_mappings_registered_with_torch_pytree_and_optree() -> None:
    class Keyed(ReadOnly):
        pass

    everywhere = getattr(optree.registry, "__GLOBAL_NAMESPACE")  # optree keeps the global namespace private
    optree.register_pytree_node(
        Keyed, lambda m: (list(m.values()), list(m)), lambda k, v: Keyed(dict(zip(k, v))), namespace=everywhere
    )
    try:
        lengths = torch.tensor([2])
        for mapping in (helpers.Output(x=ones(), lengths=lengths), Keyed({"x": ones(), "lengths": lengths})):
            for how in ("walk", "coalesced", "packed"):
                obj: Any = todevice.pack({"m": mapping}) if how == "packed" else {"m": mapping}
                out = todevice.move(obj, "meta", skip_keys="lengths", coalesce=how == "coalesced")["m"]
                assert type(out) is type(mapping) and out["x"].device == META and out["lengths"].device == CPU
                if how != "packed":
                    assert out["lengths"] is lengths
            with pytest.raises(TypeError, match=r"\['m'\]\['bad'\]: object"):
                todevice.move({"m": type(mapping)(dict(mapping, bad=object()))}, "meta", strict=True)
    finally:
        optree.unregister_pytree_node(Keyed, namespace=everywhere)


@pytest.mark.parametrize("coalesce", [None, True, False])
def test_a_tensor_in_a_mapping_with_to_and_elsewhere_in_the_batch_is_moved_once(coalesce: bool | None) -> None:
    t = ones(3)
    first, last = (
        {"labels": t, "enc": helpers.Encoding({"input_ids": t})},
        {"enc": helpers.Encoding({"ids": t}), "y": t},
    )
    for batch in (first, last):
        for device in ("meta", "cpu"):
            out = todevice.move(batch, device, coalesce=coalesce)
            inside, outside = [v for v in out.values() if isinstance(v, torch.Tensor)], list(out["enc"].values())
            assert inside[0] is outside[0] and inside[0].device.type == device
    many = {"x": [ones() for _ in range(20)], "enc": helpers.Encoding({"ids": t}), "y": t}  # coalesced by default
    out = todevice.move(many, "meta", coalesce=coalesce)
    assert out["enc"]["ids"] is out["y"]


def test_an_object_whose_copy_adopts_the_input_s_dict_is_not_changed() -> None:
    class Adopts:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__ = state  # what copy.copy hands over is the input's own dict

        def to(self, device: Any, non_blocking: bool = False) -> Adopts:
            self.t = self.t.to(device)
            return self

    obj = Adopts(ones())
    out = todevice.move({"o": obj}, "meta")["o"]
    assert out.t.device == META and obj.t.device == CPU


def test_an_object_whose_getattr_recurses_while_copied_is_moved_by_its_own_to() -> None:
    class Forwards:
        def __init__(self, inner: torch.Tensor) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:  # a copy without _inner asks for it again, without end
            return getattr(self._inner, name)

        def to(self, device: Any, non_blocking: bool = False) -> Forwards:
            return Forwards(self._inner.to(device))

    obj = Forwards(ones())
    out = todevice.move({"x": [obj]}, "meta")["x"][0]
    assert type(out) is Forwards and out._inner.device == META and obj._inner.device == CPU


def test_no_left_behind_warning_for_a_tensor_already_on_the_target() -> None:
    class Holds:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        todevice.move({"h": Holds(torch.ones(1, device="meta")), "x": ones()}, "meta")
        todevice.move({"h": Holds(ones()), "x": ones()}, "cpu")
    with pytest.warns(TensorsLeftBehindWarning, match=r"Holds at \['h'\] through as it is: the tensor in its \.t"):
        todevice.move({"h": Holds(ones()), "x": ones()}, "meta")
    with pytest.warns(TensorsLeftBehindWarning):  # a cast would have copied it
        todevice.move({"h": Holds(torch.ones(1, device="meta")), "x": ones()}, "meta", dtype=torch.float16)


def test_a_tensor_a_mapping_s_own_to_leaves_or_casts_otherwise_stands_only_for_itself() -> None:
    class KeepsLengths(collections.UserDict):  # type: ignore[type-arg]
        def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> KeepsLengths:
            self.data = {k: v if k == "lengths" else v.to(device, dtype) for k, v in self.data.items()}
            return self

    lengths, ids = torch.tensor([3, 2]), torch.tensor([1, 2])
    for batch in (
        {"enc": KeepsLengths(lengths=lengths), "lengths": lengths},
        {"lengths": lengths, "enc": KeepsLengths(lengths=lengths)},
    ):
        out = todevice.move(batch, "meta")
        assert out["lengths"].device == META and out["enc"]["lengths"] is lengths  # its .to()'s choice, and the move's
    out = todevice.move({"m": KeepsLengths(x=ones(), ids=ids), "ids": ids}, "meta", dtype=torch.float16)
    assert out["ids"].dtype == torch.int64 and out["m"]["ids"].dtype == torch.float16  # integers keep their dtype


def test_a_registered_mapping_s_entries_say_which_child_is_under_which_key() -> None:
    class Sorted(ReadOnly):
        pass

    todevice.register(
        Sorted, lambda m: ([m[k] for k in sorted(m)], sorted(m), sorted(m)), lambda ks, ch: Sorted(dict(zip(ks, ch)))
    )
    try:
        t = ones()
        out = todevice.move(Sorted({"b": t, "a": t}), "meta", skip_keys="a")  # one object under two keys
        assert out["a"] is t and out["b"].device == META
    finally:
        todevice.unregister(Sorted)


def test_an_object_whose_copy_is_itself_is_moved_by_its_own_to_unchanged() -> None:
    class Single:
        made: Single | None = None

        def __new__(cls) -> Single:  # one instance: copy.copy hands it back, its dict set again
            if cls.made is None:
                cls.made = super().__new__(cls)
                cls.made.t, cls.made.names = ones(), ["a"]
            return cls.made

        def to(self, device: Any, non_blocking: bool = False) -> Single:
            moved = object.__new__(Single)
            moved.t, moved.names = self.t.to(device), self.names
            return moved

    obj = Single()
    state, names = obj.__dict__, obj.names
    out = todevice.move([obj], "meta")[0]
    assert out.t.device == META and obj.__dict__ is state and obj.names is names and obj.t.device == CPU


def test_an_object_whose_copy_shares_a_dict_it_cannot_replace_is_refused_unchanged() -> None:
    store: dict[str, Any] = {}

    class Shares:
        """Every instance reads and writes one dict: its copy cannot be given one of its own."""

        @property  # type: ignore[misc]
        def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
            return store

        def to(self, device: Any, non_blocking: bool = False) -> Shares:
            store["t"] = store["t"].to(device)
            return self

    obj = Shares()
    store["t"] = ones()
    with pytest.raises(TypeError, match=r"Cannot move \['o'\] \(.*Shares\) to meta: a copy of it shares its __dict__"):
        todevice.move({"o": obj}, "meta")
    assert store["t"].device == CPU


# ---------------------------------------------------------------- a registered mapping holding one tensor twice


class SortedByContext(dict):  # type: ignore[type-arg]
    """Registered with torch pytree as a dict-like type is: its children in sorted key order, the keys its context."""


class SortedWithKeys(dict):  # type: ignore[type-arg]
    """Registered with torch pytree with flatten_with_keys_fn, which names each child's key; its context names none."""


class SortedEntries(dict):  # type: ignore[type-arg]
    """Registered with optree: its children in sorted key order, named by the entries optree's convention allows."""


def _sorted_flatten(d: Any) -> tuple[list[Any], Any]:
    keys = sorted(d)
    return [d[k] for k in keys], keys


torch.utils._pytree.register_pytree_node(
    SortedByContext, _sorted_flatten, lambda ch, keys: SortedByContext(zip(keys, ch))
)
torch.utils._pytree.register_pytree_node(
    SortedWithKeys,
    lambda d: ([d[k] for k in sorted(d)], ("sorted", tuple(sorted(d)))),
    lambda ch, ctx: SortedWithKeys(zip(ctx[1], ch)),
    flatten_with_keys_fn=lambda d: (
        [(torch.utils._pytree.MappingKey(k), d[k]) for k in sorted(d)],
        ("sorted", tuple(sorted(d))),
    ),
)
optree.register_pytree_node(
    SortedEntries,
    lambda d: ([d[k] for k in sorted(d)], ("sorted", tuple(sorted(d))), sorted(d)),
    lambda ctx, ch: SortedEntries(zip(ctx[1], ch)),
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)
KEYED = [SortedByContext, SortedWithKeys, SortedEntries]


def _zeros_like(m: Any) -> Any:
    """Host targets for ``m``: a zero tensor of its own under each key, in ``m``'s order."""
    return type(m)((k, torch.zeros_like(v)) for k, v in m.items())


def _moved_skipping(batch: dict[str, Any], skip: Any, how: str) -> Any:
    """``batch`` moved to meta with ``skip_keys=skip``, the way ``how`` names; out= into zeroed host targets."""
    if how == "out=":
        static = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else _zeros_like(v) for k, v in batch.items()}
        return todevice.move(batch, out=static, skip_keys=skip)
    if how == "compiled":
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's own
            return torch.compile(lambda b: todevice.move(b, "meta", skip_keys=skip), backend="eager")(batch)
    obj = todevice.pack(batch) if how == "packed" else batch
    return todevice.move(obj, "meta", skip_keys=skip, coalesce=how == "coalesced")


def _check_skipped(got: Any, source: Any, skip: frozenset[str], how: str) -> None:
    """Each item under a key in ``skip`` as ``source`` holds it, every other moved (for out=, written)."""
    assert type(got) is type(source) and set(got) == set(source), how  # in the order its unflatten gives
    for k, v in source.items():
        if how == "out=":
            assert torch.equal(got[k], torch.zeros_like(v) if k in skip else v), (how, k)
        elif k in skip:
            assert got[k].device == CPU and (how == "packed" or got[k] is v), (how, k)  # packed: a view of the buffer
        else:
            assert got[k].device == META, (how, k)
    moved = [k for k in source if k not in skip]
    for a in moved:  # one tensor under two moved keys stays one (a fresh copy each, for out=)
        for b in moved:
            if source[a] is source[b] and how != "out=":
                assert got[a] is got[b], (how, a, b)


@pytest.mark.parametrize("how", ["walk", "coalesced", "packed", "compiled", "out="])
@pytest.mark.parametrize("cls", KEYED, ids=lambda c: c.__name__)
def test_skip_keys_skips_the_item_under_its_key_where_a_registered_mapping_lists_one_tensor_twice(
    cls: type, how: str
) -> None:
    """The flatten lists the children in sorted order and the one tensor sits under "b", then "a": skipping "a"
    keeps the item under "a" and moves the one under "b", as the registration names them (torch's
    flatten_with_keys_fn, optree's entries, or a context that lists the keys)."""
    t = torch.arange(3.0)
    m: Any = cls()
    m["b"], m["a"], m["c"] = t, t, torch.ones(2)
    got = _moved_skipping({"m": m}, "a", how)["m"]
    _check_skipped(got, m, frozenset("a"), how)


def test_without_keys_from_its_registration_a_mapping_s_children_are_its_items_in_its_order() -> None:
    """What the docs state for a registration that names no keys: children are matched to items by identity in the
    mapping's order; a flatten in that order (the usual one) gets every item right."""

    class InOrder(dict):  # type: ignore[type-arg]
        pass

    torch.utils._pytree.register_pytree_node(
        InOrder, lambda d: (list(d.values()), None), lambda ch, ctx: InOrder(zip("ba", ch))
    )
    t = torch.ones(2)
    m = InOrder(b=t, a=t)
    for how in ("walk", "coalesced"):
        got = _moved_skipping({"m": m}, "a", how)["m"]
        assert got["a"] is t and got["b"].device == META


@given(
    st.lists(st.sampled_from("abcde"), min_size=1, max_size=5, unique=True),
    st.lists(st.integers(0, 2), min_size=5, max_size=5),
    st.sets(st.sampled_from("abcde")),
    st.sampled_from(KEYED),
    st.sampled_from(["walk", "coalesced", "packed", "out="]),
)
@settings(max_examples=80)
def test_registered_mappings_holding_a_tensor_under_two_keys_skip_exactly_the_keys_named(
    order: list[str], picks: list[int], skip: set[str], cls: type, how: str
) -> None:
    pool = [torch.arange(3.0), torch.ones(2), torch.zeros(4, dtype=torch.int64)]
    m: Any = cls()
    for k, i in zip(order, picks):
        m[k] = pool[i]
    got = _moved_skipping({"m": m, "x": torch.ones(1)}, frozenset(skip), how)["m"]
    _check_skipped(got, m, frozenset(skip), how)


@dataclasses.dataclass
class Fields(collections.abc.Mapping):  # type: ignore[type-arg]
    """A dataclass that is also a mapping of its fields, registered with torch pytree's register_dataclass: its
    flatten_with_keys_fn names each child by GetAttrKey, and its context is not the one flatten_fn gives."""

    logits: Any
    lengths: Any = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __iter__(self) -> Any:
        return iter(("logits", "lengths"))

    def __len__(self) -> int:
        return 2


if hasattr(torch.utils._pytree, "register_dataclass"):
    torch.utils._pytree.register_dataclass(Fields)


@pytest.mark.skipif(
    not hasattr(torch.utils._pytree, "register_dataclass"), reason="torch pytree has no register_dataclass"
)
@pytest.mark.parametrize("how", ["walk", "coalesced", "packed", "compiled", "out="])
def test_a_mapping_registered_by_register_dataclass_moves_and_skips_its_keys(how: str) -> None:
    """Its keys come from no MappingKey: each child is matched to the item that is that very object, so skip_keys
    names it; and it is rebuilt with the context flatten_fn gives, which unflatten_fn takes."""
    lengths = torch.tensor([2])
    m = Fields(ones(2), lengths)
    if how == "out=":  # into host targets of its own
        static = {"m": Fields(torch.zeros(2), torch.zeros(1, dtype=torch.int64))}
        got = todevice.move({"m": m}, out=static, skip_keys="lengths")["m"]
    else:
        got = _moved_skipping({"m": m}, "lengths", how)["m"]
    assert type(got) is Fields
    if how == "out=":
        assert torch.equal(got.logits, ones(2)) and not got.lengths.any()
    else:
        assert got.logits.device == META and got.lengths.device == CPU
        assert how == "packed" or got.lengths is lengths
    assert todevice.move({"m": m}, "meta")["m"].lengths.device == META  # without skip_keys, moved
