"""move(): the walk over a structure and the copy of each tensor."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
from torch.nn.utils.rnn import PackedSequence

from todevice import _pack, _stream, _tree
from todevice._stream import DeviceLike

T = TypeVar("T")

_Tensor = torch.Tensor

_FAST_ATOMS = _tree.FAST_ATOMS

# Types whose .to() is known to return a new object and leave the original alone; any other
# .to() object is shallow-copied first, because several popular ones (tokenizer BatchEncoding,
# PyG Data) move their contents in place and return self, which would mutate the input.
_PURE_TO: frozenset[type] = frozenset({PackedSequence})

_takes_non_blocking: dict[type, bool] = {}


def _accepts_non_blocking(tp: type) -> bool:
    known = _takes_non_blocking.get(tp)
    if known is None:
        try:
            params = inspect.signature(tp.to).parameters.values()  # type: ignore[attr-defined]
            known = any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in params)
        except (TypeError, ValueError):  # no signature (a C method): try it and see
            known = True
        _takes_non_blocking[tp] = known
    return known


class _LeafError(Exception):
    """Internal: carries the leaf whose move failed up to move(), which adds the path."""

    def __init__(self, leaf: Any, err: BaseException) -> None:
        super().__init__()
        self.leaf = leaf
        self.err = err


def _guarded(node: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a registered flatten or unflatten: its errors name the node's path."""
    try:
        return fn(*args)
    except RecursionError:
        raise
    except Exception as err:
        raise _LeafError(node, err) from err


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        try:
            shape = f"of shape {tuple(leaf.shape)}"
        except RuntimeError:  # a nested tensor has no single shape
            shape = "nested"
        return f"{type(leaf).__qualname__} {shape}, {leaf.dtype}, on {leaf.device}"
    return type(leaf).__qualname__


def _raise_with_path(err: BaseException, msg: str) -> NoReturn:
    """Raise the same kind of error with ``msg`` (which names the path), the original as its cause.

    An exception type whose constructor wants other arguments is raised as it is, ``msg`` added as
    a note where Python has notes.
    """
    try:
        new = type(err)(msg)
    except Exception:
        new = None
    if isinstance(new, BaseException):
        raise new from err
    if hasattr(err, "add_note"):
        err.add_note(msg)
    raise err


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        msg = (
            f"Cannot cast to dtype={dtype!r}: move() casts floating-point and complex tensors only, as "
            f"nn.Module.to() does, so dtype must be a floating-point or complex torch.dtype such as "
            f"torch.float16. Cast integer tensors yourself with tensor.to(dtype)."
        )
        raise TypeError(msg)
    return dtype


# The walk, generated once per kind of "already in place" test and compiled.  The test runs inline
# for every leaf of every dict, list and tuple: a function call per leaf costs as much as the rest
# of the work on a leaf that stays where it is, and `t.is_cpu` is a third cheaper than
# `t.device == dev`, so the test is written into the loop rather than called.
_WALK_SOURCE = """
def factory(copy, to_object, other, dev, dtype, kind_of, atoms, _Tensor, _tree, views, slot, guarded):
    NODE, TENSOR, ATOM, TO, SLOT = _tree.NODE, _tree.TENSOR, _tree.ATOM, _tree.TO, _tree.SLOT
    Slot = _tree.Slot

    def tensor(v):
        return v if {here} else copy(v)

    def walk(x):
        tp = type(x)
        if tp is _Tensor:
            return tensor(x)
        if tp in atoms:
            return x
        # Containers are not memoised: a container reached twice is rebuilt twice, as by every
        # hand-written helper. Remembering each one cost a quarter of the whole walk (measured).
        if tp is dict:
            out = {{k: {leaf} for k, v in x.items()}}
        elif tp is list:
            out = [{leaf} for v in x]
        elif tp is tuple:
            out = tuple([{leaf} for v in x])
        else:
            kind = kind_of(tp)
            code = kind.code
            if code == NODE:
                children, aux = guarded(x, kind.flatten, x)
                out = guarded(x, kind.unflatten, aux, [walk(c) for c in children])
            elif code == TENSOR:
                return tensor(x)
            elif code == TO:
                return to_object(x)
            elif code == ATOM:
                return x
            elif code == SLOT:
                return slot(x)
            else:
                return other(x, code)
        return out

    return walk, tensor
"""

