"""Many tensors in one buffer: taking them out of a structure, their layout, and writing and reading them.

``take`` walks a structure once and leaves a slot where each tensor it takes was: the skeleton. It is optimistic: it
assumes no tensor is met twice and none shares memory with another, checks that in bulk afterwards, and walks again
carefully only when the check fails.

A layout is a pure function of the taken tensors' dtypes and shapes (and a cast), cached per signature. It groups the
tensors by (buffer dtype, shape). A group of two or more tensors is one block, written with one ``torch.stack`` and cut
back into tensors with one ``unbind``; tensors of a shape seen once share a ragged region per dtype, cut with one
``unflatten_dense_tensors``. Either way the per-tensor loop runs in C++: a view made from Python costs about 1.5 us
here, one made inside ``unbind`` about 0.3 us. Every tensor starts at a multiple of ``ALIGN`` bytes, so device kernels
keep their vectorised loads, and the buffer holds the data plus that padding and nothing more."""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from todevice import _options, _stream, _tree, _walk

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


_Regions = list[tuple[Block | Ragged, torch.Tensor]]  # each group with its part of a buffer (``_regions``)


class Layout(NamedTuple):
    """Where every packed tensor lives in the buffer. Slot ``i`` is the ``i``-th tensor in group order."""

    groups: tuple[Block | Ragged, ...]
    nbytes: int
    order: tuple[int, ...]  # order[k]: the place in the buffer of the k-th tensor met in the walk
    walk_order: tuple[int, ...]  # walk_order[i]: which tensor of the walk is the i-th in the buffer
    in_order: bool = False  # the buffer holds the tensors in walk order: nothing to reorder


def tight(lay: Layout) -> bool:
    """Whether ``lay`` leaves no padding between its tensors: their bytes fill the buffer."""
    return all(g.padded == g.shape.numel() if isinstance(g, Block) else not any(g.pads) for g in lay.groups)


def _buffer_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """(dtype in the buffer, dtype handed back): a cast happens on the side that sends fewer bytes."""
    final = _options.cast_to(dtype, cast)
    if final.itemsize < dtype.itemsize:
        return final, final  # cast while packing: fewer bytes cross
    return dtype, final  # cast after the copy, on the receiving side (or none)


