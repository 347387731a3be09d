"""Train EGPO a few steps with vLLM colocate mode on a CPU build of vLLM and write what the tests check as JSON.

Used by tests/test_vllm_cpu.py (one vLLM engine per process):
``python tests/scripts/vllm_colocate_egpo.py MODEL_DIR OUT.json [--no-importance-sampling] [--entropy-logps policy|sampler] [--steps N]``.

The JSON holds, per generation batch, where EGPO's entropy proxy took its log-probs, whether an extra forward pass
ran, and how far the stored entropies are from ones recomputed from that log-prob tensor; and, after training, the
log-probs of a fixed sequence under vLLM (one optimizer step stale, then after a weight sync), under the trainer's
model and under the initial checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import make_prompt_dataset, parity_reward  # noqa: E402

from egpo_trl import EGPOConfig, EGPOTrainer  # noqa: E402
from egpo_trl.advantages import sequence_entropy  # noqa: E402

FIXED_TEXT = "What is 3 + 4? Put the answer in \\boxed{}. The answer is \\boxed{7}."


class Recorder(EGPOTrainer):
    """EGPOTrainer that keeps, per generation batch, what EGPO used for its entropies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []
        self.sync_seconds = []
        sync = self.vllm_generation.sync_weights

        def timed_sync():
            start = time.perf_counter()
            sync()
            self.sync_seconds.append(time.perf_counter() - start)

        self.vllm_generation.sync_weights = timed_sync
        self.detokenize = []  # per generation call: the detokenize flags of the sampling parameters vLLM got
        generate = self.vllm_generation.llm.generate

        def recorded_generate(prompts, sampling_params=None, *args, **kwargs):
            params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params]
            self.detokenize.append(sorted({bool(p.detokenize) for p in params}))
            return generate(prompts, sampling_params, *args, **kwargs)

        self.vllm_generation.llm.generate = recorded_generate

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        batch = self.egpo_last_batch
        source = batch["entropy_source"]
        record = {
            "source": source,
            "has_old_per_token_logps": output.get("old_per_token_logps") is not None,
            "has_sampling_per_token_logps": output.get("sampling_per_token_logps") is not None,
        }
        if source in ("old_per_token_logps", "sampling_per_token_logps"):
            recomputed = sequence_entropy(output[source], output["completion_mask"])
            record["entropy_max_abs_diff"] = (recomputed - batch["entropies"]).abs().max().item()
        elif output.get("sampling_per_token_logps") is not None:  # the policy's own pass: vLLM's proxy is close
            sampler = sequence_entropy(output["sampling_per_token_logps"], output["completion_mask"])
            record["vs_sampler_max_abs_diff"] = (sampler - batch["entropies"]).abs().max().item()
        record["completion_tokens"] = int(output["completion_mask"].sum().item())
        self.records.append(record)
        return output


def vllm_logps(trainer, ids: list[int]) -> torch.Tensor:
    """Log-probs vLLM gives each token of ``ids`` after the first (its prompt log-probs)."""
    from vllm import SamplingParams

    outputs = trainer.vllm_generation.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False
    )
    prompt_logprobs = outputs[0].prompt_logprobs
    return torch.tensor([prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


@torch.no_grad()
def model_logps(model, ids: list[int]) -> torch.Tensor:
    """Log-probs a transformers causal LM gives each token of ``ids`` after the first."""
    logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float().cpu()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--no-importance-sampling", action="store_true")
    parser.add_argument("--entropy-logps", default="policy", choices=("policy", "sampler"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory", type=float, default=0.25)
    cli = parser.parse_args()

    args = EGPOConfig(
        output_dir=str(Path(cli.out).parent / "trainer"),
        use_cpu=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=cli.memory,
        vllm_importance_sampling_correction=not cli.no_importance_sampling,
        egpo_entropy_logps=cli.entropy_logps,
        learning_rate=1e-2,  # large, so that one optimizer step visibly moves the log-probs
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=cli.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    trainer = Recorder(model=cli.model, reward_funcs=parity_reward, args=args, train_dataset=make_prompt_dataset())
    trainer.train()
    detokenize = list(trainer.detokenize)  # the training's generation calls, not the checks below

    from transformers import AutoModelForCausalLM

    ids = trainer.processing_class(FIXED_TEXT)["input_ids"]
    stale = vllm_logps(trainer, ids)  # vLLM still holds the weights it sampled the last batch with
    trainer.vllm_generation.sync_weights()
    synced = vllm_logps(trainer, ids)
    current = model_logps(trainer.accelerator.unwrap_model(trainer.model), ids)
    initial = model_logps(AutoModelForCausalLM.from_pretrained(cli.model), ids)

    metrics = [h for h in trainer.state.log_history if "egpo/entropy_extra_pass" in h]
    result = {
        "records": trainer.records,
        "extra_pass": [h["egpo/entropy_extra_pass"] for h in metrics],
        "cpu_weight_sync": getattr(type(trainer.vllm_generation).sync_weights, "cpu_sync", False),
        "sync_seconds": trainer.sync_seconds,
        "detokenize": detokenize,
        "generation_kwargs": trainer.args.generation_kwargs,
        "step_seconds": [h["step_time"] for h in metrics if "step_time" in h],
        "stale_vs_trainer": (stale - current).abs().max().item(),
        "synced_vs_trainer": (synced - current).abs().max().item(),
        "initial_vs_trainer": (initial - current).abs().max().item(),
    }
    Path(cli.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
