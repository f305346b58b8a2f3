"""The transfer engine, in one run.

On the host (every machine): the time of ``pack(batch).unpack()`` for a nested batch of 1,000 small
mixed-dtype tensors, against per-leaf ``.to('meta')`` of the same tensors (the least a per-leaf copy
costs the host: dispatch alone, without the driver call and allocation a real device adds).

On an accelerator: host-to-device GB/s of ``move()`` against per-leaf ``.to(non_blocking=True)`` and
the hand-written helper, for 1,000 x 4 KiB, 100 x 1 MiB, 8 x 64 MiB and a mixed batch, beside one
pinned 256 MiB copy. On a machine without one, it says why it skipped.

    python bench/bench_transfer.py [--rounds 100] [--json bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from todevice import _bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds per cell")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "transfer.json"))
    args = parser.parse_args()
    _bench.transfer_main(rounds=args.rounds, json_path=args.json)


if __name__ == "__main__":
    main()
