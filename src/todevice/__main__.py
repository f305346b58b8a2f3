"""``python -m todevice info | bench``, and ``python -m todevice --version``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

import todevice
from todevice import _bench, _stream


def info() -> None:
    """What todevice sees on this machine."""
    acc = _stream.accelerator()
    why = _stream.no_pinned_memory()
    pinned = "yes" if why is None else f"no ({why})"
    print(f"todevice {todevice.__version__}")
    print(f"torch    {torch.__version__}")
    print(f"optree   {optree.__version__}")
    print(f"accelerators: {', '.join(_stream.available_devices()[1:-1]) or 'none'}")
    print(f"pinned memory: {pinned}")
    print(f"default device: {acc.type if acc is not None else 'cpu'}")


DEFAULTS = {"rounds": 30, "batches": 20}  # filled in after parsing, so --batches is refused with --device only if given
DEVICE_ROUNDS = 10  # --device runs at most this many rounds: its tables take minutes
# Without --rounds, a row of the first table whose rounds would take longer than this runs fewer (the 10,000-tensor
# rows: 0.1 to 0.4 s a round on a 2-core machine), which brings the default run to about 30 s there.
ROW_SECONDS = 1.0
# Without --batches, a DataLoader is timed for at most this long once _bench.host.MIN_BATCHES batches came:
# default_collate takes 0.25 s a batch at 400 tensors per sample on a 2-core machine, so 20 would take 5 s, twice.
LOADER_SECONDS = 1.0
TESTS_TIMEOUT = 240  # seconds for tests/test_accelerator.py, after the tables


def accelerator_bench(
    device: str, rounds: int, json_path: str | None, env: Mapping[str, Any], plot: str | None = None
) -> int:
    """``bench --device cuda``: the accelerator's tables over ``rounds`` rounds, then its tests, in one JSON report,
    and the picture of its size matrix where ``plot`` says.

    Returns:
        0; 1 where the tests failed or timed out, or the JSON could not be written; 2 for a device that is not an
        accelerator.
    """
    import os
    import subprocess
    import time

    try:
        dev = _stream.resolve_device(device)
    except (TypeError, ValueError) as err:
        print(f"python -m todevice bench: {err}", file=sys.stderr)
        return 2
    if not _stream.is_accelerator(dev):
        print(f"python -m todevice bench: --device must name an accelerator; {dev} is not one.", file=sys.stderr)
        return 2
    print(f"The accelerator's tables on {dev}: {rounds} rounds (--device runs at most {DEVICE_ROUNDS}).\n", flush=True)
    with _stream.on_device(dev):
        tables = _bench.gpu_main(rounds=rounds)
    sizes = next(iter(tables.values()))  # the size matrix: the first table, or why it did not run
    if plot is not None and isinstance(sizes, str):
        print(f"did not draw {plot}: the size matrix did not run ({sizes})")
    elif plot is not None:
        from todevice._bench import plot as picture

        picture.draw_device(sizes, plot, _machine(dev))
        print(f"drew {plot}")
    tests: dict[str, object] = {"skipped": "tests/test_accelerator.py is not here: run from a checkout"}
    passed = True
    if os.path.exists(os.path.join("tests", "test_accelerator.py")):
        print("tests/test_accelerator.py:", flush=True)
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_accelerator.py"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TESTS_TIMEOUT)
        except subprocess.TimeoutExpired as err:
            # What the tests wrote before they were stopped: bytes on POSIX, even with text=True.
            out = err.stdout or ""
            tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-3000:]
            if tail:
                print(tail, flush=True)
            tests = {"timed_out": True, "seconds": time.perf_counter() - start, "tail": tail}
            print(f"tests/test_accelerator.py: stopped after {TESTS_TIMEOUT} s, not finished.", flush=True)
            passed = False
        else:
            print(done.stdout[-3000:], flush=True)
            tests = {"exit_code": done.returncode, "seconds": time.perf_counter() - start, "tail": done.stdout[-3000:]}
            passed = done.returncode == 0
    result = {"device": str(dev), "tables": tables, "verdicts": tables["verdicts"], "tests": tests}
    written = _bench.write_json(json_path, result, env)
    return 0 if passed and written else 1


def bench(
    rounds: int,
    batches: int,
    json_path: str | None,
    env: Mapping[str, Any],
    plot: str | None = None,
    row_seconds: float | None = None,
    loader_seconds: float | None = None,
) -> int:
    """``bench``: the four host tables, each with its verdict, then the JSON report where ``--json`` says, and the
    size matrix's picture where ``--plot`` says. ``row_seconds``: the first table's time limit per row, and
    ``loader_seconds`` the DataLoader table's per loader, if any."""
    overhead = _bench.main(rounds=rounds, part=(1, 4), row_seconds=row_seconds)
    if plot is not None:
        from todevice._bench import plot as picture

        picture.draw(overhead["rows"], plot, _machine(None))
        print(f"drew {plot}")
    print()
    transfer = _bench.transfer_main(rounds=rounds, part=(2, 4))
    print()
    loader = _bench.loader_main(batches=batches, part=(3, 4), seconds=loader_seconds)
    print()
    guard = _bench.guard_main(part=(4, 4))
    verdicts = {**overhead["verdicts"], **transfer["verdicts"], **loader["verdicts"], **guard["verdicts"]}
    result = {
        "rows": overhead["rows"],
        "transfer": {"host": transfer["host"], "device": transfer["device"]},
        "loader": loader["rows"],
        "guard": guard["rows"],
        "verdicts": verdicts,
    }
    return 0 if _bench.write_json(json_path, result, env) else 1


