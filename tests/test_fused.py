"""egpo_entropy_logps="loss_forward": pi_old's log-probs from the loss's own forwards (egpo_trl/fused.py) train the
same as the no-grad pass ("policy"), on the tiny Qwen2 model with TRL's real GRPOTrainer machinery."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward, train_two_steps
from conftest import trainer_config as config

from egpo_trl import EGPOTrainer
from egpo_trl.fused import (
    block_size,
    group_first_order,
    loss_forward_problems,
    reentrant_checkpointing,
    reorder_rows,
)


def test_block_size_holds_whole_groups():
    assert [block_size(p, 4) for p in (1, 2, 3, 4, 8)] == [4, 2, 4, 1, 1]
    assert block_size(4, 16) == 4 and block_size(2, 16) == 8 and block_size(6, 4) == 2


def test_group_first_order_keeps_groups_in_order_of_first_appearance():
    groups = torch.tensor([2, 0, 2, 1, 0, 1])
    order = group_first_order(groups)
    assert order.tolist() == [0, 2, 1, 4, 3, 5]
    batch = {"g": groups, "names": list("abcdef"), "scalar": torch.tensor(3), "none": None}
    reordered = reorder_rows(batch, order)
    assert reordered["g"].tolist() == [2, 2, 0, 0, 1, 1] and reordered["names"] == list("acbedf")
    assert reordered["scalar"].item() == 3 and reordered["none"] is None


def _assert_same_rows(policy: list[dict], fused: list[dict], keys: tuple[str, ...]) -> None:
    """Two optimizer steps' logged rows of both paths: each of ``keys`` the policy path logs, the same to float32
    rounding."""
    assert len(policy) == len(fused) == 2
    for off, on in zip(policy, fused, strict=True):
        for key in keys:
            assert (key in on) == (key in off), key  # the same metrics logged
            if key in off:
                assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key


#: Guided Error Correction's texts short enough for the tiny model's one-token-per-character vocabulary and its
#: 12-token completions (rewritten rows: continued after the cue, or given the answer).
SHORT_GEC = {"edge_gec_reflection_cue": " Wait.", "edge_gec_answer_template": " \\boxed{{answer}}"}


@pytest.mark.parametrize(
    "per_device, accumulation, extra",
    [
        (2, 4, {}),  # blocks of 2 micro-batches
        (1, 8, {}),  # one row per micro-batch, a group over 4 of them (the R1-Distill recipes' layout: 16 of 1 row)
        (8, 1, {}),  # 2 groups in one micro-batch
        (4, 2, {}),  # one group per micro-batch
        (2, 4, {"dynamic_sampling": True, "scale_rewards": "batch"}),  # reassembled batches, batch-std advantages
        (2, 4, {"egpo_entropy_scope": "answer", "egpo_renorm": "after_clamp"}),  # a scope mask, C5
        (2, 4, {"advantage_estimator": "edge_grpo"}),  # EDGE-GRPO: weights from the forwards' Shannon entropies
        (2, 4, {"advantage_estimator": "edge_grpo", "edge_gec": True, "edge_gec_max_new_tokens": 4, **SHORT_GEC}),
        # A low temperature spreads EDGE-GRPO's weights (about 1 at temperature 1 on random weights), so that
        # entropies on the wrong rows would show; the proxy's metrics off, as the pass leaves them.
        (
            2,
            4,
            {
                "advantage_estimator": "edge_grpo",
                "edge_gec": True,
                "edge_gec_max_new_tokens": 4,
                **SHORT_GEC,
                "temperature": 0.05,
                "egpo_entropy_metrics": False,
            },
        ),
    ],
)
def test_loss_forward_trains_as_the_no_grad_pass(tmp_path, tiny_model_dir, per_device, accumulation, extra):
    """Two optimizer steps (float32, eager attention): the same rewards, entropies, weights, losses and final weights
    as with the no-grad pass, to float32 rounding; no pass of its own."""
    overrides = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, **extra)
    _, policy, policy_weights = train_two_steps(
        tmp_path / "policy", tiny_model_dir, egpo_entropy_logps="policy", **overrides
    )
    trainer, fused, fused_weights = train_two_steps(
        tmp_path / "fused", tiny_model_dir, egpo_entropy_logps="loss_forward", **overrides
    )
    _assert_same_rows(
        policy,
        fused,
        (
            "reward",
            "loss",
            "grad_norm",
            "egpo/entropy_mean",
            "egpo/entropy_correct",
            "egpo/entropy_incorrect",
            "egpo/weight_correct",
            "egpo/weight_incorrect",
            "egpo/frac_mixed",
            "egpo/frac_all_incorrect",
            "egpo/token_entropy_mean",  # EDGE-GRPO's Shannon entropies
        ),
    )
    for off, on in zip(policy, fused, strict=True):
        assert off["egpo/entropy_extra_pass"] == 1.0 and on["egpo/entropy_extra_pass"] == 0.0
        assert on["egpo/entropy_source"] == 5.0
        assert "timing/old_logps_s" not in on or on["timing/old_logps_s"] == 0.0
    # Adam divides each gradient by its running RMS: an element whose gradient is near 0 turns a rounding difference
    # of the summation order into a visible one (up to 7e-6 after two steps at lr 1e-3, on 1 of 2,048 elements).
    for name, weight in policy_weights.items():
        torch.testing.assert_close(
            fused_weights[name], weight, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the last batch: EGPO's weights filled in by the loss's forwards
    result = trainer.egpo_last_batch["result"]
    if extra.get("egpo_entropy_metrics", True):
        assert torch.isfinite(trainer.egpo_last_batch["entropies"]).all()
    if extra.get("temperature"):
        assert float(result.weights.max() - result.weights.min()) > 0.02, result.weights  # the check can tell
    torch.testing.assert_close(result.advantages, result.weights * result.base_advantages)
    assert trainer._fused_batch is None and trainer._fused_pending == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(advantage_estimator="grpo"), "serves EGPO's and EDGE-GRPO's estimators only"),
        (dict(advantage_estimator="edge_grpo", edge_grpo_entropy_normalization="batch"), "whole batch's mean"),
        (dict(num_iterations=2), r"x num_iterations \(2\) does not divide gradient_accumulation_steps"),
        (  # divides, but a second pass over the batch finds its rows' log-probs gone
            dict(gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=2),
            r"num_iterations > 1 has TRL compute",
        ),
        (dict(loss_type="bnpo"), "'bnpo' averages over each micro-batch's tokens"),
        (dict(top_entropy_quantile=0.5), "threshold within each micro-batch"),
        (dict(entropy_coef=0.01), "entropy bonus"),
        (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha adds noise"),  # switched on by Trainer.train only
        (  # generation and optimisation misaligned: TRL computes the old log-probs
            dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4),
            r"steps_per_generation \(4\) x num_iterations \(1\) does not divide gradient_accumulation_steps \(2\)",
        ),
    ],
)
def test_loss_forward_refuses_in_the_config_what_it_cannot_serve(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        config(tmp_path, egpo_entropy_logps="loss_forward", **overrides)
    assert "Use egpo_entropy_logps='policy'" in str(error.value)


def test_loss_forward_sees_deepspeed_and_fsdp_in_the_arguments_or_the_launcher(monkeypatch):
    """Read without building a DeepSpeed configuration (which needs DeepSpeed installed)."""
    from types import SimpleNamespace

    from egpo_trl.config import _distributed_engine

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert _distributed_engine(SimpleNamespace(deepspeed=None, fsdp=None)) is None
    assert _distributed_engine(SimpleNamespace(deepspeed="zero2.json", fsdp=None)) == "DeepSpeed"
    assert _distributed_engine(SimpleNamespace(deepspeed=None, fsdp="full_shard")) == "FSDP"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as `accelerate launch` with a DeepSpeed config sets it
    assert _distributed_engine(SimpleNamespace(deepspeed=None, fsdp=None)) == "DeepSpeed"


def test_loss_forward_checks_the_arguments_again_when_the_trainer_starts(tmp_path, tiny_model_dir):
    args = config(tmp_path, egpo_entropy_logps="loss_forward")
    args.loss_type = "bnpo"  # changed after the config was built
    with pytest.raises(ValueError, match="'bnpo' averages"):
        EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())


def test_reentrant_checkpointing_reads_as_the_trainer_and_pytorch_do():
    assert not reentrant_checkpointing(None) and not reentrant_checkpointing({})  # the Trainer passes none: False
    assert reentrant_checkpointing({"preserve_rng_state": True})  # PyTorch's default when not given: reentrant
    assert reentrant_checkpointing({"use_reentrant": None}) and reentrant_checkpointing({"use_reentrant": True})
    assert not reentrant_checkpointing({"use_reentrant": False})


def _loss_forward_arguments(**overrides):
    """The arguments ``EGPOConfig._validate_loss_forward`` reads, for settings a one-process test cannot build (several
    processes): a recipe-like run that it accepts, with ``overrides``."""
    from types import SimpleNamespace

    settings = dict(
        advantage_estimator="egpo", num_iterations=1, use_vllm=True, vllm_importance_sampling_correction=False,
        loss_type="dapo", top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False,
        steps_per_generation=32, gradient_accumulation_steps=32, per_device_train_batch_size=4, num_generations=16,
        gradient_checkpointing=True, gradient_checkpointing_kwargs=None, world_size=2, deepspeed=None, fsdp=None,
    )  # fmt: skip
    from egpo_trl import EGPOConfig

    arguments = SimpleNamespace(**{**settings, **overrides})
    arguments._loss_forward_launch = lambda: EGPOConfig._loss_forward_launch(arguments)
    return arguments


def test_loss_forward_problems_name_each_setting(monkeypatch):
    from egpo_trl import EGPOConfig

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)

    def refusal(problems=None, **overrides) -> str:
        with pytest.raises(ValueError) as error:
            EGPOConfig._validate_loss_forward(_loss_forward_arguments(**overrides), problems)
        return str(error.value)

    EGPOConfig._validate_loss_forward(_loss_forward_arguments())  # accepted
    # 2 processes x 4 rows, groups of 16
    spans = refusal(per_device_train_batch_size=4, steps_per_generation=1, gradient_accumulation_steps=1)
    assert "spans processes" in spans and "(16)" in spans
    reentrant = refusal(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert "use_reentrant: false" in reentrant
    # one process: several forwards before one backward work with reentrant checkpointing
    EGPOConfig._validate_loss_forward(
        _loss_forward_arguments(gradient_checkpointing_kwargs={"use_reentrant": True}, world_size=1)
    )
    # DeepSpeed ZeRO-2/3 (checked on GPUs by benchmarks/loss_forward_check.py), but not with reentrant checkpointing,
    # even in one process: its gradient hooks take one report per weight and backward; FSDP is refused
    EGPOConfig._validate_loss_forward(_loss_forward_arguments(deepspeed="zero2.json"))
    deepspeed_reentrant = refusal(
        deepspeed="zero2.json", world_size=1, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    assert "use_reentrant: false" in deepspeed_reentrant and "DeepSpeed" in deepspeed_reentrant
    assert "not been checked under FSDP" in refusal(fsdp="full_shard")
    assert "updates the weights during each backward" in refusal(optim="adalomo")
    from types import SimpleNamespace

    assert "context parallelism" in refusal(parallelism_config=SimpleNamespace(cp_size=2))
    EGPOConfig._validate_loss_forward(_loss_forward_arguments(parallelism_config=SimpleNamespace(cp_size=1)))
    assert loss_forward_problems(False) == []
    (dropout,) = loss_forward_problems(True)
    assert "dropout" in dropout
    (engine,) = loss_forward_problems(False, engine="FSDP")
    assert "FSDP" in engine
    (router,) = loss_forward_problems(False, router_loss=True)
    assert "router" in router
    assert len(loss_forward_problems(True, "FSDP", True, True)) == 4
    # the trainer's problems come in the same error, after the arguments'
    both = refusal([dropout], loss_type="bnpo")
    assert both.index("'bnpo'") < both.index("dropout") and "Use egpo_entropy_logps='policy'" in both


def test_a_new_generation_batch_drops_what_a_stopped_block_kept(tmp_path, tiny_model_dir):
    """A run stopped inside a block (an exception in a step) and trained again in the same process: the next
    generation batch starts its blocks afresh."""
    args = config(
        tmp_path,
        max_steps=1,
        egpo_entropy_logps="loss_forward",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
    )
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer._fused_pending = [{"stale": True}]
    trainer._fused_cache = [("stale",)]
    trainer.train()
    assert trainer._fused_pending == [] and trainer._fused_cache == [] and trainer._fused_batch is None
    assert trainer.state.log_history[0]["egpo/entropy_source"] == 5.0


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_loss_forward_trains_as_the_no_grad_pass_over_two_processes(tmp_path, tiny_model_dir, checkpointing):
    """DDP over 2 CPU processes (gloo): the micro-batches of a block run no backward of their own, so DDP's gradient
    synchronisation still happens once, on the generation batch's last micro-batch; with gradient checkpointing,
    a block keeps several checkpointed forwards before its backward. Same metrics and weights as the no-grad pass."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "ddp_fused.py"
    results = {}
    for logps in ("policy", "loss_forward"):
        out = tmp_path / logps
        out.mkdir()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_port", str(29600 + os.getpid() % 1000), str(script), tiny_model_dir, str(out), logps]
        command += ["1" if checkpointing else "0"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        results[logps] = (json.loads((out / "log.json").read_text()), torch.load(out / "weights.pt"))
    (policy_rows, policy_weights), (fused_rows, fused_weights) = results["policy"], results["loss_forward"]
    _assert_same_rows(
        policy_rows,
        fused_rows,
        ("reward", "loss", "grad_norm", "egpo/entropy_mean", "egpo/weight_correct", "egpo/weight_incorrect"),
    )
    for on in fused_rows:
        assert on["egpo/entropy_extra_pass"] == 0.0
    for name, weight in policy_weights.items():
        torch.testing.assert_close(fused_weights[name], weight, rtol=1e-4, atol=1e-6)
    # process 0's backward calls over 2 steps of 4 micro-batches: one per block of 2 under DDP
    assert json.loads((tmp_path / "policy" / "backwards.json").read_text()) == 8
    assert json.loads((tmp_path / "loss_forward" / "backwards.json").read_text()) == 4


def test_loss_forward_backpropagates_each_micro_batch_as_its_loss_is_computed(tmp_path, tiny_model_dir):
    """One process, blocks of 2 micro-batches: each micro-batch's gradient reaches the parameters by a backward of its
    own, as without blocks (one backward of the block's sum would hold every parameter's partial gradient until the
    block's first micro-batch reaches it, a whole gradient beside DeepSpeed's shards), and only the last one's waits
    for the trainer's step; the logged loss still counts every micro-batch (the same as the pass's run)."""
    overrides = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    args = config(tmp_path / "fused", max_steps=2, egpo_entropy_logps="loss_forward", bf16=False, **overrides)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer._fused_block == 2
    parameter = trainer.model.get_input_embeddings().weight
    arrivals = []  # the optimizer step during which each gradient arrived
    parameter.register_post_accumulate_grad_hook(lambda _: arrivals.append(trainer.state.global_step))
    events = []  # "loss" when TRL computes a micro-batch's loss, "backward" for each backward call
    backward, compute = trainer.accelerator.backward, trainer._compute_loss
    trainer.accelerator.backward = lambda loss, **kwargs: events.append("backward") or backward(loss, **kwargs)
    trainer._compute_loss = lambda *args, **kwargs: events.append("loss") or compute(*args, **kwargs)
    trainer.train()
    assert arrivals == [0, 0, 0, 0, 1, 1, 1, 1]
    # each backward right after its loss: no block keeps two micro-batches' losses (and graphs) waiting
    assert events == ["loss", "backward"] * 8, events
    _, policy, _ = train_two_steps(tmp_path / "policy", tiny_model_dir, egpo_entropy_logps="policy", **overrides)
    fused = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["loss"] for row in fused] == pytest.approx([row["loss"] for row in policy], rel=1e-4, abs=1e-6)


