"""move(batch, out=static): each tensor of a batch copied into the matching tensor of a structure that stays.

CUDA graphs and persistent inference buffers read the same device memory on every step. Each step,
the batch's tensors are paired with ``static``'s by path, every pair is checked before anything is
written, and the copies go in order on the current stream, after the work queued there that reads
``static``. The small host tensors are written into one staging buffer (page-locked where the target
is an accelerator). When their destinations are views of one buffer laid out as coalescing lays them
out, which is what ``move(example, device)`` returns for small tensors, that staging buffer is sent
into it with one copy, or one per group where the layout leaves padding between them; otherwise each
goes with a copy of its own.

The one-buffer step: ``move(batch, out=static)`` finds on each call whether its targets are laid out so
(``step_for``); a StaticBatch finds it once and keeps it. The step (``fed``) reads each source's type and
dtype and the shape of a few, and leaves the rest to the writes into the staging buffer, which refuse a
wrong shape, device or layout, or a tensor requiring grad, before a target is written; the caller then
runs the full check (``checked``: each pair, named by its path in ``out``, then memory the targets share).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
from typing import Any, NamedTuple, NoReturn

import torch

from todevice import _layout, _options, _passed, _tree, _walk
from todevice._layout import data_ptr, device_of, dtype_of, is_cpu, layout_of, nbytes_of, pick, requires_grad, shape_of

_Tensor = torch.Tensor


def into(
    batch: Any,
    out: Any,
    dev: torch.device | None,
    non_blocking: bool,
    dtype: torch.dtype | None,
    coalesce: bool | None,
    max_bytes: int,
    stream: Any,
    strict: bool,
    skip: frozenset[Any],
) -> Any:
    """``move(batch, dev, out=out, ...)``, its device and options checked: ``out`` itself, its
    tensors holding ``batch``'s values."""
    if stream is not None:
        msg = (
            "Cannot copy into out= on a side stream: the copies overwrite memory that work on the current "
            "stream may still read, so they go on the current stream, in order after it. Pass stream=None."
        )
        raise TypeError(msg)
    if strict:
        _passed.refuse_unknown(batch, skip)
    copy(*_walk.paired(batch, out, skip), out, dev, Copying(non_blocking, dtype, coalesce, max_bytes))
    return out


class Copying(NamedTuple):
    """``copy``'s options; ``find_step``: look for the one-buffer step (a StaticBatch, which holds it, has tried it)."""

    non_blocking: bool
    dtype: torch.dtype | None
    coalesce: bool | None
    max_bytes: int
    find_step: bool = True


