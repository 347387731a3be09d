"""Whether a colocated vLLM engine's share of each GPU still fits once the optimizer's state exists.

In colocate mode each training process shares its GPU with a vLLM engine that takes ``vllm_gpu_memory_utilization``
of the card whenever it generates. Beside it, training keeps its weights' and optimizer's shards there. PyTorch's
Adam and AdamW (DeepSpeed's fused Adam too) create their two moment estimates, each the size of the parameters they
update, at the first optimizer step, not before. So the first generation of a run has that much more room than
every later one: a share that fits the first generation can run out of memory at the second, one whole step later.

At the first generation of training, with vLLM awake, the trainer reads each GPU's memory in use and adds the
moments still to come: before vLLM generates, and again once it has (its sampling's buffers are then still held by
PyTorch's cache). Where the sum comes within ``MARGIN_BYTES`` of the card (or over it) and the run has a later
generation, it stops, naming the share that would fit: before generating where that reading already says so, else
right after the first generation, a step before the second would have failed.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "GenerationMemoryError",
    "device_memory",
    "fullest_reading",
    "generation_memory_verdict",
    "optimizer_name",
    "pending_optimizer_state_bytes",
]

GIB = 1024**3
#: What the suggested share leaves free on the fullest GPU at later generations, for the allocator's slack.
HEADROOM_BYTES = 1 * GIB
#: Later generations must leave this much of the card free to pass: the estimate can come out somewhat below the
#: peak that the second generation reaches.
MARGIN_BYTES = 1 * GIB
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


def _moments_per_parameter(optimizer, group: dict) -> int | None:
    """How many tensors like the parameter the optimizer keeps per parameter, where known."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or type(optimizer).__name__ in _ADAM_CLASS_NAMES:
        return 3 if group.get("amsgrad") else 2
    return None


def _optimizer_chain(optimizer) -> list:
    """``optimizer`` and the optimizers it wraps (accelerate's and DeepSpeed's wrappers: ``.optimizer``)."""
    chain = [optimizer]
    for _ in range(8):
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or inner is chain[-1]:
            break
        chain.append(inner)
    return chain


def optimizer_name(optimizer) -> str:
    """The class name of the optimizer that holds the state, under its wrappers."""
    return type(_optimizer_chain(optimizer)[-1]).__name__


def _updated_tensors(chain: list) -> list | None:
    """The tensors the innermost optimizer updates: DeepSpeed ZeRO-3 keeps its fp32 partitions on its own wrapper
    (``fp32_partitioned_groups_flat``) and puts each in the inner optimizer's ``param_groups`` only for the length of
    its step; everything else lists them in ``param_groups``. ``None`` where no tensor is found."""
    for level in chain:
        flats = getattr(level, "fp32_partitioned_groups_flat", None)
        if isinstance(flats, (list, tuple)) and flats:
            return [flat for flat in flats if isinstance(flat, torch.Tensor)]  # swapped to NVMe: empty, counts 0
    tensors = [parameter for group in getattr(chain[-1], "param_groups", None) or () for parameter in group["params"]]
    return tensors or None


def pending_optimizer_state_bytes(optimizer, device_type: str = "cuda") -> tuple[int, int] | None:
    """``(bytes, parameters)``: the state ``optimizer`` has yet to create on ``device_type`` devices, and of how many
    parameters (elements), or ``None`` for an optimizer whose state this does not know (anything but Adam/AdamW, or
    one whose parameters are not found).

    A parameter whose state exists (after the first step, or loaded on resume) adds nothing; one on another device
    (an optimizer offloaded to the CPU) neither. Under ZeRO the parameters are this process's fp32 partitions; under
    FSDP each parameter counts its local shard.
    """
    if optimizer is None:
        return None
    chain = _optimizer_chain(optimizer)
    inner = chain[-1]
    groups = getattr(inner, "param_groups", None)
    tensors = _updated_tensors(chain)
    if not groups or tensors is None:
        return None
    moments = {_moments_per_parameter(inner, group) for group in groups}
    if None in moments:
        return None
    per_parameter = max(moments)
    state = getattr(inner, "state", {})
    pending = elements = 0
    for parameter in tensors:
        if state.get(parameter):
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP2's DTensor
        if local.device.type != device_type:
            continue
        pending += per_parameter * local.numel() * local.element_size()
        elements += local.numel()
    return pending, elements


