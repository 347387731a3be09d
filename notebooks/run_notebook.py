#!/usr/bin/env python3
"""Execute a notebook with parameter overrides; save the executed notebook and its figures.

Usage::

    python3 notebooks/run_notebook.py notebooks/01_quickstart.ipynb --out runs/quickstart \\
        -p model_name_or_path=/models/Qwen2.5-0.5B-Instruct -p max_steps=40

Overrides are written into a new cell right after the cell tagged ``parameters`` (as papermill does); values are
Python literals (``-p max_steps=40``, ``-p seeds=[0,1]``) or, failing that, strings (``-p model_name_or_path=/models/m``).
Unless ``-p output_dir=...`` is given, the notebook's ``output_dir`` parameter is pointed at ``OUT/outputs``.
nbclient runs the cells in a Jupyter kernel of this same Python; ``OUT`` receives the executed notebook (same file
name) and ``figures/``, every PNG it displayed, named after its cell. The exit status is 1 when a cell fails (the
notebook executed up to the failure is still saved). Run with a Python that cannot import egpo_trl, it re-runs itself
with the repository's ``.venv/bin/python`` when there is one.
"""

from __future__ import annotations

import argparse
import ast
import base64
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
KERNEL_NAME = "egpo-trl-python"


def parse_parameter(text: str) -> tuple[str, Any]:
    """``"name=value"`` -> ``(name, value)``; the value is a Python literal when it parses as one, else a string."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise ValueError(f"-p {text!r}: write overrides as NAME=VALUE, e.g. -p max_steps=20.")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return name, value


def find_parameters_cell(notebook: dict[str, Any]) -> int:
    """Index of the code cell tagged ``parameters`` (a ``ValueError`` when there is none)."""
    for index, cell in enumerate(notebook["cells"]):
        if cell.get("cell_type") == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            return index
    raise ValueError("The notebook has no code cell tagged 'parameters'; tag the cell that holds its parameters.")


def parameter_names(notebook: dict[str, Any]) -> list[str]:
    """Names assigned in the ``parameters`` cell."""
    source = notebook["cells"][find_parameters_cell(notebook)]["source"]
    tree = ast.parse("".join(source) if isinstance(source, list) else source)
    return [
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    ]


def inject_parameters(notebook: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``notebook`` with a cell assigning ``parameters`` right after its ``parameters`` cell (replacing an
    earlier injected one); a name the ``parameters`` cell does not define is an error (most likely a typo)."""
    import nbformat

    notebook = copy.deepcopy(notebook)
    index = find_parameters_cell(notebook)
    known = parameter_names(notebook)
    unknown = [name for name in parameters if name not in known]
    if unknown:
        raise ValueError(f"Unknown parameter(s) {unknown}; the notebook's parameters are {known}.")
    lines = ["# Parameters set for this run"] + [f"{name} = {value!r}" for name, value in parameters.items()]
    cell = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": [INJECTED_TAG]})
    cells = notebook["cells"]
    following = cells[index + 1] if index + 1 < len(cells) else None
    replace = following is not None and INJECTED_TAG in following.get("metadata", {}).get("tags", [])
    cells[index + 1 : index + 1 + int(replace)] = [cell]
    return notebook


def _kernel_manager(kernel_dir: str):
    """A kernel manager whose kernel is ``sys.executable -m ipykernel_launcher`` (this interpreter, this venv)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = Path(kernel_dir) / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (run_notebook)",
        "language": "python",
        # Figures shown inline (as in Jupyter), whatever MPLBACKEND the calling process has.
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dir]))


def execute_notebook(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    parameters: dict[str, Any] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Execute the notebook at ``path`` with ``parameters`` (``output_dir`` defaults to ``out_dir/outputs``) in
    ``cwd``, ``timeout`` seconds per cell, and save it and its figures into ``out_dir``.

    Returns ``{"notebook": path of the executed notebook, "figures": [PNG paths], "error": message or None}``.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path, out_dir = Path(path), Path(out_dir)
    target = out_dir / path.name
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; choose another --out or pass --overwrite.")
    notebook = nbformat.read(path, as_version=4)
    parameters = dict(parameters or {})
    if "output_dir" in parameter_names(notebook) and "output_dir" not in parameters:
        parameters["output_dir"] = str((out_dir / "outputs").resolve())
    notebook = inject_parameters(notebook, parameters)
    cwd = str(Path(cwd or os.getcwd()).resolve())
    out_dir.mkdir(parents=True, exist_ok=True)
    error = None
    with tempfile.TemporaryDirectory(prefix="egpo-kernel-") as kernel_dir:
        client = NotebookClient(notebook, km=_kernel_manager(kernel_dir), timeout=timeout)
        try:
            client.execute(cwd=cwd)
        except CellExecutionError as exc:
            error = str(exc)
    nbformat.write(notebook, target)
    figures_dir = out_dir / "figures"
    for old in figures_dir.glob("cell*_*.png"):
        old.unlink()
    figures = []
    for index, cell in enumerate(notebook["cells"]):
        images = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        for number, data in enumerate(images, start=1):
            figures_dir.mkdir(parents=True, exist_ok=True)
            figure = figures_dir / f"cell{index:02d}_{number}.png"
            figure.write_bytes(base64.b64decode(data))
            figures.append(str(figure))
    return {"notebook": str(target), "figures": figures, "error": error}


_REEXEC_GUARD = "EGPO_RUN_NOTEBOOK_REEXEC"


def main(argv: list[str] | None = None) -> int:
    import importlib.util

    venv_python = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    if argv is None and importlib.util.find_spec("egpo_trl") is None and not os.environ.get(_REEXEC_GUARD):
        if venv_python.is_file():  # `make install` puts egpo_trl there
            print(f"run_notebook: egpo_trl is installed in .venv, not in {sys.executable}: running with {venv_python}")
            sys.stdout.flush()
            os.environ[_REEXEC_GUARD] = "1"
            os.execv(venv_python, [str(venv_python), str(Path(__file__).resolve()), *sys.argv[1:]])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", help="the .ipynb file to execute")
    parser.add_argument("--out", required=True, help="folder for the executed notebook and its figures")
    parser.add_argument(
        "-p", "--parameter", action="append", default=[], metavar="NAME=VALUE", help="override a parameter"
    )
    parser.add_argument("--cwd", default=None, help="working directory of the execution (default: current)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds per cell (default: none)")
    parser.add_argument("--overwrite", action="store_true", help="replace an executed notebook already in --out")
    args = parser.parse_args(argv)
    missing = [name for name in ("egpo_trl", "nbclient", "ipykernel") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"run_notebook: {', '.join(missing)} not importable by {sys.executable}. In the repository, run `make "
            "install` (it creates .venv) and then `source .venv/bin/activate`, or `pip install -e '.[dev]'` with this "
            "Python.",
            file=sys.stderr,
        )
        return 2
    try:
        parameters = dict(parse_parameter(item) for item in args.parameter)
        result = execute_notebook(args.notebook, args.out, parameters, args.cwd, args.timeout, args.overwrite)
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        print(f"run_notebook: {error}", file=sys.stderr)
        return 2
    print(f"\nExecuted: {result['notebook']}")
    for figure in result["figures"]:
        print(f"  {figure}")
    if result["error"]:
        print(f"\nrun_notebook: a cell failed:\n{result['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
