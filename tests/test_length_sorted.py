"""egpo_length_sorted_micro_batches: rows of similar length share a micro-batch, each optimizer step (each
loss_forward block) keeps exactly its rows, and training is the same as without it, on the tiny Qwen2 model with
TRL's real GRPOTrainer machinery."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config

from egpo_trl import EGPOTrainer
from egpo_trl.fused import GROUP_KEY, ROW_KEY, length_sorted_order, reorder_rows
from egpo_trl.old_logps import completion_widths


def test_length_sorted_order_sorts_within_windows_longest_first():
    completion_mask = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    )
    prompt_mask = torch.tensor([[1, 1], [0, 1], [1, 1], [1, 1], [0, 1], [1, 1]])
    # lengths (prompt + completion): 4, 5, 3, 5, 3, 6
    order = length_sorted_order({"completion_mask": completion_mask, "prompt_mask": prompt_mask}, window=3)
    assert order.tolist() == [1, 0, 2, 5, 3, 4]  # each window of 3 rows on its own, ties in their order
    assert length_sorted_order({"completion_mask": completion_mask}, window=6).tolist() == [1, 5, 3, 0, 4, 2]
    # a completion's length runs to its last scored token (a masked token inside it still counts)
    holes = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]])
    assert length_sorted_order({"completion_mask": holes}, window=2).tolist() == [0, 1]
    with pytest.raises(ValueError, match="at least one row"):
        length_sorted_order({"completion_mask": completion_mask}, window=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(loss_type="bnpo"), "'bnpo' averages over each micro-batch's tokens"),
        (dict(top_entropy_quantile=0.5), "threshold within each micro-batch"),
        (dict(entropy_coef=0.01), "entropy bonus"),
    ],
)
def test_length_sorting_refuses_terms_normalised_per_micro_batch(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        config(tmp_path, egpo_length_sorted_micro_batches=True, **overrides)
    assert "Set egpo_length_sorted_micro_batches=False" in str(error.value)


class RecordingTrainer(EGPOTrainer):
    """Keeps, per prepared micro-batch, its rows' lengths (prompt plus completion), their prompt and completion ids
    (to compare the rows each optimizer step trained on) and, under loss_forward, their groups."""

    def _prepare_inputs(self, generation_batch):
        prepared = super()._prepare_inputs(generation_batch)
        if self.model.training:
            widths = completion_widths(prepared["completion_mask"])
            lengths = widths + prepared["prompt_mask"].sum(dim=1)
            rows = [
                (tuple(p[m.bool()].tolist()), tuple(c[: int(w)].tolist()))
                for p, m, c, w in zip(
                    prepared["prompt_ids"], prepared["prompt_mask"], prepared["completion_ids"], widths
                )
            ]
            groups = prepared[GROUP_KEY].tolist() if GROUP_KEY in prepared else None
            self.seen.append((lengths.tolist(), rows, groups))
            ends = getattr(self, "_fused_block_ends", None)
            self.block_ends.append(sorted(ends) if ends is not None else None)
        return prepared


#: A bias on the tiny model's end token (id 2), so that its completions end at varied lengths.
VARIED_LENGTHS = {"sequence_bias": [[[2], 3.0]]}


def _train(tmp_path, model_dir, **overrides):
    settings = dict(
        max_steps=2,
        bf16=False,
        model_init_kwargs={"attn_implementation": "eager"},
        generation_kwargs=VARIED_LENGTHS,
    )
    args = config(tmp_path, **{**settings, **overrides})
    trainer = RecordingTrainer(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.seen, trainer.block_ends = [], []
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    return trainer, rows, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _descending(values):
    return values == sorted(values, reverse=True)


@pytest.mark.parametrize(
    "per_device, accumulation, extra, window",
    [
        (2, 4, {}, 4),  # the optimizer step's 4 micro-batches sorted together
        (2, 4, {"steps_per_generation": 2}, 2),  # two generation batches per optimizer step: each on its own
        (2, 4, {"egpo_entropy_logps": "loss_forward"}, "group"),  # blocks of 2 micro-batches, one group each
        (6, 2, {"egpo_entropy_logps": "loss_forward"}, "group"),  # a block of 2 micro-batches holds 3 groups
        # one group per micro-batch, groups merged into blocks where that cuts padding, each block sorted together
        (4, 4, {"egpo_entropy_logps": "loss_forward", "egpo_loss_forward_block_tokens": 10**6}, "merged"),
        # DAPO's dynamic sampling: a generation batch assembled from rounds, then sorted
        (2, 4, {"advantage_estimator": "grpo", "dynamic_sampling": True, "egpo_entropy_metrics": False}, 4),
    ],
)
def test_length_sorted_micro_batches_train_as_unsorted(
    tmp_path, tiny_model_dir, per_device, accumulation, extra, window
):
    """Two optimizer steps with and without sorting: each optimizer step trains on the same rows, sorted longest
    first within each window (within each group under loss_forward, whose groups stay together), and the losses,
    EGPO's weights and the final weights are the same to float32 rounding."""
    overrides = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, **extra)
    plain, plain_rows, plain_weights = _train(tmp_path / "plain", tiny_model_dir, **overrides)
    sorted_, sorted_rows, sorted_weights = _train(
        tmp_path / "sorted", tiny_model_dir, egpo_length_sorted_micro_batches=True, **overrides
    )
    assert sorted_._egpo_sort_window == (4 if window in ("group", "merged") else window * per_device)
    assert len(plain.seen) == len(sorted_.seen) == 2 * accumulation
    completion_lengths = {len(row[1]) for seen in sorted_.seen for row in seen[1]}
    assert len(completion_lengths) > 2, f"completion lengths {completion_lengths}: the test cannot tell"
    unsorted = mixed = 0
    for step in range(2):
        plain_step = plain.seen[step * accumulation : (step + 1) * accumulation]
        sorted_step = sorted_.seen[step * accumulation : (step + 1) * accumulation]
        assert sorted(r for _, rows, _ in sorted_step for r in rows) == sorted(
            r for _, rows, _ in plain_step for r in rows
        )
        if window == "merged":
            mixed += _check_merged_blocks(sorted_step, sorted_.block_ends[step * accumulation], per_device)
            for _, _, groups in plain_step:  # without sorting: one group per micro-batch
                assert len(set(groups)) == 1
            unsorted += any(not _descending(lengths) for lengths, _, _ in plain_step)
        elif window == "group":
            # each group's rows together, longest first; the blocks hold the same groups as without sorting
            for seen_step, check in ((sorted_step, True), (plain_step, False)):
                flat = [(g, n) for lengths, _, groups in seen_step for g, n in zip(groups, lengths)]
                by_group = {}
                for position, (g, n) in enumerate(flat):
                    by_group.setdefault(g, []).append((position, n))
                for members in by_group.values():
                    positions = [position for position, _ in members]
                    assert positions == list(range(positions[0], positions[0] + len(positions)))  # together
                    if check:
                        assert _descending([n for _, n in members])
                    else:
                        unsorted += not _descending([n for _, n in members])
        else:
            for start in range(0, accumulation, window):
                for seen_step, check in ((sorted_step, True), (plain_step, False)):
                    values = [n for lengths, _, _ in seen_step[start : start + window] for n in lengths]
                    if check:
                        assert _descending(values)
                    else:
                        unsorted += not _descending(values)
                sorted_rows_in = sorted(r for _, rows, _ in sorted_step[start : start + window] for r in rows)
                plain_rows_in = sorted(r for _, rows, _ in plain_step[start : start + window] for r in rows)
                assert sorted_rows_in == plain_rows_in  # a window keeps its rows
    assert unsorted > 0, "without sorting every window was sorted already: the test cannot tell"
    if window == "merged":
        assert mixed > 0, "no micro-batch held rows of two groups: the test cannot tell"
        assert len(sorted_.block_ends[0]) < accumulation or len(sorted_.block_ends[accumulation]) < accumulation
    if extra.get("dynamic_sampling"):
        rounds = [row.get("dynamic_sampling/rounds") for row in sorted_rows]
        assert rounds == [row.get("dynamic_sampling/rounds") for row in plain_rows]
        assert max(rounds) > 1, f"rounds {rounds}: no batch was assembled from several rounds, the test cannot tell"
    for off, on in zip(plain_rows, sorted_rows, strict=True):
        for key in (
            "reward",
            "loss",
            "grad_norm",
            "egpo/entropy_mean",
            "egpo/weight_correct",
            "egpo/weight_incorrect",
        ):
            if key in off:
                assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    for name, weight in plain_weights.items():
        torch.testing.assert_close(
            sorted_weights[name], weight, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def _check_merged_blocks(step, ends, per_device) -> int:
    """One generation batch's micro-batches under merged blocks: each block (up to each of ``ends``) holds whole
    groups of 4, its rows sorted longest first across its micro-batches. Returns how many micro-batches hold rows of
    more than one group."""
    assert ends is not None and ends[-1] == len(step), ends
    start = 0
    for end in ends:
        block = step[start:end]
        lengths = [n for lengths, _, _ in block for n in lengths]
        assert _descending(lengths), (ends, lengths)
        groups = [g for _, _, groups in block for g in groups]
        assert all(groups.count(g) == 4 for g in set(groups)), groups
        start = end
    return sum(len(set(groups)) > 1 for _, _, groups in step)


def test_merged_blocks_cut_padding_within_their_budget():
    """Groups join the block before them only where that cuts the padded tokens (summed over the processes), and no
    process's block then computes more than the budget."""
    from egpo_trl.fused import merged_blocks, padded_tokens

    assert padded_tokens(torch.tensor([1, 5, 2, 4]), 2) == 5 * 2 + 2 * 2
    same = torch.full((1, 8), 7)
    assert merged_blocks(same, 2, 2, 10**6) == [2, 2, 2, 2]  # nothing to save: units as they are
    # units (9, 1) (8, 2) (7, 3) (6, 4), 18, 16, 14 and 12 tokens: the first two together 9 * 2 + 2 * 2 = 22 tokens;
    # the third saves nothing on them (36 tokens either way), so it starts a block, which the fourth joins (22)
    spread = torch.tensor([[9, 1, 8, 2, 7, 3, 6, 4]])
    assert merged_blocks(spread, 2, 2, 10**6) == [4, 4]
    assert merged_blocks(spread, 2, 2, 22) == [4, 4]
    assert merged_blocks(spread, 2, 2, 21) == [2, 2, 2, 2]  # within the budget only apart
    # two processes, one whose rows are all alike (no saving), the other's as above: the sum decides (50 < 62 tokens
    # for the first two units), the largest block the budget (4 rows of 7: 28 tokens), the same blocks on both
    both = torch.stack([same[0], spread[0]])
    assert merged_blocks(both, 2, 2, 10**6) == [4, 4]
    assert merged_blocks(both, 2, 2, 27) == [2, 2, 2, 2]
    assert merged_blocks(spread[0], 2, 2, 10**6) == [4, 4]  # one process's lengths as a vector
    with pytest.raises(ValueError, match="not made of units of 3 rows"):
        merged_blocks(spread, 3, 1, 10)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(beta=0.04), "keeps TRL's full width"),
        (dict(egpo_shift_prompt_padding=False), "keeps TRL's full width"),
        (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1), "cannot change which rows"),
        (dict(egpo_entropy_logps="loss_forward", per_device_train_batch_size=4), "cannot change which rows"),
        (dict(per_device_train_batch_size=1, gradient_accumulation_steps=8), "cannot change which rows"),
        ({"unshiftable": True}, "rows cannot be shifted past their prompt padding"),
    ],
)
def test_length_sorting_that_saves_nothing_says_so_and_leaves_the_order(
    tmp_path, tiny_model_dir, overrides, reason, caplog, monkeypatch
):
    overrides = dict(overrides)
    if overrides.pop("unshiftable", False):  # a model type the shifted layout does not serve
        monkeypatch.setattr("egpo_trl.old_logps.REALIGN_MODEL_TYPES", frozenset())
    args = config(tmp_path, egpo_length_sorted_micro_batches=True, **{"gradient_accumulation_steps": 2, **overrides})
    with caplog.at_level("WARNING"):
        trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer._egpo_sort_window is None
    assert any(reason in record.getMessage() for record in caplog.records), caplog.text


