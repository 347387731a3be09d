"""The paper's recipes: every one loads with the paper's values, and ``--dry-run`` checks each without downloading."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_prompt_dataset

from egpo_trl.launch import dry_run, launch_command, plan_launch
from egpo_trl.train import parse_args

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "qwen15b": ("Qwen/Qwen2.5-Math-1.5B", 3072, "zero2", 0.3),
    "qwen7b": ("Qwen/Qwen2.5-Math-7B", 3072, "zero2", 0.4),
    "r1_distill_15b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 15360, "zero2", 0.55),
    "r1_distill_7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 15360, "zero3", 0.65),
}
METHODS = ("egpo", "grpo", "dapo", "edge_grpo")
RECIPE_KEYS = {f"recipes/{method}_{model}.yaml": (method, model) for method in METHODS for model in MODELS}
RECIPES = list(RECIPE_KEYS)
QWEN_MATH_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
# Fields that may differ between the recipes of one model: the method's block and the run's names.
METHOD_FIELDS = {"output_dir", "run_name"}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def _method_fields(path: str) -> set[str]:
    """Keys of the recipe's last block (the method's fields)."""
    text = (REPO / path).read_text().rstrip().split("\n\n")[-1]
    return {line.split(":")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_has_the_papers_settings(recipe):
    method, model_key = RECIPE_KEYS[recipe]
    model, completion, zero, memory_share = MODELS[model_key]
    raw = yaml.safe_load((REPO / recipe).read_text())
    assert raw["bf16"] is True  # checked on the YAML: this machine has no GPU for bf16
    script_args, args, model_args = parse_args(["--config", recipe, "--bf16", "false"])
    assert model_args.model_name_or_path == model
    assert args.num_generations == 16
    assert args.learning_rate == 1e-6
    assert args.num_train_epochs == 5
    assert args.gradient_checkpointing
    assert args.use_vllm and args.vllm_mode == "colocate" and args.vllm_enable_sleep_mode
    # One share per model for all four methods: generation's memory (ZeRO's shards and vLLM) is the same in each.
    assert args.vllm_gpu_memory_utilization == memory_share
    assert args.max_completion_length == completion
    assert script_args.max_prompt_length + args.max_completion_length == args.vllm_max_model_length
    assert args.vllm_max_model_length == (4096 if model_key.startswith("qwen") else 16384)
    assert script_args.reward_funcs == ["boxed_accuracy_reward"]
    assert script_args.system_prompt == QWEN_MATH_PROMPT
    assert script_args.dataset_name == "outputs/data/openr1_stable_10k/dataset"
    assert script_args.accelerate_config == f"recipes/accelerate/{zero}.yaml"
    assert script_args.num_processes == 8
    assert args.report_to == ["wandb"] and args.project == "egpo" and args.run_name == f"{method}_{model_key}"
    assert args.log_completions
    # 64 prompts x 16 rollouts per optimizer step on 8 GPUs: 5 epochs of ~9.9k problems = ~770 steps.
    assert args.per_device_train_batch_size * 8 * args.gradient_accumulation_steps == 64 * 16
    expected_estimator = {"egpo": "egpo", "grpo": "grpo", "dapo": "grpo", "edge_grpo": "edge_grpo"}[method]
    assert args.advantage_estimator == expected_estimator
    if method == "egpo":
        assert (args.egpo_lambda_min, args.egpo_lambda_max) == (0.8, 2.0)
        assert args.egpo_clamp == "asymmetric" and args.egpo_nsr
    if method == "dapo":
        assert args.epsilon_high == 0.28 and args.dynamic_sampling and args.overlong_buffer_length > 0
    if method == "edge_grpo":
        assert args.edge_gec


@pytest.mark.parametrize("model_key", MODELS)
def test_baseline_recipes_differ_only_in_the_methods_fields(model_key):
    def settings(method):
        return yaml.safe_load((REPO / f"recipes/{method}_{model_key}.yaml").read_text())

    egpo = settings("egpo")
    for method in METHODS[1:]:
        other = settings(method)
        allowed = (
            METHOD_FIELDS
            | _method_fields(f"recipes/{method}_{model_key}.yaml")
            | _method_fields(f"recipes/egpo_{model_key}.yaml")
        )
        differing = {k for k in egpo.keys() | other.keys() if egpo.get(k) != other.get(k)}
        assert differing <= allowed, differing - allowed


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_on_every_recipe(recipe, capsys):
    code = dry_run(["--config", recipe])
    out = capsys.readouterr().out
    model, _, zero, _ = MODELS[RECIPE_KEYS[recipe][1]]
    # The Hub model is not on this machine: the context check says so instead of downloading it.
    assert f"not checked ({model} is not available locally)" in out
    assert (
        f"accelerate launch --config_file recipes/accelerate/{zero}.yaml --num_processes 8 -m egpo_trl.train "
        f"--config {recipe}" in out
    )
    expected = ["dataset outputs/data/openr1_stable_10k/dataset does not exist"]
    if not torch.cuda.is_available():
        expected.append("this machine sees no GPU, but the recipe needs 8 GPUs")
    if importlib.util.find_spec("vllm") is None:
        expected.append("use_vllm is true but vLLM is not installed")
    if importlib.util.find_spec("deepspeed") is None:
        expected.append("uses DeepSpeed, which is not installed")
    assert f"{len(expected)} problem(s) found" in out
    for problem in expected:
        assert problem in out
    assert code == 1


@pytest.fixture
def local_dataset(tmp_path):
    from datasets import DatasetDict

    path = tmp_path / "dataset"
    DatasetDict({"train": make_prompt_dataset(32), "validation": make_prompt_dataset(8)}).save_to_disk(str(path))
    return str(path)


def _tiny_overrides(model_dir, dataset, output_dir):
    return [
        "--model_name_or_path", model_dir, "--dataset_name", dataset, "--output_dir", str(output_dir),
        "--use_vllm", "false", "--accelerate_config", "recipes/accelerate/ddp.yaml", "--num_processes", "2",
        "--bf16", "false", "--max_prompt_length", "64", "--max_completion_length", "256",
        "--vllm_max_model_length", "320",
    ]  # fmt: skip


def test_dry_run_passes_on_a_complete_local_setup(tiny_model_dir, local_dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    code = dry_run(
        ["--config", "recipes/egpo_qwen15b.yaml", *_tiny_overrides(tiny_model_dir, local_dataset, tmp_path)]
    )
    out = capsys.readouterr().out
    assert "No problems found" in out, out
    assert code == 0
    rows = out.split("Resolved settings:\n")[1].split("\n\n")[0].splitlines()
    settings = dict((part.strip() for part in row.strip().split("  ", 1)) for row in rows)
    assert settings["model context"] == "512 tokens" and settings["train rows"] == "32"
    assert "16 per device x 2 processes x 8 accumulation = 256 completions (16 prompts)" in out


def test_dry_run_lists_every_late_failure(tiny_model_dir, local_dataset, tmp_path, capsys):
    out_dir = tmp_path / "earlier-run"
    (out_dir / "checkpoint-10").mkdir(parents=True)
    overrides = _tiny_overrides(tiny_model_dir, local_dataset, out_dir)
    overrides += ["--max_completion_length", "600", "--per_device_train_batch_size", "1"]
    overrides += ["--gradient_accumulation_steps", "3", "--accelerate_config", "recipes/accelerate/zero3.yaml"]
    overrides += ["--eval_size", "4"]
    code = dry_run(["--config", "recipes/egpo_qwen15b.yaml", *overrides])
    out = capsys.readouterr().out
    assert code == 1
    # Reported in the fields the user sets, with a value that works: 1 x 2 x 3 = 6
    assert (
        "per_device_train_batch_size 1 x 2 process(es) x gradient_accumulation_steps 3 = 6 completions per "
        "generation, not divisible by num_generations=16" in out
    )
    assert "e.g. 8." in out
    # the recipe's egpo_entropy_logps: loss_forward cannot serve groups across processes: listed with the rest
    assert "egpo_entropy_logps='loss_forward' cannot be used here" in out and "spans processes" in out
    assert "exceeds the model's context (512 tokens)" in out  # 64 + 600
    assert "vllm_max_model_length=320 < max_prompt_length + max_completion_length = 664" not in out  # vLLM off
    assert "already holds another run (checkpoint-10)" in out
    assert "ZeRO-3's sharded weights" in out
    # Resuming that folder is fine.
    code = dry_run(["--config", "recipes/egpo_qwen15b.yaml", *overrides, "--resume_from_checkpoint", "true"])
    out = capsys.readouterr().out
    assert "already holds another run" not in out and "resumes from" in out
    # Resuming an earlier checkpoint of it: the later one is named as set aside.
    (out_dir / "checkpoint-5").mkdir()
    resume = ["--resume_from_checkpoint", str(out_dir / "checkpoint-5")]
    dry_run(["--config", "recipes/egpo_qwen15b.yaml", *overrides, *resume])
    out = capsys.readouterr().out
    assert "checkpoint-10 of" in out and "the run sets them aside" in out and "replaced/" in out


def test_launch_plan_and_command(tmp_path):
    plan = plan_launch(["--config", "recipes/egpo_r1_distill_7b.yaml", "--num_processes", "4", "--seed", "1"])
    assert plan.accelerate_config == "recipes/accelerate/zero3.yaml" and plan.zero_stage == 3
    assert launch_command(plan) == [
        "accelerate", "launch", "--config_file", "recipes/accelerate/zero3.yaml", "--num_processes", "4",
        "-m", "egpo_trl.train", "--config", "recipes/egpo_r1_distill_7b.yaml", "--num_processes", "4", "--seed", "1",
    ]  # fmt: skip
    assert plan_launch(["--config", "recipes/egpo_qwen7b.yaml"]).zero_stage == 2
    assert (
        plan_launch(["--config", "recipes/egpo_qwen7b.yaml", "--accelerate_config", "none"]).accelerate_config is None
    )
    # A CPU recipe names no accelerate config: it trains in its own process.
    assert plan_launch(["--config", "recipes/demo_tiny_cpu.yaml"]).accelerate_config is None


ALL_RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
# What users write into recipes: LaTeX and Python in comments, and a key appended after the last line.
RISKY_COMMENT = (
    '# reward: \\boxed{\\frac{a}{b}} \\x41 \\u00e9 \\N{GREEK SMALL LETTER ALPHA} \\ulcorner """docstring"""\n'
)


def _edited_copy(recipe: str, directory: Path) -> Path:
    """The recipe with RISKY_COMMENT after its first line and in its middle, and `max_steps: 2` appended."""
    lines = (REPO / "recipes" / recipe).read_text().splitlines(keepends=True)
    lines = [line for line in lines if not line.startswith("max_steps:")]  # a key written twice is refused
    middle = len(lines) // 2
    lines = [lines[0], RISKY_COMMENT, *lines[1:middle], RISKY_COMMENT, *lines[middle:], "max_steps: 2\n"]
    path = directory / recipe
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_recipe_is_plain_yaml_and_a_python_program(recipe, tmp_path):
    """Any YAML tool reads a recipe; Python runs it, whatever its comments say and with a key appended at the end."""
    from egpo_trl.script.recipe import FOOTER, HEADER, MARKER_KEY, load_recipe, script_problem

    text = (REPO / "recipes" / recipe).read_text()
    assert text.splitlines()[0] == HEADER and text.splitlines()[-1] == FOOTER
    plain = yaml.safe_load(text)
    assert plain.pop(MARKER_KEY) == "(r'''" and load_recipe(REPO / "recipes" / recipe) == plain
    edited = _edited_copy(recipe, tmp_path)
    assert load_recipe(edited) == {**plain, "max_steps": 2}
    assert script_problem(REPO / "recipes" / recipe) is None and script_problem(edited) is None
    # What `python recipe.yaml` compiles: one string from the first line to the last, then the call that trains.
    tree = ast.parse(edited.read_text())
    assert isinstance(tree.body[0], ast.AnnAssign) and "max_steps: 1000" not in ast.unparse(tree.body[1:])
    assert ast.unparse(tree.body[1]) == "from egpo_trl.recipe_launch import run_as_script"


def test_python_on_a_recipe_runs_egpo_trl_train(tmp_path):
    """`python recipe.yaml [overrides]` is `egpo-trl train recipe.yaml [overrides]` (here its dry run)."""
    edited = _edited_copy("egpo_qwen15b.yaml", tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    result = subprocess.run(
        [sys.executable, str(edited), "--dry-run", "--seed", "3"], capture_output=True, text=True, timeout=120,
        cwd=REPO, env=env,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert "Resolved settings:" in result.stdout and "max_steps 2" in result.stdout
    assert f"--config {edited} --seed 3" in result.stdout  # the launch command it would run


def test_a_recipe_broken_for_python_is_reported_and_repaired(tmp_path, capsys):
    from egpo_trl.script.recipe import _main as repair
    from egpo_trl.script.recipe import load_recipe, script_problem

    path = _edited_copy("demo_tiny_cpu.yaml", tmp_path)
    with path.open("a") as file:
        file.write("run_name: demo:tiny  # not a Python expression\n")
    before = load_recipe(path)
    problem = script_problem(path)
    assert "run_name: demo:tiny" in problem and "after the last line" in problem
    assert f"python -m egpo_trl.script.recipe {path}" in problem
    assert dry_run(["--config", str(path), "--output_dir", str(tmp_path / "o")]) == 0  # egpo-trl train still reads it
    assert problem in capsys.readouterr().out
    assert repair([str(path)]) == 0
    assert script_problem(path) is None and load_recipe(path) == before  # nothing lost
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text(path.read_text().replace("# LaTeX", "# '''", 1).replace("# reward", "# ''' x", 1))
    assert "line 2 holds ''', which ends the text Python skips" in script_problem(quoted)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('generation_kwargs: {stop: ["a"], stop: ["b"]}\n', "stop is written twice, on line 1, columns 21 and 34"),
        ("generation_kwargs:\n  stop: [a]\n  stop: [b]\n", "stop is written twice, on lines 2 and 3"),
    ],
)
def test_dry_run_refuses_a_key_written_twice(text, where, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert dry_run(["--config", str(path)]) == 1
    assert f"1 problem(s) found:\n  - {path}: {where}; keep one.\n" in capsys.readouterr().out


def test_launch_options_are_read_from_the_accelerate_command(tmp_path):
    from egpo_trl.recipe_launch import launch_parent_options

    recipe = tmp_path / "r.yaml"
    recipe.write_text("")
    command = [sys.executable, "-c", "import time; time.sleep(60)", "launch"]
    for options in ([], ["--num_processes", "2", "--config_file", "c.yaml"]):
        process = subprocess.Popen([*command, *options, str(recipe), "--seed", "1"])
        try:
            for _ in range(200):  # until the child has replaced pytest's command line with its own
                if b"time.sleep" in Path(f"/proc/{process.pid}/cmdline").read_bytes():
                    break
                time.sleep(0.05)
            assert launch_parent_options(process.pid, str(recipe)) == options
        finally:
            process.kill()
            process.wait()
    assert launch_parent_options(os.getpid(), str(recipe)) is None  # not started by accelerate launch


def _accelerate_launch(options, recipe: Path, overrides, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    env["HF_HOME"] = str(tmp_path / "hf")  # no default accelerate config from the user's machine
    command = [sys.executable, "-m", "accelerate.commands.launch", *options, str(recipe), *overrides]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


SHORT = [
    "--eval_size", "0", "--synthetic_train_size", "16", "--per_device_train_batch_size", "4", "--num_generations",
    "4", "--max_completion_length", "8", "--plot", "false", "--disable_tqdm", "true",
]  # fmt: skip


@pytest.mark.slow
def test_accelerate_launch_of_a_recipe_trains_it(tmp_path):
    """`accelerate launch recipes/demo_tiny_cpu.yaml` trains, with LaTeX in its comments and a key appended."""
    from egpo_trl.train import read_metrics

    recipe = _edited_copy("demo_tiny_cpu.yaml", tmp_path)
    result = _accelerate_launch(
        [], recipe, [*SHORT, "--max_steps", "1", "--output_dir", str(tmp_path / "run")], tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r] == [1]


@pytest.mark.slow
def test_accelerate_launch_uses_the_recipes_accelerate_settings_unless_given_others(tmp_path):
    from egpo_trl.script.recipe import add_script_lines

    accelerate_config = tmp_path / "cpu.yaml"
    accelerate_config.write_text(
        yaml.safe_dump({"distributed_type": "NO", "use_cpu": True, "num_processes": 1, "mixed_precision": "no"})
    )
    recipe = _edited_copy("demo_tiny_cpu.yaml", tmp_path)
    with recipe.open("a") as file:
        file.write(f"accelerate_config: {accelerate_config}\n")
    recipe.write_text(add_script_lines(recipe.read_text()))  # a path is no Python expression: above the last line
    result = _accelerate_launch(
        [], recipe, [*SHORT, "--max_steps", "1", "--output_dir", str(tmp_path / "a")], tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"using the recipe's ({accelerate_config})" in result.stdout
    assert f"Launching: accelerate launch --config_file {accelerate_config} -m egpo_trl.train" in result.stdout
    assert (tmp_path / "a" / "metrics.jsonl").is_file()
    result = _accelerate_launch(
        ["--cpu"], recipe, [*SHORT, "--max_steps", "1", "--output_dir", str(tmp_path / "b")], tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Training with the launch's own settings (--cpu; 1 process(es))" in result.stdout
    assert "Launching:" not in result.stdout and (tmp_path / "b" / "metrics.jsonl").is_file()


def test_dry_run_checks_loss_forward_for_the_launch_it_prints(tiny_model_dir, local_dataset, tmp_path, capsys):
    """loss_forward's checks see the launch's own process count and engine, the adapter's dropout and the memory
    note of a block without gradient checkpointing."""

    def check(*extra, rows=("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "32")):
        # 4 rows per micro-batch: blocks of 4 micro-batches hold a group (the recipe's 16 rows need no block)
        overrides = _tiny_overrides(tiny_model_dir, local_dataset, tmp_path / "out")
        dry_run(["--config", "recipes/egpo_qwen15b.yaml", *overrides, *rows, *extra])
        return capsys.readouterr().out

    reentrant = ["--gradient_checkpointing_kwargs", '{"use_reentrant": true}']
    problem = "reentrant gradient checkpointing cannot hold several forwards"
    # one group per micro-batch, one block each: one forward per backward
    assert problem not in check(*reentrant, rows=())
    assert "micro-batches (16 rows) of forwards" not in check("--gradient_checkpointing", "false", rows=())
    assert problem not in check(*reentrant, "--accelerate_config", "none")  # one process, no engine: it works
    assert problem in check(*reentrant)  # the recipe's DDP over 2 processes
    assert problem in check(*reentrant, "--accelerate_config", "recipes/accelerate/zero2.yaml", "--num_processes", "1")
    out = check("--use_peft", "true", "--lora_dropout", "0.05")
    assert "PEFT adapter's training forward is random" in out and "--lora_dropout 0" in out
    assert "PEFT adapter" not in check("--use_peft", "true", "--lora_dropout", "0")
    out = check("--gradient_checkpointing", "false")
    assert "holds 4 micro-batches (16 rows) of forwards" in out and "Turn gradient_checkpointing on" in out
    # under ZeRO-3, chosen for its lower memory: a note on what blocks hold, naming the way back
    zero3 = ["--accelerate_config", "recipes/accelerate/zero3.yaml", "--eval_size", "0"]
    out = check(*zero3)
    assert "under ZeRO-3 holds each block's 4 forwards" in out and "--egpo_entropy_logps policy" in out
    assert "under ZeRO-3 holds" not in check(*zero3, "--egpo_entropy_logps", "policy")
    assert "under ZeRO-3 holds" not in check(*zero3, rows=())  # 16 rows: a micro-batch is a group, no block


def test_dry_run_parses_a_generation_batch_size_for_the_launchs_process_count():
    """generation_batch_size sets steps_per_generation from the process count: the dry run parses it for the launch's
    count (it reported a divisibility problem against a stand-in count before) and still names a real problem."""
    from egpo_trl.launch import check_recipe

    def batch_problems(*extra):
        report = check_recipe(["--config", "recipes/dapo_qwen15b.yaml", *extra])
        problems = [p for p in report.problems if "generation_batch_size" in p or "dynamic_sampling" in p]
        return problems, dict(report.settings).get("generation batch")

    assert batch_problems("--generation_batch_size", "256", "--num_processes", "2") == (
        [],
        "256 completions every 8 step(s)",
    )
    problems, _ = batch_problems("--generation_batch_size", "256", "--num_processes", "3")
    assert problems == ["invalid configuration: generation_batch_size (256) must be divisible by the global batch "
                        "size (48)."]  # fmt: skip
    # 8 processes x 2 rows x 4 steps per generation: each process's 8 rows cannot hold whole groups of 16
    problems, _ = batch_problems("--generation_batch_size", "64", "--num_processes", "8",
                                 "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                                 "--dynamic_sampling_oversample", "1.5")  # fmt: skip
    assert len(problems) == 1 and "(2 x 4 = 8) must be a multiple of num_generations (16)" in problems[0]


def test_dry_run_reads_a_local_dataset_without_writing_beside_it(tmp_path, capsys):
    from datasets import Dataset

    path = tmp_path / "ds"
    Dataset.from_dict(
        {"question": [f"{i}+1" for i in range(50)], "answer": [str(i + 1) for i in range(50)]}
    ).save_to_disk(path)
    before = sorted(path.iterdir())
    template = ["--prompt_template", "{question} Put the final answer in \\boxed{{}}.", "--eval_size", "10"]
    dry_run(
        [
            "--config",
            "recipes/demo_tiny_cpu.yaml",
            "--dataset_name",
            str(path),
            *template,
            "--output_dir",
            str(tmp_path / "o"),
        ]
    )
    assert "train rows" in capsys.readouterr().out and sorted(path.iterdir()) == before
    dry_run(["--config", "recipes/demo_tiny_cpu.yaml", "--dataset_name", str(tmp_path / "train.parquet")])
    assert f"dataset {tmp_path / 'train.parquet'} does not exist" in capsys.readouterr().out
