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
import time
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import todevice
from todevice import _bench, _stream
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
    # One verdict per table, printed under it and kept in the JSON; with an accelerator, one more per table
    # of its own that ran.
    device = data["transfer"]["device"]
    if _stream.accelerator() is None:
        assert isinstance(device, str) and "--device cuda" in device
        assert set(data["verdicts"]) == set(VERDICTS)
    else:
        ran = {title for title, rows in device.items() if title != "verdicts" and not isinstance(rows, str)}
        assert ran and set(data["verdicts"]) == set(VERDICTS) | ran
    lines = out.splitlines()
    for title, start in VERDICTS.items():
        assert data["verdicts"][title].startswith(start)
        # The project's targets for move() against the helper stay in the JSON; the reader gets the answer.
        assert (data["verdicts"][title] in lines) is (title not in (_bench.OVERHEAD, _bench.TRANSFER))
    assert "On this machine, the hand-written helper's time over move()'s, per batch (above 1.00x" in out
    assert any(line.startswith("- to cpu, where the tensors already are (the cost of looking at") for line in lines)
    assert any(line.startswith("On this machine's host, packing the small tensors into one buffer ") for line in lines)
    assert not any("not met" in line for line in lines)  # the project's targets are judged in the JSON only
    env = data["environment"]
    assert env["todevice"] == todevice.__version__ and env["torch"] == torch.__version__
    assert {"optree", "python", "platform", "cpu", "cpu_count", "accelerators"} <= set(env)
    assert env["cpu"] and env["cpu_count"] >= 1
    assert datetime.datetime.fromisoformat(env["date"]).utcoffset() == datetime.timedelta(0)
    assert env["argv"] == args
    assert env["options"] == {
        "rounds": 1,
        "batches": 2,
        "json": "out.json",
        "device": None,
        "plot": None,
        "row_seconds": None,
        "loader_seconds": None,
    }
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


@pytest.mark.usefixtures("nothing_timed")
@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("missing" + os.sep, "a file to write, got '{}', which ends in a path separator as a folder does; name a "),
        ("x" * 300 + ".json", "a file this user can write, got '{}', which cannot be opened for writing ("),
    ],
    ids=["a missing folder with a trailing separator", "a name too long to open"],
)
def test_bench_refuses_a_json_path_it_could_not_open_after_the_run(
    where: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / where) + (os.sep if where.endswith(os.sep) else "")
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--rounds", "1", "--json", path])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, f"argument --json: expected {expected.format(path)}")
    assert list(tmp_path.iterdir()) == []


