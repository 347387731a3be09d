"""Run TRL's own GRPOTrainer tests against TRL's trainer and against EGPOTrainer, and compare.

Usage::

    python tests/scripts/trl_grpo_tests.py /path/to/trl/tests [--trainer both] [--workdir DIR] [-- PYTEST ARGS]

The argument is TRL's ``tests`` folder (from a checkout of the TRL version installed here): this script copies
``test_grpo_trainer.py`` and its helpers (``testing_utils.py``, ``testing_constants.py``, ``conftest.py``) into a
work folder, and, for ``egpo``, makes the test file import ``EGPOConfig`` / ``EGPOTrainer`` under the names
``GRPOConfig`` / ``GRPOTrainer`` (nothing else changes: every test then builds and trains EGPOTrainer with its
default, ``advantage_estimator="egpo"``). Nothing of TRL's is kept in this repository.

TRL's tests load tiny models and data sets from the Hugging Face Hub (``trl-internal-testing/...``). Without Hub
access, ``--stand-ins`` (on by default) writes offline stand-ins under the work folder, where the tests' relative
names resolve: the two models most tests use (``tiny-Qwen2ForCausalLM-2.5`` and
``tiny-Qwen2ForSequenceClassification-2.5``, random weights with the character-level tokenizer of
``tests/tiny_qwen2.py``), the tiny Qwen3 models (dense, mixture-of-experts and classifier, the same
tokenizer with TRL's Qwen3 chat template, which renders tool calls) and the ``zen`` data set's
``standard_prompt_only`` and ``conversational_prompt_only`` configurations. Tests of other models, of images, of
scripted completions in Qwen's own token ids, or of GPUs, fail or skip the same way for both trainers. TRL's
environment and tool tests skip unless ``jmespath`` is importable.

Prints the pass / fail / skip counts of each trainer and the tests that fail for EGPOTrainer only, and writes them
to ``<workdir>/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HELPERS = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")
TRL_IMPORT = re.compile(r"^from trl import GRPOConfig, GRPOTrainer$", re.MULTILINE)
# The errors EGPOTrainer raises by design, each naming the fix: a correctness reward that is not binary (TRL's tests
# use reward models and length rewards), and several reward sources with none named as the correctness reward.
BY_DESIGN = ("binary correctness reward", "with no egpo_correctness_reward to say which")
EGPO_IMPORT = "from egpo_trl import EGPOConfig as GRPOConfig, EGPOTrainer as GRPOTrainer"

ZEN_PROMPTS = [
    "Beautiful is better than",
    "Explicit is",
    "Simple is better",
    "Complex",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality beats",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one--",
    "Although that way may not be",
    "Now is better than",
    "Never is often better than",
    "If the implementation is hard to explain, it's",
    "If the implementation is easy",
    "Namespaces are one honking",
]


def write_stand_ins(root: Path) -> None:
    """Offline stand-ins for the Hub models and data set most of TRL's GRPO tests use, under ``root``."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_qwen2 import build_tiny_model

    hub = root / "trl-internal-testing"
    causal = hub / "tiny-Qwen2ForCausalLM-2.5"
    if not (causal / "config.json").exists():
        build_tiny_model(str(causal))
    classifier = hub / "tiny-Qwen2ForSequenceClassification-2.5"
    if not (classifier / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(causal)
        torch.manual_seed(0)
        config = Qwen2Config.from_pretrained(causal)
        config.num_labels = 1
        config.pad_token_id = tokenizer.pad_token_id
        Qwen2ForSequenceClassification(config).save_pretrained(classifier)
        tokenizer.save_pretrained(classifier)
    write_qwen3_stand_ins(hub, causal)
    zen = hub / "zen"
    if not (zen / "README.md").exists():
        lines = ["---", "configs:"]
        for name, prompt in (
            ("standard_prompt_only", lambda text: text),
            ("conversational_prompt_only", lambda text: [{"role": "user", "content": f"What is better than {text}?"}]),
        ):
            lines += [f"- config_name: {name}", "  data_files:"]
            for split, rows in (("train", ZEN_PROMPTS[:17]), ("test", ZEN_PROMPTS[17:])):
                path = zen / name / f"{split}.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                Dataset.from_list([{"prompt": prompt(text)} for text in rows]).to_json(str(path))
                lines += [f"  - split: {split}", f"    path: {name}/{split}.jsonl"]
        (zen / "README.md").write_text("\n".join([*lines, "---", "Offline stand-in.", ""]))


def write_qwen3_stand_ins(hub: Path, tokenizer_source: Path) -> None:
    """Stand-ins for the tiny Qwen3 models (dense, mixture-of-experts, sequence classifier): random weights, the
    character-level tokenizer with TRL's Qwen3 chat template, which renders tool calls (the environment and tool
    tests build their trainers with them)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.chat_template = qwen3_chat_template
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    for name, build in (
        ("tiny-Qwen3ForCausalLM", lambda: Qwen3ForCausalLM(Qwen3Config(**shape))),
        ("tiny-Qwen3MoeForCausalLM", lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **moe))),
        (
            "tiny-Qwen3ForSequenceClassification",
            lambda: Qwen3ForSequenceClassification(Qwen3Config(**shape, num_labels=1)),
        ),
    ):
        folder = hub / name
        if (folder / "config.json").exists():
            continue
        torch.manual_seed(0)
        build().save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def write_compat_plugin(package: Path, target: Path) -> None:
    """A pytest plugin that gives ``trl.import_utils`` the ``is_<package>_available`` helpers that the tests' helpers
    import and the installed TRL lacks (the tests may come from a slightly different TRL version)."""
    names = set()
    for path in package.glob("*.py"):
        for block in re.findall(r"from trl\.import_utils import \(([^)]*)\)", path.read_text()):
            names |= set(re.findall(r"is_(\w+)_available", block))
    (target / "trl_compat.py").write_text(
        "import importlib.util\n\nimport trl.import_utils as utils\n\n"
        f"for name in {sorted(names)!r}:\n"
        "    if not hasattr(utils, f'is_{name}_available'):\n"
        "        setattr(utils, f'is_{name}_available', lambda name=name: importlib.util.find_spec(name) is not None)\n"
    )


def egpo_import(estimator: str | None) -> str:
    if estimator is None:
        return EGPO_IMPORT
    # EGPOConfig with another default estimator: EGPOTrainer's machinery (entropy pass, metrics, logs) under TRL's
    # tests, with advantages that do not need a binary reward.
    return (
        "from dataclasses import dataclass as _dataclass\n\n"
        "from egpo_trl import EGPOConfig as _EGPOConfig, EGPOTrainer as GRPOTrainer\n\n\n"
        "@_dataclass\nclass GRPOConfig(_EGPOConfig):\n"
        f"    advantage_estimator: str = {estimator!r}\n"
    )


def prepare(trl_tests: Path, target: Path, trainer: str, stand_ins: Path | None, estimator: str | None = None) -> None:
    package = target / "trl_tests"
    package.mkdir(parents=True, exist_ok=True)
    for name in HELPERS:
        source = trl_tests / name
        if source.exists():
            shutil.copy(source, package / name)
    (package / "__init__.py").touch()
    text = (trl_tests / "test_grpo_trainer.py").read_text()
    if trainer == "egpo":
        text, count = TRL_IMPORT.subn(egpo_import(estimator).replace("\\", "\\\\"), text)
        if count != 1:
            raise SystemExit("test_grpo_trainer.py does not import `from trl import GRPOConfig, GRPOTrainer`.")
    (package / "test_grpo_trainer.py").write_text(text)
    write_compat_plugin(package, target)
    if stand_ins is not None:
        link = target / "trl-internal-testing"
        if not link.exists():
            link.symlink_to(stand_ins / "trl-internal-testing", target_is_directory=True)


def run(target: Path, pytest_args: list[str]) -> dict:
    report = target / "report.xml"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "trl_tests/test_grpo_trainer.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-p",
        "trl_compat",
        f"--junitxml={report}",
        *pytest_args,
    ]
    print(f"$ (cd {target} && {' '.join(command)})", flush=True)
    subprocess.run(command, cwd=target, env=env, check=False)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                results[name] = (
                    outcome,
                    (child.get("message") or "").splitlines()[0][:300] if child.get("message") else "",
                )
                break
            if child.tag == "skipped":
                outcome = "skipped"
        results.setdefault(name, (outcome, ""))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trl_tests", type=Path, help="TRL's tests folder (or its test_grpo_trainer.py)")
    parser.add_argument("--trainer", choices=("grpo", "egpo", "both"), default="both")
    parser.add_argument("--workdir", type=Path, default=None, help="work folder (default: a new temporary one)")
    parser.add_argument("--no-stand-ins", action="store_true", help="do not write offline stand-ins of Hub models")
    parser.add_argument(
        "--egpo-estimator",
        default=None,
        help="run EGPOTrainer with this advantage_estimator as the config default (e.g. grpo: the trainer's "
        "machinery without the binary-reward requirement); default: egpo",
    )
    args = parser.parse_args(argv)
    trl_tests = args.trl_tests.parent if args.trl_tests.is_file() else args.trl_tests
    if not (trl_tests / "test_grpo_trainer.py").exists():
        parser.error(f"{trl_tests} has no test_grpo_trainer.py")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trl-grpo-tests-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stand_ins = None
    if not args.no_stand_ins:
        stand_ins = workdir / "stand-ins"
        write_stand_ins(stand_ins)
    trainers = ("grpo", "egpo") if args.trainer == "both" else (args.trainer,)
    results = {}
    for trainer in trainers:
        prepare(trl_tests, workdir / trainer, trainer, stand_ins, args.egpo_estimator)
        results[trainer] = run(workdir / trainer, pytest_args)
    summary = {"trl_tests": str(trl_tests), "counts": {}, "egpo_only_failures": {}}
    for trainer, outcomes in results.items():
        counts = {key: sum(o == key for o, _ in outcomes.values()) for key in ("passed", "failed", "skipped")}
        summary["counts"][trainer] = counts
        print(f"{trainer}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if len(results) == 2:
        for name, (outcome, message) in sorted(results["egpo"].items()):
            if outcome == "failed" and results["grpo"].get(name, ("",))[0] == "passed":
                summary["egpo_only_failures"][name] = message
        only = summary["egpo_only_failures"]
        by_design = {name for name, message in only.items() if any(text in message for text in BY_DESIGN)}
        summary["egpo_only_failures_by_design"] = sorted(by_design)
        print(
            f"failing for EGPOTrainer only: {len(only)}, of which {len(by_design)} by design (a non-binary "
            "correctness reward, or several reward sources and no egpo_correctness_reward, refused with the fix; see "
            "the README)"
        )
        for name, message in only.items():
            if name not in by_design:
                print(f"  {name}: {message}")
    summary["results"] = {t: {n: o for n, (o, _) in r.items()} for t, r in results.items()}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary: {workdir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
