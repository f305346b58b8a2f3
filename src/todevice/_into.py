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

from typing import Any, NamedTuple

import torch

from todevice import _layout, _passed, _step, _walk
from todevice._layout import is_cpu, pick

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
    step = _step.step_for(targets, max_bytes) if find_step and dtype is None and coalesce is not False else None
    if step is not None and (dev is None or step.span.device == dev) and _step.fed(step, sources, non_blocking):
        return  # the common step, in few reads
    sources, read = _step.checked(sources, targets, out, dev, dtype)
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
                        _step._alone(src, dst, non_blocking)
                    except Exception as err:
                        where = f"{_step._path(out, dst)} ({_walk.describe(src)})"
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
