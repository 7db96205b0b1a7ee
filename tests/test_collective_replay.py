"""Every rank's collectives replayed (issue 31, outcome 2): one training step of a tiny Llama through the
engine (rematerialization-aware checkpointing, the data path's balanced layout, a real plan) on every rank
of 8, 12 (nodes of unequal size: ranks_per_node=8) and 64 ranks, each rank alone in its own process on
the recording group of tests/collective_replay.py, in every schedule: serial, ping-pong with both splits,
layer-level ping-pong, ping-pong planned over nodes with the link probe measuring the inter-node link
(12 ranks: nodes of 8 and 4), and the KV relay alone and under layer-level ping-pong (whole nodes only). The logs of all ranks must be one run of a real group: the same collectives
in the same order, all-to-all splits that match pairwise, the same plan digests.

The replay's premise is tested too: what a rank issues does not depend on the data it receives. Negative
controls: one rank given a different batch (a document fewer) and one rank with a different shard size
are reported by the checker; and the checker itself on hand-made logs.
"""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist
from collective_replay import A2A, check_logs, replay, step_log, summary
from test_engine_remat import docs_of, tiny_llama, with_mode

from hf_distca import DistCAConfig, enable_distca, nano_batch_loss
from hf_distca.config import PING_PONG_SPLITS
from hf_distca.data import DistCABatches

TOKENS_PER_RANK = 48
BASE = {"shard_tokens": 8, "tolerance": 0.0, "backend": "reference"}


def schedules(world: int, ranks_per_node: int) -> dict[str, dict]:
    """DistCAConfig fields of every schedule replayed (besides BASE): the KV relay where the nodes are
    whole (it refuses others), the link probe and the nodes' link classes in the plan everywhere."""
    nodes = {"ranks_per_node": ranks_per_node, "measure_link": True}
    relay = {"kv_relay": True, **nodes} if world % ranks_per_node == 0 else None
    out = {
        "serial": {"ping_pong": False},
        **{f"ping_pong:{s}": {"ping_pong": True, "ping_pong_split": s} for s in PING_PONG_SPLITS},
        "layer_ping_pong": {"layer_ping_pong": True},
        "nodes:ping_pong": {"ping_pong": True, **nodes},
    }
    if relay is not None:
        out.update(
            {
                "relay": {"ping_pong": False, **relay},
                "relay:layer_ping_pong": {"layer_ping_pong": True, **relay},
            }
        )
    return out


def lengths(world: int) -> list[int]:
    """Documents filling about 80% of the ranks' room: a few long ones cut over several ranks (their work
    moves), many short ones."""
    rng = random.Random(world)
    room, out = int(0.8 * world * TOKENS_PER_RANK), []
    while sum(out) < room:
        out.append(rng.choice([rng.randint(2, 24), rng.randint(24, 4 * TOKENS_PER_RANK)]))
    return out[:-1]


def warm() -> None:
    """What every rank needs imported (Transformers' Llama modules), once before the ranks fork."""
    tiny_llama()


def rank_steps(rank: int, world: int, ranks_per_node: int, runs: list[tuple[str, str, dict | None]]):
    """One step per run ``(section, schedule, odd)`` on this rank; ``odd``: what rank ``odd["rank"]`` does
    differently (a negative control): ``drop_doc`` (its batch lacks the last document) or ``config``
    (DistCAConfig fields of its own)."""
    base = tiny_llama(seed=7)
    for section, name, odd in runs:
        odd = odd if odd is not None and odd["rank"] == rank else {}
        docs = docs_of(lengths(world), seed=11)
        if odd.get("drop_doc"):
            docs = docs[:-1]
        n_targets = sum(len(d) - 1 for d in docs)
        fields = {**BASE, **schedules(world, ranks_per_node)[name], **odd.get("config", {})}
        config = DistCAConfig(**fields)
        model = with_mode(base, "remat")
        nanos = 2 if config.layer_ping_pong else 1
        loader = DistCABatches(
            docs, rank=rank, world_size=world, tokens_per_rank=TOKENS_PER_RANK, nano_batches=nanos
        )
        batch = loader.micro_batch(docs)

        def step(model=model, config=config, batch=batch, n_targets=n_targets) -> None:
            # enable_distca runs the link and cost probes: their collectives belong to the replayed step
            enable_distca(model, group=dist.group.WORLD, config=config)
            nano_batch_loss(model, batch, num_items_in_batch=n_targets).backward()

        yield section, step_log(step)


def replay_schedules(world: int, ranks_per_node: int, names: list[str], fill: float = 0.0) -> dict[str, list]:
    return replay(rank_steps, world, ranks_per_node, [(n, n, None) for n in names], fill=fill, warm=warm)


def plan_comparisons(log: list[dict]) -> int:
    """The all-gathers of one plan digest (a single int64) in ``log``: the engine's comparison of each new plan."""
    return sum(
        1 for e in log if e["op"] == "all_gather" and e["shape"] == [1] and e["dtype"] == "torch.int64"
    )


