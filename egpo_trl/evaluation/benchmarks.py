"""Benchmarks: built-ins vendored in ``egpo_trl/data/benchmarks/``, a local file or a Hub dataset."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from egpo_trl.evaluation.scoring import ANSWER_FORMATS, CHOICE_LETTERS, gold_answers

logger = logging.getLogger(__name__)


# The instruction of the paper's evaluation (Qwen2.5-Math's chain-of-thought prompt).
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = (
    "Please reason step by step, and put your final answer (the letter of the correct choice) within \\boxed{}."
)


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to load and score one benchmark: ``source`` is ``package:<path>``, ``synthetic:<task>``, a local file or
    ``hub:<dataset>``; ``instruction`` is appended to a text question."""

    name: str
    display_name: str
    source: str
    question_field: str = "problem"
    answer_field: str = "answer"
    answer_format: str = "math"
    choices_field: str | None = None
    id_field: str | None = None
    split: str = "test"
    subset: str | None = None
    instruction: str | None = MATH_INSTRUCTION


_MMLU = {"question_field": "question", "answer_format": "choice", "choices_field": "choices"}
_MINERVA = {"answer_field": "solution", "answer_format": "minerva", "id_field": "idx"}
BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec("math500", "MATH-500", "package:math500/test.jsonl", id_field="unique_id"),
        BenchmarkSpec("aime24", "AIME24", "package:aime24/test.jsonl", id_field="id"),
        BenchmarkSpec("amc23", "AMC23", "package:amc23/test.jsonl", id_field="id"),
        BenchmarkSpec(
            "mmlu_stem", "MMLU-STEM", "package:mmlu_stem/test.jsonl", **_MMLU, instruction=CHOICE_INSTRUCTION
        ),
        BenchmarkSpec("minerva", "Minerva", "package:minerva_math/test.jsonl", **_MINERVA),
        BenchmarkSpec("gsm8k", "GSM8K", "package:gsm8k/test.jsonl", "question", answer_format="gsm8k"),
        BenchmarkSpec("synthetic", "Synthetic", "synthetic:arithmetic", "prompt", id_field="id", instruction=None),
    )
}

# Column order of the paper's Table 1, then the other built-ins.
PAPER_ORDER = ("math500", "aime24", "mmlu_stem", "minerva", "gsm8k", "amc23", "synthetic")

_ALIASES = {"math-500": "math500", "math_500": "math500", "aime": "aime24", "aime2024": "aime24"}
_ALIASES |= {"aime_2024": "aime24", "amc": "amc23", "amc2023": "amc23", "mmlu-stem": "mmlu_stem"}
_ALIASES |= {"mmlustem": "mmlu_stem", "minerva_math": "minerva", "minerva-math": "minerva"}

_MINERVA_ALTERNATIVES = "package:minerva_math/test_with_answers.json"
_QUESTION_CANDIDATES = ("problem", "question", "prompt", "query", "input")
_ANSWER_CANDIDATES = ("answer", "final_answer", "gold", "target", "solution")
_CHOICES_CANDIDATES = ("choices", "options")


