"""``accelerate launch`` behind ``egpo-trl train <recipe>``, the ``--dry-run`` checks, and tracking."""

from __future__ import annotations

import importlib.util
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egpo_trl.script.args import batch_shape_problem, option_value, parse_args
from egpo_trl.script.data import SYNTHETIC_DATASET_PREFIX, column_problem
from egpo_trl.script.outputs import RUN_MARKERS
from egpo_trl.script.recipe import load_recipe, script_problem
from egpo_trl.script.resolve import model_problem, resolve_model_path

__all__ = [
    "DryRunReport",
    "LaunchPlan",
    "batch_summary",
    "check_recipe",
    "configure_tracking",
    "dry_run",
    "in_distributed_launch",
    "launch_command",
    "launch_if_requested",
    "normalize_argv",
    "plan_launch",
]

# Variables set by `accelerate launch` / torchrun in the processes they start.
_LAUNCH_ENV_VARS = (
    "LOCAL_RANK",
    "WORLD_SIZE",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_FSDP",
)
_NONE_VALUES = ("", "none", "null", "false")
_DRY_RUN_FLAGS = ("--dry-run", "--dry_run")


def normalize_argv(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``(argv, dry_run)``: a leading recipe path turned into ``--config <recipe>``, ``--dry-run`` taken out."""
    args = list(argv)
    is_dry_run = any(a in _DRY_RUN_FLAGS for a in args)
    args = [a for a in args if a not in _DRY_RUN_FLAGS]
    if args and not args[0].startswith("-"):
        if "--config" in args:
            raise SystemExit(
                f"egpo-trl train: got the recipe {args[0]} and --config; give the recipe once (either form works)."
            )
        args = ["--config", args[0], *args[1:]]
    return args, is_dry_run


def in_distributed_launch(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started by ``accelerate launch``/torchrun (so it must train, not launch again)."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in _LAUNCH_ENV_VARS)


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA setup counts as no GPU here
        return 0


@dataclass
class LaunchPlan:
    """How ``egpo-trl train`` runs a recipe: accelerate's launch options, ``None`` where unset."""

    recipe: str | None
    accelerate_config: str | None
    accelerate_settings: dict[str, Any] = field(default_factory=dict)
    num_processes: int | None = None
    main_process_port: int | None = None
    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_ip: str | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def machines(self) -> int:
        return self.num_machines or 1

    @property
    def distributed_type(self) -> str | None:
        return self.accelerate_settings.get("distributed_type") if self.accelerate_config else None

    @property
    def uses_deepspeed(self) -> bool:
        return self.distributed_type == "DEEPSPEED" or bool(self.accelerate_settings.get("use_deepspeed"))

    @property
    def zero_stage(self) -> int | None:
        ds = self.accelerate_settings.get("deepspeed_config") or {}
        return ds.get("zero_stage") if self.uses_deepspeed else None

    @property
    def world_size(self) -> int:
        if self.accelerate_config is None:
            return 1
        if self.num_processes is not None:
            return self.num_processes
        return int(self.accelerate_settings.get("num_processes") or 1)


def _integer_setting(argv: Sequence[str], recipe: dict[str, Any], name: str, minimum: int) -> int | None:
    """``--name`` from the command line, else the recipe's ``name``, as an integer (``None`` when unset or none)."""
    value = option_value(argv, name) or recipe.get(name)
    if value is None or str(value).lower() in _NONE_VALUES:
        return None
    try:
        value = int(value)
    except ValueError:
        raise SystemExit(f"egpo-trl train: {name} must be an integer, got {value!r}.") from None
    if value < minimum:
        raise SystemExit(f"egpo-trl train: {name} must be >= {minimum}, got {value}.")
    return value


def plan_launch(argv: Sequence[str]) -> LaunchPlan:
    """The launch of ``argv``: the command line's launch options, else the recipe's; ``num_processes`` defaults to
    the GPUs this machine sees times ``num_machines``."""
    argv = list(argv)
    recipe = option_value(argv, "config")
    data = load_recipe(recipe, "recipe") if recipe else {}
    accelerate_config = option_value(argv, "accelerate_config") or data.get("accelerate_config")
    if accelerate_config is not None and str(accelerate_config).lower() in _NONE_VALUES:
        accelerate_config = None
    num_processes = _integer_setting(argv, data, "num_processes", minimum=1)
    main_process_port = _integer_setting(argv, data, "main_process_port", minimum=1)
    num_machines = _integer_setting(argv, data, "num_machines", minimum=1)
    machine_rank = _integer_setting(argv, data, "machine_rank", minimum=0)
    main_process_ip = option_value(argv, "main_process_ip") or data.get("main_process_ip")
    machines = num_machines or 1
    if machines > 1 or machine_rank or main_process_ip:
        if accelerate_config is None:
            raise SystemExit(
                "egpo-trl train: num_machines, machine_rank and main_process_ip are settings of an accelerate launch; "
                "set accelerate_config too (e.g. --accelerate_config recipes/accelerate/ddp.yaml)."
            )
        if machine_rank is not None and machine_rank >= machines:
            raise SystemExit(
                f"egpo-trl train: machine_rank {machine_rank} is not below num_machines {machines}; number the "
                "machines 0 to num_machines - 1."
            )
        if machines > 1 and not main_process_ip:
            raise SystemExit(
                f"egpo-trl train: a launch over {machines} machines needs --main_process_ip (the address of the "
                "machine of rank 0, which every machine reaches) and --machine_rank on each machine."
            )
        if machines > 1 and machine_rank is None:
            raise SystemExit(
                f"egpo-trl train: a launch over {machines} machines needs --machine_rank (0 on the machine at "
                f"{main_process_ip}, 1 to {machines - 1} on the others)."
            )
    settings: dict[str, Any] = {}
    if accelerate_config is not None:
        settings = load_recipe(accelerate_config, "accelerate config")
        if num_processes is None and not settings.get("use_cpu"):
            num_processes = (_visible_gpus() * machines) or None
    if num_processes is not None and num_processes % machines:
        raise SystemExit(
            f"egpo-trl train: num_processes {num_processes} (the total over the machines) is not a multiple of "
            f"num_machines {machines}; give every machine as many processes, e.g. --num_processes "
            f"{machines * max(1, num_processes // machines)}."
        )
    return LaunchPlan(
        recipe=recipe,
        accelerate_config=str(accelerate_config) if accelerate_config is not None else None,
        accelerate_settings=settings,
        num_processes=num_processes,
        main_process_port=main_process_port,
        num_machines=num_machines,
        machine_rank=machine_rank,
        main_process_ip=str(main_process_ip) if main_process_ip else None,
        argv=argv,
    )


def launch_command(plan: LaunchPlan, executable: Sequence[str] = ("accelerate", "launch")) -> list[str]:
    """The ``accelerate launch`` command line of a plan (``executable`` replaces ``accelerate launch``)."""
    if plan.accelerate_config is None:
        return ["egpo-trl", "train", *plan.argv]
    command = [*executable, "--config_file", plan.accelerate_config]
    if plan.num_processes is not None:
        command += ["--num_processes", str(plan.num_processes)]
    if plan.num_machines is not None:
        command += ["--num_machines", str(plan.num_machines)]
    if plan.machine_rank is not None:
        command += ["--machine_rank", str(plan.machine_rank)]
    if plan.main_process_ip is not None:
        command += ["--main_process_ip", plan.main_process_ip]
    if plan.main_process_port is not None:
        command += ["--main_process_port", str(plan.main_process_port)]
    return [*command, "-m", "egpo_trl.train", *plan.argv]


def _printable(command: Sequence[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


def launch_if_requested(argv: Sequence[str]) -> int | None:
    """Run (and print) the recipe's ``accelerate launch`` after the dry run's checks; ``None``: train here."""
    if in_distributed_launch():
        return None
    plan = plan_launch(argv)
    if plan.accelerate_config is None:
        return None
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the checks download nothing; the launch gets the environment as it was
    try:
        problems = check_recipe(argv).problems
    finally:
        if offline is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = offline
    if problems:
        more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        recipe = f"{plan.recipe} " if plan.recipe else ""
        raise SystemExit(
            f"egpo-trl train: {problems[0]}{more} Nothing was launched; `egpo-trl train {recipe}--dry-run` lists "
            "every check."
        )
    print(f"Launching: {_printable(launch_command(plan))}", flush=True)
    # `python -m accelerate.commands.launch` is `accelerate launch` without relying on the console script.
    command = launch_command(plan, executable=(sys.executable, "-m", "accelerate.commands.launch"))
    process = subprocess.Popen(command)
    try:
        return process.wait()
    except KeyboardInterrupt:  # the launched processes got the Ctrl-C too: let them save and say how to resume
        try:
            process.wait(timeout=120)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            process.kill()
        return 130


def configure_tracking(training_args) -> None:
    """``WANDB_PROJECT`` defaults to ``project`` and ``WANDB_DIR`` to ``output_dir`` (the environment wins)."""
    report_to = training_args.report_to or []
    if isinstance(report_to, str):
        report_to = [report_to]
    if "wandb" not in report_to and "all" not in report_to:
        return
    if training_args.project:
        os.environ.setdefault("WANDB_PROJECT", training_args.project)
    os.environ.setdefault("WANDB_DIR", str(training_args.output_dir))
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------------------------------------- dry run
@dataclass
class DryRunReport:
    """What ``--dry-run`` found: resolved settings, problems (fatal) and notes."""

    settings: list[tuple[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: str | None = None
    precision: str | None = None
    needs_gpu: list[str] = field(default_factory=list)  # what needs a GPU on this machine that sees none

    def render(self) -> str:
        width = max((len(k) for k, _ in self.settings), default=0)
        lines = ["Resolved settings:"]
        lines += [f"  {key.ljust(width)}  {value}" for key, value in self.settings]
        if self.command:
            lines += ["", "Launch command:", f"  {self.command}"]
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {note}" for note in self.notes]
        lines.append("")
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s) found:")
            lines += [f"  - {problem}" for problem in self.problems]
        else:
            lines.append("No problems found: the recipe is ready to run.")
        return "\n".join(lines)


def _looks_local(name: str) -> bool:
    """A dataset name that can only be a local path (a Hub id is ``name`` or ``owner/name``)."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or Path(name).suffix in (".json", ".jsonl", ".csv", ".parquet")
    )


def _check_dataset(script_args, report: DryRunReport) -> None:
    name = script_args.dataset_name
    if name.startswith(SYNTHETIC_DATASET_PREFIX):
        report.notes.append(f"dataset: built-in synthetic task {name}.")
        return
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file()):
            from datasets import DatasetDict, load_from_disk

            try:
                loaded = load_from_disk(str(path))
            except Exception as error:  # noqa: BLE001 - any failure is reported
                report.problems.append(f"dataset {path} cannot be read with load_from_disk: {error}")
                return
            splits = loaded if isinstance(loaded, DatasetDict) else {script_args.dataset_train_split: loaded}
            if script_args.dataset_train_split not in splits:
                report.problems.append(
                    f"dataset {path} has no split {script_args.dataset_train_split!r} (splits: {list(splits)}); set "
                    "dataset_train_split."
                )
                return
            train = splits[script_args.dataset_train_split]
            problem = column_problem(train.column_names, script_args)
            if problem:
                report.problems.append(problem.replace("the dataset", f"dataset {path}", 1))
            report.settings.append(("train rows", len(train)))
        return
    if _looks_local(name):
        report.problems.append(
            f"dataset {name} does not exist. Build OpenR1-Stable-10k with `egpo-trl data build --config "
            "recipes/data/openr1_stable_10k.yaml` (it writes outputs/data/openr1_stable_10k/dataset), or point "
            "dataset_name at a Hub dataset."
        )
    else:
        report.notes.append(f"dataset: {name} is loaded from the Hugging Face Hub at run time (not checked).")


def _check_output_dir(script_args, training_args, report: DryRunReport) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    path = Path(training_args.output_dir)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        report.problems.append(f"output_dir {path} is not writable ({existing} is read-only); choose another folder.")
    resume = training_args.resume_from_checkpoint
    resuming = resume is not None and str(resume).lower() not in _NONE_VALUES
    if resuming and str(resume).lower() in ("true", "last", "latest"):
        if not path.is_dir() or get_last_checkpoint(str(path)) is None:
            report.problems.append(
                f"resume_from_checkpoint={resume} but {path} has no checkpoint-* folder; give a checkpoint path or "
                "start a new run."
            )
        else:
            report.settings.append(("resumes from", get_last_checkpoint(str(path))))
    elif resuming:
        if not Path(resume).is_dir():
            report.problems.append(f"resume_from_checkpoint={resume} does not exist.")
        else:
            report.settings.append(("resumes from", resume))
            from egpo_trl.script.resume import checkpoint_step, later_checkpoints

            own = Path(resume).resolve().parent == path.resolve()
            later = later_checkpoints(path, checkpoint_step(resume)) if own else []
            if later:
                report.notes.append(
                    f"{', '.join(c.name for c in later)} of {path} come after the checkpoint resumed from: the run "
                    "sets them aside, with the records of their steps, in replaced/<time>-from-step-N/."
                )
    if path.is_dir() and not resuming:
        found = [p.name for p in sorted(path.glob("checkpoint-*")) if p.is_dir()]
        found += [name for name in RUN_MARKERS if (path / name).exists()]
        if found and script_args.overwrite_output_dir:
            report.notes.append(f"overwrite_output_dir: the earlier run's outputs in {path} will be removed.")
        elif found:
            report.problems.append(
                f"output_dir {path} already holds another run ({', '.join(found[:5])}); choose a new output_dir, "
                "resume with --resume_from_checkpoint true, or pass --overwrite_output_dir true."
            )


def _check_context(script_args, training_args, model_args, report: DryRunReport) -> None:
    completion = training_args.max_completion_length
    prompt = script_args.max_prompt_length
    total = (prompt or 0) + completion
    vllm_length = training_args.vllm_max_model_length
    if training_args.use_vllm and vllm_length is not None and prompt is not None and vllm_length < total:
        report.problems.append(
            f"vllm_max_model_length={vllm_length} < max_prompt_length + max_completion_length = {total}: vLLM would "
            "cut generations short; raise vllm_max_model_length."
        )
    try:
        path = resolve_model_path(model_args.model_name_or_path)
    except SystemExit as error:
        report.problems.append(str(error).removeprefix("egpo-trl train: "))
        return
    problem = model_problem(path)
    if problem:
        report.problems.append(problem)
        return
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
            local_files_only=True,
        )
    except Exception:  # noqa: BLE001 - not available offline: nothing to check against
        report.settings.append(("model context", f"not checked ({path} is not available locally)"))
        return
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text_config, "max_position_embeddings", None)
    if context is None:
        report.settings.append(("model context", "not checked (the model config has no max_position_embeddings)"))
        return
    report.settings.append(("model context", f"{context} tokens"))
    if total > context:
        what = "max_prompt_length + max_completion_length" if prompt is not None else "max_completion_length"
        report.problems.append(
            f"{what} = {total} exceeds the model's context ({context} tokens); lower max_completion_length."
        )
    if training_args.use_vllm and vllm_length is not None and vllm_length > context:
        report.problems.append(f"vllm_max_model_length={vllm_length} exceeds the model's context ({context} tokens).")
    if prompt is None:
        report.notes.append(
            "max_prompt_length is not set: only max_completion_length was checked against the model's context."
        )


def _check_importance_sampling(training_args, report: DryRunReport) -> None:
    """Say whether TRL's vLLM importance-sampling correction is on (the paper recipes turn it off)."""
    if not training_args.use_vllm:
        return
    if training_args.vllm_importance_sampling_correction:
        mode = training_args.vllm_importance_sampling_mode
        report.settings.append(("vLLM importance sampling", f"on ({mode}, ratios capped at 3)"))
        if mode.startswith("sequence") and training_args.max_completion_length >= 1024:
            report.notes.append(
                f"vllm_importance_sampling_mode={mode} weights the loss by a ratio summed over up to "
                f"{training_args.max_completion_length} tokens, which drifts far below 1 from bf16 differences alone "
                "(docs/multi_gpu.md); prefer token_truncate, or turn the correction off as the paper recipes do."
            )
    else:
        report.settings.append(("vLLM importance sampling", "off (the paper's setup)"))


# Bytes a checkpoint holds per parameter: bf16 weights plus fp32 master weights and Adam's two moments.
_CHECKPOINT_BYTES_PER_PARAMETER = 14


def _model_parameters(name_or_path: str, model_args, training_args) -> int | None:
    """Parameter count of a locally available model, from its config alone (no weights are read)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(
            resolve_model_path(name_or_path),
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
            local_files_only=True,
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=training_args.trust_remote_code)
        return sum(p.numel() for p in model.parameters())
    except (Exception, SystemExit):  # noqa: BLE001 - not available offline or not a causal LM: nothing to estimate
        return None


def _check_disk(training_args, model_args, report: DryRunReport) -> None:
    """How much disk the run's checkpoints take, against the free space where they go."""
    import shutil

    parameters = _model_parameters(model_args.model_name_or_path, model_args, training_args)
    if parameters is None:
        report.settings.append(("checkpoint size", "not estimated (the model's config is not available locally)"))
        return
    checkpoint = parameters * _CHECKPOINT_BYTES_PER_PARAMETER
    final = parameters * 2
    saves = training_args.save_strategy not in ("no", None)  # SaveStrategy is a str enum: NO == "no"
    kept = training_args.save_total_limit
    needed = final + (checkpoint * ((kept or 1) + 1) if saves else 0)  # one more while the oldest is rotated out
    folder = Path(training_args.output_dir).resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    gb = 1e9
    kept_text = (
        f"save_total_limit {kept} keeps" if kept else "every checkpoint is kept (no save_total_limit), at least"
    )
    report.settings.append(
        (
            "checkpoint size",
            f"~{checkpoint / gb:.0f} GB each ({parameters / 1e9:.2f}B parameters x {_CHECKPOINT_BYTES_PER_PARAMETER} "
            f"bytes: weights, fp32 master weights and Adam moments); {kept_text} ~{needed / gb:.0f} GB with the final "
            f"model; {free / gb:.0f} GB free in {folder}",
        )
    )
    if saves and free < checkpoint + final:
        report.problems.append(
            f"{folder} has {free / gb:.0f} GB free but one checkpoint takes ~{checkpoint / gb:.0f} GB (the Trainer also "
            "saves one at the last step): point output_dir at a larger disk, or set save_strategy: no."
        )
    elif free < needed:
        report.notes.append(
            f"{folder} has {free / gb:.0f} GB free, less than the ~{needed / gb:.0f} GB the kept checkpoints and the "
            "final model can take: lower save_total_limit or free some space."
        )


def _check_wandb(training_args, report: DryRunReport) -> None:
    report_to = training_args.report_to or []
    if "wandb" not in report_to and "all" not in report_to:
        return
    if importlib.util.find_spec("wandb") is None:
        report.problems.append("report_to includes wandb but wandb is not installed: pip install wandb.")
        return
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        report.notes.append(f"wandb: WANDB_MODE={mode}.")
    elif not os.environ.get("WANDB_API_KEY") and not (Path.home() / ".netrc").is_file():
        report.notes.append(
            "wandb: no API key found (WANDB_API_KEY or `wandb login`); without network set WANDB_MODE=offline and "
            "upload later with `wandb sync`."
        )


def _check_loss_forward(args, model_args, report: DryRunReport, plan: LaunchPlan | None = None) -> None:
    """``loss_forward``'s checks made before the model loads, and its memory notes."""
    if getattr(args, "egpo_entropy_logps", None) != "loss_forward":
        return
    from egpo_trl.config import loss_forward_error
    from egpo_trl.fused import block_memory_note, block_size
    from egpo_trl.input_checks import loss_forward_input_problems

    blocks = block_size(args.per_device_train_batch_size, args.num_generations)
    if blocks > 1 and not args.gradient_checkpointing:
        report.notes.append(block_memory_note(args.per_device_train_batch_size, blocks))
    if blocks > 1 and plan is not None and plan.zero_stage == 3:
        report.notes.append(
            f"egpo_entropy_logps=loss_forward under ZeRO-3 holds each block's {blocks} forwards until their backwards, "
            "more memory than the no-grad pass; for ZeRO-3's lower memory, --egpo_entropy_logps policy."
        )
    peft = {"lora_dropout": model_args.lora_dropout} if model_args.use_peft else None
    problems = loss_forward_input_problems(model_args.model_name_or_path, peft, args.model_init_kwargs)
    if problems:
        report.problems.append(loss_forward_error(problems))


def _launch_engine(plan: LaunchPlan | None) -> str | None:
    """The distributed engine of a launch, as ``EGPOConfig``'s checks name it."""
    if plan is None:
        return None
    if plan.uses_deepspeed:
        return "DeepSpeed"
    return "FSDP" if plan.distributed_type == "FSDP" else None


def _parse_for_dry_run(argv: list[str], report: DryRunReport, plan: LaunchPlan | None = None):
    """``parse_args`` for the launch's process count and engine (``plan``) rather than this process's, and
    without a GPU for bf16; problems go to ``report``."""
    from unittest import mock

    from egpo_trl.config import EGPOConfig

    any_group = math.lcm(*range(1, 65))

    launch = (plan.world_size if plan is not None else 1, _launch_engine(plan))

    def parse(args, world: int = any_group):
        try:
            with (
                mock.patch.object(EGPOConfig, "world_size", property(lambda self: world)),
                mock.patch.object(EGPOConfig, "_loss_forward_launch", lambda self: launch),
            ):
                return parse_args(args)
        except SystemExit as error:
            # A generation_batch_size sets steps_per_generation from the process count: parse for the launch's own.
            if world == launch[0] or "must be divisible by the global batch size" not in str(error):
                raise
            return parse(args, launch[0])

    try:
        return parse(argv)
    except SystemExit as error:
        message = str(error)
        if ("bf16" in message or "fp16" in message) and _visible_gpus() == 0:
            report.needs_gpu.append("bf16" if "bf16" in message else "fp16")
            report.precision = "bf16" if "--bf16" not in argv and "bf16" in message else None
            report.precision = f"{report.precision or 'bf16/fp16'} (as the recipe says; not checked without a GPU)"
            try:
                return parse([*argv, "--bf16", "false", "--fp16", "false"])
            except SystemExit as second:
                message = str(second)
                argv = [*argv, "--bf16", "false", "--fp16", "false"]
        report.problems.append(message.removeprefix("egpo-trl train: "))
        if "egpo_entropy_logps='loss_forward' cannot be used here" in message:
            # Listed; the other checks still run, on the settings with the no-grad pass instead.
            try:
                return parse([*argv, "--egpo_entropy_logps", "policy"])
            except SystemExit as second:
                report.problems.append(str(second).removeprefix("egpo-trl train: "))
        return None


def dry_run(argv: Sequence[str]) -> int:
    """Print :func:`check_recipe`'s report; 1 when it lists a problem."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = check_recipe(argv)
    print(report.render(), flush=True)
    return 1 if report.problems else 0


def _dynamic_sampling_setting(args: Any, world: int) -> str:
    """Dynamic sampling's rounds, and its oversampled first round's size."""
    from egpo_trl.sampling.dynamic import first_round_groups

    line = f"up to {args.dynamic_sampling_max_rounds} rounds per generation batch ({args.dynamic_sampling_metric})"
    target, extra = first_round_groups(args, world)
    if extra:
        sequences = (target + extra) * args.num_generations
        line += (
            f"; first round {target} + {extra} groups ({(target + extra) / target:.3g}x), {sequences} completions, "
            f"{sequences // world} per process"
        )
    return line


def check_recipe(argv: Sequence[str]) -> DryRunReport:
    """The checks of ``--dry-run``, without printing: the resolved settings, problems and notes."""
    report = DryRunReport()
    argv = list(argv)
    plan = None
    try:
        plan = plan_launch(argv)
    except SystemExit as error:
        report.problems.append(str(error).removeprefix("egpo-trl train: "))
    parsed = _parse_for_dry_run(argv, report, plan)
    on_cpu = plan is not None and plan.accelerate_settings.get("use_cpu")
    if parsed is not None and parsed[1].use_vllm and not (parsed[1].use_cpu or on_cpu) and _visible_gpus() == 0:
        report.needs_gpu.insert(0, "use_vllm")

    if plan is not None:
        report.settings.append(("recipe", plan.recipe))
        script = script_problem(plan.recipe) if plan.recipe else None
        if script:
            report.notes.append(script)
        if plan.accelerate_config is None:
            report.settings.append(("launch", "in this process (no accelerate_config)"))
        else:
            report.settings.append(
                ("accelerate config", f"{plan.accelerate_config} ({plan.distributed_type or 'no distributed_type'})")
            )
            report.settings.append(("processes", plan.world_size))
            if plan.machines > 1:
                report.settings.append(
                    (
                        "machines",
                        f"{plan.machines} x {plan.world_size // plan.machines} processes; this one is rank "
                        f"{plan.machine_rank}, rendezvous at {plan.main_process_ip}:{plan.main_process_port or 29500}",
                    )
                )
            if plan.uses_deepspeed:
                report.settings.append(("DeepSpeed ZeRO stage", plan.zero_stage))
                if importlib.util.find_spec("deepspeed") is None:
                    report.problems.append(
                        f"{plan.accelerate_config} uses DeepSpeed, which is not installed: pip install deepspeed (or "
                        "use recipes/accelerate/ddp.yaml)."
                    )
            gpus = _visible_gpus()
            if not plan.accelerate_settings.get("use_cpu"):
                if gpus == 0 and not report.needs_gpu:  # with them, a problem below
                    report.notes.append(
                        f"this machine sees no GPU; the launch needs {plan.world_size // plan.machines} on each of "
                        f"{plan.machines} machine(s)."
                        if plan.machines > 1
                        else f"this machine sees no GPU; the launch needs {plan.world_size}."
                    )
                elif 0 < gpus < plan.world_size // plan.machines:
                    report.problems.append(
                        f"the launch needs {plan.world_size // plan.machines} GPUs on this machine but it sees {gpus}; "
                        "set num_processes (the total over the machines)."
                    )
        report.command = _printable(launch_command(plan))

    if parsed is not None:
        script_args, args, model_args = parsed
        world = plan.world_size if plan is not None else 1
        steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
        generation_batch = args.per_device_train_batch_size * world * steps_per_generation
        batch, batch_note = batch_summary(argv, args, world)
        if batch_note:
            report.notes.append(batch_note)
        report.settings += [
            ("model", model_args.model_name_or_path),
            ("dataset", f"{script_args.dataset_name} (split {script_args.dataset_train_split})"),
            ("method", args.advantage_estimator),
            ("output_dir", args.output_dir),
            ("completions per prompt", args.num_generations),
            ("batch", batch),
            ("generation batch", f"{generation_batch} completions every {steps_per_generation} step(s)"),
            ("learning rate", args.learning_rate),
            ("length", f"epochs {args.num_train_epochs:g}" if args.max_steps <= 0 else f"max_steps {args.max_steps}"),
            ("max_prompt_length", script_args.max_prompt_length),
            ("max_completion_length", args.max_completion_length),
            ("sampling", f"temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}"),
            ("precision", report.precision or ("bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32"))),
            ("gradient checkpointing", args.gradient_checkpointing),
            ("report_to", ", ".join(args.report_to or []) or "none"),
            ("project / run_name", f"{args.project} / {args.run_name}"),
        ]
        if args.advantage_estimator == "egpo":
            report.settings.append(("egpo lambda min / max", f"{args.egpo_lambda_min} / {args.egpo_lambda_max}"))
        if args.dynamic_sampling:
            report.settings.append(("dynamic sampling", _dynamic_sampling_setting(args, world)))
        batch_problem = batch_shape_problem(
            args.per_device_train_batch_size,
            world,
            args.gradient_accumulation_steps,
            args.num_generations,
            steps_per_generation if steps_per_generation != args.gradient_accumulation_steps else None,
        )
        if batch_problem:
            report.problems.append(batch_problem)
        if args.use_vllm:
            engine = ""
            if args.vllm_mode == "colocate":  # each engine decodes its tensor-parallel group's prompts together
                from egpo_trl.sampling.dynamic import colocated_engine_sequences

                rows, oversampled = colocated_engine_sequences(args, world)
                engine = f", max_num_seqs {rows} per engine" + (
                    " (the oversampled first round)" if oversampled else ""
                )
            report.settings.append(
                (
                    "vLLM",
                    f"mode {args.vllm_mode}, gpu_memory_utilization {args.vllm_gpu_memory_utilization}, "
                    f"sleep mode {args.vllm_enable_sleep_mode}, max_model_length {args.vllm_max_model_length}, "
                    f"tensor_parallel_size {args.vllm_tensor_parallel_size}{engine}",
                )
            )
            if importlib.util.find_spec("vllm") is None:
                report.problems.append(
                    "use_vllm is true but vLLM is not installed: pip install vllm (or pass --use_vllm false to "
                    "generate with transformers)."
                )
            if args.vllm_mode == "colocate" and world % args.vllm_tensor_parallel_size != 0:
                report.problems.append(
                    f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} does not divide the {world} processes."
                )
            if args.vllm_mode == "server":
                report.notes.append("vllm_mode server: a `trl vllm-serve` server must be running before the launch.")
        if plan is not None and plan.zero_stage == 3 and script_args.eval_size > 0:
            report.problems.append(
                "the held-out check (eval_size > 0) generates on the main process only, which ZeRO-3's sharded "
                "weights do not allow; set eval_size: 0 and evaluate the saved model with `egpo-trl eval`."
            )
        _check_context(script_args, args, model_args, report)
        _check_loss_forward(args, model_args, report, plan)
        _check_dataset(script_args, report)
        _check_output_dir(script_args, args, report)
        _check_wandb(args, report)
        _check_importance_sampling(args, report)
        _check_disk(args, model_args, report)
    if report.needs_gpu:  # first: nothing else matters on this machine
        processes = (
            f"{plan.world_size // plan.machines} GPUs" if plan is not None and plan.accelerate_config else "a GPU"
        )
        report.problems.insert(
            0,
            f"this machine sees no GPU, but the recipe needs {processes} ({', '.join(report.needs_gpu)}): run it on a "
            "machine with GPUs (recipes/demo_tiny_cpu.yaml trains on CPU).",
        )
    report.problems = list(dict.fromkeys(report.problems))  # a recipe that cannot be read is reported once
    return report


def batch_summary(argv: Sequence[str], args: Any, world: int) -> tuple[str, str | None]:
    """The completions and prompts of one optimizer step over all processes, and a note when they differ from the
    recipe's own (its batch sizes over its ``num_processes``, or its accelerate config's)."""
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    batch = per_device * world * accumulation
    line = (
        f"{per_device} per device x {world} processes x {accumulation} accumulation = {batch} completions "
        f"({batch / args.num_generations:g} prompts) per optimizer step"
    )
    own = _recipe_batch(option_value(argv, "config"))
    if own is None or own[0] == batch:
        return line, None
    recipe_batch, recipe_processes = own
    fix = ""
    if recipe_batch % (per_device * world) == 0:
        needed = recipe_batch // (per_device * world)
        how = "halve" if 2 * needed == accumulation else ("double" if needed == 2 * accumulation else "set")
        fix = f"; to keep the recipe's, {how} gradient_accumulation_steps (--gradient_accumulation_steps {needed})"
    processes = f", {world} processes for its {recipe_processes}" if world != recipe_processes else ""
    return line, (
        f"this launch's optimizer step takes {batch} completions, {batch / recipe_batch:g}x the recipe's "
        f"{recipe_batch}{processes}{fix}."
    )


def _recipe_batch(recipe: str | None) -> tuple[int, int] | None:
    """``(completions per optimizer step, processes)`` as the recipe file itself sets them (``None`` when unknown)."""
    from egpo_trl.config import EGPOConfig

    if recipe is None:
        return None
    data = load_recipe(recipe)
    defaults = EGPOConfig.__dataclass_fields__
    try:
        per_device = int(data.get("per_device_train_batch_size", defaults["per_device_train_batch_size"].default))
        accumulation = int(data.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"].default))
        processes = data.get("num_processes")
        config = data.get("accelerate_config")
        if processes is None and config is not None and str(config).lower() not in _NONE_VALUES:
            processes = load_recipe(config, "accelerate config").get("num_processes")
        processes = int(processes or 1)
    except (TypeError, ValueError, SystemExit):
        return None
    return per_device * processes * accumulation, processes
