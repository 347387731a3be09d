"""``egpo-trl data build --config recipes/data/openr1_stable_10k.yaml [--SETTING VALUE ...]``: every setting of
:class:`~egpo_trl.data.openr1.OpenR1DataConfig` overrides the recipe; lists and mappings are YAML."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
from typing import Any

import yaml

from egpo_trl.data.openr1 import OpenR1DataConfig, build_openr1_dataset

_TYPES = {f.name: (str(f.type).split(" |")[0], "None" in str(f.type)) for f in dataclasses.fields(OpenR1DataConfig)}
_WANTED = {"bool": "true or false", "int": "an integer", "float": "a number"}


def parse_overrides(values: dict[str, str]) -> dict[str, Any]:
    """Command-line strings as setting values: text settings as given (``null``: none), the others read as YAML."""
    parsed: dict[str, Any] = {}
    for name, text in values.items():
        base, optional = _TYPES[name]
        if base == "str":
            parsed[name] = None if optional and text.lower() in ("null", "none", "~") else text
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"--{name} {text!r} is not valid YAML: {error}") from None
        expected = {"bool": (bool,), "int": (int,), "float": (int, float)}.get(base)
        if expected and not (value is None and optional):
            if not isinstance(value, expected) or (base != "bool" and isinstance(value, bool)):
                raise ValueError(f"--{name} expects {_WANTED[base]}, got {text!r}.")
            value = float(value) if base == "float" else value
        parsed[name] = value
    return parsed


def hub_problem(config: OpenR1DataConfig) -> str | None:
    """Why the build cannot read its Hub inputs or tokenizer here, in one line naming the fix (``None``: it can)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants, try_to_load_from_cache

    remote = [spec.path for spec in config.inputs if spec.path and not os.path.exists(os.path.expanduser(spec.path))]
    tokenizer = config.tokenizer
    if tokenizer and not os.path.exists(os.path.expanduser(tokenizer)):
        if not isinstance(try_to_load_from_cache(tokenizer, "tokenizer_config.json"), str):
            remote.append(f"the tokenizer {tokenizer}")
    if not remote:
        return None
    names = ", ".join(dict.fromkeys(remote)) + " come(s) from the Hugging Face Hub, but"
    fix = (
        "build where the Hub can be reached and copy the output folder here, or read local copies (an input's "
        "`data_files: [/data/openr1/data/train-*.parquet]`, `tokenizer: /path/to/model`)"
    )
    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on") for key in offline):
        return f"{names} HF_HUB_OFFLINE is set; unset it, or {fix}."
    endpoint = constants.ENDPOINT.rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/whoami-v2", method="HEAD"), timeout=3.0)
    except urllib.error.HTTPError:
        return None  # it answered (401 without a token): reachable
    except OSError as error:
        reason = getattr(error, "reason", error)
        return (
            f"{names} {endpoint} cannot be reached from this machine ({reason}); {fix} (HF_ENDPOINT names a mirror)."
        )
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="egpo-trl data", description="Build training datasets.")
    build = parser.add_subparsers(dest="command", metavar="{build}").add_parser(
        "build",
        help="build the OpenR1-Stable pool (or the same recipe on another pool)",
        description="Build an RL training pool from OpenR1-Math-220k-style data. Settings given here override the "
        "recipe; lists and mappings are YAML (e.g. --subset_ratios '{default: 0.9, extended: 0.1}').",
        argument_default=argparse.SUPPRESS,
    )
    build.add_argument("--config", help="YAML recipe, e.g. recipes/data/openr1_stable_10k.yaml")
    for setting in dataclasses.fields(OpenR1DataConfig):
        default = setting.default if setting.default_factory is dataclasses.MISSING else setting.default_factory()
        default = "(see the recipe)" if setting.name == "inputs" else default
        flag = {"metavar": "BOOL", "nargs": "?", "const": "true"} if _TYPES[setting.name][0] == "bool" else {}
        described = f"{setting.metadata['help']} (default: {default})".replace("%", "%%")
        build.add_argument(f"--{setting.name}", **({"metavar": "VALUE"} | flag), help=described)
    args = vars(parser.parse_args(argv))
    command = args.pop("command", None)
    if command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config_path = args.pop("config", None)
    try:
        overrides = parse_overrides(args)
        config = OpenR1DataConfig.from_yaml(config_path, overrides) if config_path else OpenR1DataConfig(**overrides)
        if problem := hub_problem(config):
            print(f"egpo-trl data {command}: {problem}", file=sys.stderr)
            return 2
        result = build_openr1_dataset(config, command=shlex.join(["egpo-trl", "data", *argv]))
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        print(f"egpo-trl data {command}: error: {error}", file=sys.stderr)
        return 2
    print(f"Wrote {result.output_dir} (report: {result.report_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
