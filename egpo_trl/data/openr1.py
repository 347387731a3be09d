"""Build the paper's *OpenR1-Stable-10k* RL pool from OpenR1-Math-220k (or any pool in its schema), running the
stages of :data:`STAGES` in order (paper appendix, Table 4) on a stream, chunk by chunk."""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections import Counter, namedtuple
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from egpo_trl.data.dedup import DECONTAMINATION_BENCHMARKS, NearDuplicateIndex, benchmark_index, minhashes
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
_MARKER = "build_config.yaml"
_OPENR1_COLUMNS = "problem solution answer source uuid generations correctness_math_verify correctness_llama".split()
RECORD_COLUMNS = ["prompt", "answer", "problem", "id", "subset", "bucket", "source"]
_Candidate = namedtuple("_Candidate", "id subset index problem answer source bucket")
# What build_openr1_dataset produced: the splits (a DatasetDict), the statistics and where they were written.
BuildResult = namedtuple("BuildResult", "dataset stats output_dir report_path")


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
        revision = f", revision {self.revision}" if self.revision else ""
        return f"{self.path} (config {self.name or 'default'}, split {self.split}{revision})"

    def stream(self):
        """The input as a streamed ``datasets.IterableDataset`` (``limit`` rows at most)."""
        from datasets import load_dataset

        columns = {"columns": self.columns} if self.columns else {}
        source, options = (self.path, self.name), {"split": self.split, "revision": self.revision}
        if self.data_files:
            files = [sorted(glob.glob(os.path.expanduser(name))) for name in self.data_files]
            if not all(files):
                raise FileNotFoundError(f"input {self.subset!r}: no file matches {self.data_files}, cwd {os.getcwd()}")
            files = [name for matches in files for name in matches]
            kind = "parquet" if all(name.lower().endswith(".parquet") for name in files) else "json"
            if kind == "json" and not all(".json" in name.lower() for name in files):
                raise ValueError(f"{self.subset!r}: data_files must all be parquet or all be jsonl/json: {files}")
            source, options = (kind,), {"data_files": files, "split": "train"}
            columns = columns if kind == "parquet" else {}
        stream = load_dataset(*source, streaming=True, **options, **columns)
        return stream if self.limit is None else stream.take(self.limit)


def _setting(default: Any, help: str) -> Any:
    return field(**{"default_factory" if callable(default) else "default": default}, metadata={"help": help})


