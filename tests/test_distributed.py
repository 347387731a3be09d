"""Groups that span processes: a 2-process (gloo, CPU) run gives the advantages a 1-process run computes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from egpo_trl import egpo_advantages, sequence_entropy

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ddp_egpo.py"


def launch(model_dir: str, out_dir: Path, num_processes: int, per_device: int, estimator: str = "egpo") -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    # torchrun sets the process-group variables; accelerate picks them up and uses gloo on CPU.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes)]
    command += [
        "--master_port",
        str(29500 + os.getpid() % 1000),
        str(SCRIPT),
        model_dir,
        str(out_dir),
        str(per_device),
        estimator,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [torch.load(out_dir / f"records_rank{r}.pt") for r in range(num_processes)]


def test_two_process_advantages_match_one_process(tmp_path, tiny_model_dir):
    ranks = launch(tiny_model_dir, tmp_path / "ddp", num_processes=2, per_device=2)
    assert [r["world_size"] for r in ranks] == [2, 2]
    step0 = [r["records"][0] for r in ranks]
    # Each generation batch is one group of 4 split 2 + 2 across the processes.
    assert step0[0]["local_advantages"].numel() == 2 and step0[0]["global_advantages"].numel() == 4
    for records in zip(*(r["records"] for r in ranks)):
        # Every process holds the same gathered tensors ...
        torch.testing.assert_close(records[0]["entropies"], records[1]["entropies"], equal_nan=True)
        torch.testing.assert_close(records[0]["rewards_per_func"], records[1]["rewards_per_func"])
        # ... and keeps its own slice of the global advantages.
        local = torch.cat([rec["local_advantages"] for rec in records])
        torch.testing.assert_close(local, records[0]["global_advantages"])
        # One process, same data: the same advantages from the same rewards and entropies.
        single = egpo_advantages(records[0]["rewards_per_func"][:, 0], records[0]["entropies"], 4)
        torch.testing.assert_close(local, single.advantages)

    # The first step's entropies, recomputed in this single process with the initial weights, match the
    # gathered ones row for row (so rows and entropies were gathered in the same order).
    recomputed = recomputed_entropies(tiny_model_dir, step0)
    torch.testing.assert_close(recomputed, step0[0]["entropies"], atol=1e-4, rtol=1e-4)
    rewards = step0[0]["rewards_per_func"][:, 0]
    torch.testing.assert_close(
        egpo_advantages(rewards, recomputed, 4).advantages, step0[0]["global_advantages"], atol=1e-4, rtol=1e-4
    )


def recomputed_entropies(model_dir: str, records: list[dict]) -> torch.Tensor:
    """The records' entropy proxies recomputed in this process with the initial weights, rank by rank."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for rec in records:
        ids = torch.cat([rec["prompt_ids"], rec["completion_ids"]], dim=1)
        mask = torch.cat([rec["prompt_mask"], rec["completion_mask"]], dim=1)
        with torch.no_grad():
            logits = reference(input_ids=ids, attention_mask=mask).logits[:, rec["prompt_ids"].size(1) - 1 : -1]
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, rec["completion_ids"].unsqueeze(-1)).squeeze(-1)
        out.append(sequence_entropy(lp, rec["completion_mask"]))
    return torch.cat(out)


def test_two_process_grpo_entropy_metrics_from_the_loss_forward(tmp_path, tiny_model_dir):
    """GRPO's free entropy metrics under 2 processes: each process's loss forward fills its own rows, and the gathered
    proxy is the old policy's, in the global row order (a group of 4 split 2 + 2)."""
    ranks = launch(tiny_model_dir, tmp_path / "ddp_grpo", num_processes=2, per_device=2, estimator="grpo")
    step0 = [r["records"][0] for r in ranks]
    assert {rec["source"] for r in ranks for rec in r["records"]} == {"training_forward"}
    for records in zip(*(r["records"] for r in ranks)):
        torch.testing.assert_close(records[0]["entropies"], records[1]["entropies"])
        assert torch.isfinite(records[0]["entropies"]).all()
    torch.testing.assert_close(
        recomputed_entropies(tiny_model_dir, step0), step0[0]["entropies"], atol=1e-4, rtol=1e-4
    )
