"""What every benchmark table shares: the batches, the hand-written helper and the peers, interleaved timing, the
command-line options, the JSON report and the table and verdict formats."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import json
import math
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


def quartiles_of(values: Sequence[float]) -> list[float]:
    """The 25th, 50th and 75th percentiles of ``values`` (one value, three times)."""
    return statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else list(values) * 3


def standing(low: float, high: float) -> str:
    """A ratio (the other's time over this one's) by the middle half of its rounds, ``low`` to ``high``: "faster" where
    it lies above 1.0x, "slower" where below, "no measurable difference" where it holds 1.0x."""
    if low > 1.0:
        return "faster"
    if high < 1.0:
        return "slower"
    return "no measurable difference"


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


def ratio(value: float) -> str:
    """A ratio as the tables print it: two decimals (``1.08x``), two significant digits below 0.1x (``0.0043x``), and
    ``<0.001x`` below that: never ``0.00x``. ``-`` for one that is not a number (a time of 0)."""
    if not math.isfinite(value):
        return "-"
    if value >= 0.1:
        return f"{value:.2f}x"
    return f"{value:.2g}x" if value >= 0.001 else "<0.001x"


def _range(values: Sequence[float], fmt: str | None = None) -> str:
    """``low to high`` of ``values``, each as ``fmt`` formats it (a ratio by default); one value where they agree."""
    say: Any = ratio if fmt is None else fmt.format
    low, high = say(min(values)), say(max(values))
    return low if low == high else f"{low} to {high}"


# The helper's time / move()'s time that move() aims for, by target and batch size.
def _target(target: str, tensors: int) -> float:
    if tensors == 1:
        return 0.75
    if target == "meta":
        return 0.9
    return 1.0 if tensors < 100 else 2.0


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
