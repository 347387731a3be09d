#!/usr/bin/env python3
"""Execute a notebook with parameter overrides; save the executed notebook and its figures.

Usage::

    python3 notebooks/run_notebook.py notebooks/01_quickstart.ipynb --out runs/quickstart \\
        -p model_name_or_path=/models/Qwen2.5-0.5B-Instruct -p max_steps=40

Overrides are written into a new cell right after the cell tagged ``parameters`` (as papermill does);
values are Python literals (``-p max_steps=40``, ``-p seeds=[0,1]``) or, failing that, strings
(``-p model_name_or_path=/models/m``). Unless ``-p output_dir=...`` is given, the notebook's
``output_dir`` parameter is pointed at ``OUT/outputs``.

``OUT`` receives the executed notebook (same file name) and ``figures/``: every PNG the notebook displayed,
named after its cell. Execution uses a Jupyter kernel running this same Python interpreter (nbclient and
ipykernel); where those are not installed, the code cells run in this process instead, one namespace
for the whole notebook, with IPython magics (``%...``) and shell lines (``!...``) skipped.

The exit status is 1 when a cell fails; the notebook executed up to the failure is still saved. Run with a
Python that cannot import egpo_trl (``python3`` outside the virtual environment), it re-runs itself with the
repository's ``.venv/bin/python`` (what ``make install`` creates) when there is one.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import copy
import io
import json
import os
import re
import sys
import tempfile
import traceback
import uuid
from pathlib import Path
from typing import Any

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
KERNEL_NAME = "egpo-trl-python"

__all__ = ["NotebookError", "execute_notebook", "find_parameters_cell", "inject_parameters", "parse_parameter"]


class NotebookError(RuntimeError):
    """A cell of the notebook raised; ``cell_index`` is the failing cell's position."""

    def __init__(self, message: str, cell_index: int | None = None):
        super().__init__(message)
        self.cell_index = cell_index


# ---------------------------------------------------------------------------------------------- parameters
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


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def find_parameters_cell(notebook: dict[str, Any]) -> int:
    """Index of the code cell tagged ``parameters``.

    Raises:
        ValueError: when the notebook has no such cell.
    """
    for index, cell in enumerate(notebook["cells"]):
        if cell.get("cell_type") == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            return index
    raise ValueError("The notebook has no code cell tagged 'parameters'; tag the cell that holds its parameters.")


def parameter_names(notebook: dict[str, Any]) -> list[str]:
    """Names assigned in the ``parameters`` cell."""
    tree = ast.parse(_source(notebook["cells"][find_parameters_cell(notebook)]))
    return [
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    ]


def inject_parameters(notebook: dict[str, Any], parameters: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """A copy of ``notebook`` with a cell assigning ``parameters`` right after its ``parameters`` cell.

    An earlier injected cell is replaced. With ``strict``, a name that the ``parameters`` cell does not
    define is an error (it is most likely a typo).
    """
    notebook = copy.deepcopy(notebook)
    index = find_parameters_cell(notebook)
    if strict:
        known = parameter_names(notebook)
        unknown = [name for name in parameters if name not in known]
        if unknown:
            raise ValueError(f"Unknown parameter(s) {unknown}; the notebook's parameters are {known}.")
    lines = ["# Parameters set for this run"] + [f"{name} = {value!r}" for name, value in parameters.items()]
    cell = {
        "cell_type": "code",
        "execution_count": None,
        "id": uuid.uuid4().hex[:8],
        "metadata": {"tags": [INJECTED_TAG]},
        "outputs": [],
        "source": "\n".join(lines),
    }
    following = notebook["cells"][index + 1] if index + 1 < len(notebook["cells"]) else None
    if following is not None and INJECTED_TAG in following.get("metadata", {}).get("tags", []):
        notebook["cells"][index + 1] = cell
    else:
        notebook["cells"].insert(index + 1, cell)
    return notebook


# ---------------------------------------------------------------------------------------------- execution
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
    spec_manager = KernelSpecManager(kernel_dirs=[kernel_dir])
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=spec_manager)


def _run_with_nbclient(notebook: dict[str, Any], cwd: str, timeout: int | None) -> tuple[dict[str, Any], str | None]:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    node = nbformat.reads(json.dumps(notebook), as_version=4)
    error = None
    with tempfile.TemporaryDirectory(prefix="egpo-kernel-") as kernel_dir:
        client = NotebookClient(
            node,
            km=_kernel_manager(kernel_dir),
            timeout=timeout,
            resources={"metadata": {"path": cwd}},
            allow_errors=False,
        )
        try:
            client.execute(cwd=cwd)
        except CellExecutionError as exc:
            error = str(exc)
    return json.loads(nbformat.writes(node)), error


