"""The exchange helpers of hf_distca.comm against the real ProcessGroupNCCL, on a 1-rank group of one GPU
(issue 31, outcome 3): its stream, its stash and its ``wait()``, with poison and delay. On one rank an
all-to-all is a copy, so every received buffer must equal what was sent.

What the library relies on, and nothing more (ProcessGroupNCCL's documented behaviour): an asynchronous
collective runs on the group's own stream, which waits at issue for the work already queued on the current
stream (so writes queued before the call are seen; writes queued after it race with the read and the
library makes none); ``work.wait()`` orders the stream current at that call after the collective without
blocking the host; the collective's tensors are held (stashed) until then.

How the semantics are made to bite, deterministically:

- **delay**: :func:`hold_back_nccl` queues a long ``torch.cuda._sleep`` on a helper stream and issues a
  tiny exchange from it: the group's stream (one per group and device, in order) runs no later collective
  before the sleep ends, while the current stream runs on. The host's work between issue and read takes
  microseconds; the sleep a quarter of a second.
- **poison**: :func:`poisoned_blocks` leaves blocks of NaN free in a stream's pool of the caching
  allocator, emptied first: the next allocations of that size on that stream (the received buffers made
  inside :func:`hf_distca.comm.all_to_all_v`) get them, which each test checks by address. A reader that
  was not ordered after the collective reads NaN, never stale rows of an earlier run.
- **churn**: blocks of exactly a buffer's size allocated, filled with NaN and freed on a stream
  (``Semantics.churn_allocations`` of tests/nccl_semantics.py): a buffer that was released too early is the
  allocator's first choice and is overwritten before NCCL's delayed read.

Skipped without CUDA or NCCL. On an H200 (about 10 s):

    python -m pytest -x --timeout 300 tests/test_gpu_nccl_one_rank.py

and under PyTorch's CUDA sanitizer (it sees the collective as an op of the issuing stream, so it checks
the tests' own kernels and events around it; it must see no race):

    TORCH_CUDA_SANITIZER=1 python -m pytest -x --timeout 300 tests/test_gpu_nccl_one_rank.py

With ``HF_DISTCA_GPU_RESULTS=<file>`` each test appends what it found (tests/gpu_results.py).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from gpu_results import record
from nccl_semantics import Semantics, poison_value

from hf_distca.comm import Exchange, all_to_all_v, chain
from hf_distca.engine.state import EngineState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL"
    ),
]

N = 4 << 20
"""Elements (float32, 16 MiB) of every buffer: a size the caching allocator gives a segment of its own and
hands out best fit, so a freed buffer of this size is the next one of this size on its stream."""
HOLD_CYCLES = 4_000_000_000
"""How long NCCL's stream is held back (GPU clock cycles: about 2 s on an H100 or H200)."""
HOST_BLOCKED_S = 1.0
"""Host seconds from a hold to the read after it beyond which the host itself waited for the hold."""
NAN = poison_value(torch.float32)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A real 1-rank NCCL process group on GPU 0 (eagerly initialised: ``device_id``)."""
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        token = torch.ones(1, device="cuda")
        all_to_all_v(token, [1], [1], dist.group.WORLD).wait()  # the communicator's first use, warmed
        torch.cuda.synchronize()
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def empty_pools():
    """Each test starts with no free block in any pool: the only free blocks of size N are its poison."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    torch.cuda.synchronize()


def source() -> torch.Tensor:
    """What every test sends: N distinct float32 values (exact, and exact when doubled)."""
    return torch.arange(N, dtype=torch.float32, device="cuda")


@functools.cache
def helper_stream() -> torch.cuda.Stream:
    """The one stream the holds sleep on: one hold after another ends :data:`HOLD_CYCLES` after the
    other."""
    return torch.cuda.Stream()


