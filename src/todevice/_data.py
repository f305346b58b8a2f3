"""DataLoader integration: collate() packs each batch in the worker, prefetch() moves batches ahead."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.utils.data
from torch.utils.data._utils.collate import collate as _collate, collate_tensor_fn, default_collate_fn_map

from todevice import _move, _options, _pack, _stream, _tree
from todevice._stream import DeviceLike

B = TypeVar("B")
_Step = Callable[[Any], Any]
_Moved = tuple[Any, list[torch.Tensor], torch.Event]  # a batch moved on the side stream, its outputs, an event after


def _stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    # default_collate stacks each field straight into a shared-memory segment when it runs in a
    # worker. The small fields are packed into one buffer right after, so theirs would be waste;
    # a large field stays a tensor of its own, and goes there as default_collate puts it.
    elem = batch[0]
    if _tree.has_memory(elem) and elem.nbytes * len(batch) <= _options.COALESCE_MAX_BYTES:
        return torch.stack(batch, 0)
    return collate_tensor_fn(batch)  # type: ignore[no-any-return]  # refuses nested and sparse ones in torch's words


# default_collate's rules, with plain stacking for tensors: same values and types, no shared memory.
_worker_collate_map = {**default_collate_fn_map, torch.Tensor: _stack}
_default_collate_for_packing = functools.partial(_collate, collate_fn_map=_worker_collate_map)


def moved_on(batch: Any, dev: torch.device, non_blocking: bool, side: torch.Stream, skip: frozenset[Any]) -> _Moved:
    """``batch`` moved with copies on ``side``; the outputs and an event after them. Nothing is handed over yet: the
    consumer's stream waits for the event when the batch is used, so later copies overlap earlier work."""
    s = _move.State(_move.plan_for(dev, non_blocking, None, skip_keys=skip))
    out, _ = _move._on_stream(batch, s, side)
    copied = torch.Event(device=dev)
    copied.record(side)  # everything queued on side so far
    return s.finish(out), s.outputs(), copied


