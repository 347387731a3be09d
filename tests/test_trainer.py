"""EGPOTrainer on TRL's real GRPOTrainer machinery, with a tiny Qwen2 model built offline."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from recording import Recording, rows
from trl import GRPOConfig, GRPOTrainer

from egpo_trl import EGPOConfig, EGPOTrainer, egpo_advantages, sequence_entropy

pytestmark = pytest.mark.slow


def recompute(batch: dict, args: EGPOConfig, trainer: EGPOTrainer):
    rewards_per_func = batch["rewards_per_func"]
    rewards = (rewards_per_func * trainer.reward_weights.unsqueeze(0)).nansum(dim=1)
    return egpo_advantages(
        rewards,
        batch["entropies"],
        batch["num_generations"],
        lambda_min=args.egpo_lambda_min,
        lambda_max=args.egpo_lambda_max,
        entropy_eps=args.egpo_entropy_eps,
        clamp=args.egpo_clamp,
        renorm=args.egpo_renorm,
        nsr=args.egpo_nsr,
        nsr_weighting=args.egpo_nsr_weighting,
        correct=rewards_per_func[:, 0] > 0,
    )


def test_loss_uses_egpo_advantages_recomputed_from_rewards_and_entropies(tmp_path, tiny_model_dir):
    # num_iterations=2: TRL computes old_per_token_logps, which EGPO reuses (no extra pass); the loss sees
    # them too, so the entropy of every row the loss consumes can be recomputed independently.
    args = config(tmp_path, max_steps=4, num_iterations=2, gradient_accumulation_steps=2)
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()

    assert len(trainer.generated) == 2  # 4 optimizer steps, a generation every 2 (num_iterations)
    mixed_seen = False
    for generated in trainer.generated:
        batch = generated["batch"]
        assert batch["entropy_source"] == "old_per_token_logps"
        expected = recompute(batch, args, trainer)
        torch.testing.assert_close(batch["result"].advantages, expected.advantages, rtol=0, atol=0)
        torch.testing.assert_close(generated["advantages"], expected.advantages[batch["process_slice"]])
        mixed_seen |= bool((expected.group_type == 1).any() and (expected.weights != 1).any())
    assert mixed_seen, "the test data should produce mixed groups with non-unit weights"

    # Every loss call consumed the advantages computed for its rows, and its old log-probs give those entropies.
    for consumed in trainer.consumed:
        entropy = sequence_entropy(consumed["old_per_token_logps"], consumed["completion_mask"])
        for row, adv, h in zip(
            rows(consumed["completion_ids"], consumed["completion_mask"]), consumed["advantages"], entropy
        ):
            matches = [
                (g["advantages"][i], g["batch"]["entropies"][i])
                for g in trainer.generated
                for i, r in enumerate(rows(g["completion_ids"], g["completion_mask"]))
                if r == row
            ]
            assert any(torch.isclose(adv, a) and torch.isclose(h, e, equal_nan=True) for a, e in matches)

    logged = list(trainer._logs["advantages"])
    assert logged == trainer.generated[-1]["batch"]["result"].advantages.tolist()
    history = [h for h in trainer.state.log_history if "loss" in h]
    for key in ("egpo/frac_mixed", "egpo/frac_all_correct", "egpo/frac_all_incorrect", "egpo/weight_correct"):
        assert key in history[0], key
    fractions = (
        history[0]["egpo/frac_mixed"] + history[0]["egpo/frac_all_correct"] + history[0]["egpo/frac_all_incorrect"]
    )
    assert fractions == pytest.approx(1.0)


def test_extra_forward_pass_gives_the_old_policy_entropy(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1)
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    reference = trainer.model.__class__.from_pretrained(tiny_model_dir).eval()
    trainer.train()
    generated = trainer.generated[0]
    batch = generated["batch"]
    assert batch["entropy_source"] == "forward"
    assert trainer.state.log_history[0]["egpo/entropy_extra_pass"] == 1.0
    # The step's time is split: generation, the no-grad log-prob pass, and the whole generate-and-score call.
    logged = trainer.state.log_history[0]
    assert 0 < logged["timing/generation_s"] < logged["timing/generate_and_score_s"] <= logged["step_time"]
    assert logged["timing/old_logps_s"] > 0
    # Recompute with the initial weights (the old policy of step 1), independently of TRL's helper.
    consumed = trainer.consumed[0]
    ids = torch.cat([consumed["prompt_ids"], consumed["completion_ids"]], dim=1)
    attention = torch.cat([consumed["prompt_mask"], consumed["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=attention).logits[:, consumed["prompt_ids"].size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float() / args.temperature, dim=-1)
    logps = logps.gather(-1, consumed["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = sequence_entropy(logps, consumed["completion_mask"])
    by_row = dict(zip(rows(generated["completion_ids"], generated["completion_mask"]), batch["entropies"]))
    for row, h in zip(rows(consumed["completion_ids"], consumed["completion_mask"]), entropy):
        torch.testing.assert_close(h, by_row[row], atol=1e-4, rtol=1e-4)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_egpo_switched_off_trains_exactly_like_grpo(tmp_path, tiny_model_dir, num_iterations):
    kwargs = dict(max_steps=3, num_iterations=num_iterations)
    grpo = GRPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(tmp_path / "grpo", GRPOConfig, **kwargs),
        train_dataset=make_prompt_dataset(),
    )
    grpo.train()
    egpo = EGPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(tmp_path / "egpo", egpo_clamp="none", egpo_nsr=False, egpo_shift_prompt_padding=False, **kwargs),
        train_dataset=make_prompt_dataset(),
    )
    egpo.train()
    assert losses(egpo) == losses(grpo)
    assert any(loss != 0 for loss in losses(grpo))
    for p_grpo, p_egpo in zip(grpo.model.parameters(), egpo.model.parameters()):
        torch.testing.assert_close(p_grpo, p_egpo, rtol=0, atol=0)


def test_egpo_changes_training_when_on(tmp_path, tiny_model_dir):
    grpo = GRPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(tmp_path / "grpo", GRPOConfig, max_steps=2),
        train_dataset=make_prompt_dataset(),
    )
    grpo.train()
    egpo = EGPOTrainer(
        tiny_model_dir, parity_reward, config(tmp_path / "egpo", max_steps=2), train_dataset=make_prompt_dataset()
    )
    egpo.train()
    assert losses(egpo) != losses(grpo)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"])
def test_every_trl_loss_type_trains(tmp_path, tiny_model_dir, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    args = config(tmp_path, max_steps=1, loss_type=loss_type, **extra)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.egpo_last_batch
    torch.testing.assert_close(batch["result"].advantages, recompute(batch, args, trainer).advantages)
    assert all(torch.isfinite(torch.tensor(losses(trainer))))


def test_peft_lora_trains_only_the_adapter(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    args = config(tmp_path, max_steps=2, beta=0.04)  # beta > 0: the reference is the adapter-free base
    trainer = EGPOTrainer(
        tiny_model_dir,
        parity_reward,
        args,
        train_dataset=make_prompt_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert "kl" in trainer.state.log_history[0]


def test_correctness_comes_from_the_named_reward_function(tmp_path, tiny_model_dir):
    def format_bonus(completions, **kwargs):
        return [1.0] * len(completions)  # would make every completion "correct" if it decided correctness

    args = config(tmp_path, max_steps=1, reward_weights=[1.0, 1.0], egpo_correctness_reward="parity_reward")
    trainer = EGPOTrainer(tiny_model_dir, [parity_reward, format_bonus], args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.egpo_last_batch
    assert torch.equal(batch["result"].correct, batch["rewards_per_func"][:, 0] > 0)
    assert (batch["result"].correct == False).any()  # noqa: E712

    args = config(tmp_path, max_steps=1, egpo_correctness_reward="format_bonus")
    trainer = EGPOTrainer(tiny_model_dir, [parity_reward, format_bonus], args, train_dataset=make_prompt_dataset())
    trainer.train()
    assert trainer.egpo_last_batch["result"].correct.all()

    with pytest.raises(ValueError, match="names no reward function; set it to one of"):
        EGPOTrainer(
            tiny_model_dir,
            parity_reward,
            config(tmp_path, max_steps=1, egpo_correctness_reward="accuracy"),
            train_dataset=make_prompt_dataset(),
        )


def test_grpo_config_is_refused_with_the_fix(tmp_path, tiny_model_dir):
    with pytest.raises(TypeError, match="needs an EGPOConfig"):
        EGPOTrainer(tiny_model_dir, parity_reward, config(tmp_path, GRPOConfig), train_dataset=make_prompt_dataset())


def test_truncated_completions_are_left_out_of_the_weights(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1, max_completion_length=4, mask_truncated_completions=True)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.egpo_last_batch
    nan = torch.isnan(batch["entropies"])
    assert nan.any(), "with 4 tokens most completions are truncated"
    assert (batch["result"].weights[nan] == 1).all()


def test_importance_sampling_ratios_far_below_one_are_reported(tmp_path, tiny_model_dir, caplog):
    args = config(tmp_path, max_steps=1)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    metrics = trainer._metrics["train"]["sampling/importance_sampling_ratio/mean"]
    with caplog.at_level("WARNING", logger="egpo_trl.trainer"):
        metrics.append(0.9)
        trainer._egpo_check_importance_sampling("train")
        assert not caplog.records  # a healthy ratio says nothing
        for _ in range(10):
            metrics.append(0.0013)
            trainer._egpo_check_importance_sampling("train")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # the 1st and the 10th low batch, not every one
    assert "0.0013" in warnings[0] and "vllm_importance_sampling_correction: false" in warnings[0]


def sometimes_unscored_reward(completions, **kwargs):
    """The parity reward, but None (unscored) for every third completion."""
    return [None if i % 3 == 0 else r for i, r in enumerate(parity_reward(completions))]


@pytest.mark.slow
def test_unscored_completions_count_neither_as_correct_nor_as_incorrect_in_the_metrics(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1)
    trainer = Recording(tiny_model_dir, sometimes_unscored_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    log = trainer.state.log_history[0]
    batch = trainer.generated[0]["batch"]
    rewards = batch["rewards_per_func"][:, 0]
    entropies = batch["entropies"]
    assert torch.isnan(rewards).sum() == 3
    incorrect = rewards == -1
    correct = rewards == 1
    assert incorrect.any() and correct.any()
    assert log["egpo/entropy_incorrect"] == pytest.approx(entropies[incorrect].mean().item(), abs=1e-6)
    assert log["egpo/entropy_correct"] == pytest.approx(entropies[correct].mean().item(), abs=1e-6)
    weights = batch["result"].weights
    assert log["egpo/weight_incorrect"] == pytest.approx(weights[incorrect].mean().item(), abs=1e-6)


@pytest.mark.parametrize("estimator", ["egpo", "nsr", "grpo"])
def test_a_row_the_verifier_gives_no_verdict_is_neither_correct_nor_incorrect(tmp_path, tiny_model_dir, estimator):
    """The verifier returns None for some rows that a format reward still scores: those rows do not type their group,
    get no NSR advantage and are left out of the per-correctness metrics; the GRPO advantages stay TRL's."""

    def verifier(completions, **kwargs):
        # Per group of 4: the first row of the first group and the whole second group get no verdict.
        return [None if i % 8 == 0 or i % 8 >= 4 else -1.0 for i in range(len(completions))]

    def format_reward(completions, **kwargs):
        return [0.5] * len(completions)

    args = config(
        tmp_path, max_steps=1, advantage_estimator=estimator, egpo_correctness_reward="verifier",
        reward_weights=[1.0, 1.0],
    )  # fmt: skip
    trainer = EGPOTrainer(tiny_model_dir, [verifier, format_reward], args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.egpo_last_batch
    result, rewards_per_func = batch["result"], batch["rewards_per_func"]
    no_verdict = torch.isnan(rewards_per_func[:, 0])
    assert no_verdict.tolist() == [True, False, False, False, True, True, True, True]
    assert not torch.isnan(rewards_per_func[:, 1]).any()  # the format reward scored every row
    assert not result.correct[no_verdict].any()
    # First group: its judged rows are all incorrect; second group: no verdict at all, whatever its rewards.
    assert result.group_type.tolist() == [0] * 4 + [-1] * 4
    logged = trainer.state.log_history[0]
    assert logged["egpo/frac_all_incorrect"] == 0.5
    rewards = (rewards_per_func * torch.tensor([1.0, 1.0])).nansum(dim=1)
    if estimator == "grpo":  # TRL's advantages of the summed rewards (-0.5 / 0.5 in group 1, uniform in group 2)
        expected = torch.cat([(r - r.mean()) / (r.std() + 1e-4) for r in rewards.view(-1, 4)])
        torch.testing.assert_close(result.advantages, expected)
    else:
        torch.testing.assert_close(result.advantages[no_verdict], torch.zeros(int(no_verdict.sum())))
        assert (result.advantages[~no_verdict] < 0).all()  # NSR: the judged incorrect rows only
        assert (result.weights[no_verdict] == 1).all()
    if estimator == "egpo":
        nll = batch["entropies"][1:4]
        assert logged["egpo/entropy_incorrect"] == pytest.approx(nll[torch.isfinite(nll)].mean().item(), rel=1e-5)


@pytest.mark.parametrize("logps", ["policy", "loss_forward"])
def test_a_row_without_a_verdict_gets_no_advantage_from_the_other_reward_functions(tmp_path, tiny_model_dir, logps):
    """A shaping reward (an overlong penalty of 0, say) scores a row the verifier gives no verdict: the row gets
    advantage 0 and its group's mean and std are those of the judged rows."""

    def verifier(completions, **kwargs):
        return [[1.0, -1.0, -1.0, None][i % 4] for i in range(len(completions))]

    def shaping(completions, **kwargs):
        return [0.0] * len(completions)

    args = config(
        tmp_path, max_steps=1, egpo_correctness_reward="verifier", egpo_clamp="none", egpo_entropy_logps=logps
    )
    trainer = EGPOTrainer(tiny_model_dir, [verifier, shaping], args, train_dataset=make_prompt_dataset())
    trainer.train()
    result = trainer.egpo_last_batch["result"]
    judged = torch.tensor([1.0, -1.0, -1.0])
    expected = ((judged - judged.mean()) / (judged.std() + 1e-4)).tolist() + [0.0]
    torch.testing.assert_close(result.advantages, torch.tensor(expected * 2))
    assert result.group_type.tolist() == [1] * 8


def test_nsr_stays_bounded_under_batch_scaling_when_no_completion_is_correct(tmp_path, tiny_model_dir):
    def always_wrong(completions, **kwargs):
        return [-1.0] * len(completions)

    args = config(tmp_path, max_steps=2, scale_rewards="batch")
    trainer = EGPOTrainer(tiny_model_dir, always_wrong, args, train_dataset=make_prompt_dataset())
    trainer.train()
    result = trainer.egpo_last_batch["result"]
    # NSR is -1 under "batch" as under "group", times the entropy weight (at most 1 when incorrect).
    assert result.base_advantages.tolist() == [-1.0] * 8
    assert all(-1.0 <= a < 0 for a in trainer._logs["advantages"])
    assert all(abs(loss) <= 1.0 for loss in losses(trainer))
