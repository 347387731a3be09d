"""Time EGPO's no-grad log-prob pass against its FLOP floor, and against TRL's helper as EGPO used it before.

The pass (``EGPOTrainer._egpo_forward``) computes the old policy's per-token log-probs (and, for EDGE-GRPO, the
Shannon entropies) of one process's generation batch when TRL has not computed them. Two ways are timed on the same
batch, the same model and the same process:

* ``trl``: ``GRPOTrainer._get_per_token_logps_and_entropies`` with ``per_device_train_batch_size`` rows per forward,
  each padded to the batch's full width (what EGPO ran before it planned its own micro-batches);
* ``egpo``: ``EGPOTrainer._egpo_forward``, micro-batches of rows of similar completion length up to
  ``egpo_entropy_tokens_per_batch`` tokens (one row per ``--token-budgets`` value), each cut to its longest completion.

The floor is the forward's matrix FLOPs, ``2 * parameters * tokens`` (tokens actually present, padding excluded), at
``--mfu`` (50%) of the card's dense bf16 peak (``--peak-tflops``, 989 for an H100 SXM). Usage::

    # a real-shape model with random weights (benchmarks/real_shapes.py), one GPU's share of a paper recipe's step
    python benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen15b --device cuda
    python benchmarks/entropy_pass.py --model /tmp/shapes/qwen15b --completions 128 --completion-length 3072 \\
        --prompt-length 200 --token-budgets 16384 65536 131072 --json /tmp/entropy_pass.json
    python benchmarks/entropy_pass.py --tiny            # CPU smoke run on the tiny test model

``--attn eager`` (or another ``attn_implementation``) loads the model with that attention; ``--profile 25`` prints
the 25 costliest kernels of one pass (``torch.profiler``), to see where the time over the floor goes.

``--masked`` also times each budget with the rows left in TRL's layout (left-padded prompts, an attention mask), as
the pass ran before it shifted rows past their prompt padding, and prints the largest difference between the two.

``--lengths spread`` draws completion lengths uniformly between a quarter of ``--completion-length`` and all of it
(trained models stop at different lengths); the default ``full`` makes every completion full length, as random
weights do. Prints one table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402
from egpo_trl.old_logps import can_realign, no_grad_completion_logps  # noqa: E402

H100_BF16_TFLOPS = 989.0


def synthetic_batch(
    vocab_size: int, completions: int, prompt_length: int, completion_length: int, lengths: str, seed: int, device
) -> dict[str, torch.Tensor]:
    """A generation batch laid out as TRL's: left-padded prompts (lengths within 25% of ``prompt_length``), right-padded
    completions (all full, or spread over a quarter to all of ``completion_length``)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(
        max(1, prompt_length * 3 // 4), prompt_length + 1, (completions,), generator=generator
    )
    if lengths == "full":
        completion_lengths = torch.full((completions,), completion_length)
    else:
        low = max(1, completion_length // 4)
        completion_lengths = torch.randint(low, completion_length + 1, (completions,), generator=generator)
    prompt_width, completion_width = int(prompt_lengths.max()), int(completion_lengths.max())
    columns = torch.arange(prompt_width)
    prompt_mask = (columns.unsqueeze(0) >= prompt_width - prompt_lengths.unsqueeze(1)).long()
    completion_mask = (torch.arange(completion_width).unsqueeze(0) < completion_lengths.unsqueeze(1)).long()
    prompt_ids = torch.randint(0, vocab_size, (completions, prompt_width), generator=generator) * prompt_mask
    completion_ids = torch.randint(0, vocab_size, (completions, completion_width), generator=generator)
    completion_ids = completion_ids * completion_mask
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    return {key: value.to(device) for key, value in batch.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int) -> tuple[float, float | None, object]:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup``, its peak memory (GiB, CUDA) and result."""
    result = None
    for _ in range(warmup):
        result = fn()
    seconds = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(seconds), peak, result


def make_trainer(
    model: str, dtype: str, temperature: float, per_device_batch: int, out_dir: str, attn: str | None = None
) -> EGPOTrainer:
    """An EGPOTrainer around ``model`` (no training): the policy with TRL's fused LM head, as in a run."""
    from datasets import Dataset

    from egpo_trl.rewards import boxed_accuracy_reward

    args = EGPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=per_device_batch,
        num_generations=per_device_batch,
        temperature=temperature,
        bf16=dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        model_init_kwargs={"dtype": getattr(torch, dtype), **({"attn_implementation": attn} if attn else {})},
        report_to="none",
        max_steps=1,
    )
    dataset = Dataset.from_list([{"prompt": "1 + 1 =", "answer": "2"}] * per_device_batch)
    return EGPOTrainer(model, boxed_accuracy_reward, args, train_dataset=dataset)


def profile_table(trainer: EGPOTrainer, batch: dict, budget: int, entropy: bool, device, rows: int) -> str:
    """One pass under ``torch.profiler``: its ``rows`` costliest operators by device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    trainer.args.egpo_entropy_tokens_per_batch = budget
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer._egpo_forward(batch, compute_entropy=entropy)
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return f"profile of one pass ({budget} tokens per forward), by {key}:\n" + prof.key_averages().table(
        sort_by=key, row_limit=rows
    )


def run(argv: list[str] | None = None) -> list[dict]:
    """Parse the arguments, time both passes and print the table; returns its rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (e.g. a benchmarks/real_shapes.py shape)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny test model, a small batch")
    parser.add_argument("--completions", type=int, default=128, help="rows of one process's generation batch")
    parser.add_argument("--prompt-length", type=int, default=200)
    parser.add_argument("--completion-length", type=int, default=3072)
    parser.add_argument("--lengths", choices=("full", "spread"), default="full")
    parser.add_argument("--per-device-batch", type=int, default=4, help="rows per forward of TRL's helper")
    parser.add_argument("--token-budgets", type=int, nargs="+", default=[65536])
    parser.add_argument("--entropy", action="store_true", help="also compute Shannon entropies (EDGE-GRPO)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="dense bf16 peak of the card")
    parser.add_argument("--mfu", type=float, default=0.5, help="fraction of the peak the floor assumes")
    parser.add_argument("--skip-trl", action="store_true", help="time only the new pass")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--masked", action="store_true", help="also time the masked layout (no shifting past prompt padding)"
    )
    parser.add_argument("--attn", default=None, help="attn_implementation (e.g. sdpa, eager; default: the model's)")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one pass at the first token budget and print its N costliest kernels",
    )
    args = parser.parse_args(argv)
    if not args.tiny and not args.model:
        parser.error("give --model FOLDER (see benchmarks/real_shapes.py), or --tiny for a CPU smoke run")

    work = tempfile.mkdtemp(prefix="entropy-pass-")
    if args.tiny:
        from egpo_trl.testing import build_tiny_model

        args.model = build_tiny_model(str(Path(work) / "tiny"))
        if args.completions == 128:
            args.completions, args.prompt_length, args.completion_length = 8, 12, 24
            args.per_device_batch, args.token_budgets = 2, [64, 4096]
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    trainer = make_trainer(args.model, dtype, args.temperature, args.per_device_batch, work, args.attn)
    model = trainer.model
    device = next(model.parameters()).device
    params = sum(p.numel() for p in model.parameters())
    # The weights a token is multiplied by: an untied input embedding is a lookup, not a product.
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embedding.data_ptr()
    matmul_params = params - (0 if tied else embedding.numel())
    vocab_size = model.config.get_text_config().vocab_size
    batch = synthetic_batch(
        vocab_size, args.completions, args.prompt_length, args.completion_length, args.lengths, 0, device
    )
    tokens = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    floor = 2 * matmul_params * tokens / (args.mfu * args.peak_tflops * 1e12)

    def trl_pass():
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        model.eval()
        try:
            with torch.no_grad():
                logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    batch["completion_ids"].size(1),
                    batch_size=args.per_device_batch,
                    compute_entropy=args.entropy,
                )
        finally:
            model.train()
        return logps

    rows, reference = [], None
    if not args.skip_trl:
        seconds, peak, reference = timed(trl_pass, device, args.repeats, args.warmup)
        rows.append({"pass": f"trl (rows/forward {args.per_device_batch})", "seconds": seconds, "peak_gib": peak})
    for budget in args.token_budgets:
        trainer.args.egpo_entropy_tokens_per_batch = budget

        def egpo_pass():
            return trainer._egpo_forward(batch, compute_entropy=args.entropy)[0]

        seconds, peak, logps = timed(egpo_pass, device, args.repeats, args.warmup)
        row = {"pass": f"egpo (tokens/forward {budget})", "seconds": seconds, "peak_gib": peak}
        if reference is not None:
            row["max_abs_diff"] = float((logps - reference).abs().max())
        rows.append(row)
        if args.masked:

            def masked_pass(budget=budget):
                model.eval()
                try:
                    return no_grad_completion_logps(
                        model,
                        **batch,
                        compute_entropy=args.entropy,
                        tokens_per_batch=budget,
                        autocast=trainer.accelerator.autocast,
                        realign=False,
                    )[0]
                finally:
                    model.train()

            seconds, peak, masked = timed(masked_pass, device, args.repeats, args.warmup)
            rows.append(
                {
                    "pass": f"egpo masked (tokens/forward {budget})",
                    "seconds": seconds,
                    "peak_gib": peak,
                    "max_abs_diff": float((masked - logps).abs().max()),
                }
            )
    for row in rows:
        row.update(floor_s=floor, ratio_to_floor=row["seconds"] / floor)

    print(
        f"model {args.model} ({params / 1e9:.3f}B parameters, {dtype}) on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
        f"{args.completions} completions, {tokens} tokens present ({args.lengths} lengths), entropy {args.entropy}; "
        f"floor = 2 * {matmul_params / 1e9:.3f}B multiplied parameters * tokens at {args.mfu:.0%} of {args.peak_tflops:g} TFLOP/s = {floor:.3f} s; "
        f"rows shifted past prompt padding: {can_realign(model, batch['prompt_mask'], batch['completion_mask'])}"
    )
    print(f"{'pass':<40} {'seconds':>9} {'x floor':>8} {'peak GiB':>9} {'max |dlogp|':>12}")  # vs trl, or vs egpo
    for row in rows:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
        diff = f"{row['max_abs_diff']:.2e}" if "max_abs_diff" in row else "-"
        print(f"{row['pass']:<40} {row['seconds']:>9.3f} {row['ratio_to_floor']:>8.2f} {peak:>9} {diff:>12}")
    if args.profile:
        print(profile_table(trainer, batch, args.token_budgets[0], args.entropy, device, args.profile))
    if args.json:
        meta = {
            "model": args.model,
            "parameters": params,
            "matmul_parameters": matmul_params,
            "dtype": dtype,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "completions": args.completions,
            "prompt_length": args.prompt_length,
            "completion_length": args.completion_length,
            "lengths": args.lengths,
            "tokens": tokens,
            "entropy": args.entropy,
        }
        Path(args.json).write_text(json.dumps({"setup": meta, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    run()
