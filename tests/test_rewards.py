"""The outcome reward (paper Eq. 1) with real math-verify, and the last-box extraction."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
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
        (r"ok \boxed{4} then cut \boxed{1", None),  # the last box, cut off, is the answer: none
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


def test_a_cut_off_last_box_scores_wrong_even_after_a_correct_box():
    assert boxed_accuracy_reward([r"so \boxed{4}. Let me check: \boxed{4"], answer=["4"]) == [-1.0]


BOMBS = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{9^9^9}",
    r"\boxed{10^{387420489}}",
    r"\boxed{123456!}",
    r"\boxed{2**3**99}",
]


def _in_thread(func):
    result = []
    thread = threading.Thread(target=lambda: result.append(func()))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the reward did not return"
    return result[0]


def test_reward_returns_quickly_on_huge_powers_in_any_thread():
    start = time.monotonic()
    assert _in_thread(lambda: boxed_accuracy_reward(BOMBS, answer=["1"] * len(BOMBS))) == [-1.0] * len(BOMBS)
    assert boxed_accuracy_reward(BOMBS, answer=["1"] * len(BOMBS)) == [-1.0] * len(BOMBS)
    assert time.monotonic() - start < 10
    # A gold answer written the same way still matches (string comparison, no evaluation).
    assert boxed_accuracy_reward([r"\boxed{2^{2^{10}}}"], answer=["2^{2^{10}}"]) == [1.0]


def test_a_comparison_that_overruns_twice_is_left_unscored(monkeypatch, caplog):
    from egpo_trl import rewards

    # Without the size guards, the tower reaches sympy, which would compute 9^387420489 for minutes: the worker
    # process is killed at the deadline, from a thread, a fresh one overruns too, and the completion gets no reward.
    monkeypatch.setattr(rewards, "_too_costly", lambda answer: False)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 1.0)
    completions = [r"\boxed{9^{9^{9}}}", r"\boxed{3}"]
    with caplog.at_level(logging.WARNING, logger="egpo_trl.rewards"):
        assert _in_thread(lambda: boxed_accuracy_reward(completions, answer=["2", "3"])) == [None, 1.0]
    first, second = (record.getMessage() for record in caplog.records)
    assert first.startswith("math-verify timed out after 1 s comparing '9^{9^{9}}'") and "asking a fresh" in first
    assert second.startswith("math-verify timed out after 1 s") and "left unscored (reward None, not -1)" in second


def test_a_wrong_answer_slow_to_verify_scores_minus_one_and_is_remembered(monkeypatch, caplog):
    """A comparison that keeps computing past its CPU time is "no match", as math-verify's own timeout answers: -1,
    not unscored, and cached, so the same completion later costs nothing."""
    from egpo_trl import rewards

    monkeypatch.setattr(rewards, "VERIFY_CPU_LIMIT_S", 0.5)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 60.0)  # far beyond the CPU limit: only the latter can end it
    rewards._symbolic_match.cache_clear()
    answers_match("0", "1")  # the worker is up
    slow = ([r"\boxed{\sin(x)^{999}}"], [r"\cos(x)^{999}"])  # sympy computes this for minutes
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="egpo_trl.rewards"):
        assert boxed_accuracy_reward(*slow) == [-1.0]
    assert time.monotonic() - start < 30 and not caplog.records  # a verdict, not a stall
    start = time.monotonic()
    assert boxed_accuracy_reward(*slow) == [-1.0]
    assert time.monotonic() - start < 0.1


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_stalled_or_killed_worker_is_asked_again_not_remembered_as_wrong(monkeypatch, caplog, how):
    """A worker held up past the deadline (as a busy machine can hold it) or killed in the middle of a comparison
    is replaced and asked again: the correct answer scores +1, and the warning says which of the two happened."""
    from egpo_trl import rewards

    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 2.0 if how == "stopped" else 60.0)
    rewards._symbolic_match.cache_clear()  # every comparison below reaches the worker
    answers_match("0", "1")  # the worker is up
    worker = rewards._WORKER._proc.pid
    os.kill(worker, signal.SIGSTOP)  # it cannot answer until it is continued
    if how == "killed":
        threading.Timer(0.5, os.kill, (worker, signal.SIGKILL)).start()
    with caplog.at_level(logging.WARNING, logger="egpo_trl.rewards"):
        assert boxed_accuracy_reward([r"so \boxed{\frac{\sqrt{3}}{2}}"], answer=[r"\frac{1}{2}\sqrt{3}"]) == [1.0]
    (message,) = (record.getMessage() for record in caplog.records)
    cause = "timed out after 2 s" if how == "stopped" else "worker died (killed by SIGKILL)"
    assert message.startswith(f"math-verify {cause} comparing") and message.endswith("asking a fresh worker again.")


def test_the_worker_pipe_works_above_descriptor_1024():
    # A long-lived training process can hold over a thousand open files; the worker's pipe then gets a descriptor
    # >= 1024, which select.select refuses ("filedescriptor out of range").
    import os
    import resource

    from egpo_trl import rewards

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit on open files is {hard}")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = []
    try:
        rewards._WORKER.close()  # the next comparison starts a worker whose pipe comes after the held descriptors
        rewards._symbolic_match.cache_clear()
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert not answers_match("13", "12")
        assert rewards._WORKER._proc.stdout.fileno() >= 1024
        assert answers_match("0.5", r"\frac{1}{2}")
    finally:
        for fd in held:
            os.close(fd)
        rewards._WORKER.close()  # its descriptors are above the limit restored below
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
