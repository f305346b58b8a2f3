"""Container rules and the registry: which objects are trees, and how they come apart and go back together.

Every type is classified once and its rule cached (``_kinds``). A container's rule holds functions in optree's
convention, ``flatten(obj) -> (children, aux)`` and ``unflatten(aux, children) -> obj``, and ``entry(aux, i)``, the
path fragment of child ``i`` (``['x']``, ``[2]``, ``.field``): ``_walk``'s walks use them for moving, packing, paths
and diagnostics alike."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import enum
import functools
import inspect
import operator
import sys
import threading
import types
import weakref
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.utils._pytree as _pytree

from todevice._objects import (  # re-exported: the kinds are _tree's words to every walker
    _IN_ATTRIBUTES as _IN_ATTRIBUTES,
    _NO_KEY as _NO_KEY,
    ATOM as ATOM,
    MODULE as MODULE,
    NODE as NODE,
    PACKED as PACKED,
    SLOT as SLOT,
    STRUCTSEQ as STRUCTSEQ,
    SUBSET as SUBSET,
    TENSOR as TENSOR,
    TO as TO,
    UNKNOWN as UNKNOWN,
    Flatten as Flatten,
    Kind as Kind,
    Unflatten as Unflatten,
    _container_base as _container_base,
    _flatten_with_keys as _flatten_with_keys,
    _keys as _keys,
    _object_kind as _object_kind,
    _registered as _registered,
    _registered_entry as _registered_entry,
    _registered_unflatten as _registered_unflatten,
)

# Atomic types besides the subclasses of _ATOMIC_BASES.
_ATOMIC_EXACT: frozenset[type] = frozenset(
    {type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, range, slice, type(Ellipsis)}
)
# Exact types the hot loops recognise without a cache lookup.
FAST_ATOMS: frozenset[type] = frozenset({type(None), bool, int, float, str, bytes})
_ATOMIC_BASES: tuple[type, ...] = (int, float, complex, str, bytes, enum.Enum, torch.Size)


# functorch's wrappers (the tensors inside torch.func.vmap or grad) have no memory of their own: data_ptr() raises.
# They exist only while a transform is active, which one C call tells.
wrapped: Callable[[torch.Tensor], bool] = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)
transforming: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", bool)


def has_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor over memory of its own, which one copy reads and writes as bytes: strided, not
    nested, and not a functorch wrapper. Sparse, nested and wrapped tensors travel as they are, each by its own copy."""
    return t.layout is torch.strided and not t.is_nested and not wrapped(t)


DENSE_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128}
    | {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32}
    | {torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2}
)


def dense(t: Any) -> bool:
    """The one predicate for a tensor whose bytes a byte buffer holds, read by staging, packing and coalescing: a
    plain tensor (no subclass), with memory of its own (``has_memory``), of a dtype in ``DENSE_DTYPES``."""
    return type(t) is torch.Tensor and t.dtype in DENSE_DTYPES and has_memory(t)


class Slot(int):
    """A hole in a packed structure's skeleton: the place of the ``int(self)``-th tensor taken out. An int, so that
    making one (per tensor packed) costs no Python frame and filling one is a list index."""

    __slots__ = ()

    # Equal to itself only: beside a plain int in a skeleton's set, a slot equal to 0 would swallow the 0.
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (type(self), (int(self),))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class AliasSlot(Slot):
    """A distinct tensor over the very memory of tensor ``int(self)``: filled with a new view of it."""

    __slots__ = ()


def filled(slot: Slot, views: list[Any] | None, aliases: dict[int, tuple[Slot, Any]] | None) -> Any:
    """What fills a packed skeleton's slot: its tensor of ``views``; for an AliasSlot, a new view of it, one per
    AliasSlot however often met (``aliases``, per skeleton filled: two batches may share one)."""
    if views is None or aliases is None:
        msg = f"Cannot move {slot!r}: a slot only means something inside a PackedBatch's skeleton."
        raise TypeError(msg) from None  # not the walk's own exceptions, being handled as it is met
    view = views[slot.real]  # the plain int: dynamo before 2.12 does not take an int subclass as an index
    if type(slot) is Slot:
        return view
    hit = aliases.get(id(slot))
    if hit is None:
        hit = aliases[id(slot)] = (slot, view.view(view.shape))  # the slot kept alive, so its id stays its own
    return hit[1]