# One leaf of a dict, list or tuple, inline: a tensor in place costs no call at all. Unpacking a
# skeleton fills its slots inline as well.
_LEAF_SOURCE = "((v if {here} else copy(v)) if type(v) is _Tensor else ({slot}(v if type(v) in atoms else walk(v))))"
_SLOT_SOURCE = "views[v] if type(v) is Slot else "

_factories: dict[tuple[str, bool], Callable[..., Any]] = {}


def _in_place_test(dev: torch.device, dtype: torch.dtype | None) -> str:
    """The inline test that a tensor leaf ``v`` needs no move to ``dev`` (with ``dtype``)."""
    # For a meta target the test is skipped: .to() returns a tensor already on meta unchanged, and
    # nearly every leaf sent to meta is a copy, for which the test would be pure cost.
    where = {"cpu": "v.is_cpu", "meta": "False"}.get(dev.type, "v.device == dev")
    if dtype is None:
        return where
    return f"{where} and (v.dtype == dtype or not (v.is_floating_point() or v.is_complex()))"


def _walker_factory(here: str, slots: bool = False) -> Callable[..., Any]:
    """The walk compiled with ``here`` as its in-place test, filling slots inline when ``slots``."""
    factory = _factories.get((here, slots))
    if factory is None:
        leaf = _LEAF_SOURCE.format(here=here, slot=_SLOT_SOURCE if slots else "")
        source = _WALK_SOURCE.format(here=here, leaf=leaf)
        namespace: dict[str, Any] = {}
        exec(compile(source, f"<todevice walk: {here}>", "exec"), namespace)
        factory = _factories[here, slots] = namespace["factory"]
    return factory


def _skeleton_walker(take: Callable[[torch.Tensor], Any]) -> Callable[[Any], Any]:
    """A walk that hands every tensor to ``take`` and keeps everything else, for ``pack``."""
    keep: Callable[..., Any] = lambda x, *_: x  # noqa: E731
    factory = _walker_factory("False")
    kind_of = _tree.kind_for_packing
    args: tuple[Any, ...] = (keep, keep, None, None, kind_of, _FAST_ATOMS, _Tensor, _tree, None, keep, _guarded)
    walk, _ = factory(take, *args)
    return walk  # type: ignore[no-any-return]


# move() of a batch that optree took apart: the tensor leaves in one list, tested and moved in one
# comprehension each, with the same inline "already in place" test as the walk.
_FLAT_SOURCE = """
def factory(to, dev, dtype):
    def in_place(found):
        for v in found:
            if not ({here}):
                return False
        return True

    def moved(found):
        return [v if {here} else {call} for v in found]

    return in_place, moved
"""

_flat_factories: dict[tuple[str, str], Callable[..., Any]] = {}


def _flat_factory(here: str, call: str) -> Callable[..., Any]:
    factory = _flat_factories.get((here, call))
    if factory is None:
        namespace: dict[str, Any] = {}
        source = _FLAT_SOURCE.format(here=here, call=call)
        exec(compile(source, f"<todevice flat move: {here}>", "exec"), namespace)
        factory = _flat_factories[here, call] = namespace["factory"]
    return factory


