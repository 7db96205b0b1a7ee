"""Plans pinned bit for bit: a fixed set of seeded batches (full causal and windowed, balance-only and
communication-priced, with send and receive bounds, a measured cost table, a shipped H200 table) planned
and hashed. A refactor that changes any plan (a task, a load, a byte count, a critical path) changes a
digest; so does a change of layout_balanced, the balanced64 plans' input."""

from __future__ import annotations

import hashlib
import random

import numpy as np
from oracle import long_tailed_lengths, pack_sequential, scatter

from hf_distca import DistCAConfig, plan_core_attention
from hf_distca.cost_tables import shipped_table_data
from hf_distca.data.rebatch import layout_balanced
from hf_distca.planning import MeasuredCost, attention_flops_per_pair, causal_pairs

Q_ROW, KV_ROW = 64, 48
FLOPS = attention_flops_per_pair(2, 8)


def _layouts() -> list[tuple[str, list]]:
    out = []
    for seed in range(3):
        rng = random.Random(seed)
        lens = [rng.randint(1, 400) for _ in range(12)]
        out.append((f"scatter{seed}", scatter("s", lens, 5, rng, max_pieces=3, spread=(1, 4)).pieces))
        out.append((f"packed{seed}", pack_sequential(lens, 4)))
    lens = long_tailed_lengths(400, np.random.default_rng(7), median=600, hi=20000)
    out.append(("balanced64", layout_balanced(lens, world_size=64, tokens_per_rank=8192, ranks_per_node=8)))
    return out


def _configs() -> list[tuple[str, dict, dict]]:
    priced = dict(link_gib_per_s=1e-3, attention_tflops=1e-3)
    return [
        ("balance", dict(tolerance=0.05, shard_tokens=16), {}),
        ("window", dict(tolerance=0.05, shard_tokens=16), {"window": 64}),
        ("priced", dict(tolerance=0.05, shard_tokens=16, **priced), {}),
        ("priced-nodes", dict(shard_tokens=8, ranks_per_node=2, intra_node_gib_per_s=1e-1, **priced), {}),
        ("priced-window", dict(tolerance=0.1, shard_tokens=16, ranks_per_node=4, **priced), {"window": 96}),
        ("priced-overlap", dict(tolerance=0.0, shard_tokens=4, comm_overlap=0.5, **priced), {}),
        (
            "priced-fast",
            dict(
                tolerance=0.05,
                shard_tokens=16,
                link_gib_per_s=0.3,
                ranks_per_node=8,
                intra_node_gib_per_s=3.0,
                attention_tflops=1e-3,
            ),
            {},
        ),
        ("bounds", dict(shard_tokens=8, max_send_bytes_per_rank=6000, max_recv_bytes_per_server=8000), {}),
    ]


def _measured() -> MeasuredCost:
    lens = [16, 64, 256, 1024, 4096, 16384]
    table = [[1e-9 * causal_pairs(max(k - q, 0), k) + 2e-6 for k in lens] for q in lens]
    return MeasuredCost(lens, lens, table)


SHIPPED = "h200_bf16_32x8x128_torch_varlen.json"
SHIPPED_CONFIGS = [
    ("shipped", dict(tolerance=0.05, shard_tokens=128), {}),
    ("shipped-window", dict(shard_tokens=128), {"window": 4096}),
    (
        "shipped-priced",
        dict(shard_tokens=128, link_gib_per_s=23.3, ranks_per_node=8, intra_node_gib_per_s=260),
        {},
    ),
]
"""A shipped H200 table on the realistic layout, with Llama-3-8B-sized rows (Q 8192, KV 4096 bytes)."""


def _plan_digest(plan) -> str:
    h = hashlib.sha256(plan.digest().encode())
    for value in (plan.load_after, plan.pairs_after, plan.bytes_sent, plan.bytes_received, plan.moves,
                  plan.balance_level, plan.critical_path_before, plan.critical_path_after):  # fmt: skip
        h.update(repr(value).encode())
    return h.hexdigest()[:16]


def digests() -> dict[str, str]:
    out = {}
    for lname, pieces in _layouts():
        for cname, fields, extra in _configs():
            plan = plan_core_attention(
                pieces, q_row_bytes=Q_ROW, kv_row_bytes=KV_ROW, options=DistCAConfig(**fields).planner_options(),
                flops_per_pair=FLOPS, **extra,
            )  # fmt: skip
            out[f"{lname}/{cname}"] = _plan_digest(plan)
        config = DistCAConfig(tolerance=0.05, shard_tokens=16, link_gib_per_s=1e-2)
        plan = plan_core_attention(
            pieces,
            q_row_bytes=Q_ROW,
            kv_row_bytes=KV_ROW,
            options=config.planner_options(),
            cost_model=_measured(),
        )
        out[f"{lname}/measured"] = _plan_digest(plan)
    shipped = MeasuredCost.from_dict(shipped_table_data(SHIPPED), SHIPPED)
    pieces = dict(_layouts())["balanced64"]
    for cname, fields, extra in SHIPPED_CONFIGS:
        plan = plan_core_attention(
            pieces,
            q_row_bytes=8192,
            kv_row_bytes=4096,
            options=DistCAConfig(**fields).planner_options(),
            cost_model=shipped,
            **extra,
        )
        out[f"balanced64/{cname}"] = _plan_digest(plan)
    return out


