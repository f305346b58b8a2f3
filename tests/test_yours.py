"""todevice.bench and ``python -m todevice bench --batch``: the user's batch and helper, checked, then timed."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, strategies as st

import todevice
from todevice._bench import yours


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor


def make_batch() -> dict[str, Any]:
    return {"sample": Sample(torch.randn(4, 3), torch.arange(4)), "ids": [torch.ones(2), "x"]}


def right(batch: Any, device: Any) -> Any:
    s = batch["sample"]
    return {"sample": Sample(s.image.to(device), s.label.to(device)), "ids": [batch["ids"][0].to(device), "x"]}


def drops_the_dataclass(batch: Any, device: Any) -> Any:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_a_helper_that_gives_move_s_result_is_timed_against_move() -> None:
    report = todevice.bench(make_batch(), "meta", helper=right, rounds=3, name="make_batch()")
    assert report.helper.startswith("your helper (") and "right" in report.helper
    assert report.helper not in report.wrong
    timed = {row.contender for row in report.rows}
    assert {"todevice.move", report.helper} <= timed
    helper_row = next(row for row in report.rows if row.contender == report.helper)
    assert helper_row.speedup == helper_row.low == helper_row.high == 1.0  # the yardstick against itself
    assert all(row.host_us > 0 and row.end_to_end_us >= row.host_us for row in report.rows)
    text = str(report)
    assert text.startswith("make_batch() (dict, 3 tensors, ") and "moved to meta" in text
    assert "move() against your helper" in text


def test_a_helper_whose_result_differs_is_reported_and_not_timed() -> None:
    report = todevice.bench(make_batch(), "meta", helper=drops_the_dataclass, rounds=3)
    (name,) = [n for n in report.wrong if "drops_the_dataclass" in n]
    assert report.wrong[name].startswith("['sample'].image is a torch.float32 tensor of shape (4, 3) on cpu")
    assert name not in {row.contender for row in report.rows}
    assert report.helper == "todevice.move"  # the ratios are to move() then
    assert "The helper was not timed" in str(report) and f"differs from move()'s: {name}" in str(report)
    assert "| vs move() |" in str(report) and "vs helper" not in str(report)


def test_a_helper_that_raises_is_reported_with_its_error() -> None:
    def broken(batch: Any, device: Any) -> Any:
        raise RuntimeError("no such device")

    report = todevice.bench(make_batch(), "meta", helper=broken, rounds=3)
    assert any(why == "it raised RuntimeError: no such device" for why in report.wrong.values())


def _fixed(image: torch.Tensor | None = None, sample: Any = Sample, ids: Any = ("x",)) -> dict[str, Any]:
    image = torch.arange(12.0).reshape(4, 3) if image is None else image
    return {"sample": sample(image, torch.arange(4)), "ids": [torch.ones(2), *ids]}


@pytest.mark.parametrize(
    ("got", "says"),
    [
        (_fixed(torch.zeros(4, 3)), "['sample'].image holds other values than move() gives"),
        (_fixed(sample=lambda *a: tuple(a)), "['sample'] is a tuple where move() gives a Sample"),
        (_fixed(ids=("y",)), "['ids'][1] is 'y' where move() gives 'x'"),
        (_fixed(torch.arange(12.0).reshape(4, 3).double()), "['sample'].image is a torch.float64 tensor"),
        (_fixed(ids=()), "['ids'][1] is missing: move() gives a str there"),
        (_fixed(ids=("x", "y")), "it holds ['ids'][2], where move()'s result holds nothing"),
    ],
    ids=["values", "container", "atom", "dtype", "missing", "extra"],
)
def test_difference_names_the_first_path_that_differs(got: Any, says: str) -> None:
    want = _fixed()
    assert yours.difference(want, _fixed()) is None
    why = yours.difference(want, got)
    assert why is not None and says in why


def test_a_dict_whose_keys_come_in_another_order_is_the_same_dict() -> None:
    want = {"a": torch.ones(2), "b": {"c": torch.zeros(1), "d": 3}}
    got = {"b": {"d": 3, "c": torch.zeros(1)}, "a": torch.ones(2)}
    assert yours.difference(want, got) is None
    assert yours.difference(want, {**got, "a": torch.ones(3)}) == (
        "['a'] is a torch.float32 tensor of shape (3,) on cpu where move() gives a torch.float32 tensor of shape (2,) "
        "on cpu"
    )


def test_a_helper_that_changes_the_batch_in_place_is_reported_and_the_batch_is_untouched() -> None:
    def in_place(batch: Any, device: Any) -> Any:
        batch["ids"][0] = batch["ids"][0].to(device)
        return right(batch, device)

    batch = make_batch()
    report = todevice.bench(batch, "meta", helper=in_place, rounds=3)
    assert any(why == "it changed the batch it was given, in place" for why in report.wrong.values())
    assert batch["ids"][0].device == torch.device("cpu")  # checked on a copy


def test_nan_values_are_equal_to_nan_values() -> None:
    batch = {"x": torch.full((4,), float("nan")), "y": torch.arange(3)}
    report = todevice.bench(batch, "cpu", helper=lambda b, d: {k: v.to(d) for k, v in b.items()}, rounds=3)
    assert not any("your helper" in name for name in report.wrong)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", [torch.complex32, torch.complex64, torch.complex128])
def test_a_complex_nan_is_equal_to_itself_and_a_correct_helper_is_timed(dtype: torch.dtype) -> None:
    """move() and the helper may give back the very same tensor: equal, NaN and all."""
    x = torch.tensor([complex(float("nan"), 1.0), 2j, complex(3.0, float("nan"))], dtype=dtype)
    batch = {"x": x, "y": torch.arange(3)}
    report = todevice.bench(batch, "cpu", helper=lambda b, d: {k: v.to(d) for k, v in b.items()}, rounds=3)
    assert not any("your helper" in name for name in report.wrong) and report.helper.startswith("your helper")
    assert yours.difference({"x": x}, {"x": x.clone()}) is None
    assert yours.difference({"x": x}, {"x": x.conj().conj()}) is None  # a lazy conjugate bit, resolved
    swapped = torch.tensor([complex(1.0, float("nan")), 2j, complex(3.0, float("nan"))], dtype=dtype)
    assert yours.difference({"x": x}, {"x": swapped}) == "['x'] holds other values than move() gives"


@given(
    st.lists(
        st.tuples(
            st.one_of(st.floats(allow_nan=True, width=32), st.just(float("nan"))),
            st.one_of(st.floats(allow_nan=True, width=32), st.just(float("nan"))),
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([torch.complex64, torch.complex128, torch.float32, torch.float64]),
)
def test_values_and_nans_compare_part_by_part(parts: list[tuple[float, float]], dtype: torch.dtype) -> None:
    """A copy holds the same values, NaN where the source has NaN; a change to any part of one value is a difference."""
    if dtype.is_complex:
        x = torch.tensor([complex(re, im) for re, im in parts], dtype=dtype)
    else:
        x = torch.tensor([re for re, _ in parts], dtype=dtype)
    assert yours.difference({"x": x}, {"x": x.clone()}) is None
    changed = x.clone()
    changed[0] = 0.5 if x[0] != 0.5 else 0.25  # a NaN made a number, or a number another
    assert yours.difference({"x": x}, {"x": changed}) == "['x'] holds other values than move() gives"


@pytest.mark.parametrize(("low", "high", "verdict"), [(1.1, 1.3, "faster"), (0.7, 0.9, "slower"), (0.9, 1.1, None)])
def test_a_spread_that_holds_one_is_no_measurable_difference(low: float, high: float, verdict: str | None) -> None:
    row = yours.Row("as given", "todevice.move", 1.0, 1.0, (low + high) / 2, low, high)
    assert row.verdict == (verdict or "no measurable difference")


def test_fewer_than_three_rounds_is_refused() -> None:
    with pytest.raises(ValueError, match="rounds takes an int of at least 3"):
        todevice.bench(make_batch(), "meta", rounds=2)


MODULE = """
    import dataclasses
    import torch

    @dataclasses.dataclass
    class Sample:
        image: torch.Tensor
        label: torch.Tensor

    def make_batch():
        return {"sample": Sample(torch.randn(4, 3), torch.arange(4)), "ids": [torch.ones(2), "x"]}

    def to_device(batch, device):
        s = batch["sample"]
        return {"sample": Sample(s.image.to(device), s.label.to(device)), "ids": [batch["ids"][0].to(device), "x"]}

    def drops_the_dataclass(batch, device):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def moves_nothing(batch, device):
        return batch
