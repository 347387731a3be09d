"""How many tokens the loss's forwards compute for the tokens a generation batch holds: each micro-batch is cut to its
longest row (``egpo_shift_prompt_padding``), so rows of varied lengths in one micro-batch compute padding. Counts,
not timings: for a per-GPU generation batch of completions whose lengths follow a distribution, the tokens computed
(rows x the micro-batch's longest row, summed over micro-batches) over the tokens held, with TRL's shuffled
micro-batches and with ``egpo_length_sorted_micro_batches`` (each optimizer step's rows sorted by length, or under
``loss_forward`` each group's rows, the groups kept together, or with ``egpo_loss_forward_block_tokens`` each block
of merged groups, ``egpo_trl.fused.merged_blocks``, with the largest block's padded tokens: what a block holds), for
several micro-batch sizes::

    python benchmarks/padding.py                      # 128 rows per GPU, 16 per group, prompts of 150-200 tokens
    python benchmarks/padding.py --max-length 15360 --median 4000 --p99 12000

Lengths: ``full`` (every completion at the maximum, as random weights generate: the only padding comes from the
prompts' lengths),
``uniform`` (a quarter of the maximum to all of it, ``benchmarks/train_breakdown.py --bench-lengths spread``) and
``lognormal`` (``--median`` and ``--p99``, cut at the maximum; the defaults follow the paper's note that over 99% of
Qwen2.5-Math's responses stay below 2,500 tokens). Each row's length is drawn on its own: the completions of one
prompt are related in length, so a group's longest row is nearer its others than here, and the figures for whole
groups per micro-batch are upper bounds. Attention's share of the FLOPs grows with the square of a row's length and
is left out: the ratios are those of the matrix products.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


def draw_lengths(kind: str, rows: int, max_length: int, median: float, p99: float, generator) -> torch.Tensor:
    """``rows`` completion lengths of the distribution ``kind``, each at least 1 and at most ``max_length``."""
    if kind == "full":
        return torch.full((rows,), max_length)
    if kind == "uniform":
        low = max(1, max_length // 4)
        return torch.randint(low, max_length + 1, (rows,), generator=generator)
    if kind == "lognormal":
        sigma = math.log(p99 / median) / 2.3263  # the 99th percentile of a standard normal
        normal = torch.randn(rows, generator=generator, dtype=torch.float64)
        return (median * torch.exp(sigma * normal)).round().clamp(1, max_length).long()
    raise ValueError(f"unknown length distribution {kind!r}")


def computed_tokens(lengths: torch.Tensor, micro_batch: int) -> int:
    """Rows x the longest row, summed over consecutive micro-batches of ``micro_batch`` rows."""
    return sum(int(chunk.numel() * chunk.max()) for chunk in torch.split(lengths, micro_batch) if chunk.numel())


def sorted_within(lengths: torch.Tensor, window: int) -> torch.Tensor:
    """``lengths`` with each ``window`` consecutive rows sorted, longest first."""
    return torch.cat([chunk.sort(descending=True).values for chunk in torch.split(lengths, window)])


def padding_rows(
    kind: str,
    rows: int = 128,
    group: int = 16,
    micro_batches: tuple[int, ...] = (2, 4, 8, 16),
    max_length: int = 3072,
    prompt: tuple[int, int] = (150, 200),
    median: float = 700.0,
    p99: float = 2500.0,
    repeats: int = 200,
    seed: int = 0,
    block_tokens: tuple[int, ...] = (),
) -> list[dict]:
    """Per micro-batch size: tokens computed over tokens held, summed over ``repeats`` generation batches, with
    shuffled rows, sorted over the optimizer step (the whole batch) and, as under ``loss_forward``, with the groups
    kept together and each group's rows sorted."""
    from egpo_trl.fused import merged_blocks, padded_tokens

    generator = torch.Generator().manual_seed(seed)
    out = []
    for micro_batch in micro_batches:
        shuffled = step_sorted = group_sorted = held = 0
        merged = {tokens: 0 for tokens in block_tokens}
        largest = {tokens: 0 for tokens in block_tokens}  # the most padded tokens one block held
        for _ in range(repeats):
            completions = draw_lengths(kind, rows, max_length, median, p99, generator)
            prompts = torch.randint(prompt[0], prompt[1] + 1, (rows // group,), generator=generator)
            lengths = completions + prompts.repeat_interleave(group)  # a group shares its prompt
            held += int(lengths.sum())
            order = torch.randperm(rows, generator=generator)
            shuffled += computed_tokens(lengths[order], micro_batch)
            step_sorted += computed_tokens(sorted_within(lengths[order], rows), micro_batch)
            # loss_forward: each group's rows together (the groups in a random order), sorted inside the group
            group_order = torch.randperm(rows // group, generator=generator)
            grouped = lengths.view(-1, group)[group_order].reshape(-1)
            group_sorted += computed_tokens(sorted_within(grouped, group), micro_batch)
            unit = math.lcm(micro_batch, group)  # the fewest rows of whole groups in whole micro-batches
            for tokens in block_tokens:
                start = 0
                for size in merged_blocks(grouped, unit, micro_batch, tokens):
                    block = padded_tokens(grouped[start : start + size], micro_batch)
                    merged[tokens] += block
                    largest[tokens] = max(largest[tokens], block)
                    start += size
        row = {
            "lengths": kind,
            "micro_batch": micro_batch,
            "shuffled": shuffled / held,
            "sorted_step": step_sorted / held,
            "sorted_group": group_sorted / held,
        }
        for tokens in block_tokens:
            row[f"merged_{tokens}"] = merged[tokens] / held
            row[f"largest_block_{tokens}"] = largest[tokens]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="completions per GPU per optimizer step")
    parser.add_argument("--group", type=int, default=16, help="num_generations")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--median", type=float, default=700.0)
    parser.add_argument("--p99", type=float, default=2500.0)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--block-tokens",
        type=int,
        nargs="*",
        default=[131072, 262144],
        help="egpo_loss_forward_block_tokens budgets to count (loss_forward's blocks of merged groups)",
    )
    args = parser.parse_args(argv)
    if args.rows % args.group or any(args.rows % m for m in args.micro_batches):
        parser.error("--rows must be a multiple of --group and of every --micro-batches size")
    budgets = tuple(args.block_tokens)
    merged_headers = "".join(f" merged blocks of {t:,} tokens (largest block) |" for t in budgets)
    print("| lengths | rows per micro-batch | shuffled (TRL) | sorted per optimizer step (policy) | "
          "sorted per group (loss_forward) |" + merged_headers)  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(budgets))
    for kind in ("full", "uniform", "lognormal"):
        for row in padding_rows(
            kind, args.rows, args.group, tuple(args.micro_batches), args.max_length,
            median=args.median, p99=args.p99, repeats=args.repeats, block_tokens=budgets,
        ):  # fmt: skip
            merged = "".join(f" {row[f'merged_{t}']:.3f} ({row[f'largest_block_{t}']:,}) |" for t in budgets)
            print(
                f"| {kind} | {row['micro_batch']} | {row['shuffled']:.3f} | {row['sorted_step']:.3f} | "
                f"{row['sorted_group']:.3f} |" + merged
            )
    print("\nTokens computed by the loss's forwards over the tokens the batch holds (prompt + completion); 1.000 is no "
          "padding. Matrix-product FLOPs follow these ratios; attention's grow faster with a padded row's length.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
