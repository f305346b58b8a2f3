"""The transfer engine, in one run.

On the host (every machine): the time of ``pack(batch).unpack()`` for a nested batch of 1,000 small
mixed-dtype tensors, against per-leaf ``.to('meta')`` of the same tensors (the least a per-leaf copy
costs the host: dispatch alone, without the driver call and allocation a real device adds).

On an accelerator: host-to-device GB/s of ``move()`` against per-leaf ``.to(non_blocking=True)`` and
the hand-written helper, for 1,000 x 4 KiB, 100 x 1 MiB, 8 x 64 MiB and a mixed batch, beside one
pinned 256 MiB copy. On a machine without one, it says why it skipped.

    python bench/bench_transfer.py [--rounds 100] [--json bench/results/transfer.json]  (run from the repository root)
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.transfer_main, "transfer", rounds=100)
