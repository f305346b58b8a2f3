"""DataLoader throughput: default_collate against todevice.collate() + prefetch(..., "cpu"), in one run.

Samples hold 10, 100 and 400 small tensors; DataLoader(num_workers=2), batches of 32. Also counts the
shared-memory segments (one file descriptor each) that cross from a worker per batch.

    python bench/bench_loader.py [--batches N] [--json PATH]

Prints the table, with a verdict line below it, from any directory; todevice must be installed
(``pip install -e .``). JSON goes only where ``--json`` says: ``--json bench/results/loader.json``, from
the repository root, refreshes the recorded results.
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.loader_main, batches=100)