"""


def _cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``python -m todevice bench ARGS`` run from a folder holding the user's module, in this process."""
    from todevice import __main__ as cli

    (tmp_path / "my_batches.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_batches", raising=False)
    try:
        code = cli.main(["bench", *args])
    except SystemExit as stop:
        code = int(stop.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_line_times_a_module_the_user_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--batch", "my_batches:make_batch", "--helper", "my_batches:to_device", "--device", "meta", "--rounds", "3"]
    code, out, err = _cli(tmp_path, monkeypatch, capsys, *args, "--json", "report.json")
    assert code == 0, err
    assert out.startswith("my_batches.make_batch() (dict, 3 tensors, ")
    assert "move() against your helper (my_batches.to_device)" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["yours"]["helper"] == "your helper (my_batches.to_device)" and report["yours"]["wrong"].keys() <= {
        "accelerate"
    }


def test_the_command_line_reports_a_wrong_helper_and_does_not_time_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--batch", "my_batches:make_batch", "--helper", "my_batches:drops_the_dataclass", "--device", "meta"]
    code, out, err = _cli(tmp_path, monkeypatch, capsys, *args, "--rounds", "3")
    assert code == 0, err
    assert "Not timed, since its result differs from move()'s: your helper (my_batches.drops_the_dataclass)" in out
    assert "| as given | your helper" not in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--batch", "my_batches"], "expected MODULE:CALLABLE"),
        (["--batch", "my_batches:nothing"], "cannot load 'my_batches:nothing'"),
        (["--helper", "my_batches:to_device"], "--helper: only with --batch"),
    ],
)
def test_a_bad_batch_or_helper_is_one_line_of_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    code, _, err = _cli(tmp_path, monkeypatch, capsys, *args)
    assert code == 2 and says in err


