"""hf_distca: core attention disaggregation for Hugging Face Transformers."""

__version__ = "0.1.0"

from hf_distca import metrics
from hf_distca.attention import distca_attention_forward, enable_distca
from hf_distca.callback import DistCACallback
from hf_distca.config import DistCAConfig
from hf_distca.engine import core_attention
from hf_distca.planning import CATask, CorePlan, Piece, PieceError, plan_core_attention
from hf_distca.trainer import DistCATrainer

__all__ = [
    "CATask",
    "CorePlan",
    "DistCACallback",
    "DistCAConfig",
    "DistCATrainer",
    "Piece",
    "PieceError",
    "__version__",
    "core_attention",
    "distca_attention_forward",
    "enable_distca",
    "metrics",
    "plan_core_attention",
]
