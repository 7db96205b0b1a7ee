"""hf_distca: core attention disaggregation for Hugging Face Transformers."""

__version__ = "0.1.0"

from hf_distca.config import DistCAConfig
from hf_distca.engine import core_attention
from hf_distca.planning import CATask, CorePlan, Piece, PieceError, plan_core_attention

__all__ = [
    "CATask",
    "CorePlan",
    "DistCAConfig",
    "Piece",
    "PieceError",
    "__version__",
    "core_attention",
    "plan_core_attention",
]
