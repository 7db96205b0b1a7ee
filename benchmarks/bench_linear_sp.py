"""Sequence-parallel linear attention on N GPUs: exactness, state-scan methods, a layer, a hybrid model step.

Run with torchrun (one process per GPU; 2 GPUs expected); writes ``linear_sp.md`` and ``linear_sp.json``
into ``--out``:

1. check: flash-linear-attention's kernels (local part) and the distributed path (All-Scan) against the
   float64 per-token reference on the uncut documents, outputs and gradients, for a per-head constant
   decay (lightning), a per key-dim decay (GLA), the gated delta rule and Kimi's delta rule (dense
   transitions);
2. p2p: one-way time of a grouped isend/irecv between ranks 0 and 1 at 1 KiB-64 MiB, and the fitted
   latency / bandwidth (the simulator's input);
3. scan: the state scan alone, forward and backward, All-Scan (2-16 blocks) vs serial hand-off (LASP-1)
   vs all-gather of states (LASP-2), for states of 16/32/64 heads x 128 x 128 in fp32 and bf16, per-head
   and dense transitions, on a document cut once (chain of 1 edge) and cut zigzag (2 edges);
4. layer: ``linear_attention`` forward+backward (fla, bf16) on 32K tokens per rank, documents whole on
   each rank vs one document cut over the ranks;
5. model: a MiniMax-shaped hybrid (7 lightning + 1 softmax layer per 8, distca + All-Scan) training step
   (forward+backward) on the same token count, documents whole vs cut over ranks;
6. simulate: the scan at 2-256 ranks from the measured link (hf_distca.linear.simulate).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.bench_linear_sp --out OUTDIR

``--smoke`` shrinks every size (CPU + gloo works: ``--device cpu --smoke``) to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from functools import partial

import torch
import torch.distributed as dist

from hf_distca.data import layout_pieces
from hf_distca.linear import LINEAR_BACKENDS, LinearSPConfig, linear_attention
from hf_distca.linear.ops import (
    ScanSpec,
    build_scan_plan,
    fla_available,
    recurrence,
    scan_backward,
    scan_forward,
)
from hf_distca.linear.simulate import PointToPointLink, best_blocks, chain_scan_time, fit_link

from .common import init_process_group, median_ms

CHECK_TOL = 2e-2  # max |a - b| / max |b| per tensor: bf16/tf32 kernels against the float64 reference


# ------------------------------------------------------------------------------------------- helpers


def rel_err(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    """max |a - b| / max |b|, the max over ranks (reduced on ``device``: NCCL reduces CUDA tensors only)."""
    err = (a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
    t = err.reshape(1).to(device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def rows_and_lengths(all_pieces, rank: int) -> tuple[torch.Tensor, list[int]]:
    """Rows of rank's tokens in the concatenation of documents 0, 1, ... (padding documents included),
    and the documents' lengths."""
    ends: dict[int, int] = {}
    for pieces in all_pieces:
        for d, s, n in pieces:
            ends[d] = max(ends.get(d, 0), s + n)
    offsets, acc = {}, 0
    for d in sorted(ends):
        offsets[d] = acc
        acc += ends[d]
    return torch.cat([torch.arange(offsets[d] + s, offsets[d] + s + n) for d, s, n in all_pieces[rank]]), [
        ends[d] for d in sorted(ends)
    ]


def random_inputs(kind: str, total: int, heads: int, dk: int, dv: int, seed: int, device, dtype):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, w = (
        randn(total, heads, dk) * dk**-0.5,
        randn(total, heads, dk),
        randn(total, heads, dv),
        randn(total, heads, dv),
    )
    k = k / k.norm(dim=-1, keepdim=True)
    g = beta = None
    if kind == "const":
        g = -(0.5 ** torch.arange(1, heads + 1, dtype=torch.float64))  # lightning-like slopes
    elif kind == "vector":
        g = -0.1 * torch.rand(total, heads, dk, generator=gen, dtype=torch.float64)
    elif kind in ("delta", "kda"):
        shape = (total, heads) if kind == "delta" else (total, heads, dk)
        g = -0.1 * torch.rand(*shape, generator=gen, dtype=torch.float64)
        beta = torch.rand(total, heads, generator=gen, dtype=torch.float64)
    out = dict(q=q, k=k, v=v, g=g, beta=beta, w=w)
    return {
        n: (x.to(device=device, dtype=dtype if n != "g" else torch.float32) if x is not None else None)
        for n, x in out.items()
    }


