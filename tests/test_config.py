"""EGPOConfig: defaults from the paper, validation errors that name the fix, YAML keys as with TrlParser."""

from __future__ import annotations

import pytest
from trl import GRPOConfig, TrlParser

from egpo_trl import EGPOConfig
from egpo_trl.config import distribution_changing_sampling_options


def make(tmp_path, **kwargs):
    return EGPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


def test_defaults_are_the_papers(tmp_path):
    config = make(tmp_path)
    assert isinstance(config, GRPOConfig)
    assert (config.egpo_lambda_min, config.egpo_lambda_max) == (0.8, 2.0)
    assert config.egpo_clamp == "asymmetric" and config.egpo_renorm == "none"
    assert config.egpo_nsr is True and config.egpo_nsr_weighting == "entropy"
    assert config.advantage_estimator == "egpo" and config.egpo_entropy_scope == "completion"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"egpo_clamp": "asym"}, "egpo_clamp='asym' is not supported; set it to one of: asymmetric"),
        ({"egpo_renorm": "after"}, "egpo_renorm='after' is not supported"),
        ({"egpo_nsr_weighting": "flat"}, "egpo_nsr_weighting"),
        ({"egpo_entropy_scope": "prompt"}, "egpo_entropy_scope"),
        (
            {"egpo_entropy_logps": "vllm"},
            "egpo_entropy_logps='vllm' is not supported; set it to one of: policy, sampler",
        ),
        ({"advantage_estimator": "ppo"}, "advantage_estimator='ppo'"),
        ({"egpo_lambda_min": 0.0}, "egpo_lambda_min must be a number > 0"),
        ({"egpo_lambda_min": -1.0}, "egpo_lambda_min must be a number > 0"),
        ({"egpo_lambda_min": 1.5, "egpo_lambda_max": 1.2}, "set egpo_lambda_min <= egpo_lambda_max"),
        ({"egpo_lambda_min": 1.2, "egpo_lambda_max": 2.0}, "must bracket 1"),
        ({"egpo_entropy_eps": 0.0}, "egpo_entropy_eps must be a number > 0"),
        ({"egpo_lambda_max": float("nan")}, "finite number"),
        ({"num_generations": 0}, "num_generations must be at least 2"),  # TRL divides by it first
        ({"num_generations": 1}, "num_generations must be at least 2"),
        ({"learning_rate": -1e-4, "top_p": 1.5}, "EGPOConfig: learning_rate must be >= 0 (the paper"),  # as the CLI
    ],
)
def test_bad_values_are_refused_with_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(tmp_path, **kwargs)


def test_symmetric_clamp_may_use_bounds_above_one(tmp_path):
    assert make(tmp_path, egpo_clamp="symmetric", egpo_lambda_min=1.2).egpo_lambda_min == 1.2


def test_batch_that_does_not_divide_into_groups_is_refused(tmp_path):
    with pytest.raises(ValueError, match="divisible by num_generations"):
        make(tmp_path, per_device_train_batch_size=6, num_generations=4)


def test_yaml_keys_are_field_names_and_cli_overrides_the_file(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"output_dir: {tmp_path}/out\nuse_cpu: true\nreport_to: []\negpo_lambda_max: 1.5\negpo_renorm: after_clamp\n"
        "egpo_nsr: false\nnum_generations: 4\nper_device_train_batch_size: 4\n"
    )
    parser = TrlParser((EGPOConfig,))
    (config,) = parser.parse_args_and_config(["--config", str(recipe), "--egpo_lambda_max", "1.75"])
    assert config.egpo_lambda_max == 1.75  # the command line wins
    assert config.egpo_renorm == "after_clamp" and config.egpo_nsr is False


# Each changes the distribution vLLM samples from away from the one TRL's trainer-side log-probs describe.
DISTRIBUTION_CHANGING = [
    {"top_p": 0.95},
    {"top_k": 20},
    {"min_p": 0.05},
    {"repetition_penalty": 1.1},
    {"generation_kwargs": {"min_tokens": 1024}},
    {"generation_kwargs": {"presence_penalty": 0.5}},
    {"generation_kwargs": {"frequency_penalty": 0.5}},
    {"generation_kwargs": {"temperature": 0.6}},  # vLLM samples at 0.6, TRL's log-probs divide by 1.0
    {"generation_kwargs": {"top_p": 0.9}},
    {"generation_kwargs": {"logit_bias": {"7": 5.0}}},
    {"generation_kwargs": {"bad_words": ["wrong"]}},
    {"generation_kwargs": {"structured_outputs": {"regex": "[0-9]+"}}},
    {"vllm_structured_outputs_regex": r"\\boxed\{[0-9]+\}"},
]
DISTRIBUTION_CHANGING_IDS = [
    "-".join(f"{key}.{next(iter(value))}" if isinstance(value, dict) else key for key, value in kwargs.items())
    for kwargs in DISTRIBUTION_CHANGING
]


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
@pytest.mark.parametrize("kwargs", DISTRIBUTION_CHANGING, ids=DISTRIBUTION_CHANGING_IDS)
def test_a_processed_distribution_is_refused_under_sequence_level_importance_sampling(tmp_path, kwargs, mode):
    assert distribution_changing_sampling_options(EGPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs))
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction: false") as error:
        EGPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_importance_sampling_mode=mode, **kwargs)
    assert f"vllm_importance_sampling_mode={mode!r}" in str(error.value) and "token_truncate" in str(error.value)
    # The same options without the correction, or without vLLM, are fine.
    EGPOConfig(
        output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_importance_sampling_correction=False, **kwargs
    )
    EGPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
