"""Objects with their own ``.to()``: moved by it on a shallow copy (several popular ones move their contents in place
and return self), a mapping's items finished as move()'s walk would, and a guess at what one holds, to find its
tensors."""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from todevice import _stream, _tree
from todevice._options import cast_to, casts
from todevice._walk import CycleError, KindOf, LeafError, paths


def inside(obj: Any) -> Iterator[tuple[str, Any]]:
    """What an object with its own ``.to()`` holds: a guess, to find its tensors, never to move them."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        yield from ((f".{name}", value) for name, value in zip(obj._fields, obj))
    elif isinstance(obj, collections.abc.Mapping):
        yield from ((f"[{key!r}]", value) for key, value in obj.items())
    else:
        yield from ((f".{name}", value) for name, value in getattr(obj, "__dict__", {}).items())


# Types whose .to() is known to return a new object and leave the original alone; any other .to() object is copied
# first: several popular ones (a tokenizer's BatchEncoding, PyG's Data) move their contents in place and return self.
_PURE_TO: frozenset[type] = frozenset({torch.nn.utils.rnn.PackedSequence})
_PLAIN_CONTAINERS = (dict, list)
_JUST_TENSORS = frozenset({torch.Tensor})


def copy_for_to(obj: Any) -> Any:
    """What ``obj``'s own ``.to()`` is called on: a copy, so that one that works in place leaves ``obj`` alone. Where
    the class has no ``__copy__`` (whose copy is its word), the plain dicts and lists its attributes hold are copied
    too, at any depth, for a ``.to()`` that writes ``self.data[k] = ...``; all else is shared. One ``copy.copy``
    cannot copy (it raises, or recurses without end near the top of the stack) is returned as it is."""
    tp = type(obj)
    if tp in _PURE_TO:
        return obj
    try:
        target = copy.copy(obj)
        if target is obj:  # a singleton, or a class whose __reduce__ names a global: no copy to work on
            return obj
    except RecursionError:
        if sum(1 for _ in traceback.walk_stack(sys._getframe())) > sys.getrecursionlimit() // 2:
            raise  # deep nesting: the walk falls back to one with a stack, which calls this again near its top
        return obj  # a copy whose __getattr__ reads an attribute the copy lacks: not copyable, as below
    except Exception:
        return obj  # not copyable: its own .to() is all there is
    if getattr(tp, "__copy__", None) is not None:
        return target  # its class's own copy (a BatchEncoding's, a UserDict's): its word
    state = _state(target)
    if type(state) is not dict:
        return target
    if state is _state(obj):  # a __setstate__ that adopted the input's own dict: the copy gets one of its own
        state = state.copy()
        try:
            object.__setattr__(target, "__dict__", state)
        except Exception:  # it cannot have one: a .to() that writes attributes would write the input's
            msg = (
                f"a copy of it shares its __dict__ and cannot be given one of its own, so a .to() that works in "
                f"place would move the input too. Give {tp.__qualname__} a __copy__, or register it with "
                f"todevice.register()."
            )
            raise LeafError(obj, TypeError(msg)) from None
    _copy_plain_containers(state)
    return target


def _state(obj: Any) -> Any:
    """``obj.__dict__`` as stored (no ``__getattr__`` of the class runs), or None."""
    if torch.compiler.is_dynamo_compiling():  # dynamo reads it as the class does, and cannot call the slot itself
        return obj.__dict__ if type(obj).__dictoffset__ else None  # dynamo 2.11 raises where getattr has a default
    try:
        return object.__getattribute__(obj, "__dict__")
    except Exception:  # slots only, or a __dict__ property that raises (a proxy's)
        return None


def _copy_plain_containers(state: dict[str, Any]) -> None:
    """Replace, in place, every plain dict and list under ``state`` by a copy, at any depth, without recursion; one
    reached twice is copied once, so the copies share as the originals did."""
    copies: dict[int, Any] = {}
    todo: list[Any] = [state]  # containers already copied (or ``state``), whose items are still the originals
    while todo:
        node = todo.pop()
        for key, value in node.items() if type(node) is not list else enumerate(node):
            if type(value) in _PLAIN_CONTAINERS:
                new = copies.get(id(value))
                if new is None:
                    new = copies[id(value)] = value.copy()
                    todo.append(new)
                node[key] = new


def rest_of_mapping(
    obj: Any,
    out: Any,
    skip: frozenset[Any],
    move_item: Callable[[Any], Any],
    once: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dev: torch.device,
    dtype: torch.dtype | None,
) -> Any:
    """``out``, a mapping its own ``.to()`` moved (a BatchEncoding's moves only what has a ``.to()``), finished as
    move()'s walk would: a container item by ``move_item``; a tensor its ``.to()`` copied as move() would (to ``dev``,
    cast as move() casts) given to ``once(source, copy)``, which answers with the move's one copy of it (a tensor held
    twice stays one); one left or copied otherwise kept, never standing for the source; an item under ``skip`` put back
    as ``obj`` holds it. Written with ``out[key] = ...``: an item ``out`` refuses stays, an immutable ``out`` too."""
    items = _items(out)
    if items is out and not isinstance(out, collections.abc.MutableMapping):
        return out
    get = _items(obj).get
    changes = []
    for key, value in items.items():
        if isinstance(value, torch.Tensor) and key not in skip:
            before = get(key)
            if isinstance(before, torch.Tensor) and _as_moved(before, value, dev, dtype):
                kept = once(before, value)
                if kept is not value:
                    changes.append((key, kept))
    if skip or not set(map(type, items.values())) <= _JUST_TENSORS:  # else every item a tensor, which it moved
        for key, value in list(items.items()):  # a snapshot: moving an item runs other code
            before = get(key, _ABSENT)
            if key in skip:
                if before is not _ABSENT and value is not before:
                    changes.append((key, before))
            elif not isinstance(value, torch.Tensor):
                try:
                    new = move_item(value)
                except LeafError as failure:
                    raise failure.within(obj, value, at=f"[{key!r}]") from failure.err
                if new is not value:
                    changes.append((key, new))
    for key, value in changes:
        try:  # not contextlib.suppress: dynamo traces this function
            out[key] = value
        except Exception:  # a mapping that validates what it is given: that item stays as its .to() left it
            continue
    return out


_ABSENT: Any = object()


def _items(m: Any) -> Any:
    """A mapping's items: a UserDict's (a BatchEncoding's) plain dict, read in C rather than through its methods."""
    return m.data if collections.UserDict in type(m).__mro__ and type(m.data) is dict else m


def _as_moved(t: torch.Tensor, out: torch.Tensor, dev: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether ``out`` is ``t`` copied as move() does: on ``dev`` (any index where it names none, as under
    torch.compile), cast to ``dtype`` as move() casts."""
    if out is t or out.dtype is not cast_to(t.dtype, dtype):  # dtypes are singletons
        return False
    on = out.device
    return on == dev or (on.type == dev.type and dev.index is None)


def to_keywords(
    obj: Any, non_blocking: bool, dtype: torch.dtype | None, kind_of: KindOf = _tree.kind_of
) -> dict[str, Any]:
    """What move() passes ``obj``'s own ``.to()`` beside the device, eager and compiled: ``non_blocking`` where it takes
    it; then ``dtype`` where ``obj`` holds floating or complex tensors (``inside``), as ``nn.Module.to`` casts (a
    TypeError where its ``.to()`` takes none, rather than leave them uncast), and else not, so its integer tensors
    keep their dtype whatever its ``.to()`` would do."""
    tp = type(obj)
    named: dict[str, Any] = {"non_blocking": non_blocking} if _tree.to_takes(tp, "non_blocking") else {}
    if dtype is not None and _holds_floating(obj, kind_of):
        if not _tree.to_takes(tp, "dtype"):
            msg = (
                f"its .to() takes no dtype, and it holds floating-point tensors that dtype={dtype} would cast. "
                f"Cast them yourself, or move it without dtype= (skip_keys can leave it out)."
            )
            raise TypeError(msg)
        named["dtype"] = dtype
    return named


def to_object(obj: Any, dev: torch.device, non_blocking: bool, dtype: torch.dtype | None = None) -> Any:
    """``obj`` moved by its own ``.to()``, on a copy (``copy_for_to``), with ``to_keywords``; raises ``LeafError``."""
    try:
        named = to_keywords(obj, non_blocking, dtype)
    except TypeError as err:
        raise LeafError(obj, err) from None
    target = copy_for_to(obj)
    try:
        return moved_by_to(target, dev, named)
    except RecursionError:
        raise
    except Exception as err:
        raise LeafError(obj, err) from err


def moved_by_to(target: Any, dev: torch.device, named: dict[str, Any]) -> Any:
    """``target.to(dev, **named)``, again without ``non_blocking`` where the call refuses it (a ``.to()`` whose
    signature takes any keyword and passes them on); ``target`` itself where ``.to()`` moves it in place and returns
    nothing."""
    try:
        out = target.to(dev, **named)
    except TypeError as err:
        if "non_blocking" not in named or "non_blocking" not in str(err):
            raise
        out = target.to(dev, **{k: v for k, v in named.items() if k != "non_blocking"})
    return target if out is None else out


def _holds_floating(obj: Any, kind_of: KindOf) -> bool:
    try:
        tensors = paths([v for _, v in inside(obj)], kind_of=kind_of)
        return any(isinstance(node, torch.Tensor) and casts(node) for _, node in tensors)
    except Exception:  # a cycle, or a container that cannot list its items: say it may, and let .to() decide
        return True


def devices_inside(obj: Any, depth: int = 3) -> set[torch.device]:
    """The accelerators an object with ``.to()`` holds memory on (``inside``, a few levels deep); none seen, those with
    a context: never every device, since synchronizing one creates a CUDA context there (about 0.5 GiB)."""
    found: set[torch.device] = set()

    def look(x: Any, depth: int) -> None:
        with contextlib.suppress(CycleError):
            for _, node in paths([value for _, value in inside(x)]):
                if isinstance(node, torch.Tensor):
                    if not (node.is_cpu or node.is_meta):
                        found.add(node.device)
                elif depth and _tree.kind_of(type(node)).code in (_tree.UNKNOWN, _tree.TO):
                    look(node, depth - 1)

    look(obj, depth)
    return found or set(_stream.devices_in_use())
