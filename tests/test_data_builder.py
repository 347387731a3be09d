"""The OpenR1-Stable data builder on a fixture pool in OpenR1-Math-220k's schema with planted problems.

The fixture (tests/data_fixtures/openr1, written by tests/data_fixtures/make_openr1_fixture.py) records
in ``manifest.json`` which rows were built to fail which stage; the tests check that every stage removes
exactly those rows, that the pool follows the subset and bucket ratios, and that a seed fixes the output.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from egpo_trl.data.cli import main as data_main
from egpo_trl.data.dedup import NearDuplicateIndex, load_benchmark_problems, minhashes, shingles
from egpo_trl.data.openr1 import (
    QWEN_MATH_INSTRUCTION,
    OpenR1DataConfig,
    apportion,
    build_openr1_dataset,
    correctness_bucket,
    is_empty_answer,
    is_single_value_answer,
    sample_pool,
)
from egpo_trl.rewards import boxed_accuracy_reward

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data_fixtures" / "openr1"
RECIPE = REPO / "recipes" / "data" / "openr1_fixture.yaml"
STABLE_RECIPE = REPO / "recipes" / "data" / "openr1_stable_10k.yaml"
ROW_STAGES = ("answer", "min_generations", "length", "boxed_match", "decontamination", "deduplication")


def _generator():
    spec = importlib.util.spec_from_file_location(
        "make_openr1_fixture", REPO / "tests" / "data_fixtures" / "make_openr1_fixture.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fixture_config(output_dir: Path, **overrides) -> OpenR1DataConfig:
    """The fixture recipe with absolute paths, writing to ``output_dir``."""
    values = yaml.safe_load(RECIPE.read_text())
    for spec in values["inputs"]:
        spec["data_files"] = [str(REPO / name) for name in spec["data_files"]]
    values["tokenizer"] = str(REPO / values["tokenizer"])
    values["output_dir"] = str(output_dir)
    values.update(overrides)
    return OpenR1DataConfig.from_dict(values)


def read_removed(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "removed.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((FIXTURE / "manifest.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("build") / "openr1_fixture"
    result = build_openr1_dataset(fixture_config(output_dir), command="test build")
    return result


# --------------------------------------------------------------------------------------------------------------------
# The fixture itself
# --------------------------------------------------------------------------------------------------------------------


def test_fixture_files_are_what_the_generator_writes(manifest):
    rows, regenerated_manifest = _generator().build_rows(seed=manifest["seed"])
    assert regenerated_manifest == manifest
    assert pq.read_table(FIXTURE / "default.parquet").to_pylist() == rows["default"]
    extended = [json.loads(line) for line in (FIXTURE / "extended.jsonl").read_text().splitlines()]
    assert extended == rows["extended"]
    # OpenR1-Math-220k's columns.
    assert set(rows["default"][0]) >= {
        "problem",
        "solution",
        "answer",
        "problem_type",
        "question_type",
        "source",
        "uuid",
        "is_reasoning_complete",
        "generations",
        "correctness_math_verify",
        "correctness_llama",
        "finish_reasons",
        "correctness_count",
        "messages",
    }


# --------------------------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------------------------


def test_each_stage_removes_exactly_the_planted_rows(built, manifest):
    removed = read_removed(built.output_dir)
    by_stage: dict[str, set[str]] = {stage: set() for stage in ROW_STAGES}
    for record in removed:
        if record["stage"] in by_stage:
            by_stage[record["stage"]].add(record["id"])
    for stage in ROW_STAGES:
        assert by_stage[stage] == set(manifest["removals"][stage]), stage
    stages = {stage["name"]: stage for stage in built.stats["stages"]}
    rows_in = sum(manifest["rows"].values())
    for stage in ROW_STAGES:
        assert sum(stages[stage]["rows_in"].values()) == rows_in
        assert stages[stage]["removed"] == len(manifest["removals"][stage])
        rows_in -= len(manifest["removals"][stage])
    # What survives the row stages is exactly the clean rows, by correctness bucket.
    candidates = {f"{entry['subset']}/{entry['bucket']}": entry["count"] for entry in built.stats["candidates"]}
    assert candidates == manifest["candidates"]


def test_stage_reasons_and_details(built):
    stages = {stage["name"]: stage for stage in built.stats["stages"]}
    assert stages["answer"]["reasons"] == {"empty": 3, "multi_value": 6}
    assert stages["length"]["reasons"] == {"prompt_too_long": 2, "response_too_long": 2}
    assert built.stats["contamination_by_benchmark"] == {"math500": 5, "gsm8k": 5}
    # Two clean problems match only through a recorded generation; the boxed filter keeps them.
    assert built.stats["boxed_match_via"]["generation"] == 2
    removed = read_removed(built.output_dir)
    for record in removed:
        if record["stage"] == "length":
            assert record["tokens"] > 4096
        if record["stage"] in ("decontamination", "deduplication"):
            assert record["similarity"] >= 0.8
    # A kept row of every duplicate removal is a training candidate (it was not removed itself).
    removed_ids = {record["id"] for record in removed if record["stage"] != "final_prompt_length"}
    assert all(r["kept_id"] not in removed_ids for r in removed if r["stage"] == "deduplication")


def test_answer_rules():
    assert is_empty_answer("") and is_empty_answer("   ") and is_empty_answer(None) and is_empty_answer("$ $")
    assert not is_empty_answer("0")
    for single in [
        "42",
        "-3",
        "\\frac{3}{4}",
        "1,000",
        "12,345,678",
        "(1, 2)",
        "[0, 1)",
        "\\{1, 2\\}",
        "x^2+1",
        "3\\,000",
    ]:
        assert is_single_value_answer(single), single
    for several in [
        "2, 3",
        "3; 5",
        "x=1 \\text{ or } x=2",
        "1 and 2",
        "\\pm 4",
        "2 \\pm \\sqrt{3}",
        "1 \\quad 2",
        ["1", "2"],
    ]:
        assert not is_single_value_answer(several), several
    assert is_single_value_answer(["7"])


def test_correctness_buckets():
    assert correctness_bucket({"correctness_math_verify": [True, False]}) == "mixed"
    assert correctness_bucket({"correctness_math_verify": [True, True]}) == "entirely_correct"
    assert correctness_bucket({"correctness_math_verify": [False, None]}) == "entirely_incorrect"
    assert correctness_bucket({"correctness_math_verify": None}) == "unknown"
    row = {"correctness_math_verify": [False, False], "correctness_llama": [True, False]}
    assert correctness_bucket(row, "either") == "mixed"
    assert correctness_bucket(row, "llama") == "mixed"
    assert correctness_bucket(row, "math_verify") == "entirely_incorrect"


def test_near_duplicate_index_uses_the_threshold():
    base = "Alice has 12 red marbles and buys 7 more at the market. How many marbles does she have now?"
    close = base + " Explain."  # two new shingles: Jaccard 19/21
    far = "Bruno arranges 40 tiles into rows of 8 at the harbor. How many rows are there?"
    assert len(shingles(base) & shingles(close)) / len(shingles(base) | shingles(close)) == pytest.approx(19 / 21)
    index = NearDuplicateIndex(threshold=0.8, num_perm=128)
    signatures = minhashes([base, close, far, base.upper()], num_perm=128)
    assert index.add(signatures[0]) == 0
    assert index.best_match(signatures[1])[0] == 0
    assert index.best_match(signatures[2]) is None
    assert index.best_match(signatures[3]) == (0, 1.0)  # case and spacing do not matter


def test_vendored_benchmarks_for_decontamination():
    problems = load_benchmark_problems(["math500", "gsm8k", "aime24", "amc23", "minerva_math", "mmlu_stem"])
    counts = Counter(problem.benchmark for problem in problems)
    assert counts == {"math500": 500, "gsm8k": 1319, "aime24": 30, "amc23": 40, "minerva_math": 272, "mmlu_stem": 3018}
    with pytest.raises(ValueError, match="neither a vendored set"):
        load_benchmark_problems(["no_such_benchmark"])


# --------------------------------------------------------------------------------------------------------------------
# Sampling, split, final filter
# --------------------------------------------------------------------------------------------------------------------


def test_pool_follows_subset_and_bucket_ratios(built):
    pool = built.stats["pool"]
    assert pool["size"] == 100
    assert pool["subsets"] == {"default": 85, "extended": 15}  # 0.85 / 0.15
    assert pool["cells"] == {  # 0.60 / 0.40 inside each subset
        "default/mixed": 51,
        "default/entirely_correct": 34,
        "extended/mixed": 9,
        "extended/entirely_correct": 6,
    }
    assert built.stats["sampling"]["filled"] == []
    stages = {stage["name"]: stage for stage in built.stats["stages"]}
    assert sum(stages["validation_split"]["rows_out"].values()) == 90  # 10 held out


def test_final_prompt_filter_drops_exactly_the_long_sampled_prompts(built, manifest):
    from transformers import AutoTokenizer

    dataset = built.dataset
    removed = [r for r in read_removed(built.output_dir) if r["stage"] == "final_prompt_length"]
    kept_ids = set(dataset["train"]["id"]) | set(dataset["validation"]["id"])
    sampled = kept_ids | {r["id"] for r in removed}
    assert len(sampled) == 100
    assert len(set(dataset["train"]["id"]) & set(dataset["validation"]["id"])) == 0
    assert len(dataset["validation"]) + sum(r["split"] == "validation" for r in removed) == 10
    # The removed ones are the sampled prompts planted between 1024 and 4096 tokens.
    assert {r["id"] for r in removed} == sampled & set(manifest["medium_prompt_ids"])
    assert removed, "the fixture seed should sample some long prompts"
    tokenizer = AutoTokenizer.from_pretrained(str(FIXTURE / "tokenizer"))
    for prompt in list(dataset["train"]["prompt"]) + list(dataset["validation"]["prompt"]):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 1024


def test_sample_pool_fills_shortfalls_and_caps_sources(tmp_path):
    from types import SimpleNamespace

    def make(subset, bucket, count, source="a"):
        return [SimpleNamespace(subset=subset, bucket=bucket, source=source, index=i) for i in range(count)]

    candidates = (
        make("default", "mixed", 3)
        + make("default", "entirely_correct", 20)
        + make("default", "entirely_incorrect", 5)
    )
    candidates += make("extended", "mixed", 10) + make("extended", "entirely_correct", 10)
    config = fixture_config(tmp_path / "unused", pool_size=20, val_size=2)
    pool, summary = sample_pool(candidates, config)
    assert len(pool) == 20
    counts = Counter((c.subset, c.bucket) for c in pool)
    # default wants 17 = 10 mixed + 7 correct, has 3 mixed: 7 more correct fill the gap first.
    assert counts[("default", "mixed")] == 3 and counts[("default", "entirely_correct")] == 14
    assert counts[("extended", "mixed")] + counts[("extended", "entirely_correct")] == 3
    assert summary["filled"] == [{"subset": "default", "bucket": "entirely_correct", "count": 7, "for": "default"}]
    # Without filling, the pool is smaller; with a source cap, no source exceeds it.
    pool, _ = sample_pool(
        candidates, fixture_config(tmp_path / "unused", pool_size=20, val_size=2, fill_shortfall=False)
    )
    assert len(pool) == 13
    sourced = [SimpleNamespace(subset="default", bucket="mixed", source=f"s{i % 4}", index=i) for i in range(40)]
    sourced += [SimpleNamespace(subset="extended", bucket="mixed", source="s9", index=i) for i in range(10)]
    config = fixture_config(
        tmp_path / "unused", pool_size=20, val_size=2, max_source_fraction=0.25, bucket_ratios={"mixed": 1.0}
    )
    pool, summary = sample_pool(sourced, config)
    assert summary["source_cap"] == 5 and max(Counter(c.source for c in pool).values()) <= 5
    assert apportion(10_000, {"default": 0.85, "extended": 0.15}) == {"default": 8500, "extended": 1500}
    assert apportion(1500, {"mixed": 0.6, "entirely_correct": 0.4, "entirely_incorrect": 0.0}) == {
        "mixed": 900,
        "entirely_correct": 600,
        "entirely_incorrect": 0,
    }


# --------------------------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------------------------


def test_outputs_are_ready_for_training(built):
    from datasets import load_from_disk

    output_dir = built.output_dir
    for name in (
        "report.md",
        "stats.json",
        "removed.jsonl",
        "build_config.yaml",
        "train.parquet",
        "validation.parquet",
    ):
        assert (output_dir / name).is_file(), name
    dataset = load_from_disk(str(output_dir / "dataset"))
    assert set(dataset) == {"train", "validation"}
    train = dataset["train"]
    assert {"prompt", "answer"} <= set(train.column_names)
    assert pq.read_table(output_dir / "train.parquet").to_pylist() == train.to_list()
    for row in train:
        assert row["prompt"] == [
            {"role": "system", "content": QWEN_MATH_INSTRUCTION},
            {"role": "user", "content": row["problem"]},
        ]
        assert row["bucket"] in ("mixed", "entirely_correct")
    completions = [[{"role": "assistant", "content": f"So the answer is \\boxed{{{a}}}."}] for a in train["answer"]]
    assert boxed_accuracy_reward(completions, train["answer"]) == [1.0] * len(train)
    report = (output_dir / "report.md").read_text()
    for needle in (
        "## Stages",
        "Seed: `1234`",
        "## Decontamination",
        "## Deduplication",
        "math500",
        "| default | 0.85 |",
    ):
        assert needle in report, needle


def test_same_seed_same_output_whatever_the_chunk_size(built, tmp_path):
    output_dir = tmp_path / "again"
    status = data_main(
        ["build", "--config", str(RECIPE), "--output_dir", str(output_dir), "--chunk_size", "7"]
        + ["--tokenizer", str(FIXTURE / "tokenizer"), "--inputs", _absolute_inputs()]
    )
    assert status == 0
    stats = json.loads((output_dir / "stats.json").read_text())
    assert stats["content_sha256"] == built.stats["content_sha256"]
    for name in ("train.parquet", "validation.parquet"):
        assert pq.read_table(output_dir / name).to_pylist() == pq.read_table(built.output_dir / name).to_pylist()
    assert sorted(map(json.dumps, read_removed(output_dir))) == sorted(map(json.dumps, read_removed(built.output_dir)))


def test_another_seed_draws_another_pool_with_the_same_ratios(built, tmp_path):
    result = build_openr1_dataset(fixture_config(tmp_path / "seed7", seed=7))
    assert result.stats["pool"]["cells"] == built.stats["pool"]["cells"]
    assert set(result.dataset["train"]["id"]) != set(built.dataset["train"]["id"])


def test_reads_a_local_copy_of_the_hub_repository(built, tmp_path):
    """`path` + `name` (the hub route, here on a local folder in OpenR1-Math-220k's layout) gives the same pool."""
    import pyarrow as pa

    repo = tmp_path / "OpenR1-Math-220k"
    (repo / "data").mkdir(parents=True)
    (repo / "extended").mkdir()
    pq.write_table(pq.read_table(FIXTURE / "default.parquet"), repo / "data" / "train-00000-of-00001.parquet")
    extended = [json.loads(line) for line in (FIXTURE / "extended.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(extended), repo / "extended" / "train-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "- config_name: extended\n  data_files:\n  - split: train\n    path: extended/train-*\n---\n"
    )
    columns = ["problem", "solution", "answer", "source", "uuid", "generations", "correctness_math_verify"]
    inputs = [
        {"subset": name, "path": str(repo), "name": name, "columns": columns} for name in ("default", "extended")
    ]
    result = build_openr1_dataset(fixture_config(tmp_path / "out", inputs=inputs))
    assert result.stats["content_sha256"] == built.stats["content_sha256"]


def test_data_files_kind_is_read_from_the_matched_files(tmp_path):
    """A glob without an extension, or an upper-case suffix, reads the files it matches."""
    import shutil

    from egpo_trl.data.openr1 import InputSpec

    (tmp_path / "data").mkdir()
    shutil.copy(FIXTURE / "default.parquet", tmp_path / "DEF.PARQUET")
    shutil.copy(FIXTURE / "extended.jsonl", tmp_path / "data" / "train-00000.jsonl")
    for pattern in ("DEF.PARQUET", "data/train-*"):
        rows = list(InputSpec(subset="default", data_files=[str(tmp_path / pattern)], limit=3).stream())
        assert len(rows) == 3 and all(row["problem"] for row in rows)
    (tmp_path / "data" / "train-00001.csv").write_text("problem\n")
    with pytest.raises(ValueError, match="all be parquet or all be jsonl/json"):
        next(iter(InputSpec(subset="default", data_files=[str(tmp_path / "data/train-*")]).stream()))


def _absolute_inputs() -> str:
    values = yaml.safe_load(RECIPE.read_text())["inputs"]
    for spec in values:
        spec["data_files"] = [str(REPO / name) for name in spec["data_files"]]
    return json.dumps(values)


# --------------------------------------------------------------------------------------------------------------------
# Safety and configuration errors
# --------------------------------------------------------------------------------------------------------------------


def test_refuses_to_overwrite_unless_asked(built, tmp_path):
    before = (built.output_dir / "report.md").read_text()
    with pytest.raises(FileExistsError, match="--overwrite true"):
        build_openr1_dataset(fixture_config(built.output_dir))
    assert (built.output_dir / "report.md").read_text() == before
    # A folder this builder did not write is never replaced, even with overwrite.
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not written by this builder"):
        build_openr1_dataset(fixture_config(foreign, overwrite=True))
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert data_main(["build", "--config", str(RECIPE), "--output_dir", str(foreign)]) == 2
    # overwrite replaces an earlier build.
    target = tmp_path / "rebuild"
    inputs = json.loads(_absolute_inputs())
    for spec in inputs:
        spec["limit"] = 50  # only the first 50 rows of each input
    first = build_openr1_dataset(fixture_config(target, seed=3, decontaminate=False, inputs=inputs))
    assert [entry["rows"] for entry in first.stats["inputs"]] == [50, 50]
    result = build_openr1_dataset(fixture_config(target, seed=4, decontaminate=False, overwrite=True, inputs=inputs))
    assert json.loads((target / "stats.json").read_text())["seed"] == 4 == result.stats["seed"]
    assert not list(tmp_path.glob(".rebuild.*"))


def test_the_stable_recipe_holds_the_papers_settings():
    config = OpenR1DataConfig.from_yaml(STABLE_RECIPE)
    assert config == OpenR1DataConfig()  # the defaults are the paper's
    assert [(spec.subset, spec.path, spec.name) for spec in config.inputs] == [
        ("default", "open-r1/OpenR1-Math-220k", "default"),
        ("extended", "open-r1/OpenR1-Math-220k", "extended"),
    ]
    assert config.tokenizer == "Qwen/Qwen2.5-Math-1.5B"
    assert (config.pool_size, config.val_size, config.min_generations) == (10_000, 128, 2)
    assert (config.max_prompt_tokens, config.max_response_tokens, config.final_max_prompt_tokens) == (4096, 4096, 1024)
    assert (config.minhash_num_perm, config.minhash_threshold) == (128, 0.8)
    assert config.subset_ratios == {"default": 0.85, "extended": 0.15}
    assert config.bucket_ratios == {"mixed": 0.6, "entirely_correct": 0.4, "entirely_incorrect": 0.0}
    assert config.boxed_match_filter and config.decontaminate and config.deduplicate
    assert {"math500", "gsm8k", "aime24", "amc23", "minerva_math"} <= set(config.decontamination_benchmarks)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"subset_ratios": {"default": 0.8, "extended": 0.1}}, "sum to 1"),
        ({"subset_ratios": {"default": 1.0}}, "must be the input subsets"),
        ({"bucket_ratios": {"mixed": 0.5, "hard": 0.5}}, "unknown buckets"),
        ({"response_length_source": "generation"}, "choose one of"),
        ({"val_size": 100}, "smaller than pool_size"),
        ({"decontaminate": True, "decontamination_benchmarks": []}, "decontamination_benchmarks is empty"),
        ({"pool_sizes": 3}, "unknown setting"),
        ({"inputs": [{"subset": "default"}]}, "exactly one of `path`"),
    ],
)
def test_config_errors_name_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        fixture_config(tmp_path, **overrides)


