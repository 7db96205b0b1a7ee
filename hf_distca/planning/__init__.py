"""Planning: pure Python/NumPy, no torch.distributed, no CUDA."""

from hf_distca.planning.cost import CausalFlopsCost, MeasuredCost, causal_pairs
from hf_distca.planning.dispatch import DispatchIndex, build_dispatch_index
from hf_distca.planning.pieces import DocIndex, Piece, PieceError
from hf_distca.planning.planner import CATask, CorePlan, plan_core_attention

__all__ = [
    "CATask",
    "CausalFlopsCost",
    "CorePlan",
    "DispatchIndex",
    "DocIndex",
    "MeasuredCost",
    "Piece",
    "PieceError",
    "build_dispatch_index",
    "causal_pairs",
    "plan_core_attention",
]
