"""Entropy of evaluation records per segment (paper Eq. 5), ROC-AUC for predicting incorrect answers (Table 3),
bootstrap."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from egpo_trl.segments import DEFAULT_THINK_END, DEFAULT_THINK_START, segment_entropy, segment_masks

SCOPES = ("completion", "thinking", "answer")


@dataclass
class EntropyTable:
    """Per-completion entropies (``NaN`` for an empty segment), segment lengths and labels, aligned arrays."""

    completion: np.ndarray
    thinking: np.ndarray
    answer: np.ndarray
    thinking_tokens: np.ndarray
    answer_tokens: np.ndarray
    correct: np.ndarray
    group: np.ndarray
    benchmark: list[str]
    problem_id: list[str]
    sample: list[int]

    def __len__(self) -> int:
        return len(self.correct)


def _padded(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    values = pad_sequence([torch.tensor(row, dtype=dtype) for row in rows], batch_first=True)
    mask = pad_sequence([torch.ones(len(row), dtype=torch.long) for row in rows], batch_first=True)
    return values, mask


def _span_mask(spans: Sequence[Sequence[int]], mask: torch.Tensor) -> torch.Tensor:
    bounds = torch.tensor([list(span) for span in spans], dtype=torch.long).reshape(-1, 2)
    positions = torch.arange(mask.shape[1]).expand(len(spans), -1)
    return ((positions >= bounds[:, :1]) & (positions < bounds[:, 1:])).long() * mask


def entropy_table(
    records: Iterable[dict[str, Any]],
    tokenizer: Any = None,
    think_start: str = DEFAULT_THINK_START,
    think_end: str = DEFAULT_THINK_END,
    batch_size: int = 256,
) -> EntropyTable:
    """Per-completion entropy over the whole completion and each segment, of records with tokens and a verdict."""
    records = [record for record in records if record.get("logprobs")]
    unscored = sum(record.get("correct") is None for record in records)
    if unscored:
        logging.getLogger(__name__).warning("%d sample(s) without a verdict (correct: null) left out.", unscored)
        records = [record for record in records if record.get("correct") is not None]
    if not records:
        raise ValueError("No records with per-token log-probs (field 'logprobs') to analyse.")
    columns: dict[str, list] = {name: [] for name in (*SCOPES, "thinking_tokens", "answer_tokens")}
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        logps, mask = _padded([record["logprobs"] for record in batch], torch.float64)
        if tokenizer is not None:  # recompute the segments from the token ids
            if any("completion_ids" not in record for record in batch):
                raise ValueError("Recomputing segments with --tokenizer needs the records' 'completion_ids'.")
            ids, _ = _padded([record["completion_ids"] for record in batch], torch.long)
            thinking, answer = segment_masks(ids, mask, tokenizer, think_start, think_end)
        elif any("thinking_span" not in record or "answer_span" not in record for record in batch):
            raise ValueError("These records carry no thinking/answer spans; pass --tokenizer MODEL to compute them.")
        else:
            thinking = _span_mask([record["thinking_span"] for record in batch], mask)
            answer = _span_mask([record["answer_span"] for record in batch], mask)
        for name, segment in (("completion", mask), ("thinking", thinking), ("answer", answer)):
            columns[name] += segment_entropy(logps, segment).tolist()
        columns["thinking_tokens"] += thinking.sum(dim=1).tolist()
        columns["answer_tokens"] += answer.sum(dim=1).tolist()
    keys = [(str(record.get("benchmark", "")), str(record.get("problem_id", i))) for i, record in enumerate(records)]
    groups = {key: number for number, key in enumerate(dict.fromkeys(keys))}
    return EntropyTable(
        **{name: np.asarray(columns[name], dtype=float) for name in SCOPES},
        thinking_tokens=np.asarray(columns["thinking_tokens"], dtype=int),
        answer_tokens=np.asarray(columns["answer_tokens"], dtype=int),
        correct=np.asarray([bool(record["correct"]) for record in records]),
        group=np.asarray([groups[key] for key in keys], dtype=int),
        benchmark=[key[0] for key in keys],
        problem_id=[key[1] for key in keys],
        sample=[int(record.get("sample", 0)) for record in records],
    )


def _weighted_auc(scores: np.ndarray, positive: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUC for each row of ``weights`` (``[R, N]``): P(score_pos > score_neg) + 1/2 P(tie), pairs weighted."""
    order = np.argsort(scores, kind="mergesort")
    sorted_scores, sorted_positive = scores[order], positive[order].astype(float)
    weights = weights[:, order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    positive_weight = np.add.reduceat(weights * sorted_positive, starts, axis=1)
    negative_weight = np.add.reduceat(weights * (1.0 - sorted_positive), starts, axis=1)
    negatives_below = np.cumsum(negative_weight, axis=1) - negative_weight
    numerator = (positive_weight * (negatives_below + 0.5 * negative_weight)).sum(axis=1)
    denominator = positive_weight.sum(axis=1) * negative_weight.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / denominator, np.nan)


