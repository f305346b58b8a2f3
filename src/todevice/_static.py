"""StaticBatch: static buffers the user holds, each step's batch copied into them as move(batch, out=static) copies.

A CUDA graph reads the same memory on every replay, so a training loop built on one copies each batch
into buffers that stay. ``move(batch, out=static)`` checks every target on every call, since a call
remembers nothing of earlier ones. A StaticBatch is those buffers held in an object: their checks are
made once, when it is built, and a step checks only what can change, the batch.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch

from todevice import _into, _layout, _move, _options, _pack, _passed, _stream, _tree, _walk


class StaticBatch:
    """Static buffers you hold, fed a batch each step: ``feed(batch)`` is ``move(batch, out=static)``.

    ``static`` is a structure of tensors that stays, such as the inputs a CUDA graph was captured
    on. Each call copies the batch's tensors into the tensors at the same paths of ``static``, with
    the semantics of ``move(batch, out=static)``: every pair is checked before anything is written,
    sources that share memory with the targets are read first, the copies go on the current stream,
    and ``skip_keys`` and ``dtype`` act as they do there. What ``out=`` checks of the targets
    (each dense and writable, no two sharing memory) is checked once, here; a step that is not the
    one-buffer step below is ``out=``'s copy, which checks them again.

    A step is one staging write and one copy where the targets are views of one buffer laid out as
    coalescing lays it out, as :func:`todevice.static` allocates them (into a buffer it did not make
    whose layout has padding, one copy per group of one shape and dtype, never over that padding), the
    batch's tensors are on the host with the targets' dtypes, and ``dtype`` is None. Such a step
    reads each source's type and dtype and a few shapes, and leaves every other check to the writes
    into the staging buffer, which refuse a wrong shape, device or layout, or a tensor requiring
    grad, before a target is written.
    Anything else is copied as ``move(batch, out=static)`` copies it.

    The handle keeps the tensors of ``static`` it was built on, and pairs by the paths ``static`` has
    now (keys renamed or tensors swapped between paths are read as they are). A step raises
    ValueError where ``static`` now holds other tensors, or where their buffer's memory was moved or
    shrunk (a ``resize_()`` that grows it, ``untyped_storage().resize_()``): it never writes memory
    the tensors no longer own. A change to a tensor's shape, strides or place in its storage
    (``t_()``, ``resize_()`` within the storage, ``as_strided_()``, ``set_()``) is not seen: the
    step keeps writing the bytes the handle found, inside the buffer. Build a new handle after
    changing them.

    Example:
        >>> import torch, todevice
        >>> feed = todevice.static({"x": torch.zeros(2, 3), "y": torch.zeros(2)}, "cpu")
        >>> out = feed({"x": torch.ones(2, 3), "y": torch.arange(2.0)})
        >>> out is feed.static, out["y"]
        (True, tensor([0., 1.]))

    Args:
        static: The structure of tensors to copy each batch into.
        non_blocking: As in :func:`todevice.move`.
        dtype: As in :func:`todevice.move`: the floating-point and complex tensors of each batch are
            cast to it, and ``static``'s tensors must have that dtype.
        skip_keys: As in :func:`todevice.move`: items under these keys are left as they are.
        strict: As in :func:`todevice.move`.

    Raises:
        ValueError: a tensor of ``static`` cannot be written in place, or two share memory; or
            ``static`` holds a set or another structure ``out=`` cannot pair.
        TypeError: an option's value.

    .. versionadded:: 0.3.0
    """

    def __init__(
        self,
        static: Any,
        /,
        *,
        non_blocking: bool = True,
        dtype: torch.dtype | None = None,
        skip_keys: Any = None,
        strict: bool = False,
    ) -> None:
        self._build(static, skip_keys, (non_blocking, dtype, strict, False))

    def _build(self, static: Any, skip_keys: Any, options: tuple[bool, Any, bool, bool]) -> StaticBatch:
        """``options``: non_blocking, dtype, strict, owned (the tensors are views of a buffer :func:`static` made)."""
        non_blocking, dtype, strict, owned = options
        _options.check_bool(non_blocking, "non_blocking")
        _options.check_bool(strict, "strict")
        if dtype is not None:
            _options.check_dtype(dtype)
        self.static = static
        self._skip = _options.skip_set(skip_keys)
        self._options, self._strict = options, strict
        self._copying = _into.Copying(non_blocking, dtype, None, _options.COALESCE_MAX_BYTES, find_step=False)
        self._keys = list(static) if type(static) is dict and not self._skip else None  # the batch read by these
        self._targets = _walk.paired(static, static, self._skip)[1]
        _into.check_targets(self._targets, static)
        step = _into.step_for(self._targets, _options.COALESCE_MAX_BYTES, owned) if dtype is None else None
        if step is not None and not step.inference:  # marked written each step: those the write through the span
            before = [t._version for t in step.targets]  # does not mark, found by marking the span once
            _into.written([step.span], False)
            step = step._replace(targets=[t for t, v in zip(step.targets, before) if t._version == v])
        self._step = step
        storage = None if step is None else step.span.untyped_storage()  # where the buffer is, and how large
        self._storage = None if storage is None else (storage, storage.data_ptr(), storage.nbytes())
        self._held = self._staging()
        return self

    def __call__(self, batch: Any, /) -> Any:
        """Copy ``batch``'s tensors into the static buffers; return ``static``, the very object.

        Raises:
            ValueError: as ``move(batch, out=static)`` raises, naming the path, with nothing written;
                or the static tensors were changed behind the handle.
        """
        if self._strict:
            _passed.refuse_unknown(batch, self._skip)
        step, tried = self._step, False
        if step is not None:
            storage, where, size = self._storage  # type: ignore[misc]
            if storage.data_ptr() != where or storage.nbytes() != size:
                self._changed("their buffer's memory was moved or shrunk (resize_())")
            sources = self._sources(batch)
            if sources is not None and self._same(self.static.values()):
                if self._fed(step, sources):
                    return self.static
                tried = True
        sources, targets = _walk.paired(batch, self.static, self._skip)
        same = self._same(targets)
        if not same and sorted(map(id, targets)) != sorted(map(id, self._targets)):  # not the same ones in any order
            self._changed("it holds other tensors than those it was built on")
        if tried or not (same and step is not None and self._fed(step, sources)):  # the step reads them in order
            _into.copy(sources, targets, self.static, None, self._copying)
        return self.static

    def _same(self, targets: Any) -> bool:
        """Whether ``targets`` (a list, or a dict's values) are the handle's, in its order."""
        return len(targets) == len(self._targets) and all(map(operator.is_, targets, self._targets))

    def _sources(self, batch: Any) -> list[Any] | None:
        """A dict's values read by the static dict's keys, in one C loop; None for the general pairing."""
        keys = self._keys
        if keys is None or type(batch) is not dict or len(batch) != len(keys) or list(self.static) != keys:
            return None
        if list(batch) == keys:
            return list(batch.values())
        try:
            return list(map(batch.__getitem__, keys))
        except (KeyError, TypeError):  # a key the batch has not: the general pairing names it
            return None

    def _fed(self, step: _into.Step, sources: list[torch.Tensor]) -> bool:
        """The one-buffer step, with the staging buffer the handle holds for host targets."""
        if _into.fed(step, sources, self._copying.non_blocking, self._held):
            return True
        if self._held is not None and any(region.requires_grad for _, region in self._held[2]):
            self._held = self._staging()  # a source requiring grad made its regions part of a graph
        return False

    def _staging(self) -> tuple[torch.Tensor, bool, list[Any]] | None:
        """The staging buffer a step into host memory writes, held with its regions: that copy ends before the step
        returns. Into an accelerator, each step takes one from the caching host allocator, which hands it out
        again only once the copy from it has finished."""
        step = self._step
        if step is None or not step.span.is_cpu:
            return None
        staging = torch.empty(step.lay.nbytes, dtype=torch.uint8)
        return staging, False, _layout._regions(staging, step.lay)

    def _changed(self, why: str) -> None:
        msg = (
            f"Cannot copy into this StaticBatch's tensors: {why} since the StaticBatch was built, so a CUDA graph "
            f"captured on them reads other memory. Build a new StaticBatch on the tensors as they are now."
        )
        raise ValueError(msg)

    def __deepcopy__(self, memo: dict[int, Any]) -> StaticBatch:
        """A handle on a deep copy of ``static``: its own buffers, checked as any new handle's are."""
        return object.__new__(StaticBatch)._build(copy.deepcopy(self.static, memo), self._skip or None, self._options)

    def __repr__(self) -> str:
        one = " in one buffer" if self._step is not None else ""
        return f"StaticBatch({len(self._targets)} tensors{one})"


def static(
    example: Any,
    device: Any,
    /,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
    skip_keys: Any = None,
    strict: bool = False,
) -> StaticBatch:
    """Static buffers shaped like ``example`` on ``device``, in a :class:`StaticBatch` that feeds them.

    Every tensor of ``example`` gets a buffer of its shape and dtype (``dtype`` casts the floating-point
    and complex ones), as views of one buffer on ``device`` laid out as coalescing lays it out, so a
    step of the handle with ``dtype`` None is one staging write and one copy. The buffers start with
    ``example``'s values and do not require grad; anything that is not a tensor stays as it is in the
    structure. Tensors under ``skip_keys`` get buffers too, which the handle's steps leave as they are.

    Example:
        >>> import torch, todevice
        >>> feed = todevice.static({"x": torch.zeros(4, 3), "ids": torch.zeros(4, dtype=torch.long)}, "cpu")
        >>> feed
        StaticBatch(2 tensors in one buffer)
        >>> feed.static["ids"].dtype
        torch.int64

    Args:
        example: A batch like those the loop will feed.
        device: Where the buffers live.
        non_blocking, dtype, skip_keys, strict: As in :class:`StaticBatch`.

    Raises:
        ValueError: ``example`` holds a tensor that is not a plain dense one (sparse, nested, a
            subclass) or an object with its own ``.to()``: build those buffers yourself and pass them
            to :class:`StaticBatch`.

    .. versionadded:: 0.3.0
    """
    dev = _stream.resolve_device(device)
    from_host = _pack.pack(_move.move(example, "cpu", dtype=dtype), max_bytes=None)  # move() checks dtype
    if from_host.loose:
        msg = (
            f"Cannot make static buffers like this example: {from_host.loose} of its tensors or objects are not "
            f"plain dense tensors (sparse, nested, a tensor subclass, an object with its own .to()). Make those "
            f"buffers yourself and pass the structure to todevice.StaticBatch()."
        )
        raise ValueError(msg)
    from_host.requires_grad = ()  # buffers a graph reads, not parameters
    buffers = _one_counter(from_host.unpack(dev))
    return object.__new__(StaticBatch)._build(buffers, skip_keys, (non_blocking, dtype, strict, True))


def _one_counter(buffers: Any) -> Any:
    """``buffers`` with each tensor remade as a view of one tensor over their storage, so that they share its version
    counter: a step's one write through the buffer marks them all written for autograd, where marking each costs
    80 ns a tensor. A tensor met twice stays one tensor. Where a remade view is not seen at its tensor's address
    (memory without addresses, such as meta), ``buffers`` come back as they are."""
    made: dict[int, torch.Tensor] = {}
    bases: dict[torch.dtype, torch.Tensor] = {}

    def view(t: torch.Tensor, _: Any) -> torch.Tensor:
        if id(t) not in made:
            if not bases:  # a view of the first tensor over the whole storage, whose counter every view then shares
                bases[torch.uint8] = _into._bytes(t, t.untyped_storage().nbytes(), 0)
            if t.dtype not in bases:
                bases[t.dtype] = bases[torch.uint8].view(t.dtype)
            v = bases[t.dtype].as_strided(t.shape, t.stride(), t.storage_offset())
            if not t.data_ptr() or v.data_ptr() != t.data_ptr():
                raise _Unseen
            made[id(t)] = v
        return made[id(t)]

    try:
        return _walk.make(_layout.NEVER, view, lambda x, code, state: x, _tree.kind_of).walk(buffers, None)
    except _Unseen:
        return buffers


class _Unseen(Exception): ...  # a remade view not at its tensor's address
