"""The host's tables (``python -m todevice bench``): move() against the helper and the peers, the transfer engine, the
DataLoader and guard(), each with its verdict."""

from __future__ import annotations

import functools
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import todevice
from todevice import _stream, _walk
from todevice._bench import device as device_tables  # its gpu_main looked up when called, as tests replace it
from todevice._bench.common import (
    HELPER,
    PEERS,
    Rows,
    _copy_each,
    _count,
    _inputs,
    _per_sample,
    _range,
    _repeat,
    _span,
    _static_workload,
    _target,
    contenders,
    count_tensors,
    flat_batch,
    interleaved,
    markdown,
    missing_note,
    mixed_small_batch,
    nested_batch,
    progress,
    quartiles_of,
    ratio,
    recursive_to_device,
    report,
    small_batches,
    standing,
    tensor_leaves,
)

# A row whose rounds would take longer than its budget runs fewer of them, never fewer than this: the middle half
# of 10 per-round ratios still tells a 0.9x from a 1.1x on this project's 2-core machine (bench/README.md).
MIN_ROUNDS = 10


def _rounds(calls: dict[str, Callable[[], Any]], rounds: int, seconds: float | None) -> int:
    """How many rounds of ``calls`` to time: ``rounds``, or as many as fit in ``seconds`` (one round timed here),
    never fewer than ``MIN_ROUNDS`` nor more than ``rounds``."""
    if seconds is None:
        return rounds
    start = time.perf_counter()
    for fn in calls.values():
        fn()
    fit = int(seconds / max(time.perf_counter() - start, 1e-9))
    return max(min(rounds, MIN_ROUNDS), min(rounds, fit))


def run(
    rounds: int = 30,
    sizes: Sequence[int] = (10, 100, 1000, 10_000),
    seed: int = 0,
    row_seconds: float | None = None,
) -> list[dict[str, Any]]:
    """Every contender on every batch and target, interleaved; medians per call.

    ``row_seconds``: the time a row's rounds may take, if given; a row that would take longer runs fewer rounds,
    at least ``MIN_ROUNDS``, and records how many (``rounds``).
    """
    rng = random.Random(seed)
    batches = small_batches()
    for n in sizes:
        batches[f"flat dict, {n:,}"] = flat_batch(n)
        batches[f"nested with a dataclass, {n:,}"] = nested_batch(n)
    funcs, _ = contenders()
    rows: list[dict[str, Any]] = []
    # What is alive now (torch, the peers, the batches) lives through the run. Frozen, it is left out of
    # the collection before each cell, which then walks what the cells made, not some 300,000 objects.
    gc.collect()
    gc.freeze()
    try:
        for bname, tree in batches.items():
            for dev in (torch.device("cpu"), torch.device("meta")):
                moved = {name: count_tensors(fn(tree, dev), dev) for name, fn in funcs.items()}  # also warms up
                number = _per_sample(_repeat(recursive_to_device, [tree], dev))
                calls = {name: _repeat(fn, [tree] * number, dev) for name, fn in funcs.items()}
                times = interleaved(calls, _rounds(calls, rounds, row_seconds), rng)
                rows.append(_row(bname, str(dev), times, number, moved))
        rows.extend(_history_rows(rounds, rng, funcs))
    finally:
        gc.unfreeze()
    return rows


