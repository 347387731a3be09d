"""``egpo-trl``: training, evaluation, diagnostics and data building; a command's module is imported when used."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("egpo_trl.train", "train a policy with EGPO (or a baseline) from a YAML recipe"),
    "eval": ("egpo_trl.evaluation.cli", "evaluate a model on math benchmarks (pass@1 over k samples)"),
    "diagnose": ("egpo_trl.diagnostics.cli", "entropy diagnostics of evaluation records (ROC-AUC, plots)"),
    "data": ("egpo_trl.data.cli", "build training datasets (the OpenR1-Stable-10k recipe)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = "".join(f"\n  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items())
    usage = f"usage: egpo-trl <command> [options]\n\ncommands:{commands}\n\nRun `egpo-trl <command> --help` for its options."
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if argv[0] in ("-V", "--version"):
        from egpo_trl import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"egpo-trl: unknown command {command!r}.\n\n{usage}", file=sys.stderr)
        return 2
    try:
        result = importlib.import_module(COMMANDS[command][0]).main(rest)
    except KeyboardInterrupt:
        again = " Run the same command again to continue where it stopped." if command == "eval" else ""
        print(f"\negpo-trl {command}: interrupted.{again}", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
