"""egpo-trl eval: benchmark loading, answer scoring on real benchmark rows, pass@1, records, resume, backends."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import build_tiny_model

from egpo_trl.evaluation.backends import (
    SamplingSettings,
    TransformersBackend,
    default_max_new_tokens,
    vllm_available,
)
from egpo_trl.evaluation.benchmarks import build_messages, load_problems, resolve_benchmark
from egpo_trl.evaluation.cli import main as eval_main
from egpo_trl.evaluation.records import RecordStore, iter_records
from egpo_trl.evaluation.runner import evaluate
from egpo_trl.evaluation.scoring import choice_index, score_completion
from egpo_trl.evaluation.summary import benchmark_stats, compare_runs, pass_at_1

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models run fastest on one thread; several threads on a busy CI machine spin against each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _problems(name, limit=None):
    return load_problems(resolve_benchmark(name), limit)


def _score(spec, problem, completion):
    return score_completion(completion, problem.gold, spec.answer_format, problem.choices)


# ---------------------------------------------------------------------------------------------------------------
# Benchmarks and scoring on the vendored rows


@pytest.mark.parametrize(
    "name, rows",
    [("math500", 500), ("aime24", 30), ("amc23", 40), ("minerva", 272), ("gsm8k", 1319), ("mmlu_stem", 3018)],
)
def test_builtin_benchmarks_load_with_unique_ids(name, rows):
    spec, problems = _problems(name)
    assert len(problems) == rows
    assert len({problem.id for problem in problems}) == rows
    assert all(problem.gold and problem.gold[0] for problem in problems)
    messages = build_messages(problems[0], spec)
    assert messages[-1]["role"] == "user" and "\\boxed{}" in messages[-1]["content"]


def test_aime_zero_padded_answers():
    spec, problems = _problems("aime24")
    padded = [problem for problem in problems if problem.gold[0].startswith("0")]
    assert len(padded) == 7
    problem = next(problem for problem in problems if problem.gold == ["025"])
    assert _score(spec, problem, "so the answer is \\boxed{25}.") == ("25", True)
    assert _score(spec, problem, "\\boxed{025}")[1]
    assert not _score(spec, problem, "\\boxed{52}")[1]
    assert not _score(spec, problem, "\\boxed{250}")[1]


def test_amc_float_answers():
    spec, problems = _problems("amc23", limit=1)
    assert problems[0].gold == ["27"]  # stored as 27.0
    assert _score(spec, problems[0], "They meet \\boxed{27} miles from A.")[1]
    assert _score(spec, problems[0], "\\boxed{27.0}")[1]
    assert not _score(spec, problems[0], "\\boxed{18}")[1]


def test_gsm8k_reference_after_hashes():
    spec, problems = _problems("gsm8k", limit=3)
    assert problems[0].gold == ["18"] and problems[2].gold == ["70000"]
    assert _score(spec, problems[0], "She makes \\boxed{18} dollars.")[1]
    assert _score(spec, problems[0], "\\boxed{\\$18}")[1]
    assert _score(spec, problems[2], "\\boxed{70,000}")[1]
    assert not _score(spec, problems[2], "\\boxed{7000}")[1]
    assert _score(spec, problems[0], "#### 18") == (None, False)  # only the boxed answer counts


def test_math500_symbolic_answers():
    spec, problems = _problems("math500", limit=1)
    assert _score(spec, problems[0], "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}")[1]
    assert _score(spec, problems[0], "\\boxed{(3, \\frac{\\pi}{2})}")[1]
    assert not _score(spec, problems[0], "\\boxed{(3, \\pi)}")[1]
    # the last box counts, not any box
    assert not _score(spec, problems[0], "\\boxed{(3, \\frac{\\pi}{2})} no wait \\boxed{(3, \\pi)}")[1]


def test_minerva_units_and_scientific_notation():
    spec, problems = _problems("minerva")
    by_index = {problem.index: problem for problem in problems}
    assert by_index[0].gold[0] == "1.6"
    assert _score(spec, by_index[0], "\\boxed{1.6 \\mathrm{~cm}}")[1]
    assert _score(spec, by_index[0], "\\boxed{1.6}")[1]
    assert not _score(spec, by_index[0], "\\boxed{16}")[1]
    assert by_index[1].gold[0] == "4.5e33"
    assert _score(spec, by_index[1], "\\boxed{4.5 \\times 10^{33}}")[1]
    assert _score(spec, by_index[1], "\\boxed{4.5e33}")[1]
    assert not _score(spec, by_index[1], "\\boxed{4.5 \\times 10^{32}}")[1]
    # alternative spellings from the second vendored copy are accepted too
    assert any(len(problem.gold) > 1 for problem in problems)


def test_mmlu_stem_letter_or_choice_text():
    spec, problems = _problems("mmlu_stem", limit=5)
    problem = problems[0]
    assert problem.gold == ["2"] and len(problem.choices) == 4
    prompt = build_messages(problem, spec)[0]["content"]
    assert "C. reduce the carrying capacity" in prompt and "letter" in prompt
    for boxed in ("C", "(C)", "\\text{C}", "\\textbf{(C)}", "C. reduce the carrying capacity", problem.choices[2]):
        assert _score(spec, problem, f"Reasoning... \\boxed{{{boxed}}}") == ("C", True), boxed
    assert _score(spec, problem, "\\boxed{B}") == ("B", False)
    assert _score(spec, problem, "\\boxed{C} hmm, actually \\boxed{D}") == ("D", False)
    assert _score(spec, problem, "The answer is C.") == (None, False)
    assert _score(spec, problem, "\\boxed{E}") == ("E", False)  # names no choice
    assert choice_index("increase the mortality rate.", problem.choices) == 3


def test_local_files_with_custom_fields(tmp_path):
    rows = [{"uid": f"q{i}", "query": f"What is {i} + 1?", "target": str(i + 1)} for i in range(3)]
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    spec, problems = load_problems(
        resolve_benchmark(str(path), question_field="query", answer_field="target", id_field="uid")
    )
    assert spec.name == "custom" and spec.answer_format == "math"
    assert [problem.id for problem in problems] == ["q0", "q1", "q2"]
    assert _score(spec, problems[2], "\\boxed{3}")[1]

    json_path = tmp_path / "detect.json"
    json_path.write_text(json.dumps([{"question": "Q?", "answer": "x #### 1,200"}]))
    spec, problems = load_problems(resolve_benchmark(str(json_path)))
    assert (spec.question_field, spec.answer_format, problems[0].gold) == ("question", "gsm8k", ["1200"])

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet_path = tmp_path / "mc.parquet"
    table = pa.Table.from_pylist([{"problem": "Pick", "choices": ["red", "blue"], "answer": "B"}])
    pq.write_table(table, parquet_path)
    spec, problems = load_problems(resolve_benchmark(str(parquet_path)))
    assert spec.answer_format == "choice" and problems[0].gold == ["1"]
    assert _score(spec, problems[0], "\\boxed{blue}") == ("B", True)

    with pytest.raises(ValueError, match="--question-field"):
        load_problems(resolve_benchmark(str(path), question_field="prompt"))
    with pytest.raises(ValueError, match="Built-in benchmarks"):
        resolve_benchmark("no_such_benchmark")


def test_model_family_budgets():
    assert default_max_new_tokens("Qwen/Qwen2.5-Math-1.5B")[0] == 3072
    assert default_max_new_tokens("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")[0] == 16384
    assert default_max_new_tokens("/models/my-model")[0] == 3072


def test_budget_of_a_checkpoint_comes_from_its_chat_template_not_its_name(tiny_model_dir, tmp_path):
    from tiny_qwen2 import CHAT_TEMPLATE
    from transformers import AutoTokenizer

    # An R1-style checkpoint saved under a name that says nothing: its template opens the thinking segment.
    reasoning, plain = str(tmp_path / "outputs" / "run1"), str(tmp_path / "outputs" / "run2")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(plain)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
    tokenizer.save_pretrained(reasoning)
    tokens, reason = default_max_new_tokens(reasoning)
    assert tokens == 16384 and "chat template" in reason
    assert default_max_new_tokens("outputs/run1", tokenizer)[0] == 16384
    # A Qwen2.5-Math-style template has no tags: 3072, and the reason says what was looked at.
    tokens, reason = default_max_new_tokens(plain)
    assert tokens == 3072 and "chat template" in reason


# ---------------------------------------------------------------------------------------------------------------
# pass@1 and tables


def test_pass_at_1_hand_computed():
    stats = pass_at_1({"p1": {0: True, 1: False}, "p2": {0: True, 1: True}, "p3": {0: False, 1: False, 2: True}}, 2)
    # per problem: 0.5, 1.0, 0.0 -> 50 %; trials: [1, 1, 0] = 2/3 and [0, 1, 0] = 1/3; sample 2 is beyond k
    assert stats["pass@1"] == pytest.approx(50.0)
    # trials: sd = sqrt(((2/3 - 1/2)^2 + (1/3 - 1/2)^2) / 1) = sqrt(2) / 6, se = sd / sqrt(2) = 1/6
    assert stats["stderr_trials"] == pytest.approx(100 / 6)
    assert stats["stderr_problems"] == pytest.approx(100 * 0.5 / 3**0.5)


def test_a_sample_without_a_verdict_is_left_out_of_pass_at_1_and_counted(monkeypatch):
    from egpo_trl import rewards

    # Without the size guards the tower reaches sympy, which computes it in C past the deadline, twice: no verdict.
    monkeypatch.setattr(rewards, "_too_costly", lambda answer: False)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 0.5)
    stalled = r"so \boxed{9^{9^{9}}}"
    assert score_completion(stalled, ["2"], "math") == ("9^{9^{9}}", None)
    assert score_completion(stalled, ["9^{9^{9}}", "2"], "math") == ("9^{9^{9}}", True)  # a match decides

    records = [
        {"problem_id": "p1", "sample": 0, "correct": True},
        {"problem_id": "p1", "sample": 1, "correct": None},
        {"problem_id": "p2", "sample": 0, "correct": False},
        {"problem_id": "p2", "sample": 1, "correct": True},
    ]
    stats = benchmark_stats(records, num_samples=2, num_problems=2)
    assert stats["pass@1"] == pytest.approx(75.0)  # p1: 1 of 1 scored, p2: 1 of 2
    assert stats["unscored_samples"] == 1 and stats["finished_samples"] == 4 and stats["complete"]


def test_heldout_accuracy_leaves_unscored_completions_out(backend, caplog):
    from datasets import Dataset

    from egpo_trl.heldout import heldout_accuracy

    def judge(completions, answer, **kwargs):  # no verdict on the first problem, correct on the others
        return [None if gold == "1" else 1.0 for gold in answer]

    dataset = Dataset.from_dict({"prompt": ["1+0=", "1+1=", "2+1="], "answer": ["1", "2", "3"], "level": [1, 1, 2]})
    with caplog.at_level(logging.WARNING, logger="egpo_trl.heldout"):
        result = heldout_accuracy(
            backend.model, backend.tokenizer, dataset, max_new_tokens=4, num_samples=2, reward_func=judge
        )
    assert result.accuracy == 1.0 and result.by_level == {"1": 1.0, "2": 1.0}
    assert result.num_unscored == 2 and result.to_dict()["num_unscored"] == 2
    assert result.correct == [None, None, True, True, True, True]
    (message,) = (record.getMessage() for record in caplog.records)
    assert message.startswith("2 of 6 held-out completions got no verdict")


def test_compare_runs_prints_deltas():
    def summary(label, math500, gsm8k):
        bench = {"pass@1": math500, "complete": True, "display_name": "MATH-500"}
        return {
            "label": label,
            "protocol": {"num_samples": 8, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
            "benchmarks": {"math500": bench, "gsm8k": {"pass@1": gsm8k, "complete": True, "display_name": "GSM8K"}},
        }

    table = compare_runs([summary("base", 23.4, 58.16), summary("egpo", 74.0, 79.84)])
    lines = table.strip().splitlines()
    assert lines[0] == "| Model | MATH-500 | GSM8K | Average |"
    assert "| egpo | 74.00 (+50.60) | 79.84 (+21.68) | 76.92 (+36.14) |" in lines
    with pytest.raises(ValueError, match="at least two"):
        compare_runs([summary("a", 1, 2)])


# ---------------------------------------------------------------------------------------------------------------
# Records and the evaluation loop on a real (tiny, random) model


def test_record_store_survives_a_torn_line(tmp_path):
    store = RecordStore(str(tmp_path / "r.jsonl"))
    store.append([{"problem_id": "a", "sample": 0, "correct": True}])
    with open(store.path, "a") as handle:
        handle.write('{"problem_id": "a", "sample": 1, "corr')  # killed in the middle of a write
    store.append([{"problem_id": "a", "sample": 1, "correct": False}, {"problem_id": "a", "sample": 0, "x": 1}])
    records = store.load()
    assert sorted(records) == [("a", 0), ("a", 1)]
    assert records[("a", 0)]["correct"] is True  # first record of a key wins
    lines = open(store.path).read().splitlines()
    assert lines[1].endswith('"corr')  # the torn line is left as it was, not overwritten


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return TransformersBackend(tiny_model_dir, device="cpu", batch_size=4)


def test_evaluate_writes_records_with_model_logprobs(backend, tmp_path):
    settings = SamplingSettings(max_new_tokens=24)
    choice_file = tmp_path / "colors.jsonl"
    rows = [
        {"question": "Sky?", "choices": ["red", "blue"], "answer": 1},
        {"question": "Sky? " * 200, "choices": ["red", "blue"], "answer": 1},  # longer than the 512-token context
    ]
    choice_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    specs = [resolve_benchmark("synthetic"), resolve_benchmark(str(choice_file))]
    out = tmp_path / "run"
    summary = evaluate(
        backend, "tiny", specs, str(out), settings, num_samples=2, limit=3, progress=False, label="tiny"
    )
    assert set(summary["benchmarks"]) == {"synthetic", "colors"}
    assert summary["benchmarks"]["colors"]["finished_samples"] == 4
    assert summary["benchmarks"]["colors"]["prompt_too_long_percent"] == 50.0
    unreadable = [r for r in iter_records(str(out / "records" / "colors.jsonl")) if r["problem_id"] == "1"]
    assert [r["finish_reason"] for r in unreadable] == ["prompt_too_long"] * 2
    assert all(r["completion_ids"] == [] and r["correct"] is False for r in unreadable)
    assert summary["benchmarks"]["synthetic"]["finished_samples"] == 6
    assert (out / "summary.md").read_text().startswith("## Pass@1 (%) of tiny")

    records = list(iter_records(str(out / "records" / "synthetic.jsonl")))
    keys = [(record["problem_id"], record["sample"]) for record in records]
    assert len(keys) == len(set(keys)) == 6 and {sample for _, sample in keys} == {0, 1}
    model, tokenizer = backend.model, backend.tokenizer
    for record in records[:3]:
        assert len(record["completion_ids"]) == len(record["logprobs"]) == record["num_completion_tokens"]
        assert record["finish_reason"] in ("stop", "length")
        prompt_ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        assert len(prompt_ids) == record["num_prompt_tokens"]
        ids = torch.tensor([prompt_ids + record["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, torch.tensor(record["completion_ids"])[:, None]).squeeze(1)
        # the sampled tokens' log-probs under the model itself (raw logits, no temperature)
        assert torch.allclose(expected, torch.tensor(record["logprobs"]), atol=1e-4)
        assert record["entropy"] == pytest.approx(-sum(record["logprobs"]) / len(record["logprobs"]), abs=1e-4)
        assert record["thinking_span"][0] <= record["thinking_span"][1] <= record["answer_span"][1]

    # A second run with the same settings has nothing left to do and keeps every record.
    before = (out / "records" / "synthetic.jsonl").read_bytes()
    again = evaluate(backend, "tiny", specs, str(out), settings, num_samples=2, limit=3, progress=False)
    assert (out / "records" / "synthetic.jsonl").read_bytes() == before
    assert again["benchmarks"]["synthetic"]["pass@1"] == summary["benchmarks"]["synthetic"]["pass@1"]

    # More samples per problem: only the new (problem, sample) pairs are generated.
    evaluate(backend, "tiny", specs[:1], str(out), settings, num_samples=3, limit=3, progress=False)
    after = (out / "records" / "synthetic.jsonl").read_bytes()
    assert after.startswith(before) and len(after.splitlines()) == 9

    with pytest.raises(ValueError, match="--output-dir"):
        evaluate(backend, "tiny", specs, str(out), SamplingSettings(temperature=1.0, max_new_tokens=24))


@pytest.mark.slow
def test_resume_after_kill(tiny_model_dir, tmp_path):
    """Kill an evaluation after a few batches, rerun it: nothing lost, nothing duplicated."""
    model = tiny_model_dir
    out = tmp_path / "run"
    records_path = out / "records" / "synthetic.jsonl"
    command = [sys.executable, "-m", "egpo_trl.cli", "eval", "--model", model, "--benchmarks", "synthetic"]
    command += ["--limit", "4", "-k", "4", "--max-new-tokens", "32", "--batch-size", "2", "--output-dir", str(out)]
    command += ["--backend", "transformers", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "first-run.log", "w")
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if records_path.exists() and len(records_path.read_bytes().splitlines()) >= 4:
            break
        time.sleep(0.02)
    process.kill()
    process.wait()
    log.close()
    first = records_path.read_bytes()
    finished_before = len(list(iter_records(str(records_path))))
    assert 4 <= finished_before < 16, "the run must be interrupted part way"

    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = list(iter_records(str(records_path)))
    keys = [(r["problem_id"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == 16
    assert records_path.read_bytes().startswith(first)  # finished samples are never rewritten
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["synthetic"]["complete"]
    assert json.loads((out / "run.json").read_text())["resumed"]


def test_cli_bad_sampling_setting_names_the_field(tiny_model_dir, tmp_path, capsys):
    for flag, value, message in (("--top-p", "0", "top_p must be in (0, 1]"), ("--top-k", "-1", "top_k must be >= 0")):
        assert eval_main(["--model", tiny_model_dir, "--output-dir", str(tmp_path), flag, value]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and error.startswith(f"egpo-trl eval: {message}")
        assert "max_new_tokens" not in error  # no placeholder values


def test_cli_compare(tmp_path, capsys):
    for name, score in (("base", 10.0), ("tuned", 12.5)):
        (tmp_path / name).mkdir()
        summary = {"label": name, "benchmarks": {"gsm8k": {"pass@1": score, "complete": True}}}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert eval_main(["--compare", str(tmp_path / "base"), str(tmp_path / "tuned")]) == 0
    assert "| tuned | 12.50 (+2.50) | 12.50 (+2.50) |" in capsys.readouterr().out
    assert eval_main(["--compare", str(tmp_path / "base"), str(tmp_path / "missing")]) == 2


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed in this environment")
def test_vllm_backend_records(tmp_path):
    """The vLLM backend (GPU or the CPU build) writes the same records, with the model's log-probs."""
    model = build_tiny_model(str(tmp_path / "model"), hidden_size=128)  # vLLM's CPU attention wants head_dim 64
    out = tmp_path / "run"
    command = [sys.executable, "-m", "egpo_trl.cli", "eval", "--model", model, "--benchmarks", "synthetic"]
    command += ["--limit", "4", "-k", "2", "--max-new-tokens", "32", "--backend", "vllm", "--output-dir", str(out)]
    command += ["--gpu-memory-utilization", "0.25", "--max-model-len", "512", "--dtype", "float32", "--no-progress"]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = list(iter_records(str(out / "records" / "synthetic.jsonl")))
    assert len(records) == 8 and {r["backend"] for r in records} == {"vllm"}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for record in records[:4]:
        assert len(record["completion_ids"]) == len(record["logprobs"])
        prompt_ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + record["completion_ids"]])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, torch.tensor(record["completion_ids"])[:, None]).squeeze(1)
        assert torch.allclose(expected, torch.tensor(record["logprobs"]), atol=1e-3)
        assert tokenizer.decode(record["completion_ids"], skip_special_tokens=True) == record["completion"]
