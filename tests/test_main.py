"""``python -m todevice info | bench | --version`` and the scripts in bench/, run as a user runs them.

Two tests start a Python process of their own, as a user does. The rest call the same entry points
in this process, which saves the second or more that a new process spends importing torch.
"""

from __future__ import annotations

import datetime
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import todevice
from todevice import _bench
from todevice.__main__ import main

BENCH = Path(__file__).resolve().parent.parent / "bench"
OURS = "todevice.collate() + prefetch(..., 'cpu')"
PARTS = ("main", "transfer_main", "loader_main", "guard_main", "gpu_main", "run", "loader_rows", "guard_rows")
VERDICTS = {  # each table's title, and how its verdict line starts
    "move() against the hand-written helper and the peers": (
        "Target: move() at or above each row's target against the hand-written helper: "
    ),
    "Transfer engine, host side": (
        "Target: pack(batch).unpack() and move(batch, 'meta', coalesce=True) at most 1.5x per-leaf .to('meta'): "
    ),
    "DataLoader": f"Against default_collate: {OURS} is faster at ",
    "guard() overhead": "Against no guard (",
}


def one_line_error(err: str, expected: str) -> None:
    """argparse's usage, then one line naming the error; no traceback."""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1]
    assert expected in errors[0]


@pytest.fixture
def nothing_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part of the benchmark fails the test if it starts."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a part of the benchmark started")

    for name in PARTS:
        monkeypatch.setattr(_bench, name, timed)


# ---------------------------------------------------------------- in a process of its own


def test_bench_prints_tables_progress_and_verdicts_and_writes_json_from_any_directory(tmp_path: Path) -> None:
    args = ["bench", "--rounds", "1", "--batches", "2", "--json", "out.json"]
    done = subprocess.run(
        [sys.executable, "-m", "todevice", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out, err = done.stdout, done.stderr
    assert "| nested with a dataclass, 1,000 | cpu |" in out
    assert "| 1 tensor | meta |" in out
    assert "| 100 | todevice.collate() + prefetch(..., 'cpu') |" in out
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert [line[:5] for line in progress] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert progress[2].startswith("[3/4] DataLoader: 2 workers, 3 sample sizes") and progress[2].endswith(" ...")
    assert "[1/4]" not in out and "Traceback" not in err
    data = json.loads((tmp_path / "out.json").read_text())
    assert sorted(os.listdir(tmp_path)) == ["out.json"]
    cells = {(r["batch"], r["target"]) for r in data["rows"]}
    assert ("tokenizer dict (3 keys)", "cpu") in cells and ("flat dict, 10,000", "meta") in cells
    assert all(r["median_us"]["todevice.move"] > 0 and r["median_us"]["hand-written helper"] > 0 for r in data["rows"])
    assert all(r["tensors_on_target"]["todevice.move"] == r["tensors"] for r in data["rows"])
    assert {r["contender"] for r in data["transfer"]["host"]} >= {"pack(batch).unpack()", "per-leaf .to('meta')"}
    assert {r["tensors_per_sample"] for r in data["loader"]} == {10, 100, 400}
    assert {r["contender"] for r in data["guard"]} == {"no guard", "guard(model)", "guard removed"}
    # One verdict per table, printed under it and kept in the JSON.
    assert set(data["verdicts"]) == set(VERDICTS)
    lines = out.splitlines()
    for title, start in VERDICTS.items():
        assert data["verdicts"][title].startswith(start) and data["verdicts"][title] in lines
    env = data["environment"]
    assert env["todevice"] == todevice.__version__ and env["torch"] == torch.__version__
    assert {"optree", "python", "platform", "cpu", "cpu_count", "accelerators"} <= set(env)
    assert env["cpu"] and env["cpu_count"] >= 1
    assert datetime.datetime.fromisoformat(env["date"]).utcoffset() == datetime.timedelta(0)
    assert env["argv"] == args
    assert env["options"] == {"rounds": 1, "batches": 2, "json": "out.json", "device": None}
    assert set(env["peers"]) == {"Lightning", "accelerate"}
    assert env["peers"]["Lightning"]["package"] == "pytorch-lightning"


def test_a_bad_argument_is_one_line_of_error_and_status_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "todevice", "bench", "--rounds", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stdout == ""
    one_line_error(done.stderr, "argument --rounds: expected a whole number of at least 1")


# ---------------------------------------------------------------- in this process


def test_info_prints_versions_accelerators_pinning_and_default_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch    {torch.__version__}" in out
    assert "optree   " in out
    assert "accelerators: " in out
    assert "pinned memory: " in out
    assert "default device: " in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"todevice {todevice.__version__}\n"


def test_no_command_is_one_line_of_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main([])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, "expected a command, info or bench, got none")


@pytest.mark.usefixtures("nothing_timed")
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--rounds", "0"], "argument --rounds: expected a whole number of at least 1 (each figure is a median"),
        (["--rounds", "-3"], "argument --rounds: expected a whole number of at least 1"),
        (["--rounds", "2.5"], "got '2.5'; pass --rounds 1 or more"),
        (["--batches", "1"], "argument --batches: expected a whole number of at least 2 (the first batch only"),
        (["--batches", "0"], "got '0'; pass --batches 2 or more"),
        (["--device", "cuda", "--rounds", "0"], "argument --rounds: expected a whole number of at least 1"),
    ],
)
def test_bench_refuses_too_few_rounds_or_batches(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["bench", *args])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, expected)


