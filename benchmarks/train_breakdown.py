"""Where a recipe's scoring + training time goes, without generation: per micro-batch forward and backward, the
optimizer step, and (``--bench-profile``) how much of a micro-batch the GPU spends computing, communicating, or idle.

The recipe runs through the real trainer (``EGPOTrainer`` built as ``egpo-trl train`` builds it, the same loss,
DeepSpeed or not as launched), but its rollouts come from TRL's ``rollout_func`` hook instead of vLLM: random token
ids, prompts of 3/4 to all of ``--bench-prompt-length`` tokens and completions of ``max_completion_length`` tokens
without an end (``--bench-lengths full``, as random weights generate), of a quarter to all of it
(``--bench-lengths spread``), or drawn from a log-normal distribution cut at the maximum (``--bench-lengths lognormal``,
``--bench-median`` and ``--bench-p99``, by default a median of 700 tokens and 99% below 2,500, as
``benchmarks/padding.py`` counts them; each completion's length drawn on its own). So the
per-GPU batch, the micro-batches and every sharding choice are the recipe's, and the only thing missing is vLLM::

    python benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen7b --device cuda
    # ZeRO-3 over 4 GPUs (--accelerate_config's zero3.yaml)
    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 4 benchmarks/train_breakdown.py \\
        recipes/grpo_qwen7b.yaml --model_name_or_path /tmp/shapes/qwen7b --gradient_accumulation_steps 64 \\
        --bench-json /tmp/zero3.json
    # the same per-GPU batch under ZeRO-2, which gathers no parameters
    accelerate launch --config_file recipes/accelerate/zero2.yaml --num_processes 4 benchmarks/train_breakdown.py \\
        recipes/grpo_qwen7b.yaml --model_name_or_path /tmp/shapes/qwen7b --gradient_accumulation_steps 64 \\
        --bench-json /tmp/zero2.json
    python benchmarks/train_breakdown.py recipes/demo_tiny_cpu.yaml --bench-tiny      # CPU smoke run

Options of this script start with ``--bench-``; everything else is a recipe field as for ``egpo-trl train`` (the run
is forced to ``use_vllm false``, no saving, no reporting, ``--max_steps`` 1 unless given). The reward is
``benchmarks/timing_rewards.py``'s coin flip unless ``--reward_funcs`` is given, so groups are mixed.

Each micro-batch is timed with the GPU synchronised before and after its forward (``compute_loss``) and its whole
``training_step``; the backward is the difference. The first micro-batch of a step also scores the generation batch
(rewards, advantages, EGPO's pass) and is reported apart; under DeepSpeed the last one also runs the optimizer step.
The medians are those of the others (so ``gradient_accumulation_steps`` must be at least 3, one generation batch per
optimizer step and ``num_iterations`` 1, as in the recipes), the profiled one left out. Without DeepSpeed the model
trains in the dtype it loads in (TRL's default float32, under bf16 autocast); ``--dtype bfloat16`` runs the forward
and backward in bf16 as DeepSpeed does (its optimizer then keeps bf16 moments and no fp32 master weights).
Floors are those of ``benchmarks/floor.py``: ``6 N`` FLOPs per token (x 4/3 with gradient checkpointing) plus causal
attention, at ``--bench-mfu`` (50%) of the card's dense bf16 peak.

Under ``--egpo_entropy_logps loss_forward`` a block of micro-batches (whole groups) trains in its last micro-batch's
``training_step``: every forward of the block, then each micro-batch's loss from its kept forward with EGPO's weights,
each loss but the last backpropagated at once, and the last one by the trainer. The script then reports the median
block that does not run the optimizer (a step's last; with blocks of one micro-batch also a step's first, which scores
the batch), split into its forwards, its losses, its backwards before the last (none under DDP, which runs one
backward of the block's sum) and its last backward. Its micro-batch, forward and backward rows are the block's time,
its forwards and losses, and its backwards, over its micro-batches: what they mean under ``policy``, to compare.
``--bench-profile K`` then profiles the block that micro-batch K ends.

Each process's caching-allocator counters (peak reserved memory, segments allocated and freed, allocations retried
after emptying the cache) are printed too: a working set near the card's memory shows there before it runs out.

``--bench-steps-only`` times whole steps only, with nothing synchronised between micro-batches, as a real run goes
(the synchronisation itself can cost a launch that overlaps work across micro-batches, e.g. ZeRO-3's prefetch).

``--bench-profile K`` runs the K-th micro-batch of the first step (neither its first nor its last) under
``torch.profiler`` on every process and prints, for the main process, that micro-batch's wall time split by what the
GPU was doing: compute kernels running (any kernel that is not a collective), only collectives running (NCCL kernels,
including those waiting for other processes to arrive), or no kernel at all (the host, launches, and the profiler's
own work: a profiled micro-batch runs longer than the others), with the kernel time of each kind. The split shows
where a micro-batch waits; the unprofiled medians say how long micro-batches take. ``--bench-profile-ops FILE``
also writes that micro-batch's host and GPU time per operator (``aten::mm``, the attention kernels, ``AccumulateGrad``
and its hooks...), to see what keeps the host busy while the GPU waits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from floor import CARDS, architecture, training_flops  # noqa: E402
from padding import draw_lengths  # noqa: E402


class SyntheticRollout:
    """TRL's ``rollout_func``: random prompt and completion token ids in place of generation.

    A prompt's ids depend only on its text (the repeats of one prompt share them, as TRL's own tokenisation gives);
    each completion draws its own. No id is an end-of-sequence or padding id, so every completion runs to its length.
    """

    def __init__(
        self,
        vocab_size: int,
        excluded: set[int],
        prompt_length: int,
        completion_length: int,
        lengths: str,
        median: float = 700,
        p99: float = 2500,
    ):
        self.vocab_size = vocab_size
        self.excluded = sorted(i for i in excluded if i is not None and 0 <= i < vocab_size)
        self.prompt_length = prompt_length
        self.completion_length = completion_length
        self.lengths = lengths
        self.median = median
        self.p99 = p99
        self.calls = 0
        self.row_tokens: list[int] = []  # prompt + completion tokens of every row this process drew

    def _ids(self, generator: torch.Generator, count: int) -> list[int]:
        ids = torch.randint(0, self.vocab_size, (count,), generator=generator)
        for token in self.excluded:  # shift special ids to their neighbour
            ids[ids == token] = (token + 1) % self.vocab_size
        return ids.tolist()

    def __call__(self, prompts: list, trainer) -> dict:
        self.calls += 1
        rank = int(os.environ.get("RANK", "0"))
        prompt_ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            seed = int.from_bytes(hashlib.sha256(repr(prompt).encode()).digest()[:6], "little")
            generator = torch.Generator().manual_seed(seed)
            length = int(
                torch.randint(max(1, self.prompt_length * 3 // 4), self.prompt_length + 1, (1,), generator=generator)
            )
            prompt_ids.append(self._ids(generator, length))
            generator = torch.Generator().manual_seed(seed ^ (self.calls << 32) ^ (rank << 24) ^ index)
            length = self.completion_length
            if self.lengths == "spread":
                length = int(torch.randint(max(1, length // 4), length + 1, (1,), generator=generator))
            elif self.lengths == "lognormal":
                length = int(draw_lengths("lognormal", 1, length, self.median, self.p99, generator)[0])
            completion_ids.append(self._ids(generator, length))
            self.row_tokens.append(len(prompt_ids[-1]) + length)
        logprobs = [[0.0] * len(ids) for ids in completion_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timings:
    """Per micro-batch forward and whole ``training_step`` times, and each step's wall time. Under
    ``egpo_entropy_logps="loss_forward"`` also each model forward of the loss (``forwards``) and each backward the
    block runs before its last micro-batch's (``early_backwards``), each with the index of the micro-batch whose
    ``training_step`` ran it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.forward: list[float] = []
        self.micro: list[float] = []
        self.steps: list[float] = []
        self.after_micro: list[float] = []  # last training_step's end to the step's end (optimizer, outside DeepSpeed)
        self.forwards: list[tuple[int, float]] = []
        self.early_backwards: list[tuple[int, float]] = []
        self.block_ends: list[list[int]] = []  # loss_forward's merged blocks: the micro-batches ending one, per batch
        self._step_start = None
        self._last_micro_end = None
        self.profile_at, self.profile = None, None

    def _timed(self, function, record):
        def timed(*args, **kwargs):
            _sync(self.device)
            start = time.perf_counter()
            out = function(*args, **kwargs)
            _sync(self.device)
            record(time.perf_counter() - start)
            return out

        return timed

    def record_blocks(self, trainer) -> None:
        """Under ``egpo_loss_forward_block_tokens``: keep the micro-batches ending a block, per generation batch
        (nothing timed, so with ``--bench-steps-only`` too)."""
        if not getattr(trainer, "_fused_block_tokens", None):
            return
        merge = trainer._fused_merge_blocks

        def merge_and_record(batch):
            order = merge(batch)
            self.block_ends.append(sorted(trainer._fused_block_ends))
            return order

        trainer._fused_merge_blocks = merge_and_record

    def instrument(self, trainer, profile_at: int | None) -> None:
        compute_loss, training_step = trainer.compute_loss, trainer.training_step
        self.profile_at = profile_at
        if getattr(trainer, "_fused", False):
            # loss_forward: the block's last training_step runs every forward of the block, then each loss and (but
            # the last) its backward; time those apart, on the micro-batch index that runs them
            trainer._egpo_trl_pass = self._timed(
                trainer._egpo_trl_pass, lambda s: self.forwards.append((len(self.micro), s))
            )
            trainer._fused_backward_now = self._timed(
                trainer._fused_backward_now, lambda s: self.early_backwards.append((len(self.micro), s))
            )

        timed_compute_loss = self._timed(compute_loss, self.forward.append)

        def timed_training_step(*args, **kwargs):
            _sync(self.device)
            start = time.perf_counter()
            if self.profile_at is not None and len(self.micro) + 1 == self.profile_at:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
                with profile(activities=activities) as prof:
                    out = training_step(*args, **kwargs)
                    _sync(self.device)
                self.profile = prof
            else:
                out = training_step(*args, **kwargs)
            _sync(self.device)
            self._last_micro_end = time.perf_counter()
            self.micro.append(self._last_micro_end - start)
            if len(self.forward) < len(self.micro):  # a micro-batch kept for its block's last one: no loss yet
                self.forward.append(0.0)
            return out

        trainer.compute_loss = timed_compute_loss
        trainer.training_step = timed_training_step

    def step_begin(self) -> None:
        _sync(self.device)
        self._step_start = time.perf_counter()

    def step_end(self) -> None:
        _sync(self.device)
        now = time.perf_counter()
        self.steps.append(now - self._step_start)
        if self._last_micro_end is not None:
            self.after_micro.append(now - self._last_micro_end)


