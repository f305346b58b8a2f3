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
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
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
