"""Errors todevice raises on purpose (public)."""

from __future__ import annotations


class DeviceMismatchError(RuntimeError):
    """Tensors that must share a device do not; the message names each one by its path.

    A RuntimeError, like PyTorch's own "Expected all tensors to be on the same device", so existing
    ``except RuntimeError`` clauses still catch it.

    .. versionadded:: 0.1.0
    """
