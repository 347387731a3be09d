"""PNG figures of the entropy diagnostics (matplotlib, Agg backend; no display needed)."""

from __future__ import annotations

import os

import matplotlib
import numpy as np

from egpo_trl.diagnostics.metrics import SCOPES, EntropyTable, roc_auc, roc_curve

matplotlib.use("Agg", force=True)
import matplotlib.pyplot as plt  # noqa: E402

LOG_FLOOR = 1e-6
CORRECT_COLOR = "#2a9d8f"
INCORRECT_COLOR = "#e76f51"
SCOPE_TITLES = {"completion": "whole completion", "thinking": "thinking (inside <think>)"}
SCOPE_TITLES["answer"] = "answer (after </think>)"


def _kde(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Gaussian kernel density estimate, Silverman's robust bandwidth (entropies are often heavy-tailed)."""
    spread = values.std(ddof=1) if len(values) > 1 else 0.0
    quartiles = np.quantile(values, [0.25, 0.75]) if len(values) > 1 else np.zeros(2)
    robust = min(spread, (quartiles[1] - quartiles[0]) / 1.34) or spread
    bandwidth = 0.9 * robust * len(values) ** (-1 / 5) if robust > 0 else max(abs(values.mean()) * 0.05, 1e-6)
    density = np.zeros_like(grid)
    for start in range(0, len(values), 2048):
        chunk = values[start : start + 2048]
        density += np.exp(-0.5 * ((grid[:, None] - chunk[None, :]) / bandwidth) ** 2).sum(axis=1)
    return density / (len(values) * bandwidth * np.sqrt(2 * np.pi))


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman's correlation)."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    return (starts + (counts - 1) / 2)[inverse]


def _save(fig, path: str, note: str | None) -> str:
    """Add the footer ``note``, lay out, write ``path`` and close ``fig``."""
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="0.4", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _density_panel(axis, values: np.ndarray, correct: np.ndarray, title: str) -> None:
    """One Fig. 3 style panel: densities of correct and incorrect completions, their means and gap."""
    # Entropies that span several orders of magnitude are shown on a log axis (densities per decade), at least 1e-6.
    floored = np.maximum(values, LOG_FLOOR)
    groups = [floored[correct == flag] for flag in (True, False) if (correct == flag).any()]
    top = max(float(np.quantile(group, 0.99)) for group in groups)
    bottom = min(float(np.quantile(group, 0.01)) for group in groups)
    log_scale = top > 100 * bottom
    values = floored if log_scale else values
    shown = np.log10(values) if log_scale else values
    # The axis stops at the larger of the two classes' 99th percentiles.
    classes = [shown[correct == flag] for flag in (True, False)]
    low = shown.min() if log_scale else max(shown.min(), 0.0)
    high = max(float(np.quantile(chosen, 0.99)) for chosen in classes if len(chosen))
    cut = high < shown.max()
    pad = 0.1 * (high - low) if high > low else 0.1
    grid = np.linspace(low - pad if log_scale else max(low - pad, 0.0), high + pad, 400)
    means = {}
    for is_correct, color, name in ((True, CORRECT_COLOR, "correct"), (False, INCORRECT_COLOR, "incorrect")):
        chosen = values[correct == is_correct]
        if len(chosen) == 0:
            continue
        density = _kde(np.log10(chosen) if log_scale else chosen, grid)
        x = 10**grid if log_scale else grid
        means[name] = chosen.mean()
        axis.plot(x, density, color=color, label=f"{name} (n={len(chosen)}, μ={chosen.mean():.3g})")
        axis.fill_between(x, density, color=color, alpha=0.2)
        axis.axvline(chosen.mean(), color=color, linestyle="--", linewidth=1)
    if len(means) == 2:
        title = f"{title}\nΔ = {means['incorrect'] - means['correct']:+.3g}"
    axis.set_title(title, fontsize=10)
    if log_scale:
        axis.set_xscale("log")
    axis.set_xlim(10 ** grid[0] if log_scale else grid[0], 10 ** grid[-1] if log_scale else grid[-1])
    axis.set_ylabel("density per decade" if log_scale else "density")
    label = "entropy proxy (mean -log p)" + (", log scale" if log_scale else "")
    axis.set_xlabel(label + ("; cut at the 99th percentile" if cut else ""), fontsize=8 if cut else 10)
    axis.legend(fontsize=7, loc="upper right")


def plot_density(table: EntropyTable, path: str, title: str = "", note: str | None = None) -> str:
    """Density of the entropy of correct vs incorrect completions per scope, means and gap marked (paper Fig. 3)."""
    fig, axes = plt.subplots(1, len(SCOPES), figsize=(4.2 * len(SCOPES), 3.4))
    for axis, scope in zip(axes, SCOPES):
        values = getattr(table, scope)
        defined = ~np.isnan(values)
        if not defined.any():
            axis.set_title(SCOPE_TITLES[scope], fontsize=10)
            axis.text(0.5, 0.5, "no completion has\nthis segment", ha="center", va="center", transform=axis.transAxes)
            axis.set_yticks([])
            continue
        _density_panel(axis, values[defined], table.correct[defined], SCOPE_TITLES[scope])
    if title:
        fig.suptitle(title, fontsize=11)
    return _save(fig, path, note)


def plot_roc(table: EntropyTable, path: str, title: str = "", note: str | None = None) -> str:
    """ROC curves of the entropy for predicting an incorrect answer: thinking vs answer (and whole completion)."""
    fig, axis = plt.subplots(figsize=(4.6, 4.4))
    styles = {"thinking": ("#264653", "-"), "answer": ("#e9c46a", "-"), "completion": ("0.55", ":")}
    for scope in ("thinking", "answer", "completion"):
        values = getattr(table, scope)
        defined = ~np.isnan(values)
        incorrect = ~table.correct[defined]
        if not defined.any() or incorrect.all() or not incorrect.any():
            continue
        fpr, tpr, _ = roc_curve(values[defined], incorrect)
        auc = roc_auc(values[defined], incorrect)
        color, style = styles[scope]
        axis.plot(fpr, tpr, color=color, linestyle=style, label=f"{scope} entropy (AUC={auc:.3f}, n={defined.sum()})")
    axis.plot([0, 1], [0, 1], color="0.8", linewidth=1)
    axis.set_xlabel("false positive rate (correct flagged)")
    axis.set_ylabel("true positive rate (incorrect flagged)")
    axis.set_title(title or "Entropy as a predictor of incorrect answers", fontsize=10)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7, loc="lower right")
    else:
        axis.text(0.5, 0.5, "needs correct and incorrect\ncompletions", ha="center", va="center")
    return _save(fig, path, note)


