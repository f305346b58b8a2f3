"""todevice: move any nested structure of PyTorch tensors to a device, fast and correctly."""

from typing import TYPE_CHECKING, Any

from todevice._data import collate, prefetch
from todevice._inspect import Finding, audit, check, devices, guard
from todevice._move import move
from todevice._options import COALESCE_MAX_BYTES
from todevice._pack import PackedBatch, pack
from todevice._static import StaticBatch, static
from todevice._tree import register, unregister
from todevice.errors import DeviceMismatchError

if TYPE_CHECKING:
    from todevice._bench.yours import bench

__version__ = "0.2.0.dev0"


def __getattr__(name: str) -> Any:
    # todevice.bench loads the benchmarks (a fifth of a second) only when it is first asked for.
    if name == "bench":
        from todevice._bench.yours import bench

        return bench
    raise AttributeError(f"module 'todevice' has no attribute {name!r}")


__all__ = [  # noqa: RUF022 (grouped by capability, as the style guide asks)
    # moving
    "COALESCE_MAX_BYTES",
    "move",
    # packing
    "PackedBatch",
    "pack",
    # static buffers
    "StaticBatch",
    "static",
    # containers
    "register",
    "unregister",
    # data loading
    "collate",
    "prefetch",
    # diagnostics
    "DeviceMismatchError",
    "Finding",
    "audit",
    "check",
    "devices",
    "guard",
    # timing your own batch
    "bench",
]
