"""egpo_micro_batch_pieces: a micro-batch's loss forward run as several forwards of rows of similar length, each cut
to its own longest row, under one backward; the same log-probs, gradients and training as one forward, on the tiny
Qwen2 model with TRL's real GRPOTrainer machinery."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward, train_two_steps
from conftest import trainer_config as config
from test_old_logps import padded_batch

from egpo_trl import EGPOTrainer
from egpo_trl.old_logps import plan_pieces


def _padded_tokens(lengths: torch.Tensor, plan: list[torch.Tensor]) -> int:
    return sum(len(rows) * int(lengths[rows].max()) for rows in plan)


def _fewest_padded_tokens(lengths: list[int], count: int) -> int:
    ordered = sorted(lengths, reverse=True)
    best = None
    for cuts in itertools.combinations(range(1, len(ordered)), count - 1):
        bounds = [0, *cuts, len(ordered)]
        tokens = sum((end - start) * ordered[start] for start, end in zip(bounds[:-1], bounds[1:]))
        best = tokens if best is None else min(best, tokens)
    return best


def test_plan_pieces_cuts_sorted_rows_where_the_padding_is_least():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = int(torch.randint(1, 10, (1,), generator=generator))
        pieces = int(torch.randint(1, 6, (1,), generator=generator))
        lengths = torch.randint(1, 60, (rows,), generator=generator)
        plan = plan_pieces(lengths, pieces)
        # as many pieces as asked (at most one per row), whatever the lengths: ZeRO-3's processes run as many forwards
        assert len(plan) == min(pieces, rows) and all(len(piece) > 0 for piece in plan)
        assert sorted(torch.cat(plan).tolist()) == list(range(rows))
        ordered = lengths[torch.cat(plan)].tolist()
        assert ordered == sorted(ordered, reverse=True)  # longest first, each piece a run of the sorted rows
        assert _padded_tokens(lengths, plan) == _fewest_padded_tokens(lengths.tolist(), len(plan))
    assert [piece.tolist() for piece in plan_pieces(torch.tensor([5, 9, 5, 1]), 2)] == [[1], [0, 2, 3]]
    assert [piece.tolist() for piece in plan_pieces(torch.tensor([4, 4, 4]), 2)] == [[0], [1, 2]]  # ties: in order
    assert plan_pieces(torch.tensor([], dtype=torch.long), 3) == []


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    args = config(tmp_path_factory.mktemp("pieces"), temperature=0.7, max_steps=1, bf16=False)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.model.set_attn_implementation("eager")  # CPU results that do not change with the sequence length
    return trainer


def test_pieces_give_one_forwards_log_probs_entropies_and_gradients(trainer):
    """The loss's forward in 3 pieces: 3 forwards, each as wide as its longest row (prompt plus completion), and the
    same log-probs, entropies and parameter gradients as one forward of the micro-batch."""
    prompts, completions = [5, 9, 3, 9, 7, 1, 4], [4, 11, 0, 7, 11, 2, 9]
    batch = padded_batch(trainer.model.config.vocab_size, prompts, completions, seed=3)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    model = trainer.model
    widths = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )

    def loss_forward(pieces: int):
        trainer._egpo_pieces = pieces
        widths.clear()
        model.zero_grad()
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, batch["completion_ids"].size(1), compute_entropy=True
        )
        ((logps * batch["completion_mask"]).sum() + entropies.sum()).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), entropies.detach(), grads, list(widths)

    model.eval()  # no dropout: the passes must see the same network
    try:
        whole = loss_forward(1)
        split = loss_forward(3)
        widths.clear()
        with torch.no_grad():  # no-grad passes (old-policy, reference) are not split
            trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, batch["completion_ids"].size(1)
            )
        no_grad_widths = list(widths)
    finally:
        handle.remove()
        trainer._egpo_pieces = 1
        model.zero_grad()
        model.train()
    assert whole[3] == [(7, 20)]  # the longest row: 9 prompt + 11 completion tokens
    lengths = torch.tensor(prompts) + torch.tensor(completions)
    expected = [(len(rows), int(lengths[rows].max())) for rows in plan_pieces(lengths, 3)]
    assert split[3] == expected and len(expected) == 3
    assert sum(rows * width for rows, width in split[3]) < 7 * 20
    assert len(no_grad_widths) == 1
    torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-5)
    assert split[2].keys() == whole[2].keys() and split[2]
    for name, grad in whole[2].items():
        torch.testing.assert_close(split[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


VARIED_LENGTHS = {"sequence_bias": [[[2], 3.0]]}  # the end token favoured: completions of varied lengths


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"egpo_entropy_logps": "loss_forward"},  # a micro-batch is one group of 4
        {"egpo_entropy_logps": "policy", "egpo_length_sorted_micro_batches": True},
        {"advantage_estimator": "edge_grpo", "loss_type": "bnpo"},  # normalised over each micro-batch's tokens
    ],
)
def test_training_in_pieces_matches_training_in_one_forward(tmp_path, tiny_model_dir, extra):
    """Two optimizer steps with micro-batches of 4 rows run as 1 and as 3 forwards: the same rewards, losses, EGPO
    weights and final weights, to float32 rounding. bnpo (normalised over each micro-batch's tokens) is served: the
    loss still sees the whole micro-batch."""
    overrides = dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, generation_kwargs=VARIED_LENGTHS, **extra
    )
    results = {}
    for pieces in (1, 3):
        trainer, rows, weights = train_two_steps(
            tmp_path / str(pieces), tiny_model_dir, egpo_micro_batch_pieces=pieces, **overrides
        )
        assert trainer._egpo_pieces == pieces
        results[pieces] = (rows, weights)
    assert len(results[1][0]) == 2
    for one, three in zip(results[1][0], results[3][0], strict=True):
        for key in (
            "reward",
            "loss",
            "grad_norm",
            "egpo/entropy_mean",
            "egpo/weight_correct",
            "egpo/weight_incorrect",
        ):
            if key in one:
                assert three[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    for name, weight in results[1][1].items():
        torch.testing.assert_close(results[3][1][name], weight, rtol=1e-4, atol=2e-5, msg=name)


def test_pieces_count_the_forwards_of_training(tmp_path, tiny_model_dir):
    """Under loss_forward with one group of 4 per micro-batch and 3 pieces, each training micro-batch runs 3
    forwards (one optimizer step of 2 micro-batches: 6), and no no-grad pass runs."""
    args = config(
        tmp_path,
        max_steps=1,
        egpo_entropy_logps="loss_forward",
        egpo_micro_batch_pieces=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    rows = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            rows.append(kwargs["input_ids"].size(0)) if torch.is_grad_enabled() and module.training else None
        ),
        with_kwargs=True,
    )
    trainer.train()
    assert sorted(rows) == sorted([2, 1, 1] * 2), rows


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(beta=0.04), "beta != 0"),
        (dict(egpo_shift_prompt_padding=False), "egpo_shift_prompt_padding is off"),
        ({"unshiftable": True}, "rows cannot be shifted past their prompt padding"),
    ],
)
def test_pieces_that_save_nothing_say_so_and_run_one_forward(
    tmp_path, tiny_model_dir, overrides, reason, caplog, monkeypatch
):
    overrides = dict(overrides)
    if overrides.pop("unshiftable", False):  # a model type the shifted layout does not serve
        monkeypatch.setattr("egpo_trl.old_logps.REALIGN_MODEL_TYPES", frozenset())
    args = config(tmp_path, egpo_micro_batch_pieces=4, **overrides)
    with caplog.at_level("WARNING"):
        trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer._egpo_pieces == 1
    messages = [record.getMessage() for record in caplog.records if "egpo_micro_batch_pieces" in record.getMessage()]
    assert any(reason in message for message in messages), caplog.text


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_pieces_must_be_a_positive_integer(tmp_path, value):
    with pytest.raises(ValueError, match="egpo_micro_batch_pieces must be a positive integer"):
        config(tmp_path, egpo_micro_batch_pieces=value)


def test_pieces_refuse_reentrant_checkpointing_under_deepspeed_and_fsdp(monkeypatch):
    from test_fused import _loss_forward_arguments

    from egpo_trl import EGPOConfig

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)

    def arguments(**overrides):
        return _loss_forward_arguments(egpo_micro_batch_pieces=4, **overrides)

    EGPOConfig._validate_micro_batch_pieces(arguments())  # DDP, non-reentrant
    EGPOConfig._validate_micro_batch_pieces(arguments(deepspeed="zero3.json"))
    # one process without an engine: several forwards before one backward work with reentrant checkpointing
    EGPOConfig._validate_micro_batch_pieces(
        arguments(gradient_checkpointing_kwargs={"use_reentrant": True}, world_size=1)
    )
    for overrides in (
        dict(gradient_checkpointing_kwargs={"use_reentrant": True}),
        dict(gradient_checkpointing_kwargs={"use_reentrant": True}, world_size=1, deepspeed="zero2.json"),
    ):
        with pytest.raises(ValueError, match="use_reentrant: false"):
            EGPOConfig._validate_micro_batch_pieces(arguments(**overrides))
    with pytest.raises(ValueError, match="not been checked under FSDP"):
        EGPOConfig._validate_micro_batch_pieces(arguments(fsdp="full_shard"))
    EGPOConfig._validate_micro_batch_pieces(
        _loss_forward_arguments(egpo_micro_batch_pieces=1, fsdp="full_shard")  # one forward: nothing to refuse
    )
