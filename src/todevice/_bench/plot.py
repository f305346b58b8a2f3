"""``bench --plot FILE.png``: each contender's time over move()'s as a picture, with the middle half of the rounds where
the table has one and a line at 1x. The host tables' size matrix and the accelerator's (``--device``) against the
tensors in the batch; your batch (``--batch``) by contender. Needs matplotlib (``todevice[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from todevice._bench.common import HELPER
from todevice._bench.host import quartiles

NEEDS = 'bench --plot needs matplotlib: pip install "todevice[plot]" (or pip install matplotlib)'

# The host panels: where the batch goes, and what that measures.
TARGETS = {
    "cpu": "to cpu, where the tensors already are: the cost of looking at the batch",
    "meta": "to meta: every tensor copied, with no data",
}
FAMILIES = {"flat dict": "-", "nested with a dataclass": "--"}  # the line style of each kind of batch
MEMORIES = {  # the accelerator's panels: where the batch's tensors are
    "pageable": "from pageable host memory",
    "pinned": "from pinned host memory",
    "on the device": "already on the device",
}
COLOURS = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown"]
ONE = "1x: as fast as move()"
MOVE = "todevice.move"
YLABEL = "contender's time / move()'s time\n(above 1x: move() is faster)"
Point = tuple[float, float, float, float]  # x, the median ratio, its middle half: low, high


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _series(rows: Sequence[dict[str, Any]], target: str, family: str, name: str) -> list[Point]:
    """(tensors, median ratio, its quartiles) of one contender on one kind of batch; flat dicts from 1 to 3 tensors."""
    points = []
    for r in rows:
        batch = str(r["batch"])
        small = family == "flat dict" and r["tensors"] <= 3 and not batch.startswith(("flat", "nested", "in place"))
        if r["target"] != target or name not in r["x_vs_move"] or not (batch.startswith(family + ",") or small):
            continue
        low, mid, high = quartiles(r, name)
        points.append((int(r["tensors"]), float(mid), float(low), float(high)))
    return sorted(points)


def _ordered(names: Sequence[str]) -> list[str]:
    """The contenders but move(), the helper first: the order of the legend and of the colours."""
    return sorted((n for n in names if n != "todevice.move"), key=lambda n: (HELPER not in n, n))


def draw(rows: Sequence[dict[str, Any]], path: str, machine: str) -> None:
    """The host size matrix (``host.run``'s rows), one panel per target, written to ``path`` as a PNG."""
    names = _ordered(list(rows[0]["x_vs_move"]))
    panels: dict[str, dict[str, tuple[str, str, list[Point]]]] = {}
    for target, title in TARGETS.items():
        lines = panels[title] = {}
        for i, name in enumerate(names):
            for family, style in FAMILIES.items():
                points = _series(rows, target, family, name)
                if points:
                    label = f"{name}, {family}" + (" (and 1 to 3 tensors)" if family == "flat dict" else "")
                    lines[label] = (COLOURS[i % len(COLOURS)], style, points)
    title = f"move() against the helper and the peers, medians and the middle half of the rounds ({machine})"
    _lines(panels, path, title)


def draw_device(rows: Sequence[dict[str, Any]], path: str, machine: str) -> None:
    """The accelerator's size matrix (``device.size_rows``): each batch, by name, with one panel per memory its tensors
    are in; each contender's end-to-end time over move()'s (one median each: no spread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moves = {r["workload"]: r["x_helper_e2e"] for r in rows if r["contender"] == MOVE}
    names = _ordered(list(dict.fromkeys(r["contender"] for r in rows)))
    memories = list(dict.fromkeys(r["memory"] for r in rows))
    fig, axes = plt.subplots(1, len(memories), figsize=(6.5 * len(memories), 5.5), sharey=True, squeeze=False)
    values: list[float] = []
    for ax, memory in zip(axes[0], memories):
        here = [r for r in rows if r["memory"] == memory]
        batches = [r["workload"] for r in here if r["contender"] == MOVE]  # in the table's order
        for i, name in enumerate(names):
            by = {r["workload"]: r["x_helper_e2e"] for r in here if r["contender"] == name and r["x_helper_e2e"] > 0}
            x = [k for k, b in enumerate(batches) if b in by]
            y = [moves[batches[k]] / by[batches[k]] for k in x]  # the contender's time over move()'s
            values += y
            ax.plot(x, y, "o", color=COLOURS[i % len(COLOURS)], label=name)
        batches = [b.rpartition(", ")[0] for b in batches]  # the memory is the panel's
        ax.set_xticks(range(len(batches)), batches, rotation=25, ha="right", fontsize=7)
        ax.set_title(MEMORIES.get(memory, memory), fontsize=10)
    for ax in axes[0]:
        _ratio_axis(ax, values)
    axes[0][0].set_ylabel(YLABEL)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"move() against the helper and the peers on the accelerator, end to end ({machine})")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_yours(report: Any, path: str, machine: str) -> None:
    """``bench --batch``'s report: each contender's time over move()'s, by form of the batch, with the middle half."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forms = list(dict.fromkeys(row.form for row in report.rows))
    names = _ordered(list(dict.fromkeys(row.contender for row in report.rows)))
    fig, axes = plt.subplots(1, len(forms), figsize=(4 + 4 * len(forms), 5.5), sharey=True, squeeze=False)
    values: list[float] = []
    for ax, form in zip(axes[0], forms):
        by = {row.contender: row for row in report.rows if row.form == form}
        moved = by[MOVE]
        for i, name in enumerate(names):
            if name not in by or min(by[name].speedup, by[name].low, by[name].high) <= 0:  # no time to divide by
                continue
            # The rows give the yardstick's time over each contender's: a contender's over move()'s is their ratio.
            mid, low, high = (moved.speedup / by[name].speedup, moved.low / by[name].high, moved.high / by[name].low)
            values += [low, high]
            colour = COLOURS[i % len(COLOURS)]
            ax.errorbar([i], [mid], yerr=[[mid - low], [high - mid]], fmt="o", color=colour, label=name)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(form, fontsize=10)
    for ax in axes[0]:
        _ratio_axis(ax, values)
    axes[0][0].set_ylabel(YLABEL)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", fontsize=8, frameon=False)
    fig.suptitle(f"{report.batch}, moved to {report.device}:\nmedians and the middle half of the rounds ({machine})")
    fig.tight_layout(rect=(0, 0.08, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lines(panels: dict[str, dict[str, tuple[str, str, list[Point]]]], path: str, title: str) -> None:
    """One panel per entry, each line's median ratios against the tensors, the middle half as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), sharey=True, squeeze=False)
    values: list[float] = []
    for ax, (heading, lines) in zip(axes[0], panels.items()):
        for label, (colour, style, points) in lines.items():
            x, y, low, high = zip(*points)
            values += [*low, *high]
            ax.plot(x, y, style, marker="o", markersize=3, color=colour, label=label)
            ax.fill_between(x, low, high, color=colour, alpha=0.15, linewidth=0)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))  # 1, 10, ..., 10,000
        ax.set_title(heading, fontsize=10)
        ax.set_xlabel("tensors in the batch")
    for ax in axes[0]:
        _ratio_axis(ax, values)
    axes[0][0].set_ylabel(YLABEL)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.16, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Ratio ticks in plain numbers: 0.5x, 1x, 2x, 5x, 10x, and so on, where the data lie.
_TICKS = [m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5)]


def _ratio_axis(ax: Any, values: Sequence[float]) -> None:
    """A log axis of ratios, ticked in plain numbers around ``values``, and the 1x line, named in the legend (not on the
    data)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    low, high = min([1.0, *values]), max([1.0, *values])
    ax.set_yscale("log")
    ax.set_ylim(low / 1.3, high * 1.3)
    ticks = [t for t in _TICKS if low / 1.3 <= t <= high * 1.3]
    if len(ticks) < 3:  # a narrow range: thirds of a decade too
        ticks = sorted({*ticks, *(t for t in (0.7, 0.8, 0.9, 1.5, 3.0) if low / 1.3 <= t <= high * 1.3)})
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    if not any(line.get_label() == ONE for line in ax.get_lines()):
        ax.axhline(1.0, color="black", linewidth=1.2, label=ONE)