def copy(
    sources: list[torch.Tensor], targets: list[torch.Tensor], out: Any, dev: torch.device | None, how: Copying
) -> None:
    """Each source into its target, every pair checked first (ValueError naming the path in ``out``), as if every
    source were read before anything is written."""
    non_blocking, dtype, coalesce, max_bytes, find_step = how
    if not sources:  # no tensor to copy: out as it is
        return
    step = step_for(targets, max_bytes) if find_step and dtype is None and coalesce is not False else None
    if step is not None and (dev is None or step.span.device == dev) and fed(step, sources, non_blocking):
        return  # the common step, in few reads
    sources, read = checked(sources, targets, out, dev, dtype)
    with torch.no_grad():
        # On the current stream: large or device tensors each alone; the small host tensors in one copy (one per group
        # where the layout has padding) where their targets are one buffer laid out as ``lay``, else in one C++ loop
        # into host memory, or from one staging buffer (page-locked for an accelerator) with a copy each.
        small = [i for i, (host, n) in enumerate(zip(read.on_host, read.nbytes)) if host and n <= max_bytes]
        lay = None
        every = len(small) == len(sources)
        if small:
            shapes, dtypes = read[:2] if every else (pick(read.shapes, small), pick(read.dtypes, small))
            try:
                lay = _layout.layout(tuple(dtypes), tuple(shapes), None)
            except TypeError:  # a dtype a byte buffer does not hold: each alone
                small, every = [], False
        if not every:
            together = set(small)
            for i, (src, dst) in enumerate(zip(sources, targets)):
                if i not in together:
                    try:
                        _alone(src, dst, non_blocking)
                    except Exception as err:
                        where = f"{_path(out, dst)} ({_walk.describe(src)})"
                        _walk.raise_with_message(err, f"Cannot copy into out at {where}: {err}")
            sources, targets = pick(sources, small), pick(targets, small)
        if lay is None:
            return
        span = _one_span(targets, lay, coalesce is not False)
        if span is None and (any(map(_Tensor.is_conj, targets)) or any(map(_Tensor.is_neg, targets))):  # lazily
            for src, dst in zip(sources, targets):  # conjugated or negated: each copied as copy_() resolves it
                dst.copy_(src, non_blocking=_layout.asynchronous(non_blocking, dst.device, src, waited=False))
        elif span is None and all(map(is_cpu, targets)):
            torch._foreach_copy_(targets, sources)
        elif span is not None and targets[0].is_cpu:
            _layout.write(span, lay, sources)  # each target's bytes only
            written(targets)
        else:
            staging, asynchronous = _layout.staging(lay.nbytes, targets[0].device, pinned=non_blocking)
            _layout.write(staging, lay, sources)  # casts where the targets' dtypes ask
            if span is None:
                torch._foreach_copy_(targets, _layout.read(staging, lay), non_blocking=asynchronous)
            else:
                send(span, staging, lay, _layout.tight(lay), asynchronous)
                written(targets)


class Step(NamedTuple):
    """A step into targets that are views of one buffer laid out as coalescing lays it out, a layout that proves what
    the full check reads target by target: they are plain, contiguous, distinct, apart and on one device."""

    lay: _layout.Layout
    span: torch.Tensor  # the targets' bytes
    whole: bool  # one copy of the span may write them: no byte of it is another tensor's (else a copy per group)
    dtypes: list[torch.dtype]  # the targets', which the sources must have
    # The sources a step reads the shape, device and requires_grad of (the first of each block, each of a ragged
    # group), and their shapes, as the targets have them.
    probe: tuple[int, ...]
    shapes: list[torch.Size]
    inference: bool  # a target is an inference tensor, written inside torch.inference_mode() only
    grad: bool  # a target requires grad
    targets: list[torch.Tensor]  # each with a version counter of its own, which a write through the span does not move


def step_for(targets: list[torch.Tensor], max_bytes: int, owned: bool = False) -> Step | None:
    """The one-buffer step for ``targets``, or None where they are not views of one buffer laid out as coalescing lays
    it out, are lazily conjugated or negated (which a copy of bytes would not resolve), or hold a tensor over
    ``max_bytes`` in a buffer over it (such a tensor goes alone). ``owned``: the buffer was made for them alone
    (``todevice.static()``), so its padding is no other tensor's."""
    if set(map(type, targets)) != {_Tensor}:
        return None
    try:
        dtypes, shapes = list(map(dtype_of, targets)), list(map(shape_of, targets))
        lay = _layout.layout(tuple(dtypes), tuple(shapes), None)
        if lay.nbytes > max_bytes and max(map(nbytes_of, targets)) > max_bytes:
            return None
        span = _one_span(targets, lay, True)
    except (RuntimeError, TypeError, NotImplementedError):  # no shape or storage (nested, sparse); a dtype a byte
        return None  # buffer does not hold: the full check names it
    if span is None:
        return None
    probe: list[int] = []  # stack() checks that a block's tensors have one shape; a ragged group's are copied each
    k = 0
    for g in lay.groups:
        n, read = (g.n, 1) if isinstance(g, _layout.Block) else (len(g.shapes), len(g.shapes))
        probe.extend(lay.walk_order[k : k + read])
        k += n
    inference, grad = any(map(_Tensor.is_inference, targets)), any(map(requires_grad, targets))
    return Step(
        lay, span, owned or _layout.tight(lay), dtypes, tuple(probe), pick(shapes, probe), inference, grad, targets
    )


