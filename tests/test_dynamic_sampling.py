"""DAPO's dynamic sampling (``egpo_trl.sampling.dynamic``) in real runs on TRL's machinery and a tiny Qwen2.

The batch fills with informative groups, rows keep their rewards when they move, the cap stops a run without
informative groups with a warning, and two processes keep the same groups.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from recording import Recording, answers_of, history, rows, texts


def half_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on prompts with an even answer; the parity reward on the others."""
    parity = parity_reward(completions)
    return [-1.0 if int(a) % 2 == 0 else p for a, p in zip(answer, parity)]


def always_wrong(completions, **kwargs):
    return [-1.0] * len(completions)


def test_the_mixin_adds_methods_and_overrides_nothing_of_grpo_trainer():
    from trl import GRPOTrainer

    from egpo_trl import EGPOTrainer
    from egpo_trl.sampling import DynamicSamplingMixin

    own = {name for name in vars(DynamicSamplingMixin) if not name.startswith("__")}
    assert own and not own & set(dir(GRPOTrainer)) and not own & set(vars(EGPOTrainer))
    assert DynamicSamplingMixin in EGPOTrainer.__mro__ and issubclass(EGPOTrainer, GRPOTrainer)


@pytest.mark.slow
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


@pytest.mark.slow
def test_dynamic_sampling_cap_stops_a_run_without_informative_groups(tmp_path, tiny_model_dir, caplog):
    args = config(tmp_path, max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    trainer = Recording(tiny_model_dir, always_wrong, args, train_dataset=make_prompt_dataset())
    with caplog.at_level(logging.WARNING, logger="egpo_trl.sampling.dynamic"):
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_dynamic_sampling_metrics_describe_the_kept_batch(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=3, dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    trainer = Recording(tiny_model_dir, half_informative_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == len(trainer.generated) == 3
    assert sum(history(trainer, "dynamic_sampling/rounds")) > 3, "some steps need extra rounds"
    for log, generated in zip(logs, trainer.generated):
        rewards = generated["batch"]["rewards_per_func"][:, 0]
        lengths = generated["completion_mask"].sum(dim=1).float()
        # Every kept group is mixed: no zero-std group, whatever the discarded rounds held.
        assert log["frac_reward_zero_std"] == 0.0
        assert log["reward"] == pytest.approx(rewards.mean().item(), abs=1e-6)
        assert log["reward_std"] == pytest.approx(rewards.std().item(), abs=1e-6)
        assert log["rewards/half_informative_reward/mean"] == pytest.approx(rewards.mean().item(), abs=1e-6)
        assert log["completions/mean_length"] == pytest.approx(lengths.mean().item(), abs=1e-6)
        assert log["completions/max_length"] == lengths.max().item()
