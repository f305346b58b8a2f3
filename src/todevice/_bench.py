"""The traversal benchmark: move() against the hand-written helper and the peers, in one run.

Shipped inside the package so that ``python -m todevice bench`` works wherever todevice is
installed; ``bench/bench_overhead.py`` runs the same code with more rounds and writes JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import platform
import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

import todevice
from todevice import _stream


def recursive_to_device(data: Any, device: Any) -> Any:
    """The hand-written helper, as ../shared/seeds/002 writes it (the one every training loop has)."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    elif isinstance(data, list):
        return [recursive_to_device(item, device) for item in data]
    elif isinstance(data, dict):
        return {key: recursive_to_device(value, device) for key, value in data.items()}
    else:
        return data


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


def nested_batch(n: int = 1000) -> dict[str, Any]:
    """A nested batch of ``n`` small tensors: dicts, lists, a dataclass and non-tensor leaves."""
    per_group = 9  # 111 groups of 9 tensors, plus the dataclass's tensors, make 1,000
    groups = (n - 1) // per_group
    batch: dict[str, Any] = {
        f"feature_{i}": {
            "values": [torch.randn(4) for _ in range(per_group - 2)],
            "mask": torch.ones(4, dtype=torch.bool),
            "ids": torch.arange(4),
            "name": f"f{i}",
            "count": i,
        }
        for i in range(groups)
    }
    batch["sample"] = Sample(torch.randn(3, 8, 8), torch.tensor(1), "s0")
    extra = n - groups * per_group - 2
    batch["extra"] = [torch.randn(2) for _ in range(extra)]
    return batch


def flat_batch(n: int = 1000) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randn(4) for i in range(n)}


def count_tensors(tree: Any, device: torch.device) -> tuple[int, int]:
    """(tensors on ``device``, all tensors), looking inside dataclasses too."""
    leaves = optree.tree_leaves(tree, is_leaf=dataclasses.is_dataclass)
    on, total = 0, 0
    for leaf in leaves:
        inner = [getattr(leaf, f.name) for f in dataclasses.fields(leaf)] if dataclasses.is_dataclass(leaf) else [leaf]
        for t in inner:
            if isinstance(t, torch.Tensor):
                total += 1
                on += t.device == device
    return on, total


def contenders() -> dict[str, Callable[[Any, torch.device], Any]]:
    """Every function to time, by name; peers only when they are installed."""
    found: dict[str, Callable[[Any, torch.device], Any]] = {
        "todevice.move": lambda tree, dev: todevice.move(tree, dev),
        "hand-written helper": recursive_to_device,
        "optree.tree_map(.to)": lambda tree, dev: optree.tree_map(
            lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, tree
        ),
    }
    try:
        from lightning_fabric.utilities.apply_func import move_data_to_device

        found["Lightning move_data_to_device"] = move_data_to_device
    except ImportError:
        pass
    try:
        from accelerate.utils import send_to_device

        found["accelerate send_to_device"] = send_to_device
    except ImportError:
        pass
    return found


