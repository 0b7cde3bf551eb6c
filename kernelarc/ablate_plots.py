"""The ablation's plots (``python -m kernelarc.ablate``): best-so-far curves per arm and the memory curve.

Takes the runs (:class:`kernelarc.ablate.RunResult`: count, memory, plateau, curve, best_ms) and the summary
rows as plain data, so it imports nothing of the ablation (matplotlib only, loaded here)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any


def _arm(r: Any) -> str:
    mem = "all" if r.memory is None else r.memory
    return f"agents={r.count} memory={mem} plateau={'on' if r.plateau else 'off'}"


def plots(results: list[Any], rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """best_so_far.png (mean champion latency / best known per arm) and memory_curve.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    arms: dict[str, list[Any]] = {}
    for r in results:
        arms.setdefault(_arm(r), []).append(r)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, rs in sorted(arms.items()):
        n = max(len(r.curve) for r in rs)
        mean = []
        for i in range(n):
            vals = [r.curve[min(i, len(r.curve) - 1)] / r.best_ms for r in rs if r.curve]
            vals = [v for v in vals if math.isfinite(v)]
            mean.append(statistics.fmean(vals) if vals else math.nan)
        ax.plot(range(1, n + 1), mean, label=key, lw=1.4)
    paths.append(_save(fig, ax, "candidates evaluated", "champion latency / best known (mean over seeds)",
                       "best so far per arm", 7, out / "best_so_far.png"))  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for count in sorted({r["agents"] for r in rows}):
        for plateau in (True, False):
            pts = [r for r in rows if r["agents"] == count and r["plateau"] is plateau]
            if not pts:
                continue
            pts.sort(key=lambda r: math.inf if r["memory"] is None else r["memory"])
            xs = list(range(len(pts)))
            ax.errorbar(xs, [r["mean"] for r in pts], yerr=[r["std"] / math.sqrt(r["runs"]) for r in pts],
                        marker="o", capsize=3,
                        label=f"agents={count} plateau={'on' if plateau else 'off'}")  # fmt: skip
            ax.set_xticks(xs, ["all" if r["memory"] is None else str(r["memory"]) for r in pts])
    paths.append(_save(fig, ax, "memory.limit (wins and traps shown to each agent)",
                       "final champion latency / best known (mean ± s.e.)", "memory curve", 8,
                       out / "memory_curve.png"))  # fmt: skip
    return paths


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, legend_size: int, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
