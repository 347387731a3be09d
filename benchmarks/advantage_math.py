"""Speed and equality of ``egpo_advantages`` against a straightforward per-group Python loop.

Usage::

    python benchmarks/advantage_math.py                      # CPU, and CUDA when available
    python benchmarks/advantage_math.py --sizes 1024 16384 --devices cpu
    python benchmarks/advantage_math.py --devices cpu --threads 1 2   # CPU rows with 1 and with 2 intra-op threads

For each size (completions, in groups of 16) it draws random ±1 rewards and entropies (with a few NaN
entropies and some all-correct / all-incorrect groups), checks that the vectorised function and the loop
agree, and prints the median time of each. The loop is the reference for both speed and results: it
walks every group and every sample with plain Python floats, as a first implementation would.

On CPU the vectorised function's time is mostly per-operation overhead, which intra-op threads (``--threads``,
``torch.set_num_threads``) can raise as well as lower; the loop is plain Python and uses one thread whatever the
setting. The header gives the load average: time on a quiet machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egpo_trl import egpo_advantages  # noqa: E402

LAMBDA_MIN, LAMBDA_MAX, EPS = 0.8, 2.0, 1e-6


def loop_advantages(rewards: list[float], entropies: list[float], n: int) -> list[float]:
    """EGPO (paper defaults) written group by group, sample by sample."""
    out = []
    for start in range(0, len(rewards), n):
        r = rewards[start : start + n]
        h = entropies[start : start + n]
        correct = [x > 0 for x in r]
        valid = [math.isfinite(x) for x in h]
        vals = [x for x, ok in zip(h, valid) if ok]
        mean_h = sum(vals) / len(vals) if vals else 0.0
        mean_r = sum(r) / n
        std_r = math.sqrt(sum((x - mean_r) ** 2 for x in r) / (n - 1))
        for i in range(n):
            if all(correct):
                base = 0.0
            elif not any(correct):
                base = -1.0
            else:
                base = (r[i] - mean_r) / (std_r + 1e-4)
            if valid[i] and mean_h != 0:
                w = min(max(mean_h / (h[i] + EPS), LAMBDA_MIN), LAMBDA_MAX)
                w = max(1.0, w) if correct[i] else min(1.0, w)
            else:
                w = 1.0
            out.append(w * base)
    return out


def make_inputs(size: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p_correct = torch.rand(size // n, 1, generator=gen).expand(-1, n)  # per-prompt difficulty
    rewards = torch.where(torch.rand(size, generator=gen) < p_correct.reshape(-1), 1.0, -1.0)
    entropies = torch.rand(size, generator=gen) * 0.5 + 0.05
    entropies[torch.rand(size, generator=gen) < 0.01] = float("nan")  # empty / truncated completions
    return rewards, entropies


def time_it(fn, repeats: int, sync=lambda: None) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_cuda(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    parser.add_argument("--num-generations", type=int, default=16)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--loop-max", type=int, default=65536, help="largest size the Python loop is timed at")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="intra-op threads for the CPU rows (torch.set_num_threads); several values give one row each "
        "(default: torch's default)",
    )
    args = parser.parse_args()
    n = args.num_generations
    devices = [d for d in args.devices if d == "cpu" or torch.cuda.is_available()]
    default_threads = torch.get_num_threads()
    if args.threads is not None and any(t < 1 for t in args.threads):
        parser.error(f"--threads takes positive integers, got {args.threads}")
    cpu_threads = args.threads or [default_threads]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None

    rows = []
    for size in args.sizes:
        rewards, entropies = make_inputs(size, n)
        loop_ms = None
        if size <= args.loop_max:
            r_list, h_list = rewards.tolist(), entropies.tolist()
            expected = torch.tensor(loop_advantages(r_list, h_list, n))
            loop_ms = time_it(
                lambda r_list=r_list, h_list=h_list: loop_advantages(r_list, h_list, n),
                repeats=max(3, args.repeats // 10),
            )
        for device in devices:
            r, h = rewards.to(device), entropies.to(device)

            def run(r=r, h=h):
                return egpo_advantages(r, h, n, lambda_min=LAMBDA_MIN, lambda_max=LAMBDA_MAX, entropy_eps=EPS)

            for threads in cpu_threads if device == "cpu" else [default_threads]:
                torch.set_num_threads(threads)
                out = run().advantages.cpu()
                if loop_ms is not None:
                    error = (out.double() - expected.double()).abs().max().item()
                    assert error < 1e-5, f"vectorised and loop results differ by {error} at size {size} on {device}"
                else:
                    error = float("nan")
                ms = time_cuda(run, args.repeats) if device == "cuda" else time_it(run, args.repeats)
                rows.append((size, device, threads if device == "cpu" else "-", ms, loop_ms, error))
            torch.set_num_threads(default_threads)

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"\negpo_advantages vs per-group Python loop (groups of {n}); torch {torch.__version__}; GPU: {name}")
    threads = ", ".join(str(t) for t in cpu_threads)
    print(
        f"CPU: {os.cpu_count()} logical cores; intra-op threads for the CPU rows: {threads} (default {default_threads})"
    )
    if load is not None:
        print(f"load average at start (1, 5, 15 min): {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")
    print()
    print(
        "| completions | device | threads | vectorised (ms, median) | Python loop (ms, median) | speed-up | max abs diff |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for size, device, threads, ms, loop_ms, error in rows:
        loop = f"{loop_ms:.2f}" if loop_ms is not None else "-"
        speedup = f"{loop_ms / ms:.0f}x" if loop_ms is not None else "-"
        diff = f"{error:.1e}" if math.isfinite(error) else "-"
        print(f"| {size:,} | {device} | {threads} | {ms:.3f} | {loop} | {speedup} | {diff} |")


if __name__ == "__main__":
    main()
