"""The outcome reward (paper Eq. 1) with real math-verify, and the last-box extraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from egpo_trl.rewards import answers_match, boxed_accuracy_reward, extract_last_boxed, think_format_reward

BENCHMARKS = Path(__file__).resolve().parents[1] / "egpo_trl" / "data" / "benchmarks"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{3}, finally \boxed{5}", "5"),
        (r"nested \boxed{\sqrt{\frac{a}{b}}} end", r"\sqrt{\frac{a}{b}}"),
        (r"\fbox{7}", "7"),
        (r"answer: \boxed 9", "9"),
        (r"cut off \boxed{12", None),
        (r"ok \boxed{4} then cut \boxed{1", "4"),
        ("no box at all", None),
        ("", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_reward_is_plus_minus_one_on_the_last_box():
    completions = [
        r"<think>2+2</think> \boxed{4}",
        r"\boxed{4} no wait \boxed{5}",  # math-verify on the whole text would see {4, 5}
        r"\boxed{\dfrac{1}{2}}",
        r"\boxed{0.5}",
        "I don't know",
        r"\boxed{4",
    ]
    answers = ["4", "4", r"\frac12", "1/2", "4", "4"]
    assert boxed_accuracy_reward(completions, answer=answers) == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]


def test_reward_accepts_chat_messages():
    completions = [[{"role": "assistant", "content": r"\boxed{10}"}], [{"role": "assistant", "content": "x"}]]
    assert boxed_accuracy_reward(completions, answer=["10", "10"]) == [1.0, -1.0]


def test_reward_on_real_benchmark_answers():
    rows = [json.loads(line) for line in (BENCHMARKS / "math500" / "test.jsonl").open()][:40]
    completions = [f"Therefore the answer is $\\boxed{{{row['answer']}}}$." for row in rows]
    assert boxed_accuracy_reward(completions, answer=[r["answer"] for r in rows]) == [1.0] * len(rows)
    shifted = [r["answer"] for r in rows[1:]] + [rows[0]["answer"]]
    assert boxed_accuracy_reward(completions, answer=shifted).count(1.0) < 5


def test_zero_padded_and_float_answers():
    assert answers_match("25", "025")
    assert answers_match("27", 27.0)
    assert not answers_match("26", 27.0)


def test_reward_never_raises_on_garbage():
    junk = [r"\boxed{\frac{}{}}", r"\boxed{" + "(" * 500 + "}", r"\boxed{\x\y\z}", "\\boxed{" + "1+" * 2000 + "1}"]
    assert boxed_accuracy_reward(junk, answer=["1"] * len(junk)) == [-1.0] * len(junk)


def test_mismatched_lengths_name_the_missing_column():
    with pytest.raises(ValueError, match="answer"):
        boxed_accuracy_reward(["a", "b"], answer=["1"])


def test_think_format_reward():
    assert think_format_reward([r"<think>a</think> \boxed{1}", r"\boxed{1}", "<think>a</think>"]) == [1.0, 0.0, 0.0]
