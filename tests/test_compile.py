"""move(), pack() and unpack() inside torch.compile: traced into one graph where dynamo can, equal to eager."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import todevice
from tests import helpers
from todevice import _inspect, _move, _pack, _traced, _walk

SRC = Path(todevice.__file__).parent

# CPU inductor compiles C++: its test skips where there is no compiler (the other backends need none).
_inductor = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="no C++ compiler for CPU inductor"
)


def no_warning_from_todevice(caught: list[warnings.WarningMessage]) -> None:
    """Dynamo warns where it breaks the graph on a C function it does not know (a dict subclass's
    ``dict.keys``): todevice's own check of whether a compiled function runs is never one of those."""
    ours = [str(w.message) for w in caught if "get_eval_frame_callback" in str(w.message)]
    assert not ours
    assert not [w for w in caught if w.filename.startswith(str(SRC))]


class Item(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: Any
    n: int = 3


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    y: Any


def structures() -> dict[str, Any]:
    """Each holds two tensors or more, and tensors of several dtypes, so a cast is seen to skip integers."""
    x, y, i = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.float16), torch.arange(3)
    return {
        "dict": {"x": x, "y": y, "ids": i, "name": "b0"},
        "list": [x, y, i, 7],
        "tuple": (x, (y, i), None),
        "namedtuple": Item(x, "a"),
        "namedtuples": [Item(x, "a"), Item(i, "b"), Item(y, "c")],
        "dataclass": Batch(x, [y, i]),
        "frozen-dataclass": Frozen(x, {"i": i, "y": y}),
        "ordereddict": collections.OrderedDict([("b", x), ("a", i)]),
        "defaultdict": collections.defaultdict(list, {"k": [x, y], "i": i}),
        "deque": collections.deque([x, i]),  # no maxlen: dynamo (2.13) takes a deque in without it
        "structseq": {"max": torch.max(x, 1), "i": i},
        "nested": {"a": [x, {"b": (y, Item(i, "z"))}], "c": Batch(x, (i, 1.5)), "d": torch.float32},
    }


TARGETS = {"meta": ("meta", None), "cpu-float64": ("cpu", torch.float64)}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from nothing: no graph cached by another test decides what this one sees."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn: Callable[..., Any], backend: str = "eager", fullgraph: bool = False) -> Callable[..., Any]:
    return torch.compile(fn, backend=backend, fullgraph=fullgraph)


def fullgraph_where_traced(fn: Callable[..., Any], obj: Any, backend: str = "eager") -> Any:
    """``fn(obj)`` compiled with fullgraph=True where dynamo traces the shallow copy of a ``.to()`` object
    and the list of a dataclass's attributes (torch 2.12 and later). Before, fullgraph raises, naming
    what cannot be traced, and the default compile gives the eager result."""
    if _traced.LISTS_ATTRIBUTES:
        return compiled(fn, backend, fullgraph=True)(obj)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"dynamo before torch 2\.12 cannot trace"):
        compiled(fn, backend, fullgraph=True)(obj)
    torch._dynamo.reset()
    return compiled(fn, backend)(obj)


def check(actual: Any, expected: Any) -> None:
    """Same containers, tensors alike (values too, where they have any), atoms equal.

    Equal, not the same objects: dynamo may hand back the constant it traced with, which equals the
    one passed (its guards check that) but need not be it.
    """
    with_values = not any(isinstance(v, torch.Tensor) and v.is_meta for _, v in _walk.paths(expected))
    helpers.assert_same_tree(actual, expected, values=with_values, same=False)


# ---------------------------------------------------------------- one graph


@helpers.traces
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", structures())
def test_fullgraph_move_matches_eager(name: str, target: str) -> None:
    device, dtype = TARGETS[target]
    obj = structures()[name]
    out = compiled(lambda b: todevice.move(b, device, dtype=dtype), fullgraph=True)(obj)
    check(out, todevice.move(obj, device, dtype=dtype))