def block_breakdown(timings: Timings, accumulation: int, block: int, profiled: int) -> dict:
    """loss_forward's blocks that do not run the optimizer (a step's last) nor score the batch (with blocks of one
    micro-batch, a step's first), the profiled one left out: the median block (its last micro-batch's
    ``training_step``), the medians of what it runs, and per micro-batch the forward and backward as the ``policy``
    rows mean them (a block's forwards and losses, and its backwards, over its micro-batches). Under DDP a block runs
    one backward of its losses' sum, its last: no early backwards."""
    ends = [i for i in range(len(timings.micro)) if (i % accumulation + 1) % block == 0]
    middle = [
        i for i in ends if i % accumulation != accumulation - 1 and (block > 1 or i % accumulation) and i != profiled
    ]
    if not middle:
        return {}
    median = statistics.median

    def per_block(pairs):
        return {i: [s for at, s in pairs if at == i] for i in middle}

    forwards, early = per_block(timings.forwards), per_block(timings.early_backwards)
    early_each = [s for i in middle for s in early[i]]
    return {
        "block_micro_batches": block,
        "blocks_timed": len(middle),
        "block_median_s": median(timings.micro[i] for i in middle),
        "block_forwards_median_s": median(sum(forwards[i]) for i in middle),
        "block_losses_median_s": median(
            timings.forward[i] - sum(forwards[i]) - sum(early[i]) for i in middle
        ),  # each micro-batch's loss from its kept forward, and EGPO's weights
        "block_early_backwards_median_s": median(sum(early[i]) for i in middle),
        "block_last_backward_median_s": median(timings.micro[i] - timings.forward[i] for i in middle),
        "model_forward_median_s": median(s for i in middle for s in forwards[i]),
        "early_backward_median_s": median(early_each) if early_each else None,
        "forward_per_micro_batch_median_s": median((timings.forward[i] - sum(early[i])) / block for i in middle),
        "backward_per_micro_batch_median_s": median(
            (sum(early[i]) + timings.micro[i] - timings.forward[i]) / block for i in middle
        ),
    }


