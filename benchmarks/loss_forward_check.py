"""Does ``egpo_entropy_logps="loss_forward"`` train as the no-grad pass (``"policy"``) under a distributed engine?

Runs ``tests/scripts/ddp_fused.py`` (a tiny random Qwen2, float32, two optimizer steps, 2 rows per device, 4
accumulation steps: blocks of 2 micro-batches; ``--per-device-batch 1 --accumulation 8``: blocks of 4) under
``accelerate launch`` with each engine's configuration from ``recipes/accelerate/``, once per setting, and prints,
per engine, the largest differences between the two runs' logged metrics and final weights. A second ``policy`` run gives the engine's own run-to-run spread, the yardstick.
The last column counts process 0's backward calls: one per micro-batch (8 in the 2 steps by default), or under DDP
one per block (4), where the block's micro-batches share one backward.

    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/loss_forward_check.py --out /tmp/lf --engines zero2 zero3

Without a GPU the same command checks ZeRO-2 and ZeRO-3 on the CPU (2 processes over gloo).

Exits 1 when a difference is larger than ``--rtol``/``--atol`` (or a run fails).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("reward", "loss", "grad_norm", "egpo/entropy_mean", "egpo/weight_correct", "egpo/weight_incorrect")


def run(
    engine: str,
    logps: str,
    checkpointing: bool,
    model: str,
    out: Path,
    port: int,
    processes: int,
    shape: tuple[int, int] = (2, 4),
    settings: str | None = None,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(ROOT / "recipes" / "accelerate" / f"{engine}.yaml"), "--num_processes", str(processes)]
    command += ["--mixed_precision", "no", "--main_process_port", str(port)]
    script = ROOT / "tests" / "scripts" / "ddp_fused.py"
    command += [str(script), model, str(out), logps, "1" if checkpointing else "0", *map(str, shape)]
    if settings:
        command.append(settings)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    with open(out / "run.log", "w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode:
        return {"error": f"exit {done.returncode}, see {out / 'run.log'}"}
    rows = json.loads((out / "log.json").read_text())
    backwards = json.loads((out / "backwards.json").read_text())
    return {"rows": rows, "weights": torch.load(out / "weights.pt"), "backwards": backwards}


def differences(a: dict, b: dict) -> dict:
    """Largest absolute and relative differences between two runs' metrics and weights."""
    metric_abs = metric_rel = 0.0
    for row_a, row_b in zip(a["rows"], b["rows"], strict=True):
        for key in METRICS:
            x, y = row_a.get(key), row_b.get(key)
            if x is None or y is None:
                continue
            metric_abs = max(metric_abs, abs(x - y))
            metric_rel = max(metric_rel, abs(x - y) / max(abs(y), 1e-12))
    weight_abs = max((a["weights"][k] - w).abs().max().item() for k, w in b["weights"].items())
    return {"metric_abs": metric_abs, "metric_rel": metric_rel, "weight_abs": weight_abs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the runs (model, logs, weights)")
    parser.add_argument("--engines", nargs="+", default=["zero2", "zero3"], choices=["ddp", "zero2", "zero3"])
    parser.add_argument("--checkpointing", nargs="+", type=int, default=[1, 0], choices=[0, 1])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--per-device-batch", type=int, default=2, help="rows per micro-batch (1 makes blocks of 4)")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument(
        "--settings",
        help='more EGPOConfig settings for every run, as JSON, e.g. \'{"egpo_entropy_scope": "answer"}\'',
    )
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest relative metric difference accepted")
    parser.add_argument("--atol", type=float, default=1e-5, help="largest weight difference accepted")
    parser.add_argument("--json", help="write the table's rows here")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_qwen2 import build_tiny_model

    out = Path(args.out)
    model = build_tiny_model(str(out / "tiny-qwen2"))
    table, failed = [], False
    shape = (args.per_device_batch, args.accumulation)
    print(
        "| engine | checkpointing | compared | metrics max abs | metrics max rel | weights max abs | within | "
        "backward calls (process 0) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | --- | --- |")
    for engine in args.engines:
        for checkpointing in args.checkpointing:
            runs = {}
            for name, logps in (("policy", "policy"), ("policy_again", "policy"), ("loss_forward", "loss_forward")):
                folder = out / f"{engine}-ckpt{checkpointing}" / name
                runs[name] = run(
                    engine, logps, bool(checkpointing), model, folder, args.port, args.processes, shape, args.settings
                )
                args.port += 1
            for other in ("policy_again", "loss_forward"):
                row = {"engine": engine, "checkpointing": bool(checkpointing), "compared": f"{other} vs policy"}
                errors = [runs[n]["error"] for n in ("policy", other) if "error" in runs[n]]
                if errors:
                    row["error"] = "; ".join(errors)
                    failed = True
                    print(f"| {engine} | {bool(checkpointing)} | {row['compared']} | {row['error']} | | | no | |")
                else:
                    row.update(differences(runs[other], runs["policy"]))
                    row["within"] = row["metric_rel"] <= args.rtol and row["weight_abs"] <= args.atol
                    row["backwards"] = {"policy": runs["policy"]["backwards"], other: runs[other]["backwards"]}
                    failed |= not row["within"]
                    print(
                        f"| {engine} | {bool(checkpointing)} | {row['compared']} | {row['metric_abs']:.2e} | "
                        f"{row['metric_rel']:.2e} | {row['weight_abs']:.2e} | {'yes' if row['within'] else 'NO'} | "
                        f"{runs[other]['backwards']} against {runs['policy']['backwards']} |",
                        flush=True,
                    )
                table.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