@helpers.traces
def test_fullgraph_move_is_one_graph_of_per_leaf_copies() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    obj = structures()["nested"]
    torch.compile(lambda b: todevice.move(b, "meta"), backend=backend, fullgraph=True)(obj)
    assert len(graphs) == 1
    copies = [n for n in graphs[0].graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(copies) == 3  # x and i, each met twice and copied once, and y


class _MovesItself(collections.UserDict):  # a tokenizer's BatchEncoding: a mapping whose .to() works in place
    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> _MovesItself:
        self.data = {k: v.to(device, dtype, non_blocking=non_blocking) for k, v in self.data.items()}
        return self


def _twice(x: torch.Tensor) -> dict[str, Any]:
    return {"a": x, "b": [x], "c": torch.ones(2)}


NEW_EACH_STEP: dict[str, Callable[[int], Any]] = {
    "a tensor met twice": lambda k: _twice(torch.full((3,), float(k))),
    "nested": lambda k: structures()["nested"],
    "packed sequence": lambda k: {"s": pack_padded_sequence(torch.full((2, 1), float(k)), [2])},
    "mapping with .to()": lambda k: {"e": _MovesItself({"x": torch.full((2,), float(k))})},
    "packed batch": lambda k: {"p": todevice.pack({"x": torch.full((2,), float(k)), "y": torch.arange(3) + k})},
}


@pytest.mark.parametrize("name", NEW_EACH_STEP)
def test_a_compiled_step_is_not_compiled_again_for_each_new_batch(name: str) -> None:
    """The traced walk never takes the id() of what it is given: dynamo would guard on that very object, and compile
    the step again for every new batch until it gave up on it (8 times, then the step runs uncompiled)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    step = torch.compile(lambda b: todevice.move(b, "cpu", dtype=torch.float64), backend=backend)
    step(NEW_EACH_STEP[name](0))
    first = len(graphs)
    for k in range(1, 5):
        got, expected = step(NEW_EACH_STEP[name](k)), todevice.move(NEW_EACH_STEP[name](k), "cpu", dtype=torch.float64)
        pairs = list(zip(_inspect._tensors(got), _inspect._tensors(expected), strict=True))  # .to() objects' too
        assert pairs and all(p == q and t.dtype == u.dtype and torch.equal(t, u) for (p, t), (q, u) in pairs)
    assert len(graphs) == first


@helpers.traces
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_wrapper_made_with_functools_wraps_keeps_its_body_under_compile(fullgraph: bool) -> None:
    @functools.wraps(todevice.move)  # copies move's __dict__: nothing there may stand in for the wrapper
    def move_with_extra(batch: dict[str, Any], device: Any, **kwargs: Any) -> Any:
        batch = {**batch, "extra": "added by the wrapper"}
        return todevice.move(batch, device, dtype=torch.float16, **kwargs)

    compiled = torch.compile(lambda b: move_with_extra(b, "meta"), backend="eager", fullgraph=fullgraph)
    got = compiled({"x": torch.ones(2)})
    assert sorted(got) == ["extra", "x"] == sorted(move_with_extra({"x": torch.ones(2)}, "meta"))
    assert got["x"].dtype == torch.float16 and got["x"].is_meta
    assert move_with_extra.__name__ == "move" and move_with_extra.__doc__ == todevice.move.__doc__


@helpers.traces
def test_a_bare_tensor_is_traced_as_one_copy_in_a_graph() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    out = torch.compile(lambda t: todevice.move(t, "meta", dtype=torch.float16) * 2, backend=backend, fullgraph=True)(
        torch.ones(3)
    )
    assert out.is_meta and out.dtype == torch.float16 and len(graphs) == 1


@helpers.traces
def test_aot_backend_and_inside_a_model() -> None:
    model = torch.nn.Linear(3, 2, dtype=torch.float64)

    def step(batch: dict[str, Any]) -> torch.Tensor:
        moved = todevice.move(batch, "cpu", dtype=torch.float64)
        out: torch.Tensor = model(moved["x"]).sum() + moved["ids"].sum()
        return out

    batch = {"x": torch.ones(4, 3), "ids": torch.arange(4)}
    assert torch.equal(compiled(step, "aot_eager", fullgraph=True)(batch), step(batch))


class Pair:
    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


class Carrier:
    """An object with its own .to(), which moves its contents in place and returns itself."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any, non_blocking: bool = False) -> Carrier:
        self.t = self.t.to(device, non_blocking=non_blocking)
        return self


@helpers.traces
def test_fullgraph_move_of_registered_types_to_objects_and_modules() -> None:
    todevice.register(Pair, lambda p: ((p.a, p.b), None), lambda aux, ch: Pair(*ch))
    try:
        lengths = torch.tensor([3, 2])
        seq = torch.nn.utils.rnn.pack_padded_sequence(torch.ones(3, 2, 4), lengths)
        model, carried = torch.nn.Linear(2, 2), Carrier(torch.ones(2))
        batch = {"pair": Pair(torch.ones(2), [torch.arange(2)]), "c": carried, "m": model, "seq": seq}
        out = fullgraph_where_traced(lambda b: todevice.move(b, "meta"), batch)
    finally:
        todevice.unregister(Pair)
    assert type(out["pair"]) is Pair and out["pair"].a.is_meta and out["pair"].b[0].is_meta
    assert out["c"].t.is_meta and carried.t.device.type == "cpu"  # moved on a copy: the input is not mutated
    assert out["m"] is model and model.weight.device.type == "cpu"
    assert type(out["seq"]) is type(seq) and out["seq"].data.is_meta


@helpers.traces
def test_fullgraph_mapping_with_its_own_to_has_its_containers_moved_and_skipped_keys_kept() -> None:
    from tests.test_dropin import InPlaceStore, TensorsOnly

    enc = TensorsOnly({"ids": torch.arange(3), "pixel": [torch.ones(2)], "lengths": torch.tensor([3])})
    store = InPlaceStore(torch.ones(2))
    batch = {"enc": enc, "store": store}
    out = fullgraph_where_traced(lambda b: todevice.move(b, "meta", skip_keys="lengths"), batch)
    assert out["enc"]["ids"].is_meta and out["enc"]["pixel"][0].is_meta
    assert not out["enc"]["lengths"].is_meta and out["store"].data["inner"]["u"].is_meta
    assert enc["pixel"][0].device.type == "cpu" and store.data["inner"]["u"].device.type == "cpu"
    assert store.items[1][0].device.type == "cpu"


class ReturnsNone:
    """A .to() that moves its contents in place and returns nothing."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any, non_blocking: bool = False) -> None:
        self.t = self.t.to(device)


class Uncopyable(ReturnsNone):
    def __copy__(self) -> Uncopyable:
        raise TypeError("cannot be copied")

    def to(self, device: Any, non_blocking: bool = False) -> Uncopyable:  # type: ignore[override]
        return Uncopyable(self.t.to(device))


class NoNonBlocking(ReturnsNone):
    def to(self, device: Any) -> NoNonBlocking:  # type: ignore[override]
        return NoNonBlocking(self.t.to(device))


@helpers.traces
@pytest.mark.parametrize("cls", [ReturnsNone, Uncopyable, NoNonBlocking])
def test_fullgraph_move_of_to_objects_as_the_eager_move_calls_them(cls: type[ReturnsNone]) -> None:
    obj = cls(torch.ones(2))
    out = fullgraph_where_traced(lambda b: todevice.move(b, "meta"), {"o": obj})
    assert type(out["o"]) is cls and out["o"].t.is_meta
    assert obj.t.device.type == "cpu" or cls is Uncopyable  # moved on a copy where it can be copied


class KeywordsSeen:
    """A .to() that records the keywords it is given, in order."""

    seen: ClassVar[list[list[str]]] = []

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any, **kwargs: Any) -> KeywordsSeen:
        KeywordsSeen.seen.append(list(kwargs))
        return KeywordsSeen(self.t.to(device, **kwargs))


@helpers.traces
def test_a_to_object_gets_its_keywords_in_the_eager_move_s_order() -> None:
    KeywordsSeen.seen.clear()
    todevice.move([KeywordsSeen(torch.ones(2))], "meta", dtype=torch.float16)
    compiled(lambda b: todevice.move(b, "meta", dtype=torch.float16))([KeywordsSeen(torch.ones(2))])
    assert KeywordsSeen.seen == [["non_blocking", "dtype"], ["non_blocking", "dtype"]]


class Casts:
    """A .to() that takes a dtype and casts every tensor it holds with it, integer ones too."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> Casts:
        return Casts(**{k: v.to(device, dtype, non_blocking=non_blocking) for k, v in self.tensors.items()})


class TakesNoDtype(ReturnsNone):
    def to(self, device: Any, non_blocking: bool = False) -> TakesNoDtype:  # type: ignore[override]
        return TakesNoDtype(self.t.to(device, non_blocking=non_blocking))


@helpers.traces
@pytest.mark.parametrize("fullgraph", [False, True])
def test_dtype_reaches_a_to_object_as_in_the_eager_move(fullgraph: bool) -> None:
    """dtype= reaches a .to() only where the object holds floating-point tensors: its integer ones keep their dtype."""
    move = lambda b: todevice.move(b, "meta", dtype=torch.float16)  # noqa: E731
    batch = [Casts(i=torch.arange(2)), Casts(i=torch.arange(2), f=torch.ones(2))]
    eager = move(batch)
    if fullgraph and not _traced.LISTS_ATTRIBUTES:  # before torch 2.12 fullgraph refuses the shallow copy
        return
    out = compiled(move, fullgraph=fullgraph)(batch)
    for got in (eager, out):
        assert got[0].tensors["i"].dtype == torch.int64
        assert got[1].tensors["i"].dtype == got[1].tensors["f"].dtype == torch.float16


class DictWithTo(dict):  # type: ignore[type-arg]
    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> DictWithTo:
        return DictWithTo({k: v.to(device, dtype, non_blocking=non_blocking) for k, v in self.items()})


class ListWithTo(list):  # type: ignore[type-arg]
    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> ListWithTo:
        return ListWithTo([v.to(device, dtype, non_blocking=non_blocking) for v in self])


class FrozensetWithTo(frozenset):  # type: ignore[type-arg]
    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> FrozensetWithTo:
        return FrozensetWithTo([v.to(device, dtype, non_blocking=non_blocking) for v in self])


class TupleWithTo(tuple):  # type: ignore[type-arg]
    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> TupleWithTo:
        return TupleWithTo([v.to(device, dtype, non_blocking=non_blocking) for v in self])


class SlotsWithTo:
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any, dtype: Any = None, non_blocking: bool = False) -> SlotsWithTo:
        return SlotsWithTo(self.t.to(device, dtype, non_blocking=non_blocking))


