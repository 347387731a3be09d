"""``accelerate launch`` behind ``egpo-trl train <recipe>``, the ``--dry-run`` checks, and wandb tracking."""

from __future__ import annotations

import importlib.util
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from egpo_trl.script.args import option_value, parse_args
from egpo_trl.script.data import SYNTHETIC_DATASET_PREFIX
from egpo_trl.script.recipe import load_recipe, script_problem
from egpo_trl.script.resolve import resolve_model_path

# `accelerate launch` options a recipe key or a flag sets, in the order they are passed on.
_LAUNCH_OPTIONS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")
_DRY_RUN_FLAGS = ("--dry-run", "--dry_run")
_PROG = "egpo-trl train: "


def is_none(value: Any) -> bool:
    return value is None or str(value).lower() in ("", "none", "null", "false")


def normalize_argv(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``(argv, dry_run)``: a leading recipe path turned into ``--config <recipe>``, ``--dry-run`` taken out."""
    args = [a for a in argv if a not in _DRY_RUN_FLAGS]
    if args and not args[0].startswith("-"):
        if "--config" in args:
            raise SystemExit(f"{_PROG}got the recipe {args[0]} and --config; give the recipe once.")
        args = ["--config", *args]
    return args, any(a in _DRY_RUN_FLAGS for a in argv)


def in_distributed_launch() -> bool:
    """Whether ``accelerate launch``/torchrun started this process (so it must train, not launch again)."""
    return any(name in os.environ for name in ("LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_MIXED_PRECISION"))


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


@dataclass
class LaunchPlan:
    """How ``egpo-trl train`` runs a recipe: its accelerate config (``None``: in this process) and that config's
    settings, the ``accelerate launch`` options (``_LAUNCH_OPTIONS``, ``None`` when unset) and the arguments."""

    recipe: str | None
    accelerate_config: str | None
    argv: list[str]
    settings: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name in _LAUNCH_OPTIONS:
            return self.options.get(name)
        raise AttributeError(name)

    @property
    def machines(self) -> int:
        return self.num_machines or 1

    @property
    def engine(self) -> str | None:
        """The distributed engine, as ``EGPOConfig``'s checks name it."""
        kind = self.settings.get("distributed_type")
        if kind == "DEEPSPEED" or self.settings.get("use_deepspeed"):
            return "DeepSpeed"
        return "FSDP" if kind == "FSDP" else None

    @property
    def zero_stage(self) -> int | None:
        return (self.settings.get("deepspeed_config") or {}).get("zero_stage") if self.engine == "DeepSpeed" else None

    @property
    def world_size(self) -> int:
        configured = int(self.settings.get("num_processes") or 1)
        return 1 if self.accelerate_config is None else self.num_processes or configured


def _option(argv: Sequence[str], recipe: dict[str, Any], name: str) -> Any:
    """``--name`` from the command line, else the recipe's ``name``; ``None`` when unset or none."""
    value = option_value(argv, name) or recipe.get(name)
    if is_none(value) or name in ("accelerate_config", "main_process_ip"):
        return None if is_none(value) else str(value)
    minimum = 0 if name == "machine_rank" else 1
    if not str(value).isdigit() or int(value) < minimum:
        raise SystemExit(f"{_PROG}{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def plan_launch(argv: Sequence[str]) -> LaunchPlan:
    """The launch of ``argv``: the command line's launch options, else the recipe's (default: GPUs x machines)."""
    argv = list(argv)
    recipe = option_value(argv, "config")
    data = load_recipe(recipe, "recipe") if recipe else {}
    plan = LaunchPlan(recipe, _option(argv, data, "accelerate_config"), argv)
    plan.options = {name: _option(argv, data, name) for name in _LAUNCH_OPTIONS}
    machines = plan.machines
    if machines > 1 or plan.machine_rank or plan.main_process_ip:
        if plan.accelerate_config is None:
            raise SystemExit(
                f"{_PROG}num_machines, machine_rank and main_process_ip are settings of an accelerate launch; set "
                "accelerate_config too (e.g. --accelerate_config recipes/accelerate/ddp.yaml)."
            )
        if (machines > 1 and None in (plan.main_process_ip, plan.machine_rank)) or (
            plan.machine_rank or 0
        ) >= machines:
            raise SystemExit(
                f"{_PROG}a launch over {machines} machine(s) needs --main_process_ip (the address of the machine of "
                f"rank 0, which every machine reaches) and, on each machine, its --machine_rank 0 to {machines - 1}."
            )
    if plan.accelerate_config is not None:
        plan.settings = load_recipe(plan.accelerate_config, "accelerate config")
        if plan.num_processes is None and not plan.settings.get("use_cpu"):
            plan.options["num_processes"] = (_visible_gpus() * machines) or None
    if (plan.num_processes or 0) % machines:
        raise SystemExit(
            f"{_PROG}num_processes {plan.num_processes} (the total over the machines) is not a multiple of "
            f"num_machines {machines}; give every machine as many processes, e.g. --num_processes "
            f"{machines * max(1, plan.num_processes // machines)}."
        )
    return plan


def launch_command(plan: LaunchPlan, executable: Sequence[str] = ("accelerate", "launch")) -> list[str]:
    """The ``accelerate launch`` command line of a plan (``executable`` replaces ``accelerate launch``)."""
    if plan.accelerate_config is None:
        return ["egpo-trl", "train", *plan.argv]
    options = [item for name, value in plan.options.items() if value is not None for item in (f"--{name}", str(value))]
    return [*executable, "--config_file", plan.accelerate_config, *options, "-m", "egpo_trl.train", *plan.argv]


def launch_if_requested(argv: Sequence[str]) -> int | None:
    """Run (and print) the recipe's ``accelerate launch`` after the dry run's checks; ``None``: train here."""
    if in_distributed_launch():
        return None
    plan = plan_launch(argv)
    if plan.accelerate_config is None:
        return None
    with mock.patch.dict(os.environ, HF_HUB_OFFLINE="1"):  # the checks download nothing
        problems = check_recipe(argv).problems
    if problems:
        more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        check = f"`egpo-trl train {plan.recipe + ' ' if plan.recipe else ''}--dry-run` lists every check."
        raise SystemExit(f"{_PROG}{problems[0]}{more} Nothing was launched; {check}")
    print(f"Launching: {shlex.join(launch_command(plan))}", flush=True)
    process = subprocess.Popen(launch_command(plan, executable=(sys.executable, "-m", "accelerate.commands.launch")))
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
    if "wandb" in training_args.report_to:  # a list once TrainingArguments has parsed it
        if training_args.project:
            os.environ.setdefault("WANDB_PROJECT", training_args.project)
        Path(os.environ.setdefault("WANDB_DIR", str(training_args.output_dir))).mkdir(parents=True, exist_ok=True)


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
        lines = ["Resolved settings:", *(f"  {key.ljust(width)}  {value}" for key, value in self.settings)]
        if self.command:
            lines += ["", "Launch command:", f"  {self.command}"]
        if self.notes:
            lines += ["", "Notes:", *(f"  - {note}" for note in self.notes)]
        if self.problems:
            lines += ["", f"{len(self.problems)} problem(s) found:", *(f"  - {p}" for p in self.problems)]
        else:
            lines += ["", "No problems found: the recipe is ready to run."]
        return "\n".join(lines)


def _check_dataset(script_args, report: DryRunReport) -> None:
    """The run's own loading of a local or synthetic dataset; a Hub dataset is loaded at run time."""
    from egpo_trl.script.data import DATA_FILE_BUILDERS, load_datasets

    name = script_args.dataset_name
    path = Path(name).expanduser()
    if not (path.exists() or name.startswith(SYNTHETIC_DATASET_PREFIX)):
        local = name.startswith((".", "/", "~")) or name.count("/") > 1
        if local or path.suffix in DATA_FILE_BUILDERS:
            return report.problems.append(
                f"dataset {name} does not exist. Build OpenR1-Stable-10k with `egpo-trl data build --config "
                "recipes/data/openr1_stable_10k.yaml` (it writes outputs/data/openr1_stable_10k/dataset), or point "
                "dataset_name at a Hub dataset."
            )
        return report.notes.append(f"dataset: {name} is loaded from the Hugging Face Hub at run time (not checked).")
    import datasets

    caching = datasets.is_caching_enabled()
    datasets.disable_caching()  # the dry run writes nothing beside the user's dataset
    try:
        train, _ = load_datasets(script_args)
    except SystemExit as error:
        return report.problems.append(str(error).removeprefix(_PROG))
    except Exception as error:  # noqa: BLE001 - any failure is reported
        return report.problems.append(f"dataset {name} cannot be read: {error}")
    finally:
        if caching:
            datasets.enable_caching()
    report.settings.append(("train rows", len(train)))


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_output_dir(script_args, training_args, model_args, report: DryRunReport) -> None:
    """The run's own checks of ``output_dir`` and ``resume_from_checkpoint``."""
    from egpo_trl.script.outputs import prepare_output_dir, refuse_output_dir_over_model
    from egpo_trl.script.resume import checkpoint_step, later_checkpoints, resume_checkpoint, resumes_own_run

    path = Path(training_args.output_dir)
    if not os.access(_existing(path), os.W_OK):
        report.problems.append(f"output_dir {path} is not writable ({_existing(path)} is read-only); choose another.")
    try:
        resume = resume_checkpoint(training_args)
        own_run = resumes_own_run(resume, path)
        refuse_output_dir_over_model(str(path), model_args.model_name_or_path)
        prepare_output_dir(str(path), script_args.overwrite_output_dir, own_run, None if own_run else resume)
    except SystemExit as error:
        return report.problems.append(str(error).removeprefix(_PROG))
    if resume is None and script_args.overwrite_output_dir and path.is_dir() and any(path.iterdir()):
        report.notes.append(f"overwrite_output_dir: the earlier run's outputs in {path} will be removed.")
    later = later_checkpoints(path, checkpoint_step(resume)) if resume is not None and own_run else []
    if resume is not None:
        report.settings.append(("resumes from", resume))
    if later:
        report.notes.append(
            f"{', '.join(c.name for c in later)} of {path} come after the checkpoint resumed from: the run sets "
            "them aside, with the records of their steps, in replaced/<time>-from-step-N/."
        )


def _check_model(script_args, training_args, model_args, report: DryRunReport) -> None:
    """The model exists, the prompt and completion fit its context, and its checkpoints fit the disk."""
    from transformers import AutoConfig

    prompt, vllm_length = script_args.max_prompt_length, training_args.vllm_max_model_length
    total = (prompt or 0) + training_args.max_completion_length
    vllm = training_args.use_vllm and vllm_length is not None
    if vllm and prompt is not None and vllm_length < total:
        report.problems.append(
            f"vllm_max_model_length={vllm_length} < max_prompt_length + max_completion_length = {total}: vLLM would "
            "cut generations short; raise vllm_max_model_length."
        )
    try:
        path = resolve_model_path(model_args.model_name_or_path)
    except SystemExit as error:
        return report.problems.append(str(error).removeprefix(_PROG))
    try:
        remote = training_args.trust_remote_code
        config = AutoConfig.from_pretrained(path, revision=model_args.model_revision, trust_remote_code=remote,
                                            local_files_only=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - not available offline: nothing to check against
        return report.settings.append(("model context", f"not checked ({path} is not available locally)"))
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context is not None:
        report.settings.append(("model context", f"{context} tokens"))
        if total > context:
            what = "max_prompt_length + max_completion_length" if prompt is not None else "max_completion_length"
            report.problems.append(f"{what} = {total} exceeds the model's context ({context} tokens); lower it.")
        if vllm and vllm_length > context:
            report.problems.append(f"vllm_max_model_length={vllm_length} exceeds the model's context ({context}).")
    # The checkpoints' disk against the free space: 14 bytes a parameter (bf16 weights, fp32 master weights and
    # Adam's two moments), the parameters counted on the meta device.
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            parameters = sum(
                p.numel() for p in AutoModelForCausalLM.from_config(config, trust_remote_code=remote).parameters()
            )
    except Exception:  # noqa: BLE001 - not a causal LM: nothing to estimate
        return
    gb, checkpoint, final = 1e9, parameters * 14, parameters * 2
    kept, saves = training_args.save_total_limit, training_args.save_strategy != "no"
    needed = final + (checkpoint * ((kept or 1) + 1) if saves else 0)  # one more while the oldest is rotated out
    folder = _existing(Path(training_args.output_dir).resolve())
    free = shutil.disk_usage(folder).free
    kept_text = (
        f"save_total_limit {kept} keeps" if kept else "every checkpoint is kept (no save_total_limit), at least"
    )
    report.settings.append(("checkpoint size",
        f"~{checkpoint / gb:.0f} GB each ({parameters / 1e9:.2f}B parameters x 14 bytes); {kept_text} ~{needed / gb:.0f} "
        f"GB with the final model; {free / gb:.0f} GB free in {folder}"))  # fmt: skip
    if saves and free < checkpoint + final:
        report.problems.append(
            f"{folder} has {free / gb:.0f} GB free but one checkpoint takes ~{checkpoint / gb:.0f} GB: point "
            "output_dir at a larger disk, or set save_strategy: no."
        )


def _check_wandb(training_args, report: DryRunReport) -> None:
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
    if "wandb" not in training_args.report_to:
        return
    if importlib.util.find_spec("wandb") is None:
        report.problems.append("report_to includes wandb but wandb is not installed: pip install wandb.")
    elif not offline and not os.environ.get("WANDB_API_KEY") and not (Path.home() / ".netrc").is_file():
        report.notes.append(
            "wandb: no API key found (WANDB_API_KEY or `wandb login`); without network set WANDB_MODE=offline and "
            "upload later with `wandb sync`."
        )


def _check_loss_forward(args, model_args, report: DryRunReport, plan: LaunchPlan | None) -> None:
    """``loss_forward``'s checks made before the model loads, and its memory notes."""
    if args.egpo_entropy_logps != "loss_forward":
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
    if problems := loss_forward_input_problems(model_args.model_name_or_path, peft, args.model_init_kwargs):
        report.problems.append(loss_forward_error(problems))


def _parse_for_dry_run(argv: list[str], report: DryRunReport, plan: LaunchPlan | None):
    """``parse_args`` for the launch's process count and engine; each problem goes to ``report`` and the parse is
    retried past it (bf16 without a GPU, a batch the processes cannot split, ``loss_forward`` where it cannot run)."""
    from egpo_trl.config import EGPOConfig

    launch = (plan.world_size, plan.engine) if plan is not None else (1, None)
    world = launch[0]
    for _ in range(4):
        try:
            with (
                mock.patch.object(EGPOConfig, "world_size", property(lambda self, count=world: count)),
                mock.patch.object(EGPOConfig, "_loss_forward_launch", lambda self: launch),
            ):
                return parse_args(argv)
        except SystemExit as error:
            message = str(error).removeprefix(_PROG)
        if ("bf16" in message or "fp16" in message) and _visible_gpus() == 0 and not report.needs_gpu:
            report.needs_gpu.append("bf16" if "bf16" in message else "fp16")
            report.precision = f"{report.needs_gpu[0]} (as the recipe says; not checked without a GPU)"
            argv = [*argv, "--bf16", "false", "--fp16", "false"]
            continue
        if world != launch[0] and "global batch size" in message:
            return None  # the stand-in count below, not the launch's: the batch problem is already listed
        report.problems.append(message)
        if "not divisible by num_generations" in message:
            world = math.lcm(*range(1, 65))  # a stand-in count every group size divides, for the other checks
        elif "egpo_entropy_logps='loss_forward' cannot be used here" in message:
            argv = [*argv, "--egpo_entropy_logps", "policy"]  # the other checks, on the no-grad pass instead
        else:
            return None
    return None


def dry_run(argv: Sequence[str]) -> int:
    """Print :func:`check_recipe`'s report; 1 when it lists a problem."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = check_recipe(argv)
    print(report.render(), flush=True)
    return 1 if report.problems else 0


def _check_launch(plan: LaunchPlan, report: DryRunReport) -> None:
    """The recipe's launch: its accelerate config, processes, machines and GPUs."""
    report.settings.append(("recipe", plan.recipe))
    if plan.recipe and (script := script_problem(plan.recipe)):
        report.notes.append(script)
    report.command = shlex.join(launch_command(plan))
    if plan.accelerate_config is None:
        report.settings.append(("launch", "in this process (no accelerate_config)"))
        return
    kind = plan.settings.get("distributed_type") or "no distributed_type"
    report.settings += [("accelerate config", f"{plan.accelerate_config} ({kind})"), ("processes", plan.world_size)]
    per_machine = plan.world_size // plan.machines
    if plan.machines > 1:
        rendezvous = f"rendezvous at {plan.main_process_ip}:{plan.main_process_port or 29500}"
        rank = f"{plan.machines} x {per_machine} processes; this one is rank {plan.machine_rank}"
        report.settings.append(("machines", f"{rank}, {rendezvous}"))
    if plan.engine == "DeepSpeed":
        report.settings.append(("DeepSpeed ZeRO stage", plan.zero_stage))
        if importlib.util.find_spec("deepspeed") is None:
            report.problems.append(
                f"{plan.accelerate_config} uses DeepSpeed, which is not installed: pip install deepspeed (or use "
                "recipes/accelerate/ddp.yaml)."
            )
    gpus = None if plan.settings.get("use_cpu") else _visible_gpus()  # None: a CPU launch needs none
    if gpus == 0 and not report.needs_gpu:  # with them, a problem
        each = f" on each of {plan.machines} machine(s)" if plan.machines > 1 else ""
        report.notes.append(f"this machine sees no GPU; the launch needs {per_machine}{each}.")
    elif gpus and gpus < per_machine:
        report.problems.append(
            f"the launch needs {per_machine} GPUs on this machine but it sees {gpus}; set num_processes (the total "
            "over the machines)."
        )


def _check_vllm(args, world: int, report: DryRunReport) -> None:
    engine, tp = "", args.vllm_tensor_parallel_size
    if args.vllm_mode == "colocate":  # each engine decodes its tensor-parallel group's prompts together
        from egpo_trl.sampling.dynamic import colocated_engine_sequences

        rows, oversampled = colocated_engine_sequences(args, world)
        engine = f", max_num_seqs {rows} per engine" + (" (the oversampled first round)" if oversampled else "")
    vllm = f"mode {args.vllm_mode}, gpu_memory_utilization {args.vllm_gpu_memory_utilization}, sleep mode "
    vllm += f"{args.vllm_enable_sleep_mode}, max_model_length {args.vllm_max_model_length}, tensor_parallel_size "
    report.settings.append(("vLLM", f"{vllm}{tp}{engine}"))
    if importlib.util.find_spec("vllm") is None:
        report.problems.append("use_vllm is true but vLLM is not installed: pip install vllm (or --use_vllm false).")
    if args.vllm_mode == "colocate" and world % tp:
        report.problems.append(f"vllm_tensor_parallel_size={tp} does not divide the {world} processes.")


def check_recipe(argv: Sequence[str]) -> DryRunReport:
    """The checks of ``--dry-run``, without printing: the resolved settings, problems and notes."""
    report, argv, plan = DryRunReport(), list(argv), None
    try:
        plan = plan_launch(argv)
    except SystemExit as error:
        report.problems.append(str(error).removeprefix(_PROG))
    parsed = _parse_for_dry_run(argv, report, plan)
    on_cpu = plan is not None and plan.settings.get("use_cpu")
    if parsed is not None and parsed[1].use_vllm and not (parsed[1].use_cpu or on_cpu) and _visible_gpus() == 0:
        report.needs_gpu.insert(0, "use_vllm")
    if plan is not None:
        _check_launch(plan, report)
    if parsed is not None:
        script_args, args, model_args = parsed
        world = plan.world_size if plan is not None else 1
        steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
        generation_batch = args.per_device_train_batch_size * world * steps_per_generation
        batch, batch_note = batch_summary(argv, args, world)
        report.notes += [batch_note] if batch_note else []
        precision = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
        length = f"epochs {args.num_train_epochs:g}" if args.max_steps <= 0 else f"max_steps {args.max_steps}"
        report.settings += [
            ("model", model_args.model_name_or_path),
            ("dataset", f"{script_args.dataset_name} (split {script_args.dataset_train_split})"),
            ("output_dir", args.output_dir),
            ("batch", batch),
            ("generation batch", f"{generation_batch} completions every {steps_per_generation} step(s)"),
            ("length", length),
            ("precision", report.precision or precision),
        ]
        if args.dynamic_sampling:  # its rounds, and its oversampled first round's size
            from egpo_trl.sampling.dynamic import first_round_groups

            line = f"up to {args.dynamic_sampling_max_rounds} rounds per generation batch ({args.dynamic_sampling_metric})"
            target, extra = first_round_groups(args, world)
            sequences = (target + extra) * args.num_generations
            if extra:
                line += f"; first round {target} + {extra} groups ({(target + extra) / target:.3g}x), {sequences} "
                line += f"completions, {sequences // world} per process"
            report.settings.append(("dynamic sampling", line))
        if args.use_vllm:
            _check_vllm(args, world, report)
        if plan is not None and plan.zero_stage == 3 and script_args.eval_size > 0:
            report.problems.append(
                "the held-out check (eval_size > 0) generates on the main process only, which ZeRO-3's sharded "
                "weights do not allow; set eval_size: 0 and evaluate the saved model with `egpo-trl eval`."
            )
        _check_model(script_args, args, model_args, report)
        _check_loss_forward(args, model_args, report, plan)
        _check_dataset(script_args, report)
        _check_output_dir(script_args, args, model_args, report)
        _check_wandb(args, report)
    if report.needs_gpu:  # first: nothing else matters on this machine
        gpus = f"{plan.world_size // plan.machines} GPUs" if plan is not None and plan.accelerate_config else "a GPU"
        needs = f"this machine sees no GPU, but the recipe needs {gpus} ({', '.join(report.needs_gpu)}): run it on "
        report.problems.insert(0, f"{needs}a machine with GPUs (recipes/demo_tiny_cpu.yaml trains on CPU).")
    report.problems = list(dict.fromkeys(report.problems))  # a recipe that cannot be read is reported once
    return report


def batch_summary(argv: Sequence[str], args: Any, world: int) -> tuple[str, str | None]:
    """The completions and prompts of one optimizer step over all processes, with a note where the recipe's differ."""
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    batch = per_device * world * accumulation
    line = f"{per_device} per device x {world} processes x {accumulation} accumulation = {batch} completions "
    line += f"({batch / args.num_generations:g} prompts) per optimizer step"
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
    try:
        per_device = int(data.get("per_device_train_batch_size", EGPOConfig.per_device_train_batch_size))
        accumulation = int(data.get("gradient_accumulation_steps", EGPOConfig.gradient_accumulation_steps))
        processes, config = data.get("num_processes"), data.get("accelerate_config")
        if processes is None and not is_none(config):
            processes = load_recipe(config, "accelerate config").get("num_processes")
        return per_device * int(processes or 1) * accumulation, int(processes or 1)
    except (TypeError, ValueError, SystemExit):
        return None
