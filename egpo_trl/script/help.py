"""``egpo-trl train --help``: how to run a recipe and the fields most runs change (``--help-all`` lists every field)."""

from __future__ import annotations

from egpo_trl.script.args import TrainScriptArguments, known_fields, make_parser, model_config_class

__all__ = ["SHORT_HELP_FIELDS", "short_help"]

SHORT_HELP_FIELDS = (
    "model_name_or_path",
    "dataset_name",
    "prompt_template",
    "answer_column",
    "reward_funcs",
    "output_dir",
    "max_steps",
    "num_train_epochs",
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "temperature",
    "seed",
    "advantage_estimator",
    "egpo_lambda_min",
    "egpo_lambda_max",
    "egpo_clamp",
    "egpo_nsr",
    "eval_size",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "use_cpu",
    "bf16",
    "accelerate_config",
    "num_processes",
)
_SHORT_HELP_TEXT = {
    "output_dir": "Where the run's metrics, plot, checkpoints and model go; '{timestamp}' in it is replaced by the "
    "start time.",
    "resume_from_checkpoint": "'true' continues the run from the last checkpoint-* in output_dir; or a checkpoint "
    "path.",
    "use_cpu": "Train on the CPU. Pass --bf16 false with it for float32: bf16 is on unless set false.",
    "bf16": "bf16 mixed precision, on unless set false (or fp16 is on). On a GPU it needs one that supports bf16 "
    "(Ampere or newer); with use_cpu it runs under the CPU's bf16 autocast, usually slower than float32 (the CPU "
    "recipes set bf16: false).",
}


def short_help() -> str:
    """``egpo-trl train --help``: how to run a recipe and the fields most runs change (``--help-all``: every field)."""
    import dataclasses
    import re
    import textwrap

    from egpo_trl.config import EGPOConfig

    parser = make_parser()
    actions = {action.dest: action for action in parser._actions}
    defaults = {}
    for cls in (model_config_class(), EGPOConfig, TrainScriptArguments):
        for item in dataclasses.fields(cls):
            if item.default is not dataclasses.MISSING:
                defaults[item.name] = item.default
            elif item.default_factory is not dataclasses.MISSING:
                defaults[item.name] = item.default_factory()

    def first_sentence(text: str) -> str:
        text = " ".join((text or "").split()).replace("%%", "%")
        match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!Eq)(?<!Sec)\. (?=[A-Z`(])", text)
        return text if match is None else text[: match.start() + 1]

    lines = [
        "usage: egpo-trl train RECIPE.yaml [--dry-run] [--FIELD VALUE ...]",
        "",
        "Train a policy with EGPO (or a baseline advantage estimator) from a YAML recipe. Every field is a YAML key",
        "of the recipe or a --flag; flags override the recipe.",
        "",
        "examples:",
        "  egpo-trl train recipes/demo_tiny_cpu.yaml                    the CPU demo (what `make demo` runs)",
        "  egpo-trl train recipes/demo_tiny_cpu.yaml --max_steps 20 --seed 1",
        "  egpo-trl train recipes/egpo_qwen15b.yaml --dry-run           check a GPU recipe, print its launch",
        "  egpo-trl train recipes/egpo_qwen15b.yaml                     run it (prints, then runs, accelerate launch)",
        "",
        "arguments:",
        "  RECIPE.yaml, --config RECIPE.yaml",
        "                        the YAML recipe (see recipes/)",
        "  --dry-run             check the recipe and print the resolved settings and launch command; trains nothing",
        "  -h, --help            this help",
        f"  --help-all            all {len(known_fields(parser))} fields (TRL's GRPOConfig, TrainingArguments, "
        "ModelConfig, egpo_*)",
        "",
        "fields most runs change [default]:",
    ]
    for name in SHORT_HELP_FIELDS:
        action = actions.get(name)
        if action is None:
            continue
        default = defaults.get(name)
        shown = (
            ""
            if default in (None, "", [], ())
            else f" [{', '.join(default) if isinstance(default, list) else default}]"
        )
        lines.append(f"  --{name}{shown}")
        lines += textwrap.wrap(
            _SHORT_HELP_TEXT.get(name) or first_sentence(action.help),
            width=110,
            initial_indent=" " * 6,
            subsequent_indent=" " * 6,
        )
    lines += ["", "Every field, with its full help: egpo-trl train --help-all"]
    return "\n".join(lines)