@helpers.traces
@pytest.mark.parametrize(
    "made",
    [
        lambda: DictWithTo(a=torch.ones(2)),
        lambda: ListWithTo([torch.ones(2)]),
        lambda: FrozensetWithTo([torch.ones(2)]),
        lambda: TupleWithTo([torch.ones(2)]),
    ],
    ids=["dict", "list", "frozenset", "tuple"],
)
def test_a_container_subclass_with_its_own_to_keeps_its_items_compiled(made: Callable[[], Any]) -> None:
    """Dynamo's copy of a built-in container's subclass loses its items, or fails for a tuple's (torch 2.13): the copy
    is made outside the graph."""
    move = lambda b: todevice.move(b, "meta")  # noqa: E731
    out = compiled(move)(made())
    assert type(out) is type(made()) and len(out) == 1
    assert next(iter(out.values() if isinstance(out, dict) else out)).is_meta
    torch._dynamo.reset()
    # Before torch 2.12 the graph breaks earlier, at the shallow copy every such object gets.
    why = r"container subclass with its own \.to\(\)" if _traced.LISTS_ATTRIBUTES else r"dynamo before torch 2\.12"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=why):
        compiled(move, fullgraph=True)(made())


@helpers.traces
def test_an_object_with_slots_and_its_own_to_is_moved_compiled() -> None:
    out = compiled(lambda b: todevice.move(b, "meta"))([SlotsWithTo(torch.ones(2))])  # raised on torch 2.11
    assert type(out[0]) is SlotsWithTo and out[0].t.is_meta


