"""Rows shifted past their prompt padding (egpo_trl.old_logps) against TRL's own log-prob helper, on the tiny Qwen2 model."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward, train_two_steps
from conftest import trainer_config as config
from trl import GRPOTrainer

from egpo_trl import EGPOTrainer
from egpo_trl.old_logps import can_realign, completion_widths, shifted_logps


def padded_batch(vocab_size: int, prompt_lengths: list[int], completion_lengths: list[int], seed: int = 0):
    """Left-padded prompts and right-padded completions, as TRL lays out a generation batch."""
    generator = torch.Generator().manual_seed(seed)
    batch, prompt_width, completion_width = len(prompt_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_ids = torch.randint(3, vocab_size, (batch, prompt_width), generator=generator)
    completion_ids = torch.randint(3, vocab_size, (batch, completion_width), generator=generator)
    prompt_mask = torch.zeros(batch, prompt_width, dtype=torch.long)
    completion_mask = torch.zeros(batch, completion_width, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_mask[row, prompt_width - p :] = 1
        completion_mask[row, :c] = 1
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    args = config(tmp_path_factory.mktemp("old-logps"), temperature=0.7, max_steps=1)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    # PyTorch's CPU SDPA kernel rounds differently with the sequence length (up to 4e-4 on a log-prob of this model,
    # for TRL's helper itself); eager attention does not, so the comparison below holds to float32 precision.
    trainer.model.set_attn_implementation("eager")
    return trainer


def _pass(helper, trainer, batch, compute_entropy, model):
    model = trainer.model if model is None else model
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    model.eval()
    with torch.no_grad():
        logps, entropies, _ = helper(
            model,
            input_ids,
            attention_mask,
            batch["completion_ids"].size(1),
            batch_size=3,
            compute_entropy=compute_entropy,
        )
    model.train()
    return logps, entropies


def trl_pass(trainer, batch, compute_entropy, model=None):
    """TRL's own helper over ``batch``, three rows at a time, with ``model`` (default: the trainer's policy)."""
    return _pass(
        partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer), trainer, batch, compute_entropy, model
    )


def egpo_pass(trainer, batch, compute_entropy, model=None):
    """The trainer's no-grad pass (rows shifted where :func:`can_realign` allows it)."""
    return _pass(trainer._get_per_token_logps_and_entropies, trainer, batch, compute_entropy, model)


def test_pass_equals_trls_helper(trainer):
    assert trainer.temperature == 0.7  # the fused head divides by it in both passes
    # Padding in prompts and completions, a completion with no scored token, rows in no particular length order.
    prompt_lengths = [5, 9, 3, 9, 7, 1, 6]
    completion_lengths = [4, 11, 0, 7, 11, 2, 9]
    batch = padded_batch(trainer.model.config.vocab_size, prompt_lengths, completion_lengths)
    expected_logps, expected_entropies = trl_pass(trainer, batch, compute_entropy=True)
    logps, entropies = trainer._egpo_forward(batch, compute_entropy=True)
    logps_only, none = trainer._egpo_forward(batch, compute_entropy=False)
    assert trainer.model.training  # the pass puts the model back in training mode
    assert none is None
    assert logps.shape == expected_logps.shape == batch["completion_ids"].shape
    scored = batch["completion_mask"].bool()
    assert (logps[~scored] == 0).all() and (entropies[~scored] == 0).all()  # as TRL's: 0 where nothing is scored
    torch.testing.assert_close(logps, expected_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, expected_entropies, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logps_only, logps, rtol=0, atol=0)
    assert (logps[scored] < 0).all() and (entropies[scored] > 0).all()


def test_realigned_rows_give_trls_values(trainer):
    """Rows shifted past their prompt padding, with their original positions and no attention mask, score every
    completion token as TRL's masked pass does."""
    batch = padded_batch(trainer.model.config.vocab_size, [5, 9, 3, 9, 7, 1, 6], [4, 11, 0, 7, 11, 2, 9], seed=3)
    assert can_realign(trainer.model, batch["prompt_mask"], batch["completion_mask"])
    expected_logps, expected_entropies = trl_pass(trainer, batch, compute_entropy=True)
    calls = []
    handle = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True
    )
    try:
        logps, entropies = egpo_pass(trainer, batch, compute_entropy=True)
    finally:
        handle.remove()
    assert calls and all(call.get("attention_mask") is None and "position_ids" in call for call in calls)
    torch.testing.assert_close(logps, expected_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, expected_entropies, rtol=1e-5, atol=1e-5)
    scored = batch["completion_mask"].bool()
    assert (logps[~scored] == 0).all() and (logps[scored] < 0).all()