def assert_one_run(world: int, ranks_per_node: int, names: list[str]) -> dict[str, dict[str, int]]:
    logs = replay_schedules(world, ranks_per_node, names)
    counts = {}
    for name in names:
        problems = check_logs(logs[name])  # the comparisons too: the same calls on every rank
        assert not problems, f"{world} ranks, {name}:\n" + "\n".join(problems)
        counts[name] = summary(logs[name])
        assert counts[name].get(A2A, 0) > 0 and counts[name].get("plan", 0) > 0, (name, counts[name])
    # the first schedule's process met every plan new: each one compared once (not per layer or recompute)
    first = logs[names[0]][0]
    plans = {(e["digest"], e["window"]) for e in first if e["op"] == "plan"}
    assert plan_comparisons(first) == len(plans) > 0, (names[0], plan_comparisons(first), len(plans))
    return counts


@pytest.mark.parametrize(("world", "ranks_per_node"), [(8, 4), (12, 8)])
def test_every_rank_issues_the_same_collectives(world, ranks_per_node):
    """At 12 ranks (nodes of 8 and 4) the link probe's all-to-all is the one that failed before its
    receive splits were taken from what each peer sends: rank 0 sent 2 MiB to rank 8, which expected 1."""
    names = list(schedules(world, ranks_per_node))
    counts = assert_one_run(world, ranks_per_node, names)
    # the schedules really differ: ping-pong starts more exchanges than serial, the relay chains stages;
    # the link probe ran once per process (its all-reduce of seconds), at the first enable_distca that measures
    a2a = {name: c[A2A] for name, c in counts.items()}
    assert a2a["ping_pong:local_first"] > a2a["serial"] and a2a["layer_ping_pong"] > a2a["serial"], a2a
    assert "relay" not in a2a or a2a["relay"] > a2a["serial"], a2a
    assert counts["nodes:ping_pong"].get("all_reduce", 0) == 1 and "all_reduce" not in counts["serial"], (
        counts
    )
    assert ("relay" in counts) == (world % ranks_per_node == 0)


def test_every_rank_issues_the_same_collectives_at_64_ranks():
    assert_one_run(64, 8, ["ping_pong:local_first", "relay:layer_ping_pong"])


def test_what_a_rank_issues_does_not_depend_on_the_data_it_receives():
    """The replay's premise: the received all-to-all data (zeros here, NaN there) changes no collective,
    no split, no plan."""
    names = ["ping_pong:halves", "relay:layer_ping_pong"]
    assert replay_schedules(8, 4, names, fill=float("nan")) == replay_schedules(8, 4, names, fill=0.0)


ODD = {"batch": {"rank": 5, "drop_doc": True}, "config": {"rank": 2, "config": {"shard_tokens": 16}}}


def test_a_rank_that_diverges_is_reported():
    """Negative controls: one rank with a batch a document short, one with another shard size (both
    caught by the engine's consistency check on a real group; the recording group shows each rank only
    its own vector, so only the checker can tell)."""
    for what, odd in ODD.items():
        # a replay each: a rank's engine state remembers the plans it compared, so an odd rank's history
        # would show in the next control's log too (on a real group the first control raised on every rank)
        logs = replay(rank_steps, 8, 4, [(what, "serial", odd)], warm=warm)
        problems = check_logs(logs[what])
        assert problems, f"{what}: a rank with other inputs replayed like the others"
        assert any(f"rank(s) [{odd['rank']}]" in p for p in problems), (what, problems)


def _a2a(send: list[int], recv: list[int]) -> dict:
    return {"op": A2A, "world": len(send), "dtype": "torch.float32", "send": send, "recv": recv,
            "in_numel": sum(send), "out_numel": sum(recv)}  # fmt: skip


def test_checker_on_hand_made_logs():
    plan = {"op": "plan", "digest": "abc", "window": None}
    good = [[plan, _a2a([0, 2], [0, 3])], [plan, _a2a([3, 0], [2, 0])]]
    assert check_logs(good) == []
    unequal = [[plan, _a2a([0, 2], [0, 1])], [plan, _a2a([1, 0], [1, 0])]]  # 0 sends 2 to 1, which expects 1
    assert check_logs(unequal) == [
        "call 1 (all_to_all_single): rank 0 sends 2 elements to rank 1, which expects 1"
    ]
    other_plan = [[plan], [{**plan, "digest": "abd"}]]
    assert "call 0 differs" in check_logs(other_plan)[0]
    shorter = [[plan, _a2a([0, 2], [0, 3])], [plan]]
    assert "log ended" in check_logs(shorter)[0]
    bad_buffer = [[{**_a2a([0, 2], [0, 3]), "in_numel": 5}], [_a2a([3, 0], [2, 0])]]
    assert "do not describe" in check_logs(bad_buffer)[0]
