"""The baselines through EGPOTrainer on TRL's real machinery and a tiny Qwen2 built offline.

Dynamic sampling (DAPO) in real runs: the batch fills with informative groups, rows keep their rewards when
they move, the cap stops a run without informative groups with a warning; EDGE-GRPO's Shannon entropies are
the old policy's; NSR and GRPO through the registry; Guided Error Correction rewrites incorrect completions.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from trl import GRPOConfig, GRPOTrainer

from egpo_trl import EGPOTrainer
from egpo_trl.advantages import edge_grpo_advantages, nsr_advantages, sequence_mean
from egpo_trl.rewards import boxed_accuracy_reward, completion_text, overlong_penalty

pytestmark = pytest.mark.slow


def half_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on prompts with an even answer; the parity reward on the others."""
    parity = parity_reward(completions)
    return [-1.0 if int(a) % 2 == 0 else p for a, p in zip(answer, parity)]


def always_wrong(completions, **kwargs):
    return [-1.0] * len(completions)


class Recording(EGPOTrainer):
    """Keeps each generation batch handed to TRL and each batch the loss consumed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated, self.consumed = [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.generated.append(
            {"batch": self.egpo_last_batch, **{k: v.clone() for k, v in output.items() if torch.is_tensor(v)}}
        )
        return output

    def _compute_loss(self, model, inputs):
        self.consumed.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return super()._compute_loss(model, inputs)


def rows(ids, mask):
    return [tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask)]


def texts(trainer, generated):
    """Prompt and completion texts of a generation batch, decoded the way TRL decodes them for the rewards."""
    tokenizer = trainer.processing_class
    prompts = tokenizer.batch_decode(generated["prompt_ids"], skip_special_tokens=True)
    ids = [r[m.bool()] for r, m in zip(generated["completion_ids"], generated["completion_mask"])]
    return prompts, tokenizer.batch_decode(ids, skip_special_tokens=True)


def answers_of(trainer, prompts):
    """The ground truth of each decoded prompt, looked up in make_prompt_dataset by its decoded chat prompt."""
    tokenizer = trainer.processing_class
    lookup = {}
    for row in make_prompt_dataset():
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        lookup[tokenizer.decode(ids, skip_special_tokens=True)] = row["answer"]
    return [lookup[prompt] for prompt in prompts]


def history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ----------------------------------------------------------------------------- DAPO: dynamic sampling
def test_dynamic_sampling_fills_the_batch_with_informative_groups(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=4, dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    trainer = Recording(tiny_model_dir, half_informative_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()

    rounds = history(trainer, "dynamic_sampling/rounds")
    assert len(rounds) == 4 and sum(rounds) > 4, "half the prompts are uninformative: some steps need extra rounds"
    assert history(trainer, "dynamic_sampling/cap_hit") == [0.0] * 4
    for generated in trainer.generated:
        batch = generated["batch"]
        sampling = batch["dynamic_sampling"]
        assert not sampling["cap_hit"] and len(sampling["selected"]) == sampling["target_groups"] == 2
        correctness = batch["rewards_per_func"][:, 0].view(-1, 4) > 0
        assert (correctness.any(dim=1) & ~correctness.all(dim=1)).all(), "every kept group is mixed"
        # Each kept row still carries its own reward: recompute it from the row's prompt and completion text.
        prompts, completions = texts(trainer, generated)
        recomputed = half_informative_reward(completions, answers_of(trainer, prompts))
        torch.testing.assert_close(batch["rewards_per_func"][:, 0], torch.tensor(recomputed))
        # The completions table shows the kept rows, with the advantages the loss uses.
        assert list(trainer._logs["prompt"])[-8:] is not None
        assert generated["advantages"].abs().sum() > 0
    logged_rewards = list(trainer._logs["rewards"]["half_informative_reward"])
    assert logged_rewards == trainer.generated[-1]["batch"]["rewards_per_func"][:, 0].tolist()
    assert list(trainer._logs["advantages"]) == trainer.generated[-1]["batch"]["result"].advantages.tolist()

    # The loss consumed exactly the assembled rows.
    kept = {row for g in trainer.generated for row in rows(g["completion_ids"], g["completion_mask"])}
    for consumed in trainer.consumed:
        assert set(rows(consumed["completion_ids"], consumed["completion_mask"])) <= kept


def test_dynamic_sampling_cap_stops_a_run_without_informative_groups(tmp_path, tiny_model_dir, caplog):
    args = config(tmp_path, max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    trainer = Recording(tiny_model_dir, always_wrong, args, train_dataset=make_prompt_dataset())
    with caplog.at_level(logging.WARNING, logger="egpo_trl.trainer"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert history(trainer, "dynamic_sampling/rounds") == [3.0, 3.0]
    assert history(trainer, "dynamic_sampling/cap_hit") == [1.0, 1.0]
    assert history(trainer, "dynamic_sampling/frac_informative") == [0.0, 0.0]
    warnings = [r.getMessage() for r in caplog.records if "Dynamic sampling" in r.getMessage()]
    assert len(warnings) == 2
    assert "0 of the 2 groups" in warnings[0] and "dynamic_sampling_max_rounds=3" in warnings[0]
    # The batch keeps its shape: the first round's groups fill it.
    sampling = trainer.generated[0]["batch"]["dynamic_sampling"]
    assert sampling["selected"] == [(0, 0), (0, 1)] and trainer.generated[0]["completion_ids"].size(0) == 8


def test_dapo_recipe_settings_train_with_the_overlong_penalty(tmp_path, tiny_model_dir):
    args = config(
        tmp_path,
        max_steps=1,
        advantage_estimator="grpo",
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=4,
        overlong_buffer_length=4,
    )
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer.reward_func_names == ["parity_reward", "overlong_penalty"]
    assert trainer.epsilon_high == 0.28
    trainer.train()
    generated = trainer.generated[0]
    lengths = generated["completion_mask"].sum(dim=1).tolist()
    expected = [overlong_penalty(n, 12, 4) for n in lengths]
    torch.testing.assert_close(generated["batch"]["rewards_per_func"][:, 1], torch.tensor(expected))
    assert any(value < 0 for value in expected)
    # Dynamic sampling decides on correctness (the first reward), not on the length-shaped total.
    correctness = generated["batch"]["rewards_per_func"][:, 0].view(-1, 4) > 0
    assert (correctness.any(dim=1) & ~correctness.all(dim=1)).all()

    with pytest.raises(ValueError, match="reward_weights needs 2 entries"):
        EGPOTrainer(
            tiny_model_dir,
            parity_reward,
            config(tmp_path, overlong_buffer_length=4, reward_weights=[1.0]),
            train_dataset=make_prompt_dataset(),
        )


# ----------------------------------------------------------------------------- EDGE-GRPO
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_edge_grpo_uses_the_old_policy_shannon_entropy(tmp_path, tiny_model_dir, num_iterations):
    args = config(tmp_path, max_steps=1, advantage_estimator="edge_grpo", num_iterations=num_iterations)
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    reference = trainer.model.__class__.from_pretrained(tiny_model_dir).eval()
    trainer.train()
    generated = trainer.generated[0]
    batch = generated["batch"]
    # num_iterations=2: TRL's old-log-prob pass returns the entropies too, no pass of our own.
    assert batch["entropy_source"] == ("forward" if num_iterations == 1 else "old_per_token_logps")
    assert trainer.state.log_history[0]["egpo/entropy_extra_pass"] == float(num_iterations == 1)
    assert "egpo_token_entropies" not in trainer.consumed[0]

    # Shannon entropy of the full next-token distribution at the sampling temperature, recomputed independently.
    ids = torch.cat([generated["prompt_ids"], generated["completion_ids"]], dim=1)
    attention = torch.cat([generated["prompt_mask"], generated["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=attention).logits[:, generated["prompt_ids"].size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float() / args.temperature, dim=-1)
    token_entropy = -(logps.exp() * logps).sum(dim=-1)
    expected = sequence_mean(token_entropy, generated["completion_mask"])
    torch.testing.assert_close(batch["token_entropies"], expected, atol=1e-4, rtol=1e-4)

    rewards = batch["rewards_per_func"][:, 0]
    recomputed = edge_grpo_advantages(rewards, batch["token_entropies"], 4)
    torch.testing.assert_close(batch["result"].advantages, recomputed.advantages)
    torch.testing.assert_close(generated["advantages"], recomputed.advantages)


# ----------------------------------------------------------------------------- NSR and GRPO through the registry
def test_nsr_trains_on_incorrect_completions_only(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1, advantage_estimator="nsr", egpo_entropy_metrics=False)
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.generated[0]["batch"]
    rewards = batch["rewards_per_func"][:, 0]
    torch.testing.assert_close(batch["result"].advantages, nsr_advantages(rewards, None, 4).advantages)
    assert set(batch["result"].advantages.tolist()) <= {0.0, -1.0} and (rewards < 0).any()
    assert batch["entropies"] is None and batch["entropy_source"] == "none"
    assert trainer.state.log_history[0]["egpo/entropy_extra_pass"] == 0.0
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_grpo_estimator_trains_exactly_like_trl(tmp_path, tiny_model_dir):
    grpo = GRPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(tmp_path / "trl", GRPOConfig, max_steps=2),
        train_dataset=make_prompt_dataset(),
    )
    grpo.train()
    ours = EGPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(tmp_path / "ours", max_steps=2, advantage_estimator="grpo", egpo_entropy_metrics=False),
        train_dataset=make_prompt_dataset(),
    )
    ours.train()
    assert history(ours, "loss") == history(grpo, "loss")
    for a, b in zip(grpo.model.parameters(), ours.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- EDGE-GRPO: Guided Error Correction
def solution_dataset():
    dataset = make_prompt_dataset()
    return dataset.map(lambda row: {"solution": f"S\\boxed{{{row['answer']}}}"})


@pytest.mark.parametrize("strategy", ["answer", "solution", "reflect"])
def test_guided_error_correction_rewrites_incorrect_completions(tmp_path, tiny_model_dir, strategy):
    probs = {"answer": (0.0, 1.0, 0.0), "solution": (0.0, 0.0, 1.0), "reflect": (1.0, 0.0, 0.0)}[strategy]
    args = config(
        tmp_path,
        max_steps=1,
        max_completion_length=24,
        advantage_estimator="edge_grpo",
        edge_gec=True,
        edge_gec_reflect_prob=probs[0],
        edge_gec_answer_prob=probs[1],
        edge_gec_solution_prob=probs[2],
        edge_gec_answer_template=" \\boxed{{answer}}",
        edge_gec_reflection_cue=" Wait.",
        edge_gec_max_new_tokens=6,
    )
    trainer = Recording(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=solution_dataset())
    trainer.train()
    generated = trainer.generated[0]
    prompts, completions = texts(trainer, generated)
    answers = answers_of(trainer, prompts)
    metrics = trainer.state.log_history[0]
    # The random tiny model never answers correctly: every completion is eligible and rewritten.
    assert metrics["gec/frac_eligible"] == 1.0 and metrics[f"gec/frac_{strategy}"] == 1.0
    assert generated["completion_mask"].sum(dim=1).max() <= 24
    if strategy == "answer":
        assert all(c.endswith(f"\\boxed{{{a}}}") for c, a in zip(completions, answers)), completions
    elif strategy == "solution":
        assert completions == [f"S\\boxed{{{a}}}" for a in answers]
    else:
        assert all("Wait." in c for c in completions), completions
    # TRL scored the rewritten completions (the reference answer makes them correct) and the loss trains on them.
    correct = [1.0 if strategy != "reflect" else r for r in boxed_accuracy_reward(completions, answers)]
    torch.testing.assert_close(generated["batch"]["rewards_per_func"][:, 0], torch.tensor(correct))
    assert set(rows(trainer.consumed[0]["completion_ids"], trainer.consumed[0]["completion_mask"])) == set(
        rows(generated["completion_ids"], generated["completion_mask"])
    )
    assert completion_text(completions[0])


def test_guided_error_correction_needs_the_answer_column(tmp_path, tiny_model_dir):
    dataset = make_prompt_dataset().remove_columns("answer")
    with pytest.raises(ValueError, match="`answer` column"):
        EGPOTrainer(tiny_model_dir, parity_reward, config(tmp_path, edge_gec=True), train_dataset=dataset)


# ----------------------------------------------------------------------------- dynamic sampling, 2 processes
def test_dynamic_sampling_with_two_processes_keeps_the_same_groups_everywhere(tmp_path, tiny_model_dir):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    script = Path(__file__).parent / "scripts" / "ddp_dynamic_sampling.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(30500 + os.getpid() % 1000), str(script), tiny_model_dir, str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"records_rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lookup = {}
    for row in make_prompt_dataset():
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        lookup[tokenizer.decode(ids, skip_special_tokens=True)] = row["answer"]

    rounds = []
    for first, second in zip(ranks[0]["records"], ranks[1]["records"]):
        # Both processes took the same decisions from the same gathered rewards ...
        assert first["selected"] == second["selected"] and first["rounds"] == second["rounds"]
        torch.testing.assert_close(first["rewards_per_func"], second["rewards_per_func"])
        assert all(torch.equal(a, b) for a, b in zip(first["informative"], second["informative"]))
        # ... kept one informative group of 4, 2 rows on each process (the group spans both) ...
        assert not first["cap_hit"] and first["completion_ids"].size(0) == second["completion_ids"].size(0) == 2
        correct = first["rewards_per_func"][:, 0] > 0
        assert correct.any() and not correct.all()
        torch.testing.assert_close(
            torch.cat([first["local_advantages"], second["local_advantages"]]), first["global_advantages"]
        )
        # ... and every row that moved between processes still matches its reward.
        for rank, record in enumerate((first, second)):
            prompts = tokenizer.batch_decode(record["prompt_ids"], skip_special_tokens=True)
            ids = [r[m.bool()] for r, m in zip(record["completion_ids"], record["completion_mask"])]
            completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
            expected = half_informative_reward(completions, [lookup[p] for p in prompts])
            torch.testing.assert_close(record["rewards_per_func"][2 * rank : 2 * rank + 2, 0], torch.tensor(expected))
        rounds.append(first["rounds"])
    assert max(rounds) > 1, "with half the prompts uninformative some step needs extra rounds"
