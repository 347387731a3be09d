"""egpo-trl diagnose: per-segment entropy, ROC-AUC for incorrect answers, bootstrap intervals, plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from egpo_trl.diagnostics.cli import main as diagnose_main
from egpo_trl.diagnostics.metrics import bootstrap_gap_and_auc, entropy_table, roc_auc, roc_curve, scope_report
from egpo_trl.evaluation.records import RecordStore

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models run fastest on one thread; several threads on a busy CI machine spin against each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_auc_hand_computed():
    # incorrect answers (positives) score 0.35 and 0.8, correct ones 0.1 and 0.4:
    # pairs (0.35 > 0.1), (0.35 < 0.4), (0.8 > 0.1), (0.8 > 0.4) -> 3 of 4
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    # a tie counts one half: (1 vs 1) -> 0.5, (2 vs 1) -> 1; (0.5 + 1) / 2
    assert roc_auc([1.0, 1.0, 2.0], [False, True, True]) == pytest.approx(0.75)
    # NaN scores (an empty segment) are left out
    assert roc_auc([0.1, float("nan"), 0.9], [False, True, True]) == pytest.approx(1.0)
    assert math.isnan(roc_auc([0.1, 0.2], [True, True]))


def test_auc_and_roc_agree_with_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=300), 1)  # rounded: many ties
    positive = rng.random(300) < 0.3 + 0.4 * (scores > 0)
    assert roc_auc(scores, positive) == pytest.approx(metrics.roc_auc_score(positive, scores))
    fpr, tpr, _ = roc_curve(scores, positive)
    want_fpr, want_tpr, _ = metrics.roc_curve(positive, scores, drop_intermediate=False)
    assert np.allclose(fpr, want_fpr) and np.allclose(tpr, want_tpr)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)


def test_bootstrap_over_problems():
    # 4 problems x 2 samples; incorrect completions always have the higher entropy
    scores = np.array([0.1, 0.5, 0.2, 0.6, 0.15, 0.7, 0.3, 0.9])
    correct = np.array([True, False] * 4)
    group = np.repeat(np.arange(4), 2)
    gaps, aucs = bootstrap_gap_and_auc(scores, correct, group, num_resamples=300, seed=1)
    assert np.allclose(aucs, 1.0)
    point_gap = scores[~correct].mean() - scores[correct].mean()
    assert np.nanmin(gaps) <= point_gap <= np.nanmax(gaps)
    again, _ = bootstrap_gap_and_auc(scores, correct, group, num_resamples=300, seed=1)
    assert np.array_equal(gaps, again)  # seeded


def _records(tokenizer):
    """Hand-made records with known per-token log-probs: -1 in the thinking, -a in the answer, -5 on tags."""
    rows = [
        ("<think>1+2=3</think> \\boxed{3}", True, 0.5),
        ("<think>2+2=4</think> \\boxed{4}", True, 1.0),
        ("<think>1+1=3</think> \\boxed{3}", False, 2.0),
        ("<think>5+5=11</think> \\boxed{11}", False, 3.0),
        ("<think>9+9=", False, None),  # cut off: no answer segment
    ]
    think_ids = set(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    records = []
    for index, (text, correct, answer_nll) in enumerate(rows):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        logprobs, after = [], False
        for token in ids:
            if token in think_ids:
                logprobs.append(-5.0)
                after = after or token == tokenizer.convert_tokens_to_ids("</think>")
            else:
                logprobs.append(-answer_nll if after else -1.0)
        records.append(
            {
                "benchmark": "synthetic",
                "problem_id": str(index // 2),
                "sample": index % 2,
                "correct": correct,
                "completion_ids": ids,
                "logprobs": logprobs,
            }
        )
    return records


def test_entropy_table_from_token_ids(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    table = entropy_table(_records(tokenizer), tokenizer)
    assert np.allclose(table.thinking, 1.0)
    assert np.allclose(table.answer[:4], [0.5, 1.0, 2.0, 3.0]) and math.isnan(table.answer[4])
    assert table.answer_tokens[4] == 0 and table.thinking_tokens[4] == len("9+9=")
    report = scope_report(table, "answer", num_resamples=200)
    assert report["auc_incorrect"] == pytest.approx(1.0)
    assert report["num_completions"] == 4 and report["num_undefined"] == 1
    assert report["mean_entropy_correct"] == pytest.approx(0.75)
    assert report["mean_entropy_incorrect"] == pytest.approx(2.5)
    assert report["gap"] == pytest.approx(1.75)
    thinking = scope_report(table, "thinking", num_resamples=50)
    assert thinking["auc_incorrect"] == pytest.approx(0.5)  # same thinking entropy everywhere: chance


def test_diagnose_cli_writes_tables_and_figures(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = _records(tokenizer)
    path = tmp_path / "records.jsonl"
    RecordStore(str(path)).append(records)
    out = tmp_path / "diag"
    # these records carry no spans: the split needs the tokenizer
    assert diagnose_main([str(path), "--output-dir", str(out)]) == 2
    assert "--tokenizer" in capsys.readouterr().err

    argv = [str(path), "--output-dir", str(out), "--tokenizer", tiny_model_dir, "--bootstrap", "100", "--label", "t"]
    assert diagnose_main(argv) == 0
    report = json.loads((out / "diagnostics.json").read_text())
    assert report["scopes"]["answer"]["auc_incorrect"] == pytest.approx(1.0)
    assert report["num_with_answer_segment"] == 4
    markdown = (out / "diagnostics.md").read_text()
    assert "| t | 0.500 | 1.000 |" in markdown
    for name in (
        "entropy_density",
        "roc_thinking_vs_answer",
        "answer_length_vs_entropy",
        "thinking_vs_answer_entropy",
    ):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    assert len((out / "entropies.csv").read_text().splitlines()) == 1 + len(records)

    assert diagnose_main(argv) == 2  # never replaces earlier diagnostics silently
    assert "--overwrite" in capsys.readouterr().err
    assert diagnose_main(argv + ["--overwrite"]) == 0


def test_diagnose_uses_spans_written_by_eval(tiny_model_dir, tmp_path):
    """Records of `egpo-trl eval` carry the thinking/answer spans; the tokenizer is then not needed."""
    from transformers import AutoTokenizer

    from egpo_trl.evaluation.backends import SamplingSettings, TransformersBackend
    from egpo_trl.evaluation.benchmarks import resolve_benchmark
    from egpo_trl.evaluation.runner import evaluate

    backend = TransformersBackend(tiny_model_dir, device="cpu", batch_size=8)
    run = tmp_path / "run"
    evaluate(backend, "tiny", [resolve_benchmark("synthetic")], str(run), SamplingSettings(max_new_tokens=16), 2, 4)
    with_spans = entropy_table(RecordStore(str(run / "records" / "synthetic.jsonl")).load().values())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    recomputed = entropy_table(RecordStore(str(run / "records" / "synthetic.jsonl")).load().values(), tokenizer)
    for scope in ("completion", "thinking", "answer"):
        assert np.allclose(getattr(with_spans, scope), getattr(recomputed, scope), equal_nan=True)
    assert diagnose_main([str(run), "--bootstrap", "20"]) == 0
    assert (run / "diagnostics" / "diagnostics.json").exists()
