"""What ``python recipes/<recipe>.yaml`` and ``accelerate launch recipes/<recipe>.yaml`` run: the recipe's training."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from egpo_trl.launch import in_distributed_launch, is_none
from egpo_trl.script.args import option_value
from egpo_trl.script.recipe import load_recipe

# Variables `accelerate launch`/torchrun set in the processes they start; cleared before a launch of our own.
_LAUNCH_VARIABLES_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "FSDP_")
_LAUNCH_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


def launch_parent_options(ppid: int | None = None, script: str | None = None) -> list[str] | None:
    """The options given to the ``accelerate launch`` that started this process (``None`` when unknown)."""
    try:
        raw = Path(f"/proc/{os.getppid() if ppid is None else ppid}/cmdline").read_bytes()
    except OSError:
        return None
    args = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    start = next((i for i, a in enumerate(args) if a == "launch" or a.endswith("accelerate.commands.launch")), -1)
    if start < 0:
        return None
    target = os.path.realpath(sys.argv[0] if script is None else script)
    end = next((i for i in range(start + 1, len(args)) if os.path.realpath(args[i]) == target), None)
    return None if end is None else args[start + 1 : end]


def run_as_script(path: str, argv: Sequence[str] | None = None) -> int:
    """Train the recipe ``path``: what ``python <recipe>.yaml`` and ``accelerate launch <recipe>.yaml`` run. Inside an
    ``accelerate launch`` given no options (and with no default accelerate config), the first process launches the
    recipe's own ``accelerate_config`` instead, as ``egpo-trl train <recipe>`` does."""
    from accelerate.commands.config import default_config_file

    from egpo_trl.train import main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not in_distributed_launch() or any(a in ("-h", "--help", "--help-all", "--dry-run", "--dry_run") for a in argv):
        return main([path, *argv])
    rank, world = int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    try:
        recipe = load_recipe(path)
    except SystemExit:
        if rank != 0:
            return 1  # the first process says why, once
        raise
    accelerate_config = option_value(argv, "accelerate_config") or recipe.get("accelerate_config")
    if is_none(accelerate_config):
        return main(["--config", path, *argv])
    given = launch_parent_options()
    default_config = default_config_file if os.path.isfile(default_config_file) else None
    if given == [] and default_config is None:
        if rank != 0:
            return 0
        print(f"accelerate launch was given no settings: using the recipe's ({accelerate_config}), as `egpo-trl "
              f"train {path}` does.", flush=True)  # fmt: skip
        for name in list(os.environ):
            if name in _LAUNCH_VARIABLES or name.startswith(_LAUNCH_VARIABLES_PREFIXES):
                del os.environ[name]
        if world > 1 and option_value(argv, "main_process_port") is None and not recipe.get("main_process_port"):
            import socket

            with socket.socket() as sock:  # the first launch still holds its port: a free one
                sock.bind(("127.0.0.1", 0))
                argv = [*argv, "--main_process_port", str(sock.getsockname()[1])]
    elif rank == 0:
        default = f"accelerate's default config {default_config}" if default_config else "accelerate launch's settings"
        print(f"Training with the launch's own settings ({shlex.join(given) if given else default}; {world} "
              f"process(es)), not the recipe's accelerate_config {accelerate_config}.", flush=True)  # fmt: skip
    return main(["--config", path, *argv])
