"""Synthetic multi-step arithmetic with verifiable answers (``Compute 23 + 8 - 15.``), for demos, tests and the tiny
model; a problem's split is a stable hash of its expression, so splits never share a problem."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_INSTRUCTION = "Think step by step inside <think></think>, then put the final answer in \\boxed{}."
# Buckets of a stable 0-99 hash: test 0-9, validation 10-19, train 20-99.
SPLITS: dict[str, range] = {"test": range(0, 10), "validation": range(10, 20), "train": range(20, 100)}
QUESTION_TEMPLATES = ("Compute {expr}.", "What is {expr}?", "Calculate {expr}.", "Evaluate {expr}.")
# Level n chains n operations on operands in [0, MAX_OPERAND] (the first in [1, MAX_OPERAND]).
LEVELS = range(1, 7)
MAX_OPERAND = 30
# The slips of the imperfect teacher: how far a slipped result lands from the right one.
SLIP_OFFSETS = (-10, -2, -1, 1, 2, 10)


@dataclass(frozen=True)
class ArithmeticProblem:
    """One chain ``operands[0] op[0] operands[1] op[1] ...`` evaluated left to right."""

    operands: tuple[int, ...]
    operators: tuple[str, ...]
    level: int

    @property
    def expression(self) -> str:
        return " ".join([str(self.operands[0])] + [f"{op} {n}" for op, n in zip(self.operators, self.operands[1:])])

    @property
    def answer(self) -> int:
        return self.operands[0] + sum(n if op == "+" else -n for op, n in zip(self.operators, self.operands[1:]))

    @property
    def uid(self) -> str:
        return hashlib.blake2b(self.expression.encode(), digest_size=8).hexdigest()

    def solution(self, rng: random.Random | None = None, slip_prob: float = 0.0) -> str:
        """The worked solution; with ``rng``, each step slips by a small offset with probability ``slip_prob``."""
        total, thoughts = self.operands[0], []
        for operator, operand in zip(self.operators, self.operands[1:]):
            result = total + operand if operator == "+" else total - operand
            if slip_prob > 0 and rng.random() < slip_prob:
                offset = rng.choice(SLIP_OFFSETS)
                result += offset if result + offset >= 0 else 0
            thoughts.append(f"{total}{operator}{operand}={result}")
            total = result
        return f"<think>{', '.join(thoughts)}</think> \\boxed{{{total}}}"


def split_of(problem: ArithmeticProblem) -> str:
    """The split (``train``, ``validation`` or ``test``) a problem belongs to, from a stable hash of its expression."""
    bucket = int.from_bytes(hashlib.sha256(problem.expression.encode()).digest()[:8], "big") % 100
    return next(name for name, buckets in SPLITS.items() if bucket in buckets)


def sample_problem(level: int, rng: random.Random) -> ArithmeticProblem:
    """Draw one problem of ``level`` with ``rng``; the running total stays in [0, 999]."""
    if level not in LEVELS:
        raise ValueError(f"Unknown level {level}; the arithmetic task has levels {list(LEVELS)}.")
    total = rng.randint(1, MAX_OPERAND)
    operands, operators = [total], []
    for _ in range(level):
        if total > 0 and (total + MAX_OPERAND > 999 or rng.random() < 0.5):
            operand = rng.randint(0, min(total, MAX_OPERAND))
            operators.append("-")
            total -= operand
        else:
            operand = rng.randint(0, MAX_OPERAND)
            operators.append("+")
            total += operand
        operands.append(operand)
    return ArithmeticProblem(operands=tuple(operands), operators=tuple(operators), level=level)


def format_prompt(
    question: str, system_prompt: str | None = None, instruction: str | None = DEFAULT_INSTRUCTION
) -> list[dict[str, str]]:
    """TRL's conversational prompt: an optional system message, then the question with ``instruction`` appended."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": f"{question} {instruction}" if instruction else question}]


def make_arithmetic_dataset(
    split: str = "train",
    num_problems: int = 1000,
    levels: int | str | Sequence[int] = (1, 2, 3, 4, 5),
    seed: int = 0,
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
):
    """``num_problems`` distinct problems of one split, spread evenly over ``levels`` (e.g. ``"1,2,3"``), in a seeded
    shuffled order."""
    from datasets import Dataset

    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; choose one of {list(SPLITS)}.")
    if num_problems < 1:
        raise ValueError(f"num_problems must be at least 1, got {num_problems}.")
    parts = levels.split(",") if isinstance(levels, str) else [levels] if isinstance(levels, int) else levels
    if isinstance(levels, str) and not all(part.strip().isdigit() for part in parts if part.strip()):
        raise ValueError(f"levels={levels!r}: give comma-separated integers such as '1,2,3'.")
    levels = sorted({int(part) for part in parts if str(part).strip()})
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels={levels}: choose among {list(LEVELS)}.")
    rng = random.Random(f"egpo-arithmetic/{split}/{seed}")
    rows: list[dict[str, Any]] = []
    for index, level in enumerate(levels):
        wanted = num_problems // len(levels) + (1 if index < num_problems % len(levels) else 0)
        seen: set[str] = set()
        misses = 0  # draws in a row that gave no new problem of this split
        while len(seen) < wanted:
            problem = sample_problem(level, rng)
            if problem.expression in seen or split_of(problem) != split:
                misses += 1
                if misses > 5000:
                    raise ValueError(
                        f"Level {level} has too few distinct problems in the {split!r} split for {wanted} rows (found "
                        f"{len(seen)}); ask for fewer problems or include higher levels."
                    )
                continue
            misses = 0
            seen.add(problem.expression)
            question = rng.choice(QUESTION_TEMPLATES).format(expr=problem.expression)
            prompt = format_prompt(question, system_prompt=system_prompt, instruction=instruction)
            rows.append(
                {"prompt": prompt, "answer": str(problem.answer), "level": level, "id": f"arith-{problem.uid}"}
            )
            rows[-1].update(problem=question, solution=problem.solution())
    rng.shuffle(rows)
    return Dataset.from_list(rows)


# Built-in synthetic tasks, by the name recipes use (``dataset_name: synthetic:<name>``).
SYNTHETIC_TASKS = {"arithmetic": make_arithmetic_dataset}


def load_synthetic_task(name: str, **kwargs: Any):
    """The built-in synthetic task ``name`` (:data:`SYNTHETIC_TASKS`) built with ``kwargs``."""
    if name not in SYNTHETIC_TASKS:
        raise ValueError(f"Unknown synthetic task {name!r}; built-in tasks: {sorted(SYNTHETIC_TASKS)}.")
    return SYNTHETIC_TASKS[name](**kwargs)
