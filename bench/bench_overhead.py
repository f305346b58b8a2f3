"""move() beside the hand-written helper and the peers, in one run, from 1 to 10,000 tensors.

Batches: one tensor; an (input, target) pair; a tokenizer-style dict of 3 tensors; flat dicts and nested batches
with a dataclass of 10, 100, 1,000 and 10,000 tensors. Targets: 'cpu', where the tensors already are (the cost of
the walk), and 'meta' (every tensor copied, with no data). More rows: an in-place move back to back, right after a
move of another batch and right after the helper moved it; and a batch whose dict keys are new objects every call.
Lightning and accelerate are timed when installed (``pip install -e ".[bench]"``); otherwise a line names them.

    python bench/bench_overhead.py [--rounds N] [--json PATH]

Prints the table, with a verdict line below it, from any directory; todevice must be installed
(``pip install -e .``). JSON goes only where ``--json`` says: ``--json bench/results/overhead.json``, from
the repository root, refreshes the recorded results.
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.main, rounds=100)
