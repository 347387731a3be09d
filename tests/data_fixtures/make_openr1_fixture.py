"""Write a small pool in OpenR1-Math-220k's schema with planted problems, and a tokenizer to measure it.

Run from the repository root to refresh the copy the tests and ``recipes/data/openr1_fixture.yaml`` use::

    python tests/data_fixtures/make_openr1_fixture.py --output tests/data_fixtures/openr1

It writes ``default.parquet`` (the ``default`` subset), ``extended.jsonl`` (the ``extended`` subset),
``tokenizer/`` (a BPE tokenizer trained on these texts with the ``tokenizers`` library, with a
Qwen-style chat template) and ``manifest.json``: for each builder stage, the ids of the rows planted to
be removed by it, and the number of clean candidates per (subset, correctness bucket).

Planted rows, each built to fail exactly one stage and pass all earlier ones:

- ``answer``: empty and multi-value ground truths;
- ``min_generations``: fewer than two non-empty generations;
- ``length``: a prompt or a reference solution over 4096 tokens;
- ``boxed_match``: no last ``\\boxed{}`` of the solution or of a generation matches the answer;
- ``decontamination``: MATH-500 and GSM8K test problems, verbatim or lightly edited;
- ``deduplication``: lightly edited copies of earlier clean rows, in the same and in the other subset.

Clean rows also include prompts between 1024 and 4096 tokens (removed only by the final prompt filter
when sampled), answers matched only through a generation, and answers that look like lists but are one
value (``1,000``, ``(1, 2)``). The output depends only on ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "egpo_trl" / "data" / "benchmarks"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

NAMES = [
    "Alice", "Bruno", "Chen", "Dana", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiara", "Liam", "Mona",
    "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wes", "Xena", "Yusuf", "Zoe",
]  # fmt: skip
ITEMS = [
    "marbles", "stamps", "pencils", "apples", "coins", "stickers", "books", "shells", "cards", "candles", "buttons",
    "kites", "ribbons", "tiles", "bottles", "lanterns", "feathers", "pebbles", "postcards", "beads",
]  # fmt: skip
PLACES = [
    "market", "library", "garden", "harbor", "bakery", "museum", "workshop", "station", "orchard", "studio",
    "campsite", "village fair",
]  # fmt: skip
ADJECTIVES = [
    "red",
    "small",
    "wooden",
    "shiny",
    "old",
    "striped",
    "heavy",
    "blue",
    "paper",
    "glass",
    "silver",
    "green",
]

SETUPS = [
    "{name} has {a} {adj} {item} and buys {b} more at the {place}.",
    "At the {place}, {name} arranges {a} {item} into rows of {b}.",
    "{name} collects {a} {adj} {item} every day for {b} days.",
    "A box at the {place} holds {a} {item}, and {name} removes {b} of them.",
    "{name} and {name2} share {a} {adj} {item} so that {name2} gets {b} more than {name}.",
    "A pack of {adj} {item} costs {a} dollars at the {place}, and {name} has {b} dollars.",
    "The {place} sells {item} in packs of {a}, and {name} needs {b} packs.",
]
TWISTS = [
    "Later, {name2} gives away {c} {item2} to friends from the {place2}.",
    "On the way home {name2} finds {c} {adj2} {item2}.",
    "Then a storm ruins {c} of the {adj2} {item2} stored at the {place2}.",
    "Meanwhile the {place2} doubles its stock of {item2} to {c}.",
    "{name2} trades {c} {item2} for a {adj2} basket at the {place2}.",
]
QUESTIONS = [
    "How many {item} does {name} have now?",
    "What is the total number of {item} involved?",
    "How many {item2} are left at the end?",
    "Find the number of {adj} {item} that remain.",
    "Compute the final count of {item} for {name}.",
]
FILLERS = [
    "Note that the {adj} {item} near the {place} weighs {n} grams.",
    "Record {k}: {name} counted {n} {item} at the {place}.",
    "The {place} opens at {k} and closes after {n} visitors.",
    "{name} writes down that {n} {adj} {item} were sold before noon.",
]


def _fill(rng: random.Random) -> dict[str, Any]:
    name, name2 = rng.sample(NAMES, 2)
    item, item2 = rng.sample(ITEMS, 2)
    place, place2 = rng.sample(PLACES, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    a, b, c = (rng.randint(2, 999) for _ in range(3))
    return dict(
        name=name, name2=name2, item=item, item2=item2, place=place, place2=place2, adj=adj, adj2=adj2, a=a, b=b, c=c
    )


def make_problem(rng: random.Random, filler_sentences: int = 0) -> str:
    """A word problem of two or three sentences, optionally padded with ``filler_sentences`` context sentences."""
    slots = _fill(rng)
    parts = [rng.choice(SETUPS).format(**slots)]
    if rng.random() < 0.7:
        parts.append(rng.choice(TWISTS).format(**slots))
    for _ in range(filler_sentences):
        extra = _fill(rng)
        parts.append(rng.choice(FILLERS).format(n=rng.randint(2, 9999), k=rng.randint(1, 99), **extra))
    parts.append(rng.choice(QUESTIONS).format(**slots))
    return " ".join(parts)


def make_answer(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.8:
        return str(rng.randint(2, 999))
    if kind < 0.9:
        p, q = rng.randint(1, 20), rng.randint(21, 40)
        return f"\\frac{{{p}}}{{{q}}}" if _gcd(p, q) == 1 else str(p + q)
    return f"{rng.randint(2, 99)}\\sqrt{{{rng.choice([2, 3, 5, 7])}}}"


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def wrong_answer(rng: random.Random, answer: str) -> str:
    if answer.lstrip("-").isdigit():
        return str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
    return answer + "+1"


def make_solution(rng: random.Random, boxed: str | None, extra_words: int = 0) -> str:
    steps = [
        f"Step {i + 1}: we combine {rng.randint(2, 99)} and {rng.randint(2, 99)}." for i in range(rng.randint(2, 4))
    ]
    if extra_words:
        words = [rng.choice(ITEMS + ADJECTIVES + PLACES) for _ in range(extra_words)]
        steps.append("We also tabulate " + " ".join(words) + ".")
    ending = f"Hence the answer is $\\boxed{{{boxed}}}$." if boxed is not None else "Hence we are done."
    return "Solution. " + " ".join(steps) + " " + ending


def make_generation(rng: random.Random, boxed: str | None) -> str:
    thoughts = " ".join(
        f"Check {rng.randint(2, 999)} against {rng.randint(2, 999)}." for _ in range(rng.randint(2, 5))
    )
    ending = f"The final answer is \\boxed{{{boxed}}}." if boxed is not None else "I could not finish."
    return f"<think>\nLet me work through this. {thoughts}\n</think>\n{ending}"


def correctness_flags(rng: random.Random, bucket: str, count: int) -> list[bool]:
    if bucket == "entirely_correct":
        return [True] * count
    if bucket == "entirely_incorrect":
        return [False] * count
    flags = [True] + [False] + [rng.random() < 0.5 for _ in range(count - 2)]
    rng.shuffle(flags)
    return flags


def make_row(
    rng: random.Random,
    problem: str,
    answer: str,
    bucket: str = "mixed",
    num_generations: int | None = None,
    solution: str | None = None,
    generations: list[str] | None = None,
    flags: list[bool] | None = None,
    source: str = "olympiads",
) -> dict[str, Any]:
    """One row in OpenR1-Math-220k's schema."""
    if generations is None:
        count = num_generations if num_generations is not None else rng.randint(2, 4)
        flags = correctness_flags(rng, bucket, count)
        generations = [make_generation(rng, answer if ok else wrong_answer(rng, answer)) for ok in flags]
    flags = flags if flags is not None else [False] * len(generations)
    return {
        "problem": problem,
        "solution": solution if solution is not None else make_solution(rng, answer),
        "answer": answer,
        "problem_type": "Algebra",
        "question_type": "math-word-problem",
        "source": source,
        "uuid": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        "is_reasoning_complete": [True] * len(generations),
        "generations": generations,
        "correctness_math_verify": flags,
        "correctness_llama": None,
        "finish_reasons": ["stop"] * len(generations),
        "correctness_count": sum(flags),
        "messages": [{"role": "user", "content": problem}]
        + ([{"role": "assistant", "content": generations[0]}] if generations else []),
    }


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _shingles(text: str) -> set[bytes]:
    from egpo_trl.data.dedup import shingles

    return shingles(text, 3)