def fed(step: Step, sources: list[torch.Tensor], non_blocking: bool, held: Any = None) -> bool:
    """The one-buffer step: each source's type and dtype read, and the shape, device and requires_grad of a few; the
    sources written into one staging buffer (``held``: a host one and its regions, for host targets), then sent
    into the targets. False, with no target written, where the full check is to run and name what differs. Every
    source is read before a target is written, so sources over the targets copy as if read first."""
    if set(map(type, sources)) != {_Tensor} or list(map(dtype_of, sources)) != step.dtypes:
        return False
    probed = pick(sources, step.probe)
    try:
        if (
            list(map(shape_of, probed)) != step.shapes
            or not all(map(is_cpu, probed))
            or (torch.is_grad_enabled() and any(map(requires_grad, probed)))
            or _tree.transforming()  # inside torch.func.vmap or grad: wrappers with no memory of their own
            or (step.inference and not torch.is_inference_mode_enabled())
        ):
            return False
    except RuntimeError:  # a strided nested tensor has no shape
        return False
    if held is None:
        staging, pinned = _layout.staging(step.lay.nbytes, step.span.device, pinned=non_blocking)
        held = staging, pinned, _layout._regions(staging, step.lay)
    staging, pinned, regions = held
    try:
        # Written with grad mode as it is: a block's stack(out=) refuses a source requiring grad, another device or
        # layout, and its fallback's copy of one marks the block's region, read once here instead of every source's
        # requires_grad. A tensor of a shape of its own was read above: an empty one _foreach_copy_ marks nothing.
        _layout.write(staging, step.lay, sources, regions)
        if any(region.requires_grad for _, region in regions):
            return False
    except Exception:  # refused before a target is written: the full check names it
        return False
    with torch.no_grad() if step.grad else contextlib.nullcontext():  # no_grad() alone: 3.7 us on a 2-core x86 host
        send(step.span, staging, step.lay, step.whole, pinned, regions)
    written(step.targets, step.inference)
    return True


def written(targets: list[torch.Tensor], inference: bool | None = None) -> None:
    """Tell autograd that every target was written in place, as a copy_() into each would: a write through one view of
    their buffer moves only that view's version counter, and tensors cut from one buffer (a coalesced move's, or
    ``todevice.static()``'s) each have their own. A tensor saved for a backward pass then fails it, as it should,
    rather than giving gradients of the new values. 80 ns a tensor on a 2-core x86 host. An inference tensor has no
    version counter: none is marked where one is among them (``inference``, when known)."""
    if inference or (inference is None and any(map(_Tensor.is_inference, targets))):
        return
    if _BUMPS_LISTS:
        torch._C._increment_version(targets)
    else:
        for t in targets:
            torch._C._increment_version(t)


try:  # torch 2.4 bumps one tensor a call, and raises RuntimeError for a list
    torch._C._increment_version([torch.empty(0)])
    _BUMPS_LISTS = True
except (TypeError, RuntimeError):
    _BUMPS_LISTS = False


def send(
    span: torch.Tensor, staging: torch.Tensor, lay: _layout.Layout, whole: bool, non_blocking: bool, regions: Any = None
) -> None:
    """The staging buffer into the targets' span: one copy where no byte of the span is another tensor's (``whole``),
    else one per group of the layout, which writes each target's bytes and not the padding between them."""
    if whole:
        if span.is_cpu and span.storage_offset() % 8 == 0:  # the buffer's size is a multiple of _layout.ALIGN
            # As 8-byte elements, an eighth as many: copy_() splits a copy over threads from 32,768 elements, which
            # for 51 KB cost 3.1 us against 1.9 us on a 2-core x86 host, and 3.4 ms against 0.47 ms a step beside
            # two busy DataLoader workers (25 tensors of 2 KB a batch, into CPU buffers).
            span, staging = span.view(torch.int64), staging.view(torch.int64)
        span.copy_(staging, non_blocking=non_blocking)
        return
    for (g, mine), (_, theirs) in zip(_layout._regions(span, lay), regions or _layout._regions(staging, lay)):
        if isinstance(g, _layout.Ragged):
            torch._foreach_copy_(_layout._cut(mine, g), _layout._cut(theirs, g), non_blocking=non_blocking)
        else:
            mine.copy_(theirs, non_blocking=non_blocking)


