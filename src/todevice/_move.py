"""move(): a plan per (device, options), then one walk that copies each tensor, or the coalesced copy."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Hashable
from typing import Any, NamedTuple, TypeVar

import torch

from todevice import _back, _into, _layout, _options, _own_to, _passed, _stream, _traced, _tree, _walk
from todevice._options import COALESCE_MAX_BYTES
from todevice._stream import DeviceLike
from todevice._walk import LeafError

T = TypeVar("T")

_Tensor = torch.Tensor
_compiling = _traced.compiling


class Plan(NamedTuple):
    """What a move to one device with one set of options does: a pure function of the three, made once."""

    dev: torch.device
    non_blocking: bool
    dtype: torch.dtype | None
    keep: Callable[[torch.Tensor], bool]  # whether a tensor is in place already, or the walk may copy it anyway
    placed: Callable[[torch.Tensor], bool]  # whether a tensor is in place already: .to() would give it back
    to: Callable[[torch.Tensor], torch.Tensor]  # the copy of one tensor, straight from where it is
    alone: Callable[[torch.Tensor], torch.Tensor]  # the copy of a tensor sent by itself, staged where it pays
    one: Callable[[torch.Tensor], torch.Tensor]  # move() of a bare tensor: as it is, or its copy, waited for
    host_walk: _walk.Walk | None  # on the host, the optimistic first walk; its state is a list of (source, copy) pairs
    memo_walk: _walk.Walk  # the walk with a memo of every tensor (its state a State), for anything else
    sends: bool  # to an accelerator: what the batch holds decides what is coalesced and staged (_layout.sending)
    gathers: bool  # to the CPU: coalesced by default, gathering accelerator tensors on their devices first
    stage: bool  # pageable tensors may cross through pinned memory: non_blocking, to an accelerator but MPS
    to_host: bool  # asynchronous copies land in host memory: wait for them before returning
    skip: frozenset[Any]  # the keys whose items stay as they are
    # Whether a plain dict, list or tuple of tensors takes the fast gate: to an accelerator, and to the CPU; not to
    # meta, where every tensor is copied and the optimistic walk records the copies as cheaply (2 and 3 tensors
    # measured 3% to 8% slower through the gate, on a 2-core x86 VM).
    gated: bool
    takes: _layout.Takes  # the walks that take the small tensors out for coalescing


class _NeedsMemo(Exception): ...  # the optimistic walk met an object that only the memo walk moves


class _Gather(Exception): ...  # a move to the CPU met a tensor off the host, which the walk that coalesces moves


def _plain_objects_only(x: Any, code: int, rec: list[torch.Tensor], placed: Callable[[torch.Tensor], bool]) -> Any:
    """The optimistic walk's other leaves: those that leave no tensor behind stay; the rest need the memo walk."""
    if (code == _tree.UNKNOWN or code == _tree.MODULE) and _passed.left_behind(x, code, placed) is None:
        return x
    raise _NeedsMemo


class Bare(NamedTuple):
    """The plan of an accelerator named without an index ("cuda"): the current device's, by its index (``_current``)."""

    type: str


