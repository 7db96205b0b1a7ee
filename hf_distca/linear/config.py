"""Configuration of sequence-parallel linear attention: local kernel backend and cross-rank state scan."""

from __future__ import annotations

from dataclasses import dataclass

LINEAR_BACKENDS = ("auto", "reference", "chunked", "fla")
SCAN_METHODS = ("all_scan", "serial", "all_gather")


@dataclass(frozen=True)
class LinearSPConfig:
    """Knobs of sequence-parallel linear attention. Every rank must use an identical config."""

    backend: str = "auto"
    """Local recurrence kernel: 'reference' (per-token loop in torch, any device, the oracle), 'chunked'
    (chunks of 64 tokens in torch, any device), 'fla' (flash-linear-attention's chunk kernels, CUDA, needs
    the ``fla-core`` package) or 'auto' (on CUDA fla when it imports and is correct for the layer's
    transition on this GPU and Triton, else chunked; on CPU reference). The choice is made when the model
    is prepared (``enable_linear_attention_sp``): an explicit 'fla' that would be wrong raises there."""

    scan: str = "all_scan"
    """How the state entering each cut piece is computed across ranks: 'all_scan' (ZeCO: pipelined
    point-to-point hand-off in ``num_blocks`` value-dimension blocks), 'serial' (LASP-1: the whole state
    hops piece to piece) or 'all_gather' (LASP-2: every rank gathers every rank's piece states and
    transitions and combines them locally)."""

    num_blocks: int = 8
    """All-Scan pipeline depth: the state (H, K, V) is split into this many blocks along V (at most V);
    rank p forwards block j as soon as it has applied its transition to it."""

    def __post_init__(self) -> None:
        if self.backend not in LINEAR_BACKENDS:
            raise ValueError(f"LinearSPConfig.backend must be one of {LINEAR_BACKENDS}, got {self.backend!r}")
        if self.scan not in SCAN_METHODS:
            raise ValueError(f"LinearSPConfig.scan must be one of {SCAN_METHODS}, got {self.scan!r}")
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"LinearSPConfig.num_blocks must be an int >= 1, got {self.num_blocks!r}")