@pytest.mark.parametrize("helper", ["drops_the_dataclass", "moves_nothing"])
def test_on_cpu_a_helper_that_leaves_a_tensor_behind_is_named_and_not_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], helper: str
) -> None:
    """Timed on cpu, where the tensors already are, a helper that moves nothing gives move()'s result there: it is
    checked on meta too, where what it leaves behind shows; the command line as todevice.bench()."""
    code, out, err = _cli(tmp_path, monkeypatch, capsys, "--batch", "my_batches:make_batch", "--helper",
                          f"my_batches:{helper}", "--device", "cpu", "--rounds", "3")  # fmt: skip
    assert code == 0, err
    line = (
        f"Not timed, since its result differs from move()'s: your helper (my_batches.{helper}): checked moving to meta"
    )
    assert line in out and "['sample'].image is a torch.float32 tensor of shape (4, 3) on cpu" in out
    assert f"| as given | your helper (my_batches.{helper})" not in out
    import my_batches  # type: ignore[import-not-found]

    report = todevice.bench(my_batches.make_batch(), "cpu", helper=getattr(my_batches, helper), rounds=3)
    assert report.helper == "todevice.move" and any(helper in name for name in report.wrong)
    right = todevice.bench(my_batches.make_batch(), "cpu", helper=my_batches.to_device, rounds=3)
    assert right.helper.startswith("your helper") and not any("to_device" in name for name in right.wrong)


@pytest.mark.parametrize(
    ("raises", "says"),
    [
        (
            'raise ValueError("no data under\\n  /datasets")',
            "importing broken raised ValueError: no data under /datasets",
        ),
        ('raise TypeError("bad seed")', "importing broken raised TypeError: bad seed"),
        ("import not_installed_anywhere", "importing broken raised ModuleNotFoundError: No module named"),
    ],
    ids=["ValueError", "TypeError", "ImportError"],
)
def test_a_module_that_fails_to_import_gives_its_own_error_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raises: str, says: str
) -> None:
    """Whatever the user's module raises as it is imported, its message, on the line that names the module (argparse
    reads a ValueError or TypeError from a type= function as its own "invalid value" and drops the message)."""
    (tmp_path / "broken.py").write_text(raises + "\n")
    monkeypatch.delitem(sys.modules, "broken", raising=False)
    code, _, err = _cli(tmp_path, monkeypatch, capsys, "--batch", "broken:make")
    (line,) = [line for line in err.splitlines() if "broken" in line]
    assert code == 2 and "cannot load 'broken:make': " + says in line
    assert "_callable" not in err and "invalid" not in err


# ---------------------------------------------------------------- bench --plot


def _plot_rows() -> list[dict[str, Any]]:
    rows = []
    for target in ("cpu", "meta"):
        for batch, n in (
            ("1 tensor", 1),
            ("flat dict, 10", 10),
            ("flat dict, 100", 100),
            ("nested with a dataclass, 10", 10),
        ):
            x = {"todevice.move": 1.0, "hand-written helper": 0.8 * n**0.2, "Lightning": 2.0}
            spread = {name: [v * 0.9, v, v * 1.1] for name, v in x.items()}
            rows.append({"batch": batch, "target": target, "tensors": n, "x_vs_move": x, "spread_vs_move": spread})
    return rows


