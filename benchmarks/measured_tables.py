"""The measured tables of benchmarks/results/ that benchmarks/check_simulator.py checks the simulator
against: bench_remat's ('## Checkpointing modes, N x ...') and bench_ping_pong's ('## Ping-pong, N x GPU,
...') rows, read back with the command that wrote each table, and that command's options as the script's
own parser reads them."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from dataclasses import dataclass

from . import (
    bench_ping_pong,  # its parser
    bench_remat,  # its command-line parser: the results tables hold its commands
)

ATTENTION_ROW = "core-attention forward alone, all layers"
"""The mode of bench_remat's row of the core-attention forward alone."""


@dataclass(frozen=True)
class Measured:
    """One measured row of a bench_remat table."""

    source: str
    """File the row comes from."""
    world: int
    sample: str
    """Length sample name ('mix', 'prolong', ...)."""
    mode: str
    """Checkpointing mode ('remat', 'recompute', 'none') or ATTENTION_ROW."""
    backend: str
    """Kernel backend of the run ('auto' when the table names none); bench_ping_pong rows: the kernel the
    run's --backend resolved to (see :func:`parse_results`)."""
    seconds: float
    sent_gib: float | None
    """Core-attention bytes sent per step (GiB, max over ranks and steps); None for the attention-alone row."""
    imbalance: tuple[float, float] | None
    """Attention imbalance before -> after the plan (first timed step); None for the attention-alone row."""
    command: str
    """The table's bench_remat (or bench_ping_pong) command."""
    tokens_per_rank: int | None = None
    """bench_ping_pong rows: the row's tokens per rank (None: a bench_remat row, one size per command)."""
    fwd_kernels: int | None = None
    """bench_ping_pong rows: attention forward kernel runs per step (max over timed steps and ranks)."""
    device: str = ""
    """bench_ping_pong rows: the GPU model of the section header (e.g. 'NVIDIA H200')."""
    profiled_span_s: float | None = None
    """bench_ping_pong rows with a timeline: seconds from the first to the last GPU kernel of the one
    profiled step (the mode's last micro-batch, run again after a warm step)."""
    later_s: tuple[float, ...] = ()
    """bench_ping_pong rows of a ``--passes 2+`` table: the step time (s) of each pass after the first
    (column 'later passes'); empty for a one-pass table. ``seconds`` is the first pass's."""
    plans_built: tuple[int, ...] = ()
    """bench_ping_pong rows of a ``--passes 2+`` table: cuDNN plans built during each pass, first first."""

    @property
    def warm_s(self) -> float | None:
        """Step time of the second pass (every shape seen once, no new cuDNN plans); None without one."""
        return self.later_s[0] if self.later_s else None


_HEADER = re.compile(r"^## Checkpointing modes, (\d+) x ")
_PING_PONG = re.compile(r"^## Ping-pong, (\d+) x ([^,]+),")
_COMMAND = re.compile(r"^Command: `(.*)`\s*$")
_CUDNN = re.compile(r"^Software: .*\bcudnn \d")
_TIMELINE = re.compile(r"^### Timeline: (.+), (\w+) \(")
_SPAN = re.compile(r"^Step: kernels from first to last ([\d.]+) ms")
_PASS = re.compile(r"^([\d.]+)(?: \([\d.]+x\))?$")


