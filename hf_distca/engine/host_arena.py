"""A host-memory arena for offloaded activations: chunks allocated once, carved into exact-size views.

torch's pinned-memory allocator rounds every request up to a power of two, so pinning each offloaded
tensor on its own can cost up to twice its size in host memory. The arena instead allocates large chunks
(``chunk_bytes`` each, or one chunk of its own for a tensor larger than that, rounded up to a size class
at most 1/8 above it) and hands out views at a bump pointer, aligned to ``ALIGN`` bytes, so a step's
tensors cost their own bytes plus at most ``ALIGN - 1`` each and the unused tail of a chunk they did not
fit in. When no view is live any more (every offloaded tensor of the step was used and freed) the arena
resets: the pointer goes back to the first chunk and the next step reuses the same memory, and the chunks
that step did not use at all are freed, so that micro-batches of varying shapes (one a little larger than
any before, step after step) do not pile up chunks: what the arena holds after a step is what that step
used. It says how much it holds (:meth:`HostArena.report`).

On a CUDA machine the chunks are page-locked with ``cudaHostRegister`` (torch.cuda.cudart()) so
device<->host copies can run asynchronously; every chunk starts at a page boundary and is a whole number
of pages, so no two registered ranges (nor a registered range and other host memory) share a page.
Elsewhere (the CPU tests) they are plain host memory and the same code runs.
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["ALIGN", "PAGE", "HostArena"]

ALIGN = 64
"""Every view starts at a multiple of this many bytes (any dtype's element size divides it)."""

PAGE = mmap.PAGESIZE
"""Every chunk starts at a multiple of this many bytes and holds a whole number of them."""


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of an eighth of its power of two (at most 1/8 more), so that
    tensors a little larger than one step's fit the next step's chunks."""
    granule = max(1, 1 << max(nbytes.bit_length() - 4, 0))  # (the power of two <= nbytes) / 8
    return -(-nbytes // granule) * granule


class _Chunk:
    def __init__(self, nbytes: int, pin: bool) -> None:
        # nbytes is a whole number of pages; one page of slack lets the chunk start at a page boundary
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)  # (nbytes + PAGE,) plain host memory
        offset = -raw.data_ptr() % PAGE
        self.buffer = raw[offset : offset + nbytes]  # (nbytes,) page-aligned, whole pages
        self.pinned = False
        if pin:
            rc = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte host chunk failed (error {int(rc)})")
            self.pinned = True
        self.used = 0
        self.taken = False  # a view of this step lies in it

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        # unregistered before its buffer's memory goes back to the host allocator: a later chunk may get
        # the same addresses, and registering them again fails while they are still registered
        self.release()


class HostArena:
    """Exact-size host views for offloaded tensors, out of chunks reused step after step.

    ``take`` returns a view and counts it live until ``give_back``; when the count reaches zero the arena
    resets (every chunk empty again; the chunks this step did not use are freed). ``pin``: page-lock the
    chunks (needs CUDA)."""

    def __init__(self, chunk_bytes: int = 1 << 30, *, pin: bool = False) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes < ALIGN:
            raise ValueError(f"HostArena chunk_bytes must be an int >= {ALIGN}, got {chunk_bytes!r}")
        if pin and not torch.cuda.is_available():
            raise ValueError(
                "HostArena(pin=True) page-locks host memory for CUDA copies: no CUDA device here"
            )
        self.chunk_bytes = _whole_pages(chunk_bytes)
        self.pin = pin
        self._chunks: list[_Chunk] = []
        self._current = 0  # chunks before it are full for this step, chunks after it are empty
        self._taken = 0  # views taken since the last reset
        self.live = 0
        self.used_bytes = 0  # bytes handed out since the last reset (alignment included)
        self.peak_bytes = 0
        self.peak_capacity_bytes = 0
        self.chunks_released = 0
        self.resets = 0

    @property
    def capacity_bytes(self) -> int:
        """Host bytes the arena holds (every chunk)."""
        return sum(c.nbytes for c in self._chunks)

    @property
    def chunk_sizes(self) -> list[int]:
        return [c.nbytes for c in self._chunks]

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` (uninitialized), a view into a chunk; live until
        :meth:`give_back`."""
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        chunk, start = self._place(nbytes)
        chunk.used = start + nbytes
        chunk.taken = True
        self._taken += 1
        self.live += 1
        self.used_bytes = sum(c.used for c in self._chunks)  # chunks past the current one are empty
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        flat = chunk.buffer[start : start + nbytes]  # (nbytes,) uint8
        return flat.view(dtype).view(shape)

    def _place(self, nbytes: int) -> tuple[_Chunk, int]:
        """The chunk and byte offset of the next view: the current chunk if it fits, else the first later
        (empty) chunk large enough, else a new chunk of chunk_bytes (or of nbytes' size class, in whole
        pages, when larger)."""
        if self._chunks:
            chunk = self._chunks[self._current]
            start = -(-chunk.used // ALIGN) * ALIGN  # the next multiple of ALIGN
            if start + nbytes <= chunk.nbytes:
                return chunk, start
        later = range(self._current + 1 if self._chunks else 0, len(self._chunks))
        for index in later:
            if self._chunks[index].nbytes >= nbytes:
                self._current = index
                return self._chunks[index], 0
        self._chunks.append(_Chunk(max(self.chunk_bytes, _whole_pages(_size_class(nbytes))), self.pin))
        self._current = len(self._chunks) - 1
        self.peak_capacity_bytes = max(self.peak_capacity_bytes, self.capacity_bytes)
        return self._chunks[-1], 0

    def give_back(self) -> None:
        """One view of :meth:`take` is no longer used; the last one resets the arena."""
        if self.live <= 0:
            raise RuntimeError("HostArena.give_back without a live view (a view was given back twice)")
        self.live -= 1
        if self.live == 0:
            self.reset()

    def reset(self) -> None:
        """Every chunk empty again (only with no live view: a live view's bytes would be handed out twice);
        after a step that took views, the chunks it did not use are freed."""
        if self.live:
            raise RuntimeError(f"HostArena.reset with {self.live} live view(s): their memory would be reused")
        if self._taken:
            self._free([c for c in self._chunks if not c.taken])
        for chunk in self._chunks:
            chunk.used, chunk.taken = 0, False
        self._current = 0
        self._taken = 0
        self.used_bytes = 0
        self.resets += 1

    def clear(self) -> None:
        """Free every chunk (no live view allowed)."""
        self.reset()
        self._free(list(self._chunks))

    def _free(self, chunks: list[_Chunk]) -> None:
        if not chunks:
            return
        if any(c.pinned for c in chunks):
            # copies from or to them may still be queued (the host never waited for them): done first
            torch.cuda.synchronize()
        for chunk in chunks:
            chunk.release()
        self._chunks = [c for c in self._chunks if all(c is not d for d in chunks)]
        self.chunks_released += len(chunks)

    def report(self) -> dict[str, float | int | bool]:
        """What the arena holds now and at most, its peak use (GiB), chunks, whether page-locked."""
        return {
            "host_arena_gib": self.capacity_bytes / 2**30,
            "host_arena_peak_held_gib": self.peak_capacity_bytes / 2**30,
            "host_arena_peak_gib": self.peak_bytes / 2**30,
            "host_arena_chunks": len(self._chunks),
            "host_arena_chunks_released": self.chunks_released,
            "host_arena_pinned": self.pin,
        }
