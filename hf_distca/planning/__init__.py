"""Planning: pure Python/NumPy, no torch.distributed, no CUDA."""

from hf_distca.planning.cost import (
    CausalPairsCost,
    MeasuredCost,
    attention_flops_per_pair,
    causal_pairs,
    forward_flops_per_pair,
)
from hf_distca.planning.dispatch import DispatchIndex, build_dispatch_index
from hf_distca.planning.links import LinkModel, link_model_from_options, plan_critical_path
from hf_distca.planning.options import PlannerOptions
from hf_distca.planning.pieces import DocIndex, Piece, PieceError
from hf_distca.planning.planner import plan_core_attention
from hf_distca.planning.tasks import CATask, CorePlan, imbalance

__all__ = [
    "CATask",
    "CausalPairsCost",
    "CorePlan",
    "DispatchIndex",
    "DocIndex",
    "LinkModel",
    "MeasuredCost",
    "Piece",
    "PieceError",
    "PlannerOptions",
    "attention_flops_per_pair",
    "build_dispatch_index",
    "causal_pairs",
    "forward_flops_per_pair",
    "imbalance",
    "link_model_from_options",
    "plan_core_attention",
    "plan_critical_path",
]
