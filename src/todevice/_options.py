"""move()'s options, checked: each error names the option, the value and the fix."""

from __future__ import annotations

import collections.abc
from typing import Any

import torch

from todevice import _stream

# Leaves up to this size are packed into one buffer and sent in one copy when moving from the host
# to an accelerator. Packing a leaf costs a host memcpy; sending it alone costs a copy launch and an
# allocation, 5 to 7 us on a GPU. On a 2-core x86 CPU, a 64 KiB host copy takes 3.4 to 10 us (8 KiB:
# 1.0 us, 16 KiB: 1.4 us, 128 KiB: 4.3 us; medians of quiet and of busy runs): at 64 KiB the memcpy
# about equals the launch it saves, and beyond it the launch is the cheaper.
COALESCE_MAX_BYTES = 64 * 1024


def check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        named = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        meant = isinstance(named, torch.dtype) and castable(named)  # one move() casts to
        hint = f"torch.{dtype}" if meant else "a floating-point one such as torch.float16"
        msg = f"Cannot cast to dtype={dtype!r}: expected a torch.dtype, got {type(dtype).__qualname__}. Pass {hint}."
        raise TypeError(msg)
    if not castable(dtype):
        msg = (
            f"Cannot cast to dtype={dtype!r}: move() casts floating-point and complex tensors only, as "
            f"nn.Module.to() does, so dtype must be a floating-point or complex torch.dtype such as "
            f"torch.float16. Cast integer tensors yourself with tensor.to(dtype)."
        )
        raise TypeError(msg)


def castable(dtype: torch.dtype) -> bool:
    """Whether move()'s ``dtype=`` casts a tensor of ``dtype``: floating-point and complex ones, as nn.Module.to(dtype)
    does; integer and bool tensors keep theirs. The cast rule, in one place."""
    return dtype.is_floating_point or dtype.is_complex


def casts(t: torch.Tensor) -> bool:
    return castable(t.dtype)


def cast_to(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and castable(dtype) else dtype


def check_max_bytes(value: Any, what: str) -> None:
    """Raise unless ``value`` is a number of bytes: an int (or a numpy integer) of 0 or more, not a bool."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        error: type[Exception] = TypeError
    elif value < 0:
        error = ValueError
    else:
        return
    msg = (
        f"Cannot {what}={value!r}: expected a number of bytes, an int >= 0 "
        f"(todevice.COALESCE_MAX_BYTES, {COALESCE_MAX_BYTES}, by default)."
    )
    raise error(msg)


def skip_set(skip_keys: Any) -> frozenset[Any]:
    """The keys to skip: none for None, one key (a str, an int, any hashable but a collection), or a collection."""
    if skip_keys is None:
        return frozenset()
    try:
        if isinstance(skip_keys, (str, bytes)) or not isinstance(skip_keys, collections.abc.Iterable):
            return frozenset((skip_keys,))
        return frozenset(skip_keys)
    except TypeError:
        msg = (
            f"Cannot skip keys {skip_keys!r}: skip_keys takes a dict key or a collection of them, the keys "
            f"whose entries stay where they are, such as skip_keys=['lengths']; keys must be hashable."
        )
        raise TypeError(msg) from None


def check_bool(value: Any, name: str, takes: str = "True or False") -> None:
    if value is not True and value is not False:
        msg = f"Cannot move with {name}={value!r}: {name} takes {takes}."
        raise TypeError(msg)


def check(
    device: Any,
    non_blocking: Any,
    dtype: Any,
    coalesce: Any = None,
    max_bytes: Any = COALESCE_MAX_BYTES,
    stream: Any = None,
    strict: Any = False,
    skip_keys: Any = None,
    dev: torch.device | None = None,
) -> tuple[torch.device, frozenset[Any]]:
    """Every option of move(), prefetch() and collate() checked, in this order, by one rule each: the target device
    (``"cuda"`` left without its index) and the keys to skip, or the error that names the option, the value and the
    fix. ``dev``: the device, checked already (by the plan these arguments found)."""
    if dev is None:
        dev = _stream.resolve_device(device, current=False)
    check_bool(non_blocking, "non_blocking")
    if dtype is not None:
        check_dtype(dtype)
    if coalesce is not None:
        check_bool(coalesce, "coalesce", "None (the default: decided per batch), True or False")
    if max_bytes is not COALESCE_MAX_BYTES:
        check_max_bytes(max_bytes, "coalesce with coalesce_max_bytes")
    if stream is not None:
        _stream.check_stream(stream)
    check_bool(strict, "strict")
    return dev, skip_set(skip_keys)
