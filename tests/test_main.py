"""``python -m todevice info | bench``, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "todevice", *args], capture_output=True, text=True, check=True)
    return done.stdout


def test_info_prints_versions_accelerators_pinning_and_default_device() -> None:
    out = run("info")
    assert f"torch    {torch.__version__}" in out
    assert "optree   " in out
    assert "accelerators: " in out
    assert "pinned memory: " in out
    assert "default device: " in out


def test_bench_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "overhead.json"
    out = run("bench", "--rounds", "1", "--batches", "2", "--json", str(path))
    assert "| nested with a dataclass, 1,000 | cpu |" in out
    assert "| 1 tensor | meta |" in out
    data = json.loads(path.read_text())
    cells = {(r["batch"], r["target"]) for r in data["rows"]}
    assert ("tokenizer dict (3 keys)", "cpu") in cells and ("flat dict, 10,000", "meta") in cells
    assert all(r["median_us"]["todevice.move"] > 0 and r["median_us"]["hand-written helper"] > 0 for r in data["rows"])
    assert all(r["tensors_on_target"]["todevice.move"] == r["tensors"] for r in data["rows"])
    assert {r["contender"] for r in data["transfer"]["host"]} >= {"pack(batch).unpack()", "per-leaf .to('meta')"}
    assert {r["tensors_per_sample"] for r in data["loader"]} == {10, 100, 400}
    assert "| 100 | todevice.collate() + prefetch(..., 'cpu') |" in out


def test_bench_on_a_device_that_is_not_an_accelerator_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "todevice", "bench", "--device", "cpu"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "--device must name an accelerator; cpu is not one" in done.stderr