class _Mover:
    """One call's state: the target, the options and the memo of what was moved already."""

    def __init__(
        self,
        dev: torch.device,
        non_blocking: bool,
        dtype: torch.dtype | None,
        strict: bool,
        views: list[torch.Tensor] | None = None,
    ) -> None:
        self.dev = dev
        self.views = views  # the packed tensors, when the walk fills a skeleton's slots
        self.non_blocking = non_blocking
        self.dtype = dtype
        self.strict = strict
        # id(source) -> (source, result): keeps aliasing, and keeps sources alive so ids stay unique.
        self.memo: dict[int, tuple[Any, Any]] = {}
        # data_ptr -> (source, result), or a list of them once several tensors share the address:
        # aliasing, and distinct tensors over the same memory. Tensors at address 0 use ``memo``.
        self.by_ptr: dict[int, Any] = {}
        self.unknown: list[Any] = []
        self.wait_for: set[torch.device] = set()  # accelerators to sync before returning host tensors
        self.wait_for_objects = False
        self.to_host = dev.type == "cpu" and non_blocking
        self.mps = dev.type == "mps"
        self.buffers: list[torch.Tensor] = []  # coalesced copies on the target, which views point into
        # (user's stream, side stream): .to() objects are moved on the user's stream, since the
        # tensors they make cannot be found to be recorded on it.
        self.object_streams: tuple[torch.Stream, torch.Stream] | None = None
        self.flat_outputs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (sources, results)
        self.in_place: Callable[[list[torch.Tensor]], bool]
        self.moved: Callable[[list[torch.Tensor]], list[torch.Tensor]]
        self.walk, self.tensor = self._build()

    def _build(self) -> tuple[Callable[[Any], Any], Callable[[torch.Tensor], torch.Tensor]]:
        """The walk as closures: locals are the cheapest lookups Python has, and this is the hot loop."""
        memo, by_ptr, dev, dtype = self.memo, self.by_ptr, self.dev, self.dtype
        non_blocking, mps, to_host, wait_for = self.non_blocking, self.mps, self.to_host, self.wait_for
        # .to(dev) parses fastest; non_blocking means nothing for a meta target.
        plain_to = dtype is None and (not non_blocking or dev.type == "meta")

        def to(t: torch.Tensor) -> torch.Tensor:
            try:
                if plain_to:
                    plain: torch.Tensor = t.to(dev)
                    return plain
                cast = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
                nb = non_blocking
                if mps and nb and not t.is_pinned():
                    nb = False  # pageable-to-MPS async copies can return zeros (pytorch#83015)
                out = t.to(dev, cast, non_blocking=nb)
            except RecursionError:
                raise  # deep nesting: move() falls back to a walk with a stack
            except Exception as err:
                raise _LeafError(t, err) from err
            if to_host:
                src_dev = t.device
                if src_dev.type not in _stream.HOST_TYPES:
                    wait_for.add(src_dev)
            return out

        def copy(t: torch.Tensor) -> torch.Tensor:
            """Move a tensor that is not in place, once, keeping aliasing and shared memory."""
            try:
                ptr = t.data_ptr()
            except RuntimeError:  # sparse tensors and wrapper subclasses have no single storage
                ptr = 0
            if ptr:  # 0: meta and empty tensors own no memory
                hit = by_ptr.get(ptr)
                if hit is None:  # the common case: the first tensor at this address
                    if plain_to:  # to(t), inlined: this runs once per tensor moved
                        try:
                            out = t.to(dev)
                        except RecursionError:
                            raise
                        except Exception as err:
                            raise _LeafError(t, err) from err
                    else:
                        out = to(t)
                    by_ptr[ptr] = (t, out)
                    return out
                # Rare from here on: another tensor over this address was moved already. The
                # entry becomes a list of every (source, result) pair at the address.
                entries: list[tuple[torch.Tensor, torch.Tensor]] = [hit] if type(hit) is tuple else hit
                by_ptr[ptr] = entries
                for src, done in entries:  # the same tensor again, wherever it is in the list
                    if src is t:
                        return done
                for src, done in entries:
                    # Distinct tensors over exactly the same memory (tied weights in a state_dict)
                    # come out sharing memory too. Not for tensors requiring grad: a shared view
                    # would route the gradient through the wrong source.
                    if (
                        done is not src  # src stayed where it was: so does t, through to() below
                        and type(t) is _Tensor
                        and type(src) is _Tensor
                        and _pack.same_view(src, t)
                    ):
                        out = done.view(done.shape)
                        entries.append((t, out))
                        return out
                out = to(t)
                entries.append((t, out))
                return out
            seen = memo.get(id(t))
            if seen is not None:
                prior: torch.Tensor = seen[1]
                return prior
            out = to(t)
            memo[id(t)] = (t, out)
            return out

        here = _in_place_test(dev, dtype)
        self.in_place, self.moved = _flat_factory(here, "v.to(dev)" if plain_to else "to(v)")(to, dev, dtype)
        factory = _walker_factory(here, self.views is not None)
        walk, tensor = factory(
            copy,
            self.to_object,
            self.other,
            dev,
            dtype,
            _tree.kind_of,
            _FAST_ATOMS,
            _Tensor,
            _tree,
            self.views,
            self.slot,
            _guarded,
        )
        return walk, tensor

    def to_object(self, obj: Any) -> Any:
        hit = self.memo.get(id(obj))
        if hit is not None:
            return hit[1]
        tp = type(obj)
        non_blocking = self.non_blocking and not self.mps
        try:
            target = obj if tp in _PURE_TO else copy.copy(obj)
        except RecursionError:
            raise  # deep nesting: move() falls back to a walk with a stack
        except Exception:
            target = obj  # not copyable: its own .to() is all there is
        streams = self.object_streams
        if streams is not None:
            _stream.set_stream(streams[0])
        try:
            if _accepts_non_blocking(tp):
                try:
                    out = target.to(self.dev, non_blocking=non_blocking)
                except TypeError as err:
                    if "non_blocking" not in str(err):
                        raise
                    _takes_non_blocking[tp] = False
                    out = target.to(self.dev)
            else:
                out = target.to(self.dev)
        except RecursionError:
            raise
        except Exception as err:
            raise _LeafError(obj, err) from err
        finally:
            if streams is not None:
                _stream.set_stream(streams[1])
        if self.to_host:
            self.wait_for_objects = True
        self.memo[id(obj)] = (obj, out)
        return out

    def outputs(self) -> list[torch.Tensor]:
        """Every tensor this move made: the coalesced buffers and each tensor copied on its own."""
        outs = list(self.buffers)
        for entry in self.by_ptr.values():
            for src, out in [entry] if type(entry) is tuple else entry:
                if out is not src:
                    outs.append(out)
        outs.extend(out for src, out in self.memo.values() if isinstance(out, torch.Tensor) and out is not src)
        for sources, results in self.flat_outputs:
            outs.extend(out for src, out in zip(sources, results) if out is not src)
        return list({id(out): out for out in outs}.values())  # once each, whatever recorded it

    def other(self, obj: Any, code: int) -> Any:
        if type(obj) is _pack.PackedBatch:
            return self.packed(obj)
        if self.strict and code in (_tree.UNKNOWN, _tree.MODULE):
            self.unknown.append(obj)
        return obj

    def packed(self, batch: _pack.PackedBatch) -> Any:
        """A PackedBatch met inside a structure: unpacked onto the target, once."""
        hit = self.memo.get(id(batch))
        if hit is not None:
            return hit[1]
        out, inner = _unpack(batch, self.dev, self.non_blocking, self.dtype)
        self.buffers.extend(inner.outputs())  # recorded on the user's stream with the rest
        self.wait_for |= inner.wait_for
        self.memo[id(batch)] = (batch, out)
        return out

    def slot(self, s: Any) -> Any:
        """A skeleton's slot: the packed tensor, a new view of it for a distinct tensor over its
        memory, a registered container rebuilt around its moved children, or a whole flat skeleton."""
        if self.views is None:
            msg = f"Cannot move {s!r}: a slot only means something inside a PackedBatch's skeleton."
            raise TypeError(msg)
        if type(s) is _tree.Slot:
            return self.views[s]
        hit = self.memo.get(id(s))
        if hit is not None:
            return hit[1]
        if type(s) is _tree.Flat:
            # optree rebuilds the containers around the filled leaves, in C++.
            if s.order is not None:
                out = s.spec.unflatten(_pack.pick(self.views + s.leaves, s.order))
            else:
                out = s.spec.unflatten(self.walk(s.leaves))
        elif type(s) is _tree.AliasSlot:
            view = self.views[s]
            out = view.view(view.shape)
        else:
            kind = _tree.kind_of(s.cls)
            if kind.code != _tree.NODE or s.cls not in _tree._registry:
                name = s.cls.__qualname__
                msg = (
                    f"Cannot unpack a {name}: it was registered with todevice.register() where it was packed, "
                    f"but not here. Register {name} in this process too."
                )
                raise TypeError(msg)
            assert kind.unflatten is not None
            out = _guarded(s, kind.unflatten, s.aux, [self.walk(c) for c in s.children])
        self.memo[id(s)] = (s, out)
        return out

    # ------------------------------------------------------------ the walk

    def walk_iteratively(self, obj: Any) -> Any:
        """The same walk with an explicit stack, for structures nested deeper than Python recursion."""
        walk_leaf = self.walk  # used on leaves only, so it never recurses
        memo = self.memo
        result: list[Any] = []
        # Frames: (node, kind, children, aux, next child index, results so far).
        stack: list[list[Any]] = []

        def enter(x: Any) -> bool:
            """Push a frame for a container; move a leaf straight into ``result``."""
            hit = memo.get(id(x))
            if hit is not None:
                result.append(hit[1])
                return False
            kind = _tree.kind_of(type(x))
            if kind.code != _tree.NODE:
                result.append(walk_leaf(x))
                return False
            assert kind.flatten is not None
            children, aux = _guarded(x, kind.flatten, x)
            stack.append([x, kind, children, aux, 0, []])
            return True

        enter(obj)
        while stack:
            frame = stack[-1]
            x, kind, children, aux, k, done = frame
            if k < len(children):
                frame[4] = k + 1
                if not enter(children[k]):
                    done.append(result.pop())
                continue
            stack.pop()
            out = _guarded(x, kind.unflatten, aux, done)
            if stack:
                stack[-1][5].append(out)
            else:
                result.append(out)
        return result[0]

    def finish(self) -> None:
        """Wait for device-to-host copies, so the caller never reads unfinished data."""
        for src in self.wait_for:
            _stream.synchronize(src)
        if self.wait_for_objects:
            _stream.synchronize_accelerator()


