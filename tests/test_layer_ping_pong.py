"""Layer-level ping-pong (DistCAConfig.layer_ping_pong): two nano-batches through the model as coroutines.

- The split (no processes): whole documents, estimated cost (tokens and attention pairs) as equal as
  most-expensive-first allows, None when a nano-batch would be empty; the data path lays each nano-batch
  out on its own, at its own tokens per rank (the fewest that hold it).
- The scheduler (one process): turns alternate at switches in a fixed order; a failure in one nano-batch
  stops the other and is raised, without hanging.
- On 2 and 4 gloo processes (one spawn each): a tiny Llama's micro-batch split into two nano-batches by the data path;
  the interleaved forwards' combined loss and every parameter gradient equal the two nano-batches run one
  after the other and the single-process oracle (the whole batch packed in one process, fp32), with no
  checkpointing, plain recompute and rematerialization-aware checkpointing (which runs no attention
  forward in backward); the engine's bytes and kernel runs equal the serial run's; and the stages ran in
  the interleaved order in forward AND backward (the chain of engine nodes): nano-batch A's dispatch is in
  flight while B computes, and so on (the exact sequence is the simulator's schedule,
  benchmarks/sim/schedule.py's layer_ping_pong: what benchmarks/simulate.py times is what the engine runs).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from distributed import run_distributed
from test_engine_remat import (
    LAYERS,
    MODES,
    assert_grads_close,
    docs_of,
    grads_of,
    summed_over_ranks,
    tiny_llama,
    with_mode,
)
from tolerances import TOL
from transformers import DataCollatorWithFlattening, MixtralConfig, MixtralForCausalLM

from benchmarks.sim.schedule import layer_ping_pong
from hf_distca import DistCAConfig, enable_distca, metrics, nano_batch_loss
from hf_distca.data import DistCABatches
from hf_distca.data.baselines import LAYOUTS
from hf_distca.data.nano import NANO_BATCHES, nano_tokens_per_rank, split_documents
from hf_distca.engine import interleave
from hf_distca.engine.pricing import decoder_layer_weights
from hf_distca.planning.cost import LINEAR_PAIRS_PER_TOKEN, causal_pairs

LENGTHS = [150, 40, 25, 9, 31, 60, 70]
TOKENS_PER_RANK = 256


# ------------------------------------------------------------------------------------ the split
def test_enable_distca_derives_the_layer_seconds_from_the_decoder_layer():
    """Under layer_ping_pong with layer_seconds_per_token None, the runtime's config gets it from the first
    decoder layer's matmul weights (q, k, v, o, gate, up, down: counted by hand here) at layer_tflops,
    ZeRO-3-partitioned weights by their full ``ds_shape``; a given value is kept, and without layer_ping_pong
    nothing is derived. Where nothing can be derived (no decoder layer list, mixture-of-experts layers) it
    stays None, with a warning."""
    model = tiny_llama()
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    weights = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    assert decoder_layer_weights(model) == weights
    runtime = enable_distca(model, config=DistCAConfig(layer_ping_pong=True, layer_tflops=100.0))
    assert runtime.config.layer_seconds_per_token == pytest.approx(4 * 2 * weights / 100e12, rel=1e-12)
    given = DistCAConfig(layer_ping_pong=True, layer_seconds_per_token=1e-6)
    assert enable_distca(model, config=given).config == given
    assert enable_distca(model, config=DistCAConfig()).config == DistCAConfig()
    for p in model.model.layers[0].parameters():  # as ZeRO-3 leaves them: empty, the full shape aside
        p.ds_shape, p.data = p.shape, p.data.new_empty(0)
    assert decoder_layer_weights(model) == weights

    moe = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64)  # fmt: skip
    for other in (torch.nn.Linear(2, 2), MixtralForCausalLM(moe)):
        assert decoder_layer_weights(other) is None
        with pytest.warns(UserWarning, match="could not be derived"):
            runtime = enable_distca(other, config=DistCAConfig(layer_ping_pong=True))
        assert runtime.config.layer_seconds_per_token is None
    with pytest.raises(ValueError, match="layer_tflops must be a positive finite number"):
        DistCAConfig(layer_tflops=0.0)


def test_split_documents_whole_and_even_cost():
    groups = split_documents([150, 40, 25, 9, 31, 60], 2)
    assert groups == [[0, 3], [1, 2, 4, 5]]  # 159 and 156 tokens: short documents cost about their tokens
    assert sorted(i for g in groups for i in g) == list(range(6))
    # long ones: the estimated cost (LINEAR_PAIRS_PER_TOKEN per token + causal pairs) decides, not tokens
    lengths = [32000, 16000, 16000, 16000]
    groups = split_documents(lengths, 2)
    assert groups == [[0], [1, 2, 3]]  # by tokens it would be [[0, 2], [1, 3]]
    cost = [sum(LINEAR_PAIRS_PER_TOKEN * lengths[i] + causal_pairs(0, lengths[i]) for i in g) for g in groups]
    assert max(cost) / min(cost) < 1.2
    assert split_documents([12000, 300, 5000, 4000, 256, 256, 3000], 2) == [[0], [1, 2, 3, 4, 5, 6]]
    assert split_documents([500], 2) is None  # one document: the micro-batch runs whole
    assert split_documents([3, 3, 3], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_documents([1], 0)


def test_nano_tokens_per_rank_each_its_own():
    """Every nano-batch is laid out at the fewest tokens per rank that hold it, ceil(its tokens / world)."""
    assert nano_tokens_per_rank([[3000, 1000], [500]], 4) == [1000, 125]
    assert nano_tokens_per_rank([[500], [8000]], 4) == [125, 2000]
    assert nano_tokens_per_rank([[32000], [16000, 16000, 16000]], 2) == [16000, 24000]
    assert nano_tokens_per_rank([[5], [4]], 2) == [3, 2]  # rounded up
    assert nano_tokens_per_rank([[0], [4]], 2) == [1, 2]  # a layout needs at least one token per rank
    with pytest.raises(ValueError, match="world must be >= 1"):
        nano_tokens_per_rank([[1]], 0)


def test_one_long_document_pads_no_more_than_its_own_ceiling():
    """One long document dominating the cost sits alone in its nano-batch, the short ones in the other:
    each is laid out at its own tokens per rank, so the micro-batch's padding is at most world - 1 tokens
    per nano-batch (laid out alike, at the larger one's, they would hold 1.5x the tokens here)."""
    world = 4
    lengths = [24000, 1000, 1200, 900, 1500, 800, 1100, 1000, 500]  # 32000 tokens
    groups = split_documents(lengths, 2)
    assert groups == [[0], list(range(1, 9))]
    group_lengths = [[lengths[i] for i in g] for g in groups]
    tokens = nano_tokens_per_rank(group_lengths, world)
    assert tokens == [6000, 2000] and tokens[0] != tokens[1]
    assert sum(tokens) * world == sum(-(-sum(g) // world) * world for g in group_lengths) == 32000
    assert 2 * max(tokens) * world == 1.5 * 32000  # the rule before: every nano-batch at the larger one's
    docs = docs_of(lengths, seed=3)
    batch = DistCABatches(docs, rank=1, world_size=world, tokens_per_rank=8000, nano_batches=2).micro_batch(
        docs
    )
    a, b = batch[NANO_BATCHES]
    assert a["input_ids"].shape == (1, 6000) and b["input_ids"].shape == (1, 2000)
    assert batch["input_ids"].shape == batch["labels"].shape == (1, 8000)
    for nano, t in zip((a, b), tokens, strict=True):
        assert all(sum(n for _, _, n in pieces) == t for pieces in nano["distca_layout"].all_pieces)


def test_loader_lays_out_each_nano_batch():
    docs = docs_of(LENGTHS, seed=1)
    whole = DistCABatches(docs, rank=0, world_size=2, tokens_per_rank=TOKENS_PER_RANK).micro_batch(docs)
    assert NANO_BATCHES not in whole
    batches = [
        DistCABatches(docs, rank=r, world_size=2, tokens_per_rank=TOKENS_PER_RANK, nano_batches=2)
        for r in range(2)
    ]
    split = batches[0].micro_batch(docs)
    a, b = split[NANO_BATCHES]
    groups = split_documents(LENGTHS, 2)
    tokens = nano_tokens_per_rank([[LENGTHS[i] for i in g] for g in groups], 2)
    assert [a["input_ids"].shape, b["input_ids"].shape] == [(1, t) for t in tokens]  # each its own
    assert torch.equal(split["input_ids"], torch.cat([a["input_ids"], b["input_ids"]], dim=1))
    # every document once, whole, in one nano-batch: the pieces of both nano-batches over both ranks
    for nano, group in zip((a, b), groups, strict=True):
        held = {}
        for pieces in nano["distca_layout"].all_pieces:
            for doc, start, n in pieces:
                if doc < len(group):
                    held.setdefault(doc, []).append((start, n))
        assert {group[d]: sum(n for _, n in runs) for d, runs in held.items()} == {
            i: LENGTHS[i] for i in group
        }
    # the Trainer counts targets from shift_labels when present (else labels[..., 1:]): the whole one's count
    assert torch.equal(split["shift_labels"], split["labels"])
    # targets: the same count as the micro-batch laid out whole
    targets = sum(int((bt.micro_batch(docs)["labels"] != -100).sum()) for bt in batches)
    assert targets == sum(n - 1 for n in LENGTHS)


def test_loader_lays_a_whole_micro_batch_out_tight_without_padding_to_the_budget():
    """DistCABatches (pad_to_budget=False, the default): a micro-batch that runs whole is laid out at its own
    fewest tokens per rank (as a nano-batch), with the same documents and targets as when padded to the
    budget (pad_to_budget=True)."""
    world, lengths = 4, [3000, 1000, 1200, 900]  # 6100 tokens against a budget of 4 x 2048
    docs = docs_of(lengths, seed=2)
    padded = [
        DistCABatches(docs, rank=r, world_size=world, tokens_per_rank=2048, pad_to_budget=True)
        for r in range(world)
    ]
    tight = [
        DistCABatches(docs, rank=r, world_size=world, tokens_per_rank=2048) for r in range(world)
    ]  # default
    (fewest,) = nano_tokens_per_rank([lengths], world)
    assert fewest == 1525 < 2048
    targets = {"padded": 0, "tight": 0}
    for p, t in zip(padded, tight, strict=True):
        a, b = p.micro_batch(docs), t.micro_batch(docs)
        assert a["input_ids"].shape == (1, 2048) and b["input_ids"].shape == (1, fewest)
        targets["padded"] += int((a["labels"] != -100).sum())
        targets["tight"] += int((b["labels"] != -100).sum())
    assert targets["padded"] == targets["tight"] == sum(n - 1 for n in lengths)
    # a micro-batch over the budget is refused, padded or not (the sampler never builds one)
    for pad in (True, False):
        loader = DistCABatches(docs, rank=0, world_size=2, tokens_per_rank=2048, pad_to_budget=pad)
        with pytest.raises(ValueError, match="exceeds the budget of 2 ranks x 2048 tokens"):
            loader.micro_batch(docs)
    # Transformers' packing (hf-default) fills rows of the budget whatever pad_to_budget
    hf = DistCABatches(docs, rank=0, world_size=world, tokens_per_rank=2048, layout=LAYOUTS["hf-default"])
    assert hf.micro_batch(docs)["input_ids"].shape == (1, 2048)
    with pytest.raises(ValueError, match="pad_to_budget must be True or False"):
        DistCAConfig(pad_to_budget="yes")
    held = {}
    for pieces in tight[0].micro_batch(docs)["distca_layout"].all_pieces:
        assert sum(n for _, _, n in pieces) == fewest
        for doc, _, n in pieces:
            if doc < len(lengths):
                held[doc] = held.get(doc, 0) + n
    assert held == dict(enumerate(lengths))  # every document once, whole over the ranks
    # the same rule without disaggregation (attention local to each piece): the same data path
    plain = DistCABatches(docs, rank=0, world_size=world, tokens_per_rank=2048, disaggregate=False)
    assert plain.micro_batch(docs)["input_ids"].shape == (1, fewest)


# ------------------------------------------------------------------------------------ the scheduler
def test_interleave_turns_and_failures():
    log = []

    def nano(name: str, steps: int):
        def run():
            for s in range(steps):
                log.append(f"{name}{s}")
                interleave.switch()
            return name

        return run

    assert interleave.run_interleaved([nano("a", 3), nano("b", 2)]) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a2"]
    assert interleave.current() is None

    def fails():
        interleave.switch()
        raise KeyError("nano-batch B failed")

    ran = []

    def keeps_going():
        for s in range(5):
            ran.append(s)
            interleave.switch()

    with pytest.raises(KeyError, match="nano-batch B failed"):
        interleave.run_interleaved([keeps_going, fails])
    assert ran == [0, 1]  # stopped at its next switch after B failed
    assert threading.active_count() == 1 or all(
        not t.name.startswith("distca-nano") for t in threading.enumerate()
    )


def test_nano_batches_refused_by_a_plain_forward():
    docs = docs_of(LENGTHS, seed=1)
    batch = DistCABatches(
        docs, rank=0, world_size=1, tokens_per_rank=sum(LENGTHS), nano_batches=2
    ).micro_batch(docs)
    model = tiny_llama()
    enable_distca(model, config=DistCAConfig(shard_tokens=8, backend="reference"))
    with pytest.raises(ValueError, match="nano_batch_loss"):
        model(**batch)


# ------------------------------------------------------------------------------------ 2 processes
ENGINE_STAGES = {
    ("start", "fwd.dispatch"): "dispatch",
    ("compute", "kernel", "fwd"): "compute",
    ("start", "fwd.return"): "return_outputs",
    ("wait", "fwd.return"): "gather_outputs",
    ("start", "bwd.dispatch"): "dispatch_backward",
    ("compute", "kernel", "bwd"): "compute_backward",
    ("start", "bwd.return"): "return_grads",
    ("wait", "bwd.return"): "gather_grads",
}
"""The engine stage (hf_distca/engine/layer_op.py) each operation of the simulator's schedule stands for;
the other operations (layer work, waits for a dispatch) have none."""


def _expected_stages(layers: int) -> tuple[list[str], list[str]]:
    """The stages' order in forward and backward as the simulator's schedule
    (benchmarks/sim/schedule.py's layer_ping_pong) has it, ``stage.<nano><layer>`` with nano-batch 0 as A:
    the engine must run exactly this order, so the simulator times what the engine does."""
    fwd, bwd = [], []
    for op in layer_ping_pong(layers):
        key = (op.kind, op.name, op.pass_) if op.kind == "compute" else (op.kind, op.name)
        stage = ENGINE_STAGES.get(key)
        if stage is not None:
            (bwd if op.pass_ == "bwd" else fwd).append(f"{stage}.{'AB'[op.nano]}{op.layer}")
    return fwd, bwd


def _case(rank: int, world: int, device: str = "cpu", relay: bool = False) -> dict:
    from hf_distca.engine import stages

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on GPU 0
    base = tiny_llama(seed=7).to(device)
    docs = docs_of(LENGTHS, seed=11)
    loader = DistCABatches(docs, rank=rank, world_size=world, tokens_per_rank=TOKENS_PER_RANK, nano_batches=2)
    batch = send_to_device(loader.micro_batch(docs), device)
    n_targets = sum(n - 1 for n in LENGTHS)
    config = DistCAConfig(shard_tokens=8, tolerance=0.0, backend="reference", layer_ping_pong=True)
    if relay:  # KV through the relay, nodes of 2 ranks
        config = dataclasses.replace(config, ranks_per_node=2, kv_relay=True)
    runs = {}
    for mode in MODES:
        for schedule in ("interleaved", "serial"):
            model = with_mode(base, mode)
            enable_distca(model, group=dist.group.WORLD, config=config)
            metrics.reset()
            log: list = []
            originals: dict = {}
            if schedule == "interleaved":
                _wrap_stages(stages, originals, log)
                try:
                    loss = nano_batch_loss(model, batch, num_items_in_batch=n_targets)
                    loss.backward()
                finally:
                    for name, fn in originals.items():
                        setattr(stages, name, fn)
            else:  # the same nano-batches one after the other, through the engine's usual operator
                loss = sum(model(**nano, num_items_in_batch=n_targets).loss for nano in batch[NANO_BATCHES])
                loss.backward()
            run = summed_over_ranks(model, loss)
            run["grads"] = {name: g.cpu() for name, g in run["grads"].items()}
            runs[(mode, schedule)] = {**run, "log": log}
    return runs


def _wrap_stages(stages, originals: dict, log: list) -> None:
    """Log every stage the interleaved nodes (hf_distca/engine/layer_op.py, which call them through the
    stages module) run as (stage, nano-batch) — the nano-batch from the calling thread in
    forward, from the plan (the object each nano-batch's calls share) in backward."""
    nano_of_prep: dict[int, str] = {}

    def wrap(name):
        original = getattr(stages, name)

        def recorded(prep, *args, **kwargs):
            thread = threading.current_thread().name
            if thread.startswith("distca-nano-"):
                nano_of_prep.setdefault(id(prep), "AB"[int(thread.rsplit("-", 1)[1])])
            log.append((name, nano_of_prep[id(prep)]))
            return original(prep, *args, **kwargs)

        originals[name] = original
        setattr(stages, name, recorded)

    for name in (
        "dispatch", "compute", "return_outputs", "gather_outputs",
        "dispatch_backward", "compute_backward", "return_grads", "gather_grads",
    ):  # fmt: skip
        wrap(name)


BACKWARD_STAGES = ("dispatch_backward", "compute_backward", "return_grads", "gather_grads")


def _labelled(log: list) -> list[str]:
    """``stage.<nano><layer>``: the layer counted per (stage, nano-batch) in call order (backward visits
    the layers from the last)."""
    counts: dict[tuple, int] = {}
    out = []
    for name, nano in log:
        seen = counts.get((name, nano), 0)
        counts[(name, nano)] = seen + 1
        out.append(f"{name}.{nano}{LAYERS - 1 - seen if name in BACKWARD_STAGES else seen}")
    return out


def _oracle() -> dict:
    """The whole batch packed in one process (local attention per document), fp32."""
    model = with_mode(tiny_llama(seed=7), "none")
    docs = docs_of(LENGTHS, seed=11)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    loss = model(**batch, use_cache=False, num_items_in_batch=sum(n - 1 for n in LENGTHS)).loss
    loss.backward()
    return {"loss": float(loss.detach()), "grads": grads_of(model)}


@pytest.mark.parametrize(("world", "relay"), [(2, False), (4, True)])
def test_layer_ping_pong_exact_and_interleaved(world, relay):
    """2 ranks with direct exchanges; 4 ranks in 2 nodes with KV through the relay (two stages per KV phase,
    in flight across the other nano-batch's work like one)."""
    results = run_distributed(_case, world, "cpu", relay, timeout=300)
    check_exact_and_interleaved(results)
    for runs in results:  # the relay ran: the phases that carry KV (3 of 4) started two exchanges
        stats = runs[("none", "interleaved")]["stats"]
        assert (stats.exchanges > 4 * stats.calls) == relay, (stats.exchanges, stats.calls)


def check_exact_and_interleaved(results: list[dict]) -> None:
    """Every rank's interleaved and serial runs (``_case``) equal the one-process oracle and each other, and
    the interleaved one ran the engine's stages in the simulator's order."""
    oracle = _oracle()
    fwd, bwd = _expected_stages(LAYERS)
    rtol = TOL["train_loss"][0]
    for rank, runs in enumerate(results):
        for mode in MODES:
            inter, serial = runs[(mode, "interleaved")], runs[(mode, "serial")]
            label = f"rank {rank} {mode}"
            for run in (inter, serial):
                assert abs(run["loss"] - oracle["loss"]) <= rtol * abs(oracle["loss"]), (label, run["loss"])
                assert_grads_close(run["grads"], oracle["grads"], label)
            assert_grads_close(inter["grads"], serial["grads"], label + " vs serial")
            assert inter["stats"].bytes_sent == serial["stats"].bytes_sent > 0, label
            assert inter["stats"].attn_fwd_kernels == serial["stats"].attn_fwd_kernels, label
            if mode == "remat":
                assert inter["stats"].attn_replays == 2 * LAYERS, label  # both nano-batches, every layer
            if mode != "recompute":  # plain recompute re-runs attention through the usual operator
                stages = _labelled(inter["log"])
                half = len(fwd)
                assert stages[:half] == fwd, (label, stages[:half])
                assert stages[half:] == bwd, (label, stages[half:])


# ------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("world", "relay"), [(2, False), (4, True)])
def test_layer_ping_pong_exact_on_cuda_with_ranks_on_one_gpu(world, relay):
    """2 (4, with the KV relay over nodes of 2) gloo processes sharing GPU 0 (CUDA tensors staged through host
    memory; NCCL refuses two ranks on one GPU): the nano-batches' coroutines with their CUDA streams and
    asynchronous exchanges (the relay's second stage started from its side stream) give the one-process
    oracle's loss and gradients and the serial run's, in the simulator's stage order, in every checkpointing
    mode (fp32)."""
    check_exact_and_interleaved(run_distributed(_case, world, "cuda", relay, timeout=300))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_ping_pong_on_cuda_keeps_thread_state():
    """On one GPU, no process group: each nano-batch's thread runs under the caller's autocast, CUDA device
    and stream (checked inside the model), and the interleaved loss and gradients equal the nano-batches
    run one after the other (bf16 under autocast, fp32 weights; the same kernels in the same order)."""
    docs = docs_of(LENGTHS, seed=11)
    batch = DistCABatches(
        docs, rank=0, world_size=1, tokens_per_rank=sum(LENGTHS), nano_batches=2
    ).micro_batch(docs)
    batch = {
        NANO_BATCHES: tuple(
            {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in nano.items()}
            for nano in batch[NANO_BATCHES]
        )
    }
    n_targets = sum(n - 1 for n in LENGTHS)
    stream = torch.cuda.Stream()
    runs = {}
    for schedule in ("interleaved", "serial"):
        model = tiny_llama(seed=7).cuda()
        enable_distca(model, config=DistCAConfig(shard_tokens=8, backend="auto"))
        seen = []
        model.model.layers[0].register_forward_pre_hook(
            lambda *_, seen=seen: seen.append(
                (
                    threading.current_thread().name,
                    torch.is_autocast_enabled("cuda"),
                    torch.cuda.current_stream(),
                )
            )
        )
        with torch.cuda.stream(stream), torch.autocast("cuda", dtype=torch.bfloat16):
            if schedule == "interleaved":
                loss = nano_batch_loss(model, batch, num_items_in_batch=n_targets)
            else:
                loss = sum(model(**nano, num_items_in_batch=n_targets).loss for nano in batch[NANO_BATCHES])
            loss.backward()
        torch.cuda.synchronize()
        runs[schedule] = (float(loss), grads_of(model), seen)
    loss, grads, seen = runs["interleaved"]
    assert [name for name, _, _ in seen] == ["distca-nano-0", "distca-nano-1"]
    assert all(autocast and s == stream for _, autocast, s in seen), seen
    assert abs(loss - runs["serial"][0]) <= TOL["gpu_out"][0] * abs(runs["serial"][0])
    for name, want in runs["serial"][1].items():
        scale = float(want.abs().max())
        torch.testing.assert_close(
            grads[name], want, rtol=TOL["gpu_grad"][0], atol=TOL["gpu_grad"][1] * scale
        )
