"""DataLoader throughput: default_collate against todevice.collate() + prefetch(..., "cpu"), in one run.

Samples hold 10, 100 and 400 small tensors; DataLoader(num_workers=2), batches of 32. Also counts the
shared-memory segments (one file descriptor each) that cross from a worker per batch.

    python bench/bench_loader.py [--batches 100] [--json bench/results/loader.json]  (run from the repository root)
"""

from todevice import _bench

if __name__ == "__main__":
    _bench.script(__doc__, _bench.loader_main, "loader", batches=100)
