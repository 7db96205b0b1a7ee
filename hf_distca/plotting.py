"""PNG of per-rank core-attention load before and after balancing, over the training steps."""

from __future__ import annotations

from collections.abc import Sequence


def plot_attention_load(records: Sequence[dict], path: str, *, balanced: bool = True) -> None:
    """records: metrics.jsonl rows (``attn_flops_before``/``attn_flops_after`` per rank).

    ``balanced=False``: a run without disaggregation (its "after" is its own pieces, as "before")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    world = len(records[0]["attn_flops_before"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in (
        (axes[0], "attn_flops_before", "without balancing"),
        (axes[1], "attn_flops_after", "with DistCA" if balanced else "this run (attention local)"),
    ):
        for rank in range(world):
            ax.plot(steps, [r[key][rank] / 1e9 for r in records], marker="o", ms=3, label=f"rank {rank}")
        imb = sum(r[key.replace("attn_flops", "imbalance")] for r in records) / len(records)
        ax.set_title(f"{title} (mean max/mean = {imb:.2f})")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("core-attention forward GFLOP per rank")
    axes[1].legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