# Leaves up to this size are packed into one buffer and sent in one copy when moving from the host
# to an accelerator. Packing a leaf costs a host memcpy; sending it alone costs a copy launch and an
# allocation, 5 to 7 us on a GPU (shared/PEERS.md). Measured here, a 64 KiB host copy takes 3.4 to
# 10 us (8 KiB: 1.0 us, 16 KiB: 1.4 us, 128 KiB: 4.3 us; medians of quiet and of busy runs): at
# 64 KiB the memcpy about equals the launch it saves, and beyond it the launch is the cheaper.
COALESCE_MAX_BYTES = 64 * 1024


def move(
    obj: T,
    device: DeviceLike,
    /,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
    coalesce: bool | None = None,
    coalesce_max_bytes: int = COALESCE_MAX_BYTES,
    stream: torch.Stream | None = None,
    strict: bool = False,
) -> T:
    """Move every tensor in a nested structure to ``device``; containers and other values are kept.

    Each tensor leaf ``t`` becomes what ``t.to(device, non_blocking=non_blocking)`` gives (a tensor
    already there comes back as the same object), every container comes back as a new container of
    the same type, and every other value comes back as the very same object.  ``obj`` is never
    mutated.  A tensor reached twice is moved once, and distinct tensors over the same memory (tied
    weights) still share memory afterwards.

    From the host to an accelerator, the small tensors travel together: they are packed into one
    page-locked buffer, sent with one copy, and handed back as views of one device buffer.

    Example:
        >>> import torch, todevice
        >>> batch = {"x": torch.ones(2, 3), "meta": ["id-7", (torch.zeros(2), 3)]}
        >>> out = todevice.move(batch, "meta")
        >>> out["x"].device, out["meta"][0], type(out["meta"][1]).__name__
        (device(type='meta'), 'id-7', 'tuple')

    Args:
        obj: A tensor, or any nesting of dicts (including OrderedDict and defaultdict), lists,
            tuples, namedtuples, deques, sets, dataclasses, dict and list subclasses, types
            registered with :func:`todevice.register`, objects with their own ``.to()``, and
            :class:`todevice.PackedBatch`.
        device: Target device: ``"cuda"``, ``"cuda:1"``, ``torch.device("cpu")``, or an int
            (an index of the current accelerator).
        non_blocking: Let host-to-accelerator copies run asynchronously.  Copies that land in host
            memory are waited for before ``move()`` returns, so results are always safe to read.
        dtype: Cast floating-point and complex tensors to this dtype on the way (as
            ``nn.Module.to(dtype)`` does); integer and bool tensors keep theirs.
        coalesce: Pack small host tensors into one buffer and send it in one copy.  None (the
            default) does so from the host to an accelerator; True for any target but the CPU
            (``"meta"`` included); False never.  Coalesced tensors come back contiguous.
        coalesce_max_bytes: The largest tensor that is coalesced; larger ones are copied alone.
        stream: Issue the copies on this stream.  The tensors returned are safe to use on the
            current stream: it waits for the copies, and they are recorded on it.
        strict: Raise instead of passing through objects todevice does not understand.

    Returns:
        A structure of the same shape and container types as ``obj``, its tensors on ``device``.

    Raises:
        ValueError: ``device`` is not a valid or available device (before anything is copied), or
            ``obj`` contains itself.
        TypeError: ``device`` or ``dtype`` has the wrong type, or ``strict=True`` and ``obj`` holds
            objects that are not tensors, containers, ``.to()`` objects or atomic values.

    .. versionadded:: 0.1.0
    """
    dev = _stream.resolve_device(device)
    if dtype is not None:
        _check_dtype(dtype)
    user_stream = None
    if stream is not None:
        user_stream = _stream.enter_stream(stream, dev)
    try:
        out, mover = _move(obj, dev, non_blocking, dtype, coalesce, coalesce_max_bytes, strict, user_stream, stream)
    finally:
        if user_stream is not None:
            _stream.set_stream(user_stream)
    if user_stream is not None:
        assert stream is not None
        _stream.hand_over(stream, user_stream, mover.outputs())
    mover.finish()
    return out  # type: ignore[no-any-return]


