"""Memory ladder: the largest tokens per step each memory technique reaches, laid out like ALST's table.

Runs recipes/finetune_long_docs.py once per (technique set, tokens per step), each in its own process (clean
device memory) with its own timeout, climbing each set's token ladder upwards and stopping it at the first
run that does not finish (out of memory, error, timeout). Technique sets are cumulative, as in ALST's table:

    remat     bf16, SGD, rematerialization-aware checkpointing (today's configuration), micro-batches
              padded to the step's tokens (``--pad-to-budget``)
    +liger    and liger-kernel's fused linear cross-entropy
    +offload  and the checkpointed layer inputs in pinned host memory
    +kept     and the kept attention outputs placed per layer (``--kept-attention auto``)
    +tiled    and the tiled MLP
    +norms    and the tiled norms (the decoder layers' and the final norm: no float32 copies of the hidden states)

(``+X``: every set up to X in this order; ``remat+offload+tiled``: exactly those.) Each row: status, peak
allocated and reserved device memory, the host memory pinned by the offload, the median step time of the
steps after the first and tokens/s, and the recipe's accounting of the peak by owner (summary.json ``memory``).
The markdown table and the JSON are rewritten after every run (a killed ladder keeps its rows), with the
command line at the top.

    python -m benchmarks.memory_ladder --out results/ladder --num-layers 32 \\
        --ladder remat=131072 --ladder +tiled=262144,524288

``--device cpu`` (or no CUDA device): float32 (no ``--bf16``), the memory columns say n/a (CPU); for tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

from benchmarks.common import ROOT

RECIPE = os.path.join(ROOT, "recipes", "finetune_long_docs.py")
TECHNIQUES = {  # in the order the sets accumulate them: name -> the recipe's flags
    # --pad-to-budget: every micro-batch holds exactly the step's tokens (else it runs at the fewest rows
    # that hold its documents, up to a document's length fewer)
    "remat": ["--bf16", "--gradient-checkpointing", "--optim", "sgd", "--pad-to-budget"],
    "liger": ["--liger"],
    "offload": ["--offload-activations"],
    "kept": ["--kept-attention", "auto"],
    "tiled": ["--tiled-mlp", "{tile}"],
    "norms": ["--tiled-norms", "{tile}"],
}
DEFAULT_TOKENS = "65536,131072,262144,393216,524288"
DEFAULT_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]
"""Packed documents of these lengths (drawn uniformly) when no --doc-lengths sample is given."""
NA = "n/a (CPU)"
OWNERS = [  # (column, summary.json memory.by_owner key)
    ("weights", "weights_gib"),
    ("grads", "gradients_gib"),
    ("optim", "optimizer_state_gib"),
    ("inputs GPU", "checkpointed_inputs_gpu_gib"),
    ("inputs host", "checkpointed_inputs_host_gib"),
    ("kept GPU", "kept_attention_gpu_gib"),
    ("kept host", "kept_attention_host_gib"),
    ("kept dropped", "kept_attention_dropped_gib"),
    ("rest", "rest_gib"),
]
OOM = re.compile(r"out of memory|OutOfMemoryError|cudaErrorMemoryAllocation", re.IGNORECASE)
ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)|.*: error: )")


def technique_set(spec: str) -> list[str]:
    """The techniques of a set: ``+X`` is every one up to X (in TECHNIQUES' order); ``a+b+c`` exactly those."""
    order = list(TECHNIQUES)
    if spec.startswith("+"):
        name = spec[1:]
        if name not in TECHNIQUES:
            raise ValueError(f"unknown technique {name!r} in {spec!r}; known: {', '.join(order)}")
        return order[: order.index(name) + 1]
    names = spec.split("+")
    unknown = [n for n in names if n not in TECHNIQUES]
    if unknown or names[0] != "remat":
        raise ValueError(
            f"technique set {spec!r}: give remat first, then any of {', '.join(order[1:])} joined by '+' "
            f"(or +X for every technique up to X)"
        )
    return names


def parse_ladder(specs: list[str] | None, tokens: str) -> list[tuple[str, list[int]]]:
    """[(set, ascending tokens per step)] from ``SET=T1,T2`` specs (default: every +X set at ``tokens``)."""
    if not specs:
        specs = ["remat", *(f"+{name}" for name in list(TECHNIQUES)[1:])]
    out = []
    for spec in specs:
        name, _, sizes = spec.partition("=")
        technique_set(name)  # validates
        values = sorted({int(v) for v in (sizes or tokens).split(",") if v.strip()})
        if not values or values[0] <= 0:
            raise ValueError(f"--ladder {spec!r}: give positive tokens per step, e.g. {name}=131072,262144")
        out.append((name, values))
    return out


def recipe_flags(spec: str, *, cpu: bool, tile: int) -> list[str]:
    flags = []
    for name in technique_set(spec):
        flags += [f.format(tile=tile) for f in TECHNIQUES[name]]
    if cpu:  # float32 on the CPU: the tests' mode
        flags = [f for f in flags if f != "--bf16"] + ["--cpu"]
    return flags


def _median_after_first(path: str) -> float | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        times = [json.loads(line)["step_time_s"] for line in f if line.strip()]
    return statistics.median(times[1:]) if len(times) > 1 else None


def _message(output: str) -> str:
    """The first line of the error message in a run's output (the last exception line, else the last line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if OOM.search(line):
            return line
    for line in reversed(lines):
        if ERROR_LINE.match(line):
            return line
    return lines[-1] if lines else "(no output)"


def classify(rc: int | None, output: str, wrote_summary: bool, timeout: float) -> dict:
    """A run's status (ok, OOM, timeout, killed, error) and the first line of its message.
    ``rc`` None: it ran past ``timeout`` and was killed."""
    if rc == 0 and wrote_summary:
        return {"status": "ok"}
    if rc is None:
        return {"status": f"timeout ({timeout:.0f} s)"}
    if OOM.search(output):
        return {"status": "OOM", "message": _message(output)}
    if rc in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return {"status": "killed (SIGKILL: host out of memory?)"}
    return {"status": "error", "message": _message(output)}


def run_one(args, spec: str, tokens: int, cpu: bool, lengths: str, timeout: float) -> dict:
    """One recipe run in its own process; its row."""
    name = f"{spec.replace('+', '-').strip('-')}_{tokens}"
    run_dir = os.path.join(args.out, "runs", name)
    os.makedirs(run_dir, exist_ok=True)
    mean_length = args.mean_doc_length
    documents = math.ceil(1.5 * args.max_steps * tokens / mean_length) + 16
    command = [
        sys.executable, RECIPE, "--model", args.model, "--tokens-per-rank", str(tokens),
        "--max-steps", str(args.max_steps), "--doc-lengths", lengths, "--num-documents", str(documents),
        "--no-save", "--output-dir", run_dir,
        *(["--num-layers", str(args.num_layers)] if args.num_layers else []),
        *recipe_flags(spec, cpu=cpu, tile=args.tile_tokens), *shlex.split(args.recipe_args),
    ]  # fmt: skip
    row = {"tokens": tokens, "layers": args.num_layers or "model's", "technique": spec,
           "command": shlex.join(command), "log": os.path.join(run_dir, "log.txt")}  # fmt: skip
    start = time.monotonic()
    with open(row["log"], "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # past its timeout, or the ladder itself stopped (SIGTERM, Ctrl-C): no run outlives it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group (started above)
                proc.wait()
    row["wall_s"] = round(time.monotonic() - start, 1)
    with open(row["log"]) as f:
        output = f.read()
    summary_path = os.path.join(run_dir, "summary.json")
    row.update(classify(rc, output, os.path.exists(summary_path), timeout))
    summary = {}
    if row["status"] == "ok":
        with open(summary_path) as f:
            summary = json.load(f)
    memory = summary.get("memory", {})
    peak, reserved = summary.get("peak_memory_gib"), summary.get("peak_reserved_gib")
    row["peak_allocated_gib"] = peak[0] if peak else None
    row["peak_reserved_gib"] = reserved[0] if reserved else None
    pinned = memory.get("host_arena_gib", 0.0) if memory.get("host_arena_pinned") else 0.0
    row["host_pinned_gib"] = None if cpu or not summary else pinned
    row["by_owner"] = memory.get("by_owner")
    row["split"] = {k: v for k, v in memory.items() if k.startswith(("kept_attention_", "offload_inputs"))}
    step = _median_after_first(os.path.join(run_dir, "metrics.jsonl")) if summary else None
    row["step_time_s"] = step
    row["tokens_per_s"] = tokens / step if step else None
    return row


def _gib(value, cpu: bool) -> str:
    if value is None:
        return NA if cpu else "-"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def _split(row: dict) -> str:
    split = row.get("split") or {}
    parts = []
    if "offload_inputs_host_layers" in split:
        parts.append(f"inputs on host: {split['offload_inputs_host_layers']} layers")
    if "kept_attention_gpu_layers" in split:
        parts.append(
            "kept gpu/host/drop: "
            + "/".join(str(split.get(f"kept_attention_{w}_layers", 0)) for w in ("gpu", "host", "drop"))
        )
    return "; ".join(parts) or "-"


def write_tables(out: str, command: str, rows: list[dict], cpu: bool) -> None:
    """ladder.md and ladder.json in ``out``, replaced whole (written to a temporary name, then renamed)."""
    head = ["tokens", "layers", "technique", "status", "peak alloc GiB", "peak reserved GiB", "host pinned GiB",
            "step s", "tokens/s", *(c + " GiB" for c, _ in OWNERS), "split"]  # fmt: skip
    lines = [
        "# Memory ladder", "", "```", command, "```", "",
        "Step s: median of the steps after the first. Owners: the recipe's accounting of the peak "
        "(hf_distca.memory_owners); rest = peak allocated minus the owners on the GPU.", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]  # fmt: skip
    for row in rows:
        owners = row.get("by_owner") or {}
        status = row["status"] + (f": {row['message']}" if row.get("message") else "")
        cells = [
            str(row["tokens"]), str(row["layers"]), row["technique"], status.replace("|", "/"),
            _gib(row["peak_allocated_gib"], cpu), _gib(row["peak_reserved_gib"], cpu),
            _gib(row["host_pinned_gib"], cpu),
            "-" if row["step_time_s"] is None else f"{row['step_time_s']:.2f}",
            "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.0f}",
            *(_gib(owners.get(key), cpu) if owners else "-" for _, key in OWNERS), _split(row),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for name, text in (("ladder.md", "\n".join(lines) + "\n"),
                       ("ladder.json", json.dumps({"command": command, "rows": rows}, indent=2))):  # fmt: skip
        path = os.path.join(out, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory: ladder.md, ladder.json, runs/<set>_<tokens>/")
    p.add_argument(
        "--model", default="llama3-8b-shaped", help="the recipe's --model (e.g. tiny-llama on the CPU)"
    )
    p.add_argument("--num-layers", type=int, default=None, help="the recipe's --num-layers")
    p.add_argument(
        "--ladder", action="append", default=None, metavar="SET[=T1,T2,...]",
        help="a technique set (remat, +liger, +offload, +kept, +tiled, +norms, or remat+X+Y) and its tokens per step; "
        "repeat for several sets (default: every +X set at --tokens)",
    )  # fmt: skip
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="tokens per step of a set without '=...'")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each run may take")
    p.add_argument(
        "--deadline", type=float, default=None,
        help="seconds the whole ladder may take: each run's timeout is cut to what is left, none starts after",
    )  # fmt: skip
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--doc-lengths", default=None, help=f"JSON list of document lengths (default {DEFAULT_LENGTHS})"
    )
    p.add_argument(
        "--tile-tokens", type=int, default=0, help="+tiled, +norms: tokens per tile (0: the hidden size)"
    )
    p.add_argument("--recipe-args", default="", help="more flags for every recipe run (one string)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv is not None and __name__ == "__main__":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds into run_one's clean-up
    args = build_parser().parse_args(argv)
    ladder = parse_ladder(args.ladder, args.tokens)
    if args.device == "auto":
        import torch

        cpu = not torch.cuda.is_available()
    else:
        cpu = args.device == "cpu"
    os.makedirs(args.out, exist_ok=True)
    lengths = args.doc_lengths
    if lengths is None:
        lengths = os.path.join(args.out, "doc_lengths.json")
        with open(lengths, "w") as f:
            json.dump(DEFAULT_LENGTHS, f)
    with open(lengths) as f:
        sample = json.load(f)
    args.mean_doc_length = max(1.0, statistics.fmean(sample))
    command = "python -m benchmarks.memory_ladder " + shlex.join(argv)
    rows: list[dict] = []
    write_tables(args.out, command, rows, cpu)
    start = time.monotonic()
    for spec, sizes in ladder:
        for tokens in sizes:
            timeout = args.timeout
            if args.deadline is not None:
                timeout = min(timeout, args.deadline - (time.monotonic() - start))
            if timeout <= 1:
                print(f"[memory_ladder] deadline reached: {spec} at {tokens} tokens not run", flush=True)
                break
            row = run_one(args, spec, tokens, cpu, lengths, timeout)
            rows.append(row)
            write_tables(args.out, command, rows, cpu)
            print(f"[memory_ladder] {spec} {tokens}: {row['status']} {row.get('message', '')}", flush=True)
            if row["status"] != "ok":
                break  # the first size that does not fit ends this set's climb
    return rows


if __name__ == "__main__":
    main()
