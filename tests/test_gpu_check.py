"""bench/gpu_check.py, the one-call GPU check: on any machine, its steps and its report; its figures need a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
pytestmark = pytest.mark.skipif(not (BENCH / "gpu_check.py").exists(), reason="not run from a checkout")


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_step_records_its_command_exit_code_seconds_and_output(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with open(log, "w") as out:
        ok = _script()._run([sys.executable, "-c", "print('written')"], 30, out)
        failed = _script()._run([sys.executable, "-c", "raise SystemExit(3)"], 30, out)
        stopped = _script()._run(
            [sys.executable, "-c", "import time; print('begun', flush=True); time.sleep(30)"], 1, out
        )
    assert ok["exit_code"] == 0 and ok["tail"] == "written\n" and ok["seconds"] >= 0
    assert failed["exit_code"] == 3
    assert stopped["exit_code"] is None and "begun" in stopped["tail"]  # stopped at its limit, its output kept
    assert log.read_text().count("=====") == 3


def test_the_steps_past_the_budget_are_recorded_as_skipped_and_an_unknown_step_is_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--out", str(tmp_path), "--only", "info,bench", "--budget", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr
    steps = json.loads((tmp_path / "gpu-check.json").read_text())["steps"]
    assert steps == {name: {"skipped": "the budget of 0 s was spent"} for name in ("info", "bench")}
    bad = subprocess.run([*cmd[:2], "--only", "nothing"], capture_output=True, text=True, timeout=60, cwd=BENCH.parent)
    assert bad.returncode == 2 and "no step nothing" in bad.stderr
