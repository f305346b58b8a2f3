"""move() beside the hand-written helper and the peers, in one run, from 1 to 10,000 tensors.

Batches: one tensor; an (input, target) pair; a tokenizer-style dict of 3 tensors; flat dicts and nested batches
with a dataclass of 10, 100, 1,000 and 10,000 tensors. Targets: 'cpu', where the tensors already are (the cost of
the walk), and 'meta' (every tensor copied, with no data). Two more rows: an in-place move right after a move of
another batch, and a batch whose dict keys are new objects every call. Lightning and accelerate are timed when
installed (``pip install -e .[bench]``). Prints a Markdown table and writes JSON.

    python bench/bench_overhead.py [--rounds 100] [--json bench/results/overhead.json]  (run from the repository root)
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.main, "overhead", rounds=100)
