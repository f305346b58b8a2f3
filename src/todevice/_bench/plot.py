"""``bench --plot FILE.png``: the size matrix as a picture, each contender's time over move()'s against the number of
tensors, with the middle half of the rounds as a band and a line at 1.0x. Needs matplotlib (``todevice[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from todevice._bench.common import HELPER
from todevice._bench.host import quartiles

NEEDS = 'bench --plot needs matplotlib: pip install "todevice[plot]" (or pip install matplotlib)'

# The panels: where the batch goes, and what that measures.
TARGETS = {
    "cpu": "to cpu, where the tensors already are: the cost of looking at the batch",
    "meta": "to meta: every tensor copied, with no data",
}
FAMILIES = {"flat dict": "-", "nested with a dataclass": "--"}  # the line style of each kind of batch


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _series(
    rows: Sequence[dict[str, Any]], target: str, family: str, name: str
) -> list[tuple[int, float, float, float]]:
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


def draw(rows: Sequence[dict[str, Any]], path: str, machine: str) -> None:
    """The picture of ``rows`` (``host.run``'s), written to ``path`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in rows[0]["x_vs_move"] if n != "todevice.move"]
    names.sort(key=lambda n: (n != HELPER, n))
    colours = dict(zip(names, ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown"]))
    fig, axes = plt.subplots(1, len(TARGETS), figsize=(13, 5.5), sharey=True)
    for ax, (target, title) in zip(axes, TARGETS.items()):
        for name in names:
            for family, style in FAMILIES.items():
                points = _series(rows, target, family, name)
                if not points:
                    continue
                x, y, low, high = zip(*points)
                label = f"{name}, {family}" + (" (and 1 to 3 tensors)" if family == "flat dict" else "")
                ax.plot(x, y, style, marker="o", markersize=3, color=colours[name], label=label)
                ax.fill_between(x, low, high, color=colours[name], alpha=0.15, linewidth=0)
        ax.axhline(1.0, color="black", linewidth=1.2)
        ax.text(1, 1.0, " 1.0x: as fast as move()", va="bottom", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tensors in the batch")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("contender's time / move()'s time (above 1.0x: move() is faster)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"move() against the helper and the peers, medians and the middle half of the rounds ({machine})")
    fig.tight_layout(rect=(0, 0.14, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
