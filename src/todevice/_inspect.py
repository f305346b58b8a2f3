"""Diagnostics: which tensor is on which device, why Module.to() missed one, and a guard on forward."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from todevice import _layout, _own_to, _stream, _tree, _walk
from todevice._pack import PackedBatch
from todevice._stream import DeviceLike
from todevice.errors import DeviceMismatchError

SHOWN = 8  # paths listed per device in a message; the rest are counted
_Tensor = torch.Tensor


def _tensors(
    obj: Any, prefix: str = "", views: list[torch.Tensor] | None = None, within: dict[int, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in ``obj``, wherever reached; a module's by qualified name. A ``.to()`` object
    is looked into (``_own_to.inside``), a PackedBatch too (its buffer's views fill its slots). ``within``: the
    ``.to()`` objects being looked into, by id, with their paths: one that holds itself or its parent is a cycle."""
    if isinstance(obj, nn.Module):
        sep = "." if prefix else ""
        for name, t in [*obj.named_parameters(remove_duplicate=False), *obj.named_buffers(remove_duplicate=False)]:
            yield f"{prefix}{sep}{name}", t
        return
    try:
        for path, node in _walk.paths(obj, revisit=True):
            if isinstance(node, torch.Tensor):
                yield prefix + path, node
            elif views is not None and isinstance(node, _tree.Slot):
                yield prefix + path, views[node]
            elif isinstance(node, PackedBatch):
                yield from _tensors(node.skeleton, prefix + path, _layout.read(node.buffer, node.layout), within)
            elif isinstance(node, nn.Module):
                yield from _tensors(node, prefix + path)
            elif _tree.kind_of(type(node)).code == _tree.TO:
                within = {} if within is None else within
                if id(node) in within:  # in itself, or in a PackedBatch it holds
                    found = _walk.CycleError(within[id(node)], prefix + path, node)  # within's paths have the prefix
                    raise ValueError(_walk.cycle_message(found, "inspect"))
                within[id(node)] = prefix + path
                for part, inner in _own_to.inside(node):
                    yield from _tensors(inner, prefix + path + part, within=within)
                del within[id(node)]
    except _walk.CycleError as cycle:  # a container that holds itself, at paths inside obj
        cycle = _walk.CycleError(prefix + cycle.first, prefix + cycle.repeat, cycle.node)
        raise ValueError(_walk.cycle_message(cycle, "inspect")) from None


def devices(obj: Any, /) -> dict[str, torch.device]:
    """The device of every tensor in ``obj``, by its path.

    Paths are written as in todevice's errors (``['x'][2].field``); a module's tensors go by their
    qualified parameter and buffer names (``encoder.layers.0.weight``), also when the module sits
    inside a structure (``['model'].fc.bias``). A tensor at the top level has the path ``""``.

    Example:
        >>> import torch, todevice
        >>> todevice.devices({"x": [torch.ones(1), torch.ones(1, device="meta")]})
        {"['x'][0]": device(type='cpu'), "['x'][1]": device(type='meta')}

    .. versionadded:: 0.1.0
    """
    return {path: t.device for path, t in _tensors(obj)}


def _listing(paths: list[str]) -> str:
    shown = ", ".join(_walk.format_path(p) for p in paths[:SHOWN])
    more = len(paths) - SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def _where(by_device: dict[torch.device, list[str]]) -> str:
    return "; ".join(f"{dev}: {_listing(paths)}" for dev, paths in by_device.items())


def check(*objs: Any, device: DeviceLike | None = None) -> torch.device | None:
    """The one device all tensors in ``objs`` are on, or DeviceMismatchError naming where each one is.

    Modules and structures can be mixed: ``check(model, batch)``. With several objects, paths start
    with the object's place in the call (``objs[1]['x']``).

    Example:
        >>> import torch, todevice
        >>> model, batch = torch.nn.Linear(2, 2), {"x": torch.ones(2), "y": torch.ones(2, device="meta")}
        >>> todevice.check(model, batch)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        todevice.errors.DeviceMismatchError: Expected every tensor on one device, found 2: ...; meta: objs[1]['y']...

    Args:
        objs: Tensors, structures of them, modules.
        device: The device every tensor must be on; the message then lists every tensor elsewhere.

    Returns:
        The shared device, or None when there is no tensor at all.

    Raises:
        DeviceMismatchError: Tensors on more than one device, or off ``device``.

    .. versionadded:: 0.1.0
    """
    want = _stream.resolve_device(device, "check against") if device is not None else None  # "cpu:0" is "cpu"
    by_device: dict[torch.device, list[str]] = {}
    for i, obj in enumerate(objs):
        for path, t in _tensors(obj, f"objs[{i}]" if len(objs) > 1 else ""):
            by_device.setdefault(t.device, []).append(path)
    if want is not None:
        wrong = {dev: paths for dev, paths in by_device.items() if dev != want}
        if wrong:
            count = sum(len(p) for p in wrong.values())
            msg = (
                f"Expected every tensor on {want}, found {count} elsewhere: {_where(wrong)}. "
                f"Move them with todevice.move(obj, {str(want)!r}), or module.to({str(want)!r})."
            )
            raise DeviceMismatchError(msg)
        return want if by_device else None
    if len(by_device) > 1:
        msg = (
            f"Expected every tensor on one device, found {len(by_device)}: {_where(by_device)}. "
            f"Move them with todevice.move(obj, device), or module.to(device)."
        )
        raise DeviceMismatchError(msg)
    return next(iter(by_device), None)


