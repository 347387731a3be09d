"""Check that the cards of a machine are alike before comparing runs made on them side by side.

A side-by-side comparison (``benchmarks/gpu_checks.sh pair``) puts each recipe on its own GPU and divides step times.
A card that runs slower than its neighbours (power or thermal capping, lower clocks) makes the recipe on it look
slower, mostly in its training phase: matrix products are compute-bound, and decoding much less so. This script
times, on each device, a bf16 matrix product (TFLOP/s) and a device-to-device copy (GB/s), for a few seconds each,
one device after the other, and flags any device below ``--slow`` of the best one on either figure.

    python benchmarks/card_check.py                      # every visible CUDA device
    python benchmarks/card_check.py --json cards.json    # also write the figures
    python benchmarks/card_check.py --device cpu --size 256 --seconds 0.2   # the script itself, on the CPU

Exit status 0 either way (the flag is a warning: the runs may still be worth making); the flagged devices are listed
on the last line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _timed(fn, seconds: float, synchronize) -> tuple[int, float]:
    """Run ``fn`` repeatedly for about ``seconds`` (after a warm-up call); return the calls and the elapsed time."""
    fn()
    synchronize()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0:
            synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return calls, elapsed


def measure(device: torch.device, size: int, seconds: float) -> dict:
    """Matrix-product TFLOP/s and copy GB/s of one device."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def synchronize():
        if cuda:
            torch.cuda.synchronize(device)

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    calls, elapsed = _timed(lambda: torch.mm(a, b), seconds, synchronize)
    tflops = 2 * size**3 * calls / elapsed / 1e12
    elements = (256 if cuda else 4) * 2**20  # 512 MiB of bf16 on a GPU, 16 MiB of float32 on the CPU
    source = torch.empty(elements, device=device, dtype=dtype)
    target = torch.empty_like(source)
    calls, elapsed = _timed(lambda: target.copy_(source), seconds, synchronize)
    gbps = 2 * source.numel() * source.element_size() * calls / elapsed / 1e9  # read + write
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {"device": str(device), "name": name, "matmul_tflops": tflops, "copy_gbps": gbps}


def flag_slow(rows: list[dict], slow: float) -> list[str]:
    """The devices whose matrix product or copy runs below ``slow`` times the best device's."""
    best_flops = max(row["matmul_tflops"] for row in rows)
    best_copy = max(row["copy_gbps"] for row in rows)
    flagged = []
    for row in rows:
        row["matmul_vs_best"] = row["matmul_tflops"] / best_flops
        row["copy_vs_best"] = row["copy_gbps"] / best_copy
        if row["matmul_vs_best"] < slow or row["copy_vs_best"] < slow:
            flagged.append(row["device"])
    return flagged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", type=int, default=8192, help="the square matrices' side")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement and device")
    parser.add_argument("--slow", type=float, default=0.85, help="flag a device below this share of the best")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("card_check: no CUDA device is visible (use --device cpu to try the script).")
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        devices = [torch.device("cpu")]
    rows = [measure(device, args.size, args.seconds) for device in devices]
    flagged = flag_slow(rows, args.slow)
    print(f"{'device':<8} {'name':<28} {'matmul TFLOP/s':>15} {'vs best':>8} {'copy GB/s':>10} {'vs best':>8}")
    for row in rows:
        print(
            f"{row['device']:<8} {row['name'][:28]:<28} {row['matmul_tflops']:>15.1f} {row['matmul_vs_best']:>8.2f}"
            f" {row['copy_gbps']:>10.1f} {row['copy_vs_best']:>8.2f}"
        )
    if flagged:
        print(
            f"SLOW: {', '.join(flagged)} below {args.slow:.2f} of the best card: keep runs on them out of comparisons"
        )
    else:
        print(f"cards alike: every device within {args.slow:.2f} of the best")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"slow_threshold": args.slow, "flagged": flagged, "devices": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
