"""The transfer engine, in one run.

On the host (every machine): the time of ``pack(batch).unpack()`` for a nested batch of 1,000 small
mixed-dtype tensors, against per-leaf ``.to('meta')`` of the same tensors (the least a per-leaf copy
costs the host: dispatch alone, without the driver call and allocation a real device adds); and the
host time per step of a ``StaticBatch`` and of ``move(batch, out=static)`` for 100 small pageable
tensors into static CPU buffers, views of one buffer as ``todevice.static()`` allocates them, against
a per-tensor ``copy_()`` into them.

On an accelerator: host-to-device GB/s of ``move()`` against per-leaf ``.to(non_blocking=True)`` and
the hand-written helper, for 1,000 x 4 KiB, 100 x 1 MiB, 8 x 16 MiB and a mixed batch, beside one
pinned 128 MiB copy; the host time blocked and the prefetch loop; small device tensors read back to
the host, against per-leaf ``.cpu()`` and ``.item()``; and the host time per step of a
``StaticBatch`` and of ``move(batch, out=static)`` into static device buffers, against a per-tensor
``copy_()``. On a
machine without one, it says why it skipped.

    python bench/bench_transfer.py [--rounds N] [--json PATH]

Prints the table, with a verdict line below it, from any directory; todevice must be installed
(``pip install -e .``). JSON goes only where ``--json`` says: ``--json bench/results/transfer.json``, from
the repository root, refreshes the recorded results.
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.transfer_main, rounds=100)
