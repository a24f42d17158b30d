"""The latency distributions of one or more serve.py runs, drawn as CDFs side by side in one PNG."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PANELS = (
    ("ttft_ms", "time to first token (ms)"),
    ("tpot_ms", "time per output token (ms)"),
    ("itl_ms", "inter-token latency (ms)"),
    ("e2e_ms", "end-to-end latency (ms)"),
)


def plot_latency_cdfs(runs: list[tuple[str, dict[str, list[float]]]], title: str, path: str) -> None:
    """`runs`: (label, samples by metric, in ms) for each server measured."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (metric, label) in zip(axes.flat, PANELS):
        tails = []
        for run_label, samples in runs:
            values = np.sort(np.asarray(samples.get(metric) or []))
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=run_label)
                tails.append(np.percentile(values, 99.5))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if metric != "itl_ms" else "fraction of tokens")
        ax.grid(alpha=0.3)
        if metric == "itl_ms" and tails:
            ax.set_xlim(0, max(tails) * 1.05)  # a few stalls would squash the curve: the last 0.5% is off the edge
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
