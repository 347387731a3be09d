"""Each phase of a finished run's steps against its physical floor.

    python benchmarks/floor.py RUN_FOLDER [--recipe recipes/egpo_qwen15b.yaml] [--shape qwen15b | --model-config DIR]
        [--card h100|h200] [--prompt-length 200] [--summary OUT/summary.json]

``RUN_FOLDER`` is a folder of ``benchmarks/gpu_checks.sh`` (``command.txt`` and ``run/metrics.jsonl`` or
``metrics.jsonl``). The recipe (from ``command.txt`` or ``--recipe``) and the command give the completions per GPU
(``gradient_accumulation_steps * per_device_train_batch_size``) and gradient checkpointing; the architecture comes
from ``--model-config`` (a folder with ``config.json``), ``--shape`` (one of ``benchmarks/real_shapes.py``) or the
recipe's local model. Per logged step and GPU, with ``B`` completions of mean length ``L`` after ``P`` prompt tokens
and ``N`` the weights a token is multiplied by (an untied input embedding is a lookup and is left out):

* **generation** (``timing/generation_s``) against the decode bandwidth bound: every decode step reads the weights
  once and each sequence's KV cache so far, ``L * 2N + B * kv * (L * P + L (L + 1) / 2)`` bytes at the card's HBM
  bandwidth. With DAPO's dynamic sampling, each of the step's rounds reads the weights ``L`` times and every
  generated sequence reads its KV cache;
* **old log-prob pass** (``timing/old_logps_s``) against ``2 N`` FLOPs a token plus causal attention's score and
  value products (``2 * layers * heads * head_dim * T^2`` a row of ``T = P + L`` tokens);
* **scoring + training** (the step less ``timing/generate_and_score_s``) against ``6 N`` FLOPs a token plus three
  times attention's, times 4/3 with gradient checkpointing;
* **Guided Error Correction** (``timing/gec_s``, EDGE-GRPO) against the decode bound of its continued rows, each run
  to ``edge_gec_max_new_tokens``;
* **step**: the sum of those floors.

FLOPs at ``--mfu`` (50%) of the card's dense bf16 peak. The step and its training are timed by the clock where the
run logged it (``summarize_recipe_runs.py`` says why), else by TRL's ``step_time``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from summarize_recipe_runs import summarize  # noqa: E402

#: Dense bf16 peak (TFLOP/s) and HBM bandwidth (TB/s) of each card (SXM).
CARDS = {"h100": (989.0, 3.35), "h200": (989.0, 4.8)}
BYTES_BF16 = 2


def architecture(config: dict) -> dict:
    """Parameters (all, and those a token is multiplied by), KV-cache bytes per token (bf16) and causal attention's
    FLOPs per squared row length of a decoder-only transformer's ``config.json``."""
    d, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or d // heads
    inner = config.get("intermediate_size") or 4 * d
    attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
    attention += heads * head_dim + 2 * kv_heads * head_dim  # q/k/v biases (Qwen2)
    tied = bool(config.get("tie_word_embeddings"))
    params = layers * (attention + 3 * d * inner + 2 * d) + d + vocab * d * (1 if tied else 2)
    return {
        "parameters": params,
        "matmul_parameters": params - (0 if tied else vocab * d),
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * BYTES_BF16,
        "attention_flops_per_t2": 2 * layers * heads * head_dim,  # score and value products, forward, per row: x T^2
    }


def load_config(args, recipe: dict) -> dict:
    """The model's ``config.json`` as a dict, from ``--model-config``, ``--shape`` or the recipe's local model."""
    if args.model_config:
        path = Path(args.model_config)
        return json.loads((path / "config.json" if path.is_dir() else path).read_text())
    if args.shape:
        from real_shapes import SHAPES

        return dict(SHAPES[args.shape]["config"])
    model = Path(str(recipe.get("model_name_or_path", "")))
    if (model / "config.json").is_file():
        return json.loads((model / "config.json").read_text())
    raise SystemExit(f"Cannot read the architecture of {str(model)!r}: pass --model-config FOLDER or --shape.")


def option(argv: list[str], name: str, default):
    """The last ``--name VALUE`` (or ``--name=VALUE``) of a command line, else ``default``."""
    for index, item in enumerate(argv):
        if item == f"--{name}" and index + 1 < len(argv):
            default = argv[index + 1]
        elif item.startswith(f"--{name}="):
            default = item.split("=", 1)[1]
    return default


def setting(argv: list[str], recipe: dict, name: str) -> int:
    """An integer setting: the command line's, else the recipe's, else ``EGPOConfig``'s default."""
    from egpo_trl import EGPOConfig

    value = option(argv, name, recipe[name] if name in recipe else EGPOConfig.__dataclass_fields__[name].default)
    if value is None or str(value).lower() in ("none", "null", ""):
        raise SystemExit(f"{name} is {value!r} in the run's recipe or command; the floors need a number of tokens.")
    return int(value)


