"""PNG figures of the entropy diagnostics (matplotlib, Agg backend)."""

from __future__ import annotations

import os

import numpy as np

from egpo_trl.diagnostics.metrics import SCOPES, EntropyTable, roc_auc, roc_curve

LOG_FLOOR = 1e-6  # records keep log-probs to 6 digits: smaller entropies are drawn at this value
CLASSES = ((True, "correct", "#2a9d8f"), (False, "incorrect", "#e76f51"))
TITLES = {
    "completion": "whole completion",
    "thinking": "thinking (inside <think>)",
    "answer": "answer (after </think>)",
}


def _figure(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def _save(fig, path: str, title: str, note: str | None) -> str:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=11)
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="0.4", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _log_scale(values: np.ndarray) -> bool:
    """Whether values span more than two decades (drawn on a log axis, floored at ``LOG_FLOOR``)."""
    values = np.maximum(values[~np.isnan(values)], LOG_FLOOR)
    return len(values) > 1 and values.max() > 100 * np.quantile(values, 0.01)


def plot_density(table: EntropyTable, path: str, title: str = "", note: str | None = None) -> str:
    """Histogram of the entropy of correct vs incorrect completions per scope, means and gap marked (paper Fig. 3)."""
    fig, axes = _figure(1, len(SCOPES), figsize=(4.2 * len(SCOPES), 3.4))
    for axis, scope in zip(axes, SCOPES):
        values, correct = table.scope(scope), table.correct
        defined = ~np.isnan(values)
        axis.set_title(TITLES[scope], fontsize=10)
        if not defined.any():
            axis.text(0.5, 0.5, "no completion has\nthis segment", ha="center", va="center", transform=axis.transAxes)
            continue
        values, correct = values[defined], correct[defined]
        log = _log_scale(values)
        values = np.maximum(values, LOG_FLOOR) if log else values
        high = max(np.quantile(values[correct == flag], 0.99) for flag, _, _ in CLASSES if (correct == flag).any())
        low = values.min()
        bins = np.geomspace(low, high, 40) if log and high > low else np.linspace(low, max(high, low + 1e-9), 40)
        means = {}
        for flag, name, color in CLASSES:
            chosen = values[correct == flag]
            if len(chosen):
                means[name] = chosen.mean()
                label = f"{name} (n={len(chosen)}, μ={chosen.mean():.3g})"
                axis.hist(chosen, bins=bins, density=True, histtype="stepfilled", alpha=0.35, color=color, label=label)
                axis.axvline(chosen.mean(), color=color, linestyle="--", linewidth=1)
        if len(means) == 2:
            axis.set_title(f"{TITLES[scope]}\nΔ = {means['incorrect'] - means['correct']:+.3g}", fontsize=10)
        if log:
            axis.set_xscale("log")
        axis.set_xlabel("entropy proxy (mean -log p), to the 99th percentile", fontsize=8)
        axis.set_ylabel("density")
        axis.legend(fontsize=7, loc="upper right")
    return _save(fig, path, title, note)


def plot_roc(table: EntropyTable, path: str, title: str = "", note: str | None = None) -> str:
    """ROC curves of the entropy for predicting an incorrect answer, per scope."""
    fig, axis = _figure(figsize=(4.6, 4.4))
    for scope, color, style in (("thinking", "#264653", "-"), ("answer", "#e9c46a", "-"), ("completion", "0.55", ":")):
        values = table.scope(scope)
        defined = ~np.isnan(values)
        incorrect = ~table.correct[defined]
        if incorrect.any() and not incorrect.all():
            fpr, tpr, _ = roc_curve(values[defined], incorrect)
            auc = roc_auc(values[defined], incorrect)
            label = f"{scope} entropy (AUC={auc:.3f}, n={defined.sum()})"
            axis.plot(fpr, tpr, color=color, linestyle=style, label=label)
    axis.plot([0, 1], [0, 1], color="0.8", linewidth=1)
    axis.set_xlabel("false positive rate (correct flagged)")
    axis.set_ylabel("true positive rate (incorrect flagged)")
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7, loc="lower right")
    else:
        axis.text(0.5, 0.5, "needs correct and incorrect\ncompletions", ha="center", va="center")
    return _save(fig, path, title or "Entropy as a predictor of incorrect answers", note)


def _scatter(table: EntropyTable, x: np.ndarray, y: np.ndarray, path: str, labels, title, note) -> str:
    """Scatter of correct and incorrect completions (log y axis when y spans decades)."""
    fig, axis = _figure(figsize=(4.8, 4.0))
    if _log_scale(y):
        y = np.maximum(y, LOG_FLOOR)
        axis.set_yscale("log")
    defined = ~np.isnan(x) & ~np.isnan(y)
    for flag, name, color in CLASSES[::-1]:  # correct ones on top
        chosen = defined & (table.correct == flag)
        if chosen.any():
            axis.scatter(x[chosen], y[chosen], s=10, alpha=0.55, color=color, label=f"{name} (n={chosen.sum()})")
    if defined.any():
        axis.legend(fontsize=7)
    else:
        axis.text(0.5, 0.5, "no completion has an answer segment", ha="center", va="center", transform=axis.transAxes)
    axis.set_xlabel(labels[0])
    axis.set_ylabel(labels[1])
    return _save(fig, path, title, note)


def plot_all(table: EntropyTable, output_dir: str, title: str = "", note: str | None = None) -> dict[str, str]:
    """Write the four figures into ``output_dir``; returns ``{name: path}``."""
    lengths = np.where(np.isnan(table.answer), np.nan, table.answer_tokens.astype(float))
    name = lambda stem: os.path.join(output_dir, f"{stem}.png")  # noqa: E731
    return {
        "entropy_density": plot_density(table, name("entropy_density"), title, note),
        "roc_thinking_vs_answer": plot_roc(table, name("roc_thinking_vs_answer"), title, note),
        "answer_length_vs_entropy": _scatter(
            table,
            lengths,
            table.answer,
            name("answer_length_vs_entropy"),
            ("answer length (tokens after </think>)", "answer entropy"),
            title,
            note,
        ),
        "thinking_vs_answer_entropy": _scatter(
            table,
            table.thinking,
            table.answer,
            name("thinking_vs_answer_entropy"),
            ("thinking entropy", "answer entropy"),
            title,
            note,
        ),
    }