def test_length_sorting_checks_the_arguments_again_when_the_trainer_starts(tmp_path, tiny_model_dir):
    args = config(
        tmp_path, egpo_length_sorted_micro_batches=True, per_device_train_batch_size=2, gradient_accumulation_steps=2
    )
    args.loss_type = "bnpo"  # changed after the arguments were checked
    with pytest.raises(ValueError, match="'bnpo' averages over each micro-batch's tokens"):
        EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())


def test_shuffle_then_restores_trl_shuffle_after_an_error():
    from trl.trainer import grpo_trainer

    from egpo_trl.fused import shuffle_then

    original = grpo_trainer.shuffle_sequence_dict

    def prepare(batch):
        assert grpo_trainer.shuffle_sequence_dict is not original  # patched while TRL prepares
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        shuffle_then(prepare, {}, [lambda batch: None])
    assert grpo_trainer.shuffle_sequence_dict is original


def test_groups_sorted_by_length_stay_together():
    """loss_forward: grouped first, then each group's rows sorted; every group's rows stay together."""
    from egpo_trl.fused import group_first_order

    groups = torch.tensor([3, 1, 3, 0, 1, 0, 2, 2])
    widths = torch.tensor([2, 4, 1, 3, 1, 4, 2, 3])
    batch = {
        GROUP_KEY: groups,
        ROW_KEY: torch.arange(8),
        "completion_mask": (torch.arange(4)[None, :] < widths[:, None]).long(),
    }
    grouped = reorder_rows(batch, group_first_order(batch[GROUP_KEY]))
    assert grouped[GROUP_KEY].tolist() == [3, 3, 1, 1, 0, 0, 2, 2]
    result = reorder_rows(grouped, length_sorted_order(grouped, window=2))  # groups of 2
    assert result[GROUP_KEY].tolist() == [3, 3, 1, 1, 0, 0, 2, 2]
    assert completion_widths(result["completion_mask"]).tolist() == [2, 1, 4, 1, 4, 3, 3, 2]