def _move(
    obj: Any,
    dev: torch.device,
    non_blocking: bool,
    dtype: torch.dtype | None,
    coalesce: bool | None,
    coalesce_max_bytes: int,
    strict: bool,
    user_stream: torch.Stream | None = None,
    side_stream: torch.Stream | None = None,
) -> tuple[Any, _Mover]:
    """The walk of move(), on whatever stream is current: the result and the mover that made it."""
    if coalesce is None:
        coalesce = dev.type not in _stream.HOST_TYPES
    elif coalesce:
        coalesce = dev.type != "cpu"
    mover = _Mover(dev, non_blocking, dtype, strict)
    if user_stream is not None and side_stream is not None:
        mover.object_streams = (user_stream, side_stream)
    out = _coalesced(mover, obj, coalesce_max_bytes) if coalesce else _plain(mover, obj)
    if mover.unknown:
        raise TypeError(_strict_message(obj, mover.unknown))
    return out, mover


def move_on_stream(
    batch: Any, dev: torch.device, non_blocking: bool, side: torch.Stream
) -> tuple[Any, list[torch.Tensor], torch.Event]:
    """For prefetch(): move ``batch`` with copies on ``side``; the outputs and an event after them.

    Nothing is handed over yet: the consumer's stream waits for the event only when the batch is
    used, so the copies of later batches overlap the work on earlier ones.
    """
    user = _stream.enter_stream(side, dev)
    try:
        if type(batch) is _pack.PackedBatch:
            out, mover = _unpack(batch, dev, non_blocking)
        else:
            out, mover = _move(batch, dev, non_blocking, None, None, COALESCE_MAX_BYTES, False, user, side)
        copied = _stream.record_event(side, dev)
    finally:
        _stream.set_stream(user)
    mover.finish()
    return out, mover.outputs(), copied


