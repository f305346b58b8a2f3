"""Hypothesis strategies and checks for code that moves nested batches of tensors.

Is :func:`todevice.move` a drop-in for the ``recursive_to_device`` helper your training loop
carries? :func:`compare` asks Hypothesis: it runs your helper and ``todevice.move()`` on random
batches of every container kind, and reports each kind your helper gets wrong, with the smallest
batch that shows it. The same tools serve your own property tests: :func:`batches` and
:func:`tensors` generate nested batches, and :func:`assert_moved` checks that a result is a
faithful move of its source.

This module needs Hypothesis (``pip install hypothesis``); ``import todevice`` never imports it.

Example:
    >>> import torch, todevice.testing
    >>> def recursive_to_device(data, device):
    ...     if isinstance(data, torch.Tensor):
    ...         return data.to(device)
    ...     if isinstance(data, dict):
    ...         return {k: recursive_to_device(v, device) for k, v in data.items()}
    ...     return data
    >>> report = todevice.testing.compare(recursive_to_device, containers=["dict", "namedtuple"], aliasing=False)
    >>> report.ok, [m.kind for m in report.mismatches]
    (False, ['namedtuple'])
    >>> todevice.testing.assert_moved(todevice.move({"x": torch.ones(2)}, "meta"), {"x": torch.ones(2)}, "meta")

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import bisect
import collections
import collections.abc
import copy
import dataclasses
import enum
import functools
import reprlib
import sys
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Any, NamedTuple, NoReturn

import optree
import torch
import torch.utils._pytree as _pytree

try:
    import hypothesis
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - exercised by removing hypothesis from sys.modules
    _msg = (
        "todevice.testing needs Hypothesis, which is not installed: pip install hypothesis "
        '(or pip install "todevice[test]"). The rest of todevice works without it.'
    )
    raise ImportError(_msg, name="hypothesis") from err

import todevice
from todevice import _options, _stream, _tree

# The functional names. The classes that batches() makes (Pair, Record, TaggedDict, ...) stay importable by name,
# to rebuild an example a failure printed, but are not exported.
__all__ = [  # noqa: RUF022 (grouped: strategies, then checks)
    # strategies
    "DTYPES",
    "KINDS",
    "batches",
    "tensors",
    # checks
    "Mismatch",
    "Report",
    "assert_moved",
    "compare",
]

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,  # first: Hypothesis shrinks towards it, so small examples read tensor(0.)
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)
"""The dtypes :func:`tensors` draws from by default."""

KINDS: tuple[str, ...] = (
    "dict",
    "OrderedDict",
    "defaultdict",
    "list",
    "tuple",
    "namedtuple",
    "deque",
    "set",
    "frozenset",
    "dataclass",
    "dict subclass",
    "list subclass",
    "Mapping",
    "torch.return_types",
)
"""The container kinds :func:`batches` makes, by the names its ``containers=`` option takes.

