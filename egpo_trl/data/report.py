"""Markdown report of a training-data build (see :func:`egpo_trl.data.openr1.build_openr1_dataset`)."""

from __future__ import annotations

from typing import Any

import yaml


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return lines + [""]


def _share(count: int, total: int) -> str:
    return f"{count} ({100.0 * count / total:.1f}%)" if total else str(count)


def render_report(stats: dict[str, Any]) -> str:
    """The Markdown report of a build from its statistics (the ``stats.json`` the builder writes)."""
    config = stats["config"]
    subsets = list(config["subset_ratios"])
    lines = ["# Training-data build report", ""]
    if stats.get("command"):
        lines += ["Command:", "", "```bash", stats["command"], "```", ""]
    lines += [
        f"- Seed: `{stats['seed']}`",
        f"- Tokenizer: `{stats['tokenizer']}`",
        f"- Rows read: {stats['rows_read']}",
        f"- Output: train {stats['splits']['train']['rows']} rows, validation {stats['splits']['validation']['rows']} rows",
        f"- Build time: {stats['elapsed_s']} s",
        "",
        "## Inputs",
        "",
    ]
    lines += _table(["subset", "read from", "rows"], [[i["subset"], i["source"], i["rows"]] for i in stats["inputs"]])

    lines += ["## Stages", ""]
    rows = []
    for number, stage in enumerate(stats["stages"], start=1):
        rows_in, rows_out = sum(stage["rows_in"].values()), sum(stage["rows_out"].values())
        per_subset = ", ".join(
            f"{subset} {stage['rows_in'].get(subset, 0) - stage['rows_out'].get(subset, 0)}" for subset in subsets
        )
        name = stage["name"] if stage["enabled"] else f"{stage['name']} (off)"
        rows.append([number, name, stage["setting"], rows_in, stage["removed"], rows_out, per_subset])
    lines += _table(["#", "stage", "setting", "rows in", "removed", "rows out", "removed per subset"], rows)
    lines += [
        "Stages 1-6 run on the stream of input rows; `sampling` draws the pool from the surviving candidates; "
        "`validation_split` moves its removed rows to the validation split; `final_prompt_length` applies to both "
        "splits.",
        "",
    ]
    reason_rows = [
        [stage["name"], reason, count]
        for stage in stats["stages"]
        for reason, count in sorted(stage["reasons"].items())
    ]
    if reason_rows:
        lines += ["### Removal reasons", ""] + _table(["stage", "reason", "rows"], reason_rows)
    via = stats.get("boxed_match_via") or {}
    if via:
        lines += [
            f"Boxed match: {via.get('solution', 0)} problems matched through the reference solution, "
            f"{via.get('generation', 0)} only through a recorded generation.",
            "",
        ]

    lines += ["## Candidates by correctness bucket", ""]
    buckets = sorted({entry["bucket"] for entry in stats["candidates"]})
    counts = {(entry["subset"], entry["bucket"]): entry["count"] for entry in stats["candidates"]}
    cand_rows = []
    for subset in subsets:
        total = sum(counts.get((subset, bucket), 0) for bucket in buckets)
        cand_rows.append([subset] + [_share(counts.get((subset, bucket), 0), total) for bucket in buckets] + [total])
    lines += _table(["subset"] + buckets + ["total"], cand_rows)

    pool = stats["pool"]
    sampling = stats["sampling"]
    lines += ["## Pool", "", f"Requested {sampling['requested']} problems, drew {pool['size']}.", ""]
    lines += ["| subset | target share | actual |", "| --- | --- | --- |"]
    lines += [
        f"| {subset} | {config['subset_ratios'][subset]:.2f} | {_share(pool['subsets'].get(subset, 0), pool['size'])} |"
        for subset in subsets
    ]
    lines += [""]
    cell_rows = []
    for cell in sampling["cells"]:
        subset_total = pool["subsets"].get(cell["subset"], 0)
        target = config["bucket_ratios"].get(cell["bucket"], 0.0)
        taken = pool["cells"].get(f"{cell['subset']}/{cell['bucket']}", 0)
        cell_rows.append(
            [
                cell["subset"],
                cell["bucket"],
                f"{target:.2f}",
                cell["quota"],
                cell["available"],
                _share(taken, subset_total),
            ]
        )
    lines += _table(["subset", "bucket", "target share", "quota", "available", "in pool (share of subset)"], cell_rows)
    if sampling["filled"]:
        lines += ["Shortfalls were filled:", ""]
        lines += _table(
            ["from subset", "from bucket", "rows", "filling for"],
            [[f["subset"], f["bucket"], f["count"], f["for"]] for f in sampling["filled"]],
        )
    if sampling.get("source_cap"):
        lines += [f"At most {sampling['source_cap']} problems per `source`.", ""]

    lines += ["## Splits", ""]
    split_rows = []
    for name, split in stats["splits"].items():
        subset_text = ", ".join(f"{k} {_share(v, split['rows'])}" for k, v in split["subsets"].items())
        bucket_text = ", ".join(f"{k} {_share(v, split['rows'])}" for k, v in split["buckets"].items())
        split_rows.append([name, split["rows"], subset_text, bucket_text])
    lines += _table(["split", "rows", "subsets", "buckets"], split_rows)

    by_name = {stage["name"]: stage for stage in stats["stages"]}
    decontam = by_name["decontamination"]
    lines += [
        "## Decontamination",
        "",
        f"{decontam['removed']} rows removed as near duplicates of evaluation problems.",
    ]
    lines += [""]
    if stats.get("contamination_by_benchmark"):
        lines += _table(["benchmark", "rows removed"], sorted(stats["contamination_by_benchmark"].items()))
    if decontam["examples"]:
        lines += _table(
            ["row", "benchmark (row)", "similarity", "problem", "benchmark problem"],
            [
                [
                    e["id"],
                    f"{e['benchmark']} ({e['benchmark_index']})",
                    e["similarity"],
                    e["problem"],
                    e["benchmark_problem"],
                ]
                for e in decontam["examples"]
            ],
        )
    dedup = by_name["deduplication"]
    lines += [
        "## Deduplication",
        "",
        f"{dedup['removed']} rows removed as near duplicates of an earlier pool row.",
        "",
    ]
    if dedup["examples"]:
        lines += _table(
            ["removed row", "kept row", "similarity", "removed problem", "kept problem"],
            [[e["id"], e["kept_id"], e["similarity"], e["problem"], e["kept_problem"]] for e in dedup["examples"]],
        )

    lines += ["## Examples of other removals", ""]
    for stage in stats["stages"]:
        if stage["name"] in ("decontamination", "deduplication") or not stage["examples"]:
            continue
        lines += [f"### {stage['name']}", ""]
        detail_keys = [k for k in stage["examples"][0] if k not in ("stage", "id", "subset", "index", "problem")]
        lines += _table(
            ["row"] + detail_keys + ["problem"],
            [[e["id"]] + [e.get(k, "") for k in detail_keys] + [e["problem"]] for e in stage["examples"]],
        )

    lines += ["## Outputs", ""]
    lines += [
        "- `dataset/`: `datasets.DatasetDict` (`load_from_disk`) with `train` and `validation`; columns `prompt` "
        "(chat messages), `answer`, `problem`, `id`, `subset`, `bucket`, `source`",
        "- `train.parquet`, `validation.parquet`" if config.get("save_parquet") else "- no parquet files",
        "- `removed.jsonl`: one line per removed row (stage, reason, id, details)",
        "- `stats.json`, `build_config.yaml`",
        "",
    ]
    lines += _table(["split", "content SHA-256"], sorted(stats["content_sha256"].items()))
    lines += [
        "## Settings",
        "",
        "```yaml",
        yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)
