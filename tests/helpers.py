"""Test support: container types, a plain reference move(), tree comparison and an edge-case corpus."""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

import todevice
from todevice import _layout, _traced
from todevice.testing import FrozenRecord, FrozenSlotsRecord, SlotsRecord

# A test of what dynamo traces: torch.compile traces move() from torch 2.11, and runs it outside the graph before.
traces = pytest.mark.skipif(
    not _traced.TRACES, reason=f"torch.compile traces move() from torch 2.11; torch {torch.__version__} runs it eagerly"
)


class Point(NamedTuple):
    x: Any
    y: Any


class Twin(Point):
    """A namedtuple subclass whose constructor takes other arguments than its fields: Twin(v) is (v, v)."""

    def __new__(cls, x: Any) -> Twin:  # type: ignore[misc]
        return super().__new__(cls, x, x)

    def __getnewargs__(self) -> tuple[Any]:  # pickles as Twin(x)
        return (self.x,)


class Pair(Point):
    """A namedtuple subclass whose constructor takes one pair, with a matching _make: Pair((x, y))."""

    def __new__(cls, both: Any) -> Pair:  # type: ignore[misc]
        return super().__new__(cls, *both)

    @classmethod
    def _make(cls, iterable: Any) -> Pair:  # type: ignore[override]
        return tuple.__new__(cls, iterable)  # type: ignore[type-var]

    def __getnewargs__(self) -> tuple[Any]:  # type: ignore[override]
        return (tuple(self),)


@dataclasses.dataclass
class Record:
    a: Any
    b: Any = None


@dataclasses.dataclass
class LateRecord:
    """A dataclass with a field outside __init__, set after construction."""

    a: Any
    late: Any = dataclasses.field(init=False, default=None)


class TaggedDict(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor wants an extra argument, and which carries state."""

    def __init__(self, tag: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class TaggedList(list):  # type: ignore[type-arg]
    def __init__(self, tag: str, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag


class TaggedTuple(tuple):  # type: ignore[type-arg]
    """A tuple subclass that is no namedtuple, whose constructor wants an extra argument, and which carries state."""

    def __new__(cls, tag: Any, items: Any = ()) -> TaggedTuple:
        out = super().__new__(cls, items)
        out.tag = tag
        return out

    def __getnewargs__(self) -> tuple[Any, tuple[Any, ...]]:  # type: ignore[override]  # pickles as TaggedTuple(tag, items)
        return self.tag, tuple(self)


class TaggedDeque(collections.deque):  # type: ignore[type-arg]
    def __init__(self, tag: Any, items: Any = (), maxlen: int | None = None) -> None:
        super().__init__(items, maxlen)
        self.tag = tag

    def __reduce__(self) -> Any:  # pickles as TaggedDeque(tag, items, maxlen): deque's own passes the items first
        return type(self), (self.tag, list(self), self.maxlen)


class TaggedSet(set):  # type: ignore[type-arg]
    def __init__(self, tag: Any, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag

    def __reduce__(self) -> Any:  # pickles as TaggedSet(tag, items): set's own passes the items first
        return type(self), (self.tag, list(self))


class TaggedFrozenset(frozenset):  # type: ignore[type-arg]
    def __new__(cls, tag: Any, items: Any = ()) -> TaggedFrozenset:
        out = super().__new__(cls, items)
        out.tag = tag
        return out

    def __reduce__(self) -> Any:  # pickles as TaggedFrozenset(tag, items): frozenset's own passes the items first
        return type(self), (self.tag, list(self))


TAGGED_SEQUENCES = (TaggedTuple, TaggedDeque, TaggedSet, TaggedFrozenset)


class Output(collections.OrderedDict):  # type: ignore[type-arg]
    """A mapping registered with torch pytree, as transformers registers its ModelOutput."""


_pytree.register_pytree_node(
    Output, lambda o: (list(o.values()), list(o.keys())), lambda values, keys: Output(zip(keys, values))
)


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """Like a tokenizer's BatchEncoding: a UserDict whose own .to() moves the items that are tensors, in place."""

    def to(self, device: Any, non_blocking: bool = False) -> Encoding:
        self.data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.data.items()}
        return self


class Color(enum.Enum):
    RED = 1
    BLUE = 2


DATACLASSES = (Record, FrozenRecord, SlotsRecord, FrozenSlotsRecord)  # the last three: todevice.testing's


def make_late(a: Any, late: Any) -> LateRecord:
    r = LateRecord(a)
    r.late = late
    return r