def _jaccard(a: str, b: str) -> float:
    left, right = _shingles(a), _shingles(b)
    return len(left & right) / max(1, len(left | right))


def _benchmark_picks(rng: random.Random) -> dict[str, list[tuple[int, str, str]]]:
    """(row, problem, answer) of MATH-500 and GSM8K test problems long enough to survive a small edit."""
    math500 = _read_jsonl(BENCHMARKS / "math500" / "test.jsonl")
    gsm8k = _read_jsonl(BENCHMARKS / "gsm8k" / "test.jsonl")
    math_ok = [
        (i, row["problem"], row["answer"])
        for i, row in enumerate(math500)
        if re.fullmatch(r"\d+", row["answer"]) and len(row["problem"].split()) >= 35
    ]
    gsm_ok = [
        (i, row["question"], row["answer"].split("####")[-1].strip())
        for i, row in enumerate(gsm8k)
        if len(row["question"].split()) >= 35
    ]
    return {"math500": rng.sample(math_ok, 5), "gsm8k": rng.sample(gsm_ok, 5)}


def _edit(text: str, how: int) -> str:
    """A light edit that keeps the problem a near duplicate (shingle Jaccard >= 0.9 on long problems)."""
    if how == 0:
        return "  ".join(text.split(" ")).upper()  # spacing and case only
    if how == 1:
        return "Problem 7. " + text
    return text.rstrip() + " Show your work."


