"""The simulator's report: the markdown tables of every setting's results (DistCA against the ideal, every
schedule and planner, exposed communication per phase, planning time, communication, per workload) and
the plot of tokens/s per GPU."""

from __future__ import annotations

import datetime
import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hf_distca.planning.options import BALANCE_ONLY_TOLERANCE, PRICED_TOLERANCE
from hf_distca.planning.traffic import PHASES

from .costs import LinearCost, ModelShape
from .pricing import FORWARD_SHARE, Result, ideal_gain_share
from .systems import BASELINES, EXPLORATIONS, SYSTEM_SPECS, SYSTEMS, System

GOAL = 0.9
"""The share of the ideal gain DistCA aims at (issue 17); rows below it say what is left."""


@dataclass
class Row:
    """One simulated setting (workload, token budget, GPU count, inter-node bandwidth) and every system's
    result on it."""

    workload: str
    tokens_per_rank: int
    world: int
    inter_gibps: float | None
    """None for a single node (the inter-node bandwidth does not matter)."""
    results: dict[str, Result]

    @property
    def setting_cells(self) -> str:
        """The row's cells under :data:`SETTING_COLUMNS` of a report table."""
        return f"| {self.workload} | {self.tokens_per_rank} | {self.world} | {_fmt_bw(self.inter_gibps)} |"


SETTING_COLUMNS = "| workload | tokens / rank | GPUs | inter-node GiB/s |"
"""The first columns of the report's tables across settings (:attr:`Row.setting_cells`)."""
SETTING_ALIGN = "|---|---:|---:|---:|"


def _ran(rows: list[Row], systems: Sequence[str]) -> list[tuple[Row, str, Result]]:
    """(row, system, result) of each of ``systems`` that ran in each row, row by row in ``systems``' order."""
    return [(row, name, row.results[name]) for row in rows for name in systems if name in row.results]


def _share(share: float | None) -> str:
    return "n/a (< 2% to gain)" if share is None else f"{share:.0%}"


def _fmt_bw(gibps: float | None) -> str:
    return "-" if gibps is None else f"{gibps:g}"


def system_settings(system: System, info: dict) -> str:
    """The DistCAConfig a DistCA system runs with, in words, saying which settings are not DistCA's
    defaults (the report's headline)."""
    tolerance = PRICED_TOLERANCE if system.comm_aware else BALANCE_ONLY_TOLERANCE
    fields = [f"tolerance {tolerance:g} (the default for its planner) unless --tolerance"]
    fields.append(
        "cost_table=the kernel table (measured kernel time, as the default 'auto' on an H200)"
        if info["planner_table"]
        else "cost_table=None (causal pairs)"
    )
    if system.comm_aware:
        fields.append(
            "link_gib_per_s=the inter-node figure, ranks_per_node=GPUs per node, intra_node_gib_per_s=the "
            "intra-node all-to-all at 256 MiB (not defaults: the links must be given)"
        )
    if system.schedule == "attention":
        fields.append("ping_pong=True (not the default)")
    if system.schedule == "layers":
        fields.append(
            "layer_ping_pong=True, not DistCA's default (DistCAConfig.layer_ping_pong is False until measured "
            f"on 2 or more GPUs), {system.nanos} nano-batches"
        )
        if system.comm_aware and system.hide_window:
            fields.append(
                "layer_seconds_per_token None, derived as enable_distca does from the layer's weights at the "
                "default layer_tflops (each phase priced as exposed only beyond the other nano-batch's work it "
                "flies behind)"
            )
    if system.shard_tokens is not None:
        fields.append(f"shard_tokens={system.shard_tokens}")
    if system.kv_relay:
        fields.append("kv_relay=True (KV rows cross nodes once per destination node, through a relay rank)")
    if not system.balance:
        fields.append("max_planner_moves=0")
    return "DistCAConfig(" + "; ".join(fields) + ")" if system.disaggregate else "not through DistCA's engine"


def _tolerance(args, default: float) -> str:
    """The tolerance a planner ran with, in words: --tolerance, or its default."""
    return f"{default:g}, DistCAConfig's default" if args.tolerance is None else f"{args.tolerance:g}"