# ---------------------------------------------------------------- the reference


def reference_move(
    obj: Any,
    device: Any,
    dtype: torch.dtype | None = None,
    skip: frozenset[Any] = frozenset(),
    leaf: Callable[[torch.Tensor], Any] | None = None,
) -> Any:
    """What move() must give, written as plainly as possible (no speed, no aliasing tricks). A mapping's items under
    the keys in ``skip`` stay as they are; a packed batch is its unpacked structure, moved. With ``leaf``, each tensor
    (each once) becomes what ``leaf`` makes of it instead: the structure rebuilt around other tensors."""
    memo: dict[int, tuple[Any, Any]] = {}  # each source kept alive, so that its id stays its own

    def go(x: Any) -> Any:
        if id(x) in memo:
            return memo[id(x)][1]
        out = one(x)
        memo[id(x)] = (x, out)
        return out

    def items(x: Any) -> dict[Any, Any]:
        return {k: v if k in skip else go(v) for k, v in x.items()}

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and leaf is not None:
            return leaf(x)
        if isinstance(x, torch.Tensor):
            cast = dtype if dtype is not None and (x.is_floating_point() or x.is_complex()) else None
            return x.to(device, cast)
        tp = type(x)
        if tp is dict:
            return items(x)
        if tp is collections.OrderedDict or tp is Output:
            return tp(items(x))
        if tp is collections.defaultdict:
            return collections.defaultdict(x.default_factory, items(x))
        if tp is Encoding:  # its .to() works in place: the reference never calls it
            return Encoding(items(x))
        if tp is todevice.PackedBatch:
            return go(x.unpack())
        if tp is list:
            return [go(v) for v in x]
        if tp is tuple:
            return tuple(go(v) for v in x)
        if tp is collections.deque:
            return collections.deque((go(v) for v in x), maxlen=x.maxlen)
        if tp is set:
            return {go(v) for v in x}
        if tp is frozenset:
            return frozenset(go(v) for v in x)
        if isinstance(x, torch.nn.Module):
            return x
        if hasattr(tp, "to"):
            return x.to(device)
        if isinstance(x, tuple) and hasattr(tp, "_fields"):
            return tp._make(go(v) for v in x)  # not tp(*...): Twin's constructor takes one value
        if isinstance(x, tuple) and hasattr(tp, "n_sequence_fields"):  # torch.return_types
            return tp([go(v) for v in x])
        if tp is LateRecord:
            return make_late(go(x.a), go(x.late))
        if dataclasses.is_dataclass(x):
            return tp(**{f.name: go(getattr(x, f.name)) for f in dataclasses.fields(x)})
        if tp is TaggedDict:
            return TaggedDict(x.tag, items(x))
        if tp is TaggedList:
            return TaggedList(go(x.tag), [go(v) for v in x])
        if tp is TaggedDeque:
            return TaggedDeque(go(x.tag), [go(v) for v in x], x.maxlen)
        if tp in TAGGED_SEQUENCES:  # a tuple, set or frozenset subclass
            return tp(go(x.tag), [go(v) for v in x])
        if isinstance(x, collections.abc.Mapping):  # UserDict and any other mapping: rebuilt from a dict
            return tp(items(x))
        return x

    return go(obj)


# ---------------------------------------------------------------- comparison


def sharing(tree: Any) -> list[int]:
    """Which tensors of ``tree`` are the same object: each tensor's number, numbered by first meeting, in a walk of the
    containers that ``reference_move`` knows (a set's order is its own: none is walked)."""
    numbers: dict[int, int] = {}
    out: list[int] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(numbers.setdefault(id(x), len(numbers)))
        elif isinstance(x, (dict, collections.UserDict)):
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, (list, tuple, collections.deque)):
            stack.extend(reversed(list(x)))
            if isinstance(x, (TaggedList, TaggedTuple, TaggedDeque)):
                stack.append(x.tag)
        elif isinstance(x, (TaggedSet, TaggedFrozenset)):  # its elements' order is its own: only its tag is walked
            stack.append(x.tag)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name, None) for f in reversed(dataclasses.fields(x)))
    return out


def tensor_signature(t: torch.Tensor, grad: bool = True) -> tuple[Any, ...]:
    return (type(t), t.device, t.dtype, tuple(t.shape), t.requires_grad if grad else None)


