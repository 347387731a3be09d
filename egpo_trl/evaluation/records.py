"""Per-sample evaluation records, one JSON line per finished ``(problem, sample)``; a torn line is skipped."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


def iter_records(path: str) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, skipping blank and unreadable lines (a torn last write)."""
    skipped = 0
    with open(path, encoding="utf-8") as handle:
        for line in filter(str.strip, handle):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(record, dict):
                yield record
    if skipped:
        logger.warning("%s: skipped %d unreadable line(s) (an interrupted write), left in place.", path, skipped)


class RecordStore:
    """An append-only JSON-lines file of records, keyed by ``(problem_id, sample)``."""

    def __init__(self, path: str):
        self.path = path

    def load(self) -> dict[tuple[str, int], dict[str, Any]]:
        """All finished records by key (the first record of a key wins)."""
        records: dict[tuple[str, int], dict[str, Any]] = {}
        for record in iter_records(self.path) if os.path.exists(self.path) else ():
            records.setdefault((str(record["problem_id"]), int(record["sample"])), record)
        return records

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append records, one line each, synced to disk before returning."""
        lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]
        if not lines:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a+b") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":  # a torn line from a crash: start a fresh line after it
                    handle.write(b"\n")
            handle.write("".join(lines).encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
