"""Everything about todevice that needs a CUDA GPU, in one call, into one JSON file.

    python bench/gpu_check.py [--out DIR] [--probes DIR] [--budget SECONDS] [--only STEP,...] [--rounds N]

Run from the repository root on a machine with a CUDA GPU (``bench/gpu_check.sh`` sets up the paths first). The
steps, in this order, each in a process of its own with a time limit, within ``--budget`` seconds in all:

- ``info``: ``python -m todevice info``.
- ``bench``: ``python -m todevice bench --device cuda --rounds N`` (5 unless ``--rounds`` says), every accelerator
  table, then tests/test_accelerator.py.
- ``graph``: ``docs/examples/cuda_graph.py``, a training step captured as a CUDA graph and fed by a StaticBatch, timed
  against the graph fed by a ``copy_()`` per tensor and against the step without a graph.
- ``staging``: the staged host-to-device copy of 8 x 16 MiB and of one 128 MiB pageable tensor, at each piece size
  (``todevice._layout.STAGE_CHUNK_BYTES``: 1 to 32 MiB, and none), beside one pinned copy of the same bytes; the
  host's time, end to end and with 50 ms of work queued; and the host's memcpy rate into pinned memory.
- ``prefetch``: the prefetch table five times: ``prefetch()`` over a timm-style prefetcher, the median of five.
- ``suite``: the whole test suite, ``python -m pytest -n 8``.
- ``probes``: each ``probe_*.py`` in ``--probes`` (a folder of probe scripts), if given.

``DIR/gpu-check.json`` is written after every step, so a run stopped early keeps what it finished; ``DIR/gpu-check.log``
holds every step's output. Each step records its command, exit code, seconds and the tail of its output, and the
steps that measure record their figures. A step that would start past the budget is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
PIECES = (None, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB)  # None: each tensor written whole
STEPS = ("info", "bench", "graph", "staging", "prefetch", "suite", "probes")
LIMITS = {"info": 60, "bench": 300, "graph": 90, "staging": 120, "prefetch": 150, "suite": 420, "probes": 120}  # s


def _run(cmd: list[str], limit: float, log: Any, cwd: str | None = None) -> dict[str, Any]:
    """``cmd`` with a time limit: its exit code (None where it was stopped), seconds and output's tail."""
    start = time.perf_counter()
    log.write(f"\n===== {' '.join(cmd)} (at most {limit:.0f} s)\n")
    log.flush()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=cwd)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        raw = (err.stdout or b"") + (err.stderr or b"")
        out, rc = raw.decode(errors="replace") if isinstance(raw, bytes) else raw, None
    log.write(out)
    log.flush()
    return {"command": cmd, "exit_code": rc, "seconds": round(time.perf_counter() - start, 1), "tail": out[-3000:]}


def _step(name: str, args: argparse.Namespace, scratch: Path, limit: float, log: Any, save: Any) -> dict[str, Any]:
    py = sys.executable
    if name == "info":
        return _run([py, "-m", "todevice", "info"], limit, log)
    if name == "bench":
        path = scratch / "bench.json"
        cmd = [py, "-m", "todevice", "bench", "--device", "cuda", "--rounds", str(args.rounds), "--json", str(path)]
        result = _run(cmd, limit, log)
        result["report"] = json.loads(path.read_text()) if path.exists() else None
        return result
    if name == "graph":
        return _run([py, "docs/examples/cuda_graph.py", "200"], limit, log)
    if name in ("staging", "prefetch"):
        path = scratch / f"{name}.json"
        result = _run([py, __file__, "--measure", name, "--out", str(path)], limit, log)
        result["figures"] = json.loads(path.read_text()) if path.exists() else None
        return result
    if name == "suite":
        return _run([py, "-m", "pytest", "-n", "8", "-q", "-p", "no:cacheprovider"], limit, log)
    probes = sorted(Path(args.probes).glob("probe_*.py")) if args.probes else []
    if not probes:
        return {"skipped": "no --probes folder with probe_*.py scripts given"}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path("src").resolve()), os.environ.get("PYTHONPATH")]))
    done: dict[str, Any] = {}
    start = time.perf_counter()
    for p in probes:  # each within what is left of the step's time, the file saved after each
        left = limit - (time.perf_counter() - start)
        if left < 10:
            done[p.stem] = {"skipped": "the budget was spent"}
            continue
        done[p.stem] = _run([py, p.name], min(LIMITS["probes"], left), log, cwd=str(p.parent))
        save(done)
    return done


# ---------------------------------------------------------------- the measurements, each in a process of its own