def test_realigned_pass_under_sdpa_matches_the_masked_pass(trainer):
    """The default attention (SDPA): the causal kernel without a mask against the masked kernel, to SDPA's rounding."""
    batch = padded_batch(trainer.model.config.vocab_size, [6, 2, 8, 8], [10, 3, 0, 12], seed=4)
    trainer.model.set_attn_implementation("sdpa")
    try:
        assert can_realign(trainer.model, batch["prompt_mask"], batch["completion_mask"])
        realigned, _ = egpo_pass(trainer, batch, compute_entropy=False)
        masked, _ = trl_pass(trainer, batch, compute_entropy=False)
    finally:
        trainer.model.set_attn_implementation("eager")
    torch.testing.assert_close(realigned, masked, rtol=1e-3, atol=1e-3)


def test_masks_with_holes_and_other_attention_take_the_masked_path(trainer):
    batch = padded_batch(trainer.model.config.vocab_size, [5, 4, 3], [6, 8, 5], seed=5)
    model = trainer.model
    assert can_realign(model, batch["prompt_mask"], batch["completion_mask"])
    holed = {**batch, "completion_mask": batch["completion_mask"].clone()}
    holed["completion_mask"][1, 2:4] = 0  # a masked span followed by scored tokens (e.g. a tool's output)
    assert not can_realign(model, holed["prompt_mask"], holed["completion_mask"])
    right_padded_prompt = batch["prompt_mask"].flip(1)
    assert not can_realign(model, right_padded_prompt, batch["completion_mask"])
    no_prompt = batch["prompt_mask"].clone()
    no_prompt[2] = 0
    assert not can_realign(model, no_prompt, batch["completion_mask"])
    # The holed batch still gets TRL's values (through the masked path).
    expected, _ = trl_pass(trainer, holed, compute_entropy=False)
    logps, _ = egpo_pass(trainer, holed, compute_entropy=False)
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    # Attention implementations and layouts where a shifted row could see other tokens are left alone.
    config = model.config
    saved = (config._attn_implementation, config.layer_types)
    try:
        config._attn_implementation = "flash_attention_2"
        assert not can_realign(model, batch["prompt_mask"], batch["completion_mask"])
        config._attn_implementation = saved[0]
        config.layer_types = ["sliding_attention"] * len(saved[1])
        assert not can_realign(model, batch["prompt_mask"], batch["completion_mask"])
    finally:
        config._attn_implementation, config.layer_types = saved
    assert can_realign(model, batch["prompt_mask"], batch["completion_mask"])


def test_shifted_rows_in_trls_passes_give_trls_values_and_gradients(trainer):
    """egpo_shift_prompt_padding: the loss's forward (with gradients) and TRL's no-grad passes run on shifted rows with
    no attention mask, and give TRL's log-probs, entropies and parameter gradients."""
    batch = padded_batch(trainer.model.config.vocab_size, [5, 9, 3, 9, 7, 1], [4, 11, 0, 7, 11, 2], seed=6)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits_to_keep = batch["completion_ids"].size(1)
    model = trainer.model
    masks = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )

    def pass_with_gradients(shift: bool):
        trainer.args.egpo_shift_prompt_padding = shift
        model.zero_grad()
        logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=4, compute_entropy=True
        )
        (logps * batch["completion_mask"]).sum().backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            no_grad_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=3
            )
        return logps.detach(), entropies.detach(), aux, grads, no_grad_logps

    model.eval()  # no dropout: the two passes must see the same network
    try:
        shifted = pass_with_gradients(True)
        shifted_masks, masks[:] = list(masks), []
        reference = pass_with_gradients(False)
    finally:
        handle.remove()
        trainer.args.egpo_shift_prompt_padding = False
        model.zero_grad()
        model.train()
    assert shifted_masks and all(mask is None for mask in shifted_masks)  # every forward ran without a mask
    assert masks and all(mask is not None for mask in masks)  # TRL's own pass when the setting is off
    scored = batch["completion_mask"].bool()
    torch.testing.assert_close(shifted[0][scored], reference[0][scored], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shifted[1][scored], reference[1][scored], rtol=1e-5, atol=1e-5)
    assert shifted[2] is None
    assert shifted[3].keys() == reference[3].keys() and shifted[3]
    for name, grad in shifted[3].items():
        torch.testing.assert_close(grad, reference[3][name], rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(shifted[4][scored], reference[4][scored], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_training_with_shifted_rows_matches_training_without(tmp_path, tiny_model_dir):
    """Two optimizer steps with egpo_shift_prompt_padding on and off (eager attention, float32): the same rewards,
    losses and weights, to float32 rounding."""
    results = {}
    for shift in (False, True):
        _, rows, weights = train_two_steps(tmp_path / str(shift), tiny_model_dir, egpo_shift_prompt_padding=shift)
        results[shift] = (rows, weights)
    assert len(results[False][0]) == 2
    for off, on in zip(results[False][0], results[True][0], strict=True):
        assert off.keys() == on.keys()
        for key in ("reward", "loss", "egpo/entropy_mean", "grad_norm"):
            if key in off:
                assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    for name, weight in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], weight, rtol=1e-4, atol=1e-6, msg=name)


