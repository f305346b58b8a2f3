"""The DataLoader with todevice.collate() at one version against another: separate processes, alternated.

    python bench/ab_loader.py --base COMMIT [--other COMMIT] [--fields 10] [--batches 300] [--runs 3] [--json PATH]

Run from a clone. Each run is a new process with the version's ``src`` first on its path (a ``git worktree`` of the
commit, made under the system's temporary folder, or this checkout for ``--other`` left out): a DataLoader with 2
workers, batches of 32 samples, ``prefetch_factor=4`` and ``torch.set_num_threads(1)``, each sample a dict of
``--fields`` float32[16] tensors and an int label. It times ``default_collate``, then ``todevice.collate()`` with
``prefetch(..., "cpu")``, then ``default_collate`` again, each from its second batch (the workers up), and the CPU
time that the process and its workers spent per batch. The versions alternate which runs first. It prints each run,
then the medians: todevice's batches per second, default_collate's (which shows whether the machine held steady),
and the CPU time per batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cpu() -> float:
    """Seconds of CPU this process and its finished children spent."""
    mine, theirs = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + theirs.ru_utime + theirs.ru_stime


def one_run(fields: int, batches: int) -> dict[str, Any]:
    """In this process: default_collate, todevice, default_collate again; batches per second and CPU us per batch."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    import todevice

    torch.set_num_threads(1)

    class ManySmall(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.sample = {f"t{k}": torch.randn(16) for k in range(fields)}

        def __len__(self) -> int:
            return (batches + 1) * 32

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {**self.sample, "label": i}

    def timed(ours: bool) -> tuple[float, float]:
        start_cpu = _cpu()
        loader = DataLoader(
            ManySmall(),
            batch_size=32,
            num_workers=2,
            prefetch_factor=4,
            collate_fn=todevice.collate() if ours else None,
        )
        batches_in = iter(loader)
        next(batches_in)  # the workers up
        source: Any = todevice.prefetch(batches_in, "cpu") if ours else batches_in
        start, count = time.perf_counter(), 0
        for _ in source:
            count += 1
        took = time.perf_counter() - start
        del source, batches_in
        gc.collect()  # the workers are joined: their CPU time is this process's children's now
        return count / took, (_cpu() - start_cpu) / (count + 1) * 1e6

    runs = [timed(False), timed(True), timed(False)]
    return {"default": [runs[0][0], runs[2][0]], "todevice": runs[1][0], "cpu_us": [r[1] for r in runs]}


def _source(commit: str | None) -> str:
    """The ``src`` folder of ``commit`` (a worktree made once), or this checkout's."""
    if commit is None:
        return str(ROOT / "src")
    where = pathlib.Path(tempfile.gettempdir()) / f"todevice-{commit}"
    if not where.is_dir():
        subprocess.run(["git", "worktree", "add", "-f", str(where), commit], cwd=ROOT, check=True, capture_output=True)
    return str(where / "src")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--other", default=None, help="the commit to compare (default: this checkout)")
    parser.add_argument("--fields", type=int, default=10, help="tensors per sample")
    parser.add_argument("--batches", type=int, default=300, help="batches timed per loader")
    parser.add_argument("--runs", type=int, default=3, help="runs of each version")
    parser.add_argument("--json", help="also write the runs here")
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.fields, args.batches)))
        return
    versions = {"base": args.base, "other": args.other}
    got: dict[str, list[dict[str, Any]]] = {"base": [], "other": []}
    for i in range(args.runs):
        for tag in ("base", "other") if i % 2 == 0 else ("other", "base"):
            env = dict(os.environ, PYTHONPATH=_source(versions[tag]))
            command = [sys.executable, __file__, "--one-run", "--base", "-", "--fields", str(args.fields)]
            out = subprocess.run([*command, "--batches", str(args.batches)], env=env, capture_output=True, text=True)
            run = json.loads(out.stdout.splitlines()[-1])
            got[tag].append(run)
            plain = f"default_collate {run['default'][0]:.0f} and {run['default'][1]:.0f} b/s"
            print(
                f"{tag}: todevice {run['todevice']:.0f} b/s, {plain}; CPU us a batch {run['cpu_us'][1]:.0f}", flush=True
            )
    print(f"\n{args.fields} tensors a sample, {args.runs} runs each, alternated (medians, and the range):")
    for tag, runs in got.items():
        ours, plain = [r["todevice"] for r in runs], [x for r in runs for x in r["default"]]
        cpu = [r["cpu_us"][1] for r in runs]
        name = versions[tag] or "this checkout"
        print(
            f"  {name}: todevice {statistics.median(ours):.0f} b/s ({min(ours):.0f} to {max(ours):.0f}), "
            f"default_collate {statistics.median(plain):.0f} b/s ({min(plain):.0f} to {max(plain):.0f}), "
            f"todevice's CPU {statistics.median(cpu):.0f} us a batch"
        )
    ratio = statistics.median([r["todevice"] for r in got["other"]]) / statistics.median(
        [r["todevice"] for r in got["base"]]
    )
    print(f"  todevice's batches per second, {versions['other'] or 'this checkout'} over {args.base}: {ratio:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"fields": args.fields, "runs": got, "versions": versions}))


if __name__ == "__main__":
    main()
