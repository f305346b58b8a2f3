"""This version of move() against another, in one process: the calls a change to the engine can make cheaper or
dearer, timed round by round, the two versions alternating which goes first.

    python bench/ab_versions.py --base COMMIT [--rounds 60] [--seconds 150] [--json PATH] [--matrix]

Run from a clone. The version at COMMIT is taken from this repository (``git archive``; or ``--base`` names a checkout
of it) and imported as ``todevice_base`` beside the installed todevice, so both meet the same machine state, round
after round: between processes, a shared machine's speed moves by more than the differences looked for. On an
accelerator it times host-to-device moves (a bare ``"cuda"`` and an indexed one), a batch already on the device,
device-to-host, ``out=`` and the prefetch loop; without one, the same calls with the CPU as the target. With
``--matrix``, the size matrix of ``bench/bench_overhead.py`` instead: its batches of 1 to 10,000 tensors moved to
``cpu`` and ``meta``. It prints the medians and the spread of the per-round ratios, and writes them as JSON where asked.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import todevice
from todevice import _stream


def import_base(base: str, root: pathlib.Path) -> Any:
    """todevice at commit ``base``, or from the checkout at ``base`` (a folder), as the package ``todevice_base``."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="todevice-base-"))
    if pathlib.Path(base).is_dir():
        shutil.copytree(pathlib.Path(base) / "src" / "todevice", where / "src" / "todevice")
    else:
        archive = subprocess.run(["git", "archive", base, "src/todevice"], cwd=root, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    package = where / "src" / "todevice"
    for path in package.rglob("*.py"):
        text = re.sub(r"\b(from|import) todevice\b", r"\1 todevice_base", path.read_text())
        path.write_text(text)
    package.rename(where / "todevice_base")
    sys.path.insert(0, str(where))
    import todevice_base  # type: ignore[import-not-found]

    return todevice_base


def cases(dev: torch.device) -> dict[str, tuple[int, bool, Callable[[Any, str], Any]]]:
    """Each case: calls per timing, whether the timing waits for the device, and the call (of a module and its tag)."""
    on = dev.type != "cpu"
    name = dev.type if on else "cpu"  # the bare name: "cuda", the current device
    sync = _stream.accel.synchronize if on else (lambda: None)

    def tokens(pin: bool = False, device: Any = None) -> dict[str, torch.Tensor]:
        d = {
            "input_ids": torch.randint(0, 30000, (32, 512)),
            "attention_mask": torch.ones(32, 512, dtype=torch.int64),
            "labels": torch.randint(0, 2, (32,)),
        }
        return {k: v.pin_memory() if pin else v.to(device) if device is not None else v for k, v in d.items()}

    def small100() -> dict[str, torch.Tensor]:
        return {
            **{f"f{i}": torch.randn(16) for i in range(90)},
            **{f"i{i}": torch.randint(0, 9, (8,)) for i in range(10)},
        }

    one, two = torch.randn(32, 10), {"x": torch.randn(32, 10), "y": torch.randint(0, 10, (32,))}
    pinned, there = tokens(pin=on), tokens(device=dev)
    scalars = {f"m{i}": torch.tensor(float(i), device=dev) for i in range(50)}
    nested = {
        "scalars": [torch.tensor(float(i), device=dev) for i in range(500)],
        "vectors": {f"v{i}": torch.randn(1 + i % 16, device=dev) for i in range(500)},
    }
    sources = [small100() for _ in range(8)]
    static = {tag: todevice.move(small100(), dev) for tag in ("base", "this")}
    large = [torch.randn(4 * 1024 * 1024) for _ in range(8)]
    weight = torch.randn(2048, 2048, device=dev)
    images = [{"image": torch.randn(16, 3, 224, 224), "label": torch.randint(0, 1000, (16,))} for _ in range(20)]
    if on:
        images = [{k: v.pin_memory() for k, v in b.items()} for b in images]

    def into(m: Any, tag: str) -> None:  # host time per step; the device is waited for between steps, untimed
        for s in sources:
            m.move(s, out=static[tag])
            sync()

    def loop(m: Any, tag: str) -> None:
        for batch in m.prefetch(images, dev):
            x = batch["image"].flatten(1)[:, :2048]
            for _ in range(8):
                x = x @ weight
            x.sum().add_(batch["label"].sum())

    return {
        f"1 tensor, pageable, '{name}'": (200, False, lambda m, t: m.move(one, name)),
        f"dict of 2, pageable, '{name}'": (200, False, lambda m, t: m.move(two, name)),
        f"dict of 2, pageable, '{dev}'": (200, False, lambda m, t: m.move(two, dev)),
        "tokenizer dict, pinned": (200, False, lambda m, t: m.move(pinned, name)),
        "tokenizer dict, already there": (500, False, lambda m, t: m.move(there, name)),
        "50 scalars to cpu": (20, True, lambda m, t: m.move(scalars, "cpu")),
        "1,000 nested to cpu": (5, True, lambda m, t: m.move(nested, "cpu")),
        "out=: 8 steps of 100 small pageable tensors": (1, False, into),
        "8 x 16 MiB pageable": (2, True, lambda m, t: m.move(large, name)),
        "prefetch: 20 steps of 16 x 3 x 224 x 224": (1, True, loop),
    }


def matrix_cases() -> dict[str, tuple[int, bool, Callable[[Any, str], Any]]]:
    """The size matrix's batches, to ``cpu`` and ``meta``: each timed over about 2 ms of calls."""
    from todevice._bench.common import flat_batch, nested_batch, small_batches

    batches = small_batches()
    for n in (10, 100, 1000, 10_000):
        batches[f"flat dict, {n:,}"] = flat_batch(n)
        batches[f"nested with a dataclass, {n:,}"] = nested_batch(n)
    out: dict[str, tuple[int, bool, Callable[[Any, str], Any]]] = {}
    for name, tree in batches.items():
        for dev in ("cpu", "meta"):
            todevice.move(tree, dev)  # the plan and the caches made: the call after is a step's
            start = time.perf_counter()
            todevice.move(tree, dev)
            calls = max(1, int(2e-3 / max(time.perf_counter() - start, 1e-7)))
            out[f"{name}, {dev}"] = (calls, False, lambda m, t, tree=tree, dev=dev: m.move(tree, dev))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with, or a checkout of it (a folder)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=150.0, help="stop starting rounds after this long")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--matrix", action="store_true", help="the size matrix's batches instead, to cpu and meta")
    args = parser.parse_args()
    start = time.perf_counter()
    base = import_base(args.base, pathlib.Path(__file__).resolve().parent.parent)
    acc = _stream.accelerator()
    dev = torch.device(acc.type, _stream.current_index()) if acc else torch.device("cpu")
    sync = _stream.accel.synchronize if acc else (lambda: None)
    table = matrix_cases() if args.matrix else cases(dev)
    versions = {"base": base, "this": todevice}

    def timed(case: str, tag: str) -> float:
        n, waits, call = table[case]
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            call(versions[tag], tag)
        if waits:
            sync()
        return (time.perf_counter() - t0) / n * 1e6

    for case in table:  # warm both
        for tag in versions:
            for _ in range(3):
                timed(case, tag)
    got: dict[str, dict[str, list[float]]] = {case: {"base": [], "this": [], "ratio": []} for case in table}
    rounds = 0
    while rounds < args.rounds and time.perf_counter() - start < args.seconds:
        for case in table:
            order = ("base", "this") if rounds % 2 == 0 else ("this", "base")
            us = {tag: timed(case, tag) for tag in order}
            for tag, value in us.items():
                got[case][tag].append(value)
            got[case]["ratio"].append(us["this"] / us["base"])
        rounds += 1
    machine = torch.cuda.get_device_name() if acc and acc.type == "cuda" else str(acc or "cpu")
    print(f"{machine}, torch {torch.__version__}, against {args.base}: {rounds} rounds in one process, alternated\n")
    print("| case | base us | this us | this / base, median | middle half of the ratios |")
    print("|---|---:|---:|---:|---|")
    for case, d in got.items():
        q, med = statistics.quantiles(d["ratio"], n=4), statistics.median
        spread = f"{q[0]:.3f} to {q[2]:.3f}"
        print(f"| {case} | {med(d['base']):.1f} | {med(d['this']):.1f} | {med(d['ratio']):.3f} | {spread} |")
    if args.json:
        report = {"machine": machine, "torch": torch.__version__, "base": args.base, "rounds": rounds, "cases": got}
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\n{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