def test_the_json_path_check_leaves_files_as_it_found_them(tmp_path: Path) -> None:
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("{}")
    assert _bench.json_path(str(new)) == str(new) and _bench.json_path(str(old)) == str(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"] and old.read_text() == "{}"


def gone_before_the_write(folder: Path, result: dict[str, Any]) -> Any:
    """A part of the benchmark that returns ``result`` after removing ``folder``, the --json file's."""

    def part(*args: Any, **kwargs: Any) -> dict[str, Any]:
        folder.rmdir()
        return result

    return part


def test_bench_prints_the_json_and_exits_1_when_the_file_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    path = str(folder / "out.json")
    for name, title in [("main", "overhead"), ("loader_main", "loader")]:
        monkeypatch.setattr(_bench, name, lambda title=title, **kwargs: {"rows": [title], "verdicts": {title: "v"}})
    monkeypatch.setattr(_bench, "transfer_main", lambda **kwargs: {"host": [], "device": "none", "verdicts": {}})
    monkeypatch.setattr(_bench, "guard_main", gone_before_the_write(folder, {"rows": [], "verdicts": {}}))
    assert main(["bench", "--json", path]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"error: could not write {path} (No such file or directory); the JSON follows on stdout instead"
    ]
    data = json.loads(out[out.index('{\n  "environment"') :])
    assert data["rows"] == ["overhead"] and data["verdicts"] == {"overhead": "v", "loader": "v"}
    assert list(tmp_path.iterdir()) == []
    # The scripts in bench/ too.
    folder.mkdir()
    with pytest.raises(SystemExit) as exit:
        _bench.script(None, gone_before_the_write(folder, {"rows": [1]}), ["--json", path], rounds=1)
    assert exit.value.code == 1
    out, err = capsys.readouterr()
    assert f"error: could not write {path} (" in err and json.loads(out)["rows"] == [1]


def on_an_accelerator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """``--device meta`` names an accelerator whose tables come back at once, run from tmp_path.

    Returns:
        The rounds of each run of the tables, as they run.
    """
    rounds_run: list[int] = []

    def gpu_main(rounds: int) -> dict[str, Any]:
        rounds_run.append(rounds)
        return {"t": [], "verdicts": {"t": "met"}}

    monkeypatch.setattr(_stream, "is_accelerator", lambda device: True)
    monkeypatch.setattr(_bench, "gpu_main", gpu_main)  # python -m todevice bench --device's
    monkeypatch.setattr(_bench.device, "gpu_main", gpu_main)  # the transfer table's, after the host's
    monkeypatch.chdir(tmp_path)
    return rounds_run


def test_accelerator_tests_that_time_out_keep_the_tables_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    on_an_accelerator(monkeypatch, tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_accelerator.py").write_text("")

    run = subprocess.run

    def slow(cmd: list[str], **kwargs: Any) -> Any:
        if "tests/test_accelerator.py" not in cmd:  # what the platform module runs to describe the machine
            return run(cmd, **kwargs)
        assert kwargs["timeout"] == 240
        raise subprocess.TimeoutExpired(cmd, 240, output=b"tests/test_accelerator.py ..")  # bytes, as on POSIX

    monkeypatch.setattr(subprocess, "run", slow)
    assert main(["bench", "--device", "meta", "--json", "out.json"]) == 1
    out = capsys.readouterr().out
    assert "tests/test_accelerator.py: stopped after 240 s, not finished." in out.splitlines()
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["tables"] == {"t": [], "verdicts": {"t": "met"}} and data["verdicts"] == {"t": "met"}
    tests = data["tests"]
    assert tests.pop("seconds") >= 0
    assert tests == {"timed_out": True, "tail": "tests/test_accelerator.py .."}


def test_bench_on_an_accelerator_records_the_rounds_it_runs_and_refuses_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rounds = on_an_accelerator(monkeypatch, tmp_path)
    assert main(["bench", "--device", "meta", "--json", "out.json"]) == 0
    assert main(["bench", "--device", "meta", "--rounds", "4", "--json", "four.json"]) == 0
    assert rounds == [10, 4]
    out = capsys.readouterr().out
    assert "The accelerator's tables on meta: 10 rounds (--device runs at most 10)." in out.splitlines()
    env = json.loads((tmp_path / "out.json").read_text())["environment"]
    options = {"rounds": 10, "batches": None, "json": "out.json", "device": "meta", "plot": None}
    options.update(row_seconds=None, loader_seconds=None)
    assert env["options"] == options
    assert json.loads((tmp_path / "four.json").read_text())["environment"]["options"]["rounds"] == 4
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--device", "meta", "--batches", "5"])
    assert exit.value.code == 2
    one_line_error(capsys.readouterr().err, "argument --batches: not with --device, whose tables have no DataLoader")
    assert rounds == [10, 4]


def test_bench_on_a_device_that_is_not_an_accelerator_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cpu"]) == 2
    assert "--device must name an accelerator; cpu is not one" in capsys.readouterr().err


def test_a_part_says_what_it_runs_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def rows(batches: int, seconds: float | None) -> list[dict[str, Any]]:
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

    monkeypatch.setattr(_bench.host, "loader_rows", rows)
    result = _bench.loader_main(batches=7, part=(3, 4))
    out = capsys.readouterr().out
    line = (
        "Against default_collate: todevice.collate() + prefetch(..., 'cpu') is faster at 1 of 2 sample sizes "
        "(10 tensors: 0.50x; 400 tensors: 40.00x); shared-memory blocks per batch: 1 against 11 to 401."
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
    assert result["answer"] in out and "Lightning" not in verdict


def overhead_row(target: str, tensors: int, x_helper: float, **peers: float) -> dict[str, Any]:
    return {
        "batch": f"{tensors} tensors",
        "target": target,
        "tensors": tensors,
        "x_vs_move": {"todevice.move": 1.0, "hand-written helper": x_helper, **peers},
        "target_x_helper": _bench._target(target, tensors),
    }


def _answer_row(batch: str, target: str, x: float, low: float, high: float) -> dict[str, Any]:
    return {
        "batch": batch,
        "target": target,
        "x_vs_move": {_bench.HELPER: x * 0.9},  # the ratio of the medians: the answer reads the per-round median
        "spread_vs_move": {_bench.HELPER: [low, x, high]},
    }


def test_the_answer_names_every_row_where_move_is_slower_beyond_its_spread() -> None:
    rows = [
        _answer_row("1 tensor", "meta", 0.76, 0.70, 0.80),
        _answer_row("flat dict, 10", "cpu", 2.17, 2.0, 2.3),
        _answer_row("[x, y]", "meta", 0.72, 0.69, 0.75),
        _answer_row("tokenizer dict", "cpu", 0.97, 0.90, 1.04),  # straddles 1.0x: neither slower nor faster
        _answer_row("flat dict, 100", "cpu", 4.07, 3.27, 4.76),
        _answer_row("flat dict, 10", "meta", 1.02, 0.98, 1.10),
    ]
    head = (
        "On this machine, the hand-written helper's time over move()'s, per batch (above 1.00x, move() is faster; "
        "the median of the rounds, with their middle half in brackets):"
    )
    assert _bench.answer(rows).splitlines() == [
        head,
        "- to meta, every tensor copied with no data (the cost of the copies' bookkeeping): move() is slower for 2 "
        "of 3: [x, y], 0.72x (0.69x to 0.75x); 1 tensor, 0.76x (0.70x to 0.80x). No measurable difference for 1 "
        "of 3: flat dict, 10.",
        "- to cpu, where the tensors already are (the cost of looking at the batch): move() is faster for 2 of 3 "
        "batches: 2.17x (2.00x to 2.30x) for flat dict, 10, up to 4.07x (3.27x to 4.76x) for flat dict, 100. No "
        "measurable difference for 1 of 3: tokenizer dict.",
    ]
    assert _bench.answer(rows[1:2]).splitlines()[1] == (
        "- to cpu, where the tensors already are (the cost of looking at the batch): move() is faster for 1 of 1 "
        "batches: 2.17x (2.00x to 2.30x) for flat dict, 10."
    )
    assert "slower" not in _bench.answer(rows[3:4])


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
            ("todevice.StaticBatch: feed(batch)", 50.0, 0.4),
            ("move(batch, out=static)", 240.0, 2.0),
            ("per-tensor copy_()", 120.0, 1.0),
        ]
    ]
    assert _bench.transfer_verdict(host) == (
        "Target: pack(batch).unpack() and move(batch, 'meta', coalesce=True) at most 1.5x per-leaf .to('meta'): "
        "not met (pack(batch).unpack(): 1.40x; move(batch, 'meta', coalesce=True): 1.60x).\n"
        "Target: a StaticBatch step at least 4x less host time than a copy_() per tensor and 2x less than "
        "move(batch, out=static), into static CPU buffers: not met (2.50x and 5.00x less; 50, 240 and 120 us)."
    )
    assert _bench.transfer_answer(host) == (
        "On this machine's host, packing the small tensors into one buffer (coalesce=True) takes 1.60x (1.60x to "
        "1.60x) the time of a .to('meta') per tensor (pack().unpack(): 1.40x (1.40x to 1.40x)). A copy to 'meta' "
        "moves no data, so these figures are the host's bookkeeping alone; on a GPU, where each copy costs a launch, "
        "the one buffer crosses in one copy instead of one per tensor: python -m todevice bench --device cuda "
        "measures that. Into static CPU buffers, a StaticBatch step takes 0.40x (0.40x to 0.40x) the time of a "
        "copy_() per tensor and move(batch, out=static) 2.00x (2.00x to 2.00x) (50, 240 and 120 us)."
    )
    host[3]["x_per_leaf_to"] = 0.24
    assert _bench.transfer_verdict(host).endswith(
        "into static CPU buffers: met (4.17x and 8.33x less; 50, 240 and 120 us)."
    )
    guard = [
        {"contender": name, "median_us": us, "overhead_us": us - 80.0, "overhead_us_per_hook": (us - 80.0) / 8}
        for name, us in [("no guard", 80.0), ("guard(model)", 96.0), ("guard removed", 80.4)]
    ]
    assert _bench.guard_verdict(guard) == (
        "Against no guard (80.0 us a forward): guard(model) adds +16.0 us (+20.0%), +2.00 us per guarded module; "
        "once removed, it adds +0.4 us (+0.5%)."
    )


def device_rows(x_leaf: float, x_single: float) -> list[dict[str, Any]]:
    """Rows of the host-to-device table: the pinned copy, then move() and per-leaf .to() on two workloads."""
    rows: list[dict[str, Any]] = [
        {"workload": "one pinned 128 MiB copy", "contender": "tensor.to()", "ms": 5.0, "gb_per_s": 26.8}
        | {"x_single_copy": 1.0, "x_per_leaf_to": None}
    ]
    for workload in ("1,000 x 4 KiB", "8 x 16 MiB"):
        for kind, scale in (("pageable", 1.0), ("pinned", 1.5)):
            for contender, x in (("todevice.move", scale), ("per-leaf .to(non_blocking=True)", 1.0)):
                rows.append(
                    {
                        "workload": f"{workload}, {kind}",
                        "contender": contender,
                        "ms": 1.0,
                        "gb_per_s": 1.0,
                        "x_single_copy": x * x_single / 1.5 if contender == "todevice.move" else 0.5,
                        "x_per_leaf_to": x * x_leaf if contender == "todevice.move" else 1.0,
                    }
                )
    return rows


def test_the_accelerator_verdicts_are_computed_from_the_rows() -> None:
    assert _bench.to_device_verdict(device_rows(x_leaf=12.0, x_single=0.9)) == (
        "Target: move() at least 10x faster than per-leaf .to() at 1,000 small tensors, end to end: met "
        "(1,000 x 4 KiB, pageable: 12.0x; 1,000 x 4 KiB, pinned: 18.0x). Target: move() of 8 x 16 MiB, pinned or "
        "staged, at least 80% of one pinned copy of the same bytes: not met (8 x 16 MiB, pageable: 60%; "
        "8 x 16 MiB, pinned: 90%)."
    )
    assert _bench.to_device_verdict(device_rows(x_leaf=8.0, x_single=1.35)).split(". Target: ") == [
        "Target: move() at least 10x faster than per-leaf .to() at 1,000 small tensors, end to end: not met "
        "(1,000 x 4 KiB, pageable: 8.0x; 1,000 x 4 KiB, pinned: 12.0x)",
        "move() of 8 x 16 MiB, pinned or staged, at least 80% of one pinned copy of the same bytes: met "
        "(8 x 16 MiB, pageable: 90%; 8 x 16 MiB, pinned: 135%).",
    ]
    blocked = [
        {"workload": f"8 x 16 MiB {kind}, 50 ms of work queued", "contender": name, "host_ms": ms}
        for kind, name, ms in [
            ("pageable", "todevice.move", 12.5),
            ("pageable", "per-leaf .to(non_blocking=True)", 55.0),
            ("pinned", "todevice.move", 30.0),  # not judged: the target is for pageable tensors
        ]
    ]
    blocked[0]["host_ms"] = 8.5
    claim = "move() of 8 x 16 MiB pageable tensors blocks the host under 10 ms while 50 ms of work is queued"
    assert (
        _bench.blocked_verdict(blocked) == f"Target: {claim}: met (8 x 16 MiB pageable, 50 ms of work queued: 8.5 ms)."
    )
    blocked[0]["host_ms"] = 12.5
    assert _bench.blocked_verdict(blocked).startswith(f"Target: {claim}: not met (")
    prefetch = [
        {"workload": f"20 steps, {kind}", "contender": name, "ms": 100 * x, "x_timm_style": x}
        for kind, name, x in [
            ("pageable", "todevice.prefetch", 1.04),
            ("pageable", "timm-style prefetcher", 1.0),
            ("pinned", "todevice.prefetch", 0.97),
            ("pinned", "timm-style prefetcher", 1.0),
        ]
    ]
    claim = "the 20-step loop with prefetch() within 10% of the timm-style prefetcher's time"
    assert (
        _bench.prefetch_verdict(prefetch)
        == f"Target: {claim}: met (20 steps, pageable: 1.04x; 20 steps, pinned: 0.97x)."
    )
    prefetch[2]["x_timm_style"] = 1.15
    assert _bench.prefetch_verdict(prefetch).startswith(f"Target: {claim}: not met (")


def test_the_way_back_is_judged_on_its_three_targets() -> None:
    def rows(scalars: float, mixed: float, fifty: float, item_ms: float) -> list[dict[str, Any]]:
        return [
            {"workload": "50 scalars, a dict", "contender": "todevice.move", "ms": 0.3, "x_per_leaf_cpu": fifty},
            {"workload": "50 scalars, a dict", "contender": "per-leaf .item()", "ms": item_ms, "x_per_leaf_cpu": 1.4},
            {"workload": "1,000 scalars, a dict", "contender": "todevice.move", "ms": 2.0, "x_per_leaf_cpu": scalars},
            {"workload": "1,000 nested: mixed", "contender": "todevice.move", "ms": 2.5, "x_per_leaf_cpu": mixed},
        ]

    line = _bench.to_host_verdict(rows(6.5, 5.2, 2.1, 0.45))
    assert line.count(": met (") == 4 and "not met" not in line
    assert "50 scalars faster than a loop of .item(): met (50 scalars, a dict: 1.50x)" in line
    line = _bench.to_host_verdict(rows(5.9, 5.2, 2.1, 0.25))
    assert line.count(": not met (") == 2
    assert "1,000 scalars at least 6x faster than per-leaf .cpu(): not met (1,000 scalars, a dict: 5.9x)" in line
    assert "faster than a loop of .item(): not met (50 scalars, a dict: 0.83x)" in line


def size_rows(x: float) -> list[dict[str, Any]]:
    """The size matrix as size_rows() reports it, move() at ``x`` times the helper's speed in every cell."""
    rows = []
    for name, tensors in [("1 tensor", 1), ("tokenizer dict", 3), ("10 x", 10), ("100 x", 100), ("1,000 x", 1000)]:
        for memory in ("pageable", "pinned", "on the device"):
            for contender, ratio in [("todevice.move", x), (_bench.HELPER, 1.0), ("Lightning", 0.8)]:
                cell = {"workload": f"{name}, {memory}", "memory": memory, "tensors": tensors, "contender": contender}
                ratios = {"x_helper_host": ratio, "x_helper_e2e": ratio + 0.1, "x_helper_min": ratio}
                rows.append({**cell, "host_ms": 1.0, "e2e_ms": 1.0, **ratios})
    return rows


def test_the_size_matrix_is_judged_on_each_target_from_the_lower_ratio() -> None:
    rows = size_rows(2.6)
    line = _bench.size_verdict(rows)
    claims = [
        "move() of 1 to 3 tensors, pageable and pinned at least 0.9x the helper's speed, host time and end to end",
        "move() of 10 tensors, pageable and pinned at least 1.0x the helper's speed, host time and end to end",
        "move() of 100 and 1,000 tensors at least 2.5x the helper's speed, host time and end to end",
        "move() of 1 to 10 tensors already on the device at least 0.8x the helper's speed, host time and end to end",
    ]
    assert [part.split(": ")[0] for part in line.split("Target: ")[1:]] == claims
    assert line.count(": met (") == 4 and "1 tensor, pageable: 2.60x" in line and "Lightning" not in line
    assert "1,000 x, on the device" not in line  # on the device, only 1 to 10 tensors are judged
    slow = [dict(r, x_helper_min=0.85) if r["workload"] == "tokenizer dict, pinned" else r for r in rows]
    assert _bench.size_verdict(slow).count(": not met (") == 1


def test_the_queued_and_loop_tables_are_judged_on_their_targets() -> None:
    queued = [
        {"workload": f"{name}, {memory}, 5 ms queued", "contender": c, "host_ms": 1.0, "x_helper_host": x}
        for name, memory, c, x in [
            ("1 tensor (32 x 10)", "pageable", "todevice.move", 0.95),
            ("tokenizer dict", "pinned", "todevice.move", 0.92),
            ("(images, labels): 19 MB", "pageable", "todevice.move", 5.0),
            ("(images, labels): 19 MB", "pinned", "todevice.move", 0.5),  # not judged: the 4x is for pageable
            ("1 tensor (32 x 10)", "pageable", _bench.HELPER, 1.0),
        ]
    ]
    line = _bench.queued_verdict(queued)
    assert line.count(": met (") == 2 and "pinned, 5 ms queued: 0.50x" not in line
    queued[1]["x_helper_host"] = 0.8
    assert line != _bench.queued_verdict(queued) and _bench.queued_verdict(queued).count(": not met (") == 1
    loop = [
        {"workload": f"40 steps, {name}, pageable", "contender": c, "ms": 100.0, "x_helper_time": x}
        for name, c, x in [
            ("tokenizer dict: 2 x 32 x 512", "todevice.move", 1.02),
            ("(images, labels): 19 MB", "todevice.move", 0.6),
            ("(images, labels): 19 MB", "todevice.prefetch", 0.55),
        ]
    ]
    assert _bench.loop_verdict(loop) == (
        "Target: the loop on tokenizer dict with move() at most 1.03x the helper's time: met (40 steps, tokenizer "
        "dict: 2 x 32 x 512, pageable: 1.02x). Target: the loop on (images, labels) with move() at most 0.65x the "
        "helper's time: met (40 steps, (images, labels): 19 MB, pageable: 0.60x)."
    )


def test_every_accelerator_table_that_runs_is_judged_below_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made = {
        "size_rows": size_rows(1.2),
        "queued_rows": [
            {"workload": "1 tensor, pageable", "contender": "todevice.move", "host_ms": 0.1, "x_helper_host": 1.0}
        ],
        "loop_rows": "needs a CUDA GPU (these rows keep it busy while they time the host)",
        "device_rows": device_rows(x_leaf=12.0, x_single=0.9),
        "blocked_rows": [{"workload": "8 x 16 MiB pageable", "contender": "todevice.move", "host_ms": 3.0}],
        "prefetch_rows": [{"workload": "20 steps", "contender": "todevice.prefetch", "ms": 9.0, "x_timm_style": 1.0}],
        "device_to_host_rows": [
            {"workload": "1,000", "tensors": 1000, "contender": "todevice.move", "ms": 1.0, "x_per_leaf_cpu": 20.0}
        ],
        "static_rows": "no accelerator on this machine",
    }
    for name, rows in made.items():
        monkeypatch.setattr(_bench.device, name, lambda rounds, rows=rows: rows)
    result = _bench.gpu_main(rounds=1)
    lines = capsys.readouterr().out.splitlines()
    judged = [title for title, rows in result.items() if title != "verdicts" and not isinstance(rows, str)]
    assert len(judged) == 6 and set(result["verdicts"]) == set(judged)
    for title in judged:
        line = result["verdicts"][title]
        assert line.startswith("Target: ") and " met (" in line and line in lines
        assert lines.index(f"{title}:") < lines.index(line)
    assert "skipped: no accelerator on this machine" in lines
    assert "skipped: needs a CUDA GPU (these rows keep it busy while they time the host)" in lines


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


class _InProcessLoader:
    """A DataLoader that collates in this process: the table's timing loop, without starting workers."""

    def __init__(self, data: Any, batch_size: int, collate_fn: Any = None, **_: Any) -> None:
        from torch.utils.data import default_collate

        self.data, self.size, self.collate = data, batch_size, collate_fn or default_collate

    def __iter__(self) -> Any:
        for start in range(0, len(self.data), self.size):
            yield self.collate([self.data[i] for i in range(start, start + self.size)])


@pytest.mark.parametrize(("seconds", "timed"), [(0.0, _bench.host.MIN_BATCHES), (None, 6)])
def test_a_loader_stops_once_its_time_is_up_and_its_least_batches_came(
    monkeypatch: pytest.MonkeyPatch, seconds: float | None, timed: int
) -> None:
    monkeypatch.setattr(torch.utils.data, "DataLoader", _InProcessLoader)
    rows = _bench.loader_rows(batches=7, batch_size=2, seconds=seconds)  # the first batch is not timed: 6 are
    assert [r["batches_timed"] for r in rows] == [timed] * 6


def test_a_row_runs_fewer_rounds_where_its_rounds_would_pass_its_time_but_never_under_the_least() -> None:
    def slow() -> None:
        time.sleep(0.02)

    assert _bench.host._rounds({"a": slow}, 30, None) == 30  # no time limit: every round
    assert _bench.host._rounds({"a": slow, "b": slow}, 30, 0.2) == _bench.host.MIN_ROUNDS  # 0.04 s a round
    assert _bench.host._rounds({"a": slow}, 30, 0.5) == pytest.approx(23, abs=4)  # about 25 fit
    assert _bench.host._rounds({"a": lambda: None}, 30, 1.0) == 30
    assert _bench.host._rounds({"a": slow}, 4, 0.0) == 4  # asked for fewer than the least: as asked


def test_without_rounds_or_batches_the_bench_limits_rows_and_loaders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def bench(*args: Any) -> int:
        seen["args"] = args
        return 0

    monkeypatch.setattr(todevice.__main__, "bench", bench)
    assert main(["bench"]) == 0
    assert seen["args"][:2] == (30, 20) and seen["args"][-2:] == (1.0, 1.0)
    assert main(["bench", "--rounds", "5", "--batches", "3"]) == 0
    assert seen["args"][:2] == (5, 3) and seen["args"][-2:] == (None, None)
