"""What todevice.guard() costs per forward call, and that nothing is left once it is removed.

An MLP of 8 Linear(64, 64) + ReLU layers on the CPU, batch of 4: forward without a guard, with one,
and after one was installed and removed, interleaved in one run.

    python bench/bench_guard.py [--rounds 2000] [--json bench/results/guard.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from todevice import _bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000, help="interleaved rounds")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "guard.json"))
    args = parser.parse_args()
    _bench.guard_main(rounds=args.rounds, json_path=args.json)


if __name__ == "__main__":
    main()
