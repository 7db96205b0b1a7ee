"""Data path (pure, process-free): plan global batches, lay micro-batches out over ranks, synthetic data."""

from hf_distca.data.loader import DistCABatches, DistCADataLoader, DistCALayout, TokenDocuments
from hf_distca.data.rebatch import (
    IGNORE_INDEX,
    RankBatch,
    layout_balanced,
    layout_for_rank,
    layout_micro_batch,
    layout_pieces,
)
from hf_distca.data.sampler import GlobalBatchPlan, plan_global_batches
from hf_distca.data.synthetic import (
    document_lengths,
    documents_with_lengths,
    generate_documents,
    generate_text_documents,
)

__all__ = [
    "DistCABatches",
    "DistCADataLoader",
    "DistCALayout",
    "TokenDocuments",
    "IGNORE_INDEX",
    "GlobalBatchPlan",
    "RankBatch",
    "document_lengths",
    "documents_with_lengths",
    "generate_documents",
    "generate_text_documents",
    "layout_balanced",
    "layout_for_rank",
    "layout_micro_batch",
    "layout_pieces",
    "plan_global_batches",
]
