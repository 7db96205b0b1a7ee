"""Sequence parallelism for linear-attention layers: documents cut across ranks, states scanned across
ranks with All-Scan (ZeCO), serial hand-off (LASP-1) or all-gather (LASP-2).

- :mod:`hf_distca.linear.ops`: the recurrences (per-token reference, chunked PyTorch, flash-linear-attention
  kernels where they are correct), the scan plan of a layout, the state scan collective, ``linear_attention`` and the short causal convolution
  with its halo exchange (``causal_conv_pieces``);
- :mod:`hf_distca.linear.layers`: Transformers modules wrapped to use them (MiniMax lightning attention,
  Qwen3-Next gated DeltaNet).
"""

from hf_distca.linear.config import LINEAR_BACKENDS, SCAN_METHODS, LinearSPConfig
from hf_distca.linear.ops import build_scan_plan, linear_attention, recurrence, scan_states

__all__ = [
    "LINEAR_BACKENDS",
    "SCAN_METHODS",
    "LinearSPConfig",
    "build_scan_plan",
    "linear_attention",
    "recurrence",
    "scan_states",
]
