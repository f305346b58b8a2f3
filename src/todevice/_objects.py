"""The kinds of object the walkers tell apart, and the rule for dataclasses, dict and list subclasses, UserDict,
UserList and ChainMap, which are moved through every instance attribute. ``_tree`` classifies types with them."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

# Kinds of object, as the walkers see them.
TENSOR = 0  # a torch.Tensor (or subclass): moved with .to()
ATOM = 1  # a value with nothing inside to move: kept as the very same object
NODE = 2  # a container: flattened, its children moved, rebuilt
TO = 3  # an object with its own .to(): moved through it
MODULE = 4  # an nn.Module: left as it is (its .to() moves in place, mutating the input)
UNKNOWN = 5  # anything else: passed through, or reported under strict=True
SLOT = 6  # a hole in a packed structure's skeleton, filled from the packed buffer
OWN = 7  # an object that tells the walk how it is moved, through its ``_todevice_move_`` (PackedBatch)

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


_NO_KEY: Any = object()  # the key of a child that is not a mapping's item (a dataclass field, say)


# ---------------------------------------------------------------- dataclasses, dict and list subclasses, mappings


def _bare_new(tp: type) -> Callable[[type], Any]:
    """What makes an empty ``tp`` (called with ``tp``) without running a ``__new__`` or ``__init__`` written in Python.

    The first built-in base's ``__new__`` (``dict.__new__``, ``object.__new__``): a subclass's own
    ``__new__`` may want arguments that only its author knows.
    """
    for klass in tp.__mro__:
        if not klass.__flags__ & _HEAPTYPE:
            return klass.__new__  # type: ignore[return-value]
    return object.__new__  # pragma: no cover (object is never a heap type)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not by C


def _object_kind(tp: type) -> Kind:
    """The rule of a dataclass, a dict or list subclass, a UserDict, UserList or ChainMap: worked out once per type.

    Every instance attribute is a child, moved like the fields: dataclass fields, other attributes
    (set in ``__post_init__``, a ``functools.cached_property`` value, a UserDict's ``data``) and slots,
    then the items. So no tensor reachable from the result is left behind. An attribute that is one
    of the items (an attribute-access dict keeps each item as an attribute too) is not walked again:
    the copy's attribute is its copied item. Attributes are read and written below any
    ``__getattr__`` or ``__setattr__`` of the class. The copy is never passed through ``__init__``,
    ``__new__`` or ``__setitem__`` written in Python: the constructor of a subclass may want other
    arguments, and frozen dataclasses refuse setattr. Its aux data is (source, attributes set
    directly, attributes in ``__dict__``, dict keys, attributes that are items). The copy's type is the source's:
    the rule never holds ``tp``, so that the cache, which holds rules, lets a class made per batch die.
    """
    fields = tuple(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else ()
    base = _container_base(tp)
    mapping = base is not None and issubclass(base, dict)
    slots = tuple(dict.fromkeys(name for klass in tp.__mro__ for name in _slot_names(klass)))
    # Fields that live in the instance __dict__ (no slot or descriptor of the class stands in for
    # them) are read and written with it, in one call each.
    in_dict = not slots and not any(hasattr(type(getattr(tp, name, None)), "__set__") for name in fields)
    direct = (() if in_dict else fields) + tuple(name for name in slots if name not in fields)
    hidden = frozenset(direct)  # not read again from __dict__
    has_dict = tp.__dictoffset__ != 0
    new = _bare_new(tp)

    if not direct and base is None and has_dict:  # every attribute in __dict__: most dataclasses
        # The same aux and children as the general functions below, in fewer steps.
        def flatten_plain(obj: Any) -> tuple[list[Any], tuple[Any, tuple[str, ...], list[str], None, None]]:
            state = _get(obj, "__dict__")
            return list(state.values()), (obj, (), list(state), None, None)

        def unflatten_plain(aux: tuple[Any, tuple[str, ...], list[str], None, None], children: list[Any]) -> Any:
            out = new(type(aux[0]))
            _get(out, "__dict__").update(zip(aux[2], children))
            return out

        return Kind(NODE, flatten_plain, unflatten_plain, _object_entry, _object_keys)

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
        keys: list[Any] | None = None
        items: list[Any] = []
        if mapping:
            keys = list(keys_of(obj))
            items = list(values_of(obj))
        elif base is list:
            items = list(list.__iter__(obj))
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
        out = new(type(src))
        n = len(names)
        for name, value in zip(names, children):
            object.__setattr__(out, name, value)
        m = n + len(in_state)
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
        if mirrors is True:
            object.__setattr__(out, "__dict__", out)
        elif mirrors:
            _get(out, "__dict__").update((k, children[m + i]) for k, i in mirrors)
        return out

    return Kind(NODE, flatten, unflatten, _object_entry, _list_keys if base is list else _object_keys)


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
    _, names, in_state, keys, _ = aux
    n = len(names)
    if i < n:
        return f".{names[i]}"
    if i < n + len(in_state):
        return f".{in_state[i - n]}"
    i -= n + len(in_state)
    return f"[{keys[i]!r}]" if keys is not None else f"[{i}]"


def _object_keys(aux: tuple[Any, ...]) -> list[Any]:
    _, names, in_state, keys, _ = aux
    return [*(_NO_KEY,) * (len(names) + len(in_state)), *(keys or ())]


def _list_keys(aux: tuple[Any, ...]) -> list[Any]:
    """A list subclass's: one key for every child, its items (none of them a mapping's item) included."""
    src, names, in_state, _, _ = aux
    return [_NO_KEY] * (len(names) + len(in_state) + list.__len__(src))


def _container_base(tp: type) -> type | None:
    for base in _BASES:
        if issubclass(tp, base):
            return base
    return None


_BASES = (collections.defaultdict, collections.OrderedDict, dict, list)
# Mappings and sequences that keep their contents in instance attributes (``data``, ``maps``): moved
# through those attributes, which keeps the inner container's own type (an OrderedDict ``data``).
_IN_ATTRIBUTES = (collections.UserDict, collections.UserList, collections.ChainMap)
