"""What todevice.guard() costs per forward call, and that nothing is left once it is removed.

An MLP of 8 Linear(64, 64) + ReLU layers on the CPU, batch of 4: forward without a guard, with one,
and after one was installed and removed, interleaved in one run.

    python bench/bench_guard.py [--rounds N] [--json PATH]

Prints the table, with a verdict line below it, from any directory; todevice must be installed
(``pip install -e .``). JSON goes only where ``--json`` says: ``--json bench/results/guard.json``, from
the repository root, refreshes the recorded results.
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.guard_main, rounds=2000)
