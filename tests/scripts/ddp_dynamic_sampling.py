"""Train with dynamic sampling in every process of a distributed launch and save what each generation batch kept.

Used by tests/test_baselines_training.py:
``python -m torch.distributed.run --nproc_per_node 2 tests/scripts/ddp_dynamic_sampling.py MODEL OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import TRAINER_TEST_SETTINGS, make_prompt_dataset, parity_reward, save_rank_records  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402


def half_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on prompts with an even answer; the parity reward on the others."""
    parity = parity_reward(completions)
    return [-1.0 if int(a) % 2 == 0 else p for a, p in zip(answer, parity)]


class Recorder(EGPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        batch = self.egpo_last_batch
        sampling = batch["dynamic_sampling"]
        self.records.append(
            {
                "rounds": sampling["rounds"],
                "selected": sampling["selected"],
                "cap_hit": sampling["cap_hit"],
                "informative": [flags.cpu() for flags in sampling["informative"]],
                "rewards_per_func": batch["rewards_per_func"].cpu(),
                "global_advantages": batch["result"].advantages.cpu(),
                **{
                    key: output[key].cpu()
                    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                },
                "local_advantages": output["advantages"].cpu(),
            }
        )
        return output


def main(model_dir: str, out_dir: str) -> None:
    args = EGPOConfig(
        output_dir=out_dir,
        **{
            **TRAINER_TEST_SETTINGS,
            "per_device_train_batch_size": 2,
            "max_steps": 3,
            "advantage_estimator": "grpo",
            "dynamic_sampling": True,
            "dynamic_sampling_max_rounds": 8,
        },
    )
    trainer = Recorder(model_dir, half_informative_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    save_rank_records(trainer, out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
