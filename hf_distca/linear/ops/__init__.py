"""Operators of sequence-parallel linear attention: recurrences (per-token reference, chunked PyTorch,
flash-linear-attention kernels) and the choice among them, the cross-rank state scan, and the short causal
convolution of gated-DeltaNet layers with its cross-rank halo exchange."""

from hf_distca.linear.ops.all_scan import SCAN_METHODS, ScanSpec, scan_backward, scan_forward, scan_states
from hf_distca.linear.ops.conv_halo import HaloPlan, build_halo_plan, causal_conv_pieces
from hf_distca.linear.ops.fla_backend import fla_available, fla_kind, fla_unsafe_reason
from hf_distca.linear.ops.local import (
    piece_transitions,
    prepare_backend,
    recurrence,
    resolve_linear_backend,
    state_contribution,
)
from hf_distca.linear.ops.recurrence import Recurrence, transition_kind
from hf_distca.linear.ops.scan_plan import Edge, ScanPlan, build_scan_plan, chains_of
from hf_distca.linear.ops.sequence_parallel import linear_attention

__all__ = [
    "SCAN_METHODS",
    "Edge",
    "HaloPlan",
    "Recurrence",
    "ScanPlan",
    "ScanSpec",
    "build_halo_plan",
    "build_scan_plan",
    "causal_conv_pieces",
    "chains_of",
    "fla_available",
    "fla_kind",
    "fla_unsafe_reason",
    "linear_attention",
    "piece_transitions",
    "prepare_backend",
    "recurrence",
    "resolve_linear_backend",
    "scan_backward",
    "scan_forward",
    "scan_states",
    "state_contribution",
    "transition_kind",
]