_MAGIC = re.compile(r"^(\s*)[%!]")


def _strip_magics(source: str) -> str | None:
    """The cell's Python without IPython magics and shell lines (``None`` for a cell magic such as ``%%bash``)."""
    if source.lstrip().startswith("%%"):
        return None
    lines = []
    for line in source.splitlines():
        match = _MAGIC.match(line)
        lines.append(f"{match.group(1)}pass  # skipped: {line.strip()}" if match else line)
    return "\n".join(lines)


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.buffer = stream, io.StringIO()

    def write(self, text):
        self.stream.write(text)
        self.buffer.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()


def _run_in_process(notebook: dict[str, Any], cwd: str) -> tuple[dict[str, Any], str | None]:
    """Execute the code cells in this process, in one namespace; ``plt.show()`` becomes a PNG output."""
    notebook = copy.deepcopy(notebook)
    shown: list[bytes] = []
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        def show(*args, **kwargs):
            for number in plt.get_fignums():
                figure = plt.figure(number)
                buffer = io.BytesIO()
                figure.savefig(buffer, format="png", bbox_inches="tight")
                shown.append(buffer.getvalue())
            plt.close("all")

        original_show, plt.show = plt.show, show
    except ImportError:
        plt = original_show = None
    namespace: dict[str, Any] = {"__name__": "__main__"}
    previous = os.getcwd()
    os.chdir(cwd)
    error = None
    count = 0
    try:
        for index, cell in enumerate(notebook["cells"]):
            if cell.get("cell_type") != "code":
                continue
            count += 1
            cell["execution_count"] = count
            cell["outputs"] = []
            code = _strip_magics(_source(cell))
            if code is None:
                continue
            shown.clear()
            tee = _Tee(sys.stdout)
            try:
                with contextlib.redirect_stdout(tee):
                    exec(compile(code, f"<cell {index}>", "exec"), namespace)
            except BaseException as exc:  # noqa: BLE001 - report any failure of the notebook's code
                if isinstance(exc, KeyboardInterrupt):
                    raise
                trace = traceback.format_exc()
                cell["outputs"].append(
                    {
                        "output_type": "error",
                        "ename": type(exc).__name__,
                        "evalue": str(exc),
                        "traceback": trace.splitlines(),
                    }
                )
                error = f"Cell {index} raised {type(exc).__name__}: {exc}\n{trace}"
            finally:
                if tee.buffer.getvalue():
                    cell["outputs"].insert(
                        0, {"output_type": "stream", "name": "stdout", "text": tee.buffer.getvalue()}
                    )
                for png in shown:
                    cell["outputs"].append(
                        {
                            "output_type": "display_data",
                            "data": {"image/png": base64.b64encode(png).decode(), "text/plain": "<Figure>"},
                            "metadata": {},
                        }
                    )
            if error:
                break
    finally:
        os.chdir(previous)
        if plt is not None:
            plt.close("all")
            plt.show = original_show
    return notebook, error


def _save_figures(notebook: dict[str, Any], figures_dir: Path) -> list[Path]:
    paths = []
    for index, cell in enumerate(notebook["cells"]):
        number = 0
        for output in cell.get("outputs", []):
            data = output.get("data", {}).get("image/png")
            if not data:
                continue
            number += 1
            figures_dir.mkdir(parents=True, exist_ok=True)
            path = figures_dir / f"cell{index:02d}_{number}.png"
            path.write_bytes(base64.b64decode("".join(data) if isinstance(data, list) else data))
            paths.append(path)
    return paths


def nbclient_available() -> bool:
    """Whether nbclient, nbformat and ipykernel are importable (otherwise cells run in-process)."""
    import importlib.util

    return all(importlib.util.find_spec(name) for name in ("nbclient", "nbformat", "ipykernel"))