def build_rows(seed: int = 0) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The rows of both subsets and the manifest of planted removals. Deterministic in ``seed``."""
    rng = random.Random(seed)
    removals: dict[str, list[str]] = {
        stage: []
        for stage in ("answer", "min_generations", "length", "boxed_match", "decontamination", "deduplication")
    }
    candidates: Counter = Counter()
    medium_prompt_ids: list[str] = []
    picks = _benchmark_picks(rng)
    subsets: dict[str, list[dict[str, Any]]] = {"default": [], "extended": []}
    originals: dict[str, list[dict[str, Any]]] = {"default": [], "extended": []}

    def clean(subset: str, bucket: str, **kwargs: Any) -> dict[str, Any]:
        row = make_row(
            rng,
            kwargs.pop("problem", None) or make_problem(rng),
            kwargs.pop("answer", None) or make_answer(rng),
            bucket,
            **kwargs,
        )
        row["source"] = rng.choice(
            ["olympiads", "cn_contest", "aops_forum", "amc_aime"] if subset == "default" else ["cn_k12", "olympiads"]
        )
        subsets[subset].append(row)
        originals[subset].append(row)
        candidates[(subset, bucket)] += 1
        return row

    def planted(subset: str, stage: str, row: dict[str, Any]) -> dict[str, Any]:
        subsets[subset].append(row)
        removals[stage].append(row["uuid"])
        return row

    plan = {
        "default": {"mixed": 100, "entirely_correct": 70, "entirely_incorrect": 30},
        "extended": {"mixed": 40, "entirely_correct": 28, "entirely_incorrect": 12},
    }
    for subset, buckets in plan.items():
        for bucket, count in buckets.items():
            for _ in range(count):
                clean(subset, bucket)

    # Clean rows with special features (replacing nothing: they add to the candidate counts).
    for bucket in ["mixed"] * 9 + ["entirely_correct"] * 6:  # prompts between 1024 and 4096 tokens
        medium_prompt_ids.append(
            clean("default", bucket, problem=make_problem(rng, filler_sentences=rng.randint(110, 200)))["uuid"]
        )
    for _ in range(2):  # the answer is matched only through a recorded generation
        answer = make_answer(rng)
        generations = [make_generation(rng, wrong_answer(rng, answer)), make_generation(rng, answer)]
        clean(
            "default",
            "mixed",
            answer=answer,
            solution=make_solution(rng, wrong_answer(rng, answer)),
            generations=generations,
            flags=[False, True],
        )
    clean("default", "entirely_correct", answer="\\frac{3}{4}", solution=make_solution(rng, "0.75"))  # equivalent form
    clean("default", "mixed", answer="1,000")  # thousands separator: one value
    clean("default", "entirely_correct", answer="(1, 2)")  # a tuple: one value

    # Stage 1: answers.
    for subset, answers in (
        ("default", ["", "   ", "2, 3", "x=1 \\text{ or } x=2", "\\pm 4", "3; 5"]),
        ("extended", ["", "1 and 2", "4, 9"]),
    ):
        for answer in answers:
            planted(
                subset, "answer", make_row(rng, make_problem(rng), answer, solution=make_solution(rng, answer or "7"))
            )
    # A near copy of a row dropped at stage 1 is not a duplicate of anything in the pool: it stays.
    dropped = subsets["default"][-1]
    clean("default", "mixed", problem=_edit(dropped["problem"], 0), answer="5")

    # Stage 2: fewer than two non-empty generations.
    for subset, generation_sets in (("default", [[True], [], None]), ("extended", [[False]])):
        for flags in generation_sets:
            answer = make_answer(rng)
            if flags is None:  # two generations, one of them empty
                row = make_row(
                    rng, make_problem(rng), answer, generations=["", make_generation(rng, answer)], flags=[False, True]
                )
            else:
                row = make_row(
                    rng,
                    make_problem(rng),
                    answer,
                    generations=[make_generation(rng, answer if ok else wrong_answer(rng, answer)) for ok in flags],
                    flags=flags,
                )
            planted(subset, "min_generations", row)

    # Stage 3: lengths (the fixture recipe keeps the paper's 4096-token limits).
    for _ in range(2):
        planted("default", "length", make_row(rng, make_problem(rng, filler_sentences=620), make_answer(rng)))
    for _ in range(2):
        answer = make_answer(rng)
        planted(
            "default",
            "length",
            make_row(rng, make_problem(rng), answer, solution=make_solution(rng, answer, extra_words=5200)),
        )

    # Stage 4: no matching box.
    for subset, kinds in (("default", ["wrong", "earlier_box_only", "no_box"]), ("extended", ["wrong", "no_box"])):
        for kind in kinds:
            answer = make_answer(rng)
            wrong = wrong_answer(rng, answer)
            if kind == "wrong":
                solution = make_solution(rng, wrong)
            elif kind == "earlier_box_only":
                solution = f"A first guess is $\\boxed{{{answer}}}$. " + make_solution(rng, wrong)
            else:
                solution = make_solution(rng, None)
            boxed = None if kind == "no_box" else wrong
            generations = [make_generation(rng, boxed) for _ in range(3)]
            planted(
                subset,
                "boxed_match",
                make_row(rng, make_problem(rng), answer, solution=solution, generations=generations),
            )

    # Stage 5: evaluation problems, verbatim or edited.
    for benchmark, subset_plan in (
        ("math500", ["default"] * 4 + ["extended"]),
        ("gsm8k", ["default"] * 4 + ["extended"]),
    ):
        for position, (subset, (_, problem, answer)) in enumerate(zip(subset_plan, picks[benchmark])):
            text = problem if position % 2 == 0 else _edit(problem, position % 3)
            assert _jaccard(text, problem) >= 0.9, (benchmark, text)
            planted(subset, "decontamination", make_row(rng, text, answer, bucket="mixed"))

    # Stage 6: near copies of earlier clean rows, inserted after their originals.
    copies: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for subset, from_subset, count in (
        ("default", "default", 6),
        ("extended", "default", 2),
        ("extended", "extended", 1),
    ):
        for original in rng.sample(
            [row for row in originals[from_subset] if row["uuid"] not in medium_prompt_ids], count
        ):
            text = _edit(original["problem"], rng.randint(0, 2))
            if _jaccard(text, original["problem"]) < 0.9:
                text = _edit(original["problem"], 0)
            row = make_row(rng, text, make_answer(rng), bucket="entirely_correct")
            removals["deduplication"].append(row["uuid"])
            copies.append((subset, original, row))

    for subset in subsets:
        rng.shuffle(subsets[subset])
    for subset, original, row in copies:
        rows = subsets[subset]
        after = rows.index(original) + 1 if original in rows else 0
        rows.insert(rng.randint(after, len(rows)), row)

    manifest = {
        "seed": seed,
        "removals": removals,
        "candidates": {f"{subset}/{bucket}": count for (subset, bucket), count in sorted(candidates.items())},
        "medium_prompt_ids": medium_prompt_ids,
        "rows": {subset: len(rows) for subset, rows in subsets.items()},
    }
    return subsets, manifest


CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: list[str], output_dir: Path, vocab_size: int = 3000) -> None:
    """A word-piece-sized BPE tokenizer trained on ``texts``, saved for ``AutoTokenizer.from_pretrained``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(output_dir))