def test_plot_draws_a_png_of_the_size_matrix(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from todevice._bench import plot

    path = tmp_path / "size.png"
    plot.draw(_plot_rows(), str(path), "a test machine")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    points = plot._series(_plot_rows(), "cpu", "flat dict", "hand-written helper")
    assert [p[0] for p in points] == [1, 10, 100]  # the 1-tensor batch starts the flat dicts' line; nested apart
    assert all(low < mid < high for _, mid, low, high in points)


def test_plot_without_matplotlib_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from todevice import __main__ as cli
    from todevice._bench import plot

    monkeypatch.setattr(plot, "available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--plot", str(tmp_path / "size.png")])
    assert stop.value.code == 2
    assert 'pip install "todevice[plot]"' in capsys.readouterr().err


def test_a_helper_is_checked_on_every_form_of_the_batch_it_is_timed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator the batch is timed as given, pinned and already there; a helper wrong on one of them is
    reported with that form, and not timed."""
    monkeypatch.setattr(yours, "_forms", lambda batch, dev: {"pageable": batch, "pinned": {"x": batch["x"].double()}})

    def to_float(batch: Any, device: Any) -> Any:
        return {k: v.float().to(device) for k, v in batch.items()}

    report = todevice.bench({"x": torch.ones(3)}, "meta", helper=to_float, rounds=3)
    name = next(iter(report.wrong))
    assert report.wrong[name] == (
        "pinned: ['x'] is a torch.float32 tensor of shape (3,) on meta where move() gives a torch.float64 tensor of "
        "shape (3,) on meta"
    )
    assert name not in {row.contender for row in report.rows}


class _Pair:
    """An object that moves itself, as a model's input wrapper may: the walk does not look inside it."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.__dict__.update(tensors)

    def to(self, device: Any) -> _Pair:
        return _Pair(**{k: v.to(device) for k, v in vars(self).items()})


@pytest.mark.parametrize(
    ("got", "says"),
    [
        ({"m": torch.nn.Linear(2, 2, bias=False)}, "['m'].bias is missing: move() gives a torch.float32 tensor"),
        ({"m": _Pair(a=torch.ones(2))}, "['m'].b is missing"),
        ({"m": _Pair(a=torch.ones(2), b=torch.zeros(1), c=torch.ones(1))}, "it holds a torch.float32 tensor of shape"),
    ],
    ids=["module", "object missing", "object extra"],
)
def test_tensors_inside_what_moves_itself_are_compared_too(got: Any, says: str) -> None:
    torch.manual_seed(0)
    want = (
        {"m": torch.nn.Linear(2, 2)}
        if isinstance(got["m"], torch.nn.Module)
        else {"m": _Pair(a=torch.ones(2), b=torch.zeros(1))}
    )
    why = yours.difference(want, got)
    assert why is not None and says in why, why


def test_a_helper_that_drops_a_tensor_inside_an_object_is_reported_not_raised() -> None:
    def drops(batch: Any, device: Any) -> Any:
        return {"x": batch["x"].to(device), "p": _Pair(a=batch["p"].a.to(device))}

    report = todevice.bench(
        {"x": torch.ones(2), "p": _Pair(a=torch.ones(2), b=torch.zeros(1))}, "meta", helper=drops, rounds=3
    )
    assert any(why.startswith("['p'].b is missing") for why in report.wrong.values()), report.wrong


def test_a_module_not_found_says_where_it_was_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(tmp_path, monkeypatch, capsys, "--batch", "elsewhere:make")
    assert code == 2
    assert f"cannot load 'elsewhere:make': there is no module elsewhere in the current folder ({tmp_path})" in err
    assert "run from the folder that holds it, or add that folder to PYTHONPATH" in err


# ---------------------------------------------------------------- the first screen's words


def test_a_ratio_is_never_printed_as_zero() -> None:
    from todevice._bench.common import ratio
    from todevice._bench.host import _figure

    assert [ratio(v) for v in (7.094, 1.0, 0.1, 0.0043)] == ["7.09x", "1.00x", "0.10x", "0.0043x"]
    assert _figure([0.0031, 0.0043, 0.0052]) == "0.0043x (0.0031x to 0.0052x)"


def _overhead_row(batch: str, helper: float, left: bool) -> dict[str, Any]:
    tensors = 10
    return {
        "batch": batch,
        "target": "meta",
        "tensors": tensors,
        "x_vs_move": {"todevice.move": 1.0, "hand-written helper": helper},
        "spread_vs_move": {"hand-written helper": [helper * 0.95, helper, helper * 1.05]},
        "tensors_on_target": {"todevice.move": tensors, "hand-written helper": tensors - 2 if left else tensors},
    }


