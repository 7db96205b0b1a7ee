"""Planning: pure Python/NumPy, no torch.distributed, no CUDA."""

from hf_distca.planning.cost import CausalFlopsCost, MeasuredCost, causal_pairs
from hf_distca.planning.layout import RankLayout, build_rank_layout
from hf_distca.planning.pieces import DocIndex, Piece, PieceError
from hf_distca.planning.planner import CATask, CorePlan, plan_core_attention

__all__ = [
    "CATask",
    "CausalFlopsCost",
    "CorePlan",
    "DocIndex",
    "MeasuredCost",
    "Piece",
    "PieceError",
    "RankLayout",
    "build_rank_layout",
    "causal_pairs",
    "plan_core_attention",
]