# ------------------------------------------------------------------------------------------- sections
def sp_attention(x: dict, layout, rank: int, config: LinearSPConfig) -> torch.Tensor:
    """``linear_attention`` of this rank's rows ``x`` (q, k, v, g: log decay, beta) of the ranks' ``layout``."""
    return linear_attention(
        x["q"],
        x["k"],
        x["v"],
        layout[rank],
        log_decay=x["g"],
        beta=x["beta"],
        all_pieces=layout,
        config=config,
    )


def section_check(ctx) -> tuple[str, dict]:
    rank, device, smoke = ctx["rank"], ctx["device"], ctx["smoke"]
    world = dist.get_world_size()
    heads, dk = (2, 16) if smoke else (2, 128)
    per_rank = 96 if smoke else 256
    layout = layout_pieces(
        [int(per_rank * world * 0.6), per_rank // 3, per_rank // 5],
        world_size=world,
        tokens_per_rank=per_rank,
    )
    rows, lengths = rows_and_lengths(layout, rank)
    dtype = torch.float32
    results, lines = {}, []
    for kind in ("const", "vector", "delta", "kda"):
        inputs = random_inputs(kind, sum(lengths), heads, dk, dk, 1, "cpu", torch.float64)
        # float64 per-token reference on the uncut documents (CPU), outputs and gradients
        leaves = {
            n: (x.clone().requires_grad_(x.dim() > 1) if x is not None else None) for n, x in inputs.items()
        }
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        ref, _ = recurrence(
            *(leaves[n] for n in ("q", "k", "v")),
            cu_seqlens=cu,
            log_decay=leaves["g"],
            beta=leaves["beta"],
            backend="reference",
        )
        (ref * inputs["w"]).sum().backward()
        # distributed: this rank's rows, the configured backend (fla on CUDA), All-Scan
        local = {}
        for n, x in inputs.items():
            if x is None:
                local[n] = None
            elif x.dim() > 1 and x.shape[0] == sum(lengths):
                local[n] = x[rows].to(device=device, dtype=dtype if n != "g" else torch.float32)
            else:
                local[n] = x.to(device=device, dtype=torch.float32)
        for n in ("q", "k", "v", "beta"):
            if local[n] is not None:
                local[n].requires_grad_(True)
        config = LinearSPConfig(backend=ctx["backend"], scan="all_scan", num_blocks=4)
        out = sp_attention(local, layout, rank, config)
        (out * local["w"]).sum().backward()
        errs = {"out": rel_err(out.detach().cpu(), ref.detach()[rows], device)}
        for n in ("q", "k", "v", "beta"):
            if local[n] is not None:
                errs["d" + n] = rel_err(local[n].grad.cpu(), leaves[n].grad[rows], device)
        results[kind] = errs
        worst = max(errs.values())
        lines.append(
            [
                kind,
                *(f"{errs.get(n, float('nan')):.2e}" for n in ("out", "dq", "dk", "dv", "dbeta")),
                "PASS" if worst <= CHECK_TOL else "FAIL",
            ]
        )
    md = (
        f"Backend `{ctx['backend_resolved']}`, fp32 inputs, {world} ranks x {per_rank} tokens, {heads} heads x {dk}; "
        f"layout {[[tuple(p) for p in r] for r in layout]}; max |a - b| / max |b| against the float64 "
        f"per-token reference on the uncut documents (PASS: <= {CHECK_TOL}).\n\n"
        + table(["transition", "out", "dq", "dk", "dv", "dbeta", "result"], lines)
    )
    return md, results


def section_p2p(ctx) -> tuple[str, dict]:
    rank, device, smoke = ctx["rank"], ctx["device"], ctx["smoke"]
    sizes = [2**k for k in range(10, 21 if smoke else 27, 2)]
    one_way = []
    for size in sizes:
        buf = torch.empty(size // 4, dtype=torch.float32, device=device)

        def ping(buf=buf):
            if rank == 0:
                ops = [dist.P2POp(dist.isend, buf, 1)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1)]):
                    w.wait()
            elif rank == 1:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)]):
                    w.wait()
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, 0)]):
                    w.wait()

        one_way.append(median_ms(ping, 5 if smoke else 20, 3, device=device) / 2 / 1e3)
    link = fit_link(sizes, one_way)
    ctx["link"] = link
    rows = [
        [f"{s / 2**10:.0f} KiB", f"{t * 1e6:.1f}", f"{s / t / 2**30:.1f}"] for s, t in zip(sizes, one_way)
    ]
    md = (
        "One-way time of a grouped isend/irecv between ranks 0 and 1 (half the median round trip).\n\n"
        + table(["message", "one-way us", "GiB/s"], rows)
        + f"\n\nFit: latency {link.latency_s * 1e6:.1f} us, bandwidth {link.bandwidth_Bps / 2**30:.1f} GiB/s."
    )
    return md, {
        "sizes": sizes,
        "one_way_s": one_way,
        "latency_s": link.latency_s,
        "bandwidth_Bps": link.bandwidth_Bps,
    }


