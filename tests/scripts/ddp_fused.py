"""Train EGPO for two optimizer steps in every process of a distributed launch and save the final weights and
logged metrics (rank 0). Used by tests/test_fused.py: ``torchrun --nproc_per_node 2 tests/scripts/ddp_fused.py MODEL
OUT ENTROPY_LOGPS [GRADIENT_CHECKPOINTING [ROWS ACCUMULATION [SETTINGS_JSON]]]`` with 2 rows per device and 4
accumulation steps by default (one generation batch of two groups of 4 per process: blocks of 2 micro-batches under
egpo_entropy_logps='loss_forward'; 1 row and 8 steps make blocks of 4; SETTINGS_JSON, more EGPOConfig settings), and
by benchmarks/loss_forward_check.py under ``accelerate launch`` with DeepSpeed (float32 throughout). Also writes how
many backward calls process 0 made (``backwards.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from conftest import TRAINER_TEST_SETTINGS, make_prompt_dataset, parity_reward  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402


def main(
    model_dir: str,
    out_dir: str,
    logps: str,
    checkpointing: bool,
    per_device: int = 2,
    accumulation: int = 4,
    extra: dict | None = None,
):
    settings = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "max_steps": 2,
        "egpo_entropy_logps": logps,
        "bf16": False,
        "gradient_checkpointing": checkpointing,
        "model_init_kwargs": {"attn_implementation": "eager"},
        "use_cpu": not torch.cuda.is_available(),
    }
    args = EGPOConfig(output_dir=out_dir, **{**TRAINER_TEST_SETTINGS, **settings, **(extra or {})})
    trainer = EGPOTrainer(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    backwards = []  # the backward calls of this process: one per micro-batch, or one per block of them under DDP
    original = trainer.accelerator.backward
    trainer.accelerator.backward = lambda loss, **kwargs: backwards.append(1) or original(loss, **kwargs)
    trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # every process: ZeRO-3 gathers the shards
    if trainer.accelerator.is_main_process:
        torch.save({k: v.detach().float().cpu() for k, v in state.items()}, f"{out_dir}/weights.pt")
        rows = [row for row in trainer.state.log_history if "loss" in row]
        Path(out_dir, "log.json").write_text(json.dumps(rows))
        Path(out_dir, "backwards.json").write_text(json.dumps(len(backwards)))
    if torch.distributed.is_initialized():  # every process leaves the group together before the interpreter exits
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    shape = [int(value) for value in sys.argv[5:7]]  # rows per device and accumulation steps, (2, 4) by default
    extra = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
    main(sys.argv[1], sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "1", *shape, extra=extra)
