"""The benchmarks: move() against the hand-written helper and the peers, the transfer engine, the DataLoader.

Shipped inside the package so that ``python -m todevice bench`` works wherever todevice is
installed; the scripts in ``bench/`` run the same code with more rounds. Each table is followed by a
one-line verdict; JSON is written only where ``--json`` says, with the versions, the machine, the date
and the arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

import todevice
from todevice import _stream, _walk


def recursive_to_device(data: Any, device: Any) -> Any:
    """The hand-written helper most training loops carry: tensors, lists and dicts, nothing else."""
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


def nested_batch(n: int = 1000, fresh_keys: bool = False) -> dict[str, Any]:
    """A nested batch of ``n`` small tensors: dicts, lists, a dataclass and non-tensor leaves.

    Groups of 8 tensors (a dict holding a list of 6 float tensors, a bool mask, int ids, a string and
    an int), a dataclass with 2 tensors, and a list of the tensors left over. With ``fresh_keys``,
    every dict key is a new string object, as when a batch is built by parsing.
    """

    def key(text: str) -> str:
        return "".join(list(text)) if fresh_keys else text

    per_group = 8
    groups = max(0, (n - 2) // per_group)
    batch: dict[str, Any] = {
        key(f"feature_{i}"): {
            key("values"): [torch.randn(4) for _ in range(per_group - 2)],
            key("mask"): torch.ones(4, dtype=torch.bool),
            key("ids"): torch.arange(4),
            key("name"): f"f{i}",
            key("count"): i,
        }
        for i in range(groups)
    }
    batch[key("sample")] = Sample(torch.randn(3, 8, 8), torch.tensor(1), "s0")
    batch[key("extra")] = [torch.randn(2) for _ in range(n - groups * per_group - 2)]
    return batch


def flat_batch(n: int = 1000) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randn(4) for i in range(n)}


def small_batches() -> dict[str, Any]:
    """The batches most training loops carry: a tensor, an (input, target) pair, a tokenizer's output."""
    return {
        "1 tensor": torch.randn(8, 16),
        "[x, y]": [torch.randn(8, 16), torch.randint(0, 10, (8,))],
        "tokenizer dict (3 keys)": {
            "input_ids": torch.randint(0, 30000, (8, 128)),
            "attention_mask": torch.ones(8, 128, dtype=torch.int64),
            "labels": torch.randint(0, 2, (8,)),
        },
    }


def count_tensors(tree: Any, device: torch.device) -> tuple[int, int]:
    """(tensors on ``device``, all tensors), looking inside dataclasses too."""
    on, total = 0, 0
    for _, node in _walk.paths(tree, revisit=True):
        if isinstance(node, torch.Tensor):
            total += 1
            on += node.device == device
    return on, total


HELPER = "hand-written helper"
Rows = list[dict[str, Any]]

# The peers timed when installed: column name -> (module, function, the pip package that provides it).
PEERS = {
    "Lightning": ("lightning_fabric.utilities.apply_func", "move_data_to_device", "pytorch-lightning"),
    "accelerate": ("accelerate.utils", "send_to_device", "accelerate"),
}


def contenders() -> tuple[dict[str, Callable[[Any, torch.device], Any]], list[str]]:
    """Every function to time, by name, and the names of the peers not installed."""
    found: dict[str, Callable[[Any, torch.device], Any]] = {
        "todevice.move": lambda tree, dev: todevice.move(tree, dev),
        HELPER: recursive_to_device,
        "optree.tree_map": lambda tree, dev: optree.tree_map(
            lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, tree
        ),
    }
    missing: list[str] = []
    for name, (module, function, _) in PEERS.items():
        try:
            found[name] = getattr(importlib.import_module(module), function)
        except ImportError:
            missing.append(name)
    return found, missing


def missing_note(missing: Sequence[str]) -> str:
    """The line that names the peers not installed, so not timed, and how to install them."""
    names = ", ".join(f"{name} (pip package {PEERS[name][2]})" for name in missing)
    packages = " ".join(PEERS[name][2] for name in missing)
    return (
        f'Not installed, so not timed: {names}. To time them too: pip install ".[bench]" from a clone of '
        f"todevice, or pip install {packages}."
    )


