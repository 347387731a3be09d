"""Hold GPU memory so that a larger card leaves a run only as much as a smaller one would: a memory check for an
80 GB H100 on a 141 GB H200.

On each visible GPU this process allocates all free memory but ``--leave-gib`` and holds it until it is stopped
(SIGTERM or SIGINT), so a run started beside it (``egpo-trl train``, vLLM included) finds that much free, as it would
on the smaller card. Run it in the background, wait for its ``ready`` line, start the run, stop it afterwards::

    python benchmarks/memory_ballast.py --leave-gib 79.1 > /tmp/ballast.log 2>&1 &
    until grep -q ready /tmp/ballast.log; do sleep 1; done
    egpo-trl train recipes/egpo_qwen7b.yaml ... --vllm_gpu_memory_utilization S   # S: 0.4 x the factor it prints
    kill %1

What this does not change: vLLM's ``gpu_memory_utilization`` is a share of the card's total memory, so pass the share
that gives the smaller card's size: the share the recipe sets times ``--leave-gib`` over the card's total as CUDA
reports it, a factor this script prints. The driver's readings (``nvidia-smi``, the ``gpu_memory.csv`` of
``benchmarks/gpu_checks.sh``) include the ballast, which this script prints per GPU. The ballast's CUDA context is
taken before the free memory is measured, so the run sees ``--leave-gib`` free: slightly less than a fresh smaller
card, where that context is not there. Speed is the larger card's: only memory is emulated.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys

GIB = 1024**3


def ballast_bytes(free_bytes: int, leave_bytes: int) -> int:
    """How much to hold so that ``leave_bytes`` stay free; an error when less than that is free already."""
    if not leave_bytes > 0:
        raise ValueError(f"--leave-gib must be positive, got {leave_bytes / GIB:g}")
    if free_bytes < leave_bytes:
        raise ValueError(
            f"only {free_bytes / GIB:.2f} GiB are free, less than the {leave_bytes / GIB:.2f} GiB to leave: "
            "nothing to hold (is another run on this GPU?)"
        )
    return free_bytes - leave_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leave-gib", type=float, required=True, help="memory to leave free on each GPU, GiB")
    args = parser.parse_args(argv)
    if not math.isfinite(args.leave_gib) or args.leave_gib <= 0:
        parser.error(f"--leave-gib must be a positive number of GiB, got {args.leave_gib}")

    import torch

    if not torch.cuda.is_available():
        print("memory_ballast.py needs CUDA GPUs: none is visible", file=sys.stderr)
        return 2
    held = []
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            free, total = torch.cuda.mem_get_info()
            try:
                size = ballast_bytes(free, int(args.leave_gib * GIB))
            except ValueError as error:
                print(f"cuda:{index}: {error}", file=sys.stderr)
                return 2
            held.append(torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}"))
            free_after, _ = torch.cuda.mem_get_info()
            print(
                f"cuda:{index} ({torch.cuda.get_device_name(index)}): total {total / GIB:.2f} GiB, holding "
                f"{size / GIB:.2f} GiB ({size} bytes), {free_after / GIB:.2f} GiB free; a smaller card's vLLM share is "
                f"{args.leave_gib * GIB / total:.4f} x that share here",
                flush=True,
            )
    wait_for_stop()
    del held
    print("released", flush=True)
    return 0


def wait_for_stop() -> int:
    """Print ``ready`` and wait for SIGTERM or SIGINT; the signal's number. The signals are blocked and waited for,
    so no handler runs in the middle of anything."""
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    print("ready", flush=True)
    return signal.sigwait(stop)


if __name__ == "__main__":
    sys.exit(main())
