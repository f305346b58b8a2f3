"""PackedBatch: many tensors in one buffer, and the plan that lays them out.

A plan groups the packed tensors by (buffer dtype, shape). A group of two or more tensors is one
block, written with one ``torch.stack`` and cut back into tensors with one ``unbind``; tensors of a
shape seen once share a ragged region per dtype, cut with one ``unflatten_dense_tensors``. Either way
the per-tensor loop runs in C++: a view made from Python costs about 1.5 us here, one made inside
``unbind`` about 0.3 us. Every tensor starts at a multiple of ``ALIGN`` bytes, so device kernels keep
their vectorised loads, and the buffer holds the data plus that padding and nothing more.

Taking a batch apart (``take_tensors``) goes, fastest first:
- warm: the batch has the leaf pattern and dtypes of the last one of its treespec (per cast and
  ``max_bytes``), whose layout is reused; ``write`` checks shapes, devices and requires_grad per
  block instead of per tensor (``_Warm``);
- guided: from the second batch of a structure on, the structure of the last batch, taken apart by
  ``spec.flatten_up_to`` once a guide has checked its every node (``_guide``, ``_follows``, ``_Lane``);
- flat: ``optree.tree_flatten``, where optree's rules agree with todevice's (``flat_node``), the
  tensors checked in bulk (``_take_flat``);
- walked: todevice's own walk, with a ``take`` per tensor, for every other structure; a careful
  walk where a tensor is met twice or memory is shared (``_Skeleton``).
``move()`` without coalescing uses the same flat and guided paths (``flat_leaves``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import optree
import torch

from todevice import _tree

ALIGN = 16  # bytes: a CUDA vectorised load is 16 bytes (float4)

_Tensor = torch.Tensor


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pick(seq: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    """``[seq[i] for i in indices]``, in one C loop."""
    if len(indices) > 1:
        return list(operator.itemgetter(*indices)(seq))
    return [seq[i] for i in indices]


class Block(NamedTuple):
    """``n`` tensors of one dtype and shape, each ``padded`` elements apart from ``start``."""

    dtype: torch.dtype  # as stored in the buffer
    final: torch.dtype  # as handed back (a cast on the receiving side when it differs)
    shape: torch.Size
    n: int
    padded: int
    start: int


class Ragged(NamedTuple):
    """Tensors of one dtype whose shapes are each seen once, one after the other from ``start``."""

    dtype: torch.dtype
    final: torch.dtype
    shapes: tuple[torch.Size, ...]
    pads: tuple[int, ...]  # elements of padding after each tensor
    start: int
    nbytes: int


class Layout(NamedTuple):
    """Where every packed tensor lives in the buffer. Slot ``i`` is the ``i``-th tensor in group order."""

    groups: tuple[Block | Ragged, ...]
    nbytes: int
    order: tuple[int, ...]  # order[k]: the place in the buffer of the k-th tensor met in the walk
    walk_order: tuple[int, ...]  # walk_order[i]: which tensor of the walk is the i-th in the buffer


def _buffer_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """(dtype in the buffer, dtype handed back): a cast happens on the side that sends fewer bytes."""
    if cast is None or not (dtype.is_floating_point or dtype.is_complex) or cast == dtype:
        return dtype, dtype
    if cast.itemsize < dtype.itemsize:
        return cast, cast  # cast while packing: fewer bytes cross
    return dtype, cast  # cast after the copy, on the receiving side


def make_layout(signature: tuple[tuple[torch.dtype, torch.Size], ...], cast: torch.dtype | None) -> Layout:
    """The layout for tensors of these (dtype, shape) pairs, in walk order."""
    by_key: dict[tuple[torch.dtype, torch.dtype, torch.Size], list[int]] = {}
    for k, (dtype, shape) in enumerate(signature):
        stored, final = _buffer_dtype(dtype, cast)
        by_key.setdefault((stored, final, shape), []).append(k)
    groups: list[Block | Ragged] = []
    walk_order: list[int] = []  # the walk's tensors, in the order the buffer holds them
    offset = 0
    ragged: dict[tuple[torch.dtype, torch.dtype], list[tuple[torch.Size, int]]] = {}
    for (stored, final, shape), members in by_key.items():
        if len(members) == 1:
            ragged.setdefault((stored, final), []).append((shape, members[0]))
            continue
        size = stored.itemsize
        numel = shape.numel()
        padded = _aligned(numel * size) // size
        groups.append(Block(stored, final, shape, len(members), padded, offset))
        offset += len(members) * padded * size
        walk_order.extend(members)
    for (stored, final), entries in ragged.items():
        size = stored.itemsize
        shapes = tuple(shape for shape, _ in entries)
        pads = tuple(_aligned(s.numel() * size) // size - s.numel() for s in shapes)
        nbytes = sum((s.numel() + p) * size for s, p in zip(shapes, pads))
        groups.append(Ragged(stored, final, shapes, pads, offset, nbytes))
        offset += nbytes
        walk_order.extend(k for _, k in entries)
    order = [0] * len(walk_order)
    for i, k in enumerate(walk_order):
        order[k] = i
    return Layout(tuple(groups), offset, tuple(order), tuple(walk_order))


class _PlanCache:
    """Layouts by signature: a training loop sends batches of one structure step after step."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.built = 0  # how many layouts were computed, not found: the tests read it
        self.last_count = 0  # tensors in the last layout asked for: the next batch is likely alike
        self._plans: collections.OrderedDict[Any, Layout] = collections.OrderedDict()
        self._last: tuple[Any, Layout] | None = None  # replaced whole: threads may share it
        self._lock = threading.Lock()

    def get(self, dtypes: tuple[torch.dtype, ...], shapes: tuple[torch.Size, ...], cast: torch.dtype | None) -> Layout:
        # Two flat tuples hash in a third of the time of one tuple of (dtype, shape) pairs.
        key = (dtypes, shapes, cast)
        last = self._last
        if last is not None and last[0] == key:  # the batch before had this layout: no hashing
            return last[1]
        layout = self._get(key)
        self._last = (key, layout)
        return layout

    def _get(self, key: tuple[tuple[torch.dtype, ...], tuple[torch.Size, ...], torch.dtype | None]) -> Layout:
        dtypes, shapes, cast = key
        with self._lock:
            layout = self._plans.get(key)
            if layout is not None:
                self._plans.move_to_end(key)
                return layout
        layout = make_layout(tuple(zip(dtypes, shapes)), cast)
        with self._lock:
            self.built += 1
            self._plans[key] = layout
            if len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return layout