def assert_same_tree(
    actual: Any, expected: Any, path: str = "", *, values: bool = False, grad: bool = True, same: bool = True
) -> None:
    """Structure, container types and leaves agree; tensors by device, dtype, shape and requires_grad
    (and values when asked); every other leaf by identity (by equality when ``same`` is False, as
    after a pickle round trip)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert tensor_signature(actual, grad) == tensor_signature(expected, grad), f"{path}"
        if values:
            assert torch.equal(actual.detach(), expected.detach()), f"{path}: values differ"
        return
    if isinstance(expected, (dict,)):
        assert list(actual.keys()) == list(expected.keys()), f"{path}: keys"
        if isinstance(expected, collections.defaultdict):
            assert actual.default_factory is expected.default_factory
        for k in expected:
            assert_same_tree(actual[k], expected[k], f"{path}[{k!r}]", values=values, grad=grad, same=same)
        if hasattr(expected, "__dict__"):
            assert actual.__dict__.keys() == expected.__dict__.keys()
        return
    if isinstance(expected, collections.UserDict):
        assert_same_tree(actual.data, expected.data, f"{path}.data", values=values, grad=grad, same=same)
        return
    if isinstance(expected, (list, tuple, collections.deque)):
        assert len(actual) == len(expected), f"{path}: length"
        if isinstance(expected, collections.deque):
            assert actual.maxlen == expected.maxlen
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_tree(a, e, f"{path}[{i}]", values=values, grad=grad, same=same)
        if hasattr(expected, "__dict__") and not hasattr(type(expected), "_fields"):  # a namedtuple's is empty
            _same_attributes(actual, expected, path, values=values, grad=grad, same=same)
        return
    if isinstance(expected, (set, frozenset)):
        # Elements are moved one for one: compare the multisets of what they are.
        def key(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return tensor_signature(v, grad)
            return ("atom", id(v) if same else repr(v))

        assert sorted(map(repr, map(key, actual))) == sorted(map(repr, map(key, expected))), path
        if hasattr(expected, "__dict__"):
            _same_attributes(actual, expected, path, values=values, grad=grad, same=same)
        return
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for f in dataclasses.fields(expected):
            assert_same_tree(
                getattr(actual, f.name),
                getattr(expected, f.name),
                f"{path}.{f.name}",
                values=values,
                grad=grad,
                same=same,
            )
        return
    if same:
        assert actual is expected, f"{path}: {actual!r} is not {expected!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _same_attributes(actual: Any, expected: Any, path: str, **how: Any) -> None:
    """A container subclass's instance attributes, as ``assert_same_tree`` compares its items."""
    assert actual.__dict__.keys() == expected.__dict__.keys(), f"{path}: attributes"
    for k, e in expected.__dict__.items():
        assert_same_tree(actual.__dict__[k], e, f"{path}.{k}", **how)


