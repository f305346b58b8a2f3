"""Devices, device-agnostic: checking a target before anything is copied, and waiting for copies."""

from __future__ import annotations

import contextlib
import functools
import os
import types
import warnings
from typing import Any, NamedTuple, Union

import torch

DeviceLike = Union[str, int, torch.device]

HOST_TYPES = frozenset({"cpu", "meta"})  # devices that always exist and never need a wait


def _backend(device_type: str) -> types.ModuleType | None:
    """torch.cuda, torch.xpu, torch.mps, or a PrivateUse1 backend's module, when there is one."""
    mod = getattr(torch, device_type, None)
    return mod if isinstance(mod, types.ModuleType) else None


def _forwarded(name: str) -> Any:
    return lambda self, *args, **kwargs: getattr(self._module(), name)(*args, **kwargs)


class _Backend:
    """The calls of ``torch.accelerator`` that todevice makes, for torch before 2.8 (``torch.accelerator`` came in 2.6,
    ``device_index`` in 2.8): made on ``torch.cuda``, else ``torch.xpu``, whichever is available."""

    @staticmethod
    def _module() -> Any:
        for name in ("cuda", "xpu"):
            mod = getattr(torch, name, None)
            if mod is not None and mod.is_available():
                return mod
        return None

    def is_available(self) -> bool:
        return self._module() is not None

    def current_accelerator(self) -> torch.device:
        return torch.device(self._module().__name__.rpartition(".")[2])

    device_count = _forwarded("device_count")
    current_device_index = _forwarded("current_device")
    set_device_index = _forwarded("set_device")
    device_index = _forwarded("device")
    current_stream = _forwarded("current_stream")
    set_stream = _forwarded("set_stream")
    synchronize = _forwarded("synchronize")


# torch.accelerator where it has every call todevice makes (torch 2.8 and later), else the same calls on the backend.
accel: Any = torch.accelerator if hasattr(getattr(torch, "accelerator", None), "device_index") else _Backend()


def accelerator() -> torch.device | None:
    """The current accelerator (cuda, xpu, mps, a PrivateUse1 backend), or None on a host-only machine: asked once
    per process (``_asked``), as a forked DataLoader worker asks again for itself."""
    return _asked(os.getpid(), accel)


@functools.lru_cache(maxsize=8)
def _asked(pid: int, backend: Any) -> torch.device | None:
    """What ``backend`` says of process ``pid``'s accelerator. Asking calls into the backend, and with
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which Lightning sets, into NVML: ``torch.accelerator.is_available()`` took
    72.6 us against 3.3 us (torch 2.14.1's CUDA build without a GPU, 2-core x86 VM), and a step of ``out=`` of 100
    small tensors into meta views, which asked once, 396 us against 266 us asked once per process. A backend does not
    come or go while a process runs; one registered after todevice first asked is not seen."""
    return backend.current_accelerator() if backend.is_available() else None


def available_devices() -> list[str]:
    """Device types usable on this machine, for messages and ``python -m todevice info``."""
    acc = accelerator()
    return ["cpu", *([] if acc is None else [f"{acc.type}:{i}" for i in range(accel.device_count())]), "meta"]


def _invalid(device: object, why: str, verb: str = "move to") -> ValueError:
    return ValueError(f"Cannot {verb} device {device!r}: {why} Devices here: {', '.join(available_devices())}.")