def interleaved(funcs: Mapping[str, Callable[[], Any]], rounds: int, rng: random.Random) -> dict[str, list[float]]:
    """Seconds per call of each function: one call per sample, the order shuffled every round.

    One call per sample, as a training loop makes one call per step between other work: calling the
    same function back to back flatters whoever allocates least (the allocator's free lists stay
    hot). The shuffle keeps any one function from always running first, or right after another.
    The garbage collector is off during the rounds.
    """
    times: dict[str, list[float]] = {name: [] for name in funcs}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            order = list(funcs)
            rng.shuffle(order)
            for name in order:
                start = time.perf_counter()
                funcs[name]()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def script(doc: str | None, run: Callable[..., Any], name: str, **defaults: int) -> None:
    """The command line of a bench/ script: ``--json`` and one ``--<option>`` per default."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, value in defaults.items():
        parser.add_argument(f"--{option}", type=int, default=value, help=f"default {value}")
    parser.add_argument("--json", default=str(Path("bench") / "results" / f"{name}.json"), help="where the JSON goes")
    args = vars(parser.parse_args())
    run(json_path=args.pop("json"), **args)


def write_json(json_path: str | None, result: dict[str, Any]) -> None:
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump({"environment": environment(), **result}, f, indent=2)
        print(f"wrote {json_path}")


def run(rounds: int = 30, n: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Time every contender on every workload and target; interleaved rounds, medians."""
    rng = random.Random(seed)
    workloads = {"nested batch": nested_batch(n), "flat dict": flat_batch(n)}
    targets = [torch.device("cpu"), torch.device("meta")]
    funcs = contenders()
    rows: list[dict[str, Any]] = []
    for wname, tree in workloads.items():
        for dev in targets:
            moved = {name: count_tensors(fn(tree, dev), dev) for name, fn in funcs.items()}  # also warms up
            calls = {name: functools.partial(fn, tree, dev) for name, fn in funcs.items()}
            times = interleaved(calls, rounds, rng)
            base = statistics.median(times["todevice.move"])
            for name in funcs:
                med = statistics.median(times[name])
                on, total = moved[name]
                rows.append(
                    {
                        "workload": wname,
                        "target": str(dev),
                        "contender": name,
                        "median_us": med * 1e6,
                        "x_move_time": med / base,
                        "tensors_on_target": on,
                        "tensors": total,
                    }
                )
    return rows


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a column named with a leading '>' is right-aligned (numbers)."""
    header = "| " + " | ".join(c.lstrip(">") for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.startswith(">") else "---" for c in columns) + "|"
    return "\n".join([header, rule] + ["| " + " | ".join(cells) + " |" for cells in rows])


def table(rows: list[dict[str, Any]]) -> str:
    """The traversal table: one line per (workload, target, contender)."""
    columns = ["workload", "target", "contender", ">median (us)", ">time / move() time", ">tensors on target"]
    return markdown(
        columns,
        [
            [
                r["workload"],
                r["target"],
                r["contender"],
                f"{r['median_us']:.0f}",
                f"{r['x_move_time']:.2f}x",
                f"{r['tensors_on_target']}/{r['tensors']}",
            ]
            for r in rows
        ],
    )


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "optree": optree.__version__,
        "todevice": todevice.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


def main(rounds: int = 30, json_path: str | None = None) -> list[dict[str, Any]]:
    rows = run(rounds=rounds)
    print(
        "Traversal overhead, 1,000 tensors. 'cpu': tensors already there (pure traversal); "
        "'meta': every tensor copied. Medians of interleaved rounds; lower time is better."
    )
    print(table(rows))
    write_json(json_path, {"rows": rows})
    return rows


# ---------------------------------------------------------------- the transfer benchmark


def mixed_small_batch(n: int = 1000) -> dict[str, Any]:
    """A nested batch of ``n`` small tensors of mixed dtypes, as a DataLoader hands them over."""
    groups = n // 10
    return {
        f"sample_{i}": {
            "features": [torch.randn(16) for _ in range(5)],
            "ids": torch.randint(0, 1000, (8,)),
            "mask": torch.rand(8) > 0.5,
            "half": torch.randn(4, 4).to(torch.bfloat16),
            "pair": (torch.randn(3).to(torch.float64), torch.randn(2, dtype=torch.complex64)),
            "name": f"s{i}",
        }
        for i in range(groups)
    }


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    from todevice import _tree

    return [node for _, node in _tree.walk_paths(tree) if isinstance(node, torch.Tensor)]


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
    base = statistics.median(times["per-leaf .to('meta')"])
    return [
        {
            "workload": f"nested batch, {len(leaves)} small mixed-dtype tensors",
            "contender": name,
            "median_us": statistics.median(t) * 1e6,
            "x_per_leaf_to": statistics.median(t) / base,
        }
        for name, t in times.items()
    ]


def _device_workloads() -> dict[str, list[torch.Tensor]]:
    kib, mib = 1024, 1024 * 1024
    mixed = [torch.empty(4 * kib // 4) for _ in range(500)] + [torch.empty(mib // 4) for _ in range(20)]
    mixed += [torch.empty(16 * mib // 2, dtype=torch.float16) for _ in range(2)]
    return {
        "1,000 x 4 KiB": [torch.empty(kib) for _ in range(1000)],
        "100 x 1 MiB": [torch.empty(mib // 4) for _ in range(100)],
        "8 x 64 MiB": [torch.empty(16 * mib) for _ in range(8)],
        "mixed (500 x 4 KiB, 20 x 1 MiB, 2 x 16 MiB)": mixed,
    }


def _device_contenders(leaves: list[torch.Tensor], dev: torch.device) -> dict[str, Callable[[], Any]]:
    return {
        "todevice.move": lambda: todevice.move(leaves, dev),
        "per-leaf .to(non_blocking=True)": lambda: [t.to(dev, non_blocking=True) for t in leaves],
        "hand-written helper": lambda: recursive_to_device(leaves, dev),
    }


def device_rows(rounds: int = 10) -> list[dict[str, Any]] | str:
    """Host-to-device GB/s of move() against per-leaf .to() and the helper; or why it cannot run."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine (torch.accelerator.is_available() is False)"
    dev = torch.device(acc.type, _stream.current_index())

    def timed(fn: Callable[[], Any]) -> float:
        fn()  # warm-up: allocator, pinned staging, plan
        torch.accelerator.synchronize()
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            torch.accelerator.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    rows: list[dict[str, Any]] = []
    from todevice import _pack

    limit = _pack.pinning.empty(256 * 1024 * 1024)  # page-locked where the backend has it
    single = timed(lambda: limit.to(dev, non_blocking=True))
    pinned = "pinned" if _pack.pinning.available else "pageable (no pinned memory here)"
    rows.append(
        {
            "workload": f"one {pinned} 256 MiB copy (the link's practical limit)",
            "contender": "tensor.to()",
            "gb_per_s": limit.nbytes / single / 1e9,
            "x_single_copy": 1.0,
        }
    )
    limit_gbs = limit.nbytes / single / 1e9
    for name, leaves in _device_workloads().items():
        nbytes = sum(t.nbytes for t in leaves)
        funcs = _device_contenders(leaves, dev)
        for cname, fn in funcs.items():
            gbs = nbytes / timed(fn) / 1e9
            rows.append({"workload": name, "contender": cname, "gb_per_s": gbs, "x_single_copy": gbs / limit_gbs})
    return rows