``OrderedDict`` includes ones reordered with ``move_to_end()``; ``dataclass`` is plain, frozen,
``slots=True`` or frozen with slots, with a field outside ``__init__`` and an attribute that is no
field; ``dict subclass`` and ``list subclass`` carry an instance attribute, which may hold a tensor
or a container, and ``list subclass`` includes ``collections.UserList``; ``Mapping`` is
``collections.UserDict`` and a read-only ``collections.abc.Mapping`` built from a dict;
``torch.return_types`` is what ``torch.max(t, dim)`` returns.
"""


# ---------------------------------------------------------------- the classes the strategies make


class Color(enum.Enum):
    """An enum, one of the atoms in batches."""

    RED = 1
    GREEN = 2


class Pair(NamedTuple):
    """The namedtuple in batches."""

    a: Any
    b: Any


@dataclasses.dataclass
class Record:
    """A dataclass with a field outside ``__init__`` (``extra``); batches may add an attribute, ``note``."""

    a: Any
    b: Any = None
    extra: Any = dataclasses.field(default=None, init=False)

    def __repr__(self) -> str:  # shows the attribute too
        note = f", note={self.__dict__['note']!r}" if "note" in self.__dict__ else ""
        return f"Record(a={self.a!r}, b={self.b!r}, extra={self.extra!r}{note})"


@dataclasses.dataclass(frozen=True)
class FrozenRecord:
    """A frozen dataclass."""

    a: Any
    b: Any = None


@dataclasses.dataclass(slots=True)
class SlotsRecord:
    """A dataclass with ``slots=True``: no instance ``__dict__``."""

    a: Any
    b: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlotsRecord:
    """A frozen dataclass with ``slots=True``."""

    a: Any
    b: Any = None


class TaggedDict(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor wants an extra argument, which it keeps as an attribute."""

    def __init__(self, tag: Any, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag

    def __repr__(self) -> str:
        return f"TaggedDict({self.tag!r}, {dict.__repr__(self)})"


class TaggedList(list):  # type: ignore[type-arg]
    """A list subclass whose constructor wants an extra argument, which it keeps as an attribute."""

    def __init__(self, tag: Any, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag

    def __repr__(self) -> str:
        return f"TaggedList({self.tag!r}, {list.__repr__(self)})"


class FrozenMapping(collections.abc.Mapping):  # type: ignore[type-arg]
    """A read-only ``collections.abc.Mapping`` that is not a dict, built from a dict."""

    def __init__(self, items: Any = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"FrozenMapping({self._items!r})"


# ---------------------------------------------------------------- strategies

_LAYOUTS = ("contiguous", "transposed", "strided", "expanded")


def _make_tensor(dtype: torch.dtype, shape: list[int], layout: str, seed: int, grad: bool) -> torch.Tensor:
    size = list(shape)
    if layout == "strided":  # every other element of a last dimension twice as long
        size = [*size[:-1], (size[-1] if size else 1) * 2]
    # Seed 0, where Hypothesis shrinks to, gives zeros: they read best in a small example.
    base = torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 10 if seed else torch.zeros(size)
    if dtype is torch.bool:
        t = base > 0
    elif dtype is torch.uint8:
        t = base.abs().to(dtype)
    else:
        t = base.to(dtype)
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif layout == "strided" and t.dim() >= 1:
        t = t[..., ::2]
    elif layout == "expanded":  # a zero stride: two rows over the same memory
        t = t.unsqueeze(0).expand(2, *t.shape)
    if grad and (dtype.is_floating_point or dtype.is_complex):
        t = t.detach().requires_grad_(True)
    return t


def _check_dtypes(dtypes: Iterable[torch.dtype] | None) -> tuple[torch.dtype, ...]:
    if dtypes is None:
        return DTYPES
    chosen = tuple(dtypes)
    wrong = [d for d in chosen if not isinstance(d, torch.dtype)]
    if wrong:
        msg = f"Expected torch.dtype values in dtypes=, got {wrong[0]!r} ({type(wrong[0]).__qualname__})."
        raise TypeError(msg)
    if not chosen:
        msg = "Expected at least one dtype in dtypes=, got none. Pass None for the default, todevice.testing.DTYPES."
        raise ValueError(msg)
    return chosen


def tensors(
    *, dtypes: Iterable[torch.dtype] | None = None, requires_grad: bool | None = None
) -> st.SearchStrategy[torch.Tensor]:
    """A Hypothesis strategy for CPU tensors of many dtypes, shapes and memory layouts.

    Shapes have up to 3 dimensions of up to 4 elements: 0-dim and empty tensors included. Layouts
    are contiguous, transposed, strided (every other element) and expanded (a zero stride). The
    values are random, or zeros, which is what Hypothesis shrinks to.

    Example:
        >>> import torch
        >>> from hypothesis import given
        >>> from todevice.testing import tensors
        >>> @given(tensors(dtypes=[torch.int64], requires_grad=False))
        ... def test_int64(t):
        ...     assert t.dtype == torch.int64 and not t.requires_grad
        >>> test_int64()

    Args:
        dtypes: The dtypes to draw from; :data:`DTYPES` when None.
        requires_grad: True makes every floating-point and complex tensor require grad (others
            cannot), False none; None draws either.

    Returns:
        The strategy.

    Raises:
        TypeError: ``dtypes`` holds something other than a ``torch.dtype``.
        ValueError: ``dtypes`` is empty.

    .. versionadded:: 0.2.0
    """
    grads = st.booleans() if requires_grad is None else st.just(bool(requires_grad))
    return st.builds(
        _make_tensor,
        st.sampled_from(_check_dtypes(dtypes)),
        st.lists(st.integers(0, 4), max_size=3),
        st.sampled_from(_LAYOUTS),
        st.integers(0, 2**16),
        grads,
    )


_ATOMS: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.integers(),  # large ints are distinct objects, so identity checks see a copied one
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.sampled_from(
        [Color.RED, Color.GREEN, torch.float16, torch.int64, torch.device("cpu"), torch.Size([2, 3]), torch.Size([])]
    ),
)
_KEYS: st.SearchStrategy[Any] = st.one_of(st.text(alphabet="abcxyz", min_size=1, max_size=3), st.integers(0, 9))


def _tie(t: torch.Tensor) -> torch.Tensor:
    """A distinct tensor over the very same memory, as tied weights are in a ``state_dict()``."""
    return t.detach().view(t.shape)


def _ordered(items: dict[Any, Any], reorder: bool) -> collections.OrderedDict[Any, Any]:
    out = collections.OrderedDict(items)
    if reorder and len(out) > 1:  # its order now differs from the order of the dict underneath
        out.move_to_end(next(iter(out)))
    return out


def _record(a: Any, b: Any, extra: Any, note: Any) -> Record:
    out = Record(a, b)
    out.extra = extra
    if note is not None:
        out.note = note  # type: ignore[attr-defined]
    return out


def _check_kinds(containers: Iterable[str] | None) -> tuple[str, ...]:
    if containers is None:
        return KINDS
    if isinstance(containers, str):
        containers = [containers]
    chosen = tuple(containers)
    unknown = [c for c in chosen if c not in KINDS]
    if unknown:
        msg = (
            f"Unknown container kind {unknown[0]!r} in containers=. "
            f"Choose among todevice.testing.KINDS: {', '.join(map(repr, KINDS))}."
        )
        raise ValueError(msg)
    return chosen


def _opaque(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``strategy`` with a short repr. Hypothesis writes strategies out in places, and through the
    nesting of st.recursive() the repr of the whole grows as the number of kinds to the power of its depth."""

    @st.composite
    def nested(draw: st.DrawFn) -> Any:
        return draw(strategy)

    return nested()


def _container_strategies(
    kinds: tuple[str, ...], nested: st.SearchStrategy[Any], hashables: st.SearchStrategy[Any]
) -> list[st.SearchStrategy[Any]]:
    children = _opaque(nested)
    lists = st.lists(children, max_size=4)
    dicts = st.dictionaries(_KEYS, children, max_size=4)
    elements = st.lists(hashables, max_size=4)
    tags = st.text(alphabet="tag", max_size=3) | children  # an attribute, moved like an item
    made: dict[str, st.SearchStrategy[Any]] = {
        "dict": dicts,
        "OrderedDict": st.builds(_ordered, dicts, st.booleans()),
        "defaultdict": st.builds(collections.defaultdict, st.sampled_from([list, int, dict]), dicts),
        "list": lists,
        "tuple": lists.map(tuple),
        "namedtuple": st.builds(Pair, children, children),
        "deque": st.builds(
            lambda items, spare: collections.deque(items, maxlen=None if spare < 0 else len(items) + spare),
            lists,
            st.integers(-1, 2),
        ),
        "set": elements.map(set),
        "frozenset": elements.map(frozenset),
        "dataclass": st.one_of(
            st.builds(_record, children, children, children, st.none() | children),
            st.builds(FrozenRecord, children, children),
            st.builds(SlotsRecord, children, children),
            st.builds(FrozenSlotsRecord, children, children),
        ),
        "dict subclass": st.builds(TaggedDict, tags, dicts),
        "list subclass": st.one_of(st.builds(TaggedList, tags, lists), lists.map(collections.UserList)),
        "Mapping": st.one_of(dicts.map(collections.UserDict), dicts.map(FrozenMapping)),
        "torch.return_types": st.builds(lambda a, b: torch.return_types.max((a, b)), children, children),
    }
    return [made[kind] for kind in kinds]


def batches(
    *,
    containers: Iterable[str] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    max_leaves: int = 20,
    aliasing: bool = True,
    requires_grad: bool | None = None,
) -> st.SearchStrategy[Any]:
    """A Hypothesis strategy for nested batches: containers of tensors and other values, on the CPU.

    Leaves are :func:`tensors` and atoms (None, bools, ints, floats, str, bytes, an enum,
    ``torch.dtype``, ``torch.device``, ``torch.Size``); containers are the kinds of :data:`KINDS`,
    nested at random. Sets and frozensets hold leaves only, as they must be hashable. Every class
    the strategy makes is defined at module level (in this module, ``collections`` or ``torch``),
    so every batch pickles.

    Example:
        >>> from hypothesis import given
        >>> import todevice
        >>> from todevice.testing import assert_moved, batches
        >>> @given(batches(containers=["dict", "namedtuple", "dataclass"]))
        ... def test_move(batch):
        ...     assert_moved(todevice.move(batch, "meta"), batch, "meta")
        >>> test_move()

    Args:
        containers: The container kinds to make, by name (see :data:`KINDS`); all of them when
            None. An empty collection makes single leaves.
        dtypes: The tensors' dtypes, as in :func:`tensors`.
        max_leaves: About how many leaves a batch holds at most.
        aliasing: Also put one tensor at several places in a batch, and distinct tensors over
            that tensor's memory (as tied weights are in a ``state_dict()``).
        requires_grad: As in :func:`tensors`.

    Returns:
        The strategy.

    Raises:
        ValueError: ``containers`` names an unknown kind, ``dtypes`` is empty, or ``max_leaves``
            is below 1.
        TypeError: ``dtypes`` holds something other than a ``torch.dtype``.

    .. versionadded:: 0.2.0
    """
    kinds = _check_kinds(containers)
    if max_leaves < 1:
        msg = f"Expected max_leaves of at least 1, got {max_leaves!r}."
        raise ValueError(msg)
    fresh = tensors(dtypes=dtypes, requires_grad=requires_grad)
    options: list[st.SearchStrategy[Any]] = [fresh, fresh, _ATOMS]  # tensors twice as likely as atoms
    if aliasing:
        shared = st.shared(fresh)  # the same tensor object at every place it is drawn in one batch
        options += [shared, shared.map(_tie)]
    leaves = st.one_of(*options)
    if not kinds:
        return leaves
    return st.recursive(
        leaves, lambda children: st.one_of(*_container_strategies(kinds, children, leaves)), max_leaves=max_leaves
    )


def _twice(t: torch.Tensor) -> list[torch.Tensor]:
    return [t, t]


def _tied(t: torch.Tensor) -> list[torch.Tensor]:
    return [_tie(t), _tie(t)]


# compare()'s search for lost aliasing: the same tensor twice, then two tensors over the same memory,
# then anything, in the order Hypothesis shrinks towards.
_ALIASES: st.SearchStrategy[Any] = st.one_of(
    tensors().map(_twice),
    tensors().map(_tied),
    st.deferred(lambda: batches(containers=("dict", "list"), max_leaves=6)),
)


def _holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    parts = _parts(x)
    return parts is not None and any(_holds_tensor(child) for child in parts.children)


def _rooted(kind: str) -> st.SearchStrategy[Any]:
    """compare()'s search for one kind: batches with that kind at the top, holding at least one tensor.

    So a helper wrong on other kinds, or on bare tensors, shows under those kinds alone.
    """
    nested = batches(containers=(kind,), aliasing=False, max_leaves=6)
    leaves = batches(containers=(), aliasing=False)
    return st.one_of(*_container_strategies((kind,), nested, leaves)).filter(_holds_tensor)


# ---------------------------------------------------------------- walking a structure

_ATOMIC_EXACT = frozenset(
    {type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, range, slice, type(Ellipsis)}
)
_ATOMIC_BASES: tuple[type, ...] = (int, float, complex, str, bytes, enum.Enum, torch.Size)
_UNSET: Any = object()


class _Parts(NamedTuple):
    """A container's children, with the path fragment of each (``['x']``, ``[2]``, ``.field``, ``{0}``)."""

    what: str  # "keys", "items", "fields", "elements": how a message names the entries
    entries: list[str]
    children: list[Any]
    keys: list[Any] | None = None  # a mapping's key of each child (_UNSET for an attribute), for skip_keys
    elements: list[Any] | None = None  # a set or frozenset subclass's elements, matched apart from its attributes


def _is_atom(tp: type) -> bool:
    if tp in _ATOMIC_EXACT or issubclass(tp, _ATOMIC_BASES):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and issubclass(tp, numpy.generic)


def _keyed(keys: list[Any], values: list[Any]) -> _Parts:
    return _Parts("keys", [f"[{k!r}]" for k in keys], values, keys)


def _get(x: Any, name: str) -> Any:
    return object.__getattribute__(x, name)  # below any __getattr__ of the class, as move() reads


def _slot_names(klass: type) -> tuple[str, ...]:
    slots = klass.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _object(x: Any) -> _Parts:
    """A dataclass; a subclass of dict, list, tuple, deque, set or frozenset; a UserDict, UserList or ChainMap: its
    attributes, then its items.

    Fields in their order, then the other instance attributes (in ``__dict__`` or slots) by name,
    then the items of a dict, list, tuple or deque subclass; a set or frozenset subclass's elements are matched as a
    set's. A UserDict keeps its items in an attribute, ``data``.
    """
    tp = type(x)
    fields = [f.name for f in dataclasses.fields(x)] if dataclasses.is_dataclass(x) else []
    slots = {n for klass in tp.__mro__ for n in _slot_names(klass)} - {"__dict__", "__weakref__"}
    state = _get(x, "__dict__") if tp.__dictoffset__ else {}
    if state is x:  # an attribute-access dict, whose __dict__ is itself: its attributes are its items
        state = {}
    names: list[str] = []
    children: list[Any] = []
    for name in [*fields, *sorted((slots | set(state)) - set(fields))]:
        try:
            value = state[name] if name in state else _get(x, name)
        except AttributeError:  # an init=False field, or a slot, never set
            continue
        names.append(f".{name}")
        children.append(value)
    keys: list[Any] = [_UNSET] * len(names)
    if isinstance(x, dict):
        keys_of: Any = collections.OrderedDict.keys if isinstance(x, collections.OrderedDict) else dict.keys
        items = list(keys_of(x))  # an OrderedDict's own order, which dict.keys() misses after move_to_end()
        names += [f"[{k!r}]" for k in items]
        children += [dict.__getitem__(x, k) for k in items]
        keys += items
    elif isinstance(x, (set, frozenset)):
        return _Parts("entries", names, children, keys, list(_items_of(x)))
    elif isinstance(x, (list, tuple, collections.deque)):
        values = list(_items_of(x))
        names += [f"[{i}]" for i in range(len(values))]
        children += values
        keys += [_UNSET] * len(values)
    return _Parts("entries", names, children, keys)


def _items_of(x: Any) -> Any:
    """A list, tuple, deque, set or frozenset subclass's items, read by its built-in base (not its own ``__iter__``)."""
    base: Any = next(b for b in (list, tuple, collections.deque, set, frozenset) if isinstance(x, b))
    return base.__iter__(x)


def _structseq(x: Any) -> _Parts:
    """Every field of a structseq, those beyond its tuple part too (``time.struct_time.tm_zone``)."""
    seq, extra = x.__reduce__()[1]
    named = getattr(type(x), "__match_args__", ())
    entries = [f".{named[i]}" if i < len(named) else f"[{i}]" for i in range(len(seq))]
    return _Parts("fields", entries + [f".{name}" for name in extra], [*seq, *extra.values()])


_IN_ATTRIBUTES = (collections.UserDict, collections.UserList, collections.ChainMap)
_IN_ITEMS = (dict, list, tuple, collections.deque, set, frozenset, *_IN_ATTRIBUTES)
_WEAK = (weakref.WeakValueDictionary, weakref.WeakKeyDictionary)


def _parts(x: Any) -> _Parts | None:
    """The children of a container, by the rules ``todevice.move()`` documents; None for a leaf.

    Written apart from the engine's own rules, so that a check by them tests the engine.
    """
    tp = type(x)
    if _is_atom(tp) or isinstance(x, torch.Tensor):
        return None
    if tp in _tree._registry:  # todevice.register() takes precedence over every other rule
        return _registered(x)
    if tp is dict or tp is collections.defaultdict:
        return _keyed(list(x), list(x.values()))
    if tp is collections.OrderedDict:
        return _keyed(list(x), [x[k] for k in x])
    if tp is list or tp is tuple or tp is collections.deque:
        return _Parts("items", [f"[{i}]" for i in range(len(x))], list(x))
    if tp is set or tp is frozenset:
        return _Parts("elements", [f"{{{i}}}" for i in range(len(x))], list(x))
    if isinstance(x, (torch.nn.Module, todevice.PackedBatch)):
        return None
    if callable(getattr(tp, "to", None)):
        return None
    if isinstance(x, tuple) and hasattr(tp, "_fields"):
        return _Parts("fields", [f".{name}" for name in tp._fields], list(x))
    if isinstance(x, tuple) and hasattr(tp, "n_sequence_fields"):
        return _structseq(x)
    if tp in _pytree.SUPPORTED_NODES or _optree_global(tp):  # registered there: that rule, not a subclass's
        return _registered(x)
    if dataclasses.is_dataclass(tp) or isinstance(x, _IN_ITEMS):  # namedtuples and structseqs told apart above
        return _object(x)
    if isinstance(x, _WEAK):  # rebuilt around new tensors, it would drop them at once: kept as it is
        return None
    if isinstance(x, collections.abc.Mapping):
        keys = list(x)
        return _keyed(keys, [x[k] for k in keys])
    return _registered(x)  # a rule newer than this module, if any


def _registered(x: Any) -> _Parts | None:
    """The children of a type registered with todevice, torch pytree or optree, by its registered flatten."""
    kind = _tree.kind_of(type(x))
    if kind.code == _tree.NODE and kind.flatten is not None and kind.entry is not None:
        children, aux = kind.flatten(x)
        return _Parts("entries", [kind.entry(aux, i) for i in range(len(children))], list(children))
    return None


def _optree_global(tp: type) -> bool:
    """Whether ``tp`` itself is registered in optree's global namespace (not as any namedtuple or structseq is)."""
    entry = optree.register_pytree_node.get(tp)
    return entry is not None and entry.type is tp


# Containers a move builds anew even around nothing to move, so that a change to the result never
# reaches the source. A structseq or another mapping with nothing moved inside comes back as it is.
_MUTABLE = (dict, list, set, collections.deque, *_IN_ATTRIBUTES)


def _equal_atoms(a: Any, b: Any) -> bool:
    """Whether two immutable values of one type are equal; a NaN equal to a NaN."""
    try:
        return a is b or bool(a == b) or bool(a != a and b != b)
    except Exception:  # a comparison that raises or is ambiguous: only the very same object will do
        return False


def _is_mutable(x: Any) -> bool:
    if isinstance(x, _MUTABLE):
        return True
    params = getattr(type(x), "__dataclass_params__", None)
    return params is not None and not params.frozen


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def _where(path: str) -> str:
    return f"At {path}" if path else "At the top level"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        try:
            shape = f"of shape {tuple(x.shape)}"
        except RuntimeError:  # a nested tensor has no single shape
            shape = "nested"
        grad = ", requiring grad" if x.requires_grad else ""
        return f"{type(x).__qualname__} {shape}, {x.dtype}, on {x.device}{grad}"
    return f"{type(x).__qualname__} {_short.repr(x)}"


def _target(device: Any) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        accelerator = _stream.accelerator()
        if accelerator is None:
            msg = f"Cannot read device {device!r}: an int is an accelerator's index, and there is no accelerator here."
            raise ValueError(msg)
        return torch.device(accelerator.type, device)
    return _stream.as_tensors_say(torch.device(device))  # CPU and meta tensors report no index: cpu:0 is cpu


def _resolved(target: torch.device) -> torch.device:
    """Where a tensor moved to ``target`` lands: an accelerator without an index means the current one."""
    index: int | None = target.index  # None where no index was given (typeshed says int)
    if index is not None or target.type in ("cpu", "meta"):
        return target
    try:
        return torch.empty(0, device=target).device
    except Exception:  # no such device here: no tensor can be on it already
        return target


def _span(t: torch.Tensor) -> tuple[Any, int, int] | None:
    """The bytes a strided tensor can read: (memory space, start, end); None where it reads none or cannot tell."""
    try:
        if t.layout is not torch.strided or not t.numel():
            return None
        size = t.element_size()
        extent = (1 + sum(int(n - 1) * abs(int(step)) for n, step in zip(t.shape, t.stride()))) * size
        if t.device.type == "meta":  # no data pointer, but a storage of its own
            start = int(t.storage_offset()) * size
            return ("meta", t.untyped_storage()._cdata), start, start + extent
        start = t.data_ptr()
        if not start:  # a device whose tensors report no address: unknown, as the address check reads it
            return None
        return (t.device,), start, start + extent
    except (RuntimeError, NotImplementedError, TypeError):  # wrapper subclasses, nested tensors
        return None


def _overlap(a: tuple[Any, int, int] | None, b: tuple[Any, int, int] | None) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _loses_type(tp: type) -> bool:
    """Whether ``.to()`` gives a plain tensor for this subclass, as it does for ``nn.Parameter``."""
    return getattr(tp, "__torch_function__", None) is torch._C._disabled_torch_function_impl


def _on(actual: torch.device, target: torch.device) -> bool:
    return actual.type == target.type and (target.index is None or actual.index == target.index)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors read the same memory the same way, so that move() keeps them sharing it."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.requires_grad or b.requires_grad:
        return False
    if a.dtype != b.dtype or a.device != b.device or a.is_conj() != b.is_conj() or a.is_neg() != b.is_neg():
        return False
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _address(t: torch.Tensor) -> Any:
    """Where a tensor's data starts; meta tensors have no data pointer, but have a storage of their own."""
    try:
        if t.device.type == "meta":
            return ("meta", t.untyped_storage()._cdata, t.storage_offset())
        return (t.device, t.data_ptr()) if t.data_ptr() else None
    except (RuntimeError, NotImplementedError):  # sparse tensors and wrapper subclasses
        return None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
        return False
    except (RuntimeError, NotImplementedError):  # layouts torch.equal does not handle: not compared
        return True


def _fail(path: str, text: str) -> NoReturn:
    raise AssertionError(f"{_where(path)}: {text}")


class _Memory:
    """What assert_moved() checks of the tensors a result holds, beyond each one alone: one result for a source
    tensor met twice, a result of its own for each distinct source, and results that share memory exactly where
    their sources do (tied weights)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}  # id(source) -> (source, result, path)
        self.memory: dict[Any, list[tuple[torch.Tensor, torch.Tensor, str]]] = {}
        self.results: dict[int, tuple[torch.Tensor, str]] = {}  # id(result) -> (source, path)
        # The memory each result reads, per memory space: starts sorted, and (start, end, source, path).
        # "overlaps" marks a space where results overlap (their sources do), so that a search walks it all.
        self.spans: dict[Any, tuple[list[int], list[tuple[int, int, torch.Tensor, str]]]] = {}
        self.overlaps: set[Any] = set()

    def fork(self) -> _Memory:
        other = _Memory()
        other.seen = dict(self.seen)
        other.memory = {k: list(v) for k, v in self.memory.items()}
        other.results = dict(self.results)
        other.spans = {k: (list(starts), list(entries)) for k, (starts, entries) in self.spans.items()}
        other.overlaps = set(self.overlaps)
        return other

    def distinct(self, result: torch.Tensor, source: torch.Tensor, path: str) -> None:
        """One result tensor for two distinct source tensors only where those share memory (tied weights)."""
        other = self.results.setdefault(id(result), (source, path))
        if other[0] is not source and not _overlap(_span(other[0]), _span(source)):
            _fail(
                path,
                f"expected a tensor of its own, got the very tensor found at {other[1] or 'the top level'}, "
                f"though the source holds two distinct tensors there: a change to one would change the other.",
            )

    def own_memory(self, result: torch.Tensor, source: torch.Tensor, path: str) -> None:
        """Results over overlapping memory only where their sources overlap too."""
        span = _span(result)
        if span is None:
            return
        space, start, end = span
        starts, entries = self.spans.setdefault(space, ([], []))
        i = bisect.bisect_left(starts, start)
        found = []
        j = i
        while j < len(entries) and entries[j][0] < end:  # starting inside this one
            found.append(entries[j])
            j += 1
        j = i - 1
        while j >= 0:  # starting before: only the nearest can reach in, unless results overlap here
            if entries[j][1] > start:
                found.append(entries[j])
            elif space not in self.overlaps:
                break
            j -= 1
        own = _span(source)
        for _, _, other_source, other_path in found:
            if other_source is not source and not _overlap(_span(other_source), own):
                _fail(
                    path,
                    f"expected a tensor with memory of its own, got one over memory of the tensor at "
                    f"{other_path or 'the top level'}, though their sources share none: a write to one "
                    f"would change the other.",
                )
        if found:
            self.overlaps.add(space)
        starts.insert(i, start)
        entries.insert(i, (start, end, source, path))

    def shared_memory(self, result: torch.Tensor, source: torch.Tensor, path: str) -> None:
        if not source.numel():
            return
        key = _address(source)
        if key is None:
            return
        others = self.memory.setdefault(key, [])
        for other_source, other_result, other_path in others:
            if _same_view(other_source, source) and _address(other_result) != _address(result):
                _fail(
                    path,
                    f"expected a tensor sharing memory with the one at {other_path or 'the top level'}, "
                    f"as the source's two tensors do (tied weights); got one with memory of its own.",
                )
        others.append((source, result, path))

    def known(self, source: Any) -> int:
        """0 for a tensor met before (its result is known), 1 for one over memory met before, else 2."""
        if not isinstance(source, torch.Tensor):
            return 2
        if id(source) in self.seen:
            return 0
        return 1 if source.numel() and _address(source) in self.memory else 2


class _Checker:
    """One assert_moved() call: the structure, each tensor, and (``_Memory``) what each source tensor became."""

    def __init__(self, target: torch.device, dtype: torch.dtype | None, skip: frozenset[str] = frozenset()) -> None:
        self.target = target
        self.home = _resolved(target)  # where a tensor is already, to come back as it is
        self.dtype = dtype
        self.skip = skip
        self.packed: list[torch.device] = []  # the buffer's device of each PackedBatch looked into, innermost last
        self.mem = _Memory()  # what each source tensor became, and the memory the results read
        # Sets, matched once everything else is checked: by then a set's tensors that also sit
        # elsewhere are known, which tells apart elements that look alike. None: match at once.
        self.sets: list[tuple[list[Any], list[Any], str]] | None = []

    def fork(self) -> _Checker:
        other = _Checker(self.target, self.dtype, self.skip)
        other.home, other.packed = self.home, list(self.packed)
        other.mem = self.mem.fork()
        other.sets = None
        return other

    def run(self, result: Any, source: Any) -> None:
        self.check(result, source, "")
        sets, self.sets = self.sets or [], None
        self.match(sets, [_TRIALS])

    def fail(self, path: str, text: str) -> None:
        _fail(path, text)

    def check(self, result: Any, source: Any, path: str) -> None:
        if isinstance(source, torch.Tensor):
            self.tensor(result, source, path)
            return
        parts = _parts(source)
        if parts is None:
            self.leaf(result, source, path)
            return
        tp = type(source)
        if type(result) is not tp:
            self.fail(path, f"expected the type {tp.__qualname__}, got {_describe(result)}.")
        if isinstance(source, collections.defaultdict) and result.default_factory is not source.default_factory:
            self.fail(
                path,
                f"expected a defaultdict whose default_factory is {source.default_factory!r}, "
                f"got one whose default_factory is {result.default_factory!r}.",
            )
        if isinstance(source, collections.deque) and result.maxlen != source.maxlen:
            self.fail(path, f"expected a deque with maxlen={source.maxlen!r}, got maxlen={result.maxlen!r}.")
        got = parts if result is source else _parts(result)  # read once: a mapping may make values anew (os.environ)
        if got is None:  # the same type, so never for the types above; a registered one may disagree
            self.fail(path, f"expected a container like the source's, got {_describe(result)}.")
            return
        if parts.what == "elements":
            self.set_of(got.children, parts.children, path)
            self.new_container(result, source, path)
            return
        if got.entries != parts.entries:
            if parts.what == "items":
                self.fail(path, f"expected {len(parts.entries)} items, got {len(got.entries)}.")
            order = " in this order" if sorted(got.entries) == sorted(parts.entries) else ""
            self.fail(
                path,
                f"expected the {parts.what} {', '.join(parts.entries) or '(none)'}{order}, "
                f"got {', '.join(got.entries) or '(none)'}.",
            )
        keys = parts.keys if self.skip and parts.keys is not None else [_UNSET] * len(parts.entries)
        for entry, key, r, s in zip(parts.entries, keys, got.children, parts.children):
            if key is not _UNSET and key in self.skip:
                self.held(r, s, path + entry)
            else:
                self.check(r, s, path + entry)
        if parts.elements is not None:
            self.set_of(got.elements or [], parts.elements, path)
        self.new_container(result, source, path)

    def new_container(self, result: Any, source: Any, path: str) -> None:
        """A mutable container must come back new. Checked after what it holds: a helper that hands back a container
        it did not walk is reported by the tensor it left behind, where it holds one."""
        if result is source and _is_mutable(source):
            self.fail(
                path,
                f"expected a new {type(source).__qualname__}, got the source's own: a change to the result "
                f"would change the source.",
            )

    def set_of(self, results: list[Any], sources: list[Any], path: str) -> None:
        """A set's elements, each moved from one of the source's: matched now, or with every other set at the end."""
        if len(results) != len(sources):
            self.fail(path, f"expected {len(sources)} elements, got {len(results)}.")
        if self.sets is None:
            self.elements(results, sources, path)
        else:
            self.sets.append((results, sources, path))

    def held(self, result: Any, source: Any, path: str) -> None:
        """An item under a key of skip_keys: the very same object; in a packed batch, as the batch holds it."""
        if self.packed:  # filled from the batch's buffer, where the batch is: checked as a move there
            saved = self.target, self.home, self.dtype, self.skip
            self.target = self.home = self.packed[-1]
            self.dtype, self.skip = None, frozenset()
            try:
                self.check(result, source, path)
            finally:
                self.target, self.home, self.dtype, self.skip = saved
            return
        if result is not source:
            self.fail(
                path,
                f"expected the very same object as in the source, as skip_keys names its key: {_describe(source)}; "
                f"got {_describe(result)}.",
            )

    def leaf(self, result: Any, source: Any, path: str) -> None:
        if isinstance(source, todevice.PackedBatch):  # it comes back unpacked, as its own structure
            self.packed.append(source.buffer.device)
            try:
                self.check(result, source.unpack(), path)
            finally:
                self.packed.pop()
            return
        moves_itself = not isinstance(source, torch.nn.Module) and callable(getattr(type(source), "to", None))
        if moves_itself:  # an object with its own .to(): only its type is checked
            if type(result) is not type(source):
                self.fail(
                    path, f"expected a {type(source).__qualname__} (moved by its .to()), got {_describe(result)}."
                )
            return
        if _is_atom(type(source)):  # immutable: an equal value of the same type will do (a torch.Size rebuilt)
            if type(result) is not type(source) or not _equal_atoms(result, source):
                self.fail(path, f"expected {_describe(source)}, got {_describe(result)}.")
            return
        if result is not source:
            copied = "a copy, " if type(result) is type(source) else ""
            self.fail(
                path,
                f"expected the very same object as in the source, {_describe(source)}, "
                f"got {copied}{_describe(result)}.",
            )

    def tensor(self, result: Any, source: torch.Tensor, path: str) -> None:
        target = self.target
        if not isinstance(result, torch.Tensor):
            self.fail(path, f"expected a tensor on {target}, got {_describe(result)}.")
        first = self.mem.seen.get(id(source))
        if first is not None:
            if result is not first[1]:
                self.fail(
                    path,
                    f"expected the very tensor found at {first[2] or 'the top level'}, since the source holds "
                    f"one tensor at both places; got another tensor ({_describe(result)}). Aliasing was lost.",
                )
            return
        self.mem.seen[id(source)] = (source, result, path)
        self.mem.distinct(result, source, path)
        if not _on(result.device, target):
            was = ": it was not moved" if result.device == source.device else ""
            self.fail(path, f"expected a tensor on {target}, got {_describe(result)}{was}.")
        cast = self.dtype is not None and (source.is_floating_point() or source.is_complex())
        dtype = self.dtype if cast and self.dtype is not None else source.dtype
        tp = type(source)
        if type(result) is not tp and not (_loses_type(tp) and type(result) is torch.Tensor):
            self.fail(path, f"expected a {tp.__qualname__}, as the source is; got {_describe(result)}.")
        if result.dtype != dtype:
            self.fail(path, f"expected a tensor of {dtype}, got {_describe(result)}.")
        if result is not source and not self.packed and source.device == self.home and source.dtype == dtype:
            self.fail(
                path,
                f"expected the source's own tensor, which is on {target} already with nothing to cast "
                f"(move() returns it as it is, as .to() does); got another ({_describe(result)}).",
            )
        if result.shape != source.shape:
            self.fail(path, f"expected a tensor of shape {tuple(source.shape)}, got {_describe(result)}.")
        if result.requires_grad != source.requires_grad:
            want = "requiring grad" if source.requires_grad else "not requiring grad"
            self.fail(path, f"expected a tensor {want}, as the source is; got {_describe(result)}.")
        if source.requires_grad and result is not source and result.grad_fn is None and not self.packed:
            self.fail(
                path,
                "expected a tensor connected to the source's autograd graph, as .to() gives; got a new leaf, "
                "through which no gradient flows back to the source.",
            )
        self.mem.shared_memory(result, source, path)
        self.mem.own_memory(result, source, path)
        if source.device.type != "meta" and result.device.type != "meta":
            want_values = source.detach().to("cpu", dtype)
            if not _same_values(result.detach().cpu(), want_values):
                self.fail(path, f"expected the source's values, got others ({_describe(result)}).")

    def elements(self, results: list[Any], sources: list[Any], path: str) -> None:
        """A set's elements, matched at once, each with the first result element that checks."""
        self.match([(results, sources, path)], [_TRIALS])

    def match(self, sets: list[tuple[list[Any], list[Any], str]], budget: list[int]) -> None:
        """Pair every set's elements one for one, trying other pairings where a later check needs them.

        Elements can look alike (two empty tensors on meta) until a later place tells them apart (one
        of them is also elsewhere); tensors met before go first, and a pairing that a later set
        refutes is undone, up to ``budget`` trials in all.
        """
        if not sets:
            return
        (results, sources, path), rest = sets[0], sets[1:]
        order = sorted(enumerate(sources), key=lambda pair: self.mem.known(pair[1]))
        first: list[AssertionError] = []  # the first failure met, on the path tried first: the one shown

        def pair(checker: _Checker, k: int, left: list[Any]) -> bool:
            if k == len(order):
                try:
                    checker.match(rest, budget)
                except AssertionError as err:
                    first.append(err)
                    return False
                return True
            i, source = order[k]
            errors: list[AssertionError] = []
            for j, candidate in enumerate(left):
                if budget[0] <= 0:
                    break
                budget[0] -= 1
                trial = checker.fork()
                try:
                    trial.check(candidate, source, f"{path}{{{i}}}")
                except AssertionError as err:
                    errors.append(err)
                    continue
                if pair(trial, k + 1, left[:j] + left[j + 1 :]):
                    return True
            if len(errors) == 1 and len(left) == 1:  # one element left: what is wrong with it
                first.append(errors[0])
            else:
                first.append(
                    AssertionError(
                        f"{_where(f'{path}{{{i}}}')}: expected an element moved from {_describe(source)}, "
                        f"found none among the result's."
                    )
                )
            return False

        if not pair(self, 0, list(results)):
            raise first[0]


# Pairings of set elements tried by one assert_moved() call at most: only sets of elements that
# look alike, with a pairing refuted late, come near it.
_TRIALS = 10_000


def assert_moved(
    result: Any,
    source: Any,
    device: Any,
    /,
    *,
    dtype: torch.dtype | None = None,
    skip_keys: Hashable | Collection[Hashable] | None = None,
) -> None:
    """Check that ``result`` is ``source`` moved to ``device``, as ``todevice.move()`` promises.

    Containers: the same structure and exact types, a new object for each mutable one (a move never
    shares one with its input), a namedtuple's or dataclass's class, every field of a dataclass or
    structseq (``init=False`` ones too), a defaultdict's ``default_factory``, a deque's ``maxlen``
    and an OrderedDict's order (after ``move_to_end()`` too). The instance attributes of
    dataclasses, dict and list subclasses, UserDict, UserList and ChainMap are checked like fields,
    so a tensor left behind in one is found. Sets are matched element by element. Tensors: on
    ``device``, of the source's type (a subclass stays one; an ``nn.Parameter`` may come back a
    plain tensor, as ``.to()`` gives it) and dtype (or ``dtype``, for floating-point and complex
    ones), shape, ``requires_grad``, autograd history and values (not compared where either side
    is on ``meta``). A tensor already on ``device`` with nothing to cast is the very same tensor,
    as ``.to()`` returns it. A tensor that the source holds at several places is one tensor in the
    result, and distinct source tensors over the same memory, read the same way (tied weights),
    still share memory; distinct source tensors that share no memory come back as distinct tensors
    that share none. A ``PackedBatch`` comes back as the structure it packs, checked against
    ``unpack()``. The items under the keys in ``skip_keys`` are the very same objects as in the
    source. Every other value is the very same object; one with its own ``.to()`` has the
    source's type, and an immutable container may come back as the very same object when nothing
    in it needed moving.

    Example:
        >>> import collections, torch, todevice
        >>> from todevice.testing import assert_moved
        >>> source = {"x": collections.defaultdict(list, {"y": torch.ones(2)})}
        >>> assert_moved(todevice.move(source, "meta"), source, "meta")
        >>> assert_moved({"x": {"y": torch.ones(2)}}, source, "meta")
        Traceback (most recent call last):
        AssertionError: At ['x']: expected the type defaultdict, got dict {'y': tensor([1., 1.])}.

    Args:
        result: What moving ``source`` gave.
        source: What was moved, as it was before the move.
        device: The target device, as given to the move: ``"meta"``, ``"cuda"``, ``torch.device(...)``.
        dtype: The ``dtype=`` given to the move, if any.
        skip_keys: The ``skip_keys=`` given to the move, if any: a dict key, or a collection of them.

    Raises:
        AssertionError: ``result`` is not ``source`` moved. The message names the path inside the
            structure (``['x'][2].field``), what was expected there and what came instead.
        TypeError: ``skip_keys`` is neither a str nor a collection of str.

    .. versionadded:: 0.2.0
    """
    _Checker(_target(device), dtype, _options.skip_set(skip_keys)).run(result, source)


# ---------------------------------------------------------------- compare()


def _snapshot(x: Any) -> list[tuple[str, int, str, int, Any]]:
    """Every object in a structure, by path: its identity and description, and a tensor's version and memory."""
    out: list[tuple[str, int, str, int, Any]] = []

    def go(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            try:
                version = node._version
            except RuntimeError:  # an inference tensor keeps no version
                version = -1
            out.append((path, id(node), _describe(node), version, _address(node)))
            return
        out.append((path, id(node), _describe(node), 0, None))
        parts = _parts(node)
        if parts is None:
            return
        for entry, child in zip(parts.entries, parts.children):
            go(child, path + entry)

    go(x, "")
    return out


def _changed(before: list[tuple[str, int, str, int, Any]], after: list[tuple[str, int, str, int, Any]]) -> str | None:
    """How a structure changed between two snapshots, in words that are the same on every run; None if it did not."""
    for old, new in zip(before, after):
        if old == new:
            continue
        if old[2] != new[2]:
            change = f"it held {old[2]} there, and {new[2]} afterwards"
        elif old[1] != new[1]:
            change = f"the {old[2]} there was replaced by another object"
        elif old[4] != new[4]:
            change = f"the {old[2]} there was given other memory"
        else:
            change = f"the values of the {old[2]} there were written in place"
        return f"{_where(old[0])}: changed its input: {change}. A move must leave its input as it was."
    if len(before) != len(after):
        return f"Changed its input: it held {len(before)} objects, and {len(after)} afterwards."
    return None


class Mismatch(NamedTuple):
    """One container kind that a helper, or ``todevice.move()``, gets wrong, found by :func:`compare`.

    Attributes:
        kind: A name of :data:`KINDS` (batches with that kind at the top), ``"tensors"`` (single
            tensors) or ``"aliasing"``.
        example: The smallest batch found that shows it, as it was before the move.
        message: What is wrong with the helper's result, from :func:`assert_moved` (or the
            exception the helper raised, or how it changed its input); None where it is right.
        move_message: The same for ``todevice.move()``'s result; None where it is right.

    .. versionadded:: 0.2.0
    """

    kind: str
    example: Any
    message: str | None
    move_message: str | None


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`compare` found. ``str(report)`` is the readable form; ``assert report.ok, report`` fails with it.

    Attributes:
        helper: The helper's name.
        device: The device the batches were moved to.
        kinds: What was checked, in order: ``"tensors"``, container kinds, ``"aliasing"``.
        max_examples: The most batches tried per kind.
        mismatches: One per kind where the helper's result, or ``todevice.move()``'s, is wrong.

    .. versionadded:: 0.2.0
    """

    helper: str
    device: str
    kinds: tuple[str, ...]
    max_examples: int
    mismatches: tuple[Mismatch, ...]

    @property
    def ok(self) -> bool:
        """Whether the helper, and ``todevice.move()``, moved every batch tried as ``move()`` promises."""
        return not self.mismatches

    def __str__(self) -> str:
        tried = f"moving to {self.device}, up to {self.max_examples} batches per kind"
        if self.ok:
            return (
                f"{self.helper} handles every kind checked as todevice.move() does ({tried}): {', '.join(self.kinds)}."
            )
        lines = [
            f"{self.helper} differs from todevice.move() on {len(self.mismatches)} of {len(self.kinds)} kinds "
            f"({tried}):"
        ]
        for m in self.mismatches:
            example = _indent(_short_repr(m.example))
            lines.append(f"- {m.kind}, for example {example}")
            if m.message is not None:
                lines.append(f"    {self.helper}: {_indent(m.message)}")
            if m.move_message is not None:
                who = "todevice.move() too" if m.message is not None else f"todevice.move() ({self.helper} is right)"
                lines.append(f"    {who}: {_indent(m.move_message)}")
        wrong = {m.kind for m in self.mismatches}
        right = [k for k in self.kinds if k not in wrong]
        if right:
            lines.append(f"Handled as todevice.move() does: {', '.join(right)}.")
        return "\n".join(lines)


def _short_repr(x: Any, limit: int = 400) -> str:
    text = repr(x)
    tp = type(x)
    if tp.__module__ != "builtins" and not text.lower().startswith((tp.__qualname__.lower(), tp.__module__)):
        text = f"{tp.__qualname__}({text})"  # a UserDict shows itself as a dict
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _indent(text: str) -> str:
    return text.replace("\n", "\n      ")


class _Search:
    """compare()'s searches: one per kind, for a batch that the helper, or else move(), gets wrong."""

    def __init__(self, helper: Callable[[Any, Any], Any], device: Any, max_examples: int) -> None:
        self.helper, self.device = helper, device
        self.settings = hypothesis.settings(
            max_examples=max_examples,
            database=None,
            derandomize=True,  # the same report on every run, and no examples stored between runs
            deadline=None,
            verbosity=hypothesis.Verbosity.quiet,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=(hypothesis.Phase.generate, hypothesis.Phase.shrink),
        )
        # What the latest call found: after find(), that of the example it returns, which it runs last.
        self.last: tuple[str | None, bool] = (None, False)
        self.move_failed = False

    def failure(self, fn: Callable[[Any, Any], Any], batch: Any) -> tuple[str | None, bool]:
        """Why ``fn``'s move of ``batch`` is wrong (None if it is right), and whether it changed ``batch``."""
        before = _snapshot(batch)
        try:
            out = fn(batch, self.device)
        except Exception as err:
            return f"raised {type(err).__qualname__}: {err}", False
        changed = _changed(before, _snapshot(batch))
        if changed is not None:
            return changed, True
        try:
            assert_moved(out, batch, self.device)
        except AssertionError as err:
            return str(err), False
        return None, False

    def helper_fails(self, batch: Any, copies: bool = False) -> bool:
        self.last = self.failure(self.helper, copy.deepcopy(batch) if copies else batch)
        if self.last[0] is None and not self.move_failed:
            self.move_failed = self.failure(todevice.move, batch)[0] is not None
        return self.last[0] is not None

    def move_fails(self, batch: Any) -> bool:
        self.last = self.failure(todevice.move, batch)
        return self.last[0] is not None

    def find(self, strategy: st.SearchStrategy[Any], fails: Callable[[Any], bool]) -> Any:
        try:
            return hypothesis.find(strategy, fails, settings=self.settings)
        except hypothesis.errors.NoSuchExample:
            return _UNSET

    def kind(self, kind: str, strategy: st.SearchStrategy[Any]) -> Mismatch | None:
        self.move_failed = False
        example = self.find(strategy, self.helper_fails)
        if example is not _UNSET and self.last[1]:
            # The helper wrote into the batch find() hands back: search again the same way (it is
            # derandomized), handing the helper copies, so that the example shows the batch as it was.
            example = self.find(strategy, functools.partial(self.helper_fails, copies=True))
        if example is _UNSET and self.move_failed:
            example = self.find(strategy, self.move_fails)
            self.last = (None, False)
        if example is _UNSET:
            return None
        return Mismatch(kind, example, self.last[0], self.failure(todevice.move, example)[0])


def compare(
    helper: Callable[[Any, Any], Any],
    /,
    *,
    device: Any = "meta",
    containers: Iterable[str] | None = None,
    aliasing: bool = True,
    max_examples: int = 30,
) -> Report:
    """Run your own ``helper(batch, device)`` and ``todevice.move()`` on random batches, kind by kind.

    For single tensors, then each container kind (:data:`KINDS`), then aliasing (a tensor at two
    places, tied weights), Hypothesis searches batches of that kind (that kind at the top, holding
    at least one tensor) for one that the helper moves wrongly, by :func:`assert_moved`, or raises
    on, or changes in place; it then shrinks the batch to the smallest that still shows it.
    ``todevice.move()`` runs on the same batches. Each kind is one search of up to
    ``max_examples`` batches, derandomized, so the report is the same on every run; the default
    takes a few seconds. Do not call it inside a ``@given`` test.

    Example:
        >>> import torch, todevice.testing
        >>> def to_device(data, device):
        ...     if isinstance(data, (list, tuple)):
        ...         return type(data)(to_device(v, device) for v in data)
        ...     return data.to(device) if isinstance(data, torch.Tensor) else data
        >>> report = todevice.testing.compare(to_device, containers=["list", "tuple", "namedtuple"])
        >>> [m.kind for m in report.mismatches]  # a namedtuple built from one generator; a tensor twice, copied twice
        ['namedtuple', 'aliasing']

    Args:
        helper: Your move: ``helper(batch, device)`` returns the moved batch.
        device: The device to move to, passed to ``helper`` as it is. ``"meta"`` works on every
            machine, but then values are not compared.
        containers: The container kinds to check, by name; all of :data:`KINDS` when None.
        aliasing: Also check that a tensor at two places comes back as one tensor, and that tied
            weights still share memory.
        max_examples: The most batches tried per kind.

    Returns:
        A :class:`Report`: ``report.ok`` is whether the helper was right everywhere, and
        ``report.mismatches`` lists each kind it gets wrong, with the smallest batch found.

    Raises:
        ValueError: ``containers`` names an unknown kind, ``max_examples`` is below 1, or
            ``device`` is not a valid or available device (as :func:`todevice.move` says).
        TypeError: ``helper`` is not callable, or ``device`` has the wrong type.

    .. versionadded:: 0.2.0
    """
    fn: Any = helper  # anything, at run time
    if not callable(fn):
        msg = f"Cannot compare {fn!r}: compare() takes your helper, a function called as helper(batch, device)."
        raise TypeError(msg)
    kinds = _check_kinds(containers)
    if max_examples < 1:
        msg = f"Expected max_examples of at least 1, got {max_examples!r}."
        raise ValueError(msg)
    todevice.move(torch.empty(0), device)  # a device that is not valid or not here: move()'s error, up front
    name = getattr(helper, "__name__", None) or repr(helper)
    searches: list[tuple[str, st.SearchStrategy[Any]]] = [("tensors", tensors())]
    searches += [(kind, _rooted(kind)) for kind in kinds]
    if aliasing:
        searches.append(("aliasing", _ALIASES))

    search = _Search(helper, device, max_examples)
    found = (search.kind(kind, strategy) for kind, strategy in searches)
    mismatches = tuple(m for m in found if m is not None)
    return Report(name, str(device), tuple(k for k, _ in searches), max_examples, mismatches)