def forced_shift(model, batch, autocast):
    """Every row shifted in one forward, whatever :func:`can_realign` says."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        return shifted_logps(model, input_ids, attention_mask, batch["completion_ids"].size(1), autocast=autocast)


def fused_policy(trainer, model):
    """``model`` with the fused LM head GRPOTrainer installs on its policy, in evaluation mode."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    return model.eval()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 4.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 24,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_rotary_scaling_that_follows_the_longest_position_takes_the_masked_path(trainer, rope):
    """Dynamic and LongRoPE scaling pick their frequencies from the largest position of a forward. The padding after
    a shifted row carries positions past the masked layout's largest, which would change every row's values (and,
    for dynamic scaling, the frequencies of later forwards too)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Positions up to 23 in the masked layout (12 + 12 columns): within the 24 the scaling starts after.
    values = {**trainer.model.config.to_dict(), "max_position_embeddings": 24}
    values["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    torch.manual_seed(0)
    model = fused_policy(trainer, Qwen2ForCausalLM(Qwen2Config(**values, attn_implementation="eager")))
    batch = padded_batch(model.config.vocab_size, [12, 1, 12, 2], [12, 12, 3, 5], seed=6)
    assert not can_realign(model, batch["prompt_mask"], batch["completion_mask"])
    autocast = trainer.accelerator.autocast  # as TRL's helper runs
    expected_logps, expected_entropies = trl_pass(trainer, batch, compute_entropy=True, model=model)
    logps, entropies = egpo_pass(trainer, batch, compute_entropy=True, model=model)
    torch.testing.assert_close(logps, expected_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, expected_entropies, rtol=1e-5, atol=1e-5)
    # Past the scaling's start (TRL's full width 24 > 20) a micro-batch cut to its own width would stay below it:
    # the pass keeps TRL's full width for such models.
    wide = Qwen2ForCausalLM(Qwen2Config(**{**values, "max_position_embeddings": 20}, attn_implementation="eager"))
    wide.load_state_dict(model.state_dict())
    wide = fused_policy(trainer, wide)
    expected_wide, _ = trl_pass(trainer, batch, compute_entropy=False, model=wide)
    wide_logps, _ = egpo_pass(trainer, batch, compute_entropy=False, model=wide)
    torch.testing.assert_close(wide_logps, expected_wide, rtol=1e-5, atol=1e-5)
    # Forced (all rows in one forward), the shifted layout gives other values; TRL's own pass after it still gives
    # its values.
    shifted, _ = forced_shift(model, batch, autocast)
    assert (shifted - expected_logps).abs().max() > 1e-4
    if rope["rope_type"] == "longrope":
        torch.testing.assert_close(trl_pass(trainer, batch, False, model=model)[0], expected_logps, rtol=0, atol=0)


def test_prompt_tuning_adapter_takes_the_masked_path(trainer, tiny_model_dir):
    """A PEFT prompt-tuning adapter prepends virtual tokens to every row and drops ``position_ids``: the shifted
    layout would read other columns at other positions. LoRA and prefix tuning keep the layout and are exact."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    batch = padded_batch(trainer.model.config.vocab_size, [5, 9, 3, 9, 7, 1], [4, 11, 0, 7, 11, 2], seed=7)
    adapters = {
        "prompt": peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "prefix": peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "lora": peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    }
    autocast = trainer.accelerator.autocast  # as TRL's helper runs
    for name, adapter in adapters.items():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
        model = peft.get_peft_model(fused_policy(trainer, base), adapter).eval()
        assert can_realign(model, batch["prompt_mask"], batch["completion_mask"]) == (name != "prompt"), name
        expected_logps, expected_entropies = trl_pass(trainer, batch, compute_entropy=True, model=model)
        logps, entropies = egpo_pass(trainer, batch, compute_entropy=True, model=model)
        torch.testing.assert_close(logps, expected_logps, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(entropies, expected_entropies, rtol=1e-5, atol=1e-5, msg=name)
        if name == "prompt":
            shifted, _ = forced_shift(model.eval(), batch, autocast)
            assert (shifted - expected_logps).abs().max() > 0.1


class _PassRecorder(EGPOTrainer):
    """EGPOTrainer that records, for every log-prob pass, its width, the widths and masks of the model's forwards
    inside it, and its log-probs per row (keyed by the row's tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes = []
        self._forwards = None

        def record(module, args, kwargs):
            if self._forwards is not None:
                no_mask = kwargs.get("attention_mask") is None
                positions = kwargs.get("position_ids")
                if no_mask:  # each row's positions rise by one: transformers sees no packed sequences to mask
                    assert positions is not None and bool((positions.diff(dim=1) == 1).all())
                self._forwards.append((kwargs["input_ids"].size(1), no_mask))

        self.model.register_forward_pre_hook(record, with_kwargs=True)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        self._forwards = []
        try:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        finally:
            forwards, self._forwards = self._forwards, None
        rows = {
            tuple(ids[mask.bool()].tolist()): logps.detach().clone()
            for ids, mask, logps in zip(input_ids, attention_mask, result[0])
        }
        prompt_mask, completion_mask = attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
        needed = int((prompt_mask.sum(dim=1) + completion_widths(completion_mask)).max())  # the longest row
        self.passes.append(
            {
                "grad": torch.is_grad_enabled(),
                "width": input_ids.size(1),
                "needed": needed,
                "forwards": forwards,
                "rows": rows,
            }
        )
        return result


def test_shifted_passes_keep_trls_width_when_trl_compares_two_of_them(tmp_path, tiny_model_dir):
    """With TRL's old-policy log-probs in the ratio (num_iterations 2), every shifted forward keeps TRL's width, so
    that the old-policy pass and the loss's forwards round alike: the first iteration's ratio is exactly 1. With one
    optimizer step per generation batch (no old-policy ratio) the forwards are cut to their longest row."""
    found = {}
    for iterations in (2, 1):
        args = config(
            tmp_path / str(iterations),
            max_steps=1,
            num_iterations=iterations,
            per_device_train_batch_size=2,  # 2-row forwards, grouped otherwise in the loss (shuffled) than before
            gradient_accumulation_steps=4,
            bf16=False,
        )
        assert args.egpo_shift_prompt_padding  # the default
        trainer = _PassRecorder(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
        trainer.train()
        found[iterations] = trainer.passes
    old = [p for p in found[2] if not p["grad"]]
    loss = [p for p in found[2] if p["grad"]]
    assert old and loss
    assert any(p["needed"] < p["width"] for p in loss)  # a loss micro-batch that a cut forward would have narrowed
    for record in found[2]:  # shifted (no mask), at TRL's full width
        assert record["forwards"] and all(
            no_mask and width == record["width"] for width, no_mask in record["forwards"]
        )
    old_rows = {row: logps for record in old for row, logps in record["rows"].items()}
    compared = 0
    for record in loss:  # one optimizer step, at its end: every loss forward ran the old policy
        for row, logps in record["rows"].items():
            assert torch.equal(logps, old_rows[row])
            compared += 1
    assert compared > 0
    # One optimizer step per generation batch: no old-policy pass in the ratio, each forward cut to its longest row.
    widths = [(width, p["width"]) for p in found[1] for width, _ in p["forwards"]]
    assert widths and all(width <= full for width, full in widths) and any(width < full for width, full in widths)


def test_moe_auxiliary_loss_keeps_trls_layout_in_every_pass(tmp_path, tiny_model_dir):
    """A mixture-of-experts model whose router loss TRL adds to the loss: TRL asks for it in the loss's forward
    only, so every pass (the old-policy one too) keeps TRL's masked layout, and the ratio compares one layout."""
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    moe_config = Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    router_loss = moe_config.router_aux_loss_coef
    assert router_loss != 0
    model = Qwen2MoeForCausalLM(moe_config)
    passes = {}
    for coefficient in (router_loss, 0.0):
        model.config.router_aux_loss_coef = coefficient
        moe_dir = tmp_path / f"tiny-moe-{coefficient}"
        model.save_pretrained(moe_dir)
        tokenizer.save_pretrained(moe_dir)
        args = config(tmp_path / f"run-{coefficient}", max_steps=1, num_iterations=2, bf16=False)
        trainer = _PassRecorder(str(moe_dir), parity_reward, args, train_dataset=make_prompt_dataset())
        assert trainer.aux_loss_enabled == (coefficient != 0)
        trainer.train()
        assert any(not p["grad"] for p in trainer.passes) and any(p["grad"] for p in trainer.passes)
        passes[coefficient] = [no_mask for p in trainer.passes for _, no_mask in p["forwards"]]
    with_loss, without_loss = passes[router_loss], passes[0.0]
    assert with_loss and not any(with_loss)  # TRL's masked layout in every pass
    assert without_loss and all(without_loss)  # the same model without the router loss: shifted in every pass