def plan(device: Any, non_blocking: bool, dtype: torch.dtype | None, skip: frozenset[Any] = frozenset()) -> Plan | Bare:
    """The plan for moves with these arguments, each checked; ``_plans`` keeps it."""
    dev = _options.check(device, non_blocking, dtype)[0]
    if _stream.means_current(dev):
        return Bare(dev.type)
    keep: Callable[[torch.Tensor], bool]  # whether a tensor is in place already
    if dtype is None and dev.type == "cpu":
        keep = _layout.is_cpu  # a C call; `t.device == dev` makes a device object first
    elif dtype is None and dev.type == "meta":
        # .to("meta") gives a meta tensor back as it is, and nearly every leaf sent to meta is a copy.
        keep = _layout.NEVER
    elif dtype is None:  # a host tensor, the usual source, is told apart without making a device object
        keep = lambda t: not t.is_cpu and t.device == dev  # noqa: E731
    else:
        keep = lambda t: t.device == dev and t.dtype == _options.cast_to(t.dtype, dtype)  # noqa: E731
    placed = operator.attrgetter("is_meta") if keep is _layout.NEVER else keep
    # A copy is ``t.to(dev)``: no cast, and nothing asynchronous (non_blocking means nothing for meta).
    plain = dtype is None and (not non_blocking or dev.type == "meta")

    host = dev.type in _stream.HOST_TYPES
    gathers = dev.type == "cpu"
    to_host = gathers and non_blocking
    stage = _layout.stages(non_blocking, dev)
    by_tensor = non_blocking and dev.type in ("cpu", "mps")  # whether _layout.asynchronous's answer is per tensor

    def to(t: torch.Tensor) -> torch.Tensor:
        if plain:
            return t.to(dev)  # parses fastest
        nb = _layout.asynchronous(non_blocking, dev, t) if by_tensor else non_blocking
        return t.to(dev, None if dtype is None else _options.cast_to(t.dtype, dtype), non_blocking=nb)

    def alone(t: torch.Tensor) -> torch.Tensor:
        """``t`` copied by itself: through pinned memory where the driver would wait for queued work."""
        if _layout.staged_alone(t, stage):
            out = _layout.stage([t], dev, dtype).get(id(t))
            if out is not None:
                return out
        return to(t)

    def one(t: torch.Tensor) -> torch.Tensor:
        if keep(t):
            return t
        try:
            out = t.to(dev) if plain else alone(t)
        except Exception as err:
            _walk.explain(LeafError(t, err), t, dev)
        if to_host and not t.is_cpu and not t.is_meta:
            _stream.synchronize(t.device)
        return out

    def recorded(t: torch.Tensor, rec: list[torch.Tensor]) -> torch.Tensor:
        """A tensor not in place, moved and recorded: repeats and shared memory are found afterwards, in bulk."""
        if gathers and not t.is_cpu:
            raise _Gather  # its copy may be gathered with others on its device
        try:  # _walk.guarded's rule, inline: the host walk's one call per tensor is the copy
            out = t.to(dev) if plain else to(t)
        except RecursionError:
            raise  # deep nesting: the memo walk goes on on a stack
        except Exception as err:
            raise LeafError(t, err) from err
        rec.append(t)
        rec.append(out)
        return out

    def moved(t: torch.Tensor, s: State) -> torch.Tensor:
        """A tensor not in place, moved once, with aliasing and shared memory kept."""
        key = _walk.where(t)
        if key not in s.seen.at:  # the common case, Seen.find and add inline: the first tensor at this address
            out = _copied(t, s)
            s.seen.at[key] = [(t, out)]
            return out
        return _same_address(t, s)

    # A batch rarely repeats a tensor, and the memo costs moves to meta a quarter more. So on the host the first walk
    # only records its copies; a batch that repeats one is walked again with the memo, reusing them (a repeat copied
    # twice, in host memory). On an accelerator, where that copy would hold device memory, the memo walk is the one.
    memo_walk = _walk.make(keep, moved, _leaf, _tree.kind_of, _slot, skip, _skipped_item)
    others = functools.partial(_plain_objects_only, placed=placed)
    host_walk = _walk.make(keep, recorded, others, _tree.kind_of, skip=skip) if host else None
    return Plan(
        dev, non_blocking, dtype, keep, placed, to, alone, one, host_walk, memo_walk, not host, gathers, stage, to_host,
        skip, dev.type != "meta", _layout.takes(skip, gathers),
    )  # fmt: skip


# The one cache from move()'s arguments to their plan, a pure function of them: the device argument's type is in the
# key, as 0, 0.0 and False are equal keys and only 0 names a device. A bare accelerator name's plan is the current
# device's, kept under (its Bare, the index, non_blocking, dtype). A dict, bounded by clearing it when full: the
# lookup costs 15 to 30 ns less than an lru_cache's, on moves of a tensor already in place that take 0.5 us.
_plans: dict[tuple[Any, ...], Plan | Bare] = {}


