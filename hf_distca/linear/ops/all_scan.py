"""The cross-rank state scan of linear attention: All-Scan (ZeCO), serial hand-off (LASP-1), all-gather (LASP-2).

Along every chain of pieces (see :mod:`hf_distca.linear.ops.scan_plan`) the state entering piece i + 1 is

    S_in(i + 1) = A(i) S_in(i) + S_loc(i)              (S_in of a document's first piece is 0)

with A(i) the piece's transition (per-head factor, per key-dim factor or dense (K, K) matrix) and S_loc(i)
its final state from zero. The backward pass is the reverse scan of the state gradient:

    G(i) = D(i + 1) + A(i + 1)^T G(i + 1)               (G of the last edge: D of the last piece)

where D(i) is the gradient reaching S_in(i) from piece i's outputs and G(i) the gradient of the state
leaving piece i; then dS_loc(i) = G(i) and dA(i) = G(i) S_in(i)^T (summed over the dimensions a diagonal
transition does not have).

All-Scan splits the (H, K, V) state into blocks along V (columns never mix: A acts on K) and pipelines
them: edge e of a chain carries block j in step e + j, so a rank forwards block j as soon as it has
applied its transition to it, and a chain of E edges takes E + B - 1 steps of one block each instead of E
steps of a whole state. Every step is one ``batch_isend_irecv`` per rank (one message per peer, the
blocks of all chains concatenated); a hop to a piece on the same rank is a local copy. ``serial`` is the
same schedule with one block. ``all_gather`` gathers every rank's (A, S_loc) (and, backward, every D)
and combines them locally: one collective, P x the volume.

The group is always passed in (None: the default group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hf_distca.comm import all_gather_padded
from hf_distca.linear.config import SCAN_METHODS
from hf_distca.linear.ops.scan_plan import Edge, ScanPlan

__all__ = ["SCAN_METHODS", "ScanSpec", "apply_transition", "scan_backward", "scan_forward", "scan_states"]


class ScanSpec(NamedTuple):
    """How one scan runs, forward and backward: its plan, the transitions' kind ('scalar', 'vector' or
    'dense'), the method (one of ``SCAN_METHODS``), All-Scan's number of column blocks and the group."""

    plan: ScanPlan
    kind: str
    method: str = "all_scan"
    num_blocks: int = 8
    group: Any = None


