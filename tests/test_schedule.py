"""benchmarks/sim/schedule.py (the simulator's): the engine's schedules as data, and the list scheduler that times them.

No processes except one spawn of 2 gloo ranks: the attention call's operations in the serial and the
attention-level ping-pong schedules are in the order of the engine's own profiler ranges (a forward and
backward of core_attention under torch.profiler on the CPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from oracle import named_layouts, random_qkv

from benchmarks.sim import schedule as sch
from hf_distca import DistCAConfig, core_attention
from hf_distca import engine as eng
from hf_distca.engine.ping_pong import ping_pong_parts


def _names(ops):
    return [(op.kind, op.name, op.pass_, op.layer, op.nano, op.part) for op in ops]


def test_serial_schedule_order():
    ops = sch.serial(2)
    got = [(k, n, p, layer) for k, n, p, layer, _, _ in _names(ops)]
    call = lambda p, layer: [  # noqa: E731
        ("start", f"{p}.dispatch", p, layer), ("wait", f"{p}.dispatch", p, layer), ("compute", "kernel", p, layer),
        ("start", f"{p}.return", p, layer), ("wait", f"{p}.return", p, layer),
    ]  # fmt: skip
    want = []
    for layer in (0, 1):
        want += [("compute", "pre", "fwd", layer), *call("fwd", layer), ("compute", "post", "fwd", layer)]
    want.append(("compute", "head", "fwd", 2))
    for layer in (1, 0):
        want += [
            ("compute", "post_bwd", "bwd", layer),
            *call("bwd", layer),
            ("compute", "pre_bwd", "bwd", layer),
        ]
    assert got == want
    # plain recompute: the layer's forward attention call runs again in backward, before its backward
    full = sch.serial(1, recompute="full")
    backward = [(o.kind, o.name, o.call) for o in full[full.index(sch.Op("compute", "head", "fwd", 1)) + 1 :]]
    assert backward[:3] == [
        ("compute", "pre_recompute", 0),
        ("start", "fwd.dispatch", 1),
        ("wait", "fwd.dispatch", 1),
    ]
    with pytest.raises(ValueError, match="recompute"):
        sch.serial(1, recompute="none")


def test_attention_ping_pong_call_names_are_the_engines_stages():
    ops = sch.attention_call("bwd", 0, parts=3)
    assert [sch.engine_stage(o) for o in ops] == [
        "bwd.dispatch.0", "bwd.dispatch.1", "bwd.dispatch.2",
        "bwd.wait_dispatch.0", "bwd.compute.0", "bwd.return.0",
        "bwd.wait_dispatch.1", "bwd.compute.1", "bwd.return.1",
        "bwd.wait_dispatch.2", "bwd.compute.2", "bwd.return.2",
        "bwd.wait_return.0", "bwd.wait_return.1", "bwd.wait_return.2",
    ]  # fmt: skip
    one = [sch.engine_stage(o) for o in sch.attention_call("fwd", 3)]
    assert one == ["fwd.dispatch", "fwd.wait_dispatch", "fwd.compute", "fwd.return", "fwd.wait_return"]
    assert sch.engine_stage(sch.Op("compute", "pre", "fwd", 0)) is None


def test_layer_ping_pong_order():
    ops = sch.layer_ping_pong(2)
    short = [(o.kind[0], o.name, o.layer, "AB"[o.nano]) for o in ops]
    want_fwd = [
        ("c", "pre", 0, "A"), ("s", "fwd.dispatch", 0, "A"), ("c", "pre", 0, "B"), ("s", "fwd.dispatch", 0, "B"),
        ("w", "fwd.dispatch", 0, "A"), ("c", "kernel", 0, "A"), ("s", "fwd.return", 0, "A"),
        ("w", "fwd.dispatch", 0, "B"), ("c", "kernel", 0, "B"), ("s", "fwd.return", 0, "B"),
        ("w", "fwd.return", 0, "A"), ("c", "post", 0, "A"), ("c", "pre", 1, "A"), ("s", "fwd.dispatch", 1, "A"),
        ("w", "fwd.return", 0, "B"), ("c", "post", 0, "B"), ("c", "pre", 1, "B"), ("s", "fwd.dispatch", 1, "B"),
        ("w", "fwd.dispatch", 1, "A"), ("c", "kernel", 1, "A"), ("s", "fwd.return", 1, "A"),
        ("w", "fwd.dispatch", 1, "B"), ("c", "kernel", 1, "B"), ("s", "fwd.return", 1, "B"),
        ("w", "fwd.return", 1, "A"), ("c", "post", 1, "A"), ("w", "fwd.return", 1, "B"), ("c", "post", 1, "B"),
        ("c", "head", 2, "A"), ("c", "head", 2, "B"),
    ]  # fmt: skip
    assert short[: len(want_fwd)] == want_fwd
    # backward: the engine's nodes in reverse creation order, the forward mirrored (layers and
    # nano-batches reversed, pre <-> post, fwd.* -> bwd.*; the head has no backward op here)
    mirror = {"pre": "post_bwd", "post": "pre_bwd"}
    want_bwd = [
        (kind, mirror.get(name, name.replace("fwd.", "bwd.")), 1 - layer, "BA"["AB".index(nano)])
        for kind, name, layer, nano in want_fwd
        if name != "head"
    ]
    assert short[len(want_fwd) :] == want_bwd


def _one(x):
    return np.array([x, x])


def test_run_schedule_serial_waits_for_the_slowest_rank_and_the_transfer():
    ops = sch.serial(1)
    compute = {
        ("pre", "fwd", 0, 0): np.array([1.0, 2.0]),
        ("kernel", "fwd", 0, 0): np.array([3.0, 1.0]),
        ("post", "fwd", 0, 0): _one(1.0),
        ("post_bwd", "bwd", 0, 0): _one(1.0),
        ("kernel", "bwd", 0, 0): np.array([1.0, 5.0]),
    }
    comm = {("fwd.dispatch", "fwd", 0, 0): 0.5, ("bwd.return", "bwd", 0, 0): 0.25}
    t = sch.run_schedule(ops, compute, comm, 2)
    # pre: max 2, then the dispatch (0.5); no collective until the backward return, which rank 1 reaches
    # at 2.5 + 1 + 1 + 1 + 5 (its kernels, post, post_bwd); then 0.25
    assert t.step == pytest.approx(2.5 + 1 + 1 + 1 + 5 + 0.25)
    assert t.busy.tolist() == pytest.approx([7.0, 10.0])
    assert t.comm == pytest.approx({"fwd.dispatch": 0.5, "bwd.return": 0.25})
    # rank 0 waited 1 s for rank 1 to start the dispatch, then 0.5 s on the transfer itself
    assert t.exposed["fwd.dispatch"].tolist() == pytest.approx([0.5, 0.5])
    assert t.exposed["bwd.return"].tolist() == pytest.approx([0.25, 0.25])
    free = sch.run_schedule(ops, compute, {}, 2)  # no collective: no synchronisation either
    assert free.step == pytest.approx(10.0) and not free.exposed


def test_run_schedule_hides_a_transfer_behind_the_other_nano_batch():
    ops = sch.layer_ping_pong(1)
    compute = {(name, p, n, 0): _one(1.0) for name, p in (("pre", "fwd"), ("post", "fwd"), ("post_bwd", "bwd"),
               ("pre_bwd", "bwd"), ("kernel", "fwd"), ("kernel", "bwd")) for n in (0, 1)}  # fmt: skip
    comm = {(phase, phase[:3], n, 0): 0.5 for phase in ("fwd.dispatch", "fwd.return") for n in (0, 1)}
    t = sch.run_schedule(ops, compute, comm, 2)
    # A's dispatch flies during B.pre, B's during A's kernel, A's return during B's kernel, B's return
    # during A.post: all hidden; backward has no collective
    assert t.step == pytest.approx(12.0)
    assert t.exposed["fwd.dispatch"].tolist() == t.exposed["fwd.return"].tolist() == [0.0, 0.0]
    # one communication channel: a collective waits for the previous one to end; A.pre, the four
    # transfers one after the other, B.post, then the six backward ops
    slow = {k: 3.0 for k in comm}
    timing = sch.run_schedule(ops, compute, slow, 2)
    assert timing.step == pytest.approx(1 + 4 * 3.0 + 1 + 6)
    assert timing.exposed["fwd.return"].tolist() == pytest.approx(
        [2.0 + 2.0, 2.0 + 2.0]
    )  # A waits at 8 of 7-10, B at 11 of 10-13
    with pytest.raises(ValueError, match="never waited"):
        sch.run_schedule(ops[:2], compute, comm, 2)


# ------------------------------------------------------------------ the engine's order (2 gloo ranks)
def _engine_order(rank: int, world: int, layout, config: DistCAConfig) -> dict:
    q, k, v, w = (
        t[torch.as_tensor(layout.rows(rank))] for t in random_qkv(layout.total, 4, 2, 8, torch.float32, 1)
    )
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = core_attention(*leaves, layout.pieces[rank], config=config, all_pieces=layout.pieces)
        out.backward(w)
    events = sorted((e.time_range.start, e.name) for e in prof.events() if e.name.startswith("distca."))
    prep = eng.prepare(
        q, k, v, layout.pieces[rank], group=dist.group.WORLD, config=config, all_pieces=layout.pieces
    )
    parts = (
        len(ping_pong_parts(prep, config.shard_tokens, config.ping_pong_split).parts)
        if config.ping_pong
        else 1
    )
    return {"order": [name.removeprefix("distca.") for _, name in events], "parts": parts}


def _engine_orders(rank: int, world: int, layout, configs) -> list[dict]:
    return [_engine_order(rank, world, layout, c) for c in configs]


def test_attention_call_is_the_engines_order():
    """One forward and backward of core_attention, serial and with both ping-pong splits: the profiler's
    stage ranges are the schedule's attention-call operations, in order."""
    layout = next(x for x in named_layouts(2, seed=11) if x.name == "giant")
    configs = [
        DistCAConfig(shard_tokens=8, tolerance=0.3, backend="reference", ping_pong=False),
        *(
            DistCAConfig(
                shard_tokens=8, tolerance=0.3, backend="reference", ping_pong=True, ping_pong_split=s
            )
            for s in ("local_first", "halves")
        ),
    ]
    per_rank = run_distributed(_engine_orders, 2, layout, configs, timeout=150)
    for rank, results in enumerate(per_rank):
        for config, res in zip(configs, results, strict=True):
            parts = res["parts"]
            assert parts == 1 if not config.ping_pong else parts > 1, (rank, config.ping_pong_split, parts)
            ops = sch.attention_call("fwd", 0, parts) + sch.attention_call("bwd", 0, parts)
            assert res["order"] == [sch.engine_stage(o) for o in ops], (rank, config.ping_pong, res["order"])


def test_layer_ping_pong_every_operation_once():
    """Every operation once; every layer's backward work once per nano-batch (the order: above, and
    against the engine's recorded stages in tests/test_layer_ping_pong.py)."""
    ops = sch.layer_ping_pong(3)
    assert len(set(ops)) == len(ops)
    for name in ("post_bwd", "pre_bwd", "kernel"):
        assert sorted((o.layer, o.nano) for o in ops if o.name == name and o.pass_ == "bwd") == [
            (layer, n) for layer in range(3) for n in range(2)
        ]
    with pytest.raises(ValueError, match="nanos must be >= 1"):
        sch.layer_ping_pong(2, 0)