def plan_for(device: Any, non_blocking: bool, dtype: Any, *options: Any, **named: Any) -> Plan:
    """The plan for move()'s arguments, each checked by ``_options.check`` (``options`` and ``named``: its arguments
    after ``dtype``); "cuda" gets the current device's plan."""
    p = _cached((type(device), device, non_blocking, dtype), device, non_blocking, dtype)  # checks those, in order
    if type(p) is Bare:  # kept by the current index: made once per index, not once per call
        index = _stream.current_index()
        p = _cached((p, index, non_blocking, dtype), torch.device(p.type, index), non_blocking, dtype)
    skip = _options.check(device, non_blocking, dtype, *options, **named, dev=p.dev)[1]  # type: ignore[misc]
    if skip:  # 1 finds True's plan above; the check refuses it
        p = _cached((p.dev, non_blocking, dtype, skip), p.dev, non_blocking, dtype, skip)
    return p  # type: ignore[no-any-return]  # a device with its index has a plan


def _cached(key: tuple[Any, ...], device: Any, nb: bool, dtype: Any, skip: frozenset[Any] = frozenset()) -> Any:
    try:
        return _plans[key]
    except (KeyError, TypeError):  # not made yet, or unhashable: plan() refuses every unhashable argument
        pass
    p = plan(device, nb, dtype, skip)
    if len(_plans) >= 256:  # arguments made per call would otherwise pile up
        _plans.clear()
    _plans[key] = p
    return p


def _copied(t: torch.Tensor, s: State) -> torch.Tensor:
    """``t`` moved and recorded: the copy an optimistic walk made of it already, or a new one."""
    out = s.made.get(id(t))
    if out is None:
        if s.streams is not None:
            _order(t, s)
        out = _walk.guarded(t, s.plan.to if s.planned else s.plan.alone, t)
    s.sources.append(t)
    s.results.append(out)
    return out