EXPECTED: dict[str, str] = {
    "scatter0/balance": "b1cc3747ef1d3f1a",
    "scatter0/window": "a8cd9e845a4d2d21",
    "scatter0/priced": "fdb30ba9c7066f50",
    "scatter0/priced-nodes": "48fabd4c006368f2",
    "scatter0/priced-window": "a275865d232533c3",
    "scatter0/priced-overlap": "c5cc66b838598abb",
    "scatter0/priced-fast": "7ca3ec042a047d73",
    "scatter0/bounds": "e12ed4ce358a610c",
    "scatter0/measured": "3120306ab97c33c5",
    "packed0/balance": "f672674b7b42da65",
    "packed0/window": "b867da4a2102ef62",
    "packed0/priced": "1ff08f459d184466",
    "packed0/priced-nodes": "e07876324e12b946",
    "packed0/priced-window": "743941f5f435a159",
    "packed0/priced-overlap": "5ae145a3f6078a96",
    "packed0/priced-fast": "e81682de7d2abe21",
    "packed0/bounds": "fd76cca37465f217",
    "packed0/measured": "63d4a81b0d2f74df",
    "scatter1/balance": "41c0255faea1d0d0",
    "scatter1/window": "ae6ce78abab14f20",
    "scatter1/priced": "ac8784068cbe6cd1",
    "scatter1/priced-nodes": "3665870485c51fce",
    "scatter1/priced-window": "389602f25b682d5f",
    "scatter1/priced-overlap": "449b94238150f84b",
    "scatter1/priced-fast": "a6551df06789ee7b",
    "scatter1/bounds": "0542fc664866deae",
    "scatter1/measured": "9298f99c07a90546",
    "packed1/balance": "d28790a7b0e5515b",
    "packed1/window": "f6b4aadf7c2b57ca",
    "packed1/priced": "492b22b0717bf476",
    "packed1/priced-nodes": "0f53c6be49c66a1f",
    "packed1/priced-window": "4328ea425a9d60d0",
    "packed1/priced-overlap": "c8f8cedaad3f1193",
    "packed1/priced-fast": "1626c3889c333184",
    "packed1/bounds": "f527b6fc8da6211e",
    "packed1/measured": "cff03b7aa4ec9305",
    "scatter2/balance": "a5b29d66cdb1a6dd",
    "scatter2/window": "f280a25fdb599801",
    "scatter2/priced": "1176f9fb57bd29eb",
    "scatter2/priced-nodes": "641ec2f2507a3abe",
    "scatter2/priced-window": "7f348e22615448cf",
    "scatter2/priced-overlap": "d0c4c9708c6d0dac",
    "scatter2/priced-fast": "3d5fce048d9b5c43",
    "scatter2/bounds": "7d87b9c942eb2fa9",
    "scatter2/measured": "fb5a56a9d8715b93",
    "packed2/balance": "311f3c3ec0561544",
    "packed2/window": "a33df92b538994dc",
    "packed2/priced": "e20a9dc42dee883c",
    "packed2/priced-nodes": "adda9635a261b09d",
    "packed2/priced-window": "7943286700b069fa",
    "packed2/priced-overlap": "4a22487574b9cdab",
    "packed2/priced-fast": "be4253a998a9ab8f",
    "packed2/bounds": "598caf60a92bed2a",
    "packed2/measured": "d874b6bc5d5da404",
    "balanced64/balance": "ab35c06656aa18a2",
    "balanced64/window": "70986ec2fa07c6e3",
    "balanced64/priced": "835ea292bb68c4b8",
    "balanced64/priced-nodes": "4df564044cee8ca8",
    "balanced64/priced-window": "635956efa0522e84",
    "balanced64/priced-overlap": "62de274086ec5984",
    "balanced64/priced-fast": "b54dc9de2b40bf9d",
    "balanced64/bounds": "262b2a98afd8d731",
    "balanced64/measured": "81fd321f0fd67ab3",
    "balanced64/shipped": "905e6fe3d7d5e8c6",
    "balanced64/shipped-window": "08965394d1ec938c",
    "balanced64/shipped-priced": "0d8a436d2dd134b6",
}


def test_plans_identical():
    assert digests() == EXPECTED


if __name__ == "__main__":
    import json

    print(json.dumps(digests(), indent=1))
