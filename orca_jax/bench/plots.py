"""The figure of Orca's experiment: median normalized latency (ms/token) against throughput
(requests/s), one curve per scheduling policy, the SLO latency as a horizontal line.

matplotlib is optional (not an engine dependency): without it the figure is skipped with a
message, and the JSON still carries every number.
"""

from __future__ import annotations

from pathlib import Path

POLICY_STYLE = {
    "iteration": {"label": "iteration-level (Orca)", "marker": "o", "color": "tab:blue"},
    "request": {"label": "request-level (static batching)", "marker": "s", "color": "tab:orange"},
    "request_padded": {"label": "request-level, padded (FasterTransformer)", "marker": "^", "color": "tab:red"},
}


def plot_curves(curves: dict[str, list[dict]], path: str | Path, *, title: str, slo_ms_per_token: float | None = None,
                slo_label: str = "SLO", annotate_rates: bool = True) -> Path | None:
    """Write the figure to `path` (format from its suffix). `curves`: policy -> points with
    "rate", "throughput" (requests/s) and "latency" (median normalized latency, ms/token).
    Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
        return None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, points in curves.items():
        points = sorted(points, key=lambda p: p["rate"])
        style = POLICY_STYLE.get(policy, {"label": policy, "marker": "^", "color": None})
        ax.plot([p["throughput"] for p in points], [p["latency"] for p in points], **style)
        if annotate_rates:
            for p in points:
                ax.annotate(f"{p['rate']:g}", (p["throughput"], p["latency"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=style["color"])
    if slo_ms_per_token is not None:
        ax.axhline(slo_ms_per_token, color="gray", linestyle="--", linewidth=1,
                   label=f"{slo_label}: {slo_ms_per_token:.0f} ms/token")
    latencies = [p["latency"] for points in curves.values() for p in points] + (
        [slo_ms_per_token] if slo_ms_per_token else [])
    if max(latencies) > 10 * min(latencies):
        # Past saturation latency grows by orders of magnitude; a log axis keeps the knee visible.
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.99, 0.01, "point labels: offered arrival rate (req/s)", ha="right", fontsize=7, color="gray")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
