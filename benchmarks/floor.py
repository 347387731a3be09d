"""Each phase of a finished run's steps against its physical floor.

    python benchmarks/floor.py RUN_FOLDER [--recipe recipes/egpo_qwen15b.yaml] [--shape qwen15b | --model-config DIR]
        [--card h100|h200] [--vllm-alone-s 21.5] [--prompt-length 200] [--summary OUT/summary.json]

``RUN_FOLDER`` is a folder of ``benchmarks/gpu_recipes.sh`` (``command.txt``, ``run/metrics.jsonl``, ...) or any
folder with a ``metrics.jsonl`` of ``egpo-trl train``. The recipe (from ``command.txt`` or ``--recipe``) gives the
per-GPU batch (``gradient_accumulation_steps * per_device_train_batch_size`` completions), the processes and gradient
checkpointing; the architecture comes from ``--model-config`` (a folder with ``config.json``), ``--shape`` (one of
``benchmarks/real_shapes.py``) or the recipe's local model folder. Per logged step, per GPU:

* **generation** (``timing/generation_s``: vLLM's wake-up, weight sync and sampling) against vLLM alone on the same
  rollouts (``--vllm-alone-s``, measured on the same machine with ``benchmarks/vllm_alone.py``) and against the decode bandwidth bound: every decode
  step reads the weights once and each sequence's KV cache so far, ``L * 2N + B * kv * (L * P + L (L + 1) / 2)``
  bytes for ``B`` completions of ``L`` tokens after ``P`` prompt tokens, at the card's HBM bandwidth (3.35 TB/s for
  an H100 SXM, 4.8 for an H200); and, where the run says how many tokens its vLLM engine's KV cache holds (``K``,
  the line ``egpo-trl train`` prints at start-up, read from the run folder's ``train.log``, or ``--kv-cache-tokens``),
  against the same bound within that cache: no decode step holds more than ``K`` tokens of context, so there are at
  least ``max(L, B * (L * P + L (L + 1) / 2) / K)`` decode steps, each reading the weights once (a lower bound: a
  scheduler that admits whole rounds of sequences that all run to their limit reads them more often). Beside it,
  a reading of those rounds, not a bound: the cache holds ``S`` sequences at their length limit (the start-up
  line's count, else ``K // vllm_max_model_length``), so the ``B`` completions decode in ``ceil(B / S)`` rounds
  of ``L`` steps, each step reading the weights once, plus the same KV cache reads. Random weights run nearly every
  completion to its limit, as this reading assumes; a model whose completions end early shares the cache better;
* **old log-prob pass** (``timing/old_logps_s``) against its forward FLOPs, ``2 * N * B * (P + L)``;
* **scoring + training** (the step minus ``timing/generate_and_score_s``: rewards, the loss's forward, backward and
  the optimizer step) against ``6 * N * B * (P + L)`` FLOPs, times 4/3 with gradient checkpointing;
* **Guided Error Correction** (``timing/gec_s``, EDGE-GRPO: the continuations, and the scoring and rewriting around
  them) against the decode bandwidth bound of its continuations: ``gec/frac_reflect * B`` rows, each continued for
  the recipe's ``edge_gec_max_new_tokens`` (random weights never stop earlier; a continuation that stops early does
  less work than this bound) after ``P`` prompt tokens and the kept part of its completion.

With DAPO's dynamic sampling the generation floors count the work the step did: its ``R`` generation rounds
(``dynamic_sampling/rounds``), each decoding ``L`` steps that read the weights, and ``g`` times the batch's sequences
(``dynamic_sampling/generated_per_kept``) reading their KV cache; a step of one round at ``g = 1`` is a plain step.
A larger first round (``dynamic_sampling_oversample``) is one round of ``g`` times the sequences.

FLOPs at ``--mfu`` (50%) of the card's dense bf16 peak (989 TFLOP/s for H100 and H200 SXM). ``L`` is the step's mean
completion length. ``N`` counts the weights a token is multiplied by: an untied input embedding is a lookup and is
left out (of the bytes a decode step reads too). The matrix floors above leave attention's own FLOPs out; the ``*_attn`` floors add them: per
layer and row, ``2 * heads * head_dim * T^2`` for the causal score and value products of ``T = P + L`` tokens (x3 for
forward and backward, x4/3 with checkpointing). Prints one table and writes ``--summary`` rows: those of
``benchmarks/summarize_recipe_runs.py`` (which carry ``old_logps_s`` and ``mean_length``) plus the floors and ratios.
The "step" and "scoring + training" rows take TRL's ``step_time``; the rows marked "(clock)" (``ratio_*_clock*``)
take the step's time by the clock (``clock_s``), which also counts the GPU work a step left queued when
``training_step`` returned (``benchmarks/summarize_recipe_runs.py`` says why): compare steps by those.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from summarize_recipe_runs import summarize  # noqa: E402

#: Dense bf16 peak (TFLOP/s) and HBM bandwidth (TB/s) of each card.
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
    mlp = 3 * d * inner
    tied = bool(config.get("tie_word_embeddings"))
    params = layers * (attention + mlp + 2 * d) + d + vocab * d * (1 if tied else 2)
    return {
        "parameters": params,
        # The weights a token multiplies: an untied input embedding is a lookup (no product, and a decode step reads
        # only its own rows), so it counts in neither the FLOP floors nor the bytes a decode step reads.
        "matmul_parameters": params - (0 if tied else vocab * d),
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * BYTES_BF16,
        # causal attention's score (Q K^T) and value (P V) products, forward, per row of T tokens: x T^2
        "attention_flops_per_t2": 2 * layers * heads * head_dim,
    }


def training_flops(arch: dict, rows: float, row_tokens: float, checkpointing: bool, attention: bool = True) -> float:
    """FLOPs of training ``rows`` rows of ``row_tokens`` tokens each (forward and backward): ``6 N`` per token, plus
    causal attention's score and value products (x3) where ``attention``; x4/3 with gradient checkpointing."""
    recompute = 4 / 3 if checkpointing else 1
    matrix = 6 * arch["matmul_parameters"] * rows * row_tokens
    if not attention:
        return matrix * recompute
    return (matrix + 3 * rows * arch["attention_flops_per_t2"] * row_tokens**2) * recompute