@pytest.mark.parametrize("kwargs", DISTRIBUTION_CHANGING, ids=DISTRIBUTION_CHANGING_IDS)
def test_token_level_importance_sampling_accepts_what_grpo_config_accepts(tmp_path, kwargs, mode):
    # Each token's ratio is bounded on its own there: no product over the completion to collapse.
    fields = dict(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_importance_sampling_mode=mode, **kwargs)
    GRPOConfig(**fields)
    config = EGPOConfig(**fields)
    assert config.vllm_importance_sampling_mode == mode and config.vllm_importance_sampling_correction
    # The entropy proxy still knows vLLM's log-probs are those of another distribution (egpo_entropy_logps).
    assert distribution_changing_sampling_options(config)


def test_generation_kwargs_override_the_sampling_fields_as_trl_passes_them_to_vllm(tmp_path):
    # TRL hands generation_kwargs to vLLM after its own fields: top_p 1.0 there undoes the field's 0.9.
    fields = dict(output_dir=str(tmp_path), use_cpu=True, use_vllm=True)
    config = EGPOConfig(**fields, top_p=0.9, generation_kwargs={"top_p": 1.0})
    assert distribution_changing_sampling_options(config) == {}
    # A temperature in generation_kwargs equal to the config's is the distribution TRL's log-probs describe.
    config = EGPOConfig(**fields, temperature=0.7, generation_kwargs={"temperature": 0.7})
    assert distribution_changing_sampling_options(config) == {}
    assert distribution_changing_sampling_options(
        EGPOConfig(
            **fields,
            temperature=0.7,
            generation_kwargs={"temperature": 1.0},
            vllm_importance_sampling_mode="token_mask",
        )
    ) == {"generation_kwargs.temperature": 1.0}


@pytest.mark.parametrize(
    ("generation_kwargs", "fix"),
    [
        ({"logprobs": 5}, "sets logprobs, .* the sampled token's log-prob alone.*: remove it\\.$"),
        ({"n": 4}, "sets n, .*: remove it and set num_generations instead\\.$"),
        ({"max_tokens": 64}, "sets max_tokens, .*: remove it and set max_completion_length instead\\.$"),
        ('{"max_new_tokens": 64, "seed": 1}', "sets max_new_tokens, .* set max_completion_length instead"),
    ],
)
def test_generation_kwargs_that_trl_sets_itself_are_refused_with_the_fix(tmp_path, generation_kwargs, fix):
    """TRL sets these on every generation call and reads what comes back by its own values: with logprobs above 0 it
    would keep the most probable token's log-prob as the sampled one's. Refused, in one line, from a dict or a JSON
    string (the command line's form), with vLLM or without."""
    for use_vllm in (True, False):
        with pytest.raises(ValueError, match=f"^generation_kwargs {fix}") as error:
            make(tmp_path, use_vllm=use_vllm, generation_kwargs=generation_kwargs)
        assert "\n" not in str(error.value)
    make(tmp_path, use_vllm=True, generation_kwargs={"stop": ["\n\n"], "logprobs": 0, "n": 1})  # as TRL sets them
    make(tmp_path, use_vllm=True, vllm_mode="server", generation_kwargs={"seed": 1})
    with pytest.raises(ValueError, match="sets n, "):  # the server's n changes per call (one for GEC's continuations)
        make(tmp_path, use_vllm=True, vllm_mode="server", generation_kwargs={"n": 8})


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        (
            {"use_vllm": True, "generation_kwargs": {"seed": 1}},
            "sets seed, .*: remove it \\(or use vllm_mode='server'",
        ),
        ({"generation_kwargs": {"do_sample": False}}, "sets do_sample=False, which does not sample: .*; remove it"),
        ({"generation_kwargs": {"num_beams": 4}}, "sets num_beams=4, which does not sample: .*; remove it"),
        ({"use_vllm": True, "generation_kwargs": {"temperature": 0}}, "sets temperature=0, which does not sample"),
        ({"generation_kwargs": {"top_k": 1}}, "sets top_k=1, which does not sample"),
    ],
)
def test_generation_kwargs_that_make_a_groups_completions_identical_are_refused(tmp_path, kwargs, fix):
    """Greedy or beam search, or one vLLM seed shared by every copy of a prompt: a group of identical completions
    has no advantage to learn from."""
    with pytest.raises(ValueError, match=f"^generation_kwargs {fix}") as error:
        make(tmp_path, **kwargs)
    assert "\n" not in str(error.value)


def test_plain_sampling_passes_with_vllm_importance_sampling(tmp_path):
    neutral = {"top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "generation_kwargs": {"min_tokens": 0}}
    config = EGPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, temperature=0.7, **neutral)
    assert distribution_changing_sampling_options(config) == {}


def test_sampler_without_sampling_log_probs_says_a_pass_runs_instead(tmp_path, caplog):
    """egpo_entropy_logps='sampler' where no usable sampling log-probs come (no vLLM, or vLLM sampling from another
    distribution): the configuration says that the policy's pass gives the proxy; where TRL computes the old
    log-probs anyway (they feed the proxy at no cost), or with plain vLLM sampling, it says nothing."""
    import logging

    def warned(**kwargs) -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="egpo_trl.config"):
            EGPOConfig(output_dir=str(tmp_path), use_cpu=True, egpo_entropy_logps="sampler", **kwargs)
        return "egpo_entropy_logps='sampler'" in caplog.text

    assert warned()
    assert "generation without vLLM returns no sampling log-probs" in caplog.text
    assert "Set egpo_entropy_logps='policy'" in caplog.text
    assert warned(use_vllm=True, vllm_importance_sampling_correction=False, top_p=0.9)
    assert "'top_p': 0.9" in caplog.text
    assert not warned(use_vllm=True, vllm_importance_sampling_correction=False)
    assert not warned(num_iterations=2)
    assert not warned(advantage_estimator="grpo")  # the baselines' metrics may come from the loss's forward