def transfer_main(rounds: int = 30, json_path: str | None = None) -> dict[str, Any]:
    host = host_rows(rounds=rounds)
    print("Transfer engine, host side: what coalescing costs the host (medians; lower is better).")
    columns = ["workload", "contender", ">median (us)", ">time / per-leaf .to('meta')"]
    cells = [[r["workload"], r["contender"], f"{r['median_us']:.0f}", f"{r['x_per_leaf_to']:.2f}x"] for r in host]
    print(markdown(columns, cells))
    device = device_rows()
    if isinstance(device, str):
        print(f"\nHost-to-device bandwidth: skipped, {device}.")
    else:
        columns = ["workload", "contender", ">GB/s", ">of the single-copy figure"]
        cells = [[r["workload"], r["contender"], f"{r['gb_per_s']:.1f}", f"{r['x_single_copy']:.0%}"] for r in device]
        print("\n" + markdown(columns, cells))
    result = {"host": host, "device": device}
    write_json(json_path, result)
    return result


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
    from todevice import _pack, _tree

    if isinstance(batch, _pack.PackedBatch):
        return 1 + batch.loose
    ptrs = {node.untyped_storage().data_ptr() for _, node in _tree.walk_paths(batch) if isinstance(node, torch.Tensor)}
    return len(ptrs)


def loader_rows(batches: int = 100, batch_size: int = 32, workers: int = 2) -> list[dict[str, Any]]:
    """Batches per second of DataLoader(num_workers) with default_collate and with todevice, one run."""
    from torch.utils.data import DataLoader

    rows: list[dict[str, Any]] = []
    for fields in (10, 100, 400):
        data = _ManySmall(fields, batches * batch_size)
        results: dict[str, tuple[float, int]] = {}
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
            count = sum(1 for _ in source)
            results[name] = (count / (time.perf_counter() - start), segments)
        plain = statistics.median([results["default_collate"][0], results["default_collate again"][0]])
        for name, (rate, segments) in results.items():
            if name == "default_collate again":
                continue
            rows.append(
                {
                    "tensors_per_sample": fields,
                    "contender": name,
                    "batches_per_s": rate,
                    "x_default_collate": rate / plain,
                    "segments_per_batch": segments,
                }
            )
    return rows


def loader_main(batches: int = 100, json_path: str | None = None) -> list[dict[str, Any]]:
    rows = loader_rows(batches=batches)
    print("DataLoader, 2 workers, batches of 32: batches per second (higher is better).")
    columns = [">tensors per sample", "contender", ">batches/s", ">x default_collate", ">segments per batch"]
    cells = [
        [
            str(r["tensors_per_sample"]),
            r["contender"],
            f"{r['batches_per_s']:.0f}",
            f"{r['x_default_collate']:.2f}x",
            str(r["segments_per_batch"]),
        ]
        for r in rows
    ]
    print(markdown(columns, cells))
    write_json(json_path, {"rows": rows})
    return rows


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
    base = statistics.median(times["no guard"])
    return [
        {
            "contender": name,
            "median_us": statistics.median(t) * 1e6,
            "overhead_us": (statistics.median(t) - base) * 1e6,
            "overhead_us_per_hook": (statistics.median(t) - base) * 1e6 / 8,
        }
        for name, t in times.items()
    ]


def guard_main(rounds: int = 200, json_path: str | None = None) -> list[dict[str, Any]]:
    rows = guard_rows(rounds=rounds)
    print("guard() overhead per forward call: an MLP of 8 Linear(64, 64) + ReLU, batch of 4, CPU (medians).")
    columns = ["model", ">forward (us)", ">overhead (us)", ">per guarded module (us)"]
    cells = [
        [r["contender"], f"{r['median_us']:.1f}", f"{r['overhead_us']:+.1f}", f"{r['overhead_us_per_hook']:+.2f}"]
        for r in rows
    ]
    print(markdown(columns, cells))
    write_json(json_path, {"rows": rows})
    return rows
