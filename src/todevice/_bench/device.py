"""The accelerator's tables (``python -m todevice bench --device cuda``): the size matrix, host time with work queued, a
training loop, prefetch(), device-to-host and static buffers, each with its verdict."""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import optree
import torch

import todevice
from todevice import _stream
from todevice._bench.common import (
    HELPER,
    Rows,
    _copy_each,
    _inputs,
    _static_workload,
    contenders,
    interleaved,
    markdown,
    recursive_to_device,
    tensor_leaves,
    verdict,
)


def _device_workloads(pinned: bool) -> dict[str, list[torch.Tensor]]:
    """Random (touched) host tensors, so no copy reads pages the kernel has not mapped yet."""
    kib, mib = 1024, 1024 * 1024

    def make(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.randn(numel).to(dtype)
        return t.pin_memory() if pinned else t

    mixed = [make(kib) for _ in range(500)] + [make(mib // 4) for _ in range(20)]
    mixed += [make(8 * mib, torch.float16) for _ in range(2)]
    return {
        "1,000 x 4 KiB": [make(kib) for _ in range(1000)],
        "100 x 1 MiB": [make(mib // 4) for _ in range(100)],
        "8 x 16 MiB": [make(4 * mib) for _ in range(8)],
        "mixed (500 x 4 KiB, 20 x 1 MiB, 2 x 16 MiB)": mixed,
    }


def _device_contenders(leaves: list[torch.Tensor], dev: torch.device) -> dict[str, Callable[[], Any]]:
    return {
        "todevice.move": lambda: todevice.move(leaves, dev),
        "per-leaf .to(non_blocking=True)": lambda: [t.to(dev, non_blocking=True) for t in leaves],
        "hand-written helper": lambda: recursive_to_device(leaves, dev),
    }


def _synced(fn: Callable[[], Any]) -> None:
    fn()
    _stream.accel.synchronize()


def _timed(
    funcs: dict[str, Callable[[], Any]], rounds: int, setup: Callable[[], Any] | None = None, end_to_end: bool = True
) -> dict[str, float]:
    """Median seconds of each ``fn()``, with the device work it queued when ``end_to_end``: interleaved
    rounds after a warm-up, ``setup`` run untimed before each call."""
    timed = {name: functools.partial(_synced, fn) for name, fn in funcs.items()} if end_to_end else funcs
    for fn in timed.values():
        fn()  # warm-up: allocator, pinned staging, plan
    _stream.accel.synchronize()
    samples = interleaved(timed, rounds, random.Random(0), setup)
    _stream.accel.synchronize()
    return {name: statistics.median(t) for name, t in samples.items()}


def device_rows(rounds: int = 10) -> list[dict[str, Any]] | str:
    """Host-to-device GB/s of move() against per-leaf .to() and the helper; or why it cannot run."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine (torch.accelerator.is_available() is False)"
    dev = torch.device(acc.type, _stream.current_index())
    rows: list[dict[str, Any]] = []
    limit = _stream.pinned(128 * 1024 * 1024, torch.uint8, dev)  # the bytes of 8 x 16 MiB, in one pinned copy
    if limit is None:
        limit = torch.empty(128 * 1024 * 1024, dtype=torch.uint8)
    limit.random_(0, 255)
    single = _timed({"one copy": lambda: limit.to(dev, non_blocking=True)}, rounds)["one copy"]
    kind = "pinned" if limit.is_pinned() else "pageable (no pinned memory here)"
    limit_gbs = limit.nbytes / single / 1e9
    rows.append(
        {
            "workload": f"one {kind} 128 MiB copy (the link's practical limit)",
            "contender": "tensor.to()",
            "gb_per_s": limit_gbs,
            "ms": single * 1e3,
            "x_single_copy": 1.0,
            "x_per_leaf_to": None,
        }
    )
    for pinned in (False, True):
        for name, leaves in _device_workloads(pinned).items():
            nbytes = sum(t.nbytes for t in leaves)
            times = _timed(_device_contenders(leaves, dev), rounds)
            for cname, seconds in times.items():
                gbs = nbytes / seconds / 1e9
                rows.append(
                    {
                        "workload": f"{name}, {'pinned' if pinned else 'pageable'}",
                        "contender": cname,
                        "gb_per_s": gbs,
                        "ms": seconds * 1e3,
                        "x_single_copy": gbs / limit_gbs,
                        "x_per_leaf_to": times["per-leaf .to(non_blocking=True)"] / seconds,
                    }
                )
        del leaves
    return rows


def blocked_rows(rounds: int = 10) -> list[dict[str, Any]] | str:
    """Host ms spent inside a move of 8 x 16 MiB while 50 ms of device work is queued (CUDA only)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (these rows keep it busy while they time the host)"
    dev = torch.device("cuda", torch.cuda.current_device())
    sleep: Callable[[int], None] = torch.cuda._sleep
    torch.cuda.synchronize()
    start = time.perf_counter()
    sleep(10_000_000)
    torch.cuda.synchronize()
    cycles_50ms = int(10_000_000 / (time.perf_counter() - start) * 0.05)
    rows: list[dict[str, Any]] = []
    for pinned in (False, True):
        leaves = [torch.randn(4 << 20) for _ in range(8)]
        if pinned:
            leaves = [t.pin_memory() for t in leaves]

        def queue_work() -> None:
            torch.cuda.synchronize()  # the previous call's copies, then 50 ms of work ahead of the next
            sleep(cycles_50ms)

        times = _timed(_device_contenders(leaves, dev), rounds, setup=queue_work, end_to_end=False)
        for name, seconds in times.items():
            workload = f"8 x 16 MiB {'pinned' if pinned else 'pageable'}, 50 ms of work queued"
            rows.append({"workload": workload, "contender": name, "host_ms": seconds * 1e3})
    return rows


# ---------------------------------------------------------------- the batches loops carry, on an accelerator


def carried_batches() -> dict[str, Any]:
    """The size matrix: the batches most loops carry, and many small tensors, in pageable host memory."""

    def small(n: int) -> dict[str, torch.Tensor]:
        return {f"t{i}": torch.randn(4, 4) for i in range(n)}

    return {
        "1 tensor (32 x 10)": torch.randn(32, 10),
        "(images, labels): 32 x 3 x 224 x 224 float32 (19 MB), 32 int64": [
            torch.randn(32, 3, 224, 224),
            torch.randint(0, 1000, (32,)),
        ],
        "tokenizer dict: 2 x 32 x 512 int64 (128 KiB each), 32 labels": {
            "input_ids": torch.randint(0, 30000, (32, 512)),
            "attention_mask": torch.ones(32, 512, dtype=torch.int64),
            "labels": torch.randint(0, 2, (32,)),
        },
        "10 x float32[4, 4]": small(10),
        "100 x float32[4, 4]": small(100),
        "1,000 x float32[4, 4]": small(1000),
    }


def placed(tree: Any, memory: str, dev: torch.device) -> Any:
    """``tree`` in ``memory``: as it is ("pageable"), its tensors pinned ("pinned"), or on ``dev`` ("on the device")."""
    if memory == "pinned":
        return optree.tree_map(lambda t: t.pin_memory(), tree, namespace="")
    if memory == "on the device":
        out = recursive_to_device(tree, dev)
        _stream.accel.synchronize()
        return out
    return tree


def size_rows(rounds: int = 10) -> list[dict[str, Any]] | str:
    """move() against the helper and the peers on the size matrix, pageable, pinned and on the device: the host
    time of a call made with the device idle, and its end-to-end time (the call and its copies)."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine (torch.accelerator.is_available() is False)"
    dev = torch.device(acc.type, _stream.current_index())
    found, _ = contenders()
    found.pop("optree.tree_map")
    memories = ["pageable", "pinned", "on the device"]
    if _stream.no_pinned_memory():  # a backend without pinned memory
        memories.remove("pinned")
    rows: list[dict[str, Any]] = []
    for name, host in carried_batches().items():
        for memory in memories:
            tree = placed(host, memory, dev)
            funcs: dict[str, Callable[[], Any]] = {
                cname: functools.partial(fn, tree, dev) for cname, fn in found.items()
            }
            many = 3 if name.startswith("1,000") or name.startswith("(images") else 1
            e2e = _timed(funcs, max(3, rounds // many))
            hosted = _timed(funcs, max(3, rounds // many), setup=_stream.accel.synchronize, end_to_end=False)
            for cname in funcs:
                rows.append(
                    {
                        "workload": f"{name}, {memory}",
                        "memory": memory,
                        "tensors": len(tensor_leaves(host)),
                        "contender": cname,
                        "host_ms": hosted[cname] * 1e3,
                        "e2e_ms": e2e[cname] * 1e3,
                        "x_helper_host": hosted[HELPER] / hosted[cname],
                        "x_helper_e2e": e2e[HELPER] / e2e[cname],
                        "x_helper_min": min(hosted[HELPER] / hosted[cname], e2e[HELPER] / e2e[cname]),
                    }
                )
            del tree
    return rows


SIZE_TARGETS: tuple[tuple[Callable[[dict[str, Any]], bool], float, str], ...] = (
    # which rows, the lowest ratio of the helper's time to move()'s, host or end to end, and what is promised
    (lambda r: r["tensors"] <= 3 and r["memory"] != "on the device", 0.9, "1 to 3 tensors, pageable and pinned"),
    (lambda r: r["tensors"] == 10 and r["memory"] != "on the device", 1.0, "10 tensors, pageable and pinned"),
    (lambda r: r["tensors"] >= 100 and r["memory"] != "on the device", 2.5, "100 and 1,000 tensors"),
    (lambda r: r["tensors"] <= 10 and r["memory"] == "on the device", 0.8, "1 to 10 tensors already on the device"),
)


def size_verdict(rows: Rows) -> str:
    """The size matrix against its four targets, each on the lower of the host and end-to-end ratios."""
    return " ".join(
        verdict(
            [r for r in rows if picks(r)],
            "todevice.move",
            "x_helper_min",
            target,
            f"move() of {claim} at least {target:.1f}x the helper's speed, host time and end to end",
            fmt="{:.2f}x",
        )
        for picks, target, claim in SIZE_TARGETS
    )


def _sleep(cycles: int) -> None:
    """Queue ``cycles`` GPU clock cycles of spinning on the current stream."""
    sleep: Callable[[int], None] = torch.cuda._sleep
    sleep(cycles)


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds, measured here."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    _sleep(10_000_000)
    torch.cuda.synchronize()
    return int(10_000_000 / ((time.perf_counter() - start) * 1e3) * ms)


def queued_rows(rounds: int = 10) -> list[dict[str, Any]] | str:
    """Host time of a move made while 5 ms of work is queued on the stream, as in a loop that never waits."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (these rows keep it busy while they time the host)"
    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = _sleep_cycles(5.0)

    def queue_work() -> None:
        torch.cuda.synchronize()
        _sleep(cycles)

    batches = carried_batches()
    rows: list[dict[str, Any]] = []
    for name in list(batches)[:3]:
        for memory in ("pageable", "pinned"):
            tree = placed(batches[name], memory, dev)
            funcs: dict[str, Callable[[], Any]] = {
                "todevice.move": functools.partial(todevice.move, tree, dev),
                HELPER: functools.partial(recursive_to_device, tree, dev),
            }
            times = _timed(funcs, rounds, setup=queue_work, end_to_end=False)
            for cname, seconds in times.items():
                rows.append(
                    {
                        "workload": f"{name}, {memory}, 5 ms queued",
                        "contender": cname,
                        "host_ms": seconds * 1e3,
                        "x_helper_host": times[HELPER] / seconds,
                    }
                )
    return rows


def queued_verdict(rows: Rows) -> str:
    ours = [r for r in rows if r["contender"] == "todevice.move"]
    small = verdict(
        [r for r in ours if not r["workload"].startswith("(images")],
        "todevice.move",
        "x_helper_host",
        0.9,
        "a tensor and a tokenizer dict at least 0.9x the helper's host speed with 5 ms queued",
        fmt="{:.2f}x",
    )
    images = verdict(
        [r for r in ours if r["workload"].startswith("(images") and "pageable" in r["workload"]],
        "todevice.move",
        "x_helper_host",
        4.0,
        "19 MB of pageable images at least 4x less host time than the helper with 5 ms queued",
    )
    return f"{small} {images}"


def loop_rows(rounds: int = 3, steps: int = 40) -> list[dict[str, Any]] | str:
    """A training loop: each step moves a fresh pageable batch, works 1 ms on the host and queues 3 ms on the GPU."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (these rows keep it busy while they time the host)"
    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = _sleep_cycles(3.0)
    batches = carried_batches()
    rows: list[dict[str, Any]] = []
    for name in list(batches)[1:3]:
        # A copy for each step, as a loader makes them; clone() writes every page before the clock starts.
        source = [optree.tree_map(torch.clone, batches[name]) for _ in range(steps)]

        def step(batch: Any) -> None:
            end = time.perf_counter() + 1e-3
            while time.perf_counter() < end:  # the host's own work: logging, a scheduler, the next sample
                pass
            _sleep(cycles)
            tensor_leaves(batch)[0].sum()  # a kernel that reads the batch

        def moved(mover: Callable[[Any, torch.device], Any], source: list[Any] = source) -> None:
            for batch in source:
                step(mover(batch, dev))

        def prefetched(source: list[Any] = source) -> None:
            for batch in todevice.prefetch(source, dev):
                step(batch)

        funcs: dict[str, Callable[[], Any]] = {
            HELPER: functools.partial(moved, recursive_to_device),
            "todevice.move": functools.partial(moved, todevice.move),
            "todevice.prefetch": prefetched,
        }
        times = _timed(funcs, rounds)
        for cname, seconds in times.items():
            rows.append(
                {
                    "workload": f"{steps} steps, {name}, pageable",
                    "contender": cname,
                    "ms": seconds * 1e3,
                    "x_helper_time": seconds / times[HELPER],
                }
            )
        del source
    return rows


def loop_verdict(rows: Rows) -> str:
    def at_most(start: str, target: float) -> str:
        return verdict(
            [r for r in rows if start in r["workload"]],
            "todevice.move",
            "x_helper_time",
            target,
            f"the loop on {start.split(':')[0]} with move() at most {target:.2f}x the helper's time",
            fmt="{:.2f}x",
            at_most=True,
        )

    return f"{at_most('tokenizer dict', 1.03)} {at_most('(images, labels)', 0.65)}"


def _timm_style(batches: Any, dev: torch.device) -> Any:
    """A prefetcher as timm's PrefetchLoader and torchtnt's write it: copy on a side stream, wait at hand-over."""
    side = torch.Stream(device=dev)
    ready: Any = None
    for batch in batches:
        with side:
            moved = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        if ready is not None:
            yield ready
        _stream.accel.current_stream(dev).wait_stream(side)
        for v in moved.values():
            v.record_stream(_stream.accel.current_stream(dev))
        ready = moved
    if ready is not None:
        yield ready


def _timm_loop(loop: Callable[[Any], None], batches: Any, dev: torch.device) -> None:
    loop(_timm_style(batches, dev))


def prefetch_rows(rounds: int = 5, steps: int = 20) -> list[dict[str, Any]] | str:
    """A 20-step loop with a few ms of device work per step: prefetch() against a timm-style prefetcher."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine"
    dev = torch.device(acc.type, _stream.current_index())
    weight = torch.randn(2048, 2048, device=dev)
    rows: list[dict[str, Any]] = []
    for pinned in (False, True):
        batches = []
        for _ in range(steps):
            b = {"image": torch.randn(16, 3, 224, 224), "label": torch.randint(0, 1000, (16,))}
            batches.append({k: v.pin_memory() for k, v in b.items()} if pinned else b)

        def loop(source: Any) -> None:
            for batch in source:
                x = batch["image"].flatten(1)[:, :2048]
                for _ in range(8):
                    x = x @ weight
                x.sum().add_(batch["label"].sum())

        ours, theirs = todevice.prefetch(batches, dev), batches
        contenders: dict[str, Callable[[], Any]] = {
            "todevice.prefetch": functools.partial(loop, ours),
            "timm-style prefetcher": functools.partial(_timm_loop, loop, theirs, dev),
        }
        times = _timed(contenders, rounds)
        for name, seconds in times.items():
            rows.append(
                {
                    "workload": f"{steps} steps, 16 x 3 x 224 x 224 {'pinned' if pinned else 'pageable'}",
                    "contender": name,
                    "ms": seconds * 1e3,
                    "x_timm_style": seconds / times["timm-style prefetcher"],
                }
            )
    return rows


def _outputs() -> dict[str, Any]:
    """What a step hands back to the host, on the host still: scalar metrics, and a nested mix."""

    def scalars(n: int) -> dict[str, torch.Tensor]:
        return {f"m{i}": torch.randn(()) for i in range(n)}

    mixed = {
        "loss": torch.randn(()),
        "metrics": scalars(499),
        "per_class": [torch.randn(1 + i % 16) for i in range(500)],
    }
    return {
        "50 scalars, a dict": scalars(50),
        "1,000 scalars, a dict": scalars(1000),
        "1,000 nested: 500 scalars, 500 float32[1..16]": mixed,
    }


def _to_host_contenders(outputs: Any, cpu: torch.device) -> dict[str, Callable[[], Any]]:
    funcs: dict[str, Callable[[], Any]] = {
        "todevice.move": lambda: todevice.move(outputs, cpu),
        "per-leaf .cpu()": lambda: recursive_to_device(outputs, cpu),
        "todevice.move(coalesce=False)": lambda: todevice.move(outputs, cpu, coalesce=False),
    }
    if all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in outputs.values()):
        funcs["per-leaf .item()"] = lambda: {k: v.item() for k, v in outputs.items()}
    return funcs


def device_to_host_rows(rounds: int = 10) -> list[dict[str, Any]] | str:
    """Small device tensors read back on the host, end to end: move() against per-leaf .cpu() and .item()."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine (torch.accelerator.is_available() is False)"
    dev, cpu = torch.device(acc.type, _stream.current_index()), torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for name, host in _outputs().items():
        outputs = recursive_to_device(host, dev)  # one allocation each, as kernels leave their outputs
        leaves = tensor_leaves(outputs)
        # Each contender waits for its own copies (move() before it returns; .cpu() and .item() block),
        # so no sync is added: the time is what a caller waits before reading the values.
        times = _timed(_to_host_contenders(outputs, cpu), rounds, end_to_end=False)
        for cname, seconds in times.items():
            rows.append(
                {
                    "workload": f"{name} ({sum(t.nbytes for t in leaves) / 1024:.1f} KiB)",
                    "tensors": len(leaves),
                    "contender": cname,
                    "ms": seconds * 1e3,
                    "x_per_leaf_cpu": times["per-leaf .cpu()"] / seconds,
                }
            )
    return rows


def static_rows(rounds: int = 50) -> list[dict[str, Any]] | str:
    """Host time per step of a copy into static device buffers: a StaticBatch and move(batch, out=static) against
    per-tensor copy_(), each into its own buffers."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine (torch.accelerator.is_available() is False)"
    dev = torch.device(acc.type, _stream.current_index())
    static = todevice.move(_inputs(), dev)  # small tensors come back as views of one device buffer
    feed = todevice.static(_inputs(), dev)  # views of one device buffer, as the handle allocates them
    fresh = [_inputs()]

    def next_step() -> None:
        _stream.accel.synchronize()  # untimed: the last step's copies land, so no queue builds up
        fresh[0] = _inputs()

    contenders: dict[str, Callable[[], Any]] = {
        "todevice.StaticBatch: feed(batch)": lambda: feed(fresh[0]),
        "todevice.move(batch, out=static)": lambda: todevice.move(fresh[0], out=static),
        "per-tensor copy_(non_blocking=True)": functools.partial(_copy_each, static, fresh),
    }
    times = _timed(contenders, rounds, setup=next_step, end_to_end=False)
    return [
        {
            "workload": _static_workload(static, "device"),
            "contender": name,
            "host_us": seconds * 1e6,
            "x_per_tensor_copy": times["per-tensor copy_(non_blocking=True)"] / seconds,
        }
        for name, seconds in times.items()
    ]


def to_host_verdict(rows: Rows) -> str:
    """Three targets of the device-to-host table: 1,000 scalars, 1,000 mixed, and 50 scalars against .item() too."""
    scalars = verdict(
        [r for r in rows if r["workload"].startswith("1,000 scalars")],
        "todevice.move",
        "x_per_leaf_cpu",
        6.0,
        "move() of 1,000 scalars at least 6x faster than per-leaf .cpu()",
    )
    mixed = verdict(
        [r for r in rows if r["workload"].startswith("1,000 nested")],
        "todevice.move",
        "x_per_leaf_cpu",
        5.0,
        "move() of 1,000 mixed small tensors at least 5x faster than per-leaf .cpu()",
    )
    fifty = [r for r in rows if r["workload"].startswith("50 scalars")]
    ms = {r["contender"]: r["ms"] for r in fifty}
    x_item = [{**r, "x_item": ms["per-leaf .item()"] / r["ms"]} for r in fifty if "per-leaf .item()" in ms]
    few = verdict(fifty, "todevice.move", "x_per_leaf_cpu", 2.0, "move() of 50 scalars at least 2x faster than .cpu()")
    item = verdict(
        x_item, "todevice.move", "x_item", 1.0, "move() of 50 scalars faster than a loop of .item()", fmt="{:.2f}x"
    )
    return f"{scalars} {mixed} {few} {item}"


def to_device_verdict(rows: Rows) -> str:
    """Two targets of the host-to-device table: 1,000 small tensors, and 8 x 16 MiB against one pinned copy."""
    small = verdict(
        [r for r in rows if r["workload"].startswith("1,000 x 4 KiB,")],
        "todevice.move",
        "x_per_leaf_to",
        10.0,
        "move() at least 10x faster than per-leaf .to() at 1,000 small tensors, end to end",
    )
    large = verdict(
        [r for r in rows if r["workload"].startswith("8 x 16 MiB,")],
        "todevice.move",
        "x_single_copy",
        0.8,
        "move() of 8 x 16 MiB, pinned or staged, at least 80% of one pinned copy of the same bytes",
        fmt="{:.0%}",
    )
    return f"{small} {large}"


def blocked_verdict(rows: Rows) -> str:
    """The host time blocked by move() of 8 x 16 MiB pageable tensors, against its target of 10 ms."""
    return verdict(
        [r for r in rows if "pageable" in r["workload"]],
        "todevice.move",
        "host_ms",
        10.0,
        "move() of 8 x 16 MiB pageable tensors blocks the host under 10 ms while 50 ms of work is queued",
        fmt="{:.1f} ms",
        at_most=True,
    )


def prefetch_verdict(rows: Rows) -> str:
    """prefetch()'s loop time over the timm-style prefetcher's, against its target of 1.10x."""
    return verdict(
        rows,
        "todevice.prefetch",
        "x_timm_style",
        1.1,
        "the 20-step loop with prefetch() within 10% of the timm-style prefetcher's time",
        fmt="{:.2f}x",
        at_most=True,
    )


def gpu_main(rounds: int = 10) -> dict[str, Any]:
    """The accelerator's tables: bandwidth, host time blocked, prefetch, reads to the host, static buffers.

    Every table is judged against its targets (those of bench/README.md) on a line below it, kept under
    ``"verdicts"``: the host-to-device table against two, the others against one each. A table that cannot
    run on this machine says why instead, and has no verdict.
    """
    result: dict[str, Any] = {}
    verdicts: dict[str, str] = {}
    sections: list[tuple[str, Callable[[], Rows | str], list[tuple[str, str, str]], Callable[[Rows], str]]] = [
        (
            "The batches loops carry: move() against the helper and the peers (medians)",
            lambda: size_rows(rounds),
            [
                ("host_ms", ">host ms", "{:.3f}"),
                ("e2e_ms", ">end-to-end ms", "{:.3f}"),
                ("x_helper_host", ">helper's host time / this", "{:.2f}x"),
                ("x_helper_e2e", ">helper's end-to-end time / this", "{:.2f}x"),
            ],
            size_verdict,
        ),
        (
            "Host time with 5 ms of work queued (medians)",
            lambda: queued_rows(rounds),
            [("host_ms", ">host ms", "{:.3f}"), ("x_helper_host", ">helper's host time / this", "{:.2f}x")],
            queued_verdict,
        ),
        (
            "A 40-step loop: 1 ms on the host and 3 ms on the GPU a step (medians)",
            lambda: loop_rows(max(3, rounds // 3)),
            [("ms", ">ms", "{:.1f}"), ("x_helper_time", ">time / the helper's", "{:.2f}x")],
            loop_verdict,
        ),
        (
            "Host-to-device, end to end (medians)",
            lambda: device_rows(rounds),
            [
                ("ms", ">ms", "{:.2f}"),
                ("gb_per_s", ">GB/s", "{:.1f}"),
                ("x_single_copy", ">of one pinned copy", "{:.0%}"),
                ("x_per_leaf_to", ">faster than per-leaf .to()", "{:.1f}x"),
            ],
            to_device_verdict,
        ),
        (
            "Host time blocked (medians)",
            lambda: blocked_rows(rounds),
            [("host_ms", ">host ms", "{:.1f}")],
            blocked_verdict,
        ),
        (
            "Prefetch loop (medians)",
            lambda: prefetch_rows(max(3, rounds // 2)),
            [("ms", ">ms", "{:.1f}"), ("x_timm_style", ">time / timm-style", "{:.2f}x")],
            prefetch_verdict,
        ),
        (
            "Device to host, end to end (medians)",
            lambda: device_to_host_rows(rounds),
            [
                ("tensors", ">tensors", "{:,}"),
                ("ms", ">ms", "{:.3f}"),
                ("x_per_leaf_cpu", ">faster than per-leaf .cpu()", "{:.1f}x"),
            ],
            to_host_verdict,
        ),
        (
            "Into static buffers, host time per step (medians)",
            lambda: static_rows(rounds * 5),  # a step takes well under a millisecond: more rounds, same minutes
            [
                ("host_us", ">host us", "{:.1f}"),
                ("x_per_tensor_copy", ">less host time than per-tensor copy_()", "{:.1f}x"),
            ],
            lambda rows: verdict(
                rows,
                "todevice.StaticBatch: feed(batch)",
                "x_per_tensor_copy",
                4.0,
                "a StaticBatch step at least 4x less host time than per-tensor copy_()",
            ),
        ),
    ]
    for title, make, fields, judge in sections:
        print(f"{title}:", flush=True)
        rows = make()
        result[title] = rows
        if isinstance(rows, str):
            print(f"skipped: {rows}\n")
            continue
        columns = ["workload", "contender", *(label for _, label, _ in fields)]
        cells = [
            [r["workload"], r["contender"], *("" if r[k] is None else fmt.format(r[k]) for k, _, fmt in fields)]
            for r in rows
        ]
        print(markdown(columns, cells) + "\n", flush=True)
        verdicts[title] = judge(rows)
        print(verdicts[title] + "\n", flush=True)
    result["verdicts"] = verdicts
    return result
