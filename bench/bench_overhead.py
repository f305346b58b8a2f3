"""Traversal overhead of move() beside the hand-written helper and the peers, in one run.

Workloads: a nested batch of 1,000 tensors (dicts, lists, a dataclass, non-tensor leaves) and a flat
dict of 1,000 tensors. Targets: 'cpu', where the tensors already are (pure traversal cost), and
'meta' (every leaf copied, no data). Lightning and accelerate are timed when installed
(``pip install -e .[bench]``). Prints a Markdown table and writes JSON.

    python bench/bench_overhead.py [--rounds 100] [--json bench/results/overhead.json]  (run from the repository root)
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.main, "overhead", rounds=100)
