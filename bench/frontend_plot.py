"""bench/frontend.py's curves: throughput against API servers (with perfect scaling drawn), and the CPU each
API server spends per request and per streamed token."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_frontend(rows: list[dict], title: str, path: str, targets: dict[str, float]) -> None:
    counts = [row["api_servers"] for row in rows]
    fig, (scale_ax, cpu_ax) = plt.subplots(1, 2, figsize=(12, 4.8))

    for key, label, marker in (("requests_per_s", "requests/s (1-token chat)", "o"),
                               ("tokens_per_s", "streamed tokens/s", "s")):
        base = rows[0][key] / counts[0] if rows[0][key] else 0
        scale_ax.plot(counts, [row[key] / base if base else 0 for row in rows], marker=marker, label=label)
    scale_ax.plot(counts, counts, "k--", alpha=0.5, label="perfect scaling")
    scale_ax.set_xlabel("API servers")
    scale_ax.set_ylabel("throughput / throughput of one")
    scale_ax.set_xticks(counts)
    scale_ax.grid(alpha=0.3)
    scale_ax.legend(fontsize=8)

    cpu_ax.plot(counts, [row["api_cpu_us_per_request"] for row in rows], marker="o", label="us per request")
    cpu_ax.plot(counts, [row["api_cpu_us_per_token"] for row in rows], marker="s",
                label="us per streamed token (paced)")
    cpu_ax.plot(counts, [row["api_cpu_us_per_token_saturated"] for row in rows], marker="^",
                label="us per streamed token (saturated)")
    for key, color, unit in (("us_per_request", "C0", "us/request"), ("us_per_token", "C1", "us/token")):
        if key in targets:
            cpu_ax.axhline(targets[key], linestyle=":", color=color, label=f"target {targets[key]:g} {unit}")
    cpu_ax.set_yscale("log")
    cpu_ax.set_xlabel("API servers")
    cpu_ax.set_ylabel("API-server CPU (microseconds)")
    cpu_ax.set_xticks(counts)
    cpu_ax.grid(alpha=0.3, which="both")
    cpu_ax.legend(fontsize=8)

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
