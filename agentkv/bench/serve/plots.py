"""The PNG plots of ``agentkv bench serve`` (matplotlib is optional: no plot without it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .targets import SERVERS

__all__ = ["COLORS", "load_pyplot", "plot", "plot_setups", "save_figure"]

COLORS = {"vanilla": "tab:gray", "agentkv": "tab:blue", "agentkv+warmup": "tab:green"}


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """TTFT (mean, p99 dashed), hit rate and throughput vs arrival rate, one line per server.
    Returns None when matplotlib is not installed."""
    plt = load_pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for server in SERVERS:
        data = sorted((r for r in rows if r["server"] == server), key=lambda r: r["rate"])
        if not data:
            continue
        rates = [r["rate"] for r in data]
        color = COLORS[server]
        axes[0].plot(rates, [r["ttft_mean_ms"] for r in data], "o-", color=color, label=f"{server} mean")
        axes[0].plot(rates, [r["ttft_p99_ms"] for r in data], "o--", color=color, alpha=0.6, label=f"{server} p99")
        axes[1].plot(rates, [100 * r["hit_rate"] for r in data], "o-", color=color, label=server)
        axes[2].plot(rates, [r["throughput"] for r in data], "o-", color=color, label=server)
    for ax, label in zip(axes, ("TTFT (ms)", "prefix-cache hit rate (%)", "throughput (turns/s)"), strict=True):
        ax.set_xlabel("session arrival rate (sessions/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    return save_figure(plt, fig, path, title)


def load_pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, title: str = "") -> Path:
    """Title, lay out, write ``path`` (creating its folder) and close the figure."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_setups(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Bars per setup (single server, then each router policy/key): hit rate, TTFT mean and p99,
    throughput; vanilla and agentkv side by side. Pools rates. None without matplotlib."""
    plt = load_pyplot()
    if plt is None:
        return None
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    metrics = (("hit_rate", "prefix-cache hit rate (%)", 100.0), ("ttft_mean_ms", "TTFT mean (ms)", 1.0),
               ("ttft_p99_ms", "TTFT p99 (ms)", 1.0), ("throughput", "throughput (turns/s)", 1.0))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4.2))
    servers = [s for s in SERVERS if any(r["server"] == s for r in rows)]
    width = 0.8 / len(servers)
    for ax, (key, label, scale) in zip(axes, metrics, strict=True):
        for index, server in enumerate(servers):
            offset = (index - (len(servers) - 1) / 2) * width
            values = []
            for setup in setups:
                mine = [r[key] for r in rows if r["setup"] == setup and r["server"] == server]
                values.append(scale * sum(mine) / len(mine) if mine else 0.0)
            ax.bar([i + offset for i in range(len(setups))], values, width, color=COLORS[server], label=server)
        ax.set_xticks(range(len(setups)), setups, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return save_figure(plt, fig, path, title)