def hold_back_nccl(group) -> None:
    """Hold ProcessGroupNCCL's stream back by :data:`HOLD_CYCLES` more: a sleep on the helper stream and a
    tiny exchange issued from it, which the group's stream waits for (at issue) before any later
    collective."""
    with torch.cuda.stream(helper_stream()):
        torch.cuda._sleep(HOLD_CYCLES)
        token = torch.zeros(1, device="cuda")
        dist.all_to_all_single(torch.empty_like(token), token, group=group, async_op=True)


def poisoned_blocks(count: int) -> set[int]:
    """Leave ``count`` blocks of N NaNs free in the current stream's pool (their addresses)."""
    blocks = [torch.full((N,), NAN, device="cuda") for _ in range(count)]
    addresses = {b.data_ptr() for b in blocks}
    del blocks
    return addresses


def churn(times: int = 8) -> None:
    """Allocate, fill with NaN and free blocks of N floats on the current stream."""
    Semantics(churn=times).churn_allocations(torch.device("cuda"), nbytes=N * 4)


def exact(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when equal, else what differs (NaN rows: a read before the data landed or an overwrite)."""
    if torch.equal(got, want):
        return ""
    return f"{int(torch.isnan(got).sum())} NaN and {int((got != want).sum())} differing of {got.numel()}"


def test_the_churn_reuses_a_freed_buffer():
    """The harness itself: a freed block of size N is the next one handed out on its stream, so the
    churn of the tests below would overwrite a buffer released too early."""
    address = poisoned_blocks(1)
    again = torch.empty(N, device="cuda")
    assert again.data_ptr() in address
    assert torch.isnan(again).all()


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_write_queued_before_the_call_is_sent(group, async_op):
    """The send buffer is NaN on the device; the current stream sleeps, then writes it, then the exchange is
    issued (the host does not wait for the sleep). NCCL must read after the write: its stream waits for the
    current stream at issue (asynchronous) or the exchange runs on it (synchronous). Fails if the send
    buffer is read when the call is made (NaN received)."""
    send = torch.full((N,), NAN, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    send.copy_(source())
    exchange = all_to_all_v(send, [N], [N], group, async_op=async_op)
    assert (exchange.work is not None) == async_op
    got = exchange.wait().clone()  # read on the current stream, no host synchronisation before it
    torch.cuda.synchronize()
    failure = exact(got, source())
    record(f"{__name__}::write_before_call[{'async' if async_op else 'sync'}]", equal=not failure)
    assert not failure, failure


def test_wait_orders_the_current_stream_and_the_stash_holds_the_send(group):
    """NCCL's stream is held back; the send buffer is a temporary only the exchange holds; the received
    buffer starts as NaN. Read on the current stream without ``wait()`` (the negative control): NaN, the
    exchange has not run. The current stream then churns blocks of the send buffer's size; after
    ``Exchange.wait()`` a kernel on the current stream reads the received buffer, and only then does the
    host synchronise: it must equal what was sent. Fails if ``wait()`` does not order the current stream
    (NaN), or if the send buffer were released before NCCL read it (the churn's NaN)."""
    sent = source()
    poison = poisoned_blocks(2)  # one for the temporary send buffer, one for the received buffer
    issued = time.perf_counter()
    hold_back_nccl(group)
    exchange = all_to_all_v(sent + 0, [N], [N], group, async_op=True)
    assert exchange.recv.data_ptr() in poison, "the received buffer is not a poisoned block"
    early = exchange.recv.clone()  # the negative control: no wait()
    host_s = time.perf_counter() - issued  # the hold must outlast this for the control to bite
    churn()
    received = exchange.wait()
    got = received.clone()
    assert exchange.work is None and exchange.send.numel() == 0  # done, the send buffer let go
    assert exchange.wait() is received  # a second wait() is a no-op
    torch.cuda.synchronize()
    failure = exact(got, sent)
    held = bool(torch.isnan(early).all())
    record(f"{__name__}::wait_and_stash", equal=not failure, read_without_wait_was_poison=held)
    assert not failure, failure
    if not held and host_s > HOST_BLOCKED_S:
        pytest.skip(
            f"issuing the exchange blocked the host until NCCL's stream was free ({host_s:.2f} s from the hold "
            "to the read): on this NCCL a 1-rank group cannot show a late exchange, so wait()'s ordering is not "
            "exercised here (tests/test_nccl_semantics.py emulates it on several ranks)"
        )
    assert held, (
        f"the read without wait() saw data ({host_s:.3f} s on the host from the hold to the read): NCCL's "
        "stream was not held back, the test cannot bite"
    )


def relay(group, side) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV relay's chain on one rank: stage 1 sends :func:`source`, stage 2 sends twice what stage 1
    received, from ``side``. Every received buffer starts as NaN; NCCL's stream is held back before each
    stage (one hold after the other), so the side stream's kernels after stage 1 run a hold ahead of
    stage 2's read. Between the call and
    ``wait()`` the current stream churns; after it the side stream churns blocks of the second stage's
    send size without waiting for anything (what a later chain would do were it not to wait for the
    current stream first). Returns both stages' received buffers as read by the current stream."""
    sent = source()
    current_poison = poisoned_blocks(2)  # stage 1's send and received buffers
    with torch.cuda.stream(side):
        side_poison = poisoned_blocks(2)  # stage 2's send (twice the first's received) and received

    def then(received: torch.Tensor) -> Exchange:
        hold_back_nccl(group)  # the second stage's read comes well after the side stream's next kernels
        return all_to_all_v(received * 2, [N], [N], group, async_op=True)

    hold_back_nccl(group)
    relayed = chain(all_to_all_v(sent + 0, [N], [N], group, async_op=True), then, side)
    assert relayed.exchanges[0].recv.data_ptr() in current_poison, "stage 1 received into fresh memory"
    assert relayed.exchanges[1].recv.data_ptr() in side_poison, "stage 2 received into fresh memory"
    churn()
    first, second = relayed.wait()
    with torch.cuda.stream(side):
        churn()
    got = first.clone(), second.clone()
    torch.cuda.synchronize()
    return got


def test_chain_relays_the_first_stage_from_the_side_stream(group):
    """``chain()`` with the engine's high-priority side stream: stage 2 must send twice what stage 1
    received. Fails if the side stream does not wait for stage 1 before reading its received buffer (NaN
    doubled), if ``Chain.wait()`` does not order the current stream after both stages (NaN), or if stage
    2's send buffer, made on the side stream, is handed out again on the side stream before NCCL read it
    (the churn's NaN: what the ``record_stream`` calls in ``chain()`` prevent)."""
    side = EngineState().side_stream(torch.device("cuda", 0))
    first, second = relay(group, side)
    failures = {"stage 1": exact(first, source()), "stage 2": exact(second, 2 * source())}
    record(f"{__name__}::chain", equal={k: not v for k, v in failures.items()})
    assert not any(failures.values()), failures


def test_chain_without_record_stream(group, monkeypatch):
    """The negative control of the last test's ``record_stream``: with it a no-op, stage 2's send buffer is
    free in the side stream's pool once ``Chain.wait()`` lets go of it (ProcessGroupNCCL's stash of an
    asynchronous collective is released at its ``wait()``, on the current stream), and the side stream's
    churn overwrites it before NCCL's held-back read. Skipped when this PyTorch keeps the buffer from
    reuse by itself (e.g. ``record_stream`` on NCCL's stream instead of a stash): then the call is
    belt and braces here, and the results file says so."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    side = EngineState().side_stream(torch.device("cuda", 0))
    first, second = relay(group, side)
    overwritten = bool(torch.isnan(second).any())
    record(f"{__name__}::chain_without_record_stream", stage2_send_overwritten=overwritten)
    assert not exact(first, source())
    if not overwritten:
        pytest.skip("this PyTorch keeps stage 2's send buffer from reuse without record_stream")
