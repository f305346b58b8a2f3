"""What move() passes through as it is (an unknown object, an nn.Module, an iterator): strict=True's refusal, and the
warnings for what passing it leaves behind. Both name each object's path."""

from __future__ import annotations

import collections.abc
import contextlib
import io
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from todevice import _own_to, _tree, _walk, errors

# Iterators that yield no tensors whatever they hold: a range's, a string's, a file's lines.
_NO_TENSORS = (type(iter(range(0))), type(iter("")), type(iter(b"")), io.IOBase)


def left_behind(obj: Any, code: int, placed: Callable[[torch.Tensor], bool]) -> tuple[str, str] | None:
    """(what, why) for an object move() passes through as it is (unknown, or an nn.Module, by ``code``) that leaves
    behind what the move would have moved (``placed`` says which tensors are in place): an nn.Module's parameters and
    buffers, what an iterator yields, an unknown object's tensor attributes. None where it leaves nothing."""
    tp = type(obj)
    name = tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"
    if code == _tree.MODULE:
        try:  # a model lives on one device: its first parameter or buffer says where, in a few us however large
            first = next(itertools.chain(obj.parameters(), obj.buffers()), None)
        except Exception:  # a module whose parameters cannot be listed: nothing said of it
            return None
        if first is None or placed(first):
            return None
        why = "its .to() moves it in place, which would change the model, so its parameters and buffers were not moved"
        return f"the nn.Module {name}", f"{why}. Move it with module.to(device)"
    if isinstance(obj, collections.abc.Iterator) and not isinstance(obj, _NO_TENSORS):
        why = "walking an iterator uses it up, so what it yields was not moved. Pass a list or a tuple instead"
        return f"a {name} (an iterator)", why
    state = _own_to._state(obj)
    for attribute, value in state.items() if type(state) is dict else ():
        if isinstance(value, torch.Tensor) and not placed(value):
            why = f"the tensor in its .{attribute} (and any other it holds) was not moved. Register its type with "
            return f"a {name}", why + "todevice.register(), give it a .to() method"
    return None


def warn_left_behind(found: list[tuple[Any, tuple[str, str]]], original: Any, skip: frozenset[Any]) -> None:
    """A ``TensorsLeftBehindWarning`` for each kind of object ``left_behind`` found: where each such object is in
    ``original`` (a packed batch's skeleton looked into), the first three places and a count, found in one walk. At
    the caller's line, so Python's default filter shows it once per line and message."""
    wanted = {id(obj) for obj, _ in found}
    where: dict[int, list[str]] = {}
    with contextlib.suppress(Exception):  # a container that cannot list what it holds: the places found before it
        for link, node in _every_node(original, skip, None):
            if id(node) in wanted:
                where.setdefault(id(node), []).append(_walk.format_path(_walk._joined(link)))
    kinds: dict[tuple[str, str], list[str]] = {}
    for obj, reason in {id(obj): (obj, reason) for obj, reason in found}.values():
        kinds.setdefault(reason, []).extend(where.get(id(obj), ()))
    for (what, why), places in kinds.items():
        more = f" and {len(places) - 3} more" if len(places) > 3 else ""
        at = f" at {', '.join(places[:3])}{more}" if places else ""
        msg = f"move() passed {what}{at} through as it is: {why}, or pass strict=True to make this an error."
        warnings.warn(msg, errors.TensorsLeftBehindWarning, stacklevel=_callers_level())


def _every_node(obj: Any, skip: frozenset[Any], root: Any) -> Iterator[tuple[Any, Any]]:
    """Each (link, node) of ``obj`` at every place, a packed batch's skeleton looked into (what moves itself and holds
    one), ``root`` the link of ``obj`` itself."""
    for link, node in _walk._nodes(obj, True, skip, root):
        yield link, node
        skeleton = getattr(node, "skeleton", None) if _tree.kind_of(type(node)).code == _tree.PACKED else None
        if skeleton is not None:
            yield from _every_node(skeleton, skip, link)


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside todevice: a warning points at the caller's line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "todevice":
        frame, level = frame.f_back, level + 1
    return level


def refuse_unknown(obj: Any, skip: frozenset[Any]) -> None:
    """strict=True: raise, before anything is copied, listing every object move() does not understand."""
    found: list[str] = []
    try:
        for path, node in _walk.paths(obj, skip=skip):
            code = _tree.kind_of(type(node)).code
            if code == _tree.UNKNOWN or code == _tree.MODULE:
                hint = " (an nn.Module: move it with module.to(device))" if code == _tree.MODULE else ""
                if isinstance(node, collections.abc.Iterator):
                    hint = " (an iterator, which a walk would use up: pass a list or a tuple)"
                found.append(f"  {_walk.format_path(path)}: {type(node).__qualname__}{hint}")
    except _walk.CycleError as cycle:
        raise ValueError(_walk.cycle_message(cycle)) from None
    if not found:
        return
    listing = "\n".join(found[:20] + ([f"  ... and {len(found) - 20} more"] if len(found) > 20 else []))
    msg = (
        f"Cannot move {len(found)} object(s) with strict=True: they are not tensors, containers, objects "
        f"with .to() or atomic values:\n{listing}\n"
        f"Register their types with todevice.register(), or pass strict=False to leave them as they are."
    )
    raise TypeError(msg)