def fullest_reading(readings: list[tuple[float, float, float, float]]) -> int:
    """The process whose GPU comes closest to (or furthest over) its card once the optimizer state is there: the
    largest ``used + pending - total`` of ``readings`` (see :func:`generation_memory_verdict`)."""
    return max(range(len(readings)), key=lambda i: readings[i][0] + readings[i][2] - readings[i][1])


def generation_memory_verdict(
    readings: list[tuple[float, float, float, float]], share: float, later_generations: bool, generated: bool
) -> tuple[str, str | None]:
    """A line on the fullest GPU at the first generation and, where later generations will not fit, the error.

    ``readings`` holds, per process, ``(used, total, pending, parameters)``: bytes in use on its GPU with vLLM
    awake, the card's bytes, and the optimizer state still to come (bytes, and of how many parameters).
    ``generated``: read once the generation ran (what vLLM's sampling allocated is still held by PyTorch's cache),
    rather than before it. The sum can come out somewhat below the second generation's peak, so later generations
    must leave ``MARGIN_BYTES`` of the card free; the share it suggests leaves ``HEADROOM_BYTES``.
    """
    worst = fullest_reading(readings)
    used, total, pending, parameters = readings[worst]
    later = used + pending
    moment = "after" if generated else "before"
    line = (
        f"GPU memory at the first generation ({moment} it, vLLM awake, vllm_gpu_memory_utilization={share}): "
        f"{used / GIB:.1f} of "
        f"{total / GIB:.1f} GiB in use on the fullest GPU (process {worst}); the optimizer's state that its first "
        f"step creates ({pending / GIB:.1f} GiB there) brings later generations to about {later / GIB:.1f} GiB."
    )
    if later <= total - MARGIN_BYTES or not later_generations:
        return line, None
    suggestion = math.floor((share - (later - total + HEADROOM_BYTES) / total) * 100) / 100
    fix = (
        f"Lower vllm_gpu_memory_utilization from {share} to at most {suggestion:.2f}, or train on more processes "
        "so that ZeRO or FSDP shard the optimizer's state further."
        if suggestion >= 0.05
        else "No share leaves room for vLLM's weights beside training here: train on more processes so that ZeRO "
        "or FSDP shard the training state further, or run vLLM on GPUs of its own (vllm_mode: server)."
    )
    # Within the margin: the estimate can run low, so a sum this close to the card is not a fit.
    outcome, verdict = " and run out of memory a whole step from now", "will not fit"
    if later <= total:
        verdict = "leaves too little room"
        outcome = (
            f", within {MARGIN_BYTES / GIB:.1f} GiB of the card, too close to rely on (on GPU runs this estimate came "
            "out up to 0.75 GiB below the measured peak), and likely run out of memory a whole step from now"
        )
    error = (
        f"vLLM's share of each GPU {verdict} beside training after the first optimizer step. {moment.capitalize()} "
        f"the first generation process {worst}'s GPU has {used / GIB:.1f} of {total / GIB:.1f} GiB in use (vLLM awake, "
        f"vllm_gpu_memory_utilization={share}); the optimizer's moment estimates, which its first step creates for "
        f"this process's {parameters / 1e9:.2f}B parameters, add {pending / GIB:.1f} GiB, so the second generation "
        f"would need about {later / GIB:.1f} GiB{outcome}. {fix} "
        f"Stopped {moment} the first generation."
    )
    return line, error
