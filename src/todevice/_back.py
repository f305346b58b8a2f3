"""The fast paths for plain dicts, lists and tuples of tensors: the gate that moves a few in one pass, and the way
back for many small device tensors in one look and one copy.

``gate`` is move()'s walk of the common batch (a dict of input and target, a list of two tensors) written for
those three kinds alone: one pass that checks every value is a tensor, copies each that is not in place, and
builds the container anew. Anything else goes to the general walk.

A step's outputs (a metrics dict, a list of per-class values) are many small tensors on one
accelerator, in containers of the three plain kinds. For such a batch, ``brought`` lists the tensors
in one recursive pass written for those three kinds alone, gathers them on the device with one kernel
or two per group of one dtype and shape, copies the buffer to the host once, waits once, and rebuilds
the containers around the host views. Anything else (another container, an object, a tensor on the
host or needing grad, repeated or sharing memory) takes the general way, which handles it all.

Measured on an H100 with torch 2.11 (bench/README.md, "Device to host"): for 1,000 scalars,
``torch.stack`` costs the host 0.41 ms, the copy and the wait 0.01 ms, ``unbind`` on the host 0.67 ms,
and per-leaf ``.cpu()`` 13.5 ms. The general way's two walks (taking the tensors out, filling the
skeleton) cost more than the gather and the cut together; the pass here costs a tenth of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from todevice import _layout, _stream, _tree

_Tensor = torch.Tensor
_ATOMS = _tree.FAST_ATOMS
_JUST_TENSORS = frozenset({_Tensor})


def gate(obj: Any, p: Any, coalesce: bool | None, s: Any = None) -> Any:
    """The walk of a plain dict, list or tuple of tensors (``_walk.make``'s rule for the three), in one pass: to an
    accelerator with under COALESCE_MIN_TENSORS tensors to copy (any number with coalesce=False), to the CPU or meta
    any number from the host (to the CPU, one off the host is gathered); none repeated or sharing memory, each copied
    alone as _layout.sending plans; else None. On a side stream (``s``), host tensors only, their copies recorded in
    ``s``."""
    tp = type(obj)
    if tp is dict and not p.skip:
        values: Any = obj.values()
    elif tp is list or tp is tuple:
        values = obj
    else:
        return None
    if not values or type(next(iter(values))) is not _Tensor:  # a nested batch: at once to the walk
        return None
    least = _layout.COALESCE_MIN_TENSORS if coalesce is None and p.sends else len(values) + 1
    keep, todo, off_host = p.keep, [], s is not None or p.gathers
    for v in values:
        if type(v) is not _Tensor:
            return None
        if not keep(v):
            todo.append(v)
            if len(todo) >= least:  # enough to coalesce: the general path, after at most this many looks
                return None
            if off_host and not v.is_cpu:  # gathered to the CPU; on a side stream, waits for the user's stream first
                return None
    if not todo:  # a new container, as from every path
        return dict(obj) if tp is dict else tp([*values])
    if len(todo) > 1 and not _layout.distinct(todo):
        return None
    return _copied(obj, values, todo, p, s)


def _copied(obj: Any, values: Any, todo: list[torch.Tensor], p: Any, s: Any) -> Any:
    """The gate's copies of ``todo`` (``values`` those of ``obj``), in a new container; None where one fails. Apart
    from ``gate``, whose early returns then make no cells for what the comprehensions here read."""
    made = {}
    if p.stage:  # the pageable ones through pinned memory, where it pays; under the limit, no call to is_pinned
        try:
            host = sum(v.nbytes for v in todo if v.is_cpu)
        except RuntimeError:  # a sparse tensor has no nbytes
            return None
        if host > _layout.PAGEABLE_DIRECT_MAX_BYTES:
            made = _layout.stage(todo, p.dev, p.dtype)
    try:
        copies = [made[id(v)] if id(v) in made else p.to(v) for v in todo] if made else [p.to(v) for v in todo]
    except Exception:  # the general path names the path of the tensor that fails
        return None
    if s is not None:
        s.sources += todo
        s.results += copies
    elif p.to_host:  # copies into host memory (casts, here): waited for before move() returns, as on every path
        _stream.wait_for(todo)
    if len(todo) < len(values):
        done = dict(zip(map(id, todo), copies))
        copies = [done.get(id(v), v) for v in values]
    return dict(zip(obj, copies)) if type(obj) is dict else type(obj)(copies)


def brought(obj: Any, max_bytes: int) -> Any:
    """``obj`` with its tensors copied to the host in one blocking copy; None where the general way must move it.

    Taken only where ``obj`` is plain dicts, lists and tuples of tensors and atoms, its tensors (two or
    more) all on one accelerator, none needing grad, repeated or sharing memory, at most ``max_bytes``
    laid out.
    """
    tp = type(obj)
    if tp is not dict and tp is not list and tp is not tuple:
        return None
    tensors: list[torch.Tensor] = []
    try:
        if not _only_plain(obj, tensors) or len(tensors) < 2:
            return None
    except RecursionError:  # deep or cyclic: the general way goes on on a stack, or says which
        return None
    first = tensors[0]
    dev = first.device
    if first.is_cpu or not _stream.is_accelerator(dev):
        return None
    # Checked in bulk, a C loop each: none needing grad, all on one device (an index each: one accelerator type
    # per process, and -1 for the host and meta).
    if any(map(_layout.requires_grad, tensors)) or len(set(map(_Tensor.get_device, tensors))) > 1:
        return None
    try:
        lay = _layout.layout_for(tensors, None)
        if lay.nbytes > max_bytes or not _layout.distinct(tensors):
            return None
        buffer = _layout.gathered(tensors, lay, dev)
    except (RuntimeError, TypeError):  # sparse (no data_ptr), nested (no shape), a dtype no buffer holds, no room
        return None
    return _rebuilt(obj, iter(_layout.read(_layout.landed(buffer), lay)))


_DEPTH_MAX = 100  # containers deep: the rebuild recurses too, two frames a level; deeper batches take the general way


def _only_plain(x: Any, tensors: list[torch.Tensor], depth: int = 0) -> bool:
    """Whether ``x`` (a dict, list or tuple) holds only plain containers, tensors and atoms, at most ``_DEPTH_MAX``
    deep; its tensors appended."""
    if depth > _DEPTH_MAX:
        return False
    values = x.values() if type(x) is dict else x
    if set(map(type, values)) == _JUST_TENSORS:  # a metrics dict, a list of per-class values: C loops only
        tensors.extend(values)
        return True
    for v in values:
        tp = type(v)
        if tp is _Tensor:
            tensors.append(v)
        elif tp is dict or tp is list or tp is tuple:
            if not _only_plain(v, tensors, depth + 1):
                return False
        elif tp not in _ATOMS:
            return False
    return True


def _rebuilt(x: Any, views: Iterator[torch.Tensor]) -> Any:
    """``x`` rebuilt, each tensor replaced by the next of ``views``, in the order ``_plain`` met them."""
    tp = type(x)
    values = x.values() if tp is dict else x
    if set(map(type, values)) == _JUST_TENSORS:
        if tp is dict:
            return dict(zip(x, views))  # zip stops at x's end, before taking a view more
        done = list(itertools.islice(views, len(x)))
    else:
        done = [next(views) if type(v) is _Tensor else v if type(v) in _ATOMS else _rebuilt(v, views) for v in values]
    return dict(zip(x, done)) if tp is dict else done if tp is list else tuple(done)


def gathered_back(
    taken: _layout.Taken,
    dtype: torch.dtype | None,
    alone: Callable[[torch.Tensor], torch.Tensor],
    before: Callable[[torch.Tensor], None],
    made: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The taken tensors, off the host, copied to it: one buffer gathered per accelerator, one copy each; in walk
    order. ``alone(t)`` copies a tensor by itself (the only one on its device, or on meta, or where no room is left
    to gather), ``before(t)`` runs before the first copy from ``t``'s device, and each host buffer goes to ``made``."""
    tensors = taken.tensors
    by_device: dict[torch.device, list[int]] = {dev: [] for dev in set(map(_layout.device_of, tensors))}
    if len(by_device) > 1:
        for i, t in enumerate(tensors):
            by_device[t.device].append(i)
    views: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for dev, indices in by_device.items():
        picked = _layout.pick(tensors, indices) if len(by_device) > 1 else tensors
        if len(picked) == 1 or not _stream.is_accelerator(dev):  # alone, or meta: each copied as it is
            got = list(map(alone, picked))
        else:
            lay = taken.layout if len(by_device) == 1 else _layout.layout_for(picked, dtype)
            before(picked[0])
            try:
                buffer = _layout.gathered(picked, lay, dev)
            except torch.OutOfMemoryError:  # no room to gather them on the device: each copied alone
                got = list(map(alone, picked))
            else:
                host = _layout.landed(buffer)
                got = _layout.read(host, lay, dtype, made=made)
                made.append(host)
        if len(by_device) == 1:  # the one device's: all of them, in order
            return got
        for i, view in zip(indices, got):
            views[i] = view
    return views
