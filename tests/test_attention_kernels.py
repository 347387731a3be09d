"""egpo_cudnn_attention: PyTorch's cuDNN kernel for SDPA is off during training and evaluation steps (and only then)
where it is false, or unset with completions of at most 4,096 tokens; with TRL's real GRPOTrainer machinery on the tiny
Qwen2 model."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config

from egpo_trl import EGPOTrainer


@pytest.mark.parametrize(
    "cudnn, logps", [(False, "policy"), (False, "loss_forward"), (True, "policy"), (None, "policy")]
)
def test_cudnn_attention_is_off_in_training_steps_unless_asked(tmp_path, tiny_model_dir, cudnn, logps):
    """The flag SDPA reads, seen by every training forward, by the backward (where gradient checkpointing recomputes
    its forwards) and by the scoring pass: off in each unless egpo_cudnn_attention; as it was outside the steps."""
    args = config(
        tmp_path,
        max_steps=2,
        egpo_cudnn_attention=cudnn,
        egpo_entropy_logps=logps,
        gradient_checkpointing=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    seen = {"forward": [], "backward": []}
    model = trainer.model
    model.register_forward_pre_hook(lambda *_: seen["forward"].append(torch.backends.cuda.cudnn_sdp_enabled()))
    weight = model.get_input_embeddings().weight
    weight.register_hook(lambda grad: seen["backward"].append(torch.backends.cuda.cudnn_sdp_enabled()))
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        trainer.train()
        assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the last step
        torch.backends.cuda.enable_cudnn_sdp(False)
        with trainer._egpo_attention_kernels():
            pass
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # a setting of False stays False
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert seen["forward"] and seen["backward"]
    expected = bool(cudnn)  # unset: off, as completions of 12 tokens are far below 4,096
    assert set(seen["forward"]) == {expected} and set(seen["backward"]) == {expected}, seen


def test_cudnn_attention_setting_comes_back_after_an_error(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError, match="boom"):
        with trainer._egpo_attention_kernels():
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            raise RuntimeError("boom")
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_cudnn_attention_is_off_in_evaluation_steps_too(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1, per_device_eval_batch_size=8)
    trainer = EGPOTrainer(
        tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset(), eval_dataset=make_prompt_dataset(2)
    )
    seen = []
    trainer.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and seen and set(seen) == {False}, seen
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cudnn_as_the_only_kernel_left_on_stays_on(tmp_path, tiny_model_dir):
    """A run under sdpa_kernel([CUDNN_ATTENTION]): turning cuDNN off would leave SDPA no kernel, so the choice stands."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = config(tmp_path, max_steps=1)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        with trainer._egpo_attention_kernels():
            assert torch.backends.cuda.cudnn_sdp_enabled()
    with trainer._egpo_attention_kernels():
        assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize(
    "setting, completion_length, allowed",
    [(None, 3072, False), (None, 4096, False), (None, 15360, True), (False, 15360, False), (True, 3072, True)],
)
def test_unset_cudnn_attention_follows_the_completion_length(
    tmp_path, tiny_model_dir, setting, completion_length, allowed
):
    """Unset, cuDNN is off up to 4,096 completion tokens (where its host time showed, BENCHMARKS.md) and on beyond
    (where its faster kernels did); set, the setting decides."""
    args = config(tmp_path, max_steps=1, egpo_cudnn_attention=setting, max_completion_length=completion_length)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer._egpo_cudnn_attention() is allowed
    with trainer._egpo_attention_kernels():
        assert torch.backends.cuda.cudnn_sdp_enabled() is allowed


@pytest.mark.parametrize(
    "in_recipe, flags, value",
    [
        ({}, [], None),  # unset: decided by max_completion_length
        ({"egpo_cudnn_attention": None}, [], None),
        ({"egpo_cudnn_attention": False}, [], False),
        ({"egpo_cudnn_attention": True}, ["--egpo_cudnn_attention", "false"], False),
        ({}, ["--egpo_cudnn_attention", "true"], True),
    ],
)
def test_cudnn_attention_from_a_recipe_and_the_command_line(tmp_path, in_recipe, flags, value):
    """``egpo-trl train``'s own parser: a recipe's value (YAML null, false, true) and a flag over it."""
    import yaml

    from egpo_trl.script.args import parse_args

    recipe = tmp_path / "recipe.yaml"
    fields = {"model_name_or_path": "m", "use_cpu": True, "bf16": False, "output_dir": str(tmp_path / "out")}
    recipe.write_text(yaml.safe_dump({**fields, **in_recipe}))
    _, training_args, _ = parse_args(["--config", str(recipe), *flags])
    assert training_args.egpo_cudnn_attention is value
