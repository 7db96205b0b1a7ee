"""NCCL's semantics for the engine's all-to-all, on one GPU, over gloo (issue 31, outcome 1).

NCCL refuses two ranks on one GPU, and gloo with CUDA tensors behaves unlike NCCL: it reads the send
buffer at once and blocks the host in ``wait()``. :func:`installed` replaces ``torch.distributed.
all_to_all_single`` (what :func:`hf_distca.comm.all_to_all_v` calls) for CUDA tensors with an exchange that
behaves as ProcessGroupNCCL's does, only more so:

- at issue, the output is poisoned (NaN; the largest value for integers) on the issuing stream, and a
  private stream (one per device, as NCCL's per group) waits on the issuing stream;
- the send buffer is read late: on the private stream, after ``torch.cuda._sleep`` (a random delay);
- the host does not wait at issue; allocations are churned on the issuing stream (freed blocks reused
  and overwritten at once);
- at ``wait()``, the exchange completes late (gloo on host copies, then a random delay on the private
  stream before the received rows land) and only the stream current at ``wait()`` is made to wait (an
  event), never the host or another stream;
- send and receive buffers are held by the work until ``wait()`` and released then (NCCL's stash), no
  ``record_stream``.

So a consumer that reads a received buffer on a stream that was not made to wait reads NaN (or rows that
land later); a send buffer overwritten or freed before the exchange's late read sends garbage. One thing
NCCL does is not reproduced: at ``wait()`` the host waits for the late read (gloo needs the bytes on the
host), so a send buffer reused by another stream after ``wait()`` (the review's relay risk) is not exposed. Every rank
issues and waits in the same order (the engine's schedules are deterministic), which is what gloo needs to
pair the host-side exchanges that run at ``wait()``.

The rank function :func:`schedule_case` (run on 2-4 gloo processes sharing GPU 0 by
tests/test_nccl_semantics.py) trains one step of a tiny Llama with rematerialization-aware checkpointing in
each schedule; ``broken`` makes :class:`hf_distca.comm.Exchange` wait on a stream nobody uses (the
negative control: one wait removed); :func:`sanitized_schedule_case` runs it under PyTorch's CUDA sanitizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

SANITIZER_ENV = "TORCH_CUDA_SANITIZER"
"""Set when torch is imported, PyTorch's CUDA sanitizer (CSAN) checks every kernel launch's stream order."""
SLEEP_CYCLES = (200_000, 4_000_000)
"""Range of each random delay on the private stream (GPU clock cycles: ~0.1-2 ms on an H200)."""
CHURN_BYTES = (1 << 16, 1 << 22)
"""Range of each churned allocation's size."""


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What a poisoned buffer of ``dtype`` holds: NaN for floating point, the largest value otherwise."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def split_sizes(given: list[int] | None, numel: int, world: int) -> list[int]:
    """Elements per rank of a flat all-to-all buffer (equal parts when none are given)."""
    if given:
        return [int(s) for s in given]
    if numel % world:
        raise ValueError(f"{numel} elements do not split equally over {world} ranks")
    return [numel // world] * world


@dataclasses.dataclass
class Semantics:
    """The random choices of one process (seeded: a run is repeatable) and its private streams."""

    seed: int = 0
    churn: int = 3
    """Allocations churned at each issue and wait."""
    _rng: random.Random = dataclasses.field(init=False)
    _streams: dict[int, Any] = dataclasses.field(default_factory=dict)
    issued: int = 0
    waited: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(index)
        return self._streams[index]

    def sleep(self) -> None:
        torch.cuda._sleep(self._rng.randint(*SLEEP_CYCLES))

    def churn_allocations(self, device: torch.device, nbytes: int | None = None) -> None:
        """Allocate, overwrite and free a few blocks on the current stream (recently freed memory is
        handed out again and filled with garbage at once); ``nbytes``: each block's size (default random
        within :data:`CHURN_BYTES`; a freed buffer of exactly that size is the caching allocator's first
        choice)."""
        for _ in range(self.churn):
            size = nbytes if nbytes is not None else self._rng.randint(*CHURN_BYTES)
            block = torch.empty(size, dtype=torch.uint8, device=device)
            block.fill_(0xFF)  # NaN in every float dtype
            del block


class NcclLikeWork:
    """The handle of an exchange in flight; :meth:`wait` completes it (see the module docstring)."""

    def __init__(self, semantics: Semantics, output, input, staged, read, recv_splits, send_splits, group):  # noqa: A002
        self.semantics = semantics
        self.output, self.input, self.staged, self.read = output, input, staged, read
        self.recv_splits, self.send_splits, self.group = recv_splits, send_splits, group
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if self.done:
            return True
        self.read.synchronize()  # the late read of the send buffer (the host drives the gloo exchange)
        received = torch.empty(self.output.shape, dtype=self.output.dtype, pin_memory=True)
        _real["all_to_all_single"](
            received, self.staged, self.recv_splits, self.send_splits, group=self.group
        )
        device = self.output.device
        private = self.semantics.stream(device)
        with torch.cuda.stream(private):
            self.semantics.sleep()  # the exchange completes late
            self.output.copy_(received, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(private)
        torch.cuda.current_stream(device).wait_event(landed)  # only the current stream
        self.output = self.input = self.staged = self.read = None  # the stash released at wait()
        self.done = True
        self.semantics.waited += 1
        self.semantics.churn_allocations(device)
        return True

    def is_completed(self) -> bool:
        return self.done


_real: dict[str, Any] = {}


def nccl_like_all_to_all_single(
    semantics: Semantics,
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch.distributed's name
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> NcclLikeWork | None:
    """``torch.distributed.all_to_all_single`` with NCCL's stream semantics for CUDA tensors (the real
    one for others)."""
    if not input.is_cuda:
        return _real["all_to_all_single"](
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    world = dist.get_world_size(group)
    send_splits = split_sizes(input_split_sizes, input.numel(), world)
    recv_splits = split_sizes(output_split_sizes, output.numel(), world)
    device = input.device
    current = torch.cuda.current_stream(device)
    output.fill_(poison_value(output.dtype))  # on the issuing stream: what a reader that did not wait sees
    private = semantics.stream(device)
    private.wait_stream(current)
    with torch.cuda.stream(private):
        semantics.sleep()  # the send buffer is read late
        staged = torch.empty(input.shape, dtype=input.dtype, pin_memory=True)
        staged.copy_(input, non_blocking=True)
        read = torch.cuda.Event()
        read.record(private)
    semantics.issued += 1
    work = NcclLikeWork(semantics, output, input, staged, read, recv_splits, send_splits, group)
    semantics.churn_allocations(device)
    if async_op:
        return work
    work.wait()
    return None


@contextlib.contextmanager
def installed(semantics: Semantics) -> Iterator[Semantics]:
    """Inside, ``torch.distributed.all_to_all_single`` behaves as NCCL's for CUDA tensors."""
    if "all_to_all_single" in _real:
        raise RuntimeError("the NCCL-like all_to_all_single is installed already")
    _real["all_to_all_single"] = dist.all_to_all_single

    def replacement(*args: Any, **kwargs: Any) -> NcclLikeWork | None:
        return nccl_like_all_to_all_single(semantics, *args, **kwargs)

    dist.all_to_all_single = replacement
    try:
        yield semantics
    finally:
        dist.all_to_all_single = _real.pop("all_to_all_single")


@contextlib.contextmanager
def one_wait_removed() -> Iterator[None]:
    """The negative control: :meth:`hf_distca.comm.Exchange.wait` completes the exchange but orders a
    stream nobody uses instead of the current one (a missing ``wait_stream``)."""
    from hf_distca.comm import Exchange

    original = Exchange.wait

    def wait(self: Exchange) -> torch.Tensor:
        if self.work is not None:
            with torch.cuda.stream(torch.cuda.Stream(self.recv.device)):
                self.work.wait()
            self.work = None
        return self.recv

    Exchange.wait = wait
    try:
        yield
    finally:
        Exchange.wait = original


# ------------------------------------------------------------------------------------ the ranks' step
SCHEDULES = {
    "serial": {"ping_pong": False},
    "ping_pong:local_first": {"ping_pong": True, "ping_pong_split": "local_first"},
    "ping_pong:halves": {"ping_pong": True, "ping_pong_split": "halves"},
    "layer_ping_pong": {"layer_ping_pong": True},
    "relay": {"ping_pong": True, "kv_relay": True, "ranks_per_node": 2},
    "relay:layer_ping_pong": {"layer_ping_pong": True, "kv_relay": True, "ranks_per_node": 2},
}
"""DistCAConfig fields of every schedule (the relay's with nodes of 2 ranks: 4 ranks)."""


def schedule_case(rank: int, world: int, names: list[str], broken: bool = False, seed: int = 0) -> dict:
    """On a gloo rank sharing GPU 0: one training step of the tiny Llama of tests/test_layer_ping_pong.py
    per schedule in ``names`` (rematerialization-aware checkpointing, fp32, the reference kernel), under
    NCCL's semantics (and, with ``broken``, one wait removed); the loss and gradients summed over the ranks,
    and how many exchanges ran."""
    from accelerate.utils import send_to_device
    from test_engine_remat import docs_of, summed_over_ranks, tiny_llama, with_mode
    from test_layer_ping_pong import LENGTHS, TOKENS_PER_RANK

    from hf_distca import DistCAConfig, enable_distca, nano_batch_loss
    from hf_distca.data import DistCABatches

    torch.cuda.set_device(0)
    base = tiny_llama(seed=7).cuda()
    docs = docs_of(LENGTHS, seed=11)
    n_targets = sum(n - 1 for n in LENGTHS)
    out = {}
    for name in names:
        config = DistCAConfig(shard_tokens=8, tolerance=0.0, backend="reference", **SCHEDULES[name])
        nanos = 2 if config.layer_ping_pong else 1
        loader = DistCABatches(
            docs, rank=rank, world_size=world, tokens_per_rank=TOKENS_PER_RANK, nano_batches=nanos
        )
        batch = send_to_device(loader.micro_batch(docs), "cuda")
        model = with_mode(base, "remat")
        enable_distca(model, group=dist.group.WORLD, config=config)
        semantics = Semantics(seed=seed * 1000 + rank)
        with installed(semantics), one_wait_removed() if broken else contextlib.nullcontext():
            loss = nano_batch_loss(model, batch, num_items_in_batch=n_targets)
            loss.backward()
        torch.cuda.synchronize()
        run = summed_over_ranks(model, loss)
        out[name] = {
            "loss": run["loss"],
            "grads": {k: g.cpu() for k, g in run["grads"].items()},
            "issued": semantics.issued,
            "waited": semantics.waited,
        }
    return out


# ------------------------------------------------------------------ under PyTorch's CUDA sanitizer
def sanitized_schedule_case(rank: int, world: int, names: list[str], broken: bool = False) -> dict:
    """:func:`schedule_case` under PyTorch's CUDA sanitizer (CSAN: every kernel launch's reads and writes
    checked against the streams' events), turned on in this rank before it uses CUDA (a forkserver that
    imported torch with :data:`SANITIZER_ENV` set would have initialised CUDA before the fork). The races it
    finds are recorded instead of raised (a rank that raised mid-step would leave the others in a gloo
    exchange); ``launches``: the kernel launches it checked (0: it was not on in this process). CSAN
    sees the emulated exchange's private stream (its poison, late copies and events), not gloo's host
    side."""
    from torch.cuda import _sanitizer as csan

    if not csan.cuda_sanitizer.enabled:  # on in this rank before its first CUDA call
        csan.enable_cuda_sanitizer()
    handler = csan.cuda_sanitizer.dispatch.event_handler
    launch = handler._handle_kernel_launch
    races: list[str] = []

    def recorded(*args: Any, **kwargs: Any) -> list:
        races.extend(str(error) for error in launch(*args, **kwargs))
        return []  # nothing raised: the step runs to its end on every rank

    handler._handle_kernel_launch = recorded
    try:
        run = schedule_case(rank, world, names, broken)
    finally:
        handler._handle_kernel_launch = launch
    return {
        "enabled": csan.cuda_sanitizer.enabled,
        "launches": handler.seq_num,
        "races": len(races),
        "first_races": races[:3],
        "run": run,
    }
