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
    """``move()`` passed an object through as it is, which left behind what the move would have moved: an unknown
    object (neither a container it knows, nor registered, nor with a ``.to()`` of its own) holding, in its
    ``__dict__``, a tensor the move would have copied; an ``nn.Module`` whose parameters or buffers are not on the
    target (its ``.to()`` moves it in place, which would change the model); or an iterator, such as a generator, which
    a walk would use up. The message names the object's path and type, what was left, and the fix:
    ``todevice.register()`` its type or give it a ``.to()``, ``module.to(device)``, or a list; or ``strict=True`` to
    make it an error. Python's default warning filter shows it once per line of the calling code and message.

    .. versionadded:: 0.2.0
    """
