"""Train EGPO for a few steps in every process of a distributed launch and save what each step computed.

Used by tests/test_distributed.py: ``torchrun --nproc_per_node 2 tests/scripts/ddp_egpo.py MODEL OUT [PER_DEVICE
[ESTIMATOR]]``. GRPO's entropy metrics come from the loss's forwards, after the generation step: each record keeps
its batch and reads the entropies once training is done.
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
        self.records, self.batches = [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        batch = self.egpo_last_batch
        self.records.append(
            {
                "rewards_per_func": batch["rewards_per_func"].cpu(),
                "global_advantages": batch["result"].advantages.cpu(),
                "local_advantages": output["advantages"].cpu(),
                "prompt_ids": output["prompt_ids"].cpu(),
                "prompt_mask": output["prompt_mask"].cpu(),
                "completion_ids": output["completion_ids"].cpu(),
                "completion_mask": output["completion_mask"].cpu(),
                "source": batch["entropy_source"],
            }
        )
        self.batches.append(batch)
        return output


def main(model_dir: str, out_dir: str, per_device: int, estimator: str) -> None:
    settings = {"per_device_train_batch_size": per_device, "max_steps": 2, "advantage_estimator": estimator}
    args = EGPOConfig(output_dir=out_dir, **{**TRAINER_TEST_SETTINGS, **settings})
    trainer = Recorder(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    for record, batch in zip(trainer.records, trainer.batches, strict=True):
        record["entropies"] = batch["entropies"].cpu()
    save_rank_records(trainer, out_dir)


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]) if len(sys.argv) > 3 else 2,
        sys.argv[4] if len(sys.argv) > 4 else "egpo",
    )
