"""Communication-aware planning (hf_distca.planning.links and the priced planner), pure: no processes.

Every priced plan is checked with the planner invariants of test_planner (every query row computed
exactly once against its KV prefix, loads conserved, byte counts) and the simulated dispatch, and its
critical path is recomputed here independently from the owner of every position: it equals the
planner's, never exceeds that of no balancing nor that of the balance-only plan, and drops whenever
work moves. Free links give the balance-only plan; a very slow link moves nothing that adds traffic;
the send bound holds; a long document's KV prefix stays in its node when only the inter-node link is
slow.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracle import TOL, Layout, long_tailed_lengths, pack_sequential
from test_planner import KV_ROW, Q_ROW, SETTINGS, check_plan, layouts, owner_map, plan_with_config
from test_planner import simulate as simulate_dispatch

from hf_distca import DistCAConfig, plan_core_attention
from hf_distca.cli import add_config_arguments, config_from_args
from hf_distca.planning import (
    CausalPairsCost,
    LinkModel,
    MeasuredCost,
    attention_flops_per_pair,
    link_model_from_options,
    plan_critical_path,
    traffic,
)
from hf_distca.planning.cost import write_cost_table
from hf_distca.planning.links import FWD_BWD_FLOP_RATIO, seconds_per_cost_unit, with_hiding_work
from hf_distca.planning.options import PRICED_TOLERANCE

FLOPS = attention_flops_per_pair(2, 8)  # 2 query heads x 8: 224 FLOPs per pair forward+backward
GIB = 2**30


def _plan(pieces, config: DistCAConfig, q_row: int = Q_ROW, kv_row: int = KV_ROW, window: int | None = None):
    """The priced plan: :func:`plan_with_config` with FLOPS per pair."""
    return plan_with_config(pieces, config, q_row, kv_row, flops_per_pair=FLOPS, window=window)


def _unpriced(config: DistCAConfig) -> DistCAConfig:
    """The same config without a link: the balance-only plan."""
    fields = {**config.__dict__, "link_gib_per_s": None}
    return DistCAConfig(**fields)


# With attention_tflops 1e-3 a 300-token document's attention (45K pairs x 224 FLOPs) takes ~1e-2 s and
# its KV prefix (300 x 48 bytes) ~1e-2 s at 1e-3 GiB/s: the sampled links span free to prohibitive.
priced_configs = st.builds(
    DistCAConfig,
    tolerance=st.sampled_from([0.0, 0.05, 0.1, 0.5]),
    shard_tokens=st.sampled_from([1, 4, 16]),
    link_gib_per_s=st.sampled_from([1e-9, 1e-4, 1e-3, 1e-2, 1.0]),
    intra_node_gib_per_s=st.sampled_from([None, 1e-3, 1e-1]),
    ranks_per_node=st.sampled_from([None, 1, 2, 3]),
    comm_overlap=st.sampled_from([0.0, 0.5]),
    attention_tflops=st.sampled_from([1e-3, 1e-1]),
    max_send_bytes_per_rank=st.one_of(st.none(), st.integers(1, 40_000)),
    max_recv_bytes_per_server=st.one_of(st.none(), st.integers(1, 40_000)),
)


# ------------------------------------------------------------------------- the critical path, by hand
def rank_bytes(plan, layout: Layout, config: DistCAConfig) -> dict[tuple[int, str], list[int]]:
    """(rank, "intra" or "inter") -> [Q out, KV out, Q in, KV in] bytes of one forward dispatch, from the
    owner of every position (not from the planner's bookkeeping)."""
    owner = owner_map(layout)
    per = config.ranks_per_node
    out: dict[tuple[int, str], list[int]] = {}

    def add(holder, server, column, nbytes):
        link = "intra" if per is not None and holder // per == server // per else "inter"
        out.setdefault((holder, link), [0, 0, 0, 0])[column] += nbytes
        out.setdefault((server, link), [0, 0, 0, 0])[column + 2] += nbytes

    for server, tasks in enumerate(plan.tasks):
        for t in tasks:
            held = owner[t.doc_id][t.q_start : t.q_end]
            for h in set(held.tolist()) - {server}:
                add(h, server, 0, int((held == h).sum()) * Q_ROW)
        for doc, prefix in plan.kv_prefix[server].items():
            held = owner[doc][:prefix]
            for h in set(held.tolist()) - {server}:
                add(h, server, 1, int((held == h).sum()) * KV_ROW)
    return out


def comm_seconds(plan, layout: Layout, config: DistCAConfig) -> float:
    """One layer's forward+backward all-to-all seconds: 4 phases, each as long as its slowest rank; a
    rank's traffic inside its node and across nodes moves at once."""
    bandwidth = {
        "inter": config.link_gib_per_s * GIB,
        "intra": math.inf if config.intra_node_gib_per_s is None else config.intra_node_gib_per_s * GIB,
    }
    phases: dict[int, list[float]] = {}
    for (rank, link), (q_out, kv_out, q_in, kv_in) in rank_bytes(plan, layout, config).items():
        bw = bandwidth[link]
        if bw == math.inf:
            continue
        mine = phases.setdefault(rank, [0.0] * len(traffic.PHASES))
        # per phase of the traffic ledger, (bytes sent, bytes received) of this rank on this link
        sends_receives = traffic.phase_bytes(np.array([q_out, kv_out, q_in, kv_in])).tolist()
        for p, (sent, received) in enumerate(sends_receives):
            mine[p] = max(mine[p], max(sent, received) / bw)
    return sum(max((v[p] for v in phases.values()), default=0.0) for p in range(len(traffic.PHASES)))


def critical_path(plan, layout: Layout, config: DistCAConfig, link: LinkModel | None = None) -> float:
    """Slowest compute plus the exposed transfer time: all of it but ``comm_overlap``, or what ``link``'s
    windows leave exposed."""
    compute = max(plan.load_after, default=0.0) * FLOPS / (config.attention_tflops * 1e12)
    comm = comm_seconds(plan, layout, config)
    return compute + ((1.0 - config.comm_overlap) * comm if link is None else link.exposed(comm))


# ------------------------------------------------------------------------------------- property tests
@SETTINGS
@given(layout=layouts(), config=priced_configs)
def test_priced_plans_valid_and_never_slower(layout, config):
    rtol, _ = TOL["critical_path"]
    plan = _plan(layout.pieces, config)
    check_plan(plan, layout, config)  # coverage, loads, splits, byte counts, receive bound
    simulate_dispatch(plan, layout)
    unbalanced = _plan(layout.pieces, DistCAConfig(**{**config.__dict__, "max_planner_moves": 0}))
    balance_only = _plan(layout.pieces, _unpriced(config))
    after = critical_path(plan, layout, config)
    before = critical_path(unbalanced, layout, config)
    assert plan.critical_path_after == pytest.approx(after, rel=rtol)
    assert plan.critical_path_before == pytest.approx(before, rel=rtol)
    # never slower than no balancing, nor than balancing compute alone
    assert after <= before * (1 + rtol)
    assert after <= critical_path(balance_only, layout, config) * (1 + rtol)
    if plan.moves:  # work moved only because it lowered the critical path
        assert after < before
    bound = config.max_send_bytes_per_rank
    if bound is not None:  # no move takes a rank above the bound (or further above it)
        for sent, start in zip(plan.bytes_sent, unbalanced.bytes_sent, strict=True):
            assert sent <= max(bound, start)


@SETTINGS
@given(
    layout=layouts(),
    config=st.builds(
        DistCAConfig,
        tolerance=st.sampled_from([0.05, 0.1, 0.5]),
        shard_tokens=st.sampled_from([1, 4, 16]),
        max_recv_bytes_per_server=st.one_of(st.none(), st.integers(1, 40_000)),
    ),
    ranks_per_node=st.sampled_from([None, 1, 2]),
)
def test_free_links_give_the_balance_only_plan(layout, config, ranks_per_node):
    """Links of infinite bandwidth or all transfer time hidden: the plan is the balance-only plan, move
    for move. A link so fast that its time is far below the tolerance: the same, unless the balance-only
    plan leaves the slowest server as slow as before (then its moves only add transfer time, and the
    priced plan is no slower than it)."""
    ref = _plan(layout.pieces, config)
    assert ref.critical_path_after is None  # not priced
    free = {
        "infinite": {"link_gib_per_s": math.inf},
        "infinite, two classes": {"link_gib_per_s": math.inf, "ranks_per_node": 2},
        "hidden": {"link_gib_per_s": 1e-3, "comm_overlap": 1.0, "ranks_per_node": ranks_per_node},
    }
    for name, fields in free.items():
        priced = _plan(layout.pieces, DistCAConfig(**{**config.__dict__, **fields}))
        assert priced.digest() == ref.digest(), name
        assert (priced.load_after, priced.bytes_sent, priced.moves) == (
            ref.load_after,
            ref.bytes_sent,
            ref.moves,
        )
        compute = max(ref.load_after, default=0.0) * FLOPS / (config.attention_tflops * 1e12)
        assert priced.critical_path_after == pytest.approx(compute, rel=TOL["critical_path"][0])
    fast = DistCAConfig(
        **{**config.__dict__, "link_gib_per_s": 1e12, "intra_node_gib_per_s": 1e13, "ranks_per_node": ranks_per_node,
           "attention_tflops": 1e-3}
    )  # fmt: skip
    priced = _plan(layout.pieces, fast)
    if max(ref.load_after, default=0.0) < max(ref.load_before, default=0.0):
        assert priced.digest() == ref.digest()
    else:
        assert priced.critical_path_after <= critical_path(ref, layout, fast)


def test_fast_link_gives_the_balance_only_plan_on_realistic_batches():
    """1,000 long-tailed documents over 32 servers in nodes of 8 at 1e9 GiB/s: the same plan as
    without pricing at the tolerance the priced planner defaults to (the transfer time is far below it)."""
    rng = np.random.default_rng(7)
    pieces = pack_sequential(long_tailed_lengths(1000, rng), 32)
    fast = DistCAConfig(link_gib_per_s=1e9, intra_node_gib_per_s=1e10, ranks_per_node=8)
    ref = _plan(pieces, DistCAConfig(tolerance=fast.balance_tolerance), q_row=8192, kv_row=4096)
    plan = _plan(pieces, fast, q_row=8192, kv_row=4096)
    assert ref.moves > 10 and plan.digest() == ref.digest()


@settings(SETTINGS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    data=st.data(),
    config=priced_configs,
    window=st.sampled_from([None, 24]),
    priced=st.booleans(),
)
def test_relay_plans_valid_never_slower_and_within_the_send_bound(data, config, window, priced):
    """Planned with KV through the relay (DistCAConfig(kv_relay=True)), priced or balance-only: a valid plan;
    the send bound held on the relayed route (what the engine sends); priced, the greedy's running
    bookkeeping equal to the plan priced again (the planner raises otherwise), never slower under the
    relay's pricing than computing every rank's own pieces or than the balance-only plan, and moving work
    only where it lowered the critical path."""
    layout = data.draw(layouts(max_world=8))
    nodes = [n for n in (2, 3, 4) if layout.world > n and layout.world % n == 0]
    assume(nodes)  # whole nodes, more than one
    per = data.draw(st.sampled_from(nodes))
    config = dataclasses.replace(config, ranks_per_node=per, kv_relay=True)
    if not priced:
        config = _unpriced(config)
    plan = _plan(layout.pieces, config, window=window)
    direct = traffic.forward_bytes(plan, traffic.plan_traffic(plan))
    as_direct = dataclasses.replace(plan, bytes_sent=direct[0], bytes_received=direct[1])
    check_plan(as_direct, layout, config)  # the invariants of any plan, its bytes on the direct route
    simulate_dispatch(as_direct, layout)
    bound = config.max_send_bytes_per_rank
    if bound is not None:  # no move takes a rank above the bound (or further above it), relayed
        unbalanced = _plan(layout.pieces, dataclasses.replace(config, max_planner_moves=0), window=window)
        relayed = [
            traffic.forward_bytes(p, traffic.plan_traffic(p, per, True))[0] for p in (plan, unbalanced)
        ]
        assert plan.bytes_sent == relayed[0]  # what the plan reports is the relayed route
        for sent, start in zip(*relayed, strict=True):
            assert sent <= max(bound, start)
    if not priced:
        return
    rtol, _ = TOL["critical_path"]
    link = link_model_from_options(config.planner_options(), CausalPairsCost(window), FLOPS)
    assert plan.critical_path_after <= plan.critical_path_before * (1 + rtol)
    balance_only = plan_with_config(layout.pieces, _unpriced(config), window=window)
    assert plan.critical_path_after <= plan_critical_path(balance_only, link) * (1 + rtol)
    if plan.moves and plan.digest() != balance_only.digest():
        # priced moves are taken only where they lower the critical path; the balance-only plan, kept when
        # its transfers cost nothing (e.g. inside a node with intra_node_gib_per_s None), may move work
        # between servers tied at the top without lowering it
        assert plan.critical_path_after < plan.critical_path_before


def test_relay_pricing_moves_more_of_a_long_document_off_its_node():
    """A long document on rank 0 of 4 nodes of 2 ranks, short ones elsewhere, a slow inter-node link: with KV
    priced through the relay (its prefix crosses to a node once, whichever servers there read it) the
    planner moves more of it off its node (here to node 1, over both its ranks) than when every server's
    prefix crosses on its own, and the relayed plan is faster under the relay's pricing."""
    pieces = [[(0, 0, 4096)]] + [[(r, 0, 256)] for r in range(1, 8)]
    base = DistCAConfig(shard_tokens=64, tolerance=0.02, link_gib_per_s=3e-3, intra_node_gib_per_s=0.3,
                        ranks_per_node=2, attention_tflops=1e-3)  # fmt: skip
    relay = dataclasses.replace(base, kv_relay=True)
    direct, relayed = _plan(pieces, base), _plan(pieces, relay)
    link = link_model_from_options(relay.planner_options(), CausalPairsCost(), FLOPS)
    off_node = [
        sum(t.q_len for r in range(2, 8) for t in p.tasks[r] if t.doc_id == 0) for p in (direct, relayed)
    ]
    assert off_node[1] > off_node[0], off_node
    assert plan_critical_path(relayed, link) < plan_critical_path(direct, link)


@st.composite
def whole_documents(draw):
    """Every document whole on one rank (so nothing travels before balancing), loads uneven."""
    world = draw(st.integers(2, 6))
    lens = draw(st.lists(st.integers(1, 400), min_size=1, max_size=12))
    owners = draw(st.lists(st.integers(0, world - 1), min_size=len(lens), max_size=len(lens)))
    pieces = [[] for _ in range(world)]
    for doc, (n, r) in enumerate(zip(lens, owners)):
        pieces[r].append((doc, 0, n))
    return Layout("whole", list(range(len(lens))), lens, pieces)


@SETTINGS
@given(layout=whole_documents(), tol=st.sampled_from([0.0, 0.1]), per=st.sampled_from([None, 2]))
def test_very_slow_link_moves_nothing(layout, tol, per):
    """At 1e-12 GiB/s one byte costs ~4 minutes and all attention ~1e-4 s: nothing moves, nothing is
    sent; the balance-only planner moves work whenever loads are uneven."""
    config = DistCAConfig(
        tolerance=tol, shard_tokens=4, link_gib_per_s=1e-12, intra_node_gib_per_s=1e-12, ranks_per_node=per
    )
    plan = _plan(layout.pieces, config)
    assert plan.moves == 0 and plan.bytes_sent == [0] * layout.world
    for r, tasks in enumerate(plan.tasks):
        assert sorted((t.doc_id, t.q_start, t.q_len) for t in tasks) == sorted(layout.pieces[r])
    assert plan.critical_path_after == plan.critical_path_before


@SETTINGS
@given(layout=layouts(), tol=st.sampled_from([0.0, 0.1]))
def test_very_slow_link_adds_no_transfer_time(layout, tol):
    """On any layout (pieces cut over ranks already exchange KV), a very slow link never lets the
    all-to-all time grow: moves that take traffic away (a tail task to its head's holder) may happen."""
    config = DistCAConfig(tolerance=tol, shard_tokens=4, link_gib_per_s=1e-12, attention_tflops=1.0)
    plan = _plan(layout.pieces, config)
    unbalanced = _plan(layout.pieces, DistCAConfig(**{**config.__dict__, "max_planner_moves": 0}))
    check_plan(plan, layout, config)
    rtol, _ = TOL["critical_path"]
    assert comm_seconds(plan, layout, config) <= comm_seconds(unbalanced, layout, config) * (1 + rtol)


# ---------------------------------------------------------------------------------------- fixed cases
def _long_document_batch() -> Layout:
    """8 ranks in 2 nodes of 4: rank 0 holds one 16,384-token document, every other rank 64 of 256."""
    pieces = [[(0, 0, 16384)]] + [[(1 + 64 * r + i, 0, 256) for i in range(64)] for r in range(7)]
    return Layout("long", list(range(449)), [16384] + [256] * 448, pieces)


def _kv_fanout(plan, doc: int, holder: int) -> set[int]:
    """Servers that read part of ``doc``'s KV prefix from ``holder``."""
    return {s for s, need in enumerate(plan.kv_prefix) if doc in need and s != holder}


def test_long_document_stays_in_its_node_when_only_the_inter_node_link_is_slow():
    """Llama-3-8B rows at 300 TFLOP/s: the balance-only plan sends the document's KV prefix to all 7
    other servers; with NVLink inside a node and a 23 GiB/s NIC between nodes it stays in node 0, with a
    lower critical path than both no balancing and the balance-only plan; a send bound of three
    prefixes (plus the query rows) bounds what rank 0 sends, and balancing still happens."""
    layout = _long_document_batch()
    q_row, kv_row = 8192, 4096
    flops = attention_flops_per_pair(32, 128)
    base = DistCAConfig(shard_tokens=128)

    def plan(config):
        return plan_with_config(layout.pieces, config, q_row, kv_row, flops_per_pair=flops)

    balance_only = plan(base)
    assert _kv_fanout(balance_only, 0, 0) == set(range(1, 8))
    nodes = DistCAConfig(
        **{**base.__dict__, "link_gib_per_s": 23.3, "intra_node_gib_per_s": 250.0, "ranks_per_node": 4}
    )
    priced = plan(nodes)
    assert _kv_fanout(priced, 0, 0) == {1, 2, 3}
    assert priced.critical_path_after < priced.critical_path_before
    link = link_model_from_options(nodes.planner_options(), CausalPairsCost(), flops)
    assert priced.critical_path_after < plan_critical_path(balance_only, link)
    # everything at NVLink speed: the prefix may go anywhere again
    flat = plan(DistCAConfig(**{**base.__dict__, "link_gib_per_s": 250.0}))
    assert len(_kv_fanout(flat, 0, 0)) > 3
    # a send bound of three KV prefixes plus the query rows
    bound = 3 * 16384 * kv_row + 16384 * q_row
    bounded = plan(DistCAConfig(**{**base.__dict__, "max_send_bytes_per_rank": bound}))
    assert bounded.bytes_sent[0] <= bound < balance_only.bytes_sent[0]
    assert bounded.moves > 0 and _kv_fanout(bounded, 0, 0)
    assert bounded.imbalance_after < bounded.imbalance_before


def test_moves_only_while_they_pay():
    """One 2,048-token document and three short ones on 4 servers; attention ~0.47 s at 1e-3 TFLOP/s,
    a KV prefix ~0.1 s at 1e-3 GiB/s. Sweeping the link from slow to fast, the plan moves nothing, then
    one shard, two, then balances (as the balance-only plan at the priced planner's default tolerance); it
    moves work exactly when that lowers the critical path, which then falls as the link gets faster."""
    layout = Layout(
        "one_long",
        [0, 1, 2, 3],
        [2048, 64, 64, 64],
        [[(0, 0, 2048)], [(1, 0, 64)], [(2, 0, 64)], [(3, 0, 64)]],
    )
    balance_only = _plan(layout.pieces, DistCAConfig(shard_tokens=16, tolerance=PRICED_TOLERANCE))
    moves, paths = [], []
    for gib in (1e-3, 2e-3, 3e-3, 5e-3, 1e-2, math.inf):
        config = DistCAConfig(shard_tokens=16, link_gib_per_s=gib, attention_tflops=1e-3)
        plan = _plan(layout.pieces, config)
        check_plan(plan, layout, config)
        assert plan.critical_path_after <= plan.critical_path_before
        assert (plan.moves > 0) == (plan.critical_path_after < plan.critical_path_before)
        moves.append(plan.moves)
        paths.append(plan.critical_path_after)
    assert moves == [0, 0, 1, 2, 4, 4] and balance_only.moves == 4
    assert all(a >= b for a, b in zip(paths, paths[1:]))


# ------------------------------------------------------------------------------------ the link model
def test_phase_seconds_and_comm_closed_form():
    link = LinkModel(inter_bytes_per_s=100.0, intra_bytes_per_s=1000.0, ranks_per_node=2, overlap=0.25,
                     seconds_per_cost_unit=0.5)  # fmt: skip
    traffic = np.zeros((3, 2, 4))
    traffic[0, 1] = [100, 200, 0, 0]  # rank 0 sends 100 B of queries and 200 B of KV across nodes
    traffic[0, 0] = [0, 0, 1000, 3000]  # and receives inside its node
    traffic[1, 1] = [0, 0, 50, 400]
    phases = link.phase_seconds(traffic)
    # rank 0: inter max(300, 0)/100 = 3, intra 4000/1000 = 4 -> 4; return: inter 1, intra 1 -> 1;
    # backward dispatch: inter 500/100 = 5, intra 6000/1000 = 6 -> 6
    np.testing.assert_allclose(phases[0], [4.0, 1.0, 6.0], rtol=1e-15)
    np.testing.assert_allclose(phases[1], [4.5, 0.5, 5.5], rtol=1e-15)
    np.testing.assert_allclose(phases[2], [0.0, 0.0, 0.0])
    assert link.comm_seconds(phases) == pytest.approx(2 * 4.5 + 1.0 + 6.0, rel=1e-15)
    assert link.critical_path(10.0, 16.0) == pytest.approx(10 * 0.5 + 0.75 * 16, rel=1e-15)
    assert link.link_class(0, 1) == 0 and link.link_class(1, 2) == 1
    assert LinkModel(1.0, 1.0, None, 0.0, 1.0).link_class(0, 1) == 1


def test_layer_ping_pong_window_per_phase():
    """Under layer-level ping-pong (DistCAConfig.layer_seconds_per_token) each phase of a layer's transfer
    flies behind the other nano-batch's layer work or kernels of its pass, taken equal to this one's:
    exposed = sum over phases of max(0, share x transfer - window), the larger phase of a pass behind the
    shorter work."""
    link = LinkModel(1.0, 1.0, None, 0.0, seconds_per_cost_unit=0.01)
    assert with_hiding_work(link, DistCAConfig().planner_options(), 100, 35.0, 8, 4) is link  # none asked for
    config = DistCAConfig(layer_ping_pong=True, layer_seconds_per_token=1e-3)
    hidden = with_hiding_work(link, config.planner_options(), 100, 35.0, 8, 4)
    # per row moved: fwd.dispatch q + kv = 12 B, fwd.return out = 8, bwd.dispatch q, out, dout + kv = 28,
    # bwd.return dq + dkv = 12; layer work 0.1 s (0.025 forward), kernels 0.35 s (0.1 forward)
    expected = ((12 / 60, 0.025), (8 / 60, 0.1), (28 / 60, 0.075), (12 / 60, 0.25))
    np.testing.assert_allclose(hidden.hiding, expected, rtol=1e-12)
    assert hidden.exposed(0.1) == 0.0  # every phase shorter than the work it flies behind
    assert hidden.exposed(0.3) == pytest.approx(0.3 * 12 / 60 - 0.025 + 0.3 * 28 / 60 - 0.075, rel=1e-12)
    assert hidden.exposed(3.0) == pytest.approx(3.0 - 0.45, rel=1e-12)  # every phase longer
    assert hidden.critical_path(10.0, 3.0) == pytest.approx(0.1 + 2.55, rel=1e-12)
    halved = with_hiding_work(LinkModel(1.0, 1.0, None, 0.5, 0.01), config, 100, 35.0, 8, 4)
    assert halved.exposed(6.0) == pytest.approx(2.55, rel=1e-12)  # comm_overlap applies first
    assert link.exposed(3.0) == 3.0


def test_layer_ping_pong_window_lets_hidden_moves_pay():
    """test_moves_only_while_they_pay's batch at the link where priced moves do not pay: with the other
    nano-batch's layer work to hide the returns behind, moving work pays (the dispatches, behind the
    short kernels, stay mostly exposed); with none, only the kernels hide a little and nothing moves. The
    critical path the plan reports is the one with that work, never above no balancing."""
    layout = Layout(
        "one_long",
        [0, 1, 2, 3],
        [2048, 64, 64, 64],
        [[(0, 0, 2048)], [(1, 0, 64)], [(2, 0, 64)], [(3, 0, 64)]],
    )
    common = {"shard_tokens": 16, "link_gib_per_s": 1e-3, "attention_tflops": 1e-3}
    exposed = _plan(layout.pieces, DistCAConfig(**common))
    assert exposed.moves == 0
    for per_token, moves in ((1.0, 2), (0.0, 0)):
        config = DistCAConfig(**common, layer_ping_pong=True, layer_seconds_per_token=per_token)
        plan = _plan(layout.pieces, config)
        check_plan(plan, layout, config)
        assert plan.moves == moves
        assert plan.critical_path_after <= plan.critical_path_before
        if plan.moves:
            assert plan.critical_path_after < min(plan.critical_path_before, exposed.critical_path_after)
        link = link_model_from_options(config.planner_options(), CausalPairsCost(), FLOPS)
        tokens, mean = (2048 + 3 * 64) / 4, sum(plan.load_before) / 4
        link = with_hiding_work(link, config.planner_options(), tokens, mean, Q_ROW, KV_ROW)
        assert plan.critical_path_after == pytest.approx(plan_critical_path(plan, link), rel=1e-12)
        assert plan.critical_path_after == pytest.approx(critical_path(plan, layout, config, link), rel=1e-9)


def test_seconds_per_cost_unit(tmp_path):
    assert FLOPS == 4 * 2 * 8 * FWD_BWD_FLOP_RATIO
    assert seconds_per_cost_unit(CausalPairsCost(), FLOPS, 300.0) == pytest.approx(FLOPS / 300e12, rel=1e-15)
    # the documented default: 300 TFLOP/s = 5.2e9 pairs per second at 32 query heads x 128
    rate = DistCAConfig().attention_tflops * 1e12 / attention_flops_per_pair(32, 128)
    assert 5.2e9 <= rate < 5.3e9
    with pytest.raises(ValueError, match="flops_per_pair"):
        seconds_per_cost_unit(CausalPairsCost(), None, 300.0)
    with pytest.raises(ValueError, match="flops_per_pair"):
        plan_core_attention(
            [[(0, 0, 4)]],
            q_row_bytes=8,
            kv_row_bytes=8,
            options=DistCAConfig(link_gib_per_s=1.0).planner_options(),
        )
    with pytest.raises(ValueError, match="seconds_per_unit"):
        seconds_per_cost_unit(object(), FLOPS, 300.0)
    # a measured table is in seconds of what it timed: forward-only tables count 3.5 x
    lens, seconds = [128, 512], [[1e-5, 2e-5], [None, 4e-5]]
    write_cost_table(tmp_path / "fb.json", lens, lens, seconds, {"timed": "forward+backward"})
    write_cost_table(tmp_path / "f.json", lens, lens, seconds, {"timed": "forward"})
    both, forward = MeasuredCost.from_json(tmp_path / "fb.json"), MeasuredCost.from_json(tmp_path / "f.json")
    assert (both.timed, forward.timed) == ("forward+backward", "forward")
    assert seconds_per_cost_unit(both, None, 300.0) == 1.0
    assert seconds_per_cost_unit(forward, None, 300.0) == FWD_BWD_FLOP_RATIO
    assert both.digest() != forward.digest()  # the engine's consistency check tells them apart
    data = json.loads((tmp_path / "fb.json").read_text())
    del data["measured"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert MeasuredCost.from_json(tmp_path / "old.json").digest() == both.digest()  # tables without it
    with pytest.raises(ValueError, match="timed"):
        MeasuredCost(lens, lens, [[1e-5, 2e-5], [math.nan, 4e-5]], timed="backward")


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"link_gib_per_s": 0.0}, r"link_gib_per_s must be a positive number of GiB/s or None, got 0.0"),
        ({"link_gib_per_s": -1}, r"link_gib_per_s must be a positive"),
        ({"intra_node_gib_per_s": 0}, r"intra_node_gib_per_s must be a positive"),
        ({"ranks_per_node": 0}, r"ranks_per_node must be a positive int or None, got 0"),
        ({"comm_overlap": 1.5}, r"comm_overlap must be in \[0, 1\], got 1.5"),
        ({"attention_tflops": 0.0}, r"attention_tflops must be a positive finite number"),
        ({"attention_tflops": math.inf}, r"attention_tflops must be a positive finite number"),
        ({"max_send_bytes_per_rank": 0}, r"max_send_bytes_per_rank must be positive or None, got 0"),
        ({"layer_seconds_per_token": 4e-6}, r"set layer_ping_pong=True with it"),
        ({"layer_seconds_per_token": -1.0, "layer_ping_pong": True}, r"must be a number of seconds >= 0"),
    ],
)
def test_config_rejects_bad_link_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        DistCAConfig(**fields)


def test_link_fields_are_recipe_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(
        ["--link-gib-per-s", "23.3", "--intra-node-gib-per-s", "260", "--ranks-per-node", "8",
         "--comm-overlap", "0.5", "--attention-tflops", "400", "--max-send-bytes-per-rank", "1000000"]
    )  # fmt: skip
    assert config_from_args(args) == DistCAConfig(
        link_gib_per_s=23.3, intra_node_gib_per_s=260.0, ranks_per_node=8, comm_overlap=0.5,
        attention_tflops=400.0, max_send_bytes_per_rank=1_000_000,
    )  # fmt: skip
