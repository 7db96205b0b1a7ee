"""The per-step records of a DistCA training run: one record per optimizer step from the engine's metrics
(:mod:`hf_distca.metrics`), identical on every rank, written to a JSON-lines file (rank 0), averaged
into the Trainer's logs, and drawn as the per-rank attention load at the end (:mod:`hf_distca.plotting`).

:class:`DistCACallback` (:mod:`hf_distca.callback`) owns one :class:`StepRecords` and calls it at the
Trainer's events.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch

from hf_distca import metrics
from hf_distca.comm import all_gather_rows
from hf_distca.data.loader import DistCABatches
from hf_distca.data.rebatch import layout_pieces
from hf_distca.features import layer_windows
from hf_distca.planning import forward_flops_per_pair, imbalance
from hf_distca.plotting import plot_attention_load

__all__ = ["StepRecords", "read_records"]

# EngineStats counter -> metrics record key, where the field name alone would not say what it counts
_RECORD_KEYS = {"calls": "engine_calls"}
# EngineStats counters of the run's start (the probes at enable_distca), added to its first step's record
_STARTUP_COUNTERS = ("probes", "probe_seconds")


class StepRecords:
    """The records of one run: ``metrics_file`` and ``plot_file`` relative to the Trainer's
    ``output_dir`` (None: not written); ``balanced``: whether attention is disaggregated (the plot's
    legend)."""

    def __init__(self, metrics_file: str | None, plot_file: str | None, balanced: bool) -> None:
        self.metrics_file = metrics_file
        self.plot_file = plot_file
        self.balanced = balanced
        self.records: list[dict] = []
        """The records of the current ``train()`` call (identical on every rank)."""
        self._unlogged: list[dict] = []
        self._startup: metrics.EngineStats | None = None
        self._step_start = 0.0
        self._step_loss: torch.Tensor | None = None
        self._layers = 0
        self._flops_per_pair = 0.0
        self._windows: list[int | None] = []  # per layer, for the attention load before balancing

    def begin(self, args: Any, global_step: int, model_config: Any, startup: metrics.EngineStats) -> None:
        """At ``on_train_begin``: the model's shape, a fresh (or, on resume, truncated) metrics file;
        ``startup``: the engine's metrics of the run's start (its probes), added to the first record."""
        heads = getattr(model_config, "num_attention_heads", 0) or 0
        head_dim = getattr(model_config, "head_dim", None) or (
            getattr(model_config, "hidden_size", 0) // max(heads, 1)
        )
        self._layers = getattr(model_config, "num_hidden_layers", 0) or 0
        self._windows = layer_windows(model_config) if model_config is not None else []
        self._flops_per_pair = forward_flops_per_pair(heads, head_dim)
        self.records, self._unlogged, self._startup = [], [], startup
        if args.process_index == 0 and self.metrics_file:
            self._start_file(args, global_step)
        metrics.reset()

    def step_begin(self) -> None:
        metrics.reset()
        self._step_loss = None
        self._step_start = time.perf_counter()

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss as ``Trainer.training_step`` returns it (summed over the step)."""
        loss = loss.detach()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def step_end(self, args: Any, global_step: int, batches: DistCABatches, tokens: int) -> dict:
        """The record of the step that ends (collective: every rank's counters are gathered); ``tokens``:
        the step's token budget."""
        stats = metrics.snapshot(reset=True)
        if self._startup is not None:
            for name in _STARTUP_COUNTERS:
                setattr(stats, name, getattr(stats, name) + getattr(self._startup, name))
            self._startup = None
        elapsed = time.perf_counter() - self._step_start
        grad_accum = args.gradient_accumulation_steps
        counters = {
            f.name: getattr(stats, f.name)
            for f in dataclasses.fields(stats)
            if isinstance(getattr(stats, f.name), (int, float))
            and not isinstance(getattr(stats, f.name), bool)
        }
        int_names = [k for k, v in counters.items() if isinstance(v, int)]
        float_names = [k for k, v in counters.items() if not isinstance(v, int)]
        loss = float(self._step_loss) if self._step_loss is not None else float("nan")
        ints = all_gather_rows([counters[k] for k in int_names])
        floats = all_gather_rows([elapsed, loss, *(counters[k] for k in float_names)], dtype=torch.float64)
        step, windows = batches.current_step, self._windows  # every layer's pairs, its own window
        before = [p * self._flops_per_pair for p in batches.layout_load(step, windows=windows)]
        token_layout = batches.layout_load(step, layout=layout_pieces, windows=windows)
        if stats.flops_after and stats.calls:
            # the engine sums every call, recomputes included: scale to one forward per layer and micro-batch
            scale = self._layers * grad_accum / stats.calls
            after = [f * scale for f in stats.flops_after]
        else:  # attention stayed on each rank: nothing was moved
            after = list(before)
        record = {
            "step": global_step,
            # the Trainer's reduction of its loss: mean over ranks of the summed micro-batch losses
            "loss": statistics.fmean(row[1] for row in floats),
            "tokens": tokens,
            "step_time_s": max(row[0] for row in floats),
            "attn_flops_before": before,
            "attn_flops_after": after,
            "imbalance_before": imbalance(before),
            "imbalance_after": imbalance(after),
            # the same documents placed by the token-only rebatcher (whole documents where they fit)
            "imbalance_token_layout": imbalance(token_layout),
        }
        for i, name in enumerate(int_names):
            record[_RECORD_KEYS.get(name, name)] = [int(row[i]) for row in ints]
        for i, name in enumerate(float_names):
            record[_RECORD_KEYS.get(name, name)] = [float(row[2 + i]) for row in floats]
        self.records.append(record)
        self._unlogged.append(record)
        if args.process_index == 0 and self.metrics_file:
            with open(os.path.join(args.output_dir, self.metrics_file), "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def log_figures(self) -> dict[str, float]:
        """The figures added to the Trainer's logs (keys ``distca/...``): each record field averaged
        over the optimizer steps since the previous log; per-rank lists as ``<field>_max`` (the
        busiest rank) and ``<field>_mean`` (over ranks). Empty when no step ran since the last log."""
        steps, self._unlogged = self._unlogged, []
        if not steps:
            return {}
        figures = {}
        for key, value in steps[0].items():
            if key in ("step", "loss") or value is None or isinstance(value, bool):
                continue
            if isinstance(value, list):
                figures[f"distca/{key}_max"] = statistics.fmean(max(r[key]) for r in steps)
                figures[f"distca/{key}_mean"] = statistics.fmean(statistics.fmean(r[key]) for r in steps)
            elif isinstance(value, (int, float)):
                figures[f"distca/{key}"] = statistics.fmean(r[key] for r in steps)
        return figures

    def finish(self, args: Any) -> None:
        """At ``on_train_end``: the plot of the whole run (also the steps before a resume), rank 0."""
        if args.process_index != 0 or not self.plot_file:
            return
        records = self.records
        if self.metrics_file:
            records = read_records(os.path.join(args.output_dir, self.metrics_file))
        if records:
            plot_attention_load(
                records, os.path.join(args.output_dir, self.plot_file), balanced=self.balanced
            )

    @property
    def summary(self) -> dict:
        """Mean imbalances over the steps recorded by the current ``train()`` call: with the token-only
        layout, with this run's layout (before planning) and after planning."""
        if not self.records:
            return {}
        n = len(self.records)
        return {
            "steps": n,
            "imbalance_before": sum(r["imbalance_before"] for r in self.records) / n,
            "imbalance_after": sum(r["imbalance_after"] for r in self.records) / n,
            "imbalance_token_layout": sum(r["imbalance_token_layout"] for r in self.records) / n,
            "final_loss": self.records[-1]["loss"],
        }

    def _start_file(self, args: Any, global_step: int) -> None:
        """A fresh file, or on resume the records up to the checkpoint's step (later ones were
        written by the interrupted run after that checkpoint and are trained again)."""
        path = os.path.join(args.output_dir, self.metrics_file)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        kept = [r for r in read_records(path) if r["step"] <= global_step] if global_step > 0 else []
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)


def read_records(path: str) -> list[dict]:
    """The records of a metrics file ([] when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
