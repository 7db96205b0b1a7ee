"""The scan-time simulator (hf_distca.linear.simulate): closed forms, schedule replay, link fit (pure Python)."""

from __future__ import annotations

import pytest
from test_all_scan import chunked_layout

from hf_distca.data import layout_pieces
from hf_distca.linear.simulate import (
    PointToPointLink,
    best_blocks,
    chain_scan_time,
    fit_link,
    simulate_layout,
)

LINK = PointToPointLink(latency_s=20e-6, bandwidth_Bps=100e9)
STATE = 32 * 128 * 128 * 4  # 32 heads x 128 x 128, fp32: 2 MiB


def test_all_scan_simulator_closed_forms():
    alpha, beta = LINK.latency_s, LINK.bandwidth_Bps
    serial = chain_scan_time("serial", edges=7, ranks=8, state_bytes=STATE, transition_bytes=0, link=LINK)
    assert serial == pytest.approx(7 * (alpha + STATE / beta), rel=1e-12)
    one_block = chain_scan_time(
        "all_scan", edges=7, ranks=8, state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=1
    )
    assert one_block == pytest.approx(serial, rel=1e-12)  # All-Scan with one block is the serial hand-off
    piped = chain_scan_time(
        "all_scan", edges=7, ranks=8, state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=8
    )
    assert piped == pytest.approx(14 * (alpha + STATE / 8 / beta), rel=1e-12)
    gather = chain_scan_time(
        "all_gather", edges=7, ranks=8, state_bytes=STATE, transition_bytes=512, link=LINK
    )
    assert gather == pytest.approx(7 * (alpha + (STATE + 512) / beta), rel=1e-12)
    b = best_blocks(255, STATE, LINK, 128)
    long_chain = chain_scan_time(
        "all_scan", edges=255, ranks=256, state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=b
    )
    long_serial = chain_scan_time(
        "serial", edges=255, ranks=256, state_bytes=STATE, transition_bytes=0, link=LINK
    )
    # serial pays E (alpha + S / beta); All-Scan about E alpha + S / beta (latency-bound at this size)
    assert (
        255 * alpha
        < long_chain
        < 255 * alpha + 3 * (STATE / beta) ** 0.5 * (255 * alpha) ** 0.5 + STATE / beta
    )
    assert long_chain < 0.6 * long_serial
    assert 1 < b <= 128


def test_all_scan_simulator_best_blocks_is_the_minimum():
    for edges in (1, 3, 15, 63):
        b = best_blocks(edges, STATE, LINK, 128)

        def t(n, e=edges):
            return chain_scan_time(
                "all_scan", edges=e, ranks=2, state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=n
            )

        assert all(t(b) <= t(n) for n in range(1, 129))
    assert best_blocks(1, STATE, LINK, 128) == 1  # one hop: splitting only adds latency


def test_all_scan_simulator_replays_layouts():
    # contiguous chunks, one document over 4 ranks: the schedule is the closed form with 3 edges
    layout = chunked_layout([400], 4)
    for method, blocks in (("serial", 1), ("all_scan", 4)):
        replay = simulate_layout(
            layout, method=method, state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=blocks
        )
        closed = chain_scan_time(
            method, edges=3, ranks=4, state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=blocks
        )
        assert replay == pytest.approx(closed, rel=1e-12)
    # DistCA's zigzag layout: a document over 4 ranks is a chain of 6 edges; ranks 1 and 2 hold two pieces
    # of it, so in the steps where both of their edges carry a block they send twice the bytes
    zigzag = layout_pieces([400], world_size=4, tokens_per_rank=100)
    replay = simulate_layout(
        zigzag, method="all_scan", state_bytes=STATE, transition_bytes=0, link=LINK, num_blocks=4
    )
    block = STATE / 4
    # 9 steps; rank 1's edges (positions 1 and 5) never overlap, rank 2's (positions 2 and 4) in steps 4, 5
    expected = 7 * LINK.message_s(block) + 2 * LINK.message_s(2 * block)
    assert replay == pytest.approx(expected, rel=1e-12)
    # nothing cut: nothing to send
    assert (
        simulate_layout(
            [[(0, 0, 5)], [(1, 0, 5)]], method="serial", state_bytes=STATE, transition_bytes=0, link=LINK
        )
        == 0
    )
    # two documents cut between the same ranks in one step share one message per peer
    two = [[(0, 0, 5), (1, 0, 5)], [(0, 5, 5), (1, 5, 5)]]
    one_msg = simulate_layout(two, method="serial", state_bytes=STATE, transition_bytes=0, link=LINK)
    assert one_msg == pytest.approx(LINK.message_s(2 * STATE), rel=1e-12)


def test_all_scan_simulator_fits_measured_links():
    sizes = [2**k for k in range(12, 27)]
    times = [LINK.message_s(s) for s in sizes]
    fitted = fit_link(sizes, times)
    assert fitted.latency_s == pytest.approx(LINK.latency_s, rel=1e-6)
    assert fitted.bandwidth_Bps == pytest.approx(LINK.bandwidth_Bps, rel=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        fit_link([1.0], [1.0])
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        PointToPointLink(latency_s=0.0, bandwidth_Bps=0.0)