def execute_notebook(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    parameters: dict[str, Any] | None = None,
    engine: str = "auto",
    cwd: str | os.PathLike | None = None,
    timeout: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Execute the notebook at ``path`` with ``parameters`` and save it and its figures into ``out_dir``.

    Args:
        path: the ``.ipynb`` file.
        out_dir: where the executed notebook and ``figures/`` go.
        parameters: overrides of the ``parameters`` cell; ``output_dir`` defaults to ``out_dir/outputs``
            when the notebook has that parameter.
        engine: ``"nbclient"`` (a Jupyter kernel running this interpreter), ``"inprocess"``, or ``"auto"``
            (nbclient when installed).
        cwd: working directory of the execution (default: the current one).
        timeout: seconds allowed per cell with nbclient (``None``: no limit).
        overwrite: replace an executed notebook already in ``out_dir``.

    Returns:
        ``{"notebook": path of the executed notebook, "figures": [PNG paths], "engine": ..., "error": message or
        None}``.
    """
    path, out_dir = Path(path), Path(out_dir)
    target = out_dir / path.name
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; choose another --out or pass --overwrite.")
    notebook = json.loads(path.read_text(encoding="utf-8"))
    parameters = dict(parameters or {})
    if "output_dir" in parameter_names(notebook) and "output_dir" not in parameters:
        parameters["output_dir"] = str((out_dir / "outputs").resolve())
    notebook = inject_parameters(notebook, parameters)
    if engine == "auto":
        engine = "nbclient" if nbclient_available() else "inprocess"
    if engine not in ("nbclient", "inprocess"):
        raise ValueError(f"engine={engine!r}: choose 'auto', 'nbclient' or 'inprocess'.")
    cwd = str(Path(cwd or os.getcwd()).resolve())
    out_dir.mkdir(parents=True, exist_ok=True)
    if engine == "nbclient":
        executed, error = _run_with_nbclient(notebook, cwd, timeout)
    else:
        executed, error = _run_in_process(notebook, cwd)
    target.write_text(json.dumps(executed, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    figures_dir = out_dir / "figures"
    if figures_dir.exists() and overwrite:
        for old in figures_dir.glob("cell*_*.png"):
            old.unlink()
    figures = _save_figures(executed, figures_dir)
    return {"notebook": str(target), "figures": [str(p) for p in figures], "engine": engine, "error": error}


_REEXEC_GUARD = "EGPO_RUN_NOTEBOOK_REEXEC"


def _python_with_egpo_trl() -> str | None:
    """The repository's ``.venv`` Python when this interpreter cannot import egpo_trl (``None``: use this one).

    ``make install`` installs egpo_trl into ``.venv``; ``python3 notebooks/run_notebook.py`` run from outside it would
    otherwise execute the notebooks with a Python that has no egpo_trl.
    """
    import importlib.util

    if importlib.util.find_spec("egpo_trl") is not None or os.environ.get(_REEXEC_GUARD):
        return None
    venv_python = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.is_file() else None


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        venv_python = _python_with_egpo_trl()
        if venv_python is not None:
            print(f"run_notebook: egpo_trl is installed in .venv, not in {sys.executable}: running with {venv_python}")
            sys.stdout.flush()
            os.environ[_REEXEC_GUARD] = "1"
            os.execv(venv_python, [venv_python, str(Path(__file__).resolve()), *sys.argv[1:]])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", help="the .ipynb file to execute")
    parser.add_argument("--out", required=True, help="folder for the executed notebook and its figures")
    parser.add_argument(
        "-p", "--parameter", action="append", default=[], metavar="NAME=VALUE", help="override a parameter"
    )
    parser.add_argument("--engine", choices=("auto", "nbclient", "inprocess"), default="auto")
    parser.add_argument("--cwd", default=None, help="working directory of the execution (default: current)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds per cell (nbclient; default: none)")
    parser.add_argument("--overwrite", action="store_true", help="replace an executed notebook already in --out")
    args = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("egpo_trl") is None:
        print(
            f"run_notebook: egpo_trl is not importable by {sys.executable}. In the repository, run `make install` (it "
            "creates .venv) and then `source .venv/bin/activate`, or `pip install -e '.[dev]'` with this Python.",
            file=sys.stderr,
        )
        return 2
    try:
        parameters = dict(parse_parameter(item) for item in args.parameter)
        result = execute_notebook(
            args.notebook, args.out, parameters, args.engine, args.cwd, args.timeout, args.overwrite
        )
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        print(f"run_notebook: {error}", file=sys.stderr)
        return 2
    print(f"\nExecuted with {result['engine']}: {result['notebook']}")
    for figure in result["figures"]:
        print(f"  {figure}")
    if result["error"]:
        print(f"\nrun_notebook: a cell failed:\n{result['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