@functools.lru_cache(maxsize=64)  # a training loop cycles through a few structures
def layout(dtypes: tuple[torch.dtype, ...], shapes: tuple[torch.Size, ...], cast: torch.dtype | None) -> Layout:
    """The layout of tensors of these dtypes and shapes, in walk order; TypeError for a dtype no byte buffer holds."""
    if not _tree.DENSE_DTYPES.issuperset(dtypes):  # checked here, so a signature laid out before skips the check
        msg = f"Cannot lay out {sorted(map(str, set(dtypes) - _tree.DENSE_DTYPES))} in a byte buffer."
        raise TypeError(msg)
    by_key: dict[tuple[torch.dtype, torch.dtype, torch.Size], list[int]] = {}
    for k, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        by_key.setdefault((*_buffer_dtype(dtype, cast), shape), []).append(k)
    groups: list[Block | Ragged] = []
    walk_order: list[int] = []  # the walk's tensors, in the order the buffer holds them
    offset = 0
    ragged: dict[tuple[torch.dtype, torch.dtype], list[tuple[torch.Size, int]]] = {}
    for (stored, final, shape), members in by_key.items():
        if len(members) == 1:
            ragged.setdefault((stored, final), []).append((shape, members[0]))
            continue
        size = stored.itemsize
        padded = _aligned(shape.numel() * size) // size
        groups.append(Block(stored, final, shape, len(members), padded, offset))
        offset += len(members) * padded * size
        walk_order.extend(members)
    for (stored, final), entries in ragged.items():
        size = stored.itemsize
        shapes_once = tuple(shape for shape, _ in entries)
        pads = tuple(_aligned(s.numel() * size) // size - s.numel() for s in shapes_once)
        nbytes = sum((s.numel() + p) * size for s, p in zip(shapes_once, pads))
        groups.append(Ragged(stored, final, shapes_once, pads, offset, nbytes))
        offset += nbytes
        walk_order.extend(k for _, k in entries)
    order = sorted(range(len(walk_order)), key=walk_order.__getitem__)  # the inverse of walk_order
    return Layout(tuple(groups), offset, tuple(order), tuple(walk_order), walk_order == sorted(walk_order))


@functools.lru_cache(maxsize=32)
def _templates(group: Ragged) -> list[torch.Tensor]:
    """Meta tensors shaped like each tensor and its padding, for ``unflatten_dense_tensors``. Two small tensor objects
    per ragged tensor: 32 groups, as many as the layouts a loop cycles through, not 256, which held ~220 MB for batches
    whose 1,000 shapes changed every time."""
    return [torch.empty(n, dtype=group.dtype, device="meta") for pair in zip(group.shapes, group.pads) for n in pair]


# Whether unflatten_dense_tensors gives an empty tensor its template's shape: torch 2.8 and older give (0,) whatever
# the template, so a (0, 4) tensor came back as (0,). Asked of torch once, here.
_EMPTY_KEEPS_SHAPE = torch._C._nn.unflatten_dense_tensors(torch.empty(0), [torch.empty(0, 2)])[0].shape == (0, 2)


def _cut(region: torch.Tensor, group: Ragged, traced: bool = False) -> list[torch.Tensor]:
    """A ragged region's tensors as views, unpadded: one C++ loop; a slice each if ``traced`` (dynamo traces none)."""
    if traced:
        out, at = [], 0
        for shape, pad in zip(group.shapes, group.pads):
            out.append(region[at : at + shape.numel()].view(shape))
            at += shape.numel() + pad
        return out
    pieces: list[torch.Tensor] = torch._C._nn.unflatten_dense_tensors(region, _templates(group))[::2]
    if not _EMPTY_KEEPS_SHAPE:  # an empty tensor of two or more dimensions came back (0,)
        return [p if p.shape == shape else region[:0].view(shape) for p, shape in zip(pieces, group.shapes)]
    return pieces


@functools.lru_cache(maxsize=1024)
def _block_strides(shape: torch.Size, padded: int) -> tuple[int, ...]:
    """Strides of a block: ``padded`` elements from one tensor to the next, each tensor contiguous."""
    return (padded, *(shape[d + 1 :].numel() for d in range(len(shape))))


def _regions(buffer: torch.Tensor, lay: Layout, traced: bool = False) -> _Regions:
    """Each group's part of ``buffer``, typed: (count, *shape) for a block, 1-D for a ragged group. ``traced``: under
    dynamo, which traces no ``storage_offset()`` (a slice has it) nor the strides' cache."""
    out: _Regions = []
    strides: Callable[..., tuple[int, ...]] = _block_strides.__wrapped__ if traced else _block_strides
    for g in lay.groups:
        size = g.dtype.itemsize
        typed = buffer.view(g.dtype)  # every group starts and ends on an ALIGN boundary
        if traced:
            typed, offset = typed[g.start // size :], None
        else:
            offset = typed.storage_offset() + g.start // size
        if isinstance(g, Block):
            out.append((g, typed.as_strided((g.n, *g.shape), strides(g.shape, g.padded), offset)))
        else:
            out.append((g, typed.as_strided((g.nbytes // size,), (1,), offset)))
    return out


def write(buffer: torch.Tensor, lay: Layout, walked: Sequence[torch.Tensor], regions: _Regions | None = None) -> None:
    """Copy ``walked`` (in walk order) into ``buffer`` (its ``_regions`` if given): one or two C++ calls a group."""
    tensors = walked if lay.in_order else pick(walked, lay.walk_order)
    k = 0
    for g, region in _regions(buffer, lay) if regions is None else regions:
        n = len(g.shapes) if isinstance(g, Ragged) else g.n
        group = list(tensors[k : k + n])
        k += n
        if isinstance(g, Ragged):
            torch._foreach_copy_(_cut(region, g), group)
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
_below_autograd_views = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)


def gathered(tensors: Sequence[torch.Tensor], lay: Layout, dev: torch.device) -> torch.Tensor:
    """``tensors`` (in walk order, all on ``dev``) written into one new byte buffer there: a kernel or two per group;
    below autograd, as :func:`read` cuts: no tensor written needs grad, and the buffer is copied away at once."""
    with _below_autograd_views():
        buffer = torch.empty(lay.nbytes, dtype=torch.uint8, device=dev)
        write(buffer, lay, tensors)
    return buffer


# A tensor that comes back to the host by itself (coalesce=False, or one needing grad) lands in page-locked
# memory up to this size, its copy asynchronous until the one wait before move() returns; larger ones are
# copied into pageable memory. The caching host allocator keeps every pinned block it ever made, rounded up to
# a power of two, so a 640 MiB result would otherwise lock 1 GiB of host memory for good.
PINNED_RESULT_MAX_BYTES = _options.COALESCE_MAX_BYTES


def asynchronous(non_blocking: bool, dev: torch.device, t: torch.Tensor | None = None, waited: bool = True) -> bool:
    """The one rule for a copy's ``non_blocking``, from move()'s, for ``t`` to ``dev`` (``t`` None: the tensors are
    not seen, as by an object's own ``.to()``). Into host memory a copy is asynchronous only where the move waits for
    it before returning (``waited``: not under torch.compile, not into out=), and a tensor's only up to
    ``PINNED_RESULT_MAX_BYTES``, which land pinned. To MPS only from pinned memory (pytorch#83015: zeros)."""
    if not non_blocking:
        return False
    if dev.type == "mps":
        return t is not None and t.is_pinned()
    if dev.type == "cpu":
        return waited and (t is None or nbytes(t) <= PINNED_RESULT_MAX_BYTES)
    return True


def staged_alone(t: torch.Tensor, stage: bool) -> bool:
    """Whether ``t``, sent by itself where pageable sources may cross through pinned memory (``stage``, from
    ``stages``), crosses so: a host tensor over ``PAGEABLE_DIRECT_MAX_BYTES_ONE``, where the driver would wait."""
    return stage and t.is_cpu and nbytes(t) > PAGEABLE_DIRECT_MAX_BYTES_ONE


def stages(non_blocking: bool, dev: torch.device) -> bool:
    """Whether pageable sources may cross through pinned memory: non_blocking, to an accelerator but MPS, whose
    memory is unified and where a copy from pageable memory may not be asynchronous at all (pytorch#83015)."""
    return non_blocking and dev.type not in _stream.HOST_TYPES and dev.type != "mps"


def landed(buffer: torch.Tensor) -> torch.Tensor:
    """A gathered buffer on an accelerator copied to the host with one blocking copy, into pageable memory. Measured on
    an H100: the copy of 1,000 gathered scalars and its wait cost the host 11.6 us blocking, and 10.9 us asynchronous
    into pinned memory plus a 1.7 us pinned allocation. But a pinned allocation first queries the event of every pinned
    block freed since the last one: after a move that left 1,000 small pinned results, moving 1,000 scalars back took
    5.3 ms with a pinned buffer and 3.5 ms with a blocking copy (bench/README.md, "Device to host"). The blocking copy
    waits for the work queued on the current stream, as the one wait would."""
    return buffer.to("cpu")


def read(
    buffer: torch.Tensor, lay: Layout, cast: torch.dtype | None = None, made: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The packed tensors, in walk order, sharing ``buffer``'s memory (or one cast copy's per group). ``cast`` turns
    floating-point and complex groups into that dtype; each tensor made for it is appended to ``made``, to record."""
    views: list[torch.Tensor] = []
    traced = torch.compiler.is_dynamo_compiling()
    for g, region in _regions(buffer, lay, traced):
        final = _options.cast_to(g.final, cast)
        if final != g.dtype:
            region = region.to(final)  # one cast per group, on the receiving side
            if made is not None:
                made.append(region)
        # Cut below autograd's view tracking: each tensor comes out as a plain tensor over its part of the memory, as
        # independent as one from .to(). Views would share one version counter, so an in-place change to one tensor of
        # the batch would fail the backward pass of any other saved for it ("modified by an inplace operation"), and
        # unbind()'s views also refuse in-place changes mixed with autograd (x.mul_(w), w requiring grad). It is the
        # cheaper way too: no autograd metadata, and no detach() after.
        with contextlib.nullcontext() if traced else _below_autograd_views():  # which dynamo does not trace
            if isinstance(g, Block):  # under dynamo a slice each: unbind's views refuse in-place changes with autograd
                views.extend([region[i] for i in range(g.n)] if traced else region.unbind(0))
            else:
                views.extend(_cut(region, g, traced))
    return views if lay.in_order else pick(views, lay.order)


# ---------------------------------------------------------------- what a batch sends, and how

# Every threshold below rests on figures measured on one H100 with torch 2.11 (bench/README.md, "Host to
# device: the measured facts the plan rests on").
#
# A copy from pageable host memory with non_blocking=True: the driver copies the source into staging memory of its own
# and returns at once while little is pending, and only past that waits for every kernel queued on the stream. With
# 20 ms of work queued the host did not wait for one tensor of up to 2 MiB, for 8 of 32 KiB (256 KiB in all), or (with
# 5 ms queued) for 3 of 128 KiB (384 KiB); it waited the whole 20 ms for one of 4 MiB and for 8 of 128 KiB (1 MiB).
# Below these, staging through pinned memory buys nothing and costs a pinned allocation and a host memcpy.
PAGEABLE_DIRECT_MAX_BYTES = 384 * 1024  # several tensors, all in all
PAGEABLE_DIRECT_MAX_BYTES_ONE = 2 * 1024 * 1024  # a tensor alone

# The most one move stages. PyTorch's caching host allocator keeps every pinned block it makes for the life
# of the process, rounded up to a power of two: a 14 GB state dict staged in one block would lock 16 GiB for
# good. Past this, the rest of the tensors go straight, and the host waits for queued work as .to() does.
STAGE_MAX_BYTES = 256 * 1024 * 1024

# Small tensors are coalesced (one pinned write, one copy, views) from this many. Measured: a copy
# launch costs the host 14.4 us, a pinned allocation 2.3 us, a view 2.4 us; moving 10 small tensors
# coalesced took 1.18x the host time of 10 per-tensor .to() calls, 100 took 0.38x, 1,000 0.31x.
# Coalesced moves cost about 54 us plus 2.25 us a tensor (the 100 and 1,000 figures), per-tensor
# copies 7.3 to 8.7 us a tensor: the break-even lies between 8 and 11 tensors; 16 leaves a margin.
COALESCE_MIN_TENSORS = 16


# The most one buffer of coalesced tensors holds: a small tensor kept from a batch keeps its whole buffer alive,
# so this bounds what it holds. Measured: a copy launch costs the host 14.4 us, and a pinned copy runs at 52 GB/s,
# so 4 MiB take 80 us to cross; at that size the launches stay well under the transfer time.
COALESCED_MAX_BYTES = 4 * 1024 * 1024


def sent(
    tensors: list[torch.Tensor], lay: Layout, cast: torch.dtype | None, dev: torch.device, send: Callable[..., Any]
) -> list[torch.Tensor]:
    """``tensors`` written into host staging buffers for ``dev``, each handed to ``send``, which gives back its views:
    in runs of at most ``COALESCED_MAX_BYTES`` (what one kept view holds alive), one buffer and one copy each."""
    runs = [(tensors, lay)]
    if lay.nbytes > COALESCED_MAX_BYTES:
        runs, start, nbytes = [], 0, 0
        for i, t in enumerate(tensors):
            size = _aligned(t.numel() * _buffer_dtype(t.dtype, cast)[0].itemsize)
            if nbytes + size > COALESCED_MAX_BYTES and i > start:
                runs.append((tensors[start:i], layout_for(tensors[start:i], cast)))
                start, nbytes = i, 0
            nbytes += size
        runs.append((tensors[start:], layout_for(tensors[start:], cast)))
    views: list[torch.Tensor] = []
    for part, one in runs:
        buffer = staging(one.nbytes, dev)[0]
        write(buffer, one, part)
        views += send(buffer, one)
    return views


def layout_for(tensors: Sequence[torch.Tensor], cast: torch.dtype | None) -> Layout:
    """The layout of these tensors, in this order."""
    dtypes = tuple(map(dtype_of, tensors))
    if not any(map(_Tensor.dim, tensors)):  # 0-dim tensors (a step's metrics): one shape, never read per tensor
        return layout(dtypes, (_SCALAR,) * len(tensors), cast)
    return layout(dtypes, tuple(map(shape_of, tensors)), cast)


class Sending(NamedTuple):
    """How one move sends its host tensors to an accelerator: a pure function of what it holds (``sending``)."""

    together: bool  # the small tensors go in one pinned buffer, with one copy, and come back as views of it
    staged: bool  # the host tensors copied alone go through one pinned buffer, each with a copy of its own


def sending(small: int, small_bytes: int, alone: int, alone_bytes: int, coalesce: bool | None) -> Sending:
    """What to do with ``small`` small host tensors (``small_bytes`` in all) and ``alone`` others; ``coalesce`` None
    lets the count decide. Whatever is not coalesced is copied alone, straight from where it is while the driver copies
    that much without waiting (``PAGEABLE_DIRECT_MAX_BYTES``), otherwise all of it through one pinned buffer. Pinned
    tensors count here as pageable: telling them apart costs a call each, and they are sent as they are anyway."""
    together = small > 0 and (small >= COALESCE_MIN_TENSORS if coalesce is None else coalesce)
    if not together:
        alone, alone_bytes = alone + small, alone_bytes + small_bytes
    limit = PAGEABLE_DIRECT_MAX_BYTES_ONE if alone == 1 else PAGEABLE_DIRECT_MAX_BYTES
    return Sending(together, alone_bytes > limit)


# A staged tensor over this many bytes is written and sent in pieces of this size, so that the link carries one
# piece while the host writes the next: a 128 MiB tensor is no longer written whole before its first byte crosses.
# Tensors are already sent one by one as they are written, so this shortens only the wait for the first piece,
# at the cost of one more copy launch a piece. Measured: a copy launch costs the host 14.4 us, a pinned copy runs at
# 52 GB/s; for S bytes in pieces of C, the pieces' launches (S/C x 14.4 us) and the last piece's crossing (C / 52
# GB/s) cost least at C = sqrt(S x 14.4 us x 52 GB/s): 10 MB for 128 MiB, 3.5 MB for 16 MiB. 8 MiB is the power of
# two nearest the first; for a 16 MiB tensor it costs one launch more (14 us) and saves half a write. The sweep in
# bench/gpu_check.py measures the sizes around it (bench/README.md).
STAGE_CHUNK_BYTES = 8 * 1024 * 1024


def staging(nbytes: int, dev: torch.device, pinned: bool = True) -> tuple[torch.Tensor, bool]:
    """The one staging buffer, move()'s and out='s: ``nbytes`` of host memory for ``dev``, and whether it is page-locked
    (for an accelerator, if ``pinned`` and it is had), else pageable (host, meta, none left), whose copy blocks."""
    buffer = _stream.pinned(nbytes, torch.uint8, dev) if pinned and _stream.is_accelerator(dev) else None
    return (torch.empty(nbytes, dtype=torch.uint8), False) if buffer is None else (buffer, True)


def stageable(t: torch.Tensor) -> bool:
    """Whether ``t`` is a pageable host tensor that :func:`send_staged` sends: ``_tree.dense``, on the host, not pinned
    (that one is sent as it is, never read on the host), and not one autograd must follow."""
    return _tree.dense(t) and t.is_cpu and not (t.requires_grad and torch.is_grad_enabled()) and not t.is_pinned()


def send_staged(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Copy each :func:`stageable` host source into its target, dense on one accelerator, through one pinned buffer. One
    allocation from the caching host allocator for all of them (which hands the block out again once the copies from it
    have finished), one host memcpy and one asynchronous copy each, and no wait: the host returns once the copies are
    queued. A tensor over ``STAGE_CHUNK_BYTES`` laid out as its target (dense, with the target's strides, as ``stage()``
    makes targets) is written and sent in pieces of that size, each piece's copy queued before the next is written. A
    cast is made on the side with fewer bytes. False, with nothing copied, where no pinned memory could be had."""
    plan: list[tuple[int, torch.dtype]] = []
    total = 0
    for src, out in pairs:
        sent = out.dtype if out.dtype.itemsize < src.dtype.itemsize else src.dtype
        plan.append((total, sent))
        total += _aligned(src.numel() * sent.itemsize)
    if total == 0:
        return True  # empty tensors: nothing to send
    buffer = _stream.pinned(total, torch.uint8, pairs[0][1].device)
    if buffer is None:
        return False
    for (src, out), (at, sent) in zip(pairs, plan):
        n = src.numel()
        if n == 0:
            continue
        flat = buffer[at : at + n * sent.itemsize].view(sent)
        if src.is_neg() or src.is_conj():  # a lazy negation: copy_ into another dtype drops it (torch 2.13, float16)
            src = src.resolve_neg().resolve_conj()
        target = out.as_strided((n,), (1,), out.storage_offset())  # out is dense: one span of n
        starts = range(0, n, max(1, STAGE_CHUNK_BYTES // sent.itemsize))  # where each piece starts, in elements
        if len(starts) > 1 and src.stride() == out.stride():  # dense too, then (channels-last images, say)
            # Both in memory order: the same elements, in the same order, as one span of n each.
            source, step = src.as_strided((n,), (1,), src.storage_offset()), starts.step
            for lo in starts:
                flat[lo : lo + step].copy_(source[lo : lo + step])
                target[lo : lo + step].copy_(flat[lo : lo + step], non_blocking=True)
            continue
        flat.as_strided(out.shape, out.stride()).copy_(src)  # laid out as the target is
        target.copy_(flat, non_blocking=True)
    return True


def stage(tensors: Sequence[torch.Tensor], dev: torch.device, dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
    """The pageable ones of ``tensors`` copied to ``dev`` through one pinned buffer, if there are more bytes of them
    than the driver copies without waiting; by id of their source. Pinned tensors are left out (they are sent as they
    are), and so are those :func:`stageable` refuses, a tensor over the same memory as one staged already (its copy is a
    view of that one's, as the walk makes it), and those past ``STAGE_MAX_BYTES``. The copies are cast to ``dtype``
    where move() casts, and keep a dense source's strides, as ``.to()`` does. Empty where staging does not pay or fails
    (no pinned memory, no room on the device): each tensor is then copied by itself, and an error names its path."""
    pageable: list[torch.Tensor] = []
    seen = _walk.Seen()
    total = 0
    for t in tensors:
        if not stageable(t) or seen.find(t) is not None or total + t.nbytes > STAGE_MAX_BYTES:
            continue
        seen.add(t, None)
        pageable.append(t)
        total += t.nbytes
    if not sending(0, 0, len(pageable), total, False).staged:
        return {}
    with contextlib.suppress(Exception):  # each is copied by itself, and its error names its path
        pairs = [(t, torch.empty_like(t, dtype=_options.cast_to(t.dtype, dtype), device=dev)) for t in pageable]
        if send_staged(pairs):
            return {id(t): out for t, out in pairs}
    return {}


# ---------------------------------------------------------------- taking the tensors out


def nbytes(t: torch.Tensor) -> int:
    """``t.nbytes``; 0 for a sparse tensor, which has none."""
    try:
        return t.nbytes
    except RuntimeError:
        return 0


def distinct(sources: list[torch.Tensor]) -> bool:
    """Whether no tensor repeats among ``sources`` and none shares memory with another: checked in bulk."""
    try:
        if len(sources) == 2:  # a common small batch: no set to build
            if sources[0].data_ptr() != sources[1].data_ptr():
                return True
        elif len(set(map(data_ptr, sources))) == len(sources):
            return True
        ptrs = list(map(data_ptr, sources))
    except RuntimeError:  # sparse tensors and wrapper subclasses have no single storage
        return False
    # Meta and empty tensors all sit at address 0 and share nothing: they are told apart by identity.
    held = [p for p in ptrs if p]
    empty = [id(t) for t, p in zip(sources, ptrs) if not p]
    return len(set(held)) == len(held) and len(set(empty)) == len(empty)


# Slots made once: a skeleton holds one per tensor taken, and Slot(i) is always the same value.
_SLOTS = tuple(map(_tree.Slot, range(4096)))
NEVER: Callable[[torch.Tensor], bool] = functools.partial(operator.is_, None)  # a "keep" that says no, in C
_SCALAR = torch.Size([])  # the shape of 0-dim tensors, made once
# Tensor attributes, each read for many tensors in one C loop with map() (here, and by _into).
data_ptr = _Tensor.data_ptr
is_cpu = operator.attrgetter("is_cpu")
requires_grad = operator.attrgetter("requires_grad")
dtype_of = operator.attrgetter("dtype")
shape_of = operator.attrgetter("shape")
device_of = operator.attrgetter("device")
nbytes_of = operator.attrgetter("nbytes")
layout_of = operator.attrgetter("layout")


class _Taking:
    """One take's state: the tensors taken, in walk order, and those left in the skeleton."""

    __slots__ = ("alone", "devices", "grad", "loose", "max_bytes", "seen", "tensors")

    def __init__(self, max_bytes: int | None, grad: bool, devices: bool) -> None:
        self.max_bytes = max_bytes
        self.grad = grad
        self.devices = devices  # take tensors off the host (False), or off every other device (True)
        self.tensors: list[torch.Tensor] = []
        self.loose: list[Any] = []  # tensors and objects with .to() left in the skeleton
        self.alone: list[torch.Tensor] = []  # of those, the plain tensors on the side taken from (large, or grad)
        self.seen = _walk.Seen()  # the careful take's: each tensor taken, with its slot


def _take(t: torch.Tensor, s: _Taking) -> Any:
    """The optimistic take: a slot for every plain tensor on the side taken from (up to ``max_bytes``; needing grad if
    ``grad``). Whether each is dense, and of a dtype a byte buffer holds, is checked afterwards in bulk."""
    if type(t) is not _Tensor or t.is_cpu is s.devices:
        s.loose.append(t)
        return t
    try:
        big = s.max_bytes is not None and t.nbytes > s.max_bytes
    except RuntimeError:  # sparse tensors have no nbytes
        big = True
    # A large tensor keeps its own memory; move() coalesces tensors that need no autograd only.
    if big or (t.requires_grad and not s.grad):
        s.loose.append(t)
        s.alone.append(t)
        return t
    tensors = s.tensors
    tensors.append(t)
    try:
        return _SLOTS[len(tensors) - 1]
    except IndexError:
        return _tree.Slot(len(tensors) - 1)


def _take_carefully(t: torch.Tensor, s: _Taking) -> Any:
    """The take for a structure that repeats tensors, ties memory, or holds exotic tensors."""
    if (
        not _tree.dense(t)  # sparse, mkldnn, nested and functorch-wrapped tensors travel as they are
        or t.is_cpu is s.devices
        or (s.max_bytes is not None and t.nbytes > s.max_bytes)
        or (t.requires_grad and not s.grad)
    ):
        s.loose.append(t)
        if type(t) is _Tensor and t.is_cpu is not s.devices:
            s.alone.append(t)
        return t
    found = s.seen.find(t)
    if found is None:
        slot: Any = _tree.Slot(len(s.tensors))
        s.tensors.append(t)
    elif found[2]:
        return found[1]  # the same tensor again: the same slot
    else:
        slot = _tree.AliasSlot(int(found[1]))  # tied memory: a new view of the same packed tensor
    s.seen.add(t, slot)
    return slot


def _as_it_is(x: Any, code: int, s: _Taking) -> Any:
    """Objects with .to(), packed batches, unknown objects: left in the skeleton (the first counted as loose)."""
    if code == _tree.TO:
        s.loose.append(x)
    return x


class Takes(NamedTuple):
    """The optimistic and the careful take, made once: by a move's plan, or for ``pack()`` (``PACKING``)."""

    optimistic: _walk.Walk
    careful: _walk.Walk
    devices: bool


def takes(skip: frozenset[Any], devices: bool) -> Takes:
    """The takes that leave the items under the keys in ``skip`` as they are: of host tensors, or with ``devices``
    of tensors off the host, where host tensors stay where they are at the cost of a C call each."""
    keep = is_cpu if devices else NEVER
    return Takes(
        _walk.make(keep, _take, _as_it_is, _tree.kind_for_packing, skip=skip),
        _walk.make(keep, _take_carefully, _as_it_is, _tree.kind_for_packing, skip=skip),
        devices,
    )


PACKING = takes(frozenset(), False)


class Taken(NamedTuple):
    """What ``take`` found."""

    skeleton: Any  # the structure, a slot where each taken tensor was
    tensors: list[torch.Tensor]  # the taken tensors, in walk order
    layout: Layout
    loose: list[Any]  # tensors and objects with .to() left in the skeleton
    alone: list[torch.Tensor]  # of those, the plain tensors on the side taken from: large, or needing grad


def take(obj: Any, walks: Takes, max_bytes: int | None, cast: torch.dtype | None, grad: bool = False) -> Taken:
    """Take every plain dense host tensor up to ``max_bytes`` out of ``obj`` (those needing grad if ``grad``) by
    ``walks`` (``takes``): with their ``devices``, every such tensor off the host instead. Raises what the walk raises:
    ``RecursionError`` for deep or cyclic structures, ``LeafError`` from a registered flatten."""
    optimistic, careful, devices = walks
    taking = _Taking(max_bytes, grad, devices)
    skeleton = optimistic.walk(obj, taking)
    try:
        # A repeated address means a tensor met twice or memory shared, which the memo walk
        # sorts out; so does a sparse tensor, which has no data_ptr(), a nested one, no shape, and
        # a quantized one, a dtype a byte buffer does not hold.
        if len(set(map(data_ptr, taking.tensors))) == len(taking.tensors):
            return Taken(skeleton, taking.tensors, layout_for(taking.tensors, cast), taking.loose, taking.alone)
    except (RuntimeError, TypeError):
        pass
    taking = _Taking(max_bytes, grad, devices)
    skeleton = careful.walk(obj, taking)
    return Taken(skeleton, taking.tensors, layout_for(taking.tensors, cast), taking.loose, taking.alone)
