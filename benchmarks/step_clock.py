"""Steps of finished runs by the clock and as TRL's ``step_time`` counts them, and each run's steps over the first's.

    python benchmarks/step_clock.py [--tgz RUNS.tgz] BASE=PATH [LABEL=PATH ...]

``PATH`` is a run's ``metrics.jsonl`` (or the folder holding it, or its ``run/`` folder), or with ``--tgz`` a member
of that archive (the ``runs.tgz`` files kept under ``benchmarks/results/``). Per run and step it prints TRL's
``step_time`` (the host's time inside the step's ``training_step`` calls), the clock (the record's ``clock_s``, or
for older files ``time_s`` from the previous step's record: see ``steps``), the time outside those calls (clock less
``step_time``: the GPU work still queued when each call returned, which the Trainer waits for outside it, and the
Trainer's own work between calls and at the log), and both over the base run's same step.
``benchmarks/summarize_recipe_runs.py`` says why the clock is the one to compare. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path


def read_records(path: str, archive: tarfile.TarFile | None = None) -> list[dict]:
    """The ``metrics.jsonl`` records of a run: a file, a folder holding it (or its ``run/``), or an archive member."""
    if archive is not None:
        names = [path] + [f"{path.rstrip('/')}/{tail}" for tail in ("metrics.jsonl", "run/metrics.jsonl")]
        files = {member.name: member for member in archive.getmembers() if member.isfile()}
        member = next((files[name] for name in names if name in files), None)
        if member is None:
            raise SystemExit(f"step_clock: no {path} (nor its metrics.jsonl) in the archive")
        text = archive.extractfile(member).read().decode()
    else:
        candidate = Path(path)
        for option in (candidate, candidate / "metrics.jsonl", candidate / "run" / "metrics.jsonl"):
            if option.is_file():
                text = option.read_text()
                break
        else:
            raise SystemExit(f"step_clock: no metrics.jsonl at {path}")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def steps(records: list[dict]) -> dict[int, dict]:
    """Per logged optimizer step: ``step_time`` and the clock. The clock is the record's own ``clock_s`` (seconds per
    step since the run's previous log, or since it started or resumed: ``egpo_trl``'s metrics callback writes it);
    for files written before it did, the difference of ``time_s`` from the previous step record, over the steps in
    between (a ``logging_steps`` > 1 record covers several, and ``step_time`` is their mean). That difference knows
    nothing of resumes, so there the first record gets a clock only if it is step 1."""
    out, previous_time, previous_step = {}, None, None
    for record in records:
        if not isinstance(record.get("step_time"), (int, float)) or not isinstance(record.get("step"), int):
            continue
        clock = record.get("clock_s") if isinstance(record.get("clock_s"), (int, float)) else None
        time_s = record.get("time_s")
        if clock is None and isinstance(time_s, (int, float)):
            if previous_step is None and record["step"] == 1:
                clock = time_s
            elif previous_step is not None and record["step"] > previous_step:
                clock = (time_s - previous_time) / (record["step"] - previous_step)
        if isinstance(time_s, (int, float)):
            previous_time, previous_step = time_s, record["step"]
        out[record["step"]] = {"step_time": record["step_time"], "clock": clock}
    return out


def table(runs: list[tuple[str, dict[int, dict]]]) -> str:
    """A Markdown table: each run's steps, by ``step_time`` and by the clock, and both over the first run's."""

    def f(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    base = runs[0][1]
    lines = [
        "| run | step | step_time s | clock s | outside training_step s | step_time / base | clock / base |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, run in runs:
        for step, row in sorted(run.items()):
            other = base.get(step, {})
            clock, step_time = row["clock"], row["step_time"]
            outside = clock - step_time if clock is not None else None
            by_step = step_time / other["step_time"] if other.get("step_time") else None
            by_clock = clock / other["clock"] if clock is not None and other.get("clock") else None
            lines.append(
                f"| {label} | {step} | {f(step_time)} | {f(clock)} | {f(outside)} | {f(by_step, '{:.3f}')} | "
                f"{f(by_clock, '{:.3f}')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tgz", type=Path, help="read the paths as members of this archive")
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="the first is the base")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    archive = tarfile.open(args.tgz) if args.tgz else None
    runs = []
    for item in args.runs:
        label, _, path = item.partition("=")
        if not path:
            parser.error(f"{item!r}: give LABEL=PATH")
        runs.append((label, steps(read_records(path, archive))))
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