class Packed:
    """What a packed batch is to the walks (:class:`todevice.PackedBatch` is one): ``buffer``, the bytes of every
    packed tensor, which ``layout`` places; ``skeleton``, the structure with a slot where each was; ``requires_grad``,
    the slots whose tensor required grad. Moved as its buffer sent once, its slots filled with views of the copy."""

    __slots__ = ()

    buffer: Any
    layout: Any
    skeleton: Any
    requires_grad: tuple[int, ...]


class Deferred:
    """A registered container in a packed skeleton, rebuilt by its own unflatten only when unpacked: while packing,
    its children are slots, which a user's unflatten may not expect (it may read a child's shape). Its unflatten is
    the one registered when it was packed, so a move sees one registration even if another thread unregisters the type
    meanwhile; pickled (to another process), it keeps only the class, unpacked with that process's registration."""

    __slots__ = ("aux", "children", "cls", "unflatten")

    def __init__(self, cls: type, aux: Any, children: list[Any], unflatten: Unflatten | None = None) -> None:
        self.cls, self.aux, self.children, self.unflatten = cls, aux, children, unflatten

    def __reduce__(self) -> tuple[type, tuple[type, Any, list[Any]]]:
        return (type(self), (self.cls, self.aux, self.children))


class DeferredMapping(Deferred):
    """A mapping rebuilt as ``cls(dict)`` in a packed skeleton, only when unpacked: its constructor may read its
    values (``torch.as_tensor(v)``, ``v.shape``), and while packing they are slots. ``aux`` is ``(None, keys)``."""

    __slots__ = ()


# ---------------------------------------------------------------- built-in containers


def _index_entry(aux: Any, i: int) -> str:
    return f"[{i}]"


def _key_entry(aux: Any, i: int) -> str:
    return f"[{aux[-1][i]!r}]"


