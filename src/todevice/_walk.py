"""The walks over a structure, by ``_tree``'s container rules: rebuilt leaf by leaf for move() and pack() (``make``:
recursive, and the same on an explicit stack for nesting deeper than Python's recursion limit), or listed by path
(``paths``: for error messages, ``strict=True`` and the diagnostics)."""

from __future__ import annotations

import collections.abc
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

import torch

from todevice import _tree

_NODE, _TENSOR, _ATOM, _SLOT = _tree.NODE, _tree.TENSOR, _tree.ATOM, _tree.SLOT
_Tensor = torch.Tensor
KindOf = Callable[[type], _tree.Kind]


class LeafError(Exception):
    """Internal: the leaf or node whose move failed, for the caller to add its path. A failure inside an object moved
    on its own (a packed batch) is that object's: the path inside it in ``inner``, the failing leaf in ``shown``."""

    def __init__(self, leaf: Any, err: BaseException, inner: str = "", shown: Any = None) -> None:
        super().__init__()
        self.leaf, self.err, self.inner, self.shown = leaf, err, inner, leaf if shown is None else shown

    def within(self, outer: Any, structure: Any, skip: frozenset[Any] = frozenset(), at: str = "") -> LeafError:
        """This failure, as one of ``outer``, whose ``structure`` (at the path ``at`` in it) holds the failing leaf."""
        inner = at + (find_path(structure, self.leaf, skip) or "") + self.inner
        return LeafError(outer, self.err, inner, self.shown)


