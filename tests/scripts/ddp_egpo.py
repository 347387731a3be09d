"""Train EGPO for a few steps in every process of a distributed launch and save what each step computed.

Used by tests/test_distributed.py: ``accelerate launch --cpu --num_processes 2 tests/scripts/ddp_egpo.py MODEL OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import TRAINER_TEST_SETTINGS, make_prompt_dataset, parity_reward, save_rank_records  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402


class Recorder(EGPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        batch = self.egpo_last_batch
        self.records.append(
            {
                "rewards_per_func": batch["rewards_per_func"].cpu(),
                "entropies": batch["entropies"].cpu(),
                "global_advantages": batch["result"].advantages.cpu(),
                "local_advantages": output["advantages"].cpu(),
                "prompt_ids": output["prompt_ids"].cpu(),
                "prompt_mask": output["prompt_mask"].cpu(),
                "completion_ids": output["completion_ids"].cpu(),
                "completion_mask": output["completion_mask"].cpu(),
                "source": batch["entropy_source"],
            }
        )
        return output


def main(model_dir: str, out_dir: str, per_device: int) -> None:
    args = EGPOConfig(
        output_dir=out_dir, **{**TRAINER_TEST_SETTINGS, "per_device_train_batch_size": per_device, "max_steps": 2}
    )
    trainer = Recorder(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    save_rank_records(trainer, out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2)