def apply_transition(kind: str, a: torch.Tensor, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """A x (or A^T x) for one piece: a (H,) / (H, K) / (H, K, K) for 'scalar' / 'vector' / 'dense';
    x (H, K, Vb): a block of state columns."""
    if kind == "scalar":
        return a[:, None, None] * x
    if kind == "vector":
        return a[:, :, None] * x
    return (a.transpose(-1, -2) if transpose else a) @ x  # (H, K, K) @ (H, K, Vb)


def _transition_grad(kind: str, g: torch.Tensor, s_in: torch.Tensor) -> torch.Tensor:
    """d loss / d A for out = A s_in + S_loc with d loss / d out = g; g, s_in: (H, K, V)."""
    if kind == "scalar":
        return (g * s_in).sum((-1, -2))  # (H,)
    if kind == "vector":
        return (g * s_in).sum(-1)  # (H, K)
    return g @ s_in.transpose(-1, -2)  # (H, K, K)


def _column_blocks(v_dim: int, num_blocks: int) -> list[tuple[int, int]]:
    """[c0, c1) column ranges of min(num_blocks, V) blocks as equal as possible (the larger first)."""
    b = max(1, min(num_blocks, v_dim))
    base, extra = divmod(v_dim, b)
    bounds, c = [], 0
    for j in range(b):
        n = base + (1 if j < extra else 0)
        bounds.append((c, c + n))
        c += n
    return bounds


@dataclass(frozen=True)
class _Send:
    peer: int
    offset: int  # block j leaves in step offset + j
    key: tuple[int, int]  # (chain, position): message order shared by sender and receiver
    local_index: int  # row of the local term (S_loc forward, D backward)
    input_index: int  # row of the received state to transform and add, -1: none
    transition_index: int  # row of the transition applied to it


@dataclass(frozen=True)
class _Recv:
    peer: int
    offset: int
    key: tuple[int, int]
    result_index: int


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _pipelined(
    spec: ScanSpec,
    transitions: torch.Tensor,
    local_terms: torch.Tensor,
    sends: list[_Send],
    recvs: list[_Recv],
    num_results: int,
    transpose: bool,
) -> torch.Tensor:
    """Run one direction of the chain scan; return the received states (num_results, H, K, V)."""
    kind, rank, group = spec.kind, spec.plan.rank, spec.group
    h, kd, vd = local_terms.shape[1:]
    results = local_terms.new_zeros((num_results, h, kd, vd))
    if not sends and not recvs:
        return results
    blocks = _column_blocks(vd, 1 if spec.method == "serial" else spec.num_blocks)
    steps = spec.plan.max_chain_edges + len(blocks) - 1
    sends = sorted(sends, key=lambda s: s.key)
    recvs = sorted(recvs, key=lambda r: r.key)
    for step in range(steps):
        outgoing: dict[int, list[torch.Tensor]] = {}
        for s in sends:
            j = step - s.offset
            if not 0 <= j < len(blocks):
                continue
            c0, c1 = blocks[j]
            block = local_terms[s.local_index, :, :, c0:c1]  # (H, K, Vb)
            if s.input_index >= 0:
                block = block + apply_transition(
                    kind, transitions[s.transition_index], results[s.input_index, :, :, c0:c1], transpose
                )
            outgoing.setdefault(s.peer, []).append(block)
        incoming: dict[int, list[tuple[int, int, int]]] = {}
        for r in recvs:
            j = step - r.offset
            if 0 <= j < len(blocks):
                incoming.setdefault(r.peer, []).append((r.result_index, *blocks[j]))
        ops, landing = [], []
        for peer, parts in outgoing.items():
            if peer == rank:
                continue
            buf = torch.cat([p.reshape(-1) for p in parts])
            ops.append(dist.P2POp(dist.isend, buf, _global_rank(group, peer), group))
        for peer, slots in incoming.items():
            if peer == rank:
                continue
            buf = local_terms.new_empty(sum(h * kd * (c1 - c0) for _, c0, c1 in slots))
            ops.append(dist.P2POp(dist.irecv, buf, _global_rank(group, peer), group))
            landing.append((buf, slots))
        if rank in incoming:  # hops between two pieces of this rank: the blocks in the same order
            landing.append((torch.cat([p.reshape(-1) for p in outgoing[rank]]), incoming[rank]))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buf, slots in landing:
            offset = 0
            for index, c0, c1 in slots:
                n = h * kd * (c1 - c0)
                results[index, :, :, c0:c1] = buf[offset : offset + n].view(h, kd, c1 - c0)
                offset += n
    return results


def _reverse_position(e: Edge) -> int:
    return e.chain_edges - 1 - e.position


def scan_forward(transitions: torch.Tensor, local_states: torch.Tensor, spec: ScanSpec) -> torch.Tensor:
    """States entering this rank's in pieces (n_in, H, K, V) from the transitions (n_out, ...) and local
    final states (n_out, H, K, V) of its out pieces (no autograd; see :func:`scan_states`)."""
    plan, kind, method, _, group = spec
    h, kd, vd = local_states.shape[1:]
    transitions = transitions.to(local_states.dtype)
    if method == "all_gather":
        a_all = all_gather_padded(transitions, plan.out_counts, group)
        s_all = all_gather_padded(local_states, plan.out_counts, group)
        result = local_states.new_zeros((len(plan.in_pieces), h, kd, vd))
        by_chain = {c[0].chain: c for c in plan.chains}
        for slot, e in enumerate(plan.in_edges):
            state = local_states.new_zeros((h, kd, vd))
            for q in by_chain[e.chain][: e.position + 1]:
                state = (
                    apply_transition(kind, a_all[q.src_rank][q.src_slot], state)
                    + s_all[q.src_rank][q.src_slot]
                )
            result[slot] = state
        return result
    sends = [
        _Send(e.dst_rank, e.position, (e.chain, e.position), slot, plan.out_input_slot[slot], slot)
        for slot, e in enumerate(plan.out_edges)
    ]
    recvs = [
        _Recv(e.src_rank, e.position, (e.chain, e.position), slot) for slot, e in enumerate(plan.in_edges)
    ]
    return _pipelined(spec, transitions, local_states, sends, recvs, len(plan.in_pieces), False)


def scan_backward(
    transitions: torch.Tensor, entering: torch.Tensor, grad_entering: torch.Tensor, spec: ScanSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse scan: from the gradients reaching this rank's entering states (n_in, H, K, V) to the
    gradients of its out pieces' transitions and local final states. ``entering`` is the forward result."""
    plan, kind, method, _, group = spec
    h, kd, vd = grad_entering.shape[1:]
    transitions = transitions.to(grad_entering.dtype)
    n_out = len(plan.out_pieces)
    if method == "all_gather":
        a_all = all_gather_padded(transitions, plan.out_counts, group)
        d_all = all_gather_padded(grad_entering, plan.in_counts, group)
        by_chain = {c[0].chain: c for c in plan.chains}
        grad_leaving = grad_entering.new_zeros((n_out, h, kd, vd))
        for slot, e in enumerate(plan.out_edges):
            chain = by_chain[e.chain]
            g = None
            for q in reversed(range(e.position, len(chain))):
                d = d_all[chain[q].dst_rank][chain[q].dst_slot]
                if g is not None:
                    nxt = chain[q + 1]
                    d = d + apply_transition(kind, a_all[nxt.src_rank][nxt.src_slot], g, transpose=True)
                g = d
            grad_leaving[slot] = g
    else:
        sends = [
            _Send(
                e.src_rank,
                _reverse_position(e),
                (e.chain, e.position),
                slot,
                plan.in_output_slot[slot],
                plan.in_output_slot[slot],
            )
            for slot, e in enumerate(plan.in_edges)
        ]
        recvs = [
            _Recv(e.dst_rank, _reverse_position(e), (e.chain, e.position), slot)
            for slot, e in enumerate(plan.out_edges)
        ]
        grad_leaving = _pipelined(spec, transitions, grad_entering, sends, recvs, n_out, True)
    grad_transitions = torch.zeros_like(transitions)
    for slot, in_slot in enumerate(plan.out_input_slot):
        if in_slot >= 0:
            grad_transitions[slot] = _transition_grad(kind, grad_leaving[slot], entering[in_slot])
    return grad_transitions, grad_leaving


class _StateScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, transitions, local_states, anchor, spec: ScanSpec):
        entering = scan_forward(transitions.detach(), local_states.detach(), spec)
        ctx.save_for_backward(transitions, entering)
        ctx.spec = spec
        token = local_states.new_zeros(())
        return entering, token

    @staticmethod
    def backward(ctx, grad_entering, grad_token):
        transitions, entering = ctx.saved_tensors
        grad_a, grad_s = scan_backward(transitions, entering, grad_entering.contiguous(), ctx.spec)
        return grad_a.to(transitions.dtype), grad_s, None, None


def scan_states(
    transitions: torch.Tensor,
    local_states: torch.Tensor,
    plan: ScanPlan,
    *,
    kind: str,
    method: str = "all_scan",
    num_blocks: int = 8,
    group=None,
    anchor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable scan: (states entering this rank's in pieces (n_in, H, K, V), a zero scalar token).

    Every rank of the layout must call it, forward and backward, even with nothing to send: add the
    token to something the loss depends on, and pass an ``anchor`` that requires grad whenever the
    layer's inputs do, so that autograd runs the backward (and its communication) on every rank.
    """
    if method not in SCAN_METHODS:
        raise ValueError(f"scan method must be one of {SCAN_METHODS}, got {method!r}")
    if kind not in ("scalar", "vector", "dense"):
        raise ValueError(f"transition kind must be 'scalar', 'vector' or 'dense', got {kind!r}")
    if local_states.shape[0] != len(plan.out_pieces) or transitions.shape[0] != len(plan.out_pieces):
        raise ValueError(
            f"this rank has {len(plan.out_pieces)} pieces that hand their state on, got {local_states.shape[0]} "
            f"states and {transitions.shape[0]} transitions"
        )
    if anchor is None:
        anchor = local_states.new_zeros(())
    return _StateScan.apply(
        transitions, local_states, anchor, ScanSpec(plan, kind, method, num_blocks, group)
    )