def resolve_device(device: DeviceLike | None, verb: str = "move to", current: bool = True) -> torch.device:
    """The torch.device for ``device``, or a ValueError/TypeError naming it (and ``verb``). ``"cpu:0"`` is ``"cpu"``,
    as tensors say. An accelerator named without an index (``"cuda"``) means its current device, as ``.to()`` reads it,
    filled in unless ``current`` is False (for a caller that fills it in on each call: the current one can change)."""
    if device is None:
        msg = (
            f"Cannot {verb} device None: name the device, such as 'cuda', 'cuda:1', 0 or torch.device('cpu'). "
            f"move() leaves it out only with out=, whose tensors say where."
        )
        raise TypeError(msg)
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        msg = (
            f"Cannot {verb} device {device!r}: expected a str, an int or a torch.device, "
            f"got {type(device).__qualname__}. Pass e.g. 'cuda', 'cuda:1', 0 or torch.device('cpu')."
        )
        raise TypeError(msg)
    if isinstance(device, int):
        if device < 0:
            raise _invalid(device, "a device index cannot be negative.", verb)
        acc = accelerator()
        if acc is None:
            raise _invalid(device, "an integer names an accelerator, and this machine has none.", verb)
        dev = torch.device(acc.type, device)
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise _invalid(device, "PyTorch does not know this device string.", verb) from err
    else:
        dev = device
    if dev.type in HOST_TYPES:
        return as_tensors_say(dev)
    mod = _backend(dev.type)
    if mod is None:
        # No torch.<type> module (xla, hpu, lazy, ...), so nothing to ask below: ask for an empty tensor there, the
        # one probe that every backend answers, before anything is copied.
        try:
            torch.empty(0, device=dev)
        except Exception as err:
            raise _invalid(device, f"no {dev.type} backend answers here ({type(err).__name__}).", verb) from err
    is_available = getattr(mod, "is_available", None)
    if callable(is_available) and not is_available():
        raise _invalid(device, f"{dev.type} is not available on this machine.", verb)
    device_count = getattr(mod, "device_count", None)
    if dev.index is not None and callable(device_count) and dev.index >= device_count():
        raise _invalid(device, f"there are {device_count()} {dev.type} devices here.", verb)
    if current and means_current(dev):
        return torch.device(dev.type, current_index())
    return dev


def current_index() -> int:
    return accel.current_device_index()  # type: ignore[no-any-return]


def set_index(index: int) -> None:
    accel.set_device_index(index)


def as_tensors_say(dev: torch.device) -> torch.device:
    """``dev`` as a tensor there reports its device: torch drops the index of the host's (``cpu:0``) and meta's."""
    return torch.device(dev.type) if dev.type in HOST_TYPES and dev.index is not None else dev


def means_current(dev: torch.device) -> bool:
    """Whether ``dev`` names an accelerator without an index (``"cuda"``): whichever device is current at the time."""
    index: int | None = dev.index  # typed as int in torch's stubs, but None for "cuda"
    return index is None and dev.type not in HOST_TYPES and is_accelerator(dev)


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device``'s current stream has finished."""
    if is_accelerator(device):
        accel.current_stream(device).synchronize()
        return
    sync = getattr(_backend(device.type), "synchronize", None)
    if callable(sync):
        sync()


def wait_for(sources: list[torch.Tensor], also: set[torch.device] | None = None) -> None:
    """Wait for the copies into host memory from these tensors' accelerators (and ``also``'s)."""
    devices = {t.device for t in sources if not t.is_cpu and not t.is_meta}
    for dev in devices.union(also) if also else devices:
        synchronize(dev)


def devices_in_use() -> list[torch.device]:
    """The accelerator's devices this process has a context on (CUDA), or its current device (others)."""
    acc = accelerator()
    if acc is None:
        return []
    has_context = getattr(torch._C, f"_{acc.type}_hasPrimaryContext", None)
    if callable(has_context):
        return [torch.device(acc.type, i) for i in range(accel.device_count()) if has_context(i)]
    return [torch.device(acc.type, current_index())]


def on_device(device: torch.device) -> Any:
    """A context in which ``device`` is the current accelerator device. CUDA makes a process's context on the current
    device when first needed, pinned host memory included: a target's allocations are made under its device."""
    if device.index is None or not is_accelerator(device) or device.index == current_index():
        return contextlib.nullcontext()
    return accel.device_index(device.index)