def _header(info: dict, args, command: str) -> list[str]:
    """The title, what the figures are, the command, the tables used and the systems compared."""
    linear: LinearCost = info["linear"]
    model: ModelShape = info["model"]
    return [
        f"# Simulated step times: DistCA and baselines on {', '.join(map(str, args.gpus))} GPUs",
        "",
        "**These are simulated figures, not measurements.** They come from benchmarks/simulate.py, which "
        "prices the real layouts and the real DistCA planner's plans with measured tables; read its "
        "docstring for the model. Checked against the measured steps of 1 and 2 x H200 in "
        "benchmarks/results/simulator_check_2xh200.md (benchmarks/check_simulator.py: what it found, row by row; "
        "among it, layer-level ping-pong's split of a micro-batch is priced as free); nothing past 2 GPUs has "
        "been measured. Generated on a CPU machine "
        f"({platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}) on "
        f"{datetime.date.today().isoformat()}.",
        "",
        f"Command: `{command}`",
        "",
        "Tables used:",
        f"- core attention: {info['kernels']}",
        f"- non-attention work: {linear.per_token_layer * 1e6:.3f} us per token per layer + "
        f"{linear.per_token_fixed * 1e6:.3f} us per token ({linear.source}), {model.layers} layers "
        "(Llama-3-8B-shaped: hidden 4096, 32/8 heads x 128, MLP 14336, vocabulary 128256)",
        "- intra-node all-to-all: "
        + ", ".join(f"{g:g} GiB/s at {s / 2**20:g} MiB" for s, g in info["intra"])
        + (
            " (NCCL_P2P_DISABLE=1 measurement, benchmarks/sim/costs.py)"
            if args.intra_link == "host"
            else " per rank (2 x H200 NVLink NCCL all-to-all, benchmarks/sim/costs.py; assumed for 8 GPUs on NVSwitch)"
        )
        + f"; {args.gpus_per_node} GPUs per node",
        "- inter-node: " + ", ".join(f"{g:g}" for g in args.inter_node_gibps) + " GiB/s per GPU "
        "(23.3 = 200 Gb/s, 46.6 = 400 Gb/s; the 2-GPU NCCL_P2P_DISABLE=1 measurement, ~22 GiB/s, sits at "
        "the low end)",
        f"- recompute: {args.recompute} "
        + (
            "(rematerialization-aware checkpointing: attention runs forward once)"
            if args.recompute == "remat"
            else "(plain activation recompute: attention and its communication run forward twice)"
        ),
        f"- {args.steps} optimizer steps of {args.grad_accum} micro-batch(es) per setting, seed {args.seed}; "
        "every system trains the same documents per step",
        "- padding: "
        + (
            "every micro-batch that runs whole is laid out at --tokens-per-rank (--pad-to-budget, "
            "DistCAConfig(pad_to_budget=True)): its unfilled room runs through the non-attention work as padding"
            if args.pad_to_budget
            else "the systems through DistCA's data path (all but hf-default) lay out a micro-batch that runs "
            "whole at the fewest tokens per rank that hold it (DistCAConfig.pad_to_budget=False, the default; "
            "nano-batches always are); hf-default packs to --tokens-per-rank"
        ),
        "- schedules (benchmarks/sim/schedule.py, timed by its list scheduler: per rank one compute stream "
        "and one communication channel, every all-to-all a collective that starts once every rank has started "
        "it and lasts as long as the slowest rank's transfer; a wait blocks the compute stream): serial for "
        "exact-unbalanced, balanced, distca and distca-comm (every exchange exposed); attention-level and "
        "layer-level ping-pong for the *-pingpong and *-layers systems. Each layer's non-attention work is "
        f"split {FORWARD_SHARE:g} forward / {1 - FORWARD_SHARE:g} backward with its recompute, and "
        "before / after attention by matmul weights (QKV against o_proj and MLP)",
        "- what the DistCA systems' planner balances: "
        + (
            "the kernel table above, DistCAConfig(cost_table=its path): measured kernel time, as "
            'cost_table="auto" (the default) plans on an H200 with bf16 32/8 x 128 heads'
            if info["planner_table"]
            else "causal pairs, DistCAConfig(cost_table=None) (the whole-document rows are no (q_len, kv_len) "
            "table), priced at the default attention_tflops=300 (forward+backward) where communication is priced"
        ),
        "- distca-comm's planner: DistCAConfig(link_gib_per_s=the inter-node figure, ranks_per_node="
        f"{args.gpus_per_node}, intra_node_gib_per_s=the intra-node all-to-all at 256 MiB per rank), "
        "comm_overlap=0; for distca-comm-layers also layer_ping_pong=True, layer_seconds_per_token="
        f"{model.derived_layer_seconds:.4g} (derived as "
        "enable_distca derives it: the layer's weights at the default layer_tflops; the simulated "
        f"non-attention work above is {linear.per_token_layer:.4g}): transfers "
        "priced as hidden behind the other nano-batch's layer work and kernels (hf_distca.planning.links."
        "with_hiding_work; distca-comm-layers-exposed: without it)",
        "",
        "Systems: hf-default (each rank packs whole documents in order, attention local to each piece; "
        "documents longer than the budget become independent chunks: **the math differs**), "
        "exact-unbalanced (the token-only rebatcher layout, layout_pieces, DistCA engine with balancing off: "
        "max_planner_moves=0), balanced (WLB-LLM-style balanced packing with per-document context "
        "parallelism, layout_balanced, exact, planner off), distca (DistCA's default: the same balanced "
        f"layout and the planner, tolerance {_tolerance(args, BALANCE_ONLY_TOLERANCE)}, balancing compute only), "
        f"distca-comm (tolerance {_tolerance(args, PRICED_TOLERANCE)}, the "
        "same with communication-aware planning: each move priced by the compute time it saves against the "
        "transfer time it adds on the simulated links; its layout cuts documents inside one node), "
        "distca-pingpong and distca-comm-pingpong (those plans run with attention-level ping-pong, "
        "DistCAConfig(ping_pong=True), its default split: nano-batches inside each attention call, messages "
        "hidden only behind kernels of the same call), distca-layers and distca-comm-layers (layer-level "
        "ping-pong, DistCAConfig(layer_ping_pong=True), not DistCA's default: the micro-batch's whole "
        "documents in two nano-batches of about equal estimated cost, each laid out over all ranks at its "
        "own tokens per rank (the fewest that hold it) and planned on its own, as the data path does (hf_distca.data.nano), run "
        "through the layers as coroutines in the engine's order (benchmarks/sim/schedule.py's layer_ping_pong, "
        "asserted against the engine's stages by tests/test_layer_ping_pong.py): while one nano-batch's "
        "messages fly the other runs its projections, MLP or layer backward), distca-comm-layers-relay "
        "(distca-comm-layers with DistCAConfig(kv_relay=True), hf_distca.planning.relay: a KV row crosses nodes "
        "once per destination node, to the node's rank at the holder's position in its node, which forwards it "
        "to the servers of its node that read it; each phase that carries KV is two all-to-alls back to back, as "
        "the engine chains them; its planner prices the relay; on one node the same as distca-comm-layers). "
        "Ideal: the exact computation of "
        "the real tokens (no padding, every document's attention whole in one kernel) perfectly balanced with no "
        "exposed communication. 'share of ideal gain': (speedup - 1) / (ideal speedup - 1), both against "
        "exact-unbalanced.",
        "",
    ]


