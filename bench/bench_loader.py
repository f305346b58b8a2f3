"""DataLoader throughput: default_collate against todevice.collate() + prefetch(..., "cpu"), in one run.

Samples hold 10, 100 and 400 small tensors; DataLoader(num_workers=2), batches of 32. Also counts the
shared-memory segments (one file descriptor each) that cross from a worker per batch.

    python bench/bench_loader.py [--batches 100] [--json bench/results/loader.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from todevice import _bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=100, help="batches timed per cell")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "loader.json"))
    args = parser.parse_args()
    _bench.loader_main(batches=args.batches, json_path=args.json)


if __name__ == "__main__":
    main()
