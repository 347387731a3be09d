"""Near-duplicate detection with MinHash-LSH (datasketch) over word n-gram shingles, for deduplicating a problem
pool and decontaminating it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import unicodedata
from collections import namedtuple
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from datasketch import MinHash, MinHashLSH

BENCHMARK_DIR = Path(__file__).resolve().parent / "benchmarks"
# Vendored evaluation sets: name -> (file inside BENCHMARK_DIR, field holding the problem text).
DECONTAMINATION_BENCHMARKS: dict[str, tuple[str, str]] = {
    "math500": ("math500/test.jsonl", "problem"),
    "gsm8k": ("gsm8k/test.jsonl", "question"),
    "aime24": ("aime24/test.jsonl", "problem"),
    "amc23": ("amc23/test.jsonl", "problem"),
    "minerva_math": ("minerva_math/test.jsonl", "problem"),
    "mmlu_stem": ("mmlu_stem/test.jsonl", "question"),
}
BenchmarkProblem = namedtuple("BenchmarkProblem", "benchmark index text")


def shingles(text: str, size: int = 3) -> set[bytes]:
    """The word ``size``-gram shingles of a problem (NFKC, lower case, no ``$``; a shorter text is one shingle)."""
    text = unicodedata.normalize("NFKC", text or "").lower()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", " ")
    tokens = re.findall(r"\w+|[^\w\s]", text)
    return {" ".join(tokens[i : i + size]).encode("utf-8") for i in range(max(len(tokens) - size, 0) + 1)}


def minhashes(texts: Sequence[str], num_perm: int = 128, shingle_size: int = 3) -> list[MinHash]:
    """MinHash signatures of ``texts`` (one per text, ``num_perm`` permutations, fixed hash seed)."""
    return MinHash.bulk((sorted(shingles(text, shingle_size)) for text in texts), num_perm=num_perm)


def _band_key(band: bytes) -> bytes:
    return hashlib.blake2b(band, digest_size=8).digest()


class NearDuplicateIndex:
    """An LSH index of MinHash signatures, items identified by insertion position; matches verified against ``threshold``."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 128) -> None:
        self.threshold = threshold
        # Band keys hashed to 8 bytes; an extra LSH candidate from a key collision fails the check in best_match.
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, hashfunc=_band_key)
        self._signatures: list[np.ndarray] = []

    def add(self, minhash: MinHash) -> int:
        self._lsh.insert(len(self._signatures), minhash, check_duplication=False)
        self._signatures.append(np.array(minhash.hashvalues, copy=True))
        return len(self._signatures) - 1

    def best_match(self, minhash: MinHash) -> tuple[int, float] | None:
        """``(position, estimated Jaccard)`` of the most similar stored item at or above the threshold (earliest on ties), or ``None``."""
        best: tuple[int, float] | None = None
        for key in sorted(self._lsh.query(minhash)):
            similarity = float(np.count_nonzero(self._signatures[key] == minhash.hashvalues)) / len(minhash.hashvalues)
            if similarity >= self.threshold and (best is None or similarity > best[1]):
                best = (key, similarity)
        return best


def load_benchmark_problems(names: Sequence[str]) -> list[BenchmarkProblem]:
    """Problem texts of evaluation sets, by vendored name or path of a .jsonl/.json/.parquet file with a ``problem`` or ``question`` field."""
    problems: list[BenchmarkProblem] = []
    for name in names:
        relative, field = DECONTAMINATION_BENCHMARKS.get(name, (name, None))
        path = BENCHMARK_DIR / relative if field else Path(name)
        if not path.is_file():
            raise ValueError(
                f"decontamination benchmark {name!r} is neither a vendored set "
                f"({', '.join(DECONTAMINATION_BENCHMARKS)}) nor an existing .jsonl/.json/.parquet file."
            )
        if path.suffix == ".parquet":
            rows = pq.read_table(path).to_pylist()
        elif path.suffix == ".json":
            rows = json.loads(path.read_text(encoding="utf-8"))
        else:
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        field = field or next((key for key in ("problem", "question") if rows and key in rows[0]), None)
        if field is None:
            raise ValueError(f"decontamination file {path} needs a `problem` or `question` field in every row.")
        problems += [BenchmarkProblem(name, index, str(row[field])) for index, row in enumerate(rows)]
    return problems


def benchmark_index(names: Sequence[str], threshold: float, num_perm: int, shingle_size: int) -> tuple:
    """The problems of ``names`` and a read-only index of their signatures, reused while no file of them changes."""
    stamps = tuple((name, os.stat(name).st_mtime_ns if os.path.isfile(name) else 0) for name in names)
    return _benchmark_index(stamps, threshold, num_perm, shingle_size)


@functools.lru_cache(maxsize=4)
def _benchmark_index(stamps, threshold, num_perm, shingle_size):
    problems = load_benchmark_problems([name for name, _ in stamps])
    index = NearDuplicateIndex(threshold, num_perm)
    for signature in minhashes([problem.text for problem in problems], num_perm, shingle_size):
        index.add(signature)
    return problems, index
