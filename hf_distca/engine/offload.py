"""Saved tensors in host memory: copied out on a side stream in forward, brought back a group ahead in backward.

An :class:`Offloader` gives ``torch.autograd.graph.saved_tensors_hooks`` their pack and unpack functions
(and the rematerialization frames of :mod:`hf_distca.engine.remat` the same two for the kept attention
outputs). Tensors are packed into groups (one per decoder layer call, :meth:`Offloader.begin_group`),
numbered in forward order.

- pack: a tensor of at least ``min_bytes`` (plain ``torch.Tensor``, not a parameter) is copied into an
  exact-size view of the :class:`~hf_distca.engine.host_arena.HostArena`. On CUDA the copy runs on the
  offloader's side stream after waiting (an event, never the host) for the stream that produced it; the
  source is recorded on the side stream and dropped at once, so its device memory is freed as soon as its
  last other user lets go of it, and the caching allocator hands it out again only after the copy has
  run. Smaller tensors are kept as they are.
- unpack: the tensor comes back into fresh memory on its device (the side stream waits for the compute
  stream first, so memory the allocator just recycled is not written early) and the consumer's stream
  waits on the copy's event. Unpacking any tensor of group g also starts the copies of the nearest earlier
  group with offloaded tensors (:meth:`Offloader.prefetch_before`), the next one backward needs, so that
  they run while group g's backward computes. Correctness never depends on that prefetch: an unpack always
  makes sure its own copy was issued and waits for it.

On CPU tensors (the tests) the copies are synchronous and everything else is the same code.
Host views are given back to the arena when autograd frees the packed object (after its backward, or
with the graph); the arena then resets for the next step.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from hf_distca.engine.host_arena import HostArena

__all__ = ["Offloader", "Packed"]


class Packed:
    """A tensor held in host memory by an :class:`Offloader` (what autograd keeps instead of it)."""

    __slots__ = (
        "__weakref__",
        "_owner",
        "d2h",
        "device",
        "device_copy",
        "dtype",
        "group",
        "h2d",
        "host",
        "shape",
    )

    def __init__(
        self, owner: Offloader, group: int, source: torch.Tensor, host: torch.Tensor, d2h: Any
    ) -> None:
        self._owner = owner
        self.group = group
        self.device, self.dtype, self.shape = source.device, source.dtype, source.shape
        self.host = host
        self.d2h = d2h  # the device->host copy's CUDA event (None on the CPU)
        self.device_copy: torch.Tensor | None = None  # brought back, not yet handed out
        self.h2d: Any = None  # the host->device copy's CUDA event

    def __del__(self) -> None:
        owner = self._owner
        if owner is not None:
            self._owner = None
            owner._forget(self)


class Offloader:
    """Pack/unpack hooks that keep saved tensors in host memory (see the module docstring)."""

    def __init__(self, arena: HostArena | None = None, *, min_bytes: int = 1 << 20) -> None:
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"Offloader min_bytes must be an int >= 0, got {min_bytes!r}")
        self.arena = arena if arena is not None else HostArena()
        self.min_bytes = min_bytes
        self._lock = threading.RLock()  # pack runs on forward threads, unpack and frees on backward's
        self._groups: dict[int, list[weakref.ref]] = {}  # packed objects of each group with live ones
        self._next_group = 0
        self._prefetched: set[int] = set()
        self._streams: dict[torch.device, Any] = {}
        self.live = 0
        self.tensors_offloaded = 0
        self.bytes_offloaded = 0
        self.groups_prefetched = 0

    # ------------------------------------------------------------------------------------ forward
    def begin_group(self) -> int:
        """The number of the next group (a decoder layer call; numbers grow in forward order)."""
        with self._lock:
            self._next_group += 1
            return self._next_group - 1

    def packer(self, group: int) -> Any:
        """The pack hook of ``group``: ``tensor`` itself when small (or not offloadable), else a
        :class:`Packed`."""
        return lambda tensor: self.pack(tensor, group)

    def pack(self, tensor: torch.Tensor, group: int) -> Any:
        """Pack ``tensor`` into ``group`` (see :meth:`packer`)."""
        if (
            type(tensor) is not torch.Tensor  # parameters, wrapper subclasses (DTensor): left alone
            or tensor.layout != torch.strided
            or tensor.numel() * tensor.element_size() < max(self.min_bytes, 1)
        ):
            return tensor
        with self._lock:
            host = self.arena.take(tensor.shape, tensor.dtype)
            d2h = None
            if tensor.is_cuda:
                side = self._side(tensor.device)
                side.wait_stream(torch.cuda.current_stream(tensor.device))  # the producer's work first
                with torch.cuda.stream(side):
                    host.copy_(tensor, non_blocking=True)
                    d2h = side.record_event()
                # no reference is kept: the allocator does not reuse its memory before the copy has run
                tensor.record_stream(side)
            else:
                host.copy_(tensor)
            packed = Packed(self, group, tensor, host, d2h)
            self._groups.setdefault(group, []).append(weakref.ref(packed))
            self.live += 1
            self.tensors_offloaded += 1
            self.bytes_offloaded += tensor.numel() * tensor.element_size()
            return packed

    @property
    def side_streams(self) -> list:
        """The CUDA streams the copies run on (one per device; none before the first CUDA copy)."""
        return list(self._streams.values())

    # ----------------------------------------------------------------------------------- backward
    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook: the tensor, back on its device (the consumer's stream waits for its copy)."""
        if not isinstance(packed, Packed):
            return packed
        with self._lock:
            self._bring_back(packed)
            self.prefetch_before(packed.group)
            tensor, packed.device_copy = packed.device_copy, None  # a second unpack copies again
            if packed.h2d is not None:
                torch.cuda.current_stream(packed.device).wait_event(packed.h2d)
            return tensor

    def prefetch_before(self, group: int) -> int | None:
        """Start bringing back the nearest group before ``group`` that has offloaded tensors (backward needs it
        next), unless it already was; groups in between kept theirs on the device. Returns that group (None:
        there is none). Called at each unpack of ``group``; a caller that knows when the backward of a group
        without offloaded tensors begins may call it then, so the copies of the last offloaded group start
        early too."""
        with self._lock:
            earlier = [g for g in self._groups if g < group]
            if not earlier:
                return None
            nearest = max(earlier)
            if nearest not in self._prefetched:
                self._prefetch(nearest)
            return nearest

    def _prefetch(self, group: int) -> None:
        self._prefetched.add(group)
        self.groups_prefetched += 1
        for ref in self._groups[group]:
            packed = ref()
            if packed is not None:
                self._bring_back(packed)

    def _bring_back(self, packed: Packed) -> None:
        """Issue the host->device copy of ``packed`` unless it is already on its way."""
        if packed.device_copy is not None:
            return
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)  # (same shape)
        if packed.device.type == "cuda":
            side = self._side(packed.device)
            # memory just recycled by the compute stream may still be read there: write after it
            side.wait_stream(torch.cuda.current_stream(packed.device))
            with torch.cuda.stream(side):
                out.copy_(packed.host, non_blocking=True)
                packed.h2d = side.record_event()
            out.record_stream(side)  # freed early (never consumed), it is not reused before the copy ends
        else:
            out.copy_(packed.host)
        packed.device_copy = out

    def _side(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    # ------------------------------------------------------------------------------------ release
    def _forget(self, packed: Packed) -> None:
        """``packed`` was freed by autograd: its host view goes back; with none live, a new step starts."""
        with self._lock:
            self.live -= 1
            self.arena.give_back()  # the last one resets the arena
            if self.live == 0:
                self._groups, self._prefetched = {}, set()

    def report(self) -> dict[str, float | int | bool]:
        """Offloaded tensors and bytes so far, groups prefetched, and the arena's size."""
        return {
            "offloaded_tensors": self.tensors_offloaded,
            "offloaded_gib": self.bytes_offloaded / 2**30,
            "offload_groups_prefetched": self.groups_prefetched,
            **self.arena.report(),
        }
