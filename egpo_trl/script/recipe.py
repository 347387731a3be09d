"""Training recipes as files that both YAML and Python read: ``accelerate launch recipes/<recipe>.yaml`` trains."""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKER_KEY = "egpo_trl_recipe"
HEADER = f"{MARKER_KEY}: (r'''  # this line and the last one let `python` and `accelerate launch` run this file"
FOOTER = "#'''); from egpo_trl.recipe_launch import run_as_script; raise SystemExit(run_as_script(__file__))"


def load_recipe(path: str | Path, what: str = "recipe", prog: str = "egpo-trl train") -> dict[str, Any]:
    """Read a recipe's YAML mapping, without the ``egpo_trl_recipe`` marker key; a key written twice is refused."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[tuple[str, str], yaml.Mark] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                mark = key_node.start_mark
                first = seen.setdefault((key_node.tag, key_node.value), mark)
                if first is not mark:
                    where = f"on lines {first.line + 1} and {mark.line + 1}"
                    if first.line == mark.line:
                        where = f"on line {mark.line + 1}, columns {first.column + 1} and {mark.column + 1}"
                    raise SystemExit(f"{prog}: {path}: {key_node.value} is written twice, {where}; keep one.")
            return super().construct_mapping(node, deep)

    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{prog}: the {what} {path} does not exist; check the path.")
    text = path.read_text()
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as error:
        raise SystemExit(f"{prog}: {path} is not valid YAML: {error}") from error
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise SystemExit(f"{prog}: {path} must be a YAML mapping of field: value.")
    if quotes := _quotes_problem(path, text.splitlines()):
        raise SystemExit(f"{prog}: {quotes}")
    data.pop(MARKER_KEY, None)
    return data


def add_script_lines(text: str) -> str:
    """``text`` with the two lines that let Python run it: the header first and the footer last."""
    lines = text.splitlines()
    body = [line for line in lines if not line.startswith(f"{MARKER_KEY}:") and not line.startswith("#'''")]
    while body and not body[-1].strip():
        body.pop()
    return "\n".join([HEADER, *body, FOOTER]) + "\n"


def _quotes_problem(path: str | Path, lines: Sequence[str]) -> str | None:
    """What a line between a recipe's first and last lines that holds ``'''`` breaks (``None``: no such line)."""
    header = next((n for n, line in enumerate(lines, 1) if line.startswith(f"{MARKER_KEY}:")), None)
    footer = next((n for n, line in enumerate(lines, 1) if line.startswith("#'''")), None)
    line = next((n for n in range(header + 1, footer) if "'''" in lines[n - 1]), None) if header and footer else None
    return line and (
        f"{path} line {line} holds ''', which ends the text Python skips: `python {path}` and `accelerate launch "
        f"{path}` would stop reading the recipe there; write it otherwise (e.g. \\'\\'\\' in a quoted YAML string, or "
        "drop it from the comment)."
    )


def script_problem(path: str | Path) -> str | None:
    """Why ``python``/``accelerate launch`` cannot run the recipe ``path`` as written (``None`` when they can)."""
    lines = (text := Path(path).read_text()).splitlines()
    if not any(line.startswith(f"{MARKER_KEY}:") for line in lines):
        return None
    fix = f"run `python -m egpo_trl.script.recipe {path}` to move it above the last line"
    footer = next((number for number, line in enumerate(lines, 1) if line.startswith("#'''")), None)
    if footer is None:
        return f"{path} lost its last line (#'''; ...): {fix.replace('move it above', 'restore')}."
    if quotes := _quotes_problem(path, lines):
        return quotes
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as error:
        line = (error.text or "").strip()
        where = "after the last line" if (error.lineno or 0) > footer else "between the first and last lines"
        return (
            f"`accelerate launch {path}` cannot run it: line {error.lineno} ({line}), {where}, is not Python; {fix}."
        )
    first = tree.body[0] if tree.body else None
    if not isinstance(first, ast.AnnAssign) or first.end_lineno != footer:
        return f"`accelerate launch {path}` would not read it whole: its first line must be the {MARKER_KEY} line."
    return None


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m egpo_trl.script.recipe RECIPE.yaml ...``: add or repair the two lines, in place."""
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths or any(p in ("-h", "--help") for p in paths):
        print("usage: python -m egpo_trl.script.recipe RECIPE.yaml [...]\n\nAdds (or repairs) the first and last lines that "
              "let `accelerate launch RECIPE.yaml` train a recipe; lines after the last line move above it.")  # fmt: skip
        return 0
    for path in map(Path, paths):
        before = path.read_text()
        if (after := add_script_lines(before)) != before:
            path.write_text(after)
            print(f"{path}: updated.")
        if problem := script_problem(path):
            print(problem, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
