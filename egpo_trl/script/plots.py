"""``training_curves.png``: reward, accuracy, the entropy gap and the group types over the training steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_metrics(records: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw reward, accuracy, entropy gap and group-type fractions over the steps into a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = metrics_figure(records, title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def metrics_figure(records: Sequence[dict[str, Any]], title: str = ""):
    """The matplotlib figure :func:`plot_metrics` saves (four panels, labelled axes, one point per step)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # One point per step: the last record of a step wins (a resumed run's file may repeat the replayed steps).
    train = sorted(
        {r["step"]: r for r in records if "reward" in r and "heldout/accuracy" not in r}.values(),
        key=lambda r: r["step"],
    )
    heldout = sorted(
        {r.get("heldout/stage", r["step"]): r for r in records if "heldout/accuracy" in r}.values(),
        key=lambda r: r["step"],
    )
    window = max(1, len(train) // 12)

    def series(key: str, rows=train):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in points], [p[1] for p in points]

    def draw(ax, steps, values, color, label=None):
        if window > 1:  # the raw values faint, under their trailing moving average (shorter windows at the start)
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            total, raw, values = 0.0, values, []
            for index, value in enumerate(raw):
                total += value
                if index >= window:
                    total -= raw[index - window]
                values.append(total / min(index + 1, window))
        ax.plot(steps, values, color=color, linewidth=2, label=label)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    steps, values = series("reward")
    draw(ax, steps, values, "tab:blue")

    ax = axes[0][1]
    steps, values = series("accuracy")
    if steps:
        draw(ax, steps, values, "tab:green", "training batches")
    steps, values = series("heldout/accuracy", heldout)
    if steps:
        ax.plot(steps, values, "o--", color="black", markersize=7, label="held-out")
        for step, value in zip(steps, values):
            ax.annotate(f"{value:.1%}", (step, value), textcoords="offset points", xytext=(4, 6))
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")

    ax = axes[1][0]
    steps, values = series("egpo/entropy_gap")
    if steps:
        draw(ax, steps, values, "tab:red")
        ax.axhline(0.0, color="gray", linewidth=0.8)
    else:
        ax.text(0.5, 0.5, "no egpo/entropy_* metrics logged", ha="center", va="center", transform=ax.transAxes)

    ax = axes[1][1]
    for key, label, color in (
        ("egpo/frac_all_correct", "all correct", "tab:green"),
        ("egpo/frac_mixed", "mixed", "tab:orange"),
        ("egpo/frac_all_incorrect", "all incorrect", "tab:red"),
    ):
        steps, values = series(key)
        if steps:
            draw(ax, steps, values, color, label)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
        ax.set_ylim(0, 1)
    else:
        ax.text(0.5, 0.5, "no egpo/frac_* metrics logged", ha="center", va="center", transform=ax.transAxes)
    labels = (
        ("Mean reward of the training batches", "mean reward"),
        ("Accuracy", "fraction of correct completions"),
        ("Entropy gap: incorrect minus correct completions", "entropy gap (nats per token)"),
        ("Group types (fraction of prompts)", "fraction of prompts"),
    )
    for ax, (name, ylabel) in zip((a for row in axes for a in row), labels):
        ax.set_title(name)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    return fig
