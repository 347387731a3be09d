"""Whether a colocated vLLM engine's share of each GPU still fits once the optimizer's state exists.

In colocate mode each training process shares its GPU with a vLLM engine that takes ``vllm_gpu_memory_utilization``
of the card whenever it generates. Beside it, training keeps its weights' and optimizer's shards there. PyTorch's
Adam and AdamW (DeepSpeed's fused Adam too) create their two moment estimates, each the size of the parameters they
update, at the first optimizer step, not before. So the first generation of a run has that much more room than
every later one: a share that fits the first generation can run out of memory at the second, one whole step later.
On 4 GPUs under ZeRO-3, AdamW's moments of a 7.6B-parameter model take 14.2 GiB of each GPU.

At the first generation of training, with vLLM awake, the trainer reads each GPU's memory in use, adds the moments
still to come, and stops before generating where the sum exceeds the card, naming the share that would fit.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "GenerationMemoryError",
    "device_memory",
    "generation_memory_verdict",
    "innermost_optimizer",
    "pending_optimizer_state_bytes",
]

GIB = 1024**3
#: What the suggested share leaves free on the fullest GPU at later generations, for the allocator's slack.
HEADROOM_BYTES = 1 * GIB
#: Optimizers whose state is known: per parameter, tensors shaped and typed like it (exp_avg, exp_avg_sq).
_ADAM_CLASS_NAMES = ("FusedAdam",)


class GenerationMemoryError(RuntimeError):
    """vLLM's share of each GPU will not fit beside training once the optimizer's state exists."""


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """``(free, total)`` bytes of ``device`` as the driver counts them (every process's memory, vLLM's pool
    included), or ``None`` for a device that does not say (the CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def innermost_optimizer(optimizer):
    """The optimizer that holds the state: through accelerate's and DeepSpeed's wrappers (``.optimizer``)."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _moments_per_parameter(optimizer, group: dict) -> int | None:
    """How many tensors like the parameter the optimizer keeps per parameter, where known."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or type(optimizer).__name__ in _ADAM_CLASS_NAMES:
        return 3 if group.get("amsgrad") else 2
    return None


def pending_optimizer_state_bytes(optimizer, device_type: str = "cuda") -> tuple[int, int] | None:
    """``(bytes, parameters)``: the state ``optimizer`` has yet to create on ``device_type`` devices, and of how many
    parameters (elements), or ``None`` for an optimizer whose state this does not know (anything but Adam/AdamW).

    A parameter whose state exists (after the first step, or loaded on resume) adds nothing; one on another device
    (an optimizer offloaded to the CPU) neither. Under ZeRO the parameters are this process's fp32 partitions; under
    FSDP each parameter counts its local shard.
    """
    if optimizer is None:
        return None
    optimizer = innermost_optimizer(optimizer)
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    state = getattr(optimizer, "state", {})
    pending = elements = 0
    for group in groups:
        moments = _moments_per_parameter(optimizer, group)
        if moments is None:
            return None
        for parameter in group["params"]:
            if state.get(parameter):
                continue
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP2's DTensor
            if local.device.type != device_type:
                continue
            pending += moments * local.numel() * local.element_size()
            elements += local.numel()
    return pending, elements


def generation_memory_verdict(
    readings: list[tuple[float, float, float, float]], share: float, later_generations: bool
) -> tuple[str, str | None]:
    """A line on the fullest GPU at the first generation and, where later generations will not fit, the error.

    ``readings`` holds, per process, ``(used, total, pending, parameters)``: bytes in use on its GPU with vLLM
    awake, the card's bytes, and the optimizer state still to come (bytes, and of how many parameters).
    """
    worst = max(range(len(readings)), key=lambda i: readings[i][0] + readings[i][2] - readings[i][1])
    used, total, pending, parameters = readings[worst]
    later = used + pending
    line = (
        f"GPU memory at the first generation (vLLM awake, vllm_gpu_memory_utilization={share}): {used / GIB:.1f} of "
        f"{total / GIB:.1f} GiB in use on the fullest GPU (process {worst}); the optimizer's state that its first "
        f"step creates ({pending / GIB:.1f} GiB there) brings later generations to about {later / GIB:.1f} GiB."
    )
    if later <= total or not later_generations:
        return line, None
    suggestion = math.floor((share - (later - total + HEADROOM_BYTES) / total) * 100) / 100
    fix = (
        f"Lower vllm_gpu_memory_utilization from {share} to at most {suggestion:.2f}, or train on more processes "
        "so that ZeRO or FSDP shard the optimizer's state further."
        if suggestion >= 0.05
        else "No share leaves room for vLLM's weights beside training here: train on more processes so that ZeRO "
        "or FSDP shard the training state further, or run vLLM on GPUs of its own (vllm_mode: server)."
    )
    error = (
        f"vLLM's share of each GPU will not fit beside training after the first optimizer step. At this first "
        f"generation process {worst}'s GPU has {used / GIB:.1f} of {total / GIB:.1f} GiB in use (vLLM awake, "
        f"vllm_gpu_memory_utilization={share}); the optimizer's moment estimates, which its first step creates for "
        f"this process's {parameters / 1e9:.2f}B parameters, add {pending / GIB:.1f} GiB, so the second generation "
        f"would need about {later / GIB:.1f} GiB and run out of memory a whole step from now. {fix} Stopped before "
        "generating."
    )
    return line, error
