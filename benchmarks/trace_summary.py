"""A torch.profiler chrome trace of engine steps, summarised per engine call: which stages started in which
order, how much of the NCCL kernels' time ran beside compute kernels (hidden) and how much did not
(exposed), and the server kernels' time (benchmarks/bench_ping_pong.py's timeline tables)."""

from __future__ import annotations


def _overlap(interval: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    a, b = interval
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if x < b and y > a)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def summarize_trace(trace: dict) -> dict:
    """A chrome trace of torch.profiler, summarised (times in ms):

    ``calls``: per engine call (pass, index in call order), the stages in the order they started and,
    with GPU kernels in the trace, ``comm_ms`` (NCCL kernels launched inside the call's ``distca.*``
    ranges), ``hidden_ms`` (the part of them that ran while some non-NCCL kernel ran), ``exposed_ms``
    (the rest) and ``server_ms`` (kernels launched inside its compute stages); without GPU kernels (a
    CPU run), ``wait_ms`` (time blocked in exchanges: the wait stages, and serial dispatch/return) and
    ``server_ms`` (the compute stages' CPU time).
    ``nccl``: per NCCL kernel name, its total time and hidden part, whoever launched it (DDP's
    all-reduce too). ``span_ms``, ``compute_busy_ms``: from the first to the last kernel, and the time
    in it when some non-NCCL kernel ran (the rest is the compute units' idle time)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = sorted(
        (
            e
            for e in events
            if str(e.get("name", "")).startswith("distca.") and e.get("cat") == "user_annotation"
        ),
        key=lambda e: e["ts"],
    )
    calls: dict[tuple[str, int], dict] = {}
    seen: dict[str, int] = {}
    located = []  # (tid, start, end, call key, stage)
    for e in ranges:
        _, phase, stage, *nano = e["name"].split(".")
        name = ".".join([stage, *nano])
        first_stage = stage == "dispatch" and nano in ([], ["0"])
        if first_stage:
            seen[phase] = seen.get(phase, -1) + 1
        key = (phase, seen.get(phase, 0))
        call = calls.setdefault(key, {"pass": phase, "call": key[1], "stages": [], "cpu": {}})
        call["stages"].append(name)
        call["cpu"][name] = call["cpu"].get(name, 0.0) + e["dur"] / 1e3
        located.append((e.get("tid"), e["ts"], e["ts"] + e["dur"], key, stage))
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    summary: dict = {"nccl": {}}
    if kernels:
        compute = _merge([(k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" not in k["name"].lower()])
        summary["span_ms"] = (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)) / 1e3
        summary["compute_busy_ms"] = sum(b - a for a, b in compute) / 1e3
        for k in kernels:
            if "nccl" in k["name"].lower():
                family = summary["nccl"].setdefault(k["name"].split("(")[0], {"ms": 0.0, "hidden_ms": 0.0})
                family["ms"] += k["dur"] / 1e3
                family["hidden_ms"] += _overlap((k["ts"], k["ts"] + k["dur"]), compute) / 1e3
        for call in calls.values():
            call.update(comm_ms=0.0, hidden_ms=0.0, server_ms=0.0)
        for k in kernels:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is None:
                continue
            inside = [r for r in located if r[0] == launch.get("tid") and r[1] <= launch["ts"] <= r[2]]
            if not inside:
                continue
            _, _, _, key, stage = max(inside, key=lambda r: r[1])  # the innermost range
            call, span = calls[key], (k["ts"], k["ts"] + k["dur"])
            if "nccl" in k["name"].lower():
                call["comm_ms"] += k["dur"] / 1e3
                call["hidden_ms"] += _overlap(span, compute) / 1e3
            elif stage == "compute":
                call["server_ms"] += k["dur"] / 1e3
        for call in calls.values():
            call["exposed_ms"] = call["comm_ms"] - call["hidden_ms"]
    else:
        for call in calls.values():
            blocking = [n for n in call["cpu"] if n.startswith("wait_") or n in ("dispatch", "return")]
            call["wait_ms"] = sum(call["cpu"][n] for n in blocking)
            call["server_ms"] = sum(t for n, t in call["cpu"].items() if n.startswith("compute"))
    for call in calls.values():
        del call["cpu"]
    summary["calls"] = [calls[k] for k in sorted(calls, key=lambda k: (k[0] != "fwd", k[1]))]
    return summary
