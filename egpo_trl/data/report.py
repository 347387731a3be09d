"""Markdown report of a training-data build (see :func:`egpo_trl.data.openr1.build_openr1_dataset`)."""

from __future__ import annotations

from typing import Any

import yaml


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header, ["---"] * len(header)] + [
        [str(v).replace("|", "\\|").replace("\n", " ") for v in r] for r in rows
    ]
    return ["| " + " | ".join(row) + " |" for row in cells] + [""]


def _share(count: int, total: int) -> str:
    return f"{count} ({100.0 * count / total:.1f}%)" if total else str(count)


def render_report(stats: dict[str, Any]) -> str:
    """The Markdown report of a build from its statistics (the ``stats.json`` the builder writes)."""
    config, pool, sampling, splits = stats["config"], stats["pool"], stats["sampling"], stats["splits"]
    subsets = list(config["subset_ratios"])
    stages = {stage["name"]: stage for stage in stats["stages"]}
    lines = ["# Training-data build report", ""]
    if stats.get("command"):
        lines += ["Command:", "", "```bash", stats["command"], "```", ""]
    lines += [f"- Seed: `{stats['seed']}`\n- Tokenizer: `{stats['tokenizer']}`\n- Rows read: {stats['rows_read']}"]
    lines += [f"- Output: train {splits['train']['rows']} rows, validation {splits['validation']['rows']} rows"]
    lines += [f"- Build time: {stats['elapsed_s']} s\n\n## Inputs\n"]
    lines += _table(["subset", "read from", "rows"], [[i["subset"], i["source"], i["rows"]] for i in stats["inputs"]])

    rows = []
    for number, stage in enumerate(stats["stages"], start=1):
        rows_in, rows_out = stage["rows_in"], stage["rows_out"]
        per_subset = ", ".join(f"{s} {rows_in.get(s, 0) - rows_out.get(s, 0)}" for s in subsets)
        name = stage["name"] if stage["enabled"] else f"{stage['name']} (off)"
        rows.append([number, name, stage["setting"], sum(rows_in.values()), stage["removed"]])
        rows[-1] += [sum(rows_out.values()), per_subset]
    lines += ["## Stages", ""]
    lines += _table(["#", "stage", "setting", "rows in", "removed", "rows out", "removed per subset"], rows)
    lines.append(
        "Stages 1-6 run on the stream of input rows; `sampling` draws the pool from the surviving candidates; "
        "`validation_split` moves its removed rows to the validation split; `final_prompt_length` applies to both "
        "splits.\n"
    )
    reasons = [[s["name"], reason, n] for s in stats["stages"] for reason, n in sorted(s["reasons"].items())]
    if reasons:
        lines += ["### Removal reasons", ""] + _table(["stage", "reason", "rows"], reasons)
    if via := stats.get("boxed_match_via"):
        lines.append(
            f"Boxed match: {via.get('solution', 0)} problems matched through the reference solution, "
            f"{via.get('generation', 0)} only through a recorded generation.\n"
        )

    buckets = sorted({entry["bucket"] for entry in stats["candidates"]})
    counts = {(entry["subset"], entry["bucket"]): entry["count"] for entry in stats["candidates"]}
    rows = []
    for subset in subsets:
        total = sum(counts.get((subset, bucket), 0) for bucket in buckets)
        rows.append([subset] + [_share(counts.get((subset, bucket), 0), total) for bucket in buckets] + [total])
    lines += ["## Candidates by correctness bucket", ""] + _table(["subset"] + buckets + ["total"], rows)

    lines += ["## Pool", "", f"Requested {sampling['requested']} problems, drew {pool['size']}.", ""]
    rows = [[s, f"{config['subset_ratios'][s]:.2f}", _share(pool["subsets"].get(s, 0), pool["size"])] for s in subsets]
    lines += _table(["subset", "target share", "actual"], rows)
    rows = [
        [c["subset"], c["bucket"], f"{config['bucket_ratios'].get(c['bucket'], 0.0):.2f}", c["quota"], c["available"]]
        + [_share(pool["cells"].get(f"{c['subset']}/{c['bucket']}", 0), pool["subsets"].get(c["subset"], 0))]
        for c in sampling["cells"]
    ]
    lines += _table(["subset", "bucket", "target share", "quota", "available", "in pool (share of subset)"], rows)
    if sampling["filled"]:
        rows = [[f["subset"], f["bucket"], f["count"], f["for"]] for f in sampling["filled"]]
        lines += ["Shortfalls were filled:", ""] + _table(["from subset", "from bucket", "rows", "filling for"], rows)
    if sampling.get("source_cap"):
        lines += [f"At most {sampling['source_cap']} problems per `source`.", ""]

    rows = []
    for name, split in splits.items():
        shares = [
            ", ".join(f"{k} {_share(v, split['rows'])}" for k, v in split[key].items())
            for key in ("subsets", "buckets")
        ]
        rows.append([name, split["rows"], *shares])
    lines += ["## Splits", ""] + _table(["split", "rows", "subsets", "buckets"], rows)

    decontam, dedup = stages["decontamination"], stages["deduplication"]
    lines += [f"## Decontamination\n\n{decontam['removed']} rows removed as near duplicates of evaluation problems.\n"]
    if stats.get("contamination_by_benchmark"):
        lines += _table(["benchmark", "rows removed"], sorted(stats["contamination_by_benchmark"].items()))
    if decontam["examples"]:
        keys, examples = ("similarity", "problem", "benchmark_problem"), decontam["examples"]
        rows = [[e["id"], f"{e['benchmark']} ({e['benchmark_index']})", *(e[k] for k in keys)] for e in examples]
        lines += _table(["row", "benchmark (row)", "similarity", "problem", "benchmark problem"], rows)
    lines += [f"## Deduplication\n\n{dedup['removed']} rows removed as near duplicates of an earlier pool row.\n"]
    if dedup["examples"]:
        rows = [[e["id"], e["kept_id"], e["similarity"], e["problem"], e["kept_problem"]] for e in dedup["examples"]]
        lines += _table(["removed row", "kept row", "similarity", "removed problem", "kept problem"], rows)

    lines += ["## Examples of other removals", ""]
    for stage in stats["stages"]:
        if stage["name"] in ("decontamination", "deduplication") or not stage["examples"]:
            continue
        keys = [k for k in stage["examples"][0] if k not in ("stage", "id", "subset", "index", "problem")]
        rows = [[e["id"]] + [e.get(k, "") for k in keys] + [e["problem"]] for e in stage["examples"]]
        lines += [f"### {stage['name']}", ""] + _table(["row"] + keys + ["problem"], rows)

    lines += [
        "## Outputs\n\n- `dataset/`: `datasets.DatasetDict` (`load_from_disk`) with `train` and `validation`; columns "
        "`prompt` (chat messages), `answer`, `problem`, `id`, `subset`, `bucket`, `source`",
        "- `train.parquet`, `validation.parquet`" if config.get("save_parquet") else "- no parquet files",
        "- `removed.jsonl`: one line per removed row (stage, reason, id, details)\n- `stats.json`, `build_config.yaml`\n",
    ]
    lines += _table(["split", "content SHA-256"], sorted(stats["content_sha256"].items()))
    settings = yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip()
    return "\n".join(lines + ["## Settings", "", "```yaml", settings, "```", ""])