def _staging() -> dict[str, Any]:
    """The staged copy at each piece size, beside one pinned copy of the same bytes, and the host's memcpy rate: medians
    of interleaved rounds, timed as the accelerator's tables time them (``todevice._bench.device._timed``)."""
    import torch

    import todevice
    from todevice import _layout
    from todevice._bench import device as tables

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    pinned = torch.empty(128 * MiB, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    one_copy = tables._timed({"copy": lambda: pinned.to(dev, non_blocking=True)}, 10)["copy"]
    src = torch.randn(4 * MiB)  # 16 MiB, pageable
    out: dict[str, Any] = {"one_pinned_copy_128MiB_ms": one_copy * 1e3, "link_gb_per_s": pinned.nbytes / one_copy / 1e9}
    rates = {}
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        view = pinned[: src.nbytes].view(torch.float32)
        seconds = tables._timed({"write": lambda view=view: view.copy_(src)}, 10, end_to_end=False)["write"]
        rates[f"{threads} threads"] = src.nbytes / seconds / 1e9
    torch.set_num_threads(max(int(k.split()[0]) for k in rates))
    out["host_memcpy_into_pinned_gb_per_s"] = rates
    cycles = tables._sleep_cycles(50.0)

    def queue_work() -> None:
        sync()
        tables._sleep(cycles)

    def moved(batch: list[Any], piece: int | None) -> Any:
        def call() -> None:
            _layout.STAGE_CHUNK_BYTES = piece if piece is not None else 1 << 62
            todevice.move(batch, dev)

        return call

    batches = {"8 x 16 MiB": [torch.randn(4 * MiB) for _ in range(8)], "1 x 128 MiB": [torch.randn(32 * MiB)]}
    cells = {f"{name}, {piece}": (name, piece) for piece in PIECES for name in batches}
    calls = {key: moved(batches[name], piece) for key, (name, piece) in cells.items()}  # every size, interleaved
    e2e = tables._timed(calls, 10)
    host = tables._timed(calls, 10, setup=sync, end_to_end=False)
    blocked = tables._timed(calls, 5, setup=queue_work, end_to_end=False)
    out["rows"] = [
        {
            "batch": name,
            "piece_mib": None if piece is None else piece // MiB,
            "host_ms": host[key] * 1e3,
            "end_to_end_ms": e2e[key] * 1e3,
            "of_one_pinned_copy": one_copy / e2e[key],
            "host_ms_with_50ms_queued": blocked[key] * 1e3,
        }
        for key, (name, piece) in cells.items()
    ]
    print(json.dumps(out["rows"], indent=1), flush=True)
    return out


def _prefetch() -> dict[str, Any]:
    """The prefetch table five times, and the median of its ratios to the timm-style prefetcher."""
    import statistics

    from todevice._bench import device as tables

    runs = [tables.prefetch_rows() for _ in range(5)]
    ratios: dict[str, list[float]] = {}
    for rows in runs:
        assert not isinstance(rows, str), rows
        for r in rows:
            if r["contender"] == "todevice.prefetch":
                ratios.setdefault(r["workload"], []).append(r["x_timm_style"])
    print(ratios, flush=True)
    return {"runs": runs, "x_timm_style": {k: {"runs": v, "median": statistics.median(v)} for k, v in ratios.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check", help="the folder for gpu-check.json and gpu-check.log")
    parser.add_argument("--probes", default=None, help="a folder of probe_*.py scripts to run last")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all the steps (default 540)")
    parser.add_argument("--only", default=",".join(STEPS), help=f"steps to run, in order: {','.join(STEPS)}")
    parser.add_argument("--rounds", type=int, default=5, help="the bench step's rounds (default 5)")
    parser.add_argument("--measure", choices=("staging", "prefetch"), help=argparse.SUPPRESS)  # a step's process
    args = parser.parse_args()
    if args.measure is not None:
        figures = _staging() if args.measure == "staging" else _prefetch()
        Path(args.out).write_text(json.dumps(figures, indent=1))
        return 0
    steps = [s for s in args.only.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"argument --only: no step {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
    with tempfile.TemporaryDirectory() as scratch, open(out / "gpu-check.log", "w") as log:
        for name in steps:
            left = args.budget - (time.perf_counter() - start)

            def save(result: dict[str, Any], name: str = name) -> None:
                report["steps"][name] = result
                report["seconds"] = round(time.perf_counter() - start, 1)
                (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))

            if left < 10:
                save({"skipped": f"the budget of {args.budget:.0f} s was spent"})
            else:
                limit = left if name == "probes" else min(LIMITS[name], left)  # probes: each has its own limit
                save(_step(name, args, Path(scratch), limit, log, save))
            print(f"{name}: {report['steps'][name].get('exit_code', '-')} at {report['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