def allocator_stats(device: torch.device) -> list[float]:
    """This process's caching-allocator counters: peak reserved GiB, device allocations and frees (cudaMalloc and
    cudaFree of its segments) and allocations retried after freeing the cache (the sign of memory pressure)."""
    if device.type != "cuda":
        return [0.0, 0.0, 0.0, 0.0]
    stats = torch.cuda.memory_stats(device)
    return [
        torch.cuda.max_memory_reserved(device) / 2**30,
        float(stats.get("num_device_alloc", 0)),
        float(stats.get("num_device_free", 0)),
        float(stats.get("num_alloc_retries", 0)),
    ]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_split(prof, wall_s: float) -> dict:
    """A profiled micro-batch's GPU time: compute kernels (union over streams), collectives with no compute beside
    them, idle; and each kind's summed kernel time (matrix products, attention, collectives, the rest)."""
    compute, comm = [], []
    sums = {"matmul": 0.0, "attention": 0.0, "collective": 0.0, "other": 0.0}
    for event in prof.events():
        if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
            continue
        name = event.name.lower()
        start, end = event.time_range.start / 1e6, event.time_range.end / 1e6
        if "nccl" in name:
            comm.append((start, end))
            sums["collective"] += end - start
            continue
        compute.append((start, end))
        # Attention first: flash-attention kernels are templated on CUTLASS types, so their names contain "cutlass".
        if any(key in name for key in ("flash", "fmha", "attention", "sdpa", "efficient_attention")):
            sums["attention"] += end - start
        elif any(key in name for key in ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")):
            sums["matmul"] += end - start
        else:
            sums["other"] += end - start
    compute, comm = _union(compute), _union(comm)
    busy = _length(compute)
    comm_only = _length(comm) - _intersection(compute, comm)
    return {
        "profiled_wall_s": wall_s,
        "compute_busy_s": busy,
        "collective_only_s": comm_only,
        "idle_s": max(0.0, wall_s - busy - comm_only),
        **{f"kernels_{k}_s": v for k, v in sums.items()},
    }


#: This script's switches (its other options take a value).
SWITCHES = ("--bench-tiny", "--bench-steps-only")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's options (``--bench-*``, with their values) apart from the recipe's arguments."""
    own, rest, i = [], [], 0
    while i < len(argv):
        if argv[i].startswith("--bench-"):
            own.append(argv[i])
            if argv[i] not in SWITCHES and "=" not in argv[i] and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
        else:
            rest.append(argv[i])
        i += 1
    return own, rest


def main(argv: list[str] | None = None) -> dict | None:
    own, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-prompt-length", type=int, default=200)
    parser.add_argument("--bench-lengths", choices=["full", "spread", "lognormal"], default="full")
    parser.add_argument("--bench-median", type=float, default=700, help="--bench-lengths lognormal: median tokens")
    parser.add_argument("--bench-p99", type=float, default=2500, help="--bench-lengths lognormal: 99th percentile")
    parser.add_argument("--bench-profile", type=int, default=None, metavar="K")
    parser.add_argument(
        "--bench-profile-ops",
        default=None,
        metavar="FILE",
        help="with --bench-profile: write the profiled micro-batch's host (CPU) and GPU time per operator, by "
        "total host time and by its own, to FILE",
    )
    parser.add_argument("--bench-card", choices=sorted(CARDS), default="h100")
    parser.add_argument("--bench-mfu", type=float, default=0.5)
    parser.add_argument("--bench-json", default=None)
    parser.add_argument("--bench-tiny", action="store_true", help="CPU smoke run: the tiny model, short completions")
    parser.add_argument(
        "--bench-steps-only",
        action="store_true",
        help="time whole steps only, with no synchronisation between micro-batches (as in a real run)",
    )
    args = parser.parse_args(own)
    if args.bench_profile_ops and args.bench_profile is None:
        parser.error("--bench-profile-ops needs --bench-profile K (the micro-batch to profile)")
    if args.bench_steps_only and args.bench_profile is not None:
        parser.error("--bench-profile times a micro-batch: it does not go with --bench-steps-only")

    from transformers import TrainerCallback

    from egpo_trl.launch import normalize_argv
    from egpo_trl.script.args import parse_args
    from egpo_trl.script.data import load_datasets
    from egpo_trl.script.run import build_trainer

    def given(name: str) -> bool:
        return any(a == name or a.startswith(name + "=") for a in rest)

    forced = ["--use_vllm", "false", "--save_strategy", "no", "--report_to", "none", "--eval_size", "0"]
    if not given("--reward_funcs"):
        forced += ["--reward_funcs", "benchmarks.timing_rewards:coin_flip_reward"]
    if not given("--max_steps"):
        forced += ["--max_steps", "1"]
    if not given("--output_dir"):
        forced += ["--output_dir", f"/tmp/train_breakdown-{os.getpid()}"]
    if args.bench_tiny:
        forced += ["--max_completion_length", "64", "--logging_steps", "1"]
    rest, _ = normalize_argv(rest + forced)
    script_args, training_args, model_args = parse_args(rest)
    accumulation = training_args.gradient_accumulation_steps
    if not args.bench_steps_only:
        problems = []
        if accumulation < 3:
            problems.append(
                f"gradient_accumulation_steps is {accumulation}: the medians need micro-batches that are neither a "
                "step's first (it scores the batch) nor its last (it may run the optimizer), so at least 3 (or time "
                "whole steps with --bench-steps-only)"
            )
        if (training_args.steps_per_generation or accumulation) != accumulation or training_args.num_iterations != 1:
            problems.append(
                "one generation batch per optimizer step is assumed (steps_per_generation equal to "
                "gradient_accumulation_steps, num_iterations 1, as in the recipes); use --bench-steps-only otherwise"
            )
        if getattr(training_args, "egpo_entropy_logps", None) == "loss_forward":
            from egpo_trl.fused import block_size

            block = block_size(training_args.per_device_train_batch_size, training_args.num_generations)
            if block > 1 and (accumulation % block or accumulation // block < 2):
                problems.append(
                    f"egpo_entropy_logps is loss_forward with blocks of {block} micro-batches (whole groups of "
                    f"{training_args.num_generations} rows in micro-batches of "
                    f"{training_args.per_device_train_batch_size}): the medians need a block that is not a step's "
                    f"last (it runs the optimizer), so gradient_accumulation_steps a multiple of {block} and at least "
                    f"{2 * block} (or time whole steps with --bench-steps-only)"
                )
            elif args.bench_profile is not None and args.bench_profile % block:
                problems.append(
                    f"--bench-profile {args.bench_profile}: under loss_forward a block's last micro-batch runs the "
                    f"block; profile one of {block}, {2 * block}, ..."
                )
        if args.bench_profile is not None and not 2 <= args.bench_profile <= accumulation - 1:
            problems.append(
                f"--bench-profile {args.bench_profile}: profile a micro-batch of the first step that is neither its "
                f"first nor its last, 2 to {accumulation - 1}"
            )
        if problems:
            raise SystemExit("train_breakdown.py: " + "; ".join(problems) + ".")
    train_dataset, _ = load_datasets(script_args, seed=training_args.seed)
    trainer = build_trainer(script_args, training_args, model_args, train_dataset)
    tokenizer = trainer.processing_class
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    config = trainer.model.config
    excluded = {tokenizer.pad_token_id, tokenizer.eos_token_id, *getattr(trainer, "eos_token_ids", [])}
    excluded |= set(getattr(tokenizer, "all_special_ids", []))
    prompt_length = min(args.bench_prompt_length, script_args.max_prompt_length or args.bench_prompt_length)
    trainer.rollout_func = SyntheticRollout(
        min(config.vocab_size, len(tokenizer)),
        excluded,
        prompt_length,
        training_args.max_completion_length,
        args.bench_lengths,
        args.bench_median,
        args.bench_p99,
    )
    device = trainer.accelerator.device
    timings = Timings(device)
    timings.record_blocks(trainer)
    if not args.bench_steps_only:
        timings.instrument(trainer, args.bench_profile)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timings.step_begin()

        def on_step_end(self, *a, **k):
            timings.step_end()

    trainer.add_callback(StepTimer())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    error = None
    try:
        trainer.train()
    except torch.OutOfMemoryError as oom:
        # One process only (others would wait for it): e.g. the optimizer's state at its first step on one GPU. The
        # micro-batches that ran are still reported.
        if trainer.accelerator.num_processes > 1:
            raise
        where = (
            f"during step {len(timings.steps) + 1}"
            if args.bench_steps_only
            else f"after {len(timings.micro)} micro-batches"
        )
        error = f"out of memory {where}: {str(oom).splitlines()[0]}"
        torch.cuda.empty_cache()

    rows = training_args.per_device_train_batch_size
    steps = len(timings.steps)
    micro = timings.micro
    # Per step (begun): the first micro-batch scores the batch, the last one may run the optimizer (DeepSpeed).
    begun = -(-len(micro) // accumulation)
    firsts = [micro[i * accumulation] for i in range(begun)]
    lasts = [micro[(i + 1) * accumulation - 1] for i in range(begun) if (i + 1) * accumulation <= len(micro)]
    lasts = lasts if accumulation > 1 else []
    profiled = (args.bench_profile or 0) - 1

    def in_middle(i: int) -> bool:  # neither a step's first nor its last micro-batch, nor the profiled one
        return 0 < i % accumulation < accumulation - 1 and i != profiled

    middle = [t for i, t in enumerate(micro) if in_middle(i)]
    forward_middle = [t for i, t in enumerate(timings.forward) if in_middle(i)]
    blocks = {}
    if getattr(trainer, "_fused_block_tokens", None) and not args.bench_steps_only:
        # blocks that merge groups vary from one generation batch to the next: no median block to report
        print("loss_forward's blocks merge groups here (egpo_loss_forward_block_tokens): no per-block breakdown")
        middle, forward_middle = [], []
    elif getattr(trainer, "_fused", False) and not args.bench_steps_only:
        blocks = block_breakdown(timings, accumulation, trainer._fused_block, profiled)
        # per micro-batch as under policy: a block's time, its forwards and losses, its backwards, over its micro-batches
        middle = [blocks["block_median_s"] / blocks["block_micro_batches"]] if blocks else []
        forward_middle = [blocks["forward_per_micro_batch_median_s"]] if blocks else []
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    peaks = trainer.accelerator.gather(torch.tensor([peak], device=device)).tolist()
    allocator = trainer.accelerator.gather(torch.tensor([allocator_stats(device)], device=device)).tolist()

    arch = architecture(config.to_dict())
    peak_tflops = CARDS[args.bench_card][0]
    flops_per_s = args.bench_mfu * peak_tflops * 1e12
    # The floor counts the tokens the rows hold (every process's, each row's attention at its own length), not the
    # padding a micro-batch cut to its longest row computes: time spent on padding shows as a higher ratio. The
    # micro-batch floor is that of an average row's micro-batch (sorted rows make some micro-batches longer, some
    # shorter); the step floor is exact.
    held = trainer.accelerator.gather(
        torch.tensor(trainer.rollout_func.row_tokens, dtype=torch.float64, device=device)
    ).cpu()
    if held.numel():
        row_flops = training_flops(arch, 1, held, training_args.gradient_checkpointing).sum().item() / held.numel()
        tokens_per_row = held.mean().item()
    else:  # nothing drawn (a run that stopped before its first generation)
        tokens_per_row = prompt_length * 7 / 8 + training_args.max_completion_length
        row_flops = training_flops(arch, 1, tokens_per_row, training_args.gradient_checkpointing)
    floor_micro = row_flops * rows / flops_per_s
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    sharding = f"ZeRO-{plugin.zero_stage}" if plugin is not None else ("FSDP" if trainer.is_fsdp_enabled else "none")
    same_blocks = None
    if getattr(trainer, "_fused_block_tokens", None):  # every process's block ends, 0/1 per micro-batch of each batch
        marks = torch.zeros(len(timings.block_ends), training_args.steps_per_generation, device=device)
        for batch, ends in enumerate(timings.block_ends):
            marks[batch, [end - 1 for end in ends]] = 1
        every = trainer.accelerator.gather(marks.unsqueeze(0))
        same_blocks = bool((every == every[:1]).all())
    median = statistics.median
    result = {
        "error": error,
        "recipe_argv": rest,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "card": args.bench_card,
        "processes": trainer.accelerator.num_processes,
        "sharding": sharding,
        "rows_per_micro_batch": rows,
        "micro_batches_per_step": accumulation,
        "completion_length": training_args.max_completion_length,
        "lengths": args.bench_lengths,
        "lengths_median_p99": [args.bench_median, args.bench_p99] if args.bench_lengths == "lognormal" else None,
        "held_tokens_per_row_mean": tokens_per_row,
        # whether the trainer sorted (it declines, with a warning, where sorting cannot change a micro-batch's rows)
        "length_sorted": getattr(trainer, "_egpo_sort_window", None) is not None,
        "length_sorting_asked": bool(getattr(training_args, "egpo_length_sorted_micro_batches", False)),
        "prompt_length": prompt_length,
        "gradient_checkpointing": bool(training_args.gradient_checkpointing),
        "steps": steps,
        "micro_batches_timed": len(micro),
        "step_s": timings.steps,
        "first_micro_batch_s": firsts,
        "last_micro_batch_s": lasts,
        "micro_batch_median_s": median(middle) if middle else None,
        "forward_median_s": median(forward_middle) if forward_middle else None,
        "backward_median_s": (
            (blocks["backward_per_micro_batch_median_s"] if blocks else median(middle) - median(forward_middle))
            if middle and forward_middle
            else None
        ),
        "after_micro_batches_s": timings.after_micro,
        "micro_batch_floor_s": floor_micro,
        "micro_batch_x_floor": (median(middle) / floor_micro) if middle else None,
        "step_floor_s": floor_micro * accumulation,
        "step_x_floor": [s / (floor_micro * accumulation) for s in timings.steps],
        "peak_allocated_gib_per_process": peaks,
        "allocator_per_process": [
            dict(zip(("peak_reserved_gib", "device_allocs", "device_frees", "alloc_retries"), row))
            for row in allocator
        ],
        "loss_forward": blocks or None,
        "loss_forward_block_ends": timings.block_ends or None,
        "loss_forward_blocks_same_on_every_process": same_blocks,
        "deepspeed_config": plugin.deepspeed_config if plugin is not None else None,
    }
    if timings.profile is not None:
        split = kernel_split(timings.profile, micro[args.bench_profile - 1])
        result["profile_micro_batch"] = args.bench_profile
        result.update(split)
        if args.bench_profile_ops and trainer.accelerator.is_main_process:
            averages = timings.profile.key_averages()
            Path(args.bench_profile_ops).parent.mkdir(parents=True, exist_ok=True)
            Path(args.bench_profile_ops).write_text(
                f"micro-batch {args.bench_profile}, time per operator, by total host time:\n"
                + averages.table(sort_by="cpu_time_total", row_limit=120, max_name_column_width=110)
                + "\nby its own host time:\n"
                + averages.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=110)
            )
    if trainer.accelerator.is_main_process:
        print_table(result)
        if args.bench_json:
            Path(args.bench_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.bench_json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def print_table(r: dict) -> None:
    def f(value):
        return "-" if value is None else f"{value:.3f}"

    print(
        f"\n{r['device']}: {r['processes']} process(es), {r['sharding']}, {r['rows_per_micro_batch']} rows x "
        f"{r['micro_batches_per_step']} micro-batches per step and GPU, completions {r['completion_length']} "
        f"({r['lengths']}), prompts <= {r['prompt_length']}, checkpointing {r['gradient_checkpointing']}, "
        f"rows sorted by length {r['length_sorted']}; rows hold {r['held_tokens_per_row_mean']:.0f} tokens on average"
    )
    print("| what | s | floor s | x floor |\n| --- | ---: | ---: | ---: |")
    if not r["micro_batches_timed"]:  # --bench-steps-only
        for i, step in enumerate(r["step_s"]):
            print(f"| step {i + 1} | {step:.2f} | {r['step_floor_s']:.2f} | {r['step_x_floor'][i]:.2f} |")
    print(
        f"| micro-batch (median) | {f(r['micro_batch_median_s'])} | {f(r['micro_batch_floor_s'])} | "
        f"{f(r['micro_batch_x_floor'])} |"
    )
    print(f"| forward (median) | {f(r['forward_median_s'])} | | |")
    print(f"| backward (median) | {f(r['backward_median_s'])} | | |")
    for i, first in enumerate(r["first_micro_batch_s"]):
        if i < len(r["step_s"]):
            print(f"| step {i + 1} | {r['step_s'][i]:.2f} | {r['step_floor_s']:.2f} | {r['step_x_floor'][i]:.2f} |")
        print(f"| step {i + 1}: first micro-batch (scores the batch) | {first:.3f} | | |")
        if i < len(r["last_micro_batch_s"]):
            last = "last block (its last micro-batch)" if r.get("loss_forward") else "last micro-batch"
            print(f"| step {i + 1}: {last} | {r['last_micro_batch_s'][i]:.3f} | | |")
        if i < len(r["after_micro_batches_s"]):
            print(f"| step {i + 1}: after the micro-batches | {r['after_micro_batches_s'][i]:.3f} | | |")
    if r.get("loss_forward"):
        lf = r["loss_forward"]
        print(
            f"| loss_forward: block of {lf['block_micro_batches']} micro-batches (median of {lf['blocks_timed']}) | "
            f"{lf['block_median_s']:.3f} | {r['micro_batch_floor_s'] * lf['block_micro_batches']:.3f} | "
            f"{lf['block_median_s'] / (r['micro_batch_floor_s'] * lf['block_micro_batches']):.2f} |"
        )
        for key, label in (
            ("block_forwards_median_s", "its forwards"),
            ("block_losses_median_s", "its losses (from the kept forwards) and EGPO's weights"),
            ("block_early_backwards_median_s", "its backwards before the last (none under DDP: one of the sum)"),
            ("block_last_backward_median_s", "its last backward"),
        ):
            print(f"| {label} | {lf[key]:.3f} | | |")
    if "compute_busy_s" in r:
        what = "block ending at micro-batch" if r.get("loss_forward") else "micro-batch"
        print(f"| profiled {what} {r['profile_micro_batch']} (wall) | {r['profiled_wall_s']:.3f} | | |")
        for key in (
            "compute_busy_s",
            "collective_only_s",
            "idle_s",
            "kernels_matmul_s",
            "kernels_attention_s",
            "kernels_collective_s",
            "kernels_other_s",
        ):
            print(f"| {key.removesuffix('_s').replace('_', ' ')} | {r[key]:.3f} | | |")
    if r["error"]:
        print(f"stopped: {r['error']}")
    print("peak allocated GiB per process: " + ", ".join(f"{p:.1f}" for p in r["peak_allocated_gib_per_process"]))
    print(
        "caching allocator per process (peak reserved GiB, segments allocated / freed, allocations retried): "
        + "; ".join(
            f"{a['peak_reserved_gib']:.1f}, {a['device_allocs']:.0f} / {a['device_frees']:.0f}, {a['alloc_retries']:.0f}"
            for a in r["allocator_per_process"]
        )
    )


if __name__ == "__main__":
    main()
