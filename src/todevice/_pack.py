"""PackedBatch: a structure whose tensors travel in one buffer, made by pack() and unpacked by move()."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as pin_structure

from todevice import _layout, _move, _options, _traced, _tree, _walk
from todevice.errors import PackedBatchAttributeError, PackedBatchError


def pack(obj: Any, /, *, shared: bool = False, max_bytes: int | None = _options.COALESCE_MAX_BYTES) -> PackedBatch:
    """Pack every plain dense host tensor of ``obj`` up to ``max_bytes`` into one buffer: the host half of a transfer.

    The result holds one uint8 buffer with the bytes of every packed tensor (each at a 16-byte
    boundary), the structure with a slot where each tensor was, and the dtypes and shapes. It pickles
    as that one buffer plus a small header, so a DataLoader worker hands over one shared-memory
    segment for all the small tensors of a batch instead of one per tensor. ``pack(obj).unpack()``
    equals ``obj``, value for value and type for type; tensors that required grad come back as
    leaves requiring grad.

    Tensors larger than ``max_bytes`` (images, say) stay in the structure as they are, each in its
    own memory: a packed tensor is a view of the whole buffer wherever it goes, so a kept label
    would otherwise keep the batch's images alive with it.

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
        max_bytes: The largest tensor packed, 64 KiB by default; None packs every tensor.

    Returns:
        The :class:`todevice.PackedBatch`.

    Raises:
        ValueError: ``obj`` contains itself, or is nested deeper than Python's recursion limit, or
            ``max_bytes`` is negative.
        TypeError: ``max_bytes`` is neither an int nor None.

    .. versionadded:: 0.1.0
    """
    if max_bytes is not None:
        _options.check_max_bytes(max_bytes, "pack with max_bytes")
    if _traced.compiling():  # nothing packed, every tensor loose: see _traced.unpack (before torch 2.11, untraced)
        if not _traced.TRACES:
            return _untraced_pack(obj, shared=shared, max_bytes=max_bytes)  # type: ignore[no-any-return]
        return PackedBatch(torch.empty(0, dtype=torch.uint8), _traced.NOTHING_PACKED, obj, (), loose=1)
    try:
        taken = _layout.take(obj, _layout.PACKING, max_bytes, None, grad=True)
    except _walk.LeafError as failure:
        _walk.explain(failure, obj, None, verb="pack")
    except RecursionError as err:
        _walk.refuse_cycles(obj, err, "pack")
        msg = "Cannot pack a structure nested deeper than Python's recursion limit; move() handles it."
        raise ValueError(msg) from err
    tensors = taken.tensors
    grad = any(map(_layout.requires_grad, tensors))  # one pass in C; the slots only where a tensor requires grad
    requires_grad = tuple(k for k, t in enumerate(tensors) if t.requires_grad) if grad else ()
    for k in requires_grad:
        tensors[k] = tensors[k].detach()  # stack(out=) refuses inputs that require grad
    nbytes = taken.layout.nbytes
    if shared:
        # In a DataLoader worker: straight into shared memory, so that sending it to the main
        # process copies nothing (as default_collate does for each of its tensors).
        storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    _layout.write(buffer, taken.layout, tensors)
    return PackedBatch(buffer, taken.layout, taken.skeleton, requires_grad, len(taken.loose))


class PackedBatch(_tree.Packed):
    """A structure whose tensors travel in one buffer: made by :func:`todevice.pack`.

    It holds one uint8 buffer with the bytes of every plain dense tensor, the layout of those tensors
    in it, and the structure itself with a slot where each tensor was (non-tensor leaves, and tensors
    that cannot be packed, such as sparse ones, stay in the structure as they are). It pickles as
    one buffer plus a small header, and :func:`todevice.move` accepts it anywhere in a structure.

    It is not the batch: :meth:`unpack` gives the batch back. A DataLoader with
    ``collate_fn=todevice.collate()`` and ``num_workers > 0`` hands the loop PackedBatches (with
    ``num_workers=0`` it hands over the batches themselves), so a loop written for the batch fails on
    the first access. Indexing (``packed["x"]``, ``packed[0]``), iterating or unpacking
    (``x, y = packed``, ``"x" in packed``), and reading an attribute the batch has but a PackedBatch
    has not (``packed.image``, ``packed.to(device)``) raise a TypeError that says so: call
    ``.unpack(device)``, or iterate through :func:`todevice.prefetch`, which unpacks each batch.
    That error is an AttributeError too, so ``hasattr()`` and ``getattr()`` with a default answer as
    for any missing attribute. Names starting with ``_`` raise a plain AttributeError. ``len()``
    is not defined, so a PackedBatch is always true.

    Example:
        >>> import torch, todevice
        >>> packed = todevice.pack({"x": torch.arange(3), "y": [torch.ones(2, 2), "label"]})
        >>> packed.buffer.numel()  # 24 bytes of int64 and 16 of float32, each at a 16-byte boundary
        48
        >>> out = packed.unpack()
        >>> out["x"], out["y"][1]
        (tensor([0, 1, 2]), 'label')
        >>> try:
        ...     packed["x"]
        ... except TypeError as err:
        ...     print(err)  # doctest: +ELLIPSIS
        'PackedBatch' object is not subscriptable: this PackedBatch holds a dict, ... .unpack(device), ...

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        layout: _layout.Layout,
        skeleton: Any,
        requires_grad: tuple[int, ...],
        loose: int = 0,
    ) -> None:
        self.buffer, self.layout, self.skeleton = buffer, layout, skeleton
        self.requires_grad = requires_grad  # slots whose tensor required grad
        self.loose = loose  # tensors and .to() objects left in the skeleton (large, sparse, subclasses, ...)

    def __repr__(self) -> str:
        n = len(self.layout.order)
        return f"PackedBatch({n} tensors, {self.layout.nbytes} bytes, {len(self.layout.groups)} groups)"

    # The loop of a DataLoader with workers gets PackedBatches where, without workers, it gets the batch: every way of
    # using one as the batch explains that, instead of Python's bare message. Hidden from type checkers, which would
    # otherwise take every attribute to exist and a PackedBatch to be indexable and iterable.
    if not TYPE_CHECKING:

        def __getitem__(self, key):
            raise PackedBatchError(f"'PackedBatch' object is not subscriptable: {_unpack_first(self)}")

        def __iter__(self):
            # Also what `x, y = packed` reaches. Raising here, not leaving iteration to __getitem__,
            # keeps iter() refusing a PackedBatch at once, as it always did.
            raise PackedBatchError(f"'PackedBatch' object is not iterable: {_unpack_first(self)}")

        def __len__(self):
            raise PackedBatchError(f"object of type 'PackedBatch' has no len(): {_unpack_first(self)}")

        def __bool__(self):  # a PackedBatch is a batch: true, as every object without len() is
            return True

        def __contains__(self, item):
            # `in` would fall back to __iter__, but replaces a TypeError from it with its own message.
            raise PackedBatchError(f"'PackedBatch' object does not support 'in': {_unpack_first(self)}")

        def __getattr__(self, name):
            # Only for names the instance and its class lack. Protocols probe private and dunder names (__setstate__
            # while unpickling, _repr_html_, _fields): those stay the plain error. The rest is an AttributeError too, so
            # hasattr(), getattr(..., default) and the DataLoader's probes read it as a missing attribute.
            private = name.startswith("_")
            cls, why = (AttributeError, "") if private else (PackedBatchAttributeError, f": {_unpack_first(self)}")
            err = cls(f"'PackedBatch' object has no attribute {name!r}{why}")
            err.name, err.obj = name, self  # what Python's "Did you mean ...?" hint reads
            raise err

    def pin_memory(self, device: Any = None) -> PackedBatch:
        """This batch with its buffer in page-locked memory: one call, whatever the batch holds.

        ``DataLoader(pin_memory=True)`` calls it. Where no pinned memory exists, the batch comes back
        as it is. Tensors that were not packed, and objects with their own ``.to()``, are pinned one by
        one, as the DataLoader pins them.
        """
        try:
            buffer = self.buffer.pin_memory()
        except RuntimeError:  # no accelerator, or a backend without pinned memory
            return self
        skeleton = pin_structure(self.skeleton) if self.loose else self.skeleton  # type: ignore[no-untyped-call]
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
        if _traced.compiling():  # per-leaf copies, which the compiler schedules (before torch 2.11, untraced)
            if not _traced.TRACES:
                return _untraced_unpack(self, device, non_blocking=non_blocking)
            return _traced.unpack(self, "cpu" if device is None else device, non_blocking)
        # move(batch, device, coalesce=False), without walking to the batch
        return _move.walk_again(self, _move.plan_for("cpu" if device is None else device, non_blocking, None))