def _headline(rows: list[Row], info: dict, args) -> list[str]:
    """The headline system against the ideal and the best exact baseline, per setting."""
    lines = [
        "## DistCA against the ideal",
        "",
        f"Headline system: **{args.headline}**: {system_settings(SYSTEM_SPECS[args.headline], info)}. 'share': of the ideal gain; 'over balanced': balanced's step over the headline's "
        "(the DistCA paper compares with WLB-LLM-style balancing and reports 1.07-1.35x); 'best baseline': the "
        "fastest exact baseline (exact-unbalanced, balanced). 'left': where the headline's share is under "
        f"{GOAL:.0%}, the seconds between its step and the ideal, as exposed communication / residual imbalance / "
        "kernels and padding (Result.left: step - synced, synced - mean busy, mean busy - ideal; they add up to "
        "the gap).",
        "",
        SETTING_COLUMNS + " exact-unbalanced s | best baseline s | ideal s "
        f"| {args.headline} s | share of ideal gain | over balanced | vs best baseline | left (s): comm / imbalance "
        "/ kernels |",
        SETTING_ALIGN + "---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    head = args.headline
    for row in rows:
        r = row.results
        if "exact-unbalanced" not in r or head not in r:
            continue
        base, ideal = r["exact-unbalanced"].step_s, r["exact-unbalanced"].ideal_step_s
        baselines = {k: r[k] for k in BASELINES if k in r}
        best = min(baselines.values(), key=lambda x: x.step_s)
        h = r[head]
        over = f"{r['balanced'].step_s / h.step_s:.2f}x" if "balanced" in r else "-"
        gain = ideal_gain_share(r, head)
        left = "-" if gain is None or gain >= GOAL else " / ".join(f"{x:.2f}" for x in h.left())
        lines.append(
            row.setting_cells + f" {base:.2f} "
            f"| {best.step_s:.2f} ({best.system}) | {ideal:.2f} | {h.step_s:.2f} | {_share(gain)} | {over} "
            f"| {best.step_s / h.step_s:.3f}x | {left} |"
        )
    return lines


def _schedules(rows: list[Row], distca: Sequence[str]) -> list[str]:
    """Every DistCA system's share of the ideal gain, per setting."""

    def share(r: dict[str, Result], name: str) -> str:
        return _share(ideal_gain_share(r, name)) if name in r else "-"

    lines = [
        "",
        "## Every DistCA schedule and planner: share of the ideal gain",
        "",
        "distca / distca-comm: serial engine (balance-only / communication-aware planner); *-pingpong: "
        "attention-level ping-pong (nano-batches inside each attention call); *-layers: layer-level ping-pong "
        "(two nano-batches of documents through the layers as coroutines). Step seconds in brackets.",
        "",
        SETTING_COLUMNS + " " + " | ".join(distca) + " | best |",
        SETTING_ALIGN + "---:|" * len(distca) + "---|",
    ]
    for row in rows:
        r = row.results
        present = [k for k in distca if k in r]
        if not present or "exact-unbalanced" not in r:
            continue
        fastest = min(present, key=lambda k: r[k].step_s)
        cells = [f"{share(r, k)} ({r[k].step_s:.2f})" if k in r else "-" for k in distca]
        lines.append(row.setting_cells + " " + " | ".join(cells) + f" | {fastest} |")
    return lines


def _exposed(rows: list[Row], distca: Sequence[str]) -> list[str]:
    """Exposed communication per phase and the three parts of the gap to the ideal."""
    lines = [
        "",
        "## Where the time goes: exposed communication per phase",
        "",
        "Per step, seconds the last rank to finish waited while each phase's transfers ran (all layers, parts "
        "and nano-batches; the wait for other ranks to reach a collective counts as imbalance, not here), "
        "then the three parts of the gap to the ideal (Result.left).",
        "",
        SETTING_COLUMNS + " system | step s | comm s (all collectives) "
        "| exposed: " + " | ".join(PHASES) + " | left: comm / imbalance / kernels s |",
        SETTING_ALIGN + "---|---:|---:|" + "---:|" * len(PHASES) + "---|",
    ]
    for row, name, res in _ran(rows, distca):
        lines.append(
            row.setting_cells
            + f" {name} | {res.step_s:.2f} | {res.comm_s:.2f} | "
            + " | ".join(f"{res.exposed_by_phase.get(p, 0.0):.2f}" for p in PHASES)
            + " | "
            + " / ".join(f"{x:.2f}" for x in res.left())
            + " |"
        )
    return lines


def _planning(rows: list[Row], args, distca: Sequence[str]) -> list[str]:
    """CPU time of planning a step against the simulated step, at the largest GPU count."""
    lines = [
        "",
        "## Planning time against the step",
        "",
        "CPU time (the process's, not wall time: the machine is shared) of planning one step (every plan of "
        "its micro-batches: layer-level ping-pong plans its two nano-batches) on the CPU machine that ran "
        "this simulation, against the simulated step of the same system. The plan depends only on the data "
        "(every rank's pieces), the model's shapes and the config, so DistCAConfig(prefetch_plans=True) makes "
        "it for micro-batch N + 1 while micro-batch N trains. benchmarks/results/planner_cpu.md times the "
        "planner alone, per micro-batch.",
        "",
        SETTING_COLUMNS + " system | plan s | step s | plan / step |",
        SETTING_ALIGN + "---|---:|---:|---:|",
    ]
    for row, name, res in _ran([row for row in rows if row.world == max(args.gpus)], distca):
        lines.append(
            row.setting_cells
            + f" {name} | {res.plan_s:.2f} | {res.step_s:.2f} | {res.plan_s / res.step_s:.1%} |"
        )
    return lines


def _communication(rows: list[Row]) -> list[str]:
    """Bytes and exposed communication of the balance-only and the communication-aware planner."""
    lines = [
        "",
        "## Communication: the balance-only planner (distca) against the communication-aware one (distca-comm)",
        "",
        "Per step: exposed all-to-all seconds, GiB the busiest sender sends, its bytes over the mean rank's, the "
        "share of all bytes that cross nodes, and the KV fan-out: the most servers that read one document's KV "
        "prefix from the same holder (each one more copy it sends per layer).",
        "",
        SETTING_COLUMNS + " system | step s | exposed comm s | GiB sent (max rank) "
        "| max / mean rank | across nodes | KV fan-out |",
        SETTING_ALIGN + "---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, name, res in _ran(rows, ("exact-unbalanced", "distca", "distca-comm")):
        lines.append(
            row.setting_cells
            + f" {name} | {res.step_s:.2f} | {res.exposed_comm_s:.2f} | {res.sent_gib_max:.1f} "
            f"| {res.sent_max_over_mean:.1f} | {res.inter_node_share:.0%} | {res.kv_fanout} |"
        )
    return lines


def _per_workload(rows: list[Row]) -> list[str]:
    """Every system's figures, one table per workload and token budget."""
    lines = []
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.tokens_per_rank), []).append(row)
    for (workload, tokens_per_rank), group in groups.items():
        lines += [
            "",
            f"## {workload}, {tokens_per_rank} tokens per rank",
            "",
            "| GPUs | inter-node GiB/s | system | step s | tokens/s | MFU | busy max / mean s | imbalance "
            "| exposed comm s | GiB sent (max rank) | ideal s | gap to ideal |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in group:
            for name, res in row.results.items():
                lines.append(
                    f"| {row.world} | {_fmt_bw(row.inter_gibps)} | {name} | {res.step_s:.2f} | {res.tokens_per_s:,.0f} "
                    f"| {res.mfu:.1%} | {res.busy_max_s:.2f} / {res.busy_mean_s:.2f} | {res.imbalance:.2f} "
                    f"| {res.exposed_comm_s:.2f} | {res.sent_gib_max:.1f} | {res.ideal_step_s:.2f} "
                    f"| {res.gap_to_ideal:+.1%} |"
                )
    return lines


def write_report(rows: list[Row], info: dict, args, command: str) -> str:
    """The markdown report of ``rows`` (``info``: the tables used, from :func:`benchmarks.simulate.run_grid`)."""
    distca = [
        k for k in SYSTEMS + EXPLORATIONS if k.startswith("distca") and any(k in row.results for row in rows)
    ]
    sections = [
        _header(info, args, command),
        _headline(rows, info, args),
        _schedules(rows, distca),
        _exposed(rows, distca),
        _planning(rows, args, distca),
        _communication(rows),
        _per_workload(rows),
    ]
    return "\n".join(line for section in sections for line in section) + "\n"


def plot(rows: list[Row], path: str) -> None:
    """Tokens/s per GPU against the GPU count: one panel per workload and token budget, one line per
    system, the ideal dashed; the highest inter-node bandwidth where several were simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.tokens_per_rank), []).append(row)
    cols = len({t for _, t in groups})
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, ((workload, tokens_per_rank), group) in zip(axes.flat, groups.items(), strict=False):
        best: dict[int, Row] = {}
        for row in group:
            if row.world not in best or (row.inter_gibps or 0) > (best[row.world].inter_gibps or 0):
                best[row.world] = row
        worlds = sorted(best)
        names = list(best[worlds[0]].results)
        for name in names:
            label = f"{name} (not exact)" if name == "hf-default" else name
            ax.plot(worlds, [best[w].results[name].tokens_per_s / w for w in worlds], marker="o", label=label)
        ideal = [best[w].results[names[0]].ideal_step_s for w in worlds]
        tokens = [best[w].results[names[0]].tokens_per_s * best[w].results[names[0]].step_s for w in worlds]
        ax.plot(worlds, [t / i / w for t, i, w in zip(tokens, ideal, worlds)], "k--", label="ideal")
        ax.set_xscale("log", base=2)
        inter = max((row.inter_gibps or 0) for row in group)
        link = f", {inter:g} GiB/s between nodes" if inter else ""
        ax.set_title(f"{workload}, {tokens_per_rank // 1024}K tokens/rank{link} (simulated)", fontsize=9)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("tokens/s per GPU")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