class collate:  # named like a function: it stands where a collate_fn goes
    """A ``collate_fn`` that packs each batch in the DataLoader worker into one buffer.

    In a worker process it runs ``collate_fn`` (torch's ``default_collate`` when None), then
    :func:`todevice.pack` the result. The batch then crosses to the main process as one
    shared-memory buffer, not one segment and one file descriptor per tensor.
    ``DataLoader(pin_memory=True)`` pins that buffer in one call (:meth:`PackedBatch.pin_memory`).
    :func:`todevice.prefetch` or :func:`todevice.move` turn it back into the batch. In the main
    process (``num_workers=0``), it returns the batch as ``collate_fn`` made it, moved to
    ``device`` when one is given.

    It pickles, so it works with the fork, spawn and forkserver start methods and with
    persistent workers.

    Example:
        >>> import torch, todevice
        >>> from torch.utils.data import DataLoader
        >>> data = [{"x": torch.full((2,), float(i)), "label": i} for i in range(4)]
        >>> loader = DataLoader(data, batch_size=2, collate_fn=todevice.collate())
        >>> [batch["label"].tolist() for batch in todevice.prefetch(loader, "cpu")]
        [[0, 1], [2, 3]]

    Args:
        collate_fn: The collate function to run first; torch's ``default_collate`` when None.
        device: In the main process, move each batch there.

    .. versionadded:: 0.1.0
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None, *, device: DeviceLike | None = None):
        fn: Any = collate_fn  # anything, at run time: a DataLoader passes samples to collate_fn=todevice.collate
        if fn is not None and not callable(fn):
            hint = (
                " That looks like a batch of samples: a DataLoader called todevice.collate itself. Pass "
                "collate_fn=todevice.collate(), with the parentheses."
                if isinstance(fn, (list, tuple))
                else " Pass a function that collates a list of samples, or None for torch's default_collate."
            )
            text = repr(fn)
            short = text if len(text) <= 60 else f"{text[:57]}..."
            msg = f"Cannot make todevice.collate(collate_fn={short}): collate_fn is not callable.{hint}"
            raise TypeError(msg)
        if device is not None:
            _options.check(device, True, None)  # a bad device fails here, not later inside a worker
        self.collate_fn = collate_fn
        self.device = device

    def __repr__(self) -> str:
        return f"todevice.collate({self.collate_fn!r}, device={self.device!r})"

    def __call__(self, samples: list[Any]) -> Any:
        if torch.utils.data.get_worker_info() is not None:
            fn = _default_collate_for_packing if self.collate_fn is None else self.collate_fn
            return _pack.pack(fn(samples), shared=True)
        batch = torch.utils.data.default_collate(samples) if self.collate_fn is None else self.collate_fn(samples)
        return batch if self.device is None else _move.move(batch, self.device)


class prefetch(Generic[B]):  # named like a function: it wraps an iterable in a loop header
    """Iterate over ``iterable`` with each batch already on ``device``, the next ones on their way.

    Each batch is moved with :func:`todevice.move` (or unpacked, when it is a PackedBatch from
    :func:`todevice.collate`). On a backend with streams, up to ``depth`` batches are copied ahead on
    a side stream. The stream is made once per ``prefetch`` object and reused every epoch. Each
    batch is handed over safely: the current stream waits for its copy, and its tensors are
    recorded on the current stream. An exception from ``iterable`` reaches the loop unchanged. A
    ``break`` leaves no work behind: the side stream is waited for when the loop's iterator closes.

    Re-iterable (a new pass each ``for``), and sized when ``iterable`` is.

    Example:
        >>> import torch, todevice
        >>> batches = [{"x": torch.ones(2)}, {"x": torch.zeros(2)}]
        >>> [b["x"].device.type for b in todevice.prefetch(batches, "meta")]
        ['meta', 'meta']

    Args:
        iterable: A DataLoader, or any iterable of batches.
        device: Where the batches go.
        depth: How many batches may be alive beyond the one in use (at least 1). A batch is handed
            over before the next is started, so while the loop body runs ``depth - 1`` batches are
            on their way, and one more starts when the loop asks for the next batch.
        non_blocking: As in :func:`todevice.move`.
        skip_keys: As in :func:`todevice.move`: the items under these dict keys stay where they are.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        iterable: Iterable[B],
        device: DeviceLike,
        *,
        depth: int = 2,
        non_blocking: bool = True,
        skip_keys: Hashable | Collection[Hashable] | None = None,
    ):
        if type(depth) is not int:
            msg = f"Cannot prefetch with depth={depth!r}: depth counts the batches in flight, an int of 1 or more."
            raise TypeError(msg)
        if depth < 1:
            msg = f"Cannot prefetch with depth={depth}: depth counts the batches in flight and must be 1 or more."
            raise ValueError(msg)
        dev, skip = _options.check(device, non_blocking, None, skip_keys=skip_keys)
        self.iterable = iterable
        self.device = _stream.resolve_device(dev)  # "cuda": the device current now
        self.depth = depth
        self.non_blocking = non_blocking
        self.skip_keys = skip if skip_keys is not None else None
        self._side: torch.Stream | None = None

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"todevice.prefetch({self.iterable!r}, {str(self.device)!r}, depth={self.depth})"

    def __iter__(self) -> Iterator[B]:
        if self._side is None and _stream.is_accelerator(self.device):
            self._side = torch.Stream(device=self.device)  # made once; None where the device has no streams
        return self._plain() if self._side is None else self._ahead(self._side)

    def _plain(self) -> Iterator[B]:
        def finish(batch: Any) -> Any:
            return _move.move(batch, self.device, non_blocking=self.non_blocking, skip_keys=self.skip_keys)

        yield from _window(iter(self.iterable), 1, lambda batch: batch, finish, lambda: None)

    def _ahead(self, side: torch.Stream) -> Iterator[B]:
        def start(batch: Any) -> _Moved:
            return moved_on(batch, self.device, self.non_blocking, side, self.skip_keys or frozenset())

        def finish(moved: _Moved) -> Any:
            out, outputs, copied = moved
            _stream.receive(copied, outputs, self.device)
            return out

        yield from _window(iter(self.iterable), self.depth, start, finish, side.synchronize)


def _window(
    source: Iterator[Any], depth: int, start: _Step, finish: _Step, abandon: Callable[[], None]
) -> Iterator[Any]:
    """``finish(start(b))`` for each ``b`` of ``source``, with up to ``depth`` batches started ahead: the next one when
    the loop asks again, after the batch before is handed over and let go, so at most ``depth`` are in flight beyond
    the one in use. An exception from ``source`` reaches the loop after the batches before it; ``abandon`` runs when
    the loop stops early with batches in flight."""
    pending: collections.deque[Any] = collections.deque()
    failed: Exception | None = None  # raised once the batches before it have been used
    try:
        while True:
            while failed is None and len(pending) < depth:
                try:
                    pending.append(start(next(source)))
                except StopIteration:  # the end; a new one, which keeps no frame of the source's alive
                    failed = StopIteration()
                except Exception as err:
                    failed = err
            if not pending:
                break
            yield finish(pending.popleft())
        if failed is not None and not isinstance(failed, StopIteration):
            raise failed
    finally:
        try:
            if pending:
                abandon()  # a break or an error: no copy is left running behind the loop
        finally:
            close = getattr(source, "close", None)
            if callable(close):
                close()  # a generator source is finished now, not whenever it is collected
