"""The synthetic arithmetic task: verifiable answers, disjoint splits, reproducible generation."""

from __future__ import annotations

import itertools
import random

import pytest
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from egpo_trl.data.synthetic import (
    DEFAULT_INSTRUCTION,
    LEVELS,
    MAX_OPERAND,
    SPLITS,
    SYNTHETIC_TASKS,
    ArithmeticProblem,
    load_synthetic_task,
    make_arithmetic_dataset,
    sample_problem,
    split_of,
)
from egpo_trl.rewards import boxed_accuracy_reward, extract_last_boxed, think_format_reward


def as_messages(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_dataset_has_the_columns_the_trainer_and_reward_use():
    dataset = make_arithmetic_dataset("train", 30, levels=(1, 2, 3), seed=0)
    assert isinstance(dataset, Dataset)
    assert set(dataset.column_names) == {"prompt", "answer", "level", "id", "problem", "solution"}
    row = dataset[0]
    assert row["prompt"] == [{"role": "user", "content": f"{row['problem']} {DEFAULT_INSTRUCTION}"}]
    assert isinstance(row["answer"], str) and row["answer"].isdigit()
    assert sorted(set(dataset["level"])) == [1, 2, 3]
    assert [dataset["level"].count(level) for level in (1, 2, 3)] == [10, 10, 10]


def test_reference_solutions_verify_with_the_project_reward():
    dataset = make_arithmetic_dataset("test", 120, levels=sorted(LEVELS), seed=3)
    rewards = boxed_accuracy_reward(as_messages(dataset["solution"]), dataset["answer"])
    assert rewards == [1.0] * len(dataset)
    assert think_format_reward(as_messages(dataset["solution"])) == [1.0] * len(dataset)


def test_a_wrong_answer_is_rejected_by_the_reward():
    dataset = make_arithmetic_dataset("test", 20, seed=0)
    wrong = [f"<think>guess</think> \\boxed{{{int(answer) + 1}}}" for answer in dataset["answer"]]
    assert boxed_accuracy_reward(as_messages(wrong), dataset["answer"]) == [-1.0] * len(dataset)


def test_splits_never_share_a_problem_whatever_the_seeds():
    # The id is a hash of the expression, so equal ids mean the same problem (whatever the question wording).
    ids = {
        split: {i for seed in (0, 1, 2) for i in make_arithmetic_dataset(split, 300, seed=seed)["id"]}
        for split in SPLITS
    }
    assert len(ids["train"]) > 600
    assert not ids["train"] & ids["test"]
    assert not ids["train"] & ids["validation"]
    assert not ids["validation"] & ids["test"]


def test_rows_of_one_split_are_distinct():
    dataset = make_arithmetic_dataset("train", 600, seed=0)
    assert len(set(dataset["id"])) == len(dataset)


def test_same_seed_same_rows_other_seed_other_rows():
    first = make_arithmetic_dataset("train", 50, seed=7)
    again = make_arithmetic_dataset("train", 50, seed=7)
    other = make_arithmetic_dataset("train", 50, seed=8)
    assert first.to_list() == again.to_list()
    assert first["id"] != other["id"]


def test_system_prompt_and_instruction_options():
    dataset = make_arithmetic_dataset("train", 4, seed=0, system_prompt="Be brief.", instruction=None)
    prompt = dataset[0]["prompt"]
    assert prompt[0] == {"role": "system", "content": "Be brief."}
    assert prompt[1] == {"role": "user", "content": dataset[0]["problem"]}


def test_levels_given_as_a_string():
    dataset = make_arithmetic_dataset("train", 8, levels="2, 4", seed=0)
    assert sorted(set(dataset["level"])) == [2, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "dev"}, "Unknown split"),
        ({"levels": (0,)}, "choose among"),
        ({"levels": "1,x"}, "comma-separated"),
        ({"levels": "1 2"}, "comma-separated integers such as .1,2,3."),
        ({"num_problems": 0}, "at least 1"),
        ({"levels": (1,), "num_problems": 5000, "split": "test"}, "too few distinct problems"),
    ],
)
def test_bad_arguments_give_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_arithmetic_dataset(**kwargs)


def test_registry_of_synthetic_tasks():
    assert "arithmetic" in SYNTHETIC_TASKS
    assert len(load_synthetic_task("arithmetic", split="validation", num_problems=5)) == 5
    with pytest.raises(ValueError, match="built-in tasks"):
        load_synthetic_task("geometry")


@settings(max_examples=50, deadline=None)
@given(level=st.sampled_from(sorted(LEVELS)), seed=st.integers(0, 10**6))
def test_problems_follow_their_level_and_their_solution_is_right(level, seed):
    problem = sample_problem(level, random.Random(seed))
    assert problem.level == level
    assert len(problem.operators) == level
    assert all(0 <= operand <= MAX_OPERAND for operand in problem.operands)
    # Left-to-right evaluation of + and - is Python's, and every running total stays in [0, 999].
    assert problem.answer == eval(problem.expression)  # noqa: S307 - digits, spaces, + and - only
    signed = [n if op == "+" else -n for op, n in zip(problem.operators, problem.operands[1:])]
    assert all(0 <= total <= 999 for total in itertools.accumulate(signed, initial=problem.operands[0]))
    assert extract_last_boxed(problem.solution()) == str(problem.answer)
    assert split_of(problem) in SPLITS


def test_split_is_a_function_of_the_problem_only():
    problem = ArithmeticProblem(operands=(12, 7), operators=("+",), level=1)
    same = ArithmeticProblem(operands=(12, 7), operators=("+",), level=1)
    assert split_of(problem) == split_of(same)
    assert problem.uid == same.uid
    assert problem.solution() == "<think>12+7=19</think> \\boxed{19}"
