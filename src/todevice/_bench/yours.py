"""Your batch and your helper: is move() faster than what your loop does now, on your machine?

Each contender's result is checked against move()'s first, and one that differs is reported, not timed: a fast
wrong helper is no benchmark. The rest are timed round by round, in a new order each round, on the batch as the loop
gets it; where it holds host tensors and the target is an accelerator, also pinned, and already on the device. Each
ratio is the median over the rounds of the helper's time over the contender's, with the middle half of them: a
ratio whose middle half holds 1.0x is no measurable difference.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

import todevice
from todevice import _inspect, _stream, _tree, _walk, errors
from todevice._bench.common import (
    HELPER,
    PEERS,
    _per_sample,
    contenders,
    quartiles_of,
    ratio,
    recursive_to_device,
    standing,
)

Mover = Callable[[Any, torch.device], Any]
MOVE = "todevice.move"


@dataclasses.dataclass(frozen=True)
class Row:
    """One contender on one form of the batch: medians per call, and its ratio to the helper over the rounds."""

    form: str  # "pageable", "pinned", "already on cuda:0", or "as given" where the target is not an accelerator
    contender: str
    host_us: float  # until the call returned
    end_to_end_us: float  # until its copies had finished
    speedup: float  # the helper's end-to-end time over this contender's: the median of the per-round ratios
    low: float  # the middle half of those ratios: the 25th percentile ...
    high: float  # ... to the 75th

    @property
    def verdict(self) -> str:
        """ "faster" or "slower" than the helper, or "no measurable difference" where the middle half holds 1.0x."""
        return standing(self.low, self.high)


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`todevice.bench` found. ``str(report)`` reads as a summary; ``dataclasses.asdict`` gives the data."""

    batch: str  # what the batch is: its name where known, its type, its tensors and bytes
    device: str
    helper: str  # what the ratios are to: the helper, or move() where the helper's result differs from move()'s
    rounds: int
    rows: tuple[Row, ...]
    wrong: Mapping[str, str]  # contender -> how its result differs from move()'s; not timed
    not_installed: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"{self.batch}, moved to {self.device}: {self.rounds} rounds, the order shuffled every round.", ""]
        if self.helper == MOVE:
            lines.append(
                "The helper was not timed, since its result differs from move()'s (below): ratios are to move()."
            )
        else:
            lines.append(f"move() against {self.helper}, end to end (median, and the middle half of the rounds):")
        for row in self.rows:
            if row.contender == MOVE and self.helper != MOVE:
                lines.append(f"  {row.form + ':':22} {_said(row)}")
        if any(r.contender == MOVE and r.verdict == "slower" for r in self.rows):
            lines.append(
                "  Where move() is slower, it still keeps what the helper may not: every container type, tensors "
                "that share memory sharing it, and the batch unchanged."
            )
        columns = [c.replace("the helper's", "move()'s").replace("vs helper", "vs move()") for c in _COLUMNS]
        lines += ["", *(columns if self.helper == MOVE else _COLUMNS), "", _table(self.rows, self.helper)]
        for name, why in self.wrong.items():
            lines.append(f"Not timed, since its result differs from move()'s: {name}: {why}")
        if self.not_installed:
            lines.append(f"Not installed, so not timed: {', '.join(self.not_installed)}.")
        return "\n".join(lines)


_COLUMNS = (
    "host us: the time until the call returns, per call (median over the rounds).",
    "end-to-end us: the time until its copies have finished, per call.",
    "vs helper: the helper's end-to-end time over this one's, the median of the rounds; above 1.0x is faster.",
    "middle half: the 25th to the 75th percentile of that ratio over the rounds.",
)


def _said(row: Row) -> str:
    spread = f"({ratio(row.low)} to {ratio(row.high)})"
    if row.verdict == "faster":
        return f"{ratio(row.speedup)} faster {spread}"
    if row.verdict == "slower":
        return f"slower: {ratio(1 / row.speedup)} the helper's time ({ratio(1 / row.high)} to {ratio(1 / row.low)})"
    return f"no measurable difference {spread}"