def _scan_layouts(world: int) -> dict:
    """One document per layout. chunks: rank p -> p + 1; zigzag: DistCA's layout; alternating xN: N pieces
    dealt round-robin over the ranks, a chain of N - 1 real hops (longer chains than the GPUs at hand)."""
    chain = [[(0, r * 100, 100)] for r in range(world)]
    zigzag = [list(p) for p in layout_pieces([100 * world], world_size=world, tokens_per_rank=100)]
    layouts = {"chunks": chain, "zigzag": zigzag}
    for pieces in (8, 16):
        dealt: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        for i in range(pieces):
            dealt[i % world].append((0, i * 100, 100))
        layouts[f"alternating x{pieces}"] = dealt
    return layouts


def section_scan(ctx) -> tuple[str, dict]:
    rank, device, smoke = ctx["rank"], ctx["device"], ctx["smoke"]
    world = dist.get_world_size()
    dim = 16 if smoke else 128
    head_counts = (2, 4) if smoke else (16, 32, 64)
    methods = [("serial", 1), *[("all_scan", b) for b in (2, 4, 8, 16)], ("all_gather", 1)]
    rows, data = [], []
    for layout_name, layout in _scan_layouts(world).items():
        plan = build_scan_plan(layout, rank)
        n_out, n_in = len(plan.out_pieces), len(plan.in_pieces)
        for heads in head_counts:
            for dtype in (torch.float32, torch.bfloat16):
                for kind in ("scalar", "dense"):
                    gen = torch.Generator().manual_seed(rank)
                    states = torch.randn(n_out, heads, dim, dim, generator=gen).to(device, dtype)
                    if kind == "scalar":
                        trans = torch.rand(n_out, heads, generator=gen).to(device, dtype)
                    else:
                        trans = (torch.randn(n_out, heads, dim, dim, generator=gen) / dim).to(device, dtype)
                    grad_in = torch.randn(n_in, heads, dim, dim, generator=gen).to(device, dtype)
                    state_mb = heads * dim * dim * torch.finfo(dtype).bits / 8 / 2**20
                    cells = []
                    for method, blocks in methods:
                        spec = ScanSpec(plan, kind, method, blocks)
                        entering = scan_forward(trans, states, spec)
                        iters = 5 if smoke else 15
                        fwd = median_ms(partial(scan_forward, trans, states, spec), iters, 2, device=device)
                        bwd = median_ms(
                            partial(scan_backward, trans, entering, grad_in, spec),
                            iters,
                            2,
                            device=device,
                        )
                        cells.append(f"{fwd:.3f} / {bwd:.3f}")
                        data.append(
                            dict(
                                layout=layout_name,
                                heads=heads,
                                dtype=str(dtype),
                                kind=kind,
                                method=method,
                                blocks=blocks,
                                forward_ms=fwd,
                                backward_ms=bwd,
                                state_mib=state_mb,
                            )
                        )
                    rows.append(
                        [
                            layout_name,
                            heads,
                            str(dtype).replace("torch.", ""),
                            kind,
                            f"{state_mb:.1f}",
                            *cells,
                        ]
                    )
    header = ["layout", "heads", "dtype", "transition", "state MiB"] + [
        "serial" if m == "serial" else ("all-gather" if m == "all_gather" else f"All-Scan B={b}")
        for m, b in methods
    ]
    md = (
        f"Scan of one document cut over {world} ranks (chunks: rank p -> p + 1, {world - 1} edge(s); zigzag: "
        f"DistCA's layout, rank 0 -> 1 -> ... -> 0, {2 * (world - 1)} edges; alternating xN: N pieces dealt "
        "round-robin over the ranks, N - 1 hops, each a real transfer), state heads x "
        f"{dim} x {dim}; cells: forward / backward ms (median, max over ranks).\n\n" + table(header, rows)
    )
    return md, {"rows": data}