class RefusesNonBlocking(ReturnsNone):
    """A .to() whose signature takes any keyword, and refuses non_blocking when called."""

    def to(self, device: Any, **kwargs: Any) -> RefusesNonBlocking:  # type: ignore[override]
        if "non_blocking" in kwargs:
            raise TypeError("to() got an unexpected keyword argument 'non_blocking'")
        return RefusesNonBlocking(self.t.to(device, **kwargs))


@helpers.traces
def test_a_to_that_refuses_non_blocking_is_called_again_without_it_compiled_too() -> None:
    out = fullgraph_where_traced(lambda b: todevice.move(b, "meta"), [RefusesNonBlocking(torch.ones(2))])
    assert out[0].t.is_meta and todevice.move([RefusesNonBlocking(torch.ones(2))], "meta")[0].t.is_meta


@helpers.traces
def test_a_to_object_that_takes_no_dtype_but_holds_floats_is_refused_compiled_too() -> None:
    message = ": its .to() takes no dtype, and it holds floating-point tensors"
    move = lambda b: todevice.move(b, "meta", dtype=torch.float16)  # noqa: E731
    for step, where in ((move, "['o'] (TakesNoDtype)"), (compiled(move), "a TakesNoDtype")):  # compiled: no path
        with pytest.raises(TypeError, match=f"^{re.escape(f'Cannot move {where} to meta{message}')}"):
            step({"o": TakesNoDtype(torch.ones(2))})
    assert move({"o": TakesNoDtype(torch.arange(2))})["o"].t.dtype == torch.int64  # nothing to cast: moved


class Plain:
    pass


