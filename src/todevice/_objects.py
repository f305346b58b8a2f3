"""The kinds of object the walkers tell apart; the rule for dataclasses, subclasses of dict, list, tuple, deque, set
and frozenset, UserDict, UserList and ChainMap, which are moved through every instance attribute; and the rule of a
type registered with todevice, torch pytree or optree. ``_tree`` classifies types with them."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch.utils._pytree as _pytree

# Kinds of object, as the walkers see them.
TENSOR = 0  # a torch.Tensor (or subclass): moved with .to()
ATOM = 1  # a value with nothing inside to move: kept as the very same object
NODE = 2  # a container: flattened, its children moved, rebuilt
TO = 3  # an object with its own .to(): moved through it
MODULE = 4  # an nn.Module: left as it is (its .to() moves in place, mutating the input)
UNKNOWN = 5  # anything else: passed through, or reported under strict=True
SLOT = 6  # a hole in a packed structure's skeleton, filled from the packed buffer
PACKED = 7  # a packed batch (``_tree.Packed``): its buffer sent once, its skeleton filled with views of the copy

# Forms the walk under torch.compile takes a container by where dynamo cannot trace the container's own functions
# (``_traced``): numbered after the kinds above, so that one table holds both.
STRUCTSEQ = 8  # a structseq with no field beyond its items (torch.return_types): made from the list of them
ATTRIBUTES = 9  # a dataclass made by object.__new__: its instance attributes listed and set on a new one
SUBSET = 10  # a set or frozenset subclass, which dynamo cannot make (set.__new__(Sub)): moved outside the graph

Flatten = Callable[[Any], tuple[Any, Any]]
Unflatten = Callable[[Any, Any], Any]


class Kind(NamedTuple):
    """How one type is handled; cached per type."""

    code: int
    flatten: Flatten | None = None
    unflatten: Unflatten | None = None
    entry: Callable[[Any, int], str] | None = None
    keys: Callable[[Any], Sequence[Any]] | None = None  # a mapping's key of each child (``_NO_KEY`` for none)
    takes: frozenset[str] = frozenset()  # of an object with its own .to(): the keywords its .to() takes
    form: int = NODE  # how the walk under torch.compile takes a container: by these functions, or by a form above


_NO_KEY: Any = object()  # the key of a child that is not a mapping's item (a dataclass field, say)


# ---------------------------------------------------------------- dataclasses, dict and list subclasses, mappings


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not by C


def _object_kind(tp: type) -> Kind:
    """The rule of a dataclass, a subclass of dict, list, tuple (not a namedtuple), deque, set or frozenset, a UserDict,
    UserList or ChainMap. Every instance attribute is a child (fields, attributes set in ``__post_init__``, a
    ``cached_property`` value, a UserDict's ``data``, slots), then the items: no tensor reachable from the result is
    left behind. An attribute that is one of the items (an attribute-access dict) becomes the copy's copied item.
    Attributes are read and written below the class's ``__getattr__`` and ``__setattr__``; the copy never goes through
    an ``__init__``, ``__new__`` or ``__setitem__`` written in Python (a subclass's may want other arguments, a frozen
    dataclass refuses setattr). Aux: (source, attributes set directly, attributes in ``__dict__``, dict keys,
    attributes that are items). The rule never holds ``tp`` (the copy's type is the source's): the cache, which holds
    rules, lets a class made per batch die."""
    fields = tuple(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else ()
    base = _container_base(tp)
    mapping = base is not None and issubclass(base, dict)
    items_of: Any = None if base is None or mapping else base.__iter__  # type: ignore[attr-defined]  # read in C
    made_with_items = base is tuple or base is frozenset  # immutable: its items go to its __new__
    slots = tuple(dict.fromkeys(name for klass in tp.__mro__ for name in _slot_names(klass)))
    # Fields in the instance __dict__ (no slot or descriptor of the class stands in) are read and written with it.
    in_dict = not slots and not any(hasattr(type(getattr(tp, name, None)), "__set__") for name in fields)
    direct = (() if in_dict else fields) + tuple(name for name in slots if name not in fields)
    hidden = frozenset(direct)  # not read again from __dict__
    has_dict = tp.__dictoffset__ != 0
    # What makes an empty tp: the first built-in base's __new__ (dict.__new__, object.__new__), never one written in
    # Python, which may want arguments only its author knows.
    new: Any = next(klass.__new__ for klass in tp.__mro__ if not klass.__flags__ & _HEAPTYPE)
    # Under torch.compile a dataclass that object.__new__ makes, its attributes all in its __dict__, is taken by the
    # ATTRIBUTES form (dynamo cannot call object.__getattribute__): read with vars(), written with object.__setattr__.
    made_by_object: bool = tp.__new__ is object.__new__  # type: ignore[comparison-overlap]
    plain = fields and made_by_object and not hasattr(tp, "__slots__") and base is None
    form = ATTRIBUTES if plain else SUBSET if base in (set, frozenset) else NODE

    if not direct and base is None and has_dict:  # every attribute in __dict__: most dataclasses
        # The same aux and children as the general functions below, in fewer steps.
        def flatten_plain(obj: Any) -> tuple[list[Any], tuple[Any, tuple[str, ...], list[str], None, None]]:
            state = _get(obj, "__dict__")
            return list(state.values()), (obj, (), list(state), None, None)

        def unflatten_plain(aux: tuple[Any, tuple[str, ...], list[str], None, None], children: list[Any]) -> Any:
            out = new(type(aux[0]))
            _get(out, "__dict__").update(zip(aux[2], children))
            return out

        return Kind(NODE, flatten_plain, unflatten_plain, _object_entry, _object_keys, form=form)

    ordered = base is collections.OrderedDict  # its own order, which dict.keys() does not see after move_to_end()
    keys_of = collections.OrderedDict.keys if ordered else dict.keys
    values_of = collections.OrderedDict.values if ordered else dict.values

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        names: list[str] = []
        children: list[Any] = []
        for name in direct:
            try:
                value = _get(obj, name)
            except AttributeError:  # an init=False field or a slot never set stays unset
                continue
            names.append(name)
            children.append(value)
        keys, items = None, []
        if mapping:
            keys, items = list(keys_of(obj)), list(values_of(obj))
        elif items_of is not None:
            items = list(items_of(obj))
        state: Any = _get(obj, "__dict__") if has_dict else None
        in_state: list[str] = []
        mirrors: Any = None  # attributes that are items: (name, item index) pairs, or True for __dict__ is obj
        if state is obj:  # an attribute-access dict whose __dict__ is itself
            mirrors = True
        elif state:
            in_state = [k for k in state if k not in hidden] if hidden else list(state)
            if items:
                at = {id(v): i for i, v in enumerate(items)}
                mirrors = [(k, at[id(state[k])]) for k in in_state if id(state[k]) in at] or None
                if mirrors:
                    skip = {k for k, _ in mirrors}
                    in_state = [k for k in in_state if k not in skip]
            children.extend(map(state.__getitem__, in_state))
        children.extend(items)
        return children, (obj, tuple(names), in_state, keys, mirrors)

    def unflatten(aux: tuple[Any, ...], children: list[Any]) -> Any:
        src, names, in_state, keys, mirrors = aux
        n = len(names)
        m = n + len(in_state)
        out = new(type(src), children[m:]) if made_with_items else new(type(src))
        for name, value in zip(names, children):
            object.__setattr__(out, name, value)
        if in_state:
            _get(out, "__dict__").update(zip(in_state, children[n:m]))
        if base is collections.defaultdict:
            out.default_factory = src.default_factory
        if keys is not None:
            setitem = collections.OrderedDict.__setitem__ if ordered else dict.__setitem__
            for k, v in zip(keys, children[m:]):
                setitem(out, k, v)
        elif base is list:
            list.extend(out, children[m:])
        elif base is set:
            set.update(out, children[m:])
        elif base is collections.deque:
            collections.deque.__init__(out, children[m:], collections.deque.maxlen.__get__(src))
        if mirrors is True:
            object.__setattr__(out, "__dict__", out)
        elif mirrors:
            _get(out, "__dict__").update((k, children[m + i]) for k, i in mirrors)
        return out

    keys = _object_keys if items_of is None else _sequence_keys
    return Kind(NODE, flatten, unflatten, _object_entry, keys, form=form)


_get = object.__getattribute__  # an attribute as stored: no __getattr__ of the class runs


def _slot_names(klass: type) -> tuple[str, ...]:
    """The slots ``klass`` declares, under the names they are stored by (``__x`` becomes ``_Klass__x``)."""
    slots = klass.__dict__.get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    private = "_" + klass.__name__.lstrip("_")
    return tuple(
        private + name if name.startswith("__") and not name.endswith("__") else name
        for name in names
        if name not in ("__dict__", "__weakref__")
    )


def _object_entry(aux: tuple[Any, ...], i: int) -> str:
    src, names, in_state, keys, _ = aux
    attributes = (*names, *in_state)
    if i < len(attributes):
        return f".{attributes[i]}"
    i -= len(attributes)
    if keys is not None:
        return f"[{keys[i]!r}]"
    return f"{{{i}}}" if isinstance(src, (set, frozenset)) else f"[{i}]"  # a set's element by its place in iteration


def _object_keys(aux: tuple[Any, ...]) -> list[Any]:
    _, names, in_state, keys, _ = aux
    return [*(_NO_KEY,) * (len(names) + len(in_state)), *(keys or ())]


def _sequence_keys(aux: tuple[Any, ...]) -> list[Any]:
    """A list, tuple, deque or set subclass's: one key for every child, its items (none a mapping's) included."""
    src, names, in_state, _, _ = aux
    base: Any = _container_base(type(src))  # list, tuple, deque, set or frozenset: its length, read in C
    return [_NO_KEY] * (len(names) + len(in_state) + base.__len__(src))


def _container_base(tp: type) -> type | None:
    return next((base for base in _BASES if issubclass(tp, base)), None)


# A namedtuple or structseq is a tuple too: _tree tells those apart first.
_BASES = (collections.defaultdict, collections.OrderedDict, dict, list, tuple, collections.deque, set, frozenset)
# Mappings and sequences that keep their contents in instance attributes (``data``, ``maps``): moved through those,
# which keeps the inner container's own type (an OrderedDict ``data``).
_IN_ATTRIBUTES = (collections.UserDict, collections.UserList, collections.ChainMap)


# ---------------------------------------------------------------- registered types


def _registered_flatten(flatten: Flatten, mapping: bool = False) -> Flatten:
    """A registered flatten, its aux ``(aux, entries)``; of a mapping, ``(aux, entries, keys)``."""

    def run(obj: Any) -> tuple[list[Any], Any]:
        out = flatten(obj)
        return list(out[0]), (out[1], out[2] if len(out) > 2 else None)

    def run_mapping(obj: Any) -> tuple[list[Any], Any]:
        children, (aux, entries) = run(obj)
        keys = _keys_of_items(obj, children, entries, aux)
        if entries is None and all(k is not _NO_KEY for k in keys):
            entries = keys  # paths in messages name the keys: ['lengths']
        return children, (aux, entries, keys)

    return run_mapping if mapping else run


# The path entries of torch pytree's flatten_with_keys_fn: an item's key, an index, an attribute's name. Each names
# itself in a path (``['x']``, ``[0]``, ``.x``).
_TORCH_KEYS: tuple[type, ...] = (_pytree.MappingKey, _pytree.SequenceKey, _pytree.GetAttrKey)


def _keys_of_items(obj: Any, children: list[Any], entries: Any, context: Any) -> list[Any]:
    """The key of each child of a registered mapping that is one of its items, ``_NO_KEY`` for any other, so that
    ``skip_keys`` reaches inside it (a ModelOutput). Read from the registration where it says (torch's ``MappingKey``
    entries, not ``register_dataclass``'s ``GetAttrKey``; optree's entries; a context that lists the keys) and each
    key names that very child; else by identity: its values in order, or else the first item not yet taken that is
    the child (one object under two keys, taken in the mapping's order). With ``is``, never ``id()``: under
    torch.compile an ``id()`` would make dynamo guard on the objects of one batch."""
    if entries and all(type(e) is _pytree.MappingKey for e in entries):  # torch's keys for a mapping's items
        return [e.key for e in entries]
    try:
        items = list(obj.items())
    except Exception:  # a mapping that cannot list its items: none of its children is known as one
        return [_NO_KEY] * len(children)
    named: dict[Any, Any] | None = None
    for names in (entries, context):
        if isinstance(names, (list, tuple)) and len(names) == len(children):
            named = dict(items) if named is None else named
            try:
                if all(named.get(e, _NO_KEY) is c for e, c in zip(names, children)):
                    return list(names)
            except TypeError:  # a name that is no key (unhashable): not names of items
                pass
    if len(items) == len(children) and all(v is c for (_, v), c in zip(items, children)):
        return [k for k, _ in items]
    keys: list[Any] = []
    for c in children:
        at = next((i for i, (_, v) in enumerate(items) if v is c), None)
        keys.append(_NO_KEY if at is None else items.pop(at)[0])
    return keys


def _registered_unflatten(unflatten: Unflatten) -> Unflatten:
    return lambda aux, children: unflatten(aux[0], children)


def _registered_entry(aux: Any, i: int) -> str:
    entries = aux[1]
    if entries is None:
        return f"[{i}]"
    entry = entries[i]
    return str(entry) if isinstance(entry, _TORCH_KEYS) else f"[{entry!r}]"


def _keys(aux: Any) -> Any:  # a dict's or a registered mapping's aux ends with its keys
    return aux[-1]


def _registered(tp: type, flatten: Flatten, unflatten: Unflatten) -> Kind:
    """The rule of a type registered here, with torch pytree or with optree; a mapping's children have keys."""
    mapping = issubclass(tp, collections.abc.Mapping)
    return Kind(NODE, _registered_flatten(flatten, mapping), unflatten, _registered_entry, _keys if mapping else None)


def _flatten_with_keys(flatten: Any, with_keys: Any, obj: Any) -> tuple[list[Any], Any, list[Any] | None]:
    """torch pytree's ``flatten_fn``, in optree's convention: (children, context, the entry of each), the entries those
    ``flatten_with_keys_fn`` gives where it lists the very same children. Its context is never used: torch does not
    keep it equal to ``flatten_fn``'s, which ``unflatten_fn`` takes (``register_dataclass``'s is not)."""
    children, context = flatten(obj)
    pairs = with_keys(obj)[0]
    named = len(pairs) == len(children) and all(c is d for (_, c), d in zip(pairs, children))
    return children, context, [entry for entry, _ in pairs] if named else None