def load_config(args, recipe: dict) -> dict:
    """The model's ``config.json`` as a dict, from ``--model-config``, ``--shape`` or the recipe's local model."""
    if args.model_config:
        path = Path(args.model_config)
        return json.loads((path / "config.json" if path.is_dir() else path).read_text())
    if args.shape:
        from real_shapes import SHAPES

        return dict(SHAPES[args.shape]["config"])
    model = str(recipe.get("model_name_or_path", ""))
    if model.startswith("builtin:"):
        model = str(Path(__file__).resolve().parents[1] / "egpo_trl" / "assets" / model.split(":", 1)[1])
    if model and (Path(model) / "config.json").is_file():
        return json.loads((Path(model) / "config.json").read_text())
    raise SystemExit(
        f"Cannot read the architecture of {model or 'the model'!r}: pass --model-config FOLDER (with config.json) or "
        "--shape (one of benchmarks/real_shapes.py's)."
    )


def option(argv: list[str], name: str, default):
    """The last ``--name VALUE`` of a command line, else ``default``."""
    for index, item in enumerate(argv):
        if item == f"--{name}" and index + 1 < len(argv):
            default = argv[index + 1]
        elif item.startswith(f"--{name}="):
            default = item.split("=", 1)[1]
    return default


def config_default(name: str):
    """``EGPOConfig``'s default for ``name`` (TRL's ``GRPOConfig`` default for its own fields)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from egpo_trl.config import EGPOConfig

    return EGPOConfig.__dataclass_fields__[name].default


def setting(argv: list[str], recipe: dict, name: str) -> int:
    """An integer training setting: the command line's, else the recipe's, else the config's default."""
    value = option(argv, name, recipe[name] if name in recipe else config_default(name))
    if value is None or str(value).lower() in ("none", "null", ""):
        raise SystemExit(f"{name} is {value!r} in the run's recipe or command; the floors need a number of tokens.")
    return int(value)