@helpers.traces
def test_fullgraph_move_keeps_other_leaves_as_they_are() -> None:
    import datetime
    import pathlib

    leaves: dict[str, Any] = {
        "path": pathlib.Path("/data"),
        "date": datetime.date(2020, 1, 2),
        "plain": Plain(),
        "function": len,
        "class": Plain,
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        leaves.update(scalar=numpy.float32(1.5), array=numpy.ones(2))
    out = compiled(lambda b: todevice.move(b, "meta"), fullgraph=True)({"x": torch.ones(1), **leaves})
    assert out["x"].is_meta
    for k, v in leaves.items():
        assert out[k] is v, k


@dataclasses.dataclass
class PostInit:
    x: torch.Tensor
    late: torch.Tensor = dataclasses.field(init=False)  # set by __post_init__, not by __init__

    def __post_init__(self) -> None:
        self.late = self.x * 2
        self.extra = self.x + 1  # an attribute beyond the fields, which the eager move moves too


@helpers.traces
def test_a_dataclass_with_post_init_gives_every_attribute_it_set() -> None:
    obj = {"p": PostInit(torch.ones(2))}
    out = fullgraph_where_traced(lambda b: todevice.move(b, "meta"), obj)
    check(out, todevice.move(obj, "meta"))
    assert out["p"].extra.is_meta and out["p"].late.is_meta


@dataclasses.dataclass
class Sparse:
    x: torch.Tensor
    never: int = dataclasses.field(init=False)  # never set: absent from the instance, as from its copy


@helpers.traces
def test_the_rules_for_dynamo_before_2_12_on_any_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the traced walk does where dynamo cannot list an instance's attributes, checked on this torch."""
    monkeypatch.setattr(_traced, "LISTS_ATTRIBUTES", False)
    batch = {k: structures()[k] for k in ("dataclass", "frozen-dataclass", "nested")}
    out = compiled(lambda b: todevice.move(b, "meta"), fullgraph=True)(batch)  # rebuilt from their fields
    check(out, todevice.move(batch, "meta"))
    torch._dynamo.reset()
    sparse = Sparse(torch.ones(2))
    out = compiled(lambda b: todevice.move(b, "meta"), fullgraph=True)({"s": sparse})
    assert type(out["s"]) is Sparse and out["s"].x.is_meta and not hasattr(out["s"], "never")
    post, carried = PostInit(torch.ones(2)), Carrier(torch.ones(2))
    for obj in (post, carried):
        torch._dynamo.reset()
        name = type(obj).__qualname__
        with pytest.raises(torch._dynamo.exc.Unsupported, match=f"each {name} it moves, which dynamo before torch"):
            compiled(lambda b: todevice.move(b, "meta"), fullgraph=True)({"o": obj})
    torch._dynamo.reset()
    out = compiled(lambda b: todevice.move(b, "meta"))({"p": post, "c": carried})  # the eager result
    assert out["p"].extra.is_meta and out["p"].late.is_meta and out["c"].t.is_meta
    assert post.extra.device.type == "cpu" and carried.t.device.type == "cpu"


class Tagged(int):
    """A registered subclass of an atomic type: a container, by its registration."""

    t: torch.Tensor


@helpers.traces
def test_fullgraph_move_of_a_registered_subclass_of_int() -> None:
    def make(n: int, t: torch.Tensor) -> Tagged:
        out = Tagged(n)
        out.t = t
        return out

    # c.real, not int(c): dynamo before 2.12 cannot trace int() of an int subclass, and this flatten is traced.
    todevice.register(Tagged, lambda c: ([c.t], c.real), lambda aux, ch: make(aux, ch[0]))
    # Nor can it make one (int.__new__), as this unflatten does: there the graph breaks, and the move is eager's.
    fullgraph = torch.__version__ >= "2.12"
    try:
        out = compiled(lambda b: todevice.move(b, "meta"), fullgraph=fullgraph)({"c": make(3, torch.ones(2))})
    finally:
        todevice.unregister(Tagged)
    assert type(out["c"]) is Tagged and out["c"] == 3 and out["c"].t.is_meta


@helpers.traces
def test_a_tensor_in_place_comes_back_as_it_is_and_a_repeat_once() -> None:
    x, y = torch.ones(2), torch.zeros(2, dtype=torch.float64)
    out = compiled(lambda b: todevice.move(b, "cpu", dtype=torch.float64), fullgraph=True)({"x": x, "y": y, "z": [y]})
    assert out["y"] is y and out["z"][0] is y
    assert out["x"].dtype == torch.float64
    same = compiled(lambda b: todevice.move(b, "meta"), fullgraph=True)({"a": x, "b": x})
    assert same["a"] is same["b"]


@helpers.traces
def test_skip_keys_leaves_the_entries_as_they_are() -> None:
    lengths, inner = torch.tensor([3, 1]), torch.ones(2)
    batch = {"x": torch.ones(2, 3), "lengths": lengths, "sub": [{"lengths": inner, "y": torch.zeros(1)}]}
    out = compiled(lambda b: todevice.move(b, "meta", skip_keys="lengths"), fullgraph=True)(batch)
    assert out["lengths"] is lengths and out["sub"][0]["lengths"] is inner
    assert out["x"].is_meta and out["sub"][0]["y"].is_meta


@helpers.traces
def test_strict_traces_a_clean_batch_and_still_refuses_an_unknown_object() -> None:
    batch = {"x": torch.ones(2), "n": 1}
    out = compiled(lambda b: todevice.move(b, "meta", strict=True), fullgraph=True)(batch)
    assert out["x"].is_meta
    with pytest.raises(TypeError, match="strict=True"):
        compiled(lambda b: todevice.move(b, "meta", strict=True))({"x": torch.ones(2), "o": object()})


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"coalesce": "yes"}, TypeError, "coalesce takes None"),
        ({"coalesce_max_bytes": -1}, ValueError, "expected a number of bytes"),
        ({"stream": "side"}, TypeError, "stream takes a torch.Stream"),
    ],
    ids=["coalesce", "coalesce_max_bytes", "stream"],
)
def test_options_the_compiler_ignores_are_still_checked(options: dict[str, Any], error: type, match: str) -> None:
    """A compiled move() ignores how copies are coalesced and on which stream, but refuses what eager move() refuses."""
    for fn in (todevice.move, compiled(todevice.move)):
        with pytest.raises(error, match=match):
            fn({"x": torch.ones(2)}, "meta", **options)