def interleaved(
    funcs: Mapping[str, Callable[[], Any]],
    rounds: int,
    rng: random.Random,
    setup: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, medians over ``rounds``; the order shuffled every round.

    The shuffle keeps any one function from always running first, or right after another.
    ``setup`` runs, untimed, before each timed call (a mapping: its own setup for each function).
    The garbage collector is off during the rounds.
    """
    setups = setup if isinstance(setup, Mapping) else dict.fromkeys(funcs, setup)
    times: dict[str, list[float]] = {name: [] for name in funcs}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            order = list(funcs)
            rng.shuffle(order)
            for name in order:
                before = setups[name]
                if before is not None:
                    before()
                start = time.perf_counter()
                funcs[name]()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def _repeat(fn: Callable[[Any, torch.device], Any], trees: Sequence[Any], dev: torch.device) -> Callable[[], None]:
    """One timed sample: ``fn`` on each of ``trees``. Calls under a few microseconds are timed several at a time."""

    def sample() -> None:
        for tree in trees:
            fn(tree, dev)

    return sample


def _per_sample(fn: Callable[[], Any]) -> int:
    """How many calls make a sample of about 50 us: a lone call of 0.3 us is below the clock's noise."""
    fn()
    start = time.perf_counter()
    fn()
    return max(1, min(1000, int(50e-6 / max(time.perf_counter() - start, 1e-9))))


# ---------------------------------------------------------------- the command lines


def at_least(option: str, minimum: int, why: str) -> Callable[[str], int]:
    """An argparse ``type=`` for ``option``: a whole number of at least ``minimum``; ``why`` says why that many."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a whole number of at least {minimum} ({why}), got {text!r}; pass {option} {minimum} or more"
            )
        return value

    return parse


# Each option of the command lines: its type, and its help before "(default N)".
OPTIONS: dict[str, tuple[Callable[[str], int], str]] = {
    "rounds": (
        at_least("--rounds", 1, "each figure is a median over the rounds"),
        "interleaved rounds per cell, 1 or more",
    ),
    "batches": (
        at_least("--batches", 2, "the first batch only starts the workers and is not timed"),
        "DataLoader batches per cell, 2 or more: the first only starts the workers",
    ),
}


def json_path(text: str) -> str:
    """An argparse ``type=`` for ``--json``: a file that can be written, checked before anything is timed.

    The file is opened for appending, which changes nothing in it, and closed; made by that check, it is
    removed again, so a run that fails later leaves nothing behind.
    """
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(
            f"expected a file to write, got the folder {text!r}; name a file in it, "
            f"such as {os.path.join(text, 'bench.json')}"
        )
    if text.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise argparse.ArgumentTypeError(
            f"expected a file to write, got {text!r}, which ends in a path separator as a folder does; "
            f"name a file, such as {os.path.join(text, 'bench.json')}, in a folder that exists"
        )
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"expected a file in an existing folder, got {text!r}, and {folder} is not a folder; "
            "create the folder first, or name a file in one that exists"
        )
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(
            f"expected a file this user can write, got {text!r}, which it cannot write (permission denied); "
            "name a file in a folder you can write to"
        )
    existed = os.path.lexists(path)
    try:
        open(path, "a").close()
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"expected a file this user can write, got {text!r}, which cannot be opened for writing "
            f"({err.strerror or err}); name another file"
        ) from None
    if not existed:
        os.remove(path)
    return text


JSON_HELP = "also write the results, the versions, the machine and the arguments to this JSON file"


def script(
    doc: str | None, run: Callable[..., dict[str, Any]], argv: Sequence[str] | None = None, **defaults: int
) -> None:
    """The command line of a bench/ script: one ``--<option>`` per default, and ``--json``.

    Runs from any directory, and writes JSON only where ``--json`` says; exits with status 1 where that
    file could not be written (the JSON then went to stdout).
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, value in defaults.items():
        parse, text = OPTIONS[option]
        parser.add_argument(f"--{option}", type=parse, default=value, metavar="N", help=f"{text} (default {value})")
    parser.add_argument("--json", type=json_path, default=None, metavar="PATH", help=f"{JSON_HELP}; none by default")
    given = list(sys.argv[1:] if argv is None else argv)
    args = vars(parser.parse_args(given))
    env = environment(given, args)
    path = args.pop("json")
    if not write_json(path, run(**args), env):
        raise SystemExit(1)


def cpu_model() -> str:
    """The CPU's model name: from /proc/cpuinfo where there is one, else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def peer_versions() -> dict[str, dict[str, str | None]]:
    """Each peer's pip package and its installed version (None: not installed)."""
    found: dict[str, dict[str, str | None]] = {}
    for name, (_, _, package) in PEERS.items():
        try:
            version: str | None = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = None
        found[name] = {"package": package, "version": version}
    return found


def environment(argv: Sequence[str] = (), options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the figures depend on, stored with them: versions, the machine, the date and the arguments.

    Args:
        argv: The command-line arguments as given.
        options: Every option's value once parsed, defaults included.
    """
    acc = _stream.accelerator()
    accelerators = _stream.available_devices()[1:-1]
    if acc is not None and acc.type == "cuda":
        accelerators = [f"{name} ({torch.cuda.get_device_name(i)})" for i, name in enumerate(accelerators)]
    return {
        "todevice": todevice.__version__,
        "torch": torch.__version__,
        "optree": optree.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "accelerators": accelerators,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "options": dict(options or {}),
        "peers": peer_versions(),
    }


def write_json(json_path: str | None, result: Mapping[str, Any], env: Mapping[str, Any]) -> bool:
    """``{"environment": env, **result}`` into ``json_path``; nothing when it is None.

    Returns:
        False when the file could not be written: then one line on stderr names the file and the error,
        the file is removed if this call made it, and the JSON goes to stdout, so the results are not lost.
        True otherwise.
    """
    if json_path is None:
        return True
    text = json.dumps({"environment": dict(env), **result}, indent=2)
    made = not os.path.lexists(json_path)
    opened = False
    try:
        with open(json_path, "w") as f:
            opened = True
            f.write(text)
    except OSError as err:
        print(
            f"error: could not write {json_path} ({err.strerror or err}); the JSON follows on stdout instead",
            file=sys.stderr,
            flush=True,
        )
        if opened and made:
            with contextlib.suppress(OSError):
                os.remove(json_path)
        print(text, flush=True)
        return False
    print(f"wrote {json_path}")
    return True


def progress(part: tuple[int, int], text: str) -> None:
    """One line on stderr as a part starts, so a long part is not silent; the tables stay alone on stdout."""
    sys.stdout.flush()
    print(f"[{part[0]}/{part[1]}] {text} ...", file=sys.stderr, flush=True)


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}{'es' if word.endswith('ch') else 's'}"


def _span(sizes: Sequence[int]) -> str:
    low, high = min(sizes), max(sizes)
    return f"{low:,} tensor{'s' if low > 1 else ''}" if low == high else f"{low:,} to {high:,} tensors"


def _range(values: Sequence[float], fmt: str = "{:.2f}x") -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)} to {fmt.format(high)}"


# The helper's time / move()'s time that move() aims for, by target and batch size.
def _target(target: str, tensors: int) -> float:
    if tensors == 1:
        return 0.75
    if target == "meta":
        return 0.9
    return 1.0 if tensors < 100 else 2.0


def run(rounds: int = 30, sizes: Sequence[int] = (10, 100, 1000, 10_000), seed: int = 0) -> list[dict[str, Any]]:
    """Every contender on every batch and target, interleaved; medians per call."""
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
                rows.append(_row(bname, str(dev), interleaved(calls, rounds, rng), number, moved))
        rows.extend(_history_rows(rounds, rng, funcs))
    finally:
        gc.unfreeze()
    return rows


def _row(
    batch: str, target: str, times: dict[str, list[float]], number: int, moved: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    us = {name: statistics.median(t) / number * 1e6 for name, t in times.items()}
    tensors = moved[HELPER][1]
    return {
        "batch": batch,
        "target": target,
        "tensors": tensors,
        "median_us": us,
        "x_vs_move": {name: t / us["todevice.move"] for name, t in us.items()},
        "tensors_on_target": {name: on for name, (on, _) in moved.items()},
        "target_x_helper": _target(target, tensors),
    }


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


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a column named with a leading '>' is right-aligned (numbers)."""
    header = "| " + " | ".join(c.lstrip(">") for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.startswith(">") else "---" for c in columns) + "|"
    return "\n".join([header, rule] + ["| " + " | ".join(cells) + " |" for cells in rows])


def report(title: str, columns: list[str], cells: list[list[str]], name: str, verdict: str) -> dict[str, str]:
    """Print a table under its title, then its verdict line; the verdict by the table's name, for the JSON."""
    print(title)
    print(markdown(columns, cells) + "\n")
    print(verdict, flush=True)
    return {name: verdict}


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (batch, device): move()'s time, each contender's time over move()'s, and the tensors each moved."""
    others = [name for name in rows[0]["median_us"] if name != "todevice.move"]
    columns = ["batch", "device", ">move() (us)", *[f">{name}" for name in others], ">tensors moved (move() / helper)"]
    lines = []
    for r in rows:
        x = r["x_vs_move"]
        on = r["tensors_on_target"]
        lines.append(
            [
                r["batch"],
                r["target"],
                f"{r['median_us']['todevice.move']:.1f}",
                *[f"{x[name]:.2f}x" if name in x else "-" for name in others],
                f"{on['todevice.move']} / {on[HELPER]} of {r['tensors']}",
            ]
        )
    return markdown(columns, lines)


def answer(rows: Rows) -> str:
    """For the reader: is move() faster than the hand-written helper here, and where is it not, each by name."""
    x = {f"{r['batch']} to {r['target']}": r["x_vs_move"][HELPER] for r in rows}
    slower = {k: v for k, v in x.items() if v < 1.0}
    faster = len(x) - len(slower)
    line = f"On this machine, move() is faster than the hand-written helper in {faster} of {len(x)} rows"
    line += f" (up to {max(x.values()):.2f}x)" if faster else ""
    if not slower:
        return line + "."
    listed = "; ".join(f"{k}: {v:.2f}x" for k, v in sorted(slower.items(), key=lambda kv: kv[1]))
    return f"{line}, and slower in {len(slower)}: {listed}."


OVERHEAD = "move() against the hand-written helper and the peers"


def overhead_verdict(rows: Rows) -> str:
    """One line: ``move()`` against each row's target over the helper, by group of rows, and against the peers."""
    groups: dict[tuple[str, float], Rows] = {}
    for r in rows:
        groups.setdefault((r["target"], r["target_x_helper"]), []).append(r)
    parts = []
    for (target, goal), group in sorted(groups.items(), key=lambda g: (g[0][0], min(r["tensors"] for r in g[1]))):
        x = [r["x_vs_move"][HELPER] for r in group]
        met = sum(v >= goal for v in x)
        span = _span([r["tensors"] for r in group])
        parts.append(f"{target}, {span}, >= {goal:.2f}x: {_range(x)}, {met} of {len(group)} met")
    met = sum(r["x_vs_move"][HELPER] >= r["target_x_helper"] for r in rows)
    outcome = "met" if met == len(rows) else "not met"
    line = (
        f"Target: move() at or above each row's target against the hand-written helper: {outcome}, "
        f"{met} of {len(rows)} rows met ({'; '.join(parts)})"
    )
    peers = []
    for name in PEERS:
        x = [r["x_vs_move"][name] for r in rows if name in r["x_vs_move"]]
        if x:
            peers.append(f"than {name} in {sum(v > 1 for v in x)} of {len(x)} rows ({_range(x)})")
    return line + (f"; move() is faster {' and '.join(peers)}." if peers else ".")


def main(
    rounds: int = 30, sizes: Sequence[int] = (10, 100, 1000, 10_000), part: tuple[int, int] = (1, 1)
) -> dict[str, Any]:
    """The table of move() against the helper and the peers, and its verdict: ``{"rows", "verdicts"}``."""
    funcs, missing = contenders()
    batches = len(small_batches()) + 2 * len(sizes)
    what = f"{len(funcs)} contenders, {batches} batches to cpu and to meta, 5 more rows, {_count(rounds, 'round')} each"
    progress(part, f"{OVERHEAD}: {what}")
    rows = run(rounds=rounds, sizes=sizes)
    print(f"{OVERHEAD}.\n{answer(rows)}")
    print(
        "Columns: 'device' is where the batch goes: 'cpu', where its tensors already are (the cost of looking at "
        "the batch), or 'meta', where every tensor is copied with no data (the cost of the copies' bookkeeping). "
        "'move() (us)' is move()'s time per call. Each other column is that contender's time over move()'s: above "
        "1.00x, move() is faster. 'tensors moved' counts the tensors that reached the device (the helper leaves "
        "a dataclass's). Medians of interleaved rounds."
    )
    if missing:
        print(missing_note(missing))
    print(table(rows) + "\n")
    in_place = {r["batch"]: r["median_us"] for r in rows if r["batch"].startswith("in place")}
    if in_place:
        base, after, control = (us["todevice.move"] for us in in_place.values())
        print(
            "A call's cost does not depend on earlier calls: moving a batch already in place costs "
            f"{after / base:.2f}x its time back to back right after move() moved another batch, and "
            f"{control / base:.2f}x right after the helper did."
        )
    line = overhead_verdict(rows)  # the project's targets: in the JSON, and in bench/README.md
    return {"rows": rows, "verdicts": {OVERHEAD: line}, "answer": answer(rows)}


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
    return [node for _, node in _walk.paths(tree) if isinstance(node, torch.Tensor)]


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
    torch.accelerator.synchronize()


def _timed(
    funcs: dict[str, Callable[[], Any]], rounds: int, setup: Callable[[], Any] | None = None, end_to_end: bool = True
) -> dict[str, float]:
    """Median seconds of each ``fn()``, with the device work it queued when ``end_to_end``: interleaved
    rounds after a warm-up, ``setup`` run untimed before each call."""
    timed = {name: functools.partial(_synced, fn) for name, fn in funcs.items()} if end_to_end else funcs
    for fn in timed.values():
        fn()  # warm-up: allocator, pinned staging, plan
    torch.accelerator.synchronize()
    samples = interleaved(timed, rounds, random.Random(0), setup)
    torch.accelerator.synchronize()
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
        torch.accelerator.synchronize()
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
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:  # a backend without pinned memory
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
            hosted = _timed(funcs, max(3, rounds // many), setup=torch.accelerator.synchronize, end_to_end=False)
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
        torch.accelerator.current_stream(dev).wait_stream(side)
        for v in moved.values():
            v.record_stream(torch.accelerator.current_stream(dev))
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


def _inputs() -> dict[str, torch.Tensor]:
    """A fresh pageable batch of 100 small inputs: 90 float32[16] and 10 int64[8]."""
    batch = {f"x{i}": torch.randn(16) for i in range(90)}
    batch.update({f"ids{i}": torch.randint(0, 1000, (8,)) for i in range(10)})
    return batch


def _copy_each(static: dict[str, torch.Tensor], fresh: list[dict[str, torch.Tensor]]) -> None:
    """The loop move(batch, out=static) replaces: a copy call of its own for each tensor."""
    batch = fresh[0]
    for k in static:
        static[k].copy_(batch[k], non_blocking=True)


def _static_workload(static: dict[str, torch.Tensor], where: str) -> str:
    buffers = len({t.untyped_storage()._cdata for t in static.values()})
    return f"100 small pageable tensors into static {where} buffers ({buffers} storage{'s' if buffers > 1 else ''})"


def static_rows(rounds: int = 50) -> list[dict[str, Any]] | str:
    """Host time per step of a copy into static device buffers: move(batch, out=static) against per-tensor copy_()."""
    acc = _stream.accelerator()
    if acc is None:
        return "no accelerator on this machine (torch.accelerator.is_available() is False)"
    dev = torch.device(acc.type, _stream.current_index())
    static = todevice.move(_inputs(), dev)  # small tensors come back as views of one device buffer
    fresh = [_inputs()]

    def next_step() -> None:
        torch.accelerator.synchronize()  # untimed: the last step's copies land, so no queue builds up
        fresh[0] = _inputs()

    contenders: dict[str, Callable[[], Any]] = {
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


def static_host_rows(rounds: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    """Host time of move(batch, out=static) into static meta buffers against per-tensor copy_(), one run.

    ``static`` is views of one meta buffer, so move() takes the path it takes into views of one device
    buffer (pairing, checks, the staging write, one copy) with no data behind the copy. Into CPU tensors
    it would copy tensor by tensor, which says nothing of that path.
    """
    static = todevice.move(_inputs(), "meta", coalesce=True)
    fresh = [_inputs()]

    def next_batch() -> None:
        fresh[0] = _inputs()

    funcs: dict[str, Callable[[], Any]] = {
        "move(batch, out=static)": lambda: todevice.move(fresh[0], out=static),
        "per-tensor copy_() into meta": functools.partial(_copy_each, static, fresh),
    }
    for fn in funcs.values():
        fn()
    times = interleaved(funcs, rounds, random.Random(seed), setup=next_batch)
    base = statistics.median(times["per-tensor copy_() into meta"])
    return [
        {
            "workload": _static_workload(static, "meta"),
            "contender": name,
            "median_us": statistics.median(t) * 1e6,
            "x_per_leaf_to": statistics.median(t) / base,
        }
        for name, t in times.items()
    ]


def verdict(
    rows: Rows, contender: str, key: str, target: float, claim: str, fmt: str = "{:.1f}x", at_most: bool = False
) -> str:
    """One line: the target, whether ``contender``'s ``key`` met it in every row, and the figures.

    The target is met at ``target`` or above, or with ``at_most``, at ``target`` or below; ``fmt`` formats
    the figures.
    """
    got = {r["workload"]: r[key] for r in rows if r["contender"] == contender}
    met = "met" if got and all(x <= target if at_most else x >= target for x in got.values()) else "not met"
    return f"Target: {claim}: {met} ({'; '.join(f'{w}: {fmt.format(x)}' for w, x in got.items())})."


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
                "todevice.move(batch, out=static)",
                "x_per_tensor_copy",
                4.0,
                "move(batch, out=static) at least 4x less host time per step than per-tensor copy_()",
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


TRANSFER = "Transfer engine, host side"
PACK_TARGET = 1.5  # pack(batch).unpack() and the coalesced move: at most this many times per-leaf .to('meta')


def transfer_verdict(host: Rows) -> str:
    """One line: the coalesced paths against their target over per-leaf ``.to('meta')``, and ``out=static``.

    A copy into static buffers has no target on the host, so its line gives the figures beside per-tensor
    ``copy_()``.
    """
    by_name = {r["contender"]: r for r in host}
    judged = [by_name[name] for name in ("pack(batch).unpack()", "move(batch, 'meta', coalesce=True)")]
    met = "met" if all(r["x_per_leaf_to"] <= PACK_TARGET for r in judged) else "not met"
    figures = "; ".join(f"{r['contender']}: {r['x_per_leaf_to']:.2f}x" for r in judged)
    ours, theirs = by_name["move(batch, out=static)"], by_name["per-tensor copy_() into meta"]
    return (
        f"Target: pack(batch).unpack() and move(batch, 'meta', coalesce=True) at most {PACK_TARGET:.1f}x per-leaf "
        f".to('meta'): {met} ({figures}); move(batch, out=static) took {ours['median_us']:.0f} us against "
        f"{theirs['median_us']:.0f} us for per-tensor copy_() into meta ({ours['x_per_leaf_to']:.2f}x), which has "
        "no target on the host."
    )


def transfer_answer(host: Rows) -> str:
    """For the reader: what coalescing and ``out=`` cost the host here, where nothing is copied, and why that is so."""
    by_name = {r["contender"]: r for r in host}
    packed = by_name["pack(batch).unpack()"]["x_per_leaf_to"]
    coalesced = by_name["move(batch, 'meta', coalesce=True)"]["x_per_leaf_to"]
    ours, theirs = by_name["move(batch, out=static)"], by_name["per-tensor copy_() into meta"]
    return (
        f"On this machine's host, coalescing takes {coalesced:.2f}x the time of per-leaf .to('meta') "
        f"(pack().unpack(): {packed:.2f}x), and move(batch, out=static) {ours['x_per_leaf_to']:.2f}x per-tensor "
        f"copy_() ({ours['median_us']:.0f} against {theirs['median_us']:.0f} us). A copy to 'meta' moves no data, so "
        "these are the host's bookkeeping alone; on a GPU, where each copy costs a launch, coalescing sends one copy "
        "instead of one per tensor: python -m todevice bench --device cuda measures that."
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
    columns = ["workload", "contender", ">median (us)", ">time / per-leaf copy to meta"]
    cells = [[r["workload"], r["contender"], f"{r['median_us']:.0f}", f"{r['x_per_leaf_to']:.2f}x"] for r in host]
    title = f"{TRANSFER}: what coalescing and copies into static buffers cost the host (medians)."
    print(title)
    print(markdown(columns, cells) + "\n")
    print(transfer_answer(host), flush=True)
    verdicts = {TRANSFER: transfer_verdict(host)}  # the project's target: in the JSON, and in bench/README.md
    device: Any = "run python -m todevice bench --device cuda for the accelerator's tables"
    if acc is not None:
        print()
        device = gpu_main(rounds=max(3, rounds // 3))
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


LOADER = "DataLoader"
LOADER_OURS = "todevice.collate() + prefetch(..., 'cpu')"


def loader_verdict(rows: Rows) -> str:
    """One line: todevice's batches per second over default_collate's, and the shared-memory blocks a batch takes."""
    ours = [r for r in rows if r["contender"] == LOADER_OURS]
    plain = [r for r in rows if r["contender"] == "default_collate"]
    faster = sum(r["x_default_collate"] > 1 for r in ours)
    figures = "; ".join(f"{r['tensors_per_sample']} tensors: {r['x_default_collate']:.2f}x" for r in ours)
    return (
        f"Against default_collate: {LOADER_OURS} is faster at {faster} of {len(ours)} sample sizes ({figures}); "
        f"shared-memory blocks per batch: {_range([r['segments_per_batch'] for r in ours], '{:,}')} against "
        f"{_range([r['segments_per_batch'] for r in plain], '{:,}')}."
    )


def loader_main(batches: int = 100, part: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """The DataLoader table and its verdict: ``{"rows", "verdicts"}``."""
    progress(part, f"{LOADER}: 2 workers, 3 sample sizes, 3 loaders each, {_count(batches, 'batch')} per loader")
    rows = loader_rows(batches=batches)
    blocks = ">shared-memory blocks per batch"
    columns = [">tensors per sample", "contender", ">batches/s", ">x default_collate", blocks]
    cells = [
        [
            str(r["tensors_per_sample"]),
            r["contender"],
            f"{r['batches_per_s']:.0f}",
            "" if r["contender"] == "default_collate" else f"{r['x_default_collate']:.2f}x",
            str(r["segments_per_batch"]),
        ]
        for r in rows
    ]
    title = (
        f"{LOADER}, 2 workers, batches of 32: batches per second (higher is better). 'x default_collate' is the "
        "rate over default_collate's; 'shared-memory blocks per batch' counts the blocks, one file descriptor "
        "each, that carry a batch from a worker."
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
    columns = ["model", ">forward (us)", ">overhead (us)", ">per guarded module (us)"]
    cells = [
        [r["contender"], f"{r['median_us']:.1f}", f"{r['overhead_us']:+.1f}", f"{r['overhead_us_per_hook']:+.2f}"]
        for r in rows
    ]
    title = f"{GUARD} per forward call: an MLP of 8 Linear(64, 64) + ReLU, batch of 4, CPU (medians)."
    return {"rows": rows, "verdicts": report(title, columns, cells, GUARD, guard_verdict(rows))}