_MISSING: Any = object()


def _plain(mover: _Mover, obj: Any) -> Any:
    """move() without coalescing: the flat path where it applies, else the walk.

    The flat path moves tensors in bulk, the cheaper way when they are copied. A batch whose tensors
    are all in place already costs the walk less (it tests each one inline, with nothing to take
    apart): after such a batch the next one is walked, until a walk copies something again.
    """
    lane = _pack.moving
    if not lane.in_place:
        out = _flat_move(mover, obj)
        if out is not _MISSING:
            return out
    out = _run(mover, obj, obj)
    lane.in_place = not (mover.by_ptr or mover.memo)
    return out


def _flat_move(mover: _Mover, obj: Any) -> Any:
    """move() of a batch of dicts, lists and tuples that optree takes apart: its tensors in bulk.

    ``_MISSING`` where the walk must do it, from the top, with what was moved so far in its memo: a
    structure optree would rebuild otherwise, a tensor met twice or two over the same memory (the
    walk's memo keeps them together), a leaf optree keeps whole that holds one of the batch's
    tensors (remembered for the treespec, which is not tried again), a cycle, or a copy that fails
    (the walk raises it again, with its path).
    """
    got = _pack.flat_leaves(obj, _pack.moving)
    if got is None:
        return _MISSING
    spec, entry, leaves, pattern = got
    if entry.ties_across:
        return _MISSING
    found = _pack.pick(leaves, pattern.where)
    others = _pack.pick(leaves, pattern.others)
    try:
        in_place = mover.in_place(found)
        for k in pattern.odd:  # leaves optree keeps whole, by the walk's rules, before any bulk copy
            others[k] = mover.walk(others[k])
        if in_place:
            outs = found
            _pack.moving.in_place = True
        else:
            ptrs = list(map(_Tensor.data_ptr, found))
            if len(set(ptrs)) != len(ptrs):
                return _MISSING
            if pattern.odd:
                by_ptr, memo = mover.by_ptr, mover.memo
                if not by_ptr.keys().isdisjoint(ptrs) or (memo and not memo.keys().isdisjoint(map(id, found))):
                    entry.ties_across = True  # a tensor in both, or memory shared across
                    return _MISSING
            outs = mover.moved(found)
    except Exception:  # a cycle, deep nesting or a failing copy: the walk from the top says where
        return _MISSING
    mover.flat_outputs.append((found, outs))
    return spec.unflatten(_pack.pick(outs + others, pattern.fill))


