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
    """Keeps, per prepared micro-batch, its rows' lengths (prompt plus completion) and their prompt and completion
    ids (to compare the rows each optimizer step trained on)."""

    def _prepare_inputs(self, generation_batch):
        prepared = super()._prepare_inputs(generation_batch)
        if self.model.training:
            lengths = completion_widths(prepared["completion_mask"]) + prepared["prompt_mask"].sum(dim=1)
            rows = [
                (tuple(p[m.bool()].tolist()), tuple(c[: int(w)].tolist()))
                for p, m, c, w in zip(
                    prepared["prompt_ids"],
                    prepared["prompt_mask"],
                    prepared["completion_ids"],
                    completion_widths(prepared["completion_mask"]),
                )
            ]
            self.seen.append((lengths.tolist(), rows))
        return prepared


def _train(tmp_path, model_dir, **overrides):
    settings = dict(max_steps=2, bf16=False, model_init_kwargs={"attn_implementation": "eager"})
    args = config(tmp_path, **{**settings, **overrides})
    trainer = RecordingTrainer(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.seen = []
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    return trainer, rows, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize(
    "per_device, accumulation, extra, window",
    [
        (2, 4, {}, 4),  # policy: the optimizer step's 4 micro-batches sorted together
        (2, 4, {"egpo_entropy_logps": "loss_forward"}, 2),  # loss_forward: each block of 2 (one group) on its own
        (4, 2, {"egpo_entropy_logps": "loss_forward", "temperature": 0.05}, 1),  # one group per micro-batch: no change
    ],
)
def test_length_sorted_micro_batches_train_as_unsorted(
    tmp_path, tiny_model_dir, per_device, accumulation, extra, window
):
    overrides = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, **extra)
    plain, plain_rows, plain_weights = _train(tmp_path / "plain", tiny_model_dir, **overrides)
    sorted_, sorted_rows, sorted_weights = _train(
        tmp_path / "sorted", tiny_model_dir, egpo_length_sorted_micro_batches=True, **overrides
    )
    assert len(plain.seen) == len(sorted_.seen) == 2 * accumulation
    lengths = [length for seen in sorted_.seen for length in seen[0]]
    assert len(set(lengths)) > 1, "the tiny model's completions all had one length: the test cannot tell"

    def window_rows(seen, start):
        return sorted(row for _, rows in seen[start : start + window] for row in rows)

    def window_lengths(seen, start):
        return [length for lengths, _ in seen[start : start + window] for length in lengths]

    unsorted_windows = 0
    for step in range(2):
        plain_step = plain.seen[step * accumulation : (step + 1) * accumulation]
        sorted_step = sorted_.seen[step * accumulation : (step + 1) * accumulation]
        for start in range(0, accumulation, window):
            # each window of micro-batches trains on the same rows as without sorting, longest first
            assert window_rows(sorted_step, start) == window_rows(plain_step, start)
            assert window_lengths(sorted_step, start) == sorted(window_lengths(sorted_step, start), reverse=True)
            plain_lengths = window_lengths(plain_step, start)
            unsorted_windows += plain_lengths != sorted(plain_lengths, reverse=True)
    assert unsorted_windows > 0, "without sorting every window was sorted already: the test cannot tell"
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


def test_a_block_sorted_by_length_keeps_its_whole_groups():
    """loss_forward's blocks: grouped first, then sorted inside each block, every block still holds whole groups."""
    groups = torch.tensor([3, 1, 3, 0, 1, 0, 2, 2])
    widths = torch.tensor([2, 4, 1, 3, 1, 4, 2, 3])
    batch = {
        GROUP_KEY: groups,
        ROW_KEY: torch.arange(8),
        "completion_mask": (torch.arange(4)[None, :] < widths[:, None]).long(),
    }
    from egpo_trl.fused import group_first_order

    grouped = reorder_rows(batch, group_first_order(batch[GROUP_KEY]))
    blocks = reorder_rows(grouped, length_sorted_order(grouped, window=4))  # blocks of two groups of 2
    assert blocks[GROUP_KEY][:4].sort().values.tolist() == [1, 1, 3, 3]
    assert blocks[GROUP_KEY][4:].sort().values.tolist() == [0, 0, 2, 2]
    assert completion_widths(blocks["completion_mask"]).tolist() == [4, 2, 1, 1, 4, 3, 3, 2]