@dataclass
class Problem:
    """One benchmark question; ``gold`` lists the accepted answers (for multiple choice, the index)."""

    id: str
    index: int
    question: str | list[dict[str, str]]
    gold: list[str]
    choices: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _safe_name(text: str) -> str:
    keep = "".join(char if char.isalnum() or char in "-_." else "_" for char in text)
    return keep.strip("._") or "benchmark"


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in benchmark (or one of its aliases)."""
    return _ALIASES.get(name.lower(), name.lower()) in BENCHMARKS


def resolve_benchmark(name_or_path: str, **fields: str | None) -> BenchmarkSpec:
    """The :class:`BenchmarkSpec` of a built-in name, a local file or a Hub dataset; ``fields`` that are not
    ``None`` (``question_field``, ``split``, ...) override. Unset fields of a file are detected from its first row."""
    if fields.get("answer_format") not in (None, *ANSWER_FORMATS):
        raise ValueError(f"Unknown answer format {fields['answer_format']!r}; choose one of {ANSWER_FORMATS}.")
    key = _ALIASES.get(name_or_path.lower(), name_or_path.lower())
    overrides = {name: value for name, value in fields.items() if value is not None}
    if key in BENCHMARKS:
        return replace(BENCHMARKS[key], **overrides)
    if name_or_path.startswith("synthetic:"):
        task = name_or_path.split(":", 1)[1]
        spec = replace(BENCHMARKS["synthetic"], source=name_or_path, name=_safe_name(f"synthetic-{task}"))
        return replace(spec, **overrides)
    fields = {"question_field": "", "answer_field": "", "answer_format": "", **overrides}  # "": from the first row
    if os.path.exists(name_or_path):
        stem = os.path.splitext(os.path.basename(name_or_path.rstrip("/")))[0]
        return BenchmarkSpec(_safe_name(stem), stem, os.path.abspath(name_or_path), **fields)
    if name_or_path.startswith(("hub:", "hf:")) or "/" in name_or_path:
        dataset = name_or_path.split(":", 1)[1] if name_or_path.startswith(("hub:", "hf:")) else name_or_path
        return BenchmarkSpec(_safe_name(dataset.replace("/", "__")), dataset, f"hub:{dataset}", **fields)
    raise ValueError(
        f"Unknown benchmark {name_or_path!r}. Built-in benchmarks: {sorted(BENCHMARKS)}; otherwise give a local "
        ".jsonl/.json/.parquet file or a Hub dataset name such as 'hub:openai/gsm8k'."
    )


def _read_file(path: str) -> list[dict[str, Any]]:
    """The rows of a local ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file, or a vendored one."""
    if path.startswith("package:"):
        path = str(resources.files("egpo_trl.data").joinpath("benchmarks", *path.split(":", 1)[1].split("/")))
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"{path}: unsupported file type; give a .jsonl, .json or .parquet file.")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        data = (
            [json.loads(line) for line in text.splitlines() if line.strip()]
            if path.endswith(".jsonl")
            else json.loads(text)
        )
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error}).") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects (or a .jsonl file).")
    return data


def _detect_fields(spec: BenchmarkSpec, row: dict[str, Any]) -> BenchmarkSpec:
    def pick(current: str | None, candidates: Sequence[str], what: str, option: str) -> str:
        if current:
            if current not in row:
                raise ValueError(f"{spec.source}: no field {current!r} (fields: {sorted(row)}); fix {option}.")
            return current
        for candidate in candidates:
            if candidate in row:
                return candidate
        raise ValueError(
            f"{spec.source}: cannot tell which field holds the {what} (fields: {sorted(row)}); pass {option}."
        )

    question_field = pick(spec.question_field, _QUESTION_CANDIDATES, "question", "--question-field")
    answer_field = pick(spec.answer_field, _ANSWER_CANDIDATES, "reference answer", "--answer-field")
    choices_field = spec.choices_field or next((name for name in _CHOICES_CANDIDATES if name in row), None)
    answer, answer_format = row[answer_field], spec.answer_format
    if not answer_format:
        choice = choices_field and isinstance(row.get(choices_field), list) and not isinstance(answer, float)
        answer_format = "choice" if choice else "gsm8k" if isinstance(answer, str) and "####" in answer else "math"
    choices_field = choices_field if answer_format == "choice" else spec.choices_field
    instruction = CHOICE_INSTRUCTION if answer_format == "choice" and spec.instruction == MATH_INSTRUCTION else None
    spec = replace(spec, question_field=question_field, answer_field=answer_field, answer_format=answer_format)
    return replace(spec, choices_field=choices_field, instruction=instruction or spec.instruction)


def load_problems(spec: BenchmarkSpec, limit: int | None = None) -> tuple[BenchmarkSpec, list[Problem]]:
    """``(spec, problems)``: the first ``limit`` problems in file order, and the spec with detected fields filled in."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}.")
    if spec.source.startswith("synthetic:"):
        from egpo_trl.data.synthetic import load_synthetic_task

        task = spec.source.split(":", 1)[1]
        rows = load_synthetic_task(task, split=spec.split, num_problems=limit or 500).to_list()
    elif spec.source.startswith("hub:"):
        from datasets import load_dataset

        dataset = load_dataset(spec.source.split(":", 1)[1], spec.subset, split=spec.split)
        rows = dataset.select(range(min(limit or len(dataset), len(dataset)))).to_list()
    else:
        rows = _read_file(spec.source)[:limit]
    if not rows:
        raise ValueError(f"{spec.source}: no rows to evaluate.")
    spec = _detect_fields(spec, rows[0])
    alternatives = {}  # Minerva's alternative spellings of the answers, from a second vendored copy
    if spec.source == BENCHMARKS["minerva"].source:
        for row in _read_file(_MINERVA_ALTERNATIVES):
            alternatives[row["problem"].strip()] = [answer.strip() for answer in row.get("answer") or []]

    problems: list[Problem] = []
    for index, row in enumerate(rows):
        question = row.get(spec.question_field)
        if question is None or (isinstance(question, str) and not question.strip()):
            raise ValueError(f"{spec.source}, row {index}: empty question in field {spec.question_field!r}.")
        gold = gold_answers(row, spec.answer_format, spec.answer_field)
        for extra in alternatives.get(str(question).strip(), []):
            if extra and extra not in gold:
                gold.append(extra)
        choices = None
        if spec.answer_format == "choice":
            choices = row.get(spec.choices_field or "")
            if not isinstance(choices, list) or not choices:
                raise ValueError(f"{spec.source}, row {index}: no choices in field {spec.choices_field!r}.")
            if int(gold[0]) >= len(choices):
                raise ValueError(f"{spec.source}, row {index}: answer index {gold[0]} but {len(choices)} choices.")
        problem_id = row.get(spec.id_field) if spec.id_field else None
        meta = {key: row[key] for key in ("level", "subject", "type") if key in row}
        choices = [str(choice) for choice in choices] if choices else None
        problems.append(
            Problem(str(index if problem_id is None else problem_id), index, question, gold, choices, meta)
        )
    if len({problem.id for problem in problems}) != len(problems):
        logger.warning("%s: field %r has duplicate ids; using row indices as problem ids.", spec.name, spec.id_field)
        for problem in problems:
            problem.id = str(problem.index)
    return spec, problems


def build_messages(problem: Problem, spec: BenchmarkSpec, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages of a problem (the question, lettered choices and instruction, or its stored messages), after
    ``system_prompt`` unless they have a system message."""
    if isinstance(problem.question, list):
        messages = [dict(message) for message in problem.question]
    else:
        content = problem.question.strip()
        if problem.choices:
            lines = [f"{CHOICE_LETTERS[i]}. {choice}" for i, choice in enumerate(problem.choices)]
            content = f"{content}\n\n" + "\n".join(lines)
        if spec.instruction:
            content += ("\n\n" if problem.choices else "\n") + spec.instruction
        messages = [{"role": "user", "content": content}]
    if system_prompt and not any(message.get("role") == "system" for message in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
