"""Train with dynamic sampling in every process of a distributed launch and save what each generation batch kept.

Used by tests/test_dynamic_sampling.py:
``python -m torch.distributed.run --nproc_per_node 2 tests/scripts/ddp_dynamic_sampling.py MODEL OUT [OVERSAMPLE]``
(``dynamic_sampling_oversample``, 1.0 by default).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import TRAINER_TEST_SETTINGS, make_prompt_dataset, parity_reward, save_rank_records  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402


def mostly_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on 2 of make_prompt_dataset's 8 prompts (answers 10 and 22); parity otherwise."""
    parity = parity_reward(completions)
    return [-1.0 if (int(a) - 10) % 12 == 0 else p for a, p in zip(answer, parity)]


class Recorder(EGPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []
        self.round_rows = []  # this process's number of rows in each generation round of the current batch

    def _generate_round(self, inputs):
        self.round_rows.append(len(inputs))
        return super()._generate_round(inputs)

    def _generate_and_score_completions(self, inputs):
        self.round_rows = []
        output = super()._generate_and_score_completions(inputs)
        batch = self.egpo_last_batch
        sampling = batch["dynamic_sampling"]
        self.records.append(
            {
                "rounds": sampling["rounds"],
                "round_groups": sampling["round_groups"],
                "round_rows": list(self.round_rows),
                "selected": sampling["selected"],
                "first_round_extra_groups": sampling["first_round_extra_groups"],
                "table_rows": len(self._logs["prompt"]),
                "table_rewards": list(self._logs["rewards"]["mostly_informative_reward"]),
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


def main(model_dir: str, out_dir: str, oversample: float = 1.0) -> None:
    args = EGPOConfig(
        output_dir=out_dir,
        **{
            **TRAINER_TEST_SETTINGS,
            "per_device_train_batch_size": 8,
            "max_steps": 4,
            "advantage_estimator": "grpo",
            "dynamic_sampling": True,
            "dynamic_sampling_max_rounds": 8,
            "dynamic_sampling_oversample": oversample,
            "log_completions": True,
        },
    )
    trainer = Recorder(model_dir, mostly_informative_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    save_rank_records(trainer, out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)