def _scatter(axis, x: np.ndarray, y: np.ndarray, correct: np.ndarray, jitter: float = 0.0) -> bool:
    """Scatter of correct and incorrect completions; a y axis whose values (from their 1st percentile) span over two
    decades is drawn in log scale."""
    floored = np.maximum(y[~np.isnan(y)], LOG_FLOOR)
    if len(floored) > 1 and floored.max() > 100 * np.quantile(floored, 0.01):
        y = np.maximum(y, LOG_FLOOR)
        axis.set_yscale("log")
    defined = ~np.isnan(x) & ~np.isnan(y)
    if not defined.any():
        axis.text(0.5, 0.5, "no completion has an answer segment", ha="center", va="center", transform=axis.transAxes)
        return False
    offsets = np.random.default_rng(0).uniform(-jitter, jitter, size=len(x)) if jitter else np.zeros(len(x))
    # incorrect first, so that the (usually fewer) correct completions are drawn on top
    for is_correct, color, name, marker in (
        (False, INCORRECT_COLOR, "incorrect", "o"),
        (True, CORRECT_COLOR, "correct", "^"),
    ):
        chosen = defined & (correct == is_correct)
        if chosen.any():
            label = f"{name} (n={chosen.sum()})"
            axis.scatter(
                x[chosen] + offsets[chosen], y[chosen], s=10, alpha=0.55, color=color, marker=marker, label=label
            )
    axis.legend(fontsize=7)
    return True


def plot_length_vs_entropy(table: EntropyTable, path: str, title: str = "", note: str | None = None) -> str:
    """Answer length (tokens) vs answer entropy, coloured by correctness (is the proxy a length proxy?)."""
    fig, axis = plt.subplots(figsize=(4.8, 4.0))
    lengths = np.where(np.isnan(table.answer), np.nan, table.answer_tokens.astype(float))
    few_lengths = len(np.unique(lengths[~np.isnan(lengths)])) <= 30
    if _scatter(axis, lengths, table.answer, table.correct, jitter=0.15 if few_lengths else 0.0):
        defined = ~np.isnan(table.answer)
        if defined.sum() > 2 and np.ptp(lengths[defined]) > 0 and np.ptp(table.answer[defined]) > 0:
            rho = np.corrcoef(_ranks(lengths[defined]), _ranks(table.answer[defined]))
            axis.set_title((title + "\n" if title else "") + f"Spearman ρ = {rho[0, 1]:.2f}", fontsize=10)
        elif title:
            axis.set_title(title, fontsize=10)
    axis.set_xlabel("answer length (tokens after </think>)" + (", jittered" if few_lengths else ""))
    if few_lengths:
        from matplotlib.ticker import MaxNLocator

        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel("answer entropy")
    return _save(fig, path, note)


def plot_thinking_vs_answer(table: EntropyTable, path: str, title: str = "", note: str | None = None) -> str:
    """Thinking entropy vs answer entropy of each completion, coloured by correctness."""
    fig, axis = plt.subplots(figsize=(4.8, 4.0))
    _scatter(axis, table.thinking, table.answer, table.correct)
    axis.set_xlabel("thinking entropy")
    axis.set_ylabel("answer entropy")
    if title:
        axis.set_title(title, fontsize=10)
    return _save(fig, path, note)


FIGURES = {
    "entropy_density": plot_density,
    "roc_thinking_vs_answer": plot_roc,
    "answer_length_vs_entropy": plot_length_vs_entropy,
    "thinking_vs_answer_entropy": plot_thinking_vs_answer,
}


def plot_all(table: EntropyTable, output_dir: str, title: str = "", note: str | None = None) -> dict[str, str]:
    """Write the four figures into ``output_dir``; returns ``{name: path}``."""
    return {name: plot(table, os.path.join(output_dir, f"{name}.png"), title, note) for name, plot in FIGURES.items()}