def _callable(text: str) -> Any:
    """An argparse ``type=``: ``MODULE:CALLABLE``, imported (the current directory is on the path)."""
    import importlib

    module, sep, name = text.partition(":")
    if not sep or not module or not name:
        msg = f"expected MODULE:CALLABLE, such as my_batches:make_batch; got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        found: Any = importlib.import_module(module)
    except Exception as err:  # whatever the module raised as it was imported: its own words, on one line
        why = f"importing {module} raised {_one_line(err)}"
        if isinstance(err, ModuleNotFoundError) and err.name == module.partition(".")[0]:  # the module itself
            why = (
                f"there is no module {module} in the current folder ({os.getcwd()}) nor on the module path; run "
                f"from the folder that holds it, or add that folder to PYTHONPATH"
            )
        raise argparse.ArgumentTypeError(f"cannot load {text!r}: {why}") from err
    try:
        for part in name.split("."):
            found = getattr(found, part)
    except Exception as err:
        raise argparse.ArgumentTypeError(f"cannot load {text!r}: {_one_line(err)}") from err
    if not callable(found):
        raise argparse.ArgumentTypeError(f"{text!r} is a {type(found).__qualname__}, not a callable")
    return found


def _one_line(err: BaseException) -> str:
    """An exception as one line: its type and its message, line breaks and all runs of spaces made one space."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _machine(dev: torch.device | None) -> str:
    """The machine a picture was drawn on: the accelerator's name where there is one, the CPU's, and torch's release."""
    name = torch.cuda.get_device_name(dev) if dev is not None and dev.type == "cuda" else None
    return f"{name or _bench.cpu_model()}, torch {torch.__version__}"


def your_bench(
    make: Any, helper: Any, device: str | None, rounds: int, json_path: str | None, env: Any, plot: str | None = None
) -> int:
    """``bench --batch``: move() on the user's batch against their helper (or the hand-written one) and the peers."""
    import dataclasses

    from todevice._bench import yours

    batch = make()
    name = f"{yours._name(make)}()"
    try:
        report = yours.bench(batch, device, helper=helper, rounds=rounds, name=name)
    except (TypeError, ValueError) as err:
        print(f"python -m todevice bench: {err}", file=sys.stderr)
        return 2
    print(report, flush=True)
    if plot is not None:
        from todevice._bench import plot as picture

        picture.draw_yours(report, plot, _machine(None))
        print(f"drew {plot}")
    return 0 if _bench.write_json(json_path, {"yours": dataclasses.asdict(report)}, env) else 1