@pytest.mark.usefixtures("nothing_timed")
@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("missing/out.json", "expected a file in an existing folder, got "),
        ("", "expected a file to write, got the folder "),
    ],
)
def test_bench_checks_the_json_path_before_anything_is_timed(
    where: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--rounds", "1", "--json", str(tmp_path / where)])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, f"argument --json: {expected}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("nothing_timed")
def test_bench_refuses_a_json_path_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a folder of another user's, even for root
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--device", "cuda", "--json", str(tmp_path / "out.json")])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, "which it cannot write (permission denied)")


def test_bench_on_a_device_that_is_not_an_accelerator_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cpu"]) == 2
    assert "--device must name an accelerator; cpu is not one" in capsys.readouterr().err


def test_a_part_says_what_it_runs_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def rows(batches: int) -> list[dict[str, Any]]:
        assert capsys.readouterr().err == "[3/4] DataLoader: 2 workers, 3 sample sizes, 3 loaders each, " + (
            f"{batches} batches per loader ...\n"
        )
        return [
            {
                "tensors_per_sample": n,
                "contender": c,
                "batches_per_s": r,
                "x_default_collate": x,
                "segments_per_batch": s,
            }
            for n, c, r, x, s in [
                (10, "default_collate", 200.0, 1.0, 11),
                (10, OURS, 100.0, 0.5, 1),
                (400, "default_collate", 6.0, 1.0, 401),
                (400, OURS, 240.0, 40.0, 1),
            ]
        ]

    monkeypatch.setattr(_bench, "loader_rows", rows)
    result = _bench.loader_main(batches=7, part=(3, 4))
    out = capsys.readouterr().out
    line = (
        "Against default_collate: todevice.collate() + prefetch(..., 'cpu') is faster at 1 of 2 sample sizes "
        "(10 tensors: 0.50x; 400 tensors: 40.00x); segments per batch: 1 against 11 to 401."
    )
    assert result["verdicts"] == {"DataLoader": line}
    assert out.splitlines()[-1] == line
    assert "| 400 | todevice.collate() + prefetch(..., 'cpu') | 240 | 40.00x | 1 |" in out


def test_peers_not_installed_are_named_with_how_to_install_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "lightning_fabric.utilities.apply_func", None)  # import fails
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    result = _bench.main(rounds=1, sizes=())
    out = capsys.readouterr().out
    note = (
        "Not installed, so not timed: Lightning (pip package pytorch-lightning), accelerate (pip package "
        'accelerate). To time them too: pip install ".[bench]" from a clone of todevice, or pip install '
        "pytorch-lightning accelerate."
    )
    assert note in out.splitlines()
    assert "| Lightning |" not in out and "| accelerate |" not in out
    assert set(result["rows"][0]["median_us"]) == {"todevice.move", "hand-written helper", "optree.tree_map"}
    verdict = result["verdicts"]["move() against the hand-written helper and the peers"]
    assert verdict in out.splitlines() and "Lightning" not in verdict


def overhead_row(target: str, tensors: int, x_helper: float, **peers: float) -> dict[str, Any]:
    return {
        "batch": f"{tensors} tensors",
        "target": target,
        "tensors": tensors,
        "x_vs_move": {"todevice.move": 1.0, "hand-written helper": x_helper, **peers},
        "target_x_helper": _bench._target(target, tensors),
    }