def _one_span(targets: list[torch.Tensor], lay: _layout.Layout, coalesce: bool) -> torch.Tensor | None:
    """``_span``, or None with coalesce=False or where a target is lazily conjugated or negated (each is copied as it
    is; only a complex one can be conjugated, which the layout's dtypes, the targets', tell)."""
    if not coalesce or any(map(_Tensor.is_neg, targets)):
        return None
    conjugated = any(g.final.is_complex for g in lay.groups) and any(map(_Tensor.is_conj, targets))
    return None if conjugated else _span(targets, lay)


def _span(targets: list[torch.Tensor], lay: _layout.Layout) -> torch.Tensor | None:
    """A byte view of the one buffer all ``targets`` are views of, each a plain contiguous tensor where ``lay`` puts it
    from one base inside the first one's storage; or None. Its padding may be another tensor's (``Step.whole``)."""
    first = targets[0]
    offsets = _offsets(lay)
    base = first.storage_offset() * first.element_size() - offsets[0]
    storage = first.untyped_storage()
    if base < 0 or base + lay.nbytes > storage.nbytes():
        return None
    if set(map(type, targets)) != {_Tensor} or not all(map(_Tensor.is_contiguous, targets)):
        return None
    start = first.data_ptr() - offsets[0]
    if start:  # where memory has addresses: each target at its offset from one start, in one storage's memory
        if [p - start for p in map(data_ptr, targets)] != list(offsets):
            return None
    else:  # meta tensors have none: the same storage, at the same offsets
        key = storage._cdata
        for t, offset in zip(targets, offsets):
            if t.storage_offset() * t.element_size() - offset != base or t.untyped_storage()._cdata != key:
                return None
    return _bytes(first, lay.nbytes, base)


def _bytes(t: torch.Tensor, nbytes: int, base: Any) -> torch.Tensor:
    """``nbytes`` bytes of ``t``'s storage from byte ``base``, as one uint8 tensor."""
    # Through an empty view of unit stride: a one-element tensor may have any stride, which view(uint8) refuses.
    return t.as_strided((0,), (1,)).view(torch.uint8).as_strided((nbytes,), (1,), base)


@functools.lru_cache(maxsize=64)
def _offsets(lay: _layout.Layout) -> tuple[int, ...]:
    """The byte offset of each tensor, in walk order, in a buffer laid out by ``lay``: read off a meta buffer."""
    views = _layout.read(torch.empty(lay.nbytes, dtype=torch.uint8, device="meta"), lay)
    return tuple(int(v.storage_offset()) * v.element_size() for v in views)


# ---------------------------------------------------------------- out='s checks of every pair, before a copy


def checked(
    sources: list[torch.Tensor], targets: list[torch.Tensor], out: Any, dev: torch.device | None, dtype: Any
) -> tuple[list[torch.Tensor], _Read]:
    """Every pair checked (``_check_pairs``, then ``apart``), and each source over a target copied first (a swap, a
    rolling buffer), so that the copies read it as it was."""
    read = _check_pairs(sources, targets, out, dev, dtype)
    spans = apart(targets, out)
    if spans and not (all(read.on_host) and not any(map(is_cpu, targets))):  # host to device: nothing shared
        starts = [start for start, _, _ in spans]
        reach = list(itertools.accumulate([end for _, end, _ in spans], max))  # the furthest a target up to here ends
        sources = list(sources)
        for start, end, i in _spans(sources, once=False):  # every place a source is read from
            k = bisect.bisect_left(starts, end) - 1  # the last target starting before this source ends
            if k >= 0 and reach[k] > start:
                sources[i] = sources[i].clone()
    return sources, read