class State:
    """One memo walk's own: its copies (``sources``, ``results``), the tensors and objects met (``seen``, ``memo``: kept
    alive, so ids and addresses stay theirs), an optimistic walk's copies (``made``, by id), the slots' views."""

    views: list[torch.Tensor] | None = None  # the packed tensors, while the walk fills a skeleton
    aliases: dict[int, tuple[Any, torch.Tensor]] | None = None  # the views AliasSlots got, set with ``views``
    packed: _tree.Packed | None = None  # the packed batch whose skeleton the walk fills, while it does
    filling: State | None = None  # what fills that batch's skipped items as it holds them, made once if needed
    streams: tuple[torch.Stream, torch.Stream] | None = None  # (user's, side): .to() objects use the user's
    ordered = False  # on a side stream: whether it waits for the user's stream already
    planned = False  # whether the batch's plan (_layout.sending) decided what is staged: then no tensor is on its own
    taken: list[torch.Tensor] | None = None  # the tensors behind ``views``, until know_taken() needs them

    def __init__(  # rec: an optimistic walk's copies (sources and copies); coalesce and max_bytes: move()'s
        self, p: Plan, rec: list[Any] | None = None, coalesce: bool | None = None, max_bytes: int = COALESCE_MAX_BYTES
    ) -> None:
        self.plan = p
        self.coalesce = coalesce
        self.max_bytes = max_bytes
        self.sources: list[torch.Tensor] = []
        self.results: list[torch.Tensor] = []
        self.seen = _walk.Seen()
        self.memo: dict[int, tuple[Any, Any]] = {}
        self.made: dict[int, torch.Tensor] = dict(zip(map(id, rec[-2::-2]), rec[::-2])) if rec else {}
        self.buffers: list[torch.Tensor] = []  # what coalescing made on the target, which views point into
        self.left: list[tuple[Any, tuple[str, str]]] = []  # objects passed through that leave tensors behind, warned of
        self.waits: set[torch.device] = set()  # devices a move to the host waits for, beyond its sources'

    def outputs(self) -> list[torch.Tensor]:
        """Every tensor this move made: the coalesced buffers and each tensor copied on its own."""
        outs = [*self.buffers, *(out for src, out in zip(self.sources, self.results) if out is not src)]
        return list({id(out): out for out in outs}.values())  # once each, whatever recorded it

    def know_taken(self) -> None:
        """The taken tensors made known to the memo with their views, once: before a mapping's own .to() meets them."""
        taken, self.taken = self.taken, None
        for t, view in zip(taken or (), self.views or ()):
            self.once(t, view)

    def once(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The one copy of ``t`` in this move: the one made before, or ``out`` (made by a mapping's own .to())."""
        found = self.seen.find(t)
        if found is not None and found[2]:
            return found[1]  # type: ignore[no-any-return]
        self.seen.add(t, out)
        return out

    def finish(self, out: Any = None) -> Any:
        """``out``, once asynchronous copies into host memory have landed."""
        if self.plan.to_host:
            _stream.wait_for(self.sources, self.waits)
        return out


def _order(t: torch.Tensor, s: State) -> None:
    """On a side stream, before the first copy from accelerator memory, which work queued on the user's stream may
    write: wait for that stream. Host memory needs no wait, so copies of host tensors overlap the user's work."""
    if s.streams is not None and not s.ordered and not (t.is_cpu or t.is_meta):
        user, side = s.streams
        side.wait_stream(user)
        s.ordered = True


def _host(obj: Any, p: Plan, walk: _walk.Walk, coalesce: bool | None, max_bytes: int) -> Any:
    """A move to the host: the optimistic walk, then the memo one where needed; coalesced unless coalesce=False."""
    rec: list[torch.Tensor] = []  # source, copy, source, copy, ...
    try:
        out = walk.walk(obj, rec)
    except LeafError as failure:
        _walk.explain(failure, obj, p.dev, skip=p.skip)
    except _Gather:
        # Plain dicts, lists and tuples of device tensors: one look, one copy.
        out = _back.brought(obj, max_bytes) if coalesce is not False and not p.skip and p.dtype is None else None
        if out is not None:
            return out
        s = State(p, rec, coalesce, max_bytes)  # coalesce=False: _batch walks it again, tensor by tensor
        return s.finish(_batch(obj, s))
    except (_NeedsMemo, RecursionError):  # an object the memo walk moves, or deep nesting
        return walk_again(obj, p, rec)
    if len(rec) > 2 and not _layout.distinct(rec[::2]):  # a tensor met twice, or two over one memory
        return walk_again(obj, p, rec)
    if p.to_host and rec:
        _stream.wait_for(rec[::2])
    return out


def walk_again(obj: Any, p: Plan, rec: list[torch.Tensor] | None = None) -> Any:  # reusing an optimistic walk's copies
    s = State(p, rec)
    return s.finish(_walked(obj, s, obj))


def _walked(x: Any, s: State, original: Any, views: Callable[[], list[torch.Tensor]] | None = None) -> Any:
    """The memo walk over ``x`` (a skeleton whose slots ``views()`` fill, if given), naming paths in ``original``."""
    try:
        if views is not None:
            s.views, s.aliases = views(), {}
        out = _memo_walk(x, s)
    except LeafError as failure:
        _walk.explain(failure, original, s.plan.dev, also=x, skip=s.plan.skip)
    if s.left:
        _passed.warn_left_behind(s.left, original, s.plan.skip)
        s.left.clear()
    return out


def _memo_walk(x: Any, s: State) -> Any:  # the memo walk over x, on a stack past Python's recursion limit
    try:
        return s.plan.memo_walk.walk(x, s)
    except RecursionError as err:
        _walk.refuse_cycles(x, err, skip=s.plan.skip)
        return s.plan.memo_walk.walk_iteratively(x, s)


def _same_address(t: torch.Tensor, s: State) -> torch.Tensor:
    """Another tensor at an address moved already: the same tensor, tied memory, or another view."""
    found = s.seen.find(t)
    if found is not None and found[2]:
        return found[1]  # type: ignore[no-any-return]
    if found is not None and found[1] is not found[0]:
        # Distinct tensors over exactly the same memory (tied weights) come out sharing memory too; not those
        # requiring grad, where a shared view would route the gradient through the wrong source.
        done: torch.Tensor = found[1]
        out = done.view(done.shape)
        s.sources.append(t)
        s.results.append(out)
    else:
        out = _copied(t, s)
    s.seen.add(t, out)
    return out


def _skipped_item(x: Any, s: State) -> Any:
    """An item under a key to skip: as it is; in a packed batch's skeleton, its slots filled with views of the buffer
    where it is (one filling per batch, so a tensor in two items is one view)."""
    batch = s.packed
    if batch is None:
        return x
    filling = s.filling
    if filling is None:
        filling = s.filling = State(plan_for(batch.buffer.device, False, None))  # loose tensors stay
        if s.plan.dev == batch.buffer.device and s.plan.dtype is None:  # the move's views are the buffer's own
            filling.views, filling.aliases = s.views, s.aliases
        else:
            filling.views, filling.aliases = _layout.read(batch.buffer, batch.layout), {}
            for k in batch.requires_grad:
                filling.views[k] = filling.views[k].requires_grad_()
    return _memo_walk(x, filling)


def _unpacked(batch: _tree.Packed, s: State) -> Any:
    """A packed batch: its buffer sent once, its slots filled with views of the copy."""
    views = _send(s, batch.buffer, batch.layout)
    for k in batch.requires_grad:
        views[k] = views[k].requires_grad_()
    s.know_taken()  # the outer batch's taken tensors, which the views below replace
    outer = s.views, s.aliases, s.packed, s.filling
    s.views, s.aliases, s.packed, s.filling = views, {}, batch, None
    try:
        out = _memo_walk(batch.skeleton, s)
    except LeafError as failure:  # the walk the batch is in names the path
        raise failure.within(batch, batch.skeleton, s.plan.skip) from None
    finally:
        s.views, s.aliases, s.packed, s.filling = outer
    s.memo[id(batch)] = (batch, out)
    return out


def _slot(x: _tree.Slot, s: State) -> torch.Tensor:  # a packed batch's slot: its tensor
    try:
        return s.views[x]  # type: ignore[index]
    except TypeError:  # no views: a slot met outside a skeleton
        return _tree.filled(x, None, None)  # type: ignore[no-any-return]  # the error that says so, alone


def _leaf(x: Any, code: int, s: State) -> Any:
    if code == _tree.SLOT:  # an AliasSlot: a distinct tensor over the same memory as another, a view of its view
        return _tree.filled(x, s.views, s.aliases)
    hit = s.memo.get(id(x))  # a .to() object or a packed batch moved already
    if hit is not None:
        return hit[1]
    if code == _tree.TO:
        return _to_object(x, s)
    if code == _tree.PACKED:
        return _unpacked(x, s)
    found = _passed.left_behind(x, code, s.plan.placed)  # nn.Modules and unknown objects: as they are
    if found is not None:
        s.left.append((x, found))
    return x


def _to_object(obj: Any, s: State) -> Any:
    p = s.plan
    held = _own_to.devices_inside(obj) if p.to_host else None  # before .to(), which may move obj's insides in place
    streams = s.streams
    if streams is not None:
        _stream.accel.set_stream(streams[0])
    try:
        out = _own_to.to_object(obj, p.dev, _layout.asynchronous(p.non_blocking, p.dev), p.dtype)
    finally:
        if streams is not None:
            _stream.accel.set_stream(streams[1])
    if held:
        s.waits.update(held)
    s.memo[id(obj)] = (obj, out)  # before its items are walked: one that holds obj itself gets out
    if _tree.to_mapping(type(obj)):  # what its .to() left: containers in it, and keys to skip
        s.know_taken()  # a tensor of its own taken out of the batch: the view that holds its copy, not its .to()'s
        _own_to.rest_of_mapping(obj, out, p.skip, functools.partial(_memo_walk, s=s), s.once, p.dev, p.dtype)
    return out


def move(
    obj: T,
    /,
    device: DeviceLike | None = None,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
    coalesce: bool | None = None,
    coalesce_max_bytes: int = COALESCE_MAX_BYTES,
    stream: torch.Stream | None = None,
    strict: bool = False,
    skip_keys: Hashable | Collection[Hashable] | None = None,
    out: T | None = None,
) -> T:
    """Move every tensor in a nested structure to ``device``; containers and other values are kept.

    Each tensor leaf ``t`` becomes what ``t.to(device, non_blocking=non_blocking)`` gives (a tensor
    already there comes back as the same object), every container comes back as a new container of
    the same type, and every other value comes back as the very same object.  ``obj`` is never
    mutated.  A tensor reached twice is moved once, and distinct tensors over the same memory (tied
    weights) still share memory afterwards.

    From the host to an accelerator, 16 small tensors or more travel together: packed into one
    page-locked buffer, sent with one copy, handed back as views of one device buffer; fewer go one
    by one. To the CPU, each accelerator's small tensors are gathered there and come back in one copy.

    Example:
        >>> import torch, todevice
        >>> batch = {"x": torch.ones(2, 3), "meta": ["id-7", (torch.zeros(2), 3)]}
        >>> out = todevice.move(batch, "meta")
        >>> out["x"].device, out["meta"][0], type(out["meta"][1]).__name__
        (device(type='meta'), 'id-7', 'tuple')

    Args:
        obj: A tensor, or any nesting of dicts (including OrderedDict and defaultdict), lists,
            tuples, namedtuples, structseqs, deques, sets, dataclasses, dict and list subclasses,
            other mappings (UserDict, ...), types registered with :func:`todevice.register`,
            objects with their own ``.to()``, and :class:`todevice.PackedBatch`.
        device: Target device: ``"cuda"``, ``"cuda:1"``, ``torch.device("cpu")``, or an int
            (an index of the current accelerator). May be left out when ``out`` is given.
        non_blocking: Let host-to-accelerator copies run asynchronously. Pageable tensors go straight
            while the driver copies them without waiting for queued work, and through one pinned buffer
            past that.  Copies that land in host memory are waited for before ``move()`` returns, so
            results are always safe to read. Gathered small tensors come back with one blocking copy.
        dtype: Cast floating-point and complex tensors to this dtype on the way (as
            ``nn.Module.to(dtype)`` does); integer and bool tensors keep theirs.
        coalesce: Pack small tensors into one buffer and send it in one copy.  None (the default)
            does so from the host to an accelerator for 16 or more, and from each accelerator to the
            CPU; True for any number, ``"meta"`` too; False never.  They come back contiguous.
        coalesce_max_bytes: The largest host tensor, pinned or pageable, that is coalesced. A larger
            one is copied into an allocation of its own, so it never shares memory with another
            tensor of the batch.
        stream: Issue the copies on this stream, which must be on the target device. Copies from
            host memory do not wait for the current stream. The tensors returned are safe to use on
            the current stream: it waits for the copies, and they are recorded on it. The current
            device and stream are restored.
        strict: Raise instead of passing through objects todevice does not understand (a
            ``todevice.errors.TensorsLeftBehindWarning`` otherwise, where they hold tensors).
        skip_keys: A dict key, or a collection of them: the items under these keys, in any mapping
            at any depth, come back exactly as they are (the CPU ``lengths`` that
            ``pack_padded_sequence`` wants, for instance).
        out: A structure like ``obj`` whose tensors receive ``obj``'s values, in place; it is
            returned, its tensors the same objects over the same memory. Every pair is checked
            before anything is written. Small host tensors whose targets are views of one buffer
            (as ``move(example, device)`` returns them) cross in one copy.

    Returns:
        A structure of the same shape and container types as ``obj``, its tensors on ``device``.

    Raises:
        ValueError: ``device`` is not a valid or available device (before anything is copied),
            ``out`` differs from ``obj`` in structure, shape, dtype or device (naming the path),
            ``obj`` contains itself, ``stream`` is on another device than the target, or
            ``coalesce_max_bytes`` is negative.
        TypeError: ``device``, ``dtype``, ``coalesce_max_bytes`` or ``skip_keys`` has the wrong type,
            or ``strict=True`` and ``obj`` holds objects that are not tensors, containers, ``.to()``
            objects or atomic values.

    .. versionadded:: 0.1.0
    """
    if out is not None:  # 1. into static buffers, every pair checked first: under torch.compile, between two graphs
        # Under torch.compile the copies write memory the graphs before and after read: dynamo breaks the graph here.
        into = torch.compiler.disable(_into_static) if _compiling() else _into_static  # type: ignore[no-untyped-call]
        opts = (non_blocking, dtype, coalesce, coalesce_max_bytes, stream, strict, skip_keys)
        return into(obj, out, device, *opts)  # type: ignore[no-any-return]
    if _compiling():  # 2. under torch.compile: one traced copy per tensor (before torch 2.11, this move untraced)
        return (_traced.compiled if _traced.TRACES else _untraced)(  # type: ignore[no-any-return]
            obj, device, non_blocking=non_blocking, dtype=dtype, coalesce=coalesce, stream=stream,
            coalesce_max_bytes=coalesce_max_bytes, strict=strict, skip_keys=skip_keys,
        )  # fmt: skip
    try:
        p: Any = _plans[type(device), device, non_blocking, dtype]
        if type(p) is Bare:  # "cuda": the plan of the device current now
            p = _plans[p, _stream.current_index(), non_blocking, dtype]
    except (KeyError, TypeError):
        p = None
    plain = stream is None and strict is False
    if (  # plan_for checks every option (_options.check); here the plan's are known good, and the others default
        p is None
        or not plain
        or (non_blocking is not True and non_blocking is not False)  # 1 would find True's plan: refused on every call
        or coalesce is not None
        or coalesce_max_bytes is not COALESCE_MAX_BYTES
        or skip_keys is not None
    ):
        p = plan_for(device, non_blocking, dtype, coalesce, coalesce_max_bytes, stream, strict, skip_keys)
    if plain:
        if type(obj) is _Tensor:  # 3. a bare tensor: nothing to walk, alias or coalesce
            return p.one(obj)  # type: ignore[no-any-return]
        if p.gated and not coalesce:  # 4. the fast gate: a plain dict, list or tuple of a few tensors
            done = _back.gate(obj, p, coalesce)
            if done is not None:
                return done  # type: ignore[no-any-return]
    walk = p.host_walk if plain and (p.gathers or not coalesce) else None
    return (  # type: ignore[no-any-return]  # 5. the walks: to the host, the optimistic one first; else the memo walk
        _general(obj, p, coalesce, coalesce_max_bytes, stream, strict)
        if walk is None
        else _host(obj, p, walk, coalesce, coalesce_max_bytes)
    )


_untraced = _traced.untraced(move, "todevice.move()")


def _into_static(obj: Any, out: Any, device: Any, nb: bool, dtype: Any, *opts: Any) -> Any:
    """move() with out=: the plan checks the device and options; without a device, out's tensors say where to."""
    p = plan_for("cpu" if device is None else device, nb, dtype, *opts)
    coalesce, max_bytes, stream, strict, _ = opts
    dev = None if device is None else p.dev
    return _into.into(obj, out, dev, nb, dtype, coalesce, max_bytes, _stream.issuing(stream, p.dev), strict, p.skip)


def _general(obj: Any, p: Plan, coalesce: bool | None, max_bytes: int, stream: Any, strict: bool) -> Any:
    """The memo walk, coalesced as planned, on ``stream`` if given (the optimistic host walk is ``_host``)."""
    if strict:
        _passed.refuse_unknown(obj, p.skip)
    s = State(p, None, coalesce, max_bytes)
    stream = _stream.issuing(stream, p.dev)
    if stream is None:
        out = _batch(obj, s)
    else:
        out, user = _on_stream(obj, s, stream)
        _stream.hand_over(stream, user, s.outputs())
    return s.finish(out)


def _batch(obj: Any, s: State) -> Any:
    """A structure moved: its small tensors taken out, gathered back to the CPU or sent, and the skeleton walked with
    its slots filled; or walked tensor by tensor (a deep or cyclic ``obj`` too)."""
    p, coalesce = s.plan, s.coalesce
    gather = p.gathers and coalesce is not False
    taken = None
    if gather or p.sends or coalesce:
        try:
            taken = _layout.take(obj, p.takes, s.max_bytes, p.dtype)
        except RecursionError:
            pass  # the walk handles or reports it
        except LeafError as failure:
            _walk.explain(failure, obj, p.dev, skip=p.skip)
    if taken is None or (gather and len(taken.tensors) < 2):  # a single tensor to gather goes alone
        return _walked(obj, s, obj)
    s.taken = small = taken.tensors  # the tensors behind the slots' views
    views: Callable[[], list[torch.Tensor]] | None = None  # what fills the skeleton's slots
    if gather:
        copied, order = functools.partial(_copied, s=s), functools.partial(_order, s=s)
        views = functools.partial(_back.gathered_back, taken, p.dtype, copied, order, s.buffers)
    else:
        # Host tensors sent as _layout.sending decides from what the batch holds: the small ones together through one
        # (pinned) buffer, or each alone; those alone straight, or all through one pinned buffer where the driver would
        # wait for queued work (the skeleton's walk takes those copies).
        alone = taken.alone
        how = _layout.sending(len(small), taken.layout.nbytes, len(alone), sum(map(_layout.nbytes, alone)), coalesce)
        s.planned = bool(small or alone)  # else a PackedBatch's loose tensors: each staged by itself where it pays
        if how.staged and p.stage:
            s.made.update(_layout.stage(alone if how.together else [*small, *alone], p.dev, p.dtype))
        if small and how.together:
            views = functools.partial(_layout.sent, small, taken.layout, p.dtype, p.dev, functools.partial(_send, s))
        elif small:
            views = lambda: [_copied(t, s) for t in small]  # noqa: E731
    return _walked(obj if views is None else taken.skeleton, s, obj, views)


def _send(s: State, buffer: torch.Tensor, lay: _layout.Layout) -> list[torch.Tensor]:
    """Copy a host buffer to the target once, and cut the copy into views (cast where the layout says)."""
    p = s.plan
    if buffer.device != p.dev:
        if not buffer.is_cpu:  # a packed batch loaded onto a device
            _order(buffer, s)
            if p.to_host:
                s.waits.add(buffer.device)  # waited for before the move returns
        # A cast is made on the host as soon as the buffer is read: the copy must have landed.
        cast_on_host = p.to_host and p.dtype is not None and not buffer.is_cpu
        try:
            # A uint8 tensor copied alone: staged, pinned or pageable by the same rules as any other.
            buffer = buffer.to(p.dev) if cast_on_host else p.alone(buffer)
        except Exception as err:
            msg = f"Cannot move {len(lay.order)} packed tensors ({lay.nbytes} bytes) to {p.dev}: {err}"
            _walk.raise_with_message(err, msg)
        s.buffers.append(buffer)
    return _layout.read(buffer, lay, p.dtype, made=s.buffers)


def _on_stream(obj: Any, s: State, stream: torch.Stream) -> tuple[Any, torch.Stream]:
    """``obj`` moved with its copies issued on ``stream``; the result, and the user's stream (current again)."""
    entered = _stream.enter_stream(stream, s.plan.dev)
    s.streams = (entered.user, stream)
    try:
        out = _back.gate(obj, s.plan, s.coalesce, s) if s.plan.sends and not s.coalesce else None
        return (_batch(obj, s) if out is None else out), entered.user
    finally:
        _stream.leave_stream(entered)
