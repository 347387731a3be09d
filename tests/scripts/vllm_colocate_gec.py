"""The baselines' sampling features with vLLM colocate mode on a CPU build of vLLM.

Used by tests/test_baselines_vllm.py: ``python tests/scripts/vllm_colocate_gec.py MODEL_DIR OUT.json [--dapo]``.

Default: EDGE-GRPO with Guided Error Correction for one step. Every completion is incorrect (the reward is the boxed
answer and the tiny random model never writes it), so Guided Error Correction rewrites all of them: half are
continued by vLLM after the cue, half get the reference answer. The JSON holds, per row, what the batch handed to
the loss contains.

``--dapo``: DAPO's dynamic sampling for two steps, with a reward that makes half the prompts uninformative; the JSON
holds, per generation batch, the rounds it needed, the kept groups' correctness and the vLLM tensors' shapes.
``--dapo --oversample F`` sets ``dynamic_sampling_oversample``; the JSON also holds the rows of each generation call
and the engine's ``max_num_seqs``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import make_prompt_dataset, parity_reward  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402
from egpo_trl.rewards import boxed_accuracy_reward  # noqa: E402


class Recorder(EGPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        tokenizer = self.processing_class
        for ids, mask, logps in zip(
            output["completion_ids"], output["completion_mask"], output["sampling_per_token_logps"]
        ):
            kept = mask.bool()
            self.records.append(
                {
                    "text": tokenizer.decode(ids[kept], skip_special_tokens=True),
                    "length": int(kept.sum()),
                    "nan_logps": sum(math.isnan(v) for v in logps[kept].tolist()),
                }
            )
        self.records_rewards = self.egpo_last_batch["rewards_per_func"][:, 0].tolist()
        return output


def half_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on prompts with an even answer; the parity reward on the others."""
    return [-1.0 if int(a) % 2 == 0 else p for a, p in zip(answer, parity_reward(completions))]


class DynamicSamplingRecorder(EGPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []
        self.round_rows = []

    def _generate_round(self, inputs):
        self.round_rows.append(len(inputs))
        return super()._generate_round(inputs)

    def _generate_and_score_completions(self, inputs):
        self.round_rows = []
        output = super()._generate_and_score_completions(inputs)
        batch = self.egpo_last_batch
        correct = (batch["rewards_per_func"][:, 0] > 0).view(-1, 4)
        self.records.append(
            {
                "rounds": batch["dynamic_sampling"]["rounds"],
                "round_rows": list(self.round_rows),
                "rows": output["completion_ids"].size(0),
                "kept_mixed": (correct.any(dim=1) & ~correct.all(dim=1)).tolist(),
                "shapes": {
                    key: list(output[key].shape)
                    for key in ("completion_ids", "old_per_token_logps", "sampling_per_token_logps")
                },
                "ratio_shape": list(output["importance_sampling_ratio"].shape),
            }
        )
        return output


def colocate_config(out: str, **overrides) -> EGPOConfig:
    """The settings both runs share: vLLM colocate on CPU, 2 prompts x 4 completions per step."""
    return EGPOConfig(
        output_dir=str(Path(out).parent / "trainer"),
        use_cpu=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25,
        per_device_train_batch_size=8,
        num_generations=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        **overrides,
    )


def dapo(model_dir: str, out: str, oversample: float = 1.0) -> None:
    args = colocate_config(
        out,
        max_completion_length=12,
        max_steps=2,
        advantage_estimator="grpo",
        epsilon_high=0.28,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        dynamic_sampling_oversample=oversample,
    )
    trainer = DynamicSamplingRecorder(model_dir, half_informative_reward, args, train_dataset=make_prompt_dataset())
    engine = trainer.vllm_generation.llm.llm_engine
    config = getattr(engine, "vllm_config", None)
    trainer.train()
    from egpo_trl.script.run import kv_cache_line

    report = {
        "records": trainer.records,
        "kv_cache_line": kv_cache_line(trainer, args),
        "max_num_seqs": trainer.vllm_generation.max_num_seqs,  # what the trainer gave the engine
        "engine_max_num_seqs": config.scheduler_config.max_num_seqs if config is not None else None,
    }
    Path(out).write_text(json.dumps(report, indent=2))


def main(model_dir: str, out: str) -> None:
    args = colocate_config(
        out,
        max_completion_length=24,
        max_steps=1,
        advantage_estimator="edge_grpo",
        edge_gec=True,
        edge_gec_reflect_prob=0.5,
        edge_gec_answer_prob=0.5,
        edge_gec_solution_prob=0.0,
        edge_gec_reflection_cue=" Wait.",
        edge_gec_answer_template=" \\boxed{{answer}}",
        edge_gec_max_new_tokens=6,
    )
    trainer = Recorder(model_dir, boxed_accuracy_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    metrics = trainer.state.log_history[0]
    result = {
        "records": trainer.records,
        "rewards": trainer.records_rewards,
        "gec": {key: value for key, value in metrics.items() if key.startswith("gec/")},
    }
    Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    flags = sys.argv[3:]
    if "--dapo" in flags:
        oversample = float(flags[flags.index("--oversample") + 1]) if "--oversample" in flags else 1.0
        dapo(sys.argv[1], sys.argv[2], oversample)
    else:
        main(sys.argv[1], sys.argv[2])