def no_pinned_memory() -> str | None:
    """Why this machine has no page-locked host memory (the first line of torch's error), or None where it has: no
    accelerator, or a backend without a pinned-memory allocator."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError as err:  # NotImplementedError too: a PrivateUse1 backend without the allocator
        return str(err).splitlines()[0]
    return None


def pinned(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Page-locked host memory for a copy to ``device`` from PyTorch's caching host allocator, which hands a block out
    again only once the copies recorded on it have finished: the caller may drop it once its copy is queued. None where
    the backend has no pinned memory, and where allocating it failed (reported once; the next call tries again)."""
    try:
        with on_device(device):
            return torch.empty(numel, dtype=dtype, pin_memory=True)
    except NotImplementedError:  # a backend without pinned memory: its copies are synchronous anyway
        return None
    except RuntimeError as err:
        msg = (
            f"todevice: could not allocate page-locked host memory ({type(err).__name__}); copies to "
            f"{device.type} go from pageable memory and may block until queued work finishes. Free pinned "
            f"memory (torch.accelerator.empty_host_cache()) or lower the DataLoader's prefetch."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=1)  # once per process: warnings keeps the registry
        return None


# ---------------------------------------------------------------- streams


class Entered(NamedTuple):
    """What :func:`enter_stream` changed: the user's stream on the side stream's device, and the current device."""

    user: torch.Stream
    device_index: int | None


def check_stream(stream: Any) -> None:
    """A TypeError unless ``stream`` is a stream: a torch.Stream, or a backend's (torch.cuda.Stream)."""
    if isinstance(getattr(stream, "device", None), torch.device) and callable(getattr(stream, "wait_stream", None)):
        return
    msg = (
        f"Cannot move on stream={stream!r}: stream takes a torch.Stream (or torch.cuda.Stream) on the target "
        f"device, such as torch.Stream(device='cuda'), or None."
    )
    raise TypeError(msg)


def issuing(stream: torch.Stream | None, device: torch.device) -> torch.Stream | None:
    """The stream a move to ``device`` issues its copies on: ``stream``, or None for a host stream with a host target,
    which has no streams to order and copies as called: a loop's ``torch.Stream(device=device)`` moves to the CPU as
    without one, as a compiled move does with any stream."""
    if stream is not None and device.type in HOST_TYPES and stream.device.type in HOST_TYPES:
        return None
    return stream


def enter_stream(stream: torch.Stream, device: torch.device) -> Entered:
    """Make ``stream`` current for ``device``'s copies; ValueError where it is on another device than ``device``, an
    accelerator target. The side stream does not wait for the user's: a copy from host memory needs nothing queued
    there, so it starts at once. A copy from accelerator memory waits first (:func:`order`)."""
    if device.type not in HOST_TYPES and (stream.device.type, stream.device.index) != (device.type, device.index):
        msg = (
            f"Cannot copy to {device} on a stream of {stream.device}: a stream issues work on its own "
            f"device only. Pass a stream made with torch.Stream(device='{device}')."
        )
        raise ValueError(msg)
    index = current_index() if is_accelerator(stream.device) else None
    user = accel.current_stream(stream.device)
    accel.set_stream(stream)  # also makes the stream's device current
    return Entered(user, index)


def leave_stream(entered: Entered) -> None:
    """Undo :func:`enter_stream`: the user's stream, and the device that was current, are current again."""
    accel.set_stream(entered.user)
    if entered.device_index is not None and current_index() != entered.device_index:
        set_index(entered.device_index)


def hand_over(side: torch.Stream, user: torch.Stream, outputs: list[torch.Tensor]) -> None:
    """``user`` waits for what ``side`` copied, and each output is recorded on ``user``, so the caching allocator does
    not reuse its memory for ``side`` while ``user`` may still read it (pytorch#23729)."""
    user.wait_stream(side)
    _record(outputs, user)


def _record(outputs: list[torch.Tensor], stream: torch.Stream) -> None:
    for t in outputs:
        if t.device.type == stream.device.type:
            t.record_stream(stream)


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is one of the current accelerator's: it has streams, events and a current index."""
    acc = accelerator()
    return acc is not None and acc.type == device.type


def receive(copied: torch.Event, outputs: list[torch.Tensor], device: torch.device) -> None:
    """Make tensors copied on a side stream safe on the current stream, when they are about to be used."""
    user = accel.current_stream(device)
    user.wait_event(copied)
    _record(outputs, user)