def _run(mover: _Mover, tree: Any, original: Any) -> Any:
    """``mover.walk(tree)``, past Python's recursion limit too, with errors that name paths in ``original``."""
    try:
        try:
            return mover.walk(tree)
        except RecursionError as err:
            try:
                # Shared sub-trees are moved once via the memo, so what was done stays done.
                return _deep(mover, tree)
            except _tree.CycleError as cycle:
                raise ValueError(_tree.cycle_message(cycle)) from err
    except _LeafError as failure:
        _explain(failure, original, f"to {mover.dev}")


def _explain(failure: _LeafError, original: Any, where_to: str, verb: str = "move") -> NoReturn:
    """Raise a leaf's error again, with the leaf's path inside ``original`` in the message."""
    leaf, cause = failure.leaf, failure.err
    if type(original) is _tree.Flat and original.order is None:
        # A PackedBatch's flat skeleton: its structure, put together again, is where the path is.
        original = original.spec.unflatten(original.leaves)
    where = _tree.format_path(_tree.find_path(original, leaf) or "")
    target = f" {where_to}" if where_to else ""
    _raise_with_path(cause, f"Cannot {verb} {where} ({_describe(leaf)}){target}: {cause}")


def _coalesced(mover: _Mover, obj: Any, max_bytes: int) -> Any:
    """Pack the small host tensors, send them in one copy, then move the rest around their views."""

    try:
        taken, staging, _ = _pack.stage(obj, max_bytes, mover.dtype, _skeleton_walker, _pack.pinning.empty)
    except RecursionError:
        return _run(mover, obj, obj)  # deep or cyclic: the plain walk handles or reports it
    except _LeafError as failure:
        _explain(failure, obj, f"to {mover.dev}")
    mover.views = _send(staging, taken.layout, mover) if staging is not None else []
    mover.walk, mover.tensor = mover._build()
    return _run(mover, taken.skeleton, obj)