def test_the_slower_rows_note_names_the_dataclass_only_where_the_helper_left_its_tensors() -> None:
    from todevice._bench import host

    plain = host.notes([_overhead_row("flat dict, 10", 0.8, left=False)])
    assert plain[0].startswith("Where move() is slower") and "dataclass" not in plain[0]
    nested = host.notes([_overhead_row("nested with a dataclass, 10", 0.8, left=True)])
    assert "it moves the dataclass's tensors, which the helper leaves behind" in nested[0]
    assert not any(n.startswith("Where move() is slower") for n in host.notes([_overhead_row("x", 1.5, False)]))


def test_without_an_accelerator_the_first_screen_says_which_command_answers_the_gpu_questions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from todevice import _stream
    from todevice._bench import host

    monkeypatch.setattr(_stream, "accelerator", lambda: None)
    assert (
        "No accelerator here" in host.notes([])[-1] and "python -m todevice bench --device cuda" in host.notes([])[-1]
    )
    monkeypatch.setattr(_stream, "accelerator", lambda: torch.device("cuda"))
    assert host.notes([]) == []


def test_the_yardstick_s_own_row_says_so() -> None:
    report = todevice.bench(make_batch(), "meta", helper=right, rounds=3)
    lines = [line for line in str(report).splitlines() if line.startswith("| ") and report.helper in line]
    assert lines and all(line.endswith("| the yardstick |") for line in lines)


def test_plot_ticks_are_plain_numbers_and_the_1x_line_is_named_in_the_legend(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from todevice._bench import plot

    fig, ax = plt.subplots()
    ax.plot([1, 10], [0.7, 3.0])
    plot._ratio_axis(ax, [0.7, 3.0])
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "1x" in labels and "2x" in labels and "0.5x" not in labels  # within the data's range, in plain numbers
    assert all("^" not in label and "$" not in label for label in labels)
    assert plot.ONE in [line.get_label() for line in ax.get_lines()]
    plt.close(fig)


@pytest.mark.parametrize("other", [[], ["--device", "cpu"]], ids=["default device", "cpu"])
def test_plot_draws_the_user_s_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], other: list[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "yours.png"
    args = ["--batch", "my_batches:make_batch", "--helper", "my_batches:to_device", "--rounds", "3", "--plot", str(png)]
    code, out, err = _cli(tmp_path, monkeypatch, capsys, *args, *other)
    assert code == 0, err
    assert f"drew {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_the_accelerator_s_size_matrix(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from todevice._bench import plot

    rows = [
        {"workload": f"{n}, {memory}", "memory": memory, "tensors": n, "contender": name, "x_helper_e2e": x * n**0.1}
        for n in (1, 10, 100)
        for memory in ("pageable", "pinned", "on the device")
        for name, x in (("todevice.move", 2.0), ("hand-written helper", 1.0), ("accelerate", 0.9))
    ]
    png = tmp_path / "device.png"
    plot.draw_device(rows, str(png), "a test GPU")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_on_cpu_a_batch_move_cannot_send_to_meta_is_checked_where_it_is_timed() -> None:
    """A strided nested tensor has no copy to meta: bench() checks on cpu alone, and times."""
    batch = {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "x": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's: nested tensors are a prototype
        report = todevice.bench(batch, "cpu", helper=lambda b, d: {k: v.to(d) for k, v in b.items()}, rounds=3)
    assert report.helper.startswith("your helper")


def test_on_cpu_a_helper_that_cannot_go_to_meta_is_judged_on_cpu_and_bench_s_own_move_does_not_warn() -> None:
    def pins_off_the_cpu(batch: Any, device: Any) -> Any:
        if torch.device(device).type != "cpu":
            raise RuntimeError("no accelerator for pinned memory")
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    batch = {"x": torch.ones(2), "m": torch.nn.Linear(1, 1)}  # moved to meta, it would warn of the module
    with warnings.catch_warnings():
        warnings.simplefilter("error", todevice.errors.TensorsLeftBehindWarning)
        report = todevice.bench(batch, "cpu", helper=pins_off_the_cpu, rounds=3)
    assert report.helper.startswith("your helper") and not any("pins_off" in name for name in report.wrong)


def test_a_ratio_that_is_no_number_or_tiny_reads_so() -> None:
    from todevice._bench.common import ratio

    assert [ratio(v) for v in (float("nan"), float("inf"), 1e-05, 0.0)] == ["-", "-", "<0.001x", "<0.001x"]
