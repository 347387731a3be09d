"""Near-duplicate detection with MinHash-LSH (datasketch), for deduplicating a problem pool and decontaminating it.

Problems become sets of word n-gram shingles of their normalised text; LSH proposes candidates and each is
checked against the estimated Jaccard similarity, so near duplicates are exactly the pairs at or above the threshold.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_SPACE_RE = re.compile(r"\s+")


def normalize_problem(text: str) -> str:
    """Canonical form of a problem statement for similarity: NFKC, lower case, no ``$``, single spaces."""
    text = unicodedata.normalize("NFKC", text or "").lower()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", " ")
    return _SPACE_RE.sub(" ", text).strip()


def shingles(text: str, size: int = 3) -> set[bytes]:
    """The word ``size``-gram shingles of a problem (a text shorter than ``size`` units is one shingle)."""
    if size < 1:
        raise ValueError(f"shingle size must be >= 1, got {size}.")
    tokens = _TOKEN_RE.findall(normalize_problem(text))
    if len(tokens) < size:
        return {" ".join(tokens).encode("utf-8")}
    return {" ".join(tokens[i : i + size]).encode("utf-8") for i in range(len(tokens) - size + 1)}


def minhashes(texts: Sequence[str], num_perm: int = 128, shingle_size: int = 3) -> list[MinHash]:
    """MinHash signatures of ``texts`` (one per text, ``num_perm`` permutations, fixed hash seed)."""
    return MinHash.bulk((sorted(shingles(text, shingle_size)) for text in texts), num_perm=num_perm)


class NearDuplicateIndex:
    """An LSH index of MinHash signatures, items identified by insertion position; matches verified against ``threshold``."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 128) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"minhash threshold must be in (0, 1], got {threshold}.")
        self.threshold = threshold
        self.num_perm = num_perm
        # Band keys are compressed to 8 bytes (saves memory); any extra LSH candidate is rejected by the check below.
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, hashfunc=_band_key)
        self._signatures: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._signatures)

    def add(self, minhash: MinHash) -> int:
        key = len(self._signatures)
        self._lsh.insert(key, minhash, check_duplication=False)
        self._signatures.append(np.array(minhash.hashvalues, copy=True))
        return key

    def best_match(self, minhash: MinHash) -> tuple[int, float] | None:
        """``(position, estimated Jaccard)`` of the most similar stored item at or above the threshold (earliest on ties), or ``None``."""
        best: tuple[int, float] | None = None
        hashvalues = minhash.hashvalues
        for key in sorted(self._lsh.query(minhash)):
            similarity = float(np.count_nonzero(self._signatures[key] == hashvalues)) / len(hashvalues)
            if similarity >= self.threshold and (best is None or similarity > best[1]):
                best = (key, similarity)
        return best


def _band_key(band: bytes) -> bytes:
    return hashlib.blake2b(band, digest_size=8).digest()


@dataclass(frozen=True)
class BenchmarkProblem:
    """One evaluation problem used for decontamination."""

    benchmark: str
    index: int
    text: str


def load_benchmark_problems(names: Iterable[str]) -> list[BenchmarkProblem]:
    """Problem texts of evaluation sets, by vendored name or path of a .jsonl/.json/.parquet file with a ``problem`` or ``question`` field."""
    problems: list[BenchmarkProblem] = []
    for name in names:
        if name in DECONTAMINATION_BENCHMARKS:
            relative, field = DECONTAMINATION_BENCHMARKS[name]
            rows = _read_rows(BENCHMARK_DIR / relative)
        else:
            path = Path(name)
            if not path.is_file():
                raise ValueError(
                    f"decontamination benchmark {name!r} is neither a vendored set "
                    f"({', '.join(DECONTAMINATION_BENCHMARKS)}) nor an existing .jsonl/.json/.parquet file."
                )
            rows = _read_rows(path)
            field = next((key for key in ("problem", "question") if rows and key in rows[0]), None)
            if field is None:
                raise ValueError(f"decontamination file {path} needs a `problem` or `question` field in every row.")
        problems += [BenchmarkProblem(name, index, str(row[field])) for index, row in enumerate(rows)]
    return problems


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]
