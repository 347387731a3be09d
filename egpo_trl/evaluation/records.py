"""Per-sample evaluation records in JSON lines, appended as they finish, so that runs resume.

A record file is only ever appended to. Each line is one finished ``(problem, sample)`` pair; a run that
is interrupted (killed, out of memory, preempted) leaves every finished line in place, and the next run
skips the pairs it finds. A line cut short by a crash in the middle of a write is ignored when reading
and never overwritten: the next append starts on a new line.

Record fields:

``benchmark``, ``problem_id``, ``problem_index``, ``sample``
    which problem (the benchmark's id, or its row index) and which of its ``k`` samples.
``prompt``, ``completion``
    the rendered prompt text and the generated text (special tokens dropped).
``gold``, ``extracted``, ``correct``
    accepted reference answers, the answer read from the last ``\\boxed{}``, and the verdict.
``completion_ids``, ``logprobs``
    the sampled token ids (end-of-sequence token included) and their log-probabilities under the model.
``num_prompt_tokens``, ``num_completion_tokens``, ``finish_reason``
    lengths, and ``"stop"``, ``"length"`` (cut off by the generation budget or the context) or
    ``"prompt_too_long"`` (the prompt fills the model's context: nothing generated, scored incorrect).
``thinking_span``, ``answer_span``
    ``[start, end)`` token ranges of the thinking and answer segments (:mod:`egpo_trl.segments`).
``entropy``
    the entropy proxy of the whole completion, paper Eq. 5 (mean negative log-prob).
``backend``, ``seed``, ``meta``
    how it was generated, and extra columns of the problem (level, subject).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RecordStore", "iter_records", "record_key"]


def record_key(record: dict[str, Any]) -> tuple[str, int]:
    """The identity of a record: ``(problem_id, sample)``."""
    return str(record["problem_id"]), int(record["sample"])


def iter_records(path: str) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, skipping blank and unreadable lines (a torn last write)."""
    skipped = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(record, dict):
                yield record
    if skipped:
        logger.warning(
            "%s: skipped %d unreadable line(s) (an interrupted write); they are left in place.", path, skipped
        )


class RecordStore:
    """An append-only JSON-lines file of records, keyed by ``(problem_id, sample)``.

    Args:
        path: the file; created (with its folder) on the first append.
    """

    def __init__(self, path: str):
        self.path = path

    def load(self) -> dict[tuple[str, int], dict[str, Any]]:
        """All finished records by key. When a key appears twice, the first record wins."""
        records: dict[tuple[str, int], dict[str, Any]] = {}
        if not os.path.exists(self.path):
            return records
        for record in iter_records(self.path):
            try:
                key = record_key(record)
            except (KeyError, TypeError, ValueError):
                continue
            records.setdefault(key, record)
        return records

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Append records, one line each, and flush them to disk before returning. Returns how many."""
        lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]
        if not lines:
            return 0
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a+b") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":  # a torn line from a crash: start a fresh line after it
                    handle.write(b"\n")
            handle.seek(0, os.SEEK_END)
            handle.write("".join(lines).encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        return len(lines)