def _send(staging: torch.Tensor, layout: _pack.Layout, mover: _Mover) -> list[torch.Tensor]:
    """Copy a staging buffer (pinned, from ``_pack.stage``) to the target once, and cut the copy into views."""
    non_blocking = mover.non_blocking and (staging.is_pinned() if mover.mps else True)
    try:
        on_device = staging.to(mover.dev, non_blocking=non_blocking)
    except Exception as err:
        _raise_with_path(
            err, f"Cannot move {len(layout.order)} coalesced tensors ({layout.nbytes} bytes) to {mover.dev}: {err}"
        )
    mover.buffers.append(on_device)
    return _pack.read(on_device, layout, made=mover.buffers)


def unpack(batch: _pack.PackedBatch, device: DeviceLike | None = None, *, non_blocking: bool = True) -> Any:
    """``batch``'s structure back, its packed tensors as views of one buffer on ``device`` (None: the host)."""
    dev = torch.device("cpu") if device is None else _stream.resolve_device(device)
    out, mover = _unpack(batch, dev, non_blocking)
    mover.finish()
    return out


def _unpack(
    batch: _pack.PackedBatch, dev: torch.device, non_blocking: bool, dtype: torch.dtype | None = None
) -> tuple[Any, _Mover]:
    buffer = batch.buffer
    made: list[torch.Tensor] = []  # tensors this unpacking makes on ``dev``: the copy, and casts of it
    if buffer.device != dev:
        nb = non_blocking and (buffer.is_pinned() if dev.type == "mps" else True)
        buffer = buffer.to(dev, non_blocking=nb)
        made.append(buffer)
    views = _pack.read(buffer, batch.layout, dtype, made=made)
    for k in batch.requires_grad:
        views[k] = views[k].requires_grad_()
    mover = _Mover(dev, non_blocking, dtype, False, views=views)
    mover.buffers = made
    return _run(mover, batch.skeleton, batch.skeleton), mover


def _deep(mover: _Mover, obj: Any) -> Any:
    """Fallback for deep nesting: check for a cycle first (it would never end), then walk with a stack."""
    for _ in _tree.walk_paths(obj):  # raises CycleError on a cycle
        pass
    return mover.walk_iteratively(obj)


def _strict_message(obj: Any, unknown: list[Any]) -> str:
    ids = {id(u) for u in unknown}
    found: list[str] = []
    for path, node in _tree.walk_paths(obj):
        if id(node) in ids:
            hint = " (an nn.Module: move it with module.to(device))" if isinstance(node, torch.nn.Module) else ""
            found.append(f"  {_tree.format_path(path)}: {type(node).__qualname__}{hint}")
    shown = found[:20]
    if len(found) > len(shown):
        shown.append(f"  ... and {len(found) - len(shown)} more")
    listing = "\n".join(shown)
    return (
        f"Cannot move {len(found)} object(s) with strict=True: they are not tensors, containers, objects "
        f"with .to() or atomic values:\n{listing}\n"
        f"Register their types with todevice.register(), or pass strict=False to leave them as they are."
    )