def _row(
    batch: str, target: str, times: dict[str, list[float]], number: int, moved: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    us = {name: statistics.median(t) / number * 1e6 for name, t in times.items()}
    tensors = moved[HELPER][1]
    spread = _per_round(times, "todevice.move")
    return {
        "batch": batch,
        "target": target,
        "tensors": tensors,
        "median_us": us,
        "x_vs_move": {name: t / us["todevice.move"] for name, t in us.items()},
        "spread_vs_move": spread,
        "rounds": len(times["todevice.move"]),
        "tensors_on_target": {name: on for name, (on, _) in moved.items()},
        "target_x_helper": _target(target, tensors),
    }


def _per_round(times: dict[str, list[float]], over: str) -> dict[str, list[float]]:
    """Each function's time over ``over``'s in the same round: the quartiles of these ratios over the rounds."""
    return {name: quartiles_of([a / b for a, b in zip(t, times[over])]) for name, t in times.items()}


def _history_rows(
    rounds: int, rng: random.Random, funcs: dict[str, Callable[[Any, torch.device], Any]]
) -> list[dict[str, Any]]:
    """Cost that might depend on what ran before, and batches whose dict keys are new objects every call."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    batch, other = nested_batch(1000), flat_batch(1000)
    pair = {
        "todevice.move": _repeat(funcs["todevice.move"], [batch], cpu),
        HELPER: _repeat(recursive_to_device, [batch], cpu),
    }
    counted = {name: count_tensors(fn(batch, cpu), cpu) for name, fn in funcs.items() if name in pair}
    # The third setup is the control: the same other batch, moved by the helper, evicts the same caches
    # and leaves todevice nothing to remember, so any gap between the last two rows is history. All six
    # (setup, contender) pairs run interleaved in one loop, so the machine's noise falls on all alike.
    conditions = {
        "back to back": functools.partial(todevice.move, batch, cpu),
        "right after a move of another batch": functools.partial(todevice.move, other, meta),
        "right after the helper moved another batch": functools.partial(recursive_to_device, other, meta),
    }
    calls = {(label, name): fn for label in conditions for name, fn in pair.items()}
    names = {key: f"{key[0]}: {key[1]}" for key in calls}
    times = interleaved(
        {names[key]: fn for key, fn in calls.items()}, rounds, rng, {names[key]: conditions[key[0]] for key in calls}
    )
    rows = [
        _row(f"in place, nested 1,000, {label}", "cpu", {name: times[f"{label}: {name}"] for name in pair}, 1, counted)
        for label in conditions
    ]
    for dev in (cpu, meta):
        fresh: list[Any] = [None]

        def new_keys(fresh: list[Any] = fresh) -> None:
            fresh[0] = nested_batch(100, fresh_keys=True)

        def on_fresh(
            fn: Callable[[Any, torch.device], Any], fresh: list[Any] = fresh, dev: torch.device = dev
        ) -> Callable[[], Any]:
            def call() -> Any:
                return fn(fresh[0], dev)

            return call

        new_keys()
        moved = {name: count_tensors(fn(fresh[0], dev), dev) for name, fn in funcs.items()}
        times = interleaved({name: on_fresh(fn) for name, fn in funcs.items()}, rounds, rng, setup=new_keys)
        rows.append(_row("nested 100, new dict keys every call", str(dev), times, 1, moved))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (batch, device): move()'s time, each contender's time over move()'s with the middle half of its
    rounds, and the tensors each moved."""
    others = [name for name in rows[0]["median_us"] if name != "todevice.move"]
    columns = ["batch", "device", ">move() (us)", *[f">{name}" for name in others], ">tensors moved (move() / helper)"]
    lines = []
    for r in rows:
        on = r["tensors_on_target"]
        lines.append(
            [
                r["batch"],
                r["target"],
                f"{r['median_us']['todevice.move']:.1f}",
                *[_figure(quartiles(r, name), "") if name in r["x_vs_move"] else "-" for name in others],
                f"{on['todevice.move']} / {on[HELPER]} of {r['tensors']}",
            ]
        )
    return markdown(columns, lines)


def quartiles(row: dict[str, Any], name: str) -> list[float]:
    """``name``'s time over move()'s in ``row``: the quartiles of the per-round ratios (the ratio of the medians,
    three times, in a row that kept none)."""
    return row.get("spread_vs_move", {}).get(name) or [row["x_vs_move"][name]] * 3


def _figure(q: Sequence[float], unit: str = "x") -> str:
    """A ratio as the median of its rounds, with their middle half: ``0.73x (0.66x to 0.80x)``."""
    low, high = (ratio(v) if unit else ratio(v).removesuffix("x") for v in (q[0], q[2]))
    return f"{ratio(q[1])} ({low} to {high})"


# Where each device's rows are sent, and what their time is, in the words of the first screen.
WHERE = {
    "cpu": "to cpu, where the tensors already are (the cost of looking at the batch)",
    "meta": "to meta, every tensor copied with no data (the cost of the copies' bookkeeping)",
}


def answer(rows: Rows) -> str:
    """For the reader, one line per device: where move() is faster than the hand-written helper, where it is slower
    and where there is no measurable difference, each batch by name with the middle half of its rounds. A row whose
    middle half holds 1.00x is no measurable difference, neither faster nor slower."""
    groups: dict[str, Rows] = {}
    for r in rows:
        groups.setdefault(r["target"], []).append(r)
    lines = [
        "On this machine, the hand-written helper's time over move()'s, per batch (above 1.00x, move() is faster; "
        "the median of the rounds, with their middle half in brackets):"
    ]
    for target, group in groups.items():
        q = {r["batch"]: quartiles(r, HELPER) for r in group}
        by = {b: standing(low, high) for b, (low, _, high) in q.items()}
        faster = sorted((b for b in q if by[b] == "faster"), key=lambda b: q[b][1])
        slower = sorted((b for b in q if by[b] == "slower"), key=lambda b: q[b][1])
        even = [b for b in q if by[b] == "no measurable difference"]
        said = []
        if faster:
            low, high = faster[0], faster[-1]
            said.append(
                f"faster for {len(faster)} of {len(q)} batches: {_figure(q[low])} for {low}"
                + (f", up to {_figure(q[high])} for {high}" if high != low else "")
            )
        if slower:
            said.append(f"slower for {len(slower)} of {len(q)}: " + "; ".join(f"{b}, {_figure(q[b])}" for b in slower))
        if even:
            said.append(f"no measurable difference for {len(even)} of {len(q)}: " + "; ".join(even))
        said[1:] = [part[0].upper() + part[1:] for part in said[1:]]
        lines.append(f"- {WHERE.get(target, 'to ' + target)}: move() is " + ". ".join(said) + ".")
    return "\n".join(lines)


def notes(rows: Rows) -> list[str]:
    """What the first screen says under its answer: why move() may be slower where it is, and that the GPU questions
    need a GPU where this machine has none."""
    said = []
    slower = [r for r in rows if standing(*quartiles(r, HELPER)[::2]) == "slower"]  # as answer() names them
    if slower:
        left = any(r["tensors_on_target"][HELPER] < r["tensors"] for r in slower)
        dataclass = "; and it moves the dataclass's tensors, which the helper leaves behind (see 'tensors moved')"
        said.append(
            "Where move() is slower, it keeps what the helper does not: tensors that share memory sharing it, and "
            f"the batch unchanged{dataclass if left else ''}."
        )
    if _stream.accelerator() is None:
        said.append(
            "No accelerator here: what move() does on a GPU (many small tensors in one pinned copy, the host not "
            "blocked, streams) cannot be measured on this machine. On one with a GPU: "
            "python -m todevice bench --device cuda."
        )
    return said


OVERHEAD = "move() against the hand-written helper and the peers"


def overhead_verdict(rows: Rows) -> str:
    """One line: ``move()`` against each row's target over the helper, by group of rows, and against the peers."""
    groups: dict[tuple[str, float], Rows] = {}
    for r in rows:
        groups.setdefault((r["target"], r["target_x_helper"]), []).append(r)
    parts = []
    for (target, goal), group in sorted(groups.items(), key=lambda g: (g[0][0], min(r["tensors"] for r in g[1]))):
        x = [quartiles(r, HELPER)[1] for r in group]
        met = sum(v >= goal for v in x)
        span = _span([r["tensors"] for r in group])
        parts.append(f"{target}, {span}, >= {goal:.2f}x: {_range(x)}, {met} of {len(group)} met")
    met = sum(quartiles(r, HELPER)[1] >= r["target_x_helper"] for r in rows)
    outcome = "met" if met == len(rows) else "not met"
    line = (
        f"Target: move() at or above each row's target against the hand-written helper: {outcome}, "
        f"{met} of {len(rows)} rows met ({'; '.join(parts)})"
    )
    peers = []
    for name in PEERS:
        x = [quartiles(r, name)[1] for r in rows if name in r["x_vs_move"]]
        if x:
            peers.append(f"than {name} in {sum(v > 1 for v in x)} of {len(x)} rows ({_range(x)})")
    return line + (f"; move() is faster {' and '.join(peers)}." if peers else ".")


def main(
    rounds: int = 30,
    sizes: Sequence[int] = (10, 100, 1000, 10_000),
    part: tuple[int, int] = (1, 1),
    row_seconds: float | None = None,
) -> dict[str, Any]:
    """The table of move() against the helper and the peers, and its verdict: ``{"rows", "verdicts"}``.

    ``row_seconds`` as :func:`run` takes it."""
    funcs, missing = contenders()
    batches = len(small_batches()) + 2 * len(sizes)
    each = _count(rounds, "round") + " each"
    if row_seconds is not None and rounds > MIN_ROUNDS:
        each = f"up to {rounds} rounds each (at least {MIN_ROUNDS} where a row's would take over {row_seconds:g} s)"
    progress(part, f"{OVERHEAD}: {len(funcs)} contenders, {batches} batches to cpu and to meta, 5 more rows, {each}")
    rows = run(rounds=rounds, sizes=sizes, row_seconds=row_seconds)
    print(f"{OVERHEAD}.\n{answer(rows)}")
    for line in notes(rows):
        print(line)
    print(
        "Columns: 'device' is where the batch goes: 'cpu', where its tensors already are (the cost of looking at "
        "the batch), or 'meta', where every tensor is copied with no data (the cost of the copies' bookkeeping). "
        "'move() (us)' is move()'s time per call. Each other column is that contender's time over move()'s: above "
        "1.00x, move() is faster; in brackets, the middle half of its rounds (where that holds 1.00x, there is no "
        "measurable difference). 'tensors moved' counts the tensors that reached the device "
        "(the helper leaves a dataclass's). Medians of interleaved rounds."
    )
    if missing:
        print(missing_note(missing))
    print(table(rows) + "\n")
    in_place = {r["batch"]: r["median_us"] for r in rows if r["batch"].startswith("in place")}
    if in_place:
        base, after, control = (us["todevice.move"] for us in in_place.values())
        h_base, h_after, h_control = (us[HELPER] for us in in_place.values())
        print(
            "A call costs more right after other work, which leaves the CPU's caches holding other data: moving a "
            f"nested batch already in place took move() {after / base:.2f}x its back-to-back time right after "
            f"move() moved another batch and {control / base:.2f}x right after the helper did; the helper took "
            f"{h_after / h_base:.2f}x and {h_control / h_base:.2f}x its own."
        )
    line = overhead_verdict(rows)  # the project's targets: in the JSON, and in bench/README.md
    return {"rows": rows, "verdicts": {OVERHEAD: line}, "answer": answer(rows)}


def host_rows(rounds: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    """Host time of pack(batch).unpack() against per-leaf .to('meta') of the same leaves, one run."""
    rng = random.Random(seed)
    batch = mixed_small_batch()
    leaves = tensor_leaves(batch)
    meta = torch.device("meta")
    funcs: dict[str, Callable[[], Any]] = {
        "pack(batch).unpack()": lambda: todevice.pack(batch).unpack(),
        "per-leaf .to('meta')": lambda: [t.to(meta) for t in leaves],
        "move(batch, 'meta', coalesce=True)": lambda: todevice.move(batch, meta, coalesce=True),
        "move(batch, 'meta')": lambda: todevice.move(batch, meta),
    }
    for fn in funcs.values():
        fn()
    times = interleaved(funcs, rounds, rng)
    return _transfer_rows(f"nested batch, {len(leaves)} small mixed-dtype tensors", times, "per-leaf .to('meta')")


def _transfer_rows(workload: str, times: dict[str, list[float]], base: str) -> list[dict[str, Any]]:
    """A transfer table's rows: each contender's median, its time over ``base``'s and that ratio's middle half."""
    spread = _per_round(times, base)
    return [
        {
            "workload": workload,
            "contender": name,
            "median_us": statistics.median(t) * 1e6,
            "x_per_leaf_to": statistics.median(t) / statistics.median(times[base]),
            "spread_per_leaf_to": spread[name],
        }
        for name, t in times.items()
    ]


def static_host_rows(rounds: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    """Host time per step of a copy into static buffers: a StaticBatch, move(batch, out=static) and a copy_() per
    tensor, interleaved, one run.

    The buffers are on the CPU, views of one buffer as ``todevice.static()`` allocates them, and each
    step copies 100 small pageable tensors into them: a copy_() into meta would do no work, so it
    could not stand in for a copy. Each contender writes its own buffers.
    """
    feed = todevice.static(_inputs(), "cpu")
    static, theirs = todevice.static(_inputs(), "cpu").static, todevice.static(_inputs(), "cpu").static
    fresh = [_inputs()]

    def next_batch() -> None:
        fresh[0] = _inputs()

    funcs: dict[str, Callable[[], Any]] = {
        STATIC_BATCH: lambda: feed(fresh[0]),
        OUT: lambda: todevice.move(fresh[0], out=static),
        COPY_EACH: functools.partial(_copy_each, theirs, fresh),
    }
    for fn in funcs.values():
        fn()
    times = interleaved(funcs, rounds, random.Random(seed), setup=next_batch)
    return _transfer_rows(_static_workload(static, "cpu"), times, COPY_EACH)


TRANSFER = "Transfer engine, host side"
PACK_TARGET = 1.5  # pack(batch).unpack() and the coalesced move: at most this many times per-leaf .to('meta')
STATIC_BATCH, OUT, COPY_EACH = "todevice.StaticBatch: feed(batch)", "move(batch, out=static)", "per-tensor copy_()"
STATIC_TARGETS = (4.0, 2.0)  # a StaticBatch step: at least this many times less host time than copy_(), than out=


def transfer_verdict(host: Rows) -> str:
    """Two lines: the coalesced paths against their target over per-leaf ``.to('meta')``; a StaticBatch's step
    against its targets over a copy_() per tensor and over ``out=``, by the medians of the per-round ratios."""
    by_name = {r["contender"]: r for r in host}
    judged = [by_name[name] for name in ("pack(batch).unpack()", "move(batch, 'meta', coalesce=True)")]
    met = "met" if all(_per_leaf(r)[1] <= PACK_TARGET for r in judged) else "not met"
    figures = "; ".join(f"{r['contender']}: {_per_leaf(r)[1]:.2f}x" for r in judged)
    handle, out = (
        1 / _per_leaf(by_name[STATIC_BATCH])[1],
        _per_leaf(by_name[OUT])[1] / _per_leaf(by_name[STATIC_BATCH])[1],
    )
    static_met = "met" if handle >= STATIC_TARGETS[0] and out >= STATIC_TARGETS[1] else "not met"
    return (
        f"Target: pack(batch).unpack() and move(batch, 'meta', coalesce=True) at most {PACK_TARGET:.1f}x per-leaf "
        f".to('meta'): {met} ({figures}).\n"
        f"Target: a StaticBatch step at least {STATIC_TARGETS[0]:.0f}x less host time than a copy_() per tensor and "
        f"{STATIC_TARGETS[1]:.0f}x less than move(batch, out=static), into static CPU buffers: {static_met} "
        f"({handle:.2f}x and {out:.2f}x less; {by_name[STATIC_BATCH]['median_us']:.0f}, "
        f"{by_name[OUT]['median_us']:.0f} and {by_name[COPY_EACH]['median_us']:.0f} us)."
    )


def _per_leaf(row: dict[str, Any]) -> list[float]:
    """A transfer row's time over its yardstick's: the quartiles of the per-round ratios (the ratio of the medians,
    three times, in a row that kept none)."""
    return row.get("spread_per_leaf_to") or [row["x_per_leaf_to"]] * 3


def transfer_answer(host: Rows) -> str:
    """For the reader: what coalescing costs the host here, where nothing is copied, and what a step into static
    buffers costs."""
    by_name = {r["contender"]: r for r in host}
    packed = _figure(_per_leaf(by_name["pack(batch).unpack()"]))
    coalesced = _figure(_per_leaf(by_name["move(batch, 'meta', coalesce=True)"]))
    handle, out, each = (by_name[name] for name in (STATIC_BATCH, OUT, COPY_EACH))
    return (
        f"On this machine's host, packing the small tensors into one buffer (coalesce=True) takes {coalesced} "
        f"the time of a .to('meta') per tensor (pack().unpack(): {packed}). A copy to 'meta' moves no data, so "
        "these figures are the host's bookkeeping alone; on a GPU, where each copy costs a launch, the one buffer "
        "crosses in one copy instead of one per tensor: python -m todevice bench --device cuda measures that. "
        f"Into static CPU buffers, a StaticBatch step takes {_figure(_per_leaf(handle))} the time of a copy_() per "
        f"tensor and move(batch, out=static) {_figure(_per_leaf(out))} ({handle['median_us']:.0f}, "
        f"{out['median_us']:.0f} and {each['median_us']:.0f} us)."
    )


def transfer_main(rounds: int = 30, part: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """The transfer engine's host table and its verdict, then the accelerator's tables where there is one.

    Returns:
        ``{"host": rows, "device": the accelerator's tables or why they were skipped, "verdicts": lines}``.
    """
    acc = _stream.accelerator()
    then = f"; then the accelerator's tables on {acc.type}" if acc is not None else ""
    progress(part, f"{TRANSFER}: 2 workloads, {_count(rounds, 'round')} each{then}")
    host = host_rows(rounds=rounds) + static_host_rows(rounds=rounds)
    columns = ["workload", "contender", ">median (us)", ">time / the yardstick's (a .to('meta') or copy_() each)"]
    cells = [[r["workload"], r["contender"], f"{r['median_us']:.0f}", _figure(_per_leaf(r), "")] for r in host]
    title = (
        f"{TRANSFER}: what coalescing and copies into static buffers cost the host. The last column is each row's "
        "time over its workload's yardstick (a .to('meta') per tensor, or a copy_() per tensor): the median of the "
        "per-round ratios, with their middle half in brackets."
    )
    print(title)
    print(markdown(columns, cells) + "\n")
    print(transfer_answer(host), flush=True)
    verdicts = {TRANSFER: transfer_verdict(host)}  # the project's target: in the JSON, and in bench/README.md
    device: Any = "run python -m todevice bench --device cuda for the accelerator's tables"
    if acc is not None:
        print()
        device = device_tables.gpu_main(rounds=max(3, rounds // 3))
        verdicts.update(device["verdicts"])
    else:
        print("\nOn an accelerator: skipped, no accelerator on this machine.")
    return {"host": host, "device": device, "verdicts": verdicts}


# ---------------------------------------------------------------- the DataLoader benchmark


class _ManySmall(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples holding ``fields`` small float32 tensors and a label."""

    def __init__(self, fields: int, n: int) -> None:
        self.fields, self.n = fields, n
        self.sample = {f"t{k}": torch.randn(16) for k in range(fields)}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.sample, "label": i}


def _storages(batch: Any) -> int:
    """Tensor storages in a batch as the main process receives it: one segment and one fd each."""
    if isinstance(batch, todevice.PackedBatch):
        return 1 + batch.loose
    ptrs = {node.untyped_storage().data_ptr() for _, node in _walk.paths(batch) if isinstance(node, torch.Tensor)}
    return len(ptrs)


# With a time limit, a loader is timed over at least this many batches.
MIN_BATCHES = 5


def loader_rows(
    batches: int = 100, batch_size: int = 32, workers: int = 2, seconds: float | None = None
) -> list[dict[str, Any]]:
    """Batches per second of DataLoader(num_workers) with default_collate (twice) and with todevice, one run; the
    ratio to default_collate's median rate, and its range against each of default_collate's two runs.

    ``seconds``: if given, a loader stops once this long has passed and ``MIN_BATCHES`` have come, before
    ``batches``."""
    from torch.utils.data import DataLoader

    rows: list[dict[str, Any]] = []
    for fields in (10, 100, 400):
        data = _ManySmall(fields, batches * batch_size)
        results: dict[str, tuple[float, int, int]] = {}
        for name in ("default_collate", "todevice.collate() + prefetch(..., 'cpu')", "default_collate again"):
            ours = name.startswith("todevice")
            loader = DataLoader(
                data,
                batch_size=batch_size,
                num_workers=workers,
                collate_fn=todevice.collate() if ours else None,
                prefetch_factor=4,
            )
            batches_in = iter(loader)
            segments = _storages(next(batches_in))  # workers started and warm: time the steady state
            source: Any = todevice.prefetch(batches_in, "cpu") if ours else batches_in
            start = time.perf_counter()
            count = 0
            for _ in source:
                count += 1
                took = time.perf_counter() - start
                if seconds is not None and count >= MIN_BATCHES and took > seconds:
                    break
            results[name] = (count / took, segments, count)
            del source, batches_in  # the workers stop here, not during the next loader's timing
        runs = [results["default_collate"][0], results["default_collate again"][0]]
        plain = statistics.median(runs)
        for name, (rate, segments, timed) in results.items():
            if name == "default_collate again":
                continue
            rows.append(
                {
                    "tensors_per_sample": fields,
                    "contender": name,
                    "batches_per_s": rate,
                    "x_default_collate": rate / plain,
                    "x_default_collate_range": [rate / max(runs), rate / min(runs)],
                    "segments_per_batch": segments,
                    "batches_timed": timed,
                }
            )
    return rows


def _loader_figure(row: dict[str, Any]) -> str:
    """``2.62x (2.50 to 2.75)``: a rate over default_collate's median, and over each of its two runs."""
    if "x_default_collate_range" not in row:
        return f"{row['x_default_collate']:.2f}x"
    low, high = row["x_default_collate_range"]
    return _figure([low, row["x_default_collate"], high], "")


LOADER = "DataLoader"
LOADER_OURS = "todevice.collate() + prefetch(..., 'cpu')"


def loader_verdict(rows: Rows) -> str:
    """One line: todevice's batches per second over default_collate's, and the shared-memory blocks a batch takes."""
    ours = [r for r in rows if r["contender"] == LOADER_OURS]
    plain = [r for r in rows if r["contender"] == "default_collate"]
    faster = sum(r["x_default_collate"] > 1 for r in ours)
    figures = "; ".join(f"{r['tensors_per_sample']} tensors: {_loader_figure(r)}" for r in ours)
    return (
        f"Against default_collate: {LOADER_OURS} is faster at {faster} of {len(ours)} sample sizes ({figures}); "
        f"shared-memory blocks per batch: {_range([r['segments_per_batch'] for r in ours], '{:,}')} against "
        f"{_range([r['segments_per_batch'] for r in plain], '{:,}')}."
    )


def loader_main(batches: int = 100, part: tuple[int, int] = (1, 1), seconds: float | None = None) -> dict[str, Any]:
    """The DataLoader table and its verdict: ``{"rows", "verdicts"}``; ``seconds`` as :func:`loader_rows` takes it."""
    each = f"{_count(batches, 'batch')} per loader"
    if seconds is not None:
        each = f"up to {each} (or {seconds:g} s once {MIN_BATCHES} came)"
    progress(part, f"{LOADER}: 2 workers, 3 sample sizes, 3 loaders each, {each}")
    rows = loader_rows(batches=batches, seconds=seconds)
    blocks = ">shared-memory blocks per batch"
    columns = [">tensors per sample", "contender", ">batches/s", ">x default_collate", blocks]
    cells = [
        [
            str(r["tensors_per_sample"]),
            r["contender"],
            f"{r['batches_per_s']:.0f}",
            "" if r["contender"] == "default_collate" else _loader_figure(r),
            str(r["segments_per_batch"]),
        ]
        for r in rows
    ]
    title = (
        f"{LOADER}, 2 workers, batches of 32: batches per second (higher is better). 'x default_collate' is the "
        "rate over default_collate's (the median of its two loaders; in brackets, against each of them); "
        "'shared-memory blocks per batch' counts the pieces of shared memory a batch "
        "crosses from a worker in (each costs the operating system a file to open and map)."
    )
    return {"rows": rows, "verdicts": report(title, columns, cells, LOADER, loader_verdict(rows))}


# ---------------------------------------------------------------- guard() overhead


def guard_rows(rounds: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """Forward time of a small MLP without guard(), with it, and after its removal, in one run."""
    rng = random.Random(seed)

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) if i % 2 == 0 else torch.nn.ReLU() for i in range(16)])

    model, guarded, removed = mlp(), mlp(), mlp()
    x = torch.randn(4, 64)
    hooks = todevice.guard(guarded)
    todevice.guard(removed).remove()
    models = {"no guard": model, "guard(model)": guarded, "guard removed": removed}
    with torch.no_grad():
        for m in models.values():
            m(x)
        times = interleaved({name: functools.partial(m, x) for name, m in models.items()}, rounds, rng)
    hooks.remove()
    rows = []
    for name, t in times.items():
        added = quartiles_of([(a - b) * 1e6 for a, b in zip(t, times["no guard"])])  # over the plain model, per round
        rows.append(
            {
                "contender": name,
                "median_us": statistics.median(t) * 1e6,
                "overhead_us": added[1],
                "overhead_us_per_hook": added[1] / 8,
                "overhead_us_spread": added,
            }
        )
    return rows


GUARD = "guard() overhead"


def guard_verdict(rows: Rows) -> str:
    """One line: what guard() adds to a forward call, and what is left once it is removed."""
    by_name = {r["contender"]: r for r in rows}
    base, on, off = by_name["no guard"], by_name["guard(model)"], by_name["guard removed"]
    return (
        f"Against no guard ({base['median_us']:.1f} us a forward): guard(model) adds {on['overhead_us']:+.1f} us "
        f"({on['overhead_us'] / base['median_us']:+.1%}), {on['overhead_us_per_hook']:+.2f} us per guarded module; "
        f"once removed, it adds {off['overhead_us']:+.1f} us ({off['overhead_us'] / base['median_us']:+.1%})."
    )


def guard_main(rounds: int = 200, part: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """The guard() table and its verdict: ``{"rows", "verdicts"}``."""
    progress(part, f"{GUARD}: 3 models, {_count(rounds, 'round')}")
    rows = guard_rows(rounds=rounds)
    columns = [
        "model",
        ">forward (us)",
        ">overhead (us)",
        ">middle half of the rounds (us)",
        ">per guarded module (us)",
    ]
    cells = []
    for r in rows:
        low, _, high = r.get("overhead_us_spread") or [r["overhead_us"]] * 3
        overhead, per_hook = f"{r['overhead_us']:+.1f}", f"{r['overhead_us_per_hook']:+.2f}"
        cells.append([r["contender"], f"{r['median_us']:.1f}", overhead, f"{low:+.1f} to {high:+.1f}", per_hook])
    title = (
        f"{GUARD} per forward call: an MLP of 8 Linear(64, 64) + ReLU, batch of 4, CPU (medians). 'overhead' is the "
        "median of the per-round differences from the unguarded model's time, with their middle half beside it."
    )
    return {"rows": rows, "verdicts": report(title, columns, cells, GUARD, guard_verdict(rows))}