def _environment(given: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON's record of the machine and the options (the batch and helper as given, in its argv)."""
    return _bench.environment(given, {k: v for k, v in vars(args).items() if k not in ("command", "batch", "helper")})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m todevice", description=todevice.__doc__)
    parser.add_argument("--version", action="version", version=f"todevice {todevice.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench}")
    sub.add_parser("info", help="versions, accelerators, pinned memory and the default device")
    bench_parser = sub.add_parser(
        "bench", help="time move() against the helper and the peers, the transfer engine and the DataLoader"
    )
    budget = (
        f"; without --rounds, a row of the first table that would take over {ROW_SECONDS:g} s runs fewer, "
        f"at least {_bench.host.MIN_ROUNDS}"
    )
    for option, note in (
        ("rounds", f"{budget}; at most {DEVICE_ROUNDS} with --device"),
        (
            "batches",
            f"; without --batches, a loader stops after {LOADER_SECONDS:g} s once {_bench.host.MIN_BATCHES} came; "
            "not with --device",
        ),
    ):
        default = DEFAULTS[option]
        parse, text = _bench.OPTIONS[option]
        bench_parser.add_argument(
            f"--{option}", type=parse, default=None, metavar="N", help=f"{text} (default {default}{note})"
        )
    bench_parser.add_argument("--json", type=_bench.json_path, default=None, metavar="PATH", help=_bench.JSON_HELP)
    bench_parser.add_argument(
        "--device",
        default=None,
        help="an accelerator ('cuda'): its tables only (bandwidth, host time blocked, the prefetch loop, "
        f"device to host, into static buffers) over at most {DEVICE_ROUNDS} rounds, then tests/test_accelerator.py "
        "when run from a checkout; not with --batches, which is for the DataLoader table",
    )
    bench_parser.add_argument(
        "--plot",
        type=_bench.json_path,  # a file that can be written, checked before anything is timed
        default=None,
        metavar="FILE.png",
        help="also draw a picture of each contender's time over move()'s: the first table's, against the tensors in "
        "the batch (with --device, the accelerator's; with --batch, yours, by contender; "
        'needs matplotlib: pip install "todevice[plot]")',
    )
    bench_parser.add_argument(
        "--batch",
        type=_callable,
        default=None,
        metavar="MODULE:CALLABLE",
        help="time your own batch: a function of no arguments that returns one batch as your loop gets it; "
        "move() against --helper (or a hand-written helper) and the peers, to --device (the accelerator, else cpu)",
    )
    bench_parser.add_argument(
        "--helper",
        type=_callable,
        default=None,
        metavar="MODULE:CALLABLE",
        help="with --batch: your own helper, called as helper(batch, device); checked against move() first",
    )
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.command is None:
        parser.error("expected a command, info or bench, got none; for example: python -m todevice bench")
    if args.command == "info":
        info()
        return 0
    if args.plot is not None:
        from todevice._bench import plot as picture

        if not picture.available():
            bench_parser.error(f"argument --plot: {picture.NEEDS}")
    if args.helper is not None and args.batch is None:
        bench_parser.error("argument --helper: only with --batch, which names the batch to time it on")
    if args.batch is not None:
        if args.batches is not None:
            bench_parser.error("argument --batches: not with --batch, which times your batch, not the DataLoader")
        rounds = DEFAULTS["rounds"] if args.rounds is None else args.rounds
        return your_bench(args.batch, args.helper, args.device, rounds, args.json, _environment(given, args), args.plot)
    if args.device is not None and args.batches is not None:
        bench_parser.error(
            "argument --batches: not with --device, whose tables have no DataLoader; drop --batches, "
            "or drop --device for the host tables"
        )
    args.row_seconds = ROW_SECONDS if args.rounds is None and args.device is None else None
    args.loader_seconds = LOADER_SECONDS if args.batches is None and args.device is None else None
    args.rounds = DEFAULTS["rounds"] if args.rounds is None else args.rounds
    if args.device is None:
        args.batches = DEFAULTS["batches"] if args.batches is None else args.batches
    else:
        args.rounds = min(args.rounds, DEVICE_ROUNDS)  # the rounds that run, and that the JSON records
    env = _environment(given, args)
    if args.device is not None:
        return accelerator_bench(args.device, args.rounds, args.json, env, args.plot)
    return bench(args.rounds, args.batches, args.json, env, args.plot, args.row_seconds, args.loader_seconds)


if __name__ == "__main__":
    sys.exit(main())
