"""``tdtest``: a tiny accelerator for tests, on PyTorch's Python PrivateUse1 hooks.

Each tensor on ``tdtest`` keeps its data in a host tensor (``.raw``); the few aten ops the transfer
engine uses are implemented on it, and every copy across the device boundary is counted in
``COPIES``. Registering a backend makes ``torch.accelerator.is_available()`` true for the whole
process, so this module is imported only in a process of its own (see tests/test_pack.py).

Two limits of a Python backend shape the tests: there is no pinned-memory allocator (so copies back
to the host are blocking), and views made while autograd records views lose their Python wrapper
(so moves run under ``torch.inference_mode()``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

_setup_privateuseone_for_python_backend("tdtest")

COPIES = {"h2d": 0, "d2h": 0, "d2d": 0}
NON_BLOCKING: list[tuple[str, bool]] = []  # (direction, non_blocking) of every copy
KERNELS = {"cat": 0, "foreach_copy": 0}  # kernels run on the device, by op


def wrap(raw: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` on tdtest, as a real backend's are, its data in ``raw`` on the host."""
    t = torch._C._acc.create_empty_tensor(list(raw.shape), raw.dtype)
    t.raw = raw  # type: ignore[attr-defined]
    return t


def impl(name: str) -> Any:
    return torch.library.impl(name, "privateuseone")


@impl("aten::empty.memory_format")
def empty(
    size: Any,
    *,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    memory_format: Any = None,
) -> torch.Tensor:
    return wrap(torch.empty(size, dtype=dtype or torch.float32))


@impl("aten::empty_strided")
def empty_strided(
    size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> torch.Tensor:
    return wrap(torch.empty(size, dtype=dtype or torch.float32))


@impl("aten::_copy_from")
def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if src.device.type == "tdtest" and dst.device.type == "tdtest":
        COPIES["d2d"] += 1
        NON_BLOCKING.append(("d2d", non_blocking))
        dst.raw.copy_(src.raw)  # type: ignore[attr-defined]
    elif src.device.type == "tdtest":
        COPIES["d2h"] += 1
        NON_BLOCKING.append(("d2h", non_blocking))
        dst.copy_(src.raw)  # type: ignore[attr-defined]
    else:
        COPIES["h2d"] += 1
        NON_BLOCKING.append(("h2d", non_blocking))
        dst.raw.copy_(src)  # type: ignore[attr-defined]
    return dst


@impl("aten::view")
def view(t: Any, size: Any) -> torch.Tensor:
    return wrap(t.raw.view(size))


@impl("aten::view.dtype")
def view_dtype(t: Any, dtype: torch.dtype) -> torch.Tensor:
    return wrap(t.raw.view(dtype))


@impl("aten::as_strided")
def as_strided(t: Any, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    return wrap(t.raw.as_strided(size, stride, storage_offset))


@impl("aten::slice.Tensor")
def slice_(t: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> torch.Tensor:
    return wrap(torch.ops.aten.slice.Tensor(t.raw, dim, start, end, step))


@impl("aten::select.int")
def select(t: Any, dim: int, index: int) -> torch.Tensor:
    return wrap(t.raw.select(dim, index))


@impl("aten::unbind.int")
def unbind(t: Any, dim: int = 0) -> list[torch.Tensor]:
    return [wrap(r) for r in t.raw.unbind(dim)]


@impl("aten::detach")
def detach(t: Any) -> torch.Tensor:
    return wrap(t.raw.detach())


@impl("aten::alias")
def alias(t: Any) -> torch.Tensor:
    return wrap(t.raw)


@impl("aten::_reshape_alias")
def reshape_alias(t: Any, size: Any, stride: Any) -> torch.Tensor:
    return wrap(t.raw.as_strided(size, stride))


@impl("aten::cat")
def cat(tensors: Any, dim: int = 0) -> torch.Tensor:
    KERNELS["cat"] += 1
    return wrap(torch.cat([t.raw for t in tensors], dim))


@impl("aten::cat.out")
def cat_out(tensors: Any, dim: int = 0, *, out: Any) -> torch.Tensor:
    KERNELS["cat"] += 1
    torch.cat([t.raw for t in tensors], dim, out=out.raw)
    return out


@impl("aten::_foreach_copy_")
def foreach_copy(self: Any, src: Any, non_blocking: bool = False) -> None:
    """One kernel on the device; from host tensors, a copy across the boundary for each."""
    if any(s.device.type == "tdtest" for s in src):
        KERNELS["foreach_copy"] += 1
    for dst, s in zip(self, src):
        if s.device.type == "tdtest":
            dst.raw.copy_(s.raw)
        else:
            dst.copy_(s, non_blocking=non_blocking)  # counted by _copy_from


RECORDED: list[int] = []  # the id of every tensor recorded on a stream, in order


@impl("aten::record_stream")
def record_stream(self: Any, s: Any) -> None:
    """Nothing to protect in host memory: counted, so a test can see which outputs a move records."""
    RECORDED.append(id(self))