def test_trl_scales_its_loss_for_accumulation_itself():
    """A block's earlier micro-batches repeat Trainer.training_step's backward (fused.py, _fused_backward_now), which
    scales the loss by the accumulation steps unless ``loss_is_scaled_for_ga``: TRL 1.16's loss is scaled already."""
    from trl import GRPOTrainer

    assert GRPOTrainer.loss_is_scaled_for_ga is True


@pytest.mark.slow
def test_loss_forward_trains_as_the_no_grad_pass_under_deepspeed_zero(tmp_path):
    """DeepSpeed ZeRO-2 and ZeRO-3 over 2 CPU processes (benchmarks/loss_forward_check.py): the same metrics and
    weights as the no-grad pass, with a backward per micro-batch. ZeRO-3 counts a micro-step at the next forward, so
    without the block closing each micro-step itself the second backward would overwrite the first's gradients
    (a grad norm of 0.35 against the pass's 0.46 on this check's first step)."""
    pytest.importorskip("deepspeed")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=f"{root}:{os.environ.get('PYTHONPATH', '')}")

    def check(name: str, port: int, *options: str) -> list[dict]:
        """benchmarks/loss_forward_check.py with ``options``, with gradient checkpointing: its JSON rows."""
        done = subprocess.run(
            [sys.executable, "benchmarks/loss_forward_check.py", "--out", str(tmp_path / name), "--checkpointing", "1",
             "--port", str(port + os.getpid() % 100), "--json", str(tmp_path / f"{name}.json"), *options],
            cwd=root, env=env, capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads((tmp_path / f"{name}.json").read_text())

    rows = check("runs", 29800, "--engines", "zero2", "zero3")
    assert [(row["engine"], row["compared"]) for row in rows] == [
        ("zero2", "policy_again vs policy"),
        ("zero2", "loss_forward vs policy"),
        ("zero3", "policy_again vs policy"),
        ("zero3", "loss_forward vs policy"),
    ]
    for row in rows:
        assert row["within"] and row["metric_rel"] <= 1e-4 and row["weight_abs"] <= 1e-5, row
    for row in rows[1::2]:
        assert row["backwards"] == {"policy": 8, "loss_forward": 8}, row
    # blocks of 4 micro-batches (1 row each, 8 a step): 3 backwards of a block before its last one's, under ZeRO-2
    again, fused = check("blocks4", 29900, "--engines", "zero2", "--per-device-batch", "1", "--accumulation", "8")
    assert again["within"] and fused["within"] and fused["backwards"] == {"policy": 16, "loss_forward": 16}, fused


def test_loss_forward_refuses_a_deepspeed_older_than_the_one_it_was_checked_with(monkeypatch):
    """DeepSpeed before 0.19 was not checked (how ZeRO closes a micro-step has changed between releases): refused,
    naming the upgrade; 0.19 and later, or none installed (a DeepSpeed launch then fails by itself), pass."""
    import importlib.metadata

    from egpo_trl import EGPOConfig, fused

    installed = {"version": "0.17.6"}

    def version(name):
        if name != "deepspeed":
            return importlib.metadata.version(name)
        if installed["version"] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed["version"]

    monkeypatch.setattr(importlib.metadata, "version", version)
    message = fused.deepspeed_problem()
    assert "DeepSpeed 0.17.6 is installed" in message and "pip install 'deepspeed>=0.19'" in message
    with pytest.raises(ValueError, match="0.17.6"):
        EGPOConfig._validate_loss_forward(_loss_forward_arguments(deepspeed="zero2.json"))
    EGPOConfig._validate_loss_forward(_loss_forward_arguments())  # no DeepSpeed in the launch: not asked
    for fine in ("0.19.0", "0.19.8", "0.20.1", None):
        installed["version"] = fine
        assert fused.deepspeed_problem() is None
        EGPOConfig._validate_loss_forward(_loss_forward_arguments(deepspeed="zero2.json"))


@pytest.mark.parametrize(
    "adapter",
    [
        "LoHaConfig(r=4, rank_dropout=0.3, module_dropout=0.0, target_modules=['q_proj', 'v_proj'])",
        "LoKrConfig(r=4, rank_dropout=0.0, module_dropout=0.2, target_modules=['q_proj', 'v_proj'])",
    ],
)
def test_adapters_whose_dropout_is_in_code_make_the_training_forward_random(tiny_model_dir, adapter):
    """LoHa and LoKr (and BOFT) drop ranks, modules or blocks in their own code (no dropout module): the loss's forward
    of such a policy is not pi_old's, so loss_forward refuses it, and the baselines' entropy metrics take a pass."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from egpo_trl.fused import random_training_forward

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not random_training_forward(model)
    config = eval(adapter, vars(peft))  # noqa: S307 - the parametrized constructor calls above
    assert random_training_forward(peft.get_peft_model(model, config))
    quiet = eval(adapter.replace("0.3", "0.0").replace("0.2", "0.0"), vars(peft))  # noqa: S307
    assert not random_training_forward(
        peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), quiet)
    )


def test_loss_forward_samples_with_the_optimizer_in_training_mode(tmp_path, tiny_model_dir):
    """A schedule-free optimizer holds other weights in eval mode, where evaluation leaves it; Trainer.training_step
    switches it back before each micro-batch. A micro-batch that loss_forward only keeps must do the same before it
    generates, or the batch is sampled with the eval weights and trained as on-policy for the others."""
    from egpo_trl import EGPOTrainer

    class ModalAdamW(torch.optim.AdamW):  # the train()/eval() interface of schedule-free optimizers
        mode = "train"

        def train(self):
            self.mode = "train"

        def eval(self):
            self.mode = "eval"

    args = config(
        tmp_path, egpo_entropy_logps="loss_forward", per_device_train_batch_size=2, gradient_accumulation_steps=4,
        max_steps=2,
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = ModalAdamW(model.parameters(), lr=1e-3)
    trainer = EGPOTrainer(
        model, parity_reward, args, train_dataset=make_prompt_dataset(), optimizers=(optimizer, None)
    )
    modes = []
    generate = trainer._generate_and_score_completions

    def record(*a, **k):
        modes.append(optimizer.mode)
        return generate(*a, **k)

    trainer._generate_and_score_completions = record
    optimizer.eval()  # as an evaluation before training, or between steps, leaves it
    trainer.train()
    assert modes == ["train", "train"]  # one generation batch per optimizer step, each sampled in training mode


def test_loss_forward_refuses_a_random_adapter_or_model_config_before_the_model_loads(tmp_path, tiny_model_dir):
    """The PEFT adapter's and the model's configured dropout are refused before anything loads: a folder with only
    a config.json (no weights) gets the loss_forward error, not a loading error."""
    import json
    import shutil

    from peft import LoraConfig

    args = config(tmp_path, egpo_entropy_logps="loss_forward")
    dataset = make_prompt_dataset()
    with pytest.raises(ValueError, match=r"PEFT adapter's training forward is random.*--lora_dropout 0") as error:
        EGPOTrainer(
            tiny_model_dir, parity_reward, args, train_dataset=dataset, peft_config=LoraConfig(lora_dropout=0.05)
        )
    assert "Use egpo_entropy_logps='policy'" in str(error.value)

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    model_config = json.loads(open(f"{tiny_model_dir}/config.json").read())
    (config_only / "config.json").write_text(json.dumps({**model_config, "attention_dropout": 0.1}))
    with pytest.raises(
        ValueError, match=r"model's config sets a random training forward \(attention_dropout above 0\)"
    ):
        EGPOTrainer(str(config_only), parity_reward, args, train_dataset=dataset)
    # ... and model_init_kwargs can set it back to 0: then the check passes (the loading fails: no weights here).
    args.model_init_kwargs = {"attention_dropout": 0.0}
    with pytest.raises(Exception) as loading:
        EGPOTrainer(str(config_only), parity_reward, args, train_dataset=dataset)
    assert "cannot be used here" not in str(loading.value)
    # A model with dropout 0 and an adapter without dropout pass.
    shutil.rmtree(config_only)
    args.model_init_kwargs = None
    from egpo_trl.input_checks import loss_forward_input_problems

    assert loss_forward_input_problems(tiny_model_dir, LoraConfig(lora_dropout=0.0), None) == []
    assert loss_forward_input_problems("builtin:not-a-path", {"lora_dropout": 0.1}, None) == [
        "the PEFT adapter's training forward is random (a dropout above 0, e.g. lora_dropout, TRL's default 0.05); "
        "set it to 0 (--lora_dropout 0)"
    ]


def test_loss_forward_warns_when_a_block_holds_full_activations(tmp_path, tiny_model_dir, caplog):
    args = config(
        tmp_path,
        egpo_entropy_logps="loss_forward",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        gradient_checkpointing=False,
    )
    with caplog.at_level("WARNING", logger="egpo_trl.fused"):
        EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert (
        "holds 2 micro-batches (4 rows) of forwards" in caplog.text and "Turn gradient_checkpointing on" in caplog.text
    )
