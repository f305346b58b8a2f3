"""bench/gpu_check.py, the one-call GPU check: on any machine, its steps and its report; its figures need a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.skipif(not (BENCH / "gpu_check.py").exists(), reason="not run from a checkout")
def test_the_gpu_check_runs_its_steps_into_one_json_and_refuses_an_unknown_step(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--out", str(tmp_path), "--only", "info"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert list(report["steps"]) == ["info"] and report["steps"]["info"]["exit_code"] == 0
    assert "todevice" in report["steps"]["info"]["tail"] and report["seconds"] > 0
    assert (tmp_path / "gpu-check.log").read_text().count("=====") == 1
    bad = subprocess.run([*cmd[:2], "--only", "nothing"], capture_output=True, text=True, timeout=60, cwd=BENCH.parent)
    assert bad.returncode == 2 and "no step nothing" in bad.stderr
