"""Planning: pure Python/NumPy, no torch.distributed, no CUDA."""

from hf_distca.planning.cost import CausalPairsCost, MeasuredCost, causal_pairs, cost_model_from_config
from hf_distca.planning.dispatch import DispatchIndex, build_dispatch_index
from hf_distca.planning.pieces import DocIndex, Piece, PieceError
from hf_distca.planning.planner import CATask, CorePlan, plan_core_attention

__all__ = [
    "CATask",
    "CausalPairsCost",
    "CorePlan",
    "DispatchIndex",
    "DocIndex",
    "MeasuredCost",
    "Piece",
    "PieceError",
    "build_dispatch_index",
    "causal_pairs",
    "cost_model_from_config",
    "plan_core_attention",
]