def logged_kv_cache(run: Path) -> tuple[int | None, int | None]:
    """The KV cache size and the sequences it holds at their length limit, as the run's start-up line gives them
    (``vLLM's KV cache holds N tokens: S sequences of ...``) in ``train.log``; ``None`` for what it does not say."""
    log = run / "train.log"
    if not log.is_file():
        return None, None
    text = log.read_text(errors="replace")
    found = re.search(r"vLLM's KV cache holds ([\d,]+) tokens(?:: (\d+) sequences)?", text)
    if not found:
        return None, None
    return int(found.group(1).replace(",", "")), int(found.group(2)) if found.group(2) else None


def floors(args, run: Path) -> list[dict]:
    """Rows of ``summarize_recipe_runs.summarize`` with each phase's floor and ratio added."""
    argv = shlex.split((run / "command.txt").read_text()) if (run / "command.txt").is_file() else []
    recipe_path = args.recipe or next((a for a in argv if a.endswith(".yaml")), None)
    if recipe_path is None:
        raise SystemExit(f"No recipe: {run}/command.txt names none; pass --recipe recipes/NAME.yaml.")
    recipe = yaml.safe_load(Path(recipe_path).read_text()) or {}
    if (run / "run" / "metrics.jsonl").is_file():
        rows = summarize(run)
    else:  # a plain egpo-trl train output folder: fake the layout summarize() reads
        rows = summarize_plain(run, recipe_path)
    arch = architecture(load_config(args, recipe))
    params, kv = arch["matmul_parameters"], arch["kv_bytes_per_token"]
    peak_tflops, bandwidth = CARDS[args.card]
    per_gpu = int(option(argv, "gradient_accumulation_steps", recipe.get("gradient_accumulation_steps", 1))) * int(
        option(argv, "per_device_train_batch_size", recipe.get("per_device_train_batch_size", 1))
    )
    if args.completions_per_gpu:
        per_gpu = args.completions_per_gpu
    elif option(argv, "per_device_train_batch_size", None) is None:
        # A run whose command left the per-device batch to its recipe: the recipe may have changed since.
        print(
            f"floor.py: per_device_train_batch_size {recipe.get('per_device_train_batch_size', 1)} read from "
            f"{recipe_path} as it is now ({per_gpu} completions per GPU); pass --completions-per-gpu for a run made "
            "with another value",
            file=sys.stderr,
        )
    checkpointing = str(option(argv, "gradient_checkpointing", recipe.get("gradient_checkpointing", False)))
    checkpointing = checkpointing.lower() in ("true", "1", "yes")
    flops_per_s = args.mfu * peak_tflops * 1e12
    edge = any(row.get("gec_s") is not None for row in rows)
    max_length = setting(argv, recipe, "max_completion_length") if edge else 0
    gec_new = setting(argv, recipe, "edge_gec_max_new_tokens") if edge else 0
    logged_tokens, logged_at_once = logged_kv_cache(run)
    kv_tokens = args.kv_cache_tokens or logged_tokens
    sequence_limit = option(argv, "vllm_max_model_length", recipe.get("vllm_max_model_length"))
    sequence_limit = int(sequence_limit) if str(sequence_limit).isdigit() else None
    # The sequences the cache holds at their length limit: the start-up line's count for its own cache, else the
    # cache over the engine's model length.
    at_once = logged_at_once if not args.kv_cache_tokens else None
    if at_once is None and kv_tokens and sequence_limit:
        at_once = kv_tokens // sequence_limit
    out = []
    for row in rows:
        if args.completions_per_gpu and row.get("gpus"):  # the run's own batch, not its recipe's as it is now
            row["completions"] = per_gpu * int(row["gpus"])
            if row.get("tokens_per_s") and row.get("mean_length") and row.get("step_s"):
                row["tokens_per_s"] = row["completions"] * row["mean_length"] / row["step_s"]
        length = row.get("mean_length")
        if not length:
            out.append(row)
            continue
        prompt = args.prompt_length
        tokens = per_gpu * (prompt + length)
        # Context tokens read over the L decode steps, all completions of the GPU together.
        context_steps = per_gpu * (length * prompt + length * (length + 1) / 2)
        # DAPO's dynamic sampling: each round decodes L steps; all generated sequences read their KV cache.
        rounds_run = max(1.0, float(row.get("rounds") or 1.0))  # a mean over the record's steps when logged so
        per_kept = float(row.get("generated_per_kept") or 1.0)
        context_steps *= per_kept
        decode_bytes = rounds_run * length * BYTES_BF16 * params + kv * context_steps
        attention = per_gpu * arch["attention_flops_per_t2"] * (prompt + length) ** 2
        floor = {
            "card": args.card,
            "parameters": arch["parameters"],
            "matmul_parameters": params,
            "completions_per_gpu": per_gpu,
            "prompt_length": prompt,
            "gradient_checkpointing": checkpointing,
            "vllm_alone_s": args.vllm_alone_s,
            "floor_generation_s": decode_bytes / (bandwidth * 1e12),
            "floor_old_logps_s": 2 * params * tokens / flops_per_s,
            "floor_training_s": training_flops(arch, per_gpu, prompt + length, checkpointing, False) / flops_per_s,
            "floor_old_logps_attn_s": (2 * params * tokens + attention) / flops_per_s,
            "floor_training_attn_s": training_flops(arch, per_gpu, prompt + length, checkpointing) / flops_per_s,
            "floor_gec_s": 0.0,
            "kv_cache_tokens": kv_tokens,
            "floor_generation_kv_s": None,
            "generation_rounds": None,
            "reading_generation_rounds_s": None,
            "reading_step_rounds_attn_s": None,
            "ratio_step_rounds_attn": None,
        }
        if kv_tokens:  # no decode step holds more context than the cache: at least context_steps / K steps
            steps = max(rounds_run * length, context_steps / kv_tokens)
            floor["floor_generation_kv_s"] = (steps * BYTES_BF16 * params + kv * context_steps) / (bandwidth * 1e12)
            if at_once is not None:  # the reading: rounds of the sequences the cache holds at their length limit
                generated = round(per_gpu * per_kept)
                rounds = max(rounds_run, -(-generated // max(1, at_once)))  # a mean of rounds stays one
                rounds = int(rounds) if float(rounds).is_integer() else rounds
                floor["generation_rounds"] = rounds
                floor["reading_generation_rounds_s"] = (rounds * length * BYTES_BF16 * params + kv * context_steps) / (
                    bandwidth * 1e12
                )
        if not row.get("old_logps_s"):
            floor["floor_old_logps_s"] = floor["floor_old_logps_attn_s"] = 0.0  # no pass this step
        if row.get("gec_s") is not None and row.get("gec_frac_reflect"):
            # Each continued row keeps at most max_length - room tokens of its completion (room: the new tokens'
            # share, at most half the length) and is assumed to run to its limit, as on random weights: a worst case
            # for the work, so a continuation that stops early can take less than this bound.
            rows_continued = row["gec_frac_reflect"] * per_gpu
            new = min(gec_new, max_length // 2)
            start = prompt + min(length, max_length - new)
            gec_bytes = new * BYTES_BF16 * params + rows_continued * kv * (new * start + new * (new + 1) / 2)
            floor["floor_gec_s"] = gec_bytes / (bandwidth * 1e12)
        generation_floor = max(floor["floor_generation_s"], args.vllm_alone_s or 0.0)
        floor["floor_step_s"] = (
            generation_floor + floor["floor_old_logps_s"] + floor["floor_gec_s"] + floor["floor_training_s"]
        )
        for phase, measured in (
            ("generation", row.get("generation_s")),
            ("generation_kv", row.get("generation_s")),
            ("generation_rounds", row.get("generation_s")),
            ("old_logps", row.get("old_logps_s")),
            ("old_logps_attn", row.get("old_logps_s")),
            ("gec", row.get("gec_s")),
            ("training", row.get("rest_s")),
            ("training_attn", row.get("rest_s")),
        ):
            bound = floor.get(f"floor_{phase}_s", floor.get(f"reading_{phase}_s"))
            floor[f"ratio_{phase}"] = measured / bound if measured is not None and bound else None
        if args.vllm_alone_s and row.get("generation_s") is not None:
            floor["ratio_generation_vllm_alone"] = row["generation_s"] / args.vllm_alone_s
        floor["ratio_step"] = row["step_s"] / floor["floor_step_s"]
        floor["floor_step_attn_s"] = (
            generation_floor + floor["floor_old_logps_attn_s"] + floor["floor_gec_s"] + floor["floor_training_attn_s"]
        )
        floor["ratio_step_attn"] = row["step_s"] / floor["floor_step_attn_s"]
        if floor["reading_generation_rounds_s"]:  # the step with generation at its rounds' reading instead
            floor["reading_step_rounds_attn_s"] = (
                max(floor["reading_generation_rounds_s"], args.vllm_alone_s or 0.0)
                + floor["floor_old_logps_attn_s"]
                + floor["floor_gec_s"]
                + floor["floor_training_attn_s"]
            )
            floor["ratio_step_rounds_attn"] = row["step_s"] / floor["reading_step_rounds_attn_s"]
        # The same by the clock (summarize_recipe_runs.py: TRL's step_time leaves out what the GPU still had to do
        # when training_step returned), where the run logged time_s.
        clock, rest_clock = row.get("clock_s"), row.get("rest_clock_s")
        floor["ratio_step_clock"] = clock / floor["floor_step_s"] if clock else None
        floor["ratio_step_clock_attn"] = clock / floor["floor_step_attn_s"] if clock else None
        floor["ratio_training_clock_attn"] = rest_clock / floor["floor_training_attn_s"] if rest_clock else None
        reading = floor["reading_step_rounds_attn_s"]
        floor["ratio_step_clock_rounds_attn"] = clock / reading if clock and reading else None
        out.append({**row, **floor})
    return out


def summarize_plain(run: Path, recipe_path: str) -> list[dict]:
    """``summarize`` of a plain ``egpo-trl train`` output folder (its ``metrics.jsonl`` at the top)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / Path(recipe_path).stem
        (folder / "run").mkdir(parents=True)
        (folder / "run" / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
        command = run / "command.txt"  # the run's own command (processes, accumulation) where the folder keeps it
        text = command.read_text() if command.is_file() else f"egpo-trl train {shlex.quote(recipe_path)}\n"
        (folder / "command.txt").write_text(text)
        for name in ("exit_status", "gpu_memory.csv", "ballast.txt"):
            if (run / name).is_file():
                (folder / name).write_bytes((run / name).read_bytes())
        return summarize(folder)


def table(rows: list[dict]) -> str:
    """A Markdown table: per step and phase, measured seconds, floor seconds and their ratio."""

    def f(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)

    lines = [
        "| recipe | step | phase | measured s | floor s | x floor | floor |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        if "floor_step_s" not in row:
            continue
        phases = [
            ("generation", row["generation_s"], row["floor_generation_s"], "decode bandwidth"),
            ("old log-prob pass", row["old_logps_s"], row["floor_old_logps_s"], "2N FLOPs/token"),
            ("old log-prob pass", row["old_logps_s"], row["floor_old_logps_attn_s"], "2N FLOPs/token + attention"),
            ("scoring + training", row["rest_s"], row["floor_training_s"], "6N FLOPs/token (x4/3 ckpt)"),
            ("scoring + training", row["rest_s"], row["floor_training_attn_s"], "6N FLOPs/token + attention"),
            ("step", row["step_s"], row["floor_step_s"], "sum"),
            ("step", row["step_s"], row["floor_step_attn_s"], "sum, with attention"),
        ]
        if row.get("floor_gec_s"):
            phases.insert(
                -2, ("GEC", row["gec_s"], row["floor_gec_s"], "continuations' decode bandwidth, each to its limit")
            )
        if row.get("floor_generation_kv_s"):
            phases.insert(
                1,
                (
                    "generation",
                    row["generation_s"],
                    row["floor_generation_kv_s"],
                    f"decode bandwidth, {row['kv_cache_tokens']:,}-token KV cache",
                ),
            )
        if row.get("reading_generation_rounds_s"):
            rounds = row["generation_rounds"]
            phases.insert(
                2,
                (
                    "generation",
                    row["generation_s"],
                    row["reading_generation_rounds_s"],
                    f"decode bandwidth in {rounds:g} round{'s' * (rounds > 1)} of the sequences that cache holds "
                    "(a reading, not a bound)",
                ),
            )
        if row.get("vllm_alone_s"):
            phases.insert(1, ("generation", row["generation_s"], row["vllm_alone_s"], "vLLM alone"))
        if row.get("reading_step_rounds_attn_s"):
            phases.append(
                (
                    "step",
                    row["step_s"],
                    row["reading_step_rounds_attn_s"],
                    "sum, with attention; generation at its rounds reading"
                    + (" or vLLM alone, the larger" if row.get("vllm_alone_s") else "")
                    + " (a reading, not a bound)",
                )
            )
        if row.get("clock_s"):  # the step and its training by the clock: what the step took (see summarize)
            phases.append(
                ("scoring + training (clock)", row.get("rest_clock_s"), row["floor_training_attn_s"],
                 "6N FLOPs/token + attention")
            )  # fmt: skip
            phases.append(("step (clock)", row["clock_s"], row["floor_step_attn_s"], "sum, with attention"))
            if row.get("reading_step_rounds_attn_s"):
                phases.append(
                    ("step (clock)", row["clock_s"], row["reading_step_rounds_attn_s"],
                     "sum, with attention; generation at its rounds reading"
                     + (" or vLLM alone, the larger" if row.get("vllm_alone_s") else "")
                     + " (a reading, not a bound)")
                )  # fmt: skip
        for name, measured, bound, what in phases:
            ratio = measured / bound if measured is not None and bound else None
            lines.append(
                f"| {row['recipe']} | {row['step']} | {name} | {f(measured)} | {f(bound, '{:.3g}')} | "
                f"{f(ratio)} | {what} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, print the table and write the summary rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="run folder (gpu_recipes.sh layout, or egpo-trl train's output)")
    parser.add_argument("--recipe", help="the recipe YAML (default: the one command.txt names)")
    parser.add_argument("--model-config", help="folder or config.json of the model's architecture")
    parser.add_argument("--shape", help="a shape of benchmarks/real_shapes.py (qwen15b, qwen7b, ...)")
    parser.add_argument("--card", choices=sorted(CARDS), default="h100")
    parser.add_argument("--mfu", type=float, default=0.5, help="fraction of the bf16 peak the FLOP floors assume")
    parser.add_argument("--prompt-length", type=int, default=200, help="mean prompt tokens")
    parser.add_argument("--vllm-alone-s", type=float, default=None, help="vLLM alone on the same rollouts, seconds")
    parser.add_argument(
        "--completions-per-gpu", type=int, help="completions per GPU per step (default: from the recipe and command)"
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="tokens the vLLM engine's KV cache holds (default: from the run's train.log start-up line, if any)",
    )
    parser.add_argument("--summary", type=Path, help="write the rows as JSON here (summary.json format)")
    args = parser.parse_args(argv)
    rows = floors(args, args.run)
    print(table(rows))
    if args.summary:
        args.summary.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