def guarded(node: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a container's flatten or unflatten: its errors name the node's path."""
    try:
        return fn(*args)
    except RecursionError:
        raise
    except Exception as err:
        raise LeafError(node, err) from err


def _as_it_is(x: Any, s: Any) -> Any:
    return x


class Walk(NamedTuple):
    """A walk that rebuilds a structure, made by ``make``: ``walk(x, state)``, and the same on a stack."""

    walk: Callable[[Any, Any], Any]
    walk_iteratively: Callable[[Any, Any], Any]


def make(
    keep: Callable[[torch.Tensor], bool],
    tensor: Callable[[torch.Tensor, Any], Any],
    leaf: Callable[[Any, int, Any], Any],
    kind_of: KindOf,
    slot: Callable[[Any, Any], Any] | None = None,
    skip: frozenset[Any] = frozenset(),
    held: Callable[[Any, Any], Any] = _as_it_is,
) -> Walk:
    """The walk that rebuilds a structure: every container anew, each leaf through these. ``keep(t)``, called for every
    tensor (a C callable where it can be: ``attrgetter("is_cpu")``), says whether it comes back as it is; the others
    become ``tensor(t, state)``, any other leaf but an atom ``leaf(x, code, state)`` (by its ``_tree`` code), a packed
    batch's slot ``slot(x, state)``, inline like a tensor (by default ``leaf``), and a mapping's item under a key in
    ``skip`` ``held(item, state)`` (itself). ``state`` is one call's own: the functions are made once, for all calls."""
    # Closure cells, not globals: the cheapest lookups there are, in the loop that runs per leaf.
    atoms, tensor_type, slot_type = _tree.FAST_ATOMS, torch.Tensor, _tree.Slot
    if slot is None:
        slot = functools.partial(_slot_leaf, leaf)

    def walk(x: Any, s: Any) -> Any:
        tp = type(x)
        if tp is tensor_type:
            return x if keep(x) else tensor(x, s)
        # Containers handle their leaves inline: a call per leaf costs as much as all else done for a tensor kept.
        if tp is dict and not skip:
            return {
                k: (
                    (v if keep(v) else tensor(v, s))
                    if type(v) is tensor_type
                    else v
                    if type(v) in atoms
                    else slot(v, s)
                    if type(v) is slot_type
                    else walk(v, s)
                )
                for k, v in x.items()
            }
        if tp is list or tp is tuple:
            children = x
        elif tp is slot_type:
            return slot(x, s)
        elif tp in atoms:
            return x
        else:
            kind = kind_of(tp)
            code = kind.code
            if code == _TENSOR:
                return x if keep(x) else tensor(x, s)
            if code == _ATOM:
                return x
            if code != _NODE:
                return leaf(x, code, s)
            # guarded()'s rule, inline here and at the unflatten below: the two calls cost a nested batch of 10
            # tensors with a dataclass 2.8% (bench/ab_versions.py --matrix, 300 rounds, 2-core x86 VM).
            try:
                children, aux = kind.flatten(x)  # type: ignore[misc]
            except RecursionError:
                raise
            except Exception as err:
                raise LeafError(x, err) from err
            if skip and kind.keys is not None:
                done = [held(v, s) if k in skip else walk(v, s) for k, v in zip(kind.keys(aux), children)]
                return guarded(x, kind.unflatten, aux, done)  # type: ignore[arg-type]
        done = [
            (v if keep(v) else tensor(v, s))
            if type(v) is tensor_type
            else v
            if type(v) in atoms
            else slot(v, s)
            if type(v) is slot_type
            else walk(v, s)
            for v in children
        ]
        if tp is list:
            return done
        if tp is tuple:
            return tuple(done)
        try:
            return kind.unflatten(aux, done)  # type: ignore[misc]
        except RecursionError:
            raise
        except Exception as err:
            raise LeafError(x, err) from err

    def walk_iteratively(obj: Any, s: Any) -> Any:
        """The same walk with an explicit stack, for structures nested deeper than Python recursion."""
        # Frames: [node, kind, children, aux, next child index, results so far, keys of children to skip].
        stack: list[list[Any]] = []

        def enter(x: Any) -> Any:
            """Push a frame for a container and give ``_PUSHED``; a leaf comes back moved."""
            kind = kind_of(type(x))
            if kind.code != _NODE:
                return walk(x, s)  # a leaf: the walk does not recurse
            children, aux = guarded(x, kind.flatten, x)  # type: ignore[arg-type]
            keys = kind.keys(aux) if skip and kind.keys is not None else None
            stack.append([x, kind, children, aux, 0, [], keys])
            return _PUSHED

        out = enter(obj)
        while stack:
            frame = stack[-1]
            x, kind, children, aux, k, done, keys = frame
            if k < len(children):
                frame[4] = k + 1
                if keys is not None and keys[k] in skip:
                    done.append(held(children[k], s))
                elif (moved := enter(children[k])) is not _PUSHED:
                    done.append(moved)
                continue
            stack.pop()
            out = guarded(x, kind.unflatten, aux, done)
            if stack:
                stack[-1][5].append(out)
        return out

    return Walk(walk, walk_iteratively)


_PUSHED: Any = object()  # walk_iteratively's enter(): a frame was pushed, no leaf moved


class Seen:
    """The tensors a walk has met, under their address (``where``): one met again is found, and so is another over the
    same memory read the same way (``tied``: tied weights). Held, so their ids and addresses stay theirs meanwhile."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: dict[int, list[tuple[torch.Tensor, Any]]] = {}

    def find(self, t: torch.Tensor) -> tuple[torch.Tensor, Any, bool] | None:
        """(tensor met, its value with it, whether it is ``t``) for ``t``, else for the first tied to it, or None."""
        entries = self.at.get(where(t))
        if entries:
            for u, v in entries:
                if u is t:
                    return u, v, True
            for u, v in entries:
                if tied(u, t):
                    return u, v, False
        return None

    def add(self, t: torch.Tensor, value: Any) -> None:
        self.at.setdefault(where(t), []).append((t, value))


def where(t: torch.Tensor) -> int:
    """A tensor's key in ``Seen``: its address, or where it has none (meta, empty, sparse, a wrapper) ``~id``, none."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # sparse tensors and wrapper subclasses have no single storage
        ptr = 0
    return ptr if ptr else ~id(t)


def tied(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two plain tensors at one address read it the same way (dtype, device, shape, strides but of size-1
    dimensions, conj and neg bits), so one result serves both; never with grad, which it would route through both."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.requires_grad or b.requires_grad:
        return False
    if a.dtype != b.dtype or a.device != b.device or a.is_conj() != b.is_conj() or a.is_neg() != b.is_neg():
        return False
    shape = a.shape
    return shape == b.shape and all(n == 1 or x == y for n, x, y in zip(shape, a.stride(), b.stride()))


def _slot_leaf(leaf: Callable[[Any, int, Any], Any], x: Any, s: Any) -> Any:
    return leaf(x, _SLOT, s)


def refuse_cycles(x: Any, err: RecursionError, verb: str = "move", skip: frozenset[Any] = frozenset()) -> None:
    """After ``err``: ValueError if ``x`` contains itself (outside ``skip``'s items), whose walk would never end."""
    try:
        collections.deque(_nodes(x, False, skip), maxlen=0)  # no path built: linear in depth
    except CycleError as cycle:
        raise ValueError(cycle_message(cycle, verb)) from err
    except Exception:  # a container that cannot list its items: the walk that follows reports it, with its path
        pass


# ---------------------------------------------------------------- paths


def format_path(path: str) -> str:
    """A path for messages; the root object itself has the empty path."""
    return path if path else "the top level"


class CycleError(Exception):
    """Internal: raised by ``paths`` where a container contains itself."""

    def __init__(self, first: str, repeat: str, node: Any) -> None:
        super().__init__(repeat)
        self.first, self.repeat, self.node = first, repeat, node


def paths(
    obj: Any, *, revisit: bool = False, skip: frozenset[Any] = frozenset(), kind_of: KindOf = _tree.kind_of
) -> Iterator[tuple[str, Any]]:
    """Every (path, object) below ``obj``, depth first, without recursion, but items under ``skip``'s keys; one reached
    again listed once (each time with ``revisit``); one containing itself raises ``CycleError`` at the repeat. The
    containers are told by ``kind_of`` (the compiled move's, under torch.compile)."""
    return _nodes(obj, revisit, skip, "", kind_of)


Link = Any  # where a node sits: a path string, or (parent link, entry) to be joined only when one is wanted


def _joined(link: Link) -> str:
    """The path a chain of (parent link, entry) links names."""
    parts = []
    while link is not None:
        link, entry = link
        parts.append(entry)
    return "".join(reversed(parts))


def _nodes(
    obj: Any, revisit: bool, skip: frozenset[Any], root: Link = None, kind_of: KindOf = _tree.kind_of
) -> Iterator[tuple[Link, Any]]:
    """``paths``' walk with links: from a string ``root``, paths built as each node is reached (as long as it is deep);
    else (parent link, entry) links, joined only where a path is named (a cycle, or the node looked for)."""
    text = isinstance(root, str)
    name: Callable[[Link], str] = str if text else _joined
    stack: list[tuple[Link, Any, bool]] = [(root, obj, False)]
    on_path: dict[int, Link] = {}
    # Finished containers, kept alive: a flatten may build its children afresh, and a freed one's id could be reused.
    done: dict[int, Any] = {}
    while stack:
        link, node, leaving = stack.pop()
        if leaving:
            del on_path[id(node)]
            done[id(node)] = node
            continue
        yield link, node
        kind = kind_of(type(node))
        if kind.code != _NODE:
            continue
        i = id(node)
        if i in on_path:
            raise CycleError(name(on_path[i]), name(link), node)
        if i in done and not revisit:
            continue
        on_path[i] = link
        stack.append((link, node, True))
        assert kind.flatten is not None and kind.entry is not None
        try:
            children, aux = kind.flatten(node)
        except RecursionError:
            raise
        except Exception as err:  # a mapping whose keys fail, a registered flatten that raises: the same error, placed
            raise_with_message(err, f"Cannot list what {format_path(name(link))} ({describe(node)}) holds: {err}")
        keys = kind.keys(aux) if skip and kind.keys is not None else None
        for j in range(len(children) - 1, -1, -1):
            if keys is None or keys[j] not in skip:
                entry = kind.entry(aux, j)
                stack.append((link + entry if text else (link, entry), children[j], False))


def find_path(obj: Any, target: Any, skip: frozenset[Any] = frozenset()) -> str | None:
    """The first path at which ``target`` (by identity) sits inside ``obj``, outside the items skipped."""
    # Not found: a cycle, nesting too deep, or a container that cannot list what it holds (past the target if there).
    with contextlib.suppress(Exception):
        for link, node in _nodes(obj, False, skip):
            if node is target:
                return _joined(link)
    return None


class _Mismatch(Exception):
    """Internal: the batch and ``out`` differ here, as its argument says; the path grows as it leaves each container."""

    path = ""


def paired(batch: Any, out: Any, skip: frozenset[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``pairs``; two flat dicts of tensors in a C loop each."""
    return (None if skip else _flat_pairs(batch, out)) or pairs(batch, out, skip)


def _flat_pairs(batch: Any, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The sources and targets of two plain dicts with the same keys and only tensors, in a C loop each; else None."""
    if type(batch) is not dict or type(out) is not dict or len(batch) != len(out) or not batch:
        return None
    try:
        targets = [out[k] for k in batch]
    except (KeyError, TypeError):  # a key out has not, or an unhashable one: pairs() names it
        return None
    sources = list(batch.values())
    return (sources, targets) if set(map(type, sources)) == set(map(type, targets)) == {_Tensor} else None


def pairs(batch: Any, out: Any, skip: frozenset[Any] = frozenset()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors of ``batch`` and ``out`` paired by path, in walk order; ValueError naming the first that differs."""
    found: list[torch.Tensor] = []
    try:
        _pair(batch, out, found, skip)
    except _Mismatch as m:
        msg = f"Cannot copy into out: at {format_path(m.path)}, {m.args[0]} Nothing was copied."
        raise ValueError(msg) from None
    except RecursionError:
        msg = "Cannot copy into out: the batch is nested deeper than Python's recursion limit, or contains itself."
        raise ValueError(msg) from None
    except LeafError as failure:  # a container that cannot list what it holds, on either side
        explain(failure, batch, None, verb="copy into out:", also=out, skip=skip)
    return found[0::2], found[1::2]


def _pair(a: Any, b: Any, found: list[torch.Tensor], skip: frozenset[Any]) -> None:
    """``a`` paired with ``b``, a container's children by its kind's rule: a list's and a tuple's by position, any
    other's by a mapping item's key, else by path entry (``.field``, ``[2]``); under ``skip``'s keys, on either side."""
    kind = _tree.kind_of(type(a))
    code = kind.code
    if code == _tree.TENSOR:
        if not isinstance(b, torch.Tensor):
            raise _Mismatch(f"out holds {describe(b)} where the batch has a {describe(a)}.")
        found += (a, b)
        return
    if code in (_tree.TO, _tree.PACKED):
        why = "an object with its own .to()" if code == _tree.TO else "a PackedBatch (unpack it first)"
        raise _Mismatch(
            f"the batch holds {describe(a)}, {why}, whose tensors out= cannot pair with out's. "
            f"Register its type with todevice.register(), or pass skip_keys."
        )
    if code != _tree.NODE:
        if _tree.kind_of(type(b)).code in (_tree.TENSOR, _tree.NODE):  # an atom or unknown object where out holds more
            raise _Mismatch(f"out holds {describe(b)} where the batch has {describe(a)}.")
        return
    if type(b) is not type(a):
        raise _Mismatch(f"out holds a {type(b).__qualname__} where the batch has a {type(a).__qualname__}.")
    if isinstance(a, (set, frozenset)):
        raise _Mismatch("the batch holds a set, whose items have no order to pair them by.")
    assert kind.flatten is not None and kind.entry is not None
    children, aux = guarded(a, kind.flatten, a)
    theirs, their_aux = guarded(b, kind.flatten, b)
    positional = type(a) is list or type(a) is tuple
    if (positional or kind.keys is None) and len(theirs) != len(children):
        raise _Mismatch(f"out holds {len(theirs)} items where the batch has {len(children)}.")
    if not positional and not skip and kind.keys is not None:
        # The very same key objects on both sides, in the same order, and every child an item: they pair by position.
        # Equal keys that are other objects pair by ``_labels``, as a dict would find them.
        ids = list(map(id, kind.keys(aux)))
        positional = ids == list(map(id, kind.keys(their_aux))) and id(_tree._NO_KEY) not in ids
    if positional:
        matched: Any = zip(range(len(children)), children, theirs)
    else:
        mine = _labels(kind, aux, len(children), skip)
        wanted = [label for label in mine if label is not None]
        offered = {k: w for k, w in zip(_labels(kind, their_aux, len(theirs), skip), theirs) if k is not None}
        absent = [label for label in wanted if label not in offered]
        if absent or len(wanted) != len(offered):
            known = set(wanted)  # by hash, as a dict finds a key: never == between two lists
            missing, extra = [label[1] for label in absent], [label[1] for label in offered if label not in known]
            what = "the keys differ: " if any(label[0] == "key" for label in (*wanted, *offered)) else ""
            raise _Mismatch(
                f"{what}the batch has {missing} that out has not, and out has {extra} that the batch has not."
            )
        matched = ((i, children[i], offered[label]) for i, label in enumerate(mine) if label is not None)
    for i, v, w in matched:
        if type(v) is _Tensor and type(w) is _Tensor:  # the common pair, without a call
            found += (v, w)
            continue
        try:
            _pair(v, w, found, skip)
        except _Mismatch as m:
            m.path = kind.entry(aux, i) + m.path
            raise


def _labels(kind: _tree.Kind, aux: Any, n: int, skip: frozenset[Any]) -> list[tuple[str, Any] | None]:
    """What pairs each child: a mapping's item its key, anything else its path entry; None under a key in ``skip``."""
    keys = kind.keys(aux) if kind.keys is not None else (_tree._NO_KEY,) * n
    return [
        ("entry", kind.entry(aux, i)) if k is _tree._NO_KEY else None if skip and k in skip else ("key", k)  # type: ignore[misc]
        for i, k in enumerate(keys)
    ]


def cycle_message(err: CycleError, verb: str = "move") -> str:
    return (
        f"Cannot {verb} a cyclic structure: the {type(err.node).__qualname__} at {format_path(err.first)} "
        f"contains itself at {err.repeat}. todevice walks trees and shared sub-trees, not cycles; "
        f"break the cycle (or register the type with a flatten that skips the back reference)."
    )


def describe(leaf: Any) -> str:
    if isinstance(leaf, _tree.Deferred):
        return leaf.cls.__qualname__
    if isinstance(leaf, torch.Tensor):
        try:
            shape = f"of shape {tuple(leaf.shape)}"
        except RuntimeError:  # a nested tensor has no single shape
            shape = "nested"
        layout = "" if leaf.layout is torch.strided else f", {str(leaf.layout).removeprefix('torch.')}"
        held = ", wrapped by torch.func (vmap or grad)" if _tree.wrapped(leaf) else ""
        return f"{type(leaf).__qualname__} {shape}, {leaf.dtype}{layout}, on {leaf.device}{held}"
    return type(leaf).__qualname__


def raise_with_message(err: BaseException, msg: str) -> NoReturn:
    """Raise the same kind of error with ``msg``, the original as its cause; one whose constructor wants other
    arguments is raised as it is, ``msg`` added as a note where Python has notes."""
    try:
        new = type(err)(msg)
    except Exception:
        new = None
    if isinstance(new, BaseException):
        raise new from err
    if hasattr(err, "add_note"):
        err.add_note(msg)
    raise err


def explain(
    failure: LeafError,
    original: Any,
    dev: torch.device | None,
    verb: str = "move",
    also: Any = None,
    skip: frozenset[Any] = frozenset(),
) -> NoReturn:
    """Raise a leaf's error again, with the leaf's path inside ``original`` (or ``also``) in the message."""
    leaf, cause = failure.leaf, failure.err
    path = find_path(original, leaf, skip)
    if path is None and also is not None:
        path = find_path(also, leaf, skip)  # a node only the skeleton of a packed batch holds
    where = format_path((path or "") + failure.inner)
    target = f" to {dev}" if dev is not None else ""
    raise_with_message(cause, f"Cannot {verb} {where} ({describe(failure.shown)}){target}: {cause}")
