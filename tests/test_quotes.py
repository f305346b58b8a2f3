"""Every figure README.md's Speed section quotes is recomputed here from the recorded run it names: a quote that no
recorded run gives fails."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"

pytestmark = pytest.mark.skipif(not README.exists() or not RESULTS.is_dir(), reason="not run from a checkout")

Rows = list[dict[str, Any]]


def _gpu() -> dict[str, Rows]:
    return json.loads((RESULTS / "accelerator-h100.json").read_text())["tables"]  # type: ignore[no-any-return]


def _table(start: str) -> Rows:
    return next(rows for name, rows in _gpu().items() if name.startswith(start))


def _span(values: list[float], fmt: str = "{:.2f}x") -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low} to {high}"


def _move_ratios(workloads: tuple[str, ...], memories: tuple[str, ...]) -> list[float]:
    rows = _table("The batches loops carry")
    return [
        r[key]
        for r in rows
        if r["contender"] == "todevice.move" and r["workload"].startswith(workloads) and r["memory"] in memories
        for key in ("x_helper_host", "x_helper_e2e")
    ]


def _one(start: str, contender: str, key: str) -> float:
    return next(r[key] for r in _table(start) if r["contender"] == contender)


def _one_row(table: str, workload: str, contender: str, key: str) -> float:
    """``key`` of the row of ``table`` whose workload and contender begin so."""
    rows = _table(table)
    return next(r[key] for r in rows if r["contender"].startswith(contender) and r["workload"].startswith(workload))


# What the README says, with each figure as a group, and how the recorded run gives that figure.
GPU_QUOTES: list[tuple[str, Callable[[], str]]] = [
    (
        r"10 tensors (\S+ to \S+) faster than the helper",
        lambda: _span(_move_ratios(("10 x",), ("pageable", "pinned"))),
    ),
    (
        r"100 and 1,000 small tensors (\S+ to \S+),",
        lambda: _span(_move_ratios(("100 x", "1,000 x"), ("pageable", "pinned"))),
    ),
    (
        r"blocked (\S+ ms) by 8 x 16 MiB of pageable tensors",
        lambda: f"{_one_row('Host time blocked', '8 x 16 MiB pageable', 'todevice.move', 'host_ms'):.1f} ms",
    ),
    (
        r"against (\S+ ms) for a `\.to\(\)` per tensor",
        lambda: f"{_one_row('Host time blocked', '8 x 16 MiB pageable', 'per-leaf .to(', 'host_ms'):.1f} ms",
    ),
    (
        r"1 to 10 tensors already on the device \((\S+ to \S+) the helper's speed\)",
        lambda: _span(_move_ratios(("1 tensor", "(images", "tokenizer", "10 x"), ("on the device",))),
    ),
    (
        r"one pinned tensor's host time \((\S+)\)",
        lambda: f"{_one_row('The batches loops', '1 tensor (32 x 10), pinned', 'todevice.move', 'x_helper_host'):.2f}x",
    ),
    (
        r"pageable tensors staged at (\S+) of the link's speed",
        lambda: f"{_one_row('Host-to-device', '8 x 16 MiB, pageable', 'todevice.move', 'x_single_copy'):.0%}",
    ),
    (
        r"`out=` at (\S+) less host time than a `copy_\(\)` per tensor",
        lambda: f"{_one('Into static buffers', 'todevice.move(batch, out=static)', 'x_per_tensor_copy'):.1f}x",
    ),
]


# Three runs on each of two machines: a 2-core AMD EPYC VM and a 2-core Intel Xeon VM.
CPU_RUNS = (
    "overhead.json",
    "overhead-2.json",
    "overhead-3.json",
    "overhead-xeon.json",
    "overhead-xeon-2.json",
    "overhead-xeon-3.json",
)


def _cpu_rows() -> Rows:
    """The size matrix's rows of the recorded CPU runs (not the rows about history or new dict keys)."""
    rows: Rows = []
    for name in CPU_RUNS:
        for r in json.loads((RESULTS / name).read_text())["rows"]:
            if not r["batch"].startswith("in place") and "new dict keys" not in r["batch"]:
                rows.append(r)
    return rows


def _cpu(target: str, low: int, high: int, name: str = "hand-written helper", family: str = "") -> list[float]:
    """Each run's ratio of ``name``'s time to move()'s, for the batches (whose names begin with ``family``) of ``low``
    to ``high`` tensors to ``target``."""
    return [
        r["x_vs_move"][name]
        for r in _cpu_rows()
        if r["target"] == target
        and low <= r["tensors"] <= high
        and r["batch"].startswith(family)
        and name in r["x_vs_move"]
    ]


def _faster_in(name: str) -> str:
    x = _cpu("cpu", 1, 10**6, name) + _cpu("meta", 1, 10**6, name)
    return f"{sum(v > 1 for v in x)} of {len(x)}"