def snapshot(obj: Any) -> Any:
    """Everything about a tree that move() must not change: structure, identities, tensor contents."""
    seen: set[int] = set()

    def go(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            data = x.detach().clone() if x.device.type != "meta" else None
            return ("tensor", id(x), x._version, x.device, x.dtype, tuple(x.shape), x.requires_grad, data)
        if id(x) in seen:
            return ("seen", id(x))
        seen.add(id(x))
        if isinstance(x, dict):
            return ("dict", id(x), type(x), [(k, go(v)) for k, v in x.items()], dict(getattr(x, "__dict__", {})))
        if isinstance(x, collections.UserDict):
            return ("userdict", id(x), type(x), id(x.data), [(k, go(v)) for k, v in x.data.items()])
        if isinstance(x, (list, tuple, collections.deque)):
            attributes = [(k, go(v)) for k, v in vars(x).items()] if hasattr(x, "__dict__") else []
            return ("seq", id(x), type(x), [go(v) for v in x], attributes)
        if isinstance(x, (set, frozenset)):
            attributes = [(k, go(v)) for k, v in vars(x).items()] if hasattr(x, "__dict__") else []
            return ("set", id(x), type(x), sorted(id(v) for v in x), attributes)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return ("dc", id(x), type(x), [go(getattr(x, f.name, None)) for f in dataclasses.fields(x)])
        return ("leaf", id(x))

    return go(obj)


def assert_snapshot_equal(before: Any, after: Any) -> None:
    def eq(a: Any, b: Any) -> None:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            assert torch.equal(a, b)
        elif isinstance(a, (list, tuple)):
            assert type(a) is type(b) and len(a) == len(b), (a, b)
            for x, y in zip(a, b):
                eq(x, y)
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                eq(a[k], b[k])
        else:
            assert a == b, (a, b)

    eq(before, after)


# ---------------------------------------------------------------- the corpus


def corpus() -> dict[str, Any]:
    """Edge-case trees by readable id, for pytest.mark.parametrize."""
    t = torch.arange(6.0).reshape(2, 3)
    return {
        "tensor": t,
        "empty-dict": {},
        "empty-list": [],
        "none": None,
        "zero-dim": torch.tensor(3.5),
        "empty-tensor": torch.empty(0, 4),
        "non-contiguous": t.t(),
        "strided-view": torch.arange(10.0)[::3],
        "bool-int-complex": [torch.ones(2, dtype=torch.bool), torch.arange(3), torch.ones(2, dtype=torch.complex64)],
        "bfloat16": torch.ones(3, dtype=torch.bfloat16),
        "requires-grad": torch.ones(2, requires_grad=True),
        "nested": {"x": [t, {"y": (t + 1, "label", 3)}], "z": None},
        "ordereddict": collections.OrderedDict([("b", t), ("a", 1)]),
        "defaultdict": collections.defaultdict(list, {"k": t}),
        "namedtuple": Point(t, "p"),
        "deque": collections.deque([t, 1], maxlen=5),
        "set": {1, "a", t},
        "frozenset": frozenset({2, t}),
        "dataclass": Record(t, [t + 2]),
        "frozen-dataclass": FrozenRecord(t, {"k": t}),
        "slots-dataclass": SlotsRecord(t),
        "frozen-slots-dataclass": FrozenSlotsRecord(t, (t,)),
        "init-false-field": make_late(t, t * 2),
        "dict-subclass": TaggedDict("tag", {"a": t}),
        "list-subclass": TaggedList("tag", [t, 2]),
        "tuple-subclass": TaggedTuple(t + 1, [t, 2]),
        "deque-subclass": TaggedDeque("tag", [t, 2], maxlen=4),
        "set-subclass": TaggedSet(t + 1, [t, 2]),
        "frozenset-subclass": TaggedFrozenset("tag", [t, 2]),
        "atoms": [1, 2.5, 1 + 2j, "s", b"b", True, None, Color.RED, torch.float16, torch.device("cpu")],
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "module-inside": {"m": torch.nn.Linear(2, 2), "x": t},
        "tuple-of-tuples": ((t,), ((t + 1,),)),
        "namedtuple-own-new": {"twin": Twin(t)},
        "namedtuple-own-new-and-make": {"pair": Pair((t, t + 1))},
        "structseq": {"max": torch.max(t, 1)},
        "dict-of-objects": {"r": Record(t), "s": {t}, "l": TaggedList("tag", [t]), "n": None, "x": [t.t(), 1]},
        "empty-tensors": {"a": torch.empty(0), "b": torch.empty(0, 2)},
    }


def exotic(kind: str) -> torch.Tensor:
    """A tensor that is not dense with memory of its own, by its kind: "sparse_coo", "sparse_csr", "nested" (strided)
    or "jagged"."""
    if kind == "sparse_coo":
        return torch.eye(4).to_sparse()
    if kind == "sparse_csr":
        return torch.eye(4).to_sparse_csr()
    layout = torch.jagged if kind == "jagged" else torch.strided
    return torch.nested.nested_tensor([torch.ones(4), torch.arange(3.0)], layout=layout)


def one_buffer(example: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeroed host targets like ``example``'s, views of one buffer laid out as coalescing lays it out (what move()
    gives on a GPU)."""
    lay = _layout.layout_for(list(example.values()), None)
    return dict(zip(example, _layout.read(torch.zeros(lay.nbytes, dtype=torch.uint8), lay)))


def left_behind(name: str) -> Any:
    """What moving the corpus's tree ``name`` warns: the module it holds is left behind, with a warning."""
    if name == "module-inside":
        return pytest.warns(todevice.errors.TensorsLeftBehindWarning, match="nn.Module")
    return contextlib.nullcontext()


class Copies(TorchDispatchMode):
    """Every ``copy_`` dispatched, in order, as (target, source): the order of writes and copies across a boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.__name__.split(".")[0] == "copy_":
            self.pairs.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))

    @property
    def log(self) -> list[tuple[str, str, int]]:
        """Each copy as (from, to, elements): the devices' types and the target's elements."""
        return [(src.device.type, dst.device.type, dst.numel()) for dst, src in self.pairs]
