"""The GPU memory check of the first generation (``egpo_trl/gpu_memory.py``): the optimizer state still to come, and
the verdict on the readings. The check inside a training run with a colocated vLLM engine is in test_vllm_cpu.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config

from egpo_trl import EGPOTrainer
from egpo_trl.gpu_memory import (
    GIB,
    GenerationMemoryError,
    generation_memory_verdict,
    pending_optimizer_state_bytes,
)
from egpo_trl.trainer import vllm_out_of_memory_message


def _step(optimizer, parameters):
    sum(p.float().sum() for p in parameters).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("amsgrad, moments", [(False, 2), (True, 3)])
def test_adamw_state_is_pending_until_its_first_step(amsgrad, moments):
    parameters = [torch.nn.Parameter(torch.zeros(10, 3)), torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, amsgrad=amsgrad)
    assert pending_optimizer_state_bytes(optimizer, "cpu") == (moments * (30 * 4 + 7 * 2), 37)
    assert pending_optimizer_state_bytes(optimizer, "cuda") == (0, 0)  # state follows its parameter's device
    _step(optimizer, parameters)
    assert pending_optimizer_state_bytes(optimizer, "cpu") == (0, 0)
    # the state the step created is what was announced
    created = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    assert created == moments * (30 * 4 + 7 * 2)


class ZeroStage3Like:
    """DeepSpeed ZeRO-3's layout (deepspeed/runtime/zero/stage3.py): the fp32 partitions on the wrapper itself, the
    inner optimizer's ``param_groups`` emptied except during its step, its state keyed by the partitions."""

    def __init__(self, partitions):
        self.fp32_partitioned_groups_flat = partitions
        self.optimizer = torch.optim.AdamW(partitions, lr=1e-3)
        for group in self.optimizer.param_groups:
            group["params"] = []

    def step(self):
        for partition in self.fp32_partitioned_groups_flat:
            self.optimizer.param_groups[0]["params"] = [partition]
            self.optimizer.step()
        self.optimizer.param_groups[0]["params"] = []


def test_zero3s_partitions_are_found_on_its_wrapper():
    partitions = [torch.nn.Parameter(torch.zeros(12)), torch.nn.Parameter(torch.zeros(4))]
    zero3 = ZeroStage3Like(partitions)
    wrapper = type("AcceleratedLike", (), {"optimizer": zero3})()  # accelerate's wrapper holds DeepSpeed's
    assert pending_optimizer_state_bytes(wrapper, "cpu") == (2 * 16 * 4, 16)
    for partition in partitions:
        partition.grad = torch.ones_like(partition)
    zero3.step()
    assert pending_optimizer_state_bytes(wrapper, "cpu") == (0, 0)


def test_optimizers_whose_state_is_not_known_are_left_alone():
    parameters = [torch.nn.Parameter(torch.zeros(5))]
    assert pending_optimizer_state_bytes(torch.optim.SGD(parameters, lr=0.1, momentum=0.9), "cpu") is None
    assert pending_optimizer_state_bytes(None) is None


# Measured: the R1-Distill-7B recipe at share 0.65 on 4 x H100 under ZeRO-3 had 73.7 GiB of 79.6 in use during its
# first generation; AdamW's moments of 7.6B parameters over 4 processes are 14.2 GiB a GPU. CUDA reports 79.2 GiB for
# the card (the driver 79.6).
R1_7B_FOUR_GPUS = (73.7 * GIB, 79.2 * GIB, 14.2 * GIB, 1.9e9)


def test_a_share_that_will_not_fit_after_the_first_step_is_stopped_with_the_share_that_would():
    fits = (60.0 * GIB, 79.2 * GIB, 7.1 * GIB, 0.95e9)
    line, error = generation_memory_verdict([fits, R1_7B_FOUR_GPUS, fits], 0.65, True, generated=True)
    assert "process 1" in line and "after it" in line and "73.7 of 79.2 GiB" in line and "about 87.9 GiB" in line
    expected = math.floor((0.65 - (87.9 - 79.2 + 1) / 79.2) * 100) / 100
    assert expected == 0.52
    assert "Lower vllm_gpu_memory_utilization from 0.65 to at most 0.52" in error
    assert "1.90B parameters" in error and "add 14.2 GiB" in error and "Stopped after the first generation" in error
    _, error = generation_memory_verdict([R1_7B_FOUR_GPUS], 0.65, True, generated=False)
    assert "Before the first generation" in error and "Stopped before the first generation" in error
    # a run without a later generation (one step) is let through, with the line
    line, error = generation_memory_verdict([R1_7B_FOUR_GPUS], 0.65, False, generated=True)
    assert error is None and "87.9 GiB" in line
    # where it fits, only the line
    line, error = generation_memory_verdict([fits, fits], 0.65, True, generated=True)
    assert error is None and "about 67.1 GiB" in line
    # nothing left for vLLM: the other ways out
    _, error = generation_memory_verdict([(79.0 * GIB, 79.2 * GIB, 30 * GIB, 4e9)], 0.3, True, generated=True)
    assert "vllm_mode: server" in error and "Lower" not in error


