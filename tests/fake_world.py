"""One process that the engine takes for rank 0 of a group of ``world`` (issue 31: host syncs out of the window).

:func:`pretend_world` makes the engine see ``world`` ranks without torch.distributed: the all-gathers of
its checks return this rank's row for every rank (so every check agrees), and its all-to-alls fill what
they receive with zeros on the issuing stream and hand back a handle whose ``wait()`` does nothing (as
NCCL's ``wait()`` does for the host). The numbers are not the distributed result; the code path is: every
stage, exchange, chain and kernel the engine runs for a plan over ``world`` ranks, on any device, with
every collective logged in order. tests/test_sync_free.py runs it on the CPU, tests/test_gpu_sync_free.py
on one GPU under ``torch.cuda.set_sync_debug_mode("error")``.

:func:`train_step` is one micro-batch of a tiny Llama through it: forward and backward.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from test_engine_remat import docs_of, tiny_llama

from hf_distca import DistCAConfig, comm, enable_distca, nano_batch_loss
from hf_distca.data import DistCABatches

prepare_module = importlib.import_module("hf_distca.engine.prepare")  # the module, not the function

LENGTHS = [150, 40, 25, 9, 31, 60, 70]
TOKENS_PER_RANK = 256

SCHEDULES = {
    "serial": ({"ping_pong": False}, 2, 4),
    "ping_pong": ({"ping_pong": True}, 2, 8),
    "layer_ping_pong": ({"layer_ping_pong": True}, 2, 4),
    "relay": ({"ping_pong": False, "kv_relay": True, "ranks_per_node": 2}, 4, 7),
}
"""Every schedule the tests run in a pretended world: DistCAConfig fields, the world size, and the
exchanges each engine call starts (``EngineStats.exchanges`` per ``EngineStats.calls``): the 4 phases
(dispatch, the outputs' return, and their mirrors in backward), each twice under attention-level
ping-pong (two nano-batch parts). The KV relay forwards only with several nodes of several ranks (with
one rank a node every crossing lands on its relay already, and the index stays direct): 4 ranks in 2
nodes of 2, where the 3 phases that carry KV each run as a two-stage chain (:func:`hf_distca.comm.chain`),
7 exchanges a call."""


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def pretend_world(monkeypatch, world: int = 2, rank: int = 0) -> Iterator[list[str]]:
    """Within it the engine runs as rank ``rank`` of ``world`` (see the module docstring); yields the log
    of collectives ("all_gather", "all_to_all") in the order they were issued."""
    log: list[str] = []

    def all_gather(outputs, tensor, group=None, async_op=False):
        log.append("all_gather")
        for out in outputs:
            out.copy_(tensor)
        return _Done() if async_op else None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):  # fmt: skip
        log.append("all_to_all")
        output.zero_()
        return _Done() if async_op else None

    for module in (comm, prepare_module):
        monkeypatch.setattr(module, "group_rank_world", lambda group: (rank, world))
        monkeypatch.setattr(module, "collective_device", lambda group, device: device)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    yield log


def micro_batch(device: str, layer_ping_pong: bool, world: int = 2) -> dict:
    """Rank 0's micro-batch of LENGTHS laid out over ``world`` ranks (two nano-batches with layer_ping_pong)."""
    docs = docs_of(LENGTHS, seed=11)
    loader = DistCABatches(
        docs,
        rank=0,
        world_size=world,
        tokens_per_rank=TOKENS_PER_RANK,
        nano_batches=2 if layer_ping_pong else 1,
    )
    batch = loader.micro_batch(docs)

    def moved(b: dict) -> dict:
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}

    if "distca_nano_batches" in batch:
        return {**moved(batch), "distca_nano_batches": tuple(moved(n) for n in batch["distca_nano_batches"])}
    return moved(batch)


def model_for(device: str, **fields) -> torch.nn.Module:
    """The tiny Llama (fp32 on the CPU, bf16 on CUDA) with the engine's runtime for ``fields``."""
    model = tiny_llama(seed=7).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    config = DistCAConfig(shard_tokens=8, tolerance=0.0, cost_table=None, **fields)
    enable_distca(model, config=config)
    return model


def train_step(model: torch.nn.Module, batch: dict, backward=None) -> torch.Tensor:
    """One forward (the nano-batches interleaved, if any) and backward (``backward(loss)``, default
    ``loss.backward()``); returns the loss."""
    loss = nano_batch_loss(model, batch, num_items_in_batch=sum(n - 1 for n in LENGTHS))
    (backward or (lambda x: x.backward()))(loss)
    return loss
