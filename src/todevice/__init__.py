"""todevice: move any nested structure of PyTorch tensors to a device, fast and correctly."""

from todevice._move import move
from todevice._tree import register, unregister

__version__ = "0.1.0"

__all__ = [
    # moving
    "move",
    # containers
    "register",
    "unregister",
]