def write_fixture(output_dir: str | Path, seed: int = 0, with_tokenizer: bool = True) -> dict[str, Any]:
    """Write the fixture files into ``output_dir`` and return the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    subsets, manifest = build_rows(seed)
    pq.write_table(pa.Table.from_pylist(subsets["default"]), output_dir / "default.parquet")
    with open(output_dir / "extended.jsonl", "w", encoding="utf-8") as handle:
        for row in subsets["extended"]:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    if with_tokenizer:
        texts = [row[key] for rows in subsets.values() for row in rows for key in ("problem", "solution")]
        texts += [text for rows in subsets.values() for row in rows for text in row["generations"]] + [INSTRUCTION]
        train_tokenizer(texts, output_dir / "tokenizer")
        _check_lengths(subsets, manifest, output_dir / "tokenizer")
    return manifest


def _check_lengths(subsets: dict[str, list[dict[str, Any]]], manifest: dict[str, Any], tokenizer_dir: Path) -> None:
    """The planted lengths land where they should under the trained tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    medium = set(manifest["medium_prompt_ids"])
    long_ids = set(manifest["removals"]["length"])
    for rows in subsets.values():
        for row in rows:
            messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": row["problem"]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            solution_tokens = len(tokenizer(row["solution"], add_special_tokens=False)["input_ids"])
            if row["uuid"] in medium:
                assert 1024 < tokens <= 4096, (row["uuid"], tokens)
            elif row["uuid"] in long_ids:
                assert tokens > 4096 or solution_tokens > 4096, (row["uuid"], tokens, solution_tokens)
            else:
                assert tokens <= 1024 and solution_tokens <= 4096, (row["uuid"], tokens, solution_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO_ROOT / "tests" / "data_fixtures" / "openr1"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    manifest = write_fixture(args.output, seed=args.seed)
    print(
        f"Wrote {args.output}: {manifest['rows']} rows, planted removals {[(k, len(v)) for k, v in manifest['removals'].items()]}"
    )


if __name__ == "__main__":
    main()