CPU_QUOTES: list[tuple[str, Callable[[], str]]] = [
    (r"already there: one tensor (\S+( to \S+)?),", lambda: _span(_cpu("cpu", 1, 1))),
    (r"2 and 3 tensors (\S+( to \S+)?),", lambda: _span(_cpu("cpu", 2, 3))),
    (r"flat dicts of 10 to 10,000 tensors (\S+( to \S+)?),", lambda: _span(_cpu("cpu", 10, 10_000, family="flat"))),
    (r"nested batches of 10 to 10,000 (\S+( to \S+)?)", lambda: _span(_cpu("cpu", 10, 10_000, family="nested"))),
    (r"Copied to `meta`: one tensor (\S+( to \S+)?),", lambda: _span(_cpu("meta", 1, 1))),
    (r"2 to 10,000 tensors (\S+( to \S+)?)\.", lambda: _span(_cpu("meta", 2, 10_000))),
    (r"than Lightning's `move_data_to_device` in (\d+ of \d+)", lambda: _faster_in("Lightning")),
    (
        r"Lightning's `move_data_to_device` in \d+ of \d+ \((\S+ to \S+)\)",
        lambda: _span(_cpu("cpu", 1, 10**6, "Lightning") + _cpu("meta", 1, 10**6, "Lightning")),
    ),
    (r"accelerate's `send_to_device` in (\d+ of \d+)", lambda: _faster_in("accelerate")),
    (
        r"accelerate's `send_to_device` in \d+ of \d+ \((\S+ to \S+)\)",
        lambda: _span(_cpu("cpu", 1, 10**6, "accelerate") + _cpu("meta", 1, 10**6, "accelerate")),
    ),
]


@pytest.mark.parametrize(("pattern", "figure"), CPU_QUOTES, ids=[q[0][:40] for q in CPU_QUOTES])
def test_each_cpu_figure_the_readme_quotes_is_the_recorded_runs(pattern: str, figure: Callable[[], str]) -> None:
    speed = _speed()
    assert all(f"`bench/results/{name}`" in speed for name in CPU_RUNS)  # the runs the figures come from are named
    found = re.search(pattern, speed)
    assert found is not None, f"README's Speed section no longer says {pattern!r}"
    assert found.group(1) == figure()


def _speed() -> str:
    """The Speed section, its lines joined: a figure may be wrapped."""
    text = README.read_text()
    return " ".join(text[text.index("## Speed") : text.index("\n## ", text.index("## Speed") + 1)].split())


@pytest.mark.parametrize(("pattern", "figure"), GPU_QUOTES, ids=[q[0][:40] for q in GPU_QUOTES])
def test_each_gpu_figure_the_readme_quotes_is_the_recorded_h100_run_s(pattern: str, figure: Callable[[], str]) -> None:
    speed = _speed()
    assert "`bench/results/accelerator-h100.json`" in speed  # the run the figures come from is named
    found = re.search(pattern, speed)
    assert found is not None, f"README's Speed section no longer says {pattern!r}"
    assert found.group(1) == figure()


def test_the_quote_check_fails_when_a_quoted_ratio_is_edited() -> None:
    speed = _speed()
    pattern, figure = GPU_QUOTES[0]
    edited = speed.replace(figure(), "1.25x to 1.58x")
    assert edited != speed
    found = re.search(pattern, edited)
    assert found is not None and found.group(1) != figure()


def test_the_guard_figures_docs_api_quotes_are_the_recorded_runs() -> None:
    """The share of a forward and the time per guarded module, each the range over bench/results/guard*.json."""
    text = " ".join((ROOT / "docs" / "api.md").read_text().split())
    runs = [json.loads(path.read_text())["rows"] for path in sorted(RESULTS.glob("guard*.json"))]
    on = [next(r for r in rows if r["contender"] == "guard(model)") for rows in runs]
    base = [next(r for r in rows if r["contender"] == "no guard")["median_us"] for rows in runs]
    share = [r["overhead_us"] / b * 100 for r, b in zip(on, base)]
    found = re.search(
        r"it added (\d+)% to (\d+)% to the forward time .*?, (\S+) to (\S+) us per guarded module, over (\w+)", text
    )
    assert found is not None, "docs/api.md no longer quotes guard()'s cost"
    assert found.groups()[:4] == (
        f"{min(share):.0f}",
        f"{max(share):.0f}",
        f"{min(r['overhead_us_per_hook'] for r in on):.2f}",
        f"{max(r['overhead_us_per_hook'] for r in on):.2f}",
    )
    assert found.group(5) == ["one", "two", "three", "four", "five", "six"][len(runs) - 1]


LOADER_RUNS = ("loader.json", "loader-xeon.json")  # two 2-core Intel Xeon VMs


def test_the_dataloader_figures_the_readme_quotes_are_the_recorded_runs() -> None:
    """The range, over the recorded runs it names, of collate()'s rate over default_collate's per sample size."""
    text = " ".join(README.read_text().split())
    assert all(f"`bench/results/{name}`" in text for name in LOADER_RUNS)
    found = re.search(r"2 workers delivered (\S+ to \S+), (\S+ to \S+) and (\S+ to \S+) the batches per second", text)
    assert found is not None, "the README no longer quotes the DataLoader's figures"
    runs = [json.loads((RESULTS / name).read_text())["rows"] for name in LOADER_RUNS]
    for fields, quoted in zip((10, 100, 400), found.groups()):
        x = [
            r["x_default_collate"]
            for rows in runs
            for r in rows
            if r["tensors_per_sample"] == fields and r["contender"].startswith("todevice")
        ]
        assert quoted == _span(x), fields