# ---------------------------------------------------------------- audit()

Kind = Literal["unregistered-tensor", "tensor-in-container", "split-devices"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing in a module that ``Module.to()`` will not move, or that sits on the wrong device.

    Attributes:
        path: The qualified attribute path (``encoder.cache[2]``), or the module's name for
            ``split-devices`` ("" for the top module).
        kind: ``"unregistered-tensor"``, ``"tensor-in-container"`` or ``"split-devices"``.
        message: What is wrong, and the fix.

    .. versionadded:: 0.1.0
    """

    path: str
    kind: Kind
    message: str


def _need_module(module: Any, name: str) -> None:
    if not isinstance(module, nn.Module):
        msg = (
            f"Cannot {name} a {type(module).__qualname__}: {name}() takes an nn.Module, the model. For a batch, "
            f"use todevice.check(batch) or todevice.devices(batch)."
        )
        raise TypeError(msg)


def audit(module: nn.Module, /) -> list[Finding]:
    """What in ``module`` ``Module.to()`` will not move, and parameters split across devices.

    ``Module.to()`` moves parameters and buffers only. A tensor kept as a plain attribute, or in a
    plain list or dict attribute, stays where it was made, and the next forward fails with
    "Expected all tensors to be on the same device".

    Example:
        >>> import torch, todevice
        >>> class Scaled(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(2, 2)
        ...         self.scale = torch.ones(2)  # a plain attribute: .to() skips it
        >>> [(f.path, f.kind) for f in todevice.audit(Scaled())]
        [('scale', 'unregistered-tensor')]

    Returns:
        The findings, in module order.

    .. versionadded:: 0.1.0
    """
    _need_module(module, "audit")
    registered = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    findings: list[Finding] = []
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            where = f"{name}.{attr}" if name else attr
            if isinstance(value, torch.Tensor):
                if id(value) not in registered and not _recomputed(sub, attr):
                    msg = (
                        f"{where} is a tensor attribute on {value.device}, neither a parameter nor a buffer: "
                        f"Module.to() will not move it. Register it with self.register_buffer({attr!r}, tensor) "
                        f"(persistent=False to keep it out of the state_dict), or make it an nn.Parameter."
                    )
                    findings.append(Finding(where, "unregistered-tensor", msg))
            elif _tree.kind_of(type(value)).code == _tree.NODE:  # every container the walk takes apart
                findings.extend(_in_container(where, value, registered))
        findings.extend(_split(name, sub))
    return findings


def _recomputed(module: nn.Module, attr: str) -> bool:
    """A tensor attribute that a pre-hook rebuilds each forward from registered parameters: pruning
    and spectral norm keep ``<attr>_orig``, the old weight norm ``<attr>_g`` and ``<attr>_v``."""
    params = module._parameters
    return f"{attr}_orig" in params or (f"{attr}_g" in params and f"{attr}_v" in params)


def _in_container(where: str, value: Any, registered: set[int]) -> Iterator[Finding]:
    """Tensors, and modules, held in a plain container attribute: Module.to() reaches neither."""
    kind = type(value).__name__
    for path, node in _walk.paths(value):
        if isinstance(node, torch.Tensor) and id(node) not in registered:  # not a view of a parameter (RNNs)
            what, moved = f"a tensor on {node.device}", "it"
            fix = "Use nn.ParameterList or nn.ParameterDict for parameters, or register each tensor as a buffer."
        elif isinstance(node, nn.Module) and any(id(p) not in registered for p in node.parameters()):
            what, moved = f"a {type(node).__name__}", "its parameters and buffers"
            fix = "Use nn.ModuleList or nn.ModuleDict."
        else:
            continue
        msg = f"{where}{path} is {what} in a plain {kind} attribute: Module.to() will not move {moved}. {fix}"
        yield Finding(where + path, "tensor-in-container", msg)


def _split(name: str, module: nn.Module) -> Iterator[Finding]:
    """Parameters and buffers of one module on more than one device (a model split across devices on
    purpose, one module per device, is not reported)."""
    prefix = f"{name}." if name else ""
    split: dict[torch.device, list[str]] = {}
    for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        split.setdefault(t.device, []).append(prefix + n)
    if len(split) > 1:
        msg = f"{name or 'The module'} has parameters and buffers on {len(split)} devices ({_where(split)}). "
        yield Finding(name, "split-devices", msg + "Move the module whole with module.to(device).")


# ---------------------------------------------------------------- guard()


class guard:  # named like a function: it is called, and used as a context manager
    """Check every forward call's tensor inputs against the device of the module they go into.

    Installs a forward pre-hook on ``module`` and each submodule with parameters or buffers of its
    own. A call whose input tensor is not on that submodule's device raises DeviceMismatchError
    naming the submodule, the input's path and both devices, before PyTorch's own, nameless
    "Expected all tensors to be on the same device". Use it as a context manager, or call
    :meth:`remove`; once removed, no hook and no overhead remain.

    Example:
        >>> import torch, todevice
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to("meta"))
        >>> with todevice.guard(model):  # doctest: +ELLIPSIS
        ...     model(torch.ones(2))
        Traceback (most recent call last):
        ...
        todevice.errors.DeviceMismatchError: Module 1 (Linear) is on meta, but its input args[0] is on cpu...

    A 0-dim CPU tensor is never reported: PyTorch accepts one beside tensors of any device.

    Args:
        module: The model to guard.
        ignore: Inputs that belong where they are, by their path in the message (``"args[1]"``,
            ``"kwargs['lengths']"``) or by keyword name (``"lengths"``): the CPU lengths that
            ``pack_padded_sequence`` wants, for instance.

    .. versionadded:: 0.1.0
    """

    def __init__(self, module: nn.Module, /, *, ignore: Iterable[str] = ()) -> None:
        _need_module(module, "guard")
        self.module = module
        names = (ignore,) if isinstance(ignore, str) else tuple(ignore)  # read once: it may be a generator
        self.ignore = frozenset(names) | frozenset(f"kwargs[{name!r}]" for name in names)
        self._handles: list[Any] = []
        for name, sub in module.named_modules():
            if next(itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)), None) is None:
                continue  # containers: their children check what reaches them
            self._handles.append(sub.register_forward_pre_hook(_Hook(name, sub, self.ignore), with_kwargs=True))

    def remove(self) -> None:
        """Take every hook off; the module is as it was before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"todevice.guard({type(self.module).__name__}, {len(self._handles)} hooks)"


class _Hook:
    """The pre-hook of one submodule: cheap when inputs are right, precise when they are not."""

    def __init__(self, name: str, module: nn.Module, ignore: frozenset[str]) -> None:
        self.name, self.module, self.ignore = name, module, ignore

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The module's device, read at each call (it may have moved since the guard went on), from its
        # dicts directly: module.parameters() builds two generators, several us a call.
        own: torch.Tensor | None = None
        for own in module._parameters.values():
            if own is not None:
                break
        else:
            own = next((b for b in module._buffers.values() if b is not None), None)
            if own is None:
                return
        want = own.device
        if not kwargs and not self.ignore:
            for t in args:  # the common case, tensors as positional arguments: no walk at all
                if type(t) is not _Tensor or (t.device != want and not (t.is_cpu and t.dim() == 0)):
                    break
            else:
                return
        wrong = [  # the inputs off ``want``, but ignored ones and 0-dim CPU tensors (PyTorch accepts those)
            f"{path} is on {t.device}"
            for path, t in _inputs(args, kwargs)
            if t.device != want
            and not (t.is_cpu and t.dim() == 0)
            and not any(path == skip or path.startswith((skip + "[", skip + ".")) for skip in self.ignore)
        ]
        if not wrong:
            return
        name = f"Module {self.name}" if self.name else "The top module"
        msg = (
            f"{name} ({type(self.module).__name__}) is on {want}, but its input {_listing(wrong)}. "
            f"Move the input with todevice.move(x, {str(want)!r}), or the module with module.to(...); "
            f"an input that belongs where it is goes in guard(model, ignore=[...])."
        )
        raise DeviceMismatchError(msg)


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    named = [*((f"args[{i}]", arg) for i, arg in enumerate(args)), *((f"kwargs[{k!r}]", v) for k, v in kwargs.items())]
    for name, arg in named:
        yield from _tensors(arg, name)
