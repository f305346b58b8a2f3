"""``python -m todevice info | bench``."""

from __future__ import annotations

import argparse
import sys

import optree
import torch

import todevice
from todevice import _stream


def info() -> None:
    """What todevice sees on this machine."""
    acc = _stream.accelerator()
    try:
        torch.empty(1).pin_memory()
        pinned = "yes"
    except RuntimeError as err:
        pinned = f"no ({str(err).splitlines()[0]})"
    print(f"todevice {todevice.__version__}")
    print(f"torch    {torch.__version__}")
    print(f"optree   {optree.__version__}")
    print(f"accelerators: {', '.join(_stream.available_devices()[1:-1]) or 'none'}")
    print(f"pinned memory: {pinned}")
    print(f"default device: {acc.type if acc is not None else 'cpu'}")


def accelerator_bench(device: str, rounds: int, json_path: str | None) -> int:
    """``bench --device cuda``: the accelerator's tables, then its tests, in one JSON report."""
    import os
    import subprocess
    import time

    from todevice import _bench

    try:
        dev = _stream.resolve_device(device)
    except (TypeError, ValueError) as err:
        print(f"python -m todevice bench: {err}", file=sys.stderr)
        return 2
    if not _stream.is_accelerator(dev):
        print(f"python -m todevice bench: --device must name an accelerator; {dev} is not one.", file=sys.stderr)
        return 2
    with _stream.on_device(dev):
        tables = _bench.gpu_main(rounds=min(rounds, 10))
    tests: dict[str, object] = {"skipped": "tests/test_accelerator.py is not here: run from a checkout"}
    if os.path.exists(os.path.join("tests", "test_accelerator.py")):
        print("tests/test_accelerator.py:", flush=True)
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_accelerator.py"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        print(done.stdout[-3000:], flush=True)
        tests = {"exit_code": done.returncode, "seconds": time.perf_counter() - start, "tail": done.stdout[-3000:]}
    _bench.write_json(json_path, {"device": str(dev), "tables": tables, "tests": tests})
    return 0 if tests.get("exit_code", 0) == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m todevice", description=todevice.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, accelerators, pinned memory and the default device")
    bench = sub.add_parser(
        "bench", help="time move() against the helper and the peers, the transfer engine and the DataLoader"
    )
    bench.add_argument("--rounds", type=int, default=30, help="interleaved rounds per cell (default 30)")
    bench.add_argument("--batches", type=int, default=20, help="DataLoader batches timed per cell (default 20)")
    bench.add_argument("--json", default=None, help="also write the results to this JSON file")
    bench.add_argument(
        "--device",
        default=None,
        help="an accelerator ('cuda'): its tables only (bandwidth, host time blocked, the prefetch loop, "
        "device to host, into static buffers), then tests/test_accelerator.py when run from a checkout",
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
    elif args.device is not None:
        return accelerator_bench(args.device, args.rounds, args.json)
    else:
        from todevice import _bench

        overhead = _bench.main(rounds=args.rounds)
        print()
        transfer = _bench.transfer_main(rounds=args.rounds)
        print()
        loader = _bench.loader_main(batches=args.batches)
        print()
        guard = _bench.guard_main()
        _bench.write_json(args.json, {"rows": overhead, "transfer": transfer, "loader": loader, "guard": guard})
    return 0


if __name__ == "__main__":
    sys.exit(main())