@dataclass
class OpenR1DataConfig:
    """Settings of the OpenR1-Stable-10k builder. Defaults are the paper's (appendix, Table 4)."""

    # Inputs and outputs
    inputs: list[InputSpec] = _setting(
        lambda: [
            InputSpec(subset=name, path="open-r1/OpenR1-Math-220k", name=name, columns=list(_OPENR1_COLUMNS))
            for name in ("default", "extended")
        ],
        "The pools to read, each {subset, path | data_files, name, split, revision, columns, limit}; `subset` labels "
        "the rows for `subset_ratios`. Default: OpenR1-Math-220k `default` and `extended` from the Hub, streamed.",
    )
    tokenizer: str | None = _setting(
        "Qwen/Qwen2.5-Math-1.5B",
        "Tokenizer (hub name or local path) that counts tokens (null: none, no token limits).",
    )
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
        known = {f.name for f in dataclasses.fields(InputSpec)}
        for spec in [spec for spec in self.inputs if not isinstance(spec, InputSpec)]:
            if not isinstance(spec, dict) or set(spec) - known or "subset" not in spec:
                raise ValueError(f"each input is a mapping with `subset` and some of {sorted(known)}, got {spec!r}.")
        self.inputs = [spec if isinstance(spec, InputSpec) else InputSpec(**spec) for spec in self.inputs]
        subsets = [spec.subset for spec in self.inputs]
        if not subsets or len(set(subsets)) != len(subsets):
            raise ValueError(f"`inputs` must hold at least one pool, with distinct subset labels; got {subsets}.")
        for name, choices in (
            ("response_length_source", "solution, shortest_generation, all_generations"),
            ("correctness_source", "math_verify, llama, either"),
        ):
            if getattr(self, name) not in choices.split(", "):
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {choices}.")
        for name in ("subset_ratios", "bucket_ratios"):
            ratios = getattr(self, name)
            if not isinstance(ratios, dict) or not ratios:
                raise ValueError(f"{name} must be a non-empty mapping such as {{default: 0.85, extended: 0.15}}.")
            ratios = {str(key): float(value) for key, value in ratios.items()}
            total = sum(ratios.values())
            if any(value < 0 for value in ratios.values()) or not math.isclose(total, 1.0, abs_tol=1e-6):
                raise ValueError(f"{name} must be non-negative and sum to 1, got {ratios} (sum {total:g}).")
            setattr(self, name, ratios)
        if set(self.bucket_ratios) - set(BUCKETS):
            raise ValueError(f"bucket_ratios has unknown buckets {sorted(set(self.bucket_ratios) - set(BUCKETS))}.")
        if set(self.subset_ratios) != set(subsets):
            raise ValueError(f"subset_ratios keys {sorted(self.subset_ratios)} must be the input subsets {subsets}.")
        if self.min_generations < 0:
            raise ValueError(f"min_generations must be >= 0 (0 disables the stage), got {self.min_generations}.")
        for name in ("pool_size", "chunk_size", "minhash_num_perm", "shingle_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("max_prompt_tokens", "max_response_tokens", "final_max_prompt_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null (disabled), got {getattr(self, name)}.")
            if getattr(self, name) and not self.tokenizer:
                raise ValueError(f"tokenizer is null but {name} counts tokens: set a tokenizer, or {name}: null.")
        if not 0 <= self.val_size < self.pool_size:
            raise ValueError(f"val_size must be >= 0 and smaller than pool_size ({self.pool_size}): {self.val_size}.")
        if self.decontaminate and not self.decontamination_benchmarks:
            raise ValueError(
                "decontaminate is true but decontamination_benchmarks is empty: name them, or decontaminate: false."
            )
        if not 0.0 < self.minhash_threshold <= 1.0:
            raise ValueError(f"minhash_threshold must be in (0, 1], got {self.minhash_threshold}.")
        if self.max_source_fraction is not None and not 0.0 < self.max_source_fraction <= 1.0:
            raise ValueError(f"max_source_fraction must be in (0, 1] or null, got {self.max_source_fraction}.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OpenR1DataConfig:
        """A config from a mapping such as a parsed YAML recipe; unknown keys are an error."""
        known = [f.name for f in dataclasses.fields(cls)]
        if set(values) - set(known):
            raise ValueError(f"unknown setting(s) {sorted(set(values) - set(known))}. Known: {', '.join(known)}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> OpenR1DataConfig:
        """Load a YAML recipe, then apply ``overrides`` (setting name -> value) on top."""
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a recipe must be a YAML mapping of settings, got {type(values).__name__}.")
        return cls.from_dict({**values, **(overrides or {})})


_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]")
_MULTI_WORD_RE = re.compile(r"\\text\s*\{\s*(?:or|and)\s*\}|\b(?:or|and)\b|\\q?quad\b|\\pm\b|\\mp\b")


def _answer_text(answer: Any) -> str:
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return "" if answer is None else str(answer).strip()


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
    depth = 0
    for char in _LATEX_SPACE_RE.sub(" ", _THOUSANDS_RE.sub("", text)):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif char in ",;" and depth == 0:
            return False
    return True


def correctness_bucket(row: dict[str, Any], source: str = "math_verify") -> str:
    """``mixed``, ``entirely_correct``, ``entirely_incorrect`` or ``unknown`` from the recorded correctness flags."""
    verify, llama = row.get("correctness_math_verify") or [], row.get("correctness_llama") or []
    if source == "either":
        flags = [bool(a) or bool(b) for a, b in itertools.zip_longest(verify, llama, fillvalue=False)]
    else:
        flags = [bool(flag) for flag in (verify if source == "math_verify" else llama)]
    if not flags:
        return "unknown"
    return "entirely_correct" if all(flags) else "entirely_incorrect" if not any(flags) else "mixed"


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


def sample_pool(candidates: Sequence[Any], config: OpenR1DataConfig) -> tuple[list[Any], dict[str, Any]]:
    """``pool_size`` problems by ``subset_ratios`` and ``bucket_ratios`` (short cells filled), and a summary."""
    subsets, present = list(config.subset_ratios), {candidate.bucket for candidate in candidates}
    buckets = sorted(config.bucket_ratios, key=lambda name: (-config.bucket_ratios[name], BUCKETS.index(name)))
    buckets += [name for name in BUCKETS if name in present and name not in buckets]
    cells: dict[tuple[str, str], list[Any]] = {(s, b): [] for s in subsets for b in buckets}
    for candidate in candidates:
        cells[(candidate.subset, candidate.bucket)].append(candidate)
    for (subset, bucket), members in cells.items():
        random.Random(f"{config.seed}:{subset}:{bucket}").shuffle(members)

    fraction, pool, taken, per_source = config.max_source_fraction, [], Counter(), Counter()
    cap = None if fraction is None else max(1, math.floor(fraction * min(config.pool_size, len(candidates))))
    subset_quota = apportion(config.pool_size, config.subset_ratios)
    summary: dict[str, Any] = {"cells": [], "filled": [], "requested": config.pool_size, "source_cap": cap}

    def take(cell: tuple[str, str], count: int) -> list[Any]:
        chosen, rest = [], []
        for candidate in cells[cell]:
            if len(chosen) < count and (cap is None or per_source[candidate.source] < cap):
                chosen.append(candidate)
                per_source[candidate.source] += 1
            else:
                rest.append(candidate)
        cells[cell] = rest
        pool.extend(chosen)
        taken[cell[0]] += len(chosen)
        return chosen

    for subset in subsets:
        quota = apportion(subset_quota[subset], {b: config.bucket_ratios.get(b, 0.0) for b in buckets})
        for bucket in buckets:
            cell = {
                "subset": subset,
                "bucket": bucket,
                "quota": quota[bucket],
                "available": len(cells[subset, bucket]),
            }
            summary["cells"].append(cell | {"taken": len(take((subset, bucket), quota[bucket]))})
    if config.fill_shortfall:
        # First each subset fills its own quota, then the remaining gap is filled from any subset.
        for subset in subsets + [None]:
            wanted = subset_quota[subset] - taken[subset] if subset is not None else config.pool_size - len(pool)
            for cell in [(s, b) for s in subsets for b in buckets if subset in (None, s)]:
                chosen = take(cell, wanted) if wanted > 0 else []
                wanted -= len(chosen)
                if chosen:
                    filled = {"subset": cell[0], "bucket": cell[1], "count": len(chosen)}
                    summary["filled"].append(filled | {"for": subset or "any subset"})
    summary["size"] = len(pool)
    return pool, summary


class _Builder:
    def __init__(self, config: OpenR1DataConfig, command: str | None, removal_log) -> None:
        self.config, self.command, self.removal_log = config, command, removal_log
        c = config
        minhash = f"num_perm={c.minhash_num_perm}, threshold={c.minhash_threshold}"
        answers = f"single value: {c.require_single_value_answer}; drop empty: {c.drop_empty_answers}"
        final = c.final_max_prompt_tokens
        lengths = f"prompt <= {c.max_prompt_tokens}; {c.response_length_source} <= {c.max_response_tokens} tokens"
        stages = {
            "answer": (c.require_single_value_answer or c.drop_empty_answers, answers),
            "min_generations": (c.min_generations > 0, f">= {c.min_generations} generations"),
            "length": (c.max_prompt_tokens is not None or c.max_response_tokens is not None, lengths),
            "boxed_match": (c.boxed_match_filter, "solution or any generation"),
            "decontamination": (c.decontaminate, f"{', '.join(c.decontamination_benchmarks)}; {minhash}"),
            "deduplication": (c.deduplicate, minhash),
            "sampling": (True, f"pool {c.pool_size}; subsets {c.subset_ratios}; buckets {c.bucket_ratios}"),
            "validation_split": (c.val_size > 0, f"{c.val_size} held out"),
            "final_prompt_length": (final is not None, f"prompt <= {final} tokens"),
        }
        self.stages = {
            name: {"name": name, "description": STAGES[name], "enabled": on, "setting": setting, "rows_in": Counter()}
            | {"rows_out": Counter(), "removed": 0, "reasons": Counter(), "examples": []}
            for name, (on, setting) in stages.items()
        }
        self.boxed_match_via, self.contamination = Counter(), Counter()
        self.pool_index = NearDuplicateIndex(c.minhash_threshold, c.minhash_num_perm)
        self.pool_members: list[tuple[str, str]] = []  # (id, problem) of the rows in `pool_index`, by position
        if c.decontaminate:
            self.benchmark_problems, self.benchmark_index = benchmark_index(
                c.decontamination_benchmarks, c.minhash_threshold, c.minhash_num_perm, c.shingle_size
            )

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        name = self.config.tokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as error:
            raise ValueError(
                f"could not load the tokenizer {name!r} ({error}); set `tokenizer` to a hub name or a local folder."
            ) from error
        if not tokenizer.chat_template and (self.config.max_prompt_tokens or self.config.final_max_prompt_tokens):
            logger.warning("Tokenizer %s has no chat template: counting the prompts' text only.", name)
        return tokenizer

    def prompt_messages(self, problem: str) -> list[dict[str, str]]:
        system, instruction = self.config.system_prompt, self.config.user_instruction
        content = f"{problem.strip()}\n{instruction}" if instruction else problem.strip()
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]

    def token_counts(self, texts: list[str]) -> list[int]:
        encoded = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        return [len(ids) for ids in encoded]

    def run_stage(self, name: str, rows: list[dict], *checks) -> list[dict]:
        """The rows no ``check(rows)`` rejects with a ``(reason, details)`` verdict, counted and logged."""
        stats = self.stages[name]
        stats["rows_in"].update(row["_subset"] for row in rows)
        for check in checks if stats["enabled"] else ():
            kept = []
            for row, verdict in zip(rows, check(rows)):
                if verdict is None:
                    kept.append(row)
                    continue
                stats["reasons"][verdict[0]] += 1
                record = {"stage": name, "reason": verdict[0], "id": row["_id"], "subset": row["_subset"]}
                record.update(index=row["_index"], **verdict[1])
                self.removal_log.write(json.dumps(record, ensure_ascii=False) + "\n")
                if len(stats["examples"]) < self.config.report_examples:
                    example = {**record, "problem": _snippet(row.get("problem", ""))}
                    if "answer" in row:
                        example["answer"] = _snippet(_answer_text(row["answer"]), 80)
                    stats["examples"].append(example)
            rows = kept
        stats["rows_out"].update(row["_subset"] for row in rows)
        return rows

    def answer_verdict(self, row):
        if self.config.drop_empty_answers and is_empty_answer(row.get("answer")):
            return "empty", {}
        if self.config.require_single_value_answer and not is_single_value_answer(row.get("answer")):
            return "multi_value", {}
        return None

    def generations_verdict(self, row):
        count = len(_generations(row))
        return ("too_few_generations", {"generations": count}) if count < self.config.min_generations else None

    def prompt_verdicts(self, rows, limit, **details):
        conversations = [self.prompt_messages(row["problem"]) for row in rows]
        if conversations and self.tokenizer.chat_template:
            texts = self.tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
        else:
            texts = ["\n\n".join(message["content"] for message in messages) for messages in conversations]
        return [("prompt_too_long", {"tokens": n, **details}) if n > limit else None for n in self.token_counts(texts)]

    def response_verdicts(self, rows):
        source = self.config.response_length_source
        if source == "solution":
            lengths = self.token_counts([row.get("solution") or "" for row in rows])
        else:
            texts = [_generations(row) or [""] for row in rows]
            counts = iter(self.token_counts([text for group in texts for text in group]))
            pick = min if source == "shortest_generation" else max
            lengths = [pick(next(counts) for _ in group) for group in texts]
        limit = self.config.max_response_tokens
        return [("response_too_long", {"tokens": n}) if n > limit else None for n in lengths]

    def boxed_verdict(self, row):
        gold = _answer_text(row.get("answer"))
        solution_box = extract_last_boxed(row.get("solution") or "")
        if answers_match(solution_box, gold):
            self.boxed_match_via["solution"] += 1
        elif any(answers_match(extract_last_boxed(text), gold) for text in _generations(row)):
            self.boxed_match_via["generation"] += 1
        else:
            return "no_matching_box", {"solution_box": solution_box}
        return None

    def contamination_verdict(self, row):
        match = self.benchmark_index.best_match(row["_minhash"])
        if match is None:
            return None
        benchmark, index, text = self.benchmark_problems[match[0]]
        self.contamination[benchmark] += 1
        details = {"benchmark": benchmark, "benchmark_index": index, "similarity": round(match[1], 4)}
        return "benchmark_near_duplicate", details | {"benchmark_problem": _snippet(text)}

    def duplicate_verdict(self, row):
        match = self.pool_index.best_match(row["_minhash"])
        if match is None:
            self.pool_index.add(row["_minhash"])
            self.pool_members.append((row["_id"], row["problem"].strip()))
            return None
        kept_id, kept_problem = self.pool_members[match[0]]
        details = {"kept_id": kept_id, "similarity": round(match[1], 4), "kept_problem": _snippet(kept_problem)}
        return "pool_near_duplicate", details

    def process_chunk(self, rows: list[dict[str, Any]]) -> list[_Candidate]:
        c = self.config
        length_checks = [lambda rows: self.prompt_verdicts(rows, c.max_prompt_tokens)] if c.max_prompt_tokens else []
        length_checks += [self.response_verdicts] if c.max_response_tokens else []
        rows = self.run_stage("answer", rows, lambda rows: map(self.answer_verdict, rows))
        rows = self.run_stage("min_generations", rows, lambda rows: map(self.generations_verdict, rows))
        rows = self.run_stage("length", rows, *length_checks)
        rows = self.run_stage("boxed_match", rows, lambda rows: map(self.boxed_verdict, rows))
        problems = [row["problem"] for row in rows] if c.decontaminate or c.deduplicate else []
        for row, signature in zip(rows, minhashes(problems, c.minhash_num_perm, c.shingle_size) if problems else []):
            row["_minhash"] = signature
        rows = self.run_stage("decontamination", rows, lambda rows: map(self.contamination_verdict, rows))
        rows = self.run_stage("deduplication", rows, lambda rows: map(self.duplicate_verdict, rows))
        candidates = []
        for row in rows:
            answer = row["answer"]
            if isinstance(answer, (list, tuple)):  # the first non-empty value
                answer = next((item for item in answer if not is_empty_answer(item)), "")
            values = (row["problem"].strip(), _answer_text(answer), str(row.get("source") or "unknown"))
            bucket = correctness_bucket(row, c.correctness_source)
            candidates.append(_Candidate(row["_id"], row["_subset"], row["_index"], *values, bucket))
        return candidates

    def read_chunks(self, spec: InputSpec):
        """The rows of ``spec`` in chunks of ``chunk_size``, each tagged with its ``_id``, ``_subset`` and ``_index``."""
        c, indices = self.config, itertools.count()
        uses = {
            "generations": c.min_generations > 0 or c.boxed_match_filter or c.response_length_source != "solution",
            "correctness_math_verify": c.correctness_source in ("math_verify", "either"),
            "correctness_llama": c.correctness_source in ("llama", "either"),
            "solution": c.max_response_tokens is not None and c.response_length_source == "solution",
        }
        needed = {"problem", "answer"} | {name for name, used in uses.items() if used}
        for batch in spec.stream().iter(batch_size=c.chunk_size):
            if needed - set(batch):
                raise ValueError(
                    f"input {spec.subset!r} ({spec.describe()}) lacks the column(s) {sorted(needed - set(batch))} of "
                    f"OpenR1-Math-220k's schema; it has {sorted(batch)}. Add them, or disable the stages that need them."
                )
            rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
            for row, index in zip(rows, indices):
                uid = row.get("uuid") or f"{spec.subset}-{index:07d}"
                row.update(_id=str(uid), _subset=spec.subset, _index=index, problem=str(row.get("problem") or ""))
            yield rows

    def build(self, started: float) -> tuple[Any, dict[str, Any]]:
        """Run the stages; the splits as a ``DatasetDict`` and the statistics of the build."""
        from datasets import Dataset, DatasetDict

        c = self.config
        candidates: list[_Candidate] = []
        rows_read: Counter = Counter()
        for spec in c.inputs:
            logger.info("Reading %s: %s", spec.subset, spec.describe())
            for rows in self.read_chunks(spec):
                rows_read[spec.subset] += len(rows)
                candidates += self.process_chunk(rows)
                logger.info("%s: %d rows read, %d candidates", spec.subset, rows_read[spec.subset], len(candidates))
        candidate_buckets = Counter((cand.subset, cand.bucket) for cand in candidates)

        self.stages["sampling"]["rows_in"].update(cand.subset for cand in candidates)
        pool, sampling = sample_pool(candidates, c)
        self.stages["sampling"]["rows_out"].update(cand.subset for cand in pool)
        if len(pool) < c.pool_size:
            logger.warning("The pool has %d problems, fewer than pool_size=%d.", len(pool), c.pool_size)

        self.stages["validation_split"]["rows_in"].update(cand.subset for cand in pool)
        order = list(pool)
        random.Random(f"{c.seed}:validation").shuffle(order)
        splits = {"train": order[c.val_size :], "validation": order[: c.val_size]}
        self.stages["validation_split"]["rows_out"].update(cand.subset for cand in splits["train"])
        for name, members in splits.items():  # stage 9 on both splits
            rows = [dict(_id=m.id, _subset=m.subset, _index=m.index, problem=m.problem, _c=m) for m in members]
            check = functools.partial(self.prompt_verdicts, limit=c.final_max_prompt_tokens, split=name)
            splits[name] = [row["_c"] for row in self.run_stage("final_prompt_length", rows, check)]

        dataset, hashes, empty = DatasetDict(), {}, {key: [] for key in RECORD_COLUMNS}
        for name, members in splits.items():
            records = [{"prompt": self.prompt_messages(m.problem), **m._asdict()} for m in members]
            records = [{key: record[key] for key in RECORD_COLUMNS} for record in records]
            split = dataset[name] = Dataset.from_list(records) if records else Dataset.from_dict(empty)
            text = "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in split)
            hashes[name] = hashlib.sha256(text.encode("utf-8")).hexdigest()

        def shares(rows, key):
            return dict(sorted(Counter(getattr(row, key) for row in rows).items()))

        stats = {
            "command": self.command,
            "seed": c.seed,
            "tokenizer": c.tokenizer,
            "inputs": [{"subset": s.subset, "source": s.describe(), "rows": rows_read[s.subset]} for s in c.inputs],
            "rows_read": sum(rows_read.values()),
            "stages": [
                {k: dict(v) if isinstance(v, Counter) else v for k, v in stage.items()}
                | {"removed": sum(stage["rows_in"].values()) - sum(stage["rows_out"].values())}
                for stage in self.stages.values()
            ],
            "boxed_match_via": dict(self.boxed_match_via),
            "contamination_by_benchmark": dict(self.contamination),
            "candidates": [{"subset": s, "bucket": b, "count": n} for (s, b), n in sorted(candidate_buckets.items())],
            "sampling": sampling,
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
            "content_sha256": hashes,
            "config": dataclasses.asdict(c),
            "elapsed_s": round(time.time() - started, 1),
        }
        return dataset, stats


def build_openr1_dataset(config: OpenR1DataConfig, command: str | None = None) -> BuildResult:
    """Run the recipe of ``config`` and write ``config.output_dir`` (dataset, report, statistics) atomically."""
    from egpo_trl.data.report import render_report

    started = time.time()
    output_dir = Path(config.output_dir).expanduser().resolve()
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        ours = (output_dir / _MARKER).is_file()
        if not (ours and config.overwrite):
            why = "pass `--overwrite true` to replace the earlier build there" if ours else "it was not written by "
            why += "" if ours else f"this builder (no {_MARKER}), so even `overwrite: true` does not replace it"
            raise FileExistsError(f"output_dir {output_dir} is not empty: {why}; or choose another `output_dir`.")
    staging = output_dir.parent / f".{output_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with open(staging / "removed.jsonl", "w", encoding="utf-8") as removal_log:
            dataset, stats = _Builder(config, command, removal_log).build(started)
        dataset.save_to_disk(str(staging / "dataset"))
        for name, split in dataset.items() if config.save_parquet else ():
            split.to_parquet(str(staging / f"{name}.parquet"))
        (staging / "stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (staging / "report.md").write_text(render_report(stats), encoding="utf-8")
        settings = yaml.safe_dump(dataclasses.asdict(config), sort_keys=False, allow_unicode=True)
        (staging / _MARKER).write_text(settings, encoding="utf-8")
        backup = output_dir.parent / f".{output_dir.name}.previous-{os.getpid()}"
        if output_dir.exists():
            output_dir.rename(backup)
        staging.rename(output_dir)
        shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("Wrote %s (train %d, validation %d).", output_dir, len(dataset["train"]), len(dataset["validation"]))
    return BuildResult(dataset=dataset, stats=stats, output_dir=output_dir, report_path=output_dir / "report.md")