plans = _PlanCache()


@functools.lru_cache(maxsize=32)
def _templates(group: Ragged) -> list[torch.Tensor]:
    """Meta tensors shaped like each tensor and its padding, for ``unflatten_dense_tensors``.

    Two small tensor objects per ragged tensor: 32 groups, as many as the layouts a loop cycles
    through, not 256, which held ~220 MB for batches whose 1,000 shapes changed every time.
    """
    out: list[torch.Tensor] = []
    for shape, pad in zip(group.shapes, group.pads):
        out.append(torch.empty(shape, dtype=group.dtype, device="meta"))
        out.append(torch.empty(pad, dtype=group.dtype, device="meta"))
    return out


def _cut(region: torch.Tensor, group: Ragged) -> list[torch.Tensor]:
    """A ragged region's tensors, as views, without their padding: one C++ loop."""
    pieces: list[torch.Tensor] = torch._C._nn.unflatten_dense_tensors(region, _templates(group))
    return pieces[::2]


@functools.lru_cache(maxsize=1024)
def _block_strides(shape: torch.Size, padded: int) -> tuple[int, ...]:
    """Strides of a block: ``padded`` elements from one tensor to the next, each tensor contiguous."""
    strides = [padded]
    inner = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        inner[d] = inner[d + 1] * shape[d + 1]
    return tuple(strides + inner)


