"""Traversal overhead of move() beside the hand-written helper and the peers, in one run.

Workloads: a nested batch of 1,000 tensors (dicts, lists, a dataclass, non-tensor leaves) and a flat
dict of 1,000 tensors. Targets: 'cpu', where the tensors already are (pure traversal cost), and
'meta' (every leaf copied, no data). Lightning and accelerate are timed when installed
(``pip install -e .[bench]``). Prints a Markdown table and writes JSON.

    python bench/bench_overhead.py [--rounds 100] [--json bench/results/overhead.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from todevice import _bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds per cell")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "overhead.json"))
    args = parser.parse_args()
    _bench.main(rounds=args.rounds, json_path=args.json)


if __name__ == "__main__":
    main()