def floors(args, run: Path) -> list[dict]:
    """Rows of ``summarize_recipe_runs.summarize`` with each phase's floor and ratio added."""
    argv = shlex.split((run / "command.txt").read_text()) if (run / "command.txt").is_file() else []
    recipe_path = args.recipe or next((a for a in argv if a.endswith(".yaml")), None)
    if recipe_path is None:
        raise SystemExit(f"No recipe: {run}/command.txt names none; pass --recipe recipes/NAME.yaml.")
    recipe = yaml.safe_load(Path(recipe_path).read_text()) or {}
    arch = architecture(load_config(args, recipe))
    params, kv = arch["matmul_parameters"], arch["kv_bytes_per_token"]
    peak_tflops, bandwidth = CARDS[args.card]
    bandwidth *= 1e12
    flops_per_s = args.mfu * peak_tflops * 1e12
    per_gpu = setting(argv, recipe, "gradient_accumulation_steps") * setting(
        argv, recipe, "per_device_train_batch_size"
    )
    checkpointing = str(option(argv, "gradient_checkpointing", recipe.get("gradient_checkpointing", False)))
    recompute = 4 / 3 if checkpointing.lower() in ("true", "1", "yes") else 1
    rows = summarize(run)
    edge = any(row.get("gec_s") is not None for row in rows)
    max_length = setting(argv, recipe, "max_completion_length") if edge else 0
    gec_new = setting(argv, recipe, "edge_gec_max_new_tokens") if edge else 0
    out = []
    for row in rows:
        length, prompt = row.get("mean_length"), args.prompt_length
        if not length:
            out.append(row)
            continue
        row_tokens = prompt + length
        attention = per_gpu * arch["attention_flops_per_t2"] * row_tokens**2
        # Context tokens read over the decode steps; DAPO: each round reads the weights, every sequence its cache.
        context = per_gpu * (length * prompt + length * (length + 1) / 2) * float(row.get("generated_per_kept") or 1)
        rounds = max(1.0, float(row.get("rounds") or 1))
        floor = {
            "card": args.card,
            "completions_per_gpu": per_gpu,
            "prompt_length": prompt,
            "floor_generation_s": (rounds * length * BYTES_BF16 * params + kv * context) / bandwidth,
            "floor_old_logps_s": (2 * params * per_gpu * row_tokens + attention) / flops_per_s
            if row.get("old_logps_s")
            else 0.0,
            "floor_training_s": (6 * params * per_gpu * row_tokens + 3 * attention) * recompute / flops_per_s,
            "floor_gec_s": 0.0,
        }
        if row.get("gec_s") is not None and row.get("gec_frac_reflect"):
            # A continued row keeps at most max_length - new tokens of its completion and runs to its limit.
            new = min(gec_new, max_length // 2)
            start = prompt + min(length, max_length - new)
            continued = row["gec_frac_reflect"] * per_gpu
            floor["floor_gec_s"] = (
                new * BYTES_BF16 * params + continued * kv * (new * start + new * (new + 1) / 2)
            ) / (bandwidth)
        floor["floor_step_s"] = sum(floor[f"floor_{p}_s"] for p in ("generation", "old_logps", "gec", "training"))
        step = row.get("clock_s") or row["step_s"]
        training = row.get("rest_clock_s") if row.get("clock_s") else row.get("rest_s")
        for phase, measured in (
            ("generation", row.get("generation_s")),
            ("old_logps", row.get("old_logps_s")),
            ("gec", row.get("gec_s")),
            ("training", training),
            ("step", step),
        ):
            bound = floor[f"floor_{phase}_s"]
            floor[f"ratio_{phase}"] = measured / bound if measured is not None and bound else None
        floor["timed_by"] = "clock" if row.get("clock_s") else "step_time"
        out.append({**row, **floor})
    return out


def table(rows: list[dict]) -> str:
    """A Markdown table: per step and phase, measured seconds, floor seconds and their ratio."""
    lines = ["| recipe | step | phase | measured s | floor s | x floor |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for row in rows:
        if "floor_step_s" not in row:
            continue
        clock = row["timed_by"] == "clock"
        for phase, name, measured in (
            ("generation", "generation (decode bandwidth)", row.get("generation_s")),
            ("old_logps", "old log-prob pass (2N FLOPs/token + attention)", row.get("old_logps_s")),
            ("gec", "GEC continuations (decode bandwidth)", row.get("gec_s")),
            ("training", "scoring + training (6N FLOPs/token + attention)", row.get(f"rest{'_clock' * clock}_s")),
            ("step", f"step, by {row['timed_by']}", row.get("clock_s") if clock else row.get("step_s")),
        ):
            bound, ratio = row[f"floor_{phase}_s"], row[f"ratio_{phase}"]
            if not bound:
                continue
            shown = "-" if measured is None else f"{measured:.2f}"
            lines.append(
                f"| {row['recipe']} | {row['step']} | {name} | {shown} | {bound:.3g} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="run folder of benchmarks/gpu_checks.sh")
    parser.add_argument("--recipe", help="the recipe YAML (default: the one command.txt names)")
    parser.add_argument("--model-config", help="folder or config.json of the model's architecture")
    parser.add_argument("--shape", help="a shape of benchmarks/real_shapes.py (qwen15b, qwen7b, ...)")
    parser.add_argument("--card", choices=sorted(CARDS), default="h100")
    parser.add_argument("--mfu", type=float, default=0.5, help="fraction of the bf16 peak the FLOP floors assume")
    parser.add_argument("--prompt-length", type=int, default=200, help="mean prompt tokens")
    parser.add_argument("--summary", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = floors(args, args.run)
    print(table(rows))
    if args.summary:
        args.summary.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