def _regions(buffer: torch.Tensor, layout: Layout) -> list[tuple[Block | Ragged, torch.Tensor]]:
    """Each group's part of ``buffer``, typed: (count, *shape) for a block, 1-D for a ragged group."""
    out: list[tuple[Block | Ragged, torch.Tensor]] = []
    for g in layout.groups:
        size = g.dtype.itemsize
        typed = buffer.view(g.dtype)  # every group starts and ends on an ALIGN boundary
        offset = typed.storage_offset() + g.start // size
        if type(g) is Block:
            out.append((g, typed.as_strided((g.n, *g.shape), _block_strides(g.shape, g.padded), offset)))
        else:
            assert type(g) is Ragged
            out.append((g, typed.as_strided((g.nbytes // size,), (1,), offset)))
    return out


class Stale(Exception):
    """Internal: a layout reused without reading every tensor's shape did not fit the tensors."""


stale_writes = [0]  # how many writes found their warm layout stale: the tests read it
# A warm block up to this size is checked by stacking it on its own (one extra copy of its bytes);
# a larger one by reading each of its tensors.
_STACK_TO_CHECK = 64 * 1024


def _stale(check: _Warm) -> NoReturn:
    check.forget()
    stale_writes[0] += 1
    raise Stale


def write(buffer: torch.Tensor, layout: Layout, walked: Sequence[torch.Tensor], check: Any = None) -> None:
    """Copy ``walked`` (tensors in walk order) into ``buffer``: one or two C++ calls per group.

    With ``check`` (the ``_Warm`` layout this is), the shapes, devices and requires_grad of the
    tensors in blocks were not read. A block up to ``_STACK_TO_CHECK`` bytes is stacked on its own
    and must come out host-resident, not requiring grad and of the block's shape (``torch.stack``
    refuses tensors of unequal shapes by itself), which costs no more than stacking into the buffer;
    a larger block's tensors are read one by one. A block that does not fit raises ``Stale``.
    """
    tensors = pick(walked, layout.walk_order)
    k = 0
    for g, region in _regions(buffer, layout):
        if type(g) is Ragged:
            group = list(tensors[k : k + len(g.shapes)])
            k += len(group)
            torch._foreach_copy_(_cut(region, g), group)
            continue
        assert type(g) is Block
        group = list(tensors[k : k + g.n])
        k += g.n
        if check is not None:
            if g.n * g.padded * g.dtype.itemsize > _STACK_TO_CHECK:
                # A large block holds few tensors for its bytes: read each, rather than copy it twice.
                shape = g.shape
                try:
                    fits = not any(t.shape != shape or not t.is_cpu or t.requires_grad for t in group)
                except RuntimeError:  # a nested tensor has no shape
                    fits = False
                if not fits:
                    _stale(check)
            else:
                try:
                    stacked = torch.stack(group)
                except RuntimeError:  # unequal shapes, or devices
                    _stale(check)
                if stacked.shape != region.shape or not stacked.is_cpu or stacked.requires_grad:
                    _stale(check)
                region.copy_(stacked)
                continue
        if region.is_contiguous():
            try:
                torch.stack(group, out=region)
                continue
            except (RuntimeError, TypeError):  # sources of other dtypes, cast into this one
                pass
        region.copy_(torch.stack(group))  # padded rows, or a cast: stack, then one strided copy


# A private guard of PyTorch's, there since 1.9 and used by its own functorch: a PyTorch without it
# gets autograd views, as detached unbind() gave before (one version counter for the batch).
_below_autograd_views: Callable[[], Any] = getattr(
    torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext
)


def read(
    buffer: torch.Tensor, layout: Layout, cast: torch.dtype | None = None, made: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The packed tensors, in walk order, sharing ``buffer``'s memory (or one cast copy's per group).

    ``cast`` turns floating-point and complex groups into that dtype; every tensor made for a cast is
    appended to ``made``, so a side stream's caller can record it.
    """
    views: list[torch.Tensor] = []
    for g, region in _regions(buffer, layout):
        final = g.final
        if cast is not None and (final.is_floating_point or final.is_complex):
            final = cast
        if final != g.dtype:
            region = region.to(final)  # one cast per group, on the receiving side
            if made is not None:
                made.append(region)
        # Cut below autograd's view tracking: each tensor comes out as a plain tensor over its part
        # of the memory, as independent as one from .to(). Views would share one version counter,
        # so an in-place change to one tensor of the batch would fail the backward pass of any other
        # saved for it ("modified by an inplace operation"), and unbind()'s views also refuse
        # in-place changes mixed with autograd (x.mul_(w), w requiring grad). It is the cheaper way
        # too: no autograd metadata, and no detach() after.
        with _below_autograd_views():
            if type(g) is Block:
                views.extend(region.unbind(0))
            else:
                assert type(g) is Ragged
                views.extend(_cut(region, g))
    return pick(views, layout.order)


# ---------------------------------------------------------------- host staging


class _Pinning:
    """Whether page-locked memory can be had here; asked once, never warned about."""

    def __init__(self) -> None:
        self.available: bool | None = None

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 staging buffer, page-locked where possible, from PyTorch's caching host allocator.

        That allocator reuses blocks, and does not hand a block out again while a copy from it
        is still in flight (the copy records an event on it).
        """
        if self.available is not False:
            try:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.available = True
                return buf
            except RuntimeError:  # no accelerator, or a backend without pinned memory
                self.available = False
        return torch.empty(nbytes, dtype=torch.uint8)


pinning = _Pinning()


# ---------------------------------------------------------------- pack()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors at one address read that memory the very same way, so one result serves both.

    Same dtype, device, shape and strides (a dimension of size 1 may have any stride), and no lazy
    conjugate or negative bit on one only. Tensors requiring grad never share: a shared result would
    route one's gradient through the other.
    """
    if a.requires_grad or b.requires_grad or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_conj() != b.is_conj() or a.is_neg() != b.is_neg():
        return False
    shape = a.shape
    return shape == b.shape and all(n == 1 or x == y for n, x, y in zip(shape, a.stride(), b.stride()))


# Dtypes a byte buffer holds exactly (quantized and other exotic dtypes are left out).
_DENSE_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
_strided = torch.strided


class _SlotPool:
    """Slot objects made once and shared: a skeleton takes one per tensor, and ints are immutable."""

    def __init__(self) -> None:
        self.slots: list[_tree.Slot] = []
        self._lock = threading.Lock()

    def at_least(self, n: int) -> list[_tree.Slot]:
        slots = self.slots
        if len(slots) < n:
            with self._lock:
                size = max(n, 2 * len(self.slots), 4096)
                if len(self.slots) < size:
                    self.slots = self.slots + [_tree.Slot(i) for i in range(len(self.slots), size)]
                slots = self.slots
        return slots


_slot_pool = _SlotPool()


class _Skeleton:
    """What the packing walk keeps: the tensors it took, in walk order, and where they were.

    ``take`` runs once per tensor, so it is a closure over locals with the selection written out:
    each attribute lookup or call it saves is ~5% of the packing walk. The first walk is
    optimistic: it assumes no tensor is met twice and none shares memory with another, and checks
    that afterwards in bulk (``take_tensors``); only when the check fails does a careful walk run.
    """

    def __init__(self, max_bytes: int | None, careful: bool = False, expected: int = 0) -> None:
        self.tensors: list[torch.Tensor] = []
        self.by_ptr: dict[int, list[int]] = {}  # data_ptr -> indices of the tensors taken there
        self.by_id: dict[int, Any] = {}  # tensors met again, over taken memory, or with no memory
        self.loose: list[torch.Tensor] = []  # tensors left in the skeleton as they are
        tensors, loose = self.tensors, self.loose
        append = tensors.append
        dense = _DENSE_DTYPES
        slots = _slot_pool.at_least(expected)
        Slot = _tree.Slot

        def take(t: torch.Tensor) -> Any:
            """A slot for ``t``, or ``t`` itself when it is not packed."""
            if type(t) is not _Tensor or not t.is_cpu or t.dtype not in dense:
                loose.append(t)
                return t  # stays in the skeleton as it is
            if max_bytes is not None:
                try:
                    big = t.nbytes > max_bytes
                except RuntimeError:  # sparse tensors have no nbytes
                    big = True
                if big or t.requires_grad:
                    loose.append(t)
                    return t  # move() coalesces small tensors that need no autograd only
            n = len(tensors)
            append(t)
            try:
                return slots[n]
            except IndexError:
                return Slot(n)

        self.take = self._careful if careful else take
        self.max_bytes = max_bytes

    def _careful(self, t: torch.Tensor) -> Any:
        """``take`` for a structure that repeats tensors, ties memory, or holds exotic tensors."""
        if (
            type(t) is not _Tensor
            or not t.is_cpu
            or t.dtype not in _DENSE_DTYPES
            or t.layout is not _strided  # sparse and mkldnn tensors travel as they are
            or t.is_nested
            or (self.max_bytes is not None and (t.requires_grad or t.nbytes > self.max_bytes))
        ):
            self.loose.append(t)
            return t
        seen = self.by_id.get(id(t))
        if seen is not None:
            return seen[1]  # the same tensor again: the same slot
        ptr = t.data_ptr()
        at_ptr = self.by_ptr.setdefault(ptr, []) if ptr else []
        for first in at_ptr:
            if same_view(self.tensors[first], t):
                slot: Any = _tree.AliasSlot(first)  # tied memory: a new view of the same packed tensor
                break
        else:
            slot = _tree.Slot(len(self.tensors))
            at_ptr.append(len(self.tensors))
            self.tensors.append(t)
        self.by_id[id(t)] = (t, slot)  # the tensor kept alive, so its id stays its own
        return slot


_is_cpu = operator.attrgetter("is_cpu")
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_needs_grad = operator.attrgetter("requires_grad")
_nbytes_of = operator.attrgetter("nbytes")


class _Pattern(NamedTuple):
    """Where a treespec's tensors were among its leaves, the last time it was seen."""

    types: list[type]  # the type of each leaf
    where: list[int]  # the places of the tensor leaves
    others: list[int]  # the places of the other leaves
    fill: tuple[int, ...]  # leaf k is (tensors + others)[fill[k]]
    odd: list[int]  # the places, among ``others``, of leaves neither atoms nor tensors: the walk takes them on
    atoms: list[int] | None  # ``others`` when every one is an atom, else None
    order: tuple[int, ...] | None  # ``fill`` when every other leaf is an atom (for Flat.order), else None


def _pattern(types: list[type]) -> _Pattern:
    where = [i for i, tp in enumerate(types) if tp is _Tensor]
    others = [i for i, tp in enumerate(types) if tp is not _Tensor]
    fill = [0] * len(types)
    for k, i in enumerate(where):
        fill[i] = k
    for k, i in enumerate(others, len(where)):
        fill[i] = k
    atoms = _tree.FAST_ATOMS
    odd = [k for k, i in enumerate(others) if types[i] not in atoms]
    if odd:
        return _Pattern(types, where, others, tuple(fill), odd, None, None)
    return _Pattern(types, where, others, tuple(fill), odd, others, tuple(fill))


class _NoGuide(Exception):
    """Internal: the structure holds a node whose details ``flatten_up_to`` does not check."""


_UNGUIDED = frozenset({collections.OrderedDict, collections.defaultdict, collections.deque})
_NoneType = type(None)
# (exact type, (keys in order, their ids) for a dict or its length otherwise,
#  [(key or index, guide) of each child node])
Guide = tuple[type, Any, tuple[tuple[Any, Any], ...]]


def _guide(x: Any) -> Guide | None:
    """Every node of ``x`` as optree sees it: its exact type, its keys in order or its length, its child nodes.

    None for a leaf. ``PyTreeSpec.flatten_up_to(batch)`` takes a batch apart along a known treespec
    ~8x faster than ``tree_flatten``, but lets an OrderedDict or a defaultdict pass for a dict and
    dict keys in another order (which would come back in the treespec's order), and a mismatch costs
    it the repr of the whole subtree in its error message: a millisecond, tensors included. The
    guide, checked first (``_follows``), keeps it to batches exactly like the one the treespec came
    from. A structure holding an OrderedDict, a defaultdict or a deque raises ``_NoGuide``.
    """
    tp = type(x)
    if tp is dict:
        # The treespec's own keys come back, not the batch's: equal is not enough (1 == True ==
        # 1.0, an Enum may equal a str, a fresh string is another object), so the keys must be
        # the very same objects. The guide keeps them alive, so their ids stay theirs.
        keys = list(x)
        return (tp, (keys, list(map(id, keys))), _guided(x.items()))
    if tp is list or tp is tuple or (isinstance(x, tuple) and _tuple_node(tp)):
        return (tp, len(x), _guided(enumerate(x)))
    if tp is _NoneType:
        return (tp, None, ())
    if tp in _UNGUIDED:
        raise _NoGuide
    return None


def _tuple_node(tp: type) -> bool:
    """Whether optree opens a tuple subclass (a namedtuple or a structseq), not keep it as a leaf (torch.Size)."""
    return bool(optree.is_namedtuple_class(tp) or optree.is_structseq_class(tp))


def _guided(items: Any) -> tuple[tuple[Any, Guide], ...]:
    out = []
    for key, value in items:
        guide = _guide(value)
        if guide is not None:
            out.append((key, guide))
    return tuple(out)


def _follows(obj: Any, guide: Guide) -> bool:
    """Whether ``obj`` has every node of ``guide``: same exact types, dict keys in the same order, same lengths."""
    stack: list[tuple[Any, Guide]] = [(obj, guide)]
    pop, push = stack.pop, stack.append
    while stack:
        x, (tp, shape, children) = pop()
        if type(x) is not tp:
            return False
        if tp is dict:
            if list(map(id, x)) != shape[1]:  # type: ignore[call-overload]
                return False
        elif shape is not None and len(x) != shape:  # type: ignore[arg-type]
            return False
        for key, sub in children:
            push((x[key], sub))  # type: ignore[index]
    return True


class _Warm(NamedTuple):
    """The layout of the last batch of a treespec whose tensor leaves were all packed.

    The next batch with the same leaf pattern and the same dtypes reuses it without reading
    every tensor's device, shape and requires_grad: ``write`` checks those per block instead.
    """

    pattern: _Pattern
    dtypes: tuple[torch.dtype, ...]
    layout: Layout
    cast: torch.dtype | None
    max_bytes: int | None
    ragged: list[int]  # places (in walk order) of the tensors in ragged groups, checked one by one
    shapes: tuple[torch.Size, ...]  # their shapes
    entry: _SpecEntry

    def forget(self) -> None:
        """Drop this layout from its entry: it did not fit a batch."""
        if self.entry.warm.get((self.cast, self.max_bytes)) is self:
            self.entry.warm.pop((self.cast, self.max_bytes), None)


def _warm(
    entry: _SpecEntry,
    pattern: _Pattern,
    dtypes: tuple[torch.dtype, ...],
    shapes: tuple[torch.Size, ...],
    layout: Layout,
    cast: torch.dtype | None,
    max_bytes: int | None,
) -> _Warm:
    ragged: list[int] = []
    k = 0
    for g in layout.groups:
        n = g.n if type(g) is Block else len(g.shapes)  # type: ignore[union-attr]
        if type(g) is Ragged:
            ragged.extend(layout.walk_order[k : k + n])
        k += n
    return _Warm(pattern, dtypes, layout, cast, max_bytes, ragged, tuple(shapes[i] for i in ragged), entry)


class _SpecEntry:
    __slots__ = ("flat", "guides", "pattern", "seen", "ties_across", "warm")

    def __init__(self, flat: bool) -> None:
        self.flat = flat  # whether optree and todevice rebuild every node of the treespec alike
        self.pattern: _Pattern | None = None  # replaced whole, never changed: threads may share it
        self.seen = 0
        self.ties_across = False  # move(): a leaf optree keeps whole held a tensor of the batch
        # Warm layouts by (cast, max_bytes): pack() and move() keep one each.
        self.warm: dict[tuple[torch.dtype | None, int | None], _Warm] = {}
        # Guides of batches with this treespec: treespecs that differ only in the order of dict
        # keys are equal, so one entry may need several. None: the structure cannot have one.
        self.guides: list[Guide] | None = []

    def guide_for(self, obj: Any) -> Guide | None:
        """A guide that ``obj`` follows, made the second time the treespec is met (a structure that repeats)."""
        self.seen += 1
        guides = self.guides
        if guides is None or self.seen < 2:
            return None
        for guide in guides:
            if _follows(obj, guide):
                return guide
        if len(guides) >= 4:
            return None
        try:
            made = _guide(obj)
        except (_NoGuide, RecursionError):
            self.guides = None
            return None
        if made is not None:
            self.guides = [*guides, made]  # replaced whole: threads may share the list
        return made


class _SpecCache:
    """What is known of each treespec: whether a Flat skeleton may hold it, its guides, patterns and layouts.

    A training loop sends batches of one structure, so the entry is nearly always found, for the cost
    of hashing the treespec in C++; working out a new one walks every node of the treespec in Python.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.checked = 0  # how many treespecs were worked out, not found: the tests read it
        # Treespecs a Flat skeleton may hold, with what is known of them. A treespec holds its dict
        # keys, defaultdict factories and node classes, so these stay alive while it is cached.
        self._entries: dict[Any, _SpecEntry] = {}
        # The hashes of treespecs that may not: a hash keeps nothing alive (a custom node's aux data
        # can be anything), and two treespecs with one hash only send a batch to the walk.
        self._refused: set[int] = set()
        self._generation = -1  # a registration change can change a verdict

    def get(self, spec: Any) -> tuple[_SpecEntry, bool]:
        """The entry of ``spec``, and whether it is new."""
        entries = self._entries
        if self._generation != _tree._generation[0]:
            entries = self._entries = {}
            self._refused = set()
            self._generation = _tree._generation[0]
        entry = entries.get(spec)
        if entry is not None:
            return entry, False
        key = hash(spec)
        if key in self._refused:
            return _REFUSED, False
        nodes: set[tuple[type, Any]] = set()

        def node(one: Any) -> Any:
            nodes.add((one.type, one.kind))
            return one

        spec.transform(node)
        self.checked += 1
        if not all(_tree.flat_node(tp, kind) for tp, kind in nodes):
            if len(self._refused) >= 4096:
                self._refused.clear()
            self._refused.add(key)
            return _REFUSED, True
        entry = _SpecEntry(True)
        if len(entries) >= self.size:
            entries.clear()
        entries[spec] = entry
        return entry, True


class _Lane:
    """One caller's recent structures: ``pack()`` and the coalesced path share one, plain ``move()`` has its own.

    ``last`` is the treespec of the last batch taken flat, with its guide: the next batch most likely
    has it too, and ``spec.flatten_up_to(batch)`` takes a batch apart along a known treespec ~8x
    faster than ``tree_flatten``, which looks every leaf's type up in optree's registry. The guide is
    the batch's own: treespecs that differ only in the order of dict keys are equal, and share an
    entry. Structures that never repeat (a list whose length changes every batch) would pay for the
    flatten and for working out each treespec: after 3 new treespecs in a row, the next 16 batches
    go straight to the walk, and then the flat path is tried again. So do structures the flat path
    refuses (a PackedSequence inside a dict), which would pay for a flatten every time.
    """

    __slots__ = ("in_place", "last", "misses", "skip")

    def __init__(self) -> None:
        self.last: tuple[Any, _SpecEntry, Guide, int] | None = None  # (spec, entry, guide, generation)
        self.misses = 0
        self.skip = 0
        self.in_place = False  # move(): the last batch had every tensor in place already


_REFUSED = _SpecEntry(False)  # the entry of every treespec a Flat skeleton may not hold
specs = _SpecCache()
packing = _Lane()
moving = _Lane()
# isinstance(x, torch.Tensor) as a C callable: optree asks it first, and a leaf it says yes to skips
# optree's registry lookup, the larger part of optree's cost for a tensor leaf (measured).
_is_tensor = functools.partial(type.__instancecheck__, _Tensor)
_FLAT_ROOTS = _tree.FLAT_BUILTINS - {type(None)}  # a None batch has nothing to take apart


def _flat_root(tp: type) -> bool:
    """Whether a batch of this type may be taken apart by optree: a container optree opens as todevice does.

    A namedtuple with a ``.to()`` (PackedSequence) is an object to todevice, and goes to the walk
    without a flatten.
    """
    if tp in _FLAT_ROOTS:
        return True
    unflatten = _tree.kind_of(tp).unflatten
    return unflatten is _tree._namedtuple_unflatten or unflatten is _tree._structseq_unflatten


def _selected(found: list[torch.Tensor], max_bytes: int | None) -> list[torch.dtype] | None:
    """The dtypes of ``found`` when ``take`` would pack every one of them, or None: checked in bulk."""
    try:
        if not all(map(_is_cpu, found)):
            return None
        dtypes = list(map(_dtype_of, found))
        if not _DENSE_DTYPES.issuperset(dtypes):
            return None
        if (
            max_bytes is not None
            and found
            and (any(map(_needs_grad, found)) or max(map(_nbytes_of, found)) > max_bytes)
        ):
            return None
    except RuntimeError:  # sparse tensors have no nbytes
        return None
    return dtypes


class _FlatTaken(NamedTuple):
    skeleton: _tree.Flat
    sk: _Skeleton
    dtypes: tuple[torch.dtype, ...] | None  # the taken tensors' dtypes, when read already
    entry: _SpecEntry
    warm: _Warm | None  # taken along it: shapes, devices and requires_grad of blocks unread


def flat_leaves(obj: Any, lane: _Lane) -> tuple[Any, _SpecEntry, list[Any], _Pattern] | None:
    """``obj`` taken apart by optree, where optree's rules agree with todevice's: treespec, entry, leaves, pattern.

    None where they may not agree, or where the lane is skipping: the walk takes over.
    """
    if not _flat_root(type(obj)):
        return None
    leaves: list[Any] | None = None
    generation = _tree._generation[0]  # read once: a registration meanwhile makes this batch's guide stale
    last = lane.last
    if last is not None and last[3] == generation:
        spec, entry, guide, _ = last
        # The guide first: it turns another structure away at its first difference, where
        # flatten_up_to would format the repr of the subtree it fails on.
        if _follows(obj, guide):
            try:
                leaves = spec.flatten_up_to(obj)
            except Exception:  # not expected once the guide agrees; the full flatten decides
                leaves = None
    if leaves is None:
        if lane.skip:
            lane.skip -= 1
            return None
        try:
            # The global namespace: types registered with todevice stay leaves, for the walk.
            leaves, spec = optree.tree_flatten(obj, is_leaf=_is_tensor)
            entry, new = specs.get(spec)
        except Exception:  # too deep, cyclic, a failing flatten, or aux data that cannot be compared
            return None
        if new or not entry.flat:  # a new structure, or one the walk must take: the flatten was for nothing
            lane.misses += 1
            if lane.misses >= 3:
                lane.skip, lane.misses = 16, 0
        else:
            lane.misses = 0
        if not entry.flat:
            return None
        made = entry.guide_for(obj)
        if made is not None:
            lane.last = (spec, entry, made, generation)
    types = list(map(type, leaves))
    pattern = entry.pattern
    if pattern is None or pattern.types != types:
        entry.pattern = pattern = _pattern(types)
    return spec, entry, leaves, pattern


def _take_flat(
    obj: Any, max_bytes: int | None, cast: torch.dtype | None, walker: Callable[..., Any], use_warm: bool = True
) -> _FlatTaken | None:
    """The packing walk done by ``optree.tree_flatten``, where optree's rules agree with ours; else None.

    The structure comes apart in C++, and the tensors among its leaves are checked and taken in bulk.
    Leaves optree keeps whole but todevice opens (dataclasses, dict subclasses, sets) go through
    ``walker``.
    """
    got = flat_leaves(obj, packing)
    if got is None:
        return None
    spec, entry, leaves, pattern = got
    found = pick(leaves, pattern.where)
    sk = _Skeleton(max_bytes)
    dtypes: tuple[torch.dtype, ...] | None = None
    warm = entry.warm.get((cast, max_bytes)) if use_warm else None
    if (
        warm is not None
        and warm.pattern is pattern
        and torch.is_grad_enabled()  # so that a stacked block tells whether a tensor requires grad
    ):
        dtypes = tuple(map(_dtype_of, found))
        if dtypes != warm.dtypes or not _ragged_fit(found, warm):
            dtypes = None
    if dtypes is None:
        warm = None
        selected = _selected(found, max_bytes)
        dtypes = None if selected is None else tuple(selected)
    if dtypes is not None and pattern.atoms is not None:  # the usual case: all leaves tensors or atoms
        sk.tensors.extend(found)
        simple = _tree.Flat(spec, pick(leaves, pattern.atoms), pattern.order)
        return _FlatTaken(simple, sk, dtypes, entry, warm)
    if dtypes is not None:
        sk.tensors.extend(found)
        for i, slot in zip(pattern.where, _slot_pool.at_least(len(found))):
            leaves[i] = slot
    elif not any(map(_is_cpu, found)):  # a batch on the device already: nothing to take
        sk.loose.extend(found)
    else:
        take = sk.take
        for i in pattern.where:
            leaves[i] = take(leaves[i])
    if pattern.odd:
        walk = walker(sk.take)
        for k in pattern.odd:
            i = pattern.others[k]
            leaves[i] = walk(leaves[i])
        if len(sk.tensors) != len(found):
            dtypes = None  # the walk took tensors too
    return _FlatTaken(_tree.Flat(spec, leaves), sk, dtypes, entry, None)


def _ragged_fit(found: list[torch.Tensor], warm: _Warm) -> bool:
    """Whether the tensors a warm layout puts in ragged groups still fit them: read one by one."""
    if not warm.ragged:
        return True
    ragged = pick(found, warm.ragged)
    try:
        return (
            tuple(map(_shape_of, ragged)) == warm.shapes
            and all(map(_is_cpu, ragged))
            and not any(map(_needs_grad, ragged))
        )
    except RuntimeError:  # nested tensors have no shape
        return False


class Taken(NamedTuple):
    """What the packing walk found: see ``take_tensors``."""

    skeleton: Any
    tensors: list[torch.Tensor]  # the packed tensors, in walk order
    layout: Layout
    loose: int  # tensors left in the skeleton
    check: _Warm | None  # pass to ``write``: the layout is warm and blocks are still to be checked


def take_tensors(
    obj: Any, max_bytes: int | None, cast: torch.dtype | None, walker: Callable[..., Any], warm: bool = True
) -> Taken:
    """Walk ``obj``: the skeleton, the packed tensors in walk order, their layout, and how many were not packed.

    Packs every plain dense CPU tensor, or with ``max_bytes`` only those up to that size that need
    no autograd. ``walker(take)`` builds the walk (in ``_move``, which owns the container rules)
    that calls ``take`` on every tensor. ``warm=False`` reads every tensor's metadata, after a
    ``Stale`` write.
    """
    flat = _take_flat(obj, max_bytes, cast, walker, warm)
    dtypes: tuple[torch.dtype, ...] | None = None
    if flat is not None:
        skeleton, sk, dtypes = flat.skeleton, flat.sk, flat.dtypes
    else:
        sk = _Skeleton(max_bytes, expected=plans.last_count)
        skeleton = walker(sk.take)(obj)
    tensors = sk.tensors
    try:
        # A repeated address means a tensor met twice or memory shared, which the careful walk
        # sorts out; so does a sparse tensor, which has no data_ptr().
        clean = len(set(map(_Tensor.data_ptr, tensors))) == len(tensors)
        if clean and flat is not None and flat.warm is not None:
            plans.last_count = len(tensors)
            return Taken(skeleton, tensors, flat.warm.layout, 0, flat.warm)
        shapes = tuple(map(_shape_of, tensors))  # nested tensors have no shape
    except RuntimeError:
        clean = False
    if not clean:
        sk = _Skeleton(max_bytes, careful=True)
        skeleton = walker(sk.take)(obj)
        tensors = sk.tensors
        shapes = tuple(map(_shape_of, tensors))
        dtypes = None
    plans.last_count = len(tensors)
    if dtypes is None:
        dtypes = tuple(map(_dtype_of, tensors))
    layout = plans.get(dtypes, shapes, cast)
    if clean and flat is not None and flat.skeleton.order is not None:  # every tensor leaf taken
        pattern = flat.entry.pattern
        assert pattern is not None
        flat.entry.warm[cast, max_bytes] = _warm(flat.entry, pattern, dtypes, shapes, layout, cast, max_bytes)
    return Taken(skeleton, tensors, layout, len(sk.loose), None)


def stage(
    obj: Any,
    max_bytes: int | None,
    cast: torch.dtype | None,
    walker: Callable[..., Any],
    allocate: Callable[[int], torch.Tensor],
) -> tuple[Taken, torch.Tensor | None, tuple[int, ...]]:
    """Take ``obj``'s tensors and write them into a buffer from ``allocate(nbytes)``.

    Returns what was taken, the buffer (None when no tensor was taken) and the places of the taken
    tensors that required grad. A warm layout that does not fit the batch is dropped (``Stale``),
    and the batch taken again, every tensor read.
    """
    warm = True
    while True:
        taken = take_tensors(obj, max_bytes, cast, walker, warm)
        tensors = taken.tensors
        if not tensors:
            return taken, None, ()
        requires_grad: tuple[int, ...] = ()
        # Only pack() takes tensors that require grad (move() leaves them to .to()); a warm layout
        # has none, which write() checks.
        if max_bytes is None and taken.check is None and any(map(_needs_grad, tensors)):
            requires_grad = tuple(k for k, t in enumerate(tensors) if t.requires_grad)
            for k in requires_grad:
                tensors[k] = tensors[k].detach()  # stack(out=) refuses inputs that require grad
        buffer = allocate(taken.layout.nbytes)
        try:
            write(buffer, taken.layout, tensors, taken.check)
        except Stale:  # the last batch's layout did not fit this one: read every tensor
            warm = False
            continue
        return taken, buffer, requires_grad


def pack(obj: Any, /, *, shared: bool = False) -> PackedBatch:
    """Pack every plain dense host tensor in ``obj`` into one buffer: the host half of a transfer.

    The result holds one uint8 buffer with the bytes of every packed tensor (each at a 16-byte
    boundary), the structure with a slot where each tensor was, and the dtypes and shapes. It pickles
    as that one buffer plus a small header, so a DataLoader worker hands over one shared-memory
    segment per batch instead of one per tensor. ``pack(obj).unpack()`` equals ``obj``, value for
    value and type for type; tensors that required grad come back as leaves requiring grad.

    Example:
        >>> import torch, todevice
        >>> batch = {"x": torch.ones(2, 3), "y": torch.arange(2), "name": "b0"}
        >>> packed = todevice.pack(batch)
        >>> packed
        PackedBatch(2 tensors, 48 bytes, 2 groups)
        >>> todevice.move(packed, "meta")["x"].device  # move() and unpack() accept it
        device(type='meta')

    Args:
        obj: Any structure :func:`todevice.move` accepts.
        shared: Put the buffer in shared memory, as a DataLoader worker wants it.

    Returns:
        The :class:`todevice.PackedBatch`.

    Raises:
        ValueError: ``obj`` contains itself, or is nested deeper than Python's recursion limit.

    .. versionadded:: 0.1.0
    """
    from todevice import _move  # the walk and its container rules live there; imported late, one way

    def allocate(nbytes: int) -> torch.Tensor:
        if shared:
            # In a DataLoader worker: straight into shared memory, so that sending it to the main
            # process copies nothing (as default_collate does for each of its tensors).
            storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        return torch.empty(nbytes, dtype=torch.uint8)

    try:
        taken, buffer, requires_grad = stage(obj, None, None, _move._skeleton_walker, allocate)
    except _move._LeafError as failure:
        _move._explain(failure, obj, "", verb="pack")
    except RecursionError as err:
        try:
            for _ in _tree.walk_paths(obj):
                pass
        except _tree.CycleError as cycle:
            raise ValueError(_tree.cycle_message(cycle).replace("Cannot move", "Cannot pack", 1)) from err
        msg = "Cannot pack a structure nested deeper than Python's recursion limit; move() handles it."
        raise ValueError(msg) from err
    if buffer is None:
        buffer = allocate(0)
    return PackedBatch(buffer, taken.layout, taken.skeleton, requires_grad, taken.loose)


class PackedBatch:
    """A structure whose tensors travel in one buffer: made by :func:`todevice.pack`.

    It holds one uint8 buffer with the bytes of every plain dense tensor, the layout of those tensors
    in it, and the structure itself with a slot where each tensor was (non-tensor leaves, and tensors
    that cannot be packed, such as sparse ones, stay in the structure as they are). It pickles as
    one buffer plus a small header, and :func:`todevice.move` accepts it anywhere in a structure.

    Example:
        >>> import torch, todevice
        >>> packed = todevice.pack({"x": torch.arange(3), "y": [torch.ones(2, 2), "label"]})
        >>> packed.buffer.numel()  # 24 bytes of int64 and 16 of float32, each at a 16-byte boundary
        48
        >>> out = packed.unpack()
        >>> out["x"], out["y"][1]
        (tensor([0, 1, 2]), 'label')

    .. versionadded:: 0.1.0
    """

    def __init__(
        self, buffer: torch.Tensor, layout: Layout, skeleton: Any, requires_grad: tuple[int, ...], loose: int = 0
    ) -> None:
        self.buffer = buffer
        self.layout = layout
        self.skeleton = skeleton
        self.requires_grad = requires_grad  # slots whose tensor required grad
        self.loose = loose  # tensors left in the skeleton, not packed (sparse, subclasses, ...)

    def __repr__(self) -> str:
        n = len(self.layout.order)
        return f"PackedBatch({n} tensors, {self.layout.nbytes} bytes, {len(self.layout.groups)} groups)"

    def pin_memory(self, device: Any = None) -> PackedBatch:
        """This batch with its buffer in page-locked memory: one call, whatever the batch holds.

        ``DataLoader(pin_memory=True)`` calls it. Where no pinned memory exists, the batch comes back
        as it is. Tensors that could not be packed are pinned one by one, as the DataLoader does.
        """
        try:
            buffer = self.buffer.pin_memory()
        except RuntimeError:  # no accelerator, or a backend without pinned memory
            return self
        skeleton = self.skeleton
        if self.loose:
            from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

            if type(skeleton) is _tree.Flat:
                skeleton = _tree.Flat(skeleton.spec, pin_structure(skeleton.leaves))  # type: ignore[no-untyped-call]
            else:
                skeleton = pin_structure(skeleton)  # type: ignore[no-untyped-call]
        return PackedBatch(buffer, self.layout, skeleton, self.requires_grad, self.loose)

    def unpack(self, device: Any = None, *, non_blocking: bool = True) -> Any:
        """The structure back, its packed tensors as views of one buffer on ``device``.

        With ``device=None`` the tensors stay in host memory, as views of this batch's buffer. With
        a device, the buffer is sent there in one copy and the tensors are views of the copy;
        tensors that were not packed move one by one, as :func:`todevice.move` moves them.

        Args:
            device: Where the tensors go; None keeps them on the host.
            non_blocking: As in :func:`todevice.move`.

        Returns:
            A structure equal to the one that was packed.
        """
        from todevice import _move  # the walk and its container rules live there; imported late, one way

        return _move.unpack(self, device, non_blocking=non_blocking)