_untraced_pack = _traced.untraced(pack, "todevice.pack()")
_untraced_unpack = _traced.untraced(PackedBatch.unpack, "PackedBatch.unpack()")


def _unpack_first(packed: PackedBatch) -> str:
    """What the batch is, and how to get it: the end of every PackedBatchError message."""
    # Read from __dict__: __getattr__ may run on an instance that unpickling has not filled yet,
    # and reading a missing attribute here would call it again.
    skeleton = packed.__dict__.get("skeleton")
    if "skeleton" not in packed.__dict__:
        held = "batch"
    elif isinstance(skeleton, _tree.Slot):  # the batch is one packed tensor
        held = "Tensor"
    elif isinstance(skeleton, _tree.Deferred):  # a registered type or a mapping, rebuilt when unpacked
        held = skeleton.cls.__name__
    else:
        held = type(skeleton).__name__
    article = "an" if held[:1].lower() in "aeio" else "a"  # a UserDict, an OrderedDict
    return (
        f"this PackedBatch holds {article} {held}, packed into one buffer by todevice.pack() (a DataLoader "
        f"worker packs each batch with collate_fn=todevice.collate()). Get the {held} back with "
        f".unpack(device), or .unpack() to keep its tensors on the host; or iterate through "
        f"todevice.prefetch(loader, device), which unpacks each batch."
    )
