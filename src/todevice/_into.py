"""move(batch, out=static): each tensor of a batch copied into the matching tensor of a structure that stays.

CUDA graphs and persistent inference buffers read the same device memory on every step. Each step,
the batch's tensors are paired with ``static``'s by path, every pair is checked before anything is
written, and the copies go in order on the current stream, after the work queued there that reads
``static``. The small host tensors are written into one staging buffer (page-locked where the target
is an accelerator). When their destinations are views of one buffer laid out as coalescing lays them
out, which is what ``move(example, device)`` returns for small tensors, that staging buffer is sent
into it with one copy, or one per group where the layout leaves padding between them (``_step``);
otherwise each goes with a copy of its own.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, NamedTuple, NoReturn

import torch

from todevice import _layout, _options, _passed, _step, _tree, _walk
from todevice._layout import data_ptr, device_of, dtype_of, is_cpu, layout_of, nbytes_of, pick, requires_grad, shape_of

_Tensor = torch.Tensor


class _Mismatch(Exception):
    """Internal: the batch and ``out`` differ here, as its argument says; the path grows as it leaves each container."""

    path = ""


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
    copy(*paired(batch, out, skip), out, dev, Copying(non_blocking, dtype, coalesce, max_bytes))
    return out


def paired(batch: Any, out: Any, skip: frozenset[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors of ``batch`` and the tensors at their paths in ``out``, in walk order; ValueError naming the first
    path where the structures differ."""
    if not skip and (flat := _flat_pairs(batch, out)) is not None:
        return flat
    found = pairs(batch, out, skip)
    return found[0::2], found[1::2]


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
    step = _step.step_for(targets, max_bytes) if find_step and dtype is None and coalesce is not False else None
    if step is not None and (dev is None or step.span.device == dev) and _step.fed(step, sources, non_blocking):
        return  # the common step, in few reads
    read = _check_pairs(sources, targets, out, dev, dtype)
    spans = apart(targets, out)
    if spans and not (all(read.on_host) and not any(map(is_cpu, targets))):  # host to device: nothing shared
        # Each source over a target is copied first (a swap, a rolling buffer).
        starts = [start for start, _, _ in spans]
        reach = list(itertools.accumulate([end for _, end, _ in spans], max))  # the furthest a target up to here ends
        sources = list(sources)
        for start, end, i in _spans(sources, once=False):  # every place a source is read from
            k = bisect.bisect_left(starts, end) - 1  # the last target starting before this source ends
            if k >= 0 and reach[k] > start:
                sources[i] = sources[i].clone()
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
        span = _step._one_span(targets, lay, coalesce is not False)
        if span is None and (any(map(_Tensor.is_conj, targets)) or any(map(_Tensor.is_neg, targets))):  # lazily
            for src, dst in zip(sources, targets):  # conjugated or negated: each copied as copy_() resolves it
                dst.copy_(src, non_blocking=_layout.asynchronous(non_blocking, dst.device, src, waited=False))
        elif span is None and all(map(is_cpu, targets)):
            torch._foreach_copy_(targets, sources)
        elif span is not None and targets[0].is_cpu:
            _layout.write(span, lay, sources)  # each target's bytes only
            _step.written(targets)
        else:
            staging, asynchronous = _layout.staging(lay.nbytes, targets[0].device, pinned=non_blocking)
            _layout.write(staging, lay, sources)  # casts where the targets' dtypes ask
            if span is None:
                torch._foreach_copy_(targets, _layout.read(staging, lay), non_blocking=asynchronous)
            else:
                _step.send(span, staging, lay, _layout.tight(lay), asynchronous)
                _step.written(targets)


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


# ---------------------------------------------------------------- pairing the two structures


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


def pairs(batch: Any, out: Any, skip: frozenset[Any] = frozenset()) -> list[torch.Tensor]:
    """Every tensor of ``batch`` and the tensor at its path in ``out``: source, target, source, ... in walk order;
    ValueError naming the first path where the structures differ."""
    found: list[torch.Tensor] = []
    try:
        _pair(batch, out, found, skip)
    except _Mismatch as m:
        msg = f"Cannot copy into out: at {_walk.format_path(m.path)}, {m.args[0]} Nothing was copied."
        raise ValueError(msg) from None
    except RecursionError:
        msg = "Cannot copy into out: the batch is nested deeper than Python's recursion limit, or contains itself."
        raise ValueError(msg) from None
    except _walk.LeafError as failure:  # a container that cannot list what it holds, on either side
        _walk.explain(failure, batch, None, verb="copy into out:", also=out, skip=skip)
    return found


def _pair(a: Any, b: Any, found: list[torch.Tensor], skip: frozenset[Any]) -> None:
    code = _tree.kind_of(type(a)).code
    if code == _tree.TENSOR:
        if not isinstance(b, torch.Tensor):
            raise _Mismatch(f"out holds {_walk.describe(b)} where the batch has a {_walk.describe(a)}.")
        found += (a, b)
    elif code == _tree.NODE:
        _pair_children(a, b, found, skip)
    elif code in (_tree.TO, _tree.PACKED):
        why = "an object with its own .to()" if code == _tree.TO else "a PackedBatch (unpack it first)"
        raise _Mismatch(
            f"the batch holds {_walk.describe(a)}, {why}, whose tensors out= cannot pair with out's. "
            f"Register its type with todevice.register(), or pass skip_keys."
        )
    elif _tree.kind_of(type(b)).code in (_tree.TENSOR, _tree.NODE):  # an atom or unknown object where out holds more
        raise _Mismatch(f"out holds {_walk.describe(b)} where the batch has {_walk.describe(a)}.")


def _pair_children(a: Any, b: Any, found: list[torch.Tensor], skip: frozenset[Any]) -> None:
    """A container's children, paired with those of ``b`` through the walk's rule for its kind: a list's and a tuple's
    by position; any other's by the key of a mapping's item, or by the path entry of anything else (``.field``,
    ``[2]``). A mapping's items under the keys in ``skip`` need not be on both sides."""
    if type(b) is not type(a):
        raise _Mismatch(f"out holds a {type(b).__qualname__} where the batch has a {type(a).__qualname__}.")
    if isinstance(a, (set, frozenset)):
        raise _Mismatch("the batch holds a set, whose items have no order to pair them by.")
    kind = _tree.kind_of(type(a))
    assert kind.flatten is not None and kind.entry is not None
    children, aux = _walk.guarded(a, kind.flatten, a)
    theirs, their_aux = _walk.guarded(b, kind.flatten, b)
    positional = type(a) is list or type(a) is tuple
    if (positional or kind.keys is None) and len(theirs) != len(children):
        raise _Mismatch(f"out holds {len(theirs)} items where the batch has {len(children)}.")
    if not positional and not skip and kind.keys is not None:
        # The very same key objects on both sides, in the same order, and every child an item: they pair by position.
        # Equal keys that are other objects pair by ``_labels``, as a dict would find them.
        ids = list(map(id, kind.keys(aux)))
        positional = ids == list(map(id, kind.keys(their_aux))) and id(_tree._NO_KEY) not in ids
    if positional:
        paired: Any = zip(range(len(children)), children, theirs)
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
        paired = ((i, children[i], offered[label]) for i, label in enumerate(mine) if label is not None)
    for i, v, w in paired:
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


# ---------------------------------------------------------------- checking every pair, then copying


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