def section_layer(ctx) -> tuple[str, dict]:
    rank, device, smoke = ctx["rank"], ctx["device"], ctx["smoke"]
    world = dist.get_world_size()
    per_rank = 512 if smoke else 32768
    heads, dim = (2, 16) if smoke else (16, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    doc = per_rank // 4
    layouts = {
        "whole (4 docs per rank)": [[(4 * r + i, 0, doc) for i in range(4)] for r in range(world)],
        "cut (chunks)": [[(0, r * per_rank, per_rank)] for r in range(world)],
        "cut (zigzag)": [
            list(p) for p in layout_pieces([per_rank * world], world_size=world, tokens_per_rank=per_rank)
        ],
    }
    rows, data = [], []
    for kind in ("const", "delta"):
        inputs = random_inputs(kind, per_rank, heads, dim, dim, 2 + rank, device, dtype)
        for name, layout in layouts.items():
            for scan in ("all_scan", "serial", "all_gather"):
                if name.startswith("whole") and scan != "all_scan":
                    continue
                config = LinearSPConfig(backend=ctx["backend"], scan=scan, num_blocks=8)
                leaves = {
                    n: (x.detach().requires_grad_(n in ("q", "k", "v")) if x is not None else None)
                    for n, x in inputs.items()
                }

                def step(leaves=leaves, layout=layout, config=config):
                    sp_attention(leaves, layout, rank, config).backward(leaves["w"])

                ms = median_ms(step, 3 if smoke else 10, 2, device=device)
                rows.append([kind, name, scan, f"{ms:.2f}"])
                data.append(dict(kind=kind, layout=name, scan=scan, fwd_bwd_ms=ms))
        cu = list(range(0, per_rank + 1, doc))
        leaves = {
            n: (x.detach().requires_grad_(n in ("q", "k", "v")) if x is not None else None)
            for n, x in inputs.items()
        }

        def local_only(leaves=leaves, cu=cu):
            out, _ = recurrence(
                leaves["q"],
                leaves["k"],
                leaves["v"],
                cu_seqlens=cu,
                log_decay=leaves["g"],
                beta=leaves["beta"],
                backend=ctx["backend"],
            )
            out.backward(leaves["w"])

        ms = median_ms(local_only, 3 if smoke else 10, 2, device=device)
        rows.append([kind, "kernel alone (4 docs)", "-", f"{ms:.2f}"])
        data.append(dict(kind=kind, layout="kernel alone", scan="-", fwd_bwd_ms=ms))
    md = (
        f"`linear_attention` forward+backward, {world} ranks x {per_rank} tokens, {heads} heads x {dim}, "
        f"{str(dtype).replace('torch.', '')}, backend `{ctx['backend_resolved']}`; const = per-head constant decay "
        "(lightning), delta = gated delta rule (dense transition). ms, median, max over ranks.\n\n"
        + table(["transition", "layout", "scan", "fwd+bwd ms"], rows)
    )
    return md, {"rows": data}


def section_model(ctx) -> tuple[str, dict]:
    from transformers import AutoModelForCausalLM, MiniMaxConfig

    import hf_distca
    from hf_distca.data import DistCABatches
    from hf_distca.linear.layers import enable_linear_attention_sp

    rank, device, smoke = ctx["rank"], ctx["device"], ctx["smoke"]
    world = dist.get_world_size()
    per_rank = 256 if smoke else 16384
    if smoke:
        shape = dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
        )
        layers, vocab = 4, 256
    else:
        shape = dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        )
        layers, vocab = 8, 32000
    layer_types = [
        "full_attention" if (i + 1) % 8 == 0 or (smoke and i == layers - 1) else "linear_attention"
        for i in range(layers)
    ]
    config = MiniMaxConfig(
        vocab_size=vocab,
        num_hidden_layers=layers,
        layer_types=layer_types,
        num_local_experts=1,
        num_experts_per_tok=1,
        max_position_embeddings=per_rank * world,
        use_cache=False,
        block_size=256,
        **shape,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:  # initialise on the GPU directly
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="distca", experts_implementation="eager"
        )
    model = model.to(dtype=dtype)
    hf_distca.enable_distca(model, group=None)
    enable_linear_attention_sp(model, group=None, config=LinearSPConfig(backend=ctx["backend"]))
    gen = torch.Generator().manual_seed(3)
    rows, data = [], []
    for name, doc_len in (
        ("whole (docs of tokens_per_rank / 4)", per_rank // 4),
        ("cut (docs of 2 x tokens_per_rank)", 2 * per_rank),
    ):
        docs = [
            torch.randint(0, vocab, (doc_len,), generator=gen).tolist()
            for _ in range(per_rank * world // doc_len)
        ]
        batches = DistCABatches(docs, rank=rank, world_size=world, tokens_per_rank=per_rank)
        batch = batches.micro_batch(docs)
        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
        targets = sum(len(d) - 1 for d in docs)
        cut = build_scan_plan(batch["distca_layout"].all_pieces, rank).has_edges

        def step(batch=batch, targets=targets):
            model.zero_grad(set_to_none=True)
            out = model(**batch, num_items_in_batch=targets)
            out.loss.backward()
            return out.loss

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss = float(step().detach())
        ms = median_ms(step, 2 if smoke else 5, 1, device=device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        rows.append([name, "yes" if cut else "no", f"{loss:.4f}", f"{ms:.1f}", f"{peak:.1f}"])
        data.append(dict(layout=name, documents_cut=cut, loss=loss, step_ms=ms, peak_gib=peak))
    md = (
        f"MiniMax-shaped hybrid from its config (random init): {layers} layers ({layer_types.count('linear_attention')} "
        f"lightning + {layer_types.count('full_attention')} softmax), hidden {shape['hidden_size']}, "
        f"{shape['num_attention_heads']} heads x {shape['head_dim']}, 1 expert (dense MLP {shape['intermediate_size']}), "
        f"vocabulary {vocab}, {str(dtype).replace('torch.', '')}; {world} ranks x {per_rank} tokens; softmax layers "
        "through attn_implementation='distca', lightning layers through All-Scan (8 blocks). Forward+backward "
        "(no optimizer), ms, median, max over ranks; the same token count per rank in both rows.\n\n"
        + table(["documents", "cut over ranks", "loss (rank share)", "step ms", "peak GiB (rank 0)"], rows)
    )
    return md, {"rows": data}


def section_simulate(ctx) -> tuple[str, dict]:
    link = ctx.get("link") or PointToPointLink(
        latency_s=ctx["args"].link_latency_us * 1e-6, bandwidth_Bps=ctx["args"].link_gibps * 2**30
    )
    dim = 128
    rows, data = [], []
    for heads, dtype_name, elem in ((16, "fp32", 4), (64, "bf16", 2), (64, "fp32", 4)):
        state = heads * dim * dim * elem
        for kind, trans in (("scalar", heads * elem), ("dense", heads * dim * dim * elem)):
            for ranks in (2, 4, 8, 16, 32, 64, 128, 256):
                cells = []
                for layout, edges in (("chunks", ranks - 1), ("zigzag", 2 * (ranks - 1))):
                    b = best_blocks(edges, state, link, dim)
                    chain = dict(
                        edges=edges, ranks=ranks, state_bytes=state, transition_bytes=trans, link=link
                    )
                    times = {
                        "serial": chain_scan_time("serial", **chain),
                        "all_scan": chain_scan_time("all_scan", **chain, num_blocks=b),
                        "all_gather": chain_scan_time("all_gather", **chain),
                    }
                    cells += [
                        f"{times['serial'] * 1e3:.2f}",
                        f"{times['all_scan'] * 1e3:.2f} (B={b})",
                        f"{times['all_gather'] * 1e3:.2f}",
                    ]
                    data.append(
                        dict(
                            heads=heads,
                            dtype=dtype_name,
                            kind=kind,
                            ranks=ranks,
                            layout=layout,
                            blocks=b,
                            **{k + "_s": v for k, v in times.items()},
                        )
                    )
                rows.append([f"{heads} x {dim} x {dim} {dtype_name}", kind, ranks, *cells])
    md = (
        f"Simulated scan time (one direction, ms) of one document cut over P ranks, from the measured link "
        f"(latency {link.latency_s * 1e6:.1f} us, bandwidth {link.bandwidth_Bps / 2**30:.1f} GiB/s) with "
        "`hf_distca.linear.simulate` (alpha-beta model; all-gather as a ring; All-Scan with its best block count). "
        "The link between every pair is assumed equal to the measured one (one NVLink pair); across nodes use the "
        "NIC's figures (`--link-latency-us`, `--link-gibps` with `--sections simulate`).\n\n"
        + table(
            [
                "state",
                "transition",
                "P",
                "chunks serial",
                "chunks All-Scan",
                "chunks all-gather",
                "zigzag serial",
                "zigzag All-Scan",
                "zigzag all-gather",
            ],
            rows,
        )
    )
    return md, {"rows": data, "latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps}


# ------------------------------------------------------------------------------------------------ main
# section name -> the function that runs it (section_<name>), in report order
SECTIONS = {
    run.__name__.removeprefix("section_"): run
    for run in (section_check, section_p2p, section_scan, section_layer, section_model, section_simulate)
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (linear_sp.md, linear_sp.json)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--backend", choices=LINEAR_BACKENDS, default="auto")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {tuple(SECTIONS)}"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes: test the script, not the machine")
    p.add_argument(
        "--link-latency-us", type=float, default=10.0, help="simulate without the p2p section: latency"
    )
    p.add_argument("--link-gibps", type=float, default=25.0, help="simulate without the p2p section: GiB/s")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {tuple(SECTIONS)}")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_process_group("nccl" if use_cuda else "gloo")  # NCCL: bound to LOCAL_RANK's GPU
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.all_reduce(torch.zeros(1, device=device))  # communicators up before any point-to-point op
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("run with at least 2 processes (torchrun --nproc-per-node 2 ...)")
    from hf_distca.linear.ops.local import resolve_linear_backend

    # the concrete backend per transition ('auto' on a Hopper GPU with Triton 3.4-3.7.0: chunked for delta)
    resolved = ", ".join(
        f"{kind}: {resolve_linear_backend(args.backend, device, kind=kind)}"
        for kind in ("const", "vector", "delta", "kda")
    )
    ctx = dict(
        rank=rank, device=device, smoke=args.smoke, backend=args.backend, backend_resolved=resolved, args=args
    )
    os.makedirs(args.out, exist_ok=True)
    md_path, json_path = os.path.join(args.out, "linear_sp.md"), os.path.join(args.out, "linear_sp.json")
    import transformers

    gpu = torch.cuda.get_device_name() if use_cuda else platform.processor() or "CPU"
    fla_version = "not installed"
    if fla_available():
        import importlib.metadata

        try:
            fla_version = importlib.metadata.version("fla-core")
        except importlib.metadata.PackageNotFoundError:
            fla_version = "importable"
    header = (
        f"# Sequence-parallel linear attention ({world} x {gpu})\n\n"
        f"torch {torch.__version__}, transformers {transformers.__version__}, fla-core {fla_version}, "
        f"Python {sys.version.split()[0]}; local kernel backend `{resolved}`.\n\n"
        f"Command: `torchrun --nproc-per-node {world} -m benchmarks.bench_linear_sp {' '.join(sys.argv[1:])}`\n"
    )
    report, results = [header], {}
    for name in sections:
        start = time.perf_counter()
        try:
            md, res = SECTIONS[name](ctx)
        except Exception as exc:  # a section that fails on every rank alike: report it, run the next one
            traceback.print_exc()
            md, res = f"FAILED on rank {rank}: `{type(exc).__name__}: {exc}`", {"error": repr(exc)}
        took = time.perf_counter() - start
        results[name] = res
        report.append(f"## {name}\n\n{md}\n\n({took:.1f} s)\n")
        if rank == 0:
            print(f"== {name} ({took:.1f} s)\n{md}\n", flush=True)
            with open(md_path, "w") as f:
                f.write("\n".join(report))
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