def _dict_flatten(d: dict[Any, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    return list(d.values()), (list(d),)


def _defaultdict_flatten(d: defaultdict[Any, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    return list(d.values()), (d.default_factory, list(d))


def _seq_flatten(s: Any) -> tuple[list[Any], None]:
    return list(s), None


def _set_entry(aux: Any, i: int) -> str:  # a set's element, by its place in iteration order
    return f"{{{i}}}"


_BUILTIN: dict[type, Kind] = {
    dict: Kind(NODE, _dict_flatten, lambda aux, ch: dict(zip(aux[0], ch)), _key_entry, _keys),
    OrderedDict: Kind(NODE, _dict_flatten, lambda aux, ch: OrderedDict(zip(aux[0], ch)), _key_entry, _keys),
    defaultdict: Kind(
        NODE, _defaultdict_flatten, lambda aux, ch: defaultdict(aux[0], zip(aux[1], ch)), _key_entry, _keys
    ),
    list: Kind(NODE, _seq_flatten, lambda aux, ch: ch, _index_entry),
    tuple: Kind(NODE, _seq_flatten, lambda aux, ch: tuple(ch), _index_entry),
    deque: Kind(NODE, lambda d: (list(d), d.maxlen), lambda maxlen, ch: deque(ch, maxlen=maxlen), _index_entry),
    set: Kind(NODE, _seq_flatten, lambda aux, ch: set(ch), _set_entry),
    frozenset: Kind(NODE, _seq_flatten, lambda aux, ch: frozenset(ch), _set_entry),
}

# ---------------------------------------------------------------- namedtuples and structseqs


# tp._make(children), not tp(*children): a subclass may define __new__ with other arguments.
_NAMEDTUPLE = Kind(NODE, lambda t: (list(t), type(t)), lambda tp, ch: tp._make(ch), lambda tp, i: f".{tp._fields[i]}")


def _structseq_flatten(t: tuple[Any, ...]) -> tuple[list[Any], tuple[Any, ...]]:
    # Every field, the ones beyond the tuple part too (struct_time.tm_zone, stat_result's float times).
    reduced: Any = t.__reduce__()
    seq, extra = reduced[1]
    children = [*seq, *extra.values()]
    return children, (t, len(seq), tuple(extra), children.copy())


def _structseq_unflatten(aux: tuple[Any, ...], children: list[Any]) -> Any:
    src, n, names, before = aux
    if all(map(operator.is_, children, before)):
        return src  # nothing inside moved: the very same object, as for any other value kept
    return type(src)(children[:n], dict(zip(names, children[n:])))


def _structseq_entry(aux: tuple[Any, ...], i: int) -> str:
    src, n, names, _ = aux
    named = getattr(type(src), "__match_args__", ())  # the tuple part's field names (values, indices)
    return (f".{named[i]}" if i < len(named) else f"[{i}]") if i < n else f".{names[i - n]}"


# ---------------------------------------------------------------- mappings


# Mappings whose items are weak references: rebuilt around new tensors, they would drop them at once.
_WEAK = (weakref.WeakValueDictionary, weakref.WeakKeyDictionary)


def _mapping_flatten(m: collections.abc.Mapping[Any, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    keys = list(m)
    children = [m[k] for k in keys]
    return children, (m, keys, children.copy())


def _mapping_unflatten(aux: tuple[Any, ...], children: list[Any]) -> Any:
    """Any other mapping: ``cls(dict)`` of its moved items, as accelerate and torchtnt do; the very same object where
    nothing in it moved (``os.environ``). No copy with its items set: it could share the input's storage."""
    src, keys, before = aux
    if all(map(operator.is_, children, before)):
        return src
    try:
        return _mapping_from(type(src), keys, children)
    except TypeError:
        if all(map(_unchanged, children, before)):  # only containers rebuilt around the same leaves
            return src
        raise


def _mapping_from(tp: type, keys: list[Any], children: list[Any]) -> Any:
    try:
        return tp(dict(zip(keys, children)))
    except Exception as err:
        msg = (
            f"Cannot rebuild a {tp.__qualname__}: {tp.__qualname__}(dict) failed ({type(err).__name__}: {err}). "
            f"Register it with todevice.register(), or leave it where it is with skip_keys."
        )
        raise TypeError(msg) from err


def _mapping_deferred(aux: tuple[Any, ...], children: list[Any]) -> Any:
    """A mapping in a packed skeleton: deferred, or the very same object where nothing in it was taken (as move())."""
    src, keys, before = aux
    return src if all(map(_unchanged, children, before)) else DeferredMapping(type(src), (None, keys), children)


def _unchanged(new: Any, old: Any) -> bool:
    """Whether ``new`` is ``old``, or a container rebuilt around the very same leaves, at any depth."""
    if new is old:
        return True
    kind = kind_of(type(old))
    if type(new) is not type(old) or kind.flatten is None:
        return False
    try:
        a, b = kind.flatten(new)[0], kind.flatten(old)[0]
    except Exception:
        return False
    return len(a) == len(b) and all(map(_unchanged, a, b))


_MAPPING = Kind(NODE, _mapping_flatten, _mapping_unflatten, lambda aux, i: f"[{aux[1][i]!r}]", lambda aux: aux[1])
_MAPPING_PACKED = _MAPPING._replace(unflatten=_mapping_deferred)


# ---------------------------------------------------------------- the registry


_lock = threading.Lock()
_registry: dict[type, Kind] = {}  # the rule of each registered type
# Each type's rule, by the type's id; the type held weakly (``_refs``), so its entry goes when it dies and classes
# made per batch (a namedtuple defined in a function) die with their batch. ``_kinds`` holds ``_settled``'s rules
# (todevice.register() clears it); ``_late`` the others (torch pytree's or optree's, unknown types, plain mappings),
# which a registration or removal there, or a ``.to()`` given to the class, would change, with what they assumed.
_kinds: dict[int, Kind] = {}
_late: dict[int, tuple[Kind, tuple[Any, Any]]] = {}
_refs: dict[int, weakref.ref[type]] = {}
_generation = [0]  # bumped by every registration change


def _check_registration(cls: object, flatten: object, unflatten: object) -> None:
    if not isinstance(cls, type):
        msg = f"Cannot register {cls!r}: expected a class, got {type(cls).__qualname__}. Pass the class itself."
        raise TypeError(msg)
    for name, fn in (("flatten", flatten), ("unflatten", unflatten)):
        if not callable(fn):
            msg = f"Cannot register {cls.__qualname__}: {name} must be callable, got {type(fn).__qualname__}."
            raise TypeError(msg)


def register(cls: type, flatten: Flatten, unflatten: Unflatten, /) -> None:
    """Teach :func:`todevice.move` a container type.

    ``flatten(obj)`` returns ``(children, aux)``: the values to move and whatever else is needed to
    rebuild the object; ``unflatten(aux, children)`` builds the object back from moved children.
    This is optree's convention. The registration is todevice's own: optree and torch pytree behave as
    before for every other library. Registration is by exact type, takes precedence over every
    built-in rule (and over a registration of the same type with torch pytree or optree) and is thread-safe.

    Example:
        >>> import torch, todevice
        >>> class Pair:
        ...     def __init__(self, a, b):
        ...         self.a, self.b = a, b
        >>> todevice.register(Pair, lambda p: ((p.a, p.b), None), lambda aux, ch: Pair(*ch))
        >>> moved = todevice.move(Pair(torch.ones(1), 2), "meta")
        >>> moved.a.device, moved.b
        (device(type='meta'), 2)
        >>> todevice.unregister(Pair)

    Args:
        cls: The class to register.
        flatten: ``flatten(obj) -> (children, aux)``; may also return ``(children, aux, entries)``,
            where ``entries`` name the children in error messages.
        unflatten: ``unflatten(aux, children) -> obj``.

    Raises:
        TypeError: ``cls`` is not a class, or ``flatten``/``unflatten`` are not callable.
        ValueError: ``cls`` is already registered, or is a built-in container.

    .. versionadded:: 0.1.0
    """
    _check_registration(cls, flatten, unflatten)  # typed as objects: what a caller may pass
    if cls in _BUILTIN or cls is torch.Tensor:
        msg = (
            f"Cannot register {cls.__qualname__}: it is a built-in type that todevice already handles. "
            f"Register a subclass of it instead."
        )
        raise ValueError(msg)
    with _lock:
        if cls in _registry:
            msg = (
                f"Cannot register {cls.__qualname__}: it is already registered with todevice. "
                f"Call todevice.unregister({cls.__qualname__}) first to replace it."
            )
            raise ValueError(msg)
        _registry[cls] = _registered(cls, flatten, _registered_unflatten(unflatten))
        _forget_all()


def unregister(cls: type, /) -> None:
    """Remove a registration made with :func:`todevice.register`.

    Example:
        >>> import todevice
        >>> class Box:
        ...     pass
        >>> todevice.register(Box, lambda b: ((), None), lambda aux, ch: Box())
        >>> todevice.unregister(Box)

    Raises:
        ValueError: ``cls`` is not registered.

    .. versionadded:: 0.1.0
    """
    with _lock:
        if cls not in _registry:
            name = getattr(cls, "__qualname__", repr(cls))
            msg = f"Cannot unregister {name}: it is not registered with todevice."
            raise ValueError(msg)
        del _registry[cls]
        _forget_all()


# ---------------------------------------------------------------- classification


def _deferred_flatten(d: Deferred) -> tuple[list[Any], Deferred]:
    return d.children, d


def _deferred_unflatten(d: Deferred, children: list[Any]) -> Any:
    if d.unflatten is not None:
        return d.unflatten(d.aux, children)
    reg = _registry.get(d.cls) or _pytree_kind(d.cls)
    if reg is None:
        name = d.cls.__qualname__
        msg = (
            f"Cannot unpack a {name}: it was registered (with todevice.register(), torch pytree or optree) where "
            f"it was packed, but not here. Register {name} in this process too."
        )
        raise TypeError(msg)
    return reg.unflatten(d.aux, children)  # type: ignore[misc]


def _deferred_keys(d: Deferred) -> list[Any]:  # a registered mapping's keys, as its flatten found them when packed
    return list(d.aux[2]) if len(d.aux) > 2 else [_NO_KEY] * len(d.children)


_DEFERRED = Kind(NODE, _deferred_flatten, _deferred_unflatten, lambda d, i: _registered_entry(d.aux, i), _deferred_keys)
_DEFERRED_MAPPING = _DEFERRED._replace(
    unflatten=lambda d, ch: _mapping_from(d.cls, d.aux[1], ch), keys=lambda d: d.aux[1]
)
_OWN = types.MappingProxyType(
    {Slot: Kind(SLOT), AliasSlot: Kind(SLOT), Deferred: _DEFERRED, DeferredMapping: _DEFERRED_MAPPING}
)


def _has_to(tp: type) -> bool:
    return callable(getattr(tp, "to", None))


def _to_kind(tp: type) -> Kind:
    """The rule of an object with its own ``.to()``: the keywords of move() its ``.to()`` takes, by its signature (all
    for a C method), and ``keys`` set for a mapping (a BatchEncoding), finished as one after its ``.to()``."""
    try:
        params = inspect.signature(tp.to).parameters.values()  # type: ignore[attr-defined]
        takes = frozenset(n for n in _TO_KEYWORDS if any(p.name == n or p.kind is p.VAR_KEYWORD for p in params))
    except (TypeError, ValueError):
        takes = _TO_KEYWORDS
    return Kind(TO, keys=list if issubclass(tp, collections.abc.Mapping) else None, takes=takes)


_TO_KEYWORDS = frozenset({"non_blocking", "dtype"})


def to_takes(tp: type, name: str) -> bool:
    """Whether ``tp.to`` takes the keyword ``name`` (``"non_blocking"`` or ``"dtype"``)."""
    return name in kind_of(tp).takes


to_takes._dynamo_marked_constant = True  # type: ignore[attr-defined]  # under torch.compile, run as Python: a constant


def to_mapping(tp: type) -> bool:
    """Whether an object with its own ``.to()`` is a mapping, finished as one after its ``.to()`` (the rule's keys)."""
    return kind_of(tp).keys is not None


to_mapping._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _pytree_kind(tp: type) -> Kind | None:
    """The rule of a type registered with ``torch.utils._pytree`` (torch.export, Hugging Face's ModelOutput) or in
    optree's global namespace: moved through that flatten and unflatten, packed like a type registered here."""
    node = _pytree.SUPPORTED_NODES.get(tp)
    if node is not None:
        rebuild = node.unflatten_fn  # torch's order: (children, context)
        flatten: Any = node.flatten_fn
        with_keys = getattr(node, "flatten_with_keys_fn", None)
        if with_keys is not None and issubclass(tp, collections.abc.Mapping):  # its children's keys, as torch says
            flatten = functools.partial(_flatten_with_keys, flatten, with_keys)
        return _registered(tp, flatten, lambda aux, ch: rebuild(ch, aux[0]))
    entry: Any = _optree_entry(tp)  # optree's own convention is todevice.register()'s
    if entry is not None:
        return _registered(tp, entry.flatten_func, _registered_unflatten(entry.unflatten_func))
    return None


def _settled(tp: type) -> Kind | None:
    """The rule of ``tp`` where no registration but todevice's own can change it; else None."""
    rule = _OWN.get(tp) or _registry.get(tp) or _BUILTIN.get(tp)
    if rule is not None:
        return rule
    if issubclass(tp, torch.Tensor):
        return Kind(TENSOR)
    numpy = sys.modules.get("numpy")  # numpy scalars count, without importing numpy ourselves
    if tp in _ATOMIC_EXACT or issubclass(tp, _ATOMIC_BASES) or (numpy is not None and issubclass(tp, numpy.generic)):
        return Kind(ATOM)
    if issubclass(tp, torch.nn.Module):
        return Kind(MODULE)
    if issubclass(tp, Packed):
        return Kind(PACKED)
    if _has_to(tp):
        return _to_kind(tp)
    if issubclass(tp, tuple) and hasattr(tp, "_fields"):
        return _NAMEDTUPLE
    if issubclass(tp, tuple) and hasattr(tp, "n_sequence_fields"):  # torch.return_types, os.stat_result
        plain = getattr(tp, "n_fields", None) == tp.n_sequence_fields  # no field beyond its items
        return Kind(NODE, _structseq_flatten, _structseq_unflatten, _structseq_entry, form=STRUCTSEQ if plain else NODE)
    if _pytree_kind(tp) is not None:  # torch pytree's or optree's rule, which a removal there would change
        return None
    if dataclasses.is_dataclass(tp) or _container_base(tp) is not None or issubclass(tp, _IN_ATTRIBUTES):
        return _object_kind(tp)
    return None


def _late_rule(tp: type) -> Kind:
    """The rule of a type no rule above claims, or claimed by torch pytree or optree: one that a registration or
    removal there, or a ``.to()`` given to the class, would change, so its cached rule is checked against them
    (``kind_of``). A dataclass or a container subclass keeps the rule it was first moved with: checking each would
    cost its every move about 0.4 us on a 2-core x86 VM, a twentieth of a nested batch of 10 tensors."""
    foreign = _pytree_kind(tp)
    if foreign is not None:
        return foreign
    return _MAPPING if issubclass(tp, collections.abc.Mapping) and not issubclass(tp, _WEAK) else Kind(UNKNOWN)


def kind_of(tp: type) -> Kind:
    """The cached rule of ``tp``: from ``_kinds``, or from ``_late`` while what it was worked out under holds (what
    torch pytree and optree hold for ``tp``, and that the class has no ``.to()`` yet), else worked out now."""
    kind = _kinds.get(id(tp))
    if kind is not None:
        return kind
    late = _late.get(id(tp))
    # Functions compare by identity. The .to() lookup, which misses, costs about half a microsecond on a 2-core x86 VM:
    # only the rare rules in _late pay it.
    if late is not None and late[1] == _foreign(tp) and not _has_to(tp):
        return late[0]
    _learn(tp)
    kind = _kinds.get(id(tp))
    if kind is not None:
        return kind
    late = _late.get(id(tp))
    if late is not None:
        return late[0]
    return _settled(tp) or _late_rule(tp)  # in neither: a registration made meanwhile, not cached


# optree's registry: its global namespace's rule for a type is the entry under the type itself. A rule given, removed
# or replaced there changes the functions that entry holds, as one with torch pytree changes its NodeDef's. A dict
# lookup: optree's own getter takes its lock, 0.36 against 0.05 us on a 2-core x86 VM. An optree without that dict is
# asked through its getter.
_OPTREE_NODES: dict[Any, Any] | None = getattr(optree.registry, "_NODETYPE_REGISTRY", None)


def _optree_entry(tp: type) -> Any:
    """optree's global entry for ``tp``, or None. A function, not the dict's bound ``get``: dynamo 2.11 does not trace a
    call to a bound builtin method held in a global."""
    return optree.register_pytree_node.get(tp) if _OPTREE_NODES is None else _OPTREE_NODES.get(tp)


def _foreign(tp: type) -> tuple[Any, Any]:
    """The functions torch pytree and optree's global namespace hold for ``tp``, which a registration or removal there
    changes: never their entries, which hold ``tp`` itself and would keep a class unregistered there alive."""
    node, entry = _pytree.SUPPORTED_NODES.get(tp), _optree_entry(tp)
    return (
        None if node is None else (node.flatten_fn, node.unflatten_fn, getattr(node, "flatten_with_keys_fn", None)),
        None if entry is None else (entry.flatten_func, entry.unflatten_func),
    )


def _learn(tp: type) -> int:
    """Classify ``tp`` and cache its rule. Under torch.compile dynamo calls this as plain Python (it is marked as
    giving a constant), so it never traces the lock, and reads the rule from the cache afterwards."""
    # Classified outside the lock: issubclass() and getattr() may run a metaclass's code, which could call back into
    # todevice. Cached only where no registration happened meanwhile, which would make the answer stale.
    generation = _generation[0]
    kind, under = _settled(tp), None
    if kind is None:
        under, kind = _foreign(tp), _late_rule(tp)
    with _lock:
        if _generation[0] == generation:
            if id(tp) not in _refs:
                # The callback runs as the type is freed, before its id can name another type.
                _refs[id(tp)] = weakref.ref(tp, functools.partial(_forget, id(tp)))
            if under is None:
                _kinds[id(tp)] = kind
            else:
                _late[id(tp)] = (kind, under)
    return 0


_learn._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _forget(key: int, ref: weakref.ref[type]) -> None:
    """A classified type died: its rule goes with it (unless the cache was cleared and refilled since). No lock: it
    runs wherever the collector frees the type, maybe inside ``_learn``'s lock; no other type has its id till then."""
    if _refs.get(key) is ref:
        for cache in (_refs, _kinds, _late):
            cache.pop(key, None)


def _forget_all() -> None:  # under the lock: a registration changed, so every rule is worked out again
    _generation[0] += 1
    for cache in (_refs, _kinds, _late):
        cache.clear()


def kind_for_packing(tp: type) -> Kind:
    """``kind_of``, but a registered type or a mapping is kept as a ``Deferred`` node instead of being rebuilt."""
    kind = kind_of(tp)
    if kind is _MAPPING:
        return _MAPPING_PACKED
    if kind.entry is _registered_entry:  # the rule itself says it is registered: no second lookup to race
        unflatten = kind.unflatten
        return kind._replace(unflatten=lambda aux, children: Deferred(tp, aux, children, unflatten))
    return kind
