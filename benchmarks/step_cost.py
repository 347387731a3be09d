"""What EGPO costs per training step, against TRL's GRPOTrainer with the same model, data, seed and settings.

Usage (one GPU)::

    CUDA_VISIBLE_DEVICES=0 python benchmarks/step_cost.py                 # ~300M-parameter Qwen2, random weights
    python benchmarks/step_cost.py --hidden 64 --layers 2 --steps 3 --repeats 1 --completion-length 16   # CPU smoke

Two entropy paths are measured:

* ``reuse``: ``num_iterations = 2``; TRL computes the old policy's log-probs and EGPO reuses them.
* ``extra``: ``num_iterations = 1``; EGPO runs one extra no-grad forward pass per generation batch.

Every completion is forced to the full ``--completion-length`` (``min_new_tokens``) so that both trainers
do the same work. Step times are TRL's own ``step_time`` (generation included); the first ``--warmup`` steps
of each run are dropped. Runs alternate GRPO / EGPO so that drift affects both. Prints one table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "egpo_trl" / "assets" / "tiny-math-qwen2"


def build_model(path: Path, hidden: int, layers: int, seed: int, tokenizer_dir: str) -> int:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if tokenizer_dir == "char":  # the character-level tokenizer of egpo_trl.testing (no files needed)
        from egpo_trl.testing import build_tiny_model

        tokenizer_dir = build_tiny_model(str(path.parent / "char-tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64 or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def dataset(num_prompts: int):
    from datasets import Dataset

    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i} * {i + 7} - {3 * i}."}],
            "answer": str(i * (i + 7) - 3 * i),
        }
        for i in range(num_prompts)
    ]
    return Dataset.from_list(rows)


def accuracy_like_reward(completions, **kwargs):
    """Splits groups roughly in half (random weights never answer correctly), so EGPO weights are non-trivial."""
    return [1.0 if hash(str(c)) % 2 else -1.0 for c in completions]


class TimedEGPOTrainer(EGPOTrainer):
    """EGPOTrainer that times its extra no-grad pass (``_egpo_forward``) on its own, GPU work included."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_pass_seconds: list[float] = []

    def _egpo_forward(self, *args, **kwargs):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = super()._egpo_forward(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        self.extra_pass_seconds.append(time.perf_counter() - start)
        return result


def run_once(
    method: str, path: str, args, num_iterations: int, seed: int, out: str
) -> tuple[list[float], float, list[float]]:
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    common = dict(
        output_dir=out,
        per_device_train_batch_size=args.batch,
        num_generations=args.num_generations,
        max_completion_length=args.completion_length,
        generation_kwargs={"min_new_tokens": args.completion_length},
        num_iterations=num_iterations,
        max_steps=args.steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=seed,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=args.gradient_checkpointing,
        log_completions=False,
        disable_tqdm=True,
    )
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if method == "grpo" else (EGPOConfig, TimedEGPOTrainer)
    trainer = trainer_cls(path, accuracy_like_reward, config_cls(**common), train_dataset=dataset(256))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][args.warmup :]
    extra = [h.get("egpo/entropy_extra_pass") for h in trainer.state.log_history if "step_time" in h]
    # The extra pass runs once per generation batch, i.e. once per step here (steps_per_generation = 1).
    extra_seconds = list(getattr(trainer, "extra_pass_seconds", []))[args.warmup :]
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if method == "egpo":
        print(f"    egpo/entropy_extra_pass per step: {extra}", flush=True)
    return times, peak, extra_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", nargs="+", default=["reuse", "extra"], choices=["reuse", "extra"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--tokenizer",
        default=str(TOKENIZER_DIR),
        help="tokenizer directory (default: the shipped one), or 'char' for a character-level one",
    )
    parser.add_argument("--json", type=str, default=None, help="also write the raw numbers to this file")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="egpo-step-cost-"))
    n_params = build_model(work / "model", args.hidden, args.layers, seed=0, tokenizer_dir=args.tokenizer)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"model: Qwen2, {n_params / 1e6:.0f}M parameters (random weights); device: {device}", flush=True)

    raw = {}
    for path_name in args.paths:
        num_iterations = 2 if path_name == "reuse" else 1
        raw[path_name] = {"grpo": [], "egpo": [], "peak": {"grpo": [], "egpo": []}, "extra_pass": []}
        for repeat in range(args.repeats):
            order = ("grpo", "egpo") if repeat % 2 == 0 else ("egpo", "grpo")
            for method in order:
                start = time.perf_counter()
                times, peak, extra = run_once(method, str(work / "model"), args, num_iterations, 0, str(work / "out"))
                raw[path_name][method].append(statistics.mean(times))
                raw[path_name]["peak"][method].append(peak)
                raw[path_name]["extra_pass"].extend(extra)
                print(
                    f"  {path_name:5s} repeat {repeat} {method}: mean step {statistics.mean(times) * 1e3:.1f} ms "
                    f"over {len(times)} steps, peak {peak:.2f} GiB ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "params": n_params, "device": device, "raw": raw}))

    print(f"\nStep cost, EGPOTrainer vs GRPOTrainer: {n_params / 1e6:.0f}M-parameter Qwen2 on {device}")
    print(
        f"per-device batch {args.batch}, {args.num_generations} generations, {args.completion_length} completion tokens, "
        f"{args.steps - args.warmup} timed steps x {args.repeats} repeats\n"
    )
    print(
        "| entropy path | GRPO step (ms) | EGPO step (ms) | ratio EGPO/GRPO (median, min-max) | peak memory ratio "
        "| extra pass alone (ms, median) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for path_name, numbers in raw.items():
        ratios = [e / g for e, g in zip(numbers["egpo"], numbers["grpo"])]
        peaks = [e / g for e, g in zip(numbers["peak"]["egpo"], numbers["peak"]["grpo"]) if g == g and g > 0]
        peak = f"{statistics.median(peaks):.3f}" if peaks else "-"
        label = "reuse (num_iterations=2)" if path_name == "reuse" else "extra pass (num_iterations=1)"
        extra = f"{statistics.median(numbers['extra_pass']) * 1e3:.1f}" if numbers["extra_pass"] else "not run"
        print(
            f"| {label} | {statistics.median(numbers['grpo']) * 1e3:.1f} | {statistics.median(numbers['egpo']) * 1e3:.1f} "
            f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | {peak} | {extra} |"
        )


if __name__ == "__main__":
    main()