def _defined(scores: Sequence[float], positive: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    scores, positive = np.asarray(scores, dtype=float), np.asarray(positive, dtype=bool)
    keep = ~np.isnan(scores)
    return scores[keep], positive[keep]


def roc_auc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """ROC-AUC of ``scores`` for the ``positive`` class (ties count one half, ``NaN`` scores left out)."""
    scores, positive = _defined(scores, positive)
    return float(_weighted_auc(scores, positive, np.ones((1, len(scores))))[0]) if len(scores) else float("nan")


def roc_curve(scores: Sequence[float], positive: Sequence[bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fpr, tpr, thresholds)``, positive when ``score >= threshold``, from ``(0, 0)`` to ``(1, 1)``."""
    scores, positive = _defined(scores, positive)
    order = np.argsort(-scores, kind="mergesort")
    scores, positive = scores[order], positive[order]
    last_of_group = np.r_[scores[1:] != scores[:-1], True] if len(scores) else np.array([], dtype=bool)
    true_positives = np.cumsum(positive)[last_of_group]
    false_positives = np.cumsum(~positive)[last_of_group]
    tpr = true_positives / max(positive.sum(), 1)
    fpr = false_positives / max((~positive).sum(), 1)
    return np.r_[0.0, fpr], np.r_[0.0, tpr], np.r_[np.inf, scores[last_of_group]]


def bootstrap_gap_and_auc(
    scores: np.ndarray, correct: np.ndarray, group: np.ndarray, num_resamples: int = 1000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap replicates ``(gaps, aucs)`` of the entropy gap (incorrect minus correct mean) and of the AUC,
    resampling problems with all their completions (a cluster bootstrap)."""
    keep = ~np.isnan(scores)
    scores, correct, group = scores[keep], correct[keep].astype(bool), group[keep]
    if len(scores) == 0 or num_resamples < 1:
        return np.full(max(num_resamples, 0), np.nan), np.full(max(num_resamples, 0), np.nan)
    _, group = np.unique(group, return_inverse=True)
    num_groups = int(group.max()) + 1
    rng = np.random.default_rng(seed)
    gaps, aucs = [], []
    incorrect = ~correct
    for start in range(0, num_resamples, 200):
        size = min(200, num_resamples - start)
        counts = rng.multinomial(num_groups, np.full(num_groups, 1.0 / num_groups), size=size).astype(float)
        weights = counts[:, group]  # [size, N]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_incorrect = (weights * scores * incorrect).sum(1) / (weights * incorrect).sum(1)
            mean_correct = (weights * scores * correct).sum(1) / (weights * correct).sum(1)
        gaps.append(mean_incorrect - mean_correct)
        aucs.append(_weighted_auc(scores, incorrect, weights))
    return np.concatenate(gaps), np.concatenate(aucs)


def _interval(values: np.ndarray, level: float) -> list[float | None]:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return [None, None]
    tail = (1 - level) / 2
    return [float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))]


def nan_to_none(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def scope_report(
    table: EntropyTable, scope: str, num_resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """For one scope: AUC for predicting incorrect answers (Table 3), mean entropy of correct and incorrect
    completions and their gap (Sec. 5.4), with bootstrap intervals."""
    scores, correct = getattr(table, scope), table.correct
    defined = ~np.isnan(scores)
    gaps, aucs = bootstrap_gap_and_auc(scores, correct, table.group, num_resamples, seed)
    mean_correct = scores[defined & correct].mean() if (defined & correct).any() else np.nan
    mean_incorrect = scores[defined & ~correct].mean() if (defined & ~correct).any() else np.nan
    report = {"scope": scope, "num_completions": int(defined.sum()), "num_correct": int((defined & correct).sum())}
    report |= {"num_incorrect": int((defined & ~correct).sum()), "num_undefined": int((~defined).sum())}
    report |= {"auc_incorrect": nan_to_none(roc_auc(scores, ~correct)), "auc_interval": _interval(aucs, level)}
    report |= {
        "mean_entropy_correct": nan_to_none(mean_correct),
        "mean_entropy_incorrect": nan_to_none(mean_incorrect),
    }
    report |= {"gap": nan_to_none(mean_incorrect - mean_correct), "gap_interval": _interval(gaps, level)}
    return report | {"interval_level": level, "num_resamples": num_resamples}