def _path(out: Any, t: torch.Tensor) -> str:
    return _walk.format_path(_walk.find_path(out, t) or "")


def _refuse(out: Any, dst: torch.Tensor, why: str) -> NoReturn:
    msg = f"Cannot copy into out: at {_path(out, dst)}, {why} Nothing was copied."
    raise ValueError(msg)


# ---------------------------------------------------------------- memory shared between the two sides


def _extent(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to the end of its last one."""
    if t.is_contiguous():
        return int(t.nbytes)
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)) * t.element_size()


def _spans(tensors: list[torch.Tensor], once: bool = True) -> list[tuple[int, int, int]]:
    """(start, end, index) of each tensor with memory (distinct ones with ``once``), sorted; meta and empty: none."""
    seen: set[int] = set()
    found = []
    for i, (t, ptr) in enumerate(zip(tensors, map(data_ptr, tensors))):
        if ptr and not (once and id(t) in seen) and (n := _extent(t)):
            seen.add(id(t))
            found.append((ptr, ptr + n, i))
    return sorted(found)


_EXACT_MAX = 1 << 22  # elements: past this, two strided targets whose ranges cross are taken to share memory


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte ranges cross have an element in common (interleaved columns have none)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    size = a.element_size()
    if size != b.element_size() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True  # not one storage read as one dtype: not told apart here
    first, second = int(a.storage_offset()), int(b.storage_offset())
    lo, hi = min(first, second), max(first + _extent(a) // size, second + _extent(b) // size)
    if hi - lo > _EXACT_MAX:
        return True
    offsets = torch.arange(hi - lo)
    mine = offsets.as_strided(a.shape, a.stride(), first - lo).flatten()
    theirs = offsets.as_strided(b.shape, b.stride(), second - lo).flatten()
    return bool(torch.isin(mine, theirs).any())


def apart(targets: list[torch.Tensor], out: Any) -> list[tuple[int, int, int]]:
    """The targets' ``_spans``; ValueError, naming both paths, where two targets share memory, since one would be
    written over the other."""
    spans = _spans(targets)
    active: list[tuple[int, int]] = []  # (end, index) of the targets whose range reaches the next start
    for start, end, i in spans:
        active = [(e, k) for e, k in active if e > start]
        for _, k in active:
            if _share_elements(targets[i], targets[k]):
                why = f"out's tensor shares memory with the one at {_path(out, targets[k])}, so one would be written"
                _refuse(out, targets[i], f"{why} over the other. Give each its own memory.")
        active.append((end, i))
    return spans


class _Read(NamedTuple):
    """What the check read of every pair, each in one C loop, for the copies to use again."""

    shapes: list[torch.Size]  # the targets' (and, checked, the sources')
    dtypes: list[torch.dtype]  # the targets'
    on_host: list[bool]  # the sources'
    nbytes: list[int]  # the sources'


def _check_pairs(
    sources: list[torch.Tensor], targets: list[torch.Tensor], out: Any, dev: torch.device | None, dtype: Any
) -> _Read:
    """Raise ValueError, naming the path in ``out``, for the first pair that cannot be copied; nothing is written. Each
    property is read in one C loop; the pair at fault is looked for, pair by pair, only when there is one."""
    read: _Read | None = None
    try:
        read = _read(sources, targets)
        same_shapes = read.shapes == list(map(shape_of, sources))
    except RuntimeError:  # a strided nested tensor has no shape: no dense tensor to copy
        same_shapes = False
    if (
        read is not None
        and dtype is None
        and same_shapes
        and read.dtypes == list(map(dtype_of, sources))
        and set(map(layout_of, sources)) == {torch.strided}  # a sparse or jagged source: no dense tensor either
        and not _tree.transforming()  # nor, inside torch.func.vmap or grad, a wrapper with no memory of its own
        and (dev is None or set(map(device_of, targets)) == {dev})
        and (all(read.on_host) or not any(t.is_meta for t in sources))
        and not (torch.is_grad_enabled() and any(map(requires_grad, sources)))
        and len(set(map(id, targets))) == len(targets)
        and _writable(targets)
    ):
        return read
    seen: dict[int, torch.Tensor] = {}
    for src, dst in zip(sources, targets):
        why = None
        expected = _options.cast_to(src.dtype, dtype)
        if not _tree.has_memory(src):  # before the shape, which a strided nested tensor has not
            why = f"the batch holds a {_walk.describe(src)}, which out= does not copy (dense tensors with data only)."
        elif (fault := _target_fault(dst)) is not None:
            why = fault
        elif dst.shape != src.shape:
            why = f"out's tensor has shape {tuple(dst.shape)} and the batch's {tuple(src.shape)}."
        elif dst.dtype != expected:
            cast = f" (cast to {dtype})" if expected is not src.dtype else ""
            why = f"out's tensor is {dst.dtype} and the batch's is {expected}{cast}."
        elif dev is not None and dst.device != dev:
            why = f"out's tensor is on {dst.device}, not on {dev}, the device asked for."
        elif src.is_meta or src.layout is not torch.strided:
            why = f"the batch holds a {_walk.describe(src)}, which out= does not copy (dense tensors with data only)."
        elif src.requires_grad and torch.is_grad_enabled():
            why = "the batch's tensor requires grad, and autograd does not record a copy into out=: pass it detached."
        elif seen.setdefault(id(dst), src) is not src:
            why = "out holds this very tensor at two places where the batch holds two different tensors."
        if why is not None:
            _refuse(out, dst, why)
    return read or _read(sources, targets)


def _read(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> _Read:
    shapes, dtypes = list(map(shape_of, targets)), list(map(dtype_of, targets))
    return _Read(shapes, dtypes, list(map(is_cpu, sources)), list(map(nbytes_of, sources)))


def _writable(targets: list[torch.Tensor]) -> bool:
    """Whether ``copy_`` can write every target: dense, no element twice, and not an inference tensor here."""
    return (
        set(map(layout_of, targets)) == {torch.strided}
        and (torch.is_inference_mode_enabled() or not any(map(_Tensor.is_inference, targets)))
        and (all(map(_Tensor.is_contiguous, targets)) or not any(map(_overlaps_itself, targets)))
    )


def _overlaps_itself(t: torch.Tensor) -> bool:  # an expanded view: one element at several places
    return bool(torch._debug_has_internal_overlap(t) == 1)


def _target_fault(dst: torch.Tensor) -> str | None:
    """Why ``copy_`` cannot write ``dst`` here, or None."""
    if not _tree.has_memory(dst):
        return f"out's tensor ({_walk.describe(dst)}) cannot be written in place: it is not a dense tensor."
    if _writable([dst]):
        return None
    return (
        f"out's tensor ({_walk.describe(dst)}) cannot be written in place: it is sparse, an expanded "
        f"view whose elements share memory, or an inference tensor outside torch.inference_mode()."
    )


def check_targets(targets: list[torch.Tensor], out: Any) -> None:
    """What out= checks of its targets alone, each named by its path in ``out`` in a ValueError: each can be written
    in place here, and no two share memory."""
    for dst in targets:
        if (why := _target_fault(dst)) is not None:
            _refuse(out, dst, why)
    apart(targets, out)


def _alone(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
    """One copy: a large pageable host tensor through pinned memory, anything else as ``copy_`` does it; into host
    memory it has landed when move() returns."""
    dev = dst.device
    if not (
        _layout.staged_alone(src, _layout.stages(non_blocking, dev))
        and dst.is_contiguous()
        and _layout.stageable(src)
        and _layout.send_staged([(src, dst)])
    ):
        dst.copy_(src, non_blocking=_layout.asynchronous(non_blocking, dev, src, waited=False))
