"""Build an RL training pool from OpenR1-Math-220k (or any pool in its schema): the paper's *OpenR1-Stable-10k*.

The stages of :data:`STAGES` run in order (paper appendix, Table 4), each switched and parameterised by a field
of :class:`OpenR1DataConfig`. The row-level stages run on a stream, chunk by chunk, so only the surviving
problems are held in memory; the output does not depend on the chunk size.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from egpo_trl.data.dedup import (
    DECONTAMINATION_BENCHMARKS,
    NearDuplicateIndex,
    load_benchmark_problems,
    minhashes,
)
from egpo_trl.rewards import answers_match, extract_last_boxed

logger = logging.getLogger(__name__)

QWEN_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BUCKETS = ("mixed", "entirely_correct", "entirely_incorrect", "unknown")
STAGES = {
    "answer": "single-value ground truth enforced, empty ground truth dropped",
    "min_generations": "at least `min_generations` recorded generations",
    "length": "prompt <= `max_prompt_tokens`, response <= `max_response_tokens` (tokenizer-based)",
    "boxed_match": "last \\boxed{} of the solution or of any generation matches the answer",
    "decontamination": "MinHash-LSH near duplicates of evaluation problems removed",
    "deduplication": "MinHash-LSH near duplicates inside the pool removed (first occurrence kept)",
    "sampling": "pool drawn with subset and bucket ratios",
    "validation_split": "validation problems held out of the pool",
    "final_prompt_length": "prompts longer than `final_max_prompt_tokens` dropped",
}
_RESPONSE_SOURCES = ("solution", "shortest_generation", "all_generations")
_CORRECTNESS_SOURCES = ("math_verify", "llama", "either")
_MARKER = "build_config.yaml"
_OPENR1_COLUMNS = [
    "problem",
    "solution",
    "answer",
    "source",
    "uuid",
    "generations",
    "correctness_math_verify",
    "correctness_llama",
]


@dataclass
class InputSpec:
    """One input: a streamed hub dataset (``path``) or local parquet/jsonl ``data_files``, labelled ``subset``."""

    subset: str
    path: str | None = None
    name: str | None = None
    split: str = "train"
    data_files: list[str] | None = None
    revision: str | None = None
    columns: list[str] | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data_files, str):
            self.data_files = [self.data_files]
        if bool(self.path) == bool(self.data_files):
            raise ValueError(
                f"input {self.subset!r}: give exactly one of `path` (a hub dataset name or local dataset folder) "
                "and `data_files` (local parquet/jsonl files)."
            )
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"input {self.subset!r}: `limit` must be >= 0 or null, got {self.limit}.")

    def describe(self) -> str:
        if self.data_files:
            return f"local files {', '.join(self.data_files)}"
        where = f"{self.path} (config {self.name or 'default'}, split {self.split}"
        return where + (f", revision {self.revision})" if self.revision else ")")

    def resolved_files(self) -> list[str]:
        """The local files of ``data_files``, globs expanded and sorted (an error if none exist)."""
        files: list[str] = []
        for pattern in self.data_files or []:
            matches = sorted(glob.glob(os.path.expanduser(pattern)))
            if not matches:
                raise FileNotFoundError(
                    f"input {self.subset!r}: no file matches {pattern!r} (relative paths are read from the current "
                    f"directory, {os.getcwd()})."
                )
            files += matches
        return files

    def iter_batches(self, batch_size: int) -> Iterator[dict[str, list]]:
        """Stream the input as column batches of at most ``batch_size`` rows (``limit`` rows in all at most)."""
        from datasets import load_dataset

        if self.data_files:
            files = self.resolved_files()
            kinds = {_file_kind(name) for name in files}
            if len(kinds) != 1 or None in kinds:
                raise ValueError(
                    f"input {self.subset!r}: data_files must all be parquet or all be jsonl/json, got {files}."
                )
            kind = kinds.pop()
            kwargs = {"columns": self.columns} if kind == "parquet" and self.columns else {}
            stream = load_dataset(kind, data_files=files, split="train", streaming=True, **kwargs)
        else:
            kwargs = {"columns": self.columns} if self.columns else {}
            stream = load_dataset(
                self.path, self.name, split=self.split, revision=self.revision, streaming=True, **kwargs
            )
        if self.limit is not None:
            stream = stream.take(self.limit)
        yield from stream.iter(batch_size=batch_size)


def _file_kind(name: str) -> str | None:
    lowered = name.lower()
    if lowered.endswith(".parquet"):
        return "parquet"
    if lowered.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    return None


def _default_inputs() -> list[InputSpec]:
    return [
        InputSpec(subset=subset, path="open-r1/OpenR1-Math-220k", name=subset, columns=list(_OPENR1_COLUMNS))
        for subset in ("default", "extended")
    ]


def _setting(default: Any, help: str) -> Any:
    if callable(default):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class OpenR1DataConfig:
    """Settings of the OpenR1-Stable-10k builder. Defaults are the paper's (appendix, Table 4)."""

    # Inputs and outputs
    inputs: list[InputSpec] = _setting(
        _default_inputs,
        "The pools to read, each {subset, path | data_files, name, split, revision, columns, limit}; `subset` labels "
        "the rows for `subset_ratios`. Default: OpenR1-Math-220k `default` and `extended` from the Hub, streamed.",
    )
    tokenizer: str = _setting("Qwen/Qwen2.5-Math-1.5B", "Tokenizer (hub name or local path) that counts tokens.")
    output_dir: str = _setting("outputs/data/openr1_stable_10k", "Where the dataset, report and removal log go.")
    overwrite: bool = _setting(False, "Replace an earlier output of this builder in `output_dir` (never another).")
    seed: int = _setting(42, "Seed of the pool sampling and of the validation split.")
    chunk_size: int = _setting(1000, "Rows read and filtered at a time (memory bound; does not change results).")
    save_parquet: bool = _setting(True, "Also write train.parquet and validation.parquet.")
    # Prompt format
    system_prompt: str | None = _setting(QWEN_MATH_INSTRUCTION, "System message of every prompt (null for none).")
    user_instruction: str | None = _setting(None, "Text appended to the problem in the user message (null: none).")
    # Stage 1: answers
    require_single_value_answer: bool = _setting(
        True, "Drop problems whose ground truth lists several values ('2, 3', 'x=1 or x=2', '\\pm 4')."
    )
    drop_empty_answers: bool = _setting(True, "Drop problems with an empty ground truth.")
    # Stage 2: generations
    min_generations: int = _setting(2, "Minimum number of non-empty recorded generations (0 disables the stage).")
    # Stage 3: lengths
    max_prompt_tokens: int | None = _setting(4096, "Maximum prompt tokens, chat template included (null disables).")
    max_response_tokens: int | None = _setting(4096, "Maximum response tokens (null disables).")
    response_length_source: str = _setting(
        "solution",
        "What `max_response_tokens` applies to: `solution`, `shortest_generation` (one generation fits) or "
        "`all_generations` (every generation fits).",
    )
    # Stage 4: boxed match
    boxed_match_filter: bool = _setting(
        True, "Keep a problem only if the last \\boxed{} of its solution or of a generation matches."
    )
    # Stages 5-6: MinHash-LSH
    decontaminate: bool = _setting(True, "Remove near duplicates of the `decontamination_benchmarks` problems.")
    decontamination_benchmarks: list[str] = _setting(
        lambda: list(DECONTAMINATION_BENCHMARKS),
        f"Vendored evaluation sets ({', '.join(DECONTAMINATION_BENCHMARKS)}) or .jsonl/.json/.parquet files with "
        "a `problem` or `question` field.",
    )
    deduplicate: bool = _setting(True, "Remove near duplicates inside the pool.")
    minhash_num_perm: int = _setting(128, "MinHash permutations.")
    minhash_threshold: float = _setting(0.8, "Estimated Jaccard similarity from which problems are near duplicates.")
    shingle_size: int = _setting(3, "Word n-gram size of the MinHash shingles.")
    # Stage 7: sampling
    correctness_source: str = _setting(
        "math_verify", "Correctness flags that define the buckets: `math_verify`, `llama` or `either`."
    )
    pool_size: int = _setting(10000, "Problems in the sampled pool (train + validation).")
    subset_ratios: dict[str, float] = _setting(
        lambda: {"default": 0.85, "extended": 0.15}, "Share of the pool from each input subset (sums to 1)."
    )
    bucket_ratios: dict[str, float] = _setting(
        lambda: {"mixed": 0.6, "entirely_correct": 0.4, "entirely_incorrect": 0.0},
        "Share of each subset's quota per correctness bucket (sums to 1); a share-0 bucket only fills shortfalls.",
    )
    fill_shortfall: bool = _setting(
        True,
        "Fill a short (subset, bucket) cell from the subset's other buckets, then other subsets (else: smaller pool).",
    )
    max_source_fraction: float | None = _setting(None, "Cap on the share of the pool from one `source` (null: none).")
    # Stage 8: validation
    val_size: int = _setting(128, "Problems of the pool held out for validation.")
    # Stage 9: final prompt filter
    final_max_prompt_tokens: int | None = _setting(1024, "Drop longer prompts at the end (null disables).")
    report_examples: int = _setting(5, "Examples of removed rows shown per stage in the report.")

    def __post_init__(self) -> None:
        self.inputs = [spec if isinstance(spec, InputSpec) else _input_from_dict(spec) for spec in self.inputs]
        if not self.inputs:
            raise ValueError("`inputs` is empty: give at least one pool to read.")
        subsets = [spec.subset for spec in self.inputs]
        if len(set(subsets)) != len(subsets):
            raise ValueError(f"input subsets must be distinct labels, got {subsets}.")
        if self.response_length_source not in _RESPONSE_SOURCES:
            raise ValueError(
                f"response_length_source={self.response_length_source!r}: choose one of {', '.join(_RESPONSE_SOURCES)}."
            )
        if self.correctness_source not in _CORRECTNESS_SOURCES:
            raise ValueError(
                f"correctness_source={self.correctness_source!r}: choose one of {', '.join(_CORRECTNESS_SOURCES)}."
            )
        self.subset_ratios = _check_ratios("subset_ratios", self.subset_ratios)
        self.bucket_ratios = _check_ratios("bucket_ratios", self.bucket_ratios)
        unknown_buckets = sorted(set(self.bucket_ratios) - set(BUCKETS))
        if unknown_buckets:
            raise ValueError(f"bucket_ratios has unknown buckets {unknown_buckets}; buckets are {', '.join(BUCKETS)}.")
        if set(self.subset_ratios) != set(subsets):
            raise ValueError(
                f"subset_ratios keys {sorted(self.subset_ratios)} must be the input subsets {sorted(subsets)}."
            )
        for name in ("pool_size", "chunk_size", "minhash_num_perm", "shingle_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not 0 <= self.val_size < self.pool_size:
            raise ValueError(
                f"val_size must be >= 0 and smaller than pool_size ({self.pool_size}), got {self.val_size}."
            )
        if self.min_generations < 0:
            raise ValueError(f"min_generations must be >= 0, got {self.min_generations}.")
        for name in ("max_prompt_tokens", "max_response_tokens", "final_max_prompt_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null (disabled), got {getattr(self, name)}.")
        if not 0.0 < self.minhash_threshold <= 1.0:
            raise ValueError(f"minhash_threshold must be in (0, 1], got {self.minhash_threshold}.")
        if self.max_source_fraction is not None and not 0.0 < self.max_source_fraction <= 1.0:
            raise ValueError(f"max_source_fraction must be in (0, 1] or null, got {self.max_source_fraction}.")
        if self.decontaminate and not self.decontamination_benchmarks:
            raise ValueError("decontaminate is true but decontamination_benchmarks is empty.")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OpenR1DataConfig:
        """A config from a mapping such as a parsed YAML recipe; unknown keys are an error."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}. Known settings: {', '.join(cls.field_names())}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> OpenR1DataConfig:
        """Load a YAML recipe, then apply ``overrides`` (setting name -> value) on top."""
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a recipe must be a YAML mapping of settings, got {type(values).__name__}.")
        values.update(overrides or {})
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _input_from_dict(values: Any) -> InputSpec:
    if not isinstance(values, dict):
        raise ValueError(
            f"each entry of `inputs` must be a mapping such as {{subset: default, path: ...}}, got {values!r}."
        )
    known = {f.name for f in dataclasses.fields(InputSpec)}
    unknown = sorted(set(values) - known)
    if unknown or "subset" not in values:
        raise ValueError(f"input {values!r}: needs `subset`, may hold {sorted(known)}; unknown keys {unknown}.")
    return InputSpec(**values)


def _check_ratios(name: str, ratios: Any) -> dict[str, float]:
    if not isinstance(ratios, dict) or not ratios:
        raise ValueError(
            f"{name} must be a non-empty mapping such as {{default: 0.85, extended: 0.15}}, got {ratios!r}."
        )
    ratios = {str(key): float(value) for key, value in ratios.items()}
    if any(value < 0 for value in ratios.values()) or not math.isclose(sum(ratios.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"{name} must be non-negative and sum to 1, got {ratios} (sum {sum(ratios.values()):g}).")
    return ratios


_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]")
_MULTI_WORD_RE = re.compile(r"\\text\s*\{\s*(?:or|and)\s*\}|\b(?:or|and)\b|\\q?quad\b|\\pm\b|\\mp\b")


def _answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def _single_answer(answer: Any) -> str:
    if isinstance(answer, (list, tuple)):
        return next((_answer_text(item) for item in answer if not is_empty_answer(item)), "")
    return _answer_text(answer)


def is_empty_answer(answer: Any) -> bool:
    """Whether a ground truth is empty: missing, blank, an empty list, or only ``$`` signs and spaces."""
    if isinstance(answer, (list, tuple)):
        return all(is_empty_answer(item) for item in answer)
    return not _answer_text(answer).strip("$ \t\n")


def is_single_value_answer(answer: Any) -> bool:
    """Whether a ground truth is one value: no list of alternatives, no top-level ``,``/``;``, "or"/"and", ``\\pm``."""
    if isinstance(answer, (list, tuple)):
        values = [item for item in answer if not is_empty_answer(item)]
        return len(values) <= 1 and all(is_single_value_answer(item) for item in values)
    text = _answer_text(answer)
    if _MULTI_WORD_RE.search(text):
        return False
    text = _LATEX_SPACE_RE.sub(" ", _THOUSANDS_RE.sub("", text))
    depth = 0
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif char in ",;" and depth == 0:
            return False
    return True


def correctness_bucket(row: dict[str, Any], source: str = "math_verify") -> str:
    """``mixed``, ``entirely_correct``, ``entirely_incorrect`` or ``unknown`` from the recorded correctness flags."""
    verify_flags = list(row.get("correctness_math_verify") or [])
    llama_flags = list(row.get("correctness_llama") or [])
    if source == "math_verify":
        flags = [bool(flag) for flag in verify_flags]
    elif source == "llama":
        flags = [bool(flag) for flag in llama_flags]
    else:
        size = max(len(verify_flags), len(llama_flags))
        verify_flags += [False] * (size - len(verify_flags))
        llama_flags += [False] * (size - len(llama_flags))
        flags = [bool(a) or bool(b) for a, b in zip(verify_flags, llama_flags)]
    if not flags:
        return "unknown"
    if all(flags):
        return "entirely_correct"
    if not any(flags):
        return "entirely_incorrect"
    return "mixed"


def _generations(row: dict[str, Any]) -> list[str]:
    return [text for text in (row.get("generations") or []) if isinstance(text, str) and text.strip()]


def _snippet(text: str, limit: int = 160) -> str:
    text = re.sub(r"\s+", " ", str(text)).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def apportion(total: int, ratios: dict[str, float]) -> dict[str, int]:
    """Split ``total`` into integer counts proportional to ``ratios`` (largest remainder; ties in key order)."""
    weight = sum(ratios.values())
    exact = {key: round(total * value / weight, 9) for key, value in ratios.items()}
    counts = {key: int(math.floor(value)) for key, value in exact.items()}
    order = sorted(ratios, key=lambda key: (-(exact[key] - counts[key]), list(ratios).index(key)))
    for key in order[: total - sum(counts.values())]:
        counts[key] += 1
    return counts


@dataclass(slots=True)
class _Candidate:
    id: str
    subset: str
    index: int
    problem: str
    answer: str
    source: str
    bucket: str


def sample_pool(candidates: Sequence[Any], config: OpenR1DataConfig) -> tuple[list[Any], dict[str, Any]]:
    """Draw ``pool_size`` problems split by ``subset_ratios``, each subset by ``bucket_ratios``.

    Each (subset, bucket) cell is shuffled with a seed of its own and its quota taken from the front; short
    cells are filled (``fill_shortfall``) from the same subset's other buckets, then from other subsets.
    Returns the pool and a summary of quotas, available and taken counts, and fills.
    """
    subsets = list(config.subset_ratios)
    present = {candidate.bucket for candidate in candidates}
    buckets = sorted(config.bucket_ratios, key=lambda name: (-config.bucket_ratios[name], BUCKETS.index(name)))
    buckets += [name for name in BUCKETS if name in present and name not in buckets]
    cells: dict[tuple[str, str], list[Any]] = {(s, b): [] for s in subsets for b in buckets}
    for candidate in candidates:
        cells[(candidate.subset, candidate.bucket)].append(candidate)
    for (subset, bucket), members in cells.items():
        random.Random(f"{config.seed}:{subset}:{bucket}").shuffle(members)

    pool_size = min(config.pool_size, len(candidates))
    cap = (
        math.inf if config.max_source_fraction is None else max(1, math.floor(config.max_source_fraction * pool_size))
    )
    per_source: Counter = Counter()
    subset_quota = apportion(config.pool_size, config.subset_ratios)
    summary: dict[str, Any] = {"cells": [], "filled": [], "requested": config.pool_size, "source_cap": None}
    if cap != math.inf:
        summary["source_cap"] = cap
    pool: list[Any] = []
    taken_per_subset: Counter = Counter()

    def take(members: list[Any], count: int) -> list[Any]:
        chosen, rest = [], []
        for candidate in members:
            if len(chosen) < count and per_source[candidate.source] < cap:
                chosen.append(candidate)
                per_source[candidate.source] += 1
            else:
                rest.append(candidate)
        members[:] = rest
        return chosen

    for subset in subsets:
        quota = apportion(subset_quota[subset], {b: config.bucket_ratios.get(b, 0.0) for b in buckets})
        for bucket in buckets:
            available = len(cells[(subset, bucket)])
            chosen = take(cells[(subset, bucket)], quota[bucket])
            pool += chosen
            taken_per_subset[subset] += len(chosen)
            summary["cells"].append(
                {
                    "subset": subset,
                    "bucket": bucket,
                    "quota": quota[bucket],
                    "available": available,
                    "taken": len(chosen),
                }
            )
    if config.fill_shortfall:
        order = [(s, b) for s in subsets for b in buckets]
        for subset in subsets + [None]:
            # First each subset fills its own quota, then the remaining gap is filled from any subset.
            wanted = (
                subset_quota[subset] - taken_per_subset[subset] if subset is not None else config.pool_size - len(pool)
            )
            for cell in order:
                if wanted <= 0:
                    break
                if subset is not None and cell[0] != subset:
                    continue
                chosen = take(cells[cell], wanted)
                if chosen:
                    pool += chosen
                    taken_per_subset[cell[0]] += len(chosen)
                    wanted -= len(chosen)
                    summary["filled"].append(
                        {"subset": cell[0], "bucket": cell[1], "count": len(chosen), "for": subset or "any subset"}
                    )
    summary["size"] = len(pool)
    return pool, summary


@dataclass
class StageStats:
    name: str
    enabled: bool = True
    setting: str = ""
    rows_in: Counter = field(default_factory=Counter)
    rows_out: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return sum(self.rows_in.values()) - sum(self.rows_out.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": STAGES[self.name],
            "enabled": self.enabled,
            "setting": self.setting,
            "rows_in": dict(self.rows_in),
            "rows_out": dict(self.rows_out),
            "removed": self.removed,
            "reasons": dict(self.reasons),
            "examples": self.examples,
        }


@dataclass
class BuildResult:
    """What :func:`build_openr1_dataset` produced: the splits, the statistics and where they were written."""

    dataset: Any  # datasets.DatasetDict with "train" and "validation"
    stats: dict[str, Any]
    output_dir: Path
    report_path: Path


class _Builder:
    def __init__(self, config: OpenR1DataConfig, command: str | None) -> None:
        self.config = config
        self.command = command
        self.stages = {name: StageStats(name) for name in STAGES}
        self._describe_stages()
        self._warned_no_template = False
        self.removal_log = None
        self.extra: dict[str, Any] = {"boxed_match_via": Counter(), "contamination_by_benchmark": Counter()}

    def _describe_stages(self) -> None:
        c = self.config
        s = self.stages
        s["answer"].enabled = c.require_single_value_answer or c.drop_empty_answers
        s["answer"].setting = f"single value: {c.require_single_value_answer}; drop empty: {c.drop_empty_answers}"
        s["min_generations"].enabled = c.min_generations > 0
        s["min_generations"].setting = f">= {c.min_generations} generations"
        s["length"].enabled = c.max_prompt_tokens is not None or c.max_response_tokens is not None
        limits = f"prompt <= {c.max_prompt_tokens}; {c.response_length_source} <= {c.max_response_tokens} tokens"
        s["length"].setting = limits
        s["boxed_match"].enabled = c.boxed_match_filter
        s["boxed_match"].setting = "solution or any generation"
        s["decontamination"].enabled = c.decontaminate
        minhash = f"num_perm={c.minhash_num_perm}, threshold={c.minhash_threshold}"
        s["decontamination"].setting = f"{', '.join(c.decontamination_benchmarks)}; {minhash}"
        s["deduplication"].enabled = c.deduplicate
        s["deduplication"].setting = minhash
        s["sampling"].setting = f"pool {c.pool_size}; subsets {c.subset_ratios}; buckets {c.bucket_ratios}"
        s["validation_split"].enabled = c.val_size > 0
        s["validation_split"].setting = f"{c.val_size} held out"
        s["final_prompt_length"].enabled = c.final_max_prompt_tokens is not None
        s["final_prompt_length"].setting = f"prompt <= {c.final_max_prompt_tokens} tokens"

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.config.tokenizer)
        except Exception as error:
            raise ValueError(
                f"could not load the tokenizer {self.config.tokenizer!r} ({error}). Set `tokenizer` to a hub name "
                "or a local folder holding tokenizer files."
            ) from error

    def prompt_messages(self, problem: str) -> list[dict[str, str]]:
        content = problem.strip()
        if self.config.user_instruction:
            content = f"{content}\n{self.config.user_instruction}"
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return messages + [{"role": "user", "content": content}]

    def prompt_token_counts(self, problems: Sequence[str]) -> list[int]:
        if not problems:
            return []
        tokenizer = self.tokenizer
        conversations = [self.prompt_messages(problem) for problem in problems]
        if getattr(tokenizer, "chat_template", None):
            texts = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
        else:
            if not self._warned_no_template:
                logger.warning(
                    "Tokenizer %s has no chat template: counting the messages' text only.", self.config.tokenizer
                )
                self._warned_no_template = True
            texts = ["\n\n".join(message["content"] for message in messages) for messages in conversations]
        return self.token_counts(texts)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        encoded = self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def remove(self, stage: str, row: dict[str, Any], reason: str, **details: Any) -> None:
        stats = self.stages[stage]
        stats.reasons[reason] += 1
        record = {"stage": stage, "reason": reason, "id": row["_id"], "subset": row["_subset"], "index": row["_index"]}
        record.update(details)
        self.removal_log.write(json.dumps(record, ensure_ascii=False) + "\n")
        if len(stats.examples) < self.config.report_examples:
            example = {**record, "problem": _snippet(row.get("problem", ""))}
            if "answer" in row:
                example["answer"] = _snippet(_answer_text(row["answer"]), 80)
            stats.examples.append(example)

    def run_stage(self, name: str, rows: list[dict[str, Any]], keep) -> list[dict[str, Any]]:
        """Apply a row filter ``keep(rows) -> list[bool]`` (which records its removals) and count rows in/out."""
        stats = self.stages[name]
        stats.rows_in.update(row["_subset"] for row in rows)
        if stats.enabled and rows:
            rows = [row for row, kept in zip(rows, keep(rows)) if kept]
        stats.rows_out.update(row["_subset"] for row in rows)
        return rows

    def keep_answer(self, rows):
        flags = []
        for row in rows:
            answer = row.get("answer")
            if self.config.drop_empty_answers and is_empty_answer(answer):
                self.remove("answer", row, "empty")
                flags.append(False)
            elif self.config.require_single_value_answer and not is_single_value_answer(answer):
                self.remove("answer", row, "multi_value")
                flags.append(False)
            else:
                flags.append(True)
        return flags

    def keep_min_generations(self, rows):
        flags = []
        for row in rows:
            count = len(_generations(row))
            flags.append(count >= self.config.min_generations)
            if not flags[-1]:
                self.remove("min_generations", row, "too_few_generations", generations=count)
        return flags

    def keep_length(self, rows):
        c = self.config
        flags = [True] * len(rows)
        if c.max_prompt_tokens is not None:
            for i, tokens in enumerate(self.prompt_token_counts([row["problem"] for row in rows])):
                if tokens > c.max_prompt_tokens:
                    flags[i] = False
                    self.remove("length", rows[i], "prompt_too_long", tokens=tokens)
        if c.max_response_tokens is not None:
            pending = [i for i in range(len(rows)) if flags[i]]
            if c.response_length_source == "solution":
                counts = self.token_counts([rows[i].get("solution") or "" for i in pending])
                lengths = dict(zip(pending, counts))
            else:
                texts, owners = [], []
                for i in pending:
                    generations = _generations(rows[i]) or [""]
                    texts += generations
                    owners += [i] * len(generations)
                lengths = {}
                pick = min if c.response_length_source == "shortest_generation" else max
                for owner, count in zip(owners, self.token_counts(texts)):
                    lengths[owner] = pick(lengths.get(owner, count), count)
            for i in pending:
                if lengths[i] > c.max_response_tokens:
                    flags[i] = False
                    self.remove("length", rows[i], "response_too_long", tokens=lengths[i])
        return flags

    def keep_boxed_match(self, rows):
        flags = []
        for row in rows:
            gold = _answer_text(row.get("answer"))
            via = None
            if answers_match(extract_last_boxed(row.get("solution") or ""), gold):
                via = "solution"
            else:
                for text in _generations(row):
                    if answers_match(extract_last_boxed(text), gold):
                        via = "generation"
                        break
            flags.append(via is not None)
            if via is None:
                self.remove(
                    "boxed_match", row, "no_matching_box", solution_box=extract_last_boxed(row.get("solution") or "")
                )
            else:
                self.extra["boxed_match_via"][via] += 1
        return flags

    def keep_decontaminated(self, rows, signatures):
        flags = []
        for row, signature in zip(rows, signatures):
            match = self.benchmark_index.best_match(signature)
            flags.append(match is None)
            if match is not None:
                problem = self.benchmark_problems[match[0]]
                self.extra["contamination_by_benchmark"][problem.benchmark] += 1
                self.remove(
                    "decontamination",
                    row,
                    "benchmark_near_duplicate",
                    benchmark=problem.benchmark,
                    benchmark_index=problem.index,
                    similarity=round(match[1], 4),
                    benchmark_problem=_snippet(problem.text),
                )
        return flags

    def keep_unique(self, rows, signatures):
        flags = []
        for row, signature in zip(rows, signatures):
            match = self.pool_index.best_match(signature)
            flags.append(match is None)
            if match is None:
                self.pool_index.add(signature)
                self.pool_members.append(row["_candidate"])
            else:
                kept = self.pool_members[match[0]]
                self.remove(
                    "deduplication",
                    row,
                    "pool_near_duplicate",
                    kept_id=kept.id,
                    similarity=round(match[1], 4),
                    kept_problem=_snippet(kept.problem),
                )
        return flags

    def process_chunk(self, rows: list[dict[str, Any]]) -> list[_Candidate]:
        c = self.config
        rows = self.run_stage("answer", rows, self.keep_answer)
        rows = self.run_stage("min_generations", rows, self.keep_min_generations)
        rows = self.run_stage("length", rows, self.keep_length)
        rows = self.run_stage("boxed_match", rows, self.keep_boxed_match)
        if (c.decontaminate or c.deduplicate) and rows:
            computed = minhashes([row["problem"] for row in rows], c.minhash_num_perm, c.shingle_size)
            for row, signature in zip(rows, computed):
                row["_minhash"] = signature

        def signatures(selected):
            return [row["_minhash"] for row in selected]

        rows = self.run_stage(
            "decontamination", rows, lambda selected: self.keep_decontaminated(selected, signatures(selected))
        )
        for row in rows:
            row["_candidate"] = _Candidate(
                id=row["_id"],
                subset=sys.intern(row["_subset"]),
                index=row["_index"],
                problem=row["problem"].strip(),
                answer=_single_answer(row["answer"]),
                source=sys.intern(str(row.get("source") or "unknown")),
                bucket=correctness_bucket(row, c.correctness_source),
            )
        rows = self.run_stage("deduplication", rows, lambda selected: self.keep_unique(selected, signatures(selected)))
        return [row["_candidate"] for row in rows]

    def read_rows(self, spec: InputSpec) -> Iterator[list[dict[str, Any]]]:
        index = 0
        checked = False
        for batch in spec.iter_batches(self.config.chunk_size):
            if not checked:
                self.check_columns(spec, set(batch))
                checked = True
            size = len(next(iter(batch.values())))
            rows = []
            for i in range(size):
                row = {key: values[i] for key, values in batch.items()}
                uuid = row.get("uuid")
                row["_id"] = str(uuid) if uuid else f"{spec.subset}-{index:07d}"
                row["_subset"] = spec.subset
                row["_index"] = index
                row["problem"] = str(row.get("problem") or "")
                rows.append(row)
                index += 1
            yield rows

    def check_columns(self, spec: InputSpec, columns: set[str]) -> None:
        c = self.config
        needed = {"problem", "answer"}
        if c.min_generations > 0 or c.boxed_match_filter or c.response_length_source != "solution":
            needed.add("generations")
        if c.correctness_source in ("math_verify", "either"):
            needed.add("correctness_math_verify")
        if c.correctness_source in ("llama", "either"):
            needed.add("correctness_llama")
        if c.max_response_tokens is not None and c.response_length_source == "solution":
            needed.add("solution")
        missing = sorted(needed - columns)
        if missing:
            raise ValueError(
                f"input {spec.subset!r} ({spec.describe()}) lacks the column(s) {missing} of OpenR1-Math-220k's schema; "
                f"it has {sorted(columns)}. Add them, or disable the stages that need them."
            )

    def build(self) -> BuildResult:
        from datasets import Dataset, DatasetDict

        c = self.config
        started = time.time()
        output_dir = Path(c.output_dir).expanduser().resolve()
        _check_output_dir(output_dir, c.overwrite)
        staging = output_dir.parent / f".{output_dir.name}.partial-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        try:
            if c.decontaminate:
                self.benchmark_problems = load_benchmark_problems(c.decontamination_benchmarks)
                self.benchmark_index = NearDuplicateIndex(c.minhash_threshold, c.minhash_num_perm)
                for signature in minhashes(
                    [problem.text for problem in self.benchmark_problems], c.minhash_num_perm, c.shingle_size
                ):
                    self.benchmark_index.add(signature)
            self.pool_index = NearDuplicateIndex(c.minhash_threshold, c.minhash_num_perm)
            self.pool_members: list[_Candidate] = []  # the rows in `pool_index`, by position
            candidates: list[_Candidate] = []
            rows_read: Counter = Counter()
            with open(staging / "removed.jsonl", "w", encoding="utf-8") as self.removal_log:
                for spec in c.inputs:
                    logger.info("Reading %s: %s", spec.subset, spec.describe())
                    for rows in self.read_rows(spec):
                        rows_read[spec.subset] += len(rows)
                        candidates += self.process_chunk(rows)
                        logger.info(
                            "%s: %d rows read, %d candidates so far (%.0f s)",
                            spec.subset,
                            rows_read[spec.subset],
                            len(candidates),
                            time.time() - started,
                        )
                candidate_buckets = Counter((cand.subset, cand.bucket) for cand in candidates)

                # Stage 7: sampling.
                sampling = self.stages["sampling"]
                sampling.rows_in.update(cand.subset for cand in candidates)
                pool, sampling_summary = sample_pool(candidates, c)
                sampling.rows_out.update(cand.subset for cand in pool)
                del candidates
                if sampling_summary["size"] < c.pool_size:
                    logger.warning("The pool has %d problems, fewer than pool_size=%d.", len(pool), c.pool_size)

                # Stage 8: validation split.
                split = self.stages["validation_split"]
                split.rows_in.update(cand.subset for cand in pool)
                order = list(pool)
                random.Random(f"{c.seed}:validation").shuffle(order)
                validation, train = order[: c.val_size], order[c.val_size :]
                split.rows_out.update(cand.subset for cand in train)

                # Stage 9: final prompt filter on both splits.
                final = self.stages["final_prompt_length"]
                splits = {"train": train, "validation": validation}
                for name in splits:
                    final.rows_in.update(cand.subset for cand in splits[name])
                    if final.enabled and splits[name]:
                        counts = self.prompt_token_counts([cand.problem for cand in splits[name]])
                        kept = []
                        for cand, tokens in zip(splits[name], counts):
                            if tokens > c.final_max_prompt_tokens:
                                row = {
                                    "_id": cand.id,
                                    "_subset": cand.subset,
                                    "_index": cand.index,
                                    "problem": cand.problem,
                                }
                                self.remove("final_prompt_length", row, "prompt_too_long", tokens=tokens, split=name)
                            else:
                                kept.append(cand)
                        splits[name] = kept
                    final.rows_out.update(cand.subset for cand in splits[name])

            dataset = DatasetDict(
                {name: Dataset.from_list([self.record(cand) for cand in rows]) for name, rows in splits.items()}
            )
            for name in dataset:
                if len(dataset[name]) == 0:
                    dataset[name] = Dataset.from_dict({key: [] for key in self.record_columns()})
            dataset.save_to_disk(str(staging / "dataset"))
            if c.save_parquet:
                for name, split_dataset in dataset.items():
                    split_dataset.to_parquet(str(staging / f"{name}.parquet"))
            stats = self.collect_stats(rows_read, candidate_buckets, sampling_summary, pool, splits, dataset, started)
            (staging / "stats.json").write_text(
                json.dumps(stats, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
            from egpo_trl.data.report import render_report

            (staging / "report.md").write_text(render_report(stats), encoding="utf-8")
            with open(staging / _MARKER, "w", encoding="utf-8") as handle:
                yaml.safe_dump(c.to_dict(), handle, sort_keys=False, allow_unicode=True)
            _publish(staging, output_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info(
            "Wrote %s (train %d, validation %d).", output_dir, len(dataset["train"]), len(dataset["validation"])
        )
        return BuildResult(dataset=dataset, stats=stats, output_dir=output_dir, report_path=output_dir / "report.md")

    @staticmethod
    def record_columns() -> list[str]:
        return ["prompt", "answer", "problem", "id", "subset", "bucket", "source"]

    def record(self, cand: _Candidate) -> dict[str, Any]:
        return {
            "prompt": self.prompt_messages(cand.problem),
            "answer": cand.answer,
            "problem": cand.problem,
            "id": cand.id,
            "subset": cand.subset,
            "bucket": cand.bucket,
            "source": cand.source,
        }

    def collect_stats(self, rows_read, candidate_buckets, sampling_summary, pool, splits, dataset, started):
        c = self.config

        def shares(rows, key):
            counts = Counter(getattr(row, key) for row in rows)
            return {name: counts[name] for name in sorted(counts)}

        return {
            "command": self.command,
            "seed": c.seed,
            "tokenizer": c.tokenizer,
            "inputs": [
                {"subset": spec.subset, "source": spec.describe(), "rows": rows_read[spec.subset]} for spec in c.inputs
            ],
            "rows_read": sum(rows_read.values()),
            "stages": [self.stages[name].to_dict() for name in STAGES],
            "boxed_match_via": dict(self.extra["boxed_match_via"]),
            "contamination_by_benchmark": dict(self.extra["contamination_by_benchmark"]),
            "candidates": [
                {"subset": subset, "bucket": bucket, "count": count}
                for (subset, bucket), count in sorted(candidate_buckets.items())
            ],
            "sampling": sampling_summary,
            "pool": {
                "size": len(pool),
                "subsets": shares(pool, "subset"),
                "buckets": shares(pool, "bucket"),
                "cells": dict(Counter(f"{row.subset}/{row.bucket}" for row in pool)),
            },
            "splits": {
                name: {"rows": len(rows), "subsets": shares(rows, "subset"), "buckets": shares(rows, "bucket")}
                for name, rows in splits.items()
            },
            "content_sha256": {name: _content_hash(split) for name, split in dataset.items()},
            "config": c.to_dict(),
            "elapsed_s": round(time.time() - started, 1),
        }


def _content_hash(dataset) -> str:
    digest = hashlib.sha256()
    for row in dataset:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def _check_output_dir(output_dir: Path, overwrite: bool) -> None:
    if not output_dir.exists() or (output_dir.is_dir() and not any(output_dir.iterdir())):
        return
    if not output_dir.is_dir():
        raise FileExistsError(f"output_dir {output_dir} exists and is not a folder; choose another `output_dir`.")
    if not overwrite:
        raise FileExistsError(
            f"output_dir {output_dir} already exists and is not empty. Pass `--overwrite true` to replace an earlier "
            "build there, or choose another `output_dir`."
        )
    if not (output_dir / _MARKER).is_file():
        raise FileExistsError(
            f"output_dir {output_dir} is not empty and was not written by this builder (no {_MARKER}); refusing to "
            "replace it even with `overwrite: true`. Choose another `output_dir`."
        )


def _publish(staging: Path, output_dir: Path) -> None:
    """Move the finished build into place; an earlier build is removed only once the new one is complete."""
    backup = None
    if output_dir.exists():
        backup = output_dir.parent / f".{output_dir.name}.previous-{os.getpid()}"
        output_dir.rename(backup)
    staging.rename(output_dir)
    if backup is not None:
        shutil.rmtree(backup)


def build_openr1_dataset(config: OpenR1DataConfig, command: str | None = None) -> BuildResult:
    """Run the recipe of ``config`` and write ``config.output_dir`` atomically.

    Writes ``dataset/`` (``save_to_disk``: ``train`` and ``validation`` with columns ``prompt``, ``answer``,
    ``problem``, ``id``, ``subset``, ``bucket``, ``source``), the parquet files, ``report.md``, ``stats.json``,
    ``removed.jsonl`` and ``build_config.yaml``.
    """
    return _Builder(config, command).build()
