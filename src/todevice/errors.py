"""Errors and warnings todevice raises on purpose (public)."""

from __future__ import annotations


class DeviceMismatchError(RuntimeError):
    """Tensors that must share a device do not; the message names each one by its path.

    A RuntimeError, like PyTorch's own "Expected all tensors to be on the same device", so existing
    ``except RuntimeError`` clauses still catch it.

    .. versionadded:: 0.1.0
    """


class PackedBatchError(TypeError):
    """A :class:`todevice.PackedBatch` used as the batch it holds: indexed, iterated, measured with ``len()``, or
    tested with ``in``. The message says what the batch holds and how to get it back (``.unpack(device)``, or
    iterating through :func:`todevice.prefetch`). A TypeError, as Python raises for indexing what cannot be.

    .. versionadded:: 0.2.0
    """


class PackedBatchAttributeError(PackedBatchError, AttributeError):
    """An attribute of the batch read from the :class:`todevice.PackedBatch` that holds it. Also an AttributeError,
    so ``hasattr()`` and ``getattr(packed, name, default)`` read it as a missing attribute.

    .. versionadded:: 0.2.0
    """


class TensorsLeftBehindWarning(UserWarning):
    """``move()`` passed an object through that it does not walk (neither a container it knows, nor registered,
    nor with a ``.to()`` of its own), and that object holds, in its ``__dict__``, a tensor the move would have
    copied: it was not moved. The message names the type and the attribute, and the fixes: ``todevice.register()``
    its type, give it a ``.to()``, or pass ``strict=True`` to make it an error. Python's default warning filter
    shows it once per line of the calling code and message.

    .. versionadded:: 0.2.0
    """