def parse_results(text: str, source: str) -> list[Measured]:
    """Every timed row of the bench_remat tables in ``text`` (sections '## Checkpointing modes, N x ...')
    and of the bench_ping_pong tables (sections '## Ping-pong, N x GPU, ...', with the kernel span of each
    profiled step from its '### Timeline' subsection, and with ``--passes 2+`` the later passes' step
    times and the cuDNN plans built per pass from the two last columns; tables without them parse as
    one pass). A ping-pong row's tokens per rank is the size of
    its command's --tokens-per-rank that its label names; its backend is the command's --backend, 'auto'
    resolved as hf_distca.kernels resolves it (cudnn first): 'cudnn' when the file's 'Software:' line
    says cudnn imported, else 'torch_varlen'."""
    rows: list[Measured] = []
    world = command = timeline = None
    section, ping_pong, device = 0, False, ""
    cudnn = any(_CUDNN.match(line) for line in text.splitlines())
    labels: dict[int, tuple] = {}  # index in rows -> (section, 'sample / size', mode) of a ping-pong row
    spans: dict[tuple, float] = {}  # (section, 'sample / size', mode) -> profiled kernel span (s)
    for line in text.splitlines():
        header = _HEADER.match(line) or _PING_PONG.match(line)
        if header:
            world, command, timeline, section = int(header.group(1)), None, None, section + 1
            ping_pong = header.re is _PING_PONG
            device = header.group(2).strip() if ping_pong else ""
            continue
        found = _TIMELINE.match(line)
        if found and ping_pong and world is not None:
            timeline = (section, found.group(1), found.group(2))
            continue
        if line.startswith("#"):
            world = None
            continue
        found = _SPAN.match(line)
        if found and timeline is not None:
            spans[timeline] = float(found.group(1)) / 1e3
            continue
        found = _COMMAND.match(line)
        if found and world is not None:
            command = found.group(1)
            continue
        if world is None or command is None or not line.startswith("| ") or line.startswith("| sample"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        try:
            seconds = float(cells[2])
        except ValueError:  # out of memory / not run
            continue
        if ping_pong:
            labels[len(rows)] = (section, cells[0].split(" (")[0], cells[1])
            rows.append(_ping_pong_row(cells, seconds, source, world, device, command, cudnn))
            continue
        sample = cells[0].split(" (")[0]
        mode, backend = cells[1], "auto"
        if mode.endswith(")") and " (" in mode:
            mode, backend = mode[:-1].split(" (")
        sent = imbalance = None
        if mode != ATTENTION_ROW:
            sent = float(cells[6])
            imbalance = tuple(float(x) for x in cells[7].split("->"))
        rows.append(Measured(source, world, sample, mode, backend, seconds, sent, imbalance, command))
    for i, key in labels.items():
        rows[i] = dataclasses.replace(rows[i], profiled_span_s=spans.get(key))
    return rows


def _ping_pong_row(
    cells: list[str], seconds: float, source: str, world: int, device: str, command: str, cudnn: bool
) -> Measured:
    """One row of a bench_ping_pong table ('sample / 32K (0%)', mode, step time, ..., and with
    ``--passes 2+``: 'later passes' as '1.118 (1.07x)' per pass after the first, comma-separated, and
    'cuDNN plans built per pass' as '2 / 0')."""
    args = ping_pong_args(command)
    sample, _, size = cells[0].split(" (")[0].rpartition(" / ")
    sizes = [int(x) for x in args.tokens_per_rank.split(",") if x]
    tokens = {f"{t // 1024}K" if t >= 1024 else f"{t}": t for t in sizes}[size]  # bench_ping_pong's labels
    backend = args.backend if args.backend != "auto" else ("cudnn" if cudnn else "torch_varlen")
    imbalance = tuple(float(x) for x in cells[8].split("->"))
    later: tuple[float, ...] = ()
    built: tuple[int, ...] = ()
    if len(cells) > 10 and cells[9]:
        found = [_PASS.match(t.strip()) for t in cells[9].split(",")]
        if not all(found):
            raise ValueError(f"{source}: unreadable 'later passes' cell {cells[9]!r}")
        later = tuple(float(m.group(1)) for m in found)
        built = tuple(int(x) for x in cells[10].split("/"))
    return Measured(
        source, world, sample, cells[1], backend, seconds, float(cells[7]), imbalance, command, tokens,
        int(cells[6]), device, later_s=later, plans_built=built,
    )  # fmt: skip


def _script_words(command: str, script: str) -> list[str]:
    """The arguments after ``-m benchmarks.<script>`` in ``command``."""
    words = shlex.split(command)
    return words[words.index(f"benchmarks.{script}") + 1 :]


def bench_args(command: str) -> argparse.Namespace:
    """The bench_remat options of a table's command that decide which micro-batches ran."""
    args, _ = bench_remat.build_parser().parse_known_args(_script_words(command, "bench_remat"))
    return args


def ping_pong_args(command: str) -> argparse.Namespace:
    """bench_ping_pong's own parse of a table's command (seed, warm-up, steps, layout, layers ...)."""
    return bench_ping_pong.parse_args(_script_words(command, "bench_ping_pong"))