def _table(rows: tuple[Row, ...], yardstick: str) -> str:
    """The rows as a Markdown table, each ratio to ``yardstick``: the helper, or move() where the helper is wrong."""
    head = f"| batch | contender | host us | end-to-end us | vs {'move()' if yardstick == MOVE else 'helper'} |"
    lines = [head + " middle half | verdict |", "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        cells = [r.form, r.contender, f"{r.host_us:,.1f}", f"{r.end_to_end_us:,.1f}", ratio(r.speedup)]
        verdict = "the yardstick" if r.contender == yardstick else r.verdict
        lines.append("| " + " | ".join([*cells, f"{ratio(r.low)} to {ratio(r.high)}", verdict]) + " |")
    return "\n".join(lines)


def difference(want: Any, got: Any) -> str | None:
    """Where ``got`` differs from ``want`` (move()'s result): the first path, in ``want``'s order, that ``got`` lacks
    or whose type, tensor device, dtype, shape or values differ, or whose other value is not equal; then a path
    only ``got`` has. None where they agree: a dict whose keys come in another order is the same dict."""
    mine, theirs = dict(_walk.paths(want, revisit=True)), dict(_walk.paths(got, revisit=True))
    for path, a in mine.items():
        where = path or "the batch"
        if path not in theirs:
            return f"{where} is missing: move() gives a {type(a).__qualname__} there"
        b = theirs[path]
        if type(a) is not type(b):
            return f"{where} is a {type(b).__qualname__} where move() gives a {type(a).__qualname__}"
        if not isinstance(a, torch.Tensor) and _tree.kind_of(type(a)).code == _tree.ATOM and not _equal(a, b):
            return f"{where} is {b!r} where move() gives {a!r}"
    extra = next((path for path in theirs if path not in mine), None)
    if extra is not None:
        return f"it holds {extra or 'the batch'}, where move()'s result holds nothing"
    # The tensors again, by path: these paths reach inside what the walk moves whole (a module, an object
    # with its own .to()), which may hold a tensor more or less.
    mine_t, theirs_t = dict(_inspect._tensors(want)), dict(_inspect._tensors(got))
    missing = next((path for path in mine_t if path not in theirs_t), None)
    if missing is not None:
        return f"{missing or 'the batch'} is missing: move() gives {_described(mine_t[missing])} there"
    extra = next((path for path in theirs_t if path not in mine_t), None)
    if extra is not None:
        return f"it holds {_described(theirs_t[extra])} at {extra or 'the batch'}, where move()'s result holds none"
    for path, a in mine_t.items():
        where, b = path or "the batch", theirs_t[path]
        if (a.device, a.dtype, a.layout) != (b.device, b.dtype, b.layout):
            return f"{where} is {_described(b)} where move() gives {_described(a)}"
        if not _tree.has_memory(a) or a.device.type == "meta":
            continue  # a nested or sparse tensor: its device, dtype and layout are what is compared
        if a.shape != b.shape:
            return f"{where} is {_described(b)} where move() gives {_described(a)}"
        if not a.is_cpu:  # compared on the host: a backend may have no comparison kernels of its own
            a, b = a.cpu(), b.cpu()
        if a is not b and not _same_values(a, b):
            return f"{where} holds other values than move() gives"
    return None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same values, a NaN equal to a NaN at the same place, which
    ``torch.equal`` never finds equal to itself. A complex tensor is compared part by part: ``allclose`` takes any
    complex value with a NaN part for any other, and the host has no comparison for complex32."""
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, 0, 0, equal_nan=True))


_RAISED = "it raised"


def _checked(fn: Mover, batch: Any, dev: torch.device, want: Any) -> str | None:
    """What is wrong with ``fn(copy of batch, dev)`` against ``want``, move()'s result; None where nothing is."""
    given = _copy(batch)
    before = _places(given)
    try:
        got = fn(given, dev)
    except Exception as err:
        return f"{_RAISED} {type(err).__name__}: {err}"
    return "it changed the batch it was given, in place" if _places(given) != before else difference(want, got)


def _equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an object whose == raises or is ambiguous: only itself will do
        return False


def _described(t: torch.Tensor) -> str:
    shape = f" of shape {tuple(t.shape)}" if t.layout == torch.strided else f" ({t.layout})"
    return f"a {t.dtype} tensor{shape} on {t.device}"


def _copy(batch: Any) -> Any:
    """A copy of ``batch`` to check a contender on, so that one that changes its batch in place changes only this.

    Its plain tensors off the host are copied with ``empty_like`` and ``copy_``, which every backend a batch is moved
    to has: ``deepcopy`` clones their storage, which a backend without an allocator of its own cannot.
    """
    memo: dict[int, Any] = {}
    for _, t in _inspect._tensors(batch):
        if type(t) is torch.Tensor and not (t.is_cpu or t.is_meta) and t.layout == torch.strided and id(t) not in memo:
            with torch.no_grad():
                memo[id(t)] = torch.empty_like(t).copy_(t).requires_grad_(t.requires_grad)
    try:
        return copy.deepcopy(batch, memo)
    except Exception:  # an object that cannot be copied: the batch itself, whose tensors are then watched
        return batch


def _places(batch: Any) -> list[tuple[str, int, torch.device]]:
    """Where each tensor of ``batch`` is: its path, the tensor, and its device."""
    return [(path, id(t), t.device) for path, t in _inspect._tensors(batch)]


def _pinned(x: Any) -> Any:
    """``x`` with each host tensor in its containers pinned, for the pinned form of the batch."""
    if isinstance(x, torch.Tensor):
        return x.pin_memory() if x.is_cpu else x
    kind = _tree.kind_of(type(x))
    if kind.code != _tree.NODE:
        return x
    children, aux = kind.flatten(x)  # type: ignore[misc]
    return kind.unflatten(aux, [_pinned(c) for c in children])  # type: ignore[misc]


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _contenders(helper: Mover | None) -> tuple[dict[str, Mover], str, tuple[str, ...]]:
    """move(), the helper (the user's, or the hand-written one), and the peers that are installed (the host table's,
    but optree.tree_map, which no loop carries as its helper)."""
    helper_name = f"your helper ({_name(helper)})" if helper is not None else HELPER
    timed, absent = contenders()
    found: dict[str, Mover] = {MOVE: todevice.move, helper_name: helper or recursive_to_device}
    found.update((name, fn) for name, fn in timed.items() if name in PEERS)
    return found, helper_name, tuple(f"{name} (pip install {PEERS[name][2]})" for name in absent)


def _forms(batch: Any, dev: torch.device) -> dict[str, Any]:
    """The forms of the batch to time: as given, pinned (where the machine has page-locked memory) and already on the
    device where that differs."""
    host = any(t.is_cpu for _, t in _inspect._tensors(batch))
    if not _stream.is_accelerator(dev) or not host:
        return {"as given": batch}
    forms = {"pageable": batch}
    if not _stream.no_pinned_memory():
        forms["pinned"] = _pinned(batch)
    forms[f"already on {dev}"] = todevice.move(batch, dev)
    return forms


_META = torch.device("meta")


def _checks(forms: dict[str, Any], dev: torch.device) -> list[tuple[str, Any, torch.device, Any]]:
    """What each contender is checked on, before it is timed: (label, batch, device, move()'s result) for each form.
    On the host, where the tensors already are, a helper that moves nothing gives the right result: it is checked
    moving to meta too, where every tensor it leaves behind shows; not where move() itself cannot go there (a strided
    nested tensor, a quantized one)."""
    named = len(forms) > 1
    checks = [(f"{f}: " if named else "", variant, dev, todevice.move(variant, dev)) for f, variant in forms.items()]
    if dev.type == "cpu":
        label = "checked moving to meta, where a tensor left behind shows (it is timed on cpu): "
        for variant in forms.values():
            with contextlib.suppress(Exception):  # move() cannot go to meta with it: the check on cpu is all there is
                checks.append((label, variant, _META, todevice.move(variant, _META)))
    return checks


def _timed(fn: Mover, batch: Any, dev: torch.device, calls: int, sync: Callable[[], None]) -> tuple[float, float]:
    """Seconds per call until ``calls`` calls returned, and until their copies finished."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(batch, dev)
    returned = time.perf_counter()
    sync()
    return (returned - start) / calls, (time.perf_counter() - start) / calls


def bench(
    batch: Any, device: Any = None, *, helper: Mover | None = None, rounds: int = 30, name: str | None = None
) -> Report:
    """Time :func:`todevice.move` on ``batch`` against ``helper`` and the peers installed, on this machine.

    Args:
        batch: One batch as the training loop gets it.
        device: Where it goes; by default the current accelerator, else the CPU.
        helper: Your own ``recursive_to_device(batch, device)``; by default a hand-written one that moves
            tensors, lists and dicts.
        rounds: Timing rounds; each times every contender on every form of the batch once, in a new order.
        name: What to call the batch in the report.

    Returns:
        A :class:`Report`: ``print()`` it, or read its rows.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 3:
        msg = f"Cannot time {rounds!r} rounds: rounds takes an int of at least 3, for a median and a spread."
        raise ValueError(msg)
    with warnings.catch_warnings():  # what move() leaves behind, its every call would warn of: the report says it
        warnings.simplefilter("ignore", errors.TensorsLeftBehindWarning)
        return _bench(batch, device, helper, rounds, name)


def _bench(batch: Any, device: Any, helper: Mover | None, rounds: int, name: str | None) -> Report:
    acc = _stream.accelerator()
    dev = _stream.resolve_device(device if device is not None else acc or "cpu")
    sync = (lambda: _stream.synchronize(dev)) if _stream.is_accelerator(dev) else (lambda: None)
    found, helper_name, missing = _contenders(helper)
    forms = _forms(batch, dev)  # made before any contender runs: one that changes its batch changes only its copy
    checks = _checks(forms, dev)
    wrong: dict[str, str] = {}
    for cname, fn in list(found.items())[1:]:
        for label, variant, where, want in checks:  # each form it is timed on, each on a copy
            why = _checked(fn, variant, where, want)
            cannot_go = where != dev and why is not None and why.startswith(_RAISED)  # to meta: judged where timed
            if why is not None and not cannot_go:
                wrong[cname] = f"{label}{why}"
                del found[cname]
                break
    yardstick = helper_name if helper_name in found else MOVE  # a wrong helper is no yardstick: then move() is
    rng = random.Random(0)
    rows = []
    for form, variant in forms.items():
        calls = _per_sample(functools.partial(_timed, todevice.move, variant, dev, 1, sync))
        samples: dict[str, list[tuple[float, float]]] = {c: [] for c in found}
        for _ in range(rounds):
            order = list(found)
            rng.shuffle(order)
            for cname in order:
                samples[cname].append(_timed(found[cname], variant, dev, calls, sync))
        base = [e2e for _, e2e in samples[yardstick]]
        for cname, got in samples.items():
            ratios = [b / e2e for b, (_, e2e) in zip(base, got)]
            q = quartiles_of(ratios)
            host, e2e = (statistics.median(x) * 1e6 for x in zip(*got))
            rows.append(Row(form, cname, host, e2e, statistics.median(ratios), q[0], q[2]))
    tensors = list(_inspect._tensors(batch))
    size = sum(t.nbytes for _, t in tensors if t.layout == torch.strided)
    what = f"{name or 'your batch'} ({type(batch).__qualname__}, {len(tensors)} tensors, {size:,} bytes)"
    return Report(what, str(dev), yardstick, rounds, tuple(rows), wrong, missing)
