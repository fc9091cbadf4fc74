"""`trl-gc-plan --plot FILE`: the candidates drawn, predicted peak against predicted recompute, with the budget line and
the pick marked. matplotlib, an optional dependency, is imported only here."""

from __future__ import annotations

from typing import Any

from ..core.errors import UsageError

GIB = 2**30


class PlotUnavailable(UsageError):
    """matplotlib is not installed (`trl-gc-plan` exits 2 with this line)."""


def plot(plan: Any, label: str, path: str) -> None:
    """Write the candidates of `plan` (a `planner.Plan`) to the image `path` (its suffix picks the format: .png,
    .svg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write the file only
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'trl-gc-plugin[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    note = {"textcoords": "offset points", "fontsize": 8}
    try:
        for c in plan.candidates:
            chosen = plan.chosen is not None and c.name == plan.chosen.name
            fits = c.peak_bytes <= plan.budget
            colour = "tab:green" if chosen else ("tab:blue" if c.allowed and fits else "tab:gray")
            marker = "*" if chosen else ("o" if c.allowed else "x")
            point = (c.recompute, c.peak_bytes / GIB)
            ax.scatter(*point, s=220 if chosen else 40, c=colour, marker=marker, zorder=3)
            if chosen or "-of-" not in c.name:  # the k-of-n layouts between every-N ones go unlabelled
                ax.annotate(c.name, point, xytext=(6, 4), color=colour, **note)
        ax.axhline(plan.budget / GIB, color="tab:red", linestyle="--", linewidth=1)
        budget = f"budget {plan.budget / GIB:.3g} GiB"
        where = {"xycoords": ("axes fraction", "data"), "xytext": (-4, 4), "ha": "right", "color": "tab:red"}
        ax.annotate(budget, (1, plan.budget / GIB), **where, **note)
        pick = f"pick: {plan.chosen.name}" if plan.chosen is not None else "nothing fits"
        ax.set_title(f"{label}: {pick}", fontsize=10)
        ax.set_xlabel("predicted recompute (share of one forward)")
        ax.set_ylabel("predicted peak above weights and optimizer (GiB)")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