def test_missing_columns_and_bad_cli_values(tmp_path, capsys):
    rows = [{"problem": "What is 1 + 1?", "answer": "2"}]
    path = tmp_path / "pool.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    inputs = [{"subset": "default", "data_files": [str(path)]}, {"subset": "extended", "data_files": [str(path)]}]
    with pytest.raises(ValueError, match="lacks the column"):
        build_openr1_dataset(fixture_config(tmp_path / "out", inputs=inputs, decontaminate=False))
    assert not (tmp_path / "out").exists()  # nothing half-written
    for spec in inputs:
        spec["data_files"] = [str(tmp_path / "none-*.parquet")]
    with pytest.raises(FileNotFoundError, match="no file matches"):
        build_openr1_dataset(fixture_config(tmp_path / "out", inputs=inputs, decontaminate=False))
    assert data_main(["build", "--config", str(RECIPE), "--pool_size", "many"]) == 2
    assert "--pool_size expects an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        data_main(["build", "--config", str(RECIPE), "--no_such_setting", "1"])


def test_a_recipe_without_a_tokenizer(tmp_path, capsys):
    """`tokenizer: null` builds when no token limit is set, and otherwise stops in one line."""
    values = yaml.safe_load(RECIPE.read_text())
    values["inputs"] = json.loads(_absolute_inputs())
    values.update(tokenizer=None, output_dir=str(tmp_path / "out"), decontaminate=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    assert data_main(["build", "--config", str(recipe)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "tokenizer is null but max_prompt_tokens counts tokens" in error
    no_limits = [f"--{name}=null" for name in ("max_prompt_tokens", "max_response_tokens", "final_max_prompt_tokens")]
    assert data_main(["build", "--config", str(recipe), *no_limits]) == 0
    assert (tmp_path / "out" / "train.parquet").exists()


def test_no_chat_template_warning_names_the_tokenizer_when_prompts_are_counted(tmp_path, caplog):
    import shutil

    tokenizer = tmp_path / "plain-tokenizer"
    shutil.copytree(FIXTURE / "tokenizer", tokenizer, ignore=shutil.ignore_patterns("chat_template.jinja"))
    settings = {"tokenizer": str(tokenizer), "decontaminate": False, "final_max_prompt_tokens": None}
    with caplog.at_level("WARNING", logger="egpo_trl.data.openr1"):
        build_openr1_dataset(fixture_config(tmp_path / "responses", max_prompt_tokens=None, **settings))
    assert "no chat template" not in caplog.text  # only response lengths were counted
    with caplog.at_level("WARNING", logger="egpo_trl.data.openr1"):
        build_openr1_dataset(fixture_config(tmp_path / "prompts", **settings))
    warnings = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert warnings == [f"Tokenizer {tokenizer} has no chat template: counting the prompts' text only."]


def test_build_without_the_hub_stops_in_one_line(monkeypatch, capsys, tmp_path):
    """Offline, or with the Hub out of reach, the build says so at once instead of retrying for half a minute."""
    import time

    from huggingface_hub import constants

    from egpo_trl.data.cli import hub_problem

    output = ["--output_dir", str(tmp_path / "out")]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert data_main(["build", "--config", str(STABLE_RECIPE), *output]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "open-r1/OpenR1-Math-220k" in error and "HF_HUB_OFFLINE is set" in error
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.monotonic()
    assert data_main(["build", "--config", str(STABLE_RECIPE), *output]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "http://127.0.0.1:9 cannot be reached" in error
    assert time.monotonic() - start < 15 and not (tmp_path / "out").exists()
    # Local inputs and a local tokenizer need no network.
    assert hub_problem(fixture_config(tmp_path / "local")) is None
