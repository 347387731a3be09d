"""The notebooks in notebooks/: clean in the repository, and executed end to end on CPU with a tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOKS_DIR.glob("*.ipynb"))
SHIPPED_MODEL = REPO / "egpo_trl" / "assets" / "tiny-math-qwen2"
# No notebook or document may point at a repository address that the project does not back.
UNBACKED_ADDRESSES = ("github.com/egpo-trl", "git+https://github.com")


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_notebook", NOTEBOOKS_DIR / "run_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()

# A handful of steps on CPU for each notebook (the model is set by the fixture below).
TEST_PARAMETERS = {
    "01_quickstart.ipynb": {
        "dataset": "synthetic:arithmetic",
        "num_train_problems": 32,
        "num_eval_problems": 8,
        "eval_batch_size": 8,
        "max_steps": 2,
        "prompts_per_step": 4,
        "num_generations": 4,
        "micro_batch_size": 8,
        "max_completion_length": 32,
        "device": "cpu",
    },
    "02_entropy_diagnostics.ipynb": {
        "benchmark": "synthetic",
        "limit": 8,
        "num_samples": 4,
        "max_new_tokens": 32,
        "num_resamples": 50,
        "device": "cpu",
    },
    "03_ablations.ipynb": {
        "variants": "EGPO,C1,C4,C6,GRPO",  # one switch of each kind (clamp, NSR weighting, renorm, estimator)
        "num_train_problems": 32,
        "num_eval_problems": 8,
        "eval_num_samples": 1,
        "max_steps": 1,
        "prompts_per_step": 4,
        "num_generations": 4,
        "max_completion_length": 32,
        "device": "cpu",
    },
}
# Files each notebook writes into its time-stamped run folder.
EXPECTED_FILES = {
    "01_quickstart.ipynb": ["summary.md", "egpo_vs_grpo.png", "grpo/metrics.jsonl", "egpo/metrics.jsonl"],
    "02_entropy_diagnostics.ipynb": ["summary.json", "diagnostics/report.json", "diagnostics/entropy_density.png"],
    "03_ablations.ipynb": ["ablations.md", "ablations.png"],
}


def _read(name: str) -> dict:
    return json.loads((NOTEBOOKS_DIR / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def notebook_model(tmp_path_factory) -> str:
    """The shipped tiny model when present, else a tiny Qwen2 built offline."""
    if (SHIPPED_MODEL / "config.json").is_file():
        return "builtin:tiny-math-qwen2"
    from conftest import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("notebook-model")))


def test_every_notebook_has_test_parameters():
    assert NOTEBOOKS == sorted(TEST_PARAMETERS), "add the new notebook's CPU parameters to TEST_PARAMETERS"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_clean_and_parametrised(name):
    notebook = _read(name)
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for cell in code_cells:
        assert cell["outputs"] == [], f"{name}: clear the outputs before committing"
        assert cell["execution_count"] is None, f"{name}: clear the execution counts before committing"
    tagged = [cell for cell in code_cells if "parameters" in cell["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"{name}: exactly one cell must be tagged 'parameters'"
    names = runner.parameter_names(notebook)
    for required in ("model_name_or_path", "device", "output_dir"):
        assert required in names
    assert set(TEST_PARAMETERS[name]) <= set(names)
    first = "".join(notebook["cells"][0]["source"])
    assert "Colab" in first and "run_notebook.py" in first, f"{name}: the first cell should say where to run it"


@pytest.mark.parametrize("name", [*NOTEBOOKS, "../README.md", "../docs/notebooks.md"])
def test_no_invented_install_address(name):
    text = (NOTEBOOKS_DIR / name).read_text(encoding="utf-8")
    for address in UNBACKED_ADDRESSES:
        assert address not in text, f"{name} points at {address}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_outside_the_environment_names_the_fix(name, tmp_path):
    """The install cell, run by a Python without egpo_trl (not on Colab), says how to install it instead of guessing."""
    import subprocess
    import sys

    # IPython's magics and shell lines (Colab only) become `pass` for plain Python
    code = re.sub(r"^(\s*)[%!].*$", r"\1pass", "".join(_read(name)["cells"][1]["source"]), flags=re.M)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env
    )  # -S and no PYTHONPATH: egpo_trl is not importable
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: egpo_trl is not importable by this kernel's Python"), result.stderr
    assert "make install" in last


def test_runner_uses_the_virtual_environment_when_this_python_lacks_egpo_trl(tmp_path):
    """`python3 notebooks/run_notebook.py` from outside .venv runs the notebook with .venv's Python."""
    import subprocess
    import sys

    venv_python = REPO / ".venv" / "bin" / "python"
    if not venv_python.is_file():
        pytest.skip("no .venv in the repository (make install creates it)")
    path = tmp_path / "toy.ipynb"
    path.write_text(json.dumps(_toy_notebook("import egpo_trl\nprint('egpo_trl', egpo_trl.__version__)")))
    result = subprocess.run(
        [sys.executable, "-S", str(NOTEBOOKS_DIR / "run_notebook.py"), str(path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "egpo_trl is installed in .venv" in result.stdout and "not installed" not in result.stdout
    executed = json.loads((tmp_path / "out" / "toy.ipynb").read_text())
    assert any("egpo_trl 0." in "".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", []))


def test_inject_parameters_after_the_parameters_cell():
    notebook = _read("01_quickstart.ipynb")
    index = runner.find_parameters_cell(notebook)
    injected = runner.inject_parameters(notebook, {"max_steps": 3, "model_name_or_path": "/models/m"})
    cell = injected["cells"][index + 1]
    assert "injected-parameters" in cell["metadata"]["tags"]
    assert "max_steps = 3" in cell["source"] and "model_name_or_path = '/models/m'" in cell["source"]
    assert len(injected["cells"]) == len(notebook["cells"]) + 1
    again = runner.inject_parameters(injected, {"max_steps": 4})
    assert len(again["cells"]) == len(injected["cells"])
    assert again["cells"][index + 1]["source"].endswith("max_steps = 4")
    with pytest.raises(ValueError, match="max_step"):
        runner.inject_parameters(notebook, {"max_step": 3})
    assert runner.parse_parameter("max_steps=40") == ("max_steps", 40)
    assert runner.parse_parameter("seeds=[0, 1]") == ("seeds", [0, 1])
    assert runner.parse_parameter("model_name_or_path=/models/Qwen") == ("model_name_or_path", "/models/Qwen")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        runner.parse_parameter("max_steps")


def _toy_notebook(body: str) -> dict:
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": "# toy"},
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": 'import sys\nif "google.colab" in sys.modules:\n    %pip install nothing\n!echo skipped',
        },
        {
            "cell_type": "code",
            "metadata": {"tags": ["parameters"]},
            "outputs": [],
            "execution_count": None,
            "source": "scale = 1\noutput_dir = 'unused'",
        },
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": body},
    ]
    for number, cell in enumerate(cells):
        cell["id"] = f"cell{number}"
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_runner_runs_cells_and_saves_figures(tmp_path):
    """The cells run in a kernel with the parameters injected; figures of plt.show() are saved as PNG."""
    body = (
        "import matplotlib.pyplot as plt\nfrom pathlib import Path\n"
        "fig, ax = plt.subplots()\nax.plot([0, 1], [0, scale])\nplt.show()\n"
        "Path(output_dir).mkdir(parents=True)\nprint('scale is', scale)"
    )
    path = tmp_path / "toy.ipynb"
    path.write_text(json.dumps(_toy_notebook(body)))
    out = tmp_path / "out"
    result = runner.execute_notebook(path, out, {"scale": 3}, cwd=tmp_path)
    assert result["error"] is None
    assert [Path(p).name for p in result["figures"]] == ["cell04_1.png"]
    assert Path(result["figures"][0]).read_bytes().startswith(b"\x89PNG")
    assert (out / "outputs").is_dir()  # output_dir was pointed into --out
    executed = json.loads((out / "toy.ipynb").read_text())
    texts = ["".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", [])]
    assert any("scale is 3" in text for text in texts)
    with pytest.raises(FileExistsError):
        runner.execute_notebook(path, out, {"scale": 3}, cwd=tmp_path)

    path.write_text(json.dumps(_toy_notebook("raise RuntimeError('broken cell')")))
    failed = runner.execute_notebook(path, tmp_path / "failed", cwd=tmp_path)
    assert failed["error"] is not None and "broken cell" in failed["error"]
    assert runner.main([str(path), "--out", str(tmp_path / "cli")]) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_end_to_end(name, notebook_model, tmp_path):
    """Run the whole notebook in a Jupyter kernel (this interpreter), with the tiny model, on CPU."""
    parameters = {"model_name_or_path": notebook_model, **TEST_PARAMETERS[name]}
    out = tmp_path / "run"
    result = runner.execute_notebook(NOTEBOOKS_DIR / name, out, parameters, cwd=tmp_path, timeout=240)
    assert result["error"] is None, result["error"]
    executed = json.loads(Path(result["notebook"]).read_text())
    errors = [o for c in executed["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors
    code_cells = [c for c in executed["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code_cells)
    assert result["figures"], "the notebook displayed no figure"
    for figure in result["figures"]:
        assert Path(figure).read_bytes().startswith(b"\x89PNG")
    runs = [path for path in (out / "outputs").iterdir() if path.is_dir()]
    assert len(runs) == 1 and re.fullmatch(r"\d{8}-\d{6}", runs[0].name)
    for relative in EXPECTED_FILES[name]:
        assert (runs[0] / relative).is_file(), f"{name} did not write {relative}"