def test_the_verdicts_are_computed_from_the_rows() -> None:
    rows = [
        overhead_row("cpu", 1, 0.80, Lightning=3.0),
        overhead_row("cpu", 10, 1.50, Lightning=2.0),
        overhead_row("cpu", 1000, 2.50),
        overhead_row("meta", 100, 0.95, Lightning=1.5),
    ]
    assert _bench.overhead_verdict(rows) == (
        "Target: move() at or above each row's target against the hand-written helper: met, 4 of 4 rows met "
        "(cpu, 1 tensor, >= 0.75x: 0.80x, 1 of 1 met; cpu, 10 tensors, >= 1.00x: 1.50x, 1 of 1 met; "
        "cpu, 1,000 tensors, >= 2.00x: 2.50x, 1 of 1 met; meta, 100 tensors, >= 0.90x: 0.95x, 1 of 1 met); "
        "move() is faster than Lightning in 3 of 3 rows (1.50x to 3.00x)."
    )
    rows[2] = overhead_row("cpu", 100, 1.90)
    assert _bench.overhead_verdict(rows).startswith(
        "Target: move() at or above each row's target against the hand-written helper: not met, 3 of 4 rows met "
        "(cpu, 1 tensor, >= 0.75x: 0.80x, 1 of 1 met; cpu, 10 tensors, >= 1.00x: 1.50x, 1 of 1 met; "
        "cpu, 100 tensors, >= 2.00x: 1.90x, 0 of 1 met;"
    )
    host = [
        {"contender": name, "median_us": us, "x_per_leaf_to": x}
        for name, us, x in [
            ("pack(batch).unpack()", 1400.0, 1.4),
            ("per-leaf .to('meta')", 1000.0, 1.0),
            ("move(batch, 'meta', coalesce=True)", 1600.0, 1.6),
            ("move(batch, out=static)", 180.0, 2.84),
            ("per-tensor copy_() into meta", 63.0, 1.0),
        ]
    ]
    assert _bench.transfer_verdict(host) == (
        "Target: pack(batch).unpack() and move(batch, 'meta', coalesce=True) at most 1.5x per-leaf .to('meta'): "
        "not met (pack(batch).unpack(): 1.40x; move(batch, 'meta', coalesce=True): 1.60x); move(batch, out=static) "
        "took 180 us against 63 us for per-tensor copy_() into meta (2.84x), which has no target on the host."
    )
    guard = [
        {"contender": name, "median_us": us, "overhead_us": us - 80.0, "overhead_us_per_hook": (us - 80.0) / 8}
        for name, us in [("no guard", 80.0), ("guard(model)", 96.0), ("guard removed", 80.4)]
    ]
    assert _bench.guard_verdict(guard) == (
        "Against no guard (80.0 us a forward): guard(model) adds +16.0 us (+20.0%), +2.00 us per guarded module; "
        "once removed, it adds +0.4 us (+0.5%)."
    )


def test_the_json_holds_the_versions_the_machine_the_date_and_the_arguments(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    env = _bench.environment(["--rounds", "3"], {"rounds": 3, "json": str(path)})
    _bench.write_json(str(path), {"rows": [], "verdicts": {"t": "v"}}, env)
    data = json.loads(path.read_text())
    assert data["verdicts"] == {"t": "v"}
    assert set(data["environment"]) >= {
        "todevice", "torch", "optree", "python", "platform", "cpu", "cpu_count", "date", "argv", "options", "peers",
    }  # fmt: skip
    assert data["environment"]["argv"] == ["--rounds", "3"] and data["environment"]["options"]["rounds"] == 3
    assert data["environment"]["optree"] == optree.__version__


# ---------------------------------------------------------------- the scripts in bench/


def run_script(name: str, *args: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python bench/<name> ARGS`` from the current directory, as a user runs it."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(BENCH / name), run_name="__main__")


def test_a_script_runs_from_any_directory_and_writes_no_json_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded = {p: p.read_bytes() for p in (BENCH / "results").glob("*.json")}
    monkeypatch.chdir(tmp_path)
    run_script("bench_guard.py", "--rounds", "1", monkeypatch=monkeypatch)
    captured = capsys.readouterr()
    assert "| guard(model) |" in captured.out and "wrote" not in captured.out
    assert captured.out.splitlines()[-1].startswith(VERDICTS["guard() overhead"])
    assert captured.err == "[1/1] guard() overhead: 3 models, 1 round ...\n"
    assert list(tmp_path.iterdir()) == []
    assert {p: p.read_bytes() for p in (BENCH / "results").glob("*.json")} == recorded
    run_script("bench_guard.py", "--rounds", "1", "--json", "guard.json", monkeypatch=monkeypatch)
    data = json.loads((tmp_path / "guard.json").read_text())
    assert set(data) == {"environment", "rows", "verdicts"}
    assert data["environment"]["argv"] == ["--rounds", "1", "--json", "guard.json"]


@pytest.mark.usefixtures("nothing_timed")
@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("bench_overhead.py", ["--rounds", "0"], "argument --rounds: expected a whole number of at least 1"),
        ("bench_transfer.py", ["--rounds", "0"], "argument --rounds: expected a whole number of at least 1"),
        ("bench_guard.py", ["--rounds", "x"], "argument --rounds: expected a whole number of at least 1"),
        ("bench_loader.py", ["--batches", "1"], "argument --batches: expected a whole number of at least 2"),
        ("bench_loader.py", ["--json", "."], "argument --json: expected a file to write, got the folder '.'"),
    ],
)
def test_a_script_refuses_a_bad_argument_in_one_line(
    name: str,
    args: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit:
        run_script(name, *args, monkeypatch=monkeypatch)
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, expected)
