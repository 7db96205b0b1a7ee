"""hf_distca: core attention disaggregation for Hugging Face Transformers."""

from hf_distca import metrics
from hf_distca.attention import distca_attention_forward, enable_distca
from hf_distca.callback import DistCACallback
from hf_distca.checkpointing import enable_remat_checkpointing, remat_checkpointing_kwargs
from hf_distca.config import DistCAConfig
from hf_distca.engine import InconsistentInputError, core_attention, local_attention
from hf_distca.nano_batches import forward_nano_batches, nano_batch_loss
from hf_distca.offloading import OffloadOptions, offload_activations
from hf_distca.planning import CATask, CorePlan, Piece, PieceError, plan_core_attention
from hf_distca.tiled_mlp import tile_mlp, tile_norms
from hf_distca.trainer import DistCATrainer, DistCATrainerMixin
from hf_distca.version import __version__

__all__ = [
    "CATask",
    "CorePlan",
    "DistCACallback",
    "DistCAConfig",
    "DistCATrainer",
    "DistCATrainerMixin",
    "InconsistentInputError",
    "OffloadOptions",
    "Piece",
    "PieceError",
    "__version__",
    "core_attention",
    "distca_attention_forward",
    "enable_distca",
    "enable_remat_checkpointing",
    "forward_nano_batches",
    "local_attention",
    "metrics",
    "nano_batch_loss",
    "offload_activations",
    "plan_core_attention",
    "remat_checkpointing_kwargs",
    "tile_mlp",
    "tile_norms",
]