def test_later_generations_must_leave_a_margin_of_the_card_free():
    # Measured at the Qwen2.5-Math-1.5B shape (one process, ZeRO-2): the estimate came out 0.13 GiB below the second
    # generation's peak with 4-row micro-batches and 0.75 GiB below with 16-row ones, so a sum within 1 GiB of the
    # card is not taken as fitting.
    card = 79.2 * GIB
    just_under = (card - 13.2 * GIB - 0.3 * GIB, card, 13.2 * GIB, 1.78e9)
    line, error = generation_memory_verdict([just_under], 0.6, True, generated=False)
    assert error is not None and "Lower vllm_gpu_memory_utilization from 0.6 to at most 0.59" in error, error
    assert (
        error.startswith("vLLM's share of each GPU leaves too little room") and "within 1.0 GiB of the card" in error
    )
    assert generation_memory_verdict([(card - 13.2 * GIB - 0.8 * GIB, card, 13.2 * GIB, 1.78e9)], 0.6, True, False)[1]
    clear = (card - 13.2 * GIB - 1.1 * GIB, card, 13.2 * GIB, 1.78e9)
    assert generation_memory_verdict([clear], 0.6, True, generated=False)[1] is None


def test_the_checks_error_is_not_rewrapped_as_a_vllm_out_of_memory_error(tmp_path):
    args = config(tmp_path, use_vllm=True, vllm_mode="colocate")
    error = GenerationMemoryError("... would need about 88 GiB and run out of memory a whole step from now ...")
    assert vllm_out_of_memory_message(args, 4, error) is None
    assert vllm_out_of_memory_message(args, 4, RuntimeError("CUDA error: out of memory")) is not None


@pytest.mark.slow
def test_the_trainer_reads_its_optimizer_and_decides_on_the_gathered_readings(tmp_path, tiny_model_dir, monkeypatch):
    """The trainer's check on the real trainer and optimizer (one process, CPU: the device reading is given)."""
    trainer = EGPOTrainer(
        tiny_model_dir, parity_reward, config(tmp_path, max_steps=3), train_dataset=make_prompt_dataset()
    )
    trainer.create_optimizer()
    trainer.state.max_steps = 3
    pending, parameters = pending_optimizer_state_bytes(trainer.optimizer, "cpu")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert parameters == trainable and pending == 2 * 4 * trainable  # float32 weights, two moments
    readings = []
    monkeypatch.setattr("egpo_trl.trainer.device_memory", lambda device: readings.append(device) or (free, 10 * GIB))
    free = pending + GIB  # room for the moments
    trainer._egpo_check_generation_memory(generated=False)
    trainer._egpo_check_generation_memory(generated=True)
    free = pending // 2  # not enough
    with pytest.raises(GenerationMemoryError, match=r"from 0\.3 to at most 0\.19"):
        trainer._egpo_check_generation_memory(generated=True)
    trainer.state.max_steps = 1  # no later generation
    trainer._egpo_check_generation_memory(generated=True)
    assert len(readings) == 4
    # the fullest GPU's figures go to the first step's metrics (one per check made after generating that passed)
    metrics = trainer._metrics["train"]
    assert metrics["egpo/gpu_memory_first_generation_gib"][0] == pytest.approx(10 - (pending + GIB) / GIB)
    assert metrics["egpo/gpu_memory_later_generations_gib"][0] == pytest.approx(9.0)
    metrics.clear()
    # after training, through accelerate's wrapper: the moments exist, nothing is pending
    trainer.train()
    assert not isinstance(trainer.optimizer, torch.optim.AdamW)
    assert pending_optimizer_state_bytes(trainer.optimizer, "cpu") == (0, 0)


@pytest.mark.slow
def test_the_check_says_when_it_stands_aside_and_its_figures_survive_dynamic_samplings_rounds(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    trainer = EGPOTrainer(
        tiny_model_dir, parity_reward, config(tmp_path, max_steps=3), train_dataset=make_prompt_dataset()
    )
    trainer.state.max_steps = 3
    monkeypatch.setattr("egpo_trl.trainer.device_memory", lambda device: (GIB, 10 * GIB))
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)  # state this check does not know
    with caplog.at_level("WARNING", logger="egpo_trl.trainer"):
        trainer._egpo_check_generation_memory(generated=False)
        trainer._egpo_check_generation_memory(generated=True)
    assert [r.getMessage().count("stands aside: the optimizer (SGD)") for r in caplog.records] == [1]
    assert "egpo/gpu_memory_first_generation_gib" not in trainer._metrics["train"]

    # Dynamic sampling keeps the metrics of the rounds whose groups fill the batch; the memory check's figures,
    # logged in the first round, are the run's, whichever rounds are kept.
    metrics = trainer._metrics["train"]
    metrics["egpo/gpu_memory_first_generation_gib"].append(9.0)
    metrics["egpo/gpu_memory_later_generations_gib"].append(9.5)
    metrics["completions/mean_length"].append(7.0)
    marks = [{}, {name: len(values) for name, values in metrics.items()}]
    metrics["completions/mean_length"].append(8.0)  # the second round's
    rewards = torch.tensor([[1.0], [-1.0]] * (trainer.num_generations // 2))
    trainer._keep_batch_metrics(marks, [1], {}, rewards, trainer.num_generations)  # only the second round is used
    assert metrics["egpo/gpu_memory_first_generation_gib"] == [9.0]
    assert metrics["egpo/gpu_memory_later_generations_gib"] == [9.5]
    assert metrics["completions/mean_length"] == [8.0]