@helpers.traces
def test_coalescing_options_give_per_leaf_copies_under_compile() -> None:
    obj = structures()["nested"]
    out = compiled(lambda b: todevice.move(b, "meta", coalesce=True, coalesce_max_bytes=1 << 20), fullgraph=True)(obj)
    check(out, todevice.move(obj, "meta"))


def test_the_traced_function_takes_what_move_takes_but_out() -> None:
    def shape(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]

    assert shape(_traced.compiled) == [(n, k) for n, k in shape(todevice.move) if n != "out"]  # out=: eagerly
    assert "_torchdynamo_inline" not in vars(todevice.move)  # functools.wraps would copy it onto a wrapper


# ---------------------------------------------------------------- graph breaks, and the default compile


@pytest.mark.parametrize("name", ["set", "frozenset", "dict-subclass", "slots-dataclass", "dict-of-objects"])
def test_default_compile_of_what_breaks_the_graph_matches_eager(name: str) -> None:
    """Untraced types break the graph; the move then runs as plain Python, per leaf, and still gives eager's
    result. To the host with a cast: the eager move's pinned results there fail where dynamo compiles its frames."""
    obj = helpers.corpus()[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(lambda b: todevice.move(b, "cpu", dtype=torch.float64))(obj)
    check(out, todevice.move(obj, "cpu", dtype=torch.float64))
    no_warning_from_todevice(caught)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_default_compile_of_a_coalesced_move(backend: str) -> None:
    obj = {**structures()["nested"], "sub": helpers.corpus()["dict-subclass"]}  # which breaks the graph
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(lambda b: todevice.move(b, "meta", coalesce=True), backend)(obj)
    check(out, todevice.move(obj, "meta", coalesce=True))
    no_warning_from_todevice(caught)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_default_compile_of_pack_then_unpack(backend: str) -> None:
    obj = structures()["nested"]

    def roundtrip(b: Any) -> tuple[Any, Any]:
        return todevice.pack(b).unpack(), todevice.move(todevice.pack(b), "cpu", dtype=torch.float64)

    back, moved = compiled(roundtrip, backend)(obj)
    check(back, obj)
    check(moved, todevice.move(obj, "cpu", dtype=torch.float64))


def test_pack_then_unpack_under_compile_gives_copies() -> None:
    x, g = torch.zeros(2), torch.ones(2, requires_grad=True)
    # Not fullgraph: dynamo (2.13) breaks the graph to return a tensor made a leaf there.
    back = compiled(lambda b: todevice.pack(b).unpack())({"x": x, "g": g, "again": x})
    assert back["x"] is not x and back["again"] is back["x"]
    back["x"].add_(1)
    assert x.tolist() == [0.0, 0.0]  # the input is not touched, as with the eager unpack
    assert back["g"] is not g and back["g"].requires_grad and back["g"].is_leaf


def test_a_batch_packed_outside_unpacks_inside() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    obj = {"a": x, "b": x + 1, "c": torch.arange(5), "d": Item(torch.ones(3, dtype=torch.float16), "z"), "e": x}
    packed = todevice.pack(obj)
    back = compiled(lambda p: p.unpack(), "aot_eager")(packed)
    check(back, packed.unpack())
    moved = compiled(lambda p: todevice.move(p, "meta", dtype=torch.float64), "aot_eager")(packed)
    check(moved, todevice.move(packed, "meta", dtype=torch.float64))
    assert moved["a"] is moved["e"]


@helpers.traces
def test_skip_keys_in_a_batch_packed_outside() -> None:
    batch = {"x": torch.ones(2, 3), "lengths": torch.tensor([3, 1]), "sub": [{"lengths": torch.ones(2)}]}
    packed = todevice.pack(batch)
    out = compiled(lambda p: todevice.move(p, "meta", skip_keys="lengths"), "aot_eager", fullgraph=True)(packed)
    check(out, todevice.move(packed, "meta", skip_keys="lengths"))
    assert torch.equal(out["lengths"], batch["lengths"]) and out["x"].is_meta  # filled, where the buffer is


@_inductor
def test_inductor_compiles_a_coalesced_move_and_pack_then_unpack() -> None:
    obj = {"x": torch.arange(6.0).reshape(2, 3), "ids": torch.arange(3), "y": [torch.ones(2, dtype=torch.float16)]}

    def step(b: Any) -> tuple[Any, Any]:
        moved = todevice.move(b, "cpu", dtype=torch.float64, coalesce=True)
        return moved, todevice.pack(moved).unpack()

    moved, back = torch.compile(step)(obj)
    expected = todevice.move(obj, "cpu", dtype=torch.float64)
    check(moved, expected)
    check(back, expected)


FRESH = {
    # Nothing cached (no plan, no classified type) when a compiled coalesced move is a process's first call.
    "compiled-coalesced-move-first": """
        import torch, todevice
        batch = {"x": torch.ones(2, 3), "ids": torch.arange(4), "z": [torch.zeros(2)]}
        out = torch.compile(lambda b: todevice.move(b, "meta", coalesce=True), backend="aot_eager")(batch)
        assert out["x"].is_meta and out["ids"].dtype == torch.int64 and out["z"][0].shape == (2,)
    """,
    # The eager paths never reach for dynamo, whose import alone takes about a second.
    "eager-never-imports-dynamo": """
        import sys, torch, todevice
        todevice.move({"a": torch.ones(2)}, "meta", coalesce=True)
        todevice.move([torch.ones(2)], "cpu")
        todevice.move(torch.ones(2), "cpu")
        todevice.pack({"a": torch.ones(2)}).unpack()
        assert "torch._dynamo" not in sys.modules, "an eager call imported dynamo"
    """,
}


@pytest.mark.parametrize("script", FRESH)
def test_in_a_fresh_process(script: str) -> None:
    code = textwrap.dedent(FRESH[script]) + "print('ok')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


# ---------------------------------------------------------------- the traced walk, run as plain Python


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", helpers.corpus())
def test_the_traced_walk_gives_what_the_eager_move_gives(name: str, target: str) -> None:
    """Run as plain Python (which is what a graph break runs), on every edge case of the corpus."""
    device, dtype = TARGETS[target]
    obj = helpers.corpus()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the corpus's complex tensor, cast to float64, warns alike
        out = _traced.compiled(obj, device, dtype=dtype)
        expected = todevice.move(obj, device, dtype=dtype, coalesce=False)
    helpers.assert_same_tree(out, expected, values=device != "meta")


def test_dtype_reaches_a_packed_sequence_under_compile_as_in_eager_code() -> None:
    from torch.nn.utils.rnn import pack_sequence

    batch = {"f": pack_sequence([torch.ones(3), torch.ones(2)]), "i": pack_sequence([torch.arange(3), torch.arange(2)])}
    got = compiled(lambda b: todevice.move(b, "cpu", dtype=torch.float16), "eager")(batch)
    want = todevice.move(batch, "cpu", dtype=torch.float16)
    assert got["f"].data.dtype == want["f"].data.dtype == torch.float16
    assert got["i"].data.dtype == want["i"].data.dtype == torch.int64


# ---------------------------------------------------------------- at the edges, as eager


class Items(list):  # type: ignore[type-arg]
    pass


def test_the_edges_give_the_eager_result() -> None:
    """A list subclass and a pytree-registered mapping with keys to skip, and a tensor held by a mapping with its own
    .to() and by the rest of the batch: as eager move() gives them."""
    t = torch.ones(3)
    items = Items([torch.ones(1), {"lengths": torch.ones(2)}])
    batch = {
        "items": items,
        "out": helpers.Output(x=torch.ones(2), lengths=torch.tensor([2])),
        "labels": t,
        "enc": helpers.Encoding({"input_ids": t}),
    }
    out = compiled(lambda b: todevice.move(b, "meta", skip_keys="lengths"))(batch)
    check(out, todevice.move(batch, "meta", skip_keys="lengths"))
    assert len(out["items"]) == 2 and out["items"][1]["lengths"] is items[1]["lengths"]
    assert out["out"]["lengths"].device == torch.device("cpu") and out["out"]["x"].device == torch.device("meta")
    assert out["labels"] is out["enc"]["input_ids"]


# ---------------------------------------------------------------- before torch 2.11: outside the graph


def test_before_torch_2_11_move_pack_and_unpack_run_outside_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch 2.4 to 2.10 get, on any torch: the eager result behind a graph break, and under fullgraph=True an
    error that names the release which traces move()."""
    monkeypatch.setattr(_traced, "TRACES", False)
    monkeypatch.setattr(_move, "_untraced", _traced.untraced(todevice.move, "todevice.move()"))
    monkeypatch.setattr(_pack, "_untraced_pack", _traced.untraced(todevice.pack, "todevice.pack()"))
    monkeypatch.setattr(_pack, "_untraced_unpack", _traced.untraced(todevice.PackedBatch.unpack, "unpack()"))
    batch = {"x": torch.ones(2, 3), "s": frozenset({torch.ones(1)}), "k": [torch.arange(3), "id"]}
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer dynamo steps into the wrapper and warns where it turns dynamo off
        out = torch.compile(lambda b: todevice.move(b, "meta", dtype=torch.float16), backend=backend)(batch)
        packed = torch.compile(lambda b: todevice.pack(b), backend="eager")(batch)
        unpacked = torch.compile(lambda p: p.unpack("meta"), backend="eager")(packed)
        with pytest.raises(Exception, match=re.escape("todevice.move(), which torch.compile traces from torch 2.11")):
            torch.compile(lambda b: todevice.move(b, "meta"), backend="eager", fullgraph=True)(batch)
    check(out, todevice.move(batch, "meta", dtype=torch.float16))
    assert not any(n.op == "call_method" and n.target == "to" for g in graphs for n in g.graph.nodes)
    assert packed.layout is not _traced.NOTHING_PACKED and packed.buffer.numel() > 0  # packed as eager code packs
    check(unpacked, todevice.move(batch, "meta"))


# ---------------------------------------------------------------- found by review of the one walk


@pytest.mark.skipif(not _traced.TRACES, reason="dynamo traces move() from torch 2.11")
def test_a_batch_packed_outside_unpacks_inside_as_tensors_that_take_in_place_changes_with_autograd() -> None:
    """Tensors of one shape share a block of the buffer: cut under dynamo into plain slices, not unbind()'s views,
    which refuse an in-place change mixed with autograd, as the eager unpack's tensors take it."""
    packed = todevice.pack([torch.randn(4) for _ in range(3)])
    out = compiled(lambda p: todevice.move(p, "cpu"), fullgraph=True)(packed)
    weight = torch.randn(4, requires_grad=True)
    out[0].mul_(weight)
    out[0].sum().backward()
    assert weight.grad is not None


class _Stored:
    """A descriptor that keeps its value under another name in the instance's __dict__."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, obj: Any, tp: Any = None) -> Any:
        return self if obj is None else getattr(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.name, value)


@dataclasses.dataclass
class _WithDescriptor:
    x: Any = _Stored()


@pytest.mark.skipif(not _traced.TRACES, reason="dynamo traces move() from torch 2.11")
def test_a_dataclass_with_a_descriptor_field_traces_in_one_graph_or_breaks_it_before_2_12() -> None:
    batch = _WithDescriptor(torch.ones(2))
    if not _traced.LISTS_ATTRIBUTES:  # its value is under another name than its field's, which dynamo cannot list
        with pytest.raises(Exception, match="cannot trace: the graph breaks here"):
            compiled(lambda b: todevice.move(b, "meta"), fullgraph=True)(batch)
    out = compiled(lambda b: todevice.move(b, "meta"), fullgraph=_traced.LISTS_ATTRIBUTES)(batch)
    helpers.assert_same_tree(out, todevice.move(batch, "meta"))
    assert out.x.device.type == "meta" and batch.x.device.type == "cpu"
