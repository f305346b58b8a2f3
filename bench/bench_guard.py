"""What todevice.guard() costs per forward call, and that nothing is left once it is removed.

An MLP of 8 Linear(64, 64) + ReLU layers on the CPU, batch of 4: forward without a guard, with one,
and after one was installed and removed, interleaved in one run.

    python bench/bench_guard.py [--rounds 2000] [--json bench/results/guard.json]  (run from the repository root)
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.guard_main, "guard", rounds=2000)
