"""The integration examples of docs/examples run, and their batches arrive on the device.

Each example checks its batches with todevice.check() and exits non-zero when a tensor is elsewhere.
They run in a process of their own: they train, print, and change global state as scripts do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from todevice import _stream

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"

pytestmark = pytest.mark.skipif(not EXAMPLES.is_dir(), reason=f"no examples at {EXAMPLES}")

# Where the frameworks put a single-process run; each example prints "N steps on <device>".
DEVICE_TYPE = getattr(_stream.accelerator(), "type", "cpu")


def _needs(module: str) -> None:
    # find_spec rather than importorskip: importing Lightning or transformers here would cost seconds.
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_lightning_module(tmp_path: Path) -> None:
    _needs("pytorch_lightning")
    out = _run([str(EXAMPLES / "lightning_module.py")], tmp_path)
    assert re.search(rf"^4 steps on {DEVICE_TYPE}\b", out, re.MULTILINE), out
    assert not list(tmp_path.iterdir()), "the example wrote files: logs or checkpoints"


@pytest.mark.slow
def test_ddp_two_gloo_ranks(tmp_path: Path) -> None:
    # Hidden GPUs make both ranks CPU ranks on gloo, on any machine.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = _run([*torchrun, str(EXAMPLES / "ddp.py")], tmp_path, env)
    # Matched anywhere, not line by line: both ranks write to one pipe, and an unbuffered print
    # (PYTHONUNBUFFERED) writes its newline apart, so two lines can interleave, even run together
    # ("8 steps on cpurank 1: ..."): the device name ends where the other rank's line begins.
    found = re.findall(r"rank (\d): (\d+) steps on ([a-z]+?)(?=rank \d:|[^a-z]|$)", out)
    assert sorted(found) == [("0", "8", "cpu"), ("1", "8", "cpu")], out


@pytest.mark.slow
def test_accelerate_loop(tmp_path: Path) -> None:
    _needs("accelerate")
    out = _run([str(EXAMPLES / "accelerate_loop.py")], tmp_path)
    assert re.search(rf"^4 steps on {DEVICE_TYPE}\b", out, re.MULTILINE), out


@pytest.mark.slow
def test_hf_trainer(tmp_path: Path) -> None:
    _needs("transformers")
    out = _run([str(EXAMPLES / "hf_trainer.py")], tmp_path)
    assert re.search(rf"^4 steps on {DEVICE_TYPE}\b", out, re.MULTILINE), out


def test_cuda_graph_trains_on_a_gpu_or_says_why_not(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "cuda_graph.py"), "20"], tmp_path)
    if DEVICE_TYPE == "cuda":
        assert re.search(r"^20 steps on cuda: the StaticBatch's host time is \S+x less$", out, re.MULTILINE), out
    else:
        assert out == "No CUDA GPU on this machine: a CUDA graph needs one, so nothing was run.\n"
