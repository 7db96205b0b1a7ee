"""Where each decoder layer keeps its attention output from forward to backward: a per-layer policy.

Rematerialization-aware checkpointing (:mod:`hf_distca.engine.remat`) keeps every layer's attention output
and log-sum-exp so that backward never runs core attention forward again. Per layer that is one of

- ``"gpu"``: kept on the device (the default, and today's behaviour);
- ``"host"``: kept in host memory (:mod:`hf_distca.engine.offload`), brought back a layer ahead;
- ``"drop"``: not kept; that layer's checkpoint recomputes its attention as plain checkpointing does.

``"auto"`` chooses before the first step by :func:`choose_kept_attention`'s rule from the free device and host
memory, and looks again after it: a layer in host memory drops its outputs where the first step measured
their copies to cost more than its attention (:mod:`hf_distca.offload_timing`). The choice is a list with one entry per decoder layer, the same on every rank (a rank that
dropped a layer's output runs that layer's attention again in backward, with its collectives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "KEPT_ATTENTION_CHOICES",
    "KEPT_ATTENTION_OPTIONS",
    "choose_kept_attention",
    "describe",
    "free_device_bytes",
    "free_host_bytes",
    "kept_attention_bytes",
    "per_layer",
]

KEPT_ATTENTION_CHOICES = ("gpu", "host", "drop")
KEPT_ATTENTION_OPTIONS = ("auto", *KEPT_ATTENTION_CHOICES)


def per_layer(kept_attention: str | Sequence[str], layers: int) -> list[str] | None:
    """The per-layer list of ``kept_attention`` (one choice for every layer, or one per layer); None for
    ``"auto"`` (chosen at the first step). Raises on an unknown choice or a list of the wrong length."""
    if isinstance(kept_attention, str):
        if kept_attention not in KEPT_ATTENTION_OPTIONS:
            raise ValueError(
                f"kept_attention must be one of {KEPT_ATTENTION_OPTIONS} or one of {KEPT_ATTENTION_CHOICES} per "
                f"decoder layer, got {kept_attention!r}"
            )
        return None if kept_attention == "auto" else [kept_attention] * layers
    choices = list(kept_attention)
    if len(choices) != layers or any(c not in KEPT_ATTENTION_CHOICES for c in choices):
        raise ValueError(
            f"kept_attention as a list needs one of {KEPT_ATTENTION_CHOICES} for each of the model's {layers} "
            f"decoder layers, got {choices!r}"
        )
    return choices


def kept_attention_bytes(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one layer keeps for ``tokens`` query rows: the output (T, Hq, D) and the float32 log-sum-exp
    (T, Hq)."""
    return tokens * heads * (head_dim * torch.empty((), dtype=dtype).element_size() + 4)


def choose_kept_attention(
    layers: int,
    kept_bytes: int,
    *,
    free_device: int | None,
    free_host: int,
    inputs_on_device: int = 0,
    inputs_on_host: int = 0,
    device_fraction: float = 0.5,
    host_fraction: float = 0.8,
) -> list[str]:
    """The rule of ``kept_attention="auto"``, one choice per layer.

    Device budget: ``device_fraction x free_device`` (the rest is left to one layer's recompute and
    backward working set, the gradients and the optimizer's states, not all allocated yet at the first
    step) minus the checkpointed inputs that stay on the device (``inputs_on_device``, all layers). Host
    budget: ``host_fraction x free_host`` minus the checkpointed inputs offloaded there. The LAST layers
    keep on the device as many outputs as its budget holds (backward needs them first, so they are on the
    device longest for the least time), the layers before them in host memory as many as its budget
    holds, and the first layers drop theirs (recomputed in backward). ``free_device`` None (no CUDA
    device, e.g. the CPU): everything stays where it is ("gpu")."""
    if free_device is None:
        return ["gpu"] * layers
    if kept_bytes <= 0:
        return ["gpu"] * layers
    device_budget = max(0.0, device_fraction * free_device - inputs_on_device)
    host_budget = max(0.0, host_fraction * free_host - inputs_on_host)
    on_device = min(layers, int(device_budget // kept_bytes))
    on_host = min(layers - on_device, int(host_budget // kept_bytes))
    dropped = layers - on_device - on_host
    return ["drop"] * dropped + ["host"] * on_host + ["gpu"] * on_device


def free_device_bytes(device: torch.device | None = None) -> int | None:
    """Free memory of the current CUDA device (``torch.cuda.mem_get_info``), None without CUDA."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def free_host_bytes() -> int:
    """Host memory available to new allocations: MemAvailable of /proc/meminfo (psutil's
    ``virtual_memory().available`` where there is no /proc), and no more than the room left under this
    process's cgroup memory limit (a container sees the whole machine's MemAvailable), in bytes."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    room = _cgroup_room()
    return available if room is None else min(available, room)


_CGROUP_FILES = (  # (limit, usage, stat) of cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
    ),
)


def _cgroup_room() -> int | None:
    """The cgroup's memory limit minus its usage (its reclaimable inactive page cache not counted as used);
    None without a limit."""
    for limit_file, usage_file, stat_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max" or v1's "unlimited" page counter
            return None
        cache = 0
        try:
            with open(stat_file) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name in ("inactive_file", "total_inactive_file"):
                        cache = int(value)
                        break
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - usage + cache)
    return None


def describe(policy: Sequence[str]) -> dict[str, int]:
    """How many layers keep their attention output where (for reports)."""
    return {
        f"kept_attention_{choice}_layers": sum(p == choice for p in policy)
        for choice in KEPT_ATTENTION_CHOICES
    }
